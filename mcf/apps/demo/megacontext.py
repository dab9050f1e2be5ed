"""The MegaContext demo on real data: a real text, a real tokenizer, a real embedding matrix.

Tokenizes the README.md shipped with the all-MiniLM-L6-v2 checkpoint paragraph by paragraph (as a
stream), appends the ids to LOD0 as they arrive, builds LOD1/LOD2 gists by mean pooling the checkpoint's
word embeddings, assembles a working context with :func:`plan_tail`, checks it against a plain numpy
assembly, snapshots and verifies the tree, and prints a short summary.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from mcf.conversion.tokenizer import load_tokenizer  # the checkpoint's tokenizer, truncation and padding off

EMBEDDING_TENSOR = "embeddings.word_embeddings.weight"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def _numpy_reference(tree, plan, table):
    rows = []
    for level, index in plan:
        if level == 0:
            rows.extend(table[tree.block(index)].astype(np.float32))
        else:
            rows.append(tree.gist(level, index).astype(np.float32))
    return np.stack(rows)


def demo_megacontext(model_dir, workdir, *, out=None, budget: int = 128, recent_tokens: int = 64) -> int:
    """Build ``<workdir>/megacontext-tree`` from the checkpoint's README.md; returns 0 when every check
    passes."""
    import mcf.megacontext as mc
    from mcf.safetensors.reader import open_checkpoint

    out = out or sys.stdout
    w = out.write
    tree_dir = os.path.join(workdir, "megacontext-tree")
    tok = load_tokenizer(model_dir)
    with open(os.path.join(model_dir, "README.md"), encoding="utf-8") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()]
    ok = True
    with open_checkpoint(model_dir) as ckpt:
        table = ckpt.tensors[EMBEDDING_TENSOR].array()           # [30522, 384] f32, zero-copy
        vocab, d = table.shape
        w(f"== MegaContext tree from {os.path.join(model_dir, 'README.md')}\n   -> {tree_dir}\n")
        t0 = time.perf_counter()
        pool = mc.MeanPool(table, checkpoint=f"mean-pooling:{EMBEDDING_TENSOR}")
        with mc.create(tree_dir, embedding_dim=d, model_name=MODEL_NAME, vocab_size=vocab,
                       gist_dtype="fp16") as tree:
            for para in paragraphs:                               # text arrives paragraph by paragraph
                ids = tok.encode(para, add_special_tokens=False).ids
                tree.append_tokens(np.asarray(ids, dtype=np.uint32), commit=False)
                mc.build_gists(tree, pool, commit=False)
                tree.commit()
            tree.set_ingestion_complete()
            t_build = time.perf_counter() - t0
            t, n1, n2 = tree.counts
            w(f"   {len(paragraphs)} paragraphs -> {t} tokens, {tree.num_blocks} full blocks + "
              f"{t % tree.block_size} tokens in the partial one; {n1} LOD1 + {n2} LOD2 gists "
              f"(mean pooling, d={d} fp16) in {t_build * 1e3:.1f} ms\n")
            for lv in range(3):
                info = tree.info()["files"][f"LOD{lv}"]
                w(f"   {os.path.basename(info['file'])}: {info['file_size_bytes']:>9,} bytes, "
                  f"{info['num_entries']} entries of {info['entry_bytes']} bytes\n")

            plan = mc.plan_tail(tree, budget=budget, recent_tokens=recent_tokens)
            start, stop = mc.plan_coverage(plan, t, block_size=tree.block_size)
            t0 = time.perf_counter()
            wc = tree.assemble(plan, table)
            t_asm = time.perf_counter() - t0
            kinds = {lv: int((wc.levels == lv).sum()) for lv in range(3)}
            w(f"\n== working context: plan_tail(budget={budget}, recent_tokens={recent_tokens})\n")
            w(f"   {len(plan)} entries covering tokens [{start}, {stop}) -> {len(wc)} rows: {kinds[0]} tokens "
              f"(LOD0), {kinds[1]} LOD1 gists, {kinds[2]} LOD2 gists; matrix {wc.embeddings.shape} "
              f"{wc.embeddings.dtype} in {t_asm * 1e3:.2f} ms\n")
            same = np.array_equal(wc.embeddings, _numpy_reference(tree, plan, table))
            ok &= same
            w(f"   equals a plain numpy assembly: {'yes' if same else 'NO'}\n")
            tail = tok.decode(wc.token_ids[-24:].tolist())
            w(f"   most recent tokens: ...{tail!r}\n")

            # the gists mean something: the block whose gist is closest to a query's mean embedding
            q = tok.encode("training data sentence pairs", add_special_tokens=False).ids
            qv = table[q].mean(axis=0)
            g = tree.gists(1).astype(np.float32)
            cos = g @ qv / (np.linalg.norm(g, axis=1) * np.linalg.norm(qv) + 1e-9)
            best = int(np.argmax(cos))
            w(f"   LOD1 gist closest to 'training data sentence pairs': block {best} (cos {cos[best]:.3f}): "
              f"{tok.decode(tree.block(best).tolist())[:90]!r}\n")

            snap = tree.snapshot()

            # the same tree with quantized gists: q8 everywhere, and the hybrid policy (LOD1 fp16, LOD2 q8)
            w("\n== quantized gists (q8: 32 int8 codes + one f16 scale per block)\n")
            base = np.asarray(wc.embeddings, dtype=np.float32)
            gist_rows = wc.levels != 0
            for policy in ("q8", "hybrid"):
                qdir = os.path.join(workdir, f"megacontext-tree-{policy}")
                with mc.create(qdir, embedding_dim=d, model_name=MODEL_NAME, vocab_size=vocab,
                               gist_dtype=policy) as qt:
                    qt.append_tokens(tree.tokens(), commit=False)
                    mc.build_gists(qt, pool)
                    size = sum(qt.info()["files"][f"LOD{lv}"]["file_size_bytes"] for lv in (1, 2))
                    qwc = qt.assemble(plan, table)
                err = float(np.abs(np.asarray(qwc.embeddings, np.float32) - base)[gist_rows].max()) \
                    if gist_rows.any() else 0.0
                same_tokens = np.array_equal(qwc.embeddings[~gist_rows], wc.embeddings[~gist_rows])
                ok &= same_tokens and not mc.verify(qdir, deep=True)
                fp16 = sum(tree.info()["files"][f"LOD{lv}"]["file_size_bytes"] for lv in (1, 2))
                w(f"   {policy:<6}: gist files {size:>9,} bytes ({size / fp16:.2f}x fp16's {fp16:,}); working "
                  f"context: token rows {'identical' if same_tokens else 'DIFFER'}, gist rows within "
                  f"{err:.2e} of fp16's "
                  f"(|gist| <= {float(np.abs(base[gist_rows]).max()) if gist_rows.any() else 0:.3f})\n")
        problems = mc.verify(tree_dir, deep=True) + mc.verify(snap, deep=True)
        ok &= not problems
        w(f"\n== snapshot {snap}\n   mcf ctx verify (tree and snapshot): "
          f"{'OK' if not problems else '; '.join(map(str, problems))}\n")
    return 0 if ok else 1
