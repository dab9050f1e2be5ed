/* Block and super-block quantization kernels for MCF tensors.
 *
 * Layout (docs/mcf.md): blocks of 32 values along each row; q*: one f16 scale per block; k*: one f16
 * super scale per 8 blocks and a 6-bit sub-scale per block; int*: one f32 scale (and zero point) per
 * tensor.  Codes are signed two's complement in `bits` bits, LSB-first bit streams per block.
 *
 * Every function here trusts its arguments: the Cython layer (mcf/_core/_kernels.pyx) checks all sizes and
 * that every region lies inside its buffer before calling, and calls only with the GIL released. */
#ifndef MCF_QUANT_H
#define MCF_QUANT_H
#include <stddef.h>
#include <stdint.h>

#include "fpconv.h" /* MCF_OUT_* */

enum { MCF_FAM_RAW = 0, MCF_FAM_BLOCK = 1, MCF_FAM_SUPER = 2 };

typedef struct {
    int family;              /* MCF_FAM_* */
    int bits;                /* 2, 3, 4, 6 or 8 */
    size_t rows, cols;
    size_t bpr, spr;         /* blocks and super-blocks per row */
    const uint16_t *scales;  /* block: f16[rows*bpr]; super: f16[rows*spr] */
    const uint8_t *sub;      /* super: u8[rows*bpr] (6 bits used) */
    const uint8_t *data;     /* codes: block/super: rows*bpr*(4*bits) bytes; raw: rows*row_bytes */
    size_t row_bytes;        /* raw only */
    float scale, zero;       /* raw only: x = scale * (q - zero) */
} mcf_qtensor;

/* Dequantize rows [r0, r1) into `out` (contiguous, (r1-r0)*cols items of the MCF_OUT_* kind). */
void mcf_dequant_rows(const mcf_qtensor *t, size_t r0, size_t r1, void *out, int out_kind, int impl);

/* Unpack the codes of rows [r0, r1) into int8 (each row: bpr*32 codes, padding included). */
void mcf_unpack_rows(const mcf_qtensor *t, size_t r0, size_t r1, int8_t *out, int impl);

/* Scale decoding, as the reference decoder does it: f16 subnormals flush to zero. */
float mcf_scale_from_f16(uint16_t h);

/* Quantization.  `src` holds rows [0, nrows) of the tensor (row stride = cols floats), already
 * finite.  Outputs are written for those rows only: scales/super/sub/codes at the row offsets of
 * the tensor's full layout, i.e. the caller passes pointers already advanced to the first row.
 * compat = 1 reproduces the Go quantizer bit for bit (truncating f32->f16 scales, codes from the
 * unrounded f32 scale); compat = 0 rounds scales to nearest even and derives codes from the stored
 * scale.  Returns 0, or -1 if a stored scale would be infinite (rounded: max|x| / qmax >= 65520;
 * truncated, compat = 1: >= 65536), since the decoder would read it back as inf/NaN.  `impl` picks
 * the variant (scalar, avx2 or avx512; all give the same bytes). */
int mcf_quantize_rows(int family, int bits, const float *src, size_t nrows, size_t cols, float min_clip,
                      float max_clip, int compat, uint16_t *scales, uint8_t *sub, uint8_t *codes, int impl);

/* The error-minimizing quantizer (the default for the q and k methods; csrc/quant_search.c, docs/quantization.md): per block,
 * the scale (either sign) whose codes minimize sum_i w_i * (x_i - scale * q_i)^2, evaluated with the scale the
 * decoder reads (f16 rounding, subnormal flush, super * u6/32), and never worse than the scales of the two
 * single-pass quantizers above (compat = 0 and 1); k*: the super scale and the sub-scales chosen together.
 * `weights` holds one float per column (>= 0, finite), or NULL for all 1.  Arguments and outputs as
 * mcf_quantize_rows; returns 0, or -1 when the single-pass quantizer's scale would overflow f16 (the same
 * condition, so the same error).  Codes are clamp(rint(x / scale), -2^(bits-1), 2^(bits-1) - 1): the most
 * negative code is written too.  All variants (`impl`) write the same bytes. */
int mcf_quantize_rows_search(int family, int bits, const float *src, size_t nrows, size_t cols, float min_clip,
                             float max_clip, const float *weights, uint16_t *scales, uint8_t *sub, uint8_t *codes,
                             int impl);

/* Pack 32 codes of `bits` bits into one block's LSB-first bit stream (q4/k4: item 0 in the low nibble). */
void mcf_pack_block(const int32_t q[32], int bits, uint8_t *dst);

/* int8/int4 per-tensor quantization of rows: x clamped to [min_clip, max_clip] (pass -inf, +inf for no
 * clip), then q = clamp(round(x / scale + zero)), row-packed.  `src` is only read. */
void mcf_quantize_raw_rows(int bits, const float *src, size_t nrows, size_t cols, float min_clip, float max_clip,
                           float scale, float zero, uint8_t *codes, size_t row_bytes, int impl);

/* max |x| over n values (variant `impl`); returns the index of the first non-finite value, or -1. */
long long mcf_absmax(const float *src, size_t n, float *absmax, int impl);

/* max |x|, min and max over n values; returns the index of the first non-finite value, or -1. */
long long mcf_absmax_finite(const float *src, size_t n, float *absmax, float *minv, float *maxv);

/* f32 -> f16 the way the Go quantizer stores scales: mantissa truncated, subnormals flushed to 0. */
uint16_t mcf_f32_to_f16_trunc(float f);

#endif
