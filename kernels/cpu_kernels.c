// CPU kernels for bf16 decode: the engine's fast path on a CPU.
//
// Why they exist: at one token per step a 135M model spends more time in per-op overhead
// (dispatch, small allocations, casts) than in reading its weights. These kernels read the
// weights once at full bandwidth (GEMVs for bf16, int8 and int4 weights), read the paged KV
// cache in place (no gather copy), and fuse the small per-layer ops.
//
// One source, one build per instruction set (workbench_kernels/cpu.py compiles it with each
// variant's flags and loads the best one the CPU runs): the arithmetic is written over the
// 16-lane vector layer of cpu_vec.h. Where AVX-512 BF16 is present (__AVX512BF16__) the bf16 dot
// products use vdpbf16ps (32 bf16 multiply-adds an instruction) on the raw bf16 values; elsewhere
// bf16 stays in memory and is widened to fp32 in registers for the arithmetic.
//
// Numerics follow the torch reference where it matters for exactness: every bf16 rounding that
// torch performs in the elementwise ops (RMSNorm, RoPE, SiLU*up, residual adds) happens here at
// the same point; matmuls and attention accumulate in fp32.
//
// Layouts are documented in cpu.py. The library links against the libgomp torch already loaded,
// so both share one thread pool.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_vec.h"

#if defined(WB_AVX512) && defined(__AVX512BF16__)
#define WB_BF16_DOT 1
#define WB_VARIANT "avx512_bf16"
#else
#define WB_BF16_DOT 0
#define WB_VARIANT WB_ISA
#endif
// The builds whose quantised GEMVs take activations re-laid out per call (int8_prepare,
// int4_prepare) instead of plain fp32 copies: AVX-512 BF16 and AVX2.
#if defined(__AVX2__) && !defined(WB_AVX512) && !defined(WB_PORTABLE)
#define WB_AVX2_ONLY 1
#else
#define WB_AVX2_ONLY 0
#endif
#if WB_BF16_DOT || WB_AVX2_ONLY
#define WB_QUANT_PREPARED 1
#else
#define WB_QUANT_PREPARED 0
#endif

int wb_abi_version(void) { return 3; }
// The instruction set this build was compiled for, as cpu.py names the variants.
const char *wb_variant(void) { return WB_VARIANT; }

// ---------------------------------------------------------------------------------------------
// GEMV-shaped matmuls: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for a few rows m < M (the
// engine sends up to 8; they go MAX_M at a time).
// Each thread streams a contiguous range of output rows, ROWS rows at a time, so the weights are
// read exactly once per call whatever M is.

#define ROWS 4
#define MAX_M 4
// Software prefetch PREFETCH_BLOCKS row blocks ahead: rows are short (a 576-wide bf16 row is 18
// cache lines), too short for the hardware prefetcher to ramp up on; measured 8.5 ms instead of
// 11.6 ms for SmolLM2's weights per token on the 2-core box, ~31 GB/s, the DRAM read rate.
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2
#endif
#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
// The bf16 GEMVs read each weight row whole, one row after another (each thread's rows are one
// sequential stream), with 2-4 accumulators per row for the multiply-add latency, prefetching
// BF16_AHEAD elements (4 KB) ahead. Against 4-row blocks read in lockstep (4 interleaved streams),
// SmolLM2's 121 GEMVs of a token: 7.6-8.2 -> 6.0-6.3 ms (avx512_bf16), 7.1-7.4 -> 5.6-6.0 ms (avx2),
// 4 activation rows: 6.2 -> 5.4 and 9.2 -> 6.5 ms, on the 2-core box.
#define BF16_AHEAD 2048

// Each thread takes a contiguous range of ROWS-row blocks; activation rows go MAX_M at a time
// (a block's weights are still in L1 for the next group), and the group size is a compile-time
// constant inside the block kernels (the switch), so their accumulators stay in registers. OMP is the work-sharing
// construct: "omp parallel for" for a call of its own, "omp for" inside the fused layer's region.
#define ROW_BLOCKS(OMP, BLOCK, ...)                                           \
    do {                                                                      \
        int64_t blocks_ = (N + ROWS - 1) / ROWS;                              \
        _Pragma(OMP)                                                          \
        for (int64_t b_ = 0; b_ < blocks_; b_++) {                            \
            int64_t n0 = b_ * ROWS;                                           \
            int nr = N - n0 < ROWS ? (int)(N - n0) : ROWS;                    \
            for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {                       \
                switch (M - m0 < MAX_M ? M - m0 : MAX_M) {                    \
                case 1: BLOCK(__VA_ARGS__, m0, n0, nr, 1); break;             \
                case 2: BLOCK(__VA_ARGS__, m0, n0, nr, 2); break;             \
                case 3: BLOCK(__VA_ARGS__, m0, n0, nr, 3); break;             \
                default: BLOCK(__VA_ARGS__, m0, n0, nr, 4); break;            \
                }                                                             \
            }                                                                 \
        }                                                                     \
    } while (0)
#define PARALLEL "omp parallel for schedule(static)"
#define SHARED "omp for schedule(static)"

static inline void store_row(bf16 *y, int64_t N, int64_t m, int64_t n, float v, const bf16 *bias) {
    if (bias) v += bf2f(bias[n]);
    y[m * N + n] = f2bf(v);
}

// The accumulators of a block: one vector per (activation row, weight row), summed across lanes
// into y at the end, times the weight row's scale where there is one (int8).
static inline void acc_clear(vf acc[MAX_M][ROWS], const int M) {
    for (int m = 0; m < M; m++)
        for (int r = 0; r < ROWS; r++) acc[m][r] = vf_zero();
}

static inline void acc_store(vf acc[MAX_M][ROWS], const int M, int nr, bf16 *y, int64_t N, int64_t m0, int64_t n0,
                             const bf16 *scale, const bf16 *bias) {
    for (int r = 0; r < nr; r++) {
        for (int m = 0; m < M; m++) {
            float v = vf_sum(acc[m][r]);
            store_row(y, N, m0 + m, n0 + r, scale ? v * bf2f(scale[n0 + r]) : v, bias);
        }
    }
}

// The row-sequential bf16 GEMV's accumulators: U per activation row (more for fewer rows, to hide
// the multiply-add latency), summed into one weight row's outputs at the end.
#define ROW_ACCS 4
static inline int row_accs(const int M) { return M == 1 ? 4 : M == 2 ? 2 : 1; }

static inline void row_acc_clear(vf acc[MAX_M][ROW_ACCS], const int M, const int U) {
    for (int m = 0; m < M; m++)
        for (int u = 0; u < U; u++) acc[m][u] = vf_zero();
}

static inline void row_acc_store(vf acc[MAX_M][ROW_ACCS], const int M, const int U, bf16 *y, int64_t N, int64_t m0,
                                 int64_t n, const bf16 *bias) {
    for (int m = 0; m < M; m++) {
        vf t = acc[m][0];
        for (int u = 1; u < U; u++) t = vf_add(t, acc[m][u]);
        store_row(y, N, m0 + m, n, vf_sum(t), bias);
    }
}

#if !WB_BF16_DOT
// Activations as fp32, for the kernels that multiply in fp32 (the builds without vdpbf16ps).
static void bf16_to_f32(const bf16 *x, float *f, int64_t n) {
    for (int64_t i = 0; i < n; i++) f[i] = bf2f(x[i]);
}

static float *to_f32(const bf16 *x, int64_t n) {
    float *f = (float *)aligned_alloc(64, ((n * 4 + 63) / 64) * 64);
    bf16_to_f32(x, f, n);
    return f;
}
#endif

#if WB_BF16_DOT
#include <immintrin.h>
// bf16 weights: vdpbf16ps does 16 (ymm) or 32 (zmm) multiply-adds per instruction on bf16 pairs; x
// is bf16 here. The register width is the host's, chosen by measurement (cpu.gemv_width): a core
// whose AVX-512 units are 256 bits wide (Zen 4) streams the weights faster in ymm registers, with
// half the prefetch distance: SmolLM2's 121 GEMVs of a token at 21.6-21.8 GB/s in zmm, 25.9-31.2
// in ymm on a 2-vCPU Zen 4 guest (zmm with the shorter distance: 23.2). There a single row (a lone
// decode) streams faster on the hardware prefetchers alone: weights in 2 MiB pages, eight
// interleaved pairs of runs, 25.3-43.2 -> 27.2-49.7 GB/s, faster in every pair; with 4 rows it was
// a wash (19.7-26.9 against 22.7-25.8) and with 8 the prefetch won (11.5-12.5 against 9.4-10.7).
static int gemv_ymm = 0;
void wb_set_gemv_ymm(int64_t on) { gemv_ymm = on != 0; }
int64_t wb_gemv_ymm(void) { return gemv_ymm; }
#define BF16_AHEAD_YMM 1024

static inline float hsum256(__m256 t) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline void gemv_bf16_row_ymm(const bf16 *x, const bf16 *wr, const bf16 *bias, bf16 *y, int64_t N,
                                     int64_t K, int64_t m0, int64_t n, const int M, int prefetch) {
    const int U = row_accs(M);
    __m256 acc[MAX_M][ROW_ACCS];
    for (int m = 0; m < M; m++)
        for (int u = 0; u < U; u++) acc[m][u] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U) {
        for (int u = 0; u < U; u++) {
            if (prefetch && !(u & 1)) PREFETCH(wr + BF16_AHEAD_YMM + k + 16 * u);  // a line per 32 values
            __m256bh wv = (__m256bh)_mm256_loadu_si256((const __m256i *)(wr + k + 16 * u));
            for (int m = 0; m < M; m++)
                acc[m][u] = _mm256_dpbf16_ps(acc[m][u], wv,
                                             (__m256bh)_mm256_loadu_si256((const __m256i *)(x + (m0 + m) * K + k + 16 * u)));
        }
    }
    for (; k < K; k += 16) {
        __mmask16 mk = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
        __m256bh wv = (__m256bh)_mm256_maskz_loadu_epi16(mk, wr + k);
        for (int m = 0; m < M; m++)
            acc[m][0] = _mm256_dpbf16_ps(acc[m][0], wv, (__m256bh)_mm256_maskz_loadu_epi16(mk, x + (m0 + m) * K + k));
    }
    for (int m = 0; m < M; m++) {
        __m256 t = acc[m][0];
        for (int u = 1; u < U; u++) t = _mm256_add_ps(t, acc[m][u]);
        store_row(y, N, m0 + m, n, hsum256(t), bias);
    }
}

static inline void gemv_bf16_row_zmm(const bf16 *x, const bf16 *wr, const bf16 *bias, bf16 *y, int64_t N,
                                     int64_t K, int64_t m0, int64_t n, const int M) {
    const int U = row_accs(M);
    vf acc[MAX_M][ROW_ACCS];  // vf is __m512 in this build
    row_acc_clear(acc, M, U);
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U) {
        for (int u = 0; u < U; u++) {
            PREFETCH(wr + BF16_AHEAD + k + 32 * u);
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * u);
            for (int m = 0; m < M; m++)
                acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, (__m512bh)_mm512_loadu_si512(x + (m0 + m) * K + k + 32 * u));
        }
    }
    for (; k < K; k += 32) {
        __mmask32 mk = K - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mk, wr + k);
        for (int m = 0; m < M; m++)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(mk, x + (m0 + m) * K + k));
    }
    row_acc_store(acc, M, U, y, N, m0, n, bias);
}

// `rows`: the call's activation rows (M: this group's, at most MAX_M)
static inline void gemv_bf16_block(const bf16 *x, const bf16 *w, const bf16 *bias, bf16 *y, int64_t N,
                                   int64_t K, int64_t rows, int64_t m0, int64_t n0, int nr, const int M) {
    for (int r = 0; r < nr; r++) {
        if (gemv_ymm)
            gemv_bf16_row_ymm(x, w + (n0 + r) * K, bias, y, N, K, m0, n0 + r, M, rows > 1);
        else
            gemv_bf16_row_zmm(x, w + (n0 + r) * K, bias, y, N, K, m0, n0 + r, M);
    }
}
#else
// Without vdpbf16ps the register width is the build's (one choice): the switch says so.
void wb_set_gemv_ymm(int64_t on) { (void)on; }
int64_t wb_gemv_ymm(void) { return 0; }
// bf16 weights widened to fp32 in registers; x is fp32 here (converted once per call).
static inline void gemv_bf16_block(const float *xf, const bf16 *w, const bf16 *bias, bf16 *y, int64_t N,
                                   int64_t K, int64_t m0, int64_t n0, int nr, const int M) {
    const int U = row_accs(M);
    for (int r = 0; r < nr; r++) {
        const bf16 *wr = w + (n0 + r) * K;
        vf acc[MAX_M][ROW_ACCS];
        row_acc_clear(acc, M, U);
        int64_t k = 0;
        for (; k + 16 * U <= K; k += 16 * U) {
            for (int u = 0; u < U; u += 2) PREFETCH(wr + BF16_AHEAD + k + 16 * u);
            for (int u = 0; u < U; u++) {
                vf wv = vf_load_bf(wr + k + 16 * u);
                for (int m = 0; m < M; m++) acc[m][u] = vf_fma(wv, vf_load(xf + (m0 + m) * K + k + 16 * u), acc[m][u]);
            }
        }
        for (; k + 16 <= K; k += 16) {
            vf wv = vf_load_bf(wr + k);
            for (int m = 0; m < M; m++) acc[m][0] = vf_fma(wv, vf_load(xf + (m0 + m) * K + k), acc[m][0]);
        }
        if (k < K) {
            vf wv = vf_load_bf_n(wr + k, K - k);
            for (int m = 0; m < M; m++) acc[m][0] = vf_fma(wv, vf_load_n(xf + (m0 + m) * K + k, K - k), acc[m][0]);
        }
        row_acc_store(acc, M, U, y, N, m0, n0 + r, bias);
    }
}
#endif

// The three GEMV entry points share one signature (x, weights, aux, bias, y, M, N, K, group) so the
// caller binds a weight once and calls any of them the same way; aux and group are unused here.
void wb_gemv_bf16(const bf16 *x, const bf16 *w, const void *aux, const bf16 *bias, bf16 *y, int64_t M, int64_t N,
                  int64_t K, int64_t group) {
    (void)aux, (void)group;
#if WB_BF16_DOT
    ROW_BLOCKS(PARALLEL, gemv_bf16_block, x, w, bias, y, N, K, M);
#else
    float *xf = to_f32(x, M * K);
    ROW_BLOCKS(PARALLEL, gemv_bf16_block, xf, w, bias, y, N, K);
    free(xf);
#endif
}

// int8 weights, per-row scale: y = (x . q) * scale. K % 16 == 0.
// int4 weights, asymmetric groups in torch's convention: w = (q - 8) * scale + zero, q in 0..15.
// Row n holds K/2 bytes; within each run of 32 values, byte j packs value j (low nibble) and value
// j + 16 (high nibble), so one 16-byte load unpacks into two 16-lane vectors. `scale_zero` is bf16
// [N, K / group, 2] (torch's own values: 4 bytes a group, not fp32's 8). K % 32 == 0; group is a
// power of two >= 32.
#if WB_QUANT_PREPARED
#define INT8_SPAN 4096 // int32 lanes flush to fp32 every INT8_SPAN values: 256 products of <= 128 * 32767

// Each weight row whole, one after another (a thread's rows are one sequential stream, prefetched
// QUANT_AHEAD bytes ahead), as the bf16 GEMVs read theirs: in 4-row lockstep the int8 head read
// 7 GB/s on one thread whatever the arithmetic cost.
#define QUANT_AHEAD 2048

// Each activation row's (-136 sum(x), sum(x)) per group, [M, K / group, 2] floats: the pairs the
// rows' bf16 (scale, zero) pairs dot into the int4 zero term.
static void int4_group_sums(const bf16 *x, int64_t M, int64_t K, int64_t group, float *sums) {
    int64_t G = K / group;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float sx = 0;
            for (int64_t j = 0; j < group; j++) sx += bf2f(x[m * K + g * group + j]);
            sums[(m * G + g) * 2] = -136.0f * sx;
            sums[(m * G + g) * 2 + 1] = sx;
        }
}
#endif

