"""`RemoteEngineClient`: the `EngineClient` surface over any OpenAI-compatible HTTP server.

    eng = EngineClient.connect("http://127.0.0.1:8000")     # vLLM, SGLang, TGI, llama.cpp, ours
    eng.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
    for chunk in eng.stream("Once upon a time"): ...
    eng.metrics(); eng.timeline(); eng.settings()            # settings are a read-only report
    eng.configure(max_num_seqs=8)                            # RemoteSettingsError

The URL is the server's root (a trailing ``/v1`` is accepted); ``?model=NAME`` picks one of
several served models (default: the first of ``/v1/models``). The API key comes from
``api_key=`` or ``$WORKBENCH_API_KEY`` / ``$OPENAI_API_KEY``. `register_remote("vllm1", url)`
gives a server an engine name, so whatever attaches by name (``EngineClient.connect("vllm1")``,
the lab panel's server extension) reaches it.

How each part is built:

- requests are streamed (SSE) even for `generate`, so every request's arrival, first token
  and token times are measured here (client side: they include the network);
- `timeline()` holds those per-request events (``arrived``, ``first_token``, ``finished``
  with the finish reason as detail) in the same `Timeline` structs as the engine's; it has no
  steps, since an HTTP server does not report its batches;
- `metrics()` has the engine's keys: gauges and counters from the server's Prometheus
  ``/metrics`` when it has one (vLLM ``vllm:*``, SGLang ``sglang:*``, llama.cpp
  ``llamacpp:*``, TGI ``tgi_*``, ours ``workbench:*``), the latency percentiles from this
  client's requests; a value nobody reports is absent (never made up; same in `status()`),
  and ``sources`` says where each value came from ("server" or "client");
- `settings()` maps what the server tells about itself onto our setting names (ours: all of
  them; vLLM: the KV cache config from /metrics; SGLang: /get_server_info; llama.cpp: /props);
  `configure()` raises `RemoteSettingsError`;
- `events()` delivers "timeline" increments as requests progress and "metrics" once a second.

Token ids and logprobs' token ids are exact with our server and vLLM (``return_token_ids``,
``return_tokens_as_token_ids``); other servers report text only: `token_ids` is then empty,
logprob token ids are -1, and a non-default sampling field that such a server has no
parameter for is dropped with a warning.

All HTTP runs on one asyncio loop in a daemon thread (httpx); callers on any thread or event
loop hand requests to it, as with `EngineClient`'s IO thread.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import logging
import os
import secrets
import threading
import time
import urllib.parse
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from .ipc.events import EventSubscription
from .ipc.protocol import EngineConnectError, EngineDeadError, Event, WorkbenchIPCError
from .ipc.surface import RequestSurface, request_ids
from .outputs import RequestMetrics, RequestOutput, StreamChunk, TokenLogprobs
from .sampling_params import SamplingParams
from .timeline import Timeline, TimelineRecorder

__all__ = ["RemoteEngineClient", "RemoteError", "RemoteSettingsError", "list_remotes", "parse_prometheus",
           "register_remote", "registered_remote", "server_metrics", "unregister_remote"]

log = logging.getLogger("workbench.remote")

ENV_API_KEYS = ("WORKBENCH_API_KEY", "OPENAI_API_KEY")
_RECENT = 1000  # finished requests kept for the latency percentiles
_clients: weakref.WeakSet = weakref.WeakSet()  # closed at exit (their loop threads are daemons)
_TOK_WINDOW_S = 10.0  # output_tok_s window (as the engine's metrics())


class RemoteSettingsError(ValueError):
    """A remote server's settings cannot be changed through its OpenAI API."""


class RemoteError(WorkbenchIPCError):
    """The remote server failed (5xx) or answered something that is not the OpenAI API."""


# -- Prometheus -----------------------------------------------------------------------------------
def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _sum(samples, name: str) -> float | None:
    got = samples.get(name)
    return sum(v for _, v in got) if got else None


def _mean(samples, name: str) -> float | None:
    got = samples.get(name)
    return sum(v for _, v in got) / len(got) if got else None


