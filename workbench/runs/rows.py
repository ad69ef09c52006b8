"""A run as the views show it: its metrics flattened to dotted keys, its headline numbers (what
`workbench runs list` shows, and `compare` puts first), a CSV row, and how far a simulation's
prediction missed the run it predicts."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

# Headline metrics shown by `list` and put first by `compare`.
HEADLINE = (
    "output_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "cost_per_mtok",
    "joules_per_token",
)


def ordered_union(dicts: Iterable[dict], first: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    dicts = list(dicts)
    for k in first:
        if any(k in d for d in dicts):
            seen[k] = None
    for d in dicts:
        for k in d:
            seen.setdefault(k, None)
    return list(seen)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys; lists are kept only when short lists of scalars (as JSON)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, list):
            if len(v) <= 8 and all(isinstance(x, (int, float, str, bool)) or x is None for x in v):
                out[key] = json.dumps(v)
        else:
            out[key] = v
    return out


def export_row(run: dict) -> dict[str, Any]:
    row = {
        k: run.get(k)
        for k in (
            "id",
            "kind",
            "parent_id",
            "status",
            "started_at",
            "finished_at",
            "label",
            "model",
            "weights_checksum",
            "device",
            "host",
            "error",
        )
    }
    for col in ("settings", "metrics", "workload", "versions"):
        v = run.get(col)
        if isinstance(v, dict):
            for k, x in flatten({k: x for k, x in v.items() if k != "runs"}).items():
                row[f"{col}.{k}"] = x
    return row


def predictions(runs: list[dict]) -> list[dict[str, Any]]:
    by_id = {r["id"]: r for r in runs}
    out = []
    for r in runs:
        target = by_id.get((r.get("extra") or {}).get("predicts")) if r.get("kind") == "simulation" else None
        if target is None:
            continue
        pred, meas = headline(r), headline(target)
        out.append(
            {
                "simulation": r["id"],
                "measured": target["id"],
                "error": {k: pred[k] / meas[k] - 1 for k in pred if k in meas and meas[k]},
            }
        )
    return out


def headline(run: dict) -> dict[str, Any]:
    """The metrics `list` shows: a sweep point's own, a bench's `workbench` system, a sweep's best,
    a scenario run's ratios (on/off, the peer's, ours vs the peer)."""
    m = run.get("metrics") or {}
    if run.get("kind") == "scenario":
        return {k: v for k, v in (m.get("ratios") or {}).items() if v is not None}
    if run.get("kind") == "bench":
        m = (m.get("results") or {}).get("workbench") or next(iter((m.get("results") or {}).values()), {})
    elif run.get("kind") == "sweep":
        m = m.get("best") or {}
    return {k: m.get(k) for k in HEADLINE if m.get(k) is not None}


def ratios_text(run: dict) -> str:
    """The headline numbers without a column of their own in `list` (a scenario run's ratios), each
    with its target where it has one: `int4_vs_bf16=1.93 (>= 2: no) int4_vs_hf=2.1`."""
    targets = {t.get("name"): t for t in (run.get("metrics") or {}).get("targets") or [] if isinstance(t, dict)}
    parts = []
    for k, v in headline(run).items():
        if k in HEADLINE or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        text = f"{k}={v:.3g}"
        t = targets.get(k)
        if t is not None and isinstance(t.get("target"), (int, float)):
            text += f" (>= {t['target']:g}: {'met' if t.get('met') else 'no'})"
        parts.append(text)
    return " ".join(parts)
