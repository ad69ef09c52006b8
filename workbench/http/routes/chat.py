"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..protocol import ChatCompletionRequest
from ..render import chat_body
from ..serving import Serving
from .common import counted, generation

router = APIRouter()


@router.post("/v1/chat/completions")
@counted
async def chat_completions(request: Request):
    return await generation(request, ChatCompletionRequest, Serving.prepare_chat, chat_body)
