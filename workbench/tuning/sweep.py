"""Sweeps: one fixed, seeded workload measured at every point of a settings grid.

    eng = workbench.start_engine()                       # or workbench.LLM()
    res = workbench.sweep(eng, grid={"batching": ["continuous", "static"], "max_num_seqs": [4, 16]},
                          workload={"num_requests": 16}, repeats=3)
    res.table()          # a DataFrame when pandas is installed, else row dicts
    res.show()           # Bokeh: throughput vs p99 TTFT / p99 ITL, Pareto front, hover, "apply" button
    res.apply(2)         # configure the engine with point 2 (index, label or record)

`engine` is anything with `configure`, `settings`, `generate`, `metrics` and `status`: an
`EngineClient` (the engine process), an in-process `LLM`, or a look-alike. For each grid point
(re-layout settings vary slowest, so an expensive re-layout happens once per value):

1. `configure(**point)` — it returns once the change (a re-layout included) is in place;
2. warm-up: `warmup` short requests from the workload, then the prefix cache is emptied;
3. `repeats` measured runs of the whole workload (greedy, `ignore_eos`, prefix cache emptied before
   each), per run: output tok/s, TTFT/ITL percentiles (`workbench.bench.stats.summarize`), peak
   and mean KV use and prefill/decode time (from the engine timeline), prefix hit rate and
   speculative acceptance (from the engine's counters), cost and energy (`workbench.tuning.costs`);
4. where the point is quantised (weights or KV cache): perplexity on the workload's text and its
   difference from the unquantised model (`delta_ppl`).

A record per point holds the medians over repeats, the spread (`<metric>_min/_max/_std`) and the
per-run numbers; `pareto`/`pareto_ttft_p99`/`pareto_itl_p99` mark the fronts, and `overlaps` /
`noisy` name the points whose throughput spread overlaps this one (so a "winner" inside the noise
is visible as such).

Interrupting (Ctrl-C, the notebook's stop button) aborts the in-flight requests, puts the engine
back on the settings it had before the sweep and marks the sweep `interrupted` in the run log.
Running the same sweep again resumes: points already measured (same model weights, workload,
grid, repeats, base settings) are taken from the run log, not rerun; `resume=False` measures
everything again.
"""

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..runs import RunLog
from .grid import DEFAULT_MAX_TOKENS
from .result import SweepResult
from .sweep_run import LAST, SweepRun


def sweep(
    engine,
    grid: dict[str, Sequence[Any]],
    workload=None,
    *,
    repeats: int = 1,
    warmup: int = 2,
    resume: bool | Sequence[dict] = True,
    price_per_hour: float | None = None,
    watts: float | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    ppl_tokens: int = 256,
    reset_prefix_cache: bool = True,
    progress=True,
    record: bool = True,
    run_log: str | RunLog | None = None,
    on_point: Callable[[dict], Any] | None = None,
    cancel: threading.Event | None = None,
    simulate_first: bool | Any = False,
) -> SweepResult:
    """Measure `workload` at every point of `grid` on the running `engine`; one record per point.

    repeats: measured runs per point (spread and noise flags need >= 2). warmup: short warm-up
    requests after each configure (0: none). resume: True reuses the points of the same sweep
    already in the run log; a previous result (list of records) reuses its points; False measures
    all. price_per_hour / watts: the machine's (defaults in `workbench.tuning.costs`). max_tokens: output
    length of prompt-list workloads. ppl_tokens: tokens of workload text scored for perplexity at
    quantised points (0: skip). progress: True (tqdm), False, or a factory `(desc, total) -> bar`.
    record: write the run log (`run_log`: a path or RunLog; default `workbench.runs.default_path()`).
    on_point: called with each finished record. cancel: a threading.Event that stops the sweep like
    Ctrl-C when set (what `asweep` uses). simulate_first: True (or a `workbench.Simulator`)
    predicts every point with the simulator (calibrated on this engine) and measures only the
    points on the predicted Pareto front, and those whose settings it cannot simulate; the others
    keep their prediction (`source` "simulated"; every record has `predicted`).
    See the module doc for what is measured and how interrupts and resume behave.
    """
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    run = SweepRun(
        engine,
        grid,
        workload,
        repeats=repeats,
        warmup=warmup,
        resume=resume,
        price_per_hour=price_per_hour,
        watts=watts,
        max_tokens=max_tokens,
        ppl_tokens=ppl_tokens,
        reset_prefix_cache=reset_prefix_cache,
        record=record,
        run_log=run_log,
        cancel=cancel,
        simulate_first=simulate_first,
    )
    return run.run(progress, on_point)


async def asweep(engine, grid: dict[str, Sequence[Any]], workload=None, **kwargs) -> SweepResult:
    """`sweep` on a worker thread, awaited: the event loop keeps running meanwhile, so a notebook's
    dashboard and widgets stay live (`res = await workbench.sweep.asweep(eng, grid=...)`).
    Cancelling the task or interrupting the kernel stops the sweep as Ctrl-C does (in-flight
    requests aborted, the engine back on its previous settings) and raises KeyboardInterrupt."""
    import asyncio
    import concurrent.futures

    cancel = threading.Event()
    done: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        try:
            done.set_result(sweep(engine, grid, workload, cancel=cancel, **kwargs))
        except BaseException as e:  # handed to the awaiting task
            done.set_exception(e)

    threading.Thread(target=work, name="workbench-sweep", daemon=True).start()
    try:
        return await asyncio.shield(asyncio.wrap_future(done))
    except BaseException as e:
        if done.done() and not done.cancelled() and done.exception() is e:
            raise  # the sweep's own error
        cancel.set()  # cancelled from outside: stop the worker and let it restore the engine
        with contextlib.suppress(BaseException):
            done.result(timeout=300)
        raise KeyboardInterrupt("sweep interrupted; the engine is back on the settings it had before") from None


def last() -> SweepResult | None:
    """The most recent sweep's records in this process (partial when it was interrupted)."""
    return LAST[0]


# `workbench.sweep` is the function; its async twin and the last result hang off it.
sweep.asweep = asweep  # type: ignore[attr-defined]
sweep.last = last  # type: ignore[attr-defined]
