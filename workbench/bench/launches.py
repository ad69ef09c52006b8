"""Kernel launches per decoder layer in an eager decode step (`workbench gpucheck`'s count).

An eager step on a GPU is launch-bound when a layer launches dozens of small kernels (an unfused
RMSNorm is eight, RoPE twelve). The count: one decode step of a few sequences, forwarded with all
the model's layers and with one; the difference over the other layers is each layer's launches,
and what is left of the one-layer count is outside the layers (embedding, final norm, LM head).
Counted with the fused layer ops (`fused_layer.py`, the Triton backend's) and without them.

On CUDA the torch profiler records the device's kernels (copies and memsets apart). On a CPU
(the dry run: Triton interpreted) it counts what would launch one: each Triton kernel, and each
top-level torch op that is not a view or an allocation.
"""

from __future__ import annotations

import contextlib
import os

import torch

# torch ops that launch nothing on a GPU: views and allocations; and those that launch a copy
# only when they make one (a copy then runs inside them)
_NOT_LAUNCHES = frozenset(
    "aten::" + name
    for name in (
        "view _unsafe_view split split_with_sizes chunk slice select narrow unsqueeze squeeze t transpose "
        "permute expand as_strided alias detach detach_ flatten unflatten empty empty_like empty_strided "
        "lift_fresh resolve_conj resolve_neg"
    ).split()
)
_IF_THEY_COPY = frozenset({"aten::to", "aten::contiguous", "aten::reshape", "aten::type_as"})
_COPIES = frozenset({"aten::copy_", "aten::_to_copy", "aten::clone"})


def _copies(event) -> bool:
    return any(c.name in _COPIES or _copies(c) for c in event.cpu_children)


def _launches(event) -> bool:
    if event.name in _NOT_LAUNCHES:
        return False
    return event.name not in _IF_THEY_COPY or _copies(event)


@contextlib.contextmanager
def _interpreted_launches_as_ranges():
    """Each interpreted Triton launch as one profiler range (its numpy work nested inside it)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        with torch.profiler.record_function(f"triton::{getattr(self.fn, '__name__', 'kernel')}"):
            return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield
    finally:
        InterpretedFunction.run = run


def count_launches(fn, device: torch.device) -> int:
    """Kernel launches of `fn()` on `device` (see the module doc for what counts on a CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # kineto prints every profiler start and stop on stderr at its USDT level (5): above it, quiet
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        return sum(
            1 for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
        )
    with _interpreted_launches_as_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.cpu_parent is None and _launches(e))


def launches_per_layer(llm, batch: int = 4, prompt_len: int = 8) -> dict:
    """Count an eager decode step of `batch` sequences on `llm` (an `LLM` on the Triton backend,
    CUDA graphs off). Leaves its requests aborted."""
    from ..sampling_params import SamplingParams

    eng = llm.engine
    runner, model = eng.runner, eng.runner.model
    num_layers = len(model.layers)
    if num_layers < 2:
        raise ValueError("counting launches per layer needs a model of at least 2 layers")
    vocab = eng.model_config.vocab_size
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    rids = [
        eng.add_request(prompt_token_ids=[(7 * i + j) % (vocab - 5) + 5 for j in range(prompt_len)], params=params)
        for i in range(batch)
    ]
    try:
        while any(not eng.requests[r].seq.output_token_ids for r in rids):  # past the prefills
            eng.step()
        sched = eng.scheduler.schedule()  # every sequence one decode token (never stepped: counted only)
        if [s.kind for s in sched.scheduled] != ["decode"] * batch:
            raise RuntimeError(f"expected {batch} decodes, got {[s.kind for s in sched.scheduled]}")
        step = lambda: runner.forward(sched.scheduled)  # noqa: E731
        step()  # compiled and warm
        fused_ops, counts = model.fused_ops, {}
        for name, ops in (("fused", fused_ops), ("unfused", None)):
            if name == "fused" and ops is None:
                continue
            model.fused_ops = ops
            layers, ropes = model.layers, model.ropes
            try:
                full = count_launches(step, runner.device)
                model.layers, model.ropes = layers[:1], ropes[:1]
                one = count_launches(step, runner.device)
            finally:
                model.layers, model.ropes = layers, ropes
            per_layer = (full - one) / (num_layers - 1)
            counts[name] = {"per_layer": per_layer, "per_step": full, "outside_layers": one - per_layer}
        model.fused_ops = fused_ops
    finally:
        for rid in rids:
            eng.abort_request(rid)
    serving = counts.get("fused", counts["unfused"])
    return {
        "launches_per_layer": serving["per_layer"],
        "fused_layers": fused_ops is not None,
        "fused_layers_reason": model.fused_layers_reason,
        "counts": counts,
        "batch": batch,
        "layers": num_layers,
        "counted": "device kernels (torch profiler)"
        if runner.device.type == "cuda"
        else "Triton launches and torch ops that are not views (CPU, interpreter)",
    }
