"""The serving simulator: the engine's own scheduler on simulated time (identical batches to a real
engine), step-cost models, replicas and routers, disaggregation, SLOs, the run log and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import workbench
from workbench import LLM, SamplingParams, Simulator
from workbench.bench.driver import run_workload
from workbench.bench.stats import RESULT_KEYS
from workbench.bench.workload import BenchRequest, make_workload
from workbench.jupyter.reducer import TimelineReducer
from workbench.runs import RunLog
from workbench.sim import FittedCost, RooflineCost, StepShape
from workbench.sim.cost import ModelShape, shapes_from_timeline
from workbench.sim.profiles import PROFILES
from workbench.timeline import Timeline


class Fixed:
    """A step-cost model: every step takes the same time (the batches cannot depend on it)."""

    def __call__(self, shape: StepShape) -> float:
        return 0.01

    def describe(self) -> dict:
        return {"kind": "fixed", "step_s": 0.01}


def small(n=8, seed=0, **kw):
    return make_workload(n, seed=seed, vocab_size=256, prompt_len=(8, 40), output_len=(3, 8), **kw)


def sim_for(llm, **kw) -> Simulator:
    st = llm.status()
    return Simulator(
        None,
        cost=Fixed(),
        settings=llm.settings(),
        num_kv_blocks=st["num_kv_blocks"],
        block_size=st["block_size"],
        vocab_size=256,
        **kw,
    )


def batches(timeline, order: dict[str, int]) -> list[list[tuple[int, int, str]]]:
    return [[(order[e.request_id], e.num_tokens, e.kind) for e in s.batch] for s in timeline.steps]


@pytest.mark.parametrize(
    "blocks,settings",
    [
        (24, {"max_num_seqs": 3, "max_num_batched_tokens": 32}),  # chunked prefill at odd boundaries
        (24, {"batching": "static", "max_num_seqs": 4}),
        (8, {"max_num_seqs": 8, "max_num_batched_tokens": 256}),  # every prompt fills a block: decodes preempt
    ],
)
def test_the_engine_and_the_simulator_admit_the_same_batches(tiny_llama, blocks, settings):
    """Same workload (all at t=0), same settings, same KV cache: every step's batch is identical,
    since both run the same Scheduler (a scheduler change shows up in both)."""
    llm = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=blocks, prefix_caching=False, **settings)
    w = small(8) if blocks > 8 else [BenchRequest(i, [(7 * i + k) % 250 + 3 for k in range(16)], 6) for i in range(8)]
    cursor = llm.timeline(since=1 << 62).cursor
    run_workload(llm, w if isinstance(w, list) else w.requests)
    real = llm.timeline(since=cursor)
    arrived = [r.request_id for r in real.requests if r.kind == "arrived"]
    measured = batches(real, {rid: i for i, rid in enumerate(arrived)})
    res = sim_for(llm).run(w, record=False)
    simulated = batches(res.timeline, {str(i): i for i in range(8)})
    assert measured == simulated
    # and the same shapes, which the fit reads from the engine's timeline: the engine records a
    # request's "finished" inside the step that finishes it, the simulator after it
    assert (
        shapes_from_timeline(real.steps, real.requests)[0]
        == shapes_from_timeline(res.timeline.steps, res.timeline.requests)[0]
    )
    assert res.summary()["preemptions"] == sum(1 for r in real.requests if r.kind == "preempted")
    assert any(len(b) > 1 for b in simulated)
    assert (res.summary()["preemptions"] > 0) == (blocks == 8)


def test_a_fit_recovers_the_step_cost_it_was_fitted_on():
    truth = [0.002, 0.0001, 0.0005, 0.0002, 0.0004, 0.0003, 0.004, 0.0]
    shapes = [
        StepShape(p, d, max(1, d), float(a + pa), float(pa))
        for p in (0, 16, 64, 200)
        for d in (1, 4, 6, 9, 32)
        for a in (100, 2000)
        for pa in ((0, 300, 5000) if p else (0,))
    ]
    seconds = [sum(c * f for c, f in zip(truth, s.features(8))) for s in shapes]
    fit = FittedCost.fit(shapes, seconds)
    assert fit.report["mape"] < 1e-6 and fit.report["threshold_tokens"] == 8
    mixed = StepShape(32, 8, 8, 900.0, 600.0)
    assert fit(mixed) == pytest.approx(sum(c * f for c, f in zip(truth, mixed.features(8))))
    # attention over a just-written prefill context and over decoding sequences' are apart
    assert fit.report["coefficients"]["per_1k_prefill_attended_s"] == pytest.approx(0.0002)
    assert fit.report["coefficients"]["per_1k_decode_attended_s"] == pytest.approx(0.0004)
    with pytest.raises(ValueError, match="at least 8"):
        FittedCost.fit(shapes[:3], seconds[:3])


def test_pooled_calibrations_are_one_fit_over_all_their_steps(tiny_llama):
    truth = [0.002, 0.0001, 0.0005, 0.0002, 0.0004, 0.0003, 0.004, 0.0]
    shapes = [StepShape(p, d, max(1, d), float(a), 0.0) for p in (0, 64) for d in (1, 4, 9, 32) for a in (100, 2000)]
    cost = [sum(c * f for c, f in zip(truth, s.features(8))) for s in shapes]
    slow, fast = FittedCost.fit(shapes, [1.2 * t for t in cost]), FittedCost.fit(shapes, [0.9 * t for t in cost])
    both = FittedCost.pooled([slow, fast])
    probe = StepShape(16, 4, 5, 800.0, 200.0)
    assert both.report["steps"] == 2 * len(shapes)
    assert fast(probe) < both(probe) < slow(probe)
    with pytest.raises(ValueError, match="no steps to pool"):
        FittedCost.pooled([slow, FittedCost(slow.coefficients, slow.threshold)])

    llm = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=64)
    first, second = Simulator.calibrate(llm), Simulator.calibrate(llm)
    sim = Simulator.pooled([first, second])
    assert sim.calibration["calibrations"] == 2
    assert sim.calibration["steps"] == first.calibration["steps"] + second.calibration["steps"]
    assert sim.run(small(4), record=False).summary()["output_tokens"] > 0
    from workbench.jupyter.sim_magic import simulate_parser
    from workbench.sim.cli import simulate_from_args

    args = simulate_parser().parse_args(["--calibrate", "--calibrations", "2", "--requests", "4", "--no-plot"])
    report, _ = simulate_from_args(args, {}, llm)
    assert report["simulator"]["calibration"]["calibrations"] == 2
    with pytest.raises(ValueError, match="no steps to pool"):  # a fit read back from the run log
        Simulator.pooled([first, Simulator.from_calibration(first.calibration)])
    with pytest.raises(ValueError, match="share engine, device and quantization"):
        Simulator.pooled([first, Simulator.from_calibration({**first.calibration, "engine": "another-model"})])
    with pytest.raises(ValueError, match="made by Simulator.calibrate"):
        Simulator.pooled([first, Simulator(profile="h200")])


def test_roofline_steps_are_bandwidth_or_compute_bound():
    m = ModelShape(weight_bytes=2e9, flops_per_token=2e9, kv_bytes_per_token=1e5, attention_flops_per_position=1e4)
    h200 = RooflineCost(PROFILES["h200"], m)
    decode = h200(StepShape(0, 1, 1, 100.0))
    read = (2e9 + 101 * 1e5) / (4800e9 * 0.8)
    assert decode == pytest.approx(0.0005 + read)  # one token: reading the weights
    big = StepShape(8192, 0, 1, 8192 * 4096.0)
    flops = 8192 * 2e9 + 8192 * 4096.0 * 1e4
    assert h200(big) == pytest.approx(
        0.0005 + max((2e9 + (8192 * 4096 + 8192) * 1e5) / (4800e9 * 0.8), flops / (989e12 * 0.6))
    )
    assert RooflineCost(PROFILES["l4"], m)(StepShape(0, 1, 1, 100.0)) > decode  # less bandwidth: slower


def test_replicas_routers_and_the_summary():
    sim = Simulator("h200")
    wl = {
        "num_requests": 40,
        "arrival": "poisson",
        "rate": 50.0,
        "seed": 3,
        "prompt_len": (32, 256),
        "output_len": (16, 64),
    }
    res = sim.run(wl, replicas=2, router="round_robin", record=False)
    assert sorted(r.replica for r in res.requests) == [0] * 20 + [1] * 20
    s = res.summary()
    assert set(RESULT_KEYS) <= set(s) and s["requests"] == 40 and s["replicas"] == 2
    assert s["output_tokens"] == sum(r.max_tokens for r in sim.workload(wl))
    assert isinstance(res.timeline, Timeline) and len(res.timelines) == 2
    reducer = TimelineReducer()
    reducer.add(res.timeline)  # the notebook's views draw a simulated run like a measured one
    assert reducer.drain()["steps"]["phase"]
    least = sim.run(wl, replicas=3, router="least_outstanding", record=False)
    assert {r.replica for r in least.requests} == {0, 1, 2}
    shared = [BenchRequest(i, [7] * 64 + [i + 10] * 8, 4, 0.01 * i) for i in range(6)]
    aff = sim.run(shared, replicas=3, router="prefix_affinity", record=False)
    assert len({r.replica for r in aff.requests}) == 1  # one prefix, one replica: its cache gets the hits
    assert aff.summary()["prefix_hit_tokens"] > 0
    custom = sim.run(shared, replicas=2, router=lambda req, replicas: req.index % 2, record=False)
    assert [r.replica for r in custom.requests] == [0, 1, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="router must be one of round_robin"):
        sim.run(wl, replicas=2, router="random")


def test_disaggregated_prefill_hands_its_kv_to_decode_replicas():
    sim = Simulator("h100")
    wl = {"num_requests": 12, "arrival": "poisson", "rate": 20.0, "seed": 1, "output_len": (8, 16)}
    res = sim.run(wl, disaggregated=(1, 2), kv_transfer_gbs=10.0, record=False)
    prefill, *decode = res.timelines
    assert all(e.kind == "prefill" for s in prefill.steps for e in s.batch)
    assert all(e.num_tokens == 1 for tl in decode for s in tl.steps for e in s.batch)  # the KV arrived with it
    s = res.summary()
    assert s["output_tokens"] == sum(r.max_tokens for r in sim.workload(wl)) and s["replicas"] == 3
    colocated = sim.run(wl, replicas=3, record=False).summary()
    assert s["ttft_p50_ms"] > 0 and colocated["output_tokens"] == s["output_tokens"]
    with pytest.raises(ValueError, match="prefill replicas, decode replicas"):
        sim.run(wl, disaggregated=(0, 2))
    # one merged timeline, as a cluster's: every event names its replica, a band each in the views
    merged = res.merged_timeline()
    assert res.replica_names() == ["prefill-0", "decode-0", "decode-1"]
    assert len(merged.steps) == sum(len(tl.steps) for tl in res.timelines)
    seqs = sorted(e.seq for e in (*merged.steps, *merged.requests, *merged.changes))
    assert seqs == list(range(1, len(seqs) + 1)) and merged.cursor == len(seqs)
    assert {s.replica for s in merged.steps} == {"prefill-0", "decode-0", "decode-1"}
    assert all(b.request_id.endswith("@" + s.replica) for s in merged.steps for b in s.batch)
    from workbench.jupyter.reducer import TimelineReducer

    red = TimelineReducer()
    red.add(merged)
    assert set(red.replicas) == set(res.replica_names())
    assert sim.run(wl, replicas=2, record=False).replica_names() == ["r0", "r1"]


def test_slo_goodput_and_the_smallest_replica_count():
    sim = Simulator("l4")
    wl = {"num_requests": 60, "arrival": "poisson", "rate": 30.0, "seed": 2}
    slo = {"ttft_ms": 300.0, "itl_ms": 60.0}
    one = sim.run(wl, replicas=1, slo=slo, record=False).summary()
    need = sim.replicas_for(slo, wl, max_replicas=16)
    assert need is not None and need >= 1
    at = sim.run(wl, replicas=need, router="least_outstanding", slo=slo, record=False).summary()
    assert at["slo_attainment"] >= 0.99
    if need > 1:
        below = sim.run(wl, replicas=need - 1, router="least_outstanding", slo=slo, record=False).summary()
        assert below["slo_attainment"] < 0.99
    assert one["slo_attainment"] <= at["slo_attainment"]
    assert at["cost_per_mtok"] > 0 and at["joules_per_token"] > 0
    with pytest.raises(ValueError, match="slo must be a dict"):
        sim.run(wl, slo={"tpot": 5})


def test_bad_input_is_refused_with_what_is_allowed():
    sim = Simulator("h200")
    with pytest.raises(ValueError, match="allowed: num_requests"):
        sim.run({"num_requests": 4, "bogus": 1})
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        sim.run({"num_requests": 4}, replicas=0)
    with pytest.raises(ValueError, match="unknown profile 'tpu'"):
        Simulator("tpu")
    with pytest.raises(ValueError, match="max_num_seqs"):
        sim.run({"num_requests": 4}, {"max_num_seqs": 0})
    tiny_cache = Simulator("h200", num_kv_blocks=4)
    with pytest.raises(ValueError, match="more than the 4"):
        tiny_cache.run([BenchRequest(0, list(range(3, 200)), 8)])


def test_calibrated_from_a_live_engine_and_recorded(tiny_llama, tmp_path):
    llm = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=64)
    sim = Simulator.calibrate(llm)
    cal = sim.calibration
    assert cal["kind"] == "fitted" and cal["steps"] >= 8 and 0 <= cal["mape"] < 1
    w = small(12, seed=5, arrival="poisson", rate=20.0)
    log = RunLog(tmp_path / "runs.sqlite")
    res = sim.run(w, run_log=log, predicts=7)
    row = log.get(res.run_id)
    assert row["kind"] == "simulation" and row["extra"]["predicts"] == 7
    assert row["extra"]["simulator"]["calibration"]["steps"] == cal["steps"]
    assert row["metrics"]["output_tok_s"] == pytest.approx(res.summary()["output_tok_s"])
    shapes, seconds = shapes_from_timeline(llm.timeline().steps, llm.timeline().requests)
    assert len(shapes) == len(seconds) > 0 and all(t > 0 for t in seconds)

    # fitted on a run it served: the steps after the cursor only
    since = llm.timeline(since=1 << 62).cursor
    llm.generate(prompt_token_ids=[list(range(5, 5 + n)) for n in (12, 40, 7, 90)], params=SamplingParams(max_tokens=9))
    served = Simulator.calibrate(llm, measure=False, since=since)
    after = llm.timeline(since=since)
    assert served.calibration["steps"] == len(shapes_from_timeline(after.steps, after.requests)[0])
    assert served.calibration["steps"] < Simulator.calibrate(llm, measure=False).calibration["steps"]
    with pytest.raises(ValueError, match="measure=False"):
        Simulator.calibrate(llm, since=since)


def test_the_command_line_prints_the_bench_keys(tmp_path):
    env_db = {"WORKBENCH_RUNS_DB": str(tmp_path / "runs.sqlite")}
    import os

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "simulate",
            "--json",
            "--requests",
            "20",
            "--rate",
            "10",
            "--replicas",
            "2",
            "--slo-ttft-ms",
            "100",
            "--replicas-for",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env_db},
    )
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert set(RESULT_KEYS) <= set(rep["results"]["simulated"]) and rep["replicas_for_slo"] >= 1
    assert rep["simulator"]["cost"]["profile"] == "h200" and rep["run_id"] is not None
    bad = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "simulate", "--max-num-seqs", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env_db},
    )
    assert bad.returncode == 2 and "max_num_seqs" in bad.stderr
    assert workbench.Simulator is Simulator


def test_the_simulate_magic(tmp_path, monkeypatch):
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from workbench.jupyter.sim_magic import SimulateMagics
    from workbench.sim import SimResult

    monkeypatch.setenv("WORKBENCH_RUNS_DB", str(tmp_path / "runs.sqlite"))
    shell = InteractiveShell.instance()
    try:
        shell.register_magics(SimulateMagics)
        with capture_output() as cap:
            shell.run_line_magic("simulate", "--profile a100 --requests 12 --rate 8 --replicas 2 -o r")
        res = shell.user_ns["r"]
        assert isinstance(res, SimResult) and res.summary()["requests"] == 12 and res.config["replicas"] == 2
        assert "workbench simulate: 12 requests" in cap.stdout and "a100 roofline" in cap.stdout
        assert cap.outputs  # the simulated timeline, drawn by the notebook's view
        with pytest.raises(UsageError, match="replicas must be an int >= 1"):
            shell.run_line_magic("simulate", "--replicas 0 --no-plot")
        with pytest.raises(UsageError, match="--calibrations must be >= 1 and, above 1, comes with --calibrate"):
            shell.run_line_magic("simulate", "--calibrations 2 --no-plot")
    finally:
        InteractiveShell.clear_instance()


def test_routing_short_prompts_to_a_cheaper_pool():
    from workbench.sim import route

    small_gpu, big_gpu = Simulator("l4"), Simulator("h100")
    wl = {"num_requests": 30, "arrival": "poisson", "rate": 10.0, "seed": 4}
    res = route(wl, [("short", small_gpu, lambda r: r.prompt_len < 200), ("long", big_gpu, None)])
    s = res.summary()
    reqs = small_gpu.workload(wl)
    short = sum(1 for r in reqs if r.prompt_len < 200)
    assert s["routes"]["short"]["requests"] == short and s["routes"]["long"]["requests"] == 30 - short
    assert s["requests"] == 30 and set(RESULT_KEYS) <= set(s)
    l4, h100 = s["routes"]["short"]["cost_per_mtok"], s["routes"]["long"]["cost_per_mtok"]
    assert min(l4, h100) <= s["cost_per_mtok"] <= max(l4, h100)  # each token at its route's price
    with pytest.raises(ValueError, match="matches no route"):
        route(wl, [("short", small_gpu, lambda r: r.prompt_len < 10)])


def test_a_cascade_pays_both_routes_and_its_client_sees_only_the_answer_kept():
    from workbench.sim import route

    cheap, dear = Simulator("l4"), Simulator("h100")
    wl = {"num_requests": 12, "arrival": "all", "seed": 3}
    reqs = {r.index: r for r in cheap.workload(wl)}
    lengths = {"cheap": 5, "dear": 9}
    res = route(
        wl,
        [("cheap", cheap, None), ("dear", dear, None)],
        escalate=lambda r, name: r.index % 3 == 0,
        output_len=lambda r, name: lengths[name],
    )
    s = res.summary()
    escalated = [i for i in reqs if i % 3 == 0]
    assert s["routes"]["cheap"]["requests"] == 12 and s["routes"]["dear"]["requests"] == len(escalated)
    assert s["routes"]["dear"]["answered"] == len(escalated) and s["routes"]["cheap"]["answered"] == 8
    ran = {name: {r.index: r for r in res.routes[name].requests} for name in ("cheap", "dear")}
    for rec in res.records:
        if rec.index in escalated:
            assert res.answered[rec.index] == "dear" and len(rec.token_ids) == 9
            # it arrived on the dear route when its cheap answer was judged: that wait is in its TTFT
            assert ran["dear"][rec.index].arrival == ran["cheap"][rec.index].finished
            assert rec.ttft > ran["cheap"][rec.index].finished - rec.arrival
            assert len(set(rec.token_times)) > 1
        else:  # a held answer reaches its client all at once
            assert res.answered[rec.index] == "cheap" and len(rec.token_ids) == 5
            assert rec.token_times == [ran["cheap"][rec.index].finished] * 5
    assert s["output_tokens"] == 8 * 5 + 4 * 9


def test_routes_on_a_shared_host_take_turns_step_by_step():
    from workbench.sim import route

    small, big = Simulator("l4"), Simulator("h100")
    wl = {"num_requests": 16, "arrival": "all", "seed": 5}
    routes = [("a", small, lambda r: r.index % 2 == 0), ("b", big, None)]
    apart = route(wl, routes)
    shared = route(wl, routes, shared_host=True)
    spans = sorted((s.start, s.end) for res in shared.routes.values() for s in res.timeline.steps)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "no two steps overlap"
    busy = {name: sum(s.end - s.start for s in res.timeline.steps) for name, res in apart.routes.items()}
    assert shared.summary()["duration_s"] == pytest.approx(sum(busy.values()), rel=1e-6)  # one after another
    assert apart.summary()["duration_s"] == pytest.approx(max(busy.values()), rel=1e-6)  # side by side
    assert [r.token_ids for r in shared.records] == [r.token_ids for r in apart.records]


def test_each_route_counts_prompts_in_its_own_models_tokens():
    """Routing between model families: a route whose model has another tokenizer sees the same text
    in its own tokens (here a character-level one: longer prompts, so more prefill)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from workbench.sim import route
    from workbench.sim.routes import route_requests
    from workbench.tokenizer import Tokenizer

    small = Simulator("l4")
    wl = {"num_requests": 12, "arrival": "all", "seed": 8}
    reqs = small.workload(wl)
    words = small.text_tokenizer()
    text = "".join(words.decode(r.prompt_token_ids) for r in reqs)
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    chars = HFTokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab))))
    chars.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    other = Simulator("l4", tokenizer=Tokenizer(chars))
    mine = route_requests(reqs, small, other)
    assert [r.index for r in mine] == [r.index for r in reqs]
    assert all(len(m.prompt_token_ids) == len(words.decode(r.prompt_token_ids)) for m, r in zip(mine, reqs))
    assert route_requests(reqs, small, Simulator("h100")) == reqs  # the same tokenizer: the same requests
    res = route(wl, [("words", small, lambda r: r.index % 2 == 0), ("chars", other, None)]).summary()
    odd = [m for m in mine if m.index % 2 == 1]
    assert res["routes"]["chars"]["requests"] == len(odd)
    assert res["prompt_tokens"] == sum(r.prompt_len for r in reqs if r.index % 2 == 0) + sum(m.prompt_len for m in odd)


