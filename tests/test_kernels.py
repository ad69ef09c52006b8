"""The Triton paged-attention kernels against their torch references (kernels/reference.py).

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
which pays per op rather than per element: the cases are small, hand-picked cross products of
head dim, GQA ratio, block size, dtype, KV quantisation and query layout, some with small tile
overrides so that several query tiles / key steps / KV splits are exercised. bf16 runs here too:
under the interpreter the launchers widen bf16 dot operands to fp32 (its bf16 tl.dot is wrong),
on a GPU the dots are bf16's own.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from workbench_kernels import reference as ref
from workbench_kernels.triton_ops import decode_attention, extend_attention, pick_num_splits, write_kv

torch.set_num_threads(1)  # the interpreter runs numpy; thread contention makes it erratic

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
INT8, FP8 = torch.int8, torch.float8_e4m3fn
QUANT = (INT8, FP8)
TOL = {F32: 2e-4, F16: 4e-3, BF16: 3e-2}


def _cdiv(a, b):
    return -(-a // b)


def _fill_cache(num_blocks, bs, hkv, d, dtype, kv, gen):
    """A cache whose every slot holds random data (stale slots must never leak into results)."""
    store = kv if kv in QUANT else dtype
    kc = torch.empty(num_blocks, bs, hkv, d, dtype=store, device=DEVICE)
    vc = torch.empty_like(kc)
    ks = torch.empty(num_blocks, bs, hkv, device=DEVICE) if kv in QUANT else None
    vs = torch.empty_like(ks) if kv in QUANT else None
    n = num_blocks * bs
    k = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    if kv not in QUANT:
        k, v = k.to(dtype), v.to(dtype)
    slots = torch.arange(n, dtype=torch.int32, device=DEVICE)
    ref.write_kv_ref(k, v, kc, vc, slots, ks, vs)
    return kc, vc, ks, vs


def _block_tables(seq_lens, bs, num_blocks, gen):
    """Shuffled physical blocks; the unused tail of each row holds other (valid) block ids."""
    need = [_cdiv(s, bs) for s in seq_lens]
    width = max(need) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    return bt.to(DEVICE)


def _queries(num_tokens, hq, d, dtype, gen, strided):
    q = torch.randn(num_tokens, hq + 2, d, generator=gen).to(DEVICE, dtype)
    return q[:, 1 : hq + 1] if strided else q[:, :hq].contiguous()


def _extend_inputs(seq_lens, q_lens, bs, hkv, group, d, dtype, kv, gen, strided):
    """A filled paged cache for `seq_lens`, shuffled block tables, and the new tokens' queries with
    their cu_seqlens: (k_cache, v_cache, k_scale, v_scale, block_tables, q, cu_seqlens_q, seq_lens)."""
    num_blocks = sum(_cdiv(s, bs) for s in seq_lens) + 3
    kc, vc, ks, vs = _fill_cache(num_blocks, bs, hkv, d, dtype, kv, gen)
    bt = _block_tables(seq_lens, bs, num_blocks, gen)
    q = _queries(sum(q_lens), hkv * group, d, dtype, gen, strided)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return kc, vc, ks, vs, bt, q, cu, lens


def _case_id(c, tail):
    d, g, bs, dtype, kv = c[:5]
    kv = "same" if kv is None else str(kv).removeprefix("torch.")
    extra = tail.format(*c[5:7]).replace(" ", "")
    return f"d{d}-g{g}-bs{bs}-{str(dtype).removeprefix('torch.')}-kv_{kv}-{extra}{'-strided' if c[7] else ''}"


def _check(out, expect, dtype):
    assert out.dtype == expect.dtype and out.shape == expect.shape
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])


# ----------------------------------------------------------------------------------- KV write


@pytest.mark.parametrize(
    "kv, dtype, d, hkv, bs, strided",
    [
        (F32, F32, 64, 3, 16, False),
        (F16, F16, 128, 1, 32, True),
        (BF16, BF16, 64, 2, 16, False),
        (INT8, F32, 64, 3, 32, False),
        (INT8, F16, 128, 2, 16, True),
        (FP8, BF16, 64, 1, 16, True),
        (FP8, F32, 128, 3, 32, False),
    ],
)
def test_write_kv(kv, dtype, d, hkv, bs, strided):
    """Bit-exact against the reference, including the int8/fp8 quantisation (no dots: bf16 is fine)."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 6, 37
    # keys/values as the engine has them: possibly strided views of a fused projection
    k = _queries(num_tokens, hkv, d, dtype, gen, strided) * 3
    v = _queries(num_tokens, hkv, d, dtype, gen, strided)
    k[0, 0] = 0.0  # an all-zero head exercises the amax clamp
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens].to(torch.int32)
    slots[[2, 9, 30]] = torch.tensor([-1, -1, -5], dtype=torch.int32)  # padding: skipped
    slots = slots.to(DEVICE)
    results = []
    for fn in (write_kv, ref.write_kv_ref):
        kc, vc, ks, vs = _fill_cache(num_blocks, bs, hkv, d, dtype, kv, torch.Generator().manual_seed(2))
        fn(k, v, kc, vc, slots, ks, vs)
        results.append((kc, vc, ks, vs))
    for got, want in zip(*results):
        if want is None:
            continue
        if want.dtype == FP8:  # compare the stored bytes
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want)


