"""What fresh destination memory costs on this machine, and what makes it cheaper: the investigation behind
``mcf.io.aligned_empty`` taking its memory from the C allocator instead of numpy's (bench/results/loading.md,
"Fresh destination memory").

    python bench/fresh_memory.py                 # 1 GiB, 5 rounds
    python bench/fresh_memory.py --size 0.5 --rounds 3

A loader's result is fresh memory: its pages are faulted in while the read engine fills it, and every
load in a new process pays for all of them.  Each case below gets 1 GiB of fresh memory one way and
fills it with 2 threads (``memset`` of each half through ctypes, which releases the GIL), in a fresh
process, after ``--settle`` idle seconds; it prints the time from the allocation to the last byte
written, and the system time (the page faults):

- ``4k``: an anonymous mapping with the system's page policy (``madvise`` THP here: 4 KiB pages);
- ``hugepage``: the same after ``madvise(MADV_HUGEPAGE)`` (what numpy does for arrays of 4 MiB or more);
- ``numpy``: ``np.empty`` itself;
- ``populate``: ``MAP_POPULATE`` (the kernel faults everything in ``mmap``, one thread);
- ``populate-write``: ``madvise(MADV_POPULATE_WRITE)`` by the 2 threads, each its half, then the writes;
- ``hugepage-populate``: ``MADV_HUGEPAGE`` and then ``MADV_POPULATE_WRITE`` by the 2 threads;
- ``reused-at-once`` / ``reused-after``: 1 GiB with huge pages faulted in, unmapped, and mapped again at
  once or after ``--settle`` seconds: whether the cost is the guest's page fault or the memory behind it
  (a balloon's free page reporting hands freed memory back to the host, whose next first touch is slow).

The transparent huge page settings (``/sys/kernel/mm/transparent_hugepage``) are printed with the results.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from host_state import load_average, machine  # noqa: E402

MADV_POPULATE_WRITE = 23   # Linux 5.14
PAGE = 4096
CASES = ["4k", "hugepage", "numpy", "populate", "populate-write", "hugepage-populate", "reused-at-once",
         "reused-after"]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _in_halves(fn, n):
    """``fn(start, length)`` on each page-aligned half of ``n`` bytes, by 2 threads."""
    half = n // 2 // PAGE * PAGE
    ts = [threading.Thread(target=fn, args=a) for a in ((0, half), (half, n - half))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _touch(addr, n):
    """Every byte written, by 2 threads (memset through ctypes releases the GIL): the destination filled."""
    lib = ctypes.CDLL(None)
    lib.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    _in_halves(lambda start, length: lib.memset(addr + start, 1, length), n)


def _anon(n, flags=0):
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def child(case: str, n: int, settle: float) -> dict:
    import numpy as np
    libc = _libc()
    keep = []
    if case.startswith("reused"):
        m, a = _anon(n)
        m.madvise(mmap.MADV_HUGEPAGE)
        _touch(a, n)
        m.close()
        if case == "reused-after":
            time.sleep(settle)
    c0, t0 = os.times(), time.perf_counter()
    if case == "numpy":
        arr = np.empty(n, np.uint8)
        addr = arr.ctypes.data
        keep.append(arr)
    else:
        m, addr = _anon(n, mmap.MAP_POPULATE if case == "populate" else 0)
        keep.append(m)
        if case in ("hugepage", "hugepage-populate", "reused-at-once", "reused-after"):
            m.madvise(mmap.MADV_HUGEPAGE)
        if case in ("populate-write", "hugepage-populate"):
            _in_halves(lambda s, k: libc.madvise(addr + s, k, MADV_POPULATE_WRITE), n)
    _touch(addr, n)
    dt, c1 = time.perf_counter() - t0, os.times()
    return {"case": case, "gbps": n / dt / 1e9, "system_s": c1.system - c0.system, "load": load_average()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=1.0, help="GiB (default 1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--settle", type=float, default=10.0, help="idle seconds before every case (default 10)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    n = int(a.size * 2**30) // PAGE * PAGE
    if a.child:
        print(json.dumps(child(a.child, n, a.settle)))
        return
    print(f"{n / 2**30:.2f} GiB per case; {machine()}; load {load_average():.2f}", flush=True)
    res = {c: [] for c in CASES}
    for r in range(a.rounds):
        order = list(CASES)
        random.Random(r).shuffle(order)
        for c in order:
            time.sleep(a.settle)
            p = subprocess.run([sys.executable, __file__, "--child", c, "--size", str(a.size),
                                "--settle", str(a.settle)],
                               capture_output=True, text=True, timeout=600, check=True)
            res[c].append(json.loads(p.stdout))
    print(f"medians of {a.rounds} interleaved rounds, each case in a fresh process; "
          f"load {load_average():.2f} at the end")
    for c, v in res.items():
        print(f"  {c:18s} {statistics.median(x['gbps'] for x in v):6.2f} GB/s  system "
              f"{statistics.median(x['system_s'] for x in v):5.2f} s  ("
              + ", ".join(f"{x['gbps']:.2f}" for x in v) + ")")


if __name__ == "__main__":
    main()
