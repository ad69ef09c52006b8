"""`workbench lab`: the README's run command. It starts the engine named "default" on the
embedded model and JupyterLab on notebooks/ with the quickstart open, and stops the engine when
JupyterLab exits. Real processes; everything is killed at the end whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from jupyter_helpers import REPO, kill_engines_in, private_runtime_dir, wait_for

from workbench.jupyter.lab import QUICKSTART, jupyter_command, lab_url, notebook_dir

pytestmark = [pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_command_opens_the_quickstart_in_notebooks():
    from workbench.cli import build_parser

    args = build_parser().parse_args(
        ["lab", "--no-browser", "--port", "9999", "--batching", "static", "--", "--ServerApp.token=x"]
    )
    assert args.name == "default" and args.setting_batching == "static"
    nb_dir = notebook_dir(str(REPO / "notebooks"))
    cmd = jupyter_command(args, nb_dir, 9999, None)
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={nb_dir}" in cmd and "--port=9999" in cmd and "--no-browser" in cmd
    assert "--ServerApp.token=x" in cmd and "--" not in cmd
    assert not any(c.startswith("--IdentityProvider.token") for c in cmd)  # the user's token, not ours
    assert cmd[-1] == str(nb_dir / QUICKSTART)
    # a quiet start: what the launcher quiets, the user can still set after --
    assert "--ServerApp.log_level=WARN" in cmd
    settings_dir = next(c for c in cmd if c.startswith("--LabApp.app_settings_dir=")).split("=", 1)[1]
    overrides = json.loads((Path(settings_dir) / "overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    loud = argparse.Namespace(**{**vars(args), "jupyter_args": ["--", "--ServerApp.log_level=DEBUG"]})
    loud_cmd = jupyter_command(loud, nb_dir, 9999, "tok")
    assert "--ServerApp.log_level=DEBUG" in loud_cmd and "--ServerApp.log_level=WARN" not in loud_cmd
    assert "--IdentityProvider.token=tok" in loud_cmd
    # the URL it prints opens the quickstart, not the Launcher
    assert lab_url(args, nb_dir, 9999, "x") == f"http://localhost:9999/lab/tree/{QUICKSTART}?token=x"
    missing = argparse.Namespace(**{**vars(args), "open_notebook": "nope.ipynb"})
    assert not jupyter_command(missing, nb_dir, 9999, None)[-1].endswith("nope.ipynb")
    assert lab_url(missing, nb_dir, 9999, "x") == "http://localhost:9999/lab?token=x"


def _open_with_a_kernel(port: int, token: str) -> None:
    """GET the quickstart's content, start a kernel for it and open its websocket; wait until idle."""
    import asyncio
    import json

    from tornado.websocket import websocket_connect

    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"token {token}"}

    def call(method, path, body=None):
        req = urllib.request.Request(
            base + path,
            method=method,
            headers={**auth, "Content-Type": "application/json"},
            data=None if body is None else json.dumps(body).encode(),
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    call("GET", f"/api/contents/{QUICKSTART}?content=1")
    session = call(
        "POST",
        "/api/sessions",
        {"path": QUICKSTART, "type": "notebook", "name": QUICKSTART, "kernel": {"name": "python3"}},
    )
    kid = session["kernel"]["id"]

    async def channels():
        ws = await websocket_connect(
            f"ws://127.0.0.1:{port}/api/kernels/{kid}/channels?token={token}&session_id={os.urandom(8).hex()}"
        )
        await asyncio.sleep(2)
        ws.close()

    asyncio.run(channels())
    wait_for(lambda: call("GET", f"/api/kernels/{kid}")["execution_state"] == "idle", 60, "the kernel to be idle")
    time.sleep(1)  # its start-up lines reach the log


@pytest.mark.slow
def test_lab_starts_engine_and_jupyterlab_then_stops_both(tmp_path):
    port = _free_port()
    rt = tmp_path / "rt"
    jupyter_home = tmp_path / "jupyter"
    # a short runtime dir, like ~/.local/share/jupyter/runtime: kernels' IPC socket paths fit in it
    short = tempfile.mkdtemp(prefix="wbj", dir="/tmp")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        JUPYTER_RUNTIME_DIR=short,
        JUPYTER_CONFIG_DIR=str(jupyter_home / "config"),
        JUPYTER_DATA_DIR=str(jupyter_home / "data"),
    )
    with private_runtime_dir(rt):
        env["WORKBENCH_RUNTIME_DIR"] = str(rt)
        cmd = [
            sys.executable,
            "-m",
            "workbench.cli",
            "lab",
            "--no-browser",
            "--port",
            str(port),
            "--",
            "--IdentityProvider.token=wbtest",
            "--ServerApp.ip=127.0.0.1",
        ]
        log = open(tmp_path / "lab.log", "wb")
        proc = subprocess.Popen(
            cmd, cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            from workbench.ipc import connection as conn

            info = wait_for(lambda: conn.live_engine("default", rt), 180, "the engine named 'default'", every=0.5)

            def contents():
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/api/contents/{QUICKSTART}?content=0",
                    headers={"Authorization": "token wbtest"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=5) as r:
                        return r.status == 200
                except OSError:
                    return False

            wait_for(contents, 120, "JupyterLab serving notebooks/ (the quickstart at its root)", every=0.5)
            # kernels started by this JupyterLab find the engine by name
            text = (tmp_path / "lab.log").read_text(errors="replace")
            assert "engine 'default' ready" in text and "JupyterLab on" in text and "notebooks" in text
            assert f"open http://localhost:{port}/lab/tree/{QUICKSTART}?token=wbtest" in text
            # open the quickstart and start its kernel, as the browser does: a clean start says
            # nothing more (no INFO chatter, untrusted-notebook, TCP-kernel or websocket warnings)
            _open_with_a_kernel(port, "wbtest")
            # no "receive official Jupyter news?" toast over the quickstart: the lab's own override
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification",
                headers={"Authorization": "token wbtest"},
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                defaults = json.loads(r.read())["schema"]["properties"]  # overrides.json sets the defaults
            assert defaults["fetchNews"]["default"] == "false" and defaults["checkForUpdates"]["default"] is False
            text = (tmp_path / "lab.log").read_text(errors="replace")
            for noise in (
                "extension was successfully",
                "Skipped non-installed",
                "is not trusted",
                "[I ",
                "TCP without encryption",
                "websocket_ping_timeout",
                "Failed to load",
            ):
                assert noise not in text, f"{noise!r} in the lab's output:\n{text}"
            proc.send_signal(signal.SIGTERM)  # what a terminal closing (or `kill`) sends
            proc.wait(60)
            wait_for(lambda: not conn.pid_alive(info.pid), 30, "the engine to stop with JupyterLab")
            assert conn.live_engine("default", rt) is None
            text = (tmp_path / "lab.log").read_text(errors="replace")
            assert "stopping engine 'default'" in text
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            log.close()
            kill_engines_in(rt)
            shutil.rmtree(short, ignore_errors=True)
            time.sleep(0.1)
