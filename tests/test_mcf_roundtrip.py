"""Round trips through mcf.Writer and mcf.open: random tensor sets, resources, ModelInfo and quantized
payloads come back bit for bit in every access mode; ModelInfo encodes and decodes on its own; the
writer is atomic.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
from mcf.container.layout import RESOURCE_FILES
from mcf.container.modelinfo import decode_model_info, encode_model_info

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                       HealthCheck.too_slow, HealthCheck.data_too_large])

PLAIN = {
    "f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype(ml_dtypes.bfloat16),
    "f64": np.dtype("<f8"), "i8": np.dtype("i1"), "u8": np.dtype("u1"), "i16": np.dtype("<i2"),
    "u16": np.dtype("<u2"), "i32": np.dtype("<i4"), "u32": np.dtype("<u4"), "i64": np.dtype("<i8"),
    "u64": np.dtype("<u8"),
}
QUANT = ["q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"]
RESOURCES = sorted(RESOURCE_FILES.values())
MODES = ["mmap", "pread", "fileobj", "memory"]

F32_MAX = float(np.finfo(np.float32).max)
U32 = 2**32 - 1

# names: any Unicode scalar value except NUL (surrogates cannot be UTF-8 encoded)
name_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\0")
names = st.one_of(st.text(name_chars, min_size=1, max_size=12),
                  st.text(st.sampled_from("abc.0_"), min_size=1, max_size=4),   # many shared prefixes
                  st.text(name_chars, min_size=100, max_size=300))


def utf8(s: str) -> bytes:
    return s.encode("utf-8")


def f32(x: float) -> float:
    """What a float stored as f32 reads back as."""
    return float(np.float32(x))


def bits(a: np.ndarray) -> bytes:
    """The bytes of an array, compared bit for bit (``view(np.uint8)`` needs at least one dimension)."""
    return a.reshape(-1).view(np.uint8).tobytes()


def same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


# ------------------------------------------------------------------------------------------------
# strategies
# ------------------------------------------------------------------------------------------------
@st.composite
def arrays(draw, dtype_name=None):
    dtype_name = dtype_name or draw(st.sampled_from(sorted(PLAIN)))
    dt = PLAIN[dtype_name]
    rank = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=rank, max_size=rank)))
    n = math.prod(shape) * dt.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))      # any bits: NaNs, infinities, subnormals
    return np.frombuffer(raw, dtype=dt).reshape(shape).copy()


u32s = st.integers(0, U32)
any_f32 = st.floats(width=32)                               # stored exactly (NaN and inf included)
wide_floats = st.floats(-3e38, 3e38, allow_nan=False)       # float64s that round to f32
texts = st.text(name_chars | st.just("\0"), max_size=30)
extra_values = st.one_of(u32s, st.floats(width=32, allow_nan=False, allow_infinity=False),
                         st.floats(-1e30, 1e30), texts)


@st.composite
def model_infos(draw):
    return mcf.ModelInfo(
        model_name=draw(texts), base_model=draw(texts),
        arch=draw(st.sampled_from(list(mcf.Arch)) | u32s),
        vocab_size=draw(u32s), hidden_size=draw(u32s), layer_count=draw(u32s), head_count=draw(u32s),
        head_count_kv=draw(u32s), context_length=draw(u32s), train_context=draw(u32s),
        rope_type=draw(st.sampled_from(list(mcf.RopeType)) | u32s),
        rope_freq_base=draw(any_f32 | wide_floats), rope_scale=draw(any_f32 | wide_floats),
        extras=draw(st.dictionaries(st.text(name_chars, min_size=1, max_size=20), extra_values, max_size=6)),
    )


def expected_model_info(mi: mcf.ModelInfo) -> mcf.ModelInfo:
    """``mi`` as it reads back: floats rounded to f32."""
    return mcf.ModelInfo(
        model_name=mi.model_name, base_model=mi.base_model, arch=mi.arch, vocab_size=mi.vocab_size,
        hidden_size=mi.hidden_size, layer_count=mi.layer_count, head_count=mi.head_count,
        head_count_kv=mi.head_count_kv, context_length=mi.context_length, train_context=mi.train_context,
        rope_type=mi.rope_type, rope_freq_base=f32(mi.rope_freq_base), rope_scale=f32(mi.rope_scale),
        extras={k: f32(v) if isinstance(v, float) else v for k, v in mi.extras.items()},
    )


def assert_model_info_equal(got: mcf.ModelInfo, want: mcf.ModelInfo) -> None:
    want = expected_model_info(want)
    for field in ("model_name", "base_model", "arch", "vocab_size", "hidden_size", "layer_count",
                  "head_count", "head_count_kv", "context_length", "train_context", "rope_type"):
        assert getattr(got, field) == getattr(want, field), field
        assert type(getattr(got, field)) is not bool
    assert same_float(got.rope_freq_base, want.rope_freq_base)
    assert same_float(got.rope_scale, want.rope_scale)
    assert got.extras == want.extras
    assert {k: type(v) for k, v in got.extras.items()} == {k: type(v) for k, v in want.extras.items()}
    assert sorted(got.extras, key=utf8) == list(got.extras)   # read back in key order


@st.composite
def quant_tensors(draw):
    dtype = draw(st.sampled_from(QUANT))
    rows = draw(st.integers(0, 5))
    cols = draw(st.sampled_from([0, 1, 31, 32, 33, 64, 255, 256, 257, 300]) | st.integers(1, 600))
    domain = draw(st.sampled_from([0, 1])) if dtype.startswith("int") else 0
    n = mcf.quant_layout(dtype, (rows, cols), domain=domain).nbytes
    payload = draw(st.binary(min_size=n, max_size=n))
    quant = {"min_clip": draw(st.floats(width=32, allow_nan=False) | st.floats(-1e30, 1e30)),
             "max_clip": draw(st.floats(width=32, allow_nan=False) | st.floats(-1e30, 1e30))}
    if domain or draw(st.booleans()):
        quant["domain"] = domain
    return dtype, (rows, cols), payload, quant


@st.composite
def tensor_sets(draw, quantized: bool = False):
    """A whole file's content: (tensors in insertion order, resources, model info, options)."""
    plain_names = draw(st.lists(names, max_size=8, unique_by=utf8))
    tensors = [("plain", n, draw(arrays())) for n in plain_names]
    if quantized:
        for n in draw(st.lists(names, min_size=1, max_size=4, unique_by=utf8)):
            if utf8(n) not in {utf8(t[1]) for t in tensors}:
                tensors.append(("quant", n, draw(quant_tensors())))
    # byte-identical copies under other names (what dedup folds) and aliases
    dups, aliases = [], []
    used = {utf8(t[1]) for t in tensors}
    for kind, n, value in list(tensors):
        if draw(st.integers(0, 4)) == 0:
            new = n + draw(st.sampled_from(["~copy", "\u00e9", "/2"]))
            if utf8(new) not in used:
                used.add(utf8(new))
                dups.append((kind, new, value))
        elif draw(st.integers(0, 6)) == 0:
            new = n + "~alias"
            if utf8(new) not in used:
                used.add(utf8(new))
                aliases.append((new, n))
    tensors += dups
    order = draw(st.sampled_from(["sorted", "reversed", "shuffled", "as-drawn"]))
    if order == "sorted":
        tensors.sort(key=lambda t: utf8(t[1]))
    elif order == "reversed":
        tensors.sort(key=lambda t: utf8(t[1]), reverse=True)
    elif order == "shuffled":
        tensors = draw(st.permutations(tensors))
    resources = draw(st.dictionaries(st.sampled_from(RESOURCES), st.binary(max_size=300), max_size=4))
    mi = draw(st.none() | model_infos())
    opts = dict(align=draw(st.sampled_from([1, 2, 3, 8, 16, 64, 128, 4096])), dedup=draw(st.booleans()),
                meta_first=draw(st.booleans()))
    return list(tensors), aliases, resources, mi, opts


