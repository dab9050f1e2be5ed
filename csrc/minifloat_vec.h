/* The byte-sized element types of csrc/minifloat.h decoded VW at a time, written once against the vocabulary of
 * csrc/simd_vec.h: csrc/mx.c includes this file once per ISA, which defines VSFX(el8) (el8_avx2, el8_avx512,
 * el8_neon).  Bit-identical to minifloat.h's decoders, NaN payloads included:
 *
 *   E5M2 is binary16's top byte, widened exactly (VSFX(mcf_h2f): a signalling NaN keeps its payload);
 *   E4M3 and the FNUZ types put their exponent and mantissa bits where float32 keeps them and change the bias
 *   with an integer add; their subnormals are mantissa * 2^(1 - bias - mbits), a product of normal floats, so no
 *   float32 subnormal ever enters an arithmetic instruction (a microcode assist on some CPUs: 4-5x slower
 *   decoding of random E4M3 bytes, measured);
 *   E8M0 shifts its byte into float32's exponent field (2^-127 for 0, a subnormal, as a constant), the OCP rule
 *   for 0xFF (NaN);
 *   NaN encodings become the quiet NaN the reference writes, with the element's sign for E4M3. */

/* VW byte-sized elements of format `fmt` (MCF_EL_*, not E2M1), one per 32-bit lane of u, as float32 */
VTARGET static inline vf_t VSFX(el8)(int fmt, vi_t u)
{
    const vi_t qnan = vi_set1(0x7fc00000);
    switch (fmt) {
    case MCF_EL_E5M2:
        return VSFX(mcf_h2f)(vi_narrow16(vi_shl(u, 8)));
    case MCF_EL_E8M0: {
        vi_t r = vi_blend(vi_shl(u, 23), vi_set1(0x00400000), vi_eq(u, vi_zero()));
        return vi_as_f(vi_blend(r, qnan, vi_eq(u, vi_set1(MCF_E8M0_NAN))));
    }
    default: {
        int e5 = fmt == MCF_EL_E5M2FNUZ;
        int rebias = fmt == MCF_EL_E4M3 ? 120 : fmt == MCF_EL_E4M3FNUZ ? 119 : 111;
        float sub = mcf_mf_pow2(fmt == MCF_EL_E4M3 ? -9 : fmt == MCF_EL_E4M3FNUZ ? -10 : -17);
        vi_t mag = vi_and(u, vi_set1(0x7f));
        vi_t sign = vi_shl(vi_and(u, vi_set1(0x80)), 24);
        vi_t normal = vi_add(e5 ? vi_shl(mag, 21) : vi_shl(mag, 20), vi_set1(rebias << 23));
        vi_t small = vf_as_i(vf_mul(vi_to_f(vi_and(mag, vi_set1(e5 ? 3 : 7))), vf_set1(sub)));
        vi_t r = vi_or(vi_blend(normal, small, vi_testz(mag, vi_set1(e5 ? 0x7c : 0x78))), sign);
        if (fmt == MCF_EL_E4M3) return vi_as_f(vi_blend(r, vi_or(qnan, sign), vi_eq(mag, vi_set1(0x7f))));
        return vi_as_f(vi_blend(r, qnan, vi_eq(u, vi_set1(0x80))));
    }
    }
}
