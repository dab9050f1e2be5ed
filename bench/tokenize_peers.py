"""``mcf megatron tokenize`` end to end (JSON lines to .bin/.idx) against the tools it replaces, in one run on
the same cores, corpus and tokenizer: Megatron-LM's ``tools/preprocess_data.py`` way and datatrove's
tokenizer step.

- corpus: Python source files of the standard library (and site-packages, to reach the size), one file a
  JSON line, ``--mb`` MB (default 40) in two files (so that datatrove's two tasks both have work);
- tokenizer: a 32k byte-level BPE trained here with HF tokenizers on the first files (cached);
- ``preprocess_data.py``: what its ``Encoder`` does with a ``multiprocessing.Pool`` of ``--workers``
  processes, ``pool.imap(encoder.encode, lines, 32)``: ``json.loads`` and one HF tokenizers ``encode`` per
  document in the workers, ``np.array(ids)`` and the builder's ``add_document`` in the parent (mcf's Writer
  here, which writes the same bytes as Megatron's builder);
- datatrove: ``JsonlReader`` + ``MegatronDocumentTokenizer`` (HF tokenizers' ``encode_batch``), with
  ``tasks=workers=--workers``;
- mcf: ``tokenize(..., workers=N)`` with ``tokenizer_backend`` hf and auto (fastokens here), N = 1 and
  ``--workers``, each run in a fresh process (its start and imports timed too, as the peers' are).

Every output is checked byte for byte against mcf's (datatrove's with its dtype rule, EOS and empty-text
rule). Each timing is the median of ``--rounds`` runs, the peers interleaved with ours. Run from the
repository root: ``python bench/tokenize_peers.py [--mb 40] [--workers 2] [--rounds 2] [--json out.json]``.

``--scaling`` times mcf alone, 1 worker (as it runs by default, and on one thread) against ``--workers``, on
one file of ``--scaling-mb`` MB (160 by default: the same sources, cached), each run a fresh process, and
prints the ratios and the load average.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import sysconfig
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import bench_dir, print_summary, utf8_texts  # noqa: E402

EOS = "<|endoftext|>"


def _source_lines():
    """JSON lines of Python source files: the standard library's, then site-packages'."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    files += sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "**", "*.py"), recursive=True))
    for t in utf8_texts(files):
        if t.strip():
            yield json.dumps({"text": t}) + "\n"


def build_corpus(root: str, mb: int) -> list:
    """Two files of about ``mb`` MB together, in a folder of that size (cached)."""
    where = os.path.join(root, f"corpus-{mb}")
    paths = [os.path.join(where, f"part{k}.jsonl") for k in (0, 1)]
    stamp = os.path.join(where, "done")
    if os.path.exists(stamp):
        return paths
    os.makedirs(where, exist_ok=True)
    texts, total = [], 0
    for line in _source_lines():
        texts.append(line)
        total += len(line)
        if total >= mb * 1e6:
            break
    half = len(texts) // 2
    for p, part in zip(paths, (texts[:half], texts[half:])):
        with open(p, "w", encoding="utf-8") as f:
            f.writelines(part)
    open(stamp, "w").close()
    return paths


def build_big_corpus(root: str, mb: int) -> str:
    """One file of at least ``mb`` MB (the sources again from the start if they are fewer; cached)."""
    path = os.path.join(root, f"scaling-{mb}.jsonl")
    if os.path.exists(path + ".done"):
        return path
    total = 0
    with open(path, "w", encoding="utf-8") as f:
        while total < mb * 1e6:
            for line in _source_lines():
                f.write(line)
                total += len(line)
                if total >= mb * 1e6:
                    break
    open(path + ".done", "w").close()
    return path


def build_tokenizer(root: str, paths: list) -> str:
    out = os.path.join(root, "bpe32k.json")
    if os.path.exists(out):
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        n = 0
        with open(paths[0], encoding="utf-8") as f:
            for line in f:
                t = json.loads(line)["text"]
                n += len(t)
                yield t
                if n > 8e6:
                    return

    tok.train_from_iterator(texts(), trainer)
    tok.save(out)
    return out


# -- Megatron-LM's preprocess_data.py, its Encoder in a Pool --------------------------------------------
class Encoder:
    """tools/preprocess_data.py's Encoder: the tokenizer is built in each worker (``initializer``), and
    ``encode`` parses one JSON line and tokenizes its text, appending the EOD."""

    def __init__(self, tok_path: str):
        self.tok_path = tok_path

    def initializer(self):
        from tokenizers import Tokenizer

        Encoder.tokenizer = Tokenizer.from_file(self.tok_path)
        Encoder.eod = Encoder.tokenizer.token_to_id(EOS)

    def encode(self, json_line):
        data = json.loads(json_line)
        text = data["text"]
        ids = Encoder.tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) > 0:
            ids.append(Encoder.eod)
        return ids, len(json_line)


