"""The files written by the Go reference (samcharles93/mantle) read exactly as its own reader reports."""

import hashlib
import io
import os
import struct

import numpy as np
import pytest

import mcf
from _vectors import MANTLE, MANTLE_NAMES, mantle_check, mantle_file, mantle_manifest

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

MODES = ["mmap", "pread", "fileobj", "memory"]


def open_mode(path, mode):
    if mode == "mmap":
        return mcf.open(path)
    if mode == "pread":
        return mcf.open(path, mmap=False)
    if mode == "fileobj":
        f = open(path, "rb")  # noqa: SIM115
        c = mcf.open(f)
        _open_files.append(f)
        return c
    with open(path, "rb") as f:
        return mcf.open(memoryview(f.read()))


def sha(b) -> str:
    return hashlib.sha256(bytes(b)).hexdigest()


_open_files = []


@pytest.fixture(params=MODES)
def mode(request):
    yield request.param
    while _open_files:
        _open_files.pop().close()


@pytest.mark.parametrize("name", MANTLE_NAMES)
def test_header_and_sections_match_go_report(name, mode):
    chk = mantle_check(name)
    with open_mode(mantle_file(name), mode) as c:
        h = c.header
        assert h.magic.hex() == chk["header"]["magic_hex"]
        for k in ("major", "minor", "header_size", "section_count", "section_dir_offset", "file_size", "flags"):
            assert getattr(h, k) == chk["header"][k], k
        got = {(s.type, s.version, s.offset, s.size) for s in c.sections}
        want = {(s["type"], s["version"], s["offset"], s["size"]) for s in chk["sections"]}
        assert got == want
        for s in chk["sections"]:
            assert sha(c.section_bytes(s["type"])) == s["sha256"]
            assert c.section(s["type"]).name == s["type_name"]
        assert c.index.flags == chk["tensor_index_flags"]


@pytest.mark.parametrize("name", MANTLE_NAMES)
def test_tensor_metadata_matches_go_report(name, mode):
    chk = mantle_check(name)
    with open_mode(mantle_file(name), mode) as c:
        assert list(c) == [t["name"] for t in chk["tensors"]]
        for t in chk["tensors"]:
            info = c.info(t["name"])
            assert info.index == t["index"]
            assert info.dtype.code == t["dtype"]
            assert info.dtype.name.upper() == t["dtype_name"]
            assert list(info.shape) == t["shape"]
            assert info.offset == t["data_off"]
            assert info.nbytes == t["data_size"]
            assert sha(c.raw(t["name"])) == t["raw_sha256"]


@pytest.mark.parametrize("name", MANTLE_NAMES)
def test_plain_tensors_equal_source_values_bit_for_bit(name, mode):
    manifest = next(f for f in mantle_manifest()["files"] if f["file"] == f"files/{name}.mcf")
    with open_mode(mantle_file(name), mode) as c:
        for t in manifest["tensors"]:
            info = c.info(t["name"])
            if info.quantized:
                continue
            with open(os.path.join(MANTLE, t["deq"]), "rb") as f:
                deq = np.frombuffer(f.read(), dtype="<f4").reshape(t["shape"])
            got = c.to_float32(t["name"])
            assert got.shape == deq.shape
            assert got.tobytes() == deq.tobytes(), t["name"]
            if info.dtype.code == mcf.DType.F32:
                with open(os.path.join(MANTLE, t["src"]), "rb") as f:
                    src = f.read()
                assert c.tensor(t["name"]).tobytes() == src


