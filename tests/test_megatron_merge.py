"""``mcf.megatron.merge`` / ``mcf megatron merge``: one pass over the inputs, byte-identical to Megatron-LM's
merge (its own ``IndexedDatasetBuilder.add_index`` + ``finalize``, lifted out of the megatron-core wheel),
a thousand shards with one input open at a time, and nothing published when an input is bad or changes
while it is merged."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mcf
import mcf.megatron as mm
from _megatron_ref import load_megatron_builder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def megatron(tmp_path_factory):
    try:
        return load_megatron_builder(tmp_path_factory.mktemp("megatron-core-wheel"))
    except RuntimeError as exc:  # no PyPI access, or no wheel for this Python
        pytest.skip(f"Megatron's IndexedDatasetBuilder unavailable: {exc}")


def make_shards(d, count, *, seed=0, multimodal=False, empty_every=0, max_docs=12):
    """``count`` shards of random one- and two-sequence documents (every ``empty_every``-th one empty)."""
    rng = np.random.default_rng(seed)
    os.makedirs(d, exist_ok=True)
    out = []
    for k in range(count):
        p = os.path.join(d, f"s{k:05d}")
        with mm.Writer(p, dtype=np.uint16, multimodal=multimodal, durable=False) as w:
            if not (empty_every and k % empty_every == 0):
                for _ in range(int(rng.integers(1, max_docs))):
                    lens = rng.integers(0, 40, size=int(rng.integers(1, 3)))
                    modes = rng.integers(-3, 4, size=len(lens)) if multimodal else None
                    w.add_document(rng.integers(0, 65535, size=int(lens.sum())), lens, modes)
        out.append(p)
    return out


def megatron_merge(megatron, out, prefixes, *, multimodal=False):
    """What Megatron-LM's tools/merge_datasets.py does: one builder, add_index per input, finalize."""
    b = megatron.IndexedDatasetBuilder(out + ".bin", dtype=np.uint16, multimodal=multimodal)
    for p in prefixes:
        b.add_index(p)
    b.finalize(out + ".idx")


def same_bytes(a, b):
    for ext in (".idx", ".bin"):
        with open(a + ext, "rb") as fa, open(b + ext, "rb") as fb:
            assert fa.read() == fb.read(), ext


def test_a_thousand_shards_merge_as_megatron_merges_them_one_open_at_a_time(tmp_path, megatron):
    prefixes = make_shards(tmp_path / "shards", 1000, empty_every=97)
    out = str(tmp_path / "out" / "merged")
    # the merge in a child process allowed 24 descriptors in all: the inputs are opened one at a time
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24))
        import mcf.megatron as mm
        r = mm.merge({out!r}, {[str(p) for p in prefixes]!r}, durable=False)
        print(r.inputs, r.sequence_count, r.document_count, r.token_count)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    megatron_merge(megatron, str(tmp_path / "ref"), prefixes)
    same_bytes(out, str(tmp_path / "ref"))
    with mm.open(out) as ds:
        assert r.stdout.split() == [str(x) for x in (1000, len(ds), ds.num_documents, ds.num_tokens)]
        assert ds.verify() == []
    assert sorted(os.listdir(tmp_path / "out")) == ["merged.bin", "merged.idx"]


def test_multimodal_merge_with_an_empty_shard(tmp_path, megatron):
    """An empty shard's index cannot say it is multimodal (N = 0: both layouts have one size); Megatron's
    merge reads it as multimodal because it is told so, and so must the merge of a multimodal dataset."""
    prefixes = make_shards(tmp_path, 5, multimodal=True, empty_every=2, seed=3)  # shards 0, 2, 4 empty
    mm.merge(str(tmp_path / "m"), prefixes)
    megatron_merge(megatron, str(tmp_path / "ref"), prefixes, multimodal=True)
    same_bytes(str(tmp_path / "m"), str(tmp_path / "ref"))
    with mm.open(str(tmp_path / "m")) as ds:
        assert ds.multimodal and ds.verify() == []


def test_merge_equals_megatron_for_plain_and_multimodal_inputs(tmp_path, megatron):
    for mmodal in (False, True):
        d = tmp_path / f"mm{int(mmodal)}"
        prefixes = make_shards(d, 7, multimodal=mmodal, seed=int(mmodal), max_docs=30)
        res = mm.merge(str(d / "m"), prefixes, mmap=False)
        megatron_merge(megatron, str(d / "ref"), prefixes, multimodal=mmodal)
        same_bytes(str(d / "m"), str(d / "ref"))
        assert res.multimodal is mmodal and res.prefix == str(d / "m") and res.inputs == 7


