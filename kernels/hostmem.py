"""Long-lived CPU tensors (weights, their packed copies, the KV cache) in 2 MiB pages.

With 4 KiB pages a decode step's weights span ~70,000 pages: the hardware prefetchers stop at
every page boundary and each page costs a TLB walk, so the GEMVs stream below the memory's rate
(SmolLM2's 121 GEMVs of a token on a Zen 4 guest: 22-27 GB/s from 4 KiB pages, 28-31 GB/s from
2 MiB ones, interleaved). Linux backs memory with huge pages only where asked (transparent huge
pages in "madvise" mode, the common default), and torch's allocator never asks; an `Arena` maps
anonymous memory in 2 MiB-aligned chunks, asks for huge pages with `madvise`, and hands out
64-byte-aligned tensors from them. Elsewhere (THP off or unknown, another OS) the same calls give
the same tensors in ordinary pages.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: the kernels' vector loads never straddle one
CHUNK = 64 << 20


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), or "unavailable"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


def huge_pages_asked() -> bool:
    """Whether memory from an arena is advised into huge pages here (Linux, THP not off, and not
    turned off with WORKBENCH_HUGE_PAGES=0 to compare)."""
    if os.environ.get("WORKBENCH_HUGE_PAGES", "1") == "0":
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


class Arena:
    """A bump allocator over huge-page-advised chunks. Tensors keep their chunk mapped; a chunk
    is unmapped when no tensor from it is left. A tensor of more than half a chunk gets a mapping
    of its own (so it is unmapped with it). Meant for memory that lives as long as a model."""

    def __init__(self, chunk_bytes: int = CHUNK):
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8 view of the current chunk, 2 MiB aligned
        self._used = 0
        self._lock = threading.Lock()

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor on the CPU."""
        shape = torch.Size(shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        if nbytes > self.chunk_bytes // 2:
            # a mapping of its own, unmapped with its last view: as the current chunk the arena
            # itself kept it (a dropped draft's KV cache stayed resident until the next chunk)
            return _map(nbytes)[:nbytes].view(dtype).view(shape)
        with self._lock:
            start = -(-self._used // ALIGN) * ALIGN
            if self._chunk is None or start + nbytes > self._chunk.numel():
                self._chunk, start = _map(max(self.chunk_bytes, nbytes)), 0
            self._used = start + nbytes
            raw = self._chunk[start : start + nbytes]
        return raw.view(dtype).view(shape)

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(shape, dtype).zero_()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (a CPU tensor) copied into the arena; other devices' tensors are returned as they are."""
        if t.device.type != "cpu":
            return t
        return self.empty(t.shape, t.dtype).copy_(t)


def _map(nbytes: int) -> torch.Tensor:
    """A fresh anonymous private mapping of at least `nbytes`, 2 MiB aligned, advised into huge
    pages before anything touches it (a page faulted in first stays small)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping open while any view lives
    offset = -whole.data_ptr() % HUGE_PAGE
    if huge_pages_asked():
        m.madvise(mmap.MADV_HUGEPAGE, offset, size)
    return whole[offset : offset + size]


# The process's arena for model memory: weights, their packed copies and the KV cache.
ARENA = Arena()


_LIBC = None
# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# What a serving process keeps in its heap: C allocations up to this size (a step's activations: a
# 1,024-token prompt's gate/up output is 6 MB a layer for SmolLM2, 32 MB for a 1B model), and up to
# twice it free at the heap's top before handing memory back to the OS.
STEP_BUFFERS_MAX = 256 << 20


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes, _LIBC.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
            _LIBC.mallopt.argtypes, _LIBC.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def trim_heap() -> None:
    """Hand the C heap's free memory back to the OS (glibc's malloc_trim): after a re-layout drops
    a copy of the weights, or a large answer is sent, glibc keeps the freed pages otherwise and the
    process's RSS stays at its high-water mark. A no-op where there is no glibc."""
    if _libc():
        _LIBC.malloc_trim(0)


def keep_step_buffers() -> None:
    """Let the steps' activations reuse the heap's pages. Left to itself glibc moves its mmap and
    trim thresholds as blocks come and go, and in some processes settles where every large step
    hands its pages back and faults them in again: a 1,024-token prompt of SmolLM2 then took
    ~55,000 page faults and 234 ms a step, against ~10 and 168-194 ms in the others (1 process
    of 5, at random; docs/benchmarks.md). Fixed thresholds keep it out of that state. A no-op
    where there is no glibc."""
    libc = _libc()
    if libc:
        libc.mallopt(_M_MMAP_THRESHOLD, STEP_BUFFERS_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * STEP_BUFFERS_MAX)


@contextlib.contextmanager
def own_mappings():
    """Inside, every C allocation of 128 KiB or more gets a mapping of its own, so what is built
    here (a draft model, its packed weights, their temporaries) goes back to the OS whole when it
    is dropped. glibc would otherwise serve them from its heap once its dynamic mmap threshold has
    risen (it rises to each large block freed, up to 32 MiB), and a dropped draft left ~0.9 GB
    resident in heap holes (float32 SmolLM2). After, the steps' thresholds (`keep_step_buffers`)."""
    libc = _libc()
    if libc:
        libc.mallopt(_M_MMAP_THRESHOLD, 128 << 10)
    try:
        yield
    finally:
        keep_step_buffers()


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                out[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup may still take before its limit (v2 memory.max, v1
    memory.limit_in_bytes), counting its reclaimable file cache as room; None: no limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        base = f"/sys/fs/cgroup{path}" if v2 else f"/sys/fs/cgroup/memory{path}"
        names = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        try:
            with open(f"{base}/{names[0]}") as f:
                limit = f.read().strip()
            with open(f"{base}/{names[1]}") as f:
                used = int(f.read())
            if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
                return None
            cache = 0
            with open(f"{base}/memory.stat") as f:
                for stat in f:
                    key, _, value = stat.partition(" ")
                    if key in ("inactive_file", "total_inactive_file"):
                        cache = int(value)
            return max(0, int(limit) - used + cache)
        except (OSError, ValueError):
            return None
    return None


def total_bytes() -> int:
    """This machine's memory (MemTotal), or 0 where /proc/meminfo does not say."""
    return _meminfo().get("MemTotal", 0)


def available_bytes() -> int | None:
    """Bytes a process can still take without swapping or being killed: the kernel's estimate
    (MemAvailable: free memory and reclaimable cache), and at most what this process's cgroup
    leaves (a container's limit, which /proc/meminfo does not show). None where neither is known."""
    room = [n for n in (_meminfo().get("MemAvailable"), _cgroup_room()) if n is not None]
    return min(room) if room else None
