"""Routing between models (workbench.routing): a router is an Engine over member engines.

Two tiny random Llama models of different sizes (one vocabulary) stand for a cheap and a dear
model; fp32 greedy, so every member's answer is exact and repeatable. The decision logic
(thresholds, calibration, the classifier) is also tested on its own, on set scores.
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import make_tiny_model

from workbench import LLM, SamplingParams
from workbench.routing import evaluate, route
from workbench.routing import policies as P

GREEDY = SamplingParams(max_tokens=6, temperature=0)
LENGTHS = (3, 10, 40, 70, 5, 90, 17, 33)


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    small_dir = tmp_path_factory.mktemp("small")
    large_dir = tmp_path_factory.mktemp("large")
    make_tiny_model(small_dir, "llama", seed=0)
    make_tiny_model(large_dir, "llama", seed=5, hidden_size=128, intermediate_size=256, num_hidden_layers=3)
    small = LLM(str(small_dir), dtype="float32", num_kv_blocks=64)
    large = LLM(str(large_dir), dtype="float32", num_kv_blocks=64, max_model_len=128)
    solo = {
        "small": small.generate(prompt_token_ids=_prompts(), params=GREEDY),
        "large": large.generate(prompt_token_ids=_prompts(), params=GREEDY),
    }
    return {"small": small, "large": large, "dirs": (small_dir, large_dir), "solo": solo}


@pytest.fixture
def router(members):
    return route({"small": members["small"], "large": members["large"]}, policy="length", threshold=32)


def _check_solo(outs, members):
    """Every routed greedy answer is its member's solo answer, token for token."""
    for i, o in enumerate(outs):
        assert o.token_ids == members["solo"][o.route][i].token_ids, (i, o.route)


# -- the decision logic on set scores ------------------------------------------------------------
def test_thresholds_and_calibration_on_set_scores():
    assert P.escalates("length", 65, 64) and not P.escalates("length", 64, 64)  # at the threshold: cheaper
    assert P.escalates("cascade", -1.5, -1.2) and not P.escalates("cascade", -1.2, -1.2)
    scores = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 10.0]
    for share in (0.0, 0.1, 0.3, 0.55, 1.0):
        t = P.calibrate_threshold("length", scores, share)
        assert sum(P.escalates("length", s, t) for s in scores) == round(share * len(scores))
        t = P.calibrate_threshold("cascade", scores, share)
        assert sum(P.escalates("cascade", s, t) for s in scores) == round(share * len(scores))
    assert P.calibrate_threshold("random", scores, 0.3) == 0.3
    with pytest.raises(ValueError, match="share .* must be in \\[0, 1\\]"):
        P.calibrate_threshold("length", scores, 1.5)
    assert P.confidence([-0.5, -1.5], "mean") == -1.0 and P.confidence([-0.5, -1.5], "min") == -1.5


def test_the_classifier_learns_separable_labels_and_round_trips_as_json(tmp_path):
    rng = random.Random(1)
    rows = [[rng.gauss(0, 1), rng.gauss(0, 1)] for _ in range(40)]
    labels = ["large" if a + b > 0 else "small" for a, b in rows]
    clf = P.Classifier.fit(rows, labels, ["small", "large"])
    assert [("large" if clf.probabilities(r)[0] > 0.5 else "small") for r in rows] == labels
    clf.save(tmp_path / "c.json")
    again = P.Classifier.load(tmp_path / "c.json")
    assert again.probabilities(rows[0]) == pytest.approx(clf.probabilities(rows[0]))
    assert json.loads((tmp_path / "c.json").read_text())["kind"] == "workbench-router-classifier"
    with pytest.raises(ValueError, match="labels name no member: \\['medium'\\]"):
        P.Classifier.fit(rows[:2], ["small", "medium"], ["small", "large"])


# -- the router over real engines ----------------------------------------------------------------
def test_length_routes_by_prompt_tokens_and_answers_as_each_member_alone(router, members):
    outs = router.generate(prompt_token_ids=_prompts(), params=GREEDY)
    assert [o.route for o in outs] == ["small" if n <= 32 else "large" for n in LENGTHS]
    assert [o.route_score for o in outs] == [float(n) for n in LENGTHS]
    assert all(o.route_tried == [o.route] for o in outs)
    _check_solo(outs, members)
    # streamed: the chunks carry the router's request id, the last one the member
    chunks = list(router.stream(prompt_token_ids=_prompts()[3], params=GREEDY))
    assert len({c.request_id for c in chunks}) == 1 and chunks[-1].output.route == "large"
    assert [t for c in chunks for t in c.token_ids_delta] == members["solo"]["large"][3].token_ids


