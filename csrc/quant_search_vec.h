/* The vector variants of the error-minimizing quantizer (csrc/quant_search.c), written once against the
 * vocabulary of csrc/simd_vec.h: quant_search.c includes this file once per ISA (AVX2, AVX-512, NEON), which
 * defines VSFX(group_block) and VSFX(group_super) (group_block_avx2, ...; the helpers likewise).
 *
 * VW rows per call, lane l = row r0 + l, all at the same block position: a block's VW x 32 values are loaded row
 * by row and transposed in registers, so that V[i*VW + l] = value i of row l, and every lane runs the scalar
 * reference's sequence of float32 operations on its own row's block (the top of quant_search.c says why that
 * makes the variants bit-identical).  QS_PASS, set by the includer, is how many candidates of the block search
 * share one pass over the block (2 where the ISA has 32 vector registers to hold their sums). */

/* f16 scales as the decoder reads them: zero and subnormal exponents give +0 */
VTARGET static inline vf_t VSFX(dec_h)(vh_t h)
{
    return vf_blend(vh_cvt(h), vf_zero(), vi_testz(vh_widen(h), vi_set1(0x7c00)));
}

/* f16 bits with the magnitude clamped to the normal finite range; the sign is kept (clamp_h) */
VTARGET static inline vh_t VSFX(clamp_h)(vh_t h)
{
    vi_t u = vh_widen(h);
    vi_t m = vi_min(vi_max(vi_and(u, vi_set1(0x7fff)), vi_set1(F16_MIN_NORMAL)), vi_set1(F16_MAX_FINITE));
    return vi_narrow16(vi_or(m, vi_and(u, vi_set1(F16_SIGN))));
}

/* mcf_f32_to_f16_trunc of finite values >= 0: the exponent rebiased into binary16's field, the mantissa truncated;
 * from 65536 infinity, below 2^-14 zero */
VTARGET static inline vh_t VSFX(trunc_h)(vf_t x)
{
    vi_t u = vf_as_i(x), e = vi_shr(u, 23);
    vi_t h = vi_or(vi_shl(vi_sub(e, vi_set1(112)), 10), vi_and(vi_shr(u, 13), vi_set1(0x3ff)));
    h = vi_blend(h, vi_set1(0x7c00), vi_gt(e, vi_set1(142)));
    return vi_narrow16(vi_blend(vi_zero(), h, vi_gt(e, vi_set1(112))));
}

/* any lane of m whose f16 value is infinite */
VTARGET static inline int VSFX(any_inf_h)(vh_t h, vm_t m)
{
    return vm_any(vm_and(m, vi_eq(vi_and(vh_widen(h), vi_set1(0x7c00)), vi_set1(0x7c00))));
}

/* 1 / s where s != 0 (NaN included), else 0 */
VTARGET static inline vf_t VSFX(inv)(vf_t s)
{
    return vf_maskz_div(vf_ne(s, vf_zero()), vf_set1(1.0f), s);
}

/* u6_single_pass per lane where ok (else 0) */
VTARGET static inline vf_t VSFX(u6)(vf_t base, vf_t super, vm_t ok)
{
    const vf_t one = vf_set1(1.0f);
    vf_t t = vf_mul(vf_maskz_div(ok, base, super), vf_set1(32.0f));
    vf_t tt = vf_trunc(t);
    tt = vf_add(tt, vf_maskz(vf_ge(vf_sub(t, tt), vf_set1(0.5f)), one));
    return vf_maskz(ok, vf_min(vf_max(tt, one), vf_set1(63.0f)));
}

/* Block (c0, nc columns) of rows 0..nl-1 (stride cols) into V[32][VW], the clipped values (padding and idle
 * lanes 0).  Returns max |value| per lane. */
VTARGET static vf_t VSFX(load_t)(const float *src, size_t cols, size_t nl, size_t c0, size_t nc, float lo, float hi,
                                 float *V)
{
    vf_t vlo = vf_set1(lo), vhi = vf_set1(hi), amax = vf_zero(), r[VW];
    for (size_t q = 0; q < 32 / VW; q++) {
        for (size_t l = 0; l < VW; l++)
            r[l] = (l < nl && VW * q < nc) ? vf_load_clip(src + l * cols + c0, q, nc, vlo, vhi) : vf_zero();
        vf_transpose(r);
        for (size_t i = 0; i < VW; i++) {
            vf_store(V + VW * (VW * q + i), r[i]);
            amax = vf_max(amax, vf_abs(r[i]));
        }
    }
    return amax;
}

