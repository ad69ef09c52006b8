"""`RemoteEngineClient` (`workbench.connect("http://...")`): against our own HTTP endpoint in a
separate process, against a minimal third-party-style OpenAI server (text only, no /metrics),
and against llama.cpp's server (llama-cpp-python) when it is installed; plus the endpoint load
generator (`workbench bench --endpoint`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import warnings

import httpx
import pytest
from fastapi import Request  # module level: FastAPI resolves the handler's annotations here
from http_helpers import API_KEY, MAX_LEN, free_port, shared_server, stop_process

import workbench
from workbench import EngineClient, SamplingParams
from workbench.remote import RemoteEngineClient, RemoteSettingsError, parse_prometheus, server_metrics
from workbench.remote.prometheus import histogram_quantile
from workbench.remote.wire import detect_kind, split_url
from workbench.timeline import Timeline

VLLM_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 50.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 40.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 2.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="9000"} 1.0
"""

SGLANG_METRICS = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.75
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="m"} 2.5
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="m"} 321.0
"""


def test_prometheus_mapping_for_vllm_and_sglang():
    v = server_metrics(parse_prometheus(VLLM_METRICS))
    assert (v["num_running"], v["num_waiting"], v["kv_usage"]) == (4, 2, 0.25)
    assert v["prefix_hit_rate"] == 0.25 and v["spec_acceptance_rate"] == 0.8
    assert v["total_output_tokens"] == 1234 and v["kv_blocks_total"] == 9000
    assert v["server_ttft_p50_ms"] == pytest.approx(100.0)  # rank 5 of 10 ends the first bucket
    s = server_metrics(parse_prometheus(SGLANG_METRICS))
    assert (s["num_running"], s["num_waiting"], s["kv_usage"], s["prefix_hit_rate"]) == (7, 1, 0.5, 0.75)
    assert s["spec_mean_accepted"] == 2.5 and s["output_tok_s"] == 321.0
    assert histogram_quantile({}, "x", 0.5) is None
    assert split_url("http://h:1/v1/?model=a") == ("http://h:1", "a")
    assert detect_kind({"owned_by": "vllm"}, {}, "") == "vllm"
    assert detect_kind({"owned_by": "me", "permissions": []}, {}, "") == "llama-cpp-python"
    assert detect_kind({}, parse_prometheus(SGLANG_METRICS), "") == "sglang"
    assert detect_kind({"owned_by": "someone"}, {}, "uvicorn") == "openai-compatible"


# -- against our own endpoint (a separate process) ------------------------------------------------
@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return shared_server(request.config, tmp_path_factory.mktemp("http"))


@pytest.fixture(scope="module")
def remote(server):
    os.environ["WORKBENCH_API_KEY"] = API_KEY
    try:
        client = workbench.connect(server["url"] + "/v1")  # the factory picks the remote client
    finally:
        os.environ.pop("WORKBENCH_API_KEY", None)
    yield client
    client.close()


@pytest.mark.timeout(300)
def test_remote_surface_against_our_endpoint(server, remote):
    assert isinstance(remote, RemoteEngineClient) and remote.kind == "workbench" and remote.alive
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=1, ignore_eos=True)
    outs = remote.generate(["Hello there", "Good night"], params)
    # exactly what the engine itself produces (token ids travel with return_token_ids)
    engine = EngineClient.connect(server["name"])
    try:
        direct = engine.generate(["Hello there", "Good night"], params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in direct]
        assert [o.text for o in outs] == [o.text for o in direct]
        assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in direct]
        assert [lp.token_id for lp in outs[0].logprobs] == direct[0].token_ids
        assert remote.weights_checksum() == engine.status()["weights_checksum"]
        # read-only, but the real values (those the engine leaves unset, None, are not reported)
        assert remote.settings() == {k: v for k, v in engine.settings().items() if v is not None}
    finally:
        engine.close()
    m = outs[0].metrics
    assert m.ttft is not None and m.ttft > 0 and len(m.token_times) == 5 and m.finished >= m.token_times[-1]
    chunks = list(remote.stream("Once upon", SamplingParams(max_tokens=4, temperature=0), chat=True))
    assert chunks[-1].finish_reason == "length" and chunks[-1].output.text == "".join(c.text_delta for c in chunks)
    assert len(chunks[-1].output.token_ids) == 4

    async def run_async():
        got = await remote.agenerate(prompt_token_ids=[[5, 6, 7]], params=SamplingParams(max_tokens=3, temperature=0))
        text = ""
        async for c in remote.astream("abc", SamplingParams(max_tokens=3, temperature=0)):
            text += c.text_delta
        return got, text

    got, text = asyncio.run(run_async())
    assert len(got[0].token_ids) == 3 and got[0].prompt_token_ids == [5, 6, 7] and text
    # OpenAI's penalties and logit_bias, and vLLM's min_tokens, reach the server
    biased = SamplingParams(max_tokens=4, temperature=0, logit_bias={2: 100.0}, min_tokens=2, presence_penalty=0.5)
    held = remote.generate(["Hi"], biased)[0]
    assert len(held.token_ids) == 3 and held.token_ids[2] == 2 and 2 not in held.token_ids[:2]  # 2: EOS

    with pytest.raises(RemoteSettingsError, match="cannot be changed"):
        remote.configure(max_num_seqs=4)
    with pytest.raises(ValueError):  # the server's 400 comes back as ValueError
        remote.generate(["x"], SamplingParams(max_tokens=MAX_LEN + 10))
    st = remote.status()
    assert st["server"] == "workbench" and st["read_only"] and st["remote_engine"]["max_model_len"] == MAX_LEN
    schema = remote.schema()
    assert schema and all(e["kind"] == "read-only" for e in schema)
    from workbench.jupyter.dashboard import Dashboard

    dash = Dashboard(client=remote, start=False)  # shown, never editable
    try:
        assert "batching" in dash.controls and all(c.disabled for c in dash.controls.values())
    finally:
        dash.close()


@pytest.mark.timeout(300)
def test_remote_abort_timeline_metrics_events(server, remote):
    since = remote.timeline(1 << 62).cursor
    sub = remote.events(["timeline", "metrics"])
    try:
        it = remote.stream("Keep going", SamplingParams(max_tokens=MAX_LEN - 16, ignore_eos=True))
        first = next(it)
        assert first.finish_reason is None
        it.close()  # leaving the stream aborts it: the HTTP stream is closed, the server aborts
        engine = EngineClient.connect(server["name"])
        try:
            deadline = time.monotonic() + 30
            while engine.metrics()["num_running"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert engine.metrics()["num_running"] == 0
        finally:
            engine.close()
        remote.generate(["one", "two"], SamplingParams(max_tokens=2))
        tl = remote.timeline(since)
        assert isinstance(tl, Timeline) and tl.steps == []
        kinds = [(ev.kind, ev.detail) for ev in tl.requests]
        assert ("finished", "abort") in kinds and kinds.count(("finished", "length")) == 2
        assert sum(k == "arrived" for k, _ in kinds) == 3 and sum(k == "first_token" for k, _ in kinds) == 3
        seen = set()
        deadline = time.monotonic() + 20
        while seen != {"timeline", "metrics"} and time.monotonic() < deadline:
            seen.add(sub.get(timeout=10).kind)
        assert seen == {"timeline", "metrics"}
    finally:
        sub.close()
    m = remote.metrics()
    assert m["sources"]["kv_usage"] == "server" and m["sources"]["ttft_p50_ms"] == "client"
    assert m["num_running"] == 0 and m["ttft_p50_ms"] > 0 and m["total_output_tokens"] > 0
    assert {"output_tok_s", "num_waiting", "kv_usage", "prefix_hit_rate", "spec_acceptance_rate", "itl_p99_ms"} <= set(
        m
    )


@pytest.mark.timeout(300)
def test_bench_endpoint_against_our_server(server, capsys):
    from workbench.bench.endpoint import run_endpoint_bench
    from workbench.cli import main

    rep = run_endpoint_bench(
        [f"ours={server['url']}"],
        num_requests=4,
        arrival="poisson",
        rate=20.0,
        seed=1,
        prompt_len=(8, 16),
        output_len=(2, 4),
        api_key=API_KEY,
    )
    r = rep["results"]["ours"]
    assert r["requests"] == 4 and r["errors"] == 0 and r["output_tok_s"] > 0 and r["ttft_p50_ms"] > 0
    assert r["output_tokens"] == rep["workload"]["output_tokens"]  # ignore_eos honoured: exact lengths
    assert rep["endpoints"]["ours"]["server"] == "workbench"
    assert (
        main(
            [
                "bench",
                "--endpoint",
                server["url"],
                "--api-key",
                API_KEY,
                "--requests",
                "2",
                "--quick",
                "--arrival",
                "poisson",
                "--rate",
                "50",
                "--json",
                "--token-ids",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    [(label, res)] = out["results"].items()
    assert label.startswith("workbench@127.0.0.1:") and {
        "output_tok_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
    } <= set(res)


@pytest.mark.timeout(120)
def test_named_remote_reaches_the_lab_server_hub(server):
    """register_remote gives a server an engine name: EngineClient.connect(name) and the Jupyter
    server extension's hub (which attach by name) then reach it."""
    import secrets

    from workbench.jupyter_server.hub import EngineHub
    from workbench.remote import list_remotes, register_remote, unregister_remote

    name = f"remote-{secrets.token_hex(3)}"
    register_remote(name, server["url"], api_key=API_KEY)
    try:
        assert {"name": name, "url": server["url"], "model": None} in list_remotes()
        with workbench.connect(name) as eng:
            assert isinstance(eng, RemoteEngineClient) and eng.name == name
            assert eng.generate(["hi"], SamplingParams(max_tokens=2))[0].finish_reason == "length"

        async def via_hub():
            hub = EngineHub()
            client = await hub.client(name)
            try:
                tl = await client.atimeline(None)
                return await client.astatus(), await client.asettings(), tl
            finally:
                hub.forget(name)

        status, settings, tl = asyncio.run(via_hub())
        assert status["server"] == "workbench" and settings["max_num_seqs"] == 64 and isinstance(tl, Timeline)
    finally:
        unregister_remote(name)
    assert all(r["name"] != name for r in list_remotes())
    with pytest.raises(FileNotFoundError):
        EngineClient.connect(name)


