/* Dequantization and code unpacking: a scalar reference and AVX2 / AVX-512 / NEON (dequant_neon.h) variants.
 *
 * All variants compute every output with the same single IEEE operation sequence (block scale as
 * f16->f32 with subnormal flush; k*: super * (u6 / 32.0f); then scale * (float)q; int*: scale *
 * ((float)q - zero)), with no FMA contraction (-ffp-contract=off), so their results are bit-identical.
 * f16 output rounds to nearest even (F16C does exactly that); bf16 output uses the same integer
 * rounding in every variant.
 *
 * A block whose scale is zero decodes to +0.0 in every element, as the Go decoder does: it skips
 * such blocks (q*: f16 scale == 0 after the subnormal flush; k*: super == 0 or u6 == 0) and leaves
 * their values at +0.0.  Multiplying would give -0.0 for negative codes (and NaN for an infinite
 * super scale with u6 = 0).  int8/int4 follow the same rule for their per-tensor scale. */
#include <string.h>

#include "dispatch.h"
#include "fpconv.h"
#include "quant.h"
#include "simd.h"

float mcf_scale_from_f16(uint16_t h)
{
    if ((h & 0x7c00u) == 0) {              /* zero or subnormal: flushed, as the Go decoder does */
        uint32_t z = (uint32_t)(h & 0x8000u) << 16;
        float f;
        memcpy(&f, &z, 4);
        return f;
    }
    return mcf_f16_to_f32_one(h);
}

/* The scale of block b of row r; a block that decodes to zeros (see the top of the file) gives a zero,
 * and every variant then writes +0.0 for the whole block. */
static inline float block_scale(const mcf_qtensor *t, size_t r, size_t b)
{
    if (t->family == MCF_FAM_BLOCK) return mcf_scale_from_f16(t->scales[r * t->bpr + b]);
    unsigned u6 = t->sub[r * t->bpr + b] & 0x3f;
    if (u6 == 0) return 0.0f;
    float s = mcf_scale_from_f16(t->scales[r * t->spr + b / 8]);
    return s * ((float)u6 / 32.0f);
}

static inline int8_t sext(unsigned v, int bits)
{
    int sh = 8 - bits;
    return (int8_t)((int8_t)(uint8_t)(v << sh) >> sh);
}

/* Reference decode of one 32-code block: an LSB-first bit stream (q4/k4: item 0 in the low nibble,
 * which is the same thing). */
static void decode_block_scalar(const uint8_t *src, int bits, int8_t q[32])
{
    if (bits == 8) {
        for (int i = 0; i < 32; i++) q[i] = (int8_t)src[i];
        return;
    }
    unsigned pos = 0;
    for (int i = 0; i < 32; i++) {
        unsigned v = 0;
        for (int k = 0; k < bits; k++, pos++) v |= (unsigned)((src[pos >> 3] >> (pos & 7)) & 1u) << k;
        q[i] = sext(v, bits);
    }
}

static inline void store_out(void *out, size_t idx, float w, int kind)
{
    if (kind == MCF_OUT_F32) ((float *)out)[idx] = w;
    else if (kind == MCF_OUT_F16) ((uint16_t *)out)[idx] = mcf_f32_to_f16_one(w);
    else ((uint16_t *)out)[idx] = mcf_f32_to_bf16_one(w);
}

static void raw_row_codes(const mcf_qtensor *t, size_t r, int8_t *q)
{
    const uint8_t *src = t->data + r * t->row_bytes;
    if (t->bits == 8) {
        memcpy(q, src, t->cols);
        return;
    }
    for (size_t j = 0; j < t->cols; j++) {
        uint8_t b = src[j >> 1];
        q[j] = sext((j & 1) ? (b >> 4) : (b & 0x0f), 4);
    }
}

