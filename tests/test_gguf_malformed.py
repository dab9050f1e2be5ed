"""Malformed GGUF files: every one gives a clear MCFError subclass, before any allocation larger than
the file (measured with tracemalloc, which sees numpy's buffers too)."""

import os
import random
import struct
import tracemalloc
import zlib

import numpy as np
import pytest

import mcf
import mcf.gguf as G
import mcf.conversion.gguf as GC

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "gguf")
GOLDEN = os.path.join(HERE, "golden_v3.gguf")


# -- a byte-level GGUF builder (gguf-py's writer refuses to write broken files) ---------------------

def s(text) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv_u32(key, v):
    return s(key) + struct.pack("<II", 4, v)


def kv_str(key, v):
    return s(key) + struct.pack("<I", 8) + s(v)


def tinfo(name, dims, gtype, offset):
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", gtype, offset)


def build(kvs=(), tensors=(), data=b"", *, version=3, n_tensors=None, n_kv=None, align=32, magic=b"GGUF"):
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    pad = (-len(body)) % align
    return body + b"\0" * pad + data


def f32_tensor_file(n=2, *, offsets=None, dims=((4,), (4,)), gtype=0, data=None, kvs=()):
    offs = offsets or [32 * i for i in range(n)]
    ts = [tinfo(f"t{i}", dims[i], gtype, offs[i]) for i in range(n)]
    return build(kvs, ts, data if data is not None else b"\x01" * (32 * n))


def expect(data, cls, match=None):
    """Opening ``data`` raises ``cls`` and allocates at most the file size plus a small constant."""
    tracemalloc.start()
    try:
        with pytest.raises(cls, match=match) as ei:
            G.open(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(ei.value, mcf.MCFError)
    assert peak < len(data) + (256 << 10), f"peak allocation {peak} for a {len(data)}-byte file"
    return ei.value


def test_builder_makes_valid_files():
    g = G.open(f32_tensor_file())
    assert list(g.tensors) == ["t0", "t1"] and g.dequantize("t1").tolist() == [np.float32(
        np.frombuffer(b"\x01" * 4, "<f4")[0])] * 4


@pytest.mark.parametrize("data,cls,match", [
    (b"", mcf.TruncatedError, "too short"),
    (b"GGU", mcf.TruncatedError, "too short"),
    (b"GGML" + b"\0" * 20, mcf.FormatError, "not a GGUF"),
    (build(version=1), mcf.UnsupportedVersionError, "v1"),
    (build(version=4), mcf.UnsupportedVersionError, "version"),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), mcf.UnsupportedVersionError, "big-endian"),
    (build(n_tensors=2 ** 64 - 1), mcf.FormatError, "tensor count"),
    (build(n_kv=2 ** 63), mcf.FormatError, "metadata count"),
    (build(n_kv=1000), mcf.TruncatedError, "cannot fit"),
    (build(n_tensors=50), mcf.TruncatedError, "cannot fit"),
], ids=["empty", "short", "magic", "v1", "v4", "big-endian", "tensor-count", "kv-count", "kv-overrun",
        "tensor-overrun"])
def test_header(data, cls, match):
    expect(data, cls, match)


def test_huge_string_lengths():
    expect(build([struct.pack("<Q", 2 ** 64 - 1) + b"k"]), mcf.FormatError, "limit")
    expect(build([struct.pack("<Q", 2 ** 40) + b"key"]), mcf.FormatError, "limit")
    expect(build([struct.pack("<Q", 1000) + b"key" + b"\0" * 20]), mcf.TruncatedError, "remain")
    expect(build([s("k") + struct.pack("<I", 8) + struct.pack("<Q", 2 ** 33)]), mcf.FormatError, "limit")
    expect(build([s("k") + struct.pack("<I", 8) + struct.pack("<Q", 2 ** 20) + b"x" * 50]), mcf.TruncatedError)
    expect(build([s(b"\xff\xfe")+ struct.pack("<IB", 0, 1)]), mcf.FormatError, "UTF-8")


