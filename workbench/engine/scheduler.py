"""Decides, every step, which sequences run and how many of their tokens are computed.

Policies (the `batching` setting):
- continuous: iteration-level batching. Running sequences go first (decodes, unfinished
  prefill chunks), then waiting ones are admitted while the token budget
  (`max_num_batched_tokens`) and `max_num_seqs` allow; a long prompt is split across steps.
- static: admit a batch only when nothing runs, then run it to completion.
- off: static with a batch of one.
Out of KV blocks, the newest running sequence is preempted (blocks freed, recomputed later).

The budget counts tokens, but a prefill chunk's work grows with its context: past the model's
`attention_context` (the context at which a token's attention costs what its matmuls cost), each
token of a chunk counts 1 + (context - attention_context) / attention_context, so a long prompt's
later chunks get smaller and a step beside running decodes stays about as long as an early one
(`attention_aware_budget`). Shorter contexts, decodes and verifies count one a token, as before.
While requests decode, a step's prefill is also cut so the step is predicted to take at most
`step_time_target_ms` (their worst gap between tokens). The prediction counts time units, each
token one plus its context over the model's `time_context` (where a token's attention takes what its
matmuls take), at the milliseconds per unit that recent steps with prefill work took (learned in
`record_step`, on the engine's clock or the simulator's). Time is linear in those units at every
context, so the learned rate holds as a prompt's context grows; the step records the bound.

The scheduler owns every sequence's state and KV blocks: it admits, preempts and removes, and
after each step `update_from_output` (and `update_after_verify`) advances what was computed,
appends the new tokens and registers the full blocks for prefix reuse, each state change next to
its KV consequence. The engine asks it for capacity (`reserve`) and never edits blocks itself.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..settings import EngineSettings
from ..timeline import BatchEntry, TimelineRecorder
from .block_manager import BlockManager
from .sequence import PLACEHOLDER, SeqState, Sequence


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
    work: float = 0.0  # budget units the step used (tokens, long-context chunks counting more)
    time_units: float = 0.0  # what its time is predicted from (time_units of each scheduled part)
    time_target_ms: float = 0.0  # the step-time target in force (0: none)
    time_capped: bool = False  # that target cut a prefill chunk of this step
    prefix_hit_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    jump_forward_tokens: int = 0  # forced tokens a grammar proposed and the step kept: model steps saved

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


MIN_CAPPED_BUDGET = 64  # the step-time cap never leaves a step less than this (a prefill must progress)
# Prefill attention runs a tile of 16 queries at a time (the CPU extend kernel's lanes): a chunk of
# 150 pays for 160, a tenth of its attention for nothing at long contexts, where attention is most
# of a step.
CHUNK_ALIGN = 16


def _aligned(n: int) -> int:
    """A cut chunk of `n` tokens cut down to whole tiles, where that leaves at least two. (A chunk
    cut by a whole tile more, so that its tiles x KV heads divide evenly among two threads, gave
    up more tokens than the idle thread it saved.)"""
    return n - n % CHUNK_ALIGN if n >= 2 * CHUNK_ALIGN else n


def _most(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [lo, hi] with fits(n), for a `fits` true up to some n and false after (lo
    if none)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def time_units(context: int, n: int, time_context: float | None) -> float:
    """`n` tokens after `context` computed ones in the units a step's time is linear in: each token
    one, plus its context (the positions it attends to) over `time_context`."""
    if not time_context or n <= 0:
        return float(max(n, 0))
    return n + (n * context + n * (n - 1) / 2) / time_context


def chunk_in_time(context: int, todo: int, units: float, time_context: float | None) -> int:
    """The most of `todo` prefill tokens after `context` whose time units fit `units` (maybe 0),
    a chunk that is cut ending on a whole tile (`_aligned`)."""
    if time_units(context, todo, time_context) <= units:
        return todo
    return _aligned(_most(0, todo - 1, lambda n: time_units(context, n, time_context) <= units))


def chunk_cost(context: int, n: int, attention_context: float | None) -> float:
    """The budget's units that `n` prefill tokens after `context` computed ones take: one a token,
    plus each token's context past `attention_context` over `attention_context`."""
    if not attention_context or n <= 0:
        return float(n)
    c0 = int(attention_context)
    first, last = max(context, c0), context + n - 1  # the tokens whose context is past c0
    if last < c0:
        return float(n)

    def tri(k: int) -> int:  # 0 + 1 + ... + k
        return k * (k + 1) // 2 if k > 0 else 0

    return n + (tri(last - c0) - tri(first - 1 - c0)) / attention_context


