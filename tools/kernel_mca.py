"""llvm-mca's throughput estimates of the kernels' inner loops: the table of docs/kernels.md.

ARM speed cannot be timed on an x86 machine, so this asks LLVM's scheduling models instead: each inner loop
of tools/mca_loops.c (the kernels' own code between region markers) is compiled with Debian's cross gcc for
aarch64 (scalar and NEON) and with gcc for x86-64 (AVX2), and llvm-mca-19 estimates the cycles per
iteration on a CPU model: Neoverse V2 (NVIDIA Grace, AWS Graviton 4) and Apple M1 for aarch64, Zen 4 for
AVX2.  The table gives bytes written per cycle (output bytes of one iteration / cycles per iteration).

    python tools/kernel_mca.py            # prints the markdown table
    python tools/kernel_mca.py --check    # also fails unless every NEON decode is >= 8x scalar and >= AVX2

An estimate, not a measurement: llvm-mca models the core (ports, latencies, dispatch width) with every load
hitting L1 and no branch mispredictions; it says whether a loop is written well, not what memory allows.
LLVM 19 has no model of its own for Apple M1: -mcpu=apple-m1 selects the Cyclone model (Apple A7, 6-wide),
so the M1 column is that older, narrower core's view.  Needs: gcc-aarch64-linux-gnu, gcc, llvm-19.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MCA = os.environ.get("LLVM_MCA", "llvm-mca-19")
CFLAGS = ["-std=gnu11", "-O3", "-ffp-contract=off", "-fno-strict-aliasing",
          # loops of constant trip count unrolled completely, so each region is straight-line code
          "--param=max-completely-peel-times=1024", "--param=max-completely-peeled-insns=100000",
          "--param=max-unrolled-insns=100000", "-I" + os.path.join(HERE, "..", "csrc")]
ARM_CPUS = ("neoverse-v2", "apple-m1")
X86_CPU = "znver4"

# loop -> (what it is, output bytes per iteration)
LOOPS = {
    "q8": ("MCF q8 block -> f32", 128), "q4": ("MCF q4 block -> f32", 128), "k6": ("MCF k6 block -> f32", 128),
    "k4": ("MCF k4 block -> f32", 128), "k3": ("MCF k3 block -> f32", 128), "k2": ("MCF k2 block -> f32", 128),
    "gguf_q8_0": ("GGUF Q8_0 block -> f32", 128), "gguf_q4_0": ("GGUF Q4_0 block -> f32", 128),
    "gguf_q2_k": ("GGUF Q2_K block -> f32", 1024), "gguf_q3_k": ("GGUF Q3_K block -> f32", 1024),
    "gguf_q4_k": ("GGUF Q4_K block -> f32", 1024), "gguf_q5_k": ("GGUF Q5_K block -> f32", 1024),
    "gguf_q6_k": ("GGUF Q6_K block -> f32", 1024),
    "f16_to_f32": ("f16 -> f32, 8 values", 32), "bf16_to_f32": ("bf16 -> f32, 8 values", 32),
    "f32_to_f16": ("f32 -> f16, 8 values", 16), "f32_to_bf16": ("f32 -> bf16, 8 values", 16),
}
DECODES = [k for k in LOOPS if "_to_" not in k]  # the decode loops the targets are about


def assemble(compiler, out):
    subprocess.run([compiler, *CFLAGS, "-S", os.path.join(HERE, "mca_loops.c"), "-o", out], check=True)
    text = open(out).read()
    # gcc writes negative byte immediates as 64-bit hex (movi v0.16b, 0xff..f8), which LLVM's assembler refuses
    text = re.sub(r"(movi\s+v\d+\.(?:16b|8b),\s*)0xf{14}([0-9a-f]{2})\b", r"\g<1>0x\2", text)
    # a loop body the compiler duplicated (peeled or versioned) keeps its first region only
    seen, lines = set(), []
    for line in text.splitlines():
        m = re.search(r"LLVM-MCA-(BEGIN|END) (\S+)", line)
        if m:
            key = (m.group(1), m.group(2))
            if key in seen:
                continue
            seen.add(key)
        lines.append(line)
    open(out, "w").write("\n".join(lines) + "\n")


def cycles(asm, triple, cpu):
    """{region: cycles per iteration}: llvm-mca's block reciprocal throughput of each region, the cycles the
    busiest execution resources need per iteration.  Its simulated total would also count dependencies
    between one iteration and the next that exist only in the harness (a function body repeated: the
    compiler reuses an argument register as a temporary), where a kernel's iterations are independent."""
    r = subprocess.run([MCA, f"-mtriple={triple}", f"-mcpu={cpu}", "-iterations=200", asm],
                       capture_output=True, text=True, check=True)
    out = {}
    for block in r.stdout.split("[")[1:]:
        m = re.match(r"\d+\] Code Region - (\S+)", block)
        rt = re.search(r"Block RThroughput:\s+([0-9.]+)", block)
        if m and rt:
            out[m.group(1)] = float(rt.group(1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail unless NEON decodes reach 8x scalar and AVX2's B/cycle")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        arm, x86 = os.path.join(tmp, "arm.s"), os.path.join(tmp, "x86.s")
        assemble("aarch64-linux-gnu-gcc", arm)
        assemble("gcc", x86)
        est = {cpu: cycles(arm, "aarch64", cpu) for cpu in ARM_CPUS}
        est[X86_CPU] = cycles(x86, "x86_64", X86_CPU)

    def bpc(cpu, region):
        c = est[cpu].get(region)
        return None if c is None else LOOPS[region.split("_", 1)[1]][1] / c

    def fmt(v):
        return "-" if v is None else f"{v:.1f}"

    print("| loop | NEON V2 | scalar V2 | NEON M1 | scalar M1 | AVX2 Zen 4 | scalar Zen 4 | NEON/scalar V2 |")
    print("|---|---|---|---|---|---|---|---|")
    failures = []
    for key, (what, _) in LOOPS.items():
        nv2, sv2 = bpc("neoverse-v2", "neon_" + key), bpc("neoverse-v2", "scalar_" + key)
        nm1, sm1 = bpc("apple-m1", "neon_" + key), bpc("apple-m1", "scalar_" + key)
        a2, sz = bpc(X86_CPU, "avx2_" + key), bpc(X86_CPU, "scalar_" + key)
        ratio = nv2 / sv2 if nv2 and sv2 else None
        print(f"| {what} | {fmt(nv2)} | {fmt(sv2)} | {fmt(nm1)} | {fmt(sm1)} | {fmt(a2)} | {fmt(sz)} | "
              f"{'-' if ratio is None else f'{ratio:.1f}x'} |")
        if key in DECODES and (ratio is None or ratio < 8 or a2 is None or nv2 < a2):
            failures.append(f"{key} ({'-' if ratio is None else f'{ratio:.1f}x'} scalar, "
                            f"{'-' if not a2 else f'{nv2 / a2:.2f}'} AVX2)")
    print("\nbytes written per cycle (llvm-mca-19 estimates; V2 = -mcpu=neoverse-v2, M1 = -mcpu=apple-m1, "
          "Zen 4 = -mcpu=znver4)")
    if args.check and failures:
        print(f"below target (NEON >= 8x scalar and >= AVX2 on V2): {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
