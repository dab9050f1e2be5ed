/* Quantization of float32 rows to every MCF method (scalar; the quantizer is not the hot path).
 *
 * compat = 1 is the Go reference quantizer operation for operation: block scale = max|x| / qmax in
 * f32; k*: super = max block scale, u6 = clamp(round_half_away(scale / super * 32), 1, 63), block scale
 * = super * (u6 / 32) from the unrounded super; codes = clamp(round_half_away(v * (1 / scale)), +-qmax)
 * with the product in f32; stored scales truncated to f16 (subnormals flushed).
 * compat = 0 (the default) rounds stored scales to nearest even and computes codes against the scale
 * the decoder will actually see, which lowers the error. */
#include <math.h>
#include <string.h>

#include "fpconv.h"
#include "quant.h"

uint16_t mcf_f32_to_f16_trunc(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    int e = (int)((u >> 23) & 0xff);
    uint32_t m = u & 0x7fffffu;
    if (e == 0xff) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u : 0u));
    int he = e - 127 + 15;
    if (he >= 31) return (uint16_t)(sign | 0x7c00u);
    if (he <= 0) return (uint16_t)sign;
    return (uint16_t)(sign | ((uint32_t)he << 10) | (m >> 13));
}

long long mcf_absmax_finite(const float *src, size_t n, float *absmax, float *minv, float *maxv)
{
    float mx = 0.0f, lo = INFINITY, hi = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        float v = src[i];
        if (!isfinite(v)) return (long long)i;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
        float a = fabsf(v);
        if (a > mx) mx = a;
    }
    *absmax = mx;
    *minv = lo;
    *maxv = hi;
    return -1;
}

static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

static inline int32_t qround(float x, int32_t qmax, int compat)
{
    /* math.Round(float64(x)): half away from zero.  In double, x + 0.5 is exact for |x| < 2**52, so
     * truncating it rounds exactly; |x| is bounded by clamping first.  x is NaN or infinite only when a
     * block's scale is so tiny (< 2**-126) that 1/scale overflows: Go's int32() of such a value is
     * MinInt32 on amd64 (then clamped to -qmax); the default mode maps NaN to 0 and keeps the sign of
     * infinities. */
    double d = (double)x;
    if (__builtin_expect(d != d, 0)) return compat ? -qmax : 0;
    if (compat && __builtin_expect(fabs(d) >= 2147483648.0, 0)) return -qmax;
    double q = (double)qmax;
    d = d > q ? q : d;      /* branch-free: compiles to minsd/maxsd */
    d = d < -q ? -q : d;
    return (int32_t)(d + copysign(0.5, d));
}

/* Pack 32 codes of `bits` bits into an LSB-first stream (q4/k4: item 0 in the low nibble). */
static void pack_block(const int32_t q[32], int bits, uint8_t *dst)
{
    if (bits == 8) {
        for (int i = 0; i < 32; i++) dst[i] = (uint8_t)(int8_t)q[i];
        return;
    }
    uint64_t acc = 0, mask = (1u << bits) - 1u;
    int nb = 0;
    size_t o = 0;
    for (int i = 0; i < 32; i++) {
        acc |= ((uint64_t)(uint32_t)q[i] & mask) << nb;
        nb += bits;
        while (nb >= 8) {
            dst[o++] = (uint8_t)acc;
            acc >>= 8;
            nb -= 8;
        }
    }
}

static float dec16(uint16_t h) { return mcf_scale_from_f16(h); }

