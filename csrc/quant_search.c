/* The error-minimizing quantizer of the q and k methods (the default): scalar reference, AVX2 and AVX-512
 * variants that write the same bytes.
 *
 * What it computes (docs/quantization.md, "How the default quantizer chooses scales", is the full
 * description; tests/reference.py implements it in numpy from there):
 *
 *  - block search: for n candidate inverse scales (qmax + a_j) / max|v| (a_j = a0 + j*step, a table per bit
 *    width), round every value to the nearest code (clamped to +-qmax), take the least-squares scale of those
 *    codes, sum(w*v*L) / sum(w*L*L), and keep the candidate with the largest sum(w*v*L)^2 / sum(w*L*L), i.e. the
 *    smallest weighted squared error;
 *  - q*: store that scale as f16 (round to nearest even, kept normal and finite) if its error, evaluated with the
 *    scale the decoder will read, is below the single-pass quantizer's (f16(max|v| / qmax)); else store the latter;
 *  - k*: D = the largest block optimum of the super-block; for the super scales f16(D*32/63) and f16(D*32/62)
 *    (so the sub-scales use the whole 6-bit range), give every block the sub-scale floor or ceil of
 *    optimum*32/super (clamped to 1..63) whose error at super*(u6/32) is smaller, keep the super scale with the
 *    smallest total, and keep it only if that total is below the single-pass quantizer's;
 *  - codes: q = clamp(rint(v * (1 / scale)), -qmax, qmax) for the scale the decoder computes.
 *  Errors are sum_i w_i * ((v_i - s*q_i) * (v_i - s*q_i)), float32, summed in index order from +0.
 *
 * Bit-identity by construction: the vector variants put one ROW in each lane (16 rows for AVX-512, 8 for
 * AVX2), all at the same block position, so every lane runs exactly the scalar sequence of IEEE float32
 * operations on its row's block, and a column's weight is the same in every lane (a broadcast).  Maxima and
 * minima are written `a > b ? a : b` / `a < b ? a : b` in the scalar code, which is what maxps / minps do
 * lane by lane; the build has -ffp-contract=off and nothing here uses FMA. */
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "fpconv.h"
#include "quant.h"
#include "simd.h"

#define MCF_SEARCH_MAX_CANDIDATES 12
#define MCF_SUPER_CANDIDATES 2
#define F16_MIN_NORMAL 0x0400u
#define F16_MAX_FINITE 0x7bffu

typedef struct {
    float a0, step;
    int n;
} search_grid;

/* The candidate table (tuned on all-MiniLM-L6-v2: more candidates or a wider range gain < 0.01 dB). */
static search_grid grid_for(int bits)
{
    switch (bits) {
    case 2: return (search_grid){0.0f, 0.25f, 8};
    case 3: return (search_grid){-0.5f, 0.25f, 8};
    case 4: return (search_grid){-1.0f, 0.375f, 10};
    case 6: return (search_grid){-1.5f, 1.0f, 12};
    default: return (search_grid){-1.0f, 0.75f, 12};
    }
}

/* (qmax + a_j) for every candidate: exact in float32 (a few binary digits). */
static int grid_tops(int bits, float qf, float tops[MCF_SEARCH_MAX_CANDIDATES])
{
    search_grid g = grid_for(bits);
    for (int j = 0; j < g.n; j++) tops[j] = qf + (g.a0 + (float)j * g.step);
    return g.n;
}

