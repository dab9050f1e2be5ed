"""Megatron datasets: our writer against a plain-Python Megatron-style writer (byte for byte), our reader
against a plain-numpy reader, in every I/O mode; hypothesis round trips; merge equals one build."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.megatron as mm
from _megatron_ref import ref_read, ref_write, ref_write_fairseq
from mcf.megatron import writer as mwriter

DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16]


def random_documents(rng, n_docs=30, max_seqs=4, max_len=50, dtype=np.uint16, modes=False):
    docs = []
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    for _ in range(n_docs):
        doc = []
        for _ in range(int(rng.integers(0, max_seqs + 1))):
            ln = int(rng.integers(0, max_len))
            if info is not None:
                toks = rng.integers(info.min, info.max, ln, endpoint=True, dtype=dtype)
            else:
                toks = rng.standard_normal(ln).astype(dtype)
            doc.append((toks, int(rng.integers(-128, 128)) if modes else 0))
        docs.append(doc)
    return docs


def write_ours(prefix, docs, dtype, multimodal=False, style="items"):
    with mm.Writer(prefix, dtype=dtype, multimodal=multimodal) as w:
        for doc in docs:
            if style == "items":
                for toks, mode in doc:
                    w.add_item(toks, mode)
                w.end_document()
            else:
                flat = np.concatenate([t for t, _ in doc]) if doc else np.empty(0, dtype)
                w.add_document(flat, [len(t) for t, _ in doc], [m for _, m in doc] if multimodal else None)


def open_modes(prefix):
    """The same dataset through every kind of source the I/O core offers."""
    yield "mmap", mm.open(prefix)
    yield "pread", mm.open(prefix, mmap=False)
    idx, binf = open(prefix + ".idx", "rb"), open(prefix + ".bin", "rb")
    try:
        yield "fileobj", mm.open(idx=idx, bin=binf)
    finally:
        idx.close()
        binf.close()
    yield "memory", mm.open(idx=memoryview(bytearray(Path(prefix + ".idx").read_bytes())),
                            bin=memoryview(bytearray(Path(prefix + ".bin").read_bytes())))


def check_against_reference(ds, ref, docs=None, multimodal=False):
    assert len(ds) == len(ref["lengths"])
    assert ds.dtype == ref["dtype"]
    assert np.array_equal(ds.sequence_lengths, ref["lengths"])
    assert np.array_equal(ds.sequence_pointers, ref["pointers"])
    if ref["docs"] is not None:
        assert np.array_equal(ds.document_indices, ref["docs"])
    if multimodal:
        assert np.array_equal(ds.sequence_modes, ref["modes"])
    else:
        assert ds.sequence_modes is None
    for i, s in enumerate(ref["seqs"]):
        assert ds[i].tobytes() == s.tobytes()
        assert ds[i - len(ds)].tobytes() == s.tobytes()
    if len(ds):
        idx = np.random.default_rng(0).integers(-len(ds), len(ds), 50)
        flat, offs = ds.gather(idx)
        want = [ref["seqs"][int(i)] for i in idx]
        assert flat.tobytes() == b"".join(w.tobytes() for w in want)
        assert np.array_equal(np.diff(offs), [len(w) for w in want])
    if docs is not None:
        assert ds.num_documents == len(docs)
        for k, doc in enumerate(docs):
            want = b"".join(np.asarray(t).tobytes() for t, _ in doc)
            assert ds.document(k).tobytes() == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("multimodal", [False, True])
def test_writer_bytes_equal_megatron_builder(tmp_path, dtype, multimodal):
    rng = np.random.default_rng(7)
    docs = random_documents(rng, dtype=dtype, modes=multimodal)
    ref_write(str(tmp_path / "ref"), docs, dtype, multimodal)
    for style in ("items", "document"):
        write_ours(str(tmp_path / style), docs, dtype, multimodal, style)
        for ext in (".idx", ".bin"):
            assert (tmp_path / (style + ext)).read_bytes() == (tmp_path / ("ref" + ext)).read_bytes(), (style, ext)
    ref = ref_read(str(tmp_path / "ref"), multimodal)
    for mode, ds in open_modes(str(tmp_path / "items")):
        with ds:
            assert ds.multimodal == multimodal, mode
            check_against_reference(ds, ref, docs, multimodal)


def test_empty_dataset(tmp_path):
    p = str(tmp_path / "empty")
    with mm.Writer(p, dtype=np.uint16):
        pass
    ref_write(str(tmp_path / "ref"), [], np.uint16)
    assert os.path.getsize(p + ".idx") == 42 and os.path.getsize(p + ".bin") == 0
    assert Path(p + ".idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    for _mode, ds in open_modes(p):
        with ds:
            assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0
            assert ds.verify() == []
            assert ds[:] == []
            flat, offs = ds.gather([])
            assert flat.size == 0 and offs.tolist() == [0]
            with pytest.raises(mcf.OutOfBoundsError):
                ds[0]


def test_empty_sequences_and_documents(tmp_path):
    p = str(tmp_path / "e")
    with mm.Writer(p, dtype=np.int32) as w:
        w.end_document()                      # a document without sequences
        w.add_item([])                        # an empty sequence
        w.end_document()
        w.add_document([], [0, 0])
        w.add_item([7])                       # left open: finalize closes it
    with mm.open(p) as ds:
        assert ds.document_indices.tolist() == [0, 0, 1, 3, 4]
        assert [len(ds[i]) for i in range(len(ds))] == [0, 0, 0, 1]
        assert ds.document(0).size == 0 and ds.document(3).tolist() == [7]
        assert ds.verify() == []
        assert ds.get(3, 1).size == 0
        assert ds.get(0, 0, 0).size == 0


def test_api_details(tmp_path):
    p = str(tmp_path / "a")
    docs = [[(np.arange(5), 0), (np.arange(5, 9), 0)], [(np.arange(100, 103), 0)]]
    write_ours(p, docs, np.uint16)
    for spelled in (p, p + ".idx", p + ".bin", Path(p + ".idx")):
        with mm.open(spelled) as ds:
            assert ds.path_prefix == p
    with mm.open(p) as ds:
        assert ds[0].flags.writeable is False
        assert ds[1:3][0].tolist() == [5, 6, 7, 8] and len(ds[::2]) == 2 and ds[-1:][0].tolist() == [100, 101, 102]
        assert ds[np.int64(2)].tolist() == [100, 101, 102]
        assert ds.get(0, 2, 2).tolist() == [2, 3] and ds.get(-3, 3).tolist() == [3, 4]
        assert ds.document(0).tolist() == list(range(9)) and ds.document(-1).tolist() == [100, 101, 102]
        assert ds.document_sequences(0) == range(0, 2)
        assert [a.tolist() for a in ds] == [list(range(5)), [5, 6, 7, 8], [100, 101, 102]]
        assert ds.num_tokens == 12 and ds.variant == "megatron" and ds.dtype_code == 8
        out = np.zeros(20, np.uint16)
        flat, offs = ds.gather([2, 0], out=out)
        assert flat.tolist() == [100, 101, 102, 0, 1, 2, 3, 4] and np.shares_memory(flat, out)
        assert offs.tolist() == [0, 3, 8]
        with pytest.raises(mcf.InvalidArgumentError):
            ds.gather([0], out=np.zeros(2, np.uint16))
        with pytest.raises(mcf.InvalidArgumentError):
            ds.gather([0], out=np.zeros(20, np.int32))
        with pytest.raises(TypeError):
            ds["x"]
        for bad in (lambda: ds[3], lambda: ds[-4], lambda: ds.get(0, 6), lambda: ds.get(0, 2, 4),
                    lambda: ds.get(0, -1), lambda: ds.get(0, 0, -1), lambda: ds.gather([0, 3]),
                    lambda: ds.gather([-4]), lambda: ds.document(2), lambda: ds.document_sequences(-3)):
            with pytest.raises(mcf.OutOfBoundsError):
                bad()
        kept = ds[0]
        ds2 = pickle.loads(pickle.dumps(ds))
        assert ds2[2].tolist() == [100, 101, 102]
        ds2.close()
    assert kept.tolist() == list(range(5))  # views outlive close
    with pytest.raises(mcf.ClosedError):
        ds[0]
    with pytest.raises(mcf.ClosedError):
        ds.gather([0])
    assert ds.closed
    assert "3 sequences" in repr(mm.open(p))


def test_gather_large_and_pread(tmp_path):
    rng = np.random.default_rng(3)
    p = str(tmp_path / "g")
    lens = rng.integers(0, 5000, 300)
    toks = rng.integers(0, 2**31 - 1, int(lens.sum()), dtype=np.int32)
    with mm.Writer(p, dtype=np.int32) as w:
        w.add_documents(toks, lens)
    ref = ref_read(p)
    idx = rng.integers(0, 300, 1000)
    want = np.concatenate([ref["seqs"][i] for i in idx])
    for mmap in (True, False):
        with mm.open(p, mmap=mmap) as ds:
            flat, offs = ds.gather(idx)
            assert np.array_equal(flat, want)
            assert offs[-1] == want.size
            assert [a.tolist() for a in ds[10:20]] == [s.tolist() for s in ref["seqs"][10:20]]


@pytest.mark.parametrize("code,dtype", [(4, np.int32), (8, np.uint16), (9, np.uint32), (10, np.uint64),
                                        (7, np.float64), (6, np.float64), (1, np.uint8)])
def test_fairseq_variant(tmp_path, code, dtype):
    rng = np.random.default_rng(code)
    seqs = [rng.integers(0, 200, int(rng.integers(0, 30))).astype(dtype) for _ in range(25)]
    p = str(tmp_path / "fs")
    ref_write_fairseq(p, seqs, code)
    assert os.path.getsize(p + ".idx") == 26 + 12 * 25
    ref = ref_read(p)
    for _mode, ds in open_modes(p):
        with ds:
            assert ds.variant == "fairseq" and ds.dtype == np.dtype(dtype) and ds.dtype_code == code
            assert ds.document_indices.tolist() == list(range(26))
            assert ds.verify() == []
            check_against_reference(ds, ref)
    ref_write_fairseq(str(tmp_path / "fs0"), [], 9)
    with mm.open(str(tmp_path / "fs0")) as ds:
        assert len(ds) == 0 and ds.variant == "fairseq"
    with pytest.raises(mcf.FormatError, match="fairseq"):
        mm.open(p, multimodal=True)


def test_multimodal_given_or_detected(tmp_path):
    rng = np.random.default_rng(1)
    docs = random_documents(rng, modes=True)
    write_ours(str(tmp_path / "mm"), docs, np.uint16, True)
    write_ours(str(tmp_path / "plain"), docs, np.uint16, False)
    with mm.open(str(tmp_path / "mm")) as ds:
        assert ds.multimodal and ds.sequence_modes.tolist() == [m for d in docs for _, m in d]
    with mm.open(str(tmp_path / "mm"), multimodal=True) as ds:
        assert ds.multimodal
    with pytest.raises(mcf.FormatError, match="multimodal"):
        mm.open(str(tmp_path / "mm"), multimodal=False)
    with pytest.raises(mcf.FormatError, match="multimodal"):
        mm.open(str(tmp_path / "plain"), multimodal=True)


def test_dtype_rules():
    assert mm.dtype_for_vocab(65499) == np.uint16 and mm.dtype_for_vocab(65500) == np.int32
    assert mm.dtype_for_vocab(65536, "datatrove") == np.uint16 and mm.dtype_for_vocab(65537, "datatrove") == np.int32
    with pytest.raises(mcf.InvalidArgumentError):
        mm.dtype_for_vocab(10, "gpt")
    with pytest.raises(mcf.InvalidArgumentError):
        mm.Writer("/nonexistent-dir/x", dtype=np.uint32)


@pytest.mark.parametrize("dtype,bad", [(np.uint16, [1, 65536]), (np.uint16, [-1]), (np.int32, [2**31]),
                                       (np.uint8, np.array([256], np.int64)), (np.int8, np.array([200], np.uint8)),
                                       (np.int16, np.array([2**63 - 1], np.uint64)), (np.int64, [2**64 - 1])])
def test_token_range_checked(tmp_path, dtype, bad):
    with mm.Writer(str(tmp_path / "r"), dtype=dtype) as w:
        w.add_item([1, 2])
        with pytest.raises(mcf.InvalidArgumentError, match="does not fit|integers"):
            w.add_item(bad)
        with pytest.raises(mcf.InvalidArgumentError):
            w.add_document(bad, [len(bad)])
    with mm.open(str(tmp_path / "r")) as ds:  # the failed calls left nothing behind
        assert len(ds) == 1 and ds[0].tolist() == [1, 2]


def test_writer_argument_errors(tmp_path):
    w = mm.Writer(str(tmp_path / "w"), dtype=np.uint16, multimodal=True)
    for bad in (lambda: w.add_item([1.5]), lambda: w.add_item(["a"]), lambda: w.add_item([1], mode=300),
                lambda: w.add_document([1, 2], [3]), lambda: w.add_document([1, 2], [-1, 3]),
                lambda: w.add_document([1, 2], [2], modes=[1, 2]), lambda: w.add_documents([1, 2], [1]),
                lambda: w.add_documents([1], [1], empty="x")):
        with pytest.raises(mcf.InvalidArgumentError):
            bad()
    w.abort()
    assert not list(tmp_path.iterdir())
    with pytest.raises(mcf.InvalidArgumentError):
        w.add_item([1])
    with pytest.raises(mcf.InvalidArgumentError):
        mm.Writer(str(tmp_path / "w"), dtype=np.uint16, vocab_size=10)


def test_gather_follows_numpy_index_rules(tmp_path):
    """A boolean mask selects (it used to read as sequences 1, 0, 0, 0, 1); floats are refused (gather
    read sequence 2 for 2.9 while ds[2.9] raised); uint64 beyond int64 is not wrapped to -1."""
    p = str(tmp_path / "g")
    with mm.Writer(p, dtype=np.int32) as w:
        for k in range(5):
            w.add_item(np.full(k + 1, k, np.int32))
    with mm.open(p) as ds:
        seqs = [ds[i].tolist() for i in range(5)]
        for mask in (np.array([True, False, False, False, True]), [True, False, False, False, True]):
            flat, offs = ds.gather(mask)
            assert flat.tolist() == seqs[0] + seqs[4] and offs.tolist() == [0, 1, 6]
        assert ds.gather(np.zeros(5, bool))[1].tolist() == [0]
        assert ds.gather([])[1].tolist() == [0]
        for ints in ([4, -5, 2], np.array([4, 0, 2], np.uint8), np.array([1, 1], np.int16), range(3)):
            flat, _ = ds.gather(ints)
            assert flat.tolist() == sum((seqs[i] for i in ints), [])
        for bad in ([2.9], np.array([2.0]), np.array([True, False]), ["1"], [[0, 1]], np.array([1 + 0j])):
            with pytest.raises(mcf.InvalidArgumentError):
                ds.gather(bad)
        with pytest.raises(mcf.OutOfBoundsError):
            ds.gather(np.array([2**64 - 1], np.uint64))
        with pytest.raises(mcf.OutOfBoundsError):
            ds.gather([2**70])
        with pytest.raises(TypeError):
            ds[2.9]
        for bad in (lambda: ds.get(2.9), lambda: ds.get(True), lambda: ds.get(0, 0.0),
                    lambda: ds.get(1, 0, 1.0), lambda: ds.get(np.float64(1))):
            with pytest.raises(mcf.InvalidArgumentError, match="must be an integer"):
                bad()
        assert ds.get(np.int8(4), np.uint16(1), np.int64(2)).tolist() == [4, 4]
        with pytest.raises(mcf.OutOfBoundsError):
            ds.get(2**70)


def test_lengths_and_modes_must_be_integers(tmp_path):
    """``lengths=[2.9, 3.9]`` used to be stored as [2, 3]."""
    w = mm.Writer(str(tmp_path / "w"), dtype=np.uint16, multimodal=True)
    for bad in (lambda: w.add_document([1, 2, 3, 4, 5], [2.9, 3.9]),
                lambda: w.add_document([1, 2, 3, 4, 5], np.array([2.0, 3.0])),
                lambda: w.add_document([1, 2], [True, True]),
                lambda: w.add_document([1, 2], [2], modes=[0.5]),
                lambda: w.add_documents([1, 2, 3, 4, 5], [2.9, 3.9]),
                lambda: w.add_item([1], mode=1.5), lambda: w.add_item([1], mode=True)):
        with pytest.raises(mcf.InvalidArgumentError, match="integer"):
            bad()
    w.add_document([1, 2, 3], np.array([1, 2], np.uint8), modes=(np.int8(3), 4))
    w.add_documents(np.arange(3), [np.int64(1), 2])
    w.finalize()
    with mm.open(str(tmp_path / "w")) as ds:
        assert ds.sequence_lengths.tolist() == [1, 2, 1, 2] and ds.sequence_modes.tolist() == [3, 4, 0, 0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_datasets_refuse_ids_they_cannot_hold_exactly(tmp_path, dtype):
    """A float32 dataset stored id 16777217 as 16777216.0; an integer dataset refuses an id outside
    its range, a float one now refuses an id it would round."""
    big = 2**24 + 1 if dtype == np.float32 else 2**53 + 1
    with mm.Writer(str(tmp_path / "f"), dtype=dtype) as w:
        ok = [0, 1, -7, 2**24, 2**30, big - 1, 2**62]
        w.add_item(ok)
        w.add_item(np.array([0.5, -2.0**100, np.inf, -np.inf], np.float64))
        w.add_item(np.array([np.nan], np.float32))
        bad_items = [[big], np.array([big], np.int64), np.array([2**64 - 1], np.uint64), [2**63 - 1]]
        if dtype == np.float32:
            bad_items += [np.array([0.1]), np.array([1e300])]
        for bad in bad_items:
            with pytest.raises(mcf.InvalidArgumentError, match="exactly"):
                w.add_item(bad)
            with pytest.raises(mcf.InvalidArgumentError, match="exactly"):
                w.add_documents(bad, [np.size(bad)])
    with mm.open(str(tmp_path / "f")) as ds:
        assert len(ds) == 3 and ds[0].tolist() == [float(x) for x in ok]
        assert np.isnan(ds[2][0])


def test_atomic_finalize(tmp_path):
    p = str(tmp_path / "at")
    write_ours(p, [[(np.arange(3), 0)]], np.uint16)
    before = (Path(p + ".idx").read_bytes(), Path(p + ".bin").read_bytes())
    with pytest.raises(RuntimeError):
        with mm.Writer(p, dtype=np.uint16) as w:
            w.add_item(np.arange(100))
            raise RuntimeError("interrupted")
    assert (Path(p + ".idx").read_bytes(), Path(p + ".bin").read_bytes()) == before
    assert sorted(os.listdir(tmp_path)) == ["at.bin", "at.idx"]
    with mm.Writer(p, dtype=np.uint16, atomic=False) as w:
        w.add_item([9])
    with mm.open(p) as ds:
        assert ds[0].tolist() == [9]
    with mm.Writer(p, dtype=np.uint16, durable=False) as w:
        w.add_item([8, 7])
    with mm.open(p) as ds:
        assert ds[0].tolist() == [8, 7]
    assert sorted(os.listdir(tmp_path)) == ["at.bin", "at.idx"]


def test_merge_equals_single_build(tmp_path, monkeypatch):
    rng = np.random.default_rng(11)
    shards = [random_documents(rng, n_docs=int(rng.integers(0, 40)), modes=True) for _ in range(6)]
    for k, docs in enumerate(shards):
        write_ours(str(tmp_path / f"s{k}"), docs, np.uint16, True)
    write_ours(str(tmp_path / "single"), [d for s in shards for d in s], np.uint16, True)
    # force the spill-to-disk path of every column with a tiny memory limit
    orig = mwriter._Column.__init__
    monkeypatch.setattr(mwriter._Column, "__init__", lambda self, dt, d, limit=64: orig(self, dt, d, limit))
    mm.merge(str(tmp_path / "merged"), [str(tmp_path / f"s{k}") for k in range(6)])
    for ext in (".idx", ".bin"):
        assert (tmp_path / ("merged" + ext)).read_bytes() == (tmp_path / ("single" + ext)).read_bytes()
    # Megatron's add_index: sequences added before are kept, shards of another dtype refused
    with mm.Writer(str(tmp_path / "mix"), dtype=np.uint16, multimodal=True) as w:
        w.add_item([1, 2], 3)
        w.end_document()
        with mm.open(str(tmp_path / "s1")) as ds:
            w.add_index(ds)
        write_ours(str(tmp_path / "i32"), [[(np.arange(2), 0)]], np.int32)
        with pytest.raises(mcf.InvalidArgumentError, match="dtype"):
            w.add_index(str(tmp_path / "i32"))
        write_ours(str(tmp_path / "nomm"), [[(np.arange(2), 0)]], np.uint16, False)
        with pytest.raises(mcf.InvalidArgumentError, match="multimodal"):
            w.add_index(str(tmp_path / "nomm"))
    with mm.open(str(tmp_path / "mix")) as ds, mm.open(str(tmp_path / "s1")) as s1:
        assert ds[0].tolist() == [1, 2] and ds.sequence_modes[0] == 3
        assert len(ds) == 1 + len(s1) and ds.verify() == []
        assert all(ds[i + 1].tolist() == s1[i].tolist() for i in range(len(s1)))
    with pytest.raises(mcf.InvalidArgumentError):
        mm.merge(str(tmp_path / "none"), [])


def test_merge_pread_and_fileobj_copy_path(tmp_path):
    rng = np.random.default_rng(5)
    docs = random_documents(rng, n_docs=20)
    write_ours(str(tmp_path / "a"), docs, np.uint16)
    with mm.Writer(str(tmp_path / "m"), dtype=np.uint16) as w:
        w.add_index(str(tmp_path / "a"), mmap=False)
        with open(str(tmp_path / "a.idx"), "rb") as fi, open(str(tmp_path / "a.bin"), "rb") as fb:
            w.add_index(mm.open(idx=io.BytesIO(fi.read()), bin=io.BytesIO(fb.read())))
    write_ours(str(tmp_path / "aa"), docs + docs, np.uint16)
    assert (tmp_path / "m.bin").read_bytes() == (tmp_path / "aa.bin").read_bytes()
    assert (tmp_path / "m.idx").read_bytes() == (tmp_path / "aa.idx").read_bytes()


@st.composite
def datasets(draw):
    dtype = draw(st.sampled_from([np.uint16, np.int32, np.uint8, np.int64]))
    info = np.iinfo(dtype)
    tok = st.integers(int(info.min), int(info.max))
    seq = st.lists(tok, max_size=20)
    docs = draw(st.lists(st.lists(st.tuples(seq, st.integers(-128, 127)), max_size=4), max_size=12))
    return dtype, [[(np.array(t, dtype=dtype), m) for t, m in d] for d in docs], draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(datasets())
def test_hypothesis_round_trip(tmp_path, case):
    dtype, docs, multimodal = case
    p = str(tmp_path / "h")
    write_ours(p, docs, dtype, multimodal, "items")
    ref_write(str(tmp_path / "hr"), docs, dtype, multimodal)
    assert Path(p + ".idx").read_bytes() == (tmp_path / "hr.idx").read_bytes()
    assert Path(p + ".bin").read_bytes() == (tmp_path / "hr.bin").read_bytes()
    ref = ref_read(p, multimodal)
    for mmap in (True, False):
        with mm.open(p, mmap=mmap, multimodal=multimodal) as ds:
            assert ds.verify() == []
            check_against_reference(ds, ref, docs, multimodal)


def _child_killed_between_renames(prefix: str, n: int) -> None:
    """Runs in a child process: publish a dataset of ``n`` items and die (SIGKILL) right after the .bin
    rename, before the .idx one: the state a kill at that instant leaves."""
    import signal

    import mcf.megatron.writer as W

    real = os.replace
    calls = []

    def replace(a, b):
        real(a, b)
        calls.append(b)
        if b.endswith(".bin"):
            os.kill(os.getpid(), signal.SIGKILL)

    W.os.replace = replace
    with mcf.megatron.Writer(prefix, dtype="int32") as w:
        for k in range(n):
            w.add_item(np.arange(k + 1, dtype=np.int32))


def test_a_publish_killed_between_its_renames_is_finished_by_the_next_reader(tmp_path):
    import multiprocessing as mp

    prefix = str(tmp_path / "ds")
    with mcf.megatron.Writer(prefix, dtype="int32") as w:
        w.add_item(np.arange(3, dtype=np.int32))
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_child_killed_between_renames, args=(prefix, 5))
    p.start()
    p.join(60)
    assert p.exitcode == -9
    assert os.path.exists(prefix + ".publish")              # the intent survived the kill, unlocked
    with mcf.megatron.open(prefix) as ds:                   # rolled forward: the new dataset, whole
        assert len(ds) == 5 and np.array_equal(ds[4], np.arange(5))
    assert not os.path.exists(prefix + ".publish")
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]


def test_a_live_publish_is_never_rolled_forward_by_a_reader(tmp_path):
    """finish_interrupted leaves an intent alone while its writer holds the lock."""
    from mcf.megatron._publish import Intent, finish_interrupted

    prefix = str(tmp_path / "ds")
    (tmp_path / "a.tmp").write_bytes(b"x")
    with Intent(prefix, [(str(tmp_path / "a.tmp"), str(tmp_path / "a"))], durable=False):
        assert finish_interrupted(prefix) is False
        assert (tmp_path / "a.tmp").exists()
    assert finish_interrupted(prefix) is True                # the holder is gone (here: closed without done())
    assert (tmp_path / "a").read_bytes() == b"x" and not (tmp_path / "ds.publish").exists()
