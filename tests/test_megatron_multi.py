"""Many shards read as one (``mcf.megatron.open([...])`` / a shard list): every answer equals the merged
dataset's, GPT samples included; opening reads headers or the list only; a list that disagrees with its
shards, a malformed list, mixed dtypes and closed views are refused or kept safe."""

from __future__ import annotations

import json
import os
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.megatron as mm
from mcf.megatron.sharded import ShardedDataset, write_shard_list


def build_shards(tmp_path, spec, dtype=np.uint16, seed=0, multimodal=False):
    """spec: per shard, a list of documents, each a list of sequence lengths."""
    rng = np.random.default_rng(seed)
    prefixes = []
    for k, docs in enumerate(spec):
        p = str(tmp_path / f"s{k:03d}")
        with mm.Writer(p, dtype=dtype, multimodal=multimodal, durable=False) as w:
            for lens in docs:
                toks = rng.integers(0, 1000, int(sum(lens)))
                modes = rng.integers(-3, 4, len(lens)) if multimodal else None
                w.add_document(toks, lens, modes)
        prefixes.append(p)
    merged = str(tmp_path / "merged")
    mm.merge(merged, prefixes)
    return prefixes, merged


SPEC = [[[3, 1], [4]], [], [[0], [2, 2, 2]], [[5]], [[]], [[1], [1], [7, 0]]]


def assert_same(s, m, rng):
    assert len(s) == len(m)
    assert s.num_documents == m.num_documents and s.num_tokens == m.num_tokens and s.dtype == m.dtype
    for i in range(-len(m), len(m)):
        assert s[i].tolist() == m[i].tolist()
        assert s.get(i, 0).tolist() == m.get(i, 0).tolist()
    assert [a.tolist() for a in s[1:-1:2]] == [a.tolist() for a in m[1:-1:2]]
    assert s.sequence_lengths.tolist() == m.sequence_lengths.tolist()
    assert s.document_indices.tolist() == m.document_indices.tolist()
    for k in range(-m.num_documents, m.num_documents):
        assert s.document(k).tolist() == m.document(k).tolist()
        assert s.document_sequences(k) == m.document_sequences(k)
    idx = rng.integers(-len(m), len(m), 64)
    (a, ao), (b, bo) = s.gather(idx), m.gather(idx)
    assert a.tolist() == b.tolist() and ao.tolist() == bo.tolist()
    out = np.full(len(a) + 5, 77, m.dtype)
    c, co = s.gather(idx, out=out)
    assert c.tolist() == a.tolist() and (len(a) == 0 or np.shares_memory(c, out))
    assert [x.tolist() for x in s] == [x.tolist() for x in m]


@pytest.mark.parametrize("mmap", [True, False])
def test_prefix_list_equals_merged(tmp_path, mmap):
    prefixes, merged = build_shards(tmp_path, SPEC)
    with mm.open(prefixes, mmap=mmap) as s, mm.open(merged, mmap=mmap) as m:
        assert isinstance(s, ShardedDataset) and s.num_shards == len(SPEC)
        assert_same(s, m, np.random.default_rng(1))
        # a sequence's place: shard and id in it
        k, j = s.locate(len(m) - 1)
        assert k == len(SPEC) - 1 and s.shard(k)[j].tolist() == m[len(m) - 1].tolist()


def test_shard_list_equals_merged_and_opens_nothing(tmp_path):
    prefixes, merged = build_shards(tmp_path, SPEC)
    with mm.open(prefixes) as s:
        shards = s.shards
    listing = str(tmp_path / "corpus.shards.json")
    write_shard_list(listing, shards, dtype=np.uint16)
    doc = json.loads((tmp_path / "corpus.shards.json").read_text())
    assert doc["shards"][0]["prefix"] == "s000"                 # relative to the list
    assert doc["tokens"] == sum(e["tokens"] for e in doc["shards"])
    weights = doc["megatron_data_path"].split()
    assert weights[1] == prefixes[0] and int(weights[0]) == shards[0].tokens
    with mm.open(listing) as s, mm.open(merged) as m:
        assert not any(s._shard_bound(k) for k in range(s.num_shards))   # counts came from the list
        assert len(s) == len(m) and s.num_documents == m.num_documents and s.num_tokens == m.num_tokens
        assert not any(s._shard_bound(k) for k in range(s.num_shards))
        assert_same(s, m, np.random.default_rng(2))