/* One value's term of a block error at scale s (iv = inv(s)), added to a.  `unit`: every weight of the block(s)
 * is 1 (no importance, a full block), and the product by the weight is left out: w * x == x exactly when
 * w == 1, so the sums are the same. */
VTARGET static inline __attribute__((always_inline)) vf_t VSFX(err_term)(vf_t a, vf_t x, vf_t s, vf_t iv, vf_t vn,
                                                                        vf_t vp, int unit, float w)
{
    vf_t q = vf_min(vf_max(vf_rint(vf_mul(x, iv)), vn), vp);
    vf_t r = vf_sub(x, vf_mul(s, q)), r2 = vf_mul(r, r);
    return vf_add(a, unit ? r2 : vf_mul(vf_set1(w), r2));
}

/* the error of block V at scale s (err_scalar, VW rows) */
VTARGET static vf_t VSFX(err1)(const float *V, const float *w, int unit, vf_t s, float qn, float qp)
{
    vf_t vn = vf_set1(qn), vp = vf_set1(qp), iv = VSFX(inv)(s), a = vf_zero();
    for (int i = 0; i < 32; i++) a = VSFX(err_term)(a, vf_load(V + VW * i), s, iv, vn, vp, unit, w[i]);
    return a;
}

/* errors of block V0 at scale s0 and block V1 at scale s1, in one pass */
VTARGET static void VSFX(err2)(const float *V0, const float *w0, vf_t s0, const float *V1, const float *w1, vf_t s1,
                               int unit, float qn, float qp, vf_t *e0, vf_t *e1)
{
    vf_t vn = vf_set1(qn), vp = vf_set1(qp), i0 = VSFX(inv)(s0), i1 = VSFX(inv)(s1), a0 = vf_zero(), a1 = vf_zero();
    for (int i = 0; i < 32; i++) {
        a0 = VSFX(err_term)(a0, vf_load(V0 + VW * i), s0, i0, vn, vp, unit, w0[i]);
        a1 = VSFX(err_term)(a1, vf_load(V1 + VW * i), s1, i1, vn, vp, unit, w1[i]);
    }
    *e0 = a0;
    *e1 = a1;
}

/* one sign's running best: keep (score, slx / sl2) where the score is larger */
VTARGET static inline void VSFX(keep)(vf_t slx, vf_t sl2, vm_t live, int neg, vf_t *best, vf_t *d)
{
    vm_t pos = vf_gt(sl2, vf_zero());
    vf_t den = vf_blend(vf_set1(1.0f), sl2, pos);
    vf_t score = vf_div(vf_mul(slx, slx), den);
    vm_t better = vm_and(vm_and(pos, live), vf_gt(score, *best));
    vf_t q = vf_div(slx, den);
    if (neg) q = vf_neg(q);
    *best = vf_blend(*best, score, better);
    *d = vf_blend(*d, q, better);
}

/* One value's terms of one candidate of search_scalar, both signs: acc[0] += x*w * L+, acc[1] += (w * L+) * L+,
 * acc[2] and acc[3] the same for L-. */
VTARGET static inline __attribute__((always_inline)) void VSFX(sums_term)(vf_t x, vf_t wx, vf_t wi, const int unit,
                                                                         vf_t is, vf_t vn, vf_t vp, vf_t vmn,
                                                                         vf_t vmp, vf_t acc[4])
{
    vf_t r = vf_rint(vf_mul(x, is));
    vf_t lp = vf_min(vf_max(r, vn), vp);
    vf_t lm = vf_max(vf_min(r, vmn), vmp);
    acc[0] = vf_add(acc[0], vf_mul(wx, lp));
    acc[2] = vf_add(acc[2], vf_mul(wx, lm));
    if (unit) {
        acc[1] = vf_add(acc[1], vf_mul(lp, lp));
        acc[3] = vf_add(acc[3], vf_mul(lm, lm));
    } else {
        acc[1] = vf_add(acc[1], vf_mul(vf_mul(wi, lp), lp));
        acc[3] = vf_add(acc[3], vf_mul(vf_mul(wi, lm), lm));
    }
}

