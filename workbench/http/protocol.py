"""OpenAI request models, OpenAI-style errors, and the mapping onto `SamplingParams`.

Requests are decoded with msgspec (strict types: ``"max_tokens": "8"`` is a 400 naming the
field, not a silent coercion). Unknown fields are ignored, as OpenAI-compatible servers do;
fields whose meaning we cannot honour (suffix, best_of other than n, ...) are rejected with a
400 that says so, rather than ignored. Structured output (`response_format`, `tools`, vLLM's
`structured_outputs` and `guided_*`) is mapped in `structured.py`.

Extensions beyond OpenAI's API use vLLM's names, so one client works against both:
``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``return_token_ids`` (adds ``token_ids`` to each choice and ``prompt_token_ids`` to the
response) and ``return_tokens_as_token_ids`` (logprob tokens spelled ``"token_id:<id>"``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from ..sampling_params import SEED_MAX, TOKEN_ID_LIMIT, SamplingParams

MAX_N = 64  # choices per prompt
MAX_PROMPTS = 256  # prompts in one /v1/completions request
MAX_LOGPROBS = 20
DEFAULT_MAX_BODY_MB = 16  # largest request body (413 beyond)
DEFAULT_READ_TIMEOUT_S = 30.0  # for a request's whole body to arrive (408 beyond)


class APIError(Exception):
    """An error answered as an OpenAI error object: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.headers = headers  # e.g. retry-after on a 503
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-compatible extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # structured output (workbench/http/structured.py): OpenAI's, then vLLM's fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: msgspec.Raw = msgspec.Raw(b"null")  # str | list[str] | list[int] | list[list[int]]: see completion_prompts
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: Any = None  # str | list of {"type": "text", "text": ...} parts | None
    name: str | None = None
    tool_calls: list | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    add_generation_prompt: bool | None = True


_PATH_RE = re.compile(r"at `\$\.([A-Za-z_]+)")


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode a JSON body into `kind`; malformed JSON, wrong types and values nested too deep
    become 400s naming the field."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _PATH_RE.search(str(e))
        raise bad_request(f"invalid request: {e}", param=m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"malformed JSON in the request body: {e}", code="invalid_json") from None
    except RecursionError:
        field = _too_deep(body)
        raise bad_request(
            f"{field or 'the request body'} nests arrays or objects too deeply to be a valid value", param=field
        ) from None


_JSON_TOKEN_RE = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _too_deep(body: bytes, depth: int = 256, most_tokens: int = 200_000) -> str | None:
    """The top-level field whose value nests deeper than `depth`: the last key of the outer object
    before that point (None if not found within `most_tokens` strings and brackets)."""
    level, key = 0, None
    for n, m in enumerate(_JSON_TOKEN_RE.finditer(body)):
        if n >= most_tokens:
            return None
        tok = m.group()
        if tok in (b"[", b"{"):
            level += 1
            if level > depth:
                return key
        elif tok in (b"]", b"}"):
            level -= 1
        elif level == 1 and body[m.end() : m.end() + 64].lstrip()[:1] == b":":  # a key of the outer object
            try:
                key = msgspec.json.decode(tok)
            except msgspec.DecodeError:
                return None
    return None