def test_bursty_arrivals_keep_the_rate_and_clump():
    import statistics

    po = make_workload(2000, seed=0, vocab_size=256, arrival="poisson", rate=10.0)
    bu = make_workload(2000, seed=0, vocab_size=256, arrival="bursty", rate=10.0)

    def gaps(w):
        t = [r.arrival_s for r in w.requests]
        return [b - a for a, b in zip(t, t[1:])]

    assert statistics.mean(gaps(bu)) == pytest.approx(0.1, rel=0.15)  # same mean rate
    cv = statistics.pstdev(gaps(bu)) / statistics.mean(gaps(bu))
    assert 1.6 < cv < 2.4 and statistics.pstdev(gaps(po)) / statistics.mean(gaps(po)) < 1.2
    sim = Simulator("l4")
    calm = sim.run(po, replicas=1, record=False).summary()
    burst = sim.run(bu, replicas=1, record=False).summary()
    assert burst["ttft_p99_ms"] > calm["ttft_p99_ms"]  # clumps queue


def test_a_recorded_timeline_replays_as_a_trace(tiny_llama):
    llm = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=64)
    w = small(6, seed=9, arrival="poisson", rate=30.0)
    cursor = llm.timeline(since=1 << 62).cursor
    run_workload(llm, w.requests)
    trace = llm.timeline(since=cursor)
    sim = sim_for(llm)
    replay = sim.workload(trace)
    assert [r.prompt_len for r in replay] == [r.prompt_len for r in w.requests]
    assert [r.max_tokens for r in replay] == [r.max_tokens for r in w.requests]
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(replay, replay[1:])]
    assert gaps == pytest.approx([b.arrival_s - a.arrival_s for a, b in zip(w.requests, w.requests[1:])], abs=0.05)
    assert sim.run(trace, record=False).summary()["requests"] == 6
    with pytest.raises(ValueError, match="nothing to replay"):
        sim.workload(Timeline(steps=[], requests=[], cursor=0))


