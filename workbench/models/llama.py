"""The transformer: Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3, the MoE ones, Gemma 3)
over a flat token batch.

No padding anywhere: a step's tokens from every sequence are concatenated, and attention finds
each sequence's context in the paged KV cache through `AttnMetadata`. Q/K/V and gate/up are
fused into one matmul each, since on a CPU every kernel launch costs.

This file composes the layers in torch ops (any device and dtype); where a step runs is decided
behind the backends: the attention backend (`engine/attention.py`: torch, Triton, or the C
kernels) and, for bf16 on a CPU, the C-kernel forward (`cpu_forward.py`, set by
`set_cpu_kernels`), which takes the same arithmetic into fused kernels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from workbench_kernels import hostmem

from .linear import Linear


def default_inv_freq(d: int, base: float) -> torch.Tensor:
    # float32 arithmetic as in the Hugging Face reference, so positions rotate identically.
    return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE variant."""
    d = config.head_dim
    base = config.rope_theta
    inv = default_inv_freq(d, base)
    scaling = dict(config.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    mscale = 1.0
    if kind in ("default", "dynamic", None):
        pass  # dynamic NTK only departs from default beyond max_position_embeddings, which we never reach
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "yarn":
        factor = scaling["factor"]
        old_len = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
        beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)

        def dim_for(rot):
            return (d * math.log(old_len / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo = max(math.floor(dim_for(beta_fast)), 0)
        hi = min(math.ceil(dim_for(beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = inv / factor * (1 - extrapolation) + inv * extrapolation
        mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0)
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, dynamic, llama3, yarn")
    return inv, mscale


class RotaryEmbedding:
    def __init__(self, config, max_positions: int, device, dtype, theta: float | None = None):
        """`theta`: another base without scaling (Gemma 3's sliding layers); None: the config's."""
        inv, mscale = rope_inv_freq(config) if theta is None else (default_inv_freq(config.head_dim, theta), 1.0)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Cast to the compute dtype up front, as the Hugging Face reference does per call.
        self.cos = (emb.cos() * mscale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * mscale).to(device=device, dtype=dtype)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    # Half-split (GPT-NeoX) layout, as in Hugging Face Llama checkpoints.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def offset_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: `scale` is (1 + w) in fp32, applied before the cast back (Llama casts first)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


class Norm:
    """An RMSNorm with its checkpoint weight: Llama's w, or Gemma's (1 + w) (`offset` 1)."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        self.weight, self.eps = weight, eps
        self.scale = weight.float() + offset if offset else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return rms_norm(x, self.weight, self.eps)
        return offset_rms_norm(x, self.scale, self.eps)


def merged_groups(config, weights: dict[str, torch.Tensor]) -> list[list[str]]:
    """The weights each layer multiplies as one matmul, in the order `merged` stacks them: Q/K/V (and
    their biases), gate/up, and an MoE layer's experts' gate/up pairs and downs."""
    groups = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        groups.append([p + f"self_attn.{n}_proj.weight" for n in "qkv"])
        if config.attention_bias:
            groups.append([p + f"self_attn.{n}_proj.bias" for n in "qkv"])
        if i not in config.moe_layers:
            groups.append([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            continue
        experts = [p + f"mlp.experts.{e}." for e in range(config.num_experts)]
        groups.append([e + f"{n}_proj.weight" for e in experts for n in ("gate", "up")])
        groups.append([e + "down_proj.weight" for e in experts])
    return [keys for keys in groups if all(k in weights for k in keys)]


def merged(weights: dict[str, torch.Tensor], keys: list[str], empty=None) -> torch.Tensor:
    """The tensors at `keys` stacked along their first dimension, as one tensor (a merged matmul's
    weights). The dict's entries become views of it, so each weight is held once: beside a merged
    copy the parts would keep Q/K/V and gate/up twice (Llama-3-8B: 9 GB). Parts that already lie
    back to back in one tensor (an earlier merge; `place_weights`'s, in huge pages) are taken as they
    lie. `empty(shape, dtype)` allocates the merged tensor (default: torch.empty on the parts' device)."""
    parts = [weights[k] for k in keys]
    first, rows = parts[0], sum(p.shape[0] for p in parts)
    shape, offset = (rows, *first.shape[1:]), first.storage_offset()
    adjacent = all(p.is_contiguous() and p.shape[1:] == first.shape[1:] and p.dtype == first.dtype for p in parts)
    for p in parts:
        adjacent = adjacent and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        adjacent = adjacent and p.storage_offset() == offset
        offset += p.numel()
    if adjacent:
        strides = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        return first.as_strided(shape, strides, first.storage_offset())
    whole = empty(shape, first.dtype) if empty else torch.empty(shape, dtype=first.dtype, device=first.device)
    torch.cat(parts, out=whole)
    row = 0
    for k, p in zip(keys, parts):
        weights[k] = whole[row : row + p.shape[0]]
        row += p.shape[0]
    return whole


def place_weights(config, weights: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A model's weights where it runs, those of each merged matmul (`merged_groups`) back to back in
    one tensor, the parts views of it: the model takes them as they lie, and holds each weight once.
    On a CPU all of them in huge pages (`hostmem`: the GEMVs stream them faster than from 4 KiB pages).
    The tensors are taken out of `weights` as they are placed (it ends empty): the loader's copy of
    each goes as its placed one comes, so the process never holds the model twice (Llama-3-8B's
    16 GB on a 23 GB host)."""
    on_cpu = torch.device(device).type == "cpu"
    order, placed = list(weights), {}
    for keys in merged_groups(config, weights):
        parts = {k: weights.pop(k).to(device) for k in keys}
        merged(parts, keys, empty=hostmem.ARENA.empty if on_cpu else None)
        placed.update(parts)
    for k in list(weights):
        v = weights.pop(k).to(device)
        placed[k] = hostmem.ARENA.copy(v) if on_cpu else v
    return {k: placed[k] for k in order}


class WeightsByName(Mapping):
    """A model's weights by checkpoint name, as `place_weights` returned them, those a layer holds in
    the tiles' layout (`Linear.hold_once`) read back as copies. Read under `LAYOUT_LOCK` where a
    re-layout may run on another thread (the engine's checksum)."""

    def __init__(self, weights: dict[str, torch.Tensor], model: Transformer):
        self._weights = weights
        self._held: dict[str, tuple[Linear, int]] = {}  # name -> (the layer whose bytes it views, first row)
        # each owning layer's bytes: (layer, first address, end, bytes a row, inputs)
        spans = [
            (lin, st.data_ptr(), st.data_ptr() + st.nbytes, st.stride(0) * st.element_size(), st.shape[1])
            for lin, st in ((lin, lin.storage) for lin in model.linears() if lin.own)
        ]
        for name, t in weights.items():
            for lin, start, end, row_bytes, k in spans:
                if t.dim() == 2 and t.shape[1] == k and start <= t.data_ptr() < end:
                    self._held[name] = (lin, (t.data_ptr() - start) // row_bytes)
                    break

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._weights[name]
        held = self._held.get(name)
        if held is not None and held[0].held_once:
            lin, row = held
            return lin.weight_rows(row, row + t.shape[0])
        return t

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __contains__(self, name) -> bool:  # without reading (a held tensor's read is a copy)
        return name in self._weights


class DecoderLayer:
    def __init__(self, config, weights: dict[str, torch.Tensor], i: int, own: bool = False):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv = merged(weights, [a + f"{n}_proj.weight" for n in "qkv"])
        bias = merged(weights, [a + f"{n}_proj.bias" for n in "qkv"]) if config.attention_bias else None
        self.qkv = Linear(qkv, bias, own)
        self.o = Linear(weights[a + "o_proj.weight"], own=own)
        self.moe = MoE(config, weights, p + "mlp.") if i in config.moe_layers else None
        if self.moe is None:
            self.gate_up = Linear(merged(weights, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]), own=own)
            self.down = Linear(weights[p + "mlp.down_proj.weight"], own=own)
        eps, off = config.rms_norm_eps, config.norm_offset
        self.ln1 = weights[p + "input_layernorm.weight"]
        self.ln2 = weights[p + "post_attention_layernorm.weight"]
        self.input_norm = Norm(self.ln1, eps, off)
        self.post_attn_norm = Norm(self.ln2, eps, off)
        # Gemma 3: the attention output is normed before the residual add (post_attention_layernorm),
        # and the MLP is wrapped the same way (pre/post_feedforward_layernorm)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_ff_norm = Norm(weights[p + "pre_feedforward_layernorm.weight"], eps, off)
            self.post_ff_norm = Norm(weights[p + "post_feedforward_layernorm.weight"], eps, off)
        self.gelu = config.activation == "gelu_tanh"
        # Qwen3/Gemma 3: RMSNorm over each head's query and key; OLMoE: over all heads at once (before RoPE)
        self.q_norm = weights.get(a + "q_norm.weight") if config.qk_norm else None
        self.k_norm = weights.get(a + "k_norm.weight") if config.qk_norm else None
        if self.q_norm is not None:
            self.q_normed, self.k_normed = Norm(self.q_norm, eps, off), Norm(self.k_norm, eps, off)
        self.qk_norm_per_head = config.qk_norm_per_head
        self.eps = eps
        self.nq, self.nkv, self.d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.index = i

    def linears(self) -> list[Linear]:
        if self.moe is not None:
            return [self.qkv, self.o, *self.moe.linears()]
        return [self.qkv, self.o, self.gate_up, self.down]

    def _qkv(self, h: torch.Tensor):
        """The normed input's queries, keys and values [T, H, D], their per-model norms applied."""
        qkv = self.qkv(h)
        q, k, v = qkv.split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_normed(q), self.k_normed(k)
        q = q.view(-1, self.nq, self.d)
        k = k.view(-1, self.nkv, self.d)
        v = v.view(-1, self.nkv, self.d)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_normed(q), self.k_normed(k)
        return q, k, v

    def __call__(self, x, positions, rope, attention, meta):
        q, k, v = self._qkv(self.input_norm(x))
        q, k = rope(positions, q, k)
        o = self.o(attention(q, k, v, self.index, meta).reshape(-1, self.nq * self.d))
        if self.sandwich:
            x = x + self.post_attn_norm(o)
            return x + self.post_ff_norm(self._mlp(self.pre_ff_norm(x)))
        x = x + o
        return x + self._mlp(self.post_attn_norm(x))

    def fused(self, x, residual, positions, rope, attention, meta, ops):
        """The layer in few kernel launches (`ops`: the Triton backend's `fused_layer` kernels),
        the same arithmetic as `__call__`: the residual stream rides beside x, added inside the
        next norm (vLLM's fused_add_rms_norm); RoPE rotates as it writes the KV cache. Returns
        (this layer's MLP output, the residual stream before it)."""
        h, residual = ops.rms_norm(x, self.ln1, self.eps, residual)
        q, k, v = self._qkv(h)
        k_cache, v_cache, k_scale, _ = attention.kv.layer(self.index)
        if k_scale is None:
            q = ops.rope_write_kv(q, k, v, rope.cos, rope.sin, positions, k_cache, v_cache, meta.slot_mapping)
            a = attention.attend(q, self.index, meta)
        else:  # a quantised cache: write_kv's per-head scales
            q, k = rope(positions, q, k)
            a = attention(q, k, v, self.index, meta)
        o = self.o(a.reshape(-1, self.nq * self.d))
        h, residual = ops.rms_norm(o, self.ln2, self.eps, residual)
        if self.moe is not None or self.gelu:
            return self._mlp(h), residual
        return self.down(ops.silu_mul(self.gate_up(h))), residual

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(h)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down(act * up)


class MoE:
    """A sparse mixture-of-experts MLP: a softmax router picks each token's top-k experts (their
    weights renormalised to sum to 1 where the checkpoint says so), and only those experts run,
    each on the tokens routed to it. `top_k` can be overridden live (`moe_top_k`); `_counts` holds
    how many tokens each expert received in the last forward."""

    def __init__(self, config, weights: dict[str, torch.Tensor], prefix: str):
        self.router = Linear(weights[prefix + "gate.weight"])
        n, inter = config.num_experts, config.moe_intermediate_size
        # The experts' weights stacked ([E, 2I, H] gate and up, [E, H, I] down) for the fused kernel;
        # each expert's Linear and the checkpoint's tensors are views into them (no second copy).
        experts = [prefix + f"experts.{e}." for e in range(n)]
        self.w13 = merged(weights, [e + f"{p}_proj.weight" for e in experts for p in ("gate", "up")])
        self.w13 = self.w13.view(n, 2 * inter, -1)
        self.w2 = merged(weights, [e + "down_proj.weight" for e in experts]).view(n, -1, inter)
        self.experts = [(Linear(self.w13[e]), Linear(self.w2[e])) for e in range(n)]
        self.default_top_k = config.num_experts_per_tok
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.fused = False  # the Triton fused-MoE kernel (the triton backend), while the experts are unquantised
        self._counts = torch.zeros(n, dtype=torch.int64)

    def linears(self) -> list[Linear]:
        """The experts' linears (quantised with the rest); the small router stays in full precision,
        since a quantised router would reroute tokens."""
        return [lin for pair in self.experts for lin in pair]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(h), dim=-1, dtype=torch.float32)
        weight, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        weight = weight.to(h.dtype)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts))
        self._counts = counts  # read once per step, for all layers (`Transformer.expert_counts`)
        if self.fused and all(lin.mode == "none" for pair in self.experts for lin in pair):
            from workbench_kernels.triton_ops import fused_moe

            return fused_moe(h.contiguous(), self.w13, self.w2, weight, chosen)
        out = torch.zeros_like(h)
        for e in torch.nonzero(counts).flatten().tolist():
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            gate_up, down = self.experts[e]
            g, u = gate_up(h[rows]).chunk(2, dim=-1)
            out.index_add_(0, rows, down(F.silu(g) * u) * weight[rows, slot, None])
        return out


class Transformer:
    """Weights plus forward; holds the original tensors so any quantisation can be undone. With
    `own_weights` (the engine's model, over weights `place_weights` laid out for it alone) the
    layers may hold theirs in the tiles' layout only (`Linear.hold_once`); read them by name
    through `WeightsByName`."""

    def __init__(
        self,
        config,
        weights: dict[str, torch.Tensor],
        device,
        max_positions: int,
        own_weights=False,
        memory=None,
        on_layer=None,
    ):
        self.config = config
        self.own_weights = own_weights
        self.embed = weights["model.embed_tokens.weight"]
        self.layers = []
        for i in range(config.num_hidden_layers):
            self.layers.append(DecoderLayer(config, weights, i, own_weights))
            if on_layer is not None:  # done with each layer before the next is read (a self-int4 draft's codes)
                on_layer(self.layers[-1])
        self.moe_layers = [layer.moe for layer in self.layers if layer.moe is not None]  # read every step
        self.norm = weights["model.norm.weight"]
        self.final_norm = Norm(self.norm, config.rms_norm_eps, config.norm_offset)
        head = weights.get("lm_head.weight", self.embed) if not config.tie_word_embeddings else self.embed
        # the engine's own head may hold its weights in the tiles' layout, a tied embedding's too:
        # the embedding is then looked up there (`embed_tokens`)
        self.lm_head = Linear(head, own=own_weights)
        self._embed_head = self.lm_head if head is self.embed else None
        for lin in self.linears():
            lin.memory = memory  # asked before any copy of the weights (`models.host_memory`)
        self.rope = RotaryEmbedding(config, max_positions, device, self.embed.dtype)
        # a window at least as long as the context never binds: that layer attends globally
        self.windows = [w if 0 < w < max_positions else 0 for w in (config.layer_windows or [0] * len(self.layers))]
        local = config.rope_local_theta
        self.ropes = [self.rope] * len(self.layers)
        if local is not None:  # Gemma 3: sliding layers rotate with their own base
            rope_local = RotaryEmbedding(config, max_positions, device, self.embed.dtype, theta=local)
            self.ropes = [rope_local if w else self.rope for w in (config.layer_windows or [])]
        # Gemma 3 scales the embeddings by sqrt(hidden_size), rounded to the model's dtype as its reference does
        self.embed_scale = (
            None
            if config.embed_scale is None
            else torch.tensor(config.embed_scale, dtype=self.embed.dtype, device=self.embed.device)
        )
        self.softcap = config.final_logit_softcapping
        self.cpu_forward = None  # a CpuKernelForward while fused C layers serve this model
        self.fused_ops = None  # the Triton fused layer ops while they serve (`set_triton_kernels`)
        self.fused_layers_reason: str | None = "not set up yet"  # why they do not (None: they do)
        self._why_not: str | None = "not set up yet"  # why no C kernel serves (None: they do)
        self._unfused: str | None = None  # why the layers are not fused, when the C kernels serve

    @property
    def cpu_kernels(self) -> bool:
        return self._why_not is None

    def set_cpu_kernels(self, on: bool) -> bool:
        """Use the C kernels where they apply (bf16 on a CPU that has a variant): the linears on our
        GEMVs, attention on our kernels, and whole layers fused where the architecture allows;
        returns whether they serve."""
        from .cpu_forward import CpuKernelForward, why_not, why_not_fused

        self._why_not = why_not(self, on)
        self._unfused = why_not_fused(self) if self._why_not is None else None
        fused = self._why_not is None and self._unfused is None
        self.cpu_forward = CpuKernelForward(self) if fused else None
        CpuKernelForward.bind_linears(self, self._why_not is None)
        if self.own_weights:
            self.pack_tiles()
        return self.cpu_kernels

    def kernel_report(self) -> dict:
        """Which kernels serve and why: `kernel_variant` (the C kernels' instruction set, "torch",
        or "cuda") and the dtype that large steps multiply in."""
        dt = str(self.embed.dtype).removeprefix("torch.")
        if self.embed.device.type == "cuda":
            return {
                "kernel_variant": "cuda",
                "kernel_variant_reason": "a CUDA device: torch and our Triton kernels",
                "compute_path": dt,
                "compute_path_reason": "torch's CUDA kernels in the model's dtype",
            }
        if self._why_not is not None:
            return {
                "kernel_variant": "torch",
                "kernel_variant_reason": self._why_not,
                "compute_path": dt,
                "compute_path_reason": "torch's ops in the model's dtype",
            }
        from .cpu_forward import CpuKernelForward

        held = any(lin.held_once for layer in self.layers for lin in layer.linears())
        return CpuKernelForward.report(self._unfused, held, self.copies_skipped())

    def linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head]

    def originals(self) -> dict[int, int]:
        """Address -> bytes of the original tensors the model multiplies by (linears, embedding)."""
        tensors = [t for lin in self.linears() for t in (lin.storage, lin.bias) if t is not None] + [self.embed]
        return {t.data_ptr(): t.nbytes for t in tensors}

    def memory_bytes(self, shared: dict[int, int] | None = None) -> dict[str, int]:
        """Bytes held: "weights" (the originals, less those `shared` with another model: a draft's
        own only) and each kind of copy the linears made (`Linear.copies_bytes`)."""
        out = {"weights": sum(n for at, n in self.originals().items() if at not in (shared or {}))}
        for lin in self.linears():
            for kind, n in lin.copies_bytes().items():
                out[kind] = out.get(kind, 0) + n
        return out

    def copies_skipped(self) -> dict[str, int]:
        """Copy kind -> layers serving without that copy of their weights, for want of memory."""
        out: dict[str, int] = {}
        for lin in self.linears():
            for kind in lin.skipped:
                out[kind] = out.get(kind, 0) + 1
        return out

    def set_moe_top_k(self, top_k: int | None) -> None:
        """Experts per token on every MoE layer (None: the checkpoint's)."""
        for moe in self.moe_layers:
            moe.top_k = moe.default_top_k if top_k is None else top_k

    def expert_counts(self) -> list[list[int]]:
        """Tokens each expert received in the last forward, per MoE layer (empty: a dense model);
        one device-to-host copy for all layers."""
        if not self.moe_layers:
            return []
        return torch.stack([moe._counts.to(self.embed.device) for moe in self.moe_layers]).tolist()

    def set_triton_kernels(self, on: bool) -> None:
        """The Triton backend's kernels beyond attention (on) or torch's ops: the fused-MoE
        experts, and the fused layer ops (residual add + RMSNorm, RoPE + KV write, SiLU x up)
        where the architecture's norms allow (`fused_layers_reason`)."""
        for moe in self.moe_layers:
            moe.fused = on
        c = self.config
        why = None
        if not on:
            why = "the attention backend is not 'triton'"
        elif c.norm_offset or c.sandwich_norms:
            why = "Gemma's (1 + w) and sandwich norms run as torch ops"
        self.fused_layers_reason = why
        self.fused_ops = None
        if why is None:
            from workbench_kernels import triton_ops

            self.fused_ops = triton_ops

    def mode_of(self, lin: Linear, mode: str) -> str:
        """The mode `lin` takes when the model is quantised to `mode`: the output head (often the tied
        embedding) is the most sensitive matrix, 4 bits there cost several points of perplexity, so
        it stays at 8."""
        return "int8" if mode == "int4" and lin is self.lm_head else mode

    def quantize(self, mode: str, group_size: int | str) -> None:
        if group_size == "auto":
            group_size = self.config.source_quant_block or 128
        for lin in self.linears():
            lin.quantize(self.mode_of(lin, mode), group_size)
        self.pack_tiles()

    def pack_tiles(self) -> None:
        """The layers' weights packed for the tiles now, where large steps take them: not at the
        first prompt, whose TTFT that was (0.4 s of Llama-3.2-1B's shape); laid out as the tiles
        in place where a layer may hold them once (`Linear.hold_once`), the output head's too.
        Elsewhere the head's copy waits for a step of many sequences, which it alone serves."""
        for layer in self.layers:
            for lin in layer.linears():
                if not lin.hold_once():
                    lin.fused_tiles()
        self.lm_head.hold_once()

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings: from a tied output head's tiles where it holds them."""
        head = self._embed_head
        if head is not None and head.held_once:
            return head.rows(input_ids.reshape(-1)).view(*input_ids.shape, -1)
        return F.embedding(input_ids, self.embed)

    def share_embedding(self, other: Transformer) -> None:
        """Look the embeddings up in `other`'s (a self-int4 draft in its target's: the draft's copy
        goes); the output head keeps its own."""
        self.embed, self._embed_head = other.embed, other._embed_head

    def hidden_states(self, input_ids, positions, attention, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.cpu_forward is not None and attention.kv.k_scale is None:  # quantised KV: torch ops
            return self.cpu_forward(x, positions, attention, meta)
        ops = self.fused_ops
        if ops is not None:
            residual = None
            for layer, rope in zip(self.layers, self.ropes):
                x, residual = layer.fused(x, residual, positions, rope, attention, meta, ops)
            return ops.rms_norm(x, self.norm, self.config.rms_norm_eps, residual)[0]
        for layer, rope in zip(self.layers, self.ropes):
            x = layer(x, positions, rope, attention, meta)
        return self.final_norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
