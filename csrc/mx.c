/* The scaled formats of csrc/mx.h: a scalar reference (csrc/minifloat.h's decoders, one float32 multiply per
 * value) and AVX2 / AVX-512 / NEON (mx_neon.h) variants computing the same products.
 *
 * How the vector variants decode elements: E2M1 is a table lookup in registers (vpermps on the 16 values for
 * AVX-512; on the magnitude's 8 values plus a sign xor for AVX2); E5M2 is binary16's top byte (vcvtph2ps);
 * E4M3 and the FNUZ types put their exponent and mantissa bits where float32 keeps them and change the bias
 * with an integer add (AVX2 decodes runs of E4M3 16 at a time as binary16 instead: e4m3x16_avx2),
 * their subnormals being mantissa * 2^-9 (E4M3) as a product of normal floats: a float32
 * subnormal operand would cost a microcode assist (4-5x slower decoding of random E4M3 bytes, measured here);
 * E8M0 shifts its byte into float32's exponent field.  NaN encodings are then set to the quiet NaN the
 * reference writes.
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

#ifdef MCF_X86
/* ---- AVX2 --------------------------------------------------------------------------------------------- */

/* stream: float32 output only, 32-byte aligned at every o the caller passes (simd.h's rule) */
MCF_TARGET_AVX2 static inline void st8_avx2(void *out, size_t o, __m256 w, int kind, int stream)
{
    if (kind == MCF_OUT_F32) {
        if (stream) _mm256_stream_ps((float *)out + o, w);
        else _mm256_storeu_ps((float *)out + o, w);
    }
    else if (kind == MCF_OUT_F16)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + o), _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT));
    else _mm_storeu_si128((__m128i *)((uint16_t *)out + o), mcf_bf16_round_avx2(_mm256_castps_si256(w)));
}

