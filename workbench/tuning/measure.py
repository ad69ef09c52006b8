"""One measured run at the engine's current settings: the sweep's hold on the engine, the run
through the workload driver, and what is read around it (timeline, counters, costs, perplexity)."""

import contextlib
import math
import statistics
import threading
import time
import warnings
from typing import Any

from ..bench.driver import run_workload
from ..bench.stats import RequestRecord, summarize
from ..bench.workload import BenchRequest, Workload
from ..interface import Engine
from .costs import phase_split, run_costs
from .grid import QUANT_DEFAULTS, SPREAD_KEYS
from .pareto import spread


# ----------------------------------------------------------------------------- engine access
class SweepTarget:
    """The sweep's hold on an `Engine`: cancellation, and the requests it has in flight."""

    def __init__(self, engine: Engine, cancel: threading.Event | None = None):
        if not isinstance(engine, Engine):
            raise TypeError(
                f"sweep needs a workbench Engine (an LLM, an EngineClient from start_engine/connect, or "
                f"a RemoteEngineClient); got {type(engine).__name__}"
            )
        self.obj = engine
        self.cancel = cancel
        # Ids of requests sent and not yet known to be done; filled before anything is sent, so an
        # interrupt at any point leaves nothing unaccounted for.
        self.in_flight: list[str] = []

    def abort_in_flight(self) -> None:
        """Abort whatever a run left behind (an interrupt can skip a run's own clean-up)."""
        if self.in_flight:
            left, self.in_flight = self.in_flight, []
            self.obj.release(left, set())

    def check(self) -> None:
        """Raise KeyboardInterrupt when `asweep`'s task was cancelled (the sweep runs on a worker
        thread there, which a kernel interrupt does not reach)."""
        if self.cancel is not None and self.cancel.is_set():
            raise KeyboardInterrupt("sweep cancelled")

    def configure(self, **changes) -> dict:
        return self.obj.configure(**changes)

    def settings(self) -> dict:
        return dict(self.obj.settings())

    def status(self) -> dict:
        return dict(self.obj.status())

    def metrics(self) -> dict:
        return dict(self.obj.metrics())

    def reset_prefix_cache(self) -> None:
        from ..remote import RemoteSettingsError

        with contextlib.suppress(RemoteSettingsError):  # a remote server's cache is its own
            self.obj.reset_prefix_cache()

    def score(self, ids: list[int]) -> list[float] | None:
        try:
            return self.obj.score(ids)
        except NotImplementedError:  # a remote server scores nothing
            return None

    def timeline_cursor(self) -> int:
        return self.obj.timeline(since=1 << 62).cursor

    def steps_since(self, cursor: int) -> list:
        return list(self.obj.timeline(since=cursor).steps)

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Let other clients' requests drain so they do not share the measured run."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if not (m.get("num_running") or m.get("num_waiting")):
                return
            if time.monotonic() > deadline:
                warnings.warn(
                    "the engine is still busy with other requests; measuring anyway", RuntimeWarning, stacklevel=3
                )
                return
            time.sleep(0.05)

    def run(self, requests: list[BenchRequest], progress=None) -> tuple[list[RequestRecord], float]:
        """Serve the requests through the workload driver; returns (records in request order, start)."""
        self.check()
        return run_workload(self.obj, list(requests), progress=progress, check=self.check, in_flight=self.in_flight)


# ----------------------------------------------------------------------------- measuring
def measure_run(
    eng: SweepTarget,
    workload: Workload,
    *,
    price_per_hour: float,
    watts: float,
    progress=None,
    reset_prefix_cache: bool = True,
) -> dict[str, Any]:
    """One measured run of the workload at the engine's current settings."""
    if reset_prefix_cache:
        eng.reset_prefix_cache()
    eng.wait_idle()
    m0 = eng.metrics()
    cursor = eng.timeline_cursor()
    records, start = eng.run(workload.requests, progress)
    finished = time.monotonic()
    m1 = eng.metrics()
    steps = eng.steps_since(cursor)
    out = summarize(records, start)

    def delta(k: str) -> float:
        return (m1.get(f"total_{k}") or 0) - (m0.get(f"total_{k}") or 0)

    prompt = delta("prompt_tokens")
    out["prefix_hit_rate"] = delta("prefix_hit_tokens") / prompt if prompt > 0 else 0.0
    proposed = delta("spec_proposed")
    out["spec_acceptance_rate"] = delta("spec_accepted") / proposed if proposed > 0 else None
    out["spec_mean_accepted"] = delta("spec_accepted") / delta("spec_verifies") if delta("spec_verifies") > 0 else None
    out["preemptions"] = delta("preemptions")
    usage = [
        (s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0, max(s.end - s.start, 0.0)) for s in steps
    ]
    busy = sum(d for _, d in usage)
    out["kv_usage_peak"] = max((u for u, _ in usage), default=None)
    out["kv_usage_mean"] = sum(u * d for u, d in usage) / busy if busy > 0 else None
    out["engine_steps"] = len(steps)
    out["started_at"], out["finished_at"] = start, finished  # this process's monotonic clock (parallel points overlap)
    out["busy_s"] = busy
    split = phase_split(steps) if steps else None
    if split is not None:
        out.update(split)
    out.update(run_costs(out["output_tok_s"], price_per_hour, watts, split))
    out.pop("price_per_hour")
    out.pop("watts")
    return out


def perplexity(eng: SweepTarget, ids: list[int]) -> float | None:
    if len(ids) < 2:
        return None
    lps = eng.score(ids)
    if not lps:
        return None
    return math.exp(-sum(lps) / len(lps))


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeated runs, plus min/max/std of the headline metrics."""
    out: dict[str, Any] = {}
    keys = [
        k for k in runs[0] if all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for r in runs)
    ]
    for k in keys:
        out[k] = statistics.median(r[k] for r in runs)
    for k in runs[0]:
        if k not in out:
            vals = [r.get(k) for r in runs if r.get(k) is not None]
            out[k] = statistics.median(vals) if vals and all(isinstance(v, (int, float)) for v in vals) else None
    for k in SPREAD_KEYS:
        s = spread([r.get(k) for r in runs if r.get(k) is not None])
        out[f"{k}_min"], out[f"{k}_max"], out[f"{k}_std"] = s["min"], s["max"], s["std"]
    return out


def is_quantised(settings: dict) -> bool:
    return any(settings.get(k, v) != v for k, v in QUANT_DEFAULTS.items())
