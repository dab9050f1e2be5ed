/* The scaled formats of csrc/mx.h: a scalar reference (csrc/minifloat.h's decoders, one float32 multiply per
 * value) and AVX2 / AVX-512 / NEON (mx_neon.h) variants computing the same products.
 *
 * How the vector variants decode elements: E2M1 is a table lookup in registers (vpermps on the 16 values for
 * AVX-512; on the magnitude's 8 values plus a sign xor for AVX2; two byte lookups on NEON); the byte-sized types
 * come from one source for every ISA, csrc/minifloat_vec.h (el8_avx2, el8_avx512, el8_neon), which says how (AVX2
 * decodes runs of E4M3 16 at a time as binary16 instead: e4m3x16_avx2).
 *
 * The scalar reference decodes each element from the format's definition (csrc/minifloat.h), through a table
 * of the 16 or 256 values it builds on each call (cheap next to any tensor, and no shared state). */
#include <string.h>

#include "dispatch.h"
#include "fpconv.h"
#include "minifloat.h"
#include "mx.h"
#include "simd.h"

static inline float ld_f32(const uint8_t *p)
{
    float f;
    memcpy(&f, p, 4);   /* the scales of a payload in a caller's buffer may sit at any address */
    return f;
}

static inline void put(void *out, size_t i, float w, int kind)
{
    if (kind == MCF_OUT_F32) ((float *)out)[i] = w;
    else if (kind == MCF_OUT_F16) ((uint16_t *)out)[i] = mcf_f32_to_f16_one(w);
    else ((uint16_t *)out)[i] = mcf_f32_to_bf16_one(w);
}

/* Values per scale block (mxfp4 / nvfp4). */
static inline size_t block_values(const mcf_mxtensor *t) { return t->kind == MCF_MX_MXFP4 ? 32 : 16; }

/* The scale of block `blk` (counted over the whole payload) of an mxfp4 or nvfp4 tensor. */
static inline float block_scale(const mcf_mxtensor *t, size_t blk)
{
    if (t->kind == MCF_MX_MXFP4) return mcf_e8m0_to_f32(t->scales[blk]);
    return mcf_e4m3_to_f32(t->scales[blk]) * t->global;
}

/* ---- scalar reference ------------------------------------------------------------------------------ */

static void dequant_scalar(const mcf_mxtensor *t, size_t r0, size_t r1, void *out, int kind)
{
    size_t cols = t->cols, o = 0;
    float lut[256];
    if (t->kind == MCF_MX_F8B128) {
        for (unsigned i = 0; i < 256; i++) lut[i] = mcf_e4m3_to_f32((uint8_t)i);
        size_t cpr = (cols + 127) / 128;
        for (size_t r = r0; r < r1; r++) {
            const uint8_t *srow = t->scales + (r / 128) * cpr * 4, *d = t->data + r * cols;
            for (size_t c = 0; c < cols; c++) put(out, o++, lut[d[c]] * ld_f32(srow + (c / 128) * 4), kind);
        }
        return;
    }
    for (unsigned i = 0; i < 16; i++) lut[i] = mcf_e2m1_to_f32(i);
    size_t bs = block_values(t), bpr = cols / bs;
    for (size_t blk = r0 * bpr; blk < r1 * bpr; blk++) {   /* cols is a multiple of bs: blocks run on across rows */
        float s = block_scale(t, blk);
        const uint8_t *d = t->data + blk * (bs / 2);
        for (size_t k = 0; k < bs / 2; k++) {
            put(out, o++, lut[d[k] & 15u] * s, kind);
            put(out, o++, lut[d[k] >> 4] * s, kind);
        }
    }
}

/* elements i0 .. n - 1 (the vector variants' tails start past 0) */
static void elements_scalar_from(int fmt, const uint8_t *src, size_t i0, size_t n, void *out, int kind)
{
    float lut[256];
    if (fmt == MCF_EL_E2M1) {
        for (unsigned k = 0; k < 16; k++) lut[k] = mcf_e2m1_to_f32(k);
        for (size_t i = i0; i < n; i++) put(out, i, lut[(src[i >> 1] >> ((i & 1) * 4)) & 15u], kind);
        return;
    }
    for (unsigned k = 0; k < 256; k++) lut[k] = mcf_el8_to_f32(fmt, (uint8_t)k);
    for (size_t i = i0; i < n; i++) put(out, i, lut[src[i]], kind);
}

