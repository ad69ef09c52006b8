"""GGUF files: config, tokenizer and (dequantised) weights, through the `gguf` package."""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..tokenizer import Tokenizer
from .config import (
    LoadedModel,
    ModelConfig,
    gemma3_fields,
    layer_windows_of,
    select_weights,
    weights_checksum,
)

# ----------------------------------------------------------------------------------- GGUF
# llama.cpp tensor names -> Hugging Face names ("{i}" is the layer).
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3, olmoe
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the MoE router
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_ARCHS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
    "gemma3": "gemma3",
}
# Gemma 3 wraps attention and the MLP in norms: llama.cpp's ffn_norm is the pre-MLP one there.
_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}

# Mixture-of-experts tensors: the router, and each expert projection stacked over the experts.
_GGUF_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) -> how the original tokenizer splits text.
_GPT2_PRE = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"}
_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501  (one regex, as llama.cpp spells it)
)
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
_REGEX_PRE = {
    "qwen2": _QWEN2_REGEX,
    "stablelm2": _QWEN2_REGEX,
    "deepseek-r1-qwen": _QWEN2_REGEX,
    "llama-bpe": _LLAMA3_REGEX,
    "llama3": _LLAMA3_REGEX,
}


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's HF->GGUF reordering of q_proj/k_proj rows.

    The converter regroups each head's rows from [first half | second half] (HF's rotate_half
    RoPE) to interleaved pairs (GGML's RoPE): reshape(n_head, 2, d/2).swapaxes(1, 2). The
    inverse reads the rows as (n_head, d/2, 2) and swaps back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_tokenizer(reader) -> Tokenizer | None:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        return None
    if kind == "llama":
        return _sentencepiece_tokenizer(reader)
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer type {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece)"
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pre = _field(reader, "tokenizer.ggml.pre", "default")

    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in ("llama-bpe", "llama3"),
    )
    tk = HFTokenizer(bpe)
    if pre in _DIGITS_PRE:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in _REGEX_PRE:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if pre not in _GPT2_PRE:
            warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using the GPT-2 byte-level split", stacklevel=3)
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()

    special, user = [], []
    for tok, ty in zip(tokens, types, strict=False):
        if ty == 3:  # CONTROL
            special.append(AddedToken(tok, special=True, normalized=False))
        elif ty == 4:  # USER_DEFINED
            user.append(AddedToken(tok, special=False, normalized=False))
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)

    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    eos_ids = [
        int(v)
        for v in (
            _field(reader, "tokenizer.ggml.eos_token_id"),
            _field(reader, "tokenizer.ggml.eot_token_id"),
            _field(reader, "tokenizer.ggml.eom_token_id"),
        )
        if v is not None
    ]
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        b = tokens[bos_id]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B:1", special_tokens=[(b, int(bos_id))]
        )
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    return Tokenizer(
        tk,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token=None if bos_id is None else tokens[bos_id],
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        eos_token_ids=eos_ids,
        bos_token_id=None if bos_id is None else int(bos_id),
    )


