"""One sweep's run (`sweep.sweep` builds it): its plan, the points it measures, and its end.

plan:    the grid's points, their keys and the sweep's (resume), the simulator's predictions
measure: each point configured, warmed up, measured `repeats` times (here, or fanned out over a
         cluster's replicas), recorded in the run log as it finishes
finish:  on any end (done, Ctrl-C, an error) the engine back on its settings, the records
         annotated (Pareto, noise), the sweep's row in the run log closed
"""

from __future__ import annotations

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
from ..runs.rows import HEADLINE
from .costs import resolve
from .grid import QUANT_DEFAULTS, grid_points, point_label, stable_hash
from .measure import SweepTarget, aggregate, is_quantised, measure_run, perplexity
from .pareto import annotate
from .result import SweepResult, record_from_row
from .workload import make_sweep_workload, workload_definition

# a point record's keys that are not metrics (the run log keeps them beside the metrics)
_NOT_METRICS = ("index", "label", "point", "settings", "run_id", "key", "configure_s", "resumed", "replica")


# Settings the simulator models (the scheduler's); a point changing any other is always measured.
SIMULATED_SETTINGS = frozenset({"batching", "max_num_seqs", "max_num_batched_tokens", "kv_cache", "prefix_caching"})
PREDICTED_KEYS = (*HEADLINE, "kv_usage_peak", "preemptions")  # what a simulated point reports