def chunk_within(context: int, todo: int, budget: float, attention_context: float | None) -> int:
    """The most of `todo` prefill tokens after `context` whose cost fits `budget` (at least one).
    Counting work (`attention_context` given), a chunk the budget cuts ends on a whole tile."""
    n = min(todo, int(budget))
    if not attention_context or n <= 1:
        return max(1, n)
    if chunk_cost(context, n, attention_context) > budget:
        n = _most(1, n, lambda k: chunk_cost(context, k, attention_context) <= budget)
    return _aligned(n) if n < todo else n


def _flops_per_token(config) -> tuple[float, float, float]:
    """(the layers' matmul FLOPs, the LM head's, attention's per earlier position) of one token."""
    H, layers = config.hidden_size, config.num_hidden_layers
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = H * (q + 2 * kv) + q * H
    dense = 3 * H * config.intermediate_size
    moe = getattr(config, "moe_layers", ()) or ()
    active = getattr(config, "num_experts_per_tok", 0) or 0
    expert = 3 * H * (getattr(config, "moe_intermediate_size", 0) or 0)
    matmul = layers * per_layer + (layers - len(moe)) * dense + len(moe) * active * expert
    return 2 * matmul, 2 * config.vocab_size * H, 4 * layers * q  # QK^T and PV per earlier position


def prefill_flops(config, n: int) -> float:
    """FLOPs of prefilling an `n`-token prompt in one step: every token's matmuls, causal attention
    (token i over i earlier positions and itself), the LM head on the last token."""
    matmul, head, attention = _flops_per_token(config)
    return n * matmul + head + attention * n * (n + 1) / 2


def attention_context_of(config, attention_slower: float = 2.8) -> float:
    """The context length at which one token's attention (QK and PV over every earlier position, in
    every layer) costs as much as its matmuls (the LM head's included), counting attention
    `attention_slower` times dearer per FLOP: the budget's weight. SmolLM2-135M: ~1,400 tokens. It
    weighs long contexts about twice what they take (see `time_context_of`): it makes a long
    prompt's chunks shrink early; the step time is predicted from `time_context_of`."""
    matmul, head, attention = _flops_per_token(config)
    return (matmul + head) / (attention * attention_slower)


def time_context_of(config, attention_slower: float = 1.2) -> float:
    """The context length at which a prompt token's attention takes as long as its matmuls (the LM
    head runs on a chunk's last token only), attention running `attention_slower` times slower per
    FLOP: the step-time prediction's. 2026-12-06, a 2-vCPU Zen 4, an 8k prompt's chunks: extend
    attention ~310 GFLOP/s, the bf16 tiles ~360-390; SmolLM2-135M: ~2,560 tokens, where those steps'
    times put it at ~2,650. A host where the ratio differs is still predicted from the learned rate,
    which then drifts as the context grows."""
    matmul, _, attention = _flops_per_token(config)
    return matmul / (attention * attention_slower)


