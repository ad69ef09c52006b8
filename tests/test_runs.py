"""The run log: records, compare/export, the CLI, five concurrent writers and a killed writer."""

import csv
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from workbench import runs
from workbench.cli import main
from workbench.runs import RunLog


@pytest.fixture
def log(tmp_path):
    return RunLog(tmp_path / "runs.sqlite")


def test_start_finish_get_list_children(log):
    assert not log.path.exists()
    sid = log.start(
        "sweep",
        label="sweep x",
        key="k1",
        model="m",
        weights_checksum="abc",
        device="cpu",
        settings={"batching": "static"},
        workload={"num_requests": 4},
    )
    pid = log.start(
        "sweep_point", parent_id=sid, label="batching=static", key="p1", settings={"batching": "static"}, facts=False
    )
    assert log.get(pid)["status"] == "running"
    log.finish(pid, metrics={"output_tok_s": 12.5, "runs": [{"x": 1}]}, extra={"point": {"batching": "static"}})
    log.finish(sid, "completed", metrics={"best": {"output_tok_s": 12.5}})
    run = log.get(sid)
    assert run["status"] == "completed" and run["finished_at"] and run["settings"] == {"batching": "static"}
    assert run["versions"]["python"] and run["machine"]["cpu_count"] >= 1 and run["pid"] == os.getpid()
    assert [c["id"] for c in run["children"]] == [pid]
    # prompts and settings: the owner's only (the write-ahead log and its index take the same mode)
    assert log.path.stat().st_mode & 0o777 == 0o600
    assert run["children"][0]["metrics"]["output_tok_s"] == 12.5
    assert [r["id"] for r in log.list()] == [sid]  # points hidden by default
    assert [r["id"] for r in log.list(children=True)] == [pid, sid]
    assert log.list()[0]["num_children"] == 1
    assert [r["id"] for r in log.find("sweep", "k1")] == [sid]
    assert runs.headline(log.get(pid))["output_tok_s"] == 12.5
    with pytest.raises(KeyError):
        log.get(999)
    with pytest.raises(ValueError):
        log.start("nope")
    with pytest.raises(ValueError):
        log.finish(sid, "running")


def test_compare_and_export(log, tmp_path):
    a = log.start("bench", settings={"batching": "static", "max_num_seqs": 4}, weights_checksum="w")
    log.finish(a, metrics={"results": {"workbench": {"output_tok_s": 10.0, "ttft_p99_ms": 3.0}}})
    b = log.start("bench", settings={"batching": "continuous", "max_num_seqs": 4}, weights_checksum="w")
    log.finish(b, metrics={"results": {"workbench": {"output_tok_s": 20.0, "ttft_p99_ms": 2.0}}})
    c = log.compare([a, b])
    assert [r["id"] for r in c["runs"]] == [a, b]
    assert c["settings"] == {"batching": ["static", "continuous"]}
    assert c["metrics"]["results.workbench.output_tok_s"] == [10.0, 20.0]
    assert c["same_weights"]

    text = log.export(tmp_path / "out.csv")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [int(r["id"]) for r in rows] == [a, b]
    assert rows[1]["metrics.results.workbench.output_tok_s"] == "20.0" and rows[0]["settings.batching"] == "static"
    assert (tmp_path / "out.csv").read_text() == text
    data = json.loads(log.export(tmp_path / "out.json"))
    assert [r["id"] for r in data] == [a, b] and data[0]["settings"]["max_num_seqs"] == 4
    assert json.loads(log.export(ids=[b], fmt="json"))[0]["id"] == b
    with pytest.raises(ValueError):
        log.export(fmt="xml")


