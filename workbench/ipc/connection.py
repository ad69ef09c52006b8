"""Finding engines: the private runtime directory and one connection file per engine name.

The runtime directory is ``$WORKBENCH_RUNTIME_DIR`` if set, else
``$XDG_RUNTIME_DIR/serving-workbench``, else platformdirs' user runtime dir. It is created with
mode 0700 (and refused if another user owns it). It holds, per engine name:

- ``<name>.json``: the connection file (mode 0600): addresses of the request ROUTER and the
  event PUB, the engine pid, and for TCP the CURVE keys (the server's public key and the one
  client keypair the engine accepts). It is written when the engine is ready and removed when
  it stops, so its presence means "ready" (a stale one left by a killed engine is detected by
  its pid and replaced);
- ``<name>.log``: the engine's log when started by `start_engine`.

IPC socket files live in the runtime directory too, with a random suffix, so two engines never
collide; when that path would exceed the kernel's limit for socket paths, a private
``mkdtemp`` folder under the system temp dir is used instead.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

APP = "serving-workbench"
ENV_RUNTIME_DIR = "WORKBENCH_RUNTIME_DIR"
CONNECTION_FILE_VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MAX_IPC_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


def runtime_dir(create: bool = True) -> Path:
    env = os.environ.get(ENV_RUNTIME_DIR)
    if env:
        path = Path(env)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / APP
    else:
        import platformdirs

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = Path(platformdirs.user_runtime_dir(APP))
    if create:
        ensure_private_dir(path)
    return path


def ensure_private_dir(path: Path) -> None:
    """Create `path` with mode 0700, or check that an existing one is private to this user (an
    existing directory is never chmod-ed: it might be /tmp)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise PermissionError(
            f"runtime directory {path} belongs to another user; set {ENV_RUNTIME_DIR} to a private directory"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"runtime directory {path} is open to other users (mode {oct(stat.S_IMODE(st.st_mode))}); it holds "
            f"engine keys and sockets: `chmod 700 {path}` or set {ENV_RUNTIME_DIR} to a private directory"
        )


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid engine name {name!r}: use 1-64 letters, digits, '_', '.', '-' (starting with a letter or digit)"
        )
    return name


def connection_path(name: str, directory: Path | None = None) -> Path:
    return (directory or runtime_dir()) / f"{check_name(name)}.json"


def log_path(name: str, directory: Path | None = None) -> Path:
    return (directory or runtime_dir()) / f"{check_name(name)}.log"


def _host_identity() -> dict[str, str]:
    """What tells two processes they share a host and pid namespace (so pids can be checked)."""
    ident = {"hostname": socket.gethostname()}
    try:
        ident["boot_id"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ident["pid_ns"] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return ident


@dataclass
class ConnectionInfo:
    name: str
    pid: int
    transport: str  # "ipc" | "tcp"
    request_address: str
    event_address: str
    model: str | None = None
    heartbeat_s: float = 1.0
    client_timeout_s: float = 10.0
    max_message_bytes: int = 64 << 20
    protocol: int = 1
    host: dict[str, str] = field(default_factory=_host_identity)
    curve: dict[str, str] | None = None  # server_public, client_public, client_secret (z85 text)
    log_file: str | None = None
    path: str | None = None  # where this was read from (not written)
    version: int = CONNECTION_FILE_VERSION

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("path")
        return json.dumps(d, indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str | None = None) -> ConnectionInfo:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "path"}
        missing = {"name", "pid", "transport", "request_address", "event_address"} - known.keys()
        if missing:
            raise ValueError(f"connection file {path} lacks {sorted(missing)}")
        return cls(**known, path=path)

    def same_host(self) -> bool:
        """True when this process can check the engine's pid directly."""
        here = _host_identity()
        return all(self.host.get(k) == v for k, v in here.items()) and len(here) == 3

    def engine_alive(self) -> bool:
        """Local pid check (True when it cannot tell)."""
        return pid_alive(self.pid) if self.same_host() else True


def pid_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_connection_file(path: str | os.PathLike) -> ConnectionInfo:
    path = Path(path)
    with open(path) as f:
        d = json.load(f)
    if not isinstance(d, dict):
        raise ValueError(f"{path} is not a workbench connection file")
    return ConnectionInfo.from_dict(d, str(path))


def resolve(name_or_file: str | os.PathLike | None) -> Path:
    """A connection file path from an engine name or a path; None picks "default" or the only
    running engine."""
    if name_or_file is None:
        default = connection_path("default")
        if default.exists():
            return default
        live = list_engines()
        if len(live) == 1:
            return Path(live[0].path)
        if not live:
            raise FileNotFoundError(
                f"no running engine found in {runtime_dir()}; start one with start_engine() or `workbench serve`"
            )
        raise ValueError(f"several engines are running ({', '.join(c.name for c in live)}); pass a name")
    text = os.fspath(name_or_file)
    if os.sep in text or text.endswith(".json"):
        path = Path(text).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"connection file {path} does not exist")
        return path
    path = connection_path(text)
    if not path.exists():
        live = [c.name for c in list_engines()]
        raise FileNotFoundError(
            f"no engine named {text!r} in {path.parent} (running: {', '.join(live) or 'none'}); "
            "start one with start_engine(name=...) or `workbench serve --name ...`"
        )
    return path


def runtime_json(pattern: str = "*.json", directory: Path | None = None):
    """(path, parsed JSON) of each runtime-dir file matching `pattern`, in name order; files that
    cannot be read or parsed (half written, removed meanwhile) are skipped."""
    for p in sorted((directory or runtime_dir()).glob(pattern)):
        try:
            yield p, json.loads(p.read_text())
        except (OSError, ValueError):
            continue


