"""The engine core's end of a step, per request: the stops that free KV (EOS, a stop token,
max_tokens, the context), token timing, and the finish that frees the sequence with its KV
(`Scheduler.finish`), so an output and its KV go together. What it hands back is a `CoreOutput`:
new token ids, never text. Text, stop strings and `RequestOutput`s are the output processor's
(`workbench.processing.output`), on the side of whoever consumes the output.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from ..outputs import CoreFinal, CoreOutput, RequestMetrics, TokenLogprobs
from ..timeline import TimelineRecorder
from .scheduler import Scheduler
from .sequence import Sequence


class RequestState:
    """The core's state of one running request besides its sequence: what a finish reports."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.prompt_logprobs = [None] if seq.params.prompt_logprobs is not None else None
        # the whole answer's logprobs, kept only for the response cache (it replays them)
        self.logprobs: list[TokenLogprobs] | None = None


class Emitter:
    def __init__(
        self,
        eos_token_ids,
        max_model_len: int,
        scheduler: Scheduler,
        timeline: TimelineRecorder,
        totals: dict[str, Any],
    ):
        self.eos_ids = tuple(eos_token_ids or ())
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.timeline = timeline
        self.totals = totals  # the engine's running counters (output_tokens, finished, preemptions)
        self.requests: dict[str, RequestState] = {}
        self.recent: deque[RequestMetrics] = deque(maxlen=1000)  # finished requests', for latency metrics

    def add(self, seq: Sequence, keep_logprobs: bool = False) -> RequestState:
        req = self.requests[seq.request_id] = RequestState(seq)
        if keep_logprobs and seq.params.logprobs is not None:
            req.logprobs = []
        return req

    def add_prompt_logprobs(self, req: RequestState, first: int, lps: list) -> None:
        """Log-probabilities of prompt tokens first+1, first+2, ... (from a prefill chunk's positions
        first, first+1, ...); a chunk computed again after a preemption adds nothing twice."""
        have = req.prompt_logprobs
        if have is not None and first + 1 == len(have):
            have.extend(lps)

    def emit(self, req: RequestState, new_tokens: list[int], lps, now: float) -> CoreOutput:
        seq, params = req.seq, req.seq.params
        m = seq.metrics
        reason = None
        emitted = new_tokens
        for k, tok in enumerate(new_tokens):
            if (not params.ignore_eos and tok in self.eos_ids) or tok in (params.stop_token_ids or ()):
                reason = "stop"
            elif (
                seq.num_output_tokens - (len(new_tokens) - 1 - k) >= params.max_tokens
                or len(seq) - seq.pending - (len(new_tokens) - 1 - k) >= self.max_model_len
            ):
                reason = "length"
            if reason:
                emitted = new_tokens[: k + 1]
                # accepted draft tokens past the stop are not output
                self.scheduler.drop_tokens(seq, len(new_tokens) - k - 1)
                break
        lps = [x for x in (lps or [])[: len(emitted)] if x is not None] or None
        if m.first_token is None:
            m.first_token = now
            self.timeline.add_request(now, seq.request_id, "first_token")
        m.token_times.extend([now] * len(emitted))
        self.totals["output_tokens"] += len(emitted)
        if req.logprobs is not None and lps:
            req.logprobs.extend(lps)
        if reason:
            return self.finish(req, reason, emitted, lps)
        return CoreOutput(seq.request_id, list(emitted), logprobs=lps)

    def finish(
        self,
        req: RequestState,
        reason: str,
        last_tokens: list[int] | None = None,
        last_logprobs=None,
        keep: int | None = None,
    ) -> CoreOutput:
        """End a request and free its KV. `keep`: the output tokens a stop string left (the output
        processor found it; what the core ran past it, at most one step, is dropped)."""
        seq = req.seq
        now = time.monotonic()
        self.scheduler.drop_pending(seq)  # a launched step's token for it (async scheduling) is not output
        if keep is not None and keep < seq.num_output_tokens:
            self.totals["output_tokens"] -= seq.num_output_tokens - keep
            self.scheduler.drop_tokens(seq, seq.num_output_tokens - keep)
            del seq.metrics.token_times[keep:]
            if req.logprobs is not None:
                del req.logprobs[keep:]
        was_running = self.scheduler.finish(seq, reason, now)
        del self.requests[seq.request_id]
        complete = None if seq.grammar is None else seq.grammar.complete
        self.totals["finished"] += 1
        self.totals["preemptions"] += seq.metrics.num_preemptions
        self.recent.append(seq.metrics)
        detail = reason if was_running or reason != "abort" else "abort (queued)"
        if complete is False:
            detail += " (before its grammar was complete: the output does not match it)"
        self.timeline.add_request(now, seq.request_id, "finished", detail)
        final = CoreFinal(
            metrics=seq.metrics,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            prompt_logprobs=req.prompt_logprobs,
            structured_complete=complete,
        )
        return CoreOutput(seq.request_id, list(last_tokens or []), reason, last_logprobs, final)
