"""`SweepResult`: a sweep's records with tables, Pareto fronts, noise report, plots and `apply`."""

import html
from collections.abc import Sequence
from typing import Any

from .grid import COST_COLUMNS, TABLE_COLUMNS


# ----------------------------------------------------------------------------- results
class SweepResult(list):
    """The records of a sweep, one per grid point (a list of dicts), with tables, plots and
    `apply`. Attributes: `engine`, `grid`, `workload` (definition), `run_id` (the run log's sweep
    row), `price_per_hour`, `watts`, `baseline_ppl`, `status`."""

    def __init__(
        self,
        records=(),
        *,
        engine=None,
        grid=None,
        workload=None,
        run_id=None,
        price_per_hour=None,
        watts=None,
        baseline_ppl=None,
        status="completed",
        key=None,
    ):
        super().__init__(records)
        self.engine, self.grid, self.workload, self.run_id = engine, grid, workload, run_id
        self.price_per_hour, self.watts, self.baseline_ppl = price_per_hour, watts, baseline_ppl
        self.status, self.key = status, key

    def __repr__(self) -> str:
        return f"SweepResult({len(self)} points, run_id={self.run_id}, status={self.status!r})"

    def _find(self, point) -> dict:
        if isinstance(point, dict):
            return point
        if isinstance(point, bool):
            raise TypeError("point must be an index, a label or a record")
        if isinstance(point, int):
            return self[point]
        if isinstance(point, str):
            for r in self:
                if r["label"] == point:
                    return r
            raise KeyError(f"no point labelled {point!r}; labels: {[r['label'] for r in self]}")
        raise TypeError("point must be an index, a label or a record")

    def apply(self, point, engine=None) -> dict:
        """Configure the engine with a point's settings (index, label or record); returns the
        effective settings."""
        rec = self._find(point)
        engine = engine if engine is not None else self.engine
        if engine is None:
            raise ValueError("no engine to apply to: pass engine=")
        return engine.configure(**rec["point"])

    def rows(self, columns: Sequence[str] = TABLE_COLUMNS) -> list[dict[str, Any]]:
        keys = list(dict.fromkeys(k for r in self for k in r["point"]))
        rows = []
        for r in self:
            row = {"label": r["label"], **{k: r["point"].get(k) for k in keys}}
            for c in columns:
                v = r.get(c)
                row[c] = ", ".join(v) if isinstance(v, list) else v
            rows.append(row)
        return rows

    def table(self, columns: Sequence[str] = TABLE_COLUMNS):
        """One row per point: its settings and metrics (a DataFrame when pandas is installed)."""
        return _frame(self.rows(columns))

    def cost_table(self):
        """Cost per million output tokens and energy per token, end to end and per phase."""
        return _frame(self.rows(COST_COLUMNS))

    def pareto(self, latency: str | None = None) -> list[dict]:
        """Records on the front: all objectives, or throughput vs `latency` ("ttft_p99_ms", ...)."""
        flag = "pareto" if latency is None else f"pareto_{latency.removesuffix('_ms')}"
        return [r for r in self if r.get(flag)]

    def noise_report(self) -> str:
        lines = []
        for r in self:
            if r.get("noisy"):
                lines.append(
                    f"{r['label']}: throughput {r['output_tok_s_min']:.1f}-{r['output_tok_s_max']:.1f} tok/s "
                    f"overlaps {', '.join(r['overlaps'])}"
                )
        return "\n".join(lines) or "no overlapping spreads"

    def plot(self, **kwargs):
        """Bokeh layout: throughput vs p99 TTFT and vs p99 ITL, fronts highlighted, hover settings."""
        from .plots import pareto_plot

        return pareto_plot(self, **kwargs)

    def widget(self, engine=None):
        """The plot with a point picker and an "Apply to engine" button (ipywidgets)."""
        from .plots import widget

        return widget(self, engine=engine if engine is not None else self.engine)

    def show(self, engine=None) -> None:
        """Display `widget()`: the Pareto plots, a point picker and the "Apply to engine" button."""
        from IPython.display import display

        display(self.widget(engine))

    def _repr_html_(self) -> str:
        rows = self.rows()
        if not rows:
            return "<i>empty sweep</i>"
        cols = list(rows[0])
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join(
            "<tr"
            + (' style="font-weight:bold"' if r.get("pareto") else "")
            + ">"
            + "".join(f"<td>{html.escape(_cell(r[c]))}</td>" for c in cols)
            + "</tr>"
            for r in rows
        )
        return (
            f"<div><b>sweep</b> ({len(self)} points, {self.status}; bold: Pareto front; noisy: throughput spread "
            f"overlaps another point)<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
        )


class Rows(list):
    """Plain row dicts (what `table()` gives without pandas) that render as an HTML table."""

    def _repr_html_(self) -> str:
        if not self:
            return "<i>no rows</i>"
        cols = list(dict.fromkeys(k for r in self for k in r))
        head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in self
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)


def _frame(rows: list[dict]):
    try:
        import pandas as pd
    except ImportError:
        return Rows(rows)
    return pd.DataFrame(rows)


def record_from_row(row: dict) -> dict | None:
    extra = row.get("extra") or {}
    metrics = row.get("metrics") or {}
    if "point" not in extra or not metrics:
        return None
    rec = {
        "index": extra.get("index"),
        "label": extra.get("label"),
        "point": extra["point"],
        **extra["point"],
        **metrics,
        "settings": row.get("settings"),
        "run_id": row["id"],
        "key": row.get("key"),
        "configure_s": extra.get("configure_s"),
        "resumed": True,
    }
    return rec
