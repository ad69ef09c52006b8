"""Coalescing engine events for a browser: one snapshot first, then deltas at a chosen rate.

Pure logic (no sockets, no clocks of its own) so it can be tested on synthetic events; the
websocket handler feeds it events from the engine's subscription and asks it, on a timer, for the
next message. Its TypeScript counterpart (`extension/src/model.ts`) applies the messages.

The plot columns come from the same tested reducer the notebook views use
(`workbench.jupyter.reducer.TimelineReducer`): every message with timeline events also carries
``columns`` (the reducer's new rows of ``steps`` and ``lanes``, x in seconds since ``t0``), and
the snapshot carries ``t0`` and the ``palette``, so the panel and the main-area timeline draw
exactly what notebooks draw, in the same colours.

Messages (JSON-ready dicts):

- ``{"type": "snapshot", "engine", "status", "settings", "metrics", "timeline": {"steps",
  "requests", "cursor"}, "columns", "t0", "palette", "time", "rate", "window", "older"}`` (steps
  without their batch: the columns carry it) — always the first message: the
  newest ``window`` steps (bounded, so the first message stays small; ``older`` says the engine
  holds earlier ones). The browser may ask for a wider window (``{"history": steps}``); it then
  gets a fresh snapshot of that many steps.
- ``{"type": "delta", "seq", "time", ["timeline", "columns"], ["settings", "changes"], ["metrics"],
  ["relayout"], ["engine"], ["status"], ["dropped"]}`` — only what changed since the previous message:
  new step, request and settings-change events (``seq`` above the last cursor sent, in order), the latest
  effective settings (with the union of the changed names), the latest metrics, relayout
  progress, the engine's state ("ready" / "stopped" / "dead") and its status, read again after a
  change of a setting that reshapes it (``workbench.settings.STATUS_SETTINGS``: which kernels serve).

Several events of one kind between two flushes collapse: timeline events concatenate (capped,
oldest dropped first and counted in ``dropped``); settings and metrics keep the latest.
"""

from __future__ import annotations

import math
from typing import Any

from ..jupyter.reducer import PHASE_COLORS, STATE_COLORS, TimelineReducer

# The reducer's columns the browser draws (rows are its own; y comes from phase and lane there).
DRAWN = {
    "steps": (
        "left",
        "right",
        "seq",
        "phase",
        "color",
        "duration_ms",
        "batch_size",
        "prefill_tokens",
        "decode_tokens",
        "composition",
        "parts",
        "bound",
    ),
    "lanes": ("left", "right", "lane", "request", "label", "state", "color"),
    "changes": ("t", "end", "label", "by", "apply_ms", "relayout", "color"),
    "host": ("t", "engine_cpu_pct", "host_cpu_pct", "host_mem_pct", "kv_pct", "engine_rss_mb"),
}

MIN_RATE_HZ = 0.2
MAX_RATE_HZ = 60.0
DEFAULT_RATE_HZ = 10.0
SNAPSHOT_STEPS = 500  # steps in a first snapshot (the newest)
SNAPSHOT_REQUEST_EVENTS = 4 * SNAPSHOT_STEPS
MAX_HISTORY_STEPS = 20000  # the widest window a browser may ask for (what its views keep)
# Batch entries per step of the window, on average: a window of full 64-request batches holds
# a quarter of the steps, so the first message stays under ~0.5 MB whatever the batch size.
ENTRIES_PER_STEP = 16
DELTA_STEPS = 5000  # most steps in one delta; older ones are dropped and counted
DELTA_REQUEST_EVENTS = 20000


def clamp_rate(rate: Any, default: float = DEFAULT_RATE_HZ) -> float:
    """A flush rate in Hz from user input (a query argument or a websocket message)."""
    try:
        value = float(rate)
    except (TypeError, ValueError):
        return default
    if value != value:  # NaN
        return default
    return min(MAX_RATE_HZ, max(MIN_RATE_HZ, value))


def history_window(steps: Any) -> int:
    """A snapshot window in steps from user input, within [SNAPSHOT_STEPS, MAX_HISTORY_STEPS]."""
    try:
        value = int(steps)
    except (TypeError, ValueError, OverflowError):
        return SNAPSHOT_STEPS
    return min(MAX_HISTORY_STEPS, max(SNAPSHOT_STEPS, value))


def trim_timeline(
    timeline: dict[str, Any], max_steps: int, max_requests: int, max_entries: int | None = None
) -> tuple[dict[str, Any], int]:
    """Keep the newest steps/request events (and at most `max_entries` batch entries over the
    kept steps: a step of a 64-request batch is 64 times the bytes of a single stream's);
    returns the trimmed timeline and how many were cut."""
    steps = list(timeline.get("steps") or [])
    requests = list(timeline.get("requests") or [])
    keep = min(len(steps), max_steps)
    if max_entries is not None:
        entries = 0
        for i in range(len(steps) - 1, len(steps) - 1 - keep, -1):
            entries += len(steps[i].get("batch") or ())
            if entries > max_entries:
                keep = len(steps) - 1 - i
                break
    cut = (len(steps) - keep) + max(0, len(requests) - max_requests)
    steps = steps[len(steps) - keep :]
    if len(requests) > max_requests:
        requests = requests[len(requests) - max_requests :]
    # Settings changes are few (the engine keeps the last 1000) and each is a marker: all are kept.
    return {
        "steps": steps,
        "requests": requests,
        "changes": list(timeline.get("changes") or []),
        "cursor": int(timeline.get("cursor") or 0),
    }, cut


