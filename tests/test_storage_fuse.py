"""mmap=None on a real FUSE mount (tests/_fuse_passthrough.py: a read-only passthrough filesystem served
by mfusepy): every reader opens files there with positional reads through the read engine, not a
mapping, and gets the right bytes; ``mmap=True`` still maps; a disk error in the middle of a file stops
the engine's workers and names the file and the offset.

Whether a file is mapped is read from /proc/self/maps, the kernel's own list of this process's
mappings, so the check does not depend on how a reader stores its source."""

from __future__ import annotations

import errno
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import mcf
import mcf.bucket
import mcf.gguf
import mcf.megacontext as mc
import mcf.megatron as mm
from mcf.io import open_source
from mcf.safetensors.reader import open_checkpoint

from _fuse_passthrough import mounted

FIXTURES = Path(__file__).parent / "fixtures"


def mapped_paths() -> set:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


@pytest.fixture(scope="module")
def fuse(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuse-root")
    mnt = tmp_path_factory.mktemp("fuse-mnt")
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, (5 << 20) + 77, dtype=np.uint8)
    data.tofile(root / "data.bin")
    arrays = {"w": rng.standard_normal((300, 257)).astype(np.float32), "b": np.arange(11, dtype=np.int16)}
    with mcf.Writer(root / "model.mcf") as w:
        for n, a in arrays.items():
            w.add_tensor(n, a)
    import safetensors.numpy
    safetensors.numpy.save_file(arrays, str(root / "model.safetensors"))
    shutil.copy(FIXTURES / "gguf" / "golden_v3.gguf", root / "model.gguf")
    for ext in ("idx", "bin"):
        shutil.copy(FIXTURES / "megatron" / f"megatron_u16.{ext}", root / f"tokens.{ext}")
    shutil.copytree(FIXTURES / "megacontext" / "canonical_fp16", root / "tree")
    shutil.copy(FIXTURES / "bucket" / "float16_none.mcb", root / "kv.mcb")
    with mounted(root, mnt) as m:
        yield Path(root), Path(m), data, arrays


def test_the_mount_is_fuse(fuse):
    root, mnt, _, _ = fuse
    s = mcf.io.storage_of(mnt / "data.bin")
    assert (s.kind, s.filesystem) == ("fuse", "fuse")
    assert mcf.io.storage_of(root / "data.bin").kind != "fuse"


def test_default_reads_with_the_engine_and_mmap_true_still_maps(fuse):
    _, mnt, data, _ = fuse
    p = mnt / "data.bin"
    with open_source(p) as src:
        assert src.mode == "pread" and not src.is_mapped and src.storage.kind == "fuse"
        assert str(p) not in mapped_paths()
        bufs = [np.empty(n, np.uint8) for n in (1, 4 << 20, 1000)]
        src.read_into([3, 100, data.size - 1000], bufs)
        assert bufs[0].tobytes() == data[3:4].tobytes()
        assert bufs[1].tobytes() == data[100:100 + (4 << 20)].tobytes()
        assert bufs[2].tobytes() == data[-1000:].tobytes()
        st = src.read_stats
        assert st.storage.kind == "fuse" and st.threads > 1 and st.bytes_read == 1 + (4 << 20) + 1000
        assert st.streams == 0          # one stream: every worker takes the next request, as before
        big = np.empty(4 << 20, np.uint8)   # per-worker streams when asked: a descriptor each, same bytes
        src.read_into([5], [big], threads=4, chunk_bytes=1 << 20, streams=True)
        assert big.tobytes() == data[5:5 + (4 << 20)].tobytes()
        assert src.read_stats.streams == (4 if sys.platform.startswith("linux") else 0)
        assert src.view(0, data.size).tobytes() == data.tobytes()   # a large view: the engine too
        assert src.read_stats.bytes_read == data.size
    with open_source(p, mmap=True) as src:
        assert src.mode == "mmap" and str(p) in mapped_paths()
        assert src.view(7, 4096).tobytes() == data[7:4103].tobytes()