#if WB_BF16_DOT
// Widening each int8 weight or int4 code to fp32 and multiplying it there, four rows in lockstep,
// bound these GEMVs by arithmetic and access order, not memory: SmolLM2's int4 layers and int8
// head of a token read 13-16 GB/s that way, where its bf16 GEMVs read 29 (2-vCPU Zen 4). Here both
// multiply in the formats the weights already are, and read rows as the bf16 GEMVs do:
//
// int8: the activations as int16 fixed point, one scale per activation row (max |x| -> 32767), and
// vpdpwssd (32 int16 products an instruction, summed exactly in int32). Rounding x costs at most
// max|x| / 65534 an element, under bf16's own rounding for every element within a factor of 128
// of the row's largest; a sum moves by at most that times sum |w|, which only sums cancelling to
// near zero notice against their own bf16 rounding.
//
// int4: a code q in 0..15 under the high bits 0x4300 is the bf16 number 128 + q, exactly; one
// and/or makes the codes bf16 and vdpbf16ps multiplies them by the bf16 activations as they are.
// A group sums to scale * sum((128 + q) x) + (zero - 136 scale) * sum(x): the first term in the
// loop, the second once per row at the end, as the dot of the row's (scale, zero) pairs with the
// (-136 sum(x), sum(x)) of each group, computed once per call.
//
// Each call first re-lays out its activations (int8_prepare, int4_prepare) in a scratch of
// quant_scratch_bytes(M, K); the weights and their layouts are every build's.

static inline int64_t run_pairs_len(int64_t K) { return (K + 63) & ~(int64_t)63; }

static int64_t quant_scratch_bytes(int64_t M, int64_t K) {
    return (M * run_pairs_len(K) * 2 + M * (K / 16 + 1) * 4 + 127) & ~(int64_t)63;
}

// The scratch: [M, K] int16 activations (int8) or [M, K rounded up to 64] re-laid-out bf16 ones
// (int4), then per row the int8 scale or the int4 group sums.
static inline float *quant_scratch_tail(void *scratch, int64_t M, int64_t K) {
    return (float *)((bf16 *)scratch + M * run_pairs_len(K));
}

// The four rows of a block summed across their lanes at once (three shuffle-and-add rounds for all
// four, not four reductions: a short row's reduction cost a third of its time) and stored.
static inline void store_rows4(vf a[ROWS], bf16 *y, int64_t N, int64_t m, int64_t n0, int nr, const bf16 *bias) {
    _Static_assert(ROWS == 4, "store_rows4 sums four rows");
    __m512 a01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
    __m512 a23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
    __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, 0x88), _mm512_shuffle_f32x4(a01, a23, 0xDD));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E)); // 128-bit lane r: row r's four partial sums
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
    float sums[16];
    _mm512_storeu_ps(sums, t);
    for (int r = 0; r < nr; r++) store_row(y, N, m, n0 + r, sums[4 * r], bias);
}

static inline void gemv_int8_block(const int16_t *x16, const float *dx, const int8_t *q, const bf16 *scale,
                                   const bf16 *bias, bf16 *y, int64_t N, int64_t K, int64_t m0, int64_t n0, int nr,
                                   const int M) {
    vf acc[MAX_M][ROWS];
    acc_clear(acc, M);
    for (int r = 0; r < nr; r++) {
        const int8_t *wr = q + (n0 + r) * K;
        for (int64_t k0 = 0; k0 < K; k0 += INT8_SPAN) {
            int64_t end = K - k0 < INT8_SPAN ? K : k0 + INT8_SPAN, k = k0;
            __m512i part[MAX_M][2];
            for (int m = 0; m < M; m++) part[m][0] = part[m][1] = _mm512_setzero_si512();
            for (; k + 64 <= end; k += 64) {
                PREFETCH(wr + QUANT_AHEAD + k);
                __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + k)));
                __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + k + 32)));
                for (int m = 0; m < M; m++) {
                    const int16_t *xr = x16 + (m0 + m) * K + k;
                    part[m][0] = _mm512_dpwssd_epi32(part[m][0], w0, _mm512_loadu_si512(xr));
                    part[m][1] = _mm512_dpwssd_epi32(part[m][1], w1, _mm512_loadu_si512(xr + 32));
                }
            }
            for (; k < end; k += 32) {
                __mmask32 mk = end - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (end - k)) - 1);
                __m512i w = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mk, wr + k));
                for (int m = 0; m < M; m++)
                    part[m][0] = _mm512_dpwssd_epi32(part[m][0], w, _mm512_maskz_loadu_epi16(mk, x16 + (m0 + m) * K + k));
            }
            for (int m = 0; m < M; m++)
                acc[m][r] = _mm512_add_ps(acc[m][r], _mm512_cvtepi32_ps(_mm512_add_epi32(part[m][0], part[m][1])));
        }
        // the row's scale and the activations' fixed-point scale, on the lanes before the sum
        for (int m = 0; m < M; m++) acc[m][r] = _mm512_mul_ps(acc[m][r], _mm512_set1_ps(dx[m0 + m] * bf2f(scale[n0 + r])));
    }
    for (int m = 0; m < M; m++) store_rows4(acc[m], y, N, m0 + m, n0, nr, bias);
}

// A row's activations as [run0 0..15, run1 0..15, run0 16..31, run1 16..31] per 64 values (the
// order two runs' codes widen to from one 32-byte load; zero-padded to whole 64s), then each
// row's (-136 sum(x), sum(x)) per group.
static void int4_prepare(const bf16 *x, int64_t M, int64_t K, int64_t group, void *scratch) {
    int64_t K64 = run_pairs_len(K);
    bf16 *xp = (bf16 *)scratch;
    for (int64_t m = 0; m < M; m++) {
        const bf16 *xr = x + m * K;
        bf16 *o = xp + m * K64;
        for (int64_t k = 0; k < K64; k += 64)
            for (int64_t j = 0; j < 16; j++) {
                const int64_t from[4] = {k + j, k + 32 + j, k + 16 + j, k + 48 + j};
                for (int h = 0; h < 4; h++) o[k + 16 * h + j] = from[h] < K ? xr[from[h]] : 0;
            }
    }
    int4_group_sums(x, M, K, group, quant_scratch_tail(scratch, M, K));
}

// One step of a row: 64 values (two runs, or one at the end of a row) into acc.
static inline void int4_step(const uint8_t *wq, const bf16 *s, const bf16 *xp, int64_t K64, int whole, int pair,
                             vf *acc, const int M) {
    const __m512i nibble = _mm512_set1_epi16(0x000F), as_bf16 = _mm512_set1_epi16(0x4300);
    // groups of 32: lanes 0-7 sum the first run and 8-15 the second, so they take scale0 and scale1,
    // the bf16 words 0 and 2 of (scale0, zero0, scale1, zero1) in each lane's high half (= fp32)
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x20000, 0x20000, 0x20000, 0x20000, 0x20000,
                                           0x20000, 0x20000, 0x20000);
    __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(whole ? 0xffffffffu : 0xffffu, wq));
    __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(b, nibble, as_bf16, 0xEA); // (b & 0xF) | 0x4300
    __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), as_bf16);
    __m512 sv = pair && whole ? _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
                                    0xAAAAAAAAu, pick, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)s))))
                              : _mm512_set1_ps(bf2f(s[0]));
    for (int m = 0; m < M; m++) {
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xp + m * K64));
        acc[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(t, hi, (__m512bh)_mm512_loadu_si512(xp + m * K64 + 32)), sv, acc[m]);
    }
}

static inline void gemv_int4_block(const bf16 *xp, const float *cv, const uint8_t *q, const bf16 *sl,
                                   const bf16 *bias, bf16 *y, int64_t N, int64_t K, int64_t group, int64_t m0,
                                   int64_t n0, int nr, const int M) {
    const int64_t K64 = run_pairs_len(K), G = K / group;
    const int gshift = __builtin_ctzll(group), pair = group == 32; // group: a power of two (cpu.py checks)
    const bf16 *x0 = xp + m0 * K64;
    vf rows[MAX_M][ROWS];
    acc_clear(rows, M);
    for (int r = 0; r < nr; r++) {
        const int64_t n = n0 + r;
        const uint8_t *wr = q + n * (K / 2);
        const bf16 *sr = sl + n * G * 2;
        vf acc[2][MAX_M]; // two chains, alternate steps
        for (int m = 0; m < M; m++) acc[0][m] = acc[1][m] = vf_zero();
        int64_t k = 0;
        for (; k + 128 <= K; k += 128) {
            PREFETCH(wr + QUANT_AHEAD + k / 2);
            int4_step(wr + k / 2, sr + ((k >> gshift) << 1), x0 + k, K64, 1, pair, acc[0], M);
            int4_step(wr + k / 2 + 32, sr + (((k + 64) >> gshift) << 1), x0 + k + 64, K64, 1, pair, acc[1], M);
        }
        for (; k < K; k += 64)
            int4_step(wr + k / 2, sr + ((k >> gshift) << 1), x0 + k, K64, K - k >= 64, pair, acc[0], M);
        for (int m = 0; m < M; m++) {
            // the zero term joins the lanes before the sum across them
            vf a = _mm512_add_ps(acc[0][m], acc[1][m]);
            const float *c = cv + (m0 + m) * G * 2;
            for (int64_t i = 0; i < G * 2; i += 16) a = vf_fma(vf_load_bf_n(sr + i, G * 2 - i), vf_load_n(c + i, G * 2 - i), a);
            rows[m][r] = a;
        }
    }
    for (int m = 0; m < M; m++) store_rows4(rows[m], y, N, m0 + m, n0, nr, bias);
}

#elif WB_AVX2_ONLY
// AVX2 (Zen 3 and older): widening each int8 weight or int4 code to fp32 (vpmovzxbd, vcvtdq2ps)
// bound these GEMVs at 4-13 G values/s a core, under half the bf16 GEMVs' DRAM rate, and
// vcvtdq2ps and the widening loads share the pipes the multiply-adds need (a 2-vCPU Zen 3
// guest). Here neither converts in the loop, and rows are read whole, one after another:
//
// int8: as the AVX-512 BF16 build, activations as int16 fixed point (one scale per activation
// row, the same bound) and vpmaddwd (16 exact int16 products an instruction, summed in int32).
//
// int4: a code q under the high bits 0x4300 is the bf16 number 128 + q, and a bf16 number in the
// high half of a 32-bit lane is the same fp32 number: a shift (even codes) or an and (odd codes)
// makes the codes fp32 exactly, so the activations stay exact fp32. They are re-laid out per run of
// 32 as the codes widen (even values, then odd, for each nibble half). A group sums to
// scale * sum((128 + q) x) + (zero - 136 scale) * sum(x), the second term one dot per row as in
// the AVX-512 BF16 build.

static int64_t quant_scratch_bytes(int64_t M, int64_t K) { return (M * K * 4 + M * (K / 16 + 1) * 4 + 127) & ~(int64_t)63; }

// The scratch: [M, K] int16 activations (int8) or fp32 re-laid-out ones (int4), then per row the
// int8 scale or the int4 group sums.
static inline float *quant_scratch_tail(void *scratch, int64_t M, int64_t K) { return (float *)scratch + M * K; }

static inline void gemv_int8_block(const int16_t *x16, const float *dx, const int8_t *q, const bf16 *scale,
                                   const bf16 *bias, bf16 *y, int64_t N, int64_t K, int64_t m0, int64_t n0, int nr,
                                   const int M) {
    vf acc[MAX_M][ROWS];
    for (int r = 0; r < nr; r++) {
        const int8_t *wr = q + (n0 + r) * K;
        __m256 row[MAX_M];
        for (int m = 0; m < M; m++) row[m] = _mm256_setzero_ps();
        for (int64_t k0 = 0; k0 < K; k0 += INT8_SPAN) {
            int64_t end = K - k0 < INT8_SPAN ? K : k0 + INT8_SPAN, k = k0;
            __m256i part[MAX_M][2];
            for (int m = 0; m < M; m++) part[m][0] = part[m][1] = _mm256_setzero_si256();
            for (; k + 32 <= end; k += 32) {
                PREFETCH(wr + QUANT_AHEAD + k);
                __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + k)));
                __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + k + 16)));
                for (int m = 0; m < M; m++) {
                    const int16_t *xr = x16 + (m0 + m) * K + k;
                    part[m][0] = _mm256_add_epi32(part[m][0], _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xr)));
                    part[m][1] =
                        _mm256_add_epi32(part[m][1], _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xr + 16))));
                }
            }
            if (k < end) { // K % 16 == 0
                __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + k)));
                for (int m = 0; m < M; m++)
                    part[m][0] = _mm256_add_epi32(
                        part[m][0], _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)(x16 + (m0 + m) * K + k))));
            }
            for (int m = 0; m < M; m++)
                row[m] = _mm256_add_ps(row[m], _mm256_cvtepi32_ps(_mm256_add_epi32(part[m][0], part[m][1])));
        }
        // the row's scale and the activations' fixed-point scale, on the lanes before the sum
        for (int m = 0; m < M; m++) {
            acc[m][r].a = _mm256_mul_ps(row[m], _mm256_set1_ps(dx[m0 + m] * bf2f(scale[n0 + r])));
            acc[m][r].b = _mm256_setzero_ps();
        }
    }
    acc_store(acc, M, nr, y, N, m0, n0, NULL, bias);
}

// Per run of 32: [x0 x2 .. x14, x1 x3 .. x15, x16 x18 .. x30, x17 .. x31] (the order the codes come
// out in), then each row's (-136 sum(x), sum(x)) per group. K % 32 == 0.
static void int4_prepare(const bf16 *x, int64_t M, int64_t K, int64_t group, void *scratch) {
    float *xp = (float *)scratch;
    for (int64_t m = 0; m < M; m++) {
        const bf16 *xr = x + m * K;
        float *o = xp + m * K;
        for (int64_t k = 0; k < K; k += 32)
            for (int64_t j = 0; j < 8; j++) {
                o[k + j] = bf2f(xr[k + 2 * j]);
                o[k + 8 + j] = bf2f(xr[k + 2 * j + 1]);
                o[k + 16 + j] = bf2f(xr[k + 16 + 2 * j]);
                o[k + 24 + j] = bf2f(xr[k + 16 + 2 * j + 1]);
            }
    }
    int4_group_sums(x, M, K, group, quant_scratch_tail(scratch, M, K));
}

// One group of a row: sum((128 + q) x) over its runs of 32, times the group's scale, into row.
static inline void int4_group(const uint8_t *wq, const float *x, int64_t K, int64_t group, const bf16 *sz,
                              __m256 *row, const int M) {
    const __m256i nibble = _mm256_set1_epi16(0x000F), as_bf16 = _mm256_set1_epi16(0x4300);
    const __m256i high_half = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 even[MAX_M], odd[MAX_M];
    for (int m = 0; m < M; m++) even[m] = odd[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < group; k += 32) {
        if ((k & 127) == 0) PREFETCH(wq + QUANT_AHEAD + k / 2);
        __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wq + k / 2)));
        __m256i lo = _mm256_or_si256(_mm256_and_si256(w, nibble), as_bf16);
        __m256i hi = _mm256_or_si256(_mm256_srli_epi16(w, 4), as_bf16);
        __m256 lo_even = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
        __m256 lo_odd = _mm256_castsi256_ps(_mm256_and_si256(lo, high_half));
        __m256 hi_even = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
        __m256 hi_odd = _mm256_castsi256_ps(_mm256_and_si256(hi, high_half));
        for (int m = 0; m < M; m++) {
            const float *xr = x + m * K + k;
            __m256 e = _mm256_fmadd_ps(lo_even, _mm256_loadu_ps(xr), even[m]);
            __m256 o = _mm256_fmadd_ps(lo_odd, _mm256_loadu_ps(xr + 8), odd[m]);
            even[m] = _mm256_fmadd_ps(hi_even, _mm256_loadu_ps(xr + 16), e);
            odd[m] = _mm256_fmadd_ps(hi_odd, _mm256_loadu_ps(xr + 24), o);
        }
    }
    // the scale: the low bf16 of the group's (scale, zero) pair, shifted into an fp32's high half
    __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32(*(const int32_t *)sz), 16));
    for (int m = 0; m < M; m++) row[m] = _mm256_fmadd_ps(_mm256_add_ps(even[m], odd[m]), s, row[m]);
}

static inline void gemv_int4_block(const float *xp, const float *cv, const uint8_t *q, const bf16 *sl,
                                   const bf16 *bias, bf16 *y, int64_t N, int64_t K, int64_t group, int64_t m0,
                                   int64_t n0, int nr, const int M) {
    const int64_t G = K / group;
    const float *x0 = xp + m0 * K;
    vf acc[MAX_M][ROWS];
    for (int r = 0; r < nr; r++) {
        const uint8_t *wr = q + (n0 + r) * (K / 2);
        const bf16 *sr = sl + (n0 + r) * G * 2;
        __m256 row[2][MAX_M]; // two chains, alternate groups
        for (int m = 0; m < M; m++) row[0][m] = row[1][m] = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 2 <= G; g += 2) {
            int4_group(wr + g * group / 2, x0 + g * group, K, group, sr + 2 * g, row[0], M);
            int4_group(wr + (g + 1) * group / 2, x0 + (g + 1) * group, K, group, sr + 2 * g + 2, row[1], M);
        }
        if (g < G) int4_group(wr + g * group / 2, x0 + g * group, K, group, sr + 2 * g, row[0], M);
        for (int m = 0; m < M; m++) {
            // the zero term joins the lanes before the sum across them: whole 8s, then one by one (the
            // shared vf_load_n tail goes through a zero-padded copy: 7-8% slower on the token here)
            const float *c = cv + (m0 + m) * G * 2;
            __m256 a = _mm256_add_ps(row[0][m], row[1][m]), z = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= G * 2; i += 8)
                z = _mm256_fmadd_ps(wb_widen8(_mm_loadu_si128((const __m128i *)(sr + i))), _mm256_loadu_ps(c + i), z);
            float rest = 0;
            for (; i < G * 2; i++) rest += bf2f(sr[i]) * c[i];
            acc[m][r].a = _mm256_add_ps(a, z);
            acc[m][r].b = _mm256_set_ps(0, 0, 0, 0, 0, 0, 0, rest);
        }
    }
    acc_store(acc, M, nr, y, N, m0, n0, NULL, bias);
}

