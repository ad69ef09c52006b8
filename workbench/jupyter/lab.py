"""`workbench lab`: an engine on the embedded default model, and JupyterLab on the tutorials.

Starts (or attaches to) the engine named "default", then `jupyter lab` on `notebooks/` with
`00-quickstart.ipynb` open. Kernels find the engine by name: `$WORKBENCH_ENGINE` and the
runtime dir are passed down, so `%engine`, `%%generate` and `%dashboard` attach to it. When
JupyterLab exits (Ctrl-C twice, its File > Shut Down, or SIGTERM to this process) the engine
is stopped, if this command started it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

QUICKSTART = "00-quickstart.ipynb"


def add_lab_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="'smollm2-135m' (default), a HF folder or a .gguf file")
    p.add_argument("--name", default="default", help="engine name the notebooks attach to (default 'default')")
    p.add_argument("--notebook-dir", default=None,
                   help="folder JupyterLab opens (default: ./notebooks, else the repository's notebooks/)")
    p.add_argument("--open", dest="open_notebook", default=QUICKSTART, metavar="NOTEBOOK",
                   help=f"notebook to open, relative to the notebook dir (default {QUICKSTART}; '' for none)")
    p.add_argument("--port", type=int, default=None, help="JupyterLab port (default: Jupyter's choice, 8888)")
    p.add_argument("--ip", default=None, help="JupyterLab interface (default: Jupyter's, localhost)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser (print the URL only)")
    p.add_argument("--engine-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long the engine may take to load (default 600)")
    p.add_argument("jupyter_args", nargs=argparse.REMAINDER,
                   help="after --: further `jupyter lab` options, e.g. -- --ServerApp.token=secret")


def notebook_dir(given: str | None) -> Path:
    if given:
        return Path(given).expanduser().resolve()
    here = Path.cwd() / "notebooks"
    if here.is_dir():
        return here.resolve()
    repo = Path(__file__).resolve().parents[2] / "notebooks"
    if repo.is_dir():
        return repo
    return Path.cwd().resolve()


def jupyter_command(args: argparse.Namespace, nb_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={nb_dir}"]
    if args.port is not None:
        cmd.append(f"--port={args.port}")
    if args.ip:
        cmd.append(f"--ip={args.ip}")
    if args.no_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers and CI run as root; JupyterLab refuses it otherwise
    extra = list(args.jupyter_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    cmd += extra
    if args.open_notebook:
        nb = nb_dir / args.open_notebook
        if nb.exists():
            cmd.append(str(nb))
        else:
            print(f"workbench lab: {nb} does not exist; opening the folder instead", file=sys.stderr)
    return cmd


def run_lab(args: argparse.Namespace, settings: dict) -> int:
    from ..engines import connect
    from ..ipc import connection as conn
    from ..ipc.launch import start_engine

    nb_dir = notebook_dir(args.notebook_dir)
    name = conn.check_name(args.name)
    owned = False
    if conn.live_engine(name) is not None:
        client = connect(name)
        print(f"workbench lab: attached to the running engine {name!r} (pid {client.pid}); it keeps running "
              "after JupyterLab exits", file=sys.stderr, flush=True)
        if settings:
            client.configure(**{k: v for k, v in settings.items()})
    else:
        print(f"workbench lab: starting engine {name!r} on {args.model or 'the embedded default model'}…",
              file=sys.stderr, flush=True)
        try:
            client = start_engine(args.model, name=name, timeout=args.engine_timeout, **settings)
        except Exception as e:
            print(f"workbench lab: the engine did not start: {e}", file=sys.stderr)
            return 1
        owned = True
        info = client.engine_info
        print(f"workbench lab: engine {name!r} ready ({info.get('model')} on {info.get('device')}, pid "
              f"{client.pid}); log: {client.log_file}", file=sys.stderr, flush=True)
    env = dict(os.environ)
    env["WORKBENCH_ENGINE"] = name
    env[conn.ENV_RUNTIME_DIR] = str(conn.runtime_dir())
    cmd = jupyter_command(args, nb_dir)
    print(f"workbench lab: JupyterLab on {nb_dir}", file=sys.stderr, flush=True)
    proc = None
    previous = {}

    def forward(signum, frame):  # SIGTERM / SIGHUP: stop JupyterLab, then the engine below
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, forward)
        proc = subprocess.Popen(cmd, env=env, cwd=str(nb_dir))
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # JupyterLab got it too and asks to confirm; keep waiting
                continue
        return rc
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if owned:
            print(f"workbench lab: stopping engine {name!r}", file=sys.stderr, flush=True)
            try:
                client.shutdown(timeout=30)
            except Exception as e:
                print(f"workbench lab: engine shutdown: {e}", file=sys.stderr)
        else:
            client.close()
