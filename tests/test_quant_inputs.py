"""What quantization accepts and never does to its input: explicit clips leave the caller's array (and a
read-only mapping) untouched for every method and every input dtype and byte order; the bytes equal
quantizing an already-clipped copy; ``src_dtype`` must describe the array; every convert/quantize error
names the source file and the tensor."""

import hashlib
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
from _vectors import mantle_file
from mcf.cli import main as cli_main
from mcf.conversion.quant_policy import quantize_file

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays are a test extra")
stnp = pytest.importorskip("safetensors.numpy", reason="the safetensors package is a test extra")

METHODS = ["q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"]
# every float dtype quantize reads, in both byte orders, and bfloat16 as ml_dtypes or raw uint16 bits
DTYPES = ["<f4", ">f4", "<f2", ">f2", "<f8", ">f8", "bf16", "bf16-bits", "bf16-bits-be"]


def as_dtype(x32: np.ndarray, kind: str):
    """(array, src_dtype) holding the float32 values ``x32`` rounded to ``kind``, and the float32
    values the quantizer must see."""
    if kind.startswith("bf16"):
        b = x32.astype(ml_dtypes.bfloat16)
        seen = b.astype(np.float32)
        if kind == "bf16":
            return b, None, seen
        bits = b.view(np.uint16)
        return (bits.astype(">u2") if kind.endswith("-be") else bits), "bf16", seen
    a = x32.astype(kind)
    with np.errstate(over="ignore"):
        return a, None, a.astype(np.float32)


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def file_digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def check_untouched_and_clipped(x, src_dtype, seen, method, lo, hi):
    before = digest(x)
    got, q = mcf.quantize(x, method, min_clip=lo, max_clip=hi, src_dtype=src_dtype)
    assert digest(x) == before, "quantize changed its input"
    want, q2 = mcf.quantize(np.clip(seen, np.float32(lo), np.float32(hi)), method, min_clip=lo, max_clip=hi)
    assert got.tobytes() == want.tobytes()
    assert q == q2 and q["min_clip"] == float(np.float32(lo)) and q["max_clip"] == float(np.float32(hi))
    ro = x.copy()
    ro.flags.writeable = False  # a read-only input (a mapped file) works too
    assert mcf.quantize(ro, method, min_clip=lo, max_clip=hi, src_dtype=src_dtype)[0].tobytes() == got.tobytes()


@pytest.mark.parametrize("kind", DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_clips_never_modify_the_input(method, kind):
    rng = np.random.default_rng(zlib.crc32(repr((method, kind)).encode()))
    x32 = (rng.standard_normal((5, 70)) * 0.1).astype(np.float32)
    x, src_dtype, seen = as_dtype(x32, kind)
    check_untouched_and_clipped(x, src_dtype, seen, method, -0.05, 0.05)
    check_untouched_and_clipped(x, src_dtype, seen, method, -0.02, 0.07)   # asymmetric
    check_untouched_and_clipped(x, src_dtype, seen, method, 0.01, 0.03)    # zero outside the range


def test_clips_on_views_of_a_larger_array():
    """Non-contiguous and offset views: the clip must not reach the parent array either."""
    rng = np.random.default_rng(3)
    parent = rng.standard_normal((40, 96)).astype(np.float32)
    before = digest(parent)
    for view in (parent[3:9], parent[:, 10:74], parent[::2, ::3], parent.T[:64]):
        for method in ("q4", "k3", "int8", "int4"):
            seen = np.ascontiguousarray(view)
            got, _ = mcf.quantize(view, method, min_clip=-0.5, max_clip=0.25)
            want, _ = mcf.quantize(np.clip(seen, -0.5, 0.25), method, min_clip=-0.5, max_clip=0.25)
            assert got.tobytes() == want.tobytes()
    assert digest(parent) == before


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(METHODS), kind=st.sampled_from(DTYPES), rows=st.integers(1, 5),
       cols=st.integers(1, 300), seed=st.integers(0, 2**32 - 1), lo=st.floats(-2, 0.5), width=st.floats(0, 3),
       domain=st.sampled_from([0, 1]))
