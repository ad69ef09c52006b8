"""asyncio's `wait_for` without the lost cancellation of Python 3.10 and 3.11 (gh-86296).

There, a task cancelled in the same loop pass as the awaitable it waits on completes gets that
awaitable's result and runs on: the cancel is gone. A Ctrl-C in a `%%generate` cell (ipykernel
turns SIGINT into a cancel) was lost that way when a token landed at the same moment."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """`await aw` for at most `timeout` s (None: no limit); asyncio.TimeoutError after it, with
    `aw` cancelled. A cancel of the caller always raises CancelledError here, and cancels `aw`."""
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout)
    except asyncio.CancelledError:
        fut.cancel()
        raise
    if not done:
        fut.cancel()
        raise asyncio.TimeoutError
    return fut.result()