static inline uint16_t clamp_h(uint16_t h)
{
    return h < F16_MIN_NORMAL ? (uint16_t)F16_MIN_NORMAL : (h > F16_MAX_FINITE ? (uint16_t)F16_MAX_FINITE : h);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Scalar reference: one block at a time. */

static inline float maxf_(float a, float b) { return a > b ? a : b; }
static inline float minf_(float a, float b) { return a < b ? a : b; }
static inline float clip_(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* v[32] (clipped, padding 0), a[32] = |v|, w[32] (padding 0); returns max |v|. */
static float load_block(const float *row, size_t c0, size_t cols, float lo, float hi, const float *weights,
                        float v[32], float a[32], float w[32])
{
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) {
        size_t c = c0 + (size_t)i;
        v[i] = c < cols ? clip_(row[c], lo, hi) : 0.0f;
        a[i] = fabsf(v[i]);
        w[i] = c < cols ? (weights ? weights[c] : 1.0f) : 0.0f;
        amax = maxf_(amax, a[i]);
    }
    return amax;
}

/* The error and the search work on magnitudes: rint is symmetric and the clamp is +-qmax, so the code of -v is
 * minus the code of v, every product v*L, L*L and (v - s*q)^2 is the same for v and -v, and the sums (which
 * start at +0) are bit for bit those of the signed description. */
static float err_scalar(const float a[32], const float w[32], float s, float qf)
{
    float inv = s != 0.0f ? 1.0f / s : 0.0f, e = 0.0f;
    for (int i = 0; i < 32; i++) {
        float q = minf_(rintf(a[i] * inv), qf);
        float r = a[i] - s * q;
        e = e + w[i] * (r * r);
    }
    return e;
}

static float search_scalar(const float a[32], const float w[32], float amax, float qf, const float *tops, int n)
{
    if (!(amax > 0.0f)) return 0.0f;
    float d = amax / qf, best = 0.0f, wa[32];
    for (int i = 0; i < 32; i++) wa[i] = w[i] * a[i];
    for (int j = 0; j < n; j++) {
        float isc = tops[j] / amax, slx = 0.0f, sl2 = 0.0f;
        for (int i = 0; i < 32; i++) {
            float L = minf_(rintf(a[i] * isc), qf);
            slx = slx + wa[i] * L;
            sl2 = sl2 + (w[i] * L) * L;
        }
        if (sl2 > 0.0f) {
            float score = (slx * slx) / sl2;
            if (score > best) {
                best = score;
                d = slx / sl2;
            }
        }
    }
    return d;
}

static void codes_scalar_rne(const float v[32], float s, float qf, int bits, uint8_t *dst)
{
    float inv = s != 0.0f ? 1.0f / s : 0.0f;
    int32_t q[32];
    for (int i = 0; i < 32; i++) q[i] = (int32_t)minf_(maxf_(rintf(v[i] * inv), -qf), qf);
    mcf_pack_block(q, bits, dst);
}

/* u6 of the single-pass quantizer: round_half_away(base / super * 32) clamped to 1..63 (base, super > 0). */
static inline float u6_single_pass(float base, float super)
{
    float t = (base / super) * 32.0f, tt = truncf(t);
    tt = (t - tt >= 0.5f) ? tt + 1.0f : tt;
    return minf_(maxf_(tt, 1.0f), 63.0f);
}

static int row_block_scalar(int bits, const float *row, size_t cols, size_t bpr, float lo, float hi,
                            const float *weights, uint16_t *scales, uint8_t *codes)
{
    const float qf = (float)((1 << (bits - 1)) - 1);
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qf, tops), overflow = 0;
    size_t bb = (size_t)bits * 4;
    for (size_t b = 0; b < bpr; b++) {
        float v[32], a[32], w[32];
        float amax = load_block(row, b * 32, cols, lo, hi, weights, v, a, w);
        float base = amax > 0.0f ? amax / qf : 0.0f;
        uint16_t h0 = mcf_f32_to_f16_one(base);
        if ((h0 & 0x7c00u) == 0x7c00u) overflow = 1;
        float d = search_scalar(a, w, amax, qf, tops, n);
        uint16_t h1 = clamp_h(mcf_f32_to_f16_one(d));
        float e0 = err_scalar(a, w, mcf_scale_from_f16(h0), qf);
        float e1 = err_scalar(a, w, mcf_scale_from_f16(h1), qf);
        uint16_t h = e1 < e0 ? h1 : h0;
        scales[b] = h;
        codes_scalar_rne(v, mcf_scale_from_f16(h), qf, bits, codes + b * bb);
    }
    return overflow;
}

static int row_super_scalar(int bits, const float *row, size_t cols, size_t bpr, size_t spr, float lo, float hi,
                            const float *weights, uint16_t *supers, uint8_t *sub, uint8_t *codes)
{
    const float qf = (float)((1 << (bits - 1)) - 1);
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qf, tops), overflow = 0;
    size_t bb = (size_t)bits * 4;
    for (size_t s = 0; s < spr; s++) {
        float v[8][32], a[8][32], w[8][32], amax[8], base[8], d[8], u0[8], u[8], bu[8];
        int nb = (int)(bpr - s * 8 < 8 ? bpr - s * 8 : 8);
        float smax = 0.0f, dmax = 0.0f;
        for (int k = 0; k < nb; k++) {
            amax[k] = load_block(row, (s * 8 + (size_t)k) * 32, cols, lo, hi, weights, v[k], a[k], w[k]);
            base[k] = amax[k] > 0.0f ? amax[k] / qf : 0.0f;
            d[k] = search_scalar(a[k], w[k], amax[k], qf, tops, n);
            smax = maxf_(smax, base[k]);
            dmax = maxf_(dmax, d[k]);
        }
        /* the single-pass quantizer's choice, and its error */
        uint16_t H = mcf_f32_to_f16_one(smax);
        if ((H & 0x7c00u) == 0x7c00u) overflow = 1;
        float S0 = mcf_scale_from_f16(H), E0 = 0.0f;
        for (int k = 0; k < nb; k++) {
            u0[k] = (base[k] > 0.0f && S0 > 0.0f) ? u6_single_pass(base[k], S0) : 0.0f;
            float sc = u0[k] > 0.0f ? S0 * (u0[k] / 32.0f) : 0.0f;
            E0 = E0 + err_scalar(a[k], w[k], sc, qf);
        }
        memcpy(u, u0, sizeof u);
        if (dmax > 0.0f) {
            float bestT = INFINITY;
            uint16_t bestH = 0;
            for (int c = 0; c < MCF_SUPER_CANDIDATES; c++) {
                uint16_t hc = clamp_h(mcf_f32_to_f16_one((dmax * 32.0f) / (float)(63 - c)));
                float Sc = mcf_scale_from_f16(hc), T = 0.0f, uc[8];
                for (int k = 0; k < nb; k++) {
                    float e = 0.0f;
                    uc[k] = 0.0f;
                    if (amax[k] > 0.0f) {
                        float f = floorf((d[k] * 32.0f) / Sc);
                        float ua = minf_(maxf_(f, 1.0f), 63.0f), ub = minf_(maxf_(f + 1.0f, 1.0f), 63.0f);
                        float ea = err_scalar(a[k], w[k], Sc * (ua / 32.0f), qf);
                        float eb = err_scalar(a[k], w[k], Sc * (ub / 32.0f), qf);
                        uc[k] = eb < ea ? ub : ua;
                        e = eb < ea ? eb : ea;
                    }
                    T = T + e;
                }
                if (T < bestT) {
                    bestT = T;
                    bestH = hc;
                    memcpy(bu, uc, sizeof uc);
                }
            }
            if (bestT < E0) {
                H = bestH;
                memcpy(u, bu, sizeof u);
            }
        }
        supers[s] = H;
        float S = mcf_scale_from_f16(H);
        for (int k = 0; k < nb; k++) {
            size_t b = s * 8 + (size_t)k;
            sub[b] = (uint8_t)u[k];
            codes_scalar_rne(v[k], u[k] > 0.0f ? S * (u[k] / 32.0f) : 0.0f, qf, bits, codes + b * bb);
        }
    }
    return overflow;
}