static void dequant_scalar(const mcf_qtensor *t, size_t r0, size_t r1, void *out, int kind)
{
    size_t cols = t->cols, o = 0;
    int8_t q[32];
    if (t->family == MCF_FAM_RAW) {
        for (size_t r = r0; r < r1; r++) {
            const uint8_t *src = t->data + r * t->row_bytes;
            for (size_t j = 0; j < cols; j++) {
                int8_t v;
                if (t->bits == 8) v = (int8_t)src[j];
                else v = sext((j & 1) ? (src[j >> 1] >> 4) : (src[j >> 1] & 0x0f), 4);
                store_out(out, o++, t->scale * ((float)v - t->zero), kind);
            }
        }
        return;
    }
    size_t bb = (size_t)t->bits * 4;
    for (size_t r = r0; r < r1; r++) {
        for (size_t b = 0; b < t->bpr; b++) {
            float s = block_scale(t, r, b);
            size_t n = cols - b * 32 < 32 ? cols - b * 32 : 32;
            if (s == 0.0f) {
                for (size_t i = 0; i < n; i++) store_out(out, o++, 0.0f, kind);
                continue;
            }
            decode_block_scalar(t->data + (r * t->bpr + b) * bb, t->bits, q);
            for (size_t i = 0; i < n; i++) store_out(out, o++, s * (float)q[i], kind);
        }
    }
}

/* The codes of rows [r0, r1) as int8, each q* / k* block written by `block` (a variant's decoder of the 32 codes
 * at src into dst; inlined into each variant); int8 / int4 rows are copied or sign-extended by the scalar code. */
typedef void (*unpack_block_fn)(const uint8_t *src, int bits, int8_t *dst);

static inline __attribute__((always_inline)) void unpack_blocks(const mcf_qtensor *t, size_t r0, size_t r1,
                                                                int8_t *out, unpack_block_fn block)
{
    if (t->family == MCF_FAM_RAW) {
        for (size_t r = r0; r < r1; r++) raw_row_codes(t, r, out + (r - r0) * t->cols);
        return;
    }
    size_t bb = (size_t)t->bits * 4;
    for (size_t r = r0; r < r1; r++)
        for (size_t b = 0; b < t->bpr; b++)
            block(t->data + (r * t->bpr + b) * bb, t->bits, out + ((r - r0) * t->bpr + b) * 32);
}

static void unpack_scalar(const mcf_qtensor *t, size_t r0, size_t r1, int8_t *out)
{
    unpack_blocks(t, r0, r1, out, decode_block_scalar);
}

#ifdef MCF_X86
/* ---- AVX2 -----------------------------------------------------------------------------------------
 * Codes go straight from the packed bytes into int32 lanes, 8 at a time, with no BMI2 (pdep is
 * microcoded on AMD Zen 1/2, ~300 cycles) and no per-element work: a byte shuffle copies to each lane the
 * 4 bytes holding its field, vpsllvd moves the field to the top of the lane and vpsrad sign-extends it.
 * A block's 8 <= bytes <= 16 sit in both 128-bit halves of one register (vpshufb is per half); for
 * 6 bits (24 bytes) groups 0-1 shuffle bytes 0..15 and groups 2-3 bytes 8..23.  Every load stays inside
 * the block.  The tables below are what tools/ would generate from "code c is the `bits` bits at bit
 * bits*c": for lane i of group g, the 4 bytes from byte bits*(8g+i)/8 (0x80 = zero for bytes past the
 * loaded ones, which the shift discards anyway), and the left shift 32 - bits - (bits*i) % 8. */
