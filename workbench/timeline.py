"""Engine activity as events: what ran in each step and what happened to each request.

The engine records into a `TimelineRecorder` (bounded ring buffers, so memory stays flat over a
day of serving); clients read increments with `since=` cursors; `Timeline` is the
client-side view with a Chrome-trace export (loadable by Perfetto / chrome://tracing).
Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterable

import msgspec

PHASES = ("prefill", "decode", "mixed", "verify", "relayout")
# Where a step's time goes, in order (`StepEvent.parts`, milliseconds each): a draft model's
# proposals, the scheduler's decisions, the batch's tensors and attention metadata, the
# transformer's layers, the LM head, sampling, the outputs (each sequence advanced, detokenised,
# stop strings checked) and, in an engine process, handing the chunks to their clients.
# The grammar masks of structured requests ("mask") are their own part, before sampling.
STEP_PARTS = ("draft", "schedule", "prepare", "layers", "lm_head", "mask", "sample", "outputs", "send")
# On CUDA these are the device's times (events), the others the host's; a step on CUDA also
# records "device_idle", the device's wait for it since the step before ended (not a STEP_PART).
DEVICE_PARTS = ("layers", "lm_head", "sample")
REQUEST_EVENTS = (
    "arrived",
    "scheduled",
    "first_token",
    "preempted",
    "resumed",
    "finished",
    "routed",
    "escalated",  # a router's cascade: the cheaper member's answer was not confident enough
    "grammar",  # a structured request's grammar: compiled (how long) or found in the cache
)


class BatchEntry(msgspec.Struct, array_like=True):
    request_id: str
    num_tokens: int  # tokens of this request computed in the step
    kind: str  # "prefill" | "decode" | "verify"


class StepEvent(msgspec.Struct, omit_defaults=True):
    seq: int
    start: float
    end: float
    phase: str
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    batch: list[BatchEntry] = msgspec.field(default_factory=list)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_hit_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    jump_forward_tokens: int = 0  # tokens a grammar forced and the step kept (jump-forward): steps saved
    num_waiting: int = 0
    num_running: int = 0
    output_tokens: int = 0  # tokens emitted by this step
    # MoE models: per MoE layer, how many tokens each expert received in this step
    expert_counts: list[list[int]] = msgspec.field(default_factory=list)
    parts: dict[str, float] = msgspec.field(default_factory=dict)  # STEP_PARTS -> ms (a simulated step: none)
    # the step-time target that cut this step's prefill (step_time_target_ms) and the time predicted
    # for the step it left; 0: no target cut it
    target_ms: float = 0.0
    predicted_ms: float = 0.0
    replica: str = ""  # the replica that ran it, in a cluster's merged timeline


class RequestEvent(msgspec.Struct, omit_defaults=True):
    seq: int
    time: float
    request_id: str
    kind: str  # one of REQUEST_EVENTS
    detail: str | None = None
    label: str | None = None  # "arrived": the prompt's start, to name the request's lane by
    replica: str = ""  # a cluster's merged timeline: the replica it happened on ("routed": where it went)


def prompt_label(text: str | None, width: int = 32) -> str | None:
    """The start of a prompt on one line, at most `width` characters (a lane's name)."""
    if not text:
        return None
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"


class ChangeEvent(msgspec.Struct, omit_defaults=True):
    """One accepted `configure` call: what changed, who asked, and how long applying it took
    (`end - start`: a re-layout, e.g. re-quantising the weights, stalls the engine that long)."""

    seq: int
    start: float
    end: float
    changes: dict[str, list]  # name -> [old, new]
    by: str = ""  # the client that asked ("notebook kernel (pid 4242)", "JupyterLab panel (pid ...)")
    relayout: bool = False  # a change that re-lays out weights or the KV cache
    replica: str = ""  # a cluster's merged timeline: the replica it was applied on

    def label(self) -> str:
        return change_label(self.changes)


def change_label(changes: dict[str, list]) -> str:
    """ "quantization: 'none' → 'int8', max_num_seqs: 8 → 16" (strings quoted, as in Python)."""
    return ", ".join(f"{k}: {_show(old)} → {_show(new)}" for k, (old, new) in changes.items())


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def step_breakdown(steps: Iterable[StepEvent]) -> dict:
    """Where the steps' time went: per part of `STEP_PARTS`, total ms and share of the steps' time,
    the part that took most (what limits the run), and the time between steps (the loop waiting
    or doing other work), as a share of the span from the first step's start to the last's end."""
    steps = list(steps)
    if not steps:
        return {}
    totals = dict.fromkeys(STEP_PARTS, 0.0)
    for st in steps:
        for name, ms in st.parts.items():
            if name in totals:
                totals[name] += ms
    busy = sum(st.end - st.start for st in steps) * 1e3
    span = (steps[-1].end - steps[0].start) * 1e3
    measured = sum(totals.values())
    out = {
        "steps": len(steps),
        "step_ms": busy,
        "parts_ms": totals,
        "parts_share": {k: v / measured if measured else 0.0 for k, v in totals.items()},
        # async scheduling overlaps a step (launch to outputs) with the next one: no time between
        "between_steps_share": max(0.0, 1 - busy / span) if span > 0 else 0.0,
    }
    out["limit"] = max(totals, key=totals.get) if measured else None
    # on CUDA: the device's share of time busy with steps rather than waiting for the host between them
    idle = [st.parts["device_idle"] for st in steps if "device_idle" in st.parts]
    if idle:
        on_device = sum(totals[k] for k in DEVICE_PARTS)
        out["device_busy_share"] = on_device / (on_device + sum(idle)) if on_device else 0.0
    return out


def expert_totals(per_step: Iterable[list[list[int]]]) -> list[list[int]]:
    """Tokens per expert of each MoE layer, summed over steps' `expert_counts`."""
    out: list[list[int]] = []
    for counts in per_step:
        for i, layer in enumerate(counts):
            if i == len(out):
                out.append([0] * len(layer))
            out[i] = [a + b for a, b in zip(out[i], layer)]
    return out


def imbalance(counts: list[int]) -> float:
    """Max over mean tokens per expert (1: perfectly even; what expert-parallel serving cares
    about); NaN when no token was routed."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else float("nan")


class TimelineRecorder:
    """Engine-side ring buffers with one monotonically increasing cursor over both kinds."""

    def __init__(self, capacity: int = 20_000):
        self.steps: deque[StepEvent] = deque(maxlen=capacity)
        self.requests: deque[RequestEvent] = deque(maxlen=capacity * 4)
        self.changes: deque[ChangeEvent] = deque(maxlen=1000)
        self.cursor = 0

    def next_seq(self) -> int:
        self.cursor += 1
        return self.cursor

    def add_step(self, **fields) -> StepEvent:
        ev = StepEvent(seq=self.next_seq(), **fields)
        self.steps.append(ev)
        return ev

    def add_request(
        self, time: float, request_id: str, kind: str, detail: str | None = None, label: str | None = None
    ) -> RequestEvent:
        ev = RequestEvent(seq=self.next_seq(), time=time, request_id=request_id, kind=kind, detail=detail, label=label)
        self.requests.append(ev)
        return ev

    def add_change(
        self, start: float, end: float, changes: dict[str, list], by: str = "", relayout: bool = False
    ) -> ChangeEvent:
        ev = ChangeEvent(seq=self.next_seq(), start=start, end=end, changes=changes, by=by, relayout=relayout)
        self.changes.append(ev)
        return ev

    def merge(self, tl: Timeline, replica: str, offset: float = 0.0, rename=None) -> None:
        """Append another engine's events (a cluster's replica, a router's member), on this host's
        clock (`offset`: theirs minus ours), each tagged with where it happened; `rename` maps
        their request ids to the ones this recorder's users know (None: the same)."""
        rid = rename or (lambda r: r)
        for s in tl.steps:
            batch = [msgspec.structs.replace(b, request_id=rid(b.request_id)) for b in s.batch] if rename else s.batch
            self.steps.append(
                msgspec.structs.replace(
                    s, seq=self.next_seq(), start=s.start - offset, end=s.end - offset, replica=replica, batch=batch
                )
            )
        for q in tl.requests:
            self.requests.append(
                msgspec.structs.replace(
                    q, seq=self.next_seq(), time=q.time - offset, replica=replica, request_id=rid(q.request_id)
                )
            )
        for c in tl.changes:
            self.changes.append(
                msgspec.structs.replace(
                    c, seq=self.next_seq(), start=c.start - offset, end=c.end - offset, replica=replica
                )
            )

    def newer(self, since: int) -> Timeline:
        """What came after cursor `since`, in O(new): `read` for a cursor near the end (the
        engine process publishes this 20 times a second)."""
        return Timeline(
            steps=_newer(self.steps, since),
            requests=_newer(self.requests, since),
            cursor=self.cursor,
            changes=_newer(self.changes, since),
        )

    def read(self, since: int | None = None) -> Timeline:
        since = since or 0
        return Timeline(
            steps=[s for s in self.steps if s.seq > since],
            requests=[r for r in self.requests if r.seq > since],
            cursor=self.cursor,
            changes=[c for c in self.changes if c.seq > since],
        )


class Timeline(msgspec.Struct):
    steps: list[StepEvent]
    requests: list[RequestEvent]
    cursor: int  # pass as `since` to read only what came after
    changes: list[ChangeEvent] = msgspec.field(default_factory=list)  # settings changes, in order

    def extend(self, other: Timeline) -> None:
        self.steps.extend(other.steps)
        self.requests.extend(other.requests)
        self.changes.extend(other.changes)
        self.cursor = max(self.cursor, other.cursor)

    def request_spans(self) -> dict[str, dict[str, float]]:
        """Per request: the time of each lifecycle event (first occurrence)."""
        spans: dict[str, dict[str, float]] = {}
        for ev in self.requests:
            spans.setdefault(ev.request_id, {}).setdefault(ev.kind, ev.time)
        return spans

    def to_chrome_trace(self, path: str | os.PathLike | None = None) -> dict:
        """Chrome trace-event JSON: engine steps on one track, each request on its own track, and
        every settings change as a global marker (with its re-layout as a slice on the steps track)."""
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "engine"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "steps"}},
        ]
        for s in self.steps:
            events.append(
                {
                    "name": s.phase,
                    "cat": "step",
                    "ph": "X",
                    "pid": 1,
                    "tid": 0,
                    "ts": s.start * 1e6,
                    "dur": max(s.end - s.start, 0.0) * 1e6,
                    "args": {
                        "prefill_tokens": s.num_prefill_tokens,
                        "decode_tokens": s.num_decode_tokens,
                        "batch": [[x.request_id, x.num_tokens, x.kind] for x in s.batch],
                        "kv_blocks_used": s.kv_blocks_used,
                        "prefix_hit_tokens": s.prefix_hit_tokens,
                        "spec_proposed": s.spec_proposed,
                        "spec_accepted": s.spec_accepted,
                    },
                }
            )
        lanes: dict[str, int] = {}
        for rid, t in self.request_spans().items():
            tid = lanes.setdefault(rid, len(lanes) + 1)
            events.append({"name": "thread_name", "ph": "M", "pid": 2, "tid": tid, "args": {"name": rid}})
            arrived = t.get("arrived")
            scheduled = t.get("scheduled")
            first = t.get("first_token")
            end = t.get("finished")
            for name, a, b in (("queued", arrived, scheduled), ("prefill", scheduled, first), ("decode", first, end)):
                if a is not None and b is not None:
                    events.append(
                        {
                            "name": name,
                            "cat": "request",
                            "ph": "X",
                            "pid": 2,
                            "tid": tid,
                            "ts": a * 1e6,
                            "dur": max(b - a, 0.0) * 1e6,
                        }
                    )
        for c in self.changes:
            # A global instant event: Perfetto and chrome://tracing draw it as a line across every track.
            args = {"by": c.by, "changes": c.changes, "apply_ms": (c.end - c.start) * 1e3}
            events.append(
                {
                    "name": c.label(),
                    "cat": "settings",
                    "ph": "i",
                    "s": "g",
                    "pid": 1,
                    "tid": 0,
                    "ts": c.start * 1e6,
                    "args": args,
                }
            )
            if c.relayout:
                events.append(
                    {
                        "name": "relayout",
                        "cat": "settings",
                        "ph": "X",
                        "pid": 1,
                        "tid": 0,
                        "ts": c.start * 1e6,
                        "dur": max(c.end - c.start, 0.0) * 1e6,
                        "args": args,
                    }
                )
        events.insert(0, {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "requests"}})
        trace = {"traceEvents": events, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace


def _newer(buf, cursor: int) -> list:
    """Items of an append-only ring buffer with seq > cursor, oldest first, in O(new)."""
    out = []
    for item in reversed(buf):
        if item.seq <= cursor:
            break
        out.append(item)
    out.reverse()
    return out
