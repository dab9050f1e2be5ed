/* ggml block types -> float: the type table (block sizes and each variant's kernel), the dispatch, and
 * the kernels of the legacy and K-quant types: a scalar reference for every one, AVX2 and AVX-512
 * variants for the common ones (Q8_0, Q4_0, Q4_K, Q6_K), AVX2 for Q2_K, Q3_K and Q5_K, NEON for all seven
 * (gguf_neon.h).  The IQ types are in gguf_iq.c, the ternary, 1-/2-bit and FP4 types in gguf_lowbit.c.
 *
 * Every variant computes each value with the operation sequence of gguf-py's numpy dequantizers
 * (gguf/quants.py), which is also ggml's: f16 scales converted exactly to f32 (subnormals kept), then
 *   Q4_0/Q5_0/Q8_0: d * q             Q4_1/Q5_1: d * q + m
 *   Q2_K: (d * sc) * q - (dmin * m)   Q3_K, Q6_K: (d * sc) * q
 *   Q4_K/Q5_K: (d * sc) * q - (dmin * m)                        Q8_K: d(f32) * q
 * each product and difference rounded to f32 separately (no FMA: -ffp-contract=off and explicit
 * mul/sub intrinsics), so the variants agree bit for bit with each other and with gguf-py.
 * Block layouts are ggml's (ggml-common.h); all multi-byte fields are little-endian. */
#include <string.h>

#include "dispatch.h"
#include "minifloat.h"
#include "fpconv.h"
#include "gguf_dequant.h"
#include "gguf_kernels.h"
#include "simd.h"

#define QK_K MCF_QK_K
#define f16 mcf_f16_at
#define le32 mcf_le32

/* ---- scalar reference ----------------------------------------------------------------------- */

static void f32_scalar(const uint8_t *x, size_t n, float *y) { memcpy(y, x, n * 4); }
static void f16_scalar(const uint8_t *x, size_t n, float *y) { for (size_t i = 0; i < n; i++) y[i] = f16(x + 2 * i); }

static void bf16_scalar(const uint8_t *x, size_t n, float *y)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)(x[2 * i] | (x[2 * i + 1] << 8)) << 16;
        memcpy(y + i, &u, 4);
    }
}

static void f64_scalar(const uint8_t *x, size_t n, float *y)
{
    for (size_t i = 0; i < n; i++) {
        double v;
        memcpy(&v, x + 8 * i, 8);
        y[i] = (float)v;
    }
}

static void q4_0_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 18, y += 32) {
        float d = f16(x);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((int)(x[2 + j] & 0x0f) - 8);
            y[j + 16] = d * (float)((int)(x[2 + j] >> 4) - 8);
        }
    }
}

static void q4_1_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 20, y += 32) {
        float d = f16(x), m = f16(x + 2);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(x[4 + j] & 0x0f) + m;
            y[j + 16] = d * (float)(x[4 + j] >> 4) + m;
        }
    }
}

static void q5_0_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 22, y += 32) {
        float d = f16(x);
        uint32_t qh = le32(x + 2);
        const uint8_t *qs = x + 6;
        for (int j = 0; j < 16; j++) {
            int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1u) << 4);
            int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
            y[j] = d * (float)(lo - 16);
            y[j + 16] = d * (float)(hi - 16);
        }
    }
}

static void q5_1_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 24, y += 32) {
        float d = f16(x), m = f16(x + 2);
        uint32_t qh = le32(x + 4);
        const uint8_t *qs = x + 8;
        for (int j = 0; j < 16; j++) {
            int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1u) << 4);
            int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        }
    }
}

static void q8_0_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 34, y += 32) {
        float d = f16(x);
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)x[2 + j] * d;
    }
}

/* Q2_K: scales[16] | qs[64] | d | dmin.  Element e = h*128 + s*32 + j takes bits 2s of qs[h*32 + j];
 * sub-block e/16 has scale low nibble, min high nibble. */
static inline void q2_k_factors(const uint8_t *x, float dl[16], float ml[16])
{
    float d = f16(x + 80), dmin = f16(x + 82);
    for (int i = 0; i < 16; i++) {
        dl[i] = d * (float)(x[i] & 0x0f);
        ml[i] = dmin * (float)(x[i] >> 4);
    }
}

