"""mcf's own casts and sums are quiet on NaN, infinities and values beyond the target's range: no RuntimeWarning
escapes (the caller may run under ``-W error``), and the values stay what a cast makes of them: NaN stays NaN where
the format holds it, beyond the range is infinity, and where mcf refuses non-finite values (quantizers, int8 KV,
the importance and second-moment files) the refusal is an MCFError that says so (docs/reliability.md, "NaN,
infinity and overflow in casts").  Each case here emitted a RuntimeWarning before."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import mcf
from mcf.bucket import kvfile
from mcf.errors import InvalidArgumentError

F64 = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e300, -1e300, 70000.0, 3.5e38, 1.5, -0.0, 1e-300, 5e-46] * 2,
               np.float64)


def _cast(a, dt):
    with np.errstate(over="ignore"):
        return a.astype(dt)


@pytest.fixture(autouse=True)
def _warnings_are_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _same(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok], want[ok]) and np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))


def test_writer_f64_to_f32(tmp_path):
    with mcf.Writer(tmp_path / "w.mcf") as w:
        w.add_tensor("x", F64, dtype="f32")
    with mcf.open(tmp_path / "w.mcf") as c:
        _same(c.tensor("x"), _cast(F64, np.float32))


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
def test_load_convert_and_export_casts(tmp_path, dtype):
    """The loaders' dtype=, convert's and export's dtype=: every float pair through the same quiet casts
    (guards what already was quiet, next to what was not)."""
    src = tmp_path / "src.mcf"
    with mcf.Writer(src) as w:
        w.add_tensor("d", F64.reshape(2, 12))
        w.add_tensor("s", F64.reshape(2, 12), dtype="f32")
        w.add_tensor("h", F64.reshape(2, 12), dtype="f16")
    want = {"f16": np.float16, "f32": np.float32, "f64": np.float64}.get(dtype)
    for name, got in mcf.load_file(src, dtype=dtype).items():
        if want is not None and name == "d":
            _same(got, _cast(F64.reshape(2, 12), want))
        assert np.array_equal(np.isnan(np.asarray(got, np.float64)), np.isnan(F64.reshape(2, 12))), name
    if dtype != "f64":
        mcf.export(src, tmp_path / "e.safetensors", dtype=dtype)
        mcf.convert(tmp_path / "e.safetensors", tmp_path / "c.mcf", dtype=dtype)
        with mcf.open(tmp_path / "c.mcf") as c:
            for name in ("d", "s", "h"):
                assert np.array_equal(np.isnan(c.to_float32(name)), np.isnan(F64.reshape(2, 12))), name


@pytest.mark.parametrize("gist_dtype", ["fp32", "fp16", "bf16"])
def test_megacontext_gists_from_float64(tmp_path, gist_dtype):
    """float64 gists beyond float32's range: a fp32 level stores infinity (before: "overflow encountered in
    cast"), as the fp16 and bf16 levels do; NaN stays NaN."""
    from mcf import megacontext

    rows = F64.reshape(1, 24)
    t = megacontext.create(tmp_path / "t", embedding_dim=24, gist_dtype=gist_dtype, block_size=32)
    try:
        t.append_tokens(np.arange(32, dtype=np.int64))
        t.append_gists(1, rows)
        got = t.gists(1)
    finally:
        t.close()
    want = {"fp32": np.float32, "fp16": np.float16}.get(gist_dtype)
    if want is not None:
        _same(got, _cast(rows, want))
    else:
        assert np.array_equal(np.isnan(np.asarray(got, np.float64)), np.isnan(rows))


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("source", ["f64", "f32", "int64"])
def test_kv_float_storage_is_a_quiet_cast(tmp_path, dtype, source):
    """KV data stored as float16/float32: beyond the range is infinity, NaN stays NaN (before: "overflow
    encountered in cast" for float64 and float32 data above 65504 and for int64 data past float16)."""
    a = {"f64": F64, "f32": _cast(F64, np.float32), "int64": np.array([2**40, -2**40, 7] * 8, np.int64)}[source]
    a = a.reshape(1, 1, 24)
    kvfile.write_kv(tmp_path / "kv.mcb", [(a, a)], dtype=dtype)
    k, v = kvfile.read_kv(tmp_path / "kv.mcb")[0]
    if dtype != "bfloat16":
        _same(k, _cast(a, np.dtype(dtype)))
    else:
        assert np.array_equal(np.isnan(np.asarray(k, np.float64)), np.isnan(np.asarray(a, np.float64)))


def test_kv_int8_refuses_what_float32_cannot_hold(tmp_path):
    """int8 storage needs finite float32 values: 1e300 (float64) is refused as clearly as NaN, instead of an
    overflow warning and then an error that spoke of NaN or infinity."""
    for bad in (np.full((1, 1, 8), 1e300), np.full((1, 1, 8), np.nan)):
        with pytest.raises(InvalidArgumentError, match="int8 KV storage needs finite values within float32's range"):
            kvfile.write_kv(tmp_path / "kv8.mcb", [(bad, bad)], dtype="int8")


def test_int8_kv_with_an_infinite_scale_decodes_quietly():
    q = kvfile.Int8KV(np.array([[[0, 1, -1]]], np.int8), np.array([[np.inf]], np.float32))
    got = q.dequantize()
    assert np.isnan(got[0, 0, 0]) and got[0, 0, 1] == np.inf and got[0, 0, 2] == -np.inf


@pytest.mark.parametrize("values", [np.full((4, 8), 1e200), np.where(np.eye(4, 8) > 0, np.nan, 1.0)])
def test_second_moments_refuse_non_finite_sums_without_a_warning(tmp_path, values):
    from mcf.conversion.second_moment import SecondMomentCollector

    c = SecondMomentCollector()
    c.add("w", values)
    c.add("w", values * 2)
    with pytest.raises(InvalidArgumentError, match=r"sums\['w'\] / counts\['w'\] is not finite"):
        c.write(tmp_path / "sm.safetensors")


def test_importance_means_beyond_float32_are_infinity():
    from mcf.conversion.imatrix import ImportanceCollector

    c = ImportanceCollector()
    c.add("w", np.full((2, 4), 1e100))   # squares of 1e200: finite in float64, beyond float32
    assert np.isinf(c.means()["w"]).all()
