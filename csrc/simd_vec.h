/* A width-generic vector vocabulary: a kernel written once against the names below compiles to AVX2 (8 float32
 * lanes), AVX-512 (16) or NEON (4), as numpy's universal intrinsics do.  The per-ISA sections hold the
 * vocabulary, never an algorithm; the algorithms live in the *_vec.h files, each included once per ISA:
 *
 *     #define MCF_VEC_ISA MCF_VEC_AVX2        (after simd.h; MCF_VEC_AVX512, MCF_VEC_NEON likewise)
 *     #include "simd_vec.h"                 (maps the names onto that ISA, then forgets MCF_VEC_ISA)
 *     #include "quant_search_vec.h"         (defines VSFX(group_block) = group_block_avx2, ...)
 *
 * and MCF_VEC_ISA MCF_VEC_NONE to drop every name again.  The header has no include guard on purpose; each
 * inclusion first undefines what the previous one defined.
 *
 * Every name means exactly one IEEE operation per lane, or the bit manipulation its comment says, in every
 * ISA, so a kernel written here runs the same float32 sequence lane by lane as the scalar reference does (no
 * FMA: the build has -ffp-contract=off).  vf_max / vf_min are x86's maxps / minps, `a > b ? a : b` and
 * `a < b ? a : b` (NaN: the second operand), also on NEON, whose FMAX / FMIN would return the NaN.
 *
 *   types   vf_t float32 x VW, vi_t int32 x VW (uint32 on NEON), vm_t a lane mask, vh_t VW binary16 bit patterns
 *   names   VW (lanes), VSFX(name) (name_avx2 / name_avx512 / name_neon), VTARGET (the target attribute)
 *   float   vf_set1 vf_zero vf_load vf_store (aligned to VW * 4) vf_storeu vf_add vf_sub vf_mul vf_div vf_max
 *           vf_min vf_abs vf_neg (sign flipped) vf_rint (nearest even) vf_floor vf_trunc
 *   compare vf_gt vf_ge vf_lt (ordered) vf_ne (unordered: NaN != 0) vi_eq vi_gt (signed) vi_testz ((a & b) == 0)
 *   select  vf_blend(a, b, m) / vi_blend(a, b, m): b where m, else a; vf_maskz(m, x): x where m, else +0;
 *           vf_maskz_div(m, a, b): a / b where m, else +0 (no lane outside m divides)
 *   masks   vm_and vm_andnot(a, b) (b and not a) vm_any vm_first(n) (lanes 0 .. n-1)
 *   int     vi_set1 vi_zero vi_and vi_or vi_add vi_sub vi_min / vi_max (signed) vi_shl / vi_shr (logical; a
 *           constant count) vi_as_f / vf_as_i (the same bits) vi_to_f (converted)
 *   f16     vf_to_h (nearest even) vh_cvt (the hardware widening: exact, but it may quiet a signalling NaN; see
 *           VSFX(mcf_h2f)) vh_widen (zero-extended to vi_t) vi_narrow16 (the low 16 bits of lanes in 0 .. 0xffff)
 *           vh_storeu vh_blend(a, b, m) vh_or(h, bits)
 *   blocks  vf_load_clip(p, q, nc, lo, hi): p[VW*q .. VW*q + VW-1] clamped to [lo, hi], lanes at or past nc +0
 *           (VW*q < nc); vf_transpose(r[VW]); vf_codes32(x[32 / VW], bits, dst): 32 integral floats in the int8
 *           range as codes, stored or packed as csrc/quant.h lays blocks out
 *
 * Helpers written once against the vocabulary, defined for every ISA the first time simd.h maps it:
 * VSFX(mcf_bf16_round) (float32 bits to bfloat16, nearest even, NaN quieted) and VSFX(mcf_h2f) (binary16 to
 * float32 exactly as mcf_f16_to_f32_one, signalling NaN payloads kept). */
#ifndef MCF_SIMD_H
#error "include simd.h before simd_vec.h"
#endif