# ------------------------------------------------------------------------------------------------
# writing and reading
# ------------------------------------------------------------------------------------------------
def write(path, tensors, aliases, resources, mi, opts) -> None:
    with mcf.Writer(path, align=opts["align"], dedup=opts["dedup"]) as w:
        def meta():
            for fname, data in resources.items():
                w.add_resource(fname, data)
            if mi is not None:
                w.add_model_info(mi)
        if opts["meta_first"]:
            meta()
        for kind, name, value in tensors:
            if kind == "plain":
                w.add_tensor(name, value)
            else:
                dtype, shape, payload, quant = value
                w.add_tensor_bytes(name, dtype, shape, payload, quant=quant)
        for new, old in aliases:
            w.alias(new, old)
        if not opts["meta_first"]:
            meta()


def opened(path: Path, mode: str):
    """Open ``path`` in ``mode``; returns (container, cleanup)."""
    if mode == "mmap":
        c = mcf.open(path)
        return c, c.close
    if mode == "pread":
        c = mcf.open(path, mmap=False)
        return c, c.close
    if mode == "memory":
        c = mcf.open(memoryview(path.read_bytes()))
        return c, c.close
    f = open(path, "rb")  # noqa: SIM115 - closed by the cleanup

    def cleanup():
        c.close()
        f.close()

    c = mcf.open(f)
    return c, cleanup


