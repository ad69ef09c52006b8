"""`EventSubscription`: what an engine's events are delivered through, for every `Engine` (the
in-process `LLM` after each step, `EngineClient` from its event thread, `RemoteEngineClient` from
its loop); the engine provides ``_unsubscribe(sub)``."""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import msgspec

log = logging.getLogger("workbench.client")

POLL_S = 0.5  # longest a waiting caller sleeps before re-checking (keeps Ctrl-C responsive)

_CLOSED = object()
EVENT_KINDS = ("timeline", "settings", "relayout", "metrics", "engine")
METRICS_EVERY_S = 1.0  # how often every engine (process, in-process, remote client) publishes "metrics"


class Event(msgspec.Struct):
    """What subscribers receive. ``data`` is a `Timeline` for "timeline" events, else a dict."""

    kind: str
    time: float
    data: Any


class EventSubscription:
    """Events from the engine: iterate (blocking), `get(timeout)`, or give a callback.

    ``kinds`` filters: "timeline" (new steps, request events and settings changes, data is a
    `Timeline`), "settings" ({"changes", "settings", "by"}), "relayout" ({"setting", "value", "state"}),
    "metrics" (the metrics dict, once a second) and "engine" ({"state": "ready"|"stopped"}).
    A slow consumer loses the oldest events (counted in ``dropped``), never blocks the engine.
    """

    def __init__(
        self,
        client: Any,
        kinds: Iterable[str] | None,
        callback=None,
        maxsize: int = 10_000,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self._client = client
        self.kinds = None if kinds is None else frozenset([kinds] if isinstance(kinds, str) else kinds)
        self._callback = callback
        self._loop = loop
        self._queue: queue.Queue = queue.Queue(maxsize)
        self._aqueue: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self.dropped = 0
        self.closed = False

    def _deliver(self, item: Event | BaseException) -> None:
        if self.closed:
            return
        if isinstance(item, Event) and self.kinds is not None and item.kind not in self.kinds:
            return
        if self._callback is not None:
            if isinstance(item, Event):
                try:
                    self._callback(item)
                except Exception:
                    log.exception("event callback failed")
            return
        if self._aqueue is not None:
            try:
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, item)
            except RuntimeError:  # loop closed
                self.closed = True
            return
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def get(self, timeout: float | None = None) -> Event:
        """The next event; TimeoutError after `timeout` seconds; EngineDeadError when the engine
        is gone; RuntimeError once closed."""
        ev = self._next(timeout)
        if ev is None:
            raise RuntimeError("this event subscription is closed")
        return ev

    def _next(self, timeout: float | None) -> Event | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.closed:
                return None
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"no event within {timeout}s")
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def __iter__(self) -> Iterator[Event]:
        while (ev := self._next(None)) is not None:
            yield ev

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._aiter()

    async def _aiter(self):
        if self._aqueue is None:
            raise TypeError("use client.aevents() for async iteration")
        while not self.closed:
            item = await self._aqueue.get()
            if item is _CLOSED:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._client._unsubscribe(self)
        if self._aqueue is not None:
            try:
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, _CLOSED)
            except RuntimeError:
                pass

    def __enter__(self) -> EventSubscription:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