#undef VW
#undef VSFX
#undef VTARGET
#undef vf_t
#undef vi_t
#undef vm_t
#undef vh_t
#undef vf_set1
#undef vf_zero
#undef vf_load
#undef vf_store
#undef vf_storeu
#undef vf_add
#undef vf_sub
#undef vf_mul
#undef vf_div
#undef vf_max
#undef vf_min
#undef vf_abs
#undef vf_neg
#undef vf_rint
#undef vf_floor
#undef vf_trunc
#undef vf_gt
#undef vf_ge
#undef vf_lt
#undef vf_ne
#undef vf_blend
#undef vf_maskz
#undef vf_maskz_div
#undef vm_and
#undef vm_andnot
#undef vm_any
#undef vm_first
#undef vi_set1
#undef vi_zero
#undef vi_and
#undef vi_or
#undef vi_add
#undef vi_sub
#undef vi_min
#undef vi_max
#undef vi_shl
#undef vi_shr
#undef vi_eq
#undef vi_gt
#undef vi_testz
#undef vi_blend
#undef vi_as_f
#undef vf_as_i
#undef vi_to_f
#undef vf_to_h
#undef vh_cvt
#undef vh_widen
#undef vi_narrow16
#undef vh_storeu
#undef vh_blend
#undef vh_or
#undef vf_load_clip
#undef vf_transpose
#undef vf_codes32

#if MCF_VEC_ISA == MCF_VEC_AVX2
/* ---- AVX2: 8 lanes, masks are float vectors of all-ones / all-zeros lanes ------------------------------- */
#ifndef MCF_VEC_HAVE_AVX2
#define MCF_VEC_HAVE_AVX2 1
#define MCF_VEC_FIRST 1

/* a 32-bit lane mask as a 16-bit lane mask (for blending f16 values) */
MCF_TARGET_AVX2 static inline __m128i mcf_mask16_of_avx2(__m256 m)
{
    __m256i i = _mm256_castps_si256(m);
    return _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
}

MCF_TARGET_AVX2 static inline __m256 mcf_maskz_div_avx2(__m256 m, __m256 a, __m256 b)
{
    return _mm256_and_ps(m, _mm256_div_ps(a, _mm256_blendv_ps(_mm256_set1_ps(1.0f), b, m)));
}

MCF_TARGET_AVX2 static inline __m256 mcf_load_clip_avx2(const float *p, size_t q, size_t nc, __m256 lo, __m256 hi)
{
    __m256i ix = _mm256_add_epi32(_mm256_set1_epi32((int)(8 * q)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nc), ix);
    __m256 x = _mm256_maskload_ps(p + 8 * q, m);
    x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    return _mm256_and_ps(x, _mm256_castsi256_ps(m));
}

MCF_TARGET_AVX2 static inline void mcf_transpose_avx2(__m256 r[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 2; g++) {
        u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g + 0], t[4 * g + 2], 0x44);
        u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g + 0], t[4 * g + 2], 0xee);
        u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}

MCF_TARGET_AVX2 static inline void mcf_codes32_avx2(const __m256 x[4], int bits, uint8_t *dst)
{
    __m256i q[4];
    for (int k = 0; k < 4; k++) q[k] = _mm256_cvttps_epi32(x[k]);
    mcf_store_codes32_avx2(q, bits, dst);
}
#endif

