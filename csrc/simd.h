/* What every SIMD variant shares: one target attribute per tier of csrc/cpu.c, and the small inline
 * helpers more than one kernel file needs (with those of csrc/simd_vec.h, the width-generic vocabulary a
 * kernel can be written against once for every ISA: the *_vec.h files).
 *
 * NEON (aarch64) uses only the ASIMD instructions every aarch64 CPU has (the architecture's baseline:
 * numpy assumes it too), so its functions need no target attribute; its code lives in the *_neon.h files,
 * each included by the one kernel file whose scalar helpers it shares, or comes from a *_vec.h file, and is
 * compiled on aarch64 only.  The
 * optional features (dotprod, FP16 arithmetic, SVE) buy nothing here: every kernel converts to float32 and
 * multiplies in float32, which is what the scalar reference does, and a dot product or f16 arithmetic
 * would round differently.
 *
 * A tier's attribute names exactly the instructions cpu.c checks before it reports that tier, so a
 * function marked MCF_TARGET_AVX2 runs wherever mcf_cpu_supports(MCF_IMPL_AVX2) is true, and one tier's
 * functions may call (and inline) the lower tier's.  "fma" is allowed but never used for arithmetic:
 * the build passes -ffp-contract=off, so every variant rounds as the scalar reference does. */
#ifndef MCF_SIMD_H
#define MCF_SIMD_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu.h"
#include "fpconv.h" /* MCF_OUT_* */

#define MCF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#define MCF_TARGET_AVX512 \
    __attribute__((target("avx2,fma,f16c,bmi2,avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")))

/* Streaming (non-temporal) stores pay off only for outputs far larger than the caches, and need
 * 64-byte-aligned destinations; they change where values are written, never the values. */
/* The ISAs of csrc/simd_vec.h's vocabulary (the MCF_VEC_ISA a *_vec.h kernel is compiled for). */
#define MCF_VEC_NONE 0
#define MCF_VEC_AVX2 1
#define MCF_VEC_AVX512 2
#define MCF_VEC_NEON 3

#define MCF_STREAM_MIN_BYTES ((size_t)8 << 20)

static inline int mcf_use_streaming(const void *out, size_t out_bytes)
{
    return out_bytes >= MCF_STREAM_MIN_BYTES && ((uintptr_t)out & 63) == 0;
}

#if defined(__x86_64__)
#include <immintrin.h>
#define MCF_X86 1

/* 32 int8 codes (the bytes of ``b``, in order) bit-packed as csrc/quant.h lays out int2/int3/int4/int6
 * blocks: the low ``bits`` bits of each code, each group of 8 codes in ``bits`` bytes, little-endian.
 * Multiply-adds put 2 codes in each 16-bit lane and 4 in each 32-bit lane at their stream positions, then
 * a byte shuffle keeps the whole bytes (3 bits: pairs of 32-bit lanes are first merged into 24 bits); no
 * BMI2 pext, which AMD Zen 1/2 microcode at ~300 cycles. */
MCF_TARGET_AVX2 static inline void mcf_pack_bytes32_avx2(__m256i b, int bits, uint8_t *dst)
{
    __m256i c = _mm256_and_si256(b, _mm256_set1_epi8((char)((1 << bits) - 1)));
    __m256i t16 = _mm256_maddubs_epi16(c, _mm256_set1_epi16((short)(1 | (1 << (8 + bits)))));
    __m256i t = _mm256_madd_epi16(t16, _mm256_set1_epi32(1 | (1 << (16 + 2 * bits))));
    __m256i keep;
    if (bits == 2) {
        keep = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    } else if (bits == 3) {   /* 12 bits per 32-bit lane: the odd lane's moved down next to the even one's */
        t = _mm256_or_si256(_mm256_and_si256(t, _mm256_set1_epi64x(0xfff)), _mm256_srli_epi64(t, 20));
        keep = _mm256_setr_epi8(0, 1, 2, 8, 9, 10, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                0, 1, 2, 8, 9, 10, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    } else if (bits == 4) {
        keep = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    } else {
        keep = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    }
    uint8_t tmp[32];
    _mm256_storeu_si256((__m256i *)tmp, _mm256_shuffle_epi8(t, keep));
    size_t half = (size_t)bits * 2;   /* each 128-bit half packed 16 codes */
    memcpy(dst, tmp, half);
    memcpy(dst + half, tmp + 16, half);
}

/* 32 codes, given as int32 lanes already clamped to the int8 range, stored in order: 32 int8 bytes
 * when bits == 8, else packed (mcf_pack_bytes32_avx2).  The tail of every quantizer's SIMD code path
 * (quantize.c, quant_search.c): four vectors of 8 codes (AVX2) or two of 16 (AVX-512). */
MCF_TARGET_AVX2 static inline void mcf_store_codes32_avx2(const __m256i q[4], int bits, uint8_t *dst)
{
    /* int32 -> int8 keeping order: pack pairs, then undo the 128-bit lane interleave */
    __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (bits == 8) {
        _mm256_storeu_si256((__m256i *)dst, b);
        return;
    }
    mcf_pack_bytes32_avx2(b, bits, dst);
}

MCF_TARGET_AVX512 static inline void mcf_store_codes32_avx512(__m512i q0, __m512i q1, int bits, uint8_t *dst)
{
    __m128i b0 = _mm512_cvtepi32_epi8(q0), b1 = _mm512_cvtepi32_epi8(q1);
    if (bits == 8) {
        _mm_storeu_si128((__m128i *)dst, b0);
        _mm_storeu_si128((__m128i *)(dst + 16), b1);
        return;
    }
    __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1);
    if (bits == 4) {   /* byte pairs (lo, hi) -> lo | hi << 4: item 0 in the low nibble */
        __m256i lo = _mm256_and_si256(b, _mm256_set1_epi16(0x000f));
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi16(0x00f0));
        _mm_storeu_si128((__m128i *)dst, _mm256_cvtepi16_epi8(_mm256_or_si256(lo, hi)));
        return;
    }
    mcf_pack_bytes32_avx2(b, bits, dst);
}
#endif

