/* The NEON variant of the scaled formats (part of csrc/mx.c, included there on aarch64 only: it shares that
 * file's block_scale, put and elements_scalar_from, and el8_neon, its minifloat_vec.h).  The AVX2 variant's algorithm
 * with 4 lanes: E2M1 from two byte lookups (the high and low byte of the bfloat16-exact value, whose low 16
 * float32 bits are zero) and a sign bit; the byte-sized types through el8_neon.  Each output is one float32
 * multiplication, the reference's. */

/* 16 E2M1 codes (one per byte, 0..15) as four float32x4 vectors: every E2M1 value is exact in the top 16 bits
 * of a float32, so two table lookups give those bytes and the sign is bit 3 of the code */
static inline void e2m1x16_neon(uint8x16_t nib, float32x4_t f[4])
{
    static const uint8_t hi_t[16] = {0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40};
    static const uint8_t lo_t[16] = {0x00, 0x00, 0x80, 0xc0, 0x00, 0x40, 0x80, 0xc0};
    uint8x16_t mag = vandq_u8(nib, vdupq_n_u8(7));
    uint8x16_t hi = vorrq_u8(vqtbl1q_u8(vld1q_u8(hi_t), mag), vshlq_n_u8(vandq_u8(nib, vdupq_n_u8(8)), 4));
    uint8x16_t lo = vqtbl1q_u8(vld1q_u8(lo_t), mag);
    uint16x8_t h0 = vreinterpretq_u16_u8(vzip1q_u8(lo, hi)), h1 = vreinterpretq_u16_u8(vzip2q_u8(lo, hi));
    f[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h0), 16));
    f[1] = vreinterpretq_f32_u32(vshll_high_n_u16(h0, 16));
    f[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h1), 16));
    f[3] = vreinterpretq_f32_u32(vshll_high_n_u16(h1, 16));
}

/* 16 packed bytes (or 8, the rest zero) as 32 E2M1 codes in element order (byte k: element 2k low, 2k+1 high) */
static inline void nibbles32_neon(uint8x16_t by, uint8x16_t *a, uint8x16_t *b)
{
    uint8x16_t lo = vandq_u8(by, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(by, 4);
    *a = vzip1q_u8(lo, hi);
    *b = vzip2q_u8(lo, hi);
}

/* 16 float32 values (four vectors), times s when `scaled`, to out[o] in format kind */
static inline void st16_neon(void *out, size_t o, const float32x4_t f[4], float32x4_t s, int scaled, int kind)
{
    float32x4_t w[4];
    for (int k = 0; k < 4; k++) w[k] = scaled ? vmulq_f32(f[k], s) : f[k];
    mcf_store8_neon(out, o, w[0], w[1], kind);
    mcf_store8_neon(out, o + 8, w[2], w[3], kind);
}

static void dequant_neon(const mcf_mxtensor *t, size_t r0, size_t r1, void *out, int kind)
{
    size_t cols = t->cols, o = 0;
    if (t->kind == MCF_MX_F8B128) {
        size_t cpr = (cols + 127) / 128;
        for (size_t r = r0; r < r1; r++, o += cols) {
            const uint8_t *srow = t->scales + (r / 128) * cpr * 4, *d = t->data + r * cols;
            size_t c = 0;
            for (; c + 16 <= cols; c += 16) {   /* 16 | 128: the 16 values share one scale */
                uint8x16_t v = vld1q_u8(d + c);
                uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_high_u8(v);
                float32x4_t f[4] = {el8_neon(MCF_EL_E4M3, vmovl_u16(vget_low_u16(lo))),
                                    el8_neon(MCF_EL_E4M3, vmovl_high_u16(lo)),
                                    el8_neon(MCF_EL_E4M3, vmovl_u16(vget_low_u16(hi))),
                                    el8_neon(MCF_EL_E4M3, vmovl_high_u16(hi))};
                st16_neon(out, o + c, f, vdupq_n_f32(ld_f32(srow + (c / 128) * 4)), 1, kind);
            }
            for (; c < cols; c++) put(out, o + c, mcf_e4m3_to_f32(d[c]) * ld_f32(srow + (c / 128) * 4), kind);
        }
        return;
    }
    size_t bs = block_values(t), bpr = cols / bs;
    for (size_t blk = r0 * bpr; blk < r1 * bpr; blk++) {
        float32x4_t s = vdupq_n_f32(block_scale(t, blk)), f[4];
        uint8x16_t a, b;
        if (bs == 32) nibbles32_neon(vld1q_u8(t->data + blk * 16), &a, &b);
        else nibbles32_neon(vcombine_u8(vld1_u8(t->data + blk * 8), vdup_n_u8(0)), &a, &b);
        e2m1x16_neon(a, f);
        st16_neon(out, o, f, s, 1, kind);
        if (bs == 32) {
            e2m1x16_neon(b, f);
            st16_neon(out, o + 16, f, s, 1, kind);
        }
        o += bs;
    }
}

static void elements_neon(int fmt, const uint8_t *src, size_t n, void *out, int kind)
{
    size_t i = 0;
    float32x4_t f[4], none = vdupq_n_f32(1.0f);
    if (fmt == MCF_EL_E2M1) {
        for (; i + 32 <= n; i += 32) {
            uint8x16_t a, b;
            nibbles32_neon(vld1q_u8(src + i / 2), &a, &b);
            e2m1x16_neon(a, f);
            st16_neon(out, i, f, none, 0, kind);
            e2m1x16_neon(b, f);
            st16_neon(out, i + 16, f, none, 0, kind);
        }
        elements_scalar_from(fmt, src, i, n, out, kind);
        return;
    }
    for (; i + 16 <= n; i += 16) {
        uint8x16_t v = vld1q_u8(src + i);
        uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_high_u8(v);
        f[0] = el8_neon(fmt, vmovl_u16(vget_low_u16(lo)));
        f[1] = el8_neon(fmt, vmovl_high_u16(lo));
        f[2] = el8_neon(fmt, vmovl_u16(vget_low_u16(hi)));
        f[3] = el8_neon(fmt, vmovl_high_u16(hi));
        st16_neon(out, i, f, none, 0, kind);
    }
    elements_scalar_from(fmt, src, i, n, out, kind);
}