def test_clip_property(method, kind, rows, cols, seed, lo, width, domain):
    """Any clip range, shape, method, dtype and (int*) domain: the input is untouched and the bytes are
    those of the already-clipped values."""
    if domain and not method.startswith("int"):
        domain = 0
    rng = np.random.default_rng(seed)
    x32 = rng.standard_normal((rows, cols)).astype(np.float32)
    x, src_dtype, seen = as_dtype(x32, kind)
    hi = lo + width
    before = digest(x)
    got, _ = mcf.quantize(x, method, min_clip=lo, max_clip=hi, src_dtype=src_dtype, domain=domain)
    assert digest(x) == before
    want, _ = mcf.quantize(np.clip(seen, np.float32(lo), np.float32(hi)), method, min_clip=lo, max_clip=hi,
                           domain=domain)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("kind", ["<f4", ">f4", "<f2", ">f2", "<f8", ">f8", "bf16"])
def test_byte_order_does_not_change_the_bytes(kind):
    rng = np.random.default_rng(8)
    x32 = rng.standard_normal((3, 100)).astype(np.float32)
    x, src_dtype, seen = as_dtype(x32, kind)
    for method in METHODS:
        assert mcf.quantize(x, method)[0].tobytes() == mcf.quantize(seen, method)[0].tobytes()


def test_src_dtype_must_describe_the_array():
    x = np.ones((2, 32), np.float32)
    with pytest.raises(mcf.DTypeError, match="does not describe"):
        mcf.quantize(x, "q8", src_dtype="bf16")          # float32 values are not bf16 bits
    with pytest.raises(mcf.DTypeError, match="raw bits"):
        mcf.quantize(x.view(np.uint32).astype(np.uint64), "q8", src_dtype="f32")
    with pytest.raises(mcf.DTypeError, match="only float"):
        mcf.quantize(np.ones((2, 32), np.int32), "q8")
    bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert mcf.quantize(bits, "q8", src_dtype="bf16")[0].tobytes() == mcf.quantize(x, "q8")[0].tobytes()


@pytest.mark.parametrize("method", METHODS)
def test_cli_quantize_with_clips_reads_the_mapped_input(tmp_path, method, capsys):
    """The input file is mapped read-only: clipping used to write into it (ValueError: output array is
    read-only)."""
    src = mantle_file("f32")
    before = file_digest(src)
    out = tmp_path / "o.mcf"
    assert cli_main(["quantize", src, str(out), "--method", method, "--min-clip", "-0.05", "--max-clip", "0.05",
                     "-q"]) == 0
    assert file_digest(src) == before
    with mcf.open(src) as c, mcf.open(out) as q:
        for name in q:
            if not q.info(name).dtype.quantized:
                continue
            rec = q.quant_record(name)
            assert (rec.min_clip, rec.max_clip) == (float(np.float32(-0.05)), float(np.float32(0.05)))
            want, _ = mcf.quantize(np.clip(c.to_float32(name), np.float32(-0.05), np.float32(0.05)), method,
                                   min_clip=-0.05, max_clip=0.05)
            assert q.raw(name).tobytes() == want.tobytes(), name
    capsys.readouterr()


# -- errors name the source file and the tensor -------------------------------------------------------
def test_convert_errors_name_file_and_tensor(tmp_path):
    empty = tmp_path / "empty.safetensors"
    stnp.save_file({"": np.ones((2, 32), np.float32), "b": np.ones(3, np.float32)}, str(empty))
    with pytest.raises(mcf.InvalidArgumentError) as ei:
        mcf.convert(empty, tmp_path / "o.mcf")
    assert str(empty) in str(ei.value) and "tensor ''" in str(ei.value)
    big = tmp_path / "big.safetensors"
    stnp.save_file({"a.ok": np.ones((2, 32), np.float32), "w.big": np.full((2, 32), 1e10, np.float64)}, str(big))
    for method in ("q8", "q4", "k6", "k2"):
        with pytest.raises(mcf.InvalidArgumentError, match="overflows float16") as ei:
            mcf.convert(big, tmp_path / "o.mcf", method=method)
        assert str(big) in str(ei.value) and "tensor 'w.big'" in str(ei.value)
    nan = tmp_path / "nan.safetensors"
    x = np.ones((2, 32), np.float32)
    x[1, 3] = np.nan
    stnp.save_file({"layer.0": x}, str(nan))
    with pytest.raises(mcf.InvalidArgumentError, match="non-finite") as ei:
        mcf.convert(nan, tmp_path / "o.mcf", method="k4")
    assert str(nan) in str(ei.value) and "tensor 'layer.0'" in str(ei.value)
    assert not (tmp_path / "o.mcf").exists()


