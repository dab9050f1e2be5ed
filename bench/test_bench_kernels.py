"""Dequantization and quantization throughput of the compiled kernels (issue: kernels).

For a 4096x4096 tensor of each method, float32 output into a preallocated 64-byte aligned buffer, every
variant this CPU supports, against (a) numpy.copyto of the same output size (memory-bandwidth
yardstick), (b) gguf-py's dequantizer of the nearest GGUF type, and (c) an L1-resident case: one row
(16 KiB of output) at a time into a small reused buffer, which shows the kernel's compute speed rather
than DRAM's.  Ratios are measured in the same run and stored in benchmark.extra_info.

Run: python -m pytest bench/test_bench_kernels.py --benchmark-only -s
"""

import threading

import numpy as np
import pytest

import mcf
from mcf._core import _kernels as K
from mcf.io import aligned_empty
from bench_common import median_time

gguf = pytest.importorskip("gguf", reason="gguf-py is the anchor of these benchmarks (pip install gguf)")
from gguf.quants import GGMLQuantizationType as GT  # noqa: E402

N = 4096
METHODS = ["q8", "q4", "k6", "k4", "k3", "k2"]
GGUF_TYPE = {"q8": GT.Q8_0, "q4": GT.Q4_0, "k6": GT.Q6_K, "k4": GT.Q4_K, "k3": GT.Q3_K, "k2": GT.Q2_K}
IMPLS = K.kernel_info()["supported"]
_SUMMARY = []


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((N, N)) * 0.02).astype(np.float32)


@pytest.fixture(scope="module")
def payloads(weights):
    return {m: mcf.quantize(weights, m)[0] for m in METHODS}


@pytest.fixture(scope="module")
def out_buf():
    out = aligned_empty(N * N * 4, 64).view(np.float32).reshape(N, N)
    out[...] = 1.0
    return out


def _copyto_time(out, src):
    return median_time(lambda: np.copyto(out, src))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.benchmark(group="dequant-4096x4096")
