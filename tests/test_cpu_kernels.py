"""The C kernels of the CPU fast path (workbench_kernels.cpu) against torch, op by op, on every
variant this host can execute (an AVX-512 BF16 host runs avx512_bf16, avx512, avx2 and portable;
the NEON build runs under qemu-aarch64 where the cross compiler and qemu-user are installed), and
the engine with them on against the engine with torch's ops only.

Elementwise ops keep torch's bf16 rounding points, so RoPE/KV write and SiLU*up are bit-exact;
reductions (RMSNorm's mean, dots, softmax sums) may differ in fp32 summation order, so those are
held to a bf16 ulp or two on rare elements."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import cpu_qemu
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_agree_up_to_near_ties, make_tiny_model
from workbench_kernels import cpu, reference

from workbench.models.linear import Linear, int4_codes, int4_torch_operands, native_int4, quantize_int8
from workbench.models.llama import RotaryEmbedding, rms_norm

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")

QEMU_NEON = "neon-qemu"


@pytest.fixture(scope="session")
def neon_driver(tmp_path_factory):
    why = cpu_qemu.unavailable_reason()
    if why:
        pytest.skip(why)
    return cpu_qemu.build(tmp_path_factory.mktemp("neon"))


@pytest.fixture(params=[*cpu.variants(), QEMU_NEON])
def kern(request):
    """The kernels of one variant: this module's functions bound to it, or the NEON build under qemu."""
    if request.param == QEMU_NEON:
        yield cpu_qemu.QemuKernels(request.getfixturevalue("neon_driver"))
        return
    lacks = cpu.missing(request.param)
    if lacks:
        pytest.skip(f"variant {request.param} not run: this CPU lacks {', '.join(lacks)}")
    cpu.use(request.param)
    try:
        yield cpu
    finally:
        cpu.use(None)


@pytest.fixture(params=cpu.variants())
def native_variant(request):
    """One in-process variant this CPU runs, active for the test."""
    lacks = cpu.missing(request.param)
    if lacks:
        pytest.skip(f"variant {request.param} not run: this CPU lacks {', '.join(lacks)}")
    cpu.use(request.param)
    try:
        yield request.param
    finally:
        cpu.use(None)


BF = torch.bfloat16


def ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each element's magnitude."""
    e = torch.frexp(x.float().abs().clamp(min=1e-30))[1]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8)


def assert_within_ulps(
    out: torch.Tensor, ref: torch.Tensor, max_fraction: float = 0.02, ulps: int = 1, slack: torch.Tensor | float = 0.0
):
    """Every element within `ulps` bf16 ulps (plus `slack`, an error the kernel is allowed by its
    numerics), and at most `max_fraction` of them differing at all."""
    diff = (out.float() - ref.float()).abs()
    bound = ulps * ulp(torch.maximum(out.float().abs(), ref.float().abs())) + slack
    assert bool((diff <= bound).all()), f"max diff {diff.max().item()}"
    assert (out != ref).float().mean().item() <= max_fraction