#if defined(__x86_64__)
#include <immintrin.h>

/* ---------------------------------------------------------------------------------------------------------------
 * AVX2: 8 rows per call, lane l = row r0 + l.  A block's 8 x 32 values are loaded row by row and transposed in
 * registers, so that A[i*8 + l] = |value i of row l|. */

MCF_TARGET_AVX2 static inline __m256 dec_ph8(__m128i h)
{
    __m128i sub = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7c00)), _mm_setzero_si128());
    return _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cvtepi16_epi32(sub)), _mm256_cvtph_ps(h));
}

MCF_TARGET_AVX2 static inline __m128i f16_8(__m256 x)
{
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

MCF_TARGET_AVX2 static inline __m128i clamp_h8(__m128i h)
{
    return _mm_min_epu16(_mm_max_epu16(h, _mm_set1_epi16((short)F16_MIN_NORMAL)), _mm_set1_epi16((short)F16_MAX_FINITE));
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

/* Block (c0, nc columns) of rows 0..nl-1 (stride cols) into A[32][8] as magnitudes of the clipped values;
 * padding and idle lanes 0.  Returns max |value| per lane. */
MCF_TARGET_AVX2 static __m256 load_t8(const float *src, size_t cols, size_t nl, size_t c0, size_t nc,
                                                   float lo, float hi, float *A)
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
                x = _mm256_andnot_ps(sign, _mm256_and_ps(x, _mm256_castsi256_ps(m)));
            }
            r[l] = x;
        }
        transpose8(r);
        for (int i = 0; i < 8; i++) {
            _mm256_store_ps(A + 8 * (8 * q + i), r[i]);
            amax = _mm256_max_ps(amax, r[i]);
        }
    }
    return amax;
}

/* errors of block A0 at scale s0 and block A1 at scale s1 (both per lane), in one pass */
MCF_TARGET_AVX2 static void err2_8(const float *A0, const float *w0, __m256 s0, const float *A1,
                                                const float *w1, __m256 s1, float qf, __m256 *e0, __m256 *e1)
{
    __m256 qp = _mm256_set1_ps(qf), i0 = inv8(s0), i1 = inv8(s1);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int i = 0; i < 32; i++) {
        __m256 x0 = _mm256_load_ps(A0 + 8 * i), x1 = _mm256_load_ps(A1 + 8 * i);
        __m256 q0 = _mm256_min_ps(rne8(_mm256_mul_ps(x0, i0)), qp);
        __m256 q1 = _mm256_min_ps(rne8(_mm256_mul_ps(x1, i1)), qp);
        __m256 r0 = _mm256_sub_ps(x0, _mm256_mul_ps(s0, q0)), r1 = _mm256_sub_ps(x1, _mm256_mul_ps(s1, q1));
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_set1_ps(w0[i]), _mm256_mul_ps(r0, r0)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_set1_ps(w1[i]), _mm256_mul_ps(r1, r1)));
    }
    *e0 = a0;
    *e1 = a1;
}

MCF_TARGET_AVX2 static __m256 search8(const float *A, const float *w, __m256 amax, float qf,
                                                   const float *tops, int n)
{
    __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), qp = _mm256_set1_ps(qf);
    __m256 live = _mm256_cmp_ps(amax, zero, _CMP_GT_OQ);
    __m256 safe = _mm256_blendv_ps(one, amax, live);
    __m256 d = _mm256_and_ps(live, _mm256_div_ps(safe, qp)), best = zero;
    float wa[32 * 8] __attribute__((aligned(32)));
    for (int i = 0; i < 32; i++)
        _mm256_store_ps(wa + 8 * i, _mm256_mul_ps(_mm256_set1_ps(w[i]), _mm256_load_ps(A + 8 * i)));
    for (int j = 0; j < n; j += 2) {
        __m256 is0 = _mm256_div_ps(_mm256_set1_ps(tops[j]), safe), is1 = _mm256_div_ps(_mm256_set1_ps(tops[j + 1]), safe);
        __m256 x0 = zero, y0 = zero, x1 = zero, y1 = zero;
        for (int i = 0; i < 32; i++) {
            __m256 x = _mm256_load_ps(A + 8 * i), wx = _mm256_load_ps(wa + 8 * i), wi = _mm256_set1_ps(w[i]);
            __m256 L0 = _mm256_min_ps(rne8(_mm256_mul_ps(x, is0)), qp);
            __m256 L1 = _mm256_min_ps(rne8(_mm256_mul_ps(x, is1)), qp);
            x0 = _mm256_add_ps(x0, _mm256_mul_ps(wx, L0));
            y0 = _mm256_add_ps(y0, _mm256_mul_ps(_mm256_mul_ps(wi, L0), L0));
            x1 = _mm256_add_ps(x1, _mm256_mul_ps(wx, L1));
            y1 = _mm256_add_ps(y1, _mm256_mul_ps(_mm256_mul_ps(wi, L1), L1));
        }
        for (int t = 0; t < 2; t++) {
            __m256 slx = t ? x1 : x0, sl2 = t ? y1 : y0;
            __m256 pos = _mm256_cmp_ps(sl2, zero, _CMP_GT_OQ);
            __m256 den = _mm256_blendv_ps(one, sl2, pos);
            __m256 score = _mm256_div_ps(_mm256_mul_ps(slx, slx), den);
            __m256 better = _mm256_and_ps(_mm256_and_ps(pos, live), _mm256_cmp_ps(score, best, _CMP_GT_OQ));
            best = _mm256_blendv_ps(best, score, better);
            d = _mm256_blendv_ps(d, _mm256_div_ps(slx, den), better);
        }
    }
    return d;
}