def test_live_changes_take_effect_at_the_next_request_and_bad_values_are_refused(router, members):
    router.configure(router="fixed", router_member="small")
    assert {o.route for o in router.generate(prompt_token_ids=_prompts(), params=GREEDY)} == {"small"}
    settings = router.configure(router_member="large")
    assert settings["router"] == "fixed" and settings["router_member"] == "large"
    assert {o.route for o in router.generate(prompt_token_ids=_prompts(), params=GREEDY)} == {"large"}
    router.configure(router="random", router_threshold=0.0)
    assert {o.route for o in router.generate(prompt_token_ids=_prompts(), params=GREEDY)} == {"small"}
    router.configure(router_threshold=1.0)
    outs = router.generate(prompt_token_ids=_prompts(), params=GREEDY)
    assert {o.route for o in outs} == {"large"}
    _check_solo(outs, members)
    with pytest.raises(ValueError, match="setting 'router'; allowed: 'length', 'classifier'"):
        router.configure(router="smart")
    with pytest.raises(ValueError, match="'router_member'; allowed: small, large"):
        router.configure(router_member="medium")
    with pytest.raises(ValueError, match="one threshold per boundary"):
        router.configure(router_threshold=[1.0, 2.0])
    with pytest.raises(ValueError, match="classifier policy needs a classifier"):
        router.configure(router="classifier")
    assert router.settings()["router"] == "random"  # a refused change changed nothing


