"""mcf's loaders against the loaders people use today, on a 1.67 GB checkpoint read from the local disk,
cold and warm, with fio's sequential read as the storage's limit.

    python bench/load_peers.py                               # cold and warm, 5 rounds (root: drops caches)
    python bench/load_peers.py --states warm --rounds 3 --cases mcf.torch memcpy
    python bench/load_peers.py --quiet-load 1.5 --json out.json   # wait for a quiet machine first
    python bench/load_peers.py --before /path/to/an/older/checkout   # its mcf cases interleaved as "before"

What is measured, and why this way:

- **The checkpoint** (bench/loading_model.py): 836 M bfloat16 parameters of a Llama-shaped model, one
  safetensors file written by safetensors itself, the same as four shards with an index, and as .mcf.
- **Every load in a fresh process** (bench/load_child.py): the time is taken inside the child after its
  imports, so interpreter and library start-up are not charged; the page cache is dropped (cold) or the
  files read once (warm) right before; peak RSS (VmHWM) is the child's own.  A script, not a
  pytest-benchmark test: pytest-benchmark times a function in its own process, which would charge the
  child's start-up and share the parent's allocator and page-cache state.
- **Like with like**: every loader returns the whole checkpoint in CPU memory, and the child then reads
  one byte of every 4 KiB page of every tensor, so a mapped loader (``safetensors.torch.load_file``'s
  default) pays its page faults as a first forward pass would, and a copying one pays almost nothing
  more.  Peers run with their defaults; so does mcf (no ``threads=`` or ``chunk_bytes=``).
- **Interleaved rounds**: each round runs every case once, in an order shuffled with the round's seed,
  after ``--settle`` seconds of idle (the VM's balloon takes free memory back after ~2 s, so every load
  starts from memory freed long ago, as a process starting up does).  Figures are medians over rounds;
  each row carries the load average and the share of the cores other processes used during its runs.
- **The limits**: cold, fio's sequential read of the same file (8 MiB blocks, buffered and O_DIRECT,
  1/2/4 jobs; the best median of the six); warm, ``memcpy`` by 2 threads of the same bytes from the
  populated mapping of the warm file into one fresh anonymous mapping with the system's page policy (its
  pages are faulted in by the copy, as a loader's destination is), and the same into memory advised
  ``MADV_HUGEPAGE``, for reference.

Targets, checked and printed at the end:

- cold: each mcf loader >= 0.9x fio's best, and >= 1.5x the best peer, or >= 0.95x fio's best where
  1.5x the best peer would be above fio's best;
- warm: each mcf loader >= 0.8x the parallel memcpy;
- a tensor-parallel rank (rank 0 of 4, every matrix cut along its split dimension): time and bytes read
  against the full load by the same loader (``Source.bytes_read``, and /proc/self/io's ``read_bytes``, what
  the disk delivered, readahead included);
- peak RSS: at most the result plus 2x the read engine's staging (threads x chunk_bytes of the storage's
  defaults: 16 x 8 MiB locally) above the RSS before the load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fio  # noqa: E402
from bench_common import print_summary  # noqa: E402
from host_state import drop_caches, load_average, machine  # noqa: E402
from loading_model import loading_model, tp_bytes  # noqa: E402

ROOT = os.path.dirname(HERE)
MiB = 1 << 20

# (case, label, role): role "mcf" (a target), "peer", "anchor", "tp" (a tensor-parallel rank), "tp-full"
# (the full load a tp row is compared with), "tp-peer"
MCF = [
    ("mcf.safetensors", "mcf.safetensors.load_file(file), numpy", "mcf"),
    ("mcf.torch", "mcf.torch.load_file(file)", "mcf"),
    ("mcf.load_file.mcf", "mcf.load_file(.mcf), numpy", "mcf"),
    ("mcf.torch.mcf", "mcf.torch.load_file(.mcf)", "mcf"),
    ("mcf.safetensors.sharded", "mcf.safetensors.load_file(sharded dir), numpy", "mcf"),
    ("mcf.torch.sharded", "mcf.torch.load_file(sharded dir)", "mcf"),
]
PEERS = [
    ("safetensors.torch.mmap", "safetensors.torch.load_file (mmap) + touch", "peer"),
    ("safetensors.torch.pread", "safetensors.torch.load_file(backend='pread')", "peer"),
    ("safetensors.numpy", "safetensors.numpy.load_file", "peer"),
    ("fastsafetensors", "fastsafetensors, CPU, nogds=True", "peer"),
    ("runai", "Run:ai Model Streamer, SafetensorsStreamer, CPU", "peer"),
]
TP = [
    ("mcf.safetensors.full+stats", "mcf.safetensors.load_file(file), all", "tp-full"),
    ("mcf.safetensors.slices", "mcf.safetensors.load_file(file, slices=rank 0 of 4)", "tp"),
    ("mcf.load_file.mcf.full+stats", "mcf.load_file(.mcf), all", "tp-full"),
    ("mcf.load_file.mcf.slices", "mcf.load_file(.mcf, slices=rank 0 of 4)", "tp"),
    ("mcf.torch.slices", "mcf.torch.load_file(file, slices=rank 0 of 4)", "tp"),
    ("safetensors.get_slice", "safetensors safe_open + get_slice, rank 0 of 4", "tp-peer"),
]
WARM_ANCHORS = [
    ("memcpy", "memcpy, 2 threads, warm mapping -> fresh memory", "anchor"),
    ("memcpy:hugepage", "the same into MADV_HUGEPAGE memory (reference)", "reference"),
]
TP_PAIRS = {"mcf.safetensors.slices": "mcf.safetensors.full+stats",
            "mcf.load_file.mcf.slices": "mcf.load_file.mcf.full+stats",
            "mcf.torch.slices": "mcf.torch", "safetensors.get_slice": "safetensors.torch.mmap"}
FIO = [(f"fio:{'direct' if d else 'buffered'}:{j}", f"fio, sequential 8 MiB reads, {'O_DIRECT' if d else 'buffered'}, "
        f"{j} job{'s' if j > 1 else ''}", "limit") for d in (False, True) for j in (1, 2, 4)]

STAGING = 16 * 8 * MiB      # the engine's local defaults, threads x chunk_bytes (mcf/_core/storage.py)


def cases_for(state: str) -> list:
    out = MCF + PEERS + TP
    return out + (FIO if state == "cold" else WARM_ANCHORS)


def run_child(case: str, state: str, verify: bool, pythonpath: str) -> dict:
    name, _, variant = case.partition(":")
    spec = {"case": name, "state": state, "verify": verify}
    if variant:
        spec["anchor"] = variant
    env = {**os.environ, "PYTHONPATH": pythonpath}
    p = subprocess.run([sys.executable, os.path.join(HERE, "load_child.py"), json.dumps(spec)], env=env,
                       capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(f"{case} ({state}) failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_fio(case: str, m) -> dict:
    _, kind, jobs = case.split(":")
    drop_caches()
    load0 = load_average()
    size = os.path.getsize(m.single)
    gbps = fio.sequential_read(m.single, size, direct=kind == "direct", jobs=int(jobs))
    return {"case": case, "state": "cold", "seconds": size / gbps / 1e9, "nbytes": size, "load": load0}


def wait_for_quiet(limit: float | None, most: float) -> float:
    """The 1-minute load average once it is below ``limit`` (polling every minute, at most ``most``
    seconds), or as it is."""
    t0 = time.monotonic()
    while limit is not None and load_average() >= limit and time.monotonic() - t0 < most:
        time.sleep(60)
    return load_average()


def measure(args, m) -> dict:
    runs = {}
    for state in args.states:
        cases = [c for c in cases_for(state) if not args.cases or c[0] in args.cases]
        if args.before:
            cases += [(f"before:{c}", f"{label} [before]", "before") for c, label, role in cases if role == "mcf"]
        for rnd in range(args.rounds):
            # the machine's own load once the runs start is partly theirs (two cores): wait before the first
            load = wait_for_quiet(args.quiet_load, args.wait) if rnd == 0 else load_average()
            print(f"{state} round {rnd + 1}/{args.rounds}, load {load:.2f}", flush=True)
            order = list(cases)
            random.Random(rnd).shuffle(order)
            for case, label, _role in order:
                time.sleep(args.settle)
                if case.startswith("fio:"):
                    r = run_fio(case, m)
                elif case.startswith("before:"):
                    r = run_child(case[len("before:"):], state, rnd == 0, args.before)
                else:
                    r = run_child(case, state, rnd == 0, ROOT)
                r["round"] = rnd
                runs.setdefault(state, {}).setdefault(case, []).append(r)
                v = r.get("verified")
                print(f"  {label:58s} {r['nbytes'] / r['seconds'] / 1e9:6.2f} GB/s"
                      + (f"  peak RSS {(r['peak_rss'] - r['rss_before']) / 1e9:.2f} GB" if "peak_rss" in r else "")
                      + (f"  [{v}]" if v else ""), flush=True)
                if v not in (None, "ok"):
                    raise SystemExit(f"{case}: {v}")
    return runs


def _med(rs, key):
    vals = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: dict, m, cases_meta: dict) -> list:
    """Rows of (state, case, label, role, GB/s median, seconds median, peak RSS excess, read_bytes, bytes_read,
    load range, other CPU median) and the verdicts."""
    lines, verdicts = [], []
    for state, by_case in runs.items():
        gbps = {c: statistics.median(r["nbytes"] / r["seconds"] / 1e9 for r in rs) for c, rs in by_case.items()}
        lines.append(f"\n{state}: medians of {max(len(v) for v in by_case.values())} interleaved rounds")
        lines.append(f"  {'loader':62s} {'GB/s':>6} {'s':>6} {'RSS+':>6} {'disk':>6} {'read':>6} {'load':>9} "
                     f"{'other':>5}")
        for case, rs in by_case.items():
            label, role = cases_meta.get(case, (case, ""))
            rss = [r["peak_rss"] - r["rss_before"] - r["nbytes"] for r in rs if "peak_rss" in r]
            loads = [r["load"] for r in rs]
            disk = _med(rs, "read_bytes")
            br = _med(rs, "bytes_read")
            other = _med(rs, "other_cpu")
            lines.append(f"  {label[:62]:62s} {gbps[case]:6.2f} {_med(rs, 'seconds'):6.2f} "
                         + (f"{statistics.median(rss) / 1e9:+6.2f}" if rss else f"{'':>6}") + " "
                         + (f"{disk / 1e9:6.2f}" if disk is not None else f"{'':>6}") + " "
                         + (f"{br / 1e9:6.2f}" if br is not None else f"{'':>6}") + " "
                         + f"{min(loads):4.1f}-{max(loads):<4.1f} "
                         + (f"{other * 100:4.0f}%" if other is not None else ""))
        mcf_cases = [c for c, (_, role) in cases_meta.items() if role == "mcf" and c in gbps]
        peers = [c for c, (_, role) in cases_meta.items() if role == "peer" and c in gbps]
        if state == "cold" and any(c.startswith("fio:") for c in gbps):
            limit = max(v for c, v in gbps.items() if c.startswith("fio:"))
            best_peer = max((gbps[c] for c in peers), default=None)
            for c in mcf_cases:
                verdicts.append((state, c, f"{gbps[c] / limit:.2f}x fio's best ({limit:.2f} GB/s)", ">= 0.9x",
                                 gbps[c] >= 0.9 * limit))
                if best_peer:
                    if 1.5 * best_peer > limit:
                        verdicts.append((state, c, f"{gbps[c] / best_peer:.2f}x the best peer ({best_peer:.2f}); "
                                         f"1.5x it is above fio's best: {gbps[c] / limit:.2f}x fio", ">= 0.95x fio",
                                         gbps[c] >= 0.95 * limit))
                    else:
                        verdicts.append((state, c, f"{gbps[c] / best_peer:.2f}x the best peer ({best_peer:.2f})",
                                         ">= 1.5x", gbps[c] >= 1.5 * best_peer))
        if state == "warm" and "memcpy" in gbps:
            for c in mcf_cases:
                verdicts.append((state, c, f"{gbps[c] / gbps['memcpy']:.2f}x the parallel memcpy "
                                 f"({gbps['memcpy']:.2f} GB/s)", ">= 0.8x", gbps[c] >= 0.8 * gbps["memcpy"]))
        for tp, full in TP_PAIRS.items():
            if tp in by_case and full in by_case:
                t_tp, t_full = _med(by_case[tp], "seconds"), _med(by_case[full], "seconds")
                br = _med(by_case[tp], "bytes_read")
                what = f"{t_tp:.2f} s vs {t_full:.2f} s all ({t_full / t_tp:.1f}x faster)"
                if br is not None:
                    what += f"; bytes_read {br / tp_bytes():.3f}x the slice"
                    verdicts.append((state, tp, what, "bytes <= 1.05x", br <= 1.05 * tp_bytes() + 64 * 1024))
                else:
                    verdicts.append((state, tp, what, "(reported)", True))
        for c in mcf_cases + [c for c, (_, role) in cases_meta.items() if role in ("tp", "tp-full") and c in by_case]:
            rs = [r for r in by_case[c] if "peak_rss" in r]
            if rs:
                excess = statistics.median(r["peak_rss"] - r["rss_before"] - r["nbytes"] for r in rs)
                verdicts.append((state, c, f"peak RSS: result {excess / MiB:+.0f} MiB", f"<= +{2 * STAGING // MiB} MiB",
                                 excess <= 2 * STAGING))
    lines.append(f"\n{'state':5s} {'loader':32s} {'measure':78s} {'target':>14s}  met")
    for state, c, what, target, met in verdicts:
        lines.append(f"{state:5s} {c:32s} {what[:78]:78s} {target:>14s}  {'yes' if met else 'NO'}")
    return lines


def versions() -> str:
    out = []
    for mod in ("mcf", "numpy", "torch", "safetensors", "fastsafetensors", "runai_model_streamer"):
        try:
            p = subprocess.run([sys.executable, "-c", f"import {mod}; print(getattr({mod}, '__version__', '?'))"],
                               env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
            out.append(f"{mod} {p.stdout.strip() or '?'}")
        except subprocess.TimeoutExpired:
            out.append(f"{mod} ?")
    if fio.available():
        out.append(subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip())
    return ", ".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--states", nargs="+", choices=["cold", "warm"], default=["cold", "warm"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", nargs="+", help="only these cases (names as in bench/load_child.py, fio:buffered:4 ...)")
    ap.add_argument("--settle", type=float, default=5.0, help="idle seconds before every run (default 5)")
    ap.add_argument("--quiet-load", type=float, help="before the first round of each state, wait for the 1-minute load "
                    "to drop below this")
    ap.add_argument("--wait", type=float, default=600, help="longest wait for --quiet-load, seconds (default 600)")
    ap.add_argument("--before", help="a checkout whose mcf cases run interleaved as 'before' rows")
    ap.add_argument("--json", help="write every run here")
    args = ap.parse_args(argv)
    if "cold" in args.states and os.geteuid() != 0:
        raise SystemExit("cold runs drop the page cache: run as root, or with --states warm")
    m = loading_model()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{m.root}: {m.nbytes / 1e9:.2f} GB of bf16 tensors; {machine()}; load {load_average():.2f}", flush=True)
    runs = measure(args, m)
    meta = {c: (label, role) for c, label, role in MCF + PEERS + TP + FIO + WARM_ANCHORS}
    meta.update({f"before:{c}": (f"{label} [before]", "before") for c, label, role in MCF})
    head = [f"started {started}, ended {time.strftime('%H:%M UTC', time.gmtime())}; {versions()}",
            f"machine: {machine()}",
            "GB/s of tensor payload (fio: of the file); s: median seconds; RSS+: peak RSS above "
            "(RSS before + result), GB; disk: bytes read from storage (/proc/self/io, readahead included), GB; read: "
            "bytes_read the engine reports, GB; load: 1-min load average at the runs' start; other: other processes' "
            "share of the cores during the timed part"]
    lines = head + summarize(runs, m, meta)
    print_summary(lines, runs, args.json)


if __name__ == "__main__":
    main()