#else
static inline void gemv_int8_block(const float *xf, const int8_t *q, const bf16 *scale, const bf16 *bias,
                                   bf16 *y, int64_t N, int64_t K, int64_t m0, int64_t n0, int nr, const int M) {
    vf acc[MAX_M][ROWS];
    acc_clear(acc, M);
    for (int64_t k = 0; k < K; k += 16) {
        vf xv[MAX_M];
        for (int m = 0; m < M; m++) xv[m] = vf_load(xf + (m0 + m) * K + k);
        for (int r = 0; r < ROWS; r++) {
            if (r >= nr) break;
            if ((k & 63) == 0) PREFETCH(q + (n0 + r + PREFETCH_BLOCKS * ROWS) * K + k);
            vf wv = vf_load_i8(q + (n0 + r) * K + k);
            for (int m = 0; m < M; m++) acc[m][r] = vf_fma(wv, xv[m], acc[m][r]);
        }
    }
    acc_store(acc, M, nr, y, N, m0, n0, scale, bias);
}

void wb_gemv_int8(const bf16 *x, const int8_t *q, const bf16 *scale, const bf16 *bias, bf16 *y, int64_t M,
                  int64_t N, int64_t K, int64_t group) {
    (void)group;
    float *xf = to_f32(x, M * K);
    ROW_BLOCKS(PARALLEL, gemv_int8_block, xf, q, scale, bias, y, N, K);
    free(xf);
}

static inline void gemv_int4_block(const float *xf, const uint8_t *q, const bf16 *sl, const bf16 *bias,
                                   bf16 *y, int64_t N, int64_t K, int64_t group, int64_t m0, int64_t n0,
                                   int nr, const int M) {
    vf acc[MAX_M][ROWS];
    acc_clear(acc, M);
#if defined(WB_AVX512)
    // The 16 weights a group's codes stand for, as a table: vpermps looks codes up (it reads only an
    // index's low 4 bits, so no masking), cheaper than convert-and-scale; measured 3.4 vs 3.9 ms
    // for SmolLM2's int4 layers per token. Same values as fma(code, scale, low) below.
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
    int64_t groups = K / group;
    for (int r = 0; r < nr && m0 == 0; r++) {
        const char *p = (const char *)(sl + (n0 + r + PREFETCH_BLOCKS * ROWS) * groups * 2);
        for (int64_t o = 0; o < groups * 4; o += 64) PREFETCH(p + o);
    }
    for (int64_t k = 0; k < K; k += 32) {
        vf xlo[MAX_M], xhi[MAX_M];
        for (int m = 0; m < M; m++) {
            xlo[m] = vf_load(xf + (m0 + m) * K + k);
            xhi[m] = vf_load(xf + (m0 + m) * K + k + 16);
        }
        int64_t g = k / group;
        for (int r = 0; r < ROWS; r++) {
            if (r >= nr) break;
            int64_t n = n0 + r;
            if ((k & 127) == 0) PREFETCH(q + (n + PREFETCH_BLOCKS * ROWS) * (K / 2) + k / 2);
            const uint8_t *qb = q + n * (K / 2) + k / 2;
            // low = zero - 8 scale, rounded once in fp32 as torch rounds it
            float s = bf2f(sl[(n * groups + g) * 2]);
            vf scale = vf_set1(s), low = vf_set1(bf2f(sl[(n * groups + g) * 2 + 1]) - 8.0f * s);
#if defined(WB_AVX512)
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qb));
            __m512 table = _mm512_fmadd_ps(codes, scale, low);
            vf w0 = _mm512_permutexvar_ps(b, table);
            vf w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
#else
            vf w0 = vf_fma(vf_load_u4(qb, 0), scale, low);
            vf w1 = vf_fma(vf_load_u4(qb, 1), scale, low);
#endif
            for (int m = 0; m < M; m++) {
                acc[m][r] = vf_fma(w0, xlo[m], acc[m][r]);
                acc[m][r] = vf_fma(w1, xhi[m], acc[m][r]);
            }
        }
    }
    acc_store(acc, M, nr, y, N, m0, n0, NULL, bias);
}

void wb_gemv_int4(const bf16 *x, const uint8_t *q, const bf16 *scale_zero, const bf16 *bias, bf16 *y, int64_t M,
                  int64_t N, int64_t K, int64_t group) {
    float *xf = to_f32(x, M * K);
    ROW_BLOCKS(PARALLEL, gemv_int4_block, xf, q, scale_zero, bias, y, N, K, group);
    free(xf);
}
#endif

#if WB_QUANT_PREPARED
// The int8 activations as int16 fixed point, max |x| -> 32767, and each row's scale (both builds).
static void int8_prepare(const bf16 *x, int64_t M, int64_t K, void *scratch) {
    int16_t *x16 = (int16_t *)scratch;
    float *dx = quant_scratch_tail(scratch, M, K);
    for (int64_t m = 0; m < M; m++) {
        float top = 0;
        for (int64_t k = 0; k < K; k++) top = fmaxf(top, fabsf(bf2f(x[m * K + k])));
        float inv = top > 0 ? 32767.0f / top : 0.0f;
        dx[m] = top / 32767.0f;
        for (int64_t k = 0; k < K; k++) x16[m * K + k] = (int16_t)nearbyintf(fminf(fmaxf(bf2f(x[m * K + k]) * inv, -32767.0f), 32767.0f));
    }
}

void wb_gemv_int8(const bf16 *x, const int8_t *q, const bf16 *scale, const bf16 *bias, bf16 *y, int64_t M,
                  int64_t N, int64_t K, int64_t group) {
    (void)group;
    void *scratch = aligned_alloc(64, quant_scratch_bytes(M, K));
    int8_prepare(x, M, K, scratch);
    ROW_BLOCKS(PARALLEL, gemv_int8_block, (const int16_t *)scratch, quant_scratch_tail(scratch, M, K), q, scale, bias,
               y, N, K);
    free(scratch);
}

void wb_gemv_int4(const bf16 *x, const uint8_t *q, const bf16 *scale_zero, const bf16 *bias, bf16 *y, int64_t M,
                  int64_t N, int64_t K, int64_t group) {
    void *scratch = aligned_alloc(64, quant_scratch_bytes(M, K));
    int4_prepare(x, M, K, group, scratch);
    ROW_BLOCKS(PARALLEL, gemv_int4_block, (const void *)scratch, quant_scratch_tail(scratch, M, K), q, scale_zero,
               bias, y, N, K, group);
    free(scratch);
}
#endif

// ---------------------------------------------------------------------------------------------
// Batched decode steps (tens of rows) on AVX-512 BF16: a GEMM over weights packed for it. At these
// sizes the work is compute-bound, and a weight row dotted with one activation row at a time leaves
// vdpbf16ps waiting on its own latency. Here each weight pair is broadcast-free: the packed layout
// puts 16 outputs' (k, k+1) pairs in one register, each activation pair is broadcast, and a tile of
// TM rows x 64 outputs keeps 24 accumulators with no horizontal sums. Layout (cpu.pack_tiles):
// [N / 64][K / 2][4][16][2] bf16, zero-padded to whole groups of 64 outputs, so one group's step
// is 256 contiguous bytes and a thread's groups are one stream.
#define TN 64
#define TM 6
#define TILES_AHEAD 8192  // bytes: how far a one-pass task fetches its own weights ahead
#if WB_BF16_DOT
static inline void tile_group(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t N, int64_t K,
                              int64_t g, const bf16 *next, int64_t m0, const int MR) {
    int64_t KP = K / 2;
    __m512 acc[TM][4];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
    const bf16 *w = wp + g * KP * TN * 2;
    for (int64_t kp = 0; kp < KP; kp++) {
        if (next) {  // the first rows of a group fetch the next group's weights, 4 lines a step
            for (int j = 0; j < 4; j++) PREFETCH(next + kp * TN * 2 + 32 * j);
        }
        __m512bh wv[4];
        for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + kp * TN * 2 + 32 * j);
        for (int m = 0; m < MR; m++) {
            int32_t pair;
            memcpy(&pair, x + (m0 + m) * K + 2 * kp, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
        }
    }
    for (int j = 0; j < 4; j++) {
        int64_t n0 = g * TN + 16 * j;
        if (n0 >= N) break;
        __mmask16 mk = N - n0 >= 16 ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
        __m512 b = bias ? wb_widen_bf(_mm256_maskz_loadu_epi16(mk, bias + n0)) : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++)
            _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0, mk, wb_narrow_bf(_mm512_add_ps(acc[m][j], b)));
    }
}
#endif

// The same products on AMX (Sapphire Rapids and later): a tdpbf16ps multiplies 16 rows x 32 inputs
// by 32 inputs x 16 outputs, 8,192 multiply-adds, where vdpbf16ps does 32. The tiles' layout is
// already AMX's: a B tile (16 input pairs x 16 outputs x 2) is 64 contiguous bytes of each of 16
// consecutive pair rows of a group, 256 bytes apart; A tiles are the activation rows as they lie.
// Blocks of 32 rows x 32 outputs (2 x 2 accumulator tiles), the two halves of a group in turn.
// Products of bf16 are exact in fp32 and the sums are fp32: the same rounding as the AVX-512 tiles
// up to summation order. Off unless cpu.py turns it on (the CPU has AMX and the kernel granted
// its state, `wb_amx_init`); K must be a multiple of 32, else the AVX-512 tiles serve.
#if WB_BF16_DOT && defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#define WB_AMX 1
#include <sys/syscall.h>
extern long syscall(long number, ...);  // unistd.h declares it only outside strict C11
#else
#define WB_AMX 0
#endif
static int amx_on = 0;

// 1 when this process may use AMX's tile state (Linux asks each process to request it).
int64_t wb_amx_init(void) {
#if WB_AMX
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

void wb_set_amx(int64_t on) { amx_on = WB_AMX && on; }
int64_t wb_amx(void) { return amx_on; }

#if WB_AMX
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

// tiles 0-3: accumulators (rows 0-15 x outputs 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31);
// 4, 5: the two A tiles (ma, mb rows); 6, 7: the two B tiles. mb may be 0 (then 2, 3, 5 unused).
AMX_TARGET static void amx_configure(int ma, int mb) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    int rows[8] = {ma, ma, mb, mb, ma, mb, 16, 16};
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)(rows[t] ? rows[t] : 1);
        c.colsb[t] = 64;
    }
    // GCC 12 does not see ldtilecfg read the whole struct: out of line it dropped the stores of
    // rows and colsb, and the load faulted. The barrier keeps them.
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

AMX_TARGET static void amx_release(void) { _tile_release(); }

// One block: rows m0 .. m0 + ma + mb of x, outputs 32h .. 32h + 31 of group g, into y.
// With `fetch` (a task's first block, which reads the weights from memory), the weight rows of the
// fourth step ahead are prefetched: tile loads alone wait on DRAM's latency, one after another.
AMX_TARGET static void amx_block(const bf16 *x, const bf16 *wg, const bf16 *scale, const bf16 *bias, bf16 *y,
                                 int64_t N, int64_t K, int64_t g, int h, int64_t m0, int ma, int mb, int fetch) {
    const bf16 *w = wg + 32 * (2 * h);
    _tile_zero(0);
    _tile_zero(1);
    if (mb) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const bf16 *a = x + m0 * K;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const bf16 *b = w + (k0 / 2) * TN * 2;
        if (fetch && k0 + 128 < K) {
            const char *ahead = (const char *)(b + 64 * TN * 2);
            for (int r = 0; r < 16; r++) {
                PREFETCH(ahead + r * TN * 4);
                PREFETCH(ahead + r * TN * 4 + 64);
            }
        }
        _tile_loadd(4, a + k0, K * 2);
        _tile_loadd(6, b, TN * 4);
        _tile_loadd(7, b + 32, TN * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (mb) {
            _tile_loadd(5, a + 16 * K + k0, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    float c[32][32];
    _tile_stored(0, &c[0][0], 128);
    _tile_stored(1, &c[0][16], 128);
    if (mb) {
        _tile_stored(2, &c[16][0], 128);
        _tile_stored(3, &c[16][16], 128);
    }
    for (int j = 0; j < 2; j++) {
        int64_t n0 = g * TN + 32 * h + 16 * j;
        if (n0 >= N) break;
        __mmask16 mk = N - n0 >= 16 ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
        __m512 bv = bias ? wb_widen_bf(_mm256_maskz_loadu_epi16(mk, bias + n0)) : _mm512_setzero_ps();
        // scale: the int8 weights' per output, else 1 (exact: bf16 weights round acc + bias once)
        __m512 sv = scale ? wb_widen_bf(_mm256_maskz_loadu_epi16(mk, scale + n0)) : _mm512_set1_ps(1.0f);
        for (int m = 0; m < ma + mb; m++)
            _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0, mk,
                                     wb_narrow_bf(_mm512_fmadd_ps(_mm512_loadu_ps(&c[m][16 * j]), sv, bv)));
    }
}

// r[i] lane j -> r[j] lane i, for 16 registers of 16 32-bit lanes: swapping the off-diagonal blocks
// of 8, 4, 2 and 1 lanes in turn, each swap one two-source permute per register.
static inline void transpose16_epi32(__m512i r[16]) {
    for (int b = 8; b; b >>= 1) {
        int lo_idx[16], hi_idx[16];
        for (int l = 0; l < 16; l++) {
            lo_idx[l] = (l & b) ? 16 + l - b : l;  // row i keeps its own lanes, takes row i + b's low ones
            hi_idx[l] = (l & b) ? 16 + l : l + b;  // row i + b takes row i's high lanes, keeps its own
        }
        __m512i lo = _mm512_loadu_si512(lo_idx), hi = _mm512_loadu_si512(hi_idx);
        for (int i = 0; i < 16; i++) {
            if (i & b) continue;
            __m512i a = r[i], c = r[i + b];
            r[i] = _mm512_permutex2var_epi32(a, lo, c);
            r[i + b] = _mm512_permutex2var_epi32(a, hi, c);
        }
    }
}

// Quantised codes of outputs n0 .. n0 + 31 (those past N zero) widened to bf16 into columns
// o0 .. o0 + 31 of one group in the tiles' layout ([K / 2][64][2]): per 16 outputs and 32 inputs,
// 16 rows converted in registers and transposed as (k, k + 1) pairs. int8 (`sz` NULL): rows of K
// codes, exact in bf16 (|q| <= 127 needs 7 of its 8 bits; the scale is the epilogue's). int4: rows
// of the GEMV's nibbles with bf16 (scale, zero) per `group` inputs, (q - 8) * scale + zero in fp32
// rounded once to bf16 (torch's int4 kernel multiplies the fp32 value: 2^-9 apart at most).
static void codes_to_tiles(const void *codes, const bf16 *sz, int64_t group, int64_t N, int64_t K, int64_t n0,
                           int o0, bf16 *buf) {
    for (int c = 0; c < 32; c += 16) {
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                int64_t n = n0 + c + i;
                if (n >= N) {
                    r[i] = _mm512_setzero_si512();
                    continue;
                }
                __m512 lo, hi;
                if (!sz) {
                    const int8_t *src = (const int8_t *)codes + n * K + k0;
                    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
                    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16))));
                } else {
                    const uint8_t *src = (const uint8_t *)codes + (n * K + k0) / 2;
                    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
                    const bf16 *p = sz + (n * (K / group) + k0 / group) * 2;
                    __m512 scale = _mm512_set1_ps(bf2f(p[0])), zero = _mm512_set1_ps(bf2f(p[1]));
                    __m512 eight = _mm512_set1_ps(8.0f);
                    __m512 qlo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
                    __m512 qhi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
                    lo = _mm512_fmadd_ps(_mm512_sub_ps(qlo, eight), scale, zero);
                    hi = _mm512_fmadd_ps(_mm512_sub_ps(qhi, eight), scale, zero);
                }
                r[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            }
            transpose16_epi32(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512(buf + ((k0 / 2 + j) * TN + o0 + c) * 2, r[j]);
        }
    }
}

