"""A checkpoint read from a cold page cache, against the storage's limit measured in the same run: fio's best
sequential read of the file, and a plain striped ``pread`` by N threads.

    python -m pytest bench/test_bench_cold_read.py --benchmark-only -s      # 3 rounds, ~20 min
    python bench/test_bench_cold_read.py --rounds 3 --json out.json          # the same as a script
    python bench/test_bench_cold_read.py --rounds 1 --cases fio:buffered:4:8M engine:16:streams:touched

The file is bench/loading_model.py's checkpoint (one safetensors file of 1.67 GB, 147 bf16 tensors, and the
same weights as ``model.mcf``).  Every measurement runs in a fresh process (``--child``), timed inside it
after its imports; the parent evicts the files from the page cache first with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed; ``drop_caches`` is not writable everywhere) and
records how much of them stayed resident (``mincore``; it should be 0%).  Rounds are interleaved (every case
once per round, in a shuffled order) after ``--settle`` idle seconds each; figures are medians, with the
child's system CPU time ("sys": the kernel's read path and page faults).

The cases:

- ``fio:{buffered,direct}:{1,2,4}:{1M,4M,8M,16M}``: fio 3.x, ``psync``, ``--readonly``, N jobs each reading
  its own consecutive part of the file (``--offset_increment``): the storage's limit is the best median.
- ``pread:N:{fresh,touched}``: N Python threads, each with a descriptor of its own, read one contiguous
  1/N of the file in 8 MiB ``os.preadv`` calls into one buffer: fresh (allocated in the timed region:
  the reads fault its pages in) or touched (allocated and written before).  No hints, no tricks: what a
  plain loop gets.
- ``engine:T:{streams,shared}:{touched,fresh}``: ``Source.read_into`` of every tensor's bytes into one
  array per tensor (page-aligned, as the loaders allocate them), with T workers, through per-worker
  streams (the local default) or one shared stream (every worker taking the next request through one
  descriptor: the layout before, and still the network filesystems').
- not in the default list: ``engine:T:direct:MEM`` (per-worker streams with O_DIRECT);
  ``engine:T:LAYOUT:MEM:arena``, the whole file as one range into one buffer; ``load:WHICH:T``, a loader
  with ``threads=T``.
- the loaders, with their defaults: ``mcf.safetensors.load_file`` (numpy), ``mcf.torch.load_file``,
  ``mcf.load_file`` of the .mcf (fresh memory: the result is new), and ``mcf.torch.load_into`` into
  tensors allocated and touched before the timed region.

Targets (printed with a met/NO verdict; a miss is a finding, not a failure):

- into touched memory (the engine's default layout, ``mcf.torch.load_into``): >= 0.9x fio's best;
- into fresh memory (the three loaders): >= 0.95x the best plain striped pread into fresh memory.

Round 0 checks every case's bytes (a CRC-32 of what it read against the file's).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

MiB = 1 << 20
FIO_BS = ("1M", "4M", "8M", "16M")


def all_cases(fio_bs=FIO_BS, workers=(4, 8, 16)) -> list:
    out = [f"fio:{kind}:{jobs}:{bs}" for kind in ("buffered", "direct") for jobs in (1, 2, 4) for bs in fio_bs]
    out += [f"pread:{n}:{mem}" for n in (1, 2, 4, 8, 16) for mem in ("fresh", "touched")]
    out += [f"engine:{t}:streams:{mem}" for t in workers for mem in ("touched", "fresh")]
    out += ["engine:16:shared:touched", "engine:16:shared:fresh"]
    out += ["load:safetensors", "load:torch", "load:mcf", "load_into:torch"]
    return out


# -- the page cache ------------------------------------------------------------------------------------
def evict(path: str) -> None:
    from bench_common import evict_page_cache

    evict_page_cache(path)


def resident(path: str) -> float:
    """Fraction of the file's pages in the page cache (mincore over a read-only mapping of it)."""
    import numpy as np
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = np.zeros(pages, np.uint8)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        try:
            view = np.frombuffer(m, np.uint8)
            rc = libc.mincore(view.ctypes.data, size, vec.ctypes.data)
            del view
        finally:
            m.close()
    return float("nan") if rc else float((vec & 1).sum()) / pages


