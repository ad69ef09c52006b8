"""Per-request sampling parameters (the contract's `SamplingParams`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import msgspec

# A seed seeds a torch.Generator, which takes [-2**63, 2**64); msgpack carries the same range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# OpenAI allows 4 stop strings; more are fine, but each one is searched in every new piece of
# text and the longest is held back from the stream, so their number and length are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 4096  # all stop strings together
MAX_STOP_TOKEN_IDS = 1024
TOKEN_ID_LIMIT = 2**63  # token ids travel as msgpack int64; no vocabulary comes near
MAX_GRAMMAR_CHARS = 256 << 10  # a schema, regex or grammar's text (a real schema is a few KB)
MAX_CHOICES = 1024


class StructuredOutput(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """What the output must match (vLLM's `StructuredOutputsParams`): exactly one of a JSON schema
    (`json`, a dict or its JSON text), any JSON object (`json_object=True`), a `regex`, an EBNF
    `grammar` (XGrammar's dialect of GBNF: `root ::= ...`), one of a list of `choice` strings, or
    an XGrammar `structural_tag` (free text in which each triggered tag holds, e.g., a tool call's
    JSON; a dict or its JSON text)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"SamplingParams.structured must give exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"SamplingParams.structured.{name} is not valid JSON: {e}") from None
                if not isinstance(parsed, dict):
                    raise ValueError(f"SamplingParams.structured.{name} must be a JSON object")
            elif value is not None and not isinstance(value, dict):
                raise TypeError(f"SamplingParams.structured.{name} must be a dict or JSON text, got {value!r:.80}")
        if not isinstance(self.json_object, bool):
            raise TypeError(f"SamplingParams.structured.json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"SamplingParams.structured.{name} must be a non-empty str, got {value!r:.80}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise TypeError(
                    f"SamplingParams.structured.choice must be a non-empty list of str, got {self.choice!r:.80}"
                )
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(
                    f"SamplingParams.structured.choice has {len(self.choice)} entries; at most {MAX_CHOICES}"
                )
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"SamplingParams.structured.{self.kind} has {len(self.text):,} characters; at most "
                f"{MAX_GRAMMAR_CHARS:,} are allowed"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as one string (the compiled grammar's cache key, with `kind`)."""
        for value in (self.json, self.structural_tag):
            if value is not None:
                return value if isinstance(value, str) else json.dumps(value)
        if self.choice is not None:
            return json.dumps(self.choice)
        return self.regex or self.grammar or ""

    @classmethod
    def coerce(cls, value) -> StructuredOutput | None:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(KINDS)
            if unknown:
                raise ValueError(f"unknown SamplingParams.structured field(s) {sorted(unknown)}; known: {list(KINDS)}")
            return cls(**value)
        raise TypeError(f"SamplingParams.structured must be a StructuredOutput or dict, got {type(value).__name__}")


KINDS = tuple(StructuredOutput.__struct_fields__)


class SamplingParams(msgspec.Struct, kw_only=False, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time a token was generated
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    prompt_logprobs: int | None = None  # each prompt token's log-probability (+ top-n), from the prefill
    structured: StructuredOutput | None = None  # the output must match this schema, regex, grammar or choice

    def __post_init__(self) -> None:
        _check_number("max_tokens", self.max_tokens, int)
        if self.max_tokens <= 0:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        _check_number("temperature", self.temperature, float)
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p, float)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        _check_number("top_k", self.top_k, int)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        _check_number("min_p", self.min_p, float)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        _check_number("repetition_penalty", self.repetition_penalty, float)
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _check_number("seed", self.seed, int)
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise ValueError(f"SamplingParams.seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                raise TypeError(f"SamplingParams.stop must be a non-empty str or list of them, got {self.stop!r}")
            if len(self.stop) > MAX_STOP_STRINGS:
                raise ValueError(
                    f"SamplingParams.stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
                )
            total = sum(len(x) for x in self.stop)
            if total > MAX_STOP_CHARS:
                raise ValueError(
                    f"SamplingParams.stop strings have {total} characters together; at most "
                    f"{MAX_STOP_CHARS} are allowed"
                )
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
            ):
                raise TypeError(
                    f"SamplingParams.stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
                )
            bad = [t for t in self.stop_token_ids if not 0 <= t < TOKEN_ID_LIMIT]
            if bad:
                raise ValueError(f"SamplingParams.stop_token_ids must be in [0, 2**63), got {bad[:5]}")
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(
                    f"SamplingParams.stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                    f"{MAX_STOP_TOKEN_IDS} are allowed"
                )
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_number(name, value, int)
                if not 0 <= value <= 20:
                    raise ValueError(f"SamplingParams.{name} must be in [0, 20], got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), float)
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        _check_number("min_tokens", self.min_tokens, int)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logit_bias is not None:
            self.logit_bias = _check_bias(self.logit_bias)
        self.structured = StructuredOutput.coerce(self.structured)
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            # the grammar ends the output (its end is the EOS token): neither may overrule it
            raise ValueError(
                f"SamplingParams.{'ignore_eos' if self.ignore_eos else 'min_tokens'} cannot be combined with "
                "structured: the grammar decides where the output ends"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Anything that changes the logits before the choice (penalties, biases, min_tokens):
        such a request's choice depends on its earlier tokens, so it takes no draft tokens."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.min_tokens
        )

    @classmethod
    def coerce(cls, params: SamplingParams | dict | None) -> SamplingParams:
        if params is None:
            return cls()
        if isinstance(params, cls):
            return params
        if isinstance(params, dict):
            unknown = set(params) - set(cls.__struct_fields__)
            if unknown:
                raise ValueError(
                    f"unknown SamplingParams field(s) {sorted(unknown)}; known: {list(cls.__struct_fields__)}"
                )
            return cls(**params)
        raise TypeError(f"params must be SamplingParams, dict or None, got {type(params).__name__}")


def _check_number(name: str, value, kind: type) -> None:
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if isinstance(value, bool) or not ok:
        raise TypeError(f"SamplingParams.{name} must be {kind.__name__}, got {value!r}")
    # NaN passes every comparison check that follows; an int too big for a float is no better.
    if kind is float and not (math.isfinite(value) if isinstance(value, float) else abs(value) < 2**1023):
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
    # ints travel as msgpack int64 (the seed, a uint64 for torch, has its own range)
    if kind is int and name != "seed" and not -(2**63) <= value < 2**63:
        raise ValueError(f"SamplingParams.{name} must fit in 64 bits, got {value!r}")


MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias (OpenAI's own limit is 300)


def _check_bias(bias) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise TypeError(f"SamplingParams.logit_bias must be a dict of token id -> bias, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"SamplingParams.logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out = {}
    for k, v in bias.items():
        tok = int(k) if not isinstance(k, bool) and (isinstance(k, int) or str(k).isdigit()) else None
        if tok is None or not 0 <= tok < TOKEN_ID_LIMIT:
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids (ints >= 0), got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and -100 <= v <= 100):
            raise ValueError(f"SamplingParams.logit_bias values must be numbers in [-100, 100], got {v!r} for {k!r}")
        out[tok] = float(v)
    return out


def normalize_batch(prompts, params, prompt_token_ids) -> list[tuple[str | None, list[int] | None, SamplingParams]]:
    """One (prompt, ids, params) per request, validated before anything is submitted.
    Shared by `LLM` and the engine clients (it imports no torch)."""
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompts or prompt_token_ids")
    if prompts is not None:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a str or a list of str")
        items = [(p, None) for p in prompts]
    else:
        if not isinstance(prompt_token_ids, Sequence) or not prompt_token_ids:
            raise TypeError("prompt_token_ids must be a non-empty list of token-id lists")
        if all(isinstance(t, int) for t in prompt_token_ids):
            prompt_token_ids = [prompt_token_ids]
        items = [(None, list(ids)) for ids in prompt_token_ids]
    if isinstance(params, (list, tuple)):
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts")
        plist = [SamplingParams.coerce(p) for p in params]
    else:
        plist = [SamplingParams.coerce(params)] * len(items)
    return [(p, ids, sp) for (p, ids), sp in zip(items, plist)]