# ------------------------------------------------------------------------- extend attention


def _extend_layout(scenario, bs):
    """(seq_lens, q_lens): ragged lengths around block boundaries, new tokens at the end."""
    if scenario == "prefill":  # whole prompts, no cache hits
        seq = [1, bs - 1, bs, bs + 1, 2 * bs + 1]
        return seq, list(seq)
    if scenario == "prefix":  # prefix-cache hits / later chunked-prefill chunks: queries start mid-sequence
        seq = [bs + 1, 3 * bs - 1, 2 * bs, 5, 2 * bs + 3]
        return seq, [1, bs + 2, bs - 1, 5, 7]
    # mixed: a first chunk, a continuation, a one-token verify, an empty entry, a full prompt
    seq = [bs, 2 * bs + 1, 3 * bs + 1, 9, bs - 1]
    return seq, [bs, bs + 1, 1, 0, bs - 1]


# The full head-dim x group x block-size cross product, with the KV format, dtype, query layout
# (or split count) and q strides rotated through it so that most pairs of factors meet, plus
# targeted extras.
_GRID = list(itertools.product((64, 128), (1, 3, 8), (16, 32)))
_KVS = (None, INT8, FP8)  # None: the activation dtype
_SCENARIOS = ("prefill", "prefix", "mixed")

