"""Gists for real data without a trained GistNet: mean pooling.

LOD1 gist i is the mean of the embeddings of tokens [32i, 32i+32); LOD2 gist j is the mean of LOD1
gists [32j, 32j+32) as stored (so a tree is reproducible from its own files).  Sums run in float64 in
row order; the mean is rounded to float32, then to the tree's gist dtype (round to nearest even).
This is the "pooling" baseline the seeds pretrain GistNet against; it makes trees that can be built end
to end from text and inspected.
"""

from __future__ import annotations

import numpy as np

from mcf._core.args import integer
from mcf.errors import InvalidArgumentError
from mcf.megacontext import _megacontext as _mc

__all__ = ["MeanPool", "build_gists"]


class MeanPool:
    """Mean pooling over an embedding table (any [vocab, d] fp16/bf16/fp32 array, e.g. a model's input
    embeddings, possibly a zero-copy view of a checkpoint)."""

    def __init__(self, table, *, checkpoint: str = "mean-pooling"):
        t = np.asarray(table)
        if t.dtype.byteorder == ">":  # big-endian values are values: a native copy
            t = t.astype(t.dtype.newbyteorder("="))
        if t.ndim != 2 or _mc.float_code(t.dtype) < 0:
            raise InvalidArgumentError(f"the embedding table must be a 2-D float16/bfloat16/float32 array, got "
                                       f"{t.dtype} {t.shape}")
        self.table = t
        self.checkpoint = checkpoint

    @property
    def embedding_dim(self) -> int:
        return int(self.table.shape[1])

    def pool_tokens(self, ids, block_size: int, dtype) -> np.ndarray:
        """[len(ids) / block_size, d]: the mean embedding of each block of ids."""
        return _mc.pool_tokens(ids, block_size, self.table, dtype)

    def pool_gists(self, rows, block_size: int, dtype) -> np.ndarray:
        """[len(rows) / block_size, d]: the mean of each group of gist rows."""
        return _mc.pool_rows(rows, block_size, dtype)


def build_gists(tree, pooler: MeanPool, *, chunk_blocks: int = 4096, commit: bool = True) -> tuple:
    """Bring LOD1 and LOD2 up to date with LOD0: a gist for every complete block that has none yet,
    then for every complete group of LOD1 gists.  Returns how many gists of each level were added.

    Works from the files, so streaming ingest in any chunking produces the same gists."""
    tree.check_writable()
    if pooler.embedding_dim != tree.embedding_dim:
        raise InvalidArgumentError(f"the pooler's table is {pooler.embedding_dim} wide, the tree's "
                                   f"embedding_dim is {tree.embedding_dim}")
    k = tree.block_size
    added = [0, 0]
    for level in (1, 2):
        gdt = tree.gist_dtype_of(level)   # q8 levels: pooled in float32, quantized by append_gists
        dt = np.dtype(np.float32) if gdt.quantized else _mc.numpy_dtype(gdt.code)
        lower = tree.num_tokens if level == 1 else tree.num_gists(1)
        have = tree.num_gists(level)
        want = lower // k
        step = max(1, integer(chunk_blocks, "chunk_blocks"))
        for g in range(have, want, step):
            h = min(want, g + step)
            if level == 1:
                rows = pooler.pool_tokens(tree.tokens(g * k, h * k), k, dt)
            else:
                rows = pooler.pool_gists(tree.gists(1, slice(g * k, h * k)), k, dt)
            tree.append_gists(level, rows, checkpoint=pooler.checkpoint, commit=False)
            added[level - 1] += h - g
    if commit:
        tree.commit()
    return tuple(added)
