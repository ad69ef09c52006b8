"""The magics and the dashboard in real kernels against a real engine process.

One engine (embedded default model) for the module, started here and stopped at the end
whatever happens; kernels find it by name through a private runtime dir. Covers: every magic
through nbclient, the IOPub message rate of a 16-prompt `%%generate` with a dashboard open,
a widget toggle reaching the engine while a cell runs, and a kernel interrupt aborting the
cell's requests in the engine.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from jupyter_helpers import REPO, Kernel, private_engine, texts, wait_for

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

IOPUB_LIMIT = 1000  # Jupyter Server's default iopub_msg_rate_limit (messages/s)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with private_engine(tmp_path_factory.mktemp("rt-kernel"), None, name="default", timeout=300) as eng:
        yield eng


@pytest.fixture(scope="module")
def kernel(engine):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    k = Kernel(env)
    try:
        k.run("%load_ext workbench\n%engine start", timeout=120)
        yield k
    finally:
        k.close()


def test_every_magic_through_nbclient(engine, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    cells = [
        "%load_ext workbench",
        "%engine start",
        "%engine status",
        "%%generate --max-tokens 4 -o outs --timeline\nOnce upon a time\n---\nThe capital of France is",
        "assert len(outs) == 2 and all(o.token_ids for o in outs)\nprint([o.finish_reason for o in outs])",
        "%engine set max_num_batched_tokens=256",
        "%timeline --last 120",
        "%dashboard",
        "_dashboard.pump(); "
        "print(sorted(_dashboard.controls)[:3], _dashboard.controls['max_num_batched_tokens'].value)",
        "%engine set max_num_batched_tokens=1024",
        # the blocking path (no input transformer): a helper thread runs it, output lands in this cell
        "get_ipython().run_cell_magic('generate', '--max-tokens 3 -o outs2', 'Hi')\nprint(len(outs2))",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(REPO)}})
    client.execute()
    outs = [c.outputs for c in nb.cells]
    errors = [o for cell in outs for o in cell if o.output_type == "error"]
    assert not errors, errors
    flat = [json.dumps(cell) for cell in outs]
    assert "already running" in flat[1] and "attached" in flat[1]
    assert "smollm2-135m" in flat[2] and "batching" in flat[2] and "kv_cache 512 MiB" in flat[2]
    assert "memory room" in flat[2] and "MiB more (" in flat[2]
    assert "Prompt 2" in flat[3] and "TTFT" in flat[3] and "application/vnd.jupyter.widget-view+json" in flat[3]
    assert "'length'" in flat[4] or "'stop'" in flat[4]
    assert "max_num_batched_tokens: 1024" in flat[5]
    assert "[timeline: " in flat[6]
    assert "application/vnd.jupyter.widget-view+json" in flat[7]
    assert "256" in flat[8]
    assert "Prompt 1" in flat[10] and "finish:" in flat[10] and '"1\\n"' in flat[10]
    assert engine.settings()["max_num_batched_tokens"] == 1024


def test_iopub_rate_of_16_prompts_with_a_dashboard_open(kernel, engine):
    kernel.run("%dashboard --hz 20", timeout=60)
    body = "\n---\n".join(f"Story {i}: once upon a time" for i in range(16))
    msg_id = kernel.execute(f"%%generate --max-tokens 24 --ignore-eos -o outs\n{body}")
    times: list[float] = []
    counts: dict[str, int] = {}
    # count every IOPub message while the cell runs (the dashboard's comm traffic included)
    t0 = time.monotonic()
    deadline = t0 + 240
    while True:
        assert time.monotonic() < deadline, "the 16-prompt cell did not finish"
        try:
            m = kernel.kc.get_iopub_msg(timeout=5)
        except Exception:
            continue
        times.append(time.monotonic())
        counts[m["msg_type"]] = counts.get(m["msg_type"], 0) + 1
        assert m["msg_type"] != "error", m["content"]
        if (
            m["parent_header"].get("msg_id") == msg_id
            and m["msg_type"] == "status"
            and m["content"]["execution_state"] == "idle"
        ):
            break
    wall = times[-1] - t0
    peak = max(sum(1 for t in times if s <= t < s + 1.0) for s in times)
    print(f"16 prompts: {len(times)} IOPub messages in {wall:.1f}s, peak {peak}/s, {counts}")
    assert kernel.stdout("print(len(outs), sum(len(o.token_ids) for o in outs))").split() == ["16", str(16 * 24)]
    assert counts.get("update_display_data", 0) <= wall * 10 + 5  # the token display: <= 10 Hz
    assert peak < IOPUB_LIMIT / 5, f"peak {peak} msg/s is too close to the IOPub limit"
    kernel.run("_dashboard.close()")


def test_widget_toggle_reaches_engine_while_a_cell_runs(kernel, engine):
    kernel.run("%dashboard", timeout=60)
    comm_id = kernel.stdout("print(_dashboard.controls['batching'].model_id)").strip()
    index = kernel.stdout("print([v for _, v in _dashboard.controls['batching'].options].index('static'))").strip()
    assert engine.settings()["batching"] == "continuous"
    msg_id = kernel.execute("%%generate --max-tokens 40 --ignore-eos\nHello\n---\nWorld")
    wait_for(lambda: engine.status()["num_requests"] > 0, 60, "the cell's requests to reach the engine")
    # what the browser sends when the user picks "static" in the dropdown
    kernel.send_comm(comm_id, {"method": "update", "state": {"index": int(index)}, "buffer_paths": []})
    wait_for(lambda: engine.settings()["batching"] == "static", 20, "the toggle to reach the engine")
    assert engine.status()["num_requests"] > 0, "the cell finished before the toggle arrived: not a concurrent test"
    msgs, _ = kernel.collect(msg_id, timeout=240)
    assert not [m for m in msgs if m["msg_type"] == "error"]
    assert "finish: length" in texts(msgs)
    engine.configure(batching="continuous")
    kernel.run("_dashboard.close()")


def test_interrupt_aborts_the_cells_requests(kernel, engine):
    before = engine.metrics()["total_finished"]
    msg_id = kernel.execute("%%generate --max-tokens 400 --ignore-eos\nCount: 1, 2, 3\n---\nList of fruit:")
    wait_for(lambda: engine.status()["num_requests"] == 2, 60, "both requests running")
    time.sleep(0.5)
    kernel.km.interrupt_kernel()
    msgs, _ = kernel.collect(msg_id, timeout=60)
    errors = [m for m in msgs if m["msg_type"] == "error"]
    assert len(errors) == 1, f"one error expected; got {[m['msg_type'] for m in msgs]}, ending {texts(msgs)[-300:]!r}"
    [err] = errors
    assert err["content"]["ename"] == "KeyboardInterrupt"
    assert "2 request(s) aborted in the engine" in err["content"]["evalue"]
    # one line saying so, not a traceback through the magic's machinery
    [line] = err["content"]["traceback"]
    assert "2 request(s) aborted" in line and "__import__" not in line and "File " not in line
    wait_for(lambda: engine.status()["num_requests"] == 0, 30, "the engine to drop the aborted requests")
    assert engine.metrics()["total_finished"] >= before + 2
    assert "finish: abort" in texts(msgs)
    # the kernel is fine afterwards
    assert kernel.stdout("print(1 + 1)").strip() == "2"
