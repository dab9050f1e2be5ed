"""kv_data.mcb: round trips for every dtype x compression (x chunking), partial and prefix loads,
zero-copy, and malformed input (truncation, checksums, sizes disagreeing with the shape, bombs)."""

from __future__ import annotations

import io
import struct
import zlib

import lz4.block
import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
from mcf.bucket import Int8KV, open_kv, read_kv, write_kv

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

DTYPES = ["float32", "float16", "bfloat16", "int8"]
MODES = [("none", False), ("lz4", True), ("lz4", False), ("zstd", True), ("zstd", False)]
# the header as FORMATS.md §4 writes it, spelled out independently of mcf.bucket._layout
HDR = struct.Struct("<4sHHIIIIBBQQI18s")


def make_layers(rng, n_layers, heads, seq, dim):
    return [
        (rng.standard_normal((heads, seq, dim)).astype(np.float32) * 3,
         rng.standard_normal((heads, seq, dim)).astype(np.float32))
        for _ in range(n_layers)
    ]


def reference(x: np.ndarray, dtype: str) -> np.ndarray:
    """What a reader must give back, computed with plain numpy / ml_dtypes."""
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "bfloat16":
        return x.astype(ml_dtypes.bfloat16)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    scale = (amax / np.float32(127)).astype(np.float32)
    q = np.clip(np.rint(x / np.where(scale == 0, 1, scale)), -127, 127).astype(np.int8)
    return q.astype(np.float32) * scale


def encode(layers, **kw) -> bytes:
    bio = io.BytesIO()
    write_kv(bio, layers, **kw)
    return bio.getvalue()


def assert_same(got, want):
    got = np.asarray(got)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()


# ------------------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compression,chunked", MODES)
def test_roundtrip_file(tmp_path, dtype, compression, chunked):
    rng = np.random.default_rng(7)
    layers = make_layers(rng, 3, 2, 17, 8)
    p = tmp_path / "kv_data.mcb"
    h = write_kv(p, layers, dtype=dtype, compression=compression, chunked=chunked)
    raw = p.read_bytes()
    magic, ver, flags, nl, nh, hd, seq, dt, comp, orig, csize, crc, res = HDR.unpack(raw[:64])
    assert (magic, ver, nl, nh, hd, seq) == (b"MCB\0", 1, 3, 2, 8, 17)
    assert dt == DTYPES.index(dtype) and comp == ["none", "lz4", "zstd"].index(compression)
    assert flags == (1 if chunked else 0) and res == bytes(18)
    assert csize == len(raw) - 64 and crc == zlib.crc32(raw[64:])
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}[dtype]
    per = 2 * 17 * 8 * itemsize + (2 * 17 * 4 if dtype == "int8" else 0)
    assert orig == 3 * 2 * per == h.original_size
    for mmap in (True, False):
        with open_kv(p, mmap=mmap) as f:
            out = f.load()
        for (k, v), (k0, v0) in zip(out, layers):
            assert_same(k, reference(k0, dtype))
            assert_same(v, reference(v0, dtype))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    mode=st.sampled_from(MODES),
    dims=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(0, 40), st.integers(1, 16)),
    seed=st.integers(0, 2**32 - 1),
    threads=st.integers(1, 3),
)
def test_roundtrip_hypothesis(dtype, mode, dims, seed, threads):
    rng = np.random.default_rng(seed)
    layers = make_layers(rng, *dims)
    if dims[2] and rng.random() < 0.3:  # zero rows exercise int8's zero scale
        layers[0][0][:, 0, :] = 0
    raw = encode(layers, dtype=dtype, compression=mode[0], chunked=mode[1], threads=threads)
    with open_kv(memoryview(raw)) as f:
        out = f.load(threads=threads)
    for (k, v), (k0, v0) in zip(out, layers):
        assert_same(k, reference(k0, dtype))
        assert_same(v, reference(v0, dtype))


