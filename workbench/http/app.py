"""The FastAPI app: OpenAI routes, auth, SSE streaming, disconnect handling, /health, /metrics.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE with
``stream=true``), ``GET /health``, ``GET /metrics`` (Prometheus), and for `RemoteEngineClient`
``GET /workbench/status|settings|metrics`` (JSON). With an API key, everything but /health
and /metrics needs ``Authorization: Bearer <key>`` (as vLLM does).

Each choice of each request is one engine request through the shared `EngineClient`
(thread-safe, asyncio-friendly). A client that disconnects cancels the task waiting on the
engine; the client's stream cleanup then sends the engine an abort, so the KV blocks are freed
at the next step boundary.

Over 600 lines on purpose: one app's routes and the request, streaming and drain state they
share (`Front`); the wire shapes live in `protocol.py`, the exposition in `metrics.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..outputs import RequestOutput, StreamChunk, TokenLogprobs
from ..sampling_params import SamplingParams
from ..settings import DEFAULT_MAX_QUEUED_CHARS
from ..tokenizer import lower_thread_priority
from .metrics import CONTENT_TYPE, FrontMetrics
from .protocol import (
    DEFAULT_MAX_BODY_MB,
    DEFAULT_READ_TIMEOUT_S,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    check_unsupported,
    completion_prompts,
    decode_request,
    logprobs_count,
    message_dicts,
    num_choices,
    sampling_params,
)
from .structured import ToolPlan, constraint_of, tool_plan, with_tools

log = logging.getLogger("workbench.http")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
RETRY_AFTER_S = 5  # what a 503 during a drain tells clients (the engine may come back, or another)
OFF_LOOP_BYTES = 256 << 10  # request bodies at least this large are decoded on a worker thread


class _ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class ServerShuttingDown(Exception):
    """The server was told to stop and its drain deadline passed with this request unfinished."""


@dataclass
class Job:
    """One engine request: one choice of one prompt."""

    index: int  # the choice index in the response
    prompt_index: int
    params: SamplingParams
    text: str | None = None  # prompt text (sent as text when ids is None)
    ids: list[int] | None = None  # prompt token ids (preferred)
    chat: bool = False  # let the engine apply the chat template to `text`
    echo: str = ""  # text to put in front of the completion (echo=true)


@dataclass
class Ctx:
    kind: str  # "completion" | "chat"
    id: str
    model: str
    jobs: list[Job]
    logprobs: int | None
    token_ids: bool = False  # return_token_ids
    ids_as_tokens: bool = False  # return_tokens_as_token_ids
    include_usage: bool = False
    tools: ToolPlan | None = None  # chat with a required or named tool call: outputs become tool_calls
    created: int = field(default_factory=lambda: int(time.time()))


class Front:
    """Everything the routes share: the engine client, the model's names and tokenizer, limits."""

    def __init__(
        self,
        engine,
        *,
        model_names: list[str],
        tokenizer=None,
        max_model_len: int | None = None,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20,
        status: dict | None = None,
        aliases: list[str] | None = None,
        max_queued_chars: int = DEFAULT_MAX_QUEUED_CHARS,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        open_metrics: bool = False,
    ):
        if not model_names:
            raise ValueError("model_names must name at least one model")
        self.engine = engine
        self.model_names = list(model_names)
        self.aliases = set(self.model_names) | set(aliases or ())
        self.tokenizer = tokenizer
        # worked out now (a parse of tokenizer.json: ~0.3 s holding the GIL), not on the first request
        self.max_token_chars = tokenizer.max_token_chars if tokenizer is not None else None
        self.max_model_len = max_model_len
        self.api_key = api_key or None
        self.max_body_bytes = int(max_body_bytes)
        self.read_timeout_s = float(read_timeout_s)
        self.open_metrics = open_metrics  # /metrics without the key (for a scraper that cannot send one)
        self.status = dict(status or {})
        self.metrics = FrontMetrics(self.model_names[0])
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        # Prompts are tokenized here, off the event loop, at a lower CPU priority than the engine;
        # what waits for that is bounded like the engine's own queue (503 beyond, as the engine would).
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(
            2, "wb-http-tokenize", initializer=lower_thread_priority
        )
        self.max_queued_chars = int(max_queued_chars)
        self.tokenizing_chars = 0
        self.draining = False  # a stop was asked for: new requests get 503, running ones go on
        self.inflight = 0  # requests inside a route handler (streams are counted by their queues)
        self._cut_queues: set[asyncio.Queue] = set()  # running streams, told when the drain ends
        self._cut_futures: set[asyncio.Future] = set()  # running non-streamed answers

    # -- graceful stop ----------------------------------------------------------------------------
    def begin_drain(self, timeout_s: float) -> None:
        """On the event loop: refuse new requests; end what still runs after `timeout_s`."""
        if not self.draining:
            self.draining = True
            log.info("draining: %d request(s) running; they end within %.0f s", self.busy(), timeout_s)
            why = f"this request was still running at the drain deadline ({timeout_s:g} s)"
            asyncio.get_running_loop().call_later(timeout_s, self.cut_all, why)

    def busy(self) -> int:
        """Requests being read, prepared, answered or streamed."""
        return self.inflight + len(self._cut_queues)

    def cut_all(self, why: str) -> None:
        """End every running request now: streams with an error event, the others with a 503."""
        why = f"the server is shutting down: {why}"
        for q in self._cut_queues:
            q.put_nowait((-1, ServerShuttingDown(why)))
        for fut in self._cut_futures:
            if not fut.done():
                fut.set_exception(ServerShuttingDown(why))

    def check_accepting(self) -> None:
        if self.draining or getattr(self.engine, "draining", False):
            raise APIError(
                503,
                "the server is shutting down and accepts no new requests",
                code="server_shutting_down",
                headers={"retry-after": str(RETRY_AFTER_S)},
            )

    # -- request checks -------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(
                401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    async def decode(self, body: bytes, kind):
        """`decode_request`, off the event loop for a large body: decoding megabytes holds the GIL for
        tens of milliseconds, and in a worker thread the loop still gets it every switch interval, so
        the other streams keep flowing."""
        if len(body) < OFF_LOOP_BYTES:
            return decode_request(body, kind)
        return await asyncio.to_thread(decode_request, body, kind)

    async def read_body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        too_big = APIError(413, f"request body exceeds {limit >> 20} MiB", code="request_too_large")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        parts: list[bytes] = []

        async def read() -> None:
            size = 0
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_big
                parts.append(part)

        try:  # a client that never finishes its body must not hold a connection (and its buffer) forever
            await asyncio.wait_for(read(), self.read_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(
                408, f"the request body did not arrive within {self.read_timeout_s:g} s", code="request_timeout"
            ) from None
        return b"".join(parts)

    def check_model(self, model: str | None) -> str:
        """The served name a request asks for; behind a router, RouteLLM's form
        `router-<policy>-<threshold>` also routes that request by that policy and threshold."""
        if model is None or model in self.aliases:
            return self.model_names[0] if model is None or model not in self.model_names else model
        routes = getattr(self.engine, "route_by_model_name", None)  # a router (workbench.routing)
        if routes is not None and model.startswith("router-"):
            try:
                routes(model)  # sets this request's policy and threshold; the tasks it starts inherit it
            except ValueError as e:
                raise APIError(404, str(e), param="model", code="model_not_found") from None
            return model
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {', '.join(repr(m) for m in self.model_names)}",
            param="model",
            code="model_not_found",
        )

    def max_tokens_for(self, ids: list[int] | None, requested: int | None, default: int | None) -> int:
        """Check the prompt against the context; the max_tokens to run with."""
        if ids is not None and self.max_model_len:
            room = self.max_model_len - len(ids)
            if room < 1:
                raise bad_request(
                    f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                    f"has {len(ids)} tokens (plus at least one output token must fit)",
                    param="messages" if default is None else "prompt",
                    code="context_length_exceeded",
                )
            if requested is not None and requested > room:
                raise bad_request(
                    f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                    f"{len(ids) + requested} tokens ({len(ids)} in the prompt, {requested} for the completion); "
                    "shorten the prompt or lower max_tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            if requested is None:
                return room if default is None else min(default, room)
        if requested is not None:
            return requested
        if default is not None:
            return default
        return max(1, (self.max_model_len or 4096) - (len(ids) if ids else 0))

    # -- tokenizing -------------------------------------------------------------------------------
    def check_fits(self, text: str, param: str) -> None:
        """Refuse from its length alone a text that cannot fit the context (no tokenizing)."""
        if self.tokenizer is not None and self.max_model_len:
            try:
                self.tokenizer.check_fits(text, self.max_model_len, "the prompt")
            except ValueError as e:
                raise bad_request(str(e), param=param, code="context_length_exceeded") from None

    async def encode(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of a prompt, off the event loop (the tokenizer releases the GIL), so a big
        prompt never stalls other streams or /health. `encode_within` refuses what cannot fit."""
        loop = asyncio.get_running_loop()
        if self.tokenizing_chars and self.tokenizing_chars + len(text) > self.max_queued_chars:
            raise APIError(
                503,
                f"the server is busy: prompts of {self.tokenizing_chars:,} characters wait to be "
                f"tokenized and this request adds {len(text):,} (limit {self.max_queued_chars:,}); "
                "retry later",
                code="engine_overloaded",
                headers={"retry-after": "1"},
            )
        self.tokenizing_chars += len(text)
        try:
            if not self.max_model_len:
                return await loop.run_in_executor(self._tokenizing, self.tokenizer.encode, text, add_special_tokens)
            return await loop.run_in_executor(
                self._tokenizing,
                self.tokenizer.encode_within,
                text,
                self.max_model_len,
                add_special_tokens,
                "the prompt",
            )
        except ValueError as e:
            raise bad_request(str(e), param=param, code="context_length_exceeded") from None
        finally:
            self.tokenizing_chars -= len(text)

    # -- token text ------------------------------------------------------------------------------
    def token_text(self, token_id: int, as_id: bool) -> str:
        if as_id or self.tokenizer is None:
            return f"token_id:{token_id}"
        s = self._token_text.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = s
        return s

    # -- engine ----------------------------------------------------------------------------------
    def _call_kwargs(self, job: Job) -> dict[str, Any]:
        if job.ids is not None:
            return {"prompt_token_ids": job.ids, "params": job.params}
        return {"prompt": job.text, "params": job.params, "chat": job.chat}

    async def generate(self, jobs: list[Job]) -> list[RequestOutput]:
        async def one(job: Job) -> RequestOutput:
            kw = self._call_kwargs(job)
            if "prompt_token_ids" in kw:
                [out] = await self.engine.agenerate(prompt_token_ids=[kw["prompt_token_ids"]], params=kw["params"])
            else:
                [out] = await self.engine.agenerate(kw["prompt"], kw["params"], chat=kw["chat"])
            self.metrics.observe(out)
            return out

        tasks = [asyncio.ensure_future(one(j)) for j in jobs]
        cut = asyncio.get_running_loop().create_future()
        self._cut_futures.add(cut)
        gathered = asyncio.gather(*tasks)
        try:
            await asyncio.wait({gathered, cut}, return_when=asyncio.FIRST_COMPLETED)
            if cut.done():
                raise cut.exception()
            return list(gathered.result())
        finally:  # on an error or a disconnect, the other choices stop too (their engine requests abort)
            self._cut_futures.discard(cut)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            gathered.cancel()  # a no-op once it is done

    async def merged_streams(self, jobs: list[Job]) -> AsyncIterator[tuple[int, StreamChunk]]:
        """(job number, chunk) from every job's stream, as they come."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, job: Job) -> None:
            try:
                async for chunk in self.engine.astream(**self._call_kwargs(job)):
                    q.put_nowait((k, chunk))
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                q.put_nowait((k, e))

        tasks = [asyncio.ensure_future(pump(k, j)) for k, j in enumerate(jobs)]
        left = len(jobs)
        self._cut_queues.add(q)
        try:
            while left:
                k, item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    left -= 1
                    if item.output is not None:
                        self.metrics.observe(item.output)
                yield k, item
        finally:
            self._cut_queues.discard(q)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(exc: BaseException) -> APIError:
    """An engine-side exception as the HTTP error it deserves."""
    from ..errors import EngineBusyError, EngineDeadError, EngineDrainingError, WorkbenchIPCError

    if isinstance(exc, APIError):
        return exc
    msg = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    if isinstance(exc, (ValueError, TypeError, LookupError)):
        code = "context_length_exceeded" if ("context" in msg or "KV blocks" in msg) else None
        return APIError(400, msg, code=code)
    if isinstance(exc, (ServerShuttingDown, EngineDrainingError)):
        return APIError(503, msg, code="server_shutting_down", headers={"retry-after": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineBusyError):
        return APIError(503, msg, code="engine_overloaded", headers={"retry-after": "1"})
    if isinstance(exc, (EngineDeadError, WorkbenchIPCError)):
        return APIError(503, f"the engine is unavailable: {msg}", code="engine_unavailable")
    if isinstance(exc, TimeoutError):
        return APIError(504, f"the engine did not answer in time: {msg}", code="timeout")
    log.error("unexpected error serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {msg}")


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive, aw):
    """Await `aw` unless the client disconnects first (then it is cancelled: _ClientGone)."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise _ClientGone()
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


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


# -- response pieces ------------------------------------------------------------------------------
def _completion_logprobs(
    front: Front, lps: list[TokenLogprobs], offset: int, as_id: bool, prompt: RequestOutput | None = None
) -> dict:
    """OpenAI's legacy completion logprobs; with `prompt` (echo), its prompt's tokens first, from
    offset 0: the first has no log-probability (None), as OpenAI and vLLM give it."""
    entries: list[tuple[int, TokenLogprobs | None]] = []
    if prompt is not None:
        entries = list(zip(prompt.prompt_token_ids, prompt.prompt_logprobs or []))
        offset = 0
    entries += [(x.token_id, x) for x in lps]
    tokens = [front.token_text(t, as_id) for t, _ in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None if x is None else x.logprob for _, x in entries],
        "top_logprobs": [
            None if x is None else {front.token_text(t, as_id): lp for t, lp in (x.top or [(x.token_id, x.logprob)])}
            for _, x in entries
        ],
        "text_offset": offsets,
    }


def _chat_logprobs(front: Front, lps: list[TokenLogprobs], top: int, as_id: bool) -> dict:
    def entry(token_id: int, lp: float) -> dict:
        s = front.token_text(token_id, as_id)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            {**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, lp) for t, lp in x.top[:top]]} for x in lps
        ],
        "refusal": None,
    }


def _usage(ctx: Ctx, outputs: dict[int, RequestOutput]) -> dict:
    """OpenAI's usage, each prompt counted once; `cached_tokens`: its tokens the prefix cache held."""
    prompt, cached = {}, {}
    completion = 0
    for k, out in outputs.items():
        i = ctx.jobs[k].prompt_index
        prompt[i] = len(out.prompt_token_ids)
        cached[i] = max(cached.get(i, 0), out.metrics.prefix_hit_tokens)
        completion += len(out.token_ids)
    p = sum(prompt.values())
    return {
        "prompt_tokens": p,
        "completion_tokens": completion,
        "total_tokens": p + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


def _route(out: RequestOutput | None) -> dict | None:
    """A routed answer's extension field: its member, the policy, its score and the members it ran on."""
    if out is None or out.route is None:
        return None
    return {"member": out.route, "policy": out.route_policy, "score": out.route_score, "tried": out.route_tried}


def route_header(outs) -> dict[str, str]:
    """`x-workbench-route`: the members that answered, in choice order (none: not routed)."""
    names = list(dict.fromkeys(o.route for o in outs if o is not None and o.route))
    return {"x-workbench-route": ",".join(names)} if names else {}


def completion_body(front: Front, ctx: Ctx, outs: list[RequestOutput]) -> dict:
    choices = []
    for job, out in zip(ctx.jobs, outs):
        choice: dict[str, Any] = {
            "index": job.index,
            "text": job.echo + out.text,
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }
        if ctx.logprobs is not None:
            echoed = out if job.echo and out.prompt_logprobs is not None else None
            choice["logprobs"] = _completion_logprobs(
                front, out.logprobs or [], len(job.echo), ctx.ids_as_tokens, echoed
            )
        if ctx.token_ids:
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = out.prompt_token_ids
        if out.route is not None:
            choice["route"] = _route(out)
        choices.append(choice)
    return {
        "id": ctx.id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": sorted(choices, key=lambda c: c["index"]),
        "usage": _usage(ctx, dict(enumerate(outs))),
        "system_fingerprint": None,
    }


def _tool_answer(ctx: Ctx, out: RequestOutput) -> tuple[str | None, list[dict] | None]:
    """A chat output as its content and `tool_calls` (no calls where no tool was called, or where
    the output was cut before its call was whole: that text comes back with finish_reason "length")."""
    if ctx.tools is None or not out.structured_complete:
        return out.text, None
    return ctx.tools.answer(out.text)


def chat_body(front: Front, ctx: Ctx, outs: list[RequestOutput]) -> dict:
    choices = []
    for job, out in zip(ctx.jobs, outs):
        choice: dict[str, Any] = {
            "index": job.index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }
        content, calls = _tool_answer(ctx, out)
        if calls is not None:
            choice["message"], choice["finish_reason"] = (
                {"role": "assistant", "content": content, "tool_calls": calls},
                "tool_calls",
            )
        if ctx.logprobs is not None:
            choice["logprobs"] = _chat_logprobs(front, out.logprobs or [], ctx.logprobs, ctx.ids_as_tokens)
        if ctx.token_ids:
            choice["token_ids"] = out.token_ids
        if out.route is not None:
            choice["route"] = _route(out)
        choices.append(choice)
    body = {
        "id": ctx.id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": _usage(ctx, dict(enumerate(outs))),
        "system_fingerprint": None,
    }
    if ctx.token_ids and outs:
        body["prompt_token_ids"] = outs[0].prompt_token_ids
    return body


async def stream_events(
    front: Front, ctx: Ctx, first: tuple[int, StreamChunk], rest: AsyncIterator[tuple[int, StreamChunk]]
) -> AsyncIterator[bytes]:
    obj = "text_completion" if ctx.kind == "completion" else "chat.completion.chunk"
    head = {"id": ctx.id, "object": obj, "created": ctx.created, "model": ctx.model}
    chat = ctx.kind == "chat"
    started: set[int] = set()
    offsets = {k: len(j.echo) for k, j in enumerate(ctx.jobs)}
    outputs: dict[int, RequestOutput] = {}
    lp_sent: dict[int, int] = {}
    if chat:
        for job in ctx.jobs:
            yield _sse(
                {
                    **head,
                    "choices": [
                        {
                            "index": job.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )

    def render(k: int, chunk: StreamChunk) -> bytes | None:
        job = ctx.jobs[k]
        text = chunk.text_delta
        if not chat and k not in started and job.echo:
            text = job.echo + text
        first_chunk = k not in started
        started.add(k)
        lps = chunk.logprobs_delta or []
        if chunk.finish_reason is not None and chunk.output is not None:
            outputs[k] = chunk.output
            if ctx.logprobs is not None and not lps:  # the engine's last chunk carries only the output
                lps = (chunk.output.logprobs or [])[lp_sent.get(k, 0) :]
        lp_sent[k] = lp_sent.get(k, 0) + len(lps)
        if not text and chunk.finish_reason is None and not (ctx.token_ids and chunk.token_ids_delta) and not lps:
            return None
        choice: dict[str, Any] = {"index": job.index}
        if chat and ctx.tools is not None:  # held to the end: the text may turn out to be calls
            if chunk.finish_reason is None or chunk.output is None:
                return None
            content, calls = _tool_answer(ctx, chunk.output)
            choice["delta"] = {"content": content} if content else {}
            if calls:
                choice["delta"]["tool_calls"] = [{"index": n, **c} for n, c in enumerate(calls)]
        elif chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        if ctx.logprobs is not None and lps:
            if chat:
                choice["logprobs"] = _chat_logprobs(front, lps, ctx.logprobs, ctx.ids_as_tokens)
            else:
                choice["logprobs"] = _completion_logprobs(front, lps, offsets[k], ctx.ids_as_tokens)
        offsets[k] += len(chunk.text_delta)
        choice["finish_reason"] = chunk.finish_reason
        if chunk.finish_reason is not None and chat and ctx.tools is not None and "tool_calls" in choice["delta"]:
            choice["finish_reason"] = "tool_calls"
        if ctx.token_ids:
            choice["token_ids"] = chunk.token_ids_delta
            if first_chunk and chunk.output is None and job.ids is not None:
                choice["prompt_token_ids"] = job.ids
            elif first_chunk and chunk.output is not None:
                choice["prompt_token_ids"] = chunk.output.prompt_token_ids
        if chunk.finish_reason is not None and _route(chunk.output) is not None:
            choice["route"] = _route(chunk.output)
        return _sse({**head, "choices": [choice]})

    try:
        data = render(*first)
        if data is not None:
            yield data
        async for k, chunk in rest:
            data = render(k, chunk)
            if data is not None:
                yield data
    except Exception as e:  # the engine failed mid-stream: say so in the stream
        yield _sse(engine_error(e).to_dict())
    else:
        if ctx.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(ctx, outputs)})
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
    yield b"data: [DONE]\n\n"


# -- the app --------------------------------------------------------------------------------------
def create_app(front: Front) -> FastAPI:
    # The API's description is served behind the key like the API itself (below).
    app = FastAPI(
        title="Serving Workbench",
        description="OpenAI-compatible API of a workbench engine",
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.front = front

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        front.check_auth(request)
        return JSONResponse(
            get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        )

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        front.check_auth(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} API")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.to_dict(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        err = engine_error(exc)
        return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)

    @app.get("/health")
    async def health():
        alive = getattr(front.engine, "alive", True)
        draining = front.draining or getattr(front.engine, "draining", False)
        state = "draining" if draining else "ok" if alive else "engine unavailable"
        body = {
            "status": state,
            "server": "workbench",
            "engine": getattr(front.engine, "name", None),
            "model": front.model_names[0],
        }
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        if not front.open_metrics:  # it tells the host's CPU and memory: behind the key when there is one
            front.check_auth(request)
        engine_metrics = settings = None
        try:
            engine_metrics, settings = await asyncio.gather(front.engine.ametrics(), front.engine.asettings())
        except Exception as e:  # the engine is gone: still serve the histograms
            log.warning("/metrics: engine metrics unavailable: %s", e)
        data = await asyncio.to_thread(front.metrics.render, engine_metrics, settings, front.status)
        return Response(data, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        front.check_auth(request)
        return {"object": "list", "data": [_model_card(front, m) for m in front.model_names]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        front.check_auth(request)
        return _model_card(front, front.check_model(model))

    @app.get("/workbench/status")
    async def wb_status(request: Request):
        front.check_auth(request)
        status = await front.engine.astatus()
        return {
            "server": "workbench",
            "models": front.model_names,
            "max_model_len": front.max_model_len,
            "front_tokenizer": front.tokenizer is not None,
            "engine": status,
        }

    @app.get("/workbench/settings")
    async def wb_settings(request: Request):
        front.check_auth(request)
        settings, schema = await asyncio.gather(front.engine.asettings(), front.engine.aschema())
        return {"settings": settings, "schema": schema}

    @app.get("/workbench/metrics")
    async def wb_metrics(request: Request):
        front.check_auth(request)
        return await front.engine.ametrics()

    def counted(route):
        """Count the request in `front.inflight` while the handler runs (a drain waits for it)."""

        @functools.wraps(route)
        async def handler(request: Request):
            front.inflight += 1
            try:
                return await route(request)
            finally:
                front.inflight -= 1

        return handler

    @app.post("/v1/completions")
    @counted
    async def completions(request: Request):
        front.check_auth(request)
        front.check_accepting()
        req = await front.decode(await front.read_body(request), CompletionRequest)
        model = front.check_model(req.model)
        check_unsupported(req)
        n = num_choices(req)
        lp = logprobs_count(req)
        structured = constraint_of(req)
        jobs = []
        for i, p in enumerate(completion_prompts(req.prompt, front.max_model_len, front.status.get("vocab_size"))):
            text, ids = (p, None) if isinstance(p, str) else (None, p)
            if ids is None and front.tokenizer is not None:
                ids = await front.encode(text, add_special_tokens=True, param="prompt")  # as the engine would
            echo = ""
            if req.echo:
                echo = (
                    text
                    if text is not None
                    else (front.tokenizer.decode(ids, skip_special_tokens=False) if front.tokenizer is not None else "")
                )
            max_tokens = front.max_tokens_for(ids, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
            for j in range(n):
                scored = lp if req.echo and lp is not None else None  # echo + logprobs: the prompt's too
                params = sampling_params(
                    req, max_tokens=max_tokens, logprobs=lp, choice=j, prompt_logprobs=scored, structured=structured
                )
                jobs.append(Job(index=i * n + j, prompt_index=i, params=params, text=text, ids=ids, echo=echo))
        ctx = Ctx(
            "completion",
            f"cmpl-{secrets.token_hex(12)}",
            model,
            jobs,
            lp,
            token_ids=bool(req.return_token_ids),
            ids_as_tokens=bool(req.return_tokens_as_token_ids),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
        )
        return await _answer(front, request, ctx, bool(req.stream), completion_body)

    @app.post("/v1/chat/completions")
    @counted
    async def chat_completions(request: Request):
        front.check_auth(request)
        front.check_accepting()
        req = await front.decode(await front.read_body(request), ChatCompletionRequest)
        model = front.check_model(req.model)
        check_unsupported(req)
        n = num_choices(req)
        lp = logprobs_count(req)
        messages = message_dicts(req.messages)
        template = (front.tokenizer.chat_template or "") if front.tokenizer is not None else ""
        plan = tool_plan(req, template)
        structured = plan.structured if plan is not None else constraint_of(req)
        extra = {}
        if plan is not None and plan.tagged:
            extra["tools"] = req.tools  # the template describes them, in its own words
        elif plan is not None:
            messages = with_tools(messages, plan)
        text, ids, chat = None, None, False
        if front.tokenizer is not None:
            front.check_fits("".join(str(m.get("content") or "") for m in messages), "messages")
            try:
                rendered = await asyncio.to_thread(
                    front.tokenizer.apply_chat_template,
                    messages,
                    add_generation_prompt=req.add_generation_prompt is not False,
                    **extra,
                )
            except Exception as e:  # no template, or the template raised (e.g. roles out of order)
                raise bad_request(f"cannot apply the chat template: {e}", param="messages") from None
            ids = await front.encode(rendered, add_special_tokens=False, param="messages")
        elif len(messages) == 1 and messages[0]["role"] == "user":
            text, chat = messages[0]["content"], True  # the engine applies the template
        else:
            raise bad_request(
                "this server has no tokenizer for the model here, so only a single user message "
                "can be sent (start it with --model so the chat template can be rendered)",
                param="messages",
            )
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = front.max_tokens_for(ids, requested, None)
        jobs = [
            Job(
                index=j,
                prompt_index=0,
                text=text,
                ids=ids,
                chat=chat,
                params=sampling_params(req, max_tokens=max_tokens, logprobs=lp, choice=j, structured=structured),
            )
            for j in range(n)
        ]
        ctx = Ctx(
            "chat",
            f"chatcmpl-{secrets.token_hex(12)}",
            model,
            jobs,
            lp,
            token_ids=bool(req.return_token_ids),
            ids_as_tokens=bool(req.return_tokens_as_token_ids),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            tools=plan,
        )
        return await _answer(front, request, ctx, bool(req.stream), chat_body)

    return app


def _model_card(front: Front, name: str) -> dict:
    card = {
        "id": name,
        "object": "model",
        "created": front.created,
        "owned_by": "workbench",
        "root": name,
        "parent": None,
    }
    if front.max_model_len:
        card["max_model_len"] = front.max_model_len
    return card


async def _answer(front: Front, request: Request, ctx: Ctx, stream: bool, body_fn) -> Response:
    try:
        if not stream:
            outs = await until_disconnect(request.receive, front.generate(ctx.jobs))
            return JSONResponse(body_fn(front, ctx, outs), headers=route_header(outs))
        events = front.merged_streams(ctx.jobs)
        try:
            # The first chunk comes before the 200: a request the engine rejects gets a 4xx.
            first = await until_disconnect(request.receive, events.__anext__())
        except BaseException:
            await events.aclose()
            raise
        member_of = getattr(front.engine, "member_of", None)
        chunk = first[1]
        member = chunk.output.route if chunk.output is not None else member_of and member_of(chunk.request_id)
        headers = {"x-workbench-route": member} if member else None
        return SSEResponse(stream_events(front, ctx, first, events), headers=headers)
    except _ClientGone:
        return Response(status_code=499)
    except StopAsyncIteration:  # pragma: no cover - a stream always ends with a finish chunk
        raise APIError(500, "the engine returned no output") from None
    except APIError:
        raise
    except Exception as e:
        raise engine_error(e) from None
