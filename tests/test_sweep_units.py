"""Pure parts of sweeps: Pareto fronts, noise overlap, cost and energy, the grid, aggregation."""

import math

import pytest

from workbench.tuning import costs
from workbench.tuning.grid import grid_points, point_label
from workbench.tuning.measure import aggregate
from workbench.tuning.pareto import annotate, dominates, noise_overlaps, pareto_front, ranges_overlap, spread
from workbench.tuning.plots import front_line, plot_data

MAXMIN = [("tps", "max"), ("lat", "min")]


def pts(*pairs):
    return [{"tps": a, "lat": b} for a, b in pairs]


def test_pareto_front_two_objectives():
    p = pts((100, 50), (200, 80), (150, 40), (90, 60), (200, 90), (50, 10))
    # (90,60) is dominated by (100,50); (200,90) by (200,80); the others trade off.
    assert pareto_front(p, MAXMIN) == [1, 2, 5]
    assert dominates(p[0], p[3], MAXMIN) and not dominates(p[3], p[0], MAXMIN)
    assert not dominates(p[1], p[2], MAXMIN) and not dominates(p[2], p[1], MAXMIN)


def test_pareto_front_edge_cases():
    assert pareto_front([], MAXMIN) == []
    assert pareto_front(pts((1, 1)), MAXMIN) == [0]
    # exact duplicates do not dominate each other: both stay
    assert pareto_front(pts((5, 5), (5, 5), (4, 6)), MAXMIN) == [0, 1]
    # equal on one objective, better on the other: dominated
    assert pareto_front(pts((5, 5), (5, 4)), MAXMIN) == [1]
    # missing values are never on the front and dominate nothing
    p = [{"tps": None, "lat": 0}, {"tps": 1.0, "lat": float("nan")}, {"tps": 1, "lat": 9}]
    assert pareto_front(p, MAXMIN) == [2]
    # all minimised / all maximised
    assert pareto_front(pts((1, 3), (2, 2), (3, 1), (3, 3)), [("tps", "min"), ("lat", "min")]) == [0, 1, 2]
    assert pareto_front(pts((1, 3), (2, 2), (3, 1), (3, 3)), [("tps", "max"), ("lat", "max")]) == [3]
    with pytest.raises(ValueError, match="'max' or 'min'"):
        pareto_front(pts((1, 1), (2, 2)), [("tps", "up")])
    with pytest.raises(ValueError):
        pareto_front(pts((1, 1)), [])


def test_pareto_front_three_objectives_matches_brute_force():
    import random

    rng = random.Random(3)
    p = [{"a": rng.randint(0, 9), "b": rng.randint(0, 9), "c": rng.randint(0, 9)} for _ in range(60)]
    obj = [("a", "max"), ("b", "min"), ("c", "min")]
    front = pareto_front(p, obj)
    for i, x in enumerate(p):
        beaten = any(
            y["a"] >= x["a"]
            and y["b"] <= x["b"]
            and y["c"] <= x["c"]
            and (y["a"], y["b"], y["c"]) != (x["a"], x["b"], x["c"])
            for y in p
        )
        assert (i in front) == (not beaten)


def test_noise_overlaps_and_annotate():
    recs = [
        {
            "label": "a",
            "output_tok_s": 100,
            "output_tok_s_min": 90,
            "output_tok_s_max": 110,
            "ttft_p99_ms": 50,
            "itl_p99_ms": 5,
        },
        {
            "label": "b",
            "output_tok_s": 105,
            "output_tok_s_min": 108,
            "output_tok_s_max": 120,
            "ttft_p99_ms": 60,
            "itl_p99_ms": 6,
        },
        {
            "label": "c",
            "output_tok_s": 200,
            "output_tok_s_min": 195,
            "output_tok_s_max": 205,
            "ttft_p99_ms": 80,
            "itl_p99_ms": 4,
        },
        {"label": "d", "output_tok_s": 50, "ttft_p99_ms": 100, "itl_p99_ms": 9},  # one run: zero-width range
    ]
    assert noise_overlaps(recs, "output_tok_s") == [[1], [0], [], []]
    annotate(recs)
    assert [r["noisy"] for r in recs] == [True, True, False, False]
    assert recs[0]["overlaps"] == ["b"] and recs[2]["overlaps"] == []
    assert [r["pareto_ttft_p99"] for r in recs] == [True, True, True, False]
    assert [r["pareto_itl_p99"] for r in recs] == [False, False, True, False]
    assert [r["pareto"] for r in recs] == [True, True, True, False]
    assert ranges_overlap((1, 2), (2, 3)) and not ranges_overlap((1, 2), (2.5, 3))
    s = spread([3, 1, 2])
    assert s == {"median": 2, "min": 1, "max": 3, "std": 1.0}
    assert spread([])["median"] is None


