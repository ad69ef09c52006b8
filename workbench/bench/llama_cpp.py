"""llama.cpp's `llama-server` as a peer in `workbench bench` (system `llama_server`).

When a `llama-server` binary is found (`--llama-server PATH`, `$WORKBENCH_LLAMA_SERVER`, or on
PATH), the bench starts it on the model's own GGUF (the embedded model ships as one: Q4_1) with
continuous batching over 16 slots, sends it the bench's workload -- the same requests, as token
ids, released at the same times -- through the OpenAI-compatible client, and stops it. Timing is
client-side (TTFT to the first streamed token, ITL between chunks), over loopback.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from .workload import Workload

SLOTS = 16
HOW_TO_GET = (
    "llama.cpp's llama-server is not on PATH (give it with --llama-server PATH or $WORKBENCH_LLAMA_SERVER). "
    "It builds offline from the llama-cpp-python sdist in ~10 minutes on 2 cores: "
    "pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz && "
    "cd llama_cpp_python-*/ && cmake -S vendor/llama.cpp -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON && "
    "cmake --build build --target llama-server llama-bench -j2 (the binaries land in build/bin/)"
)


def find_llama_server(explicit: str | None = None) -> str | None:
    for candidate in (explicit, os.environ.get("WORKBENCH_LLAMA_SERVER"), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    if explicit:
        raise ValueError(f"--llama-server {explicit!r} is not an executable file")
    return None


def model_gguf(model) -> str | None:
    """The GGUF llama.cpp serves for `model`: the embedded model's own file, or the .gguf given."""
    from ..models.loader import DEFAULT_MODEL, default_gguf_path

    if model is None or model == DEFAULT_MODEL:
        return str(default_gguf_path())
    if str(model).lower().endswith(".gguf"):
        return str(model)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_llama_server(binary: str, gguf: str, workloads: dict[str, Workload], *, threads: int, progress=None,
                     log=lambda msg: None, startup_timeout: float = 120.0) -> tuple[dict[str, dict], dict]:
    """Serve each named workload in turn on one fresh llama-server; returns ({name: summary}, how
    it was run). `progress(name, total)` makes a progress bar per workload, as in the runner."""
    import tempfile

    from ..remote import RemoteEngineClient
    from ..sampling_params import SamplingParams
    from .driver import serve_workload
    from .endpoint import endpoint_summary

    longest = max(r.prompt_len + r.max_tokens for w in workloads.values() for r in w.requests)
    ctx = SLOTS * (longest + 64)
    port = _free_port()
    cmd = [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", str(SLOTS), "-cb",
           "--no-cache-prompt", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]
    log(f"llama_server: {' '.join(cmd)}")
    # its log goes to a file: a pipe nobody reads would fill and stall the server mid-run
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        summaries = {}
        try:
            _wait_ready(proc, err, url, startup_timeout)
            with RemoteEngineClient(url) as client:
                client.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
                for name, workload in workloads.items():
                    bar = progress(name, len(workload.requests)) if progress is not None else None
                    try:
                        served, start = serve_workload(client, workload.requests, progress=bar, keep_errors=True)
                    finally:
                        if bar is not None:
                            bar.close()
                    summaries[name] = endpoint_summary(served, start)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return summaries, {"command": cmd, "gguf": gguf, "slots": SLOTS, "timing": "client-side over loopback"}


def _wait_ready(proc: subprocess.Popen, err, url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-1500:]
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready: {tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"llama-server was not ready within {timeout:.0f} s")