static void q2_k_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 84, y += QK_K) {
        const uint8_t *qs = x + 16;
        float dl[16], ml[16];
        q2_k_factors(x, dl, ml);
        for (int e = 0; e < QK_K; e++) {
            int h = e >> 7, s = (e >> 5) & 3, j = e & 31;
            float q = (float)((qs[h * 32 + j] >> (2 * s)) & 3);
            y[e] = dl[e >> 4] * q - ml[e >> 4];
        }
    }
}

/* Q3_K: hmask[32] | qs[64] | scales[12] | d.  6-bit signed scales (minus 32); element e takes 2 bits
 * from qs like Q2_K and subtracts 4 unless bit e/32 of hmask[e%32] is set. */
static inline void q3_k_factors(const uint8_t *x, float dl[16])
{
    const uint8_t *s = x + 96;
    float d = f16(x + 108);
    for (int k = 0; k < 16; k++) {
        int lo = k < 8 ? (s[k] & 0x0f) : (s[k - 8] >> 4);
        int hi = (s[8 + (k & 3)] >> (2 * (k >> 2))) & 3;
        dl[k] = d * (float)((int8_t)(lo | (hi << 4)) - 32);
    }
}

static void q3_k_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 110, y += QK_K) {
        const uint8_t *hm = x, *qs = x + 32;
        float dl[16];
        q3_k_factors(x, dl);
        for (int e = 0; e < QK_K; e++) {
            int h = e >> 7, sh = (e >> 5) & 3, j = e & 31;
            int ql = (qs[h * 32 + j] >> (2 * sh)) & 3;
            int hb = (hm[j] >> (e >> 5)) & 1;
            y[e] = dl[e >> 4] * (float)(ql - (hb ? 0 : 4));
        }
    }
}

/* The 12-byte packed 6-bit scales and mins of Q4_K / Q5_K. */
static inline void k4_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8])
{
    for (int i = 0; i < 4; i++) {
        sc[i] = s[i] & 63;
        mn[i] = s[4 + i] & 63;
        sc[4 + i] = (uint8_t)((s[8 + i] & 0x0f) | ((s[i] >> 2) & 0x30));
        mn[4 + i] = (uint8_t)((s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30));
    }
}

static inline void k4_factors(const uint8_t *x, float ds[8], float dm[8])
{
    uint8_t sc[8], mn[8];
    float d = f16(x), dmin = f16(x + 2);
    k4_scales(x + 4, sc, mn);
    for (int i = 0; i < 8; i++) {
        ds[i] = d * (float)sc[i];
        dm[i] = dmin * (float)mn[i];
    }
}

/* Q4_K: d | dmin | scales[12] | qs[128].  Element e = g*64 + s*32 + j: nibble s of qs[g*32 + j],
 * sub-block e/32. */
static void q4_k_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 144, y += QK_K) {
        float ds[8], dm[8];
        k4_factors(x, ds, dm);
        const uint8_t *qs = x + 16;
        for (int e = 0; e < QK_K; e++) {
            int g = e >> 6, s = (e >> 5) & 1, j = e & 31;
            float q = (float)((qs[g * 32 + j] >> (4 * s)) & 0x0f);
            y[e] = ds[e >> 5] * q - dm[e >> 5];
        }
    }
}

/* Q5_K: d | dmin | scales[12] | qh[32] | qs[128]; the fifth bit of element e is bit e/32 of qh[e%32]. */
static void q5_k_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 176, y += QK_K) {
        float ds[8], dm[8];
        k4_factors(x, ds, dm);
        const uint8_t *qh = x + 16, *qs = x + 48;
        for (int e = 0; e < QK_K; e++) {
            int g = e >> 6, s = (e >> 5) & 1, j = e & 31;
            int q = ((qs[g * 32 + j] >> (4 * s)) & 0x0f) | (((qh[j] >> (e >> 5)) & 1) << 4);
            y[e] = ds[e >> 5] * (float)q - dm[e >> 5];
        }
    }
}