#define VW 8
#define VSFX(name) name##_avx2
#define VTARGET MCF_TARGET_AVX2
#define vf_t __m256
#define vi_t __m256i
#define vm_t __m256
#define vh_t __m128i
#define vf_set1(x) _mm256_set1_ps(x)
#define vf_zero() _mm256_setzero_ps()
#define vf_load(p) _mm256_load_ps(p)
#define vf_store(p, v) _mm256_store_ps(p, v)
#define vf_storeu(p, v) _mm256_storeu_ps(p, v)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_sub(a, b) _mm256_sub_ps(a, b)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_div(a, b) _mm256_div_ps(a, b)
#define vf_max(a, b) _mm256_max_ps(a, b)
#define vf_min(a, b) _mm256_min_ps(a, b)
#define vf_abs(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)
#define vf_neg(x) _mm256_xor_ps(x, _mm256_set1_ps(-0.0f))
#define vf_rint(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vf_floor(x) _mm256_round_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define vf_trunc(x) _mm256_round_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC)
#define vf_gt(a, b) _mm256_cmp_ps(a, b, _CMP_GT_OQ)
#define vf_ge(a, b) _mm256_cmp_ps(a, b, _CMP_GE_OQ)
#define vf_lt(a, b) _mm256_cmp_ps(a, b, _CMP_LT_OQ)
#define vf_ne(a, b) _mm256_cmp_ps(a, b, _CMP_NEQ_UQ)
#define vf_blend(a, b, m) _mm256_blendv_ps(a, b, m)
#define vf_maskz(m, x) _mm256_and_ps(m, x)
#define vf_maskz_div(m, a, b) mcf_maskz_div_avx2(m, a, b)
#define vm_and(a, b) _mm256_and_ps(a, b)
#define vm_andnot(a, b) _mm256_andnot_ps(a, b)
#define vm_any(m) (_mm256_movemask_ps(m) != 0)
#define vm_first(n) \
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))
#define vi_set1(x) _mm256_set1_epi32(x)
#define vi_zero() _mm256_setzero_si256()
#define vi_and(a, b) _mm256_and_si256(a, b)
#define vi_or(a, b) _mm256_or_si256(a, b)
#define vi_add(a, b) _mm256_add_epi32(a, b)
#define vi_sub(a, b) _mm256_sub_epi32(a, b)
#define vi_min(a, b) _mm256_min_epi32(a, b)
#define vi_max(a, b) _mm256_max_epi32(a, b)
#define vi_shl(a, n) _mm256_slli_epi32(a, n)
#define vi_shr(a, n) _mm256_srli_epi32(a, n)
#define vi_eq(a, b) _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b))
#define vi_gt(a, b) _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b))
#define vi_testz(a, b) _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(a, b), _mm256_setzero_si256()))
#define vi_blend(a, b, m) _mm256_blendv_epi8(a, b, _mm256_castps_si256(m))
#define vi_as_f(a) _mm256_castsi256_ps(a)
#define vf_as_i(x) _mm256_castps_si256(x)
#define vi_to_f(a) _mm256_cvtepi32_ps(a)
#define vf_to_h(x) _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vh_cvt(h) _mm256_cvtph_ps(h)
#define vh_widen(h) _mm256_cvtepu16_epi32(h)
#define vi_narrow16(a) _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1))
#define vh_storeu(p, h) _mm_storeu_si128((__m128i *)(p), h)
#define vh_blend(a, b, m) _mm_blendv_epi8(a, b, mcf_mask16_of_avx2(m))
#define vh_or(h, bits) _mm_or_si128(h, _mm_set1_epi16((short)(bits)))
#define vf_load_clip(p, q, nc, lo, hi) mcf_load_clip_avx2(p, q, nc, lo, hi)
#define vf_transpose(r) mcf_transpose_avx2(r)
#define vf_codes32(x, bits, dst) mcf_codes32_avx2(x, bits, dst)

#elif MCF_VEC_ISA == MCF_VEC_AVX512
/* ---- AVX-512: 16 lanes, masks are mask registers ------------------------------------------------------- */
#ifndef MCF_VEC_HAVE_AVX512
#define MCF_VEC_HAVE_AVX512 1
#define MCF_VEC_FIRST 1

MCF_TARGET_AVX512 static inline __mmask16 mcf_mask16_avx512(size_t n)
{
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

MCF_TARGET_AVX512 static inline __m512 mcf_load_clip_avx512(const float *p, size_t q, size_t nc, __m512 lo,
                                                            __m512 hi)
{
    __mmask16 m = mcf_mask16_avx512(nc - 16 * q);
    __m512 x = _mm512_maskz_loadu_ps(m, p + 16 * q);
    x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), x, lo);
    x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), x, hi);
    return _mm512_maskz_mov_ps(m, x);
}

MCF_TARGET_AVX512 static inline void mcf_transpose_avx512(__m512 r[16])
{
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {
        __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
        __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
        r[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    /* r[4g + k], 128-bit lane L: element 4L + k of rows 4g .. 4g+3 */
    for (int k = 0; k < 4; k++) {
        t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
        t[k + 4] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);
        t[k + 8] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        t[k + 12] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd);
        r[k + 4] = _mm512_shuffle_f32x4(t[k + 4], t[k + 12], 0x88);
        r[k + 12] = _mm512_shuffle_f32x4(t[k + 4], t[k + 12], 0xdd);
    }
}

MCF_TARGET_AVX512 static inline void mcf_codes32_avx512(const __m512 x[2], int bits, uint8_t *dst)
{
    mcf_store_codes32_avx512(_mm512_cvttps_epi32(x[0]), _mm512_cvttps_epi32(x[1]), bits, dst);
}
#endif

