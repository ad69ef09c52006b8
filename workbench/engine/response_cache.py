"""The response cache: an exact repeat of a deterministic request answered from its earlier answer.

Deterministic means greedy (temperature 0) or seeded: the same prompt, parameters and engine
settings give the same tokens, so the answer can be replayed without a step. A sampled request
without a seed is never answered from here (its next answer is meant to differ). Entries are keyed
by the prompt's token ids, the sampling parameters and the settings that shape the numbers
(`settings.kv_salt`: weights' quantisation, KV dtype, kernels...); the engine empties the cache when
those change. Bounded in entries (least recently used go first) and in age (TTL).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import msgspec

from ..outputs import CoreOutput
from ..sampling_params import SamplingParams

MAX_ENTRIES = 1024
TTL_S = 600.0


def deterministic(params: SamplingParams) -> bool:
    return params.temperature == 0 or params.seed is not None


class ResponseCache:
    def __init__(self, max_entries: int = MAX_ENTRIES, ttl_s: float = TTL_S):
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._entries: OrderedDict[tuple, tuple[float, CoreOutput]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(ids: list[int], params: SamplingParams, salt: int) -> tuple | None:
        """None for a request the cache must not answer (sampled without a seed)."""
        if not deterministic(params):
            return None
        return tuple(ids), msgspec.json.encode(params), salt

    def get(self, key: tuple, now: float | None = None) -> CoreOutput | None:
        now = time.monotonic() if now is None else now
        entry = self._entries.get(key)
        if entry is None or now - entry[0] > self.ttl_s:
            if entry is not None:
                del self._entries[key]
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[1]

    def put(self, key: tuple, out: CoreOutput, now: float | None = None) -> None:
        if out.finish_reason not in ("stop", "length"):
            return  # an aborted answer is not the answer
        self._entries[key] = (time.monotonic() if now is None else now, out)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