def megatron_way(paths, tok_path, out, workers):
    import mcf.megatron as mm

    encoder = Encoder(tok_path)
    with mm.Writer(out, vocab_size=32000) as w:
        with multiprocessing.get_context("fork").Pool(workers, initializer=encoder.initializer) as pool:
            for p in paths:
                with open(p, encoding="utf-8") as fin:
                    for ids, _ in pool.imap(encoder.encode, fin, 32):
                        w.add_document(np.array(ids, dtype=w.dtype), [len(ids)] if ids else [])


def datatrove_way(paths, tok_path, out, workers, logs):
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens.megatron_tokenizer import MegatronDocumentTokenizer

    LocalPipelineExecutor(pipeline=[JsonlReader(os.path.dirname(paths[0]), glob_pattern="part*.jsonl"),
                                    MegatronDocumentTokenizer(output_folder=out, tokenizer_name_or_path=tok_path,
                                                              eos_token=EOS)],
                          tasks=workers, workers=workers, logging_dir=logs).run()


def ours(paths, tok_path, out, workers, backend, env=None, **kw):
    """``tokenize`` in a fresh process, as the peers run (fastokens and HF tokenizers keep caches of the words
    they met: a second run in one process would find them warm), with ``env`` added to its environment.
    Returns its stats."""
    import subprocess

    code = ("import json, sys; from mcf.conversion.tokenize import tokenize; a = json.loads(sys.argv[1]); "
            "s = tokenize(a['paths'], a['out'], a['tok'], append_eod=True, eod_token=a['eos'], workers=a['workers'], "
            "tokenizer_backend=a['backend'], **a['kw']); print(json.dumps(s))")
    arg = json.dumps({"paths": paths, "out": out, "tok": tok_path, "eos": EOS, "workers": workers, "backend": backend,
                      "kw": kw})
    done = subprocess.run([sys.executable, "-c", code, arg], check=True, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def same_bytes(a: str, b: str) -> bool:
    for ext in (".idx", ".bin"):
        with open(a + ext, "rb") as x, open(b + ext, "rb") as y:
            if x.read() != y.read():
                return False
    return True


#: one worker on one thread: fastokens otherwise encodes a batch on every core (FASTOKENS_BPE_THREADS), so
#: "one worker" in one process already uses more than one core; each --workers process uses one
ONE_THREAD = {"FASTOKENS_BPE_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}


def scaling(root: str, args) -> None:
    """``--scaling``: mcf alone on one file of ``--scaling-mb`` MB: 1 worker as it runs by default (the
    backend's own threads on), 1 worker on one thread, and ``--workers``; each run a fresh process,
    interleaved; tokenize's own seconds (after the tokenizer is loaded, the pool's start included) and
    the whole process's."""
    path = build_big_corpus(root, args.scaling_mb)
    tok = build_tokenizer(root, build_corpus(root, args.mb))
    nbytes = os.path.getsize(path)
    work = os.path.join(root, "out-scaling")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    n = args.workers
    runs = {"1": (1, None), "1t": (1, ONE_THREAD), str(n): (n, None)}
    inner: dict = {k: [] for k in runs}
    outer: dict = {k: [] for k in runs}
    cpu: dict = {k: [] for k in runs}
    loads = [os.getloadavg()[0]]
    backend = None
    for _ in range(args.rounds):
        for key, (w, env) in runs.items():
            t0 = time.perf_counter()
            stats = ours([path], tok, os.path.join(work, f"w{key}"), w, "auto", env=env)
            outer[key].append(time.perf_counter() - t0)
            inner[key].append(stats["seconds"])
            cpu[key].append(stats["cpu_seconds"])
            backend = stats["backend"]
            assert stats["workers"] == w, stats
            loads.append(os.getloadavg()[0])
    identical = all(same_bytes(os.path.join(work, "w1"), os.path.join(work, f"w{k}")) for k in runs)
    mb = nbytes / 1e6
    med_in = {k: statistics.median(v) for k, v in inner.items()}
    med_out = {k: statistics.median(v) for k, v in outer.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    lines = [f"tokenize scaling: {mb:.1f} MB of JSON lines (Python source), 32k byte-level BPE, backend {backend}, "
             f"{os.cpu_count()} cores, load average {min(loads):.1f}-{max(loads):.1f} during the runs, median of "
             f"{args.rounds}; outputs byte-identical: {identical}"]
    names = {"1": "1 worker (default threads)", "1t": "1 worker on one thread", str(n): f"{n} workers"}
    for key in runs:
        lines.append(f"  {names[key]:27s}: tokenize {mb / med_in[key]:7.1f} MB/s ({med_in[key]:.2f} s), whole process "
                     f"{mb / med_out[key]:7.1f} MB/s ({med_out[key]:.2f} s), {med_cpu[key]:.2f} CPU s")
    for base in ("1t", "1"):
        lines.append(f"  {n} workers / {names[base]}: {med_in[base] / med_in[str(n)]:.2f}x in tokenize, "
                     f"{med_out[base] / med_out[str(n)]:.2f}x whole process"
                     + (f" (target >= {0.8 * n:.1f}x)" if base == "1t" else ""))
    print_summary(lines, {"seconds_inner": inner, "seconds_process": outer, "cpu_seconds": cpu, "bytes": nbytes,
                          "backend": backend, "load": loads}, args.json)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scaling", action="store_true", help="mcf alone: 1 worker against --workers")
    ap.add_argument("--scaling-mb", type=int, default=160, help="the --scaling corpus, MB")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"   # every tool gets --workers cores, no hidden threads
    root = os.path.join(bench_dir(), "tokenize")
    os.makedirs(root, exist_ok=True)
    if args.scaling:
        return scaling(root, args)
    paths = build_corpus(root, args.mb)
    tok = build_tokenizer(root, paths)
    nbytes = sum(os.path.getsize(p) for p in paths)
    work = os.path.join(root, "out")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        from datatrove.utils.logging import logger

        logger.remove()
        have_datatrove = True
    except ImportError:
        have_datatrove = False
    n = args.workers
    t: dict = {k: [] for k in ("megatron", "datatrove", "hf1", "hfN", "auto1", "autoN")}
    backend = None
    for r in range(args.rounds):
        t["megatron"].append(timed(lambda: megatron_way(paths, tok, os.path.join(work, "meg"), n)))
        t["auto1"].append(timed(lambda: ours(paths, tok, os.path.join(work, "auto1"), 1, "auto")))
        if have_datatrove:
            dt = os.path.join(work, f"dt{r}")
            t["datatrove"].append(timed(lambda: datatrove_way(paths, tok, dt, n, os.path.join(work, f"log{r}"))))
        stats = {}
        t["autoN"].append(timed(lambda: stats.update(ours(paths, tok, os.path.join(work, "autoN"), n, "auto"))))
        backend = stats["backend"]
        t["hf1"].append(timed(lambda: ours(paths, tok, os.path.join(work, "hf1"), 1, "hf")))
        t["hfN"].append(timed(lambda: ours(paths, tok, os.path.join(work, "hfN"), n, "hf")))
    med = {k: statistics.median(v) for k, v in t.items() if v}
    identical = all(same_bytes(os.path.join(work, "meg"), os.path.join(work, k))
                    for k in ("auto1", "autoN", "hf1", "hfN"))
    if have_datatrove:   # datatrove's dataset of each part against ours of that part, with its rules
        for k, p in enumerate(paths):
            ours([p], tok, os.path.join(work, f"dtrule{k}"), n, "auto", dtype_rule="datatrove", empty_text="datatrove")
            identical &= same_bytes(os.path.join(work, f"dtrule{k}"), os.path.join(work, "dt0", f"{k:05d}_tokens"))
    mb = nbytes / 1e6
    load = os.getloadavg()[0]
    lines = [f"tokenize {mb:.1f} MB of JSON lines (Python source), 32k byte-level BPE, {n} workers, "
             f"{os.cpu_count()} cores, load {load:.1f}, median of {args.rounds}; outputs byte-identical: {identical}",
             f"  preprocess_data.py way (Pool of {n})      {mb / med['megatron']:7.1f} MB/s"]
    if "datatrove" in med:
        lines.append(f"  datatrove tokenizer step ({n} tasks)      {mb / med['datatrove']:7.1f} MB/s")
    for key, label in (("hf1", "mcf, hf backend, 1 worker"), ("hfN", f"mcf, hf backend, {n} workers"),
                       ("auto1", f"mcf, auto ({backend}), 1 worker"), ("autoN", f"mcf, auto ({backend}), {n} workers")):
        lines.append(f"  {label:<39} {mb / med[key]:7.1f} MB/s")
    ratio = med['megatron'] / med['autoN']
    lines.append(f"  mcf auto {n} workers / preprocess_data.py way: {ratio:.1f}x (target >= 10x)")
    if "datatrove" in med:
        lines.append(f"  mcf auto {n} workers / datatrove: {med['datatrove'] / med['autoN']:.1f}x (target >= 10x)")
    lines.append(f"  mcf auto {n} workers / 1 worker: {med['auto1'] / med['autoN']:.2f}x (target >= {0.8 * n:.1f}x); "
                 f"hf backend: {med['hf1'] / med['hfN']:.2f}x")
    print_summary(lines, {"seconds": t, "bytes": nbytes, "backend": backend}, args.json)


if __name__ == "__main__":
    main()
