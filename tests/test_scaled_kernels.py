"""The compiled decoders of mcf's extension dtypes (csrc/mx.c through mcf._core._mx), every variant this CPU
supports forced one by one, against references that are not mcf's code:

- the element types (FP8 E4M3 / E5M2 and their FNUZ variants, E8M0, FP4 E2M1) on every bit pattern (all 256 of
  a byte, all 16 of a nibble in both halves of a byte) against torch's and ml_dtypes' conversions;
- the block formats (mxfp4, nvfp4, f8_e4m3_b128) against the plain-numpy references of tests/_scaled_checkpoints.py,
  written from the published layouts (OCP MX v1.0, ModelOpt's NVFP4QTensor, DeepSeek-V3's weight_dequant), on
  payloads split into regions by this file's own reading of docs/mcf.md;
- and the same results through every reader (Container.dequantize, mcf.load_file, mcf.load_state_dict,
  mcf.torch.load_file) under whatever MCF_FORCE_IMPL says (.ci/run runs this file once per variant).
"""

import re
import zlib

import ml_dtypes
import numpy as np
import pytest

import mcf
import _scaled_checkpoints as S
from mcf._core import _kernels, _mx

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

IMPLS = _kernels.kernel_info()["supported"]
BYTES = np.arange(256, dtype=np.uint8)
ML = {"f8_e4m3": ml_dtypes.float8_e4m3fn, "f8_e5m2": ml_dtypes.float8_e5m2, "f8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
      "f8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz, "f8_e8m0": ml_dtypes.float8_e8m0fnu}
TORCH = {"f8_e4m3": "float8_e4m3fn", "f8_e5m2": "float8_e5m2", "f8_e4m3fnuz": "float8_e4m3fnuz",
         "f8_e5m2fnuz": "float8_e5m2fnuz", "f8_e8m0": "float8_e8m0fnu"}
OUT = [np.float32, np.float16, ml_dtypes.bfloat16]


def rng_for(*label):
    return np.random.default_rng(zlib.crc32(repr(label).encode()))


def same_values(got, want):
    """Equal bit for bit where ``want`` is a number, NaN where it is NaN (NaN payloads are each library's own)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    bits = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    assert np.array_equal(got[~nan].view(bits), want[~nan].view(bits))


def rounded(ref32, dt):
    """The float32 reference rounded once to the output dtype, as every kernel rounds (to nearest even; beyond
    float16's range is infinity)."""
    with np.errstate(over="ignore"):
        return ref32.astype(dt)


# -- element types -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(ML))
def test_every_byte_as_ml_dtypes_converts_it(name, impl):
    want = BYTES.view(ML[name]).astype(np.float32)
    for dt in OUT:
        same_values(_mx.decode_elements(BYTES, name, dtype=dt, impl=impl), rounded(want, dt))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(TORCH))
def test_every_byte_as_torch_converts_it(name, impl):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, TORCH[name], None)
    if tdt is None:
        pytest.skip(f"torch {torch.__version__} has no {TORCH[name]}")
    want = torch.from_numpy(BYTES.copy()).view(tdt).float().numpy()
    same_values(_mx.decode_elements(BYTES, name, impl=impl), want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(ML) + ["f4"])
def test_every_variant_writes_the_scalar_bits_nan_payloads_included(name, impl):
    """Every byte (F4: every code in both nibbles) decodes to the scalar reference's float32 bits in every variant,
    NaN payloads included (csrc/minifloat.h's promise). E5M2's signalling NaNs 0x7D / 0xFD are binary16's 0x7D00 /
    0xFD00 widened exactly, payload kept (the x86 variants' vcvtph2ps used to quiet them to 0x7FE00000)."""
    got, want = (_mx.decode_elements(BYTES, name, impl=i).view(np.uint32) for i in (impl, "scalar"))
    assert np.array_equal(got, want), [(hex(b), hex(g), hex(w)) for b, g, w in zip(BYTES, got, want) if g != w]
    if name == "f8_e5m2":
        assert (hex(got[0x7D]), hex(got[0xFD])) == ("0x7fa00000", "0xffa00000")