def histogram_quantile(samples, name: str, q: float) -> float | None:
    """Prometheus' histogram_quantile over `name`_bucket (summed over other labels)."""
    buckets: dict[float, float] = {}
    for labels, value in samples.get(name + "_bucket", []):
        le = labels.get("le")
        if le is None:
            continue
        bound = float("inf") if le in ("+Inf", "Inf") else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + value
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank:
            if b == float("inf"):
                return prev_bound
            if count == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = b, count
    return prev_bound


# name prefix -> where our metric keys come from
_FAMILIES: dict[str, dict[str, Any]] = {
    "vllm:": {}, "workbench:": {},  # vLLM's names (ours mirror them)
    "sglang:": {"running": "num_running_reqs", "waiting": "num_queue_reqs", "kv": ("token_usage",),
                "prefix_rate": "cache_hit_rate", "spec_len": "spec_accept_length", "tok_s": "gen_throughput",
                "gen": "generation_tokens_total", "prompt": "prompt_tokens_total"},
    "llamacpp:": {"running": "requests_processing", "waiting": "requests_deferred", "kv": ("kv_cache_usage_ratio",),
                  "gen": "tokens_predicted_total", "prompt": "prompt_tokens_total", "tok_s": "predicted_tokens_seconds"},
    "tgi_": {"running": "batch_current_size", "waiting": "queue_size"},
}
_VLLM_NAMES = {"running": "num_requests_running", "waiting": "num_requests_waiting",
               "kv": ("kv_cache_usage_perc", "gpu_cache_usage_perc"), "prefix_rate": "gpu_prefix_cache_hit_rate",
               "prefix_hits": "prefix_cache_hits_total", "prefix_queries": "prefix_cache_queries_total",
               "spec_rate": "spec_decode_draft_acceptance_rate", "spec_accepted": "spec_decode_num_accepted_tokens_total",
               "spec_draft": "spec_decode_num_draft_tokens_total", "gen": "generation_tokens_total",
               "prompt": "prompt_tokens_total", "finished": "request_success_total",
               "ttft": "time_to_first_token_seconds", "itl": ("inter_token_latency_seconds",
                                                              "time_per_output_token_seconds")}
_FAMILIES["vllm:"] = _FAMILIES["workbench:"] = _VLLM_NAMES
_FAMILIES["sglang:"].update(ttft="time_to_first_token_seconds",
                            itl=("inter_token_latency_seconds", "time_per_output_token_seconds"))


def metrics_prefix(samples) -> str | None:
    for prefix in ("workbench:", "vllm:", "sglang:", "llamacpp:", "tgi_"):
        if any(name.startswith(prefix) for name in samples):
            return prefix
    return None


def server_metrics(samples) -> dict[str, Any]:
    """Our metric keys from a parsed /metrics (only those the server reports)."""
    prefix = metrics_prefix(samples)
    if prefix is None:
        return {}
    names = _FAMILIES[prefix]
    out: dict[str, Any] = {}

    def first(key, fn=_sum):
        spec = names.get(key)
        for n in ((spec,) if isinstance(spec, str) else spec or ()):
            v = fn(samples, prefix + n)
            if v is not None:
                return v
        return None

    if (v := first("running")) is not None:
        out["num_running"] = int(v)
    if (v := first("waiting")) is not None:
        out["num_waiting"] = int(v)
    if (v := first("kv", _mean)) is not None:
        out["kv_usage"] = v
    hits, queries = first("prefix_hits"), first("prefix_queries")
    if hits is not None and queries:
        out["prefix_hit_rate"] = hits / queries
    elif (v := first("prefix_rate", _mean)) is not None:
        out["prefix_hit_rate"] = v
    acc, draft = first("spec_accepted"), first("spec_draft")
    if acc is not None and draft:
        out["spec_acceptance_rate"] = acc / draft
    elif (v := first("spec_rate", _mean)) is not None:
        out["spec_acceptance_rate"] = v
    if (v := first("spec_len", _mean)) is not None:
        out["spec_mean_accepted"] = v
    if (v := first("gen")) is not None:
        out["total_output_tokens"] = int(v)
    if (v := first("prompt")) is not None:
        out["total_prompt_tokens"] = int(v)
    if (v := first("tok_s")) is not None:
        out["output_tok_s"] = v
    for key, label in (("ttft", "ttft"), ("itl", "itl")):
        spec = names.get(key)
        for n in ((spec,) if isinstance(spec, str) else spec or ()):
            if prefix + n + "_bucket" in samples:
                for q in (50, 99):
                    v = histogram_quantile(samples, prefix + n, q / 100)
                    if v is not None:
                        out[f"server_{label}_p{q}_ms"] = v * 1e3
                break
    info = samples.get(prefix + "cache_config_info")
    if info:
        labels = info[0][0]
        if str(labels.get("num_gpu_blocks", "")).isdigit():
            out["kv_blocks_total"] = int(labels["num_gpu_blocks"])
    return out


