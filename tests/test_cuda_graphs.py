"""CUDA graphs' decisions on a CPU (issue 29): the buckets, the padding, when a step falls back to
eager, and what status() says. Capture and replay need CUDA: `workbench gpucheck` runs them."""

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.engine import cuda_graphs as cg


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert cg.buckets_for(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert cg.buckets_for(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert cg.buckets_for(1) == [1]
    buckets = cg.buckets_for(40)
    assert [cg.bucket_for(n, buckets) for n in (1, 3, 9, 33, 40)] == [1, 4, 16, 40, 40]
    assert cg.bucket_for(41, buckets) is None


def test_plan_replays_decodes_that_fit_and_says_why_others_do_not():
    buckets = cg.buckets_for(8)
    assert cg.plan(["decode"] * 3, 10, buckets, 64) == cg.Plan(4)
    assert cg.plan(["decode", "prefill"], 2, buckets, 64).reason == "the step has prefill or verify tokens"
    assert cg.plan(["decode", "verify"], 2, buckets, 64).bucket is None
    assert "more than the largest bucket (8)" in cg.plan(["decode"] * 9, 1, buckets, 64).reason
    assert "longer than the captured 64" in cg.plan(["decode"], 65, buckets, 64).reason
    why = cg.unsupported(torch.device("cpu"), "cpu", False)
    assert why == "CUDA graphs need a CUDA device; this engine runs on cpu"
    assert "graphs need triton" in cg.unsupported(torch.device("cuda"), "torch", False)
    assert "mixture-of-experts" in cg.unsupported(torch.device("cuda"), "triton", True)
    assert cg.unsupported(torch.device("cuda"), "triton", False) is None


def test_padding_writes_nothing_and_reads_one_position():
    step = cg.pad_decode([5, 6], [10, 3], [170, 35], [[10, 11], [2]], bucket=4, max_blocks=3)
    assert step.n == 2
    assert step.input_ids.tolist() == [5, 6, 0, 0] and step.positions.tolist() == [10, 3, 0, 0]
    assert step.slot_mapping.tolist() == [170, 35, -1, -1]  # padding rows write no KV
    assert step.seq_lens.tolist() == [11, 4, 1, 1]
    assert step.block_tables.tolist() == [[10, 11], [2, 0], [0, 0], [0, 0]]  # as wide as the widest table
    assert step.block_tables.dtype == torch.int32 and step.slot_mapping.dtype == torch.int64
    with pytest.raises(ValueError, match="do not fit bucket 1"):
        cg.pad_decode([5, 6], [1, 1], [1, 2], [[0], [0]], bucket=1, max_blocks=3)
    with pytest.raises(ValueError, match=r"widest table 4\) do not fit bucket 4 x 3"):
        cg.pad_decode([5], [1], [1], [[0, 1, 2, 3]], bucket=4, max_blocks=3)


def test_a_graphs_table_past_the_widest_keeps_stale_columns_that_no_kernel_reads():
    """A replay copies only the step's columns into the graph's max_blocks-wide table; the stale
    block ids past them change nothing: Triton decode attention (interpreted, fp32) reads a
    sequence's own blocks only."""
    from workbench_kernels import triton_ops

    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(12, 4, 2, 16, generator=g), torch.randn(12, 4, 2, 16, generator=g)
    q = torch.randn(4, 4, 16, generator=g)
    step = cg.pad_decode([1, 2, 3], [9, 2, 6], [0, 0, 0], [[4, 5, 6], [3], [7, 8]], bucket=4, max_blocks=6)
    static = cg.pad_decode([0] * 4, [0] * 4, [-1] * 4, [[11] * 6] * 4, bucket=4, max_blocks=6)  # stale ids
    inputs = {
        k: getattr(static, k).clone() for k in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens")
    }
    cg.load_inputs(inputs, step, pin=False)
    assert inputs["block_tables"].tolist() == [[4, 5, 6, 11, 11, 11], [3, 0, 0, 11, 11, 11], [7, 8, 0, 11, 11, 11],
                                               [0, 0, 0, 11, 11, 11]]  # fmt: skip
    assert inputs["seq_lens"].tolist() == [10, 3, 7, 1] and inputs["slot_mapping"].tolist() == [0, 0, 0, -1]
    wide = triton_ops.decode_attention(q, kc, vc, inputs["block_tables"], inputs["seq_lens"], 0.25)
    narrow = triton_ops.decode_attention(q, kc, vc, step.block_tables, step.seq_lens, 0.25)
    assert torch.equal(wide, narrow)


def test_padded_rows_change_nothing_on_the_reference_ops():
    """The padded step's real rows equal the unpadded step's, and the cache only changes where the
    real rows write (what a replayed graph relies on)."""
    from workbench_kernels import reference

    g = torch.Generator().manual_seed(0)
    kc = torch.randn(8, 4, 2, 16, generator=g)
    vc = torch.randn(8, 4, 2, 16, generator=g)
    q = torch.randn(2, 4, 16, generator=g)
    k_new, v_new = torch.randn(2, 2, 16, generator=g), torch.randn(2, 2, 16, generator=g)
    step = cg.pad_decode([1, 2], [5, 2], [1 * 4 + 1, 3 * 4 + 2], [[0, 1], [3]], bucket=4, max_blocks=2)
    eager_k, eager_v = kc.clone(), vc.clone()
    reference.write_kv_ref(k_new, v_new, eager_k, eager_v, step.slot_mapping[:2])
    eager = reference.decode_attention_ref(q, eager_k, eager_v, step.block_tables[:2], step.seq_lens[:2], 0.25)
    padded_k, padded_v = kc.clone(), vc.clone()
    pad = lambda t: torch.cat([t, torch.zeros(2, *t.shape[1:])])  # noqa: E731
    reference.write_kv_ref(pad(k_new), pad(v_new), padded_k, padded_v, step.slot_mapping)
    assert torch.equal(padded_k, eager_k) and torch.equal(padded_v, eager_v)
    padded = reference.decode_attention_ref(pad(q), padded_k, padded_v, step.block_tables, step.seq_lens, 0.25)
    torch.testing.assert_close(padded[:2], eager)


def test_a_graph_splits_the_kv_for_its_longest_context_and_any_shorter_one_is_exact():
    """Issue 50.3: a bucket's graph takes the kernel's split count for the longest context it serves
    (one sequence of 32k on 8 KV heads: many splits, not 8 programs on the GPU), and that fixed count
    is exact at every shorter length, its later splits empty (Triton interpreter, fp32)."""
    from workbench_kernels import reference, triton_ops

    bn = triton_ops.decode_config(128, torch.bfloat16, torch.bfloat16)["block_n"]
    one = cg.graph_splits(triton_ops, 1, 8, 128, 32768, torch.bfloat16, num_sms=132)
    assert one == triton_ops.pick_num_splits(1, 8, 32768, bn, 132) > 8
    assert cg.graph_splits(triton_ops, 256, 8, 128, 32768, torch.bfloat16, num_sms=132) == 1  # a full GPU already
    g = torch.Generator().manual_seed(1)
    lens = [1, 7, 16, 17, 90]  # blocks of 16: one sequence's keys in at most 6 blocks, 8 splits asked
    kc, vc = torch.randn(40, 16, 2, 32, generator=g), torch.randn(40, 16, 2, 32, generator=g)
    tables = torch.randperm(40, generator=g)[: 6 * len(lens)].view(len(lens), 6).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 4, 32, generator=g)
    out = triton_ops.decode_attention(q, kc, vc, tables, seq_lens, 32**-0.5, num_splits=8)
    torch.testing.assert_close(out, reference.decode_attention_ref(q, kc, vc, tables, seq_lens, 32**-0.5))


def test_the_setting_on_a_cpu_runs_eagerly_and_says_why(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, cuda_graphs=True, max_num_seqs=8)
    st = llm.status()
    assert st["cuda_graph_buckets"] == [1, 2, 4, 8]
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], params=SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4
    st = llm.status()
    assert st["cuda_graph_steps"] == {"replayed": 0, "eager": 4}
    assert st["cuda_graph_reason"] == "CUDA graphs need a CUDA device; this engine runs on cpu"
    assert st["cuda_graph_splits"] == {}  # nothing captured
    llm.configure(max_num_seqs=24)
    assert llm.status()["cuda_graph_buckets"] == [1, 2, 4, 8, 16, 24]
    llm.configure(cuda_graphs=False)
    assert llm.status()["cuda_graph_buckets"] == [] and llm.status()["cuda_graph_reason"] == "cuda_graphs is off"
