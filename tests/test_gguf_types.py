"""Every ggml type gguf-py can dequantize, decoded by mcf bit for bit: the IQ, ternary, 1-/2-bit and FP4
types, their codebooks, edge bit patterns of their scales, real quantized data, and
``mcf.gguf.dequantize``, the drop-in for ``gguf.quants.dequantize``.

Every kernel variant the CPU has runs here (``impl=``), and the whole file runs again under
``MCF_FORCE_IMPL`` in .ci/run.  gguf-py is the reference; for Q1_0 and Q2_0, which it cannot decode, the
reference is ggml's C written in numpy (tests/fixtures/gguf/gguf_fixtures.py)."""

import os
import platform
import struct
import subprocess
import sys

import numpy as np
import pytest

import mcf
import mcf.gguf as G
import mcf.conversion.gguf as GC
from mcf._core import _kernels as K
from mcf.gguf import _gguf

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

gguf = pytest.importorskip("gguf")
from gguf import quants as gq  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures", "gguf"))
import gguf_fixtures as fx  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = K.kernel_info()["supported"]
NEW = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
       "MXFP4", "NVFP4", "Q1_0", "Q2_0")
# float16 bit patterns at the edges: zeros, subnormals, the normal range's ends, infinities, NaNs
# (quiet, signalling, negative, with payloads)
EDGE_F16 = (0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00,
            0xFE00, 0x7C01, 0xFD55, 0x7FFF)


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def code_of(name):
    return G.ggml_type(name).code


def decode(blocks, name, impl):
    bs, _ = fx.sizes(name)
    out = np.full(len(blocks) * bs, np.nan, np.float32)
    _gguf.dequantize_blocks(np.ascontiguousarray(blocks).reshape(-1), code_of(name), len(blocks), out, impl=impl)
    return out


def assert_same(got, want, what):
    g, w = bits(got).reshape(-1), bits(np.asarray(want, np.float32)).reshape(-1)
    if not np.array_equal(g, w):
        i = np.nonzero(g != w)[0]
        raise AssertionError(f"{what}: {len(i)} of {g.size} values differ, first at {i[:4]}: "
                             f"got {[hex(v) for v in g[i[:4]]]}, want {[hex(v) for v in w[i[:4]]]}")


# -- the type table --------------------------------------------------------------------------------

def _gguf_py_decodes(t) -> bool:
    return t in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or t in gq._type_traits


def test_every_type_gguf_py_can_dequantize_is_decoded():
    """The newest gguf-py's types: each one it can dequantize mcf decodes, and every type it names has the
    same block sizes in mcf's reader table, in the compiled table, and in gguf-py's GGML_QUANT_SIZES."""
    for t in gguf.GGMLQuantizationType:
        mine = G.ggml_type(t.value)
        assert mine.name == t.name
        assert (mine.block, mine.size) == gguf.GGML_QUANT_SIZES[t], t.name
        if _gguf_py_decodes(t):
            assert mine.kind in ("float", "quant") and mine.name in G.SUPPORTED_TYPES, t.name
        if mine.kind in ("float", "quant"):
            assert _gguf.block_info(t.value) == (mine.block, mine.size), t.name
        else:
            assert _gguf.block_info(t.value) == (0, 0), t.name
    for code, (name, bs, ts) in fx.UNNAMED.items():  # newer than gguf-py
        assert (G.ggml_type(code).name, G.ggml_type(code).block, G.ggml_type(code).size) == (name, bs, ts)
        assert _gguf.block_info(code) == (bs, ts)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="the AVX2 / AVX-512 kernels are compiled on x86-64 only")
def test_new_types_have_vector_kernels():
    for name in NEW:
        assert _gguf.own_variants(code_of(name)) == ("scalar", "avx2", "avx512"), name


@pytest.mark.skipif(platform.machine() not in ("aarch64", "arm64"),
                    reason="the NEON kernels are compiled on aarch64 only")
def test_every_vector_type_has_a_neon_kernel():
    """Every type with an AVX2 kernel has a NEON one (csrc/gguf_neon.h, gguf_iq.c, gguf_lowbit_neon.h)."""
    for name in ("F16", "BF16", "Q8_0", "Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K") + NEW:
        assert _gguf.own_variants(code_of(name)) == ("scalar", "neon"), name


def _gguf_py_grid(cls_name):
    cls = getattr(gq, cls_name)
    cls.init_grid()
    return np.asarray(cls.grid, np.float32).reshape(-1)


