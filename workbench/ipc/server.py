"""The engine process: one `LLMEngine` served to many clients over ZeroMQ.

    python -m workbench.ipc.engine_main [--model M] [--name N] [--<setting> value ...]   (`engine_main.py`)
    workbench serve ...          (the same, from the CLI)

`EngineServer` is the engine loop; its sockets and their IO threads are `transport.Transport`.
Threads:

- main: the step loop, the only thread that touches the engine (apart from what
  `LLMEngine.THREAD_SAFE` declares; tests/test_engine_loop_thread.py checks it). It drains the
  transport's inbox (requests, aborts, stops, RPCs, "client gone" notices), then runs one
  `engine.core_step()`, routes its outputs (new token ids) to their requesters, and publishes
  timeline increments. Text is the client's to make (`workbench.processing.output` in the engine
  client): no detokenizing or stop-string search on this loop.
  Adding, aborting, configuring, reading metrics all run here, between steps, so a setting never
  changes under a running step (vLLM v1's busy loop reads the same: poll inputs, then step).
- tokenizer: processes submitted requests (`engine.inputs`, an `InputProcessor`, handed over by
  the loop: token ids, checks, a constraint compiled; the tokenizer releases the GIL) and hands
  them back through the inbox, so a huge prompt never stalls the steps of other requests. What
  waits for it, and what waits to run, is bounded (admission control: `EngineBusyError`).
- calls: builds the answers of calls that take long (hashing the weights, encoding a long
  timeline) from what the loop took for them.
- the transport's router IO and event IO threads (`transport.py`).

SIGTERM or Ctrl-C drains: new requests and handshakes are refused, running requests finish until
the drain deadline (`--drain-timeout`), the rest are aborted. A second signal exits at once,
removing the connection file and sockets first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from ..reports import ProcessStatus, as_dict
from ..settings import schema
from . import connection as conn
from .heap import HeapTrim
from .logs import MAX_LOG_BYTES, QuietLog, rotate_log, short
from .protocol import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_MESSAGE_MB,
    DEFAULT_MAX_QUEUED_CHARS,
    DEFAULT_MAX_QUEUED_TOKENS,
    METRICS_EVERY_S,
    PROTOCOL_VERSION,
    Abort,
    Call,
    EngineBusyError,
    EngineDrainingError,
    ErrorInfo,
    Failure,
    Outputs,
    Rejected,
    Result,
    Stop,
    Submit,
    encode_raw,
    encode_raw_in_pieces,
    error_to_wire,
)
from .transport import Transport

log = logging.getLogger("workbench.engine")

INLINE_TOKENIZE_CHARS = 4096  # prompt characters (or ids) of a submit tokenized on the step loop itself
TIMELINE_FLUSH_S = 0.05  # publish step/request events at most 20 times a second


class EngineServer:
    def __init__(
        self,
        engine,
        *,
        name: str,
        transport: str = "ipc",
        host: str = "127.0.0.1",
        port: int = 0,
        client_timeout_s: float = 10.0,
        max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
        parent_pid: int | None = None,
        directory: Path | None = None,
        log_file: str | None = None,
        max_queued_chars: int = DEFAULT_MAX_QUEUED_CHARS,
        max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ):
        for what, value in (
            ("max_queued_chars", max_queued_chars),
            ("max_queued_tokens", max_queued_tokens),
            ("drain_timeout_s", drain_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{what} must be > 0, got {value}")
        self.engine = engine
        self.name = conn.check_name(name)
        self.io = Transport(
            self.name,
            transport=transport,
            host=host,
            port=port,
            client_timeout_s=client_timeout_s,
            max_message_bytes=int(max_message_mb * 2**20),
            directory=directory or conn.runtime_dir(),
            max_prompt_tokens=engine.max_model_len - 1,
            stopping=lambda: self._stop_mode is not None,  # heartbeats tell the clients
        )
        self.parent_pid = parent_pid
        self.log_file = log_file
        self.max_queued_chars, self.max_queued_tokens = int(max_queued_chars), int(max_queued_tokens)
        self.drain_timeout_s = float(drain_timeout_s)
        self.started = time.monotonic()

        self._heap = HeapTrim()
        # request_id -> its client's identity, and whether the client reads every step's ids
        self._owners: dict[str, tuple[bytes, bool]] = {}
        self._owned: dict[bytes, set[str]] = defaultdict(set)
        self._client_names: dict[bytes, str] = {}
        self._stop_mode: str | None = None  # None | "abort" | "drain"
        self._drain_deadline: float | None = None  # a signal's drain ends here
        self._tokenize_q: queue.SimpleQueue = queue.SimpleQueue()
        self._rejections = QuietLog(log)  # refused configure calls: a fuzzer's flood stays a few lines
        self._tokenizing: dict[str, bytes] = {}  # request_id -> owner, while its prompt is tokenized
        self._tokenizing_chars = 0
        self._cancelled: dict[str, str] = {}  # request_id being tokenized -> "abort" | "gone"
        self._tl_cursor = engine.timeline.cursor
        self._last_tl_flush = 0.0
        self._last_metrics = 0.0
        self._stalled = False
        self._tok: tuple[msgspec.Raw | None, str | None] | None = None
        self.connection_file: Path | None = None
        self.info: conn.ConnectionInfo | None = None
        # Every method takes the caller's identity first (hello names it, configure records it).
        self._methods = {
            "hello": self._hello,
            "configure": self._configure,
            "settings": lambda _who: self.engine.settings.as_dict(),
            "metrics": lambda _who, **kw: self.engine.metrics(**kw),
            "status": lambda _who: self.status(),
            "timeline": lambda _who, **kw: self._timeline(**kw),
            "reset_prefix_cache": lambda _who: self.engine.reset_prefix_cache(),
            "weights_checksum": lambda _who: lambda: encode_raw(self.engine.weights_checksum()),
            "schema": lambda _who: schema(),
            "tokenizer": lambda _who: self._tokenizer()[0],
            "shutdown": lambda _who, **kw: self._shutdown_rpc(**kw),
            "sync_events": lambda _who, **kw: self._sync_events(**kw),
        }
        # Calls whose answer takes long to build (hashing the weights, encoding a long timeline):
        # the step loop takes what they read and a worker thread builds and sends the answer, so
        # steps go on meanwhile. Their method returns that work as a function.
        self._background_calls = {"timeline", "weights_checksum"}
        self._call_q: queue.SimpleQueue = queue.SimpleQueue()
        if hasattr(engine, "score"):  # log-probabilities of a token sequence (perplexity), between steps
            self._methods["score"] = lambda _who, token_ids, **kw: self.engine.score(token_ids, **kw)
        engine.event_hooks.append(self._on_engine_event)

    # -- setup ----------------------------------------------------------------------------------
    def start(self) -> Path:
        """Bind the sockets, start the threads, then write the connection file (= ready)."""
        self.io.bind()
        self._tokenizer_thread = threading.Thread(target=self._tokenize_loop, name="wb-tokenizer", daemon=True)
        self._call_thread = threading.Thread(target=self._background_loop, name="wb-calls", daemon=True)
        self._tokenizer_thread.start()
        self._call_thread.start()
        self.info, self.connection_file = self.io.announce(self.engine.model_name, self.log_file)
        log.info(
            "engine %r ready (pid %d, model %s, %s); connection file %s",
            self.name,
            os.getpid(),
            self.engine.model_name,
            self.info.request_address,
            self.connection_file,
        )
        return self.connection_file

    # -- main loop ------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        received = []

        def handler(signum, frame):
            received.append(signum)
            if len(received) > 1:  # a second Ctrl-C / SIGTERM: stop waiting for the drain
                self.io.remove_files()
                os._exit(128 + signum)
            self.io.inbox.put(("signal", None, signal.Signals(signum).name))

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def serve_forever(self) -> None:
        self.io.publish("engine", {"state": "ready", "name": self.name, "pid": os.getpid()})
        last_parent_check = time.monotonic()
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                self._drain_inbox(0.0 if busy and not self._stalled else (0.005 if busy else 0.05))
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    log.warning(
                        "drain deadline (%.0f s) passed: aborting %d request(s)",
                        self.drain_timeout_s,
                        len(self.engine.requests),
                    )
                    self._stop_mode = "abort"
                drained = not self.engine.has_unfinished_requests() and not self._tokenizing
                if self._stop_mode == "abort" or (self._stop_mode == "drain" and drained):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                t = time.monotonic()
                if t - self._last_tl_flush >= TIMELINE_FLUSH_S:
                    self._flush_timeline(t)
                if t - self._last_metrics >= METRICS_EVERY_S:
                    self._last_metrics = t
                    if self.log_file:
                        rotate_log(self.log_file, MAX_LOG_BYTES)
                    self.io.publish("metrics", self.engine.metrics())
                    if not self.engine.has_unfinished_requests():
                        self._heap.when_idle()
                if self.parent_pid and t - last_parent_check > 0.5:
                    last_parent_check = t
                    if os.getppid() != self.parent_pid:
                        log.warning(
                            "the process that started this engine (pid %d) is gone; shutting down", self.parent_pid
                        )
                        self._stop_mode = "abort"
        finally:
            self.close()

    def _drain_inbox(self, wait: float) -> None:
        try:
            item = self.io.inbox.get(timeout=wait) if wait > 0 else self.io.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.io.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, ident: bytes | None, payload: Any) -> None:
        if kind == "msg":
            payload, size = payload
            if size is not None:  # a counted submit or call
                self.io.taken(ident, size)
                self._heap.handled(size)
            if isinstance(payload, Submit):
                self._on_submit(ident, payload)
            elif isinstance(payload, Abort):
                for rid in payload.request_ids:
                    self._abort(rid)
            elif isinstance(payload, Stop):
                if self._owners.get(payload.request_id, (None,))[0] == ident:  # only its client reads its text
                    out = self.engine.core_stop(payload.request_id, payload.keep)
                    if out is not None:
                        self._route([out])
            elif isinstance(payload, Call):
                self._on_call(ident, payload)
        elif kind == "encoded":
            self._on_encoded(ident, *payload)
        elif kind == "answer":
            self.io.send(ident, payload)
            self._heap.after_answer(payload)
        elif kind == "gone":
            rids = self._owned.pop(ident, set())
            self._client_names.pop(ident, None)
            for rid in list(rids):
                self._abort(rid)
            for rid, owner in self._tokenizing.items():
                if owner == ident:
                    self._cancelled[rid] = "gone"
            if rids:
                log.warning("client %r vanished (%s): aborted %d request(s)", ident, payload, len(rids))
        elif kind == "crash":
            log.error("%s: shutting down", payload)
            self._stop_mode = "abort"
        elif kind == "signal":
            if self._stop_mode is None:
                log.info("%s: draining (up to %.0f s; a second signal stops at once)", payload, self.drain_timeout_s)
                self._stop_mode = "drain"
                self._drain_deadline = time.monotonic() + self.drain_timeout_s

    def _on_submit(self, ident: bytes, msg: Submit) -> None:
        reqs = msg.requests
        ids = [r.request_id for r in reqs]
        try:
            if self._stop_mode is not None:
                raise EngineDrainingError(f"engine {self.name!r} is shutting down and accepts no new requests")
            if not reqs:
                raise ValueError("submit carries no requests")
            if not all(ids) or len(set(ids)) != len(ids):
                raise ValueError("request ids must be non-empty and distinct")
            taken = [rid for rid in ids if rid in self._owners or rid in self._tokenizing]
            if taken:
                raise ValueError(f"request_id {taken[0]!r} is already in use")
            chars = sum(len(r.prompt or "") + len(r.prompt_token_ids or ()) for r in reqs)
            self._admit(chars)
        except Exception as e:
            self.io.send(ident, Rejected(ids, error_to_wire(e)))
            return
        inputs = self.engine.inputs  # taken here, on the loop: the tokenizer thread never reads the engine
        if chars <= INLINE_TOKENIZE_CHARS and not self._tokenizing and all(inputs.is_compiled(r.params) for r in reqs):
            # Small, and nothing ahead of it: tokenizing here (under a millisecond) costs less
            # than the hand-over to the tokenizer thread and back. A grammar not seen before is
            # compiled there too (a large schema takes seconds).
            self._on_encoded(ident, msg, 0, _process(inputs, msg))
            return
        for rid in ids:
            self._tokenizing[rid] = ident
        self._tokenizing_chars += chars
        self._tokenize_q.put((ident, msg, chars, inputs))

    def _admit(self, chars: int) -> None:
        """Refuse new work while too much waits (one message is always let into an empty queue:
        its size is already bounded by max_message_bytes)."""
        if self._tokenizing_chars and self._tokenizing_chars + chars > self.max_queued_chars:
            raise EngineBusyError(
                f"the engine is busy: prompts of {self._tokenizing_chars:,} characters wait to be tokenized and "
                f"this request adds {chars:,} (limit {self.max_queued_chars:,}); retry later"
            )
        queued = self.engine.num_queued_tokens()
        if queued > self.max_queued_tokens:
            raise EngineBusyError(
                f"the engine is busy: {queued:,} prompt tokens wait to run (limit "
                f"{self.max_queued_tokens:,}); retry later"
            )

    def _tokenize_loop(self) -> None:
        """Tokenizer thread: prompts to token ids, handed back to the main thread in order."""
        from ..tokenizer import lower_thread_priority

        lower_thread_priority()
        while True:
            item = self._tokenize_q.get()
            if item is None:
                return
            ident, msg, chars, inputs = item
            if all(r.request_id in self._cancelled for r in msg.requests):  # nobody waits for them: skip the work
                processed = ValueError("aborted before its prompt was tokenized")
            else:
                processed = _process(inputs, msg)
            self.io.inbox.put(("encoded", ident, (msg, chars, processed)))

    def _on_encoded(self, ident: bytes, msg: Submit, chars: int, processed) -> None:
        reqs = msg.requests
        ids = [r.request_id for r in reqs]
        self._tokenizing_chars -= chars
        for rid in ids:
            self._tokenizing.pop(rid, None)
        cancelled = {rid: self._cancelled.pop(rid) for rid in ids if rid in self._cancelled}
        if "gone" in cancelled.values():
            return  # the client vanished while its prompts were tokenized
        added: list[str] = []
        try:
            if isinstance(processed, BaseException):
                raise processed
            if self._stop_mode == "abort":  # a drain still runs what it accepted before the signal
                raise EngineDrainingError(f"engine {self.name!r} is shutting down and accepts no new requests")
            try:
                for r, req in zip(reqs, processed):
                    added.append(self.engine.core_add(req, request_id=r.request_id))
            except BaseException:
                for rid in added:
                    self.engine.core_abort(rid)
                raise
        except Exception as e:
            self.io.send(ident, Rejected(ids, error_to_wire(e)))
            return
        for r, req in zip(reqs, processed):
            steps = r.stream or bool(req.params.stop) or req.params.logprobs is not None
            self._owners[r.request_id] = (ident, steps)
            self._owned[ident].add(r.request_id)
        for rid in cancelled:  # aborted while tokenized: it ends like any aborted request
            self._abort(rid)

    def _abort(self, rid: str) -> None:
        if rid in self._tokenizing:
            self._cancelled[rid] = "abort"
            return
        out = self.engine.core_abort(rid)
        if out is not None:
            self._route([out])

    def _on_call(self, ident: bytes, call: Call) -> None:
        fn = self._methods.get(call.method)
        try:
            if fn is None:
                raise ValueError(f"unknown method {call.method!r}; known: {', '.join(sorted(self._methods))}")
            value = fn(ident, **call.kwargs)
            if call.method in self._background_calls:
                self._call_q.put((ident, call.call_id, value))
                return
            raw = encode_raw(value)
        except Exception as e:
            self.io.send(ident, Failure(call.call_id, error_to_wire(e)))
            if call.method == "configure":
                self._rejections.note(f"configure {short(call.kwargs)} rejected: {short(e)}")
            return
        self.io.send(ident, Result(call.call_id, raw))

    def _background_loop(self) -> None:
        """Worker thread: build the answers of background calls, hand them to the main thread."""
        while True:
            item = self._call_q.get()
            if item is None:
                return
            ident, call_id, work = item
            try:
                answer = Result(call_id, work())
            except Exception as e:
                answer = Failure(call_id, error_to_wire(e))
            self.io.inbox.put(("answer", ident, answer))

    def _step(self) -> None:
        timeline = self.engine.timeline
        cursor, launched = timeline.cursor, self.engine.totals["overlapped_steps"]
        try:
            outs = self.engine.core_step()
        except Exception as e:
            log.exception("engine step failed; aborting the requests in flight")
            self._fail_all(e)
            return
        sending = time.monotonic()
        self._route(outs)
        if timeline.steps and timeline.steps[-1].seq > cursor:  # the step's event, not yet published
            timeline.steps[-1].parts["send"] = (time.monotonic() - sending) * 1e3
        # no output, no step recorded and none launched (async scheduling's first step records none)
        self._stalled = not outs and timeline.cursor == cursor and self.engine.totals["overlapped_steps"] == launched

    def _fail_all(self, exc: BaseException) -> None:
        err = ErrorInfo("EngineError", f"engine step failed: {type(exc).__name__}: {exc}")
        by_owner: dict[bytes, list[str]] = defaultdict(list)
        for rid, (ident, _) in list(self._owners.items()):
            by_owner[ident].append(rid)
        for rid in list(self.engine.requests):
            try:
                self.engine.core_abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
        self._owners.clear()
        self._owned.clear()
        for ident, rids in by_owner.items():
            self.io.send(ident, Rejected(rids, err))

    def _route(self, outs) -> None:
        """Outputs to their requesters: each step's where the client reads them (a stream, stop
        strings to find, logprobs to gather), else only the last (it carries every id)."""
        by_owner: dict[bytes, list] = defaultdict(list)
        for c in outs:
            owner = self._owners.get(c.request_id)
            if owner is None:
                continue
            ident, steps = owner
            if c.finish_reason is not None:
                del self._owners[c.request_id]
                owned = self._owned.get(ident)
                if owned is not None:
                    owned.discard(c.request_id)
            elif not steps:
                continue
            by_owner[ident].append(c)
        for ident, cs in by_owner.items():
            self.io.send(ident, Outputs(cs))

    def _flush_timeline(self, t: float) -> None:
        self._last_tl_flush = t
        rec = self.engine.timeline
        if rec.cursor == self._tl_cursor:
            return
        new = rec.newer(self._tl_cursor)
        self._tl_cursor = new.cursor
        self.io.publish("timeline", new)

    def _on_engine_event(self, kind: str, payload: dict) -> None:
        if kind == "settings":
            log.info("settings changed by %s: %s", payload.get("by"), payload.get("changes"))
        self._flush_timeline(time.monotonic())
        self.io.publish(kind, payload)

    # -- RPC methods ----------------------------------------------------------------------------
    def _hello(self, ident: bytes, name: str = "", pid: int = 0, protocol: int = PROTOCOL_VERSION) -> dict:
        if protocol != PROTOCOL_VERSION:
            raise ValueError(f"protocol version mismatch: engine speaks {PROTOCOL_VERSION}, client {protocol}")
        if self._stop_mode is not None:
            raise RuntimeError(f"engine {self.name!r} is shutting down; it accepts no new clients")
        self._client_names[ident] = f"{name or 'client'} (pid {pid})"
        log.info("client %s connected", self._client_names[ident])
        return {
            **self.status(),
            "settings": self.engine.settings.as_dict(),
            "heartbeat_s": self.io.heartbeat_s,
            "client_timeout_s": self.io.client_timeout_s,
            "monotonic": time.monotonic(),
            "tokenizer_digest": self._tokenizer()[1],
        }

    def _tokenizer(self) -> tuple[msgspec.Raw | None, str | None]:
        """The model's tokenizer as a `TokenizerSpec`'s msgpack, and the digest that names it, for
        clients' output processors: built, encoded and hashed once (~30 ms), then only sent."""
        if self._tok is None:
            tok = self.engine.tokenizer
            raw = None if tok is None else encode_raw(tok.to_spec())
            self._tok = (raw, None if raw is None else hashlib.sha256(raw).hexdigest()[:16])
        return self._tok

    def _configure(self, ident: bytes, **changes) -> dict:
        return self.engine.apply_settings(changes, by=self._client_names.get(ident, "client"))

    def status(self) -> dict:
        engine = as_dict(self.engine.status_report())
        engine["uptime_s"] = time.monotonic() - self.started  # the process's, across re-layouts and reloads
        return as_dict(
            ProcessStatus(
                **engine,
                name=self.name,
                protocol=PROTOCOL_VERSION,
                transport=self.io.transport,
                num_clients=len(self._client_names),
                num_requests=len(self.engine.requests),
                connection_file=str(self.connection_file) if self.connection_file else None,
                started_monotonic=self.started,
            )
        )

    def _timeline(self, since: int | None = None):
        if since is not None and (not isinstance(since, int) or isinstance(since, bool)):
            raise TypeError(f"since must be an int cursor or None, got {since!r}")
        snapshot = self.engine.timeline.read(since)  # a copy of the lists, taken between steps
        return lambda: encode_raw_in_pieces(snapshot)

    def _shutdown_rpc(self, drain: bool = False) -> dict:
        if not isinstance(drain, bool):
            raise TypeError(f"drain must be a bool, got {drain!r}")
        mode = "drain" if drain else "abort"
        log.info("shutdown requested (%s)", mode)
        if self._stop_mode != "abort":
            self._stop_mode = mode
        return {"state": "stopping", "mode": mode, "pid": os.getpid()}

    def _sync_events(self, token: str = "") -> bool:
        self.io.publish("sync", {"token": token})
        return True

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Abort what is left, answer what is queued, tell everyone, remove the connection file,
        close the sockets."""
        self._stop_mode = "abort"
        self._tokenize_q.put(None)
        self._call_q.put(None)
        for rid in list(self.engine.requests):
            try:
                self._abort(rid)
            except Exception:
                log.exception("abort of %s failed during shutdown", rid)
        self._refuse_queued()
        self._flush_timeline(time.monotonic())
        self.io.publish("engine", {"state": "stopped", "name": self.name, "pid": os.getpid()})
        self.io.remove_files()  # before the sockets close: nobody new finds this engine
        self.io.close()
        log.info("engine %r stopped", self.name)

    def _refuse_queued(self) -> None:
        """Answer what is still in the inbox (a handshake, a submit, a prompt being tokenized)
        instead of leaving its sender waiting for a timeout."""
        err = ErrorInfo("EngineDeadError", f"engine {self.name!r} is shutting down")
        for rid, ident in list(self._tokenizing.items()):
            self.io.send(ident, Rejected([rid], err))
        self._tokenizing.clear()
        while True:
            try:
                kind, ident, payload = self.io.inbox.get_nowait()
            except queue.Empty:
                return
            msg = payload[0] if kind == "msg" else None
            if isinstance(msg, Call):
                self.io.send(ident, Failure(msg.call_id, err))
            elif isinstance(msg, Submit):
                self.io.send(ident, Rejected([r.request_id for r in msg.requests], err))


def _process(inputs, msg: Submit) -> list | BaseException:
    """A submit's requests processed whole (`InputProcessor`), or the error that refuses them all."""
    try:
        return [
            inputs.process(r.prompt, r.params, prompt_token_ids=r.prompt_token_ids, chat=r.chat) for r in msg.requests
        ]
    except Exception as e:
        return e
