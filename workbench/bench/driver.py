"""The workload driver: one seeded workload served on any `Engine`, each request released at its
arrival time. `workbench bench`, its scenarios, sweeps and the endpoint bench (any OpenAI-compatible
server, through `RemoteEngineClient`) all measure through it.

Requests are greedy with ``ignore_eos`` (fixed output lengths). A record's arrival is the request's
scheduled release time (start + arrival_s), so TTFT includes any wait for a busy engine loop or
client thread, as a user would see it. ``max_concurrency`` caps the requests in flight (a closed
loop, as `vllm bench serve --max-concurrency`); later ones wait for a slot.

Interrupts and errors abort whatever is still running: ids go into ``in_flight`` before anything
is sent (pass a list to keep them visible to a canceller on another thread).
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..interface import Engine
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams, normalize_batch
from .stats import RequestRecord
from .workload import BenchRequest

__all__ = ["Served", "run_workload", "serve_workload"]

_MAX_WAIT_S = 0.1  # longest wait between checks for cancellation


@dataclass
class Served:
    """One request of a served workload: its scheduled release, and its output or its error."""

    request: BenchRequest
    arrival: float
    output: RequestOutput | None = None
    error: BaseException | None = None

    def record(self) -> RequestRecord:
        out = self.output
        if out is None:  # failed: counted, with no tokens
            return RequestRecord(self.request.index, self.arrival, self.request.prompt_len)
        m = out.metrics
        return RequestRecord(
            self.request.index,
            self.arrival,
            len(out.prompt_token_ids) or self.request.prompt_len,
            list(out.token_ids),
            list(m.token_times),
            m.finished,
        )


def run_workload(engine: Engine, requests: list[BenchRequest], **kwargs) -> tuple[list[RequestRecord], float]:
    """`serve_workload` as records (request order) and the start time; a failed request raises."""
    served, start = serve_workload(engine, requests, **kwargs)
    return [s.record() for s in served], start


def serve_workload(
    engine: Engine,
    requests: list[BenchRequest],
    *,
    progress=None,
    check: Callable[[], None] | None = None,
    max_concurrency: int | None = None,
    in_flight: list[str] | None = None,
    ignore_eos: bool = True,
    keep_errors: bool = False,
    structured=None,
) -> tuple[list[Served], float]:
    """Serve `requests`; returns (one `Served` per request, in request order; start time).
    `progress.update(1)` per finished request; `check()` is called while waiting and may raise
    to stop. A request that fails raises, unless `keep_errors` (then it is kept as `error`).
    `structured`: every request's output constraint (`SamplingParams.structured`)."""
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    q: queue.SimpleQueue = queue.SimpleQueue()
    submitted = in_flight if in_flight is not None else []
    served: dict[int, Served] = {}
    done: set[int] = set()
    finished: set[str] = set()
    start = time.monotonic()
    i = 0
    try:
        while i < len(pending) or len(done) < len(served):
            if check is not None:
                check()
            now = time.monotonic()
            running = len(served) - len(done)
            while (
                i < len(pending)
                and start + pending[i].arrival_s <= now
                and (max_concurrency is None or running < max_concurrency)
            ):
                r = pending[i]
                i += 1
                s = served[r.index] = Served(r, start + r.arrival_s)
                try:
                    engine.submit(
                        _batch(r, ignore_eos, structured), functools.partial(_tagged, q, r.index), into=submitted
                    )
                except Exception as e:  # refused at once (too long, engine busy, ...)
                    if not keep_errors:
                        raise
                    s.error = e
                    done.add(r.index)
                    continue
                running += 1
            if i < len(pending) and (max_concurrency is None or running < max_concurrency):
                wait = max(0.0, min(_MAX_WAIT_S, start + pending[i].arrival_s - time.monotonic()))
            else:
                wait = _MAX_WAIT_S
            try:
                index, item = engine.poll(q, wait) if wait > 0 else q.get_nowait()
            except queue.Empty:
                continue
            s = served[index]
            if isinstance(item, BaseException):
                if not keep_errors:
                    raise item
                s.error = item
            elif item.finish_reason is None:
                continue
            else:
                finished.add(item.request_id)
                s.output = item.output
            done.add(index)
            if progress is not None:
                progress.update(1)
    finally:
        engine.release(list(submitted), finished)  # aborts what is still running (interrupt, error)
        submitted.clear()
    return [served[k] for k in sorted(served)], start


def _batch(r: BenchRequest, ignore_eos: bool, structured=None):
    sp = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=ignore_eos, structured=structured)
    if r.prompt is not None:
        return normalize_batch(r.prompt, sp, None)
    return normalize_batch(None, sp, [r.prompt_token_ids])


def _tagged(q: queue.SimpleQueue, index: int, item) -> None:
    q.put((index, item))