static const uint8_t win_ctl[4][4][32] __attribute__((aligned(32))) = {
    /* 2 bits */
    {{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4},
     {2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6},
     {4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 5, 6, 7, 0x80, 5, 6, 7, 0x80, 5, 6, 7, 0x80, 5, 6, 7, 0x80},
     {6, 7, 0x80, 0x80, 6, 7, 0x80, 0x80, 6, 7, 0x80, 0x80, 6, 7, 0x80, 0x80, 7, 0x80, 0x80, 0x80, 7, 0x80, 0x80, 0x80,
      7, 0x80, 0x80, 0x80, 7, 0x80, 0x80, 0x80}},
    /* 3 bits */
    {{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 2, 3, 4, 5, 2, 3, 4, 5},
     {3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5, 6, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 5, 6, 7, 8, 5, 6, 7, 8},
     {6, 7, 8, 9, 6, 7, 8, 9, 6, 7, 8, 9, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 8, 9, 10, 11, 8, 9, 10, 11},
     {9, 10, 11, 0x80, 9, 10, 11, 0x80, 9, 10, 11, 0x80, 10, 11, 0x80, 0x80, 10, 11, 0x80, 0x80, 10, 11, 0x80, 0x80,
      11, 0x80, 0x80, 0x80, 11, 0x80, 0x80, 0x80}},
    /* 4 bits */
    {{0, 1, 2, 3, 0, 1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 4, 2, 3, 4, 5, 2, 3, 4, 5, 3, 4, 5, 6, 3, 4, 5, 6},
     {4, 5, 6, 7, 4, 5, 6, 7, 5, 6, 7, 8, 5, 6, 7, 8, 6, 7, 8, 9, 6, 7, 8, 9, 7, 8, 9, 10, 7, 8, 9, 10},
     {8, 9, 10, 11, 8, 9, 10, 11, 9, 10, 11, 12, 9, 10, 11, 12, 10, 11, 12, 13, 10, 11, 12, 13, 11, 12, 13, 14, 11, 12,
      13, 14},
     {12, 13, 14, 15, 12, 13, 14, 15, 13, 14, 15, 0x80, 13, 14, 15, 0x80, 14, 15, 0x80, 0x80, 14, 15, 0x80, 0x80, 15,
      0x80, 0x80, 0x80, 15, 0x80, 0x80, 0x80}},
    /* 6 bits: groups 2 and 3 index bytes 8..23 */
    {{0, 1, 2, 3, 0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5, 3, 4, 5, 6, 3, 4, 5, 6, 4, 5, 6, 7, 5, 6, 7, 8},
     {6, 7, 8, 9, 6, 7, 8, 9, 7, 8, 9, 10, 8, 9, 10, 11, 9, 10, 11, 12, 9, 10, 11, 12, 10, 11, 12, 13, 11, 12, 13, 14},
     {4, 5, 6, 7, 4, 5, 6, 7, 5, 6, 7, 8, 6, 7, 8, 9, 7, 8, 9, 10, 7, 8, 9, 10, 8, 9, 10, 11, 9, 10, 11, 12},
     {10, 11, 12, 13, 10, 11, 12, 13, 11, 12, 13, 14, 12, 13, 14, 15, 13, 14, 15, 0x80, 13, 14, 15, 0x80, 14, 15, 0x80,
      0x80, 15, 0x80, 0x80, 0x80}},
};
static const int32_t win_shl[4][8] __attribute__((aligned(32))) = {
    {30, 28, 26, 24, 30, 28, 26, 24},   /* 2 bits */
    {29, 26, 23, 28, 25, 22, 27, 24},   /* 3 bits */
    {28, 24, 28, 24, 28, 24, 28, 24},   /* 4 bits */
    {26, 20, 22, 24, 26, 20, 22, 24},   /* 6 bits */
};

static inline uint64_t ld64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);  /* little-endian host */
    return v;
}

static inline uint32_t ld32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The 32 signed codes of the block at src (bits*4 bytes, LSB-first) as four vectors of 8 int32.  `bits` is
 * a constant at every call (the callers are specialized per width), so the branches fold away. */
MCF_TARGET_AVX2 static inline __attribute__((always_inline)) void codes32_avx2(const uint8_t *src, const int bits,
                                                                               __m256i q[4])
{
    if (bits == 8) {
        for (int g = 0; g < 4; g++) q[g] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8 * g)));
        return;
    }
    const int k = bits == 2 ? 0 : bits == 3 ? 1 : bits == 4 ? 2 : 3;
    __m256i lo, hi;
    if (bits == 2) {
        lo = hi = _mm256_set1_epi64x((long long)ld64(src));
    } else if (bits == 3) {
        __m128i x = _mm_insert_epi32(_mm_loadl_epi64((const __m128i *)src), (int)ld32(src + 8), 2);
        lo = hi = _mm256_broadcastsi128_si256(x);
    } else if (bits == 4) {
        lo = hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)src));
    } else {
        lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)src));
        hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(src + 8)));
    }
    const __m256i shl = _mm256_load_si256((const __m256i *)win_shl[k]);
    for (int g = 0; g < 4; g++) {
        __m256i w = _mm256_shuffle_epi8(g < 2 ? lo : hi, _mm256_load_si256((const __m256i *)win_ctl[k][g]));
        q[g] = _mm256_srai_epi32(_mm256_sllv_epi32(w, shl), 32 - bits);
    }
}

