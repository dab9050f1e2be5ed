/* The NEON kernels of the legacy and K-quant ggml types (part of csrc/gguf_dequant.c, included there on
 * aarch64 only: it shares that file's scale helpers, k4_factors, q2_k_factors..., and field loads).  Each is
 * the AVX2 kernel's algorithm with 16-byte registers: codes as bytes, widened to float32, then the
 * reference's products and differences, one float32 operation each in the reference's order.  Streaming
 * stores are an x86 matter: `st` is ignored (AArch64's non-temporal STNP has no C intrinsic). */

/* 16 codes u - bias -> 16 floats s * (u - bias) (the code is exact in float32: mcf_u8x16_to_f32_neon) */
static inline void emit16s_neon(uint8x16_t u, float bias, float s, float *y)
{
    float32x4_t f[4], vs = vdupq_n_f32(s);
    mcf_u8x16_to_f32_neon(u, bias, f);
    vst1q_f32_x4(y, (float32x4x4_t){{vmulq_f32(vs, f[0]), vmulq_f32(vs, f[1]), vmulq_f32(vs, f[2]), vmulq_f32(vs, f[3])}});
}

/* 16 unsigned codes -> 16 floats s * q - m */
static inline void emit16u_neon(uint8x16_t q, float s, float m, float *y)
{
    float32x4_t f[4], vs = vdupq_n_f32(s), vm = vdupq_n_f32(m);
    mcf_u8x16_to_f32_neon(q, 0.0f, f);
    vst1q_f32_x4(y, (float32x4x4_t){{vsubq_f32(vmulq_f32(vs, f[0]), vm), vsubq_f32(vmulq_f32(vs, f[1]), vm),
                                     vsubq_f32(vmulq_f32(vs, f[2]), vm), vsubq_f32(vmulq_f32(vs, f[3]), vm)}});
}

static void q8_0_neon(const uint8_t *x, size_t nb, float *y, int st)
{
    (void)st;
    for (size_t b = 0; b < nb; b++, x += 34, y += 32) {
        float32x4_t d = vdupq_n_f32(f16(x));
        for (int k = 0; k < 2; k++) {   /* (float)q * d, the reference's order */
            float32x4_t f[4];
            mcf_u8x16_to_f32_neon(veorq_u8(vld1q_u8(x + 2 + 16 * k), vdupq_n_u8(0x80)), 128.0f, f);
            vst1q_f32_x4(y + 16 * k, (float32x4x4_t){{vmulq_f32(f[0], d), vmulq_f32(f[1], d), vmulq_f32(f[2], d),
                                                      vmulq_f32(f[3], d)}});
        }
    }
}

static void q4_0_neon(const uint8_t *x, size_t nb, float *y, int st)
{
    (void)st;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    for (size_t b = 0; b < nb; b++, x += 18, y += 32) {
        float d = f16(x);
        uint8x16_t v = vld1q_u8(x + 2);
        emit16s_neon(vandq_u8(v, m4), 8.0f, d, y);   /* nibble - 8 */
        emit16s_neon(vshrq_n_u8(v, 4), 8.0f, d, y + 16);
    }
}

static void q4_k_neon(const uint8_t *x, size_t nb, float *y, int st)
{
    (void)st;
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    for (size_t b = 0; b < nb; b++, x += 144, y += QK_K) {
        float ds[8], dm[8];
        k4_factors(x, ds, dm);
        for (int g = 0; g < 4; g++) {
            uint8x16_t v0 = vld1q_u8(x + 16 + 32 * g), v1 = vld1q_u8(x + 32 + 32 * g);
            float *o = y + 64 * g;
            emit16u_neon(vandq_u8(v0, m4), ds[2 * g], dm[2 * g], o);
            emit16u_neon(vandq_u8(v1, m4), ds[2 * g], dm[2 * g], o + 16);
            emit16u_neon(vshrq_n_u8(v0, 4), ds[2 * g + 1], dm[2 * g + 1], o + 32);
            emit16u_neon(vshrq_n_u8(v1, 4), ds[2 * g + 1], dm[2 * g + 1], o + 48);
        }
    }
}

