"""GGUF decode and conversion throughput (with the IQ / ternary / FP4 types and transformers' GGUF
loading).

1. Full decode of one 4096x4096 tensor of Q4_K, Q6_K, Q8_0 and Q4_0 to float32 (``GGUFFile.dequantize``
   into a preallocated 64-byte aligned buffer, every kernel variant this CPU supports) against
   gguf-py's ``gguf.quants.dequantize`` on the same bytes, shaped as GGUFReader hands them out
   (rows x row bytes).  Target: >= 20x for Q4_K.
2. ``convert_gguf(method="native")`` of a file of Q8_0 (or Q4_0) tensors to MCF q8 (q4), lossless,
   against plain copies of the same file made durable like the MCF writer makes its output
   (``shutil.copyfile`` + fsync, and a 16 MiB-chunk read/write loop + fsync; page cache warm), and the
   decode-to-float32 conversion of a Q4_K file against the same copies.

3. Every newer type (IQ1_S ... IQ4_XS, TQ1_0, TQ2_0, MXFP4, NVFP4, Q1_0, Q2_0): the same full
   decode, every variant, against gguf-py's dequantizer on the same bytes (Q1_0 / Q2_0, which gguf-py
   cannot decode: against the numpy reference of ggml's layout in tests/fixtures/gguf).  Target: >= 10x.
4. transformers' ``from_pretrained(dir, gguf_file=...)`` of a Q4_K_M-style llama (random Q4_K / Q6_K
   blocks, ~240M parameters) with gguf-py's ``gguf.dequantize`` and with ``mcf.gguf.dequantize`` in its
   place: whole load time, and the time spent inside the dequantizer, both ways.

Run: python -m pytest bench/test_bench_gguf.py --benchmark-only -s
"""

import os
import shutil
import sys
import time
import zlib

import numpy as np
import pytest

import mcf.gguf as G
from mcf._core import _kernels as K
from mcf.io import aligned_empty
from bench_common import median_time

gguf = pytest.importorskip("gguf", reason="gguf-py is the anchor of these benchmarks (pip install gguf)")
from gguf import GGMLQuantizationType as GT  # noqa: E402 - after the skip above

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, os.path.join(TESTS, "fixtures", "gguf"))
import gguf_fixtures as fx  # noqa: E402

N = 4096
TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0"]
IMPLS = K.kernel_info()["supported"]
_SUMMARY = []
F16_SCALES = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def _blocks(tname, n_blocks, seed_label):
    """Random codes with normal float16 scales around 0.01 (the decode work does not depend on the
    values); Q8_0/Q4_0 from gguf-py's own quantizer would be the same work."""
    rng = np.random.default_rng(zlib.crc32(seed_label.encode()))
    ts = gguf.GGML_QUANT_SIZES[GT[tname]][1]
    b = rng.integers(0, 256, (n_blocks, ts), dtype=np.uint8)
    for off in F16_SCALES[tname]:
        v = (0.01 + 0.001 * rng.random(n_blocks)).astype(np.float16)
        b[:, off:off + 2] = v.view(np.uint8).reshape(n_blocks, 2)
    return b