/* 8 byte-sized elements (one per int32 lane of u) as float32. */
MCF_TARGET_AVX2 static inline __m256 el8_avx2(int fmt, __m256i u)
{
    const __m256i qnan = _mm256_set1_epi32(0x7fc00000);
    __m256i r, nan;
    switch (fmt) {
    case MCF_EL_E5M2: {
        __m256i h = _mm256_slli_epi32(u, 8);
        return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    }
    case MCF_EL_E8M0:
        r = _mm256_slli_epi32(u, 23);
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(u, _mm256_setzero_si256()));
        return _mm256_castsi256_ps(_mm256_blendv_epi8(r, qnan, _mm256_cmpeq_epi32(u, _mm256_set1_epi32(0xff))));
    default: {
        /* normal values: exponent and mantissa moved into float32's fields, the bias changed by an integer add;
         * subnormals (exponent field 0): mantissa * 2^(1 - bias - mbits), a product of normal floats, so no
         * arithmetic ever sees a float32 subnormal (which costs a microcode assist on some CPUs) */
        int e5 = fmt == MCF_EL_E5M2FNUZ;
        int rebias = fmt == MCF_EL_E4M3 ? 120 : fmt == MCF_EL_E4M3FNUZ ? 119 : 111;
        float sub = mcf_mf_pow2(fmt == MCF_EL_E4M3 ? -9 : fmt == MCF_EL_E4M3FNUZ ? -10 : -17);
        __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7f));
        __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
        __m256i bits = e5 ? _mm256_slli_epi32(mag, 21) : _mm256_slli_epi32(mag, 20);
        __m256i normal = _mm256_add_epi32(bits, _mm256_set1_epi32(rebias << 23));
        __m256i m = _mm256_and_si256(mag, _mm256_set1_epi32(e5 ? 3 : 7));
        __m256i small = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(sub)));
        __m256i zexp = _mm256_cmpeq_epi32(_mm256_and_si256(mag, _mm256_set1_epi32(e5 ? 0x7c : 0x78)),
                                          _mm256_setzero_si256());
        r = _mm256_or_si256(_mm256_blendv_epi8(normal, small, zexp), sign);
        if (fmt == MCF_EL_E4M3) {
            nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f));
            return _mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_or_si256(qnan, sign), nan));
        }
        nan = _mm256_cmpeq_epi32(u, _mm256_set1_epi32(0x80));
        return _mm256_castsi256_ps(_mm256_blendv_epi8(r, qnan, nan));
    }
    }
}

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
                st8_avx2(out, o + c, _mm256_mul_ps(x0, s), kind, stream);
                st8_avx2(out, o + c + 8, _mm256_mul_ps(x1, s), kind, stream);
            }
            for (; c + 8 <= cols; c += 8) {
                __m256 x = el8_avx2(MCF_EL_E4M3, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(d + c))));
                st8_avx2(out, o + c, _mm256_mul_ps(x, _mm256_set1_ps(ld_f32(srow + (c / 128) * 4))), kind, stream);
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
                __m256 s0 = _mm256_broadcast_ss(&sc[k]), s1 = _mm256_broadcast_ss(&sc[k + 1]);
                st8_avx2(out, o, _mm256_mul_ps(e2m1_avx2(_mm256_cvtepu8_epi32(a)), s0), kind, stream);
                st8_avx2(out, o + 8, _mm256_mul_ps(e2m1_avx2(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))), s0), kind,
                         stream);
                st8_avx2(out, o + 16, _mm256_mul_ps(e2m1_avx2(_mm256_cvtepu8_epi32(b)), s1), kind, stream);
                st8_avx2(out, o + 24, _mm256_mul_ps(e2m1_avx2(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), s1), kind,
                         stream);
            }
        }
    }
    for (; blk < end; blk++) {
        __m256 s = _mm256_set1_ps(block_scale(t, blk));
        __m128i a, b;
        if (bs == 32) nibbles32(_mm_loadu_si128((const __m128i *)(t->data + blk * 16)), &a, &b);
        else nibbles32(_mm_loadl_epi64((const __m128i *)(t->data + blk * 8)), &a, &b);
        st8_avx2(out, o, _mm256_mul_ps(e2m1_avx2(_mm256_cvtepu8_epi32(a)), s), kind, stream);
        st8_avx2(out, o + 8, _mm256_mul_ps(e2m1_avx2(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))), s), kind, stream);
        if (bs == 32) {
            st8_avx2(out, o + 16, _mm256_mul_ps(e2m1_avx2(_mm256_cvtepu8_epi32(b)), s), kind, stream);
            st8_avx2(out, o + 24, _mm256_mul_ps(e2m1_avx2(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), s), kind, stream);
        }
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
            st8_avx2(out, i, e2m1_avx2(_mm256_cvtepu8_epi32(a)), kind, stream);
            st8_avx2(out, i + 8, e2m1_avx2(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))), kind, stream);
            st8_avx2(out, i + 16, e2m1_avx2(_mm256_cvtepu8_epi32(b)), kind, stream);
            st8_avx2(out, i + 24, e2m1_avx2(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), kind, stream);
        }
    } else {
        if (fmt == MCF_EL_E4M3)
            for (; i + 16 <= n; i += 16) {
                __m256 x0, x1;
                e4m3x16_avx2(_mm_loadu_si128((const __m128i *)(src + i)), &x0, &x1);
                st8_avx2(out, i, x0, kind, stream);
                st8_avx2(out, i + 8, x1, kind, stream);
            }
        for (; i + 8 <= n; i += 8)
            st8_avx2(out, i, el8_avx2(fmt, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)))), kind, stream);
    }
    if (stream) _mm_sfence();
    elements_scalar_from(fmt, src, i, n, out, kind);
}

/* ---- AVX-512 ------------------------------------------------------------------------------------------- */

MCF_TARGET_AVX512 static inline void st16_avx512(void *out, size_t o, __m512 w, int kind, __mmask16 m, int stream)
{
    if (kind == MCF_OUT_F32) {
        if (stream && m == 0xffff) _mm512_stream_ps((float *)out + o, w);
        else _mm512_mask_storeu_ps((float *)out + o, m, w);
    } else if (kind == MCF_OUT_F16) {
        _mm256_mask_storeu_epi16((uint16_t *)out + o, m, _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT));
    } else {
        _mm256_mask_storeu_epi16((uint16_t *)out + o, m, mcf_bf16_round_avx512(_mm512_castps_si512(w)));
    }
}