int mcf_quantize_rows(int family, int bits, const float *src, size_t nrows, size_t cols, float min_clip,
                      float max_clip, int compat, uint16_t *scales, uint8_t *sub, uint8_t *codes)
{
    size_t bpr = (cols + 31) / 32, spr = (bpr + 7) / 8, bb = (size_t)bits * 4;
    int32_t qmax = (1 << (bits - 1)) - 1;
    int32_t q[32];
    int overflow = 0;
    for (size_t r = 0; r < nrows; r++) {
        const float *row = src + r * cols;
        if (family == MCF_FAM_BLOCK) {
            for (size_t b = 0; b < bpr; b++) {
                float v[32], mx = 0.0f;
                for (int i = 0; i < 32; i++) {
                    size_t c = b * 32 + (size_t)i;
                    v[i] = c < cols ? clampf(row[c], min_clip, max_clip) : 0.0f;
                    float a = fabsf(v[i]);
                    mx = a > mx ? a : mx;
                }
                float scale = mx > 0.0f ? mx / (float)qmax : 0.0f;
                uint16_t h;
                if (compat) {
                    h = mcf_f32_to_f16_trunc(scale);
                } else {
                    h = mcf_f32_to_f16_one(scale);
                    if ((h & 0x7c00u) == 0x7c00u) overflow = 1;
                    scale = dec16(h);  /* codes against the scale the decoder sees */
                }
                scales[r * bpr + b] = h;
                float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
                for (int i = 0; i < 32; i++) q[i] = scale != 0.0f ? qround(v[i] * inv, qmax, compat) : 0;
                pack_block(q, bits, codes + (r * bpr + b) * bb);
            }
        } else {
            for (size_t s = 0; s < spr; s++) {
                float bs[8] = {0}, v[8][32], maxs = 0.0f;
                for (int k = 0; k < 8; k++) {
                    size_t b = s * 8 + (size_t)k;
                    if (b >= bpr) break;
                    float mx = 0.0f;
                    for (int i = 0; i < 32; i++) {
                        size_t c = b * 32 + (size_t)i;
                        v[k][i] = c < cols ? clampf(row[c], min_clip, max_clip) : 0.0f;
                        float a = fabsf(v[k][i]);
                        mx = a > mx ? a : mx;
                    }
                    bs[k] = mx > 0.0f ? mx / (float)qmax : 0.0f;
                    if (bs[k] > maxs) maxs = bs[k];
                }
                float super = maxs;
                uint16_t h;
                if (compat) {
                    h = mcf_f32_to_f16_trunc(super);
                } else {
                    h = mcf_f32_to_f16_one(super);
                    if ((h & 0x7c00u) == 0x7c00u) overflow = 1;
                    super = dec16(h);
                }
                scales[r * spr + s] = h;
                for (int k = 0; k < 8; k++) {
                    size_t b = s * 8 + (size_t)k;
                    if (b >= bpr) break;
                    uint8_t u6 = 0;
                    if (bs[k] > 0.0f && super > 0.0f) {
                        float ratio = bs[k] / super;
                        double u = round((double)(ratio * 32.0f));
                        u6 = (uint8_t)(u < 1.0 ? 1 : (u > 63.0 ? 63 : (int)u));
                    }
                    sub[r * bpr + b] = u6 & 0x3f;
                    float scale = (u6 > 0 && super > 0.0f) ? super * ((float)u6 / 32.0f) : 0.0f;
                    float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
                    for (int i = 0; i < 32; i++) q[i] = scale != 0.0f ? qround(v[k][i] * inv, qmax, compat) : 0;
                    pack_block(q, bits, codes + (r * bpr + b) * bb);
                }
            }
        }
    }
    return overflow ? -1 : 0;
}

void mcf_quantize_raw_rows(int bits, const float *src, size_t nrows, size_t cols, float scale, float zero,
                           uint8_t *codes, size_t row_bytes)
{
    int32_t qmax = (1 << (bits - 1)) - 1, qmin = -(1 << (bits - 1));
    float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    for (size_t r = 0; r < nrows; r++) {
        const float *row = src + r * cols;
        uint8_t *dst = codes + r * row_bytes;
        memset(dst, 0, row_bytes);
        for (size_t c = 0; c < cols; c++) {
            double x = scale != 0.0f ? round((double)(row[c] * inv + zero)) : 0.0;
            int32_t v = x > qmax ? qmax : (x < qmin ? qmin : (int32_t)x);
            if (bits == 8) dst[c] = (uint8_t)(int8_t)v;
            else dst[c >> 1] |= (uint8_t)(((uint32_t)v & 0xfu) << ((c & 1) * 4));
        }
    }
}
