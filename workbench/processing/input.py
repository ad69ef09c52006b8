"""Requests into what the engine core takes: validated token ids, checked parameters, a compiled
constraint (vLLM v1's input processor).

One `InputProcessor` per engine, used by every way in: `LLM.submit`, the engine process's
tokenizer thread, the engine's own `add_request`. The core adds a `ProcessedRequest` without
reading its ids again. Thread-safe: it reads only what never changes after loading (the
tokenizer, the context, the vocabulary) and the grammar cache (which locks), so the engine process
runs it off its step loop and never touches the engine there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..sampling_params import SamplingParams
from ..tokenizer import too_long_message


@dataclass(frozen=True)
class ProcessedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: Any = None  # the text or chat messages as given (a label, and `RequestOutput.prompt`)
    grammar: Any = None  # the constraint compiled (`structured.Compiled`), or None


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, grammars):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.grammars = grammars  # `structured.Grammars`: compiled constraints, cached (thread-safe)

    def process(
        self,
        prompt=None,
        params: SamplingParams | dict | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        chat: bool = False,
    ) -> ProcessedRequest:
        """A request checked whole (ValueError or TypeError naming what is wrong), ready to add."""
        params = SamplingParams.coerce(params)
        ids = self.encode(prompt, prompt_token_ids, chat)
        outside = [t for t in (params.logit_bias or ()) if t >= self.vocab_size]
        if outside:
            raise ValueError(f"logit_bias names token ids outside the vocabulary [0, {self.vocab_size}): {outside[:5]}")
        return ProcessedRequest(ids, params, prompt, self.grammar(params))

    def grammar(self, params: SamplingParams):
        """The request's constraint compiled (cached; an invalid one raises ValueError), or None."""
        return None if params.structured is None else self.grammars.get(params.structured)

    def is_compiled(self, params: SamplingParams | None) -> bool:
        """Whether the request's constraint (if any) is compiled already (else compiling may take seconds)."""
        s = params.structured if params is not None else None
        return s is None or self.grammars.cached(s)

    def encode(self, prompt, prompt_token_ids, chat: bool) -> list[int]:
        """Token ids for a request; prompt_token_ids win (prompt is then only a label)."""
        if prompt is None and prompt_token_ids is None:
            raise ValueError("give a prompt or prompt_token_ids")
        if prompt_token_ids is not None:
            if not isinstance(prompt_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids
            ):
                raise TypeError("prompt_token_ids must be a list of ints")
            ids = list(prompt_token_ids)
            if len(ids) >= self.max_model_len:  # before scanning millions of ids
                raise ValueError(self.too_long(len(ids)))
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        else:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
            if self.tokenizer is None:
                what = "a chat cannot be rendered" if chat else "text cannot be encoded"
                raise ValueError(
                    f"this model has no tokenizer (a model shape's random weights, or a folder without "
                    f"tokenizer.json), so {what}: give the prompt as token ids (prompt_token_ids in Python, "
                    "a list of ints as a completion's prompt over HTTP)"
                )
            # Refused from its length (or a prefix's tokens) when it cannot fit: tokenizing
            # megabytes costs seconds. A chat message is checked before its template is rendered.
            if chat:
                self.tokenizer.check_fits(prompt, self.max_model_len)
                prompt = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            ids = self.tokenizer.encode_within(prompt, self.max_model_len, add_special_tokens=not chat)
            if len(ids) >= self.max_model_len:  # a text whose prefix fit, tokenized whole
                raise ValueError(self.too_long(len(ids)))
        if not ids:
            raise ValueError("prompt is empty: it must have at least one token")
        return ids

    def too_long(self, num_tokens: int) -> str:
        return too_long_message(f"prompt has {num_tokens} tokens", self.max_model_len)