@pytest.mark.parametrize("table,cls_name,dtype", [
    ("iq2xxs_grid", "IQ2_XXS", np.uint8), ("iq2xs_grid", "IQ2_XS", np.uint8), ("iq2s_grid", "IQ2_S", np.uint8),
    ("iq3xxs_grid", "IQ3_XXS", np.uint8), ("iq3s_grid", "IQ3_S", np.uint8), ("iq1s_grid", "IQ1_S", np.int8)])
def test_compiled_codebooks_equal_gguf_py(table, cls_name, dtype):
    """csrc/gguf_tables.h is generated from gguf-py's tables: the compiled bytes are gguf-py's values."""
    mine = np.frombuffer(_gguf.table(table), dtype=dtype).astype(np.float32)
    assert np.array_equal(mine, _gguf_py_grid(cls_name))


def test_compiled_small_tables_equal_gguf_py():
    assert _gguf.table("ksigns_iq2xs") == gq.IQ2_XXS.ksigns
    assert np.frombuffer(_gguf.table("kvalues_iq4nl"), np.int8).tolist() == list(gq.IQ4_NL.kvalues)
    assert np.frombuffer(_gguf.table("kvalues_mxfp4"), np.int8).tolist() == list(gq.MXFP4.kvalues) \
        == list(gq.NVFP4.kvalues)
    with pytest.raises(mcf.InvalidArgumentError):
        _gguf.table("nope")


def test_table_generator_is_up_to_date():
    """tools/gen_gguf_tables.py regenerates the committed header byte for byte from the installed gguf-py."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_gguf_tables.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


# -- decoding --------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", NEW)
def test_random_bytes_every_block(name, impl):
    """Every bit pattern is a valid block of these types: random bytes, scales included (so some are
    NaN or infinite), and the same blocks with finite scales."""
    rng = fx.rng_for(f"random {name}")
    _, ts = fx.sizes(name)
    raw = rng.integers(0, 256, (333, ts), dtype=np.uint8)
    assert_same(decode(raw, name, impl), fx.reference_decode(raw, name, (-1,)), f"{name} {impl} raw")
    fin = fx.random_blocks(name, 333, rng, scale=3.0)
    assert_same(decode(fin, name, impl), fx.reference_decode(fin, name, (-1,)), f"{name} {impl} finite")


def _edge_blocks(name, rng):
    """Blocks whose float16 scale takes each of EDGE_F16 (for every scale field of the type), with
    random codes; MXFP4 / NVFP4 get every value of their one-byte scales instead."""
    _, ts = fx.sizes(name)
    if name == "MXFP4":  # every E8M0 exponent, every code in both nibbles
        b = rng.integers(0, 256, (256 * 2, ts), dtype=np.uint8)
        b[:, 0] = np.repeat(np.arange(256, dtype=np.uint8), 2)
        b[0::2, 1:] = np.arange(16, dtype=np.uint8) * 17
        return b
    if name == "NVFP4":  # every UE4M3 byte in each of the four scale slots
        b = rng.integers(0, 256, (256, ts), dtype=np.uint8)
        for s in range(4):
            b[:, s] = np.roll(np.arange(256, dtype=np.uint8), 61 * s)
        b[:16, 4:] = np.arange(16, dtype=np.uint8)[:, None] * 17
        return b
    e = np.array(EDGE_F16, np.uint16)
    b = rng.integers(0, 256, (len(e) * 3, ts), dtype=np.uint8)
    d = np.tile(e, 3)
    if name == "IQ1_M":
        fx.set_iq1m_scale(b, d.view(np.float16))
    else:
        for off in fx.F16_SCALES[name]:
            b[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return b


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", NEW)
def test_edge_scales(name, impl):
    b = _edge_blocks(name, fx.rng_for(f"edge {name}"))
    want = fx.reference_decode(b, name, (-1,))
    got = decode(b, name, impl)
    assert_same(got, want, f"{name} {impl}")
    if name not in ("MXFP4", "NVFP4"):
        assert np.isnan(got).any() and np.isinf(got).any() and (got == 0).any()


def test_mxfp4_decodes_to_the_ocp_values():
    """ggml's doubled codes times its halved scale are the OCP MX values 2^(e-127) * E2M1 (with ggml's +0
    for code 8), for every exponent: 0xFF, which the MX spec reserves for NaN, is the scale 2^128 in ggml
    and gguf-py (so the values are 2^128 * E2M1, infinite in float32 from 2 up)."""
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
    b = np.zeros((256, 17), np.uint8)
    b[:, 0] = np.arange(256)
    b[:, 1:] = (np.arange(16, dtype=np.uint8) * 17)
    got = decode(b, "MXFP4", IMPLS[-1]).reshape(256, 32)
    want = (2.0 ** (np.arange(256, dtype=np.float64) - 127))[:, None] * np.tile(e2m1, 2)[None, :]
    with np.errstate(over="ignore"):  # 2^127 * 6 is infinite in float32, as in ggml
        assert_same(got, want.astype(np.float32), "MXFP4 vs OCP")


@pytest.mark.parametrize("name", [n for n in NEW if n in fx.QUANTIZABLE])
def test_real_quantized_data(name, tmp_path):
    """Blocks made by gguf-py's own quantizer, through a GGUF file: ordinary weights, rows of zeros,
    and rows scaled by 2^-30 .. 2^38 (MXFP4's E8M0 exponent then spans a wide range) or, for the types
    with a float16 scale, by 2^-30 .. 2^16 (the float16 range, subnormal scales included)."""
    rng = fx.rng_for(f"real {name}")
    x = (rng.standard_normal((64, 512)) * 0.02).astype(np.float32)
    x[3] = 0
    top = 40 if name == "MXFP4" else 18
    k = np.arange(-30, top, 2)
    x[5:5 + len(k)] *= (2.0 ** k).astype(np.float32)[:, None]
    q = gq.quantize(x, fx.qtype(name))
    path = str(tmp_path / "real.gguf")
    fx.write_gguf(path, [("w", q, fx.qtype(name))])
    want = gq.dequantize(q, fx.qtype(name))
    with G.open(path) as g:
        for impl in IMPLS:
            assert_same(g.dequantize("w", impl=impl), want, f"{name} {impl}")
    if name == "MXFP4":
        assert len(np.unique(q.reshape(-1, 17)[:, 0])) > 20
    assert np.abs(want - x).max() <= np.abs(x).max()  # a sanity check that the data is not garbage


def _patch_tensor(path, name, *, ggml_code=None, dim0=None):
    """Rewrite one tensor description of a GGUF file in place: its type code and / or its first dim."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    if dim0 is not None:
        struct.pack_into("<Q", data, at + 4, dim0)
    if ggml_code is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_code)
    with open(path, "wb") as f:
        f.write(data)


