/* The kernels' inner loops between llvm-mca region markers, for tools/kernel_mca.py (never built into mcf).
 *
 * Each function is one iteration of a kernel's inner loop, straight-line between the markers (llvm-mca
 * repeats a region as a loop body; markers inside a real loop land out of order once gcc rotates it, and the
 * loop's own increment/compare/branch, the same few instructions in every variant, are left out).  They call the kernel files' own code (they are
 * included whole, so the static helpers are reachable): the GGUF kernels themselves with one block per call
 * (inlined, and the block loop folds away), the MCF dequantizer's per-block steps as dequant_*() runs them
 * (scale, decode, widen, multiply, store; the zero-scale branch left out, as it is not the steady state),
 * the conversions 8 values per call.  Compiled for aarch64 (scalar and NEON) and for x86-64 (scalar and
 * AVX2), then llvm-mca estimates the cycles per iteration of each marked region on a CPU model. */
#include "../csrc/fpconv.c"
#include "../csrc/dequant.c"
#include "../csrc/gguf_dequant.c"
#undef f16
#include "../csrc/fpconv_simd.c"

/* "#" markers on both architectures (llvm-mca reads them; this assembly is never assembled); the memory
 * clobber keeps every load and store of the body between them */
#define MCA_BEGIN(name) __asm__ volatile("# LLVM-MCA-BEGIN " name ::: "memory")
#define MCA_END(name) __asm__ volatile("# LLVM-MCA-END " name ::: "memory")
#if defined(__aarch64__)
#define VEC neon
#define VEC_ATTR
#else
#define VEC avx2
#define VEC_ATTR MCF_TARGET_AVX2
#endif
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

/* ---- MCF q and k blocks (32 values, float32 out): name, bits, family ---------------------------------- */
#define MCF_BLOCK_LOOPS(X) X(q8, 8, MCF_FAM_BLOCK) X(q4, 4, MCF_FAM_BLOCK) X(k6, 6, MCF_FAM_SUPER) \
    X(k4, 4, MCF_FAM_SUPER) X(k3, 3, MCF_FAM_SUPER) X(k2, 2, MCF_FAM_SUPER)

/* block b's scale as dequant_*() computes it: a q block's own f16 scale, a k block's from its super-block */
#define MCA_BLOCK_SCALE(t, b, FAM)                                                                      \
    ((FAM) == MCF_FAM_BLOCK ? mcf_scale_from_f16((t)->scales[b])                                       \
                            : block_scale(&(mcf_qtensor){.family = (FAM), .bpr = (b) + 1, .spr = (b) + 1,  \
                                                         .scales = (t)->scales, .sub = (t)->sub}, 0, (b)))