# -- the client -----------------------------------------------------------------------------------
# Fields beyond OpenAI's that each kind of server takes, by our SamplingParams name -> its name.
_EXTRA_FIELDS = {
    "workbench": {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                  "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids"},
    "llama.cpp": {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repeat_penalty",
                  "ignore_eos": "ignore_eos"},
    "llama-cpp-python": {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repeat_penalty"},
    "tgi": {"repetition_penalty": "repetition_penalty"},
}
_EXTRA_FIELDS["vllm"] = _EXTRA_FIELDS["sglang"] = _EXTRA_FIELDS["workbench"]
_TOKEN_ID_KINDS = ("workbench", "vllm")  # return_token_ids / return_tokens_as_token_ids


class _Pending:
    __slots__ = ("future", "arrival", "first")

    def __init__(self, future, arrival: float):
        self.future = future
        self.arrival = arrival
        self.first: float | None = None


class RemoteEngineClient(RequestSurface):
    """An OpenAI-compatible server behind the `EngineClient` surface. Thread-safe."""

    rpc_timeout: float = 30.0

    def __init__(self, url: str, *, api_key: str | None = None, model: str | None = None, timeout: float = 10.0,
                 request_timeout: float | None = 600.0, name: str | None = None, max_connections: int = 512):
        """`name`: what `.name` reports (default: the URL; a registered remote's engine name)."""
        base, query_model = _split_url(url)
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
            return httpx.AsyncClient(base_url=self.base, headers=headers, timeout=http_timeout, limits=limits,
                                     trust_env=False)

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
            raise _transport_error(self.base, e) from None
        if resp.status_code >= 400:
            raise _http_error(resp.status_code, resp.content, self.base)
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
                raise PermissionError(f"{self.base} refused the API key (HTTP {resp.status_code}); pass api_key= or "
                                      f"set ${ENV_API_KEYS[0]}")
            if resp.status_code >= 400:
                raise EngineConnectError(f"{self.base}/v1/models answered HTTP {resp.status_code}: "
                                         f"{_error_message(resp.content)}")
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
        self.kind = _detect_kind(card, samples, server_header)
        self.max_model_len = card.get("max_model_len")
        self._extra = _EXTRA_FIELDS.get(self.kind, {})
        self._token_ids = self.kind in _TOKEN_ID_KINDS
        self._usage_in_stream = self.kind != "llama-cpp-python"
        self._remote_status: dict = {}
        self.engine_info = {**self._run(self._astatus(), timeout), "settings": {}}
        log.info("connected to %s (%s, model %r, metrics: %s)", self.base, self.kind, model, self.has_metrics)

    # -- settings, status, metrics, timeline ----------------------------------------------------
    def configure(self, **changes: Any) -> dict:
        names = ", ".join(sorted(changes)) or "(none given)"
        raise RemoteSettingsError(
            f"settings of the remote {self.kind} server at {self.base} cannot be changed from here ({names}); "
            "restart that server with the settings you want. settings() shows what it reports (read-only).")

    async def aconfigure(self, **changes: Any) -> dict:
        return self.configure(**changes)

    def settings(self) -> dict:
        """What the server reports about itself, under our setting names (read-only)."""
        return self._run(self._asettings(), self.rpc_timeout)

    async def _asettings(self) -> dict:
        from .settings import setting_names

        out: dict[str, Any] = {}
        if self.kind == "workbench":
            got = await self._get_json("/workbench/settings")
            out = dict(got.get("settings") or {})
        elif self.kind == "vllm" and self.has_metrics:
            text = await self._get_text("/metrics")
            info = (parse_prometheus(text).get("vllm:cache_config_info") or [({}, 0)])[0][0] if text else {}
            if info.get("block_size", "").isdigit():
                out["block_size"] = int(info["block_size"])
            if info.get("num_gpu_blocks", "").isdigit():
                out["num_kv_blocks"] = int(info["num_gpu_blocks"])
            if "enable_prefix_caching" in info:
                out["prefix_caching"] = info["enable_prefix_caching"].lower() == "true"
            if info.get("cache_dtype"):
                out["kv_cache_dtype"] = info["cache_dtype"]
        elif self.kind == "sglang":
            for path in ("/get_server_info", "/server_info"):
                text = await self._get_text(path)
                if text:
                    out = _sglang_settings(json.loads(text))
                    break
        elif self.kind == "llama.cpp":
            text = await self._get_text("/props")
            if text:
                props = json.loads(text)
                if isinstance(props.get("total_slots"), int):
                    out["max_num_seqs"] = props["total_slots"]
                n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
                if isinstance(n_ctx, int):
                    out["max_model_len"] = n_ctx
        if self.max_model_len and "max_model_len" not in out:
            out["max_model_len"] = self.max_model_len
        known = set(setting_names())
        return {k: v for k, v in out.items() if k in known and v is not None}

    async def asettings(self) -> dict:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._asettings(), self._loop))

    def schema(self) -> list[dict]:
        """Our settings schema for the settings this server reports, each marked read-only."""
        from .settings import schema

        reported = self.settings()
        return [{**e, "kind": "read-only", "read_only": True, "engine_kind": e["kind"], "value": reported[e["name"]]}
                for e in schema() if e["name"] in reported]

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
            "pid": None, "model": self.model, "device": f"remote ({self.kind})",
            "uptime_s": rs.get("uptime_s"), "weights_checksum": rs.get("weights_checksum"),
            "remote": self.base, "server": self.kind, "models": self.models, "max_model_len": self.max_model_len,
            "metrics_endpoint": self.has_metrics, "read_only": True, "connected_s": time.monotonic() - self._connected_at,
            "num_requests": len(self._pending),
            **({"remote_engine": {k: v for k, v in rs.items() if k not in ("pid", "connection_file")}} if rs else {}),
        }
        return {k: v for k, v in st.items() if v is not None}  # absent: the server does not say

    def metrics(self) -> dict:
        return self._run(self._ametrics(), self.rpc_timeout)

    async def _ametrics(self) -> dict:
        from .bench.stats import percentile

        now = time.monotonic()
        with self._lock:
            recent = list(self._recent)
            pending = list(self._pending.values())
            totals = dict(self._totals)
        ttft = [o.metrics.ttft for o in recent if o.metrics.ttft is not None]
        itl = [x for o in recent for x in o.metrics.itl]
        window = [t for o in recent for t in o.metrics.token_times if t >= now - _TOK_WINDOW_S]
        running = sum(1 for p in pending if p.first is not None)
        m: dict[str, Any] = {
            "output_tok_s": len(window) / _TOK_WINDOW_S if window else 0.0,
            "num_waiting": len(pending) - running, "num_running": running,
            "kv_blocks_used": None, "kv_blocks_total": None, "kv_usage": None,
            "prefix_hit_rate": None, "spec_acceptance_rate": None, "spec_mean_accepted": None,
            "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
            "total_prompt_tokens": totals["prompt_tokens"], "total_output_tokens": totals["output_tokens"],
            "total_finished": totals["finished"],
        }
        sources = {k: "client" for k in ("output_tok_s", "num_waiting", "num_running", "ttft_p50_ms", "ttft_p99_ms",
                                         "itl_p50_ms", "itl_p99_ms", "total_prompt_tokens", "total_output_tokens",
                                         "total_finished")}
        m["client_num_waiting"], m["client_num_running"] = m["num_waiting"], m["num_running"]
        if self.has_metrics:
            text = await self._get_text("/metrics")
            if text:
                srv = server_metrics(parse_prometheus(text))
                gen = srv.get("total_output_tokens")
                if gen is not None and "output_tok_s" not in srv:
                    last = self._last_scrape
                    if last is not None and now > last[0] and gen >= last[1]:
                        srv["output_tok_s"] = (gen - last[1]) / (now - last[0])
                    self._last_scrape = (now, gen)
                m.update(srv)
                sources.update({k: "server" for k in srv})
        m = {k: v for k, v in m.items() if v is not None}  # absent: nobody reports it (never made up)
        m["sources"] = {k: v for k, v in sources.items() if k in m}
        m["remote"] = self.base
        return m

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

    # -- EngineClient.call / acall (used by the Jupyter server extension) -----------------------
    _METHODS = ("status", "settings", "metrics", "timeline", "configure", "schema", "weights_checksum",
                "reset_prefix_cache", "score")

    def call(self, method: str, *, _timeout: float | None = None, _type: Any = Any, **kwargs) -> Any:
        if method not in self._METHODS:
            raise NotImplementedError(f"{method}() is not available on a remote OpenAI-compatible server")
        return getattr(self, method)(**kwargs)

    async def acall(self, method: str, *, _timeout: float | None = None, _type: Any = Any, **kwargs) -> Any:
        if method not in self._METHODS:
            raise NotImplementedError(f"{method}() is not available on a remote OpenAI-compatible server")
        if method == "metrics":
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._ametrics(), self._loop))
        if method == "settings":
            return await self.asettings()
        if method == "status":
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._astatus(), self._loop))
        if method in ("timeline", "configure"):
            return getattr(self, method)(**kwargs)  # local, non-blocking
        return await asyncio.to_thread(getattr(self, method), **kwargs)

    # -- requests -------------------------------------------------------------------------------
    def _record(self, t: float, rid: str, kind: str, detail: str | None = None) -> None:
        with self._lock:
            self._recorder.add_request(t, rid, kind, detail)

    def _body(self, prompt: str | None, ids: list[int] | None, sp: SamplingParams, chat: bool) -> tuple[str, dict]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": sp.max_tokens, "temperature": sp.temperature,
                                "top_p": sp.top_p, "stream": True}
        if self._usage_in_stream:
            body["stream_options"] = {"include_usage": True}
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.stop:
            body["stop"] = sp.stop
        defaults = SamplingParams()
        for name in ("top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids"):
            value = getattr(sp, name)
            if value == getattr(defaults, name) or (name == "stop_token_ids" and not value):
                continue
            if name in self._extra:
                body[self._extra[name]] = value
            elif name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"the {self.kind} server at {self.base} has no parameter for SamplingParams.{name}; "
                              "sent without it", stacklevel=4)
        if self._token_ids:
            body["return_token_ids"] = True
            if sp.logprobs is not None:
                body["return_tokens_as_token_ids"] = True
        if chat:
            if prompt is None:
                raise ValueError("chat=True needs a text prompt, not prompt_token_ids")
            body["messages"] = [{"role": "user", "content": prompt}]
            if sp.logprobs is not None:
                body["logprobs"] = True
                body["top_logprobs"] = sp.logprobs
            return "/v1/chat/completions", body
        body["prompt"] = prompt if ids is None else ids
        if sp.logprobs is not None:
            body["logprobs"] = sp.logprobs
        return "/v1/completions", body

    async def _request(self, rid: str, prompt: str | None, ids: list[int] | None, sp: SamplingParams, chat: bool,
                       sink: Callable[[Any], None] | None, stream: bool, arrival: float | None = None) -> dict:
        """Run one streamed request; deliver chunks (stream) or the final one to `sink`. Returns
        {"output", "usage", "chunk_times"} (for the load generator)."""
        arrival = arrival if arrival is not None else time.monotonic()
        with self._lock:
            pend = self._pending.get(rid)
            if pend is None:
                pend = self._pending[rid] = _Pending(None, arrival)
            pend.arrival = arrival
        self._record(arrival, rid, "arrived", f"prompt_tokens={len(ids)}" if ids is not None else None)
        text_parts: list[str] = []
        token_ids: list[int] = []
        token_times: list[float] = []
        chunk_times: list[float] = []
        lps: list[TokenLogprobs] | None = [] if sp.logprobs is not None else None
        prompt_ids = list(ids) if ids is not None else []
        finish: str | None = None
        usage: dict | None = None
        error: BaseException | None = None
        try:
            path, body = self._body(prompt, ids, sp, chat)
            async with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    raise _http_error(resp.status_code, await resp.aread(), self.base)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        raise RemoteError(f"{self.base} sent a stream line that is not JSON: {data[:200]!r}") from None
                    if isinstance(obj.get("error"), (dict, str)):
                        raise _error_from_object(obj["error"], self.base)
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if obj.get("prompt_token_ids"):
                        prompt_ids = list(obj["prompt_token_ids"])
                    for choice in obj.get("choices") or []:
                        now = time.monotonic()
                        text = choice.get("text")
                        if text is None:
                            text = (choice.get("delta") or {}).get("content") or ""
                        tids = [int(t) for t in choice.get("token_ids") or []]
                        if choice.get("prompt_token_ids"):
                            prompt_ids = list(choice["prompt_token_ids"])
                        new_lps = _parse_logprobs(choice.get("logprobs"), tids) if lps is not None else []
                        n = len(tids) or len(new_lps) or (1 if text else 0)
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
                        if n == 0 and not text:
                            continue
                        if pend.first is None:
                            pend.first = now
                            self._record(now, rid, "first_token")
                        chunk_times.append(now)
                        token_times.extend([now] * n)
                        text_parts.append(text)
                        token_ids.extend(tids)
                        if lps is not None:
                            lps.extend(new_lps)
                        if stream and sink is not None:
                            _safe(sink, StreamChunk(rid, text, tids, None, new_lps or None))
            if finish is None:
                finish = "abort"  # the stream ended without saying why
        except asyncio.CancelledError:
            finish = "abort"  # aborted here: leaving the `async with` closed the connection
        except httpx.HTTPError as e:
            error = _transport_error(self.base, e)
        except BaseException as e:
            error = e
        end = time.monotonic()
        out = RequestOutput(
            request_id=rid, prompt_token_ids=prompt_ids, token_ids=token_ids, text="".join(text_parts),
            finish_reason=finish if error is None else "abort",
            metrics=RequestMetrics(arrival=arrival, first_token=pend.first, finished=end, token_times=token_times),
            prompt=prompt, logprobs=lps, error=None if error is None else f"{type(error).__name__}: {error}")
        self._record(end, rid, "finished", out.finish_reason if error is None else "error")
        with self._lock:
            self._pending.pop(rid, None)
            self._recent.append(out)
            self._totals["finished"] += 1
            self._totals["output_tokens"] += (usage or {}).get("completion_tokens") or len(token_ids) or len(token_times)
            self._totals["prompt_tokens"] += (usage or {}).get("prompt_tokens") or len(prompt_ids)
        if sink is not None:
            _safe(sink, error if error is not None else StreamChunk(rid, "", [], out.finish_reason, output=out))
        return {"output": out, "usage": usage, "chunk_times": chunk_times, "error": error}

    def _submit(self, batch, chat: bool, stream: bool, sink: Callable[[Any], None],
                into: list[str] | None = None) -> list[str]:
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

    def _abandon(self, rids: list[str]) -> None:
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

    def run_load(self, items: list[dict], *, max_concurrency: int | None = None, progress=None,
                 timeout: float | None = None) -> tuple[list[dict], float]:
        """The load generator's entry: each item {"prompt" or "prompt_token_ids", "params",
        "arrival_s"} is sent at start + arrival_s (on this client's event loop, so no thread hop
        is timed). Returns ([{"output", "usage", "chunk_times", "error"}], start)."""

        async def run():
            sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
            start = time.monotonic() + 0.05

            async def one(item):
                await asyncio.sleep(max(0.0, start + item.get("arrival_s", 0.0) - time.monotonic()))
                if sem is not None:
                    await sem.acquire()
                try:
                    rid = secrets.token_hex(6)
                    with self._lock:
                        self._pending[rid] = _Pending(None, time.monotonic())
                    res = await self._request(rid, item.get("prompt"), item.get("prompt_token_ids"),
                                              SamplingParams.coerce(item.get("params")), bool(item.get("chat")),
                                              None, False)
                finally:
                    if sem is not None:
                        sem.release()
                if progress is not None:
                    progress.update(1)
                return res

            return list(await asyncio.gather(*(one(it) for it in items))), start

        return self._run(run(), timeout)

    # -- events ---------------------------------------------------------------------------------
    def events(self, kinds: Iterable[str] | str | None = None, *, maxsize: int = 10_000,
               timeout: float = 10.0) -> EventSubscription:
        """"timeline" increments (this client's requests) and "metrics" once a second."""
        return self._subscribe(EventSubscription(self, kinds, maxsize=maxsize))

    def on_event(self, callback: Callable[[Event], None], kinds: Iterable[str] | str | None = None, *,
                 timeout: float = 10.0) -> EventSubscription:
        return self._subscribe(EventSubscription(self, kinds, callback=callback))

    async def aevents(self, kinds: Iterable[str] | str | None = None, *, timeout: float = 10.0) -> EventSubscription:
        return self._subscribe(EventSubscription(self, kinds, loop=asyncio.get_running_loop()))

    def _subscribe(self, sub: EventSubscription) -> EventSubscription:
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
            if now - last_metrics >= 1.0:
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