def test_q2_0_through_a_file(tmp_path):
    """Q2_0 (code 42) is newer than gguf-py, whose writer cannot label a tensor with it: a Q1_0 tensor of
    the same byte count is relabelled (Q1_0 and Q2_0 blocks are both 18 bytes, of 128 and 64 values)."""
    rng = fx.rng_for("q2_0 file")
    blocks = fx.random_blocks("Q2_0", 6 * 4, rng, scale=2.0)
    path = str(tmp_path / "q2.gguf")
    fx.write_gguf(path, [("w", blocks.reshape(6, 4 * 18), fx.qtype("Q1_0"))])
    _patch_tensor(path, "w", ggml_code=42, dim0=4 * 64)
    with G.open(path) as g:
        assert g.info("w").type.name == "Q2_0" and g.info("w").shape == (6, 256)
        for impl in IMPLS:
            assert_same(g.dequantize("w", impl=impl), fx.reference_decode(blocks, "Q2_0", (6, 256)), impl)


def test_unknown_type_code_names_the_code_and_the_known_ones(tmp_path):
    path = str(tmp_path / "unknown.gguf")
    fx.write_gguf(path, [("w", np.ones((2, 32), np.float32), None)])
    _patch_tensor(path, "w", ggml_code=99)
    with pytest.raises(mcf.DTypeError, match=r"tensor\['w'\].*unknown ggml type code 99.*known: 0 F32, 1 F16.*"
                                             r"41 Q1_0, 42 Q2_0"):
        G.open(path)
    with pytest.raises(mcf.DTypeError, match=r"code 77; known: 0 F32.*39 MXFP4"):
        G.ggml_type(77)


def test_block_count_that_does_not_divide_names_the_tensor(tmp_path):
    path = str(tmp_path / "odd.gguf")
    b = fx.random_blocks("IQ4_XS", 4, fx.rng_for("odd"))
    fx.write_gguf(path, [("blk.0.ffn_down.weight", b.reshape(2, -1), fx.qtype("IQ4_XS"))])
    _patch_tensor(path, "blk.0.ffn_down.weight", dim0=300)
    with pytest.raises(mcf.FormatError, match=r"tensor\['blk.0.ffn_down.weight'\].*300 is not a multiple of the "
                                              r"IQ4_XS block size 256"):
        G.open(path)


