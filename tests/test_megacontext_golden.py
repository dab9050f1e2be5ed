"""Golden MegaContext trees (tests/fixtures/megacontext/, written once by
tests/fixtures/megacontext_golden.py): the committed bytes decode to the expected tokens and
mean-pooled gists, and today's writer reproduces the canonical files byte for byte."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

import mcf.megacontext as mc
from _megacontext_ref import canonical_header, legacy_header, mean_pool
from _vectors import load_fixture

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

golden = load_fixture("megacontext_golden.py")

FILES = ("LOD0.ctx", "LOD1.ctx", "LOD2.ctx")
DTYPES = {"canonical_fp16": np.dtype(np.float16), "canonical_bf16": np.dtype(ml_dtypes.bfloat16),
          "legacy_fp32": np.dtype(np.float32)}


def expected(npdt):
    ids = golden.tokens()
    k = golden.K
    lod1 = mean_pool(golden.table()[ids[:len(ids) // k * k]], k, npdt)
    lod2 = mean_pool(lod1[:len(lod1) // k * k], k, npdt)
    return ids, lod1, lod2


@pytest.mark.parametrize("name", list(DTYPES))
def test_golden_tree_decodes(name):
    path = os.path.join(golden.OUT, name)
    ids, lod1, lod2 = expected(DTYPES[name])
    with mc.open(path) as t:
        assert t.counts == (103, 25, 6)
        assert (t.block_size, t.embedding_dim) == (4, 6)
        assert np.array_equal(t.tokens(), ids)
        assert t.gists(1).dtype == DTYPES[name]
        assert np.array_equal(t.gists(1).view(np.uint8), lod1.view(np.uint8))
        assert np.array_equal(t.gists(2).view(np.uint8), lod2.view(np.uint8))
        assert t.ingestion_complete
        wc = t.assemble(t.plan_tail(20, 5), golden.table())
        assert mc.plan_coverage(t.plan_tail(20, 5), 103, block_size=4) == (0, 103)
        assert len(wc) <= 20
    assert [p for p in mc.verify(path, deep=True) if p.severity != "note"] == []


def read(*parts, n=None):
    with open(os.path.join(golden.OUT, *parts), "rb") as f:
        return f.read() if n is None else f.read(n)


def test_golden_headers_are_the_documented_bytes():
    assert read("canonical_fp16", "LOD1.ctx", n=64) == canonical_header(1, 4, 6, 1, 25, b"golden-model")
    assert read("canonical_bf16", "LOD2.ctx", n=64) == canonical_header(2, 4, 6, 2, 6, b"golden-model")
    assert read("legacy_fp32", "LOD0.ctx", n=64) == legacy_header(0, 4, 6, 0, b"legacy-tool", magic=b"MCCT")
    with mc.open(os.path.join(golden.OUT, "legacy_fp32")) as t:
        assert t.header(0).layout == "legacy" and t.header(0).magic_order == "reversed"


@pytest.mark.parametrize("name,dtype", [("canonical_fp16", "fp16"), ("canonical_bf16", "bf16")])
def test_writer_reproduces_the_golden_bytes(tmp_path, name, dtype):
    golden.write_canonical(tmp_path / "t", dtype)
    for f in FILES:
        assert (tmp_path / "t" / f).read_bytes() == read(name, f), f
    a = json.loads((tmp_path / "t" / "metadata.json").read_text())
    b = json.loads(read(name, "metadata.json"))
    for m in (a, b):
        del m["created_at"], m["last_modified"]
    assert a == b


def test_legacy_golden_upgraded_by_a_writer(tmp_path):
    shutil.copytree(os.path.join(golden.OUT, "legacy_fp32"), tmp_path / "t")
    with mc.open(tmp_path / "t", "r+") as t:
        assert any("canonical layout" in n for n in t.notes)
    raw = (tmp_path / "t" / "LOD1.ctx").read_bytes()
    assert raw[:64] == canonical_header(1, 4, 6, 3, 25, b"legacy-tool")
    assert raw[64:] == read("legacy_fp32", "LOD1.ctx")[64:]
    assert mc.verify(tmp_path / "t") == []
    with mc.open(tmp_path / "t") as t:      # seed 000's single gistnet_checkpoint covers every gist
        assert t.checkpoint_ranges(1) == [(0, 25, None, False)]
