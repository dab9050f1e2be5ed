/* Decoding the scaled low-precision formats MCF stores as its extension dtypes (docs/mcf.md, "mcf
 * extensions"): plain FP8 / E8M0 / FP4 elements, and three block-scaled weight formats.
 *
 *   mxfp4    OCP MX: blocks of 32 E2M1 values along a row (16 bytes, element 2k in the low nibble of byte k),
 *            one E8M0 scale per block:                     w = e2m1 * 2^(e - 127)
 *   nvfp4    NVIDIA ModelOpt: blocks of 16 E2M1 values (8 bytes), one E4M3 scale per block, one float32
 *            scale per tensor:                             w = e2m1 * (f32(e4m3) * global), as ModelOpt computes it
 *   f8b128   DeepSeek-V3: one E4M3 byte per value, one float32 (inverse) scale per 128 x 128 block, the
 *            last row and column of blocks partial:        w = f32(e4m3) * scale[r / 128][c / 128]
 *
 * Each product is one IEEE float32 multiplication (the e2m1 times e8m0 and e2m1 times e4m3 products are exact),
 * so the scalar reference and the AVX2 / AVX-512 variants give the same bits; float16 and bfloat16 outputs round
 * that float32 to nearest even, as the other kernels do.  A NaN scale makes its whole block NaN; the Cython layer
 * refuses such payloads before calling.
 *
 * Everything here trusts its arguments: mcf/_core/_mx.pyx checks every size and that each region lies inside its
 * buffer (quant_layout of mcf/container/layout.py) before calling, with the GIL released. */
#ifndef MCF_MX_H
#define MCF_MX_H
#include <stddef.h>
#include <stdint.h>

#include "fpconv.h"   /* MCF_OUT_* */
#include "minifloat.h" /* MCF_EL_* */

enum { MCF_MX_MXFP4 = 0, MCF_MX_NVFP4 = 1, MCF_MX_F8B128 = 2 };

typedef struct {
    int kind;                 /* MCF_MX_* */
    size_t rows, cols;        /* rows: the product of every dimension but the last; cols: the last */
    const uint8_t *scales;    /* mxfp4: E8M0[rows * cols/32]; nvfp4: E4M3[rows * cols/16];
                                 f8b128: little-endian float32[ceil(rows/128) * ceil(cols/128)] (any alignment) */
    const uint8_t *data;      /* mxfp4, nvfp4: rows * cols/2 bytes; f8b128: rows * cols E4M3 bytes */
    float global;             /* nvfp4: the per-tensor float32 scale */
} mcf_mxtensor;

/* Rows [r0, r1) into `out` (contiguous, (r1 - r0) * cols values of the MCF_OUT_* kind). */
void mcf_mx_dequant_rows(const mcf_mxtensor *t, size_t r0, size_t r1, void *out, int out_kind, int impl);

/* n elements of format `fmt` (MCF_EL_*) from `src` (n bytes; E2M1: (n + 1) / 2 bytes) into `out`. */
void mcf_decode_elements(int fmt, const uint8_t *src, size_t n, void *out, int out_kind, int impl);

#endif