@pytest.mark.parametrize("compression,chunked", MODES)
def test_partial_layers_and_prefix(tmp_path, compression, chunked):
    rng = np.random.default_rng(3)
    layers = make_layers(rng, 4, 2, 30, 8)
    p = tmp_path / "kv.mcb"
    write_kv(p, layers, dtype="float16", compression=compression, chunked=chunked)
    with open_kv(p) as f:
        full = f.load()
        part = f.load([3, 1], tokens=11, threads=2)
        one = f.load(2)
        none = f.load(tokens=0)
    assert len(part) == 2
    for (k, v), j in zip(part, [3, 1]):
        assert_same(k, layers[j][0][:, :11].astype(np.float16))
        assert_same(v, layers[j][1][:, :11].astype(np.float16))
    assert_same(one[0][0], np.asarray(full[2][0]))
    assert all(k.shape == (2, 0, 8) for k, _ in none)


def test_int8_raw_and_prequantized(tmp_path):
    rng = np.random.default_rng(4)
    layers = make_layers(rng, 2, 3, 9, 16)
    raw = encode(layers, dtype="int8")
    with open_kv(memoryview(raw)) as f:
        q = f.load(dequantize=False)
    k = q[0][0]
    assert isinstance(k, Int8KV) and k.data.dtype == np.int8 and k.scales.shape == (3, 9)
    # each value is within half a quantization step of the original
    err = np.abs(k.dequantize() - layers[0][0])
    assert (err <= k.scales[..., None] / 2 + 1e-6).all()
    # writing the Int8KV pairs again gives the same bytes
    assert encode([(a, b) for a, b in q], dtype="int8") == raw


def test_uncompressed_mmap_is_zero_copy(tmp_path):
    rng = np.random.default_rng(5)
    p = tmp_path / "kv.mcb"
    write_kv(p, make_layers(rng, 2, 2, 64, 32), dtype="float16")
    with open_kv(p, mmap=True) as f:
        a = f.load()[1][0]
        b = f.load(1, tokens=5)[0][0]
    assert not a.flags.writeable and not a.flags.owndata
    assert np.shares_memory(a, b)


def test_read_kv_copies(tmp_path):
    rng = np.random.default_rng(6)
    layers = make_layers(rng, 1, 1, 4, 4)
    p = tmp_path / "kv.mcb"
    write_kv(p, layers, dtype="float32", compression="lz4")
    (k, v), = read_kv(p, tokens=2)
    assert k.flags.writeable
    np.testing.assert_array_equal(v, layers[0][1][:, :2])


def test_bf16_input_and_nan(tmp_path):
    x = np.array([[[1.0, np.nan, -np.inf, 3.14159, 1e-40, 65504.0, 1.00390625, 1.01171875]]], np.float32)
    raw = encode([(x, x.astype(ml_dtypes.bfloat16))], dtype="bfloat16")
    (k, v), = open_kv(memoryview(raw)).load()
    want = x.astype(ml_dtypes.bfloat16)
    assert np.array_equal(k.view(np.uint16)[~np.isnan(x)], want.view(np.uint16)[~np.isnan(x)])
    assert np.isnan(k.astype(np.float32)[np.isnan(x)]).all()
    assert np.array_equal(v.view(np.uint16), want.view(np.uint16))