def test_cascade_escalates_exactly_when_the_cheap_answer_is_unsure(router, members):
    router.configure(router="cascade")
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=0)
    cheap = members["small"].generate(prompt_token_ids=_prompts(), params=sp)
    conf = [P.confidence([lp.logprob for lp in o.logprobs], "mean") for o in cheap]
    t = sorted(conf)[len(conf) // 2]
    router.configure(router_threshold=t)
    outs = router.generate(prompt_token_ids=_prompts(), params=GREEDY)
    for o, c in zip(outs, conf):
        if c < t:
            assert o.route == "large" and o.route_tried == ["small", "large"]
        else:
            assert o.route == "small" and o.route_tried == ["small"] and o.route_score == pytest.approx(c)
    assert sum(o.route == "large" for o in outs) == sum(c < t for c in conf) > 0
    assert all(o.logprobs is None for o in outs)  # the router's own log-probabilities stay its own
    _check_solo(outs, members)
    # times as the client saw them: a kept (held) answer arrives all at once when it is judged;
    # an escalated one's TTFT counts the cheap answer it waited for
    judged = {e.request_id: e.time for e in router.timeline().requests if e.kind == "escalated"}
    for o in outs:
        m = o.metrics
        if o.route == "small":
            assert len(set(m.token_times)) == 1 and m.first_token == m.finished == m.token_times[0]
        else:
            assert m.arrival < judged[o.request_id] < m.first_token
            assert len(set(m.token_times)) == len(m.token_times) > 1  # streamed by the large member
        assert m.ttft > 0
    # streamed: nothing of an escalated cheap answer reaches the client
    escalated = next(i for i, c in enumerate(conf) if c < t)
    chunks = list(router.stream(prompt_token_ids=_prompts()[escalated], params=GREEDY))
    assert [t for c in chunks for t in c.token_ids_delta] == members["solo"]["large"][escalated].token_ids
    tl = router.timeline()
    assert any(e.kind == "escalated" and e.replica == "small" for e in tl.requests)


def test_calibration_hits_the_asked_share(router):
    prompts = _prompts()
    for policy in ("length", "cascade"):
        router.configure(router=policy)
        for share in (0.0, 0.25, 0.5, 0.75, 1.0):
            t = router.calibrate(prompts, large_share=share, params=GREEDY)  # a cascade: as it will serve
            assert router.settings()["router_threshold"] == t
            outs = router.generate(prompt_token_ids=prompts, params=GREEDY)
            large = sum(o.route == "large" for o in outs)
            assert abs(large - share * len(prompts)) <= 1, (policy, share, large)


def test_the_classifier_policy_routes_by_what_it_learned(router, members, tmp_path):
    prompts = _prompts()
    labels = ["large" if n > 32 else "small" for n in LENGTHS]
    router.fit(prompts, labels)
    router.configure(router="classifier", router_threshold=0.5)
    outs = router.generate(prompt_token_ids=prompts, params=GREEDY)
    assert [o.route for o in outs] == labels
    assert all(0.0 <= o.route_score <= 1.0 for o in outs)
    _check_solo(outs, members)
    router.save_classifier(tmp_path / "router.json")
    other = route({"small": members["small"], "large": members["large"]}, policy="classifier",
                  classifier=str(tmp_path / "router.json"))  # fmt: skip
    assert [o.route for o in other.generate(prompt_token_ids=prompts, params=GREEDY)] == labels
    swapped = route({"large": members["large"], "small": members["small"]})
    with pytest.raises(ValueError, match="trained for members"):
        swapped.load_classifier(tmp_path / "router.json")


def test_a_member_that_refuses_names_itself_and_the_router_keeps_serving(router, members):
    long = [[7] * 200]  # past the large member's 128-token context (the small one takes 512)
    with pytest.raises(ValueError, match="router member 'large'"):
        router.generate(prompt_token_ids=long, params=GREEDY)
    outs = router.generate(prompt_token_ids=_prompts(), params=GREEDY)
    assert {o.route for o in outs} == {"small", "large"}
    _check_solo(outs, members)
    assert router.stats()["down"] == {}


def test_a_member_that_dies_is_routed_around(members, tmp_path):
    """A member in its own engine process is killed: requests it would have had go to the live
    member, and the router says why."""
    import os
    import signal

    from jupyter_helpers import private_runtime_dir, wait_for

    from workbench import start_engine

    with private_runtime_dir(tmp_path / "rt"):
        large = start_engine(str(members["dirs"][1]), name="routing-large", dtype="float32", num_kv_blocks=64)
        try:
            r = route({"small": members["small"], "large": large}, policy="length", threshold=32)
            outs = r.generate(prompt_token_ids=_prompts(), params=GREEDY)
            assert {o.route for o in outs} == {"small", "large"}
            _check_solo(outs, members)
            os.kill(large.pid, signal.SIGKILL)
            wait_for(lambda: not large.alive, 30, "the killed member to be seen gone")
            outs = r.generate(prompt_token_ids=_prompts(), params=GREEDY)
            assert {o.route for o in outs} == {"small"}
            assert "large" in r.stats()["down"]
            assert any("large is down" in (e.detail or "") for e in r.timeline().requests if e.kind == "routed")
        finally:
            large.close()


def test_evaluate_measures_cost_quality_and_the_gap_recovered(router, members):
    router.configure(router="length")
    ev = evaluate(router, _prompts(), params=GREEDY)
    shares = [r["large_share"] for r in ev]
    assert shares == sorted(shares) and shares[0] == 0.0 and shares[-1] == 1.0
    for r in ev:
        assert set(r) >= {"threshold", "cost_per_request", "quality", "share", "ttft_p50_ms", "pgr"}
        assert sum(r["share"].values()) == pytest.approx(1.0)
    # the default scorer: agreement with the dearest member's answer
    assert ev[-1]["quality"] == 1.0 and ev[-1]["pgr"] == 1.0 and ev[0]["pgr"] == 0.0
    assert ev.members["large"]["quality"] == 1.0
    assert ev[-1]["cost_per_request"] == pytest.approx(ev.members["large"]["cost_per_request"])
    assert ev.cpt[0.5] is not None and ev.cpt[0.5] <= ev.cpt[0.8]
    # a cascade pays for both members where it escalates
    router.configure(router="cascade")
    priced = evaluate(router, _prompts(), params=GREEDY, prices={"small": 1.0, "large": 10.0})
    solo = members["solo"]
    tokens = {m: sum(len(p) + len(o.token_ids) for p, o in zip(_prompts(), solo[m])) for m in solo}
    n = len(LENGTHS)
    assert priced[0]["large_share"] == 0.0 and priced[-1]["large_share"] == 1.0
    assert priced[0]["cost_per_request"] == pytest.approx(tokens["small"] / n / 1e6)  # none escalated
    assert priced[-1]["cost_per_request"] == pytest.approx((tokens["small"] + 10 * tokens["large"]) / n / 1e6)
    assert priced.plot() is not None
    # the picker: a point on the front applies its threshold to the router, live
    front = [i for i, r in enumerate(priced) if r.get("pareto")]
    assert front and 0 in front  # the cheapest is never beaten on cost
    settings = priced.apply(front[-1], router)
    assert settings["router"] == "cascade" and settings["router_threshold"] == priced[front[-1]]["threshold"]
    assert "past the cheapest" in priced.label(0)
    box = priced.widget(router)
    picker = box.children[1].children[0]
    assert len(picker.options) == len(priced)
    picker.value = 0
    box.children[1].children[1].click()  # "Apply to router"
    assert router.settings()["router_threshold"] == priced[0]["threshold"]
    assert "routing live by" in box.children[2].value


def test_the_simulator_predicts_a_routed_run_with_its_decisions_and_lengths(router, members):
    """Evaluation.predict: sim.route over each member's calibration, with the decisions and answer
    lengths the evaluation measured; the measured run (the bench driver on the router) routes the
    same way and serves the same tokens. How close the times come is for the notebook (11)."""
    from workbench import Simulator
    from workbench.bench.driver import serve_workload

    sims = {
        name: Simulator.calibrate(
            members[name], workload={"num_requests": 8, "prompt_len": (4, 40), "output_len": (2, 12), "seed": 2}
        )
        for name in ("small", "large")
    }
    for policy in ("cascade", "length"):
        router.configure(router=policy)
        t = router.calibrate(_prompts(), large_share=0.5, params=GREEDY)
        ev = evaluate(router, _prompts(), params=GREEDY)
        levels = ev.levels(t)
        assert 0 < sum(levels) < len(levels)
        predicted = ev.predict(sims, t)
        summary = predicted.summary()
        names = ["small", "large"]
        assert predicted.answered == {i: names[at] for i, at in enumerate(levels)}
        served = {name: [len(o.token_ids) for o in ev.answers[name]] for name in names}
        assert [len(r.token_ids) for r in predicted.records] == [served[names[at]][i] for i, at in enumerate(levels)]
        ran = summary["routes"]["small"]["requests"]
        assert ran == (len(levels) if policy == "cascade" else levels.count(0))  # a cascade asks small first
        served, _ = serve_workload(router, ev.requests(), ignore_eos=False)
        assert [s.output.route for s in served] == [names[at] for at in levels]
        assert [len(s.output.token_ids) for s in served] == [len(r.token_ids) for r in predicted.records]
    with pytest.raises(ValueError, match="missing"):
        ev.predict({"small": sims["small"]}, t)


# -- behind the HTTP endpoint --------------------------------------------------------------------
@pytest.fixture(scope="module")
def routed_server(tmp_path_factory):
    """`workbench serve --route small=...,large=... --http`: two tiny models with SmolLM2's
    tokenizer, each in its own engine process, behind one OpenAI endpoint."""
    import subprocess
    import sys

    from http_helpers import ROOT, free_port, make_tiny_tokenized_model, stop_process, wait_http

    root = tmp_path_factory.mktemp("routed")
    small = make_tiny_tokenized_model(root / "small", seed=0)
    large = make_tiny_tokenized_model(root / "large", seed=1)
    port = free_port()
    log = root / "serve.log"
    cmd = [sys.executable, "-m", "workbench.cli", "serve", "--http", f"127.0.0.1:{port}", "--name", f"rt{port}",
           "--route", f"small={small},large={large}", "--router", "length", "--router-threshold", "8",
           "--dtype", "float32", "--num-kv-blocks", "64", "--http-log-level", "warning"]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc, 240, log)
        yield url
    finally:
        stop_process(proc)