def test_costs_arithmetic_and_defaults(monkeypatch):
    # $3.60/h at 1000 tok/s: $0.001 per second -> $1 per million tokens
    assert costs.cost_per_million(1000, 3.6) == pytest.approx(1.0)
    assert costs.joules_per_token(50, 100) == pytest.approx(2.0)
    assert costs.cost_per_million(0, 3.6) is None and costs.joules_per_token(None, 100) is None
    monkeypatch.delenv("WORKBENCH_PRICE_PER_HOUR", raising=False)
    monkeypatch.delenv("WORKBENCH_WATTS", raising=False)
    assert costs.resolve(None, None, "cpu") == costs.DEFAULTS["cpu"]
    assert costs.resolve(None, None, "cuda:1") == costs.DEFAULTS["cuda"]
    assert costs.resolve(1.5, None, "cpu") == {"price_per_hour": 1.5, "watts": costs.DEFAULTS["cpu"]["watts"]}
    monkeypatch.setenv("WORKBENCH_WATTS", "250")
    assert costs.resolve(None, None, "cpu")["watts"] == 250.0
    with pytest.raises(ValueError):
        costs.resolve(-1, None)


def test_phase_split_and_run_costs():
    steps = [
        {
            "phase": "prefill",
            "start": 0.0,
            "end": 1.0,
            "num_prefill_tokens": 100,
            "num_decode_tokens": 0,
            "output_tokens": 4,
        },
        {
            "phase": "mixed",
            "start": 1.0,
            "end": 2.0,
            "num_prefill_tokens": 30,
            "num_decode_tokens": 10,
            "output_tokens": 10,
        },
        {
            "phase": "decode",
            "start": 2.0,
            "end": 4.0,
            "num_prefill_tokens": 0,
            "num_decode_tokens": 4,
            "output_tokens": 4,
        },
        {"phase": "relayout", "start": 4.0, "end": 9.0},
    ]
    s = costs.phase_split(steps)
    assert s["prefill_s"] == pytest.approx(1.75) and s["decode_s"] == pytest.approx(2.25)
    assert s["prefill_tokens"] == 130 and s["decode_output_tokens"] == 18
    c = costs.run_costs(10.0, 3.6, 100.0, s)
    assert c["cost_per_mtok"] == pytest.approx(100.0) and c["joules_per_token"] == pytest.approx(10.0)
    assert c["prefill_tok_s"] == pytest.approx(130 / 1.75) and c["decode_tok_s"] == pytest.approx(18 / 2.25)
    assert c["decode_cost_per_mtok"] == pytest.approx(3.6 / 3600 / 8 * 1e6)
    assert c["prefill_joules_per_token"] == pytest.approx(100 / (130 / 1.75))
    live = costs.live_costs({"output_tok_s": 20.0}, price_per_hour=3.6, watts=100)
    assert live["cost_per_mtok"] == pytest.approx(50.0) and "decode_cost_per_mtok" not in live


def test_grid_points_order_and_validation():
    pts_ = grid_points({"batching": ["continuous", "static"], "quantization": ["none", "int8"], "max_num_seqs": 4})
    # the re-layout setting varies slowest
    assert [list(p) for p in pts_][0] == ["quantization", "batching", "max_num_seqs"]
    assert [(p["quantization"], p["batching"]) for p in pts_] == [
        ("none", "continuous"),
        ("none", "static"),
        ("int8", "continuous"),
        ("int8", "static"),
    ]
    assert point_label(pts_[0]) == "quantization=none batching=continuous max_num_seqs=4"
    with pytest.raises(ValueError, match="unknown setting 'batch'"):
        grid_points({"batch": [1]})
    with pytest.raises(ValueError, match="fixed when the engine starts"):
        grid_points({"block_size": [16, 32]})
    with pytest.raises(ValueError, match="batching"):
        grid_points({"batching": ["fast"]})
    with pytest.raises(ValueError, match="no values"):
        grid_points({"batching": []})
    with pytest.raises(ValueError, match="repeats a value"):
        grid_points({"max_num_seqs": [4, 4]})
    with pytest.raises(ValueError):
        grid_points({})


