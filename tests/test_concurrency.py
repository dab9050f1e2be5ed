"""Concurrency: the compiled loops release the GIL, so many threads decode, gather, read and
assemble on the SAME open objects at once, and every result must equal the single-threaded one bit for
bit.  Then close() racing with readers, and readers in other processes while a writer publishes
(Megatron builder, MegaContext ingest, bucket ingest): they see a consistent published state or an
MCFError, never a torn one.

Every multi-threaded test starts its threads on a barrier so their calls overlap; jobs run in a
different seeded order per thread.  The whole file takes well under a minute.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import mcf
import mcf.container.quant
import mcf.megacontext as mc
import mcf.megatron as mt
from mcf.io import open_source

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from fuzz import kill_at_random as kar  # noqa: E402  (the generations the writers publish)

THREADS = 12
IMPLS = mcf.kernel_info()["supported"]
METHODS = mcf.container.quant.METHODS


def seeded(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def hammer(jobs, run, threads=THREADS, rounds=1):
    """Run ``run(job)`` for every job on each of ``threads`` threads (each in its own seeded order,
    ``rounds`` times), all released together by a barrier; returns how many calls were made.  The
    first exception of any thread is re-raised here."""
    barrier = threading.Barrier(threads)
    errors, calls = [], []

    def work(k):
        order = list(range(len(jobs))) * rounds
        random.Random(f"order-{k}").shuffle(order)
        try:
            barrier.wait()
            for j in order:
                run(jobs[j])
            calls.append(len(order))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return sum(calls)


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ------------------------------------------------------------------------------------------------
# one MCF file with every quantized method and the plain float dtypes
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mcf_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("conc") / "all.mcf"
    r = seeded("mcf-file")
    with mcf.Writer(p) as w:
        for m in METHODS:
            w.add_tensor(f"q.{m}", r.standard_normal((48, 512)).astype(np.float32), method=m)
        w.add_tensor("f.f32", r.standard_normal((64, 300)).astype(np.float32))
        w.add_tensor("f.f16", r.standard_normal((64, 300)).astype(np.float32), dtype="f16")
        w.add_tensor("f.bf16", r.standard_normal((64, 300)).astype(np.float32), dtype="bf16")
        w.add_tensor("i.i32", np.arange(10_000, dtype=np.int32))
    return p


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
def test_dequantize_every_method_and_impl_from_many_threads(mcf_file, mmap):
    with mcf.open(mcf_file, mmap=mmap) as c:
        jobs = []
        for name in c:
            if name.startswith("i."):
                continue
            for impl in IMPLS:
                for dtype in (np.float32, np.float16):
                    for rows in (None, (5, 40)):
                        for threads in (1, 2):
                            jobs.append((name, impl, dtype, rows, threads))
        want = {j: c.dequantize(j[0], impl=j[1], dtype=j[2], rows=j[3]) for j in jobs}
        # the variants agree with each other too (bit-identical by design): a cheap cross-check
        for name in c:
            if name.startswith("q."):
                assert all(same(want[(name, i, np.float32, None, 1)], want[(name, "scalar", np.float32, None, 1)])
                           for i in IMPLS)
        mismatches = []

        def run(j):
            name, impl, dtype, rows, threads = j
            got = c.dequantize(name, impl=impl, dtype=dtype, rows=rows, threads=threads)
            if not same(got, want[j]):
                mismatches.append(j)
            if j[3] is None and j[4] == 1:       # into a caller's buffer as well
                out = np.empty_like(want[j])
                c.dequantize(name, impl=impl, out=out)
                if not same(out, want[j]):
                    mismatches.append(("out",) + j)

        assert hammer(jobs, run) == THREADS * len(jobs)
        assert mismatches == []


@pytest.mark.parametrize("mode", ["mmap", "pread", "fileobj", "memory"])
def test_source_reads_from_many_threads(tmp_path, mode):
    data = seeded("source").integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    p = tmp_path / "data.bin"
    p.write_bytes(data)
    fobj = None
    if mode == "fileobj":
        fobj = open(p, "rb")  # noqa: SIM115 - closed below
        src = open_source(fobj)
    elif mode == "memory":
        src = open_source(memoryview(data))
    else:
        src = open_source(p, mmap=mode == "mmap")
    r = seeded("source-jobs", mode)
    jobs = []
    for k in range(40):
        off = int(r.integers(0, len(data) - 1))
        n = int(r.integers(0, min(len(data) - off, 300_000)))
        jobs.append(("read", off, n) if k % 3 == 0 else ("readinto", off, n) if k % 3 == 1 else ("view", off, n))
    for k in range(8):
        offs = r.integers(0, len(data) - 70_000, 64)
        sizes = r.integers(0, 70_000, 64)
        jobs.append(("ranges", offs, sizes, 1 + k % 3))
    bad = []

    def run(j):
        if j[0] == "ranges":
            _, offs, sizes, threads = j
            dsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            out = np.zeros(int(sizes.sum()), np.uint8)
            src.read_ranges(offs, sizes, out, dsts, threads=threads)
            want = b"".join(data[o:o + s] for o, s in zip(offs.tolist(), sizes.tolist()))
            ok = out.tobytes() == want
        else:
            kind, off, n = j
            if kind == "read":
                ok = src.read(off, n) == data[off:off + n]
            elif kind == "readinto":
                buf = bytearray(n)
                ok = src.readinto(off, buf) == n and bytes(buf) == data[off:off + n]
            else:
                ok = src.view(off, n).tobytes() == data[off:off + n]
        if not ok:
            bad.append(j[:2])

    try:
        hammer(jobs, run)
    finally:
        src.close()
        if fobj is not None:
            fobj.close()
    assert bad == []


def test_load_file_and_container_load_from_many_threads(mcf_file):
    want = mcf.load_file(mcf_file, dtype="raw")   # quantized tensors as stored, as Container.load returns them
    with mcf.open(mcf_file) as c, mcf.open(mcf_file, mmap=False) as cp:
        jobs = [("file", True, 1), ("file", False, 2), ("file", True, 3), ("shared", c, 2), ("shared", cp, 2),
                ("shared", c, 1), ("names", cp, 2)]
        bad = []

        def run(j):
            if j[0] == "file":
                got = mcf.load_file(mcf_file, mmap=j[1], threads=j[2], dtype="raw")
            elif j[0] == "names":
                got = j[1].load(["q.q4", "f.bf16"], threads=j[2])
            else:
                got = j[1].load(threads=j[2])
            for k, v in got.items():
                if not same(v, want[k]):
                    bad.append((j[0], k))

        hammer(jobs, run, threads=8, rounds=2)
    assert bad == []


# ------------------------------------------------------------------------------------------------
# Megatron: get / gather / ds[i] on one open dataset
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron_ds(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("conc-mt") / "ds"
    tokens, lengths = kar.megatron_variant(2)
    with mt.Writer(prefix, dtype=np.uint16) as w:
        w.add_documents(tokens, lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return prefix, tokens, lengths, starts


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
def test_megatron_gather_get_from_many_threads(megatron_ds, mmap):
    prefix, tokens, lengths, starts = megatron_ds
    r = seeded("mt-jobs")
    n = len(lengths)
    jobs = [("gather", r.integers(0, n, int(r.integers(1, 400)))) for _ in range(30)]
    jobs += [("get", int(i), int(r.integers(0, lengths[i])), None) for i in r.integers(0, n, 60)]
    jobs += [("item", int(i)) for i in r.integers(-n, n, 60)]
    bad = []

    def seq(i):
        return tokens[starts[i]:starts[i] + lengths[i]]

    with mt.open(prefix, mmap=mmap) as ds:
        def run(j):
            if j[0] == "gather":
                got, offs = ds.gather(j[1])
                ok = all(same(got[offs[k]:offs[k + 1]], seq(i)) for k, i in enumerate(j[1]))
            elif j[0] == "get":
                ok = same(ds.get(j[1], j[2]), seq(j[1])[j[2]:])
            else:
                ok = same(ds[j[1]], seq(j[1] % n))
            if not ok:
                bad.append(j[:2])

        hammer(jobs, run)
    assert bad == []


# ------------------------------------------------------------------------------------------------
# MegaContext: assembling working contexts on one open tree
# ------------------------------------------------------------------------------------------------
def build_tree(path, n_tokens=40_000, d=64):
    r = seeded("tree")
    with mc.create(path, embedding_dim=d, model_name="conc") as t:
        t.append_tokens(r.integers(0, 30_000, n_tokens).astype(np.uint32))
        k = t.block_size
        n1 = n_tokens // k
        t.append_gists(1, r.standard_normal((n1, d)).astype(np.float16))
        t.append_gists(2, r.standard_normal((n1 // k, d)).astype(np.float16))


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
def test_megacontext_assemble_from_many_threads(tmp_path, mmap):
    build_tree(tmp_path / "t")
    table = seeded("table").standard_normal((30_000, 64)).astype(np.float16)
    with mc.open(tmp_path / "t", mmap=mmap) as t:
        jobs = [(b, rt, emb, th) for b, rt in ((300, 64), (2000, 500), (4096, 1024), (50, 10))
                for emb in (False, True) for th in (1, 2)]

        def assemble(j):
            budget, recent, emb, threads = j
            return t.assemble(t.plan_tail(budget, recent), table if emb else None, threads=threads)

        want = {j: assemble(j) for j in jobs}
        bad = []

        def run(j):
            got, ref = assemble(j), want[j]
            fields = ("levels", "positions", "token_ids", "gist_rows", "embeddings")
            if not all(same(getattr(got, f), getattr(ref, f)) if getattr(ref, f) is not None
                       else getattr(got, f) is None for f in fields):
                bad.append(j)

        hammer(jobs, run, rounds=2)
    assert bad == []


# ------------------------------------------------------------------------------------------------
# close() racing with readers: each read finishes with the right bytes or raises an MCFError; the
# process never crashes.  Run in a child process so that a crash fails this test and nothing else.
# ------------------------------------------------------------------------------------------------
CLOSE_RACE = r"""
import sys, threading, time, numpy as np, mcf, mcf.megatron as mt
sys.path.insert(0, sys.argv[1])
kind, path = sys.argv[2], sys.argv[3]
outcomes = {"ok": 0, "closed": 0}
for rnd in range(int(sys.argv[4])):
    if kind.startswith("mcf"):
        obj = mcf.open(path, mmap=kind == "mcf-mmap")
        want = {n: obj.dequantize(n) for n in obj if n.startswith("q.")}
        calls = [lambda n=n: (obj.dequantize(n, threads=2), want[n]) for n in want]
        calls += [lambda n=n: (obj.tensor(n), want[n]) for n in want]
    elif kind.startswith("source"):
        from mcf.io import open_source
        fobj = open(path, "rb") if kind == "source-fileobj" else None
        if kind == "source-memory":
            obj = open_source(memoryview(open(path, "rb").read()))
        else:
            obj = open_source(fobj if fobj else path, mmap=kind == "source-mmap")
        whole = obj.read(0, obj.size)
        def ranges():
            out = np.empty(obj.size, np.uint8)
            obj.read_ranges([0, obj.size // 2], [obj.size // 2, obj.size - obj.size // 2], out,
                            [0, obj.size // 2], threads=2)
            return out, np.frombuffer(whole, np.uint8)
        def readinto():
            out = np.empty(obj.size, np.uint8)
            obj.readinto(0, out)
            return out, np.frombuffer(whole, np.uint8)
        calls = [ranges, readinto]
    else:
        obj = mt.open(path, mmap=kind == "megatron-mmap")
        idx = np.arange(len(obj))
        flat, _ = obj.gather(idx)
        calls = [lambda: (obj.gather(idx)[0], flat)] * 4
    barrier = threading.Barrier(5)
    bad = []
    def work(k):
        barrier.wait()
        for c in calls[k % 2::2] * 3:
            try:
                got, exp = c()
                if not np.array_equal(got, exp):
                    bad.append("wrong")
                outcomes["ok"] += 1
            except mcf.MCFError:
                outcomes["closed"] += 1
    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts: t.start()
    barrier.wait()
    time.sleep(0.0015 * (rnd % 6))   # close before, during and after the reads
    obj.close()
    for t in ts: t.join()
    if kind == "source-fileobj":
        fobj.close()
    assert not bad, bad
print(outcomes["ok"], outcomes["closed"])
"""


@pytest.mark.parametrize("kind", ["mcf-mmap", "mcf-pread", "megatron-mmap", "megatron-pread", "source-mmap",
                                  "source-pread", "source-fileobj", "source-memory"])
def test_close_racing_with_readers(mcf_file, megatron_ds, kind):
    """Containers and datasets in both modes, and the I/O core's Source in its four modes."""
    path = str(megatron_ds[0]) if kind.startswith("megatron") else str(mcf_file)
    p = subprocess.run([sys.executable, "-c", CLOSE_RACE, str(ROOT), kind, path, "30"], capture_output=True,
                       text=True, timeout=120, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    ok, closed = map(int, p.stdout.split())
    assert ok > 0 and closed > 0, (ok, closed)  # both outcomes happened: the close raced with the reads


# ------------------------------------------------------------------------------------------------
# readers in other processes while a writer publishes
# ------------------------------------------------------------------------------------------------
READ_SECONDS = 3.0    # readers run at least this long, and on until they saw enough (at most MAX_SECONDS)
MAX_SECONDS = 60.0


def keep_reading(start, enough) -> bool:
    t = time.monotonic() - start
    return t < MAX_SECONDS and (t < READ_SECONDS or not enough())


def spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(ROOT))


def spawn_reader(name, *args) -> subprocess.Popen:
    code = (f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(ROOT)!r}]; import test_concurrency as t; "
            f"t.{name}(*sys.argv[1:])")
    return spawn("-c", code, *args)


def start_child_writer(writer, work) -> subprocess.Popen:
    p = spawn(ROOT / "fuzz" / "kill_at_random.py", "--child", writer, work, 0)
    assert p.stdout.readline().startswith("ready"), p.stderr.read() if p.poll() is not None else ""
    return p


def finish(readers, writer) -> list:
    """The readers' JSON reports (they stop by themselves), then the writer is killed."""
    import json

    outs = []
    try:
        for r in readers:
            out, err = r.communicate(timeout=120)
            assert r.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        writer.kill()
        writer.communicate()
    return outs


def reader_megatron(work):
    """Open the dataset again and again while the builder republishes it; every open must give one
    whole published variant (lengths and every token), or raise an MCFError."""
    import json

    variants = {v: kar.megatron_variant(v) for v in range(kar.MEGATRON_VARIANTS)}
    seen = {"ok": {}, "refused": 0, "torn": 0}
    start = time.monotonic()
    while keep_reading(start, lambda: len(seen["ok"]) >= 2 and sum(seen["ok"].values()) >= 5):
        try:
            with mt.open(Path(work) / "ds") as ds:
                lengths = np.asarray(ds.sequence_lengths)
                tokens, _ = ds.gather(np.arange(len(ds)))
        except mcf.MCFError:
            seen["refused"] += 1
            continue
        match = [v for v, (tok, ln) in variants.items() if same(lengths, ln.astype(np.int32)) and same(tokens, tok)]
        if match:
            seen["ok"][match[0]] = seen["ok"].get(match[0], 0) + 1
        else:
            seen["torn"] += 1
    print(json.dumps(seen))


def test_megatron_readers_while_the_builder_republishes(tmp_path):
    writer = start_child_writer("megatron", tmp_path)
    readers = [spawn_reader("reader_megatron", tmp_path) for _ in range(2)]
    outs = finish(readers, writer)
    assert [o["torn"] for o in outs] == [0, 0], outs
    seen = {int(v) for o in outs for v in o["ok"]}
    assert len(seen) >= 2 and sum(sum(o["ok"].values()) for o in outs) >= 10, outs


def reader_megacontext(tree):
    """Fresh opens and refreshes of one long-lived tree while the ingest appends: every view is a
    consistent committed prefix (tests/test_megacontext_crash.py's check)."""
    import json

    from test_megacontext_crash import check_consistent

    states = set()
    start = time.monotonic()
    with mc.open(tree) as long_lived:
        while keep_reading(start, lambda: len(states) >= 2):
            long_lived.refresh()
            states.add(check_consistent(long_lived, live=True))
            with mc.open(tree) as fresh:
                states.add(check_consistent(fresh, live=True))
    print(json.dumps({"states": len(states)}))


def test_megacontext_readers_while_ingest_appends(tmp_path):
    from _megacontext_ref import token_stream_at

    tree = tmp_path / "tree"
    with mc.create(tree, embedding_dim=8, model_name="conc"):
        pass
    writer = spawn(HERE / "_megacontext_writer.py", tree, 7, 10**9)
    assert writer.stdout.readline().startswith("ready")
    readers = [spawn_reader("reader_megacontext", tree) for _ in range(2)]
    # here: one tree shared by threads; one refreshes (remapping the grown files) while the others
    # assemble from it
    stop = threading.Event()
    errors, done = [], []
    with mc.open(tree) as shared:
        def refresher():
            while not stop.is_set():
                shared.refresh()

        def assembler():
            try:
                while not stop.is_set():
                    wc = shared.assemble(shared.plan_tail(256, 64))
                    pos = wc.positions[wc.levels == 0]
                    if pos.size:
                        stream = token_stream_at(0, int(pos.max()) + 1, 5)
                        assert same(wc.token_ids, stream[pos]), "assembled tokens differ from the stream"
                    done.append(len(wc))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        ts = [threading.Thread(target=refresher)] + [threading.Thread(target=assembler) for _ in range(3)]
        for t in ts:
            t.start()
        start = time.monotonic()
        while keep_reading(start, lambda: len(done) > 10 and not errors):
            time.sleep(0.05)
        stop.set()
        for t in ts:
            t.join()
    outs = finish(readers, writer)
    assert not errors, errors[0]
    assert len(done) > 10
    assert all(o["states"] >= 2 for o in outs), outs


def reader_bucket(root):
    """discover() and load() every context while another process ingests: each listed context loads
    with exactly the content it was ingested with."""
    import json

    from mcf.bucket.store import Bucket

    want = {}
    for g in range(4000):
        k = kar.bucket_layers(g)[0][0].astype(np.float16)
        want[zlib.crc32(k.tobytes())] = g
    checked, seen_lists = set(), 0
    start = time.monotonic()
    while keep_reading(start, lambda: len(checked) >= 3 and seen_lists >= 3):
        if not (Path(root) / "registry.json").exists():
            continue
        b = Bucket(root)
        for meta in b.discover("m"):
            cid = meta["context_id"]
            if cid in checked:
                continue
            layers = b.load(cid, record_access=False)
            g = want[zlib.crc32(np.asarray(layers[0][0], np.float16).tobytes())]
            exp = kar.bucket_layers(g)
            assert all(same(np.asarray(k, np.float16), e[0].astype(np.float16)) for (k, _), e in zip(layers, exp))
            checked.add(cid)
        seen_lists += 1
    print(json.dumps({"checked": len(checked), "lists": seen_lists}))


def test_bucket_readers_while_ingesting(tmp_path):
    writer = start_child_writer("bucket", tmp_path)
    readers = [spawn_reader("reader_bucket", tmp_path / "bucket") for _ in range(2)]
    outs = finish(readers, writer)
    assert all(o["checked"] >= 3 and o["lists"] >= 3 for o in outs), outs
