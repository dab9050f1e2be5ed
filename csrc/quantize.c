/* Quantization of float32 rows to every MCF method: scalar reference, AVX2, AVX-512 and NEON (quantize_neon.h) variants.
 *
 * compat = 1 is the Go reference quantizer operation for operation: block scale = max|x| / qmax in
 * f32; k*: super = max block scale, u6 = clamp(round_half_away(scale / super * 32), 1, 63), block scale
 * = super * (u6 / 32) from the unrounded super; codes = clamp(round_half_away(v * (1 / scale)), +-qmax)
 * with the product in f32; stored scales truncated to f16 (subnormals flushed).
 * compat = 0 (the default) rounds stored scales to nearest even and computes codes against the scale
 * the decoder will actually see, which lowers the error.  In both modes a stored scale that comes out
 * infinite is refused (-1) rather than written: the Go tool writes it, and the tensor then decodes to
 * inf/NaN. */
#include <math.h>
#include <string.h>

#include "dispatch.h"
#include "fpconv.h"
#include "quant.h"
#include "simd.h"

uint16_t mcf_f32_to_f16_trunc(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    int e = (int)((u >> 23) & 0xff);
    uint32_t m = u & 0x7fffffu;
    if (e == 0xff) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u : 0u));
    int he = e - 127 + 15;
    if (he >= 31) return (uint16_t)(sign | 0x7c00u);
    if (he <= 0) return (uint16_t)sign;
    return (uint16_t)(sign | ((uint32_t)he << 10) | (m >> 13));
}

/* max |x| of n floats; returns the index of the first non-finite value, or -1. */
static long long absmax_scalar(const float *src, size_t n, float *absmax)
{
    float mx = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(src[i]);
        if (!isfinite(a)) return (long long)i;
        if (a > mx) mx = a;
    }
    *absmax = mx;
    return -1;
}

long long mcf_absmax_finite(const float *src, size_t n, float *absmax, float *minv, float *maxv)
{
    float mx = 0.0f, lo = INFINITY, hi = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        float v = src[i];
        if (!isfinite(v)) return (long long)i;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
        float a = fabsf(v);
        if (a > mx) mx = a;
    }
    *absmax = mx;
    *minv = lo;
    *maxv = hi;
    return -1;
}

static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

static inline int32_t qround(float x, int32_t qmax, int compat)
{
    /* math.Round(float64(x)): half away from zero.  In double, x + 0.5 is exact for |x| < 2**52, so
     * truncating it rounds exactly; |x| is bounded by clamping first.  x is NaN or infinite only when a
     * block's scale is so tiny (< 2**-126) that 1/scale overflows: Go's int32() of such a value is
     * MinInt32 on amd64 (then clamped to -qmax); the default mode maps NaN to 0 and keeps the sign of
     * infinities. */
    double d = (double)x;
    if (__builtin_expect(d != d, 0)) return compat ? -qmax : 0;
    if (compat && __builtin_expect(fabs(d) >= 2147483648.0, 0)) return -qmax;
    double q = (double)qmax;
    d = d > q ? q : d;      /* branch-free: compiles to minsd/maxsd */
    d = d < -q ? -q : d;
    return (int32_t)(d + copysign(0.5, d));
}

/* Pack 32 codes of `bits` bits into an LSB-first stream (q4/k4: item 0 in the low nibble). */
static void pack_block(const int32_t q[32], int bits, uint8_t *dst)
{
    if (bits == 8) {
        for (int i = 0; i < 32; i++) dst[i] = (uint8_t)(int8_t)q[i];
        return;
    }
    uint64_t acc = 0, mask = (1u << bits) - 1u;
    int nb = 0;
    size_t o = 0;
    for (int i = 0; i < 32; i++) {
        acc |= ((uint64_t)(uint32_t)q[i] & mask) << nb;
        nb += bits;
        while (nb >= 8) {
            dst[o++] = (uint8_t)acc;
            acc >>= 8;
            nb -= 8;
        }
    }
}

static float dec16(uint16_t h) { return mcf_scale_from_f16(h); }

/* Per-block steps.  The scalar versions are the reference; the AVX-512 versions compute the same
 * values with the same IEEE operations (clamp, |x| max, x * inv in f32, exact round-half-away via
 * truncation and the exact fractional part), so every variant writes the same bytes. */
