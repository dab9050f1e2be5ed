"""Conversion into MCF: the same bytes as pack without a method, the Go quantizer's bytes with
compat, quantize_file's rules, real checkpoints, GGUF dispatch, bad inputs refused before any output,
the CLI, the documented examples, and peak memory on a ~1 GB checkpoint."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

import mcf
from _vectors import MANTLE_MODEL, mantle_file
from mcf.cli import main as cli_main
from mcf.conversion.checkpoint import convert
from mcf.conversion.export import export
from mcf.conversion.quant_policy import quantize_file

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

stnp = pytest.importorskip("safetensors.numpy", reason="the safetensors package is a test extra")
ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays for the safetensors package")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF_GOLDEN = os.path.join(ROOT, "tests", "fixtures", "gguf", "golden_v3.gguf")


def rng_for(text):
    return np.random.default_rng(zlib.crc32(text.encode()))


def tensors_of(path):
    """name -> (dtype name, shape, payload bytes, quant record fields) of an MCF file."""
    with mcf.open(path) as c:
        out = {}
        for n in c:
            t = c.info(n)
            r = c.quant_record(n)
            out[n] = (t.dtype.name, t.shape, c.raw(n).tobytes(),
                      None if r is None else (r.method, r.domain, r.min_clip, r.max_clip))
        return out


def write_safetensors(path, header, data=b""):
    """A safetensors file from a raw header dict (for malformed inputs the package would refuse)."""
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


# -- the same code path as pack -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["keep", "f16", "bf16"])
def test_without_method_convert_is_pack(tmp_path, dtype):
    convert(MANTLE_MODEL, tmp_path / "c.mcf", dtype=dtype)
    mcf.pack(MANTLE_MODEL, tmp_path / "p.mcf", cast=dtype)
    assert (tmp_path / "c.mcf").read_bytes() == (tmp_path / "p.mcf").read_bytes()
    if dtype == "keep":
        with open(mantle_file("f32"), "rb") as f:
            assert (tmp_path / "c.mcf").read_bytes() == f.read()
    convert(MANTLE_MODEL, tmp_path / "n.mcf", dtype=dtype, mmap=False)
    assert (tmp_path / "n.mcf").read_bytes() == (tmp_path / "p.mcf").read_bytes()


def test_minilm_converts_exports_and_loads_back(tmp_path, minilm_dir):
    convert(minilm_dir, tmp_path / "m.mcf")
    mcf.pack(minilm_dir, tmp_path / "p.mcf")
    assert (tmp_path / "m.mcf").read_bytes() == (tmp_path / "p.mcf").read_bytes()
    export(tmp_path / "m.mcf", tmp_path / "out")
    ref = stnp.load_file(os.path.join(minilm_dir, "model.safetensors"))
    got = stnp.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape
        assert got[k].tobytes() == ref[k].tobytes(), k
    for fname in ("config.json", "tokenizer.json"):
        with open(os.path.join(minilm_dir, fname), "rb") as f:
            assert (tmp_path / "out" / fname).read_bytes() == f.read(), fname
    with mcf.open(tmp_path / "m.mcf") as c:
        assert c.model_info.hidden_size == 384


@pytest.mark.parametrize("command", ["convert", "pack"])
def test_cli_names_the_files_it_leaves_out(tmp_path, minilm_dir, capsys, command):
    """mcf convert and mcf pack (which used to say nothing) name every file of the checkpoint the MCF
    file does not hold, directories with a slash, and say how to keep them."""
    out = str(tmp_path / "m.mcf")
    assert cli_main([command, minilm_dir, "-o", out, "-q"]) == 0
    lines = capsys.readouterr().out.splitlines()
    k = next(i for i, x in enumerate(lines) if x.startswith("not stored (MCF has no section for them): "))
    left = lines[k].split(": ", 1)[1].split(", ")
    assert "vocab.txt" in left and "special_tokens_map.json" in left and "1_Pooling/" in left
    with mcf.open(out) as c:
        stored = set(c.resources)
    want = {n + "/" * os.path.isdir(os.path.join(minilm_dir, n)) for n in os.listdir(minilm_dir)
            if not n.startswith(".") and n != "model.safetensors"} - stored
    assert set(left) == want
    assert lines[k + 1] == ("  besides the weights MCF holds only config.json, generation_config.json, tokenizer.json, "
                            f"vocab.json, tokenizer_config.json and merges.txt: keep the others beside {out}, and copy "
                            "them next to what mcf export writes")
    assert stored <= {"config.json", "generation_config.json", "tokenizer.json", "vocab.json",
                      "tokenizer_config.json", "merges.txt"}


def test_minilm_k4_round_trip_through_safetensors(tmp_path, minilm_dir):
    stats = convert(minilm_dir, tmp_path / "k4.mcf", method="k4", overrides=["*embeddings*=q8"], report=True)
    assert stats and all(s.snr_db > 10 for s in stats)
    assert {s.method for s in stats} == {"k4", "q8"}
    export(tmp_path / "k4.mcf", tmp_path / "out", dtype="f32")
    got = stnp.load_file(str(tmp_path / "out" / "model.safetensors"))
    with mcf.open(tmp_path / "k4.mcf") as c:
        for n in c:
            want = c.dequantize(n) if c.info(n).dtype.quantized else np.asarray(c.tensor(n))
            assert got[n].tobytes() == want.tobytes(), n


# -- quantization rules ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["q4", "k4", "k3"])
def test_compat_convert_reproduces_go_quantizer_tensors(tmp_path, method):
    convert(MANTLE_MODEL, tmp_path / "q.mcf", method=method, compat=True)
    assert tensors_of(tmp_path / "q.mcf") == tensors_of(mantle_file(method))


@pytest.mark.parametrize("method", ["q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"])
def test_convert_follows_quantize_file(tmp_path, method):
    ov = ["a.*=none", "c.*=q8"]
    convert(MANTLE_MODEL, tmp_path / "c.mcf", method=method, overrides=ov)
    mcf.pack(MANTLE_MODEL, tmp_path / "p.mcf")
    quantize_file(tmp_path / "p.mcf", tmp_path / "q.mcf", method, overrides=ov)
    got, want = tensors_of(tmp_path / "c.mcf"), tensors_of(tmp_path / "q.mcf")
    assert got == want
    assert got["a.small"][0] == "f32" and got["c.odd"][0] == "q8"


def test_float_sources_of_every_width_quantize_like_their_float32_values(tmp_path):
    rng = rng_for("widths")
    x = (rng.standard_normal((8, 512)) * 0.05).astype(np.float32)
    src = {"w16": x.astype(np.float16), "wbf": x.astype(ml_dtypes.bfloat16), "w64": x.astype(np.float64),
           "w32": x, "bias": x[0], "ints": rng.integers(0, 9, (8, 512), dtype=np.int32)}
    stnp.save_file(src, str(tmp_path / "in.safetensors"))
    convert(tmp_path / "in.safetensors", tmp_path / "o.mcf", method="k4")
    with mcf.open(tmp_path / "o.mcf") as c:
        assert c.model_info.model_name == "in"
        for n in ("w16", "wbf", "w64", "w32"):
            assert c.info(n).dtype.name == "k4"
            payload, _ = mcf.quantize(src[n].astype(np.float32), "k4")
            assert c.raw(n).tobytes() == payload.tobytes(), n
        assert c.info("bias").dtype.name == "f32" and c.info("ints").dtype.name == "i32"
        assert c.tensor("ints").tobytes() == src["ints"].tobytes()


def test_bf16_checkpoints_stay_bf16(tmp_path):
    """(pack used to store BF16 safetensors tensors as U16.)"""
    x = rng_for("bf16").standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
    d = tmp_path / "ck"
    d.mkdir()
    stnp.save_file({"w": x}, str(d / "model.safetensors"))
    for out, kw in (("a.mcf", {}), ("b.mcf", {"dtype": "f32"})):
        convert(d, tmp_path / out, **kw)
    mcf.pack(d, tmp_path / "p.mcf")
    with mcf.open(tmp_path / "a.mcf") as a, mcf.open(tmp_path / "b.mcf") as b, mcf.open(tmp_path / "p.mcf") as p:
        assert a.info("w").dtype.name == "bf16" and p.info("w").dtype.name == "bf16"
        assert a.raw("w").tobytes() == x.tobytes()
        assert b.tensor("w").tobytes() == x.astype(np.float32).tobytes()


def test_sharded_checkpoint_converts_like_the_single_file(tmp_path):
    ref = stnp.load_file(os.path.join(MANTLE_MODEL, "model.safetensors"))
    d = tmp_path / "mcf-testmodel"
    d.mkdir()
    for f in os.listdir(MANTLE_MODEL):
        if f != "model.safetensors":
            shutil.copy(os.path.join(MANTLE_MODEL, f), d / f)
    names = sorted(ref)
    wm = {}
    for k, part in enumerate((names[::3], names[1::3], names[2::3])):
        fname = f"model-0000{k + 1}-of-00003.safetensors"
        stnp.save_file({n: ref[n] for n in part}, str(d / fname))
        wm.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    convert(d, tmp_path / "s.mcf", method="k4")
    convert(MANTLE_MODEL, tmp_path / "one.mcf", method="k4")
    assert (tmp_path / "s.mcf").read_bytes() == (tmp_path / "one.mcf").read_bytes()


def test_hugging_face_cache_layout_with_symlinks(tmp_path):
    """A hub cache snapshot is a directory of symlinks into blobs/: followed like files."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "0123abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for k, f in enumerate(sorted(os.listdir(MANTLE_MODEL))):
        shutil.copy(os.path.join(MANTLE_MODEL, f), blobs / f"blob{k}")
        os.symlink(os.path.relpath(blobs / f"blob{k}", snap), snap / f)
    convert(snap, tmp_path / "s.mcf")
    convert(MANTLE_MODEL, tmp_path / "ref.mcf")
    assert tensors_of(tmp_path / "s.mcf") == tensors_of(tmp_path / "ref.mcf")
    with mcf.open(tmp_path / "s.mcf") as a, mcf.open(tmp_path / "ref.mcf") as b:
        assert a.resources == b.resources


