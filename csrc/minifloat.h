/* The small float element types of today's checkpoints, decoded to float32: the scalar reference every
 * vector variant (csrc/mx.c, csrc/minifloat_vec.h; the GGUF decoders) is tested against, written from the formats'
 * definitions.  Header-only: include it, no object file to link.
 *
 *   E4M3 (float8_e4m3fn)    OCP FP8: bias 7, no infinity, NaN = S.1111.111, subnormals m * 2^-9
 *   E5M2                    OCP FP8: bias 15, IEEE-like (infinities, NaNs): the top byte of a binary16
 *   E4M3FNUZ, E5M2FNUZ      bias 8 / 16, no infinity, no negative zero: 0x80 is the only NaN
 *   E8M0 (float8_e8m0fnu)   the MX scale: 2^(e - 127), no sign, no zero; 0xFF under two rules (below)
 *   E2M1 (float4_e2m1fn)    OCP MX FP4 element: bias 1, values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
 *                           (1000 is -0.0); ggml's doubled table (below) for GGUF's MXFP4 and NVFP4
 *
 * Every value of these types is exact in float32 (E8M0's 2^-127 as a float32 subnormal).  A NaN decodes to
 * the quiet NaN 0x7fc00000 with the element's sign bit (E5M2, which is binary16's top byte, keeps its payload
 * as mcf_f16_to_f32_one does), so every variant writes the same bits. */
#ifndef MCF_MINIFLOAT_H
#define MCF_MINIFLOAT_H
#include <stdint.h>
#include <string.h>

#include "fpconv.h"

/* The element formats, as the compiled modules pass them (the values are fixed). */
enum {
    MCF_EL_E4M3 = 0,
    MCF_EL_E5M2 = 1,
    MCF_EL_E4M3FNUZ = 2,
    MCF_EL_E5M2FNUZ = 3,
    MCF_EL_E8M0 = 4,
    MCF_EL_E2M1 = 5,   /* two per byte, element 2k in the low nibble of byte k */
    MCF_EL_COUNT = 6
};

static inline float mcf_mf_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* 2^k as a float32, for -149 <= k <= 127 (exact: a power of two, subnormal below -126). */
static inline float mcf_mf_pow2(int k)
{
    if (k >= -126) return mcf_mf_bits((uint32_t)(k + 127) << 23);
    return mcf_mf_bits(1u << (k + 149));
}

/* A finite minifloat with `mbits` mantissa bits and exponent bias `bias`: sign, biased exponent e and
 * mantissa m as fields.  e == 0 is subnormal: m * 2^(1 - bias - mbits); else (2^mbits + m) * 2^(e - bias - mbits).
 * Both products are exact (a small integer times a power of two). */
static inline float mcf_mf_finite(unsigned sign, unsigned e, unsigned m, int mbits, int bias)
{
    float v = e == 0 ? (float)m * mcf_mf_pow2(1 - bias - mbits)
                     : (float)((1u << mbits) + m) * mcf_mf_pow2((int)e - bias - mbits);
    return sign ? -v : v;
}

static inline float mcf_mf_nan(unsigned sign) { return mcf_mf_bits((sign ? 0x80000000u : 0u) | 0x7fc00000u); }

static inline float mcf_e4m3_to_f32(uint8_t b)
{
    unsigned s = b >> 7, e = (b >> 3) & 15u, m = b & 7u;
    if (e == 15u && m == 7u) return mcf_mf_nan(s);
    return mcf_mf_finite(s, e, m, 3, 7);
}

static inline float mcf_e5m2_to_f32(uint8_t b) { return mcf_f16_to_f32_one((uint16_t)((unsigned)b << 8)); }

static inline float mcf_e4m3fnuz_to_f32(uint8_t b)
{
    if (b == 0x80u) return mcf_mf_nan(0);
    return mcf_mf_finite(b >> 7, (b >> 3) & 15u, b & 7u, 3, 8);
}

static inline float mcf_e5m2fnuz_to_f32(uint8_t b)
{
    if (b == 0x80u) return mcf_mf_nan(0);
    return mcf_mf_finite(b >> 7, (b >> 2) & 31u, b & 3u, 2, 16);
}