typedef float (*blk_load_fn)(const float *row, size_t c0, size_t cols, float lo, float hi, float v[32]);
typedef void (*blk_codes_fn)(const float v[32], float inv, int32_t qmax, int compat, int bits, uint8_t *dst);
/* an int8/int4 row's whole 32-value chunks; returns how many values it wrote */
typedef size_t (*raw_row_fn)(const float *row, size_t cols, int bits, int clip, float lo, float hi, float inv,
                             float zero, uint8_t *dst);

static float load_scalar(const float *row, size_t c0, size_t cols, float lo, float hi, float v[32])
{
    float mx = 0.0f;
    for (int i = 0; i < 32; i++) {
        size_t c = c0 + (size_t)i;
        v[i] = c < cols ? clampf(row[c], lo, hi) : 0.0f;
        float a = fabsf(v[i]);
        mx = a > mx ? a : mx;
    }
    return mx;
}

static void codes_scalar(const float v[32], float inv, int32_t qmax, int compat, int bits, uint8_t *dst)
{
    int32_t q[32];
    for (int i = 0; i < 32; i++) q[i] = qround(v[i] * inv, qmax, compat);
    pack_block(q, bits, dst);
}

#ifdef MCF_X86
#include <immintrin.h>

MCF_TARGET_AVX2 static float load_avx2(const float *row, size_t c0, size_t cols, float lo, float hi,
                                                     float v[32])
{
    size_t n = cols - c0 < 32 ? cols - c0 : 32;
    __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(8 * k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx);
        __m256 x = _mm256_maskload_ps(row + c0 + 8 * k, m);   /* masked-off lanes read as +0 */
        x = _mm256_blendv_ps(x, vlo, _mm256_cmp_ps(x, vlo, _CMP_LT_OQ));
        x = _mm256_blendv_ps(x, vhi, _mm256_cmp_ps(x, vhi, _CMP_GT_OQ));
        x = _mm256_and_ps(x, _mm256_castsi256_ps(m));          /* padding lanes are +0 */
        _mm256_storeu_ps(v + 8 * k, x);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, x));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}

MCF_TARGET_AVX2 static inline __m256i round_away_clamp8(__m256 p, float qmax)
{
    __m256 t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(p, t));   /* exact */
    __m256 up = _mm256_cmp_ps(f, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(p, _mm256_set1_ps(-0.0f)));
    t = _mm256_add_ps(t, _mm256_and_ps(one, up));
    t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-qmax)), _mm256_set1_ps(qmax));
    return _mm256_cvttps_epi32(t);
}

MCF_TARGET_AVX2 static void codes_avx2(const float v[32], float inv, int32_t qmax, int compat,
                                                    int bits, uint8_t *dst)
{
    if (!isfinite(inv)) {
        codes_scalar(v, inv, qmax, compat, bits, dst);
        return;
    }
    __m256 vi = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int k = 0; k < 4; k++) q[k] = round_away_clamp8(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * k), vi), (float)qmax);
    mcf_store_codes32_avx2(q, bits, dst);
}


MCF_TARGET_AVX512 static float load_avx512(const float *row, size_t c0, size_t cols, float lo,
                                                         float hi, float v[32])
{
    size_t n = cols - c0 < 32 ? cols - c0 : 32;
    __mmask16 m0 = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    __mmask16 m1 = n >= 32 ? (__mmask16)0xffff : (n > 16 ? (__mmask16)((1u << (n - 16)) - 1u) : 0);
    __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    __m512 x0 = _mm512_maskz_loadu_ps(m0, row + c0), x1 = _mm512_maskz_loadu_ps(m1, row + c0 + 16);
    /* clampf: v < lo ? lo : (v > hi ? hi : v), lane for lane */
    x0 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x0, vlo, _CMP_LT_OQ), x0, vlo);
    x0 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x0, vhi, _CMP_GT_OQ), x0, vhi);
    x1 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x1, vlo, _CMP_LT_OQ), x1, vlo);
    x1 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x1, vhi, _CMP_GT_OQ), x1, vhi);
    x0 = _mm512_maskz_mov_ps(m0, x0);  /* padding lanes are +0, as in the scalar code */
    x1 = _mm512_maskz_mov_ps(m1, x1);
    _mm512_storeu_ps(v, x0);
    _mm512_storeu_ps(v + 16, x1);
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
}