def test_lazy_open_reads_no_shard_until_touched(tmp_path):
    prefixes, _ = build_shards(tmp_path, SPEC)
    write_shard_list(tmp_path / "l.json", mm.open(prefixes).shards, dtype=np.uint16)
    os.unlink(prefixes[3] + ".bin")
    with mm.open(str(tmp_path / "l.json")) as s:
        first = int(s.sequence_starts[3])            # shard 3's first sequence
        assert s[0].tolist() == mm.open(prefixes[0])[0].tolist() and s[first - 1] is not None
        with pytest.raises(mcf.MissingFileError):
            s[first]
        with pytest.raises(mcf.MissingFileError):
            s.gather([0, first])


def test_gpt_samples_on_shards_equal_merged(tmp_path):
    spec = [[[int(x) for x in np.random.default_rng(k).integers(1, 40, 3)] for _ in range(5)] for k in range(7)]
    prefixes, merged = build_shards(tmp_path, spec)
    with mm.open(prefixes) as s, mm.open(merged) as m:
        a = mm.GPTSamples(s, seq_length=16, num_samples=40, seed=7)
        b = mm.GPTSamples(m, seq_length=16, num_samples=40, seed=7)
        assert len(a) == len(b) and len(a) >= 40
        for x, y in zip((a.document_index, a.sample_index, a.shuffle_index),
                        (b.document_index, b.sample_index, b.shuffle_index)):
            assert np.array_equal(x, y) and x.dtype == y.dtype
        for i in range(len(a)):
            assert a[i].tolist() == b[i].tolist()
        sizes = s.sequence_lengths
        di = mm.build_document_index(np.arange(len(s), dtype=np.int32), 2, 3)
        tpe = int(sizes.sum())
        assert np.array_equal(mm.build_sample_idx(sizes, di, 8, 2, tpe),
                              mm.build_sample_idx(m.sequence_lengths, di, 8, 2, tpe))


def test_multimodal_shards(tmp_path):
    prefixes, merged = build_shards(tmp_path, [[[2, 1]], [[3]], [[1, 1, 1]]], multimodal=True)
    with mm.open(prefixes) as s, mm.open(merged) as m:
        assert s.multimodal and s.sequence_modes.tolist() == m.sequence_modes.tolist()
        assert_same(s, m, np.random.default_rng(3))


def test_pickle_reopens_lazily(tmp_path):
    prefixes, merged = build_shards(tmp_path, SPEC)
    s = mm.open(prefixes)
    s[3]
    t = pickle.loads(pickle.dumps(s))
    assert not t._shard_bound(0)
    with mm.open(merged) as m:
        assert_same(t, m, np.random.default_rng(4))
    s.close()
    t.close()


def test_views_survive_close_and_closed_reads_raise(tmp_path):
    prefixes, merged = build_shards(tmp_path, SPEC)
    s = mm.open(prefixes)
    v = s[2]
    want = v.tolist()
    s.close()
    assert v.tolist() == want and s.closed
    for op in (lambda: s[0], lambda: s.gather([0]), lambda: s.get(0)):
        with pytest.raises(mcf.ClosedError):
            op()


def test_gather_racing_close(tmp_path):
    prefixes, _ = build_shards(tmp_path, [[[50] * 20] for _ in range(8)])
    idx = np.arange(160)[::-1].copy()
    for _ in range(20):
        s = mm.open(prefixes).open_all()
        errors = []

        def reader():
            try:
                for _ in range(50):
                    s.gather(idx)
            except mcf.ClosedError:
                pass
            except Exception as exc:  # noqa: BLE001 - the test reports any other failure
                errors.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        s.close()
        t.join(30)
        assert not t.is_alive() and not errors