# -- named remotes --------------------------------------------------------------------------------
# A remote server can get an engine name, so that everything that attaches by name (the lab panel's
# server extension, `%engine connect NAME`, `EngineClient.connect(NAME)`) reaches it: its entry is a
# small JSON file beside the engines' connection files, {"name", "remote_url", "model"}.
def register_remote(name: str, url: str, *, model: str | None = None, api_key: str | None = None) -> str:
    """Give the OpenAI-compatible server at `url` the engine name `name`; returns the entry's path
    (mode 0600, like the engines' connection files, since it may hold the API key). A local
    engine started later under the same name replaces the entry."""
    from .ipc import connection as conn

    conn.check_name(name)
    _split_url(url)  # validates
    holder = conn.live_engine(name)
    if holder is not None:
        raise FileExistsError(f"an engine named {name!r} is already running (pid {holder.pid}); choose another name")
    path = conn.connection_path(name)
    tmp = path.with_name(f".{name}.remote.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"name": name, "remote_url": url, "model": model, "api_key": api_key, "version": 1}, f)
    os.replace(tmp, path)
    return str(path)


def unregister_remote(name: str) -> None:
    from .ipc import connection as conn

    if registered_remote(name) is not None:
        conn.connection_path(name).unlink(missing_ok=True)


def registered_remote(name_or_file) -> dict | None:
    """RemoteEngineClient arguments ({"url", "model", "api_key"}) registered under an engine name
    or entry file, else None."""
    from .ipc import connection as conn

    try:
        text = os.fspath(name_or_file)
        path = text if (os.sep in text or text.endswith(".json")) else conn.connection_path(text)
        with open(path) as f:
            entry = json.load(f)
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("remote_url"), str):
        return None
    return {"url": entry["remote_url"], "model": entry.get("model"), "api_key": entry.get("api_key"),
            "name": entry.get("name")}