# -- prompts --------------------------------------------------------------------------------------
def completion_prompts(
    prompt: Any, max_model_len: int | None = None, vocab_size: int | None = None
) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, a list of strings, a list of token ids, a list of lists.

    Everything here runs on the event loop, so nothing is proportional to the body in Python: a
    16 MiB body holds 8 million ids, which a per-id Python check scanned for a second (and turning
    them into Python ints takes 0.15 s), stalling every stream. As raw JSON from the request, a flat
    list of ids longer than the context is refused from its commas before it is decoded; ids are
    then checked in C-speed passes."""
    if isinstance(prompt, msgspec.Raw):
        prompt = _decode_prompt(bytes(prompt), max_model_len)
    if isinstance(prompt, str):
        return [prompt]
    out = None
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], str):
            out = list(prompt) if _all_of(prompt, str) else None
        elif isinstance(prompt[0], list):
            out = [_token_ids(p, max_model_len, vocab_size) for p in prompt] if _all_of(prompt, list) else None
        else:
            out = [_token_ids(prompt, max_model_len, vocab_size)]
    if out is None or any(p is None for p in out):
        raise bad_request(
            "prompt must be a non-empty string, a list of strings, a list of token ids or a list of lists of token ids",
            param="prompt",
        )
    if len(out) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(out)}", param="prompt")
    return out


def _decode_prompt(raw: bytes, max_model_len: int | None) -> Any:
    head = raw[:64].lstrip()
    if max_model_len and head[:1] == b"[" and head[1:].lstrip()[:1].isdigit():  # a flat list of ids
        count = raw.count(b",") + 1
        if count >= max_model_len:
            raise bad_request(
                f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{count} token ids (plus at least one output token must fit)",
                param="prompt",
                code="context_length_exceeded",
            )
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as e:  # e.g. invalid UTF-8 inside the string: the client's error, a 400
        raise bad_request(f"prompt is not valid JSON text: {e}", param="prompt", code="invalid_json") from None


def _all_of(items: list, kind: type) -> bool:
    return set(map(type, items)) == {kind}  # exact types: True is not a token id


def _token_ids(ids: list, max_model_len: int | None, vocab_size: int | None) -> list[int] | None:
    """`ids` if it is a non-empty list of token ids (None: it is not); 400 for ids out of range or a
    list that cannot fit the context."""
    if not ids:
        return None
    if max_model_len and len(ids) >= max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(ids)} token ids (plus at least one output token must fit)",
            param="prompt",
            code="context_length_exceeded",
        )
    if not _all_of(ids, int):
        return None
    limit = vocab_size or TOKEN_ID_LIMIT
    if min(ids) < 0 or max(ids) >= limit:
        bad = [t for t in ids if not 0 <= t < limit][:5]
        raise bad_request(f"prompt has token ids outside the vocabulary [0, {limit}): {bad}", param="prompt")
    return ids


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template wants them: text content only."""
    if not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(
                f"messages[{i}].role {m.role!r} is not one of system, developer, user, assistant, tool",
                param="messages",
            )
        content = m.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                        "supported by this text-only model",
                        param="messages",
                    )
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        if m.tool_calls and not text:  # a template without tools sees the calls as their JSON
            text = json.dumps([_call_of(c, i) for c in m.tool_calls], ensure_ascii=False)
        role = "system" if m.role == "developer" else m.role
        d = {"role": role, "content": text}
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


def _call_of(call, i: int) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls must be OpenAI tool calls", param="messages")
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass  # kept as the text it was
    return {"name": fn["name"], "parameters": args}


# -- sampling -------------------------------------------------------------------------------------
def check_unsupported(req: _Common) -> None:
    """Reject what we would otherwise silently get wrong."""
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix (insertion) is not supported", param="suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request("best_of other than n is not supported", param="best_of")
        if req.echo and req.logprobs is not None and req.stream:
            raise bad_request(
                "echo with logprobs (the prompt's log-probabilities) is served without stream; send stream=false",
                param="echo",
            )


def num_choices(req: _Common) -> int:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {n}", param="n")
    return n


def logprobs_count(req: _Common) -> int | None:
    """Top alternatives per token to ask the engine for (None: no logprobs)."""
    if isinstance(req, ChatCompletionRequest):
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
        if not req.logprobs:
            if top:
                raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return top or 0
    lp = req.logprobs
    if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {lp}", param="logprobs")
    return lp


_FIELD_RE = re.compile(r"SamplingParams\.(\w+)")


def sampling_params(
    req: _Common,
    *,
    max_tokens: int,
    logprobs: int | None,
    choice: int = 0,
    prompt_logprobs: int | None = None,
    structured=None,
) -> SamplingParams:
    """The engine's params for choice number `choice` (seeded choices get seed + choice, so n
    seeded samples differ from each other and are each reproducible)."""
    kw: dict[str, Any] = {"max_tokens": max_tokens}
    if prompt_logprobs is not None:
        kw["prompt_logprobs"] = prompt_logprobs
    if structured is not None:
        kw["structured"] = structured
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "min_tokens",
    ):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if req.seed is not None:
        seed = req.seed + choice
        kw["seed"] = seed - 2**64 if seed > SEED_MAX and req.seed <= SEED_MAX else seed  # wraps, as a uint64
    if req.stop:
        kw["stop"] = req.stop
    if req.stop_token_ids:
        kw["stop_token_ids"] = req.stop_token_ids
    if logprobs is not None:
        kw["logprobs"] = logprobs
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        m = _FIELD_RE.search(str(e))
        raise bad_request(str(e).replace("SamplingParams.", ""), param=m.group(1) if m else None) from None
