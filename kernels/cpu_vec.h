// The vector layer under cpu_kernels.c: 16 fp32 lanes (`vf`) and the few operations the kernels
// need, written once per instruction set. cpu_kernels.c is compiled once per variant with that
// variant's flags (workbench_kernels/cpu.py), and the compiler's predefined macros pick the
// implementation here:
//
//   __AVX512F__   one zmm register          (variants avx512, avx512_bf16)
//   __AVX2__      two ymm registers         (variant avx2; needs FMA and F16C too)
//   __ARM_NEON    four q registers          (variant neon, aarch64)
//   otherwise     a float[16] in plain C    (variant portable, -DWB_PORTABLE: loops the compiler
//                                            vectorises)
//
// Every implementation rounds the same way: bf16 conversions round to nearest even as torch does,
// exp uses the same polynomial, so the variants differ only where fp32 sums are ordered
// differently. Tails shorter than 16 lanes go through a zero-padded copy (AVX-512 masks them).

#ifndef WB_CPU_VEC_H
#define WB_CPU_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf2f(bf16 v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

// Round to nearest even, as torch does (a NaN stays a quiet NaN).
static inline bf16 f2bf(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#if defined(__AVX512F__) && !defined(WB_PORTABLE)
#include <immintrin.h>
#define WB_ISA "avx512"
#define WB_AVX512 1
typedef __m512 vf;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_neg(vf a) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
}
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline __mmask16 wb_tail(int64_t n) { return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1); }
static inline vf vf_load_n(const float *p, int64_t n) { return _mm512_maskz_loadu_ps(wb_tail(n), p); }
static inline void vf_store_n(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, wb_tail(n), v); }
static inline vf wb_widen_bf(__m256i raw) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline vf vf_load_bf(const bf16 *p) { return wb_widen_bf(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vf_load_bf_n(const bf16 *p, int64_t n) { return wb_widen_bf(_mm256_maskz_loadu_epi16(wb_tail(n), p)); }
#if defined(__AVX512BF16__)
static inline __m256i wb_narrow_bf(vf v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
static inline __m256i wb_narrow_bf(vf v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}
#endif
static inline void vf_store_bf(bf16 *p, vf v) { _mm256_storeu_si256((__m256i *)p, wb_narrow_bf(v)); }
static inline void vf_store_bf_n(bf16 *p, vf v, int64_t n) { _mm256_mask_storeu_epi16(p, wb_tail(n), wb_narrow_bf(v)); }
static inline vf vf_round_bf(vf v) { return wb_widen_bf(wb_narrow_bf(v)); }
static inline vf vf_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
// The 32 int4 codes of 16 packed bytes: low nibbles (values 0-15 of the run) or high (16-31).
static inline vf vf_load_u4(const uint8_t *p, int high) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    if (high) b = _mm512_srli_epi32(b, 4);
    return _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
}
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_hmax(vf v) { return _mm512_reduce_max_ps(v); }
static inline vf vf_round_int(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_scale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }

#elif defined(__AVX2__) && !defined(WB_PORTABLE)
#include <immintrin.h>
#define WB_ISA "avx2"
typedef struct { __m256 a, b; } vf;
#define WB_BOTH(expr_a, expr_b) do { r.a = (expr_a); r.b = (expr_b); } while (0)

static inline vf vf_zero(void) { vf r; WB_BOTH(_mm256_setzero_ps(), _mm256_setzero_ps()); return r; }
static inline vf vf_set1(float x) { vf r; WB_BOTH(_mm256_set1_ps(x), _mm256_set1_ps(x)); return r; }
static inline vf vf_add(vf x, vf y) { vf r; WB_BOTH(_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)); return r; }
static inline vf vf_sub(vf x, vf y) { vf r; WB_BOTH(_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)); return r; }
static inline vf vf_mul(vf x, vf y) { vf r; WB_BOTH(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); return r; }
static inline vf vf_div(vf x, vf y) { vf r; WB_BOTH(_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)); return r; }
static inline vf vf_fma(vf x, vf y, vf z) {
    vf r; WB_BOTH(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); return r;
}
static inline vf vf_max(vf x, vf y) { vf r; WB_BOTH(_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)); return r; }
static inline vf vf_min(vf x, vf y) { vf r; WB_BOTH(_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)); return r; }
static inline vf vf_neg(vf x) {
    __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
    vf r; WB_BOTH(_mm256_xor_ps(x.a, s), _mm256_xor_ps(x.b, s)); return r;
}
static inline vf vf_load(const float *p) { vf r; WB_BOTH(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); return r; }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
static inline __m256 wb_widen8(__m128i raw) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)); }
static inline vf vf_load_bf(const bf16 *p) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    vf r; WB_BOTH(wb_widen8(_mm256_castsi256_si128(raw)), wb_widen8(_mm256_extracti128_si256(raw, 1))); return r;
}
static inline __m256i wb_narrow8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
}
static inline __m256i wb_narrow_bf(vf v) {
    // packus works within 128-bit lanes: [a0-3 b0-3 a4-7 b4-7], put back in order
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(wb_narrow8(v.a), wb_narrow8(v.b)), 0xD8);
}
static inline void vf_store_bf(bf16 *p, vf v) { _mm256_storeu_si256((__m256i *)p, wb_narrow_bf(v)); }
static inline vf vf_round_bf(vf v) {
    __m256i n = wb_narrow_bf(v);
    vf r; WB_BOTH(wb_widen8(_mm256_castsi256_si128(n)), wb_widen8(_mm256_extracti128_si256(n, 1))); return r;
}
static inline vf vf_load_i8(const int8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    vf r;
    WB_BOTH(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
    return r;
}
static inline float vf_sum(vf v) {
    __m256 s = _mm256_add_ps(v.a, v.b);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline float vf_hmax(vf v) {
    __m256 s = _mm256_max_ps(v.a, v.b);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline vf vf_round_int(vf v) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    vf r; WB_BOTH(_mm256_round_ps(v.a, mode), _mm256_round_ps(v.b, mode)); return r;
}
// 2^n for integral n in [-126, 127], built in the exponent field
static inline vf vf_pow2i(vf n) {
    const __m256i bias = _mm256_set1_epi32(127);
    vf r;
    WB_BOTH(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.a), bias), 23)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.b), bias), 23)));
    return r;
}
#undef WB_BOTH

