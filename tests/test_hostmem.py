"""Long-lived CPU tensors in huge pages (workbench_kernels.hostmem): what the arena hands out is
an ordinary tensor, and its memory is advised into 2 MiB pages where the kernel allows it."""

from __future__ import annotations

import pytest
import torch
from workbench_kernels import hostmem


def _mapping_flags(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address `ptr`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_arena_tensors_are_ordinary_aligned_and_apart():
    arena = hostmem.Arena(chunk_bytes=1 << 20)
    a = arena.copy(torch.arange(1000, dtype=torch.float32))
    b = arena.zeros((3, 5), torch.bfloat16)
    c = arena.empty((7,), torch.int8)
    assert torch.equal(a, torch.arange(1000, dtype=torch.float32)) and a.is_contiguous()
    assert b.dtype == torch.bfloat16 and b.shape == (3, 5) and not b.any()
    for t in (a, b, c):
        assert t.data_ptr() % hostmem.ALIGN == 0
    # no overlap: writing one leaves the others as they were
    c.fill_(-1)
    b.fill_(2)
    assert torch.equal(a, torch.arange(1000, dtype=torch.float32)) and bool((c == -1).all())
    # larger than a chunk: a mapping of its own; empty: no memory at all
    big = arena.zeros((3 << 20,), torch.uint8)
    assert big.numel() == 3 << 20 and not big.any()
    assert arena.empty((0, 4), torch.float32).shape == (0, 4)
    # another device's tensor is left where it is
    meta = torch.empty(3, device="meta")
    assert arena.copy(meta) is meta


def test_chunks_outlive_the_arena_while_a_tensor_uses_them():
    t = hostmem.Arena(chunk_bytes=1 << 20).copy(torch.full((4096,), 7.0))
    import gc

    gc.collect()
    assert bool((t == 7.0).all())


@pytest.mark.skipif(
    not hostmem.huge_pages_asked(),
    reason=f"transparent huge pages are {hostmem.thp_mode()!r} here (or the OS has no MADV_HUGEPAGE)",
)
def test_arena_memory_is_advised_into_huge_pages(monkeypatch):
    t = hostmem.Arena().zeros((4 << 20,), torch.uint8)
    assert _mapping_flags(t.data_ptr()).get("THPeligible") == "1"
    if hostmem.thp_mode() == "madvise":  # otherwise every mapping is eligible
        monkeypatch.setenv("WORKBENCH_HUGE_PAGES", "0")
        plain = hostmem.Arena().zeros((4 << 20,), torch.uint8)
        assert _mapping_flags(plain.data_ptr()).get("THPeligible") == "0"


def test_a_large_tensor_is_unmapped_with_its_last_view():
    """A tensor of more than half a chunk gets a mapping of its own: the arena does not keep it as
    its current chunk (a dropped draft model's KV cache stayed resident until the next chunk)."""
    import gc
    import weakref

    from workbench_kernels.hostmem import Arena

    arena = Arena(chunk_bytes=4 << 20)
    small = arena.empty((1024,), torch.float32)
    big = arena.empty((3 << 20,), torch.uint8)
    assert arena._chunk is not None and arena._chunk.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    storage = weakref.ref(big.untyped_storage()) if hasattr(torch.UntypedStorage, "__weakref__") else None
    del big
    gc.collect()
    if storage is not None:
        assert storage() is None
    assert small.numel() == 1024  # the chunk of small tensors is untouched


def test_turning_draft_speculation_off_drops_the_draft(tiny_llama):
    """The draft (its weights' copies and KV cache) is held only while it proposes."""
    from workbench import LLM

    llm = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=32)
    llm.configure(speculative="draft")
    assert llm.engine.spec.draft is not None
    llm.configure(speculative="ngram")
    assert llm.engine.spec.draft is None
    llm.configure(speculative="draft")  # loaded again when asked for
    assert llm.engine.spec.draft is not None