/* 16 byte-sized elements (one per int32 lane of u) as float32: el8_avx2 on 16 lanes. */
MCF_TARGET_AVX512 static inline __m512 el8_avx512(int fmt, __m512i u)
{
    const __m512i qnan = _mm512_set1_epi32(0x7fc00000);
    __m512i r;
    switch (fmt) {
    case MCF_EL_E5M2:
        return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(u, 8)));
    case MCF_EL_E8M0:
        r = _mm512_slli_epi32(u, 23);
        r = _mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(u, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
        return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(u, _mm512_set1_epi32(0xff)), qnan));
    default: {   /* as el8_avx2: no float32 subnormal ever enters an arithmetic instruction */
        int e5 = fmt == MCF_EL_E5M2FNUZ;
        int rebias = fmt == MCF_EL_E4M3 ? 120 : fmt == MCF_EL_E4M3FNUZ ? 119 : 111;
        float sub = mcf_mf_pow2(fmt == MCF_EL_E4M3 ? -9 : fmt == MCF_EL_E4M3FNUZ ? -10 : -17);
        __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7f));
        __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
        __m512i bits = e5 ? _mm512_slli_epi32(mag, 21) : _mm512_slli_epi32(mag, 20);
        __m512i normal = _mm512_add_epi32(bits, _mm512_set1_epi32(rebias << 23));
        __m512i m = _mm512_and_si512(mag, _mm512_set1_epi32(e5 ? 3 : 7));
        __m512i small = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(sub)));
        __mmask16 zexp = _mm512_testn_epi32_mask(mag, _mm512_set1_epi32(e5 ? 0x7c : 0x78));
        r = _mm512_or_si512(_mm512_mask_mov_epi32(normal, zexp, small), sign);
        if (fmt == MCF_EL_E4M3)
            return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)),
                                                             _mm512_or_si512(qnan, sign)));
        return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(u, _mm512_set1_epi32(0x80)), qnan));
    }
    }
}

MCF_TARGET_AVX512 static inline __m512 e2m1_avx512(__m128i nib16)
{
    const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nib16), lut);
}

static inline __mmask16 mask16(size_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

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
                __mmask16 m = mask16(cols - c);
                __m512 x = el8_avx512(MCF_EL_E4M3, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, d + c)));
                st16_avx512(out, o + c, _mm512_mul_ps(x, _mm512_set1_ps(ld_f32(srow + (c / 128) * 4))), kind, m, stream);
            }
        }
    } else {
        size_t bs = block_values(t), bpr = cols / bs;
        for (size_t blk = r0 * bpr; blk < r1 * bpr; blk++) {
            __m512 s = _mm512_set1_ps(block_scale(t, blk));
            if (bs == 32) {
                __m128i a, b;
                nibbles32(_mm_loadu_si128((const __m128i *)(t->data + blk * 16)), &a, &b);
                st16_avx512(out, o, _mm512_mul_ps(e2m1_avx512(a), s), kind, 0xffff, stream);
                st16_avx512(out, o + 16, _mm512_mul_ps(e2m1_avx512(b), s), kind, 0xffff, stream);
            } else {
                __m128i a, b;
                nibbles32(_mm_loadl_epi64((const __m128i *)(t->data + blk * 8)), &a, &b);
                st16_avx512(out, o, _mm512_mul_ps(e2m1_avx512(a), s), kind, 0xffff, stream);
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
            st16_avx512(out, i, e2m1_avx512(a), kind, 0xffff, 0);
            st16_avx512(out, i + 16, e2m1_avx512(b), kind, 0xffff, 0);
        }
        elements_scalar_from(fmt, src, i, n, out, kind);
        return;
    }
    for (; i < n; i += 16) {
        __mmask16 m = mask16(n - i);
        st16_avx512(out, i, el8_avx512(fmt, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, src + i))), kind, m, 0);
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