def test_runs_side_by_side_as_plot_columns(log):
    """What the notebook's `workbench.runs.plot` and the lab's run-log view draw: one bar per
    metric and run, in the run's colour, and the settings that differ."""
    from workbench.runs.plots import comparison, plot, settings_html

    a = log.start("bench", label="static", settings={"batching": "static", "max_num_seqs": 4}, workload={"n": 8})
    log.finish(
        a,
        metrics={
            "results": {
                "workbench": {"output_tok_s": 10.0, "ttft_p99_ms": 3.0, "itl_p50_ms": 1.5},
                "hf_static": {"output_tok_s": 4.0},
            }
        },
    )
    b = log.start(
        "sweep_point", label="continuous", settings={"batching": "continuous", "max_num_seqs": 4}, workload={"n": 16}
    )
    log.finish(b, metrics={"output_tok_s": 20.0, "ttft_p99_ms": 2.0, "itl_p50_ms": float("nan")})
    comp = comparison(log.compare([a, b]))
    assert comp["runs"] == [f"#{a} static", f"#{b} continuous"]
    tput = comp["throughput"]
    assert set(zip(tput["metric"], tput["run"], tput["value"])) == {
        ("workbench output tok/s", f"#{a} static", 10.0),
        ("workbench output tok/s", f"#{b} continuous", None),
        ("hf_static output tok/s", f"#{a} static", 4.0),
        ("hf_static output tok/s", f"#{b} continuous", None),
        ("output tok/s", f"#{a} static", None),
        ("output tok/s", f"#{b} continuous", 20.0),
    }
    assert tput["color"][:2] == comp["colors"] and comp["colors"][0] != comp["colors"][1]
    lat = comp["latency"]
    assert "ITL p50" not in lat["metric"]  # measured by no run (NaN): no bars at all
    assert ("workbench ITL p50", f"#{b} continuous", None) in set(zip(lat["metric"], lat["run"], lat["value"]))
    assert comp["settings"] == [{"setting": "batching", "values": ["static", "continuous"]}]
    text = settings_html(comp)
    assert "<code>batching</code>" in text and "different workloads" in text  # said, not hidden
    assert "different weights" not in text
    with pytest.raises(ValueError, match="two or more"):
        plot([a], db=log)
    assert comp["same_weights"] is None  # no checksum recorded: not known to differ, no caveat
    # one figure per metric family, each on its own axis: tok/s, TTFT, ITL
    assert [f["title"].split(" (")[0] for f in comp["figures"]] == [
        "Output tokens/s",
        "Time to first token",
        "Inter-token latency",
    ]
    assert all("TTFT" in m for m in comp["figures"][1]["rows"]["metric"])
    assert comp["figures"][2]["rows"]["metric"] and all("ITL" in m for m in comp["figures"][2]["rows"]["metric"])
    layout = plot([a, b], db=log)  # outside a kernel: the Bokeh layout itself
    assert len(layout.children) == 2 and len(layout.children[0].children) == 3


def test_a_sweep_point_has_one_name_in_every_view(log):
    """The Pareto plot's picker, its tooltip and the run log's comparison all call a point by its
    number in the sweep, with its run-log id beside it; an unmeasured delta ppl says so."""
    from workbench.runs.plots import comparison
    from workbench.tuning.plots import plot_data, point_name

    sweep = log.start("sweep", label="sweep max_num_seqs[2]")
    ids = []
    for index, n in enumerate((4, 8)):
        pid = log.start(
            "sweep_point",
            parent_id=sweep,
            label=f"max_num_seqs={n}",
            settings={"max_num_seqs": n},
            extra={"point": {"max_num_seqs": n}, "label": f"max_num_seqs={n}", "index": index},
        )
        log.finish(pid, metrics={"output_tok_s": 10.0 * (index + 1), "ttft_p50_ms": 5.0, "itl_p50_ms": 1.0})
        ids.append(pid)
    log.finish(sweep)
    comp = comparison(log.compare([sweep]))  # the sweep alone: its points
    assert comp["runs"] == [f"#{ids[0]} point 0: max_num_seqs=4", f"#{ids[1]} point 1: max_num_seqs=8"]
    records = [
        {"label": "max_num_seqs=4", "run_id": ids[0], "output_tok_s": 10.0},
        {"label": "max_num_seqs=8", "run_id": ids[1], "output_tok_s": 20.0, "delta_ppl": 0.25},
    ]
    assert point_name(1, records[1]) == f"point 1: max_num_seqs=8 (run #{ids[1]})"
    data = plot_data(records)
    assert data["run"] == [f"run #{ids[0]}", f"run #{ids[1]}"]
    assert data["delta_ppl_text"] == ["not measured (no quantisation)", "+0.250"]


