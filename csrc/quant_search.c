/* The error-minimizing quantizer of the q and k methods (the default): scalar reference, and AVX2, AVX-512 and
 * NEON variants from one source (quant_search_vec.h, over simd_vec.h's vocabulary) that write the same bytes.
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

/* ---------------------------------------------------------------------------------------------------------------
 * The vector variants: one source, quant_search_vec.h, compiled per ISA (simd_vec.h's vocabulary). */
#if defined(__x86_64__)
#define QS_PASS 1
#define MCF_VEC_ISA MCF_VEC_AVX2
#include "simd_vec.h"
#include "quant_search_vec.h"   /* group_block_avx2, group_super_avx2: 8 rows per call */
#undef QS_PASS
#define QS_PASS 2
#define MCF_VEC_ISA MCF_VEC_AVX512
#include "simd_vec.h"
#include "quant_search_vec.h"   /* group_block_avx512, group_super_avx512: 16 rows per call */
#undef QS_PASS
#endif
#ifdef MCF_NEON
#define QS_PASS 1
#define MCF_VEC_ISA MCF_VEC_NEON
#include "simd_vec.h"
#include "quant_search_vec.h"   /* group_block_neon, group_super_neon: 4 rows per call */
#undef QS_PASS
#endif
#define MCF_VEC_ISA MCF_VEC_NONE
#include "simd_vec.h"

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
