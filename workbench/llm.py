"""`LLM`: the engine in this process, an `Engine` stepped by whichever call is waiting.

There is no background thread: `generate`, `stream` (and the asyncio twins) run engine steps
until their own output is there, and every request's chunks go to its own caller, so two streams
iterated in turn both progress. Events (`events`, `on_event`) are delivered after each step.
One thread at a time: the engine's state is not locked against concurrent steps.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .engine.llm_engine import LLMEngine
from .events import METRICS_EVERY_S, Event, EventSubscription
from .interface import Engine, request_ids
from .outputs import StreamChunk


class LLM(Engine):
    def __init__(self, model: str | None = None, **settings: Any):
        self.engine = LLMEngine(model, **settings)
        self._sinks: dict[str, tuple[Callable[[Any], None], bool]] = {}
        self._lock = threading.RLock()
        self._subs: list[EventSubscription] = []
        self._tl_cursor = self.engine.timeline.cursor
        self._last_metrics = 0.0
        self.engine.event_hooks.append(self._on_engine_event)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def name(self) -> str:
        return "in-process"

    # -- primitives -------------------------------------------------------------------------------
    def submit(
        self,
        batch,
        sink: Callable[[Any], None],
        *,
        chat: bool = False,
        stream: bool = False,
        into: list[str] | None = None,
    ) -> list[str]:
        # Process everything first (a constraint compiles, or is refused) so one bad prompt submits nothing.
        inputs = self.engine.inputs
        processed = [inputs.process(p, sp, prompt_token_ids=ids, chat=chat) for p, ids, sp in batch]
        submitted: list[str] = []
        try:
            for req in processed:
                rid = self.engine.add_processed(req)
                self._sinks[rid] = (sink, stream)
                submitted.append(rid)
                if into is not None:
                    into.append(rid)
        except Exception:
            self.abandon(submitted)
            raise
        return submitted

    def abandon(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sinks.pop(rid, None)
            self.engine.abort_request(rid)

    def poll(self, q: queue.SimpleQueue, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while q.empty():
            if not self.engine.has_unfinished_requests():
                return q.get(timeout=max(0.0, deadline - time.monotonic()))  # nothing to step
            self._step()
            if time.monotonic() >= deadline and q.empty():
                raise queue.Empty
        return q.get_nowait()

    async def apoll(self, aq: asyncio.Queue) -> Any:
        while aq.empty():
            if not self.engine.has_unfinished_requests():
                return await aq.get()
            self._step()
            await asyncio.sleep(0)  # lets the sinks' call_soon callbacks (and other tasks) run
        return aq.get_nowait()

    def _step(self) -> None:
        for chunk in self.engine.step():
            self._deliver(chunk)
        self._publish_progress()

    def _deliver(self, chunk: StreamChunk | None) -> None:
        if chunk is None:
            return
        entry = self._sinks.get(chunk.request_id)
        if entry is None:
            return
        sink, stream = entry
        if chunk.finish_reason is not None:
            del self._sinks[chunk.request_id]
        elif not stream:
            return
        sink(chunk)

    # -- control and views --------------------------------------------------------------------------
    def abort(self, request_id: str | Iterable[str]) -> None:
        for rid in request_ids(request_id):
            self._deliver(self.engine.abort_request(rid))

    def configure(self, **changes) -> dict:
        return self.engine.configure(**changes)

    def settings(self) -> dict:
        return self.engine.settings.as_dict()

    def status(self) -> dict:
        return self.engine.status()

    def metrics(self) -> dict:
        return self.engine.metrics()

    def schema(self) -> list[dict]:
        from .settings import schema

        return schema()

    def timeline(self, since: int | None = None):
        return self.engine.timeline.read(since)

    def score(self, token_ids: list[int]) -> list[float]:
        return self.engine.score(token_ids)

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def weights_checksum(self) -> str:
        return self.engine.weights_checksum()

    # -- events -------------------------------------------------------------------------------------
    def _subscribe(self, sub: EventSubscription, timeout: float = 10.0) -> EventSubscription:
        """Events are delivered after each step ("engine" events: none, the engine is this process)."""
        with self._lock:
            self._subs.append(sub)
        return sub

    def _publish(self, kind: str, data: Any) -> None:
        with self._lock:
            subs = list(self._subs)
        ev = Event(kind, time.monotonic(), data)
        for sub in subs:
            sub._deliver(ev)

    def _publish_progress(self) -> None:
        if not self._subs:
            return
        rec = self.engine.timeline
        if rec.cursor != self._tl_cursor:
            tl = rec.read(self._tl_cursor)
            self._tl_cursor = rec.cursor
            self._publish("timeline", tl)
        now = time.monotonic()
        if now - self._last_metrics >= METRICS_EVERY_S:
            self._last_metrics = now
            self._publish("metrics", self.engine.metrics())

    def _on_engine_event(self, kind: str, payload: dict) -> None:
        if self._subs:
            self._publish_progress()
            self._publish(kind, payload)

    # -- lifecycle ------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return True

    def close(self) -> None:
        """Abort what is still running and end the event subscriptions (the engine stays usable)."""
        self.abandon(list(self._sinks))
        with self._lock:
            subs, self._subs = self._subs, []
        for sub in subs:
            sub.close()

    def shutdown(self, drain: bool = False, timeout: float = 60.0) -> None:
        self.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