class SweepRun:
    def __init__(
        self,
        engine,
        grid: dict[str, Sequence[Any]],
        workload,
        *,
        repeats: int,
        warmup: int,
        resume: bool | Sequence[dict],
        price_per_hour: float | None,
        watts: float | None,
        max_tokens: int,
        ppl_tokens: int,
        reset_prefix_cache: bool,
        record: bool,
        run_log: str | RunLog | None,
        cancel: threading.Event | None,
        simulate_first: bool | Any,
    ):
        self.engine = engine
        self.eng = SweepTarget(engine, cancel)
        self.cancel = cancel
        self.repeats, self.warmup, self.reset_prefix_cache = repeats, warmup, reset_prefix_cache
        self.original = self.eng.settings()
        self.points = grid_points(grid)
        self.status = status = self.eng.status()
        self.device = str(status.get("device", "cpu"))
        self.prices = resolve(price_per_hour, watts, self.device)
        self.w = make_sweep_workload(engine, workload, max_tokens=max_tokens, status=status)
        self.wdef = workload_definition(self.w)
        keys = list(self.points[0])
        self.grid_values = {k: list(dict.fromkeys(p[k] for p in self.points)) for k in keys}
        base = {k: v for k, v in self.original.items() if k not in keys}
        self.identity = {
            "model": status.get("model"),
            "weights_checksum": status.get("weights_checksum"),
            "device": self.device,
            "workload": self.wdef["fingerprint"],
            "repeats": repeats,
            "warmup": warmup,
            "reset_prefix_cache": reset_prefix_cache,
        }
        self.key = stable_hash({**self.identity, "base": base, "grid": self.points})
        self.log = None
        if record and (run_log is not None or recording_enabled()):
            self.log = run_log if isinstance(run_log, RunLog) else RunLog(run_log)
        self.reuse, self.parent_id, previous_ppl = self._resume(resume)
        self.todo = [(p, stable_hash({**self.identity, "settings": {**self.original, **p}})) for p in self.points]
        self.predicted = self._predict(simulate_first) if simulate_first else {}
        self.skip = _off_the_predicted_front(self.predicted, len(self.todo))
        self.to_measure = [t for i, t in enumerate(self.todo) if t[1] not in self.reuse and i not in self.skip]
        self._say_what_runs()
        self.ppl_ids = self._perplexity_ids(ppl_tokens)
        self.ppl_cache: dict[str, float | None] = {}
        self.result = SweepResult(
            engine=engine,
            grid=self.grid_values,
            workload=self.wdef,
            run_id=self.parent_id,
            price_per_hour=self.prices["price_per_hour"],
            watts=self.prices["watts"],
            status="running",
            key=self.key,
        )
        self.result.baseline_ppl = previous_ppl
        self.touched: set[str] = set()  # settings the sweep changed (restored at the end)
        self.child_id = None  # the point being measured here, finished as the sweep ends if it is cut
        self.bar = None

    # -- plan ------------------------------------------------------------------------------------
    def _resume(self, resume) -> tuple[dict[str, dict], Any, float | None]:
        """(records to reuse by key, the sweep's run-log row, its baseline perplexity), from an
        earlier result or the run log; the sweep's row started when there is none to reopen."""
        reuse: dict[str, dict] = {}
        parent_id, previous_ppl, log = None, None, self.log
        if isinstance(resume, (list, tuple)):
            reuse = {r["key"]: dict(r, resumed=True) for r in resume if isinstance(r, dict) and r.get("key")}
        elif resume and log is not None:
            try:
                previous = log.find("sweep", self.key)
                if previous:
                    parent_id = previous[0]["id"]
                    previous_ppl = (previous[0].get("metrics") or {}).get("baseline_ppl")
                    for child in log.children(parent_id):
                        rec = record_from_row(child) if child["status"] == "completed" else None
                        if rec is not None:
                            reuse[child["key"]] = rec
                    log.reopen(parent_id)
            except Exception as e:  # an unreadable log: measure everything
                warnings.warn(f"run log {log.path}: cannot resume from it ({e})", RuntimeWarning, stacklevel=4)
                parent_id = None
        if parent_id is None:
            parent_id = safe_start(
                log,
                "sweep",
                label="sweep " + " x ".join(f"{k}[{len(v)}]" for k, v in self.grid_values.items()),
                key=self.key,
                model=self.status.get("model"),
                weights_checksum=self.status.get("weights_checksum"),
                device=self.device,
                settings=self.original,
                workload=self.wdef,
                extra={"grid": self.grid_values, "repeats": self.repeats, "warmup": self.warmup, **self.prices},
            )
        return reuse, parent_id, previous_ppl

    def _predict(self, simulate_first) -> dict[int, dict]:
        return predict(self.engine, simulate_first, self.w, self.original, [p for p, _ in self.todo])

    def _say_what_runs(self) -> None:
        todo, measure, skip = self.todo, self.to_measure, self.skip
        if skip:
            print(
                f"sweep: simulated all {len(todo)} points; measuring the {len(measure)} on the predicted front "
                "(and any the simulator cannot model)",
                file=sys.stderr,
            )
        if self.reuse and len(measure) < len(todo) - len(skip):
            print(
                f"sweep: {len(todo) - len(measure)} of {len(todo)} points already measured"
                + (f" (run log sweep #{self.parent_id})" if self.parent_id else "")
                + "; resuming (resume=False measures again)",
                file=sys.stderr,
            )

    def _perplexity_ids(self, ppl_tokens: int) -> list[int]:
        """The workload's first `ppl_tokens` prompt tokens, where a point to measure is quantised."""
        ids: list[int] = []
        if ppl_tokens and any(is_quantised({**self.original, **p}) for p, _ in self.to_measure):
            for r in self.w.requests:
                ids.extend(r.prompt_token_ids)
                if len(ids) >= ppl_tokens:
                    break
            limit = int(self.status.get("max_model_len") or ppl_tokens)
            ids = ids[: min(ppl_tokens, limit)]
        return ids

    # -- measure ---------------------------------------------------------------------------------
    def run(self, progress, on_point: Callable[[dict], Any] | None) -> SweepResult:
        self.bar = _make_progress(progress, len(self.to_measure) * self.repeats * len(self.w))
        records: list[dict] = []
        outcome, error = "completed", None
        try:
            if self.ppl_ids:
                need = {k: v for k, v in QUANT_DEFAULTS.items() if self.original.get(k) != v}
                if need:
                    self.touched |= set(need)
                    self.eng.configure(**need)
                baseline = perplexity(self.eng, self.ppl_ids)
                if baseline is not None:
                    self.result.baseline_ppl = baseline
            pending = [
                (i, p, key) for i, (p, key) in enumerate(self.todo) if i not in self.skip and key not in self.reuse
            ]
            fanned = hasattr(self.engine, "replicas") and hasattr(self.engine, "replica") and len(pending) > 1
            # a cluster: points in parallel, one at a time on each live replica
            measured = fan_out(self.engine, pending, self.measure_point, self.cancel, self.touched) if fanned else {}
            for index, (p, key) in enumerate(self.todo):
                if index in self.skip:
                    guess = self.predicted[index]
                    rec = {"index": index, "label": point_label(p), "point": p, **p, **guess, "source": "simulated",
                           "predicted": guess, "key": key, "resumed": False}  # fmt: skip
                elif key in self.reuse:
                    rec = dict(self.reuse[key], index=index, label=point_label(p))
                elif fanned:
                    rec = measured[index]
                else:
                    self.touched |= set(p)
                    rec = self.measure_point(self.eng, index, p, key, None)
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
            self._finish(records, outcome, error)
        return self.result

    def measure_point(self, target: SweepTarget, index: int, p: dict, key: str, replica: str | None) -> dict:
        """Configure `target` with point `p`, warm it up, measure it; the point's record."""
        label = point_label(p)
        target.check()
        if hasattr(self.bar, "set_description"):
            self.bar.set_description(label)
        t0 = time.monotonic()
        settings_now = target.configure(**p)
        configure_s = time.monotonic() - t0
        mismatch = {k: (v, settings_now.get(k)) for k, v in p.items() if settings_now.get(k) != v}
        if mismatch:
            raise RuntimeError(f"the engine did not take the settings {mismatch} (asked, got)")
        where = {} if replica is None else {"replica": replica}
        extra = {"point": p, "label": label, "index": index, **where}
        point_id = safe_start(
            self.log,
            "sweep_point",
            parent_id=self.parent_id,
            label=label,
            key=key,
            model=self.status.get("model"),
            weights_checksum=self.status.get("weights_checksum"),
            device=self.device,
            settings=settings_now,
            workload=self.wdef,
            facts=False,
            extra=extra,
        )
        if replica is None:
            self.child_id = point_id  # finished as interrupted or failed if the sweep stops in this point
        try:
            runs, agg, ppl = self._measure(target, settings_now)
        except BaseException as e:
            if replica is not None:
                outcome = "failed" if not isinstance(e, KeyboardInterrupt) else "interrupted"
                safe_finish(self.log, point_id, outcome, error=f"{type(e).__name__}: {e}")
            raise
        base_ppl = self.result.baseline_ppl
        agg["ppl"] = ppl
        agg["delta_ppl"] = ppl - base_ppl if ppl is not None and base_ppl is not None else None
        agg["repeats"] = self.repeats
        rec = {"index": index, "label": label, "point": p, **p, **agg, "runs": runs, "settings": settings_now,
               "run_id": point_id, "key": key, "configure_s": configure_s, "resumed": False, "source": "measured",
               "predicted": self.predicted.get(index), **where}  # fmt: skip
        metrics = {k: v for k, v in rec.items() if k not in _NOT_METRICS and k not in p}
        safe_finish(self.log, point_id, "completed", metrics=metrics, extra={**extra, "configure_s": configure_s})
        if replica is None:
            self.child_id = None
        return rec

    def _measure(self, target: SweepTarget, settings_now: dict) -> tuple[list[dict], dict, float | None]:
        """Warm-up, then `repeats` runs of the workload: (the runs, their aggregate, the perplexity
        where the point is quantised)."""
        w = self.w
        if self.warmup:
            warm = [
                BenchRequest(r.index, r.prompt_token_ids, min(r.max_tokens, 8), 0.0) for r in w.requests[: self.warmup]
            ]
            target.run(warm)
        runs = [
            measure_run(target, w, progress=self.bar, reset_prefix_cache=self.reset_prefix_cache, **self.prices)
            for _ in range(self.repeats)
        ]
        ppl = None
        if self.ppl_ids and is_quantised(settings_now):
            qkey = json.dumps([settings_now.get(k) for k in ("quantization", "quant_group_size", "kv_cache_dtype")])
            if qkey not in self.ppl_cache:  # the same weights give the same perplexity at every other setting
                self.ppl_cache[qkey] = perplexity(target, self.ppl_ids)
            ppl = self.ppl_cache[qkey]
        return runs, aggregate(runs), ppl

    # -- finish ----------------------------------------------------------------------------------
    def _finish(self, records: list[dict], outcome: str, error: str | None) -> None:
        """However the sweep ended: the engine back on its settings, the records annotated, the
        run log's rows closed."""
        log, result = self.log, self.result
        self.bar.close()
        if self.child_id is not None:
            safe_finish(log, self.child_id, outcome, error=error)
        if log is not None and self.parent_id is not None and outcome != "completed":
            try:  # a point whose row was written just as the interrupt came
                log.finish_children(self.parent_id, outcome, error)
            except Exception:
                pass
        self.eng.abort_in_flight()
        back = {k: self.original[k] for k in self.touched}
        if back:
            restore(self.eng, back)  # a cluster: every replica
        result[:] = records
        result.status = outcome
        if records:
            annotate(result)
        best = max((r for r in result if r.get("pareto")), key=lambda r: r.get("output_tok_s") or 0, default=None)
        headline = ("label", "output_tok_s", "ttft_p99_ms", "itl_p99_ms", "cost_per_mtok", "joules_per_token")
        safe_finish(
            log,
            self.parent_id,
            outcome,
            error=error,
            metrics={
                "points": len(self.todo),
                "completed_points": len(result),
                "measured_now": sum(not r.get("resumed") for r in result),
                "best": None if best is None else {k: best.get(k) for k in headline},
                "pareto": [r["label"] for r in result if r.get("pareto")],
                "noisy": [r["label"] for r in result if r.get("noisy")],
                "baseline_ppl": result.baseline_ppl,
                **self.prices,
            },
        )
        LAST[0] = result


