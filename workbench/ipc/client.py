"""Clients of an engine process: `start_engine` spawns one, `EngineClient.connect` attaches.

    eng = start_engine("path/to/model", name="lab", max_num_seqs=8)
    outs = eng.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
    for chunk in eng.stream("Once upon a time"): ...
    eng.configure(batching="static")            # every client sees a "settings" event
    for ev in eng.events(): ...                 # steps, request events, settings, metrics
    eng.shutdown()

One IO thread per client owns its DEALER socket: callers from any thread (a running cell, a
widget callback, an asyncio task) hand it messages through a queue and wait on their own
future or queue, so the client is thread-safe and asyncio-friendly. The IO thread sends
heartbeats and notices a dead engine (process gone, or silent for the engine's client timeout):
every waiter then raises `EngineDeadError` instead of hanging. Events come through a SUB socket
owned by a second thread, started on the first subscription (`event_feed.py`). `start_engine`
is in `launch.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import secrets
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import zmq

from ..aio import wait_for
from ..errors import fresh_copy
from ..events import Event, EventSubscription
from ..interface import Engine, closed_at_exit, request_ids
from ..processing.output import Stop as StopFound
from ..timeline import Timeline
from ..tokenizer import Tokenizer, TokenizerSpec
from . import connection as conn
from .event_feed import EventFeed
from .pending import PendingRequests
from .protocol import (
    HEADER,
    PROTOCOL_VERSION,
    Abort,
    Bye,
    Call,
    EngineConnectError,
    EngineDeadError,
    EngineDrainingError,
    Failure,
    NewRequest,
    Outputs,
    Ping,
    Pong,
    ProtocolError,
    Rejected,
    Result,
    Stop,
    Submit,
    WorkbenchIPCError,
    check_header,
    decode_engine_message,
    decode_value,
    encode_strict,
    error_from_wire,
)

log = logging.getLogger("workbench.client")

_clients = closed_at_exit()


class EngineClient(Engine):
    """A connection to an engine process. Thread-safe; sync and asyncio methods."""

    rpc_timeout: float = 300.0  # seconds an RPC may take (a relayout of a big model is slow)

    def __init__(
        self,
        info: conn.ConnectionInfo,
        *,
        process: subprocess.Popen | None = None,
        timeout: float = 10.0,
        check_pid: bool = True,
        client_name: str | None = None,
        reconnect: bool = False,
    ):
        self.name = info.name
        self.reconnect = reconnect  # after the engine dies, attach to the next one holding the name
        self._client_name = client_name or conn.default_client_name()
        self._check_pid_wanted = check_pid
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._outq: deque[list[bytes]] = deque()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._pending = PendingRequests()  # sinks, and the output processor that makes their chunks
        self._ids = itertools.count(1)
        self._dead: BaseException | None = None
        self.draining = False  # the engine said it is shutting down (heartbeats, refusals)
        self.clock_offset = 0.0  # the engine's time.monotonic() minus this process's (set at the handshake)
        self._closing = False
        self._closed = False
        self._got_reply = False
        self._identity = b"wb" + secrets.token_bytes(10)  # a routing id must not start with 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._subs: list[EventSubscription] = []
        self._events = EventFeed(self._ctx, self.name, self._deliver_event)
        self._ev_lock = threading.Lock()  # one feed thread started, not two
        self._reconnect_lock = threading.Lock()
        self._io: threading.Thread | None = None
        try:
            self._open(info, process, timeout)
        except BaseException:
            self.close()
            raise
        _clients.add(self)

    def _open(self, info: conn.ConnectionInfo, process: subprocess.Popen | None, timeout: float) -> None:
        """Start the IO thread on `info`'s sockets and shake hands."""
        self.info, self.pid, self.process = info, info.pid, process
        self.draining = False
        self._check_pid = self._check_pid_wanted and info.same_host()
        self._io = threading.Thread(target=self._io_loop, name=f"wb-client-io-{info.name}", daemon=True)
        self._io.start()
        try:
            asked = time.monotonic()
            self.engine_info = self.call(
                "hello", _timeout=timeout, name=self._client_name, pid=os.getpid(), protocol=PROTOCOL_VERSION
            )
            # the engine's clock minus ours (0 on one host): its timeline's times in ours, for merged views
            answered = time.monotonic()
            there = self.engine_info.get("monotonic")
            self.clock_offset = 0.0 if there is None or info.same_host() else there - (asked + answered) / 2
            fetch = partial(self.call, "tokenizer", _timeout=timeout, _type=TokenizerSpec)
            self._pending.expect_tokenizer(self.engine_info.get("tokenizer_digest"), fetch)
        except TimeoutError:
            hint = (
                " For tcp, check that this connection file carries the engine's CURVE keys."
                if info.transport == "tcp"
                else ""
            )
            raise EngineConnectError(
                f"engine {info.name!r} at {info.request_address} did not answer the handshake within {timeout}s.{hint}"
            ) from None

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The engine's own tokenizer (it comes over the socket: an engine on any host)."""
        return self._pending.tokenizer()

    def _revive(self) -> bool:
        """With `reconnect`, attach to a new engine holding this name once the old one is dead.
        Requests and subscriptions of the old engine ended with EngineDeadError; new ones go to
        the new engine. True when the client is usable."""
        if self._dead is None:
            return True
        if not self.reconnect or self._closed:
            return False
        with self._reconnect_lock:
            if self._dead is None:
                return True
            directory = Path(self.info.path).parent if self.info.path else None
            info = conn.live_engine(self.name, directory)
            if info is None or info.pid == self.pid:
                return False
            for t in (self._io, self._events.thread):
                if t is not None and t is not threading.current_thread():
                    t.join(5)  # both leave once the client is dead
            self._outq.clear()
            with self._lock:
                self._subs = []  # they ended with the old engine's EngineDeadError
            self._events.reset()
            self._got_reply = False
            self._dead = None
            try:
                self._open(info, None, 10.0)
            except Exception as e:
                self._set_dead(EngineDeadError(f"reconnecting to engine {self.name!r} (pid {info.pid}) failed: {e}"))
                return False
            log.info("reconnected to engine %r (now pid %d)", self.name, info.pid)
            return True

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def connect(
        cls,
        name_or_connection_file: str | os.PathLike | None = None,
        *,
        timeout: float = 10.0,
        check_pid: bool = True,
        reconnect: bool = False,
        client_name: str | None = None,
    ) -> EngineClient:
        """Attach to a running engine process by name (looked up in the runtime dir) or connection
        file (`workbench.connect` also takes http(s):// URLs). With reconnect=True the client follows
        the name: when the engine dies and another starts under the same name, the next call (or
        `alive`) attaches to it."""
        path = conn.resolve(name_or_connection_file)
        info = conn.read_connection_file(path)
        if check_pid and not info.engine_alive():
            raise EngineDeadError(f"engine {info.name!r} (pid {info.pid}) is not running; {path} is stale")
        return cls(info, timeout=timeout, check_pid=check_pid, reconnect=reconnect, client_name=client_name)

    def __repr__(self) -> str:
        state = "dead" if self._dead else "connected"
        return f"<EngineClient {self.name!r} pid={self.pid} {self.info.transport} {state}>"

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.shutdown()
        else:
            self.close()

    @property
    def alive(self) -> bool:
        return self._dead is None or self._revive()

    @property
    def connection_file(self) -> str | None:
        return self.info.path

    @property
    def log_file(self) -> str | None:
        return self.info.log_file

    # -- IO thread ------------------------------------------------------------------------------
    def _io_loop(self) -> None:
        info = self.info
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self._identity)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        conn.apply_curve(sock, info)
        sock.connect(info.request_address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        hb = max(0.05, float(info.heartbeat_s))
        dead_after = max(float(info.client_timeout_s), 3 * hb)
        last_send = last_check = time.monotonic()
        # Silence counts from the first ping left unanswered, not from the last message: after
        # this process was suspended (a laptop asleep) the engine gets a fresh chance to answer.
        unanswered_since: float | None = None
        try:
            while True:
                ready = dict(poller.poll(int(hb * 500)))
                if self._wake_r.fileno() in ready:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, InterruptedError):
                        pass
                while self._outq:
                    sock.send_multipart(self._outq.popleft(), copy=False)
                    last_send = time.monotonic()
                if sock in ready:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        unanswered_since = None
                        self._got_reply = True
                        self._dispatch(frames)
                t = time.monotonic()
                if self._closing:
                    if self._dead is None:
                        while self._outq:  # what was posted just before close() still goes out
                            sock.send_multipart(self._outq.popleft(), copy=False)
                        sock.send_multipart([HEADER, encode_strict(Bye())])
                    break
                if t - last_send >= hb:
                    sock.send_multipart([HEADER, encode_strict(Ping())])
                    last_send = t
                    if unanswered_since is None:
                        unanswered_since = t
                if t - last_check >= min(hb, 0.5):
                    last_check = t
                    silent = 0.0 if unanswered_since is None else t - unanswered_since
                    reason = self._death_reason(silent, dead_after)
                    if reason:
                        self._set_dead(EngineDeadError(f"engine {info.name!r} (pid {info.pid}) is gone: {reason}"))
                        break
        except Exception as e:  # pragma: no cover - a bug here must surface, not hang callers
            log.exception("client IO thread crashed")
            self._set_dead(EngineDeadError(f"client IO thread crashed: {e!r}"))
        finally:
            sock.close()

    def _death_reason(self, silent_s: float, dead_after: float) -> str | None:
        if self.process is not None:
            rc = self.process.poll()
            if rc is not None:
                return f"its process exited with code {rc}"
        elif self._check_pid and not conn.pid_alive(self.info.pid):
            return "its process no longer exists"
        if self._got_reply and silent_s > dead_after:
            return f"no heartbeat for {silent_s:.1f}s"
        return None

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or check_header(frames[0]) is not None:
            log.warning("dropping a malformed message from the engine")
            return
        try:
            msg = decode_engine_message(frames[1])
        except Exception as e:
            log.warning("dropping an undecodable message from the engine: %s", e)
            return
        if isinstance(msg, Outputs):
            self._pending.on_outputs(msg.outputs, self._send_stop)
        elif isinstance(msg, (Result, Failure)):
            with self._lock:
                fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if isinstance(msg, Result):
                    fut.set_result(bytes(msg.value))
                else:
                    fut.set_exception(error_from_wire(msg.error))
        elif isinstance(msg, Rejected):
            if msg.error.type == EngineDrainingError.__name__:
                self.draining = True
            self._pending.fail(msg.request_ids, partial(error_from_wire, msg.error))
        elif isinstance(msg, ProtocolError):
            log.error("the engine could not understand a message from this client: %s", msg.message)
        elif isinstance(msg, Pong):
            self.draining = msg.draining

    def _send_stop(self, stop: StopFound) -> None:
        """A stop string this client's output processor found: the engine ends the request there."""
        try:
            self._post(Stop(*stop))
        except Exception:
            pass  # the engine is gone: its requests end with that error

    def _set_dead(self, exc: BaseException, quiet: bool = False) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = exc
            calls, self._calls = self._calls, {}
            subs = list(self._subs)
        if not quiet:
            log.warning("%s", exc)
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(fresh_copy(exc))
        self._pending.fail_all(partial(fresh_copy, exc))
        for sub in subs:
            sub._deliver(fresh_copy(exc))

    def _post(self, msg: Any) -> None:
        if self._dead is not None:
            raise fresh_copy(self._dead)
        frames = [HEADER, encode_strict(msg)]
        if len(frames[1]) > self.info.max_message_bytes:
            raise ValueError(
                f"message of {len(frames[1]) / 2**20:.1f} MiB exceeds the engine's limit of "
                f"{self.info.max_message_bytes / 2**20:.0f} MiB; submit fewer or shorter prompts at once"
            )
        self._outq.append(frames)
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending

    # -- RPC ------------------------------------------------------------------------------------
    def _start_call(self, method: str, kwargs: dict) -> tuple[int, concurrent.futures.Future]:
        self._revive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        with self._lock:
            if self._dead is not None:
                raise fresh_copy(self._dead)
            self._calls[call_id] = fut
        try:
            self._post(Call(call_id, method, kwargs))
        except BaseException:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        return call_id, fut

    def call(self, method: str, *, _timeout: float | None = None, _type: Any = Any, **kwargs) -> Any:
        """Run an engine RPC (between steps) and return its value; engine errors re-raised."""
        timeout = self.rpc_timeout if _timeout is None else _timeout
        call_id, fut = self._start_call(method, kwargs)
        try:
            raw = fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"engine {self.name!r} did not answer {method}() within {timeout}s") from None
        finally:
            with self._lock:
                self._calls.pop(call_id, None)
        return decode_value(raw, _type)

    async def acall(self, method: str, *, _timeout: float | None = None, _type: Any = Any, **kwargs) -> Any:
        timeout = self.rpc_timeout if _timeout is None else _timeout
        call_id, fut = self._start_call(method, kwargs)
        try:
            raw = await wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine {self.name!r} did not answer {method}() within {timeout}s") from None
        finally:
            with self._lock:
                self._calls.pop(call_id, None)
        return decode_value(raw, _type)

    def configure(self, **changes: Any) -> dict:
        """Change settings; applied by the engine at the next step boundary. Returns the
        effective settings. Invalid names/values raise ValueError/TypeError (nothing applied)."""
        return self.call("configure", **changes)

    async def aconfigure(self, **changes: Any) -> dict:
        return await self.acall("configure", **changes)

    async def asettings(self) -> dict:
        return await self.acall("settings")

    async def ametrics(self) -> dict:
        return await self.acall("metrics")

    async def astatus(self) -> dict:
        return await self.acall("status")

    async def aschema(self) -> list[dict]:
        return await self.acall("schema")

    async def atimeline(self, since: int | None = None) -> Timeline:
        return await self.acall("timeline", since=since, _type=Timeline)

    def settings(self) -> dict:
        return self.call("settings")

    def metrics(self) -> dict:
        return self.call("metrics")

    def status(self) -> dict:
        return self.call("status")

    def schema(self) -> list[dict]:
        return self.call("schema")

    def weights_checksum(self) -> str:
        return self.call("weights_checksum")

    def reset_prefix_cache(self) -> int:
        return self.call("reset_prefix_cache")

    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probability of each token after the first given those before it (for perplexity);
        run by the engine between steps without disturbing other requests."""
        return self.call("score", token_ids=list(token_ids))

    def timeline(self, since: int | None = None) -> Timeline:
        """Steps and request events after cursor `since` (all that the ring buffer holds if None)."""
        return self.call("timeline", since=since, _type=Timeline)

    # -- requests -------------------------------------------------------------------------------
    def submit(
        self,
        batch,
        sink: Callable[[Any], None],
        *,
        chat: bool = False,
        stream: bool = False,
        into: list[str] | None = None,
        ids: list[str] | None = None,
    ) -> list[str]:
        """Send a batch; its ids are appended to `into` before anything is sent, so a caller
        interrupted at any point still knows what to abort. `ids`: the request ids to use (a
        cluster's, so that every replica's timeline names a request as the cluster does)."""
        if ids is not None and len(ids) != len(batch):
            raise ValueError(f"{len(ids)} request ids for {len(batch)} requests")
        given = ids if ids is not None else [secrets.token_hex(6) for _ in batch]
        reqs = [
            NewRequest(request_id=rid, prompt=p, prompt_token_ids=tok, params=sp, chat=bool(chat), stream=stream)
            for rid, (p, tok, sp) in zip(given, batch)
        ]
        rids = [r.request_id for r in reqs]
        if into is not None:
            into.extend(rids)
        self._revive()
        if self._dead is not None:
            raise fresh_copy(self._dead)
        self._pending.add(reqs, sink, stream)  # (if the engine dies now, the post below raises)
        try:
            self._post(Submit(reqs))
        except BaseException:
            # An interrupt can land after the message is queued: abort, so nothing runs unowned.
            self.abandon(rids)
            raise
        return rids

    def abandon(self, rids: list[str]) -> None:
        self._pending.drop(rids)
        if self._dead is None and not self._closed:
            try:
                self._post(Abort(rids))
            except Exception:
                pass

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (of any client) by id; their owner gets finish_reason="abort"."""
        self._post(Abort(request_ids(request_id)))

    # -- events ---------------------------------------------------------------------------------
    def _subscribe(self, sub: EventSubscription, timeout: float) -> EventSubscription:
        self._revive()
        with self._ev_lock:
            if self._dead is not None:
                raise fresh_copy(self._dead)
            self._events.start(self.info, lambda: not self._closing and self._dead is None, timeout)
        self._sync_events(timeout)
        with self._lock:
            self._subs.append(sub)
        return sub

    def _deliver_event(self, ev: Event) -> None:
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub._deliver(ev)

    def _sync_events(self, timeout: float) -> None:
        """Wait until our SUB socket receives events (a PUB drops what it sends before then)."""
        token = secrets.token_hex(8)
        seen = self._events.expect(token)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                self.call("sync_events", token=token, _timeout=max(0.1, deadline - time.monotonic()))
                if seen.wait(0.2):
                    return
            raise TimeoutError(f"event subscription to engine {self.name!r} not live within {timeout}s")
        finally:
            self._events.forget(token)

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Disconnect (the engine aborts this client's unfinished requests). The engine runs on."""
        if self._closed:
            return
        self._closed = True
        self._closing = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        threads = [t for t in (self._io, self._events.thread) if t is not None]
        for t in threads:
            if t is not threading.current_thread():
                t.join(5)
        self._set_dead(WorkbenchIPCError(f"this client of engine {self.name!r} is closed"), quiet=True)
        _clients.discard(self)
        if any(t.is_alive() for t in threads):
            return  # closed from a callback on one of our threads: it closes its socket on its way out
        for s in (self._wake_r, self._wake_w):
            s.close()
        self._ctx.term()

    def shutdown(self, drain: bool = False, timeout: float = 60.0) -> None:
        """Stop the engine: abort (or, with drain=True, finish) what is in flight, free its
        memory, remove its connection file. Waits until the process is gone."""
        deadline = time.monotonic() + timeout
        if self._dead is None:
            try:
                self.call("shutdown", drain=drain, _timeout=min(timeout, 30.0))
            except (EngineDeadError, WorkbenchIPCError):
                pass
        try:
            self._wait_gone(deadline)
        finally:
            self.close()

    def _wait_gone(self, deadline: float) -> None:
        def gone() -> bool:
            return self._dead is not None or (self._check_pid and not conn.pid_alive(self.pid))

        conn.wait_gone(self.name, self.pid, self.process, gone, deadline)
