/* Run-time CPU feature detection and the choice of kernel variant.
 * Variants: 0 scalar (always compiled, the reference), 1 avx2 (+FMA-free, F16C), 2 avx512 (F/DQ/BW/VL/VBMI)
 * on x86-64; 3 neon (ASIMD, the aarch64 baseline) on aarch64, where the x86 variants do not exist.  The
 * numbers are names, not a ranking across architectures: ask mcf_cpu_supports, never compare with "<=".
 * No -march flag is ever used: vector code lives in functions with target attributes (x86), or uses only
 * the aarch64 baseline (NEON). */
#ifndef MCF_CPU_H
#define MCF_CPU_H

enum { MCF_IMPL_SCALAR = 0, MCF_IMPL_AVX2 = 1, MCF_IMPL_AVX512 = 2, MCF_IMPL_NEON = 3, MCF_IMPL_COUNT = 4 };

/* The fastest variant this CPU (and OS: XGETBV on x86, the auxiliary vector on aarch64) supports. */
int mcf_cpu_best(void);
/* 1 if variant `impl` can run here. */
int mcf_cpu_supports(int impl);
const char *mcf_impl_name(int impl);

#endif