def test_a_sweep_simulates_its_grid_first_and_measures_the_predicted_front(tiny_llama, tmp_path):
    from workbench.tuning.sweep_run import _off_the_predicted_front

    llm = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=64)
    sim = Simulator.calibrate(llm)
    grid = {"kv_cache": [True, False], "max_num_seqs": [4, 8]}  # recomputing every step: dominated
    wl = {"num_requests": 8, "prompt_len": (8, 24), "output_len": (4, 8)}
    res = workbench.sweep(
        llm,
        grid=grid,
        workload=wl,
        repeats=1,
        warmup=0,
        progress=False,
        run_log=tmp_path / "runs.sqlite",
        simulate_first=sim,
    )
    assert len(res) == 4 and all(r["predicted"] is not None for r in res)
    simulated = [r for r in res if r["source"] == "simulated"]
    measured = [r for r in res if r["source"] == "measured"]
    assert {r["index"] for r in res if not r["kv_cache"]} <= {r["index"] for r in simulated}
    assert measured and all(r["kv_cache"] for r in measured)
    expected_skip = _off_the_predicted_front({r["index"]: r["predicted"] for r in res}, len(res))
    assert {r["index"] for r in simulated} == expected_skip
    assert all(r["output_tok_s"] == r["predicted"]["output_tok_s"] for r in simulated)
    assert llm.settings()["max_num_seqs"] == 64 and llm.settings()["batching"] == "continuous"  # put back
    q = workbench.sweep(
        llm,
        grid={"quantization": ["none", "int8"]},
        workload=wl,
        repeats=1,
        warmup=0,
        progress=False,
        record=False,
        ppl_tokens=0,
        simulate_first=sim,
    )
    assert [r["source"] for r in q] == ["measured", "measured"]  # the simulator cannot model quantisation