MCF_TARGET_AVX2 static void codes_row8(const float *row, size_t c0, size_t nc, float lo, float hi,
                                                    float inv, float qf, int bits, uint8_t *dst)
{
    __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), vi = _mm256_set1_ps(inv);
    __m256 qp = _mm256_set1_ps(qf), qn = _mm256_set1_ps(-qf);
    __m256i q[4];
    for (int k = 0; k < 4; k++) {
        __m256i ix = _mm256_add_epi32(_mm256_set1_epi32(8 * k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nc), ix);
        __m256 x = _mm256_maskload_ps(row + c0 + 8 * k, m);
        x = _mm256_blendv_ps(x, vlo, _mm256_cmp_ps(x, vlo, _CMP_LT_OQ));
        x = _mm256_blendv_ps(x, vhi, _mm256_cmp_ps(x, vhi, _CMP_GT_OQ));
        x = _mm256_and_ps(x, _mm256_castsi256_ps(m));
        q[k] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(rne8(_mm256_mul_ps(x, vi)), qn), qp));
    }
    mcf_store_codes32_avx2(q, bits, dst);
}

/* any active lane whose f16 value is infinite */
MCF_TARGET_AVX2 static inline int overflow8(__m128i h, __m256 act)
{
    __m128i inf = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7c00)), _mm_set1_epi16(0x7c00));
    return _mm_movemask_epi8(_mm_and_si128(inf, mask16_of(act))) != 0;
}

static void weights_of(const float *weights, size_t c0, size_t nc, float w[32])
{
    for (size_t i = 0; i < 32; i++) w[i] = i < nc ? (weights ? weights[c0 + i] : 1.0f) : 0.0f;
}

MCF_TARGET_AVX2 static int group_block_avx2(int bits, const float *src, size_t cols, size_t bpr, size_t nl,
                                                         float lo, float hi, const float *weights, uint16_t *scales,
                                                         uint8_t *codes)
{
    const float qf = (float)((1 << (bits - 1)) - 1);
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qf, tops), overflow = 0;
    __m256 act = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)nl), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    float A[32 * 8] __attribute__((aligned(32))), w[32], inv[8];
    uint16_t hs[8];
    size_t bb = (size_t)bits * 4;
    for (size_t b = 0; b < bpr; b++) {
        size_t c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
        weights_of(weights, c0, nc, w);
        __m256 amax = load_t8(src, cols, nl, c0, nc, lo, hi, A);
        __m256 live = _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ);
        __m256 base = _mm256_and_ps(live, _mm256_div_ps(amax, _mm256_set1_ps(qf)));
        __m128i h0 = f16_8(base);
        overflow |= overflow8(h0, act);
        __m256 d = search8(A, w, amax, qf, tops, n);
        __m128i h1 = clamp_h8(f16_8(d));
        __m256 e0, e1;
        err2_8(A, w, dec_ph8(h0), A, w, dec_ph8(h1), qf, &e0, &e1);
        __m128i h = _mm_blendv_epi8(h0, h1, mask16_of(_mm256_cmp_ps(e1, e0, _CMP_LT_OQ)));
        _mm_storeu_si128((__m128i *)hs, h);
        _mm256_storeu_ps(inv, inv8(dec_ph8(h)));
        for (size_t l = 0; l < nl; l++) {
            scales[l * bpr + b] = hs[l];
            codes_row8(src + l * cols, c0, nc, lo, hi, inv[l], qf, bits, codes + (l * bpr + b) * bb);
        }
    }
    return overflow;
}

