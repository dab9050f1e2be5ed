"""mcf's extension dtypes in the MCF format (docs/mcf.md, "mcf extensions"): their codes, payload sizes, the
writer's and reader's rules, verify(), and what a reader that does not know them does with them (it refuses
the tensor: its size and meaning are unknown to it)."""

import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import mcf
from mcf._core.dtypes import DType, EXTENSION_BASE, dtype_info, parse_dtype
from mcf.container.tensor_index import HEADER as INDEX_HEADER

EXTENSIONS = {"f8_e4m3": 0x8001, "f8_e5m2": 0x8002, "f8_e4m3fnuz": 0x8003, "f8_e5m2fnuz": 0x8004,
              "f8_e8m0": 0x8005, "f4": 0x8006, "mxfp4": 0x8010, "nvfp4": 0x8011, "f8_e4m3_b128": 0x8012}


def test_extension_codes_stay_clear_of_the_spec_s():
    """The reference implementation numbers 1-12, 0x10/0x11, 0x20/0x21, 0x30-0x33; ours start at 0x8000 and fit
    its 16-bit dtype field."""
    for name, code in EXTENSIONS.items():
        info = parse_dtype(name)
        assert info.code == code and info.extension and EXTENSION_BASE <= code <= 0xFFFF
    spec = {c for c in DType if not dtype_info(c).extension}
    assert max(spec) == 0x33 and not set(EXTENSIONS.values()) & spec
    for alias, name in (("float8_e4m3fn", "f8_e4m3"), ("float8_e8m0fnu", "f8_e8m0"), ("float4_e2m1fn", "f4")):
        assert parse_dtype(alias).name == name
    assert parse_dtype(np.dtype(ml_dtypes.float8_e5m2)).name == "f8_e5m2"
    assert [parse_dtype(n).quantized for n in ("mxfp4", "nvfp4", "f8_e4m3_b128", "f8_e4m3", "f4")] == [
        True, True, True, False, False]


@pytest.mark.parametrize("dtype,shape,nbytes", [
    # the real tensors: gpt-oss-120b's experts, DeepSeek-V3's kv_a_proj (partial edge blocks), an NVFP4 down_proj
    ("mxfp4", (128, 5760, 2880), 128 * 5760 * 90 + 128 * 5760 * 90 * 16),
    ("f8_e4m3_b128", (576, 7168), 1152 + 576 * 7168),
    ("nvfp4", (7168, 18432), 64 + 7168 * 1152 + 7168 * 9216),
    # small ones, where the align64 padding shows
    ("mxfp4", (1, 32), 64 + 16), ("mxfp4", (3, 96), 64 + 144), ("nvfp4", (1, 16), 128 + 8),
    ("f8_e4m3_b128", (1, 1), 64 + 1), ("f8_e4m3_b128", (129, 129), 64 + 129 * 129),
])
def test_payload_sizes(dtype, shape, nbytes):
    assert mcf.quant_layout(dtype, shape).nbytes == nbytes