// Rows m0 .. (up to 32 of them before `last`) as two A tiles of *ma and *mb rows, the tiles configured
// for them unless the last block's were the same (`configured`: that shape, -1 before the first).
AMX_TARGET static inline void amx_rows(int64_t m0, int64_t last, int *configured, int *ma, int *mb) {
    int rows = last - m0 < 32 ? (int)(last - m0) : 32;
    *ma = rows < 16 ? rows : 16;
    *mb = rows - *ma;
    if (*configured != *ma * 32 + *mb) {
        amx_configure(*ma, *mb);
        *configured = *ma * 32 + *mb;
    }
}

// On AMX (inside the caller's parallel region), a task a group's half over a chunk of up to 512 rows,
// chunk by chunk: a single row's step (the halves share out evenly, and each weight is read once, as
// by the GEMVs), and quantised codes whose activations fit in L2 (`q`, `wp` NULL; `sz` and `group` for
// int4, `codes_to_tiles`), which each task first widens into the tiles' layout in a buffer of its
// thread (L1-sized), multiplies from there, and scales by output (`scale`, int8's).
#define AMX_CHUNK 512
AMX_TARGET static void amx_groups(const bf16 *x, const bf16 *wp, const void *q, const bf16 *sz, int64_t group,
                                  const bf16 *scale, const bf16 *bias, bf16 *y, int64_t M, int64_t N, int64_t K) {
    int64_t halves = 2 * ((N + TN - 1) / TN), chunks = (M + AMX_CHUNK - 1) / AMX_CHUNK;
    int configured = -1;
    bf16 *buf = q ? aligned_alloc(64, (size_t)K * TN * sizeof(bf16)) : NULL;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < chunks * halves; task++) {
        int64_t gh = task % halves, g = gh / 2, first = task / halves * AMX_CHUNK;
        int64_t last = first + AMX_CHUNK < M ? first + AMX_CHUNK : M;
        const bf16 *wg = wp ? wp + g * (K / 2) * TN * 2 : buf;
        if (q) codes_to_tiles(q, sz, group, N, K, g * TN + 32 * (gh % 2), 32 * (int)(gh % 2), buf);
        for (int64_t m0 = first; m0 < last; m0 += 32) {
            int ma, mb;
            amx_rows(m0, last, &configured, &ma, &mb);
            amx_block(x, wg, scale, bias, y, N, K, g, (int)(gh % 2), m0, ma, mb, !q && m0 == first);
        }
    }
    if (configured >= 0) amx_release();
    free(buf);
}

// Steps of more rows on AMX (inside the caller's parallel region): a task is a span of groups (~1 MB
// of weights, which stay in L2) over a part of the rows, 32 rows at a time against each half group of
// the span in turn (the 32 rows stay in L1-L2). The weights are read from memory once per part, the
// activations once per span. Tasks of a half group over 512 rows (before) read the activations
// again for every half group (2 GB from L3 at a 1,024-token prompt of Llama-3.2-1B's gate/up) and
// each weight once per 512 rows: interleaved in one process, the spans took Llama-3.2-1B's shape's
// linears 1.2-1.4x as fast at 2-64 rows and 1.1-1.3x at 128-1,536 (past 512 rows 1.03-1.09x oneDNN's
// AMX kernels, where the half groups were 0.87x), SmolLM2's 1.05-1.3x (past 512 rows 0.84-0.92x
// oneDNN's, its prompts' TTFT within 3%). So the tiles take every step on AMX, one row's excepted:
// a span is too coarse to share out evenly where every byte of weight is read once (SmolLM2's 9 groups
// of outputs in 5 spans on 2 threads).
// With `q` (quantised codes, `wp` NULL; `sz` and `group` for int4, `codes_to_tiles`), each task first
// widens its span's codes into the tiles' layout in a buffer of its thread (~1 MB, L2), multiplies
// from there, and scales the sums by output (`scale`, int8's): where the activations outgrow L2 (the
// half groups re-read them each). Codes at 1,024 rows 1.22x the half groups' speed on SmolLM2's
// linears, 1.33x on the 1B shape's; below, the half groups' L1-sized buffer led (SmolLM2 at 64-256
// rows 1.06-1.14x, the 1B shape at 16 rows 1.06-1.1x).
#define AMX_SPAN_BYTES (1 << 20)
AMX_TARGET static void amx_spans(const bf16 *x, const bf16 *wp, const void *q, const bf16 *sz, int64_t group,
                                 const bf16 *scale, const bf16 *bias, bf16 *y, int64_t M, int64_t N, int64_t K) {
    int64_t groups = (N + TN - 1) / TN, threads = omp_get_num_threads(), most = AMX_SPAN_BYTES / (K * TN * 2);
    // spans of equal size, a multiple of the threads and at least four each where the groups allow:
    // SmolLM2's 48 groups of gate/up had gone in spans of 14, 14, 14 and 6 (28 against 20 a thread)
    int64_t spans = (groups + (most < 1 ? 1 : most) - 1) / (most < 1 ? 1 : most);
    if (spans < 4 * threads) spans = 4 * threads;
    spans = (spans + threads - 1) / threads * threads;
    int64_t span = spans >= groups ? 1 : (groups + spans - 1) / spans;
    spans = (groups + span - 1) / span;
    int64_t row_blocks = (M + 31) / 32, parts = 1;
    while (parts < row_blocks && (spans * parts) % threads && spans * parts < 8 * threads) parts++;
    int64_t part_rows = (row_blocks + parts - 1) / parts * 32;
    int configured = -1;
    bf16 *buf = q ? aligned_alloc(64, (size_t)span * K * TN * sizeof(bf16)) : NULL;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < spans * parts; task++) {
        int64_t g0 = task / parts * span, g1 = g0 + span < groups ? g0 + span : groups;
        int64_t first = task % parts * part_rows, last = first + part_rows < M ? first + part_rows : M;
        for (int64_t g = g0; q && g < g1; g++)
            for (int h = 0; h < 2; h++) codes_to_tiles(q, sz, group, N, K, g * TN + 32 * h, 32 * h, buf + (g - g0) * K * TN);
        for (int64_t m0 = first; m0 < last; m0 += 32) {
            int ma, mb;
            amx_rows(m0, last, &configured, &ma, &mb);
            for (int64_t g = g0; g < g1; g++) {
                const bf16 *wg = q ? buf + (g - g0) * K * TN : wp + g * K * TN;
                for (int h = 0; h < 2; h++) amx_block(x, wg, scale, bias, y, N, K, g, h, m0, ma, mb, !q && m0 == first);
            }
        }
    }
    if (configured >= 0) amx_release();
    free(buf);
}
#endif

// y [M, N] = x [M, K] @ W^T (+ bias), W packed by cpu.pack_tiles; K even. Inside the caller's
// parallel region (all threads call it). Tasks (a group of 64 outputs over a part of the rows) are
// handed out dynamically: a thread preempted by another process does not hold the other at a
// static share's end. The rows are split into parts until the tasks divide evenly among the
// threads: SmolLM2's 576 outputs are 9 groups, which two threads took 5 and 4 (a tenth of those
// GEMMs idle); the parts read their group's weights once each, from the caches after the first.
static void tile_groups(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t N, int64_t K) {
#if WB_AMX
    if (amx_on && K % 32 == 0) {
        if (M == 1)
            amx_groups(x, wp, NULL, NULL, 0, NULL, bias, y, M, N, K);
        else
            amx_spans(x, wp, NULL, NULL, 0, NULL, bias, y, M, N, K);
        return;
    }
#endif
#if WB_BF16_DOT
    int64_t groups = (N + TN - 1) / TN, KP = K / 2, row_tiles = (M + TM - 1) / TM, threads = omp_get_num_threads();
    int64_t parts = 1;
    while (parts < row_tiles && (groups * parts) % threads && groups * parts < 8 * threads) parts++;
    int64_t part_rows = (row_tiles + parts - 1) / parts * TM;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < groups * parts; task++) {
        int64_t g = task / parts, first = task % parts * part_rows, last = first + part_rows < M ? first + part_rows : M;
        const bf16 *next = g + 1 < groups ? wp + (g + 1) * KP * TN * 2 : NULL;
        // A step of a few rows reads each group once: its own stream is fetched ahead instead (1-2
        // rows of 1B-shaped layers in AVX-512, Emerald Rapids guest: 40-42 -> 55-62 GB/s, the GEMVs
        // 55-60; on AMX the tiles take such steps, 1.1-1.2x the GEMVs there).
        if (row_tiles == 1) next = wp + g * KP * TN * 2 + TILES_AHEAD / 2;
        for (int64_t m0 = first; m0 < last; m0 += TM) {
            const bf16 *pf = m0 == first ? next : NULL;
            switch (last - m0 < TM ? last - m0 : TM) {
            case 1: tile_group(x, wp, bias, y, N, K, g, pf, m0, 1); break;
            case 2: tile_group(x, wp, bias, y, N, K, g, pf, m0, 2); break;
            case 3: tile_group(x, wp, bias, y, N, K, g, pf, m0, 3); break;
            case 4: tile_group(x, wp, bias, y, N, K, g, pf, m0, 4); break;
            case 5: tile_group(x, wp, bias, y, N, K, g, pf, m0, 5); break;
            default: tile_group(x, wp, bias, y, N, K, g, pf, m0, 6); break;
            }
        }
    }
#else
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K;  // cpu.py uses tiles on avx512_bf16 only
#endif
}

void wb_gemm_tiles(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel
    tile_groups(x, wp, bias, y, M, N, K);
}

// y [M, N] = (x [M, K] @ q^T) * scale + bias, int8 weights q [N, K] with a scale per output, on AMX
// (K % 32 == 0; cpu.py asks only then): the codes widened to bf16 a half group at a time, in a
// buffer each thread reuses (L2-sized: 64 x K bf16), so large steps multiply at the tiles' rate
// where torch's int8 kernel widens them to fp32 (5x slower prompts). Sums in fp32, scaled once.
void wb_gemm_q8_tiles(const bf16 *x, const int8_t *q, const bf16 *scale, const bf16 *bias, bf16 *y, int64_t M,
                      int64_t N, int64_t K) {
#if WB_AMX
#pragma omp parallel
    if (M * K * 2 > AMX_SPAN_BYTES)
        amx_spans(x, NULL, q, NULL, 0, scale, bias, y, M, N, K);
    else
        amx_groups(x, NULL, q, NULL, 0, scale, bias, y, M, N, K);
#else
    (void)x, (void)q, (void)scale, (void)bias, (void)y, (void)M, (void)N, (void)K;
#endif
}

// The same for int4 weights in the GEMV's layout (wb_gemv_int4: nibbles, bf16 (scale, zero) per
// `group` inputs), each weight (q - 8) * scale + zero rounded to bf16 as it is widened.
void wb_gemm_q4_tiles(const bf16 *x, const uint8_t *q, const bf16 *scale_zero, const bf16 *bias, bf16 *y, int64_t M,
                      int64_t N, int64_t K, int64_t group) {
#if WB_AMX
#pragma omp parallel
    if (M * K * 2 > AMX_SPAN_BYTES)
        amx_spans(x, NULL, q, scale_zero, group, NULL, bias, y, M, N, K);
    else
        amx_groups(x, NULL, q, scale_zero, group, NULL, bias, y, M, N, K);
#else
    (void)x, (void)q, (void)scale_zero, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)group;
#endif
}

// ---------------------------------------------------------------------------------------------
// Elementwise ops with torch's bf16 rounding points.

// x += delta (if given, rounded to bf16), then out = w * bf16(x * rsqrt(mean(x^2) + eps)).
static void norm_row(bf16 *x, const bf16 *delta, const bf16 *w, bf16 *out, int64_t H, float eps) {
    vf ss = vf_zero();
    for (int64_t i = 0; i < H; i += 16) {
        vf v = vf_load_bf_n(x + i, H - i);
        if (delta) {
            v = vf_round_bf(vf_add(v, vf_load_bf_n(delta + i, H - i)));
            vf_store_bf_n(x + i, v, H - i);
        }
        ss = vf_fma(v, v, ss);
    }
    vf r = vf_set1(1.0f / sqrtf(vf_sum(ss) / (float)H + eps));
    for (int64_t i = 0; i < H; i += 16) {
        vf normed = vf_round_bf(vf_mul(vf_load_bf_n(x + i, H - i), r));
        vf_store_bf_n(out + i, vf_mul(vf_load_bf_n(w + i, H - i), normed), H - i);
    }
}

void wb_add_rms_norm(bf16 *x, const bf16 *delta, const bf16 *w, bf16 *out, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) norm_row(x + t * H, delta ? delta + t * H : NULL, w, out + t * H, H, eps);
}

// out = bf16(silu(gate)) * up
static void silu_row(const bf16 *g, const bf16 *u, bf16 *o, int64_t I) {
    for (int64_t i = 0; i < I; i += 16) {
        vf gv = vf_load_bf_n(g + i, I - i);
        vf silu = vf_div(gv, vf_add(vf_set1(1.f), vf_exp(vf_neg(gv))));
        vf_store_bf_n(o + i, vf_mul(vf_round_bf(silu), vf_load_bf_n(u + i, I - i)), I - i);
    }
}

// gate/up are the two halves of each row of gu [T, 2I].
void wb_silu_mul(const bf16 *gu, bf16 *out, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++) silu_row(gu + t * 2 * I, gu + t * 2 * I + I, out + t * I, I);
}

// Rotate one head in the half-split layout: out = x * cos + rotate_half(x) * sin, bf16 products.
static inline void rope_head(const bf16 *x, const bf16 *cos, const bf16 *sin, bf16 *out, int64_t D) {
    int64_t h = D / 2;
    for (int64_t i = 0; i < h; i += 16) {
        int64_t n = h - i;
        vf x1 = vf_load_bf_n(x + i, n), x2 = vf_load_bf_n(x + h + i, n);
        vf c1 = vf_load_bf_n(cos + i, n), s1 = vf_load_bf_n(sin + i, n);
        vf c2 = vf_load_bf_n(cos + h + i, n), s2 = vf_load_bf_n(sin + h + i, n);
        // vf_neg flips the sign bit: an exact negation, as torch's (0 - x would turn -0 into +0)
        vf_store_bf_n(out + i, vf_add(vf_round_bf(vf_mul(x1, c1)), vf_round_bf(vf_mul(vf_neg(x2), s1))), n);
        vf_store_bf_n(out + h + i, vf_add(vf_round_bf(vf_mul(x2, c2)), vf_round_bf(vf_mul(x1, s2))), n);
    }
}

// One token's fused qkv row [(Hq + 2 Hkv) * D]: q rotated into q_out [Hq, D]; k rotated and v
// copied into the bf16 paged cache at `slot` (a negative slot is padding: skipped).
static void rope_token(const bf16 *row, int64_t pos, const bf16 *cos, const bf16 *sin, int64_t slot, bf16 *q_out,
                       bf16 *k_cache, bf16 *v_cache, int64_t Hq, int64_t Hkv, int64_t D) {
    const bf16 *c = cos + pos * D, *s = sin + pos * D;
    for (int64_t h = 0; h < Hq; h++) rope_head(row + h * D, c, s, q_out + h * D, D);
    if (slot < 0) return;
    for (int64_t h = 0; h < Hkv; h++) {
        rope_head(row + (Hq + h) * D, c, s, k_cache + (slot * Hkv + h) * D, D);
        memcpy(v_cache + (slot * Hkv + h) * D, row + (Hq + Hkv + h) * D, (size_t)D * sizeof(bf16));
    }
}

void wb_rope_write_kv(const bf16 *qkv, const int64_t *pos, const bf16 *cos, const bf16 *sin,
                      const int64_t *slots, bf16 *q_out, bf16 *k_cache, bf16 *v_cache, int64_t T, int64_t Hq,
                      int64_t Hkv, int64_t D) {
    int64_t width = (Hq + 2 * Hkv) * D;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int64_t t = 0; t < T; t++)
        rope_token(qkv + t * width, pos[t], cos, sin, slots[t], q_out + t * Hq * D, k_cache, v_cache, Hq, Hkv, D);
}

