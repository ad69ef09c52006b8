"""Decides, every step, which sequences run and how many of their tokens are computed.

Policies (the `batching` setting):
- continuous: iteration-level batching. Running sequences go first (decodes, unfinished
  prefill chunks), then waiting ones are admitted while the token budget
  (`max_num_batched_tokens`) and `max_num_seqs` allow; a long prompt is split across steps.
- static: admit a batch only when nothing runs, then run it to completion.
- off: static with a batch of one.
Out of KV blocks, the newest running sequence is preempted (blocks freed, recomputed later).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..settings import EngineSettings
from ..timeline import TimelineRecorder
from .block_manager import BlockManager
from .sequence import SeqState, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for this sequence in the step (incl. draft tokens)
    kind: str  # "prefill" | "decode" | "verify"

    @property
    def samples(self) -> bool:
        """True when the step reaches the end of the sequence, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens >= len(self.seq) + len(self.seq.spec_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_hit_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def phase(self) -> str:
        kinds = {s.kind for s in self.scheduled}
        if "verify" in kinds:
            return "verify"
        if kinds == {"decode"}:
            return "decode"
        return "prefill" if kinds == {"prefill"} else "mixed"


class Scheduler:
    def __init__(self, settings: EngineSettings, block_manager: BlockManager, timeline: TimelineRecorder):
        self.settings = settings
        self.bm = block_manager
        self.timeline = timeline
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    # -- policy ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.settings.max_num_batched_tokens
        policy = self.settings.batching
        max_seqs = 1 if policy == "off" else self.settings.max_num_seqs

        if policy != "continuous" and not self.running:
            # Static batching forms the whole batch up front; the token budget only paces it.
            while self.waiting and len(self.running) < max_seqs and self.bm.can_allocate(self.waiting[0]):
                self._admit(self.waiting.popleft(), out)
        budget = self._schedule_running(out, budget)
        if policy == "continuous":
            while self.waiting and budget > 0 and len(self.running) < max_seqs:
                if not self.bm.can_allocate(self.waiting[0]):
                    break
                seq = self.waiting.popleft()
                self._admit(seq, out)
                n = min(len(seq) - seq.num_computed_tokens, budget)
                out.scheduled.append(ScheduledSeq(seq, n, "prefill"))
                budget -= n
        return out

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> None:
        hit = self.bm.allocate(seq)
        out.prefix_hit_tokens += hit
        seq.metrics.prefix_hit_tokens = max(seq.metrics.prefix_hit_tokens, hit)
        resumed = seq.state is SeqState.PREEMPTED
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        now = time.monotonic()
        if seq.metrics.first_scheduled is None:
            seq.metrics.first_scheduled = now
        self.timeline.add_request(now, seq.request_id, "resumed" if resumed else "scheduled",
                                  f"prefix_hit={hit}" if hit else None)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            todo = len(seq) + len(seq.spec_tokens) - seq.num_computed_tokens
            n = min(todo, budget)
            while not self.bm.ensure_capacity(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.state is not SeqState.RUNNING:
                break  # seq itself was the newest and got preempted; nothing newer remains
            if todo > 1 and not seq.spec_tokens:
                kind = "prefill"
            else:
                kind = "verify" if seq.spec_tokens else "decode"
            if kind == "verify" and n < todo:  # budget cannot hold every draft token: drop them
                seq.spec_tokens, seq.spec_probs = [], None
                n, kind = 1, "decode"
            out.scheduled.append(ScheduledSeq(seq, n, kind))
            budget -= n
            i += 1
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.bm.free(seq)
        seq.num_computed_tokens = seq.draft_computed = 0
        seq.spec_tokens = []
        seq.state = SeqState.PREEMPTED
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.timeline.add_request(time.monotonic(), seq.request_id, "preempted")
