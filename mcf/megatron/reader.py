"""Reading Megatron indexed datasets (``PREFIX.idx`` + ``PREFIX.bin``) through the shared I/O core.

Opening validates the whole index against the ``.bin`` (one compiled pass over the arrays): the
header, the counts against the exact ``.idx`` size, non-negative lengths, pointers that are the prefix
sums of the lengths, sequences inside the ``.bin``, a document index that runs from 0 to N without
decreasing, and a ``.bin`` of exactly the indexed size.  After that, per-item reads trust the index
(and still compare each range with the file size: a dataset opened with ``validate=False`` cannot
read out of bounds either).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from mcf._core.args import integer, slice_bounds
from mcf.io import Source, open_source
from mcf._core.redaction import redact
from mcf._core.lifetime import ClosedOnExit
from mcf.errors import (ArgumentTypeError, FormatError, InvalidArgumentError, MissingFileError, OutOfBoundsError,
                        TruncatedError, UnsupportedVersionError)
from mcf.megatron import _megatron
from mcf.megatron._layout import (DOC_DTYPE, FAIRSEQ_DTYPES, FAIRSEQ_HEADER, FAIRSEQ_HEADER_SIZE, HEADER,
                                  HEADER_SIZE, LENGTH_DTYPE, MAGIC, MEGATRON_DTYPES, MODE_DTYPE, POINTER_DTYPE,
                                  VERSION, Layout, layout_for)

__all__ = ["IndexedDataset", "IndexHeader", "open", "verify", "split_prefix"]

RANDOM_ADVICE_BELOW = 32 << 10  # mean sequence bytes under which the mapped .bin is advised MADV_RANDOM


def split_prefix(path) -> str:
    """``data.idx``, ``data.bin`` and ``data`` all name the dataset ``data``."""
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    for ext in (".idx", ".bin"):
        if p.endswith(ext):
            return p[: -len(ext)]
    return p


@dataclass(frozen=True)
class IndexHeader:
    """What the ``.idx`` header says, plus the variant and layout its exact size implies."""

    variant: str            # "megatron" or "fairseq"
    version: int
    dtype_code: int
    dtype: np.dtype
    sequence_count: int
    document_count: int     # len(document_indices) (documents + 1); 0 for fairseq
    multimodal: bool
    layout: Layout


def parse_header(src: Source, *, multimodal: bool | None = None) -> IndexHeader:
    """Read and check the ``.idx`` header and that the counts fit the file size exactly."""
    path = src.name
    size = src.size
    if size < FAIRSEQ_HEADER_SIZE:
        raise TruncatedError("file shorter than the .idx header", path=path, field="header", offset=0,
                             expected=f">= {FAIRSEQ_HEADER_SIZE} bytes", got=f"{size} bytes")
    magic, version, code, n = FAIRSEQ_HEADER.unpack(src.read(0, FAIRSEQ_HEADER_SIZE))
    if magic != MAGIC:
        raise FormatError("not a Megatron/fairseq index (bad magic)", path=path, field="magic", offset=0,
                          expected=MAGIC.hex(), got=magic.hex())
    if version != VERSION:
        raise UnsupportedVersionError("unsupported index version", path=path, field="version", offset=9,
                                      expected=VERSION, got=version)
    fairseq = layout_for("fairseq", n, 0, False)
    if size == fairseq.size:
        if multimodal:
            raise FormatError("multimodal=True, but the file is a fairseq index (no sequence modes)",
                              path=path, field="sequence_count", offset=18,
                              expected=layout_for("megatron", n, 1, True).size, got=size)
        if code not in FAIRSEQ_DTYPES:
            raise FormatError("unknown dtype code", path=path, field="dtype", offset=17,
                              expected=f"one of {sorted(FAIRSEQ_DTYPES)} (fairseq)", got=code)
        return IndexHeader("fairseq", version, code, FAIRSEQ_DTYPES[code], n, 0, False, fairseq)
    if size < HEADER_SIZE:
        raise TruncatedError("file shorter than the .idx header", path=path, field="header", offset=0,
                             expected=f"{HEADER_SIZE} bytes, or {fairseq.size} for a fairseq index",
                             got=f"{size} bytes")
    d = HEADER.unpack(src.read(0, HEADER_SIZE))[4]
    plain = layout_for("megatron", n, d, False)
    mm = layout_for("megatron", n, d, True)
    if multimodal is None:
        lay = plain if size == plain.size else mm if size == mm.size else None
    else:
        lay = mm if multimodal else plain
        if size != lay.size:
            other = plain if multimodal else mm
            if size == other.size and n:
                raise FormatError(
                    "multimodal=%s, but the file size says the opposite" % bool(multimodal), path=path,
                    field="sequence_count", offset=18, expected=lay.size, got=size)
            lay = None
    if lay is None:
        want = plain.size if multimodal is not True else mm.size
        alt = "" if multimodal is not None else f" ({mm.size} if multimodal)"
        cls = TruncatedError if size < want else FormatError
        raise cls(f"sequence_count={n} and document_count={d} do not fit the file size", path=path,
                  field="sequence_count", offset=18,
                  expected=f"34 + 12*N + 8*D = {want} bytes{alt}", got=f"{size} bytes")
    if d == 0:
        raise FormatError("the document index must hold at least [0]", path=path, field="document_count",
                          offset=26, expected=">= 1", got=d)
    if code not in MEGATRON_DTYPES:
        raise FormatError("unknown dtype code", path=path, field="dtype", offset=17,
                          expected=f"one of {sorted(MEGATRON_DTYPES)}", got=code)
    return IndexHeader("megatron", version, code, MEGATRON_DTYPES[code], n, d, lay.multimodal, lay)


class _Arrays:
    """Raw byte views of the index arrays (zero-copy when the .idx is mapped)."""

    def __init__(self, src: Source, h: IndexHeader):
        lay = h.layout
        whole = src.view(0, lay.size)  # zero-copy when mapped, else one read into page-aligned memory
        whole.flags.writeable = False
        self.whole = whole
        n, d = h.sequence_count, h.document_count
        self.lens = whole[lay.lengths_off:lay.lengths_off + 4 * n]
        self.ptrs = whole[lay.pointers_off:lay.pointers_off + 8 * n]
        self.docs = whole[lay.docs_off:lay.docs_off + 8 * d]
        self.modes = whole[lay.modes_off:lay.modes_off + n] if h.multimodal else None


def _scan(kernel, *args, kmax: int):
    bad = np.empty(kmax, dtype=np.int64)
    count = kernel(*args, bad)
    return count, [int(x) for x in bad[:min(count, kmax)]]


def _more(count: int, shown: int) -> str:
    return f" ({count} positions in all)" if count > shown else ""


def array_problems(h: IndexHeader, arrs: _Arrays, bin_size: int, *, idx_path: str, bin_path: str,
                   first_only: bool, kmax: int = 5) -> list:
    """Every problem of the index arrays against the .bin, as exceptions (the first one only when
    ``first_only``: then the scans stop at the first kind of problem found)."""
    out: list = []
    lay, n, d, isz = h.layout, h.sequence_count, h.document_count, h.dtype.itemsize
    k = 1 if first_only else kmax
    lens = np.frombuffer(arrs.lens, LENGTH_DTYPE) if n else np.empty(0, LENGTH_DTYPE)
    ptrs = np.frombuffer(arrs.ptrs, POINTER_DTYPE) if n else np.empty(0, POINTER_DTYPE)

    count, where = _scan(_megatron.check_lengths, arrs.lens, n, kmax=k)
    for i in where:
        out.append(FormatError("negative sequence length" + _more(count, len(where)), path=idx_path,
                               field=f"sequence_lengths[{i}]", offset=lay.lengths_off + 4 * i, expected=">= 0",
                               got=int(lens[i])))
    if out and first_only:
        return out

    if h.variant == "megatron":
        docs = np.frombuffer(arrs.docs, DOC_DTYPE)
        count, where = _scan(_megatron.check_documents, arrs.docs, d, n, kmax=k)
        for i in where:
            v = int(docs[i])
            if i == 0 and v != 0:
                reason, exp = "the document index does not start at 0", 0
            elif i > 0 and v < int(docs[:i].max()):
                reason, exp = "the document index decreases", f">= {int(docs[:i].max())}"
            elif i == d - 1 and v != n:
                reason, exp = "the document index does not end at the sequence count", n
            else:
                reason, exp = "document index outside [0, sequence_count]", f"0..{n}"
            out.append(FormatError(reason + _more(count, len(where)), path=idx_path,
                                   field=f"document_indices[{i}]", offset=lay.docs_off + 8 * i, expected=exp,
                                   got=v))
        if out and first_only:
            return out

    count, where = _scan(_megatron.check_pointers, arrs.lens, arrs.ptrs, n, isz, kmax=k)
    for i in where:
        want = 0 if i == 0 else int(ptrs[i - 1]) + int(lens[i - 1]) * isz
        out.append(FormatError("pointer is not the end of the previous sequence (pointers must be the prefix "
                               "sums of length * itemsize)" + _more(count, len(where)), path=idx_path,
                               field=f"sequence_pointers[{i}]", offset=lay.pointers_off + 8 * i, expected=want,
                               got=int(ptrs[i])))
    if out and first_only:
        return out

    count, where = _scan(_megatron.check_extents, arrs.lens, arrs.ptrs, n, isz, bin_size, kmax=k)
    for i in where:
        start, nb = int(ptrs[i]), int(lens[i]) * isz
        out.append(TruncatedError(f"sequence {i} ([{start}, {start + nb}) bytes) runs outside the .bin "
                                  f"{bin_path}" + _more(count, len(where)), path=idx_path,
                                  field=f"sequence_pointers[{i}]", offset=lay.pointers_off + 8 * i,
                                  expected=f"a range inside [0, {bin_size}]", got=start))
    if out and first_only:
        return out

    if not out:
        total = int(ptrs[-1]) + int(lens[-1]) * isz if n else 0
        if total != bin_size:
            cls = TruncatedError if bin_size < total else FormatError
            out.append(cls(".bin size does not match the index (sum of sequence_lengths * itemsize)",
                           path=bin_path, field="size", expected=f"{total} bytes", got=f"{bin_size} bytes"))
    return out


class IndexedDataset(_megatron.SequenceTable, ClosedOnExit):
    """An open Megatron (or fairseq) indexed dataset.  Use :func:`mcf.megatron.open`.

    ``ds[i]`` (negative ``i`` too) is sequence ``i`` as a read-only numpy view when the .bin is
    mapped (a fresh array otherwise); ``ds[a:b]`` a list of them; ``ds.get(i, offset, length)`` part
    of one, bounds-checked; ``ds.gather(indices)`` many at once into one flat array.  Views stay valid
    after :meth:`close`.
    """

    def __init__(self, idx, bin, *, mmap: bool | None = None, multimodal: bool | None = None, validate: bool = True,
                 prefix: str | None = None):
        self._opened: list = []
        self._is_closed = False
        self.mmap = mmap
        self.validated = bool(validate)
        self.path_prefix = prefix
        try:
            self._idx_src = self._open(idx)
            self._bin_src = self._open(bin)
            self.idx_path = self._idx_src.name
            self.bin_path = self._bin_src.name
            self.header = h = parse_header(self._idx_src, multimodal=multimodal)
            arrs = _Arrays(self._idx_src, h)
            if validate:
                problems = array_problems(h, arrs, self._bin_src.size, idx_path=self.idx_path,
                                          bin_path=self.bin_path, first_only=True)
                if problems:
                    raise problems[0]
            self._arrs = arrs
            self._bind(arrs.lens, arrs.ptrs, h.sequence_count, arrs.whole, self._bin_src, h.dtype)
        except BaseException:
            self._close_sources()
            raise
        n = self.header.sequence_count
        if self._bin_src.mode == "mmap" and n and self._bin_src.size // n < RANDOM_ADVICE_BELOW:
            # Short sequences read in random order: readahead (and fault-around) would load 128 KiB for a
            # few hundred tokens of a cold file.  Long sequences are sequential reads: keep readahead.
            self._bin_src.advise("random")

    def _open(self, obj) -> Source:
        if isinstance(obj, Source):
            return obj
        src = open_source(obj, mmap=self.mmap)
        self._opened.append(src)
        return src

    # -- metadata ---------------------------------------------------------------------------------
    @property
    def variant(self) -> str:
        return self.header.variant

    @property
    def dtype(self) -> np.dtype:
        return self.header.dtype

    @property
    def dtype_code(self) -> int:
        return self.header.dtype_code

    @property
    def multimodal(self) -> bool:
        return self.header.multimodal

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 token count of every sequence (read-only; unaligned: it starts at byte 34)."""
        n = self.header.sequence_count
        return np.frombuffer(self._arrs.lens, LENGTH_DTYPE) if n else np.empty(0, LENGTH_DTYPE)

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of every sequence in the .bin (read-only)."""
        n = self.header.sequence_count
        return np.frombuffer(self._arrs.ptrs, POINTER_DTYPE) if n else np.empty(0, POINTER_DTYPE)

    @property
    def document_indices(self) -> np.ndarray:
        """int64 ``[0, ..., N]``: document ``k`` is sequences ``[di[k], di[k+1])``.  A fairseq index has
        none; each of its sequences is reported as one document."""
        if self.header.variant == "fairseq":
            return np.arange(self.header.sequence_count + 1, dtype=np.int64)
        return np.frombuffer(self._arrs.docs, DOC_DTYPE)

    @property
    def sequence_modes(self) -> np.ndarray | None:
        """int8 mode of every sequence for multimodal datasets, else None."""
        if self._arrs.modes is None:
            return None
        return np.frombuffer(self._arrs.modes, MODE_DTYPE) if len(self._arrs.modes) else np.empty(0, MODE_DTYPE)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def document_sequences(self, k: int) -> range:
        """The sequence ids of document ``k`` (negative ``k`` counts from the end)."""
        di = self.document_indices
        nd = len(di) - 1
        kk = integer(k, "a document index")
        kk = kk + nd if kk < 0 else kk
        if not 0 <= kk < nd:
            raise OutOfBoundsError(f"document index {k} out of range for {nd} documents")
        first, stop = int(di[kk]), int(di[kk + 1])
        if not 0 <= first <= stop <= self.header.sequence_count:  # only checked at open when validated
            raise FormatError(f"document {kk} spans sequences [{first}, {stop})", path=self.idx_path,
                              field=f"document_indices[{kk}]", offset=self.header.layout.docs_off + 8 * kk,
                              expected=f"0 <= start <= stop <= {self.header.sequence_count}",
                              got=[first, stop])
        return range(first, stop)

    def document(self, k: int) -> np.ndarray:
        """All tokens of document ``k`` in one array (its sequences are adjacent in the .bin)."""
        seqs = self.document_sequences(k)
        if len(seqs) == 0:
            return np.empty(0, self.dtype)
        if len(seqs) == 1:
            return self[seqs.start]
        if self.validated:
            count = int(self.sequence_lengths[seqs.start:seqs.stop].sum(dtype=np.int64))
            return self._read_span(seqs.start, count)
        return self.gather(np.arange(seqs.start, seqs.stop))[0]

    def _read_span(self, first: int, count: int) -> np.ndarray:
        """``count`` tokens from the start of sequence ``first`` (only after validation: adjacency)."""
        off = int(self.sequence_pointers[first])
        return self._bin_src.array(off, self.dtype, count) if self._bin_src.is_mapped else \
            self._bin_src.view(off, count * self.dtype.itemsize).view(self.dtype)

    def _getitem_other(self, idx):
        if isinstance(idx, slice):
            start, stop, step = slice_bounds(idx, len(self), "sequence slice")
            if step == 1 and self.validated and stop > start and not self._bin_src.is_mapped:
                lens = self.sequence_lengths[start:stop]
                block = self._read_span(start, int(lens.sum(dtype=np.int64)))
                return np.split(block, np.cumsum(lens[:-1], dtype=np.int64))
            return [self[i] for i in range(start, stop, step)]
        raise ArgumentTypeError(f"dataset indices must be integers or slices, not {type(idx).__name__}")

    def advise(self, advice: str) -> None:
        """``madvise`` the mapped .bin: "random" (the default for datasets of short sequences),
        "sequential", "willneed", "dontneed" or "normal".  A no-op when not mapped."""
        self._bin_src.advise(advice)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    # -- lifetime ---------------------------------------------------------------------------------
    def verify(self) -> list:
        """All problems of the index against the .bin, as messages (empty when the dataset is valid)."""
        return [str(p) for p in array_problems(self.header, self._arrs, self._bin_src.size,
                                               idx_path=self.idx_path, bin_path=self.bin_path,
                                               first_only=False)]

    def _close_sources(self):
        for s in self._opened:
            s.close()
        self._opened = []

    def close(self) -> None:
        """Release both files.  Arrays handed out earlier stay valid."""
        self._is_closed = True
        self._unbind()
        self._close_sources()

    @property
    def closed(self) -> bool:
        return self._is_closed

    def __reduce__(self):
        # Reopens in the receiving process (DataLoader workers): Sources pickle as their path.
        return (_reopen, (self._idx_src, self._bin_src, self.mmap, self.header.multimodal, self.validated,
                          self.path_prefix))

    def __repr__(self):
        h = self.header
        return (f"<mcf.megatron.IndexedDataset {redact(self.path_prefix or self.idx_path)!r} {h.variant} "
                f"{h.dtype} {h.sequence_count} sequences, "
                f"{max(h.document_count - 1, 0) if h.variant == 'megatron' else h.sequence_count} documents"
                f"{', multimodal' if h.multimodal else ''}>")


def _reopen(idx, bin, mmap, multimodal, validate, prefix):
    ds = IndexedDataset(idx, bin, mmap=mmap, multimodal=multimodal, validate=validate, prefix=prefix)
    ds._opened = [ds._idx_src, ds._bin_src]
    return ds


def _sources(prefix, idx, bin):
    if prefix is not None:
        if idx is not None or bin is not None:
            raise InvalidArgumentError("pass either a prefix or idx= and bin=, not both")
        p = split_prefix(prefix)
        return p, p + ".idx", p + ".bin"
    if idx is None or bin is None:
        raise InvalidArgumentError("pass a prefix, or both idx= and bin=")
    return None, idx, bin


def open(prefix=None, *, mmap: bool | None = None, multimodal: bool | None = None, validate: bool = True,
         idx=None, bin=None):
    """Open one dataset, ``PREFIX.idx`` + ``PREFIX.bin`` (or ``idx=`` and ``bin=``): the arguments as
    :func:`mcf.megatron.open` documents them, which also opens lists of prefixes and shard lists."""
    p, i, b = _sources(prefix, idx, bin)
    try:
        return _open_pair(p, i, b, mmap, multimodal, validate)
    except (FormatError, TruncatedError, MissingFileError):
        from mcf.megatron._publish import finish_interrupted

        # a writer killed between its two renames left its intent: finish its publish, then open
        if p is None or _is_url(p) or not finish_interrupted(p):
            raise
    return _open_pair(p, i, b, mmap, multimodal, validate)


def _is_url(p) -> bool:
    from mcf.remote import is_url

    return is_url(p)


def _open_pair(p, i, b, mmap, multimodal, validate) -> IndexedDataset:
    for attempt in range(_OPEN_ATTEMPTS):
        before = _identity(i, b)
        try:
            ds = IndexedDataset(i, b, mmap=mmap, multimodal=multimodal, validate=validate, prefix=p)
        except (FormatError, TruncatedError, MissingFileError):
            after = _identity(i, b)
            if before is None or attempt == _OPEN_ATTEMPTS - 1:
                raise
            if after == before:
                if not _publishing(after):
                    raise
                time.sleep(0.001 * (attempt + 1))  # the writer is between its two renames
            continue
        if before is None or _identity(i, b) == before:
            return ds
        ds.close()  # a writer published a new dataset while this one was opening: the pair may be mixed
    raise FormatError("the dataset was replaced by a writer during every attempt to open it",
                      path=os.fspath(i), expected="one .idx/.bin pair")


_OPEN_ATTEMPTS = 8


def _publishing(identity) -> bool:
    """True when the pair looks like a writer between its two renames: the new .bin is in place
    (renamed after the .idx, or the old .idx already removed) and the new .idx is not yet."""
    idx, bin = identity
    return bin is not None and (idx is None or bin[4] > idx[4])


def _identity(idx, bin):
    """(device, inode) of both paths, to notice a writer renaming a new dataset into place while the
    pair is being opened (the two renames are not one atomic step); None for non-path inputs."""
    if not (isinstance(idx, (str, os.PathLike)) and isinstance(bin, (str, os.PathLike))):
        return None
    out = []
    for q in (idx, bin):
        try:
            st = os.stat(q)
            out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, st.st_ctime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def verify(prefix=None, *, mmap: bool | None = None, multimodal: bool | None = None, idx=None, bin=None) -> list:
    """Every problem of a dataset as a message; empty when it is valid.  A broken header stops the
    check (nothing after it can be located); the array checks all run and each reports its first
    offenders and how many there are."""
    from mcf.errors import MCFError

    p, i, b = _sources(prefix, idx, bin)
    try:
        ds = IndexedDataset(i, b, mmap=mmap, multimodal=multimodal, validate=False, prefix=p)
    except MCFError as exc:
        return [str(exc)]
    with ds:
        return ds.verify()