class Scheduler:
    def __init__(
        self,
        settings: EngineSettings,
        num_blocks: int,
        timeline: TimelineRecorder,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings
        self.clock = clock  # the engine's time.monotonic; the simulator's simulated time
        self.bm = BlockManager(num_blocks, settings.block_size, settings.prefix_caching and settings.kv_cache)
        self.timeline = timeline
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # sequences whose prompt's KV arrived computed (a disaggregated decode replica, simulated):
        # admitted, only their new token is computed; a preemption loses that KV
        self._kv_arrived: set[str] = set()
        # the model's attention context (attention_context_of), set by the engine; None: tokens only
        self.attention_context: float | None = None
        self.time_context: float | None = None  # time_context_of the model, set by the engine; None: tokens
        self.ms_per_unit: float | None = None  # what recent steps with prefill work took per time unit

    def _prefill_chunk(self, seq: Sequence, todo: int, budget: float, out: SchedulerOutput) -> tuple[int, float]:
        """(tokens, budget units) of `seq`'s next prefill chunk within `budget` and the time left
        under the step-time target (`out.time_target_ms`; the step's first prefill gets at least
        MIN_CAPPED_BUDGET tokens: a prompt always progresses; a later one may get none)."""
        c0 = self.attention_context if self.settings.attention_aware_budget else None
        context = seq.num_computed_tokens
        n = chunk_within(context, todo, budget, c0)
        if out.time_target_ms:
            left = out.time_target_ms / self.ms_per_unit - out.time_units
            timed = chunk_in_time(context, n, left, self.time_context)
            if not any(s.kind == "prefill" for s in out.scheduled):
                timed = max(timed, min(n, MIN_CAPPED_BUDGET))
            out.time_capped |= timed < n
            n = timed
        return n, chunk_cost(context, n, c0)

    @property
    def block_manager(self) -> BlockManager:
        """For reading (usage, tests); changes go through the scheduler's methods."""
        return self.bm

    def add(self, seq: Sequence, *, kv_arrived: bool = False) -> None:
        """Queue `seq`. kv_arrived: its prompt's KV comes computed (sent by a prefill replica)."""
        if kv_arrived:
            self._kv_arrived.add(seq.request_id)
        self.waiting.append(seq)

    def blocks_needed(self, num_tokens: int) -> int | None:
        """KV blocks a sequence of `num_tokens` needs, or None when that is within the cache."""
        need = self.bm.blocks_for(num_tokens)
        return need if need > self.bm.num_blocks else None

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for the first `num_tokens` of `seq` (draft tokens, a scoring pass); False when
        the cache cannot hold them now."""
        return self.bm.ensure_capacity(seq, num_tokens)

    def release(self, seq: Sequence) -> None:
        """Free the blocks of a sequence the scheduler never ran (a scoring pass)."""
        self.bm.free(seq)

    def computed(self, seq: Sequence, num_tokens: int) -> None:
        """`num_tokens` more of a reserved sequence's KV is in the cache (a scoring pass, run
        outside the steps)."""
        seq.num_computed_tokens += num_tokens

    def finish(self, seq: Sequence, reason: str, now: float) -> bool:
        """End a sequence (EOS, max tokens, a stop string, an abort): its finish reason and time,
        out of the queues, its blocks freed. Returns whether it was running."""
        was_running = seq.state is SeqState.RUNNING
        seq.metrics.finished = now
        seq.finish_reason = reason
        self.remove(seq)
        return was_running

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._kv_arrived.discard(seq.request_id)
        self.bm.free(seq)
        seq.state = SeqState.FINISHED

    # -- speculative decoding: the draft tokens a step verifies, and the draft model's KV --------
    def attach_drafts(self, seq: Sequence, tokens: list[int], probs=None, jump: bool = False) -> None:
        """Draft tokens for `seq`'s next step to verify (and the draft's distribution at each;
        `jump`: they are the continuation its grammar forces)."""
        seq.spec_tokens, seq.spec_probs, seq.spec_jump = tokens, probs, jump

    def clear_drafts(self) -> None:
        """Drop every sequence's pending draft tokens (speculation switched or resized)."""
        for seq in (*self.running, *self.waiting):
            seq.spec_tokens, seq.spec_probs, seq.spec_jump = [], None, False

    def draft_computed(self, seq: Sequence, num_tokens: int) -> None:
        """The draft model's cache holds `seq`'s first `num_tokens` tokens."""
        seq.draft_computed = num_tokens

    def reset_draft_caches(self) -> None:
        """A new draft model: its cache holds nothing of any sequence yet."""
        for seq in (*self.running, *self.waiting):
            seq.draft_computed = 0

    # -- policy ---------------------------------------------------------------------------------
    def _time_target(self) -> float:
        """The step-time target in force: while requests decode, once a rate has been learned."""
        target = self.settings.step_time_target_ms
        if target and self.ms_per_unit and any(len(s) - s.num_computed_tokens <= 1 for s in self.running):
            return float(target)
        return 0.0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(time_target_ms=self._time_target())
        budget = full = float(self.settings.max_num_batched_tokens)
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
                n, cost = self._prefill_chunk(seq, len(seq) - seq.num_computed_tokens, budget, out)
                if not n:  # the step-time target is spent: it starts next step (admitted, its blocks held)
                    break
                self._add(out, ScheduledSeq(seq, n, "prefill"))
                budget -= cost
        out.work = full - budget
        return out

    def _add(self, out: SchedulerOutput, s: ScheduledSeq) -> None:
        out.scheduled.append(s)
        out.time_units += time_units(s.seq.num_computed_tokens, s.num_tokens, self.time_context)

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> None:
        hit = self.bm.allocate(seq)
        if seq.request_id in self._kv_arrived:
            seq.num_computed_tokens = max(seq.num_computed_tokens, len(seq) - 1)
        out.prefix_hit_tokens += hit
        seq.metrics.prefix_hit_tokens = max(seq.metrics.prefix_hit_tokens, hit)
        resumed = seq.state is SeqState.PREEMPTED
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        now = self.clock()
        if seq.metrics.first_scheduled is None:
            seq.metrics.first_scheduled = now
        self.timeline.add_request(
            now, seq.request_id, "resumed" if resumed else "scheduled", f"prefix_hit={hit}" if hit else None
        )

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.pending and seq.num_output_tokens + seq.pending >= seq.params.max_tokens:
                i += 1  # its last token is on the device: it finishes when that lands
                continue
            todo = len(seq) + len(seq.spec_tokens) - seq.num_computed_tokens
            n, cost = min(todo, max(1, int(budget))), None
            if todo > 1 and not seq.spec_tokens:  # a prefill chunk: its attention may count
                n, cost = self._prefill_chunk(seq, todo, budget, out)
                if not n:  # the step-time target is spent: its next chunk waits, the decodes after it run
                    i += 1
                    continue
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
                seq.spec_tokens, seq.spec_probs, seq.spec_jump = [], None, False
                n, kind = 1, "decode"
            self._add(out, ScheduledSeq(seq, n, kind))
            budget -= n if cost is None or kind != "prefill" else cost
            i += 1
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput | None, counted: bool = True) -> None:
        self.running.remove(seq)
        if out is not None:
            for s in out.scheduled:
                if s.seq is seq:
                    out.time_units -= time_units(seq.num_computed_tokens, s.num_tokens, self.time_context)
            out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.bm.free(seq)
        self._kv_arrived.discard(seq.request_id)
        seq.num_computed_tokens = seq.draft_computed = 0
        seq.spec_tokens, seq.spec_probs = [], None
        seq.state = SeqState.PREEMPTED
        self.waiting.appendleft(seq)
        if counted:
            seq.metrics.num_preemptions += 1
            self.timeline.add_request(self.clock(), seq.request_id, "preempted")

    def preempt_all(self) -> None:
        """Drop every running sequence's KV (they recompute it when rescheduled): a re-layout of
        the cache. Not counted as preemptions (no sequence lost to another)."""
        for seq in list(self.running):
            self._preempt(seq, None, counted=False)

    # -- after a step -----------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, sampled: dict[int, int], verified: set[int]) -> None:
        """Advance each scheduled sequence by what the step computed. `sampled` maps a position in
        `sched.scheduled` to the token sampled there; positions in `verified` are settled by
        `update_after_verify`."""
        kv = self.settings.kv_cache
        for i, s in enumerate(sched.scheduled):
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
            if i in verified:
                continue
            if i in sampled:
                seq.token_ids.append(sampled[i])
                if seq.grammar is not None:
                    seq.grammar.accept([sampled[i]])
                if not kv:
                    seq.num_computed_tokens = 0  # no cache: the whole context is recomputed next step
                    continue
            if kv:
                self.bm.register_computed(seq)

    def advance(self, sched: SchedulerOutput, sampled: list[int]) -> list[int]:
        """Async scheduling: a step was launched and its tokens are still on the device. Advance
        what it computed and give each sampling sequence (positions in `sampled`, in row order) a
        placeholder for its token; returns their positions, in that order. Its blocks are registered when
        the tokens land (`settle`): a placeholder must not go into a prefix hash."""
        positions = []
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
        for i in sampled:
            seq = sched.scheduled[i].seq
            positions.append(len(seq.token_ids))
            seq.token_ids.append(PLACEHOLDER)
            seq.pending += 1
        return positions

    def settle(self, seq: Sequence, position: int | None = None, token: int | None = None) -> None:
        """A launched step's token landed (`position`: its placeholder's), or a sequence of it that
        sampled nothing: register the blocks the step completed."""
        if position is not None:
            assert seq.token_ids[position] == PLACEHOLDER, (seq, position)
            seq.token_ids[position] = token
            seq.pending -= 1
        if seq.state is SeqState.RUNNING:
            self.bm.register_computed(seq)

    def drop_pending(self, seq: Sequence) -> None:
        """A finishing sequence's tokens still on the device are not its output."""
        if seq.pending:
            del seq.token_ids[-seq.pending :]
            seq.pending = 0

    def update_after_verify(self, seq: Sequence, base: int, accepted: list[int]) -> None:
        """A verify step accepted `accepted` (the kept draft tokens and one more) after the first
        `base` tokens: keep their KV, drop the rejected draft's, register the full blocks."""
        seq.spec_tokens, seq.spec_probs, seq.spec_jump = [], None, False
        seq.num_computed_tokens = base + len(accepted) - 1
        seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
        seq.token_ids.extend(accepted)
        if seq.grammar is not None:
            seq.grammar.accept(accepted)
        self.bm.truncate(seq, len(seq))
        self.bm.register_computed(seq)

    def drop_tokens(self, seq: Sequence, count: int) -> None:
        """Forget the last `count` tokens (accepted draft tokens past a stop)."""
        if count:
            del seq.token_ids[-count:]
            if seq.grammar is not None:
                seq.grammar.rollback(count)

    def record_step(
        self,
        sched: SchedulerOutput,
        start: float,
        end: float,
        output_tokens: int,
        expert_counts: list[list[int]] | None = None,
        parts: dict[str, float] | None = None,
    ) -> None:
        """The step's event on the timeline (the engine's and the simulator's steps alike);
        `expert_counts`: tokens per expert of each MoE layer (counts, not tensors); `parts`: where
        its time went (`timeline.STEP_PARTS`)."""
        batch = [BatchEntry(s.seq.request_id, s.num_tokens, s.kind) for s in sched.scheduled]
        prefill = sum(s.num_tokens for s in sched.scheduled if s.kind == "prefill")
        bound = {}
        if sched.time_capped:  # the prediction the cut was made on (the rate it was scheduled at)
            bound = {"target_ms": sched.time_target_ms, "predicted_ms": round(self.ms_per_unit * sched.time_units, 1)}
        if prefill >= MIN_CAPPED_BUDGET and end > start:  # compute-bound: learn the time a unit takes
            rate, old = (end - start) * 1e3 / sched.time_units, self.ms_per_unit
            # a rate off by 2x is a new regime (the first steps' warm-up, a re-layout, another host
            # load): taken at once, not averaged in over the next several steps
            self.ms_per_unit = rate if old is None or not 0.5 < rate / old < 2 else 0.7 * old + 0.3 * rate
        used, total = self.kv_blocks
        self.timeline.add_step(
            start=start,
            end=end,
            phase=sched.phase,
            num_prefill_tokens=prefill,
            num_decode_tokens=sched.num_tokens - prefill,
            batch=batch,
            kv_blocks_used=used,
            kv_blocks_total=total,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            spec_proposed=sched.spec_proposed,
            spec_accepted=sched.spec_accepted,
            jump_forward_tokens=sched.jump_forward_tokens,
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            output_tokens=output_tokens,
            expert_counts=expert_counts or [],
            parts=parts or {},
            **bound,
        )

    # -- cache-wide -------------------------------------------------------------------------------
    def set_prefix_caching(self, enabled: bool, reset: bool) -> None:
        if reset or not enabled:
            self.bm.reset_prefix_cache()
        self.bm.prefix_caching = enabled

    def reset_prefix_cache(self) -> int:
        return self.bm.reset_prefix_cache()

    def set_kv_salt(self, salt: int) -> None:
        """Key cached blocks by the settings that shaped their values (`settings.kv_salt`)."""
        self.bm.set_salt(salt)

    @property
    def kv_blocks(self) -> tuple[int, int]:
        """(used, total) KV blocks."""
        return self.bm.num_used_blocks, self.bm.num_blocks