@pytest.mark.parametrize("etype,count", [(0, 2 ** 31 + 1), (4, 2 ** 40), (10, 10 ** 6), (8, 10 ** 6), (9, 10 ** 6),
                                         (0, 2 ** 64 - 1)])
def test_huge_arrays(etype, count):
    data = build([s("arr") + struct.pack("<IIQ", 9, etype, count) + b"\0" * 64])
    expect(data, (mcf.FormatError, mcf.TruncatedError))


def test_array_nesting_and_types():
    nested = s("deep") + struct.pack("<I", 9)
    for _ in range(20):
        nested += struct.pack("<IQ", 9, 1)
    expect(build([nested + struct.pack("<IQ", 0, 0) + b"\0" * 32]), mcf.FormatError, "nested")
    expect(build([s("x") + struct.pack("<IIQ", 9, 13, 1) + b"\0" * 16]), mcf.FormatError, "element type")
    expect(build([s("x") + struct.pack("<I", 13) + b"\0" * 16]), mcf.FormatError, "value type")
    expect(build([kv_u32("a", 1), kv_u32("a", 2)]), mcf.FormatError, "duplicate metadata")


@pytest.mark.parametrize("kv,match", [
    (kv_u32("general.alignment", 0), "power of two"),
    (kv_u32("general.alignment", 48), "power of two"),
    (kv_str("general.alignment", "32"), "uint32"),
    (s("general.alignment") + struct.pack("<IQ", 10, 32), "uint32"),
    (kv_u32("general.alignment", 2 ** 31), "power of two"),
])
def test_bad_alignment(kv, match):
    expect(build([kv], [tinfo("t", (4,), 0, 0)], b"\0" * 64), mcf.FormatError, match)


def test_tensor_layout_errors():
    expect(f32_tensor_file(offsets=[0, 16]), mcf.FormatError, "not a multiple of the alignment")
    expect(f32_tensor_file(offsets=[0, 4096]), mcf.TruncatedError, "past the end")
    expect(f32_tensor_file(offsets=[0, 0]), mcf.FormatError, "overlaps")
    expect(f32_tensor_file(dims=((16,), (4,))), mcf.FormatError, "overlaps")
    expect(f32_tensor_file(offsets=[0, 2 ** 64 - 32]), mcf.TruncatedError, "past the end")
    expect(build([], [tinfo("t", (4,), 0, 0), tinfo("t", (4,), 0, 32)], b"\0" * 64), mcf.FormatError, "duplicate")
    expect(build([kv_u32("general.alignment", 64)], [tinfo("t", (4,), 0, 32)], b"\0" * 128), mcf.FormatError,
           "alignment 64")


@pytest.mark.parametrize("dims,match", [
    ((1, 1, 1, 1, 1), "at most 4"),
    ((2 ** 40, 2 ** 40), "2\\*\\*59"),
    ((2 ** 63, 2 ** 63, 2 ** 63, 2 ** 63), "2\\*\\*59"),
    ((2 ** 29, 2 ** 29), "past the end"),
    ((2 ** 59,), "past the end"),
    ((2 ** 60,), "2\\*\\*59"),
])
def test_absurd_dims(dims, match):
    expect(build([], [tinfo("t", dims, 0, 0)], b"\0" * 64), mcf.FormatError, match)


def test_zero_dims_are_empty_not_errors():
    g = G.open(build([], [tinfo("e", (0, 2 ** 59), 0, 0), tinfo("f", (4,), 0, 0)], b"\0" * 32))
    assert g.info("e").nbytes == 0 and g.info("e").shape == (2 ** 59, 0)
    assert g.dequantize("e").size == 0


def test_types():
    expect(build([], [tinfo("t", (32,), 1000, 0)], b"\0" * 64), mcf.DTypeError, "unknown ggml type code 1000")
    expect(build([], [tinfo("t", (32,), 4, 0)], b"\0" * 64), mcf.DTypeError, "code 4")  # removed Q4_2
    expect(build([], [tinfo("t", (33,), 8, 0)], b"\0" * 64), mcf.FormatError, "block size 32")
    expect(build([], [tinfo("t", (100,), 12, 0)], b"\0" * 256), mcf.FormatError, "Q4_K block size 256")
    g = G.open(build([], [tinfo("t", (32,), 9, 0)], b"\0" * 64))  # Q8_1: opens, cannot decode
    with pytest.raises(mcf.DTypeError, match="Q8_1"):
        g.dequantize("t")
    g = G.open(build([], [tinfo("t", (256,), 16, 0)], b"\0" * 96))  # IQ2_XXS: a type mcf decodes
    assert not g.dequantize("t").any()


