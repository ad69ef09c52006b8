"""`RunLog`: the SQLite file behind the run log, and the flat views of a run (headline metrics,
export rows, the targets text). See the package docstring for the guarantees."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .facts import machine_facts, package_versions
from .rows import HEADLINE, export_row, flatten, ordered_union, predictions

ENV_VAR = "WORKBENCH_RUNS_DB"
SCHEMA_VERSION = 1
STATUSES = ("running", "completed", "interrupted", "failed", "abandoned")
KINDS = ("bench", "scenario", "sweep", "sweep_point", "simulation")
JSON_COLUMNS = ("settings", "workload", "metrics", "versions", "machine", "extra")
COLUMNS = (
    "id",
    "kind",
    "parent_id",
    "status",
    "started_at",
    "finished_at",
    "label",
    "key",
    "model",
    "weights_checksum",
    "device",
    "host",
    "pid",
    "pid_start",
    *JSON_COLUMNS,
    "error",
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    parent_id INTEGER REFERENCES runs(id),
    status TEXT NOT NULL,
    started_at TEXT NOT NULL,
    finished_at TEXT,
    label TEXT,
    key TEXT,
    model TEXT,
    weights_checksum TEXT,
    device TEXT,
    host TEXT,
    pid INTEGER,
    pid_start TEXT,
    settings TEXT,
    workload TEXT,
    metrics TEXT,
    versions TEXT,
    machine TEXT,
    extra TEXT,
    error TEXT
);
CREATE INDEX IF NOT EXISTS runs_key ON runs(kind, key);
CREATE INDEX IF NOT EXISTS runs_parent ON runs(parent_id);
CREATE INDEX IF NOT EXISTS runs_started ON runs(started_at);
"""


_OFF = ("off", "none", "0", "false", "no")


