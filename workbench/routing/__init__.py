"""Route requests between models, cheapest first: `route()` returns a `workbench.Engine` over
member engines (`engine.RoutedEngine`), deciding by policy (`policies.py`); `evaluate()` measures
what each threshold costs and what quality it keeps (`evaluate.py`)."""

from __future__ import annotations

from typing import Any

from .engine import RoutedEngine
from .evaluate import evaluate
from .policies import POLICIES, Classifier

__all__ = ["route", "evaluate", "RoutedEngine", "Classifier", "POLICIES"]


def route(members: dict[str, Any], policy: str = "length", threshold=None, **options) -> RoutedEngine:
    """A `workbench.Engine` over `members` (name -> Engine, or anything `workbench.connect` takes),
    cheapest first. `policy`: "length" | "classifier" | "cascade" | "random" | "fixed";
    `threshold`: one number, or one per boundary between neighbouring members. Options:
    `member` (fixed), `confidence` ("mean" | "min", cascade), `classifier` (a saved file),
    `seed` (random), `name`."""
    return RoutedEngine(members, policy, threshold, **options)