/* QS_PASS candidates (inverse scales is[c]) of search_scalar, both signs, for VW rows: the sums of x * L and
 * (w * L) * L into acc[4c .. 4c+3].  Inlined into search once with unit = 1 (no weight products) and once with
 * unit = 0. */
VTARGET static inline __attribute__((always_inline)) void VSFX(sums)(const float *V, const float *wv, const float *w,
                                                                    const int unit, const vf_t *is, float qn,
                                                                    float qp, vf_t acc[4 * QS_PASS])
{
    const vf_t vn = vf_set1(qn), vp = vf_set1(qp), vmn = vf_set1(-qn), vmp = vf_set1(-qp);
    for (int i = 0; i < 32; i++) {
        vf_t x = vf_load(V + VW * i), wx = unit ? x : vf_load(wv + VW * i), wi = vf_set1(w[i]);
        for (int c = 0; c < QS_PASS; c++) VSFX(sums_term)(x, wx, wi, unit, is[c], vn, vp, vmn, vmp, acc + 4 * c);
    }
}

/* The block search of search_scalar, VW rows at once: dp/bp the positive optimum and its score, dn/bn the
 * negative one. */
VTARGET static void VSFX(search)(const float *V, const float *w, int unit, vf_t amax, float qn, float qp,
                                 const float *tops, int n, vf_t *dp, vf_t *bp, vf_t *dn, vf_t *bn)
{
    const vf_t zero = vf_zero(), one = vf_set1(1.0f);
    vm_t live = vf_gt(amax, zero);
    vf_t safe = vf_blend(one, amax, live);
    vf_t base = vf_maskz_div(live, safe, vf_set1(qp));
    vf_t d0 = base, d1 = vf_neg(base), b0 = zero, b1 = zero;
    float wv[32 * VW] __attribute__((aligned(VW * 4)));
    if (!unit)
        for (int i = 0; i < 32; i++) vf_store(wv + VW * i, vf_mul(vf_set1(w[i]), vf_load(V + VW * i)));
    for (int j = 0; j < n; j += QS_PASS) {   /* every table has a multiple of QS_PASS candidates */
        vf_t is[QS_PASS], acc[4 * QS_PASS];
        for (int c = 0; c < QS_PASS; c++) is[c] = vf_div(vf_set1(tops[j + c]), safe);
        for (int k = 0; k < 4 * QS_PASS; k++) acc[k] = zero;
        if (unit)
            VSFX(sums)(V, wv, w, 1, is, qn, qp, acc);
        else
            VSFX(sums)(V, wv, w, 0, is, qn, qp, acc);
        for (int c = 0; c < QS_PASS; c++) {
            VSFX(keep)(acc[4 * c], acc[4 * c + 1], live, 0, &b0, &d0);
            VSFX(keep)(acc[4 * c + 2], acc[4 * c + 3], live, 1, &b1, &d1);
        }
    }
    *dp = d0;
    *bp = b0;
    *dn = d1;
    *bn = b1;
}

/* codes of one block of one row, row-major: q = clamp(rint(v * inv), qn, qp), packed LSB first */
VTARGET static void VSFX(codes_row)(const float *row, size_t c0, size_t nc, float lo, float hi, float inv, float qn,
                                    float qp, int bits, uint8_t *dst)
{
    vf_t vlo = vf_set1(lo), vhi = vf_set1(hi), vi = vf_set1(inv), vp = vf_set1(qp), vn = vf_set1(qn), x[32 / VW];
    for (size_t k = 0; k < 32 / VW; k++) {
        vf_t v = VW * k < nc ? vf_load_clip(row + c0, k, nc, vlo, vhi) : vf_zero();
        x[k] = vf_min(vf_max(vf_rint(vf_mul(v, vi)), vn), vp);
    }
    vf_codes32(x, bits, dst);
}

