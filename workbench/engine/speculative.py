"""Speculative decoding: proposers guess the next k tokens; one target pass verifies them all.

- `NgramProposer` (prompt lookup): find the latest earlier occurrence of the sequence's last n
  tokens and propose what followed it. No model; shines when the output copies the input.
- Jump-forward (`jump_forward`): where a structured request's grammar forces the next text, its
  tokens are proposed; the step verifies them under the grammar's masks like any draft, so the
  output is exactly what decoding token by token gives, in fewer steps (SGLang appends them
  unverified, in the grammar's tokenization; verifying keeps the model's own).
- `DraftProposer`: a smaller model with the target's tokenizer (by default the target's own
  int4 copy) runs k cheap decode steps. Its KV cache shares the target's block tables, so a
  sequence's draft context lives at the same slots.
`SpeculativeDecoder` is the one object the engine talks to: `propose` before a step attaches
draft tokens to the running sequences that can take them; `verify` after it settles one verify
row (accept, count, and let the scheduler keep the accepted tokens' KV).
`accept` keeps the target's distribution exact: greedy requests accept while the draft equals
the argmax; sampled requests accept token d with probability min(1, p(d)/q(d)) and otherwise
draw from normalise(max(p - q, 0)).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..sampling_params import SamplingParams
from . import sampler
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .sequence import Sequence
from .structured import JUMP_MAX_TOKENS


class NgramProposer:
    def __init__(self, n: int):
        self.n = n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.token_ids
        for n in range(min(self.n, len(tokens) - 1), 0, -1):
            tail = tokens[-n:]
            # Latest earlier match first: recent context predicts best.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return follow
        return []


class _DraftView:
    """What the model runner reads of a sequence, with the draft's own progress."""

    params = SamplingParams(max_tokens=1)  # a draft forward scores no prompt (prompt_logprobs unset)

    def __init__(self, seq: Sequence, token_ids: list[int], computed: int):
        self.token_ids = token_ids
        self.num_computed_tokens = computed
        self.block_table = seq.block_table
        self.spec_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)


class DraftProposer:
    def __init__(self, runner, source: str):
        self.runner = runner  # a ModelRunner over the draft model, same block layout as the target
        self.source = source  # "self-int4" or the draft model's path, for status/events

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], k: int, scheduler: Scheduler
    ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Draft tokens per request, with the draft's distribution at each (None for greedy); the
        draft cache's progress is the scheduler's to record."""
        drafts: dict[str, list[int]] = {s.request_id: [] for s in seqs}
        probs: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in seqs}
        for j in range(k):
            views, scheduled = [], []
            for s in seqs:
                tokens = s.token_ids + drafts[s.request_id]
                view = _DraftView(s, tokens, s.draft_computed if j == 0 else len(tokens) - 1)
                n = len(tokens) - view.num_computed_tokens
                views.append(view)
                scheduled.append(ScheduledSeq(view, n, "prefill" if n > 1 else "decode"))
            result = self.runner.forward(scheduled)
            rows = [result.rows[i][0] for i in range(len(seqs))]
            logits = result.logits[rows]
            greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
            sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
            if greedy:
                for i, tok in zip(greedy, logits[greedy].argmax(-1).tolist()):
                    drafts[seqs[i].request_id].append(tok)
            if sampled:
                p = sampler.probabilities(logits[sampled], [seqs[i] for i in sampled])
                # one batched draw (draw_rows sums its input in place: p is kept for the verify)
                tokens = sampler.draw_rows(p.clone(), [seqs[i].generator for i in sampled])
                for row, (i, tok) in enumerate(zip(sampled, tokens)):
                    drafts[seqs[i].request_id].append(tok)
                    probs[seqs[i].request_id].append(p[row])
            for s, view in zip(seqs, views):
                scheduler.draft_computed(s, len(view.token_ids) if j == 0 else s.draft_computed + 1)
        return {rid: (toks, torch.stack(probs[rid]) if probs[rid] else None) for rid, toks in drafts.items()}


def accept(seq: Sequence, logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None) -> list[int]:
    """Tokens to append after verifying `draft` against the target's logits [k+1, V]:
    the accepted prefix plus one token from the target (a correction or a bonus)."""
    if seq.params.greedy:
        target = logits.max(-1).indices.tolist()  # argmax's first maximum, faster (sampler.py)
        out = []
        for i, d in enumerate(draft):
            if d != target[i]:
                return out + [target[i]]
            out.append(d)
        return out + [target[len(draft)]]
    p = sampler.probabilities(logits, [seq] * logits.shape[0])
    out = []
    for i, d in enumerate(draft):
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        p_d = float(p[i, d])
        u = float(torch.rand((), generator=seq.generator))
        if u * q_d <= p_d:
            out.append(d)
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - draft_probs[i]).clamp(min=0.0)
        total = float(residual.sum())
        residual = p[i] if total <= 0 else residual / total
        return out + [sampler.draw(residual, seq.generator)]
    return out + [sampler.draw(p[len(draft)], seq.generator)]


def check_same_vocabulary(target_config, target_tok, draft_config, draft_tok, name) -> None:
    """A draft must speak the target's tokens, id for id."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"draft_model {name!r} has a vocabulary of {draft_config.vocab_size} tokens; the target's has "
            f"{target_config.vocab_size}: a draft must use the target's tokenizer"
        )
    if target_tok is not None and draft_tok is not None:
        a, b = target_tok.backend.get_vocab(), draft_tok.backend.get_vocab()
        if a != b:
            differ = sorted(set(a.items()) ^ set(b.items()))[:3]
            raise ValueError(f"draft_model {name!r} uses a different tokenizer from the target (e.g. {differ})")