#define VW 16
#define VSFX(name) name##_avx512
#define VTARGET MCF_TARGET_AVX512
#define vf_t __m512
#define vi_t __m512i
#define vm_t __mmask16
#define vh_t __m256i
#define vf_set1(x) _mm512_set1_ps(x)
#define vf_zero() _mm512_setzero_ps()
#define vf_load(p) _mm512_load_ps(p)
#define vf_store(p, v) _mm512_store_ps(p, v)
#define vf_storeu(p, v) _mm512_storeu_ps(p, v)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_sub(a, b) _mm512_sub_ps(a, b)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_div(a, b) _mm512_div_ps(a, b)
#define vf_max(a, b) _mm512_max_ps(a, b)
#define vf_min(a, b) _mm512_min_ps(a, b)
#define vf_abs(x) _mm512_abs_ps(x)
#define vf_neg(x) _mm512_xor_ps(x, _mm512_set1_ps(-0.0f))
#define vf_rint(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vf_floor(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define vf_trunc(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC)
#define vf_gt(a, b) _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ)
#define vf_ge(a, b) _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ)
#define vf_lt(a, b) _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ)
#define vf_ne(a, b) _mm512_cmp_ps_mask(a, b, _CMP_NEQ_UQ)
#define vf_blend(a, b, m) _mm512_mask_blend_ps(m, a, b)
#define vf_maskz(m, x) _mm512_maskz_mov_ps(m, x)
#define vf_maskz_div(m, a, b) _mm512_maskz_div_ps(m, a, b)
#define vm_and(a, b) ((__mmask16)((a) & (b)))
#define vm_andnot(a, b) ((__mmask16)(~(a) & (b)))
#define vm_any(m) ((m) != 0)
#define vm_first(n) mcf_mask16_avx512(n)
#define vi_set1(x) _mm512_set1_epi32(x)
#define vi_zero() _mm512_setzero_si512()
#define vi_and(a, b) _mm512_and_si512(a, b)
#define vi_or(a, b) _mm512_or_si512(a, b)
#define vi_add(a, b) _mm512_add_epi32(a, b)
#define vi_sub(a, b) _mm512_sub_epi32(a, b)
#define vi_min(a, b) _mm512_min_epi32(a, b)
#define vi_max(a, b) _mm512_max_epi32(a, b)
#define vi_shl(a, n) _mm512_slli_epi32(a, n)
#define vi_shr(a, n) _mm512_srli_epi32(a, n)
#define vi_eq(a, b) _mm512_cmpeq_epi32_mask(a, b)
#define vi_gt(a, b) _mm512_cmpgt_epi32_mask(a, b)
#define vi_testz(a, b) _mm512_testn_epi32_mask(a, b)
#define vi_blend(a, b, m) _mm512_mask_mov_epi32(a, m, b)
#define vi_as_f(a) _mm512_castsi512_ps(a)
#define vf_as_i(x) _mm512_castps_si512(x)
#define vi_to_f(a) _mm512_cvtepi32_ps(a)
#define vf_to_h(x) _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vh_cvt(h) _mm512_cvtph_ps(h)
#define vh_widen(h) _mm512_cvtepu16_epi32(h)
#define vi_narrow16(a) _mm512_cvtepi32_epi16(a)
#define vh_storeu(p, h) _mm256_storeu_si256((__m256i *)(p), h)
#define vh_blend(a, b, m) _mm256_mask_blend_epi16(m, a, b)
#define vh_or(h, bits) _mm256_or_si256(h, _mm256_set1_epi16((short)(bits)))
#define vf_load_clip(p, q, nc, lo, hi) mcf_load_clip_avx512(p, q, nc, lo, hi)
#define vf_transpose(r) mcf_transpose_avx512(r)
#define vf_codes32(x, bits, dst) mcf_codes32_avx512(x, bits, dst)

#elif MCF_VEC_ISA == MCF_VEC_NEON
/* ---- NEON: 4 lanes, masks are all-ones / all-zeros uint32 lanes ------------------------------------------ */
#ifndef MCF_VEC_HAVE_NEON
#define MCF_VEC_HAVE_NEON 1
#define MCF_VEC_FIRST 1

