"""The request surface that `EngineClient` and `RemoteEngineClient` share.

`RequestSurface` gives `generate`, `stream`, `agenerate` and `astream` (same shapes as `LLM`)
to any client that provides two primitives:

- ``_submit(batch, chat, stream, sink) -> list[str]``: start the normalized requests, hand
  every `StreamChunk` (or an exception) for them to ``sink`` from any thread, and return
  their ids in order;
- ``_abandon(rids)``: stop caring about these unfinished requests (forget their sinks, abort
  them where that still makes sense); called when a caller leaves early or fails.

`_cleanup(rids, finished)` (also used by `workbench.sweep`) calls `_abandon` for the ids not in
``finished``. A client that keeps event subscriptions in ``self._subs`` under ``self._lock``
gets `_unsubscribe` too.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from ..outputs import RequestOutput, StreamChunk
from ..sampling_params import normalize_batch

__all__ = ["RequestSurface"]

_POLL_S = 0.5  # longest a waiting caller sleeps before re-checking (keeps Ctrl-C responsive)


class RequestSurface:
    """generate/stream and their asyncio twins, built on `_submit` and `_abandon`."""

    def _submit(self, batch, chat: bool, stream: bool, sink: Callable[[Any], None],
                into: list[str] | None = None) -> list[str]:
        raise NotImplementedError

    def _abandon(self, rids: list[str]) -> None:
        raise NotImplementedError

    def _cleanup(self, rids: Iterable[str], finished: set[str]) -> None:
        left = [r for r in rids if r not in finished]
        if left:
            self._abandon(left)

    def _unsubscribe(self, sub) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def generate(self, prompts=None, params=None, *, prompt_token_ids=None, chat: bool = False,
                 timeout: float | None = None) -> list[RequestOutput]:
        """Like `LLM.generate`: one RequestOutput per prompt, in order."""
        batch = normalize_batch(prompts, params, prompt_token_ids)
        q: queue.SimpleQueue = queue.SimpleQueue()
        rids = self._submit(batch, chat, False, q.put)
        deadline = None if timeout is None else time.monotonic() + timeout
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(rids):
                _collect(done, _get(q, deadline, timeout))
        finally:
            self._cleanup(rids, set(done))
        return [done[r] for r in rids]

    def stream(self, prompt=None, params=None, *, prompt_token_ids=None, chat: bool = False,
               timeout: float | None = None) -> Iterator[StreamChunk]:
        """Like `LLM.stream`: chunks of one request as they are produced. Leaving the loop early
        (break, exception, Ctrl-C) aborts the request."""
        [item] = _one(prompt, params, prompt_token_ids)
        q: queue.SimpleQueue = queue.SimpleQueue()
        [rid] = self._submit([item], chat, True, q.put)
        return self._stream_iter(rid, q, timeout)

    def _stream_iter(self, rid: str, q: queue.SimpleQueue, timeout: float | None) -> Iterator[StreamChunk]:
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = False
        try:
            while not finished:
                item = _get(q, deadline, timeout)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            self._cleanup([rid], {rid} if finished else set())

    async def agenerate(self, prompts=None, params=None, *, prompt_token_ids=None, chat: bool = False,
                        timeout: float | None = None) -> list[RequestOutput]:
        batch = normalize_batch(prompts, params, prompt_token_ids)
        aq, sink = _async_sink()
        rids = self._submit(batch, chat, False, sink)
        done: dict[str, RequestOutput] = {}
        try:
            async with _atimeout(timeout):
                while len(done) < len(rids):
                    _collect(done, await aq.get())
        finally:
            self._cleanup(rids, set(done))
        return [done[r] for r in rids]

    async def astream(self, prompt=None, params=None, *, prompt_token_ids=None, chat: bool = False,
                      timeout: float | None = None) -> AsyncIterator[StreamChunk]:
        [item] = _one(prompt, params, prompt_token_ids)
        aq, sink = _async_sink()
        [rid] = self._submit([item], chat, True, sink)
        finished = False
        try:
            async with _atimeout(timeout):
                while not finished:
                    got = await aq.get()
                    if isinstance(got, BaseException):
                        finished = True
                        raise got
                    finished = got.finish_reason is not None
                    yield got
        finally:
            self._cleanup([rid], {rid} if finished else set())


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


def _get(q: queue.SimpleQueue, deadline: float | None, timeout: float | None):
    while True:
        wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError(f"no result within {timeout}s")
        try:
            return q.get(timeout=wait)
        except queue.Empty:
            continue


def _async_sink() -> tuple[asyncio.Queue, Callable[[Any], None]]:
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
