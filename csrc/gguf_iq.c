/* ggml's IQ block types -> float32: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS.
 *
 * Block layouts and arithmetic are ggml's (ggml-common.h, dequantize_row_iq* in ggml-quants.c), which
 * gguf-py's numpy dequantizers reproduce; every value is computed with their float32 operations in their
 * order, e.g. IQ2_XXS  y = ((d * (0.5 + s)) * 0.25) * grid * sign,  IQ1_S  y = (d * (2s + 1)) * (grid +
 * delta),  IQ4_XS  y = (d * (s - 32)) * kvalue.  The grids ("codebooks") are csrc/gguf_tables.h,
 * generated from gguf-py's.  Scalar reference per element; the vector kernels unpack each block into int8
 * codes and per-group scales (one unpacker per type: AVX2 on x86-64, NEON on aarch64) and emit them with 8
 * (AVX2), 16 (AVX-512) or 4 x 4 (NEON) lanes (gguf_kernels.h says why that is exact).  All multi-byte
 * fields are little-endian. */
#include <string.h>

#include "gguf_kernels.h"
#include "gguf_tables.h"

/* ggml's kvalues_iq4nl: the 16 levels an IQ4_NL / IQ4_XS nibble indexes (checked against gguf-py's) */
static const int8_t mcf_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* ---- scalar reference --------------------------------------------------------------------------- */

/* one group of 8 values: ggml's db * grid[j] * (bit j of signs ? -1 : 1), computed as db * (+-grid[j]):
 * the same bits (gguf_kernels.h), and a form the compiler cannot rewrite: it may turn a product with the
 * constant -1 into a sign flip, which differs from the product for a NaN db */
static inline void iq_group8(float db, const uint8_t *grid, uint8_t signs, float *y)
{
    for (int j = 0; j < 8; j++) {
        int neg = -((signs >> j) & 1);   /* 0 or -1: (g ^ neg) - neg is g or -g, without a branch to mispredict */
        y[j] = db * (float)(((int)grid[j] ^ neg) - neg);
    }
}

/* IQ2_XXS (66 bytes): d | per 32 values: 4 grid indices (bytes), then 4 x 7 sign bits and a 4-bit scale
 * in one uint32 */
void mcf_gguf_iq2_xxs_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 66) {
        float d = mcf_f16_at(x);
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = x + 2 + 8 * ib;
            uint32_t aux = mcf_le32(q + 4);
            float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
            for (int l = 0; l < 4; l++, y += 8)
                iq_group8(db, (const uint8_t *)(mcf_iq2xxs_grid + q[l]), mcf_ksigns_iq2xs[(aux >> (7 * l)) & 127], y);
        }
    }
}

/* IQ2_XS (74 bytes): d | 32 uint16 (9-bit grid index, 7 sign bits) | 8 bytes of two 4-bit scales */
void mcf_gguf_iq2_xs_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 74) {
        float d = mcf_f16_at(x);
        const uint8_t *sc = x + 66;
        for (int ib = 0; ib < 8; ib++) {
            float db[2] = {d * (0.5f + (float)(sc[ib] & 0x0f)) * 0.25f, d * (0.5f + (float)(sc[ib] >> 4)) * 0.25f};
            for (int l = 0; l < 4; l++, y += 8) {
                uint16_t q = mcf_le16(x + 2 + 8 * ib + 2 * l);
                iq_group8(db[l / 2], (const uint8_t *)(mcf_iq2xs_grid + (q & 511)), mcf_ksigns_iq2xs[q >> 9], y);
            }
        }
    }
}

/* IQ2_S (82 bytes): d | qs[32] (low 8 bits of the grid indices) | signs[32] | qh[8] (2 high bits each) |
 * scales[8] */
void mcf_gguf_iq2_s_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 82) {
        float d = mcf_f16_at(x);
        const uint8_t *qs = x + 2, *signs = x + 34, *qh = x + 66, *sc = x + 74;
        for (int ib = 0; ib < 8; ib++) {
            float db[2] = {d * (0.5f + (float)(sc[ib] & 0x0f)) * 0.25f, d * (0.5f + (float)(sc[ib] >> 4)) * 0.25f};
            for (int l = 0; l < 4; l++, y += 8) {
                int idx = qs[4 * ib + l] | ((qh[ib] << (8 - 2 * l)) & 0x300);
                iq_group8(db[l / 2], (const uint8_t *)(mcf_iq2s_grid + idx), signs[4 * ib + l], y);
            }
        }
    }
}

