"""Bad MegaContext trees: every corruption the issue lists raises a specific MCFError subclass naming
the file and field; verify() lists every inconsistency at once; random corruption never escapes as a
builtin exception; the leftovers of a killed writer are reported and repaired."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.megacontext as mc
from _megacontext_ref import canonical_header, token_stream, write_tree_files

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

D = 8


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid tree: 2100 tokens, 65 LOD1 and 2 LOD2 gists (fp16, d=8)."""
    path = tmp_path_factory.mktemp("good") / "tree"
    rng = np.random.default_rng(0)
    with mc.create(path, embedding_dim=D, model_name="m") as t:
        t.append_tokens(token_stream(2100))
        t.append_gists(1, rng.standard_normal((65, D)), checkpoint="c")
        t.append_gists(2, rng.standard_normal((2, D)))
    return path


@pytest.fixture
def tree(good, tmp_path):
    p = tmp_path / "tree"
    shutil.copytree(good, p)
    return p


def meta_of(p):
    return json.loads((p / "metadata.json").read_text())


def put_meta(p, m):
    (p / "metadata.json").write_text(json.dumps(m))


def patch(p, name, offset, fmt, value):
    b = bytearray((p / name).read_bytes())
    struct.pack_into(fmt, b, offset, value)
    (p / name).write_bytes(bytes(b))


def edit_meta(fn):
    def apply(p):
        m = meta_of(p)
        fn(m)
        put_meta(p, m)
    return apply


def _del(m, *keys):
    for k in keys[:-1]:
        m = m[k]
    del m[keys[-1]]


def _set(m, value, *keys):
    for k in keys[:-1]:
        m = m[k]
    m[keys[-1]] = value


