/* ggml's ternary, 1-/2-bit and FP4 block types -> float32: TQ1_0, TQ2_0, Q1_0, Q2_0, MXFP4, NVFP4.
 *
 * Layouts and arithmetic are ggml's (ggml-common.h, ggml-quants.c); gguf-py reproduces them for TQ1_0,
 * TQ2_0, MXFP4 and NVFP4, and has no dequantizer for Q1_0 and Q2_0 (the newest types, codes 41 and 42),
 * whose reference is ggml's C, written again in numpy in the tests.  Every value is one float32 product
 * of the block scale and a small integer, except Q1_0 (the scale or its negation):
 *   TQ1_0, TQ2_0, Q2_0: d * q with q in {-1, 0, 1(, 2)}      Q1_0: bit ? d : -d
 *   MXFP4: (E8M0 scale / 2) * (2 * E2M1 value)               NVFP4: (UE4M3 scale / 2) * (2 * E2M1 value)
 * Scalar reference per element; the AVX2 / AVX-512 kernels unpack codes with AVX2 and emit with 8 / 16
 * lanes (gguf_kernels.h), the NEON ones (gguf_lowbit_neon.h) with NEON and 4 x 4 lanes.  All multi-byte fields are little-endian. */
#include <string.h>

#include "minifloat.h"
#include "gguf_kernels.h"

static const uint8_t pow3[5] = {1, 3, 9, 27, 81};

/* TQ1_0's base-3 digit of a byte: the byte times 3^n (mod 256), then times 3, high byte */
static inline int tern_digit(uint8_t b, int n)
{
    uint8_t q = (uint8_t)(b * pow3[n]);
    return (((uint16_t)q * 3) >> 8) - 1;
}

/* half of an unsigned E4M3 scale (bias 7, no sign, no NaN; 0x00 and 0x7F are zero, bit 7 is ignored), as
 * ggml_ue4m3_to_fp32: exact, built from bits rather than with ldexpf */
static inline float ue4m3_half(uint8_t x)
{
    if (x == 0 || x == 0x7f) return 0.0f;
    int e = (x >> 3) & 0x0f, m = x & 7;
    if (e == 0) return (float)m * (1.0f / 1024.0f);   /* m * 2^-9, halved */
    uint32_t bits = ((uint32_t)(e + 119) << 23) | ((uint32_t)m << 20);   /* (1 + m/8) * 2^(e-7), halved */
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- scalar reference --------------------------------------------------------------------------- */

/* TQ1_0 (54 bytes): qs[48] (5 base-3 digits per byte) | qh[4] (4 digits per byte) | d.  Digit n of
 * qs[m] is element n*32 + m for m < 32, 160 + n*16 + (m - 32) for the next 16 bytes; of qh[m], 240 + n*4 + m */
void mcf_gguf_tq1_0_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 54) {
        float d = mcf_f16_at(x + 52);
        for (int n = 0; n < 5; n++)
            for (int m = 0; m < 32; m++) *y++ = (float)tern_digit(x[m], n) * d;
        for (int n = 0; n < 5; n++)
            for (int m = 0; m < 16; m++) *y++ = (float)tern_digit(x[32 + m], n) * d;
        for (int n = 0; n < 4; n++)
            for (int m = 0; m < 4; m++) *y++ = (float)tern_digit(x[48 + m], n) * d;
    }
}

/* TQ2_0 (66 bytes): qs[64] | d; element h*128 + s*32 + m is bits 2s of qs[h*32 + m], minus 1 */
void mcf_gguf_tq2_0_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 66) {
        float d = mcf_f16_at(x + 64);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int m = 0; m < 32; m++) *y++ = (float)(((x[32 * h + m] >> (2 * s)) & 3) - 1) * d;
    }
}

/* Q1_0 (18 bytes, 128 values): d | qs[16]; element j is bit j%8 of qs[j/8]: d if set, -d if not (the
 * sign bit of d flipped, as C's unary minus does, also for a NaN d) */
void mcf_gguf_q1_0_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 18, y += 128) {
        float d = mcf_f16_at(x);
        uint32_t u;
        memcpy(&u, &d, 4);
        for (int j = 0; j < 128; j++) {
            uint32_t v = u ^ ((~(uint32_t)(x[2 + j / 8] >> (j % 8)) & 1u) << 31);
            memcpy(y + j, &v, 4);
        }
    }
}

