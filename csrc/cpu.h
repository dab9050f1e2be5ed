/* Run-time CPU feature detection and the choice of kernel variant.
 * Variants: 0 scalar (always compiled, the reference), 1 avx2 (+FMA-free, F16C), 2 avx512 (F/DQ/BW/VL/VBMI).
 * No -march flag is ever used: vector code lives in functions with target attributes. */
#ifndef MCF_CPU_H
#define MCF_CPU_H

enum { MCF_IMPL_SCALAR = 0, MCF_IMPL_AVX2 = 1, MCF_IMPL_AVX512 = 2, MCF_IMPL_COUNT = 3 };

/* Highest variant this CPU (and OS, via XGETBV) supports. */
int mcf_cpu_best(void);
/* 1 if variant `impl` can run here. */
int mcf_cpu_supports(int impl);
const char *mcf_impl_name(int impl);

#endif