class EventCoalescer:
    """Per-connection state: what the browser has been sent and what is pending."""

    def __init__(
        self,
        rate_hz: float = DEFAULT_RATE_HZ,
        *,
        max_steps: int = DELTA_STEPS,
        max_requests: int = DELTA_REQUEST_EVENTS,
    ):
        self.rate_hz = clamp_rate(rate_hz)
        self.max_steps = max_steps
        self.max_requests = max_requests
        self.snapshot_sent = False
        self.cursor = 0  # highest timeline seq sent (or covered by the snapshot)
        self.messages_sent = 0
        self.last_flush: float | None = None
        self.engine_time: float | None = None
        self.reducer = TimelineReducer()
        self._reset_pending()

    def _reset_pending(self) -> None:
        self._steps: list[dict[str, Any]] = []
        self._requests: list[dict[str, Any]] = []
        self._change_events: list[dict[str, Any]] = []  # timeline ChangeEvents (markers)
        self._pending_cursor = 0
        self._settings: dict[str, Any] | None = None
        self._changes: dict[str, Any] = {}
        self._metrics: dict[str, Any] | None = None
        self._relayout: list[dict[str, Any]] = []
        self._engine: dict[str, Any] | None = None
        self._status: dict[str, Any] | None = None
        self._dropped = 0

    # -- configuration --------------------------------------------------------------------------
    def set_rate(self, rate_hz: Any) -> float:
        self.rate_hz = clamp_rate(rate_hz, self.rate_hz)
        return self.rate_hz

    @property
    def interval(self) -> float:
        return 1.0 / self.rate_hz

    # -- input ----------------------------------------------------------------------------------
    def add(self, kind: str, data: Any, time: float | None = None) -> None:
        """One engine event, already in JSON-ready form (``msgspec.to_builtins``)."""
        if time is not None:
            self.engine_time = time if self.engine_time is None else max(self.engine_time, time)
        if kind == "timeline":
            self._add_timeline(data or {})
        elif kind == "settings":
            data = data or {}
            if isinstance(data.get("settings"), dict):
                self._settings = dict(data["settings"])
            if isinstance(data.get("changes"), dict):
                self._changes.update(data["changes"])
        elif kind == "metrics":
            self._metrics = dict(data or {})
            if self.snapshot_sent and time is not None:
                self.reducer.add_metrics(self._metrics, time)  # a row of the host plot
        elif kind == "relayout":
            self._relayout.append(dict(data or {}))
        elif kind == "engine":
            self._engine = dict(data or {})
        elif kind == "status":  # read again after a setting that reshapes it (STATUS_SETTINGS)
            self._status = dict(data or {})
        # other kinds (internal "sync" tokens, future kinds) are not relayed

    def _add_timeline(self, data: dict[str, Any]) -> None:
        floor = max(self.cursor, self._pending_cursor) if self.snapshot_sent else 0
        steps = [s for s in data.get("steps") or [] if s.get("seq", 0) > floor]
        requests = [r for r in data.get("requests") or [] if r.get("seq", 0) > floor]
        self._steps.extend(steps)
        self._requests.extend(requests)
        self._change_events.extend(c for c in data.get("changes") or [] if c.get("seq", 0) > floor)
        self._pending_cursor = max(self._pending_cursor, int(data.get("cursor") or 0))
        if len(self._steps) > self.max_steps:
            cut = len(self._steps) - self.max_steps
            del self._steps[:cut]
            self._dropped += cut
        if len(self._requests) > self.max_requests:
            cut = len(self._requests) - self.max_requests
            del self._requests[:cut]
            self._dropped += cut

    def mark_dead(self, reason: str) -> None:
        self._engine = {"state": "dead", "reason": reason}

    # -- output ---------------------------------------------------------------------------------
    def snapshot(
        self,
        *,
        engine: str,
        status: dict[str, Any],
        settings: dict[str, Any],
        metrics: dict[str, Any],
        timeline: dict[str, Any],
        now: float,
        window: int = SNAPSHOT_STEPS,
        older: bool = False,
    ) -> dict[str, Any]:
        """The first message (or a wider one asked for later): the newest `window` steps and 4x
        as many request events; `older`: the engine holds events before these. Events
        subscribed before the snapshot was read and already covered by it (seq <= its cursor)
        are discarded; newer ones stay pending for the next delta."""
        tl, cut = trim_timeline(timeline, window, 4 * window, ENTRIES_PER_STEP * window)
        self.cursor = tl["cursor"]
        self._steps = [s for s in self._steps if s.get("seq", 0) > self.cursor]
        self._requests = [r for r in self._requests if r.get("seq", 0) > self.cursor]
        self._change_events = [c for c in self._change_events if c.get("seq", 0) > self.cursor]
        if self._pending_cursor <= self.cursor:
            self._pending_cursor = 0
        self._metrics = None  # the snapshot carries fresh metrics
        # x = 0 at the engine process's start, so every view of it (panel, main-area timeline,
        # opened at any time) puts an event at the same x; else the earliest event shown
        started = status.get("started_monotonic")
        t0 = (
            started
            if isinstance(started, (int, float))
            else _first_time(tl, self.engine_time if self.engine_time is not None else now)
        )
        self.reducer = TimelineReducer(t0=t0)
        self.reducer.add(tl)
        self.snapshot_sent = True
        self.last_flush = now
        self.messages_sent += 1
        return {
            "type": "snapshot",
            "engine": engine,
            "status": status,
            "settings": settings,
            "metrics": metrics,
            "timeline": _without_batches(tl),
            "columns": self._columns(),
            "t0": self.reducer.t0,
            "palette": {"phase": PHASE_COLORS, "state": STATE_COLORS},
            "time": self.engine_time,
            "rate": self.rate_hz,
            "window": window,
            "older": bool(older or cut),
        }

    def pending(self) -> bool:
        return bool(
            self._steps
            or self._requests
            or self._change_events
            or self._settings is not None
            or self._changes
            or self._metrics is not None
            or self._relayout
            or self._engine is not None
            or self._status is not None
            or self._dropped
        )

    def due(self, now: float) -> bool:
        """Whether a delta should go out now: something is pending and the rate allows it (an
        engine that stopped or died is reported at once)."""
        if not (self.snapshot_sent and self.pending()):
            return False
        if self._engine is not None and self._engine.get("state") in ("stopped", "dead"):
            return True
        return self.last_flush is None or now - self.last_flush >= self.interval - 1e-9

    def next_flush_in(self, now: float) -> float:
        """Seconds until a flush may go out (0 when one may go now)."""
        if self.last_flush is None:
            return 0.0
        return max(0.0, self.last_flush + self.interval - now)

    def flush(self, now: float, *, force: bool = False) -> dict[str, Any] | None:
        """The next delta, or None when nothing is pending or it is too early (unless force)."""
        if not self.snapshot_sent or not self.pending():
            return None
        if not force and not self.due(now):
            return None
        msg: dict[str, Any] = {"type": "delta", "seq": self.messages_sent, "time": self.engine_time}
        if self._steps or self._requests or self._change_events or self._pending_cursor > self.cursor:
            events = (*self._steps, *self._requests, *self._change_events)
            cursor = max(self.cursor, self._pending_cursor, *(e.get("seq", 0) for e in events))
            part = {"steps": self._steps, "requests": self._requests, "changes": self._change_events, "cursor": cursor}
            self.reducer.add(part)
            msg["timeline"] = _without_batches(part)
            self.cursor = cursor
        columns = self._columns()
        if any(next(iter(cols.values()), None) for cols in columns.values()):
            msg["columns"] = columns
        if self._settings is not None or self._changes:
            if self._settings is not None:
                msg["settings"] = self._settings
            msg["changes"] = self._changes
        if self._metrics is not None:
            msg["metrics"] = self._metrics
        if self._relayout:
            msg["relayout"] = self._relayout
        if self._engine is not None:
            msg["engine"] = self._engine
        if self._status is not None:
            msg["status"] = self._status
        if self._dropped:
            msg["dropped"] = self._dropped
        self._reset_pending()
        self.last_flush = now
        self.messages_sent += 1
        return msg

    def _columns(self) -> dict[str, dict[str, list]]:
        return browser_columns(self.reducer.drain())


