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


def run_llama_server(
    binary: str,
    gguf: str,
    workloads: dict[str, Workload],
    *,
    threads: int,
    progress=None,
    log=lambda msg: None,
    startup_timeout: float = 120.0,
) -> tuple[dict[str, dict], dict]:
    """Serve each named workload in turn on one fresh llama-server; returns ({name: summary}, how
    it was run). `progress(name, total)` makes a progress bar per workload, as in the runner."""
    from .server_peer import ServerPeer, free_port, serve_workloads

    longest = max(r.prompt_len + r.max_tokens for w in workloads.values() for r in w.requests)
    port = free_port()
    cmd = [
        binary,
        "-m",
        gguf,
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(SLOTS * (longest + 64)),
        "-np",
        str(SLOTS),
        "-cb",
        "--no-cache-prompt",
        "--no-webui",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    summaries, how = serve_workloads(
        ServerPeer("llama-server", cmd, port, startup_timeout=startup_timeout), workloads, progress=progress, log=log
    )
    return summaries, {**how, "gguf": gguf, "slots": SLOTS}