# -- a third-party-style server: text only, no /metrics, no extensions ----------------------------
@contextlib.contextmanager
def plain_openai_server():
    """A minimal OpenAI-compatible server of the kind we know nothing about (FastAPI, in a thread)."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    seen: list[dict] = []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "plain", "object": "model", "owned_by": "someone"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if body.get("temperature", 1) > 2:
            return JSONResponse(
                {"error": {"message": "temperature too high", "type": "invalid_request_error"}}, status_code=400
            )
        words = [f" w{i}" for i in range(body["max_tokens"])]

        async def gen():
            for i, w in enumerate(words):
                last = i == len(words) - 1
                yield (
                    "data: "
                    + json.dumps({"choices": [{"index": 0, "text": w, "finish_reason": "length" if last else None}]})
                    + "\n\n"
                )
                await asyncio.sleep(0.01)
            yield (
                "data: "
                + json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(words)}})
                + "\n\n"
            )
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.timeout(120)
def test_remote_against_a_plain_openai_server():
    with plain_openai_server() as (url, seen), RemoteEngineClient(url) as eng:
        assert eng.kind == "openai-compatible" and not eng.has_metrics and eng.model == "plain"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            [out] = eng.generate(["hi"], SamplingParams(max_tokens=3, top_k=5, temperature=0))
        assert any("top_k" in str(w.message) for w in caught)  # dropped, and said so
        assert "top_k" not in seen[-1] and "return_token_ids" not in seen[-1]
        assert out.text == " w0 w1 w2" and out.token_ids == [] and out.finish_reason == "length"
        assert len(out.metrics.token_times) == 3
        m = eng.metrics()
        assert "kv_usage" not in m and "prefix_hit_rate" not in m and m["total_output_tokens"] == 3
        assert m["sources"]["num_running"] == "client"
        assert eng.settings() == {}
        with pytest.raises(ValueError, match="temperature too high"):
            eng.generate(["x"], SamplingParams(max_tokens=1, temperature=3.0))


# -- llama.cpp's server on the same GGUF ----------------------------------------------------------
def _llama_cpp_available() -> str | None:
    try:
        import llama_cpp  # noqa: F401
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        return (
            f"llama-cpp-python[server] is not installed ({e}); it compiles llama.cpp for several minutes: "
            "`.venv/bin/pip install 'llama-cpp-python[server]'` to run this comparison"
        )
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(_llama_cpp_available() is not None, reason=str(_llama_cpp_available()))
def test_remote_against_llama_cpp_server_on_the_same_gguf(tmp_path):
    """llama.cpp's server (llama-cpp-python) and ours on the embedded SmolLM2 GGUF: the remote backend
    works the same against both; greedy outputs start alike (Q4 weights dequantised by us, used
    quantised by llama.cpp, so long continuations may drift)."""
    from workbench.models.loader import default_gguf_path

    gguf = default_gguf_path()
    port = free_port()
    log = tmp_path / "llama.log"
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "2048",
        "--model_alias",
        "smollm2",
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180  # loading; llama-cpp-python has no /health
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        with RemoteEngineClient(f"http://127.0.0.1:{port}", request_timeout=300) as llama:
            assert llama.kind in ("llama-cpp-python", "llama.cpp")
            params = SamplingParams(max_tokens=8, temperature=0)
            [theirs] = llama.generate(["The capital of France is"], params)
            assert theirs.finish_reason in ("stop", "length") and theirs.text
            assert theirs.metrics.ttft is not None
            chunks = list(llama.stream("Count: one, two,", params))
            assert chunks[-1].output is not None
            from workbench import LLM

            [ours] = LLM(str(gguf)).generate(["The capital of France is"], params)
            assert ours.text.split()[:1] == theirs.text.split()[:1]
            assert [ev.kind for ev in llama.timeline().requests].count("finished") == 2
    finally:
        stop_process(proc)


def test_connect_errors_are_clear():
    port = free_port()  # nothing listens there
    with pytest.raises(ConnectionError, match="no OpenAI-compatible server"):
        workbench.connect(f"http://127.0.0.1:{port}", timeout=2)
    with pytest.raises(ValueError):
        RemoteEngineClient("ftp://x")


@pytest.mark.timeout(300)
def test_magics_connect_to_url_share_it_with_the_lab_panel(server):
    """`%engine connect URL` attaches the magics and lists the server for the lab panel."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from workbench.jupyter import session as wb_session
    from workbench.remote import list_remotes, unregister_remote

    url = server["url"] + "/v1"
    os.environ["WORKBENCH_API_KEY"] = API_KEY
    ip = InteractiveShell.instance()
    try:
        wb_session.reset_session("default")
        ip.run_line_magic("load_ext", "workbench")
        with capture_output() as cap:
            ip.run_line_magic("engine", f"connect {url}")
        shown = cap.stdout + "".join(str(o.data) for o in cap.outputs)
        assert "listed in the lab panel" in shown
        [entry] = [r for r in list_remotes() if r["url"].rstrip("/") == url]
        with capture_output():
            res = ip.run_cell("%%generate --max-tokens 3 --temperature 0 -o outs\nHello")
        assert res.success and len(ip.user_ns["outs"][0].token_ids) == 3
    finally:
        os.environ.pop("WORKBENCH_API_KEY", None)
        wb_session.reset_session("default")
        for r in list_remotes():
            if r["url"].rstrip("/") == url:
                unregister_remote(r["name"])
