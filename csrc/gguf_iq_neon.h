/* The NEON kernels of the IQ types (part of csrc/gguf_iq.c, included there on aarch64 only): each block is
 * unpacked into int8 codes (grid values with their signs applied) and per-group float32 scales, the scales
 * with the scalar reference's expressions, as the AVX2 unpackers do, then emitted by mcf_gguf_emit_neon. */

static inline void iq2_xxs_unpack_neon(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = x + 2 + 8 * ib;
        uint32_t aux = mcf_le32(q + 4);
        scales[ib] = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        mcf_gguf_put_signed32_neon(codes + 32 * ib, mcf_gguf_grid2_neon(mcf_iq2xxs_grid, q[0], q[1]),
                                   mcf_gguf_grid2_neon(mcf_iq2xxs_grid, q[2], q[3]), ksigns4(aux));
    }
}

static inline void iq2_xs_unpack_neon(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    const uint8_t *sc = x + 66;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = x + 2 + 8 * ib;
        uint16_t q0 = mcf_le16(q), q1 = mcf_le16(q + 2), q2 = mcf_le16(q + 4), q3 = mcf_le16(q + 6);
        scales[2 * ib] = d * (0.5f + (float)(sc[ib] & 0x0f)) * 0.25f;
        scales[2 * ib + 1] = d * (0.5f + (float)(sc[ib] >> 4)) * 0.25f;
        uint32_t signs = (uint32_t)mcf_ksigns_iq2xs[q0 >> 9] | ((uint32_t)mcf_ksigns_iq2xs[q1 >> 9] << 8) |
                         ((uint32_t)mcf_ksigns_iq2xs[q2 >> 9] << 16) | ((uint32_t)mcf_ksigns_iq2xs[q3 >> 9] << 24);
        mcf_gguf_put_signed32_neon(codes + 32 * ib, mcf_gguf_grid2_neon(mcf_iq2xs_grid, q0 & 511, q1 & 511),
                                   mcf_gguf_grid2_neon(mcf_iq2xs_grid, q2 & 511, q3 & 511), signs);
    }
}

static inline void iq2_s_unpack_neon(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    const uint8_t *qs = x + 2, *signs = x + 34, *qh = x + 66, *sc = x + 74;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 4 * ib;
        int h = qh[ib];
        scales[2 * ib] = d * (0.5f + (float)(sc[ib] & 0x0f)) * 0.25f;
        scales[2 * ib + 1] = d * (0.5f + (float)(sc[ib] >> 4)) * 0.25f;
        mcf_gguf_put_signed32_neon(
            codes + 32 * ib, mcf_gguf_grid2_neon(mcf_iq2s_grid, q[0] | ((h << 8) & 0x300), q[1] | ((h << 6) & 0x300)),
            mcf_gguf_grid2_neon(mcf_iq2s_grid, q[2] | ((h << 4) & 0x300), q[3] | ((h << 2) & 0x300)),
            mcf_le32(signs + 4 * ib));
    }
}

/* eight 32-bit grid rows (4 bytes each) as two 16-byte vectors */
static inline void grid32x8_neon(const uint32_t *grid, const int idx[8], uint8x16_t *g0, uint8x16_t *g1)
{
    uint32_t v[8];
    for (int k = 0; k < 8; k++) v[k] = grid[idx[k]];
    *g0 = vreinterpretq_u8_u32(vld1q_u32(v));
    *g1 = vreinterpretq_u8_u32(vld1q_u32(v + 4));
}

static inline void iq3_xxs_unpack_neon(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    const uint8_t *qs = x + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 8 * ib;
        uint32_t aux = mcf_le32(x + 66 + 4 * ib);
        scales[ib] = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        int idx[8] = {q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]};
        uint8x16_t g0, g1;
        grid32x8_neon(mcf_iq3xxs_grid, idx, &g0, &g1);
        mcf_gguf_put_signed32_neon(codes + 32 * ib, g0, g1, ksigns4(aux));
    }
}

static inline void iq3_s_unpack_neon(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    const uint8_t *qs = x + 2, *qh = x + 66, *signs = x + 74, *sc = x + 106;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 8 * ib;
        int h = qh[ib];
        scales[ib] = d * (float)(1 + 2 * ((sc[ib / 2] >> (4 * (ib % 2))) & 0x0f));
        int idx[8];
        for (int k = 0; k < 8; k++) idx[k] = q[k] | ((h << (8 - k)) & 256);
        uint8x16_t g0, g1;
        grid32x8_neon(mcf_iq3s_grid, idx, &g0, &g1);
        mcf_gguf_put_signed32_neon(codes + 32 * ib, g0, g1, mcf_le32(signs + 4 * ib));
    }
}

/* IQ1: the code is 8 * grid + (delta > 0 ? 1 : -1), so that code * 0.125 == grid + delta exactly (the grid
 * values are -1, 0 and 1) */