CASES = {
    # metadata.json
    "metadata missing": (lambda p: os.unlink(p / "metadata.json"), mcf.MissingFileError, None),
    "metadata not JSON": (lambda p: (p / "metadata.json").write_text("{"), mcf.FormatError, "metadata"),
    "metadata not UTF-8": (lambda p: (p / "metadata.json").write_bytes(b"\xff\xfe{}"), mcf.FormatError, "metadata"),
    "metadata nested too deep": (lambda p: (p / "metadata.json").write_text("[" * 200_000), mcf.FormatError,
                                 "metadata"),
    "metadata a list": (lambda p: (p / "metadata.json").write_text("[]"), mcf.FormatError, "metadata"),
    "metadata version 2": (edit_meta(lambda m: _set(m, 2, "version")), mcf.UnsupportedVersionError, "version"),
    "metadata embedding_dim 0": (edit_meta(lambda m: _set(m, 0, "embedding_dim")), mcf.FormatError, "embedding_dim"),
    "metadata block_size 0": (edit_meta(lambda m: _set(m, 0, "block_size")), mcf.FormatError, "block_size"),
    "metadata block_size str": (edit_meta(lambda m: _set(m, "32", "block_size")), mcf.FormatError, "block_size"),
    "metadata no levels": (edit_meta(lambda m: _del(m, "levels")), mcf.FormatError, "levels"),
    "metadata no LOD2": (edit_meta(lambda m: _del(m, "levels", "LOD2")), mcf.FormatError, "levels.LOD2"),
    "metadata no num_tokens": (edit_meta(lambda m: _del(m, "levels", "LOD0", "num_tokens")), mcf.FormatError,
                               "levels.LOD0.num_tokens"),
    "metadata negative count": (edit_meta(lambda m: _set(m, -1, "levels", "LOD1", "num_gists")), mcf.FormatError,
                                "levels.LOD1.num_gists"),
    "metadata bool count": (edit_meta(lambda m: _set(m, True, "levels", "LOD2", "num_gists")), mcf.FormatError,
                            "levels.LOD2.num_gists"),
    "metadata wrong file size": (edit_meta(lambda m: _set(m, 5, "levels", "LOD1", "file_size_bytes")),
                                 mcf.FormatError, "levels.LOD1.file_size_bytes"),
    "metadata wrong num_blocks": (edit_meta(lambda m: _set(m, 7, "levels", "LOD0", "num_blocks")), mcf.FormatError,
                                  "levels.LOD0.num_blocks"),
    "metadata LOD1 > ceil(tokens/32)": (edit_meta(lambda m: (
        _set(m, 67, "levels", "LOD1", "num_gists"), _set(m, 64 + 67 * 16, "levels", "LOD1", "file_size_bytes"))),
        mcf.FormatError, "levels.LOD1.num_gists"),
    "metadata no ingestion_complete": (edit_meta(lambda m: _del(m, "ingestion_complete")), mcf.FormatError,
                                       "ingestion_complete"),
    "metadata no model_name": (edit_meta(lambda m: _del(m, "model_name")), mcf.FormatError, "model_name"),
    "metadata bad gist dtype": (edit_meta(lambda m: _set(m, "int8", "gist_dtype")), mcf.FormatError, "gist_dtype"),
    "metadata bad ranges": (edit_meta(lambda m: _set(m, [{"start": 5, "stop": 2}], "levels", "LOD1", "gists")),
                            mcf.FormatError, "levels.LOD1.gists[0]"),
    "metadata ranges past count": (edit_meta(lambda m: _set(m, [{"start": 0, "stop": 99, "gistnet_checkpoint": None}],
                                                             "levels", "LOD1", "gists")),
                                   mcf.FormatError, "levels.LOD1.gists[0]"),
    "metadata counts more than header": (edit_meta(lambda m: (
        _set(m, 2101 // 32, "levels", "LOD0", "num_blocks"), _set(m, 2101, "levels", "LOD0", "num_tokens"),
        _set(m, 64 + 2101 * 4, "levels", "LOD0", "file_size_bytes"))), mcf.FormatError, "levels.LOD0"),
    "metadata d differs from headers": (edit_meta(lambda m: (
        _set(m, 16, "embedding_dim"), _set(m, 64 + 65 * 32, "levels", "LOD1", "file_size_bytes"),
        _set(m, 64 + 2 * 32, "levels", "LOD2", "file_size_bytes"))), mcf.FormatError, "embedding_dim"),
    # headers
    "bad magic": (lambda p: patch(p, "LOD1.ctx", 0, "<4s", b"GGUF"), mcf.FormatError, "magic"),
    "unknown level": (lambda p: patch(p, "LOD2.ctx", 6, "<H", 7), mcf.FormatError, "level"),
    "level of another file": (lambda p: patch(p, "LOD2.ctx", 6, "<H", 1), mcf.FormatError, "level"),
    "unknown dtype code": (lambda p: patch(p, "LOD1.ctx", 12, "<H", 9), mcf.FormatError, "dtype_code"),
    "block_size 0": (lambda p: patch(p, "LOD0.ctx", 8, "<H", 0), mcf.FormatError, "block_size"),
    "embedding_dim 0": (lambda p: patch(p, "LOD1.ctx", 10, "<H", 0), mcf.FormatError, "embedding_dim"),
    "version 9": (lambda p: patch(p, "LOD0.ctx", 4, "<H", 9), mcf.UnsupportedVersionError, "version"),
    "count larger than the file": (lambda p: patch(p, "LOD1.ctx", 14, "<Q", 66), mcf.TruncatedError, "num_entries"),
    "huge count": (lambda p: patch(p, "LOD0.ctx", 14, "<Q", 2**63), mcf.TruncatedError, "num_entries"),
    "reserved bytes set": (lambda p: patch(p, "LOD0.ctx", 63, "<B", 1), mcf.FormatError, "reserved"),
    "truncated header": (lambda p: (p / "LOD2.ctx").write_bytes((p / "LOD2.ctx").read_bytes()[:30]),
                         mcf.TruncatedError, "header"),
    "file missing": (lambda p: os.unlink(p / "LOD1.ctx"), mcf.MissingFileError, None),
    "block_size differs between files": (lambda p: patch(p, "LOD2.ctx", 8, "<H", 16), mcf.FormatError, "block_size"),
    "gist dtype differs": (lambda p: (patch(p, "LOD2.ctx", 12, "<H", 3), patch(p, "LOD2.ctx", 14, "<Q", 1)),
                           mcf.FormatError, "dtype_code"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_tree(tree, name):
    corrupt, cls, field = CASES[name]
    corrupt(tree)
    for mode in ("r", "r+"):
        with pytest.raises(cls) as ei:
            mc.open(tree, mode)
        assert isinstance(ei.value, cls)
        if field is not None:
            assert ei.value.field == field, str(ei.value)
        assert str(tree) in str(ei.value)
    problems = mc.verify(tree)
    assert any(p.severity == "error" and type(p.error) is type(ei.value)
               and getattr(p.error, "field", None) == field for p in problems), problems


def contradicting_tree(p, n1, n2, tokens=100):
    """Files that agree with their own sizes but whose counts contradict each other."""
    rng = np.random.default_rng(1)
    write_tree_files(p, token_stream(tokens), rng.standard_normal((n1, D)).astype(np.float16),
                     rng.standard_normal((n2, D)).astype(np.float16), name=b"m")
    m = {"version": 1, "created_at": "x", "last_modified": "x", "model_name": "m", "embedding_dim": D,
         "block_size": 32, "gist_dtype": "fp16", "gistnet_checkpoint": None, "ingestion_complete": False,
         "levels": {"LOD0": {"num_tokens": 0, "num_blocks": 0, "file_size_bytes": 64},
                    "LOD1": {"num_gists": 0, "file_size_bytes": 64}, "LOD2": {"num_gists": 0, "file_size_bytes": 64}}}
    put_meta(p, m)


@pytest.mark.parametrize("n1,n2,file", [(5, 0, "LOD1.ctx"), (4, 2, "LOD2.ctx")])
def test_levels_whose_counts_contradict(tmp_path, n1, n2, file):
    contradicting_tree(tmp_path, n1, n2)          # 100 tokens: ceil(100/32) = 4 blocks
    with pytest.raises(mcf.FormatError) as ei:
        mc.open(tmp_path)
    assert ei.value.field == "num_entries" and file in str(ei.value) and "ceil" in str(ei.value)
    contradicting_tree(tmp_path, 4, 0)            # a gist for the partial block: allowed (ceil), but reported
    with mc.open(tmp_path) as t:
        assert t.counts == (100, 4, 0)
    assert [p.severity for p in mc.verify(tmp_path) if "partial" in str(p)] == ["warning"]


def test_verify_lists_every_inconsistency(tree):
    patch(tree, "LOD2.ctx", 0, "<4s", b"XXXX")
    patch(tree, "LOD0.ctx", 8, "<H", 16)
    m = meta_of(tree)
    m["ingestion_complete"] = "yes"
    m["levels"]["LOD1"]["file_size_bytes"] = 1
    put_meta(tree, m)
    with open(tree / "LOD1.ctx", "ab") as f:
        f.write(b"\1" * 10)
    problems = mc.verify(tree)
    text = "\n".join(map(str, problems))
    for want in ("magic", "ingestion_complete", "LOD1.file_size_bytes", "block_size", "10 bytes after"):
        assert want in text, text
    assert sum(p.severity == "error" for p in problems) >= 4


# -- what a killed writer leaves behind: reported by readers, repaired by the next writer --------------
def test_uncommitted_tail(tree):
    w = mc.open(tree, "r+")
    w.append_tokens(token_stream(50, seed=7), commit=False)
    w.append_gists(1, np.ones((1, D)), commit=False)
    w._release()                                  # dies without committing
    with mc.open(tree) as r:
        assert r.counts == (2100, 65, 2)
        assert any("200 bytes after the 2100 committed tokens" in n for n in r.notes)
    problems = mc.verify(tree)
    assert problems and all(p.severity == "warning" for p in problems)
    with mc.open(tree, "r+") as w:
        assert w.counts == (2100, 65, 2)
        assert any("uncommitted bytes discarded" in n for n in w.notes)
    assert os.path.getsize(tree / "LOD0.ctx") == 64 + 2100 * 4
    assert mc.verify(tree) == []


def test_metadata_behind_the_headers(tree, monkeypatch):
    import mcf.megacontext.tree as tree_mod

    w = mc.open(tree, "r+")
    w.append_tokens(token_stream(60, seed=3), commit=False)
    w.append_gists(1, np.ones((2, D)), checkpoint="c2", commit=False)

    def die(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tree_mod, "write_metadata", die)
    with pytest.raises(KeyboardInterrupt):
        w.commit()                                # headers updated, metadata.json not
    monkeypatch.undo()
    w._release()
    with mc.open(tree) as r:
        assert r.counts == (2160, 67, 2)          # the headers are the commit point
        assert any("metadata.json is behind" in n for n in r.notes)
    assert {p.severity for p in mc.verify(tree)} == {"warning"}
    with mc.open(tree, "r+") as w:
        assert any("brought up to the committed counts" in n for n in w.notes)
        assert w.checkpoint_ranges(1) == [(0, 65, "c", False), (65, 67, None, False)]   # checkpoint unknown
    assert meta_of(tree)["levels"]["LOD0"]["num_tokens"] == 2160
    assert mc.verify(tree) == []


def test_legacy_tree_is_read_and_upgraded_by_a_writer(tmp_path):
    rng = np.random.default_rng(4)
    tokens = token_stream(2100)
    lod1 = rng.standard_normal((65, D)).astype(np.float16)
    lod2 = rng.standard_normal((2, D)).astype(np.float16)
    write_tree_files(tmp_path, tokens, lod1, lod2, name=b"SmolLM3-3B", legacy=True, magic=b"MCCT")
    with mc.create(tmp_path / "x", embedding_dim=D) as t:       # a metadata.json to start from
        meta = t.metadata
    meta = dict(meta, model_name="SmolLM3-3B")
    from mcf.megacontext.metadata import with_counts

    put_meta(tmp_path, with_counts(meta, (2100, 65, 2)))
    with mc.open(tmp_path) as t:
        assert t.counts == (2100, 65, 2)
        assert t.header(1).layout == "legacy" and t.header(1).magic_order == "reversed"
        assert np.array_equal(t.tokens(), tokens) and np.array_equal(t.gists(1), lod1)
        assert any("legacy header" in n for n in t.notes)
    with mc.open(tmp_path, "r+") as t:
        t.append_tokens([1, 2])
    raw = (tmp_path / "LOD0.ctx").read_bytes()
    assert raw[:64] == canonical_header(0, 32, D, 0, 2102, b"SmolLM3-3B")
    assert (tmp_path / "LOD1.ctx").read_bytes()[:64] == canonical_header(1, 32, D, 1, 65, b"SmolLM3-3B")
    assert mc.verify(tmp_path) == []


# -- fuzzing: any byte of any file, any truncation ---------------------------------------------------------
FILES = ["LOD0.ctx", "LOD1.ctx", "LOD2.ctx", "metadata.json"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(file=st.sampled_from(FILES), pos=st.integers(0, 10**6), val=st.integers(0, 255), cut=st.booleans())
def test_fuzz_never_escapes(good, tmp_path_factory, file, pos, val, cut):
    p = tmp_path_factory.mktemp("fuzz") / "tree"
    shutil.copytree(good, p)
    raw = bytearray((p / file).read_bytes())
    pos %= len(raw)
    if cut:
        raw = raw[:pos]
    else:
        raw[pos] = val
    (p / file).write_bytes(bytes(raw))
    for mode in ("r", "r+"):
        try:
            with mc.open(p, mode) as t:
                t.assemble(t.plan_tail(200, 40))
        except mcf.MCFError:
            pass
    for prob in mc.verify(p, deep=True):
        assert isinstance(prob.error, mcf.MCFError)
    shutil.rmtree(p)
