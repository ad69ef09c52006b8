"""`%load_ext workbench` in a bare IPython InteractiveShell against a real engine process.

The embedded default model (text prompts need its tokenizer); generations are a few tokens.
One engine for the module, started by `%%generate` itself (the auto-start path), stopped at the
end whatever happens; the runtime dir is private to the module.
"""

from __future__ import annotations

import os
import re
import time

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from jupyter_helpers import kill_engines_in, private_runtime_dir, stop_engine, wait_for

import workbench
from workbench.jupyter import session as wb_session

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def shown(cap) -> str:
    return cap.stdout + "\n".join(str(o.data.get("text/plain", "")) for o in cap.outputs)


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    from IPython.core.interactiveshell import InteractiveShell

    rt = tmp_path_factory.mktemp("rt-magics")
    with private_runtime_dir(rt):
        wb_session.reset_session("default")
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "workbench")
        # No engine yet: --no-start says exactly what to run.
        with capture_output() as cap:
            ip.run_cell("%%generate --no-start\nHello")
        ip.no_engine_text = shown(cap)
        # Then the auto-start path: the embedded default model, and the output says so.
        t0 = time.monotonic()
        with capture_output() as cap:
            res = ip.run_cell("%%generate --max-tokens 6 -o first\nOnce upon a time")
        ip.autostart_text = shown(cap)
        ip.autostart_s = time.monotonic() - t0
        ip.autostart_ok = res.success
        try:
            yield ip
        finally:
            for dash in list(__import__("workbench.jupyter.dashboard", fromlist=["_"]).open_dashboards()):
                dash.close()
            stop_engine(wb_session.get_session().client(reconnect=True))
            kill_engines_in(rt)
            wb_session.reset_session()


@pytest.fixture(scope="module")
def client(shell):
    c = wb_session.get_session().client()
    assert c is not None
    return c


def test_without_engine_says_what_to_run_then_autostarts(shell):
    assert "%engine start" in shell.no_engine_text and "No engine named 'default'" in shell.no_engine_text
    assert shell.autostart_ok
    assert "No engine was running: starting the embedded default model" in shell.autostart_text
    assert "Engine 'default' ready: smollm2-135m" in shell.autostart_text
    [out] = shell.user_ns["first"]
    assert out.finish_reason in ("length", "stop") and out.token_ids


def test_generate_concurrent_prompts_sections_and_output_var(shell, client, monkeypatch):
    cursor = client.timeline(since=1 << 62).cursor
    sizes = []
    real_submit = client.submit

    def submit(batch, *args, **kwargs):
        sizes.append(len(batch))
        return real_submit(batch, *args, **kwargs)

    monkeypatch.setattr(client, "submit", submit)
    with capture_output() as cap:
        shell.run_cell(
            "%%generate --max-tokens 5 --ignore-eos -o outs\nThe sky is\n---\nOne, two,\n---\nParis is the capital of"
        )
    assert sizes == [3]
    text = shown(cap)
    outs = shell.user_ns["outs"]
    assert [o.prompt for o in outs] == ["The sky is", "One, two,", "Paris is the capital of"]
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in outs)
    for i in (1, 2, 3):
        assert f"── Prompt {i} ──" in text
    assert text.count("TTFT") == 3 and text.count("tok/s") >= 3 and text.count("finish: length") == 3
    assert outs[0].text in text
    # submitted in one message: the cell's first step already holds all three (sent one by one,
    # the engine started a step on the first alone)
    ids = {o.request_id for o in outs}
    tl = client.timeline(since=cursor)
    first = next(s for s in tl.steps if {b.request_id for b in s.batch} & ids)
    assert {b.request_id for b in first.batch} == ids


def test_an_instruct_prompt_that_ends_at_once_says_why_and_chat_answers_it(shell):
    """A tester's first trap: the instruct model given bare text ends after a token, no text."""
    with capture_output() as cap:
        shell.run_cell("%%generate --max-tokens 24 -o outs\nWrite a recipe for bread.")
    [out] = shell.user_ns["outs"]
    assert out.finish_reason == "stop" and len(out.token_ids) <= 2, out.token_ids
    assert "may need --chat" in shown(cap)
    with capture_output() as cap:
        shell.run_cell("%%generate --max-tokens 24 --chat -o outs\nWrite a recipe for bread.")
    [out] = shell.user_ns["outs"]
    assert len(out.token_ids) > 2 and out.text.strip() and "may need --chat" not in shown(cap)


