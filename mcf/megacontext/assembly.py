"""Working-context assembly: a focus plan in, token ids + gist rows (or one [n, d] matrix) out.

A plan is a sequence of ``(level, index)`` entries in timeline order, the shape a focus allocator
produces: ``(0, b)`` is LOD0 block ``b`` (its block_size tokens, or fewer for the partial last block),
``(1, i)`` is LOD1 gist ``i`` (tokens [32i, 32i+32)), ``(2, j)`` LOD2 gist ``j`` (tokens
[1024j, 1024j+1024)).  Each token of an LOD0 entry becomes one row of the working context; each gist
becomes one row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mcf._core.args import integer
from mcf.errors import InvalidArgumentError
from mcf.megacontext import _megacontext as _mc

__all__ = ["Plan", "WorkingContext", "assemble", "plan_tail", "plan_coverage"]


@dataclass(frozen=True)
class Plan:
    """A focus plan as two parallel arrays (uint8 levels, int64 indices)."""

    levels: np.ndarray
    indices: np.ndarray

    @classmethod
    def of(cls, entries) -> "Plan":
        """A Plan from a Plan, a sequence of (level, index) pairs or an [m, 2] integer array."""
        if isinstance(entries, Plan):
            return entries
        a = np.asarray(entries if len(entries) else np.empty((0, 2), np.int64))
        if a.ndim != 2 or a.shape[1] != 2 or (a.size and a.dtype.kind not in "iu"):
            raise InvalidArgumentError("a plan is a sequence of (level, index) integer pairs")
        if a.size and (a[:, 0].min() < 0 or a[:, 0].max() > 2):
            k = int(np.flatnonzero((a[:, 0] < 0) | (a[:, 0] > 2))[0])
            raise InvalidArgumentError(f"plan entry {k}: unknown level {int(a[k, 0])} (expected 0, 1 or 2)")
        if a.size and a.dtype == np.uint64 and a[:, 1].max() >= 2**63:
            raise InvalidArgumentError("plan index too large")
        return cls(a[:, 0].astype(np.uint8), a[:, 1].astype(np.int64))

    def __len__(self) -> int:
        return int(self.levels.shape[0])

    def __iter__(self):
        return iter(zip(self.levels.tolist(), self.indices.tolist()))

    def rows(self, num_tokens: int, block_size: int) -> int:
        """How many working-context rows the plan yields."""
        tok = self.levels == 0
        r = np.ones(len(self), dtype=np.int64)
        r[tok] = np.minimum(block_size, num_tokens - self.indices[tok] * block_size)
        return int(r.sum())


@dataclass(frozen=True)
class WorkingContext:
    """The result of :func:`assemble`.

    ``levels`` (uint8) and ``positions`` (int64, first token each row covers) have one entry per row.
    ``token_ids`` holds the ids of the LOD0 rows in row order.  Without an embedding table, ``gists``
    holds the gist rows ([n_gists, d], in the dtype :func:`assemble` describes) and ``embeddings`` is
    None; with one, ``embeddings`` is the [n, d] matrix (token rows looked up in the table, gist rows converted) and
    :attr:`gists` reads the gist rows back out of it.
    """

    levels: np.ndarray
    positions: np.ndarray
    token_ids: np.ndarray
    gist_rows: np.ndarray | None
    embeddings: np.ndarray | None
    block_size: int

    def __len__(self) -> int:
        return int(self.levels.shape[0])

    @property
    def gists(self) -> np.ndarray:
        if self.gist_rows is not None:
            return self.gist_rows
        return self.embeddings[self.levels != 0]

    @property
    def spans(self) -> np.ndarray:
        """Tokens covered by each row: 1, block_size or block_size**2."""
        return np.power(np.int64(self.block_size), self.levels.astype(np.int64))

    @property
    def token_rows(self) -> np.ndarray:
        return np.flatnonzero(self.levels == 0)


def assemble(tree, plan, embeddings=None, *, out=None, dtype=None, threads: int = 1) -> WorkingContext:
    """Gather the working context of ``plan`` from ``tree`` in one compiled call (GIL released).

    ``embeddings``: optional [vocab, d] table (fp16, bf16 or fp32, e.g. a model's input embeddings);
    then the result's ``embeddings`` is one [n, d] matrix of ``dtype`` (default the table's), written
    into ``out`` when given (reuse it across steps to skip the allocation).  ``threads`` > 1 splits
    large gathers across threads.  Indices are checked against the committed counts; token ids
    against the table's rows.

    q8 gist rows (a "q8" or "hybrid" tree) are decoded inside the same call, straight into their output
    rows, with MCF's dequantization kernel (the SIMD variant ``MCF_FORCE_IMPL`` names, else the best the
    CPU runs).  Without a table the gist rows come out in ``dtype``, by default the levels' common float
    dtype, or float32 when a level is q8 or the levels differ."""
    tree.check_open()
    p = Plan.of(plan)
    threads = integer(threads, "threads", minimum=1)
    t, n1, n2 = tree.counts
    srcs = (tree.level_source(0, t), tree.level_source(1, n1) if n1 else None, tree.level_source(2, n2) if n2 else None)
    levels, positions, token_ids, gists, matrix = _mc.assemble(
        srcs, (t, n1, n2), tree.block_size, tree.embedding_dim,
        (tree.gist_dtype_of(1).code, tree.gist_dtype_of(2).code), p.levels, p.indices,
        table=embeddings, out=out, out_dtype=dtype, threads=threads)
    return WorkingContext(levels, positions, token_ids, gists, matrix, tree.block_size)


def timeline_counts(tree_or_counts, *, block_size: int = 32, who: str = "plan_tail") -> tuple:
    """``((num_tokens, lod1_gists, lod2_gists), block_size)`` of a tree, or of such a triple (checked
    for consistency with ``block_size``): the timeline a plan is made for.  ``who`` names the caller in
    the error."""
    if hasattr(tree_or_counts, "counts") and hasattr(tree_or_counts, "block_size"):
        return tuple(tree_or_counts.counts), tree_or_counts.block_size
    try:
        t, n1, n2 = tree_or_counts
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{who} needs a tree or (num_tokens, lod1_gists, lod2_gists)") from None
    t, n1, n2 = integer(t, "num_tokens"), integer(n1, "lod1_gists"), integer(n2, "lod2_gists")
    block_size = integer(block_size, "block_size", minimum=1)
    if min(t, n1, n2) < 0 or n1 > t // block_size or n2 > n1 // block_size:
        raise InvalidArgumentError(f"inconsistent counts {(t, n1, n2)} for block_size {block_size}")
    return (t, n1, n2), block_size


def plan_tail(tree, budget: int, recent_tokens: int, *, block_size: int = 32) -> Plan:
    """The simple focus plan of the seeds, without a LensNet: the most recent ``recent_tokens`` tokens
    (whole blocks, the partial last block included) at LOD0, older blocks as LOD1 gists, older groups
    as LOD2 gists, the most recent LOD2 gists expanded to LOD1 while the ``budget`` (rows) allows.

    ``tree`` is a tree or ``(num_tokens, lod1_gists, lod2_gists)`` (then ``block_size`` applies).
    Blocks without a gist yet stay at LOD0.  When the whole timeline does not fit even as LOD2 gists,
    the plan covers the most recent part that does (oldest entries dropped).  Entries are in timeline
    order and cover a contiguous suffix of the timeline (see :func:`plan_coverage`)."""
    (t, n1, n2), k = timeline_counts(tree, block_size=block_size)
    for name, v in (("budget", budget), ("recent_tokens", recent_tokens)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise InvalidArgumentError(f"{name} must be a non-negative integer, got {v!r}")
    budget = int(budget)
    nb = -(-t // k)                                   # blocks, the partial one included
    b0 = max(0, t - int(recent_tokens)) // k          # first LOD0 block
    b0 = min(b0, n1)                                  # blocks without a gist must stay at LOD0
    if t - b0 * k > budget:                           # not even the recent tokens fit: keep what does
        if t % k > budget:
            raise InvalidArgumentError(f"budget {budget} is smaller than the partial last block ({t % k} tokens)")
        b0 = -(-(t - budget) // k)
        if b0 > n1:                                   # older blocks have no gist: the plan stops here
            return _plan([], [], range(b0, nb))
    left = budget - (t - b0 * k)
    g2 = min(n2, b0 // k)                             # LOD2 gists wholly before the LOD0 region
    rest1 = range(g2 * k, b0)                         # LOD1 gists not under an available LOD2 gist
    if len(rest1) >= left:
        return _plan([], range(b0 - left, b0), range(b0, nb))
    left -= len(rest1)
    if g2 > left:
        return _plan(range(g2 - left, g2), rest1, range(b0, nb))
    left -= g2
    expand = g2 if k == 1 else min(g2, left // (k - 1))
    return _plan(range(0, g2 - expand), range((g2 - expand) * k, b0), range(b0, nb))


def _plan(lod2, lod1, lod0) -> Plan:
    lv = np.concatenate([np.full(len(lod2), 2), np.full(len(lod1), 1), np.zeros(len(lod0))]).astype(np.uint8)
    ix = np.concatenate([np.asarray(lod2, np.int64), np.asarray(lod1, np.int64), np.asarray(lod0, np.int64)])
    return Plan(lv, ix.astype(np.int64))


def plan_coverage(plan, num_tokens: int, *, block_size: int = 32) -> tuple:
    """``(start, stop)``: the tokens a plan covers, checking that its entries are in timeline order
    and leave no gap and no overlap; InvalidArgumentError otherwise."""
    p = Plan.of(plan)
    block_size = integer(block_size, "block_size", minimum=1)
    if not len(p):
        return num_tokens, num_tokens
    w = np.power(np.int64(block_size), p.levels.astype(np.int64))
    w = np.where(p.levels == 0, np.int64(block_size), w)
    start = p.indices * w
    stop = np.minimum(start + w, num_tokens)
    if (start >= num_tokens).any():
        k = int(np.flatnonzero(start >= num_tokens)[0])
        raise InvalidArgumentError(f"plan entry {k} starts at token {int(start[k])}, past the end ({num_tokens})")
    gap = np.flatnonzero(start[1:] != stop[:-1])
    if gap.size:
        k = int(gap[0]) + 1
        raise InvalidArgumentError(f"plan entry {k} starts at token {int(start[k])}, the previous one ends at "
                                   f"{int(stop[k - 1])}")
    return int(start[0]), int(stop[-1])