@pytest.mark.parametrize("n,k", [(7, 40), (13, 64), (96, 576), (33, 100)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_bf16(kern, m, n, k):
    check_bf16_product(kern.gemv_bf16, m, n, k)


def check_bf16_product(multiply, m, n, k):
    """multiply(x [m, k], w [n, k], bias or None) against the exact product, with and without bias."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = (torch.randn(n, k, generator=g) * 0.1).to(BF)
    x = torch.randn(m, k, generator=g).to(BF)
    bias = torch.randn(n, generator=g).to(BF)
    for b in (None, bias):
        ref = x.float() @ w.float().t() + (0 if b is None else b.float())
        out = multiply(x, w, b)
        assert out.shape == (m, n) and out.dtype == BF
        # fp32 accumulation, one rounding: within an ulp of the exact result
        assert bool(((out.float() - ref).abs() <= ulp(ref) + 1e-6).all())


@pytest.fixture(params=cpu.GEMV_WIDTHS)
def bf16_dot_width(request):
    """The AVX-512 BF16 build with its bf16 GEMVs in one register width (the other is the host's
    measured choice, so both run here whichever this host picks)."""
    lacks = cpu.missing("avx512_bf16")
    if lacks:
        pytest.skip(f"the GEMV widths are the avx512_bf16 build's: this CPU lacks {', '.join(lacks)}")
    cpu.use("avx512_bf16")
    cpu.set_gemv_width(request.param)
    try:
        yield request.param
    finally:
        cpu.set_gemv_width(None)
        cpu.use(None)


@pytest.mark.parametrize("n,k", [(7, 40), (13, 64), (96, 576), (33, 100), (5, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_gemv_bf16_in_either_register_width(bf16_dot_width, m, n, k):
    assert cpu._sel.lib.wb_gemv_ymm() == (bf16_dot_width == "ymm")
    check_bf16_product(cpu.gemv_bf16, m, n, k)


def test_gemv_width_is_measured_and_can_be_forced():
    width, why, rates = cpu.gemv_width()
    if cpu.variant() != "avx512_bf16":
        assert (width, rates) == ("", {}) and "one register width" in why
        return
    assert width == max(rates, key=rates.get) or "forced" in why
    assert why.startswith(("measured:", "forced")) and "GB/s" in why
    code = "from workbench_kernels import cpu; print(cpu.gemv_width()[0]); print(cpu._sel.lib.wb_gemv_ymm())"
    for forced in cpu.GEMV_WIDTHS:
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "WORKBENCH_CPU_GEMV": forced},
        )
        assert r.stdout.split() == [forced, str(int(forced == "ymm"))], r.stderr
    with pytest.raises(ValueError, match="allowed: zmm, ymm"):
        cpu.set_gemv_width("xmm")


# 96: whole 32-value steps; 4112: past the int32 sums' 4096-value span, and a 16-value tail
@pytest.mark.parametrize("k", [96, 4112])
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_int8_matches_torch_kernel(kern, m, k):
    g = torch.Generator().manual_seed(m + k)
    w = (torch.randn(48, k, generator=g) * 0.1).to(BF)
    x = torch.randn(m, k, generator=g).to(BF)
    q, s = quantize_int8(w)
    out, ref = kern.gemv_int8(x, q, s), torch.ops.aten._weight_int8pack_mm(x, q, s)
    fixed_point = kern is cpu and cpu.variant() in INT8_FIXED_POINT
    assert_within_ulps(out, ref, 0.05, slack=int8_fixed_point_slack(q, s, x) if fixed_point else 0.0)


# the builds whose int8 GEMV takes its activations as int16 fixed point (vpdpwssd, vpmaddwd)
INT8_FIXED_POINT = ("avx512_bf16", "avx2")


def int8_fixed_point_slack(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What an int8 GEMV's int16 activations (one scale per row, max |x| -> 32767) may move each
    output by: max|x| / 65534 times sum |w|, which only sums cancelling to near zero notice against
    their own ulp."""
    return (q.float().abs() * s.float()[:, None]).sum(1) * x.float().abs().amax(1, keepdim=True) / 65534


# 96: two 32-value runs, then one alone (the int4 kernels read runs in pairs where they can)
@pytest.mark.parametrize("k,group", [(256, 32), (256, 64), (256, 128), (96, 32), (1536, 128)])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_int4_matches_torch_kernel(kern, m, k, group):
    g = torch.Generator().manual_seed(group + m + k)
    w = (torch.randn(48, k, generator=g) * 0.1).to(BF)
    x = torch.randn(m, k, generator=g).to(BF)
    codes, scales_zeros = int4_codes(w, group)
    packed, sz, _ = int4_torch_operands(codes, scales_zeros, w.dtype)
    ref = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    assert_within_ulps(kern.gemv_int4(x, *native_int4(codes, scales_zeros), group), ref, 0.05)


def test_pack_int4_layout():
    codes = torch.arange(64).remainder(16).view(1, 64)
    packed = cpu.pack_int4(codes)
    # byte j of each run of 32 holds value j (low nibble) and value j + 16 (high nibble)
    assert packed.shape == (1, 32)
    assert packed[0, 0].item() == codes[0, 0] | (codes[0, 16] << 4)
    assert packed[0, 17].item() == codes[0, 33] | (codes[0, 49] << 4)
    many = torch.randint(0, 16, (5, 96), generator=torch.Generator().manual_seed(1))
    assert torch.equal(cpu.unpack_int4(cpu.pack_int4(many)), many.to(torch.int32))  # the inverse


# seeds 12 and 18 draw int8 sums that cancel to near zero (see int8_fixed_point_slack)
@pytest.mark.parametrize("seed", [0, 12, 18])
def test_linear_native_switch_keeps_results(native_variant, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(64, 64, generator=g) * 0.1).to(BF)
    lin = Linear(w)
    x = torch.randn(2, 64, generator=g).to(BF)
    for mode in ("none", "int8", "int4", "none"):
        lin.quantize(mode, 32)
        lin.native = False
        ref = lin(x)
        lin.native = True
        fixed_point = mode == "int8" and native_variant in INT8_FIXED_POINT
        assert_within_ulps(lin(x), ref, 0.1, slack=int8_fixed_point_slack(*lin._q, x) if fixed_point else 0.0)
    lin.native = True
    big = torch.randn(cpu.MAX_ROWS + 1, 64).to(BF)  # more rows than a GEMV takes: torch's kernel
    lin.native = False
    ref = lin(big)
    lin.native = True
    assert torch.equal(lin(big), ref)


@pytest.fixture(params=["avx512", "amx"])
def amx_unit(request):
    """The bf16 build's kernels on AVX-512 or on AMX (where the CPU has it): both run here,
    whichever this host would use."""
    if cpu.variant() != "avx512_bf16":
        pytest.skip(f"the AMX paths are the avx512_bf16 build's; this host runs {cpu.variant()}")
    cpu.set_amx(None)
    on, why = cpu.amx()
    if request.param == "amx" and not on:
        pytest.skip(f"the AMX paths do not run here: {why}")
    cpu.set_amx(request.param == "amx")
    try:
        assert cpu._require().wb_amx() == (request.param == "amx")
        yield request.param
    finally:
        cpu.set_amx(None)


@pytest.mark.parametrize("n,k", [(130, 98), (128, 64), (1, 2)])
def test_pack_tiles_lays_out_input_pairs_per_group_of_64_outputs(n, k):
    """The tiles' layout, [N / 64][K / 2][4][16][2] zero-padded to whole groups, however it is made
    (pairs moved as 32-bit words)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(BF)
    groups = -(-n // 64)
    padded = torch.zeros(groups * 64, k, dtype=BF)
    padded[:n] = w
    assert torch.equal(cpu.pack_tiles(w), padded.view(groups, 4, 16, k // 2, 2).permute(0, 3, 1, 2, 4))


@pytest.mark.parametrize(
    "m,n,k",
    [
        (9, 576, 576), (13, 100, 64), (64, 3072, 576), (70, 576, 1536), (1100, 130, 96),
        (300, 17, 2), (6, 64, 40), (1, 130, 98),
    ],
)  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bf16_tiles_equal_the_exact_product(m, n, k, threads, amx_unit):
    """Whole and partial tiles (rows past a multiple of 6, of 16 and 32 on AMX, past its chunks of
    512; outputs past a multiple of 64 and of 16), with and without bias: fp32 sums, one rounding,
    within an ulp of the exact result. On 2 and 3 threads, groups of outputs that do not divide
    among them are split by rows too (9 groups on 2 threads: two parts each). AMX takes inputs in
    multiples of 32; the others (the last three) take AVX-512 there too."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_bf16_product(lambda x, w, b: cpu.Tiles(w, b)(x), m, n, k)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="even number of inputs"):
        cpu.pack_tiles(torch.zeros(4, 3, dtype=BF))


def test_tiled_linear_keeps_no_onednn_copy():
    """On the tiles path a large step packs the weights once for the tiles and, up to a prompt's
    size, never asks oneDNN for its layout (one extra copy, as before); quantised modes keep their
    own kernels and drop the tiles' copy, made again when the original weights serve again."""
    if not cpu.tiles_available():
        pytest.skip(f"the bf16 tiles are the avx512_bf16 build's; this host runs {cpu.variant()}")
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 64, generator=g) * 0.1).to(BF)
    lin = Linear(w)
    lin.native, lin.tiled = True, True
    x = torch.randn(cpu.MAX_ROWS + 3, 64, generator=g).to(BF)
    y = lin(x)
    assert lin._tiles is not None and lin._packed is False
    assert bool(((y.float() - x.float() @ w.float().t()).abs() <= ulp(y.float()) + 1e-6).all())
    lin.quantize("int8")
    lin.tiled = True
    assert lin(x).shape == (cpu.MAX_ROWS + 3, 96) and lin._tiles is None  # int8: torch's packed kernel
    assert lin.copies_bytes().keys() == {"quantized"}
    lin.quantize("none")
    assert torch.equal(lin(x), y) and lin.copies_bytes() == {"tiles": lin._tiles.packed.nbytes}