# -- the file's tensors -----------------------------------------------------------------------------------
def safetensors_ranges(path: str) -> list:
    """(name, offset, size) of every tensor of a safetensors file, in file order."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    base = 8 + n
    out = [(k, base + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
           for k, v in header.items() if k != "__metadata__"]
    return sorted(out, key=lambda t: t[1])


def reference_crcs(path: str) -> dict:
    """CRC-32 of the whole file and of its tensors' bytes in file order."""
    whole = tensors = 0
    ranges = safetensors_ranges(path)
    with open(path, "rb") as f:
        data = f.read()
    whole = zlib.crc32(data)
    for _, o, n in ranges:
        tensors = zlib.crc32(memoryview(data)[o:o + n], tensors)
    return {"whole": whole, "tensors": tensors}


# -- one case, in a fresh process -----------------------------------------------------------------------
def _fill(arrays) -> None:
    for a in arrays:
        a.fill(1)


def _pread_case(path, n, mem, verify):
    import numpy as np

    from mcf.io import aligned_empty
    size = os.path.getsize(path)
    if mem == "touched":
        buf = aligned_empty(size)
        buf.fill(1)
    part = (-(-size // n) + 4095) // 4096 * 4096 if n > 1 else size

    def read(k, out):
        lo, hi = k * part, min(size, (k + 1) * part)
        fd = os.open(path, os.O_RDONLY)
        try:
            mv = memoryview(out)
            pos = lo
            while pos < hi:
                got = os.preadv(fd, [mv[pos:min(hi, pos + 8 * MiB)]], pos)
                if got <= 0:
                    raise OSError(f"short read at {pos}")
                pos += got
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    if mem == "fresh":
        buf = aligned_empty(size)
    ts = [threading.Thread(target=read, args=(k, buf)) for k in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    out = {"seconds": dt, "nbytes": size}
    if verify:
        out["crc"] = {"whole": zlib.crc32(np.asarray(buf))}
    return out


def _engine_case(path, threads, layout, mem, verify):
    from mcf.io import aligned_empty, open_source
    ranges = safetensors_ranges(path)
    src = open_source(path, mmap=False)
    if mem == "touched":
        bufs = [aligned_empty(n) for _, _, n in ranges]
        _fill(bufs)
    t0 = time.perf_counter()
    if mem == "fresh":
        bufs = [aligned_empty(n) for _, _, n in ranges]
    got = src.read_into([o for _, o, _ in ranges], bufs, threads=threads, streams=layout != "shared",
                        direct=layout == "direct")
    dt = time.perf_counter() - t0
    out = {"seconds": dt, "nbytes": got, "read_stats": str(src.read_stats)}
    if verify:
        c = 0
        for b in bufs:
            c = zlib.crc32(b, c)
        out["crc"] = {"tensors": c}
    src.close()
    return out


def _arena_case(path, threads, layout, mem, verify):
    import numpy as np

    from mcf.io import aligned_empty, open_source
    size = os.path.getsize(path)
    src = open_source(path, mmap=False)
    if mem == "touched":
        buf = aligned_empty(size)
        buf.fill(1)
    t0 = time.perf_counter()
    if mem == "fresh":
        buf = aligned_empty(size)
    src.read_ranges([0], [size], buf, [0], threads=threads, streams=layout == "streams")
    dt = time.perf_counter() - t0
    out = {"seconds": dt, "nbytes": size, "read_stats": str(src.read_stats)}
    if verify:
        out["crc"] = {"whole": zlib.crc32(np.asarray(buf))}
    src.close()
    return out


def _tensors_crc(sd, ranges) -> int:
    import numpy as np
    c = 0
    for name, _, _ in ranges:
        t = sd[name]
        if hasattr(t, "numpy"):
            import torch
            t = t.view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()
        c = zlib.crc32(np.ascontiguousarray(t).view(np.uint8), c)
    return c


def _load_case(which, m, verify, threads=None):
    ranges = safetensors_ranges(m.single)
    if which == "safetensors":
        import mcf.safetensors
        fn = lambda: mcf.safetensors.load_file(m.single, threads=threads)  # noqa: E731
    elif which == "torch":
        import mcf.torch
        fn = lambda: mcf.torch.load_file(m.single, threads=threads)  # noqa: E731
    else:
        import mcf
        fn = lambda: mcf.load_file(m.mcf, threads=threads)  # noqa: E731
    t0 = time.perf_counter()
    sd = fn()
    dt = time.perf_counter() - t0
    out = {"seconds": dt, "nbytes": sum(n for _, _, n in ranges)}
    if verify:
        out["crc"] = {"tensors": _tensors_crc(sd, ranges)}
    return out


def _load_into_case(m, verify):
    import torch

    import mcf.torch
    from safetensors import safe_open
    ranges = safetensors_ranges(m.single)
    with safe_open(m.single, "pt") as f:
        shapes = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
    dt_of = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    tensors = {k: torch.empty(s, dtype=dt_of[d]) for k, (s, d) in shapes.items()}
    for t in tensors.values():
        t.view(torch.uint8).fill_(1)
    t0 = time.perf_counter()
    mcf.torch.load_into(tensors, m.single)
    dt = time.perf_counter() - t0
    out = {"seconds": dt, "nbytes": sum(n for _, _, n in ranges)}
    if verify:
        out["crc"] = {"tensors": _tensors_crc(tensors, ranges)}
    return out


def child(spec: dict) -> dict:
    from loading_model import loading_model
    case, verify = spec["case"], spec["verify"]
    m = loading_model()
    parts = case.split(":")
    c0 = os.times()
    out = _child_case(parts, m, verify)
    c1 = os.times()
    out["user_s"], out["sys_s"] = c1.user - c0.user, c1.system - c0.system
    return out


def _child_case(parts, m, verify):
    if parts[0] == "pread":
        return _pread_case(m.single, int(parts[1]), parts[2], verify)
    if parts[0] == "engine":
        if parts[4:] == ["arena"]:
            return _arena_case(m.single, int(parts[1]), parts[2], parts[3], verify)
        return _engine_case(m.single, int(parts[1]), parts[2], parts[3], verify)
    if parts[0] == "load":
        return _load_case(parts[1], m, verify, int(parts[2]) if len(parts) > 2 else None)
    if parts[0] == "load_into":
        return _load_into_case(m, verify)
    raise SystemExit(f"unknown case {':'.join(parts)}")


# -- fio --------------------------------------------------------------------------------------------------
def fio_case(path: str, kind: str, jobs: int, bs: str) -> dict:
    size = os.path.getsize(path)
    part = size // jobs // (1 << 20) * (1 << 20)   # whole MiB: O_DIRECT offsets stay aligned
    r = subprocess.run(["fio", "--name=seq", f"--filename={path}", "--readonly", "--rw=read", f"--bs={bs}",
                        f"--direct={int(kind == 'direct')}", f"--numjobs={jobs}", "--group_reporting",
                        f"--size={part}", f"--offset_increment={part}", "--ioengine=psync",
                        "--output-format=json"], capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"fio failed: {r.stderr[-2000:]}")
    job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]["read"]
    return {"seconds": job["runtime"] / 1000, "nbytes": job["io_bytes"]}


# -- the parent ---------------------------------------------------------------------------------------------
def run_case(case: str, m, verify: bool, files: list) -> dict:
    for f in files:
        evict(f)
    res = {f: resident(f) for f in files}
    load0 = os.getloadavg()[0]
    if case.startswith("fio:"):
        _, kind, jobs, bs = case.split(":")
        r = fio_case(m.single, kind, int(jobs), bs)
    else:
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                            json.dumps({"case": case, "verify": verify})],
                           capture_output=True, text=True, timeout=900, env=env)
        if p.returncode:
            raise RuntimeError(f"{case} failed:\n{p.stderr[-3000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
    r["resident_before"] = max(res.values())
    r["load"] = load0
    return r


def wait_for(pattern: str, most: float) -> None:
    """Wait (at most ``most`` seconds) until no process matches ``pattern`` (pgrep -f)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < most:
        if subprocess.run(["pgrep", "-f", pattern], capture_output=True).returncode != 0:
            return
        time.sleep(15)


def measure(cases: list, rounds: int, settle: float, log=print) -> dict:
    from loading_model import loading_model
    m = loading_model()
    files = [m.single, m.mcf]
    want = reference_crcs(m.single)
    runs = {c: [] for c in cases}
    for rnd in range(rounds):
        order = list(cases)
        random.Random(rnd).shuffle(order)
        log(f"round {rnd + 1}/{rounds}, load {os.getloadavg()[0]:.2f}")
        for case in order:
            time.sleep(settle)
            r = run_case(case, m, rnd == 0, files)
            for k, v in r.pop("crc", {}).items():
                if v != want[k]:
                    raise AssertionError(f"{case}: CRC-32 of the {k} bytes {v:#x}, the file's {want[k]:#x}")
            runs[case].append(r)
            log(f"  {case:32s} {r['nbytes'] / r['seconds'] / 1e9:6.2f} GB/s  (resident before "
                f"{r['resident_before'] * 100:.1f}%, load {r['load']:.1f})")
    return runs


def summarize(runs: dict) -> tuple:
    gbps = {c: statistics.median(r["nbytes"] / r["seconds"] / 1e9 for r in rs) for c, rs in runs.items() if rs}
    lines = [f"GB/s, medians of {max(len(rs) for rs in runs.values())} interleaved rounds, each case in a fresh "
             "process from a cold page cache (posix_fadvise DONTNEED)"]
    for c in sorted(gbps, key=lambda c: (c.split(":")[0], -gbps[c])):
        rs = runs[c]
        each = ", ".join(f"{r['nbytes'] / r['seconds'] / 1e9:.2f}" for r in rs)
        cpu = [r["sys_s"] for r in rs if "sys_s" in r]
        lines.append(f"  {c:32s} {gbps[c]:6.2f}   ({each})"
                     + (f"  sys {statistics.median(cpu):.2f} s" if cpu else "")
                     + f"  resident<= {max(r['resident_before'] for r in rs) * 100:.1f}%"
                     f"  load {min(r['load'] for r in rs):.1f}-{max(r['load'] for r in rs):.1f}")
    verdicts = []
    fio = {c: v for c, v in gbps.items() if c.startswith("fio:")}
    fresh = {c: v for c, v in gbps.items() if c.startswith("pread:") and c.endswith(":fresh")}
    if fio:
        best = max(fio, key=fio.get)
        for c in sorted(gbps):
            if (c.startswith("engine:") and ":streams:touched" in c) or c == "load_into:torch" \
                    or c.startswith("pread:") and c.endswith(":touched"):
                verdicts.append((c, f"{gbps[c] / fio[best]:.2f}x fio's best ({best}, {fio[best]:.2f} GB/s)",
                                 ">= 0.9x", gbps[c] >= 0.9 * fio[best]))
    if fresh:
        best = max(fresh, key=fresh.get)
        same = f"pread:{defaults_threads()}:fresh"
        for c in sorted(gbps):
            if c.startswith("load:") or (c.startswith("engine:") and ":streams:fresh" in c):
                what = (f"{gbps[c] / fresh[best]:.2f}x the best plain pread into fresh memory ({best}, "
                        f"{fresh[best]:.2f})")
                if same in fresh and same != best:
                    what += f"; {gbps[c] / fresh[same]:.2f}x {same}"
                verdicts.append((c, what, ">= 0.95x", gbps[c] >= 0.95 * fresh[best]))
    lines.append("")
    for mem in ("touched", "fresh"):
        for t in sorted({int(c.split(":")[1]) for c in gbps if c.startswith("engine:")}):
            a, b = f"engine:{t}:streams:{mem}", f"engine:{t}:shared:{mem}"
            if a in gbps and b in gbps:
                lines.append(f"  {a}: {gbps[a] / gbps[b]:.2f}x one shared stream ({b}, {gbps[b]:.2f} GB/s)")
    for c, what, target, met in verdicts:
        lines.append(f"  {c:26s} {what:100s} {target:>9s}  {'met' if met else 'NO'}")
    return lines, gbps, verdicts


def defaults_threads() -> int:
    """The read engine's workers on this machine's local disks (the loaders' default)."""
    from mcf._core.storage import defaults_for
    return defaults_for("local").threads


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=2.0, help="idle seconds before every case (default 2)")
    ap.add_argument("--cases", nargs="+", help="only these cases (see the module docstring)")
    ap.add_argument("--wait-for", default="qemu-aarch64", help="wait until no process matches this (pgrep -f) "
                    "before measuring, at most --wait seconds; '' to skip")
    ap.add_argument("--wait", type=float, default=1800)
    ap.add_argument("--json", help="write every run here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    if a.wait_for:
        wait_for(a.wait_for, a.wait)
    runs = measure(a.cases or all_cases(), a.rounds, a.settle)
    lines, _, _ = summarize(runs)
    from bench_common import print_summary
    print_summary([f"machine: {_machine()}"] + lines, runs, a.json)


def _machine() -> str:
    from host_state import machine
    return str(machine())


# -- as a pytest benchmark -----------------------------------------------------------------------------------
def test_cold_read(benchmark):
    import pytest
    import shutil
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed (Debian's fio package): it is the anchor")
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    rounds = int(os.environ.get("MCF_BENCH_ROUNDS", "3"))
    wait_for("qemu-aarch64", 1800)
    holder = {}
    benchmark.pedantic(lambda: holder.setdefault("runs", measure(all_cases(), rounds, 2.0)), rounds=1,
                       iterations=1)
    lines, gbps, verdicts = summarize(holder["runs"])
    benchmark.extra_info.update({"gbps": gbps, "verdicts": [(c, w, t, m) for c, w, t, m in verdicts]})
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