# -- GGUF -----------------------------------------------------------------------------------------
def test_gguf_files_go_to_convert_gguf(tmp_path):
    pytest.importorskip("gguf", reason="mcf.gguf's tests need gguf-py; the dispatch itself does not")
    from mcf.conversion.gguf import convert_gguf

    convert_gguf(GGUF_GOLDEN, tmp_path / "direct.mcf", method="k4")
    convert(GGUF_GOLDEN, tmp_path / "a.mcf", method="k4")
    shutil.copy(GGUF_GOLDEN, tmp_path / "no_extension")
    convert(tmp_path / "no_extension", tmp_path / "b.mcf", method="k4")
    want = (tmp_path / "direct.mcf").read_bytes()
    assert (tmp_path / "a.mcf").read_bytes() == want and (tmp_path / "b.mcf").read_bytes() == want
    stats = convert(GGUF_GOLDEN, tmp_path / "c.mcf", report=True)
    assert stats and all(hasattr(s, "ggml_type") for s in stats)


def test_cli_convert_gguf_reports_how_each_tensor_was_stored(tmp_path, capsys):
    pytest.importorskip("gguf", reason="mcf.gguf's tests need gguf-py; the dispatch itself does not")
    from mcf.conversion.gguf import convert_gguf

    assert cli_main(["convert", GGUF_GOLDEN, "-o", str(tmp_path / "n.mcf"), "--method", "native", "--report",
                     "-q"]) == 0
    out = capsys.readouterr().out
    stats = convert_gguf(GGUF_GOLDEN, tmp_path / "direct.mcf", method="native")
    assert (tmp_path / "n.mcf").read_bytes() == (tmp_path / "direct.mcf").read_bytes()
    for s in stats:
        assert re.search(rf"{re.escape(s.name)}\s+{s.ggml_type}\s+->\s+{s.stored_as}\s+{s.how}", out), s.name
    assert cli_main(["convert", MANTLE_MODEL, "-o", str(tmp_path / "x.mcf"), "--method", "native"]) == 1
    assert "unknown method" in capsys.readouterr().err


