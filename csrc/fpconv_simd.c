/* Array conversions f16 <-> f32 and bf16 <-> f32 with run-time variant selection.  The scalar loops of
 * fpconv.c are the reference; the AVX2 (F16C) and AVX-512 loops give the same bits, NaN payloads
 * included (F16C would quiet a signalling f16 NaN on widening; those lanes are rebuilt with integer
 * operations, as the scalar code does). */
#include <string.h>

#include "dispatch.h"
#include "fpconv.h"
#include "simd.h"

#ifdef MCF_X86

MCF_TARGET_AVX2 static __m256 h2f_avx2(__m128i h)
{
    __m256 f = _mm256_cvtph_ps(h);
    __m256i u = _mm256_cvtepu16_epi32(h);
    __m256i e = _mm256_and_si256(u, _mm256_set1_epi32(0x7c00)), m = _mm256_and_si256(u, _mm256_set1_epi32(0x3ff));
    __m256i isnan = _mm256_andnot_si256(_mm256_cmpeq_epi32(m, _mm256_setzero_si256()),
                                        _mm256_cmpeq_epi32(e, _mm256_set1_epi32(0x7c00)));
    __m256i nanv = _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x8000)), 16),
                                                   _mm256_set1_epi32(0x7f800000)), _mm256_slli_epi32(m, 13));
    return _mm256_blendv_ps(f, _mm256_castsi256_ps(nanv), _mm256_castsi256_ps(isnan));
}

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

/* 16 values per step: one test finds whether any is a NaN, and only then are NaN lanes rebuilt
 * (h2f_avx2); every other value is vcvtph2ps's, which is exact. */
MCF_TARGET_AVX2 static void f16_to_f32_avx2(const uint16_t *s, float *d, size_t n)
{
    size_t i = 0;
    int stream = mcf_use_streaming(d, n * 4);
    const __m256i absm = _mm256_set1_epi16(0x7fff), inf = _mm256_set1_epi16(0x7c00);
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i nan = _mm256_cmpgt_epi16(_mm256_and_si256(h, absm), inf);
        __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
        if (__builtin_expect(_mm256_testz_si256(nan, nan), 1)) {
            put8_f32(d + i, _mm256_cvtph_ps(lo), stream);
            put8_f32(d + i + 8, _mm256_cvtph_ps(hi), stream);
        } else {
            put8_f32(d + i, h2f_avx2(lo), stream);
            put8_f32(d + i + 8, h2f_avx2(hi), stream);
        }
    }
    for (; i + 8 <= n; i += 8) put8_f32(d + i, h2f_avx2(_mm_loadu_si128((const __m128i *)(s + i))), stream);
    if (stream) _mm_sfence();
    for (; i < n; i++) d[i] = mcf_f16_to_f32_one(s[i]);
}

MCF_TARGET_AVX2 static void f32_to_f16_avx2(const float *s, uint16_t *d, size_t n)
{
    size_t i = 0;
    int stream = mcf_use_streaming(d, n * 2);
    for (; i + 8 <= n; i += 8)
        put8_u16(d + i, _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT), stream);
    if (stream) _mm_sfence();
    for (; i < n; i++) d[i] = mcf_f32_to_f16_one(s[i]);
}

MCF_TARGET_AVX2 static void bf16_to_f32_avx2(const uint16_t *s, float *d, size_t n)
{
    size_t i = 0;
    int stream = mcf_use_streaming(d, n * 4);
    for (; i + 8 <= n; i += 8)
        put8_f32(d + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i))), 16)), stream);
    if (stream) _mm_sfence();
    for (; i < n; i++) {
        uint32_t u = (uint32_t)s[i] << 16;
        memcpy(d + i, &u, 4);
    }
}

MCF_TARGET_AVX2 static void f32_to_bf16_avx2(const float *s, uint16_t *d, size_t n)
{
    size_t i = 0;
    int stream = mcf_use_streaming(d, n * 2);
    for (; i + 8 <= n; i += 8)
        put8_u16(d + i, mcf_bf16_round_avx2(_mm256_loadu_si256((const __m256i *)(s + i))), stream);
    if (stream) _mm_sfence();
    for (; i < n; i++) d[i] = mcf_f32_to_bf16_one(s[i]);
}

MCF_TARGET_AVX512 static void f16_to_f32_avx512(const uint16_t *s, float *d, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
        __m512 f = _mm512_cvtph_ps(h);
        __m512i u = _mm512_cvtepu16_epi32(h);
        __m512i m = _mm512_and_si512(u, _mm512_set1_epi32(0x3ff));
        __mmask16 isnan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7c00)), _mm512_set1_epi32(0x7c00)) &
                          _mm512_cmpneq_epi32_mask(m, _mm512_setzero_si512());
        __m512i nanv = _mm512_or_si512(_mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x8000)), 16),
                                                       _mm512_set1_epi32(0x7f800000)), _mm512_slli_epi32(m, 13));
        _mm512_storeu_ps(d + i, _mm512_mask_mov_ps(f, isnan, _mm512_castsi512_ps(nanv)));
    }
    f16_to_f32_avx2(s + i, d + i, n - i);
}

MCF_TARGET_AVX512 static void f32_to_f16_avx512(const float *s, uint16_t *d, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(d + i), _mm512_cvtps_ph(_mm512_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
    f32_to_f16_avx2(s + i, d + i, n - i);
}

MCF_TARGET_AVX512 static void bf16_to_f32_avx512(const uint16_t *s, float *d, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_si512((void *)(d + i),
                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + i))), 16));
    bf16_to_f32_avx2(s + i, d + i, n - i);
}

MCF_TARGET_AVX512 static void f32_to_bf16_avx512(const float *s, uint16_t *d, size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(d + i), mcf_bf16_round_avx512(_mm512_loadu_si512((const void *)(s + i))));
    f32_to_bf16_avx2(s + i, d + i, n - i);
}
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
