"""One replica: an engine process on a Ray node, owned by a Ray actor.

Ray places the actor (its bundle of the cluster's placement group), starts it, and restarts or
kills it; the actor starts the engine process beside itself (`start_engine`, tcp with CURVE keys
on the node's address) and hands the driver the connection info. Tokens then flow between the
driver and the engine over ZeroMQ, never through Ray. The engine watches its parent (the actor):
an actor that is killed takes its engine with it within half a second.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


class ReplicaServer:
    """The actor's class (wrapped by `ray.remote` in `workbench.cluster`)."""

    def __init__(
        self,
        name: str,
        model,
        settings: dict[str, Any],
        host: str | None = None,
        engine_options: dict[str, Any] | None = None,
    ):
        self.name = name
        self.model = model
        self.settings = dict(settings)
        self.host = host
        self.engine_options = dict(engine_options or {})
        self.client = None
        self.started = 0.0
        self._start()

    def _start(self) -> None:
        import ray

        from ..ipc.launch import start_engine

        host = self.host or ray.util.get_node_ip_address()
        # Ray sets OMP_NUM_THREADS to the actor's CPUs: the engine process inherits it
        self.client = start_engine(
            self.model, name=self.name, transport="tcp", host=host, **self.engine_options, **self.settings
        )
        self.started = time.time()

    def info(self) -> dict[str, Any]:
        """Who and where: the replica's name, node, engine pid, and the connection (JSON)."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "name": self.name,
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_pid": os.getpid(),
            "pid": self.client.pid,
            "connection": self.client.info.to_json(),
            "started": self.started,
        }

    def alive(self) -> bool:
        return self.client is not None and self.client.alive

    def restart(self) -> dict[str, Any]:
        """A fresh engine process (the same settings it started with); its new connection info."""
        self.stop()
        self._start()
        return self.info()

    def stop(self) -> bool:
        if self.client is not None:
            from ..ipc import connection as conn

            pid = self.client.pid
            try:
                self.client.shutdown(timeout=30.0)
            except Exception:
                pass
            # an engine that was killed left its connection file: gone with the replica
            conn.remove_connection_file(self.name, pid)
            self.client = None
        return True


def connection_of(info: dict[str, Any]):
    """The `ConnectionInfo` the driver connects with, from `ReplicaServer.info()`."""
    from ..ipc.connection import ConnectionInfo

    return ConnectionInfo.from_dict(json.loads(info["connection"]))
