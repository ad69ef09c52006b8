"""Bokeh plots of sweep results (Bokeh is imported only when a plot is made).

`pareto_plot(records)`: output tok/s against p99 TTFT and against p99 ITL, side by side, one
marker per grid point with whiskers spanning its repeats (min-max on both axes). Points on the
plot's Pareto front (no other point is both faster and lower-latency) are red and joined by a
dashed line; points whose throughput spread overlaps another point's have an orange ring (their
ranking is inside the noise). Hover shows the point's settings and numbers; both plots share one
data source, so tapping a point selects it in both.

`widget(records, engine)`: the plot, a point picker (tapping a point picks it) and an "Apply to
engine" button (ipywidgets), for one-click "use these settings"; `SweepResult.show()` displays it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FRONT = "#d62728"
OTHER = "#1f77b4"
NOISY = "#ff7f0e"
LATENCY_NAMES = {"ttft_p99_ms": "p99 TTFT", "itl_p99_ms": "p99 ITL", "ttft_p50_ms": "p50 TTFT", "itl_p50_ms": "p50 ITL"}


def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)


def plot_data(records: Sequence[dict], latencies: Sequence[str] = ("ttft_p99_ms", "itl_p99_ms")) -> dict[str, list]:
    """The columns the plot draws (plain lists, testable without Bokeh)."""
    data: dict[str, list] = {
        "index": [],
        "label": [],
        "settings": [],
        "x": [],
        "x_lo": [],
        "x_hi": [],
        "cost": [],
        "joules": [],
        "delta_ppl": [],
        "delta_ppl_text": [],
        "run": [],
        "repeats": [],
        "noise": [],
        "ring": [],
        "ring_width": [],
    }
    for lat in latencies:
        for suffix in ("", "_lo", "_hi", "_color", "_size"):
            data[f"{lat}{suffix}"] = []
    for i, r in enumerate(records):
        x = _num(r.get("output_tok_s"))
        data["index"].append(i)
        data["label"].append(r.get("label", str(i)))
        data["settings"].append(", ".join(f"{k}={v}" for k, v in (r.get("point") or {}).items()))
        data["x"].append(x)
        data["x_lo"].append(_num(r.get("output_tok_s_min", x)))
        data["x_hi"].append(_num(r.get("output_tok_s_max", x)))
        data["cost"].append(_num(r.get("cost_per_mtok")))
        data["joules"].append(_num(r.get("joules_per_token")))
        dppl = _num(r.get("delta_ppl"))
        data["delta_ppl"].append(dppl)
        # measured only where the point is quantised: say so rather than "NaN"
        data["delta_ppl_text"].append(f"{dppl:+.3f}" if dppl == dppl else "not measured (no quantisation)")
        data["run"].append(f"run #{r['run_id']}" if isinstance(r.get("run_id"), int) else "not in the run log")
        data["repeats"].append(r.get("repeats", 1))
        overlaps = r.get("overlaps") or []
        data["noise"].append(("within noise of " + "; ".join(overlaps)) if overlaps else "clear")
        data["ring"].append(NOISY if overlaps else "#333333")
        data["ring_width"].append(3 if overlaps else 1)
        for lat in latencies:
            y = _num(r.get(lat))
            on_front = bool(r.get(f"pareto_{lat.removesuffix('_ms')}"))
            data[lat].append(y)
            data[f"{lat}_lo"].append(_num(r.get(f"{lat}_min", y)))
            data[f"{lat}_hi"].append(_num(r.get(f"{lat}_max", y)))
            data[f"{lat}_color"].append(FRONT if on_front else OTHER)
            data[f"{lat}_size"].append(14 if on_front else 10)
    return data


def whisker_bounds(values: Sequence[float], pad: float = 0.08) -> tuple[float, float] | None:
    """A range that holds every point and whisker end of an axis, padded by `pad` of its span (the
    automatic range counts glyphs only: whiskers past them were clipped). None: nothing finite."""
    v = [x for x in values if x == x and x not in (float("inf"), float("-inf"))]
    if not v:
        return None
    lo, hi = min(v), max(v)
    span = (hi - lo) or abs(hi) or 1.0
    return lo - pad * span, hi + pad * span


def point_name(index: int, record: dict) -> str:
    """A point as every view names it: its number in the sweep, its label and its run-log id."""
    run = f" (run #{record['run_id']})" if isinstance(record.get("run_id"), int) else ""
    return f"point {index}: {record.get('label', index)}{run}"


def front_line(records: Sequence[dict], latency: str) -> tuple[list[float], list[float]]:
    """The front's points in throughput order (for the dashed line)."""
    flag = f"pareto_{latency.removesuffix('_ms')}"
    pts = sorted((_num(r.get("output_tok_s")), _num(r.get(latency))) for r in records if r.get(flag))
    return [p[0] for p in pts], [p[1] for p in pts]


