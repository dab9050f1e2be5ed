"""Export to safetensors: bit-exact round trips through the safetensors package's own reader, casts
against numpy references, quantized tensors against Container.dequantize, raw payloads, shards,
resources, atomicity and the CLI."""

import importlib
import json
import os
import struct
import tempfile
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
from _vectors import MANTLE_MODEL
from mcf.cli import main as cli_main
from mcf.conversion.export import RAW_KEY_PREFIX, export, parse_size

safetensors = pytest.importorskip("safetensors", reason="the safetensors package is a test extra")
import safetensors.numpy as stnp  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 arrays for the safetensors package")

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64,
          "i8": np.int8, "u8": np.uint8, "i16": np.int16, "u16": np.uint16, "i32": np.int32,
          "u32": np.uint32, "i64": np.int64, "u64": np.uint64}


def rng_for(text):
    return np.random.default_rng(zlib.crc32(text.encode()))


def random_tensor(rng, dtype, shape):
    """Random bits of the dtype (NaNs with payloads, infinities, subnormals and -0 included)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    return np.frombuffer(rng.integers(0, 256, n, dtype=np.uint8).tobytes(), dtype=dt).reshape(shape)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def st_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    return n, raw, json.loads(raw)


tensor_sets = st.dictionaries(
    st.text(alphabet="abcxyz._0123456789", min_size=1, max_size=12),
    st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 5), min_size=0, max_size=4)),
    min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_sets, st.integers(0, 2**32 - 1))
def test_round_trip_is_bit_exact_for_every_dtype(spec, seed):
    """safetensors -> MCF -> safetensors gives back the very bits the safetensors package reads from
    the original, for every dtype and shape (rank 0 and empty tensors included)."""
    rng = np.random.default_rng(seed)
    tensors = {name: random_tensor(rng, DTYPES[dt], tuple(shape)) for name, (dt, shape) in spec.items()}
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "in.safetensors")
        stnp.save_file(tensors, src)
        mcf.convert(src, os.path.join(d, "m.mcf"))
        export(os.path.join(d, "m.mcf"), os.path.join(d, "out.safetensors"))
        ref = stnp.load_file(src)
        got = stnp.load_file(os.path.join(d, "out.safetensors"))
        assert sorted(got) == sorted(ref)
        for name in ref:
            assert same_bits(got[name], ref[name]), name
        with safetensors.safe_open(os.path.join(d, "out.safetensors"), "np") as f:
            assert f.metadata() == {"format": "pt"}


def test_header_layout_matches_safetensors_conventions(tmp_path):
    rng = rng_for("layout")
    tensors = {"b16": random_tensor(rng, np.float16, (3, 5)), "a8": random_tensor(rng, np.uint8, (7,)),
               "c64": random_tensor(rng, np.float64, (2, 3)), "d32": random_tensor(rng, np.int32, (3,))}
    stnp.save_file(tensors, str(tmp_path / "in.safetensors"))
    mcf.convert(tmp_path / "in.safetensors", tmp_path / "m.mcf")
    out = tmp_path / "out.safetensors"
    export(tmp_path / "m.mcf", out)
    n, raw, hdr = st_header(out)
    assert n % 8 == 0 and raw == raw.rstrip(b" ") + b" " * (len(raw) - len(raw.rstrip(b" ")))
    assert next(iter(hdr)) == "__metadata__"
    spans = sorted((v["data_offsets"], k) for k, v in hdr.items() if k != "__metadata__")
    assert spans[0][0][0] == 0
    for (a, _), (b, _) in zip(spans, spans[1:]):
        assert a[1] == b[0]                       # back to back, no gaps
    assert spans[-1][0][1] == os.path.getsize(out) - 8 - n
    assert [k for _, k in spans] == ["c64", "d32", "b16", "a8"]   # larger items first: all aligned
    for (b, _e), k in spans:
        assert b % np.dtype(tensors[k].dtype).itemsize == 0


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_casts_round_to_nearest_even(tmp_path, dtype):
    rng = rng_for("cast " + dtype)
    x32 = (rng.standard_normal((17, 33)) * 1e3).astype(np.float32)
    x32.reshape(-1)[:4] = [np.inf, -np.inf, 65520.0, 1e-8]
    x64 = rng.standard_normal((4, 9)) * 1e5
    ints = rng.integers(-9, 9, (5,), dtype=np.int32)
    stnp.save_file({"x32": x32, "x64": x64, "ints": ints}, str(tmp_path / "in.safetensors"))
    mcf.convert(tmp_path / "in.safetensors", tmp_path / "m.mcf")
    export(tmp_path / "m.mcf", tmp_path / "o.safetensors", dtype=dtype)
    got = stnp.load_file(str(tmp_path / "o.safetensors"))
    assert same_bits(got["ints"], ints)
    if dtype == "bf16":
        u = x32.view(np.uint32).astype(np.uint64)
        want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        assert np.array_equal(got["x32"].view(np.uint16), want)
        assert got["x64"].dtype == ml_dtypes.bfloat16
    else:
        npdt = {"f32": np.float32, "f16": np.float16}[dtype]
        with np.errstate(over="ignore"):
            assert same_bits(got["x32"], x32.astype(npdt))
        assert got["x64"].dtype == npdt


@pytest.mark.parametrize("method", ["q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"])
@pytest.mark.parametrize("dtype", [None, "f32", "f16", "bf16"])
def test_quantized_export_equals_container_dequantize(tmp_path, method, dtype):
    mcf.convert(MANTLE_MODEL, tmp_path / "q.mcf", method=method)
    export(tmp_path / "q.mcf", tmp_path / "o.safetensors", dtype=dtype)
    got = stnp.load_file(str(tmp_path / "o.safetensors"))
    npdt = {None: np.float32, "f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype]
    with mcf.open(tmp_path / "q.mcf") as c:
        assert sorted(got) == sorted(c)
        quantized = [n for n in c if c.info(n).dtype.quantized]
        assert quantized
        for n in c:
            if c.info(n).dtype.quantized:
                want = c.dequantize(n, dtype=npdt)
                assert same_bits(got[n], want), n
            elif dtype is None:
                assert same_bits(got[n], np.asarray(c.tensor(n))), n


def test_raw_export_keeps_payloads_and_converts_back(tmp_path):
    mcf.convert(MANTLE_MODEL, tmp_path / "k4.mcf", method="k4", overrides=["a.*=int8", "d.*=q4"])
    export(tmp_path / "k4.mcf", tmp_path / "raw.safetensors", dtype="raw")
    with safetensors.safe_open(str(tmp_path / "raw.safetensors"), "np") as f:
        meta = f.metadata()
        with mcf.open(tmp_path / "k4.mcf") as c:
            for n in c:
                t = c.info(n)
                arr = f.get_tensor(n)
                if t.dtype.quantized:
                    assert arr.dtype == np.uint8 and arr.shape == (t.nbytes,)
                    assert arr.tobytes() == c.raw(n).tobytes()
                    d = json.loads(meta[RAW_KEY_PREFIX + n])
                    rec = c.quant_record(n)
                    assert d == {"method": t.dtype.name, "shape": list(t.shape), "domain": rec.domain,
                                 "min_clip": rec.min_clip, "max_clip": rec.max_clip}
                else:
                    assert RAW_KEY_PREFIX + n not in meta
                    assert arr.tobytes() == c.raw(n).tobytes()
    mcf.convert(tmp_path / "raw.safetensors", tmp_path / "back.mcf")
    with mcf.open(tmp_path / "k4.mcf") as a, mcf.open(tmp_path / "back.mcf") as b:
        assert list(a) == list(b)
        for n in a:
            assert a.info(n).dtype == b.info(n).dtype and a.info(n).shape == b.info(n).shape
            assert a.raw(n).tobytes() == b.raw(n).tobytes()
        assert [(r.name, r.method, r.domain, r.min_clip, r.max_clip) for r in a.quant_info] == \
               [(r.name, r.method, r.domain, r.min_clip, r.max_clip) for r in b.quant_info]


def test_directory_export_with_resources(tmp_path):
    mcf.pack(MANTLE_MODEL, tmp_path / "m.mcf")
    paths = export(tmp_path / "m.mcf", tmp_path / "out")
    with mcf.open(tmp_path / "m.mcf") as c:
        res = c.resources
    assert res
    assert sorted(os.path.basename(p) for p in paths) == sorted(["model.safetensors", *res])
    for fname, data in res.items():
        assert (tmp_path / "out" / fname).read_bytes() == data
    ref = stnp.load_file(os.path.join(MANTLE_MODEL, "model.safetensors"))
    got = stnp.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(ref) and all(same_bits(got[k], ref[k]) for k in ref)
    # no resources: only the weights
    paths = export(tmp_path / "m.mcf", tmp_path / "bare", resources=False)
    assert os.listdir(tmp_path / "bare") == ["model.safetensors"]
    # and the directory packs back to the same MCF bytes
    mcf.pack(tmp_path / "out", tmp_path / "again.mcf", model_name="mcf-testmodel")
    assert (tmp_path / "again.mcf").read_bytes() == (tmp_path / "m.mcf").read_bytes()


def test_sharded_export(tmp_path):
    mcf.pack(MANTLE_MODEL, tmp_path / "m.mcf")
    ref = stnp.load_file(os.path.join(MANTLE_MODEL, "model.safetensors"))
    biggest = max(a.nbytes for a in ref.values())
    out = tmp_path / "out"
    export(tmp_path / "m.mcf", out, max_shard_size=biggest)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert idx["metadata"]["total_size"] == sum(a.nbytes for a in ref.values())
    got = {}
    for s in shards:
        part = stnp.load_file(str(out / s))
        assert sum(a.nbytes for a in part.values()) <= biggest
        assert all(idx["weight_map"][k] == s for k in part)
        got.update(part)
    assert sorted(got) == sorted(ref) and all(same_bits(got[k], ref[k]) for k in ref)
    # the sharded directory converts back to the same tensors
    mcf.pack(out, tmp_path / "again.mcf", model_name="mcf-testmodel")
    assert (tmp_path / "again.mcf").read_bytes() == (tmp_path / "m.mcf").read_bytes()
    # exporting unsharded into the same directory removes the stale index and shards
    export(tmp_path / "m.mcf", out)
    assert sorted(p for p in os.listdir(out) if "safetensors" in p) == ["model.safetensors"]


@pytest.mark.slow
def test_transformers_loads_an_exported_sharded_directory(tmp_path, minilm_dir):
    transformers = pytest.importorskip("transformers", reason="optional: the real consumer of the directory")
    torch = pytest.importorskip("torch")
    mcf.convert(minilm_dir, tmp_path / "m.mcf")
    export(tmp_path / "m.mcf", tmp_path / "out", max_shard_size="20MB")
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    ref = transformers.AutoModel.from_pretrained(minilm_dir)
    got = transformers.AutoModel.from_pretrained(str(tmp_path / "out"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    x = tok(["a converted model", "round trips"], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(got(**x).last_hidden_state, ref(**x).last_hidden_state)


def test_failed_export_leaves_nothing(tmp_path):
    mcf.pack(MANTLE_MODEL, tmp_path / "m.mcf")

    def boom(done, total, name):
        if done == 2:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        export(tmp_path / "m.mcf", tmp_path / "o.safetensors", progress=boom)
    assert os.listdir(tmp_path) == ["m.mcf"]
    (tmp_path / "o.safetensors").write_bytes(b"old")
    with pytest.raises(RuntimeError):
        export(tmp_path / "m.mcf", tmp_path / "o.safetensors", progress=boom)
    assert (tmp_path / "o.safetensors").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["m.mcf", "o.safetensors"]


def test_bad_arguments(tmp_path):
    mcf.pack(MANTLE_MODEL, tmp_path / "m.mcf")
    with pytest.raises(mcf.InvalidArgumentError, match="dtype"):
        export(tmp_path / "m.mcf", tmp_path / "o.safetensors", dtype="k4")
    with pytest.raises(mcf.InvalidArgumentError, match="directory"):
        export(tmp_path / "m.mcf", tmp_path / "o.safetensors", max_shard_size="1GB")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(mcf.InvalidArgumentError, match="not a directory"):
        export(tmp_path / "m.mcf", tmp_path / "file")
    with pytest.raises(mcf.InvalidArgumentError, match="size"):
        export(tmp_path / "m.mcf", tmp_path / "d", max_shard_size="lots")
    with pytest.raises(mcf.MissingFileError):
        export(tmp_path / "nope.mcf", tmp_path / "o.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["file", "m.mcf"]


@pytest.mark.parametrize("text,want", [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("2G", 2 * 10**9),
                                       (1234, 1234), ("1.5kb", 1500), ("7", 7)])
def test_parse_size(text, want):
    assert parse_size(text) == want


def test_pread_source_exports_the_same(tmp_path):
    mcf.convert(MANTLE_MODEL, tmp_path / "q.mcf", method="k4")
    export(tmp_path / "q.mcf", tmp_path / "a.safetensors", dtype="f16")
    export(tmp_path / "q.mcf", tmp_path / "b.safetensors", dtype="f16", mmap=False)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_cli_export(tmp_path, capsys):
    mcf.convert(MANTLE_MODEL, tmp_path / "q.mcf", method="q8")
    assert cli_main(["export", str(tmp_path / "q.mcf"), "-o", str(tmp_path / "out"), "--dtype", "bf16",
                     "--max-shard-size", "100000", "-q"]) == 0
    assert "wrote" in capsys.readouterr().out
    idx = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    got = {}
    for s in set(idx["weight_map"].values()):
        got.update(stnp.load_file(str(tmp_path / "out" / s)))
    with mcf.open(tmp_path / "q.mcf") as c:
        for n in c:
            if c.info(n).dtype.family in ("float", "block"):
                assert got[n].dtype == ml_dtypes.bfloat16
                assert same_bits(got[n], c.dequantize(n, dtype=ml_dtypes.bfloat16)), n
    assert cli_main(["export", str(tmp_path / "nope.mcf"), "-o", str(tmp_path / "x.safetensors")]) == 1
    assert "mcf export: error" in capsys.readouterr().err


def test_kernel_copy_and_user_space_copy_write_the_same_bytes(tmp_path, monkeypatch):
    """Plain tensors go through copy_file_range when the source is a file; from memory, or when the
    kernel refuses (EXDEV across file systems on older kernels), through pread + write."""
    import errno

    mcf.convert(MANTLE_MODEL, tmp_path / "q.mcf", method="k4", overrides=["a.*=none"])
    export(tmp_path / "q.mcf", tmp_path / "kernel.safetensors")
    export(memoryview((tmp_path / "q.mcf").read_bytes()), tmp_path / "memory.safetensors")

    def refuse(*args):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    export(tmp_path / "q.mcf", tmp_path / "fallback.safetensors")
    want = (tmp_path / "kernel.safetensors").read_bytes()
    assert (tmp_path / "memory.safetensors").read_bytes() == want
    assert (tmp_path / "fallback.safetensors").read_bytes() == want


def test_a_tensor_named_like_the_metadata_key_is_refused(tmp_path):
    with mcf.Writer(tmp_path / "m.mcf") as w:
        w.add_tensor("__metadata__", np.zeros(3, np.float32))
    with pytest.raises(mcf.InvalidArgumentError, match="__metadata__"):
        export(tmp_path / "m.mcf", tmp_path / "o.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["m.mcf"]


def test_rows_wider_than_the_stream_buffer(tmp_path, monkeypatch):
    """Decoding row blocks into the reused buffer, when even one row is larger than it."""
    import sys

    E = sys.modules["mcf.conversion.export"]   # (mcf.export, the attribute, is the function)
    x = rng_for("wide").standard_normal((3, 1024)).astype(np.float32)
    with mcf.Writer(tmp_path / "m.mcf") as w:
        w.add_tensor("w", x, method="k4")
    export(tmp_path / "m.mcf", tmp_path / "a.safetensors")
    monkeypatch.setattr(E, "_CHUNK_BYTES", 1000)   # < one row of 4096 bytes
    export(tmp_path / "m.mcf", tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    with mcf.open(tmp_path / "m.mcf") as c:
        assert same_bits(stnp.load_file(str(tmp_path / "b.safetensors"))["w"], c.dequantize("w"))


def test_unwritable_destination_is_an_mcf_io_error(tmp_path):
    mcf.pack(MANTLE_MODEL, tmp_path / "m.mcf")
    with pytest.raises(mcf.MissingFileError):
        export(tmp_path / "m.mcf", tmp_path / "no" / "such" / "dir" / "o.safetensors")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").mkdir()   # a directory where a resource file goes
    with pytest.raises(mcf.MCFIOError, match="config.json"):
        export(tmp_path / "m.mcf", tmp_path / "out")


# -- a sharded export that dies half way: the directory never loads as a mix or a part --------------------

def _two_models(tmp_path):
    """Two MCF files with the same tensor names, dtypes and shapes (so the same shard split) and other bits."""
    out = []
    for tag in ("old", "new"):
        rng = rng_for(tag)
        tensors = {f"t{k}": rng.standard_normal(256).astype(np.float32) for k in range(4)}
        stnp.save_file(tensors, str(tmp_path / f"{tag}.safetensors"))
        mcf.convert(tmp_path / f"{tag}.safetensors", tmp_path / f"{tag}.mcf")
        out.append((tmp_path / f"{tag}.mcf", tensors))
    return out


def _loaded(directory):
    """The tensors a loader reads from ``directory``, or the MCFError it raises."""
    try:
        return mcf.safetensors.load_file(str(directory))
    except mcf.MCFError as exc:
        return exc


def _old_new_or_error(got, old, new, where):
    if isinstance(got, mcf.MCFError):
        assert str(got), where
        return "error"
    for label, ref in (("old", old), ("new", new)):
        if sorted(got) == sorted(ref) and all(same_bits(got[k], ref[k]) for k in ref):
            return label
    raise AssertionError(f"{where}: the directory loads as neither the old nor the new model: "
                         f"{ {k: (v[:2].tolist() if hasattr(v, 'tolist') else v) for k, v in got.items()} }")


@pytest.mark.parametrize("over_old", [True, False])
def test_export_failing_after_the_first_shard_leaves_the_old_model_or_an_error(tmp_path, monkeypatch, over_old):
    export_module = importlib.import_module("mcf.conversion.export")  # mcf.export is also the function

    (old_mcf, old), (new_mcf, new) = _two_models(tmp_path)
    out = tmp_path / "out"
    if over_old:
        export(old_mcf, out, max_shard_size=1024)
        assert len([n for n in os.listdir(out) if n.startswith("model-")]) == 4
        assert _old_new_or_error(_loaded(out), old, new, "before") == "old"
    real = export_module._write_safetensors
    calls = []

    def failing(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(export_module, "_write_safetensors", failing)
    with pytest.raises(OSError, match="No space left"):
        export(new_mcf, out, max_shard_size=1024)
    got = _loaded(out)
    assert _old_new_or_error(got, old, new, "after") == ("old" if over_old else "error")
    if not over_old:
        assert "no model.safetensors" in str(got)
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]  # the temporaries are removed


@pytest.mark.parametrize("old_kind", ["sharded", "single"])
def test_export_killed_at_any_step_of_publishing_never_loads_a_mix(tmp_path, monkeypatch, old_kind):
    """Every rename, removal and write of the publish step, made to fail in turn (the process dies there):
    the directory loads as the old model, the new one, or fails with a clear error."""
    export_module = importlib.import_module("mcf.conversion.export")  # mcf.export is also the function

    (old_mcf, old), (new_mcf, new) = _two_models(tmp_path)
    seen = set()
    k = 0
    while True:
        out = tmp_path / f"out{k}"
        export(old_mcf, out, max_shard_size=1024 if old_kind == "sharded" else None)
        ops = []

        def dies_at(fn, name):
            def run(*args, **kwargs):
                ops.append(name)
                if len(ops) > k:
                    raise KeyboardInterrupt(f"killed at {name}")
                return fn(*args, **kwargs)
            return run

        for name in ("_rename", "_unlink", "write_atomic", "fsync_dir"):
            monkeypatch.setattr(export_module, name, dies_at(getattr(export_module, name), name))
        try:
            export(new_mcf, out, max_shard_size=1024, resources=False)
            finished = True
        except KeyboardInterrupt:
            finished = False
        monkeypatch.undo()
        seen.add(_old_new_or_error(_loaded(out), old, new, f"killed after {k} steps"))
        if finished:
            assert _old_new_or_error(_loaded(out), old, new, "finished") == "new"
            break
        k += 1
    assert k > 6 and "old" in seen and "new" in seen


def test_index_less_shards_load_only_as_a_complete_set(tmp_path):
    (old_mcf, old), (new_mcf, new) = _two_models(tmp_path)
    out = tmp_path / "out"
    export(old_mcf, out, max_shard_size=1024)
    (out / "model.safetensors.index.json").unlink()
    got = mcf.safetensors.load_file(str(out))  # every shard of the set: the whole model
    assert all(same_bits(got[k], old[k]) for k in old) and sorted(got) == sorted(old)
    (out / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(mcf.MissingFileError, match="model-00003-of-00004.safetensors is missing"):
        mcf.safetensors.load_file(str(out))
    export(old_mcf, out, max_shard_size=1024)  # whole again
    (out / "model.safetensors.index.json").unlink()
    export(new_mcf, tmp_path / "two", max_shard_size=2048)
    for n in os.listdir(tmp_path / "two"):
        if n.startswith("model-"):
            os.replace(tmp_path / "two" / n, out / n)  # two complete sets, of 4 and of 2 shards
    with pytest.raises(mcf.FormatError, match="shards of 2 checkpoints side by side"):
        mcf.safetensors.load_file(str(out))
