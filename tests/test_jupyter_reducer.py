"""The dashboard's reducer on synthetic engine events: pure, fast, no engine."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from workbench.jupyter.reducer import COLUMNS, PHASE_COLORS, STATE_COLORS, TimelineReducer
from workbench.timeline import BatchEntry, RequestEvent, StepEvent, Timeline

pytestmark = pytest.mark.timeout(60)


class Fake:
    """Builds a consistent synthetic event stream with one increasing seq over both kinds."""

    def __init__(self):
        self.seq = 0
        self.steps: list[StepEvent] = []
        self.requests: list[RequestEvent] = []

    def req(self, t, rid, kind, detail=None):
        self.seq += 1
        self.requests.append(RequestEvent(self.seq, t, rid, kind, detail))

    def step(self, start, end, phase, batch, **kw):
        self.seq += 1
        entries = [BatchEntry(r, n, k) for r, n, k in batch]
        self.steps.append(
            StepEvent(
                self.seq,
                start,
                end,
                phase,
                batch=entries,
                num_prefill_tokens=sum(n for _, n, k in batch if k == "prefill"),
                num_decode_tokens=sum(n for _, n, k in batch if k != "prefill"),
                **kw,
            )
        )

    def timeline(self):
        return Timeline(steps=list(self.steps), requests=list(self.requests), cursor=self.seq)


def two_requests() -> Fake:
    """A arrives at 10.0, B at 10.05; both prefill in one step, then decode together; A ends first."""
    f = Fake()
    f.req(10.00, "aaaaaaaa", "arrived")
    f.req(10.05, "bbbbbbbb", "arrived")
    f.req(10.10, "aaaaaaaa", "scheduled")
    f.req(10.10, "bbbbbbbb", "scheduled")
    f.req(10.30, "aaaaaaaa", "first_token")
    f.req(10.30, "bbbbbbbb", "first_token")
    f.step(
        10.10,
        10.30,
        "prefill",
        [("aaaaaaaa", 8, "prefill"), ("bbbbbbbb", 4, "prefill")],
        kv_blocks_used=2,
        kv_blocks_total=100,
        output_tokens=2,
        prefix_hit_tokens=4,
    )
    t = 10.30
    for i in range(6):
        batch = [("aaaaaaaa", 1, "decode"), ("bbbbbbbb", 1, "decode")] if i < 3 else [("bbbbbbbb", 1, "decode")]
        if i == 2:
            f.req(t + 0.1, "aaaaaaaa", "finished", "length")
        f.step(
            t, t + 0.1, "decode", batch, kv_blocks_used=2 if i < 3 else 1, kv_blocks_total=100, output_tokens=len(batch)
        )
        t += 0.1
    f.req(t, "bbbbbbbb", "finished", "stop")
    return f


def test_a_reused_lane_takes_the_new_requests_label():
    """A lane freed by one request and taken by the next is named after the newcomer, in the
    reducer's lane names and on every row it draws, whether the events come in one batch or
    one by one (as a live dashboard gets them)."""

    def events() -> Fake:
        f = Fake()
        for k, (rid, text) in enumerate((("old00000", "the first prompt"), ("new00000", "a second prompt"))):
            t0 = 10.0 + 2 * k
            f.req(t0, rid, "arrived")
            f.requests[-1].label = text
            f.req(t0 + 0.1, rid, "scheduled")
            f.step(t0 + 0.1, t0 + 0.3, "prefill", [(rid, 6, "prefill")])
            f.req(t0 + 0.3, rid, "first_token")
            f.step(t0 + 0.3, t0 + 0.4, "decode", [(rid, 1, "decode")])
            f.req(t0 + 0.4, rid, "finished", "length")
        return f

    whole, live = TimelineReducer(), TimelineReducer()
    whole.add(events().timeline())
    drained = [whole.drain()["lanes"]]
    f = events()
    live_rows = {"lane": [], "request": [], "label": []}
    for ev in sorted(f.steps + f.requests, key=lambda e: e.seq):
        live.add(
            Timeline(
                steps=[ev] if isinstance(ev, StepEvent) else [],
                requests=[ev] if isinstance(ev, RequestEvent) else [],
                cursor=ev.seq,
            )
        )
        lanes = live.drain().get("lanes") or {}
        for c in live_rows:
            live_rows[c] += lanes.get(c, [])
    drained.append(live_rows)
    for r in (whole, live):
        assert r.lane_labels == {0: "a second prompt"}
    for lanes in drained:
        assert set(lanes["lane"]) == {0}  # the second request did take the first one's lane
        by_request = {
            req: {lab for lab, q in zip(lanes["label"], lanes["request"]) if q == req} for req in set(lanes["request"])
        }
        assert by_request == {"old000": {"the first prompt"}, "new000": {"a second prompt"}}


def test_columns_steps_lanes_and_ttft():
    r = TimelineReducer(bin_s=0.5)
    r.add(two_requests().timeline())
    r.tick(1e9)
    d = r.drain()
    for name, cols in d.items():
        assert tuple(cols) == COLUMNS[name]
        assert len({len(v) for v in cols.values()}) == 1, f"ragged columns in {name}"
    steps = d["steps"]
    assert len(steps["left"]) == 7
    assert steps["left"][0] == pytest.approx(0.10) and steps["right"][0] == pytest.approx(0.30)  # t0 = first event
    assert steps["phase"][:2] == ["prefill", "decode"]
    assert steps["color"][0] == PHASE_COLORS["prefill"]
    assert steps["batch_size"] == [2, 2, 2, 2, 1, 1, 1]
    assert steps["composition"][0] == "2 prefill (12 tok)"
    assert steps["composition"][1] == "2 decode (2 tok)"
    assert "aaaaaa:p8" in steps["requests"][0] and "bbbbbb:p4" in steps["requests"][0]
    assert steps["prefix_hit_tokens"][0] == 4 and steps["kv"][0] == "2/100"

    lanes = d["lanes"]
    by_req = {}
    for req, state, lane, left, right in zip(
        lanes["request"], lanes["state"], lanes["lane"], lanes["left"], lanes["right"]
    ):
        by_req.setdefault(req, []).append((state, lane, left, right))
    a, b = by_req["aaaaaa"], by_req["bbbbbb"]
    assert a[0] == ("queued", 0, pytest.approx(0.0), pytest.approx(0.10))
    assert b[0] == ("queued", 1, pytest.approx(0.05), pytest.approx(0.10))
    assert [s for s, *_ in a] == ["queued", "prefill", "decode", "decode", "decode"]
    assert [s for s, *_ in b] == ["queued", "prefill"] + ["decode"] * 6
    assert {lane for _, lane, *_ in a} == {0} and {lane for _, lane, *_ in b} == {1}
    assert all(c == STATE_COLORS[s] for c, s in zip(lanes["color"], lanes["state"]))
    assert r.num_lanes == 2

    ttft = d["ttft"]
    assert ttft["request"] == ["aaaaaa", "bbbbbb"]
    assert ttft["ttft_ms"] == [pytest.approx(300.0), pytest.approx(250.0)]


def test_series_bins_throughput_itl_kv_and_rates():
    r = TimelineReducer(bin_s=0.5)
    r.add(two_requests().timeline())
    r.tick(1e9)
    s = r.drain()["series"]
    # steps end at 0.3, 0.4, ..., 0.9 (relative): bin [0, 0.5) holds 2 steps, [0.5, 1.0) holds 5
    assert s["t"] == [0.5, 1.0]
    assert s["tok_s"] == [pytest.approx((2 + 2) / 0.5), pytest.approx((2 + 2 + 1 + 1 + 1) / 0.5)]
    assert s["itl_ms"][0] == pytest.approx(100.0) and s["itl_ms"][1] == pytest.approx(100.0)
    assert s["kv_used"] == [2, 2] and s["kv_total"] == [100, 100]
    assert s["prefix_hit_rate"][0] == pytest.approx(4 / (4 + 12))
    assert math.isnan(s["prefix_hit_rate"][1]) and math.isnan(s["spec_accept_rate"][0])


def test_incremental_feeding_matches_one_shot_and_skips_repeats():
    f = two_requests()
    whole = TimelineReducer(bin_s=0.5)
    whole.add(f.timeline())
    whole.tick(1e9)
    expected = whole.drain()

    parts = TimelineReducer(bin_s=0.5)
    got: dict = {}
    events = sorted([(s.seq, s) for s in f.steps] + [(q.seq, q) for q in f.requests], key=lambda x: x[0])
    for i in range(0, len(events), 3):  # increments of 3 events, each fed twice (overlapping reads)
        chunk = [e for _, e in events[i : i + 3]]
        tl = Timeline(
            steps=[e for e in chunk if isinstance(e, StepEvent)],
            requests=[e for e in chunk if isinstance(e, RequestEvent)],
            cursor=0,
        )
        parts.add(tl)
        parts.add(tl)
        for name, cols in parts.drain().items():
            into = got.setdefault(name, {c: [] for c in cols})
            for c, v in cols.items():
                into[c].extend(v)
    parts.tick(1e9)
    for name, cols in parts.drain().items():
        for c, v in cols.items():
            got[name][c].extend(v)
    for name in ("steps", "lanes", "ttft"):
        assert got[name] == expected[name], name
    assert got["series"]["tok_s"] == expected["series"]["tok_s"]
    assert r_empty(parts.drain())


def r_empty(d):
    return d == {}


def test_lanes_are_reused_and_bounded():
    f = Fake()
    t = 0.0
    for i in range(200):  # 200 requests, at most 3 in flight
        rid = f"r{i:07d}"
        f.req(t, rid, "arrived")
        f.req(t + 0.01, rid, "scheduled")
        f.step(t + 0.01, t + 0.02, "prefill", [(rid, 4, "prefill")], output_tokens=1)
        if i >= 2:
            f.req(t + 0.02, f"r{i - 2:07d}", "finished", "length")
        t += 0.03
    r = TimelineReducer(bin_s=0.5, max_lanes=8)
    r.add(f.timeline())
    lanes = r.drain()["lanes"]
    assert max(lanes["lane"]) <= 3 and r.num_lanes <= 4
    assert len(r._lane_of) <= 4 * 8 + 1024


def test_overflow_lane_and_filter_only():
    f = Fake()
    for i in range(5):
        f.req(0.0, f"x{i}", "arrived")
    f.step(0.0, 0.1, "prefill", [(f"x{i}", 2, "prefill") for i in range(5)])
    f.step(0.1, 0.2, "decode", [("other", 1, "decode")])
    r = TimelineReducer(max_lanes=2)
    r.add(f.timeline())
    d = r.drain()
    assert sorted(set(d["lanes"]["lane"])) == [0, 1, 2]  # lanes 0, 1, then everyone else on the overflow lane
    only = TimelineReducer(only={"x0", "x1"})
    only.add(f.timeline())
    d = only.drain()
    assert len(d["steps"]["left"]) == 1  # the step without x0/x1 is left out
    assert set(d["lanes"]["request"]) == {"x0", "x1"}


def test_preemption_shows_queued_again_and_abort_while_queued():
    f = Fake()
    f.req(0.0, "p", "arrived")
    f.req(0.1, "p", "scheduled")
    f.step(0.1, 0.2, "prefill", [("p", 4, "prefill")])
    f.req(0.25, "p", "preempted")
    f.req(0.5, "p", "resumed")
    f.step(0.5, 0.6, "prefill", [("p", 5, "prefill")])
    f.req(0.0, "q", "arrived")
    f.req(0.7, "q", "finished", "abort (queued)")
    r = TimelineReducer()
    r.add(f.timeline())
    lanes = r.drain()["lanes"]
    rows = [
        (req, st, round(a, 2), round(b, 2))
        for req, st, a, b in zip(lanes["request"], lanes["state"], lanes["left"], lanes["right"])
    ]
    assert ("p", "queued", 0.0, 0.1) in rows
    assert ("p", "queued", 0.25, 0.5) in rows
    assert ("q", "queued", 0.0, 0.7) in rows


def test_speculative_acceptance_and_idle_gap():
    f = Fake()
    f.req(0.0, "s", "arrived")
    f.step(0.0, 0.1, "verify", [("s", 5, "verify")], spec_proposed=4, spec_accepted=3, output_tokens=4)
    f.step(3.0, 3.1, "verify", [("s", 5, "verify")], spec_proposed=4, spec_accepted=1, output_tokens=2)
    r = TimelineReducer(bin_s=0.5)
    r.add(f.timeline())
    r.tick(100.0)
    s = r.drain()["series"]
    assert s["spec_accept_rate"][0] == pytest.approx(0.75)
    assert s["spec_accept_rate"][-1] == pytest.approx(0.25)
    # the idle gap: the 2 s average decays over its window (4 bins) to zero, then a zero just
    # before the next busy bin, so no line slopes across the gap
    assert s["t"] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    assert s["tok_s"][1:6] == [0.0] * 5
    assert s["tok_s_avg"][:6] == pytest.approx([8.0, 4.0, 8 / 3, 2.0, 0.0, 0.0])
    assert r.drain() == {}


def test_grammar_compiles_are_lane_spans_and_jump_forward_is_in_the_step_tooltip():
    """A structured request's grammar: compiled (for 250 ms) is a span ending where the request
    arrived; found in the cache, nothing. A step's jump-forward tokens (steps saved) show beside
    its drafts."""
    f = Fake()
    f.req(1.0, "a", "arrived")
    f.req(1.0, "a", "grammar", "json compiled in 250.0 ms")
    f.req(1.1, "b", "arrived")
    f.req(1.1, "b", "grammar", "json cached (compiled in 250.0 ms)")
    f.step(1.2, 1.3, "verify", [("a", 6, "verify"), ("b", 1, "decode")], jump_forward_tokens=5, output_tokens=7)
    f.step(1.3, 1.4, "verify", [("a", 3, "verify")], spec_proposed=2, spec_accepted=1, jump_forward_tokens=0)
    r = TimelineReducer(bin_s=0.5)
    r.add(f.timeline())
    cols = r.drain()
    lanes = cols["lanes"]
    spans = [(lanes["left"][i], lanes["right"][i]) for i, st in enumerate(lanes["state"]) if st == "grammar"]
    assert spans == [pytest.approx((-0.25, 0.0))]  # the compile's 250 ms, up to its arrival (the origin)
    assert STATE_COLORS["grammar"] in lanes["color"]
    assert cols["steps"]["spec"] == ["jump-forward 5 tok", "1/2"]


def test_a_long_idle_gap_is_flat_at_zero():
    """70 s idle: the average is zero two seconds after the last token; one row marks the end."""
    f = Fake()
    f.req(0.0, "s", "arrived")
    f.step(0.0, 0.1, "decode", [("s", 1, "decode")], output_tokens=10)
    f.step(70.0, 70.1, "decode", [("s", 1, "decode")], output_tokens=10)
    r = TimelineReducer(bin_s=0.5, smooth_s=2.0)
    r.add(f.timeline())
    r.tick(100.0)
    s = r.drain()["series"]
    assert s["t"] == [0.5, 1.0, 1.5, 2.0, 2.5, 70.0, 70.5]
    assert s["tok_s_avg"][4:6] == [0.0, 0.0]


def test_tick_closes_bins_and_late_events_join_the_next_bin():
    f = Fake()
    f.step(0.0, 0.1, "decode", [("a", 1, "decode")], output_tokens=1)
    r = TimelineReducer(bin_s=0.5)
    r.add(f.timeline())
    r.tick(0.4)
    assert "series" not in r.drain()  # bin still open
    r.tick(0.8)
    assert r.drain()["series"]["t"] == [0.5]
    f.step(0.3, 0.45, "decode", [("a", 1, "decode")], output_tokens=1)  # arrives after its bin closed
    r.add(f.timeline())
    r.tick(5.0)
    assert r.drain()["series"]["t"] == [1.0]


def test_accepts_dicts_and_is_pure():
    r = TimelineReducer()
    r.add(
        {
            "steps": [
                {
                    "seq": 1,
                    "start": 1.0,
                    "end": 1.5,
                    "phase": "mixed",
                    "batch": [["abc", 3, "prefill"], ["def", 1, "decode"]],
                    "output_tokens": 2,
                }
            ],
            "requests": [],
        }
    )
    d = r.drain()
    assert d["steps"]["composition"] == ["1 prefill (3 tok) · 1 decode (1 tok)"]
    code = (
        "import sys, workbench.jupyter.reducer; "
        "bad = [m for m in ('bokeh', 'ipywidgets', 'IPython', 'torch', 'zmq') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


# -- expert routing ---------------------------------------------------------------------------------
def test_expert_load_over_a_window_and_each_layers_imbalance():
    from workbench.jupyter.expert_load import ExpertLoad
    from workbench.jupyter.tooltips import routing_text
    from workbench.timeline import imbalance

    steps = [
        {"seq": i + 1, "start": i, "end": i + 0.5, "phase": "decode", "expert_counts": [[4, 0, 0, 0], [1, 1, 1, 1]]}
        for i in range(3)
    ]
    load = ExpertLoad(window=2)
    assert load.add({"steps": steps}) and not load.add({"steps": steps})  # seen already: nothing new
    cols = load.columns()
    assert cols["layer"] == [0] * 4 + [1] * 4 and cols["expert"] == [0, 1, 2, 3] * 2
    assert cols["tokens"] == [8, 0, 0, 0, 2, 2, 2, 2]  # the newest 2 steps only
    assert cols["share"][:4] == [1.0, 0.0, 0.0, 0.0]
    assert load.imbalance_by_layer() == [4.0, 1.0]
    assert imbalance([3, 1]) == 1.5 and imbalance([0, 0]) != imbalance([0, 0])  # nan when idle
    assert routing_text([[4, 0, 0, 0], [1, 1, 1, 1]]) == "L0 e0:4 (4.0x) · L1 e0:1 (1.0x)"
    assert routing_text([]) == "-"
    assert not ExpertLoad().add({"steps": [{"seq": 1, "start": 0, "end": 1, "phase": "decode"}]})  # dense


def test_the_step_tooltip_and_the_heatmap_show_the_routing():
    from workbench.jupyter.expert_load import ExpertLoad
    from workbench.jupyter.reducer import TimelineReducer
    from workbench.jupyter.views import ExpertHeatmap

    red = TimelineReducer()
    red.add(
        {
            "steps": [
                {
                    "seq": 1,
                    "start": 0.0,
                    "end": 0.1,
                    "phase": "decode",
                    "batch": [["r", 1, "decode"]],
                    "expert_counts": [[0, 2], [1, 1]],
                }
            ],
            "requests": [],
        }
    )
    assert red.drain()["steps"]["routing"] == ["L0 e1:2 (2.0x) · L1 e0:1 (1.0x)"]
    load = ExpertLoad()
    load.add({"steps": [{"seq": 1, "start": 0.0, "end": 0.1, "phase": "decode", "expert_counts": [[0, 2], [1, 1]]}]})
    view = ExpertHeatmap()
    view.update(load.columns(), load.imbalance_by_layer())
    assert view.source.data["tokens"] == [0, 2, 1, 1]
    assert "worst imbalance 2.00x (layer 0" in view.figure.title.text
    assert (view.figure.y_range.start, view.figure.y_range.end) == (-0.5, 1.5)
    # two layers get rows a person can read, whole-number ticks and a colour bar for the shares
    from bokeh.models import ColorBar

    assert view.figure.height >= 180
    assert view.figure.yaxis[0].ticker.interval == view.figure.xaxis[0].ticker.interval == 1
    bars = [r for r in view.figure.right if isinstance(r, ColorBar)]
    assert bars and bars[0].color_mapper is view.mapper and view.mapper.high == 1.0


def test_lanes_are_named_by_prompt_and_changes_are_markers():
    """A lane carries its request's prompt start (also on the step that follows its "finished"
    event, as the engine records them); each settings change is one marker row: what changed,
    who asked, how long applying it stalled the engine."""
    from workbench.timeline import ChangeEvent

    f = two_requests()
    f.requests[0].label = "Once upon a time"  # A's "arrived"; B has no text: its id names it
    f.seq += 1
    change = ChangeEvent(
        f.seq,
        10.5,
        10.9,
        {"quantization": ["none", "int8"], "max_num_seqs": [4, 8]},
        by="notebook kernel (pid 7)",
        relayout=True,
    )
    tl = f.timeline()
    tl.changes = [change]
    r = TimelineReducer()
    r.add(tl)
    d = r.drain()
    lanes = d["lanes"]
    a_rows = [label for label, req in zip(lanes["label"], lanes["request"]) if req == "aaaaaa"]
    assert a_rows and set(a_rows) == {"Once upon a time"}  # every rect, the one after "finished" too
    assert {label for label, req in zip(lanes["label"], lanes["request"]) if req == "bbbbbb"} == {"bbbbbb"}
    assert r.lane_labels == {0: "Once upon a time", 1: "bbbbbb"}
    ch = d["changes"]
    assert ch["label"] == ["quantization: 'none' → 'int8', max_num_seqs: 4 → 8"]
    assert ch["by"] == ["notebook kernel (pid 7)"] and ch["relayout"] == [True]
    assert ch["t"][0] == pytest.approx(0.5) and ch["end"][0] == pytest.approx(0.9)
    assert ch["apply_ms"][0] == pytest.approx(400.0)
    # re-reading overlapping history adds nothing twice
    r.add(tl)
    assert "changes" not in r.drain()


def test_chrome_trace_marks_each_change():
    from workbench.timeline import ChangeEvent

    tl = two_requests().timeline()
    tl.changes = [
        ChangeEvent(99, 10.5, 10.9, {"kv_cache_dtype": ["auto", "int8"]}, by="cli", relayout=True),
        ChangeEvent(100, 11.0, 11.0, {"max_num_seqs": [4, 8]}, by="cli"),
    ]
    events = [e for e in tl.to_chrome_trace()["traceEvents"] if e.get("cat") == "settings"]
    marks = [e for e in events if e["ph"] == "i"]
    assert [m["name"] for m in marks] == ["kv_cache_dtype: 'auto' → 'int8'", "max_num_seqs: 4 → 8"]
    assert all(m["s"] == "g" for m in marks) and marks[0]["ts"] == pytest.approx(10.5e6)
    stalls = [e for e in events if e["ph"] == "X"]
    assert len(stalls) == 1 and stalls[0]["dur"] == pytest.approx(0.4e6)  # only the re-layout stalls


def test_tokens_per_second_is_averaged_over_a_window():
    """Steady decode at 4 steps/s into 0.5 s bins catches 2 or 3 steps per bin: the per-bin rate
    zig-zags, the 2 s average does not."""
    f = Fake()
    f.req(0.0, "aaaaaaaa", "arrived")
    t = 0.0
    for _ in range(40):  # 10 s of one decode step every 0.26 s
        f.step(t, t + 0.01, "decode", [("aaaaaaaa", 1, "decode")], output_tokens=1)
        t += 0.26
    r = TimelineReducer(bin_s=0.5, smooth_s=2.0)
    r.add(f.timeline())
    r.tick(1e9)
    series = r.drain()["series"]
    raw, avg = series["tok_s"][4:-1], series["tok_s_avg"][4:-1]  # past the first window, before the last bin
    assert max(raw) - min(raw) >= 2.0  # 1 or 2 (or 3) steps per bin: 2-6 tok/s
    assert max(avg) - min(avg) <= 0.6 and all(abs(a - 1 / 0.26) < 0.5 for a in avg)
    assert series["tok_s_avg"][0] == series["tok_s"][0]  # the first bin is its own average


def test_where_each_step_spent_its_time():
    """Issue 27.3: a step's parts (scheduler, tensors, layers, LM head, sampling, outputs, send) in
    its tooltip, biggest first; the breakdown over a run names the part that limits it."""
    from workbench.jupyter.dashboard import step_time_text
    from workbench.timeline import STEP_PARTS, step_breakdown

    f = Fake()
    f.step(
        0.0,
        0.010,
        "decode",
        [("a", 1, "decode")],
        parts={"schedule": 0.5, "prepare": 0.5, "layers": 7.0, "lm_head": 1.5, "sample": 0.2, "outputs": 0.3},
    )
    f.step(0.012, 0.020, "decode", [("a", 1, "decode")], parts={"layers": 6.0, "lm_head": 1.0, "send": 1.0})
    f.step(0.020, 0.021, "decode", [("a", 1, "decode")])  # a simulated step: no parts
    r = TimelineReducer(t0=0.0)
    r.add(f.timeline())
    parts = r.drain()["steps"]["parts"]
    assert parts[0] == (
        "layers 7.0 ms (70%), lm_head 1.5 ms (15%), schedule 0.5 ms (5%), prepare 0.5 ms (5%), "
        "outputs 0.3 ms (3%), sample 0.2 ms (2%)"
    )
    assert parts[1].startswith("layers 6.0 ms (75%)") and parts[2] == "-"
    b = step_breakdown(f.steps)
    assert b["steps"] == 3 and b["limit"] == "layers" and set(b["parts_ms"]) == set(STEP_PARTS)
    assert b["parts_ms"]["layers"] == 13.0 and b["parts_share"]["layers"] == pytest.approx(13 / 18)
    assert b["between_steps_share"] == pytest.approx(1 - 19 / 21)  # 2 ms idle between the first two
    assert step_breakdown([]) == {}
    text = step_time_text({"step_parts_share": b["parts_share"]})
    assert text.startswith(" · step time: layers 72%, lm_head 14%") and step_time_text({}) == ""
    assert "device" not in text and "device_busy_share" not in b  # no CUDA step: no device gap measured


def test_the_devices_idle_gaps_between_steps():
    """Issue 50.4: on CUDA each step records the device's idle time before it ("device_idle", CUDA
    events; not a part of the step): its tooltip says it, and a run's breakdown gives the device's
    busy share, which the dashboard shows."""
    from workbench.jupyter.dashboard import step_time_text
    from workbench.timeline import step_breakdown

    f = Fake()
    f.step(0.0, 0.010, "decode", [("a", 1, "decode")], parts={"prepare": 1.0, "layers": 6.0, "sample": 1.0})
    f.step(0.010, 0.020, "decode", [("a", 1, "decode")],
           parts={"prepare": 1.0, "layers": 6.0, "lm_head": 1.0, "sample": 1.0, "device_idle": 2.0})  # fmt: skip
    r = TimelineReducer(t0=0.0)
    r.add(f.timeline())
    parts = r.drain()["steps"]["parts"]
    assert parts[1].startswith("layers 6.0 ms (67%)") and parts[1].endswith("; the device idled 2.00 ms before it")
    b = step_breakdown(f.steps)
    assert "device_idle" not in b["parts_ms"]
    assert b["device_busy_share"] == pytest.approx(15 / 17)  # layers, lm_head, sample: 15 ms; idle 2 ms
    assert step_time_text({"step_parts_share": b["parts_share"], "device_busy_share": 0.88}).endswith(
        " · device busy 88%"
    )


def test_a_clusters_replicas_get_a_band_each_with_the_routers_decisions():
    """Issue 28: a merged timeline names the replica on each event; each replica's steps row and
    lanes form a band of their own (stacked), and a lane says why the router sent it there."""
    f = Fake()
    f.req(0.0, "a", "routed", "least_loaded")
    f.requests[-1].replica = "c-r0"
    f.req(0.0, "b", "routed", "prefix_affinity (a 64-long prefix seen there)")
    f.requests[-1].replica = "c-r1"
    for rid, rep in (("a", "c-r0"), ("b", "c-r1")):
        f.req(0.01, rid, "arrived")
        f.requests[-1].replica, f.requests[-1].label = rep, f"prompt {rid}"
        f.req(0.02, rid, "scheduled")
        f.requests[-1].replica = rep
    f.step(0.02, 0.05, "prefill", [("a", 5, "prefill")], replica="c-r0")
    f.step(0.02, 0.06, "prefill", [("b", 7, "prefill")], replica="c-r1")
    r = TimelineReducer(t0=0.0, lanes_per_replica=4)
    r.add(f.timeline())
    out = r.drain()
    steps, lanes = out["steps"], out["lanes"]
    assert steps["replica"] == ["c-r0", "c-r1"]
    assert [b + 0.4 for b in steps["bottom"]] == pytest.approx([0, 6])  # band = steps row + 4 lanes + overflow
    assert r.replicas == ["c-r0", "c-r1"]
    by_req = dict(zip(lanes["request"], zip(lanes["lane"], lanes["routed"])))
    assert by_req["a"] == (0, "c-r0: least_loaded")
    assert by_req["b"][0] == 6 and by_req["b"][1].startswith("c-r1: prefix_affinity")
    assert r.lane_labels[-1] == "c-r0 steps" and r.lane_labels[5] == "c-r1 steps"  # y = lane + 1
    assert r.lane_labels[0] == "prompt a" and r.lane_labels[6] == "prompt b"
    assert r.num_lanes == 7


def test_the_host_plot_shows_only_with_samples():
    """A finished (`--timeline`) or simulated run has no host samples: no empty host plot under
    it; the live dashboard's appears with its first sample."""
    from workbench.jupyter.views import TimelineView, static_timeline, to_columns

    red = TimelineReducer()
    red.add(two_requests().timeline())
    view = static_timeline(to_columns(red), red.num_lanes, lane_labels=red.lane_labels)
    assert view.sources["steps"].data["left"] and not view.figures["host"].visible
    live = TimelineView(live=True)
    live.push({"steps": {}})
    assert not live.figures["host"].visible
    red.add_metrics(
        {"engine_cpu_pct": 50.0, "host_cpu_pct": 60.0, "host_mem_pct": 40.0, "kv_blocks_used": 1, "kv_blocks_total": 8},
        11.0,
    )
    live.push(red.drain())
    assert live.figures["host"].visible