/* The byte-sized element decoders of the vector variants: one source, minifloat_vec.h, compiled per ISA
 * (simd_vec.h's vocabulary): el8_avx2, el8_avx512, el8_neon. */
#ifdef MCF_X86
#define MCF_VEC_ISA MCF_VEC_AVX2
#include "simd_vec.h"
#include "minifloat_vec.h"
#define MCF_VEC_ISA MCF_VEC_AVX512
#include "simd_vec.h"
#include "minifloat_vec.h"
#endif
#ifdef MCF_NEON
#define MCF_VEC_ISA MCF_VEC_NEON
#include "simd_vec.h"
#include "minifloat_vec.h"
#endif
#define MCF_VEC_ISA MCF_VEC_NONE
#include "simd_vec.h"

#ifdef MCF_X86
/* ---- AVX2 --------------------------------------------------------------------------------------------- */

/* 16 E4M3 bytes as float32, in two vectors of 8: the byte's exponent and mantissa go where binary16 keeps
 * them (bits 14..7 of a half read with bias 15 instead of 7), vcvtph2ps widens exactly, subnormals
 * included, and the product by 2^8 (exact) restores the bias; a NaN byte becomes the binary16 quiet NaN,
 * whose widening is the quiet float32 NaN el8_avx2 writes, and which the product keeps.  About half the
 * instructions of el8_avx2 per value. */
MCF_TARGET_AVX2 static inline void e4m3x16_avx2(__m128i by, __m256 *lo, __m256 *hi)
{
    __m256i x = _mm256_cvtepu8_epi16(by);
    __m256i mag = _mm256_and_si256(x, _mm256_set1_epi16(0x7f));
    __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), sign);
    __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f));
    h = _mm256_blendv_epi8(h, _mm256_or_si256(sign, _mm256_set1_epi16(0x7e00)), nan);
    const __m256 bias = _mm256_set1_ps(256.0f);
    *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), bias);
    *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), bias);
}

/* 8 E2M1 codes (one per int32 lane, 0..15) as float32. */
MCF_TARGET_AVX2 static inline __m256 e2m1_avx2(__m256i nib)
{
    const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    __m256 v = _mm256_permutevar8x32_ps(mag, nib);   /* the low 3 bits pick the magnitude */
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nib, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
}

/* 16 packed bytes as 32 E2M1 codes in element order (byte k: element 2k low, 2k+1 high). */
MCF_TARGET_AVX2 static inline void nibbles32(__m128i by, __m128i *a, __m128i *b)
{
    __m128i lo = _mm_and_si128(by, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(by, 4), _mm_set1_epi8(0x0f));
    *a = _mm_unpacklo_epi8(lo, hi);
    *b = _mm_unpackhi_epi8(lo, hi);
}

