"""The OpenAI HTTP dialects of the servers we attach to: URLs, which server it is, request
bodies, logprobs, and errors mapped onto our exception types."""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

import httpx

from ..errors import EngineDeadError, WorkbenchIPCError
from ..outputs import TokenLogprobs
from ..sampling_params import SamplingParams
from .prometheus import metrics_prefix


class RemoteSettingsError(ValueError):
    """A remote server's settings cannot be changed through its OpenAI API."""


class RemoteError(WorkbenchIPCError):
    """The remote server failed (5xx) or answered something that is not the OpenAI API."""


# -- helpers --------------------------------------------------------------------------------------
def split_url(url: str) -> tuple[str, str | None]:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"a remote engine URL starts with http:// or https://, got {url!r}")
    parts = urllib.parse.urlsplit(url)
    model = urllib.parse.parse_qs(parts.query).get("model", [None])[0]
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", "")), model


def detect_kind(card: dict, samples: dict, server_header: str) -> str:
    owned = str(card.get("owned_by", "")).lower()
    prefix = metrics_prefix(samples)
    if owned == "workbench" or prefix == "workbench:":
        return "workbench"
    if owned == "vllm" or prefix == "vllm:":
        return "vllm"
    if owned == "sglang" or prefix == "sglang:":
        return "sglang"
    if owned == "llamacpp" or prefix == "llamacpp:" or "llama.cpp" in server_header.lower():
        return "llama.cpp"
    if owned == "me" and "permissions" in card:
        return "llama-cpp-python"
    if owned in ("tgi", "huggingface") or prefix == "tgi_" or "text-generation" in server_header.lower():
        return "tgi"
    return "openai-compatible"


def sglang_settings(info: dict) -> dict:
    out: dict[str, Any] = {}
    args = info.get("server_args", info) if isinstance(info, dict) else {}
    if isinstance(args.get("max_running_requests"), int):
        out["max_num_seqs"] = args["max_running_requests"]
    if isinstance(args.get("chunked_prefill_size"), int):
        out["max_num_batched_tokens"] = args["chunked_prefill_size"]
    if isinstance(args.get("disable_radix_cache"), bool):
        out["prefix_caching"] = not args["disable_radix_cache"]
    if isinstance(args.get("page_size"), int):
        out["block_size"] = args["page_size"]
    for ours, theirs in (("kv_cache_dtype", "kv_cache_dtype"), ("dtype", "dtype"), ("quantization", "quantization")):
        if args.get(theirs) is not None:
            out[ours] = args[theirs]
    if "speculative_algorithm" in args:
        out["speculative"] = args["speculative_algorithm"] or "off"
    if isinstance(args.get("speculative_num_draft_tokens"), int):
        out["num_speculative_tokens"] = args["speculative_num_draft_tokens"]
    if isinstance(args.get("context_length"), int):
        out["max_model_len"] = args["context_length"]
    return out


def token_id(token: Any) -> int:
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[9:])
        except ValueError:
            return -1
    return -1


def parse_logprobs(block: Any, token_ids: list[int]) -> list[TokenLogprobs]:
    """Completions ({tokens, token_logprobs, top_logprobs}) or chat ({content: [...]}) logprobs."""
    if not isinstance(block, dict):
        return []
    out = []
    if isinstance(block.get("content"), list):
        for i, e in enumerate(block["content"]):
            tid = token_id(e.get("token"))
            if tid < 0 and i < len(token_ids):
                tid = token_ids[i]
            top = [(token_id(t.get("token")), float(t.get("logprob", 0.0))) for t in e.get("top_logprobs") or []]
            out.append(TokenLogprobs(tid, float(e.get("logprob", 0.0)), top))
        return out
    tokens = block.get("tokens") or []
    lps = block.get("token_logprobs") or []
    tops = block.get("top_logprobs") or []
    for i, tok in enumerate(tokens):
        tid = token_id(tok)
        if tid < 0 and i < len(token_ids):
            tid = token_ids[i]
        top_d = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        lp = lps[i] if i < len(lps) and lps[i] is not None else 0.0
        out.append(TokenLogprobs(tid, float(lp), [(token_id(t), float(v)) for t, v in top_d.items()]))
    return out


def error_message(content: bytes) -> str:
    try:
        obj = json.loads(content)
    except ValueError:
        return content[:300].decode(errors="replace")
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)
    return str(err)


def http_error(status: int, content: bytes, base: str) -> BaseException:
    msg = error_message(content)
    if status in (401, 403):
        return PermissionError(f"{base}: HTTP {status}: {msg}")
    if status == 404:
        return LookupError(f"{base}: {msg}")
    if status in (400, 413, 422):
        return ValueError(msg)
    if status == 503:
        return EngineDeadError(f"{base} is unavailable (HTTP 503): {msg}")
    if status == 504:
        return TimeoutError(f"{base}: {msg}")
    return RemoteError(f"{base}: HTTP {status}: {msg}")