def test_runs_compare_sets_a_prediction_next_to_its_measurement(tiny_llama, tmp_path, capsys):
    log = RunLog(tmp_path / "runs.sqlite")
    measured = log.start("bench", label="bench workbench", model="m")
    log.finish(measured, "completed", metrics={"results": {"workbench": {"output_tok_s": 100.0, "ttft_p99_ms": 50.0}}})
    sim = Simulator("h200")
    res = sim.run({"num_requests": 4, "arrival": "all"}, run_log=log, predicts=measured)
    c = log.compare([res.run_id])
    assert [r["id"] for r in c["runs"]] == [measured, res.run_id]  # the measurement comes along
    [p] = c["predictions"]
    assert p["measured"] == measured and p["error"]["output_tok_s"] == pytest.approx(
        res.summary()["output_tok_s"] / 100.0 - 1
    )
    from workbench.cli import main

    assert main(["runs", "compare", str(res.run_id), "--db", str(log.path)]) == 0
    assert f"simulation #{res.run_id} predicts run #{measured}: output_tok_s" in capsys.readouterr().out


def test_speculative_decoding_and_quantisation_change_the_step_costs():
    sim = Simulator("l4")
    wl = {"num_requests": 8, "arrival": "all", "seed": 6, "output_len": (40, 60)}
    off = sim.run(wl, record=False)
    sure = sim.run(wl, {"speculative": "ngram", "num_speculative_tokens": 4}, spec_acceptance=1.0, record=False)
    never = sim.run(wl, {"speculative": "ngram", "num_speculative_tokens": 4}, spec_acceptance=0.0, record=False)
    tokens = off.summary()["output_tokens"]
    assert sure.summary()["output_tokens"] == never.summary()["output_tokens"] == tokens
    assert all(len(r.token_times) == r.max_tokens for r in sure.requests)  # never past the output length
    assert sure.summary()["engine_steps"] < off.summary()["engine_steps"] / 3  # five tokens per verify
    assert never.summary()["output_tok_s"] < off.summary()["output_tok_s"]  # verifying costs, nothing gained
    verifies = [e for s in sure.timeline.steps for e in s.batch if e.kind == "verify"]
    assert verifies and max(e.num_tokens for e in verifies) == 5
    int4 = sim.run(wl, {"quantization": "int4"}, record=False).summary()
    assert int4["itl_p50_ms"] < off.summary()["itl_p50_ms"]  # fewer weight bytes per decode step
    # a fit measured at one layout is carried to another by this CPU's roofline ratio, and says so
    fitted = Simulator(None, cost=Fixed())
    fitted.calibration = {"quantization": "none"}
    # one stream: its decode steps read the weights (memory-bound on any host; 8 at once can be
    # compute-bound on a slow-FLOP CPU, where int8 then saves nothing, rightly)
    single = {**wl, "num_requests": 1}
    base = fitted.run(single, record=False)
    int8 = fitted.run(single, {"quantization": "int8"}, record=False)
    assert int8.config["cost"]["extrapolated"] == "quantization 'none' -> 'int8'"
    assert int8.summary()["itl_p50_ms"] < base.summary()["itl_p50_ms"]  # half the weight bytes per decode
    assert "extrapolated" not in base.config["cost"]
    fitted.device = "cuda:0"
    with pytest.raises(ValueError, match="measured on cuda:0.*needs a calibration at that layout"):
        fitted.run(wl, {"quantization": "int8"}, record=False)
    # a draft model's forward is paid per proposing round: slower than free n-gram proposals
    ngram = sim.run(wl, {"speculative": "ngram"}, spec_acceptance=0.5, record=False).summary()
    draft = sim.run(wl, {"speculative": "draft"}, spec_acceptance=0.5, record=False).summary()
    assert draft["output_tokens"] == ngram["output_tokens"] and draft["itl_p50_ms"] > ngram["itl_p50_ms"]
    with pytest.raises(ValueError, match="spec_acceptance must be a probability"):
        sim.run(wl, {"speculative": "ngram"}, spec_acceptance=1.5, record=False)