#if defined(__aarch64__)
#include <arm_neon.h>

#define MCF_NEON 1

/* float32 to binary16, round to nearest even (FCVTN rounds as FPCR says: nearest even, subnormals kept,
 * NaN quieted with its top payload bits, exactly what mcf_f32_to_f16_one writes). */
static inline uint16x4_t mcf_f16_round_neon(float32x4_t f)
{
    return vreinterpret_u16_f16(vcvt_f16_f32(f));
}

/* 8 codes (one per byte of w, low `bits` bits each) packed LSB-first into the low 8 * bits bits, as BMI2's
 * pext does for the x86 variants: three rounds, each merging neighbouring fields into lanes twice as wide */
static inline uint64_t mcf_pack8_bits(uint64_t w, int bits)
{
    int s = 8 - bits;   /* the gap from one field's end to the next one's start; it doubles each round */
    uint64_t f = (1ull << bits) - 1, f2 = (1ull << (2 * bits)) - 1, f4 = (1ull << (4 * bits)) - 1;
    uint64_t x = w & (f * 0x0101010101010101ull);
    /* each round keeps the even field in place and moves the odd one down next to it (masking both: a
     * shifted field must not spill into its neighbour when the gap is narrower than a field, as for 6 bits) */
    x = (x & (f * 0x0001000100010001ull)) | ((x >> s) & ((f << bits) * 0x0001000100010001ull));
    x = (x & (f2 * 0x0000000100000001ull)) | ((x >> (2 * s)) & ((f2 << (2 * bits)) * 0x0000000100000001ull));
    return (x & f4) | ((x >> (4 * s)) & (f4 << (4 * bits)));
}

/* 32 codes, given as int32 lanes already clamped to the int8 range (q[0] codes 0..3, ..., q[7] codes 28..31),
 * stored in order: 32 int8 bytes when bits == 8, else packed as csrc/quant.h lays blocks out.  The tail of
 * the NEON quantizers (quantize_neon.h, quant_search_vec.h), as mcf_store_codes32_avx2 is of the AVX2 ones. */
static inline void mcf_store_codes32_neon(const int32x4_t q[8], int bits, uint8_t *dst)
{
    int8x16_t b[2];
    for (int h = 0; h < 2; h++) {
        int16x8_t lo = vcombine_s16(vmovn_s32(q[4 * h]), vmovn_s32(q[4 * h + 1]));
        int16x8_t hi = vcombine_s16(vmovn_s32(q[4 * h + 2]), vmovn_s32(q[4 * h + 3]));
        b[h] = vcombine_s8(vmovn_s16(lo), vmovn_s16(hi));
    }
    if (bits == 8) {
        vst1q_s8((int8_t *)dst, b[0]);
        vst1q_s8((int8_t *)dst + 16, b[1]);
        return;
    }
    if (bits == 4) {   /* byte pairs (lo, hi) -> lo | hi << 4: item 0 in the low nibble */
        uint8x16_t ev = vuzp1q_u8(vreinterpretq_u8_s8(b[0]), vreinterpretq_u8_s8(b[1]));
        uint8x16_t od = vuzp2q_u8(vreinterpretq_u8_s8(b[0]), vreinterpretq_u8_s8(b[1]));
        vst1q_u8(dst, vorrq_u8(vandq_u8(ev, vdupq_n_u8(0x0f)), vshlq_n_u8(od, 4)));
        return;
    }
    uint64_t w[4];
    vst1q_s8((int8_t *)w, b[0]);
    vst1q_s8((int8_t *)w + 16, b[1]);
    for (int g = 0; g < 4; g++) {
        uint64_t packed = mcf_pack8_bits(w[g], bits);
        memcpy(dst + (size_t)g * (size_t)bits, &packed, (size_t)bits);
    }
}

