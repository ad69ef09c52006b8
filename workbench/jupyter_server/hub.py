"""The Jupyter server's side of the engines: one `EngineClient` per engine, shared by handlers.

The server extension is the only ZeroMQ client the browser needs: REST handlers and websockets
ask the hub for a connected client by engine name (looked up in the runtime directory, the same
place `start_engine` and `workbench serve` write connection files to). Blocking work (the
handshake, starting or stopping an engine) runs on worker threads so the server's event loop
never waits on an engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

log = logging.getLogger("workbench.jupyter_server")


class EngineHub:
    """Clients of the engines this server talks to, and the engines it started."""

    connect_timeout = 10.0

    def __init__(self, start_timeout: float = 600.0):
        self.start_timeout = start_timeout
        self._clients: dict[str, Any] = {}
        self._started: set[str] = set()
        self._lock = threading.Lock()

    # -- discovery ------------------------------------------------------------------------------
    def list_engines(self) -> list[dict[str, Any]]:
        from ..ipc import connection as conn

        out = []
        for info in conn.list_engines():
            out.append(
                {
                    "name": info.name,
                    "pid": info.pid,
                    "model": info.model,
                    "transport": info.transport,
                    "connection_file": info.path,
                    "started_here": info.name in self._started,
                }
            )
        from ..cluster.engine import list_clusters

        for c in list_clusters():  # replicas on Ray (workbench.cluster): one entry, "cluster:NAME"
            out.append(
                {
                    "name": f"cluster:{c['name']}",
                    "pid": c.get("owner_pid"),
                    "model": c.get("model"),
                    "transport": "cluster",
                    "connection_file": c["path"],
                    "started_here": False,
                    "replicas": [r["name"] for r in c["replicas"]],
                }
            )
        from ..routing.shared import list_routers

        for r in list_routers():  # models behind one router (workbench.routing, shared): "router:NAME"
            out.append(
                {
                    "name": f"router:{r['name']}",
                    "pid": r.get("owner_pid"),
                    "model": " < ".join(r.get("members", {})),
                    "transport": "router",
                    "connection_file": r["path"],
                    "started_here": False,
                    "members": r.get("members", {}),
                }
            )
        from ..remote import list_remotes

        for r in list_remotes():  # OpenAI-compatible servers registered with register_remote()
            out.append(
                {
                    "name": r["name"],
                    "pid": None,
                    "model": r["model"],
                    "transport": "http",
                    "connection_file": None,
                    "started_here": False,
                    "remote_url": r["url"],
                }
            )
        return out

    def runtime_dir(self) -> str:
        from ..ipc import connection as conn

        return str(conn.runtime_dir())

    # -- clients --------------------------------------------------------------------------------
    def _connected(self, name: str):
        from ..engines import connect
        from ..ipc import connection as conn

        conn.check_name(name.removeprefix("cluster:").removeprefix("router:"))
        with self._lock:
            client = self._clients.get(name)
            if client is not None and client.alive:
                return client
            self._clients.pop(name, None)
        if client is not None:
            _quiet_close(client)
        client = connect(name, timeout=self.connect_timeout, client_name="JupyterLab panel")
        with self._lock:
            other = self._clients.get(name)
            if other is not None and other.alive:
                _quiet_close(client)
                return other
            self._clients[name] = client
        return client

    async def client(self, name: str):
        """A live client of engine `name` (FileNotFoundError when there is none)."""
        with self._lock:
            client = self._clients.get(name)
        if client is not None and client.alive:
            return client
        return await asyncio.to_thread(self._connected, name)

    def forget(self, name: str, client=None) -> None:
        """Drop (and close) the client of `name`; with `client`, only if it is still that one."""
        with self._lock:
            held = self._clients.get(name)
            if held is None or (client is not None and held is not client):
                return
            del self._clients[name]
        _quiet_close(held)

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(
        self,
        *,
        name: str | None = None,
        model: str | None = None,
        settings: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Spawn an engine (stopped when this server exits) and keep its client."""
        from ..ipc.launch import start_engine
        from ..settings import validate

        settings = validate(dict(settings or {}))  # fail fast, before spawning anything
        wait = min(float(timeout), self.start_timeout) if timeout else self.start_timeout
        client = await asyncio.to_thread(start_engine, model, name=name, timeout=wait, **settings)
        with self._lock:
            old = self._clients.pop(client.name, None)
            self._clients[client.name] = client
            self._started.add(client.name)
        if old is not None:
            _quiet_close(old)
        return client

    async def stop(self, name: str, drain: bool = False) -> None:
        client = await self.client(name)
        try:
            await asyncio.to_thread(client.shutdown, drain, 60.0)
        finally:
            with self._lock:
                if self._clients.get(name) is client:
                    del self._clients[name]
                self._started.discard(name)

    def close(self, stop_started: bool = True) -> None:
        """Disconnect everything; stop the engines this server started (they would stop with
        the server's process anyway)."""
        with self._lock:
            clients, self._clients = dict(self._clients), {}
            started, self._started = set(self._started), set()
        for name, client in clients.items():
            try:
                if stop_started and name in started:
                    client.shutdown(timeout=20.0)
                else:
                    client.close()
            except Exception:
                log.debug("closing the client of %s failed", name, exc_info=True)


def _quiet_close(client) -> None:
    try:
        client.close()
    except Exception:
        log.debug("closing a client failed", exc_info=True)