def check(c, tensors, aliases, resources, mi, opts) -> None:
    by_name = {name: (kind, value) for kind, name, value in tensors}
    for new, old in aliases:
        by_name[new] = by_name[old]
    assert list(c) == sorted(by_name, key=utf8)
    assert len(c) == len(by_name)
    quantized = False
    for name, (kind, value) in by_name.items():
        assert name in c
        t = c.info(name)
        if kind == "plain":
            a = c.tensor(name)
            assert a.shape == value.shape
            assert a.dtype == value.dtype
            assert t.dtype.name == next(k for k, v in PLAIN.items() if v == value.dtype)
            assert bits(a) == bits(value)
            assert c.raw(name).tobytes() == value.tobytes()
            if opts["align"] > 1:
                assert t.offset % opts["align"] == 0 or t.nbytes == 0
        else:
            quantized = True
            dtype, shape, payload, quant = value
            assert t.dtype.name == dtype and t.shape == shape and t.nbytes == len(payload)
            assert t.offset % 64 == 0
            domain = quant.get("domain", 0)
            lay = mcf.quant_layout(dtype, shape, domain=domain)
            regions = c.quant_regions(name)
            assert [r.name for r in lay.regions] == list(regions)
            for r in lay.regions:
                got = regions[r.name]
                assert got.dtype == np.dtype(r.dtype) and got.shape == (r.count,)
                assert got.view(np.uint8).tobytes() == payload[r.offset:r.offset + r.size]
            assert c.raw(name).tobytes() == payload
            rec = c.quant_record(name)
            assert rec is not None and rec.name == name
            assert rec.tensor_index == t.index
            assert rec.method == t.dtype.code and rec.domain == domain
            fam = t.dtype.family
            assert rec.block_size == (32 if fam in ("block", "super") else 0)
            assert rec.super_size == (256 if fam == "super" else 0)
            assert rec.min_clip == f32(quant["min_clip"]) and rec.max_clip == f32(quant["max_clip"])
    qnames = sorted((n for n, (k, _) in by_name.items() if k == "quant"), key=utf8)
    assert [r.name for r in c.quant_info] == qnames
    assert c.header.aligned64 == (quantized or (bool(by_name) and opts["align"] % 64 == 0))
    # dedup: byte-identical copies share one range; aliases always do
    for _kind, name, _value in tensors:
        for new, old in aliases:
            if old == name:
                assert c.info(new)[2:5] == c.info(name)[2:5]
    if opts["dedup"]:
        firsts = {}
        for kind, name, value in tensors:
            key = (kind, value.tobytes(), value.dtype.str, value.shape) if kind == "plain" else \
                (kind, value[0], value[1], value[2], value[3].get("domain", 0))
            if key in firsts:
                assert c.info(name).offset == c.info(firsts[key]).offset
            else:
                firsts[key] = name
    assert c.resources == {k: bytes(v) for k, v in resources.items()}
    for fname in RESOURCES:
        assert c.resource(fname) == (bytes(resources[fname]) if fname in resources else None)
    if mi is None:
        assert c.model_info is None
    else:
        assert_model_info_equal(c.model_info, mi)
    # random payloads may set the top bits of k* sub-scales or hold inf/NaN scales, random resources are not JSON
    assert all("sub-scale" in p or "JSON" in p or "infinite or NaN" in p for p in c.verify())


