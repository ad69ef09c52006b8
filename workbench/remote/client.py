"""`RemoteEngineClient`: the engine interface over an OpenAI-compatible HTTP server (see the
package docstring for how each part is built).

What the server reports about itself (settings per dialect, metrics) is `reports.py`; the
dialects of its requests and answers `wire.py`; Prometheus parsing `prometheus.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import secrets
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from ..errors import EngineConnectError, EngineDeadError, WorkbenchIPCError
from ..events import METRICS_EVERY_S, Event, EventSubscription
from ..interface import Engine, closed_at_exit, deliver, request_ids
from ..outputs import RequestOutput, StreamChunk
from ..sampling_params import SamplingParams
from ..timeline import Timeline, TimelineRecorder, prompt_label
from .answer import DONE, StreamedAnswer, sse_object
from .prometheus import parse_prometheus
from .reports import metrics_of, server_settings
from .wire import (
    EXTRA_FIELDS,
    TOKEN_ID_KINDS,
    RemoteSettingsError,
    detect_kind,
    error_message,
    http_error,
    request_body,
    split_url,
    transport_error,
)

__all__ = ["RemoteEngineClient"]

log = logging.getLogger("workbench.remote")

ENV_API_KEYS = ("WORKBENCH_API_KEY", "OPENAI_API_KEY")
_RECENT = 1000  # finished requests kept for the latency percentiles
_clients = closed_at_exit()  # closed at exit (their loop threads are daemons)


class _Pending:
    __slots__ = ("future", "arrival", "first")

    def __init__(self, future, arrival: float):
        self.future = future
        self.arrival = arrival
        self.first: float | None = None


class RemoteEngineClient(Engine):
    """An OpenAI-compatible server as an `Engine` (settings read-only). Thread-safe."""

    rpc_timeout: float = 30.0

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = 10.0,
        request_timeout: float | None = 600.0,
        name: str | None = None,
        max_connections: int = 512,
    ):
        """`name`: what `.name` reports (default: the URL; a registered remote's engine name)."""
        base, query_model = split_url(url)
        self.base = base
        self.api_base = base + "/v1"
        self.url = base
        self.name = name or base
        self.pid = None
        self.process = None
        self.info = None
        self.connection_file = None
        self.log_file = None
        self.remote = True
        self.read_only = True
        self._api_key = api_key or next((os.environ[k] for k in ENV_API_KEYS if os.environ.get(k)), None)
        self._lock = threading.Lock()
        self._closed = False
        self._dead: BaseException | None = None
        self._pending: dict[str, _Pending] = {}
        self._recorder = TimelineRecorder(capacity=20_000)
        self._recent: deque[RequestOutput] = deque(maxlen=_RECENT)
        self._totals = {"prompt_tokens": 0, "output_tokens": 0, "finished": 0}
        self._subs: list[EventSubscription] = []
        self._ticker: concurrent.futures.Future | None = None
        self._last_scrape: tuple[float, int] | None = None  # (time, server's generation tokens)
        self._warned: set[str] = set()
        self._connected_at = time.monotonic()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"wb-remote-{self.name}", daemon=True)
        self._thread.start()
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=min(64, max_connections))
        http_timeout = httpx.Timeout(timeout, read=request_timeout, pool=None)

        async def make_client():
            return httpx.AsyncClient(
                base_url=self.base, headers=headers, timeout=http_timeout, limits=limits, trust_env=False
            )

        self._http: httpx.AsyncClient = self._run(make_client(), timeout)
        try:
            self._handshake(query_model or model, timeout)
        except BaseException:
            self.close()
            raise
        _clients.add(self)

    @classmethod
    def connect(cls, url: str, *, timeout: float = 10.0, **kwargs) -> RemoteEngineClient:
        return cls(url, timeout=timeout, **kwargs)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "dead" if self._dead else "connected"
        return f"<RemoteEngineClient {self.base} {self.kind} model={self.model!r} {state}>"

    def __enter__(self) -> RemoteEngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return not self._closed and self._dead is None

    # -- plumbing -------------------------------------------------------------------------------
    def _run(self, coro, timeout: float | None = None):
        if self._closed and self._loop.is_closed():
            raise WorkbenchIPCError(f"this client of {self.base} is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"{self.base} did not answer within {timeout}s") from None

    async def _get_json(self, path: str, *, auth_errors: bool = True) -> Any:
        try:
            resp = await self._http.get(path)
        except httpx.HTTPError as e:
            raise transport_error(self.base, e) from None
        if resp.status_code >= 400:
            raise http_error(resp.status_code, resp.content, self.base)
        return resp.json()

    async def _get_text(self, path: str) -> str | None:
        """A GET that may legitimately be absent (404 and the like -> None)."""
        try:
            resp = await self._http.get(path)
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    def _handshake(self, model: str | None, timeout: float) -> None:
        async def hello():
            try:
                resp = await self._http.get("/v1/models")
            except httpx.HTTPError as e:
                raise EngineConnectError(f"no OpenAI-compatible server answered at {self.base}: {e}") from None
            if resp.status_code in (401, 403):
                raise PermissionError(
                    f"{self.base} refused the API key (HTTP {resp.status_code}); pass api_key= or "
                    f"set ${ENV_API_KEYS[0]}"
                )
            if resp.status_code >= 400:
                raise EngineConnectError(
                    f"{self.base}/v1/models answered HTTP {resp.status_code}: {error_message(resp.content)}"
                )
            try:
                models = resp.json().get("data") or []
            except ValueError:
                raise EngineConnectError(f"{self.base}/v1/models is not the OpenAI API (not JSON)") from None
            metrics_text = await self._get_text("/metrics")
            return models, metrics_text, resp.headers.get("server", "")

        models, metrics_text, server_header = self._run(hello(), timeout)
        ids = [m.get("id") for m in models if isinstance(m, dict) and m.get("id")]
        if model is None:
            if not ids:
                raise EngineConnectError(f"{self.base} serves no model (/v1/models is empty)")
            model = ids[0]
        elif ids and model not in ids:
            raise ValueError(f"{self.base} does not serve model {model!r}; it serves {', '.join(ids)}")
        self.model = model
        self.models = ids
        card = next((m for m in models if isinstance(m, dict) and m.get("id") == model), {})
        samples = {}
        if metrics_text is not None:
            try:
                samples = parse_prometheus(metrics_text)
            except Exception:  # not Prometheus text: treat as absent
                metrics_text = None
        self.has_metrics = metrics_text is not None and bool(samples)
        self.kind = detect_kind(card, samples, server_header)
        self.max_model_len = card.get("max_model_len")
        self._extra = EXTRA_FIELDS.get(self.kind, {})
        self._token_ids = self.kind in TOKEN_ID_KINDS
        self._usage_in_stream = self.kind != "llama-cpp-python"
        self._remote_status: dict = {}
        self.engine_info = {**self._run(self._astatus(), timeout), "settings": {}}
        log.info("connected to %s (%s, model %r, metrics: %s)", self.base, self.kind, model, self.has_metrics)

    # -- settings, status, metrics, timeline ----------------------------------------------------
    def configure(self, **changes: Any) -> dict:
        names = ", ".join(sorted(changes)) or "(none given)"
        raise RemoteSettingsError(
            f"settings of the remote {self.kind} server at {self.base} cannot be changed from here ({names}); "
            "restart that server with the settings you want. settings() shows what it reports (read-only)."
        )

    def settings(self) -> dict:
        """What the server reports about itself, under our setting names (read-only)."""
        return self._run(self._asettings(), self.rpc_timeout)

    async def _asettings(self) -> dict:
        return await server_settings(self)

    async def asettings(self) -> dict:
        return await self._on_loop(self._asettings())

    def schema(self) -> list[dict]:
        """Our settings schema for the settings this server reports, each marked read-only."""
        from ..settings import schema

        reported = self.settings()
        return [
            {**e, "kind": "read-only", "read_only": True, "engine_kind": e["kind"], "value": reported[e["name"]]}
            for e in schema()
            if e["name"] in reported
        ]

    def status(self) -> dict:
        return self._run(self._astatus(), self.rpc_timeout)

    async def _astatus(self) -> dict:
        if self.kind == "workbench":
            try:
                self._remote_status = (await self._get_json("/workbench/status")).get("engine") or {}
            except Exception as e:
                log.debug("%s: /workbench/status failed: %s", self.base, e)
        rs = self._remote_status
        st = {
            "pid": None,
            "model": self.model,
            "device": f"remote ({self.kind})",
            "uptime_s": rs.get("uptime_s"),
            "weights_checksum": rs.get("weights_checksum"),
            "remote": self.base,
            "server": self.kind,
            "models": self.models,
            "max_model_len": self.max_model_len,
            "metrics_endpoint": self.has_metrics,
            "read_only": True,
            "connected_s": time.monotonic() - self._connected_at,
            "num_requests": len(self._pending),
            **({"remote_engine": {k: v for k, v in rs.items() if k not in ("pid", "connection_file")}} if rs else {}),
        }
        return {k: v for k, v in st.items() if v is not None}  # absent: the server does not say

    def metrics(self) -> dict:
        return self._run(self._ametrics(), self.rpc_timeout)

    async def _ametrics(self) -> dict:
        with self._lock:
            recent, pending, totals = list(self._recent), list(self._pending.values()), dict(self._totals)
        return await metrics_of(self, recent, pending, totals)

    def timeline(self, since: int | None = None) -> Timeline:
        """This client's requests (arrived, first_token, finished) after cursor `since`."""
        if since is not None and (not isinstance(since, int) or isinstance(since, bool)):
            raise TypeError(f"since must be an int cursor or None, got {since!r}")
        with self._lock:
            return self._recorder.read(since)

    def weights_checksum(self) -> str | None:
        return self._remote_status.get("weights_checksum")

    def reset_prefix_cache(self) -> int:
        raise RemoteSettingsError(f"the prefix cache of the remote server at {self.base} cannot be reset from here")

    def score(self, token_ids: list[int]) -> list[float]:
        raise NotImplementedError(f"score() needs the engine's own API; {self.base} is a remote OpenAI server")

    # -- the asyncio control calls (the Jupyter server extension's), answered on the HTTP loop ---
    def _on_loop(self, coro):
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def astatus(self) -> dict:
        return await self._on_loop(self._astatus())

    async def ametrics(self) -> dict:
        return await self._on_loop(self._ametrics())

    async def atimeline(self, since: int | None = None) -> Timeline:
        return self.timeline(since)  # local: this client's own records

    # -- requests -------------------------------------------------------------------------------
    def _record(self, t: float, rid: str, kind: str, detail: str | None = None, label: str | None = None) -> None:
        with self._lock:
            self._recorder.add_request(t, rid, kind, detail, label)

    def _body(self, prompt: str | None, ids: list[int] | None, sp: SamplingParams, chat: bool) -> tuple[str, dict]:
        def dropped(name: str) -> None:  # once per field and client
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(
                    f"the {self.kind} server at {self.base} has no parameter for SamplingParams.{name}; "
                    "sent without it",
                    stacklevel=6,
                )

        return request_body(
            self.model,
            prompt,
            ids,
            sp,
            chat,
            extra=self._extra,
            token_ids=self._token_ids,
            usage_in_stream=self._usage_in_stream,
            dropped=dropped,
        )

    async def _request(
        self,
        rid: str,
        prompt: str | None,
        ids: list[int] | None,
        sp: SamplingParams,
        chat: bool,
        sink: Callable[[Any], None] | None,
        stream: bool,
    ) -> None:
        """Run one streamed request; deliver chunks (stream) or the final one to `sink`."""
        arrival = time.monotonic()
        with self._lock:
            pend = self._pending.get(rid)
            if pend is None:
                pend = self._pending[rid] = _Pending(None, arrival)
            pend.arrival = arrival
        self._record(
            arrival,
            rid,
            "arrived",
            f"prompt_tokens={len(ids)}" if ids is not None else None,
            prompt_label(prompt if isinstance(prompt, str) else None),
        )
        answer = StreamedAnswer(list(ids) if ids is not None else [], sp.logprobs is not None)
        error: BaseException | None = None
        try:
            path, body = self._body(prompt, ids, sp, chat)
            async with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    raise http_error(resp.status_code, await resp.aread(), self.base)
                async for line in resp.aiter_lines():
                    obj = sse_object(line, self.base)
                    if obj is DONE:
                        break
                    if obj is None:
                        continue
                    now = time.monotonic()
                    for text, tids, new_lps in answer.add(obj, now):
                        if pend.first is None:
                            pend.first = now
                            self._record(now, rid, "first_token")
                        if stream and sink is not None:
                            deliver(sink, StreamChunk(rid, text, tids, None, new_lps or None))
            if answer.finish is None:
                answer.finish = "abort"  # the stream ended without saying why
        except asyncio.CancelledError:
            answer.finish = "abort"  # aborted here: leaving the `async with` closed the connection
        except httpx.HTTPError as e:
            error = transport_error(self.base, e)
        except BaseException as e:
            error = e
        end = time.monotonic()
        out = answer.output(rid, prompt, arrival, pend.first, end, error)
        self._record(end, rid, "finished", out.finish_reason if error is None else "error")
        with self._lock:
            self._pending.pop(rid, None)
            self._recent.append(out)
            self._totals["finished"] += 1
            told = answer.usage or {}  # what the server counted, else what came back
            n = len(answer.token_ids) or len(answer.token_times)
            self._totals["output_tokens"] += told.get("completion_tokens") or n
            self._totals["prompt_tokens"] += told.get("prompt_tokens") or len(answer.prompt_ids)
        if sink is not None:
            deliver(sink, error if error is not None else StreamChunk(rid, "", [], out.finish_reason, output=out))

    def submit(
        self,
        batch,
        sink: Callable[[Any], None],
        *,
        chat: bool = False,
        stream: bool = False,
        into: list[str] | None = None,
    ) -> list[str]:
        if self._closed:
            raise WorkbenchIPCError(f"this client of {self.base} is closed")
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        rids = []
        for prompt, ids, sp in batch:
            if chat and prompt is None:
                raise ValueError("chat=True needs text prompts, not prompt_token_ids")
            rid = secrets.token_hex(6)
            if into is not None:
                into.append(rid)
            with self._lock:
                self._pending[rid] = _Pending(None, time.monotonic())
            fut = asyncio.run_coroutine_threadsafe(self._request(rid, prompt, ids, sp, chat, sink, stream), self._loop)
            with self._lock:
                if rid in self._pending:
                    self._pending[rid].future = fut
            rids.append(rid)
        self._ensure_ticker()
        return rids

    def abandon(self, rids: list[str]) -> None:
        if not self._closed:
            self.abort(rids)

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests of this client: the HTTP stream is closed, which the server takes as an
        abort (ours, vLLM, SGLang do)."""
        ids = request_ids(request_id)
        with self._lock:
            futs = [self._pending[r].future for r in ids if r in self._pending]
        for f in futs:
            if f is not None:
                f.cancel()

    # -- events ---------------------------------------------------------------------------------
    def _subscribe(self, sub: EventSubscription, timeout: float = 10.0) -> EventSubscription:
        """ "timeline" increments (this client's requests) and "metrics" once a second."""
        if self._closed:
            raise WorkbenchIPCError(f"this client of {self.base} is closed")
        with self._lock:
            self._subs.append(sub)
        self._ensure_ticker()
        return sub

    def _ensure_ticker(self) -> None:
        with self._lock:
            if self._subs and (self._ticker is None or self._ticker.done()) and not self._closed:
                self._ticker = asyncio.run_coroutine_threadsafe(self._tick(), self._loop)

    async def _tick(self) -> None:
        """While anyone subscribes: timeline increments (<= 20/s) and metrics (1/s); health."""
        cursor = self._recorder.cursor
        last_metrics = 0.0
        failures = 0
        while True:
            with self._lock:
                subs = list(self._subs)
            if not subs or self._closed:
                return
            now = time.monotonic()
            with self._lock:
                tl = self._recorder.read(cursor) if self._recorder.cursor > cursor else None
            if tl is not None:
                cursor = tl.cursor
                ev = Event("timeline", now, tl)
                for s in subs:
                    s._deliver(ev)
            if now - last_metrics >= METRICS_EVERY_S:
                last_metrics = now
                try:
                    m = await self._ametrics()
                    failures = 0
                except Exception:
                    m = None
                    failures += 1
                if m is None and failures >= 3 and not await self._healthy():
                    self._dead = EngineDeadError(f"the remote server at {self.base} is unreachable")
                    for s in subs:
                        s._deliver(Event("engine", now, {"state": "dead", "remote": self.base}))
                    return
                if m is not None:
                    ev = Event("metrics", now, m)
                    for s in subs:
                        s._deliver(ev)
            await asyncio.sleep(0.05)

    async def _healthy(self) -> bool:
        for path in ("/health", "/v1/models"):
            try:
                resp = await self._http.get(path)
                if resp.status_code < 500:
                    return True
            except httpx.HTTPError:
                continue
        return False

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Abort this client's requests and stop its thread. The server runs on."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            futs = [p.future for p in self._pending.values() if p.future is not None]
            subs, self._subs = list(self._subs), []
        for f in futs:
            f.cancel()
        for s in subs:
            s.closed = True

        async def finish():
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            if tasks:  # cancelled requests deliver their "abort" chunk on the way out
                _, left = await asyncio.wait(tasks, timeout=2)
                for t in left:  # the metrics ticker, a stuck request: a closed loop must not hold them
                    t.cancel()
                await asyncio.gather(*left, return_exceptions=True)
            http = getattr(self, "_http", None)
            if http is not None:
                await http.aclose()
            # close the response streams' async generators here: finalised later, on a stopped loop,
            # asyncio prints "Task was destroyed but it is pending! ... async_generator_athrow"
            await self._loop.shutdown_asyncgens()

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(finish(), self._loop).result(5)
            except Exception:
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    def shutdown(self, drain: bool = False, timeout: float = 60.0) -> None:
        """A remote server is not stopped by its clients: this only closes the connection."""
        log.info("%s is a remote server: shutdown() only disconnects (stop the server where it runs)", self.base)
        self.close()
