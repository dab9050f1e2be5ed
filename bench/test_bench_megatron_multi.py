"""Many shards read as one (``mcf.megatron.open([...])``), against the same data merged
into one file, as ratios measured in the same run:

- per-item cost of ``ds[i]`` and of ``gather`` (random sequences), target <= 1.2x a single file's;
- opening 1,000 shards (from their headers, and from a shard list), target: milliseconds;
- numpy integers against Python ints as indices of the sharded view, target <= 1.5x.

    python -m pytest bench/test_bench_megatron_multi.py --benchmark-only -s

Data (cached in ``$MCF_BENCH_DIR/multi``): 1,048,576 sequences of 64 random non-zero uint16 tokens
(the worst case: per-item overheads weigh most on short sequences), and 262,144 of 512 tokens (1 KiB,
the sequences of bench/test_bench_megatron.py), each written once as 1,000 shards, once as 16 shards,
and merged into one file.  Per-item times are the
minimum of 30 interleaved rounds of CPU time (``time.thread_time``: the machine is shared, and the
minimum of CPU time is what the code costs), warm page cache.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
import pytest

import mcf.megatron as mm
from mcf.megatron.sharded import write_shard_list
from bench_common import touch_files
from test_bench_megatron import INDEX_KINDS, index_kinds, interleaved

SIZES = {64: 1 << 20, 512: 1 << 18}     # tokens per sequence: sequences
RESULTS: list = []


def bench_dir() -> str:
    d = os.path.join(os.environ.get("MCF_BENCH_DIR") or os.path.join(tempfile.gettempdir(), "mcf-bench"), "multi")
    os.makedirs(d, exist_ok=True)
    return d


def record(benchmark, what, value, target, met, **extra):
    extra["loadavg_1min"] = os.getloadavg()[0]
    RESULTS.append((what, value, target, met))
    benchmark.extra_info.update(extra, verdict=f"{what}: {value} (target {target}) {'met' if met else 'NOT met'}")


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    if RESULTS:
        print(f"\n\nMany shards as one (load average now {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
        for w, v, t, m in RESULTS:
            print(f"  {w:<68} {v:>16}  target {t:<12} {'met' if m else 'NOT met'}")


def shards(tokens: int, k: int) -> list:
    n_all = SIZES[tokens]
    d = os.path.join(bench_dir(), f"t{tokens}-k{k}")
    os.makedirs(d, exist_ok=True)
    prefixes = [os.path.join(d, f"s{i:04d}") for i in range(k)]
    if all(os.path.exists(p + ".idx") for p in prefixes):
        return prefixes
    rng = np.random.default_rng(k)
    per = n_all // k
    for i, p in enumerate(prefixes):
        n = per if i < k - 1 else n_all - per * (k - 1)
        with mm.Writer(p, dtype=np.uint16, durable=False) as w:
            w.add_documents(rng.integers(1, 65000, n * tokens, dtype=np.uint16), np.full(n, tokens))
    return prefixes


@pytest.fixture(scope="module")
def data():
    out = {(t, k): shards(t, k) for t in SIZES for k in (16, 1000)}
    merged = {}
    for key, prefixes in out.items():
        m = os.path.join(bench_dir(), f"merged-t{key[0]}-k{key[1]}")
        if not os.path.exists(m + ".idx"):
            mm.merge(m, prefixes)
        merged[key] = m
    return out, merged


def touch(prefixes):
    touch_files(p + ext for p in prefixes for ext in (".idx", ".bin"))


def per_item(fn, items, rounds=30):
    best = float("inf")
    for _ in range(rounds):
        t = time.thread_time()
        fn(items)
        best = min(best, time.thread_time() - t)
    return best


@pytest.mark.parametrize("tokens", list(SIZES))
@pytest.mark.parametrize("k", [16, 1000])
def test_getitem_and_gather_vs_single_file(benchmark, data, k, tokens):
    prefixes, merged = data
    prefixes, merged = prefixes[tokens, k], merged[tokens, k]
    touch(prefixes + [merged])
    rng = np.random.default_rng(1)
    idx = rng.integers(0, SIZES[tokens], 20000).tolist()
    batch = np.array(idx[:1024])

    def items(ds):
        g = ds.__getitem__

        def run(ii):
            for i in ii:
                g(i)
        return run

    def gathers(ds):
        def run(ii):
            for _ in range(20):
                ds.gather(ii)
        return run

    with mm.open(prefixes) as s, mm.open(merged) as m:
        s.open_all()
        best = {"s_get": float("inf"), "m_get": float("inf"), "s_gat": float("inf"), "m_gat": float("inf")}
        for _ in range(30):   # interleaved, so that both see the same machine
            best["m_get"] = min(best["m_get"], per_item(items(m), idx, 1))
            best["s_get"] = min(best["s_get"], per_item(items(s), idx, 1))
            best["m_gat"] = min(best["m_gat"], per_item(gathers(m), batch, 1))
            best["s_gat"] = min(best["s_gat"], per_item(gathers(s), batch, 1))
        benchmark.pedantic(items(s), args=(idx,), rounds=5, iterations=1)
    g_ns = {key: v / len(idx) * 1e9 for key, v in best.items() if key.endswith("get")}
    t_ns = {key: v / (20 * len(batch)) * 1e9 for key, v in best.items() if key.endswith("gat")}
    r_get = g_ns["s_get"] / g_ns["m_get"]
    r_gat = t_ns["s_gat"] / t_ns["m_gat"]
    what = f"{k} shards vs one file, {tokens}-token sequences"
    record(benchmark, f"ds[i], {what}", f"{r_get:.2f}x", "<= 1.2x", r_get <= 1.2,
           sharded_ns=g_ns["s_get"], single_ns=g_ns["m_get"])
    record(benchmark, "  (ns per item: shards / one file)", f"{g_ns['s_get']:.0f} / {g_ns['m_get']:.0f}",
           "(info)", True)
    record(benchmark, f"gather 1024, {what}", f"{r_gat:.2f}x", "<= 1.2x", r_gat <= 1.2,
           sharded_ns_per_seq=t_ns["s_gat"], single_ns_per_seq=t_ns["m_gat"])
    record(benchmark, "  (ns per sequence: shards / one file)", f"{t_ns['s_gat']:.1f} / {t_ns['m_gat']:.1f}",
           "(info)", True)


@pytest.mark.parametrize("k", [16, 1000])
@pytest.mark.parametrize("what", INDEX_KINDS)
def test_numpy_integer_indices_sharded(benchmark, data, k, what):
    """The sharded view indexed with numpy integers against Python ints (the anchor), as
    test_bench_megatron.py's test_numpy_integer_indices does for one file: medians
    of interleaved rounds, 64-token sequences.  Target: numpy integers within 1.5x of Python ints."""
    prefixes = data[0][64, k]
    touch(prefixes)
    rng = np.random.default_rng(7)
    with mm.open(prefixes) as s:
        s.open_all()
        idx = rng.integers(0, len(s), 100_000).tolist()
        batches = [rng.integers(0, len(s), 1024) for _ in range(20)]
        numpy_call, python_call = index_kinds(s, idx, batches)[what]
        t_np, t_py = interleaved(benchmark, numpy_call, python_call, rounds=15)
    per = 20 * 1024 if what.startswith("gather") else len(idx)
    record(benchmark, f"{what}, {k} shards: numpy-int / Python-int", f"{t_np / t_py:.2f}x", "<= 1.5x",
           t_np / t_py <= 1.5, numpy_int_us=t_np / per * 1e6, python_int_us=t_py / per * 1e6)
    record(benchmark, "  (us per item: numpy int / Python int)", f"{t_np / per * 1e6:.3f} / {t_py / per * 1e6:.3f}",
           "(info)", True)


def test_open_1000_shards(benchmark, data):
    prefixes = data[0][64, 1000]
    listing = os.path.join(bench_dir(), "t64-k1000.shards.json")
    with mm.open(prefixes) as s:
        write_shard_list(listing, s.shards, dtype=np.uint16)
    touch(prefixes[:1])

    def from_headers():
        mm.open(prefixes).close()

    def from_list():
        mm.open(listing).close()

    t_headers = min(_wall(from_headers) for _ in range(15))
    benchmark.pedantic(from_list, rounds=15, iterations=1)
    t_list = min(_wall(from_list) for _ in range(15))
    record(benchmark, "open 1,000 shards from their headers", f"{t_headers * 1e3:.1f} ms", "ms, no scan",
           t_headers < 0.25, ms=t_headers * 1e3)
    record(benchmark, "open 1,000 shards from a shard list", f"{t_list * 1e3:.1f} ms", "ms, no scan",
           t_list < 0.05, ms=t_list * 1e3, list_bytes=os.path.getsize(listing))
    with open(listing) as f:
        assert len(json.load(f)["shards"]) == 1000


def _wall(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