def test_dequant_full(benchmark, payloads, out_buf, weights, method, impl):
    code = mcf._core.dtypes.parse_dtype(method).code
    p = payloads[method]

    def run():
        K.dequantize(p, code, N, N, out=out_buf, impl=impl)

    benchmark.pedantic(run, rounds=9, warmup_rounds=1, iterations=1)
    t = benchmark.stats.stats.median
    t_copy = _copyto_time(out_buf, weights)
    gbps = N * N * 4 / t / 1e9
    ratio_copy = t_copy / t
    # gguf-py on its nearest type (random bytes of the right size: the decode work is the same)
    gt = GGUF_TYPE[method]
    block, tsize = gguf.GGML_QUANT_SIZES[gt]
    raw = np.random.default_rng(1).integers(0, 256, (N, N // block * tsize), dtype=np.uint8)
    if gt in (GT.Q8_0, GT.Q4_0):
        raw = gguf.quants.quantize(weights, gt)
    with np.errstate(all="ignore"):
        t_gguf = median_time(lambda: gguf.quants.dequantize(raw, gt), rounds=2)
    ratio_gguf = t_gguf / t
    benchmark.extra_info.update(gbps_out=gbps, vs_copyto=ratio_copy, vs_gguf=ratio_gguf,
                                gguf_gbps=N * N * 4 / t_gguf / 1e9, copyto_gbps=N * N * 4 / t_copy / 1e9)
    _SUMMARY.append(("full", method, impl, gbps, ratio_copy, ratio_gguf))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.benchmark(group="dequant-L1-resident")
def test_dequant_l1(benchmark, payloads, weights, out_buf, method, impl):
    """Every row of the tensor decoded one row (16 KiB) at a time into the same small buffer, in one
    C loop (QTensor.decode_tiles): the kernel's compute speed, with the output staying in L1.  Anchor:
    numpy.copyto of the full 64 MiB tensor (the issue's yardstick, ~13 GB/s here)."""
    code = mcf._core.dtypes.parse_dtype(method).code
    qt = K.QTensor(payloads[method], code, N, N, impl=impl)
    tile = aligned_empty(N * 4, 64).view(np.float32)
    benchmark.pedantic(lambda: qt.decode_tiles(0, N, 1, tile), rounds=7, warmup_rounds=1, iterations=1)
    t = benchmark.stats.stats.median
    t_copy = _copyto_time(out_buf, weights)
    gbps = N * N * 4 / t / 1e9
    benchmark.extra_info.update(gbps_out=gbps, vs_copyto=t_copy / t)
    _SUMMARY.append(("L1", method, impl, gbps, t_copy / t, None))


def _two_threads(benchmark, qt, rows, passes):
    """Decoding ``rows`` rows of ``qt`` tile by tile ``passes`` times: the median seconds of one thread doing
    it all (best of two), then of two threads each doing half into its own small buffer (the benchmark)."""
    tiles = [aligned_empty(N * 4, 64).view(np.float32) for _ in range(2)]

    def part(k, r0, r1):
        for _ in range(passes):
            qt.decode_tiles(r0, r1, 1, tiles[k])

    def two():
        ts = [threading.Thread(target=part, args=(k, k * rows // 2, (k + 1) * rows // 2)) for k in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    t1 = min(median_time(lambda: part(0, 0, rows)) for _ in range(2))
    benchmark.pedantic(two, rounds=7, warmup_rounds=1, iterations=1)
    t2 = benchmark.stats.stats.median
    benchmark.extra_info.update(speedup_2_threads=t1 / t2)
    return t1, t2


@pytest.mark.parametrize("method", ["q8", "q4", "k4", "k3"])
@pytest.mark.benchmark(group="dequant-L1-2threads")
def test_dequant_l1_two_threads(benchmark, payloads, method):
    """Two threads, each decoding half of the rows tile by tile into its own small buffer (one
    GIL-free C loop per thread): speedup over one thread doing all the rows."""
    code = mcf._core.dtypes.parse_dtype(method).code
    qt = K.QTensor(payloads[method], code, N, N)
    passes = 64  # ~0.1 s of work per round: thread start-up, wake-up and this VM's scheduling noise must not dominate
    t1, t2 = _two_threads(benchmark, qt, N, passes)
    _SUMMARY.append(("2thr", method, "best", passes * N * N * 4 / t2 / 1e9, t1 / t2, None))


@pytest.mark.parametrize("method", ["q8", "q4", "k4", "k3"])
@pytest.mark.benchmark(group="dequant-L2-payload-2threads")
def test_dequant_l2_payload_two_threads(benchmark, weights, method):
    """The same two-thread split on a 128 x 4096 slice of the tensor, whose payload (0.3-0.5 MiB) stays in
    each core's L2 across passes: the kernel's own scaling, without the payload stream from L3/DRAM that
    the 4096 x 4096 case shares between the two cores (one thread already reads 6-16 GB/s of it)."""
    rows = 128
    code = mcf._core.dtypes.parse_dtype(method).code
    payload, _ = mcf.quantize(np.ascontiguousarray(weights[:rows]), method)
    qt = K.QTensor(payload, code, rows, N)
    passes = 2048  # ~0.15 s of work per round
    t1, t2 = _two_threads(benchmark, qt, rows, passes)
    _SUMMARY.append(("2thrL2", method, "best", passes * rows * N * 4 / t2 / 1e9, t1 / t2, None))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.benchmark(group="quantize-4096x4096")
def test_quantize(benchmark, weights, method, threads):
    """The single-pass quantizer (fast=True); the default scale search: bench/test_bench_quant_search.py."""
    benchmark.pedantic(lambda: mcf.quantize(weights, method, fast=True, threads=threads), rounds=3,
                       warmup_rounds=0, iterations=1)
    t = benchmark.stats.stats.median
    gbps = N * N * 4 / t / 1e9
    info = {"gbps_in": gbps}
    if method in ("q8", "q4"):
        gt = GGUF_TYPE[method]
        with np.errstate(all="ignore"):
            t_g = median_time(lambda: gguf.quants.quantize(weights, gt), rounds=1)
        info["vs_gguf_quantize"] = t_g / t
    benchmark.extra_info.update(info)
    _SUMMARY.append(("quant", method, f"{threads}thr", gbps, info.get("vs_gguf_quantize"), None))


def teardown_module(module):
    if not _SUMMARY:
        return
    print("\n\nkind   method impl     GB/s   ratio-a   ratio-b")
    print("  full: ratio-a = vs numpy.copyto (target >= 1.4), ratio-b = vs gguf-py (target >= 20)")
    print("  L1: ratio-a = vs numpy.copyto of the full tensor (target >= 3 for q8/q4/k4, >= 2.3 others)")
    print("  2thr: ratio-a = 2 threads / 1 thread (target >= 1.6); 2thrL2: same on an L2-resident payload; "
          "quant: ratio-a = vs gguf-py quantize")
    for kind, m, impl, gbps, a, b in _SUMMARY:
        fa = f"{a:8.2f}x" if a is not None else "        -"
        fb = f"{b:8.2f}x" if b is not None else "        -"
        print(f"{kind:6s} {m:6s} {impl:7s} {gbps:6.2f} {fa} {fb}")