def pareto_plot(
    records: Sequence[dict],
    *,
    latencies: Sequence[str] = ("ttft_p99_ms", "itl_p99_ms"),
    width: int = 460,
    height: int = 360,
    title: str | None = None,
):
    """A Bokeh `row` of one figure per latency metric (see the module doc)."""
    from bokeh.layouts import column, row
    from bokeh.models import ColumnDataSource, Div, HoverTool, Range1d, Whisker
    from bokeh.plotting import figure

    data = plot_data(records, latencies)
    source = ColumnDataSource(data)
    figs = []
    for lat in latencies:
        name = LATENCY_NAMES.get(lat, lat)
        ranges = {}
        for axis, cols in (("x_range", ("x", "x_lo", "x_hi")), ("y_range", (lat, f"{lat}_lo", f"{lat}_hi"))):
            bounds = whisker_bounds([v for c in cols for v in data[c]])
            if bounds is not None:
                ranges[axis] = Range1d(*bounds)
        p = figure(
            **ranges,
            width=width,
            height=height,
            title=f"throughput vs {name}",
            x_axis_label="output tokens/s",
            y_axis_label=f"{name} (ms)",
            tools="pan,wheel_zoom,box_zoom,tap,reset,save",
            toolbar_location="above",
        )
        p.add_layout(
            Whisker(source=source, base=lat, lower="x_lo", upper="x_hi", dimension="width", line_color="#888888")
        )
        p.add_layout(
            Whisker(
                source=source, base="x", lower=f"{lat}_lo", upper=f"{lat}_hi", dimension="height", line_color="#888888"
            )
        )
        xs, ys = front_line(records, lat)
        if xs:
            p.line(xs, ys, line_color=FRONT, line_dash="dashed", line_width=2, legend_label="Pareto front")
        dots = p.scatter(
            "x",
            lat,
            source=source,
            size=f"{lat}_size",
            fill_color=f"{lat}_color",
            line_color="ring",
            line_width="ring_width",
            fill_alpha=0.85,
            selection_fill_color="#2ca02c",
            nonselection_fill_alpha=0.35,
        )
        p.add_tools(
            HoverTool(
                renderers=[dots],
                tooltips=[
                    ("point", "point @index: @label (@run)"),
                    ("output tok/s", "@x{0.0} (repeats: @x_lo{0.0} - @x_hi{0.0})"),
                    (name, f"@{{{lat}}}{{0.0}} ms (@{{{lat}_lo}}{{0.0}} - @{{{lat}_hi}}{{0.0}})"),
                    ("$ / M output tokens", "@cost{0.0000}"),
                    ("J / output token", "@joules{0.000}"),
                    ("delta ppl", "@delta_ppl_text"),
                    ("repeats", "@repeats"),
                    ("noise", "@noise"),
                ],
            )
        )
        if xs:  # beside the plot, not over its points
            p.add_layout(p.legend[0], "right")
            p.legend.location = "top_left"
        figs.append(p)
    note = Div(
        text=(title + " &mdash; " if title else "") + "red: Pareto front; orange ring: throughput spread "
        "overlaps another point (a difference inside the noise); whiskers: min-max over repeats."
    )
    layout = column(note, row(*figs))
    layout.tags = ["workbench-sweep"]
    layout._workbench_source = source  # for show(): tapping a point picks it
    return layout


def widget(records, engine=None):
    """The plot with a point picker and an "Apply to engine" button (an ipywidgets VBox). Without
    ipywidgets, or without jupyter_bokeh for the plot, what can be shown is shown right away and
    the rest returned."""
    layout = pareto_plot(records)
    try:
        import ipywidgets as W
    except ImportError:
        from bokeh.io import output_notebook
        from bokeh.io import show as bshow

        from ..bokehjs import bokeh_resources

        output_notebook(resources=bokeh_resources(), hide_banner=True)  # never a CDN
        bshow(layout)
        print("apply a point with records.apply(index)")
        return layout
    try:
        from jupyter_bokeh.widgets import BokehModel

        from ..bokehjs import ensure_bokehjs

        ensure_bokehjs()  # all of BokehJS, widget models (the Div) included, from the installed bokeh
        plot_widget = BokehModel(layout)
    except ImportError:
        from bokeh.io import output_notebook
        from bokeh.io import show as bshow

        from ..bokehjs import bokeh_resources

        output_notebook(resources=bokeh_resources(), hide_banner=True)  # never a CDN
        bshow(layout)
        plot_widget = None
    best = max(
        range(len(records)),
        key=lambda i: (bool(records[i].get("pareto")), records[i].get("output_tok_s") or 0),
        default=0,
    )
    row, status = point_picker(
        [(point_name(i, r), i) for i, r in enumerate(records)],
        best if records else None,
        lambda i: records.apply(i, engine),
        source=getattr(layout, "_workbench_source", None) if plot_widget is not None else None,
        description="point",
        width="420px",
        button="Apply to engine",
        tooltip="engine.configure(**point settings)",
        target=engine,
        target_name="engine",
        name=lambda i: records[i]["label"],
        done=lambda i: f"applied <b>{records[i]['label']}</b> to the engine",
    )
    return W.VBox([w for w in (plot_widget, row, status) if w is not None])


def point_picker(options, value, apply, *, source, description, width, button, target, target_name, name, done,
                 tooltip=None):  # fmt: skip
    """A Pareto plot's picker row and status line (ipywidgets): a dropdown of `options` (label,
    index), an apply button calling `apply(index)` (disabled without a `target`), tapping a dot of
    `source` picks its index; the status says `done(index)`, or the error naming `name(index)`."""
    import ipywidgets as W

    picker = W.Dropdown(options=options, value=value, description=description, layout=W.Layout(width=width))
    btn = W.Button(description=button, button_style="primary", icon="check", tooltip=tooltip,
                   disabled=target is None or not options)  # fmt: skip
    status = W.HTML("" if target is not None else f"<i>no {target_name} attached: pass {target_name}=</i>")

    def on_click(_=None):
        try:
            apply(picker.value)
        except Exception as e:  # shown, not raised: this runs in a widget callback
            status.value = f"<span style='color:#c00'>could not apply {name(picker.value)}: {e}</span>"
            return
        status.value = done(picker.value)

    btn.on_click(on_click)
    if source is not None:

        def picked(attr, old, new):
            if new:
                picker.value = int(new[0])

        source.selected.on_change("indices", picked)
    return W.HBox([picker, btn]), status
