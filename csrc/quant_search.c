/* The error-minimizing quantizer of the q and k methods (the default): scalar reference, AVX2, AVX-512 and
 * NEON (quant_search_neon.h) variants that write the same bytes.
 *
 * What it computes (docs/quantization.md, "How the default quantizer chooses scales", is the full
 * description; tests/reference.py implements it in numpy from there):
 *
 *  - codes use the whole two's-complement range qmin..qmax = -2^(bits-1)..2^(bits-1)-1, and scales have either
 *    sign: a positive scale gives the extra level -2^(bits-1) to a block's negative values, a negative scale to
 *    its positive ones (docs/mcf.md: every reader decodes the most negative code);
 *  - block search: for n candidate inverse scales (qmax + a_j) / max|v| (a_j = a0 + j*step, a table per bit
 *    width), each with both signs, round every value to the nearest code (clamped to qmin..qmax), take the
 *    least-squares scale of those codes, sum(w*v*L) / sum(w*L*L), and keep per sign the candidate with the
 *    largest sum(w*v*L)^2 / sum(w*L*L), i.e. the smallest weighted squared error;
 *  - q*: of three f16 scales, the single-pass quantizer's f16(max|v| / qmax), the mantle quantizer's (the same
 *    value truncated) and the search's (the better sign, magnitude kept normal and finite), store the first
 *    with the smallest error, evaluated with the scale the decoder will read;
 *  - k*: of the single-pass choice, the mantle choice and, per sign, the super scales f16(D*32/63) and
 *    f16(D*32/62) (D = the largest block optimum of that sign, so the sub-scales use the whole 6-bit range; every
 *    block takes the sub-scale floor or ceil of optimum*32/super whose error is smaller), store the first with
 *    the smallest total error;
 *  - codes: q = clamp(rint(v * (1 / scale)), qmin, qmax) for the scale the decoder computes.
 *  Errors are sum_i w_i * ((v_i - s*q_i) * (v_i - s*q_i)), float32, summed in index order from +0.
 *  Having the two single-pass quantizers among the candidates makes the result never worse than either of
 *  them, block by block (k*: super-block by super-block), with the same weights.
 *
 * Bit-identity by construction: the vector variants put one ROW in each lane (16 rows for AVX-512, 8 for
 * AVX2, 4 for NEON), all at the same block position, so every lane runs exactly the scalar sequence of IEEE float32
 * operations on its row's block, and a column's weight is the same in every lane (a broadcast).  Maxima and
 * minima are written `a > b ? a : b` / `a < b ? a : b` in the scalar code, which is what maxps / minps do
 * lane by lane (NaN included: the second operand); the build has -ffp-contract=off and nothing here uses FMA.
 *
 * Both signs of the block search share one product and one rounding per value: with r = rint(v * isc), the
 * codes of +isc are clamp(r, qmin, qmax) and those of -isc are -clamp(r, -qmax, qmax + 1) (rint is odd and
 * negation exact), so the sums of -isc are the negated sums of the clamped magnitudes, bit for bit (a sum that
 * comes out zero may differ in its sign, and then scores 0, which is never kept). */
#include <math.h>
#include <string.h>

#include "dispatch.h"
#include "fpconv.h"
#include "quant.h"
#include "simd.h"

#define MCF_SEARCH_MAX_CANDIDATES 8
#define MCF_SUPER_CANDIDATES 2
#define F16_MIN_NORMAL 0x0400u
#define F16_MAX_FINITE 0x7bffu
#define F16_SIGN 0x8000u

typedef struct {
    float a0, step;
    int n;
} search_grid;

/* The candidate table (tuned on all-MiniLM-L6-v2: 10-12 candidates gain 0.002-0.02 dB over these 8). */
static search_grid grid_for(int bits)
{
    switch (bits) {
    case 2: return (search_grid){0.0f, 0.25f, 8};
    case 3: return (search_grid){0.0f, 0.25f, 8};
    case 4: return (search_grid){-0.75f, 0.5f, 8};
    case 6: return (search_grid){-1.0f, 1.25f, 8};
    default: return (search_grid){-1.0f, 1.0f, 8};
    }
}

/* (qmax + a_j) for every candidate: exact in float32 (a few binary digits). */
static int grid_tops(int bits, float qf, float tops[MCF_SEARCH_MAX_CANDIDATES])
{
    search_grid g = grid_for(bits);
    for (int j = 0; j < g.n; j++) tops[j] = qf + (g.a0 + (float)j * g.step);
    return g.n;
}

/* f16 bits with the magnitude clamped to the normal finite range; the sign is kept */
static inline uint16_t clamp_h(uint16_t h)
{
    uint16_t m = (uint16_t)(h & 0x7fffu);
    m = m < F16_MIN_NORMAL ? (uint16_t)F16_MIN_NORMAL : (m > F16_MAX_FINITE ? (uint16_t)F16_MAX_FINITE : m);
    return (uint16_t)((h & F16_SIGN) | m);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Scalar reference: one block at a time. */

static inline float maxf_(float a, float b) { return a > b ? a : b; }
static inline float minf_(float a, float b) { return a < b ? a : b; }
static inline float clip_(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* the code of a scaled value: clamp to qn..qp, max first (a NaN product, 0 * inf, gives qn) */
static inline float code_(float x, float qn, float qp) { return minf_(maxf_(rintf(x), qn), qp); }

/* v[32] (clipped, padding 0), w[32] (padding 0); returns max |v|. */
static float load_block(const float *row, size_t c0, size_t cols, float lo, float hi, const float *weights,
                        float v[32], float w[32])
{
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) {
        size_t c = c0 + (size_t)i;
        v[i] = c < cols ? clip_(row[c], lo, hi) : 0.0f;
        w[i] = c < cols ? (weights ? weights[c] : 1.0f) : 0.0f;
        amax = maxf_(amax, fabsf(v[i]));
    }
    return amax;
}

static float err_scalar(const float v[32], const float w[32], float s, float qn, float qp)
{
    float inv = s != 0.0f ? 1.0f / s : 0.0f, e = 0.0f;
    for (int i = 0; i < 32; i++) {
        float q = code_(v[i] * inv, qn, qp);
        float r = v[i] - s * q;
        e = e + w[i] * (r * r);
    }
    return e;
}

/* The block optimum of each sign: d[0] > 0 with score b[0], d[1] < 0 with score b[1] (+-amax/qmax and 0 when
 * no candidate of that sign scores above 0). */
typedef struct {
    float d[2], b[2];
} block_opt;

static block_opt search_scalar(const float v[32], const float w[32], float amax, float qn, float qp,
                               const float *tops, int n)
{
    block_opt o = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    if (!(amax > 0.0f)) return o;
    float base = amax / qp, wv[32];
    o.d[0] = base;
    o.d[1] = -base;
    for (int i = 0; i < 32; i++) wv[i] = w[i] * v[i];
    for (int j = 0; j < n; j++) {
        float isc = tops[j] / amax, sxp = 0.0f, s2p = 0.0f, sxm = 0.0f, s2m = 0.0f;
        for (int i = 0; i < 32; i++) {
            float r = rintf(v[i] * isc);
            float lp = minf_(maxf_(r, qn), qp);            /* codes of +isc */
            float lm = maxf_(minf_(r, -qn), -qp);          /* minus the codes of -isc (NaN: -qn, as qn above) */
            sxp = sxp + wv[i] * lp;
            s2p = s2p + (w[i] * lp) * lp;
            sxm = sxm + wv[i] * lm;
            s2m = s2m + (w[i] * lm) * lm;
        }
        if (s2p > 0.0f) {
            float score = (sxp * sxp) / s2p;
            if (score > o.b[0]) {
                o.b[0] = score;
                o.d[0] = sxp / s2p;
            }
        }
        if (s2m > 0.0f) {
            float score = (sxm * sxm) / s2m;
            if (score > o.b[1]) {
                o.b[1] = score;
                o.d[1] = -(sxm / s2m);
            }
        }
    }
    return o;
}

static void codes_scalar_rne(const float v[32], float s, float qn, float qp, int bits, uint8_t *dst)
{
    float inv = s != 0.0f ? 1.0f / s : 0.0f;
    int32_t q[32];
    for (int i = 0; i < 32; i++) q[i] = (int32_t)code_(v[i] * inv, qn, qp);
    mcf_pack_block(q, bits, dst);
}

/* u6 of the single-pass quantizers: round_half_away(base / super * 32) clamped to 1..63 (base, super > 0). */
static inline float u6_single_pass(float base, float super)
{
    float t = (base / super) * 32.0f, tt = truncf(t);
    tt = (t - tt >= 0.5f) ? tt + 1.0f : tt;
    return minf_(maxf_(tt, 1.0f), 63.0f);
}

static int row_block_scalar(int bits, const float *row, size_t cols, size_t bpr, float lo, float hi,
                            const float *weights, uint16_t *scales, uint8_t *codes)
{
    const float qp = (float)((1 << (bits - 1)) - 1), qn = -qp - 1.0f;
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qp, tops), overflow = 0;
    size_t bb = (size_t)bits * 4;
    for (size_t b = 0; b < bpr; b++) {
        float v[32], w[32];
        float amax = load_block(row, b * 32, cols, lo, hi, weights, v, w);
        float base = amax > 0.0f ? amax / qp : 0.0f;
        uint16_t cand[3];
        cand[0] = mcf_f32_to_f16_one(base);          /* the single-pass quantizer's scale */
        if ((cand[0] & 0x7c00u) == 0x7c00u) overflow = 1;
        cand[1] = mcf_f32_to_f16_trunc(base);        /* mantle's */
        block_opt o = search_scalar(v, w, amax, qn, qp, tops, n);
        cand[2] = clamp_h(mcf_f32_to_f16_one(o.b[0] >= o.b[1] ? o.d[0] : o.d[1]));
        uint16_t h = cand[0];
        float e = err_scalar(v, w, mcf_scale_from_f16(h), qn, qp);
        for (int c = 1; c < 3; c++) {
            float ec = err_scalar(v, w, mcf_scale_from_f16(cand[c]), qn, qp);
            if (ec < e) {
                e = ec;
                h = cand[c];
            }
        }
        scales[b] = h;
        codes_scalar_rne(v, mcf_scale_from_f16(h), qn, qp, bits, codes + b * bb);
    }
    return overflow;
}

