"""`%dashboard`: a control for every live setting, bound to the engine, over live Bokeh plots.

Controls are generated from the engine's `schema()` (every setting that is not fixed at start).
A change runs `configure` on a worker thread (a re-layout may take seconds; the kernel loop keeps
drawing meanwhile); a rejected change puts the control back and says why. The engine announces
every applied change to every client, so a change made in another notebook, the lab panel or
through `configure()` shows here too.

Engine events arrive on the client's event thread and are queued; `pump()` (an asyncio task on
the kernel loop, `hz` times a second) feeds them to the reducer and streams one batch per plot
source, so many requests in flight cost a bounded number of IOPub messages. When the engine
goes away the dashboard says so and reconnects when an engine of the same name is back.
"""

from __future__ import annotations

import asyncio
import html
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..events import EVENT_KINDS
from ..settings import STATUS_SETTINGS
from .expert_load import ExpertLoad
from .reducer import TimelineReducer
from .session import EngineSession, _local_name, get_session
from .views import TimelineView

_OPEN: list[Dashboard] = []


def control_for(entry: dict[str, Any]):
    """An ipywidgets control for one `settings.schema()` entry."""
    import ipywidgets as w

    name, kind = entry["name"], entry["kind"]
    tip = f"{name}: {entry.get('help', '')} [{kind}]"
    style = {"description_width": "170px"}
    layout = w.Layout(width="330px")
    common = dict(description=entry.get("label", name), tooltip=tip, style=style, layout=layout)
    default = entry.get("default")
    if entry.get("values"):
        options = [(str(v), v) for v in entry["values"]]
        value = default if default in entry["values"] else entry["values"][0]
        return w.Dropdown(options=options, value=value, **common)
    if entry["type"] == "bool":
        return w.Checkbox(value=bool(default), indent=False, **{**common, "style": {}})
    if entry["type"] == "int" and not entry.get("allow_none"):
        lo = entry.get("min")
        hi = entry.get("max")
        return w.BoundedIntText(
            value=int(default if default is not None else (lo or 0)),
            min=lo if lo is not None else -(1 << 31),
            max=hi if hi is not None else (1 << 31),
            continuous_update=False,
            **common,
        )
    return w.Text(
        value="" if default is None else str(default),
        placeholder="None" if entry.get("allow_none") else "",
        continuous_update=False,
        **common,
    )


def _to_widget(control, value):
    import ipywidgets as w

    if isinstance(control, w.Text):
        return "" if value is None else str(value)
    return value


def _from_widget(control, value, name: str | None = None):
    import ipywidgets as w

    if isinstance(control, w.Text):
        if name is not None:  # typed as `%engine set` types it ("None", "4", ...)
            from ..settings import parse_value

            try:
                return parse_value(name, value.strip() or "None")
            except ValueError:
                return value.strip() or None  # configure names what is wrong and what is allowed
        return value.strip() or None
    return value


