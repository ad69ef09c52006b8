"""Response bodies and server-sent events: pure functions of a request's `Ctx` and the engine's
outputs (OpenAI's shapes for completions and chat, logprobs, usage, the route extension)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from ..outputs import RequestOutput, StreamChunk, TokenLogprobs
from .serving import Ctx, Serving, engine_error


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _completion_logprobs(
    serving: Serving, lps: list[TokenLogprobs], offset: int, as_id: bool, prompt: RequestOutput | None = None
) -> dict:
    """OpenAI's legacy completion logprobs; with `prompt` (echo), its prompt's tokens first, from
    offset 0: the first has no log-probability (None), as OpenAI and vLLM give it."""
    entries: list[tuple[int, TokenLogprobs | None]] = []
    if prompt is not None:
        entries = list(zip(prompt.prompt_token_ids, prompt.prompt_logprobs or []))
        offset = 0
    entries += [(x.token_id, x) for x in lps]
    tokens = [serving.token_text(t, as_id) for t, _ in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None if x is None else x.logprob for _, x in entries],
        "top_logprobs": [
            None if x is None else {serving.token_text(t, as_id): lp for t, lp in (x.top or [(x.token_id, x.logprob)])}
            for _, x in entries
        ],
        "text_offset": offsets,
    }


def _chat_logprobs(serving: Serving, lps: list[TokenLogprobs], top: int, as_id: bool) -> dict:
    def entry(token_id: int, lp: float) -> dict:
        s = serving.token_text(token_id, as_id)
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


def completion_body(serving: Serving, ctx: Ctx, outs: list[RequestOutput]) -> dict:
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
                serving, out.logprobs or [], len(job.echo), ctx.ids_as_tokens, echoed
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


def chat_body(serving: Serving, ctx: Ctx, outs: list[RequestOutput]) -> dict:
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
            choice["logprobs"] = _chat_logprobs(serving, out.logprobs or [], ctx.logprobs, ctx.ids_as_tokens)
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
    serving: Serving, ctx: Ctx, first: tuple[int, StreamChunk], rest: AsyncIterator[tuple[int, StreamChunk]]
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
            yield sse(
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
                choice["logprobs"] = _chat_logprobs(serving, lps, ctx.logprobs, ctx.ids_as_tokens)
            else:
                choice["logprobs"] = _completion_logprobs(serving, lps, offsets[k], ctx.ids_as_tokens)
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
        return sse({**head, "choices": [choice]})

    try:
        data = render(*first)
        if data is not None:
            yield data
        async for k, chunk in rest:
            data = render(k, chunk)
            if data is not None:
                yield data
    except Exception as e:  # the engine failed mid-stream: say so in the stream
        yield sse(engine_error(e).to_dict())
    else:
        if ctx.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(ctx, outputs)})
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
    yield b"data: [DONE]\n\n"
