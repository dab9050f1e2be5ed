/* The NEON variant of the error-minimizing quantizer (part of csrc/quant_search.c, included there on aarch64
 * only): the AVX2 variant's steps with 4 rows per call, lane l = row r0 + l, so each lane runs the scalar
 * sequence of float32 operations on its own row's block (the top of quant_search.c says why that makes it
 * bit-identical).  AArch64's FMAX/FMIN return NaN for a NaN operand where the scalar code's `a > b ? a : b`
 * returns b, so maxima and minima are compare-and-select (max4/min4: x86's maxps/minps exactly); FRINTN is
 * rintf, FRINTZ / FRINTM the truncation and floor; FCVTN / FCVTL are the f16 conversions. */

static inline float32x4_t max4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
static inline float32x4_t min4(float32x4_t a, float32x4_t b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
/* b where m, else a (x86's blendv(a, b, m)) */
static inline float32x4_t sel4(float32x4_t a, float32x4_t b, uint32x4_t m) { return vbslq_f32(m, b, a); }
static inline float32x4_t and4(uint32x4_t m, float32x4_t x)
{
    return vreinterpretq_f32_u32(vandq_u32(m, vreinterpretq_u32_f32(x)));
}
static inline float32x4_t neg4(float32x4_t x) { return vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x80000000u))); }

/* f16 scales as the decoder reads them: zero or subnormal -> +0 (as dec_ph8) */
static inline float32x4_t dec_ph4(uint16x4_t h)
{
    uint32x4_t sub = vreinterpretq_u32_s32(vmovl_s16(vreinterpret_s16_u16(vceqz_u16(vand_u16(h, vdup_n_u16(0x7c00))))));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(vcvt_f32_f16(vreinterpret_f16_u16(h))), sub));
}

static inline uint16x4_t f16_4(float32x4_t x) { return vreinterpret_u16_f16(vcvt_f16_f32(x)); }

static inline uint16x4_t clamp_h4(uint16x4_t h)
{
    uint16x4_t m = vand_u16(h, vdup_n_u16(0x7fff));
    m = vmin_u16(vmax_u16(m, vdup_n_u16(F16_MIN_NORMAL)), vdup_n_u16(F16_MAX_FINITE));
    return vorr_u16(m, vand_u16(h, vdup_n_u16(F16_SIGN)));
}

/* mcf_f32_to_f16_trunc of finite values >= 0, as trunc_h8 */
static inline uint16x4_t trunc_h4(float32x4_t x)
{
    int32x4_t u = vreinterpretq_s32_f32(x), e = vshrq_n_s32(u, 23);
    int32x4_t h = vorrq_s32(vshlq_n_s32(vsubq_s32(e, vdupq_n_s32(112)), 10), vandq_s32(vshrq_n_s32(u, 13), vdupq_n_s32(0x3ff)));
    h = vbslq_s32(vcgtq_s32(e, vdupq_n_s32(142)), vdupq_n_s32(0x7c00), h);
    h = vreinterpretq_s32_u32(vbicq_u32(vreinterpretq_u32_s32(h), vcgtq_s32(vdupq_n_s32(113), e)));
    return vmovn_u32(vreinterpretq_u32_s32(h));
}

/* 1 / s where s != 0 (NaN included), else 0 */
static inline float32x4_t inv4(float32x4_t s)
{
    uint32x4_t nz = vmvnq_u32(vceqzq_f32(s));
    return and4(nz, vdivq_f32(vdupq_n_f32(1.0f), sel4(vdupq_n_f32(1.0f), s, nz)));
}

/* u6_single_pass per lane where ok (else 0) */
static inline float32x4_t u6_4(float32x4_t base, float32x4_t super, uint32x4_t ok)
{
    const float32x4_t one = vdupq_n_f32(1.0f);
    float32x4_t t = vmulq_f32(and4(ok, vdivq_f32(base, sel4(one, super, ok))), vdupq_n_f32(32.0f));
    float32x4_t tt = vrndq_f32(t);
    uint32x4_t up = vcgeq_f32(vsubq_f32(t, tt), vdupq_n_f32(0.5f));
    tt = vaddq_f32(tt, and4(up, one));
    return and4(ok, min4(max4(tt, one), vdupq_n_f32(63.0f)));
}

