"""From sampled tokens to what a caller sees, per request: detokenized text with stop strings
held back from the stream, logprobs, the finish reason (EOS, a stop token or string, max_tokens,
the context), token timing, and the `RequestOutput` at the end.

The engine hands it each step's new tokens (`emit`); when a request finishes it tells the
scheduler to free the sequence (`Scheduler.remove`), so an output and its KV go together.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from ..outputs import RequestOutput, StreamChunk
from ..timeline import TimelineRecorder
from ..tokenizer import IncrementalDetokenizer
from .scheduler import Scheduler
from .sequence import Sequence


class RequestState:
    """Output-side state of one request: detokenizer, emitted text, logprobs."""

    def __init__(self, seq: Sequence, prompt: str | None, detok: IncrementalDetokenizer | None):
        self.seq = seq
        self.prompt = prompt
        self.detok = detok
        self.text = ""
        self.sent = 0  # characters of text already streamed
        self.logprobs = [] if seq.params.logprobs is not None else None
        self.prompt_logprobs = [None] if seq.params.prompt_logprobs is not None else None


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        eos_token_ids,
        max_model_len: int,
        scheduler: Scheduler,
        timeline: TimelineRecorder,
        totals: dict[str, Any],
    ):
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_token_ids or ())
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.timeline = timeline
        self.totals = totals  # the engine's running counters (output_tokens, finished, preemptions)
        self.requests: dict[str, RequestState] = {}
        self.recent: deque[RequestOutput] = deque(maxlen=1000)  # finished outputs, for latency metrics

    def add(self, seq: Sequence, prompt: str | None) -> None:
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.requests[seq.request_id] = RequestState(seq, prompt, detok)

    def add_prompt_logprobs(self, req: RequestState, first: int, lps: list) -> None:
        """Log-probabilities of prompt tokens first+1, first+2, ... (from a prefill chunk's positions
        first, first+1, ...); a chunk computed again after a preemption adds nothing twice."""
        have = req.prompt_logprobs
        if have is not None and first + 1 == len(have):
            have.extend(lps)

    def emit(self, req: RequestState, new_tokens: list[int], lps, now: float) -> StreamChunk | None:
        seq, params = req.seq, req.seq.params
        m = seq.metrics
        reason = None
        emitted = new_tokens
        for k, tok in enumerate(new_tokens):
            if (not params.ignore_eos and tok in self.eos_ids) or tok in (params.stop_token_ids or ()):
                reason = "stop"
            elif (
                seq.num_output_tokens - (len(new_tokens) - 1 - k) >= params.max_tokens
                or len(seq) - (len(new_tokens) - 1 - k) >= self.max_model_len
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
        if req.detok is not None:
            before = len(req.text)
            req.text += req.detok.add(emitted)
            if params.stop and seq.num_output_tokens >= params.min_tokens:
                hit = _find_stop(req.text, params.stop, before)
                if hit is not None:
                    req.text = req.text[:hit]
                    reason = "stop"
        if reason:
            return self.finish(req, reason, emitted, lps)
        hold = max((len(s) for s in params.stop), default=1) - 1 if params.stop else 0
        upto = max(req.sent, len(req.text) - hold)
        delta, req.sent = req.text[req.sent : upto], upto
        return StreamChunk(seq.request_id, delta, list(emitted), logprobs_delta=lps)

    def finish(
        self, req: RequestState, reason: str, last_tokens: list[int] | None = None, last_logprobs=None
    ) -> StreamChunk:
        seq = req.seq
        now = time.monotonic()
        was_running = self.scheduler.finish(seq, reason, now)
        del self.requests[seq.request_id]
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=req.text,
            finish_reason=reason,
            metrics=seq.metrics,
            prompt=req.prompt,
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            structured_complete=None if seq.grammar is None else seq.grammar.complete,
        )
        self.totals["finished"] += 1
        self.totals["preemptions"] += seq.metrics.num_preemptions
        self.recent.append(out)
        detail = reason if was_running or reason != "abort" else "abort (queued)"
        if out.structured_complete is False:
            detail += " (before its grammar was complete: the output does not match it)"
        self.timeline.add_request(now, seq.request_id, "finished", detail)
        delta = req.text[req.sent :]
        req.sent = len(req.text)
        return StreamChunk(
            seq.request_id, delta, list(last_tokens or []), reason, logprobs_delta=last_logprobs, output=out
        )


def _find_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Earliest stop string that ends in the newly added text; index where it starts."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