MCF_TARGET_AVX512 static inline __m512i round_away_clamp(__m512 p, float qmax)
{
    __m512 t = _mm512_roundscale_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_abs_ps(_mm512_sub_ps(p, t));           /* exact */
    __mmask16 up = _mm512_cmp_ps_mask(f, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    __m512 one = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(p, _mm512_set1_ps(-0.0f)));  /* +-1 */
    t = _mm512_mask_add_ps(t, up, t, one);
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-qmax)), _mm512_set1_ps(qmax));
    return _mm512_cvttps_epi32(t);
}

MCF_TARGET_AVX512 static void codes_avx512(const float v[32], float inv, int32_t qmax, int compat,
                                                        int bits, uint8_t *dst)
{
    if (!isfinite(inv)) {  /* a scale below 2**-126: leave the rare overflow rules to the scalar code */
        codes_scalar(v, inv, qmax, compat, bits, dst);
        return;
    }
    __m512 vi = _mm512_set1_ps(inv);
    __m512i q0 = round_away_clamp(_mm512_mul_ps(_mm512_loadu_ps(v), vi), (float)qmax);
    __m512i q1 = round_away_clamp(_mm512_mul_ps(_mm512_loadu_ps(v + 16), vi), (float)qmax);
    mcf_store_codes32_avx512(q0, q1, bits, dst);
}

/* The AVX-512 fast path for the default mode without explicit clips: 16 full blocks of one row at a
 * time (two super-blocks for k*), with the scale arithmetic done once for the 16 blocks in one vector
 * instead of block by block.  Every operation is the IEEE operation of the scalar code, so the bytes are
 * the same: block max |x| (exact in any order), mx / qmax, round-to-nearest-even f16 (vcvtps2ph), the
 * decoder's f16 -> f32 with subnormals flushed, 1 / scale; for k*: super = max of the 8 block scales,
 * u6 = clamp(round_half_away(bs / super * 32), 1, 63), scale = super * (u6 / 32). */
MCF_TARGET_AVX512 static inline __m512 dec16x16(__m256i h)
{
    __m512 f = _mm512_cvtph_ps(h);
    __mmask16 normal = _mm256_test_epi16_mask(h, _mm256_set1_epi16(0x7c00));
    return _mm512_maskz_mov_ps(normal, f);   /* exponent 0 (zero or subnormal) flushes to 0 */
}

MCF_TARGET_AVX512 static inline void codes_reg_avx512(__m512 x0, __m512 x1, float inv, float qmax,
                                                                   int bits, uint8_t *dst)
{
    __m512 vi = _mm512_set1_ps(inv);
    __m512i q0 = round_away_clamp(_mm512_mul_ps(x0, vi), qmax);
    __m512i q1 = round_away_clamp(_mm512_mul_ps(x1, vi), qmax);
    mcf_store_codes32_avx512(q0, q1, bits, dst);
}

/* 16 full blocks starting at `p`.  Writes 16 block scales (q*) or 2 super scales + 16 sub-scales (k*)
 * and 16 blocks of codes; returns 1 if a stored scale overflows f16. */
