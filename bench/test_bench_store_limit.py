"""Every decode to float32 against the store limit, one thread.

The yardstick is ``mcf._core._kernels._store_yardstick`` (csrc/yardstick.c): a loop that reads 1 byte and
writes 4 with non-temporal stores, compiled like the kernels with the AVX2 instructions.  A decoder at its
speed is bound by writing its output, not by decoding; the target is >= 0.7x for 64 MiB outputs.  Each
decode (the MCF methods q*/k*/int*, the GGUF types with a vector variant, the mcf extension dtypes, and
the float16 / bfloat16 widening) is timed for a 64 MiB, a 4 MiB and a 1 MiB (cache-sized) float32 output, in rounds
interleaved with the yardstick's on the same output size, and the ratio of the medians is reported.  A
1 MiB output stays in a 2 MiB L2 (4 MiB does not on such a machine, and is bound by L3's write bandwidth):
there the decoders' own speed shows.

The variant is ``MCF_BENCH_IMPL`` (default ``avx2``: most x86 machines without AVX-512 run it; this
suite forces it on machines that have AVX-512 too).  Payloads are random bytes from 0x30..0x3b, which
every format reads as normal numbers (f16 / e4m3 / e8m0 / f32 scales), so no value is NaN and no
product is subnormal (a float32 subnormal costs a microcode assist that would measure the data, not
the decoder).

Run: python -m pytest bench/test_bench_store_limit.py --benchmark-only -s   (~1 min)
"""

import os
import time

import numpy as np
import pytest

from mcf._core import _fpconv, _kernels, _mx
from mcf._core.dtypes import parse_dtype
from mcf._core.scaled import scaled_layout
from mcf.container.layout import quant_layout
from mcf.gguf import _gguf
from mcf.io import aligned_empty

IMPL = os.environ.get("MCF_BENCH_IMPL", "avx2")
if IMPL not in _kernels.kernel_info()["supported"]:
    pytest.skip(f"this CPU cannot run the {IMPL} kernels (MCF_BENCH_IMPL)", allow_module_level=True)

SIZES = {"64MiB": 64 << 20, "4MiB": 4 << 20, "1MiB": 1 << 20}
COLS = 4096
ROUNDS = 9
TARGET = 0.7
MCF_METHODS = ["q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"]
MX_METHODS = ["mxfp4", "nvfp4", "f8_e4m3_b128"]
GGUF_NAMES = {8: "Q8_0", 2: "Q4_0", 14: "Q6_K", 12: "Q4_K", 13: "Q5_K", 11: "Q3_K", 10: "Q2_K", 16: "IQ2_XXS",
              17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
              29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
_SUMMARY = []


def _payload(nbytes, seed=0):
    return np.random.default_rng(seed).integers(0x30, 0x3C, nbytes, dtype=np.uint8)


def _decoders(out_bytes):
    """(name, function writing the float32 output into `out`) for every decode, sized for out_bytes."""
    n = out_bytes // 4
    rows = n // COLS
    for m in MCF_METHODS:
        info = parse_dtype(m)
        p = _payload(quant_layout(m, (rows, COLS)).nbytes)
        yield m, (lambda out, p=p, c=info.code: _kernels.dequantize(p, c, rows, COLS, out=out, impl=IMPL))
    for code, name in GGUF_NAMES.items():
        if IMPL not in _gguf.own_variants(code):
            continue
        bs, ts = _gguf.block_info(code)
        p = _payload(n // bs * ts)
        yield f"gguf {name}", (lambda out, p=p, c=code, nb=n // bs: _gguf.dequantize_blocks(p, c, nb, out, impl=IMPL))
    for m in MX_METHODS:
        info = parse_dtype(m)
        p = _payload(scaled_layout(info, (rows, COLS)).nbytes)
        yield m, (lambda out, p=p, c=info.code: _mx.dequantize(p, c, (rows, COLS), out=out, impl=IMPL))
    for m in ("f8_e4m3", "f8_e5m2"):
        p, c = _payload(n), parse_dtype(m).code
        yield m, (lambda out, p=p, c=c: _mx.decode_elements(p, c, out=out, impl=IMPL))
    h = _payload(n * 2).view(np.uint16)
    yield "f16->f32", lambda out: _fpconv.f16_to_f32(h, out=out, impl=IMPL)
    yield "bf16->f32", lambda out: _fpconv.bf16_to_f32(h, out=out, impl=IMPL)


def _time(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.benchmark(group="store-limit")
def test_decoders_against_the_store_limit(benchmark, size):
    out_bytes = SIZES[size]
    n = out_bytes // 4
    out = aligned_empty(out_bytes, 64).view(np.float32)
    out[:] = 1.0
    src = _payload(n, seed=1)
    reps = max(1, (64 << 20) // out_bytes)  # ~64 MiB written per timing: the 4 MiB case repeats 16 times

    def yardstick():
        for _ in range(reps):
            _kernels._store_yardstick(src, out.view(np.uint32), True)

    decoders = list(_decoders(out_bytes))
    for _, fn in decoders:
        fn(out)  # warm up (and fault in) everything once
    times = {name: [] for name, _ in decoders}
    yard = []
    for _ in range(ROUNDS):  # interleaved: a slow minute slows the yardstick and the decoders alike
        for name, fn in decoders:
            yard.append(_time(yardstick))
            times[name].append(_time(lambda fn=fn: [fn(out) for _ in range(reps)]))
    t_yard = float(np.median(yard))
    benchmark.pedantic(yardstick, rounds=3, iterations=1)
    info = {"yardstick_gbps": reps * out_bytes / t_yard / 1e9}
    for name, ts in times.items():
        t = float(np.median(ts))
        info[name] = {"gbps": reps * out_bytes / t / 1e9, "vs_yardstick": t_yard / t}
        _SUMMARY.append((size, name, reps * out_bytes / t / 1e9, t_yard / t))
    _SUMMARY.append((size, "yardstick (NT stores)", reps * out_bytes / t_yard / 1e9, 1.0))
    benchmark.extra_info.update(info, impl=IMPL, load=os.getloadavg())


def teardown_module(module):
    if not _SUMMARY:
        return
    print(f"\n\nvariant {IMPL}, one thread, float32 output; load average at the end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"size   decode                  GB/s   vs yardstick (target >= {TARGET} at 64 MiB)")
    for size, name, gbps, ratio in _SUMMARY:
        flag = "" if size != "64MiB" or ratio >= TARGET else "  NO"
        print(f"{size:6s} {name:22s} {gbps:6.2f}   {ratio:5.2f}x{flag}")