#define SCALAR_MCF(name, BITS, FAM)                                                                     \
    void mca_scalar_##name(const mcf_qtensor *t, float *out, size_t b)                                 \
    {                                                                                                   \
        int8_t q[32];                                                                                   \
        MCA_BEGIN("scalar_" #name);                                                                 \
        float s = MCA_BLOCK_SCALE(t, b, FAM);                                                       \
        decode_block_scalar(t->data + b * (BITS) * 4, BITS, q);                                     \
        for (int i = 0; i < 32; i++) store_out(out, b * 32 + (size_t)i, s * (float)q[i], MCF_OUT_F32); \
        MCA_END("scalar_" #name);                                                                   \
    }
MCF_BLOCK_LOOPS(SCALAR_MCF)

#if defined(__aarch64__)
#define VEC_MCF(name, BITS, FAM)                                                                        \
    void mca_neon_##name(const mcf_qtensor *t, float *out, size_t b)                                   \
    {                                                                                                   \
        uint8x16_t q[2];                                                                                 \
        MCA_BEGIN("neon_" #name);                                                                   \
        float s = MCA_BLOCK_SCALE(t, b, FAM);                                                       \
        decode_block_neon(t->data + b * (BITS) * 4, BITS, q);                                       \
        float32x4_t vs = vdupq_n_f32(s);                                                            \
        emit16_neon(out, b * 32, q[0], vs, NULL, 16, MCF_OUT_F32);                                  \
        emit16_neon(out, b * 32 + 16, q[1], vs, NULL, 16, MCF_OUT_F32);                             \
        MCA_END("neon_" #name);                                                                     \
    }
#else
/* dequant_blocks_avx2's per-block steps: the codes by byte shuffle and shift (codes32_avx2), widen,
 * multiply, four 32-byte stores (store32_avx2's full-block path).  Its scales are converted 8 blocks at a time (scales8_avx2, once per 8
 * blocks), so the region takes the block's scale from that array, as the kernel does. */
#define VEC_MCF(name, BITS, FAM)                                                                        \
    MCF_TARGET_AVX2 void mca_avx2_##name(const mcf_qtensor *t, float *out, size_t b, const float *sc)   \
    {                                                                                                   \
        MCA_BEGIN("avx2_" #name);                                                                   \
        __m256 s = _mm256_broadcast_ss(&sc[b & 7]);                                                 \
        __m256i q[4];                                                                               \
        __m256 w[4];                                                                                \
        codes32_avx2(t->data + b * (BITS) * 4, BITS, q);                                            \
        for (int k = 0; k < 4; k++) w[k] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(q[k]));               \
        for (int k = 0; k < 4; k++) store8_avx2(out, b * 32 + 8 * (size_t)k, w[k], MCF_OUT_F32, 8);  \
        MCA_END("avx2_" #name);                                                                     \
    }
#endif
MCF_BLOCK_LOOPS(VEC_MCF)

/* ---- GGUF blocks: name, bytes per block, values per block ------------------------------------------- */
#define GGUF_LOOPS(X) X(q8_0, 34, 32) X(q4_0, 18, 32) X(q2_k, 84, 256) X(q3_k, 110, 256) X(q4_k, 144, 256) \
    X(q5_k, 176, 256) X(q6_k, 210, 256)

#define SCALAR_GGUF(name, TS, BS)                                                                       \
    void mca_scalar_gguf_##name(const uint8_t *x, float *y, size_t b)                                  \
    {                                                                                                   \
        MCA_BEGIN("scalar_gguf_" #name);                                                            \
        name##_scalar(x + b * (TS), 1, y + b * (BS));                                               \
        MCA_END("scalar_gguf_" #name);                                                              \
    }
GGUF_LOOPS(SCALAR_GGUF)

#define VEC_GGUF(name, TS, BS)                                                                          \
    VEC_ATTR void CAT(CAT(mca, VEC), gguf_##name)(const uint8_t *x, float *y, size_t b)                \
    {                                                                                                   \
        MCA_BEGIN(CAT_STR(VEC) "_gguf_" #name);                                                     \
        CAT(name, VEC)(x + b * (TS), 1, y + b * (BS), 0);                                           \
        MCA_END(CAT_STR(VEC) "_gguf_" #name);                                                       \
    }
#define STR_(x) #x
#define CAT_STR(x) STR_(x)
GGUF_LOOPS(VEC_GGUF)

/* ---- conversions, 8 values per iteration: name, source type, destination type ---------------------- */
#define CONV_LOOPS(X) X(f16_to_f32, uint16_t, float) X(bf16_to_f32, uint16_t, float) \
    X(f32_to_f16, float, uint16_t) X(f32_to_bf16, float, uint16_t)

#define SCALAR_CONV(name, S, D)                                                                         \
    void mca_scalar_##name(const S *s, D *d, size_t i)                                                  \
    {                                                                                                   \
        MCA_BEGIN("scalar_" #name);                                                                 \
        mcf_##name(s + i, d + i, 8);                                                                \
        MCA_END("scalar_" #name);                                                                   \
    }
CONV_LOOPS(SCALAR_CONV)

#define VEC_CONV(name, S, D)                                                                            \
    VEC_ATTR void CAT(CAT(mca, VEC), name)(const S *s, D *d, size_t i)                                  \
    {                                                                                                   \
        MCA_BEGIN(CAT_STR(VEC) "_" #name);                                                          \
        CAT(name, VEC)(s + i, d + i, 8);                                                            \
        MCA_END(CAT_STR(VEC) "_" #name);                                                            \
    }
CONV_LOOPS(VEC_CONV)