/* Q6_K: ql[128] | qh[64] | scales[16] (int8) | d.  Element e = h*128 + l: low nibble l/64 of
 * ql[h*64 + l%64], high two bits l/32 of qh[h*32 + l%32]; minus 32; sub-block e/16. */
static inline void q6_k_factors(const uint8_t *x, float ds[16])
{
    const int8_t *sc = (const int8_t *)(x + 192);
    float d = f16(x + 208);
    for (int i = 0; i < 16; i++) ds[i] = d * (float)sc[i];
}

static void q6_k_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 210, y += QK_K) {
        const uint8_t *ql = x, *qh = x + 128;
        float ds[16];
        q6_k_factors(x, ds);
        for (int e = 0; e < QK_K; e++) {
            int h = e >> 7, l = e & 127;
            int lo = (ql[h * 64 + (l & 63)] >> (4 * (l >> 6))) & 0x0f;
            int hi = (qh[h * 32 + (l & 31)] >> (2 * (l >> 5))) & 3;
            y[e] = ds[e >> 4] * (float)((lo | (hi << 4)) - 32);
        }
    }
}

/* Q8_K: d (f32) | qs[256] (int8) | bsums[16] (int16, unused here). */
static void q8_k_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 292, y += QK_K) {
        float d;
        memcpy(&d, x, 4);
        for (int j = 0; j < QK_K; j++) y[j] = d * (float)(int8_t)x[4 + j];
    }
}

#ifdef MCF_X86
/* ---- AVX2 and AVX-512 ------------------------------------------------------------------------------ */
/* Stores: streaming (non-temporal) for outputs far larger than the caches when aligned, else plain.
 * Only where the values are written, never how they are computed, so the bytes do not change. */
MCF_TARGET_AVX2 static inline void st8(float *p, __m256 v, int st)
{
    if (st) _mm256_stream_ps(p, v);
    else _mm256_storeu_ps(p, v);
}

MCF_TARGET_AVX2 static inline __m256 u8x8_ps(__m128i v) /* low 8 bytes, unsigned */
{
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

MCF_TARGET_AVX2 static inline __m256 i8x8_ps(__m128i v)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

MCF_TARGET_AVX512 static inline void st16(float *p, __m512 v, int st)
{
    if (st) _mm512_stream_ps(p, v);
    else _mm512_storeu_ps(p, v);
}

MCF_TARGET_AVX512 static inline __m512 u8x16_ps(__m128i v)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}

MCF_TARGET_AVX512 static inline __m512 i8x16_ps(__m128i v)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

/* The emitters, one per width with the same arguments: 16 signed codes (the low 16 bytes of q) -> 16 floats
 * s * q; 32 unsigned codes -> 32 floats s * q - m */
MCF_TARGET_AVX2 static inline void emit16s_avx2(__m128i q, float s, float *y, int st)
{
    __m256 vs = _mm256_set1_ps(s);
    st8(y, _mm256_mul_ps(vs, i8x8_ps(q)), st);
    st8(y + 8, _mm256_mul_ps(vs, i8x8_ps(_mm_srli_si128(q, 8))), st);
}

MCF_TARGET_AVX512 static inline void emit16s_avx512(__m128i q, float s, float *y, int st)
{
    st16(y, _mm512_mul_ps(_mm512_set1_ps(s), i8x16_ps(q)), st);
}

MCF_TARGET_AVX2 static inline void emit32_avx2(__m256i q, float s, float m, float *y, int st)
{
    __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    st8(y, _mm256_sub_ps(_mm256_mul_ps(vs, u8x8_ps(lo)), vm), st);
    st8(y + 8, _mm256_sub_ps(_mm256_mul_ps(vs, u8x8_ps(_mm_srli_si128(lo, 8))), vm), st);
    st8(y + 16, _mm256_sub_ps(_mm256_mul_ps(vs, u8x8_ps(hi)), vm), st);
    st8(y + 24, _mm256_sub_ps(_mm256_mul_ps(vs, u8x8_ps(_mm_srli_si128(hi, 8))), vm), st);
}

