"""Turns a scheduled batch into one flat forward pass over the paged cache, and returns logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.llama import Transformer
from . import cuda_graphs
from .attention import AttnMetadata, KVCache, make_backend, pad_tables
from .device import Marks, to_device
from .inflight import InFlight, fill_inputs
from .scheduler import ScheduledSeq


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [rows, vocab] float32: one row per sampled position
    rows: dict[int, tuple[int, int]]  # index into the scheduled list -> (first row, count)
    marks: Marks  # the step's parts so far ("prepare", "layers", "lm_head"), read when its work is done
    # prefill chunks of requests asking for prompt log-probabilities: index -> (first row, count),
    # one row per position of the chunk (after the sampled rows)
    prompt_rows: dict[int, tuple[int, int]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        config,
        weights,
        *,
        device,
        dtype,
        block_size,
        num_blocks,
        kv_cache_dtype,
        attention_backend,
        max_model_len,
        cpu_kernels=True,
        prefill_attention="auto",
        own_weights=False,
        memory=None,
        on_layer=None,
    ):
        self.config = config
        self.device, self.dtype = device, dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model = Transformer(config, weights, device, max_model_len, own_weights, memory, on_layer)
        self.kv = self._new_cache(kv_cache_dtype)
        if memory is not None:  # counted before the kernels' copies ask it for room
            memory.add(self)
        self.backend_name = attention_backend
        self.max_blocks = -(-max_model_len // block_size)  # a sequence's longest block table
        self.max_model_len = max_model_len
        self.prefill_attention = prefill_attention
        self.graph_buckets: list[int] = []  # CUDA graphs' batch sizes; empty: off
        self._graphs = None  # their GraphRunner, captured at the first decode step that fits
        self.graph_steps = {"replayed": 0, "eager": 0}
        self.graph_reason: str | None = "cuda_graphs is off"  # why the last step ran eagerly
        self.set_cpu_kernels(cpu_kernels)

    def _new_cache(self, kv_cache_dtype: str) -> KVCache:
        c = self.config
        return KVCache(
            c.num_hidden_layers,
            self.num_blocks,
            self.block_size,
            c.num_key_value_heads,
            c.head_dim,
            self.dtype,
            kv_cache_dtype,
            self.device,
        )

    def set_backend(self, name: str) -> None:
        self.backend = make_backend(
            name,
            self.device,
            self.model.cpu_kernels,
            self.kv,
            self.config.head_dim,
            scale=self.config.attention_scale,
            windows=self.model.windows,
        )
        self.backend_name = name
        self.model.set_triton_kernels(self.backend.name == "triton")
        self.drop_graphs()
        self.set_prefill_attention(self.prefill_attention)

    def set_prefill_attention(self, setting: str) -> None:
        """Which path serves prompts: our attention kernel or SDPA (measured at auto; the backend says which)."""
        self.prefill_attention = setting
        self.backend.choose_prefill(setting, self.config.num_attention_heads, self.max_model_len)

    def set_cuda_graphs(self, on: bool, max_num_seqs: int) -> None:
        """Replay decode steps as CUDA graphs, one per batch-size bucket up to `max_num_seqs`."""
        self.graph_buckets = cuda_graphs.buckets_for(max_num_seqs) if on else []
        self.graph_reason = None if on else "cuda_graphs is off"
        self.drop_graphs()

    def drop_graphs(self) -> None:
        """Forget the captured graphs: they hold the old weights', cache's or kernels' addresses
        (re-captured at the next decode step that fits)."""
        self._graphs = None

    def memory_bytes(self, shared: dict[int, int] | None = None) -> dict[str, int]:
        """The model's bytes (`Transformer.memory_bytes`) and its KV cache's."""
        return {**self.model.memory_bytes(shared), "kv_cache": self.kv.nbytes}

    def graph_report(self) -> dict:
        """status()'s CUDA-graph fields: the buckets, the steps replayed and run eagerly, and why
        the last step ran eagerly (None: it replayed)."""
        return {
            "cuda_graph_buckets": list(self.graph_buckets),
            "cuda_graph_steps": dict(self.graph_steps),
            "cuda_graph_reason": self.graph_reason,
            "cuda_graph_splits": {str(b): n for b, n in self._graphs.splits.items()} if self._graphs else {},
        }

    def set_cpu_kernels(self, on: bool) -> None:
        self.model.set_cpu_kernels(on)
        self.set_backend(self.backend_name)

    def set_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """Re-lay out the cache; callers recompute every sequence's context afterwards."""
        self.drop_graphs()
        self.kv = None
        self.backend.kv = None
        self.kv = self._new_cache(kv_cache_dtype)
        self.backend.kv = self.kv
        self.set_prefill_attention(self.prefill_attention)  # SDPA reads 16-bit caches only

    def _graph_plan(self, scheduled: list[ScheduledSeq], all_logits: bool) -> cuda_graphs.Plan:
        if not self.graph_buckets:
            return cuda_graphs.Plan(None, "cuda_graphs is off")
        why = cuda_graphs.unsupported(self.device, self.backend.name, bool(self.config.moe_layers))
        if why is not None or all_logits or self.kv.k_scale is not None:
            return cuda_graphs.Plan(
                None, why or ("every position's logits (scoring)" if all_logits else "a quantised KV cache")
            )
        width = max(len(s.seq.block_table) for s in scheduled)
        return cuda_graphs.plan([s.kind for s in scheduled], width, self.graph_buckets, self.max_blocks)

    def _replay(self, scheduled: list[ScheduledSeq], bucket: int, marks: Marks, fill: InFlight | None):
        bs = self.block_size
        ids, pos, slots, tables, fills = [], [], [], [], []
        for i, s in enumerate(scheduled):
            seq = s.seq
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            if fill is not None and (hit := fill.fills(seq, p, 1)) is not None:
                fills.append((i, hit[1]))
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            tables.append(seq.block_table)
        step = cuda_graphs.pad_decode(ids, pos, slots, tables, bucket, self.max_blocks)
        if self._graphs is None:
            self._graphs = cuda_graphs.GraphRunner(self, self.graph_buckets, self.max_blocks)
        marks.host("prepare")
        source = fill.tokens if fill is not None else None
        logits = self._graphs.run(step, bucket, lambda input_ids: fill_inputs(input_ids, fills, source))
        marks.device("layers")  # one replay runs the layers and the LM head: its time is the layers' part
        self.graph_steps["replayed"] += 1
        return ForwardResult(logits, {i: (i, 1) for i in range(len(scheduled))}, marks)

    @torch.inference_mode()
    def forward(
        self,
        scheduled: list[ScheduledSeq],
        all_logits: bool = False,
        marks: Marks | None = None,
        fill: InFlight | None = None,
    ) -> ForwardResult:
        """`marks`: the step's, to time its parts on (a fresh one: from here); `fill`: the step in
        flight, whose tokens on the device some of these sequences read (async scheduling)."""
        marks = marks or Marks(self.device)
        plan = self._graph_plan(scheduled, all_logits)
        if plan.bucket is not None:
            self.graph_reason = None
            return self._replay(scheduled, plan.bucket, marks, fill)
        if self.graph_buckets:
            self.graph_steps["eager"] += 1
            self.graph_reason = plan.reason
        # One-token decodes first: they take the batched decode path.
        order = sorted(range(len(scheduled)), key=lambda i: scheduled[i].kind != "decode")
        bs = self.block_size
        ids, pos, slots = [], [], []
        dec_tables, dec_lens, ext_tables, ext_lens, ext_cu = [], [], [], [], [0]
        tables: list[tuple[list[int], int]] = []  # (block table, tokens) in token order
        sample_at: list[tuple[int, int, int]] = []  # (scheduled index, first flat index, count)
        scored_at: list[tuple[int, int, int]] = []  # the same, for prompt log-probabilities
        fills: list[tuple[int, int]] = []  # (flat index, row of the step in flight's tokens)
        num_decode = 0
        for i in order:
            s = scheduled[i]
            seq, n = s.seq, s.num_tokens
            start = seq.num_computed_tokens
            tokens = (seq.token_ids + seq.spec_tokens if seq.spec_tokens else seq.token_ids)[start : start + n]
            flat = len(ids)
            if fill is not None and (hit := fill.fills(seq, start, n)) is not None:
                fills.append((flat + hit[0], hit[1]))
            ids.extend(tokens)
            positions = range(start, start + n)
            pos.extend(positions)
            table = seq.block_table
            tables.append((table, n))
            slots.extend(table[p // bs] * bs + p % bs for p in positions)
            if s.kind == "decode":
                num_decode += 1
                dec_tables.append(table)
                dec_lens.append(start + n)
            else:
                ext_tables.append(table)
                ext_lens.append(start + n)
                ext_cu.append(ext_cu[-1] + n)
            if all_logits:
                sample_at.append((i, flat, n))
                continue
            if s.kind == "prefill" and seq.params.prompt_logprobs is not None:
                scored_at.append((i, flat, n))
            if s.samples:
                count = 1 + len(seq.spec_tokens) if s.kind == "verify" else 1
                sample_at.append((i, flat + n - count, count))
        dev = self.device
        i32 = torch.int32
        meta = AttnMetadata(
            slot_mapping=to_device(slots, torch.int64, dev),
            num_decode=num_decode,
            decode_block_tables=pad_tables(dec_tables, dev) if dec_tables else None,
            decode_seq_lens=to_device(dec_lens, i32, dev) if dec_lens else None,
            ext_cu_seqlens_q=to_device(ext_cu, i32, dev) if ext_tables else None,
            ext_seq_lens=to_device(ext_lens, i32, dev) if ext_tables else None,
            ext_block_tables=pad_tables(ext_tables, dev) if ext_tables else None,
        )
        self.backend.prepare(meta, tables, pos)
        input_ids = to_device(ids, torch.int64, dev)
        positions = to_device(pos, torch.int64, dev)
        fill_inputs(input_ids, fills, fill.tokens if fill is not None else None)
        marks.host("prepare")
        hidden = self.model.hidden_states(input_ids, positions, self.backend, meta)
        marks.device("layers")
        index, rows, r = [], {}, 0
        prompt_rows: dict[int, tuple[int, int]] = {}
        for at, into in ((sample_at, rows), (scored_at, prompt_rows)):
            for i, flat, count in at:
                index.extend(range(flat, flat + count))
                into[i] = (r, count)
                r += count
        if not index:
            return ForwardResult(torch.empty(0, self.config.vocab_size), rows, marks)
        logits = self.model.logits(hidden[to_device(index, torch.int64, dev)])
        marks.device("lm_head")
        return ForwardResult(logits, rows, marks, prompt_rows)


def memory_mb(runner: ModelRunner, draft=None) -> dict[str, float]:
    """status()'s memory_mb, in MiB on the model's device: the weights, each copy of them the
    kernels made (tiles, onednn, quantized, dequantized, fp32), the KV cache, and a speculative
    draft's whole (its own weights, copies and cache). Parts of none are left out."""
    parts = runner.memory_bytes()
    if draft is not None:
        parts["draft"] = sum(draft.runner.memory_bytes(runner.model.originals()).values())
    return {k: round(v / 2**20, 1) for k, v in parts.items() if v}
