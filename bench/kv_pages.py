"""The bucket's pages area against SGLang's HiCacheFile, LMCache's fs:// layout and fio, in one run.

    PYTHONPATH=. python bench/kv_pages.py [--pages 128] [--page-mib 4] [--rounds 5]

A page is a Llama-8B-shaped KV page: 64 tokens x 32 layers x 8 KV heads x 128 dims x K,V x bf16 = 4 MiB
(64 * 32 * 8 * 128 * 2 * 2 bytes).  Each round:

* ``batch_exists`` of 128 keys (all present), p50 and p99 over the rounds' calls: the bucket's
  ``prefix_hits`` against HiCacheFile's ``batch_exists`` and LMCache's fs layout (``os.path.exists`` per
  key, as its connector does);
* ``batch_set`` of 128 new pages (after ``sync``, so that no writeback of another's pages runs under it;
  each contender first in turn) and ``batch_get`` of them, warm (in the page cache, after ``sync``; each
  contender first in turn) and cold (after bench_common.evict_page_cache), into preallocated pages; the
  bucket checks every CRC-32C and reads on its default 4 threads;
* fio's sequential read of the same bytes (one file of 128 pages), cold.

Ratios are taken in the same run (figures on this shared machine drift by +-25%).  HiCacheFile comes
from the sglang wheel when it imports; the LMCache fs layout is reproduced with its file naming and
``readinto`` (its connector needs an event loop and an allocator, not what is measured).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import evict_page_cache  # noqa: E402
import fio  # noqa: E402

from mcf.bucket.pages import PageStore  # noqa: E402


def _hicache(root):
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    except ImportError:
        return None
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="llama", extra_config={"file_storage_path": root})
    return HiCacheFile(cfg)


class LMCacheFs:
    """LMCache's fs:// connector's files: ``<key>.data`` written to ``.tmp`` and renamed, read with readinto."""

    def __init__(self, root):
        self.root = root
        os.makedirs(root, exist_ok=True)

    def path(self, key):
        return os.path.join(self.root, key.replace("/", "-SEP-") + ".data")

    def exists(self, keys):
        for i, k in enumerate(keys):
            if not os.path.exists(self.path(k)):
                return i
        return len(keys)

    def set(self, keys, pages):
        for k, p in zip(keys, pages):
            tmp = self.path(k)[:-5] + ".tmp"
            with open(tmp, "wb") as f:
                f.write(memoryview(p))
            os.replace(tmp, self.path(k))

    def get(self, keys, outs):
        for k, o in zip(keys, outs):
            with open(self.path(k), "rb") as f:
                f.readinto(memoryview(o))


def _evict(root):
    evict_page_cache(*[os.path.join(d, n) for d, _, names in os.walk(root) for n in names])


def _t(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--page-mib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    size = int(a.page_mib * 2**20)
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(a.pages)]
    outs = [np.empty(size, np.uint8) for _ in range(a.pages)]
    for o in outs:
        o.fill(1)   # fault the destinations in once: engines read into kept host pools
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        store = PageStore(os.path.join(tmp, "mcb"), "bench")   # its default threads (4)
        hf = _hicache(os.path.join(tmp, "hf"))
        lm = LMCacheFs(os.path.join(tmp, "lm"))
        import torch

        tpages = [torch.from_numpy(p).view(torch.bfloat16) for p in pages]
        touts = [torch.from_numpy(o).view(torch.bfloat16) for o in outs]
        res: dict[str, list[float]] = {}
        exists: dict[str, list[float]] = {}

        def add(name, value, into=res):
            into.setdefault(name, []).append(value)

        for r in range(a.rounds):
            keys = [f"{r:08x}{i:056x}" for i in range(a.pages)]
            lkeys = [f"llama@1@0@{r:x}{i:x}@bfloat16" for i in range(a.pages)]
            sets = [("mcf", lambda: store.put_many(keys, pages)),
                    ("HiCacheFile", (lambda: hf.batch_set(keys, tpages)) if hf else None),
                    ("LMCache fs", lambda: lm.set(lkeys, pages))]
            for name, fn in sets[r % 3:] + sets[:r % 3]:   # each first in turn, none under another's writeback
                if fn is not None:
                    os.sync()
                    add(f"set {name}", _t(fn))
            for _ in range(20):
                add("mcf", _t(lambda: store.prefix_hits(keys)), exists)
                if hf:
                    add("HiCacheFile", _t(lambda: hf.batch_exists(keys)), exists)
                add("LMCache fs", _t(lambda: lm.exists(lkeys)), exists)
            os.sync()   # the sets' writeback done: it would slow whichever warm read came first
            warm = [("mcf", lambda: store.get_many_into(keys, outs)),
                    ("HiCacheFile", (lambda: hf.batch_get(keys, touts)) if hf else None),
                    ("LMCache fs", lambda: lm.get(lkeys, outs))]
            for name, fn in warm[r % 3:] + warm[:r % 3]:   # each first in turn
                if fn is not None:
                    add(f"get warm {name}", _t(fn))
            store.get_many_into(keys, outs)
            assert all((o == p).all() for o, p in zip(outs[:2], pages[:2]))
            for name, fn in (("mcf", lambda: store.get_many_into(keys, outs)),
                             ("HiCacheFile", (lambda: hf.batch_get(keys, touts)) if hf else None),
                             ("LMCache fs", lambda: lm.get(lkeys, outs))):
                if fn is None:
                    continue
                _evict(tmp)
                add(f"get cold {name}", _t(fn))
        big = os.path.join(tmp, "fio.bin")
        with open(big, "wb") as f:
            for p in pages:
                f.write(memoryview(p))
        fio_gbs = []
        if fio.available():
            for _ in range(a.rounds):
                _evict(tmp)
                fio_gbs.append(fio.sequential_read(big, size * a.pages, direct=False, jobs=2))
        store.close()
    gb = size * a.pages / 1e9
    print(f"{a.pages} pages of {a.page_mib} MiB ({gb:.2f} GB), {a.rounds} rounds, medians")
    for name, vals in sorted(exists.items()):
        q = statistics.quantiles(vals, n=100)
        print(f"batch_exists({a.pages}) {name:12s} p50 {statistics.median(vals) * 1e6:8.0f} us  "
              f"p99 {q[98] * 1e6:8.0f} us")
    for name, vals in sorted(res.items()):
        print(f"{name:24s} {statistics.median(vals) * 1e3:8.1f} ms  {gb / statistics.median(vals):6.2f} GB/s")
    for op in ("set", "get warm", "get cold"):
        ours = statistics.median(res[f"{op} mcf"])
        for peer in ("HiCacheFile", "LMCache fs"):
            if f"{op} {peer}" in res:
                print(f"{op}: mcf is {statistics.median(res[f'{op} {peer}']) / ours:.2f}x {peer}")
    if fio_gbs:
        print(f"get cold: mcf at {gb / statistics.median(res['get cold mcf']) / statistics.median(fio_gbs):.2f}x "
              f"fio's sequential read ({statistics.median(fio_gbs):.2f} GB/s)")


if __name__ == "__main__":
    main()