// ---------------------------------------------------------------------------------------------
// Decode attention over the paged bf16 cache, read in place: one query token per sequence.
// q [B, Hq, D]; caches [blocks, block_size, Hkv, D]; tables [B, W] int32; lens [B] int32.
// D % 16 == 0. One task per (sequence, kv head) computes all of its query heads (GQA). It follows
// the steps of torch's CPU flash attention for bf16 (what transformers runs), so greedy decoding
// agrees with it as often as torch's own path does: scores q.k in fp32 then scaled, an online
// softmax over chunks of KV_CHUNK keys, probabilities rounded to bf16 before they weight the
// values (their fp32 sum is the normaliser), fp32 accumulation, one division at the end.
#define MAX_D 256
#define MAX_G 16
#define KV_CHUNK 512
#define DV (MAX_D / 16)
// Key/value rows are short (128 bytes at D = 64) and scattered over the cache's blocks, strided by
// the other heads: the hardware prefetcher does not follow them, so each row is fetched KV_AHEAD
// rows before its use, all of its lines. 64 sequences x 300 tokens, a cache cold in DRAM: 1.81 ->
// 0.80 ms per layer (avx512_bf16), 1.74 -> 0.99 (avx2) against the next two rows' first line
// (16 and 64 rows ahead were slower; so was prefetching the values during the scores).
#define KV_AHEAD 32
// The decodes go further, in two levels: keys KV_FAR rows ahead into L2 and KV_NEAR rows ahead
// into L1, and the values into L2 while the scores are computed, so many more rows are in flight
// than L1's miss buffers hold. 40 sequences x 400 tokens from DRAM on a Zen 4 guest (ab_kernels.py,
// interleaved), ms per layer: avx512_bf16 1.10-1.23 -> 0.61-0.70 (64 x 300: 1.42 -> 0.87), avx512
// 1.45 -> 1.16, avx2 1.48 -> 1.35. (The extend kernel keeps KV_AHEAD.)
#define KV_NEAR 16
#define KV_FAR 64

static inline void prefetch_row(const bf16 *row, int64_t D) {
    for (int64_t o = 0; o < D; o += 32) PREFETCH(row + o);
}

static inline void prefetch_row_l2(const bf16 *row, int64_t D) {
    for (int64_t o = 0; o < D; o += 32) __builtin_prefetch((const void *)(row + o), 0, 2);
}

// Where each key/value row of a chunk lives: cache row offsets, shared by K and V.
static void chunk_rows(int64_t *rows, const int32_t *table, int64_t c0, int64_t cn, int64_t bs, int64_t Hkv,
                       int64_t h, int64_t D) {
    for (int64_t t = 0; t < cn;) {
        int64_t pos = c0 + t, off = pos % bs;
        int64_t n = bs - off < cn - t ? bs - off : cn - t;
        int64_t first = (((int64_t)table[pos / bs] * bs + off) * Hkv + h) * D;
        for (int64_t o = 0; o < n; o++) rows[t + o] = first + o * Hkv * D;
        t += n;
    }
}

// Online softmax over a chunk of scores: rescale what came before to the new maximum, turn the
// scores into bf16-rounded probabilities in place; returns the factor for the old accumulators.
static float softmax_chunk(float *s, int64_t cn, float *run_max, float *run_sum) {
    vf mxv = vf_set1(*run_max);
    for (int64_t t = 0; t < cn; t += 16) {
        vf v = vf_load_n(s + t, cn - t);
        // lanes past the end must not raise the maximum: pad them with the running one
        if (cn - t < 16) {
            float tmp[16];
            vf_store(tmp, v);
            for (int64_t i = cn - t; i < 16; i++) tmp[i] = *run_max;
            v = vf_load(tmp);
        }
        mxv = vf_max(mxv, v);
    }
    float mx = vf_hmax(mxv);
    float corr = wb_expf(*run_max - mx);
    vf mv = vf_set1(mx), sum = vf_zero();
    for (int64_t t = 0; t < cn; t += 16) {
        int64_t n = cn - t;
        vf e = vf_exp(vf_sub(vf_load_n(s + t, n), mv));
        if (n < 16) {  // padding lanes contribute nothing
            float tmp[16];
            vf_store(tmp, e);
            for (int64_t i = n; i < 16; i++) tmp[i] = 0.f;
            e = vf_load(tmp);
        }
        sum = vf_add(sum, e);
        // the probabilities weight the values as bf16, as in torch; their fp32 sum normalises
        vf_store_n(s + t, vf_round_bf(e), n);
    }
    *run_sum = *run_sum * corr + vf_sum(sum);
    *run_max = mx;
    return corr;
}

#if WB_BF16_DOT
// bf16 pair (a, b) in one 32-bit lane: the layout vdpbf16ps multiplies
static inline uint32_t bf_pair(bf16 a, bf16 b) { return (uint32_t)a | ((uint32_t)b << 16); }
#define BCAST_PAIR(p) ((__m512bh)_mm512_set1_epi32(*(const int32_t *)(p)))

// 16 dims of two rows as bf16 pairs, lane i = (a[i], b[i]); a NULL row gives zeros
static inline __m512i bf_pairs16(const bf16 *a, const bf16 *b) {
    __m512i lo = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)a)) : _mm512_setzero_si512();
    __m512i hi = b ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)), 16)
                   : _mm512_setzero_si512();
    return _mm512_or_si512(lo, hi);
}
#endif

#if WB_AVX512
// r[i] <- column i of the 16 x 16 matrix of 32-bit lanes r holds (row i in r[i])
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int k = 0; k < 4; k++) {  // u[k + 4j]: the 128-bit lanes of rows 4j .. 4j + 3, columns k, k + 4, k + 8, k + 12
        __m512i v0 = _mm512_shuffle_i32x4(u[k], u[k + 4], 0x88), v1 = _mm512_shuffle_i32x4(u[k], u[k + 4], 0xdd);
        __m512i v2 = _mm512_shuffle_i32x4(u[k + 8], u[k + 12], 0x88), v3 = _mm512_shuffle_i32x4(u[k + 8], u[k + 12], 0xdd);
        r[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[k + 8] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        r[k + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[k + 12] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

#endif

#if WB_AMX
// Where 16 keys' rows (keys t0 .. t0 + nt - 1 of a chunk starting at c0) lie for an A tile: in the
// cache, Hkv * D apart, when they are in one block; else gathered into kbuf [16][D] (rows past nt
// zero). Sets the tile's row stride in bytes.
static const bf16 *amx_key_rows(bf16 *kbuf, const bf16 *k_cache, const int64_t *rows, int64_t c0, int64_t t0,
                                int64_t nt, int64_t bs, int64_t Hkv, int64_t D, int64_t *stride) {
    if ((c0 + t0) % bs + 16 <= bs) {
        *stride = Hkv * D * 2;
        return k_cache + rows[t0];
    }
    for (int64_t i = 0; i < 16; i++) {
        if (i < nt) memcpy(kbuf + i * D, k_cache + rows[t0 + i], D * 2);
        else memset(kbuf + i * D, 0, D * 2);
    }
    *stride = D * 2;
    return kbuf;
}

// A decode's scores on AMX: S^T [16 keys][16 lanes] = K [16 keys][32 dims] . Q^T, the G query heads
// of a KV head in lanes 0 .. G - 1 of the B tile (bf16 pairs, qtp [D/2][16]), one tdpbf16ps per 32
// dims where AVX-512 took G x 2 vdpbf16ps and a transpose-and-add per head; the tile transposed
// back gives each head's 16 scores in a vector. Tile 0 accumulates, 6 is A, 7 is B.
AMX_TARGET static void decode_scores_amx(const uint32_t *qtp, const bf16 *k_cache, const bf16 *v_cache,
                                         const int64_t *rows, int64_t c0, int64_t cn, int64_t bs, int64_t Hkv,
                                         int64_t D, int64_t G, float scale, float scores[][KV_CHUNK]) {
    _Alignas(64) bf16 kbuf[16 * MAX_D];
    _Alignas(64) float st[16][16];
    for (int64_t t0 = 0; t0 < cn; t0 += 16) {
        int64_t nt = cn - t0 < 16 ? cn - t0 : 16;
        for (int64_t a = t0 + KV_NEAR; a < t0 + KV_NEAR + 16 && a < cn; a++) prefetch_row(k_cache + rows[a], D);
        for (int64_t a = t0 + KV_FAR; a < t0 + KV_FAR + 16 && a < cn; a++) prefetch_row_l2(k_cache + rows[a], D);
        for (int64_t a = t0; a < t0 + 16 && a < cn; a++) prefetch_row_l2(v_cache + rows[a], D);
        int64_t stride;
        const bf16 *kr = amx_key_rows(kbuf, k_cache, rows, c0, t0, nt, bs, Hkv, D, &stride);
        _tile_zero(0);
        for (int64_t c = 0; c < D; c += 32) {
            _tile_loadd(6, kr + c, stride);
            _tile_loadd(7, qtp + c / 2 * 16, 64);
            _tile_dpbf16ps(0, 6, 7);
        }
        _tile_stored(0, &st[0][0], 64);
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(st[i]);
        transpose16(r);
        for (int64_t g = 0; g < G; g++)
            _mm512_mask_storeu_ps(scores[g] + t0, (__mmask16)((1u << nt) - 1),
                                  _mm512_mul_ps(_mm512_castsi512_ps(r[g]), _mm512_set1_ps(scale)));
    }
}
#endif

#if WB_BF16_DOT
// Lane i of the result = the sum of the 16 lanes of v[i]: pairwise unpack-and-add within 128-bit
// lanes, then across them; ~45 instructions where 16 horizontal reductions take ~130.
static inline __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // b[i] holds, per 128-bit lane j, the lane-j partial sums of v[4i .. 4i+3]; add the lanes up
    __m512 c01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
    __m512 c23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c01, c23, 0x88), _mm512_shuffle_f32x4(c01, c23, 0xDD));
}

// The dot products of one query with 16 key rows (nt of them real), as one vector. Called with a
// constant DW, the 16 partial sums stay in registers (see pv_head).
static inline __attribute__((always_inline)) __m512 qk16(const __m512bh *qb, const bf16 *k_cache,
                                                         const int64_t *rows, int nt, const __mmask32 *dmask,
                                                         const int64_t DW) {
    __m512 dots[16];
    for (int i = 0; i < 16; i++) {
        dots[i] = _mm512_setzero_ps();
        if (i >= nt) continue;
        const bf16 *kr = k_cache + rows[i];
        for (int64_t c = 0; c < DW; c++)
            dots[i] = _mm512_dpbf16_ps(dots[i], (__m512bh)_mm512_maskz_loadu_epi16(dmask[c], kr + c * 32), qb[c]);
    }
    return sum16(dots);
}

// acc += sum_t p[t] v_t over a chunk for one query head, keys in pairs (an odd last key pairs
// with itself at p = 0): each vdpbf16ps takes two keys. Called with a constant DW, the accumulators
// stay in registers; indexed by runtime head and width they lived on the stack, and every update
// waited for its store to forward (slow for Zen 4's split 512-bit stores).
static inline __attribute__((always_inline)) void pv_head(__m512 *acc_lo, __m512 *acc_hi, const float *p,
                                                          const bf16 *v_cache, const int64_t *rows, int64_t cn,
                                                          const __mmask32 *dmask, const int64_t DW, int prefetch,
                                                          int64_t D) {
    __m512 lo_acc[MAX_D / 32], hi_acc[MAX_D / 32];
    for (int64_t c = 0; c < DW; c++) {
        lo_acc[c] = acc_lo[c];
        hi_acc[c] = acc_hi[c];
    }
    for (int64_t t = 0; t < cn; t += 2) {
        const bf16 *r0 = v_cache + rows[t], *r1 = t + 1 < cn ? v_cache + rows[t + 1] : r0;
        if (prefetch)
            for (int64_t a = t + KV_AHEAD; a < t + KV_AHEAD + 2 && a < cn; a++) prefetch_row(v_cache + rows[a], D);
        // the probabilities are bf16 values already: their top 16 bits are the bf16
        union {
            float f;
            uint32_t u;
        } p0 = {p[t]}, p1 = {t + 1 < cn ? p[t + 1] : 0.f};
        __m512bh pp = (__m512bh)_mm512_set1_epi32((int)((p0.u >> 16) | (p1.u & 0xffff0000u)));
        for (int64_t c = 0; c < DW; c++) {
            __m512i a = _mm512_maskz_loadu_epi16(dmask[c], r0 + c * 32);
            __m512i b = _mm512_maskz_loadu_epi16(dmask[c], r1 + c * 32);
            lo_acc[c] = _mm512_dpbf16_ps(lo_acc[c], (__m512bh)_mm512_unpacklo_epi16(a, b), pp);
            hi_acc[c] = _mm512_dpbf16_ps(hi_acc[c], (__m512bh)_mm512_unpackhi_epi16(a, b), pp);
        }
    }
    for (int64_t c = 0; c < DW; c++) {
        acc_lo[c] = lo_acc[c];
        acc_hi[c] = hi_acc[c];
    }
}

