"""The focus allocator of the MegaContext design (seed 001): scores in, the next working-context plan out.

A model the caller runs (LensNet, or anything else) scores the entries of the current working context;
:func:`focus_plan` turns those scores into the next plan, which :func:`mcf.megacontext.assemble` reads
unchanged.  Scores are *signed utilities*, as in the MegaContext design: high means "needs more detail",
low means "can be compressed".

The rules, and why (docs/megacontext.md, "Focus plan"):

* **One level per step.**  An LOD1 gist with a score above ``tau_expand`` becomes its LOD0 block, an LOD2
  gist its 32 LOD1 gists.  An LOD0 block collapses into its LOD1 gist, and 32 aligned LOD1 siblings into
  their LOD2 gist, when the span's score is below ``-tau_collapse``.  A span's score is the *largest* score
  of its rows (one row scoring high keeps the whole span in detail), so a partial view never hides a
  relevant token.  Only spans whose parent gist exists collapse: the partial last block, blocks whose gist
  GistNet has not written yet and LOD1 runs that do not fill an aligned group stay as they are.  Moving one
  level at a time keeps each step small and lets the scorer see the new entries before going further.
* **The budget counts working-context rows**: a token costs 1 and a gist costs 1, as in
  :meth:`Plan.rows` and :func:`plan_tail`.  Every expansion and every collapse changes the row count by
  exactly ``block_size - 1``.
* **Greedy by score within the budget.**  Threshold collapses are always applied (they only free rows).
  Expansions are then taken from the highest score down; one that does not fit is paid for by collapsing
  the lowest-scoring collapsible span, but only a span scoring strictly lower than the expansion, so a
  swap always raises the plan's total score and equal scores never trade places.  The first expansion
  that can be neither afforded nor paid for ends the step (the later ones score no higher).
* **Over budget** (the budget shrank, or new tokens arrived): the lowest-scoring collapsible spans are
  collapsed until the plan fits, going further than one level when it must (no expansion is made in such a
  step); when even the most collapsed plan of the covered tokens does not fit, InvalidArgumentError says
  how many rows that plan needs.
* **Deterministic.**  Ties are broken by position: among equal scores, collapses take the oldest span
  first and expansions the most recent gist first (recent text is likelier to be needed next).  The same
  inputs always give the same plan.
* **Stable.**  When no score crosses a threshold, the timeline did not grow and the plan is within
  budget, the plan comes back unchanged.
* **Contiguous.**  The plan covers the same tokens as the current one, in order, each exactly once;
  tokens appended to the tree since then are added at LOD0 (they are the newest text and have no score
  yet: they score +inf, so they are the last spans a step collapses).  An empty current plan is the empty prefix:
  the whole timeline comes in at LOD0 and is collapsed, oldest first, to fit the budget.
"""

from __future__ import annotations

import numpy as np

from mcf._core.args import integer
from mcf.errors import InvalidArgumentError
from mcf.megacontext.assembly import Plan, WorkingContext, plan_coverage, timeline_counts

__all__ = ["focus_plan"]

# what happens to an entry in a step
_KEEP, _EXPAND, _COLLAPSE, _ABSORBED = 0, 1, 2, 3   # _ABSORBED: a non-first member of a collapsed LOD1 group