def test_a_recorded_fit_comes_back_from_the_run_log(tiny_llama, tmp_path):
    llm = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=64)
    sim = Simulator.calibrate(llm)
    log = RunLog(tmp_path / "runs.sqlite")
    assert Simulator.latest_fit(sim.calibration["engine"], run_log=log) is None  # nothing recorded yet
    w = small(6, seed=2, arrival="poisson", rate=10.0)
    first = sim.run(w, run_log=log)
    again = Simulator.latest_fit(sim.calibration["engine"], run_log=log)
    assert again is not None and again.source == f"fitted (run log #{first.run_id})"
    assert again.run(w, record=False).summary()["output_tok_s"] == pytest.approx(first.summary()["output_tok_s"])
    assert Simulator.latest_fit("some-other-model", run_log=log) is None


def test_the_calibration_covers_mid_width_and_long_context_small_steps():
    """Without a 16-wide burst the GEMM path's narrow end was extrapolated (wide decodes 9-22%
    optimistic), and without a few long prompts the fit could not price attention for small steps
    over long contexts (20-35% optimistic): docs/benchmarks.md, issue 16."""
    from workbench.sim.workloads import calibration_workloads

    loads = list(calibration_workloads(None, 256, 2048, 64))
    widths = [len(w.requests) for w in loads]
    assert widths == [64, 16, 8, 4, 1]
    long_prompts = loads[3].requests
    assert all(len(r.prompt_token_ids) >= 512 for r in long_prompts)
    assert len({r.max_tokens for r in long_prompts}) > 1  # decodes narrow from 4 to 1 as they finish
    assert [len(w.requests) for w in calibration_workloads(None, 256, 2048, 16)] == [16, 8, 4, 1]