def test_a_refused_prompt_in_a_cell_leaves_the_others_running(shell, client):
    """A submit is all or nothing: the cell then sends each prompt alone, so only the bad one fails."""
    long = "word " * 9000  # past the model's 8192-token context
    with capture_output() as cap:
        shell.run_cell(f"%%generate --max-tokens 3 --ignore-eos -o outs\nThe sky is\n---\n{long}\n---\nOne, two,")
    text = shown(cap)
    outs = shell.user_ns["outs"]
    assert outs[1] is None and outs[0].finish_reason == outs[2].finish_reason == "length"
    assert text.count("error: ") == 1 and "context" in text.split("error: ")[1].split("\n")[0]


def test_generate_sync_path_n_samples_stop_and_chat(shell):
    with capture_output() as cap:
        shell.run_cell_magic("generate", "--max-tokens 4 --n 2 --temperature 0.8 --seed 1 --chat -o outs", "Say hi")
    outs = shell.user_ns["outs"]
    assert len(outs) == 2 and all(o.token_ids for o in outs)
    assert "sample 2" in shown(cap)
    with pytest.raises(UsageError, match="max-tokens"):
        shell.run_cell_magic("generate", "--max-tokens nope", "x")
    with pytest.raises(UsageError, match="no prompt"):
        shell.run_cell_magic("generate", "", "\n---\n")


def test_generate_takes_penalties_bias_and_min_tokens(shell):
    """The sampling surface of issue 47 as %%generate options and per-prompt overrides."""
    shell.run_cell_magic(
        "generate", "--max-tokens 4 --logit-bias 28:100 --min-tokens 2 --presence-penalty 0.5 -o outs", "Hi\n---\nYo"
    )
    outs = shell.user_ns["outs"]
    assert [o.token_ids for o in outs] == [[28] * 4] * 2  # +100 on ',' outweighs the penalty
    shell.run_cell_magic(
        "generate", "--max-tokens 4 --logit-bias 28:100 -o outs", "--- frequency_penalty=2 presence_penalty=2\nHi"
    )
    assert shell.user_ns["outs"][0].token_ids == [28] * 4  # still: 100 - 2 - 2 per repeat, at most 3 repeats
    with pytest.raises(UsageError, match=r"--logit-bias takes ID:BIAS"):
        shell.run_cell_magic("generate", "--logit-bias 28", "x")
    with pytest.raises(UsageError, match=r"logit_bias values must be numbers in \[-100, 100\]"):
        shell.run_cell_magic("generate", "--logit-bias 28:500", "x")
    with pytest.raises(UsageError, match="min_tokens must be in"):
        shell.run_cell_magic("generate", "--max-tokens 2 --min-tokens 3", "x")


def test_generate_takes_structured_output_options(shell):
    """--json-schema (a notebook variable), --choice, --regex; two at once is a usage error; an
    invalid regex is the engine's error, shown under its prompt."""
    import json

    import jsonschema

    person = {"type": "object", "properties": {"age": {"enum": [20, 30, 40]}}, "required": ["age"]}
    shell.user_ns["person"] = person
    shell.run_cell_magic("generate", "--max-tokens 24 --json-schema person -o outs", "A person:\n---\nAnother:")
    for out in shell.user_ns["outs"]:
        jsonschema.validate(json.loads(out.text), person)
    shell.run_cell_magic("generate", "--max-tokens 8 --choice yes --choice no -o outs", "Is the sky blue?")
    assert shell.user_ns["outs"][0].text in ("yes", "no")
    shell.run_cell_magic(
        "generate", "--max-tokens 8 --temperature 1 --seed 3 --regex '(19|20)[0-9][0-9]' -o outs", "Year:"
    )
    assert re.fullmatch("(19|20)[0-9][0-9]", shell.user_ns["outs"][0].text)  # (IPython expands {4} in a line)
    with pytest.raises(
        UsageError, match="exactly one of json, json_object, regex, grammar, choice, structural_tag; got regex, choice"
    ):
        shell.run_cell_magic("generate", "--regex a --choice b", "x")
    with capture_output() as cap:
        shell.run_cell_magic("generate", "--regex '((' -o outs", "x")
    assert shell.user_ns["outs"] == [None] and "structured.regex is invalid" in shown(cap)


