"""`workbench runs list|show|compare|export`: the run log (`workbench/runs/`) from a shell.

    workbench runs list [--kind bench|scenario|sweep|sweep_point] [--status S] [--limit N] [--all] [--json]
    workbench runs show ID [--json]
    workbench runs compare ID ID [...] [--json]      # a sweep expands to its points
    workbench runs export [FILE] [--format csv|json] [--ids 3,7] [--kind K]   # stdout without FILE
    workbench runs path                              # where the database is

Every subcommand takes `--db PATH` (default: $WORKBENCH_RUNS_DB or the user data dir).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any


def add_runs_parser(sub: argparse._SubParsersAction) -> None:
    from .log import KINDS

    p = sub.add_parser(
        "runs",
        help="the run log: every bench, scenario and sweep run (list, show, compare, export)",
        description="Every `workbench bench` run (`--scenario` runs too) and every sweep is "
        "recorded in a local SQLite "
        "database with its settings, model, weights checksum, versions, machine, "
        "workload and metrics.",
    )
    rs = p.add_subparsers(dest="runs_command", metavar="SUBCOMMAND")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--db", default=None, metavar="PATH", help="the run-log database (default: the user data dir)")

    q = rs.add_parser("list", help="runs, newest first")
    q.add_argument("--kind", choices=KINDS, default=None)
    q.add_argument("--status", choices=["running", "completed", "interrupted", "failed", "abandoned"], default=None)
    q.add_argument("--limit", type=int, default=50, help="most runs shown (default 50)")
    q.add_argument("--all", action="store_true", help="include sweep points")
    q.add_argument("--json", action="store_true", help="JSON instead of a table")
    common(q)
    q.set_defaults(_runs=_list)

    q = rs.add_parser("show", help="everything recorded about one run")
    q.add_argument("id", type=int)
    q.add_argument("--json", action="store_true")
    common(q)
    q.set_defaults(_runs=_show)

    q = rs.add_parser("compare", help="metrics side by side and the settings that differ")
    q.add_argument("ids", type=int, nargs="+", metavar="ID")
    q.add_argument("--json", action="store_true")
    common(q)
    q.set_defaults(_runs=_compare)

    q = rs.add_parser("export", help="runs as CSV (flat) or JSON (nested)")
    q.add_argument("file", nargs="?", default=None, help="output file (default: stdout)")
    q.add_argument("--format", choices=["csv", "json"], default=None, help="default: from FILE's suffix, else csv")
    q.add_argument("--ids", default=None, help="comma-separated run ids (default: all)")
    q.add_argument("--kind", choices=KINDS, default=None)
    common(q)
    q.set_defaults(_runs=_export)

    q = rs.add_parser("path", help="print the database path")
    common(q)
    q.set_defaults(_runs=_path)

    p.set_defaults(_run=_run_runs, _runs_parser=p)


def _run_runs(args: argparse.Namespace) -> int:
    fn = getattr(args, "_runs", None)
    if fn is None:
        args._runs_parser.print_help()
        return 2
    from .log import RunLog

    log = RunLog(args.db)
    if fn is not _path and not log.path.exists():
        print(f"workbench runs: no run log at {log.path} yet (run `workbench bench` or a sweep first)", file=sys.stderr)
        return 1
    try:
        return fn(args, log) or 0
    except BrokenPipeError:  # `workbench runs list | head`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyError as e:
        print(f"workbench runs: {e.args[0]}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"workbench runs: {e}", file=sys.stderr)
        return 2


def _when(iso: str | None) -> str:
    if not iso:
        return ""
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return iso


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)
    return str(v)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def _list(args, log) -> int:
    from .rows import headline, ratios_text

    runs = log.list(kind=args.kind, status=args.status, limit=args.limit, children=args.all)
    if args.json:
        print(json.dumps(runs, indent=1, default=str))
        return 0
    if not runs:
        print("no runs recorded")
        return 0
    rows = []
    for r in runs:
        h = headline(r)
        label = r.get("label") or ""
        if r["kind"] == "sweep":
            label += f" ({r.get('num_children', 0)} points)"
        rows.append(
            [
                r["id"],
                r["kind"],
                r["status"],
                _when(r["started_at"]),
                r.get("model"),
                r.get("device"),
                label,
                h.get("output_tok_s"),
                h.get("ttft_p99_ms"),
                h.get("itl_p99_ms"),
                h.get("cost_per_mtok"),
                ratios_text(r),
            ]
        )
    headers = [
        "id",
        "kind",
        "status",
        "started",
        "model",
        "device",
        "label",
        "out tok/s",
        "TTFT p99 ms",
        "ITL p99 ms",
        "$/M tok",
        "ratios (targets)",
    ]
    if not any(row[-1] for row in rows):
        headers, rows = headers[:-1], [row[:-1] for row in rows]
    print(table(headers, rows))
    print(f"\n{log.path}")
    return 0


def _show(args, log) -> int:
    from .rows import flatten, ratios_text

    run = log.get(args.id)
    if args.json:
        print(json.dumps(run, indent=1, default=str))
        return 0
    kids = run.pop("children", [])
    print(f"run {run['id']}: {run['kind']} {run.get('label') or ''} [{run['status']}]")
    for k in ("parent_id", "started_at", "finished_at", "model", "weights_checksum", "device", "host", "pid", "error"):
        if run.get(k) is not None:
            print(f"  {k}: {run[k]}")
    if ratios_text(run):
        print(f"  ratios (targets): {ratios_text(run)}")
    for col in ("settings", "workload", "metrics", "versions", "machine", "extra"):
        v = run.get(col)
        if not v:
            continue
        print(f"{col}:")
        flat = flatten({k: x for k, x in v.items() if k not in ("runs", "prompts")}) if isinstance(v, dict) else {"": v}
        for k, x in flat.items():
            print(f"  {k}: {_fmt(x)}")
    if kids:
        print(f"points ({len(kids)}):")
        keys = ("output_tok_s", "ttft_p99_ms", "itl_p99_ms", "cost_per_mtok")
        rows = [[k["id"], k.get("label"), k["status"], *((k.get("metrics") or {}).get(m) for m in keys)] for k in kids]
        print(table(["id", "point", "status", "out tok/s", "TTFT p99 ms", "ITL p99 ms", "$/M tok"], rows))
    return 0


def _compare(args, log) -> int:
    c = log.compare(args.ids)
    if args.json:
        print(json.dumps(c, indent=1, default=str))
        return 0
    runs = c["runs"]
    headers = ["", *[f"#{r['id']}" for r in runs]]
    rows = [
        ["label", *[r.get("label") for r in runs]],
        ["status", *[r.get("status") for r in runs]],
        ["model", *[r.get("model") for r in runs]],
        ["device", *[r.get("device") for r in runs]],
    ]
    rows += [[f"setting {k}", *v] for k, v in c["settings"].items()]
    rows += [[k, *v] for k, v in c["metrics"].items()]
    print(table(headers, rows))
    for p in c.get("predictions") or []:
        errs = ", ".join(f"{k} {v:+.1%}" for k, v in p["error"].items())
        print(f"simulation #{p['simulation']} predicts run #{p['measured']}: {errs or 'no common metrics'}")
    notes = []
    if not c["same_weights"]:
        notes.append("weights checksums differ (or are unknown): different models or weights")
    if not c["same_workload"]:
        notes.append("workloads differ")
    for n in notes:
        print(f"note: {n}")
    return 0


def _export(args, log) -> int:
    ids = [int(x) for x in args.ids.split(",") if x.strip()] if args.ids else None
    fmt = args.format or (args.file.rsplit(".", 1)[-1].lower() if args.file and "." in args.file else "csv")
    text = log.export(args.file, ids=ids, fmt=fmt, kind=args.kind)
    if args.file is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        print(f"wrote {args.file}", file=sys.stderr)
    return 0


def _path(args, log) -> int:
    print(log.path)
    return 0
