/* What the GGUF block decoders share (internal to csrc/gguf_*.c): the kernel signatures the type table
 * of gguf_dequant.c points to, little-endian field loads, the "codes times scales" emitters of the vector
 * variants and the vocabulary their unpackers are written in.
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

/* ---- the vector variants: kernels, emitters, and the vocabulary of the unpackers ----------------------
 * An unpacker (the first step above: `unpack(block, codes, scales)`) is written once for both architectures,
 * MCF_GGUF_UNPACKER (an AVX2 function on x86-64, which the AVX-512 kernel inlines too; plain NEON on
 * aarch64), with the functions below, which have the same names and meaning on both: 32 bytes are one
 * mcf_gguf_bytes32 (one AVX2 register, two NEON registers). */
#if defined(MCF_X86) || defined(MCF_NEON)
#define MCF_GGUF_VECTOR 1
#endif

/* One kernel `fn` of a type decoded by `unpack`: `bs` values and `ts` bytes per block, one scale per `g`
 * values, emitted by `emit` (with `eighths`, each code is first multiplied by 0.125: exact, the IQ1 types
 * store grid + delta as 8 * grid +- 1).  A macro only because C has no templates: two short loops. */
#define MCF_GGUF_CODE_KERNEL(fn, target, emit, unpack, ts, bs, g, eighths)                              \
    target void fn(const uint8_t *x, size_t nb, float *y, int st)                                      \
    {                                                                                                   \
        int8_t codes[bs] __attribute__((aligned(MCF_GGUF_CODES_ALIGN)));                                \
        float scales[(bs) / (g)];                                                                       \
        for (size_t b = 0; b < nb; b++, x += (ts), y += (bs)) {                                         \
            unpack(x, codes, scales);                                                                   \
            emit(codes, scales, (bs), (g), (eighths), y, st);                                           \
        }                                                                                               \
    }

#ifdef MCF_X86
#define MCF_GGUF_UNPACKER MCF_TARGET_AVX2 static inline
#define MCF_GGUF_CODES_ALIGN 32   /* the unpackers' aligned 32-byte stores */
/* the AVX2 and AVX-512 kernels of a type (MCF_GGUF_CODE_KERNEL) */
#define MCF_GGUF_CODE_KERNELS(name, unpack, ts, bs, g, eighths)                                         \
    MCF_GGUF_CODE_KERNEL(name##_avx2, MCF_TARGET_AVX2, mcf_gguf_emit_avx2, unpack, ts, bs, g, eighths)  \
    MCF_GGUF_CODE_KERNEL(name##_avx512, MCF_TARGET_AVX512, mcf_gguf_emit_avx512, unpack, ts, bs, g, eighths)

/* the emitters: n and g are multiples of 8 (AVX2) / 16 (AVX-512) and compile-time constants at every call,
 * so the loops unroll */
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

typedef __m256i mcf_gguf_bytes32;

/* four 64-bit grid rows (8 bytes each) */
MCF_GGUF_UNPACKER mcf_gguf_bytes32 mcf_gguf_grid64x4(const uint64_t *grid, int a, int b, int c, int d)
{
    return _mm256_setr_epi64x((long long)grid[a], (long long)grid[b], (long long)grid[c], (long long)grid[d]);
}

/* eight 32-bit grid rows (4 bytes each) */
MCF_GGUF_UNPACKER mcf_gguf_bytes32 mcf_gguf_grid32x8(const uint32_t *grid, const int i[8])
{
    return _mm256_setr_epi32((int)grid[i[0]], (int)grid[i[1]], (int)grid[i[2]], (int)grid[i[3]], (int)grid[i[4]],
                             (int)grid[i[5]], (int)grid[i[6]], (int)grid[i[7]]);
}

/* 32 grid bytes with 32 sign bits applied (bit j of byte k negates code 8k + j), stored at codes */
MCF_GGUF_UNPACKER void mcf_gguf_put_signed32(int8_t *codes, mcf_gguf_bytes32 g, uint32_t signs)
{
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)signs), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);   /* -1 where negated, else 0; | 1: -1 or +1 */
    _mm256_store_si256((__m256i *)codes, _mm256_sign_epi8(g, _mm256_or_si256(v, _mm256_set1_epi8(1))));
}

/* 32 bytes of -1 where `neg` is nonzero, else +1; and per group k of 8 bytes, -1 where nk is nonzero: without
 * branches, which random bits mispredict */
MCF_GGUF_UNPACKER mcf_gguf_bytes32 mcf_gguf_signs1(int neg) { return _mm256_set1_epi8((char)(1 | -(neg != 0))); }

MCF_GGUF_UNPACKER mcf_gguf_bytes32 mcf_gguf_signs4(int n0, int n1, int n2, int n3)
{
    const uint64_t ones = 0x0101010101010101ull;
    return _mm256_setr_epi64x((long long)(ones | (0 - (uint64_t)(n0 != 0))),
                              (long long)(ones | (0 - (uint64_t)(n1 != 0))),
                              (long long)(ones | (0 - (uint64_t)(n2 != 0))),
                              (long long)(ones | (0 - (uint64_t)(n3 != 0))));
}