/* x86's maxps / minps, lane by lane: FMAX / FMIN would return a NaN operand where these return b */
static inline float32x4_t mcf_max_neon(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline float32x4_t mcf_min_neon(float32x4_t a, float32x4_t b) { return vbslq_f32(vcltq_f32(a, b), a, b); }

static inline float32x4_t mcf_maskz_neon(uint32x4_t m, float32x4_t x)
{
    return vreinterpretq_f32_u32(vandq_u32(m, vreinterpretq_u32_f32(x)));
}

static inline float32x4_t mcf_neg_neon(float32x4_t x)
{
    return vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x80000000u)));
}

static inline float32x4_t mcf_maskz_div_neon(uint32x4_t m, float32x4_t a, float32x4_t b)
{
    return mcf_maskz_neon(m, vdivq_f32(a, vbslq_f32(m, b, vdupq_n_f32(1.0f))));
}

static inline uint32x4_t mcf_first_neon(size_t n)
{
    static const uint32_t idx[4] = {0, 1, 2, 3};
    return vcltq_u32(vld1q_u32(idx), vdupq_n_u32((uint32_t)n));
}

static inline float32x4_t mcf_load_clip_neon(const float *p, size_t q, size_t nc, float32x4_t lo, float32x4_t hi)
{
    float32x4_t x;
    if (4 * q + 4 <= nc) {
        x = vld1q_f32(p + 4 * q);
    } else {
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        memcpy(t, p + 4 * q, (nc - 4 * q) * sizeof(float));
        x = vld1q_f32(t);
    }
    x = vbslq_f32(vcltq_f32(x, lo), lo, x);
    x = vbslq_f32(vcgtq_f32(x, hi), hi, x);
    if (4 * q + 4 > nc) x = mcf_maskz_neon(mcf_first_neon(nc - 4 * q), x);   /* a clip above 0 raised them */
    return x;
}

static inline void mcf_transpose_neon(float32x4_t r[4])
{
    float32x4_t t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
    float32x4_t t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
    r[0] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[1] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
    r[2] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[3] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
}

static inline void mcf_codes32_neon(const float32x4_t x[8], int bits, uint8_t *dst)
{
    int32x4_t q[8];
    for (int k = 0; k < 8; k++) q[k] = vcvtq_s32_f32(x[k]);
    mcf_store_codes32_neon(q, bits, dst);
}
#endif

