"""`workbench lab`: the README's run command. It starts the engine named "default" on the
embedded model and JupyterLab on notebooks/ with the quickstart open, and stops the engine when
JupyterLab exits. Real processes; everything is killed at the end whatever happens.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from jupyter_helpers import REPO, kill_engines_in, private_runtime_dir, wait_for

from workbench.jupyter.lab import QUICKSTART, jupyter_command, notebook_dir

pytestmark = [pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_command_opens_the_quickstart_in_notebooks():
    from workbench.cli import build_parser

    args = build_parser().parse_args(["lab", "--no-browser", "--port", "9999", "--batching", "static",
                                      "--", "--ServerApp.token=x"])
    assert args.name == "default" and args.setting_batching == "static"
    nb_dir = notebook_dir(str(REPO / "notebooks"))
    cmd = jupyter_command(args, nb_dir)
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={nb_dir}" in cmd and "--port=9999" in cmd and "--no-browser" in cmd
    assert "--ServerApp.token=x" in cmd and "--" not in cmd
    assert cmd[-1] == str(nb_dir / QUICKSTART)
    missing = argparse.Namespace(**{**vars(args), "open_notebook": "nope.ipynb"})
    assert not jupyter_command(missing, nb_dir)[-1].endswith("nope.ipynb")


@pytest.mark.slow
def test_lab_starts_engine_and_jupyterlab_then_stops_both(tmp_path):
    port = _free_port()
    rt = tmp_path / "rt"
    jupyter_home = tmp_path / "jupyter"
    env = dict(os.environ, OMP_NUM_THREADS="1", JUPYTER_RUNTIME_DIR=str(jupyter_home / "runtime"),
               JUPYTER_CONFIG_DIR=str(jupyter_home / "config"))
    with private_runtime_dir(rt):
        env["WORKBENCH_RUNTIME_DIR"] = str(rt)
        cmd = [sys.executable, "-m", "workbench.cli", "lab", "--no-browser", "--port", str(port),
               "--", "--ServerApp.token=wbtest", "--ServerApp.ip=127.0.0.1"]
        log = open(tmp_path / "lab.log", "wb")
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            from workbench.ipc import connection as conn

            info = wait_for(lambda: conn.live_engine("default", rt), 180, "the engine named 'default'", every=0.5)

            def contents():
                req = urllib.request.Request(f"http://127.0.0.1:{port}/api/contents/{QUICKSTART}?content=0",
                                             headers={"Authorization": "token wbtest"})
                try:
                    with urllib.request.urlopen(req, timeout=5) as r:
                        return r.status == 200
                except OSError:
                    return False

            wait_for(contents, 120, "JupyterLab serving notebooks/ (the quickstart at its root)", every=0.5)
            # kernels started by this JupyterLab find the engine by name
            text = (tmp_path / "lab.log").read_text(errors="replace")
            assert "engine 'default' ready" in text and "JupyterLab on" in text and "notebooks" in text
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
            time.sleep(0.1)
