/* MegaContext working-context assembly and mean pooling (see megacontext.h). */
#include "megacontext.h"

#include <string.h>

#include "fpconv.h"

static size_t dtype_size(int dt) { return dt == MC_F32 || dt == MC_U32 ? 4 : 2; }

static void to_f32(const void *src, int dt, float *dst, size_t n)
{
    switch (dt) {
    case MC_F16: mcf_f16_to_f32((const uint16_t *)src, dst, n); break;
    case MC_BF16: mcf_bf16_to_f32((const uint16_t *)src, dst, n); break;
    default: memcpy(dst, src, n * 4); break;
    }
}

static void from_f32(const float *src, void *dst, int dt, size_t n)
{
    switch (dt) {
    case MC_F16: mcf_f32_to_f16(src, (uint16_t *)dst, n); break;
    case MC_BF16: mcf_f32_to_bf16(src, (uint16_t *)dst, n); break;
    default: memcpy(dst, src, n * 4); break;
    }
}

void mc_convert(const void *src, int src_dtype, void *dst, int dst_dtype, size_t n)
{
    if (src_dtype == dst_dtype) {
        memcpy(dst, src, n * dtype_size(src_dtype));
        return;
    }
    if (src_dtype == MC_F32) {
        from_f32((const float *)src, dst, dst_dtype, n);
        return;
    }
    if (dst_dtype == MC_F32) {
        to_f32(src, src_dtype, (float *)dst, n);
        return;
    }
    /* f16 <-> bf16 through float32 (exact widening, then one rounding), in stack-sized pieces */
    float tmp[512];
    const uint8_t *s = (const uint8_t *)src;
    uint8_t *d = (uint8_t *)dst;
    for (size_t i = 0; i < n; i += 512) {
        size_t k = n - i < 512 ? n - i : 512;
        to_f32(s + i * 2, src_dtype, tmp, k);
        from_f32(tmp, d + i * 2, dst_dtype, k);
    }
}

int64_t mc_assemble(const mc_assembly *a, size_t e0, size_t e1)
{
    const size_t K = a->block_size;
    for (size_t e = e0; e < e1; e++) {
        const int level = a->plan_level[e];
        const int64_t idx = a->plan_index[e];
        const int64_t row = a->out_row[e];
        const int64_t slot = a->out_slot[e];
        const int64_t src = a->src_first[e];
        if (level == 0) {
            const int64_t nrows = a->rows[e];
            const int64_t first_token = idx * (int64_t)K;
            const uint32_t *ids = a->tokens + src;
            memcpy(a->token_ids + slot, ids, (size_t)nrows * 4);
            for (int64_t r = 0; r < nrows; r++) {
                a->levels[row + r] = 0;
                a->positions[row + r] = first_token + r;
            }
            if (a->matrix) {
                for (int64_t r = 0; r < nrows; r++) {
                    const uint32_t id = ids[r];
                    if ((uint64_t)id >= a->vocab)
                        return row + r;
                    mc_convert(a->table + (size_t)id * a->table_row_stride, a->table_dtype,
                               a->matrix + (size_t)(row + r) * a->out_row_bytes, a->out_dtype, a->dim);
                }
            }
        } else {
            const uint8_t *g = a->gists[level] + (size_t)src * a->gist_row_bytes;
            int64_t span = (int64_t)K;
            if (level == 2)
                span *= (int64_t)K;
            a->levels[row] = (uint8_t)level;
            a->positions[row] = idx * span;
            if (a->gists_out)
                memcpy(a->gists_out + (size_t)slot * a->gist_row_bytes, g, a->gist_row_bytes);
            if (a->matrix)
                mc_convert(g, a->gist_dtype, a->matrix + (size_t)row * a->out_row_bytes, a->out_dtype, a->dim);
        }
    }
    return -1;
}

static void acc_add(double *acc, const void *row, int dt, uint32_t dim, float *tmp)
{
    if (dt == MC_F32) {
        const float *f = (const float *)row;
        for (uint32_t j = 0; j < dim; j++)
            acc[j] += (double)f[j];
        return;
    }
    for (uint32_t j = 0; j < dim; j += 256) {
        uint32_t k = dim - j < 256 ? dim - j : 256;
        to_f32((const uint8_t *)row + (size_t)j * 2, dt, tmp, k);
        for (uint32_t i = 0; i < k; i++)
            acc[j + i] += (double)tmp[i];
    }
}

static void acc_store(double *acc, uint32_t group, uint32_t dim, uint8_t *out, int out_dtype, float *tmp)
{
    const size_t osz = dtype_size(out_dtype);
    for (uint32_t j = 0; j < dim; j += 256) {
        uint32_t k = dim - j < 256 ? dim - j : 256;
        for (uint32_t i = 0; i < k; i++)
            tmp[i] = (float)(acc[j + i] / (double)group);
        from_f32(tmp, out + (size_t)j * osz, out_dtype, k);
    }
}

void mc_pool_rows(const uint8_t *rows, int src_dtype, size_t n_groups, uint32_t group, uint32_t dim,
                  uint8_t *out, int out_dtype, double *acc)
{
    float tmp[256];
    const size_t rb = (size_t)dim * dtype_size(src_dtype);
    const size_t ob = (size_t)dim * dtype_size(out_dtype);
    for (size_t g = 0; g < n_groups; g++) {
        memset(acc, 0, (size_t)dim * sizeof(double));
        for (uint32_t r = 0; r < group; r++)
            acc_add(acc, rows + (g * group + r) * rb, src_dtype, dim, tmp);
        acc_store(acc, group, dim, out + g * ob, out_dtype, tmp);
    }
}

int64_t mc_pool_tokens(const uint32_t *ids, size_t n_groups, uint32_t group, const uint8_t *table,
                       uint64_t vocab, int table_dtype, size_t table_row_stride, uint32_t dim,
                       uint8_t *out, int out_dtype, double *acc)
{
    float tmp[256];
    const size_t ob = (size_t)dim * dtype_size(out_dtype);
    for (size_t g = 0; g < n_groups; g++) {
        memset(acc, 0, (size_t)dim * sizeof(double));
        for (uint32_t r = 0; r < group; r++) {
            const uint32_t id = ids[g * group + r];
            if ((uint64_t)id >= vocab)
                return (int64_t)(g * group + r);
            acc_add(acc, table + (size_t)id * table_row_stride, table_dtype, dim, tmp);
        }
        acc_store(acc, group, dim, out + g * ob, out_dtype, tmp);
    }
    return -1;
}