static void q5_k_neon(const uint8_t *x, size_t nb, float *y, int st)
{
    (void)st;
    const uint8x16_t m4 = vdupq_n_u8(0x0f), one = vdupq_n_u8(1);
    for (size_t b = 0; b < nb; b++, x += 176, y += QK_K) {
        float ds[8], dm[8];
        k4_factors(x, ds, dm);
        uint8x16_t qh[2] = {vld1q_u8(x + 16), vld1q_u8(x + 32)};
        for (int g = 0; g < 4; g++) {
            float *o = y + 64 * g;
            for (int k = 0; k < 2; k++) {   /* elements j = 16k .. 16k+15 of each 32 */
                uint8x16_t v = vld1q_u8(x + 48 + 32 * g + 16 * k);
                int8x16_t s0 = vdupq_n_s8((int8_t)-(2 * g)), s1 = vdupq_n_s8((int8_t)-(2 * g + 1));
                uint8x16_t h0 = vshlq_n_u8(vandq_u8(vshlq_u8(qh[k], s0), one), 4);
                uint8x16_t h1 = vshlq_n_u8(vandq_u8(vshlq_u8(qh[k], s1), one), 4);
                emit16u_neon(vorrq_u8(vandq_u8(v, m4), h0), ds[2 * g], dm[2 * g], o + 16 * k);
                emit16u_neon(vorrq_u8(vshrq_n_u8(v, 4), h1), ds[2 * g + 1], dm[2 * g + 1], o + 32 + 16 * k);
            }
        }
    }
}

static void q6_k_neon(const uint8_t *x, size_t nb, float *y, int st)
{
    (void)st;
    const uint8x16_t m4 = vdupq_n_u8(0x0f), m2 = vdupq_n_u8(3);
    for (size_t b = 0; b < nb; b++, x += 210, y += QK_K) {
        float ds[16];
        q6_k_factors(x, ds);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 2; k++) {   /* the 16-byte halves of the AVX2 kernel's 32-byte registers */
                uint8x16_t l0 = vld1q_u8(x + 64 * h + 16 * k), l1 = vld1q_u8(x + 64 * h + 32 + 16 * k);
                uint8x16_t qh = vld1q_u8(x + 128 + 32 * h + 16 * k);
                for (int t = 0; t < 4; t++) {
                    uint8x16_t lsrc = (t & 1) ? l1 : l0;
                    uint8x16_t lo = (t >> 1) ? vshrq_n_u8(lsrc, 4) : vandq_u8(lsrc, m4);
                    uint8x16_t hi = vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)(-2 * t))), m2);
                    int sb = (h * 128 + 32 * t) >> 4;   /* (lo | hi << 4) - 32 */
                    emit16s_neon(vorrq_u8(lo, vshlq_n_u8(hi, 4)), 32.0f, ds[sb + k], y + h * 128 + 32 * t + 16 * k);
                }
            }
    }
}

static void q2_k_neon(const uint8_t *x, size_t nb, float *y, int st)
{
    (void)st;
    const uint8x16_t m2 = vdupq_n_u8(3);
    for (size_t b = 0; b < nb; b++, x += 84, y += QK_K) {
        float dl[16], ml[16];
        q2_k_factors(x, dl, ml);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 2; k++) {
                uint8x16_t v = vld1q_u8(x + 16 + 32 * h + 16 * k);
                for (int s = 0; s < 4; s++) {
                    uint8x16_t q = vandq_u8(vshlq_u8(v, vdupq_n_s8((int8_t)(-2 * s))), m2);
                    int sb = ((h * 128 + 32 * s) >> 4) + k;
                    emit16u_neon(q, dl[sb], ml[sb], y + h * 128 + 32 * s + 16 * k);
                }
            }
    }
}

static void q3_k_neon(const uint8_t *x, size_t nb, float *y, int st)
{
    (void)st;
    const uint8x16_t m2 = vdupq_n_u8(3), one = vdupq_n_u8(1);
    for (size_t b = 0; b < nb; b++, x += 110, y += QK_K) {
        float dl[16];
        q3_k_factors(x, dl);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 2; k++) {
                uint8x16_t v = vld1q_u8(x + 32 + 32 * h + 16 * k), hm = vld1q_u8(x + 16 * k);
                for (int sh = 0; sh < 4; sh++) {
                    uint8x16_t ql = vandq_u8(vshlq_u8(v, vdupq_n_s8((int8_t)(-2 * sh))), m2);
                    uint8x16_t hb = vandq_u8(vshlq_u8(hm, vdupq_n_s8((int8_t)(-(4 * h + sh)))), one);
                    int sb = ((h * 128 + 32 * sh) >> 4) + k;   /* (ql | hb << 2) - 4 */
                    emit16s_neon(vorrq_u8(ql, vshlq_n_u8(hb, 2)), 4.0f, dl[sb], y + h * 128 + 32 * sh + 16 * k);
                }
            }
    }
}

/* F16 / BF16: the shared conversions (fpconv_neon.h) */
static void f16_neon(const uint8_t *x, size_t n, float *y, int st) { (void)st; mcf_convert(MCF_F16_TO_F32, x, y, n, MCF_IMPL_NEON); }
static void bf16_neon(const uint8_t *x, size_t n, float *y, int st) { (void)st; mcf_convert(MCF_BF16_TO_F32, x, y, n, MCF_IMPL_NEON); }