static inline void transpose4(float32x4_t r[4])
{
    float32x4_t t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
    float32x4_t t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
    r[0] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[1] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
    r[2] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[3] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
}

/* the values c0 + 4q .. c0 + 4q + 3 of a row that has nc columns from c0: clamped to the clips, the lanes
 * past nc +0 (never read) */
static inline float32x4_t load4_clipped(const float *p, size_t q, size_t nc, float32x4_t vlo, float32x4_t vhi)
{
    float32x4_t x;
    if (4 * q + 4 <= nc) {
        x = vld1q_f32(p + 4 * q);
    } else {
        float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        memcpy(t, p + 4 * q, (nc - 4 * q) * sizeof(float));
        x = vld1q_f32(t);
    }
    x = vbslq_f32(vcltq_f32(x, vlo), vlo, x);
    x = vbslq_f32(vcgtq_f32(x, vhi), vhi, x);
    if (4 * q + 4 > nc) {   /* padding lanes are +0 (a clip above 0 would have raised them) */
        static const uint32_t idx[4] = {0, 1, 2, 3};
        x = and4(vcltq_u32(vld1q_u32(idx), vdupq_n_u32((uint32_t)(nc - 4 * q))), x);
    }
    return x;
}

/* Block (c0, nc columns) of rows 0..nl-1 (stride cols) into V[32][4], transposed: V[i*4 + l] = value i of
 * row l (padding and idle lanes 0).  Returns max |value| per lane. */
static float32x4_t load_t4(const float *src, size_t cols, size_t nl, size_t c0, size_t nc, float lo, float hi,
                           float *V)
{
    float32x4_t vlo = vdupq_n_f32(lo), vhi = vdupq_n_f32(hi), amax = vdupq_n_f32(0.0f), r[4];
    for (size_t q = 0; q < 8; q++) {
        for (size_t l = 0; l < 4; l++)
            r[l] = (l < nl && 4 * q < nc) ? load4_clipped(src + l * cols + c0, q, nc, vlo, vhi) : vdupq_n_f32(0.0f);
        transpose4(r);
        for (int i = 0; i < 4; i++) {
            vst1q_f32(V + 4 * (4 * q + (size_t)i), r[i]);
            amax = max4(amax, vabsq_f32(r[i]));
        }
    }
    return amax;
}

/* `unit`: every weight of the block(s) is 1, and the products by the weight are left out (as err1_8) */
static float32x4_t err1_4(const float *V, const float *w, int unit, float32x4_t s, float qn, float qp)
{
    float32x4_t vn = vdupq_n_f32(qn), vp = vdupq_n_f32(qp), iv = inv4(s), a = vdupq_n_f32(0.0f);
    for (int i = 0; i < 32; i++) {
        float32x4_t x = vld1q_f32(V + 4 * i);
        float32x4_t q = min4(max4(vrndnq_f32(vmulq_f32(x, iv)), vn), vp);
        float32x4_t r = vsubq_f32(x, vmulq_f32(s, q)), r2 = vmulq_f32(r, r);
        a = vaddq_f32(a, unit ? r2 : vmulq_f32(vdupq_n_f32(w[i]), r2));
    }
    return a;
}

