/* Run-time detection of the kernel tier.
 * x86: cpuid + xgetbv: a variant is usable only if the CPU has the instructions AND the OS saves the wider
 * registers (XCR0), which __builtin_cpu_supports alone does not check on every compiler.
 * aarch64: the kernel's auxiliary vector (getauxval(AT_HWCAP)), as numpy, ggml and c-blosc2 read it; the
 * kernel sets HWCAP_ASIMD only where it also saves the vector registers.  ASIMD is part of the aarch64
 * baseline, but a kernel (or qemu -cpu) may still report it absent, and then the scalar code runs. */
#include "cpu.h"

#if defined(__x86_64__)   /* the kernels' x86 code is x86-64 only: a 32-bit x86 build reports scalar */
#include <cpuid.h>

static unsigned long long xgetbv0(void)
{
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

static int detect(void)
{
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return MCF_IMPL_SCALAR;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1, fma = (c >> 12) & 1;
    if (!osxsave || !avx) return MCF_IMPL_SCALAR;
    unsigned long long xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return MCF_IMPL_SCALAR;          /* XMM and YMM state */
    if (__get_cpuid_max(0, 0) < 7) return MCF_IMPL_SCALAR;
    __cpuid_count(7, 0, a, b, c, d);
    int avx2 = (b >> 5) & 1, bmi2 = (b >> 8) & 1;
    int avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
    int vbmi = (c >> 1) & 1;
    if (!(avx2 && f16c && fma && bmi2)) return MCF_IMPL_SCALAR;
    if (avx512f && avx512dq && avx512bw && avx512vl && vbmi && (xcr0 & 0xe0) == 0xe0) /* opmask, ZMM_Hi256, Hi16_ZMM */
        return MCF_IMPL_AVX512;
    return MCF_IMPL_AVX2;
}
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1UL << 1)
#endif

static int detect(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMD) ? MCF_IMPL_NEON : MCF_IMPL_SCALAR; }
#elif defined(__aarch64__)
/* no auxiliary vector outside Linux (macOS: every arm64 CPU has ASIMD) */
static int detect(void) { return MCF_IMPL_NEON; }
#else
static int detect(void) { return MCF_IMPL_SCALAR; }
#endif

/* Detected once; a relaxed atomic, as two threads may race to the first call (both store the same value). */
static int best = -1;

int mcf_cpu_best(void)
{
    int b = __atomic_load_n(&best, __ATOMIC_RELAXED);
    if (b < 0) {
        b = detect();
        __atomic_store_n(&best, b, __ATOMIC_RELAXED);
    }
    return b;
}

/* The variants each best variant implies: the x86 tiers nest (AVX-512 implies AVX2); NEON stands beside
 * them, on the other architecture. */
static const unsigned char IMPLIES[MCF_IMPL_COUNT] = {
    [MCF_IMPL_SCALAR] = 1u << MCF_IMPL_SCALAR,
    [MCF_IMPL_AVX2] = 1u << MCF_IMPL_SCALAR | 1u << MCF_IMPL_AVX2,
    [MCF_IMPL_AVX512] = 1u << MCF_IMPL_SCALAR | 1u << MCF_IMPL_AVX2 | 1u << MCF_IMPL_AVX512,
    [MCF_IMPL_NEON] = 1u << MCF_IMPL_SCALAR | 1u << MCF_IMPL_NEON,
};

int mcf_cpu_supports(int impl)
{
    return 0 <= impl && impl < MCF_IMPL_COUNT && ((IMPLIES[mcf_cpu_best()] >> impl) & 1u);
}

const char *mcf_impl_name(int impl)
{
    switch (impl) {
    case MCF_IMPL_SCALAR: return "scalar";
    case MCF_IMPL_AVX2: return "avx2";
    case MCF_IMPL_AVX512: return "avx512";
    case MCF_IMPL_NEON: return "neon";
    default: return "unknown";
    }
}