@pytest.mark.parametrize("rows", [1, 2, 5, 40, 600])
def test_a_linear_held_once_multiplies_on_its_own_bytes_laid_out_as_the_tiles(rows, amx_unit, monkeypatch):
    """Held once (`Linear.hold_once`, the engine's layers on AMX), a layer's weights take the tiles'
    layout in their own bytes and every step multiplies there: within an ulp of the exact product at
    any row count, in AVX-512 (forced here; the rule holds them once on AMX only) and AMX alike. `weight` reads the
    originals back exactly; a quantisation and the torch path lay the bytes back first."""
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(192, 96, generator=g) * 0.1).to(BF)
    bias = torch.randn(192, generator=g).to(BF)
    x = torch.randn(rows, 96, generator=g).to(BF)
    ref = x.float() @ w.float().t() + bias.float()
    store = w.clone()
    lin = Linear(store, bias, own=True)
    lin.bind(True, False, True)
    assert lin.hold_once() == cpu.tiles_hold_weights()[0] == (amx_unit == "amx")
    monkeypatch.setattr(cpu, "tiles_hold_weights", lambda: (True, "forced by the test"))
    assert lin.hold_once() and lin.storage is store and not torch.equal(store, w)
    assert lin.copies_bytes() == {} and lin.gemv is not None  # no copy; the one-call layer binds the tiles
    y = lin(x)
    assert y.shape == (rows, 192) and bool(((y.float() - ref).abs() <= ulp(ref) + 1e-6).all())
    assert lin.copies_bytes() == {}
    assert torch.equal(lin.weight, w) and torch.equal(lin.weight_rows(64, 130), w[64:130])
    lin.quantize("int8")
    assert not lin.held_once and torch.equal(store, w)
    lin.quantize("none")
    assert lin.hold_once()
    lin.bind(False, False, False)  # torch's path reads the plain layout
    assert not lin.held_once and torch.equal(store, w) and torch.equal(lin(x), F.linear(x, w, bias))
    # a weight another reader shares, or one the layout would pad, is never laid out in place
    shared, odd = Linear(w), Linear(torch.zeros(100, 96, dtype=BF), own=True)
    for other in (shared, odd):
        other.bind(True, False, True)
        assert not other.hold_once()


@pytest.mark.parametrize("m,n,k", [(9, 576, 576), (100, 130, 64), (1030, 96, 2048), (33, 17, 32)])
def test_int8_steps_on_amx_equal_the_exact_product(m, n, k, amx_unit):
    """On AMX an int8 layer's large steps widen the codes to bf16 (exact) a half group at a time and
    multiply on the tiles: within an ulp of (x @ q^T) * scale + bias, for partial groups and chunks,
    plus fp32 summation's error where the bias cancels the sum; the Linear takes that path, not
    torch's int8 kernel (which widens to fp32: 5x slower prompts)."""
    g = torch.Generator().manual_seed(m + n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(n, generator=g) * 0.01 + 1e-3).to(BF)
    x = torch.randn(m, k, generator=g).to(BF)
    if amx_unit != "amx":  # AVX-512 alone: torch's int8 kernel (the codes on these tiles were no faster)
        assert not cpu.codes_on_tiles(m, k)
        with pytest.raises(RuntimeError, match="multiply on AMX"):
            cpu.gemm_q8_tiles(x, q, scale)
        return
    summed = (x.double().abs() @ q.double().abs().t()) * scale.double() * 2.0**-20  # fp32 sums' error bound
    for bias in (None, torch.randn(n, generator=g).to(BF)):
        exact = (x.double() @ q.double().t()) * scale.double() + (0 if bias is None else bias.double())
        out = cpu.gemm_q8_tiles(x, q, scale, bias)
        assert out.shape == (m, n) and bool(((out.double() - exact).abs() <= ulp(exact) + summed).all())
    rows = cpu.quant_gemv_rows()
    assert cpu.codes_on_tiles(rows + 1, k) and not cpu.codes_on_tiles(rows, k)
    lin = Linear((torch.randn(n, k, generator=g) * 0.05).to(BF))
    lin.quantize("int8")
    lin.native = True
    codes, s = lin._q
    # the Linear: the GEMVs up to quant_gemv_rows() rows (they read the codes once), the tiles beyond
    assert torch.equal(lin(x[:rows]), lin.gemv(x[:rows]))
    if m > rows:
        assert torch.equal(lin(x), cpu.gemm_q8_tiles(x, codes, s))


@pytest.mark.parametrize(
    "m,n,k,group", [(9, 576, 576, 64), (100, 130, 64, 32), (1030, 96, 2048, 128), (33, 17, 128, 32)]
)
def test_int4_steps_on_amx_multiply_each_weight_rounded_once(m, n, k, group, amx_unit):
    """On AMX an int4 layer's large steps widen the GEMV's codes to (q - 8) * scale + zero, rounded
    to bf16 (torch's int4 kernel keeps the fp32 value: 2^-9 apart at most), and multiply on the
    tiles: within an ulp of x @ those weights, plus fp32 summation's error. torch's packed copy of
    the codes is never made (the int4 mode held two copies of its codes: no smaller than int8)."""
    from workbench.models.linear import int4_weights

    if amx_unit != "amx":
        pytest.skip("the int4 codes go to the tiles on AMX only (elsewhere torch's int4 kernel)")
    g = torch.Generator().manual_seed(m + n + k)
    lin = Linear((torch.randn(n, k, generator=g) * 0.05).to(BF))
    lin.quantize("int4", group)
    lin.native = True
    x = torch.randn(m, k, generator=g).to(BF)
    codes, scale_zero, _ = lin.gemv.operands
    weights = int4_weights(cpu.unpack_int4(codes), scale_zero, group).to(BF).double()
    exact = x.double() @ weights.t()
    summed = (x.double().abs() @ weights.abs().t()) * 2.0**-20
    out = cpu.gemm_q4_tiles(x, codes, scale_zero, None, group)
    assert bool(((out.double() - exact).abs() <= ulp(exact) + summed).all())
    rows = cpu.quant_gemv_rows()
    assert torch.equal(lin(x[:rows]), lin.gemv(x[:rows]))
    if m > rows:
        assert torch.equal(lin(x), out)
    assert torch.equal(lin.dequantized().double(), weights)
    assert lin._q == () and set(lin.copies_bytes()) == {"quantized"}