MCF_TARGET_AVX512 static inline void emit32_avx512(__m256i q, float s, float m, float *y, int st)
{
    __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m);
    st16(y, _mm512_sub_ps(_mm512_mul_ps(vs, u8x16_ps(_mm256_castsi256_si128(q))), vm), st);
    st16(y + 16, _mm512_sub_ps(_mm512_mul_ps(vs, u8x16_ps(_mm256_extracti128_si256(q, 1))), vm), st);
}

MCF_TARGET_AVX2 static void q8_0_avx2(const uint8_t *x, size_t nb, float *y, int st)
{
    for (size_t b = 0; b < nb; b++, x += 34, y += 32) {
        __m256 d = _mm256_set1_ps(f16(x));
        for (int k = 0; k < 4; k++)
            st8(y + 8 * k, _mm256_mul_ps(i8x8_ps(_mm_loadl_epi64((const __m128i *)(x + 2 + 8 * k))), d), st);
    }
}

MCF_TARGET_AVX512 static void q8_0_avx512(const uint8_t *x, size_t nb, float *y, int st)
{
    for (size_t b = 0; b < nb; b++, x += 34, y += 32) {
        __m512 d = _mm512_set1_ps(f16(x));
        st16(y, _mm512_mul_ps(i8x16_ps(_mm_loadu_si128((const __m128i *)(x + 2))), d), st);
        st16(y + 16, _mm512_mul_ps(i8x16_ps(_mm_loadu_si128((const __m128i *)(x + 18))), d), st);
    }
}

/* Q4_0, Q4_K, Q6_K in both widths */
#define MCF_GGUF_W avx2
#define MCF_GGUF_W_TARGET MCF_TARGET_AVX2
#include "gguf_dequant_x86.h"
#define MCF_GGUF_W avx512
#define MCF_GGUF_W_TARGET MCF_TARGET_AVX512
#include "gguf_dequant_x86.h"

/* ---- AVX2 only: Q5_K, Q2_K, Q3_K (AVX-512 runs these; the decode is bound by writing the output) ------- */
/* 16 unsigned codes (low 16 bytes) -> 16 floats s * q - m */
MCF_TARGET_AVX2 static inline void emit16u_avx2(__m128i q, float s, float m, float *y, int st)
{
    __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
    st8(y, _mm256_sub_ps(_mm256_mul_ps(vs, u8x8_ps(q)), vm), st);
    st8(y + 8, _mm256_sub_ps(_mm256_mul_ps(vs, u8x8_ps(_mm_srli_si128(q, 8))), vm), st);
}

/* Q5_K: Q4_K's nibbles plus bit e/32 of qh[e%32] as the fifth bit. */
MCF_TARGET_AVX2 static void q5_k_avx2(const uint8_t *x, size_t nb, float *y, int st)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    for (size_t b = 0; b < nb; b++, x += 176, y += QK_K) {
        float ds[8], dm[8];
        k4_factors(x, ds, dm);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(x + 16));
        for (int g = 0; g < 4; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + 48 + 32 * g));
            __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), one), 4);
            __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * g + 1), one), 4);
            emit32_avx2(_mm256_or_si256(_mm256_and_si256(v, m4), h0), ds[2 * g], dm[2 * g], y + 64 * g, st);
            emit32_avx2(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), h1), ds[2 * g + 1],
                        dm[2 * g + 1], y + 64 * g + 32, st);
        }
    }
}

/* Q2_K: element e = h*128 + s*32 + j is bits 2s of qs[h*32 + j]; scale/min per 16 elements. */
MCF_TARGET_AVX2 static void q2_k_avx2(const uint8_t *x, size_t nb, float *y, int st)
{
    const __m256i m2 = _mm256_set1_epi8(3);
    for (size_t b = 0; b < nb; b++, x += 84, y += QK_K) {
        float dl[16], ml[16];
        q2_k_factors(x, dl, ml);
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + 16 + 32 * h));
            for (int s = 0; s < 4; s++) {
                __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), m2);
                int sb = (h * 128 + 32 * s) >> 4;
                float *o = y + h * 128 + 32 * s;
                emit16u_avx2(_mm256_castsi256_si128(q), dl[sb], ml[sb], o, st);
                emit16u_avx2(_mm256_extracti128_si256(q, 1), dl[sb + 1], ml[sb + 1], o + 16, st);
            }
        }
    }
}

