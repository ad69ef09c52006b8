"""Bokeh figures for the reducer's columns, shown through `jupyter_bokeh.BokehModel`.

BokehJS is put on the page once per kernel (`workbench.bokehjs.ensure_bokehjs`): never from a
CDN, so the plots work offline. `TimelineView` owns the column data sources and the layout; `push()`
streams a reducer drain into them (one patch per source that has new rows, each bounded by
the reducer's rollover).
"""

from __future__ import annotations

from typing import Any

from ..bokehjs import ensure_bokehjs
from .reducer import BIN_S, CHANGE_COLOR, COLUMNS, PHASE_COLORS, ROLLOVER, ROW_HALF, SMOOTH_S, STATE_COLORS


class TimelineView:
    """The timeline (steps + request lanes) and four small time series, sharing the x axis.

    ``live=True`` makes the x range follow the newest data over ``window_s`` seconds."""

    def __init__(
        self,
        *,
        live: bool = True,
        window_s: float = 60.0,
        width: int = 900,
        title: str | None = None,
        bin_s: float = BIN_S,
        smooth_s: float = SMOOTH_S,
    ):
        from bokeh.models import ColumnDataSource

        self.live = live
        self.window_s = window_s
        self.width = width
        self.sources = {name: ColumnDataSource({c: [] for c in cols}) for name, cols in COLUMNS.items()}
        self.layout = self._build(title, bin_s, smooth_s)
        self._model = None
        self.pushes = 0

    # -- data -------------------------------------------------------------------------------------
    def push(
        self,
        drained: dict[str, dict[str, list]],
        num_lanes: int | None = None,
        lane_labels: dict[int, str] | None = None,
    ) -> int:
        """Stream new rows into the sources; returns how many sources changed. `lane_labels`
        (the reducer's) name the lanes on the y axis."""
        n = 0
        for name, cols in drained.items():
            if cols and cols[COLUMNS[name][0]]:
                self.sources[name].stream(cols, rollover=ROLLOVER[name])
                n += 1
        if num_lanes is not None and num_lanes + 1 != self._lanes_shown:
            self._set_lanes(num_lanes)
        if lane_labels:
            self._label_lanes(lane_labels)
        self._show_host()
        self.pushes += n
        return n

    def load(
        self, data: dict[str, dict[str, list]], num_lanes: int | None = None, lane_labels: dict[int, str] | None = None
    ) -> None:
        """Replace all rows (a static view, or a reset after the engine restarted)."""
        for name, cols in COLUMNS.items():
            self.sources[name].data = {c: list(data.get(name, {}).get(c, [])) for c in cols}
        if num_lanes is not None:
            self._set_lanes(num_lanes)
        self._label_lanes(lane_labels or {})
        self._show_host()

    def _show_host(self) -> None:
        """The host plot only once there are samples: a finished or simulated run has none (its
        engine's metrics are not sampled), and an empty plot under it says nothing."""
        self.figures["host"].visible = bool(self.sources["host"].data["t"])

    # -- widget -----------------------------------------------------------------------------------
    def widget(self):
        """The `jupyter_bokeh.BokehModel` showing this view (created once)."""
        if self._model is None:
            from jupyter_bokeh import BokehModel

            ensure_bokehjs()
            self._model = BokehModel(self.layout)
        return self._model

    # -- layout -----------------------------------------------------------------------------------
    def _build(self, title: str | None, bin_s: float, smooth_s: float):
        from bokeh.layouts import column, gridplot
        from bokeh.models import DataRange1d, Range1d

        x_range = DataRange1d(range_padding=0.02)
        if self.live:
            x_range.follow = "end"
            x_range.follow_interval = self.window_s
        tools = "xpan,xwheel_zoom,box_zoom,reset,save"
        self._lanes_shown = 1
        self._y_range = Range1d(start=1.6, end=-0.6)  # flipped: steps on top, lanes downwards
        tl = self.timeline_figure = self._timeline(title, x_range, tools)
        self._settings_changes(tl)
        self._legend(tl)

        def small(title: str, y_label: str):
            from bokeh.plotting import figure

            f = figure(
                title=title,
                height=170,
                width=self.width // 2,
                x_range=x_range,
                tools=tools,
                sizing_mode="stretch_width",
                toolbar_location=None,
                y_axis_label=y_label,
            )
            f.title.text_font_size = "9pt"
            return f

        tput = self._throughput(
            small(f"Output tokens/s ({smooth_s:g} s average; dots: each {bin_s:g} s)", "tok/s"), bin_s, smooth_s
        )
        lat = self._latency(small("Latency: TTFT (dots) and inter-token (line)", "ms"))
        kv = self._kv(small("KV-cache blocks used", "blocks"))
        rates = self._rates(small("Prefix hit rate and speculative acceptance", "fraction"))
        host = self._host(small("Host: CPU, memory and KV cache in use", "% of the host"))
        for f in (tput, lat, kv, rates, host):
            self._change_lines(f)
        self.figures = {"timeline": tl, "throughput": tput, "latency": lat, "kv": kv, "rates": rates, "host": host}
        grid = gridplot([[tput, lat], [kv, rates], [host, None]], sizing_mode="stretch_width", toolbar_location=None)
        return column(tl, grid, sizing_mode="stretch_width")

    def _timeline(self, title: str | None, x_range, tools: str):
        """The steps row and one lane per request, with their hovers."""
        from bokeh.models import HoverTool
        from bokeh.plotting import figure

        tl = figure(
            title=title or "Engine steps (top row) and requests (one lane each)",
            height=260,
            width=self.width,
            x_range=x_range,
            y_range=self._y_range,
            tools=tools,
            sizing_mode="stretch_width",
            x_axis_label="seconds",
            toolbar_location="above",
        )
        tl.yaxis.ticker = [0]
        tl.yaxis.major_label_overrides = {0: "steps"}
        tl.ygrid.grid_line_color = None
        steps = tl.quad(
            left="left",
            right="right",
            bottom="bottom",
            top="top",
            color="color",
            source=self.sources["steps"],
            line_color=None,
        )
        lanes = tl.quad(
            left="left",
            right="right",
            bottom="bottom",
            top="top",
            color="color",
            source=self.sources["lanes"],
            line_color=None,
            alpha=0.9,
        )
        tl.add_tools(
            HoverTool(
                renderers=[steps],
                tooltips=[
                    ("step", "@seq (@phase)"),
                    ("time", "@duration_ms{0.0} ms"),
                    ("batch", "@batch_size: @composition"),
                    ("requests", "@requests"),
                    ("tokens", "@prefill_tokens prefill, @decode_tokens decode"),
                    ("prefix hits", "@prefix_hit_tokens tok"),
                    ("drafts kept", "@spec"),  # accepted/proposed, and jump-forward's forced tokens
                    ("KV blocks", "@kv"),
                    ("expert routing", "@routing"),
                    ("time went to", "@parts"),
                    ("bound", "@bound"),  # the step-time target that cut its prefill
                ],
            )
        )
        tl.add_tools(
            HoverTool(
                renderers=[lanes],
                tooltips=[
                    ("request", "@label"),
                    ("id", "@request (lane @lane)"),
                    ("state", "@state"),
                    ("span", "@left{0.000} → @right{0.000} s"),
                    ("tokens", "@tokens"),
                ],
            )
        )
        tl.yaxis.major_label_text_font_size = "8pt"
        return tl

    def _settings_changes(self, tl) -> None:
        """A settings change: a dashed line across every plot, a marker on top (hover: what, who,
        how long), and its re-layout stall hatched in the steps row (zero width for live changes)."""
        from bokeh.models import HoverTool

        changes = self.sources["changes"]
        tl.quad(
            left="t",
            right="end",
            bottom=-ROW_HALF,
            top=ROW_HALF,
            source=changes,
            fill_color=PHASE_COLORS["relayout"],
            hatch_pattern="/",
            hatch_color="white",
            line_color=None,
        )
        self._change_lines(tl)
        marks = tl.scatter(x="t", y=-0.5, marker="inverted_triangle", size=11, color="color", source=changes)
        tl.add_tools(
            HoverTool(
                renderers=[marks],
                tooltips=[
                    ("changed", "@label"),
                    ("by", "@by"),
                    ("applied in", "@apply_ms{0.0} ms"),
                    ("at", "@t{0.000} s"),
                ],
            )
        )

    def _legend(self, tl) -> None:
        """Legend swatches: glyphs of one NaN row each (never drawn on the plot; BokehJS draws no
        swatch for a glyph without rows)."""
        from bokeh.models import Legend, LegendItem

        nan = [float("nan")]
        legend_items = []
        for state, color in {**{"queued": STATE_COLORS["queued"]}, **PHASE_COLORS}.items():
            r = tl.quad(left=nan, right=nan, bottom=nan, top=nan, color=color)
            legend_items.append(LegendItem(label=state, renderers=[r]))
        swatch = tl.scatter(x=nan, y=nan, marker="inverted_triangle", size=9, color=CHANGE_COLOR)
        legend_items.append(LegendItem(label="settings change", renderers=[swatch]))
        tl.add_layout(
            Legend(
                items=legend_items,
                orientation="horizontal",
                location="top_left",
                label_text_font_size="8pt",
                glyph_height=10,
                glyph_width=10,
                spacing=4,
                padding=2,
                margin=2,
                background_fill_alpha=0.6,
            ),
            "above",
        )

    def _throughput(self, tput, bin_s: float, smooth_s: float):
        from bokeh.models import DataRange1d, HoverTool

        series = self.sources["series"]
        tput_line = tput.line("t", "tok_s_avg", source=series, line_width=2, color=PHASE_COLORS["decode"])
        tput_dots = tput.scatter("t", "tok_s", source=series, size=3, color=PHASE_COLORS["decode"], alpha=0.35)
        tput.y_range = DataRange1d(renderers=[tput_line, tput_dots], start=0)
        tput.add_tools(
            HoverTool(
                renderers=[tput_line],
                tooltips=[
                    ("t", "@t{0.0} s"),
                    (f"tok/s, {smooth_s:g} s average", "@tok_s_avg{0.0}"),
                    (f"tok/s in this {bin_s:g} s", "@tok_s{0.0}"),
                    ("running", "@running"),
                    ("waiting", "@waiting"),
                ],
                mode="vline",
            )
        )
        return tput

    def _latency(self, lat):
        from bokeh.models import DataRange1d, HoverTool

        series = self.sources["series"]
        ttft = lat.scatter(
            "t", "ttft_ms", source=self.sources["ttft"], size=6, color=PHASE_COLORS["prefill"], legend_label="TTFT"
        )
        itl = lat.line("t", "itl_ms", source=series, line_width=2, color=PHASE_COLORS["verify"], legend_label="ITL")
        lat.y_range = DataRange1d(renderers=[ttft, itl])
        lat.legend.location = "top_left"
        lat.legend.label_text_font_size = "8pt"
        lat.add_tools(HoverTool(tooltips=[("request", "@request"), ("TTFT", "@ttft_ms{0} ms")]))
        return lat

    def _kv(self, kv):
        from bokeh.models import DataRange1d, HoverTool

        series = self.sources["series"]
        used = kv.varea(x="t", y1=0, y2="kv_used", source=series, alpha=0.4, color=PHASE_COLORS["mixed"])
        kv.line("t", "kv_used", source=series, color=PHASE_COLORS["mixed"])
        kv.y_range = DataRange1d(renderers=[used], start=0)  # scale to what is used; the total is in the hover
        kv.add_tools(HoverTool(tooltips=[("t", "@t{0.0} s"), ("used", "@kv_used / @kv_total")], mode="vline"))
        return kv

    def _rates(self, rates):
        from bokeh.models import Range1d

        series = self.sources["series"]
        rates.y_range = Range1d(-0.02, 1.05)
        rates.line(
            "t",
            "prefix_hit_rate",
            source=series,
            line_width=2,
            color=PHASE_COLORS["prefill"],
            legend_label="prefix hits",
        )
        rates.scatter("t", "prefix_hit_rate", source=series, size=4, color=PHASE_COLORS["prefill"])
        rates.line(
            "t",
            "spec_accept_rate",
            source=series,
            line_width=2,
            color=PHASE_COLORS["verify"],
            legend_label="spec accepted",
        )
        rates.scatter("t", "spec_accept_rate", source=series, size=4, color=PHASE_COLORS["verify"])
        rates.legend.location = "bottom_left"
        rates.legend.label_text_font_size = "8pt"
        return rates

    def _host(self, host):
        from bokeh.models import HoverTool, Range1d

        host.y_range = Range1d(-2, 102)
        hs = self.sources["host"]
        for col, label, color in (
            ("engine_cpu_pct", "engine CPU", PHASE_COLORS["prefill"]),
            ("host_cpu_pct", "host CPU", PHASE_COLORS["mixed"]),
            ("host_mem_pct", "host memory", PHASE_COLORS["relayout"]),
            ("kv_pct", "KV cache", PHASE_COLORS["decode"]),
        ):
            host.line("t", col, source=hs, line_width=2, color=color, legend_label=label)
        host.add_tools(
            HoverTool(
                tooltips=[
                    ("t", "@t{0.0} s"),
                    ("engine CPU", "@engine_cpu_pct{0.0} % of the host"),
                    ("host CPU", "@host_cpu_pct{0.0} %"),
                    ("host memory", "@host_mem_pct{0.0} %"),
                    ("engine memory", "@engine_rss_mb{0,0} MiB"),
                    ("KV cache", "@kv_pct{0.0} %"),
                ],
                mode="vline",
            )
        )
        host.legend.location = "top_left"
        host.legend.label_text_font_size = "8pt"
        host.legend.orientation = "horizontal"
        return host

    def _change_lines(self, fig) -> None:
        """Settings changes as vertical lines (past any y range; each plot's range ignores them)."""
        fig.segment(
            x0="t",
            x1="t",
            y0=-1e9,
            y1=1e9,
            source=self.sources["changes"],
            color="color",
            line_dash="dashed",
            line_width=1.5,
            alpha=0.8,
        )

    def _set_lanes(self, num_lanes: int) -> None:
        lanes = max(1, num_lanes)
        self._lanes_shown = lanes + 1
        self._y_range.start = lanes + 0.6
        self._y_range.end = -0.6
        self.timeline_figure.height = int(min(620, 90 + 22 * (lanes + 1)))

    def _label_lanes(self, lane_labels: dict[int, str]) -> None:
        """Name each lane (y = lane + 1) after the request that took it last."""
        overrides = {0: "steps", **{lane + 1: text for lane, text in lane_labels.items()}}
        axis = self.timeline_figure.yaxis[0]
        if axis.major_label_overrides != overrides:
            axis.ticker = sorted(overrides)
            axis.major_label_overrides = overrides