// pv_head for every head of the group at once (G * DW <= 8: 16 accumulators at most): each pair
// of value rows is loaded and interleaved once for all of them.
static inline __attribute__((always_inline)) void pv_heads(__m512 acc_lo[][MAX_D / 32], __m512 acc_hi[][MAX_D / 32],
                                                           float scores[][KV_CHUNK], const bf16 *v_cache,
                                                           const int64_t *rows, int64_t cn, const __mmask32 *dmask,
                                                           const int64_t G, const int64_t DW, int64_t D) {
    __m512 lo_acc[8], hi_acc[8];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < DW; c++) {
            lo_acc[g * DW + c] = acc_lo[g][c];
            hi_acc[g * DW + c] = acc_hi[g][c];
        }
    for (int64_t t = 0; t < cn; t += 2) {
        const bf16 *r0 = v_cache + rows[t], *r1 = t + 1 < cn ? v_cache + rows[t + 1] : r0;
        for (int64_t a = t + KV_AHEAD; a < t + KV_AHEAD + 2 && a < cn; a++) prefetch_row(v_cache + rows[a], D);
        __m512i lo[4], hi[4];
        for (int64_t c = 0; c < DW; c++) {
            __m512i a = _mm512_maskz_loadu_epi16(dmask[c], r0 + c * 32);
            __m512i b = _mm512_maskz_loadu_epi16(dmask[c], r1 + c * 32);
            lo[c] = _mm512_unpacklo_epi16(a, b);
            hi[c] = _mm512_unpackhi_epi16(a, b);
        }
        for (int64_t g = 0; g < G; g++) {
            // the probabilities are bf16 values already: their top 16 bits are the bf16
            union {
                float f;
                uint32_t u;
            } p0 = {scores[g][t]}, p1 = {t + 1 < cn ? scores[g][t + 1] : 0.f};
            __m512bh pp = (__m512bh)_mm512_set1_epi32((int)((p0.u >> 16) | (p1.u & 0xffff0000u)));
            for (int64_t c = 0; c < DW; c++) {
                lo_acc[g * DW + c] = _mm512_dpbf16_ps(lo_acc[g * DW + c], (__m512bh)lo[c], pp);
                hi_acc[g * DW + c] = _mm512_dpbf16_ps(hi_acc[g * DW + c], (__m512bh)hi[c], pp);
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < DW; c++) {
            acc_lo[g][c] = lo_acc[g * DW + c];
            acc_hi[g][c] = hi_acc[g * DW + c];
        }
}

static void decode_task(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *tables,
                        const int32_t *lens, bf16 *out, int64_t b, int64_t h, int64_t Hq, int64_t Hkv, int64_t D,
                        int64_t bs, int64_t W, float scale) {
    int64_t G = Hq / Hkv;
    int64_t L = lens[b];
    if (L <= 0) return;
    float scores[MAX_G][KV_CHUNK];
    __m512bh qb[MAX_G][MAX_D / 32];
    // P.V accumulates two keys per vdpbf16ps: `lo`/`hi` hold the unpacklo/unpackhi halves of each
    // 32-wide chunk of the value rows (an interleaved order, undone when storing).
    __m512 acc_lo[MAX_G][MAX_D / 32], acc_hi[MAX_G][MAX_D / 32];
    float run_max[MAX_G], run_sum[MAX_G];
    int64_t DW = (D + 31) / 32;
    __mmask32 dmask[MAX_D / 32];
    for (int64_t c = 0; c < DW; c++) dmask[c] = D - c * 32 >= 32 ? 0xffffffffu : (__mmask32)((1u << (D - c * 32)) - 1);
    for (int64_t g = 0; g < G; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.f;
        for (int64_t c = 0; c < DW; c++)
            qb[g][c] = (__m512bh)_mm512_maskz_loadu_epi16(dmask[c], q + (b * Hq + h * G + g) * D + c * 32);
        for (int64_t c = 0; c < DW; c++) acc_lo[g][c] = acc_hi[g][c] = _mm512_setzero_ps();
    }
#if WB_AMX
    // the scores on AMX where the tiles multiply there: the queries' bf16 pairs as a B tile's lanes
    const int amx = amx_on && D % 32 == 0 && G <= 16;
    _Alignas(64) uint32_t qtp[MAX_D / 2 * 16];
    if (amx) {
        memset(qtp, 0, sizeof(uint32_t) * D / 2 * 16);
        for (int64_t g = 0; g < G; g++) {
            const bf16 *qr = q + (b * Hq + h * G + g) * D;
            for (int64_t d = 0; d < D; d += 2) qtp[d / 2 * 16 + g] = bf_pair(qr[d], qr[d + 1]);
        }
        amx_configure(16, 16);
    }
#endif
    const int32_t *table = tables + b * W;
    int64_t rows[KV_CHUNK];
    for (int64_t c0 = 0; c0 < L; c0 += KV_CHUNK) {
        int64_t cn = L - c0 < KV_CHUNK ? L - c0 : KV_CHUNK;
        chunk_rows(rows, table, c0, cn, bs, Hkv, h, D);
        // the first rows have nobody ahead to fetch them: ask for them now
        for (int64_t a = 0; a < KV_NEAR && a < cn; a++) prefetch_row(k_cache + rows[a], D);
        for (int64_t a = KV_NEAR; a < KV_FAR && a < cn; a++) prefetch_row_l2(k_cache + rows[a], D);
        // scores[g][t] = (q_g . k_t) * scale, 16 keys at a time: vdpbf16ps on the bf16 rows (exact
        // products, fp32 sums), then one transpose-and-add gives 16 dot products at once instead
        // of 16 horizontal reductions.
#if WB_AMX
        if (amx)
            decode_scores_amx(qtp, k_cache, v_cache, rows, c0, cn, bs, Hkv, D, G, scale, scores);
        else  // the AVX-512 scores
#endif
        for (int64_t t0 = 0; t0 < cn; t0 += 16) {
            int nt = cn - t0 < 16 ? (int)(cn - t0) : 16;
            for (int64_t a = t0 + KV_NEAR; a < t0 + KV_NEAR + 16 && a < cn; a++) prefetch_row(k_cache + rows[a], D);
            for (int64_t a = t0 + KV_FAR; a < t0 + KV_FAR + 16 && a < cn; a++) prefetch_row_l2(k_cache + rows[a], D);
            for (int64_t a = t0; a < t0 + 16 && a < cn; a++) prefetch_row_l2(v_cache + rows[a], D);
            for (int64_t g = 0; g < G; g++) {
                __m512 dots = DW == 2   ? qk16(qb[g], k_cache, rows + t0, nt, dmask, 2)
                              : DW == 4 ? qk16(qb[g], k_cache, rows + t0, nt, dmask, 4)
                                        : qk16(qb[g], k_cache, rows + t0, nt, dmask, DW);
                _mm512_mask_storeu_ps(scores[g] + t0, (__mmask16)((1u << nt) - 1),
                                      _mm512_mul_ps(dots, _mm512_set1_ps(scale)));
            }
        }
        for (int64_t a = 0; a < KV_AHEAD && a < cn; a++) prefetch_row(v_cache + rows[a], D);  // fetched during the softmax
        for (int64_t g = 0; g < G; g++) {
            __m512 corr = _mm512_set1_ps(softmax_chunk(scores[g], cn, &run_max[g], &run_sum[g]));
            for (int64_t c = 0; c < DW; c++) {
                acc_lo[g][c] = _mm512_mul_ps(acc_lo[g][c], corr);
                acc_hi[g][c] = _mm512_mul_ps(acc_hi[g][c], corr);
            }
        }
        // acc_g += sum_t p[g][t] v_t: every head of the group at once where their accumulators fit
        // in registers (each value row loaded and interleaved once), else one head at a time (the
        // value rows from the caches after the first head's pass, which prefetches them)
        if (G * DW <= 8) {
            if (G == 3 && DW == 2)
                pv_heads(acc_lo, acc_hi, scores, v_cache, rows, cn, dmask, 3, 2, D);
            else if (G == 4 && DW == 2)
                pv_heads(acc_lo, acc_hi, scores, v_cache, rows, cn, dmask, 4, 2, D);
            else if (G == 2 && DW == 4)
                pv_heads(acc_lo, acc_hi, scores, v_cache, rows, cn, dmask, 2, 4, D);
            else if (G == 1 && DW == 4)
                pv_heads(acc_lo, acc_hi, scores, v_cache, rows, cn, dmask, 1, 4, D);
            else if (G == 2 && DW == 2)
                pv_heads(acc_lo, acc_hi, scores, v_cache, rows, cn, dmask, 2, 2, D);
            else
                pv_heads(acc_lo, acc_hi, scores, v_cache, rows, cn, dmask, G, DW, D);
        } else {
            for (int64_t g = 0; g < G; g++) {
                if (DW == 2)
                    pv_head(acc_lo[g], acc_hi[g], scores[g], v_cache, rows, cn, dmask, 2, g == 0, D);
                else if (DW == 4)
                    pv_head(acc_lo[g], acc_hi[g], scores[g], v_cache, rows, cn, dmask, 4, g == 0, D);
                else
                    pv_head(acc_lo[g], acc_hi[g], scores[g], v_cache, rows, cn, dmask, DW, g == 0, D);
            }
        }
    }
#if WB_AMX
    if (amx) amx_release();
#endif
    // un-interleave: within each 128-bit lane, lo holds elements 0-3 and hi elements 4-7
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t g = 0; g < G; g++) {
        bf16 *o = out + (b * Hq + h * G + g) * D;
        __m512 sum = _mm512_set1_ps(run_sum[g]);
        for (int64_t c = 0; c < DW; c++) {
            float tmp[32];
            _mm512_storeu_ps(tmp, _mm512_div_ps(_mm512_permutex2var_ps(acc_lo[g][c], first, acc_hi[g][c]), sum));
            _mm512_storeu_ps(tmp + 16, _mm512_div_ps(_mm512_permutex2var_ps(acc_lo[g][c], second, acc_hi[g][c]), sum));
            for (int64_t j = 0; j < 32 && c * 32 + j < D; j++) o[c * 32 + j] = f2bf(tmp[j]);
        }
    }
}
#endif

// The decode steps with each cached row widened to fp32 in registers: bf16 rows (no scales; q.k
// and P.V as fp32 multiply-adds, a bf16 x bf16 product being exact in fp32, so only the summation
// order differs from the AVX-512 BF16 build) or, for kv_cache_dtype=int8, int8 rows with an fp32
// scale per (slot, KV head), half a bf16 row's bytes, the scale multiplying the key's score and
// the value's probability once, not each element.
static inline void widen_row(vf *dst, const void *cache, int64_t off, int64_t DW, int i8) {
    for (int64_t c = 0; c < DW; c++)
        dst[c] = i8 ? vf_load_i8((const int8_t *)cache + off + c * 16) : vf_load_bf((const bf16 *)cache + off + c * 16);
}

static inline void prefetch_any(const void *cache, int64_t off, int64_t D, int i8) {
    const char *row = (const char *)cache + off * (i8 ? 1 : 2);
    for (int64_t o = 0; o < D * (i8 ? 1 : 2); o += 64) PREFETCH(row + o);
}

static inline void prefetch_any_l2(const void *cache, int64_t off, int64_t D, int i8) {
    const char *row = (const char *)cache + off * (i8 ? 1 : 2);
    for (int64_t o = 0; o < D * (i8 ? 1 : 2); o += 64) __builtin_prefetch((const void *)(row + o), 0, 2);
}

static void decode_task_widened(const bf16 *q, const void *k_cache, const void *v_cache, const float *k_scale,
                                const float *v_scale, const int32_t *tables, const int32_t *lens, bf16 *out,
                                int64_t b, int64_t h, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t W,
                                float scale) {
    int64_t G = Hq / Hkv;
    int64_t L = lens[b];
    if (L <= 0) return;
    int i8 = k_scale != NULL;
    int64_t DW = D / 16;
    float scores[MAX_G][KV_CHUNK];
    vf qf[MAX_G][DV], acc[MAX_G][DV];
    float run_max[MAX_G], run_sum[MAX_G];
    for (int64_t g = 0; g < G; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.f;
        for (int64_t c = 0; c < DW; c++) {
            qf[g][c] = vf_load_bf(q + (b * Hq + h * G + g) * D + c * 16);
            acc[g][c] = vf_zero();
        }
    }
    const int32_t *table = tables + b * W;
    int64_t rows[KV_CHUNK];
    for (int64_t c0 = 0; c0 < L; c0 += KV_CHUNK) {
        int64_t cn = L - c0 < KV_CHUNK ? L - c0 : KV_CHUNK;
        chunk_rows(rows, table, c0, cn, bs, Hkv, h, D);  // element offsets; a row's scale is at offset / D
        for (int64_t a = KV_NEAR; a < KV_FAR && a < cn; a++) prefetch_any_l2(k_cache, rows[a], D, i8);
        for (int64_t t = 0; t < cn; t++) {
            if (t + KV_NEAR < cn) prefetch_any(k_cache, rows[t + KV_NEAR], D, i8);
            if (t + KV_FAR < cn) prefetch_any_l2(k_cache, rows[t + KV_FAR], D, i8);
            prefetch_any_l2(v_cache, rows[t], D, i8);
            float s = (i8 ? k_scale[rows[t] / D] : 1.f) * scale;
            vf kv[DV];
            widen_row(kv, k_cache, rows[t], DW, i8);
            for (int64_t g = 0; g < G; g++) {
                vf dot = vf_mul(kv[0], qf[g][0]);
                for (int64_t c = 1; c < DW; c++) dot = vf_fma(kv[c], qf[g][c], dot);
                scores[g][t] = vf_sum(dot) * s;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            vf corr = vf_set1(softmax_chunk(scores[g], cn, &run_max[g], &run_sum[g]));
            for (int64_t c = 0; c < DW; c++) acc[g][c] = vf_mul(acc[g][c], corr);
        }
        for (int64_t t = 0; t < cn; t++) {
            if (t + KV_AHEAD < cn) prefetch_any(v_cache, rows[t + KV_AHEAD], D, i8);
            float s = i8 ? v_scale[rows[t] / D] : 1.f;
            vf vv[DV];
            widen_row(vv, v_cache, rows[t], DW, i8);
            for (int64_t g = 0; g < G; g++) {
                vf p = vf_set1(scores[g][t] * s);
                for (int64_t c = 0; c < DW; c++) acc[g][c] = vf_fma(p, vv[c], acc[g][c]);
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        bf16 *o = out + (b * Hq + h * G + g) * D;
        vf sum = vf_set1(run_sum[g]);
        for (int64_t c = 0; c < DW; c++) {
            // one division, then one rounding to bf16, as in the AVX-512 BF16 build
            float tmp[16];
            vf_store(tmp, vf_div(acc[g][c], sum));
            for (int j = 0; j < 16; j++) o[c * 16 + j] = f2bf(tmp[j]);
        }
    }
}

// One (sequence, KV head) of a decode over a bf16 cache: vdpbf16ps where the CPU has it.
static inline void decode_bf16_task(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *tables,
                                    const int32_t *lens, bf16 *out, int64_t b, int64_t h, int64_t Hq, int64_t Hkv,
                                    int64_t D, int64_t bs, int64_t W, float scale) {
#if WB_BF16_DOT
    decode_task(q, k_cache, v_cache, tables, lens, out, b, h, Hq, Hkv, D, bs, W, scale);
#else
    decode_task_widened(q, k_cache, v_cache, NULL, NULL, tables, lens, out, b, h, Hq, Hkv, D, bs, W, scale);
#endif
}

void wb_paged_decode(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *tables,
                     const int32_t *lens, bf16 *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                     int64_t W, float scale) {
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++)
            decode_bf16_task(q, k_cache, v_cache, tables, lens, out, b, h, Hq, Hkv, D, bs, W, scale);
}

void wb_paged_decode_i8(const bf16 *q, const int8_t *k_cache, const int8_t *v_cache, const float *k_scale,
                        const float *v_scale, const int32_t *tables, const int32_t *lens, bf16 *out, int64_t B,
                        int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t W, float scale) {
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++)
            decode_task_widened(q, k_cache, v_cache, k_scale, v_scale, tables, lens, out, b, h, Hq, Hkv, D, bs, W,
                                scale);
}

// ---------------------------------------------------------------------------------------------
// Prefill (extend) attention: the new tokens of each sequence attend causally over its cache,
// a tile of EXT_Q consecutive queries at a time with the queries along the vector lanes. A key
// row is read once per tile instead of once per query, scores need no horizontal sums, and the
// causal mask is a lane mask on the diagonal tiles only; a 512-token prompt chunk's attention
// runs in about a third of the time of 512 one-query decodes.
//
// Per task (a sequence's tile of queries, one KV head), its G query heads: q^T [G][D] lane vectors,
// keys in chunks of up to EXT_KEYS: scores[g][key] (one vector: the tile's queries), each
// chunk's softmax in two passes as in the decode kernel (the chunk's maximum first; probabilities
// rounded to bf16 weight the values, their fp32 sum normalises), P.V into acc^T[G][D].
#define EXT_Q 16
#define EXT_GD 512      // most G * D this kernel takes (SmolLM2: 3 * 64; Llama 3 8B: 4 * 128)
#define EXT_SCORES 2048 // G * keys of a chunk's scores (SmolLM2: 512 keys a chunk, as the decode kernel)
#define EXT_KEYS 512    // most keys a chunk
#define EXT_FLOATS (16 * (2 * EXT_GD + EXT_SCORES) + EXT_KEYS / 2 * MAX_D)

static _Thread_local float *ext_scratch;  // per thread, made on first use: q^T, acc^T, scores, values

static float *ext_buffers(void) {
    if (ext_scratch == NULL) ext_scratch = aligned_alloc(64, sizeof(float) * EXT_FLOATS);
    return ext_scratch;
}

#if WB_BF16_DOT
// The G (<= EXT_SHARED_G) query heads of one KV head together: each key (value) pair is broadcast
// once for all of them instead of once per head, the broadcasts being what the loops waited on.
// G is a constant in each inlined copy, so the G x 8 accumulators stay in registers.
#define EXT_SHARED_G 3

// scores of 8 keys for G heads: s[g][i] = q_g . k_i (lanes: the tile's queries)
static inline __attribute__((always_inline)) void ext_qk8(const int G, const uint32_t *qt, const bf16 *const *kr,
                                                          int64_t D, __m512 s[][8]) {
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 8; i++) s[g][i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        __m512bh qv[EXT_SHARED_G];
        for (int g = 0; g < G; g++) qv[g] = (__m512bh)_mm512_load_si512(qt + (g * D / 2 + p) * 16);
        for (int i = 0; i < 8; i++) {
            __m512bh kb = BCAST_PAIR(kr[i] + 2 * p);
            for (int g = 0; g < G; g++) s[g][i] = _mm512_dpbf16_ps(s[g][i], qv[g], kb);
        }
    }
}

// acc^T[g][d0 .. d0 + 8) = corr[g] * acc^T + P_g . V over the chunk's key pairs (probability pairs
// packed per head at sc + g * chunk * 16, value pairs at vp)
static inline __attribute__((always_inline)) void ext_pv8(const int G, float *acc, const float *sc, int64_t chunk,
                                                          const uint32_t *vp, int64_t cn, int64_t D, int64_t d0,
                                                          const vf *corr) {
    __m512 a[EXT_SHARED_G][8];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 8; i++) a[g][i] = _mm512_mul_ps(_mm512_load_ps(acc + (g * D + d0 + i) * 16), corr[g]);
    for (int64_t t = 0; t < cn; t += 2) {
        __m512bh pp[EXT_SHARED_G];
        for (int g = 0; g < G; g++) pp[g] = (__m512bh)_mm512_load_si512(sc + (g * chunk + t / 2) * 16);
        const uint32_t *vr = vp + t / 2 * D + d0;
        for (int i = 0; i < 8; i++) {
            __m512bh vb = BCAST_PAIR(vr + i);
            for (int g = 0; g < G; g++) a[g][i] = _mm512_dpbf16_ps(a[g][i], pp[g], vb);
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 8; i++) _mm512_store_ps(acc + (g * D + d0 + i) * 16, a[g][i]);
}
#endif

// one key's scores for the tile's 16 query lanes: scaled, masked where the key is on the diagonal
// (m > 0: later than some of the tile's queries), stored, and folded into the running maximum
static inline __attribute__((always_inline)) void ext_score(vf s, float scale, int64_t m, float bias[][16],
                                                            float *dst, vf *mx) {
    vf sv = vf_mul(s, vf_set1(scale));
    if (m > 0) sv = vf_add(sv, vf_load(bias[m]));
    vf_store(dst, sv);
    *mx = vf_max(*mx, sv);
}

// one key's probabilities for the tile's lanes: exp(score - max), zero where masked (m > 0: on the
// diagonal, later than some of the tile's queries)
static inline __attribute__((always_inline)) vf ext_prob(const float *st, vf max, int64_t m, float keep[][16]) {
    vf e = vf_exp_nonpos(vf_sub(vf_load(st), max));
    return m > 0 ? vf_mul(e, vf_load(keep[m])) : e;
}