/* Block scale with F16C (exact, like mcf_f16_to_f32_one) and the reference decoder's subnormal flush. */
MCF_TARGET_AVX2 static inline float scale16_f16c(uint16_t h)
{
    if ((h & 0x7c00u) == 0) return (h & 0x8000u) ? -0.0f : 0.0f;
    return _cvtsh_ss(h);
}

MCF_TARGET_AVX2 static inline float block_scale_f16c_super(uint16_t h) { return scale16_f16c(h); }

/* The scales of blocks b .. b+n-1 (n <= 8, b a multiple of 8) of row r into sc[], with block_scale()'s
 * operations: f16 -> f32 with subnormals flushed to a zero of the same sign; k*: super * (u6 / 32), and
 * +0 where u6 = 0.  The 8 blocks of a k* group share one super scale.  Returns the mask of zero scales. */
MCF_TARGET_AVX2 static inline unsigned scales8_avx2(const mcf_qtensor *t, size_t r, size_t b, size_t n, float sc[8])
{
    __m256 v;
    if (t->family == MCF_FAM_BLOCK) {
        __m128i h;
        if (n == 8) {
            h = _mm_loadu_si128((const __m128i *)(t->scales + r * t->bpr + b));
        } else {
            uint16_t tmp[8] = {0};
            memcpy(tmp, t->scales + r * t->bpr + b, n * 2);
            h = _mm_loadu_si128((const __m128i *)tmp);
        }
        __m256i u = _mm256_cvtepu16_epi32(h);
        __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7c00)), _mm256_setzero_si256());
        __m256i keep = _mm256_or_si256(_mm256_andnot_si256(sub, _mm256_set1_epi32(-1)),
                                       _mm256_set1_epi32((int)0x80000000u));   /* zero/subnormal: the sign only */
        v = _mm256_and_ps(_mm256_cvtph_ps(h), _mm256_castsi256_ps(keep));
    } else {
        __m128i s8;
        if (n == 8) {
            s8 = _mm_loadl_epi64((const __m128i *)(t->sub + r * t->bpr + b));
        } else {
            uint8_t tmp[16] = {0};
            memcpy(tmp, t->sub + r * t->bpr + b, n);
            s8 = _mm_loadu_si128((const __m128i *)tmp);
        }
        __m256i u = _mm256_and_si256(_mm256_cvtepu8_epi32(s8), _mm256_set1_epi32(0x3f));
        __m256 sup = _mm256_set1_ps(block_scale_f16c_super(t->scales[r * t->spr + b / 8]));
        v = _mm256_mul_ps(sup, _mm256_div_ps(_mm256_cvtepi32_ps(u), _mm256_set1_ps(32.0f)));
        /* u6 = 0 is +0 even under an infinite or NaN super scale */
        v = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(u, _mm256_setzero_si256())), v);
    }
    _mm256_storeu_ps(sc, v);
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_EQ_OQ)) & ((1u << n) - 1u);
}

/* n <= 8 outputs w at out[idx] */
MCF_TARGET_AVX2 static inline void store8_avx2(void *out, size_t idx, __m256 w, int kind, int n)
{
    if (n == 8) {
        mcf_store8_avx2(out, idx, w, kind, 0);
        return;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, w);
    for (int i = 0; i < n; i++) store_out(out, idx + (size_t)i, tmp[i], kind);
}

/* n <= 32 outputs w[0..3] at out[o]; full float32 blocks take four plain or streaming 32-byte stores. */
MCF_TARGET_AVX2 static inline __attribute__((always_inline)) void store32_avx2(void *out, size_t o, const __m256 w[4],
                                                                              size_t n, int kind, int stream)
{
    if (n == 32 && kind == MCF_OUT_F32) {
        float *dst = (float *)out + o;
        if (stream) {
            for (int k = 0; k < 4; k++) _mm256_stream_ps(dst + 8 * k, w[k]);
        } else {
            for (int k = 0; k < 4; k++) _mm256_storeu_ps(dst + 8 * k, w[k]);
        }
        return;
    }
    for (int k = 0; k < 4 && (size_t)k * 8 < n; k++) {
        int m = n - (size_t)k * 8 < 8 ? (int)(n - (size_t)k * 8) : 8;
        store8_avx2(out, o + (size_t)k * 8, w[k], kind, m);
    }
}