/* 16 bytes u as four float32x4 vectors of (float)u - bias, in order, for a bias of 0 .. 255 (signed codes are
 * passed as q ^ 0x80 with bias 128, q - 8 as q with bias 8...).  Each byte becomes the low byte of the float
 * 0x4B4000uu = 12582912 + u (two interleaves with zero and with 0x4B40), and one subtraction of
 * 12582912 + bias gives u - bias, exactly (both operands are integers below 2^24), so the result is the bits
 * SCVTF would give.  It avoids SCVTF, which costs two micro-ops on only two of the four vector pipes of
 * Neoverse V-class cores (llvm-mca: the bound of a decode loop), with single-uop permutes on any pipe. */
static inline void mcf_u8x16_to_f32_neon(uint8x16_t u, float bias, float32x4_t f[4])
{
    const uint16x8_t hi = vdupq_n_u16(0x4B40);
    const uint8x16_t zero = vdupq_n_u8(0);
    const float32x4_t m = vdupq_n_f32(12582912.0f + bias);
    uint16x8_t w0 = vreinterpretq_u16_u8(vzip1q_u8(u, zero)), w1 = vreinterpretq_u16_u8(vzip2q_u8(u, zero));
    f[0] = vsubq_f32(vreinterpretq_f32_u16(vzip1q_u16(w0, hi)), m);
    f[1] = vsubq_f32(vreinterpretq_f32_u16(vzip2q_u16(w0, hi)), m);
    f[2] = vsubq_f32(vreinterpretq_f32_u16(vzip1q_u16(w1, hi)), m);
    f[3] = vsubq_f32(vreinterpretq_f32_u16(vzip2q_u16(w1, hi)), m);
}
#endif

/* The vocabulary's helpers, for every ISA of this build (simd_vec.h): mcf_bf16_round_avx2 / _avx512 / _neon
 * and mcf_h2f_avx2 / _avx512 / _neon, written once there. */
#if defined(__x86_64__)
#define MCF_VEC_ISA MCF_VEC_AVX2
#include "simd_vec.h"
#define MCF_VEC_ISA MCF_VEC_AVX512
#include "simd_vec.h"
#endif
#if defined(__aarch64__)
#define MCF_VEC_ISA MCF_VEC_NEON
#include "simd_vec.h"
#endif
#define MCF_VEC_ISA MCF_VEC_NONE
#include "simd_vec.h"

#if defined(__x86_64__)
/* 8 / 16 floats to the output format `kind` (fpconv.h) at out[idx] (AVX-512: the lanes of m); `stream`: float32
 * only, streaming stores at 32- / 64-byte aligned addresses (mcf_use_streaming), every lane stored. */
MCF_TARGET_AVX2 static inline void mcf_store8_avx2(void *out, size_t idx, __m256 w, int kind, int stream)
{
    if (kind == MCF_OUT_F32) {
        if (stream) _mm256_stream_ps((float *)out + idx, w);
        else _mm256_storeu_ps((float *)out + idx, w);
    } else if (kind == MCF_OUT_F16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)out + idx), _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT));
    } else {
        _mm_storeu_si128((__m128i *)((uint16_t *)out + idx), mcf_bf16_round_avx2(_mm256_castps_si256(w)));
    }
}

MCF_TARGET_AVX512 static inline void mcf_store16_avx512(void *out, size_t idx, __m512 w, int kind, __mmask16 m,
                                                        int stream)
{
    if (kind == MCF_OUT_F32) {
        if (stream && m == 0xffff) _mm512_stream_ps((float *)out + idx, w);
        else _mm512_mask_storeu_ps((float *)out + idx, m, w);
    } else if (kind == MCF_OUT_F16) {
        _mm256_mask_storeu_epi16((uint16_t *)out + idx, m, _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT));
    } else {
        _mm256_mask_storeu_epi16((uint16_t *)out + idx, m, mcf_bf16_round_avx512(_mm512_castps_si512(w)));
    }
}
#endif

#if defined(__aarch64__)
/* 8 floats (two vectors) to the output format `kind` (fpconv.h) at out[idx]: all 8 lanes. */
static inline void mcf_store8_neon(void *out, size_t idx, float32x4_t a, float32x4_t b, int kind)
{
    if (kind == MCF_OUT_F32) {
        vst1q_f32((float *)out + idx, a);
        vst1q_f32((float *)out + idx + 4, b);
    } else if (kind == MCF_OUT_F16) {
        vst1q_u16((uint16_t *)out + idx, vcombine_u16(mcf_f16_round_neon(a), mcf_f16_round_neon(b)));
    } else {
        vst1q_u16((uint16_t *)out + idx, vcombine_u16(mcf_bf16_round_neon(vreinterpretq_u32_f32(a)),
                                                      mcf_bf16_round_neon(vreinterpretq_u32_f32(b))));
    }
}
#endif

#endif
