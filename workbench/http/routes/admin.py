"""What operators and `RemoteEngineClient` read: /health (open), /metrics (Prometheus; behind the
key unless opened for scrapers), /workbench/status|settings|metrics (JSON), and the API's own
description (/openapi.json, /docs), served behind the key like the API."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from ..metrics import CONTENT_TYPE
from .common import serving_of

log = logging.getLogger("workbench.http")

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    serving = serving_of(request)
    alive = getattr(serving.engine, "alive", True)
    draining = serving.draining or getattr(serving.engine, "draining", False)
    state = "draining" if draining else "ok" if alive else "engine unavailable"
    body = {
        "status": state,
        "server": "workbench",
        "engine": getattr(serving.engine, "name", None),
        "model": serving.model_names[0],
    }
    return JSONResponse(body, status_code=200 if state == "ok" else 503)


@router.get("/metrics")
async def metrics(request: Request):
    serving = serving_of(request)
    if not serving.open_metrics:  # it tells the host's CPU and memory: behind the key when there is one
        serving.check_auth(request)
    engine_metrics = settings = None
    try:
        engine_metrics, settings = await asyncio.gather(serving.engine.ametrics(), serving.engine.asettings())
    except Exception as e:  # the engine is gone: still serve the histograms
        log.warning("/metrics: engine metrics unavailable: %s", e)
    data = await asyncio.to_thread(serving.metrics.render, engine_metrics, settings, serving.status)
    return Response(data, media_type=CONTENT_TYPE)


@router.get("/workbench/status")
async def workbench_status(request: Request):
    serving = serving_of(request)
    serving.check_auth(request)
    status = await serving.engine.astatus()
    return {
        "server": "workbench",
        "models": serving.model_names,
        "max_model_len": serving.max_model_len,
        "front_tokenizer": serving.tokenizer is not None,
        "engine": status,
    }


@router.get("/workbench/settings")
async def workbench_settings(request: Request):
    serving = serving_of(request)
    serving.check_auth(request)
    settings, schema = await asyncio.gather(serving.engine.asettings(), serving.engine.aschema())
    return {"settings": settings, "schema": schema}


@router.get("/workbench/metrics")
async def workbench_metrics(request: Request):
    serving = serving_of(request)
    serving.check_auth(request)
    return await serving.engine.ametrics()


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request):
    serving_of(request).check_auth(request)
    app = request.app
    return JSONResponse(
        get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    )


@router.get("/docs", include_in_schema=False)
async def docs(request: Request):
    serving_of(request).check_auth(request)
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} API")