static void err2_4(const float *V0, const float *w0, float32x4_t s0, const float *V1, const float *w1,
                   float32x4_t s1, int unit, float qn, float qp, float32x4_t *e0, float32x4_t *e1)
{
    float32x4_t vn = vdupq_n_f32(qn), vp = vdupq_n_f32(qp), i0 = inv4(s0), i1 = inv4(s1);
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = vdupq_n_f32(0.0f);
    for (int i = 0; i < 32; i++) {
        float32x4_t x0 = vld1q_f32(V0 + 4 * i), x1 = vld1q_f32(V1 + 4 * i);
        float32x4_t q0 = min4(max4(vrndnq_f32(vmulq_f32(x0, i0)), vn), vp);
        float32x4_t q1 = min4(max4(vrndnq_f32(vmulq_f32(x1, i1)), vn), vp);
        float32x4_t r0 = vsubq_f32(x0, vmulq_f32(s0, q0)), r1 = vsubq_f32(x1, vmulq_f32(s1, q1));
        float32x4_t p0 = vmulq_f32(r0, r0), p1 = vmulq_f32(r1, r1);
        a0 = vaddq_f32(a0, unit ? p0 : vmulq_f32(vdupq_n_f32(w0[i]), p0));
        a1 = vaddq_f32(a1, unit ? p1 : vmulq_f32(vdupq_n_f32(w1[i]), p1));
    }
    *e0 = a0;
    *e1 = a1;
}

static inline void keep4(float32x4_t slx, float32x4_t sl2, uint32x4_t live, int neg, float32x4_t *best,
                         float32x4_t *d)
{
    uint32x4_t pos = vcgtzq_f32(sl2);
    float32x4_t den = sel4(vdupq_n_f32(1.0f), sl2, pos);
    float32x4_t score = vdivq_f32(vmulq_f32(slx, slx), den);
    uint32x4_t better = vandq_u32(vandq_u32(pos, live), vcgtq_f32(score, *best));
    float32x4_t q = vdivq_f32(slx, den);
    if (neg) q = neg4(q);
    *best = sel4(*best, score, better);
    *d = sel4(*d, q, better);
}

static inline __attribute__((always_inline)) void sums4(const float *V, const float *wv, const float *w,
                                                        const int unit, float32x4_t is, float qn, float qp,
                                                        float32x4_t acc[4])
{
    const float32x4_t vn = vdupq_n_f32(qn), vp = vdupq_n_f32(qp), vmn = vdupq_n_f32(-qn), vmp = vdupq_n_f32(-qp);
    float32x4_t xp = acc[0], yp = acc[1], xm = acc[2], ym = acc[3];
    for (int i = 0; i < 32; i++) {
        float32x4_t x = vld1q_f32(V + 4 * i), wx = unit ? x : vld1q_f32(wv + 4 * i);
        float32x4_t r = vrndnq_f32(vmulq_f32(x, is));
        float32x4_t lp = min4(max4(r, vn), vp);
        float32x4_t lm = max4(min4(r, vmn), vmp);
        xp = vaddq_f32(xp, vmulq_f32(wx, lp));
        xm = vaddq_f32(xm, vmulq_f32(wx, lm));
        if (unit) {
            yp = vaddq_f32(yp, vmulq_f32(lp, lp));
            ym = vaddq_f32(ym, vmulq_f32(lm, lm));
        } else {
            float32x4_t wi = vdupq_n_f32(w[i]);
            yp = vaddq_f32(yp, vmulq_f32(vmulq_f32(wi, lp), lp));
            ym = vaddq_f32(ym, vmulq_f32(vmulq_f32(wi, lm), lm));
        }
    }
    acc[0] = xp;
    acc[1] = yp;
    acc[2] = xm;
    acc[3] = ym;
}