def test_engine_status_set_and_errors(shell, client):
    with capture_output() as cap:
        shell.run_line_magic("engine", "status")
    text = shown(cap)
    for needle in ("smollm2-135m", "batching", "prefix_caching", "output tok/s", "setting (live)", "pid"):
        assert needle in text
    with capture_output() as cap:
        shell.run_line_magic("engine", "set batching=static max_num_seqs=8")
    assert "batching: 'continuous' → 'static'" in shown(cap)
    assert client.settings()["batching"] == "static" and client.settings()["max_num_seqs"] == 8
    with pytest.raises(UsageError, match=r"allowed: 'continuous', 'static', 'off'"):
        shell.run_line_magic("engine", "set batching=sometimes")
    with pytest.raises(UsageError, match="unknown setting 'bogus'"):
        shell.run_line_magic("engine", "set bogus=1")
    with pytest.raises(UsageError, match="fixed when the engine starts"):
        shell.run_line_magic("engine", "set block_size=32")
    with pytest.raises(UsageError, match="unknown subcommand"):
        shell.run_line_magic("engine", "frobnicate")
    shell.run_line_magic("engine", "set batching=continuous max_num_seqs=64")
    with capture_output() as cap:
        shell.run_line_magic("engine", "settings")
        shell.run_line_magic("engine", "list")
    assert "relayout" in shown(cap) and "default" in shown(cap)
    with pytest.raises(UsageError, match="no engine named 'nope'"):
        shell.run_line_magic("engine", "connect nope")
    # start while running attaches (and applies live settings)
    with capture_output() as cap:
        shell.run_line_magic("engine", "start prefix_caching=false")
    assert "already running" in shown(cap)
    assert client.settings()["prefix_caching"] is False
    shell.run_line_magic("engine", "set prefix_caching=true")
    # a setting already at its value is said to be unchanged, not reported as a change
    with capture_output() as cap:
        shell.run_line_magic("engine", "set prefix_caching=true")
    assert "Nothing to apply: already prefix_caching=True (no change)" in shown(cap)
    with capture_output() as cap:
        shell.run_line_magic("engine", "set prefix_caching=true max_num_seqs=32")
    assert "max_num_seqs: 64 → 32" in shown(cap) and "already prefix_caching=True (no change)" in shown(cap)
    assert "rebuilds" not in shown(cap)  # a live change: nothing to wait for
    shell.run_line_magic("engine", "set max_num_seqs=64")
    # a re-layout says so before it blocks, then what it did
    with capture_output() as cap:
        shell.run_line_magic("engine", "set kv_cache_dtype=int8")
    text = shown(cap)
    assert text.index("Applying kv_cache_dtype='int8': the engine rebuilds") < text.index("Applied in")
    shell.run_line_magic("engine", "set kv_cache_dtype=auto")
    # --model while an engine runs: a warning that it was not started on that model
    with capture_output() as cap:
        shell.run_line_magic("engine", "start --model /some/other/model")
    assert "NOT started on --model /some/other/model" in shown(cap) and "#a35a00" in str(cap.outputs[0].data)


def test_timeline_magics_render_bokeh(shell):
    with capture_output() as cap:
        shell.run_cell("%%generate --max-tokens 3 --timeline\nA\n---\nB")
    text = shown(cap)
    assert "[timeline: " in text and "2 requests" in text
    assert any("application/vnd.jupyter.widget-view+json" in o.data for o in cap.outputs)
    with capture_output() as cap:
        shell.run_line_magic("timeline", "--last 120")
    assert "[timeline: " in shown(cap)