def test_write_and_read_back(tmp_path):
    rng = np.random.default_rng(0)
    p = tmp_path / "x.mcf"
    f8 = rng.standard_normal((4, 3)).astype(ml_dtypes.float8_e4m3fn)
    payload = rng.integers(0, 255, mcf.quant_layout("mxfp4", (2, 4, 64)).nbytes, dtype=np.uint8)
    with mcf.Writer(p) as w:
        w.add_tensor("f8", f8)
        w.add_tensor("e8m0", np.arange(6, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).reshape(2, 3))
        w.add_tensor_bytes("f4", "f4", (2, 4), np.array([0x21, 0x43, 0xA9, 0xCB], np.uint8))
        w.add_tensor_bytes("odd_rows", "f4", (2, 3), np.array([0x00, 0x70, 0x18], np.uint8))   # codes 0 0 0 7 8 1
        w.add_tensor_bytes("experts", "mxfp4", (2, 4, 64), payload)
        w.add_tensor("plain", np.ones(3, np.float32))
    with mcf.open(p) as c:
        assert {n: (c.info(n).dtype.name, c.info(n).shape) for n in c} == {
            "e8m0": ("f8_e8m0", (2, 3)), "experts": ("mxfp4", (2, 4, 64)), "f4": ("f4", (2, 4)),
            "f8": ("f8_e4m3", (4, 3)), "odd_rows": ("f4", (2, 3)), "plain": ("f32", (3,))}
        assert c.tensor("f8").dtype == f8.dtype and c.tensor("f8").tobytes() == f8.tobytes()
        assert c.info("experts").offset % 64 == 0 and c.header.aligned64
        assert c.to_float32("f4").tolist() == [[0.5, 1.0, 1.5, 2.0], [-0.5, -1.0, -1.5, -2.0]]
        assert c.dequantize("odd_rows", rows=(1, 2)).tolist() == [[6.0, -0.0, 0.5]]   # starts in a byte's high nibble
        out = np.empty((1, 3), ml_dtypes.bfloat16)
        assert c.dequantize("odd_rows", rows=(1, 2), out=out) is out
        assert out.astype(np.float32).tolist() == [[6.0, -0.0, 0.5]]
        assert c.raw("experts").tobytes() == payload.tobytes()
        regions = c.quant_regions("experts")
        assert set(regions) == {"scales", "data"} and regions["scales"].tobytes() == payload[:16].tobytes()
        assert c.tensor("experts").shape == (2, 4, 64) and c.dequantize("experts", rows=(1, 2)).shape == (1, 4, 64)
        assert c.verify() == [] and c.quant_info == []


def test_writer_rules(tmp_path):
    with mcf.Writer(tmp_path / "x.mcf") as w:
        w.add_tensor("keep", np.zeros(1, np.float32))
        with pytest.raises(mcf.InvalidArgumentError, match="no QuantInfo record"):
            w.add_tensor_bytes("m", "mxfp4", (1, 32), np.zeros(80, np.uint8), quant={"min_clip": -1, "max_clip": 1})
        with pytest.raises(mcf.InvalidArgumentError, match="odd number of values"):
            w.add_tensor_bytes("f4", "f4", (3,), np.zeros(2, np.uint8))
        with pytest.raises(mcf.InvalidArgumentError, match="not a multiple of 32"):
            w.add_tensor_bytes("m", "mxfp4", (1, 48), np.zeros(100, np.uint8))
        with pytest.raises(mcf.InvalidArgumentError, match="rank 2"):
            w.add_tensor_bytes("b", "f8_e4m3_b128", (1, 2, 128), np.zeros(400, np.uint8))
        with pytest.raises(mcf.InvalidArgumentError, match="rank 2 or more"):
            w.add_tensor_bytes("n", "nvfp4", (16,), np.zeros(100, np.uint8))
        with pytest.raises(mcf.InvalidArgumentError, match="payload is"):
            w.add_tensor_bytes("n", "nvfp4", (1, 16), np.zeros(100, np.uint8))


def _entry_and_dims(path, name):
    """(file offset of tensor ``name``'s index entry, file offset of its first dim)."""
    with mcf.open(path) as c:
        s = c.section(mcf.SectionType.TENSOR_INDEX)
        i = c.info(name).index
    with open(path, "rb") as f:
        f.seek(s.offset)
        hdr = INDEX_HEADER.unpack(f.read(INDEX_HEADER.size))
        entry = s.offset + hdr[4] + 40 * i
        f.seek(entry + 16)
        (dim_off,) = struct.unpack("<I", f.read(4))
    return entry, s.offset + hdr[5] + 8 * dim_off


def _patch(path, at, fmt, value):
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack(fmt, value))


@pytest.fixture()
def ext_file(tmp_path):
    p = tmp_path / "e.mcf"
    with mcf.Writer(p) as w:
        w.add_tensor_bytes("layers.0.experts", "mxfp4", (2, 64),
                           np.full(mcf.quant_layout("mxfp4", (2, 64)).nbytes, 0x7E, np.uint8))
        w.add_tensor("norm", np.ones(4, np.float32))
    return p


