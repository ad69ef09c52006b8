"""`%sweep` in a real kernel against an engine process (tiny model): the kernel stays responsive
while a sweep runs (a dashboard control reaches the engine mid-sweep), and a kernel interrupt
stops the sweep, aborts its requests and puts the engine back on its settings."""

from __future__ import annotations

import os
import time

import pytest
from jupyter_helpers import Kernel, private_engine, texts, wait_for

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

NAME = "sweep-kernel"


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_llama):
    with private_engine(
        tmp_path_factory.mktemp("rt-sweep-kernel"), str(tiny_llama[0]), name=NAME, timeout=300, num_kv_blocks=256
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def kernel(engine, tmp_path_factory):
    db = tmp_path_factory.mktemp("sweep-kernel-runs") / "runs.sqlite"
    k = Kernel(dict(os.environ, OMP_NUM_THREADS="1", WORKBENCH_ENGINE=NAME, WORKBENCH_RUNS_DB=str(db)))
    try:
        k.run("%load_ext workbench\n%engine connect " + NAME, timeout=120)
        yield k
    finally:
        k.close()


def test_kernel_stays_live_during_a_sweep(kernel, engine):
    kernel.run("%dashboard --no-start", timeout=60)
    comm_id = kernel.stdout("print(_dashboard.controls['ngram_size'].model_id)").strip()
    before = engine.settings()
    msg_id = kernel.execute(
        "%sweep max_num_seqs=2,3 --requests 24 --prompt-len 8-16 --output-len 300-400 --repeats 2 --warmup 0 --no-plot"
    )
    wait_for(lambda: engine.status()["num_requests"] > 0, 60, "the sweep's requests to reach the engine")
    # what the browser sends when the user edits a dashboard control: handled mid-sweep
    kernel.send_comm(comm_id, {"method": "update", "state": {"value": 5}, "buffer_paths": []})
    wait_for(lambda: engine.settings()["ngram_size"] == 5, 30, "the dashboard edit to reach the engine")
    assert engine.status()["num_requests"] > 0, "the sweep finished before the edit arrived: not a concurrent test"
    msgs, _ = kernel.collect(msg_id, timeout=300)
    assert not [m for m in msgs if m["msg_type"] == "error"], texts(msgs)
    assert "SweepResult(2 points" in texts(msgs)
    assert "IntProgress" in texts(msgs)  # the progress bar
    assert engine.settings()["max_num_seqs"] == before["max_num_seqs"]
    engine.configure(ngram_size=before["ngram_size"])
    kernel.run("_dashboard.close()")


def test_interrupt_stops_the_sweep_and_restores_settings(kernel, engine):
    engine.configure(max_num_seqs=9)
    before = engine.settings()
    msg_id = kernel.execute(
        "%sweep max_num_seqs=3,5 batching=continuous,static --requests 24 --prompt-len 8-16 "
        "--output-len 300-400 --repeats 2 --warmup 0 --no-plot --no-resume"
    )
    wait_for(lambda: engine.status()["num_requests"] > 0, 60, "the sweep's requests to reach the engine")
    time.sleep(0.3)
    kernel.km.interrupt_kernel()
    msgs, _ = kernel.collect(msg_id, timeout=120)
    [err] = [m for m in msgs if m["msg_type"] == "error"]
    assert err["content"]["ename"] == "KeyboardInterrupt"
    wait_for(lambda: engine.status()["num_requests"] == 0, 20, "the engine to drop the sweep's requests")
    assert engine.settings() == before
    status = kernel.stdout("import workbench; print(workbench.runs.list_runs(kind='sweep')[0]['status'])").strip()
    assert status == "interrupted"
    assert kernel.stdout("print(1 + 1)").strip() == "2"
    engine.configure(max_num_seqs=64)
