"""Remote read throughput on loopback: SeaweedFS (S3) or nginx (HTTP), one large object read whole.

    unshare --net sh -c 'ip link set lo up; python bench/remote_throughput.py --server s3 --rounds 3'
    python bench/remote_throughput.py --server http --today /path/to/a/checkout/of/main

Figures (GB/s, medians of interleaved rounds, each from a fresh process so no connection pool or
page of the destination is reused between them):

Each round runs the cases in a new (seeded) order.

- ceiling: the same bytes as parallel ranged GETs by a bare client, obstore's ``get_ranges`` (8 and
  16 MiB ranges; it keeps 10 in flight and returns every range as its own buffer), nothing else done;
- mcf: ``mcf.io.open_source(url).read_into([0], [dst])``, a whole-file plan into a fresh array, with
  the defaults (``--sweep`` adds request_size x concurrency variants through ``open_remote``);
- fsspec: the same through ``backend="fsspec"`` (s3fs / fsspec's aiohttp), and with ``--today`` the
  code of another checkout (the path this branch replaced) through its ``open_source(url)``.

The object is ``--size`` GB of f16 noise (never zeros: BENCHMARKING.md), written once under
``$MCF_BENCH_DIR``.  The machine is shared: the load average at start and end is printed with the
figures; compare within one run only.  The issue's targets (issue 24 item 6): mcf >= 0.9x the ceiling
on S3 and over HTTP, >= 5x today's path over HTTP.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

_TIMED = """
import os, time, numpy as np
N = {n}
{setup}
t = time.perf_counter()
{body}
print(N / (time.perf_counter() - t) / 1e9)
"""


def _ceiling(server, part, n):
    if server == "s3":
        store = ("from obstore.store import S3Store\nst = S3Store('models', endpoint=os.environ['AWS_ENDPOINT_URL'], "
                 "region=os.environ['AWS_REGION'], client_options={'allow_http': True})")
    else:
        store = ("from obstore.store import HTTPStore\n"
                 "st = HTTPStore.from_url(os.environ['BENCH_ROOT_URL'], client_options={'allow_http': True})")
    setup = store + f"\nimport obstore\nstarts = list(range(0, N, {part})); ends = [min(a + {part}, N) for a in starts]"
    body = ("rs = obstore.get_ranges(st, 'ckpt.bin', starts=starts, ends=ends, coalesce=0)\n"
            "assert sum(len(r) for r in rs) == N")
    return _TIMED.format(n=n, setup=setup, body=body)


def _mcf(url, n, **options):
    if options:
        setup = f"from mcf.remote import open_remote\nsrc = open_remote({url!r}, **{options!r})"
    else:
        setup = f"import mcf.io\nsrc = mcf.io.open_source({url!r})"
    return _TIMED.format(n=n, setup=setup + "\ndst = np.empty(N, np.uint8)", body="src.read_into([0], [dst])")


def _run(code, env):
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=900)
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return float(p.stdout.split()[-1])


def _data(size_gb):
    import numpy as np

    d = os.path.join(os.environ.get("MCF_BENCH_DIR") or os.path.join(tempfile.gettempdir(), "mcf-bench"), "remote-www")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "ckpt.bin")
    n = int(size_gb * 1e9) // 2 * 2
    if not os.path.exists(path) or os.path.getsize(path) != n:
        rng = np.random.default_rng(24)
        with open(path + ".tmp", "wb") as f:
            left = n
            while left:
                k = min(left, 64 << 20)
                f.write((rng.standard_normal(k // 2, dtype=np.float32) * 0.02).astype(np.float16).tobytes())
                left -= k
        os.replace(path + ".tmp", path)
    return path, n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", choices=["s3", "http"], required=True)
    ap.add_argument("--size", type=float, default=1.5, help="GB (default 1.5)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--today", help="a checkout whose mcf is the baseline (e.g. main before this branch)")
    ap.add_argument("--sweep", action="store_true", help="also request_size x concurrency variants")
    a = ap.parse_args(argv)
    import _http_server
    import _s3_server

    path, n = _data(a.size)
    work = tempfile.mkdtemp(prefix="mcf-bench-remote-")
    load0 = open("/proc/loadavg").read().split()[:3]
    times = {}
    cm = _s3_server.serve(os.path.join(work, "weed")) if a.server == "s3" else \
        _http_server.serve(os.path.dirname(path), os.path.join(work, "http"))
    with cm as srv:
        if a.server == "s3":
            srv.put("ckpt.bin", path)
            # AWS_EC2_METADATA_DISABLED / AWS_METADATA_ENDPOINT: no client ever asks the instance metadata service
            env = {**srv.env(), "AWS_EC2_METADATA_DISABLED": "true", "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9"}
        else:
            env = {"BENCH_ROOT_URL": f"http://127.0.0.1:{srv.port}"}
        url = srv.url("ckpt.bin")
        here = {**env, "PYTHONPATH": ROOT}
        cases = {"ceiling: obstore get_ranges, 8 MiB ranges": (_ceiling(a.server, 8 << 20, n), env),
                 "ceiling: obstore get_ranges, 16 MiB ranges": (_ceiling(a.server, 16 << 20, n), env),
                 "mcf: open_source(url).read_into, defaults": (_mcf(url, n), here),
                 "mcf, backend='fsspec'": (_mcf(url, n, backend="fsspec"), here)}
        if a.today:
            cases[f"today: {a.today} open_source(url).read_into"] = (_mcf(url, n), {**env, "PYTHONPATH": a.today})
        if a.sweep:
            for part, conc in ((4, 8), (8, 4), (8, 16), (16, 8), (16, 16), (32, 8)):
                cases[f"mcf: {part} MiB x {conc}"] = (_mcf(url, n, request_size=part << 20, concurrency=conc), here)
        for r in range(a.rounds):
            # a new order every round: a case must not always follow the same one (the server's garbage
            # collection after a 1.5 GB burst slowed whatever came next)
            order = list(cases.items())
            random.Random(r).shuffle(order)
            for name, (code, e) in order:
                v = _run(code, e)
                times.setdefault(name, []).append(v)
                print(f"round {r + 1}: {name}: {v:.3f} GB/s", flush=True)
    load1 = open("/proc/loadavg").read().split()[:3]
    print(f"\n{a.server} ({'SeaweedFS' if a.server == 's3' else srv.kind}), {n / 1e9:.2f} GB, {a.rounds} interleaved "
          f"rounds, load average {' '.join(load0)} -> {' '.join(load1)}")
    ceiling = max(statistics.median(v) for k, v in times.items() if k.startswith("ceiling"))
    for name, v in times.items():
        m = statistics.median(v)
        print(f"  {name:55s} {m:6.3f} GB/s  {m / ceiling:5.2f}x ceiling   ({', '.join(f'{x:.3f}' for x in v)})")


if __name__ == "__main__":
    main()