# ------------------------------------------------------------------------------------------------
# caller errors
# ------------------------------------------------------------------------------------------------
def test_caller_errors():
    a = np.zeros((2, 3, 4), np.float32)
    bad = [
        dict(layers=[], kw={}),
        dict(layers=[(a,)], kw={}),
        dict(layers=[(a, a[:1])], kw={}),
        dict(layers=[(a[0], a[0])], kw={}),
        dict(layers=[(a, a)], kw={"dtype": "float64"}),
        dict(layers=[(a, a)], kw={"compression": "gzip"}),
        dict(layers=[(a, a)], kw={"chunked": True}),
        dict(layers=[(a, a)], kw={"threads": 0}),
        dict(layers=[(a + np.nan, a)], kw={"dtype": "int8"}),
    ]
    for case in bad:
        with pytest.raises(mcf.InvalidArgumentError):
            encode(case["layers"], **case["kw"])
    raw = encode([(a, a)], compression="lz4")
    f = open_kv(memoryview(raw))
    for kw in ({"layers": [1]}, {"layers": [-1]}, {"tokens": 4}, {"tokens": -1}, {"threads": 0}, {"layers": ["0"]}):
        with pytest.raises(mcf.InvalidArgumentError):
            f.load(**kw)


# ------------------------------------------------------------------------------------------------
# malformed input
# ------------------------------------------------------------------------------------------------
def small(compression="lz4", chunked=True, dtype="float16") -> bytes:
    rng = np.random.default_rng(11)
    return encode(make_layers(rng, 2, 2, 6, 4), dtype=dtype, compression=compression, chunked=chunked)


def load_all(raw: bytes, **kw):
    with open_kv(memoryview(bytes(raw)), **kw) as f:
        return f.load()


def patch(raw: bytes, fmt: str, offset: int, value) -> bytes:
    b = bytearray(raw)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


@pytest.mark.parametrize("compression,chunked", MODES)
def test_every_truncation(compression, chunked):
    raw = small(compression, chunked)
    for n in range(len(raw)):
        with pytest.raises(mcf.FormatError) as ei:
            load_all(raw[:n])
        assert isinstance(ei.value, mcf.TruncatedError), (n, ei.value)
    with pytest.raises(mcf.FormatError, match="trailing"):
        load_all(raw + b"\0")


@pytest.mark.parametrize("compression,chunked", MODES)
def test_every_flipped_data_byte_is_caught(compression, chunked):
    raw = small(compression, chunked)
    for i in range(64, len(raw)):
        b = bytearray(raw)
        b[i] ^= 0x5A
        with pytest.raises(mcf.ChecksumError):
            load_all(b)


def test_corrupt_stored_checksum():
    for compression, chunked in MODES:
        raw = small(compression, chunked)
        bad = patch(raw, "<I", 42, struct.unpack_from("<I", raw, 42)[0] ^ 1)
        with pytest.raises(mcf.ChecksumError, match="checksum"):
            load_all(bad)
        if chunked:  # a partial load checks only the chunks it reads, which are intact
            with open_kv(memoryview(bad)) as f:
                assert_same(f.load([1])[0][0], np.asarray(open_kv(memoryview(raw)).load([1])[0][0]))


