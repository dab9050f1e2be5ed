"""Decoding throughput of the extension dtypes' kernels (csrc/mx.c): mxfp4, nvfp4 and f8_e4m3_b128 payloads of
a 4096 x 4096 weight, every variant this CPU supports, into a preallocated 64-byte-aligned float32 buffer and as
bfloat16, against anchors measured in the same run:

- ``numpy.copyto`` of the same float32 output size (the memory-bandwidth yardstick);
- what users run today: gguf-py's MXFP4 ``dequantize`` (numpy), transformers' ``convert_moe_packed_tensors``
  (the gpt-oss loader, torch on the CPU, bfloat16), and the torch expressions of DeepSeek-V3's ``weight_dequant``
  and ModelOpt's ``NVFP4QTensor.dequantize`` (float32).

Ratios (anchor time / mcf time) go to benchmark.extra_info and the summary printed at the end.

Run: python -m pytest bench/test_bench_scaled.py --benchmark-only -s
"""

import numpy as np
import pytest

import mcf
from mcf._core import _kernels, _mx
from mcf.io import aligned_empty
from bench_common import median_time

N = 4096
FORMATS = ["mxfp4", "nvfp4", "f8_e4m3_b128"]
IMPLS = _kernels.kernel_info()["supported"]
_SUMMARY = []


def _payload(fmt):
    rng = np.random.default_rng(0)
    lay = mcf.quant_layout(fmt, (N, N))
    p = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    sc = lay.region("scales")
    if fmt == "mxfp4":
        p[sc.offset:sc.offset + sc.size] = rng.integers(118, 130, sc.size, dtype=np.uint8)
    elif fmt == "nvfp4":
        p[sc.offset:sc.offset + sc.size] = rng.integers(0x28, 0x60, sc.size, dtype=np.uint8)
        p[0:4] = np.frombuffer(np.float32(3e-4).tobytes(), np.uint8)
    else:
        p[sc.offset:sc.offset + sc.size] = np.frombuffer(rng.uniform(1e-4, 1e-2, sc.count).astype("<f4").tobytes(),
                                                         np.uint8)
    data = lay.region("data")
    if fmt == "f8_e4m3_b128":   # weights hold no NaN
        d = p[data.offset:data.offset + data.size]
        d[(d & 0x7F) == 0x7F] ^= 1
    return lay, p


@pytest.fixture(scope="module")
def payloads():
    return {f: _payload(f) for f in FORMATS}


@pytest.fixture(scope="module")
def out_buf():
    out = aligned_empty(N * N * 4, 64).view(np.float32).reshape(N, N)
    out[...] = 1.0
    return out


def _anchors(fmt, lay, p):
    """name -> seconds of what users run today on the same weight."""
    out = {}
    src = np.ones((N, N), np.float32)
    dst = np.empty((N, N), np.float32)
    out["numpy.copyto"] = median_time(lambda: np.copyto(dst, src))
    sc, data = lay.region("scales"), lay.region("data")
    scales, codes = p[sc.offset:sc.offset + sc.size], p[data.offset:data.offset + data.size]
    try:
        import torch
    except ImportError:   # pragma: no cover - the torch anchors need torch
        torch = None
    if fmt == "mxfp4":
        try:
            import gguf
            from gguf.quants import dequantize

            blocks = np.concatenate([scales.reshape(-1, 1), codes.reshape(-1, 16)], axis=1).reshape(N, -1)
            out["gguf-py MXFP4 dequantize"] = median_time(lambda: dequantize(blocks, gguf.GGMLQuantizationType.MXFP4),
                                                           rounds=3)
        except ImportError:   # pragma: no cover
            pass
        if torch is not None:
            try:
                from transformers.integrations.mxfp4 import convert_moe_packed_tensors
            except ImportError:   # pragma: no cover
                convert_moe_packed_tensors = None
            if convert_moe_packed_tensors is not None:
                b = torch.from_numpy(codes.reshape(1, N, N // 32, 16).copy())
                s = torch.from_numpy(scales.reshape(1, N, N // 32).copy())
                out["transformers convert_moe_packed_tensors (bf16)"] = median_time(
                    lambda: convert_moe_packed_tensors(b, s, dtype=torch.bfloat16), rounds=3)
    elif torch is not None and fmt == "f8_e4m3_b128":
        x = torch.from_numpy(codes.reshape(N, N).copy()).view(torch.float8_e4m3fn)
        s = torch.from_numpy(scales.view("<f4").reshape(N // 128, N // 128).copy())

        def weight_dequant():   # DeepSeek-V3's weight_dequant, as torch CPU code: y = x.float() * s[i//128, j//128]
            return (x.float().view(N // 128, 128, N // 128, 128) * s[:, None, :, None]).view(N, N)

        out["torch weight_dequant (f32)"] = median_time(weight_dequant, rounds=3)
    elif torch is not None:
        w = torch.from_numpy(codes.reshape(N, N // 2).copy())
        s = torch.from_numpy(scales.reshape(N, N // 16).copy()).view(torch.float8_e4m3fn)
        s2 = torch.tensor(3e-4)
        lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])

        def nvfp4_dequantize():   # ModelOpt's NVFP4QTensor.dequantize (non-fast path)
            u = torch.empty((N, N), dtype=torch.long)
            u[:, 1::2] = (w >> 4).long()
            u[:, 0::2] = (w & 15).long()
            return (lut[u].view(N, -1, 16) * (s.float() * s2).unsqueeze(-1)).view(N, N)

        out["torch NVFP4QTensor.dequantize (f32)"] = median_time(nvfp4_dequantize, rounds=3)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.benchmark(group="scaled-4096x4096")
def test_dequant(benchmark, payloads, out_buf, fmt, impl):
    lay, p = payloads[fmt]
    bf16 = np.empty((N, N), np.uint16)

    def run():
        _mx.dequantize(p, fmt, (N, N), out=out_buf, impl=impl)

    benchmark.pedantic(run, rounds=9, warmup_rounds=1, iterations=1)
    t = benchmark.stats.stats.median
    t_bf16 = median_time(lambda: _mx.dequantize(p, fmt, (N, N), out=bf16, impl=impl))
    ratios = {name: a / t for name, a in _anchors(fmt, lay, p).items()}
    benchmark.extra_info.update({"GB/s f32 out": N * N * 4 / t / 1e9, "ms bf16 out": t_bf16 * 1e3,
                                 **{f"x {k}": v for k, v in ratios.items()}})
    _SUMMARY.append((fmt, impl, t * 1e3, t_bf16 * 1e3, ratios))


def teardown_module(module):
    if not _SUMMARY:
        return
    print("\nextension dtypes, 4096 x 4096 (median ms; ratio = anchor time / mcf f32 time, same run)")
    for fmt, impl, ms, ms16, ratios in _SUMMARY:
        r = ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items())
        print(f"  {fmt:13} {impl:7} f32 {ms:7.2f} ms  bf16 {ms16:7.2f} ms  {r}")
