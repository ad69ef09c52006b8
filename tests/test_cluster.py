"""Engine replicas on Ray (issue 28): a two-node Ray cluster on this machine (`ray.cluster_utils`,
one CPU a node, loopback only, token authentication on), one for the test session (conftest.py); each test starts
its replicas on it and stops them. Never `ray stop`: only what a test started is shut down.

Routed greedy outputs equal solo runs, every policy routes as it says, configure reaches every
replica (or the one named), the timeline is merged with the replica on each event, a killed
replica is routed around (its waiting requests run elsewhere, its running ones fail naming it)
and comes back on restart, a sweep measures points in parallel, and shutdown leaves nothing.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ray = pytest.importorskip("ray", reason="workbench.cluster needs Ray: the [test] extra installs ray==2.60.0")

from workbench import LLM, SamplingParams, cluster  # noqa: E402
from workbench.ipc.connection import pid_alive  # noqa: E402

pytestmark = pytest.mark.timeout(600)
GREEDY = SamplingParams(max_tokens=8, temperature=0)
ENGINE = dict(dtype="float32", num_kv_blocks=64, host="127.0.0.1")


@pytest.fixture
def two(ray_cluster, tiny_llama):
    path, _ = tiny_llama
    c = cluster.start(replicas=2, name=f"t{secrets.token_hex(3)}", model=str(path), **ENGINE)
    try:
        yield c
    finally:
        c.shutdown()


def prompts(n: int, seed: int = 0, length: int = 12) -> list[list[int]]:
    return [[3 + (seed * 31 + i * 7 + j * 13) % 250 for j in range(length + i % 5)] for i in range(n)]


def test_replicas_spread_and_routed_greedy_equals_solo(two, tiny_llama):
    rows = two.replicas()
    assert [r["name"] for r in rows] == [f"{two.name}-r0", f"{two.name}-r1"]
    assert all(r["alive"] and pid_alive(r["pid"]) for r in rows)
    assert len({r["node_id"] for r in rows}) == 2  # SPREAD: one replica per node
    ps = prompts(6)
    got = [o.token_ids for o in two.generate(prompt_token_ids=ps, params=GREEDY)]
    solo = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=64)
    assert got == [o.token_ids for o in solo.generate(prompt_token_ids=ps, params=GREEDY)]
    served = {r["name"]: r["served"] for r in two.replicas()}
    assert sum(served.values()) == 6 and all(served.values())  # least_loaded used both
    # streaming through the cluster, and one replica's engine on its own
    chunks = list(two.stream(prompt_token_ids=ps[0], params=GREEDY))
    assert [t for c in chunks for t in c.token_ids_delta] == got[0] and chunks[-1].finish_reason == "length"
    assert two.replica(rows[1]["name"]).generate(prompt_token_ids=[ps[0]], params=GREEDY)[0].token_ids == got[0]
    with pytest.raises(KeyError, match="no replica named 'nope'"):
        two.replica("nope")
    st = two.status()
    assert st["cluster"] == two.name and st["num_replicas"] == 2 and st["router"] == "least_loaded"


def test_every_policy_routes_as_it_says(two):
    two.configure(router="round_robin")
    before = {r["name"]: r["served"] for r in two.replicas()}
    two.generate(prompt_token_ids=prompts(4, 1), params=GREEDY)
    after = {r["name"]: r["served"] for r in two.replicas()}
    assert {n: after[n] - before[n] for n in after} == dict.fromkeys(after, 2)

    two.configure(router="prefix_affinity")
    shared = [5] * 40
    outs = two.generate(prompt_token_ids=[shared + [7 + i] for i in range(4)], params=GREEDY)
    routed = [ev for ev in two.timeline().requests if ev.kind == "routed"]
    where = {ev.request_id: ev.replica for ev in routed}
    assert len({where[o.request_id] for o in outs}) == 1  # one prefix, one replica (its prefix cache)
    assert any("seen there" in (ev.detail or "") for ev in routed if ev.request_id in {o.request_id for o in outs})

    two.configure(router="least_loaded")
    stream = two.stream(
        prompt_token_ids=prompts(1, 9, 60)[0], params=SamplingParams(max_tokens=440, temperature=0, ignore_eos=True)
    )
    first = next(stream)  # running, ~440 tokens still to come on its replica
    busy = routed_to(two, first.request_id)
    small = two.generate(prompt_token_ids=prompts(2, 4), params=GREEDY)
    assert all(routed_to(two, o.request_id) != busy for o in small)  # both went to the idle replica
    assert len(list(stream)) > 0
    with pytest.raises(ValueError, match="invalid router 'random'"):
        two.configure(router="random")


def test_configure_reaches_every_replica_or_the_one_named(two):
    out = two.configure(max_num_seqs=3)
    assert out["max_num_seqs"] == 3 and out["router"] == "least_loaded"
    assert [two.replica(r["name"]).settings()["max_num_seqs"] for r in two.replicas()] == [3, 3]
    r1 = two.replicas()[1]["name"]
    two.configure(max_num_batched_tokens=100, replica=r1)
    tokens = [two.replica(r["name"]).settings()["max_num_batched_tokens"] for r in two.replicas()]
    assert tokens == [1024, 100]
    with pytest.raises(ValueError, match="max_num_seqs"):
        two.configure(max_num_seqs=0)
    with pytest.raises(KeyError, match="no replica named"):
        two.configure(max_num_seqs=4, replica="elsewhere")


def test_the_timeline_is_merged_with_the_replica_on_each_event(two):
    outs = two.generate(prompt_token_ids=prompts(4, 2), params=GREEDY)
    tl = two.timeline()  # at once: the read catches up with the replicas' events not yet published
    assert {s.replica for s in tl.steps} == {r["name"] for r in two.replicas()}
    by_request = {}
    for ev in tl.requests:
        by_request.setdefault(ev.request_id, []).append((ev.kind, ev.replica))
    for o in outs:
        kinds = [k for k, _ in by_request[o.request_id]]
        assert kinds[0] == "routed" and kinds.count("first_token") == 1 and kinds.count("finished") == 1, kinds
        assert len({rep for _, rep in by_request[o.request_id]}) == 1  # routed where it ran
    time.sleep(0.5)  # the replicas' feeds now bring the same events: merged once, not twice
    again = two.timeline()
    assert len({(s.replica, s.start) for s in again.steps}) == len(again.steps)
    assert sum(ev.kind == "finished" and ev.request_id in {o.request_id for o in outs} for ev in again.requests) == 4
    m = two.metrics()
    assert set(m["per_replica"]) == {r["name"] for r in two.replicas()}
    assert m["total_finished"] == sum(x["total_finished"] for x in m["per_replica"].values())


def routed_to(two, request_id: str) -> str | None:
    return next(
        (ev.replica for ev in two.timeline().requests if ev.kind == "routed" and ev.request_id == request_id), None
    )


def test_a_killed_replica_is_routed_around_and_restarted(two):
    """b runs on the victim (its first tokens out), d waits behind it there (one sequence at a time);
    the victim's engine is killed: b fails naming the replica, d runs on the other replica."""
    two.configure(max_num_seqs=1, router="round_robin")
    long = SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
    b_chunks, b_error, b_running = [], [], threading.Event()

    def stream_b():
        try:
            for chunk in two.stream(prompt_token_ids=prompts(1, 6)[0], params=long):
                b_chunks.append(chunk)
                if len(b_chunks) == 3:
                    b_running.set()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            b_error.append(e)
            b_running.set()

    tb = threading.Thread(target=stream_b)
    tb.start()
    assert b_running.wait(60)
    victim = routed_to(two, b_chunks[0].request_id)
    waiting: dict[str, object] = {}

    def run(key):
        try:
            waiting[key] = two.generate(prompt_token_ids=[prompts(1, 8)[0]], params=GREEDY)[0]
        except Exception as e:  # noqa: BLE001
            waiting[key] = e

    threads = []
    for key in ("d1", "d2"):  # round robin: one of the two lands on the victim, behind b
        threads.append(threading.Thread(target=run, args=(key,)))
        threads[-1].start()
        time.sleep(0.05)
    time.sleep(0.2)
    victim_row = next(r for r in two.replicas() if r["name"] == victim)
    assert victim_row["in_flight"] == 2  # b running, a d waiting
    os.kill(victim_row["pid"], signal.SIGKILL)
    tb.join(60)
    for t in threads:
        t.join(60)
    assert b_error and victim in str(b_error[0]) and "after its first tokens" in str(b_error[0])
    assert all(getattr(o, "finish_reason", None) == "length" for o in waiting.values()), waiting  # nothing lost
    rows = {r["name"]: r for r in two.replicas()}
    assert not rows[victim]["alive"] and sum(r["alive"] for r in rows.values()) == 1
    more = two.generate(prompt_token_ids=prompts(3, 9), params=GREEDY)  # all on the live one
    assert all(len(o.token_ids) == 8 for o in more)
    row = two.restart(victim)
    assert row["alive"] and row["restarts"] == 1 and row["pid"] != victim_row["pid"]
    two.generate(prompt_token_ids=prompts(4, 10), params=GREEDY)
    assert next(r for r in two.replicas() if r["name"] == victim)["served"] > rows[victim]["served"]


