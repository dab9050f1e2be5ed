"""Throughput of the error-minimizing quantizer (the default for q*/k*; issue: quantizer quality).

One core, a 4096x4096 float32 matrix (normal x 0.02), every method, every kernel variant this CPU
supports, in the same run as its anchors: the single-pass quantizer (``fast=True``, what the default was
before the search) and gguf-py's numpy quantizer (Q4_0 for q4/k4, Q8_0 for q8/k6; gguf-py has no
quantizer for its k-quants).  Target: >= 0.5 GB/s of float32 input for q4 and k4 with the search on.
The host load (``os.getloadavg``) is printed with the figures: on a shared machine they are only
comparable within one run.

Run: python -m pytest bench/test_bench_quant_search.py --benchmark-only -s
"""

import os
import time

import numpy as np
import pytest

import mcf
from mcf._core import _kernels as K

gguf = pytest.importorskip("gguf", reason="gguf-py's quantizer is an anchor of this benchmark (pip install gguf)")
from gguf.quants import GGMLQuantizationType as GT  # noqa: E402

N = 4096
METHODS = ["q4", "k4", "q8", "k6", "k3", "k2"]
ANCHOR = {"q4": GT.Q4_0, "k4": GT.Q4_0, "q8": GT.Q8_0, "k6": GT.Q8_0}
IMPLS = K.kernel_info()["supported"]
_ROWS = []
_GGUF = {}


@pytest.fixture(scope="module")
def weights():
    return (np.random.default_rng(0).standard_normal((N, N)) * 0.02).astype(np.float32)


def _best(fn, rounds):
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.benchmark(group="quantize-search-4096x4096")
def test_quantize_search(benchmark, weights, method, impl):
    if impl == "scalar" and method not in ("q4", "k4"):
        pytest.skip("the scalar reference is slow; q4 and k4 show it")
    rounds = 1 if impl == "scalar" else 3
    benchmark.pedantic(lambda: mcf.quantize(weights, method, impl=impl), rounds=rounds, warmup_rounds=0,
                       iterations=1)
    t_search = benchmark.stats.stats.min
    t_fast = _best(lambda: mcf.quantize(weights, method, fast=True, impl=impl), rounds)
    gt = ANCHOR.get(method)
    t_gguf = None
    if gt is not None:
        if gt not in _GGUF:
            with np.errstate(all="ignore"):
                _GGUF[gt] = _best(lambda: gguf.quants.quantize(weights, gt), 1)
        t_gguf = _GGUF[gt]
    gbps = weights.nbytes / t_search / 1e9
    info = {"gbps_in": gbps, "search_over_fast_time": t_search / t_fast,
            "vs_gguf": (t_gguf / t_search) if t_gguf else None, "load": os.getloadavg()[0]}
    benchmark.extra_info.update(info)
    _ROWS.append((method, impl, gbps, weights.nbytes / t_fast / 1e9, t_search / t_fast,
                  info["vs_gguf"], gt.name if gt is not None else "-"))


def teardown_module(module):
    if not _ROWS:
        return
    print(f"\n\nquantize 4096x4096 f32, one thread, load average {os.getloadavg()[0]:.2f} "
          "(search = the default; fast = the single-pass quantizer)")
    print("method impl     search GB/s  fast GB/s  search time / fast  search vs gguf-py (type)")
    for m, impl, g, gf, ratio, vg, gname in _ROWS:
        vs = f"{vg:8.2f}x ({gname})" if vg else "        -"
        print(f"{m:6s} {impl:7s} {g:11.2f} {gf:10.2f} {ratio:18.2f}x  {vs}")