static int row_super_scalar(int bits, const float *row, size_t cols, size_t bpr, size_t spr, float lo, float hi,
                            const float *weights, uint16_t *supers, uint8_t *sub, uint8_t *codes)
{
    const float qp = (float)((1 << (bits - 1)) - 1), qn = -qp - 1.0f;
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qp, tops), overflow = 0;
    size_t bb = (size_t)bits * 4;
    for (size_t s = 0; s < spr; s++) {
        float v[8][32], w[8][32], amax[8], base[8], mag[2][8], u[8], uc[8];
        int nb = (int)(bpr - s * 8 < 8 ? bpr - s * 8 : 8);
        float M = 0.0f, D[2] = {0.0f, 0.0f};
        for (int k = 0; k < nb; k++) {
            amax[k] = load_block(row, (s * 8 + (size_t)k) * 32, cols, lo, hi, weights, v[k], w[k]);
            base[k] = amax[k] > 0.0f ? amax[k] / qp : 0.0f;
            block_opt o = search_scalar(v[k], w[k], amax[k], qn, qp, tops, n);
            mag[0][k] = o.d[0];
            mag[1][k] = -o.d[1];
            M = maxf_(M, base[k]);
            D[0] = maxf_(D[0], mag[0][k]);
            D[1] = maxf_(D[1], mag[1][k]);
        }
        /* 1. the single-pass choice */
        uint16_t H = mcf_f32_to_f16_one(M);
        if ((H & 0x7c00u) == 0x7c00u) overflow = 1;
        float S = mcf_scale_from_f16(H), E = 0.0f;
        for (int k = 0; k < nb; k++) {
            u[k] = (base[k] > 0.0f && S > 0.0f) ? u6_single_pass(base[k], S) : 0.0f;
            E = E + err_scalar(v[k], w[k], u[k] > 0.0f ? S * (u[k] / 32.0f) : 0.0f, qn, qp);
        }
        /* 2. mantle's: the truncated super scale, sub-scales from the unrounded one */
        {
            uint16_t Hc = mcf_f32_to_f16_trunc(M);
            float Sc = mcf_scale_from_f16(Hc), T = 0.0f;
            for (int k = 0; k < nb; k++) {
                uc[k] = base[k] > 0.0f ? u6_single_pass(base[k], M) : 0.0f;
                T = T + err_scalar(v[k], w[k], uc[k] > 0.0f ? Sc * (uc[k] / 32.0f) : 0.0f, qn, qp);
            }
            if (T < E) {
                E = T;
                H = Hc;
                memcpy(u, uc, sizeof u);
            }
        }
        /* 3. the searched choices: per sign, the super scales that give the largest block optimum u6 = 63, 62 */
        for (int sg = 0; sg < 2; sg++) {
            if (!(D[sg] > 0.0f)) continue;
            for (int c = 0; c < MCF_SUPER_CANDIDATES; c++) {
                uint16_t Hc = clamp_h(mcf_f32_to_f16_one((D[sg] * 32.0f) / (float)(63 - c)));
                float Sc = mcf_scale_from_f16(Hc), T = 0.0f;
                for (int k = 0; k < nb; k++) {
                    uc[k] = 0.0f;
                    if (!(amax[k] > 0.0f)) continue;
                    float f = floorf((mag[sg][k] * 32.0f) / Sc);
                    float ua = minf_(maxf_(f, 1.0f), 63.0f), ub = minf_(maxf_(f + 1.0f, 1.0f), 63.0f);
                    float sa = Sc * (ua / 32.0f), sb = Sc * (ub / 32.0f);
                    float ea = err_scalar(v[k], w[k], sg ? -sa : sa, qn, qp);
                    float eb = err_scalar(v[k], w[k], sg ? -sb : sb, qn, qp);
                    uc[k] = eb < ea ? ub : ua;
                    T = T + (eb < ea ? eb : ea);
                }
                if (T < E) {
                    E = T;
                    H = (uint16_t)(Hc | (sg ? F16_SIGN : 0u));
                    memcpy(u, uc, sizeof u);
                }
            }
        }
        supers[s] = H;
        S = mcf_scale_from_f16(H);
        for (int k = 0; k < nb; k++) {
            size_t b = s * 8 + (size_t)k;
            sub[b] = (uint8_t)u[k];
            codes_scalar_rne(v[k], u[k] > 0.0f ? S * (u[k] / 32.0f) : 0.0f, qn, qp, bits, codes + b * bb);
        }
    }
    return overflow;
}

/* the weights of a block of the vector variants (padding 0) */
static void weights_of(const float *weights, size_t c0, size_t nc, float w[32])
{
    for (size_t i = 0; i < 32; i++) w[i] = i < nc ? (weights ? weights[c0 + i] : 1.0f) : 0.0f;
}

#if defined(__x86_64__)
#include <immintrin.h>

/* ---------------------------------------------------------------------------------------------------------------
 * AVX2: 8 rows per call, lane l = row r0 + l.  A block's 8 x 32 values are loaded row by row and transposed in
 * registers, so that V[i*8 + l] = value i of row l. */

MCF_TARGET_AVX2 static inline __m256 dec_ph8(__m128i h)
{
    __m128i sub = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7c00)), _mm_setzero_si128());
    return _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cvtepi16_epi32(sub)), _mm256_cvtph_ps(h));
}

MCF_TARGET_AVX2 static inline __m128i f16_8(__m256 x)
{
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* the magnitude clamped to the normal finite range, the sign kept */
MCF_TARGET_AVX2 static inline __m128i clamp_h8(__m128i h)
{
    __m128i m = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
    m = _mm_min_epu16(_mm_max_epu16(m, _mm_set1_epi16((short)F16_MIN_NORMAL)), _mm_set1_epi16((short)F16_MAX_FINITE));
    return _mm_or_si128(m, _mm_and_si128(h, _mm_set1_epi16((short)F16_SIGN)));
}

/* mcf_f32_to_f16_trunc of finite values >= 0: the mantissa truncated, below 2^-14 zero, from 65536 infinity */
MCF_TARGET_AVX2 static inline __m128i trunc_h8(__m256 x)
{
    __m256i u = _mm256_castps_si256(x), e = _mm256_srli_epi32(u, 23);
    __m256i h = _mm256_or_si256(_mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(112)), 10),
                                _mm256_and_si256(_mm256_srli_epi32(u, 13), _mm256_set1_epi32(0x3ff)));
    h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7c00), _mm256_cmpgt_epi32(e, _mm256_set1_epi32(142)));
    h = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(113), e), h);
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

