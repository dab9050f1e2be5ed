"""mcf.load_state_dict (numpy) against safetensors.numpy.load_file of the same weights (packed with mcf.pack
from a checkpoint directory the safetensors package wrote), Container.dequantize for quantized tensors,
ml_dtypes / numpy casts for dtype conversion, and concatenation for tensor-parallel shares."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mcf
from mcf import DTypeError, InvalidArgumentError, TensorNotFoundError

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

ml_dtypes = pytest.importorskip("ml_dtypes")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

BF16 = np.dtype(ml_dtypes.bfloat16)


def _rng(tag):
    return np.random.default_rng(zlib.crc32(tag.encode()))


def _weights():
    rng = _rng("state-dict-weights")
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return {
        "emb.weight": f(96, 64),
        "attn.q.weight": f(64, 64),
        "attn.q.bias": f(64),
        "mlp.up.weight": f(128, 64).astype(np.float16),
        "mlp.down.weight": f(64, 128).astype(BF16),
        "norm.weight": f(64).astype(BF16),
        "conv.weight": f(8, 4, 3),
        "pos.ids": np.arange(96, dtype=np.int64).reshape(1, 96),
        "mask.i8": rng.integers(-128, 127, size=(4, 6), dtype=np.int8),
        "table.u8": rng.integers(0, 255, size=(5, 7), dtype=np.uint8),
        "counts.i32": rng.integers(-2**31, 2**31 - 1, size=(6,), dtype=np.int32),
        "bits.u16": rng.integers(0, 2**16, size=(3, 4), dtype=np.uint16),
        "dbl": rng.standard_normal((3, 2)),
        "scalar": np.array(1.5, dtype=np.float32),
        "empty": np.zeros((0, 8), np.float32),
    }


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    weights = _weights()
    safetensors_numpy.save_file(weights, str(d / "model.safetensors"))
    out = str(d / "model.mcf")
    mcf.pack(str(d), out)
    return d, out


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    rng = _rng("state-dict-quantized")
    p = str(tmp_path_factory.mktemp("q") / "q.mcf")
    with mcf.Writer(p) as w:
        for m in ("k4", "q8", "k6", "int8"):
            w.add_tensor(f"{m}.weight", rng.standard_normal((64, 512)).astype(np.float32), method=m)
        w.add_tensor("plain", rng.standard_normal((64, 32)).astype(np.float32))
        w.add_tensor("bias", rng.standard_normal((64,)).astype(np.float32))
    return p


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype == BF16:
        a, b = a.view(np.uint16), b.view(np.uint16)
    assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def test_equals_safetensors_numpy(packed):
    d, out = packed
    ref = safetensors_numpy.load_file(str(d / "model.safetensors"))
    got = mcf.load_state_dict(out)
    assert sorted(got) == sorted(ref)
    for name in ref:
        _same(got[name], ref[name])
    got = mcf.load_state_dict(out, copy=True)
    for name in ref:
        _same(got[name], ref[name])
        assert got[name].flags.writeable


def test_zero_copy_views_of_the_mapping(packed):
    _, out = packed
    with mcf.open(out) as c:
        whole = c.source.view(0, c.source.size)
        lo, hi = whole.ctypes.data, whole.ctypes.data + whole.nbytes
        sd = mcf.load_state_dict(c)
        for name, a in sd.items():
            if a.nbytes:
                assert lo <= a.ctypes.data and a.ctypes.data + a.nbytes <= hi, name
                assert np.shares_memory(a.reshape(-1).view(np.uint8), whole)
                assert not a.flags.writeable
        copied = mcf.load_state_dict(c, copy=True)
        for name, a in copied.items():
            if a.nbytes:
                assert not np.shares_memory(a.reshape(-1).view(np.uint8), whole), name
    # views outlive the container (they keep the mapping alive)
    assert float(sd["emb.weight"].sum()) == float(safetensors_numpy.load_file(
        out.replace("model.mcf", "model.safetensors"))["emb.weight"].sum())


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", np.float64, BF16])
def test_casts_float_tensors_only(packed, dtype):
    d, out = packed
    ref = safetensors_numpy.load_file(str(d / "model.safetensors"))
    got = mcf.load_state_dict(out, dtype=dtype)
    want_dt = BF16 if str(dtype) in ("bfloat16",) or dtype is BF16 else np.dtype(dtype)
    for name, r in ref.items():
        g = got[name]
        if r.dtype.kind in "iu":
            _same(g, r)       # integers keep their dtype
            continue
        assert g.dtype == want_dt, name
        # the reference conversion: through float32 (all sources are exactly representable there),
        # then numpy's / ml_dtypes' round-to-nearest-even cast
        r32 = r.astype(np.float32) if r.dtype != np.float64 else r
        want = r32.astype(want_dt) if r.dtype != np.float64 or want_dt == np.float64 else \
            r.astype(np.float32).astype(want_dt)
        _same(g, want)


def test_quantized_equal_container_dequantize(quantized):
    with mcf.open(quantized) as c:
        for dtype in (None, "float16", "bfloat16"):
            sd = mcf.load_state_dict(c, dtype=dtype)
            for name in c.keys():
                if c.info(name).dtype.quantized:
                    want = c.dequantize(name, dtype=np.float32 if dtype is None else
                                        (np.float16 if dtype == "float16" else BF16))
                    _same(sd[name], want)
                else:
                    assert sd[name].dtype == (np.float32 if dtype in (None,) else
                                              (np.float16 if dtype == "float16" else BF16))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("tp_dim", [0, 1])
def test_tp_shares_concatenate_to_the_whole(packed, quantized, tp_size, tp_dim):
    for path in (packed[1], quantized):
        with mcf.open(path) as c:
            names = [n for n in c.keys() if n not in ("scalar", "empty")
                     and (len(c.info(n).shape) < 2 or c.info(n).shape[tp_dim] % tp_size == 0)]
        full = mcf.load_state_dict(path, names=names, dtype="float32")
        shards = [mcf.load_state_dict(path, names=names, dtype="float32", tp_rank=r, tp_size=tp_size,
                                      tp_dim=tp_dim) for r in range(tp_size)]
        for name, whole in full.items():
            if whole.ndim < 2:
                for s in shards:          # one-dimensional tensors are replicated
                    _same(s[name], whole)
                continue
            _same(np.concatenate([s[name] for s in shards], axis=tp_dim), whole)


def test_tp_quantized_rows_decode_only_their_rows(quantized):
    with mcf.open(quantized) as c:
        part = mcf.load_state_dict(c, names=["k4.weight"], tp_rank=3, tp_size=4)["k4.weight"]
        _same(part, c.dequantize("k4.weight", rows=(48, 64)))


def test_tp_zero_copy_row_share(packed):
    _, out = packed
    with mcf.open(out) as c:
        whole = c.source.view(0, c.source.size)
        a = mcf.load_state_dict(c, names=["emb.weight"], tp_rank=1, tp_size=2)["emb.weight"]
        assert a.shape == (48, 64) and np.shares_memory(a, whole)
        _same(a, c.tensor("emb.weight")[48:])


def test_tp_callable_rule(packed):
    _, out = packed
    rule = lambda name, shape: 1 if name.endswith("down.weight") else (0 if len(shape) == 2 else None)  # noqa: E731
    sd = mcf.load_state_dict(out, tp_rank=1, tp_size=2, tp_dim=rule,
                             names=["mlp.down.weight", "mlp.up.weight", "attn.q.bias"])
    ref = mcf.load_state_dict(out, names=["mlp.down.weight", "mlp.up.weight", "attn.q.bias"])
    _same(sd["mlp.down.weight"], np.ascontiguousarray(ref["mlp.down.weight"][:, 64:]))
    _same(sd["mlp.up.weight"], ref["mlp.up.weight"][64:])
    _same(sd["attn.q.bias"], ref["attn.q.bias"])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 12), size=st.sampled_from([1, 2, 3]),
       dim=st.sampled_from([0, 1]), dt=st.sampled_from(["f32", "f16", "bf16", "i32"]))
def test_tp_property(tmp_path_factory, rows, cols, size, dim, dt):
    shape = [rows, cols]
    shape[dim] *= size
    rng = _rng(f"tp-prop-{rows}-{cols}-{size}-{dim}-{dt}")
    a = rng.standard_normal(shape).astype({"f32": np.float32, "f16": np.float16, "bf16": BF16,
                                            "i32": np.int32}[dt])
    p = str(tmp_path_factory.mktemp("tp") / "t.mcf")
    with mcf.Writer(p) as w:
        w.add_tensor("t", a)
    parts = [mcf.load_state_dict(p, tp_rank=r, tp_size=size, tp_dim=dim)["t"] for r in range(size)]
    _same(np.concatenate(parts, axis=dim), a)


def test_bad_arguments(packed):
    _, out = packed
    with pytest.raises(InvalidArgumentError, match="both"):
        mcf.load_state_dict(out, tp_rank=0)
    with pytest.raises(InvalidArgumentError, match="tp_rank"):
        mcf.load_state_dict(out, tp_rank=2, tp_size=2)
    with pytest.raises(InvalidArgumentError, match="evenly"):
        mcf.load_state_dict(out, names=["emb.weight"], tp_rank=0, tp_size=5)
    with pytest.raises(InvalidArgumentError, match="tp_dim"):
        mcf.load_state_dict(out, tp_rank=0, tp_size=2, tp_dim=2)
    with pytest.raises(InvalidArgumentError, match="dimension 1"):
        mcf.load_state_dict(out, names=["attn.q.bias"], tp_rank=0, tp_size=2, tp_dim=lambda n, s: 1)
    with pytest.raises(DTypeError):
        mcf.load_state_dict(out, dtype="int32")
    with pytest.raises(InvalidArgumentError, match="names"):
        mcf.load_state_dict(out, names="emb.weight")
    with pytest.raises(TensorNotFoundError):
        mcf.load_state_dict(out, names=["nope"])


def test_pread_and_buffer_inputs(packed):
    d, out = packed
    ref = safetensors_numpy.load_file(str(d / "model.safetensors"))
    with open(out, "rb") as f:
        got = mcf.load_state_dict(f)
    for name in ref:
        _same(got[name], ref[name])
    with mcf.open(out, mmap=False) as c:
        got = mcf.load_state_dict(c, dtype="float16", tp_rank=0, tp_size=2, names=["emb.weight", "mlp.down.weight"])
        _same(got["emb.weight"], ref["emb.weight"][:48].astype(np.float16))
        _same(got["mlp.down.weight"], ref["mlp.down.weight"][:32].astype(np.float32).astype(np.float16))