MCF_TARGET_AVX512 static int group16_avx512(int family, int bits, const float *p, uint16_t *scales,
                                                         uint8_t *sub, uint8_t *codes)
{
    const float qmax = (float)((1 << (bits - 1)) - 1);
    float mxs[16];
    for (int k = 0; k < 16; k++) {
        __m512 a = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(p + 32 * k)),
                                 _mm512_abs_ps(_mm512_loadu_ps(p + 32 * k + 16)));
        mxs[k] = _mm512_reduce_max_ps(a);
    }
    __m512 bs = _mm512_div_ps(_mm512_loadu_ps(mxs), _mm512_set1_ps(qmax));   /* 0 when the block is all zero */
    __m512 scale;
    int overflow;
    if (family == MCF_FAM_BLOCK) {
        __m256i h = _mm512_cvtps_ph(bs, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        overflow = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7c00)),
                                           _mm256_set1_epi16(0x7c00)) != 0;
        _mm256_storeu_si256((__m256i *)scales, h);
        scale = dec16x16(h);
    } else {
        float s0 = _mm512_mask_reduce_max_ps(0x00ff, bs), s1 = _mm512_mask_reduce_max_ps(0xff00, bs);
        __m512 sup = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
        __m256i h = _mm512_cvtps_ph(sup, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        overflow = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7c00)),
                                           _mm256_set1_epi16(0x7c00)) != 0;
        uint16_t hs[16];
        _mm256_storeu_si256((__m256i *)hs, h);
        scales[0] = hs[0];
        scales[1] = hs[8];
        sup = dec16x16(h);
        __mmask16 live = _mm512_cmp_ps_mask(bs, _mm512_setzero_ps(), _CMP_GT_OQ)
                       & _mm512_cmp_ps_mask(sup, _mm512_setzero_ps(), _CMP_GT_OQ);
        __m512 u = _mm512_mul_ps(_mm512_maskz_div_ps(live, bs, sup), _mm512_set1_ps(32.0f));
        __m512 t = _mm512_roundscale_ps(u, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(u, t), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
        t = _mm512_mask_add_ps(t, up, t, _mm512_set1_ps(1.0f));                 /* u >= 0: half away = half up */
        t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(1.0f)), _mm512_set1_ps(63.0f));
        t = _mm512_maskz_mov_ps(live, t);                                       /* u6 = 0 for dead blocks */
        _mm_storeu_si128((__m128i *)sub, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(t)));
        scale = _mm512_maskz_mul_ps(live, sup, _mm512_div_ps(t, _mm512_set1_ps(32.0f)));
    }
    __mmask16 nz = _mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    float inv[16];
    _mm512_storeu_ps(inv, _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.0f), scale));
    size_t bb = (size_t)bits * 4;
    for (int k = 0; k < 16; k++) {
        uint8_t *dst = codes + (size_t)k * bb;
        if (!((nz >> k) & 1)) {
            memset(dst, 0, bb);
        } else if (!isfinite(inv[k])) {   /* scale below 2**-126: the scalar code's overflow rules */
            codes_scalar(p + 32 * k, inv[k], (int32_t)qmax, 0, bits, dst);
        } else {
            codes_reg_avx512(_mm512_loadu_ps(p + 32 * k), _mm512_loadu_ps(p + 32 * k + 16), inv[k], qmax, bits, dst);
        }
    }
    return overflow;
}

/* max |x| of n finite floats; returns the index of the first non-finite value, or -1. */
MCF_TARGET_AVX512 static long long absmax_avx512(const float *src, size_t n, float *absmax)
{
    __m512 mx = _mm512_setzero_ps(), inf = _mm512_set1_ps(INFINITY);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 a = _mm512_abs_ps(_mm512_loadu_ps(src + i));
        if (_mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ)) break;   /* NaN or infinity */
        mx = _mm512_max_ps(mx, a);
    }
    float m = _mm512_reduce_max_ps(mx);
    for (; i < n; i++) {
        float a = fabsf(src[i]);
        if (!isfinite(a)) return (long long)i;
        if (a > m) m = a;
    }
    *absmax = m;
    return -1;
}

/* 32 values of an int8/int4 row: q = clamp(round_half_away(x * inv + zero), qmin, qmax), the scalar
 * code's f32 operations, then packed (int4: item 0 in the low nibble). */
MCF_TARGET_AVX512 static inline void raw32_avx512(const float *x, int bits, int clip, float clip_lo,
                                                                float clip_hi, float inv, float zero, uint8_t *dst)
{
    const float qmax = (float)((1 << (bits - 1)) - 1), qmin = -(float)(1 << (bits - 1));
    const __m512 vlo = _mm512_set1_ps(clip_lo), vhi = _mm512_set1_ps(clip_hi);
    __m512i q[2];
    for (int h = 0; h < 2; h++) {
        __m512 v = _mm512_loadu_ps(x + 16 * h);
        if (clip) {   /* clampf, lane for lane */
            v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, vlo, _CMP_LT_OQ), v, vlo);
            v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, vhi, _CMP_GT_OQ), v, vhi);
        }
        __m512 p = _mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv)), _mm512_set1_ps(zero));
        __m512 t = _mm512_roundscale_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(p, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
        __m512 one = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(p, _mm512_set1_ps(-0.0f)));
        t = _mm512_mask_add_ps(t, up, t, one);
        t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(qmin)), _mm512_set1_ps(qmax));
        q[h] = _mm512_cvttps_epi32(t);
    }
    mcf_store_codes32_avx512(q[0], q[1], bits, dst);   /* bits is 4 or 8 here */
}