/* IQ1 codes 8 * grid + delta (grid values -1, 0, 1; delta -1 or +1 per code), stored at codes */
MCF_GGUF_UNPACKER void mcf_gguf_put_iq1(int8_t *codes, mcf_gguf_bytes32 g, mcf_gguf_bytes32 delta)
{
    _mm256_store_si256((__m256i *)codes, _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), delta));
}

/* 16 bytes of nibbles at q -> 32 int8 codes table[nibble] at codes: the low nibbles first, then the high */
MCF_GGUF_UNPACKER void mcf_gguf_put_nibbles_lut(int8_t *codes, const uint8_t *q, const int8_t table[16])
{
    const __m128i m4 = _mm_set1_epi8(0x0f), t = _mm_loadu_si128((const __m128i *)table);
    __m128i v = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_shuffle_epi8(t, _mm_and_si128(v, m4));
    __m128i hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    _mm256_store_si256((__m256i *)codes, _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}
#endif /* MCF_X86 */

#ifdef MCF_NEON
#define MCF_GGUF_UNPACKER static inline
#define MCF_GGUF_CODES_ALIGN 16
/* the NEON kernel of a type (MCF_GGUF_CODE_KERNEL) */
#define MCF_GGUF_CODE_KERNELS(name, unpack, ts, bs, g, eighths)                                         \
    MCF_GGUF_CODE_KERNEL(name##_neon, , mcf_gguf_emit_neon, unpack, ts, bs, g, eighths)

/* the emitter (n, g multiples of 16 and constants at every call); the codes are widened exactly
 * (mcf_u8x16_to_f32_neon, simd.h).  Streaming stores are an x86 matter: `st` is ignored (AArch64's
 * non-temporal STNP has no C intrinsic). */
static inline __attribute__((always_inline)) void
mcf_gguf_emit_neon(const int8_t *codes, const float *scales, int n, int g, int eighths, float *y, int st)
{
    const float32x4_t eighth = vdupq_n_f32(0.125f);
    (void)st;
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

typedef uint8x16x2_t mcf_gguf_bytes32;

/* two 64-bit grid rows as one 16-byte vector */
static inline uint8x16_t mcf_gguf_grid2_neon(const uint64_t *grid, int a, int b)
{
    return vreinterpretq_u8_u64(vcombine_u64(vcreate_u64(grid[a]), vcreate_u64(grid[b])));
}

static inline mcf_gguf_bytes32 mcf_gguf_grid64x4(const uint64_t *grid, int a, int b, int c, int d)
{
    return (mcf_gguf_bytes32){{mcf_gguf_grid2_neon(grid, a, b), mcf_gguf_grid2_neon(grid, c, d)}};
}

static inline mcf_gguf_bytes32 mcf_gguf_grid32x8(const uint32_t *grid, const int i[8])
{
    uint32_t v[8];
    for (int k = 0; k < 8; k++) v[k] = grid[i[k]];
    return (mcf_gguf_bytes32){{vreinterpretq_u8_u32(vld1q_u32(v)), vreinterpretq_u8_u32(vld1q_u32(v + 4))}};
}

static inline void mcf_gguf_put_signed32(int8_t *codes, mcf_gguf_bytes32 g, uint32_t signs)
{
    static const uint8_t spread[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    const uint8x16_t bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ull));
    uint8x16_t sb = vreinterpretq_u8_u32(vdupq_n_u32(signs));
    for (int h = 0; h < 2; h++) {   /* (g ^ m) - m, m = 0xff where negated */
        uint8x16_t m = vtstq_u8(vqtbl1q_u8(sb, vld1q_u8(spread + 16 * h)), bit);
        vst1q_u8((uint8_t *)codes + 16 * h, vsubq_u8(veorq_u8(g.val[h], m), m));
    }
}

static inline mcf_gguf_bytes32 mcf_gguf_signs1(int neg)
{
    uint8x16_t v = vdupq_n_u8(neg ? 0xff : 1);
    return (mcf_gguf_bytes32){{v, v}};
}

static inline mcf_gguf_bytes32 mcf_gguf_signs4(int n0, int n1, int n2, int n3)
{
    return (mcf_gguf_bytes32){{vcombine_u8(vdup_n_u8(n0 ? 0xff : 1), vdup_n_u8(n1 ? 0xff : 1)),
                               vcombine_u8(vdup_n_u8(n2 ? 0xff : 1), vdup_n_u8(n3 ? 0xff : 1))}};
}

static inline void mcf_gguf_put_iq1(int8_t *codes, mcf_gguf_bytes32 g, mcf_gguf_bytes32 delta)
{
    for (int h = 0; h < 2; h++) vst1q_u8((uint8_t *)codes + 16 * h, vaddq_u8(vshlq_n_u8(g.val[h], 3), delta.val[h]));
}

static inline void mcf_gguf_put_nibbles_lut(int8_t *codes, const uint8_t *q, const int8_t table[16])
{
    int8x16_t t = vld1q_s8(table);
    uint8x16_t v = vld1q_u8(q);
    vst1q_s8(codes, vqtbl1q_s8(t, vandq_u8(v, vdupq_n_u8(0x0f))));
    vst1q_s8(codes + 16, vqtbl1q_s8(t, vshrq_n_u8(v, 4)));
}
#endif /* MCF_NEON */

#endif