def finite_or_none(value: Any) -> Any:
    """NaN and infinities as null, all the way down (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def browser_columns(drained: dict[str, dict[str, list]]) -> dict[str, dict[str, list]]:
    """The drawn sources' columns of a reducer `drain()` (empty when no rows), times to the us;
    NaN (a gap in a line) as null, since JSON has no NaN."""
    out = {}
    for name, columns in DRAWN.items():
        rows = drained.get(name) or {}
        out[name] = {
            c: finite_or_none([round(v, 6) if isinstance(v, float) else v for v in rows.get(c, [])]) for c in columns
        }
    return out


def _without_batches(timeline: dict[str, Any]) -> dict[str, Any]:
    """The timeline as the browser gets it: a step's batch is drawn from the columns (its lane
    rectangles, its composition), so it is not sent twice."""
    steps = [{k: v for k, v in s.items() if k != "batch"} for s in timeline.get("steps") or []]
    return {**timeline, "steps": steps}


def _first_time(timeline: dict[str, Any], fallback: float) -> float:
    """The earliest event time in `timeline` (x = 0 of the drawn columns), else `fallback`."""
    times = [s.get("start") for s in timeline.get("steps") or []] + [
        r.get("time") for r in timeline.get("requests") or []
    ]
    times = [t for t in times if isinstance(t, (int, float))]
    return min(times) if times else fallback