// out rows row0 .. row0 + nq - 1, heads h * G .. h * G + G - 1 <- acc^T [G][D][16 query lanes] / sums
static void ext_write(const float *acc, const vf *run_sum, bf16 *out, int64_t row0, int64_t nq, int64_t h, int64_t G,
                      int64_t Hq, int64_t D) {
    for (int64_t g = 0; g < G; g++) {
#if WB_AVX512
        if (D % 16 == 0) {  // a row per query, 16 dims at a time: transposed back in registers
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = _mm512_castps_si512(vf_div(vf_load(acc + (g * D + d0 + i) * 16), run_sum[g]));
                transpose16(r);
                for (int64_t j = 0; j < nq; j++)
                    _mm256_storeu_si256((__m256i *)(out + ((row0 + j) * Hq + h * G + g) * D + d0),
                                        wb_narrow_bf(_mm512_castsi512_ps(r[j])));
            }
            continue;
        }
#endif
        float res[16];
        for (int64_t d = 0; d < D; d++) {
            vf_store(res, vf_div(vf_load(acc + (g * D + d) * 16), run_sum[g]));
            for (int64_t j = 0; j < nq; j++) out[((row0 + j) * Hq + h * G + g) * D + d] = f2bf(res[j]);
        }
    }
}

// A task's start: q^T [G][D][16] (bf16 pairs [G][D/2][16] where the dot is vdpbf16ps), lane j =
// query row0 + j (lanes past nq repeat the last query: their results are dropped); acc^T zero
static void ext_start(const bf16 *q, float *qt, float *acc, vf *run_max, vf *run_sum, int64_t row0, int64_t nq,
                      int64_t h, int64_t G, int64_t Hq, int64_t D) {
    for (int64_t g = 0; g < G; g++) {
        for (int64_t j = 0; j < EXT_Q; j++) {
            const bf16 *qr = q + ((row0 + (j < nq ? j : nq - 1)) * Hq + h * G + g) * D;
#if WB_BF16_DOT
            uint32_t *qp = (uint32_t *)qt + g * D / 2 * 16;
            for (int64_t d = 0; d < D; d += 2) qp[d / 2 * 16 + j] = bf_pair(qr[d], qr[d + 1]);
#else
            for (int64_t d = 0; d < D; d++) qt[(g * D + d) * 16 + j] = bf2f(qr[d]);
#endif
        }
        for (int64_t d = 0; d < D; d++) vf_store(acc + (g * D + d) * 16, vf_zero());
        run_max[g] = vf_set1(-INFINITY);
        run_sum[g] = vf_zero();
    }
}

// causal masks for the diagonal keys: key p0 + m is seen by lanes j >= m (0 / -inf added to the
// scores, 1 / 0 multiplying the probabilities)
static void ext_masks(float bias[EXT_Q][16], float keep[EXT_Q][16]) {
    for (int64_t m = 0; m < EXT_Q; m++)
        for (int64_t j = 0; j < 16; j++) {
            bias[m][j] = j >= m ? 0.f : -INFINITY;
            keep[m][j] = j >= m ? 1.f : 0.f;
        }
}

static void extend_task(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *table, bf16 *out,
                        int64_t row0, int64_t nq, int64_t p0, int64_t h, int64_t Hq, int64_t Hkv, int64_t D,
                        int64_t bs, float scale) {
    int64_t G = Hq / Hkv, L = p0 + nq;  // keys 0 .. L - 1: the last query's context
#if WB_BF16_DOT
    const int shared = G <= EXT_SHARED_G;  // all heads in one pass over each key (value) broadcast
#endif
    float *buf = ext_buffers();
    // q^T [G][D][16] (bf16 pairs [G][D/2][16] where the dot is vdpbf16ps), acc^T [G][D][16],
    // scores [G][chunk][16], value pairs [chunk/2][D] (vdpbf16ps)
    float *qt = buf, *acc = buf + 16 * EXT_GD, *sc = buf + 32 * EXT_GD;
    int64_t chunk = EXT_SCORES / G;
    chunk = chunk > EXT_KEYS ? EXT_KEYS : chunk & ~(int64_t)15;
    vf run_max[EXT_GD / 16], run_sum[EXT_GD / 16];
    ext_start(q, qt, acc, run_max, run_sum, row0, nq, h, G, Hq, D);
    float bias[EXT_Q][16], keep[EXT_Q][16];
    ext_masks(bias, keep);
    int64_t rows[EXT_KEYS];
    for (int64_t c0 = 0; c0 < L; c0 += chunk) {
        int64_t cn = L - c0 < chunk ? L - c0 : chunk;
        chunk_rows(rows, table, c0, cn, bs, Hkv, h, D);
        // pass 1: scores, 8 keys at a time (8 accumulators in registers), and each row's maximum
        vf mx[EXT_GD / 16];
        for (int64_t g = 0; g < G; g++) mx[g] = vf_set1(-INFINITY);
        for (int64_t t0 = 0; t0 < cn; t0 += 8) {
            int64_t nt = cn - t0 < 8 ? cn - t0 : 8;
            for (int64_t a = t0 + KV_AHEAD; a < t0 + KV_AHEAD + 8 && a < cn; a++) prefetch_row(k_cache + rows[a], D);
            const bf16 *kr[8];
            for (int64_t i = 0; i < 8; i++) kr[i] = k_cache + rows[t0 + (i < nt ? i : nt - 1)];
#if WB_BF16_DOT
            if (shared) {
                __m512 s[EXT_SHARED_G][8];
                const uint32_t *qu = (const uint32_t *)qt;
                if (G == 3) ext_qk8(3, qu, kr, D, s);
                else if (G == 2) ext_qk8(2, qu, kr, D, s);
                else ext_qk8(1, qu, kr, D, s);
                for (int64_t g = 0; g < G; g++)
                    for (int64_t i = 0; i < nt; i++)
                        ext_score(s[g][i], scale, c0 + t0 + i - p0, bias, sc + (g * chunk + t0 + i) * 16, &mx[g]);
                continue;
            }
#endif
            for (int64_t g = 0; g < G; g++) {
                vf s[8];
                for (int i = 0; i < 8; i++) s[i] = vf_zero();
#if WB_BF16_DOT
                const __m512bh *qg = (const __m512bh *)((uint32_t *)qt + g * D / 2 * 16);
                for (int64_t p = 0; p < D / 2; p++) {
                    __m512bh qv = qg[p];
                    for (int i = 0; i < 8; i++) s[i] = _mm512_dpbf16_ps(s[i], qv, BCAST_PAIR(kr[i] + 2 * p));
                }
#else
                const float *qg = qt + g * D * 16;
                for (int64_t d = 0; d < D; d++) {
                    vf qv = vf_load(qg + d * 16);
                    for (int i = 0; i < 8; i++) s[i] = vf_fma(qv, vf_set1(bf2f(kr[i][d])), s[i]);
                }
#endif
                for (int64_t i = 0; i < nt; i++)
                    ext_score(s[i], scale, c0 + t0 + i - p0, bias, sc + (g * chunk + t0 + i) * 16, &mx[g]);
            }
        }
#if WB_BF16_DOT
        // the chunk's values as pairs of keys, one 32-bit lane per dimension: (v_t[d], v_t+1[d])
        uint32_t *vp = (uint32_t *)(sc + 16 * EXT_SCORES);
        for (int64_t t = 0; t < cn; t += 2) {
            if (t + KV_AHEAD < cn) prefetch_row(v_cache + rows[t + KV_AHEAD], D);
            if (t + 1 + KV_AHEAD < cn) prefetch_row(v_cache + rows[t + 1 + KV_AHEAD], D);
            const bf16 *v0 = v_cache + rows[t], *v1 = t + 1 < cn ? v_cache + rows[t + 1] : NULL;
            for (int64_t d = 0; d < D; d += 16)  // 16 dims at a time: v0 in the low halves, v1 in the high
                _mm512_storeu_si512(vp + t / 2 * D + d, bf_pairs16(v0 + d, v1 ? v1 + d : NULL));
        }
#endif
        // pass 2: probabilities (bf16-rounded), the running sums, then P.V a block of 16 dims at a time
        // (8 dims for all G heads at once where they share the value broadcasts)
        vf corrs[EXT_GD / 16];
        for (int64_t g = 0; g < G; g++) {
            vf new_max = vf_max(run_max[g], mx[g]);
            vf corr = corrs[g] = vf_exp(vf_sub(run_max[g], new_max));
            run_max[g] = new_max;
            vf sum = vf_zero();
            float *ag = acc + g * D * 16, *sg = sc + g * chunk * 16;
#if WB_BF16_DOT
            // probabilities of key pairs, as the values: lane j = (p_j[t], p_j[t+1]) in bf16 (odd
            // tail: p = 0), packed in place straight from the fp32 exps (pair t / 2 is written after
            // keys t and t + 1 are read)
            for (int64_t t = 0; t < cn; t += 2) {
                vf e = ext_prob(sg + t * 16, new_max, c0 + t - p0, keep);
                sum = vf_add(sum, e);
                __m512i pair = _mm512_cvtepu16_epi32(wb_narrow_bf(e));
                if (t + 1 < cn) {
                    e = ext_prob(sg + (t + 1) * 16, new_max, c0 + t + 1 - p0, keep);
                    sum = vf_add(sum, e);
                    pair = _mm512_or_si512(pair, _mm512_slli_epi32(_mm512_cvtepu16_epi32(wb_narrow_bf(e)), 16));
                }
                _mm512_storeu_si512(sg + t / 2 * 16, pair);
            }
            run_sum[g] = vf_add(vf_mul(run_sum[g], corr), sum);
            if (shared) continue;  // P.V below, all heads at once
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
                vf a[16];
                for (int i = 0; i < 16; i++) a[i] = vf_mul(vf_load(ag + (d0 + i) * 16), corr);
                for (int64_t t = 0; t < cn; t += 2) {
                    __m512bh pp = (__m512bh)_mm512_loadu_si512(sg + t / 2 * 16);
                    const uint32_t *vr = vp + t / 2 * D + d0;
                    for (int i = 0; i < 16; i++) a[i] = _mm512_dpbf16_ps(a[i], pp, BCAST_PAIR(vr + i));
                }
                for (int i = 0; i < 16; i++) vf_store(ag + (d0 + i) * 16, a[i]);
            }
#else
            for (int64_t t = 0; t < cn; t++) {
                vf e = ext_prob(sg + t * 16, new_max, c0 + t - p0, keep);
                sum = vf_add(sum, e);
                vf_store(sg + t * 16, vf_round_bf(e));
            }
            run_sum[g] = vf_add(vf_mul(run_sum[g], corr), sum);
            for (int64_t d0 = 0; d0 < D; d0 += 16) {
                vf a[16];
                for (int i = 0; i < 16; i++) a[i] = vf_mul(vf_load(ag + (d0 + i) * 16), corr);
                for (int64_t t = 0; t < cn; t++) {
                    vf pt = vf_load(sg + t * 16);
                    const bf16 *vr = v_cache + rows[t] + d0;
                    for (int i = 0; i < 16; i++) a[i] = vf_fma(pt, vf_set1(bf2f(vr[i])), a[i]);
                }
                for (int i = 0; i < 16; i++) vf_store(ag + (d0 + i) * 16, a[i]);
            }
#endif
        }
#if WB_BF16_DOT
        if (shared)
            for (int64_t d0 = 0; d0 < D; d0 += 8) {
                if (G == 3) ext_pv8(3, acc, sc, chunk, vp, cn, D, d0, corrs);
                else if (G == 2) ext_pv8(2, acc, sc, chunk, vp, cn, D, d0, corrs);
                else ext_pv8(1, acc, sc, chunk, vp, cn, D, d0, corrs);
            }
#endif
    }
    ext_write(acc, run_sum, out, row0, nq, h, G, Hq, D);
}

#if WB_AMX
// The same tile of queries with its two products on AMX (where the tiles multiply on it): scores
// S^T [16 keys][16 queries] = K [16 keys][32 dims] . Q^T, whose B tile is q^T's bf16 pairs as the
// kernel above lays them out (16 pair rows x 16 query lanes), stored straight into the scores'
// query-lane layout; then acc^T [16 dims][16 queries] += V^T [16 dims][32 keys] . P^T, whose B tile
// is the probabilities' key pairs as packed above, and V^T the values transposed once a call for
// all query tiles. The softmax between them counts in log2 units (exta_exp2); the rounding points
// are the AVX-512 kernel's (probabilities rounded to bf16, products of bf16 exact in fp32, fp32
// sums). Tiles 0 .. G - 1 accumulate a head each, 6 is A, 7 is B: G <= 6 and D a multiple of 32.
#define EXTA_G 6
#define EXTA_CASES(OP) \
    switch (g) {       \
    case 0: OP(0); break; \
    case 1: OP(1); break; \
    case 2: OP(2); break; \
    case 3: OP(3); break; \
    case 4: OP(4); break; \
    default: OP(5); break; \
    }
#define EXTA_ZERO(t) _tile_zero(t)
#define EXTA_DOT(t) _tile_dpbf16ps(t, 6, 7)
#define EXTA_STORE(t) _tile_stored(t, p, 64)
#define EXTA_LOAD(t) _tile_loadd(t, p, 64)
AMX_TARGET static inline void exta_zero(int g) { EXTA_CASES(EXTA_ZERO) }
AMX_TARGET static inline void exta_dot(int g) { EXTA_CASES(EXTA_DOT) }
AMX_TARGET static inline void exta_store(int g, void *p) { EXTA_CASES(EXTA_STORE) }
AMX_TARGET static inline void exta_load(int g, const void *p) { EXTA_CASES(EXTA_LOAD) }

// vt [D][ld] bf16, columns 0 .. cp - 1 <- the values of keys rows[0 .. cn - 1] transposed (zero
// past cn; cp: cn rounded up to 32)
static void exta_values(bf16 *vt, int64_t ld, const bf16 *v_cache, const int64_t *rows, int64_t cn, int64_t cp,
                        int64_t D) {
    for (int64_t t0 = 0; t0 < cp; t0 += 32)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512i r[16];  // r[i]: keys t0 + 2i, t0 + 2i + 1 at dims d0 .. d0 + 15, as bf16 pairs
            for (int i = 0; i < 16; i++) {
                int64_t t = t0 + 2 * i;
                r[i] = bf_pairs16(t < cn ? v_cache + rows[t] + d0 : NULL, t + 1 < cn ? v_cache + rows[t + 1] + d0 : NULL);
            }
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(vt + (d0 + i) * ld + t0, r[i]);
        }
}

// 2^x for x <= 0 (scores minus their maximum, in log2 units), a degree-6 polynomial on [-1/2, 1/2]
// scaled by 2^n. Clamped at -126, so never under fp32's smallest normal: a denormal or underflowing
// result takes a microcode assist (a clamp at -150 made the whole kernel 1.4x slower); the masked
// (-inf) scores' 2^-126 is zeroed by the caller
static inline vf exta_exp2(vf x) {
    x = vf_max(x, vf_set1(-126.0f));
    vf n = vf_round_int(x), f = vf_sub(x, n);  // f in [-1/2, 1/2]
    vf p = vf_set1(1.5403530393381609e-4f);
    p = vf_fma(p, f, vf_set1(1.3333558146428443e-3f));
    p = vf_fma(p, f, vf_set1(9.6181291076284772e-3f));
    p = vf_fma(p, f, vf_set1(5.5504108664821580e-2f));
    p = vf_fma(p, f, vf_set1(0.24022650695910071f));
    p = vf_fma(p, f, vf_set1(0.69314718055994531f));
    p = vf_fma(p, f, vf_set1(1.0f));
    return vf_scale2(p, n);
}

// lane j = (e0_j, e1_j) rounded to bf16: the key pairs of P^T, a B tile's rows
static inline __m512i exta_pairs(vf e0, vf e1) {
    static const int16_t inter[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // e0 in words 0-15, e1 in 16-31
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(inter), both);
}

// The calling thread's buffer for the transposed values, grown as needed and kept (a prefill
// step's layers all need about the same size).
static _Thread_local bf16 *exta_vt;
static _Thread_local int64_t exta_vt_n;

static bf16 *exta_transposed(int64_t n) {
    if (n > exta_vt_n) {
        free(exta_vt);
        exta_vt_n = n + n / 4;
        exta_vt = aligned_alloc(64, (exta_vt_n * 2 + 63) & ~(int64_t)63);
    }
    return exta_vt;
}