#elif defined(__ARM_NEON) && !defined(WB_PORTABLE)
#include <arm_neon.h>
#define WB_ISA "neon"
typedef struct { float32x4_t v[4]; } vf;
#define WB_EACH(expr) do { for (int i_ = 0; i_ < 4; i_++) r.v[i_] = (expr); } while (0)

static inline vf vf_zero(void) { vf r; WB_EACH(vdupq_n_f32(0.f)); return r; }
static inline vf vf_set1(float x) { vf r; WB_EACH(vdupq_n_f32(x)); return r; }
static inline vf vf_add(vf x, vf y) { vf r; WB_EACH(vaddq_f32(x.v[i_], y.v[i_])); return r; }
static inline vf vf_sub(vf x, vf y) { vf r; WB_EACH(vsubq_f32(x.v[i_], y.v[i_])); return r; }
static inline vf vf_mul(vf x, vf y) { vf r; WB_EACH(vmulq_f32(x.v[i_], y.v[i_])); return r; }
static inline vf vf_div(vf x, vf y) { vf r; WB_EACH(vdivq_f32(x.v[i_], y.v[i_])); return r; }
static inline vf vf_fma(vf x, vf y, vf z) { vf r; WB_EACH(vfmaq_f32(z.v[i_], x.v[i_], y.v[i_])); return r; }
static inline vf vf_max(vf x, vf y) { vf r; WB_EACH(vmaxq_f32(x.v[i_], y.v[i_])); return r; }
static inline vf vf_min(vf x, vf y) { vf r; WB_EACH(vminq_f32(x.v[i_], y.v[i_])); return r; }
static inline vf vf_neg(vf x) { vf r; WB_EACH(vnegq_f32(x.v[i_])); return r; }
static inline vf vf_load(const float *p) { vf r; WB_EACH(vld1q_f32(p + 4 * i_)); return r; }
static inline void vf_store(float *p, vf v) { for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, v.v[i]); }
static inline float32x4_t wb_widen4(uint16x4_t h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }
static inline vf vf_load_bf(const bf16 *p) {
    uint16x8_t a = vld1q_u16(p), b = vld1q_u16(p + 8);
    vf r;
    r.v[0] = wb_widen4(vget_low_u16(a)), r.v[1] = wb_widen4(vget_high_u16(a));
    r.v[2] = wb_widen4(vget_low_u16(b)), r.v[3] = wb_widen4(vget_high_u16(b));
    return r;
}
static inline uint16x4_t wb_narrow4(float32x4_t v) {
    uint32x4_t u = vreinterpretq_u32_f32(v);
    uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1))));
    r = vshrq_n_u32(r, 16);
    uint32x4_t is_num = vceqq_f32(v, v);
    r = vbslq_u32(is_num, r, vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40)));
    return vmovn_u32(r);
}
static inline void vf_store_bf(bf16 *p, vf v) {
    for (int i = 0; i < 4; i++) vst1_u16(p + 4 * i, wb_narrow4(v.v[i]));
}
static inline vf vf_round_bf(vf v) { vf r; WB_EACH(wb_widen4(wb_narrow4(v.v[i_]))); return r; }
static inline vf vf_load_i8(const int8_t *p) {
    int8x16_t b = vld1q_s8(p);
    int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
    vf r;
    r.v[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), r.v[1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
    r.v[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), r.v[3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
    return r;
}
static inline vf vf_load_u4(const uint8_t *p, int high) {
    uint8x16_t b = vld1q_u8(p);
    b = high ? vshrq_n_u8(b, 4) : vandq_u8(b, vdupq_n_u8(15));
    uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_u8(vget_high_u8(b));
    vf r;
    r.v[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), r.v[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo)));
    r.v[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), r.v[3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)));
    return r;
}
static inline float vf_sum(vf v) { return vaddvq_f32(vaddq_f32(vaddq_f32(v.v[0], v.v[1]), vaddq_f32(v.v[2], v.v[3]))); }
static inline float vf_hmax(vf v) { return vmaxvq_f32(vmaxq_f32(vmaxq_f32(v.v[0], v.v[1]), vmaxq_f32(v.v[2], v.v[3]))); }
static inline vf vf_round_int(vf v) { vf r; WB_EACH(vrndnq_f32(v.v[i_])); return r; }
static inline vf vf_pow2i(vf n) {
    vf r;
    WB_EACH(vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.v[i_]), vdupq_n_s32(127)), 23)));
    return r;
}
#undef WB_EACH

