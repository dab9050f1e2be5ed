/* What the GGUF block decoders share (internal to csrc/gguf_*.c): the kernel signatures the type table
 * of gguf_dequant.c points to, little-endian field loads, and the "codes times scales" emitters of the
 * vector variants.
 *
 * Scalar kernels are the reference: per element, in ggml's and gguf-py's operation order.  Most vector
 * kernels work in two steps per block: unpack the block into int8 codes (one per value) and one float32
 * scale per group of values, then emit y = scale * (float)code with 8 (AVX2), 16 (AVX-512) or 4 x 4 (NEON)
 * lanes.
 * Both steps are exact rewrites of the reference, not approximations of it:
 *   - a sign applied to the code instead of to the product ((db * g) * -1 == db * -g in IEEE float32,
 *     NaN payload and sign included: x86 and AArch64 both return the (quieted) NaN operand, and rounding
 *     is sign-symmetric);
 *   - the scale is computed from the block's fields with the reference's own expression, in scalar code.
 * So every variant writes the same bits, which the tests check against gguf-py on every block. */
#ifndef MCF_GGUF_KERNELS_H
#define MCF_GGUF_KERNELS_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fpconv.h"
#include "simd.h"

#define MCF_QK_K 256

/* decode nb blocks at x into y (nb * block_size floats); st: streaming stores (simd.h) */
typedef void (*mcf_gguf_scalar_fn)(const uint8_t *x, size_t nb, float *y);
typedef void (*mcf_gguf_vector_fn)(const uint8_t *x, size_t nb, float *y, int st);

static inline uint16_t mcf_le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t mcf_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
/* an f16 field, converted exactly (subnormals kept, NaN payloads kept) */
static inline float mcf_f16_at(const uint8_t *p) { return mcf_f16_to_f32_one(mcf_le16(p)); }

/* ---- kernels of csrc/gguf_iq.c and csrc/gguf_lowbit.c ------------------------------------------- */
#define MCF_GGUF_DECLARE(name)                                              \
    void name##_scalar(const uint8_t *x, size_t nb, float *y);              \
    void name##_avx2(const uint8_t *x, size_t nb, float *y, int st);        \
    void name##_avx512(const uint8_t *x, size_t nb, float *y, int st);      \
    void name##_neon(const uint8_t *x, size_t nb, float *y, int st);
MCF_GGUF_DECLARE(mcf_gguf_iq2_xxs)
MCF_GGUF_DECLARE(mcf_gguf_iq2_xs)
MCF_GGUF_DECLARE(mcf_gguf_iq2_s)
MCF_GGUF_DECLARE(mcf_gguf_iq3_xxs)
MCF_GGUF_DECLARE(mcf_gguf_iq3_s)
MCF_GGUF_DECLARE(mcf_gguf_iq1_s)
MCF_GGUF_DECLARE(mcf_gguf_iq1_m)
MCF_GGUF_DECLARE(mcf_gguf_iq4_nl)
MCF_GGUF_DECLARE(mcf_gguf_iq4_xs)
MCF_GGUF_DECLARE(mcf_gguf_tq1_0)
MCF_GGUF_DECLARE(mcf_gguf_tq2_0)
MCF_GGUF_DECLARE(mcf_gguf_mxfp4)
MCF_GGUF_DECLARE(mcf_gguf_nvfp4)
MCF_GGUF_DECLARE(mcf_gguf_q1_0)
MCF_GGUF_DECLARE(mcf_gguf_q2_0)
#undef MCF_GGUF_DECLARE
const void *mcf_gguf_iq_table(const char *name, size_t *nbytes);

#ifdef MCF_X86
/* ---- emitters: y[i] = scales[i / g] * (float)codes[i] for i < n ----------------------------------
 * n and g are multiples of 8 (AVX2) / 16 (AVX-512) and compile-time constants at every call, so the
 * loops unroll.  With `eighths`, each code is first multiplied by 0.125 (exact: the IQ1 types store
 * grid + delta as 8 * grid +- 1). */
