"""Per-request sampling parameters (the contract's `SamplingParams`)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


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
            raise ValueError(
                f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if self.seed is not None:
            _check_number("seed", self.seed, int)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                raise TypeError(f"SamplingParams.stop must be a non-empty str or list of them, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
            ):
                raise TypeError(
                    f"SamplingParams.stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
                )
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, int)
            if not 0 <= self.logprobs <= 20:
                raise ValueError(f"SamplingParams.logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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
