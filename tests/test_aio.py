"""workbench.aio.wait_for: a cancel is never lost, a timeout cancels what it waited on."""

from __future__ import annotations

import asyncio

import pytest

from workbench.aio import wait_for


async def _cancelled_as_it_completes(wf) -> str:
    """Cancel the waiting task in the same loop pass as its queue item arrives: Python 3.10/3.11's
    asyncio.wait_for returns the item here and the cancel is gone (gh-86296)."""
    q: asyncio.Queue = asyncio.Queue()
    t = asyncio.ensure_future(wf(q.get(), 10))
    for _ in range(3):
        await asyncio.sleep(0)
    q.put_nowait("item")
    t.cancel()
    try:
        return await t
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancel_landing_with_the_result_still_cancels():
    assert asyncio.run(_cancelled_as_it_completes(wait_for)) == "cancelled"


def test_a_cancel_while_waiting_cancels_the_awaited_task():
    async def main():
        inner = asyncio.ensure_future(asyncio.sleep(10))
        t = asyncio.ensure_future(wait_for(inner, 10))
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.sleep(0)
        assert inner.cancelled()

    asyncio.run(main())


def test_timeout_raises_and_cancels_the_awaited_task():
    async def main():
        inner = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(inner, 0.01)
        await asyncio.sleep(0)
        assert inner.cancelled()

    asyncio.run(main())


def test_results_and_errors_pass_through():
    async def value():
        await asyncio.sleep(0)
        return 7

    async def boom():
        raise ValueError("bad")

    async def main():
        assert await wait_for(value(), 1) == 7
        assert await wait_for(value(), None) == 7
        with pytest.raises(ValueError, match="bad"):
            await wait_for(boom(), 1)

    asyncio.run(main())
