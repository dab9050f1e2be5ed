"""The compiled kernels against the plain-numpy reference (tests/reference.py), every variant this CPU
supports forced one by one, plus the Go reference files."""

import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import reference as ref
from _vectors import MANTLE, mantle_file
from mcf._core import _kernels as K
from mcf.conversion.quant_policy import quantize_file

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

IMPLS = K.kernel_info()["supported"]
QK = ["q8", "q4", "k6", "k4", "k3", "k2"]
ALL = QK + ["int8", "int4"]
SHAPES = [(1, 1), (1, 31), (2, 32), (3, 33), (2, 40), (1, 255), (2, 256), (3, 257), (2, 2080), (4, 300),
          (1, 512), (2, 2048 + 32)]


def random_payload(method, rows, cols, rng, domain=0, scale_kind="normal"):
    regs, total = ref.layout(method, rows, cols, domain)
    p = rng.integers(0, 256, total, dtype=np.uint8)
    for name, (o, n) in regs.items():
        if name in ("scales", "super_scales"):
            if scale_kind == "normal":
                h = rng.uniform(1e-4, 2.0, n // 2).astype(np.float16).view(np.uint16)
            else:  # every finite bit pattern and infinity: zeros, subnormals (flushed), huge values
                h = (rng.integers(0, 0x7C01, n // 2, dtype=np.uint16)
                     | (rng.integers(0, 2, n // 2, dtype=np.uint16) << 15))
                h[rng.random(n // 2) < 0.1] = rng.choice(np.array([0, 0x8000, 1, 0x83FF], np.uint16))
            p[o:o + n] = h.view(np.uint8)
        elif name in ("scale", "zero"):
            p[o:o + 4] = np.frombuffer(np.float32(rng.uniform(-2, 2)).tobytes(), np.uint8)
    return p


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", ALL)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequant_matches_reference(method, shape, impl):
    rng = np.random.default_rng(zlib.crc32(repr((method, shape)).encode()))  # stable across runs
    domain = 1 if method == "int8" else 0
    p = random_payload(method, *shape, rng, domain, "all" if method in QK else "normal")
    want = ref.dequant(p, method, *shape, domain)
    code = mcf._core.dtypes.parse_dtype(method).code
    got = K.dequantize(p, code, *shape, domain=domain, impl=impl)
    assert got.tobytes() == want.tobytes()
    got16 = K.dequantize(p, code, *shape, domain=domain, dtype=np.float16, impl=impl)
    assert got16.view(np.uint16).tobytes() == ref.to_f16_bits(want).tobytes()
    gotbf = K.dequantize(p, code, *shape, domain=domain, dtype=np.uint16, impl=impl)
    assert gotbf.tobytes() == ref.to_bf16_bits(want).tobytes()


ZERO_SCALES = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF], np.uint16)  # +-0 and subnormals


def zero_scale_payload(method, rows, cols, rng):
    """Random codes (the most negative ones included) under scales that decode to zero: q* blocks
    with a zero or subnormal f16 scale, k* blocks under such a super scale or with u6 = 0 (under a
    normal, a huge or an infinite super scale), int* with a zero per-tensor scale (+0.0 or -0.0).
    Every other block keeps a normal scale.  Returns (payload, mask of values that must be +0.0)."""
    regs, total = ref.layout(method, rows, cols)
    p = rng.integers(0, 256, total, dtype=np.uint8)
    bpr, fam = -(-cols // 32), ref.FAMILY[method]
    zero = np.zeros((rows, bpr), bool)
    if fam == "raw":
        o, _ = regs["scale"]
        p[o:o + 4] = np.frombuffer(np.float32(rng.choice([0.0, -0.0])).tobytes(), np.uint8)
        return p, np.ones((rows, cols), bool)
    if fam == "block":
        h = rng.uniform(1e-3, 2.0, rows * bpr).astype(np.float16).view(np.uint16).reshape(rows, bpr)
        zero = rng.random((rows, bpr)) < 0.5
        zero[0, 0] = True
        h[zero] = rng.choice(ZERO_SCALES, int(zero.sum()))
        o, n = regs["scales"]
        p[o:o + n] = h.reshape(-1).view(np.uint8)
    else:
        spr = -(-bpr // 8)
        sup = rng.uniform(1e-3, 2.0, rows * spr).astype(np.float16).view(np.uint16).reshape(rows, spr)
        zsup = rng.random((rows, spr)) < 0.3
        zsup[0, 0] = True
        sup[zsup] = rng.choice(ZERO_SCALES, int(zsup.sum()))
        big = ~zsup & (rng.random((rows, spr)) < 0.3)
        sup[big] = rng.choice(np.array([0x7BFF, 0x7C00, 0xFC00], np.uint16), int(big.sum()))  # max, +-inf
        sub = p[regs["sub_scales"][0]:regs["sub_scales"][0] + rows * bpr].reshape(rows, bpr)
        u0 = rng.random((rows, bpr)) < 0.3
        sub[u0] &= 0xC0          # u6 = 0 (the unused top bits stay random)
        sub[~u0 & ((sub & 0x3F) == 0)] |= 1
        zero = u0 | np.repeat(zsup, 8, axis=1)[:, :bpr]
        o, n = regs["super_scales"]
        p[o:o + n] = sup.reshape(-1).view(np.uint8)
    mask = np.repeat(zero, 32, axis=1)[:, :cols]
    return p, mask


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", ALL)
@pytest.mark.parametrize("shape", [(1, 1), (3, 40), (2, 300), (4, 1100)])
def test_zero_scale_blocks_decode_to_positive_zero(method, shape, impl):
    """The Go decoder skips a block whose scale is zero and leaves +0.0 in it; every variant must
    give +0.0 (not -0.0 for a negative code, not NaN for an infinite super scale with u6 = 0), in
    every output dtype, whole or by rows or tiles, and agree with the reference elsewhere."""
    rng = np.random.default_rng(zlib.crc32(repr(("zero", method, shape)).encode()))
    rows, cols = shape
    p, mask = zero_scale_payload(method, rows, cols, rng)
    code = mcf._core.dtypes.parse_dtype(method).code
    want = ref.dequant(p, method, rows, cols)
    assert not (want.view(np.uint32)[mask]).any()          # the reference says +0.0 too
    got = K.dequantize(p, code, rows, cols, impl=impl)
    assert got.tobytes() == want.tobytes()
    assert not got.view(np.uint32)[mask].any()
    for dt in (np.float16, np.uint16):
        assert not K.dequantize(p, code, rows, cols, dtype=dt, impl=impl).view(np.uint16)[mask].any()
    part = K.dequantize(p, code, rows, cols, row_range=(rows - 1, rows), impl=impl)
    assert part.tobytes() == want[rows - 1:].tobytes()
    qt = K.QTensor(p, code, rows, cols, impl=impl)
    buf = np.empty(cols, np.float32)
    qt.rows_into(0, 1, buf)
    assert buf.tobytes() == want[0].tobytes()


@pytest.mark.parametrize("method", QK)
def test_compat_quantized_underflowing_blocks_decode_to_positive_zero(method):
    """The Go quantizer computes codes from the unrounded f32 scale and stores a truncated f16 one:
    a block of values so small that the stored scale flushes to zero keeps nonzero codes (negative
    ones too).  Decoding it gives +0.0 everywhere, as the Go decoder does."""
    x = np.full((2, 64), 1e-7, np.float32)
    x[:, 1::2] = -3e-7
    payload, _ = mcf.quantize(x, method, compat=True)
    codes = K.unpack_codes(payload, mcf._core.dtypes.parse_dtype(method).code, 2, 64)
    assert (codes < 0).any()                  # the codes say "negative"
    for impl in IMPLS:
        y = mcf.dequantize(payload, method, x.shape, impl=impl)
        assert not y.view(np.uint32).any()    # every value is +0.0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", ALL)
def test_unpack_matches_reference(method, impl):
    rng = np.random.default_rng(3)
    rows, cols = 3, 300
    p = random_payload(method, rows, cols, rng)
    got = K.unpack_codes(p, mcf._core.dtypes.parse_dtype(method).code, rows, cols, impl=impl)
    regs, _ = ref.layout(method, rows, cols)
    o, n = regs["data"]
    if method in QK:
        want = ref.codes_of_blocks(p[o:o + n], ref.BITS[method], rows * 10).reshape(rows, 320)
        assert int(got.min()) == -(1 << (ref.BITS[method] - 1))  # the most negative code decodes
    else:
        want = ref.raw_codes(p[o:o + n], ref.BITS[method], rows, cols)
    assert np.array_equal(got, want)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(QK), rows=st.integers(1, 4), cols=st.integers(1, 1100), seed=st.integers(0, 2**32 - 1),
       compat=st.booleans(), scale=st.sampled_from([1e-6, 0.01, 1.0, 300.0]))
def test_quantize_property_all_variants(method, rows, cols, seed, compat, scale):
    """The single-pass quantizer (fast=True) and the Go-compatible one against ref.quantize."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    x[rng.random((rows, cols)) < 0.1] = 0.0
    want = ref.quantize(x, method, compat).tobytes()
    for impl in IMPLS:
        assert mcf.quantize(x, method, compat=compat, fast=True, impl=impl)[0].tobytes() == want


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(ALL), rows=st.integers(1, 6), cols=st.integers(1, 700), seed=st.integers(0, 2**32 - 1),
       data=st.data())
def test_dequant_property(method, rows, cols, seed, data):
    rng = np.random.default_rng(seed)
    domain = data.draw(st.sampled_from([0, 1])) if method in ("int8", "int4") else 0
    p = random_payload(method, rows, cols, rng, domain, "all")
    want = ref.dequant(p, method, rows, cols, domain)
    code = mcf._core.dtypes.parse_dtype(method).code
    for impl in IMPLS:
        assert K.dequantize(p, code, rows, cols, domain=domain, impl=impl).tobytes() == want.tobytes()
    r0 = data.draw(st.integers(0, rows))
    r1 = data.draw(st.integers(r0, rows))
    part = K.dequantize(p, code, rows, cols, domain=domain, row_range=(r0, r1))
    assert part.tobytes() == want[r0:r1].tobytes()


def test_threads_and_out_and_row_slices():
    rng = np.random.default_rng(9)
    p = random_payload("k4", 37, 333, rng)
    want = ref.dequant(p, "k4", 37, 333)
    code = mcf._core.dtypes.parse_dtype("k4").code
    for threads in (2, 3, 64):
        assert K.dequantize(p, code, 37, 333, threads=threads).tobytes() == want.tobytes()
    out = np.full((5, 333), np.nan, np.float32)
    res = K.dequantize(p, code, 37, 333, row_range=slice(10, 15), out=out)
    assert res is out and out.tobytes() == want[10:15].tobytes()
    with pytest.raises(mcf.InvalidArgumentError):
        K.dequantize(p, code, 37, 333, row_range=(10, 15), out=np.empty((4, 333), np.float32))
    with pytest.raises(mcf.InvalidArgumentError):
        K.dequantize(p, code, 37, 333, row_range=(30, 40))
    with pytest.raises(mcf.InvalidArgumentError):
        K.dequantize(p[:-1], code, 37, 333)
    with pytest.raises(mcf.InvalidArgumentError):
        K.dequantize(p, code, 37, 333, out=np.empty((37, 333), np.float64))
    with pytest.raises(mcf.InvalidArgumentError):
        K.dequantize(p, code, 37, 333, out=np.empty((333, 37), np.float32).T)


def test_impl_forcing(monkeypatch):
    info = mcf.kernel_info()
    assert info["active"] in ("scalar", "avx2", "avx512", "neon") and "scalar" in info["supported"]
    with pytest.raises(mcf.InvalidArgumentError):
        K.resolve_impl("sse9")
    monkeypatch.setenv("MCF_FORCE_IMPL", "scalar")
    assert mcf.kernel_info()["active"] == "scalar" and K.resolve_impl() == 0
    monkeypatch.setenv("MCF_FORCE_IMPL", "bogus")
    assert mcf.kernel_info()["active"].startswith("error")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", QK)
@pytest.mark.parametrize("compat", [False, True])
def test_quantizer_matches_reference(method, compat, impl):
    rng = np.random.default_rng(11)
    for shape in [(1, 1), (3, 40), (5, 300), (2, 2080), (4, 96), (3, 33)]:
        x = (rng.standard_normal(shape) * rng.choice([1e-4, 0.02, 3.0, 1e3], size=(shape[0], 1))).astype(np.float32)
        x[0, : min(5, shape[1])] = 0.0
        x.reshape(-1)[-1] = 0.5 * np.float32(3.0)  # exact ties of the rounding rule appear in the codes
        payload, q = mcf.quantize(x, method, compat=compat, fast=True, impl=impl)
        assert payload.tobytes() == ref.quantize(x, method, compat).tobytes(), shape
        assert q["max_clip"] == np.abs(x).max() and q["min_clip"] == -np.abs(x).max()


@pytest.mark.parametrize("method", QK)
def test_single_pass_quantizer_error_is_bounded(method):
    """fast=True: scale = max|x| / qmax, so no value is off by more than half a step (k*: one step)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    payload, _ = mcf.quantize(x, method, fast=True)
    y = mcf.dequantize(payload, method, x.shape)
    bits = ref.BITS[method]
    qmax = (1 << (bits - 1)) - 1
    blocks = np.abs(x).reshape(16, 16, 32).max(axis=2)
    tol = blocks / qmax * (0.5 if method.startswith("q") else 1.0) * 1.01 + 1e-6
    err = np.abs(y - x).reshape(16, 16, 32).max(axis=2)
    assert (err <= tol).all()


@pytest.mark.parametrize("method,domain", [("int8", 0), ("int8", 1), ("int4", 0), ("int4", 1)])
def test_int_methods_round_trip(method, domain):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((7, 45)) + (1.5 if domain else 0)).astype(np.float32)
    payload, q = mcf.quantize(x, method, domain=domain)
    assert q["domain"] == domain
    y = mcf.dequantize(payload, method, x.shape, domain=domain)
    assert y.tobytes() == ref.dequant(payload, method, 7, 45, domain).tobytes()
    bits = ref.BITS[method]
    if domain:  # asymmetric: 2**bits - 1 steps over [min(x, 0), max(x)]
        step = (x.max() - min(x.min(), 0)) / ((1 << bits) - 1)
    else:       # symmetric: qmax steps over [0, max|x|]
        step = np.abs(x).max() / ((1 << (bits - 1)) - 1)
    assert np.abs(y - x).max() <= step * 0.51 + 1e-6


def test_nan_and_inf_are_refused():
    x = np.ones((2, 40), np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        x[1, 7] = bad
        with pytest.raises(mcf.InvalidArgumentError, match="non-finite"):
            mcf.quantize(x, "k4")


def test_inputs_in_f16_and_bf16_quantize_like_their_f32_values():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 100)).astype(np.float32)
    for dt in (np.float16, ml_dtypes.bfloat16):
        xd = x.astype(dt)
        a, _ = mcf.quantize(xd, "q8")
        b, _ = mcf.quantize(xd.astype(np.float32), "q8")
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("method", ["q4", "k4", "k3"])
def test_compat_quantize_reproduces_go_files(tmp_path, method):
    out = tmp_path / f"{method}.mcf"
    quantize_file(mantle_file("f32"), out, method, compat=True)
    with open(out, "rb") as f, open(mantle_file(method), "rb") as g:
        assert f.read() == g.read()


@pytest.mark.parametrize("method", ["q4", "k4", "k3"])
@pytest.mark.parametrize("impl", IMPLS)
def test_go_decoder_values(method, impl):
    with mcf.open(mantle_file(method)) as c:
        for name in c:
            t = c.info(name)
            deq = np.fromfile(os.path.join(MANTLE, "deq", method, name + ".deq.f32"), dtype="<f4")
            got = c.dequantize(name, impl=impl) if t.quantized else c.to_float32(name)
            assert got.tobytes() == deq.tobytes(), name


def test_writer_method_and_container_dequantize(tmp_path):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    p = tmp_path / "q.mcf"
    with mcf.Writer(p) as wr:
        wr.add_tensor("w", w, method="k6")
        wr.add_tensor("norm", np.ones(96, np.float32), method="k6")  # rank 1: stored plain
        wr.add_tensor("ids", np.arange(6, dtype=np.int64).reshape(2, 3), method="k6")  # not float: plain
    with mcf.open(p) as c:
        assert c.info("w").dtype.name == "k6" and c.info("norm").dtype.name == "f32"
        assert c.info("ids").dtype.name == "i64"
        full = c.tensor("w")
        assert full.dtype == np.float32 and full.shape == (64, 96)
        assert c.dequantize("w", rows=(8, 16)).tobytes() == full[8:16].tobytes()
        half = c.dequantize("w", dtype=np.float16)
        assert half.view(np.uint16).tobytes() == ref.to_f16_bits(full).tobytes()
        out = np.empty((64, 96), np.float32)
        assert c.dequantize("w", out=out, threads=2) is out and out.tobytes() == full.tobytes()
        assert c.dequantize("norm").tobytes() == np.ones(96, np.float32).tobytes()
        rec = c.quant_record("w")
        assert rec.method == mcf.DType.K6 and rec.max_clip == np.abs(w).max()
        assert np.abs(full - w).max() < 0.1


@pytest.mark.parametrize("method", ALL)
def test_large_outputs_stream_the_same_values(method):
    """Outputs of 8 MiB and more, 64-byte aligned, take the streaming-store path of the vector variants
    (csrc/simd.h); a misaligned or narrower one takes the plain stores.  Both must give the scalar bits,
    zero-scale blocks and the partial last block of each row included."""
    rng = np.random.default_rng(zlib.crc32(repr(("stream", method)).encode()))
    code = mcf._core.dtypes.parse_dtype(method).code
    for rows, cols in ((64, 32768), (2047, 1032)):       # 8 MiB; 8.06 MiB with a 8-column last block
        p = random_payload(method, rows, cols, rng, 0, "all" if method in QK else "normal")
        want = K.dequantize(p, code, rows, cols, impl="scalar")
        assert want.ctypes.data % 64 == 0 and want.nbytes >= 8 << 20
        raw = np.empty(rows * cols * 4 + 64, np.uint8)
        skew = raw[(-raw.ctypes.data) % 64 + 4:][: rows * cols * 4].view(np.float32)   # 4 bytes off alignment
        for impl in IMPLS:
            assert K.dequantize(p, code, rows, cols, impl=impl).tobytes() == want.tobytes(), impl
            K.dequantize(p, code, rows, cols, impl=impl, out=skew)
            assert skew.tobytes() == want.tobytes(), impl


def test_qtensor_tiles_equal_full_decode():
    rng = np.random.default_rng(12)
    p = random_payload("k3", 9, 200, rng)
    want = ref.dequant(p, "k3", 9, 200)
    for impl in IMPLS:
        qt = K.QTensor(p, mcf._core.dtypes.parse_dtype("k3").code, 9, 200, impl=impl)
        buf = np.empty(2 * 200, np.float32)
        for r in range(0, 9, 2):
            r1 = min(9, r + 2)
            qt.rows_into(r, r1, buf)
            assert buf[: (r1 - r) * 200].tobytes() == want[r:r1].tobytes()
        with pytest.raises(mcf.InvalidArgumentError):
            qt.rows_into(8, 10, buf)
        with pytest.raises(mcf.InvalidArgumentError):
            qt.rows_into(0, 3, buf)


def test_decode_tiles_covers_every_row():
    rng = np.random.default_rng(13)
    p = random_payload("q4", 10, 70, rng)
    want = ref.dequant(p, "q4", 10, 70)
    qt = K.QTensor(p, mcf._core.dtypes.parse_dtype("q4").code, 10, 70)
    tile = np.empty(3 * 70, np.float32)
    assert qt.decode_tiles(0, 10, 3, tile) == 4
    assert tile[:70].tobytes() == want[9].tobytes()  # the last tile held row 9 only
    with pytest.raises(mcf.InvalidArgumentError):
        qt.decode_tiles(0, 10, 4, tile)
    with pytest.raises(mcf.InvalidArgumentError):
        qt.decode_tiles(0, 11, 1, tile)


@pytest.mark.parametrize("method", ["q8", "k3"])
def test_quantize_threads_give_the_same_bytes(method):
    x = np.random.default_rng(21).standard_normal((300, 1000)).astype(np.float32)
    one, q1 = mcf.quantize(x, method)
    for threads in (2, 3):
        many, q2 = mcf.quantize(x, method, threads=threads)
        assert many.tobytes() == one.tobytes() and q1 == q2


@pytest.mark.parametrize("impl", IMPLS)
def test_absmax_all_variants(impl):
    """The quantizer's range pass: the same max |x| from every variant, the first non-finite value named."""
    rng = np.random.default_rng(zlib.crc32(b"absmax"))
    for n in (0, 1, 15, 16, 17, 1000, 4099):
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        want = float(np.abs(x).max()) if n else 0.0
        assert K.absmax(x, impl=impl) == want
        if n:
            for bad in (np.nan, np.inf, -np.inf):
                y = x.copy()
                y[n // 2] = bad
                with pytest.raises(mcf.errors.InvalidArgumentError, match=f"flat index {n // 2}"):
                    K.absmax(y, impl=impl)


@pytest.mark.parametrize("method", QK)
def test_quantize_wide_rows_every_group_path(method):
    """Rows of several 16-block groups plus a tail (the AVX-512 path quantizes 16 blocks at once), with
    all-zero blocks, a block whose f16 scale is subnormal, and exact rounding ties inside a group."""
    rng = np.random.default_rng(zlib.crc32(method.encode()))
    for cols in (512, 1024 + 32, 2048 + 300):
        x = (rng.standard_normal((3, cols)) * 0.05).astype(np.float32)
        x[0, 32:64] = 0.0
        x[1, 64:96] *= 1e-5
        x[2, 96:128] = np.float32(0.5) * np.arange(32, dtype=np.float32)
        want = ref.quantize(x, method, False).tobytes()
        for impl in IMPLS:
            assert mcf.quantize(x, method, fast=True, impl=impl)[0].tobytes() == want, (cols, impl)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(["int8", "int4"]), domain=st.sampled_from([0, 1]), rows=st.integers(1, 4),
       cols=st.integers(1, 200), seed=st.integers(0, 2**32 - 1), shift=st.sampled_from([0.0, 0.7, -3.0]))
def test_int_quantizer_matches_reference_all_variants(method, domain, rows, cols, seed, shift):
    """int8/int4 codes from every variant equal the spec's formula applied with the stored scale/zero."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) + shift).astype(np.float32)
    x.reshape(-1)[::7] = 0.0
    payload, _ = mcf.quantize(x, method, domain=domain)
    regs, _ = ref.layout(method, rows, cols, domain)
    o, n = regs["scale"]
    scale = float(np.frombuffer(payload[o:o + 4].tobytes(), np.float32)[0])
    zero = 0.0
    if "zero" in regs:
        o, n = regs["zero"]
        zero = float(np.frombuffer(payload[o:o + 4].tobytes(), np.float32)[0])
    o, n = regs["data"]
    want = ref.raw_quantize_codes(x, ref.BITS[method], scale, zero).tobytes()
    assert payload[o:o + n].tobytes() == want
    for impl in IMPLS:
        assert mcf.quantize(x, method, domain=domain, impl=impl)[0].tobytes() == payload.tobytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(["int8", "int4"]), domain=st.sampled_from([0, 1]), rows=st.integers(1, 4),
       cols=st.integers(1, 200), seed=st.integers(0, 2**32 - 1), lo=st.floats(-2, 0.5), width=st.floats(0, 3))
def test_int_quantizer_clips_in_every_variant(method, domain, rows, cols, seed, lo, width):
    """int8/int4 clamp each value to the clips inside the kernel (the input is only read): every
    variant gives the codes of the spec's formula applied to the clipped values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    before = x.tobytes()
    hi = lo + width
    payload, _ = mcf.quantize(x, method, domain=domain, min_clip=lo, max_clip=hi)
    assert x.tobytes() == before
    regs, _ = ref.layout(method, rows, cols, domain)
    scale = float(np.frombuffer(payload[0:4].tobytes(), np.float32)[0])
    zero = float(np.frombuffer(payload[64:68].tobytes(), np.float32)[0]) if "zero" in regs else 0.0
    o, n = regs["data"]
    clipped = np.clip(x, np.float32(lo), np.float32(hi))
    assert payload[o:o + n].tobytes() == ref.raw_quantize_codes(clipped, ref.BITS[method], scale, zero).tobytes()
    for impl in IMPLS:
        assert mcf.quantize(x, method, domain=domain, min_clip=lo, max_clip=hi, impl=impl)[0].tobytes() == \
            payload.tobytes()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int_quantizer_with_a_scale_whose_inverse_overflows(method):
    """A clip range (or data) so small that the float32 scale's inverse overflows: the codes come from
    x / scale (x * inf was NaN for x = 0, and NaN to int is undefined), the same in every variant."""
    x = np.zeros((2, 70), np.float32)
    x[0, ::3] = 5e-40
    x[1, ::5] = -1e-39
    for kw in ({"min_clip": -2e-39, "max_clip": 2e-39}, {}):
        payload, _ = mcf.quantize(x, method, **kw)
        regs, _ = ref.layout(method, 2, 70)
        scale = float(np.frombuffer(payload[0:4].tobytes(), np.float32)[0])
        assert 0 < scale < 2.0**-126
        o, n = regs["data"]
        clipped = np.clip(x, np.float32(kw.get("min_clip", -1)), np.float32(kw.get("max_clip", 1)))
        assert payload[o:o + n].tobytes() == ref.raw_quantize_codes(clipped, ref.BITS[method], scale, 0.0).tobytes()
        codes = K.unpack_codes(payload, mcf._core.dtypes.parse_dtype(method).code, 2, 70)
        assert codes[0, 1] == 0 and codes[1, 0] < 0 and codes[0, 0] > 0
        for impl in IMPLS:
            assert mcf.quantize(x, method, impl=impl, **kw)[0].tobytes() == payload.tobytes()
