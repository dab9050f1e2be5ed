/* What every SIMD variant shares: one target attribute per tier of csrc/cpu.c, and the small inline
 * helpers more than one kernel file needs.
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

#define MCF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#define MCF_TARGET_AVX512 \
    __attribute__((target("avx2,fma,f16c,bmi2,avx512f,avx512dq,avx512bw,avx512vl,avx512vbmi")))

/* Streaming (non-temporal) stores pay off only for outputs far larger than the caches, and need
 * 64-byte-aligned destinations; they change where values are written, never the values. */
#define MCF_STREAM_MIN_BYTES ((size_t)8 << 20)

static inline int mcf_use_streaming(const void *out, size_t out_bytes)
{
    return out_bytes >= MCF_STREAM_MIN_BYTES && ((uintptr_t)out & 63) == 0;
}

#if defined(__x86_64__)
#include <immintrin.h>

/* float32 bits to bfloat16, round to nearest even, NaN kept with the quiet bit set: 8 / 16 lanes,
 * identical to mcf_f32_to_bf16_one (csrc/fpconv.c). */
MCF_TARGET_AVX2 static inline __m128i mcf_bf16_round_avx2(__m256i u)
{
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i nanv = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                       _mm256_set1_epi32(0x7f800000));
    r = _mm256_and_si256(_mm256_blendv_epi8(r, nanv, isnan), _mm256_set1_epi32(0xffff));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

MCF_TARGET_AVX512 static inline __m256i mcf_bf16_round_avx512(__m512i u)
{
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __m512i nanv = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    __mmask16 isnan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                              _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, isnan, nanv));
}

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

#endif