MCF_TARGET_AVX2 static int group_super_avx2(int bits, const float *src, size_t cols, size_t bpr, size_t spr,
                                                         size_t nl, float lo, float hi, const float *weights,
                                                         uint16_t *supers, uint8_t *sub, uint8_t *codes)
{
    const float qf = (float)((1 << (bits - 1)) - 1);
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qf, tops), overflow = 0;
    __m256 act = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)nl), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    float A[8][32 * 8] __attribute__((aligned(32))), w[8][32], uu[8], inv[8];
    uint16_t hs[8];
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), c32 = _mm256_set1_ps(32.0f);
    const __m256 c63 = _mm256_set1_ps(63.0f), qv = _mm256_set1_ps(qf);
    size_t bb = (size_t)bits * 4;
    for (size_t s = 0; s < spr; s++) {
        int nb = (int)(bpr - s * 8 < 8 ? bpr - s * 8 : 8);
        __m256 amax[8], base[8], d[8], u[8], bu[8], e0[8], smax = zero, dmax = zero;
        for (int k = 0; k < nb; k++) {
            size_t c0 = (s * 8 + (size_t)k) * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            weights_of(weights, c0, nc, w[k]);
            amax[k] = load_t8(src, cols, nl, c0, nc, lo, hi, A[k]);
            __m256 live = _mm256_cmp_ps(amax[k], zero, _CMP_GT_OQ);
            base[k] = _mm256_and_ps(live, _mm256_div_ps(amax[k], qv));
            d[k] = search8(A[k], w[k], amax[k], qf, tops, n);
            smax = _mm256_max_ps(smax, base[k]);
            dmax = _mm256_max_ps(dmax, d[k]);
        }
        __m128i H = f16_8(smax);
        overflow |= overflow8(H, act);
        __m256 S0 = dec_ph8(H), E0 = zero, sc0[8];
        __m256 s0pos = _mm256_cmp_ps(S0, zero, _CMP_GT_OQ), S0safe = _mm256_blendv_ps(one, S0, s0pos);
        for (int k = 0; k < nb; k++) {
            __m256 ok = _mm256_and_ps(_mm256_cmp_ps(base[k], zero, _CMP_GT_OQ), s0pos);
            __m256 t = _mm256_mul_ps(_mm256_and_ps(ok, _mm256_div_ps(base[k], S0safe)), c32);
            __m256 tt = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __m256 up = _mm256_cmp_ps(_mm256_sub_ps(t, tt), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
            tt = _mm256_add_ps(tt, _mm256_and_ps(up, one));
            u[k] = _mm256_and_ps(ok, _mm256_min_ps(_mm256_max_ps(tt, one), c63));
            __m256 upos = _mm256_cmp_ps(u[k], zero, _CMP_GT_OQ);
            sc0[k] = _mm256_and_ps(upos, _mm256_mul_ps(S0, _mm256_div_ps(u[k], c32)));
        }
        for (int k = 0; k < nb; k += 2) {  /* two blocks per pass */
            int k1 = k + 1 < nb ? k + 1 : k;
            err2_8(A[k], w[k], sc0[k], A[k1], w[k1], sc0[k1], qf, &e0[k], &e0[k1]);
        }
        for (int k = 0; k < nb; k++) E0 = _mm256_add_ps(E0, e0[k]);
        __m256 anyd = _mm256_and_ps(_mm256_cmp_ps(dmax, zero, _CMP_GT_OQ), act);
        if (_mm256_movemask_ps(anyd)) {
            __m256 bestT = _mm256_set1_ps(INFINITY);
            __m128i bestH = _mm_setzero_si128();
            for (int k = 0; k < nb; k++) bu[k] = zero;
            for (int c = 0; c < MCF_SUPER_CANDIDATES; c++) {
                __m128i hc = clamp_h8(f16_8(_mm256_div_ps(_mm256_mul_ps(dmax, c32), _mm256_set1_ps((float)(63 - c)))));
                __m256 Sc = dec_ph8(hc), T = zero, uc[8];
                for (int k = 0; k < nb; k++) {
                    __m256 live = _mm256_cmp_ps(amax[k], zero, _CMP_GT_OQ);
                    __m256 f = _mm256_round_ps(_mm256_div_ps(_mm256_mul_ps(d[k], c32), Sc),
                                               _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
                    __m256 ua = _mm256_min_ps(_mm256_max_ps(f, one), c63);
                    __m256 ub = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(f, one), one), c63);
                    __m256 ea, eb;
                    err2_8(A[k], w[k], _mm256_mul_ps(Sc, _mm256_div_ps(ua, c32)), A[k], w[k],
                           _mm256_mul_ps(Sc, _mm256_div_ps(ub, c32)), qf, &ea, &eb);
                    __m256 pb = _mm256_cmp_ps(eb, ea, _CMP_LT_OQ);
                    uc[k] = _mm256_and_ps(live, _mm256_blendv_ps(ua, ub, pb));
                    T = _mm256_add_ps(T, _mm256_and_ps(live, _mm256_blendv_ps(ea, eb, pb)));
                }
                __m256 better = _mm256_cmp_ps(T, bestT, _CMP_LT_OQ);
                bestT = _mm256_blendv_ps(bestT, T, better);
                bestH = _mm_blendv_epi8(bestH, hc, mask16_of(better));
                for (int k = 0; k < nb; k++) bu[k] = _mm256_blendv_ps(bu[k], uc[k], better);
            }
            __m256 take = _mm256_and_ps(anyd, _mm256_cmp_ps(bestT, E0, _CMP_LT_OQ));
            H = _mm_blendv_epi8(H, bestH, mask16_of(take));
            for (int k = 0; k < nb; k++) u[k] = _mm256_blendv_ps(u[k], bu[k], take);
        }
        _mm_storeu_si128((__m128i *)hs, H);
        __m256 S = dec_ph8(H);
        for (size_t l = 0; l < nl; l++) supers[l * spr + s] = hs[l];
        for (int k = 0; k < nb; k++) {
            size_t b = s * 8 + (size_t)k, c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            __m256 upos = _mm256_cmp_ps(u[k], zero, _CMP_GT_OQ);
            _mm256_storeu_ps(uu, u[k]);
            _mm256_storeu_ps(inv, inv8(_mm256_and_ps(upos, _mm256_mul_ps(S, _mm256_div_ps(u[k], c32)))));
            for (size_t l = 0; l < nl; l++) {
                sub[l * bpr + b] = (uint8_t)uu[l];
                codes_row8(src + l * cols, c0, nc, lo, hi, inv[l], qf, bits, codes + (l * bpr + b) * bb);
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

MCF_TARGET_AVX512 static inline __m256i clamp_h16(__m256i h)
{
    return _mm256_min_epu16(_mm256_max_epu16(h, _mm256_set1_epi16((short)F16_MIN_NORMAL)),
                            _mm256_set1_epi16((short)F16_MAX_FINITE));
}

MCF_TARGET_AVX512 static inline __m512 rne16(__m512 x)
{
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

MCF_TARGET_AVX512 static inline __m512 inv16(__m512 s)
{
    return _mm512_maskz_div_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.0f), s);
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

/* Block (c0, nc columns) of rows 0..nl-1 into A[32][16] as magnitudes of the clipped values (padding and idle
 * lanes 0); returns max |value| per lane. */
MCF_TARGET_AVX512 static __m512 load_t16(const float *src, size_t cols, size_t nl, size_t c0, size_t nc,
                                                      float lo, float hi, float *A)
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
                x = _mm512_abs_ps(_mm512_maskz_mov_ps(m, x));
            }
            r[l] = x;
        }
        transpose16(r);
        for (int i = 0; i < 16; i++) {
            _mm512_store_ps(A + 16 * (16 * h + i), r[i]);
            amax = _mm512_max_ps(amax, r[i]);
        }
    }
    return amax;
}

