/* FP4 (E2M1) values and the MXFP4 block, as the OCP Microscaling spec v1.0 and ggml define them.
 *
 * Shared by every decoder of 4-bit float weights: GGUF's MXFP4 (type 39) and NVFP4 (type 40) blocks
 * (csrc/gguf_lowbit.c), and any other reader of E2M1 codes.  Header-only and scalar: include it, no
 * object file to link.  The SIMD block decoders are behind mcf_gguf_dequant(MCF_GGML_MXFP4, ...)
 * (csrc/gguf_dequant.h), bit-identical to mcf_mxfp4_block_decode.
 *
 * E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; code 8 is -0.  ggml stores the values doubled as
 * int8 (kvalues_mxfp4) and halves the E8M0 scale instead, so that the codes are integers; its code 8 is
 * +0, so a decoded "-0" comes out +0.  Both tables are here: mcf_e2m1_f32 for the spec's values,
 * mcf_e2m1_x2 with ggml's convention (what gguf-py and llama.cpp return). */
#ifndef MCF_FP4_H
#define MCF_FP4_H
#include <stdint.h>
#include <string.h>

/* E2M1 code -> value (OCP MX v1.0, table 5) */
__attribute__((unused)) static const float mcf_e2m1_f32[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                       -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* E2M1 code -> twice its value, code 8 as +0 (ggml's kvalues_mxfp4) */
__attribute__((unused)) static const int8_t mcf_e2m1_x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Half the E8M0 scale 2^(e - 127), as ggml_e8m0_to_fp32_half: exact for every e, 2^-128 for e = 0 (a
 * float32 subnormal).  e = 0xFF, which the MX spec reserves for NaN, gives 2^127 (the scale 2^128), as in
 * ggml and gguf-py: a reader that must refuse NaN scales checks for 0xFF itself. */
static inline float mcf_e8m0_to_f32_half(uint8_t e)
{
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* One MXFP4 block as GGUF stores it (17 bytes: the E8M0 scale, then 16 bytes of codes, element j in
 * the low nibble of byte j and element j + 16 in the high nibble) -> 32 floats, bit-identical to ggml's
 * dequantize_row_mxfp4 and gguf-py: y = (half scale) * (doubled value). */
static inline void mcf_mxfp4_block_decode(const uint8_t *blk, float *y)
{
    float d = mcf_e8m0_to_f32_half(blk[0]);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)mcf_e2m1_x2[blk[1 + j] & 0x0f];
        y[j + 16] = d * (float)mcf_e2m1_x2[blk[1 + j] >> 4];
    }
}

#endif