def test_bad_indices_and_arguments(tmp_path):
    prefixes, _ = build_shards(tmp_path, SPEC)
    with mm.open(prefixes) as s:
        n = len(s)
        for bad in (n, -n - 1):
            with pytest.raises(mcf.OutOfBoundsError):
                s[bad]
            with pytest.raises(mcf.OutOfBoundsError):
                s.gather([0, bad])
        with pytest.raises(mcf.OutOfBoundsError):
            s.get(0, 0, 99)
        with pytest.raises(mcf.OutOfBoundsError):
            s.document(s.num_documents)
        with pytest.raises(mcf.InvalidArgumentError):
            s.gather(np.zeros((2, 2), np.int64))
        # numpy's index rules, as on one dataset: floats refused, a mask of n bools selects
        with pytest.raises(mcf.InvalidArgumentError, match="must be integers"):
            s.gather([0.0, 1.7])
        mask = np.zeros(n, bool)
        mask[[1, n - 1]] = True
        got, offs = s.gather(mask)
        want, woffs = s.gather([1, n - 1])
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(offs, woffs)
        with pytest.raises(mcf.InvalidArgumentError):
            s.gather(mask[:-1])
        with pytest.raises(TypeError):
            s["x"]
    with pytest.raises(mcf.InvalidArgumentError):
        mm.open([])
    with mm.Writer(str(tmp_path / "i32"), dtype=np.int32) as w:
        w.add_item([1])
    with pytest.raises(mcf.InvalidArgumentError, match="dtype"):
        mm.open([prefixes[0], str(tmp_path / "i32")])
    with pytest.raises(mcf.MissingFileError):
        mm.open([prefixes[0], str(tmp_path / "nope")])


def test_sharded_and_single_refuse_the_same_indices(tmp_path):
    """``document(1.5)`` and ``document(True)`` returned document 1 on shards while the single reader
    raised: every indexing entry point of both follows mcf._core.args' rules, with the same error."""
    prefixes, merged = build_shards(tmp_path, SPEC)
    calls = {"ds[k]": lambda ds, v: ds[v], "get": lambda ds, v: ds.get(v), "get(offset)": lambda ds, v: ds.get(0, v),
             "get(length)": lambda ds, v: ds.get(0, 0, v), "document": lambda ds, v: ds.document(v),
             "document_sequences": lambda ds, v: ds.document_sequences(v), "ds[k:]": lambda ds, v: ds[v:],
             "ds[:k]": lambda ds, v: ds[:v], "ds[::k]": lambda ds, v: ds[::v],
             "gather": lambda ds, v: ds.gather([v]), "GPTSamples[k]": lambda ds, v: mm.GPTSamples(ds, 2)[v]}
    with mm.open(prefixes) as s, mm.open(merged) as m:
        for name, call in calls.items():
            assert _same_result(call(s, 1), call(m, 1)), name
            for bad in (1.5, 1.0, True, np.float64(1.0), np.bool_(True), "1", None if name.startswith("ds[") else 1j):
                if bad is None:
                    continue
                errors = []
                for ds in (s, m):
                    with pytest.raises(mcf.MCFError) as e:
                        call(ds, bad)
                    errors.append(type(e.value))
                assert errors[0] is errors[1], (name, bad, errors)
        for bad in (1.5, True, "1"):
            with pytest.raises(mcf.MCFError):
                s.shard(bad)
            with pytest.raises(mcf.MCFError):
                s.locate(bad)
        with pytest.raises(mcf.InvalidArgumentError, match="zero"):
            s[::0]
        with pytest.raises(mcf.InvalidArgumentError, match="zero"):
            m[::0]
        # numpy integers take the compiled path: every width, negative, and past int64
        for ds in (s, m):
            n = len(ds)
            for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64, np.intp,
                      np.longlong, np.ulonglong):
                assert ds[t(5)].tolist() == ds[5].tolist() and ds.get(t(5), t(1), t(1)).tolist() == ds[5][1:2].tolist()
            assert ds[np.int64(-1)].tolist() == ds[n - 1].tolist() and ds[np.int8(-n)].tolist() == ds[0].tolist()
            for big in (np.uint64(2**64 - 1), np.uint64(2**63), np.int64(n), np.int64(-n - 1)):
                with pytest.raises(mcf.OutOfBoundsError):
                    ds[big]
                with pytest.raises(mcf.OutOfBoundsError):
                    ds.get(big)
            with pytest.raises(mcf.OutOfBoundsError):
                ds.get(0, np.uint64(2**64 - 1))