static void search4(const float *V, const float *w, int unit, float32x4_t amax, float qn, float qp,
                    const float *tops, int n, float32x4_t *dp, float32x4_t *bp, float32x4_t *dn, float32x4_t *bn)
{
    const float32x4_t zero = vdupq_n_f32(0.0f), one = vdupq_n_f32(1.0f);
    uint32x4_t live = vcgtzq_f32(amax);
    float32x4_t safe = sel4(one, amax, live);
    float32x4_t base = and4(live, vdivq_f32(safe, vdupq_n_f32(qp)));
    float32x4_t d0 = base, d1 = neg4(base), b0 = zero, b1 = zero;
    float wv[32 * 4] __attribute__((aligned(16)));
    if (!unit)
        for (int i = 0; i < 32; i++) vst1q_f32(wv + 4 * i, vmulq_f32(vdupq_n_f32(w[i]), vld1q_f32(V + 4 * i)));
    for (int j = 0; j < n; j++) {
        float32x4_t is = vdivq_f32(vdupq_n_f32(tops[j]), safe), acc[4] = {zero, zero, zero, zero};
        if (unit)
            sums4(V, wv, w, 1, is, qn, qp, acc);
        else
            sums4(V, wv, w, 0, is, qn, qp, acc);
        keep4(acc[0], acc[1], live, 0, &b0, &d0);
        keep4(acc[2], acc[3], live, 1, &b1, &d1);
    }
    *dp = d0;
    *bp = b0;
    *dn = d1;
    *bn = b1;
}

static void codes_row4(const float *row, size_t c0, size_t nc, float lo, float hi, float inv, float qn, float qp,
                       int bits, uint8_t *dst)
{
    float32x4_t vlo = vdupq_n_f32(lo), vhi = vdupq_n_f32(hi), vi = vdupq_n_f32(inv);
    float32x4_t vp = vdupq_n_f32(qp), vn = vdupq_n_f32(qn);
    int32x4_t q[8];
    for (size_t k = 0; k < 8; k++) {
        float32x4_t x = 4 * k < nc ? load4_clipped(row + c0, k, nc, vlo, vhi) : vdupq_n_f32(0.0f);
        q[k] = vcvtq_s32_f32(min4(max4(vrndnq_f32(vmulq_f32(x, vi)), vn), vp));
    }
    mcf_store_codes32_neon(q, bits, dst);
}

/* any active lane whose f16 value is infinite */
static inline int overflow4(uint16x4_t h, uint32x4_t act)
{
    uint16x4_t inf = vceq_u16(vand_u16(h, vdup_n_u16(0x7c00)), vdup_n_u16(0x7c00));
    return vmaxv_u16(vand_u16(inf, vmovn_u32(act))) != 0;
}

static inline uint32x4_t lanes_below(size_t nl)
{
    static const uint32_t idx[4] = {0, 1, 2, 3};
    return vcltq_u32(vld1q_u32(idx), vdupq_n_u32((uint32_t)nl));
}

static int group_block_neon(int bits, const float *src, size_t cols, size_t bpr, size_t nl, float lo, float hi,
                            const float *weights, uint16_t *scales, uint8_t *codes)
{
    const float qp = (float)((1 << (bits - 1)) - 1), qn = -qp - 1.0f;
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qp, tops), overflow = 0;
    uint32x4_t act = lanes_below(nl);
    float V[32 * 4] __attribute__((aligned(16))), w[32], inv[4];
    uint16_t hs[4];
    size_t bb = (size_t)bits * 4;
    for (size_t b = 0; b < bpr; b++) {
        size_t c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
        weights_of(weights, c0, nc, w);
        int unit = !weights && nc == 32;
        float32x4_t amax = load_t4(src, cols, nl, c0, nc, lo, hi, V);
        uint32x4_t live = vcgtzq_f32(amax);
        float32x4_t base = and4(live, vdivq_f32(amax, vdupq_n_f32(qp)));
        uint16x4_t h = f16_4(base), hm = trunc_h4(base);
        overflow |= overflow4(h, act);
        float32x4_t dp, bp, dn, bn, e, em;
        search4(V, w, unit, amax, qn, qp, tops, n, &dp, &bp, &dn, &bn);
        uint16x4_t hsr = clamp_h4(f16_4(sel4(dn, dp, vcgeq_f32(bp, bn))));
        err2_4(V, w, dec_ph4(h), V, w, dec_ph4(hm), unit, qn, qp, &e, &em);
        uint32x4_t take = vcltq_f32(em, e);
        h = vbsl_u16(vmovn_u32(take), hm, h);
        e = sel4(e, em, take);
        take = vcltq_f32(err1_4(V, w, unit, dec_ph4(hsr), qn, qp), e);
        h = vbsl_u16(vmovn_u32(take), hsr, h);
        vst1_u16(hs, h);
        vst1q_f32(inv, inv4(dec_ph4(h)));
        for (size_t l = 0; l < nl; l++) {
            scales[l * bpr + b] = hs[l];
            codes_row4(src + l * cols, c0, nc, lo, hi, inv[l], qn, qp, bits, codes + (l * bpr + b) * bb);
        }
    }
    return overflow;
}