AMX_TARGET static void extend_task_amx(const bf16 *q, const bf16 *k_cache, const bf16 *vts, int64_t ld,
                                       const int32_t *table, bf16 *out, int64_t row0, int64_t nq, int64_t p0, int64_t h,
                                       int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale) {
    int64_t G = Hq / Hkv, L = p0 + nq;
    float *buf = ext_buffers();
    // q^T pairs [G][D/2][16], acc^T [G][D][16], scores [G][chunk][16] (their probabilities packed
    // in place as key pairs); the values transposed are the caller's (vts [D][ld], all keys)
    float *qt = buf, *acc = buf + 16 * EXT_GD, *sc = buf + 32 * EXT_GD;
    _Alignas(64) bf16 kbuf[16 * MAX_D];  // 16 keys' rows where they do not lie in one block
    int64_t chunk = EXT_SCORES / G;
    chunk = (chunk > EXT_KEYS ? EXT_KEYS : chunk) & ~(int64_t)31;
    vf run_max[EXTA_G], run_sum[EXTA_G];
    ext_start(q, qt, acc, run_max, run_sum, row0, nq, h, G, Hq, D);
    float bias[EXT_Q][16], keep[EXT_Q][16];
    ext_masks(bias, keep);
    int64_t rows[EXT_KEYS];
    for (int64_t c0 = 0; c0 < L; c0 += chunk) {
        int64_t cn = L - c0 < chunk ? L - c0 : chunk, cp = (cn + 31) & ~(int64_t)31;
        chunk_rows(rows, table, c0, cn, bs, Hkv, h, D);
        // pass 1: S^T, 16 keys at a time, read from the cache where they lie in one block
        for (int64_t t0 = 0; t0 < cn; t0 += 16) {
            int64_t nt = cn - t0 < 16 ? cn - t0 : 16;
            int64_t stride;
            const bf16 *kr = amx_key_rows(kbuf, k_cache, rows, c0, t0, nt, bs, Hkv, D, &stride);
            for (int64_t a = t0 + KV_AHEAD; a < t0 + KV_AHEAD + 16 && a < cn; a++) prefetch_row(k_cache + rows[a], D);
            for (int g = 0; g < G; g++) exta_zero(g);
            for (int64_t c = 0; c < D; c += 32) {
                _tile_loadd(6, kr + c, stride);
                for (int g = 0; g < G; g++) {
                    _tile_loadd(7, (const uint32_t *)qt + (g * D / 2 + c / 2) * 16, 64);
                    exta_dot(g);
                }
            }
            for (int g = 0; g < G; g++) exta_store(g, sc + (g * chunk + t0) * 16);
        }
        // scores in log2 units (scale * log2 e), masked on the diagonal, and each lane's maximum;
        // keys before `clear` are later than no query of the tile
        int64_t clear = p0 - c0 + 1 < cn ? p0 - c0 + 1 : cn;
        if (clear < 0) clear = 0;
        vf mx[EXTA_G], s2 = vf_set1(scale * 1.44269504088896341f);
        for (int64_t g = 0; g < G; g++) {
            float *sg = sc + g * chunk * 16;
            vf m0 = vf_set1(-INFINITY), m1 = m0;
            int64_t t = 0;
            for (; t + 1 < clear; t += 2) {
                vf a = vf_mul(vf_load(sg + t * 16), s2), b = vf_mul(vf_load(sg + (t + 1) * 16), s2);
                vf_store(sg + t * 16, a);
                vf_store(sg + (t + 1) * 16, b);
                m0 = vf_max(m0, a);
                m1 = vf_max(m1, b);
            }
            for (; t < cn; t++) {
                vf a = vf_mul(vf_load(sg + t * 16), s2);
                if (t >= clear) a = vf_add(a, vf_load(bias[c0 + t - p0]));
                vf_store(sg + t * 16, a);
                m0 = vf_max(m0, a);
            }
            mx[g] = vf_max(m0, m1);
        }
        // pass 2: probabilities 2^(s - max) as key pairs (bf16, zero past the chunk's end up to 32
        // keys), their fp32 running sums, the old accumulators rescaled; then acc^T += V^T . P^T
        for (int64_t g = 0; g < G; g++) {
            vf new_max = vf_max(run_max[g], mx[g]);
            vf corr = exta_exp2(vf_sub(run_max[g], new_max));
            run_max[g] = new_max;
            vf sum0 = vf_zero(), sum1 = vf_zero();
            float *sg = sc + g * chunk * 16, *ag = acc + g * D * 16;
            int64_t t = 0;
            for (; t + 1 < clear; t += 2) {
                vf e0 = exta_exp2(vf_sub(vf_load(sg + t * 16), new_max));
                vf e1 = exta_exp2(vf_sub(vf_load(sg + (t + 1) * 16), new_max));
                sum0 = vf_add(sum0, e0);
                sum1 = vf_add(sum1, e1);
                _mm512_storeu_si512(sg + t / 2 * 16, exta_pairs(e0, e1));
            }
            for (; t < cp; t += 2) {  // the diagonal (masked lanes zeroed), the odd key, the padding
                vf e0 = vf_zero(), e1 = vf_zero();
                if (t < cn) e0 = exta_exp2(vf_sub(vf_load(sg + t * 16), new_max));
                if (t + 1 < cn) e1 = exta_exp2(vf_sub(vf_load(sg + (t + 1) * 16), new_max));
                if (t >= clear && t < cn) e0 = vf_mul(e0, vf_load(keep[c0 + t - p0]));
                if (t + 1 >= clear && t + 1 < cn) e1 = vf_mul(e1, vf_load(keep[c0 + t + 1 - p0]));
                sum0 = vf_add(sum0, e0);
                sum1 = vf_add(sum1, e1);
                _mm512_storeu_si512(sg + t / 2 * 16, exta_pairs(e0, e1));
            }
            run_sum[g] = vf_add(vf_mul(run_sum[g], corr), vf_add(sum0, sum1));
            for (int64_t d = 0; d < D; d++) vf_store(ag + d * 16, vf_mul(vf_load(ag + d * 16), corr));
        }
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            for (int g = 0; g < G; g++) exta_load(g, acc + (g * D + d0) * 16);
            for (int64_t t0 = 0; t0 < cp; t0 += 32) {
                _tile_loadd(6, vts + d0 * ld + c0 + t0, ld * 2);
                for (int g = 0; g < G; g++) {
                    _tile_loadd(7, sc + (g * chunk + t0 / 2) * 16, 64);
                    exta_dot(g);
                }
            }
            for (int g = 0; g < G; g++) exta_store(g, acc + (g * D + d0) * 16);
        }
    }
    ext_write(acc, run_sum, out, row0, nq, h, G, Hq, D);
}
#endif

// 1 when wb_paged_extend multiplies on AMX at these heads (G = Hq / Hkv query heads per KV head)
int64_t wb_extend_amx(int64_t Hq, int64_t Hkv, int64_t D) {
#if WB_AMX
    return amx_on && D % 32 == 0 && Hq / Hkv <= EXTA_G;
#else
    (void)Hq, (void)Hkv, (void)D;
    return 0;
#endif
}

// Causal attention of the new tokens: sequence s has its tokens at q rows cu_q[s] .. cu_q[s+1] - 1
// and lens[s] tokens of context in all (the new ones last, already in the cache).
void wb_paged_extend(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int32_t *tables,
                     const int32_t *cu_q, const int32_t *lens, bf16 *out, int64_t S, int64_t Hq, int64_t Hkv,
                     int64_t D, int64_t bs, int64_t W, float scale) {
    int64_t tasks = 0;
    for (int64_t s = 0; s < S; s++) tasks += (cu_q[s + 1] - cu_q[s] + EXT_Q - 1) / EXT_Q * Hkv;
#if WB_AMX
    const int amx = (int)wb_extend_amx(Hq, Hkv, D);
    // on AMX, every sequence's values transposed first ([Hkv][D][keys rounded up to 32] each at
    // voff[s]), once for all its query tiles, in tasks of 32 keys of a KV head
    int64_t vtasks = 0, *voff = NULL;
    bf16 *vt = NULL;
    if (amx) {
        voff = malloc(sizeof(int64_t) * (S + 1));
        voff[0] = 0;
        for (int64_t s = 0; s < S; s++) {
            int64_t lp = (lens[s] + 31) & ~(int64_t)31;
            voff[s + 1] = voff[s] + Hkv * D * lp;
            vtasks += lp / 32 * Hkv;
        }
        vt = exta_transposed(voff[S]);
    }
#endif
#pragma omp parallel
    {
#if WB_AMX
        if (amx) {
            amx_configure(16, 16);
#pragma omp for schedule(dynamic, 4)
            for (int64_t i = 0; i < vtasks; i++) {
                int64_t k = i, s = 0, blocks = 0;
                for (; s < S; s++) {
                    blocks = (lens[s] + 31) / 32 * Hkv;
                    if (k < blocks) break;
                    k -= blocks;
                }
                int64_t lp = blocks / Hkv * 32, h = k % Hkv, c0 = k / Hkv * 32;
                int64_t cn = lens[s] - c0 < 32 ? lens[s] - c0 : 32, rows[32];
                chunk_rows(rows, tables + s * W, c0, cn, bs, Hkv, h, D);
                exta_values(vt + voff[s] + h * D * lp + c0, lp, v_cache, rows, cn, 32, D);
            }
        }
#endif
        // the longest tiles (last in each sequence: the most keys) go first for the dynamic schedule
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tasks; i++) {
            int64_t k = i, s = 0, tiles = 0;
            for (; s < S; s++) {
                tiles = (cu_q[s + 1] - cu_q[s] + EXT_Q - 1) / EXT_Q * Hkv;
                if (k < tiles) break;
                k -= tiles;
            }
            int64_t n = cu_q[s + 1] - cu_q[s], tile = (tiles / Hkv - 1) - k / Hkv, h = k % Hkv;
            int64_t first = tile * EXT_Q, nq = n - first < EXT_Q ? n - first : EXT_Q;
#if WB_AMX
            if (amx) {
                int64_t lp = (lens[s] + 31) & ~(int64_t)31;
                extend_task_amx(q, k_cache, vt + voff[s] + h * D * lp, lp, tables + s * W, out, cu_q[s] + first, nq,
                                lens[s] - n + first, h, Hq, Hkv, D, bs, scale);
                continue;
            }
#endif
            extend_task(q, k_cache, v_cache, tables + s * W, out, cu_q[s] + first, nq, lens[s] - n + first, h, Hq,
                        Hkv, D, bs, scale);
        }
#if WB_AMX
        if (amx) amx_release();
#endif
    }
#if WB_AMX
    free(voff);
#endif
}

// ---------------------------------------------------------------------------------------------
// One decoder layer for a step of a few tokens (decodes, short verifies and prefills; each token
// attends as a one-query decode over its causal context), in one call and one parallel
// region: at a token per step the per-op cost (a Python call, a thread fork and join each) was a
// fifth of the step. Same kernels and rounding points as the op-by-op path.

typedef struct {
    int64_t kind; // 0: bf16, 1: int8, 2: int4 (the wb_gemv_* layouts), 3: bf16 in `tiles` only
    const void *w, *aux;
    const bf16 *bias;
    int64_t n, k, group;
    const bf16 *tiles; // bf16 weights packed for the tiles (steps of more than GEMV_ROWS rows), or NULL
} wb_linear;

// Most rows the GEMVs take in a layer (cpu.MAX_ROWS); a longer step of bf16 layers runs the tiles.
// On AMX the tiles take steps from 3 rows (cpu.AMX_GEMV_ROWS): at SmolLM2's widths they streamed the
// weights 1.16x faster than the GEMVs at 4 rows and 2.0x at 8, 0.9x at 1-2.
#define GEMV_ROWS 8
#define AMX_GEMV_ROWS 2

typedef struct {
    wb_linear qkv, o, gate_up, down;
    const bf16 *ln1, *ln2;
    float eps;
} wb_layer;

typedef struct {
    int64_t T, H, Hq, Hkv, D, I;
    const int64_t *pos, *slots;
    const int32_t *tables, *lens;
    int64_t W, bs;
    const bf16 *cos, *sin;
    float scale;
    bf16 *h, *qkv, *q, *att, *o, *gu, *act; // scratch, sized for T rows
    float *xf;                               // scratch: T * max(K) floats
} wb_step;

// y = x @ W^T inside the caller's parallel region (all threads must call it).
static void linear_shared(const wb_linear *L, const bf16 *x, bf16 *y, int64_t M, float *xf) {
    int64_t N = L->n, K = L->k;
#if WB_BF16_DOT
    if (L->kind == 3 || (L->kind == 0 && M > (amx_on && K % 32 == 0 ? AMX_GEMV_ROWS : GEMV_ROWS) && L->tiles)) {
        tile_groups(x, L->tiles, L->bias, y, M, N, K);
        return;
    }
    if (L->kind == 0) {
        ROW_BLOCKS(SHARED, gemv_bf16_block, x, (const bf16 *)L->w, L->bias, y, N, K, M);
        return;
    }
#else
    if (L->kind == 0) {
#pragma omp single
        bf16_to_f32(x, xf, M * K);
        ROW_BLOCKS(SHARED, gemv_bf16_block, xf, (const bf16 *)L->w, L->bias, y, N, K);
        return;
    }
#endif
#if WB_QUANT_PREPARED
    // the quantised kernels' activations, re-laid out once (xf holds quant_scratch_bytes)
    const float *tail = quant_scratch_tail(xf, M, K);
    if (L->kind == 1) {
#pragma omp single
        int8_prepare(x, M, K, xf);
        ROW_BLOCKS(SHARED, gemv_int8_block, (const int16_t *)xf, tail, (const int8_t *)L->w, (const bf16 *)L->aux,
                   L->bias, y, N, K);
    } else {
#pragma omp single
        int4_prepare(x, M, K, L->group, xf);
        ROW_BLOCKS(SHARED, gemv_int4_block, (const void *)xf, tail, (const uint8_t *)L->w, (const bf16 *)L->aux,
                   L->bias, y, N, K, L->group);
    }
#else
#pragma omp single
    bf16_to_f32(x, xf, M * K);
    if (L->kind == 1)
        ROW_BLOCKS(SHARED, gemv_int8_block, xf, (const int8_t *)L->w, (const bf16 *)L->aux, L->bias, y, N, K);
    else
        ROW_BLOCKS(SHARED, gemv_int4_block, xf, (const uint8_t *)L->w, (const bf16 *)L->aux, L->bias, y, N, K,
                   L->group);
#endif
}

// One layer inside the caller's parallel region (all threads call it): x (the residual stream)
// += delta_in; delta_out = this layer's MLP output, for the next norm to add.
static void layer_body(const wb_layer *L, const wb_step *S, bf16 *x, const bf16 *delta_in, bf16 *delta_out,
                       bf16 *k_cache, bf16 *v_cache) {
    int64_t T = S->T, H = S->H, qkv_w = (S->Hq + 2 * S->Hkv) * S->D, att_w = S->Hq * S->D;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * H, delta_in ? delta_in + t * H : NULL, L->ln1, S->h + t * H, H, L->eps);
    linear_shared(&L->qkv, S->h, S->qkv, T, S->xf);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++)
        rope_token(S->qkv + t * qkv_w, S->pos[t], S->cos, S->sin, S->slots[t], S->q + t * att_w, k_cache, v_cache,
                   S->Hq, S->Hkv, S->D);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < T; b++)
        for (int64_t h = 0; h < S->Hkv; h++)
            decode_bf16_task(S->q, k_cache, v_cache, S->tables, S->lens, S->att, b, h, S->Hq, S->Hkv, S->D, S->bs,
                             S->W, S->scale);
    linear_shared(&L->o, S->att, S->o, T, S->xf);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) norm_row(x + t * H, S->o + t * H, L->ln2, S->h + t * H, H, L->eps);
    linear_shared(&L->gate_up, S->h, S->gu, T, S->xf);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) silu_row(S->gu + t * 2 * S->I, S->gu + t * 2 * S->I + S->I, S->act + t * S->I, S->I);
    linear_shared(&L->down, S->act, delta_out, T, S->xf);
}

void wb_decode_layer(const wb_layer *L, const wb_step *S, bf16 *x, const bf16 *delta_in, bf16 *delta_out,
                     bf16 *k_cache, bf16 *v_cache) {
#pragma omp parallel
    layer_body(L, S, x, delta_in, delta_out, k_cache, v_cache);
}

// n layers in one call and one parallel region (the whole decoder of a small step): delta ping-pongs
// between two [T, H] buffers, and the last layer's MLP output lands in delta_out.
void wb_decode_layers(const wb_layer *layers, int64_t n, const wb_step *S, bf16 *x, const bf16 *delta_in,
                      bf16 *delta_out, bf16 *delta_tmp, bf16 *const *k_caches, bf16 *const *v_caches) {
#pragma omp parallel
    for (int64_t i = 0; i < n; i++) {
        // the last layer writes delta_out; before it the buffers alternate so that it does
        bf16 *out = ((n - 1 - i) % 2 == 0) ? delta_out : delta_tmp;
        const bf16 *in = i == 0 ? delta_in : (out == delta_out ? delta_tmp : delta_out);
        layer_body(&layers[i], S, x, in, out, k_caches[i], v_caches[i]);
    }
}
