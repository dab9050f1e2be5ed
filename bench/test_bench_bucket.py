"""Model Context Bucket benchmarks against seed 003 §9.2's targets, ratios in extra_info.

    python -m pytest bench/test_bench_bucket.py --benchmark-only -s

- registry: 10,000 contexts (10 models x 1,000), made by writing context directories and running
  ``rebuild()``; cached discovery of one model (< 1 ms), a full scan = ``rebuild()`` (< 100 ms) and
  ``lookup`` of one context (< 0.1 ms).
- registry: one ingest's registry update (a journal line) against a full rewrite of the registry.
- KV "injection": a 32-layer, 8-head, 128-dim, 4096-token fp16 context (512 MiB) stored uncompressed,
  loaded from a bucket as mmap views (< 10 ms) with verify "never", "always" (CRC-32 of everything on
  every load) and "once" (per file identity).
- full materialization: copying the loaded arrays into owned memory, against ``np.copyto`` of the same
  bytes (>= 60% of copy bandwidth), and lz4-chunked decompression on 1 and 2 threads (>= 1.5 GB/s), into
  fresh arrays and into preallocated ones (``out=``).
- the server under load: ``mcf bucket serve`` as a process, 4 keep-alive clients on loopback
  doing lookups, ingests, and the review's mix (4,100 requests, 9 lookups per ingest); requests per
  second and p50/p99 latencies in extra_info, next to the review's p50 6.7 ms / p99 23 ms, and the load
  average (the machine is shared: report it with the figures).
- slow clients beside well-behaved ones: 4 keep-alive clients doing lookups, first alone, then
  while slow readers pipeline requests and never read, uploads drip a byte at a time (with and without
  the token) and a client floods unauthenticated requests, then alone again; the well-behaved clients'
  p99 under attack over their p99 alone (the anchor, measured in the same run) is ``p99_ratio``, whose
  target is below 2.
Data is cached under ``$MCF_BENCH_DIR/bucket`` (default ``<tempdir>/mcf-bench/bucket``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import numpy as np
import pytest

from mcf.bucket import Bucket, open_kv
from mcf.bucket.store import content_hash, context_id_for
from mcf.bucket import _layout as L

BASE = os.path.join(os.environ.get("MCF_BENCH_DIR", os.path.join(tempfile.gettempdir(), "mcf-bench")), "bucket")
N_CONTEXTS = 10_000
N_MODELS = 10
SHAPE = (32, 8, 4096, 128)  # layers, kv heads, tokens, head_dim
TARGETS = {"discover_cached_ms": 1.0, "scan_ms": 100.0, "lookup_ms": 0.1, "inject_ms": 10.0}


@pytest.fixture(scope="module")
def registry_bucket():
    root = os.path.join(BASE, "registry")
    if not os.path.exists(os.path.join(root, "done")):
        shutil.rmtree(root, ignore_errors=True)
        b = Bucket(root)
        tiny = [(np.ones((1, 4, 8), np.float32),) * 2]
        first = b.ingest("model-0", tiny, content="seed", compression="none")
        src = os.path.join(root, "contexts", first["context_id"])
        with open(os.path.join(src, "kv_data.mcb"), "rb") as f:
            kv = f.read()
        for i in range(N_CONTEXTS):
            model = f"model-{i % N_MODELS}"
            chash = content_hash(f"document {i}")
            cid = context_id_for(model, chash, "float32", L.KVShape(1, 1, 8, 4))
            d = os.path.join(root, "contexts", cid)
            os.makedirs(d, exist_ok=True)
            meta = dict(first, context_id=cid, model_id=model,
                        content=dict(first["content"], hash=chash, name=f"doc {i}"))
            meta.pop("deduplicated", None)
            with open(os.path.join(d, "metadata.json"), "w") as f:
                json.dump(meta, f)
            with open(os.path.join(d, "kv_data.mcb"), "wb") as f:
                f.write(kv)
        Bucket(root).rebuild()
        open(os.path.join(root, "done"), "w").close()
    with open(os.path.join(root, "registry.json"), "rb") as f:
        if b'"stamps"' not in f.read():  # made by an older version: give it the scan stamps once
            Bucket(root).rebuild()
    return root


def test_discover_cached(benchmark, registry_bucket):
    b = Bucket(registry_bucket)
    b.discover("model-3")
    out = benchmark(b.discover, "model-3")
    assert len(out) == N_CONTEXTS // N_MODELS
    ms = benchmark.stats.stats.median * 1e3
    benchmark.extra_info.update(median_ms=ms, target_ms=TARGETS["discover_cached_ms"],
                                ratio_to_target=ms / TARGETS["discover_cached_ms"], contexts_per_model=len(out))


def test_discover_scan(benchmark, registry_bucket):
    """force_scan: list contexts/, lstat every metadata.json, re-read the changed ones (none here).
    Anchor in the same run: rebuild(), which re-reads and validates all 10,001."""
    import time

    b = Bucket(registry_bucket)
    b.discover("model-3", force_scan=True)
    out = benchmark.pedantic(b.discover, args=("model-3",), kwargs={"force_scan": True}, rounds=7, iterations=1)
    assert len(out) == N_CONTEXTS // N_MODELS
    ms = benchmark.stats.stats.median * 1e3
    t = time.perf_counter()
    b.rebuild()
    rebuild_ms = (time.perf_counter() - t) * 1e3
    benchmark.extra_info.update(median_ms=ms, target_ms=TARGETS["scan_ms"], ratio_to_target=ms / TARGETS["scan_ms"],
                                total_contexts=N_CONTEXTS + 1, rebuild_ms=rebuild_ms, rebuild_over_scan=rebuild_ms / ms)


def test_ingest_registry_update(benchmark, registry_bucket, tmp_path):
    """The registry work of one ingest into the 10,001-context bucket: one journal line (appended and
    fsynced under the lock).  Anchor in the same run: rewriting the whole registry snapshot, which is
    what every ingest did before the journal."""
    import time

    from mcf.bucket._fs import BucketFS
    from mcf.bucket._json import dumps as _dumps

    b = Bucket(registry_bucket)
    b.discover("model-0")
    meta = b.lookup(b.discover("model-0")[0]["context_id"])

    def append():
        with b._lock():
            b._journal_locked([b._put_record(meta, None)])

    benchmark.pedantic(append, rounds=30, iterations=1)
    ms = benchmark.stats.stats.median * 1e3
    doc = b.registry()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        BucketFS(tmp_path, create=True).write_atomic("registry.json", _dumps(doc, False))
        ts.append(time.perf_counter() - t)
    full_ms = float(np.median(ts)) * 1e3
    b.rebuild()  # fold the 30 journal lines back
    benchmark.extra_info.update(median_ms=ms, full_rewrite_ms=full_ms, speedup=full_ms / ms)


def test_lookup(benchmark, registry_bucket):
    b = Bucket(registry_bucket)
    cid = b.discover("model-5")[17]["context_id"]
    meta = benchmark(b.lookup, cid)
    assert meta["context_id"] == cid
    ms = benchmark.stats.stats.median * 1e3
    benchmark.extra_info.update(median_ms=ms, target_ms=TARGETS["lookup_ms"], ratio_to_target=ms / TARGETS["lookup_ms"])


@pytest.fixture(scope="module")
def big_files():
    """The 512 MiB fp16 context, uncompressed and lz4-chunked (non-zero values)."""
    os.makedirs(BASE, exist_ok=True)
    paths = {c: os.path.join(BASE, f"big_{c}.mcb") for c in ("none", "lz4")}
    if not all(os.path.exists(p) for p in paths.values()):
        nl, nh, seq, hd = SHAPE
        rng = np.random.default_rng(0)
        # KV-like values: smooth along head_dim and correlated across tokens, so lz4 sees realistic
        # (poor) redundancy; fp16 noise bits keep it from compressing to nothing
        layers = []
        for _ in range(nl):
            base = rng.standard_normal((nh, 1, hd)).astype(np.float16)
            layers.append(tuple((base + rng.standard_normal((nh, seq, hd)).astype(np.float16) * np.float16(0.1))
                                for _ in range(2)))
        for c, p in paths.items():
            from mcf.bucket import write_kv

            write_kv(p + ".tmp", layers, dtype="float16", compression=c, threads=2)
            os.replace(p + ".tmp", p)
    return paths


def _touch(path):
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


@pytest.mark.parametrize("verify", ["never", "always", "once"])
def test_inject_mmap(benchmark, big_files, verify):
    """Arrays ready for a runtime, as a bucket serves them: "always" checks the CRC-32 of all 512 MiB
    on every load, "once" checks a file the first time this Bucket loads it and then only its identity
    (device, inode, size, mtime, ctime).  Anchor for "always": zlib.crc32 over the same bytes."""
    import time
    import zlib

    from mcf.bucket.kvfile import CRC_BACKEND

    path = big_files["none"]
    _touch(path)
    root = os.path.join(BASE, "inject")
    b = Bucket(root)
    nl, nh, seq, hd = SHAPE
    cid = context_id_for("bench", content_hash("inject"), "float16", L.KVShape(nl, nh, hd, seq))
    d = os.path.join(root, "contexts", cid)
    if not os.path.exists(os.path.join(d, "metadata.json")):
        with open_kv(path) as f:
            layers = f.load(verify=False)
            b.ingest("bench", layers, content="inject", compression="none")
    b.load(cid, verify=verify, record_access=False)  # "once": the first load pays the check

    def inject():
        return b.load(cid, verify=verify, record_access=False)

    out = benchmark.pedantic(inject, rounds=7 if verify == "always" else 30, iterations=1)
    assert len(out) == SHAPE[0] and out[0][0].shape == SHAPE[1:]
    ms = benchmark.stats.stats.median * 1e3
    with open_kv(path) as f:
        view = f._src.view(64, f.header.compressed_size)
        t = time.perf_counter()
        zlib.crc32(view)
        zlib_ms = (time.perf_counter() - t) * 1e3
    benchmark.extra_info.update(median_ms=ms, target_ms=TARGETS["inject_ms"], ratio_to_target=ms / TARGETS["inject_ms"],
                                bytes=os.path.getsize(path), verify=verify, crc_backend=CRC_BACKEND,
                                zlib_crc_ms=zlib_ms)


def test_materialize_uncompressed(benchmark, big_files):
    """Owned copies of every K/V array, against one np.copyto of the same byte count."""
    import time

    path = big_files["none"]
    _touch(path)
    f = open_kv(path)
    views = f.load(verify=False)
    nbytes = sum(k.nbytes + v.nbytes for k, v in views)
    dst = np.empty(nbytes, np.uint8)
    src = np.frombuffer(f._src.view(64, nbytes), np.uint8)
    outs = [(np.empty_like(k), np.empty_like(v)) for k, v in views]
    anchors = []

    def setup():
        t = time.perf_counter()
        np.copyto(dst, src)
        anchors.append(time.perf_counter() - t)

    def materialize():
        for (k, v), (ok, ov) in zip(views, outs):
            np.copyto(ok, k)
            np.copyto(ov, v)

    benchmark.pedantic(materialize, setup=setup, rounds=7, iterations=1)
    t = benchmark.stats.stats.median
    anchor = float(np.median(anchors))
    benchmark.extra_info.update(gb_per_s=nbytes / t / 1e9, copy_gb_per_s=nbytes / anchor / 1e9,
                                ratio_to_copy=anchor / t, target_ratio=0.6)
    f.close()


@pytest.mark.parametrize("dest", ["fresh", "out"])
@pytest.mark.parametrize("threads", [1, 2])
def test_materialize_lz4(benchmark, big_files, threads, dest):
    """lz4-chunked 512 MiB, every chunk decoded: into newly allocated arrays ("fresh": the kernel's page
    faults on new memory dominate) or into the caller's preallocated KV buffers ("out", the case of a
    runtime with its KV cache allocated).  Anchor: np.copyto of the same bytes between warm buffers."""
    import time

    path = big_files["lz4"]
    _touch(path)
    f = open_kv(path)
    nbytes = f.header.original_size
    kw = {"threads": threads, "verify": False}
    if dest == "out":
        kw["out"] = [(np.ones(SHAPE[1:], np.float16), np.ones(SHAPE[1:], np.float16)) for _ in range(SHAPE[0])]
    out = benchmark.pedantic(f.load, kwargs=kw, rounds=3 if dest == "fresh" else 7, iterations=1)
    assert len(out) == SHAPE[0]
    t = benchmark.stats.stats.median
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        ts.append(time.perf_counter() - t0)
    copy = nbytes / min(ts) / 1e9
    benchmark.extra_info.update(gb_per_s=nbytes / t / 1e9, target_gb_per_s=1.5, threads=threads, dest=dest,
                                compression_ratio=nbytes / f.header.compressed_size, copy_gb_per_s=copy,
                                ratio_to_copy=nbytes / t / 1e9 / copy)
    f.close()


# ------------------------------------------------------------------------------------------------
# the server under load: 4 clients on loopback
# ------------------------------------------------------------------------------------------------
#: the outside review's figures: 4,100 requests from 4 clients, no errors
REVIEW = {"requests": 4100, "p50_ms": 6.7, "p99_ms": 23.0}
CLIENTS = 4
TOKEN = "bench-token-0123456789abcdefghijklmnop"


def _small_npz(i: int) -> bytes:
    import io

    rng = np.random.default_rng(i)
    k = rng.standard_normal((2, 2, 16, 8)).astype(np.float32)
    bio = io.BytesIO()
    np.savez(bio, k=k, v=k + 1)
    return bio.getvalue()


@contextlib.contextmanager
def _serve_bucket(root, seed: int, n: int, content: str, *serve_args):
    """``mcf bucket serve`` as a real process on a fresh bucket at ``root`` of ``n`` small contexts
    (``content`` numbered); yields (port, ids) once it answers, stops it on exit."""
    import http.client
    import socket
    import subprocess
    import sys
    import time

    b = Bucket(root)
    rng = np.random.default_rng(seed)
    ids = [b.ingest("m", [(rng.standard_normal((2, 16, 8)).astype(np.float32),) * 2] * 2, content=f"{content} {i}",
                    dtype="float32")["context_id"] for i in range(n)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MCF_BUCKET_TOKEN=TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "mcf.cli", "bucket", "serve", "--root", str(root), "--port",
                             str(port), *serve_args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/mcrp/v1/openapi.json")
                c.getresponse().read()
                c.close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield port, ids
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def load_server(tmp_path_factory):
    """``mcf bucket serve`` as a real process on a fresh bucket of 200 small contexts; yields (port, ids)."""
    pytest.importorskip("uvicorn", reason="the server extra")
    with _serve_bucket(tmp_path_factory.mktemp("load"), 1, 200, "seed") as served:
        yield served


def _drive(port: int, plan) -> dict:
    """Run ``plan(client, i) -> (method, path, body, headers, want_status, kind)`` on CLIENTS keep-alive
    connections at once; returns latencies per kind (seconds), errors and wall time."""
    import http.client
    import threading
    import time

    lat: dict = {}
    errors = []
    lock = threading.Lock()
    go = threading.Barrier(CLIENTS + 1)

    def client(c: int, n: int):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine: dict = {}
        go.wait()
        for i in range(n):
            method, path, body, headers, want, kind = plan(c, i)
            t = time.perf_counter()
            conn.request(method, path, body=body, headers={"Authorization": f"Bearer {TOKEN}", **headers})
            r = conn.getresponse()
            r.read()
            mine.setdefault(kind, []).append(time.perf_counter() - t)
            if r.status != want:
                errors.append((kind, r.status))
        conn.close()
        with lock:
            for k, v in mine.items():
                lat.setdefault(k, []).extend(v)

    n = plan.per_client
    ts = [threading.Thread(target=client, args=(c, n)) for c in range(CLIENTS)]
    for t in ts:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return {"latencies": lat, "errors": errors, "seconds": time.perf_counter() - t0}


def _report(benchmark, res: dict) -> None:
    info = {"clients": CLIENTS, "errors": len(res["errors"]), "wall_s": res["seconds"],
            "review_p50_ms": REVIEW["p50_ms"], "review_p99_ms": REVIEW["p99_ms"]}
    total = 0
    for kind, xs in sorted(res["latencies"].items()):
        a = np.sort(np.array(xs)) * 1e3
        total += len(a)
        info[f"{kind}_requests"] = len(a)
        info[f"{kind}_per_s"] = len(a) / res["seconds"]
        info[f"{kind}_p50_ms"] = float(np.percentile(a, 50))
        info[f"{kind}_p99_ms"] = float(np.percentile(a, 99))
    allx = np.sort(np.concatenate([np.array(x) for x in res["latencies"].values()])) * 1e3
    info.update(requests=total, requests_per_s=total / res["seconds"], p50_ms=float(np.percentile(allx, 50)),
                p99_ms=float(np.percentile(allx, 99)))
    info["p50_over_review"] = info["p50_ms"] / REVIEW["p50_ms"]
    info["p99_over_review"] = info["p99_ms"] / REVIEW["p99_ms"]
    try:
        info["loadavg_1min"] = os.getloadavg()[0]
    except OSError:
        pass
    benchmark.extra_info.update(info)
    assert not res["errors"], res["errors"][:5]


class _Plan:
    def __init__(self, fn, per_client: int):
        self.fn, self.per_client = fn, per_client

    def __call__(self, c, i):
        return self.fn(c, i)


def test_server_lookups_4_clients(benchmark, load_server):
    """GET /contexts/{id} (reads and validates metadata.json), 4 keep-alive clients, 1,025 each."""
    port, ids = load_server
    plan = _Plan(lambda c, i: ("GET", f"/mcrp/v1/contexts/{ids[(c * 1025 + i) % len(ids)]}", None, {}, 200, "lookup"),
                 REVIEW["requests"] // CLIENTS)
    res = {}
    benchmark.pedantic(lambda: res.update(_drive(port, plan)), rounds=1, iterations=1)
    _report(benchmark, res)


def test_server_ingests_4_clients(benchmark, load_server):
    """POST /contexts (a 4 KiB .npz each: spooled, checked, written, fsynced, journaled), 4 clients."""
    port, _ = load_server
    bodies = [_small_npz(i) for i in range(400)]
    run = [0]

    def step(c, i):
        k = c * 100 + i
        return ("POST", f"/mcrp/v1/contexts?model_id=m&content=ingest-{run[0]}-{k}&dtype=float32", bodies[k],
                {"Content-Type": "application/octet-stream"}, 201, "ingest")

    plan = _Plan(step, 100)
    res = {}
    benchmark.pedantic(lambda: res.update(_drive(port, plan)), rounds=1, iterations=1)
    _report(benchmark, res)


def test_server_mixed_4_clients(benchmark, load_server):
    """The review's load: 4,100 requests from 4 clients, nine lookups for each ingest."""
    port, ids = load_server
    bodies = [_small_npz(i) for i in range(CLIENTS * 103)]

    def step(c, i):
        if i % 10 == 9:
            k = c * 103 + i // 10
            return ("POST", f"/mcrp/v1/contexts?model_id=m&content=mixed-{k}&dtype=float32", bodies[k],
                    {"Content-Type": "application/octet-stream"}, 201, "ingest")
        return ("GET", f"/mcrp/v1/contexts/{ids[(c * 1025 + i) % len(ids)]}", None, {}, 200, "lookup")

    plan = _Plan(step, REVIEW["requests"] // CLIENTS)
    res = {}
    benchmark.pedantic(lambda: res.update(_drive(port, plan)), rounds=1, iterations=1)
    _report(benchmark, res)


# ------------------------------------------------------------------------------------------------
# slow clients beside well-behaved ones
# ------------------------------------------------------------------------------------------------
SLOW_CAP = 32  # the connection cap of this run: the attackers alone would fill it


def _slow_attack(port: int, stop, counts: dict) -> list:
    """Threads that attack the server on ``port`` until ``stop`` is set: slow readers (a new one every
    0.1 s, none closed, each pipelining 300 GET /openapi.json with a 4 KiB window, never reading: with
    the drips they fill every slot within 3 s, as in the audit),
    drip-fed uploads (6 without the token, 2 with it: one byte every 0.5 s) and one client sending
    unauthenticated requests as fast as it gets answers."""
    import socket
    import threading
    import time

    def sock(rcvbuf=None):
        s = socket.socket()
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        return s

    def readers():
        live = []
        req = b"GET /mcrp/v1/openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 300
        while not stop.is_set():
            try:
                s = sock(4096)
                s.setblocking(False)
                try:
                    s.send(req)
                except OSError:
                    pass
                live.append(s)
                counts["readers"] += 1
            except OSError:
                counts["refused"] += 1
            time.sleep(0.1)
        for s in live:
            s.close()

    def drips(authorised: bool):
        head = (b"POST /mcrp/v1/contexts?model_id=m&content=drip HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n"
                + (f"Authorization: Bearer {TOKEN}\r\n".encode() if authorised else b"") + b"\r\n")
        s = None
        while not stop.is_set():
            try:
                if s is None:
                    s = sock()
                    s.sendall(head)
                    counts["drips"] += 1
                s.send(b"x")
            except OSError:
                if s is not None:
                    s.close()
                s = None
            time.sleep(0.5)
        if s is not None:
            s.close()

    def flood():
        import http.client

        conn = None
        while not stop.is_set():
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/mcrp/v1/registry", headers={"Authorization": "Bearer wrong"})
                conn.getresponse().read()
                counts["flood"] += 1
            except (OSError, http.client.HTTPException):
                conn = None
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=readers), threading.Thread(target=flood)]
    threads += [threading.Thread(target=drips, args=(i < 2,)) for i in range(8)]
    for t in threads:
        t.start()
    return threads


