"""The focus allocator (mcf.megacontext.focus_plan): against a plain-Python reference written from the rules
in docs/megacontext.md ("Focus plan"), its properties (coverage, budget, stability, determinism), the
expansion/collapse cases one by one, and an end-to-end refocusing loop through assemble on a real tree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mcf
import mcf.megacontext as mc
from _megacontext_ref import numpy_assembly, token_stream

TAU = dict(tau_expand=0.2, tau_collapse=0.2)


# -- a reference written from the documented rules, one span object at a time ---------------------------------
def reference_focus(counts, k, plan, scores, budget, tau_expand, tau_collapse):
    """The rules of docs/megacontext.md, "Focus plan", as plainly as possible: a list of [level, index, score]
    spans, one action at a time.  Returns a list of (level, index) or raises InvalidArgumentError."""
    t, n1, n2 = counts
    nb = -(-t // k)
    spans = [[lv, ix, float(s)] for (lv, ix), s in zip(plan, scores)]
    end = 0
    if spans:
        lv, ix, _ = spans[-1]
        end = (ix + 1) * k if lv == 0 else (ix + 1) * k ** lv
    for b in range(-(-end // k), nb):
        spans.append([0, b, float("inf")])

    def start(sp):
        return sp[1] * k if sp[0] == 0 else sp[1] * k ** sp[0]

    def rows(sps):
        return sum(min(k, t - s[1] * k) if s[0] == 0 else 1 for s in sps)

    def candidates(sps):
        """(score, start token, list of span positions) of every span that can collapse one level."""
        out = []
        for p, s in enumerate(sps):
            if s[0] == 0 and s[1] < n1 and (s[1] + 1) * k <= t:
                out.append((s[2], start(s), [p]))
            if s[0] == 1 and s[1] % k == 0 and s[1] // k < n2:
                group = sps[p:p + k]
                if len(group) == k and all(g[0] == 1 and g[1] == s[1] + j for j, g in enumerate(group)):
                    out.append((max(g[2] for g in group), start(s), list(range(p, p + k))))
        return sorted(out, key=lambda c: (c[0], c[1]))

    def collapse(sps, victims):
        """Replace each victim (positions) by its parent, keeping the largest score."""
        first = {v[0]: v for v in victims}
        gone = {p for v in victims for p in v}
        out = []
        for p, s in enumerate(sps):
            if p in first:
                members = [sps[q] for q in first[p]]
                out.append([s[0] + 1, s[1] // k if s[0] == 1 else s[1], max(m[2] for m in members)])
            elif p not in gone:
                out.append(s)
        return out

    cands = candidates(spans)
    total = rows(spans)
    chosen = []
    while cands and (cands[0][0] < -tau_collapse or total > budget):
        chosen.append(cands.pop(0)[2])
        total -= k - 1
    if total > budget:                                   # level after level until it fits
        spans = collapse(spans, chosen)
        while rows(spans) > budget:
            cands = candidates(spans)
            if not cands or k == 1:
                raise mcf.InvalidArgumentError("does not fit")
            victims, total = [], rows(spans)
            for c in cands:
                if total <= budget:
                    break
                victims.append(c[2])
                total -= k - 1
            spans = collapse(spans, victims)
        return [(s[0], s[1]) for s in spans]

    gone = {p for v in chosen for p in v}
    order = sorted((p for p, s in enumerate(spans) if s[0] > 0 and s[2] > tau_expand),
                   key=lambda p: (-spans[p][2], -start(spans[p])))
    expanded = []
    for p in order:
        if p in gone:
            continue
        if total + k - 1 > budget:
            if cands and cands[0][0] < spans[p][2]:
                victim = cands.pop(0)[2]
                chosen.append(victim)
                gone |= set(victim)
                total -= k - 1
            else:
                break
        expanded.append(p)
        total += k - 1
    spans = [s for s in spans]
    out = []
    heads = {v[0]: v for v in chosen}
    for p, s in enumerate(spans):
        if p in heads:
            out.append((s[0] + 1, s[1] // k if s[0] == 1 else s[1]))
        elif p in gone:
            continue
        elif p in expanded:
            out += [(0, s[1])] if s[0] == 1 else [(1, s[1] * k + j) for j in range(k)]
        else:
            out.append((s[0], s[1]))
    return out


def random_plan(rng, counts, k, p1=0.5, p2=0.5):
    """A random valid plan covering the whole timeline (LOD2 where a group may go, else LOD1 or LOD0)."""
    t, n1, n2 = counts
    nb = -(-t // k)
    out, b = [], 0
    while b < nb:
        if b % k == 0 and b // k < n2 and rng.random() < p2:
            out.append((2, b // k))
            b += k
        elif b < n1 and rng.random() < p1:
            out.append((1, b))
            b += 1
        else:
            out.append((0, b))
            b += 1
    return out


def rows_of(plan, t, k):
    return mc.Plan.of(plan).rows(t, k) if len(plan) else 0


def most_collapsed_rows(counts, k, start=0):
    """Rows of the most collapsed plan of tokens [start, t), from the counts alone."""
    t, n1, n2 = counts
    nb = -(-t // k)
    rows, b = 0, start // k
    while b < nb:
        if b % k == 0 and b // k < n2 and k > 1:
            rows, b = rows + 1, b + k
        elif b < n1:
            rows, b = rows + 1, b + 1
        else:
            rows, b = rows + min(k, t - b * k), b + 1
    return rows


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.sampled_from([2, 3, 4, 32]), blocks=st.integers(0, 300),
       tail=st.integers(0, 31), lag1=st.integers(0, 6), lag2=st.integers(0, 2), slack=st.integers(-120, 120),
       ties=st.booleans(), grow=st.integers(0, 3), tau=st.sampled_from([(0.2, 0.2), (0.0, 0.0), (0.5, -0.1),
                                                                        (0.9, 0.9)]))
def test_focus_plan_matches_reference_and_keeps_its_promises(seed, k, blocks, tail, lag1, lag2, slack, ties, grow,
                                                             tau):
    rng = np.random.default_rng(seed)
    t = blocks * k + tail % k
    n1 = max(0, t // k - lag1)
    n2 = max(0, n1 // k - lag2)
    # the plan was made before the last `grow` blocks arrived (the tree has grown since)
    t_old = max(0, t - grow * k)
    n1_old, n2_old = min(n1, t_old // k), min(n2, min(n1, t_old // k) // k)
    plan = random_plan(rng, (t_old, n1_old, n2_old), k)
    scores = (rng.integers(-2, 3, len(plan)) / 2.0 if ties else rng.uniform(-1, 1, len(plan)))
    budget = max(0, rows_of(plan, t, k) + slack)
    te, tc = tau
    want_error = most_collapsed_rows((t, n1, n2), k) > budget
    try:
        ref = reference_focus((t, n1, n2), k, plan, scores, budget, te, tc)
    except mcf.InvalidArgumentError:
        ref = None
    try:
        got = mc.focus_plan((t, n1, n2), plan, scores, budget=budget, tau_expand=te, tau_collapse=tc, block_size=k)
    except mcf.InvalidArgumentError as exc:
        assert ref is None and want_error, exc
        assert "most collapsed plan" in str(exc)
        return
    assert not want_error and ref is not None
    assert list(got) == ref                                            # the documented rules, exactly
    # the whole timeline, once, in order; within the budget; indices the tree has
    assert mc.plan_coverage(got, t, block_size=k) == ((0, t) if t else (t, t))
    assert got.rows(t, k) <= budget
    lv, ix = got.levels, got.indices
    assert (ix[lv == 1] < n1).all() and (ix[lv == 2] < n2).all() and (ix[lv == 0] < -(-t // k)).all()
    # deterministic
    again = mc.focus_plan((t, n1, n2), plan, scores, budget=budget, tau_expand=te, tau_collapse=tc, block_size=k)
    assert list(again) == list(got)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.sampled_from([2, 4, 32]), blocks=st.integers(0, 200),
       tail=st.integers(0, 31), lag1=st.integers(0, 4), slack=st.integers(0, 100))
def test_focus_plan_is_stable_when_no_score_crosses_a_threshold(seed, k, blocks, tail, lag1, slack):
    rng = np.random.default_rng(seed)
    t = blocks * k + tail % k
    n1 = max(0, t // k - lag1)
    n2 = n1 // k
    plan = random_plan(rng, (t, n1, n2), k)
    scores = rng.uniform(-0.3, 0.2, len(plan))          # between -tau_collapse = -0.3 and tau_expand = 0.2
    lv = np.array([e[0] for e in plan], np.int64)
    # scores past a threshold where the rule does not apply change nothing either: LOD0 blocks cannot expand,
    # LOD2 gists cannot collapse
    scores[lv == 0] += 3.0 * rng.integers(0, 2, int((lv == 0).sum()))
    scores[lv == 2] -= 3.0 * rng.integers(0, 2, int((lv == 2).sum()))
    budget = rows_of(plan, t, k) + slack
    got = mc.focus_plan((t, n1, n2), plan, scores, budget=budget, tau_expand=0.2, tau_collapse=0.3, block_size=k)
    assert list(got) == plan
    # the same with per-row scores
    rows = mc.Plan.of(plan).rows(t, k) if plan else 0
    per_row = np.repeat(scores, [min(k, t - i * k) if lev == 0 else 1 for lev, i in plan]) if plan else []
    assert len(per_row) == rows
    got = mc.focus_plan((t, n1, n2), plan, per_row, budget=budget, tau_expand=0.2, tau_collapse=0.3, block_size=k)
    assert list(got) == plan


# -- the cases one by one (block_size 4 keeps them readable: an LOD2 gist is 16 tokens) ------------------------
K = 4
COUNTS = (64 + 3, 16, 4)        # 67 tokens: 16 full blocks + 3 tokens; every full block and group has its gist


def focus(plan, scores, budget=1000, counts=COUNTS, **kw):
    return list(mc.focus_plan(counts, plan, scores, budget=budget, **{"block_size": K, **TAU, **kw}))


def test_expansions_one_level_at_a_time():
    plan = [(2, 0), (2, 1), (1, 8), (1, 9), (1, 10), (1, 11), (2, 3), (0, 16)]
    got = focus(plan, [0.0, 0.5, 0, 0.3, 0, 0, 0.21, 0])
    assert got == [(2, 0), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (0, 9), (1, 10), (1, 11),
                   (1, 12), (1, 13), (1, 14), (1, 15), (0, 16)]
    assert focus(plan, [0.2] * 8) == plan            # exactly the threshold: no change
    assert focus(plan, [0.0] * 7 + [9.0]) == plan    # LOD0 cannot expand


def test_collapses_need_a_full_aligned_group_and_an_existing_parent():
    plan = [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (0, 7), (2, 2), (0, 12), (0, 13), (0, 14),
            (0, 15), (0, 16)]
    low = [-1.0] * len(plan)
    got = focus(plan, low)
    # gists 0..3 -> LOD2 gist 0; 4..6 stay (block 7 is at LOD0: the group is not all LOD1); block 7 -> gist 7;
    # blocks 12..15 -> gists; the partial block 16 has no gist
    assert got == [(2, 0), (1, 4), (1, 5), (1, 6), (1, 7), (2, 2), (1, 12), (1, 13), (1, 14), (1, 15), (0, 16)]
    # one member of the group above -tau_collapse keeps the whole group (a span scores as its largest row)
    some = list(low)
    some[2] = -0.1
    assert focus(plan, some)[:5] == [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    # blocks without a gist yet (the gists lag behind) stay at LOD0
    assert focus(plan, low, counts=(67, 13, 3))[-5:] == [(1, 12), (0, 13), (0, 14), (0, 15), (0, 16)]
    # an LOD1 group whose LOD2 gist does not exist yet stays
    lod1 = [(1, i) for i in range(16)] + [(0, 16)]
    assert focus(lod1, [-1.0] * 17, counts=(67, 16, 3)) == [(2, 0), (2, 1), (2, 2)] + lod1[12:]


def test_per_row_scores_and_working_context_input(tmp_path):
    plan = [(2, 0), (0, 4), (0, 5), (1, 6), (1, 7), (2, 2), (2, 3), (0, 16)]
    rows = mc.Plan.of(plan).rows(67, K)
    assert rows == 1 + 4 + 4 + 1 + 1 + 1 + 1 + 3
    per_row = np.full(rows, -1.0)
    per_row[1 + 4 + 2] = 0.0           # one token of block 5 is not low: block 5 stays, block 4 collapses
    got = focus(plan, per_row)
    assert got[:3] == [(2, 0), (1, 4), (0, 5)]
    # the same through a real working context (the allocator reads the plan back from its rows)
    with mc.create(tmp_path / "t", embedding_dim=8, block_size=K) as tree:
        tree.append_tokens(token_stream(67, vocab=100))
        tree.append_gists(1, np.ones((16, 8), np.float32))
        tree.append_gists(2, np.ones((4, 8), np.float32))
        wc = tree.assemble(plan)
        assert list(mc.focus_plan(tree, wc, per_row, budget=1000, **TAU)) == got
        with pytest.raises(mcf.InvalidArgumentError, match="scores for a plan of 8 entries and 16 rows"):
            mc.focus_plan(tree, wc, per_row[:-1], budget=1000, **TAU)


def test_budget_expansions_pay_with_the_lowest_scoring_spans():
    plan = [(2, 0), (2, 1), (2, 2), (0, 12), (0, 13), (0, 14), (0, 15), (0, 16)]
    rows = mc.Plan.of(plan).rows(67, K)                       # 3 + 16 + 3 = 22
    scores = [0.9, 0.5, 0.0, 0.1, 0.15, 0.05, 0.3, 0.0]
    # room for one expansion (+3): the highest score, gist (2, 0), takes it; gist (2, 1) at 0.5 is paid for
    # by the lowest-scoring collapsible span, block 14 (0.05); (2, 2) at 0.0 does not cross tau_expand
    got = focus(plan, scores, budget=rows + 3)
    assert got == [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (2, 2), (0, 12), (0, 13),
                   (1, 14), (0, 15), (0, 16)]
    assert mc.Plan.of(got).rows(67, K) == rows + 3
    # no room at all: (2, 0) is paid for by block 14 (0.05), (2, 1) by block 12 (0.1)
    got = focus(plan, scores, budget=rows)
    assert got == [(1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (2, 2), (1, 12), (0, 13),
                   (1, 14), (0, 15), (0, 16)]
    assert mc.Plan.of(got).rows(67, K) == rows
    # a span scoring as high as the expansion is never traded for it
    assert focus(plan, [0.3, 0.0, 0.0, 0.3, 0.3, 0.3, 0.3, 0.0], budget=rows) == plan


def test_ties_are_broken_by_position():
    plan = [(2, 0), (2, 1), (2, 2), (2, 3), (0, 16)]
    rows = mc.Plan.of(plan).rows(67, K)
    # equal scores, room for two expansions: the two most recent gists
    got = focus(plan, [0.5, 0.5, 0.5, 0.5, 0.0], budget=rows + 6)
    assert [e for e in got if e[0] == 2] == [(2, 0), (2, 1)]
    # equal low scores, over budget by one step: the oldest span collapses first
    plan = [(1, i) for i in range(16)] + [(0, 16)]
    got = focus(plan, [0.0] * 17, budget=mc.Plan.of(plan).rows(67, K) - 3)
    assert got[:2] == [(2, 0), (1, 4)]


def test_over_budget_collapses_level_after_level_and_says_when_it_cannot():
    plan = [(0, b) for b in range(17)]
    scores = np.linspace(-0.1, 0.1, 17)
    # 67 rows into 20: every block to LOD1 (17 rows... 16 gists + 3 tokens = 19), more needs LOD2
    got = focus(plan, scores, budget=19)
    assert got == [(1, b) for b in range(16)] + [(0, 16)]
    got = focus(plan, scores, budget=16)                      # the oldest LOD1 group goes to LOD2 too
    assert got == [(2, 0)] + [(1, b) for b in range(4, 16)] + [(0, 16)]
    assert focus(plan, scores, budget=7) == [(2, 0), (2, 1), (2, 2), (2, 3), (0, 16)]
    with pytest.raises(mcf.InvalidArgumentError, match="smaller than the 7 rows of the most collapsed plan"):
        focus(plan, scores, budget=6)


def test_new_tokens_come_in_at_lod0_and_an_empty_plan_starts_the_timeline():
    plan = [(2, 0), (1, 4), (0, 5)]                          # made when the tree had 24 tokens
    got = focus(plan, [0.0, 0.0, 0.0])
    assert got == plan + [(0, b) for b in range(6, 17)]
    # over budget: the new blocks are the last to collapse (+inf), the old block first
    got = focus(plan, [0.0, 0.0, 0.0], budget=mc.Plan.of(got).rows(67, K) - 3)
    assert got[:3] == [(2, 0), (1, 4), (1, 5)] and got[3:] == [(0, b) for b in range(6, 17)]
    # an empty plan: the whole timeline at LOD0, collapsed oldest first to fit
    assert focus([], [], budget=1000) == [(0, b) for b in range(17)]
    got = focus([], [], budget=40)
    assert mc.plan_coverage(got, 67, block_size=K) == (0, 67) and mc.Plan.of(got).rows(67, K) <= 40
    assert got[0] == (1, 0) and got[-1] == (0, 16)


def test_a_plan_covering_a_suffix_keeps_its_start():
    plan = [(1, 8), (1, 9), (1, 10), (1, 11), (0, 12), (0, 13), (0, 14), (0, 15), (0, 16)]
    got = focus(plan, [-1.0] * 9)
    assert got == [(2, 2), (1, 12), (1, 13), (1, 14), (1, 15), (0, 16)]
    assert mc.plan_coverage(got, 67, block_size=K) == (32, 67)


def test_invalid_inputs_are_refused():
    plan = [(2, 0), (2, 1), (2, 2), (2, 3), (0, 16)]
    ok = [0.0] * 5
    for bad, what in (([0.0] * 4, "4 scores for a plan of 5 entries and 7 rows"),
                      ([0.0, np.nan, 0, 0, 0], "score 1 is NaN"),
                      (np.zeros((5, 1)), "one-dimensional"),
                      (["a"] * 5, "one-dimensional sequence of numbers")):
        with pytest.raises(mcf.InvalidArgumentError, match=what):
            focus(plan, bad)
    with pytest.raises(mcf.InvalidArgumentError, match="tau_expand"):
        focus(plan, ok, tau_expand=-0.5, tau_collapse=0.2)
    for tau in (float("nan"), True, "0.2", float("inf")):
        with pytest.raises(mcf.InvalidArgumentError, match="finite number"):
            focus(plan, ok, tau_expand=tau)
    with pytest.raises(mcf.InvalidArgumentError, match="budget"):
        focus(plan, ok, budget=-1)
    with pytest.raises(mcf.InvalidArgumentError, match="budget"):
        focus(plan, ok, budget=10.0)
    with pytest.raises(mcf.InvalidArgumentError, match="starts at token"):                  # a gap
        focus([(2, 0), (2, 2), (2, 3), (0, 16)], [0.0] * 4)
    with pytest.raises(mcf.InvalidArgumentError, match="the tree has 4 LOD2 gists"):
        focus([(2, 4)], [0.0])
    with pytest.raises(mcf.InvalidArgumentError, match="the tree has 16 LOD1 gists"):
        focus([(1, 16)], [0.0])
    with pytest.raises(mcf.InvalidArgumentError, match="inconsistent counts"):
        focus(plan, ok, counts=(67, 17, 4))
    with pytest.raises(mcf.InvalidArgumentError, match="focus_plan needs a tree"):
        mc.focus_plan("tree", plan, ok, budget=10, **TAU)
    # block_size 0 made plan_tail divide by zero and plan_coverage answer (0, 0)
    for call in (lambda: focus(plan, ok, block_size=0), lambda: mc.plan_tail((67, 16, 4), 10, 4, block_size=0),
                 lambda: mc.plan_coverage(plan, 67, block_size=0)):
        with pytest.raises(mcf.InvalidArgumentError, match="block_size must be >= 1"):
            call()


def test_working_context_rows_that_are_not_a_plan_are_refused(tmp_path):
    with mc.create(tmp_path / "t", embedding_dim=8, block_size=K) as tree:
        tree.append_tokens(token_stream(67, vocab=100))
        tree.append_gists(1, np.ones((16, 8), np.float32))
        wc = tree.assemble([(1, 0), (0, 1), (0, 2)])
        bad = mc.WorkingContext(wc.levels, wc.positions[::-1].copy(), wc.token_ids, None, None, K)
        with pytest.raises(mcf.InvalidArgumentError, match="not the rows of a plan"):
            mc.focus_plan(tree, bad, np.zeros(len(wc)), budget=100, **TAU)
        short = mc.WorkingContext(wc.levels[:3], wc.positions[:3], wc.token_ids[:2], None, None, K)
        with pytest.raises(mcf.InvalidArgumentError, match="an LOD0 block of 2 rows before the end"):
            mc.focus_plan(tree, mc.WorkingContext(np.r_[short.levels, wc.levels[5:]],
                                                  np.r_[short.positions, wc.positions[5:]], None, None, None, K),
                          np.zeros(3 + len(wc) - 5), budget=100, **TAU)
        other = mc.WorkingContext(wc.levels, wc.positions, wc.token_ids, None, None, 32)
        with pytest.raises(mcf.InvalidArgumentError, match="block_size 32, the tree 4"):
            mc.focus_plan(tree, other, np.zeros(len(wc)), budget=100, **TAU)


# -- end to end: a refocusing loop on a real tree, assembled by the compiled call -----------------------------
def test_refocusing_loop_through_assemble(tmp_path):
    """A runtime loop: tokens stream in, a toy scorer (the similarity of each row to a query vector) scores
    the working context, focus_plan refocuses it, and the compiled assembly reads each plan; every working
    context equals a plain numpy assembly of the same plan."""
    d, vocab, budget = 32, 300, 256
    rng = np.random.default_rng(5)
    table = rng.standard_normal((vocab, d)).astype(np.float32)
    query = table[7] + table[8]
    stream = token_stream(9000, seed=3, vocab=vocab)
    with mc.create(tmp_path / "tree", embedding_dim=d, vocab_size=vocab) as tree:
        pool = mc.MeanPool(table)
        tree.append_tokens(stream[:4000])
        mc.build_gists(tree, pool)
        plan = mc.plan_tail(tree, budget=budget, recent_tokens=96)
        seen_levels = set()
        for _ in range(12):
            wc = tree.assemble(plan, table)
            t = tree.counts[0]
            ref = numpy_assembly(stream[:t], tree.gists(1), tree.gists(2), list(plan), 32, table)
            assert np.array_equal(wc.levels, ref[0]) and np.array_equal(wc.positions, ref[1])
            assert np.array_equal(wc.embeddings, ref[4])
            assert len(wc) <= budget and mc.plan_coverage(plan, t) == (0, t)
            seen_levels |= set(wc.levels.tolist())
            e = wc.embeddings / (np.linalg.norm(wc.embeddings, axis=1, keepdims=True) + 1e-6)
            scores = np.tanh(4 * e @ (query / np.linalg.norm(query)))   # signed utilities in (-1, 1), per row
            tree.append_tokens(stream[t:t + 300])                        # the next tokens arrive
            mc.build_gists(tree, pool)
            new = mc.focus_plan(tree, wc, scores, budget=budget, **TAU)
            assert mc.plan_coverage(new, tree.counts[0]) == (0, tree.counts[0])
            assert new.rows(tree.counts[0], 32) <= budget
            plan = new
        assert seen_levels == {0, 1, 2}