def focus_plan(tree, current, scores, *, budget: int, tau_expand: float, tau_collapse: float,
               block_size: int = 32) -> Plan:
    """The next working-context plan: ``current`` refocused by ``scores`` within ``budget`` rows.

    ``tree``: the tree (or ``(num_tokens, lod1_gists, lod2_gists)``, then ``block_size`` applies).
    ``current``: the plan the scores were computed for (a :class:`Plan`, ``(level, index)`` pairs) or the
    :class:`WorkingContext` assembled from it.  ``scores``: one float per plan entry, or one per
    working-context row (an LOD0 block then scores as the largest of its token rows).  An LOD1/LOD2 gist
    scoring above ``tau_expand`` is expanded one level; a span scoring below ``-tau_collapse`` collapses
    into its parent gist (``tau_expand >= -tau_collapse``; LensNet's POC uses 0.2 and 0.2).  The rules
    (budget, ties, stability) are in this module's docstring and docs/megacontext.md."""
    (t, n1, n2), k = timeline_counts(tree, block_size=block_size, who="focus_plan")
    budget = integer(budget, "budget", minimum=0)
    tau_e, tau_c = _threshold(tau_expand, "tau_expand"), _threshold(tau_collapse, "tau_collapse")
    if tau_e < -tau_c:
        raise InvalidArgumentError(f"tau_expand ({tau_e}) must be >= -tau_collapse ({-tau_c}): a score between "
                                   "them would mean both expand and collapse")
    lv, ix, sc = _entries(current, scores, (t, n1, n2), k)
    lv, ix, sc = _extend(lv, ix, sc, t, k)
    rows = _rows(lv, ix, t, k)
    total = int(rows.sum())
    step = k - 1

    pool = _collapsible(lv, ix, sc, n1, n2, k, t)
    npool = len(pool[0])
    action = np.zeros(len(lv), np.int8)
    taken = 0
    while taken < npool and (pool[1][taken] < -tau_c or total > budget):
        _collapse(action, pool, taken, k)
        total -= step
        taken += 1
    if total > budget:                 # one level was not enough: collapse further, no expansion this step
        return _fit(*_apply(lv, ix, sc, action, k), budget, (t, n1, n2), k)

    expand = np.flatnonzero((lv > 0) & (sc > tau_e))
    # highest score first; among equals the most recent first
    expand = expand[np.lexsort((-_start(lv[expand], ix[expand], k), -sc[expand]))]
    for e in expand.tolist():
        if action[e] != _KEEP:         # inside an LOD1 group collapsed to pay for a higher-scoring expansion
            continue
        if total + step > budget:
            if taken < npool and pool[1][taken] < sc[e]:
                _collapse(action, pool, taken, k)
                total -= step
                taken += 1
            else:
                break
        action[e] = _EXPAND
        total += step
    return Plan(*_apply(lv, ix, sc, action, k)[:2])


