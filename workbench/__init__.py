"""Serving Workbench: a live, tunable LLM inference engine and the instruments to watch it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# How long idle OpenMP threads spin before sleeping. libgomp's default spins long: on a busy
# 2-core box two threads then collapse (single-stream ITL 232 ms, vs 74 ms sleeping at once),
# while sleeping at once (OMP_WAIT_POLICY=PASSIVE) costs a wake-up per op when quiet (103 vs
# 60 ms). A short spin gave 66 ms quiet and 105 ms busy (docs/benchmarks.md). Applies only when
# the user set neither variable, and only before torch is imported.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "2000")

__version__ = "0.1.0"

# Heavy modules (torch, the model) load on first use, so `import workbench` stays cheap for
# the Jupyter server extension and the CLI's --help.
_LAZY = {
    "LLM": ("workbench.llm", "LLM"),
    "SamplingParams": ("workbench.sampling_params", "SamplingParams"),
    "EngineClient": ("workbench.ipc.client", "EngineClient"),
    "start_engine": ("workbench.ipc.launch", "start_engine"),
    "connect": ("workbench.engines", "connect"),
    "Engine": ("workbench.interface", "Engine"),
    "route": ("workbench.routing", "route"),
    "sweep": ("workbench.tuning.sweep", "sweep"),
    "Simulator": ("workbench.sim", "Simulator"),
    "runs": ("workbench.runs", None),  # the run log module: workbench.runs.list_runs(), ...
    "RequestOutput": ("workbench.outputs", "RequestOutput"),
    "StreamChunk": ("workbench.outputs", "StreamChunk"),
    "Timeline": ("workbench.timeline", "Timeline"),
    "EngineSettings": ("workbench.settings", "EngineSettings"),
}

__all__ = [
    "LLM",
    "SamplingParams",
    "EngineClient",
    "start_engine",
    "connect",
    "Engine",
    "route",
    "sweep",
    "Simulator",
    "RequestOutput",
    "StreamChunk",
    "Timeline",
    "EngineSettings",
]

if TYPE_CHECKING:
    from .engines import connect
    from .interface import Engine
    from .ipc.client import EngineClient
    from .ipc.launch import start_engine
    from .llm import LLM
    from .outputs import RequestOutput, StreamChunk
    from .routing import route
    from .sampling_params import SamplingParams
    from .settings import EngineSettings
    from .timeline import Timeline


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")


def _jupyter_server_extension_points():  # the Jupyter server extension (REST + websocket)
    return [{"module": "workbench.jupyter_server"}]


def _jupyter_labextension_paths():  # `jupyter labextension develop` of the built extension
    return [{"src": "labextension", "dest": "serving-workbench"}]


def load_ipython_extension(ipython):  # `%load_ext workbench`
    from .jupyter.magics import load_ipython_extension as load

    load(ipython)
