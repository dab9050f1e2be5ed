"""Remote reads (mcf.remote: obstore for http(s)://) against local reads, over loopback HTTP.

A ~256 MiB MCF file (32 F16 tensors of 4096 x 1024) is served by nginx (or the uvicorn fallback of
tests/_http_server.py, named in the summary) on a free loopback port.  Every round loads all tensors
into fresh memory with ``Container.load()``:

- local, mapped (the anchor) and local ``mmap=False`` (pread): the page cache is warm, so these are
  memory copies;
- remote: ``mcf.open(url).load()``: the whole plan in ranged GETs of at most ``request_size`` (8 MiB),
  ``concurrency`` (16) in flight;
- yardstick: one plain GET of the whole file with http.client into a preallocated buffer, the
  loopback HTTP path without mcf, fsspec or aiohttp.

Ratios compare interleaved medians of the same run.  The point is what remote loading costs next to
local loading on one machine (no network: loopback measures the HTTP stack and the copies, never a
real link); bench/remote_throughput.py measures the remote path against the bare client's ceiling, on
SeaweedFS (S3) and nginx.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

import mcf  # noqa: E402
from bench_common import Interleaved, bench_dir, bench_median, touch_files  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import _http_server  # noqa: E402

ROUNDS = 5
N_TENSORS, ROWS, COLS = 32, 4096, 1024
NBYTES = N_TENSORS * ROWS * COLS * 2


@pytest.fixture(scope="module")
def remote_model(tmp_path_factory):
    d = os.path.join(bench_dir(), "remote")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "model256.mcf")
    ok = False
    if os.path.exists(path):
        try:
            with mcf.open(path) as c:
                ok = len(c) == N_TENSORS and sum(c.info(n).nbytes for n in c) == NBYTES
        except mcf.MCFError:
            ok = False
    if not ok:
        rng = np.random.default_rng(20261122)
        tmp = path + f".{os.getpid()}.tmp"
        with mcf.Writer(tmp) as w:
            for k in range(N_TENSORS):
                w.add_tensor(f"layer.{k:02d}.weight",
                             (rng.standard_normal((ROWS, COLS), dtype=np.float32) * 0.02).astype(np.float16))
        os.replace(tmp, path)
    with _http_server.serve(d, str(tmp_path_factory.mktemp("srv"))) as srv:
        yield path, srv


def _load(src):
    with mcf.open(src) as c:
        return c.load()


def _load_pread(path):
    with mcf.open(path, mmap=False) as c:
        return c.load()


def _http_get(url):
    """The plainest HTTP client: http.client, one GET, readinto a preallocated buffer (aiohttp's
    ``read()`` of a 256 MiB body took 7-13 s here, which says nothing about the loopback path)."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("GET", u.path)
        r = conn.getresponse()
        size = int(r.headers["Content-Length"])
        buf = bytearray(size)
        mv, n = memoryview(buf), 0
        while n < size:
            k = r.readinto(mv[n:n + (8 << 20)])
            if not k:
                break
            n += k
        assert n == size
        return buf
    finally:
        conn.close()


def _check(sd, path):
    ref = _load(path)
    assert sorted(sd) == sorted(ref)
    for n in ref:
        assert np.array_equal(sd[n], ref[n])


CASES = {
    "local-mmap": ("Container.load(), local file, mapped", "anchor", lambda p, u: _load(p)),
    "local-pread": ("Container.load(), local file, mmap=False", "reference", lambda p, u: _load_pread(p)),
    "remote": ("Container.load(), http:// URL on loopback", "target", lambda p, u: _load(u)),
    "http-get": ("http.client GET of the whole file, readinto", "yardstick", lambda p, u: _http_get(u)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.benchmark(group="remote")
def test_remote_load(benchmark, remote_model, bench_model, report, case):
    path, srv = remote_model
    url = srv.url(os.path.basename(path))
    label, role, fn = CASES[case]
    touch_files([path])
    anchor = Interleaved(lambda: _load(path)) if case != "local-mmap" else None
    result = {}

    def target():
        result["r"] = fn(path, url)

    def teardown(*a, **k):
        r = result.pop("r")
        if case != "http-get" and "checked" not in result:
            _check(r, path)
            result["checked"] = True
        del r

    benchmark.pedantic(target, setup=anchor, teardown=teardown, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    t = bench_median(benchmark)
    if t is None:
        return
    note = f"server: {srv.kind}"
    if anchor is not None:
        a = anchor.median
        note = f"{a / t:.2f}x local mapped load (interleaved); server: {srv.kind}"
        benchmark.extra_info.update(anchor_median_s=a, ratio=a / t)
    report.row("remote", label, role, t, NBYTES if case != "http-get" else os.path.getsize(path), note)