def test_every_reader_defaults_to_positional_reads_on_fuse(fuse):
    _, mnt, _, arrays = fuse
    checks = []

    def unmapped(path):
        checks.append(path)
        assert str(path) not in mapped_paths(), path

    with mcf.open(mnt / "model.mcf") as c:
        unmapped(mnt / "model.mcf")
        assert c.source.mode == "pread"
        assert np.array_equal(c.tensor("w"), arrays["w"])
    got = mcf.load_file(mnt / "model.mcf")
    assert all(np.array_equal(got[n], a) for n, a in arrays.items())
    with open_checkpoint(mnt / "model.safetensors") as ck:
        unmapped(mnt / "model.safetensors")
        assert ck.files[0].source.mode == "pread"
        assert np.array_equal(ck.tensors["w"].array(), arrays["w"])
    with mcf.gguf.open(mnt / "model.gguf") as g, mcf.gguf.open(FIXTURES / "gguf" / "golden_v3.gguf") as ref:
        unmapped(mnt / "model.gguf")
        assert g.source.mode == "pread"
        name = next(iter(ref.tensors))
        assert np.array_equal(g.dequantize(name), ref.dequantize(name))
    with mm.open(mnt / "tokens") as ds, mm.open(FIXTURES / "megatron" / "megatron_u16") as ref:
        unmapped(mnt / "tokens.bin")
        unmapped(mnt / "tokens.idx")
        assert len(ds) == len(ref) and all(np.array_equal(ds[i], ref[i]) for i in range(len(ref)))
    with mc.open_tree(mnt / "tree") as t, mc.open_tree(FIXTURES / "megacontext" / "canonical_fp16") as ref:
        assert t.source(0).mode == "pread"
        for f in (mnt / "tree").iterdir():
            unmapped(f)
        assert ref.num_tokens and np.array_equal(t.tokens(), ref.tokens())
    with mcf.bucket.open_kv(mnt / "kv.mcb") as kv, mcf.bucket.open_kv(FIXTURES / "bucket" / "float16_none.mcb") as ref:
        unmapped(mnt / "kv.mcb")
        for (k, v), (rk, rv) in zip(kv.load(), ref.load()):
            assert np.array_equal(k, rk) and np.array_equal(v, rv)
    assert len(checks) >= 7


def test_mmap_true_maps_on_fuse_for_every_reader(fuse):
    _, mnt, _, arrays = fuse
    with mcf.open(mnt / "model.mcf", mmap=True) as c:
        assert str(mnt / "model.mcf") in mapped_paths() and np.array_equal(c.tensor("w"), arrays["w"])
    with mm.open(mnt / "tokens", mmap=True) as ds:
        assert str(mnt / "tokens.bin") in mapped_paths() and len(ds) > 0
    with mcf.gguf.open(mnt / "model.gguf", mmap=True):
        assert str(mnt / "model.gguf") in mapped_paths()


def test_an_io_error_mid_file_names_the_file_and_offset_and_stops_the_workers(tmp_path):
    root, mnt = tmp_path / "root", tmp_path / "mnt"
    root.mkdir()
    mnt.mkdir()
    size, bad = 32 << 20, 1 << 20
    np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8).tofile(root / "f.bin")
    with mounted(root, mnt, eio_from=bad):
        p = mnt / "f.bin"
        with open_source(p) as src:
            out = np.zeros(size, np.uint8)
            with pytest.raises(mcf.MCFIOError) as exc:
                src.read_ranges([0], [size], out, [0], threads=16, chunk_bytes=65536)
            e = exc.value
            assert e.errno == errno.EIO and isinstance(e, OSError) and e.filename == str(p)
            offset = int(re.search(r"read at offset (\d+)", str(e)).group(1))
            assert bad - (128 << 10) <= offset <= bad
            # the other workers stopped: of 512 requests, about the first failing one plus one per worker
            assert src.read_stats.requests < 128
            assert src.bytes_read == src.read_stats.bytes_read <= bad