/* 16 E2M1 codes (one per byte of a), times s when `scaled`, as 16 outputs at out[o] */
MCF_TARGET_AVX2 static inline void e2m1x16_out_avx2(void *out, size_t o, __m128i a, __m256 s, int scaled, int kind,
                                                    int stream)
{
    __m256 lo = e2m1_avx2(_mm256_cvtepu8_epi32(a)), hi = e2m1_avx2(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
    mcf_store8_avx2(out, o, scaled ? _mm256_mul_ps(lo, s) : lo, kind, stream);
    mcf_store8_avx2(out, o + 8, scaled ? _mm256_mul_ps(hi, s) : hi, kind, stream);
}

MCF_TARGET_AVX2 static void dequant_avx2(const mcf_mxtensor *t, size_t r0, size_t r1, void *out, int kind)
{
    size_t cols = t->cols, o = 0;
    /* streaming stores for outputs far larger than the caches, when every 8-value store lands aligned */
    int stream = kind == MCF_OUT_F32 && cols % 8 == 0 && mcf_use_streaming(out, (r1 - r0) * cols * 4);
    if (t->kind == MCF_MX_F8B128) {
        size_t cpr = (cols + 127) / 128;
        for (size_t r = r0; r < r1; r++, o += cols) {
            const uint8_t *srow = t->scales + (r / 128) * cpr * 4, *d = t->data + r * cols;
            size_t c = 0;
            for (; c + 16 <= cols; c += 16) {   /* 16 | 128: the 16 values share one scale */
                __m256 s = _mm256_set1_ps(ld_f32(srow + (c / 128) * 4)), x0, x1;
                e4m3x16_avx2(_mm_loadu_si128((const __m128i *)(d + c)), &x0, &x1);
                mcf_store8_avx2(out, o + c, _mm256_mul_ps(x0, s), kind, stream);
                mcf_store8_avx2(out, o + c + 8, _mm256_mul_ps(x1, s), kind, stream);
            }
            for (; c + 8 <= cols; c += 8) {
                __m256 x = el8_avx2(MCF_EL_E4M3, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(d + c))));
                x = _mm256_mul_ps(x, _mm256_set1_ps(ld_f32(srow + (c / 128) * 4)));
                mcf_store8_avx2(out, o + c, x, kind, stream);
            }
            for (; c < cols; c++) put(out, o + c, mcf_e4m3_to_f32(d[c]) * ld_f32(srow + (c / 128) * 4), kind);
        }
        if (stream) _mm_sfence();
        return;
    }
    size_t bs = block_values(t), bpr = cols / bs, blk = r0 * bpr, end = r1 * bpr;
    if (t->kind == MCF_MX_NVFP4) {
        /* 16 blocks per step: their scales at once (E4M3 through binary16, times the tensor's scale, as
         * block_scale() computes them), then two blocks (16 bytes) per nibble split, as mxfp4 does one */
        float sc[16];
        const __m256 g = _mm256_set1_ps(t->global);
        for (; blk + 16 <= end; blk += 16) {
            __m256 lo, hi;
            e4m3x16_avx2(_mm_loadu_si128((const __m128i *)(t->scales + blk)), &lo, &hi);
            _mm256_storeu_ps(sc, _mm256_mul_ps(lo, g));
            _mm256_storeu_ps(sc + 8, _mm256_mul_ps(hi, g));
            for (int k = 0; k < 16; k += 2, o += 32) {
                __m128i a, b;
                nibbles32(_mm_loadu_si128((const __m128i *)(t->data + (blk + (size_t)k) * 8)), &a, &b);
                e2m1x16_out_avx2(out, o, a, _mm256_broadcast_ss(&sc[k]), 1, kind, stream);
                e2m1x16_out_avx2(out, o + 16, b, _mm256_broadcast_ss(&sc[k + 1]), 1, kind, stream);
            }
        }
    }
    for (; blk < end; blk++) {
        __m256 s = _mm256_set1_ps(block_scale(t, blk));
        __m128i a, b;
        if (bs == 32) nibbles32(_mm_loadu_si128((const __m128i *)(t->data + blk * 16)), &a, &b);
        else nibbles32(_mm_loadl_epi64((const __m128i *)(t->data + blk * 8)), &a, &b);
        e2m1x16_out_avx2(out, o, a, s, 1, kind, stream);
        if (bs == 32) e2m1x16_out_avx2(out, o + 16, b, s, 1, kind, stream);
        o += bs;
    }
    if (stream) _mm_sfence();
}

MCF_TARGET_AVX2 static void elements_avx2(int fmt, const uint8_t *src, size_t n, void *out, int kind)
{
    size_t i = 0;
    int stream = kind == MCF_OUT_F32 && mcf_use_streaming(out, n * 4);
    if (fmt == MCF_EL_E2M1) {
        for (; i + 32 <= n; i += 32) {
            __m128i a, b;
            nibbles32(_mm_loadu_si128((const __m128i *)(src + i / 2)), &a, &b);
            e2m1x16_out_avx2(out, i, a, _mm256_setzero_ps(), 0, kind, stream);
            e2m1x16_out_avx2(out, i + 16, b, _mm256_setzero_ps(), 0, kind, stream);
        }
    } else {
        if (fmt == MCF_EL_E4M3)
            for (; i + 16 <= n; i += 16) {
                __m256 x0, x1;
                e4m3x16_avx2(_mm_loadu_si128((const __m128i *)(src + i)), &x0, &x1);
                mcf_store8_avx2(out, i, x0, kind, stream);
                mcf_store8_avx2(out, i + 8, x1, kind, stream);
            }
        for (; i + 8 <= n; i += 8) {
            __m256 x = el8_avx2(fmt, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i))));
            mcf_store8_avx2(out, i, x, kind, stream);
        }
    }
    if (stream) _mm_sfence();
    elements_scalar_from(fmt, src, i, n, out, kind);
}

/* ---- AVX-512 ------------------------------------------------------------------------------------------- */

MCF_TARGET_AVX512 static inline __m512 e2m1_avx512(__m128i nib16)
{
    const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nib16), lut);
}

