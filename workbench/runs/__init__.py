"""The run log: every bench, scenario and sweep run in a local SQLite database.

    import workbench
    workbench.runs.list_runs()                 # newest first: id, kind, status, model, headline metrics
    workbench.runs.get_run(12)                 # everything recorded, a sweep with its points
    workbench.runs.compare([12, 27])           # metrics side by side, settings that differ
    workbench.runs.export("runs.csv")          # or .json; format from the suffix or fmt=

The same from a shell: `workbench runs list|show|compare|export`.

Where: `$WORKBENCH_RUNS_DB` if set, else `runs.sqlite` in the user data directory
(`platformdirs.user_data_dir("serving-workbench")`, e.g. ~/.local/share/serving-workbench).
Every function takes `db=` (a path or a `RunLog`) to use another file. `WORKBENCH_RUNS_DB=off`
turns recording off (`run_bench(record=False)`, `sweep(record=False)` do it per call).

What a run holds: kind (`bench`, `scenario` (`workbench bench --scenario`), `sweep`, or
`sweep_point`, the child of a sweep), status,
start/finish times (UTC ISO), the engine settings, model name and weights checksum, device,
package versions, machine facts, the workload definition and all metrics (JSON columns).

Safety with several writers (two notebooks, a CLI bench): the database runs in WAL mode, every
write is one short `BEGIN IMMEDIATE` transaction on its own connection, and a busy timeout makes
writers wait for each other instead of failing, so a writer killed at any point leaves the file
consistent (SQLite rolls its half-written transaction back). A run is inserted as `running`
before its work starts and set to `completed`, `interrupted` (Ctrl-C / kernel interrupt) or
`failed` at the end; a run still `running` whose writer process is gone (same host, pid dead or
reused) is shown, and stored, as `abandoned`: half-finished runs are never mistaken for results.

Modules: `log` (`RunLog`, the SQLite file, flat views of a run), `record` (recording runs as they
happen: `record_bench`, `record_scenarios`, `safe_start` / `safe_finish`), `facts` (package
versions, machine facts), `cli` (`workbench runs`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .facts import machine_facts, package_versions
from .log import KINDS, STATUSES, RunLog, default_path, open_log, recording_enabled
from .record import bench_fields, record_bench, record_scenarios, safe_finish, safe_start, scenario_fields
from .rows import HEADLINE, export_row, flatten, headline, ratios_text

__all__ = [
    "HEADLINE",
    "KINDS",
    "STATUSES",
    "RunLog",
    "bench_fields",
    "compare",
    "default_path",
    "export",
    "export_row",
    "flatten",
    "get_run",
    "headline",
    "list_runs",
    "machine_facts",
    "package_versions",
    "plot",
    "ratios_text",
    "record_bench",
    "record_scenarios",
    "recording_enabled",
    "safe_finish",
    "safe_start",
    "scenario_fields",
    "table",
]


# ----------------------------------------------------------------------------- module-level API
def list_runs(
    *, kind: str | None = None, status: str | None = None, limit: int | None = 50, children: bool = False, db=None
) -> list[dict[str, Any]]:
    return open_log(db).list(kind=kind, status=status, limit=limit, children=children)


def get_run(run_id: int, *, db=None) -> dict[str, Any]:
    return open_log(db).get(run_id)


def compare(ids: Iterable[int], *, db=None) -> dict[str, Any]:
    return open_log(db).compare(ids)


def export(
    path: str | os.PathLike | None = None,
    *,
    ids: Iterable[int] | None = None,
    fmt: str | None = None,
    kind: str | None = None,
    db=None,
) -> str:
    return open_log(db).export(path, ids=ids, fmt=fmt, kind=kind)


def plot(ids: Iterable[int], *, db=None):
    """Runs side by side as plots: throughput, latency percentiles and the settings that differ."""
    from .plots import plot as _plot

    return _plot(ids, db=db)


def table(runs: list[dict[str, Any]]):
    """Runs as a pandas DataFrame when pandas is installed, else flat row dicts."""
    rows = [export_row(r) for r in runs]
    try:
        import pandas as pd
    except ImportError:
        return rows
    return pd.DataFrame(rows)