def test_cli_runs_subcommands(log, tmp_path, capsys):
    sid = log.start("sweep", label="sweep batching[2]", model="tiny", device="cpu")
    p1 = log.start("sweep_point", parent_id=sid, label="batching=static", settings={"batching": "static"})
    log.finish(p1, metrics={"output_tok_s": 11.0, "ttft_p99_ms": 4.0})
    p2 = log.start("sweep_point", parent_id=sid, label="batching=continuous", settings={"batching": "continuous"})
    log.finish(p2, metrics={"output_tok_s": 22.0, "ttft_p99_ms": 5.0})
    log.finish(sid, metrics={"best": {"output_tok_s": 22.0}})
    db = ["--db", str(log.path)]

    assert main(["runs", "list", *db]) == 0
    out = capsys.readouterr().out
    assert "sweep batching[2] (2 points)" in out and "completed" in out and "batching=static" not in out
    assert main(["runs", "list", "--all", "--json", *db]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
    assert main(["runs", "show", str(sid), *db]) == 0
    out = capsys.readouterr().out
    assert f"run {sid}: sweep" in out and "batching=continuous" in out
    assert main(["runs", "compare", str(sid), *db]) == 0  # a sweep expands to its points
    out = capsys.readouterr().out
    assert "setting batching" in out and "output_tok_s" in out and f"#{p1}" in out
    assert main(["runs", "export", str(tmp_path / "x.csv"), *db]) == 0
    assert (tmp_path / "x.csv").read_text().startswith("id,kind,")
    assert main(["runs", "export", "--format", "json", "--ids", str(p2), *db]) == 0
    assert json.loads(capsys.readouterr().out)[0]["id"] == p2
    assert main(["runs", "show", "999", *db]) == 1
    assert main(["runs", "list", "--db", str(tmp_path / "none.sqlite")]) == 1
    capsys.readouterr()
    assert main(["runs", "path", *db]) == 0
    assert capsys.readouterr().out.strip() == str(log.path)


def test_recording_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_RUNS_DB", "off")
    assert not runs.recording_enabled()
    assert runs.default_path().name == "runs.sqlite"
    calls = []

    @runs.record_bench
    def fake_bench(model=None, **kw):
        calls.append(kw)
        return {"results": {}}

    assert "run_id" not in fake_bench(None, num_requests=2)
    monkeypatch.setenv("WORKBENCH_RUNS_DB", str(tmp_path / "r.sqlite"))
    rep = fake_bench(None, num_requests=2)
    assert RunLog().get(rep["run_id"])["status"] == "completed"


def test_bench_decorator_marks_interrupted_and_failed(log):
    @runs.record_bench
    def boom(model=None, **kw):
        raise kw["exc"]

    for exc, status in ((KeyboardInterrupt(), "interrupted"), (RuntimeError("x"), "failed")):
        with pytest.raises(type(exc)):
            boom(None, exc=exc, run_log=log)
        assert log.list(kind="bench")[0]["status"] == status


_WRITER = textwrap.dedent("""
    import sys, time
    from workbench.runs import RunLog
    log = RunLog(sys.argv[1])
    n, tag = int(sys.argv[2]), sys.argv[3]
    print("ready", flush=True)
    for i in range(n):
        rid = log.start("bench", label=f"{tag}-{i}", settings={"i": i}, facts=(i == 0))
        log.update(rid, metrics={"results": {"workbench": {"output_tok_s": float(i)}}})
        log.finish(rid, "completed")
    if n == 0:  # the victim: a run left running, then busy writing until killed
        rid = log.start("bench", label=f"{tag}-victim", facts=False)
        print("started", rid, flush=True)
        while True:
            log.update(rid, metrics={"t": time.time(), "blob": "x" * 20000})
""")


def _writer(path, n, tag):
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), str(n), tag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_five_concurrent_writers_never_corrupt_the_log(log):
    log.start("bench", label="init", facts=False)  # create the file first
    n, tags = 30, "abcde"
    procs = [_writer(log.path, n, tag) for tag in tags]
    seen = 0
    try:
        while any(p.poll() is None for p in procs):  # read while they write
            seen = max(seen, len(log.list(kind="bench", limit=None)))
            time.sleep(0.02)
        for p in procs:
            assert p.wait(timeout=120) == 0, p.stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    rows = log.list(kind="bench", limit=None)
    labels = {r["label"] for r in rows}
    assert all(f"{t}-{i}" in labels for t in tags for i in range(n))
    assert sum(r["status"] == "completed" for r in rows) == len(tags) * n
    assert log.integrity_check() == "ok"