/* q* / k* rows at one code width (a constant after inlining). */
MCF_TARGET_AVX2 static inline __attribute__((always_inline)) void
dequant_blocks_avx2(const mcf_qtensor *t, size_t r0, size_t r1, void *out, int kind, int stream, const int bits)
{
    size_t cols = t->cols, o = 0, bb = (size_t)bits * 4;
    float sc[8];
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *rowdata = t->data + r * t->bpr * bb;
        for (size_t g = 0; g < t->bpr; g += 8) {
            size_t ng = t->bpr - g < 8 ? t->bpr - g : 8;
            unsigned zero = scales8_avx2(t, r, g, ng, sc);
            for (size_t b = g; b < g + ng; b++) {
                size_t n = cols - b * 32 < 32 ? cols - b * 32 : 32;
                __m256 w[4];
                if (__builtin_expect((zero >> (b - g)) & 1, 0)) {   /* a zero-scale block is +0.0 everywhere */
                    for (int k = 0; k < 4; k++) w[k] = _mm256_setzero_ps();
                } else {
                    __m256 s = _mm256_broadcast_ss(&sc[b - g]);
                    __m256i q[4];
                    codes32_avx2(rowdata + b * bb, bits, q);
                    for (int k = 0; k < 4; k++) w[k] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(q[k]));
                }
                store32_avx2(out, o, w, n, kind, stream);
                o += n;
            }
        }
    }
}

/* int8/int4 rows (one scale and zero point per tensor): w = scale * (q - zero), 32 codes at a time from
 * the row bytes (int4: item 2i in the low nibble of byte i, the 4-bit block layout); the row's last
 * cols % 32 values take the scalar expression, which rounds the same. */
MCF_TARGET_AVX2 static inline __attribute__((always_inline)) void
dequant_raw_avx2(const mcf_qtensor *t, size_t r0, size_t r1, void *out, int kind, int stream, const int bits)
{
    size_t cols = t->cols, o = 0;
    const __m256 sc = _mm256_set1_ps(t->scale), z = _mm256_set1_ps(t->zero);
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *src = t->data + r * t->row_bytes;
        size_t j = 0;
        for (; j + 32 <= cols; j += 32, o += 32) {
            __m256i q[4];
            __m256 w[4];
            codes32_avx2(src + j * (size_t)bits / 8, bits, q);
            for (int k = 0; k < 4; k++) w[k] = _mm256_mul_ps(sc, _mm256_sub_ps(_mm256_cvtepi32_ps(q[k]), z));
            store32_avx2(out, o, w, 32, kind, stream);
        }
        for (; j < cols; j++, o++) {
            int8_t v = bits == 8 ? (int8_t)src[j] : sext((j & 1) ? (src[j >> 1] >> 4) : (src[j >> 1] & 0x0f), 4);
            store_out(out, o, t->scale * ((float)v - t->zero), kind);
        }
    }
}

MCF_TARGET_AVX2 static void dequant_avx2(const mcf_qtensor *t, size_t r0, size_t r1, void *out, int kind)
{
    /* streaming stores for outputs far larger than the caches, when every full 8-lane store lands aligned */
    int stream = kind == MCF_OUT_F32 && mcf_use_streaming(out, (r1 - r0) * t->cols * 4) && t->cols % 8 == 0;
    if (t->family == MCF_FAM_RAW) {
        if (t->bits == 8) dequant_raw_avx2(t, r0, r1, out, kind, stream, 8);
        else dequant_raw_avx2(t, r0, r1, out, kind, stream, 4);
    } else {
        switch (t->bits) {
        case 2: dequant_blocks_avx2(t, r0, r1, out, kind, stream, 2); break;
        case 3: dequant_blocks_avx2(t, r0, r1, out, kind, stream, 3); break;
        case 4: dequant_blocks_avx2(t, r0, r1, out, kind, stream, 4); break;
        case 6: dequant_blocks_avx2(t, r0, r1, out, kind, stream, 6); break;
        default: dequant_blocks_avx2(t, r0, r1, out, kind, stream, 8); break;
        }
    }
    if (stream) _mm_sfence();
}

MCF_TARGET_AVX2 static inline void unpack_block_avx2(const uint8_t *src, int bits, int8_t *dst)
{
    __m256i q[4];
    switch (bits) {
    case 2: codes32_avx2(src, 2, q); break;
    case 3: codes32_avx2(src, 3, q); break;
    case 4: codes32_avx2(src, 4, q); break;
    case 6: codes32_avx2(src, 6, q); break;
    default: codes32_avx2(src, 8, q); break;
    }
    mcf_store_codes32_avx2(q, 8, (uint8_t *)dst);
}

