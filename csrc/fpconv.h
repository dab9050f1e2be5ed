/* Scalar float conversions (IEEE 754 binary16 and bfloat16), round to nearest even.
 * These are the reference every SIMD variant (fpconv_simd.c) must match. */
#ifndef MCF_FPCONV_H
#define MCF_FPCONV_H
#include <stddef.h>
#include <stdint.h>

void mcf_bf16_to_f32(const uint16_t *src, float *dst, size_t n);
void mcf_f32_to_bf16(const float *src, uint16_t *dst, size_t n);
void mcf_f16_to_f32(const uint16_t *src, float *dst, size_t n);
void mcf_f32_to_f16(const float *src, uint16_t *dst, size_t n);

uint16_t mcf_f32_to_f16_one(float f);
float mcf_f16_to_f32_one(uint16_t h);
uint16_t mcf_f32_to_bf16_one(float f);

/* The float formats a kernel writes (the out_kind argument of the dequantizing kernels). */
enum { MCF_OUT_F32 = 0, MCF_OUT_F16 = 1, MCF_OUT_BF16 = 2 };

/* The conversions mcf_convert runs (the values are fixed: compiled modules pass them). */
typedef enum {
    MCF_BF16_TO_F32 = 0,
    MCF_F32_TO_BF16 = 1,
    MCF_F16_TO_F32 = 2,
    MCF_F32_TO_F16 = 3,
} mcf_fpconv_op;

/* Array conversion with a chosen variant (csrc/fpconv_simd.c); impl as in cpu.h.  Bit-identical to the
 * scalar loops. */
void mcf_convert(mcf_fpconv_op op, const void *src, void *dst, size_t n, int impl);

#endif