@settings(max_examples=150, **SETTINGS)
@given(content=tensor_sets())
def test_roundtrip_plain(tmp_path_factory, content):
    tensors, aliases, resources, mi, opts = content
    path = tmp_path_factory.mktemp("rt") / "model.mcf"
    if not tensors and not resources and mi is None:
        with pytest.raises(mcf.InvalidArgumentError):
            write(path, tensors, aliases, resources, mi, opts)
        assert not path.exists()
        return
    write(path, tensors, aliases, resources, mi, opts)
    for mode in MODES:
        c, cleanup = opened(path, mode)
        try:
            check(c, tensors, aliases, resources, mi, opts)
        finally:
            cleanup()


@settings(max_examples=100, **SETTINGS)
@given(content=tensor_sets(quantized=True))
def test_roundtrip_quantized(tmp_path_factory, content):
    tensors, aliases, resources, mi, opts = content
    path = tmp_path_factory.mktemp("rtq") / "model.mcf"
    write(path, tensors, aliases, resources, mi, opts)
    for mode in MODES:
        c, cleanup = opened(path, mode)
        try:
            check(c, tensors, aliases, resources, mi, opts)
        finally:
            cleanup()


@settings(max_examples=80, **SETTINGS)
@given(q=quant_tensors())
def test_quant_regions_single(tmp_path_factory, q):
    """One quantized tensor: regions equal the quant_layout slices of the payload."""
    dtype, shape, payload, quant = q
    path = tmp_path_factory.mktemp("q") / "q.mcf"
    with mcf.Writer(path, align=1) as w:
        w.add_tensor_bytes("w", dtype, shape, payload, quant=quant)
    with mcf.open(path) as c:
        lay = mcf.quant_layout(dtype, shape, domain=quant.get("domain", 0))
        regions = c.quant_regions("w")
        joined = bytearray(len(payload))
        for r in lay.regions:
            data = regions[r.name].view(np.uint8).tobytes()
            assert data == payload[r.offset:r.offset + r.size]
            joined[r.offset:r.offset + r.size] = data
        # everything outside the regions is alignment padding
        assert bytes(joined) == bytes(b if any(r.offset <= i < r.offset + r.size for r in lay.regions)
                                      else 0 for i, b in enumerate(payload))
        (rec,) = c.quant_info
        assert (rec.name, rec.tensor_index, rec.method) == ("w", 0, c.info("w").dtype.code)
        assert c.quant_layout("w") == lay