VTARGET static int VSFX(group_block)(int bits, const float *src, size_t cols, size_t bpr, size_t nl, float lo,
                                     float hi, const float *weights, uint16_t *scales, uint8_t *codes)
{
    const float qp = (float)((1 << (bits - 1)) - 1), qn = -qp - 1.0f;
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qp, tops), overflow = 0;
    vm_t act = vm_first(nl);
    float V[32 * VW] __attribute__((aligned(VW * 4))), w[32], inv[VW];
    uint16_t hs[VW];
    size_t bb = (size_t)bits * 4;
    for (size_t b = 0; b < bpr; b++) {
        size_t c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
        weights_of(weights, c0, nc, w);
        int unit = !weights && nc == 32;
        vf_t amax = VSFX(load_t)(src, cols, nl, c0, nc, lo, hi, V);
        vf_t base = vf_maskz_div(vf_gt(amax, vf_zero()), amax, vf_set1(qp));
        vh_t h = vf_to_h(base), hm = VSFX(trunc_h)(base);
        overflow |= VSFX(any_inf_h)(h, act);
        vf_t dp, bp, dn, bn, e, em;
        VSFX(search)(V, w, unit, amax, qn, qp, tops, n, &dp, &bp, &dn, &bn);
        vh_t hsr = VSFX(clamp_h)(vf_to_h(vf_blend(dn, dp, vf_ge(bp, bn))));
        VSFX(err2)(V, w, VSFX(dec_h)(h), V, w, VSFX(dec_h)(hm), unit, qn, qp, &e, &em);
        vm_t take = vf_lt(em, e);
        h = vh_blend(h, hm, take);
        e = vf_blend(e, em, take);
        take = vf_lt(VSFX(err1)(V, w, unit, VSFX(dec_h)(hsr), qn, qp), e);
        h = vh_blend(h, hsr, take);
        vh_storeu(hs, h);
        vf_storeu(inv, VSFX(inv)(VSFX(dec_h)(h)));
        for (size_t l = 0; l < nl; l++) {
            scales[l * bpr + b] = hs[l];
            VSFX(codes_row)(src + l * cols, c0, nc, lo, hi, inv[l], qn, qp, bits, codes + (l * bpr + b) * bb);
        }
    }
    return overflow;
}

/* the total error of a super-block's nb blocks at the scales sc[k], summed in block order */
VTARGET static vf_t VSFX(total)(const float (*V)[32 * VW], const float (*w)[32], const int *unit, const vf_t *sc,
                                int nb, float qn, float qp)
{
    vf_t e[8], T = vf_zero();
    for (int k = 0; k < nb; k += 2) {   /* two blocks per pass */
        int k1 = k + 1 < nb ? k + 1 : k;
        VSFX(err2)(V[k], w[k], sc[k], V[k1], w[k1], sc[k1], unit[k] && unit[k1], qn, qp, &e[k], &e[k1]);
    }
    for (int k = 0; k < nb; k++) T = vf_add(T, e[k]);
    return T;
}