def test_an_unknown_code_is_refused_naming_the_tensor(ext_file):
    """A file with a dtype code nobody knows (0x8fff here, as a future extension is to an older mcf)."""
    entry, _ = _entry_and_dims(ext_file, "layers.0.experts")
    _patch(ext_file, entry + 8, "<I", 0x8FFF)
    with pytest.raises(mcf.FormatError, match=r"unknown dtype of tensor 'layers.0.experts'.*got 36863"):
        mcf.open(ext_file)


def test_a_reader_without_the_extension_table_refuses_them(ext_file):
    """The reader as it stands, with the extension codes taken out of its table (what a reader written before
    them has): the tensor is refused with the unknown-dtype error naming it, never read as something else."""
    code = (f"import mcf.container.tensor_index as ti\n"
            f"ti._EXTENSIONS.clear()\n"
            f"import mcf\n"
            f"try:\n"
            f"    mcf.open({str(ext_file)!r})\n"
            f"except mcf.FormatError as e:\n"
            f"    print(type(e).__name__, e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.startswith("FormatError") and "unknown dtype of tensor 'layers.0.experts'" in out.stdout
    assert "got 32784" in out.stdout   # 0x8010


def test_an_impossible_shape_is_refused_naming_the_tensor(ext_file):
    _, dims = _entry_and_dims(ext_file, "layers.0.experts")
    _patch(ext_file, dims + 8, "<Q", 48)      # 2 x 48: not a whole number of 32-value blocks
    with pytest.raises(mcf.FormatError, match=r"tensor 'layers.0.experts': mxfp4 stores blocks of 32"):
        mcf.open(ext_file)


def test_an_f4_tensor_of_odd_size_is_refused(tmp_path):
    p = tmp_path / "f4.mcf"
    with mcf.Writer(p) as w:
        w.add_tensor_bytes("f4", "f4", (2, 2), np.zeros(2, np.uint8))
    _, dims = _entry_and_dims(p, "f4")
    _patch(p, dims, "<Q", 1)
    _patch(p, dims + 8, "<Q", 3)      # 1 x 3: three values do not fill whole bytes
    with pytest.raises(mcf.FormatError, match=r"data_size of 'f4'.*an even number of values"):
        mcf.open(p)


def test_nan_and_inf_scales(tmp_path):
    """The writer stores any payload; verify() reports NaN and infinite scales, and decoding refuses a NaN one
    naming the file, the tensor and the scale (an E8M0 0xFF, an E4M3 NaN, a float32 NaN)."""
    p = tmp_path / "nan.mcf"
    mx = np.full(mcf.quant_layout("mxfp4", (2, 64)).nbytes, 0x3C, np.uint8)
    mx[3] = 0xFF
    b128 = np.zeros(mcf.quant_layout("f8_e4m3_b128", (2, 200)).nbytes, np.uint8)
    b128[:8] = np.frombuffer(np.array([1.0, np.inf], "<f4").tobytes(), np.uint8)
    with mcf.Writer(p) as w:
        w.add_tensor_bytes("mx", "mxfp4", (2, 64), mx)
        w.add_tensor_bytes("b128", "f8_e4m3_b128", (2, 200), b128)
    with mcf.open(p) as c:
        problems = c.verify()
        assert any("'mx': scales[3] is NaN (0xff)" in s for s in problems)
        assert any("'b128': 1 of 2 scales infinite" in s for s in problems)
        with pytest.raises(mcf.FormatError, match=r"nan.mcf: tensor 'mx' scales\[3\].*NaN block scale"):
            c.dequantize("mx")
        assert c.dequantize("mx", rows=(0, 1)).shape == (1, 64)     # row 0's scales are numbers
    with pytest.raises(mcf.FormatError, match=r"tensor 'mx' scales\[3\]"):
        mcf.load_file(p, names=["mx"])


def test_mcf_info_lists_them(ext_file, capsys):
    from mcf.cli import main

    assert main(["info", str(ext_file)]) in (0, None)
    assert "mxfp4" in capsys.readouterr().out
