"""The settings grid: its points, in the order that re-lays out least, their labels, and the
constants the sweep's parts share."""

import hashlib
import itertools
import json
from collections.abc import Iterable, Sequence
from typing import Any

from ..settings import RELAYOUT, RELOAD, RESTART, setting_kind, setting_names, validate

DEFAULT_WORKLOAD = {"num_requests": 16, "prompt_len": (16, 64), "output_len": (8, 32), "seed": 0, "arrival": "all"}
DEFAULT_MAX_TOKENS = 32  # output length for prompt-list workloads
SPREAD_KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "cost_per_mtok")
QUANT_DEFAULTS = {"quantization": "none", "kv_cache_dtype": "auto"}
TABLE_COLUMNS = (
    "output_tok_s",
    "output_tok_s_min",
    "output_tok_s_max",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "kv_usage_peak",
    "prefix_hit_rate",
    "spec_acceptance_rate",
    "delta_ppl",
    "cost_per_mtok",
    "joules_per_token",
    "pareto",
    "noisy",
    "overlaps",
    "repeats",
    "resumed",
    "source",
)
COST_COLUMNS = (
    "output_tok_s",
    "cost_per_mtok",
    "joules_per_token",
    "prefill_tok_s",
    "prefill_cost_per_mtok",
    "prefill_joules_per_token",
    "decode_tok_s",
    "decode_cost_per_mtok",
    "decode_joules_per_token",
)


# ----------------------------------------------------------------------------- the grid
def grid_points(grid: dict[str, Sequence[Any] | Any]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, validated (names, values, no start-time settings).

    Settings that re-lay out or reload the model vary slowest (outermost), the rest in the order
    given, so a sweep pays for each re-layout once per value."""
    if not isinstance(grid, dict) or not grid:
        raise ValueError("grid must be a non-empty dict of setting name -> list of values")
    names = setting_names()
    values: dict[str, list[Any]] = {}
    for name, vals in grid.items():
        if name not in names:
            raise ValueError(f"unknown setting {name!r} in the grid; known settings: {', '.join(names)}")
        if setting_kind(name) == RESTART:
            raise ValueError(
                f"setting {name!r} is fixed when the engine starts and cannot be swept live; "
                "start one engine per value instead"
            )
        if isinstance(vals, (str, bytes)) or not isinstance(vals, Iterable):
            vals = [vals]
        vals = list(vals)
        if not vals:
            raise ValueError(f"grid entry {name!r} has no values")
        checked = [validate({name: v})[name] for v in vals]
        if len({json.dumps(v) for v in checked}) != len(checked):
            raise ValueError(f"grid entry {name!r} repeats a value: {vals}")
        values[name] = checked
    order = sorted(values, key=lambda n: 0 if setting_kind(n) in (RELAYOUT, RELOAD) else 1)
    return [dict(zip(order, combo)) for combo in itertools.product(*(values[n] for n in order))]


def point_label(point: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items())


def stable_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
