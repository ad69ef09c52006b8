"""`Serving`: what the HTTP routes share and do, apart from the HTTP itself.

The engine client, the served model names, the front's tokenizer and limits, the drain state,
and the work of a request: a decoded OpenAI request checked and tokenized into engine jobs
(`prepare_completion`, `prepare_chat`), run (`generate`, `merged_streams`). The routes
(`routes/`) call it; the bodies it answers with are `render.py`'s.

Each choice of each request is one engine request through the shared `EngineClient`
(thread-safe, asyncio-friendly). A client that disconnects cancels the task waiting on the
engine; the client's stream cleanup then sends the engine an abort, so the KV blocks are freed
at the next step boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..aio import wait_for
from ..outputs import RequestOutput, StreamChunk
from ..sampling_params import SamplingParams
from ..settings import DEFAULT_MAX_QUEUED_CHARS
from ..tokenizer import lower_thread_priority
from .metrics import FrontMetrics
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

    @classmethod
    def of(cls, req, kind: str, model: str, jobs: list[Job], logprobs: int | None, tools: ToolPlan | None = None):
        """A request's context, with the response options it asked for."""
        return cls(
            kind,
            f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{secrets.token_hex(12)}",
            model,
            jobs,
            logprobs,
            token_ids=bool(req.return_token_ids),
            ids_as_tokens=bool(req.return_tokens_as_token_ids),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            tools=tools,
        )


class Serving:
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
            await wait_for(read(), self.read_timeout_s)
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

    # -- requests into engine jobs ----------------------------------------------------------------
    async def prepare_completion(self, req: CompletionRequest) -> Ctx:
        """A /v1/completions request checked and tokenized: one job per prompt and choice."""
        model = self.check_model(req.model)
        check_unsupported(req)
        n = num_choices(req)
        lp = logprobs_count(req)
        structured = constraint_of(req)
        jobs = []
        for i, p in enumerate(completion_prompts(req.prompt, self.max_model_len, self.status.get("vocab_size"))):
            text, ids = (p, None) if isinstance(p, str) else (None, p)
            if ids is None and self.tokenizer is not None:
                ids = await self.encode(text, add_special_tokens=True, param="prompt")  # as the engine would
            echo = ""
            if req.echo:
                echo = (
                    text
                    if text is not None
                    else (self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else "")
                )
            max_tokens = self.max_tokens_for(ids, req.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
            for j in range(n):
                scored = lp if req.echo and lp is not None else None  # echo + logprobs: the prompt's too
                params = sampling_params(
                    req, max_tokens=max_tokens, logprobs=lp, choice=j, prompt_logprobs=scored, structured=structured
                )
                jobs.append(Job(index=i * n + j, prompt_index=i, params=params, text=text, ids=ids, echo=echo))
        return Ctx.of(req, "completion", model, jobs, lp)

    async def prepare_chat(self, req: ChatCompletionRequest) -> Ctx:
        """A /v1/chat/completions request checked, its template rendered and tokenized here (with a
        tokenizer; without one the engine renders a single user message): one job per choice."""
        model = self.check_model(req.model)
        check_unsupported(req)
        n = num_choices(req)
        lp = logprobs_count(req)
        messages = message_dicts(req.messages)
        template = (self.tokenizer.chat_template or "") if self.tokenizer is not None else ""
        plan = tool_plan(req, template)
        structured = plan.structured if plan is not None else constraint_of(req)
        extra = {}
        if plan is not None and plan.tagged:
            extra["tools"] = req.tools  # the template describes them, in its own words
        elif plan is not None:
            messages = with_tools(messages, plan)
        text, ids, chat = None, None, False
        if self.tokenizer is not None:
            self.check_fits("".join(str(m.get("content") or "") for m in messages), "messages")
            try:
                rendered = await asyncio.to_thread(
                    self.tokenizer.apply_chat_template,
                    messages,
                    add_generation_prompt=req.add_generation_prompt is not False,
                    **extra,
                )
            except Exception as e:  # no template, or the template raised (e.g. roles out of order)
                raise bad_request(f"cannot apply the chat template: {e}", param="messages") from None
            ids = await self.encode(rendered, add_special_tokens=False, param="messages")
        elif len(messages) == 1 and messages[0]["role"] == "user":
            text, chat = messages[0]["content"], True  # the engine applies the template
        else:
            raise bad_request(
                "this server has no tokenizer for the model here, so only a single user message "
                "can be sent (start it with --model so the chat template can be rendered)",
                param="messages",
            )
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.max_tokens_for(ids, requested, None)
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
        return Ctx.of(req, "chat", model, jobs, lp, tools=plan)

    def model_card(self, name: str) -> dict:
        card = {"id": name, "object": "model", "created": self.created, "owned_by": "workbench", "root": name,
                "parent": None}  # fmt: skip
        if self.max_model_len:
            card["max_model_len"] = self.max_model_len
        return card

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