def static_timeline(
    data: dict[str, dict[str, list]],
    num_lanes: int,
    *,
    title: str | None = None,
    lane_labels: dict[int, str] | None = None,
):
    """A finished timeline (for `%timeline` and `%%generate --timeline`) as a BokehModel."""
    view = TimelineView(live=False, title=title)
    view.load(data, num_lanes, lane_labels)
    return view


def merge(a: dict[str, dict[str, list]], b: dict[str, dict[str, list]]) -> dict[str, dict[str, list]]:
    """Append drained rows `b` to `a` (both {source: {column: [..]}})."""
    for name, cols in b.items():
        into = a.setdefault(name, {c: [] for c in COLUMNS[name]})
        for c, values in cols.items():
            into[c].extend(values)
    return a


def to_columns(reducer: Any) -> dict[str, dict[str, list]]:
    """Everything a reducer has not handed out yet, with empty sources filled in."""
    out = reducer.empty()
    merge(out, reducer.drain())
    return out


class ExpertHeatmap:
    """The routing heatmap of a mixture-of-experts model: tokens per (layer, expert) over the recent
    steps (`expert_load.ExpertLoad`), shaded by each expert's share of its layer; the title gives the
    worst layer's imbalance (max / mean tokens per expert)."""

    ROW_PX = 36  # per MoE layer: a row a person can hover
    FRAME_PX = 110  # title, expert axis and its label

    def __init__(self, width: int = 900):
        from bokeh.models import (
            ColorBar,
            ColumnDataSource,
            HoverTool,
            LinearColorMapper,
            SingleIntervalTicker,
        )
        from bokeh.plotting import figure

        from .expert_load import ExpertLoad

        self.source = ColumnDataSource({c: [] for c in ExpertLoad.COLUMNS})
        self.mapper = LinearColorMapper(palette="Viridis256", low=0.0, high=0.5)
        self.figure = figure(
            title="Expert routing (recent steps)",
            height=self.FRAME_PX + self.ROW_PX,
            width=width,
            tools="hover,save",
            x_axis_label="expert",
            y_axis_label="MoE layer",
            y_range=(-0.5, 0.5),
        )
        self.figure.rect(
            x="expert",
            y="layer",
            width=0.95,
            height=0.95,
            source=self.source,
            fill_color={"field": "share", "transform": self.mapper},
            line_color=None,
        )
        # layers and experts are whole numbers: one tick each, never -0.5 or 1.5
        for axis in (self.figure.xaxis, self.figure.yaxis):
            axis.ticker = SingleIntervalTicker(interval=1, num_minor_ticks=0)
        self.figure.grid.visible = False
        self.figure.add_layout(
            ColorBar(
                color_mapper=self.mapper,
                title="share of the layer's tokens",
                width=10,
                title_text_font_size="10px",
                major_label_text_font_size="10px",
            ),
            "right",
        )
        self.figure.select_one(HoverTool).tooltips = [
            ("layer", "@layer"),
            ("expert", "@expert"),
            ("tokens", "@tokens"),
            ("share", "@share{0.0%}"),
        ]
        self._model = None

    def update(self, columns: dict[str, list], imbalances: list[float]) -> None:
        self.source.data = columns
        layers = max(columns["layer"], default=0) + 1
        self.figure.y_range.start, self.figure.y_range.end = -0.5, layers - 0.5
        self.figure.height = int(min(640, self.FRAME_PX + self.ROW_PX * layers))
        shares = columns["share"]
        self.mapper.high = max(max(shares, default=0.0), 1e-6)
        worst = max(((v, i) for i, v in enumerate(imbalances) if v == v), default=None)
        if worst is not None:
            self.figure.title.text = (
                f"Expert routing over the recent steps · worst imbalance {worst[0]:.2f}x "
                f"(layer {worst[1]}; 1.0x is even)"
            )

    def widget(self):
        if self._model is None:
            from jupyter_bokeh import BokehModel

            ensure_bokehjs()
            self._model = BokehModel(self.figure)
        return self._model