def test_quantize_file_errors_name_file_and_tensor(tmp_path):
    src = tmp_path / "big.mcf"
    with mcf.Writer(src) as w:
        w.add_tensor("fine", np.ones((2, 32), np.float32))
        w.add_tensor("huge", np.full((2, 32), 1e10, np.float64))
    with pytest.raises(mcf.InvalidArgumentError, match="overflows float16") as ei:
        quantize_file(src, tmp_path / "o.mcf", "q8")
    assert str(src) in str(ei.value) and "tensor 'huge'" in str(ei.value)
    assert main_err(["quantize", str(src), str(tmp_path / "o.mcf"), "--method", "k4"], "tensor 'huge'")


def main_err(argv, needle):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli_main(argv)
    return rc != 0 and needle in err.getvalue()


def test_in_tensor_keeps_the_class_and_the_structure():
    e = mcf.errors.in_tensor(mcf.InvalidArgumentError("boom"), "/x/m.safetensors", "w")
    assert type(e) is mcf.InvalidArgumentError and str(e) == "/x/m.safetensors: tensor 'w': boom"
    f = mcf.errors.in_tensor(mcf.FormatError("bad", path="/x/a", offset=8), "/x/b", "w")
    assert isinstance(f, mcf.FormatError) and f.path == "/x/a" and f.field == "tensor 'w'" and f.offset == 8
    io_err = mcf.MissingFileError(2, "gone", "/x/c")
    assert mcf.errors.in_tensor(io_err, "/x/c", "w") is io_err


def test_writer_quantize_errors_name_the_tensor(tmp_path):
    with mcf.Writer(tmp_path / "w.mcf") as w:
        with pytest.raises(mcf.InvalidArgumentError, match="tensor 'layers.3.w': values too large"):
            w.add_tensor("layers.3.w", np.full((2, 32), 1e10, np.float64), method="q8")
        x = np.ones((2, 32), np.float32)
        x[0, 1] = np.inf
        with pytest.raises(mcf.InvalidArgumentError, match="tensor 'layers.4.w': .*non-finite"):
            w.add_tensor("layers.4.w", x, method="k4")
        w.add_tensor("ok", np.ones((2, 32), np.float32), method="k4")
    with mcf.open(tmp_path / "w.mcf") as c:
        assert list(c) == ["ok"]


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("lo,hi", [(0.5, 0.8), (-0.8, -0.5), (0.3, 0.3)])
def test_activation_clips_outside_the_data_range(method, lo, hi):
    """int8/int4 activations (asymmetric) with a clip range that the data lies entirely outside: every
    value clips to a bound, so that bound must decode back (the range was taken as [max(lo, min_clip),
    min(hi, max_clip)], an empty interval, and 0.5 came back as 0.2)."""
    x = (np.random.default_rng(0).standard_normal((3, 40)) * 0.1).astype(np.float32)
    got, _ = mcf.quantize(x, method, domain=1, min_clip=lo, max_clip=hi)
    y = mcf.dequantize(got, method, x.shape, domain=1)
    want = np.clip(x, np.float32(lo), np.float32(hi))
    step = max(abs(lo), abs(hi)) / ((1 << (8 if method == "int8" else 4)) - 1)
    assert np.abs(y - want).max() <= step * 0.51 + 1e-7


# -- silent wrong answers -------------------------------------------------------------------------------
QMAX = {"q8": 127, "q4": 7, "k6": 31, "k4": 7, "k3": 3, "k2": 1}


@pytest.mark.parametrize("method", list(QMAX))
def test_scale_overflow_is_refused_in_every_mode(method):
    """compat=True truncates scales to f16 instead of rounding them; a block with max|x| / qmax >= 65536
    truncated to infinity and was written, so the tensor read back as inf/NaN (the other modes refuse it)."""
    x = np.ones((2, 64), np.float32)
    x[1, 5] = np.float32(70000.0 * QMAX[method])
    for kw in ({}, {"fast": True}, {"compat": True}):
        for impl in ("scalar", None):
            with pytest.raises(mcf.InvalidArgumentError, match="overflows float16"):
                mcf.quantize(x, method, impl=impl, **kw)
    x[1, 5] = np.float32(65500.0 * QMAX[method])  # truncates to 65504, the largest finite f16: kept
    p, _ = mcf.quantize(x, method, compat=True)
    assert np.isfinite(mcf.dequantize(p, method, x.shape)).all()


