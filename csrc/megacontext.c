/* MegaContext working-context assembly and mean pooling (see megacontext.h). */
#include "megacontext.h"

#include <string.h>

#include "fpconv.h"
#include "quant.h"

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

int64_t mc_plan_rows(const mc_assembly *a, size_t e0, size_t e1)
{
    const size_t K = a->block_size;
    const int to_matrix = a->matrix != NULL;
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
            if (to_matrix) {
                for (int64_t r = 0; r < nrows; r++) {
                    const uint32_t id = ids[r];
                    if ((uint64_t)id >= a->vocab)
                        return row + r;
                    a->row_src[row + r] = a->table + (size_t)id * a->table_row_stride;
                    a->row_dtype[row + r] = (uint8_t)a->table_dtype;
                }
            }
        } else {
            int64_t span = (int64_t)K;
            if (level == 2)
                span *= (int64_t)K;
            a->levels[row] = (uint8_t)level;
            a->positions[row] = idx * span;
            const int64_t at = to_matrix ? row : slot;
            a->row_src[at] = a->gists[level] + (size_t)src * a->gist_stride[level];
            a->row_dtype[at] = (uint8_t)a->gist_dtype[level];
        }
    }
    return -1;
}

#ifndef MC_PREFETCH_ROWS
#define MC_PREFETCH_ROWS 2   /* rows ahead whose source is prefetched while a row is copied */
#endif

#if defined(__SSE2__)
#include <emmintrin.h>
#define MC_HAVE_SSE2 1
#endif

/* Copy n bytes; prefetch the same extent at `next` (the following row's source); stream the stores
 * past the caches when asked. */
static void copy_row(uint8_t *d, const uint8_t *s, size_t n, const uint8_t *next, int stream)
{
#ifdef MC_HAVE_SSE2
    if (stream) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        if (head > n)
            head = n;
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
        size_t off = 0;
        for (; off + 64 <= n; off += 64) {
            if (next)
                _mm_prefetch((const char *)next + off, _MM_HINT_T0);
            __m128i x0 = _mm_loadu_si128((const __m128i *)(s + off));
            __m128i x1 = _mm_loadu_si128((const __m128i *)(s + off + 16));
            __m128i x2 = _mm_loadu_si128((const __m128i *)(s + off + 32));
            __m128i x3 = _mm_loadu_si128((const __m128i *)(s + off + 48));
            _mm_stream_si128((__m128i *)(d + off), x0);
            _mm_stream_si128((__m128i *)(d + off + 16), x1);
            _mm_stream_si128((__m128i *)(d + off + 32), x2);
            _mm_stream_si128((__m128i *)(d + off + 48), x3);
        }
        memcpy(d + off, s + off, n - off);
        return;
    }
#endif
    if (next) {
        for (size_t off = 0; off < n; off += 64)
            __builtin_prefetch(next + off, 0, 3);
    }
    memcpy(d, s, n);
}

static int out_kind(int dt) { return dt == MC_F16 ? MCF_OUT_F16 : dt == MC_BF16 ? MCF_OUT_BF16 : MCF_OUT_F32; }

void mc_decode_q8_row(const uint8_t *row, uint32_t dim, void *out, int out_dtype, int impl)
{
    mcf_qtensor t;
    memset(&t, 0, sizeof t);
    t.family = MCF_FAM_BLOCK;
    t.bits = 8;
    t.rows = 1;
    t.cols = dim;
    t.bpr = ((size_t)dim + 31) / 32;
    t.scales = (const uint16_t *)row;      /* the row is 2-byte aligned: rows are 34 * bpr bytes after a 64-byte header */
    t.data = row + 2 * t.bpr;
    mcf_dequant_rows(&t, 0, 1, out, out_kind(out_dtype), impl);
}

void mc_copy_rows(const mc_assembly *a, size_t r0, size_t r1, int stream)
{
    uint8_t *dst = a->matrix ? a->matrix : a->gists_out;
    const size_t ob = a->out_row_bytes;
    const int odt = a->out_dtype;
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *next = r + MC_PREFETCH_ROWS < r1 ? a->row_src[r + MC_PREFETCH_ROWS] : NULL;
        if (a->row_dtype[r] == odt)
            copy_row(dst + r * ob, a->row_src[r], ob, next, stream);
        else if (a->row_dtype[r] == MC_Q8) {
            if (next)
                __builtin_prefetch(next, 0, 3);
            mc_decode_q8_row(a->row_src[r], a->dim, dst + r * ob, odt, a->impl);
        } else
            mc_convert(a->row_src[r], a->row_dtype[r], dst + r * ob, odt, a->dim);
    }
#ifdef MC_HAVE_SSE2
    if (stream)
        _mm_sfence();
#endif
}

int64_t mc_assemble(const mc_assembly *a, size_t n_entries, size_t n_rows, int stream)
{
    int64_t bad = mc_plan_rows(a, 0, n_entries);
    if (bad >= 0)
        return bad;
    mc_copy_rows(a, 0, n_rows, stream);
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
