"""Pareto fronts and noise overlap for sweep results (pure functions, no engine needed).

A point is on the front when no other point is at least as good on every objective and strictly
better on one. Objectives are given as (key, "max" | "min"); points are dicts (sweep records).
Points missing an objective (None / NaN) are never on the front and dominate nothing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

Objective = tuple[str, str]  # (key, "max" | "min")


def _value(point: dict, key: str) -> float | None:
    v = point.get(key)
    if v is None:
        return None
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def dominates(a: dict, b: dict, objectives: Sequence[Objective]) -> bool:
    """True when `a` is at least as good as `b` on every objective and strictly better on one."""
    better = False
    for key, sense in objectives:
        if sense not in ("max", "min"):
            raise ValueError(f"objective sense must be 'max' or 'min', got {sense!r}")
        x, y = _value(a, key), _value(b, key)
        if x is None or y is None:
            return False
        if sense == "min":
            x, y = -x, -y
        if x < y:
            return False
        if x > y:
            better = True
    return better


def pareto_front(points: Sequence[dict], objectives: Sequence[Objective]) -> list[int]:
    """Indices (ascending) of the points no other point dominates. Exact duplicates are all kept."""
    if not objectives:
        raise ValueError("give at least one objective")
    ok = [i for i, p in enumerate(points) if all(_value(p, k) is not None for k, _ in objectives)]
    return [i for i in ok if not any(dominates(points[j], points[i], objectives) for j in ok if j != i)]


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """Median, min, max and sample standard deviation of repeated measurements."""
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    if not v:
        return {"median": None, "min": None, "max": None, "std": None}
    return {
        "median": statistics.median(v),
        "min": min(v),
        "max": max(v),
        "std": statistics.stdev(v) if len(v) > 1 else 0.0,
    }


def ranges_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Closed intervals (lo, hi) share at least one value."""
    return a[0] <= b[1] and b[0] <= a[1]


def noise_overlaps(points: Sequence[dict], key: str) -> list[list[int]]:
    """For each point, the indices of the other points whose [min, max] range of `key` over
    repeats (fields `{key}_min`, `{key}_max`) overlaps its own: measurements that cannot be
    told apart from it. A point measured once has a zero-width range."""
    rng: list[tuple[float, float] | None] = []
    for p in points:
        lo, hi = _value(p, f"{key}_min"), _value(p, f"{key}_max")
        if lo is None or hi is None:
            v = _value(p, key)
            rng.append(None if v is None else (v, v))
        else:
            rng.append((lo, hi))
    out = []
    for i, a in enumerate(rng):
        out.append(
            [j for j, b in enumerate(rng) if j != i and a is not None and b is not None and ranges_overlap(a, b)]
        )
    return out


def annotate(
    records: list[dict[str, Any]],
    throughput: str = "output_tok_s",
    latencies: Sequence[str] = ("ttft_p99_ms", "itl_p99_ms"),
) -> None:
    """Set on each record: `pareto` (non-dominated on throughput and every latency), one
    `pareto_<latency>` flag per latency (the two-objective fronts the plots draw), `overlaps`
    (labels of points whose throughput spread overlaps this one) and `noisy` (any overlap)."""
    all_obj = [(throughput, "max")] + [(lat, "min") for lat in latencies]
    front = set(pareto_front(records, all_obj)) if records else set()
    for i, r in enumerate(records):
        r["pareto"] = i in front
    for lat in latencies:
        f = set(pareto_front(records, [(throughput, "max"), (lat, "min")])) if records else set()
        for i, r in enumerate(records):
            r[f"pareto_{lat.removesuffix('_ms')}"] = i in f
    for r, ov in zip(records, noise_overlaps(records, throughput)):
        r["overlaps"] = [records[j].get("label", str(j)) for j in ov]
        r["noisy"] = bool(ov)
