"""`start_engine`: spawn an engine process, wait until it serves, and hand back its client.

The child runs `python -m workbench.ipc.engine_main` with the settings as flags; its log goes to a
file beside the connection file, so a start that fails says why (the log's last lines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import connection as conn
from .client import EngineClient
from .protocol import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_MESSAGE_MB,
    DEFAULT_MAX_QUEUED_CHARS,
    DEFAULT_MAX_QUEUED_TOKENS,
    START_FAILED,
    EngineDeadError,
    EngineStartError,
)

__all__ = ["start_engine"]


# -- start_engine -------------------------------------------------------------------------------
def start_engine(
    model: str | os.PathLike | None = None,
    *,
    name: str | None = None,
    timeout: float = 600.0,
    transport: str = "ipc",
    host: str = "127.0.0.1",
    port: int = 0,
    client_timeout: float = 10.0,
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB,
    detach: bool = False,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    max_queued_chars: int = DEFAULT_MAX_QUEUED_CHARS,
    max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS,
    **settings: Any,
) -> EngineClient:
    """Spawn a long-lived engine process (a fresh interpreter: never a fork, so it is safe from a
    notebook), wait until it is ready, and return a client of it.

    `settings` are engine settings (validated here first). Unless `detach=True`, the engine stops
    when this process exits. `drain_timeout`: how long a SIGTERM lets running requests finish;
    `max_queued_chars` / `max_queued_tokens`: admission limits (beyond them EngineBusyError).
    Raises EngineStartError with the engine's last log lines when it fails to start (a bad model
    path shows the loader's message), or does not become ready within `timeout` seconds (loading,
    or converting the default model the first time, is the usual cause)."""
    from ..settings import validate

    settings = validate(settings)
    if transport not in ("ipc", "tcp"):
        raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
    directory = conn.runtime_dir()
    name = conn.check_name(name) if name is not None else conn.unique_name(directory)
    holder = conn.live_engine(name, directory)
    if holder is not None:
        raise FileExistsError(
            f"an engine named {name!r} is already running (pid {holder.pid}); connect with "
            f"EngineClient.connect({name!r}) or pass another name"
        )
    log_file = conn.log_path(name, directory)
    if log_file.exists() and log_file.stat().st_size:  # an engine restarted under its name keeps the last log
        log_file.replace(log_file.with_name(log_file.name + ".1"))
    cmd = [
        sys.executable,
        "-m",
        "workbench.ipc.engine_main",
        "--name",
        name,
        "--transport",
        transport,
        "--host",
        host,
        "--port",
        str(int(port)),
        "--client-timeout",
        str(float(client_timeout)),
        "--max-message-mb",
        str(float(max_message_mb)),
        "--settings-json",
        json.dumps(settings),
        "--drain-timeout",
        str(float(drain_timeout)),
        "--max-queued-chars",
        str(int(max_queued_chars)),
        "--max-queued-tokens",
        str(int(max_queued_tokens)),
        "--log-file",
        str(log_file),
    ]
    if model is not None:
        cmd += ["--model", os.fspath(model)]
    if not detach:
        cmd += ["--parent-pid", str(os.getpid())]
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[conn.ENV_RUNTIME_DIR] = str(directory)
    env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_file, "wb") as logf:
        os.chmod(log_file, 0o600)
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            close_fds=True,
            start_new_session=True,
        )
    try:
        return _wait_ready(proc, name, directory, log_file, timeout)
    except BaseException:
        _kill(proc)
        raise


def _wait_ready(proc: subprocess.Popen, name: str, directory: Path, log_file: Path, timeout: float) -> EngineClient:
    deadline = time.monotonic() + timeout
    path = conn.connection_path(name, directory)
    while True:
        rc = proc.poll()
        if rc is not None:
            raise EngineStartError(_start_failure(name, f"exited with code {rc} while starting", log_file))
        try:
            info = conn.read_connection_file(path)
        except (OSError, ValueError, TypeError):
            info = None
        if info is not None and info.pid == proc.pid:
            left = max(1.0, deadline - time.monotonic())
            try:
                return EngineClient(info, process=proc, timeout=min(left, 60.0))
            except EngineDeadError:
                raise EngineStartError(_start_failure(name, "died during the handshake", log_file)) from None
        if time.monotonic() > deadline:
            raise EngineStartError(
                _start_failure(
                    name,
                    f"did not become ready within {timeout}s (loading the weights, or converting the "
                    "default model the first time, is the usual cause; pass a larger timeout=)",
                    log_file,
                )
            )
        time.sleep(0.05)


def _start_failure(name: str, what: str, log_file: Path) -> str:
    tail = _tail(log_file)
    reason = next((line.split(START_FAILED, 1)[1].strip() for line in reversed(tail) if START_FAILED in line), None)
    head = f"engine {name!r} {what}" + (f": {reason}" if reason else "")
    return head + f"\n--- last lines of {log_file} ---\n" + "\n".join(tail)


def _tail(path: Path, lines: int = 30) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16_384))
            return f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
