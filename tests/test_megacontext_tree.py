"""The tree store: create/append/read against struct + numpy references, seed 000's metadata and size
table, chunking invariance, in-place rewrites, locking, refresh, snapshots and restore."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.megacontext as mc
from _megacontext_ref import GIST_NP, canonical_header, mean_pool, token_stream

D = 16


def rand_gists(rng, n, d=D, dtype=np.float16):
    return rng.standard_normal((n, d)).astype(np.float32).astype(dtype)


def build(path, tokens, *, d=D, dtype="fp16", gists=True, seed=0, **kw):
    """A tree with `tokens` and random gists for every complete span; returns (lod1, lod2) arrays."""
    rng = np.random.default_rng(seed)
    npdt = GIST_NP[mc.CTX_DTYPES[{"fp16": 1, "bf16": 2, "fp32": 3}[dtype]].code]
    with mc.create(path, embedding_dim=d, gist_dtype=dtype, **kw) as t:
        t.append_tokens(tokens)
        n1 = len(tokens) // t.block_size if gists else 0
        lod1 = rand_gists(rng, n1, d, npdt)
        t.append_gists(1, lod1, checkpoint="ckpt-a")
        n2 = n1 // t.block_size
        lod2 = rand_gists(rng, n2, d, npdt)
        t.append_gists(2, lod2)
    return lod1, lod2


def test_files_are_byte_for_byte_the_seed_layout(tmp_path):
    tokens = token_stream(1000)
    lod1, lod2 = build(tmp_path / "t", tokens, model_name="SmolLM3-3B")
    assert len(lod1) == 31 and len(lod2) == 0
    raw0 = (tmp_path / "t" / "LOD0.ctx").read_bytes()
    assert raw0 == canonical_header(0, 32, D, 0, 1000, b"SmolLM3-3B") + tokens.astype("<u4").tobytes()
    raw1 = (tmp_path / "t" / "LOD1.ctx").read_bytes()
    assert raw1 == canonical_header(1, 32, D, 1, 31, b"SmolLM3-3B") + lod1.tobytes()
    assert (tmp_path / "t" / "LOD2.ctx").read_bytes() == canonical_header(2, 32, D, 1, 0, b"SmolLM3-3B")
    # O(1) offsets: token 5 of block 10 and gist 7 where the seed's formulas put them
    assert struct.unpack_from("<I", raw0, mc.token_offset(10, 5))[0] == tokens[325]
    off = mc.gist_offset(7, D, 2)
    assert raw1[off:off + 2 * D] == lod1[7].tobytes()


def test_reads(tmp_path):
    tokens = token_stream(5000, seed=3)
    lod1, lod2 = build(tmp_path / "t", tokens)
    with mc.open(tmp_path / "t") as t:
        assert t.counts == (5000, 156, 4) and t.num_blocks == 156 and t.num_tokens == 5000
        assert np.array_equal(t.tokens(), tokens)
        assert np.array_equal(t.tokens(100, 200), tokens[100:200])
        assert np.array_equal(t.block(10), tokens[320:352])
        assert np.array_equal(t.block(156), tokens[4992:5000])          # the partial block
        assert np.array_equal(t.gist(1, 42), lod1[42])
        assert np.array_equal(t.gists(2), lod2)
        assert np.array_equal(t.gists(1, slice(10, 20)), lod1[10:20])
        assert np.array_equal(t.gists(1, slice(3, 50, 7)), lod1[3:50:7])
        idx = [5, 0, 155, 5, -1]
        assert np.array_equal(t.gists(1, idx), lod1[idx])
        assert t.span(1, 3) == (96, 128) and t.span(2, 1) == (1024, 2048)
        assert list(t.children(2, 3)) == list(range(96, 128)) and t.parent(1, 100) == 3
        assert t.token_offset(10, 5) == 1364 and t.gist_offset(42) == 64 + 42 * D * 2
        for bad in (lambda: t.block(157), lambda: t.gist(1, 156), lambda: t.gist(2, -1),
                    lambda: t.tokens(0, 5001), lambda: t.gists(1, [156]), lambda: t.gists(1, [-157])):
            with pytest.raises(mcf.OutOfBoundsError):
                bad()
        with pytest.raises(mcf.InvalidArgumentError):
            t.num_gists(0)
        with pytest.raises(mcf.InvalidArgumentError, match="read-only"):
            t.append_tokens([1])
        view = t.tokens()
    with pytest.raises(mcf.ClosedError):
        t.tokens()
    assert view[7] == tokens[7]                      # views outlive the tree


def test_metadata_has_the_fields_of_seed_000(tmp_path):
    build(tmp_path / "t", token_stream(2048 + 40), model_name="HuggingFaceTB/SmolLM2-1.7B-Instruct",
          gistnet_checkpoint="checkpoints/gistnet_epoch10.pt")
    meta = json.loads((tmp_path / "t" / "metadata.json").read_text())
    for key in ("version", "created_at", "model_name", "embedding_dim", "block_size", "levels",
                "gistnet_checkpoint", "ingestion_complete", "last_modified"):
        assert key in meta
    assert meta["version"] == 1 and meta["block_size"] == 32 and meta["embedding_dim"] == D
    assert meta["model_name"] == "HuggingFaceTB/SmolLM2-1.7B-Instruct"   # full name; the header keeps 31 bytes
    assert meta["levels"]["LOD0"] == {"num_blocks": 65, "num_tokens": 2088, "file_size_bytes": 64 + 2088 * 4}
    assert meta["levels"]["LOD1"]["num_gists"] == 65
    assert meta["levels"]["LOD1"]["file_size_bytes"] == 64 + 65 * D * 2
    assert meta["levels"]["LOD2"]["num_gists"] == 2
    assert meta["levels"]["LOD1"]["gists"] == [{"start": 0, "stop": 65, "gistnet_checkpoint": "ckpt-a",
                                                "pending": False}]
    assert meta["gistnet_checkpoint"] == "ckpt-a" and meta["ingestion_complete"] is False
    assert meta["created_at"].endswith("Z") and meta["last_modified"] >= meta["created_at"]
    with mc.open(tmp_path / "t") as t:
        assert t.header(0).model_name == "HuggingFaceTB/SmolLM2-1.7B-Instruct"[:31]
        assert t.model_name == "HuggingFaceTB/SmolLM2-1.7B-Instruct"
        assert t.checkpoint_ranges(1) == [(0, 65, "ckpt-a", False)]
    with mc.open(tmp_path / "t", "r+") as t:
        t.set_ingestion_complete()
    assert json.loads((tmp_path / "t" / "metadata.json").read_text())["ingestion_complete"] is True


def test_size_table_of_seed_000_reproduced_by_building_the_tree(tmp_path):
    """1M tokens at d=2048 fp16: LOD0 4,000,064 B, LOD1 (31,250 gists) 128,000,064 B, LOD2 (976 gists)
    3,997,760 B, streamed in chunks so at most a few MB are in memory."""
    rng = np.random.default_rng(1)
    d = 2048
    chunk_rows = rand_gists(rng, 1250, d)          # reused: the values do not matter for the sizes
    path = tmp_path / "big"
    with mc.create(path, embedding_dim=d, model_name="SmolLM2-1.7B") as t:
        for s in range(0, 1_000_000, 40_000):
            t.append_tokens(token_stream(40_000, seed=s), commit=False)
            t.append_gists(1, chunk_rows, commit=False)
            while t.num_gists(2) < t.num_gists(1) // 32:
                t.append_gists(2, chunk_rows[:min(25, t.num_gists(1) // 32 - t.num_gists(2))], commit=False)
            t.commit()
    try:
        sizes = {n: os.path.getsize(path / n) for n in ("LOD0.ctx", "LOD1.ctx", "LOD2.ctx")}
        assert sizes == {"LOD0.ctx": 4_000_064, "LOD1.ctx": 128_000_064, "LOD2.ctx": 3_997_760}
        meta = json.loads((path / "metadata.json").read_text())
        assert meta["levels"]["LOD0"] == {"num_blocks": 31250, "num_tokens": 1_000_000, "file_size_bytes": 4_000_064}
        assert meta["levels"]["LOD1"]["num_gists"] == 31250
        assert meta["levels"]["LOD1"]["file_size_bytes"] == 128_000_064
        assert meta["levels"]["LOD2"]["num_gists"] == 976
        assert meta["levels"]["LOD2"]["file_size_bytes"] == 3_997_760
        assert mc.verify(path) == []
        from test_megacontext_docs import size_table

        l0, _, l1, _, l2, _ = size_table()[1_000_000]         # docs/megacontext.md's row
        assert [sizes["LOD0.ctx"], sizes["LOD1.ctx"], sizes["LOD2.ctx"]] == [l0, l1, l2]
        # the seed's "~3.2% overhead" is wrong: the gists take 33x the tokens' bytes
        assert (sizes["LOD1.ctx"] + sizes["LOD2.ctx"]) / sizes["LOD0.ctx"] > 32
    finally:
        for n in ("LOD0.ctx", "LOD1.ctx", "LOD2.ctx"):
            os.unlink(path / n)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 3000), max_size=8), k=st.sampled_from([4, 32]),
       dtype=st.sampled_from(["fp16", "bf16", "fp32"]), gist_every=st.booleans())
def test_any_chunking_gives_identical_files(tmp_path_factory, cuts, k, dtype, gist_every):
    tokens = token_stream(3000, seed=len(cuts), vocab=1000)
    rng = np.random.default_rng(5)
    table = rng.standard_normal((1000, 8)).astype(np.float32)
    pool = mc.MeanPool(table)
    base = tmp_path_factory.mktemp("chunks")

    def ingest(path, pieces):
        with mc.create(path, embedding_dim=8, block_size=k, gist_dtype=dtype, model_name="m") as t:
            for a, b in pieces:
                t.append_tokens(tokens[a:b], commit=not gist_every)
                if gist_every:
                    mc.build_gists(t, pool)
            mc.build_gists(t, pool)
        return {n: (path / n).read_bytes() for n in ("LOD0.ctx", "LOD1.ctx", "LOD2.ctx")}

    whole = ingest(base / "whole", [(0, 3000)])
    edges = [0] + sorted(cuts) + [3000]
    parts = ingest(base / "parts", list(zip(edges, edges[1:])))
    assert parts == whole
    m1 = json.loads((base / "whole" / "metadata.json").read_text())
    m2 = json.loads((base / "parts" / "metadata.json").read_text())
    for m in (m1, m2):
        del m["created_at"], m["last_modified"]
    assert m1 == m2
    # and the gists are the plain-numpy mean pooling
    npdt = GIST_NP[{"fp16": 1, "bf16": 2, "fp32": 3}[dtype]]
    with mc.open(base / "whole") as t:
        n1 = 3000 // k
        want1 = mean_pool(table[tokens[:n1 * k]], k, npdt)
        assert np.array_equal(t.gists(1).view(np.uint8), want1.view(np.uint8))
        n2 = n1 // k
        want2 = mean_pool(want1[:n2 * k], k, npdt)
        assert np.array_equal(t.gists(2).view(np.uint8), want2.view(np.uint8))


def test_gists_only_for_complete_spans(tmp_path):
    with mc.create(tmp_path / "t", embedding_dim=4, block_size=4) as t:
        t.append_tokens(np.arange(10))
        t.append_gists(1, np.zeros((2, 4), np.float32))
        with pytest.raises(mcf.InvalidArgumentError, match="complete spans"):
            t.append_gists(1, np.zeros((1, 4), np.float32))       # tokens 8..9 are a partial block
        with pytest.raises(mcf.InvalidArgumentError, match="complete spans"):
            t.append_gists(2, np.zeros((1, 4), np.float32))       # only 2 LOD1 gists of 4
        t.append_tokens(np.arange(6))
        t.append_gists(1, np.ones((2, 4), np.float64))             # float64 is rounded via float32
        t.append_gists(2, np.ones(4, np.float16))                  # one row as a 1-D array
        assert t.counts == (16, 4, 1)


def test_in_place_rewrite_records_the_checkpoint(tmp_path):
    tokens = token_stream(32 * 70)
    lod1, _ = build(tmp_path / "t", tokens)
    rng = np.random.default_rng(9)
    new = rand_gists(rng, 10, D)
    size = os.path.getsize(tmp_path / "t" / "LOD1.ctx")
    with mc.open(tmp_path / "t", "r+") as t:
        t.write_gists(1, 20, new, checkpoint="ckpt-b")
        assert np.array_equal(t.gists(1, slice(20, 30)), new)
        assert t.checkpoint_ranges(1) == [(0, 20, "ckpt-a", False), (20, 30, "ckpt-b", False),
                                          (30, 70, "ckpt-a", False)]
        with pytest.raises(mcf.OutOfBoundsError, match="append_gists"):
            t.write_gists(1, 65, new, checkpoint="x")
        t.write_gists(1, 30, lod1[30:70], checkpoint="ckpt-a")     # neighbours with equal values merge
        assert t.checkpoint_ranges(1)[-1] == (30, 70, "ckpt-a", False)
    assert os.path.getsize(tmp_path / "t" / "LOD1.ctx") == size
    raw = (tmp_path / "t" / "LOD1.ctx").read_bytes()
    assert raw[mc.gist_offset(20, D, 2):mc.gist_offset(30, D, 2)] == new.tobytes()
    meta = json.loads((tmp_path / "t" / "metadata.json").read_text())
    assert meta["gistnet_checkpoint"] == "ckpt-a"
    assert mc.verify(tmp_path / "t") == []


def test_interrupted_rewrite_is_reported(tmp_path, monkeypatch):
    build(tmp_path / "t", token_stream(32 * 40))
    import mcf.megacontext.tree as tree_mod

    with mc.open(tmp_path / "t", "r+") as t:
        def boom(*a, **k):
            raise KeyboardInterrupt

        monkeypatch.setattr(tree_mod, "pwrite_all", boom)
        with pytest.raises(KeyboardInterrupt):
            t.write_gists(1, 5, np.zeros((3, D), np.float16), checkpoint="ckpt-new")
        monkeypatch.undo()
    problems = mc.verify(tmp_path / "t")
    assert [p.severity for p in problems] == ["warning"]
    assert "rewrite of gists [5, 8)" in str(problems[0]) and "ckpt-new" in str(problems[0])


def test_argument_errors(tmp_path):
    for kw in (dict(embedding_dim=0), dict(embedding_dim=70000), dict(embedding_dim=8, block_size=0),
               dict(embedding_dim=8, gist_dtype="uint32"), dict(embedding_dim=8, gist_dtype="int8"),
               dict(embedding_dim=8, model_name=3), dict(embedding_dim=8, vocab_size=0),
               dict(embedding_dim=True)):
        with pytest.raises(mcf.InvalidArgumentError):
            mc.create(tmp_path / "bad", **kw)
    assert not (tmp_path / "bad" / "metadata.json").exists()
    with mc.create(tmp_path / "t", embedding_dim=8, vocab_size=100) as t:
        for ids in ([-1], [100], [1.5], [[1, 2]], ["a"]):
            with pytest.raises(mcf.InvalidArgumentError):
                t.append_tokens(ids)
        for rows in (np.zeros((2, 7)), np.zeros((2, 8), np.int32), np.zeros(3), "x"):
            with pytest.raises(mcf.InvalidArgumentError):
                t.append_gists(1, rows)
        with pytest.raises(mcf.InvalidArgumentError):
            t.append_gists(3, np.zeros((0, 8)))
        assert t.counts == (0, 0, 0)
    with pytest.raises(mcf.InvalidArgumentError, match="already exists"):
        mc.create(tmp_path / "t", embedding_dim=8)
    with pytest.raises(mcf.InvalidArgumentError):
        mc.open(tmp_path / "t", "w")
    with pytest.raises(mcf.MissingFileError):
        mc.open(tmp_path / "nothing")


def test_one_writer_at_a_time(tmp_path):
    build(tmp_path / "t", token_stream(100))
    with mc.open(tmp_path / "t", "r+") as w:
        with pytest.raises(mcf.MCFIOError, match="already open for writing"):
            mc.open(tmp_path / "t", "r+")
        with mc.open(tmp_path / "t") as r:                      # readers are always welcome
            assert r.num_tokens == 100
        w.append_tokens([1, 2, 3])
    with mc.open(tmp_path / "t", "r+") as w:                    # the lock died with the writer
        assert w.num_tokens == 103


def test_reader_refresh_sees_commits_only(tmp_path):
    with mc.create(tmp_path / "t", embedding_dim=4, block_size=4) as w, mc.open(tmp_path / "t") as r:
        w.append_tokens(np.arange(10))
        assert r.counts == (0, 0, 0)
        assert r.refresh() == (10, 0, 0)
        assert np.array_equal(r.tokens(), np.arange(10))
        w.append_tokens(np.arange(10, 20), commit=False)
        w.append_gists(1, np.ones((4, 4)), commit=False)
        assert w.counts == (20, 4, 0) and w.committed_counts == (10, 0, 0)
        assert r.refresh() == (10, 0, 0)                        # written, not committed: invisible
        w.commit()
        assert r.refresh() == (20, 4, 0)
        assert np.array_equal(r.gists(1), np.ones((4, 4), np.float16))


def test_pread_mode(tmp_path):
    tokens = token_stream(3000)
    lod1, lod2 = build(tmp_path / "t", tokens)
    with mc.open(tmp_path / "t", mmap=False) as t:
        assert t.source(0).mode == "pread"
        assert np.array_equal(t.tokens(), tokens)
        assert np.array_equal(t.gists(1, [3, 1, 4]), lod1[[3, 1, 4]])
        assert np.array_equal(t.gists(2), lod2)


def test_bf16_and_fp32_trees(tmp_path):
    for dtype, npdt in (("bf16", ml_dtypes.bfloat16), ("fp32", np.float32)):
        lod1, _ = build(tmp_path / dtype, token_stream(640), dtype=dtype)
        with mc.open(tmp_path / dtype) as t:
            assert t.gist_dtype.name == dtype and t.gists(1).dtype == npdt
            assert np.array_equal(t.gists(1), lod1)
        # float32 input is rounded to nearest even, like ml_dtypes / numpy
        x = np.random.default_rng(2).standard_normal((1, D)).astype(np.float32)
        with mc.open(tmp_path / dtype, "r+") as t:
            t.write_gists(1, 0, x, checkpoint="c")
            assert np.array_equal(t.gist(1, 0), x[0].astype(npdt))


# -- snapshots and restore --------------------------------------------------------------------------------
def test_snapshot_layout_contents_and_atomicity(tmp_path):
    tokens = token_stream(5000)
    lod1, lod2 = build(tmp_path / "t", tokens)
    with mc.open(tmp_path / "t", "r+") as t:
        t.append_tokens(token_stream(100, seed=9), commit=False)        # pending: committed by snapshot()
        snap = t.snapshot()
        t.append_tokens([1, 2, 3])                                      # after: not in the snapshot
    rel = os.path.relpath(snap, tmp_path / "t")
    assert rel.startswith("checkpoints" + os.sep) and len(os.path.basename(snap)) == len("2025-01-15_10-30-00")
    assert sorted(os.listdir(snap)) == ["LOD0.ctx", "LOD1.ctx", "LOD2.ctx", "metadata.json"]
    assert not [n for n in os.listdir(os.path.dirname(snap)) if "partial" in n]
    with mc.open(snap) as s:
        assert s.counts == (5100, 156, 4)
        assert np.array_equal(s.tokens(0, 5000), tokens)
        assert np.array_equal(s.gists(1), lod1) and np.array_equal(s.gists(2), lod2)
        assert s.metadata["snapshot"]["of"] == str(tmp_path / "t")
    assert mc.verify(snap) == []
    with mc.open(tmp_path / "t") as r:          # a reader can snapshot too (the committed prefix)
        snap2 = r.snapshot(tmp_path / "elsewhere" / "s2")
    with mc.open(snap2) as s:
        assert s.num_tokens == 5103
    with pytest.raises(mcf.InvalidArgumentError, match="exists"):
        with mc.open(tmp_path / "t") as r:
            r.snapshot(snap2)


def test_restore(tmp_path):
    tokens = token_stream(3000)
    build(tmp_path / "t", tokens)
    with mc.open(tmp_path / "t", "r+") as t:
        snap = t.snapshot()
        t.append_tokens(token_stream(500, seed=4))
        t.write_gists(1, 0, np.zeros((5, D), np.float16), checkpoint="bad-run")
        with pytest.raises(mcf.MCFIOError, match="already open for writing"):
            mc.restore(snap, tmp_path / "t")                 # not under a live writer
        t.restore(snap)                                      # the writer itself can
        assert t.counts == (3000, 93, 2)
        assert np.array_equal(t.tokens(), tokens)
        assert t.checkpoint_ranges(1) == [(0, 93, "ckpt-a", False)]
        t.append_tokens([7])
    mc.restore(snap, tmp_path / "copy")                      # into a new directory
    with mc.open(tmp_path / "copy") as c:
        assert c.counts == (3000, 93, 2) and c.metadata["restored_from"] == snap
    assert mc.verify(tmp_path / "copy") == []


def test_interrupted_restore_is_finished_by_the_next_writer(tmp_path, monkeypatch):
    tokens = token_stream(3000)
    build(tmp_path / "t", tokens)
    with mc.open(tmp_path / "t", "r+") as t:
        snap = t.snapshot()
        t.append_tokens(token_stream(700, seed=4))
    import mcf.megacontext.snapshots as snap_mod

    real = snap_mod.finish_restore
    calls = []

    def crash_after_first_rename(tree_dir):
        calls.append(1)
        if len(calls) == 2:      # the call that performs the renames: do one, then "die"
            os.replace(os.path.join(tree_dir, ".restore-LOD0.ctx"), os.path.join(tree_dir, "LOD0.ctx"))
            raise KeyboardInterrupt
        return real(tree_dir)

    monkeypatch.setattr(snap_mod, "finish_restore", crash_after_first_rename)
    with pytest.raises(KeyboardInterrupt):
        mc.restore(snap, tmp_path / "t")
    monkeypatch.undo()
    with pytest.raises(mcf.MCFIOError, match="restore"):
        mc.open(tmp_path / "t")                               # readers refuse the half-restored tree
    assert any("restore" in str(p) for p in mc.verify(tmp_path / "t"))
    with mc.open(tmp_path / "t", "r+") as t:                  # a writer rolls it forward
        assert t.counts == (3000, 93, 2)
    assert mc.verify(tmp_path / "t") == []
    assert not [n for n in os.listdir(tmp_path / "t") if n.startswith(".restore")]


def test_durable_writer_and_pread_mode(tmp_path):
    """durable=True adds fdatasync/fsync at every step of a commit; the results are the same."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((100, D)).astype(np.float32)
    ids = token_stream(2100, vocab=100)
    with mc.create(tmp_path / "t", embedding_dim=D, durable=True, mmap=False) as t:
        for chunk in np.array_split(ids, 5):
            t.append_tokens(chunk)
            mc.build_gists(t, mc.MeanPool(table))
        t.write_gists(1, 3, np.ones((2, D)), checkpoint="x")
        snap = t.snapshot()
    with mc.open(tmp_path / "t") as t, mc.open(snap) as s:
        assert t.counts == s.counts == (2100, 65, 2)
        assert np.array_equal(t.tokens(), ids) and np.array_equal(t.gists(1), s.gists(1))
        want = mean_pool(table[ids[:65 * 32]], 32, np.float16)
        want[3:5] = 1
        assert np.array_equal(t.gists(1), want)
    assert mc.verify(tmp_path / "t") == []
