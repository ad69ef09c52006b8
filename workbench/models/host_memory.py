"""What an engine on a CPU may hold in the host's memory, checked before it takes it.

The C kernels serve from copies of the weights beside the originals: our tiles' layout where
AMX is absent, oneDNN's packed layout, an fp32 copy on CPUs without bf16 arithmetic (twice the
bf16 bytes). Each made at load or at its first use, they double or triple a model: an 8B model
(16 GB in bf16) then needs 32-48 GB, and a host with less was killed by the OOM killer at load
or, worse, at its first long prompt, with every running request. `HostMemory` is asked before
each such allocation:

- a model and its KV cache that cannot fit are refused before a byte is read (`check_load`), and a
  live quantisation the same way (`check_more`): a `MemoryError` naming what was needed, what is
  available and what to change; the engine keeps serving;
- a copy that would not fit is not made (`affords`): the layer multiplies from the weights as they
  are, at some cost in speed (a tiles copy becomes the tiles' layout in place, `Linear.hold_once`;
  oneDNN's and the fp32 copy are made per call, one layer at a time), and status() counts them.

The room is the machine's (MemAvailable, and a cgroup's limit where the process has one) less a
reserve for everything else the process and the machine do, and at most `host_memory_mb` for
what the engine holds: the parts of status()["memory_mb"].
"""

from __future__ import annotations

import math
import weakref

from workbench_kernels import hostmem

from ..reports import HostMemoryReport

MIB = 1 << 20
GIB = 1 << 30
# Kept free for the process's own work (a step's activations, the tokenizer, the front ends) and
# the rest of the machine: 5% of the memory, at least 512 MiB.
RESERVE_SHARE, RESERVE_MIN = 0.05, 512 * MIB


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


class HostMemory:
    """The budget of one engine: its model runners (the target's, a draft's) register as they are
    built, before their kernels make any copy (`add`)."""

    def __init__(self, limit_mb: int | None):
        self.limit = None if limit_mb is None else limit_mb * MIB
        self.reserve = max(RESERVE_MIN, int(RESERVE_SHARE * hostmem.total_bytes()))
        self._runners: list[weakref.ref] = []  # a dropped draft's runner leaves with its memory

    def add(self, runner) -> None:
        """Count `runner`'s memory (a `ModelRunner`: weights, copies, KV cache) from now on."""
        self._runners = [r for r in self._runners if r() is not None] + [weakref.ref(runner)]

    def held(self) -> int:
        """Bytes the engine holds: status()["memory_mb"]'s parts (a draft's own, less what it shares)."""
        total, seen = 0, {}
        for ref in self._runners:
            runner = ref()
            if runner is not None:
                total += sum(runner.memory_bytes(seen).values())
                seen.update(runner.model.originals())
        return total

    def room(self) -> tuple[int | None, str]:
        """(bytes the engine may still take, what bounds them); None: unbounded (nothing known)."""
        rooms = []
        available = hostmem.available_bytes()
        if available is not None:
            rooms.append((available - self.reserve, f"{gib(available)} available, less a {gib(self.reserve)} reserve"))
        if self.limit is not None:
            held = self.held()
            rooms.append(
                (self.limit - held, f"host_memory_mb={self.limit // MIB}, of which the engine holds {gib(held)}")
            )
        if not rooms:
            return None, "nothing is known of this machine's memory"
        return min(rooms, key=lambda r: r[0])

    def affords(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit (a kernel's copy of a layer's weights)."""
        room, _ = self.room()
        return room is None or nbytes <= room

    def check_more(self, nbytes: int, what: str, advice: str) -> None:
        """MemoryError unless `nbytes` more fit: `what` they are for, `advice` on what to change."""
        room, bound = self.room()
        if room is not None and nbytes > room:
            raise MemoryError(
                f"{what} needs {gib(nbytes)}, but the engine may take {gib(max(0, room))} more ({bound}); {advice}"
            )

    def report(self, skipped: dict[str, int]) -> HostMemoryReport:
        """status()["host_memory"]: the bounds, and the copies not made for them (`skipped`: kind ->
        layers serving without it)."""
        room, bound = self.room()
        available = hostmem.available_bytes()
        return HostMemoryReport(
            limit_mb=None if self.limit is None else self.limit // MIB,
            available_mb=None if available is None else available // MIB,
            reserve_mb=self.reserve // MIB,
            room_mb=None if room is None else max(0, room) // MIB,
            bound=bound,
            copies_skipped=skipped,
        )


def weights_bytes(config, dtype_size: int) -> int:
    """The model's weights in the engine's dtype, from its config alone."""
    from .config import expected_weight_shapes

    return sum(math.prod(shape) for shape in expected_weight_shapes(config).values()) * dtype_size


def check_load(memory: HostMemory | None, config, dtype_size: int, kv_bytes: int, what: str) -> None:
    """Refuse a model whose weights and KV cache cannot fit, before any is read (`what`: "the model
    NAME", "the draft model NAME")."""
    if memory is None or config is None:
        return
    weights = weights_bytes(config, dtype_size)
    memory.check_more(
        weights + kv_bytes,
        f"{what} ({gib(weights)} of weights, {gib(kv_bytes)} of KV cache)",
        "use a smaller model, a smaller kv_cache_memory_mb or num_kv_blocks, or free memory",
    )


def quantize_bytes(model, mode: str) -> int:
    """Bytes a quantisation of `model` (a `Transformer`) to `mode` adds: its codes and scales, less the
    copies of the originals and the earlier codes it drops. Going back to "none" adds nothing here:
    the copies made again after it ask `affords` one by one."""
    if mode == "none":
        return 0
    add = sum(lin.codes_bytes(model.mode_of(lin, mode)) for lin in model.linears())
    drop = sum(n for lin in model.linears() for n in lin.copies_bytes().values())
    return max(0, add - drop)