def test_a_sweep_measures_points_in_parallel_one_per_replica(two, tmp_path):
    import workbench
    from workbench.runs import RunLog

    log = RunLog(tmp_path / "runs.sqlite")
    res = workbench.sweep(
        two,
        grid={"max_num_seqs": [2, 4, 8, 16]},
        workload={"num_requests": 4, "prompt_len": (16, 32), "output_len": (16, 24)},
        repeats=1,
        warmup=0,
        progress=False,
        run_log=log,
    )
    assert len(res) == 4 and res.status == "completed"
    assert {r["replica"] for r in res} == {r["name"] for r in two.replicas()}
    spans = sorted((r["runs"][0]["started_at"], r["runs"][0]["finished_at"]) for r in res)
    overlapping = any(a[1] > b[0] for a, b in zip(spans, spans[1:]))
    kids = log.children(log.list(kind="sweep")[0]["id"])
    assert len(kids) == 4 and all(k["status"] == "completed" for k in kids)
    assert {k["extra"]["replica"] for k in kids} == {r["name"] for r in two.replicas()}
    assert overlapping, spans  # two points were measured at the same time
    assert [two.replica(r["name"]).settings()["max_num_seqs"] for r in two.replicas()] == [64, 64]  # restored


def test_another_process_attaches_by_name(two):
    code = (
        "import workbench; from workbench import SamplingParams as S; "
        f"c = workbench.connect('cluster:{two.name}'); "
        "o = c.generate(prompt_token_ids=[[5, 6, 7, 8]], params=S(max_tokens=4, temperature=0)); "
        "print(len(c.replicas()), len(o[0].token_ids)); c.close()"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "4"]
    with pytest.raises(FileNotFoundError, match="no cluster named 'nowhere'"):
        __import__("workbench").connect("cluster:nowhere")


