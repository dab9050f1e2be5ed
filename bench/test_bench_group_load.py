"""Two ranks of a gloo process group loading one checkpoint from a cold page cache: ``group=`` (each rank
reads about half and the ranks broadcast their shares) against the plain per-rank load (every rank reads
everything: what each rank of a job does without ``group=``).

    python -m pytest bench/test_bench_group_load.py --benchmark-only -s

The checkpoint: 1.0 GB of bfloat16 in two shards with their index (the widths of bench/loading_model.py's
Llama, 8 layers), built once into ``$MCF_BENCH_DIR/group``.  Two processes (spawn) hold the group for the
whole run; every round starts cold: the parent evicts the shards from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed; the ranks closed every file).  Rounds alternate
(the plain load in pedantic's untimed setup, timed on its own, then the group load), each timed from the
parent's request to the last rank's answer.  Per rank and load: the bytes its sources read
(``Source.bytes_read``) and what its process read from the block device (``read_bytes`` of
``/proc/self/io``: two ranks reading one file at the same moment share the page cache, so the plain load's
device bytes can stay near 1x on one host; its ``bytes_read`` is what a network filesystem or an object
store would serve).  Every round checks that both loads gave the same tensors.

Asserts correctness only; the summary is printed (``-s``) and put in ``extra_info``.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import shutil
import signal
import statistics
import tempfile
import time
import zlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

HIDDEN, INTERMEDIATE, KV_DIM, LAYERS, VOCAB = 2048, 5632, 256, 8, 32000
N = 2
ROUNDS = 3
WAIT = 600.0


def _spec():
    yield "model.embed_tokens.weight", (VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (HIDDEN,)
        yield p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)
        yield p + "self_attn.k_proj.weight", (KV_DIM, HIDDEN)
        yield p + "self_attn.v_proj.weight", (KV_DIM, HIDDEN)
        yield p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)
        yield p + "post_attention_layernorm.weight", (HIDDEN,)
        yield p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)
        yield p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)
        yield p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)
    yield "model.norm.weight", (HIDDEN,)
    yield "lm_head.weight", (VOCAB, HIDDEN)


@pytest.fixture(scope="module")
def checkpoint():
    from safetensors.torch import save_file

    base = os.environ.get("MCF_BENCH_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "mcf-bench")
    d = os.path.join(base, "group")
    done = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(done):
        os.makedirs(d, exist_ok=True)
        g = torch.Generator().manual_seed(20261128)
        names = [n for n, _ in _spec()]
        half = len(names) // 2
        weight_map = {}
        for k, part in enumerate((names[:half], names[half:])):
            fname = f"model-{k + 1:05d}-of-00002.safetensors"
            shapes = dict(_spec())
            save_file({n: (torch.randn(shapes[n], generator=g) * 0.02).bfloat16() for n in part},
                      os.path.join(d, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        with open(done + ".tmp", "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        os.replace(done + ".tmp", done)
    return d


def _shards(d):
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))


def _evict(files):
    from bench_common import evict_page_cache

    evict_page_cache(*files)


def _io_read_bytes():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def _rank_main(rank, store, tasks, answers):
    import torch.distributed as dist

    import mcf.torch as mtorch
    from mcf.safetensors import open_checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=N,
                            timeout=datetime.timedelta(seconds=300))
    while True:
        item = tasks.get()
        if item is None:
            break
        path, grouped = item
        dev0 = _io_read_bytes()
        t0 = time.perf_counter()
        with open_checkpoint(path) as ck:
            sd = mtorch.load_file(ck, group=dist.group.WORLD if grouped else None)
            read = sum(f.source.bytes_read for f in ck.files)
        elapsed = time.perf_counter() - t0
        crc = {n: zlib.crc32(sd[n].view(torch.uint8).numpy()) for n in
               ("model.embed_tokens.weight", "model.layers.3.mlp.up_proj.weight", "model.norm.weight")}
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        del sd
        answers.put((rank, {"s": elapsed, "bytes_read": read, "device": _io_read_bytes() - dev0, "crc": crc,
                            "nbytes": nbytes}))
    answers.close()
    answers.join_thread()
    os._exit(0)


@pytest.fixture(scope="module")
def ranks():
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    scratch = tempfile.mkdtemp(prefix="mcf-group-bench-")   # a file store: nothing listens beyond loopback
    tasks, answers = [ctx.Queue() for _ in range(N)], ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, os.path.join(scratch, "store"), tasks[r], answers), daemon=True)
             for r in range(N)]
    for p in procs:
        p.start()

    def run(path, grouped):
        t0 = time.perf_counter()
        for q in tasks:
            q.put((path, grouped))
        out = [None] * N
        for _ in range(N):
            try:
                r, a = answers.get(timeout=WAIT)
            except queue.Empty:
                raise AssertionError("a rank did not answer") from None
            out[r] = a
        return time.perf_counter() - t0, out

    yield run
    for q in tasks:
        q.put(None)
    for p in procs:
        p.join(30)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.benchmark(group="group-load")
def test_group_load_cold(benchmark, checkpoint, ranks):
    files = _shards(checkpoint)
    size = sum(os.path.getsize(f) for f in files)
    plain, grouped = [], []

    def setup():
        _evict(files)
        plain.append(ranks(checkpoint, False))
        _evict(files)

    def target():
        grouped.append(ranks(checkpoint, True))

    ranks(checkpoint, True)   # the processes' first load (imports, allocator) is not a round
    benchmark.pedantic(target, setup=setup, rounds=ROUNDS, iterations=1)

    for (_, a), (_, b) in zip(plain, grouped):
        for r in range(N):
            assert a[r]["crc"] == b[r]["crc"] == a[0]["crc"] and a[r]["nbytes"] == b[r]["nbytes"]
    t_plain = statistics.median(t for t, _ in plain)
    t_group = statistics.median(t for t, _ in grouped)

    def per_rank(runs, key):
        return [statistics.median(out[r][key] for _, out in runs) / size for r in range(N)]

    info = {"checkpoint_bytes": size, "plain_s": t_plain, "group_s": t_group, "speedup": t_plain / t_group,
            "plain_bytes_read_per_rank": per_rank(plain, "bytes_read"),
            "group_bytes_read_per_rank": per_rank(grouped, "bytes_read"),
            "plain_device_read_per_rank": per_rank(plain, "device"),
            "group_device_read_per_rank": per_rank(grouped, "device"),
            "load_average": os.getloadavg()[0]}
    benchmark.extra_info.update(info)
    fmt = lambda xs: " + ".join(f"{x:.3f}" for x in xs) + f" = {sum(xs):.3f}x"  # noqa: E731
    print(f"\n{N} ranks, {size / 1e9:.2f} GB checkpoint (2 shards), cold, medians of {ROUNDS} interleaved rounds, "
          f"load average {info['load_average']:.1f}")
    print(f"  plain per-rank load: {t_plain:.2f} s ({size / t_plain / 1e9:.2f} GB/s of checkpoint); "
          f"bytes_read {fmt(info['plain_bytes_read_per_rank'])}, device {fmt(info['plain_device_read_per_rank'])}")
    print(f"  group= load:         {t_group:.2f} s ({size / t_group / 1e9:.2f} GB/s of checkpoint); "
          f"bytes_read {fmt(info['group_bytes_read_per_rank'])}, device {fmt(info['group_device_read_per_rank'])}")
    print(f"  group= is {t_plain / t_group:.2f}x the plain load's speed, and reads "
          f"{sum(info['group_bytes_read_per_rank']) / sum(info['plain_bytes_read_per_rank']):.2f}x its bytes")