@pytest.mark.parametrize("name", ["q4", "k4", "k3"])
def test_quantized_regions_follow_the_spec_formula(name, mode):
    chk = mantle_check(name)
    with open_mode(mantle_file(name), mode) as c:
        n_quant = 0
        for t in chk["tensors"]:
            info = c.info(t["name"])
            if not info.quantized:
                continue
            n_quant += 1
            rows, cols = info.shape
            bits = info.dtype.bits
            bpr = -(-cols // 32)
            spr = -(-bpr // 8)
            tb, ts = rows * bpr, rows * spr
            a64 = lambda x: (x + 63) // 64 * 64  # noqa: E731
            if info.dtype.family == "block":
                want = a64(2 * tb) + tb * 32 * bits // 8
            else:
                want = a64(a64(2 * ts) + tb) + tb * 32 * bits // 8
            assert info.nbytes == want == t["data_size"]
            regions = c.quant_regions(t["name"])
            assert regions["data"].nbytes == tb * 32 * bits // 8
            if info.dtype.family == "super":
                assert regions["super_scales"].shape == (ts,)
                assert regions["super_scales"].dtype == np.dtype("<f2")
                assert regions["sub_scales"].shape == (tb,)
                assert int(regions["sub_scales"].max()) <= 63
            else:
                assert regions["scales"].shape == (tb,)
            deq = np.fromfile(os.path.join(MANTLE, "deq", name, t["name"] + ".deq.f32"), dtype="<f4")
            assert c.tensor(t["name"]).tobytes() == deq.tobytes()  # the Go decoder's values, bit for bit
        assert n_quant == 11


@pytest.mark.parametrize("name", ["q4", "k4", "k3"])
def test_quant_records_match_go_report(name):
    chk = mantle_check(name)
    with mcf.open(mantle_file(name)) as c:
        recs = c.quant_info
        assert len(recs) == len(chk["quant_records"])
        for r, w in zip(recs, chk["quant_records"]):
            assert r.tensor_index == w["tensor_index"]
            assert r.name == w["tensor_name"]
            assert (r.method, r.domain, r.block_size, r.super_size) == (
                w["method"], w["domain"], w["block_size"], w["super_size"])
            assert struct.pack("<f", r.min_clip) == struct.pack("<I", int(w["min_clip_bits"], 16))
            assert struct.pack("<f", r.max_clip) == struct.pack("<I", int(w["max_clip_bits"], 16))
            assert c.quant_record(r.name) == r


@pytest.mark.parametrize(
    "method,shape,size",
    [("q8", (4096, 4096), 17_825_792), ("q4", (4096, 4096), 9_437_184), ("k6", (4096, 4096), 13_238_272),
     ("k4", (4096, 4096), 9_043_968), ("k3", (4096, 4096), 6_946_816), ("k2", (4096, 4096), 4_849_664),
     ("k3", (2, 40), 176), ("q4", (2, 40), 128), ("k6", (3, 300), 848), ("k2", (1, 1), 136)],
)
def test_quant_layout_size_vectors(method, shape, size):
    assert mcf.quant_layout(method, shape).nbytes == size


def test_model_info_and_resources():
    with mcf.open(mantle_file("q4")) as c:
        mi = c.model_info
        assert mi.model_name == "mcf-testmodel"
        assert mi.arch == mcf.Arch.LLAMA
        assert (mi.vocab_size, mi.hidden_size, mi.layer_count, mi.head_count, mi.head_count_kv,
                mi.context_length) == (11, 63, 2, 7, 1, 4096)
        assert mi.rope_freq_base == 500000.0
        assert mi.extras == {"hf.config_json_present": 1, "hf.model_type": "llama", "hf.rope_scaling": "present"}
        assert c.resource_json("config.json")["model_type"] == "llama"
        assert c.resource_json("tokenizer_config.json")["chat_template"].startswith("{% for m in messages %}")
        assert c.resource_text("merges.txt") == "#version: 0.2\nh é\n"
        assert set(c.resources) == {"config.json", "generation_config.json", "tokenizer.json", "vocab.json",
                                    "tokenizer_config.json", "merges.txt"}
        # decoding then encoding ModelInfo gives the Go bytes back
        assert mi.to_bytes() == c.section_bytes(mcf.SectionType.MODEL_INFO)


@pytest.mark.parametrize("name", MANTLE_NAMES)
def test_verify_is_clean(name):
    with mcf.open(mantle_file(name)) as c:
        assert c.verify() == []


def test_fileobj_source_through_bytesio():
    with open(mantle_file("f32"), "rb") as f:
        data = f.read()
    with mcf.open(io.BytesIO(data)) as c, mcf.open(mantle_file("f32")) as ref:
        assert c.tensor("a.small").tobytes() == ref.tensor("a.small").tobytes()