MCF_TARGET_AVX2 static void unpack_avx2(const mcf_qtensor *t, size_t r0, size_t r1, int8_t *out)
{
    unpack_blocks(t, r0, r1, out, unpack_block_avx2);
}

/* ---- AVX-512 ------------------------------------------------------------------------------------ */
/* 32 signed codes of one block as bytes.  4-bit codes take a pure-SIMD nibble split (item 0 in the low
 * nibble); 2, 3 and 6 bits vpermb + vpmultishiftqb (below). */
MCF_TARGET_AVX512 static inline __m256i decode32_avx512(const uint8_t *src, int bits)
{
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)src);
    __m256i v;
    if (bits == 4) {
        __m128i b = _mm_loadu_si128((const __m128i *)src);
        __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
        v = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    } else {
        /* 2, 3, 6 bits: every 8 codes fill `bits` whole bytes.  vpermb copies bytes [g*bits, g*bits+8)
         * into qword g, vpmultishiftqb pulls the 8 bits starting at bit j*bits into byte j, and a mask
         * keeps the low `bits`.  The masked load never touches bytes past the block. */
        __m256i raw = _mm256_maskz_loadu_epi8((__mmask32)((1ull << (bits * 4)) - 1), src);
        __m256i idx, sh;
        if (bits == 2) {
            idx = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 2, 3, 4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 9, 10, 11, 6, 7, 8, 9, 10, 11, 12, 13);
            sh = _mm256_set1_epi64x(0x0e0c0a0806040200ll);
        } else if (bits == 3) {
            idx = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 8, 9, 10, 6, 7, 8, 9, 10, 11, 12, 13, 9, 10, 11, 12, 13, 14, 15, 16);
            sh = _mm256_set1_epi64x(0x15120f0c09060300ll);
        } else {
            idx = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9, 10, 11, 12, 13, 12, 13, 14, 15, 16, 17, 18, 19, 18, 19, 20, 21, 22, 23, 24, 25);
            sh = _mm256_set1_epi64x(0x2a241e18120c0600ll);
        }
        v = _mm256_multishift_epi64_epi8(sh, _mm256_permutexvar_epi8(idx, raw));
        v = _mm256_and_si256(v, _mm256_set1_epi8((char)((1 << bits) - 1)));
    }
    __m256i m = _mm256_set1_epi8((char)(1 << (bits - 1)));
    return _mm256_sub_epi8(_mm256_xor_si256(v, m), m);
}

/* The scales of blocks b .. b+15 of row r (fewer at the row's end) in one go, with the same operations
 * as block_scale(): f16 -> f32 with subnormals flushed to a zero of the same sign; for k*, the super
 * scale times (sub & 0x3f) / 32.  b is a multiple of 16, so the 16 blocks span super-blocks b/8, b/8+1. */
MCF_TARGET_AVX512 static inline __mmask16 scales16_avx512(const mcf_qtensor *t, size_t r, size_t b,
                                                                     float sc[16])
{
    size_t n = t->bpr - b < 16 ? t->bpr - b : 16;
    __mmask16 m = mcf_mask16_avx512(n);
    if (t->family == MCF_FAM_BLOCK) {
        __m256i h = _mm256_maskz_loadu_epi16(m, t->scales + r * t->bpr + b);
        __m512 f = _mm512_cvtph_ps(h);
        __mmask16 sub = _mm256_testn_epi16_mask(h, _mm256_set1_epi16(0x7c00));   /* zero or subnormal */
        f = _mm512_castsi512_ps(_mm512_mask_and_epi32(_mm512_castps_si512(f), sub, _mm512_castps_si512(f),
                                                      _mm512_set1_epi32((int)0x80000000u)));  /* keep the sign */
        _mm512_storeu_ps(sc, f);
        return _mm512_cmp_ps_mask(f, _mm512_setzero_ps(), _CMP_EQ_OQ);
    }
    size_t s0 = r * t->spr + b / 8;
    float h0 = block_scale_f16c_super(t->scales[s0]);
    float h1 = b / 8 + 1 < t->spr ? block_scale_f16c_super(t->scales[s0 + 1]) : 0.0f;
    __m512 sup = _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(h0), _mm512_set1_ps(h1));
    __m512i u = _mm512_and_si512(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, t->sub + r * t->bpr + b)),
                                 _mm512_set1_epi32(0x3f));
    __mmask16 live = _mm512_test_epi32_mask(u, u);                              /* u6 != 0 */
    __m512 u6 = _mm512_cvtepi32_ps(u);
    __m512 v = _mm512_maskz_mul_ps(live, sup, _mm512_div_ps(u6, _mm512_set1_ps(32.0f)));
    _mm512_storeu_ps(sc, v);
    return _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_EQ_OQ);
}

