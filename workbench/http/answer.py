"""How a prepared request is answered: one JSON body, or server-sent events; a client that
disconnects first cancels the engine work (its requests abort at the next step boundary)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .protocol import APIError
from .render import route_header, stream_events
from .serving import Ctx, Serving, engine_error

log = logging.getLogger("workbench.http")


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive, aw):
    """Await `aw` unless the client disconnects first (then it is cancelled: ClientGone)."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientGone()
    return task.result()


class SSEResponse(Response):
    """Server-sent events from an async iterator of bytes. A client disconnect (noticed on the
    receive channel, or as a failed send) stops the iterator, whose cleanup aborts the engine
    requests."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        super().__init__(
            content=None,
            status_code=200,
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})},
            media_type=self.media_type,
        )
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # streamed: chunked
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, watch):
                t.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
        if task.done() and not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if not isinstance(exc, OSError):
                log.warning("stream ended with %s: %s", type(exc).__name__, exc)


async def answer(
    serving: Serving, request: Request, ctx: Ctx, stream: bool, body_fn: Callable[[Serving, Ctx, list], dict]
) -> Response:
    """The answer to a prepared request: `body_fn`'s JSON, or its events as they come."""
    try:
        if not stream:
            outs = await until_disconnect(request.receive, serving.generate(ctx.jobs))
            return JSONResponse(body_fn(serving, ctx, outs), headers=route_header(outs))
        events = serving.merged_streams(ctx.jobs)
        try:
            # The first chunk comes before the 200: a request the engine rejects gets a 4xx.
            first = await until_disconnect(request.receive, events.__anext__())
        except BaseException:
            await events.aclose()
            raise
        member_of = getattr(serving.engine, "member_of", None)
        chunk = first[1]
        member = chunk.output.route if chunk.output is not None else member_of and member_of(chunk.request_id)
        headers = {"x-workbench-route": member} if member else None
        return SSEResponse(stream_events(serving, ctx, first, events), headers=headers)
    except ClientGone:
        return Response(status_code=499)
    except StopAsyncIteration:  # pragma: no cover - a stream always ends with a finish chunk
        raise APIError(500, "the engine returned no output") from None
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from None