class Dashboard:
    """Controls + live plots for one engine. `display(dash)` or `%dashboard` shows it."""

    def __init__(
        self,
        session: EngineSession | None = None,
        *,
        client=None,
        hz: float = 10.0,
        window_s: float = 60.0,
        history_s: float | None = 30.0,
        start: bool = True,
    ):
        import ipywidgets as w

        self.session = session or get_session()
        self.client = client or self.session.require()
        self.name = self.client.name
        self.hz = float(hz)
        self.window_s = window_s
        self._events: deque = deque(maxlen=100_000)
        self._lock = threading.Lock()
        self._syncing = False
        self._settings: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}  # sent, not yet answered: the control stays disabled
        self._requested: dict[str, Any] = {}  # sent by this dashboard, until its settings event is seen
        self._relayouts: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="workbench-configure")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._sub = None
        self._gone_since: float | None = None
        self._attached_pid: int | None = None
        self._next_reconnect = 0.0
        self.closed = False
        self.configure_calls: list[dict[str, Any]] = []  # what this dashboard sent (tests, debugging)
        self.messages: list[str] = []

        self.reducer = TimelineReducer()
        from ..tuning.costs import LiveCosts  # $/M tokens and J/token, prefill and decode

        self.costs = LiveCosts(device=str((getattr(self.client, "engine_info", None) or {}).get("device", "cpu")))
        self.view = TimelineView(live=True, window_s=window_s)
        order = {"live": 0, "relayout": 1, "reload": 2}  # live first; fixed-at-start ones get no control

        def kind(e):  # a remote's entries are kind "read-only", with the engine's kind beside it
            return e.get("engine_kind", e["kind"])

        # the headline toggles first (batching, KV cache, prefix caching, quantisation, speculative)
        self.schema = sorted(
            (e for e in self.client.schema() if kind(e) in order),
            key=lambda e: -1 if e.get("headline") else order[kind(e)],
        )
        self.controls: dict[str, Any] = {}
        # A remote server reports settings it cannot change: shown, never editable.
        self._read_only = {e["name"] for e in self.schema if e.get("read_only")}
        for entry in self.schema:
            c = control_for(entry)
            c.disabled = entry["name"] in self._read_only
            c.observe(self._on_control, names="value")
            self.controls[entry["name"]] = c
        self.header = w.HTML()
        self.kernels = w.HTML(value="")  # which kernels serve and why (status() kernel_variant, compute_path)
        self.status = w.HTML(value="")
        self.metrics_line = w.HTML(value="")
        # A cluster (workbench.cluster): which replica the controls change (all, one at a time, or
        # one), and the router's policy; the timeline shows every replica in a band of its own.
        self.replica_picker = self.router_picker = None
        cluster_controls = []
        if hasattr(self.client, "replicas") and hasattr(self.client, "router"):
            from ..cluster import POLICIES

            names = [r["name"] for r in self.client.replicas()]
            style = {"description_width": "150px"}
            self.replica_picker = w.Dropdown(
                options=[("every replica", None)] + [(n, n) for n in names],
                value=None,
                description="Replica",
                style=style,
                layout=w.Layout(width="330px"),
                tooltip="the replica the controls change (every replica: one at a time)",
            )
            self.replica_picker.observe(self._on_replica, names="value")
            self.router_picker = w.Dropdown(
                options=list(POLICIES),
                value=self.client.router.policy,
                description="Router",
                style=style,
                layout=w.Layout(width="330px"),
            )
            self.router_picker.observe(self._on_router, names="value")
            cluster_controls = [self.replica_picker, self.router_picker]
        grid = w.GridBox(
            cluster_controls + list(self.controls.values()),
            layout=w.Layout(grid_template_columns="repeat(auto-fill, 340px)", grid_gap="2px 8px"),
        )
        self.experts = ExpertLoad()
        self._routing_pending = False
        self.heatmap = None  # an ExpertHeatmap once the engine reports expert routing (MoE models)
        self.widget = w.VBox([self.header, self.kernels, grid, self.status, self.metrics_line, self.view.widget()])
        self._attach(self.client, history_s)
        _OPEN.append(self)
        if start:
            self.start()

    # -- display --------------------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    # -- engine attachment ----------------------------------------------------------------------
    def _attach(self, client, history_s: float | None) -> None:
        self.client = client
        self.name = client.name
        self._apply_settings(client.settings(), source=None)
        info = client.engine_info or {}
        what = (
            f"Cluster {html.escape(self.name)}</b> ({info['num_replicas']} replicas)"
            if info.get("cluster")
            else f"Engine {html.escape(self.name)}</b>"
        )
        self.header.value = (
            f"<b>{what} · {html.escape(str(info.get('model')))} on "
            f"{html.escape(str(info.get('device')))} · pid {client.pid}"
        )
        self._refresh_kernels()
        if history_s:
            tl = client.timeline()
            cutoff = time.monotonic() - history_s
            tl.steps = [s for s in tl.steps if s.end >= cutoff]
            tl.requests = [r for r in tl.requests if r.time >= cutoff]
            self.reducer.add(tl)
            self._routing_pending = self.experts.add(tl)
        else:
            self.reducer.cursor = client.timeline(since=1 << 62).cursor
            self.experts.cursor = self.reducer.cursor
        self._sub = client.on_event(self._events.append, kinds=EVENT_KINDS)
        self._gone_since = None
        self._attached_pid = client.pid

    def _detach(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                sub.close()
            except Exception:
                pass

    def _check_engine(self, now: float) -> bool:
        """False while the engine is gone (after saying so); re-attaches as soon as an engine holds
        the name again: a reconnecting client revives in place (its pid changes), otherwise a new
        client is connected by name."""
        client = self.client
        if client.alive:
            if self._gone_since is None and client.pid == self._attached_pid:
                return True
            return self._reattach(client)
        if self._gone_since is None:
            self._gone_since = now
            self._detach()
            self._set_status(
                f"Engine {self.name!r} is gone (stopped or restarted). Waiting for an engine named "
                f"{self.name!r} to come back; start one with `%engine start`.",
                "error",
            )
            for c in self.controls.values():
                c.disabled = True
            # the old engine's numbers are not current any more
            self.metrics_line.value = (
                '<span style="font-size: 12px; color: var(--jp-ui-font-color2, #555);">'
                f"no engine: the numbers of pid {client.pid} are gone with it</span>"
            )
        if now < self._next_reconnect:
            return False
        self._next_reconnect = now + 1.0
        from ..ipc import connection as conn

        try:
            if not _local_name(self.name) or conn.live_engine(self.name) is None:
                return False
            if self.session.name == self.name:
                client = self.session.client()
            else:
                from ..engines import connect

                client = connect(self.name, timeout=5)
            if client is None:
                return False
        except Exception as e:  # still starting, or gone again
            self._set_status(f"Engine {self.name!r} is gone; reconnecting failed: {e}", "error")
            return False
        return self._reattach(client)

    def _reattach(self, client) -> bool:
        """Follow the name to the engine now holding it: a fresh timeline, its settings, its events."""
        self._detach()
        self._events.clear()  # the old engine's last events
        try:
            self.reducer = TimelineReducer(t0=self.reducer.t0)
            self.view.load(TimelineReducer.empty(), 1)
            self._attach(client, history_s=None)
        except Exception as e:  # gone again while attaching
            self._gone_since = self._gone_since or time.monotonic()
            self._set_status(f"Engine {self.name!r} is gone; reconnecting failed: {e}", "error")
            return False
        for name, c in self.controls.items():
            c.disabled = name in self._read_only
        self._set_status(f"Reconnected to engine {self.name!r} (pid {self.client.pid}).", "ok")
        return True

    # -- the feed ---------------------------------------------------------------------------------
    def start(self) -> bool:
        """Run `pump()` hz times a second as an asyncio task on this thread's running loop (the
        kernel's); False when there is none (then call `pump()` yourself)."""
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            try:
                loop = asyncio.get_event_loop()
            except RuntimeError:
                return False
            if not loop.is_running():
                return False
            self._loop = loop
        self._task = self._loop.create_task(self._run())
        return True

    async def _run(self) -> None:
        period = 1.0 / self.hz
        while not self.closed:
            try:
                self.pump()
            except Exception as e:  # keep the feed alive; say what went wrong
                self._set_status(f"dashboard update failed: {type(e).__name__}: {e}", "error")
            await asyncio.sleep(period)

    def pump(self) -> int:
        """Apply queued engine events; stream new plot rows. Returns the number of sources
        updated (each is one Bokeh patch, i.e. a few IOPub messages)."""
        now = time.monotonic()
        if not self._check_engine(now):
            return 0
        events = []
        while True:
            try:
                events.append(self._events.popleft())
            except IndexError:
                break
        last_metrics = None
        routed, self._routing_pending = self._routing_pending, False
        for ev in events:
            if ev.kind == "timeline":
                self.reducer.add(ev.data)
                self.costs.add(ev.data)
                routed = self.experts.add(ev.data) or routed
            elif ev.kind == "settings":
                picked = self.replica_picker.value if self.replica_picker is not None else None
                if picked is None or ev.data.get("replica") in (None, picked):  # a cluster: the replica shown
                    self._apply_settings(
                        ev.data.get("settings", {}), source=ev.data.get("changes", {}), by=ev.data.get("by", "")
                    )
            elif ev.kind == "relayout":
                self._on_relayout(ev.data)
            elif ev.kind == "metrics":
                last_metrics = ev.data
                self.reducer.add_metrics(ev.data, ev.time)
            elif ev.kind == "engine" and ev.data.get("state") == "stopped":
                self._set_status(f"Engine {self.name!r} is stopping.", "error")
        if last_metrics is not None:
            self._show_metrics(last_metrics)
        if routed:
            self._show_routing()
        self.reducer.tick(now)
        drained = self.reducer.drain()
        return self.view.push(drained, self.reducer.num_lanes, self.reducer.lane_labels) if drained else 0

    def _show_routing(self) -> None:
        if self.heatmap is None:
            from .views import ExpertHeatmap

            self.heatmap = ExpertHeatmap()
            self.widget.children = (*self.widget.children, self.heatmap.widget())
        self.heatmap.update(self.experts.columns(), self.experts.imbalance_by_layer())

    # -- settings ---------------------------------------------------------------------------------
    def _apply_settings(self, settings: dict[str, Any], source: dict[str, Any] | None, by: str = "") -> None:
        """Show the engine's settings in the controls (without sending them back)."""
        self._settings.update(settings)
        self._syncing = True
        try:
            for name, c in self.controls.items():
                if name in settings and name not in self._pending:
                    v = _to_widget(c, settings[name])
                    if c.value != v:
                        c.value = v
        finally:
            self._syncing = False
        if source and STATUS_SETTINGS & source.keys():
            self._refresh_kernels()
        if source:
            # The event can come after the call's answer: what this dashboard asked for is
            # remembered until then, so its own change is never reported as someone else's.
            mine = all(self._requested.get(k, object()) == v for k, v in source.items())
            if not mine:
                text = ", ".join(f"{k}={v!r}" for k, v in source.items())
                self._set_status(f"Changed by {by or 'another client'}: {text}", "info")
            for k in source:
                self._requested.pop(k, None)

    def _on_control(self, change: dict[str, Any]) -> None:
        if self._syncing or self.closed:
            return
        control = change["owner"]
        name = next(k for k, c in self.controls.items() if c is control)
        value = _from_widget(control, change["new"], name)
        if self._settings.get(name) == value:
            return
        self._pending[name] = value
        self._requested[name] = value
        control.disabled = True
        self._set_status(f"Applying {name}={value!r}…", "info")
        self.configure_calls.append({name: value})
        client = self.client
        replica = self.replica_picker.value if self.replica_picker is not None else None
        fut = self._pool.submit(self._configure, client, name, value, replica)
        fut.add_done_callback(lambda f, n=name, v=value: self._call_back(self._configured, n, v, f))

    @staticmethod
    def _configure(client, name: str, value: Any, replica: str | None = None) -> tuple[float, dict]:
        t0 = time.monotonic()
        settings = client.configure(**{name: value}, **({"replica": replica} if replica else {}))
        return time.monotonic() - t0, settings

    def _on_replica(self, change: dict[str, Any]) -> None:
        """Show the chosen replica's settings in the controls (every replica: the first's)."""
        name = change["new"]
        target = self.client.replica(name) if name else self.client
        fut = self._pool.submit(target.settings)
        fut.add_done_callback(
            lambda f: self._call_back(
                lambda: self._apply_settings(f.result(), source=None) if f.exception() is None else None
            )
        )

    def _on_router(self, change: dict[str, Any]) -> None:
        if self._syncing or self.closed:
            return
        policy = change["new"]
        self.configure_calls.append({"router": policy})
        fut = self._pool.submit(self.client.configure, router=policy)
        fut.add_done_callback(
            lambda f: self._call_back(
                self._set_status,
                f"Router: {policy}" if f.exception() is None else f"Router: {f.exception()}",
                "ok" if f.exception() is None else "error",
            )
        )

    def _refresh_kernels(self) -> None:
        """Ask the engine which kernels serve now (off the display loop: it is a round trip)."""
        fut = self._pool.submit(self.client.status)
        fut.add_done_callback(lambda f: self._call_back(self._show_kernels, f))

    def _show_kernels(self, fut) -> None:
        try:
            st = fut.result()
        except Exception:  # the engine is going away; the status line says so
            return
        self.kernels.value = kernels_line(st)

    def _call_back(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and loop.is_running() and not _on_loop_thread(loop):
            loop.call_soon_threadsafe(fn, *args)
        else:
            fn(*args)

    def _configured(self, name: str, value: Any, fut) -> None:
        control = self.controls[name]
        self._pending.pop(name, None)
        control.disabled = name in self._read_only
        try:
            took, settings = fut.result()
        except Exception as e:
            self._requested.pop(name, None)
            self._syncing = True
            try:
                control.value = _to_widget(control, self._settings.get(name))
            finally:
                self._syncing = False
            self._set_status(f"Rejected {name}={value!r}: {e}", "error")
            return
        self._apply_settings(settings, source=None)
        self._set_status(f"Applied {name}={value!r} ({took * 1e3:.0f} ms; takes effect at the next step).", "ok")

    def _on_relayout(self, data: dict[str, Any]) -> None:
        name, state = data.get("setting"), data.get("state")
        c = self.controls.get(name)
        if state == "started":
            self._relayouts[name] = time.monotonic()
            if c is not None:
                c.disabled = True
            self._set_status(f"Re-layout: {name} → {data.get('value')!r} in progress… (requests are kept)", "info")
        elif state == "done":
            t0 = self._relayouts.pop(name, None)
            if c is not None and name not in self._pending:
                c.disabled = name in self._read_only
            took = f" in {time.monotonic() - t0:.1f} s" if t0 else ""
            self._set_status(f"Re-layout: {name} → {data.get('value')!r} done{took}.", "ok")

    def _set_status(self, text: str, level: str = "info") -> None:
        self.messages.append(text)
        del self.messages[:-50]
        color = {"ok": "#2a7a2a", "error": "#b00020", "info": "var(--jp-ui-font-color1, #333)"}[level]
        self.status.value = f'<span style="color: {color}; font-size: 12px;">{html.escape(text)}</span>'

    def _show_metrics(self, m: dict[str, Any]) -> None:
        self.metrics_line.value = (
            '<span style="font-size: 12px; color: var(--jp-ui-font-color2, #555);">'
            f"{html.escape(metrics_text(m, self._settings))}{html.escape(step_time_text(m))}<br>"
            f"{html.escape(self.costs.html(m))}</span>"
        )

    # -- teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._task is not None:
            self._task.cancel()
        self._detach()
        self._pool.shutdown(wait=False)
        try:
            self.widget.close()
        except Exception:
            pass
        if self in _OPEN:
            _OPEN.remove(self)


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def open_dashboards() -> list[Dashboard]:
    return list(_OPEN)


def metrics_text(m: dict[str, Any], settings: dict[str, Any]) -> str:
    """The dashboard's line of numbers, each with the window it is over (the plots show their own):
    rates over the last `window_s`, latencies over the last finished requests, cache rates since the
    engine started; the speculative acceptance only while speculative decoding is on."""
    window = m.get("window_s") or 10
    parts = [
        f"{m.get('output_tok_s', 0):.1f} tok/s (last {window:g} s)",
        f"running {m.get('num_running', 0)}",
        f"waiting {m.get('num_waiting', 0)}",
        f"KV {m.get('kv_blocks_used', 0)}/{m.get('kv_blocks_total', 0)} blocks",
        f"prefix hits {m.get('prefix_hit_rate', 0) * 100:.0f}% (since start)",
    ]
    if settings.get("speculative", "off") != "off":
        parts.append(f"spec accepted {m.get('spec_acceptance_rate', 0) * 100:.0f}% (since start)")
    n = m.get("recent_requests")
    if n:
        parts.append(
            f"TTFT p50 {m.get('ttft_p50_ms', 0):.0f} ms, ITL p50 {m.get('itl_p50_ms', 0):.0f} ms "
            f"(last {n} request{'s' if n != 1 else ''})"
        )
    elif n is None:  # an engine that does not say how many (a remote server)
        parts.append(f"TTFT p50 {m.get('ttft_p50_ms', 0):.0f} ms, ITL p50 {m.get('itl_p50_ms', 0):.0f} ms")
    routed = m.get("router")
    if isinstance(routed, dict) and isinstance(routed.get("share"), dict) and sum(routed.get("served", {}).values()):
        share = ", ".join(f"{name} {v * 100:.0f}%" for name, v in routed["share"].items())
        parts.append(f"routed ({routed.get('policy')}, since start): {share}")
    return " · ".join(parts)


def step_time_text(m: dict[str, Any]) -> str:
    """ " · step time: layers 71%, lm_head 12%, outputs 6%" from metrics() (empty when idle)."""
    shares = sorted(((k, v) for k, v in (m.get("step_parts_share") or {}).items() if v >= 0.01), key=lambda kv: -kv[1])
    if not shares:
        return ""
    busy = m.get("device_busy_share")  # CUDA only: the GPU's time on steps, not waiting between them
    return (
        " · step time: "
        + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares)
        + (f" · device busy {100 * busy:.0f}%" if busy is not None else "")
    )


def kernels_line(status: dict) -> str:
    """The dashboard's kernels line: the variant and the large-step compute path, each with why
    (empty for a remote server, whose status has no such keys)."""
    if "kernel_variant" not in status:
        return ""
    parts = [("kernels:", "kernel_variant"), ("large steps in", "compute_path")]
    if status.get("prefill_attention"):  # our attention backends (C, Triton): the prefill path (measured at auto)
        parts.append(("prefill attention:", "prefill_attention"))
    text = " · ".join(
        f"{label} <b>{html.escape(str(status[key]))}</b> ({html.escape(str(status.get(key + '_reason')))})"
        for label, key in parts
    )
    return f'<span style="font-size: 12px;">{text}</span>'