def _threshold(v, name: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not np.isfinite(v):
        raise InvalidArgumentError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _entries(current, scores, counts, k):
    """(levels int64, indices int64, per-entry scores float64) of the current plan, validated against the
    tree's counts."""
    t, n1, n2 = counts
    try:
        a = np.asarray(scores)
    except (TypeError, ValueError):
        raise InvalidArgumentError("scores must be a one-dimensional sequence of numbers") from None
    if a.ndim != 1 or (a.size and a.dtype.kind not in "fiu" and a.dtype.name != "bfloat16"):
        raise InvalidArgumentError(f"scores must be a one-dimensional sequence of numbers, got {a.dtype} of shape "
                                   f"{a.shape}")
    s = a.astype(np.float64)
    if np.isnan(s).any():
        raise InvalidArgumentError(f"score {int(np.flatnonzero(np.isnan(s))[0])} is NaN")

    if isinstance(current, WorkingContext):
        if current.block_size != k:
            raise InvalidArgumentError(f"the working context has block_size {current.block_size}, the tree {k}")
        lv, ix, first = _entries_of_rows(current.levels, current.positions, k)
        row_counts = np.diff(np.append(first, len(current.levels)))
    else:
        p = Plan.of(current)
        lv, ix = p.levels.astype(np.int64), p.indices.copy()
        first = None
        row_counts = None
    _check_indices(lv, ix, counts, k)
    if len(lv):
        plan_coverage(Plan(lv.astype(np.uint8), ix), t, block_size=k)   # contiguous, in order, inside the timeline
    if row_counts is None:
        row_counts = _rows(lv, ix, t, k)
    if len(s) == len(lv):
        return lv, ix, s.copy()
    if len(s) == int(row_counts.sum()):
        if first is None:
            first = np.concatenate([[0], np.cumsum(row_counts)[:-1]]).astype(np.int64)
        return lv, ix, np.maximum.reduceat(s, first) if len(s) else s.copy()
    raise InvalidArgumentError(f"{len(s)} scores for a plan of {len(lv)} entries and {int(row_counts.sum())} rows: "
                               "give one score per entry or one per row")


def _entries_of_rows(levels, positions, k):
    """The plan of a working context's rows: (levels, indices, first row of each entry)."""
    lv = np.asarray(levels).astype(np.int64)
    pos = np.asarray(positions).astype(np.int64)
    if lv.shape != pos.shape or lv.ndim != 1:
        raise InvalidArgumentError("a working context has one level and one position per row")
    if lv.size and (lv.min() < 0 or lv.max() > 2 or pos.min() < 0):
        raise InvalidArgumentError("working context rows with an unknown level or a negative position")
    span = np.power(np.int64(k), lv)
    block = np.where(lv == 0, pos // k, pos // span)
    new = np.ones(len(lv), bool)
    new[1:] = (lv[1:] != 0) | (lv[:-1] != 0) | (block[1:] != block[:-1])
    first = np.flatnonzero(new)
    entry_of_row = np.cumsum(new) - 1
    # gist rows sit at their span's first token; token rows of a block are consecutive from its first token
    want = np.where(lv == 0, block * k + (np.arange(len(lv)) - first[entry_of_row]), block * span)
    bad = np.flatnonzero(want != pos)
    if bad.size:
        r = int(bad[0])
        raise InvalidArgumentError(f"working context row {r} (level {int(lv[r])}) has position {int(pos[r])}, "
                                   f"expected {int(want[r])}: not the rows of a plan")
    counts = np.diff(np.append(first, len(lv)))
    lod0 = np.flatnonzero(lv[first] == 0)
    short = lod0[(counts[lod0] != k) & (lod0 != len(first) - 1)]
    if short.size:
        raise InvalidArgumentError(f"working context entry {int(short[0])}: an LOD0 block of {int(counts[short[0]])} "
                                   f"rows before the end (a block has {k})")
    return lv[first], block[first], first


def _check_indices(lv, ix, counts, k):
    t, n1, n2 = counts
    nb = -(-t // k)
    for level, n, what in ((0, nb, "LOD0 blocks"), (1, n1, "LOD1 gists"), (2, n2, "LOD2 gists")):
        sel = np.flatnonzero((lv == level) & ((ix < 0) | (ix >= n)))
        if sel.size:
            e = int(sel[0])
            raise InvalidArgumentError(f"plan entry {e} ({level}, {int(ix[e])}): the tree has {n} {what}")


def _extend(lv, ix, sc, t, k):
    """Tokens appended since the plan was made come in at LOD0, scored +inf (never collapsed in this step)."""
    next_block = 0
    if len(lv):   # the block after the last entry's span
        level, i = int(lv[-1]), int(ix[-1])
        next_block = i + 1 if level == 0 else (i + 1) * k ** (level - 1)
    nb = -(-t // k)
    if next_block >= nb:
        return lv, ix, sc
    new = np.arange(next_block, nb, dtype=np.int64)
    return (np.concatenate([lv, np.zeros(len(new), np.int64)]), np.concatenate([ix, new]),
            np.concatenate([sc, np.full(len(new), np.inf)]))


def _start(lv, ix, k):
    """The first token of each entry's span."""
    lv = np.asarray(lv, np.int64)
    return ix * np.where(lv == 0, k, np.power(np.int64(k), lv))


def _rows(lv, ix, t, k):
    r = np.ones(len(lv), np.int64)
    tok = lv == 0
    r[tok] = np.minimum(k, t - ix[tok] * k)
    return r


def _collapsible(lv, ix, sc, n1, n2, k, t):
    """The spans that can collapse one level, lowest score first (oldest first among equals), as
    ``(first entry, score, kind)`` arrays; kind 0 is an LOD0 block, kind 1 a group of ``k`` LOD1 gists."""
    m = len(lv)
    blocks = np.flatnonzero((lv == 0) & (ix < n1) & ((ix + 1) * k <= t))
    is1 = (lv == 1).astype(np.int64)
    c1 = np.concatenate([[0], np.cumsum(is1)])
    heads = np.flatnonzero((lv == 1) & (ix % k == 0) & (ix // k < n2))
    heads = heads[heads + k <= m]
    # contiguous coverage: k entries from an aligned LOD1 head that are all LOD1 are exactly its k siblings
    heads = heads[c1[heads + k] - c1[heads] == k]
    gscore = _group_max(sc, heads, k)
    first = np.concatenate([blocks, heads])
    score = np.concatenate([sc[blocks], gscore])
    kind = np.concatenate([np.zeros(len(blocks), np.int8), np.ones(len(heads), np.int8)])
    start = np.concatenate([ix[blocks] * k, ix[heads] * k])
    order = np.lexsort((start, score))
    return first[order], score[order], kind[order]


def _group_max(sc, heads, k):
    """The largest score of each run of ``k`` entries starting at ``heads``."""
    if not heads.size:
        return np.empty(0)
    return np.lib.stride_tricks.sliding_window_view(sc, k)[heads].max(axis=1)


def _collapse(action, pool, i, k):
    first, _, kind = pool
    e = int(first[i])
    action[e] = _COLLAPSE
    if kind[i] == 1:
        action[e + 1:e + k] = _ABSORBED


def _apply(lv, ix, sc, action, k):
    """(levels uint8, indices int64, scores) of the plan after ``action``; a collapsed span keeps the
    largest score of its members, each child of an expanded gist the gist's score."""
    lvl = lv.astype(np.int64)
    count = np.ones(len(lv), np.int64)
    count[action == _ABSORBED] = 0
    count[(action == _EXPAND) & (lvl == 2)] = k
    new_lv = np.where(action == _EXPAND, lvl - 1, np.where(action == _COLLAPSE, lvl + 1, lvl))
    # an LOD1 gist i becomes block i; LOD2 gist j becomes LOD1 gists k*j ...; a block b becomes LOD1 gist b;
    # the LOD1 group from k*j becomes LOD2 gist j
    base = np.where((action == _EXPAND) & (lvl == 2), ix * k,
                    np.where((action == _COLLAPSE) & (lvl == 1), ix // k, ix))
    score = sc.copy()
    heads = np.flatnonzero((action == _COLLAPSE) & (lvl == 1))
    score[heads] = _group_max(sc, heads, k)
    out_lv = np.repeat(new_lv, count)
    starts = np.repeat(np.cumsum(count) - count, count)
    out_ix = np.repeat(base, count) + (np.arange(int(count.sum())) - starts)
    return out_lv.astype(np.uint8), out_ix.astype(np.int64), np.repeat(score, count)


def _fit(lv, ix, sc, budget, counts, k):
    """Collapse the lowest-scoring spans, level after level, until the plan fits ``budget`` rows."""
    t, n1, n2 = counts
    lv = lv.astype(np.int64)
    while True:
        total = int(_rows(lv, ix, t, k).sum())
        if total <= budget:
            return Plan(lv.astype(np.uint8), ix)
        pool = _collapsible(lv, ix, sc, n1, n2, k, t)
        if not len(pool[0]) or k == 1:
            start = int(_start(lv[:1], ix[:1], k)[0]) if len(lv) else 0
            raise InvalidArgumentError(f"budget {budget} is smaller than the {total} rows of the most collapsed plan "
                                       f"of tokens [{start}, {t})")
        action = np.zeros(len(lv), np.int8)
        for i in range(len(pool[0])):
            if total <= budget:
                break
            _collapse(action, pool, i, k)
            total -= k - 1
        lv, ix, sc = _apply(lv, ix, sc, action, k)
        lv = lv.astype(np.int64)