@pytest.mark.parametrize("rows", [9, 33, 520, 1100])
@pytest.mark.parametrize("n,k", [(576, 576), (200, 2048)])
def test_on_the_tiles_a_prompts_rows_make_no_onednn_copy(rows, n, k, amx_unit):
    """The tiles take every step of a tiled layer, a prompt's too (on AMX in spans of groups whose
    weights stay in L2, the activations 32 rows at a time: as fast as oneDNN's kernels past 512 rows,
    which needed a copy of the weights in their layout): within an ulp of the exact product, and no
    oneDNN copy made. Spans of one group and of several, the rows split among the threads where the
    spans are too few (576 outputs: 9 groups)."""
    g = torch.Generator().manual_seed(rows + n)
    w = (torch.randn(n, k, generator=g) * 0.05).to(BF)
    b = torch.randn(n, generator=g).to(BF)
    lin = Linear(w, b)
    lin.native, lin.tiled = True, True
    x = torch.randn(rows, k, generator=g).to(BF)
    y = lin(x)
    exact = x.double() @ w.double().t() + b.double()
    # one rounding to bf16 of fp32 sums: an ulp, and the sums' own error where terms cancel
    fp32_sums = 2**-16 * (x.double().abs() @ w.double().abs().t())
    assert bool(((y.double() - exact).abs() <= ulp(exact.float()).double() + fp32_sums).all()), rows
    assert lin._packed is False and lin.copies_bytes().keys() == {"tiles"}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("rows", [cpu.MAX_ROWS + 1, 64, 300])
def test_wide_linear_is_fp32_over_the_bf16_weights(rows):
    """The fp32 path for large steps multiplies in fp32 by oneDNN's packed copy of the weights
    (one copy, no plain fp32 one as well) and equals F.linear in fp32 up to summation order."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(200, 576, generator=g) * 0.05).to(BF)
    b = torch.randn(200, generator=g).to(BF)
    lin = Linear(w, b)
    lin.native, lin.wide = True, True
    x = torch.randn(rows, 576, generator=g).to(BF)
    y = lin(x)
    packed, plain, bias = lin._wide
    assert packed is not None and plain is None and bias.dtype == torch.float32
    ref = F.linear(x.float(), w.float(), b.float())
    assert y.dtype == BF and torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2)
    assert torch.allclose(cpu.packed_linear(x.float(), packed, bias), ref, rtol=1e-5, atol=1e-4)


def test_add_rms_norm_in_place(kern):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=g) * 3).to(BF)
    d = torch.randn(37, 576, generator=g).to(BF)
    w = (torch.rand(576, generator=g) + 0.5).to(BF)
    ref = rms_norm(x + d, w, 1e-5)
    x2 = x.clone()
    out = kern.add_rms_norm(x2, d, w, 1e-5)
    assert torch.equal(x2, x + d)  # the residual stream is updated in place, rounded as torch does
    # one ulp in bf16(x * rsqrt(...)) becomes up to two after the product with the weight
    assert_within_ulps(out, ref, ulps=2)
    x3 = x.clone()
    assert_within_ulps(kern.add_rms_norm(x3, None, w, 1e-5), rms_norm(x, w, 1e-5), ulps=2)
    assert torch.equal(x3, x)


def test_silu_mul_bit_exact(kern):
    gu = (torch.randn(9, 2 * 1539) * 4).to(BF)  # odd width: the scalar tail runs too
    gate, up = gu.chunk(2, -1)
    assert torch.equal(kern.silu_mul(gu), F.silu(gate) * up)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 1, 16), (8, 8, 128)])
def test_rope_write_kv_bit_exact(kern, hq, hkv, d):
    rope = RotaryEmbedding(SimpleNamespace(head_dim=d, rope_theta=10000.0, rope_scaling=None), 2048, "cpu", BF)
    t = 23
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(BF)
    pos = torch.randint(0, 2000, (t,), generator=g)
    slots = torch.randperm(32 * 16, generator=g)[:t]
    slots[3] = -1  # padding: skipped
    kc = torch.zeros(32, 16, hkv, d, dtype=BF)
    vc = torch.zeros_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    qr, kr = rope(pos, q.view(t, hq, d), k.view(t, hkv, d))
    reference.write_kv_ref(kr, v.reshape(t, hkv, d), kc, vc, slots)
    out = kern.rope_write_kv(qkv, pos, rope.cos, rope.sin, slots, kc2, vc2, hq)
    assert torch.equal(out, qr)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)


# head widths of one, two, three (80: the last partly masked) and four 32-lane chunks: the AVX-512
# BF16 kernel keeps two and four in registers, the others take its general loop
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 1, 16, 32), (8, 2, 128, 16), (10, 2, 80, 16)])
def test_paged_decode_matches_torch(kern, hq, hkv, d, bs):
    _check_decode(kern, hq, hkv, d, bs)


# the scores on AMX: a B tile holds up to 16 query heads of a KV head; 16 keys across blocks of 8 gathered
@pytest.mark.parametrize(
    "hq,hkv,d,bs", [(9, 3, 64, 16), (4, 1, 32, 32), (8, 2, 128, 16), (9, 3, 64, 8), (32, 2, 64, 16)]
)
def test_paged_decode_on_amx_matches_torch(amx_unit, hq, hkv, d, bs):
    """Decode attention with its scores on AMX (S^T = K . Q^T, transposed back per head): as close
    to exact attention as torch's bf16 path, within 2 ulps of it, past a 512-key chunk."""
    _check_decode(cpu, hq, hkv, d, bs)


def _check_decode(kern, hq, hkv, d, bs):
    g = torch.Generator().manual_seed(hq * d)
    nb = 160  # blocks: the longest table (1,100 keys in blocks of 8) fits
    kc = (torch.randn(nb, bs, hkv, d, generator=g) * 2).to(BF)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(BF)
    lens = torch.tensor([1, 17, bs, 300, 700 if bs == 16 else 1100], dtype=torch.int32)  # > 512: online softmax
    width = int((lens.max() + bs - 1) // bs)
    assert width <= nb
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in lens]).int()
    q = (torch.randn(len(lens), hq, d, generator=g) * 2).to(BF)
    out = kern.decode_attention(q, kc, vc, tables, lens, d**-0.5)
    # exact attention in fp32 on the same bf16 inputs: ours is as close as torch's bf16 path
    exact = reference.decode_attention_ref(q.float(), kc.float(), vc.float(), tables, lens, d**-0.5)
    ref = reference.decode_attention_ref(q, kc, vc, tables, lens, d**-0.5)
    ours, theirs = (out.float() - exact).abs().max(), (ref.float() - exact).abs().max()
    assert ours <= theirs * 1.5 + 1e-3
    # A probability rounded to bf16 the other way moves an output by a few ulps of the values.
    scale = ref.float().abs().amax(-1, keepdim=True)
    assert bool(((out.float() - ref.float()).abs() <= 2 * ulp(scale)).all())
    assert (out != ref).float().mean().item() <= 0.1


