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
import json
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..bench.stats import NoProgress
from ..bench.workload import BenchRequest
from ..runs import RunLog, recording_enabled, safe_finish, safe_start
from .costs import resolve
from .grid import DEFAULT_MAX_TOKENS, QUANT_DEFAULTS, grid_points, point_label, stable_hash
from .measure import SweepTarget, aggregate, is_quantised, measure_run, perplexity
from .pareto import annotate
from .result import SweepResult, record_from_row
from .workload import make_sweep_workload, workload_definition


# ----------------------------------------------------------------------------- progress
class _TextProgress:
    def __init__(self, desc: str, total: int):
        self.desc, self.total, self.n, self._last = desc, total, 0, 0.0

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last > 1.0 or self.n >= self.total:
            self._last = time.monotonic()
            print(f"\r{self.desc}: {self.n}/{self.total} requests", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr, flush=True)


def _make_progress(progress, total: int):
    if progress is False or progress is None:
        return NoProgress()
    if callable(progress) and progress is not True:
        return progress("sweep", total)
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="sweep", unit="req", leave=True)
    except ImportError:
        return _TextProgress("sweep", total)


# ----------------------------------------------------------------------------- the sweep
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
    eng = SweepTarget(engine, cancel)
    original = eng.settings()
    points = grid_points(grid)
    status = eng.status()
    device = str(status.get("device", "cpu"))
    prices = resolve(price_per_hour, watts, device)
    w = make_sweep_workload(engine, workload, max_tokens=max_tokens, status=status)
    wdef = workload_definition(w)
    grid_keys = list(points[0])
    grid_values = {k: list(dict.fromkeys(p[k] for p in points)) for k in grid_keys}
    base = {k: v for k, v in original.items() if k not in grid_keys}
    identity = {
        "model": status.get("model"),
        "weights_checksum": status.get("weights_checksum"),
        "device": device,
        "workload": wdef["fingerprint"],
        "repeats": repeats,
        "warmup": warmup,
        "reset_prefix_cache": reset_prefix_cache,
    }
    sweep_key = stable_hash({**identity, "base": base, "grid": points})
    if record and (run_log is not None or recording_enabled()):
        log = run_log if isinstance(run_log, RunLog) else RunLog(run_log)
    else:
        log = None

    # -- resume ------------------------------------------------------------------------------------
    reuse: dict[str, dict] = {}
    parent_id = None
    previous_ppl = None
    if isinstance(resume, (list, tuple)):
        reuse = {r["key"]: dict(r, resumed=True) for r in resume if isinstance(r, dict) and r.get("key")}
    elif resume and log is not None:
        try:
            previous = log.find("sweep", sweep_key)
            if previous:
                parent_id = previous[0]["id"]
                previous_ppl = (previous[0].get("metrics") or {}).get("baseline_ppl")
                for child in log.children(parent_id):
                    rec = record_from_row(child) if child["status"] == "completed" else None
                    if rec is not None:
                        reuse[child["key"]] = rec
                log.reopen(parent_id)
        except Exception as e:  # an unreadable log: measure everything
            warnings.warn(f"run log {log.path}: cannot resume from it ({e})", RuntimeWarning, stacklevel=2)
            parent_id = None
    if parent_id is None:
        parent_id = safe_start(
            log,
            "sweep",
            label="sweep " + " x ".join(f"{k}[{len(v)}]" for k, v in grid_values.items()),
            key=sweep_key,
            model=status.get("model"),
            weights_checksum=status.get("weights_checksum"),
            device=device,
            settings=original,
            workload=wdef,
            extra={"grid": grid_values, "repeats": repeats, "warmup": warmup, **prices},
        )

    todo = []
    for p in points:
        full = {**original, **p}
        todo.append((p, stable_hash({**identity, "settings": full})))
    predicted = _predict(engine, simulate_first, w, original, [p for p, _ in todo]) if simulate_first else {}
    skip = _off_the_predicted_front(predicted, len(todo))
    measure = [t for i, t in enumerate(todo) if t[1] not in reuse and i not in skip]
    if skip:
        print(
            f"sweep: simulated all {len(todo)} points; measuring the {len(measure)} on the predicted front "
            "(and any the simulator cannot model)",
            file=sys.stderr,
        )
    if reuse and len(measure) < len(todo) - len(skip):
        print(
            f"sweep: {len(todo) - len(measure)} of {len(todo)} points already measured"
            + (f" (run log sweep #{parent_id})" if parent_id else "")
            + "; resuming (resume=False measures again)",
            file=sys.stderr,
        )

    ppl_ids: list[int] = []
    if ppl_tokens and any(is_quantised({**original, **p}) for p, _ in measure):
        for r in w.requests:
            ppl_ids.extend(r.prompt_token_ids)
            if len(ppl_ids) >= ppl_tokens:
                break
        limit = int(status.get("max_model_len") or ppl_tokens)
        ppl_ids = ppl_ids[: min(ppl_tokens, limit)]

    bar = _make_progress(progress, len(measure) * repeats * len(w))
    records: list[dict] = []
    result = SweepResult(
        engine=engine,
        grid=grid_values,
        workload=wdef,
        run_id=parent_id,
        price_per_hour=prices["price_per_hour"],
        watts=prices["watts"],
        status="running",
        key=sweep_key,
    )
    touched: set[str] = set()
    outcome, error = "completed", None
    child_id = None
    try:
        baseline_ppl = None
        if ppl_ids:
            need = {k: v for k, v in QUANT_DEFAULTS.items() if original.get(k) != v}
            if need:
                touched |= set(need)
                eng.configure(**need)
            baseline_ppl = perplexity(eng, ppl_ids)
        result.baseline_ppl = baseline_ppl if baseline_ppl is not None else previous_ppl
        ppl_cache: dict[str, float | None] = {}

        def measure_point(target: SweepTarget, index: int, p: dict, key: str, replica: str | None) -> dict:
            """Configure `target` with point `p`, warm it up, measure it; the point's record."""
            nonlocal child_id
            label = point_label(p)
            target.check()
            if hasattr(bar, "set_description"):
                bar.set_description(label)
            t0 = time.monotonic()
            settings_now = target.configure(**p)
            configure_s = time.monotonic() - t0
            mismatch = {k: (v, settings_now.get(k)) for k, v in p.items() if settings_now.get(k) != v}
            if mismatch:
                raise RuntimeError(f"the engine did not take the settings {mismatch} (asked, got)")
            where = {} if replica is None else {"replica": replica}
            point_id = safe_start(
                log,
                "sweep_point",
                parent_id=parent_id,
                label=label,
                key=key,
                model=status.get("model"),
                weights_checksum=status.get("weights_checksum"),
                device=device,
                settings=settings_now,
                workload=wdef,
                facts=False,
                extra={"point": p, "label": label, "index": index, **where},
            )
            if replica is None:
                child_id = point_id  # finished as interrupted or failed if the sweep stops in this point
            try:
                if warmup:
                    warm = [
                        BenchRequest(r.index, r.prompt_token_ids, min(r.max_tokens, 8), 0.0)
                        for r in w.requests[:warmup]
                    ]
                    target.run(warm)
                runs = [
                    measure_run(target, w, progress=bar, reset_prefix_cache=reset_prefix_cache, **prices)
                    for _ in range(repeats)
                ]
                agg = aggregate(runs)
                ppl = None
                if ppl_ids and is_quantised(settings_now):
                    qkey = json.dumps(
                        [settings_now.get(k) for k in ("quantization", "quant_group_size", "kv_cache_dtype")]
                    )
                    if qkey not in ppl_cache:  # the same weights give the same perplexity at every other setting
                        ppl_cache[qkey] = perplexity(target, ppl_ids)
                    ppl = ppl_cache[qkey]
            except BaseException as e:
                if replica is not None:
                    safe_finish(
                        log,
                        point_id,
                        "failed" if not isinstance(e, KeyboardInterrupt) else "interrupted",
                        error=f"{type(e).__name__}: {e}",
                    )
                raise
            agg["ppl"] = ppl
            base_ppl = result.baseline_ppl
            agg["delta_ppl"] = ppl - base_ppl if ppl is not None and base_ppl is not None else None
            agg["repeats"] = repeats
            rec = {
                "index": index,
                "label": label,
                "point": p,
                **p,
                **agg,
                "runs": runs,
                "settings": settings_now,
                "run_id": point_id,
                "key": key,
                "configure_s": configure_s,
                "resumed": False,
                "source": "measured",
                "predicted": predicted.get(index),
                **where,
            }
            safe_finish(
                log,
                point_id,
                "completed",
                metrics={
                    k: v
                    for k, v in rec.items()
                    if k
                    not in (
                        "index",
                        "label",
                        "point",
                        "settings",
                        "run_id",
                        "key",
                        "configure_s",
                        "resumed",
                        "replica",
                        *p,
                    )
                },
                extra={"point": p, "label": label, "index": index, "configure_s": configure_s, **where},
            )
            if replica is None:
                child_id = None
            return rec

        pending = [(i, p, key) for i, (p, key) in enumerate(todo) if i not in skip and key not in reuse]
        fanned = hasattr(engine, "replicas") and hasattr(engine, "replica") and len(pending) > 1
        # a cluster: points in parallel, one at a time on each live replica
        measured = _fan_out(engine, pending, measure_point, cancel, touched) if fanned else {}
        for index, (p, key) in enumerate(todo):
            label = point_label(p)
            if index in skip:
                rec = {
                    "index": index,
                    "label": label,
                    "point": p,
                    **p,
                    **predicted[index],
                    "source": "simulated",
                    "predicted": predicted[index],
                    "key": key,
                    "resumed": False,
                }
            elif key in reuse:
                rec = dict(reuse[key], index=index, label=label)
            elif fanned:
                rec = measured[index]
            else:
                touched |= set(p)
                rec = measure_point(eng, index, p, key, None)
            records.append(rec)
            if on_point is not None:
                on_point(rec)
    except KeyboardInterrupt:
        outcome, error = "interrupted", "KeyboardInterrupt"
        raise
    except BaseException as e:
        outcome, error = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        bar.close()
        if child_id is not None:
            safe_finish(log, child_id, outcome, error=error)
        if log is not None and parent_id is not None and outcome != "completed":
            try:  # a point whose row was written just as the interrupt came
                log.finish_children(parent_id, outcome, error)
            except Exception:
                pass
        eng.abort_in_flight()
        restore = {k: original[k] for k in touched}
        if restore:
            _restore(eng, restore)  # a cluster: every replica
        result[:] = records
        result.status = outcome
        if records:
            annotate(result)
        best = max((r for r in result if r.get("pareto")), key=lambda r: r.get("output_tok_s") or 0, default=None)
        safe_finish(
            log,
            parent_id,
            outcome,
            error=error,
            metrics={
                "points": len(todo),
                "completed_points": len(result),
                "measured_now": sum(not r.get("resumed") for r in result),
                "best": None
                if best is None
                else {
                    k: best.get(k)
                    for k in ("label", "output_tok_s", "ttft_p99_ms", "itl_p99_ms", "cost_per_mtok", "joules_per_token")
                },
                "pareto": [r["label"] for r in result if r.get("pareto")],
                "noisy": [r["label"] for r in result if r.get("noisy")],
                "baseline_ppl": result.baseline_ppl,
                **prices,
            },
        )
        _LAST[0] = result
    return result