GOLDEN_NEW = os.path.join(fx.HERE, "golden_new_types.gguf")


@pytest.mark.parametrize("impl", IMPLS)
def test_golden_new_types(impl):
    """The committed bytes decode to what gguf-py (numpy for Q1_0) gave when they were made, and still give."""
    import json

    with open(os.path.join(fx.HERE, "golden_new_types.json")) as f:
        digests = json.load(f)["decoded_sha256"]
    r = gguf.GGUFReader(GOLDEN_NEW)
    with G.open(GOLDEN_NEW) as g:
        assert set(g.tensors) == set(digests) and {t.type.name for t in g.tensors.values()} == set(NEW) - {"Q2_0"}
        for t in r.tensors:
            got = g.dequantize(t.name, impl=impl)
            assert fx.decoded_digest(got) == digests[t.name], t.name
            want = fx.reference_decode(np.asarray(t.data), g.info(t.name).type.name, got.shape)
            assert_same(got, want, t.name)


def test_golden_new_types_generator_reproduces_the_committed_bytes(tmp_path):
    path = str(tmp_path / "g.gguf")
    fx.write_gguf(path, fx.golden_new_tensors(), [("add_name", "golden new types")])
    with open(path, "rb") as a, open(GOLDEN_NEW, "rb") as b:
        assert a.read() == b.read()


# -- mcf.gguf.dequantize, gguf.quants.dequantize's drop-in -------------------------------------------

DROP_IN = [t.name for t in gguf.GGMLQuantizationType if _gguf_py_decodes(t)]


