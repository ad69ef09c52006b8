"""The engine process's sockets: a ROUTER for requests and answers, a PUB for events, and the
two IO threads that own them. Nothing here calls the engine: what arrives is decoded, checked and
put in `inbox` for the step loop (`server.EngineServer`), and what the loop hands to `send` and
`publish` goes out from here, so socket work overlaps compute.

- router IO: decodes and checks incoming messages, answers pings itself (heartbeats flow while a
  long step runs), refuses at once what a client sends past its bounds, sends the outbox, and
  notices clients that stopped sending heartbeats.
- event IO: encodes and publishes events (steps, request lifecycle, settings changes, relayout
  progress, metrics once a second).

TCP is only offered with CURVE: the engine's keypair plus one client keypair, both written to the
(0600) connection file; a ZAP handler accepts only that client key, so a peer without the keys can
neither submit work nor read events.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from ..tokenizer import too_long_message
from . import connection as conn
from .protocol import (
    HEADER,
    PROTOCOL_VERSION,
    Abort,
    Bye,
    ErrorInfo,
    EventMsg,
    Failure,
    Ping,
    Pong,
    ProtocolError,
    Rejected,
    Stop,
    Submit,
    check_header,
    client_decoder,
    decode_client_message,
    encode,
    encode_raw,
    guess_refs,
    token_id_counts,
)

log = logging.getLogger("workbench.engine")

# What one client may have waiting for the step loop (decoded submits and calls): past either bound
# its next ones are refused at once with EngineBusyError (one message is always taken, whatever its
# size). Without them a client that sent faster than the loop answered grew the engine without end:
# 555k fuzzed messages in 40 s left 10.4 GB resident, the backlog still being worked through.
MAX_PENDING_MESSAGES = 1000
MAX_PENDING_BYTES = 16 << 20
# Per client, messages libzmq holds unread (past it the sender waits: backpressure, nothing lost)
# and answers it holds for a client that does not read them (past it they are dropped: only a
# client that stopped reading its socket, whose libzmq no longer drains it, gets there).
ROUTER_RCVHWM = 64
ROUTER_SNDHWM = 10_000


class Transport:
    """The sockets and IO threads of engine `name`. `bind()` then `announce()` (the connection
    file: ready); the step loop drains `inbox` (("msg", identity, (message, counted size | None)),
    ("gone", identity, why), ("crash", None, why)), calls `taken` for each counted message it
    handled, and answers through `send` / `publish`; `close()` last."""

    def __init__(
        self,
        name: str,
        *,
        transport: str = "ipc",
        host: str = "127.0.0.1",
        port: int = 0,
        client_timeout_s: float = 10.0,
        max_message_bytes: int,
        directory: Path,
        max_prompt_tokens: int | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ):
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        if not client_timeout_s > 0:
            raise ValueError(f"client_timeout_s must be > 0, got {client_timeout_s}")
        self.name, self.transport, self.host, self.port = name, transport, host, int(port)
        self.client_timeout_s = float(client_timeout_s)
        self.heartbeat_s = min(1.0, self.client_timeout_s / 4)
        self.max_message_bytes = int(max_message_bytes)
        self.directory = directory
        # token-id prompts longer than this are refused before their ids are decoded
        self.max_prompt_tokens = max_prompt_tokens
        self._decode = decode_client_message if max_prompt_tokens is None else client_decoder(max_prompt_tokens).decode
        self._stopping = stopping  # whether the loop drains or aborts: pongs tell the clients
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._outbox: deque = deque()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._io_stop = threading.Event()
        self._clients: dict[bytes, float] = {}  # router thread only: identity -> last seen
        # identity -> (messages, bytes) in the inbox, not yet handled by the step loop
        self._pending: dict[bytes, tuple[int, int]] = {}
        self._pending_lock = threading.Lock()
        self._own_ipc_dir: Path | None = None
        self._ipc_files: list[str] = []
        self._curve: dict[str, str] | None = None
        self._auth = None
        self.addresses: tuple[str, str] | None = None  # (requests, events), once bound

    def bind(self) -> None:
        """Bind the sockets and start the IO threads."""
        if self.transport == "ipc":
            req_addr, evt_addr, self._own_ipc_dir = conn.ipc_addresses(self.name, self.directory)
        else:
            req_addr = f"tcp://{self.host}:{self.port or '*'}"
            evt_addr = f"tcp://{self.host}:*"
            self._setup_curve()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._pub = self._ctx.socket(zmq.PUB)
        for s in (self._router, self._pub):
            s.setsockopt(zmq.LINGER, 2000)
            if self._curve is not None:
                s.curve_server = True
                s.curve_secretkey = self._curve["server_secret"].encode()
                s.curve_publickey = self._curve["server_public"].encode()
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.SNDHWM, ROUTER_SNDHWM)
        self._router.setsockopt(zmq.RCVHWM, ROUTER_RCVHWM)
        self._router.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        self._router.bind(req_addr)
        self._pub.bind(evt_addr)
        req_addr = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        evt_addr = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.addresses = (req_addr, evt_addr)
        if self.transport == "ipc":
            self._ipc_files = [a.removeprefix("ipc://") for a in (req_addr, evt_addr)]
        # Wakes the router thread when the step loop queued something to send.
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://wake-{id(self)}")
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://wake-{id(self)}")
        self._router_thread = threading.Thread(target=self._router_loop, name="wb-router-io", daemon=True)
        self._event_thread = threading.Thread(target=self._event_loop, name="wb-event-io", daemon=True)
        self._router_thread.start()
        self._event_thread.start()

    def announce(self, model: str, log_file: str | None) -> tuple[conn.ConnectionInfo, Path]:
        """Write the connection file: from here on clients find the engine."""
        curve = None
        if self._curve is not None:
            curve = {k: self._curve[k] for k in ("server_public", "client_public", "client_secret")}
        req_addr, evt_addr = self.addresses
        info = conn.ConnectionInfo(
            name=self.name,
            pid=os.getpid(),
            transport=self.transport,
            request_address=req_addr,
            event_address=evt_addr,
            model=model,
            heartbeat_s=self.heartbeat_s,
            client_timeout_s=self.client_timeout_s,
            max_message_bytes=self.max_message_bytes,
            protocol=PROTOCOL_VERSION,
            curve=curve,
            log_file=log_file,
        )
        return info, conn.write_connection_file(info, self.directory)

    def _setup_curve(self) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support; TCP needs it (use transport='ipc')")
        from zmq.auth.thread import ThreadAuthenticator

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        self._curve = {
            k: v.decode()
            for k, v in dict(
                server_public=server_public,
                server_secret=server_secret,
                client_public=client_public,
                client_secret=client_secret,
            ).items()
        }
        allowed = client_public

        class _OneKey:
            def callback(self, domain, key):  # key: z85 public key of the connecting client
                return key == allowed

        self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("workbench.engine.auth"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_OneKey())

    # -- router IO thread (its socket only) -------------------------------------------------------------------------
    def _router_loop(self) -> None:
        sock, wake = self._router, self._wake_rx
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        next_check = time.monotonic() + self.heartbeat_s
        try:
            while True:
                ready = dict(poller.poll(100))
                if wake in ready:
                    while True:
                        try:
                            wake.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self._flush_outbox()
                if sock in ready:
                    for _ in range(256):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                    self._flush_outbox()
                t = time.monotonic()
                if t >= next_check:
                    next_check = t + self.heartbeat_s / 2
                    self._check_clients(t)
                if self._io_stop.is_set():
                    self._flush_outbox()
                    break
        except Exception:  # pragma: no cover - a bug here must not hang clients silently
            log.exception("router IO thread crashed")
            self.inbox.put(("crash", None, "router IO thread crashed"))
        finally:
            sock.close()
            wake.close()

    def _flush_outbox(self) -> None:
        while self._outbox:
            ident, msg = self._outbox.popleft()
            self._send_now(ident, msg)

    def _send_now(self, ident: bytes, msg: Any) -> None:
        try:
            self._router.send_multipart([ident, HEADER, encode(msg)], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # unknown peer is dropped silently by ROUTER; anything else: log
            log.debug("send to %r failed: %s", ident, e)

    def _on_frames(self, frames: list[bytes]) -> None:
        ident = frames[0]
        if len(frames) != 3:
            self._send_now(ident, ProtocolError(f"expected 2 frames [header, body], got {len(frames) - 1}"))
            return
        header, body = frames[1], frames[2]
        problem, kind = check_header(header), "ProtocolMismatchError"
        if problem is None:
            try:
                msg = self._decode(body)
            except msgspec.ValidationError as e:  # well-formed msgpack, wrong shape or values
                problem, kind = f"invalid message: {e}", "ValueError"
                if self.max_prompt_tokens is not None and f"of length <= {self.max_prompt_tokens} -" in str(e):
                    n = next(c for c in token_id_counts(body) if c is not None and c > self.max_prompt_tokens)
                    problem = too_long_message(f"prompt has {n} tokens", self.max_prompt_tokens + 1)
            except Exception as e:  # msgspec.DecodeError: not msgpack at all
                problem = f"undecodable message: {e}"
        if problem is not None:
            call_id, request_ids = guess_refs(body)
            err = ErrorInfo(kind, problem)
            if call_id is not None:
                self._send_now(ident, Failure(call_id, err))
            elif request_ids:
                self._send_now(ident, Rejected(request_ids, err))
            else:
                self._send_now(ident, ProtocolError(problem))
            return
        self._clients[ident] = time.monotonic()
        if isinstance(msg, Ping):
            self._send_now(ident, Pong(time.monotonic(), self._stopping()))
        elif isinstance(msg, Bye):
            self._clients.pop(ident, None)
            self.inbox.put(("gone", ident, "said bye"))
        elif isinstance(msg, (Abort, Stop)):  # always taken, not counted: dropping one would leave requests running
            self.inbox.put(("msg", ident, (msg, None)))
        elif self._take(ident, len(body)):
            self.inbox.put(("msg", ident, (msg, len(body))))
        else:
            n, size = self._pending[ident]
            err = ErrorInfo(
                "EngineBusyError",
                f"{n} messages ({size / 2**20:.1f} MiB) from this client already wait for the engine's step "
                f"loop (at most {MAX_PENDING_MESSAGES}, {MAX_PENDING_BYTES >> 20} MiB); wait for answers "
                "before sending more",
            )
            self._send_now(ident, Rejected([r.request_id for r in msg.requests], err) if isinstance(msg, Submit)
                           else Failure(msg.call_id, err))  # fmt: skip

    def _take(self, ident: bytes, size: int) -> bool:
        """Count a message toward what `ident` has waiting, unless that is already at a bound."""
        with self._pending_lock:
            n, total = self._pending.get(ident, (0, 0))
            if n and (n >= MAX_PENDING_MESSAGES or total + size > MAX_PENDING_BYTES):
                return False
            self._pending[ident] = (n + 1, total + size)
            return True

    def taken(self, ident: bytes, size: int) -> None:
        """The step loop took a counted message of `ident`'s."""
        with self._pending_lock:
            n, total = self._pending.get(ident, (1, size))
            if n <= 1:
                self._pending.pop(ident, None)
            else:
                self._pending[ident] = (n - 1, total - size)

    def _check_clients(self, t: float) -> None:
        for ident, seen in list(self._clients.items()):
            if t - seen > self.client_timeout_s:
                del self._clients[ident]
                self.inbox.put(("gone", ident, f"no heartbeat for {t - seen:.1f}s"))

    # -- event IO thread --------------------------------------------------------------------------
    def _event_loop(self) -> None:
        pub = self._pub
        try:
            while True:
                item = self._events.get()
                if item is None:
                    break
                kind, t, data = item
                try:
                    body = encode(EventMsg(kind, t, encode_raw(data)))
                    pub.send_multipart([kind.encode(), HEADER, body], zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass
                except Exception:
                    log.exception("could not publish a %s event", kind)
        finally:
            pub.close()

    def publish(self, kind: str, data: Any) -> None:
        self._events.put((kind, time.monotonic(), data))

    def send(self, ident: bytes, msg: Any) -> None:
        """Queue an answer for `ident` (any thread); the router thread sends it."""
        self._outbox.append((ident, msg))
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- teardown -------------------------------------------------------------------------------
    def remove_files(self) -> None:
        """The connection file and ipc sockets: nobody new finds the engine."""
        conn.remove_connection_file(self.name, os.getpid(), self.directory)
        for f in self._ipc_files:
            Path(f).unlink(missing_ok=True)
        if self._own_ipc_dir is not None:
            shutil.rmtree(self._own_ipc_dir, ignore_errors=True)

    def close(self) -> None:
        """Send what is queued, stop the IO threads, close the sockets."""
        self._io_stop.set()
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._router_thread.join(5)
        self._events.put(None)
        self._event_thread.join(5)
        self._wake_tx.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
