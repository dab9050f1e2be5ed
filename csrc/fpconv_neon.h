/* The NEON variant of the array conversions (part of csrc/fpconv_simd.c, included there on aarch64 only).
 * Same bits as the scalar loops of fpconv.c: FCVTL widens f16 exactly but quiets a signalling NaN, so NaN
 * lanes are rebuilt with integer operations (sign, all-ones exponent, payload << 13), as the scalar code
 * and the x86 variants do; FCVTN narrows with round to nearest even, subnormals kept (Linux leaves FPCR's
 * flush-to-zero bits clear), NaN quieted with its top payload bits, which is mcf_f32_to_f16_one. */

static void f16_to_f32_neon(const uint16_t *s, float *d, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint16x8_t h = vld1q_u16(s + i);
        vst1q_f32(d + i, mcf_h2f_neon(vget_low_u16(h)));
        vst1q_f32(d + i + 4, mcf_h2f_neon(vget_high_u16(h)));
    }
    for (; i < n; i++) d[i] = mcf_f16_to_f32_one(s[i]);
}

static void f32_to_f16_neon(const float *s, uint16_t *d, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        vst1q_u16(d + i, vcombine_u16(mcf_f16_round_neon(vld1q_f32(s + i)), mcf_f16_round_neon(vld1q_f32(s + i + 4))));
    for (; i < n; i++) d[i] = mcf_f32_to_f16_one(s[i]);
}

static void bf16_to_f32_neon(const uint16_t *s, float *d, size_t n)
{
    size_t i = 0;
    uint32_t *o = (uint32_t *)d;
    for (; i + 8 <= n; i += 8) {
        uint16x8_t h = vld1q_u16(s + i);
        vst1q_u32(o + i, vshll_n_u16(vget_low_u16(h), 16));
        vst1q_u32(o + i + 4, vshll_high_n_u16(h, 16));
    }
    for (; i < n; i++) o[i] = (uint32_t)s[i] << 16;
}

static void f32_to_bf16_neon(const float *s, uint16_t *d, size_t n)
{
    size_t i = 0;
    const uint32_t *u = (const uint32_t *)s;
    for (; i + 8 <= n; i += 8)
        vst1q_u16(d + i, vcombine_u16(mcf_bf16_round_neon(vld1q_u32(u + i)), mcf_bf16_round_neon(vld1q_u32(u + i + 4))));
    for (; i < n; i++) d[i] = mcf_f32_to_bf16_one(s[i]);
}