def test_partial_load_checks_its_chunks():
    raw = bytearray(small("lz4", True))
    with open_kv(memoryview(bytes(raw))) as f:
        off, size = struct.unpack_from("<QQ", raw, 64 + 24 * 2)  # chunk 2 = layer 1 K
    raw[off + size // 2] ^= 0xFF
    with open_kv(memoryview(bytes(raw))) as f:
        f.load([0])
        with pytest.raises(mcf.ChecksumError, match=r"chunk\[2\]"):
            f.load([1])


@pytest.mark.parametrize(
    "field,fmt,offset,value,match",
    [
        ("magic", "<4s", 0, b"MCBX", "not an MCB"),
        ("version", "<H", 4, 2, "version"),
        ("flags", "<H", 6, 0x8001, "unknown flag"),
        ("num_layers", "<I", 8, 0, "at least one layer"),
        ("num_layers", "<I", 8, 3, "original_size disagrees"),
        ("num_kv_heads", "<I", 12, 2**32 - 1, "original_size disagrees"),
        ("head_dim", "<I", 16, 5, "original_size disagrees"),
        ("sequence_length", "<I", 20, 7, "original_size disagrees"),
        ("dtype", "<B", 24, 9, "dtype"),
        ("dtype", "<B", 24, 0, "original_size disagrees"),
        ("compression", "<B", 25, 7, "compression"),
        ("original_size", "<Q", 26, 2**64 - 1, "original_size disagrees"),
        ("compressed_size", "<Q", 34, 2**64 - 1, "ends before"),
        ("compressed_size", "<Q", 34, 3, "smaller than the chunk table"),
        ("reserved", "<B", 63, 1, "reserved"),
    ],
)
def test_bad_header_fields(field, fmt, offset, value, match):
    bad = patch(small(), fmt, offset, value)
    with pytest.raises(mcf.FormatError, match=match) as ei:
        load_all(bad)
    assert ei.value.field is not None


def test_flags_and_compression_must_agree():
    raw = small("none", False)
    with pytest.raises(mcf.FormatError, match="CHUNKED flag on an uncompressed"):
        load_all(patch(raw, "<H", 6, 1))
    # an lz4 chunked file relabelled "none": its sizes cannot agree
    with pytest.raises(mcf.FormatError):
        load_all(patch(small("lz4", True), "<B", 25, 0))
    # a file relabelled zstd <-> lz4 (checksums still valid): the stream does not decode
    for src, dst in (("lz4", 2), ("zstd", 1)):
        with pytest.raises(mcf.FormatError, match="decompress|size"):
            load_all(patch(small(src, True), "<B", 25, dst))


def rebuild(raw_header_fields: dict, chunks: list[bytes]) -> bytes:
    """A chunked file assembled by hand around the given chunk payloads (valid CRCs everywhere)."""
    n = len(chunks)
    off = 64 + n * 24 + 4
    entries = b""
    for c in chunks:
        entries += struct.pack("<QQII", off, len(c), zlib.crc32(c), 0)
        off += len(c)
    data = entries + struct.pack("<I", zlib.crc32(entries)) + b"".join(chunks)
    f = dict(raw_header_fields)
    head = HDR.pack(b"MCB\0", 1, 1, f["nl"], f["nh"], f["hd"], f["seq"], f["dt"], f["comp"], f["orig"], len(data),
                    zlib.crc32(data), bytes(18))
    return head + data


def test_decompression_bombs():
    # header claims a huge (shape-consistent) payload behind a few bytes of lz4
    big = dict(nl=1, nh=1024, hd=1024, seq=2**20, dt=0, comp=1)
    big["orig"] = 2 * 1024 * 1024 * 2**20 * 4  # 8 TiB
    raw = rebuild(big, [b"\x00" * 4, b"\x00" * 4])
    with pytest.raises(mcf.FormatError, match="decompression bomb"):
        load_all(raw)
    # the limit is the caller's to set: a legitimate file above it is refused too
    legit = small("zstd", True)
    with pytest.raises(mcf.FormatError, match="decompression bomb"):
        load_all(legit, max_decompressed_bytes=100)
    assert load_all(legit, max_decompressed_bytes=10**6)
    # a zstd chunk whose frame header declares far more than the shape allows
    fields = dict(nl=1, nh=1, hd=4, seq=4, dt=0, comp=2, orig=2 * 64)
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * 2**24)
    raw = rebuild(fields, [bomb, bomb])
    with pytest.raises(mcf.FormatError, match="different decompressed size"):
        load_all(raw)
    # a zstd frame without a declared size that inflates past the shape
    nosize = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 2**24)
    with pytest.raises(mcf.FormatError, match="decompress|size"):
        load_all(rebuild(fields, [nosize, nosize]))
    # an lz4 block that inflates past the shape
    lzb = lz4.block.compress(b"\0" * 2**20, store_size=False)
    with pytest.raises(mcf.FormatError, match="decompress|size"):
        load_all(rebuild(fields, [lzb, lzb]))
    # and one that decodes to less than the shape
    short = lz4.block.compress(b"\0" * 10, store_size=False)
    with pytest.raises(mcf.FormatError, match="decompress|size"):
        load_all(rebuild(fields, [short, short]))


