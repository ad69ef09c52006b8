"""Per-request timing records and the summary every system is reported with."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..reports import percentile  # defined low: the engine computes its own metrics with it

# The keys every entry of a report's `results` carries (the contract's `workbench bench --json`).
RESULT_KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


@dataclass
class RequestRecord:
    """One finished request, times in `time.monotonic()` seconds."""

    index: int
    arrival: float  # when the request was released (its TTFT clock starts here)
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # when each output token existed
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def summarize(records: list[RequestRecord], start: float) -> dict:
    """Throughput over the whole run (first release to last token) and pooled latency stats.

    TTFT is per request; ITL pools every gap between consecutive tokens of every request.
    """
    out_tokens = sum(len(r.token_ids) for r in records)
    prompt_tokens = sum(r.prompt_tokens for r in records)
    end = max((r.finished or (r.token_times[-1] if r.token_times else start) for r in records), default=start)
    duration = max(end - start, 1e-9)
    ttft = [r.ttft for r in records if r.ttft is not None]
    itl = [x for r in records for x in r.itl]
    return {
        "output_tok_s": out_tokens / duration,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
        "ttft_mean_ms": (sum(ttft) / len(ttft) * 1e3) if ttft else 0.0,
        "itl_mean_ms": (sum(itl) / len(itl) * 1e3) if itl else 0.0,
        "total_tok_s": (prompt_tokens + out_tokens) / duration,
        "duration_s": duration,
        "requests": len(records),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
    }


class NoProgress:
    """A progress bar that shows nothing (the bench and sweeps without tqdm or a terminal)."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
