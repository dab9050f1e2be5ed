/* Array conversions f16 <-> f32 and bf16 <-> f32 with run-time variant selection.  The scalar loops of
 * fpconv.c are the reference; the AVX2 (F16C) and AVX-512 loops give the same bits, NaN payloads
 * included (F16C would quiet a signalling f16 NaN on widening; those lanes are rebuilt with integer
 * operations, as the scalar code does). */
#include <string.h>

#include "dispatch.h"
#include "fpconv.h"
#include "simd.h"

#ifdef MCF_X86

/* Plain or streaming 32- / 16-byte stores: streaming for outputs far larger than the caches (simd.h),
 * whose every vector store then lands aligned (the loops below store at multiples of 8 elements). */
MCF_TARGET_AVX2 static inline void put8_f32(float *d, __m256 v, int stream)
{
    if (stream) _mm256_stream_ps(d, v);
    else _mm256_storeu_ps(d, v);
}

MCF_TARGET_AVX2 static inline void put8_u16(uint16_t *d, __m128i v, int stream)
{
    if (stream) _mm_stream_si128((__m128i *)d, v);
    else _mm_storeu_si128((__m128i *)d, v);
}

/* f16 -> f32 of values 0 .. 16k-1, k as large as n allows; returns 16k.  One test per 16 values finds whether any is
 * a NaN, and only then are NaN lanes rebuilt (mcf_h2f_avx2); every other value is vcvtph2ps's, which is exact. */
MCF_TARGET_AVX2 static inline size_t f16_to_f32_x16_avx2(const uint16_t *s, float *d, size_t n, int stream)
{
    size_t i = 0;
    const __m256i absm = _mm256_set1_epi16(0x7fff), inf = _mm256_set1_epi16(0x7c00);
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i nan = _mm256_cmpgt_epi16(_mm256_and_si256(h, absm), inf);
        __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
        if (__builtin_expect(_mm256_testz_si256(nan, nan), 1)) {
            put8_f32(d + i, _mm256_cvtph_ps(lo), stream);
            put8_f32(d + i + 8, _mm256_cvtph_ps(hi), stream);
        } else {
            put8_f32(d + i, mcf_h2f_avx2(lo), stream);
            put8_f32(d + i + 8, mcf_h2f_avx2(hi), stream);
        }
    }
    return i;
}

/* An AVX2 conversion `name` of n values s -> d: STEP converts and stores values i .. i+7 (put8_*: streaming for
 * outputs far larger than the caches), from i = `first` on; the rest through fpconv.c's scalar loop `scalar`. */
#define MCF_CONVERT_AVX2(name, in_t, out_t, scalar, first, STEP)                                                   \
    MCF_TARGET_AVX2 static void name(const in_t *s, out_t *d, size_t n)                                            \
    {                                                                                                              \
        int stream = mcf_use_streaming(d, n * sizeof(out_t));                                                      \
        size_t i = first;                                                                                          \
        for (; i + 8 <= n; i += 8) STEP;                                                                           \
        if (stream) _mm_sfence();                                                                                  \
        scalar(s + i, d + i, n - i);                                                                               \
    }

MCF_CONVERT_AVX2(f16_to_f32_avx2, uint16_t, float, mcf_f16_to_f32, f16_to_f32_x16_avx2(s, d, n, stream),
    put8_f32(d + i, mcf_h2f_avx2(_mm_loadu_si128((const __m128i *)(s + i))), stream))
MCF_CONVERT_AVX2(f32_to_f16_avx2, float, uint16_t, mcf_f32_to_f16, 0,
    put8_u16(d + i, _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT), stream))
MCF_CONVERT_AVX2(bf16_to_f32_avx2, uint16_t, float, mcf_bf16_to_f32, 0,
    put8_f32(d + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                        _mm_loadu_si128((const __m128i *)(s + i))), 16)), stream))
MCF_CONVERT_AVX2(f32_to_bf16_avx2, float, uint16_t, mcf_f32_to_bf16, 0,
    put8_u16(d + i, mcf_bf16_round_avx2(_mm256_loadu_si256((const __m256i *)(s + i))), stream))

/* An AVX-512 conversion: STEP converts and stores values i .. i+15, the AVX2 one the rest. */
#define MCF_CONVERT_AVX512(name, in_t, out_t, avx2, STEP)                                                           \
    MCF_TARGET_AVX512 static void name(const in_t *s, out_t *d, size_t n)                                          \
    {                                                                                                              \
        size_t i = 0;                                                                                              \
        for (; i + 16 <= n; i += 16) STEP;                                                                         \
        avx2(s + i, d + i, n - i);                                                                                 \
    }

MCF_CONVERT_AVX512(f16_to_f32_avx512, uint16_t, float, f16_to_f32_avx2,
    _mm512_storeu_ps(d + i, mcf_h2f_avx512(_mm256_loadu_si256((const __m256i *)(s + i)))))
MCF_CONVERT_AVX512(f32_to_f16_avx512, float, uint16_t, f32_to_f16_avx2,
    _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(_mm512_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT)))
MCF_CONVERT_AVX512(bf16_to_f32_avx512, uint16_t, float, bf16_to_f32_avx2,
    _mm512_storeu_si512((void *)(d + i),
                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i))), 16)))
MCF_CONVERT_AVX512(f32_to_bf16_avx512, float, uint16_t, f32_to_bf16_avx2,
    _mm256_storeu_si256((__m256i *)(d + i), mcf_bf16_round_avx512(_mm512_loadu_si512((const void *)(s + i)))))
#endif

#ifdef MCF_NEON
#include "fpconv_neon.h"
#endif

/* Each variant's loops (dispatch.h) */
typedef struct {
    void (*bf16_to_f32)(const uint16_t *, float *, size_t);
    void (*f32_to_bf16)(const float *, uint16_t *, size_t);
    void (*f16_to_f32)(const uint16_t *, float *, size_t);
    void (*f32_to_f16)(const float *, uint16_t *, size_t);
} fpconv_kernels;

static const fpconv_kernels KERNELS[MCF_IMPL_COUNT] = {
    [MCF_IMPL_SCALAR] = {mcf_bf16_to_f32, mcf_f32_to_bf16, mcf_f16_to_f32, mcf_f32_to_f16},
#ifdef MCF_X86
    [MCF_IMPL_AVX2] = {bf16_to_f32_avx2, f32_to_bf16_avx2, f16_to_f32_avx2, f32_to_f16_avx2},
    [MCF_IMPL_AVX512] = {bf16_to_f32_avx512, f32_to_bf16_avx512, f16_to_f32_avx512, f32_to_f16_avx512},
#endif
#ifdef MCF_NEON
    [MCF_IMPL_NEON] = {bf16_to_f32_neon, f32_to_bf16_neon, f16_to_f32_neon, f32_to_f16_neon},
#endif
};

void mcf_convert(mcf_fpconv_op op, const void *src, void *dst, size_t n, int impl)
{
    const fpconv_kernels *k = &KERNELS[mcf_variant(impl)];
    switch (op) {
    case MCF_BF16_TO_F32: k->bf16_to_f32(src, dst, n); return;
    case MCF_F32_TO_BF16: k->f32_to_bf16(src, dst, n); return;
    case MCF_F16_TO_F32: k->f16_to_f32(src, dst, n); return;
    default: /* MCF_F32_TO_F16 */ k->f32_to_f16(src, dst, n); return;
    }
}
