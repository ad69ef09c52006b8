"""Models into an engine: the target at start, a draft at a live change, each checked against the
engine's host memory (`models.host_memory`) before a byte of it is read, placed for the device,
and the KV cache sized for it."""

from __future__ import annotations

import torch

from ..models.host_memory import HostMemory, check_load, gib
from ..models.llama import place_weights
from ..models.loader import LoadedModel, load_model, model_config
from .attention import KVCache, kv_cache_budget
from .model_runner import ModelRunner
from .speculative import DraftProposer, check_same_vocabulary


def host_memory(engine) -> HostMemory | None:
    """The engine's budget on a CPU (None on CUDA: the device's memory bounds it there)."""
    if engine.device.type != "cpu":
        return None
    return HostMemory(engine.settings.host_memory_mb)


def kv_block_bytes(settings, config, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    return KVCache.bytes_per_block(
        config.num_hidden_layers,
        settings.block_size,
        config.num_key_value_heads,
        config.head_dim,
        dtype,
        kv_cache_dtype,
    )


def kv_cache_blocks(settings, config, device: torch.device, dtype: torch.dtype) -> int:
    """The KV cache's blocks: `num_kv_blocks`, else as many as its budget holds."""
    per_block = kv_block_bytes(settings, config, dtype, settings.kv_cache_dtype)
    return settings.num_kv_blocks or max(1, kv_cache_budget(settings.kv_cache_memory_mb, device) // per_block)


def load_placed(
    model,
    settings,
    device: torch.device,
    dtype: torch.dtype,
    memory: HostMemory | None,
    num_blocks: int | None = None,
    role: str = "model",
) -> LoadedModel:
    """The model, refused first if it and its KV cache (`num_blocks`, else as the settings size it)
    cannot fit in `memory`, its weights placed on `device` (the loader's copies of merged parts go
    as they are merged: before the cache is sized, which on CUDA takes what is left)."""
    if memory is not None and (config := model_config(model)) is not None:
        blocks = num_blocks or kv_cache_blocks(settings, config, device, dtype)
        # a draft's cache (`num_blocks`: the target's count) is in the model's dtype
        kv = blocks * kv_block_bytes(settings, config, dtype, settings.kv_cache_dtype if num_blocks is None else "auto")
        check_load(memory, config, dtype.itemsize, kv, f"the {role} {model or 'smollm2-135m'}")
    loaded = load_model(model, dtype=dtype, device=device)  # a model shape's random weights made there
    loaded.weights = place_weights(loaded.config, loaded.weights, device)
    return loaded


class _ReadAsBuilt(dict):
    """The target's weights by name (`WeightsByName`) as a self-int4 draft's layers ask for them,
    each read (a copy where the target holds it as the tiles) kept only until its layer has its
    codes (`forget`): the draft is built one layer's copies at a time, not the model's."""

    def __init__(self, by_name):
        super().__init__()
        self._by_name = by_name

    def __missing__(self, name):
        return self._by_name[name]

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or name in self._by_name

    def get(self, name, default=None):
        return self[name] if name in self else default

    def forget(self, prefix: str) -> None:
        for name in [n for n in self if n.startswith(prefix)]:
            del self[name]


def _check_self_draft(engine) -> None:
    """MemoryError unless a self-int4 draft fits beside the engine: its codes, its KV cache, and
    while it is built one layer's copies (twice: the parts and their merge) and the output head's."""
    target, memory = engine.runner.model, engine.memory
    codes = sum(lin.codes_bytes(target.mode_of(lin, "int4")) for lin in target.linears())
    layer = max(sum(lin.storage.nbytes for lin in layer.linears()) for layer in target.layers)
    blocks = engine.scheduler.kv_blocks[1]
    kv = blocks * kv_block_bytes(engine.settings, engine.model_config, engine.dtype, "auto")
    memory.check_more(
        codes + kv + 2 * layer + target.lm_head.storage.nbytes,
        f"a self-int4 draft ({gib(codes)} of codes, {gib(kv)} of KV cache)",
        "name a smaller draft_model, raise host_memory_mb, or free memory",
    )


def build_draft(engine, draft_model: str | None) -> DraftProposer:
    """The draft for `speculative='draft'`: the named model, else the engine's own in int4, each
    layer quantised as it is built; either refused (MemoryError) where it would not fit beside the
    engine."""
    s, memory = engine.settings, engine.memory
    on_layer = None
    if draft_model is None:
        if memory is not None:
            _check_self_draft(engine)
        config, source = engine.model_config, "self-int4"
        weights = _ReadAsBuilt(engine._weights)
        group = config.source_quant_block or 128

        def on_layer(layer):  # its codes alone: a self-int4 draft is rebuilt, never re-laid out
            for lin in layer.linears():
                lin.quantize("int4", group)
                lin.drop_original()
            weights.forget(f"model.layers.{layer.index}.")

    else:
        blocks = engine.scheduler.kv_blocks[1]
        loaded = load_placed(draft_model, s, engine.device, engine.dtype, memory, blocks, "draft model")
        check_same_vocabulary(engine.model_config, engine.tokenizer, loaded.config, loaded.tokenizer, draft_model)
        config, weights, source = loaded.config, loaded.weights, str(draft_model)
    runner = ModelRunner(
        config,
        weights,
        device=engine.device,
        dtype=engine.dtype,
        block_size=s.block_size,
        num_blocks=engine.scheduler.kv_blocks[1],
        kv_cache_dtype="auto",
        attention_backend=s.attention_backend,
        max_model_len=engine.max_model_len,
        cpu_kernels=s.cpu_kernels,
        prefill_attention=s.prefill_attention,
        own_weights=draft_model is not None,  # placed for it alone; self-int4's parts are the target's
        memory=memory,
        on_layer=on_layer,
    )
    if draft_model is None:
        head = runner.model.lm_head
        head.quantize(runner.model.mode_of(head, "int4"), group)
        head.drop_original()
        runner.model.share_embedding(engine.runner.model)  # its copy of the embedding goes
    engine.scheduler.reset_draft_caches()
    return DraftProposer(runner, source)