VTARGET static int VSFX(group_super)(int bits, const float *src, size_t cols, size_t bpr, size_t spr, size_t nl,
                                     float lo, float hi, const float *weights, uint16_t *supers, uint8_t *sub,
                                     uint8_t *codes)
{
    const float qp = (float)((1 << (bits - 1)) - 1), qn = -qp - 1.0f;
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qp, tops), overflow = 0;
    vm_t act = vm_first(nl);
    float V[8][32 * VW] __attribute__((aligned(VW * 4))), w[8][32], uu[VW], inv[VW];
    uint16_t hs[VW];
    const vf_t zero = vf_zero(), c32 = vf_set1(32.0f), one = vf_set1(1.0f), c63 = vf_set1(63.0f), vp = vf_set1(qp);
    size_t bb = (size_t)bits * 4;
    for (size_t s = 0; s < spr; s++) {
        int nb = (int)(bpr - s * 8 < 8 ? bpr - s * 8 : 8);
        vf_t amax[8], base[8], mag[2][8], u[8], uc[8], sc[8], M = zero, D[2] = {zero, zero};
        int unit[8];
        for (int k = 0; k < nb; k++) {
            size_t c0 = (s * 8 + (size_t)k) * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            weights_of(weights, c0, nc, w[k]);
            unit[k] = !weights && nc == 32;
            amax[k] = VSFX(load_t)(src, cols, nl, c0, nc, lo, hi, V[k]);
            base[k] = vf_maskz_div(vf_gt(amax[k], zero), amax[k], vp);
            vf_t bp, dn, bn;
            VSFX(search)(V[k], w[k], unit[k], amax[k], qn, qp, tops, n, &mag[0][k], &bp, &dn, &bn);
            mag[1][k] = vf_neg(dn);
            M = vf_max(M, base[k]);
            D[0] = vf_max(D[0], mag[0][k]);
            D[1] = vf_max(D[1], mag[1][k]);
        }
        /* 1. the single-pass choice */
        vh_t H = vf_to_h(M);
        overflow |= VSFX(any_inf_h)(H, act);
        vf_t S = VSFX(dec_h)(H);
        vm_t spos = vf_gt(S, zero);
        for (int k = 0; k < nb; k++) {
            u[k] = VSFX(u6)(base[k], S, vm_and(vf_gt(base[k], zero), spos));
            sc[k] = vf_maskz(vf_gt(u[k], zero), vf_mul(S, vf_div(u[k], c32)));
        }
        vf_t E = VSFX(total)((const float(*)[32 * VW])V, (const float(*)[32])w, unit, sc, nb, qn, qp);
        /* 2. mantle's: the truncated super scale, sub-scales from the unrounded one */
        {
            vh_t Hc = VSFX(trunc_h)(M);
            vf_t Sc = VSFX(dec_h)(Hc);
            for (int k = 0; k < nb; k++) {
                uc[k] = VSFX(u6)(base[k], M, vf_gt(base[k], zero));
                sc[k] = vf_maskz(vf_gt(uc[k], zero), vf_mul(Sc, vf_div(uc[k], c32)));
            }
            vf_t T = VSFX(total)((const float(*)[32 * VW])V, (const float(*)[32])w, unit, sc, nb, qn, qp);
            vm_t take = vf_lt(T, E);
            E = vf_blend(E, T, take);
            H = vh_blend(H, Hc, take);
            for (int k = 0; k < nb; k++) u[k] = vf_blend(u[k], uc[k], take);
        }
        /* 3. the searched choices: per sign, the super scales that give the largest block optimum u6 = 63, 62 */
        for (int sg = 0; sg < 2; sg++) {
            vm_t anyd = vm_and(vf_gt(D[sg], zero), act);
            if (!vm_any(anyd)) continue;
            for (int c = 0; c < MCF_SUPER_CANDIDATES; c++) {
                vh_t hc = VSFX(clamp_h)(vf_to_h(vf_div(vf_mul(D[sg], c32), vf_set1((float)(63 - c)))));
                vf_t Sc = VSFX(dec_h)(hc), T = zero;
                for (int k = 0; k < nb; k++) {
                    vm_t live = vf_gt(amax[k], zero);
                    vf_t f = vf_floor(vf_div(vf_mul(mag[sg][k], c32), Sc));
                    vf_t ua = vf_min(vf_max(f, one), c63), ub = vf_min(vf_max(vf_add(f, one), one), c63);
                    vf_t sa = vf_mul(Sc, vf_div(ua, c32)), sb = vf_mul(Sc, vf_div(ub, c32)), ea, eb;
                    VSFX(err2)(V[k], w[k], sg ? vf_neg(sa) : sa, V[k], w[k], sg ? vf_neg(sb) : sb, unit[k], qn, qp,
                               &ea, &eb);
                    vm_t pb = vf_lt(eb, ea);
                    uc[k] = vf_maskz(live, vf_blend(ua, ub, pb));
                    T = vf_add(T, vf_maskz(live, vf_blend(ea, eb, pb)));
                }
                vm_t take = vm_and(anyd, vf_lt(T, E));
                E = vf_blend(E, T, take);
                if (sg) hc = vh_or(hc, F16_SIGN);
                H = vh_blend(H, hc, take);
                for (int k = 0; k < nb; k++) u[k] = vf_blend(u[k], uc[k], take);
            }
        }
        vh_storeu(hs, H);
        S = VSFX(dec_h)(H);
        for (size_t l = 0; l < nl; l++) supers[l * spr + s] = hs[l];
        for (int k = 0; k < nb; k++) {
            size_t b = s * 8 + (size_t)k, c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            vf_storeu(uu, u[k]);
            vf_storeu(inv, VSFX(inv)(vf_maskz(vf_gt(u[k], zero), vf_mul(S, vf_div(u[k], c32)))));
            for (size_t l = 0; l < nl; l++) {
                sub[l * bpr + b] = (uint8_t)uu[l];
                VSFX(codes_row)(src + l * cols, c0, nc, lo, hi, inv[l], qn, qp, bits, codes + (l * bpr + b) * bb);
            }
        }
    }
    return overflow;
}