# 1-3 query heads per KV head share each key and value broadcast (the AVX-512 BF16 build); more take a head at a time
@pytest.mark.parametrize(
    "hq,hkv,d,bs",
    [(9, 3, 64, 16), (4, 2, 32, 16), (4, 4, 64, 16), (4, 1, 16, 32), (8, 2, 128, 16), (16, 1, 64, 16)],
)
def test_paged_extend_matches_torch(kern, hq, hkv, d, bs):
    """Prefill chunks and verifies, starting mid-sequence (prefix hits, later chunks) or at 0, in
    tiles of 16 queries (a tile straddles the causal diagonal, a sequence ends mid-tile); 16 query
    heads of 64 per KV head exceed the tile kernel's buffers and take the one-query decodes."""
    if hq // hkv * d > cpu.EXTEND_MAX_GD and kern is not cpu:
        pytest.skip("the one-query-decode fallback runs in this process's variants, not the NEON driver")
    _check_extend(kern, hq, hkv, d, bs, new=[5, 1, 40, 600], lens=[5, 30, 57, 700])


# G = 1-6 query heads per KV head and head dims in multiples of 32 take AMX (7 takes AVX-512 in the
# same call); blocks of 8 keys put a 16-key tile across blocks (gathered), of 32 two tiles in one
@pytest.mark.parametrize(
    "hq,hkv,d,bs",
    [(9, 3, 64, 16), (9, 3, 64, 8), (4, 2, 32, 32), (4, 4, 64, 16), (8, 2, 128, 16), (12, 2, 64, 16), (4, 1, 96, 16),
     (14, 2, 64, 16)],
)  # fmt: skip
def test_paged_extend_on_amx_matches_torch(amx_unit, hq, hkv, d, bs):
    """Prefill attention with its products on AMX (S^T = K . Q^T, acc^T += V^T . P^T, the values
    transposed once a call): as close to exact attention as torch's bf16 path and within 2 ulps of
    it, prompts fresh and after cached keys, across 512-key chunks, an odd tail of keys."""
    assert cpu.extend_on_amx(hq, hkv, d) == (amx_unit == "amx" and hq // hkv <= 6)
    _check_extend(cpu, hq, hkv, d, bs, new=[5, 1, 40, 600, 33, 17], lens=[5, 30, 57, 700, 1101, 17])


def _check_extend(kern, hq, hkv, d, bs, new, lens):
    """`new[i]` tokens of sequence i at the end of its `lens[i]` against the torch references."""
    g = torch.Generator().manual_seed(hq + d)
    nb = 160
    kc = (torch.randn(nb, bs, hkv, d, generator=g) * 2).to(BF)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(BF)
    lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    width = int((lens.max() + bs - 1) // bs)
    assert width <= nb
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in lens]).int()
    q = (torch.randn(int(cu[-1]), hq, d, generator=g) * 2).to(BF)
    out = kern.extend_attention(q, kc, vc, tables, cu, lens, d**-0.5)
    exact = reference.extend_attention_ref(q.float(), kc.float(), vc.float(), tables, cu, lens, d**-0.5)
    ref = reference.extend_attention_ref(q, kc, vc, tables, cu, lens, d**-0.5)
    assert (out.float() - exact).abs().max() <= (ref.float() - exact).abs().max() * 1.5 + 1e-3
    scale = ref.float().abs().amax(-1, keepdim=True)
    assert bool(((out.float() - ref.float()).abs() <= 2 * ulp(scale)).all())


def _int8_cache(g, nb, bs, hkv, d):
    """A random 8-bit paged cache as kv_cache_dtype=int8 stores it (reference.write_kv_ref)."""
    from workbench_kernels.reference import quantize_kv

    kc, ks = quantize_kv((torch.randn(nb * bs, hkv, d, generator=g) * 2).to(BF), torch.int8)
    vc, vs = quantize_kv(torch.randn(nb * bs, hkv, d, generator=g).to(BF), torch.int8)
    return (
        kc.view(nb, bs, hkv, d),
        vc.view(nb, bs, hkv, d),
        ks.view(nb, bs, hkv).float(),
        vs.view(nb, bs, hkv).float(),
    )


@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 1, 16, 32), (8, 2, 128, 16)])
def test_paged_decode_over_an_int8_cache(native_variant, hq, hkv, d, bs):
    """kv_cache_dtype=int8: our kernel reads the 8-bit rows and their scales (half a bf16 row's
    bytes) and is as close to exact attention over that cache as the torch reference (which
    widens the cache to bf16 first), within a few bf16 ulps of it, past a 512-key chunk too."""
    g = torch.Generator().manual_seed(hq * d + 1)
    nb = 96
    kc, vc, ks, vs = _int8_cache(g, nb, bs, hkv, d)
    lens = torch.tensor([1, 17, bs, 300, 700 if bs == 16 else 1100], dtype=torch.int32)
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in lens]).int()
    q = (torch.randn(len(lens), hq, d, generator=g) * 2).to(BF)
    out = cpu.decode_attention(q, kc, vc, tables, lens, d**-0.5, ks, vs)
    ref = reference.decode_attention_ref(q, kc, vc, tables, lens, d**-0.5, ks, vs)
    # exact attention over the same 8-bit cache, widened in fp32: ours is as close as torch's
    exact = reference.decode_attention_ref(q.float(), kc, vc, tables, lens, d**-0.5, ks, vs)
    assert (out.float() - exact).abs().max() <= (ref.float() - exact).abs().max() * 1.5 + 1e-3
    scale = ref.float().abs().amax(-1, keepdim=True)
    assert bool(((out.float() - ref.float()).abs() <= 4 * ulp(scale)).all())


