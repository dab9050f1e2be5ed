"""The Megatron step of ``mcf demo``: tokenize the checkpoint's own README into a dataset."""

from __future__ import annotations

import json
import os
import time

import numpy as np

__all__ = ["demo_megatron", "readme_paragraphs"]


def readme_paragraphs(model_dir: str) -> list:
    """The paragraphs of ``README.md`` in the checkpoint directory (real text shipped with it)."""
    with open(os.path.join(model_dir, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def demo_megatron(model_dir: str, workdir: str) -> dict:
    """Write the README paragraphs as jsonl, tokenize them with the checkpoint's tokenizer.json into
    ``workdir/minilm-readme``, reopen, verify, build a GPT sample index over it and print a summary."""
    import mcf.megatron as mm
    from mcf.conversion.tokenize import tokenize

    os.makedirs(workdir, exist_ok=True)
    src = os.path.join(workdir, "minilm-readme.jsonl")
    paras = readme_paragraphs(model_dir)
    with open(src, "w", encoding="utf-8") as f:
        for p in paras:
            f.write(json.dumps({"text": p}) + "\n")
    prefix = os.path.join(workdir, "minilm-readme")
    print(f"== megatron: tokenizing {len(paras)} README paragraphs -> {prefix}.idx/.bin")
    t0 = time.perf_counter()
    stats = tokenize(src, prefix, os.path.join(model_dir, "tokenizer.json"), append_eod=True)
    dt = time.perf_counter() - t0
    with mm.open(prefix) as ds:
        problems = ds.verify()
        lens = ds.sequence_lengths
        print(f"   {len(ds)} sequences, {ds.num_documents} documents, {ds.num_tokens} tokens ({ds.dtype}) "
              f"in {dt * 1e3:.1f} ms; mean length {float(lens.mean()) if len(lens) else 0:.1f}")
        seq = 32
        samples = mm.GPTSamples(ds, seq, seed=1234)
        first = samples[0] if len(samples) else np.empty(0, np.int64)
        print(f"   GPT samples of {seq}+1 tokens: {len(samples)}; sample 0 starts {first[:8].tolist()}")
        print(f"   megatron verify: {'OK' if not problems else problems}")
    return {"stats": dict(stats), "problems": problems, "samples": len(samples), "prefix": prefix}
