"""Which workers x chunk size (and O_DIRECT or not) the read engine should use on local storage, measured.

A script, not a pytest benchmark: it sweeps settings of ``Source.read_ranges`` (the read engine) over one
file of random bytes read as a checkpoint would be (consecutive tensors of 1 KiB..64 MiB, log-uniform,
into one page-aligned arena with 64-byte padding between them, as ``Container.load`` lays it out), cold
(``sync; echo 3 > /proc/sys/vm/drop_caches`` before every run: needs root) and warm (the file read once
just before), against two anchors measured in the same rounds: a single-threaded copy out of a mapping
(what a mapped reader's copy costs) and, where the ``liburing`` package imports, io_uring reads of the
same plan at several queue depths.  Rounds are interleaved (every setting once per round, in a shuffled
order), figures are medians, and the load average is printed before and after.  The figures behind the
defaults in ``mcf/_core/storage.py`` came from this script (docs/io.md).

    python bench/read_engine_settings.py                       # 1.5 GB, 3 rounds, cold and warm
    python bench/read_engine_settings.py --size 0.5e9 --rounds 5 --only warm
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import tempfile
import time

import numpy as np

import fio
from host_state import drop_caches

from mcf.io import alloc_buffer, open_source

MiB = 1 << 20


def make_file(path: str, size: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    rng = np.random.default_rng(20260101)
    with open(path + ".tmp", "wb") as f:
        left = size
        while left:
            n = min(left, 64 * MiB)
            f.write(rng.integers(1, 256, n, dtype=np.uint8).tobytes())
            left -= n
    os.replace(path + ".tmp", path)


def make_plan(size: int):
    """Consecutive tensors covering the file, 1 KiB..64 MiB each (log-uniform), and their arena offsets."""
    rng = np.random.default_rng(7)
    offs, sizes = [], []
    pos = 0
    while pos < size:
        n = int(min(size - pos, 2 ** rng.uniform(10, 26)))
        offs.append(pos)
        sizes.append(n)
        pos += n
    dsts, d = [], 0
    for n in sizes:
        dsts.append(d)
        d += (n + 63) & ~63
    return np.array(offs), np.array(sizes), np.array(dsts), d


def touch(path: str) -> None:
    buf = alloc_buffer(8 * MiB)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def engine(src, plan, threads, chunk, direct):
    offs, sizes, dsts, total = plan

    def run():
        out = alloc_buffer(total)
        src.read_ranges(offs, sizes, out, dsts, threads=threads, chunk_bytes=chunk, direct=direct)
        return out
    run.plan = plan
    return run


def mmap_copy(path, plan):
    offs, sizes, dsts, total = plan

    def run():
        with open_source(path, mmap=True) as src:
            whole = src.view(0, src.size)
            out = alloc_buffer(total)
            for o, n, d in zip(offs.tolist(), sizes.tolist(), dsts.tolist()):
                out[d:d + n] = whole[o:o + n]
        return out
    run.plan = plan
    return run


def uring(path, plan, depth, chunk):
    import liburing as lu
    offs, sizes, dsts, total = plan
    pieces = []
    for o, n, d in zip(offs.tolist(), sizes.tolist(), dsts.tolist()):
        k = 0
        while k < n:
            m = min(chunk, n - k)
            pieces.append((o + k, m, d + k))
            k += m

    # liburing's Iovec never releases the buffers it is given, so the arena is allocated once and its pages
    # handed back to the kernel before every run (MADV_DONTNEED): each run faults fresh pages in, as a
    # new arena would, with huge pages where numpy's arena gets them too
    arena = mmap.mmap(-1, total)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        arena.madvise(mmap.MADV_HUGEPAGE)
    mv = memoryview(arena)

    def run():
        arena.madvise(mmap.MADV_DONTNEED)
        out = np.frombuffer(arena, np.uint8)
        ring, cqe = lu.Ring(), lu.Cqe()
        lu.io_uring_queue_init(depth, ring)
        fd = os.open(path, os.O_RDONLY)
        iovecs = {}   # kept alive until their read completes
        try:
            nxt, inflight = 0, 0
            while nxt < len(pieces) or inflight:
                while nxt < len(pieces) and inflight < depth:
                    o, m, d = pieces[nxt]
                    sqe = lu.io_uring_get_sqe(ring)
                    iovecs[nxt] = lu.Iovec([mv[d:d + m]])   # straight into the arena (prep_read takes bytearrays only)
                    lu.io_uring_prep_readv(sqe, fd, iovecs[nxt], o)
                    sqe.user_data = nxt
                    nxt += 1
                    inflight += 1
                lu.io_uring_submit(ring)
                lu.io_uring_wait_cqe(ring, cqe)
                e = cqe[0]
                got, k = e.res, e.user_data
                lu.io_uring_cqe_seen(ring, e)
                del iovecs[k]
                inflight -= 1
                if got != pieces[k][1]:
                    raise AssertionError(f"io_uring: short read {got} of {pieces[k][1]}")
        finally:
            os.close(fd)
            lu.io_uring_queue_exit(ring)
        return out
    run.plan = plan
    return run


# (threads, chunk bytes, O_DIRECT): every worker count at one chunk size, every chunk size at one worker
# count, Run:ai Model Streamer's filesystem default (16 x 2 MiB), and O_DIRECT at two points
DEFAULT_SETTINGS = ["1x8", "2x8", "4x8", "8x8", "16x8", "4x0.5", "4x2", "4x32", "16x2", "4x8d", "16x2d"]


def parse_setting(text: str):
    """"THREADSxCHUNK_MIB", with a trailing "d" for O_DIRECT: "16x2d"."""
    direct = text.endswith("d")
    t, c = text.rstrip("d").split("x")
    return int(t), int(float(c) * MiB), direct


def page_congruent(plan):
    """The plan with every destination at the same offset within its page as its range in the file, so
    that requests starting on a page of the file land on a page of the arena."""
    offs, sizes, _, _ = plan
    dsts, d = [], 0
    for o, n in zip(offs.tolist(), sizes.tolist()):
        d += (o - d) % 4096
        dsts.append(d)
        d += n
    return offs, sizes, np.array(dsts), d


def settings(path, src, plan, args):
    out = {}
    for text in args.settings:
        t, c, direct = parse_setting(text)
        out[f"engine t={t:<2} chunk={c // 1024:>5}K{' direct' if direct else ''}"] = engine(src, plan, t, c, direct)
    if args.congruent != "none":
        t, c, direct = parse_setting(args.congruent)
        out[f"engine t={t:<2} chunk={c // 1024:>5}K, page-congruent arena"] = engine(src, page_congruent(plan), t,
                                                                                      c, direct)
    out["mmap copy (1 thread)"] = mmap_copy(path, plan)
    if args.no_uring:
        return out
    try:
        import liburing  # noqa: F401
        for depth in (4, 16):
            out[f"io_uring (liburing) depth={depth} chunk=2048K"] = uring(path, plan, depth, 2 * MiB)
    except ImportError:
        print("liburing not installed: io_uring not measured")
    return out


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1.5e9)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=["cold", "warm"])
    ap.add_argument("--dir", default=os.environ.get("MCF_BENCH_DIR", os.path.join(tempfile.gettempdir(), "mcf-bench")))
    ap.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS,
                    help='THREADSxCHUNK_MIB[d], "d" for O_DIRECT (default: %(default)s)')
    ap.add_argument("--congruent", default="4x8",
                    help='the setting also measured with a page-congruent arena, or "none" (default: 4x8)')
    ap.add_argument("--no-uring", action="store_true", help="leave io_uring out")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    size = int(args.size)
    path = os.path.join(args.dir, f"engine-{size}.bin")
    make_file(path, size)
    plan = make_plan(size)
    print(f"{path}: {size / 1e9:.2f} GB, {len(plan[0])} ranges; load before: {load()}")
    src = open_source(path, mmap=False)
    runs = settings(path, src, plan, args)
    # every setting must give the file's bytes
    with open(path, "rb") as f:
        want = np.frombuffer(f.read(), np.uint8)
    for name, fn in runs.items():
        offs, sizes, dsts, _ = fn.plan
        got = fn()
        for o, n, d in zip(offs.tolist()[::97], sizes.tolist()[::97], dsts.tolist()[::97]):
            assert np.array_equal(got[d:d + n], want[o:o + n]), name
        del got
    del want
    modes = [args.only] if args.only else ["cold", "warm"]
    if "cold" in modes and os.geteuid() != 0:
        raise SystemExit("cold runs drop the page cache: run as root, or with --only warm")
    for mode in modes:
        times = {name: [] for name in runs}
        for rnd in range(args.rounds):
            order = list(runs)
            random.Random(rnd).shuffle(order)
            for name in order:
                if mode == "cold":
                    drop_caches()
                else:
                    touch(path)
                t0 = time.perf_counter()
                out = runs[name]()
                times[name].append(time.perf_counter() - t0)
                del out
        print(f"\n{mode}: GB/s, median of {args.rounds} interleaved rounds (load after: {load()})")
        for name, ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            med = statistics.median(ts)
            print(f"  {name:45s} {size / med / 1e9:6.2f}   ({', '.join(f'{size / t / 1e9:.2f}' for t in ts)})")
    src.close()
    if fio.available():
        print("\nfio (the storage's limit), sequential 8 MiB reads of the same file, cold:")
        for direct in (False, True):
            for jobs in (1, 2, 4):
                drop_caches()
                gbps = fio.sequential_read(path, size, direct=direct, jobs=jobs)
                print(f"  fio direct={int(direct)} jobs={jobs}: {gbps:.2f} GB/s")

if __name__ == "__main__":
    main()