MCF_TARGET_AVX2 static inline __m256 rne8(__m256 x)
{
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* a 32-bit lane mask as a 16-bit lane mask (for blending f16 values) */
MCF_TARGET_AVX2 static inline __m128i mask16_of(__m256 m)
{
    __m256i i = _mm256_castps_si256(m);
    return _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
}

/* 1 / s where s != 0, else 0 */
MCF_TARGET_AVX2 static inline __m256 inv8(__m256 s)
{
    __m256 nz = _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    return _mm256_and_ps(nz, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_blendv_ps(_mm256_set1_ps(1.0f), s, nz)));
}

/* u6_single_pass per lane where ok (else 0) */
MCF_TARGET_AVX2 static inline __m256 u6_8(__m256 base, __m256 super, __m256 ok)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 t = _mm256_mul_ps(_mm256_and_ps(ok, _mm256_div_ps(base, _mm256_blendv_ps(one, super, ok))),
                             _mm256_set1_ps(32.0f));
    __m256 tt = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 up = _mm256_cmp_ps(_mm256_sub_ps(t, tt), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    tt = _mm256_add_ps(tt, _mm256_and_ps(up, one));
    return _mm256_and_ps(ok, _mm256_min_ps(_mm256_max_ps(tt, one), _mm256_set1_ps(63.0f)));
}

MCF_TARGET_AVX2 static inline void transpose8(__m256 r[8])
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

/* Block (c0, nc columns) of rows 0..nl-1 (stride cols) into V[32][8], the clipped values (padding and idle
 * lanes 0).  Returns max |value| per lane. */
MCF_TARGET_AVX2 static __m256 load_t8(const float *src, size_t cols, size_t nl, size_t c0, size_t nc,
                                      float lo, float hi, float *V)
{
    __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps(), r[8];
    for (int q = 0; q < 4; q++) {
        __m256i ix = _mm256_add_epi32(_mm256_set1_epi32(8 * q), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nc), ix);
        for (size_t l = 0; l < 8; l++) {
            __m256 x = _mm256_setzero_ps();
            if (l < nl && (size_t)(8 * q) < nc) {
                x = _mm256_maskload_ps(src + l * cols + c0 + 8 * q, m);
                x = _mm256_blendv_ps(x, vlo, _mm256_cmp_ps(x, vlo, _CMP_LT_OQ));
                x = _mm256_blendv_ps(x, vhi, _mm256_cmp_ps(x, vhi, _CMP_GT_OQ));
                x = _mm256_and_ps(x, _mm256_castsi256_ps(m));
            }
            r[l] = x;
        }
        transpose8(r);
        for (int i = 0; i < 8; i++) {
            _mm256_store_ps(V + 8 * (8 * q + i), r[i]);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, r[i]));
        }
    }
    return amax;
}

/* The errors of the vector variants.  `unit`: every weight of the block(s) is 1 (no importance, a full block),
 * and the products by the weight are left out: w * x == x exactly when w == 1, so the sums are the same. */
MCF_TARGET_AVX2 static __m256 err1_8(const float *V, const float *w, int unit, __m256 s, float qn, float qp)
{
    __m256 vn = _mm256_set1_ps(qn), vp = _mm256_set1_ps(qp), iv = inv8(s), a = _mm256_setzero_ps();
    for (int i = 0; i < 32; i++) {
        __m256 x = _mm256_load_ps(V + 8 * i);
        __m256 q = _mm256_min_ps(_mm256_max_ps(rne8(_mm256_mul_ps(x, iv)), vn), vp);
        __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(s, q)), r2 = _mm256_mul_ps(r, r);
        a = _mm256_add_ps(a, unit ? r2 : _mm256_mul_ps(_mm256_set1_ps(w[i]), r2));
    }
    return a;
}

/* errors of block V0 at scale s0 and block V1 at scale s1, in one pass */
MCF_TARGET_AVX2 static void err2_8(const float *V0, const float *w0, __m256 s0, const float *V1,
                                   const float *w1, __m256 s1, int unit, float qn, float qp, __m256 *e0, __m256 *e1)
{
    __m256 vn = _mm256_set1_ps(qn), vp = _mm256_set1_ps(qp), i0 = inv8(s0), i1 = inv8(s1);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int i = 0; i < 32; i++) {
        __m256 x0 = _mm256_load_ps(V0 + 8 * i), x1 = _mm256_load_ps(V1 + 8 * i);
        __m256 q0 = _mm256_min_ps(_mm256_max_ps(rne8(_mm256_mul_ps(x0, i0)), vn), vp);
        __m256 q1 = _mm256_min_ps(_mm256_max_ps(rne8(_mm256_mul_ps(x1, i1)), vn), vp);
        __m256 r0 = _mm256_sub_ps(x0, _mm256_mul_ps(s0, q0)), r1 = _mm256_sub_ps(x1, _mm256_mul_ps(s1, q1));
        __m256 p0 = _mm256_mul_ps(r0, r0), p1 = _mm256_mul_ps(r1, r1);
        a0 = _mm256_add_ps(a0, unit ? p0 : _mm256_mul_ps(_mm256_set1_ps(w0[i]), p0));
        a1 = _mm256_add_ps(a1, unit ? p1 : _mm256_mul_ps(_mm256_set1_ps(w1[i]), p1));
    }
    *e0 = a0;
    *e1 = a1;
}

/* one sign's running best: keep (score, slx / sl2) where the score is larger */
MCF_TARGET_AVX2 static inline void keep8(__m256 slx, __m256 sl2, __m256 live, int neg, __m256 *best, __m256 *d)
{
    __m256 pos = _mm256_cmp_ps(sl2, _mm256_setzero_ps(), _CMP_GT_OQ);
    __m256 den = _mm256_blendv_ps(_mm256_set1_ps(1.0f), sl2, pos);
    __m256 score = _mm256_div_ps(_mm256_mul_ps(slx, slx), den);
    __m256 better = _mm256_and_ps(_mm256_and_ps(pos, live), _mm256_cmp_ps(score, *best, _CMP_GT_OQ));
    __m256 q = _mm256_div_ps(slx, den);
    if (neg) q = _mm256_xor_ps(q, _mm256_set1_ps(-0.0f));
    *best = _mm256_blendv_ps(*best, score, better);
    *d = _mm256_blendv_ps(*d, q, better);
}

/* One candidate of search_scalar, both signs, for 8 rows: the sums of x * L and (w * L) * L.  Inlined into
 * search8 once with unit = 1 (no weight products) and once with unit = 0. */
MCF_TARGET_AVX2 static inline __attribute__((always_inline)) void sums8(const float *V, const float *wv,
                                                                        const float *w, const int unit, __m256 is,
                                                                        float qn, float qp, __m256 acc[4])
{
    const __m256 vn = _mm256_set1_ps(qn), vp = _mm256_set1_ps(qp), vmn = _mm256_set1_ps(-qn), vmp = _mm256_set1_ps(-qp);
    __m256 xp = acc[0], yp = acc[1], xm = acc[2], ym = acc[3];
    for (int i = 0; i < 32; i++) {
        __m256 x = _mm256_load_ps(V + 8 * i), wx = unit ? x : _mm256_load_ps(wv + 8 * i);
        __m256 r = rne8(_mm256_mul_ps(x, is));
        __m256 lp = _mm256_min_ps(_mm256_max_ps(r, vn), vp);
        __m256 lm = _mm256_max_ps(_mm256_min_ps(r, vmn), vmp);
        xp = _mm256_add_ps(xp, _mm256_mul_ps(wx, lp));
        xm = _mm256_add_ps(xm, _mm256_mul_ps(wx, lm));
        if (unit) {
            yp = _mm256_add_ps(yp, _mm256_mul_ps(lp, lp));
            ym = _mm256_add_ps(ym, _mm256_mul_ps(lm, lm));
        } else {
            __m256 wi = _mm256_set1_ps(w[i]);
            yp = _mm256_add_ps(yp, _mm256_mul_ps(_mm256_mul_ps(wi, lp), lp));
            ym = _mm256_add_ps(ym, _mm256_mul_ps(_mm256_mul_ps(wi, lm), lm));
        }
    }
    acc[0] = xp;
    acc[1] = yp;
    acc[2] = xm;
    acc[3] = ym;
}