#define VW 4
#define VSFX(name) name##_neon
#define VTARGET
#define vf_t float32x4_t
#define vi_t uint32x4_t
#define vm_t uint32x4_t
#define vh_t uint16x4_t
#define vf_set1(x) vdupq_n_f32(x)
#define vf_zero() vdupq_n_f32(0.0f)
#define vf_load(p) vld1q_f32(p)
#define vf_store(p, v) vst1q_f32(p, v)
#define vf_storeu(p, v) vst1q_f32(p, v)
#define vf_add(a, b) vaddq_f32(a, b)
#define vf_sub(a, b) vsubq_f32(a, b)
#define vf_mul(a, b) vmulq_f32(a, b)
#define vf_div(a, b) vdivq_f32(a, b)
#define vf_max(a, b) mcf_max_neon(a, b)
#define vf_min(a, b) mcf_min_neon(a, b)
#define vf_abs(x) vabsq_f32(x)
#define vf_neg(x) mcf_neg_neon(x)
#define vf_rint(x) vrndnq_f32(x)
#define vf_floor(x) vrndmq_f32(x)
#define vf_trunc(x) vrndq_f32(x)
#define vf_gt(a, b) vcgtq_f32(a, b)
#define vf_ge(a, b) vcgeq_f32(a, b)
#define vf_lt(a, b) vcltq_f32(a, b)
#define vf_ne(a, b) vmvnq_u32(vceqq_f32(a, b))
#define vf_blend(a, b, m) vbslq_f32(m, b, a)
#define vf_maskz(m, x) mcf_maskz_neon(m, x)
#define vf_maskz_div(m, a, b) mcf_maskz_div_neon(m, a, b)
#define vm_and(a, b) vandq_u32(a, b)
#define vm_andnot(a, b) vbicq_u32(b, a)
#define vm_any(m) (vmaxvq_u32(m) != 0)
#define vm_first(n) mcf_first_neon(n)
#define vi_set1(x) vdupq_n_u32(x)
#define vi_zero() vdupq_n_u32(0)
#define vi_and(a, b) vandq_u32(a, b)
#define vi_or(a, b) vorrq_u32(a, b)
#define vi_add(a, b) vaddq_u32(a, b)
#define vi_sub(a, b) vsubq_u32(a, b)
#define vi_min(a, b) vreinterpretq_u32_s32(vminq_s32(vreinterpretq_s32_u32(a), vreinterpretq_s32_u32(b)))
#define vi_max(a, b) vreinterpretq_u32_s32(vmaxq_s32(vreinterpretq_s32_u32(a), vreinterpretq_s32_u32(b)))
#define vi_shl(a, n) vshlq_n_u32(a, n)
#define vi_shr(a, n) vshrq_n_u32(a, n)
#define vi_eq(a, b) vceqq_u32(a, b)
#define vi_gt(a, b) vcgtq_s32(vreinterpretq_s32_u32(a), vreinterpretq_s32_u32(b))
#define vi_testz(a, b) vceqzq_u32(vandq_u32(a, b))
#define vi_blend(a, b, m) vbslq_u32(m, b, a)
#define vi_as_f(a) vreinterpretq_f32_u32(a)
#define vf_as_i(x) vreinterpretq_u32_f32(x)
#define vi_to_f(a) vcvtq_f32_s32(vreinterpretq_s32_u32(a))
#define vf_to_h(x) vreinterpret_u16_f16(vcvt_f16_f32(x))
#define vh_cvt(h) vcvt_f32_f16(vreinterpret_f16_u16(h))
#define vh_widen(h) vmovl_u16(h)
#define vi_narrow16(a) vmovn_u32(a)
#define vh_storeu(p, h) vst1_u16(p, h)
#define vh_blend(a, b, m) vbsl_u16(vmovn_u32(m), b, a)
#define vh_or(h, bits) vorr_u16(h, vdup_n_u16(bits))
#define vf_load_clip(p, q, nc, lo, hi) mcf_load_clip_neon(p, q, nc, lo, hi)
#define vf_transpose(r) mcf_transpose_neon(r)
#define vf_codes32(x, bits, dst) mcf_codes32_neon(x, bits, dst)

#elif MCF_VEC_ISA != MCF_VEC_NONE
#error "MCF_VEC_ISA names no vector ISA this build has"
#endif

#ifdef MCF_VEC_FIRST
/* ---- helpers written once against the vocabulary: one copy per ISA, defined with its first mapping ----- */
#undef MCF_VEC_FIRST

/* float32 bits to bfloat16, round to nearest even, NaN kept with the quiet bit set: mcf_f32_to_bf16_one
 * (csrc/fpconv.c) lane by lane */
VTARGET static inline vh_t VSFX(mcf_bf16_round)(vi_t u)
{
    vi_t lsb = vi_and(vi_shr(u, 16), vi_set1(1));
    vi_t r = vi_shr(vi_add(vi_add(u, vi_set1(0x7fff)), lsb), 16);
    vi_t nanv = vi_or(vi_shr(u, 16), vi_set1(0x40));
    vm_t isnan = vi_gt(vi_and(u, vi_set1(0x7fffffff)), vi_set1(0x7f800000));
    return vi_narrow16(vi_blend(r, nanv, isnan));
}

/* binary16 to float32 exactly as mcf_f16_to_f32_one: the hardware widening is exact but may quiet a
 * signalling NaN (FCVTL does, and F16C), so NaN lanes are rebuilt with integer operations: the sign, the
 * all-ones exponent and the payload << 13 */
VTARGET static inline vf_t VSFX(mcf_h2f)(vh_t h)
{
    vf_t f = vh_cvt(h);
    vi_t u = vh_widen(h);
    vi_t e = vi_and(u, vi_set1(0x7c00)), m = vi_and(u, vi_set1(0x3ff));
    vm_t isnan = vm_andnot(vi_eq(m, vi_zero()), vi_eq(e, vi_set1(0x7c00)));
    vi_t nanv = vi_or(vi_or(vi_shl(vi_and(u, vi_set1(0x8000)), 16), vi_set1(0x7f800000)), vi_shl(m, 13));
    return vf_blend(f, vi_as_f(nanv), isnan);
}
#endif

#undef MCF_VEC_ISA
