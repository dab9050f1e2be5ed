/* The AVX2 and AVX-512 kernels of Q4_0, Q4_K and Q6_K, written once (part of csrc/gguf_dequant.c, included
 * there twice on x86-64): both widths unpack the codes with the same 128- / 256-bit operations and differ only
 * in the emitters, 8 or 16 lanes wide.  The includer defines MCF_GGUF_W, the suffix of the kernels and of
 * the emitters they call (avx2 or avx512), and MCF_GGUF_W_TARGET, the kernels' target attribute. */
#define MCF_GGUF_W_NAME_(name, w) name##_##w
#define MCF_GGUF_W_NAME(name, w) MCF_GGUF_W_NAME_(name, w)
#define W(name) MCF_GGUF_W_NAME(name, MCF_GGUF_W)

MCF_GGUF_W_TARGET static void W(q4_0)(const uint8_t *x, size_t nb, float *y, int st)
{
    const __m128i m4 = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    for (size_t b = 0; b < nb; b++, x += 18, y += 32) {
        float d = f16(x);
        __m128i v = _mm_loadu_si128((const __m128i *)(x + 2));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m4), eight);
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m4), eight);
        W(emit16s)(lo, d, y, st);
        W(emit16s)(hi, d, y + 16, st);
    }
}

MCF_GGUF_W_TARGET static void W(q4_k)(const uint8_t *x, size_t nb, float *y, int st)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (size_t b = 0; b < nb; b++, x += 144, y += QK_K) {
        float ds[8], dm[8];
        k4_factors(x, ds, dm);
        for (int g = 0; g < 4; g++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + 16 + 32 * g));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            W(emit32)(lo, ds[2 * g], dm[2 * g], y + 64 * g, st);
            W(emit32)(hi, ds[2 * g + 1], dm[2 * g + 1], y + 64 * g + 32, st);
        }
    }
}

MCF_GGUF_W_TARGET static void W(q6_k)(const uint8_t *x, size_t nb, float *y, int st)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    for (size_t b = 0; b < nb; b++, x += 210, y += QK_K) {
        float ds[16];
        q6_k_factors(x, ds);
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(x + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(x + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(x + 128 + 32 * h));
            for (int t = 0; t < 4; t++) {
                __m256i lsrc = (t & 1) ? l1 : l0;
                __m256i lo = (t >> 1) ? _mm256_and_si256(_mm256_srli_epi16(lsrc, 4), m4) : _mm256_and_si256(lsrc, m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), m2);
                __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), k32);
                int sb = (h * 128 + 32 * t) >> 4;
                float *o = y + h * 128 + 32 * t;
                W(emit16s)(_mm256_castsi256_si128(q), ds[sb], o, st);
                W(emit16s)(_mm256_extracti128_si256(q, 1), ds[sb + 1], o + 16, st);
            }
        }
    }
}

#undef W
#undef MCF_GGUF_W_NAME
#undef MCF_GGUF_W_NAME_
#undef MCF_GGUF_W
#undef MCF_GGUF_W_TARGET
