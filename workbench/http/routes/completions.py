"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol import CompletionRequest
from ..render import completion_body
from ..serving import Serving
from .common import counted, generation

router = APIRouter()


@router.post("/v1/completions")
@counted
async def completions(request: Request):
    return await generation(request, CompletionRequest, Serving.prepare_completion, completion_body)
