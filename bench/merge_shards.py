"""``mcf.megatron.merge`` of 1,000 shards against the disk's own speed for the same bytes, in one run.

    python bench/merge_shards.py                          # 1,000 shards, 4 GiB in all, 5 rounds
    python bench/merge_shards.py --total 16GiB --rounds 3 --json out.json
    python bench/merge_shards.py --dir /mnt/nvme/mcf-bench   # the disk to measure (default $MCF_BENCH_DIR)

What is measured, and why this way:

- **The data** (cached in ``$MCF_BENCH_DIR/merge-N-SIZE``): ``--shards`` Megatron datasets of 1 KiB
  sequences (512 uint16 tokens), ``--total`` bytes of ``.bin`` in all, as a tokenize run on a cluster
  leaves them; and one file of the same total bytes, the anchors' input.
- **The merge**: ``mm.merge(out, shards)`` with its defaults (``durable=True``: both outputs fsynced), in
  this process (its imports are not charged), the output removed before each round.
- **The anchors**, each ending with an fsync of its output as the merge does: ``cp`` of the one big file
  (coreutils: ``copy_file_range``, a reflink where the file system offers one), ``dd bs=8M conv=fsync`` of
  it (plain reads and writes through the page cache), and ``cat`` of the 1,000 shard ``.bin`` files into one
  (the same files the merge reads: what a merge without an index would cost).  fio's sequential read of
  the big file (8 MiB blocks, buffered, 1 job) is printed too, for the read side alone.
- **Cold**: before every timed run the page cache of its inputs is dropped (``posix_fadvise(DONTNEED)``
  after an fsync, no root needed), so every copy reads from the disk.  Rounds are interleaved, their order
  shuffled per round; figures are medians.  The load average is printed with them.

Target: the merge within 1.15x of ``cp``'s time (the .bin is the same copy; the index is 1% of the bytes,
and 2,000 opens and 1,000 validations the rest).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

import fio  # noqa: E402
from bench_common import evict_page_cache, print_summary  # noqa: E402

SEQ_TOKENS = 512


def parse_size(text: str) -> int:
    from mcf.conversion.export import parse_size as parse

    return parse(text)


def build(root: str, shards: int, total: int) -> tuple:
    """The shards (prefixes) and the big file, built once per (shards, total) and cached."""
    import mcf.megatron as mm

    d = os.path.join(root, f"merge-{shards}-{total}")
    big = os.path.join(d, "big.bin")
    prefixes = [os.path.join(d, "shards", f"s{k:05d}") for k in range(shards)]
    done = os.path.join(d, "done")
    if os.path.exists(done):
        return prefixes, big
    os.makedirs(os.path.join(d, "shards"), exist_ok=True)
    per = max(1, total // shards // (2 * SEQ_TOKENS))        # sequences per shard
    base = (np.arange(per * SEQ_TOKENS, dtype=np.uint32) * 2654435761 >> 16).astype(np.uint16)
    with open(big, "wb") as fb:
        for k, p in enumerate(prefixes):
            tokens = base ^ np.uint16(k)
            with mm.Writer(p, dtype=np.uint16, durable=False) as w:
                w.add_documents(tokens, np.full(per, SEQ_TOKENS))
            fb.write(tokens.tobytes())
    open(done, "w").close()
    return prefixes, big


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(*paths) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--total", default="4GiB", help="bytes of .bin in all (e.g. 4GiB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=os.environ.get("MCF_BENCH_DIR") or os.path.join(
        __import__("tempfile").gettempdir(), "mcf-bench"))
    ap.add_argument("--json", help="write the summary and every run here")
    args = ap.parse_args()
    import mcf.megatron as mm

    total = parse_size(args.total)
    prefixes, big = build(args.dir, args.shards, total)
    work = os.path.join(os.path.dirname(big), "out")
    os.makedirs(work, exist_ok=True)
    bins = [p + ".bin" for p in prefixes]
    inputs_all = bins + [p + ".idx" for p in prefixes]
    nbytes = sum(os.path.getsize(b) for b in bins)

    def merge():
        mm.merge(os.path.join(work, "merged"), prefixes)

    def cp():
        subprocess.run(["cp", big, os.path.join(work, "cp.bin")], check=True)
        fsync_path(os.path.join(work, "cp.bin"))

    def dd():
        subprocess.run(["dd", f"if={big}", f"of={os.path.join(work, 'dd.bin')}", "bs=8M", "conv=fsync",
                        "status=none"], check=True)

    def cat():
        with open(os.path.join(work, "cat.bin"), "wb") as f:
            subprocess.run(["cat", *bins], stdout=f, check=True)
            os.fsync(f.fileno())

    cases = {"mcf merge": (merge, inputs_all, ["merged.bin", "merged.idx"]), "cp": (cp, [big], ["cp.bin"]),
             "dd bs=8M": (dd, [big], ["dd.bin"]), "cat of the shards": (cat, bins, ["cat.bin"])}
    outputs = [os.path.join(work, n) for c in cases.values() for n in c[2]]
    times: dict = {name: [] for name in cases}
    runs = []
    for r in range(args.rounds):
        order = list(cases)
        random.Random(r).shuffle(order)
        for name in order:
            fn, inputs, outs = cases[name]
            remove(*(os.path.join(work, n) for n in outs))   # a fresh output; the others' stay as disk load
            evict_page_cache(*inputs)
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            times[name].append(dt)
            runs.append({"round": r, "case": name, "seconds": dt, "loadavg": os.getloadavg()[0]})
    with mm.open(os.path.join(work, "merged")) as ds:     # the last merge: complete and valid
        assert ds.num_tokens * 2 == nbytes and ds.verify() == []
    remove(*outputs)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    lines = [f"merge of {len(prefixes):,} shards, {nbytes / 1e9:.2f} GB of .bin, cold page cache, median of "
             f"{args.rounds} rounds (load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)"]
    for name, t in med.items():
        lines.append(f"  {name:<20} {t:8.3f} s  {nbytes / t / 1e9:6.2f} GB/s  "
                     f"merge / this = {med['mcf merge'] / t:.2f}x")
    if fio.available():
        evict_page_cache(big)
        gbs = fio.sequential_read(big, nbytes, direct=False, jobs=1)
        lines.append(f"  fio sequential read of the same bytes: {gbs:.2f} GB/s (the read side alone)" if gbs == gbs
                     else "  fio sequential read of the same bytes: fio reported no figure")
    ratio = med["mcf merge"] / med["cp"]
    lines.append(f"  target: merge <= 1.15x cp's time: {ratio:.2f}x, {'met' if ratio <= 1.15 else 'NOT met'}")
    print_summary(lines, runs, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
