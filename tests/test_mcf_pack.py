"""Packing checkpoints: byte identity with the Go packer, casts, alignment, dedup, shards, and agreement
with the safetensors library."""

import json
import os
import shutil

import numpy as np
import pytest

import mcf
from _vectors import MANTLE_MODEL, mantle_file
from mcf._core.gojson import go_marshal
from mcf.cli import main as cli_main
from mcf.conversion.pack import pack

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package is a test extra")


def read(p):
    with open(p, "rb") as f:
        return f.read()


@pytest.mark.parametrize("cast,ref", [("keep", "f32"), ("f16", "f16")])
def test_pack_is_byte_identical_to_go_packer(tmp_path, cast, ref):
    out = tmp_path / f"{ref}.mcf"
    pack(MANTLE_MODEL, out, cast=cast)
    assert read(out) == read(mantle_file(ref))


@pytest.mark.parametrize("cast,ref", [("keep", "f32"), ("f16", "f16")])
def test_cli_pack_is_byte_identical(tmp_path, cast, ref, capsys):
    out = tmp_path / "o.mcf"
    assert cli_main(["pack", MANTLE_MODEL, "-o", str(out), "--cast", cast, "-q"]) == 0
    assert read(out) == read(mantle_file(ref))


def test_model_dir_with_trailing_slash_keeps_its_name(tmp_path):
    out = tmp_path / "o.mcf"
    pack(MANTLE_MODEL + os.sep, out)
    assert read(out) == read(mantle_file("f32"))


def test_pack_agrees_with_safetensors_library(tmp_path):
    ref = safetensors_numpy.load_file(os.path.join(MANTLE_MODEL, "model.safetensors"))
    out = tmp_path / "o.mcf"
    pack(MANTLE_MODEL, out)
    with mcf.open(out) as c:
        assert sorted(c) == sorted(ref)
        for name, arr in ref.items():
            got = c.tensor(name)
            assert got.dtype == arr.dtype and got.shape == arr.shape
            assert got.tobytes() == arr.tobytes()


def test_bf16_cast_rounds_to_nearest_even(tmp_path):
    out = tmp_path / "bf16.mcf"
    pack(MANTLE_MODEL, out, cast="bf16")
    ref = safetensors_numpy.load_file(os.path.join(MANTLE_MODEL, "model.safetensors"))
    with mcf.open(out) as c:
        for name, arr in ref.items():
            assert c.info(name).dtype.code == mcf.DType.BF16
            u = arr.astype(np.float32).view(np.uint32).astype(np.uint64)
            # uint64 constants: with numpy 1.x's value-based casting a 0-d uint64 and a Python int make an
            # int64/float64 mix that right_shift refuses (the oldest-numpy CI leg)
            one, half, shift = np.uint64(1), np.uint64(0x7FFF), np.uint64(16)
            want = ((u + half + ((u >> shift) & one)) >> shift).astype(np.uint16)
            nan = np.isnan(arr)
            raw = c.raw(name).view(np.uint16).reshape(arr.shape)
            assert np.array_equal(raw[~nan], want[~nan]), name
            assert np.isnan(c.to_float32(name)[nan]).all()
            back = c.to_float32(name)
            assert np.array_equal(back[~nan], (want[~nan].astype(np.uint32) << 16).view(np.float32))


def test_bf16_tensor_is_ml_dtypes_when_installed(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="optional bfloat16 dtype")
    out = tmp_path / "bf16.mcf"
    pack(MANTLE_MODEL, out, cast="bf16")
    with mcf.open(out) as c:
        a = c.tensor("a.small")
        assert a.dtype == np.dtype(ml_dtypes.bfloat16)
        assert np.array_equal(a.astype(np.float32), c.to_float32("a.small"))


def test_align_1_packs_tensors_back_to_back(tmp_path):
    out = tmp_path / "a1.mcf"
    pack(MANTLE_MODEL, out, align=1)
    with mcf.open(out) as c, mcf.open(mantle_file("f32")) as ref:
        assert c.header.flags == 0
        infos = sorted(c.index.values(), key=lambda t: t.offset)
        for a, b in zip(infos, infos[1:]):
            assert b.offset == a.offset + a.nbytes
        for n in ref:
            assert c.tensor(n).tobytes() == ref.tensor(n).tobytes()


def test_dedup_shares_identical_tensors(tmp_path):
    out = tmp_path / "d.mcf"
    pack(MANTLE_MODEL, out, dedup=True)
    with mcf.open(out) as c, mcf.open(mantle_file("f32")) as ref:
        assert c.info("m.dup_of_a").offset == c.info("a.small").offset
        assert c.header.file_size < ref.header.file_size
        for n in ref:
            assert c.tensor(n).tobytes() == ref.tensor(n).tobytes()
        assert c.verify() == []


def test_no_resources(tmp_path):
    out = tmp_path / "n.mcf"
    pack(MANTLE_MODEL, out, resources=False)
    with mcf.open(out) as c:
        assert c.resources == {}
        assert c.model_info.model_name == "mcf-testmodel"
        assert [s.name for s in c.sections] == ["ModelInfo", "TensorIndex", "TensorData"]


def test_sharded_checkpoint_equals_single(tmp_path):
    ref = safetensors_numpy.load_file(os.path.join(MANTLE_MODEL, "model.safetensors"))
    d = tmp_path / "mcf-testmodel"
    d.mkdir()
    for f in os.listdir(MANTLE_MODEL):
        if f != "model.safetensors":
            shutil.copy(os.path.join(MANTLE_MODEL, f), d / f)
    names = sorted(ref)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    wm = {}
    for fname, ns in shards.items():
        safetensors_numpy.save_file({n: ref[n] for n in ns}, str(d / fname))
        wm.update({n: fname for n in ns})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    out = tmp_path / "s.mcf"
    pack(d, out)
    assert read(out) == read(mantle_file("f32"))


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(mcf.MissingFileError):
        pack(tmp_path, tmp_path / "o.mcf")
    assert not (tmp_path / "o.mcf").exists()


def test_bad_safetensors_header_is_a_format_error(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(mcf.FormatError, match="model.safetensors"):
        pack(d, tmp_path / "o.mcf")
    (d / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(mcf.FormatError, match="header_len"):
        pack(d, tmp_path / "o.mcf")
    hdr = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    (d / "model.safetensors").write_bytes(len(hdr).to_bytes(8, "little") + hdr + b"\0" * 12)
    with pytest.raises(mcf.FormatError, match="does not match"):
        pack(d, tmp_path / "o.mcf")
    assert not (tmp_path / "o.mcf").exists()


@pytest.mark.parametrize("value,want", [
    ({"b": 1, "a": [1.5, 4096, 1e21, 1e-7, -0.0, True, None]}, b'{"a":[1.5,4096,1e+21,1e-7,-0,true,null],"b":1}'),
    ({"t": "<s>&\u2028\n\t\x01é"}, '{"t":"\\u003cs\\u003e\\u0026\\u2028\\n\\t\\u0001é"}'.encode()),
    ({"x": 1e20, "y": 0.000001, "z": 123456789012345678901},
     b'{"x":100000000000000000000,"y":0.000001,"z":123456789012345680000}'),
])
def test_go_json_encoding(value, want):
    assert go_marshal(value) == want