/* int8/int4 (one scale and zero point per tensor): 32 codes at a time straight from the row bytes,
 * w = scale * (q - zero) as in the scalar code. */
MCF_TARGET_AVX512 static void dequant_raw_avx512(const mcf_qtensor *t, size_t r0, size_t r1, void *out,
                                                            int kind)
{
    size_t cols = t->cols, o = 0;
    __m512 sc = _mm512_set1_ps(t->scale), z = _mm512_set1_ps(t->zero);
    const __m128i lo4 = _mm_set1_epi8(0x0f), m8 = _mm_set1_epi8(8);
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *src = t->data + r * t->row_bytes;
        for (size_t j = 0; j < cols; j += 32) {
            size_t n = cols - j < 32 ? cols - j : 32;
            __m128i a, b;   /* codes j..j+15 and j+16..j+31 as int8 */
            if (t->bits == 8) {
                __m256i q = _mm256_maskz_loadu_epi8((__mmask32)(n == 32 ? 0xffffffffu : ((1u << n) - 1u)), src + j);
                a = _mm256_castsi256_si128(q);
                b = _mm256_extracti128_si256(q, 1);
            } else {       /* item 2i in the low nibble of byte i, item 2i+1 in the high one */
                size_t nb = (n + 1) / 2;
                __m128i by = _mm_maskz_loadu_epi8(mcf_mask16_avx512(nb), src + j / 2);
                __m128i lo = _mm_and_si128(by, lo4), hi = _mm_and_si128(_mm_srli_epi16(by, 4), lo4);
                a = _mm_sub_epi8(_mm_xor_si128(_mm_unpacklo_epi8(lo, hi), m8), m8);   /* sign-extend 4 bits */
                b = _mm_sub_epi8(_mm_xor_si128(_mm_unpackhi_epi8(lo, hi), m8), m8);
            }
            __m512 w0 = _mm512_mul_ps(sc, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), z));
            __m512 w1 = _mm512_mul_ps(sc, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), z));
            if (n == 32 && kind == MCF_OUT_F32) {
                _mm512_storeu_ps((float *)out + o, w0);
                _mm512_storeu_ps((float *)out + o + 16, w1);
            } else {
                __mmask16 m0 = mcf_mask16_avx512(n), m1 = n > 16 ? mcf_mask16_avx512(n - 16) : 0;
                mcf_store16_avx512(out, o, w0, kind, m0, 0);
                if (m1) mcf_store16_avx512(out, o + 16, w1, kind, m1, 0);
            }
            o += n;
        }
    }
}

/* One decoded block (32 codes, scale s) as n <= 32 outputs at out[o]. */
MCF_TARGET_AVX512 static inline void block_out_avx512(void *out, size_t o, __m512 s, __m256i q, size_t n,
                                                                  int kind, int stream)
{
    __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    if (n == 32 && kind == MCF_OUT_F32) {      /* full block, float32: plain 64-byte stores */
        float *dst = (float *)out + o;
        if (stream) {
            _mm512_stream_ps(dst, _mm512_mul_ps(s, f0));
            _mm512_stream_ps(dst + 16, _mm512_mul_ps(s, f1));
        } else {
            _mm512_storeu_ps(dst, _mm512_mul_ps(s, f0));
            _mm512_storeu_ps(dst + 16, _mm512_mul_ps(s, f1));
        }
        return;
    }
    __mmask16 m0 = mcf_mask16_avx512(n), m1 = n > 16 ? mcf_mask16_avx512(n - 16) : 0;
    mcf_store16_avx512(out, o, _mm512_mul_ps(s, f0), kind, m0, stream);
    if (m1) mcf_store16_avx512(out, o + 16, _mm512_mul_ps(s, f1), kind, m1, stream);
}