def list_remotes() -> list[dict]:
    """Registered remote servers: [{"name", "url", "model"}]."""
    from .ipc import connection as conn

    out = []
    for p in sorted(conn.runtime_dir().glob("*.json")):
        try:
            entry = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(entry, dict) and isinstance(entry.get("remote_url"), str):
            out.append({"name": entry.get("name") or p.stem, "url": entry["remote_url"], "model": entry.get("model")})
    return out


@atexit.register
def _close_all() -> None:
    for client in list(_clients):
        try:
            client.close()
        except Exception:
            pass


# -- helpers --------------------------------------------------------------------------------------
def _split_url(url: str) -> tuple[str, str | None]:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"a remote engine URL starts with http:// or https://, got {url!r}")
    parts = urllib.parse.urlsplit(url)
    model = urllib.parse.parse_qs(parts.query).get("model", [None])[0]
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", "")), model


def _detect_kind(card: dict, samples: dict, server_header: str) -> str:
    owned = str(card.get("owned_by", "")).lower()
    prefix = metrics_prefix(samples)
    if owned == "workbench" or prefix == "workbench:":
        return "workbench"
    if owned == "vllm" or prefix == "vllm:":
        return "vllm"
    if owned == "sglang" or prefix == "sglang:":
        return "sglang"
    if owned == "llamacpp" or prefix == "llamacpp:" or "llama.cpp" in server_header.lower():
        return "llama.cpp"
    if owned == "me" and "permissions" in card:
        return "llama-cpp-python"
    if owned in ("tgi", "huggingface") or prefix == "tgi_" or "text-generation" in server_header.lower():
        return "tgi"
    return "openai-compatible"