static inline void iq1_put_neon(int8_t *codes, uint8x16_t g, int8x16_t delta)
{
    vst1q_s8(codes, vaddq_s8(vshlq_n_s8(vreinterpretq_s8_u8(g), 3), delta));
}

static inline void iq1_s_unpack_neon(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    const uint8_t *qs = x + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 4 * ib;
        int qh = mcf_le16(x + 34 + 2 * ib);
        scales[ib] = d * (float)(2 * ((qh >> 12) & 7) + 1);
        int8x16_t delta = vdupq_n_s8(qh & 0x8000 ? -1 : 1);
        iq1_put_neon(codes + 32 * ib, mcf_gguf_grid2_neon(mcf_iq1s_grid, q[0] | ((qh << 8) & 0x700), q[1] | ((qh << 5) & 0x700)),
                     delta);
        iq1_put_neon(codes + 32 * ib + 16,
                     mcf_gguf_grid2_neon(mcf_iq1s_grid, q[2] | ((qh << 2) & 0x700), q[3] | ((qh >> 1) & 0x700)), delta);
    }
}

static inline void iq1_m_unpack_neon(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = iq1m_d(x);
    const uint8_t *qs = x, *qh = x + 32;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 4 * ib;
        int h0 = qh[2 * ib], h1 = qh[2 * ib + 1];
        uint16_t sc = mcf_le16(x + 48 + 2 * (ib / 2));
        scales[2 * ib] = d * (float)(2 * ((sc >> (6 * (ib % 2))) & 7) + 1);
        scales[2 * ib + 1] = d * (float)(2 * ((sc >> (6 * (ib % 2) + 3)) & 7) + 1);
        int8x16_t d0 = vcombine_s8(vdup_n_s8(h0 & 0x08 ? -1 : 1), vdup_n_s8(h0 & 0x80 ? -1 : 1));
        int8x16_t d1 = vcombine_s8(vdup_n_s8(h1 & 0x08 ? -1 : 1), vdup_n_s8(h1 & 0x80 ? -1 : 1));
        iq1_put_neon(codes + 32 * ib, mcf_gguf_grid2_neon(mcf_iq1s_grid, q[0] | ((h0 << 8) & 0x700), q[1] | ((h0 << 4) & 0x700)),
                     d0);
        iq1_put_neon(codes + 32 * ib + 16,
                     mcf_gguf_grid2_neon(mcf_iq1s_grid, q[2] | ((h1 << 8) & 0x700), q[3] | ((h1 << 4) & 0x700)), d1);
    }
}

static inline void iq4_nl_unpack_neon(const uint8_t *x, int8_t *codes, float *scales)
{
    scales[0] = mcf_f16_at(x);
    mcf_gguf_nibbles_lut_neon(codes, vld1q_u8(x + 2), vld1q_s8(mcf_kvalues_iq4nl));
}

static inline void iq4_xs_unpack_neon(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    int8x16_t table = vld1q_s8(mcf_kvalues_iq4nl);
    for (int ib = 0; ib < 8; ib++) {
        scales[ib] = iq4xs_scale(x, d, ib);
        mcf_gguf_nibbles_lut_neon(codes + 32 * ib, vld1q_u8(x + 8 + 16 * ib), table);
    }
}

MCF_GGUF_CODE_KERNEL_NEON(mcf_gguf_iq2_xxs, iq2_xxs_unpack_neon, 66, 256, 32, 0)
MCF_GGUF_CODE_KERNEL_NEON(mcf_gguf_iq2_xs, iq2_xs_unpack_neon, 74, 256, 16, 0)
MCF_GGUF_CODE_KERNEL_NEON(mcf_gguf_iq2_s, iq2_s_unpack_neon, 82, 256, 16, 0)
MCF_GGUF_CODE_KERNEL_NEON(mcf_gguf_iq3_xxs, iq3_xxs_unpack_neon, 98, 256, 32, 0)
MCF_GGUF_CODE_KERNEL_NEON(mcf_gguf_iq3_s, iq3_s_unpack_neon, 110, 256, 32, 0)
MCF_GGUF_CODE_KERNEL_NEON(mcf_gguf_iq1_s, iq1_s_unpack_neon, 50, 256, 32, 1)
MCF_GGUF_CODE_KERNEL_NEON(mcf_gguf_iq1_m, iq1_m_unpack_neon, 56, 256, 16, 1)
MCF_GGUF_CODE_KERNEL_NEON(mcf_gguf_iq4_nl, iq4_nl_unpack_neon, 18, 32, 32, 0)
MCF_GGUF_CODE_KERNEL_NEON(mcf_gguf_iq4_xs, iq4_xs_unpack_neon, 136, 256, 32, 0)
