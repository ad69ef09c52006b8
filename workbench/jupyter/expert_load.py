"""`ExpertLoad`: tokens per (MoE layer, expert) over the newest steps, for the dashboard's routing
heatmap, and each layer's imbalance. Pure: fed timelines (or steps) like `TimelineReducer`."""

from __future__ import annotations

from collections import deque
from typing import Any

from ..timeline import expert_totals, imbalance
from .reducer import value_of


class ExpertLoad:
    """Tokens per (MoE layer, expert) over the newest `window` steps, for the routing heatmap, and
    each layer's imbalance. Pure: fed timelines (or steps) like `TimelineReducer`."""

    COLUMNS = ("layer", "expert", "tokens", "share")

    def __init__(self, window: int = 200):
        self.window = int(window)
        self._steps: deque = deque(maxlen=self.window)
        self.cursor = 0

    def add(self, timeline: Any) -> bool:
        """Take the steps newer than the cursor; True when any carried expert counts."""
        changed = False
        for s in value_of(timeline, "steps", None) or []:
            seq = int(value_of(s, "seq", 0))
            if seq and seq <= self.cursor:
                continue
            self.cursor = max(self.cursor, seq)
            counts = value_of(s, "expert_counts", None)
            if counts:
                self._steps.append(counts)
                changed = True
        return changed

    def totals(self) -> list[list[int]]:
        return expert_totals(self._steps)

    def columns(self) -> dict[str, list]:
        """One row per (layer, expert): tokens routed to it in the window and its share of the layer's."""
        cols: dict[str, list] = {c: [] for c in self.COLUMNS}
        for layer, row in enumerate(self.totals()):
            total = sum(row) or 1
            for e, n in enumerate(row):
                cols["layer"].append(layer)
                cols["expert"].append(e)
                cols["tokens"].append(n)
                cols["share"].append(n / total)
        return cols

    def imbalance_by_layer(self) -> list[float]:
        return [imbalance(row) for row in self.totals()]
