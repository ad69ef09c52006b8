"""From the engine core's new token ids to what a caller sees, per request: detokenized text with
stop strings held back from the stream, logprobs gathered, and the `RequestOutput` at the end.

It runs where the output is consumed: in `LLMEngine.step` for in-process callers, in the engine
client (`workbench.ipc.client`) for an engine process, so detokenizing never runs on the
engine's step loop. A stop string is found here, after the core ran the step that produced it:
`process` returns it as a stop for the core (`(request_id, tokens kept)`), and the request ends
when the core's final output for it comes back. In-process that happens within the same step; over
ZeroMQ the core may have run one more step for the request by then (at most one wasted step), whose
tokens the core drops.
"""

from __future__ import annotations

from ..outputs import CoreOutput, RequestOutput, StreamChunk, TokenLogprobs
from ..sampling_params import SamplingParams
from ..tokenizer import IncrementalDetokenizer, Tokenizer


class _Request:
    __slots__ = ("prompt", "params", "detok", "text", "sent", "num_tokens", "logprobs", "stopped", "hold", "pending")

    def __init__(self, prompt: str | None, params: SamplingParams, detok: IncrementalDetokenizer | None):
        self.prompt = prompt
        self.params = params
        self.detok = detok
        self.text = ""
        self.sent = 0  # characters of text already streamed
        self.num_tokens = 0  # output ids seen
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.stopped = False  # a stop string ended the text: waiting for the core's final output
        self.hold = max((len(s) for s in params.stop), default=1) - 1 if params.stop else 0
        self.pending: tuple[list[int], list | None] = ([], None)  # the stop's ids, sent with the final chunk


Stop = tuple[str, int]  # a request a stop string ended, and the output tokens it keeps


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer  # None: a model without one streams ids, its text stays ""
        self.requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt, params: SamplingParams) -> None:
        """Expect outputs for `request_id` (before its first `CoreOutput` arrives)."""
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.requests[request_id] = _Request(prompt if isinstance(prompt, str) else None, params, detok)

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[StreamChunk], list[Stop]]:
        """Stream chunks for these core outputs, and the requests a stop string ended (to finish
        in the core)."""
        chunks: list[StreamChunk] = []
        stops: list[Stop] = []
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue
            chunk = self._one(out, req, stops)
            if chunk is not None:
                chunks.append(chunk)
        return chunks, stops

    def _one(self, out: CoreOutput, req: _Request, stops: list[Stop]) -> StreamChunk | None:
        params = req.params
        if req.stopped and out.final is None:
            return None  # the step the core ran past a stop string: dropped there too
        new = [] if req.stopped else out.new_token_ids
        if out.final is not None and not req.stopped and req.num_tokens + len(new) < len(out.final.token_ids):
            new = out.final.token_ids[req.num_tokens :]  # only the last output was sent: it carries every id
        lps = None if req.stopped else out.logprobs
        req.num_tokens += len(new)
        if req.logprobs is not None and lps:
            req.logprobs.extend(lps)
        reason = out.finish_reason
        if req.detok is not None and new:
            before = len(req.text)
            req.text += req.detok.add(new)
            if params.stop and req.num_tokens >= params.min_tokens:
                hit = _find_stop(req.text, params.stop, before)
                if hit is not None:
                    req.text = req.text[:hit]
                    req.stopped = True
                    if reason is None:  # the core still runs it: end it there, answer with its final
                        stops.append((out.request_id, req.num_tokens))
                        req.pending = (list(new), lps)
                        return None
        if req.stopped and reason is not None:
            reason = "stop"
            new, lps = req.pending[0] + list(new), (req.pending[1] or []) + (lps or []) or None
        if reason is not None:
            return self._finish(out, req, reason, new, lps)
        upto = max(req.sent, len(req.text) - req.hold)
        delta, req.sent = req.text[req.sent : upto], upto
        return StreamChunk(out.request_id, delta, list(new), logprobs_delta=lps)

    def _finish(self, out: CoreOutput, req: _Request, reason: str, new: list[int], lps) -> StreamChunk:
        del self.requests[out.request_id]
        final = out.final
        assert final is not None, f"the core finished {out.request_id} without its final output"
        result = RequestOutput(
            request_id=out.request_id,
            prompt_token_ids=final.prompt_token_ids,
            token_ids=final.token_ids,
            text=req.text,
            finish_reason=reason,
            metrics=final.metrics,
            prompt=req.prompt,
            logprobs=req.logprobs,
            prompt_logprobs=final.prompt_logprobs,
            structured_complete=final.structured_complete,
            from_cache=final.from_cache,
        )
        delta = req.text[req.sent :]
        req.sent = len(req.text)
        return StreamChunk(out.request_id, delta, list(new), reason, logprobs_delta=lps, output=result)


def _find_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Earliest stop string that ends in the newly added text; index where it starts."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