def test_aggregate_medians_and_spread():
    runs = [
        {"output_tok_s": 10.0, "ttft_p99_ms": 5.0, "spec_acceptance_rate": None, "requests": 4},
        {"output_tok_s": 30.0, "ttft_p99_ms": 7.0, "spec_acceptance_rate": None, "requests": 4},
        {"output_tok_s": 20.0, "ttft_p99_ms": 6.0, "spec_acceptance_rate": None, "requests": 4},
    ]
    a = aggregate(runs)
    assert a["output_tok_s"] == 20.0 and a["output_tok_s_min"] == 10.0 and a["output_tok_s_max"] == 30.0
    assert a["output_tok_s_std"] == pytest.approx(10.0) and a["ttft_p99_ms"] == 6.0
    assert a["spec_acceptance_rate"] is None and a["requests"] == 4


def test_plot_data_and_front_line():
    recs = [
        {
            "label": "a",
            "point": {"batching": "static"},
            "output_tok_s": 10.0,
            "ttft_p99_ms": 5.0,
            "itl_p99_ms": 1.0,
            "pareto_ttft_p99": True,
            "overlaps": ["b"],
        },
        {
            "label": "b",
            "point": {"batching": "continuous"},
            "output_tok_s": 20.0,
            "ttft_p99_ms": 9.0,
            "itl_p99_ms": None,
            "pareto_ttft_p99": True,
            "overlaps": [],
        },
    ]
    d = plot_data(recs)
    assert d["settings"] == ["batching=static", "batching=continuous"]
    assert d["ttft_p99_ms_color"][0] == d["ttft_p99_ms_color"][1] != d["itl_p99_ms_color"][0]
    assert d["noise"][0].startswith("within noise of b") and d["ring_width"] == [3, 1]
    assert math.isnan(d["itl_p99_ms"][1])
    assert front_line(recs, "ttft_p99_ms") == ([10.0, 20.0], [5.0, 9.0])


def test_the_pareto_plot_shows_every_whisker_and_keeps_its_legend_off_the_points():
    """A tester saw 07's legend cover a point and the y axis clip a whisker (the automatic range
    counts glyphs, not whiskers): the ranges hold every whisker end, the legend sits beside."""
    from bokeh.models import Legend

    from workbench.tuning.plots import pareto_plot, whisker_bounds

    recs = [
        {"label": "a", "output_tok_s": 10.0, "output_tok_s_min": 8.0, "output_tok_s_max": 12.0,
         "ttft_p99_ms": 50.0, "ttft_p99_ms_min": 20.0, "ttft_p99_ms_max": 400.0, "pareto_ttft_p99": True},
        {"label": "b", "output_tok_s": 20.0, "ttft_p99_ms": 90.0, "pareto_ttft_p99": True},
    ]  # fmt: skip
    layout = pareto_plot(recs, latencies=("ttft_p99_ms",))
    fig = layout.children[1].children[0]
    assert fig.y_range.start < 20.0 and fig.y_range.end > 400.0  # the whisker from 20 to 400 ms
    assert fig.x_range.start < 8.0 and fig.x_range.end > 20.0
    assert any(isinstance(r, Legend) for r in fig.right) and not any(isinstance(r, Legend) for r in fig.center)
    assert whisker_bounds([float("nan")]) is None and whisker_bounds([5.0, 5.0]) == (4.6, 5.4)


def test_live_costs_window_for_the_dashboard():
    live = costs.LiveCosts(window_s=5.0, price_per_hour=3.6, watts=100.0)
    old = {"phase": "prefill", "start": 0.0, "end": 1.0, "num_prefill_tokens": 999, "output_tokens": 1}
    recent = [
        {"phase": "prefill", "start": 10.0, "end": 11.0, "num_prefill_tokens": 100, "output_tokens": 1},
        {"phase": "decode", "start": 11.0, "end": 13.0, "num_decode_tokens": 8, "output_tokens": 8},
    ]
    live.add({"steps": [old], "requests": []})
    live.add({"steps": recent, "requests": []})
    c = live.costs({"output_tok_s": 4.0})
    assert c["prefill_tok_s"] == pytest.approx(100.0)  # the old step fell out of the window
    assert c["decode_tok_s"] == pytest.approx(4.5)  # 9 output tokens over 2 s of decode
    assert c["cost_per_mtok"] == pytest.approx(250.0)
    text = live.html({"output_tok_s": 4.0})
    assert text == (
        "cost $250 per million output tokens, 25 J each (prefill $10/M prompt tok; decode "
        "$222/M output tok) at $3.6/h and 100 W"
    )
    idle = costs.LiveCosts(window_s=10.0, price_per_hour=0.2, watts=100.0).html({"output_tok_s": 0.0})
    assert idle == "cost: nothing generated in the last 10 s (at $0.2/h and 100 W)"  # words, not dashes