# -- bad input ------------------------------------------------------------------------------------
def _bad_files(d):
    """name -> (writer of a broken checkpoint under d, expected exception, message pattern)."""
    ok = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()

    def st_file(header, data):
        return lambda: write_safetensors(d / "model.safetensors", header, data)

    def raw_file(blob):
        return lambda: (d / "model.safetensors").write_bytes(blob)

    def index(wm, shards=("s1",), index_text=None):
        def make():
            for s in shards:
                write_safetensors(d / f"{s}.safetensors", {f"t_{s}": {"dtype": "F32", "shape": [1],
                                                                       "data_offsets": [0, 4]}}, b"\0" * 4)
            (d / "model.safetensors.index.json").write_text(index_text or json.dumps({"weight_map": wm}))
        return make

    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    return {
        "empty": (raw_file(b""), mcf.TruncatedError, "header"),
        "truncated header": (raw_file(struct.pack("<Q", len(ok)) + ok[:-3]), mcf.FormatError, "header"),
        "huge header length": (raw_file(struct.pack("<Q", 2**62) + b"{}"), mcf.FormatError, "header_len"),
        "not json": (raw_file(struct.pack("<Q", 8) + b"{nope}  "), mcf.FormatError, "JSON"),
        "truncated data": (st_file({"w": f32}, b"\0" * 5), mcf.TruncatedError, "outside the file"),
        "out of range": (st_file({"w": {**f32, "data_offsets": [8, 16]}}, b"\0" * 8), mcf.TruncatedError,
                         "outside the file"),
        "overlap": (st_file({"w": f32, "v": {**f32, "data_offsets": [4, 12]}}, b"\0" * 12), mcf.FormatError,
                    "overlap"),
        "size mismatch": (st_file({"w": {**f32, "shape": [3]}}, b"\0" * 8), mcf.FormatError, "does not match"),
        "bool dtype": (st_file({"w": {"dtype": "BOOL", "shape": [1], "data_offsets": [0, 1]}}, b"\1"),
                       mcf.FormatError, "unsupported dtype"),
        # (FP8 and F4 are stored as mcf's extension dtypes: tests/test_scaled_checkpoints.py)
        "f6 dtype": (st_file({"w": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}, b"\1\2\3"),
                     mcf.FormatError, "unsupported dtype"),
        "negative dim": (st_file({"w": {**f32, "shape": [-2]}}, b"\0" * 8), mcf.FormatError, "non-negative"),
        "rank 17": (st_file({"w": {"dtype": "F32", "shape": [1] * 17, "data_offsets": [0, 4]}}, b"\0" * 4),
                    mcf.FormatError, "too many dimensions"),
        "empty but huge": (st_file({"w": {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [0, 0]}}, b""),
                           mcf.FormatError, "too large"),
        "past u64": (st_file({"w": {"dtype": "U8", "shape": [2**64, 0], "data_offsets": [0, 0]}}, b""),
                     mcf.FormatError, "too large"),
        "absurd shape": (st_file({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 2**82]}},
                                 b"\0" * 8), mcf.TruncatedError, "outside the file"),
        "index escapes": (index({"t_s1": "../s1.safetensors"}), mcf.FormatError, "plain file names"),
        "index absolute": (index({"t_s1": "/etc/passwd"}), mcf.FormatError, "plain file names"),
        "index missing shard": (index({"t_s1": "s1.safetensors", "x": "s9.safetensors"}), mcf.MissingFileError,
                                "s9.safetensors"),
        "index not an object": (index(None, index_text="[1, 2]"), mcf.FormatError, "weight_map"),
        "index map is a list": (index(None, index_text='{"weight_map": ["s1.safetensors"]}'), mcf.FormatError,
                                "weight_map"),
        "index not json": (index(None, index_text="{oops"), mcf.FormatError, "JSON"),
        "index lists a tensor no shard has": (index({"t_s1": "s1.safetensors", "ghost": "s1.safetensors"}),
                                              mcf.FormatError, "ghost"),
        "index omits a tensor": (lambda: (
            write_safetensors(d / "a.safetensors", {"w": f32, "hidden": {**f32, "data_offsets": [8, 16]}},
                              b"\0" * 16),
            (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a.safetensors"}}))),
            mcf.FormatError, "'hidden' of a.safetensors is not in the index"),
        "duplicate across shards": (lambda: (
            write_safetensors(d / "a.safetensors", {"w": f32}, b"\0" * 8),
            write_safetensors(d / "b.safetensors", {"w": f32}, b"\0" * 8),
            (d / "model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}))),
            mcf.FormatError, "two shards"),
        "bad raw description": (st_file({"__metadata__": {"mcf.quant.w": '{"method": "k4", "shape": [1, 256]}'},
                                         "w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, b"\0" * 8),
                                mcf.FormatError,
                                f"needs a U8 tensor of {mcf.quant_layout('k4', (1, 256)).nbytes} bytes"),
        "raw description not json": (st_file({"__metadata__": {"mcf.quant.w": "{"},
                                              "w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}},
                                             b"\0" * 8), mcf.FormatError, "description"),
        "no checkpoint": (lambda: None, mcf.MissingFileError, "no model.safetensors"),
    }


BAD = sorted(_bad_files(None))


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoints_are_refused_before_any_output(tmp_path, case):
    d = tmp_path / "ck"
    d.mkdir()
    make, exc, pattern = _bad_files(d)[case]
    make()
    out = tmp_path / "o.mcf"
    for kw in ({}, {"method": "k4"}, {"mmap": False}):
        with pytest.raises(exc, match=re.escape(pattern)):
            convert(d, out, **kw)
        assert sorted(os.listdir(tmp_path)) == ["ck"], case


def test_bad_arguments_fail_before_reading(tmp_path):
    for kw, pattern in (({"method": "k5"}, "method"), ({"overrides": ["x"]}, "PATTERN=METHOD"),
                        ({"overrides": ["x=z9"]}, "unknown method"), ({"dtype": "k4"}, "dtype")):
        with pytest.raises(mcf.InvalidArgumentError, match=pattern):
            convert(MANTLE_MODEL, tmp_path / "o.mcf", **kw)
    assert os.listdir(tmp_path) == []


# -- CLI ------------------------------------------------------------------------------------------
def test_cli_convert(tmp_path, capsys):
    out = tmp_path / "q.mcf"
    assert cli_main(["convert", MANTLE_MODEL, "-o", str(out), "--method", "k4", "--compat", "mantle",
                     "--override", "a.*=none", "--report", "-q"]) == 0
    text = capsys.readouterr().out
    assert "wrote" in text and "RMSE" in text and "b.mid" in text and "a.small" not in text.split("RMSE")[1]
    ref = tensors_of(mantle_file("k4"))
    got = tensors_of(out)
    assert got["a.small"][0] == "f32"
    assert {n: v for n, v in got.items() if n != "a.small"} == {n: v for n, v in ref.items() if n != "a.small"}
    assert cli_main(["convert", MANTLE_MODEL, "-o", str(tmp_path / "h.mcf"), "--dtype", "f16", "-q"]) == 0
    with open(mantle_file("f16"), "rb") as f:
        assert (tmp_path / "h.mcf").read_bytes() == f.read()
    assert cli_main(["convert", str(tmp_path / "missing"), "-o", str(tmp_path / "x.mcf")]) == 1
    assert "mcf convert: error" in capsys.readouterr().err


def test_cli_round_trip_in_a_subprocess(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = [sys.executable, "-m", "mcf.cli"]
    r = subprocess.run(run + ["convert", MANTLE_MODEL, "-o", str(tmp_path / "m.mcf")], capture_output=True,
                       text=True, env=env, check=False)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(run + ["export", str(tmp_path / "m.mcf"), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, check=False)
    assert r.returncode == 0, r.stderr
    ref = stnp.load_file(os.path.join(MANTLE_MODEL, "model.safetensors"))
    got = stnp.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(got[k].tobytes() == ref[k].tobytes() for k in ref) and sorted(got) == sorted(ref)


# -- memory ---------------------------------------------------------------------------------------
RSS_SCRIPT = textwrap.dedent("""
    import json, sys

    def hwm():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM")

    import numpy as np
    import mcf
    from mcf.conversion.checkpoint import convert
    from mcf.conversion.export import export

    src, dst, what = sys.argv[1:4]
    base = hwm()
    if what == "export":
        export(src, dst, dtype="f32")
    else:
        convert(src, dst, method=None if what == "float" else what)
    print(json.dumps({"base": base, "peak": hwm()}))
""")


def _write_big_checkpoint(path, total_bytes):
    """A ~total_bytes F32 checkpoint of 2048-wide matrices (largest 32 MiB) and a norm, non-zero data:
    one random block, scaled per tensor."""
    block = (rng_for("rss").standard_normal(1 << 22) * 0.02).astype(np.float32)
    shapes, n, i = [], 0, 0
    while n < total_bytes:
        rows = 4096 if i % 3 == 0 else 2048
        shapes.append((f"model.layers.{i}.weight", (rows, 2048)))
        n += rows * 2048 * 4
        i += 1
    shapes.append(("model.norm.weight", (2048,)))
    hdr, off = {}, 0
    for name, s in shapes:
        nb = int(np.prod(s)) * 4
        hdr[name] = {"dtype": "F32", "shape": list(s), "data_offsets": [off, off + nb]}
        off += nb
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for k, (_name, s) in enumerate(shapes):
            left = int(np.prod(s))
            while left:
                m = min(left, block.size)
                f.write((block[:m] * np.float32(1 + 0.01 * k)).tobytes())
                left -= m
    return off


@pytest.mark.slow
def test_peak_memory_of_a_1gb_conversion(tmp_path):
    """Peak RSS (VmHWM, which counts the input's mapped pages) stays under 300 MB above the baseline
    of the same process, converting a ~1 GB checkpoint to float and to k4, and exporting it back."""
    src = tmp_path / "big.safetensors"
    payload = _write_big_checkpoint(src, 1 << 30)
    assert payload >= 1 << 30
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = {}
    for what, inp, out in (("float", src, tmp_path / "f.mcf"), ("k4", src, tmp_path / "k4.mcf"),
                           ("export", tmp_path / "k4.mcf", tmp_path / "back.safetensors")):
        r = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(inp), str(out), what], capture_output=True,
                           text=True, env=env, check=False)
        assert r.returncode == 0, r.stderr
        results[what] = json.loads(r.stdout)
        grew = results[what]["peak"] - results[what]["base"]
        assert grew < 300 * 2**20, f"{what}: peak RSS grew by {grew / 2**20:.0f} MiB"
        if what == "float":
            assert os.path.getsize(out) > payload
            os.unlink(out)
    with mcf.open(tmp_path / "k4.mcf") as c:
        assert sum(c.info(n).dtype.name == "k4" for n in c) == len(c) - 1
    assert os.path.getsize(tmp_path / "back.safetensors") > payload


def test_durable_false_skips_fsync_but_still_publishes_atomically(tmp_path, monkeypatch):
    """convert(durable=False) writes the same bytes without calling fsync; the default fsyncs."""
    import numpy as np
    from safetensors.numpy import save_file

    import mcf.container.writer

    src = tmp_path / "m.safetensors"
    save_file({"w": np.arange(64, dtype=np.float32).reshape(8, 8)}, str(src))
    calls = []
    real = os.fsync
    monkeypatch.setattr(mcf.container.writer.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    mcf.convert(str(src), str(tmp_path / "a.mcf"), durable=False)
    assert calls == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".") or "tmp" in p]
    mcf.convert(str(src), str(tmp_path / "b.mcf"))
    assert calls
    assert (tmp_path / "a.mcf").read_bytes() == (tmp_path / "b.mcf").read_bytes()