def _off_the_predicted_front(predicted: dict[int, dict], n: int) -> set[int]:
    """Predicted points that another predicted point dominates (throughput vs p99 TTFT and ITL)."""
    from .pareto import pareto_front

    if len(predicted) < 2:
        return set()
    order = sorted(predicted)
    objectives = [("output_tok_s", "max"), ("ttft_p99_ms", "min"), ("itl_p99_ms", "min")]
    front = {order[i] for i in pareto_front([predicted[k] for k in order], objectives)}
    return {k for k in order if k not in front}


def fan_out(cluster, pending: list[tuple[int, dict, str]], measure_point, cancel, touched: set) -> dict[int, dict]:
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


def predict(engine, simulate_first, w, original: dict, points: list[dict]) -> dict[int, dict]:
    """The simulator's prediction of each point it can model (index -> headline metrics)."""
    from ..sim import Simulator

    sim = simulate_first if isinstance(simulate_first, Simulator) else Simulator.calibrate(engine)
    out = {}
    for i, p in enumerate(points):
        if set(p) <= SIMULATED_SETTINGS:
            summary = sim.run(w, {**original, **p}, record=False).summary()
            out[i] = {k: summary.get(k) for k in PREDICTED_KEYS}
    return out


def restore(eng: SweepTarget, settings: dict) -> None:
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


LAST: list[SweepResult | None] = [None]  # the most recent sweep in this process (`sweep.last`)


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