def _same_result(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_same_result(x, y) for x, y in zip(a, b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_result(x, y) for x, y in zip(a, b))
    return np.array_equal(np.asarray(a), np.asarray(b))


def test_shard_list_that_disagrees_with_its_shards(tmp_path):
    prefixes, _ = build_shards(tmp_path, SPEC)
    shards = list(mm.open(prefixes).shards)
    listing = tmp_path / "l.json"
    doc0 = None
    for field in ("sequences", "documents", "tokens"):
        write_shard_list(listing, shards, dtype=np.uint16)
        doc = json.loads(listing.read_text())
        doc0 = doc0 or doc
        doc["shards"][2][field] += 1
        doc[field] += 1
        listing.write_text(json.dumps(doc))
        with mm.open(str(listing)) as s:
            s[0]
            with pytest.raises(mcf.FormatError, match="does not match") as ei:
                s.open_all()
            assert "l.json" in str(ei.value) and field in str(ei.value)
    doc = dict(doc0, dtype="int32")
    listing.write_text(json.dumps(doc))
    with mm.open(str(listing)) as s, pytest.raises(mcf.FormatError, match="dtype"):
        s[0]


@pytest.mark.parametrize("mutate,match", [
    (lambda d: "not json {", "JSON"),
    (lambda d: json.dumps([1, 2]), "not a shard list"),
    (lambda d: json.dumps(dict(d, format="other")), "not a shard list"),
    (lambda d: json.dumps(dict(d, version=9)), "version"),
    (lambda d: json.dumps(dict(d, dtype="complex64")), "dtype"),
    (lambda d: json.dumps(dict(d, dtype=[1])), "dtype"),
    (lambda d: json.dumps(dict(d, multimodal="yes")), "multimodal"),
    (lambda d: json.dumps(dict(d, shards=[])), "no shards"),
    (lambda d: json.dumps(dict(d, shards={"a": 1})), "no shards"),
    (lambda d: json.dumps(dict(d, shards=[{"prefix": 3}])), "prefix"),
    (lambda d: json.dumps(dict(d, shards=[{"prefix": "a\x00b", "sequences": 1, "documents": 1}])), "NUL"),
    (lambda d: json.dumps(dict(d, shards=[dict(d["shards"][0], sequences=-1)])), "sequences"),
    (lambda d: json.dumps(dict(d, shards=[dict(d["shards"][0], documents=1.5)])), "documents"),
    (lambda d: json.dumps(dict(d, shards=[dict(d["shards"][0], tokens=2**64)])), "tokens"),
    (lambda d: json.dumps(dict(d, sequences=10**6)), "add up"),
    (lambda d: "[" * 100000 + "]" * 100000, "JSON"),
])
def test_malformed_shard_lists(tmp_path, mutate, match):
    prefixes, _ = build_shards(tmp_path, SPEC[:2])
    listing = tmp_path / "l.json"
    write_shard_list(listing, mm.open(prefixes).shards, dtype=np.uint16)
    d = json.loads(listing.read_text())
    listing.write_text(mutate(d))
    with pytest.raises(mcf.MCFError, match=match) as ei:
        mm.open(str(listing))
    assert isinstance(ei.value, ValueError) and "l.json" in str(ei.value)


def test_verify_names_the_bad_shard(tmp_path):
    prefixes, _ = build_shards(tmp_path, SPEC)
    with open(prefixes[2] + ".bin", "r+b") as f:
        f.truncate(2)
    with mm.open(prefixes) as s:
        problems = s.verify()
    assert problems and all(p.startswith("shard 2:") for p in problems)


def test_open_many_shards_reads_headers_only(tmp_path):
    # a thousand shards: opening reads 1000 headers (no validation, no array) and binds nothing
    prefixes = []
    for k in range(1000):
        p = str(tmp_path / f"t{k:04d}")
        with mm.Writer(p, dtype=np.uint16, durable=False) as w:
            w.add_documents(np.full(3, k % 60000), [1, 2])
        prefixes.append(p)
    with mm.open(prefixes) as s:
        assert len(s) == 2000 and s.num_documents == 2000 and s.num_tokens == 3000
        assert not any(s._shard_bound(k) for k in range(1000))
        assert s[1999].tolist() == [999, 999] and s._shard_bound(999) and not s._shard_bound(998)


@st.composite
def shard_specs(draw):
    return draw(st.lists(st.lists(st.lists(st.integers(0, 6), max_size=3), max_size=4), min_size=1, max_size=6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shard_specs(), st.integers(0, 2**32 - 1))
def test_hypothesis_shards_equal_merged(tmp_path_factory, spec, seed):
    d = tmp_path_factory.mktemp("h")
    prefixes, merged = build_shards(d, spec, seed=seed)
    with mm.open(prefixes) as s, mm.open(merged) as m:
        if len(m):
            assert_same(s, m, np.random.default_rng(seed))
        else:
            assert len(s) == 0 and s.num_documents == m.num_documents
            assert s.gather([])[0].size == 0


def test_a_dataset_prefix_ending_in_json_is_not_a_shard_list(tmp_path):
    with mm.Writer(str(tmp_path / "odd.json"), dtype=np.uint16) as w:
        w.add_item([1, 2])
    with mm.open(str(tmp_path / "odd.json")) as ds:
        assert isinstance(ds, mm.IndexedDataset) and ds[0].tolist() == [1, 2]


# -- a shard list fetched from a URL names shards under its own location only -----------------------------

@pytest.fixture
def remote_corpus(tmp_path):
    """(memory:// URL of a shard list whose shards lie beside it, the local shards, the merged dataset);
    the in-memory filesystem is cleared afterwards."""
    fsspec = pytest.importorskip("fsspec", reason="URL reads need fsspec (the remote extra)")
    prefixes, merged = build_shards(tmp_path, SPEC[:3])
    with mm.open(prefixes) as s:
        shards = s.shards
    write_shard_list(tmp_path / "corpus.shards.json", shards, dtype=np.uint16)
    mem = fsspec.filesystem("memory")
    for p in prefixes:
        for ext in (".idx", ".bin"):
            mem.pipe(f"/h2corpus/{os.path.basename(p)}{ext}", Path(p + ext).read_bytes())
    doc = json.loads((tmp_path / "corpus.shards.json").read_text())
    yield mem, doc, prefixes, merged
    mem.rm("/h2corpus", recursive=True)


def _publish_list(mem, doc, prefix):
    doc = json.loads(json.dumps(doc))
    doc["shards"][1]["prefix"] = prefix
    mem.pipe("/h2corpus/list.json", json.dumps(doc).encode())
    return "memory:///h2corpus/list.json"


def test_a_remote_shard_list_reads_its_relative_shards(remote_corpus):
    mem, doc, prefixes, merged = remote_corpus
    url = _publish_list(mem, doc, doc["shards"][1]["prefix"])
    with mm.open(url) as s, mm.open(merged) as m:
        assert s.shards[1].prefix == "memory:///h2corpus/s001"
        assert_same(s, m, np.random.default_rng(3))


@pytest.mark.parametrize("kind", ["absolute", "url", "dotdot", "nested-dotdot", "encoded", "query"])
def test_a_remote_shard_list_naming_shards_elsewhere_is_refused(remote_corpus, kind):
    """An absolute local prefix, another URL or bucket, or a path climbing out of the list's location, in a
    list fetched over the network: refused naming the entry, unless the caller passes allow_outside=True."""
    mem, doc, prefixes, merged = remote_corpus
    for ext in (".idx", ".bin"):
        mem.pipe(f"/h2other/s001{ext}", Path(prefixes[1] + ext).read_bytes())
    try:
        prefix = {"absolute": prefixes[1], "url": "memory:///h2other/s001", "dotdot": "../h2other/s001",
                  "nested-dotdot": "x/../../h2other/s001", "encoded": "%2e%2e/h2other/s001",
                  "query": "s001?x=1"}[kind]
        url = _publish_list(mem, doc, prefix)
        with pytest.raises(mcf.FormatError) as ei:
            mm.open(url)
        assert ei.value.field == "shards[1].prefix" and "allow_outside=True" in str(ei.value)
        assert ei.value.path == url
        if kind in ("absolute", "url"):
            with mm.open(url, allow_outside=True) as s, mm.open(merged) as m:  # the caller trusts this list
                assert_same(s, m, np.random.default_rng(4))
    finally:
        mem.rm("/h2other", recursive=True)


def test_a_local_shard_list_may_name_any_prefix(tmp_path):
    (tmp_path / "a").mkdir()
    prefixes, merged = build_shards(tmp_path / "a", SPEC[:2])
    with mm.open(prefixes) as s:
        shards = s.shards
    (tmp_path / "lists").mkdir()
    write_shard_list(tmp_path / "lists" / "l.json", shards, dtype=np.uint16)  # outside its directory: absolute
    assert json.loads((tmp_path / "lists" / "l.json").read_text())["shards"][0]["prefix"] == prefixes[0]
    with mm.open(str(tmp_path / "lists" / "l.json")) as s, mm.open(merged) as m:
        assert_same(s, m, np.random.default_rng(5))