def test_chunk_table_structure():
    fields = dict(nl=1, nh=1, hd=4, seq=4, dt=0, comp=1, orig=2 * 64)
    ok = lz4.block.compress(b"\1" * 64, store_size=False)
    assert load_all(rebuild(fields, [ok, ok]))
    raw = bytearray(rebuild(fields, [ok, ok]))
    # non-contiguous chunk offsets with a valid table CRC
    struct.pack_into("<Q", raw, 64 + 24, struct.unpack_from("<Q", raw, 64 + 24)[0] + 1)
    entries = bytes(raw[64:64 + 48])
    struct.pack_into("<I", raw, 64 + 48, zlib.crc32(entries))
    with pytest.raises(mcf.FormatError, match="contiguous"):
        load_all(raw)
    # nonzero reserved word in an entry
    raw = bytearray(rebuild(fields, [ok, ok]))
    struct.pack_into("<I", raw, 64 + 20, 1)
    struct.pack_into("<I", raw, 64 + 48, zlib.crc32(bytes(raw[64:64 + 48])))
    with pytest.raises(mcf.FormatError, match="reserved"):
        load_all(raw)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_corruption_never_crashes(data):
    compression, chunked = data.draw(st.sampled_from(MODES))
    raw = bytearray(small(compression, chunked, dtype=data.draw(st.sampled_from(DTYPES))))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        out = load_all(bytes(raw[:cut]), max_decompressed_bytes=2**20)
    except mcf.MCFError:
        return
    assert len(out) == 2


def test_errors_pickle():
    import pickle

    with pytest.raises(mcf.FormatError) as ei:
        load_all(patch(small(), "<B", 24, 9))
    again = pickle.loads(pickle.dumps(ei.value))
    assert type(again) is type(ei.value) and str(again) == str(ei.value)


# ------------------------------------------------------------------------------------------------
# loading into caller-owned buffers, the CRC backend
# ------------------------------------------------------------------------------------------------
NP_STORED = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("comp,chunked", MODES)
def test_load_into_out(tmp_path, dtype, comp, chunked):
    rng = np.random.default_rng(zlib.crc32(f"out {dtype} {comp} {chunked}".encode()))
    layers = make_layers(rng, 3, 2, 10, 8)
    p = tmp_path / "kv.mcb"
    write_kv(p, layers, dtype=dtype, compression=comp, chunked=chunked)
    for sel, tokens in ((None, None), ([2, 0], None), ([1], 7), (None, 0)):
        n = 10 if tokens is None else tokens
        count = 3 if sel is None else len(sel)
        out = [(np.full((2, n, 8), 9, NP_STORED[dtype]), np.full((2, n, 8), 9, NP_STORED[dtype])) for _ in range(count)]
        with open_kv(p) as f:
            got = f.load(sel, tokens=tokens, out=out, threads=2)
        for k, (pair, layer) in enumerate(zip(got, [layers[i] for i in (sel or range(3))])):
            assert pair[0] is out[k][0] and pair[1] is out[k][1]
            for a, x in zip(pair, layer):
                np.testing.assert_array_equal(a.view(np.uint8), reference(x, dtype)[:, :n].view(np.uint8))