EXTEND_CASES = [
    # d, group, bs, dtype, kv, scenario, (block_m, block_n) override, strided q
    (d, g, bs, (F32, F16)[(i + i // 2) % 2], _KVS[i % 3], _SCENARIOS[(i // 3 + i) % 3], None, i % 4 == 1)
    for i, (d, g, bs) in enumerate(_GRID)
] + [
    # small tiles: several query tiles per sequence and several key steps per tile
    (64, 8, 32, F32, None, "prefix", (32, 16), False),
    (64, 3, 32, F32, INT8, "prefix", (16, 32), False),
    (128, 1, 16, F16, INT8, "mixed", (32, 16), False),
    (64, 8, 16, F16, FP8, "prefill", (64, 32), True),
    (128, 3, 16, F32, None, "mixed", (16, 16), False),
    # bf16: on a GPU bf16 dots; in the interpreter the fp32 dots it is given instead
    (128, 8, 32, BF16, None, "mixed", None, False),
    (64, 3, 16, BF16, INT8, "prefix", (32, 16), False),
    (128, 1, 16, BF16, FP8, "prefill", None, False),
]


@pytest.mark.parametrize(
    "d, group, bs, dtype, kv, scenario, blocks, strided",
    EXTEND_CASES,
    ids=[_case_id(c, "{}-tiles{}") for c in EXTEND_CASES],
)
def test_extend_attention(d, group, bs, dtype, kv, scenario, blocks, strided):
    kv = kv or dtype
    gen = torch.Generator().manual_seed(d + group + bs)
    hkv = 2
    seq_lens, q_lens = _extend_layout(scenario, bs)
    kc, vc, ks, vs, bt, q, cu, lens = _extend_inputs(seq_lens, q_lens, bs, hkv, group, d, dtype, kv, gen, strided)
    scale = d**-0.5
    bm, bn = blocks or (None, None)
    out = extend_attention(q, kc, vc, bt, cu, lens, scale, ks, vs, block_m=bm, block_n=bn)
    _check(out, ref.extend_attention_ref(q, kc, vc, bt, cu, lens, scale, ks, vs), dtype)


# ------------------------------------------------------------------------- decode attention


DECODE_CASES = [
    # d, group, bs, dtype, kv, num_splits (None: automatic), block_n override, strided q
    (
        d,
        g,
        bs,
        (F16, F32)[(i + i // 2) % 2],
        _KVS[(i + j) % 3],
        splits,
        16 if splits == 3 and i % 2 else None,
        i % 4 == 2,
    )
    for i, (d, g, bs) in enumerate(_GRID)
    for j, splits in enumerate((1, 3))
] + [
    (128, 8, 16, F16, FP8, None, None, False),
    (64, 3, 16, F16, INT8, None, 16, False),
    (64, 1, 32, F32, None, 8, 16, True),  # more splits than some sequences have keys
    # bf16: on a GPU bf16 dots; in the interpreter the fp32 dots it is given instead
    (128, 8, 32, BF16, None, 1, None, False),
    (64, 3, 16, BF16, None, 4, None, False),
    (128, 1, 16, BF16, INT8, None, None, False),
    (64, 8, 32, BF16, FP8, 2, None, False),
]


@pytest.mark.parametrize(
    "d, group, bs, dtype, kv, splits, block_n, strided",
    DECODE_CASES,
    ids=[_case_id(c, "splits{}-bn{}") for c in DECODE_CASES],
)
def test_decode_attention(d, group, bs, dtype, kv, splits, block_n, strided):
    kv = kv or dtype
    gen = torch.Generator().manual_seed(3 * d + group + bs)
    hkv = 2
    seq_lens = [1, bs - 1, bs, bs + 1, 2 * bs - 1, 4 * bs + 3]
    num_blocks = sum(_cdiv(s, bs) for s in seq_lens) + 3
    kc, vc, ks, vs = _fill_cache(num_blocks, bs, hkv, d, dtype, kv, gen)
    bt = _block_tables(seq_lens, bs, num_blocks, gen)
    q = _queries(len(seq_lens), hkv * group, d, dtype, gen, strided)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    out = decode_attention(q, kc, vc, bt, lens, scale, ks, vs, num_splits=splits, block_n=block_n)
    _check(out, ref.decode_attention_ref(q, kc, vc, bt, lens, scale, ks, vs), dtype)


def _dense_windowed(q, kc, vc, bt, seq_lens, q_lens, scale, window):
    """Sliding-window attention from first principles: every key position scored against every
    query, masked to (pos - window, pos] — the reference the paged references must equal."""
    out, row = [], 0
    for b, (length, n) in enumerate(zip(seq_lens, q_lens)):
        k = ref.gather_kv(kc, None, bt[b], length, torch.float32)
        v = ref.gather_kv(vc, None, bt[b], length, torch.float32)
        for t in range(n):
            pos = length - n + t
            keys = torch.arange(length)
            seen = (keys <= pos) & (keys > pos - window)
            qh = q[row].float()  # [Hq, D]
            group = qh.shape[0] // k.shape[1]
            kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, Hq, D]
            scores = torch.einsum("hd,lhd->hl", qh, kk) * scale
            scores[:, ~seen] = float("-inf")
            out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), vv))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window_attention(window):
    """Sliding-window layers (Gemma 3, Mistral): prefill chunks, prefix hits and decodes see only
    the last `window` positions, in the Triton kernels and in the torch references alike."""
    gen = torch.Generator().manual_seed(window)
    d, hkv, group, bs = 32, 2, 2, 16
    seq_lens, q_lens = [37, 20, 9, 50], [37, 3, 9, 1]  # a prefill, a chunk, a short one, a decode-like row
    kc, vc, ks, vs, bt, q, cu, lens = _extend_inputs(seq_lens, q_lens, bs, hkv, group, d, F32, F32, gen, False)
    scale = d**-0.5
    expect = _dense_windowed(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), seq_lens, q_lens, scale, window)
    _check(ref.extend_attention_ref(q, kc, vc, bt, cu, lens, scale, window=window).cpu(), expect, F32)
    for bn in (16, 64):
        out = extend_attention(q, kc, vc, bt, cu, lens, scale, window=window, block_m=16, block_n=bn)
        _check(out.cpu(), expect, F32)
    # decode: one query per sequence at its last position
    last = torch.tensor(q_lens).cumsum(0) - 1
    qd = q[last.to(DEVICE)].contiguous()
    dense = _dense_windowed(qd.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), seq_lens, [1] * 4, scale, window)
    _check(ref.decode_attention_ref(qd, kc, vc, bt, lens, scale, window=window).cpu(), dense, F32)
    for splits in (1, 3):
        out = decode_attention(qd, kc, vc, bt, lens, scale, window=window, num_splits=splits, block_n=16)
        _check(out.cpu(), dense, F32)


