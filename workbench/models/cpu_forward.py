"""The CPU fast path: everything the engine does on our C kernels (bf16 on a CPU;
`workbench_kernels/cpu_kernels.c`), owned by `CpuKernelForward`: binding the linears to them, the
attention ops and the per-token metadata they read, the forward itself, the report of what serves
and why, and the matmul rate the roofline and the simulator's CPU profile read. Apart from the
linear layer's own weights (`linear.py`), nothing else in the engine calls the C kernels.

The forward is the same arithmetic as `llama.py`'s torch layers, in fewer and fused calls: the residual add goes
into the next RMSNorm, RoPE into the KV-cache write and SiLU into the up projection's product,
keeping torch's bf16 rounding points. Three shapes, fastest first:

- the whole stack in one C call (`DecodeStack`), when every layer has its one-call kernel;
- each layer in one call (`DecodeLayer`): a step of at most `cpu.MAX_ROWS` tokens on the CPU
  attention backend (`cpu.FUSED_MAX_ROWS` where every linear has its bf16 tiles), every token
  attending as a one-query decode (the backend's metadata);
- op by op (`_layer`): longer steps, or layers whose linears have no GEMV kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from workbench_kernels import cpu, reference


@dataclass
class TokenQueries:
    """A small step described for the one-call layer kernel: each token attends as a one-query
    decode of its own, over its sequence's block table up to its causal length (position + 1)."""

    block_tables: torch.Tensor  # [T, max blocks] int32, zero-padded
    seq_lens: torch.Tensor  # [T] int32


def why_not(model, on: bool) -> str | None:
    """Why the C kernels cannot serve `model` at all (None: its linears run on our GEMVs and its
    attention on our attention kernels; `why_not_fused` says whether whole layers can too)."""
    c = model.config
    dev, dt = model.embed.device, model.embed.dtype
    if not on:
        return "cpu_kernels is off: torch's ops only"
    if dev.type != "cpu":
        return f"the C kernels serve CPUs; this model is on {dev}"
    if dt != torch.bfloat16:
        return f"the C kernels serve bf16 models; this one runs in {str(dt).removeprefix('torch.')}"
    if not cpu.available():
        return f"no C kernels: {cpu.unavailable_reason()}"
    if not cpu.supports_decode(c.head_dim, c.num_attention_heads, c.num_key_value_heads):
        return (
            f"the C kernels take head_dim % 16 == 0 (<= 256) and <= 16 query heads per KV head; "
            f"this model has head_dim {c.head_dim}, {c.num_attention_heads}/{c.num_key_value_heads} heads"
        )
    return None


def why_not_fused(model) -> str | None:
    """Why the fused C layer (and stack) does not apply; the layer is then composed in torch ops
    around our GEMV and attention kernels (each selected expert's GEMV, on MoE models)."""
    c = model.config
    if c.moe_layers:
        return "mixture-of-experts layers: each chosen expert runs on our GEMVs, the routing in torch's ops"
    if c.sandwich_norms or c.norm_offset or c.activation != "silu":
        return (
            f"{c.architecture}'s (1 + w) norms around attention and the MLP and its GELU-tanh MLP are "
            "composed in torch's ops around our GEMVs"
        )
    if c.qk_norm:
        return "the per-head q/k norm of this architecture (Qwen3) is applied in torch's ops around our GEMVs"
    if any(model.windows):
        return "sliding-window layers: composed in torch's ops (attention: the windowed reference)"
    return None