def write_private_json(path: Path, data: dict) -> None:
    """`data` as `path` (0600), atomically: readers see the old file or the new one, never half of
    one (the cluster and router files, which every attached process re-reads)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def list_engines(directory: Path | None = None) -> list[ConnectionInfo]:
    """Connection files of engines that look alive (stale ones on this host are skipped)."""
    out = []
    for p in sorted((directory or runtime_dir()).glob("*.json")):
        try:
            info = read_connection_file(p)
        except (OSError, ValueError, TypeError):
            continue
        if info.engine_alive():
            out.append(info)
    return out


def live_engine(name: str, directory: Path | None = None) -> ConnectionInfo | None:
    """The engine currently holding `name`, or None (a stale file is not an engine)."""
    path = connection_path(name, directory)
    try:
        info = read_connection_file(path)
    except (OSError, ValueError, TypeError):
        return None
    return info if info.engine_alive() else None


def write_connection_file(info: ConnectionInfo, directory: Path | None = None) -> Path:
    """Create `<name>.json` exclusively (0600); a stale file of a dead engine is replaced."""
    path = connection_path(info.name, directory)
    # Written in full to a private temp file, then linked into place: readers never see half a
    # file, and the link fails if the name is taken.
    fd, tmp = tempfile.mkstemp(prefix=f".{info.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(info.to_json().encode())
        return _link_exclusive(Path(tmp), path, info, directory)
    finally:
        os.unlink(tmp)


def _link_exclusive(tmp: Path, path: Path, info: ConnectionInfo, directory: Path | None) -> Path:
    for _ in range(2):
        try:
            os.link(tmp, path)
        except FileExistsError:
            holder = live_engine(info.name, directory)
            if holder is not None and holder.pid != info.pid:
                raise FileExistsError(
                    f"an engine named {info.name!r} is already running (pid {holder.pid}); connect to it "
                    f"with EngineClient.connect({info.name!r}) or choose another name"
                ) from None
            _remove_stale(path)
            continue
        return path
    raise FileExistsError(f"could not create {path}")


def _remove_stale(path: Path) -> None:
    """Remove the connection file of a dead engine, and the ipc socket files it left behind."""
    try:
        stale = read_connection_file(path)
        sockets = [
            a.removeprefix("ipc://") for a in (stale.request_address, stale.event_address) if a.startswith("ipc://")
        ]
    except (OSError, ValueError, TypeError):
        sockets = []
    for sock in sockets:
        p = Path(sock)
        if p.parent == path.parent or p.parent.name.startswith("wb-"):  # only where we put them
            p.unlink(missing_ok=True)
            if p.parent != path.parent:
                try:
                    p.parent.rmdir()
                except OSError:
                    pass
    path.unlink(missing_ok=True)


def remove_connection_file(name: str, pid: int, directory: Path | None = None) -> None:
    """Remove `<name>.json` if it is still ours."""
    path = connection_path(name, directory)
    try:
        if read_connection_file(path).pid == pid:
            path.unlink()
    except (OSError, ValueError, TypeError):
        pass


def ipc_addresses(name: str, directory: Path | None = None) -> tuple[str, str, Path | None]:
    """Fresh ipc:// addresses for the request and event sockets; the third item is a private
    temp folder to remove at exit when the runtime dir's path was too long."""
    directory = directory or runtime_dir()
    tag = f"{name}-{secrets.token_hex(4)}"
    own_dir = None
    if len(str(directory / f"{tag}.evt.sock")) > _MAX_IPC_PATH:
        own_dir = Path(tempfile.mkdtemp(prefix="wb-"))
        directory = own_dir
        tag = secrets.token_hex(4)
    return f"ipc://{directory / (tag + '.req.sock')}", f"ipc://{directory / (tag + '.evt.sock')}", own_dir


def unique_name(directory: Path | None = None) -> str:
    """ "default" when no engine holds it, else a fresh random name."""
    if live_engine("default", directory) is None:
        return "default"
    return f"engine-{secrets.token_hex(3)}"


def apply_curve(sock, info: ConnectionInfo) -> None:
    """A client socket set up for the engine's CURVE encryption (tcp; ipc needs none)."""
    if info.transport != "tcp":
        return
    keys = info.curve or {}
    if not all(keys.get(k) for k in ("server_public", "client_public", "client_secret")):
        # No keys: connect anyway; the engine's CURVE handshake will never let us in, and the
        # handshake timeout reports it.
        return
    sock.curve_serverkey = keys["server_public"].encode()
    sock.curve_publickey = keys["client_public"].encode()
    sock.curve_secretkey = keys["client_secret"].encode()


def default_client_name() -> str:
    """How the engine names this client (in its log, and as `by` on the settings changes it makes)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if getattr(shell, "kernel", None) is not None:
        return "notebook kernel"
    if not sys.argv or not sys.argv[0] or sys.argv[0] == "-c":
        return "python"
    script = os.path.basename(sys.argv[0])
    if script == "__main__.py":  # python -m package: the package's name
        script = os.path.basename(os.path.dirname(sys.argv[0]))
    return script


def wait_gone(name: str, pid: int, process: subprocess.Popen | None, gone: Callable[[], bool], deadline: float) -> None:
    """Wait until an engine process has exited: our child (`process`, killed at the deadline), else
    until `gone()` says so (its pid no longer alive, its client dead)."""
    if process is not None:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
            raise TimeoutError(f"engine {name!r} did not exit in time; killed it") from None
        return
    while time.monotonic() < deadline:
        if gone():
            return
        time.sleep(0.05)
    raise TimeoutError(f"engine {name!r} (pid {pid}) did not exit in time")
