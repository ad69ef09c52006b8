"""The engine interface: one set of calls, wherever the engine runs.

    eng = workbench.LLM()                       # in this process, stepped by the caller's thread
    eng = workbench.start_engine()              # an engine process, over ZeroMQ (`ipc.client.EngineClient`)
    eng = workbench.connect("my-engine")        # attach by name, connection file or http(s):// URL
    eng = workbench.connect("http://gpu:8000")  # any OpenAI-compatible server (`remote.RemoteEngineClient`)

(`connect` is the factory in `workbench/engines.py`, above the three implementations.)

All three are an `Engine`:

- requests: `generate`, `stream` and their asyncio twins `agenerate`, `astream` (same shapes
  everywhere), `abort`;
- control and views: `configure`, `settings`, `metrics`, `status`, `schema`, `timeline`, `events`
  (plus `on_event`), `score`, `reset_prefix_cache`, `weights_checksum`, and the asyncio twins of
  the control calls (`aconfigure`, `asettings`, `ametrics`, `astatus`, `aschema`, `atimeline`);
- lifecycle: `alive`, `close` (detach), `shutdown` (stop the engine where this handle owns it).

The request calls are written once, here, over three primitives each implementation provides:

- ``submit(batch, sink, chat=, stream=, into=) -> ids``: start the normalized requests and hand
  every `StreamChunk` for them (only the last one unless ``stream``; an exception on failure) to
  ``sink``, from any thread. Ids are appended to ``into`` before anything is sent, so a caller
  interrupted at any point knows what to abandon;
- ``abandon(ids)``: stop caring about these unfinished requests (forget their sinks, abort them);
- ``poll(q, timeout)`` / ``apoll(aq)``: the next item a sink put on ``q``. Clients just wait; the
  in-process `LLM` runs engine steps until an item is there.

The workload driver (`workbench.bench.driver`), sweeps and benches use only this interface.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import logging
import queue
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from .events import POLL_S, EventSubscription
from .outputs import RequestOutput, StreamChunk
from .sampling_params import normalize_batch

__all__ = ["Engine", "async_sink", "closed_at_exit", "deliver", "request_ids"]

log = logging.getLogger("workbench.client")

Sink = Callable[[Any], None]  # receives StreamChunk or BaseException


class Engine(abc.ABC):
    """What every engine handle offers (see the module docstring)."""

    # -- primitives ------------------------------------------------------------------------------
    @abc.abstractmethod
    def submit(
        self, batch, sink: Sink, *, chat: bool = False, stream: bool = False, into: list[str] | None = None
    ) -> list[str]:
        """Start `batch` (from `normalize_batch`); chunks go to `sink`; returns the ids in order."""

    @abc.abstractmethod
    def abandon(self, request_ids: list[str]) -> None:
        """Forget these unfinished requests and abort them."""

    def poll(self, q: queue.SimpleQueue, timeout: float) -> Any:
        """The next item on `q`, waiting up to `timeout` s; `queue.Empty` when none came."""
        return q.get(timeout=timeout)

    async def apoll(self, aq: asyncio.Queue) -> Any:
        return await aq.get()

    # -- control and views -----------------------------------------------------------------------
    @abc.abstractmethod
    def abort(self, request_id: str | Iterable[str]) -> None: ...

    @abc.abstractmethod
    def configure(self, **changes: Any) -> dict: ...

    @abc.abstractmethod
    def settings(self) -> dict: ...

    @abc.abstractmethod
    def metrics(self) -> dict: ...

    @abc.abstractmethod
    def status(self) -> dict: ...

    @abc.abstractmethod
    def schema(self) -> list[dict]: ...

    @abc.abstractmethod
    def timeline(self, since: int | None = None): ...

    def events(
        self, kinds: Iterable[str] | str | None = None, *, maxsize: int = 10_000, timeout: float = 10.0
    ) -> EventSubscription:
        """Subscribe to engine events (`events.EVENT_KINDS`); returns once the subscription
        is live, so no event published after this call returns is missed."""
        return self._subscribe(EventSubscription(self, kinds, maxsize=maxsize), timeout)

    def on_event(
        self, callback: Callable, kinds: Iterable[str] | str | None = None, *, timeout: float = 10.0
    ) -> EventSubscription:
        """Call `callback(event)` for each event (on the engine's event thread); `.close()` stops."""
        return self._subscribe(EventSubscription(self, kinds, callback=callback), timeout)

    async def aevents(self, kinds: Iterable[str] | str | None = None, *, timeout: float = 10.0) -> EventSubscription:
        """`async for ev in await eng.aevents(): ...`"""
        loop = asyncio.get_running_loop()
        sub = EventSubscription(self, kinds, loop=loop)
        return await loop.run_in_executor(None, self._subscribe, sub, timeout)

    @abc.abstractmethod
    def _subscribe(self, sub: EventSubscription, timeout: float) -> EventSubscription:
        """Start delivering this engine's events to `sub` (kept in self._subs under self._lock)."""

    @abc.abstractmethod
    def score(self, token_ids: list[int]) -> list[float]: ...

    @abc.abstractmethod
    def weights_checksum(self) -> str | None:
        """A digest of the weights being served (None where the server does not say)."""

    # -- the control calls for asyncio callers (the HTTP front, the Jupyter server) ---------------
    # Each defaults to its blocking twin on a worker thread; the process and remote clients answer
    # on their own I/O loops instead.
    async def aconfigure(self, **changes: Any) -> dict:
        return await asyncio.to_thread(self.configure, **changes)

    async def asettings(self) -> dict:
        return await asyncio.to_thread(self.settings)

    async def ametrics(self) -> dict:
        return await asyncio.to_thread(self.metrics)

    async def astatus(self) -> dict:
        return await asyncio.to_thread(self.status)

    async def aschema(self) -> list[dict]:
        return await asyncio.to_thread(self.schema)

    async def atimeline(self, since: int | None = None):
        return await asyncio.to_thread(self.timeline, since)

    @abc.abstractmethod
    def reset_prefix_cache(self) -> int: ...

    @property
    @abc.abstractmethod
    def alive(self) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def shutdown(self, drain: bool = False, timeout: float = 60.0) -> None: ...

    # -- requests, written once -----------------------------------------------------------------
    def release(self, rids: Iterable[str], finished: set[str]) -> None:
        """Abandon those of `rids` that are not in `finished` (the clean-up after a call)."""
        left = [r for r in rids if r not in finished]
        if left:
            self.abandon(left)

    def generate(
        self, prompts=None, params=None, *, prompt_token_ids=None, chat: bool = False, timeout: float | None = None
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order."""
        batch = normalize_batch(prompts, params, prompt_token_ids)
        q: queue.SimpleQueue = queue.SimpleQueue()
        rids = self.submit(batch, q.put, chat=chat)
        deadline = None if timeout is None else time.monotonic() + timeout
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(rids):
                _collect(done, self._next(q, deadline, timeout))
        finally:
            self.release(rids, set(done))
        return [done[r] for r in rids]

    def stream(
        self, prompt=None, params=None, *, prompt_token_ids=None, chat: bool = False, timeout: float | None = None
    ) -> Iterator[StreamChunk]:
        """Chunks of one request as they are produced. Leaving the loop early (break, exception,
        Ctrl-C) aborts the request."""
        [item] = _one(prompt, params, prompt_token_ids)
        q: queue.SimpleQueue = queue.SimpleQueue()
        [rid] = self.submit([item], q.put, chat=chat, stream=True)
        return self._stream_iter(rid, q, timeout)

    def _stream_iter(self, rid: str, q: queue.SimpleQueue, timeout: float | None) -> Iterator[StreamChunk]:
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = False
        try:
            while not finished:
                item = self._next(q, deadline, timeout)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            self.release([rid], {rid} if finished else set())

    def _next(self, q: queue.SimpleQueue, deadline: float | None, timeout: float | None):
        while True:
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"no result within {timeout}s")
            try:
                return self.poll(q, wait)
            except queue.Empty:
                continue

    async def agenerate(
        self, prompts=None, params=None, *, prompt_token_ids=None, chat: bool = False, timeout: float | None = None
    ) -> list[RequestOutput]:
        batch = normalize_batch(prompts, params, prompt_token_ids)
        aq, sink = async_sink()
        rids = self.submit(batch, sink, chat=chat)
        done: dict[str, RequestOutput] = {}
        try:
            async with _atimeout(timeout):
                while len(done) < len(rids):
                    _collect(done, await self.apoll(aq))
        finally:
            self.release(rids, set(done))
        return [done[r] for r in rids]

    async def astream(
        self, prompt=None, params=None, *, prompt_token_ids=None, chat: bool = False, timeout: float | None = None
    ) -> AsyncIterator[StreamChunk]:
        [item] = _one(prompt, params, prompt_token_ids)
        aq, sink = async_sink()
        [rid] = self.submit([item], sink, chat=chat, stream=True)
        finished = False
        try:
            async with _atimeout(timeout):
                while not finished:
                    got = await self.apoll(aq)
                    if isinstance(got, BaseException):
                        finished = True
                        raise got
                    finished = got.finish_reason is not None
                    yield got
        finally:
            self.release([rid], {rid} if finished else set())

    # -- event subscriptions (an implementation keeps them in self._subs under self._lock) --------
    def _unsubscribe(self, sub) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)


def closed_at_exit() -> weakref.WeakSet:
    """A registry of engine handles closed when the interpreter exits (their threads are daemons)."""
    handles: weakref.WeakSet = weakref.WeakSet()
    atexit.register(_close_each, handles)
    return handles


def _close_each(handles: weakref.WeakSet) -> None:
    for handle in list(handles):
        try:
            handle.close()
        except Exception:
            pass


def deliver(sink: Sink, item: Any) -> None:
    """Hand `item` to a caller's sink; a consumer that went away (a closed event loop) is skipped."""
    try:
        sink(item)
    except Exception:
        log.debug("dropping an item for a gone consumer", exc_info=True)


def request_ids(request_id: str | Iterable[str]) -> list[str]:
    """`abort`'s argument as a list of ids (a str or an iterable of str)."""
    ids = [request_id] if isinstance(request_id, str) else list(request_id)
    if not all(isinstance(r, str) for r in ids):
        raise TypeError("request_id must be a str or a list of str")
    return ids


def _one(prompt, params, prompt_token_ids):
    return normalize_batch(prompt, params, None if prompt_token_ids is None else [prompt_token_ids])


def _collect(done: dict[str, RequestOutput], item: Any) -> None:
    """One item for a generate call: raise an error, keep a finished request's output."""
    if isinstance(item, BaseException):
        raise item
    if item.finish_reason is not None:
        done[item.request_id] = item.output


def async_sink() -> tuple[asyncio.Queue, Sink]:
    loop = asyncio.get_running_loop()
    aq: asyncio.Queue = asyncio.Queue()

    def sink(item: Any) -> None:
        loop.call_soon_threadsafe(aq.put_nowait, item)

    return aq, sink


class _atimeout:
    """`asyncio.timeout` for Python 3.10 too: cancels the body after `seconds` (None: never)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self._handle = None
        self._fired = False

    async def __aenter__(self):
        if self.seconds is not None:
            task = asyncio.current_task()
            loop = asyncio.get_running_loop()

            def fire():
                self._fired = True
                task.cancel()

            self._handle = loop.call_later(self.seconds, fire)
        return self

    async def __aexit__(self, exc_type, exc, tb):
        if self._handle is not None:
            self._handle.cancel()
        if self._fired and exc_type is asyncio.CancelledError:
            raise TimeoutError(f"no result within {self.seconds}s") from None
        return False
