"""Error-feedback quantization with the second moment of a layer's inputs (mcf.quantize(second_moment=),
mcf quantize --second-moment) and the second-moment file (mcf.conversion.second_moment, mcf imatrix --second-moment).

The reference below is written from the description of the method (GPTQ: codes column by column, each
column's rounding error spread over the later columns through the upper Cholesky factor of the inverse of
the damped second moment), not from mcf's code: it updates every later column after every column (no
batches), inverts H directly, and reads the scales from the payload's bytes by the format's rules.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
from mcf._core._kernels import unpack_codes
from mcf._core.dtypes import parse_dtype
from mcf.conversion.imatrix import read_imatrix

METHODS = ("q8", "q4", "k6", "k4", "k3", "k2")
BITS = {"q8": 8, "q4": 4, "k6": 6, "k4": 4, "k3": 3, "k2": 2}


# -- an independent reference ------------------------------------------------------------------------

def ref_scales(payload, method, shape):
    """Every value's scale as the format defines it: f16 block scales (subnormals read as 0); k*: the
    super-block's f16 scale times (sub-scale & 63) / 32, in float32."""
    rows, cols = shape
    bpr = -(-cols // 32)
    regions = {r.name: payload[r.offset:r.offset + r.size] for r in mcf.quant_layout(method, shape).regions}

    def f16(b):
        h = b.view("<u2").astype(np.uint32)
        v = b.view("<f2").astype(np.float32)
        return np.where((h & 0x7C00) == 0, np.float32(0), v)

    if method.startswith("q"):
        s = f16(regions["scales"]).reshape(rows, bpr)
    else:
        spr = -(-bpr // 8)
        sup = f16(regions["super_scales"]).reshape(rows, spr)[:, np.arange(bpr) // 8]
        s = sup * ((regions["sub_scales"].reshape(rows, bpr) & 63).astype(np.float32) / np.float32(32))
    return np.repeat(s, 32, axis=1)[:, :cols]


def ref_codes(x, h, method):
    """GPTQ's error feedback on the scales of the search weighted by diag(h), without batches."""
    bits = BITS[method]
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    payload, _ = mcf.quantize(x, method, importance=np.diag(h))
    s32 = ref_scales(payload, method, x.shape)
    cols = x.shape[1]
    hd = h + 0.01 * np.mean(np.diag(h)) * np.eye(cols)
    u = np.linalg.cholesky(np.linalg.inv(hd)).T
    w = x.astype(np.float64)
    codes = np.zeros(x.shape, dtype=np.int64)
    for j in range(cols):
        s = s32[:, j]
        with np.errstate(divide="ignore"):
            inv = np.where(s != 0, np.float32(1) / s, np.float32(0)).astype(np.float32)
        # rounded as the search quantizer rounds its codes: rint of a float32 product
        q = np.clip(np.rint(w[:, j].astype(np.float32) * inv), qmin, qmax)
        codes[:, j] = q
        e = (w[:, j] - s.astype(np.float64) * q) / u[j, j]
        w[:, j + 1:] -= np.outer(e, u[j, j + 1:])
    return codes, s32


def correlated(rng, rows, cols, tokens=None):
    """Weights and the second moment of correlated inputs (a few strong directions, as real activations)."""
    tokens = tokens or 4 * cols
    mix = rng.standard_normal((cols, cols)) * (rng.random(cols) ** 4)[:, None]
    x_in = rng.standard_normal((tokens, cols)) @ mix + 0.05 * rng.standard_normal((tokens, cols))
    h = x_in.T @ x_in / tokens
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.02
    return w, h


def mcf_codes(payload, method, shape):
    return unpack_codes(payload, parse_dtype(method).code, *shape)[:, :shape[1]].astype(np.int64)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(3, 40), (4, 64), (2, 200), (5, 33), (1, 1), (6, 300)])
def test_codes_match_the_reference(method, shape):
    """The same codes as the unbatched reference (mcf batches 128 columns: 200 and 300 columns cross a
    batch), and the decoder returns exactly scale * code."""
    rng = np.random.default_rng(zlib.crc32(f"{method} {shape}".encode()))
    w, h = correlated(rng, *shape)
    payload, params = mcf.quantize(w, method, second_moment=h)
    want, s32 = ref_codes(w, h, method)
    got = mcf_codes(payload, method, shape)
    np.testing.assert_array_equal(got, want)
    dec = mcf.dequantize(payload, method, shape)
    np.testing.assert_array_equal(dec, s32 * want.astype(np.float32))
    assert params["max_clip"] == float(np.float32(np.abs(w).max()))
    # the scales are the search's, weighted by the diagonal: only the code bytes differ
    search, _ = mcf.quantize(w, method, importance=np.diag(h))
    data = mcf.quant_layout(method, shape).region("data")
    assert payload[:data.offset].tobytes() == search[:data.offset].tobytes()


def test_row_chunks_do_not_change_the_bytes(monkeypatch):
    """Rows are fed back in chunks that bound the memory (64 MiB of float64 rows): a tensor cut into chunks of
    3 rows gives the bytes of one chunk."""
    from mcf.container import error_feedback

    rng = np.random.default_rng(12)
    w, h = correlated(rng, 10, 140)
    whole, _ = mcf.quantize(w, "k3", second_moment=h)
    monkeypatch.setattr(error_feedback, "_CHUNK_BYTES", 3 * 8 * 140)
    assert mcf.quantize(w, "k3", second_moment=h)[0].tobytes() == whole.tobytes()
    assert mcf.quantize(w, "k3", second_moment=h, threads=3)[0].tobytes() == whole.tobytes()
    w, h = correlated(rng, 700, 64)   # three chunks of at most 256 rows, on 1 or 2 threads
    assert mcf.quantize(w, "q4", second_moment=h, threads=2)[0].tobytes() == mcf.quantize(
        w, "q4", second_moment=h)[0].tobytes()


@pytest.mark.parametrize("method", METHODS)
def test_most_negative_code_and_zero_blocks(method):
    """The whole code range is used (the most negative code appears), and a block whose scale is 0 (all
    zeros) gets code 0, also when the errors of earlier columns are fed into it."""
    rng = np.random.default_rng(5)
    w, h = correlated(rng, 24, 96)
    w[3] = 0
    w[5, 32:64] = 0
    payload, _ = mcf.quantize(w, method, second_moment=h)
    codes = mcf_codes(payload, method, w.shape)
    assert codes.min() == -(1 << (BITS[method] - 1))
    assert (codes[3] == 0).all() and (codes[5, 32:64] == 0).all()
    np.testing.assert_array_equal(mcf.dequantize(payload, method, w.shape)[3], 0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scale", [1.0, 3.5e-3])
def test_identity_is_nearest_rounding(method, scale):
    """With H a multiple of the identity nothing is fed back: the bytes are the search's with uniform weights,
    which are the default's (nearest rounding with the default's scales)."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((7, 150)).astype(np.float32)
    got, _ = mcf.quantize(x, method, second_moment=scale * np.eye(150))
    want, _ = mcf.quantize(x, method, importance=np.ones(150))
    assert got.tobytes() == want.tobytes() == mcf.quantize(x, method)[0].tobytes()


@pytest.mark.parametrize("method", METHODS)
def test_lower_output_error_than_importance_alone(method):
    """The quantity error feedback lowers, trace((W - Q) H (W - Q)^T), the layer's mean squared output error,
    is lower than with the importance vector alone."""
    rng = np.random.default_rng(17)
    w, h = correlated(rng, 64, 256)

    def out_err(payload):
        d = mcf.dequantize(payload, method, w.shape).astype(np.float64) - w
        return float(np.einsum("ij,jk,ik->", d, h, d))

    fb = out_err(mcf.quantize(w, method, second_moment=h)[0])
    imp = out_err(mcf.quantize(w, method, importance=np.diag(h))[0])
    assert fb < 0.9 * imp, (fb, imp)


def test_clips_and_dtypes():
    """Explicit clips clamp the values error feedback starts from, as they clamp the search's; float16 and
    bfloat16 inputs quantize as their float32 values."""
    rng = np.random.default_rng(3)
    w, h = correlated(rng, 8, 64)
    p, q = mcf.quantize(w, "k4", second_moment=h, min_clip=-0.01, max_clip=0.02)
    assert (q["min_clip"], q["max_clip"]) == (float(np.float32(-0.01)), float(np.float32(0.02)))
    clipped = np.clip(w, np.float32(-0.01), np.float32(0.02))
    assert p.tobytes() == mcf.quantize(clipped, "k4", second_moment=h)[0].tobytes()
    w16 = w.astype(np.float16)
    assert (mcf.quantize(w16, "q4", second_moment=h)[0].tobytes()
            == mcf.quantize(w16.astype(np.float32), "q4", second_moment=h)[0].tobytes())


@pytest.mark.parametrize("shape", [(0, 40), (3, 0)])
def test_empty_tensors(shape):
    p, _ = mcf.quantize(np.zeros(shape, np.float32), "k4", second_moment=np.eye(shape[1]))
    assert p.tobytes() == mcf.quantize(np.zeros(shape, np.float32), "k4")[0].tobytes()


# -- refusals ------------------------------------------------------------------------------------------

def _bad(cols):
    sym = np.eye(cols)
    sym[0, 1] = 0.5
    nan = np.eye(cols)
    nan[1, 2] = nan[2, 1] = np.nan
    indefinite = np.eye(cols)
    indefinite[0, 1] = indefinite[1, 0] = 2.0
    negative = np.eye(cols)
    negative[2, 2] = -1e-3
    return [(sym, "not symmetric: \\[0, 1\\]"), (nan, r"second_moment\[1, 2\] = nan"),
            (np.full((cols, cols), np.inf), "must be finite"), (np.zeros((cols, cols)), "not positive definite"),
            (indefinite, "not positive definite, even with 1%"), (negative, r"second_moment\[2, 2\] = -0.001"),
            (np.eye(cols + 1), rf"shape \({cols + 1}, {cols + 1}\); the tensor has shape \(4, {cols}\)"),
            (np.ones(cols), "shape"), (np.eye(cols)[None], "shape")]


@pytest.mark.parametrize("case", range(9))
def test_bad_second_moments_are_refused(case):
    x = np.random.default_rng(1).standard_normal((4, 40)).astype(np.float32)
    h, match = _bad(40)[case]
    with pytest.raises(mcf.InvalidArgumentError, match=match):
        mcf.quantize(x, "k4", second_moment=h)


@pytest.mark.parametrize("method, kw, match", [
    ("int8", {}, "int8/int4"), ("int4", {}, "int8/int4"), ("k4", {"fast": True}, "fast=True"),
    ("q4", {"compat": True}, "compat=True"), ("k4", {"importance": np.ones(8)}, "not both"),
    ("f16", {}, "not a quantization method"),
])
def test_modes_that_refuse_it(method, kw, match):
    with pytest.raises(mcf.InvalidArgumentError, match=match):
        mcf.quantize(np.ones((2, 8), np.float32), method, second_moment=np.eye(8), **kw)


def test_wrong_types():
    with pytest.raises(mcf.ArgumentTypeError):
        mcf.quantize(np.ones((2, 8), np.float32), "k4", second_moment="not a matrix")
    with pytest.raises(mcf.ArgumentTypeError):
        mcf.quantize(np.ones((2, 8), np.float32), "k4", second_moment=[[None] * 8] * 8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(0, 2**32 - 1), st.sampled_from(["scaled", "raw"]),
       st.sampled_from(METHODS))
def test_any_matrix_quantizes_or_is_refused(cols, seed, kind, method):
    """A symmetric matrix of any values (huge, tiny, indefinite, with zero rows) either quantizes, with every
    code in range and the decoder returning scale * code, or is refused with an InvalidArgumentError."""
    rng = np.random.default_rng(seed)
    if kind == "scaled":   # a second moment, columns of very different sizes (the product may overflow)
        a = rng.standard_normal((cols, cols)) * 10.0 ** rng.integers(-150, 150, cols)[:, None]
        with np.errstate(over="ignore", invalid="ignore"):
            h = a @ a.T
    else:
        a = rng.standard_normal((cols, cols)) * 10.0 ** rng.integers(-30, 30)
        h = a + a.T
        h[rng.random(cols) < 0.3] = 0
        h = (h + h.T) / 2
    x = rng.standard_normal((3, cols)).astype(np.float32)
    try:
        payload, _ = mcf.quantize(x, method, second_moment=h)
    except mcf.InvalidArgumentError:
        return
    codes = mcf_codes(payload, method, x.shape)
    s32 = ref_scales(payload, method, x.shape)
    np.testing.assert_array_equal(mcf.dequantize(payload, method, x.shape), s32 * codes.astype(np.float32))


# -- the file ------------------------------------------------------------------------------------------

def collected(rng, names_cols, tokens=50):
    from mcf.conversion.second_moment import SecondMomentCollector

    col = SecondMomentCollector()
    inputs = {}
    for n, c in names_cols.items():
        x = rng.standard_normal((tokens, c)).astype(np.float32)
        col.add(n, x[:20])
        col.add(n, x[20:])
        inputs[n] = x.astype(np.float64)
    return col, inputs


def test_file_round_trip_and_imatrix_view(tmp_path):
    """The file holds E[x x^T] (float64 accumulation, stored as float32 or float64), the token counts and the
    datasets; its diagonals read as an importance matrix."""
    from mcf.conversion.second_moment import SecondMoments, read_second_moment

    col, inputs = collected(np.random.default_rng(2), {"a.weight": 12, "b.weight": 40})
    for dtype, rtol in ((np.float32, 1e-6), (np.float64, 1e-12)):
        path = tmp_path / f"h{np.dtype(dtype).itemsize}.safetensors"
        col.write(path, datasets=["calib.txt"], chunk_count=3, chunk_size=64, dtype=dtype)
        got = read_second_moment(path)
        assert sorted(got) == ["a.weight", "b.weight"]
        for n, x in inputs.items():
            np.testing.assert_allclose(got[n], x.T @ x / 50, rtol=rtol, atol=1e-12)
            np.testing.assert_array_equal(got[n], got[n].T)
        with SecondMoments(path) as sm:
            assert sm.counts == {"a.weight": 50, "b.weight": 50}
            assert (sm.datasets, sm.chunk_count, sm.chunk_size) == (["calib.txt"], 3, 64)
        imat = read_imatrix(path)
        for n in inputs:
            assert imat[n].dtype == np.float32
            np.testing.assert_array_equal(imat[n], np.diagonal(got[n]).astype(np.float32))
    stnp = pytest.importorskip("safetensors.numpy")   # any safetensors reader opens it
    other = stnp.load_file(str(tmp_path / "h4.safetensors"))
    assert other["b.weight"].shape == (40, 40) and other["b.weight"].dtype == np.float32


def test_collector_reuses_equal_inputs():
    """q, k and v see the same inputs: the product is computed once, and the sums are those of each call."""
    from mcf.conversion.second_moment import SecondMomentCollector

    rng = np.random.default_rng(4)
    col = SecondMomentCollector()
    x, y = rng.standard_normal((9, 5)), rng.standard_normal((9, 5))
    for n in ("q", "k", "v"):
        col.add(n, x)
    col.add("q", y)
    np.testing.assert_allclose(col.sums["k"], x.T @ x)
    np.testing.assert_allclose(col.sums["q"], x.T @ x + y.T @ y)
    assert col.counts == {"q": 18, "k": 9, "v": 9}
    with pytest.raises(mcf.InvalidArgumentError, match="columns"):
        col.add("q", np.ones((2, 6)))
    with pytest.raises(mcf.InvalidArgumentError, match="tokens, columns"):
        col.add("q", np.ones(6))


def _st_file(path, tensors, meta):
    """A safetensors file written by hand: tensors name -> (dtype name, shape, bytes)."""
    header, pos, data = {"__metadata__": meta}, 0, b""
    for n, (dt, shape, raw) in tensors.items():
        header[n] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
        data += raw
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


GOOD_META = {"format": "mcf.conversion.second_moment", "version": "1", "counts": '{"w": 5}', "datasets": "[]",
             "chunk_count": "1", "chunk_size": "5"}


@pytest.mark.parametrize("tensors, meta, cls, match", [
    ({"w": ("F32", [2, 2], np.eye(2, dtype="<f4").tobytes())}, {**GOOD_META, "format": "pt"}, "FormatError",
     "not a second-moment file"),
    ({"w": ("F32", [2, 2], np.eye(2, dtype="<f4").tobytes())}, {**GOOD_META, "version": "2"},
     "UnsupportedVersionError", "version"),
    ({"w": ("F32", [2, 3], np.ones(6, "<f4").tobytes())}, GOOD_META, "FormatError", "square"),
    ({"w": ("F16", [2, 2], np.eye(2, dtype="<f2").tobytes())}, GOOD_META, "FormatError", "F32 or F64"),
    ({"w": ("F32", [2, 2], np.eye(2, dtype="<f4").tobytes())}, {**GOOD_META, "counts": '{"w": 0}'}, "FormatError",
     "counts"),
    ({"w": ("F32", [2, 2], np.eye(2, dtype="<f4").tobytes())}, {**GOOD_META, "counts": "[1]"}, "FormatError",
     "JSON dict"),
    ({"w": ("F32", [2, 2], np.eye(2, dtype="<f4").tobytes())}, {**GOOD_META, "counts": '{"w": 5, "v": 1}'},
     "FormatError", "does not hold"),
    ({"w": ("F32", [2, 2], np.eye(2, dtype="<f4").tobytes())}, {**GOOD_META, "chunk_size": "-1"}, "FormatError",
     "chunk_size"),
    ({}, {**GOOD_META, "counts": "{}"}, "FormatError", "no second moments"),
])
def test_malformed_files_are_refused(tmp_path, tensors, meta, cls, match):
    from mcf.conversion.second_moment import read_second_moment

    path = _st_file(tmp_path / "h.safetensors", tensors, meta)
    with pytest.raises(getattr(mcf, cls), match=match) as info:
        read_second_moment(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("values, match", [([1.0, np.nan, 0.0, 1.0], r"w\[0, 1\].*finite"),
                                           ([1.0, 0.0, 0.0, -2.0], r"w\[1, 1\]")])
def test_bad_values_in_a_file(tmp_path, values, match):
    from mcf.conversion.second_moment import SecondMoments, read_second_moment

    path = _st_file(tmp_path / "h.safetensors", {"w": ("F32", [2, 2], np.array(values, "<f4").tobytes())},
                    GOOD_META)
    with pytest.raises(mcf.FormatError, match=match):
        read_second_moment(path)
    with SecondMoments(path) as sm, pytest.raises(mcf.FormatError):
        sm.diagonal("w") if values[3] < 0 else sm["w"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_damaged_files_are_refused_or_read(tmp_path, data):
    """Bytes of a good file overwritten or cut anywhere: the file reads (to finite square matrices with their
    counts) or is refused with an mcf error, never another exception."""
    from mcf.conversion.second_moment import SecondMoments, write_second_moment

    good = tmp_path / "good.safetensors"
    if not good.exists():
        write_second_moment(good, {"a.weight": np.eye(3) * 2, "b.weight": np.ones((5, 5)) + np.eye(5)},
                            {"a.weight": 4, "b.weight": 7}, datasets=["t.txt"], chunk_count=1, chunk_size=8)
    raw = bytearray(good.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    raw = raw[:data.draw(st.integers(0, len(raw)))] if data.draw(st.booleans()) else raw
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    try:
        with SecondMoments(bad) as sm:
            for n in sm:
                m = sm[n]
                assert m.ndim == 2 and m.shape[0] == m.shape[1] and np.isfinite(m).all() and sm.counts[n] >= 1
    except mcf.MCFError:
        pass


def test_write_refuses_what_it_cannot_write(tmp_path):
    from mcf.conversion.second_moment import write_second_moment

    p = tmp_path / "h.safetensors"
    with pytest.raises(mcf.InvalidArgumentError, match="square"):
        write_second_moment(p, {"w": np.ones((2, 3))}, {"w": 1})
    with pytest.raises(mcf.InvalidArgumentError, match="no token count"):
        write_second_moment(p, {"w": np.eye(2)}, {})
    with pytest.raises(mcf.InvalidArgumentError, match=">= 1"):
        write_second_moment(p, {"w": np.eye(2)}, {"w": 0})
    with pytest.raises(mcf.InvalidArgumentError, match="not finite"):
        write_second_moment(p, {"w": np.eye(2) * 1e300}, {"w": 1})
    with pytest.raises(mcf.InvalidArgumentError, match="float32 or float64"):
        write_second_moment(p, {"w": np.eye(2)}, {"w": 1}, dtype=np.float16)
    with pytest.raises(mcf.ArgumentTypeError, match="datasets"):
        write_second_moment(p, {"w": np.eye(2)}, {"w": 1}, datasets="calib.txt")
    assert not p.exists()


def test_write_checks_names_and_datasets_as_the_imatrix_writer_does(tmp_path):
    """A non-str name among str names is refused by name (sorting them raised a bare TypeError), datasets
    that are not a sequence too (iterating an int did), and datasets given as a generator are written
    (they were consumed by the check and the file said [])."""
    from mcf.conversion.second_moment import SecondMoments, write_second_moment

    p = tmp_path / "h.safetensors"
    with pytest.raises(mcf.ArgumentTypeError, match="tensor name must be a str"):
        write_second_moment(p, {"w": np.eye(2), 5: np.eye(2)}, {"w": 1, 5: 1})
    with pytest.raises(mcf.ArgumentTypeError, match="datasets must be a sequence"):
        write_second_moment(p, {"w": np.eye(2)}, {"w": 1}, datasets=5)
    assert not p.exists()
    write_second_moment(p, {"w": np.eye(2)}, {"w": 1}, datasets=(d for d in ["a.txt", "b.txt"]))
    with SecondMoments(p) as sm:
        assert sm.datasets == ["a.txt", "b.txt"]


# -- files of tensors ----------------------------------------------------------------------------------

def model_and_moments(tmp_path, rng):
    """A small file with Hugging Face names and the second moments of two of its layers under GGUF names."""
    arrays = {"model.layers.0.self_attn.q_proj.weight": rng.standard_normal((48, 64)).astype(np.float32),
              "model.layers.0.mlp.down_proj.weight": rng.standard_normal((64, 96)).astype(np.float32),
              "model.layers.0.mlp.up_proj.weight": rng.standard_normal((96, 64)).astype(np.float32),
              "model.norm.weight": rng.standard_normal(64).astype(np.float32)}
    src = tmp_path / "m.mcf"
    with mcf.Writer(src) as w:
        for n, a in arrays.items():
            w.add_tensor(n, a)
    hs = {"blk.0.attn_q.weight": correlated(rng, 1, 64)[1], "blk.0.ffn_down.weight": correlated(rng, 1, 96)[1]}
    from mcf.conversion.second_moment import write_second_moment

    path = tmp_path / "h.safetensors"
    write_second_moment(path, hs, {n: 1 for n in hs}, dtype=np.float64)
    return src, arrays, path, hs


def test_quantize_file_with_a_second_moment_file(tmp_path, capsys):
    from mcf.cli import main
    from mcf.conversion.quant_policy import quantize_file

    src, arrays, path, hs = model_and_moments(tmp_path, np.random.default_rng(8))
    with pytest.warns(UserWarning, match=r"second moment file matched 2 of the 3 .*up_proj"):
        quantize_file(src, tmp_path / "o.mcf", "k4", second_moment=path)
    with mcf.open(tmp_path / "o.mcf") as c:
        assert c.raw("model.layers.0.self_attn.q_proj.weight").tobytes() == mcf.quantize(
            arrays["model.layers.0.self_attn.q_proj.weight"], "k4",
            second_moment=hs["blk.0.attn_q.weight"])[0].tobytes()
        assert c.raw("model.layers.0.mlp.up_proj.weight").tobytes() == mcf.quantize(
            arrays["model.layers.0.mlp.up_proj.weight"], "k4")[0].tobytes()
    assert main(["quantize", str(src), str(tmp_path / "c.mcf"), "--method", "k4", "--second-moment", str(path),
                 "-q"]) == 0
    assert "mcf quantize: warning: the second moment file matched 2 of the 3" in capsys.readouterr().err
    assert (tmp_path / "c.mcf").read_bytes() == (tmp_path / "o.mcf").read_bytes()
    # a mapping works as the file does
    quantize_file(src, tmp_path / "m.mcf", "k4", second_moment=hs, overrides=["*up_proj*=none"])
    with mcf.open(tmp_path / "m.mcf") as a, mcf.open(tmp_path / "o.mcf") as b:
        assert a.raw("model.layers.0.mlp.down_proj.weight").tobytes() == b.raw(
            "model.layers.0.mlp.down_proj.weight").tobytes()


def test_quantize_file_refusals(tmp_path):
    from mcf.conversion.quant_policy import quantize_file
    from mcf.conversion.second_moment import write_second_moment

    src, arrays, path, hs = model_and_moments(tmp_path, np.random.default_rng(6))
    other = tmp_path / "other.safetensors"
    write_second_moment(other, {"transformer.h.0.attn.c_attn.weight": np.eye(64)},
                        {"transformer.h.0.attn.c_attn.weight": 3})
    with pytest.raises(mcf.InvalidArgumentError, match=r"second moment file matched 0 of the 3 tensors .*c_attn"):
        quantize_file(src, tmp_path / "o.mcf", "k4", second_moment=other)
    quantize_file(src, tmp_path / "o.mcf", "int8", second_moment=other)  # int8 has no codes to choose: no match
    wrong = tmp_path / "wrong.safetensors"
    write_second_moment(wrong, {"blk.0.attn_q.weight": np.eye(48)}, {"blk.0.attn_q.weight": 3})
    with pytest.warns(UserWarning, match="matched 1 of the 3"), pytest.raises(
            mcf.InvalidArgumentError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight'.*\(48, 48\).*\(48, 64\)"):
        quantize_file(src, tmp_path / "w.mcf", "q4", second_moment=wrong)
    assert not (tmp_path / "w.mcf").exists()
    with pytest.raises(mcf.InvalidArgumentError, match="not both"):
        quantize_file(src, tmp_path / "w.mcf", "q4", second_moment=path, imatrix=path)
    for kw in ({"fast": True}, {"compat": True}):
        with pytest.raises(mcf.InvalidArgumentError, match="does not apply"):
            quantize_file(src, tmp_path / "w.mcf", "q4", second_moment=path, **kw)
    with pytest.raises(mcf.MissingFileError, match="nope.safetensors"):
        quantize_file(src, tmp_path / "w.mcf", "q4", second_moment=tmp_path / "nope.safetensors")
    assert not (tmp_path / "w.mcf").exists()


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mcf.cli", *args], capture_output=True, text=True, check=False)


def test_cli_wrong_arguments(tmp_path):
    src, arrays, path, hs = model_and_moments(tmp_path, np.random.default_rng(7))
    out = str(tmp_path / "o.mcf")
    for extra, code, match in ((["--fast"], 2, "--fast"), (["--compat", "mantle"], 2, "--compat mantle"),
                               (["--imatrix", str(path)], 2, "not both")):
        r = run_cli("quantize", str(src), out, "--second-moment", str(path), *extra)
        assert r.returncode == code and match in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_cli("quantize", str(src), out, "--second-moment", str(tmp_path / "missing.safetensors"))
    assert r.returncode == 1 and "missing.safetensors" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("quantize", str(src), out, "--second-moment", str(src))   # an MCF file, not a second moment file
    assert r.returncode == 1 and "Traceback" not in r.stderr
    r = run_cli("imatrix", str(src), "--text", str(path))
    assert r.returncode == 2 and "--second-moment" in r.stderr
    assert not (tmp_path / "o.mcf").exists()


def test_cli_collect_and_quantize_minilm(minilm_dir, tmp_path):
    """mcf imatrix --second-moment on the demo checkpoint: one matrix per linear layer whose diagonal is the
    importance the imatrix holds; mcf quantize --second-moment then changes the codes of exactly those."""
    from mcf.conversion.pack import pack
    from mcf.conversion.second_moment import SecondMoments

    packed = tmp_path / "minilm.mcf"
    pack(minilm_dir, packed)
    text = tmp_path / "calib.txt"
    text.write_text("Second moments of the inputs of every linear layer, measured on a little text. " * 4,
                    encoding="utf-8")
    im, hm = tmp_path / "i.gguf", tmp_path / "h.safetensors"
    r = run_cli("imatrix", str(packed), "--text", str(text), "-o", str(im), "--second-moment", str(hm), "-q")
    assert r.returncode == 0, r.stderr
    assert "second moments of 36 weight tensors" in r.stdout
    imat = read_imatrix(im)
    with SecondMoments(hm) as sm, mcf.open(packed) as c:
        assert sorted(sm) == sorted(imat)
        for n in sm:
            cols = c.info(n).shape[1]
            assert sm.counts[n] > 0 and sm[n].shape == (cols, cols)
            np.testing.assert_allclose(sm.diagonal(n), imat[n], rtol=1e-5)
    out_h, out_u = tmp_path / "h.mcf", tmp_path / "u.mcf"
    assert run_cli("quantize", str(packed), str(out_h), "--method", "k3", "--second-moment", str(hm),
                   "-q").returncode == 0
    assert run_cli("quantize", str(packed), str(out_u), "--method", "k3", "--imatrix", str(hm), "-q").returncode == 0
    assert run_cli("verify", str(out_h)).returncode == 0
    with mcf.open(out_h) as a, mcf.open(out_u) as b:
        for n in a:
            same = a.raw(n).tobytes() == b.raw(n).tobytes()
            assert same == (n not in imat or not a.info(n).quantized), n


# -- the compiled helpers: every size checked before the loops run --------------------------------------

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(3, 40), (2, 256), (1, 1)])
def test_pack_codes_round_trip(method, shape):
    """Codes packed into a payload unpack to themselves (the padding of each row's last block included), the
    scales are left alone, and the decoder returns scale * code."""
    from mcf._core._kernels import pack_codes

    rng = np.random.default_rng(21)
    rows, cols = shape
    bits = BITS[method]
    x = rng.standard_normal(shape).astype(np.float32)
    payload, _ = mcf.quantize(x, method)
    before = payload.copy()
    width = -(-cols // 32) * 32
    codes = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (rows, width)).astype(np.int8)
    pack_codes(codes[1:], method, payload, 1, rows=rows, cols=cols)    # rows 1.. only
    got = unpack_codes(payload, parse_dtype(method).code, rows, cols)
    np.testing.assert_array_equal(got[1:], codes[1:])
    np.testing.assert_array_equal(got[:1], unpack_codes(before, parse_dtype(method).code, rows, cols)[:1])
    data = mcf.quant_layout(method, shape).region("data")
    assert payload[:data.offset].tobytes() == before[:data.offset].tobytes()
    s32 = ref_scales(payload, method, shape)
    np.testing.assert_array_equal(mcf.dequantize(payload, method, shape), s32 * got[:, :cols].astype(np.float32))


def test_pack_codes_refuses_what_does_not_fit():
    from mcf._core._kernels import pack_codes

    payload, _ = mcf.quantize(np.ones((2, 40), np.float32), "k3")
    ok = np.zeros((2, 64), np.int8)
    for codes, kw, match in (
            (ok, {"rows": 3}, "needs"), (ok, {"cols": 100}, "codes has 64 columns"),
            (np.full((2, 64), 4, np.int8), {}, r"-4\.\.3"), (np.full((2, 64), -5, np.int8), {}, r"-4\.\.3"),
            (ok.astype(np.int16), {}, "int8"), (ok[:, ::2], {}, "contiguous"), (ok[:1], {"row0": 2}, "outside"),
            (ok, {"code": "int8"}, "not int8"), (ok, {"payload": payload[:-1]}, "needs"),
            (ok, {"payload": payload.astype(np.int8)}, "uint8"), (ok, {"row0": -1}, ">= 0")):
        args = {"rows": 2, "cols": 40, "row0": 0, "code": "k3", "payload": payload.copy(), **kw}
        with pytest.raises(mcf.InvalidArgumentError, match=match):
            pack_codes(codes, args["code"], args["payload"], args["row0"], rows=args["rows"], cols=args["cols"])
    ro = payload.copy()
    ro.flags.writeable = False
    with pytest.raises(mcf.InvalidArgumentError, match="writeable"):
        pack_codes(ok, "k3", ro, 0, rows=2, cols=40)


def test_feedback_batch_refuses_what_does_not_fit():
    from mcf._core._kernels import feedback_batch

    cols, n = 6, 5
    good = {"wt": np.zeros((cols, n)), "st": np.ones((cols, n), np.float32), "inv": np.ones((cols, n), np.float32),
            "u": np.eye(cols), "codes": np.zeros((cols, n), np.int8), "err": np.zeros((cols, n)), "c0": 0, "c1": cols,
            "bits": 4}
    feedback_batch(**good)
    for change, match in (({"wt": np.zeros((cols, n), np.float32)}, "wt must be"),
                          ({"u": np.eye(cols + 1)}, "u must be"),
                          ({"st": np.ones((cols, n + 1), np.float32)}, "shape of wt"),
                          ({"c1": cols + 1}, "out of range"),
                          ({"c0": 4, "c1": 3}, "out of range"), ({"err": np.zeros((2, n))}, "out of range"),
                          ({"bits": 9}, "2..8"), ({"codes": np.zeros((cols, n), np.int8).T.copy().T}, "contiguous"),
                          ({"c0": -1}, ">= 0")):
        with pytest.raises(mcf.InvalidArgumentError, match=match):
            feedback_batch(**{**good, **change})