MCF_TARGET_AVX512 static void err2_16(const float *A0, const float *w0, __m512 s0, const float *A1,
                                                   const float *w1, __m512 s1, float qf, __m512 *e0, __m512 *e1)
{
    __m512 qp = _mm512_set1_ps(qf), i0 = inv16(s0), i1 = inv16(s1);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int i = 0; i < 32; i++) {
        __m512 x0 = _mm512_load_ps(A0 + 16 * i), x1 = _mm512_load_ps(A1 + 16 * i);
        __m512 q0 = _mm512_min_ps(rne16(_mm512_mul_ps(x0, i0)), qp);
        __m512 q1 = _mm512_min_ps(rne16(_mm512_mul_ps(x1, i1)), qp);
        __m512 r0 = _mm512_sub_ps(x0, _mm512_mul_ps(s0, q0)), r1 = _mm512_sub_ps(x1, _mm512_mul_ps(s1, q1));
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(_mm512_set1_ps(w0[i]), _mm512_mul_ps(r0, r0)));
        a1 = _mm512_add_ps(a1, _mm512_mul_ps(_mm512_set1_ps(w1[i]), _mm512_mul_ps(r1, r1)));
    }
    *e0 = a0;
    *e1 = a1;
}

MCF_TARGET_AVX512 static __m512 search16(const float *A, const float *w, __m512 amax, float qf,
                                                      const float *tops, int n)
{
    __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    __m512 one = _mm512_set1_ps(1.0f), qp = _mm512_set1_ps(qf);
    __m512 safe = _mm512_mask_blend_ps(live, one, amax);
    __m512 d = _mm512_maskz_div_ps(live, safe, qp), best = _mm512_setzero_ps();
    float wa[32 * 16] __attribute__((aligned(64)));
    for (int i = 0; i < 32; i++)
        _mm512_store_ps(wa + 16 * i, _mm512_mul_ps(_mm512_set1_ps(w[i]), _mm512_load_ps(A + 16 * i)));
    for (int j = 0; j < n; j += 2) {   /* two candidates per pass (every table has an even count) */
        __m512 is0 = _mm512_div_ps(_mm512_set1_ps(tops[j]), safe), is1 = _mm512_div_ps(_mm512_set1_ps(tops[j + 1]), safe);
        __m512 x0 = _mm512_setzero_ps(), y0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps(), y1 = _mm512_setzero_ps();
        for (int i = 0; i < 32; i++) {
            __m512 x = _mm512_load_ps(A + 16 * i), wx = _mm512_load_ps(wa + 16 * i), wi = _mm512_set1_ps(w[i]);
            __m512 L0 = _mm512_min_ps(rne16(_mm512_mul_ps(x, is0)), qp);
            __m512 L1 = _mm512_min_ps(rne16(_mm512_mul_ps(x, is1)), qp);
            x0 = _mm512_add_ps(x0, _mm512_mul_ps(wx, L0));
            y0 = _mm512_add_ps(y0, _mm512_mul_ps(_mm512_mul_ps(wi, L0), L0));
            x1 = _mm512_add_ps(x1, _mm512_mul_ps(wx, L1));
            y1 = _mm512_add_ps(y1, _mm512_mul_ps(_mm512_mul_ps(wi, L1), L1));
        }
        for (int t = 0; t < 2; t++) {
            __m512 slx = t ? x1 : x0, sl2 = t ? y1 : y0;
            __mmask16 pos = _mm512_cmp_ps_mask(sl2, _mm512_setzero_ps(), _CMP_GT_OQ);
            __m512 den = _mm512_mask_blend_ps(pos, one, sl2);
            __m512 score = _mm512_div_ps(_mm512_mul_ps(slx, slx), den);
            __mmask16 better = pos & live & _mm512_cmp_ps_mask(score, best, _CMP_GT_OQ);
            best = _mm512_mask_blend_ps(better, best, score);
            d = _mm512_mask_blend_ps(better, d, _mm512_div_ps(slx, den));
        }
    }
    return d;
}

/* codes of one block of one row, row-major: q = clamp(rint(v * inv)), packed LSB first */
MCF_TARGET_AVX512 static void codes_row16(const float *row, size_t c0, size_t nc, float lo, float hi,
                                                       float inv, float qf, int bits, uint8_t *dst)
{
    __mmask16 m0 = nc >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nc) - 1u);
    __mmask16 m1 = nc >= 32 ? (__mmask16)0xffff : (nc > 16 ? (__mmask16)((1u << (nc - 16)) - 1u) : 0);
    __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi), vi = _mm512_set1_ps(inv);
    __m512 qp = _mm512_set1_ps(qf), qn = _mm512_set1_ps(-qf);
    __m512i q[2];
    for (int h = 0; h < 2; h++) {
        __m512 x = _mm512_maskz_loadu_ps(h ? m1 : m0, row + c0 + 16 * h);
        x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vlo, _CMP_LT_OQ), x, vlo);
        x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vhi, _CMP_GT_OQ), x, vhi);
        x = _mm512_maskz_mov_ps(h ? m1 : m0, x);
        q[h] = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(rne16(_mm512_mul_ps(x, vi)), qn), qp));
    }
    mcf_store_codes32_avx512(q[0], q[1], bits, dst);
}

