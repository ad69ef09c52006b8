"""What serving costs the machine: the engine process's CPU and memory, and the whole host's.

`HostSampler.sample()` is cheap (a few /proc reads through psutil) and caches for `min_interval_s`
so that several readers (the once-a-second metrics event, clients' `metrics()` calls) do not cut
the CPU-time intervals into noise. CPU figures are averages since the previous sample.
"""

from __future__ import annotations

import os
import time


class HostSampler:
    def __init__(self, pid: int | None = None, min_interval_s: float = 0.5):
        self.min_interval_s = min_interval_s
        self._last: dict[str, float | None] | None = None
        self._at = 0.0
        try:
            import psutil
        except ImportError:  # psutil comes with the Jupyter stack; without it the figures are None
            self._psutil = self._proc = None
            return
        self._psutil = psutil
        self._proc = psutil.Process(pid or os.getpid())
        self._proc.cpu_percent(None)  # starts the first interval
        psutil.cpu_percent(None)

    def sample(self) -> dict[str, float | None]:
        """``process_cpu_cores`` (cores' worth of CPU the engine process used), ``host_cpu_percent``
        (all ``host_cpus`` cores, 0-100), ``process_rss_mb`` and ``host_mem_percent``."""
        now = time.monotonic()
        if self._last is not None and now - self._at < self.min_interval_s:
            return self._last
        if self._psutil is None:
            self._last = dict.fromkeys(
                ("process_cpu_cores", "host_cpu_percent", "host_cpus", "process_rss_mb", "host_mem_percent")
            )
        else:
            ps = self._psutil
            self._last = {
                "process_cpu_cores": self._proc.cpu_percent(None) / 100.0,
                "host_cpu_percent": ps.cpu_percent(None),
                "host_cpus": ps.cpu_count() or 1,
                "process_rss_mb": self._proc.memory_info().rss / 2**20,
                "host_mem_percent": ps.virtual_memory().percent,
            }
        self._at = now
        return self._last
