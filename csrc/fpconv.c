/* Scalar binary16 / bfloat16 conversions, bit-exact, round to nearest even.
 * Written on bit patterns (no reliance on the compiler's _Float16) so every platform gives the same
 * answer.  NaN stays NaN (quiet bit set, payload truncated); overflow goes to infinity. */
#include "fpconv.h"
#include <string.h>

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

uint16_t mcf_f32_to_bf16_one(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)          /* NaN: keep sign and top payload, force quiet */
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

uint16_t mcf_f32_to_f16_one(float f)
{
    uint32_t u = f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) {                       /* Inf or NaN */
        if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    }
    if (a >= 0x477ff000u)                         /* rounds to >= 65536: overflow */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {                        /* result is subnormal or zero */
        if (a < 0x33000000u) return (uint16_t)sign;   /* < 2^-25: rounds to zero */
        uint32_t e = a >> 23;                     /* 102..112 */
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;                /* 14..24 */
        uint32_t q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    /* normal: rebias exponent, round mantissa to 10 bits (carry may bump the exponent) */
    uint32_t r = a - 0x38000000u;                 /* exponent 127 -> 15 */
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

float mcf_f16_to_f32_one(uint16_t h)
{
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        if (m == 0) return bits_f32(sign);
        /* subnormal: value = m * 2^-24, exact in f32 */
        float v = (float)m * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

void mcf_bf16_to_f32(const uint16_t *restrict src, float *restrict dst, size_t n)
{
    uint32_t *d = (uint32_t *)dst;
    for (size_t i = 0; i < n; i++) d[i] = (uint32_t)src[i] << 16;
}

void mcf_f32_to_bf16(const float *restrict src, uint16_t *restrict dst, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = mcf_f32_to_bf16_one(src[i]);
}

void mcf_f16_to_f32(const uint16_t *restrict src, float *restrict dst, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = mcf_f16_to_f32_one(src[i]);
}

void mcf_f32_to_f16(const float *restrict src, uint16_t *restrict dst, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = mcf_f32_to_f16_one(src[i]);
}
