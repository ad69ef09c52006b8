"""Decode steps replayed as CUDA graphs (the `cuda_graphs` setting).

At a token per sequence a decode step is hundreds of small kernel launches, and on a GPU their
launch cost is most of the step. A CUDA graph records one step's launches once and replays them
with one call. Graphs are captured per batch-size bucket (`BUCKETS`, up to `max_num_seqs`); a
step of n sequences replays the smallest bucket >= n, its inputs padded: padded rows write no KV
(slot -1, which every write_kv skips), read one position of block 0 and their logits are
dropped. A step that does not fit runs eagerly, and `plan()` says why: prefill or verify
tokens, more sequences than the largest bucket, a context longer than the captured block
tables, or a model or backend the graphs cannot hold (MoE routing sizes its kernels per step;
only the Triton backend takes a fixed split count instead of reading the lengths on the host).

Everything but the capture and replay is plain tensor work, tested on a CPU; `GraphRunner`
needs CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def buckets_for(max_num_seqs: int) -> list[int]:
    """The batch sizes captured for an engine of `max_num_seqs`: the standard sizes below it, and it."""
    return [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds n sequences (None: none does)."""
    return next((b for b in buckets if b >= n), None)


def unsupported(device: torch.device, backend: str, moe: bool) -> str | None:
    """Why graphs cannot serve this engine at all (None: they can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; this engine runs on {device}"
    if backend != "triton":
        return f"the {backend} attention backend reads the batch's lengths on the host; graphs need triton"
    if moe:
        return "mixture-of-experts routing sizes its kernels per step"
    return None


@dataclass
class Plan:
    """How one step runs: `bucket` (replayed at that size) or None, with `reason` (eagerly)."""

    bucket: int | None
    reason: str | None = None


def plan(kinds: list[str], table_width: int, buckets: list[int], max_blocks: int) -> Plan:
    """The decision for a step: its scheduled kinds, the widest block table among them."""
    if any(k != "decode" for k in kinds):
        return Plan(None, "the step has prefill or verify tokens")
    bucket = bucket_for(len(kinds), buckets)
    if bucket is None:
        return Plan(None, f"{len(kinds)} sequences: more than the largest bucket ({buckets[-1]})")
    if table_width > max_blocks:
        return Plan(None, f"a context of {table_width} blocks: longer than the captured {max_blocks}")
    return Plan(bucket)


def graph_splits(ops, bucket: int, num_kv_heads: int, head_dim: int, max_context: int, dtype, num_sms: int) -> int:
    """The split-KV count a bucket's graph is captured with (a graph cannot choose per step): the
    Triton kernel's own choice for the longest context the graph serves. Each sequence's actual
    length is cut into that many chunks on the device, so a short context leaves later splits
    empty (they weigh nothing in the merge); a long one at a small batch keeps the GPU's SMs busy,
    where one program per KV head (no split) used a few of them (1 x 32k on 8 KV heads: 8 programs
    on an H100's 132 SMs)."""
    block_n = ops.decode_config(head_dim, dtype, dtype)["block_n"]
    return ops.pick_num_splits(bucket, num_kv_heads, max_context, block_n, num_sms)


@dataclass
class DecodeInputs:
    """A decode step's inputs, padded to a bucket (rows past `n` are padding)."""

    input_ids: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    slot_mapping: torch.Tensor  # [bucket] int64, -1 for padding
    block_tables: torch.Tensor  # [bucket, widest table] int32: the graph's columns past it are never read
    seq_lens: torch.Tensor  # [bucket] int32, 1 for padding
    n: int


def pad_decode(
    ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], bucket: int, max_blocks: int
) -> DecodeInputs:
    """The host-side tensors of a decode step of len(ids) sequences, padded to `bucket` rows; the
    block table as wide as the widest one (a graph's table is `max_blocks` wide, but a sequence's
    attention reads only its own blocks: the columns past the widest are never read, and building
    all of them cost ~7 ms a step at 256 sequences of an 8,192-token model)."""
    n = len(ids)
    width = max(map(len, tables), default=1)
    if n > bucket or width > max_blocks:
        raise ValueError(f"{n} sequences (widest table {width}) do not fit bucket {bucket} x {max_blocks} blocks")
    pad = bucket - n
    rows = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad
    table = torch.tensor(rows, dtype=torch.int32)  # one tensor from lists: a row at a time cost ~2 us each
    return DecodeInputs(
        input_ids=torch.tensor(ids + [0] * pad, dtype=torch.int64),
        positions=torch.tensor(positions + [0] * pad, dtype=torch.int64),
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        block_tables=table,
        seq_lens=torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32),
        n=n,
    )


class GraphRunner:
    """The captured graphs of one `ModelRunner` (CUDA only): `run(inputs)` replays the bucket's
    graph on the padded inputs and returns the logits of the real rows."""

    def __init__(self, runner, buckets: list[int], max_blocks: int):
        from .attention import AttnMetadata

        self.runner, self.buckets, self.max_blocks = runner, buckets, max_blocks
        self.graphs: dict[int, tuple] = {}
        self.splits: dict[int, int] = {}  # each bucket's split-KV count (graph_splits)
        dev = runner.device
        cfg, ops = runner.config, runner.backend.ops
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        pool = None
        for b in sorted(buckets, reverse=True):  # the largest first: the smaller ones fit in its pool
            context = max_blocks * runner.block_size
            self.splits[b] = graph_splits(ops, b, cfg.num_key_value_heads, cfg.head_dim, context, runner.dtype, sms)
            static = pad_decode([0] * b, [0] * b, [-1] * b, [[0] * max_blocks] * b, b, max_blocks)
            inputs = {
                k: getattr(static, k).to(dev)
                for k in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens")
            }
            meta = AttnMetadata(
                slot_mapping=inputs["slot_mapping"],
                num_decode=b,
                decode_block_tables=inputs["block_tables"],
                decode_seq_lens=inputs["seq_lens"],
                ext_cu_seqlens_q=None,
                ext_seq_lens=None,
                ext_block_tables=None,
                decode_num_splits=self.splits[b],
            )
            model, backend = runner.model, runner.backend
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # warm-up: Triton compiles, allocators settle
                    model.logits(model.hidden_states(inputs["input_ids"], inputs["positions"], backend, meta))
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                logits = model.logits(model.hidden_states(inputs["input_ids"], inputs["positions"], backend, meta))
            pool = graph.pool()
            self.graphs[b] = (graph, inputs, logits)

    def run(self, step: DecodeInputs, bucket: int, fill=None) -> torch.Tensor:
        """`fill(input_ids)`: puts tokens still on the device into the step's inputs (async scheduling)."""
        graph, inputs, logits = self.graphs[bucket]
        load_inputs(inputs, step)
        if fill is not None:
            fill(inputs["input_ids"])
        graph.replay()
        return logits[: step.n]


def load_inputs(inputs: dict[str, torch.Tensor], step: DecodeInputs, pin: bool = True) -> None:
    """Copy a step's padded tensors into a graph's static inputs (from pinned memory, so the copies
    do not wait); the block table into its first columns, the rest left as they were (unread)."""
    for name, t in inputs.items():
        src = getattr(step, name)
        dst = t if src.shape == t.shape else t[:, : src.shape[1]]
        dst.copy_(src.pin_memory() if pin else src, non_blocking=pin)