/* Q2_0 (18 bytes, 64 values): d | qs[16]; element j is bits 2*(j%4) of qs[j/4], minus 1 */
void mcf_gguf_q2_0_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 18, y += 64) {
        float d = mcf_f16_at(x);
        for (int j = 0; j < 64; j++) y[j] = (float)(((x[2 + j / 4] >> (2 * (j % 4))) & 3) - 1) * d;
    }
}

/* MXFP4 (17 bytes, 32 values): E8M0 | 16 bytes of E2M1 nibbles (element j low, j + 16 high) */
void mcf_gguf_mxfp4_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 17, y += 32) mcf_mxfp4_block_decode(x, y);
}

/* NVFP4 (36 bytes, 64 values): 4 UE4M3 scales, one per 16 values | qs[32]: sub-block s is qs[8s..8s+8),
 * element j < 8 the low nibble of its byte j, element j + 8 the high one */
void mcf_gguf_nvfp4_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 36) {
        for (int s = 0; s < 4; s++, y += 16) {
            float d = ue4m3_half(x[s]);
            const uint8_t *q = x + 4 + 8 * s;
            for (int j = 0; j < 8; j++) {
                y[j] = d * (float)mcf_e2m1_x2[q[j] & 0x0f];
                y[j + 8] = d * (float)mcf_e2m1_x2[q[j] >> 4];
            }
        }
    }
}

#ifdef MCF_X86
/* ---- vector variants ---------------------------------------------------------------------------- */

/* tern_digit of every byte of b */
MCF_TARGET_AVX2 static inline __m256i tern_digits_avx2(__m256i b, int n)
{
    const __m256i low = _mm256_set1_epi16(0x00ff), p = _mm256_set1_epi16(pow3[n]), three = _mm256_set1_epi16(3);
    __m256i ev = _mm256_and_si256(_mm256_mullo_epi16(_mm256_and_si256(b, low), p), low);
    __m256i od = _mm256_and_si256(_mm256_mullo_epi16(_mm256_srli_epi16(b, 8), p), low);
    ev = _mm256_srli_epi16(_mm256_mullo_epi16(ev, three), 8);
    od = _mm256_srli_epi16(_mm256_mullo_epi16(od, three), 8);
    return _mm256_sub_epi8(_mm256_or_si256(ev, _mm256_slli_epi16(od, 8)), _mm256_set1_epi8(1));
}

MCF_TARGET_AVX2 static inline void tq1_0_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    scales[0] = mcf_f16_at(x + 52);
    __m256i v0 = _mm256_loadu_si256((const __m256i *)x);
    __m256i v1 = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(x + 32)));
    for (int n = 0; n < 5; n++) {
        _mm256_store_si256((__m256i *)(codes + 32 * n), tern_digits_avx2(v0, n));
        _mm_store_si128((__m128i *)(codes + 160 + 16 * n), _mm256_castsi256_si128(tern_digits_avx2(v1, n)));
    }
    for (int n = 0; n < 4; n++)
        for (int m = 0; m < 4; m++) codes[240 + 4 * n + m] = (int8_t)tern_digit(x[48 + m], n);
}

MCF_TARGET_AVX2 static inline void tq2_0_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    scales[0] = mcf_f16_at(x + 64);
    for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(x + 32 * h));
        for (int s = 0; s < 4; s++)
            _mm256_store_si256((__m256i *)(codes + 128 * h + 32 * s),
                               _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 2 * s), m2), one));
    }
}

