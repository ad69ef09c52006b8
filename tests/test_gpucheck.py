"""`workbench gpucheck --dry-run`: the GPU check's whole pipeline on this CPU (issue 29), so the
script a lent GPU runs once cannot rot between the sessions that have one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# gpucheck's sections, in the order they run (the most needed first: a spent budget skips the last)
EVERY_SECTION = (
    "kernels exactness launches triton cuda_graphs async_scheduling ttft batch256 hf_sequential hf_compiled torch_ops "
    "sweep".split()
)


def _gpucheck(cwd, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`workbench gpucheck ARGS` in `cwd`, never the repo root: `python -m` puts the working
    directory first on sys.path, where our kernels/ folder shadows Hugging Face's `kernels` package
    (transformers imports it once installed, as a fresh venv now has it)."""
    return subprocess.run(
        [sys.executable, "-m", "workbench.cli", "gpucheck", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_writes_the_report_a_gpu_run_writes(tmp_path):
    out = tmp_path / "gpu" / "check.json"
    done = _gpucheck(tmp_path, "--dry-run", "--output", str(out), timeout=850)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["dry_run"] is True and "Triton interpreter" in rep["device"]["name"]
    assert {"device", "kernels", "engine", "cuda_graphs", "dry_run", "limits", "targets"} <= set(rep)
    assert rep["shape"] is None  # no --shape: the dry run's tiny model
    names = [k["name"] for k in rep["kernels"]]
    for kernel in (
        "decode_attention smollm2",
        "decode_attention gqa8:1",
        "extend_attention smollm2",
        "extend_attention gqa8:1",
        "decode_attention llama3-8b 32q/8kv d128",
        "extend_attention llama3-8b",
        "write_kv smollm2",
        "write_kv int8",
        "fused_moe",
    ):
        assert any(n.startswith(kernel) for n in names), (kernel, names)
    # issue 50.3: each shape's decode at a long context too (split-KV's case; the dry run's 1 x 256)
    assert sum(n.startswith("decode_attention") and n.endswith(" 1x256") for n in names) == 3
    for k in rep["kernels"]:
        assert "error" not in k, k
        assert {"name", "max_abs_err", "gb_s", "fraction"} <= set(k)
        assert k["max_abs_err"] < (0.05 if k["name"].startswith("write_kv int8") else 1e-3), k  # fp32, small shapes
        assert k["gb_s"] > 0 and k["fraction"] > 0
    eng = rep["engine"]
    for run in ("triton", "torch_ops", "triton_cuda_graphs", "triton_async"):
        assert "error" not in eng[run], eng[run]
        assert eng[run]["results"]["workbench"]["output_tok_s"] > 0
    assert "hf_static" in eng["triton"]["results"]
    # issue 50.5's baselines: transformers in one batch of every request, its static KV cache; the
    # engine's cache holds every request at once; 256-style batches; compiling asked (not on a CPU)
    for run, n in (("triton", 4), ("batch256", 8)):
        assert eng[run]["hf_static"] == {
            "batch_size": n,
            "cache": "static",
            "compile_asked": False,
            "frames_compiled": 0,
        }
        assert eng[run]["token_agreement"]["hf_static"]["requests"] == n  # bf16 here: agreement is test_bench's
        assert eng[run]["engine_status"]["num_kv_blocks"] == n * 9 + 64
    assert (
        eng["batch256"]["results"]["workbench"]["requests"] == 8
        and "workbench_single_stream" not in eng["batch256"]["results"]
    )
    assert set(eng["hf_compiled"]["results"]) == {"hf_static"}
    assert {"hf_sequential", "hf_single_stream"} <= set(eng["hf_sequential"]["results"])
    assert list(rep["sections_s"]) == EVERY_SECTION
    assert rep["skipped"] == [] and "errors" not in rep
    # the sweep timed the default and the grid's configuration for each shape and kind
    assert len(rep["sweep"]) == 6  # three attention shapes, decode and prefill
    for r in rep["sweep"].values():
        assert r["configs_timed"] == 2 and r["complete"] and r["default"]["time_us"] > 0, r
    assert eng["triton"]["engine_status"]["attention_backend"] == "triton"
    assert eng["torch_ops"]["engine_status"]["attention_backend"] == "torch"
    # the engine on this device's Triton kernels gives transformers' fp32 greedy tokens, every request
    assert list(eng["exactness"]) == ["triton", "triton_cuda_graphs", "triton_async", "triton_sdpa_prefill"]
    for check in eng["exactness"].values():
        assert check["identical_requests"] == check["requests"] == 5, check
        assert check["sampled_repeatable"] is True and check["sampled_as_first"] is True, check
    assert eng["exactness"]["triton_async"]["overlapped_steps"] > 0
    # issue 50.2: the eager decode step's launches per layer, counted; the fused layer ops serve
    launches = rep["launches"]
    assert launches["fused_layers"] is True and launches["layers"] == 2
    assert rep["launches_per_layer"] == launches["counts"]["fused"]["per_layer"] <= 12
    assert launches["counts"]["unfused"]["per_layer"] >= rep["launches_per_layer"] + 10
    assert "kernel launches per layer, eager decode of 4: " in out.with_suffix(".md").read_text()
    assert "USDT" not in done.stderr and "profiler_start" not in done.stderr
    graphs = rep["cuda_graphs"]
    assert graphs["buckets"] == [1, 2, 4]  # max_num_seqs: the run's requests, 4 here
    assert graphs["steps"]["replayed"] == 0 and graphs["steps"]["eager"] > 0
    assert graphs["last_eager_reason"] == "CUDA graphs need a CUDA device; this engine runs on cpu"
    overlap = rep["async_scheduling"]  # issue 50.4: the same runs with async scheduling, side by side
    assert overlap["w64_tok_s_on"] > 0 and overlap["w64_tok_s_off"] > 0 and overlap["single_stream_tok_s_on"] > 0
    assert overlap["w64_device_busy_on"] is None  # a CPU has no device to idle: no share to claim
    ttft = rep["ttft"]  # issue 50.5: one prompt's TTFT over its compute limit (the dry run's 48 tokens)
    assert ttft["prompt_tokens"] == 48 and ttft["ttft_ms"] > 0 and ttft["limit_ms"] > 0
    assert ttft["over_limit"] == pytest.approx(ttft["ttft_ms"] / ttft["limit_ms"]) and len(ttft["ttfts_ms"]) == 4
    # issue 50.3: the prefill path auto picks (off CUDA: our kernel, unmeasured), and each path's TTFT
    assert ttft["prefill_attention"] == "kernel" and "off CUDA" in ttft["prefill_attention_reason"]
    assert set(ttft["ttft_ms_by_path"]) == {"kernel", "sdpa"} and min(ttft["ttft_ms_by_path"].values()) > 0
    assert rep["targets"] == []  # no speed targets on a dry run
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# workbench gpucheck (dry run)") and "Dry run: no speed targets." in md
    assert "| fused_moe |" in md
    assert "- batch256 / hf_static: transformers in padded batches of 8, static KV cache, compile off" in md
    assert "- step breakdown, triton / workbench: " in md and "kernel launches a layer (eager decode" in md


def test_gpucheck_without_cuda_says_how_to_dry_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the real check would run")
    done = _gpucheck(tmp_path, "--output", str(tmp_path / "x.json"), timeout=120)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr and "--dry-run" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_budget_spent_skips_every_section_and_still_writes_the_report(tmp_path):
    out = tmp_path / "check.json"
    done = _gpucheck(tmp_path, "--dry-run", "--budget-s", "0", "--output", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert [s.split(":")[0] for s in rep["skipped"]] == EVERY_SECTION
    assert rep["kernels"] == [] and rep["limits"]["copy_GBps"] > 0
    assert "skipped sweep: past the 0 s budget" in out.with_suffix(".md").read_text()


def test_an_unknown_section_is_refused_naming_the_known_ones(tmp_path):
    done = _gpucheck(
        tmp_path, "--dry-run", "--only", "kernels,graphs", "--output", str(tmp_path / "x.json"), timeout=300
    )
    assert done.returncode == 2
    assert "unknown gpucheck section(s) graphs" in done.stderr and "cuda_graphs" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_gpucheck_parses_without_the_serving_stack(tmp_path):
    """A lent GPU machine's image has torch and Triton but not pyzmq: the CLI builds only the
    subcommand asked for (building every parser imported zmq and stopped the device run at once)."""
    code = (
        "import sys; sys.modules['zmq'] = None\n"  # `import zmq` now raises ImportError
        "from workbench.cli import main\n"
        "sys.exit(main(['gpucheck', '--help']))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--budget-s" in done.stdout and "--only" in done.stdout


def test_targets_of_the_h200_report_and_of_the_sections_added_since():
    """`targets` and the summary run only after a GPU run: here on the H200 run's report (sections
    of its day) and on it with the sections added since, values made up."""
    import copy

    from workbench.bench.gpu_report import summary_markdown, targets

    rep = json.loads((Path(__file__).parent.parent / "docs" / "gpu" / "gpucheck.json").read_text())
    got = {t["name"]: round(t["value"], 3) for t in targets(rep)}
    assert got == {
        "decode_attention_fraction": 0.439,
        "prefill_vs_sdpa": 0.612,
        "engine_vs_transformers_w64": 3.282,
        "engine_vs_transformers_w64_cuda_graphs": 25.402,
        "cuda_graphs_single_stream": 7.388,
    }
    now = copy.deepcopy(rep)
    eng = now["engine"]
    eng["triton"]["engine_status"]["num_layers"] = 30  # its eager single stream: 51.67 tok/s, the baseline
    eng["batch256"] = {"ratios": {"workbench_vs_hf_static": 6.5}, "results": {}}
    w64_graphs = eng["triton_cuda_graphs"]["results"]["workbench"]["output_tok_s"]
    hf = {"batch_size": 64, "cache": "static", "compile_asked": True, "frames_compiled": 0}
    compiled = {**eng["triton"]["results"]["hf_static"], "output_tok_s": w64_graphs / 4}
    eng["hf_compiled"] = {"results": {"hf_static": compiled}, "hf_static": hf}
    now["async_scheduling"] = {"w64_device_busy_on": 0.97}
    now["ttft"] = {
        "prompt_tokens": 2048, "ttft_ms": 60.0, "limit_ms": 50.0, "over_limit": 1.2, "prefill_TFLOPs": 29.7,
        "achieved_TFLOPs": 495.0, "prefill_attention": "sdpa", "prefill_attention_reason": "auto, measured",
        "ttft_ms_by_path": {"triton": 66.0, "sdpa": 60.0},
    }  # fmt: skip
    now["launches_per_layer"] = 9
    got = {t["name"]: (round(t["value"], 3), t["met"]) for t in targets(now)}
    assert got["engine_vs_transformers_batch256"] == (6.5, True)
    assert got["eager_layer_cost_vs_first_run"] == (1.0, False)
    assert got["device_busy_w64_async"] == (0.97, True)
    assert got["ttft_over_compute_limit"] == (1.2, True) and got["launches_per_layer"] == (9, True)
    assert "engine_vs_transformers_w64_compiled" not in got  # nothing compiled: no such baseline
    hf["frames_compiled"] = 3
    got = {t["name"]: (round(t["value"], 3), t["met"]) for t in targets(now)}
    assert got["engine_vs_transformers_w64_compiled"] == (4.0, False)
    md = summary_markdown({**now, "targets": targets(now)})
    assert "- hf_compiled / hf_static: transformers in padded batches of 64, static KV cache, compile asked, 3" in md
    assert "prefill attention sdpa (auto, measured); TTFT by path (ms): triton 66.0, sdpa 60.0" in md
    # issue 50.2: the eager run's step breakdown beside the launches a layer counted
    assert "- step breakdown, triton / workbench: 266 steps, 11.4 s; layers 97%, prepare 1%" in md
    assert "between steps; 9 kernel launches a layer (eager decode, `launches`)" in md


def test_a_failing_section_brings_back_where_it_failed(monkeypatch, capsys):
    """A lent device is rare: a section that fails leaves its message and the last frames of its
    traceback in the report (the whole of it in the run's log), and the others still run."""
    from workbench.bench import gpu_engine, gpucheck

    def broken(*args, **kwargs):
        raise ValueError("made to fail")

    monkeypatch.setattr(gpu_engine, "launches", broken)
    rep = gpucheck.run_gpucheck(dry_run=True, only=["launches", "triton"], budget_s=600)
    assert rep["errors"] == {"launches": "ValueError: made to fail"}
    where = rep["tracebacks"]["launches"]
    assert "in broken" in where and "made to fail" in where and "in launches" in where
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    assert "triton" in rep["engine"] and "triton" not in rep["errors"]