MCF_TARGET_AVX512 static int group_block_avx512(int bits, const float *src, size_t cols, size_t bpr,
                                                             size_t nl, float lo, float hi, const float *weights,
                                                             uint16_t *scales, uint8_t *codes)
{
    const float qf = (float)((1 << (bits - 1)) - 1);
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qf, tops), overflow = 0;
    __mmask16 act = nl >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nl) - 1u);
    float A[32 * 16] __attribute__((aligned(64))), w[32], inv[16];
    uint16_t hs[16];
    size_t bb = (size_t)bits * 4;
    for (size_t b = 0; b < bpr; b++) {
        size_t c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
        weights_of(weights, c0, nc, w);
        __m512 amax = load_t16(src, cols, nl, c0, nc, lo, hi, A);
        __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
        __m512 base = _mm512_maskz_div_ps(live, amax, _mm512_set1_ps(qf));
        __m256i h0 = f16_16(base);
        if (_mm256_mask_cmpeq_epi16_mask(act, _mm256_and_si256(h0, _mm256_set1_epi16(0x7c00)),
                                         _mm256_set1_epi16(0x7c00)))
            overflow = 1;
        __m512 d = search16(A, w, amax, qf, tops, n);
        __m256i h1 = clamp_h16(f16_16(d));
        __m512 e0, e1;
        err2_16(A, w, dec_ph16(h0), A, w, dec_ph16(h1), qf, &e0, &e1);
        __m256i h = _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(e1, e0, _CMP_LT_OQ), h0, h1);
        _mm256_storeu_si256((__m256i *)hs, h);
        _mm512_storeu_ps(inv, inv16(dec_ph16(h)));
        for (size_t l = 0; l < nl; l++) {
            scales[l * bpr + b] = hs[l];
            codes_row16(src + l * cols, c0, nc, lo, hi, inv[l], qf, bits, codes + (l * bpr + b) * bb);
        }
    }
    return overflow;
}

MCF_TARGET_AVX512 static int group_super_avx512(int bits, const float *src, size_t cols, size_t bpr,
                                                             size_t spr, size_t nl, float lo, float hi,
                                                             const float *weights, uint16_t *supers, uint8_t *sub,
                                                             uint8_t *codes)
{
    const float qf = (float)((1 << (bits - 1)) - 1);
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qf, tops), overflow = 0;
    __mmask16 act = nl >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nl) - 1u);
    float A[8][32 * 16] __attribute__((aligned(64))), w[8][32], uu[16], inv[16];
    uint16_t hs[16];
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f), c32 = _mm512_set1_ps(32.0f);
    const __m512 c63 = _mm512_set1_ps(63.0f);
    size_t bb = (size_t)bits * 4;
    for (size_t s = 0; s < spr; s++) {
        int nb = (int)(bpr - s * 8 < 8 ? bpr - s * 8 : 8);
        __m512 amax[8], base[8], d[8], u[8], bu[8], e0[8], sc0[8];
        __m512 smax = zero, dmax = zero;
        for (int k = 0; k < nb; k++) {
            size_t c0 = (s * 8 + (size_t)k) * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            weights_of(weights, c0, nc, w[k]);
            amax[k] = load_t16(src, cols, nl, c0, nc, lo, hi, A[k]);
            __mmask16 live = _mm512_cmp_ps_mask(amax[k], zero, _CMP_GT_OQ);
            base[k] = _mm512_maskz_div_ps(live, amax[k], _mm512_set1_ps(qf));
            d[k] = search16(A[k], w[k], amax[k], qf, tops, n);
            smax = _mm512_max_ps(smax, base[k]);
            dmax = _mm512_max_ps(dmax, d[k]);
        }
        __m256i H = f16_16(smax);
        if (_mm256_mask_cmpeq_epi16_mask(act, _mm256_and_si256(H, _mm256_set1_epi16(0x7c00)),
                                         _mm256_set1_epi16(0x7c00)))
            overflow = 1;
        __m512 S0 = dec_ph16(H), E0 = zero;
        __mmask16 s0pos = _mm512_cmp_ps_mask(S0, zero, _CMP_GT_OQ);
        for (int k = 0; k < nb; k++) {
            __mmask16 ok = _mm512_cmp_ps_mask(base[k], zero, _CMP_GT_OQ) & s0pos;
            __m512 t = _mm512_mul_ps(_mm512_maskz_div_ps(ok, base[k], S0), c32);
            __m512 tt = _mm512_roundscale_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(t, tt), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
            tt = _mm512_mask_add_ps(tt, up, tt, one);
            u[k] = _mm512_maskz_mov_ps(ok, _mm512_min_ps(_mm512_max_ps(tt, one), c63));
            __mmask16 upos = _mm512_cmp_ps_mask(u[k], zero, _CMP_GT_OQ);
            sc0[k] = _mm512_maskz_mul_ps(upos, S0, _mm512_div_ps(u[k], c32));
        }
        for (int k = 0; k < nb; k += 2) {  /* two blocks per pass */
            int k1 = k + 1 < nb ? k + 1 : k;
            err2_16(A[k], w[k], sc0[k], A[k1], w[k1], sc0[k1], qf, &e0[k], &e0[k1]);
        }
        for (int k = 0; k < nb; k++) E0 = _mm512_add_ps(E0, e0[k]);
        __mmask16 anyd = _mm512_cmp_ps_mask(dmax, zero, _CMP_GT_OQ) & act;
        if (anyd) {
            __m512 bestT = _mm512_set1_ps(INFINITY);
            __m256i bestH = _mm256_setzero_si256();
            for (int k = 0; k < nb; k++) bu[k] = zero;
            for (int c = 0; c < MCF_SUPER_CANDIDATES; c++) {
                __m256i hc = clamp_h16(f16_16(_mm512_div_ps(_mm512_mul_ps(dmax, c32), _mm512_set1_ps((float)(63 - c)))));
                __m512 Sc = dec_ph16(hc), T = zero, uc[8];
                for (int k = 0; k < nb; k++) {
                    __mmask16 live = _mm512_cmp_ps_mask(amax[k], zero, _CMP_GT_OQ);
                    __m512 f = _mm512_roundscale_ps(_mm512_div_ps(_mm512_mul_ps(d[k], c32), Sc),
                                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
                    __m512 ua = _mm512_min_ps(_mm512_max_ps(f, one), c63);
                    __m512 ubb = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(f, one), one), c63);
                    __m512 ea, eb;
                    err2_16(A[k], w[k], _mm512_mul_ps(Sc, _mm512_div_ps(ua, c32)), A[k], w[k],
                            _mm512_mul_ps(Sc, _mm512_div_ps(ubb, c32)), qf, &ea, &eb);
                    __mmask16 pb = _mm512_cmp_ps_mask(eb, ea, _CMP_LT_OQ);
                    uc[k] = _mm512_maskz_mov_ps(live, _mm512_mask_blend_ps(pb, ua, ubb));
                    T = _mm512_add_ps(T, _mm512_maskz_mov_ps(live, _mm512_mask_blend_ps(pb, ea, eb)));
                }
                __mmask16 better = _mm512_cmp_ps_mask(T, bestT, _CMP_LT_OQ);
                bestT = _mm512_mask_blend_ps(better, bestT, T);
                bestH = _mm256_mask_blend_epi16(better, bestH, hc);
                for (int k = 0; k < nb; k++) bu[k] = _mm512_mask_blend_ps(better, bu[k], uc[k]);
            }
            __mmask16 take = anyd & _mm512_cmp_ps_mask(bestT, E0, _CMP_LT_OQ);
            H = _mm256_mask_blend_epi16(take, H, bestH);
            for (int k = 0; k < nb; k++) u[k] = _mm512_mask_blend_ps(take, u[k], bu[k]);
        }
        _mm256_storeu_si256((__m256i *)hs, H);
        __m512 S = dec_ph16(H);
        for (size_t l = 0; l < nl; l++) supers[l * spr + s] = hs[l];
        for (int k = 0; k < nb; k++) {
            size_t b = s * 8 + (size_t)k, c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            __mmask16 upos = _mm512_cmp_ps_mask(u[k], zero, _CMP_GT_OQ);
            _mm512_storeu_ps(uu, u[k]);
            _mm512_storeu_ps(inv, inv16(_mm512_maskz_mul_ps(upos, S, _mm512_div_ps(u[k], c32))));
            for (size_t l = 0; l < nl; l++) {
                sub[l * bpr + b] = (uint8_t)uu[l];
                codes_row16(src + l * cols, c0, nc, lo, hi, inv[l], qf, bits, codes + (l * bpr + b) * bb);
            }
        }
    }
    return overflow;
}
#endif

