/* The NEON variant of the single-pass and Go-compatible quantizers' per-block steps (part of
 * csrc/quantize.c, included there on aarch64 only), the AVX2 steps with 4 lanes: clamp to the clips and
 * |x| maximum (load), then x * inv rounded half away from zero (FRINTA: exactly what qround does in double
 * for a float32 product), clamped to +-qmax and packed (codes).  A non-finite inv takes the scalar steps, as
 * in the AVX2 variant. */

static float load_neon(const float *row, size_t c0, size_t cols, float lo, float hi, float v[32])
{
    size_t n = cols - c0 < 32 ? cols - c0 : 32;
    float32x4_t vlo = vdupq_n_f32(lo), vhi = vdupq_n_f32(hi), mx = vdupq_n_f32(0.0f);
    float tmp[32] = {0};
    const float *p = row + c0;
    if (n < 32) {   /* padding lanes are +0 */
        memcpy(tmp, p, n * sizeof(float));
        p = tmp;
    }
    for (int k = 0; k < 8; k++) {
        float32x4_t x = vld1q_f32(p + 4 * k);
        x = vbslq_f32(vcltq_f32(x, vlo), vlo, x);   /* v < lo ? lo : (v > hi ? hi : v): NaN passes */
        x = vbslq_f32(vcgtq_f32(x, vhi), vhi, x);
        if ((size_t)(4 * k) >= n) x = vdupq_n_f32(0.0f);
        else if ((size_t)(4 * k + 4) > n) {
            static const uint32_t idx[4] = {0, 1, 2, 3};
            uint32x4_t live = vcltq_u32(vld1q_u32(idx), vdupq_n_u32((uint32_t)(n - 4 * (size_t)k)));
            x = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x), live));
        }
        vst1q_f32(v + 4 * k, x);
        float32x4_t a = vabsq_f32(x);
        mx = vbslq_f32(vcgtq_f32(a, mx), a, mx);    /* a > mx ? a : mx, as the scalar loop */
    }
    float m[4];
    vst1q_f32(m, mx);
    float r = 0.0f;
    for (int i = 0; i < 4; i++) r = m[i] > r ? m[i] : r;
    return r;
}

static void codes_neon(const float v[32], float inv, int32_t qmax, int compat, int bits, uint8_t *dst)
{
    if (!isfinite(inv)) {
        codes_scalar(v, inv, qmax, compat, bits, dst);
        return;
    }
    float32x4_t vi = vdupq_n_f32(inv), hi = vdupq_n_f32((float)qmax), lo = vdupq_n_f32(-(float)qmax);
    int32x4_t q[8];
    for (int k = 0; k < 8; k++) {
        float32x4_t t = vrndaq_f32(vmulq_f32(vld1q_f32(v + 4 * k), vi));
        t = vbslq_f32(vcltq_f32(t, lo), lo, t);
        t = vbslq_f32(vcgtq_f32(t, hi), hi, t);
        q[k] = vcvtq_s32_f32(t);
    }
    mcf_store_codes32_neon(q, bits, dst);
}