def test_dashboard_controls_bound_to_engine(shell, client):
    from workbench.ipc.client import EngineClient
    from workbench.jupyter.dashboard import Dashboard
    from workbench.settings import schema

    with capture_output() as cap:
        shell.run_line_magic("dashboard", "")
    assert any("application/vnd.jupyter.widget-view+json" in o.data for o in cap.outputs)
    d1 = shell.user_ns["_dashboard"]
    d2 = Dashboard(wb_session.get_session(), start=False)  # a second "notebook" on the same engine
    headline = [e["name"] for e in schema() if e["headline"]]
    live = [e["name"] for e in schema() if e["kind"] == "live" and not e["headline"]]
    changeable = [e["name"] for e in schema() if e["kind"] != "restart"]
    assert sorted(d1.controls) == sorted(changeable)
    assert list(d1.controls)[: len(headline) + len(live)] == headline + live  # the headline toggles first
    assert d1.controls["prefix_caching"].description == "Prefix caching"  # a label for people
    assert "prefix_caching" in d1.controls["prefix_caching"].tooltip  # the name for code
    for name in (
        "batching",
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache",
        "prefix_caching",
        "quantization",
        "kv_cache_dtype",
        "speculative",
        "num_speculative_tokens",
        "attention_backend",
    ):
        assert name in d1.controls
    assert d1.controls["batching"].options[1][1] == "static"
    # which kernels serve and why, from the engine's status; it follows a cpu_kernels flip
    st = client.status()
    wait_for(lambda: st["kernel_variant"] in d2.kernels.value, 20, "the kernels line")
    assert st["compute_path"] in d2.kernels.value and "large steps" in d2.kernels.value
    d1.controls["cpu_kernels"].value = not st["cpu_kernels"]
    flipped = "torch" if st["cpu_kernels"] else st["kernel_variant"]
    wait_for(lambda: (d2.pump(), f"<b>{flipped}</b>" in d2.kernels.value)[1], 20, "the kernels line to follow")
    # our attention backends (C, Triton) have two prefill paths, the torch reference one
    assert ("prefill attention" in d2.kernels.value) == (flipped != "torch")
    client.configure(cpu_kernels=st["cpu_kernels"])
    wait_for(lambda: (d2.pump(), f"<b>{st['kernel_variant']}</b>" in d2.kernels.value)[1], 20, "the kernels line back")
    on_c = f"prefill attention: <b>{st['prefill_attention']}</b> (auto, measured on one"
    assert (on_c in d2.kernels.value) == (st["attention_backend"] == "cpu")
    d1.controls["attention_backend"].value = "triton"
    wait_for(lambda: (d2.pump(), "prefill attention: <b>kernel</b> (auto off CUDA" in d2.kernels.value)[1], 20,
             "the kernels line to give the prefill path")  # fmt: skip
    client.configure(attention_backend="auto")
    wait_for(lambda: (d2.pump(), "auto off CUDA" not in d2.kernels.value)[1], 20, "the Triton backend's path gone")

    # a widget change reaches the engine, and every dashboard shows it
    d1.controls["batching"].value = "static"
    wait_for(lambda: client.settings()["batching"] == "static", 20, "the engine to apply batching=static")
    wait_for(lambda: (d2.pump(), d2.controls["batching"].value == "static")[1], 20, "the 2nd dashboard to follow")
    # a change made elsewhere (another client's configure) shows in both
    other = EngineClient.connect("default")
    try:
        other.configure(max_num_seqs=5)
        for d in (d1, d2):
            wait_for(lambda d=d: (d.pump(), d.controls["max_num_seqs"].value == 5)[1], 20, "max_num_seqs to show")
        # who changed it is named; a dashboard never reports its own change as someone else's
        from workbench.ipc.connection import default_client_name

        by = f"Changed by {default_client_name()} (pid {os.getpid()}): max_num_seqs=5"
        assert any(m.startswith(by) for m in d2.messages), d2.messages
        d1.pump()
        assert not any(m.startswith("Changed by") and "batching" in m for m in d1.messages), d1.messages
    finally:
        other.configure(max_num_seqs=64, batching="continuous")
        other.close()
    wait_for(lambda: (d1.pump(), d1.controls["batching"].value == "continuous")[1], 20, "batching back")

    # a rejected change reverts the control and says why (fp8 weights need a capable GPU)
    d1.controls["quantization"].value = "fp8"
    wait_for(lambda: any(m.startswith("Rejected quantization='fp8'") for m in d1.messages), 20, "the rejection")
    assert d1.controls["quantization"].value == "none" and "fp8" in d1.status.value
    assert client.settings()["quantization"] == "none"

    # a re-layout shows progress (started / done)
    d2.controls["kv_cache_dtype"].value = "int8"
    wait_for(
        lambda: (d2.pump(), any("Re-layout: kv_cache_dtype" in m and "done" in m for m in d2.messages))[1],
        30,
        "re-layout progress",
    )
    assert any("in progress" in m for m in d2.messages)
    client.configure(kv_cache_dtype="auto")

    # plots fill from engine events
    shell.run_cell("%%generate --max-tokens 4\nx\n---\ny")
    wait_for(lambda: (d2.pump(), len(d2.view.sources["steps"].data["left"]) > 0)[1], 20, "steps in the plot")
    wait_for(lambda: (d2.pump(), len(d2.view.sources["lanes"].data["left"]) > 0)[1], 20, "request lanes")
    d2.close()
    with capture_output():
        shell.run_line_magic("dashboard", "")  # again: the previous one's feed is closed
    assert d1.closed and shell.user_ns["_dashboard"] is not d1
    shell.user_ns["_dashboard"].close()