/* The block search of search_scalar, 8 rows at once: dp/bp the positive optimum and its score, dn/bn the
 * negative one. */
MCF_TARGET_AVX2 static void search8(const float *V, const float *w, int unit, __m256 amax, float qn, float qp,
                                    const float *tops, int n, __m256 *dp, __m256 *bp, __m256 *dn, __m256 *bn)
{
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    __m256 live = _mm256_cmp_ps(amax, zero, _CMP_GT_OQ);
    __m256 safe = _mm256_blendv_ps(one, amax, live);
    __m256 base = _mm256_and_ps(live, _mm256_div_ps(safe, _mm256_set1_ps(qp)));
    __m256 d0 = base, d1 = _mm256_xor_ps(base, _mm256_set1_ps(-0.0f)), b0 = zero, b1 = zero;
    float wv[32 * 8] __attribute__((aligned(32)));
    if (!unit)
        for (int i = 0; i < 32; i++)
            _mm256_store_ps(wv + 8 * i, _mm256_mul_ps(_mm256_set1_ps(w[i]), _mm256_load_ps(V + 8 * i)));
    for (int j = 0; j < n; j++) {
        __m256 is = _mm256_div_ps(_mm256_set1_ps(tops[j]), safe), acc[4] = {zero, zero, zero, zero};
        if (unit)
            sums8(V, wv, w, 1, is, qn, qp, acc);
        else
            sums8(V, wv, w, 0, is, qn, qp, acc);
        keep8(acc[0], acc[1], live, 0, &b0, &d0);
        keep8(acc[2], acc[3], live, 1, &b1, &d1);
    }
    *dp = d0;
    *bp = b0;
    *dn = d1;
    *bn = b1;
}

MCF_TARGET_AVX2 static void codes_row8(const float *row, size_t c0, size_t nc, float lo, float hi,
                                       float inv, float qn, float qp, int bits, uint8_t *dst)
{
    __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), vi = _mm256_set1_ps(inv);
    __m256 vp = _mm256_set1_ps(qp), vn = _mm256_set1_ps(qn);
    __m256i q[4];
    for (int k = 0; k < 4; k++) {
        __m256i ix = _mm256_add_epi32(_mm256_set1_epi32(8 * k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nc), ix);
        __m256 x = _mm256_maskload_ps(row + c0 + 8 * k, m);
        x = _mm256_blendv_ps(x, vlo, _mm256_cmp_ps(x, vlo, _CMP_LT_OQ));
        x = _mm256_blendv_ps(x, vhi, _mm256_cmp_ps(x, vhi, _CMP_GT_OQ));
        x = _mm256_and_ps(x, _mm256_castsi256_ps(m));
        q[k] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(rne8(_mm256_mul_ps(x, vi)), vn), vp));
    }
    mcf_store_codes32_avx2(q, bits, dst);
}

/* any active lane whose f16 value is infinite */
MCF_TARGET_AVX2 static inline int overflow8(__m128i h, __m256 act)
{
    __m128i inf = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7c00)), _mm_set1_epi16(0x7c00));
    return _mm_movemask_epi8(_mm_and_si128(inf, mask16_of(act))) != 0;
}

MCF_TARGET_AVX2 static int group_block_avx2(int bits, const float *src, size_t cols, size_t bpr, size_t nl,
                                            float lo, float hi, const float *weights, uint16_t *scales,
                                            uint8_t *codes)
{
    const float qp = (float)((1 << (bits - 1)) - 1), qn = -qp - 1.0f;
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qp, tops), overflow = 0;
    __m256 act = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)nl), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    float V[32 * 8] __attribute__((aligned(32))), w[32], inv[8];
    uint16_t hs[8];
    size_t bb = (size_t)bits * 4;
    for (size_t b = 0; b < bpr; b++) {
        size_t c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
        weights_of(weights, c0, nc, w);
        int unit = !weights && nc == 32;
        __m256 amax = load_t8(src, cols, nl, c0, nc, lo, hi, V);
        __m256 live = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ);
        __m256 base = _mm256_and_ps(live, _mm256_div_ps(amax, _mm256_set1_ps(qp)));
        __m128i h = f16_8(base), hm = trunc_h8(base);
        overflow |= overflow8(h, act);
        __m256 dp, bp, dn, bn, e, em;
        search8(V, w, unit, amax, qn, qp, tops, n, &dp, &bp, &dn, &bn);
        __m128i hsr = clamp_h8(f16_8(_mm256_blendv_ps(dn, dp, _mm256_cmp_ps(bp, bn, _CMP_GE_OQ))));
        err2_8(V, w, dec_ph8(h), V, w, dec_ph8(hm), unit, qn, qp, &e, &em);
        __m256 take = _mm256_cmp_ps(em, e, _CMP_LT_OQ);
        h = _mm_blendv_epi8(h, hm, mask16_of(take));
        e = _mm256_blendv_ps(e, em, take);
        take = _mm256_cmp_ps(err1_8(V, w, unit, dec_ph8(hsr), qn, qp), e, _CMP_LT_OQ);
        h = _mm_blendv_epi8(h, hsr, mask16_of(take));
        _mm_storeu_si128((__m128i *)hs, h);
        _mm256_storeu_ps(inv, inv8(dec_ph8(h)));
        for (size_t l = 0; l < nl; l++) {
            scales[l * bpr + b] = hs[l];
            codes_row8(src + l * cols, c0, nc, lo, hi, inv[l], qn, qp, bits, codes + (l * bpr + b) * bb);
        }
    }
    return overflow;
}

/* the total error of a super-block's nb blocks at the scales sc[k], summed in block order */
MCF_TARGET_AVX2 static __m256 total8(const float (*V)[32 * 8], const float (*w)[32], const int *unit,
                                     const __m256 *sc, int nb, float qn, float qp)
{
    __m256 e[8], T = _mm256_setzero_ps();
    for (int k = 0; k < nb; k += 2) {  /* two blocks per pass */
        int k1 = k + 1 < nb ? k + 1 : k;
        err2_8(V[k], w[k], sc[k], V[k1], w[k1], sc[k1], unit[k] && unit[k1], qn, qp, &e[k], &e[k1]);
    }
    for (int k = 0; k < nb; k++) T = _mm256_add_ps(T, e[k]);
    return T;
}