def _write(path, tname, count, rows=N, cols=N):
    w = gguf.GGUFWriter(path, "llama")
    bs = gguf.GGML_QUANT_SIZES[GT[tname]][0]
    for i in range(count):
        b = _blocks(tname, rows * cols // bs, f"{tname} {i}")
        w.add_tensor(f"blk.{i}.weight", b.reshape(rows, -1), raw_dtype=GT[tname])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def one_tensor_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_bench")
    out = {}
    for t in TYPES:
        p = str(d / f"{t}.gguf")
        _write(p, t, 1)
        out[t] = p
    return out


@pytest.fixture(scope="module")
def out_buf():
    out = aligned_empty(N * N * 4, 64).view(np.float32).reshape(N, N)
    out[...] = 1.0
    return out


@pytest.mark.parametrize("tname", TYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.benchmark(group="gguf-decode-4096x4096")
def test_decode_full(benchmark, one_tensor_files, out_buf, tname, impl):
    g = G.open(one_tensor_files[tname])
    name = "blk.0.weight"
    benchmark.pedantic(lambda: g.dequantize(name, out=out_buf, impl=impl), rounds=9, warmup_rounds=1,
                       iterations=1)
    t = benchmark.stats.stats.median
    raw = g.raw(name).reshape(N, -1)  # what GGUFReader's tensor.data is
    assert np.array_equal(gguf.quants.dequantize(raw, GT[tname]).view(np.uint32), out_buf.view(np.uint32))
    t_ref = median_time(lambda: gguf.quants.dequantize(raw, GT[tname]), rounds=3)
    src = np.ones((N, N), np.float32)
    t_copy = median_time(lambda: np.copyto(out_buf, src), rounds=5)
    gbps = N * N * 4 / t / 1e9
    benchmark.extra_info.update(gbps_out=gbps, vs_gguf_py=t_ref / t, gguf_py_gbps=N * N * 4 / t_ref / 1e9,
                                vs_copyto=t_copy / t)
    _SUMMARY.append(("decode", tname, impl, gbps, t_ref / t, t_copy / t))
    g.close()


@pytest.mark.parametrize("tname", TYPES)
@pytest.mark.benchmark(group="gguf-decode-fresh-output")
def test_decode_fresh_output(benchmark, one_tensor_files, tname):
    """The same decode into a freshly allocated array (what ``g.dequantize(name)`` does, and what
    gguf-py always does): includes numpy's allocation and the first-touch page faults."""
    g = G.open(one_tensor_files[tname])
    name = "blk.0.weight"
    benchmark.pedantic(lambda: g.dequantize(name), rounds=9, warmup_rounds=1, iterations=1)
    t = benchmark.stats.stats.median
    raw = g.raw(name).reshape(N, -1)
    t_ref = median_time(lambda: gguf.quants.dequantize(raw, GT[tname]), rounds=3)
    benchmark.extra_info.update(gbps_out=N * N * 4 / t / 1e9, vs_gguf_py=t_ref / t)
    _SUMMARY.append(("decode-fresh", tname, "best", N * N * 4 / t / 1e9, t_ref / t, None))
    g.close()


@pytest.mark.parametrize("tname", ["Q4_K", "Q6_K"])
@pytest.mark.benchmark(group="gguf-decode-2threads")
def test_decode_two_threads(benchmark, one_tensor_files, out_buf, tname):
    g = G.open(one_tensor_files[tname])
    t1 = median_time(lambda: g.dequantize("blk.0.weight", out=out_buf), rounds=5)
    benchmark.pedantic(lambda: g.dequantize("blk.0.weight", out=out_buf, threads=2), rounds=9,
                       warmup_rounds=1, iterations=1)
    t2 = benchmark.stats.stats.median
    benchmark.extra_info.update(speedup=t1 / t2)
    _SUMMARY.append(("2thr", tname, "best", N * N * 4 / t2 / 1e9, t1 / t2, None))
    g.close()


@pytest.fixture(scope="module")
def conversion_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_conv")
    out = {}
    for t, count in (("Q8_0", 8), ("Q4_0", 8), ("Q4_K", 4)):
        p = str(d / f"{t}x{count}.gguf")
        _write(p, t, count)
        out[t] = p
    return out


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _touch(path):
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass


@pytest.mark.parametrize("tname,method", [("Q8_0", "native"), ("Q4_0", "native"), ("Q4_K", None)])
@pytest.mark.benchmark(group="gguf-convert")
def test_convert(benchmark, conversion_files, tmp_path, tname, method):
    src = conversion_files[tname]
    dst = str(tmp_path / "out.mcf")
    size = os.path.getsize(src)

    def run():
        G.convert_gguf(src, dst, method=method)

    def copy():  # kernel-side copy (copy_file_range/sendfile), then made durable like the writer does
        shutil.copyfile(src, dst + ".copy")
        _fsync(dst + ".copy")

    def pycopy():  # the same bytes through user space in 16 MiB chunks, then fsync
        with open(src, "rb", buffering=0) as fi, open(dst + ".copy", "wb") as fo:
            while True:
                b = fi.read(16 << 20)
                if not b:
                    break
                fo.write(b)
            fo.flush()
            os.fsync(fo.fileno())

    _touch(src)
    benchmark.pedantic(run, rounds=5, warmup_rounds=1, iterations=1)
    t = benchmark.stats.stats.median
    t_copy = median_time(copy, rounds=5)
    t_pycopy = median_time(pycopy, rounds=5)
    out_size = os.path.getsize(dst)
    benchmark.extra_info.update(gbps_in=size / t / 1e9, vs_copy=t_copy / t, vs_pycopy=t_pycopy / t,
                                in_mb=size / 1e6, out_mb=out_size / 1e6)
    _SUMMARY.append((f"conv-{method or 'f32'}", tname, "best", size / t / 1e9, t_copy / t, t_pycopy / t))
    for p in (dst, dst + ".copy"):
        os.unlink(p)


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    """A llama-3-sized tokenizer: 128,256 tokens, scores, types and 280,000 merges."""
    path = str(tmp_path_factory.mktemp("gguf_vocab") / "vocab.gguf")
    n = 128_256
    w = gguf.GGUFWriter(path, "llama")
    w.add_token_list([f"tok{i}\u0120" + "ab" * (i % 7) for i in range(n)])
    w.add_token_scores([float(i) for i in range(n)])
    w.add_token_types([1] * n)
    w.add_token_merges([f"a{i} b{i}" for i in range(280_000)])
    w.add_tensor("x", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.benchmark(group="gguf-open")
def test_open_vocabulary(benchmark, vocab_file):
    """Opening a file whose header holds a large vocabulary: every key parsed, against gguf-py's
    GGUFReader (which also parses every field)."""
    _touch(vocab_file)
    benchmark.pedantic(lambda: G.open(vocab_file).close(), rounds=5, warmup_rounds=1, iterations=1)
    t = benchmark.stats.stats.median
    t_ref = median_time(lambda: gguf.GGUFReader(vocab_file), rounds=1)
    benchmark.extra_info.update(seconds=t, gguf_reader_seconds=t_ref, vs_gguf_reader=t_ref / t)
    _SUMMARY.append(("open-vocab", "-", "best", os.path.getsize(vocab_file) / t / 1e9, t_ref / t, None))


NEW_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
             "MXFP4", "NVFP4", "Q1_0", "Q2_0"]
_ANCHOR_BITS = {}  # type -> the reference decode's bits, computed once per type


def _new_type_blocks(tname):
    """N x N values of ``tname``: random codes, normal scales (float16 ones around 0.01; MXFP4 exponents
    2^-10..2^-2 as in real checkpoints, so that no value is a float32 subnormal)."""
    bs, _ = fx.sizes(tname)
    rng = np.random.default_rng(zlib.crc32(f"bench {tname}".encode()))
    b = fx.random_blocks(tname, N * N // bs, rng, normal=True)
    if tname == "MXFP4":
        b[:, 0] = rng.integers(117, 126, len(b), dtype=np.uint8)
    return b.reshape(N, -1)


def _anchor(tname, raw):
    """gguf-py's dequantizer on the bytes as GGUFReader hands them out; for Q1_0 / Q2_0, which it cannot
    decode, the numpy reference of ggml's layout (tests/fixtures/gguf)."""
    if tname in ("Q1_0", "Q2_0"):
        return fx.reference_decode(raw, tname, (N, N))
    return gguf.quants.dequantize(raw, GT[tname])


@pytest.mark.parametrize("tname", NEW_TYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.benchmark(group="gguf-decode-new-types-4096x4096")
def test_decode_new_types(benchmark, out_buf, tname, impl):
    """The ratio is the median of three pairs (mcf's best of three decodes, then one anchor decode, back to
    back), so that a change of the machine's load between the two measurements moves both."""
    from mcf.gguf import _gguf

    raw = _new_type_blocks(tname)
    flat = out_buf.reshape(-1)
    nb = raw.size // fx.sizes(tname)[1]
    code = G.ggml_type(tname).code

    def decode():
        _gguf.dequantize_blocks(raw.reshape(-1), code, nb, flat, impl=impl)

    benchmark.pedantic(decode, rounds=9, warmup_rounds=1, iterations=1)
    t = benchmark.stats.stats.median
    if tname not in _ANCHOR_BITS:
        _ANCHOR_BITS[tname] = _anchor(tname, raw).view(np.uint32).reshape(-1)
    assert np.array_equal(out_buf.view(np.uint32).reshape(-1), _ANCHOR_BITS[tname])
    ratios = []
    for _ in range(3):
        t_ours = min(median_time(decode, rounds=1) for _ in range(3))
        ratios.append(median_time(lambda: _anchor(tname, raw), rounds=1) / t_ours)
    ratio = float(np.median(ratios))
    gbps = N * N * 4 / t / 1e9
    benchmark.extra_info.update(gbps_out=gbps, vs_anchor=ratio, vs_anchor_pairs=ratios)
    _SUMMARY.append(("decode-new", tname, impl, gbps, ratio, None))


def _load_with(path, dequantize):
    """transformers' GGUF load of ``path`` with ``dequantize`` as gguf.dequantize; returns (seconds, seconds
    inside dequantize)."""
    import transformers

    spent = [0.0]

    def timed(data, qtype):
        t0 = time.perf_counter()
        try:
            return dequantize(data, qtype)
        finally:
            spent[0] += time.perf_counter() - t0

    saved = gguf.dequantize
    gguf.dequantize = timed
    try:
        t0 = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                                  gguf_file=os.path.basename(path))
        total = time.perf_counter() - t0
    finally:
        gguf.dequantize = saved
    del model
    return total, spent[0]


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    pytest.importorskip("transformers", reason="the loader being measured")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate")
    sys.path.insert(0, TESTS)
    from _gguf_llama import Q4_K_M, write_llama_gguf
    from _hf_models import tiny_model

    model = tiny_model("llama", hidden=1536, heads=16, kv_heads=4, layers=6, vocab=32000, positions=2048)
    path = str(tmp_path_factory.mktemp("gguf_llama") / "llama-q4_k_m.gguf")
    write_llama_gguf(model, path, Q4_K_M)
    del model
    return path


@pytest.mark.benchmark(group="gguf-transformers-load")
def test_transformers_load(benchmark, llama_gguf):
    """from_pretrained(gguf_file=...) with mcf's dequantize in place of gguf-py's, against gguf-py's."""
    import mcf.gguf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _touch(llama_gguf)
    inner = []
    benchmark.pedantic(lambda: inner.append(_load_with(llama_gguf, mcf.gguf.dequantize)), rounds=3,
                       warmup_rounds=1, iterations=1)
    t = benchmark.stats.stats.median
    t_dq = float(np.median([d for _, d in inner[1:]]))
    ref = [_load_with(llama_gguf, gguf.quants.dequantize) for _ in range(3)]
    t_ref, t_ref_dq = float(np.median([a for a, _ in ref])), float(np.median([d for _, d in ref]))
    size = os.path.getsize(llama_gguf)
    benchmark.extra_info.update(seconds=t, gguf_py_seconds=t_ref, vs_gguf_py=t_ref / t, dequant_seconds=t_dq,
                                gguf_py_dequant_seconds=t_ref_dq, dequant_vs_gguf_py=t_ref_dq / t_dq)
    _SUMMARY.append(("hf-load", "Q4KM", "best", size / t / 1e9, t_ref / t, t_ref_dq / t_dq))


def teardown_module(module):
    if not _SUMMARY:
        return
    print("\n\nkind          type  impl    GB/s    ratio-a   ratio-b")
    print("  decode: GB/s of float32 output into a preallocated buffer; ratio-a = vs gguf-py dequantize")
    print("          (target >= 20 for Q4_K), ratio-b = vs numpy.copyto of the same 64 MiB")
    print("  decode-fresh: the same into a new array each time (allocation and page faults included)")
    print("  2thr: ratio-a = 2 threads / 1 thread;  open-vocab: GB/s of header, ratio-a = vs gguf.GGUFReader")
    print("  conv-*: GB/s of GGUF input; ratio-a = vs shutil.copyfile + fsync, ratio-b = vs a 16 MiB-chunk")
    print("          read/write copy + fsync of the same file (the writer fsyncs too)")
    print("  decode-new: as decode, ratio-a = vs gguf-py (Q1_0 / Q2_0: vs the numpy reference); target >= 10")
    print("  hf-load: GB/s of GGUF file loaded by transformers; ratio-a = whole load vs gguf-py's dequantize,")
    print("          ratio-b = time inside the dequantizer, gguf-py's / mcf's")
    for kind, tn, impl, gbps, a, b in _SUMMARY:
        fa = f"{a:8.2f}x" if a is not None else "        -"
        fb = f"{b:8.2f}x" if b is not None else "        -"
        print(f"{kind:13s} {tn:5s} {impl:7s} {gbps:6.2f} {fa} {fb}")