def test_the_dashboards_numbers_say_their_window_and_hide_what_is_off():
    """A tester saw 'spec accepted 100%' with speculative decoding off (counted since start) and
    'TTFT p50 909 ms' beside plotted TTFTs under 125 ms (another window): each number names its
    window, and the acceptance shows only while speculation is on."""
    from workbench.jupyter.dashboard import metrics_text

    m = {"output_tok_s": 12.5, "window_s": 10.0, "prefix_hit_rate": 0.4, "spec_acceptance_rate": 1.0,
         "ttft_p50_ms": 909.0, "itl_p50_ms": 12.0, "recent_requests": 37}  # fmt: skip
    off = metrics_text(m, {"speculative": "off"})
    assert "spec accepted" not in off
    assert "12.5 tok/s (last 10 s)" in off and "prefix hits 40% (since start)" in off
    assert "TTFT p50 909 ms, ITL p50 12 ms (last 37 requests)" in off
    on = metrics_text(m, {"speculative": "ngram"})
    assert "spec accepted 100% (since start)" in on
    assert "TTFT" not in metrics_text({**m, "recent_requests": 0}, {})  # no finished request: no latency
    routed = {**m, "router": {"policy": "cascade", "share": {"small": 0.7, "large": 0.3}, "served": {"small": 7}}}
    assert "routed (cascade, since start): small 70%, large 30%" in metrics_text(routed, {})