def _sentencepiece_tokenizer(reader) -> Tokenizer:
    """A SentencePiece vocabulary (tokenizer.ggml.model 'llama': Gemma) as a `tokenizers` BPE,
    converted by transformers (its merges are derived from the scores, which takes seconds for
    a 262k vocabulary) and cached by the file's identity."""
    import hashlib
    import json

    import platformdirs
    from tokenizers import Tokenizer as HFTokenizer

    src = Path(reader.data.filename)  # the reader memory-maps the file
    st = src.stat()
    key = hashlib.blake2b(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode(), digest_size=8).hexdigest()
    cache = Path(platformdirs.user_cache_dir("serving-workbench", appauthor=False)) / "gguf-tokenizers"
    cached = cache / f"{src.stem}-{key}.json"
    if cached.exists():
        tk = HFTokenizer.from_file(str(cached))
    else:
        try:
            import transformers
        except ImportError as e:
            raise RuntimeError(
                f"{src}: its SentencePiece tokenizer is converted by transformers: pip install transformers"
            ) from e
        hf = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tk = hf.backend_tokenizer
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_text(json.dumps(json.loads(tk.to_str())))
        tmp.replace(cached)
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    eos_ids = [
        int(v)
        for v in (_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id"))
        if v is not None
    ]
    if "<end_of_turn>" in tokens and tokens.index("<end_of_turn>") not in eos_ids:
        eos_ids.append(tokens.index("<end_of_turn>"))  # Gemma's chat turns end there
    return Tokenizer(
        tk,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token=None if bos_id is None else tokens[bos_id],
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        eos_token_ids=eos_ids,
        bos_token_id=None if bos_id is None else int(bos_id),
    )


def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """A GGUF file's config from its metadata alone (the tensors stay on disk, memory-mapped)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    return _gguf_config(gguf.GGUFReader(str(path)), path)


def _gguf_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}")

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if isinstance(value, float):  # stored as float32: 1e-5 reads back as 9.9999997e-06
            value = float(str(np.float32(value)))
        return value

    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    head_dim = int(meta("attention.key_length", hidden // heads))
    scaling = None
    s_type = meta("rope.scaling.type")
    if s_type and s_type != "none":
        scaling = {"rope_type": s_type, "factor": float(meta("rope.scaling.factor", 1.0))}
        orig = meta("rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
    if "rope_freqs.weight" in names:
        warnings.warn(
            f"{path}: GGUF carries rope_freqs (Llama 3.1-style rope scaling), which is not converted; "
            "positions beyond the original context may be wrong",
            stacklevel=2,
        )
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    experts = int(meta("expert_count", 0) or 0)
    architecture = "mixtral" if arch == "llama" and experts else _GGUF_ARCHS[arch]  # llama.cpp files Mixtral as llama
    moe_layers = sorted(int(n.split(".")[1]) for n in names if n.endswith("ffn_gate_inp.weight"))
    config = ModelConfig(
        architecture=architecture,
        vocab_size=int(meta("vocab_size", len(tokens) if tokens else 0)),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=[] if eos is None else [int(eos)],
        name=path.stem,
        path=str(path),
        qk_norm="blk.0.attn_q_norm.weight" in names,
        qk_norm_per_head=architecture != "olmoe",
        num_experts=experts,
        num_experts_per_tok=int(meta("expert_used_count", 0) or 0),
        moe_intermediate_size=int(meta("expert_feed_forward_length", 0) or meta("feed_forward_length"))
        if experts
        else 0,
        norm_topk_prob=architecture == "mixtral" or bool(meta("expert_weights_norm", False)),
        moe_layers=moe_layers,
    )
    if config.vocab_size == 0:
        config.vocab_size = int(reader.tensors[[t.name for t in reader.tensors].index("token_embd.weight")].shape[1])
    if architecture == "gemma3":
        window = int(meta("attention.sliding_window", 0) or 0)
        config.sliding_window = window or None
        config.layer_windows = layer_windows_of("gemma3", {"num_hidden_layers": config.num_hidden_layers}, window)
        # query_pre_attn_scalar = head_dim (270M to 12B); the local RoPE base is llama.cpp's fixed one
        for k, v in gemma3_fields(hidden, head_dim, None, meta("final_logit_softcapping")).items():
            setattr(config, k, v)
    return config


def read_gguf(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Parse a GGUF file: config, weights in HF names (each dequantised and fixed up in float32, then
    cast to `dtype` before the next is read: every weight in float32 at once held a model's size
    twice over beside its cast, ~3x its bf16 size), tokenizer."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    reader = gguf.GGUFReader(str(path))
    config = _gguf_config(reader, path)
    arch = _field(reader, "general.architecture")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    weights: dict[str, torch.Tensor] = {}
    layer_names = _GEMMA3_LAYER_NAMES if config.architecture == "gemma3" else _GGUF_LAYER_NAMES
    layer_re = re.compile(r"^blk\.(\d+)\.(.+)$")
    for t in reader.tensors:
        if t.name in _GGUF_GLOBAL_NAMES:
            hf = _GGUF_GLOBAL_NAMES[t.name]
        elif t.name == "rope_freqs.weight":
            continue
        else:
            m = layer_re.match(t.name)
            if m and m.group(2) in _GGUF_EXPERT_NAMES:
                hf = f"model.layers.{m.group(1)}.mlp.experts.{{}}.{_GGUF_EXPERT_NAMES[m.group(2)]}.weight"
            elif not m or m.group(2) not in layer_names:
                raise ValueError(f"{path}: unexpected GGUF tensor {t.name!r} for architecture {arch!r}")
            else:
                hf = f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
        block = gguf.GGML_QUANT_SIZES[t.tensor_type][0]
        if block > 1 and len(t.shape) == 2:
            # K-quants keep 32-wide sub-blocks inside 256-wide super-blocks.
            block = min(block, 32)
            config.source_quant_block = min(config.source_quant_block or block, block)
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        arr = arr.reshape(shape).astype(np.float32, copy=False)
        if not arr.flags.writeable:  # unquantised tensors are views of the memory-mapped file
            arr = arr.copy()
        w = torch.from_numpy(arr)
        if "{}" in hf:  # [experts, out, in]: one matrix per expert
            for e in range(w.shape[0]):
                weights[hf.format(e)] = w[e].to(dtype).contiguous()
            continue
        # The HF->GGUF converter permutes q/k rows for llama (not qwen2/qwen3); undo it.
        if config.architecture in ("llama", "mistral", "mixtral"):
            if hf.endswith("q_proj.weight") or hf.endswith("q_proj.bias"):
                w = _unpermute_qk(w, heads)
            elif hf.endswith("k_proj.weight") or hf.endswith("k_proj.bias"):
                w = _unpermute_qk(w, kv_heads)
        if config.architecture == "gemma3" and hf.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm scales; the checkpoint's w is what we keep
        weights[hf] = w.to(dtype)

    tokenizer = gguf_tokenizer(reader)
    if tokenizer is not None:
        for e in tokenizer.eos_token_ids:
            if e not in config.eos_token_ids:
                config.eos_token_ids.append(e)
    return config, weights, tokenizer


def load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    t0 = time.perf_counter()
    config, raw, tokenizer = read_gguf(path, dtype)
    weights = select_weights(raw, config, str(path), dtype)
    return LoadedModel(config, weights, tokenizer, weights_checksum(weights), time.perf_counter() - t0)