MCF_TARGET_AVX2 static int group_super_avx2(int bits, const float *src, size_t cols, size_t bpr, size_t spr,
                                            size_t nl, float lo, float hi, const float *weights,
                                            uint16_t *supers, uint8_t *sub, uint8_t *codes)
{
    const float qp = (float)((1 << (bits - 1)) - 1), qn = -qp - 1.0f;
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qp, tops), overflow = 0;
    __m256 act = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)nl), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    float V[8][32 * 8] __attribute__((aligned(32))), w[8][32], uu[8], inv[8];
    uint16_t hs[8];
    const __m256 zero = _mm256_setzero_ps(), c32 = _mm256_set1_ps(32.0f), one = _mm256_set1_ps(1.0f);
    const __m256 c63 = _mm256_set1_ps(63.0f), vp = _mm256_set1_ps(qp), neg0 = _mm256_set1_ps(-0.0f);
    size_t bb = (size_t)bits * 4;
    for (size_t s = 0; s < spr; s++) {
        int nb = (int)(bpr - s * 8 < 8 ? bpr - s * 8 : 8);
        __m256 amax[8], base[8], mag[2][8], u[8], uc[8], sc[8], M = zero, D[2] = {zero, zero};
        int unit[8];
        for (int k = 0; k < nb; k++) {
            size_t c0 = (s * 8 + (size_t)k) * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            weights_of(weights, c0, nc, w[k]);
            unit[k] = !weights && nc == 32;
            amax[k] = load_t8(src, cols, nl, c0, nc, lo, hi, V[k]);
            __m256 live = _mm256_cmp_ps(amax[k], zero, _CMP_GT_OQ);
            base[k] = _mm256_and_ps(live, _mm256_div_ps(amax[k], vp));
            __m256 bp, dn, bn;
            search8(V[k], w[k], unit[k], amax[k], qn, qp, tops, n, &mag[0][k], &bp, &dn, &bn);
            mag[1][k] = _mm256_xor_ps(dn, neg0);
            M = _mm256_max_ps(M, base[k]);
            D[0] = _mm256_max_ps(D[0], mag[0][k]);
            D[1] = _mm256_max_ps(D[1], mag[1][k]);
        }
        /* 1. the single-pass choice */
        __m128i H = f16_8(M);
        overflow |= overflow8(H, act);
        __m256 S = dec_ph8(H), spos = _mm256_cmp_ps(S, zero, _CMP_GT_OQ);
        for (int k = 0; k < nb; k++) {
            u[k] = u6_8(base[k], S, _mm256_and_ps(_mm256_cmp_ps(base[k], zero, _CMP_GT_OQ), spos));
            sc[k] = _mm256_and_ps(_mm256_cmp_ps(u[k], zero, _CMP_GT_OQ), _mm256_mul_ps(S, _mm256_div_ps(u[k], c32)));
        }
        __m256 E = total8((const float(*)[32 * 8])V, (const float(*)[32])w, unit, sc, nb, qn, qp);
        /* 2. mantle's */
        {
            __m128i Hc = trunc_h8(M);
            __m256 Sc = dec_ph8(Hc);
            for (int k = 0; k < nb; k++) {
                uc[k] = u6_8(base[k], M, _mm256_cmp_ps(base[k], zero, _CMP_GT_OQ));
                sc[k] = _mm256_and_ps(_mm256_cmp_ps(uc[k], zero, _CMP_GT_OQ), _mm256_mul_ps(Sc, _mm256_div_ps(uc[k], c32)));
            }
            __m256 T = total8((const float(*)[32 * 8])V, (const float(*)[32])w, unit, sc, nb, qn, qp);
            __m256 take = _mm256_cmp_ps(T, E, _CMP_LT_OQ);
            E = _mm256_blendv_ps(E, T, take);
            H = _mm_blendv_epi8(H, Hc, mask16_of(take));
            for (int k = 0; k < nb; k++) u[k] = _mm256_blendv_ps(u[k], uc[k], take);
        }
        /* 3. the searched choices */
        for (int sg = 0; sg < 2; sg++) {
            __m256 anyd = _mm256_and_ps(_mm256_cmp_ps(D[sg], zero, _CMP_GT_OQ), act);
            if (!_mm256_movemask_ps(anyd)) continue;
            __m256 flip = sg ? neg0 : zero;
            for (int c = 0; c < MCF_SUPER_CANDIDATES; c++) {
                __m128i hc = clamp_h8(f16_8(_mm256_div_ps(_mm256_mul_ps(D[sg], c32), _mm256_set1_ps((float)(63 - c)))));
                __m256 Sc = dec_ph8(hc), T = zero;
                for (int k = 0; k < nb; k++) {
                    __m256 live = _mm256_cmp_ps(amax[k], zero, _CMP_GT_OQ);
                    __m256 f = _mm256_round_ps(_mm256_div_ps(_mm256_mul_ps(mag[sg][k], c32), Sc),
                                               _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
                    __m256 ua = _mm256_min_ps(_mm256_max_ps(f, one), c63);
                    __m256 ub = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(f, one), one), c63);
                    __m256 ea, eb;
                    err2_8(V[k], w[k], _mm256_xor_ps(_mm256_mul_ps(Sc, _mm256_div_ps(ua, c32)), flip), V[k], w[k],
                           _mm256_xor_ps(_mm256_mul_ps(Sc, _mm256_div_ps(ub, c32)), flip), unit[k], qn, qp, &ea, &eb);
                    __m256 pb = _mm256_cmp_ps(eb, ea, _CMP_LT_OQ);
                    uc[k] = _mm256_and_ps(live, _mm256_blendv_ps(ua, ub, pb));
                    T = _mm256_add_ps(T, _mm256_and_ps(live, _mm256_blendv_ps(ea, eb, pb)));
                }
                __m256 take = _mm256_and_ps(anyd, _mm256_cmp_ps(T, E, _CMP_LT_OQ));
                E = _mm256_blendv_ps(E, T, take);
                if (sg) hc = _mm_or_si128(hc, _mm_set1_epi16((short)F16_SIGN));
                H = _mm_blendv_epi8(H, hc, mask16_of(take));
                for (int k = 0; k < nb; k++) u[k] = _mm256_blendv_ps(u[k], uc[k], take);
            }
        }
        _mm_storeu_si128((__m128i *)hs, H);
        S = dec_ph8(H);
        for (size_t l = 0; l < nl; l++) supers[l * spr + s] = hs[l];
        for (int k = 0; k < nb; k++) {
            size_t b = s * 8 + (size_t)k, c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            __m256 upos = _mm256_cmp_ps(u[k], zero, _CMP_GT_OQ);
            _mm256_storeu_ps(uu, u[k]);
            _mm256_storeu_ps(inv, inv8(_mm256_and_ps(upos, _mm256_mul_ps(S, _mm256_div_ps(u[k], c32)))));
            for (size_t l = 0; l < nl; l++) {
                sub[l * bpr + b] = (uint8_t)uu[l];
                codes_row8(src + l * cols, c0, nc, lo, hi, inv[l], qn, qp, bits, codes + (l * bpr + b) * bb);
            }
        }
    }
    return overflow;
}

/* ---------------------------------------------------------------------------------------------------------------
 * AVX-512: 16 rows per call, lane l = row r0 + l; the same steps with 16-lane vectors and mask registers. */

MCF_TARGET_AVX512 static inline __m512 dec_ph16(__m256i h)
{
    __mmask16 normal = _mm256_test_epi16_mask(h, _mm256_set1_epi16(0x7c00));
    return _mm512_maskz_mov_ps(normal, _mm512_cvtph_ps(h));  /* exponent 0 (zero, subnormal) -> 0 */
}

MCF_TARGET_AVX512 static inline __m256i f16_16(__m512 x)
{
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* the magnitude clamped to the normal finite range, the sign kept */
MCF_TARGET_AVX512 static inline __m256i clamp_h16(__m256i h)
{
    __m256i m = _mm256_and_si256(h, _mm256_set1_epi16(0x7fff));
    m = _mm256_min_epu16(_mm256_max_epu16(m, _mm256_set1_epi16((short)F16_MIN_NORMAL)),
                         _mm256_set1_epi16((short)F16_MAX_FINITE));
    return _mm256_or_si256(m, _mm256_and_si256(h, _mm256_set1_epi16((short)F16_SIGN)));
}

/* mcf_f32_to_f16_trunc of finite values >= 0 (trunc_h8) */
MCF_TARGET_AVX512 static inline __m256i trunc_h16(__m512 x)
{
    __m512i u = _mm512_castps_si512(x), e = _mm512_srli_epi32(u, 23);
    __m512i h = _mm512_or_si512(_mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(112)), 10),
                                _mm512_and_si512(_mm512_srli_epi32(u, 13), _mm512_set1_epi32(0x3ff)));
    h = _mm512_mask_mov_epi32(h, _mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(142)), _mm512_set1_epi32(0x7c00));
    h = _mm512_maskz_mov_epi32(_mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(112)), h);
    return _mm512_cvtepi32_epi16(h);
}

MCF_TARGET_AVX512 static inline __m512 rne16(__m512 x)
{
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

MCF_TARGET_AVX512 static inline __m512 inv16(__m512 s)
{
    return _mm512_maskz_div_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.0f), s);
}

/* u6_single_pass per lane where ok (else 0) */
MCF_TARGET_AVX512 static inline __m512 u6_16(__m512 base, __m512 super, __mmask16 ok)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 t = _mm512_mul_ps(_mm512_maskz_div_ps(ok, base, super), _mm512_set1_ps(32.0f));
    __m512 tt = _mm512_roundscale_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(t, tt), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    tt = _mm512_mask_add_ps(tt, up, tt, one);
    return _mm512_maskz_mov_ps(ok, _mm512_min_ps(_mm512_max_ps(tt, one), _mm512_set1_ps(63.0f)));
}

