"""Route requests between models, cheapest first: `route()` returns a `workbench.Engine` over
member engines (`engine.RoutedEngine`), deciding by policy (`policies.py`); `evaluate()` measures
what each threshold costs and what quality it keeps (`evaluate.py`)."""

from __future__ import annotations

from typing import Any

from ..interface import Engine
from .engine import RoutedEngine
from .evaluate import evaluate
from .policies import POLICIES, Classifier

__all__ = ["route", "evaluate", "RoutedEngine", "Classifier", "POLICIES"]


def route(members: dict[str, Any], policy: str = "length", threshold=None, **options) -> RoutedEngine:
    """A `workbench.Engine` over `members` (name -> Engine, or anything `workbench.connect` takes),
    cheapest first. `policy`: "length" | "classifier" | "cascade" | "random" | "fixed";
    `threshold`: one number, or one per boundary between neighbouring members. Options:
    `member` (fixed), `confidence` ("mean" | "min", cascade), `classifier` (a saved file),
    `seed` (random), `name`, `share` (write a router file so that `workbench.connect("router:NAME")`
    attaches from another process; members must then be engine processes or servers)."""
    from ..engines import connect

    if not isinstance(members, dict):
        raise ValueError("route() needs a dict of at least two members, name -> Engine, cheapest first")
    timeout = options.get("timeout", 10.0)
    attached = {n for n, m in members.items() if not isinstance(m, Engine)}
    engines = {n: connect(m, timeout=timeout) if n in attached else m for n, m in members.items()}
    router = RoutedEngine(engines, policy, threshold, **options)
    router._attached |= attached  # detached again by close(); engines given as engines stay
    return router
