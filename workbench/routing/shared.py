"""A router shared between processes (`route(..., share=True)`, `workbench serve --route`).

Its file in the runtime directory, router-NAME.json, names the members (what another process
connects to) and the routing (policy, thresholds, fixed member, cascade confidence), and the
owner's pid; `workbench.connect("router:NAME")` attaches to it, and a routing changed in any
process is taken by every other at its next request (one stat each). Each process counts the
requests it answered per member in a file of its own, routed-NAME.PID.json (no process rewrites
another's), so every view of the router counts them all.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from pathlib import Path

from ..interface import Engine
from ..ipc import connection as conn

ROUTING_KEYS = ("router", "router_threshold", "router_member", "router_confidence")


class RouterFile:
    def __init__(self, name: str, targets: dict[str, str], path: Path | None = None):
        self.name = name
        self.targets = targets  # member -> what another process passes to connect()
        self.path = path or router_file(name)
        self.stamp: int | None = None  # the file's mtime as this process last wrote or read it
        # a counts write racing `drop` (an answer arriving as the router closes) must not leave a file
        self._lock = threading.Lock()
        self._dropped = False

    @classmethod
    def read(cls, name: str) -> tuple[RouterFile, dict]:
        """An attached process's view of router `name`: its file, and what the file says."""
        path = router_file(name)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no router named {name!r} is shared here ({path} is missing); start one with "
                "workbench.routing.route(..., name=NAME, share=True) or workbench serve --route"
            ) from None
        shared = cls(name, dict(data["members"]), path)
        shared.stamp = path.stat().st_mtime_ns
        return shared, data

    def write(self, routing: dict, owner: bool = False) -> None:
        """The routing, into the file (the owner creates it; another process updates it while the
        owner keeps it)."""
        data = {}
        if not owner:
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                return  # the owner has gone (and removed it): nothing to share with
        data.update(name=self.name, members=self.targets, **{k: routing[k] for k in ROUTING_KEYS})
        if owner:
            data["owner_pid"] = os.getpid()
        conn.write_private_json(self.path, data)
        self.stamp = self.path.stat().st_mtime_ns

    def changed(self) -> dict | None:
        """What the file says, when another process changed it since this one last looked."""
        try:
            stamp = self.path.stat().st_mtime_ns
        except OSError:
            return None
        if stamp == self.stamp:
            return None
        self.stamp = stamp
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def write_counts(self, served: Counter) -> None:
        """This process's answered requests per member."""
        with self._lock:
            if not self._dropped:
                conn.write_private_json(self._counts_file(os.getpid()), {"served": dict(served)})

    def others_served(self) -> Counter:
        """What the other live processes sharing this router have answered, per member."""
        out: Counter = Counter()
        for path in self.path.parent.glob(f"routed-{self.name}.*.json"):
            pid = path.stem.rpartition(".")[2]
            if not pid.isdigit() or int(pid) == os.getpid() or not conn.pid_alive(int(pid)):
                continue
            try:
                out.update({k: int(v) for k, v in json.loads(path.read_text())["served"].items()})
            except (OSError, ValueError, KeyError, AttributeError):
                continue
        return out

    def drop(self) -> None:
        """This process's counts file goes, and the owner's router file with it (an attached
        process leaves that)."""
        with self._lock:
            self._dropped = True
        self._counts_file(os.getpid()).unlink(missing_ok=True)
        try:
            if json.loads(self.path.read_text()).get("owner_pid") == os.getpid():
                self.path.unlink()
                for path in self.path.parent.glob(f"routed-{self.name}.*.json"):  # the router is gone
                    path.unlink(missing_ok=True)
        except (OSError, ValueError):
            pass

    def _counts_file(self, pid: int) -> Path:
        return self.path.with_name(f"routed-{self.name}.{pid}.json")


def router_file(name: str) -> Path:
    return conn.runtime_dir() / f"router-{conn.check_name(name)}.json"


def target_of(engine: Engine, name: str) -> str:
    """What another process passes to `connect()` for this member: an engine process's name, a
    server's URL (a member in this process cannot be reached from another: share=False then)."""
    from ..ipc.client import EngineClient
    from ..remote import RemoteEngineClient

    if isinstance(engine, EngineClient):
        return engine.name
    if isinstance(engine, RemoteEngineClient):
        return engine.base
    raise ValueError(
        f"member {name!r} ({type(engine).__name__}) lives in this process, so another cannot attach to it: "
        "give it as an engine process (start_engine) or a server URL to share the router"
    )


def connect_member(target: str, timeout: float) -> Engine:
    """A shared router's member: an engine process by name, or a server by URL (what its file holds)."""
    from ..ipc.client import EngineClient
    from ..remote import RemoteEngineClient

    if not isinstance(target, str):
        raise TypeError(f"a member is an Engine, an engine name or a server URL, got {type(target).__name__}")
    if target.startswith(("http://", "https://")):
        return RemoteEngineClient.connect(url=target, timeout=timeout)
    return EngineClient.connect(target, timeout=timeout)


def list_routers() -> list[dict]:
    """The shared routers of this machine whose owner still runs (their files, with `path`)."""
    return [
        {**data, "path": str(path)}
        for path, data in conn.runtime_json("router-*.json")
        if conn.pid_alive(int(data.get("owner_pid") or 0))
    ]
