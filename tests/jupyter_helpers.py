"""Shared by the engine-process and Jupyter tests: private runtime dirs, engines that always get
stopped, kernels, JupyterLab processes and notebooks."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@contextlib.contextmanager
def private_runtime_dir(path: Path):
    """Point the ipc layer (and every child process) at a private runtime directory."""
    from workbench.ipc import connection as conn

    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    old = os.environ.get(conn.ENV_RUNTIME_DIR)
    os.environ[conn.ENV_RUNTIME_DIR] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop(conn.ENV_RUNTIME_DIR, None)
        else:
            os.environ[conn.ENV_RUNTIME_DIR] = old


def stop_engine(client, *, check: bool = False) -> None:
    """Shut an engine down whatever state it is in; kill its process if needed. With `check`, a
    failing shutdown still raises (after the process is killed)."""
    if client is None:
        return
    try:
        client.shutdown(timeout=20)
    except Exception:
        if check:
            raise
    finally:
        proc = getattr(client, "process", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)


def kill_engines_in(runtime_dir: Path) -> None:
    """Kill any engine whose connection file is still in `runtime_dir` (one a test left behind)."""
    import signal

    from workbench.ipc import connection as conn

    for info in conn.list_engines(runtime_dir):
        try:
            os.kill(info.pid, signal.SIGKILL)
        except OSError:
            pass


@contextlib.contextmanager
def private_engine(runtime_dir: Path, model=None, **kwargs):
    """`start_engine(model, **kwargs)` in a private runtime dir; stopped at the end whatever
    happens, with any engine left behind in that dir killed too."""
    from workbench.ipc.launch import start_engine

    with private_runtime_dir(runtime_dir):
        eng = start_engine(model, **kwargs)
        try:
            yield eng
        finally:
            stop_engine(eng)
            kill_engines_in(runtime_dir)


def wait_for(pred, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Kernel:
    """A real IPython kernel (jupyter_client) with helpers to run cells and read IOPub."""

    def __init__(self, env: dict[str, str], cwd: str | None = None, startup_timeout: float = 90):
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(
            kernel_name="python3", env=env, cwd=cwd or str(REPO), startup_timeout=startup_timeout
        )

    def execute(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout: float = 120, on_msg=None) -> tuple[list[dict], float]:
        """IOPub messages of one execution until it goes idle; also the seconds it took."""
        msgs = []
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"cell did not finish within {timeout}s; got {[m['msg_type'] for m in msgs]}")
            try:
                m = self.kc.get_iopub_msg(timeout=min(left, 5))
            except queue.Empty:
                continue
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            msgs.append(m)
            if on_msg is not None:
                on_msg(m)
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                return msgs, time.monotonic() - t0

    def run(self, code: str, timeout: float = 120, allow_error: bool = False) -> list[dict]:
        msgs, _ = self.collect(self.execute(code), timeout)
        errors = [m for m in msgs if m["msg_type"] == "error"]
        if errors and not allow_error:
            raise AssertionError("cell failed:\n" + "\n".join(errors[0]["content"]["traceback"]))
        return msgs

    def stdout(self, code: str, timeout: float = 60) -> str:
        return "".join(
            m["content"]["text"]
            for m in self.run(code, timeout)
            if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
        )

    def send_comm(self, comm_id: str, data: dict) -> None:
        msg = self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        self.kc.shell_channel.send(msg)

    def close(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)


def texts(msgs: list[dict], mime: str = "text/plain") -> str:
    """Everything a cell showed in `mime` (displays, updates, results, streams)."""
    out = []
    for m in msgs:
        c = m["content"]
        if m["msg_type"] in ("display_data", "update_display_data", "execute_result"):
            out.append(str(c["data"].get(mime, "")))
        elif m["msg_type"] == "stream" and mime == "text/plain":
            out.append(c["text"])
        elif m["msg_type"] == "error":
            out.append("\n".join(c["traceback"]))
    return "\n".join(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def notebook(cells: list[str]) -> dict:
    """An nbformat 4 notebook of code cells (python3 kernel)."""
    return {
        "cells": [
            {"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [], "source": src}
            for i, src in enumerate(cells)
        ],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def stop_process_group(proc: subprocess.Popen) -> None:
    """SIGTERM a process started with `start_new_session=True` and its group; SIGKILL if it lingers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def browser_skip_reason() -> str | None:
    """Why a headless-Chromium test cannot run here (None: it can)."""
    if not os.path.exists(CHROMIUM):
        return "no chromium (run `make browser`)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed"
    return None