MCF_TARGET_AVX2 static inline void q2_0_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    const __m128i m2 = _mm_set1_epi8(3), one = _mm_set1_epi8(1);
    scales[0] = mcf_f16_at(x);
    __m128i q = _mm_loadu_si128((const __m128i *)(x + 2)), p[4];
    for (int k = 0; k < 4; k++) p[k] = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 2 * k), m2), one);
    /* interleave the four 2-bit planes back into element order: byte i gives elements 4i..4i+3 */
    __m128i a = _mm_unpacklo_epi8(p[0], p[1]), b = _mm_unpacklo_epi8(p[2], p[3]);
    __m128i c = _mm_unpackhi_epi8(p[0], p[1]), e = _mm_unpackhi_epi8(p[2], p[3]);
    _mm_store_si128((__m128i *)codes, _mm_unpacklo_epi16(a, b));
    _mm_store_si128((__m128i *)(codes + 16), _mm_unpackhi_epi16(a, b));
    _mm_store_si128((__m128i *)(codes + 32), _mm_unpacklo_epi16(c, e));
    _mm_store_si128((__m128i *)(codes + 48), _mm_unpackhi_epi16(c, e));
}

MCF_TARGET_AVX2 static inline void nvfp4_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    const __m128i m4 = _mm_set1_epi8(0x0f), table = _mm_loadu_si128((const __m128i *)mcf_e2m1_x2);
    for (int s = 0; s < 4; s++) scales[s] = ue4m3_half(x[s]);
    for (int h = 0; h < 2; h++) {   /* two sub-blocks of 8 bytes each: low nibbles, then high nibbles */
        __m128i q = _mm_loadu_si128((const __m128i *)(x + 4 + 16 * h));
        __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        _mm_store_si128((__m128i *)(codes + 32 * h), _mm_shuffle_epi8(table, _mm_unpacklo_epi64(lo, hi)));
        _mm_store_si128((__m128i *)(codes + 32 * h + 16), _mm_shuffle_epi8(table, _mm_unpackhi_epi64(lo, hi)));
    }
}

/* Q1_0: a sign-bit select, not a product (-d flips the sign of a NaN scale too, as ggml's does) */
MCF_TARGET_AVX2 void mcf_gguf_q1_0_avx2(const uint8_t *x, size_t nb, float *y, int st)
{
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (size_t b = 0; b < nb; b++, x += 18, y += 128) {
        float d = mcf_f16_at(x);
        __m256 pos = _mm256_set1_ps(d), neg = _mm256_set1_ps(-d);
        for (int k = 0; k < 16; k++) {
            __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(x[2 + k]), bit), bit);
            __m256 v = _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(m));
            if (st) _mm256_stream_ps(y + 8 * k, v);
            else _mm256_storeu_ps(y + 8 * k, v);
        }
    }
}

MCF_TARGET_AVX512 void mcf_gguf_q1_0_avx512(const uint8_t *x, size_t nb, float *y, int st)
{
    for (size_t b = 0; b < nb; b++, x += 18, y += 128) {
        float d = mcf_f16_at(x);
        __m512 pos = _mm512_set1_ps(d), neg = _mm512_set1_ps(-d);
        for (int k = 0; k < 8; k++) {
            __m512 v = _mm512_mask_blend_ps((__mmask16)mcf_le16(x + 2 + 2 * k), neg, pos);
            if (st) _mm512_stream_ps(y + 16 * k, v);
            else _mm512_storeu_ps(y + 16 * k, v);
        }
    }
}
#endif /* MCF_X86 */

#ifdef MCF_NEON
#include "gguf_lowbit_neon.h"
#endif

#ifdef MCF_GGUF_VECTOR
MCF_GGUF_UNPACKER void mxfp4_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    scales[0] = mcf_e8m0_to_f32_half(x[0]);
    mcf_gguf_put_nibbles_lut(codes, x + 1, mcf_e2m1_x2);
}

/* the other unpackers are each architecture's own (above, and gguf_lowbit_neon.h) */
MCF_GGUF_CODE_KERNELS(mcf_gguf_tq1_0, tq1_0_unpack, 54, 256, 256, 0)
MCF_GGUF_CODE_KERNELS(mcf_gguf_tq2_0, tq2_0_unpack, 66, 256, 256, 0)
MCF_GGUF_CODE_KERNELS(mcf_gguf_q2_0, q2_0_unpack, 18, 64, 64, 0)
MCF_GGUF_CODE_KERNELS(mcf_gguf_mxfp4, mxfp4_unpack, 17, 32, 32, 0)
MCF_GGUF_CODE_KERNELS(mcf_gguf_nvfp4, nvfp4_unpack, 36, 64, 16, 0)
#endif
