"""GGUF input: decoding against gguf-py (every type, kernel variant and access mode), metadata against
gguf.GGUFReader, the committed golden files, conversion to MCF and the lossless native path."""

import io
import json
import os
import sys

import numpy as np
import pytest

import mcf
import mcf.gguf as G
import mcf.conversion.gguf as GC
from mcf._core import _kernels as K
from mcf.io import open_source

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

gguf = pytest.importorskip("gguf")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures", "gguf"))
import gguf_fixtures as fx  # noqa: E402 - from the path above

IMPLS = K.kernel_info()["supported"]
GOLDEN = os.path.join(fx.HERE, "golden_v3.gguf")
GOLDEN_V2 = os.path.join(fx.HERE, "golden_v2.gguf")
DECODABLE = fx.FLOATS + fx.QUANTIZABLE + fx.RANDOM_BLOCKS
MODES = ("mmap", "pread", "memory", "fileobj", "source")


def open_mode(path, mode):
    if mode == "mmap":
        return G.open(path)
    if mode == "pread":
        return G.open(path, mmap=False)
    if mode == "memory":
        with open(path, "rb") as f:
            return G.open(f.read())
    if mode == "fileobj":
        with open(path, "rb") as f:
            return G.open(io.BytesIO(f.read()))
    return G.open(open_source(path, mmap=False))


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


@pytest.fixture(scope="module")
def many_types(tmp_path_factory):
    """Every decodable type at a few shapes (multi-row, 3-D, a single block), written by gguf-py."""
    path = str(tmp_path_factory.mktemp("gguf") / "types.gguf")
    tensors = []
    for name in DECODABLE + fx.INTS:
        bs = gguf.GGML_QUANT_SIZES[fx.qtype(name)][0]
        for k, shape in enumerate([(5, 4 * bs), (2, 3, 2 * bs), (1, bs)]):
            arr, raw = fx.make_tensor(name, shape, fx.rng_for(f"types {name} {k}"))
            tensors.append((f"{name}.{k}", arr, raw))
    fx.write_gguf(path, tensors, [("add_name", "types")])
    return path


@pytest.fixture(scope="module")
def reader(many_types):
    return gguf.GGUFReader(many_types)


def _reference(r, name):
    t = next(t for t in r.tensors if t.name == name)
    tn = gguf.GGMLQuantizationType(t.tensor_type).name
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if tn in fx.INTS:
        return np.asarray(t.data).reshape(shape)
    return fx.reference_decode(np.asarray(t.data), tn, shape)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tname", DECODABLE)
def test_decode_equals_gguf_py(many_types, reader, tname, impl):
    with G.open(many_types) as g:
        for k in range(3):
            name = f"{tname}.{k}"
            want = _reference(reader, name)
            got = g.dequantize(name, impl=impl)
            assert got.dtype == np.float32 and got.shape == want.shape == g.info(name).shape
            assert np.array_equal(bits(got), bits(want.astype(np.float32))), name


@pytest.mark.parametrize("mode", MODES)
def test_every_access_mode_decodes_the_same(many_types, reader, mode):
    g = open_mode(many_types, mode)
    try:
        for t in g.tensors.values():
            want = _reference(reader, t.name)
            if t.type.name in fx.INTS:
                assert np.array_equal(g.array(t.name), want)
                continue
            for impl in IMPLS:
                assert np.array_equal(bits(g.dequantize(t.name, impl=impl)), bits(want)), (t.name, impl)
    finally:
        g.close()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tname", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q5_K", "F16", "F32", "BF16", "IQ2_XS", "IQ1_S",
                                   "TQ2_0", "NVFP4", "Q1_0"])
