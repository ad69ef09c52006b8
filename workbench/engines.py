"""`connect`: the one factory above the engine implementations (`workbench.interface.Engine`).

workbench.connect()                      # the engine process named "default"
workbench.connect("my-engine")           # by name, or a connection file's path
workbench.connect("http://gpu-box:8000") # an OpenAI-compatible server (vLLM, SGLang, llama.cpp, ours)
workbench.connect("cluster:lab")         # the replicas of a cluster started here (workbench.cluster.start)
workbench.connect(llm)                   # an Engine already (an in-process LLM): returned as is
"""

from __future__ import annotations

import os

from .interface import Engine

__all__ = ["connect"]


def connect(target: str | os.PathLike | Engine | None = None, *, timeout: float = 10.0, **kwargs) -> Engine:
    """An `Engine` for `target`: an Engine is returned as is; an http(s):// URL, or an engine name
    given to one with `workbench.remote.register_remote`, attaches to that OpenAI-compatible
    server; anything else is an engine process's name or connection file (None: "default").
    `kwargs` go to the client (`reconnect=`, `check_pid=`, `client_name=` for engine processes; `api_key=`,
    `model=` for servers)."""
    if isinstance(target, Engine):
        return target
    if isinstance(target, str) and target.startswith("cluster:"):
        from .cluster import attach

        return attach(target.removeprefix("cluster:"), timeout=timeout)
    if isinstance(target, str) and target.startswith("router:"):
        from .routing.engine import attach as attach_router

        return attach_router(target.removeprefix("router:"), timeout=timeout)
    from .remote import RemoteEngineClient, registered_remote

    remote = (
        {"url": target}
        if isinstance(target, str) and target.startswith(("http://", "https://"))
        else registered_remote(target or "default")
    )
    if remote is not None:
        kwargs.pop("client_name", None)  # an HTTP server does not know its clients by name
        return RemoteEngineClient.connect(timeout=timeout, **{**remote, **kwargs})
    from .ipc.client import EngineClient

    return EngineClient.connect(target, timeout=timeout, **kwargs)
