/* MegaContext working-context assembly and mean pooling.
 *
 * Callers (mcf/megacontext/_megacontext.pyx) validate every count, index and pointer range before
 * calling; the only thing checked here is data read from files: token ids against the embedding
 * table's vocabulary. */
#ifndef MCF_MEGACONTEXT_H
#define MCF_MEGACONTEXT_H
#include <stddef.h>
#include <stdint.h>

/* The .ctx dtype codes.  MC_Q8 rows are MCF q8 blocks (csrc/quant.h), one row at a time: ceil(dim/32)
 * f16 scales, then 32 int8 codes per block (zero padding past dim); they are decoded with MCF's
 * dequantization kernel (mcf_dequant_rows), never copied as they are. */
enum { MC_U32 = 0, MC_F16 = 1, MC_BF16 = 2, MC_F32 = 3, MC_Q8 = 4 };

typedef struct {
    /* LOD0 token ids (the first token of the file) and the gist rows of LOD1/LOD2 (row 0 of each
     * file), or gathered copies of them (see src_first).  gists[0] is unused. */
    const uint32_t *tokens;
    const uint8_t *gists[3];
    int gist_dtype[3];           /* per level (a hybrid tree: LOD1 MC_F16, LOD2 MC_Q8); [0] unused */
    size_t gist_stride[3];       /* bytes between rows of gists[level] */
    int impl;                    /* SIMD variant of the q8 decode (MCF_IMPL_*) */
    uint32_t dim;
    uint32_t block_size;
    /* the plan: level, index within the level, and for each entry the first element in the source
     * (token index for LOD0, row for gists), the number of rows it yields, its first output row and
     * its first slot among the token (or gist) outputs */
    const uint8_t *plan_level;
    const int64_t *plan_index;
    const int64_t *src_first;
    const int64_t *rows;
    const int64_t *out_row;
    const int64_t *out_slot;
    /* outputs (all required except gists_out / matrix) */
    uint8_t *levels;
    int64_t *positions;
    uint32_t *token_ids;
    uint8_t *gists_out;          /* [n_gist_rows, dim] in out_dtype, or NULL */
    uint8_t *matrix;             /* [n_rows, dim] in out_dtype, or NULL */
    int out_dtype;               /* a float dtype (MC_F16/MC_BF16/MC_F32) */
    size_t out_row_bytes;
    /* embedding table for token rows of the matrix */
    const uint8_t *table;
    uint64_t vocab;
    int table_dtype;
    size_t table_row_stride;
    /* scratch filled by mc_plan_rows, one slot per row of the copy: source pointer and its dtype */
    const uint8_t **row_src;
    uint8_t *row_dtype;
} mc_assembly;

/* Pass 1 over plan entries [e0, e1): levels, positions and token ids, and for every row to copy
 * (matrix rows with a table, else gist rows) its source pointer and dtype in row_src/row_dtype.
 * Returns -1 on success, or the output row of the first token whose id is >= vocab. */
int64_t mc_plan_rows(const mc_assembly *a, size_t e0, size_t e1);

/* Pass 2: copy rows [r0, r1) of row_src into the matrix (or gists_out), converting to out_dtype (q8
 * rows: decoded straight into the output row).
 * Same-dtype rows are copied with the next rows' source prefetched, and with non-temporal stores when
 * `stream` is set (large outputs that are not read back at once). */
void mc_copy_rows(const mc_assembly *a, size_t r0, size_t r1, int stream);

/* Decode one q8 row (see MC_Q8) of `dim` values into `out` (MC_F16/MC_BF16/MC_F32) with MCF's
 * dequantization kernel, variant `impl`. */
void mc_decode_q8_row(const uint8_t *row, uint32_t dim, void *out, int out_dtype, int impl);

/* Both passes over all of [0, n_entries) / [0, n_rows) in one call. */
int64_t mc_assemble(const mc_assembly *a, size_t n_entries, size_t n_rows, int stream);

/* Converts n elements between the float formats (MC_F16/MC_BF16/MC_F32); a plain copy when equal. */
void mc_convert(const void *src, int src_dtype, void *dst, int dst_dtype, size_t n);

/* Mean of each group of `group` rows of `rows` ([n_groups * group, dim] in src_dtype), accumulated in
 * float64 in row order, divided by `group`, rounded to float32 then to out_dtype.  acc: dim doubles. */
void mc_pool_rows(const uint8_t *rows, int src_dtype, size_t n_groups, uint32_t group, uint32_t dim,
                  uint8_t *out, int out_dtype, double *acc);

/* The same over embedding-table rows selected by token ids ([n_groups * group]).  Returns -1, or the
 * position of the first id >= vocab. */
int64_t mc_pool_tokens(const uint32_t *ids, size_t n_groups, uint32_t group, const uint8_t *table,
                       uint64_t vocab, int table_dtype, size_t table_row_stride, uint32_t dim,
                       uint8_t *out, int out_dtype, double *acc);
#endif