MCF_TARGET_AVX2 static inline __attribute__((always_inline)) void
mcf_gguf_emit_avx2(const int8_t *codes, const float *scales, int n, int g, int eighths, float *y, int st)
{
    const __m256 eighth = _mm256_set1_ps(0.125f);
    for (int i = 0; i < n; i += g) {
        __m256 s = _mm256_set1_ps(scales[i / g]);
        for (int j = i; j < i + g; j += 8) {
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + j))));
            if (eighths) q = _mm256_mul_ps(q, eighth);
            __m256 v = _mm256_mul_ps(s, q);
            if (st) _mm256_stream_ps(y + j, v);
            else _mm256_storeu_ps(y + j, v);
        }
    }
}

MCF_TARGET_AVX512 static inline __attribute__((always_inline)) void
mcf_gguf_emit_avx512(const int8_t *codes, const float *scales, int n, int g, int eighths, float *y, int st)
{
    const __m512 eighth = _mm512_set1_ps(0.125f);
    for (int i = 0; i < n; i += g) {
        __m512 s = _mm512_set1_ps(scales[i / g]);
        for (int j = i; j < i + g; j += 16) {
            __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + j))));
            if (eighths) q = _mm512_mul_ps(q, eighth);
            __m512 v = _mm512_mul_ps(s, q);
            if (st) _mm512_stream_ps(y + j, v);
            else _mm512_storeu_ps(y + j, v);
        }
    }
}

/* The AVX2 and AVX-512 kernels of a type decoded by `unpack(block, codes, scales)` (an AVX2 inline
 * function, which the AVX-512 kernel inlines too): `bs` values and `ts` bytes per block, one scale per
 * `g` values.  A macro only because C has no templates: each expansion is two short loops. */
#define MCF_GGUF_CODE_KERNELS(name, unpack, ts, bs, g, eighths)                                         \
    MCF_TARGET_AVX2 void name##_avx2(const uint8_t *x, size_t nb, float *y, int st)                     \
    {                                                                                                   \
        int8_t codes[bs] __attribute__((aligned(32)));                                                  \
        float scales[(bs) / (g)];                                                                       \
        for (size_t b = 0; b < nb; b++, x += (ts), y += (bs)) {                                         \
            unpack(x, codes, scales);                                                                   \
            mcf_gguf_emit_avx2(codes, scales, (bs), (g), (eighths), y, st);                             \
        }                                                                                               \
    }                                                                                                   \
    MCF_TARGET_AVX512 void name##_avx512(const uint8_t *x, size_t nb, float *y, int st)                 \
    {                                                                                                   \
        int8_t codes[bs] __attribute__((aligned(32)));                                                  \
        float scales[(bs) / (g)];                                                                       \
        for (size_t b = 0; b < nb; b++, x += (ts), y += (bs)) {                                         \
            unpack(x, codes, scales);                                                                   \
            mcf_gguf_emit_avx512(codes, scales, (bs), (g), (eighths), y, st);                           \
        }                                                                                               \
    }

/* 32 sign bits -> 32 bytes: -1 where the bit is set, +1 where it is not (bit j of byte k for code 8k+j),
 * the second operand of _mm256_sign_epi8 */
MCF_TARGET_AVX2 static inline __m256i mcf_gguf_signs32_avx2(uint32_t bits)
{
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_or_si256(v, _mm256_set1_epi8(1));
}

/* 16 bytes of nibbles -> 32 int8 codes table[nibble]: the low nibbles first, then the high ones */
MCF_TARGET_AVX2 static inline __m256i mcf_gguf_nibbles_lut_avx2(__m128i q, __m128i table)
{
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, m4));
    __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}
#endif /* MCF_X86 */

