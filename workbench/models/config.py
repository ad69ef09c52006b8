"""What a model is, whatever its format: `ModelConfig`, `LoadedModel`, the supported
architectures, the expected weight names and shapes, and the weights' checksum.

Weights use Hugging Face Llama names (Qwen3 adds `self_attn.{q,k}_norm.weight`, one per head dim):

    model.embed_tokens.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   (+ q/k/v .bias when attention_bias)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.norm.weight
    lm_head.weight                                      (only when the embeddings are untied)
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
}
_MODEL_TYPES = {"gemma3_text": "gemma3"}  # config.json model_type where it differs from ours
_HF_CLASS = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
_HF_MODEL_TYPE = {v: k for k, v in _MODEL_TYPES.items()}


def _supported_text() -> str:
    return ", ".join(f"{k} (model_type {v!r})" for k, v in SUPPORTED_ARCHITECTURES.items())


# ----------------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "mistral" | "mixtral" | "olmoe"
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
    sliding_window: int | None = None
    # Per layer, its sliding attention window (0: the whole context). Gemma 3 interleaves
    # sliding layers with global ones; Mistral slides on every layer.
    layer_windows: list[int] = field(default_factory=list)
    # Gemma 3: RMSNorm scales by (1 + w), embeddings are scaled by sqrt(hidden_size), each block
    # has norms before and after both attention and the MLP ("sandwich"), the MLP is GELU-tanh
    # gated, the softmax scale is query_pre_attn_scalar^-0.5, and sliding layers rotate with
    # their own RoPE base.
    norm_offset: float = 0.0
    embed_scale: float | None = None
    sandwich_norms: bool = False
    activation: str = "silu"  # "silu" | "gelu_tanh"
    attention_scale: float | None = None  # None: 1/sqrt(head_dim)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (None: rope_theta)
    final_logit_softcapping: float | None = None
    # Block size of the quantised checkpoint these weights came from (GGUF Q4_1: 32), so int4
    # re-quantisation can line its groups up with the original grid instead of smearing it.
    source_quant_block: int | None = None
    qk_norm: bool = False  # an RMSNorm over q and k before RoPE: per head (Qwen3) or over all heads (OLMoE)
    qk_norm_per_head: bool = True
    # Mixture of experts: each MoE layer routes every token to `num_experts_per_tok` of
    # `num_experts` SwiGLU experts (softmax router, top-k; weights renormalised when norm_topk_prob).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], path: str | os.PathLike = "", name: str | None = None) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        arch = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                arch = SUPPORTED_ARCHITECTURES[a]
                break
        if arch is None and not archs and _MODEL_TYPES.get(model_type, model_type) in _HF_CLASS:
            arch = _MODEL_TYPES.get(model_type, model_type)
        if arch is None:
            found = ", ".join(map(str, archs)) if archs else f"model_type {model_type!r}"
            raise ValueError(
                f"unsupported model architecture {found} in {path or 'config'}; supported: {_supported_text()}"
            )
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        allowed = ("gelu_pytorch_tanh", "gelu_tanh") if arch == "gemma3" else ("silu", "swish")
        if act not in allowed:
            raise ValueError(
                f"unsupported hidden activation {act!r} for {arch} in {path or 'config'}; "
                f"supported: {', '.join(allowed)}"
            )
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError(
                f"attn_logit_softcapping in {path or 'config'} is not supported (Gemma 2 style); "
                "Gemma 3 checkpoints have none"
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
        local_theta = cfg.get("rope_local_base_freq")
        if arch == "gemma3" and isinstance(rope_params, dict) and "full_attention" in rope_params:
            # transformers 5: one rope_parameters dict per layer type
            local_theta = (rope_params.get("sliding_attention") or {}).get("rope_theta", local_theta)
            rope_params = rope_params.get("full_attention") or {}
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
        elif arch in ("qwen3", "qwen3_moe"):
            attention_bias = bool(cfg.get("attention_bias", False))
            sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        else:
            attention_bias = bool(cfg.get("attention_bias", False))
            sliding = cfg.get("sliding_window") if arch in ("mistral", "gemma3") else None
        windows = layer_windows_of(arch, cfg, sliding)
        gemma = arch == "gemma3"

        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        bos = cfg.get("bos_token_id")
        moe = _moe_fields(arch, cfg)
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
            layer_windows=windows,
            source_quant_block=cfg.get("workbench_source_quant_block"),
            qk_norm=arch in ("qwen3", "qwen3_moe", "olmoe", "gemma3"),
            qk_norm_per_head=arch != "olmoe",
            **moe,
            **(
                gemma3_fields(
                    hidden, cfg.get("query_pre_attn_scalar", 256), local_theta, cfg.get("final_logit_softcapping")
                )
                if gemma
                else {}
            ),
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
            "model_type": _HF_MODEL_TYPE.get(self.architecture, self.architecture),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu" if self.activation == "silu" else "gelu_pytorch_tanh",
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
            if self.architecture in ("qwen2", "qwen3"):
                out["use_sliding_window"] = True
        if self.architecture == "gemma3":
            out["hidden_activation"] = "gelu_pytorch_tanh"
            out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in self.layer_windows]
            out["rope_local_base_freq"] = self.rope_local_theta
            out["query_pre_attn_scalar"] = round(self.attention_scale**-2)
            out["final_logit_softcapping"] = self.final_logit_softcapping
            out["rope_parameters"] = {
                "full_attention": rope_parameters,
                "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_theta},
            }
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
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,) if config.qk_norm_per_head else (q_out,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,) if config.qk_norm_per_head else (kv_out,)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if i in config.moe_layers:
            e_inter = config.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (config.num_experts, H)
            for e in range(config.num_experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (e_inter, H)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (e_inter, H)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (H, e_inter)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (inter, H)
            shapes[p + "mlp.up_proj.weight"] = (inter, H)
            shapes[p + "mlp.down_proj.weight"] = (H, inter)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if config.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (H,)
            shapes[p + "post_feedforward_layernorm.weight"] = (H,)
    return shapes


# Biases some Llama-family checkpoints carry beyond the required set (attention_bias=True on
# Llama also biases o_proj; mlp_bias=True biases the MLP). Kept when present.
_OPTIONAL_BIAS = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.(gate|up|down)_proj)\.bias$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


# What Gemma 3 fixes rather than stores everywhere: every 6th layer global, the sliding layers'
# RoPE base (llama.cpp's files carry neither; older config.json files may omit them).
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def gemma3_fields(
    hidden: int, query_pre_attn_scalar: float, local_theta: float | None, final_logit_softcapping: float | None
) -> dict[str, Any]:
    """The ModelConfig fields that make a Llama-style config a Gemma 3 one (HF and GGUF alike)."""
    return {
        "norm_offset": 1.0,
        "embed_scale": hidden**0.5,
        "sandwich_norms": True,
        "activation": "gelu_tanh",
        "attention_scale": float(query_pre_attn_scalar) ** -0.5,
        "rope_local_theta": float(local_theta if local_theta is not None else GEMMA3_LOCAL_ROPE_BASE),
        "final_logit_softcapping": final_logit_softcapping,
    }


def layer_windows_of(arch: str, cfg: dict[str, Any], sliding: int | None) -> list[int]:
    """Each layer's sliding window (0: full attention): from `layer_types` where the config lists
    them (transformers 5), else Gemma 3's `sliding_window_pattern` (every Nth layer global),
    else Mistral's window on every layer."""
    layers = int(cfg["num_hidden_layers"])
    if not sliding:
        return [0] * layers
    types = cfg.get("layer_types")
    if not types and arch == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern") or GEMMA3_SLIDING_PATTERN)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if not types:
        types = ["sliding_attention"] * layers
    if len(types) != layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the config has {layers}")
    return [int(sliding) if t == "sliding_attention" else 0 for t in types]


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a config.json: Mixtral (every layer sparse, renormalised top-k) or
    Qwen3-MoE (`decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`)."""
    layers = int(cfg["num_hidden_layers"])
    if arch == "mixtral":
        return {
            "num_experts": int(cfg["num_local_experts"]),
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,
            "moe_layers": list(range(layers)),
        }
    if arch == "olmoe":
        return {
            "num_experts": int(cfg["num_experts"]),
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_layers": list(range(layers)),
        }
    if arch == "qwen3_moe":
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 4 / 5
        moe_layers = [i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0]
        return {
            "num_experts": experts,
            "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 0),
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_layers": moe_layers,
        }
    return {}


# Mixtral's names for the router and experts -> the names used here (Qwen3-MoE's).
_MIXTRAL_NAMES = [
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
]


def select_weights(
    raw: dict[str, torch.Tensor], config: ModelConfig, where: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Check names and shapes against the config; cast to dtype; drop what the engine never uses."""
    if "model.embed_tokens.weight" not in raw and "embed_tokens.weight" in raw:
        # saved from the bare LlamaModel: no "model." prefix
        raw = {(k if k.startswith("lm_head.") else "model." + k): v for k, v in raw.items()}
    if config.architecture == "mixtral":

        def rename(k: str) -> str:
            for pattern, repl in _MIXTRAL_NAMES:
                k = pattern.sub(repl, k)
            return k

        raw = {rename(k): v for k, v in raw.items()}
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
            raise ValueError(f"{where}: weight {name} has shape {tuple(t.shape)}, expected {want} from the config")
        out[name] = t.to(dtype).contiguous()
    if unknown:
        warnings.warn(f"{where}: ignoring {len(unknown)} unexpected tensors, e.g. {unknown[:3]}", stacklevel=3)
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


def config_dict(config: ModelConfig) -> dict[str, Any]:
    """The config as a plain dict (for logs and the dashboard)."""
    return asdict(config)