def _sglang_settings(info: dict) -> dict:
    out: dict[str, Any] = {}
    args = info.get("server_args", info) if isinstance(info, dict) else {}
    if isinstance(args.get("max_running_requests"), int):
        out["max_num_seqs"] = args["max_running_requests"]
    if isinstance(args.get("chunked_prefill_size"), int):
        out["max_num_batched_tokens"] = args["chunked_prefill_size"]
    if isinstance(args.get("disable_radix_cache"), bool):
        out["prefix_caching"] = not args["disable_radix_cache"]
    if isinstance(args.get("page_size"), int):
        out["block_size"] = args["page_size"]
    for ours, theirs in (("kv_cache_dtype", "kv_cache_dtype"), ("dtype", "dtype"), ("quantization", "quantization")):
        if args.get(theirs) is not None:
            out[ours] = args[theirs]
    if "speculative_algorithm" in args:
        out["speculative"] = args["speculative_algorithm"] or "off"
    if isinstance(args.get("speculative_num_draft_tokens"), int):
        out["num_speculative_tokens"] = args["speculative_num_draft_tokens"]
    if isinstance(args.get("context_length"), int):
        out["max_model_len"] = args["context_length"]
    return out


def _token_id(token: Any) -> int:
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[9:])
        except ValueError:
            return -1
    return -1


