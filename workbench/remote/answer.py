"""One streamed completion as it arrives from an OpenAI-compatible server: its server-sent events
folded into text, token ids, their times, logprobs, the usage the server counted and the finish
reason, then the `RequestOutput` (completions and chat dialects alike: `text` or `delta.content`)."""

from __future__ import annotations

import json

from ..outputs import RequestMetrics, RequestOutput, TokenLogprobs
from .wire import RemoteError, error_from_object, parse_logprobs

DONE = object()  # the stream's "[DONE]" line


def sse_object(line: str, base: str) -> dict | object | None:
    """A stream line's JSON object, `DONE` at the end, None for a line that carries no data; a
    server's error object raised as its error."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    try:
        obj = json.loads(data)
    except ValueError:
        raise RemoteError(f"{base} sent a stream line that is not JSON: {data[:200]!r}") from None
    if isinstance(obj.get("error"), (dict, str)):
        raise error_from_object(obj["error"], base)
    return obj


class StreamedAnswer:
    def __init__(self, prompt_ids: list[int], want_logprobs: bool):
        self.prompt_ids = prompt_ids
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.logprobs: list[TokenLogprobs] | None = [] if want_logprobs else None
        self.finish: str | None = None
        self.usage: dict | None = None

    def add(self, obj: dict, now: float) -> list[tuple[str, list[int], list[TokenLogprobs]]]:
        """Fold one event in; returns the pieces of output it carried: (text, ids, logprobs)."""
        if obj.get("usage"):
            self.usage = obj["usage"]
        if obj.get("prompt_token_ids"):
            self.prompt_ids = list(obj["prompt_token_ids"])
        pieces = []
        for choice in obj.get("choices") or []:
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content") or ""
            tids = [int(t) for t in choice.get("token_ids") or []]
            if choice.get("prompt_token_ids"):
                self.prompt_ids = list(choice["prompt_token_ids"])
            new_lps = parse_logprobs(choice.get("logprobs"), tids) if self.logprobs is not None else []
            n = len(tids) or len(new_lps) or (1 if text else 0)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
            if n == 0 and not text:
                continue
            self.token_times.extend([now] * n)
            self.text_parts.append(text)
            self.token_ids.extend(tids)
            if self.logprobs is not None:
                self.logprobs.extend(new_lps)
            pieces.append((text, tids, new_lps))
        return pieces

    def output(
        self, rid: str, prompt, arrival: float, first: float | None, end: float, error: BaseException | None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=rid,
            prompt_token_ids=self.prompt_ids,
            token_ids=self.token_ids,
            text="".join(self.text_parts),
            finish_reason=self.finish if error is None else "abort",
            metrics=RequestMetrics(arrival=arrival, first_token=first, finished=end, token_times=self.token_times),
            prompt=prompt,
            logprobs=self.logprobs,
            error=None if error is None else f"{type(error).__name__}: {error}",
            usage=self.usage,
        )
