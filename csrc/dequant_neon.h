/* The NEON variant of dequantization and code unpacking (part of csrc/dequant.c, included there on
 * aarch64 only: it shares that file's block_scale, store_out, sext and unpack_blocks).
 *
 * A block's 32 codes become two int8x16 vectors: 8-bit codes are loaded, 4-bit codes split into nibbles
 * and interleaved (item 0 in the low nibble), and 2-, 3- and 6-bit codes gathered with one table lookup
 * per 8 codes: each 16-bit lane receives the two bytes that hold its field, a per-lane shift moves the
 * field to bit 0 and a mask keeps it.  Loads never reach past the block.  One xor/add then turns each field
 * into its signed value plus 128 (a byte), which mcf_u8x16_to_f32_neon (simd.h) widens to the exact float32
 * of the signed code; it is multiplied by the block scale, which the scalar code computes (the same float32
 * operations, so the same bits). */

/* For 3 and 6 bits (fields that straddle bytes): the byte each code's field starts in, and its bit
 * offset there, for the 8 codes of each of the four lookups. */
static const uint8_t neon_start3[32] = {0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5,
                                        6, 6, 6, 7, 7, 7, 8, 8, 9, 9, 9, 10, 10, 10, 11, 11};
static const int16_t neon_shift3[8] = {0, -3, -6, -1, -4, -7, -2, -5};
static const uint8_t neon_start6[32] = {0, 0, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8, 9, 9, 10, 11,
                                        12, 12, 13, 14, 15, 15, 16, 17, 18, 18, 19, 20, 21, 21, 22, 23};
static const int16_t neon_shift6[8] = {0, -6, -4, -2, 0, -6, -4, -2};

/* the lookup indexes of codes 8k .. 8k+7: byte pairs (start, start + 1) as little-endian u16 lanes */
static inline uint8x16_t neon_pairs(const uint8_t *start, int k)
{
    uint8x8_t s = vld1_u8(start + 8 * k);
    return vzip1q_u8(vcombine_u8(s, s), vcombine_u8(vadd_u8(s, vdup_n_u8(1)), vdup_n_u8(0)));
}

static inline uint8x16_t neon_fields(uint8x16x2_t raw, uint8x16_t idx, int16x8_t sh, uint16x8_t mask)
{
    uint16x8_t w = vreinterpretq_u16_u8(vqtbl2q_u8(raw, idx));
    return vreinterpretq_u8_u16(vandq_u16(vshlq_u16(w, sh), mask));
}

/* The 32 signed codes of one block (bits 2, 3, 4, 6 or 8), each plus 128, as q[0] (codes 0..15) and q[1]
 * (16..31). */
static inline void decode_block_neon(const uint8_t *src, int bits, uint8x16_t q[2])
{
    uint8x16_t a, b;
    switch (bits) {
    case 8:
        q[0] = veorq_u8(vld1q_u8(src), vdupq_n_u8(0x80));
        q[1] = veorq_u8(vld1q_u8(src + 16), vdupq_n_u8(0x80));
        return;
    case 4: {
        uint8x16_t v = vld1q_u8(src);
        uint8x16_t lo = vandq_u8(v, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(v, 4);
        a = vzip1q_u8(lo, hi);
        b = vzip2q_u8(lo, hi);
        break;
    }
    case 2: {   /* 4 codes per byte: each byte four times, shifted by 0, 2, 4, 6 */
        uint8x16_t v = vcombine_u8(vld1_u8(src), vdup_n_u8(0));
        static const uint8_t rep[32] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                        4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7};
        static const int8_t sh[16] = {0, -2, -4, -6, 0, -2, -4, -6, 0, -2, -4, -6, 0, -2, -4, -6};
        int8x16_t s = vld1q_s8(sh);
        a = vandq_u8(vshlq_u8(vqtbl1q_u8(v, vld1q_u8(rep)), s), vdupq_n_u8(3));
        b = vandq_u8(vshlq_u8(vqtbl1q_u8(v, vld1q_u8(rep + 16)), s), vdupq_n_u8(3));
        break;
    }
    default: {  /* 3 (12-byte blocks) or 6 (24-byte blocks) */
        uint8x16x2_t raw;
        const uint8_t *start;
        int16x8_t sh;
        if (bits == 3) {
            uint32_t tail;
            memcpy(&tail, src + 8, 4);
            raw.val[0] = vcombine_u8(vld1_u8(src), vcreate_u8((uint64_t)tail));
            raw.val[1] = vdupq_n_u8(0);
            start = neon_start3;
            sh = vld1q_s16(neon_shift3);
        } else {
            raw.val[0] = vld1q_u8(src);
            raw.val[1] = vcombine_u8(vld1_u8(src + 16), vdup_n_u8(0));
            start = neon_start6;
            sh = vld1q_s16(neon_shift6);
        }
        uint16x8_t mask = vdupq_n_u16((uint16_t)((1u << bits) - 1u));
        uint8x16_t f0 = neon_fields(raw, neon_pairs(start, 0), sh, mask);
        uint8x16_t f1 = neon_fields(raw, neon_pairs(start, 1), sh, mask);
        uint8x16_t f2 = neon_fields(raw, neon_pairs(start, 2), sh, mask);
        uint8x16_t f3 = neon_fields(raw, neon_pairs(start, 3), sh, mask);
        a = vuzp1q_u8(f0, f1);   /* the low byte of each u16 lane, in order */
        b = vuzp1q_u8(f2, f3);
        break;
    }
    }
    /* sext(v) + 128 = (v ^ m) - m + 128, m the field's sign bit */
    uint8x16_t m = vdupq_n_u8((uint8_t)(1u << (bits - 1))), k = vdupq_n_u8((uint8_t)(128u - (1u << (bits - 1))));
    q[0] = vaddq_u8(veorq_u8(a, m), k);
    q[1] = vaddq_u8(veorq_u8(b, m), k);
}

