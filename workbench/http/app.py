"""The FastAPI app: the routers of `routes/` mounted over one `Serving`, and the error handlers.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE with
``stream=true``), ``GET /health``, ``GET /metrics`` (Prometheus), and for `RemoteEngineClient`
``GET /workbench/status|settings|metrics`` (JSON). With an API key, everything but /health
and /metrics needs ``Authorization: Bearer <key>`` (as vLLM does).

Where things live: `serving.py` (what the routes share and do: checks, tokenizing, the engine
calls, the drain), `render.py` (bodies and SSE chunks), `answer.py` (JSON or a stream, and
disconnects), `protocol.py` (the wire shapes), `metrics.py` (the exposition).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import APIError
from .routes import ROUTERS
from .serving import Serving, engine_error


def create_app(serving: Serving) -> FastAPI:
    # The API's description is served behind the key like the API itself (routes/admin.py).
    app = FastAPI(
        title="Serving Workbench",
        description="OpenAI-compatible API of a workbench engine",
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.serving = serving
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    for router in ROUTERS:
        app.include_router(router)
    return app


async def _api_error(request: Request, exc: APIError):
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: StarletteHTTPException):
    err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.to_dict(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _internal(request: Request, exc: Exception):
    err = engine_error(exc)
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)
