"""Malformed Megatron datasets: each kind of damage raises its own MCFError subclass naming the file, the
field and the offset; ``verify`` reports every problem; truncation and fuzzing never crash."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.megatron as mm

N = 6  # sequences of the base dataset
LENS = [3, 0, 5, 2, 4, 1]
DOCS = [0, 2, 2, 5, 6]
D = len(DOCS)
LO, PO = 34, 34 + 4 * N
DO = PO + 8 * N


@pytest.fixture
def base(tmp_path):
    """A valid uint16 dataset of 6 sequences in 4 documents (one without sequences)."""
    p = str(tmp_path / "base")
    toks = iter(range(1, 100))
    with mm.Writer(p, dtype=np.uint16) as w:
        bounds = DOCS[1:]
        k = 0
        for i, ln in enumerate(LENS):
            w.add_item([next(toks) for _ in range(ln)])
            while k < len(bounds) and bounds[k] == i + 1:
                w.end_document()
                k += 1
    return p


def patched(base, tmp_path, name, idx=None, binary=None, fmt=None, at=None, value=None):
    data = bytearray(Path(base + ".idx").read_bytes())
    if fmt is not None:
        struct.pack_into(fmt, data, at, value)
    if idx is not None:
        data = idx(data)
    b = Path(base + ".bin").read_bytes()
    if binary is not None:
        b = binary(b)
    p = str(tmp_path / name)
    Path(p + ".idx").write_bytes(bytes(data))
    Path(p + ".bin").write_bytes(b)
    return p


CORRUPTIONS = [
    # name, patch kwargs, exception class, field, offset, text in the message
    ("magic", dict(fmt="<9s", at=0, value=b"MMIDIDX\x00\x01"), mcf.FormatError, "magic", 0, "bad magic"),
    ("version", dict(fmt="<Q", at=9, value=2), mcf.UnsupportedVersionError, "version", 9, "expected 1"),
    ("dtype0", dict(fmt="<B", at=17, value=0), mcf.FormatError, "dtype", 17, "unknown dtype"),
    ("dtype9", dict(fmt="<B", at=17, value=9), mcf.FormatError, "dtype", 17, "unknown dtype"),
    ("count+", dict(fmt="<Q", at=18, value=N + 1), mcf.TruncatedError, "sequence_count", 18, "do not fit"),
    ("count-", dict(fmt="<Q", at=18, value=N - 1), mcf.FormatError, "sequence_count", 18, "do not fit"),
    ("count-huge", dict(fmt="<Q", at=18, value=2**64 - 1), mcf.TruncatedError, "sequence_count", 18, "do not fit"),
    ("docs+", dict(fmt="<Q", at=26, value=D + 1), mcf.TruncatedError, "sequence_count", 18, "document_count"),
    ("negative-length", dict(fmt="<i", at=LO + 4 * 2, value=-5), mcf.FormatError, "sequence_lengths[2]", LO + 8,
     "negative"),
    ("pointer-not-prefix", dict(fmt="<q", at=PO + 8 * 3, value=14), mcf.FormatError, "sequence_pointers[3]",
     PO + 24, "prefix sums"),
    ("first-pointer", dict(fmt="<q", at=PO, value=2), mcf.FormatError, "sequence_pointers[0]", PO, "prefix sums"),
    ("doc-start", dict(fmt="<q", at=DO, value=1), mcf.FormatError, "document_indices[0]", DO, "start at 0"),
    ("doc-decrease", dict(fmt="<q", at=DO + 16, value=1), mcf.FormatError, "document_indices[2]", DO + 16,
     "decreases"),
    ("doc-end", dict(fmt="<q", at=DO + 8 * 4, value=5), mcf.FormatError, "document_indices[4]", DO + 32,
     "end at the sequence count"),
    ("doc-past", dict(fmt="<q", at=DO + 8 * 3, value=99), mcf.FormatError, "document_indices[3]", DO + 24,
     "outside"),
]


@pytest.mark.parametrize("name,kw,cls,field,offset,text", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
@pytest.mark.parametrize("mmap", [True, False])
def test_corruption_named(base, tmp_path, name, kw, cls, field, offset, text, mmap):
    p = patched(base, tmp_path, name, **kw)
    with pytest.raises(cls) as ei:
        mm.open(p, mmap=mmap)
    e = ei.value
    assert type(e) is cls
    assert isinstance(e, mcf.MCFError) and isinstance(e, ValueError)
    assert e.field == field and e.offset == offset
    assert text in str(e) and p + ".idx" in str(e)
    problems = mm.verify(p, mmap=mmap)
    assert problems and any(field in q for q in problems)
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is cls and str(e2) == str(e) and e2.field == field


def test_pointer_past_bin(base, tmp_path):
    # consistent prefix sums, but the lengths run past the .bin: a longer last sequence
    p = patched(base, tmp_path, "past", fmt="<i", at=LO + 4 * 5, value=1000)
    with pytest.raises(mcf.TruncatedError) as ei:
        mm.open(p)
    assert ei.value.field == "sequence_pointers[5]" and "runs outside the .bin" in str(ei.value)
    # a pointer far past the end with a prefix break before it
    p = patched(base, tmp_path, "past2", fmt="<q", at=PO + 8 * 5, value=2**62)
    problems = mm.verify(p)
    assert any("sequence_pointers[5]" in q and "prefix sums" in q for q in problems)
    assert any("runs outside" in q for q in problems)


@pytest.mark.parametrize("change,cls,text", [(lambda b: b + b"\0\0", mcf.FormatError, "does not match"),
                                             (lambda b: b[:-2], mcf.TruncatedError, "runs outside"),
                                             (lambda b: b"", mcf.TruncatedError, "runs outside")])
def test_bin_size_mismatch(base, tmp_path, change, cls, text):
    p = patched(base, tmp_path, "binsize", binary=change)
    with pytest.raises(cls, match=text):
        mm.open(p)
    assert mm.verify(p)


def test_bin_larger_names_the_bin(base, tmp_path):
    p = patched(base, tmp_path, "big", binary=lambda b: b + b"\0\0")
    with pytest.raises(mcf.FormatError) as ei:
        mm.open(p)
    assert ei.value.path == p + ".bin" and ei.value.field == "size" and "30 bytes" in str(ei.value)


def test_verify_reports_every_problem(base, tmp_path):
    def damage(d):
        struct.pack_into("<i", d, LO + 4 * 1, -2)        # negative length
        struct.pack_into("<q", d, DO, 3)                 # document index does not start at 0
        struct.pack_into("<q", d, PO + 8 * 2, 77)        # pointer breaks the prefix sums
        struct.pack_into("<q", d, PO + 8 * 4, 10**6)     # and runs past the .bin
        return d

    p = patched(base, tmp_path, "many", idx=damage)
    problems = mm.verify(p)
    for what in ("sequence_lengths[1]", "document_indices[0]", "sequence_pointers[2]", "runs outside"):
        assert any(what in q for q in problems), (what, problems)
    assert len(problems) >= 5
    from mcf.cli import main

    assert main(["megatron", "verify", p]) == 1


def test_short_and_empty_idx(tmp_path):
    for size in (0, 8, 25, 30, 33):
        p = str(tmp_path / f"s{size}")
        Path(p + ".idx").write_bytes((b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 0, 1))[:size])
        Path(p + ".bin").write_bytes(b"")
        with pytest.raises(mcf.TruncatedError) as ei:
            mm.open(p)
        assert ei.value.field in ("header",) and ei.value.offset == 0
    p = str(tmp_path / "d0")
    Path(p + ".idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 0, 0))
    Path(p + ".bin").write_bytes(b"")
    with pytest.raises(mcf.FormatError, match="at least"):
        mm.open(p)


def test_missing_files(tmp_path):
    with pytest.raises(mcf.MissingFileError):
        mm.open(str(tmp_path / "nothing"))
    assert "nothing" in mm.verify(str(tmp_path / "nothing"))[0]


def test_every_truncation_raises(base, tmp_path):
    full = Path(base + ".idx").read_bytes()
    for cut in range(len(full)):
        p = str(tmp_path / "t")
        Path(p + ".idx").write_bytes(full[:cut])
        Path(p + ".bin").write_bytes(Path(base + ".bin").read_bytes())
        with pytest.raises(mcf.MCFError):
            mm.open(p)
        assert mm.verify(p)


def test_validate_false_still_bounds_checked(base, tmp_path):
    p = patched(base, tmp_path, "nv", fmt="<q", at=PO + 8 * 2, value=2**40)
    with mm.open(p, validate=False) as ds:
        assert ds[0].tolist() == [1, 2, 3]
        with pytest.raises(mcf.OutOfBoundsError):
            ds[2]
        with pytest.raises(mcf.OutOfBoundsError):
            ds.gather([0, 2])
        with pytest.raises(mcf.OutOfBoundsError):
            ds.get(2, 1, 1)
        assert ds.verify()
    p = patched(base, tmp_path, "nv2", fmt="<i", at=LO + 4, value=-7)
    with mm.open(p, validate=False) as ds:
        for bad in (lambda: ds[1], lambda: ds.gather([1]), lambda: ds.document(0), lambda: ds.get(1)):
            with pytest.raises(mcf.OutOfBoundsError):
                bad()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 34 + 12 * N + 8 * D - 1), st.integers(0, 255)), min_size=1, max_size=6),
       st.booleans())
def test_fuzz_idx_bytes(base, tmp_path, flips, mmap):
    data = bytearray(Path(base + ".idx").read_bytes())
    for at, v in flips:
        data[at] = v
    p = str(tmp_path / "fz")
    Path(p + ".idx").write_bytes(bytes(data))
    Path(p + ".bin").write_bytes(Path(base + ".bin").read_bytes())
    try:
        ds = mm.open(p, mmap=mmap)
    except mcf.MCFError as exc:
        assert str(exc)
        assert mm.verify(p)
        return
    with ds:
        assert ds.verify() == []
        for i in range(len(ds)):
            ds[i]
        ds.gather(np.arange(len(ds)))
        for k in range(ds.num_documents):
            ds.document(k)
