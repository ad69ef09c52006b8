"""An engine client's event feed: the engine's PUB socket read by a thread of its own (started
on the first subscription), each event handed to the client (`deliver`).

A PUB socket drops what it publishes before a SUB socket has joined, so a new subscription waits
until its feed is live: the client asks the engine to publish a `sync` token, and the feed sets
the token's event when it arrives (`expect`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq

from ..timeline import Timeline
from . import connection as conn
from .protocol import Event, check_header, decode_event, decode_value

log = logging.getLogger("workbench.client")


class EventFeed:
    def __init__(self, ctx: zmq.Context, name: str, deliver: Callable[[Event], None]):
        self._ctx = ctx
        self.name = name
        self.deliver = deliver
        self.thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._tokens: dict[str, threading.Event] = {}

    def start(self, info: conn.ConnectionInfo, running: Callable[[], bool], timeout: float) -> None:
        """The feed's thread on `info`'s event address (once), reading while `running()`."""
        if self.thread is not None:
            return
        self.thread = threading.Thread(
            target=self._loop, args=(info, running), name=f"wb-client-events-{self.name}", daemon=True
        )
        self.thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("event thread did not start")

    def reset(self) -> None:
        """Forget the old engine's feed (a client reconnecting to a new one)."""
        self.thread = None
        self._ready.clear()

    def expect(self, token: str) -> threading.Event:
        """An event set when the engine's `sync` event carrying `token` comes through this feed."""
        seen = self._tokens[token] = threading.Event()
        return seen

    def forget(self, token: str) -> None:
        self._tokens.pop(token, None)

    def _loop(self, info: conn.ConnectionInfo, running: Callable[[], bool]) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        conn.apply_curve(sock, info)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(info.event_address)
        self._ready.set()
        try:
            while running():
                if not sock.poll(200):
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
        except Exception:  # pragma: no cover
            log.exception("client event thread crashed")
        finally:
            sock.close()

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or check_header(frames[1]) is not None:
            return
        try:
            msg = decode_event(frames[2])
            data: Any = decode_value(msg.data, Timeline if msg.kind == "timeline" else Any)
        except Exception as e:
            log.warning("dropping an undecodable event: %s", e)
            return
        if msg.kind == "sync":
            token = data.get("token") if isinstance(data, dict) else None
            seen = self._tokens.get(token)
            if seen is not None:
                seen.set()
            return
        self.deliver(Event(msg.kind, msg.time, data))