def _parse_logprobs(block: Any, token_ids: list[int]) -> list[TokenLogprobs]:
    """Completions ({tokens, token_logprobs, top_logprobs}) or chat ({content: [...]}) logprobs."""
    if not isinstance(block, dict):
        return []
    out = []
    if isinstance(block.get("content"), list):
        for i, e in enumerate(block["content"]):
            tid = _token_id(e.get("token"))
            if tid < 0 and i < len(token_ids):
                tid = token_ids[i]
            top = [(_token_id(t.get("token")), float(t.get("logprob", 0.0))) for t in e.get("top_logprobs") or []]
            out.append(TokenLogprobs(tid, float(e.get("logprob", 0.0)), top))
        return out
    tokens = block.get("tokens") or []
    lps = block.get("token_logprobs") or []
    tops = block.get("top_logprobs") or []
    for i, tok in enumerate(tokens):
        tid = _token_id(tok)
        if tid < 0 and i < len(token_ids):
            tid = token_ids[i]
        top_d = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        lp = lps[i] if i < len(lps) and lps[i] is not None else 0.0
        out.append(TokenLogprobs(tid, float(lp), [(_token_id(t), float(v)) for t, v in top_d.items()]))
    return out


def _error_message(content: bytes) -> str:
    try:
        obj = json.loads(content)
    except ValueError:
        return content[:300].decode(errors="replace")
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)
    return str(err)