int mcf_quantize_rows_search(int family, int bits, const float *src, size_t nrows, size_t cols, float min_clip,
                             float max_clip, const float *weights, uint16_t *scales, uint8_t *sub, uint8_t *codes,
                             int impl)
{
    size_t bpr = (cols + 31) / 32, spr = (bpr + 7) / 8, bb = (size_t)bits * 4;
    int overflow = 0;
    size_t r = 0;
#if defined(__x86_64__)
    if (impl >= MCF_IMPL_AVX512) {
        for (; r < nrows; r += 16) {
            size_t nl = nrows - r < 16 ? nrows - r : 16;
            const float *p = src + r * cols;
            if (family == MCF_FAM_BLOCK)
                overflow |= group_block_avx512(bits, p, cols, bpr, nl, min_clip, max_clip, weights, scales + r * bpr,
                                               codes + r * bpr * bb);
            else
                overflow |= group_super_avx512(bits, p, cols, bpr, spr, nl, min_clip, max_clip, weights,
                                               scales + r * spr, sub + r * bpr, codes + r * bpr * bb);
        }
    } else if (impl == MCF_IMPL_AVX2) {
        for (; r < nrows; r += 8) {
            size_t nl = nrows - r < 8 ? nrows - r : 8;
            const float *p = src + r * cols;
            if (family == MCF_FAM_BLOCK)
                overflow |= group_block_avx2(bits, p, cols, bpr, nl, min_clip, max_clip, weights, scales + r * bpr,
                                             codes + r * bpr * bb);
            else
                overflow |= group_super_avx2(bits, p, cols, bpr, spr, nl, min_clip, max_clip, weights,
                                             scales + r * spr, sub + r * bpr, codes + r * bpr * bb);
        }
    }
#endif
    (void)impl;
    for (; r < nrows; r++) {
        const float *row = src + r * cols;
        if (family == MCF_FAM_BLOCK)
            overflow |= row_block_scalar(bits, row, cols, bpr, min_clip, max_clip, weights, scales + r * bpr,
                                         codes + r * bpr * bb);
        else
            overflow |= row_super_scalar(bits, row, cols, bpr, spr, min_clip, max_clip, weights, scales + r * spr,
                                         sub + r * bpr, codes + r * bpr * bb);
    }
    return overflow ? -1 : 0;
}
