/* Decoding of ggml (GGUF) tensor types to float.
 *
 * Every function trusts its arguments: mcf/gguf/_gguf.pyx checks the type, the block count and that
 * `src` holds nblocks * type_size bytes and `out` nblocks * block_size values before calling, with
 * the GIL released.  Results are bit-identical to gguf-py's numpy dequantizers (same f32 operation
 * order, no FMA contraction: the build uses -ffp-contract=off) in every variant; for the types gguf-py
 * cannot decode (Q8_K, F64, Q1_0, Q2_0) to ggml's reference C code. */
#ifndef MCF_GGUF_DEQUANT_H
#define MCF_GGUF_DEQUANT_H
#include <stddef.h>
#include <stdint.h>

/* ggml's type codes (ggml.h, enum ggml_type) of the types mcf decodes */
enum {
    MCF_GGML_F32 = 0, MCF_GGML_F16 = 1, MCF_GGML_Q4_0 = 2, MCF_GGML_Q4_1 = 3, MCF_GGML_Q5_0 = 6,
    MCF_GGML_Q5_1 = 7, MCF_GGML_Q8_0 = 8, MCF_GGML_Q2_K = 10, MCF_GGML_Q3_K = 11, MCF_GGML_Q4_K = 12,
    MCF_GGML_Q5_K = 13, MCF_GGML_Q6_K = 14, MCF_GGML_Q8_K = 15, MCF_GGML_IQ2_XXS = 16, MCF_GGML_IQ2_XS = 17,
    MCF_GGML_IQ3_XXS = 18, MCF_GGML_IQ1_S = 19, MCF_GGML_IQ4_NL = 20, MCF_GGML_IQ3_S = 21, MCF_GGML_IQ2_S = 22,
    MCF_GGML_IQ4_XS = 23, MCF_GGML_F64 = 28, MCF_GGML_IQ1_M = 29, MCF_GGML_BF16 = 30, MCF_GGML_TQ1_0 = 34,
    MCF_GGML_TQ2_0 = 35, MCF_GGML_MXFP4 = 39, MCF_GGML_NVFP4 = 40, MCF_GGML_Q1_0 = 41, MCF_GGML_Q2_0 = 42,
    MCF_GGML_TYPE_LIMIT = 43   /* one past the highest code */
};

/* Values per block and bytes per block of a supported type, or 0 if mcf cannot decode it. */
size_t mcf_gguf_block_size(int type);
size_t mcf_gguf_type_size(int type);
/* 1 if `impl` (cpu.h) has its own vector code for `type`, 0 if that variant runs a lower tier's code. */
int mcf_gguf_has_variant(int type, int impl);

/* Decode `nblocks` consecutive blocks at `src` into `out`: float32, float16 or bfloat16 (out_kind
 * MCF_OUT_*, fpconv.h), round to nearest even for the narrow kinds.  `impl` as in cpu.h; a type without
 * a variant for `impl` runs the next lower one (scalar at the bottom).  Returns 0, or -1 for an
 * unsupported type. */
int mcf_gguf_dequant(int type, const uint8_t *src, size_t nblocks, void *out, int out_kind, int impl);

/* Lossless re-layout of Q8_0 / Q4_0 (the only types whose math equals an MCF type: q8 / q4).
 * mcf_gguf_scales copies the f16 block scales and returns how many are subnormal, infinite or NaN
 * (MCF's decoder flushes subnormal scales to zero, so such tensors cannot be re-laid without loss).
 * mcf_gguf_codes writes the codes as MCF packs them: 32 bytes (q8) or 16 bytes (q4) per block. */
size_t mcf_gguf_scales(int type, const uint8_t *src, size_t nblocks, uint16_t *scales);
void mcf_gguf_codes(int type, const uint8_t *src, size_t nblocks, uint8_t *codes);

/* The IQ codebooks compiled in (csrc/gguf_tables.h), by name ("iq2xxs_grid", ..., "ksigns_iq2xs"), for
 * the tests that compare them with gguf-py's: a pointer to the table and its size in bytes, or NULL. */
const void *mcf_gguf_table(const char *name, size_t *nbytes);

#endif
