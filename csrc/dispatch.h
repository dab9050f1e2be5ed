/* Run-time kernel dispatch: which function each variant (cpu.h) runs, decided in one table per kernel file.
 *
 * As c-blosc2 keeps one struct of function pointers for its shuffle, each kernel file keeps one table of its
 * entry points' implementations: an array indexed by variant, one row per variant, `static const` (complete
 * when the library is loaded: nothing to initialise at import, nothing to lock).  A row names what its
 * variant really runs: its own code or, where it has none, the code of the variant below it (mcf_impl_below:
 * AVX-512 -> AVX2 -> scalar, NEON -> scalar), so each fallback is written once, in the table, and an entry
 * point is one lookup, `KERNELS[mcf_variant(impl)].fn(...)`, with no chain of tests.
 *
 * The tables are per file rather than one struct for the whole library because each compiled module links
 * only the kernel files it uses (setup.py): a table naming every kernel would pull every kernel file into
 * every module.
 *
 * Safety: the Python layer refuses a variant this CPU cannot run (resolve_impl, mcf/_core/_fpconv.pyx), and
 * mcf_variant maps one to the scalar row anyway, so no caller can reach an instruction the CPU lacks.  The
 * rows of the other architecture's variants (NEON on x86-64, AVX2 / AVX-512 on aarch64) stay empty: cpu.c
 * reports only the variants compiled for this architecture, so they are never selected. */
#ifndef MCF_DISPATCH_H
#define MCF_DISPATCH_H
#include "cpu.h"

/* The row of a kernel table to run for variant `impl`: impl itself where this CPU supports it, else scalar. */
static inline int mcf_variant(int impl) { return mcf_cpu_supports(impl) ? impl : MCF_IMPL_SCALAR; }

/* The variant a variant falls back to where a kernel has no code of its own, -1 below scalar. */
static inline int mcf_impl_below(int impl)
{
    static const signed char below[MCF_IMPL_COUNT] = {
        [MCF_IMPL_SCALAR] = -1, [MCF_IMPL_AVX2] = MCF_IMPL_SCALAR, [MCF_IMPL_AVX512] = MCF_IMPL_AVX2,
        [MCF_IMPL_NEON] = MCF_IMPL_SCALAR,
    };
    return below[impl];
}

#endif