#else
#define WB_ISA "portable"
typedef struct { float v[16]; } vf;
#define WB_EACH(expr) do { for (int i = 0; i < 16; i++) r.v[i] = (expr); } while (0)

static inline vf vf_zero(void) { vf r; WB_EACH(0.f); return r; }
static inline vf vf_set1(float x) { vf r; WB_EACH(x); return r; }
static inline vf vf_add(vf x, vf y) { vf r; WB_EACH(x.v[i] + y.v[i]); return r; }
static inline vf vf_sub(vf x, vf y) { vf r; WB_EACH(x.v[i] - y.v[i]); return r; }
static inline vf vf_mul(vf x, vf y) { vf r; WB_EACH(x.v[i] * y.v[i]); return r; }
static inline vf vf_div(vf x, vf y) { vf r; WB_EACH(x.v[i] / y.v[i]); return r; }
// a multiply and an add (two roundings): fmaf is a slow library call where the CPU has no FMA
static inline vf vf_fma(vf x, vf y, vf z) { vf r; WB_EACH(x.v[i] * y.v[i] + z.v[i]); return r; }
static inline vf vf_max(vf x, vf y) { vf r; WB_EACH(x.v[i] > y.v[i] ? x.v[i] : y.v[i]); return r; }
static inline vf vf_min(vf x, vf y) { vf r; WB_EACH(x.v[i] < y.v[i] ? x.v[i] : y.v[i]); return r; }
static inline vf vf_neg(vf x) { vf r; WB_EACH(-x.v[i]); return r; }
static inline vf vf_load(const float *p) { vf r; WB_EACH(p[i]); return r; }
static inline void vf_store(float *p, vf v) { for (int i = 0; i < 16; i++) p[i] = v.v[i]; }
static inline vf vf_load_bf(const bf16 *p) { vf r; WB_EACH(bf2f(p[i])); return r; }
static inline void vf_store_bf(bf16 *p, vf v) { for (int i = 0; i < 16; i++) p[i] = f2bf(v.v[i]); }
static inline vf vf_round_bf(vf v) { vf r; WB_EACH(bf2f(f2bf(v.v[i]))); return r; }
static inline vf vf_load_i8(const int8_t *p) { vf r; WB_EACH((float)p[i]); return r; }
static inline vf vf_load_u4(const uint8_t *p, int high) { vf r; WB_EACH((float)(high ? p[i] >> 4 : p[i] & 15)); return r; }
static inline float vf_sum(vf v) {
    // pairwise, like the vector implementations' tree
    for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) v.v[i] += v.v[i + w];
    return v.v[0];
}
static inline float vf_hmax(vf v) {
    float m = v.v[0];
    for (int i = 1; i < 16; i++) m = v.v[i] > m ? v.v[i] : m;
    return m;
}
// nearest even by adding and removing 1.5 * 2^23 (|v| < 2^22 here): nearbyintf is a library
// call on a baseline x86-64 build
static inline vf vf_round_int(vf v) {
    vf r;
    WB_EACH((v.v[i] + 12582912.0f) - 12582912.0f);  // not folded: no -ffast-math
    return r;
}
static inline vf vf_pow2i(vf n) {
    vf r;
    for (int i = 0; i < 16; i++) {
        union { uint32_t u; float f; } c;
        c.u = (uint32_t)((int32_t)n.v[i] + 127) << 23;
        r.v[i] = c.f;
    }
    return r;
}
#undef WB_EACH
#endif

