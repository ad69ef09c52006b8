"""What each live setting's change does to a running engine: validate everything first, then
re-lay out what the change touches (kernels, weights, cache, draft model), and record the change
on the timeline. `LLMEngine.apply_settings` calls `apply`, between steps.
"""

from __future__ import annotations

import time
from typing import Any

from workbench_kernels import hostmem

from ..models.host_memory import quantize_bytes
from ..models.linear import fp8_supported
from ..settings import RELAYOUT, RESTART, kv_salt, setting_kind, validate
from .attention import backend_ops


def apply(engine, changes: dict[str, Any], by: str) -> dict[str, Any]:
    """Validate all changes to `engine` (an `LLMEngine`), then apply them. Returns the effective settings.

    Anything that can fail (validation, an unsupported mode, loading a draft model) runs before
    the first change is applied, so a rejected call changes nothing. An accepted change is
    recorded on the timeline (old -> new, `by` whom, how long applying it took)."""
    started = time.monotonic()
    settings = engine.settings
    changes = validate(changes, settings)
    for name in changes:
        if setting_kind(name) == RESTART and changes[name] != getattr(settings, name):
            raise ValueError(f"setting {name!r} is fixed when the engine starts; restart the engine to change it")
    applied = {k: v for k, v in changes.items() if getattr(settings, k) != v}
    before = settings.as_dict()
    merged = {**before, **applied}
    kv_salt_before = kv_salt(settings)
    if "quantization" in applied:
        check_quantization(engine, applied["quantization"])
    if applied.get("moe_top_k") is not None:
        check_moe_top_k(applied["moe_top_k"], engine.model_config, engine.model_name)
    if "attention_backend" in applied:
        backend_ops(applied["attention_backend"], engine.device)
    new_draft = None
    if "draft_model" in applied or (merged["speculative"] == "draft" and engine.spec.draft is None):
        engine.emit_event("relayout", {"setting": "draft_model", "value": merged["draft_model"], "state": "started"})
        new_draft = engine.load_draft(merged["draft_model"])

    for name, value in applied.items():
        if setting_kind(name) == RELAYOUT:
            engine.emit_event("relayout", {"setting": name, "value": value, "state": "started"})
    if new_draft is not None:
        engine.spec.draft = new_draft
        engine.emit_event("relayout", {"setting": "draft_model", "value": new_draft.source, "state": "done"})
    runner = engine.runner
    # A new draft was built with the settings before this call: it takes these like the target.
    for r in (runner, *((engine.spec.draft.runner,) if engine.spec.draft is not None else ())):
        if "attention_backend" in applied:
            r.set_backend(applied["attention_backend"])
        if "cpu_kernels" in applied:
            r.set_cpu_kernels(applied["cpu_kernels"])
        if "prefill_attention" in applied:
            r.set_prefill_attention(applied["prefill_attention"])
    if "kv_cache_dtype" in applied:
        engine.scheduler.preempt_all()  # the cache is rebuilt: every running sequence recomputes
        runner.set_kv_cache_dtype(applied["kv_cache_dtype"])
    if {"quantization", "quant_group_size"} & applied.keys():
        with hostmem.own_mappings():  # replaced at the next re-layout: its memory must go back whole
            runner.model.quantize(merged["quantization"], merged["quant_group_size"])
        runner.drop_graphs()  # they captured the old weights' kernels
    if {"cuda_graphs", "max_num_seqs"} & applied.keys():
        runner.set_cuda_graphs(merged["cuda_graphs"], merged["max_num_seqs"])
    if "moe_top_k" in applied:
        runner.model.set_moe_top_k(applied["moe_top_k"])
    for name, value in applied.items():
        setattr(settings, name, value)
    dropped_draft = settings.speculative != "draft" and engine.spec.draft is not None
    if dropped_draft:  # a draft is held only while it proposes: its weights and cache come back now
        engine.spec.draft = None
    if {"prefix_caching", "kv_cache", "kv_cache_dtype"} & applied.keys():
        # a new cache dtype re-lays out the storage: no block's contents survive it
        engine.scheduler.set_prefix_caching(
            settings.prefix_caching and settings.kv_cache, reset="kv_cache_dtype" in applied
        )
    engine.scheduler.set_kv_salt(kv_salt(settings))  # new weights or kernels: new KV values
    if kv_salt(settings) != kv_salt_before or not settings.response_cache:
        engine.response_cache.clear()  # answers of other numbers (or a cache turned off) go
    if "speculative" in applied or "num_speculative_tokens" in applied:
        engine.scheduler.clear_drafts()
    for name, value in applied.items():
        if setting_kind(name) == RELAYOUT:
            engine.emit_event("relayout", {"setting": name, "value": value, "state": "done"})
    if applied:
        relayout = new_draft is not None or any(setting_kind(n) == RELAYOUT for n in applied)
        if relayout or dropped_draft:
            import gc

            gc.collect()  # the replaced weights, cache or draft are garbage now: give their memory back
            hostmem.trim_heap()
        engine.timeline.add_change(
            started, time.monotonic(), {k: [before[k], v] for k, v in applied.items()}, by=by, relayout=relayout
        )
        engine.emit_event("settings", {"changes": applied, "settings": settings.as_dict(), "by": by})
    return settings.as_dict()


def check_moe_top_k(value: int, config, model_name: str) -> None:
    if not config.num_experts:
        raise ValueError(
            f"invalid value {value!r} for setting 'moe_top_k': {model_name} is not a "
            "mixture-of-experts model; allowed: None"
        )
    if not 1 <= value <= config.num_experts:
        raise ValueError(
            f"invalid value {value!r} for setting 'moe_top_k': allowed None or 1..{config.num_experts} "
            f"(this model has {config.num_experts} experts, {config.num_experts_per_tok} per token "
            "by default)"
        )


def check_quantization(engine, mode: str) -> None:
    """ValueError where `mode` has no kernels on the engine's device; MemoryError where its codes
    would not fit beside the weights (which stay, so that any mode is reachable again)."""
    if mode == "fp8" and not fp8_supported(engine.device):
        raise ValueError(
            f"quantization='fp8' is not supported on this device ({engine.device}): it needs a CUDA GPU "
            "with fp8 support (compute capability 8.9+); allowed here: 'none', 'int8', 'int4'"
        )
    if engine.memory is not None:
        engine.memory.check_more(
            quantize_bytes(engine.runner.model, mode),
            f"quantization={mode!r} (its codes beside the weights it keeps)",
            "int4 takes half of int8's codes; or raise host_memory_mb, or free memory",
        )
