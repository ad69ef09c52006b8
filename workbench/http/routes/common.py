"""What every handler uses: the app's `Serving`, the drain's count of handlers running, and the
one way an OpenAI generation request is handled."""

from __future__ import annotations

import functools

from fastapi import Request

from ..answer import answer
from ..serving import Serving


def serving_of(request: Request) -> Serving:
    return request.app.state.serving


def counted(route):
    """Count the request in `Serving.inflight` while the handler runs (a drain waits for it)."""

    @functools.wraps(route)
    async def handler(request: Request):
        serving = serving_of(request)
        serving.inflight += 1
        try:
            return await route(request)
        finally:
            serving.inflight -= 1

    return handler


async def generation(request: Request, kind, prepare, body_fn):
    """An OpenAI generation request: authorized, accepted (not draining), decoded as `kind`,
    prepared into jobs by `prepare(serving, req)`, answered with `body_fn` (JSON or a stream)."""
    serving = serving_of(request)
    serving.check_auth(request)
    serving.check_accepting()
    req = await serving.decode(await serving.read_body(request), kind)
    ctx = await prepare(serving, req)
    return await answer(serving, request, ctx, bool(req.stream), body_fn)