def test_shutdown_leaves_no_process(ray_cluster, tiny_llama):
    """... nor the connection file of a replica whose engine was killed before the shutdown."""
    from workbench.ipc import connection as conn

    c = cluster.start(replicas=2, name=f"s{secrets.token_hex(3)}", model=str(tiny_llama[0]), **ENGINE)
    pids = [r["pid"] for r in c.replicas()]
    names = [r["name"] for r in c.replicas()]
    actor_pids = [r.info["actor_pid"] for r in c._replicas.values()]
    assert all(conn.connection_path(n).exists() for n in names)
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and c.replicas()[0]["alive"]:
        time.sleep(0.2)
    c.shutdown()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids + actor_pids):
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids), "an engine process outlived its cluster"
    assert not any(pid_alive(p) for p in actor_pids), "a replica actor outlived its cluster"
    from workbench.cluster.engine import _cluster_file

    assert not _cluster_file(c.name).exists()
    assert not [n for n in names if conn.connection_path(n).exists()], "a killed replica's connection file was left"
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )


def test_bad_arguments_are_refused_before_anything_starts(ray_cluster):
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        cluster.start(replicas=0)
    with pytest.raises(ValueError, match="invalid router 'fastest'"):
        cluster.start(replicas=1, router="fastest")
    with pytest.raises(ValueError, match="batching"):
        cluster.start(replicas=1, batching="sometimes")


def test_serve_replicas_behind_one_openai_endpoint(tmp_path):
    """`workbench serve --replicas 2 --http`: a local Ray cluster of its own, the OpenAI routes in
    front of both replicas, /metrics labelled by replica; SIGTERM stops everything it started."""
    import httpx
    from http_helpers import free_port, make_tiny_tokenized_model, wait_http

    model = make_tiny_tokenized_model(tmp_path / "m")
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workbench.cli",
                "serve",
                "--replicas",
                "2",
                "--router",
                "round_robin",
                "--http",
                f"127.0.0.1:{port}",
                "--model",
                str(model),
                "--name",
                f"srv{secrets.token_hex(2)}",
                "--dtype",
                "float32",
                "--http-log-level",
                "warning",
            ],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc, 300, log)
        for i in range(4):
            r = httpx.post(url + "/v1/completions", json={"prompt": f"Hello {i}", "max_tokens": 3}, timeout=60)
            assert r.status_code == 200, r.text
        status = httpx.get(url + "/workbench/status", timeout=30).json()["engine"]
        assert status["num_replicas"] == 2 and status["router"] == "round_robin"
        assert [r["served"] for r in status["replicas"]] == [2, 2]
        pids = [r["pid"] for r in status["replicas"]]
        text = httpx.get(url + "/metrics", timeout=30).text
        for r in status["replicas"]:
            assert f'workbench:routed_requests_total{{model_name="m",replica="{r["name"]}"}} 2.0' in text, text[:2000]
            assert f'replica="{r["name"]}"' in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.2)
        assert not any(pid_alive(p) for p in pids)
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    done = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "serve", "--replicas", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "give --http HOST:PORT too" in done.stderr


def test_the_dashboard_shows_every_replica_and_steers_one(two):
    """%dashboard on a cluster: a replica picker (every replica, or one), the router's policy, and
    one timeline with a band per replica."""
    from workbench.jupyter.dashboard import Dashboard

    d = Dashboard(client=two, start=False, history_s=None)
    try:
        names = [r["name"] for r in two.replicas()]
        assert [v for _, v in d.replica_picker.options] == [None, *names]
        assert d.router_picker.value == "least_loaded"
        d.router_picker.value = "round_robin"
        d.replica_picker.value = names[1]
        d.controls["max_num_seqs"].value = 5
        deadline = time.monotonic() + 30
        while two.replica(names[1]).settings()["max_num_seqs"] != 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [two.replica(n).settings()["max_num_seqs"] for n in names] == [64, 5]  # only the one picked
        assert two.router.policy == "round_robin"
        two.generate(prompt_token_ids=prompts(4, 11), params=GREEDY)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and set(d.reducer.replicas) != set(names):
            d.pump()
            time.sleep(0.2)
        assert set(d.reducer.replicas) == set(names)
        assert any(label.endswith(" steps") for label in d.reducer.lane_labels.values())
    finally:
        d.close()