def test_every_truncation_of_the_golden_file():
    """Every prefix raises (allocations measured on a seeded sample: tracemalloc slows opens 15x)."""
    with open(GOLDEN, "rb") as f:
        data = f.read()
    g = G.open(data)
    end = max(t.offset + t.nbytes for t in g.tensors.values())
    for n in range(len(data)):
        if n >= end:  # only trailing padding lost: still a complete file
            assert len(G.open(data[:n])) == len(g)
            continue
        with pytest.raises(mcf.MCFError):
            G.open(data[:n])
    rnd = random.Random(zlib.crc32(b"gguf truncations"))
    for n in sorted(rnd.sample(range(end), 150)):
        expect(data[:n], mcf.MCFError)


@pytest.mark.parametrize("mmap", [True, False])
def test_truncated_files_on_disk(tmp_path, mmap):
    with open(GOLDEN, "rb") as f:
        data = f.read()
    for n in (0, 3, 23, 24, 100, len(data) // 2, len(data) - 40):
        p = tmp_path / f"t{n}.gguf"
        p.write_bytes(data[:n])
        with pytest.raises(mcf.MCFError):
            G.open(str(p), mmap=mmap)


def test_random_mutations_raise_only_mcf_errors():
    """Seeded byte flips of the golden file: opening and decoding every tensor either works or raises an
    MCFError subclass (never IndexError, struct.error, MemoryError, a crash or a hang)."""
    with open(GOLDEN, "rb") as f:
        data = f.read()
    rnd = random.Random(zlib.crc32(b"gguf mutations"))
    header_end = G.open(data).data_offset
    for _ in range(3000):
        b = bytearray(data)
        for _ in range(rnd.randint(1, 6)):
            i = rnd.randrange(header_end)
            b[i] = rnd.choice([0, 0xFF, rnd.randrange(256), b[i] ^ (1 << rnd.randrange(8))])
        try:
            g = G.open(bytes(b))
        except mcf.MCFError:
            continue
        for t in g.tensors.values():
            try:
                g.dequantize(t.name)
            except mcf.DTypeError:
                pass


def test_every_error_names_file_and_field(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(f32_tensor_file(offsets=[0, 16]))
    with pytest.raises(mcf.FormatError) as ei:
        G.open(str(p))
    e = ei.value
    assert str(p) in str(e) and e.field == "tensor['t1'].offset" and e.offset is not None


def test_odd_but_valid_shapes_convert(tmp_path):
    """Empty tensors, a 0-dim scalar and an empty Q8_0 matrix are valid GGUF and convert."""
    data = build([], [tinfo("empty", (4, 0), 0, 0), tinfo("scalar", (), 0, 0), tinfo("q", (32, 0), 8, 32),
                      tinfo("v", (3,), 0, 32)],
                 struct.pack("<f", 1.5) + b"\0" * 28 + struct.pack("<3f", 1.5, 2.5, 3.5) + b"\0" * 20)
    g = G.open(data)
    assert g.info("scalar").shape == () and g.dequantize("scalar").shape == ()
    assert g.info("empty").shape == (0, 4) and g.dequantize("empty").shape == (0, 4)
    src = tmp_path / "odd.gguf"
    src.write_bytes(data)
    for method in (None, "native", "q8"):
        dst = str(tmp_path / f"odd-{method}.mcf")
        GC.convert_gguf(str(src), dst, method=method)
        with mcf.open(dst) as c:
            assert c.info("empty").shape == (0, 4) and c.info("q").shape == (0, 32)
            assert c.tensor("scalar").shape == () and float(c.tensor("scalar")) == 1.5
            assert c.tensor("v").tolist() == [1.5, 2.5, 3.5]