def test_paged_extend_over_an_int8_cache(native_variant):
    """A prefill over an int8 cache widens just the blocks its sequences read to bf16 and runs the
    tiled kernel: the torch reference's numbers, from mid-sequence and from 0."""
    g = torch.Generator().manual_seed(5)
    nb, bs, hq, hkv, d = 96, 16, 9, 3, 64
    kc, vc, ks, vs = _int8_cache(g, nb, bs, hkv, d)
    new = [5, 1, 40, 600]
    lens = torch.tensor([5, 30, 57, 700], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in lens]).int()
    q = (torch.randn(int(cu[-1]), hq, d, generator=g) * 2).to(BF)
    out = cpu.extend_attention(q, kc, vc, tables, cu, lens, d**-0.5, ks, vs)
    ref = reference.extend_attention_ref(q, kc, vc, tables, cu, lens, d**-0.5, ks, vs)
    scale = ref.float().abs().amax(-1, keepdim=True)
    assert bool(((out.float() - ref.float()).abs() <= 2 * ulp(scale)).all())


def test_decode_attention_fp8_cache_falls_back():
    """An fp8 cache has no kernel of ours: the torch reference runs, exactly."""
    kc = torch.zeros(4, 16, 1, 16, dtype=torch.float8_e4m3fn)
    scale = torch.ones(4, 16, 1)
    q = torch.randn(1, 2, 16).to(BF)
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    out = cpu.decode_attention(q, kc, kc, tables, lens, 0.25, scale, scale)
    ref = reference.decode_attention_ref(q, kc, kc, tables, lens, 0.25, scale, scale)
    assert torch.equal(out, ref)


# -- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-bf16")
    make_tiny_model(path, "llama", seed=3)
    from workbench import LLM

    return LLM(str(path), dtype="bfloat16")


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 5, 17, 33, 64, 90)]


def test_engine_uses_cpu_kernels_and_agrees_with_torch_ops(tiny_bf16):
    from workbench import SamplingParams

    llm = tiny_bf16
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    llm.configure(cpu_kernels=True)
    status = llm.status()
    assert status["cpu_kernels"] is True and status["attention_backend"] == "cpu"
    assert status["kernel_variant"] == cpu.variant()
    assert status["kernel_variant_reason"].startswith(cpu.variant_reason())
    width, width_why, _ = cpu.gemv_width()
    assert (f"bf16 GEMVs in {width} registers ({width_why})" in status["kernel_variant_reason"]) == bool(width)
    assert status["compute_path"] == cpu.gemm_path()[0] and "GFLOP/s" in status["compute_path_reason"]
    native = llm.generate(None, sp, prompt_token_ids=_prompts())
    llm.configure(cpu_kernels=False)
    status = llm.status()
    assert status["cpu_kernels"] is False and status["attention_backend"] == "torch"
    assert status["kernel_variant"] == "torch" and "cpu_kernels is off" in status["kernel_variant_reason"]
    plain = llm.generate(None, sp, prompt_token_ids=_prompts())
    assert_agree_up_to_near_ties(native, plain)
    llm.configure(cpu_kernels=True)


@pytest.mark.parametrize("gemm", cpu.GEMM_PATHS)
def test_engine_on_every_variant_and_compute_path(tmp_path_factory, native_variant, gemm, monkeypatch):
    """Each variant the CPU runs, with large steps (prefills of more than MAX_ROWS tokens) in bf16,
    in fp32 over the bf16 weights and (AVX-512 BF16) on our bf16 tiles, serves what torch's ops
    serve, up to near-ties."""
    from workbench import LLM, SamplingParams

    if gemm == "tiles" and not cpu.tiles_available():
        pytest.skip(f"the bf16 tiles are the avx512_bf16 build's; {native_variant} has none")
    path = tmp_path_factory.mktemp("tiny-llama-variant")
    make_tiny_model(path, "llama", seed=3)
    rates = dict.fromkeys(cpu.GEMM_PATHS, 1.0)
    monkeypatch.setattr(cpu, "_gemm", (gemm, f"forced to {gemm} by the test", rates))
    llm = LLM(str(path), dtype="bfloat16")
    status = llm.status()
    assert (status["kernel_variant"], status["compute_path"]) == (native_variant, gemm)
    linears = llm.engine.runner.model.linears()
    assert all((lin.wide, lin.tiled) == (gemm == "fp32", gemm == "tiles") for lin in linears)
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    native = llm.generate(None, sp, prompt_token_ids=_prompts())
    prefilled = [lin for layer in llm.engine.runner.model.layers for lin in layer.linears()]
    assert all((lin._tiles is not None) == (gemm == "tiles") for lin in prefilled)  # the prefills took them
    llm.configure(cpu_kernels=False)
    assert_agree_up_to_near_ties(native, llm.generate(None, sp, prompt_token_ids=_prompts()))


def test_engine_in_either_gemv_width(tmp_path_factory, bf16_dot_width):
    """The one-call layer and stack (decode steps) run the same GEMVs: in either register width the
    engine serves what torch's ops serve, up to near-ties."""
    from workbench import LLM, SamplingParams

    path = tmp_path_factory.mktemp("tiny-llama-width")
    make_tiny_model(path, "llama", seed=4)
    llm = LLM(str(path), dtype="bfloat16")
    assert f"bf16 GEMVs in {bf16_dot_width} registers" in llm.status()["kernel_variant_reason"]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    native = llm.generate(None, sp, prompt_token_ids=_prompts())
    llm.configure(cpu_kernels=False)
    assert_agree_up_to_near_ties(native, llm.generate(None, sp, prompt_token_ids=_prompts()))


@pytest.mark.parametrize("arch", ["mixtral", "gemma3"])
def test_unfused_layers_on_every_variant(tmp_path_factory, native_variant, arch):
    """MoE (each chosen expert's GEMV) and Gemma 3 (layers composed in torch around our GEMVs and
    attention kernels) on each variant the CPU runs serve what torch's ops serve, up to near-ties."""
    from workbench import LLM, SamplingParams

    path = tmp_path_factory.mktemp(f"tiny-{arch}-variant")
    make_tiny_model(path, arch, seed=3)
    llm = LLM(str(path), dtype="bfloat16")
    status = llm.status()
    assert status["kernel_variant"] == native_variant and "layers not fused" in status["kernel_variant_reason"]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    native = llm.generate(None, sp, prompt_token_ids=_prompts())
    llm.configure(cpu_kernels=False)
    assert_agree_up_to_near_ties(native, llm.generate(None, sp, prompt_token_ids=_prompts()))