def test_cpu_profile_takes_the_engines_fastest_matmul_path(monkeypatch):
    """Without native bf16 instructions (Zen 3, AVX2) oneDNN's bf16 runs ~10x slower than its fp32
    and the engine takes fp32 (`gemm_path`); the profile counted bf16 alone, so even one stream
    looked compute-bound there and int8 weights saved nothing in the simulator."""
    from workbench_kernels import cpu

    from workbench.sim.profiles import cpu_profile

    rates = {torch.bfloat16: 12.0, torch.float32: 150.0}
    monkeypatch.setattr(cpu, "gemm_rate", lambda dtype, *a, **kw: rates[dtype])
    monkeypatch.setattr(cpu, "tiles_available", lambda: False)
    assert cpu_profile().peak_tflops == pytest.approx(0.150)
    monkeypatch.setattr(cpu, "tiles_available", lambda: True)
    monkeypatch.setattr(cpu, "tiles_rate", lambda *a, **kw: 400.0)
    assert cpu_profile().peak_tflops == pytest.approx(0.400)


def test_a_model_shape_is_simulated_from_its_published_config():
    """`shape:NAME` needs no weights here either: an 8B model's single-stream decode step on an H100's
    roofline reads its 16 GB of weights, so it takes at least their bytes over the bandwidth."""
    from workbench.sim.profiles import get_profile

    sim = Simulator("h100", "shape:llama3-8b")
    assert sim.vocab_size == 128256
    one = {"num_requests": 1, "prompt_len": (32, 32), "output_len": (64, 64)}
    itl = sim.run(one, record=False).summary()["itl_p50_ms"]
    floor = 8.03e9 * 2 / (get_profile("h100").bandwidth_gbs * 1e9) * 1e3
    assert floor < itl < 1.6 * floor
    with pytest.raises(ValueError, match="unknown model shape 'llama9'"):
        Simulator("h100", "shape:llama9")
    with pytest.raises(
        FileNotFoundError, match="model '/no/such/model' not found: expected 'smollm2-135m', .* or shape:NAME"
    ):
        Simulator("h100", "/no/such/model")