def error_from_object(err: Any, base: str) -> BaseException:
    if isinstance(err, dict):
        code = err.get("code")
        status = code if isinstance(code, int) else {"invalid_request_error": 400}.get(err.get("type"), 500)
        return http_error(status, json.dumps({"error": err}).encode(), base)
    return RemoteError(f"{base}: {err}")


def transport_error(base: str, e: BaseException) -> BaseException:
    if isinstance(e, httpx.TimeoutException):
        return TimeoutError(f"{base} did not answer in time: {e}")
    return EngineDeadError(f"cannot reach {base}: {e}")


# -- the client -----------------------------------------------------------------------------------
# Fields beyond OpenAI's that each kind of server takes, by our SamplingParams name -> its name.
EXTRA_FIELDS = {
    "workbench": {
        "top_k": "top_k",
        "min_p": "min_p",
        "repetition_penalty": "repetition_penalty",
        "ignore_eos": "ignore_eos",
        "stop_token_ids": "stop_token_ids",
        "min_tokens": "min_tokens",
        "structured": "structured_outputs",
    },
    "llama.cpp": {
        "top_k": "top_k",
        "min_p": "min_p",
        "repetition_penalty": "repeat_penalty",
        "ignore_eos": "ignore_eos",
        "structured": "llama.cpp",
    },
    "llama-cpp-python": {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repeat_penalty"},
    "tgi": {"repetition_penalty": "repetition_penalty"},
}
EXTRA_FIELDS["vllm"] = EXTRA_FIELDS["workbench"]
EXTRA_FIELDS["sglang"] = {**EXTRA_FIELDS["workbench"], "structured": "sglang"}
TOKEN_ID_KINDS = ("workbench", "vllm")  # return_token_ids / return_tokens_as_token_ids


def structured_fields(so, how: str | None) -> dict | None:
    """A constraint as a server's request fields: vLLM's (and ours) `structured_outputs`, SGLang's
    `regex` / `ebnf` / `response_format`, llama.cpp's `json_schema` / `grammar`, else OpenAI's
    `response_format` (JSON only). None: this server takes no such constraint."""
    kind = so.kind
    if how == "structured_outputs":
        return {"structured_outputs": {kind: getattr(so, kind)}}
    schema = json.loads(so.json) if isinstance(so.json, str) else so.json
    if kind == "json_object":
        schema = {"type": "object"}
    if how == "llama.cpp":
        if schema is not None:
            return {"json_schema": schema}
        return {"grammar": so.grammar} if kind == "grammar" else None
    if how == "sglang":
        if kind == "regex":
            return {"regex": so.regex}
        if kind == "choice":
            return {"regex": "|".join(re.escape(c) for c in so.choice)}
        if kind == "grammar":
            return {"ebnf": so.grammar}
    if schema is not None:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}
    return None


def request_body(
    model: str | None,
    prompt: str | None,
    ids: list[int] | None,
    sp: SamplingParams,
    chat: bool,
    *,
    extra: dict[str, str],
    token_ids: bool,
    usage_in_stream: bool,
    dropped: Callable[[str], None],
) -> tuple[str, dict]:
    """(path, JSON body) of one streamed request. `extra` maps our sampling fields onto this server's
    names; a non-default field it has none for is left out and reported to `dropped`."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": sp.max_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "stream": True,
    }
    if usage_in_stream:
        body["stream_options"] = {"include_usage": True}
    if sp.seed is not None:
        body["seed"] = sp.seed
    if sp.stop:
        body["stop"] = sp.stop
    for name in ("presence_penalty", "frequency_penalty"):  # OpenAI's own: every server takes them
        if getattr(sp, name):
            body[name] = getattr(sp, name)
    if sp.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    if sp.structured is not None:
        fields = structured_fields(sp.structured, extra.get("structured"))
        if fields is None:
            dropped(f"structured ({sp.structured.kind})")
        else:
            body.update(fields)
    defaults = SamplingParams()
    for name in (
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "min_tokens",
        "prompt_logprobs",
    ):
        value = getattr(sp, name)
        if value == getattr(defaults, name) or (name == "stop_token_ids" and not value):
            continue
        if name in extra:
            body[extra[name]] = value
        else:
            dropped(name)
    if token_ids:
        body["return_token_ids"] = True
        if sp.logprobs is not None:
            body["return_tokens_as_token_ids"] = True
    if chat:
        if prompt is None:
            raise ValueError("chat=True needs a text prompt, not prompt_token_ids")
        body["messages"] = [{"role": "user", "content": prompt}]
        if sp.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = sp.logprobs
        return "/v1/chat/completions", body
    body["prompt"] = prompt if ids is None else ids
    if sp.logprobs is not None:
        body["logprobs"] = sp.logprobs
    return "/v1/completions", body