def test_float32_models_say_why_they_run_torch(tmp_path):
    from workbench import LLM

    make_tiny_model(tmp_path, "llama", seed=3)
    status = LLM(str(tmp_path), dtype="float32").status()
    assert status["cpu_kernels"] is False and status["kernel_variant"] == "torch"
    assert "bf16" in status["kernel_variant_reason"] and "float32" in status["kernel_variant_reason"]


def _select_in_subprocess(**env) -> list[str]:
    code = "from workbench_kernels import cpu; print(cpu.variant()); print(cpu.variant_reason())"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()


def test_variant_selection_and_its_reasons():
    best = cpu.runnable()[0]
    assert cpu.variant() == best or os.environ.get("WORKBENCH_CPU_ISA")
    for v in cpu.runnable():
        assert _select_in_subprocess(WORKBENCH_CPU_ISA=v) == [v, f"forced by WORKBENCH_CPU_ISA={v}"]
    foreign = "neon" if cpu._arch() == "x86_64" else "avx2"
    chosen, why = _select_in_subprocess(WORKBENCH_CPU_ISA=foreign)
    assert chosen == best and f"WORKBENCH_CPU_ISA={foreign} refused" in why and "another architecture" in why
    chosen, why = _select_in_subprocess(WORKBENCH_CPU_ISA="avx9")
    assert chosen == best and "'avx9' is not a variant" in why and "portable" in why
    assert _select_in_subprocess(WORKBENCH_CPU_KERNELS="0") == ["None", "disabled by WORKBENCH_CPU_KERNELS=0"]


def test_reason_names_the_missing_features(monkeypatch):
    """An AVX2-only CPU (Zen 3, most laptops) gets the avx2 build, and is told why."""
    if cpu._arch() != "x86_64":
        pytest.skip("x86 feature flags")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"sse2", "avx", "avx2", "fma", "f16c"})
    monkeypatch.setattr(cpu, "_sel", cpu._Selection())
    monkeypatch.delenv("WORKBENCH_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu, "_errors", {})
    monkeypatch.setattr(cpu, "_libs", {})
    assert cpu.runnable() == ["avx2", "portable"]
    assert cpu.variant() == "avx2"
    assert cpu.variant_reason() == "not avx512: this CPU lacks avx512f, avx512bw, avx512vl"


def test_neon_decode_layer_matches_portable(neon_driver):
    """The one-call layer of the NEON build (under qemu) against the portable build in-process:
    same source, same inputs, so they agree up to fp32 summation order."""
    neon = cpu_qemu.QemuKernels(neon_driver)
    g = torch.Generator().manual_seed(7)
    h, hq, hkv, d, inter, bs, t = 64, 4, 2, 16, 96, 16, 3
    ws = [
        (torch.randn(n, k, generator=g) * 0.1).to(BF)
        for n, k in (((hq + 2 * hkv) * d, h), (h, hq * d), (2 * inter, h), (h, inter))
    ]
    ln1, ln2 = (torch.rand(h, generator=g) + 0.5).to(BF), (torch.rand(h, generator=g) + 0.5).to(BF)
    rope = RotaryEmbedding(SimpleNamespace(head_dim=d, rope_theta=10000.0, rope_scaling=None), 256, "cpu", BF)
    positions = torch.tensor([5, 6, 40])
    tables = torch.tensor([[3, 1, 0], [3, 1, 0], [2, 4, 5]], dtype=torch.int32)
    slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for i, p in enumerate(positions.tolist())])
    step = dict(
        positions=positions,
        slots=slots,
        tables=tables,
        lens=(positions + 1).to(torch.int32),
        cos=rope.cos,
        sin=rope.sin,
        heads=hq,
        kv_heads=hkv,
        head_dim=d,
        intermediate=inter,
        scale=d**-0.5,
    )
    x = torch.randn(t, h, generator=g).to(BF)
    delta = torch.randn(t, h, generator=g).to(BF)
    kc = torch.randn(8, bs, hkv, d, generator=g).to(BF)
    vc = torch.randn(8, bs, hkv, d, generator=g).to(BF)
    x_neon, kc_neon, vc_neon = x.clone(), kc.clone(), vc.clone()
    out_neon = neon.decode_layer(ws, ln1, ln2, 1e-5, step, x_neon, delta, kc_neon, vc_neon)
    cpu.use("portable")
    try:
        layer = cpu.DecodeLayer(*(cpu.Gemv("bf16", w) for w in ws), ln1, ln2, 1e-5)
        s = cpu.DecodeStep(
            hidden=h,
            heads=hq,
            kv_heads=hkv,
            head_dim=d,
            intermediate=inter,
            block_size=bs,
            positions=positions,
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=step["lens"],
            cos=rope.cos,
            sin=rope.sin,
            scale=d**-0.5,
        )
        out = layer(s, x, delta, kc, vc)
    finally:
        cpu.use(None)
    assert torch.equal(x_neon, x)  # the residual add is elementwise: bit-exact
    assert torch.equal(kc_neon, kc) and torch.equal(vc_neon, vc)
    assert_within_ulps(out_neon, out, max_fraction=0.2, ulps=4)


def test_cpu_kernels_toggle_mid_stream_keeps_requests(tiny_bf16):
    from workbench import SamplingParams

    llm = tiny_bf16
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine = llm.engine
    ids = [engine.add_request(None, sp, prompt_token_ids=p) for p in _prompts()]
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        outs.update({c.request_id: c.output for c in engine.step() if c.output is not None})
        steps += 1
        if steps % 5 == 0:
            engine.configure(cpu_kernels=not engine.settings.cpu_kernels)
    assert steps > 10
    assert all(len(outs[i].token_ids) == 30 and outs[i].finish_reason == "length" for i in ids)
    llm.configure(cpu_kernels=True)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_one_call_layer_equals_op_by_op(tiny_bf16, quantization, monkeypatch):
    """Decode steps of up to MAX_ROWS sequences run each layer in one C call; that call must give
    exactly what the op-by-op C path gives (same kernels, same order)."""
    tiny_bf16.configure(cpu_kernels=True, quantization=quantization)
    calls = _fused_against_op_by_op(tiny_bf16, _prompts()[: cpu.MAX_ROWS], monkeypatch)
    assert calls and all(fused for fused, _ in calls)
    tiny_bf16.configure(quantization="none")