/* IQ3_XXS (98 bytes): d | qs[64] (grid indices, 4 values each) | 8 uint32 (4 x 7 sign bits, 4-bit scale) */
void mcf_gguf_iq3_xxs_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 98) {
        float d = mcf_f16_at(x);
        const uint8_t *qs = x + 2;
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux = mcf_le32(x + 66 + 4 * ib);
            float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
            for (int l = 0; l < 4; l++, y += 8) {
                uint8_t g[8];
                memcpy(g, mcf_iq3xxs_grid + qs[8 * ib + 2 * l], 4);
                memcpy(g + 4, mcf_iq3xxs_grid + qs[8 * ib + 2 * l + 1], 4);
                iq_group8(db, g, mcf_ksigns_iq2xs[(aux >> (7 * l)) & 127], y);
            }
        }
    }
}

/* IQ3_S (110 bytes): d | qs[64] (low 8 bits) | qh[8] (ninth bits) | signs[32] | scales[4] (4 bits each) */
void mcf_gguf_iq3_s_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 110) {
        float d = mcf_f16_at(x);
        const uint8_t *qs = x + 2, *qh = x + 66, *signs = x + 74, *sc = x + 106;
        for (int ib = 0; ib < 8; ib++) {
            float db = d * (float)(1 + 2 * ((sc[ib / 2] >> (4 * (ib % 2))) & 0x0f));
            for (int l = 0; l < 4; l++, y += 8) {
                uint8_t g[8];
                for (int h = 0; h < 2; h++) {
                    int k = 2 * l + h;
                    int idx = qs[8 * ib + k] | (((qh[ib] >> k) & 1) << 8);
                    memcpy(g + 4 * h, mcf_iq3s_grid + idx, 4);
                }
                iq_group8(db, g, signs[4 * ib + l], y);
            }
        }
    }
}

/* IQ1_S (50 bytes): d | qs[32] (low 8 bits of 11-bit indices) | 8 uint16 (3 x 3 high index bits, 3-bit
 * scale, delta sign) */
void mcf_gguf_iq1_s_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 50) {
        float d = mcf_f16_at(x);
        const uint8_t *qs = x + 2;
        for (int ib = 0; ib < 8; ib++) {
            uint16_t qh = mcf_le16(x + 34 + 2 * ib);
            float dl = d * (float)(2 * ((qh >> 12) & 7) + 1);
            float delta = qh & 0x8000 ? -0.125f : 0.125f;
            for (int l = 0; l < 4; l++, y += 8) {
                const int8_t *g = (const int8_t *)(mcf_iq1s_grid + (qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)));
                for (int j = 0; j < 8; j++) y[j] = dl * ((float)g[j] + delta);
            }
        }
    }
}

/* IQ1_M (56 bytes): qs[32] | qh[16] (per index: 3 high bits and the delta sign) | 4 uint16 of 3-bit
 * scales whose top nibbles together are the f16 d */
static inline float iq1m_d(const uint8_t *x)
{
    const uint8_t *s = x + 48;
    uint16_t h = (uint16_t)((mcf_le16(s) >> 12) | ((mcf_le16(s + 2) >> 8) & 0x00f0) |
                            ((mcf_le16(s + 4) >> 4) & 0x0f00) | (mcf_le16(s + 6) & 0xf000));
    return mcf_f16_to_f32_one(h);
}

void mcf_gguf_iq1_m_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 56) {
        float d = iq1m_d(x);
        const uint8_t *qs = x, *qh = x + 32;
        for (int ib = 0; ib < 8; ib++) {
            uint16_t sc = mcf_le16(x + 48 + 2 * (ib / 2));
            float dl[2] = {d * (float)(2 * ((sc >> (6 * (ib % 2))) & 7) + 1),
                           d * (float)(2 * ((sc >> (6 * (ib % 2) + 3)) & 7) + 1)};
            for (int l = 0; l < 4; l++, y += 8) {
                int nib = (qh[2 * ib + l / 2] >> (4 * (l % 2))) & 0x0f;
                const int8_t *g = (const int8_t *)(mcf_iq1s_grid + (qs[4 * ib + l] | ((nib & 7) << 8)));
                float delta = nib & 8 ? -0.125f : 0.125f;
                for (int j = 0; j < 8; j++) y[j] = dl[l / 2] * ((float)g[j] + delta);
            }
        }
    }
}

/* IQ4_NL (18 bytes, 32 values): d | 16 bytes of nibbles (element j low, j + 16 high) indexing kvalues */
void mcf_gguf_iq4_nl_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 18, y += 32) {
        float d = mcf_f16_at(x);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)mcf_kvalues_iq4nl[x[2 + j] & 0x0f];
            y[j + 16] = d * (float)mcf_kvalues_iq4nl[x[2 + j] >> 4];
        }
    }
}

/* IQ4_XS (136 bytes): d | scales_h (uint16, 2 bits per 32 values) | scales_l[4] (4 bits) | qs[128] */
static inline float iq4xs_scale(const uint8_t *x, float d, int ib)
{
    int ls = ((x[4 + ib / 2] >> (4 * (ib % 2))) & 0x0f) | (((mcf_le16(x + 2) >> (2 * ib)) & 3) << 4);
    return d * (float)(ls - 32);
}