def test_server_lookups_beside_slow_clients(benchmark, tmp_path_factory):
    """4 keep-alive clients, 600 lookups each: alone, beside the attackers of ``_slow_attack`` (once they
    have run for 3 s and hold the cap), and alone again.  ``p99_ratio`` is the p99 beside the attackers
    over the mean p99 of the two runs alone (target: within 2x); errors are any answer but 200 to a
    well-behaved client, which must be none.  The attackers also take CPU (the flood is answered as
    fast as it asks), so on a busy 2-core machine the ratio measures that too: report the load."""
    import threading
    import time

    pytest.importorskip("uvicorn", reason="the server extra")
    root = tmp_path_factory.mktemp("slow")
    with _serve_bucket(root, 2, 100, "s", "--max-connections", str(SLOW_CAP)) as (port, ids):
        plan = _Plan(lambda c, i: ("GET", f"/mcrp/v1/contexts/{ids[(c * 600 + i) % len(ids)]}", None, {}, 200,
                                   "lookup"), 600)
        alone = _drive(port, plan)
        stop, counts = threading.Event(), {"readers": 0, "drips": 0, "flood": 0, "refused": 0}
        attackers = _slow_attack(port, stop, counts)
        try:
            time.sleep(3)
            res = {}
            benchmark.pedantic(lambda: res.update(_drive(port, plan)), rounds=1, iterations=1)
        finally:
            stop.set()
            for t in attackers:
                t.join(timeout=30)
        alone_again = _drive(port, plan)

    def p99(r):
        return float(np.percentile(np.array(r["latencies"]["lookup"]) * 1e3, 99))

    anchor = (p99(alone) + p99(alone_again)) / 2
    print(f"beside slow clients: {len(res['errors'])} errors of {sum(map(len, res['latencies'].values()))} "
          f"requests, p99 {p99(res):.1f} ms against {anchor:.1f} ms alone")
    benchmark.extra_info.update(p99_alone_ms=p99(alone), p99_alone_again_ms=p99(alone_again),
                                p99_ratio=p99(res) / anchor, target_p99_ratio=2.0,
                                errors_alone=len(alone["errors"]) + len(alone_again["errors"]),
                                attack_slow_readers=counts["readers"], attack_drips=counts["drips"],
                                attack_flood_requests=counts["flood"], attack_refused=counts["refused"])
    _report(benchmark, res)