def test_quantized_known_sizes(tmp_path):
    """The size vectors of the spec, written and read back."""
    sizes = {("k3", (2, 40)): 176, ("q4", (2, 40)): 128, ("k6", (3, 300)): 848, ("k2", (1, 1)): 136}
    path = tmp_path / "sizes.mcf"
    with mcf.Writer(path) as w:
        for (dtype, shape), n in sizes.items():
            assert mcf.quant_layout(dtype, shape).nbytes == n
            w.add_tensor_bytes(f"{dtype}", dtype, shape, bytes(range(256)) * (n // 256) + bytes(n % 256))
    with mcf.open(path) as c:
        for (dtype, shape), n in sizes.items():
            assert c.info(dtype).nbytes == n and c.info(dtype).shape == shape
        assert all(r.min_clip == 0.0 and r.max_clip == 0.0 for r in c.quant_info)


# ------------------------------------------------------------------------------------------------
# the Go reference files read the same way in every mode
# ------------------------------------------------------------------------------------------------
VECTORS = Path(__file__).parent / "vectors" / "mantle" / "files"


@pytest.mark.parametrize("name", ["k3", "q4"])
def test_reference_files_same_in_all_modes(name):
    path = VECTORS / f"{name}.mcf"
    with mcf.open(path) as ref:
        want = {n: ref.raw(n).tobytes() for n in ref}
        mi = ref.model_info
        res = ref.resources
    for mode in MODES:
        c, cleanup = opened(path, mode)
        try:
            assert {n: c.raw(n).tobytes() for n in c} == want
            assert c.model_info == mi and c.resources == res
            assert c.verify() == []
        finally:
            cleanup()


# ------------------------------------------------------------------------------------------------
# ModelInfo on its own
# ------------------------------------------------------------------------------------------------
@settings(max_examples=300, **SETTINGS)
@given(mi=model_infos())
def test_model_info_roundtrip(mi):
    data = encode_model_info(mi)
    assert len(data) % 8 == 0 and len(data) >= 88
    got = decode_model_info(data, path="x.mcf", base_offset=40)
    assert_model_info_equal(got, mi)
    assert_model_info_equal(mcf.ModelInfo.from_bytes(mi.to_bytes()), mi)
    # encoding is deterministic and idempotent on the decoded value
    assert encode_model_info(got) == data
    # any bytearray / memoryview works too
    assert_model_info_equal(decode_model_info(memoryview(bytearray(data))), mi)


@settings(max_examples=100, **SETTINGS)
@given(extras=st.dictionaries(st.text(name_chars, min_size=1, max_size=10), st.binary(max_size=20),
                              max_size=5))
def test_model_info_bytes_extras(extras):
    """bytes values are stored as strings: UTF-8 ones read back as str, others as bytes."""
    got = decode_model_info(encode_model_info(mcf.ModelInfo(extras=extras)))
    want = {}
    for k, v in extras.items():
        try:
            want[k] = v.decode("utf-8")
        except UnicodeDecodeError:
            want[k] = v
    assert got.extras == want


def test_model_info_empty_and_fixed_layout():
    data = encode_model_info(mcf.ModelInfo())
    assert len(data) == 88
    assert struct.unpack_from("<II", data, 0) == (1, 0)
    assert decode_model_info(data) == mcf.ModelInfo()
    mi = mcf.ModelInfo(model_name="m", extras={"k": 7})
    data = encode_model_info(mi)
    name_off, base_off, kv_count, _, kv_off = struct.unpack_from("<QQIIQ", data, 56)
    assert name_off == 88 and base_off == 0 and kv_count == 1 and kv_off % 8 == 0
    assert struct.unpack_from("<I", data, name_off) == (1,)


@pytest.mark.parametrize("mi", [
    mcf.ModelInfo(rope_freq_base=1e300), mcf.ModelInfo(rope_scale=-1e39),
    mcf.ModelInfo(extras={"x": 1e39}), mcf.ModelInfo(extras={"x": float("nan")}),
    mcf.ModelInfo(extras={"x": -1}), mcf.ModelInfo(extras={"x": 2**32}), mcf.ModelInfo(extras={"x": True}),
    mcf.ModelInfo(extras={"x": [1]}), mcf.ModelInfo(extras={"": 1}), mcf.ModelInfo(vocab_size=-1),
    mcf.ModelInfo(hidden_size=2**32), mcf.ModelInfo(arch=2**40),
], ids=["rope-base-huge", "rope-scale-huge", "extra-float-huge", "extra-nan", "extra-negative",
        "extra-too-big", "extra-bool", "extra-list", "empty-key", "vocab-negative", "hidden-too-big",
        "arch-too-big"])
def test_model_info_unencodable(mi):
    with pytest.raises(mcf.InvalidArgumentError) as ei:
        encode_model_info(mi)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, mcf.MCFError)


# ------------------------------------------------------------------------------------------------
# writer atomicity
# ------------------------------------------------------------------------------------------------
class Boom(Exception):
    pass


def _fill(w):
    w.add_resource("config.json", b"{}")
    w.add_tensor("a", np.arange(1000, dtype=np.float32))
    w.add_tensor_bytes("q", "k4", (2, 40), bytes(mcf.quant_layout("k4", (2, 40)).nbytes))


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_writer_exception_leaves_nothing(tmp_path, exc):
    path = tmp_path / "out.mcf"
    with pytest.raises(exc):
        with mcf.Writer(path) as w:
            _fill(w)
            assert len(os.listdir(tmp_path)) == 1     # the temporary file, not the destination
            assert not path.exists()
            raise exc()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_writer_exception_keeps_existing_file(tmp_path, exc):
    path = tmp_path / "out.mcf"
    path.write_bytes(b"previous contents")
    with pytest.raises(exc):
        with mcf.Writer(path) as w:
            _fill(w)
            raise exc()
    assert path.read_bytes() == b"previous contents"
    assert os.listdir(tmp_path) == ["out.mcf"]


def test_writer_library_error_inside_block(tmp_path):
    path = tmp_path / "out.mcf"
    path.write_bytes(b"old")
    with pytest.raises(mcf.InvalidArgumentError):
        with mcf.Writer(path) as w:
            _fill(w)
            w.add_tensor_bytes("bad", "q4", (2, 40), b"\0" * 3)   # wrong payload size
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.mcf"]


def test_writer_error_at_close(tmp_path):
    """Nothing added: close() refuses, and neither the destination nor a temp file is left."""
    path = tmp_path / "out.mcf"
    with pytest.raises(mcf.InvalidArgumentError):
        with mcf.Writer(path):
            pass
    assert os.listdir(tmp_path) == []


def test_writer_abort_and_success_replace(tmp_path):
    path = tmp_path / "out.mcf"
    path.write_bytes(b"old")
    w = mcf.Writer(path)
    _fill(w)
    w.abort()
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.mcf"]
    with mcf.Writer(path) as w:
        _fill(w)
    assert os.listdir(tmp_path) == ["out.mcf"]
    with mcf.open(path) as c:
        assert list(c) == ["a", "q"]
        assert np.array_equal(c.tensor("a"), np.arange(1000, dtype=np.float32))


@pytest.mark.parametrize("clip", [1e300, -1e39, float("inf"), "x", None])
def test_writer_rejects_unstorable_quant_clips(tmp_path, clip):
    """Clips are stored as f32: values outside its range are refused when the tensor is added, and
    the file is not published."""
    path = tmp_path / "out.mcf"
    if clip == float("inf"):   # infinities are representable: accepted and read back
        with mcf.Writer(path) as w:
            w.add_tensor_bytes("q", "q8", (1, 32), bytes(mcf.quant_layout("q8", (1, 32)).nbytes),
                               quant={"min_clip": -clip, "max_clip": clip})
        with mcf.open(path) as c:
            assert (c.quant_info[0].min_clip, c.quant_info[0].max_clip) == (-clip, clip)
        return
    with pytest.raises(mcf.InvalidArgumentError):
        with mcf.Writer(path) as w:
            w.add_tensor_bytes("q", "q8", (1, 32), bytes(mcf.quant_layout("q8", (1, 32)).nbytes),
                               quant={"min_clip": -1.0, "max_clip": clip})
    assert os.listdir(tmp_path) == []


def test_writers_refuse_urls(tmp_path):
    """Remote files are read-only: writing to a URL is a clear error before anything is created."""
    import mcf.megatron

    with pytest.raises(mcf.InvalidArgumentError, match="remote"):
        mcf.Writer("https://example.invalid/model.mcf")
    with pytest.raises(mcf.InvalidArgumentError, match="remote"):
        mcf.megatron.Writer("https://example.invalid/corpus", dtype="int32")   # s3:// is writable (object stores)
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    src = str(tmp_path / "m.safetensors")
    safetensors_numpy.save_file({"w": np.ones((2, 2), np.float32)}, src)
    with pytest.raises(mcf.InvalidArgumentError, match="remote"):
        mcf.convert(src, "https://example.invalid/out.mcf")