@pytest.mark.parametrize("name", DROP_IN)
def test_dequantize_equals_gguf_py(name):
    """Same values, shape and dtype as gguf.quants.dequantize, for 1-D, 2-D and 3-D byte arrays and for
    the typed arrays GGUFReader hands out for F32 / F16."""
    t = fx.qtype(name)
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    rng = fx.rng_for(f"drop-in {name}")
    for shape in [(3 * ts,), (4, 2 * ts), (2, 3, ts)]:
        if name in fx.F16_SCALES or name == "IQ1_M":
            data = fx.random_blocks(name, int(np.prod(shape)) // ts, rng).reshape(shape)
        else:
            data = rng.integers(0, 256, shape, dtype=np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):
            want = gq.dequantize(data, t)
        got = G.dequantize(data, t)
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape, (name, shape)
        assert_same(got, want, f"{name} {shape}")
    if name in ("F32", "F16"):
        typed = rng.standard_normal((3, 8)).astype(np.float32 if name == "F32" else np.float16)
        got, want = G.dequantize(typed, t), gq.dequantize(typed, t)
        assert got.shape == want.shape == (3, 8) and got.dtype == np.float32
        assert_same(got, want, name + " typed")
        assert np.shares_memory(got, typed) == np.shares_memory(want, typed)
    for shape, out in [((0, ts), (0, bs)), ((5, 0), (5, 0))]:  # gguf-py fails to reshape these
        empty = G.dequantize(np.zeros(shape, np.uint8), t)
        assert empty.shape == out and empty.dtype == np.float32


def _layouts(data):
    """Non-contiguous arrays of ``data``'s bytes or values: rows picked with a step, blocks picked with a step
    (a view of a 3-D array of blocks), a Fortran-ordered copy, and for typed data the transpose of the
    transpose (a strided last axis)."""
    yield "rows[::2]", data[::2]
    yield "fortran", np.asfortranarray(data)
    if data.dtype == np.uint8:
        yield "reversed rows", data[::-1]
    else:
        yield "transposed twice", np.ascontiguousarray(data.T).T
        yield "last axis [::2]", np.repeat(data, 2, axis=-1)[..., ::2]


@pytest.mark.parametrize("name", DROP_IN)
def test_dequantize_non_contiguous_equals_gguf_py(name):
    """A transposed or strided array decodes as gguf-py decodes it: the same values, shape and dtype.  Before,
    a float16 array whose last axis is not contiguous (what ``.T`` gives) raised numpy's bare ValueError from
    mcf's uint8 view, where gguf-py returns the values."""
    t = fx.qtype(name)
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    rng = fx.rng_for(f"strided {name}")
    if name in fx.F16_SCALES or name == "IQ1_M":
        blocks = fx.random_blocks(name, 4 * 6, rng).reshape(4, 6, ts)
    else:
        blocks = rng.integers(0, 256, (4, 6, ts), dtype=np.uint8)
    cases = list(_layouts(blocks.reshape(4, 6 * ts)))
    cases.append(("blocks[:, ::2]", blocks[:, ::2]))            # a strided view of blocks, rows of 3
    cases.append(("blocks transposed", blocks.transpose(1, 0, 2)))
    if name in ("F32", "F16", "BF16"):
        typed = rng.standard_normal((6, 16)).astype(np.float32)
        typed = {"F32": typed, "F16": typed.astype(np.float16),
                 "BF16": (typed.view(np.uint32) >> 16).astype(np.uint16)}[name]
        cases += [(f"typed {k}", v) for k, v in _layouts(typed)]
        cases.append(("typed .T", typed.T))
    for what, data in cases:
        assert not data.flags.c_contiguous, what
        try:
            with np.errstate(invalid="ignore", over="ignore"):
                want = gq.dequantize(data, t)
        except ValueError:   # gguf-py cannot view it (uint8 picked with a step as F16) or takes only bytes
            with np.errstate(invalid="ignore", over="ignore"):   # (BF16 as uint16): mcf decodes the values
                want = gq.dequantize(np.ascontiguousarray(data).view(np.uint8), t)
        got = G.dequantize(data, t)
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape, (name, what)
        assert_same(got, want, f"{name} {what}")


def test_dequantize_every_tensor_of_a_reader(tmp_path):
    """What transformers does: gguf.GGUFReader's tensor.data and tensor.tensor_type, every type."""
    path = str(tmp_path / "all.gguf")
    tensors = []
    for name in fx.FLOATS + fx.QUANTIZABLE + fx.RANDOM_BLOCKS:
        bs = fx.sizes(name)[0]
        for k, shape in enumerate([(3, 2 * bs), (2, 2, bs)]):
            arr, raw = fx.make_tensor(name, shape, fx.rng_for(f"reader {name} {k}"))
            tensors.append((f"{name}.{k}", arr, raw))
    fx.write_gguf(path, tensors)
    r = gguf.GGUFReader(path)
    for t in r.tensors:
        tn = gguf.GGMLQuantizationType(t.tensor_type).name
        got = G.dequantize(t.data, t.tensor_type)
        if _gguf_py_decodes(t.tensor_type):
            want = gq.dequantize(t.data, t.tensor_type)
        else:  # F64, Q8_K, Q1_0: decoded where gguf-py raises NotImplementedError
            with pytest.raises(NotImplementedError):
                gq.dequantize(t.data, t.tensor_type)
            want = fx.reference_decode(np.asarray(t.data), tn, got.shape)
        assert got.shape == want.shape, t.name
        assert_same(got, want, t.name)


def test_dequantize_accepts_codes_names_and_types():
    b = fx.random_blocks("IQ4_NL", 4, fx.rng_for("names"))
    want = gq.dequantize(b, gguf.GGMLQuantizationType.IQ4_NL)
    for q in (20, "IQ4_NL", "iq4_nl", G.ggml_type(20), gguf.GGMLQuantizationType.IQ4_NL):
        assert_same(G.dequantize(b, q), want, repr(q))
    q2 = fx.random_blocks("Q2_0", 3, fx.rng_for("q2 names"))
    assert_same(G.dequantize(q2, 42), fx.reference_decode(q2, "Q2_0", (3, 64)), "Q2_0")


def test_dequantize_errors():
    data = np.zeros((2, 35), np.uint8)
    with pytest.raises(ValueError):  # gguf-py's own error for a row that is not whole blocks
        gq.dequantize(data, gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(mcf.InvalidArgumentError, match=r"bytes per row \(35\) is not a multiple of the Q8_0 block "
                                                       r"size in bytes \(34\)") as e:
        G.dequantize(data, gguf.GGMLQuantizationType.Q8_0)
    assert isinstance(e.value, ValueError)
    with pytest.raises(mcf.InvalidArgumentError, match="F32"):
        G.dequantize(np.zeros((2, 6), np.uint8), 0)
    with pytest.raises(mcf.DTypeError, match=r"unknown ggml type code 99; known: 0 F32"):
        G.dequantize(np.zeros(34, np.uint8), 99)
    with pytest.raises(mcf.DTypeError, match="I32 holds no values to dequantize"):
        G.dequantize(np.zeros(8, np.uint8), gguf.GGMLQuantizationType.I32)
    with pytest.raises(mcf.DTypeError, match="Q8_1"):
        G.dequantize(np.zeros(40, np.uint8), gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(mcf.ArgumentTypeError, match="numpy array"):
        G.dequantize(b"\0" * 34, 8)
    with pytest.raises(mcf.InvalidArgumentError, match="0-d"):
        G.dequantize(np.array(3, np.uint8), 30)
    with pytest.raises(mcf.ArgumentTypeError, match="dtype object"):
        G.dequantize(np.array([None] * 34, object), 8)


# -- conversion and mcf info -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def new_types_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("new_types") / "new.gguf")
    tensors = []
    for name in NEW:
        if name == "Q2_0":
            continue  # gguf-py cannot label it (test_q2_0_through_a_file)
        arr, raw = fx.make_tensor(name, (4, 2 * fx.sizes(name)[0]), fx.rng_for(f"convert {name}"))
        tensors.append((f"blk.{name}.weight", arr, raw))
    tensors.append(("output_norm.weight", np.ones(64, np.float32), None))
    fx.write_gguf(path, tensors)
    return path


def test_convert_decodes_and_requantizes_the_new_types_with_the_error_reported(new_types_file, tmp_path):
    from mcf.container.quant import tensor_error_stats

    dst = str(tmp_path / "k4.mcf")
    stats = GC.convert_gguf(new_types_file, dst, method="k4", overrides=["*IQ1_S*=q8"], report=True)
    by = {s.name: s for s in stats}
    with mcf.open(dst) as c, G.open(new_types_file) as g:
        for name, _t in g.tensors.items():
            s = by[name]
            if name == "output_norm.weight":
                assert s.how == "copy" and s.rmse is None
                continue
            assert s.how == "quantize" and s.stored_as == ("q8" if "IQ1_S" in name else "k4"), name
            want = tensor_error_stats(g.dequantize(name), c.dequantize(name))
            assert (s.rmse, s.snr_db, s.max_abs_err) == want, name
            assert 0 < s.rmse < np.abs(g.dequantize(name)).max()
    plain = str(tmp_path / "f32.mcf")
    stats = GC.convert_gguf(new_types_file, plain)
    with mcf.open(plain) as c, G.open(new_types_file) as g:
        for s in stats:
            assert s.rmse is None
            if s.ggml_type == "MXFP4":   # kept as MCF's mxfp4 extension dtype: the same values, no decode
                assert s.how == "native" and s.stored_as == "mxfp4"
                assert_same(c.dequantize(s.name), g.dequantize(s.name), s.name)
            elif s.name != "output_norm.weight":
                assert s.how == "decode" and s.stored_as == "f32"
                assert_same(c.tensor(s.name), g.dequantize(s.name), s.name)


def test_cli_convert_report_and_info(new_types_file, tmp_path, capsys):
    import json

    from mcf.cli import main

    dst = str(tmp_path / "cli.mcf")
    assert main(["convert", new_types_file, "-o", dst, "--method", "k4", "--report", "--quiet"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "blk.IQ2_XXS.weight" in ln)
    assert "IQ2_XXS -> k4" in line and "quantize" in line and "RMSE" in line and "SNR" in line
    assert "output_norm.weight" in out and "-> f32   copy" in out
    assert main(["info", new_types_file]) == 0
    out = capsys.readouterr().out
    assert "GGUF v3" in out and "IQ1_M x 1" in out
    assert any("blk.NVFP4.weight" in ln and "NVFP4" in ln and "4x128" in ln for ln in out.splitlines())
    assert main(["info", "--json", "--no-mmap", new_types_file]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == "gguf" and d["types"]["MXFP4"] == 1
    assert {t["ggml_type"] for t in d["tensors"]} >= set(NEW) - {"Q2_0"}
    assert all(t["kind"] in ("quant", "float") for t in d["tensors"])


def test_cli_info_escapes_what_the_file_says(tmp_path, capsys):
    """Metadata strings and tensor names come from whoever made the file: `mcf info` shows their control
    characters as escapes instead of sending them to the terminal."""
    from mcf.cli import main

    path = str(tmp_path / "hostile.gguf")
    fx.write_gguf(path, [("w\x1b[2J\nforged row", np.ones((1, 32), np.float32), None)],
                  [("add_string", "general.name", "\x1b]0;pwned\x07\u202eevil"),
                   ("add_array", "tok\x1b[31m", ["a\nb", "\x9b1m"])])
    assert main(["info", path]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\u202e\x9b") and "forged row" in out
    assert "\\x1b]0;pwned\\x07\\u202eevil" in out and "w\\x1b[2J\\x0aforged row" in out
    assert main(["info", "--json", path]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\u001b" in out