def test_engine_restart_dashboard_reconnects(shell, client):
    from workbench.jupyter.dashboard import Dashboard

    dash = Dashboard(wb_session.get_session(), start=False)
    with capture_output() as cap:
        shell.run_line_magic("engine", "stop")
    assert "Engine 'default' stopped." in shown(cap)
    wait_for(lambda: (dash.pump(), any("is gone" in m for m in dash.messages))[1], 20, "the dashboard to say gone")
    assert all(c.disabled for c in dash.controls.values())
    with pytest.raises(UsageError, match="%engine start"):
        shell.run_line_magic("engine", "status")
    with capture_output() as cap:
        shell.run_line_magic("engine", "start --max-num-seqs 16")
    assert "ready" in shown(cap)
    wait_for(lambda: (dash.pump(), any("Reconnected" in m for m in dash.messages))[1], 30, "the reconnect")
    assert dash.controls["max_num_seqs"].value == 16 and not dash.controls["batching"].disabled
    dash.close()


def test_dashboard_follows_an_engine_restarted_elsewhere(shell, client):
    """Stop and Start in the lab panel: another client stops the engine and another starts a new
    one under the name. The open dashboard re-attaches within seconds (its reconnecting client
    revives in place) and, while the engine is gone, shows none of the old engine's numbers."""
    from workbench.ipc.launch import start_engine
    from workbench.jupyter.dashboard import Dashboard

    session = wb_session.get_session()
    dash = Dashboard(session, start=False)
    old_pid = dash.client.pid
    shell.run_cell("%%generate --max-tokens 4\nx")
    wait_for(lambda: (dash.pump(), "tok/s" in dash.metrics_line.value)[1], 20, "the old engine's numbers")
    stop_engine(workbench.connect(session.name))  # the panel's Stop: not this kernel's client
    wait_for(lambda: (dash.pump(), any("is gone" in m for m in dash.messages))[1], 20, "the dashboard to say gone")
    assert "tok/s" not in dash.metrics_line.value and str(old_pid) in dash.metrics_line.value
    new = start_engine(name=session.name, max_num_seqs=12)  # the panel's Start: another process's client
    try:
        t0 = time.monotonic()
        wait_for(lambda: (dash.pump(), any("Reconnected" in m for m in dash.messages))[1], 20, "the reconnect")
        assert time.monotonic() - t0 < 20
        assert dash.client.pid == new.pid != old_pid and f"pid {new.pid}" in dash.header.value
        assert dash.controls["max_num_seqs"].value == 12 and not dash.controls["batching"].disabled
        shell.run_cell("%%generate --max-tokens 4\ny")  # and its events flow again
        wait_for(lambda: (dash.pump(), len(dash.view.sources["steps"].data["left"]) > 0)[1], 20, "new steps")
    finally:
        dash.close()
        new.close()


def test_help_prints_once_and_is_not_an_error():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "workbench")
        for cell in ("%%generate --help\nhello", "%sweep --help", "%simulate --help", "%timeline --help"):
            with capture_output() as cap:
                result = shell.run_cell(cell)
            assert result.error_in_exec is None and cap.stdout.count("usage:") == 1 and not cap.stderr, cell
        with capture_output() as cap:
            shell.run_cell("%%generate --help\nhello")
        assert "sampling seed: the same seed gives the same text" in cap.stdout  # every option has help
    finally:
        InteractiveShell.clear_instance()
