"""What the engine hands back: finished outputs, stream chunks and per-request metrics.

All are msgspec Structs so the same objects cross the process boundary as msgpack, never pickle.
Times are `time.monotonic()` seconds (system-wide on Linux, so comparable across processes).
"""

from __future__ import annotations

import msgspec


class RequestMetrics(msgspec.Struct, omit_defaults=True):
    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = msgspec.field(default_factory=list)
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def queued(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probability of the sampled token plus the top-n alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class RequestOutput(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"
    metrics: RequestMetrics
    prompt: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    usage: dict | None = None  # a remote server's own token counts (OpenAI `usage`)
    # Through a router (workbench.routing): the member that answered, the policy that decided and
    # its score (a cascade: the kept answer's confidence), and every member that ran it, in order
    route: str | None = None
    route_policy: str | None = None
    route_score: float | None = None
    route_tried: list[str] | None = None
    from_cache: bool = False  # answered by the response cache (an exact repeat), without a step
    # SamplingParams.prompt_logprobs: each prompt token's log-probability given those before it
    # (the first has none: None), from the prefill
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # SamplingParams.structured: whether the output matches the whole grammar (False: it ended, at
    # max_tokens or a stop string, before the grammar was complete, so it does not parse); None: unconstrained
    structured_complete: bool | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CoreFinal(msgspec.Struct, array_like=True, omit_defaults=True):
    """With a request's last `CoreOutput`: what only the engine core knows of the whole request."""

    metrics: RequestMetrics
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output id kept (a stop string's wasted step dropped)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    structured_complete: bool | None = None
    from_cache: bool = False


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the engine core hands back for one request after a step: its new token ids (EOS, stop
    ids, max_tokens and the context already applied: they free KV) and their logprobs; text and
    stop strings are the output processor's (`workbench.processing.output`)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    final: CoreFinal | None = None  # set exactly when finish_reason is


class StreamChunk(msgspec.Struct, omit_defaults=True):
    request_id: str
    text_delta: str = ""
    token_ids_delta: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    logprobs_delta: list[TokenLogprobs] | None = None
    # Set on the last chunk of a request: the whole output, so callers need not reassemble it.
    output: RequestOutput | None = None