def test_a_multimodal_input_merged_after_a_plain_one_loses_its_modes_as_in_megatron(tmp_path, megatron):
    plain = make_shards(tmp_path / "p", 2, seed=5)
    modal = make_shards(tmp_path / "q", 2, seed=6, multimodal=True)
    mm.merge(str(tmp_path / "m"), plain + modal)
    megatron_merge(megatron, str(tmp_path / "ref"), plain + modal)
    same_bytes(str(tmp_path / "m"), str(tmp_path / "ref"))
    with pytest.raises(mcf.InvalidArgumentError, match="not multimodal"):
        mm.merge(str(tmp_path / "x"), modal + plain)
    assert not list(tmp_path.glob("x*")) and not list(tmp_path.glob(".x*"))


def _listing(d):
    return sorted(os.listdir(d))


def _contents(prefix):
    out = {}
    for ext in (".idx", ".bin"):
        with open(prefix + ext, "rb") as f:
            out[ext] = f.read()
    return out


def test_an_input_that_changes_while_merged_publishes_nothing(tmp_path):
    prefixes = make_shards(tmp_path, 4, seed=7)
    out = str(tmp_path / "out")
    mm.merge(out, prefixes[:1])
    before = _contents(out)
    listing = _listing(tmp_path)

    def progress(done, total, name):
        if done == 2:   # replace the third input (counted from its header a moment ago) by a longer one
            with mm.Writer(prefixes[2], dtype=np.uint16) as w:
                w.add_documents(np.arange(10), [3, 3, 4])
                w.add_documents(np.arange(7), [7])

    with pytest.raises(mcf.FormatError, match="changed while it was merged") as ei:
        mm.merge(out, prefixes, progress=progress)
    assert prefixes[2] in str(ei.value)
    assert _contents(out) == before
    assert _listing(tmp_path) == listing             # no temporary file left behind


def test_a_damaged_input_publishes_nothing_and_names_it(tmp_path):
    prefixes = make_shards(tmp_path, 3, seed=8)
    with open(prefixes[1] + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefixes[1] + ".bin") - 2)
    listing = _listing(tmp_path)
    with pytest.raises(mcf.TruncatedError) as ei:
        mm.merge(str(tmp_path / "out"), prefixes)
    assert prefixes[1] in str(ei.value)
    assert _listing(tmp_path) == listing
    with pytest.raises(mcf.MissingFileError, match="nope"):
        mm.merge(str(tmp_path / "out"), prefixes[:1] + [str(tmp_path / "nope")])
    assert _listing(tmp_path) == listing


def test_inputs_of_another_dtype_are_refused_before_anything_is_written(tmp_path):
    a = make_shards(tmp_path, 1)[0]
    with mm.Writer(str(tmp_path / "wide"), dtype=np.int32) as w:
        w.add_item([1, 2, 3])
    with pytest.raises(mcf.InvalidArgumentError, match="int32"):
        mm.merge(str(tmp_path / "out" / "m"), [a, str(tmp_path / "wide")])
    assert not (tmp_path / "out").exists()
    with pytest.raises(mcf.InvalidArgumentError, match="at least one"):
        mm.merge(str(tmp_path / "m"), [])
    with pytest.raises(mcf.InvalidArgumentError, match="prefixes"):
        mm.merge(str(tmp_path / "m"), [3])


def test_fairseq_inputs_merge_with_one_document_per_sequence(tmp_path):
    from _megatron_ref import ref_write_fairseq

    ref_write_fairseq(str(tmp_path / "f"), [[1, 2], [], [3]], 8)
    with mm.Writer(str(tmp_path / "g"), dtype=np.uint16) as w:
        w.add_document([4, 5, 6], [1, 2])
    mm.merge(str(tmp_path / "m"), [str(tmp_path / "f"), str(tmp_path / "g")])
    with mm.Writer(str(tmp_path / "one"), dtype=np.uint16) as w:
        for s in ([1, 2], [], [3]):
            w.add_document(s, [len(s)])
        w.add_document([4, 5, 6], [1, 2])
    same_bytes(str(tmp_path / "m"), str(tmp_path / "one"))