/* ---- E8M0: one exponent byte e, the value 2^(e - 127).  The byte 0xFF has two rules, one per producer:
 *
 *   the OCP rule    OCP MX v1.0 (float8_e8m0fnu) reserves 0xFF for NaN: mcf_e8m0_to_f32.  mcf's mxfp4 payloads
 *                   and F8_E8M0 tensors (csrc/mx.c) read it so, and their readers refuse a NaN block scale.
 *   the ggml rule   ggml and gguf-py read 0xFF as 2^128, like any other exponent, through the half scale
 *                   2^(e - 128) (finite for every e): mcf_e8m0_to_f32_half, for GGUF's MXFP4 blocks (csrc/gguf_*.c).
 *                   A reader that must refuse NaN scales checks for 0xFF itself (converting GGUF MXFP4 to mcf
 *                   refuses it: docs/convert.md).
 *
 * Both give 2^(e - 127) for e < 0xFF (the half, 2^(e - 128)), every value exact. */
#define MCF_E8M0_NAN 0xffu   /* the byte the OCP rule reads as NaN */

/* the OCP rule */
static inline float mcf_e8m0_to_f32(uint8_t b)
{
    if (b == MCF_E8M0_NAN) return mcf_mf_nan(0);
    return mcf_mf_pow2((int)b - 127);
}

/* the ggml rule, halved as ggml_e8m0_to_fp32_half: 2^(e - 128), 2^-128 for e = 0 (a float32 subnormal) and 2^127
 * for e = 0xFF (the scale 2^128) */
static inline float mcf_e8m0_to_f32_half(uint8_t e)
{
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    return mcf_mf_bits(bits);
}

/* ---- E2M1 */

/* One E2M1 code (the low 4 bits of `nib`). */
static inline float mcf_e2m1_to_f32(unsigned nib)
{
    return mcf_mf_finite((nib >> 3) & 1u, (nib >> 1) & 3u, nib & 1u, 1, 1);
}

/* E2M1 code -> value (OCP MX v1.0, table 5) */
__attribute__((unused)) static const float mcf_e2m1_f32[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* E2M1 code -> twice its value, code 8 as +0 (ggml's kvalues_mxfp4).  ggml stores the values doubled as int8,
 * so that the codes are integers, and halves the E8M0 scale instead (mcf_e8m0_to_f32_half); its code 8 is +0,
 * so a decoded "-0" comes out +0: what gguf-py and llama.cpp return for GGUF's MXFP4 and NVFP4 blocks. */
__attribute__((unused)) static const int8_t mcf_e2m1_x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* One MXFP4 block as GGUF stores it (17 bytes: the E8M0 scale, then 16 bytes of codes, element j in the low
 * nibble of byte j and element j + 16 in the high nibble) -> 32 floats, bit-identical to ggml's
 * dequantize_row_mxfp4 and gguf-py: y = (half scale) * (doubled value), the ggml rule for 0xFF.  The SIMD block
 * decoders are behind mcf_gguf_dequant(MCF_GGML_MXFP4, ...) (csrc/gguf_dequant.h), bit-identical to it. */
static inline void mcf_mxfp4_block_decode(const uint8_t *blk, float *y)
{
    float d = mcf_e8m0_to_f32_half(blk[0]);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)mcf_e2m1_x2[blk[1 + j] & 0x0f];
        y[j + 16] = d * (float)mcf_e2m1_x2[blk[1 + j] >> 4];
    }
}

/* ---- any byte-sized element */

/* One byte-sized element of format `fmt` (not E2M1). */
static inline float mcf_el8_to_f32(int fmt, uint8_t b)
{
    switch (fmt) {
    case MCF_EL_E4M3: return mcf_e4m3_to_f32(b);
    case MCF_EL_E5M2: return mcf_e5m2_to_f32(b);
    case MCF_EL_E4M3FNUZ: return mcf_e4m3fnuz_to_f32(b);
    case MCF_EL_E5M2FNUZ: return mcf_e5m2fnuz_to_f32(b);
    default: return mcf_e8m0_to_f32(b);
    }
}

#endif