def test_pick_num_splits():
    # plenty of sequences x kv heads: no split
    assert pick_num_splits(128, 8, 4096, 64, num_sms=132) == 1
    # few programs and a long context: split to fill the GPU, capped by work per split
    assert pick_num_splits(1, 2, 32768, 64, num_sms=132) == 64
    assert pick_num_splits(4, 3, 4096, 64, num_sms=132) == 16
    # short contexts never split
    assert pick_num_splits(1, 1, 100, 64, num_sms=132) == 1


# --------------------------------------------------------------------- engine-like round trip


@pytest.mark.parametrize("kv", [F32, INT8, FP8])
def test_chunked_prefill_then_decode(kv):
    """write_kv + extend (two prefill chunks) + decode, all Triton, against the all-reference path."""
    gen = torch.Generator().manual_seed(7)
    d, hkv, group, bs, dtype = 64, 3, 3, 16, F32
    prompt = [40, 23]  # two sequences; chunk 1 = first 20 / 23 tokens, chunk 2 = the rest
    chunks = [[20, 23], [20, 0]]
    steps = len(chunks) + 1
    num_blocks = sum(_cdiv(p + 1, bs) for p in prompt) + 2
    bt = _block_tables([p + 1 for p in prompt], bs, num_blocks, gen)
    total = [p + 1 for p in prompt]
    k_all = torch.randn(2, max(total), hkv, d, generator=gen).to(DEVICE)
    v_all = torch.randn(2, max(total), hkv, d, generator=gen).to(DEVICE)
    q_all = torch.randn(2, max(total), hkv * group, d, generator=gen).to(DEVICE)

    def slot(b, pos):
        return int(bt[b, pos // bs]) * bs + pos % bs

    outs = {}
    for impl in ("triton", "ref"):
        wr = write_kv if impl == "triton" else ref.write_kv_ref
        ext = extend_attention if impl == "triton" else ref.extend_attention_ref
        dec = decode_attention if impl == "triton" else ref.decode_attention_ref
        kc, vc, ks, vs = _fill_cache(num_blocks, bs, hkv, d, dtype, kv, torch.Generator().manual_seed(8))
        done = [0, 0]
        results = []
        for step in range(steps):
            if step < len(chunks):
                sizes = chunks[step]
                pos = [(b, p) for b in range(2) for p in range(done[b], done[b] + sizes[b])]
                cu = torch.tensor([0, sizes[0], sizes[0] + sizes[1]], dtype=torch.int32, device=DEVICE)
            else:  # one decode token each
                pos = [(b, total[b] - 1) for b in range(2)]
            k = torch.stack([k_all[b, p] for b, p in pos])
            v = torch.stack([v_all[b, p] for b, p in pos])
            q = torch.stack([q_all[b, p] for b, p in pos])
            slots = torch.tensor([slot(b, p) for b, p in pos], dtype=torch.int32, device=DEVICE)
            wr(k, v, kc, vc, slots, ks, vs)
            for b, p in pos:
                done[b] = max(done[b], p + 1)
            lens = torch.tensor(done, dtype=torch.int32, device=DEVICE)
            if step < len(chunks):
                results.append(ext(q, kc, vc, bt, cu, lens, d**-0.5, ks, vs))
            else:
                results.append(dec(q, kc, vc, bt, lens, d**-0.5, ks, vs))
        outs[impl] = results
    for got, want in zip(outs["triton"], outs["ref"]):
        _check(got, want, dtype)


def test_int64_metadata_and_views():
    """int64 slot mappings / lengths / block tables, and a block table that is a column slice."""
    gen = torch.Generator().manual_seed(11)
    d, hkv, group, bs, dtype, kv = 64, 2, 3, 16, F32, INT8
    seq_lens = [bs + 1, 3, 2 * bs]
    q_lens = [bs + 1, 1, 5]
    num_blocks = sum(_cdiv(s, bs) for s in seq_lens) + 3
    kc, vc, ks, vs = _fill_cache(num_blocks, bs, hkv, d, dtype, kv, gen)
    wide = torch.cat([_block_tables(seq_lens, bs, num_blocks, gen)] * 2, dim=1).long()
    bt = wide[:, : wide.shape[1] // 2]  # rows are strided views
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int64, device=DEVICE)

    k = torch.randn(4, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(4, hkv, d, generator=gen).to(DEVICE)
    slots = torch.tensor([5, -1, 2 * bs + 3, 7], dtype=torch.int64, device=DEVICE)
    caches = [[t.clone() for t in (kc, vc, ks, vs)] for _ in range(2)]
    write_kv(k, v, *caches[0][:2], slots, *caches[0][2:])
    ref.write_kv_ref(k, v, *caches[1][:2], slots, *caches[1][2:])
    for got, want in zip(*caches):
        assert torch.equal(got, want)

    q = _queries(sum(q_lens), hkv * group, d, dtype, gen, strided=False)
    out = extend_attention(q, kc, vc, bt, cu, lens, d**-0.5, ks, vs)
    _check(out, ref.extend_attention_ref(q, kc, vc, bt, cu, lens, d**-0.5, ks, vs), dtype)
    qd = q[: len(seq_lens)]
    out = decode_attention(qd, kc, vc, bt, lens, d**-0.5, ks, vs, num_splits=2)
    _check(out, ref.decode_attention_ref(qd, kc, vc, bt, lens, d**-0.5, ks, vs), dtype)


# ----------------------------------------------------------------------------- fused MoE
def test_moe_align_groups_pairs_by_expert():
    from workbench_kernels.fused_moe import moe_align

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # pairs 0..5: experts 2,0,2,1,0,2
    sorted_ids, block_expert = moe_align(ids, num_experts=4, block_m=2)
    assert block_expert.tolist() == [0, 1, 2, 2]  # expert 0: one block; 1: one; 2: two; 3: none
    s = sorted_ids.tolist()
    assert s[0:2] == [1, 4] and s[2:4] == [3, 6] and s[4:8] == [0, 2, 5, 6]  # 6 = the padding sentinel


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, block_m",
    [
        (1, 4, 2, 32, 48, None),  # a single decode token
        (37, 8, 2, 64, 96, 16),  # ragged: several blocks per expert, padding, unused experts
        (20, 16, 4, 48, 32, 32),  # many small experts (OLMoE-like), odd hidden size
    ],
)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fused_moe_matches_reference(tokens, experts, top_k, hidden, inter, block_m, dtype):
    from workbench_kernels.triton_ops import fused_moe

    gen = torch.Generator().manual_seed(tokens + experts)
    h = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    if experts > 4:
        logits[:, -1] = -1e9  # an expert no token picks
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    out = fused_moe(h, w13, w2, weights.to(DEVICE), ids.to(DEVICE), block_m=block_m)
    _check(out, ref.fused_moe_ref(h, w13, w2, weights.to(DEVICE), ids.to(DEVICE)), dtype)
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_moe(h, w13, w2[:, :, :-1], weights, ids)


# ----------------------------------------------------------------------------- fused layer ops
# Each against the torch ops it replaces in the model's unfused path (workbench/models/llama.py),
# equal to the bit in bf16 too: the kernels round where those ops round (bf16 by hand: the
# interpreter truncates fp32 -> bf16 where a GPU rounds).
def _exact(got, want, dtype):
    if DEVICE.type == "cpu" or dtype == F32:
        tol = 0 if dtype != F32 else 1e-6
        assert (got.float() - want.float()).abs().max().item() <= tol
    else:  # a GPU's exp/sqrt may round their last bit differently from torch's
        _check(got, want, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 96), (3, 576)])