def test_narrow_outputs_round_like_fpconv(many_types, tname, impl):
    """float16 / bfloat16 outputs are the float32 decode rounded to nearest even."""
    with G.open(many_types) as g:
        name = f"{tname}.0"
        f32 = g.dequantize(name, impl="scalar")
        assert np.array_equal(g.dequantize(name, dtype=np.float16, impl=impl).view(np.uint16),
                              mcf._core._fpconv.f32_to_f16(f32.reshape(-1)).reshape(f32.shape))
        assert np.array_equal(g.dequantize(name, dtype="bf16", impl=impl),
                              mcf._core._fpconv.f32_to_bf16(f32.reshape(-1)).reshape(f32.shape))


@pytest.mark.parametrize("tname", ["Q4_K", "Q8_0", "Q3_K", "F16", "BF16"])
def test_row_ranges_out_and_threads(many_types, tname):
    with G.open(many_types) as g:
        for k in range(3):
            name = f"{tname}.{k}"
            full = g.dequantize(name)
            n = full.shape[0]
            for r0, r1 in [(0, n), (0, 1), (n - 1, n), (1, n), (n // 2, n // 2)]:
                if r0 > r1 or r1 > n:
                    continue
                assert np.array_equal(bits(g.dequantize(name, rows=(r0, r1))), bits(full[r0:r1]))
                out = np.full((r1 - r0, *full.shape[1:]), np.nan, dtype=np.float32)
                assert g.dequantize(name, rows=slice(r0, r1), out=out) is out
                assert np.array_equal(bits(out), bits(full[r0:r1]))
            for threads in (2, 3, 8):
                assert np.array_equal(bits(g.dequantize(name, threads=threads)), bits(full))


def test_row_range_of_a_1d_quantized_tensor_cuts_blocks(tmp_path):
    arr, raw = fx.make_tensor("Q4_K", (512,), fx.rng_for("1d q4k"))
    path = str(tmp_path / "one.gguf")
    fx.write_gguf(path, [("v", arr, raw)])
    with G.open(path) as g:
        full = g.dequantize("v")
        assert full.shape == (512,)
        assert np.array_equal(bits(g.dequantize("v", rows=(3, 300))), bits(full[3:300]))
        assert np.array_equal(bits(full), bits(fx.reference_decode(arr, "Q4_K", (512,))))


def test_bad_arguments(many_types):
    with G.open(many_types) as g:
        with pytest.raises(mcf.TensorNotFoundError):
            g.dequantize("nope")
        with pytest.raises(mcf.OutOfBoundsError):
            g.dequantize("Q4_K.0", rows=(0, 99))
        with pytest.raises(mcf.InvalidArgumentError):
            g.dequantize("Q4_K.0", rows=slice(0, 4, 2))
        with pytest.raises(mcf.InvalidArgumentError):
            g.dequantize("Q4_K.0", out=np.empty(3, np.float32))
        with pytest.raises(mcf.InvalidArgumentError):
            g.dequantize("Q4_K.0", dtype=np.int32)
        with pytest.raises(mcf.InvalidArgumentError):
            g.dequantize("Q4_K.0", impl="sse9")
        with pytest.raises(mcf.DTypeError):
            g.dequantize("I32.0")
        with pytest.raises(mcf.DTypeError):
            g.array("Q4_K.0")


def test_metadata_equals_gguf_reader(many_types):
    for path in (GOLDEN, many_types):
        r = gguf.GGUFReader(path)
        with G.open(path) as g:
            want = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
            got = {k: fx_tolist(v) for k, v in g.metadata.items()}
            for k, vt in g.value_types.items():  # gguf-py's contents() flattens arrays of arrays
                if vt == ("array", "array"):
                    assert got[k] == [[1, 2, 3], [4, 5]]
                    got[k] = [x for sub in got[k] for x in sub]
            assert got == want
            assert list(g.metadata) == list(want)  # file order
            for k, f in r.fields.items():
                if k.startswith("GGUF."):
                    continue
                types = [gguf.GGUFValueType(t).name.lower() for t in f.types]
                vt = g.value_types[k]
                assert (list(vt) if isinstance(vt, tuple) else [vt]) == types[:2]
            assert g.version == 3 and len(g) == len(r.tensors)
            for t in r.tensors:
                mine = g.info(t.name)
                assert mine.dims == tuple(int(d) for d in t.shape.tolist())
                assert mine.shape == tuple(reversed(mine.dims))
                assert mine.type.code == int(t.tensor_type)
                assert mine.offset == int(t.data_offset)
                assert mine.nbytes == int(t.n_bytes)
                assert np.array_equal(g.raw(t.name), np.asarray(t.data).reshape(-1).view(np.uint8))


def fx_tolist(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list):
        return [fx_tolist(x) for x in v]
    return v


@pytest.mark.parametrize("path", [GOLDEN, GOLDEN_V2])
@pytest.mark.parametrize("impl", IMPLS)
def test_golden_files(path, impl):
    """The committed bytes decode to what gguf-py's dequantizer gave when they were made."""
    with open(os.path.join(fx.HERE, "golden.json")) as f:
        digests = json.load(f)["decoded_sha256"]
    with G.open(path) as g:
        assert g.version == (3 if path == GOLDEN else 2)
        assert set(g.tensors) == set(digests)
        for name, t in g.tensors.items():
            got = g.array(name) if t.type.name in fx.INTS else g.dequantize(name, impl=impl)
            assert fx.decoded_digest(got) == digests[name], name
        assert g.metadata["tokenizer.ggml.tokens"][2:4] == ["h\u00e9llo", "\u4e16\u754c"]
        assert g.metadata["test.u64"] == 2 ** 63 + 5 and g.metadata["test.flag"] is True


def test_golden_still_matches_gguf_py():
    r = gguf.GGUFReader(GOLDEN)
    with G.open(GOLDEN) as g:
        for t in r.tensors:
            tn = gguf.GGMLQuantizationType(t.tensor_type).name
            if tn in fx.INTS:
                continue
            assert np.array_equal(bits(g.dequantize(t.name)), bits(_reference(r, t.name))), t.name


def test_golden_generator_reproduces_the_committed_bytes(tmp_path):
    path = str(tmp_path / "g.gguf")
    fx.write_gguf(path, fx.golden_tensors(), fx.golden_kv())
    with open(path, "rb") as a, open(GOLDEN, "rb") as b:
        assert a.read() == b.read()


# -- conversion ------------------------------------------------------------------------------------

def _convert(src, tmp_path, name="out.mcf", **kw):
    dst = str(tmp_path / name)
    stats = GC.convert_gguf(src, dst, **kw)
    return dst, stats


@pytest.mark.parametrize("mmap", [False, True])
def test_convert_keeps_floats_and_decodes_the_rest(many_types, reader, tmp_path, mmap):
    dst, stats = _convert(many_types, tmp_path, mmap=mmap)
    by = {s.name: s for s in stats}
    with mcf.open(dst) as c, G.open(many_types) as g:
        assert sorted(c) == sorted(g.tensors)
        for name, t in g.tensors.items():
            info = c.info(name)
            assert info.shape == t.shape
            tn = t.type.name
            if tn in fx.INTS or tn in fx.FLOATS:
                assert by[name].how == "copy"
                assert info.dtype.name == tn.lower()
                assert c.raw(name).tobytes() == g.raw(name).tobytes()
            elif tn == "MXFP4":   # an MCF extension dtype holds it as it is (docs/mcf.md): no decode
                assert by[name].how == "native" and info.dtype.name == "mxfp4"
                assert np.array_equal(bits(c.dequantize(name)), bits(_reference(reader, name)))
            else:
                assert by[name].how == "decode" and info.dtype.name == "f32"
                assert np.array_equal(bits(c.tensor(name)), bits(_reference(reader, name)))


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_convert_casts_with_dtype(many_types, tmp_path, dtype):
    dst, _ = _convert(many_types, tmp_path, dtype=dtype)
    with mcf.open(dst) as c, G.open(many_types) as g:
        for name, t in g.tensors.items():
            if t.type.name in fx.INTS:
                assert c.info(name).dtype.name == t.type.name.lower()
                continue
            assert c.info(name).dtype.name == dtype
            if t.type.name == "F64":
                continue  # f64 is narrowed in one rounding (see test_writer), not via float32
            f32 = g.dequantize(name)
            want = {"f32": lambda a: a, "f16": lambda a: mcf._core._fpconv.f32_to_f16(a.reshape(-1)),
                    "bf16": lambda a: mcf._core._fpconv.f32_to_bf16(a.reshape(-1))}[dtype](f32)
            assert c.raw(name).tobytes() == np.ascontiguousarray(want).tobytes(), name


def test_convert_requantizes_like_quantize_file(many_types, tmp_path):
    dst, stats = _convert(many_types, tmp_path, method="k4", overrides=["Q8_0.*=q8", "F32.0=none"])
    by = {s.name: s for s in stats}
    with mcf.open(dst) as c, G.open(many_types) as g:
        for name, t in g.tensors.items():
            info = c.info(name)
            if len(t.shape) == 2 and t.type.kind in ("float", "quant") and name != "F32.0":
                m = "q8" if name.startswith("Q8_0.") else "k4"
                assert info.dtype.name == m and by[name].how == "quantize"
                src = g.dequantize(name)
                payload, _ = mcf.quantize(src, m)
                assert c.raw(name).tobytes() == payload.tobytes(), name
                rec = c.quant_record(name)
                assert rec is not None and rec.max_clip == float(np.float32(np.abs(src).max()))
            elif name == "F32.0":
                assert info.dtype.name == "f32"
            elif t.type.name == "MXFP4":   # an expert stack (rank 3) stays mxfp4, which q*/k* could not hold
                assert info.dtype.name == "mxfp4"
            else:
                assert not info.dtype.quantized


@pytest.mark.parametrize("impl", IMPLS)
def test_native_q8_0_q4_0_is_lossless(tmp_path, impl):
    """Q8_0 -> MCF q8 and Q4_0 -> MCF q4 are re-layouts: MCF's decoder returns gguf-py's values bit for
    bit, and the payload is smaller than float."""
    path = str(tmp_path / "native.gguf")
    tensors = []
    for name in ("Q8_0", "Q4_0"):
        for k, shape in enumerate([(7, 96), (1, 32), (33, 256)]):
            arr, raw = fx.make_tensor(name, shape, fx.rng_for(f"native {name} {k}"))
            tensors.append((f"{name}.{k}", arr, raw))
        # blocks straight from random bytes: every code, both nibbles, negative scales
        b = fx.random_blocks(name, 12 * 4, fx.rng_for(f"native raw {name}"), scale=3.0)
        tensors.append((f"{name}.raw", b.reshape(12, -1), fx.qtype(name)))
    fx.write_gguf(path, tensors)
    dst, stats = _convert(path, tmp_path, method="native")
    r = gguf.GGUFReader(path)
    with mcf.open(dst) as c:
        for s in stats:
            assert s.how == "native" and s.stored_as == {"Q8_0": "q8", "Q4_0": "q4"}[s.ggml_type]
            got = c.dequantize(s.name, impl=impl)
            assert np.array_equal(bits(got), bits(_reference(r, s.name))), s.name


def test_native_falls_back_to_exact_float_for_subnormal_scales(tmp_path):
    b = fx.random_blocks("Q8_0", 8, fx.rng_for("subnormal"))
    b[3, 0:2] = np.array([0x0001], np.uint16).view(np.uint8)  # smallest subnormal f16 scale
    path = str(tmp_path / "sub.gguf")
    fx.write_gguf(path, [("w", b.reshape(2, -1), fx.qtype("Q8_0")), ("q4", *fx.make_tensor("Q4_0", (2, 64),
                  fx.rng_for("q4 ok")))])
    dst, stats = _convert(path, tmp_path, method="native")
    by = {s.name: s for s in stats}
    assert by["w"].how == "decode" and by["w"].stored_as == "f32"
    assert by["q4"].how == "native"
    r = gguf.GGUFReader(path)
    with mcf.open(dst) as c:
        assert np.array_equal(bits(c.tensor("w")), bits(_reference(r, "w")))
        assert c.tensor("w")[0, 3 * 32 + 1] != 0 or _reference(r, "w")[0, 3 * 32 + 1] == 0


def test_native_other_types_and_ranks_decode(many_types, reader, tmp_path):
    dst, stats = _convert(many_types, tmp_path, method="native")
    by = {s.name: s for s in stats}
    assert by["Q8_0.0"].how == "native" and by["Q4_0.2"].how == "native"
    assert by["Q8_0.1"].how == "decode"  # rank 3: MCF quantized tensors are rank 2
    assert by["Q4_K.0"].how == "decode" and by["F16.0"].how == "copy"
    with mcf.open(dst) as c:
        for name in ("Q8_0.1", "Q4_K.0", "Q6_K.1", "Q4_0.0"):
            assert np.array_equal(bits(c.tensor(name)), bits(_reference(reader, name)))


def test_convert_model_info_and_metadata_section(tmp_path):
    dst, _ = _convert(GOLDEN, tmp_path)
    with mcf.open(dst) as c, G.open(GOLDEN) as g:
        mi = c.model_info
        assert mi.model_name == "golden" and mi.arch == mcf.Arch.LLAMA
        assert (mi.vocab_size, mi.hidden_size, mi.layer_count, mi.head_count, mi.head_count_kv,
                mi.context_length) == (5, 64, 2, 4, 2, 256)
        assert mi.rope_freq_base == 10000.0
        assert mi.extras["gguf.architecture"] == "llama" and mi.extras["gguf.file_type"] == 7
        doc = json.loads(c.section_bytes(G.GGUF_METADATA_SECTION))
        assert doc["version"] == 3 and doc["alignment"] == g.alignment
        assert doc["metadata"] == {k: fx_tolist(v) for k, v in g.metadata.items()}
        assert [t["name"] for t in doc["tensors"]] == list(g.tensors)
        assert doc["tensors"][0]["dims"] == list(g.info("t.f32").dims)


def test_convert_progress_and_refusals(tmp_path):
    seen = []
    _convert(GOLDEN, tmp_path, progress=lambda i, n, name: seen.append((i, n, name)))
    assert [s[0] for s in seen] == list(range(1, 20)) and seen[-1][1] == 19
    with pytest.raises(mcf.InvalidArgumentError):
        _convert(GOLDEN, tmp_path, method="q7")
    with pytest.raises(mcf.InvalidArgumentError):
        _convert(GOLDEN, tmp_path, dtype="i8")
    with pytest.raises(mcf.InvalidArgumentError):
        _convert(GOLDEN, tmp_path, overrides=["x=q9"])


def test_unsupported_type_is_a_clear_dtype_error(tmp_path):
    """Q8_1 blocks (ggml's intermediate type for dot products, which no dequantizer decodes): the file
    opens (sizes are known), raw bytes are readable, decoding and converting name the type."""
    b = np.random.default_rng(1).integers(0, 256, (2, 40), dtype=np.uint8)
    path = str(tmp_path / "q81.gguf")
    fx.write_gguf(path, [("q81", b, fx.qtype("Q8_1")), ("ok", np.ones((2, 4), np.float32), None)])
    with G.open(path) as g:
        assert g.info("q81").type.name == "Q8_1" and g.raw("q81").tobytes() == b.tobytes()
        with pytest.raises(mcf.DTypeError, match="Q8_1"):
            g.dequantize("q81")
    dst = tmp_path / "q81.mcf"
    with pytest.raises(mcf.DTypeError, match="Q8_1"):
        GC.convert_gguf(path, str(dst))
    assert not dst.exists()


def test_open_accepts_bytes_and_sources_and_closes(tmp_path):
    with open(GOLDEN, "rb") as f:
        data = f.read()
    for obj in (data, bytearray(data), memoryview(data)):
        g = G.open(obj)
        assert len(g) == 19 and g.dequantize("t.q4_k").shape == (3, 512)
    src = open_source(GOLDEN)
    with G.open(src) as g:
        view = g.raw("t.q8_0")
    assert view.size == 4 * 3 * 34 and not src.closed  # a Source handed in stays the caller's
    src.close()
    g = G.open(GOLDEN)
    v = g.raw("t.f32")
    g.close()
    assert v.sum() == v.sum()  # views outlive close()


@pytest.mark.parametrize("mode", MODES)
def test_large_vocabulary_across_read_windows(tmp_path, mode):
    """String arrays are parsed in C window by window; strings that straddle the 1 MiB windows of the
    positional-read path, a string longer than a window and non-UTF-8 bytes all come back intact."""
    rnd = np.random.default_rng(fx.rng_for("vocab").integers(1 << 30))
    tokens = [f"t{i}\u0120" + "x" * int(rnd.integers(0, 40)) for i in range(120_000)]
    tokens[5000] = ""
    tokens[77_777] = "\u4e16" * 600_000  # 1.8 MB of UTF-8: longer than one window
    merges = [f"a{i} b{i}" for i in range(50_000)]
    path = str(tmp_path / "vocab.gguf")
    fx.write_gguf(path, [("x", np.ones((2, 32), np.float32), None)],
                  [("add_token_list", tokens), ("add_token_merges", merges), ("add_string", "after", "end")])
    g = open_mode(path, mode)
    try:
        assert g.metadata["tokenizer.ggml.tokens"] == tokens
        assert g.metadata["tokenizer.ggml.merges"] == merges
        assert g.metadata["after"] == "end"
        assert g.dequantize("x").tolist() == [[1.0] * 32] * 2
    finally:
        g.close()


def test_non_utf8_strings_stay_bytes(tmp_path):
    path = str(tmp_path / "bytes.gguf")
    fx.write_gguf(path, [], [("add_token_list", ["ab\u00e9", "zz"])])
    with open(path, "rb") as f:
        data = bytearray(f.read())
    i = data.index("ab\u00e9".encode())
    data[i + 2] = 0xFF  # 0xFF 0xA9 is not UTF-8
    with G.open(bytes(data)) as g:
        assert g.metadata["tokenizer.ggml.tokens"] == [b"ab\xff\xa9", "zz"]
        doc = json.loads(GC.metadata_json(g))
        assert doc["metadata"]["tokenizer.ggml.tokens"][0] == {"bytes_hex": "6162ffa9"}


@pytest.mark.parametrize("tname", ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "Q3_K", "Q2_K", "IQ2_XXS", "IQ1_M",
                                   "IQ4_NL", "TQ1_0", "MXFP4", "NVFP4", "Q1_0"])
def test_large_outputs_use_streaming_stores_with_the_same_bits(tmp_path, tname):
    """Outputs of 8 MiB and more, 64-byte aligned, are written with non-temporal stores by the vector
    variants: same values as gguf-py, and as an unaligned (plain-store) output."""
    from mcf.io import aligned_empty

    shape = (3072, 1024)  # 12 MiB of float32
    arr, raw = fx.make_tensor(tname, shape, fx.rng_for("large " + tname))
    path = str(tmp_path / "large.gguf")
    fx.write_gguf(path, [("w", arr, raw)])
    want = bits(fx.reference_decode(arr, tname, shape))
    with G.open(path) as g:
        for impl in IMPLS:
            out = aligned_empty(shape[0] * shape[1] * 4, 64).view(np.float32).reshape(shape)
            assert np.array_equal(bits(g.dequantize("w", out=out, impl=impl)), want), impl
            unaligned = np.empty(shape[0] * shape[1] + 1, np.float32)[1:].reshape(shape)
            assert unaligned.ctypes.data % 64
            assert np.array_equal(bits(g.dequantize("w", out=unaligned, impl=impl)), want), impl
            assert np.array_equal(bits(g.dequantize("w", impl=impl, threads=2)), want), impl