/* 16 outputs w[i] = s * (f[i] - z) (raw: z is the zero point) or s * f[i] (z unused) at out[o], the
 * first n of them (n <= 16); f[i] is the signed code whose value plus 128 is byte i of q */
static inline void emit16_neon(void *out, size_t o, uint8x16_t q, float32x4_t s, const float32x4_t *z, size_t n,
                               int kind)
{
    float32x4_t f[4];
    mcf_u8x16_to_f32_neon(q, 128.0f, f);
    for (int k = 0; k < 4; k++) f[k] = vmulq_f32(s, z ? vsubq_f32(f[k], *z) : f[k]);
    if (n == 16) {
        if (kind == MCF_OUT_F32) {
            vst1q_f32_x4((float *)out + o, (float32x4x4_t){{f[0], f[1], f[2], f[3]}});
        } else {
            mcf_store8_neon(out, o, f[0], f[1], kind);
            mcf_store8_neon(out, o + 8, f[2], f[3], kind);
        }
        return;
    }
    float tmp[16];
    vst1q_f32_x4(tmp, (float32x4x4_t){{f[0], f[1], f[2], f[3]}});
    for (size_t i = 0; i < n; i++) store_out(out, o + i, tmp[i], kind);
}

/* int8/int4 codes j .. j+n-1 (n <= 32) of a raw row, each plus 128, as two byte vectors (the lanes past n
 * hold code 0) */
static inline void raw_codes_neon(const uint8_t *src, int bits, size_t j, size_t n, uint8x16_t q[2])
{
    const uint8x16_t b128 = vdupq_n_u8(0x80);
    if (n == 32 && bits == 8) {
        q[0] = veorq_u8(vld1q_u8(src + j), b128);
        q[1] = veorq_u8(vld1q_u8(src + j + 16), b128);
        return;
    }
    if (n == 32) {   /* item 2i in the low nibble of byte i (j is even); sext4(v) + 128 = (v ^ 8) + 120 */
        uint8x16_t v = vld1q_u8(src + j / 2), m8 = vdupq_n_u8(8), k = vdupq_n_u8(120);
        uint8x16_t lo = vandq_u8(v, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(v, 4);
        q[0] = vaddq_u8(veorq_u8(vzip1q_u8(lo, hi), m8), k);
        q[1] = vaddq_u8(veorq_u8(vzip2q_u8(lo, hi), m8), k);
        return;
    }
    int8_t c[32] = {0};
    for (size_t i = 0; i < n; i++) {
        size_t k = j + i;
        c[i] = bits == 8 ? (int8_t)src[k] : sext((k & 1) ? (src[k >> 1] >> 4) : (src[k >> 1] & 0x0f), 4);
    }
    q[0] = veorq_u8(vreinterpretq_u8_s8(vld1q_s8(c)), b128);
    q[1] = veorq_u8(vreinterpretq_u8_s8(vld1q_s8(c + 16)), b128);
}

static void dequant_neon(const mcf_qtensor *t, size_t r0, size_t r1, void *out, int kind)
{
    size_t cols = t->cols, o = 0;
    uint8x16_t q[2];
    if (t->family == MCF_FAM_RAW) {
        float32x4_t sc = vdupq_n_f32(t->scale), z = vdupq_n_f32(t->zero);
        for (size_t r = r0; r < r1; r++) {
            const uint8_t *src = t->data + r * t->row_bytes;
            for (size_t j = 0; j < cols; j += 32) {
                size_t n = cols - j < 32 ? cols - j : 32;
                raw_codes_neon(src, t->bits, j, n, q);
                emit16_neon(out, o, q[0], sc, &z, n < 16 ? n : 16, kind);
                if (n > 16) emit16_neon(out, o + 16, q[1], sc, &z, n - 16, kind);
                o += n;
            }
        }
        return;
    }
    size_t bb = (size_t)t->bits * 4;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *rowdata = t->data + r * t->bpr * bb;
        for (size_t b = 0; b < t->bpr; b++) {
            float sb = block_scale(t, r, b);
            size_t n = cols - b * 32 < 32 ? cols - b * 32 : 32;
            if (__builtin_expect(sb == 0.0f, 0)) {   /* a zero-scale block is +0.0 everywhere */
                sb = 0.0f;
                q[0] = q[1] = vdupq_n_u8(0x80);   /* code 0 */
            } else {
                decode_block_neon(rowdata + b * bb, t->bits, q);
            }
            float32x4_t s = vdupq_n_f32(sb);
            emit16_neon(out, o, q[0], s, NULL, n < 16 ? n : 16, kind);
            if (n > 16) emit16_neon(out, o + 16, q[1], s, NULL, n - 16, kind);
            o += n;
        }
    }
}

static inline void unpack_block_neon(const uint8_t *src, int bits, int8_t *dst)
{
    uint8x16_t q[2];
    decode_block_neon(src, bits, q);
    vst1q_u8((uint8_t *)dst, veorq_u8(q[0], vdupq_n_u8(0x80)));
    vst1q_u8((uint8_t *)dst + 16, veorq_u8(q[1], vdupq_n_u8(0x80)));
}

static void unpack_neon(const mcf_qtensor *t, size_t r0, size_t r1, int8_t *out)
{
    unpack_blocks(t, r0, r1, out, unpack_block_neon);
}
