"""The lab websocket's coalescing on synthetic events: snapshot first, then rate-limited deltas."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from workbench.jupyter_server.coalesce import (
    MAX_HISTORY_STEPS,
    MAX_RATE_HZ,
    MIN_RATE_HZ,
    SNAPSHOT_STEPS,
    EventCoalescer,
    browser_columns,
    clamp_rate,
    history_window,
    trim_timeline,
)
from workbench.timeline import BatchEntry, ChangeEvent, RequestEvent, StepEvent, Timeline


def tl(steps=(), requests=(), cursor=None) -> dict:
    steps = [
        StepEvent(seq=s, start=float(s), end=s + 0.5, phase=p, batch=[BatchEntry("r", 1, "decode")]) for s, p in steps
    ]
    requests = [RequestEvent(seq=s, time=float(s), request_id=r, kind=k) for s, r, k in requests]
    seqs = [s.seq for s in steps] + [r.seq for r in requests]
    t = Timeline(steps=steps, requests=requests, cursor=cursor if cursor is not None else max(seqs, default=0))
    return msgspec.to_builtins(t)


def snap(c: EventCoalescer, timeline=None, now=0.0, **kw):
    return c.snapshot(
        engine="e",
        status={"model": "m"},
        settings={"max_num_seqs": 64},
        metrics={"output_tok_s": 0.0},
        timeline=timeline or tl(),
        now=now,
        **kw,
    )


def test_timeline_structs_json_through_msgspec():
    d = tl(steps=[(1, "prefill")], requests=[(2, "r", "arrived")])
    assert d["steps"][0]["phase"] == "prefill"
    assert d["steps"][0]["batch"] == [["r", 1, "decode"]]  # array_like entries
    assert "num_prefill_tokens" not in d["steps"][0]  # defaults omitted
    assert d["requests"][0]["kind"] == "arrived"
    assert d["cursor"] == 2


def test_nothing_before_the_snapshot():
    c = EventCoalescer(10)
    c.add("metrics", {"output_tok_s": 1.0}, 1.0)
    assert not c.due(100.0)
    assert c.flush(100.0, force=True) is None


def test_snapshot_first_then_deltas_without_duplicates():
    c = EventCoalescer(10)
    # subscribed before the snapshot was read: events 1-3 are in the snapshot, 4-5 are not
    c.add("timeline", tl(steps=[(1, "prefill"), (3, "decode")], requests=[(2, "r", "arrived")]), 3.0)
    c.add("timeline", tl(steps=[(4, "decode")], requests=[(5, "r", "finished")]), 5.0)
    s = snap(c, tl(steps=[(1, "prefill"), (3, "decode")], requests=[(2, "r", "arrived")]), now=0.0)
    assert s["type"] == "snapshot" and s["timeline"]["cursor"] == 3
    assert s["settings"] == {"max_num_seqs": 64} and s["rate"] == 10
    d = c.flush(0.1)
    assert d["type"] == "delta"
    assert [x["seq"] for x in d["timeline"]["steps"]] == [4]
    assert [x["seq"] for x in d["timeline"]["requests"]] == [5]
    assert d["timeline"]["cursor"] == 5
    # an event repeating what was sent is dropped
    c.add("timeline", tl(steps=[(4, "decode")]), 5.0)
    assert c.flush(1.0) is None


def test_every_view_of_an_engine_shares_one_clock():
    """x = 0 is the engine process's start: a panel that connected early and a timeline opened
    minutes later (a snapshot whose oldest event is later) put the same event at the same x."""
    early, late = EventCoalescer(10), EventCoalescer(10)
    status = {"model": "m", "started_monotonic": 2.0}
    a = early.snapshot(
        engine="e", status=status, settings={}, metrics={}, timeline=tl(steps=[(3, "prefill"), (9, "decode")]), now=10.0
    )
    b = late.snapshot(engine="e", status=status, settings={}, metrics={}, timeline=tl(steps=[(9, "decode")]), now=10.0)
    assert a["t0"] == b["t0"] == 2.0
    assert a["columns"]["steps"]["left"][-1] == b["columns"]["steps"]["left"][-1] == 7.0
    # without the start (an older engine, a remote server): the earliest event shown
    assert snap(EventCoalescer(10), tl(steps=[(4, "decode")]))["t0"] == 4.0


def test_rate_limit_coalesces_events():
    c = EventCoalescer(rate_hz=2)  # one delta per 0.5 s
    snap(c, now=0.0)
    for i in range(1, 11):
        c.add("timeline", tl(steps=[(i, "decode")]), float(i))
        c.add("metrics", {"output_tok_s": float(i)}, float(i))
    assert not c.due(0.3)
    assert c.flush(0.3) is None
    assert c.next_flush_in(0.3) == pytest.approx(0.2)
    d = c.flush(0.5)
    assert len(d["timeline"]["steps"]) == 10
    assert d["metrics"] == {"output_tok_s": 10.0}  # the latest wins
    assert c.flush(0.6) is None  # nothing pending
    c.add("metrics", {"output_tok_s": 11.0}, 11.0)
    assert c.flush(0.7) is None and c.flush(1.0) is not None


def test_settings_keep_latest_and_union_of_changes():
    c = EventCoalescer(10)
    snap(c)
    c.add("settings", {"changes": {"max_num_seqs": 8}, "settings": {"max_num_seqs": 8, "batching": "continuous"}})
    c.add("settings", {"changes": {"batching": "static"}, "settings": {"max_num_seqs": 8, "batching": "static"}})
    d = c.flush(1.0)
    assert d["settings"] == {"max_num_seqs": 8, "batching": "static"}
    assert d["changes"] == {"max_num_seqs": 8, "batching": "static"}
    assert "timeline" not in d and "metrics" not in d


def test_status_read_again_rides_the_next_delta():
    c = EventCoalescer(10)
    snap(c)
    assert not c.pending()
    c.add("status", {"kernel_variant": "torch", "prefill_attention": None})
    c.add("status", {"kernel_variant": "avx512_bf16", "prefill_attention": "sdpa"})  # the latest is kept
    d = c.flush(1.0)
    assert d["status"] == {"kernel_variant": "avx512_bf16", "prefill_attention": "sdpa"}
    c.add("metrics", {"output_tok_s": 1.0})
    assert "status" not in c.flush(2.0)  # sent once


def test_engine_stop_is_sent_at_once_and_relayout_kept_in_order():
    c = EventCoalescer(rate_hz=MIN_RATE_HZ)
    snap(c, now=0.0)
    c.add("relayout", {"setting": "quantization", "value": "int8", "state": "started"})
    c.add("relayout", {"setting": "quantization", "value": "int8", "state": "done"})
    c.add("engine", {"state": "stopped"})
    assert c.due(0.01)  # well inside the 5 s interval
    d = c.flush(0.01)
    assert d["engine"]["state"] == "stopped"
    assert [r["state"] for r in d["relayout"]] == ["started", "done"]


def test_dead_engine_marked():
    c = EventCoalescer(10)
    snap(c)
    c.mark_dead("gone")
    d = c.flush(0.0)
    assert d["engine"] == {"state": "dead", "reason": "gone"}


def test_cap_drops_oldest_and_counts():
    c = EventCoalescer(10, max_steps=3)
    snap(c)
    c.add("timeline", tl(steps=[(i, "decode") for i in range(1, 8)]))
    d = c.flush(1.0)
    assert [s["seq"] for s in d["timeline"]["steps"]] == [5, 6, 7]
    assert d["dropped"] == 4
    assert d["timeline"]["cursor"] == 7


def test_snapshot_is_trimmed_to_the_newest():
    c = EventCoalescer(10)
    s = snap(c, tl(steps=[(i, "decode") for i in range(1, 101)]), window=10)
    assert [x["seq"] for x in s["timeline"]["steps"]] == list(range(91, 101))
    assert s["timeline"]["cursor"] == 100
    assert s["window"] == 10 and s["older"] is True  # 90 steps were left out
    whole = snap(EventCoalescer(10), tl(steps=[(i, "decode") for i in range(1, 11)]), window=10)
    assert whole["older"] is False
    out, cut = trim_timeline(tl(requests=[(i, "r", "arrived") for i in range(1, 6)]), 10, 2)
    assert [r["seq"] for r in out["requests"]] == [4, 5] and cut == 3


def test_snapshot_bounds_batch_entries_not_only_steps():
    """A step of a wide batch weighs as much as many narrow ones: the window holds at most
    16 batch entries per step on average, newest steps first."""
    wide = {**tl(steps=[(1, "decode")])["steps"][0], "batch": [["r", 1, "decode"]] * 64}
    steps = [{**wide, "seq": i, "start": float(i)} for i in range(1, 201)]
    out, cut = trim_timeline({"steps": steps, "requests": [], "cursor": 200}, 100, 400, max_entries=16 * 100)
    assert [s["seq"] for s in out["steps"]] == list(range(176, 201)) and cut == 175  # 25 x 64 = 1600 entries
    s = snap(EventCoalescer(10), {"steps": steps, "requests": [], "cursor": 200}, window=100)
    assert len(s["timeline"]["steps"]) == 25 and s["older"] is True


def test_unknown_kinds_are_not_relayed():
    c = EventCoalescer(10)
    snap(c)
    c.add("sync", {"token": "x"})
    assert not c.pending()


@pytest.mark.parametrize(
    "given,expected",
    [
        (5, 5.0),
        ("20", 20.0),
        ("x", 10.0),
        (None, 10.0),
        (0, MIN_RATE_HZ),
        (1e6, MAX_RATE_HZ),
        (float("nan"), 10.0),
    ],
)
def test_clamp_rate(given, expected):
    assert clamp_rate(given) == expected


def test_set_rate_changes_interval():
    c = EventCoalescer(10)
    assert c.set_rate(4) == 4.0 and c.interval == 0.25
    assert c.set_rate("bogus") == 4.0


@pytest.mark.parametrize(
    "given,expected",
    [
        (None, SNAPSHOT_STEPS),
        ("x", SNAPSHOT_STEPS),
        (10, SNAPSHOT_STEPS),
        (2000, 2000),
        (10**9, MAX_HISTORY_STEPS),
        (float("inf"), SNAPSHOT_STEPS),
    ],
)
def test_history_window_is_bounded(given, expected):
    assert history_window(given) == expected


# -- the drawn columns come from the notebook's reducer ---------------------------------------------
FIXTURE = Path(__file__).resolve().parents[1] / "extension" / "test" / "fixtures" / "reducer_messages.json"


def _reducer_messages(with_sources: bool = False):
    """A snapshot and a delta for two requests (one queued behind the other), as the websocket
    sends them: the jest tests apply exactly these (`extension/test/fixtures`). `with_sources`:
    also the engine timelines they came from."""

    def step(seq, start, phase, batch, **kw):
        return StepEvent(
            seq=seq, start=start, end=start + 0.05, phase=phase, batch=[BatchEntry(*b) for b in batch], **kw
        )

    first = Timeline(
        steps=[step(3, 10.0, "prefill", [("aaaaaa1", 5, "prefill")], num_prefill_tokens=5)],
        requests=[
            RequestEvent(seq=1, time=9.9, request_id="aaaaaa1", kind="arrived", label="Once upon a time"),
            RequestEvent(seq=2, time=10.0, request_id="aaaaaa1", kind="scheduled"),
        ],
        cursor=3,
    )
    second = Timeline(
        steps=[
            step(
                6,
                10.1,
                "mixed",
                [("aaaaaa1", 1, "decode"), ("bbbbbb2", 4, "prefill")],
                num_prefill_tokens=4,
                num_decode_tokens=1,
                target_ms=400.0,  # the step-time target cut the prompt's chunk
                predicted_ms=392.4,
            ),
            step(8, 10.2, "decode", [("aaaaaa1", 1, "decode"), ("bbbbbb2", 1, "decode")], num_decode_tokens=2),
        ],
        requests=[
            RequestEvent(seq=4, time=10.05, request_id="bbbbbb2", kind="arrived"),
            RequestEvent(seq=5, time=10.1, request_id="bbbbbb2", kind="scheduled"),
            RequestEvent(seq=7, time=10.15, request_id="aaaaaa1", kind="first_token"),
            RequestEvent(seq=9, time=10.25, request_id="aaaaaa1", kind="finished", detail="length"),
        ],
        changes=[
            ChangeEvent(
                seq=10,
                start=10.21,
                end=10.24,
                changes={"quantization": ["none", "int8"]},
                by="notebook kernel (pid 1)",
                relayout=True,
            )
        ],
        cursor=10,
    )
    c = EventCoalescer(rate_hz=10)
    messages = [snap(c, msgspec.to_builtins(first), now=10.06)]
    c.add("timeline", msgspec.to_builtins(second), time=10.25)
    messages.append(c.flush(now=11.0))
    messages = json.loads(json.dumps(messages))
    return (messages, (first, second)) if with_sources else messages


def test_messages_carry_the_notebook_reducers_columns_and_palette():
    from workbench.jupyter.reducer import PHASE_COLORS, STATE_COLORS, TimelineReducer

    (snapshot, delta), (first, second) = _reducer_messages(with_sources=True)
    assert snapshot["palette"] == {"phase": PHASE_COLORS, "state": STATE_COLORS}
    assert snapshot["t0"] == 9.9  # the first event: x = 0
    reducer = TimelineReducer(t0=9.9)
    reducer.add(first)
    assert snapshot["columns"] == browser_columns(reducer.drain())
    reducer.add(second)
    expected = reducer.drain()
    assert delta["columns"] == browser_columns(expected)
    assert delta["columns"]["lanes"]["state"] == expected["lanes"]["state"]
    assert delta["columns"]["lanes"]["left"] == [round(t, 6) for t in expected["lanes"]["left"]]
    assert delta["columns"]["steps"]["phase"] == ["mixed", "decode"]
    assert delta["columns"]["steps"]["bound"] == ["cut to the 400 ms step target (predicted 392 ms)", "-"]
    assert delta["columns"]["steps"]["color"] == [PHASE_COLORS["mixed"], PHASE_COLORS["decode"]]
    assert all("batch" not in s for s in snapshot["timeline"]["steps"] + delta["timeline"]["steps"])  # sent once
    # lanes are named by their prompt's start (else the request id); a settings change is a marker
    assert snapshot["columns"]["lanes"]["label"][0] == "Once upon a time"
    assert delta["columns"]["lanes"]["label"][-1] == "bbbbbb"
    changes = delta["columns"]["changes"]
    assert changes["label"] == ["quantization: 'none' → 'int8'"] and changes["by"] == ["notebook kernel (pid 1)"]
    assert changes["t"] == [round(10.21 - 9.9, 6)] and changes["relayout"] == [True]
    assert changes["apply_ms"][0] == pytest.approx(30.0)


def test_the_browsers_fixture_is_what_the_coalescer_sends():
    """extension/test/fixtures/reducer_messages.json (what jest applies) must not drift from the
    Python side; rewrite it with WORKBENCH_WRITE_FIXTURES=1."""
    messages = _reducer_messages()
    if os.environ.get("WORKBENCH_WRITE_FIXTURES"):
        FIXTURE.write_text(json.dumps(messages, indent=1) + "\n")
    assert json.loads(FIXTURE.read_text()) == messages


def test_metrics_samples_become_the_host_plots_rows():
    """Each metrics event after the snapshot is a row of the host plot (x on the timeline's axis);
    a figure the engine did not measure is null (JSON has no NaN), a gap in the line."""
    c = EventCoalescer(rate_hz=10)
    snap(
        c,
        {"steps": [], "requests": [{"seq": 1, "time": 100.0, "request_id": "a", "kind": "arrived"}], "cursor": 1},
        now=100.0,
    )
    c.add(
        "metrics",
        {
            "process_cpu_cores": 1.0,
            "host_cpus": 4,
            "host_cpu_percent": 50.0,
            "host_mem_percent": 20.0,
            "kv_usage": 0.25,
            "process_rss_mb": 900.0,
        },
        time=101.5,
    )
    c.add("metrics", {"kv_usage": 0.5}, time=102.5)  # a remote server: no host figures
    msg = c.flush(now=103.0)
    host = msg["columns"]["host"]
    assert host["t"] == [1.5, 2.5] and host["engine_cpu_pct"] == [25.0, None]
    assert host["host_cpu_pct"] == [50.0, None] and host["kv_pct"] == [25.0, 50.0]
    json.dumps(msg, allow_nan=False)  # what the websocket sends is valid JSON
