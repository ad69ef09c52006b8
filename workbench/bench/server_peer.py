"""A peer that is a server of its own (llama.cpp's `llama-server`, vLLM, our own `workbench serve
--http`): started here on a free loopback port, sent the bench's workloads through the same
driver and OpenAI client as every endpoint (`RemoteEngineClient`), and stopped.

The process runs in a session of its own, its log in a file (a pipe nobody reads would fill and
stall it mid-run); stopping it ends its whole process group (vLLM and our server start children).
A peer that fails to start is reported with the tail of its log. On Linux the kernel also sends it
SIGTERM when the process that started it dies: a bench killed mid-run (a CI timeout, `kill -9`)
left a vLLM server computing in its own session, found after a probe was stopped by SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .workload import Workload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerPeer:
    """How to start one peer server: its command (listening on `port`), environment and name."""

    name: str
    command: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 120.0
    health_path: str = "/health"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class RunningPeer:
    """A started `ServerPeer`, ready to serve (a context manager that stops it)."""

    def __init__(self, peer: ServerPeer, log: Callable[[str], None] = lambda msg: None):
        self.peer = peer
        self._err = tempfile.TemporaryFile()
        log(f"{peer.name}: {' '.join(peer.command)}")
        self.proc = subprocess.Popen(
            peer.command,
            stdout=self._err,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **peer.env},
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
        self.started = time.monotonic()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - self.started

    def log_tail(self, chars: int = 1500) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-chars:]

    def _wait_ready(self) -> None:
        import httpx

        p = self.peer
        deadline = time.monotonic() + p.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{p.name} exited with {self.proc.returncode} before it was ready: {self.log_tail()}"
                )
            try:
                if httpx.get(p.url + p.health_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{p.name} was not ready within {p.startup_timeout:.0f} s: {self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._err.close()

    def __enter__(self) -> RunningPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_parent():
    """A preexec_fn asking the kernel to SIGTERM the child when its parent dies (Linux), or None.
    Only from the main thread: the signal follows the thread that forked, not the process."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork
    parent = os.getpid()

    def arm() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the request took hold
            os._exit(1)

    return arm


def serve_workloads(
    peer: ServerPeer, workloads: dict[str, Workload], *, progress=None, log: Callable[[str], None] = lambda msg: None
) -> tuple[dict[str, dict], dict]:
    """Start `peer`, serve each named workload in turn through the endpoint driver, stop it;
    returns ({name: summary}, how it was run). `progress(name, total)` makes a bar per workload."""
    from ..remote import RemoteEngineClient
    from ..sampling_params import SamplingParams
    from .driver import serve_workload
    from .endpoint import endpoint_summary

    summaries = {}
    with RunningPeer(peer, log) as running, RemoteEngineClient(peer.url) as client:
        # warm-up, as token ids: a model without a tokenizer takes no text
        client.generate(prompt_token_ids=[[1, 2, 3, 4]], params=SamplingParams(max_tokens=4, temperature=0.0))
        for name, workload in workloads.items():
            bar = progress(name, len(workload.requests)) if progress is not None else None
            try:
                structured = workload.extra.get("structured")  # a constraint: outputs end with their grammar
                if structured is not None:  # compiled (and the server's grammar backend loaded) before it is timed
                    client.generate(
                        prompt_token_ids=[[1, 2, 3, 4]], params=SamplingParams(max_tokens=4, structured=structured)
                    )
                served, start = serve_workload(
                    client,
                    workload.requests,
                    progress=bar,
                    keep_errors=True,
                    structured=structured,
                    ignore_eos=structured is None,
                )
            finally:
                if bar is not None:
                    bar.close()
            summaries[name] = endpoint_summary(served, start)
        how = {
            "command": peer.command,
            "env": peer.env,
            "startup_s": round(running.startup_s, 1),
            "server": client.kind,
            "timing": "client-side over loopback",
        }
    return summaries, how