def recording_enabled() -> bool:
    """False when $WORKBENCH_RUNS_DB is "off" (or none/0/false/no): bench and sweeps record nothing."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in _OFF


def default_path() -> Path:
    env = os.environ.get(ENV_VAR)
    if env and env.strip().lower() not in _OFF:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("serving-workbench", appauthor=False)) / "runs.sqlite"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, Linux): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
        return data[data.rindex(")") + 2 :].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int | None, pid_start: str | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if pid_start is not None:
        now = _process_start(pid)
        if now is not None and now != pid_start:
            return False
    return True


def json_default(o: Any):
    if hasattr(o, "item"):  # numpy / torch scalars
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def _dumps(v: Any) -> str | None:
    if v is None:
        return None
    return json.dumps(v, default=json_default, allow_nan=True)


# ----------------------------------------------------------------------------- the log
class RunLog:
    """One SQLite run-log file. Cheap to create; every call opens its own short connection."""

    _ready: set[str] = set()
    _ready_lock = threading.Lock()

    def __init__(self, path: str | os.PathLike | None = None, *, timeout: float = 60.0):
        self.path = Path(path).expanduser() if path is not None else default_path()
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"RunLog({str(self.path)!r})"

    # -- connections -------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        key = str(self.path.absolute())
        if key not in RunLog._ready or not self.path.exists():
            with RunLog._ready_lock:
                self._init()
                RunLog._ready.add(key)
        return self._open()

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
        conn.execute("PRAGMA synchronous = NORMAL")  # with WAL: durable against a killed process
        return conn

    def _init(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # The log holds prompts and settings: readable by its owner only (sqlite gives the -wal and
        # -shm files the database's mode).
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            pass
        deadline = time.monotonic() + self.timeout
        while True:
            conn = self._open()
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":  # pragma: no cover - e.g. a filesystem without shared memory
                    raise sqlite3.OperationalError(f"could not switch {self.path} to WAL mode (got {mode})")
                conn.execute("BEGIN IMMEDIATE")
                for stmt in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                    conn.execute(stmt)
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if version == 0:
                    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                elif version > SCHEMA_VERSION:
                    conn.execute("ROLLBACK")
                    raise RuntimeError(f"{self.path} was written by a newer workbench (schema {version})")
                conn.execute("COMMIT")
                return
            except sqlite3.OperationalError as e:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            finally:
                conn.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One short write transaction (BEGIN IMMEDIATE takes the write lock up front, so two
        writers queue on the busy timeout instead of deadlocking on a lock upgrade)."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        finally:
            conn.close()

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        conn = self._connect()
        try:
            yield conn
        finally:
            conn.close()

    # -- writing -----------------------------------------------------------------------------
    def start(
        self,
        kind: str,
        *,
        parent_id: int | None = None,
        label: str | None = None,
        key: str | None = None,
        model: str | None = None,
        weights_checksum: str | None = None,
        device: str | None = None,
        settings: dict | None = None,
        workload: dict | None = None,
        metrics: dict | None = None,
        extra: dict | None = None,
        facts: bool = True,
    ) -> int:
        """Insert a run as `running` (before its work starts); returns its id."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        pid = os.getpid()
        row = {
            "kind": kind,
            "parent_id": parent_id,
            "status": "running",
            "started_at": _now(),
            "label": label,
            "key": key,
            "model": model,
            "weights_checksum": weights_checksum,
            "device": device,
            "host": socket.gethostname(),
            "pid": pid,
            "pid_start": _process_start(pid),
            "settings": _dumps(settings),
            "workload": _dumps(workload),
            "metrics": _dumps(metrics),
            "versions": _dumps(package_versions()) if facts else None,
            "machine": _dumps(machine_facts()) if facts else None,
            "extra": _dumps(extra),
        }
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._write() as conn:
            cur = conn.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", tuple(row.values()))
            return int(cur.lastrowid)

    def update(self, run_id: int, **fields: Any) -> None:
        """Set columns of a run (JSON columns take dicts)."""
        if not fields:
            return
        bad = [k for k in fields if k not in COLUMNS or k == "id"]
        if bad:
            raise ValueError(f"unknown run field(s) {bad}; fields: {', '.join(COLUMNS[1:])}")
        vals = [_dumps(v) if k in JSON_COLUMNS else v for k, v in fields.items()]
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._write() as conn:
            n = conn.execute(f"UPDATE runs SET {sets} WHERE id = ?", (*vals, int(run_id))).rowcount
        if n == 0:
            raise KeyError(f"no run {run_id} in {self.path}")

    def finish(self, run_id: int, status: str = "completed", **fields: Any) -> None:
        if status not in STATUSES or status == "running":
            raise ValueError(f"a finished run's status is one of {STATUSES[1:]}, got {status!r}")
        self.update(run_id, status=status, finished_at=_now(), **fields)

    def reopen(self, run_id: int) -> None:
        """Mark an earlier run as running again in this process (a resumed sweep)."""
        pid = os.getpid()
        self.update(
            run_id,
            status="running",
            finished_at=None,
            host=socket.gethostname(),
            pid=pid,
            pid_start=_process_start(pid),
            error=None,
        )

    def finish_children(self, parent_id: int, status: str, error: str | None = None) -> int:
        """Finish the `running` children of a run written by this process (after an interrupt)."""
        with self._write() as conn:
            return conn.execute(
                "UPDATE runs SET status = ?, finished_at = ?, error = COALESCE(error, ?) "
                "WHERE parent_id = ? AND status = 'running' AND host = ? AND pid = ?",
                (status, _now(), error, int(parent_id), socket.gethostname(), os.getpid()),
            ).rowcount

    def reap(self) -> int:
        """Mark `running` runs whose writer is gone (this host, dead or reused pid) `abandoned`."""
        host = socket.gethostname()
        with self._read() as conn:
            rows = conn.execute(
                "SELECT id, pid, pid_start FROM runs WHERE status = 'running' AND host = ?", (host,)
            ).fetchall()
        dead = [r["id"] for r in rows if r["pid"] != os.getpid() and not _alive(r["pid"], r["pid_start"])]
        if dead:
            with self._write() as conn:
                conn.executemany(
                    "UPDATE runs SET status = 'abandoned', error = COALESCE(error, ?) "
                    "WHERE id = ? AND status = 'running'",
                    [("the writing process ended before the run finished", i) for i in dead],
                )
        return len(dead)

    # -- reading -----------------------------------------------------------------------------
    @staticmethod
    def _row(row: sqlite3.Row) -> dict[str, Any]:
        out = dict(row)
        for k in JSON_COLUMNS:
            if out.get(k) is not None:
                try:
                    out[k] = json.loads(out[k])
                except ValueError:
                    pass
        return out

    def get(self, run_id: int, *, children: bool = True) -> dict[str, Any]:
        """One run; a sweep comes with its points under "children" (in measurement order)."""
        self.reap()
        with self._read() as conn:
            row = conn.execute("SELECT * FROM runs WHERE id = ?", (int(run_id),)).fetchone()
            if row is None:
                raise KeyError(f"no run {run_id} in {self.path}")
            out = self._row(row)
            if children:
                kids = conn.execute("SELECT * FROM runs WHERE parent_id = ? ORDER BY id", (int(run_id),)).fetchall()
                out["children"] = [self._row(k) for k in kids]
        return out

    def list(
        self,
        *,
        kind: str | None = None,
        status: str | None = None,
        parent_id: int | None = None,
        children: bool = False,
        limit: int | None = 50,
        model: str | None = None,
    ) -> list[dict[str, Any]]:
        """Runs newest first. Sweep points are left out unless `children=True` or `parent_id` is given."""
        self.reap()
        where, args = [], []
        if kind is not None:
            where.append("kind = ?")
            args.append(kind)
        if status is not None:
            where.append("status = ?")
            args.append(status)
        if model is not None:
            where.append("model = ?")
            args.append(model)
        if parent_id is not None:
            where.append("parent_id = ?")
            args.append(int(parent_id))
        elif not children and kind is None:
            where.append("parent_id IS NULL")
        sql = "SELECT r.*, (SELECT COUNT(*) FROM runs c WHERE c.parent_id = r.id) AS num_children FROM runs r"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._read() as conn:
            return [self._row(r) for r in conn.execute(sql, args).fetchall()]

    def find(self, kind: str, key: str) -> list[dict[str, Any]]:
        """Runs of `kind` with resume key `key`, newest first."""
        self.reap()
        with self._read() as conn:
            rows = conn.execute(
                "SELECT * FROM runs WHERE kind = ? AND key = ? ORDER BY id DESC", (kind, key)
            ).fetchall()
        return [self._row(r) for r in rows]

    def children(self, run_id: int) -> list[dict[str, Any]]:
        with self._read() as conn:
            rows = conn.execute("SELECT * FROM runs WHERE parent_id = ? ORDER BY id", (int(run_id),)).fetchall()
        return [self._row(r) for r in rows]

    def integrity_check(self) -> str:
        with self._read() as conn:
            return conn.execute("PRAGMA integrity_check").fetchone()[0]

    # -- compare / export ----------------------------------------------------------------------
    def _expand(self, ids: Iterable[int]) -> list[dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for i in ids:
            run = self.get(i)
            kids = run.pop("children", [])
            for r in kids if run["kind"] == "sweep" and kids else [run]:
                out.setdefault(r["id"], r)
        return list(out.values())

    def compare(self, ids: Iterable[int]) -> dict[str, Any]:
        """Metrics side by side (a sweep expands to its points) and the settings that differ. A
        simulation that predicts a measured run brings that run along, and `predictions` holds
        its error on each headline metric (predicted / measured - 1)."""
        runs = self._expand(ids)
        present = {r["id"] for r in runs}
        for r in list(runs):
            target = (r.get("extra") or {}).get("predicts") if r.get("kind") == "simulation" else None
            if isinstance(target, int) and target not in present:
                try:
                    runs.insert(runs.index(r), self.get(target))
                    present.add(target)
                except KeyError:
                    pass  # the measured run is gone from this log
        flat = [flatten(r.get("metrics") or {}) for r in runs]
        names = ordered_union(flat, HEADLINE)
        metrics = {
            n: [f.get(n) for f in flat]
            for n in names
            if any(isinstance(f.get(n), (int, float)) and not isinstance(f.get(n), bool) for f in flat)
        }
        sets = [r.get("settings") or {} for r in runs]
        keys = ordered_union(sets, ())
        differ = {
            k: [s.get(k) for s in sets] for k in keys if len({json.dumps(s.get(k), default=str) for s in sets}) > 1
        }
        checksums = {r.get("weights_checksum") for r in runs}
        return {
            "runs": [
                {
                    **{
                        k: r.get(k)
                        for k in (
                            "id",
                            "kind",
                            "parent_id",
                            "status",
                            "started_at",
                            "label",
                            "model",
                            "weights_checksum",
                            "device",
                        )
                    },
                    # a sweep point's number in its sweep, as the sweep's records and plots name it
                    "point": (r.get("extra") or {}).get("index") if r.get("kind") == "sweep_point" else None,
                }
                for r in runs
            ],
            "metrics": metrics,
            "settings": differ,
            "same_weights": len(checksums) == 1 and None not in checksums,
            "same_workload": len({json.dumps(r.get("workload"), sort_keys=True, default=str) for r in runs}) == 1,
            "predictions": predictions(runs),
        }

    def export(
        self,
        path: str | os.PathLike | None = None,
        *,
        ids: Iterable[int] | None = None,
        fmt: str | None = None,
        kind: str | None = None,
    ) -> str:
        """All runs (or `ids`, sweeps with their points) as CSV (one flat row per run: settings.*,
        metrics.*, ...) or JSON (everything, nested). Written to `path` when given; returns the text."""
        if fmt is None:
            fmt = Path(path).suffix.lstrip(".").lower() if path is not None else "json"
        fmt = fmt.lower()
        if fmt not in ("csv", "json"):
            raise ValueError(f"export format must be 'csv' or 'json', got {fmt!r}")
        if ids is None:
            runs = self.list(kind=kind, children=True, limit=None)[::-1]
        else:
            runs = []
            for i in ids:
                run = self.get(i)
                kids = run.pop("children", [])
                runs.append(run)
                runs.extend(kids)
        if fmt == "json":
            for r in runs:
                r.pop("num_children", None)
            text = json.dumps(runs, indent=1, default=json_default)
        else:
            rows = [export_row(r) for r in runs]
            cols = ordered_union(rows, ())
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
            w.writeheader()
            for r in rows:
                w.writerow(r)
            text = buf.getvalue()
        if path is not None:
            Path(path).write_text(text)
        return text


def open_log(db: str | os.PathLike | RunLog | None) -> RunLog:
    """`db` as a RunLog: a path, an open RunLog, or None for the default file."""
    return db if isinstance(db, RunLog) else RunLog(db)
