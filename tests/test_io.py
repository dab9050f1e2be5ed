"""The I/O core: four source modes, bounds checks, lifetime of views, pickling, growth, threads."""

import gc
import io
import os
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest

import mcf
from mcf.io import PAGE_SIZE, aligned_empty, alloc_buffer, open_source


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, 3 * PAGE_SIZE + 123, dtype=np.uint8).tobytes()
    p = tmp_path / "data.bin"
    p.write_bytes(data)
    return p, data


def sources(p, data, files):
    f = open(p, "rb")  # noqa: SIM115
    files.append(f)
    return {
        "mmap": open_source(p),
        "pread": open_source(p, mmap=False),
        "fileobj": open_source(f),
        "bytesio": open_source(io.BytesIO(data)),
        "memory": open_source(memoryview(data)),
        "bytearray": open_source(bytearray(data)),
    }


@pytest.fixture
def all_sources(data_file):
    p, data = data_file
    files = []
    srcs = sources(p, data, files)
    yield srcs, data
    for s in srcs.values():
        s.close()
    for f in files:
        f.close()


def test_reads_agree_in_every_mode(all_sources):
    srcs, data = all_sources
    for mode, s in srcs.items():
        assert s.size == len(data) == len(s), mode
        for off, n in [(0, 0), (0, 10), (5, 4096), (PAGE_SIZE - 1, 2), (len(data) - 7, 7), (len(data), 0)]:
            assert s.read(off, n) == data[off:off + n], (mode, off, n)
            assert s.view(off, n).tobytes() == data[off:off + n], (mode, off, n)
            buf = bytearray(n)
            assert s.readinto(off, buf) == n
            assert bytes(buf) == data[off:off + n]
        a = s.array(3, "<u4", (2, 5))
        assert a.shape == (2, 5)
        assert a.tobytes() == data[3:43]


def test_zero_copy_only_when_mapped(all_sources):
    srcs, _ = all_sources
    assert srcs["mmap"].is_mapped and srcs["memory"].is_mapped
    assert not srcs["pread"].is_mapped and not srcs["fileobj"].is_mapped
    v1 = srcs["mmap"].view(0, 16)
    v2 = srcs["mmap"].view(0, 16)
    assert np.shares_memory(v1, v2)
    assert not v1.flags.writeable
    with pytest.raises(ValueError):
        v1[0] = 1


def test_pread_views_are_page_aligned(all_sources):
    v = all_sources[0]["pread"].view(1, 5000)
    assert v.ctypes.data % 4096 == 0
    assert aligned_empty(10).ctypes.data % 4096 == 0


@pytest.mark.parametrize("off,n", [(-1, 1), (0, -1), (0, 10**9), (2**70, 1), (1, 2**64 - 1), (10**6, 0)])
def test_out_of_bounds_reads_raise(all_sources, off, n):
    for _mode, s in all_sources[0].items():
        with pytest.raises(mcf.OutOfBoundsError) as ei:
            s.read(off, n)
        assert isinstance(ei.value, IndexError) and isinstance(ei.value, mcf.MCFError)
        with pytest.raises(mcf.OutOfBoundsError):
            s.view(off, n)
        with pytest.raises((mcf.OutOfBoundsError, ValueError)):
            s.array(off, "u1", (n,))


def test_close_keeps_views_alive(data_file):
    p, data = data_file
    s = open_source(p)
    v = s.view(100, 1000)
    a = s.array(8, "<f4", (10,))
    s.close()
    s.close()  # idempotent
    gc.collect()
    assert v.tobytes() == data[100:1100]
    assert a.tobytes() == data[8:48]
    with pytest.raises(mcf.ClosedError):
        s.read(0, 1)
    assert s.closed
    del s
    gc.collect()
    assert v.tobytes() == data[100:1100]  # the mapping outlives the source


def test_container_views_outlive_container(tmp_path):
    p = tmp_path / "t.mcf"
    with mcf.Writer(p) as w:
        w.add_tensor("x", np.arange(1000, dtype=np.float32))
    c = mcf.open(p)
    x = c.tensor("x")
    c.close()
    del c
    gc.collect()
    assert x.sum() == np.arange(1000, dtype=np.float32).sum()


