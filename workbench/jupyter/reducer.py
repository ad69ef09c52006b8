"""Engine events -> plot columns. Pure: no Bokeh, no ipywidgets, no I/O.

The dashboard and `%timeline` feed `TimelineReducer` with engine timeline increments (steps and
request events, in any chunking) and stream what `drain()` returns into Bokeh column data
sources, each bounded by `ROLLOVER`. Tests feed it synthetic events and check the columns.

Sources and their columns:

- ``steps``: one rectangle per engine step on the top row (y = 0), coloured by phase; hover
  text describes the batch composition and where the step's time went (``parts``: the scheduler,
  the batch's tensors, the layers, the LM head, sampling, outputs, sending; `STEP_PARTS`).
- ``lanes``: one rectangle per request and state (queued / prefill / decode / verify) in the
  request's lane (y = 1, 2, ...), with the request's ``label`` (its prompt's start, else its id).
  Lanes are reused: a request takes the lowest lane free when it arrives and frees it when it
  finishes, so the plot stays as tall as the concurrency; ``lane_labels`` names each lane after
  the request that took it last.
- A cluster's merged timeline (events naming their ``replica``): each replica gets a band of its
  own, its steps row then ``lanes_per_replica`` lanes for its requests, so the replicas stack one
  under the other; ``routed`` (a lane's column) says why the router sent the request there.
- ``series``: one row per time bin (``bin_s`` seconds): output tokens/s in the bin and averaged
  over the last ``smooth_s`` seconds (a bin catches a whole number of steps, so the per-bin rate
  zig-zags during steady decode), mean inter-token latency, KV blocks used, prefix hit rate,
  speculative acceptance, queue length.
- ``ttft``: one point per request at its first token: time to first token.
- ``host``: one row per engine `metrics()` sample (about one a second): the engine process's CPU
  and the host's, in percent of all the host's cores, the host's memory and the KV cache in use,
  in percent (what serving costs the machine, next to what it served).
- ``changes``: one row per accepted settings change (a `ChangeEvent`): when (``t``), until when
  it stalled the engine (``end``; a re-layout), ``label`` ("quantization: 'none' → 'int8'") and
  who made it (``by``). Views draw it as a marker across every plot, so before/after is visible.

Times (``t``, ``left``, ``right``) are seconds since ``t0`` (the first event seen unless given).
Rates with nothing to measure in a bin are NaN (a gap in the line).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

from ..timeline import change_label
from .tooltips import bound_text, parts_text, routing_text, spec_text

PHASE_COLORS = {
    "prefill": "#4C72B0",
    "decode": "#55A868",
    "mixed": "#8172B3",
    "verify": "#DD8452",
    "relayout": "#8C8C8C",
}
STATE_COLORS = {
    "queued": "#D9D9D9",
    "prefill": PHASE_COLORS["prefill"],
    "decode": PHASE_COLORS["decode"],
    "verify": PHASE_COLORS["verify"],
    "grammar": "#937860",  # a structured request's grammar compiling, just before it arrived
}
OTHER_COLOR = "#999999"
_COMPILED = re.compile(r"^\w+ compiled in ([\d.]+) ms")  # not "cached (compiled in ...)"


COLUMNS: dict[str, tuple[str, ...]] = {
    "steps": (
        "left",
        "right",
        "bottom",
        "top",
        "seq",
        "phase",
        "color",
        "duration_ms",
        "batch_size",
        "prefill_tokens",
        "decode_tokens",
        "prefix_hit_tokens",
        "spec",
        "kv",
        "composition",
        "requests",
        "routing",
        "parts",
        "bound",
        "replica",
    ),
    "lanes": ("left", "right", "bottom", "top", "lane", "request", "label", "state", "color", "tokens", "routed"),
    "series": (
        "t",
        "tok_s",
        "tok_s_avg",
        "itl_ms",
        "kv_used",
        "kv_total",
        "kv_frac",
        "prefix_hit_rate",
        "spec_accept_rate",
        "waiting",
        "running",
    ),
    "ttft": ("t", "ttft_ms", "request", "lane"),
    "changes": ("t", "end", "label", "by", "apply_ms", "relayout", "color"),
    "host": ("t", "engine_cpu_pct", "host_cpu_pct", "host_mem_pct", "kv_pct", "engine_rss_mb"),
}
ROLLOVER = {"steps": 5_000, "lanes": 20_000, "series": 2_000, "ttft": 5_000, "changes": 1_000, "host": 3_600}
CHANGE_COLOR = "#C44E52"  # markers: a colour no phase uses
BIN_S = 0.5  # the series' time bins
SMOOTH_S = 2.0  # the window of the averaged tokens/s

ROW_HALF = 0.4  # half the height of a rectangle in its row


def short_id(request_id: str) -> str:
    return request_id[:6]


class _Bin:
    __slots__ = (
        "index",
        "out_tokens",
        "itl_sum",
        "itl_n",
        "kv_used",
        "kv_total",
        "hits",
        "prefill",
        "proposed",
        "accepted",
        "waiting",
        "running",
        "steps",
    )

    def __init__(self, index: int):
        self.index = index
        self.out_tokens = 0
        self.itl_sum = 0.0
        self.itl_n = 0
        self.kv_used = 0
        self.kv_total = 0
        self.hits = 0
        self.prefill = 0
        self.proposed = 0
        self.accepted = 0
        self.waiting = 0
        self.running = 0
        self.steps = 0


def value_of(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


class TimelineReducer:
    """Accumulates engine activity and hands out new plot rows.

    ``add(timeline)`` takes anything with ``steps`` and ``requests`` (a `workbench.Timeline`, or
    dicts with the same fields); ``add_steps`` / ``add_requests`` take the events directly.
    Events are applied in ``seq`` order within one call. ``tick(now)`` closes time bins that
    ended before ``now`` (engine clock) so an idle engine's throughput drops to zero.
    ``drain()`` returns ``{source: {column: [values]}}`` with the rows added since the last
    drain (sources without new rows are left out).

    ``only``: a set of request ids; then only steps that ran one of them, and only their lanes,
    are kept (the per-cell timeline of `%%generate --timeline`).
    """

    def __init__(
        self,
        *,
        bin_s: float = BIN_S,
        smooth_s: float = SMOOTH_S,
        t0: float | None = None,
        max_lanes: int = 48,
        only: Iterable[str] | None = None,
        max_listed: int = 8,
        lanes_per_replica: int = 12,
    ):
        if bin_s <= 0:
            raise ValueError("bin_s must be > 0")
        self.bin_s = float(bin_s)
        self.smooth_bins = max(1, round(smooth_s / self.bin_s))
        self.smooth_s = self.smooth_bins * self.bin_s
        self._recent_tokens: deque[tuple[int, int]] = deque()  # (bin index, output tokens) in the window
        self._first_bin: int | None = None
        self.t0 = t0
        self.max_lanes = int(max_lanes)
        self.only = None if only is None else frozenset(only)
        self.max_listed = max_listed
        self._pending: dict[str, dict[str, list]] = {k: {c: [] for c in cols} for k, cols in COLUMNS.items()}
        self.rows = dict.fromkeys(COLUMNS, 0)  # rows produced so far, per source
        self._lane_of: OrderedDict[str, int] = OrderedDict()  # also remembers finished requests (bounded)
        self._busy: set[int] = set()
        self._active: set[str] = set()
        self._arrived: dict[str, float] = {}
        self._queued_since: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        self._label: dict[str, str] = {}  # request -> its lane's name (forgotten with its lane)
        self.lane_labels: dict[int, str] = {}  # lane -> the label of the request that took it last
        self._bin: _Bin | None = None
        self._last_emitted_bin: int | None = None
        self.cursor = 0  # highest seq applied
        self.num_lanes = 0  # lanes used so far (the plot's height)
        self.lanes_per_replica = int(lanes_per_replica)
        self.replicas: list[str] = []  # a cluster's replicas, in the order first seen (their bands)
        self._replica_of: dict[str, str] = {}  # request -> the replica that serves it
        self._routed: dict[str, str] = {}  # request -> why the router sent it there
        self._busy_band: dict[str, set[int]] = {}

    # -- input --------------------------------------------------------------------------------
    def add(self, timeline: Any) -> None:
        handlers = {"requests": self._request, "steps": self._step, "changes": self._change}
        events = [
            (int(value_of(ev, "seq", 0)), order, ev, handler)
            for order, (field, handler) in enumerate(handlers.items())
            for ev in value_of(timeline, field, None) or []
        ]
        events.sort(key=lambda e: (e[0], e[1]))
        for seq, _, ev, handler in events:
            if seq and seq <= self.cursor:
                continue  # already applied (overlapping reads)
            handler(ev)
            self.cursor = max(self.cursor, seq)

    def add_steps(self, steps: Iterable[Any]) -> None:
        self.add({"steps": list(steps), "requests": []})

    def add_requests(self, requests: Iterable[Any]) -> None:
        self.add({"steps": [], "requests": list(requests)})

    def add_metrics(self, metrics: dict[str, Any], time: float) -> None:
        """One engine `metrics()` sample taken at `time` (engine clock): a row of ``host``."""
        nan = float("nan")

        def pct(v: Any) -> float:
            return float(v) if isinstance(v, (int, float)) else nan

        cores, cpus = metrics.get("process_cpu_cores"), metrics.get("host_cpus")
        self._emit(
            "host",
            t=self._rel(time),
            engine_cpu_pct=100.0 * cores / cpus if isinstance(cores, (int, float)) and cpus else nan,
            host_cpu_pct=pct(metrics.get("host_cpu_percent")),
            host_mem_pct=pct(metrics.get("host_mem_percent")),
            kv_pct=100.0 * pct(metrics.get("kv_usage")),
            engine_rss_mb=pct(metrics.get("process_rss_mb")),
        )

    def tick(self, now: float, grace: float = 0.25) -> None:
        """Close the open time bin if it ended more than `grace` seconds before `now` (engine
        `time.monotonic()` clock; the grace covers events still on their way)."""
        if self._bin is not None and self.t0 is not None:
            end = (self._bin.index + 1) * self.bin_s
            if now - self.t0 >= end + grace:
                self._close_bin()

    # -- output -------------------------------------------------------------------------------
    def drain(self) -> dict[str, dict[str, list]]:
        out = {}
        for name, cols in self._pending.items():
            first = cols[COLUMNS[name][0]]
            if first:
                out[name] = cols
                self._pending[name] = {c: [] for c in COLUMNS[name]}
        return out

    @staticmethod
    def empty() -> dict[str, dict[str, list]]:
        return {k: {c: [] for c in cols} for k, cols in COLUMNS.items()}

    # -- internals ----------------------------------------------------------------------------
    def _rel(self, t: float) -> float:
        if self.t0 is None:
            self.t0 = t
        return t - self.t0

    def _emit(self, source: str, **row: Any) -> None:
        cols = self._pending[source]
        for c in COLUMNS[source]:
            cols[c].append(row[c])
        self.rows[source] += 1

    def _wanted(self, rid: str) -> bool:
        return self.only is None or rid in self.only

    def _band(self, replica: str) -> tuple[int, int]:
        """(first y, lanes) of a replica's band: its steps row at y, its lanes under it. One engine
        (no replica named): the steps row at 0, then `max_lanes` lanes."""
        if not replica:
            return 0, self.max_lanes
        if replica not in self.replicas:
            self.replicas.append(replica)
            base = self.replicas.index(replica) * (self.lanes_per_replica + 2)
            self.lane_labels[base - 1] = f"{replica} steps"  # lane base - 1 is drawn at y = base
        return self.replicas.index(replica) * (self.lanes_per_replica + 2), self.lanes_per_replica

    def _lane(self, rid: str) -> int:
        lane = self._lane_of.get(rid)
        if lane is not None:
            self._lane_of.move_to_end(rid)
            return lane
        base, size = self._band(self._replica_of.get(rid, ""))
        busy = self._busy_band.setdefault(self._replica_of.get(rid, ""), set())
        free = next((i for i in range(size) if i not in busy), None)
        lane = base + (size if free is None else free)  # the last lane of a band holds its overflow
        if free is not None:
            busy.add(free)
            self._busy.add(lane)
        self._active.add(rid)
        self._lane_of[rid] = lane
        while len(self._lane_of) > 4 * self.max_lanes + 1024:
            old, old_lane = self._lane_of.popitem(last=False)
            if old in self._active:  # never forget a live request: put it back at the end
                self._lane_of[old] = old_lane
                break
            self._label.pop(old, None)
            self._routed.pop(old, None)
            self._replica_of.pop(old, None)
        self.num_lanes = max(self.num_lanes, lane + 1)
        return lane

    def _release(self, rid: str) -> None:
        if rid in self._active:
            self._active.discard(rid)
            lane = self._lane_of.get(rid)
            base, size = self._band(self._replica_of.get(rid, ""))
            if lane is not None and lane < base + size:
                self._busy.discard(lane)
                self._busy_band.get(self._replica_of.get(rid, ""), set()).discard(lane - base)
        self._arrived.pop(rid, None)
        self._queued_since.pop(rid, None)
        self._last_token.pop(rid, None)

    def _lane_rect(self, rid: str, left: float, right: float, state: str, tokens: int) -> None:
        lane = self._lane(rid)
        y = lane + 1
        self._emit(
            "lanes",
            left=left,
            right=right,
            bottom=y - ROW_HALF,
            top=y + ROW_HALF,
            lane=lane,
            request=short_id(rid),
            label=self._label.get(rid, short_id(rid)),
            state=state,
            color=STATE_COLORS.get(state, OTHER_COLOR),
            tokens=tokens,
            routed=self._routed.get(rid, ""),
        )

    def _request(self, ev: Any) -> None:
        rid = value_of(ev, "request_id")
        kind = value_of(ev, "kind")
        t = float(value_of(ev, "time"))
        if not self._wanted(rid):
            return
        rel = self._rel(t)
        replica = value_of(ev, "replica", "") or ""
        if replica:
            self._replica_of.setdefault(rid, replica)
        if kind == "routed":
            self._routed[rid] = f"{replica}: {value_of(ev, 'detail', '') or ''}"
        elif kind == "arrived":
            label = value_of(ev, "label", None) or short_id(rid)
            self._label[rid] = label
            lane = self._lane(rid)
            base, size = self._band(self._replica_of.get(rid, ""))
            if lane < base + size:
                self.lane_labels[lane] = label
            self._arrived[rid] = t
            self._queued_since[rid] = rel
        elif kind in ("scheduled", "resumed"):
            since = self._queued_since.pop(rid, None)
            if since is not None:
                self._lane_rect(rid, since, rel, "queued", 0)
        elif kind == "preempted":
            self._queued_since[rid] = rel
            self._last_token.pop(rid, None)
        elif kind == "first_token":
            self._last_token[rid] = t
            arrived = self._arrived.get(rid)
            if arrived is not None:
                self._emit("ttft", t=rel, ttft_ms=(t - arrived) * 1e3, request=short_id(rid), lane=self._lane(rid))
        elif kind == "grammar":
            m = _COMPILED.match(value_of(ev, "detail", "") or "")
            if m is not None:  # compiled for this request (a cached grammar costs nothing)
                self._lane_rect(rid, rel - float(m.group(1)) / 1e3, rel, "grammar", 0)
        elif kind == "finished":
            since = self._queued_since.pop(rid, None)
            if since is not None:  # aborted while queued
                self._lane_rect(rid, since, rel, "queued", 0)
            self._release(rid)

    def _change(self, c: Any) -> None:
        start, end = float(value_of(c, "start")), float(value_of(c, "end"))
        label = change_label(value_of(c, "changes", None) or {})
        self._emit(
            "changes",
            t=self._rel(start),
            end=self._rel(end),
            label=label,
            by=value_of(c, "by", "") or "?",
            apply_ms=(end - start) * 1e3,
            relayout=bool(value_of(c, "relayout", False)),
            color=CHANGE_COLOR,
        )

    def _step(self, s: Any) -> None:
        batch = list(value_of(s, "batch", None) or [])
        entries = [
            (
                value_of(b, "request_id") if not isinstance(b, (list, tuple)) else b[0],
                int(value_of(b, "num_tokens") if not isinstance(b, (list, tuple)) else b[1]),
                value_of(b, "kind") if not isinstance(b, (list, tuple)) else b[2],
            )
            for b in batch
        ]
        if self.only is not None:
            if not any(rid in self.only for rid, _, _ in entries):
                return
        start, end = float(value_of(s, "start")), float(value_of(s, "end"))
        left, right = self._rel(start), self._rel(end)
        phase = value_of(s, "phase", "mixed")
        replica = value_of(s, "replica", "") or ""
        row, _ = self._band(replica)
        for rid, _, _ in entries:
            if replica:
                self._replica_of.setdefault(rid, replica)
        prefill_tok = int(value_of(s, "num_prefill_tokens", 0) or 0)
        decode_tok = int(value_of(s, "num_decode_tokens", 0) or 0)
        hits = int(value_of(s, "prefix_hit_tokens", 0) or 0)
        proposed = int(value_of(s, "spec_proposed", 0) or 0)
        accepted = int(value_of(s, "spec_accepted", 0) or 0)
        kv_used = int(value_of(s, "kv_blocks_used", 0) or 0)
        kv_total = int(value_of(s, "kv_blocks_total", 0) or 0)
        self.num_lanes = max(self.num_lanes, row)
        self._emit(
            "steps",
            left=left,
            right=right,
            bottom=row - ROW_HALF,
            top=row + ROW_HALF,
            seq=int(value_of(s, "seq", 0)),
            phase=phase,
            color=PHASE_COLORS.get(phase, OTHER_COLOR),
            duration_ms=(end - start) * 1e3,
            batch_size=len(entries),
            prefill_tokens=prefill_tok,
            decode_tokens=decode_tok,
            prefix_hit_tokens=hits,
            spec=spec_text(accepted, proposed, int(value_of(s, "jump_forward_tokens", 0) or 0)),
            kv=f"{kv_used}/{kv_total}",
            composition=self._composition(entries),
            requests=self._listing(entries),
            routing=routing_text(value_of(s, "expert_counts", None) or []),
            parts=parts_text(value_of(s, "parts", None) or {}),
            bound=bound_text(float(value_of(s, "target_ms", 0) or 0), float(value_of(s, "predicted_ms", 0) or 0)),
            replica=replica,
        )
        for rid, ntok, kind in entries:
            if not self._wanted(rid):
                continue
            self._lane_rect(rid, left, right, kind, ntok)
            if kind in ("decode", "verify"):
                last = self._last_token.get(rid)
                if last is not None:
                    self._bin_for(right).itl_sum += end - last
                    self._bin_for(right).itl_n += 1
                self._last_token[rid] = end
        b = self._bin_for(right)
        b.steps += 1
        b.out_tokens += int(value_of(s, "output_tokens", 0) or 0)
        b.kv_used = max(b.kv_used, kv_used)
        b.kv_total = kv_total
        b.hits += hits
        b.prefill += prefill_tok
        b.proposed += proposed
        b.accepted += accepted
        b.waiting = int(value_of(s, "num_waiting", 0) or 0)
        b.running = int(value_of(s, "num_running", 0) or 0)

    def _composition(self, entries: list[tuple[str, int, str]]) -> str:
        parts = []
        for kind in ("prefill", "decode", "verify"):
            sel = [n for _, n, k in entries if k == kind]
            if sel:
                parts.append(f"{len(sel)} {kind} ({sum(sel)} tok)")
        return " · ".join(parts) or "empty"

    def _listing(self, entries: list[tuple[str, int, str]]) -> str:
        shown = [f"{short_id(rid)}:{kind[0]}{n}" for rid, n, kind in entries[: self.max_listed]]
        more = len(entries) - len(shown)
        return " ".join(shown) + (f" +{more}" if more > 0 else "")

    def _bin_for(self, rel: float) -> _Bin:
        index = max(0, int(math.floor(rel / self.bin_s)))
        if self._last_emitted_bin is not None:
            index = max(index, self._last_emitted_bin + 1)  # a late event joins the next open bin
        if self._bin is None:
            self._bin = _Bin(index)
        elif index > self._bin.index:
            self._close_bin()
            self._bin = _Bin(index)
        return self._bin  # an event older than the open bin counts in the open bin

    def _close_bin(self) -> None:
        b = self._bin
        if b is None:
            return
        self._bin = None
        prev = self._last_emitted_bin
        if prev is not None and b.index - prev > 1:
            # idle gap: the smoothed throughput decays bin by bin to zero after the last busy bin,
            # then stays there until just before this one (never a slope across the gap)
            last_decay = min(prev + self.smooth_bins, b.index - 1)
            for index in range(prev + 1, last_decay + 1):
                self._emit_idle(index)
            if b.index - 1 > last_decay:
                self._emit_idle(b.index - 1)
        nan = float("nan")
        self._emit(
            "series",
            t=(b.index + 1) * self.bin_s,
            tok_s=b.out_tokens / self.bin_s,
            tok_s_avg=self._windowed(b.index, b.out_tokens),
            itl_ms=b.itl_sum / b.itl_n * 1e3 if b.itl_n else nan,
            kv_used=b.kv_used,
            kv_total=b.kv_total,
            kv_frac=b.kv_used / b.kv_total if b.kv_total else nan,
            prefix_hit_rate=b.hits / (b.hits + b.prefill) if (b.hits + b.prefill) else nan,
            spec_accept_rate=b.accepted / b.proposed if b.proposed else nan,
            waiting=b.waiting,
            running=b.running,
        )
        self._last_emitted_bin = b.index

    def _windowed(self, index: int, tokens: int) -> float:
        """Output tokens/s over the `smooth_bins` bins ending with bin `index` (fewer at the start)."""
        if self._first_bin is None:
            self._first_bin = index
        self._recent_tokens.append((index, tokens))
        while self._recent_tokens[0][0] <= index - self.smooth_bins:
            self._recent_tokens.popleft()
        bins = min(self.smooth_bins, index - self._first_bin + 1)
        return sum(n for _, n in self._recent_tokens) / (bins * self.bin_s)

    def _emit_idle(self, index: int) -> None:
        nan = float("nan")
        self._emit(
            "series",
            t=(index + 1) * self.bin_s,
            tok_s=0.0,
            tok_s_avg=self._windowed(index, 0),
            itl_ms=nan,
            kv_used=nan,
            kv_total=nan,
            kv_frac=nan,
            prefix_hit_rate=nan,
            spec_accept_rate=nan,
            waiting=0,
            running=0,
        )


# -- expert routing (mixture-of-experts models) -----------------------------------------------------
