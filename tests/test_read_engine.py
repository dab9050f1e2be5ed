"""The read engine (csrc/readengine.c through Source.read_into / read_ranges): byte-for-byte agreement with
a plain os.pread per range over random plans, in both layouts (per-worker streams and one shared stream),
refusals before any byte moves, exact bytes_read, a file that shrinks, and a source closed while the
engine runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
from mcf._core import storage
from mcf.io import aligned_empty, open_source

FILE_SIZE = 3 * (1 << 20) + 12345
# per-worker streams reopen the file through /proc/self/fd: a descriptor of their own on Linux only
REOPENS = sys.platform.startswith("linux")


class DataFile(tuple):
    """(path, bytes) of the test file, with a short repr: hypothesis prints a failing example's arguments."""

    def __repr__(self):
        return f"DataFile({str(self[0])!r}, {len(self[1])} bytes)"


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data = np.random.default_rng(24).integers(0, 256, FILE_SIZE, dtype=np.uint8).tobytes()
    p = tmp_path_factory.mktemp("engine") / "data.bin"
    p.write_bytes(data)
    return DataFile((p, data))


def reference(path, offsets, sizes):
    """What the engine must give: one os.pread per range."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return [os.pread(fd, n, o) for o, n in zip(offsets, sizes)]
    finally:
        os.close(fd)


@st.composite
def plans(draw):
    """Ranges of the file: random, overlapping in the file, adjacent to the previous one (in the file,
    in memory, or both: what the engine coalesces), empty, and spanning chunk boundaries; destinations
    disjoint, some adjacent and some with gaps."""
    n = draw(st.integers(0, 40))
    offs, sizes, gaps = [], [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["random", "tiny", "file-next", "empty", "big"]))
        if kind == "file-next" and offs:
            o = min(offs[-1] + sizes[-1], FILE_SIZE)
        else:
            o = draw(st.integers(0, FILE_SIZE))
        cap = FILE_SIZE - o
        size = {"random": lambda: draw(st.integers(0, min(cap, 300_000))),
                "tiny": lambda: draw(st.integers(0, min(cap, 16))),
                "file-next": lambda: draw(st.integers(0, min(cap, 200_000))),
                "empty": lambda: 0,
                "big": lambda: draw(st.integers(0, cap))}[kind]()
        offs.append(o)
        sizes.append(size)
        gaps.append(draw(st.sampled_from([0, 0, 1, 63, 4096])))
    return offs, sizes, gaps


CHUNKS = st.sampled_from([4096, 4096 * 3, 65536 + 512, 1 << 20, 2 << 20, 64 << 20])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans(), threads=st.integers(1, 16), chunk=CHUNKS, direct=st.booleans(), mmap=st.booleans(),
       one_arena=st.booleans(), streams=st.booleans())
def test_engine_agrees_with_pread_per_range(data_file, plan, threads, chunk, direct, mmap, one_arena, streams):
    path, data = data_file
    offs, sizes, gaps = plan
    want = reference(path, offs, sizes)
    with open_source(path, mmap=mmap) as src:
        if one_arena:
            dsts, pos = [], 0
            for n, g in zip(sizes, gaps):
                pos += g
                dsts.append(pos)
                pos += n
            out = np.full(pos + 7, 0xA5, np.uint8)
            src.read_ranges(offs, sizes, out, dsts, threads=threads, chunk_bytes=chunk, direct=direct, streams=streams)
            got = [out[d:d + n].tobytes() for d, n in zip(dsts, sizes)]
            covered = np.zeros(out.size, bool)
            for d, n in zip(dsts, sizes):
                covered[d:d + n] = True
            assert (out[~covered] == 0xA5).all()      # nothing written outside the destinations
        else:
            bufs = [np.full(n, 0xA5, np.uint8) for n in sizes]
            assert src.read_into(offs, bufs, threads=threads, chunk_bytes=chunk, direct=direct,
                                 streams=streams) == sum(sizes)
            got = [b.tobytes() for b in bufs]
        for k, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"range {k}: {len(g)} bytes at offset {offs[k]} differ from os.pread's"
        stats = src.read_stats
        if not direct:
            assert src.bytes_read == sum(sizes)      # exactly the bytes asked for
        else:
            # whole aligned blocks around each request: more than asked, never more than a block each side
            assert sum(sizes) <= src.bytes_read <= sum(sizes) + 2 * mcf.io.DIRECT_ALIGN * max(stats.requests, 1), \
                (src.bytes_read, sum(sizes), stats)
        if any(sizes):
            assert stats.bytes_read == src.bytes_read and 1 <= stats.threads <= threads
            assert stats.chunk_bytes >= chunk and stats.storage == src.storage
            # every worker of a per-worker-streams read has a descriptor of its own; one worker reads alone
            assert stats.streams == (stats.threads if streams and stats.threads > 1 and REOPENS else 0)


def _tiny_ranges(seed: int):
    """20,000 ranges of 0..16 bytes at random offsets, packed one after another into a zeroed output:
    ``(offsets, sizes, out, destinations)``."""
    rng = np.random.default_rng(seed)
    n = 20_000
    sizes = rng.integers(0, 17, n)
    offs = rng.integers(0, FILE_SIZE - 16, n)
    dsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return offs, sizes, np.zeros(int(sizes.sum()), np.uint8), dsts


def test_many_tiny_ranges_in_random_order(data_file):
    path, data = data_file
    offs, sizes, out, dsts = _tiny_ranges(3)
    with open_source(path, mmap=False) as src:
        src.read_ranges(offs, sizes, out, dsts, threads=8, chunk_bytes=4096)
        assert src.bytes_read == int(sizes.sum())
    want = b"".join(data[o:o + s] for o, s in zip(offs.tolist(), sizes.tolist()))
    assert out.tobytes() == want


def test_neighbours_are_coalesced(data_file):
    path, data = data_file
    with open_source(path, mmap=False) as src:
        out = np.empty(30_000, np.uint8)
        # three ranges adjacent in the file and in the arena, given out of order: one range, one request
        src.read_ranges([10_000, 0, 20_000], [10_000, 10_000, 10_000], out, [10_000, 0, 20_000], threads=4,
                        chunk_bytes=1 << 20)
        assert out.tobytes() == data[:30_000]
        assert src.read_stats.ranges == 1 and src.read_stats.requests == 1 and src.read_stats.threads == 1
        # adjacent in the file only: two ranges
        a, b = np.empty(100, np.uint8), np.empty(100, np.uint8)
        src.read_into([0, 100], [a, b])
        assert src.read_stats.ranges == 2


def test_requests_follow_chunk_boundaries_in_the_file(data_file):
    path, data = data_file
    with open_source(path, mmap=False) as src:
        out = np.empty(3 * 4096, np.uint8)
        src.read_ranges([100], [out.size], out, [0], threads=1, chunk_bytes=4096)
        # [100, 12388) touches the blocks starting at 0, 4096, 8192 and 12288: four requests
        assert src.read_stats.requests == 4 and out.tobytes() == data[100:100 + out.size]


@pytest.mark.parametrize("streams", [False, True])
@pytest.mark.parametrize("direct,misaligned", [(False, False), (True, False), (True, True)])
def test_file_that_shrank_gives_truncated_error_naming_the_offset(tmp_path, direct, misaligned, streams):
    """misaligned: a destination off the O_DIRECT alignment, so every request goes through the worker's
    staging buffer, including the one that meets the end of the file (whose bytes used to stay there).
    streams: 4 workers each own a MiB of the plan; the file now ends in the second, and the third and fourth
    fail at once (at their first byte): the error must still name where the file ended, and every byte
    before it must arrive."""
    data = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    p = tmp_path / "shrinks.bin"
    p.write_bytes(data)
    new_size = (1 << 20) + 123
    with open_source(p, mmap=False) as src:
        os.truncate(p, new_size)                 # after open: the source still believes 4 MiB
        out = aligned_empty(len(data) + 1)[1:] if misaligned else aligned_empty(len(data))
        with pytest.raises(mcf.TruncatedError) as exc:
            src.read_ranges([0], [len(data)], out, [0], threads=4, chunk_bytes=65536, direct=direct,
                            streams=streams)
        assert exc.value.offset == new_size and str(p) in str(exc.value)
        assert isinstance(exc.value, ValueError)
        # what arrived is counted, nothing more: every request before the end completed (requests are
        # handed out in file order, or each part read front to back by its worker), the ones past it
        # returned nothing
        assert src.bytes_read == new_size
        assert out[:new_size].tobytes() == data[:new_size]


def test_destinations_checked_before_any_byte_moves(data_file):
    path, data = data_file
    with open_source(path, mmap=False) as src:
        good = np.zeros(100, np.uint8)
        readonly = np.zeros(100, np.uint8)
        readonly.flags.writeable = False
        for bufs in ([good, b"read-only bytes"], [good, readonly], [good, memoryview(b"x" * 10)]):
            with pytest.raises(mcf.InvalidArgumentError):
                src.read_into([0, 10], bufs)
        arena = np.zeros(100, np.uint8)
        with pytest.raises(mcf.OutOfBoundsError):    # a destination past the end of the arena
            src.read_ranges([0, 10], [50, 60], arena, [0, 50])
        with pytest.raises(mcf.OutOfBoundsError):    # a source range past the end of the file
            src.read_ranges([0, FILE_SIZE - 5], [10, 10], arena, [0, 50])
        with pytest.raises(mcf.InvalidArgumentError):  # two ranges writing the same bytes
            src.read_ranges([0, 10], [50, 50], arena, [0, 49])
        with pytest.raises(mcf.InvalidArgumentError):  # two views of one buffer that overlap
            src.read_into([0, 10], [good[:60], good[50:]])
        with pytest.raises(mcf.InvalidArgumentError):
            src.read_ranges([0], [10], readonly, [0])
        for kw, err in ([{"threads": 0}, mcf.InvalidArgumentError], [{"threads": 2.0}, mcf.InvalidArgumentError],
                        [{"threads": mcf.io.MAX_THREADS + 1}, mcf.InvalidArgumentError],
                        [{"chunk_bytes": 4095}, mcf.InvalidArgumentError],
                        [{"chunk_bytes": mcf.io.MAX_CHUNK_BYTES + 1}, mcf.InvalidArgumentError],
                        [{"direct": 1}, mcf.ArgumentTypeError], [{"direct": "yes"}, mcf.ArgumentTypeError],
                        [{"streams": 1}, mcf.ArgumentTypeError], [{"streams": "yes"}, mcf.ArgumentTypeError]):
            with pytest.raises(err):
                src.read_into([0], [good], **kw)
            with pytest.raises(err):
                src.read_ranges([0], [10], arena, [0], **kw)
        assert not good.any() and not arena.any()
        assert src.bytes_read == 0 and src.read_stats is None
        # empty destinations may share an address: they receive nothing
        e = np.zeros(0, np.uint8)
        assert src.read_into([5, 7], [e, e]) == 0


def test_bytes_read_accumulates_exactly(data_file):
    path, data = data_file
    with open_source(path, mmap=False) as src:
        total = 0
        for threads, chunk in ((1, 4096), (5, 65536), (16, 1 << 20)):
            bufs = [np.empty(n, np.uint8) for n in (1, 4095, 4096, 4097, 1 << 20)]
            total += src.read_into([0, 1, 2, 3, 4], bufs, threads=threads, chunk_bytes=chunk)
            assert src.bytes_read == total
        src.read(0, 10)
        assert src.bytes_read == total + 10
        big = src.view(0, FILE_SIZE)                  # a pread-mode view of many chunks: through the engine
        assert big.tobytes() == data and src.bytes_read == total + 10 + FILE_SIZE


def test_defaults_follow_the_storage(data_file):
    path, data = data_file
    with open_source(path, mmap=False) as src:
        kind = src.storage.kind
        assert kind in storage.KINDS and src.storage == mcf.io.storage_of(path)
        out = np.empty(FILE_SIZE, np.uint8)
        src.read_ranges([0], [FILE_SIZE], out, [0])
        d = storage.defaults_for(kind)
        assert src.read_stats.chunk_bytes == d.chunk_bytes and src.read_stats.direct is False
        threads = min(d.threads, -(-FILE_SIZE // d.chunk_bytes))
        assert src.read_stats.threads == threads
        assert src.read_stats.streams == (threads if d.streams and threads > 1 and REOPENS else 0)
        assert out.tobytes() == data


def test_streams_many_small_ranges(data_file):
    """20,000 ranges of 0..16 bytes in random order, 16 per-worker streams over 4 KiB requests: each part
    is thousands of tiny requests, and a part boundary falls between (or inside) any of them."""
    path, data = data_file
    offs, sizes, out, dsts = _tiny_ranges(5)
    with open_source(path, mmap=False) as src:
        src.read_ranges(offs, sizes, out, dsts, threads=16, chunk_bytes=4096, streams=True)
        assert src.bytes_read == int(sizes.sum()) and src.read_stats.threads == 16
        assert src.read_stats.streams == (16 if REOPENS else 0)
    assert out.tobytes() == b"".join(data[o:o + s] for o, s in zip(offs.tolist(), sizes.tolist()))


@pytest.mark.parametrize("threads", [2, 7, 16])
def test_streams_one_huge_range(data_file, threads):
    """The whole file as one range: the parts are cut inside it (at chunk boundaries of the file), each
    read through its own descriptor, into one destination that starts off a page."""
    path, data = data_file
    out = aligned_empty(FILE_SIZE + 1)[1:]
    with open_source(path, mmap=False) as src:
        assert src.read_into([0], [out], threads=threads, chunk_bytes=4096, streams=True) == FILE_SIZE
        st_ = src.read_stats
        assert st_.threads == threads and st_.ranges == 1 and st_.bytes_read == FILE_SIZE
        assert st_.requests >= -(-FILE_SIZE // 4096)
        assert st_.streams == (threads if REOPENS else 0)
    assert out.tobytes() == data


def test_streams_ranges_across_part_boundaries(data_file):
    """Ranges of very different sizes, so that the parts (equal bytes each) begin and end inside ranges,
    inside a chunk's worth of a range and on range edges; neighbours in the file but not in memory stay
    two ranges, and the bytes between ranges are never written."""
    path, data = data_file
    sizes = [1, 4095, 4097, 700_001, 3, 65_536, 1_000_000, 17, 300_000, 12_345]
    offs, pos = [], 5
    for k, n in enumerate(sizes):
        offs.append(pos)
        pos += n + (0 if k % 3 else 777)            # some neighbours in the file, some gaps
    assert pos < FILE_SIZE
    for threads in (3, 4, 5, 10, 16):
        for chunk in (4096, 65536 + 512, 1 << 20):
            dsts, d = [], 0
            for n in sizes:
                d += 63
                dsts.append(d)
                d += n
            out = np.full(d + 1, 0xA5, np.uint8)
            with open_source(path, mmap=False) as src:
                src.read_ranges(offs, sizes, out, dsts, threads=threads, chunk_bytes=chunk, streams=True)
                assert src.bytes_read == sum(sizes)
            covered = np.zeros(out.size, bool)
            for o, n, d0 in zip(offs, sizes, dsts):
                assert out[d0:d0 + n].tobytes() == data[o:o + n], (threads, chunk, o, n)
                covered[d0:d0 + n] = True
            assert (out[~covered] == 0xA5).all()


@pytest.mark.parametrize("mmap", [False, True])
def test_streams_with_o_direct_alignment_fallbacks(data_file, mmap):
    """O_DIRECT in per-worker streams: aligned requests straight into aligned memory; a range or a
    destination off the 4 KiB alignment through the worker's staging buffer; the file's unaligned end.  (A
    filesystem that refuses O_DIRECT is read buffered, through each worker's own descriptor.)"""
    path, data = data_file
    cases = [(0, FILE_SIZE, 0), (4096, 1 << 20, 1), (1, FILE_SIZE - 1, 0), (12_345, 2_000_000, 4095),
             (FILE_SIZE - 70_000, 70_000, 7)]
    for off, n, skew in cases:
        out = aligned_empty(n + skew)[skew:]
        with open_source(path, mmap=mmap) as src:
            src.read_into([off], [out], threads=6, chunk_bytes=65536, direct=True, streams=True)
            assert out.tobytes() == data[off:off + n], (off, n, skew)
            # padding to whole blocks counts when O_DIRECT was used, nothing else does
            assert n <= src.bytes_read <= n + 2 * mcf.io.DIRECT_ALIGN * src.read_stats.requests


STREAMS_WITHOUT_DESCRIPTORS = textwrap.dedent(r"""
    import os, resource, sys
    import numpy as np
    from mcf.io import open_source
    path = sys.argv[1]
    want = np.fromfile(path, np.uint8)
    src = open_source(path, mmap=False)
    lowest = os.open(os.devnull, os.O_RDONLY)      # the lowest free descriptor number
    os.close(lowest)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))   # no open() succeeds from here on
    try:
        out = np.zeros(want.size, np.uint8)
        src.read_ranges([0], [want.size], out, [0], threads=8, chunk_bytes=4096, streams=True)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert np.array_equal(out, want), "wrong bytes"
    print(src.read_stats.threads, src.read_stats.streams)
""")


def test_streams_without_a_descriptor_left_read_through_the_shared_one(data_file):
    """Per-worker streams where the file cannot be reopened (here: no descriptor left, EMFILE): the workers
    read their parts through the source's own descriptor, with the same bytes.  In a child process: the
    descriptor limit is the process's."""
    r = subprocess.run([sys.executable, "-c", STREAMS_WITHOUT_DESCRIPTORS, str(data_file[0])], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["8", "0"]


def test_storage_table():
    assert storage.storage_for_magic(0x6969) == storage.Storage("network", "nfs", 0x6969)
    assert storage.storage_for_magic(0xFE534D42).kind == "network"                   # SMB2
    assert storage.storage_for_magic(storage.FUSE_MAGIC).kind == "fuse"
    assert storage.storage_for_magic(0xEF53).kind == "local"
    assert storage.storage_for_magic(0x12345678) == storage.Storage("unknown", "0x12345678", 0x12345678)
    # macOS names its filesystems (statfs f_fstypename) instead of numbering them the Linux way
    assert storage.storage_for_name("apfs") == storage.Storage("local", "apfs", None)
    assert storage.storage_for_name("smbfs").kind == storage.storage_for_name("nfs").kind == "network"
    assert storage.storage_for_name("macfuse").kind == storage.storage_for_name("ntfs-3g-fuse").kind == "fuse"
    assert storage.storage_for_name("zfs-unheard-of") == storage.Storage("unknown", "zfs-unheard-of", None)
    for kind in storage.KINDS:
        d = storage.defaults_for(kind)
        assert 1 <= d.threads <= mcf.io.MAX_THREADS
        assert mcf.io.MIN_CHUNK_BYTES <= d.chunk_bytes <= mcf.io.MAX_CHUNK_BYTES
    # the kinds that must not be mapped, and the ones that are
    assert {k for k in storage.KINDS if not storage.defaults_for(k).mmap} == {"network", "fuse", "object"}
    assert {kind for _, kind in storage.FILESYSTEMS.values()} <= set(storage.KINDS)
    # per-worker streams (a readahead window each) on local disks; network filesystems and object stores
    # keep every worker on the next request of one stream
    assert {k for k in storage.KINDS if storage.defaults_for(k).streams} == {"local", "unknown"}


def test_mmap_argument_is_checked(data_file):
    path, _ = data_file
    for bad in (1, "yes", 0.0):
        with pytest.raises(mcf.ArgumentTypeError):
            open_source(path, mmap=bad)
    with open_source(path) as src:
        assert src.mode == ("mmap" if storage.defaults_for(src.storage.kind).mmap else "pread")


CLOSE_DURING_ENGINE = r"""
import sys, threading, time, numpy as np, mcf
from mcf.io import aligned_empty, open_source
path, rounds = sys.argv[1], int(sys.argv[2])
want = np.fromfile(path, np.uint8)
outcomes = {"ok": 0, "closed": 0}
for rnd in range(rounds):
    src = open_source(path, mmap=rnd % 2 == 0)
    fd = src.fileno()
    out = np.zeros(want.size, np.uint8)
    started = threading.Event()
    def read():
        started.set()
        try:
            src.read_ranges([0], [want.size], out, [0], threads=4, chunk_bytes=4096, direct=rnd % 4 == 1)
            assert np.array_equal(out, want), "wrong bytes"
            outcomes["ok"] += 1
        except mcf.ClosedError:
            outcomes["closed"] += 1
    t = threading.Thread(target=read)
    t.start()
    started.wait()
    time.sleep(0.0005 * (rnd % 8))
    src.close()
    t.join()
    try:                       # the engine's last request released the descriptor
        import os
        os.fstat(fd)
        raise AssertionError("descriptor still open after close() and the read")
    except OSError:
        pass
print(outcomes)
"""


def test_close_from_another_thread_while_the_engine_runs(tmp_path):
    """close() while the engine reads: the read completes with the right bytes (or is refused before it
    starts), the process survives, and the descriptor is closed by the time both are done (pin/unpin).
    In a child process, so a crash fails this test instead of killing the suite."""
    p = tmp_path / "big.bin"
    np.random.default_rng(2).integers(0, 256, 24 << 20, dtype=np.uint8).tofile(p)
    r = subprocess.run([sys.executable, "-c", CLOSE_DURING_ENGINE, str(p), "24"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "'ok'" in r.stdout


@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_engine_under_sanitizers(tmp_path, data_file, sanitizer):
    """The C engine alone (tests/readengine_stress.c) built with ThreadSanitizer (a data race between the
    workers, the counter and the failure record is reported) and with AddressSanitizer + UBSan (a read or
    write outside a range or a buffer is reported): random plans must give pread's bytes, with no
    report (the sanitizers exit non-zero on one)."""
    import shutil
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) to build the sanitized engine")
    here = os.path.dirname(os.path.abspath(__file__))
    csrc = os.path.join(here, "..", "csrc")
    exe = tmp_path / "stress"
    build = subprocess.run([cc, "-std=c11", "-O1", "-g", f"-fsanitize={sanitizer}", "-fno-sanitize-recover=all",
                            "-I", csrc, os.path.join(here, "readengine_stress.c"), "-o", str(exe), "-lpthread"],
                           capture_output=True, text=True, timeout=300)
    missing = ("cannot find -l", "unrecognized", "unsupported option")   # no runtime library, or no such flag
    if build.returncode != 0 and any(m in build.stderr for m in missing):
        pytest.skip(f"this compiler has no -fsanitize={sanitizer} runtime: {build.stderr.strip()[-200:]}")
    assert build.returncode == 0, build.stderr
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1", ASAN_OPTIONS="detect_leaks=1")
    r = subprocess.run([str(exe), str(data_file[0]), "60"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