@pytest.mark.parametrize("use_mmap", [True, False])
def test_pickle_reopens(data_file, use_mmap):
    p, data = data_file
    s = open_source(p, mmap=use_mmap)
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.mode == s.mode and s2.read(0, 100) == data[:100]
    s.close()
    assert s2.read(10, 5) == data[10:15]
    s2.close()


def test_pickle_container(tmp_path):
    p = tmp_path / "t.mcf"
    with mcf.Writer(p) as w:
        w.add_tensor("x", np.arange(10, dtype=np.int64))
    with mcf.open(p) as c:
        c2 = pickle.loads(pickle.dumps(c))
    assert np.array_equal(c2.tensor("x"), np.arange(10))
    c2.close()


def test_refresh_sees_appended_bytes(tmp_path):
    p = tmp_path / "grow.bin"
    p.write_bytes(b"a" * 100)
    for use_mmap in (True, False):
        s = open_source(p, mmap=use_mmap)
        v = s.view(0, 100)
        with open(p, "ab") as f:
            f.write(b"b" * 50)
        assert s.size == 100
        with pytest.raises(mcf.OutOfBoundsError):
            s.read(100, 1)
        assert s.refresh() == 150
        assert s.read(100, 50) == b"b" * 50
        assert v.tobytes() == b"a" * 100
        s.close()
        p.write_bytes(b"a" * 100)


def test_advise_and_errors(data_file):
    p, _ = data_file
    with open_source(p) as s:
        for adv in ("random", "sequential", "willneed", "normal"):
            s.advise(adv)
            s.advise(adv, 5, 100)
        with pytest.raises(ValueError):
            s.advise("bogus")
        with pytest.raises(mcf.OutOfBoundsError):
            s.advise("random", 0, 10**9)


def test_open_errors(tmp_path):
    with pytest.raises(mcf.MissingFileError) as ei:
        open_source(tmp_path / "nope")
    assert isinstance(ei.value, FileNotFoundError) and "nope" in str(ei.value)
    with pytest.raises(mcf.MCFIOError):
        open_source(tmp_path)  # a directory
    with pytest.raises(TypeError):
        open_source(12.5)


def test_empty_file(tmp_path):
    p = tmp_path / "empty"
    p.write_bytes(b"")
    for use_mmap in (True, False):
        with open_source(p, mmap=use_mmap) as s:
            assert s.size == 0
            assert s.read(0, 0) == b""
            assert s.view(0, 0).size == 0
            with pytest.raises(mcf.OutOfBoundsError):
                s.read(0, 1)


