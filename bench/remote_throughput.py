"""Loading the benchmark checkpoint from an object store or an HTTP server on loopback: SeaweedFS (S3) or
nginx, against the bare client's ceiling, Run:ai Model Streamer's S3 reader and the remote path mcf had
before its concurrent ranged reads.

    unshare --net sh -c 'ip link set lo up; python bench/remote_throughput.py --server s3 --rounds 5 --today OLD'
    unshare --net sh -c 'ip link set lo up; python bench/remote_throughput.py --server http --rounds 5 --today OLD'

``OLD`` is a built checkout of the code to compare with (the figures in bench/results/loading.md and
bench/results/remote.md used 4723e8b, main before the read engine and the obstore client:
``git archive 4723e8b | tar -x -C OLD``, then
``python setup.py build_ext --inplace`` there).  The network namespace keeps every server and client on
a private loopback.

The objects are the files of bench/loading_model.py: ``model.safetensors`` (1.67 GB, one safetensors file
written by safetensors) and ``model.mcf`` (the same weights).  Every figure comes from a fresh process
(bench/load_child.py: timed after its imports, the result touched page by page, peak RSS, host state),
the cases in a new seeded order every round (SeaweedFS collects the garbage of a 1.5 GB burst while the
next case runs, so a fixed order would always charge it to the same case), medians over rounds.  The
server's files are read through right before every run, so the server serves from its page cache.

- ceiling: the same bytes as parallel ranged GETs by a bare client, obstore's ``get_ranges`` (8 MiB and
  16 MiB ranges; it keeps 10 in flight and returns each range as its own buffer), nothing else done;
- mcf: ``mcf.safetensors.load_file(url)`` and ``mcf.torch.load_file(url)`` of model.safetensors,
  ``mcf.load_file(url)`` of model.mcf, with their defaults, and the raw remote path under them,
  ``open_source(url).readinto(0, dst)`` of the whole object (``--sweep`` adds ``threads`` x
  ``chunk_bytes`` variants of ``mcf.safetensors.load_file``);
- Run:ai Model Streamer's ``SafetensorsStreamer`` on the ``s3://`` URL (its S3 reader, defaults; S3 only);
- today (``--today OLD``): ``mcf.load_file(url)`` of model.mcf and the raw ``readinto`` in that checkout.

Targets: on S3, mcf >= 0.9x the ceiling and >= 2x Run:ai's streamer; over HTTP,
>= 0.9x the ceiling and >= 5x the path before.  Peak RSS: the result plus at most 2x the staging
(requests in flight x request size: 16 x 8 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from bench_common import print_summary, touch_files  # noqa: E402
from host_state import load_average, machine  # noqa: E402
from loading_model import loading_model  # noqa: E402

MiB = 1 << 20
STAGING = 16 * 8 * MiB   # the object row of mcf/_core/storage.py: requests in flight x request size


def _cases(a, urls, files):
    """name -> (label, role, spec, PYTHONPATH)."""
    st, mc = urls["model.safetensors"], urls["model.mcf"]
    out = {
        "ceiling8": ("ceiling: obstore get_ranges, 8 MiB ranges", "ceiling",
                     {"case": "ceiling", "url": st, "part": 8 * MiB, "file": files["model.safetensors"]}, ROOT),
        "ceiling16": ("ceiling: obstore get_ranges, 16 MiB ranges", "ceiling",
                      {"case": "ceiling", "url": st, "part": 16 * MiB, "file": files["model.safetensors"]}, ROOT),
        "mcf.safetensors": ("mcf.safetensors.load_file(url), numpy", "mcf", {"case": "mcf.safetensors", "url": st},
                            ROOT),
        "mcf.torch": ("mcf.torch.load_file(url)", "mcf", {"case": "mcf.torch", "url": st}, ROOT),
        "mcf.load_file.mcf": ("mcf.load_file(url of .mcf)", "mcf", {"case": "mcf.load_file.mcf", "url": mc}, ROOT),
        "raw": ("open_source(url).readinto, the whole object", "raw",
                {"case": "remote.readinto", "url": st, "file": files["model.safetensors"]}, ROOT),
    }
    if a.server == "s3":
        out["runai"] = ("Run:ai Model Streamer, SafetensorsStreamer (S3)", "peer", {"case": "runai", "url": st}, ROOT)
    if a.today:
        out["today.mcf"] = (f"before ({os.path.basename(a.today.rstrip('/'))}): mcf.load_file(url of .mcf)", "today",
                            {"case": "mcf.load_file.mcf", "url": mc}, a.today)
        out["today.raw"] = (f"before ({os.path.basename(a.today.rstrip('/'))}): open_source(url).readinto", "today",
                            {"case": "remote.readinto", "url": st, "file": files["model.safetensors"]}, a.today)
    if a.sweep:
        for part, conc in ((4, 16), (8, 8), (8, 32), (16, 8), (16, 16), (32, 8)):
            out[f"sweep{part}x{conc}"] = (f"mcf.safetensors.load_file(url, chunk_bytes={part} MiB, threads={conc})",
                                          "sweep", {"case": "mcf.safetensors", "url": st,
                                                    "kwargs": {"chunk_bytes": part * MiB, "threads": conc}}, ROOT)
    return out


def _run(spec, env, pythonpath):
    spec = {"state": "none", **spec}
    p = subprocess.run([sys.executable, os.path.join(HERE, "load_child.py"), json.dumps(spec)],
                       env={**os.environ, **env, "PYTHONPATH": pythonpath}, capture_output=True, text=True,
                       timeout=1800)
    if p.returncode:
        raise RuntimeError(f"{spec['case']} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _server_files(srv, a, work) -> list:
    """The files the server reads from (nginx: the served files; SeaweedFS: its volumes), to touch."""
    root = srv.root if a.server == "http" else os.path.join(work, "weed")
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if os.path.getsize(os.path.join(d, n)) > MiB]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", choices=["s3", "http"], required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--today", help="a built checkout whose mcf is the baseline (the path before)")
    ap.add_argument("--sweep", action="store_true", help="also chunk_bytes x threads variants of the loader")
    ap.add_argument("--json", help="write every run here")
    a = ap.parse_args(argv)
    import _http_server
    import _s3_server

    m = loading_model()
    files = {"model.safetensors": m.single, "model.mcf": m.mcf}
    work = tempfile.mkdtemp(prefix="mcf-bench-remote-")
    load0 = load_average()
    runs = {}
    if a.server == "s3":
        cm = _s3_server.serve(os.path.join(work, "weed"))
    else:   # nginx serves a directory holding both files under the names the S3 server gets
        www = os.path.join(work, "www")
        os.makedirs(www)
        for name, path in files.items():
            os.symlink(path, os.path.join(www, name))
        cm = _http_server.serve(www, os.path.join(work, "http"))
    with cm as srv:
        if a.server == "s3":
            for name, path in files.items():
                srv.put(name, path)
            # no client ever asks the instance metadata service; Run:ai's S3 client addresses the bucket by path
            env = {**srv.env(), "AWS_EC2_METADATA_DISABLED": "true", "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9",
                   "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
        else:
            env = {}
        urls = {name: srv.url(name) for name in files}
        cases = _cases(a, urls, files)
        for r in range(a.rounds):
            order = list(cases.items())
            random.Random(r).shuffle(order)
            for key, (label, _role, spec, pp) in order:
                touch_files(_server_files(srv, a, work))
                res = _run({**spec, "verify": r == 0}, env, pp)
                runs.setdefault(key, []).append(res)
                v = res.get("verified")
                print(f"round {r + 1}: {label}: {res['nbytes'] / res['seconds'] / 1e9:.3f} GB/s"
                      + (f" [{v}]" if v else ""), flush=True)
                if v not in (None, "ok"):
                    raise SystemExit(f"{label}: {v}")
    load1 = load_average()
    gbps = {k: statistics.median(x["nbytes"] / x["seconds"] / 1e9 for x in v) for k, v in runs.items()}
    ceiling = max(gbps["ceiling8"], gbps["ceiling16"])
    lines = [f"{a.server} ({'SeaweedFS' if a.server == 's3' else srv.kind}), {m.nbytes / 1e9:.2f} GB, {a.rounds} "
             f"interleaved rounds, load average {load0:.1f} -> {load1:.1f}; {machine()}",
             f"  {'client':64s} {'GB/s':>6} {'x ceil':>6} {'RSS+ GB':>7} {'other':>5}  (each round)"]
    for key, (label, _role, _spec, _pp) in cases.items():
        v = runs[key]
        rss = statistics.median(x["peak_rss"] - x["rss_before"] - x["nbytes"] for x in v)
        other = statistics.median(x["other_cpu"] for x in v if x.get("other_cpu") is not None)
        lines.append(f"  {label[:64]:64s} {gbps[key]:6.3f} {gbps[key] / ceiling:6.2f} {rss / 1e9:+7.2f} "
                     f"{other * 100:4.0f}%  "
                     "(" + ", ".join(f"{x['nbytes'] / x['seconds'] / 1e9:.3f}" for x in v) + ")")
    lines.append("")
    for key in ("mcf.safetensors", "mcf.torch", "mcf.load_file.mcf"):
        lines.append(f"  {key}: {gbps[key] / ceiling:.2f}x the ceiling (target >= 0.9x): "
                     f"{'met' if gbps[key] >= 0.9 * ceiling else 'NOT met'}")
        if "runai" in gbps:
            lines.append(f"  {key}: {gbps[key] / gbps['runai']:.2f}x Run:ai's streamer (target >= 2x): "
                         f"{'met' if gbps[key] >= 2 * gbps['runai'] else 'NOT met'}")
        rss = statistics.median(x["peak_rss"] - x["rss_before"] - x["nbytes"] for x in runs[key])
        lines.append(f"  {key}: peak RSS result {rss / MiB:+.0f} MiB (target <= +{2 * STAGING // MiB} MiB): "
                     f"{'met' if rss <= 2 * STAGING else 'NOT met'}")
    if "today.mcf" in gbps:
        for new, old in (("mcf.load_file.mcf", "today.mcf"), ("raw", "today.raw")):
            lines.append(f"  {new}: {gbps[new] / gbps[old]:.2f}x the path before (target over HTTP >= 5x)")
    print_summary(lines, runs, a.json)


if __name__ == "__main__":
    main()