/* The whole 32-value chunks of one int8/int4 row (the caller's scalar loop does the rest): how many values
 * it wrote.  The two loops let raw32_avx512 be inlined with `clip` a constant. */
MCF_TARGET_AVX512 static size_t raw_row_avx512(const float *row, size_t cols, int bits, int clip, float lo,
                                                float hi, float inv, float zero, uint8_t *dst)
{
    size_t c = 0;
    if (clip) {
        for (; c + 32 <= cols; c += 32)
            raw32_avx512(row + c, bits, 1, lo, hi, inv, zero, dst + (bits == 8 ? c : c / 2));
    } else {
        for (; c + 32 <= cols; c += 32)
            raw32_avx512(row + c, bits, 0, lo, hi, inv, zero, dst + (bits == 8 ? c : c / 2));
    }
    return c;
}
#endif

#ifdef MCF_NEON
#include "quantize_neon.h"
#endif

/* Each variant's steps (dispatch.h).  group16 (16 full blocks at once, default mode without clips) and
 * raw_row exist in the AVX-512 variant only: NULL elsewhere, where the per-block steps do all the work. */
typedef struct {
    long long (*absmax)(const float *src, size_t n, float *absmax);
    blk_load_fn load;
    blk_codes_fn codes;
    int (*group16)(int family, int bits, const float *p, uint16_t *scales, uint8_t *sub, uint8_t *codes);
    raw_row_fn raw_row;
} quantize_kernels;

static const quantize_kernels KERNELS[MCF_IMPL_COUNT] = {
    [MCF_IMPL_SCALAR] = {absmax_scalar, load_scalar, codes_scalar, NULL, NULL},
#ifdef MCF_X86
    [MCF_IMPL_AVX2] = {absmax_scalar, load_avx2, codes_avx2, NULL, NULL},
    [MCF_IMPL_AVX512] = {absmax_avx512, load_avx512, codes_avx512, group16_avx512, raw_row_avx512},
#endif
#ifdef MCF_NEON
    [MCF_IMPL_NEON] = {absmax_scalar, load_neon, codes_neon, NULL, NULL},
#endif
};

long long mcf_absmax(const float *src, size_t n, float *absmax, int impl)
{
    return KERNELS[mcf_variant(impl)].absmax(src, n, absmax);
}