def test_one_call_layer_takes_tiled_steps_of_up_to_64_rows(tiny_bf16, monkeypatch):
    """On the tiles path decode steps of 9..64 sequences run in one call too (the tiles inside the
    layer's parallel region), exactly as op by op; a quantised layer has no tiles and goes op by op."""
    if not cpu.tiles_available():
        pytest.skip(f"the bf16 tiles are the avx512_bf16 build's; this host runs {cpu.variant()}")
    monkeypatch.setattr(cpu, "_gemm", ("tiles", "forced by the test", dict.fromkeys(cpu.GEMM_PATHS, 1.0)))
    tiny_bf16.configure(cpu_kernels=False)
    tiny_bf16.configure(cpu_kernels=True)  # binds the linears to the tiles path
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (70,), generator=g).tolist() for _ in range(12)]  # prefills of > 64 tokens
    calls = _fused_against_op_by_op(tiny_bf16, prompts, monkeypatch)
    assert any(fused and rows == 12 for fused, rows in calls)
    tiny_bf16.configure(quantization="int8")
    assert tiny_bf16.engine.runner.model.layers[0].qkv.fused_tiles() is None
    calls = _fused_against_op_by_op(tiny_bf16, prompts, monkeypatch)
    assert not any(fused for fused, rows in calls if rows > cpu.MAX_ROWS)
    tiny_bf16.configure(quantization="none", cpu_kernels=False)
    monkeypatch.undo()
    tiny_bf16.configure(cpu_kernels=True)


def _fused_against_op_by_op(llm, prompts, monkeypatch) -> list[tuple[bool, int]]:
    """Generate with the one-call layer where it applies, then with every layer op by op: the same
    tokens and log-probabilities. Returns (one call?, rows) for each layer of the first run."""
    from workbench import SamplingParams
    from workbench.models.cpu_forward import CpuKernelForward

    calls = []
    original = CpuKernelForward._one_call

    def counting(self, layer, rows):
        fused = original(self, layer, rows)
        calls.append((fused is not None, rows))
        return fused

    monkeypatch.setattr(CpuKernelForward, "_one_call", counting)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    llm.reset_prefix_cache()  # both runs compute the prompts afresh (a prefix hit's tail may take another path)
    fused = llm.generate(None, sp, prompt_token_ids=prompts)
    monkeypatch.setattr(CpuKernelForward, "_one_call", lambda self, layer, rows: None)
    llm.reset_prefix_cache()
    op_by_op = llm.generate(None, sp, prompt_token_ids=prompts)
    monkeypatch.setattr(CpuKernelForward, "_one_call", original)
    for a, b in zip(fused, op_by_op):
        assert a.token_ids == b.token_ids
        assert [t.logprob for t in a.logprobs] == [t.logprob for t in b.logprobs]
    return calls


def test_amx_says_why_and_can_be_turned_off():
    on, why = cpu.amx()
    flags = cpu.cpu_flags()
    if cpu.variant() != "avx512_bf16":
        assert not on and why == f"the {cpu.variant() or 'no'} build has no AMX path"
    elif not {"amx_tile", "amx_bf16"} <= flags:
        assert not on and why == "this CPU has no AMX (amx_tile, amx_bf16)"
    else:
        assert on or "arch_prctl" in why or "WORKBENCH_CPU_AMX" in why
    code = "from workbench_kernels import cpu; print(cpu.amx()); print(cpu._require().wb_amx())"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "WORKBENCH_CPU_AMX": "0"},
    )  # fmt: skip
    expected = "(False, 'off: WORKBENCH_CPU_AMX=0')" if cpu.variant() == "avx512_bf16" and "amx_bf16" in flags else ""
    assert r.stdout.splitlines()[1] == "0" and r.stdout.splitlines()[0].startswith(expected or "(False")


def test_the_tiles_on_amx_serve_within_a_share_of_the_fastest():
    rates = {"bf16": 2000.0, "fp32": 400.0, "tiles": 1600.0}
    assert cpu.pick_gemm(rates, False) == ("bf16", "")
    path, note = cpu.pick_gemm(rates, True)  # 0.8 of oneDNN's: the tiles on AMX
    assert path == "tiles" and note.startswith("; the tiles on AMX within 30% of oneDNN bf16")
    assert cpu.pick_gemm({**rates, "tiles": 1300.0}, True) == ("bf16", "")  # 0.65: too slow
    assert cpu.pick_gemm({**rates, "tiles": 2100.0}, True) == ("tiles", "")  # the fastest anyway
    # elsewhere the usual path serves unless another leads it by USUAL_MARGIN
    assert cpu.pick_gemm({**rates, "tiles": 1700.0}, False, "tiles")[0] == "tiles"  # 1.18x: kept
    assert cpu.pick_gemm({**rates, "tiles": 1600.0}, False, "tiles") == ("bf16", "")  # 1.25x: a clear lead
    busy = {"bf16": 22.5, "fp32": 24.3, "tiles": 22.9}  # every call a timeslice: no path leads
    assert cpu.pick_gemm(busy, False, "tiles")[0] == "tiles" and cpu.pick_gemm(busy, True)[0] == "tiles"


def test_a_busy_host_measures_no_path_and_keeps_the_usual(monkeypatch):
    """Where every round of the probe differs (two busy threads beside it on 2 vCPUs), the path is
    this kind of CPU's usual fastest, and the reason says the host was too busy."""
    unsteady = {"bf16": [22.5, 1900.0, 30.1], "fp32": [300.0, 24.0, 20.0], "tiles": [20.0, 25.0, 2100.0]}
    monkeypatch.setattr(cpu, "_interleaved_rates", lambda steps, flop: {p: unsteady[p] for p in steps})
    monkeypatch.setattr(cpu, "_gemm", None)
    path, why, rates = cpu.gemm_path()
    assert path == cpu.usual_gemm_path()[0] and "too busy to measure steadily" in why
    assert rates == {p: max(unsteady[p]) for p in rates}


def test_gemm_path_is_measured_and_can_be_forced():
    path, why, rates = cpu.gemm_path()
    usual = cpu.usual_gemm_path()
    assert path == cpu.pick_gemm(rates, cpu.amx()[0], usual[0])[0] or "forced" in why or why.startswith(usual[1])
    assert why.startswith(("measured:", "forced", usual[1])) and "GFLOP/s" in why
    code = "from workbench_kernels import cpu; print(cpu.gemm_path()[0]); print(cpu.gemm_path()[1])"
    assert set(rates) == set(cpu.GEMM_PATHS) if cpu.tiles_available() else set(rates) == {"bf16", "fp32"}
    for forced in rates:
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "WORKBENCH_CPU_GEMM": forced},
        )
        assert r.stdout.splitlines()[0] == forced and f"forced by WORKBENCH_CPU_GEMM={forced}" in r.stdout
