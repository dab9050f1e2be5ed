#!/usr/bin/env python
"""Reproducer: ``Source.close()`` racing with readers in other threads, per I/O mode.

    python fuzz/close_race.py                 # every mode, one child process each
    python fuzz/close_race.py --mode mmap

Four threads copy a 32 MiB file with ``readinto`` and ``read_ranges`` (GIL released) while the main
thread closes the source after 0-16 ms.  The contract: each call returns the right bytes or raises an
``mcf.MCFError``, and the process survives.  Each mode runs in a child process, so a crash is reported
as its signal instead of killing this script.  Written when the mmap and memory modes died with SIGSEGV
(the copy read ``base`` after ``close()`` had cleared it and did not keep the mapping alive); fixed in
the I/O core by counting copies in flight (commit 24863c0), and tests/test_io.py runs this script.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODES = ("pread", "fileobj", "memory", "mmap")


def race(mode: str, path: str, rounds: int) -> dict:
    import numpy as np

    import mcf
    from mcf.io import open_source

    data = Path(path).read_bytes()
    out = collections.Counter()
    for rnd in range(rounds):
        fobj = open(path, "rb") if mode == "fileobj" else None  # noqa: SIM115
        src = (open_source(fobj) if fobj else open_source(memoryview(data)) if mode == "memory"
               else open_source(path, mmap=mode == "mmap"))
        barrier = threading.Barrier(5)

        def work(k):
            barrier.wait()
            for _ in range(4):
                try:
                    if k % 2:
                        buf = np.empty(len(data) // 2, np.uint8)
                        src.readinto(len(data) // 4, buf)
                        ok = buf.tobytes() == data[len(data) // 4:len(data) // 4 + len(buf)]
                    else:
                        buf = np.empty(len(data), np.uint8)
                        src.read_ranges([0], [len(data)], buf, [0])
                        ok = buf.tobytes() == data
                    out["ok" if ok else "WRONG BYTES"] += 1
                except mcf.MCFError as exc:
                    out[type(exc).__name__] += 1

        ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        barrier.wait()
        time.sleep(0.004 * (rnd % 5))
        src.close()
        for t in ts:
            t.join()
        if fobj:
            fobj.close()
    return dict(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=MODES)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(race(args.child[0], args.child[1], args.rounds), flush=True)
        return 0
    import numpy as np

    rc = 0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "data.bin")
        np.random.default_rng(7).integers(0, 256, 32 << 20, dtype=np.uint8).tofile(path)
        for mode in [args.mode] if args.mode else MODES:
            p = subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--child", mode, path],
                               capture_output=True, text=True, cwd=str(Path(__file__).resolve().parent.parent))
            if p.returncode == 0 and "WRONG" not in p.stdout:
                print(f"{mode}: ok {p.stdout.strip()}")
            else:
                rc = 1
                how = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
                print(f"{mode}: FAILED ({how}) {p.stdout.strip()} {p.stderr.strip()[-500:]}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