class Truncating(io.RawIOBase):
    """A file-like object that claims a size and then delivers less (like a dropped connection)."""

    def __init__(self, data, short):
        self.data, self.short, self.pos = data, short, 0

    def seek(self, off, whence=0):
        self.pos = off if whence == 0 else len(self.data)
        return self.pos

    def readinto(self, b):
        end = min(len(self.data) - self.short, self.pos + len(b))
        n = max(0, end - self.pos)
        b[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n

    def readable(self):
        return True


def test_short_fileobj_is_truncated_error():
    s = open_source(Truncating(b"x" * 100, 10))
    with pytest.raises(mcf.TruncatedError):
        s.read(80, 20)
    assert s.read(0, 50) == b"x" * 50


def test_many_threads_read_the_same_source(data_file):
    p, data = data_file
    srcs = [open_source(p), open_source(p, mmap=False)]
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                off = int(rng.integers(0, len(data)))
                n = int(rng.integers(0, len(data) - off + 1))
                for s in srcs:
                    assert s.read(off, n) == data[off:off + n]
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for s in srcs:
        s.close()


def test_source_is_not_constructible_directly():
    with pytest.raises(TypeError):
        mcf.io.Source()


def test_alloc_buffer_is_writable_and_page_aligned():
    for n in (0, 1, 4096, 3 << 20):
        a = alloc_buffer(n)
        assert a.size == n and a.dtype == np.uint8
        if n:
            assert a.flags.writeable and a.ctypes.data % 4096 == 0
            a[:] = 7
            assert int(a[-1]) == 7
    with pytest.raises(ValueError):
        alloc_buffer(-1)


@pytest.mark.parametrize("n,align", [(0, 4096), (10, 64), (5, 3), (100, 1 << 16), (1 << 20, 1)])
def test_aligned_empty_any_alignment(n, align):
    a = aligned_empty(n, align)
    assert a.size == n and a.dtype == np.uint8 and a.flags.writeable and a.ctypes.data % align == 0
    a[:] = 5
    assert int(a.sum()) == 5 * n


def _vm_flags(addr: int) -> list:
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_fresh_buffers_do_not_ask_for_huge_pages():
    """Loader destinations are faulted in as the engine fills them; numpy's allocator advises
    MADV_HUGEPAGE ("hg") on arrays of 4 MiB or more, which made those faults 3x dearer in system time on
    the project's VM (bench/results/loading.md).  mcf's buffers never ask for it.  Checked in a fresh
    process: in this one, the C allocator may hand back heap memory that numpy advised for an earlier array
    (glibc reuses freed heap blocks before it maps new memory), and such memory keeps numpy's advice."""
    code = ("import numpy as np\n"
            "from mcf.io import alloc_buffer\n"
            "import test_io\n"
            "a = alloc_buffer(64 << 20)\n"
            "b = np.empty(64 << 20, np.uint8)\n"
            "print('hg' in test_io._vm_flags(a.ctypes.data), 'hg' in test_io._vm_flags(b.ctypes.data))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                                    os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "False", r.stdout   # (numpy's own, the second, depends on the THP mode)


_UNCLOSED = """
import io, sys
import mcf, mcf.gguf, mcf.io, mcf.safetensors
import mcf._core._io as core
fix = sys.argv[1]
held = [mcf.open(fix + "/golden_plain.mcf"), mcf.open(fix + "/golden_plain.mcf", mmap=False),
        mcf.safetensors.SafetensorsFile(sys.argv[2]), mcf.safetensors.SafetensorsFile(sys.argv[2], mmap=False),
        mcf.gguf.open(fix + "/gguf/golden_v3.gguf"), mcf.gguf.open(fix + "/gguf/golden_v3.gguf", mmap=False),
        mcf.io.open_source(io.BytesIO(open(sys.argv[2], "rb").read())),
        mcf.io.open_source(open(sys.argv[2], "rb")), mcf.io.open_source(sys.argv[2], mmap=False)]
where = sys.argv[3]
if where == "main":
    pass
elif where == "sys":        # torn down after the modules' globals
    sys.held = held
elif where == "module":     # freed while mcf's own I/O module is being cleared
    core.held = held
elif where == "cycle":
    held.append(held)
"""


@pytest.mark.parametrize("where", ["main", "sys", "module", "cycle"])
def test_unclosed_sources_exit_quietly(tmp_path, where):
    """Containers, safetensors and GGUF files and sources nobody closed, still referenced when the interpreter
    exits: nothing on stderr.  Source.__dealloc__ called os.close, and when it ran after the module globals
    were torn down that printed "Exception ignored in: 'mcf._core._io.Source.__dealloc__'" (or, once
    sys.stderr was gone too, "Error in sys.excepthook")."""
    st = tmp_path / "x.safetensors"
    header = b'{"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}'
    st.write_bytes(len(header).to_bytes(8, "little") + header + np.arange(8, dtype="<f4").tobytes())
    fix = os.path.join(os.path.dirname(__file__), "fixtures")
    r = subprocess.run([sys.executable, "-c", _UNCLOSED, fix, str(st), where], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_ranges_in_every_mode(all_sources, threads):
    srcs, data = all_sources
    rng = np.random.default_rng(threads)
    offs = rng.integers(0, len(data) - 600, 40)
    sizes = rng.integers(0, 600, 40)
    dsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) + 3
    for mode, s in srcs.items():
        out = np.zeros(int(sizes.sum()) + 3, np.uint8)
        s.read_ranges(offs, sizes, out, dsts, threads=threads)
        for o, n, d in zip(offs, sizes, dsts):
            assert out[d:d + n].tobytes() == data[o:o + n], mode


def test_read_ranges_checks_every_range_first(all_sources):
    srcs, data = all_sources
    for mode, s in srcs.items():
        out = np.zeros(100, np.uint8)
        for offs, sizes, dsts in ([[0, -1], [1, 1], [0, 1]], [[0, len(data)], [1, 1], [0, 1]],
                                  [[0, 0], [10, 10], [0, 95]], [[0], [2**62], [0]]):
            with pytest.raises(mcf.OutOfBoundsError):
                s.read_ranges(offs, sizes, out, dsts)
            assert not out.any(), mode  # nothing was copied before the checks failed
        with pytest.raises(ValueError):
            s.read_ranges([0, 1], [1], out, [0, 1])
        with pytest.raises(mcf.InvalidArgumentError):
            s.read_ranges([0], [1], b"readonly", [0])
        with pytest.raises(mcf.InvalidArgumentError):
            s.readinto(0, b"readonly")


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_container_load_materializes_fresh_arrays(tmp_path, mmap, threads):
    p = tmp_path / "t.mcf"
    rng = np.random.default_rng(5)
    arrays = {"a": rng.standard_normal((33, 17)).astype(np.float32), "b": np.arange(7, dtype=np.int16),
              "c": np.float64(2.5), "d": np.zeros((0, 3), np.float16)}
    payload = rng.integers(0, 64, mcf.quant_layout("k4", (3, 40)).nbytes, dtype=np.uint8)
    with mcf.Writer(p) as w:
        for n, a in arrays.items():
            w.add_tensor(n, a)
        w.add_tensor_bytes("q", "k4", (3, 40), payload)
    with mcf.open(p, mmap=mmap) as c:
        out = c.load(threads=threads)
        assert set(out) == {"a", "b", "c", "d", "q"}
        for n, a in arrays.items():
            got = out[n]
            assert got.dtype == np.asarray(a).dtype and got.shape == np.shape(a)
            assert got.tobytes() == np.asarray(a).tobytes()
            assert got.flags.writeable and got.flags.c_contiguous
            assert not np.shares_memory(got, c.tensor(n)) or got.size == 0
        assert out["q"].tobytes() == payload.tobytes()
        out["a"][0, 0] = 1e9  # fresh memory: the file is not touched
        assert c.tensor("a")[0, 0] == arrays["a"][0, 0]
        sub = c.load(["b"])
        assert list(sub) == ["b"]
    assert mcf.load_file(p)["a"].tobytes() == arrays["a"].tobytes()
    with pytest.raises(mcf.TensorNotFoundError):
        mcf.load_file(p, ["nope"])


@pytest.mark.parametrize("mode", ["pread", "fileobj", "memory", "mmap"])
def test_close_racing_copies_never_crashes(mode):
    """Source.close() while other threads copy with the GIL released: every copy returns the right bytes
    or raises ClosedError, and the process survives (the mapping and the descriptor are released by the
    last copy in flight, so a reused fd number is never read).  Runs fuzz/close_race.py in a child
    process so a crash fails this test instead of killing the suite."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "close_race.py")
    p = subprocess.run([sys.executable, script, "--mode", mode, "--rounds", "15"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ClosedError" in p.stdout or "'ok'" in p.stdout


@pytest.mark.parametrize("mmap", [True, False])
def test_read_into_fills_each_buffer_and_counts_bytes(tmp_path, mmap):
    data = bytes(range(256)) * 64
    (tmp_path / "f").write_bytes(data)
    with mcf.io.open_source(tmp_path / "f", mmap=mmap) as src:
        a, b, c = np.empty(100, np.uint8), bytearray(7), np.empty((3, 5), np.float32)
        assert src.read_into([5, 1000, 4000], [a, b, c]) == 100 + 7 + 60
        assert bytes(a) == data[5:105] and bytes(b) == data[1000:1007] and c.tobytes() == data[4000:4060]
        assert src.bytes_read == 167
        src.view(0, 10)                       # a mapped view reads nothing (a pread one does)
        assert src.bytes_read == (167 if mmap else 177)
        with pytest.raises(mcf.OutOfBoundsError):
            src.read_into([0, len(data) - 3], [a, b])   # checked before any byte moves
        assert src.bytes_read == (167 if mmap else 177)
        with pytest.raises(mcf.InvalidArgumentError):
            src.read_into([0], [a, b])
        with pytest.raises(mcf.InvalidArgumentError):
            src.read_into([0], [b"read-only"])
