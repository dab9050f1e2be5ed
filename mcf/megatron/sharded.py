"""Many Megatron datasets read as one, without merging them: global sequence and document numbering.

A distributed tokenization (``mcf.conversion.raydata``) produces hundreds or thousands of shards; Megatron
itself can train on them as a blend (``--data-path``), but a reader that wants one dataset (sample
indices over the whole corpus, a data loader, an inspection) would otherwise have to merge them first.
:class:`ShardedDataset` is that one dataset: ``ds[i]``, ``get``, ``gather``, ``document``,
``sequence_lengths`` and ``document_indices`` answer exactly as they would on the merged file, and
:class:`mcf.megatron.GPTSamples` and :func:`mcf.megatron.build_sample_idx` work on it unchanged.

Opening costs no scan of the data.  From a shard list (the JSON file the Ray commit step writes) the
sequence, document and token counts are read from the list itself; from a list of prefixes only each
``.idx`` header (34 bytes) is read.  A shard is opened, and validated as :func:`mcf.megatron.open`
validates a single dataset, the first time a read touches it, and its counts are then checked against
what the list or header promised.  The per-item path (locate the shard by a binary search over the
starts, then read as a single dataset does) is compiled (``_megatron.ShardTable``).

A shard list is JSON::

    {"format": "mcf.megatron.shards", "version": 1, "dtype": "uint16", "multimodal": false,
     "sequences": 7, "documents": 5, "tokens": 30,
     "shards": [{"prefix": "corpus.shards/g000000000000-000000000000-000000000003-end",
                 "sequences": 4, "documents": 3, "tokens": 17}, ...],
     "megatron_data_path": "17 /abs/corpus.shards/g... 13 /abs/corpus.shards/g..."}

Relative prefixes are relative to the list's directory.  ``megatron_data_path`` is the same shards
as Megatron-LM's ``--data-path`` blend, each weighted by its token count.

A list fetched from a URL is data from wherever it was fetched: its prefixes must be relative paths of
plain names under the list's own location (no absolute path, no URL, no ``..``, no ``?``, ``#``, ``%``
or ``\\``), or a list on a web server could make the reader open local files of the machine
(``/etc/...``, a training set's private prefixes), other servers or other buckets with the caller's
credentials.  ``allow_outside=True`` (of :func:`mcf.megatron.open`, :func:`open_shards` and
:func:`read_shard_list`) accepts such prefixes from a list the caller trusts.  A local list is the
caller's own file and may name any prefix.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
from dataclasses import dataclass

import numpy as np

from mcf.io import open_source
from mcf._core.args import integer, slice_bounds
from mcf._core.lifetime import ClosedOnExit
from mcf.errors import ArgumentTypeError, FormatError, InvalidArgumentError, OutOfBoundsError
from mcf.megatron import _megatron
from mcf.megatron._layout import DOC_DTYPE, LENGTH_DTYPE, MEGATRON_DTYPES, MODE_DTYPE, dtype_code

__all__ = ["Shard", "ShardedDataset", "open_shards", "read_shard_list", "write_shard_list", "is_shard_list",
           "SHARD_LIST_FORMAT"]

SHARD_LIST_FORMAT = "mcf.megatron.shards"
SHARD_LIST_VERSION = 1
SHARD_LIST_MAX_BYTES = 1 << 30     # a list of a million shards is ~200 MB of JSON
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Shard:
    """One dataset of a :class:`ShardedDataset`: its prefix and counts (``tokens`` None when unknown
    until the shard is opened)."""

    prefix: str
    sequences: int
    documents: int
    tokens: int | None = None


def is_shard_list(obj) -> bool:
    """True for a path naming a JSON shard list (``*.json``, unless it is the prefix of a local dataset
    ``*.json.idx``)."""
    if isinstance(obj, (str, os.PathLike)):
        p = os.fspath(obj)
        return isinstance(p, str) and p.lower().endswith(".json") and not os.path.exists(p + ".idx")
    return False


def _count(v, name: str, path: str, field: str) -> int:
    if type(v) is not int or not 0 <= v <= _INT64_MAX:
        raise FormatError(f"{name} must be a non-negative integer", path=path, field=field, got=repr(v)[:80])
    return v


_UNSAFE_IN_URL_PREFIX = ("?", "#", "%", "\\")


def _outside(pre: str) -> str | None:
    """Why prefix ``pre`` of a shard list read from a URL reaches outside the list's location (None when
    it is a relative path of plain names)."""
    from mcf.remote import is_url

    if is_url(pre) or "://" in pre:
        return "names a URL"
    if pre.startswith("/") or os.path.isabs(pre):
        return "is an absolute path"
    if any(part in ("", ".", "..") for part in pre.split("/")):
        return "has an empty, '.' or '..' component"
    if any(c in pre for c in _UNSAFE_IN_URL_PREFIX) or any(ord(c) < 0x20 or ord(c) == 0x7F for c in pre):
        return "holds '?', '#', '%', '\\' or a control character"
    return None


def read_shard_list(path, *, allow_outside: bool = False) -> tuple[list, dict]:
    """``(shards, meta)`` of a shard list; ``meta`` holds ``dtype`` (a numpy dtype) and ``multimodal``.
    Every field is checked: a hand-edited or truncated list gives a :class:`mcf.FormatError`.  A list
    read from a URL may only name prefixes relative to its own location (a :class:`mcf.FormatError`
    naming the entry otherwise) unless ``allow_outside`` (see the module docstring)."""
    from mcf.remote import is_url, redact

    p = os.fspath(path)
    where = redact(p) if is_url(p) else p  # what messages name: never a URL's credentials
    src = open_source(p, mmap=False)
    try:
        if src.size > SHARD_LIST_MAX_BYTES:
            raise FormatError("shard list too large", path=where, field="size", expected=f"<= {SHARD_LIST_MAX_BYTES}",
                              got=src.size)
        raw = bytes(src.read(0, src.size))
    finally:
        src.close()
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"not a JSON shard list: {exc}", path=where) from None
    if not isinstance(doc, dict) or doc.get("format") != SHARD_LIST_FORMAT:
        raise FormatError("not a shard list", path=where, field="format", expected=SHARD_LIST_FORMAT,
                          got=repr(doc.get("format") if isinstance(doc, dict) else type(doc).__name__)[:80])
    if doc.get("version") != SHARD_LIST_VERSION:
        from mcf.errors import UnsupportedVersionError

        raise UnsupportedVersionError("unsupported shard list version", path=where, field="version",
                                      expected=SHARD_LIST_VERSION, got=repr(doc.get("version"))[:40])
    try:
        dtype = np.dtype(doc.get("dtype"))
        dtype_code(dtype)
    except (TypeError, ValueError, InvalidArgumentError):
        raise FormatError("unknown token dtype", path=where, field="dtype",
                          expected="one of " + ", ".join(str(d) for d in MEGATRON_DTYPES.values()),
                          got=repr(doc.get("dtype"))[:40]) from None
    multimodal = doc.get("multimodal", False)
    if not isinstance(multimodal, bool):
        raise FormatError("multimodal must be true or false", path=where, field="multimodal", got=repr(multimodal)[:40])
    entries = doc.get("shards")
    if not isinstance(entries, list) or not entries:
        raise FormatError("no shards", path=where, field="shards", expected="a non-empty list")
    base = p.rsplit("/", 1)[0] if is_url(p) else os.path.dirname(os.path.abspath(p))
    shards = []
    for i, e in enumerate(entries):
        f = f"shards[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("prefix"), str) or not e["prefix"]:
            raise FormatError("a shard needs a prefix", path=where, field=f + ".prefix")
        pre = e["prefix"]
        if "\x00" in pre:
            raise FormatError("NUL in a prefix", path=where, field=f + ".prefix")
        why = _outside(pre) if is_url(p) and not allow_outside else None
        if why is not None:
            raise FormatError(f"a shard list read from a URL names prefixes relative to its own location; "
                              f"this one {why} (pass allow_outside=True to open it anyway)", path=where,
                              field=f + ".prefix", got=repr(redact(pre))[:200])
        if not (is_url(pre) or os.path.isabs(pre)):
            pre = f"{base}/{pre}" if is_url(p) else os.path.join(base, pre)
        tokens = e.get("tokens")
        shards.append(Shard(pre, _count(e.get("sequences"), "sequences", where, f + ".sequences"),
                            _count(e.get("documents"), "documents", where, f + ".documents"),
                            None if tokens is None else _count(tokens, "tokens", where, f + ".tokens")))
    for key, field in (("sequences", "sequences"), ("documents", "documents"), ("tokens", "tokens")):
        if key in doc and doc[key] is not None:
            vals = [getattr(s, field) for s in shards]
            if None not in vals and _count(doc[key], key, where, key) != sum(vals):
                raise FormatError(f"the shards' {key} do not add up to the total", path=where, field=key,
                                  expected=sum(vals), got=doc[key])
    return shards, {"dtype": dtype, "multimodal": multimodal}


def write_shard_list(path, shards, *, dtype, multimodal: bool = False, relative: bool = True) -> None:
    """Write a shard list atomically (temporary file + rename).  Prefixes under the list's directory
    are stored relative to it when ``relative`` (the directory can then be moved as a whole)."""
    from mcf._core.fs import write_atomic, write_all

    p = os.path.abspath(os.fspath(path))
    d = os.path.dirname(p)
    entries, weighted = [], []
    for s in shards:
        absprefix = os.path.abspath(s.prefix)
        rel = os.path.relpath(absprefix, d)
        stored = rel if relative and not rel.startswith("..") else absprefix
        entries.append({"prefix": stored, "sequences": int(s.sequences), "documents": int(s.documents),
                        "tokens": None if s.tokens is None else int(s.tokens)})
        weighted.append(f"{int(s.tokens) if s.tokens is not None else 1} {absprefix}")
    doc = {"format": SHARD_LIST_FORMAT, "version": SHARD_LIST_VERSION, "dtype": str(np.dtype(dtype)),
           "multimodal": bool(multimodal),
           "sequences": sum(int(s.sequences) for s in shards), "documents": sum(int(s.documents) for s in shards),
           "tokens": None if any(s.tokens is None for s in shards) else sum(int(s.tokens) for s in shards),
           "shards": entries, "megatron_data_path": " ".join(weighted)}
    data = (json.dumps(doc, indent=1) + "\n").encode("utf-8")
    write_atomic(p, lambda fd: write_all(fd, data), durable=True)


def _shards_from_headers(prefixes, multimodal):
    """Shards and their common dtype from each ``.idx`` header (and the ``.bin`` size of local files)."""
    from mcf.megatron.reader import parse_header, split_prefix
    from mcf.remote import is_url

    shards, dtype, mm = [], None, None
    for obj in prefixes:
        if not isinstance(obj, (str, os.PathLike)):
            raise InvalidArgumentError(f"shards are named by prefixes (str or os.PathLike), not {type(obj).__name__}")
        p = split_prefix(obj)
        src = open_source(p + ".idx", mmap=False)
        try:
            h = parse_header(src, multimodal=multimodal)
        finally:
            src.close()
        if dtype is None:
            dtype, mm = h.dtype, h.multimodal
        elif h.dtype != dtype:
            raise InvalidArgumentError(f"{p}: dtype {h.dtype} differs from the first shard's {dtype}")
        elif h.multimodal != mm:
            raise InvalidArgumentError(f"{p}: {'' if h.multimodal else 'not '}multimodal, unlike the first shard")
        docs = h.document_count - 1 if h.variant == "megatron" else h.sequence_count
        tokens = None
        if not is_url(p):
            try:
                nb = os.stat(p + ".bin").st_size
                tokens = nb // h.dtype.itemsize if nb % h.dtype.itemsize == 0 else None
            except OSError:
                tokens = None    # opening the shard reports it
        shards.append(Shard(p, h.sequence_count, docs, tokens))
    return shards, dtype, bool(mm)


def open_shards(obj, *, mmap: bool | None = None, multimodal: bool | None = None, validate: bool = True,
                allow_outside: bool = False) -> "ShardedDataset":
    """One read-only dataset over a shard list file (``*.json``) or a list of dataset prefixes.
    ``allow_outside``: a shard list read from a URL may name prefixes outside its own location (see the
    module docstring; refused by default)."""
    if is_shard_list(obj):
        shards, meta = read_shard_list(obj, allow_outside=allow_outside)
        if multimodal is not None and bool(multimodal) != meta["multimodal"]:
            raise InvalidArgumentError(f"{os.fspath(obj)}: multimodal={multimodal}, but the shard list says "
                                       f"{meta['multimodal']}")
        return ShardedDataset(shards, dtype=meta["dtype"], multimodal=meta["multimodal"], mmap=mmap,
                              validate=validate, shard_list=os.fspath(obj))
    if isinstance(obj, (str, bytes, os.PathLike)):
        raise InvalidArgumentError("open_shards takes a shard list (*.json) or a list of prefixes")
    prefixes = list(obj)
    if not prefixes:
        raise InvalidArgumentError("no shards given")
    shards, dtype, mm = _shards_from_headers(prefixes, multimodal)
    return ShardedDataset(shards, dtype=dtype, multimodal=mm, mmap=mmap, validate=validate)


class ShardedDataset(_megatron.ShardTable, ClosedOnExit):
    """Several Megatron datasets read as their concatenation (read-only; nothing is merged).

    Sequence ``i`` and document ``k`` are numbered as in the merged dataset.  ``ds[i]``, ``ds[a:b]``,
    ``get``, ``gather``, ``document``, ``document_sequences``, ``sequence_lengths``,
    ``document_indices``, ``sequence_modes``, ``len`` and pickling behave as on an
    :class:`~mcf.megatron.IndexedDataset`; there is no global ``sequence_pointers`` (each shard has its
    own ``.bin``): :meth:`locate` and :meth:`shard` reach a shard's own arrays.  Shards are opened on
    first use (see the module docstring); :meth:`open_all` opens them all now.
    """

    def __init__(self, shards, *, dtype, multimodal: bool = False, mmap: bool | None = None, validate: bool = True,
                 shard_list: str | None = None):
        self.shards = tuple(shards)
        if not self.shards:
            raise InvalidArgumentError("no shards given")
        self._dtype_ = np.dtype(dtype)
        self.multimodal = bool(multimodal)
        self.mmap = mmap
        self.validated = bool(validate)
        self.shard_list = shard_list
        seq = np.zeros(len(self.shards) + 1, np.int64)
        np.cumsum([s.sequences for s in self.shards], out=seq[1:])
        doc = np.zeros(len(self.shards) + 1, np.int64)
        np.cumsum([s.documents for s in self.shards], out=doc[1:])
        self.sequence_starts = seq
        self.document_starts = doc
        self._doc_starts_list = doc.tolist()
        self._datasets: list = [None] * len(self.shards)
        self._lock = threading.Lock()
        self._is_closed = False
        self._cache: dict = {}
        self._init_table(seq, self._dtype_)

    # -- shards -----------------------------------------------------------------------------------
    def _where(self) -> str:
        return self.shard_list or "the shard list"

    def _open_shard(self, k: int) -> None:
        """Open, validate and bind shard ``k`` (called by the compiled table on first touch)."""
        from mcf.megatron.reader import open as open_dataset

        with self._lock:
            if self._is_closed:
                from mcf.errors import ClosedError

                raise ClosedError("the dataset is closed")
            if self._shard_bound(k):
                return
            sh = self.shards[k]
            ds = open_dataset(sh.prefix, mmap=self.mmap, multimodal=self.multimodal, validate=self.validated)
            try:
                got = {"dtype": ds.dtype, "sequences": len(ds), "documents": ds.num_documents}
                want = {"dtype": self._dtype_, "sequences": sh.sequences, "documents": sh.documents}
                if sh.tokens is not None:
                    got["tokens"] = ds._bin_src.size // ds.dtype.itemsize
                    want["tokens"] = sh.tokens
                for key in want:
                    if got[key] != want[key]:
                        raise FormatError(f"shard {k} ({sh.prefix}) does not match {self._where()}",
                                          path=ds.idx_path, field=key, expected=want[key], got=got[key])
                self._bind_shard(k, ds._arrs.lens, ds._arrs.ptrs, len(ds), ds._arrs.whole, ds._bin_src, ds.dtype)
            except BaseException:
                ds.close()
                raise
            self._datasets[k] = ds

    def shard(self, k: int):
        """The open :class:`~mcf.megatron.IndexedDataset` of shard ``k`` (opened now if need be)."""
        nk = len(self.shards)
        kk = integer(k, "a shard index")
        kk = kk + nk if kk < 0 else kk
        if not 0 <= kk < nk:
            raise OutOfBoundsError(f"shard {k} out of range for {nk} shards")
        if self._datasets[kk] is None:
            self._open_shard(kk)
        return self._datasets[kk]

    def locate(self, i: int) -> tuple:
        """``(shard, sequence id within the shard)`` of global sequence ``i``."""
        return self._locate_sequence(i)

    def open_all(self) -> "ShardedDataset":
        """Open (and validate) every shard now instead of on first use."""
        for k in range(len(self.shards)):
            self.shard(k)
        return self

    # -- metadata ---------------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        return self._dtype_

    @property
    def dtype_code(self) -> int:
        return dtype_code(self._dtype_)

    @property
    def variant(self) -> str:
        return "sharded"

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def num_documents(self) -> int:
        return int(self.document_starts[-1])

    @property
    def num_tokens(self) -> int:
        if all(s.tokens is not None for s in self.shards):
            return sum(s.tokens for s in self.shards)
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def _concat(self, name: str, pick, dtype, first=None):
        got = self._cache.get(name)
        if got is None:
            parts = [] if first is None else [first]
            for k in range(len(self.shards)):
                parts.append(pick(k, self.shard(k)))
            got = np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
            got.flags.writeable = False
            self._cache[name] = got
        return got

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 token count of every sequence, all shards in order (built on first use: it opens every
        shard; read-only)."""
        return self._concat("lengths", lambda k, ds: ds.sequence_lengths, LENGTH_DTYPE)

    @property
    def document_indices(self) -> np.ndarray:
        """int64 ``[0, ..., N]`` as in the merged dataset (built on first use, read-only)."""
        starts = self.sequence_starts
        return self._concat("documents", lambda k, ds: ds.document_indices[1:] + starts[k], DOC_DTYPE,
                            first=np.zeros(1, DOC_DTYPE))

    @property
    def sequence_modes(self) -> np.ndarray | None:
        """int8 mode of every sequence for multimodal shards, else None."""
        if not self.multimodal:
            return None
        return self._concat("modes", lambda k, ds: ds.sequence_modes, MODE_DTYPE)

    def _document_shard(self, k: int) -> tuple:
        nd = self.num_documents
        kk = integer(k, "a document index")
        kk = kk + nd if kk < 0 else kk
        if not 0 <= kk < nd:
            raise OutOfBoundsError(f"document index {k} out of range for {nd} documents")
        s = bisect.bisect_right(self._doc_starts_list, kk) - 1
        return s, kk - self._doc_starts_list[s]

    def document_sequences(self, k: int) -> range:
        """The global sequence ids of document ``k`` (negative ``k`` counts from the end)."""
        s, local = self._document_shard(k)
        r = self.shard(s).document_sequences(local)
        off = int(self.sequence_starts[s])
        return range(r.start + off, r.stop + off)

    def document(self, k: int) -> np.ndarray:
        """All tokens of document ``k`` in one array."""
        s, local = self._document_shard(k)
        return self.shard(s).document(local)

    def _getitem_other(self, idx):
        if isinstance(idx, slice):
            return [self[i] for i in range(*slice_bounds(idx, len(self), "sequence slice"))]
        raise ArgumentTypeError(f"dataset indices must be integers or slices, not {type(idx).__name__}")

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def advise(self, advice: str) -> None:
        """``madvise`` the mapped ``.bin`` of every shard opened so far."""
        for ds in self._datasets:
            if ds is not None:
                ds.advise(advice)

    # -- lifetime ---------------------------------------------------------------------------------
    def verify(self) -> list:
        """Every problem of every shard, and every count that differs from the list, as messages."""
        from mcf.megatron.reader import verify as verify_one

        out = []
        for k, sh in enumerate(self.shards):
            problems = verify_one(sh.prefix, mmap=self.mmap, multimodal=self.multimodal)
            if problems:
                out += [f"shard {k}: {p}" for p in problems]
                continue
            try:
                self.shard(k)
            except (FormatError, InvalidArgumentError) as exc:
                out.append(f"shard {k}: {exc}")
        return out

    def close(self) -> None:
        """Release every shard.  Arrays handed out earlier stay valid."""
        with self._lock:
            self._is_closed = True
            self._unbind()
            dss, self._datasets = self._datasets, [None] * len(self.shards)
        for ds in dss:
            if ds is not None:
                ds.close()
        self._cache = {}

    @property
    def closed(self) -> bool:
        return self._is_closed

    def __reduce__(self):
        # Reopens lazily in the receiving process (DataLoader workers, Ray tasks).
        return (_reopen, (self.shards, str(self._dtype_), self.multimodal, self.mmap, self.validated,
                          self.shard_list))

    def __repr__(self):
        return (f"<mcf.megatron.ShardedDataset {self.shard_list or ''} {len(self.shards)} shards, {self._dtype_} "
                f"{len(self)} sequences, {self.num_documents} documents{', multimodal' if self.multimodal else ''}>")


def _reopen(shards, dtype, multimodal, mmap, validate, shard_list):
    return ShardedDataset(shards, dtype=dtype, multimodal=multimodal, mmap=mmap, validate=validate,
                          shard_list=shard_list)
