"""Working-context assembly against a plain numpy assembly, plan_tail's properties, and the compiled
mean pooling and float conversions against numpy / ml_dtypes, bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.megacontext as mc
from _megacontext_ref import GIST_NP, mean_pool, numpy_assembly, token_stream
from mcf.megacontext import _megacontext as _mc

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

BF16 = np.dtype(ml_dtypes.bfloat16)
VOCAB = 500


@pytest.fixture(scope="module", params=["fp16", "bf16", "fp32"])
def tree(request, tmp_path_factory):
    dtype = request.param
    path = tmp_path_factory.mktemp(f"asm-{dtype}") / "tree"
    rng = np.random.default_rng(11)
    tokens = token_stream(70_000 + 17, seed=2, vocab=VOCAB)
    npdt = GIST_NP[{"fp16": 1, "bf16": 2, "fp32": 3}[dtype]]
    lod1 = (rng.standard_normal((len(tokens) // 32, 24)) * 3).astype(np.float32).astype(npdt)
    lod2 = rng.standard_normal((len(lod1) // 32, 24)).astype(np.float32).astype(npdt)
    with mc.create(path, embedding_dim=24, gist_dtype=dtype, vocab_size=VOCAB) as t:
        t.append_tokens(tokens)
        t.append_gists(1, lod1)
        t.append_gists(2, lod2)
    return path, tokens, lod1, lod2


TABLES = {name: (np.random.default_rng(3).standard_normal((VOCAB, 24)) * 2).astype(np.float32).astype(dt)
          for name, dt in (("f32", np.float32), ("f16", np.float16), ("bf16", BF16))}


def random_plan(rng, counts, m):
    t, n1, n2 = counts
    nb = -(-t // 32)
    lv = rng.integers(0, 3 if n2 else 2, m)
    ix = np.where(lv == 0, rng.integers(0, nb, m),
                  np.where(lv == 1, rng.integers(0, n1, m), rng.integers(0, max(n2, 1), m)))
    if m:
        lv[0], ix[0] = 0, nb - 1          # always include the partial block
    return list(zip(lv.tolist(), ix.tolist()))


def check(wc, ref, table):
    levels, positions, ids, gists, matrix = ref
    assert np.array_equal(wc.levels, levels) and np.array_equal(wc.positions, positions)
    assert np.array_equal(wc.token_ids, ids)
    assert wc.gists.shape == gists.shape and np.array_equal(wc.gists.view(np.uint8), gists.view(np.uint8)) \
        if table is None else True
    if table is not None:
        assert wc.embeddings.dtype == matrix.dtype and wc.embeddings.shape == matrix.shape
        assert np.array_equal(wc.embeddings.view(np.uint8), matrix.view(np.uint8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(0, 300), table=st.sampled_from([None, "f32", "f16", "bf16"]),
       out_dtype=st.sampled_from([None, np.float32, np.float16, BF16]), mmap=st.booleans())
def test_assembly_equals_numpy(tree, seed, m, table, out_dtype, mmap):
    path, tokens, lod1, lod2 = tree
    rng = np.random.default_rng(seed)
    with mc.open(path, mmap=mmap) as t:
        plan = random_plan(rng, t.counts, m)
        tab = None if table is None else TABLES[table]
        wc = t.assemble(plan, tab, dtype=out_dtype if tab is not None else None)
        ref = numpy_assembly(tokens, lod1, lod2, plan, 32, tab, out_dtype)
        check(wc, ref, tab)
        assert len(wc) == mc.Plan.of(plan).rows(t.num_tokens, 32)
        if tab is not None:
            assert np.array_equal(wc.gists.view(np.uint8), ref[4][ref[0] != 0].view(np.uint8))


def test_plan_shapes_out_buffer_and_threads(tree):
    path, tokens, lod1, lod2 = tree
    with mc.open(path) as t:
        plan = random_plan(np.random.default_rng(1), t.counts, 2000)
        ref = numpy_assembly(tokens, lod1, lod2, plan, 32, TABLES["f16"])
        n = len(ref[0])
        out = np.full((n + 5, 24), np.nan, np.float16)
        wc = t.assemble(np.array(plan), TABLES["f16"], out=out, threads=2)
        assert np.shares_memory(wc.embeddings, out)
        check(wc, ref, TABLES["f16"])
        assert np.isnan(out[n:]).all()
        wc2 = t.assemble(mc.Plan.of(plan), TABLES["f16"], threads=3)
        check(wc2, ref, TABLES["f16"])
        assert len(t.assemble([])) == 0


def test_threads_split_a_large_gather(tmp_path):
    """A gather large enough for streaming stores, split across threads or not, into an aligned or a
    misaligned buffer: the same result."""
    rng = np.random.default_rng(2)
    d = 1024
    tokens = token_stream(32 * 3000, vocab=300)
    lod1 = rng.standard_normal((3000, d)).astype(np.float32)
    table = rng.standard_normal((300, d)).astype(np.float32)
    with mc.create(tmp_path / "t", embedding_dim=d, gist_dtype="fp32") as t:
        t.append_tokens(tokens)
        t.append_gists(1, lod1)
        plan = random_plan(rng, t.counts, 600)
        ref = numpy_assembly(tokens, lod1, np.empty((0, d), np.float32), plan, 32, table)
        assert ref[4].nbytes >= _mc.STREAM_BYTES          # large enough for the streaming-store path
        for threads in (1, 2, 4):
            check(t.assemble(plan, table, threads=threads), ref, table)
        n = len(ref[0])
        odd = np.empty(n * d + 1, np.float32)[1:].reshape(n, d)   # a destination not 16-byte aligned
        check(t.assemble(plan, table, out=odd), ref, table)
        wc = t.assemble(plan)                                     # the gist rows alone
        assert np.array_equal(wc.gists, ref[3])


def test_assembly_errors(tree):
    path, tokens, lod1, lod2 = tree
    with mc.open(path) as t:
        nb = -(-t.num_tokens // 32)
        for plan in ([(3, 0)], [(0, nb)], [(1, len(lod1))], [(2, len(lod2))], [(1, -1)], [(0.5, 1)], [[1, 2, 3]],
                     [(-1, 0)]):
            with pytest.raises((mcf.InvalidArgumentError, mcf.OutOfBoundsError)):
                t.assemble(plan)
        small = TABLES["f32"][:100]                       # ids go up to 499
        with pytest.raises(mcf.OutOfBoundsError, match="outside the embedding table"):
            t.assemble([(0, 0), (0, 1)], small)
        for table in (np.zeros((VOCAB, 23), np.float32), np.zeros((VOCAB, 24), np.int32), np.zeros(24, np.float32)):
            with pytest.raises(mcf.InvalidArgumentError):
                t.assemble([(1, 0)], table)
        for out in (np.zeros((1, 24), np.float32), np.zeros((40, 24), np.int8), np.zeros((40, 24), np.float32)[:, ::2],
                    np.zeros((40, 25), np.float32)):
            with pytest.raises(mcf.InvalidArgumentError):
                t.assemble([(0, 0), (1, 0)], TABLES["f32"], out=out)
        with pytest.raises(mcf.InvalidArgumentError, match="needs an embedding table"):
            t.assemble([(1, 0)], out=np.zeros((1, 24), np.float32))
        with pytest.raises(mcf.InvalidArgumentError):
            t.assemble([(1, 0)], threads=0)
        # a strided (non-contiguous rows) table is accepted and read correctly
        wide = np.zeros((VOCAB, 48), np.float32)
        wide[:, ::2] = TABLES["f32"]
        wc = t.assemble([(0, 3)], wide[:, ::2])
        assert np.array_equal(wc.embeddings, TABLES["f32"][tokens[96:128]])


# -- plan_tail ---------------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(t=st.integers(0, 300_000), lag1=st.integers(0, 50), lag2=st.integers(0, 5), budget=st.integers(0, 5000),
       recent=st.integers(0, 3000), k=st.sampled_from([32, 4, 2]))
def test_plan_tail_properties(t, lag1, lag2, budget, recent, k):
    n1 = max(0, t // k - lag1)
    n2 = max(0, n1 // k - lag2)
    try:
        plan = mc.plan_tail((t, n1, n2), budget, recent, block_size=k)
    except mcf.InvalidArgumentError:
        assert t % k and budget < t % k            # only when not even the partial block fits
        return
    rows = plan.rows(t, k)
    assert rows <= budget
    start, stop = mc.plan_coverage(plan, t, block_size=k)
    assert stop == t
    lv = plan.levels
    assert (np.diff(lv.astype(int)) <= 0).all()   # LOD2 ... LOD1 ... LOD0 in timeline order
    assert (plan.indices[lv == 1] < n1).all() and (plan.indices[lv == 2] < n2).all()
    lod0_start = int(plan.indices[lv == 0].min()) * k if (lv == 0).any() else t
    assert lod0_start <= max(0, n1 * k) or lod0_start == start   # blocks without a gist stay at LOD0
    want0 = min(n1, max(0, t - recent) // k) * k          # the recent tokens, widened to whole blocks
    if t - want0 <= budget:
        assert lod0_start == want0
    else:                                                # they do not fit: as many recent blocks as do
        assert t - lod0_start <= budget < t - (lod0_start - k)
    if start == 0 and (lv == 2).any() and k > 1:
        assert budget - rows < k - 1                     # LOD2 gists expanded to LOD1 while possible
    if t and start > 0:
        assert budget - rows < k                  # a suffix was dropped only for lack of room


def test_plan_tail_example():
    # 10,000 tokens: 312 full blocks + 16 tokens; 312 LOD1, 9 LOD2 gists
    plan = mc.plan_tail((10_000, 312, 9), budget=300, recent_tokens=100)
    lv = plan.levels
    # recent 100 tokens -> from block (10000 - 100) // 32 = 309: 3 full blocks + the partial one
    assert list(plan)[-5:] == [(1, 308), (0, 309), (0, 310), (0, 311), (0, 312)]
    assert int((lv == 0).sum()) == 4 and plan.rows(10_000, 32) == 112 + int((lv != 0).sum())
    assert mc.plan_coverage(plan, 10_000) == (0, 10_000)
    assert plan.rows(10_000, 32) <= 300 and 300 - plan.rows(10_000, 32) < 31
    with pytest.raises(mcf.InvalidArgumentError):
        mc.plan_tail((10_000, 312, 9), budget=10, recent_tokens=0)   # the partial block has 16 tokens
    with pytest.raises(mcf.InvalidArgumentError):
        mc.plan_tail((10_000, 400, 9), budget=10, recent_tokens=0)   # inconsistent counts
    with pytest.raises(mcf.InvalidArgumentError):
        mc.plan_coverage([(1, 0), (1, 2)], 10_000)                   # a gap


# -- compiled kernels against numpy / ml_dtypes --------------------------------------------------------------
FLOATS = [np.dtype(np.float16), BF16, np.dtype(np.float32)]


@pytest.mark.parametrize("src", FLOATS, ids=str)
@pytest.mark.parametrize("dst", FLOATS, ids=str)
def test_pooling_and_conversion_bit_exact(src, dst):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((32 * 40, 33)) * np.exp(rng.uniform(-8, 8, (32 * 40, 1)))).astype(np.float32)
    x[0, :4] = [np.inf, -np.inf, 0.0, -0.0]
    xs = x.astype(src)
    got = _mc.pool_rows(xs, 32, dst)
    want = mean_pool(xs, 32, dst)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    table = xs[:500]
    ids = rng.integers(0, 500, 32 * 20).astype(np.uint32)
    got = _mc.pool_tokens(ids, 32, table, dst)
    want = mean_pool(table[ids], 32, dst)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    conv = _mc.convert(xs, np.empty(xs.shape, dst))
    want = xs.astype(np.float32).astype(dst)       # widen exactly, round once
    assert np.array_equal(conv.view(np.uint8), want.view(np.uint8))


def test_pooling_errors(tmp_path):
    t = np.zeros((10, 4), np.float32)
    with pytest.raises(mcf.OutOfBoundsError):
        _mc.pool_tokens(np.array([1, 10], np.uint32), 2, t, np.float32)
    for bad in (lambda: _mc.pool_tokens([1, 2, 3], 2, t, np.float32),
                lambda: _mc.pool_tokens([-1, 2], 2, t, np.float32),
                lambda: _mc.pool_rows(np.zeros((3, 4), np.float32), 2, np.float32),
                lambda: _mc.pool_rows(np.zeros((4, 4), np.int32), 2, np.float32),
                lambda: _mc.pool_tokens([1, 2], 2, np.zeros((10, 4), np.int64), np.float32),
                lambda: _mc.pool_tokens([1, 2], 0, t, np.float32),
                lambda: mc.MeanPool(np.zeros(4, np.float32))):
        with pytest.raises(mcf.InvalidArgumentError):
            bad()
    with mc.create(tmp_path / "t", embedding_dim=5) as tree:
        with pytest.raises(mcf.InvalidArgumentError, match="wide"):
            mc.build_gists(tree, mc.MeanPool(t))