MCF_TARGET_AVX512 static inline void transpose16(__m512 r[16])
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

/* Block (c0, nc columns) of rows 0..nl-1 into V[32][16], the clipped values (padding and idle lanes 0);
 * returns max |value| per lane. */
MCF_TARGET_AVX512 static __m512 load_t16(const float *src, size_t cols, size_t nl, size_t c0, size_t nc,
                                         float lo, float hi, float *V)
{
    __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi), amax = _mm512_setzero_ps(), r[16];
    for (int h = 0; h < 2; h++) {
        size_t hc = nc > (size_t)(16 * h) ? nc - (size_t)(16 * h) : 0;
        __mmask16 m = hc >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << hc) - 1u);
        for (size_t l = 0; l < 16; l++) {
            __m512 x = _mm512_setzero_ps();
            if (l < nl && m) {
                x = _mm512_maskz_loadu_ps(m, src + l * cols + c0 + 16 * h);
                x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vlo, _CMP_LT_OQ), x, vlo);
                x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vhi, _CMP_GT_OQ), x, vhi);
                x = _mm512_maskz_mov_ps(m, x);
            }
            r[l] = x;
        }
        transpose16(r);
        for (int i = 0; i < 16; i++) {
            _mm512_store_ps(V + 16 * (16 * h + i), r[i]);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(r[i]));
        }
    }
    return amax;
}

/* The errors of the vector variants.  `unit`: every weight of the block(s) is 1 (no importance, a full block),
 * and the products by the weight are left out: w * x == x exactly when w == 1, so the sums are the same. */
MCF_TARGET_AVX512 static __m512 err1_16(const float *V, const float *w, int unit, __m512 s, float qn, float qp)
{
    __m512 vn = _mm512_set1_ps(qn), vp = _mm512_set1_ps(qp), iv = inv16(s), a = _mm512_setzero_ps();
    for (int i = 0; i < 32; i++) {
        __m512 x = _mm512_load_ps(V + 16 * i);
        __m512 q = _mm512_min_ps(_mm512_max_ps(rne16(_mm512_mul_ps(x, iv)), vn), vp);
        __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(s, q)), r2 = _mm512_mul_ps(r, r);
        a = _mm512_add_ps(a, unit ? r2 : _mm512_mul_ps(_mm512_set1_ps(w[i]), r2));
    }
    return a;
}

MCF_TARGET_AVX512 static void err2_16(const float *V0, const float *w0, __m512 s0, const float *V1,
                                      const float *w1, __m512 s1, int unit, float qn, float qp, __m512 *e0,
                                      __m512 *e1)
{
    __m512 vn = _mm512_set1_ps(qn), vp = _mm512_set1_ps(qp), i0 = inv16(s0), i1 = inv16(s1);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int i = 0; i < 32; i++) {
        __m512 x0 = _mm512_load_ps(V0 + 16 * i), x1 = _mm512_load_ps(V1 + 16 * i);
        __m512 q0 = _mm512_min_ps(_mm512_max_ps(rne16(_mm512_mul_ps(x0, i0)), vn), vp);
        __m512 q1 = _mm512_min_ps(_mm512_max_ps(rne16(_mm512_mul_ps(x1, i1)), vn), vp);
        __m512 r0 = _mm512_sub_ps(x0, _mm512_mul_ps(s0, q0)), r1 = _mm512_sub_ps(x1, _mm512_mul_ps(s1, q1));
        __m512 p0 = _mm512_mul_ps(r0, r0), p1 = _mm512_mul_ps(r1, r1);
        a0 = _mm512_add_ps(a0, unit ? p0 : _mm512_mul_ps(_mm512_set1_ps(w0[i]), p0));
        a1 = _mm512_add_ps(a1, unit ? p1 : _mm512_mul_ps(_mm512_set1_ps(w1[i]), p1));
    }
    *e0 = a0;
    *e1 = a1;
}

MCF_TARGET_AVX512 static inline void keep16(__m512 slx, __m512 sl2, __mmask16 live, int neg, __m512 *best,
                                            __m512 *d)
{
    __mmask16 pos = _mm512_cmp_ps_mask(sl2, _mm512_setzero_ps(), _CMP_GT_OQ);
    __m512 den = _mm512_mask_blend_ps(pos, _mm512_set1_ps(1.0f), sl2);
    __m512 score = _mm512_div_ps(_mm512_mul_ps(slx, slx), den);
    __mmask16 better = pos & live & _mm512_cmp_ps_mask(score, *best, _CMP_GT_OQ);
    __m512 q = _mm512_div_ps(slx, den);
    if (neg) q = _mm512_xor_ps(q, _mm512_set1_ps(-0.0f));
    *best = _mm512_mask_blend_ps(better, *best, score);
    *d = _mm512_mask_blend_ps(better, *d, q);
}

/* Two candidates of search_scalar, both signs, for 16 rows: the sums of x * L and (w * L) * L.  Inlined into
 * search16 once with unit = 1 (no weight products) and once with unit = 0. */
MCF_TARGET_AVX512 static inline __attribute__((always_inline)) void sums16(const float *V, const float *wv,
                                                                           const float *w, const int unit,
                                                                           __m512 is0, __m512 is1, float qn,
                                                                           float qp, __m512 acc[8])
{
    const __m512 vn = _mm512_set1_ps(qn), vp = _mm512_set1_ps(qp), vmn = _mm512_set1_ps(-qn), vmp = _mm512_set1_ps(-qp);
    __m512 xp0 = acc[0], yp0 = acc[1], xm0 = acc[2], ym0 = acc[3], xp1 = acc[4], yp1 = acc[5], xm1 = acc[6], ym1 = acc[7];
    for (int i = 0; i < 32; i++) {
        __m512 x = _mm512_load_ps(V + 16 * i), wx = unit ? x : _mm512_load_ps(wv + 16 * i);
        __m512 r0 = rne16(_mm512_mul_ps(x, is0)), r1 = rne16(_mm512_mul_ps(x, is1));
        __m512 lp0 = _mm512_min_ps(_mm512_max_ps(r0, vn), vp), lm0 = _mm512_max_ps(_mm512_min_ps(r0, vmn), vmp);
        __m512 lp1 = _mm512_min_ps(_mm512_max_ps(r1, vn), vp), lm1 = _mm512_max_ps(_mm512_min_ps(r1, vmn), vmp);
        xp0 = _mm512_add_ps(xp0, _mm512_mul_ps(wx, lp0));
        xm0 = _mm512_add_ps(xm0, _mm512_mul_ps(wx, lm0));
        xp1 = _mm512_add_ps(xp1, _mm512_mul_ps(wx, lp1));
        xm1 = _mm512_add_ps(xm1, _mm512_mul_ps(wx, lm1));
        if (unit) {
            yp0 = _mm512_add_ps(yp0, _mm512_mul_ps(lp0, lp0));
            ym0 = _mm512_add_ps(ym0, _mm512_mul_ps(lm0, lm0));
            yp1 = _mm512_add_ps(yp1, _mm512_mul_ps(lp1, lp1));
            ym1 = _mm512_add_ps(ym1, _mm512_mul_ps(lm1, lm1));
        } else {
            __m512 wi = _mm512_set1_ps(w[i]);
            yp0 = _mm512_add_ps(yp0, _mm512_mul_ps(_mm512_mul_ps(wi, lp0), lp0));
            ym0 = _mm512_add_ps(ym0, _mm512_mul_ps(_mm512_mul_ps(wi, lm0), lm0));
            yp1 = _mm512_add_ps(yp1, _mm512_mul_ps(_mm512_mul_ps(wi, lp1), lp1));
            ym1 = _mm512_add_ps(ym1, _mm512_mul_ps(_mm512_mul_ps(wi, lm1), lm1));
        }
    }
    acc[0] = xp0; acc[1] = yp0; acc[2] = xm0; acc[3] = ym0; acc[4] = xp1; acc[5] = yp1; acc[6] = xm1; acc[7] = ym1;
}