def test_compat_overflow_refused_by_quantize_file_and_cli(tmp_path):
    src = tmp_path / "big.mcf"
    with mcf.Writer(src) as w:
        w.add_tensor("huge", np.full((2, 32), 70000.0 * 127, np.float32))
    with pytest.raises(mcf.InvalidArgumentError, match="overflows float16") as ei:
        quantize_file(src, tmp_path / "o.mcf", "q8", compat=True)
    assert "tensor 'huge'" in str(ei.value) and not (tmp_path / "o.mcf").exists()
    assert main_err(["quantize", str(src), str(tmp_path / "o.mcf"), "--method", "k4", "--compat", "mantle"],
                    "overflows float16")
    assert not (tmp_path / "o.mcf").exists()


@pytest.mark.parametrize("method, region, bits", [("q8", "scales", b"\x00\x7c"), ("k4", "super_scales", b"\x00\xfc"),
                                                  ("int8", "scale", b"\x00\x00\x80\x7f"),
                                                  ("int4", "zero", b"\x01\x00\xc0\x7f")])
def test_verify_reports_non_finite_scales(tmp_path, method, region, bits, capsys):
    """A file written by another tool with an infinite or NaN scale decodes to inf/NaN without an error;
    verify() is where that is found (it used to pass such a file)."""
    path = tmp_path / "m.mcf"
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    domain = 1 if region == "zero" else 0
    with mcf.Writer(path) as w:
        w.add_tensor("ok", x, method=method)
        w.add_tensor_bytes("bad", method, x.shape, mcf.quantize(x, method, domain=domain)[0],
                           quant={"domain": domain})
    with mcf.open(path) as c:
        assert c.verify() == []
        lay = c.quant_layout("bad")
        at = c.index["bad"].offset + {r.name: r for r in lay.regions}[region].offset
    data = bytearray(path.read_bytes())
    data[at:at + len(bits)] = bits
    path.write_bytes(bytes(data))
    with mcf.open(path) as c:
        assert not np.isfinite(c.dequantize("bad")).all()
        problems = c.verify()
    assert len(problems) == 1 and "tensor 'bad'" in problems[0] and region in problems[0], problems
    assert "infinite or NaN" in problems[0] and str(path) in problems[0]
    assert cli_main(["verify", str(path)]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("method", list(QMAX))
def test_importance_scale_does_not_matter(method):
    """Only the ratios of an importance vector matter.  Large finite values overflowed the mean to inf, the
    weights became all zeros, and the tensor was quantized as if unweighted (a different file)."""
    from mcf.container.quant import importance_weights

    rng = np.random.default_rng(zlib.crc32(method.encode()))
    x = rng.standard_normal((8, 96)).astype(np.float32)
    v = rng.random(96)
    want = mcf.quantize(x, method, importance=v)[0].tobytes()
    assert want != mcf.quantize(x, method)[0].tobytes()
    w = importance_weights(v, 96)
    for big in (v * 1e306, v * 2.0 ** 1000, np.full(96, 1.7e308) * (v > 0.5), v * 1e-300, v * 5e-324 * 2 ** 60):
        got = importance_weights(big, 96)
        if big is not v and np.array_equal(big / big.max(), v / v.max()):  # exactly the same ratios
            assert got.tobytes() == w.tobytes()
        assert np.isfinite(got).all() and abs(float(got.astype(np.float64).mean()) - 1) < 1e-6
    for factor in (1e306, 2.0 ** 1000, 1e-300, 2.0 ** -1000):
        assert mcf.quantize(x, method, importance=v * factor)[0].tobytes() == want, factor
    f32 = v.astype(np.float32)
    assert (mcf.quantize(x, method, importance=f32 * np.float32(3e38))[0].tobytes()
            == mcf.quantize(x, method, importance=f32)[0].tobytes())


@pytest.mark.parametrize("importance, cls", [
    ("abc", mcf.ArgumentTypeError), ({"a": 1.0}, mcf.ArgumentTypeError), ([object()] * 64, mcf.ArgumentTypeError),
    ([None] * 64, mcf.ArgumentTypeError), (np.ones(64, complex), mcf.ArgumentTypeError),
    (np.ones(64, bool), mcf.ArgumentTypeError), ([10 ** 400] * 64, mcf.InvalidArgumentError),
    ([[1.0], [1.0, 2.0]], mcf.InvalidArgumentError)],
    ids=["str", "dict", "objects", "None", "complex", "bool", "huge int", "ragged"])
def test_importance_of_the_wrong_type_is_named(importance, cls):
    """Strings, mappings, objects, complex numbers and bools were turned into bare ValueError, TypeError,
    OverflowError or a ComplexWarning by numpy (or, for bools and None, silently into numbers)."""
    x = np.ones((2, 64), np.float32)
    with pytest.raises(cls, match="importance"):
        mcf.quantize(x, "k4", importance=importance)


@pytest.mark.parametrize("lo, hi, cls, match", [
    ("0.1", 1.0, mcf.ArgumentTypeError, "min_clip"), (-1.0, "1", mcf.ArgumentTypeError, "max_clip"),
    ([0.0], [1.0], mcf.ArgumentTypeError, "min_clip"), (False, True, mcf.ArgumentTypeError, "min_clip"),
    (-10 ** 400, 1.0, mcf.InvalidArgumentError, "min_clip"),
    (-1e39, 1.0, mcf.InvalidArgumentError, "min_clip.*float32"), (-1.0, 3.5e38, mcf.InvalidArgumentError,
                                                                   "max_clip.*float32"),
    (-np.inf, 1.0, mcf.InvalidArgumentError, "min_clip"), (0.0, np.nan, mcf.InvalidArgumentError, "max_clip"),
    (1.0, 0.5, mcf.InvalidArgumentError, "min_clip")],
    ids=["str", "str max", "list", "bool", "huge int", "1e39", "3.5e38", "-inf", "nan", "reversed"])
@pytest.mark.parametrize("method", ["k4", "q8", "int8"])
def test_bad_clips_are_named(method, lo, hi, cls, match):
    """A string clip leaked a bare TypeError; clips beyond the float32 range were accepted and recorded as
    +-inf in QuantInfo (the clips are stored as float32)."""
    x = np.ones((2, 64), np.float32)
    with pytest.raises(cls, match=match):
        mcf.quantize(x, method, min_clip=lo, max_clip=hi)
    if method == "int8":
        with pytest.raises(cls, match=match):
            mcf.quantize(x, method, min_clip=lo, max_clip=hi, domain=1)


def test_clips_at_the_float32_limit_are_kept():
    big = float(np.finfo(np.float32).max)
    x = np.ones((2, 64), np.float32)
    for method in ("k4", "int8"):
        _, q = mcf.quantize(x, method, min_clip=-big, max_clip=np.float32(big))
        assert (q["min_clip"], q["max_clip"]) == (-big, big)


def test_quantize_entry_points_name_arguments_of_the_wrong_type(tmp_path):
    """Siblings of the bare-TypeError leaks: output paths, checkpoint paths and override lists (a single
    string was iterated one character at a time)."""
    from mcf.conversion.checkpoint import convert

    src = tmp_path / "s.mcf"
    with mcf.Writer(src) as w:
        w.add_tensor("a", np.ones((2, 64), np.float32))
    for call, match in [(lambda: mcf.Writer(5), "path"), (lambda: quantize_file(src, None, "k4"), "path"),
                        (lambda: convert(5, tmp_path / "o.mcf"), "src"), (lambda: mcf.pack(None, tmp_path / "o.mcf"),
                                                                          "path"),
                        (lambda: quantize_file(src, tmp_path / "o.mcf", "k4", overrides="a=q8"), "overrides"),
                        (lambda: quantize_file(src, tmp_path / "o.mcf", "k4", overrides=["a=q8", 5]), "override"),
                        (lambda: quantize_file(src, tmp_path / "o.mcf", "k4", min_clip="0", max_clip=1), "min_clip"),
                        ]:
        with pytest.raises(mcf.ArgumentTypeError, match=match):
            call()
    assert not (tmp_path / "o.mcf").exists()
    with mcf.Writer(tmp_path / "w.mcf") as w:
        with pytest.raises(mcf.ArgumentTypeError, match="tensor 'a': importance"):
            w.add_tensor("a", np.ones((2, 64), np.float32), method="k4", importance="abc")
        w.add_tensor("b", np.ones((2, 64), np.float32))
