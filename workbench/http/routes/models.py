"""GET /v1/models and /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .common import serving_of

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request):
    serving = serving_of(request)
    serving.check_auth(request)
    return {"object": "list", "data": [serving.model_card(m) for m in serving.model_names]}


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str):
    serving = serving_of(request)
    serving.check_auth(request)
    return serving.model_card(serving.check_model(model))