#if !defined(WB_AVX512)
// Partial vectors through a zero-padded copy.
static inline vf vf_load_n(const float *p, int64_t n) {
    if (n >= 16) return vf_load(p);
    float t[16] = {0};
    memcpy(t, p, (size_t)n * sizeof(float));
    return vf_load(t);
}
static inline void vf_store_n(float *p, vf v, int64_t n) {
    if (n >= 16) { vf_store(p, v); return; }
    float t[16];
    vf_store(t, v);
    memcpy(p, t, (size_t)n * sizeof(float));
}
static inline vf vf_load_bf_n(const bf16 *p, int64_t n) {
    if (n >= 16) return vf_load_bf(p);
    bf16 t[16] = {0};
    memcpy(t, p, (size_t)n * sizeof(bf16));
    return vf_load_bf(t);
}
static inline void vf_store_bf_n(bf16 *p, vf v, int64_t n) {
    if (n >= 16) { vf_store_bf(p, v); return; }
    bf16 t[16];
    vf_store_bf(t, v);
    memcpy(p, t, (size_t)n * sizeof(bf16));
}
// p * 2^n for integral n in [-150, 128] (the range exp needs): two factors, each a normal number.
static inline vf vf_scale2(vf p, vf n) {
    vf half = vf_round_int(vf_mul(n, vf_set1(0.5f)));
    return vf_mul(vf_mul(p, vf_pow2i(half)), vf_pow2i(vf_sub(n, half)));
}
#endif

// exp(x) for the softmax and SiLU: 2^(x log2 e) with a degree-6 polynomial on the fraction
// (relative error ~1e-7), the same steps on every instruction set. x already within [-104, 88.7].
static inline vf vf_exp_core(vf x) {
    vf t = vf_mul(x, vf_set1(1.44269504088896341f));
    vf n = vf_round_int(t);
    vf f = vf_mul(vf_sub(t, n), vf_set1(0.693147180559945309f));
    vf p = vf_set1(1.0f / 720);
    p = vf_fma(p, f, vf_set1(1.0f / 120));
    p = vf_fma(p, f, vf_set1(1.0f / 24));
    p = vf_fma(p, f, vf_set1(1.0f / 6));
    p = vf_fma(p, f, vf_set1(0.5f));
    p = vf_fma(p, f, vf_set1(1.0f));
    p = vf_fma(p, f, vf_set1(1.0f));
    return vf_scale2(p, n);
}

static inline vf vf_exp(vf x) { return vf_exp_core(vf_min(vf_max(x, vf_set1(-104.0f)), vf_set1(88.7f))); }
// x <= 0 (softmax's score minus its maximum): no overflow clamp, one op fewer an element; clamped
// at -87, where e^x is still a normal float: an underflowing result takes a microcode assist on
// Intel (the masked, -inf, scores' e^-87 ~ 1.6e-38 is zeroed by the caller)
static inline vf vf_exp_nonpos(vf x) { return vf_exp_core(vf_max(x, vf_set1(-87.0f))); }

static inline float wb_expf(float x) {
    float r[16];
    vf_store(r, vf_exp(vf_set1(x)));
    return r[0];
}

#endif
