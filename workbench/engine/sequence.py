"""A request as the scheduler sees it: tokens, how many are computed, its KV blocks, its state."""

from __future__ import annotations

import enum

from ..outputs import RequestMetrics
from ..sampling_params import SamplingParams

# A token sampled on the device that the host has not read yet (async scheduling): it counts as a
# token for scheduling and KV, and the model reads its value on the device (`inflight.py`)
PLACEHOLDER = -1


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: float):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.params = params
        self.state = SeqState.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.metrics = RequestMetrics(arrival=arrival)
        self.finish_reason: str | None = None
        self.spec_tokens: list[int] = []  # draft tokens proposed for this step
        self.spec_probs = None  # the draft model's distribution at each spec token (sampling only)
        self.spec_jump = False  # the spec tokens are the grammar's forced continuation (jump-forward)
        self.draft_computed = 0  # tokens whose KV is in the draft model's cache
        self.generator = None  # per-request torch.Generator for seeded sampling
        self.grammar = None  # a structured request's GrammarState (engine/structured.py), fed each kept token
        self.pending = 0  # trailing PLACEHOLDER tokens: sampled, still on the device (at most two)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens the host knows (placeholders still on the device are not output)."""
        return self.token_ids[len(self.prompt_token_ids) : len(self.token_ids) - self.pending]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids) - self.pending

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, state={self.state.value}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