static float32x4_t total4(const float (*V)[32 * 4], const float (*w)[32], const int *unit, const float32x4_t *sc,
                          int nb, float qn, float qp)
{
    float32x4_t e[8], T = vdupq_n_f32(0.0f);
    for (int k = 0; k < nb; k += 2) {   /* two blocks per pass */
        int k1 = k + 1 < nb ? k + 1 : k;
        err2_4(V[k], w[k], sc[k], V[k1], w[k1], sc[k1], unit[k] && unit[k1], qn, qp, &e[k], &e[k1]);
    }
    for (int k = 0; k < nb; k++) T = vaddq_f32(T, e[k]);
    return T;
}

static int group_super_neon(int bits, const float *src, size_t cols, size_t bpr, size_t spr, size_t nl, float lo,
                            float hi, const float *weights, uint16_t *supers, uint8_t *sub, uint8_t *codes)
{
    const float qp = (float)((1 << (bits - 1)) - 1), qn = -qp - 1.0f;
    float tops[MCF_SEARCH_MAX_CANDIDATES];
    int n = grid_tops(bits, qp, tops), overflow = 0;
    uint32x4_t act = lanes_below(nl);
    float V[8][32 * 4] __attribute__((aligned(16))), w[8][32], uu[4], inv[4];
    uint16_t hs[4];
    const float32x4_t zero = vdupq_n_f32(0.0f), c32 = vdupq_n_f32(32.0f), one = vdupq_n_f32(1.0f);
    const float32x4_t c63 = vdupq_n_f32(63.0f), vp = vdupq_n_f32(qp);
    size_t bb = (size_t)bits * 4;
    for (size_t s = 0; s < spr; s++) {
        int nb = (int)(bpr - s * 8 < 8 ? bpr - s * 8 : 8);
        float32x4_t amax[8], base[8], mag[2][8], u[8], uc[8], sc[8], M = zero, D[2] = {zero, zero};
        int unit[8];
        for (int k = 0; k < nb; k++) {
            size_t c0 = (s * 8 + (size_t)k) * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            weights_of(weights, c0, nc, w[k]);
            unit[k] = !weights && nc == 32;
            amax[k] = load_t4(src, cols, nl, c0, nc, lo, hi, V[k]);
            base[k] = and4(vcgtzq_f32(amax[k]), vdivq_f32(amax[k], vp));
            float32x4_t bp, dn, bn;
            search4(V[k], w[k], unit[k], amax[k], qn, qp, tops, n, &mag[0][k], &bp, &dn, &bn);
            mag[1][k] = neg4(dn);
            M = max4(M, base[k]);
            D[0] = max4(D[0], mag[0][k]);
            D[1] = max4(D[1], mag[1][k]);
        }
        /* 1. the single-pass choice */
        uint16x4_t H = f16_4(M);
        overflow |= overflow4(H, act);
        float32x4_t S = dec_ph4(H);
        uint32x4_t spos = vcgtzq_f32(S);
        for (int k = 0; k < nb; k++) {
            u[k] = u6_4(base[k], S, vandq_u32(vcgtzq_f32(base[k]), spos));
            sc[k] = and4(vcgtzq_f32(u[k]), vmulq_f32(S, vdivq_f32(u[k], c32)));
        }
        float32x4_t E = total4((const float(*)[32 * 4])V, (const float(*)[32])w, unit, sc, nb, qn, qp);
        /* 2. mantle's */
        {
            uint16x4_t Hc = trunc_h4(M);
            float32x4_t Sc = dec_ph4(Hc);
            for (int k = 0; k < nb; k++) {
                uc[k] = u6_4(base[k], M, vcgtzq_f32(base[k]));
                sc[k] = and4(vcgtzq_f32(uc[k]), vmulq_f32(Sc, vdivq_f32(uc[k], c32)));
            }
            float32x4_t T = total4((const float(*)[32 * 4])V, (const float(*)[32])w, unit, sc, nb, qn, qp);
            uint32x4_t take = vcltq_f32(T, E);
            E = sel4(E, T, take);
            H = vbsl_u16(vmovn_u32(take), Hc, H);
            for (int k = 0; k < nb; k++) u[k] = sel4(u[k], uc[k], take);
        }
        /* 3. the searched choices */
        for (int sg = 0; sg < 2; sg++) {
            uint32x4_t anyd = vandq_u32(vcgtzq_f32(D[sg]), act);
            if (!vmaxvq_u32(anyd)) continue;
            for (int c = 0; c < MCF_SUPER_CANDIDATES; c++) {
                uint16x4_t hc = clamp_h4(f16_4(vdivq_f32(vmulq_f32(D[sg], c32), vdupq_n_f32((float)(63 - c)))));
                float32x4_t Sc = dec_ph4(hc), T = zero;
                for (int k = 0; k < nb; k++) {
                    uint32x4_t live = vcgtzq_f32(amax[k]);
                    float32x4_t f = vrndmq_f32(vdivq_f32(vmulq_f32(mag[sg][k], c32), Sc));
                    float32x4_t ua = min4(max4(f, one), c63);
                    float32x4_t ub = min4(max4(vaddq_f32(f, one), one), c63);
                    float32x4_t sa = vmulq_f32(Sc, vdivq_f32(ua, c32)), sb = vmulq_f32(Sc, vdivq_f32(ub, c32));
                    float32x4_t ea, eb;
                    err2_4(V[k], w[k], sg ? neg4(sa) : sa, V[k], w[k], sg ? neg4(sb) : sb, unit[k], qn, qp, &ea, &eb);
                    uint32x4_t pb = vcltq_f32(eb, ea);
                    uc[k] = and4(live, sel4(ua, ub, pb));
                    T = vaddq_f32(T, and4(live, sel4(ea, eb, pb)));
                }
                uint32x4_t take = vandq_u32(anyd, vcltq_f32(T, E));
                E = sel4(E, T, take);
                if (sg) hc = vorr_u16(hc, vdup_n_u16(F16_SIGN));
                H = vbsl_u16(vmovn_u32(take), hc, H);
                for (int k = 0; k < nb; k++) u[k] = sel4(u[k], uc[k], take);
            }
        }
        vst1_u16(hs, H);
        S = dec_ph4(H);
        for (size_t l = 0; l < nl; l++) supers[l * spr + s] = hs[l];
        for (int k = 0; k < nb; k++) {
            size_t b = s * 8 + (size_t)k, c0 = b * 32, nc = cols - c0 < 32 ? cols - c0 : 32;
            uint32x4_t upos = vcgtzq_f32(u[k]);
            vst1q_f32(uu, u[k]);
            vst1q_f32(inv, inv4(and4(upos, vmulq_f32(S, vdivq_f32(u[k], c32)))));
            for (size_t l = 0; l < nl; l++) {
                sub[l * bpr + b] = (uint8_t)uu[l];
                codes_row4(src + l * cols, c0, nc, lo, hi, inv[l], qn, qp, bits, codes + (l * bpr + b) * bb);
            }
        }
    }
    return overflow;
}