# Settings the simulator models (the scheduler's); a point changing any other is always measured.
SIMULATED_SETTINGS = frozenset({"batching", "max_num_seqs", "max_num_batched_tokens", "kv_cache", "prefix_caching"})
PREDICTED_KEYS = (
    "output_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "cost_per_mtok",
    "joules_per_token",
    "kv_usage_peak",
    "preemptions",
)


def _fan_out(cluster, pending: list[tuple[int, dict, str]], measure_point, cancel, touched: set) -> dict[int, dict]:
    """Measure the points on a cluster's live replicas in parallel, each replica one point at a
    time (its own settings, its own runs); records name their replica. The first failure stops
    the others after their current point and is raised."""
    import queue as queue_

    work: queue_.SimpleQueue = queue_.SimpleQueue()
    for item in pending:
        work.put(item)
    done: dict[int, dict] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker(name: str) -> None:
        target = SweepTarget(cluster.replica(name), cancel)
        while not stop.is_set():
            try:
                index, p, key = work.get_nowait()
            except queue_.Empty:
                return
            try:
                rec = measure_point(target, index, p, key, name)
            except BaseException as e:  # handed to the sweep's thread
                with lock:
                    errors.append(e)
                stop.set()
                target.abort_in_flight()
                return
            with lock:
                done[index] = rec

    names = [r["name"] for r in cluster.replicas() if r["alive"]]
    for item in pending:
        touched.update(item[1])  # every replica may take any point: restore them all
    threads = [threading.Thread(target=worker, args=(n,), name=f"wb-sweep-{n}", daemon=True) for n in names]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except BaseException:
        stop.set()
        raise
    if errors:
        raise errors[0]
    return done