MCF_TARGET_AVX512 static void dequant_avx512(const mcf_mxtensor *t, size_t r0, size_t r1, void *out, int kind)
{
    size_t cols = t->cols, o = 0;
    /* streaming stores for outputs far larger than the caches, when every 16-value store lands aligned */
    int stream = kind == MCF_OUT_F32 && cols % 16 == 0 && mcf_use_streaming(out, (r1 - r0) * cols * 4);
    if (t->kind == MCF_MX_F8B128) {
        size_t cpr = (cols + 127) / 128;
        for (size_t r = r0; r < r1; r++, o += cols) {
            const uint8_t *srow = t->scales + (r / 128) * cpr * 4, *d = t->data + r * cols;
            for (size_t c = 0; c < cols; c += 16) {   /* 16 | 128: the 16 values share one scale */
                __mmask16 m = mcf_mask16_avx512(cols - c);
                __m512 x = el8_avx512(MCF_EL_E4M3, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, d + c)));
                x = _mm512_mul_ps(x, _mm512_set1_ps(ld_f32(srow + (c / 128) * 4)));
                mcf_store16_avx512(out, o + c, x, kind, m, stream);
            }
        }
    } else {
        size_t bs = block_values(t), bpr = cols / bs;
        for (size_t blk = r0 * bpr; blk < r1 * bpr; blk++) {
            __m512 s = _mm512_set1_ps(block_scale(t, blk));
            if (bs == 32) {
                __m128i a, b;
                nibbles32(_mm_loadu_si128((const __m128i *)(t->data + blk * 16)), &a, &b);
                mcf_store16_avx512(out, o, _mm512_mul_ps(e2m1_avx512(a), s), kind, 0xffff, stream);
                mcf_store16_avx512(out, o + 16, _mm512_mul_ps(e2m1_avx512(b), s), kind, 0xffff, stream);
            } else {
                __m128i a, b;
                nibbles32(_mm_loadl_epi64((const __m128i *)(t->data + blk * 8)), &a, &b);
                mcf_store16_avx512(out, o, _mm512_mul_ps(e2m1_avx512(a), s), kind, 0xffff, stream);
            }
            o += bs;
        }
    }
    if (stream) _mm_sfence();
}

MCF_TARGET_AVX512 static void elements_avx512(int fmt, const uint8_t *src, size_t n, void *out, int kind)
{
    size_t i = 0;
    if (fmt == MCF_EL_E2M1) {
        for (; i + 32 <= n; i += 32) {
            __m128i a, b;
            nibbles32(_mm_loadu_si128((const __m128i *)(src + i / 2)), &a, &b);
            mcf_store16_avx512(out, i, e2m1_avx512(a), kind, 0xffff, 0);
            mcf_store16_avx512(out, i + 16, e2m1_avx512(b), kind, 0xffff, 0);
        }
        elements_scalar_from(fmt, src, i, n, out, kind);
        return;
    }
    for (; i < n; i += 16) {
        __mmask16 m = mcf_mask16_avx512(n - i);
        mcf_store16_avx512(out, i, el8_avx512(fmt, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, src + i))), kind, m, 0);
    }
}
#endif /* MCF_X86 */

#ifdef MCF_NEON
#include "mx_neon.h"
#endif

static void elements_scalar(int fmt, const uint8_t *src, size_t n, void *out, int kind)
{
    elements_scalar_from(fmt, src, 0, n, out, kind);
}

/* Each variant's kernels (dispatch.h) */
typedef struct {
    void (*dequant)(const mcf_mxtensor *t, size_t r0, size_t r1, void *out, int kind);
    void (*elements)(int fmt, const uint8_t *src, size_t n, void *out, int kind);
} mx_kernels;

static const mx_kernels KERNELS[MCF_IMPL_COUNT] = {
    [MCF_IMPL_SCALAR] = {dequant_scalar, elements_scalar},
#ifdef MCF_X86
    [MCF_IMPL_AVX2] = {dequant_avx2, elements_avx2},
    [MCF_IMPL_AVX512] = {dequant_avx512, elements_avx512},
#endif
#ifdef MCF_NEON
    [MCF_IMPL_NEON] = {dequant_neon, elements_neon},
#endif
};

void mcf_mx_dequant_rows(const mcf_mxtensor *t, size_t r0, size_t r1, void *out, int kind, int impl)
{
    if (r1 <= r0 || t->cols == 0) return;
    KERNELS[mcf_variant(impl)].dequant(t, r0, r1, out, kind);
}

void mcf_decode_elements(int fmt, const uint8_t *src, size_t n, void *out, int kind, int impl)
{
    if (n == 0) return;
    KERNELS[mcf_variant(impl)].elements(fmt, src, n, out, kind);
}
