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
import secrets
import signal
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path

QUICKSTART = "00-quickstart.ipynb"


def add_lab_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="'smollm2-135m' (default), a HF folder or a .gguf file")
    p.add_argument("--name", default="default", help="engine name the notebooks attach to (default 'default')")
    p.add_argument(
        "--notebook-dir",
        default=None,
        help="folder JupyterLab opens (default: ./notebooks, else the repository's notebooks/)",
    )
    p.add_argument(
        "--open",
        dest="open_notebook",
        default=QUICKSTART,
        metavar="NOTEBOOK",
        help=f"notebook to open, relative to the notebook dir (default {QUICKSTART}; '' for none)",
    )
    p.add_argument("--port", type=int, default=None, help="JupyterLab port (default: Jupyter's choice, 8888)")
    p.add_argument("--ip", default=None, help="JupyterLab interface (default: Jupyter's, localhost)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser (print the URL only)")
    p.add_argument(
        "--engine-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long the engine may take to load (default 600)",
    )
    p.add_argument(
        "jupyter_args",
        nargs=argparse.REMAINDER,
        help="after --: further `jupyter lab` options, e.g. -- --ServerApp.token=secret",
    )


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


# What `jupyter lab` would otherwise print on every start, and why each is safe to quiet here:
QUIET = [
    # INFO lines (extensions linked and loaded, language servers not installed): the URL below
    # says what a person needs; warnings and errors still show.
    "--ServerApp.log_level=WARN",
    "--LabApp.log_level=WARN",
    # (the websocket ping settings stay jupyter_server's: its keep-alive check needs a timeout
    # longer than the interval; the server extension quiets tornado's false alarm about that)
    # No "receive official Jupyter news?" toast over the first notebook (and no request for news
    # from the lab this command opens): our settings overrides, for this lab only
    f"--LabApp.app_settings_dir={Path(__file__).resolve().parent / 'lab_settings'}",
]


TOKEN_OPTIONS = ("--IdentityProvider.token", "--ServerApp.token", "--NotebookApp.token")


def ipc_kernels_fit() -> bool:
    """Whether kernels can talk over IPC sockets (this machine only) rather than plain TCP on
    localhost: nothing readable on the network, and no "running over TCP without encryption"
    warning per kernel. Their socket files live in Jupyter's runtime dir, and a Unix socket's path
    is limited to 107 bytes ("kernel-<uuid>-ipc-N" takes 50 of them)."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:  # pragma: no cover - jupyter_core comes with JupyterLab
        return False
    return sys.platform != "win32" and len(os.fsencode(jupyter_runtime_dir())) + 52 <= 107


def free_port(start: int = 8888, tries: int = 50) -> int:
    """The first port from `start` nothing listens on (as Jupyter would pick it, but known here)."""
    for port in range(start, start + tries):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + tries - 1}; pass --port")


def jupyter_command(args: argparse.Namespace, nb_dir: Path, port: int, token: str | None) -> list[str]:
    """`jupyter lab` on `nb_dir`; `token`: the one this command chose (None when the user passed
    their own, or asked for none, after --)."""
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={nb_dir}",
        f"--port={port}",
        "--ServerApp.port_retries=0",
    ]
    if args.ip:
        cmd.append(f"--ip={args.ip}")
    if args.no_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers and CI run as root; JupyterLab refuses it otherwise
    extra = jupyter_extra(args)
    quiet = QUIET + (["--KernelManager.transport=ipc"] if ipc_kernels_fit() else [])
    cmd += [q for q in quiet if q.split("=")[0] not in {e.split("=")[0] for e in extra}]
    if token is not None:
        cmd.append(f"--IdentityProvider.token={token}")
    cmd += extra
    if args.open_notebook and (nb_dir / args.open_notebook).exists():
        cmd.append(str(nb_dir / args.open_notebook))  # the browser Jupyter opens shows it
    return cmd


def jupyter_extra(args: argparse.Namespace) -> list[str]:
    extra = list(args.jupyter_args or [])
    return extra[1:] if extra[:1] == ["--"] else extra


def lab_url(args: argparse.Namespace, nb_dir: Path, port: int, token: str | None) -> str:
    """Where to point a browser: the notebook to open (00-quickstart by default), not the Launcher."""
    host = args.ip if args.ip and args.ip not in ("0.0.0.0", "::", "*") else "localhost"
    url = f"http://{host}:{port}/lab"
    if args.open_notebook:
        if (nb_dir / args.open_notebook).exists():
            url += "/tree/" + urllib.parse.quote(args.open_notebook)
        else:
            print(
                f"workbench lab: {nb_dir / args.open_notebook} does not exist; opening the folder instead",
                file=sys.stderr,
            )
    return url + (f"?token={token}" if token else "")


def sign_tutorials(nb_dir: Path) -> None:
    """Trust the tutorials this command opens (Jupyter warns "Notebook ... is not trusted" for
    every unsigned one); a notebook the user changes is signed again by Jupyter when saved."""
    try:
        import nbformat
        from nbformat.sign import NotebookNotary
    except ImportError:  # pragma: no cover - nbformat comes with JupyterLab
        return
    notary = NotebookNotary()
    for path in sorted(nb_dir.glob("[0-9][0-9]-*.ipynb")):
        try:
            nb = nbformat.read(path, as_version=4)
            if not notary.check_signature(nb):
                notary.sign(nb)
        except Exception:  # noqa: BLE001 - an unreadable notebook is Jupyter's to report
            continue


def run_lab(args: argparse.Namespace, settings: dict) -> int:
    from ..engines import connect
    from ..ipc import connection as conn
    from ..ipc.launch import start_engine

    nb_dir = notebook_dir(args.notebook_dir)
    name = conn.check_name(args.name)
    owned = False
    if conn.live_engine(name) is not None:
        client = connect(name)
        print(
            f"workbench lab: attached to the running engine {name!r} (pid {client.pid}); it keeps running "
            "after JupyterLab exits",
            file=sys.stderr,
            flush=True,
        )
        if settings:
            client.configure(**{k: v for k, v in settings.items()})
    else:
        print(
            f"workbench lab: starting engine {name!r} on {args.model or 'the embedded default model'}…",
            file=sys.stderr,
            flush=True,
        )
        try:
            client = start_engine(args.model, name=name, timeout=args.engine_timeout, **settings)
        except Exception as e:
            print(f"workbench lab: the engine did not start: {e}", file=sys.stderr)
            return 1
        owned = True
        info = client.engine_info
        print(
            f"workbench lab: engine {name!r} ready ({info.get('model')} on {info.get('device')}, pid "
            f"{client.pid}); log: {client.log_file}",
            file=sys.stderr,
            flush=True,
        )
    env = dict(os.environ)
    env["WORKBENCH_ENGINE"] = name
    env[conn.ENV_RUNTIME_DIR] = str(conn.runtime_dir())
    given = [e.split("=", 1)[1] for e in jupyter_extra(args) if "=" in e and e.split("=", 1)[0] in TOKEN_OPTIONS]
    token = None if given else secrets.token_hex(24)
    port = args.port if args.port is not None else free_port()
    cmd = jupyter_command(args, nb_dir, port, token)
    sign_tutorials(nb_dir)
    url = lab_url(args, nb_dir, port, given[-1] if given else token)
    print(
        f"workbench lab: JupyterLab on {nb_dir}; Ctrl-C twice stops it (and the engine it started)",
        file=sys.stderr,
        flush=True,
    )
    print(f"workbench lab: open {url}", file=sys.stderr, flush=True)
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
