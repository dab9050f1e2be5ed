/* The store limit the decode kernels are measured against (bench/test_bench_store_limit.py), not a
 * kernel: read 1 byte, write 4.  Each input byte is widened to a 32-bit lane and stored, with
 * non-temporal (streaming) stores or plain ones, using the AVX2 instructions the decoders' AVX2 variant
 * has.  It is compiled with the kernels' flags, so the two differ only in the work done per byte: a
 * decoder at this loop's speed is bound by writing its output, not by decoding.  Exposed only as
 * mcf._core._kernels._store_yardstick, for the benchmarks. */
#include <stddef.h>
#include <stdint.h>

#include "simd.h"
#include "yardstick.h"

#if defined(__x86_64__)
#include <immintrin.h>

/* Bytes i .. (the last whole 32) widened by aligned 32-byte stores, streaming or plain: `streaming` is a constant
 * at both calls, so each inlined copy of the loop has one kind of store.  Returns where it stopped. */
MCF_TARGET_AVX2 static inline __attribute__((always_inline)) size_t widen32_avx2(const uint8_t *src, uint32_t *dst,
                                                                                 size_t i, size_t n, const int streaming)
{
    for (; i + 32 <= n; i += 32) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i));
        __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
        __m256i w[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                        _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
        for (int k = 0; k < 4; k++) {
            if (streaming) _mm256_stream_si256((__m256i *)(dst + i + 8 * k), w[k]);
            else _mm256_store_si256((__m256i *)(dst + i + 8 * k), w[k]);
        }
    }
    return i;
}

MCF_TARGET_AVX2 static void widen_avx2(const uint8_t *src, uint32_t *dst, size_t n, int streaming)
{
    size_t i = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 31); i++) dst[i] = src[i];
    if (streaming) {
        i = widen32_avx2(src, dst, i, n, 1);
        _mm_sfence();
    } else {
        i = widen32_avx2(src, dst, i, n, 0);
    }
    for (; i < n; i++) dst[i] = src[i];
}
#endif

void mcf_store_yardstick(const uint8_t *src, uint32_t *dst, size_t n, int streaming)
{
#if defined(__x86_64__)
    if (mcf_cpu_supports(MCF_IMPL_AVX2)) {
        widen_avx2(src, dst, n, streaming);
        return;
    }
#endif
    (void)streaming;
    for (size_t i = 0; i < n; i++) dst[i] = src[i];
}
