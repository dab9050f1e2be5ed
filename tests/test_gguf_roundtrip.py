"""Property tests: random metadata and random tensors written by gguf-py's writer read back exactly
(metadata equal to what was written, values equal to gguf-py's dequantizer for any row range), and
the native Q8_0/Q4_0 conversion stays lossless for any shape."""

import os
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.gguf as G
import mcf.conversion.gguf as GC

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

gguf = pytest.importorskip("gguf")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures", "gguf"))
import gguf_fixtures as fx  # noqa: E402 - from the path above

DECODABLE = fx.FLOATS + fx.QUANTIZABLE + fx.RANDOM_BLOCKS
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
scalars = st.one_of(
    st.tuples(st.just("add_uint8"), st.integers(0, 255)),
    st.tuples(st.just("add_int8"), st.integers(-128, 127)),
    st.tuples(st.just("add_uint16"), st.integers(0, 2 ** 16 - 1)),
    st.tuples(st.just("add_int16"), st.integers(-2 ** 15, 2 ** 15 - 1)),
    st.tuples(st.just("add_uint32"), st.integers(0, 2 ** 32 - 1)),
    st.tuples(st.just("add_int32"), st.integers(-2 ** 31, 2 ** 31 - 1)),
    st.tuples(st.just("add_uint64"), st.integers(0, 2 ** 64 - 1)),
    st.tuples(st.just("add_int64"), st.integers(-2 ** 63, 2 ** 63 - 1)),
    st.tuples(st.just("add_float32"), st.floats(width=32, allow_nan=False)),
    st.tuples(st.just("add_float64"), st.floats(allow_nan=False)),
    st.tuples(st.just("add_bool"), st.booleans()),
    st.tuples(st.just("add_string"), text.filter(bool)),  # gguf-py's writer drops empty strings
    st.tuples(st.just("add_array"), st.lists(text, min_size=1, max_size=8)),
    st.tuples(st.just("add_array"), st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), min_size=1, max_size=8)),
    st.tuples(st.just("add_array"), st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=8)),
)


def _as_plain(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


@SETTINGS
@given(st.dictionaries(keys.filter(lambda k: k != "general.architecture"), scalars, max_size=12))
def test_metadata_round_trip(items):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.gguf")
        fx.write_gguf(path, [], [(meth, k, v) for k, (meth, v) in items.items()])
        with open(path, "rb") as f:
            data = f.read()
    g = G.open(data)
    assert list(g.metadata) == ["general.architecture", *items]
    for k, (meth, v) in items.items():
        got = _as_plain(g.metadata[k])
        if meth == "add_float32":
            assert got == float(np.float32(v))
        elif meth == "add_array" and isinstance(v[0], float):
            assert got == [float(np.float32(x)) for x in v]
        else:
            assert got == v, (k, meth)


@SETTINGS
@given(tname=st.sampled_from(DECODABLE), lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
       nblocks=st.integers(1, 3), seed=st.integers(0, 2 ** 32 - 1), data=st.data())
def test_decode_any_shape_and_row_range(tname, lead, nblocks, seed, data):
    block = gguf.GGML_QUANT_SIZES[fx.qtype(tname)][0]
    shape = (*lead, nblocks * max(block, 8))
    arr, raw = fx.make_tensor(tname, shape, np.random.default_rng(seed))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.gguf")
        fx.write_gguf(path, [("t", arr, raw)])
        with open(path, "rb") as f:
            g = G.open(f.read())
    want = fx.reference_decode(arr, tname, shape)
    r0 = data.draw(st.integers(0, shape[0]))
    r1 = data.draw(st.integers(r0, shape[0]))
    impl = data.draw(st.sampled_from(mcf.kernel_info()["supported"]))
    got = g.dequantize("t", rows=(r0, r1), impl=impl)
    assert np.array_equal(got.view(np.uint32), np.ascontiguousarray(want[r0:r1]).view(np.uint32))


@SETTINGS
@given(tname=st.sampled_from(["Q8_0", "Q4_0"]), rows=st.integers(1, 9), nblocks=st.integers(1, 9),
       seed=st.integers(0, 2 ** 32 - 1), scale=st.sampled_from([1e-3, 0.05, 3.0, 3000.0]))
def test_native_conversion_is_lossless_for_any_shape(tname, rows, nblocks, seed, scale):
    b = fx.random_blocks(tname, rows * nblocks, np.random.default_rng(seed), scale=scale)
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "n.gguf"), os.path.join(d, "n.mcf")
        fx.write_gguf(src, [("w", b.reshape(rows, -1), fx.qtype(tname))])
        (st_,) = GC.convert_gguf(src, dst, method="native")
        want = fx.reference_decode(b, tname, (rows, nblocks * 32))
        with mcf.open(dst) as c:
            got = c.tensor("w")
            assert c.info("w").dtype.name == ("f32" if st_.how == "decode" else {"Q8_0": "q8", "Q4_0": "q4"}[tname])
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