MCF_TARGET_AVX512 static void search16(const float *V, const float *w, int unit, __m512 amax, float qn,
                                       float qp, const float *tops, int n, __m512 *dp, __m512 *bp, __m512 *dn,
                                       __m512 *bn)
{
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    __mmask16 live = _mm512_cmp_ps_mask(amax, zero, _CMP_GT_OQ);
    __m512 safe = _mm512_mask_blend_ps(live, one, amax);
    __m512 base = _mm512_maskz_div_ps(live, safe, _mm512_set1_ps(qp));
    __m512 d0 = base, d1 = _mm512_xor_ps(base, _mm512_set1_ps(-0.0f)), b0 = zero, b1 = zero;
    float wv[32 * 16] __attribute__((aligned(64)));
    if (!unit)
        for (int i = 0; i < 32; i++)
            _mm512_store_ps(wv + 16 * i, _mm512_mul_ps(_mm512_set1_ps(w[i]), _mm512_load_ps(V + 16 * i)));
    for (int j = 0; j < n; j += 2) {   /* two candidates per pass (every table has an even count) */
        __m512 is0 = _mm512_div_ps(_mm512_set1_ps(tops[j]), safe), is1 = _mm512_div_ps(_mm512_set1_ps(tops[j + 1]), safe);
        __m512 acc[8] = {zero, zero, zero, zero, zero, zero, zero, zero};
        if (unit)
            sums16(V, wv, w, 1, is0, is1, qn, qp, acc);
        else
            sums16(V, wv, w, 0, is0, is1, qn, qp, acc);
        keep16(acc[0], acc[1], live, 0, &b0, &d0);
        keep16(acc[2], acc[3], live, 1, &b1, &d1);
        keep16(acc[4], acc[5], live, 0, &b0, &d0);
        keep16(acc[6], acc[7], live, 1, &b1, &d1);
    }
    *dp = d0;
    *bp = b0;
    *dn = d1;
    *bn = b1;
}

/* codes of one block of one row, row-major: q = clamp(rint(v * inv), qn, qp), packed LSB first */
MCF_TARGET_AVX512 static void codes_row16(const float *row, size_t c0, size_t nc, float lo, float hi,
                                          float inv, float qn, float qp, int bits, uint8_t *dst)
{
    __mmask16 m0 = nc >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nc) - 1u);
    __mmask16 m1 = nc >= 32 ? (__mmask16)0xffff : (nc > 16 ? (__mmask16)((1u << (nc - 16)) - 1u) : 0);
    __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi), vi = _mm512_set1_ps(inv);
    __m512 vp = _mm512_set1_ps(qp), vn = _mm512_set1_ps(qn);
    __m512i q[2];
    for (int h = 0; h < 2; h++) {
        __m512 x = _mm512_maskz_loadu_ps(h ? m1 : m0, row + c0 + 16 * h);
        x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vlo, _CMP_LT_OQ), x, vlo);
        x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vhi, _CMP_GT_OQ), x, vhi);
        x = _mm512_maskz_mov_ps(h ? m1 : m0, x);
        q[h] = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(rne16(_mm512_mul_ps(x, vi)), vn), vp));
    }
    mcf_store_codes32_avx512(q[0], q[1], bits, dst);
}

MCF_TARGET_AVX512 static inline int overflow16(__m256i h, __mmask16 act)
{
    return _mm256_mask_cmpeq_epi16_mask(act, _mm256_and_si256(h, _mm256_set1_epi16(0x7c00)),
                                        _mm256_set1_epi16(0x7c00)) != 0;
}

MCF_TARGET_AVX512 static int group_block_avx512(int bits, const float *src, size_t cols, size_t bpr, size_t nl,
                                                float lo, float hi, const float *weights, uint16_t *scales,
                                                uint8_t *codes)
{
    const float qp = (float)((1 << (bits - 1)) - 1), qn = -qp - 1.0f;
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qp, tops), overflow = 0;
    __mmask16 act = nl >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nl) - 1u);
    float V[32 * 16] __attribute__((aligned(64))), w[32], inv[16];
    uint16_t hs[16];
    size_t bb = (size_t)bits * 4;
    for (size_t b = 0; b < bpr; b++) {
        size_t c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
        weights_of(weights, c0, nc, w);
        int unit = !weights && nc == 32;
        __m512 amax = load_t16(src, cols, nl, c0, nc, lo, hi, V);
        __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
        __m512 base = _mm512_maskz_div_ps(live, amax, _mm512_set1_ps(qp));
        __m256i h = f16_16(base), hm = trunc_h16(base);
        overflow |= overflow16(h, act);
        __m512 dp, bp, dn, bn, e, em;
        search16(V, w, unit, amax, qn, qp, tops, n, &dp, &bp, &dn, &bn);
        __m256i hsr = clamp_h16(f16_16(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(bp, bn, _CMP_GE_OQ), dn, dp)));
        err2_16(V, w, dec_ph16(h), V, w, dec_ph16(hm), unit, qn, qp, &e, &em);
        __mmask16 take = _mm512_cmp_ps_mask(em, e, _CMP_LT_OQ);
        h = _mm256_mask_blend_epi16(take, h, hm);
        e = _mm512_mask_blend_ps(take, e, em);
        take = _mm512_cmp_ps_mask(err1_16(V, w, unit, dec_ph16(hsr), qn, qp), e, _CMP_LT_OQ);
        h = _mm256_mask_blend_epi16(take, h, hsr);
        _mm256_storeu_si256((__m256i *)hs, h);
        _mm512_storeu_ps(inv, inv16(dec_ph16(h)));
        for (size_t l = 0; l < nl; l++) {
            scales[l * bpr + b] = hs[l];
            codes_row16(src + l * cols, c0, nc, lo, hi, inv[l], qn, qp, bits, codes + (l * bpr + b) * bb);
        }
    }
    return overflow;
}

MCF_TARGET_AVX512 static __m512 total16(const float (*V)[32 * 16], const float (*w)[32], const int *unit,
                                        const __m512 *sc, int nb, float qn, float qp)
{
    __m512 e[8], T = _mm512_setzero_ps();
    for (int k = 0; k < nb; k += 2) {  /* two blocks per pass */
        int k1 = k + 1 < nb ? k + 1 : k;
        err2_16(V[k], w[k], sc[k], V[k1], w[k1], sc[k1], unit[k] && unit[k1], qn, qp, &e[k], &e[k1]);
    }
    for (int k = 0; k < nb; k++) T = _mm512_add_ps(T, e[k]);
    return T;
}