@pytest.mark.parametrize("impl", IMPLS)
def test_every_fp4_code_in_both_nibbles(impl):
    """All 16 E2M1 codes in the low nibble (element 2k) and in the high one (element 2k + 1), as ml_dtypes'
    float4_e2m1fn converts them (torch's float4_e2m1fn_x2 converts to nothing)."""
    want = np.stack([BYTES & 15, BYTES >> 4], -1).reshape(-1).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    same_values(want, S.E2M1[np.stack([BYTES & 15, BYTES >> 4], -1).reshape(-1)])
    for dt in OUT:
        same_values(_mx.decode_elements(BYTES, "f4", dtype=dt, impl=impl), rounded(want, dt))


def test_the_fp4_table_is_gpt_oss_loader_s():
    """The references' E2M1 table is the one transformers decodes gpt-oss with (FP4_VALUES), -0.0 included."""
    tf = pytest.importorskip("transformers.integrations.mxfp4")
    same_values(np.array(tf.FP4_VALUES, np.float32), S.E2M1)


@pytest.mark.parametrize("impl", IMPLS)
def test_element_runs_of_every_length_and_offset(impl):
    """Lengths around the vector widths (tails of 1..31 values) and unaligned starts, F4 odd counts included."""
    rng = rng_for("runs")
    raw = rng.integers(0, 256, 300, dtype=np.uint8)
    for name in ("f8_e4m3", "f8_e5m2", "f8_e8m0", "f4"):
        for start in (0, 1, 3, 7):
            for n in (0, 1, 5, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100):
                src = raw[start:start + (n + 1) // 2 if name == "f4" else start + n]
                full = _mx.decode_elements(raw[start:], name, impl="scalar")
                same_values(_mx.decode_elements(src, name, count=n, impl=impl), full[:n])


def test_element_arguments_are_checked():
    with pytest.raises(mcf.InvalidArgumentError, match="need 3 bytes"):
        _mx.decode_elements(np.zeros(2, np.uint8), "f4", count=5)
    with pytest.raises(mcf.DTypeError, match="not an FP8"):
        _mx.decode_elements(np.zeros(2, np.uint8), "bf16")
    with pytest.raises(mcf.InvalidArgumentError, match="out has 3"):
        _mx.decode_elements(np.zeros(2, np.uint8), "f8_e4m3", out=np.empty(3, np.float32))


# -- block formats -------------------------------------------------------------------------------------------

def random_payload(fmt, shape, rng, *, edge=True):
    """Random codes; every scale bit pattern but the NaN ones (zeros, E4M3 subnormals, 2^-127, float32 subnormals,
    infinities and huge values, to exercise inf * 0 and overflow)."""
    p = rng.integers(0, 256, S.payload_size(fmt, shape), dtype=np.uint8)
    r = S.split_payload(fmt, shape, p)
    if fmt == "mxfp4":
        s = r["scales"]
        s[s == 0xFF] = 0xFE
        if edge and s.size > 4:
            s[:4] = [0, 1, 253, 254]
    elif fmt == "nvfp4":
        s = r["scales"]
        s[(s & 0x7F) == 0x7F] = 0x7E
        r["scale"][:] = np.frombuffer(np.float32(rng.choice([0.37, 1e-30, 3e30, 2 ** -140])).tobytes(), np.uint8)
    else:
        v = rng.uniform(-4, 4, r["scales"].size // 4).astype("<f4")
        if edge and v.size > 3:
            v[:4] = [0.0, np.inf, 1e-40, -3e38]
        r["scales"][:] = v.view(np.uint8)
    return p


SHAPES = {"mxfp4": [(1, 32), (3, 64), (2, 5, 96), (7, 512), (2, 3, 4, 32)],
          "nvfp4": [(1, 16), (3, 48), (4, 2, 64), (5, 272)],
          "f8_e4m3_b128": [(1, 1), (5, 7), (130, 300), (256, 128), (129, 17), (3, 1000)]}
CASES = [(f, s) for f, shapes in SHAPES.items() for s in shapes]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt,shape", CASES)
def test_block_formats_match_the_references(fmt, shape, impl):
    with np.errstate(over="ignore", invalid="ignore"):
        p = random_payload(fmt, shape, rng_for(fmt, shape))
        want = S.payload_reference(fmt, shape, p).reshape(-1, shape[-1])
        for dt in OUT:
            same_values(_mx.dequantize(p, fmt, shape, dtype=dt, impl=impl), rounded(want, dt))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_row_ranges_threads_and_out(fmt, impl):
    shape = (300, 256) if fmt != "nvfp4" else (300, 64)
    with np.errstate(over="ignore", invalid="ignore"):
        p = random_payload(fmt, shape, rng_for("rows", fmt), edge=False)
        full = _mx.dequantize(p, fmt, shape, impl=impl)
        for a, b in ((0, 300), (1, 2), (127, 129), (128, 256), (299, 300), (5, 5)):
            same_values(_mx.dequantize(p, fmt, shape, row_range=(a, b), impl=impl), full[a:b])
        same_values(_mx.dequantize(p, fmt, shape, impl=impl, threads=3), full)
        out = np.empty((10, shape[1]), ml_dtypes.bfloat16)
        assert _mx.dequantize(p, fmt, shape, row_range=(20, 30), out=out, impl=impl) is out
        same_values(out, full[20:30].astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "f8_e4m3_b128"])
def test_large_float32_output_takes_the_streaming_path_with_the_same_bits(fmt):
    """8 MiB and more of float32 output goes through streaming stores (AVX2, AVX-512): the same values."""
    shape = (1024, 2048)
    p = random_payload(fmt, shape, rng_for("stream", fmt), edge=False)
    want = _mx.dequantize(p, fmt, shape, impl="scalar")
    for impl in IMPLS:
        same_values(_mx.dequantize(p, fmt, shape, impl=impl), want)


@pytest.mark.parametrize("name", ["f8_e4m3", "f8_e5m2", "f8_e4m3fnuz", "f8_e5m2fnuz", "f8_e8m0", "f4_e2m1"])
def test_large_element_runs_take_the_streaming_path_with_the_same_bits(name):
    """8 MiB of float32 values, aligned (streaming stores in the vector variants) and 4 bytes off (plain)."""
    src = rng_for("stream", name).integers(0, 256, (8 << 20) // 4, dtype=np.uint8)
    n = src.size * (2 if name == "f4_e2m1" else 1)
    want = _mx.decode_elements(src, name, count=n, impl="scalar")
    raw = np.empty(n * 4 + 64, np.uint8)
    skew = raw[(-raw.ctypes.data) % 64 + 4:][: n * 4].view(np.float32)
    for impl in IMPLS:
        same_values(_mx.decode_elements(src, name, count=n, impl=impl), want)
        same_values(_mx.decode_elements(src, name, count=n, impl=impl, out=skew), want)


@pytest.mark.parametrize("fmt,region,at,value,shown", [
    ("mxfp4", "scales", 5, b"\xff", "scales[5]"),
    ("nvfp4", "scales", 2, b"\x7f", "scales[2]"),
    ("nvfp4", "scales", 3, b"\xff", "scales[3]"),
    ("nvfp4", "scale", 0, np.float32(np.nan).tobytes(), "scale"),
    ("f8_e4m3_b128", "scales", 4, np.float32(np.nan).tobytes(), "scales[1]"),
])
def test_a_nan_block_scale_is_refused_naming_it(fmt, region, at, value, shown):
    shape = (4, 64) if fmt != "f8_e4m3_b128" else (4, 300)
    p = random_payload(fmt, shape, rng_for("nan", fmt), edge=False)
    r = S.split_payload(fmt, shape, p)
    r[region][at:at + len(value)] = np.frombuffer(value, np.uint8)
    with pytest.raises(mcf.FormatError, match=rf"{re.escape(shown)}.*NaN block scale"):
        _mx.dequantize(p, fmt, shape)
    if region == "scales" and fmt != "f8_e4m3_b128":   # rows that do not reach the block decode
        _mx.dequantize(p, fmt, shape, row_range=(3, 4))


def test_payload_sizes_and_shapes_are_checked():
    with pytest.raises(mcf.InvalidArgumentError, match="needs"):
        _mx.dequantize(np.zeros(10, np.uint8), "mxfp4", (2, 64))
    with pytest.raises(mcf.InvalidArgumentError, match="not a multiple of 32"):
        _mx.dequantize(np.zeros(1000, np.uint8), "mxfp4", (2, 48))
    with pytest.raises(mcf.InvalidArgumentError, match="rank 2"):
        _mx.dequantize(np.zeros(1000, np.uint8), "f8_e4m3_b128", (2, 2, 2))
    with pytest.raises(mcf.DTypeError, match="not a block-scaled"):
        _mx.dequantize(np.zeros(1000, np.uint8), "q8", (2, 32))
    with pytest.raises(mcf.InvalidArgumentError, match="outside"):
        _mx.dequantize(np.zeros(S.payload_size("nvfp4", (2, 16)), np.uint8), "nvfp4", (2, 16), row_range=(1, 3))


# -- through the readers -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ext_file(tmp_path_factory):
    """An MCF file with every extension dtype; the expected float32 values of each tensor."""
    path = tmp_path_factory.mktemp("ext") / "ext.mcf"
    rng = rng_for("file")
    want = {}
    with mcf.Writer(path) as w, np.errstate(over="ignore", invalid="ignore"):
        for fmt, shape in (("mxfp4", (4, 8, 64)), ("nvfp4", (20, 48)), ("f8_e4m3_b128", (300, 260))):
            p = random_payload(fmt, shape, rng, edge=False)
            w.add_tensor_bytes(fmt, fmt, shape, p)
            want[fmt] = S.payload_reference(fmt, shape, p).reshape(shape)
        for name in ML:
            raw = rng.integers(0, 256, (16, 16), dtype=np.uint8)
            w.add_tensor_bytes(name, name, raw.shape, raw)
            want[name] = raw.view(ML[name]).astype(np.float32)
        raw = rng.integers(0, 256, (6, 5), dtype=np.uint8)
        w.add_tensor_bytes("f4", "f4", (6, 10), raw)
        want["f4"] = np.stack([raw & 15, raw >> 4], -1).reshape(6, 10).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return path, want


def test_container_dequantize_every_dtype_and_variant(ext_file):
    path, want = ext_file
    with mcf.open(path) as c:
        for name, values in want.items():
            for impl in IMPLS:
                for dt in OUT:
                    same_values(c.dequantize(name, dt, impl=impl), rounded(values, dt))
            same_values(c.dequantize(name, rows=(1, 3)), values[1:3])
            if c.info(name).dtype.quantized:   # to_float32 converts plain tensors, the FP8 / F4 ones included
                with pytest.raises(mcf.DTypeError, match="not a plain float tensor"):
                    c.to_float32(name)
            else:
                same_values(c.to_float32(name), values)


def test_loaders_decode_the_block_formats(ext_file):
    path, want = ext_file
    blocks = ["mxfp4", "nvfp4", "f8_e4m3_b128"]
    got = mcf.load_file(path, names=blocks)
    for name in blocks:
        same_values(got[name], want[name])
    sd = mcf.load_state_dict(path, names=blocks, dtype="bfloat16", tp_rank=1, tp_size=2)
    same_values(sd["mxfp4"], want["mxfp4"][2:].astype(ml_dtypes.bfloat16))    # experts 2, 3
    same_values(sd["nvfp4"], want["nvfp4"][10:].astype(ml_dtypes.bfloat16))
    same_values(sd["f8_e4m3_b128"], want["f8_e4m3_b128"][150:].astype(ml_dtypes.bfloat16))
    cols = mcf.load_file(path, names=blocks, slices={"*": mcf.Shard(1, 2, -1)})
    same_values(cols["mxfp4"], want["mxfp4"][..., 32:])
    same_values(cols["nvfp4"], want["nvfp4"][:, 24:])      # 24: inside a block of 16, decoded whole and cropped
    same_values(cols["f8_e4m3_b128"], want["f8_e4m3_b128"][:, 130:])
    torch = pytest.importorskip("torch")
    from mcf import torch as mcf_torch

    t = mcf_torch.load_file(path, names=blocks, dtype=torch.float16)
    for name in blocks:
        same_values(t[name].numpy(), rounded(want[name], np.float16))