#if defined(__aarch64__)
/* ---- NEON: the emitter and the unpacking steps the *_neon.h kernels share ----------------------------
 * y[i] = scales[i / g] * (float)codes[i] for i < n (n, g multiples of 16 and constants at every call);
 * with `eighths` each code is first multiplied by 0.125, as above.  The codes are widened exactly
 * (mcf_u8x16_to_f32_neon, simd.h). */
static inline __attribute__((always_inline)) void
mcf_gguf_emit_neon(const int8_t *codes, const float *scales, int n, int g, int eighths, float *y)
{
    const float32x4_t eighth = vdupq_n_f32(0.125f);
    for (int i = 0; i < n; i += g) {
        float32x4_t s = vdupq_n_f32(scales[i / g]);
        for (int j = i; j < i + g; j += 16) {
            float32x4_t f[4];
            mcf_u8x16_to_f32_neon(veorq_u8(vld1q_u8((const uint8_t *)codes + j), vdupq_n_u8(0x80)), 128.0f, f);
            for (int k = 0; k < 4; k++) f[k] = vmulq_f32(s, eighths ? vmulq_f32(f[k], eighth) : f[k]);
            vst1q_f32_x4(y + j, (float32x4x4_t){{f[0], f[1], f[2], f[3]}});
        }
    }
}

/* The NEON kernel of a type decoded by `unpack(block, codes, scales)`, as MCF_GGUF_CODE_KERNELS. */
#define MCF_GGUF_CODE_KERNEL_NEON(name, unpack, ts, bs, g, eighths)                                     \
    void name##_neon(const uint8_t *x, size_t nb, float *y, int st)                                     \
    {                                                                                                   \
        int8_t codes[bs] __attribute__((aligned(16)));                                                  \
        float scales[(bs) / (g)];                                                                       \
        (void)st;                                                                                       \
        for (size_t b = 0; b < nb; b++, x += (ts), y += (bs)) {                                         \
            unpack(x, codes, scales);                                                                   \
            mcf_gguf_emit_neon(codes, scales, (bs), (g), (eighths), y);                                 \
        }                                                                                               \
    }

/* 32 grid bytes g[0], g[1] with 32 sign bits applied (bit j of byte k negates code 8k + j), stored at codes */
static inline void mcf_gguf_put_signed32_neon(int8_t *codes, uint8x16_t g0, uint8x16_t g1, uint32_t signs)
{
    static const uint8_t spread[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    const uint8x16_t bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ull));
    uint8x16_t sb = vreinterpretq_u8_u32(vdupq_n_u32(signs));
    uint8x16_t m0 = vtstq_u8(vqtbl1q_u8(sb, vld1q_u8(spread)), bit);       /* 0xff where negated */
    uint8x16_t m1 = vtstq_u8(vqtbl1q_u8(sb, vld1q_u8(spread + 16)), bit);
    vst1q_u8((uint8_t *)codes, vsubq_u8(veorq_u8(g0, m0), m0));
    vst1q_u8((uint8_t *)codes + 16, vsubq_u8(veorq_u8(g1, m1), m1));
}

/* two 64-bit grid rows as one 16-byte vector */
static inline uint8x16_t mcf_gguf_grid2_neon(const uint64_t *grid, int a, int b)
{
    return vreinterpretq_u8_u64(vcombine_u64(vcreate_u64(grid[a]), vcreate_u64(grid[b])));
}

/* 16 bytes of nibbles -> 32 int8 codes table[nibble] at codes: the low nibbles first, then the high ones */
static inline void mcf_gguf_nibbles_lut_neon(int8_t *codes, uint8x16_t q, int8x16_t table)
{
    vst1q_s8(codes, vqtbl1q_s8(table, vandq_u8(q, vdupq_n_u8(0x0f))));
    vst1q_s8(codes + 16, vqtbl1q_s8(table, vshrq_n_u8(q, 4)));
}
#endif /* __aarch64__ */

#endif