void mcf_gguf_iq4_xs_scalar(const uint8_t *x, size_t nb, float *y)
{
    for (size_t b = 0; b < nb; b++, x += 136) {
        float d = mcf_f16_at(x);
        for (int ib = 0; ib < 8; ib++, y += 32) {
            float dl = iq4xs_scale(x, d, ib);
            const uint8_t *qs = x + 8 + 16 * ib;
            for (int j = 0; j < 16; j++) {
                y[j] = dl * (float)mcf_kvalues_iq4nl[qs[j] & 0x0f];
                y[j + 16] = dl * (float)mcf_kvalues_iq4nl[qs[j] >> 4];
            }
        }
    }
}

const void *mcf_gguf_iq_table(const char *name, size_t *nbytes)
{
    static const struct { const char *name; const void *p; size_t n; } tables[] = {
        {"iq2xxs_grid", mcf_iq2xxs_grid, sizeof mcf_iq2xxs_grid}, {"iq2xs_grid", mcf_iq2xs_grid, sizeof mcf_iq2xs_grid},
        {"iq2s_grid", mcf_iq2s_grid, sizeof mcf_iq2s_grid}, {"iq3xxs_grid", mcf_iq3xxs_grid, sizeof mcf_iq3xxs_grid},
        {"iq3s_grid", mcf_iq3s_grid, sizeof mcf_iq3s_grid}, {"iq1s_grid", mcf_iq1s_grid, sizeof mcf_iq1s_grid},
        {"ksigns_iq2xs", mcf_ksigns_iq2xs, sizeof mcf_ksigns_iq2xs},
        {"kvalues_iq4nl", mcf_kvalues_iq4nl, sizeof mcf_kvalues_iq4nl},
    };
    for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++)
        if (!strcmp(tables[i].name, name)) {
            *nbytes = tables[i].n;
            return tables[i].p;
        }
    *nbytes = 0;
    return NULL;
}

/* four sign bytes (7-bit indices into ksigns) of one uint32 -> 32 sign bits */
static inline uint32_t ksigns4(uint32_t aux)
{
    return (uint32_t)mcf_ksigns_iq2xs[aux & 127] | ((uint32_t)mcf_ksigns_iq2xs[(aux >> 7) & 127] << 8) |
           ((uint32_t)mcf_ksigns_iq2xs[(aux >> 14) & 127] << 16) | ((uint32_t)mcf_ksigns_iq2xs[(aux >> 21) & 127] << 24);
}

#ifdef MCF_GGUF_VECTOR
/* ---- vector variants: each block unpacked to int8 codes (grid values with their signs applied) and
 * per-group scales, the scales with the scalar reference's expressions (gguf_kernels.h) -------------- */

MCF_GGUF_UNPACKER void iq2_xxs_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = x + 2 + 8 * ib;
        uint32_t aux = mcf_le32(q + 4);
        scales[ib] = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        mcf_gguf_bytes32 g = mcf_gguf_grid64x4(mcf_iq2xxs_grid, q[0], q[1], q[2], q[3]);
        mcf_gguf_put_signed32(codes + 32 * ib, g, ksigns4(aux));
    }
}

MCF_GGUF_UNPACKER void iq2_xs_unpack(const uint8_t *x, int8_t *codes, float *scales)
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
        mcf_gguf_bytes32 g = mcf_gguf_grid64x4(mcf_iq2xs_grid, q0 & 511, q1 & 511, q2 & 511, q3 & 511);
        mcf_gguf_put_signed32(codes + 32 * ib, g, signs);
    }
}

MCF_GGUF_UNPACKER void iq2_s_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    const uint8_t *qs = x + 2, *signs = x + 34, *qh = x + 66, *sc = x + 74;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 4 * ib;
        int h = qh[ib];
        scales[2 * ib] = d * (0.5f + (float)(sc[ib] & 0x0f)) * 0.25f;
        scales[2 * ib + 1] = d * (0.5f + (float)(sc[ib] >> 4)) * 0.25f;
        mcf_gguf_bytes32 g = mcf_gguf_grid64x4(mcf_iq2s_grid, q[0] | ((h << 8) & 0x300), q[1] | ((h << 6) & 0x300),
                                               q[2] | ((h << 4) & 0x300), q[3] | ((h << 2) & 0x300));
        mcf_gguf_put_signed32(codes + 32 * ib, g, mcf_le32(signs + 4 * ib));
    }
}

MCF_GGUF_UNPACKER void iq3_xxs_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    const uint8_t *qs = x + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 8 * ib;
        uint32_t aux = mcf_le32(x + 66 + 4 * ib);
        scales[ib] = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        int idx[8] = {q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]};
        mcf_gguf_put_signed32(codes + 32 * ib, mcf_gguf_grid32x8(mcf_iq3xxs_grid, idx), ksigns4(aux));
    }
}