/* Q3_K: Q2_K's 2-bit codes minus 4 unless bit e/32 of hmask[e%32] is set; signed 6-bit scales. */
MCF_TARGET_AVX2 static void q3_k_avx2(const uint8_t *x, size_t nb, float *y, int st)
{
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), four = _mm256_set1_epi8(4);
    for (size_t b = 0; b < nb; b++, x += 110, y += QK_K) {
        float dl[16];
        q3_k_factors(x, dl);
        __m256i hm = _mm256_loadu_si256((const __m256i *)x);
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + 32 + 32 * h));
            for (int sh = 0; sh < 4; sh++) {
                __m256i ql = _mm256_and_si256(_mm256_srli_epi16(v, 2 * sh), m2);
                __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + sh), one);
                __m256i q = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(hb, 2)), four);
                int sb = (h * 128 + 32 * sh) >> 4;
                float *o = y + h * 128 + 32 * sh;
                emit16s_avx2(_mm256_castsi256_si128(q), dl[sb], o, st);
                emit16s_avx2(_mm256_extracti128_si256(q, 1), dl[sb + 1], o + 16, st);
            }
        }
    }
}

/* F16 / BF16: the shared conversions (fpconv_simd.c), which have their own variants */
static void f16_avx2(const uint8_t *x, size_t n, float *y, int st) { (void)st; mcf_convert(MCF_F16_TO_F32, x, y, n, MCF_IMPL_AVX2); }
static void f16_avx512(const uint8_t *x, size_t n, float *y, int st) { (void)st; mcf_convert(MCF_F16_TO_F32, x, y, n, MCF_IMPL_AVX512); }
static void bf16_avx2(const uint8_t *x, size_t n, float *y, int st) { (void)st; mcf_convert(MCF_BF16_TO_F32, x, y, n, MCF_IMPL_AVX2); }
static void bf16_avx512(const uint8_t *x, size_t n, float *y, int st) { (void)st; mcf_convert(MCF_BF16_TO_F32, x, y, n, MCF_IMPL_AVX512); }
#endif /* MCF_X86 */

#ifdef MCF_NEON
#include "gguf_neon.h"
#endif

/* ---- the type table and the dispatch -------------------------------------------------------------- */

/* One ggml type: `block` values in `size` bytes, its scalar kernel, and the vector kernel each variant runs
 * (dispatch.h), indexed by variant: a variant without its own code for the type runs the one below it
 * (Q2_K's AVX2 code when AVX-512 is selected: the decode is bound by writing the output, AVX-512 would not
 * gain), and NULL means the scalar kernel.  The scalar column is NULL (the scalar kernel has no `st`). */
typedef struct {
    uint16_t block, size;
    mcf_gguf_scalar_fn scalar;
    mcf_gguf_vector_fn vector[MCF_IMPL_COUNT];
} gguf_type;

#ifdef MCF_X86
#define X86(fn) fn
#else
#define X86(fn) NULL
#endif
#ifdef MCF_NEON
#define NEON(fn) fn
#else
#define NEON(fn) NULL
#endif
#define VECTOR(avx2, avx512, neon) \
    {[MCF_IMPL_AVX2] = X86(avx2), [MCF_IMPL_AVX512] = X86(avx512), [MCF_IMPL_NEON] = NEON(neon)}