def test_rms_norm_with_the_residual_add_matches_the_model(dtype, rows, hidden):
    from workbench_kernels.triton_ops import rms_norm

    from workbench.models.llama import rms_norm as model_rms_norm

    gen = torch.Generator().manual_seed(rows * hidden)
    wide = torch.randn(rows, 2 * hidden, generator=gen).to(DEVICE, dtype)
    x = wide[:, :hidden]  # strided rows, as a merged projection's slice
    residual = torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    out, new_residual = rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, x + residual)
    _exact(out, model_rms_norm(x + residual, weight, 1e-5), dtype)
    alone, same = rms_norm(x, weight, 1e-6)
    assert same is x
    _exact(alone, model_rms_norm(x, weight, 1e-6), dtype)
    with pytest.raises(ValueError, match=r"weight \[H\]"):
        rms_norm(x, weight[:-1], 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, weight, 1e-5, residual[:, :-1])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("rows, inter", [(1, 48), (5, 1536)])
def test_silu_mul_matches_the_model(dtype, rows, inter):
    import torch.nn.functional as F
    from workbench_kernels.triton_ops import silu_mul

    gate_up = (3 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = silu_mul(gate_up)
    want = F.silu(gate) * up
    if dtype == F32:  # exp's last bit may differ from torch's
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        _exact(got, want, dtype)
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul(gate_up[:, :-1])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("d, hq, hkv", [(64, 9, 3), (128, 8, 8), (80, 4, 1)])
def test_rope_and_kv_write_match_the_model(dtype, d, hq, hkv):
    """RoPE on q and k at each token's position, k and v into the cache at its slot (-1: none)."""
    from types import SimpleNamespace

    from workbench_kernels.triton_ops import rope_write_kv

    from workbench.models.llama import RotaryEmbedding

    gen = torch.Generator().manual_seed(d + hq)
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    cfg = SimpleNamespace(head_dim=d, rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=1024)
    rope = RotaryEmbedding(cfg, 1024, DEVICE, dtype)
    tokens = 6
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)  # one merged projection
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    positions = torch.tensor([0, 7, 63, 64, 700, 1023], device=DEVICE)
    slots = torch.tensor([5, 0, -1, 17, 31, 8], dtype=torch.int32, device=DEVICE)
    k_cache = torch.randn(4, 8, hkv, d, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(4, 8, hkv, d, generator=gen).to(DEVICE, dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    got_q = rope_write_kv(q, k, v, rope.cos, rope.sin, positions, k_cache, v_cache, slots)
    rq, rk = rope(positions, q, k)
    ref.write_kv_ref(rk, v, want_k, want_v, slots)
    _exact(got_q, rq, dtype)
    _exact(k_cache, want_k, dtype)
    assert torch.equal(v_cache, want_v)
    with pytest.raises(ValueError, match="unquantised caches only"):
        rope_write_kv(q, k, v, rope.cos, rope.sin, positions, k_cache.to(INT8), v_cache.to(INT8), slots)
    with pytest.raises(ValueError, match="one entry per token"):
        rope_write_kv(q, k, v, rope.cos, rope.sin, positions[:-1], k_cache, v_cache, slots)