MCF_GGUF_UNPACKER void iq3_s_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    const uint8_t *qs = x + 2, *qh = x + 66, *signs = x + 74, *sc = x + 106;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 8 * ib;
        int h = qh[ib];
        scales[ib] = d * (float)(1 + 2 * ((sc[ib / 2] >> (4 * (ib % 2))) & 0x0f));
        int idx[8];
        for (int k = 0; k < 8; k++) idx[k] = q[k] | ((h << (8 - k)) & 256);   /* bit k of qh: the ninth bit */
        mcf_gguf_put_signed32(codes + 32 * ib, mcf_gguf_grid32x8(mcf_iq3s_grid, idx), mcf_le32(signs + 4 * ib));
    }
}

/* IQ1: the code is 8 * grid + (delta > 0 ? 1 : -1), so that code * 0.125 == grid + delta exactly */
MCF_GGUF_UNPACKER void iq1_s_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    const uint8_t *qs = x + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 4 * ib;
        int qh = mcf_le16(x + 34 + 2 * ib);
        scales[ib] = d * (float)(2 * ((qh >> 12) & 7) + 1);
        mcf_gguf_bytes32 g = mcf_gguf_grid64x4(mcf_iq1s_grid, q[0] | ((qh << 8) & 0x700), q[1] | ((qh << 5) & 0x700),
                                               q[2] | ((qh << 2) & 0x700), q[3] | ((qh >> 1) & 0x700));
        mcf_gguf_put_iq1(codes + 32 * ib, g, mcf_gguf_signs1(qh & 0x8000));
    }
}

MCF_GGUF_UNPACKER void iq1_m_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = iq1m_d(x);
    const uint8_t *qs = x, *qh = x + 32;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = qs + 4 * ib;
        int h0 = qh[2 * ib], h1 = qh[2 * ib + 1];
        uint16_t sc = mcf_le16(x + 48 + 2 * (ib / 2));
        scales[2 * ib] = d * (float)(2 * ((sc >> (6 * (ib % 2))) & 7) + 1);
        scales[2 * ib + 1] = d * (float)(2 * ((sc >> (6 * (ib % 2) + 3)) & 7) + 1);
        mcf_gguf_bytes32 g = mcf_gguf_grid64x4(mcf_iq1s_grid, q[0] | ((h0 << 8) & 0x700), q[1] | ((h0 << 4) & 0x700),
                                               q[2] | ((h1 << 8) & 0x700), q[3] | ((h1 << 4) & 0x700));
        mcf_gguf_put_iq1(codes + 32 * ib, g, mcf_gguf_signs4(h0 & 0x08, h0 & 0x80, h1 & 0x08, h1 & 0x80));
    }
}

MCF_GGUF_UNPACKER void iq4_nl_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    scales[0] = mcf_f16_at(x);
    mcf_gguf_put_nibbles_lut(codes, x + 2, mcf_kvalues_iq4nl);
}

MCF_GGUF_UNPACKER void iq4_xs_unpack(const uint8_t *x, int8_t *codes, float *scales)
{
    float d = mcf_f16_at(x);
    for (int ib = 0; ib < 8; ib++) {
        scales[ib] = iq4xs_scale(x, d, ib);
        mcf_gguf_put_nibbles_lut(codes + 32 * ib, x + 8 + 16 * ib, mcf_kvalues_iq4nl);
    }
}

MCF_GGUF_CODE_KERNELS(mcf_gguf_iq2_xxs, iq2_xxs_unpack, 66, 256, 32, 0)
MCF_GGUF_CODE_KERNELS(mcf_gguf_iq2_xs, iq2_xs_unpack, 74, 256, 16, 0)
MCF_GGUF_CODE_KERNELS(mcf_gguf_iq2_s, iq2_s_unpack, 82, 256, 16, 0)
MCF_GGUF_CODE_KERNELS(mcf_gguf_iq3_xxs, iq3_xxs_unpack, 98, 256, 32, 0)
MCF_GGUF_CODE_KERNELS(mcf_gguf_iq3_s, iq3_s_unpack, 110, 256, 32, 0)
MCF_GGUF_CODE_KERNELS(mcf_gguf_iq1_s, iq1_s_unpack, 50, 256, 32, 1)
MCF_GGUF_CODE_KERNELS(mcf_gguf_iq1_m, iq1_m_unpack, 56, 256, 16, 1)
MCF_GGUF_CODE_KERNELS(mcf_gguf_iq4_nl, iq4_nl_unpack, 18, 32, 32, 0)
MCF_GGUF_CODE_KERNELS(mcf_gguf_iq4_xs, iq4_xs_unpack, 136, 256, 32, 0)
#endif /* MCF_GGUF_VECTOR */
