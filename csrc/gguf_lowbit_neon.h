/* The NEON unpackers of the ternary, 1-/2-bit and FP4 types (part of csrc/gguf_lowbit.c, included there on
 * aarch64 only): blocks unpacked into int8 codes and float32 scales as the AVX2 unpackers do (the kernels are
 * made in gguf_lowbit.c, with MXFP4's unpacker, which both architectures share); Q1_0's kernel selects d or
 * -d per bit, as the scalar code does. */

/* tern_digit of every byte of b: (uint8)(b * 3^n) * 3 >> 8, minus 1 */
static inline uint8x16_t tern_digits_neon(uint8x16_t b, int n)
{
    uint8x16_t q = vmulq_u8(b, vdupq_n_u8(pow3[n]));
    uint8x8_t lo = vshrn_n_u16(vmull_u8(vget_low_u8(q), vdup_n_u8(3)), 8);
    uint8x8_t hi = vshrn_n_u16(vmull_high_u8(q, vdupq_n_u8(3)), 8);
    return vsubq_u8(vcombine_u8(lo, hi), vdupq_n_u8(1));
}

static inline void tq1_0_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    scales[0] = mcf_f16_at(x + 52);
    uint8x16_t v0 = vld1q_u8(x), v1 = vld1q_u8(x + 16), v2 = vld1q_u8(x + 32);
    for (int n = 0; n < 5; n++) {
        vst1q_u8((uint8_t *)codes + 32 * n, tern_digits_neon(v0, n));
        vst1q_u8((uint8_t *)codes + 32 * n + 16, tern_digits_neon(v1, n));
        vst1q_u8((uint8_t *)codes + 160 + 16 * n, tern_digits_neon(v2, n));
    }
    for (int n = 0; n < 4; n++)
        for (int m = 0; m < 4; m++) codes[240 + 4 * n + m] = (int8_t)tern_digit(x[48 + m], n);
}

static inline void tq2_0_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    const uint8x16_t m2 = vdupq_n_u8(3), one = vdupq_n_u8(1);
    scales[0] = mcf_f16_at(x + 64);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 2; k++) {
            uint8x16_t v = vld1q_u8(x + 32 * h + 16 * k);
            for (int s = 0; s < 4; s++)
                vst1q_u8((uint8_t *)codes + 128 * h + 32 * s + 16 * k,
                         vsubq_u8(vandq_u8(vshlq_u8(v, vdupq_n_s8((int8_t)(-2 * s))), m2), one));
        }
}

static inline void q2_0_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    const uint8x16_t m2 = vdupq_n_u8(3), one = vdupq_n_u8(1);
    scales[0] = mcf_f16_at(x);
    uint8x16_t q = vld1q_u8(x + 2), p[4];
    for (int k = 0; k < 4; k++) p[k] = vsubq_u8(vandq_u8(vshlq_u8(q, vdupq_n_s8((int8_t)(-2 * k))), m2), one);
    /* interleave the four 2-bit planes back into element order: byte i gives elements 4i..4i+3 */
    uint16x8_t a = vreinterpretq_u16_u8(vzip1q_u8(p[0], p[1])), b = vreinterpretq_u16_u8(vzip1q_u8(p[2], p[3]));
    uint16x8_t c = vreinterpretq_u16_u8(vzip2q_u8(p[0], p[1])), e = vreinterpretq_u16_u8(vzip2q_u8(p[2], p[3]));
    vst1q_u16((uint16_t *)codes, vzip1q_u16(a, b));
    vst1q_u16((uint16_t *)(codes + 16), vzip2q_u16(a, b));
    vst1q_u16((uint16_t *)(codes + 32), vzip1q_u16(c, e));
    vst1q_u16((uint16_t *)(codes + 48), vzip2q_u16(c, e));
}

static inline void nvfp4_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int8x16_t table = vld1q_s8(mcf_e2m1_x2);
    for (int s = 0; s < 4; s++) scales[s] = ue4m3_half(x[s]);
    for (int h = 0; h < 2; h++) {   /* two sub-blocks of 8 bytes each: low nibbles, then high nibbles */
        uint8x16_t q = vld1q_u8(x + 4 + 16 * h);
        uint64x2_t lo = vreinterpretq_u64_u8(vandq_u8(q, m4)), hi = vreinterpretq_u64_u8(vshrq_n_u8(q, 4));
        vst1q_s8(codes + 32 * h, vqtbl1q_s8(table, vreinterpretq_u8_u64(vzip1q_u64(lo, hi))));
        vst1q_s8(codes + 32 * h + 16, vqtbl1q_s8(table, vreinterpretq_u8_u64(vzip2q_u64(lo, hi))));
    }
}

/* Q1_0: a sign-bit select, not a product (-d flips the sign of a NaN scale too, as the scalar code does) */
void mcf_gguf_q1_0_neon(const uint8_t *x, size_t nb, float *y, int st)
{
    static const uint32_t bit[8] = {1, 2, 4, 8, 16, 32, 64, 128};
    const uint32x4_t b0 = vld1q_u32(bit), b1 = vld1q_u32(bit + 4);
    (void)st;
    for (size_t b = 0; b < nb; b++, x += 18, y += 128) {
        float d = mcf_f16_at(x);
        float32x4_t pos = vdupq_n_f32(d), neg = vdupq_n_f32(-d);
        for (int k = 0; k < 16; k++) {
            uint32x4_t v = vdupq_n_u32(x[2 + k]);
            vst1q_f32(y + 8 * k, vbslq_f32(vtstq_u32(v, b0), pos, neg));
            vst1q_f32(y + 8 * k + 4, vbslq_f32(vtstq_u32(v, b1), pos, neg));
        }
    }
}