MCF_TARGET_AVX512 static int group_super_avx512(int bits, const float *src, size_t cols, size_t bpr,
                                                size_t spr, size_t nl, float lo, float hi,
                                                const float *weights, uint16_t *supers, uint8_t *sub,
                                                uint8_t *codes)
{
    const float qp = (float)((1 << (bits - 1)) - 1), qn = -qp - 1.0f;
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qp, tops), overflow = 0;
    __mmask16 act = nl >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nl) - 1u);
    float V[8][32 * 16] __attribute__((aligned(64))), w[8][32], uu[16], inv[16];
    uint16_t hs[16];
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f), c32 = _mm512_set1_ps(32.0f);
    const __m512 c63 = _mm512_set1_ps(63.0f), vp = _mm512_set1_ps(qp), neg0 = _mm512_set1_ps(-0.0f);
    size_t bb = (size_t)bits * 4;
    for (size_t s = 0; s < spr; s++) {
        int nb = (int)(bpr - s * 8 < 8 ? bpr - s * 8 : 8);
        __m512 amax[8], base[8], mag[2][8], u[8], uc[8], sc[8], M = zero, D[2] = {zero, zero};
        int unit[8];
        for (int k = 0; k < nb; k++) {
            size_t c0 = (s * 8 + (size_t)k) * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            weights_of(weights, c0, nc, w[k]);
            unit[k] = !weights && nc == 32;
            amax[k] = load_t16(src, cols, nl, c0, nc, lo, hi, V[k]);
            __mmask16 live = _mm512_cmp_ps_mask(amax[k], zero, _CMP_GT_OQ);
            base[k] = _mm512_maskz_div_ps(live, amax[k], vp);
            __m512 bp, dn, bn;
            search16(V[k], w[k], unit[k], amax[k], qn, qp, tops, n, &mag[0][k], &bp, &dn, &bn);
            mag[1][k] = _mm512_xor_ps(dn, neg0);
            M = _mm512_max_ps(M, base[k]);
            D[0] = _mm512_max_ps(D[0], mag[0][k]);
            D[1] = _mm512_max_ps(D[1], mag[1][k]);
        }
        /* 1. the single-pass choice */
        __m256i H = f16_16(M);
        overflow |= overflow16(H, act);
        __m512 S = dec_ph16(H);
        __mmask16 spos = _mm512_cmp_ps_mask(S, zero, _CMP_GT_OQ);
        for (int k = 0; k < nb; k++) {
            u[k] = u6_16(base[k], S, _mm512_cmp_ps_mask(base[k], zero, _CMP_GT_OQ) & spos);
            sc[k] = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(u[k], zero, _CMP_GT_OQ), S, _mm512_div_ps(u[k], c32));
        }
        __m512 E = total16((const float(*)[32 * 16])V, (const float(*)[32])w, unit, sc, nb, qn, qp);
        /* 2. mantle's */
        {
            __m256i Hc = trunc_h16(M);
            __m512 Sc = dec_ph16(Hc);
            for (int k = 0; k < nb; k++) {
                uc[k] = u6_16(base[k], M, _mm512_cmp_ps_mask(base[k], zero, _CMP_GT_OQ));
                sc[k] = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(uc[k], zero, _CMP_GT_OQ), Sc, _mm512_div_ps(uc[k], c32));
            }
            __m512 T = total16((const float(*)[32 * 16])V, (const float(*)[32])w, unit, sc, nb, qn, qp);
            __mmask16 take = _mm512_cmp_ps_mask(T, E, _CMP_LT_OQ);
            E = _mm512_mask_blend_ps(take, E, T);
            H = _mm256_mask_blend_epi16(take, H, Hc);
            for (int k = 0; k < nb; k++) u[k] = _mm512_mask_blend_ps(take, u[k], uc[k]);
        }
        /* 3. the searched choices */
        for (int sg = 0; sg < 2; sg++) {
            __mmask16 anyd = _mm512_cmp_ps_mask(D[sg], zero, _CMP_GT_OQ) & act;
            if (!anyd) continue;
            __m512 flip = sg ? neg0 : zero;
            for (int c = 0; c < MCF_SUPER_CANDIDATES; c++) {
                __m256i hc = clamp_h16(f16_16(_mm512_div_ps(_mm512_mul_ps(D[sg], c32), _mm512_set1_ps((float)(63 - c)))));
                __m512 Sc = dec_ph16(hc), T = zero;
                for (int k = 0; k < nb; k++) {
                    __mmask16 live = _mm512_cmp_ps_mask(amax[k], zero, _CMP_GT_OQ);
                    __m512 f = _mm512_roundscale_ps(_mm512_div_ps(_mm512_mul_ps(mag[sg][k], c32), Sc),
                                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
                    __m512 ua = _mm512_min_ps(_mm512_max_ps(f, one), c63);
                    __m512 ub = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(f, one), one), c63);
                    __m512 ea, eb;
                    err2_16(V[k], w[k], _mm512_xor_ps(_mm512_mul_ps(Sc, _mm512_div_ps(ua, c32)), flip), V[k], w[k],
                            _mm512_xor_ps(_mm512_mul_ps(Sc, _mm512_div_ps(ub, c32)), flip), unit[k], qn, qp, &ea, &eb);
                    __mmask16 pb = _mm512_cmp_ps_mask(eb, ea, _CMP_LT_OQ);
                    uc[k] = _mm512_maskz_mov_ps(live, _mm512_mask_blend_ps(pb, ua, ub));
                    T = _mm512_add_ps(T, _mm512_maskz_mov_ps(live, _mm512_mask_blend_ps(pb, ea, eb)));
                }
                __mmask16 take = anyd & _mm512_cmp_ps_mask(T, E, _CMP_LT_OQ);
                E = _mm512_mask_blend_ps(take, E, T);
                if (sg) hc = _mm256_or_si256(hc, _mm256_set1_epi16((short)F16_SIGN));
                H = _mm256_mask_blend_epi16(take, H, hc);
                for (int k = 0; k < nb; k++) u[k] = _mm512_mask_blend_ps(take, u[k], uc[k]);
            }
        }
        _mm256_storeu_si256((__m256i *)hs, H);
        S = dec_ph16(H);
        for (size_t l = 0; l < nl; l++) supers[l * spr + s] = hs[l];
        for (int k = 0; k < nb; k++) {
            size_t b = s * 8 + (size_t)k, c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            __mmask16 upos = _mm512_cmp_ps_mask(u[k], zero, _CMP_GT_OQ);
            _mm512_storeu_ps(uu, u[k]);
            _mm512_storeu_ps(inv, inv16(_mm512_maskz_mul_ps(upos, S, _mm512_div_ps(u[k], c32))));
            for (size_t l = 0; l < nl; l++) {
                sub[l * bpr + b] = (uint8_t)uu[l];
                codes_row16(src + l * cols, c0, nc, lo, hi, inv[l], qn, qp, bits, codes + (l * bpr + b) * bb);
            }
        }
    }
    return overflow;
}
#endif

#ifdef MCF_NEON
#include "quant_search_neon.h"
#endif

/* The scalar code, one row at a time, in the vector variants' signature (lanes = 1: nl is always 1). */
static int group_block_scalar(int bits, const float *src, size_t cols, size_t bpr, size_t nl, float lo, float hi,
                              const float *weights, uint16_t *scales, uint8_t *codes)
{
    (void)nl;
    return row_block_scalar(bits, src, cols, bpr, lo, hi, weights, scales, codes);
}

static int group_super_scalar(int bits, const float *src, size_t cols, size_t bpr, size_t spr, size_t nl, float lo,
                              float hi, const float *weights, uint16_t *supers, uint8_t *sub, uint8_t *codes)
{
    (void)nl;
    return row_super_scalar(bits, src, cols, bpr, spr, lo, hi, weights, supers, sub, codes);
}

/* Each variant's group kernels (dispatch.h): `lanes` rows at a time, the last group nl <= lanes rows. */
typedef struct {
    size_t lanes;
    int (*block)(int bits, const float *src, size_t cols, size_t bpr, size_t nl, float lo, float hi,
                 const float *weights, uint16_t *scales, uint8_t *codes);
    int (*super)(int bits, const float *src, size_t cols, size_t bpr, size_t spr, size_t nl, float lo, float hi,
                 const float *weights, uint16_t *supers, uint8_t *sub, uint8_t *codes);
} search_kernels;

static const search_kernels KERNELS[MCF_IMPL_COUNT] = {
    [MCF_IMPL_SCALAR] = {1, group_block_scalar, group_super_scalar},
#if defined(__x86_64__)
    [MCF_IMPL_AVX2] = {8, group_block_avx2, group_super_avx2},
    [MCF_IMPL_AVX512] = {16, group_block_avx512, group_super_avx512},
#endif
#ifdef MCF_NEON
    [MCF_IMPL_NEON] = {4, group_block_neon, group_super_neon},
#endif
};

int mcf_quantize_rows_search(int family, int bits, const float *src, size_t nrows, size_t cols, float min_clip,
                             float max_clip, const float *weights, uint16_t *scales, uint8_t *sub, uint8_t *codes,
                             int impl)
{
    const search_kernels *k = &KERNELS[mcf_variant(impl)];
    size_t bpr = (cols + 31) / 32, spr = (bpr + 7) / 8, bb = (size_t)bits * 4;
    int overflow = 0;
    for (size_t r = 0; r < nrows; r += k->lanes) {
        size_t nl = nrows - r < k->lanes ? nrows - r : k->lanes;
        const float *p = src + r * cols;
        if (family == MCF_FAM_BLOCK)
            overflow |= k->block(bits, p, cols, bpr, nl, min_clip, max_clip, weights, scales + r * bpr,
                                 codes + r * bpr * bb);
        else
            overflow |= k->super(bits, p, cols, bpr, spr, nl, min_clip, max_clip, weights, scales + r * spr,
                                 sub + r * bpr, codes + r * bpr * bb);
    }
    return overflow ? -1 : 0;
}
