"""`LLM`: the engine in this process, driven step by step from the caller's thread."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .engine.llm_engine import LLMEngine
from .outputs import RequestOutput, StreamChunk
from .sampling_params import normalize_batch


class LLM:
    def __init__(self, model: str | None = None, **settings: Any):
        self.engine = LLMEngine(model, **settings)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts=None, params=None, *, prompt_token_ids=None, chat: bool = False) -> list[RequestOutput]:
        batch = normalize_batch(prompts, params, prompt_token_ids)
        ids = self._submit(batch, chat)
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(ids):
                for chunk in self.engine.step():
                    if chunk.output is not None and chunk.request_id in ids:
                        done[chunk.request_id] = chunk.output
        finally:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
        return [done[rid] for rid in ids]

    def stream(self, prompt=None, params=None, *, prompt_token_ids=None, chat: bool = False) -> Iterator[StreamChunk]:
        [(p, ids, sp)] = normalize_batch(
            prompt, params, None if prompt_token_ids is None else [prompt_token_ids]
        )
        rid = self.engine.add_request(p, sp, prompt_token_ids=ids, chat=chat)
        finished = False
        try:
            while not finished:
                for chunk in self.engine.step():
                    if chunk.request_id == rid:
                        finished = chunk.finish_reason is not None
                        yield chunk
        finally:
            if not finished:
                self.engine.abort_request(rid)

    def _submit(self, batch, chat: bool) -> list[str]:
        # Validate everything first so one bad prompt submits nothing.
        encoded = [self.engine.encode_prompt(p, ids, chat) for p, ids, _ in batch]
        submitted: list[str] = []
        try:
            for (p, _, sp), ids in zip(batch, encoded):
                submitted.append(self.engine.add_request(p, sp, prompt_token_ids=ids))
        except Exception:
            for rid in submitted:
                self.engine.abort_request(rid)
            raise
        return submitted

    def configure(self, **changes) -> dict:
        return self.engine.configure(**changes)

    def settings(self) -> dict:
        return self.engine.settings.as_dict()

    def status(self) -> dict:
        return self.engine.status()

    def metrics(self) -> dict:
        return self.engine.metrics()

    def timeline(self, since: int | None = None):
        return self.engine.timeline.read(since)
