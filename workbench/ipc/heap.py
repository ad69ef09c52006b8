"""When the engine process gives its C heap's free pages back to the OS. Decoding messages and
encoding large answers grow the heap, and RSS otherwise stays at its high-water mark."""

from __future__ import annotations

import time

import msgspec
from workbench_kernels import hostmem

TRIM_AFTER_BYTES = 1 << 20  # answers at least this large are followed by a heap trim
# Messages handled since the last trim past which an idle engine trims its heap (decoding a burst of
# large submits: 555k fuzzed messages left 550 MB more resident than before them, the engine idle).
TRIM_AFTER_HANDLED = 64 << 20


class HeapTrim:
    def __init__(self):
        self.handled_bytes = 0  # of counted messages since the heap was last trimmed
        self._last = 0.0

    def handled(self, size: int) -> None:
        self.handled_bytes += size

    def when_idle(self) -> None:
        """A burst of messages is over: its heap goes back to the OS."""
        if self.handled_bytes >= TRIM_AFTER_HANDLED:
            self.handled_bytes = 0
            hostmem.trim_heap()

    def after_answer(self, answer) -> None:
        """After a large answer (a whole timeline: megabytes) is sent, at most once a second."""
        value = getattr(answer, "value", None)
        size = memoryview(value).nbytes if isinstance(value, (msgspec.Raw, bytes)) else 0
        now = time.monotonic()
        if size >= TRIM_AFTER_BYTES and now - self._last >= 1.0:
            self._last = now
            hostmem.trim_heap()
