"""Runs side by side: throughput and latency of two or more runs from the run log, with the
settings that differ between them.

`comparison(compare(ids))` is pure (no Bokeh): plot columns the notebook (`plot`) and the lab's run
log view both draw, so they show the same thing. A bench run's metrics are per system
("results.workbench.output_tok_s"); a sweep point's and a simulation's are plain keys.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from typing import Any

THROUGHPUT = ("output_tok_s",)
LATENCY = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
NAMES = {
    "output_tok_s": "output tok/s",
    "ttft_p50_ms": "TTFT p50",
    "ttft_p99_ms": "TTFT p99",
    "itl_p50_ms": "ITL p50",
    "itl_p99_ms": "ITL p99",
}
RUN_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


def _metric_name(key: str, base: str) -> str:
    """ "results.workbench.ttft_p50_ms" -> "workbench TTFT p50"; "ttft_p50_ms" -> "TTFT p50"."""
    prefix = key[: -len(base)].rstrip(".")
    system = prefix.split(".", 1)[1] if prefix.startswith("results.") else prefix
    return f"{system} {NAMES[base]}".strip()


def comparison(cmp: dict[str, Any]) -> dict[str, Any]:
    """`RunLog.compare` output -> ``runs`` (one label per run), ``throughput`` and ``latency`` rows
    (one per metric and run: ``metric``, ``run``, ``value``, ``color``) and ``settings``: the
    settings that differ, one row per setting with each run's value."""
    if len(cmp["runs"]) < 2:
        raise ValueError(
            f"compare needs two or more runs (or a sweep with two or more points), got {[r['id'] for r in cmp['runs']]}"
        )
    runs = [run_label(r) for r in cmp["runs"]]
    out: dict[str, Any] = {"runs": runs, "colors": [RUN_COLORS[i % len(RUN_COLORS)] for i in range(len(runs))]}
    for part, bases in (("throughput", THROUGHPUT), ("latency", LATENCY)):
        rows: dict[str, list] = {"metric": [], "run": [], "value": [], "color": []}
        for key, values in cmp["metrics"].items():
            base = next((b for b in bases if key == b or key.endswith("." + b)), None)
            if base is None or not any(_finite(v) for v in values):
                continue
            for i, v in enumerate(values):
                rows["metric"].append(_metric_name(key, base))
                rows["run"].append(runs[i])
                rows["value"].append(float(v) if _finite(v) else None)
                rows["color"].append(out["colors"][i])
        out[part] = rows
    # what to draw: one figure per metric family, each on its own axis (ITL bars are invisible
    # on an axis sized for TTFT)
    ttft = [i for i, m in enumerate(out["latency"]["metric"]) if "ttft" in m.lower()]
    itl = [i for i in range(len(out["latency"]["metric"])) if i not in ttft]
    out["figures"] = [
        f
        for f in (
            {"title": "Output tokens/s (higher is better)", "unit": "tok/s", "rows": out["throughput"]},
            {"title": "Time to first token (lower is better)", "unit": "ms", "rows": _take(out["latency"], ttft)},
            {"title": "Inter-token latency (lower is better)", "unit": "ms", "rows": _take(out["latency"], itl)},
        )
        if f["rows"]["metric"]
    ]
    out["settings"] = [
        {"setting": name, "values": [_show(v) for v in values]} for name, values in cmp["settings"].items()
    ]
    # A caveat only for what is known to differ: a run without a recorded checksum is not "different".
    known = {r.get("weights_checksum") for r in cmp["runs"]} - {None}
    out["same_weights"] = False if len(known) > 1 else None
    out["same_workload"] = cmp.get("same_workload")
    return out


def _take(rows: dict[str, list], idx: list[int]) -> dict[str, list]:
    return {k: [v[i] for i in idx] for k, v in rows.items()}


def run_label(run: dict[str, Any]) -> str:
    """How a run is named beside others: its run-log id, and for a sweep point its number in the
    sweep as the sweep's Pareto plot and `apply` name it ("#5 point 3: max_num_seqs=8")."""
    what = run.get("label") or run.get("kind")
    point = run.get("point")
    return f"#{run['id']} point {point}: {what}" if isinstance(point, int) else f"#{run['id']} {what}"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _show(v: Any) -> str:
    return "–" if v is None else str(v)


def settings_html(comp: dict[str, Any]) -> str:
    """The settings that differ, as an HTML table (a Bokeh Div in a notebook)."""
    caveats = [
        text
        for flag, text in (
            (comp.get("same_workload"), "different workloads"),
            (comp.get("same_weights"), "different weights"),
        )
        if flag is False
    ]
    head = "".join(f"<th style='color:{c}'>{html.escape(r)}</th>" for r, c in zip(comp["runs"], comp["colors"]))
    body = "".join(
        "<tr><td><code>"
        + html.escape(s["setting"])
        + "</code></td>"
        + "".join(f"<td>{html.escape(v)}</td>" for v in s["values"])
        + "</tr>"
        for s in comp["settings"]
    )
    table = (
        f"<table><tr><th>setting</th>{head}</tr>{body}</table>"
        if comp["settings"]
        else "<i>no setting differs between these runs</i>"
    )
    note = f"<p><b>Caution:</b> {' and '.join(caveats)}; the numbers are not like for like.</p>" if caveats else ""
    return f"<b>Settings that differ</b>{table}{note}"


def plot(ids: Iterable[int], *, db=None):
    """Two or more runs side by side (a Bokeh layout): output tokens/s, TTFT/ITL percentiles and the
    settings diff; a sweep's id stands for all its points. In a notebook, a widget (BokehJS from
    the installed bokeh, inline)."""
    from bokeh.layouts import column, row
    from bokeh.models import ColumnDataSource, Div, FactorRange, HoverTool
    from bokeh.plotting import figure

    from .log import open_log

    comp = comparison(open_log(db).compare(list(ids)))  # a sweep's id stands for its points
    figs = []
    for spec in comp["figures"]:
        rows, unit = spec["rows"], spec["unit"]
        x = [(m, r.split(" ")[0]) for m, r in zip(rows["metric"], rows["run"])]  # "#5": full names in the table
        src = ColumnDataSource({**rows, "x": x})
        f = figure(
            x_range=FactorRange(*dict.fromkeys(x), group_padding=0.6),
            height=280,
            width=420,
            title=spec["title"],
            y_axis_label=unit,
            tools="save",
            toolbar_location="above",
        )
        f.vbar(x="x", top="value", width=0.85, color="color", source=src)
        f.add_tools(HoverTool(tooltips=[("run", "@run"), ("metric", "@metric"), ("value", "@value{0.0} " + unit)]))
        f.y_range.start = 0
        figs.append(f)
    layout = column(row(*figs), Div(text=settings_html(comp)))
    try:
        from IPython import get_ipython

        if getattr(get_ipython(), "kernel", None) is None:
            return layout
        from jupyter_bokeh import BokehModel

        from ..bokehjs import ensure_bokehjs
    except ImportError:
        return layout
    ensure_bokehjs()
    return BokehModel(layout)
