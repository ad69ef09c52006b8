"""Shared by the HTTP endpoint and remote backend tests: one `workbench serve --http` process per
test session (a separate process, as users run it), on a tiny random model that has the
embedded SmolLM2 tokenizer (so text, chat templates and logprob strings are real while a
step costs next to nothing). Stopped at the end of the session, and at exit whatever happens."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key-" + secrets.token_hex(4)
MAX_LEN = 2048  # the tiny model's context: long enough that a long request cannot finish before it is aborted
_server: dict | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_tokenized_model(path: Path, *, seed: int = 0, max_len: int = MAX_LEN) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer files (no transformers)."""
    import torch
    from safetensors.torch import save_file

    from workbench.models import loader

    path.mkdir(parents=True, exist_ok=True)
    vocab, hidden, inter, layers, heads, kv, hd = 49152, 64, 128, 2, 4, 2, 16
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).contiguous()

    weights = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": w(heads * hd, hidden),
                p + "self_attn.k_proj.weight": w(kv * hd, hidden),
                p + "self_attn.v_proj.weight": w(kv * hd, hidden),
                p + "self_attn.o_proj.weight": w(hidden, heads * hd),
                p + "mlp.gate_proj.weight": w(inter, hidden),
                p + "mlp.up_proj.weight": w(inter, hidden),
                p + "mlp.down_proj.weight": w(hidden, inter),
                p + "input_layernorm.weight": torch.ones(hidden),
                p + "post_attention_layernorm.weight": torch.ones(hidden),
            }
        )
    save_file(weights, str(path / "model.safetensors"))
    src = loader.ensure_converted(loader.default_gguf_path(), loader.DEFAULT_MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, path / name)
    return path


def wait_http(url: str, proc: subprocess.Popen | None, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}:\n{_tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy within {timeout}s:\n{_tail(log)}")


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-40:])


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM (graceful: the front stops its engine), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def shared_server(config, tmp_root: Path) -> dict:
    """Start (once per session) `workbench serve --http` on the tiny model; stopped at session end."""
    global _server
    if _server is not None:
        if _server["proc"].poll() is None:
            return _server
        raise RuntimeError(f"the shared HTTP server died:\n{_tail(_server['log'])}")
    model = make_tiny_tokenized_model(tmp_root / "tiny-tok")
    port = free_port()
    name = f"httptest-{secrets.token_hex(3)}"
    log = tmp_root / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    key_file = tmp_root / "api-key"
    key_file.write_text(API_KEY + "\n")
    cmd = [
        sys.executable,
        "-m",
        "workbench.cli",
        "serve",
        "--http",
        f"127.0.0.1:{port}",
        "--model",
        str(model),
        "--name",
        name,
        "--api-key-file",
        str(key_file),
        "--http-log-level",
        "warning",
        "--max-request-mb",
        "1",
        "--request-read-timeout",
        "5",
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)
    atexit.register(stop_process, proc, 10.0)

    def cleanup():
        stop_process(proc)
        from workbench.ipc import connection as conn

        conn.log_path(name).unlink(missing_ok=True)  # the engine's log in the shared runtime dir

    config.add_cleanup(cleanup)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc, 240, log)
    except BaseException:
        stop_process(proc)
        raise
    _server = {
        "url": url,
        "key": API_KEY,
        "name": name,
        "model": model,
        "proc": proc,
        "log": log,
        "model_name": model.name,
    }
    return _server