MCF_TARGET_AVX512 static void dequant_avx512(const mcf_qtensor *t, size_t r0, size_t r1, void *out,
                                                        int kind)
{
    if (t->family == MCF_FAM_RAW) {
        dequant_raw_avx512(t, r0, r1, out, kind);
        return;
    }
    size_t cols = t->cols, o = 0, bb = (size_t)t->bits * 4;
    /* streaming stores for outputs far larger than the caches, when every full block lands aligned */
    size_t total = (r1 - r0) * cols * 4;
    int stream = kind == MCF_OUT_F32 && mcf_use_streaming(out, total) && cols % 16 == 0;
    float sc[16];
    for (size_t r = r0; r < r1; r++) {
        const uint8_t *rowdata = t->data + r * t->bpr * bb;
        for (size_t g = 0; g < t->bpr; g += 16) {      /* 16 blocks per scale vector */
            __mmask16 zero = scales16_avx512(t, r, g, sc);
            size_t ge = g + 16 < t->bpr ? g + 16 : t->bpr;
            if (__builtin_expect(zero == 0, 1)) {
                for (size_t b = g; b < ge; b++) {
                    size_t n = cols - b * 32 < 32 ? cols - b * 32 : 32;
                    block_out_avx512(out, o, _mm512_set1_ps(sc[b - g]), decode32_avx512(rowdata + b * bb, t->bits),
                                     n, kind, stream);
                    o += n;
                }
            } else {   /* a zero-scale block is +0.0 everywhere: +0 times code 0, never 0 * -q */
                for (size_t b = g; b < ge; b++) {
                    size_t n = cols - b * 32 < 32 ? cols - b * 32 : 32;
                    int z = (zero >> (b - g)) & 1;
                    block_out_avx512(out, o, z ? _mm512_setzero_ps() : _mm512_set1_ps(sc[b - g]),
                                     z ? _mm256_setzero_si256() : decode32_avx512(rowdata + b * bb, t->bits),
                                     n, kind, stream);
                    o += n;
                }
            }
        }
    }
    if (stream) _mm_sfence();
}

MCF_TARGET_AVX512 static inline void unpack_block_avx512(const uint8_t *src, int bits, int8_t *dst)
{
    _mm256_storeu_si256((__m256i *)dst, decode32_avx512(src, bits));
}

MCF_TARGET_AVX512 static void unpack_avx512(const mcf_qtensor *t, size_t r0, size_t r1, int8_t *out)
{
    unpack_blocks(t, r0, r1, out, unpack_block_avx512);
}
#endif /* MCF_X86 */

#ifdef MCF_NEON
#include "dequant_neon.h"
#endif

/* Each variant's kernels (dispatch.h) */
typedef struct {
    void (*dequant)(const mcf_qtensor *t, size_t r0, size_t r1, void *out, int kind);
    void (*unpack)(const mcf_qtensor *t, size_t r0, size_t r1, int8_t *out);
} dequant_kernels;

static const dequant_kernels KERNELS[MCF_IMPL_COUNT] = {
    [MCF_IMPL_SCALAR] = {dequant_scalar, unpack_scalar},
#ifdef MCF_X86
    [MCF_IMPL_AVX2] = {dequant_avx2, unpack_avx2},
    [MCF_IMPL_AVX512] = {dequant_avx512, unpack_avx512},
#endif
#ifdef MCF_NEON
    [MCF_IMPL_NEON] = {dequant_neon, unpack_neon},
#endif
};

void mcf_dequant_rows(const mcf_qtensor *t, size_t r0, size_t r1, void *out, int kind, int impl)
{
    if (r1 <= r0) return;
    if (t->family == MCF_FAM_RAW && t->scale == 0.0f) {   /* +0.0 everywhere, whatever the codes say */
        memset(out, 0, (r1 - r0) * t->cols * (kind == MCF_OUT_F32 ? 4u : 2u));
        return;
    }
    KERNELS[mcf_variant(impl)].dequant(t, r0, r1, out, kind);
}

void mcf_unpack_rows(const mcf_qtensor *t, size_t r0, size_t r1, int8_t *out, int impl)
{
    if (r1 <= r0) return;
    KERNELS[mcf_variant(impl)].unpack(t, r0, r1, out);
}
