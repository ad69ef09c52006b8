"""Recording runs as they happen: `safe_start`/`safe_finish` (a broken run log warns, never fails
the run) and the `record_bench` / `record_scenarios` decorators that wrap the bench entry points."""

from __future__ import annotations

import functools
import json
import os
import sqlite3
from typing import Any

from .facts import machine_facts
from .log import RunLog, json_default, open_log, recording_enabled


# ----------------------------------------------------------------------------- recording helpers
def _warn(msg: str) -> None:
    import warnings

    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def safe_start(log: RunLog | None, kind: str, **fields) -> int | None:
    """`log.start`, but a broken run log (read-only disk, ...) warns instead of failing the run."""
    if log is None:
        return None
    try:
        return log.start(kind, **fields)
    except (sqlite3.Error, OSError, RuntimeError) as e:
        _warn(f"run log {log.path}: could not record the {kind} run ({e})")
        return None


def safe_finish(log: RunLog | None, run_id: int | None, status: str, **fields) -> None:
    if log is None or run_id is None:
        return
    try:
        log.finish(run_id, status, **fields)
    except (sqlite3.Error, OSError, KeyError) as e:
        _warn(f"run log {log.path}: could not finish run {run_id} ({e})")


def _recorded(fn, kind: str, start_fields, finish_fields):
    """`fn` wrapped to record its run of `kind`: inserted as `running` with `start_fields(args,
    kwargs)` before it starts, finished with `finish_fields(report)` (or as interrupted / failed).
    The wrapper takes `record=False` to skip and `run_log=` (path or RunLog) for another database;
    the report gets `run_id`."""

    @functools.wraps(fn)
    def wrapper(*args, record: bool = True, run_log=None, **kwargs):
        log = open_log(run_log) if record and (run_log is not None or recording_enabled()) else None
        run_id = safe_start(log, kind, **start_fields(args, kwargs))
        try:
            report = fn(*args, **kwargs)
        except KeyboardInterrupt:
            safe_finish(log, run_id, "interrupted", error="KeyboardInterrupt")
            raise
        except BaseException as e:
            safe_finish(log, run_id, "failed", error=f"{type(e).__name__}: {e}")
            raise
        if run_id is not None:
            report["run_id"] = run_id
            safe_finish(log, run_id, "completed", **finish_fields(report))
        return report

    return wrapper


def _model_arg(args: tuple, kwargs: dict, position: int) -> str | None:
    model = (
        args[position]
        if len(args) > position and isinstance(args[position], (str, os.PathLike))
        else kwargs.get("model")
    )
    return None if model is None else str(model)


def _bench_start_fields(args: tuple, kwargs: dict) -> dict[str, Any]:
    what = kwargs.get("systems") or (args[0] if args and isinstance(args[0], (list, tuple)) else None)
    return {
        "label": "bench " + ",".join(map(str, what or ("workbench", "hf_sequential", "hf_static"))),
        "model": _model_arg(args, kwargs, 0),
        "settings": kwargs.get("settings") or {},
        "workload": {
            k: kwargs.get(k)
            for k in ("num_requests", "arrival", "rate", "seed", "quick", "prompt_len", "output_len")
            if k in kwargs
        },
    }


def record_bench(fn):
    """Decorate `run_bench`: records the run as `running` before it starts and finishes it with the
    report (settings, model, checksum, device, machine, workload, results with cost and energy).
    Pass `record=False` to skip, `run_log=` (path or RunLog) for another database. The report
    gets `run_id`."""
    return _recorded(fn, "bench", _bench_start_fields, bench_fields)


_SCENARIO_ARGS = ("model", "with_peers", "quick")


def _scenario_start_fields(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = list(args[0] if args else kwargs.get("names") or ())
    return {
        "label": "scenario " + ",".join(map(str, names)),
        "model": _model_arg(args, kwargs, 1),
        "settings": {k: v for k, v in kwargs.items() if k not in _SCENARIO_ARGS and k != "names"},
        "workload": {"scenarios": names, "quick": kwargs.get("quick", False)},
    }


def record_scenarios(fn):
    """Decorate `run_scenarios` (`workbench bench --scenario`): the run is recorded as kind
    `scenario`, its metrics the scenario results with their `ratios` and `targets`. Same
    `record=` / `run_log=` as `record_bench`."""
    return _recorded(fn, "scenario", _scenario_start_fields, scenario_fields)


def _clean(v: Any) -> Any:
    """JSON-safe (numpy/torch scalars to numbers, NaN and infinities to None)."""
    return json.loads(json.dumps(v, default=json_default), parse_constant=lambda c: None)


def _report_fields(report: dict, *, label: str, metrics: dict, extra: dict) -> dict[str, Any]:
    """The run-log row of a finished report (bench or scenario): what they share."""
    status = report.get("engine_status") or {}
    machine = machine_facts()
    if report.get("machine") is not None:
        machine["bench"] = report["machine"]
    return {
        "label": label,
        "model": report.get("model"),
        "weights_checksum": status.get("weights_checksum"),
        "device": status.get("device") or report.get("roofline", {}).get("device"),
        "machine": machine,
        "settings": report.get("settings"),
        "workload": report.get("workload"),
        "metrics": _clean(metrics),
        "extra": {"argv": report.get("argv"), **extra},
    }


def bench_fields(report: dict) -> dict[str, Any]:
    """What a finished bench report contributes to its run-log row."""
    from ..tuning.costs import resolve, run_costs

    status = report.get("engine_status") or {}
    device = status.get("device") or report.get("roofline", {}).get("device")
    prices = resolve(None, None, device)
    results = {}
    for name, r in (report.get("results") or {}).items():
        c = run_costs(r.get("output_tok_s"), prices["price_per_hour"], prices["watts"])
        results[name] = {**r, **{k: v for k, v in c.items() if k not in ("price_per_hour", "watts")}}
    metrics = {
        "results": results,
        "roofline": report.get("roofline"),
        "ratios": report.get("ratios"),
        "targets": report.get("targets"),
        "token_agreement": report.get("token_agreement"),
        **prices,
    }
    if report.get("endpoints"):  # `workbench bench --endpoint`: the servers measured
        metrics["endpoints"] = report["endpoints"]
    fields = _report_fields(
        report,
        label="bench " + ",".join(results),
        metrics=metrics,
        extra={"systems": report.get("systems"), "loadavg": [report.get("loadavg_start"), report.get("loadavg_end")]},
    )
    fields["model"] = (
        report.get("model")
        or ",".join(sorted({str(e.get("model")) for e in (report.get("endpoints") or {}).values()}))
        or None
    )
    return fields


def scenario_fields(report: dict) -> dict[str, Any]:
    """What a finished `run_scenarios` report contributes to its run-log row: the ratios and targets
    first (the headline), then each scenario's full result."""
    names = list(report.get("scenarios") or ())
    metrics = {"ratios": report.get("ratios"), "targets": report.get("targets"), **{n: report.get(n) for n in names}}
    return _report_fields(
        report,
        label="scenario " + ",".join(names),
        metrics=metrics,
        extra={"scenarios": names, "quick": report.get("quick"), "with_peers": report.get("with_peers")},
    )