#define EXTERNAL(name, block, size) \
    {block, size, name##_scalar, VECTOR(name##_avx2, name##_avx512, name##_neon)}

static const gguf_type TYPES[MCF_GGML_TYPE_LIMIT] = {
    [MCF_GGML_F32] = {1, 4, f32_scalar, {NULL}},
    [MCF_GGML_F16] = {1, 2, f16_scalar, VECTOR(f16_avx2, f16_avx512, f16_neon)},
    [MCF_GGML_BF16] = {1, 2, bf16_scalar, VECTOR(bf16_avx2, bf16_avx512, bf16_neon)},
    [MCF_GGML_F64] = {1, 8, f64_scalar, {NULL}},
    [MCF_GGML_Q4_0] = {32, 18, q4_0_scalar, VECTOR(q4_0_avx2, q4_0_avx512, q4_0_neon)},
    [MCF_GGML_Q4_1] = {32, 20, q4_1_scalar, {NULL}},
    [MCF_GGML_Q5_0] = {32, 22, q5_0_scalar, {NULL}},
    [MCF_GGML_Q5_1] = {32, 24, q5_1_scalar, {NULL}},
    [MCF_GGML_Q8_0] = {32, 34, q8_0_scalar, VECTOR(q8_0_avx2, q8_0_avx512, q8_0_neon)},
    [MCF_GGML_Q2_K] = {QK_K, 84, q2_k_scalar, VECTOR(q2_k_avx2, q2_k_avx2, q2_k_neon)},
    [MCF_GGML_Q3_K] = {QK_K, 110, q3_k_scalar, VECTOR(q3_k_avx2, q3_k_avx2, q3_k_neon)},
    [MCF_GGML_Q4_K] = {QK_K, 144, q4_k_scalar, VECTOR(q4_k_avx2, q4_k_avx512, q4_k_neon)},
    [MCF_GGML_Q5_K] = {QK_K, 176, q5_k_scalar, VECTOR(q5_k_avx2, q5_k_avx2, q5_k_neon)},
    [MCF_GGML_Q6_K] = {QK_K, 210, q6_k_scalar, VECTOR(q6_k_avx2, q6_k_avx512, q6_k_neon)},
    [MCF_GGML_Q8_K] = {QK_K, 292, q8_k_scalar, {NULL}},
    [MCF_GGML_IQ2_XXS] = EXTERNAL(mcf_gguf_iq2_xxs, QK_K, 66),
    [MCF_GGML_IQ2_XS] = EXTERNAL(mcf_gguf_iq2_xs, QK_K, 74),
    [MCF_GGML_IQ2_S] = EXTERNAL(mcf_gguf_iq2_s, QK_K, 82),
    [MCF_GGML_IQ3_XXS] = EXTERNAL(mcf_gguf_iq3_xxs, QK_K, 98),
    [MCF_GGML_IQ3_S] = EXTERNAL(mcf_gguf_iq3_s, QK_K, 110),
    [MCF_GGML_IQ1_S] = EXTERNAL(mcf_gguf_iq1_s, QK_K, 50),
    [MCF_GGML_IQ1_M] = EXTERNAL(mcf_gguf_iq1_m, QK_K, 56),
    [MCF_GGML_IQ4_NL] = EXTERNAL(mcf_gguf_iq4_nl, 32, 18),
    [MCF_GGML_IQ4_XS] = EXTERNAL(mcf_gguf_iq4_xs, QK_K, 136),
    [MCF_GGML_TQ1_0] = EXTERNAL(mcf_gguf_tq1_0, QK_K, 54),
    [MCF_GGML_TQ2_0] = EXTERNAL(mcf_gguf_tq2_0, QK_K, 66),
    [MCF_GGML_MXFP4] = EXTERNAL(mcf_gguf_mxfp4, 32, 17),
    [MCF_GGML_NVFP4] = EXTERNAL(mcf_gguf_nvfp4, 64, 36),
    [MCF_GGML_Q1_0] = EXTERNAL(mcf_gguf_q1_0, 128, 18),
    [MCF_GGML_Q2_0] = EXTERNAL(mcf_gguf_q2_0, 64, 18),
};

static const gguf_type *type_of(int type)
{
    return type >= 0 && type < MCF_GGML_TYPE_LIMIT && TYPES[type].scalar ? &TYPES[type] : NULL;
}

size_t mcf_gguf_block_size(int type) { const gguf_type *t = type_of(type); return t ? t->block : 0; }
size_t mcf_gguf_type_size(int type) { const gguf_type *t = type_of(type); return t ? t->size : 0; }

/* A variant has code of its own for a type when it runs a vector kernel the variant below it does not. */
int mcf_gguf_has_variant(int type, int impl)
{
    const gguf_type *t = type_of(type);
    if (!t || !(0 <= impl && impl < MCF_IMPL_COUNT)) return 0;
    int below = mcf_impl_below(impl);
    return below < 0 || (t->vector[impl] && t->vector[impl] != t->vector[below]);
}

const void *mcf_gguf_table(const char *name, size_t *nbytes)
{
    if (!strcmp(name, "kvalues_mxfp4")) {
        *nbytes = sizeof mcf_e2m1_x2;
        return mcf_e2m1_x2;
    }
    return mcf_gguf_iq_table(name, nbytes);
}

/* `variant`: a row of the table, as mcf_variant returns it */
static void decode_f32(const gguf_type *t, const uint8_t *x, size_t nb, float *y, int variant)
{
    mcf_gguf_vector_fn fn = t->vector[variant];
    if (fn) {
        /* streaming stores when the output (>= 8 MiB) is 64-byte aligned: every block's output then
         * starts on a 64-byte boundary (a multiple of 16 floats) */
        fn(x, nb, y, mcf_use_streaming(y, nb * t->block * 4));
#ifdef MCF_X86
        _mm_sfence();
#endif
        return;
    }
    t->scalar(x, nb, y);
}

int mcf_gguf_dequant(int type, const uint8_t *src, size_t nblocks, void *out, int out_kind, int impl)
{
    const gguf_type *t = type_of(type);
    if (!t) return -1;
    int variant = mcf_variant(impl);
    size_t bs = t->block, ts = t->size;
    if (out_kind == MCF_OUT_F32) {
        decode_f32(t, src, nblocks, (float *)out, variant);
        return 0;
    }
    if (out_kind == MCF_OUT_F16 && type == MCF_GGML_F16) { memcpy(out, src, nblocks * 2); return 0; }
    if (out_kind == MCF_OUT_BF16 && type == MCF_GGML_BF16) { memcpy(out, src, nblocks * 2); return 0; }
    /* narrow outputs: decode a cache-sized group of blocks to f32, then round it */
    float tmp[4096];
    size_t per = 4096 / bs, done = 0;
    uint16_t *o = (uint16_t *)out;
    while (done < nblocks) {
        size_t n = nblocks - done < per ? nblocks - done : per;
        decode_f32(t, src + done * ts, n, tmp, variant);
        mcf_convert(out_kind == MCF_OUT_F16 ? MCF_F32_TO_F16 : MCF_F32_TO_BF16, tmp, o + done * bs, n * bs, variant);
        done += n;
    }
    return 0;
}

/* ---- re-layout into MCF q8 / q4 (lossless) ---------------------------------------------------- */

size_t mcf_gguf_scales(int type, const uint8_t *src, size_t nblocks, uint16_t *scales)
{
    size_t ts = type == MCF_GGML_Q8_0 ? 34 : 18, bad = 0;
    for (size_t b = 0; b < nblocks; b++, src += ts) {
        uint16_t h = (uint16_t)(src[0] | (src[1] << 8));
        unsigned e = (h >> 10) & 0x1f;
        bad += (e == 0 && (h & 0x3ff)) || e == 0x1f;
        scales[b] = h;
    }
    return bad;
}

void mcf_gguf_codes(int type, const uint8_t *src, size_t nblocks, uint8_t *codes)
{
    if (type == MCF_GGML_Q8_0) {
        for (size_t b = 0; b < nblocks; b++) memcpy(codes + 32 * b, src + 34 * b + 2, 32);
        return;
    }
    /* Q4_0: element j is the low nibble of qs[j], element j+16 the high one, value nibble - 8.  MCF q4
     * packs element 2k in the low nibble of byte k, as a 4-bit two's complement code: nibble ^ 8. */
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *qs = src + 18 * b + 2;
        uint8_t *o = codes + 16 * b;
        for (int k = 0; k < 8; k++) {
            o[k] = (uint8_t)(((qs[2 * k] & 0x0f) | (qs[2 * k + 1] << 4)) ^ 0x88);
            o[8 + k] = (uint8_t)(((qs[2 * k] >> 4) | (qs[2 * k + 1] & 0xf0)) ^ 0x88);
        }
    }
}