def _http_error(status: int, content: bytes, base: str) -> BaseException:
    msg = _error_message(content)
    if status in (401, 403):
        return PermissionError(f"{base}: HTTP {status}: {msg}")
    if status == 404:
        return LookupError(f"{base}: {msg}")
    if status in (400, 413, 422):
        return ValueError(msg)
    if status == 503:
        return EngineDeadError(f"{base} is unavailable (HTTP 503): {msg}")
    if status == 504:
        return TimeoutError(f"{base}: {msg}")
    return RemoteError(f"{base}: HTTP {status}: {msg}")


def _error_from_object(err: Any, base: str) -> BaseException:
    if isinstance(err, dict):
        code = err.get("code")
        status = code if isinstance(code, int) else {"invalid_request_error": 400}.get(err.get("type"), 500)
        return _http_error(status, json.dumps({"error": err}).encode(), base)
    return RemoteError(f"{base}: {err}")


def _transport_error(base: str, e: BaseException) -> BaseException:
    if isinstance(e, httpx.TimeoutException):
        return TimeoutError(f"{base} did not answer in time: {e}")
    return EngineDeadError(f"cannot reach {base}: {e}")


def _safe(sink: Callable[[Any], None], item: Any) -> None:
    try:
        sink(item)
    except Exception:
        log.debug("dropping an item for a gone consumer", exc_info=True)