def _predict(engine, simulate_first, w, original: dict, points: list[dict]) -> dict[int, dict]:
    """The simulator's prediction of each point it can model (index -> headline metrics)."""
    from ..sim import Simulator

    sim = simulate_first if isinstance(simulate_first, Simulator) else Simulator.calibrate(engine)
    out = {}
    for i, p in enumerate(points):
        if set(p) <= SIMULATED_SETTINGS:
            summary = sim.run(w, {**original, **p}, record=False).summary()
            out[i] = {k: summary.get(k) for k in PREDICTED_KEYS}
    return out


def _off_the_predicted_front(predicted: dict[int, dict], n: int) -> set[int]:
    """Predicted points that another predicted point dominates (throughput vs p99 TTFT and ITL)."""
    from .pareto import pareto_front

    if len(predicted) < 2:
        return set()
    order = sorted(predicted)
    objectives = [("output_tok_s", "max"), ("ttft_p99_ms", "min"), ("itl_p99_ms", "min")]
    front = {order[i] for i in pareto_front([predicted[k] for k in order], objectives)}
    return {k for k in order if k not in front}


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


_LAST: list[SweepResult | None] = [None]


def last() -> SweepResult | None:
    """The most recent sweep's records in this process (partial when it was interrupted)."""
    return _LAST[0]


def _restore(eng: SweepTarget, settings: dict) -> None:
    """Put the engine back; a second Ctrl-C during the restore does not leave it half-way."""
    for attempt in range(3):
        try:
            eng.configure(**settings)
            return
        except KeyboardInterrupt:
            if attempt == 2:
                raise
        except Exception as e:
            warnings.warn(
                f"sweep: could not restore the engine's settings {settings}: {e}", RuntimeWarning, stacklevel=3
            )
            return


# `workbench.sweep` is the function; its async twin and the last result hang off it.
sweep.asweep = asweep  # type: ignore[attr-defined]
sweep.last = last  # type: ignore[attr-defined]