def test_load_into_out_refuses_bad_buffers(tmp_path):
    rng = np.random.default_rng(5)
    p = tmp_path / "kv.mcb"
    write_kv(p, make_layers(rng, 2, 2, 4, 8), dtype="float16", compression="lz4")
    good = [(np.empty((2, 4, 8), np.float16), np.empty((2, 4, 8), np.float16)) for _ in range(2)]
    ro = np.empty((2, 4, 8), np.float16)
    ro.flags.writeable = False
    shared = np.empty((2, 4, 8), np.float16)
    bad = [
        good[:1],                                                          # too few pairs
        [(good[0][0],), good[1]],                                          # not a pair
        [(np.empty((2, 4, 8), np.float32), good[0][1]), good[1]],         # wrong dtype
        [(np.empty((2, 5, 8), np.float16), good[0][1]), good[1]],         # wrong shape
        [(ro, good[0][1]), good[1]],                                       # read-only
        [(np.empty((2, 8, 8), np.float16)[:, ::2], good[0][1]), good[1]],  # not contiguous
        [(shared, shared), good[1]],                                       # overlapping
    ]
    with open_kv(p) as f:
        for out in bad:
            with pytest.raises(mcf.InvalidArgumentError):
                f.load(out=out)
    q = tmp_path / "i8.mcb"
    write_kv(q, make_layers(rng, 1, 2, 4, 8), dtype="int8", compression="lz4")
    with open_kv(q) as f, pytest.raises(mcf.InvalidArgumentError, match="int8"):
        f.load(out=[(np.empty((2, 4, 8), np.int8),) * 2])


def test_corrupt_chunk_is_detected_when_decoding_into_out(tmp_path):
    rng = np.random.default_rng(6)
    p = tmp_path / "kv.mcb"
    write_kv(p, make_layers(rng, 2, 2, 64, 8), dtype="float16", compression="lz4")
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0x40
    p.write_bytes(bytes(raw))
    out = [(np.empty((2, 64, 8), np.float16), np.empty((2, 64, 8), np.float16)) for _ in range(2)]
    with open_kv(p) as f, pytest.raises(mcf.ChecksumError):
        f.load(out=out)
    with open_kv(p) as f, pytest.raises(mcf.ChecksumError):
        f.load([1], out=out[:1])
    # unverified, the damaged stream is refused by the decoder or decodes to some bytes: never a crash
    with open_kv(p) as f:
        try:
            f.load(out=out, verify=False)
        except mcf.FormatError:
            pass


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.integers(0, 2**32 - 1))
def test_crc_backend_equals_zlib(data, start):
    from mcf.bucket.kvfile import _crc32

    assert _crc32(data) == zlib.crc32(data)
    assert _crc32(data, start) == zlib.crc32(data, start)


def test_identity_changes_with_any_write(tmp_path):
    rng = np.random.default_rng(7)
    p = tmp_path / "kv.mcb"
    write_kv(p, make_layers(rng, 1, 2, 4, 8), dtype="float16")
    with open_kv(p) as f:
        first = f.identity()
    raw = p.read_bytes()
    p.write_bytes(raw)  # same bytes, rewritten in place: ctime moves
    with open_kv(p) as f:
        assert f.identity() != first and f.identity()[1] == first[1]
    with open_kv(memoryview(raw)) as f:
        assert f.identity() is None


def test_malformed_lz4_chunk_names_the_chunk(tmp_path):
    """A chunk whose CRC was not checked (verify=False) and whose stream is broken is refused by the
    decoder with the chunk and its offset."""
    p = tmp_path / "kv.mcb"
    write_kv(p, [(np.zeros((2, 64, 8), np.float32),) * 2], dtype="float32", compression="lz4")
    with open_kv(p) as f:
        off, size, _ = f._chunks[1]
    raw = bytearray(p.read_bytes())
    raw[off:off + size] = bytes(size)  # token 0, then offset 0: not a valid match
    p.write_bytes(bytes(raw))
    with open_kv(p) as f, pytest.raises(mcf.FormatError, match=r"chunk\[1\].*malformed lz4 block"):
        f.load(verify=False)
    out = [(np.empty((2, 64, 8), np.float32), np.empty((2, 64, 8), np.float32))]
    with open_kv(p) as f, pytest.raises(mcf.FormatError, match=r"chunk\[1\]"):
        f.load(verify=False, out=out)
    with open_kv(p) as f, pytest.raises(mcf.ChecksumError):
        f.load(out=out)