class CpuKernelForward:
    """The fast path of one model (its forward), and the path's choices for the whole engine
    (static: binding, attention ops, metadata, report, matmul rate)."""

    def __init__(self, model):
        self.model = model
        self._layers: dict[int, tuple[tuple, cpu.DecodeLayer]] = {}  # index -> (the GEMVs it binds, the layer)
        self._stack: tuple[tuple, cpu.DecodeStack] | None = None  # (what it binds, the stack)

    @staticmethod
    def bind_linears(model, on: bool) -> None:
        """Route the linears through the C GEMVs and large steps through the path measured fastest
        here (`cpu.gemm_path`: our bf16 tiles, or oneDNN in bf16 or fp32), or all back to torch."""
        path = cpu.gemm_path()[0] if on else None
        for lin in model.linears():
            lin.bind(on, path == "fp32", path == "tiles")

    @staticmethod
    def report(unfused: str | None = None, held_once: bool = False, skipped: dict[str, int] | None = None) -> dict:
        """`held_once`: the layers keep their weights in the tiles' layout alone (`Linear.hold_once`);
        `skipped`: copy kind -> layers serving without it for want of memory (`Linear.skipped`)."""
        path, why, _ = cpu.gemm_path()
        if held_once:
            on, held_why = cpu.tiles_hold_weights()
            held_why = held_why if on else "where a copy for the tiles did not fit in memory"
            why += f"; the layers' bf16 weights held once, in the tiles' layout ({held_why})"
        if skipped:
            copies = ", ".join(f"{kind} ({n} layers)" for kind, n in sorted(skipped.items()))
            why += f"; copies of the weights not made for want of memory (status()['host_memory']): {copies}"
        width, width_why, _ = cpu.gemv_width()
        reason = cpu.variant_reason() + (f"; bf16 GEMVs in {width} registers ({width_why})" if width else "")
        reason += f"; layers not fused: {unfused}" if unfused else ""
        return {
            "kernel_variant": cpu.variant(),
            "kernel_variant_reason": reason,
            "compute_path": path,
            "compute_path_reason": why,
        }

    @staticmethod
    def cpu_flags() -> set[str]:
        """This CPU's feature flags, as the kernels' variant choice reads them."""
        return cpu.cpu_flags()

    @staticmethod
    def prefill_on_amx(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether our prefill attention kernel multiplies on AMX at these heads (bf16 reads)."""
        return cpu.available() and cpu.extend_on_amx(num_heads, num_kv_heads, head_dim)

    @staticmethod
    def attention_ops() -> SimpleNamespace:
        """The attention backend's three ops on our C kernels. They have no sliding window: such
        layers take the torch reference."""

        def extend(*args, window=0):
            return reference.extend_attention_ref(*args, window=window) if window else cpu.extend_attention(*args)

        def decode(*args, window=0):
            return reference.decode_attention_ref(*args, window=window) if window else cpu.decode_attention(*args)

        return SimpleNamespace(write_kv=reference.write_kv_ref, extend_attention=extend, decode_attention=decode)

    @staticmethod
    def token_queries(
        tables: list[tuple[list[int], int]], positions: list[int], device: torch.device
    ) -> TokenQueries | None:
        """The step's tokens as one-query decodes (`tables`: each scheduled sequence's block table
        and token count, in token order), when the one-call layer can take that many rows."""
        if len(positions) > cpu.fused_max_rows():
            return None
        width = max(len(t) for t, _ in tables)
        rows = [t + [0] * (width - len(t)) for t, n in tables for _ in range(n)]
        return TokenQueries(
            block_tables=torch.tensor(rows, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device),
        )

    @staticmethod
    def gemm_rate(m: int, k: int, n: int, budget_s: float = 0.25, dtype: torch.dtype | None = torch.bfloat16) -> float:
        """GFLOP/s of an m x k x n linear as the engine runs it on this CPU (oneDNN's packed layout
        in bf16 or fp32, our tiles in bf16), the best of them in `dtype` (None: in any, as the
        engine's `gemm_path` picks) (RuntimeError: no C kernels here)."""
        return cpu.engine_gemm_rate(m, k, n, budget_s=budget_s, dtype=dtype)

    def __call__(self, x, positions, attention, meta) -> torch.Tensor:
        m = self.model
        eps = m.config.rms_norm_eps
        step = self._step(positions, attention, meta)
        stack = self._decode_stack(attention.kv, step.t) if step is not None else None
        if stack is not None:
            return cpu.add_rms_norm(x, stack(step, x, None), m.norm, eps)
        delta = None
        for layer in m.layers:
            one_call = self._one_call(layer, step.t) if step is not None else None
            if one_call is not None:
                k_cache, v_cache, _, _ = attention.kv.layer(layer.index)
                delta = one_call(step, x, delta, k_cache, v_cache)
            else:
                delta = self._layer(layer, x, delta, positions, attention, meta)
        return cpu.add_rms_norm(x, delta, m.norm, eps)

    def _layer(self, layer, x, delta, positions, attention, meta):
        """One layer op by op. The residual stream `x` is updated in place and this layer's MLP
        output comes back as the next `delta`, for the next norm to add."""
        rope = self.model.rope
        h = cpu.add_rms_norm(x, delta, layer.ln1, layer.eps)
        k_cache, v_cache, _, _ = attention.kv.layer(layer.index)
        q = cpu.rope_write_kv(
            layer.qkv(h), positions, rope.cos, rope.sin, meta.slot_mapping, k_cache, v_cache, layer.nq
        )
        o = attention.attend(q, layer.index, meta)
        h = cpu.add_rms_norm(x, layer.o(o.view(-1, layer.nq * layer.d)), layer.ln2, layer.eps)
        return layer.down(cpu.silu_mul(layer.gate_up(h)))

    def _one_call(self, layer, rows: int) -> cpu.DecodeLayer | None:
        """The layer bound to the one-call kernel, if every matmul has a GEMV kernel (and, for more
        than MAX_ROWS rows, its tiles); bound again whenever a re-layout (quantisation) gave the
        linears new kernels."""
        linears = layer.linears()
        kernels = tuple(lin.gemv for lin in linears) + tuple(lin.fused_tiles() for lin in linears)
        if any(g is None for g in kernels[:4]):
            return None
        bound = self._layers.get(layer.index)
        if bound is None or any(a is not b for a, b in zip(bound[0], kernels)):
            one_call = cpu.DecodeLayer(*kernels[:4], layer.ln1, layer.ln2, layer.eps, tiles=kernels[4:])
            bound = self._layers[layer.index] = (kernels, one_call)
        return bound[1] if rows <= bound[1].max_rows else None

    def _decode_stack(self, kv, rows: int) -> cpu.DecodeStack | None:
        """Every layer in one C call, when every layer has its one-call kernel; rebuilt when a
        layer's kernel or the cache changes (re-layouts)."""
        one_calls = [self._one_call(layer, rows) for layer in self.model.layers]
        if any(f is None for f in one_calls):
            return None
        key = (tuple(map(id, one_calls)), tuple(map(id, kv.k)), tuple(map(id, kv.v)))
        if self._stack is None or self._stack[0] != key:
            self._stack = (key, cpu.DecodeStack(one_calls, kv.k, kv.v))
        return self._stack[1]

    def _step(self, positions, attention, meta) -> cpu.DecodeStep | None:
        """The shared state of the one-call layer kernel, when the attention backend described each
        token as a one-query decode (small steps on the CPU backend); None: op by op."""
        tokens = meta.cpu_tokens
        if tokens is None:
            return None
        c, rope = self.model.config, self.model.rope
        return cpu.DecodeStep(
            hidden=c.hidden_size,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            intermediate=c.intermediate_size,
            block_size=attention.kv.k[0].shape[1],
            positions=positions,
            slot_mapping=meta.slot_mapping,
            block_tables=tokens.block_tables,
            seq_lens=tokens.seq_lens,
            cos=rope.cos,
            sin=rope.sin,
            scale=attention.scale,
        )