def ready_for_drafts(scheduler: Scheduler, k: int, max_model_len: int) -> list[tuple[Sequence, int]]:
    """The running sequences that can take draft tokens this step, each with how many (at most k,
    within its output length and the context), KV blocks reserved for them. The engine's proposer
    and the simulator both attach drafts to exactly these."""
    ready = []
    for seq in scheduler.running:
        room = draft_room(seq, k, max_model_len)
        if room >= 1 and scheduler.reserve(seq, len(seq) + room):
            ready.append((seq, room))
    return ready


def draft_room(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many draft tokens `seq` can take this step (0: none)."""
    remaining = seq.params.max_tokens - seq.num_output_tokens
    room = min(k, remaining - 1, max_model_len - len(seq) - 1)
    # Penalties (and min_tokens) depend on every earlier token, which verification would change mid-window.
    if seq.spec_tokens or room < 1 or seq.num_computed_tokens != len(seq) - 1 or seq.params.processes_logits:
        return 0
    return room


class SpeculativeDecoder:
    """Draft tokens in (`propose`), verified tokens out (`verify`), for the engine's settings."""

    def __init__(
        self,
        settings,
        scheduler: Scheduler,
        max_model_len: int,
        load_draft: Callable[[str | None], DraftProposer],
        totals: dict[str, Any],
    ):
        self.settings = settings
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.load_draft = load_draft  # builds the draft model's runner (the engine knows the weights)
        self.totals = totals
        self.draft: DraftProposer | None = None  # loaded on first use, or by a draft_model change
        self.mask_ms = 0.0  # time verify rows spent on grammar masks since the engine last took it

    def propose(self) -> int:
        """Attach draft tokens to running sequences that are decoding: first the continuations
        grammars force (jump-forward), then the proposer's. Returns the proposer's tokens."""
        s = self.settings
        if s.jump_forward:
            self.jump_forward()
        if s.speculative == "off":
            return 0
        ready = ready_for_drafts(self.scheduler, s.num_speculative_tokens, self.max_model_len)
        if not ready:
            return 0
        if s.speculative == "ngram":
            proposer = NgramProposer(s.ngram_size)
            for seq, room in ready:
                self.scheduler.attach_drafts(seq, proposer.propose(seq, room))
        else:
            if self.draft is None:
                self.draft = self.load_draft(s.draft_model)
            by_id = {seq.request_id: seq for seq, _ in ready}
            # One batched draft pass per window length.
            for room in sorted({r for _, r in ready}):
                group = [seq for seq, r in ready if r == room]
                for rid, (drafted, probs) in self.draft.propose(group, room, self.scheduler).items():
                    self.scheduler.attach_drafts(by_id[rid], drafted, probs)
        return sum(len(seq.spec_tokens) for seq, _ in ready)

    def jump_forward(self) -> int:
        """Propose what each structured request's grammar forces next. Returns tokens proposed."""
        proposed = 0
        for seq in self.scheduler.running:
            if seq.grammar is None:
                continue
            room = draft_room(seq, JUMP_MAX_TOKENS, self.max_model_len)
            tokens = seq.grammar.forced_tokens(room) if room else []
            if tokens and self.scheduler.reserve(seq, len(seq) + len(tokens)):
                self.scheduler.attach_drafts(seq, tokens, jump=True)
                proposed += len(tokens)
        self.totals["jump_forward_proposed"] += proposed
        return proposed

    def verify(self, seq: Sequence, logits: torch.Tensor, sched: SchedulerOutput) -> list[int]:
        """The tokens a verify row yields (the accepted draft and one more), counted; a structured
        request's drafts are judged under its grammar's masks."""
        draft = seq.spec_tokens
        base = len(seq)
        tokens = None
        if seq.grammar is not None:
            start = time.monotonic()
            if seq.params.greedy:
                tokens = seq.grammar.greedy_accept(logits, draft)
            else:
                logits = seq.grammar.mask_window(logits, draft)
            self.mask_ms += (time.monotonic() - start) * 1e3
        if tokens is None:
            tokens = accept(seq, logits, draft, seq.spec_probs)
        accepted = len(tokens) - 1
        if seq.spec_jump:
            sched.jump_forward_tokens += accepted
            self.totals["jump_forward_tokens"] += accepted
        else:
            seq.metrics.spec_proposed += len(draft)
            seq.metrics.spec_accepted += accepted
            sched.spec_accepted += accepted
            self.totals["spec_proposed"] += len(draft)
            self.totals["spec_accepted"] += accepted
            self.totals["spec_verifies"] += 1
        self.scheduler.update_after_verify(seq, base, tokens)
        return tokens