def test_a_killed_writer_leaves_a_consistent_log_and_an_abandoned_run(log):
    log.start("bench", label="init", facts=False)
    victim = _writer(log.path, 0, "v")
    other = _writer(log.path, 30, "o")
    try:
        assert victim.stdout.readline().strip() == "ready"
        line = victim.stdout.readline().split()
        assert line[0] == "started"
        rid = int(line[1])
        time.sleep(0.3)  # mid-stream of update transactions
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        assert other.wait(timeout=120) == 0, other.stderr.read()
    finally:
        for p in (victim, other):
            if p.poll() is None:
                p.kill()
    assert log.integrity_check() == "ok"
    run = log.get(rid)
    assert run["status"] == "abandoned" and "ended before" in run["error"]
    assert isinstance(run["metrics"]["t"], float)  # the last committed update, whole
    assert sum(r["status"] == "completed" for r in log.list(kind="bench", limit=None)) == 30
    log.finish(log.start("bench", facts=False))  # still writable


@pytest.mark.timeout(300)
def test_run_bench_is_recorded(tiny_llama, log):
    from workbench.bench import run_bench

    rep = run_bench(
        str(tiny_llama[0]),
        systems=["workbench"],
        num_requests=3,
        quick=True,
        single_stream=False,
        prompt_len=(8, 16),
        output_len=(4, 8),
        settings={"num_kv_blocks": 128},
        run_log=log,
    )
    run = log.get(rep["run_id"])
    assert run["kind"] == "bench" and run["status"] == "completed"
    assert run["model"] == rep["model"] == tiny_llama[0].name and run["device"] == "cpu"
    assert run["weights_checksum"] == rep["engine_status"]["weights_checksum"]
    assert run["settings"]["num_kv_blocks"] == 128 and run["workload"]["num_requests"] == 3
    w = run["metrics"]["results"]["workbench"]
    assert w["output_tok_s"] == pytest.approx(rep["results"]["workbench"]["output_tok_s"])
    assert w["cost_per_mtok"] > 0 and w["joules_per_token"] > 0 and run["metrics"]["roofline"]
    assert run["versions"]["torch"] and run["machine"]["cpu_count"]
    assert runs.headline(run)["output_tok_s"] == w["output_tok_s"]


@pytest.mark.timeout(300)
def test_bench_scenario_is_recorded(tiny_llama, tmp_path, monkeypatch, capsys):
    """`workbench bench --scenario` runs land in the run log (kind `scenario`) with their results,
    ratios and targets, and `runs list/show/compare/export` show them."""
    db = tmp_path / "runs.sqlite"
    monkeypatch.setenv("WORKBENCH_RUNS_DB", str(db))
    argv = [
        "bench",
        "--scenario",
        "quant",
        "--quick",
        "--model",
        str(tiny_llama[0]),
        "--num-kv-blocks",
        "64",
        "--threads",
        "1",
    ]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    run = RunLog(db).get(rep["run_id"])
    assert run["kind"] == "scenario" and run["status"] == "completed" and run["label"] == "scenario quant"
    assert run["model"] == tiny_llama[0].name and run["device"] == "cpu"
    assert run["weights_checksum"] == rep["engine_status"]["weights_checksum"]
    assert run["settings"]["num_kv_blocks"] == 64 and run["workload"] == {"quant": rep["quant"]["workload"]}
    m = run["metrics"]
    assert m["ratios"] == pytest.approx(rep["ratios"]) and m["quant"]["hf"]["none"]["tokens"] == 32
    assert m["quant"]["none"]["decode_tok_s"] == pytest.approx(rep["quant"]["none"]["decode_tok_s"])
    assert {t["name"] for t in m["targets"]} == {"int8_vs_bf16", "int4_vs_bf16"}
    h = runs.headline(run)
    assert h["int4_vs_bf16"] == pytest.approx(rep["quant"]["int4_vs_bf16"]) and "int4_vs_hf" in h
    assert "int4_vs_bf16=" in runs.ratios_text(run) and "(>= 2: " in runs.ratios_text(run)

    assert main(["runs", "list", "--kind", "scenario"]) == 0
    out = capsys.readouterr().out
    assert "scenario quant" in out and "ratios (targets)" in out and "int8_vs_bf16=" in out
    assert main(["runs", "show", str(run["id"])]) == 0
    assert "ratios (targets): int8_vs_bf16=" in capsys.readouterr().out
    assert main(["runs", "compare", str(run["id"]), str(run["id"])]) == 0
    assert "ratios.int4_vs_bf16" in capsys.readouterr().out
    row = list(csv.DictReader(io.StringIO(RunLog(db).export(fmt="csv", kind="scenario"))))[0]
    assert float(row["metrics.ratios.int4_vs_bf16"]) == pytest.approx(rep["ratios"]["int4_vs_bf16"])
    assert row["metrics.quant.hf.backend"] == "transformers TorchAoConfig"