SHORT = "Hi there"
LONG = "The quick brown fox jumps over the lazy dog. " * 6  # 60 tokens: four whole cache blocks


def test_the_endpoint_routes_names_the_member_and_counts_cached_tokens(routed_server):
    import httpx

    url = routed_server

    def complete(prompt, model="router", **kw):
        r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0, **kw}, timeout=60)  # fmt: skip
        return r

    r = complete(SHORT)
    assert r.status_code == 200, r.text
    assert r.headers["x-workbench-route"] == "small"
    route_field = r.json()["choices"][0]["route"]
    assert route_field["member"] == "small" and route_field["policy"] == "length" and route_field["tried"] == ["small"]
    first = complete(LONG)
    assert first.headers["x-workbench-route"] == "large"
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = complete(LONG).json()["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["prompt_tokens"] and cached % 16 == 0, again  # whole blocks the cache held
    # RouteLLM's form: this request's policy and threshold
    assert complete(LONG, model="router-length-1000").headers["x-workbench-route"] == "small"
    assert complete(SHORT, model="router-random-1.0").headers["x-workbench-route"] == "large"
    bad = complete(SHORT, model="router-smart-1")
    assert bad.status_code == 404 and "router-<policy>-<threshold>" in bad.json()["error"]["message"]
    # streamed: the header before the body, the member on the last chunk
    body = {"model": "router", "prompt": LONG, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as s:
        assert s.headers["x-workbench-route"] == "large"
        events = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert '"route"' in events[-1] and '"member":"large"' in events[-1].replace(" ", "")
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'workbench:routed_requests_total{member="small",model_name="router",policy="length"}' in metrics
    assert "x-workbench-route" not in httpx.get(f"{url}/v1/models", timeout=10).headers


def test_generate_cells_name_the_member(router, members):
    """%%generate's output through a router says which member answered (and the path a cascade took)."""
    from workbench.jupyter.generate import GenerateRun

    router.configure(router="length", router_threshold=32)
    run = GenerateRun(["short", "long"], GREEDY, display=False)
    # the tiny models have no tokenizer: their outputs, as the cell's stream would have ended them
    outs = router.generate(prompt_token_ids=[_prompts()[0], _prompts()[2]], params=GREEDY)
    for section, out in zip(run.sections, outs):
        section.output, section.finish_reason = out, out.finish_reason
    text = run.to_text()
    assert "via small (score 3)" in text and "via large (score 40)" in text


def test_another_process_attaches_to_a_shared_router_and_steers_it(members, tmp_path):
    """route(..., share=True) over engine processes writes a router file: another process's
    workbench.connect("router:NAME") routes as this one does, and its configure() steers both."""
    import os
    import subprocess
    import sys

    from http_helpers import ROOT
    from jupyter_helpers import private_runtime_dir

    from workbench import start_engine
    from workbench.routing.shared import router_file

    with private_runtime_dir(tmp_path / "rt") as rt:
        small = start_engine(str(members["dirs"][0]), name="shared-small", dtype="float32", num_kv_blocks=64)
        large = start_engine(str(members["dirs"][1]), name="shared-large", dtype="float32", num_kv_blocks=64)
        try:
            r = route({"small": small, "large": large}, policy="length", threshold=32, name="lab", share=True)
            assert router_file("lab").exists()
            code = (
                "import json, workbench; from workbench import SamplingParams as S; "
                "r = workbench.connect('router:lab'); "
                f"ids = {[_prompts()[0], _prompts()[3]]}; "
                "o = r.generate(prompt_token_ids=ids, params=S(max_tokens=3, temperature=0)); "
                "r.configure(router='fixed', router_member='small'); "
                "print(json.dumps([x.route for x in o])); r.close()"
            )  # fmt: skip
            env = dict(os.environ, WORKBENCH_RUNTIME_DIR=str(rt))
            done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                  timeout=120, env=env)  # fmt: skip
            assert done.returncode == 0, done.stderr[-2000:]
            assert json.loads(done.stdout.splitlines()[-1]) == ["small", "large"]
            assert r.settings()["router"] == "fixed"  # set by the other process
            outs = r.generate(prompt_token_ids=_prompts(), params=GREEDY)
            assert {o.route for o in outs} == {"small"}
            with pytest.raises(FileNotFoundError, match="no router named 'nowhere'"):
                __import__("workbench").connect("router:nowhere")
            assert r.stats()["served"]["small"] == len(outs)  # the other process closed: its counts went with it
            r.close()
            assert not router_file("lab").exists() and not list(rt.glob("routed-lab.*"))
        finally:
            small.shutdown()
            large.shutdown()