int mcf_quantize_rows(int family, int bits, const float *src, size_t nrows, size_t cols, float min_clip,
                      float max_clip, int compat, uint16_t *scales, uint8_t *sub, uint8_t *codes, int impl)
{
    const quantize_kernels *k = &KERNELS[mcf_variant(impl)];
    blk_load_fn load = k->load;
    blk_codes_fn mkcodes = k->codes;
    size_t bpr = (cols + 31) / 32, spr = (bpr + 7) / 8, bb = (size_t)bits * 4;
    int32_t qmax = (1 << (bits - 1)) - 1;
    int overflow = 0;
    /* groups of 16 full blocks per row go through the vector fast path (default mode, no clips) */
    size_t groups = 0;
    if (k->group16 && !compat && isinf(min_clip) && min_clip < 0 && isinf(max_clip) && max_clip > 0)
        groups = (cols / 32) / 16;
    for (size_t r = 0; r < nrows; r++) {
        const float *row = src + r * cols;
        for (size_t g = 0; g < groups; g++) {
            size_t b = g * 16;
            overflow |= k->group16(family, bits, row + b * 32,
                                   family == MCF_FAM_BLOCK ? scales + r * bpr + b : scales + r * spr + g * 2,
                                   family == MCF_FAM_BLOCK ? NULL : sub + r * bpr + b, codes + (r * bpr + b) * bb);
        }
        if (family == MCF_FAM_BLOCK) {
            for (size_t b = groups * 16; b < bpr; b++) {
                float v[32];
                float mx = load(row, b * 32, cols, min_clip, max_clip, v);
                float scale = mx > 0.0f ? mx / (float)qmax : 0.0f;
                uint16_t h;
                if (compat) {
                    h = mcf_f32_to_f16_trunc(scale);
                } else {
                    h = mcf_f32_to_f16_one(scale);
                    scale = dec16(h);  /* codes against the scale the decoder sees */
                }
                if ((h & 0x7c00u) == 0x7c00u) overflow = 1;  /* truncation too: it reaches inf at 65536 */
                scales[r * bpr + b] = h;
                if (scale != 0.0f) mkcodes(v, 1.0f / scale, qmax, compat, bits, codes + (r * bpr + b) * bb);
                else memset(codes + (r * bpr + b) * bb, 0, bb);
            }
        } else {
            for (size_t s = groups * 2; s < spr; s++) {
                float bs[8] = {0}, v[8][32], maxs = 0.0f;
                for (int k = 0; k < 8; k++) {
                    size_t b = s * 8 + (size_t)k;
                    if (b >= bpr) break;
                    float mx = load(row, b * 32, cols, min_clip, max_clip, v[k]);
                    bs[k] = mx > 0.0f ? mx / (float)qmax : 0.0f;
                    if (bs[k] > maxs) maxs = bs[k];
                }
                float super = maxs;
                uint16_t h;
                if (compat) {
                    h = mcf_f32_to_f16_trunc(super);
                } else {
                    h = mcf_f32_to_f16_one(super);
                    super = dec16(h);
                }
                if ((h & 0x7c00u) == 0x7c00u) overflow = 1;
                scales[r * spr + s] = h;
                for (int k = 0; k < 8; k++) {
                    size_t b = s * 8 + (size_t)k;
                    if (b >= bpr) break;
                    uint8_t u6 = 0;
                    if (bs[k] > 0.0f && super > 0.0f) {
                        float ratio = bs[k] / super;
                        double u = round((double)(ratio * 32.0f));
                        u6 = (uint8_t)(u < 1.0 ? 1 : (u > 63.0 ? 63 : (int)u));
                    }
                    sub[r * bpr + b] = u6 & 0x3f;
                    float scale = (u6 > 0 && super > 0.0f) ? super * ((float)u6 / 32.0f) : 0.0f;
                    if (scale != 0.0f) mkcodes(v[k], 1.0f / scale, qmax, compat, bits, codes + (r * bpr + b) * bb);
                    else memset(codes + (r * bpr + b) * bb, 0, bb);
                }
            }
        }
    }
    return overflow ? -1 : 0;
}

void mcf_quantize_raw_rows(int bits, const float *src, size_t nrows, size_t cols, float min_clip, float max_clip,
                           float scale, float zero, uint8_t *codes, size_t row_bytes, int impl)
{
    int32_t qmax = (1 << (bits - 1)) - 1, qmin = -(1 << (bits - 1));
    float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    int clip = !(isinf(min_clip) && min_clip < 0 && isinf(max_clip) && max_clip > 0);
    /* the vector path needs a finite 1 / scale; scale == 0 writes zeros below */
    raw_row_fn raw_row = scale != 0.0f && isfinite(inv) ? KERNELS[mcf_variant(impl)].raw_row : NULL;
    for (size_t r = 0; r < nrows; r++) {
        const float *row = src + r * cols;
        uint8_t *dst = codes + r * row_bytes;
        memset(dst, 0, row_bytes);
        size_t c = raw_row ? raw_row(row, cols, bits, clip, min_clip, max_clip, inv, zero, dst) : 0;
        for (; c < cols; c++) {
            /* a scale below 2**-128 has no finite float32 inverse: divide instead (x * inf would be NaN
             * for x = 0, and converting NaN to an integer is undefined) */
            float xc = clampf(row[c], min_clip, max_clip);
            float p = isfinite(inv) ? xc * inv + zero : xc / scale + zero;
            double x = scale != 0.0f ? round((double)p) : 0.0;
            int32_t v = x > qmax ? qmax : (x < qmin ? qmin : (int32_t)x);
            if (bits == 8) dst[c] = (uint8_t)(int8_t)v;
            else dst[c >> 1] |= (uint8_t)(((uint32_t)v & 0xfu) << ((c & 1) * 4));
        }
    }
}

/* The packer above, for the search quantizer (csrc/quant_search.c). */
void mcf_pack_block(const int32_t q[32], int bits, uint8_t *dst) { pack_block(q, bits, dst); }
