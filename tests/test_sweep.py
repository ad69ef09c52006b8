"""Sweeps on a tiny model: the grid of records, interrupt restores settings, resume skips measured
points, Δppl at quantised points, the engine process, asweep cancellation, plots and %sweep."""

import _thread
import asyncio
import threading

import pytest

import workbench
from workbench import LLM
from workbench.runs import RunLog
from workbench.tuning.result import SweepResult
from workbench.tuning.workload import make_sweep_workload

pytestmark = pytest.mark.timeout(300)

WORKLOAD = {"num_requests": 6, "prompt_len": (8, 24), "output_len": (4, 10)}
GRID = {"batching": ["continuous", "static"], "max_num_seqs": [2, 4]}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from workbench import LLM

    return LLM(str(tiny_llama[0]), num_kv_blocks=256)


@pytest.fixture
def log(tmp_path):
    return RunLog(tmp_path / "runs.sqlite")


def _interrupt_after(n_points: int):
    """An on_point callback that interrupts the main thread (as a kernel interrupt does) once
    `n_points` points are done, while the next point is being measured."""
    seen = []

    def on_point(rec):
        seen.append(rec)
        if len(seen) == n_points:
            threading.Timer(0.02, _thread.interrupt_main).start()

    return on_point, seen


def test_sweep_produces_one_record_per_grid_point(llm, log):
    before = llm.settings()
    res = workbench.sweep(llm, grid=GRID, workload=WORKLOAD, repeats=2, warmup=1, progress=False, run_log=log)
    assert isinstance(res, SweepResult) and res.status == "completed" and len(res) == 4
    assert [r["point"] for r in res] == [
        {"batching": b, "max_num_seqs": n} for b in ("continuous", "static") for n in (2, 4)
    ]
    for r in res:
        assert r["settings"]["batching"] == r["batching"] and r["settings"]["max_num_seqs"] == r["max_num_seqs"]
        assert len(r["runs"]) == 2 and r["repeats"] == 2 and not r["resumed"]
        assert r["requests"] == 6 and r["output_tokens"] == sum(
            q.max_tokens for q in make_sweep_workload(llm, WORKLOAD).requests
        )
        assert r["output_tok_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 and r["itl_p99_ms"] > 0
        assert r["output_tok_s_min"] <= r["output_tok_s"] <= r["output_tok_s_max"]
        assert 0 < r["kv_usage_peak"] <= 1 and r["prefix_hit_rate"] == 0.0
        assert r["spec_acceptance_rate"] is None and r["delta_ppl"] is None
        assert r["cost_per_mtok"] > 0 and r["joules_per_token"] > 0
        assert r["prefill_cost_per_mtok"] > 0 and r["decode_cost_per_mtok"] > 0
        assert isinstance(r["pareto"], bool) and isinstance(r["noisy"], bool)
    assert any(r["pareto"] for r in res)
    assert llm.settings() == before  # put back after the sweep

    sweep_row = log.get(res.run_id)
    assert sweep_row["kind"] == "sweep" and sweep_row["status"] == "completed"
    assert sweep_row["weights_checksum"] == llm.status()["weights_checksum"]
    assert [c["status"] for c in sweep_row["children"]] == ["completed"] * 4
    assert sweep_row["children"][0]["metrics"]["output_tok_s"] == res[0]["output_tok_s"]
    assert sweep_row["workload"]["num_requests"] == 6 and sweep_row["metrics"]["pareto"]

    rows = res.table()
    rows = rows.to_dict("records") if hasattr(rows, "to_dict") else rows
    assert [r["label"] for r in rows] == [r["label"] for r in res] and "cost_per_mtok" in rows[0]
    costs = res.cost_table()
    costs = costs.to_dict("records") if hasattr(costs, "to_dict") else costs
    assert costs[0]["decode_joules_per_token"] > 0
    assert "<table>" in res._repr_html_()

    res.apply(3)
    assert llm.settings()["batching"] == "static" and llm.settings()["max_num_seqs"] == 4
    res.apply("batching=continuous max_num_seqs=2")
    assert llm.settings()["max_num_seqs"] == 2
    llm.configure(**{k: before[k] for k in GRID})


def test_interrupt_restores_settings_and_resume_skips_measured_points(llm, log):
    llm.configure(max_num_seqs=7)
    before = llm.settings()
    grid = {"max_num_seqs": [2, 3, 5]}
    on_point, seen = _interrupt_after(1)
    wl = {**WORKLOAD, "num_requests": 24, "output_len": (300, 400)}  # long enough that the interrupt lands mid-run
    with pytest.raises(KeyboardInterrupt):
        workbench.sweep(
            llm, grid=grid, workload=wl, repeats=1, warmup=0, progress=False, run_log=log, on_point=on_point
        )
    assert len(seen) == 1
    assert llm.settings() == before  # back on the settings from before the sweep
    assert not llm.engine.has_unfinished_requests()  # in-flight requests aborted
    sweep_row = log.list(kind="sweep")[0]
    assert sweep_row["status"] == "interrupted"
    kids = log.children(sweep_row["id"])
    assert kids[0]["status"] == "completed" and all(k["status"] == "interrupted" for k in kids[1:])
    partial = workbench.sweep.last()
    assert partial.status == "interrupted" and len(partial) == 1

    measured = []
    res = workbench.sweep(
        llm,
        grid=grid,
        workload=wl,
        repeats=1,
        warmup=0,
        progress=False,
        run_log=log,
        on_point=lambda r: measured.append(r["resumed"]),
    )
    assert measured == [True, False, False]  # the first point came from the log
    assert res.run_id == sweep_row["id"] and res.status == "completed" and len(res) == 3
    assert res[0]["output_tok_s"] == kids[0]["metrics"]["output_tok_s"]
    assert log.get(res.run_id)["status"] == "completed"
    assert llm.settings() == before
    # everything measured now: a rerun measures nothing; resume=False measures all again
    again = workbench.sweep(llm, grid=grid, workload=wl, repeats=1, warmup=0, progress=False, run_log=log)
    assert all(r["resumed"] for r in again)
    fresh = workbench.sweep(
        llm, grid={"max_num_seqs": [2]}, workload=wl, repeats=1, warmup=0, progress=False, run_log=log, resume=False
    )
    assert not fresh[0]["resumed"]
    # an in-memory result resumes without the log
    mem = workbench.sweep(llm, grid=grid, workload=wl, repeats=1, warmup=0, progress=False, record=False, resume=res)
    assert all(r["resumed"] for r in mem)
    llm.configure(max_num_seqs=64)


def test_quantised_points_report_delta_perplexity(llm, log):
    res = workbench.sweep(
        llm,
        grid={"quantization": ["none", "int8"]},
        workload=WORKLOAD,
        repeats=1,
        warmup=0,
        progress=False,
        run_log=log,
        ppl_tokens=64,
    )
    none, int8 = res
    assert none["delta_ppl"] is None and res.baseline_ppl > 1
    assert int8["ppl"] > 1 and int8["delta_ppl"] == pytest.approx(int8["ppl"] - res.baseline_ppl)
    assert abs(int8["delta_ppl"]) < 0.5 * res.baseline_ppl
    assert llm.settings()["quantization"] == "none"


def test_asweep_cancellation_restores_settings(llm, log):
    before = llm.settings()
    started = threading.Event()

    async def main():
        task = asyncio.ensure_future(
            workbench.sweep.asweep(
                llm,
                grid={"max_num_seqs": [3, 5, 6]},
                workload={**WORKLOAD, "output_len": (30, 40)},
                repeats=2,
                warmup=0,
                progress=False,
                run_log=log,
                on_point=lambda r: started.set(),
            )
        )
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert llm.settings() == before and not llm.engine.has_unfinished_requests()
    assert log.list(kind="sweep")[0]["status"] == "interrupted"


def test_prompt_list_workload_and_plot(llm, log):
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    res = workbench.sweep(
        llm,
        grid={"batching": ["continuous", "off"]},
        workload=prompts,
        max_tokens=5,
        repeats=1,
        warmup=0,
        progress=False,
        run_log=log,
    )
    assert [r["output_tokens"] for r in res] == [10, 10]
    assert res.workload["source"] == "prompts"
    from bokeh.embed import json_item

    layout = res.plot()
    assert json_item(layout)["doc"]["roots"]
    with pytest.raises(TypeError):
        make_sweep_workload(llm, [[1, 2], 3])
    with pytest.raises(ValueError, match="unknown workload option"):
        make_sweep_workload(llm, {"requests": 3})


def test_engine_process_sweep_and_interrupt(tiny_llama, log):
    eng = workbench.start_engine(str(tiny_llama[0]), num_kv_blocks=256)
    try:
        before = eng.settings()
        res = workbench.sweep(
            eng,
            grid={"batching": ["continuous", "static"]},
            workload=WORKLOAD,
            repeats=1,
            warmup=1,
            progress=False,
            run_log=log,
        )
        assert len(res) == 2 and all(r["output_tok_s"] > 0 and r["kv_usage_peak"] > 0 for r in res)
        assert eng.settings() == before
        on_point, _ = _interrupt_after(1)
        with pytest.raises(KeyboardInterrupt):
            workbench.sweep(
                eng,
                grid={"max_num_seqs": [2, 3]},
                workload={**WORKLOAD, "output_len": (60, 80)},
                repeats=2,
                warmup=0,
                progress=False,
                run_log=log,
                on_point=on_point,
            )
        assert eng.settings() == before
        m = eng.metrics()
        assert m["num_running"] == 0 and m["num_waiting"] == 0  # the interrupted run's requests were aborted
    finally:
        eng.shutdown()


def test_sweep_magic(llm, log, monkeypatch):
    from IPython.core.interactiveshell import InteractiveShell

    from workbench.jupyter.sweep_magic import SweepMagics, _async_sweep, parse_grid, prepare

    assert parse_grid(["batching=continuous,static", "max-num-seqs=2,4"]) == {
        "batching": ["continuous", "static"],
        "max_num_seqs": [2, 4],
    }
    shell = InteractiveShell.instance()
    try:
        shell.register_magics(SweepMagics)
        shell.user_ns["llm"] = llm
        monkeypatch.setenv("WORKBENCH_RUNS_DB", str(log.path))
        shell.run_line_magic(
            "sweep",
            "max_num_seqs=2,4 --engine llm --requests 3 --output-len 3-4 --repeats 1 --warmup 0 --no-plot -o res",
        )
        res = shell.user_ns["res"]
        assert [r["max_num_seqs"] for r in res] == [2, 4]
        _, kwargs, _ = prepare(shell, "batching=static --engine llm --max-tokens 7", "one\n---\ntwo")
        assert kwargs["workload"] == ["one", "two"] and kwargs["max_tokens"] == 7
        # a kernel runs sweep cells as top-level await; other lines are left alone
        assert _async_sweep(["x = 1\n"]) == ["x = 1\n"]
    finally:
        InteractiveShell.clear_instance()


class _NoLocalTokenizer(LLM):
    """An engine whose tokenizer is not at hand here (as with a remote server): text is tokenized
    by the engine itself."""

    tokenizer = None


def _without_local_tokenizer(llm: LLM) -> LLM:
    plain = object.__new__(_NoLocalTokenizer)
    plain.__dict__ = llm.__dict__  # the same engine, seen without its tokenizer
    return plain


def test_text_prompts_cell_magic_and_an_engine_without_a_local_tokenizer(tmp_path, log, monkeypatch):
    from http_helpers import make_tiny_tokenized_model
    from IPython.core.interactiveshell import InteractiveShell

    from workbench import LLM
    from workbench.jupyter.sweep_magic import SweepMagics

    tok_llm = LLM(str(make_tiny_tokenized_model(tmp_path / "tok", max_len=512)), num_kv_blocks=128)
    w = make_sweep_workload(tok_llm, {"num_requests": 3, "prompt_len": (8, 12), "output_len": (3, 3)})
    assert w.source == "text"  # the bench's English prompts, through the model's tokenizer
    prompts = ["Once upon a time", "The quick brown fox jumps over"]
    ids = [tok_llm.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    assert [r.prompt_token_ids for r in make_sweep_workload(tok_llm, prompts).requests] == ids
    plain = _without_local_tokenizer(tok_llm)
    assert [r.prompt_token_ids for r in make_sweep_workload(plain, prompts).requests] == ids  # engine-tokenized
    res = workbench.sweep(
        plain,
        grid={"max_num_seqs": [1, 2]},
        workload=prompts,
        max_tokens=3,
        repeats=1,
        warmup=1,
        progress=False,
        run_log=log,
    )
    assert [r["output_tokens"] for r in res] == [6, 6]
    with pytest.raises(TypeError, match="sweep needs a workbench Engine"):  # look-alikes are not enough
        workbench.sweep(object(), grid={"max_num_seqs": [1]}, workload=prompts, progress=False, record=False)

    shell = InteractiveShell.instance()
    try:
        shell.register_magics(SweepMagics)
        shell.user_ns["eng"] = tok_llm
        monkeypatch.setenv("WORKBENCH_RUNS_DB", str(log.path))
        shell.run_cell_magic(
            "sweep",
            "batching=continuous,off --engine eng --max-tokens 3 --repeats 1 --warmup 0 --no-plot",
            "Once upon a time\n---\nThe quick brown fox jumps over\n",
        )
        res = shell.user_ns["_sweep"]
        assert [r["batching"] for r in res] == ["continuous", "off"] and res.workload["prompts"] == prompts
        assert all(r["output_tokens"] == 6 for r in res)
    finally:
        InteractiveShell.clear_instance()


def test_table_is_a_dataframe_when_pandas_is_there(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("pandas")
    fake.DataFrame = lambda rows: ("frame", rows)
    res = SweepResult([{"label": "a", "point": {"batching": "off"}, "output_tok_s": 1.0}])
    monkeypatch.setitem(sys.modules, "pandas", fake)
    kind, rows = res.table()
    assert kind == "frame" and rows[0]["batching"] == "off"
    monkeypatch.setitem(sys.modules, "pandas", None)  # import fails: plain rows
    rows = res.table()
    assert isinstance(rows, list) and rows[0]["label"] == "a" and "<table>" in rows._repr_html_()
