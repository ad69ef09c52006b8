"""Async scheduling (the `async_scheduling` setting): the next step is scheduled, prepared and
launched before the host has read the last one's tokens.

    step N+1:  schedule -> forward (N's tokens read on the device) -> sample on the device
               -> land step N (wait for its tokens, emit them) -> return N's outputs

On a GPU the host then does step N's output work and step N+1's preparation while the GPU runs
step N+1, and the GPU no longer idles between steps (SGLang's overlap scheduler, vLLM v1's async
scheduling do the same). A launched step's sampled tokens are placeholders in their sequences
(`Sequence.pending`) until they land: they count for scheduling and KV, and the next step's
model reads their values from the device tensor (`InFlight.fills`). The price is at most one
wasted row per finishing request: a request that stopped at its step N token (EOS, a stop
token) was scheduled in step N+1 before anyone knew, and that row is dropped when it lands.
(max_tokens is known ahead: such a request is not scheduled again.)

A step overlaps only when everything it samples is chosen from the logits alone: a request with
penalties, biases or min_tokens (they read its earlier tokens), a grammar, log-probabilities,
prompt log-probabilities or draft tokens makes its step synchronous, after the step in flight has
landed. So does speculative decoding or a KV-less engine, for every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..settings import EngineSettings
from . import sampler
from .device import Landing, Marks, to_device
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence


def allowed(settings: EngineSettings) -> bool:
    """Whether the settings let steps overlap at all."""
    return settings.async_scheduling and settings.speculative == "off" and settings.kv_cache


def overlappable(sched: SchedulerOutput) -> bool:
    """Whether this step's choices need nothing from the host: see the module's doc."""
    for s in sched.scheduled:
        p = s.seq.params
        if s.kind == "verify" or (s.kind == "prefill" and p.prompt_logprobs is not None):
            return False
        if s.samples and (p.processes_logits or p.logprobs is not None or s.seq.grammar is not None):
            return False
    return True


@dataclass
class InFlight:
    """A launched step whose tokens are on their way to the host."""

    sched: SchedulerOutput
    tokens: torch.Tensor  # one per sampling sequence, int64, on the device
    landing: Landing
    holes: dict[Sequence, tuple[int, int]]  # each sampling sequence's placeholder: (position, row of `tokens`)
    marks: Marks
    start: float  # when the step began (host clock)
    experts: list[list[int]]  # a MoE model's expert counts of this step, per layer ([]: dense)

    def fills(self, seq: Sequence, start: int, n: int) -> tuple[int, int] | None:
        """Where a forward reading positions [start, start + n) of `seq` reads this step's token
        for it: (offset from start, row of `tokens`); None: it reads none of its placeholders."""
        hole = self.holes.get(seq)
        if hole is None or not start <= hole[0] < start + n or seq.token_ids[hole[0]] >= 0:
            return None
        return hole[0] - start, hole[1]


def fill_inputs(input_ids: torch.Tensor, fills: list[tuple[int, int]], source: torch.Tensor) -> None:
    """Put the device's tokens at the placeholders of a step's input ids: (flat index, row of
    `source`) each; on the device, without the host reading them."""
    if fills:
        at, rows = zip(*fills)
        dev = input_ids.device
        input_ids[to_device(list(at), torch.int64, dev)] = source[to_device(list(rows), torch.int64, dev)]


def launch(sched: SchedulerOutput, result, marks: Marks, start: float, scheduler: Scheduler, experts) -> InFlight:
    """Sample a forward's logits on the device, start the tokens' copy to the host, and advance
    the sequences with placeholders for them."""
    sampled = [i for i in range(len(sched.scheduled)) if i in result.rows]
    order = [result.rows[i][0] for i in sampled]
    logits = result.logits
    if order != list(range(logits.shape[0])):
        logits = logits[to_device(order, torch.int64, logits.device)]
    seqs = [sched.scheduled[i].seq for i in sampled]
    tokens = sampler.next_tokens(logits, seqs) if seqs else torch.empty(0, dtype=torch.int64, device=logits.device)
    landing = Landing(tokens)
    marks.device("sample")
    positions = scheduler.advance(sched, sampled)
    holes = {seq: (pos, row) for row, (seq, pos) in enumerate(zip(seqs, positions))}
    return InFlight(sched, tokens, landing, holes, marks, start, experts)
