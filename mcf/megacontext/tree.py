"""The MegaContext tree store: LOD0/LOD1/LOD2 ``.ctx`` files plus ``metadata.json`` in one directory.

One writer appends (tokens stream into LOD0 block by block; gists are appended to LOD1/LOD2 or rewritten
in place when a GistNet is retrained) while any number of readers in other processes map the files.
Every commit goes in this order, which is what makes both crash safety and concurrent reading work:

1. the new entries are written after the committed ones (invisible: the header does not count them);
2. the header's ``num_entries`` is updated, LOD0 first, then LOD1, then LOD2 (the commit point);
3. metadata.json is replaced atomically (a summary; it may lag the headers, never lead them).

A writer killed anywhere leaves, per file, a committed prefix plus maybe uncommitted bytes, and a
metadata.json that is current or one commit behind; the next open reports the difference and a writer
repairs it.  Readers read metadata.json first and the headers from LOD2 down to LOD0, the reverse of the
commit order, so the counts they see always satisfy LOD2 <= LOD1/32 <= LOD0/1024 and never exceed data
that is already in the file.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from mcf._core.fs import fsync_file, open_regular
from mcf._core import _fpconv
from mcf._core.args import index_array, integer, slice_bounds
from mcf._core._io import Source
from mcf._core.lifetime import ClosedOnExit
from mcf.errors import InvalidArgumentError, MCFError, OutOfBoundsError, TruncatedError, os_error
from mcf.megacontext import _megacontext as _mc
from mcf.megacontext._files import dir_path, level_path, not_a_dir, pwrite_all
from mcf.megacontext._layout import (COUNT_OFFSET, DEFAULT_BLOCK_SIZE, HEADER_SIZE, LEVELS, CtxDType, CtxHeader,
                                     children_of, gist_dtypes, gist_policy, parent_of, parse_header,
                                     raw_gist_dtype, span_of, token_offset)
from mcf.megacontext._lock import LOCK_FILE, RESTORE_MARKER, acquire_lock
from mcf.megacontext._validate import Level, Problem, cross_check, deep_checks, scan, stable_header
from mcf.megacontext.metadata import (METADATA, counts_of, load_metadata, new_metadata, set_range,
                                      with_counts, write_metadata, now_iso)
from mcf.remote import redact, refuse_url

__all__ = ["Tree", "Problem", "create", "open_tree", "restore", "verify", "LOCK_FILE", "RESTORE_MARKER"]

_KEEP = object()


class Tree(ClosedOnExit):
    """An open MegaContext tree directory.  Use :func:`mcf.megacontext.open` or
    :func:`mcf.megacontext.create`; close it (or use ``with``).

    Counts: ``num_tokens`` (LOD0), ``num_gists(1)``, ``num_gists(2)``.  A writer sees its own
    uncommitted appends; other processes see only what :meth:`commit` published.
    """

    def __init__(self, path, *, writable: bool = False, mmap: bool | None = None, durable: bool = False):
        if writable:
            refuse_url(path, what="opening a MegaContext tree for writing")
        self.path = dir_path(path)
        self.writable = bool(writable)
        self.durable = bool(durable)
        self._mmap = mmap
        self._lock_fd = -1
        self._levels: dict = {}
        self._closed = True
        self._dirty = False
        try:
            if self.writable:
                if not os.path.isdir(self.path):
                    raise not_a_dir(self.path)
                self._lock_fd = acquire_lock(self.path)
                from mcf.megacontext.snapshots import finish_restore

                finish_restore(self.path)
            problems = self._load()
            self._closed = False
            levels = self._levels
            h0 = levels[0].header
            self.block_size = h0.block_size
            self.embedding_dim = h0.embedding_dim
            self.gist_dtypes = {1: levels[1].header.dtype, 2: levels[2].header.dtype}
            self.gist_dtype = self.gist_dtypes[1]
            if self.writable:
                self._reconcile(problems)
        except BaseException:
            self._release()
            raise

    # -- opening ----------------------------------------------------------------------------------------
    def _load(self) -> list:
        """Scan the directory into this tree (its levels, metadata and notes) and return the problems
        found; the first error among them is raised."""
        meta, levels, problems = scan(self.path, self._mmap)
        self._levels = levels
        _raise_first_error(problems)
        self._meta = meta
        self.notes = [str(p) for p in problems]
        return problems

    def _reconcile(self, problems) -> None:
        """Make the directory agree with the committed headers (the writer's open after a crash)."""
        for lv in self._levels.values():
            try:
                lv.fd = open_regular(lv.path, os.O_RDWR)
            except OSError as exc:
                raise os_error(exc, lv.path) from None
        repaired = []
        for lv in self._levels.values():
            h = lv.header
            if h.layout == "legacy" or h.magic_order == "reversed":
                pwrite_all(lv.fd, h.pack(), 0, lv.path)
                lv.header = h = CtxHeader(level=h.level, block_size=h.block_size, embedding_dim=h.embedding_dim,
                                          dtype_code=h.dtype_code, num_entries=h.num_entries, model_name=h.model_name)
                repaired.append(f"{lv.path}: header rewritten in the canonical layout")
            if lv.tail:
                try:
                    os.ftruncate(lv.fd, HEADER_SIZE + lv.committed * h.entry_size)
                except OSError as exc:
                    raise os_error(exc, lv.path) from None
                repaired.append(f"{lv.path}: {lv.tail} uncommitted bytes discarded")
                lv.tail = 0
            lv.src.refresh()
        meta = self._meta
        counts = self.committed_counts
        stale = counts_of(meta) != counts
        for level in (1, 2):
            key = f"LOD{level}"
            ranges = meta["levels"][key]["gists"]
            covered = sum(r["stop"] - r["start"] for r in ranges)
            if covered < counts[level]:
                # gists committed by a writer that died before recording their checkpoint: unknown
                edge = max((r["stop"] for r in ranges), default=0)
                meta["levels"][key]["gists"] = set_range(ranges, edge, counts[level], None)
                stale = True
        tmp = os.path.join(self.path, METADATA + ".tmp")
        if os.path.exists(tmp):
            os.unlink(tmp)
            repaired.append(f"{tmp}: removed")
        if stale:
            self._meta = with_counts(meta, counts)
            write_metadata(self.path, dict(self._meta, last_modified=now_iso()), durable=self.durable)
            repaired.append(f"{os.path.join(self.path, METADATA)}: brought up to the committed counts {counts}")
        self.notes += [f"repaired: {r}" for r in repaired]

    # -- properties -------------------------------------------------------------------------------------
    @property
    def metadata(self) -> dict:
        """metadata.json as this process sees it (counts included; a copy)."""
        import copy

        return copy.deepcopy(with_counts(self._meta, self.counts))

    @property
    def model_name(self) -> str:
        return self._meta["model_name"]

    @property
    def vocab_size(self):
        return self._meta.get("vocab_size")

    @property
    def gistnet_checkpoint(self):
        return self._meta.get("gistnet_checkpoint")

    @property
    def ingestion_complete(self) -> bool:
        return self._meta["ingestion_complete"]

    @property
    def num_tokens(self) -> int:
        return self._levels[0].count

    @property
    def num_blocks(self) -> int:
        """Complete LOD0 blocks (a partial trailing block is not counted; it has no gist yet)."""
        return self._levels[0].count // self.block_size

    def num_gists(self, level: int) -> int:
        if integer(level, "level") not in (1, 2):   # (True and 1.0 are not level 1)
            raise InvalidArgumentError(f"gists live at levels 1 and 2, not {level!r}")
        return self._levels[level].count

    @property
    def counts(self) -> tuple:
        """(tokens, LOD1 gists, LOD2 gists) as this process sees them."""
        return tuple(self._levels[lv].count for lv in LEVELS)

    @property
    def committed_counts(self) -> tuple:
        """(tokens, LOD1 gists, LOD2 gists) as the headers on disk count them."""
        return tuple(self._levels[lv].committed for lv in LEVELS)

    def checkpoint_ranges(self, level: int) -> list:
        """``[(start, stop, checkpoint, pending)]``: which GistNet checkpoint produced which gists."""
        self.num_gists(level)
        return [(r["start"], r["stop"], r.get("gistnet_checkpoint"), r["pending"])
                for r in self._meta["levels"][f"LOD{level}"]["gists"]]

    def header(self, level: int) -> CtxHeader:
        if integer(level, "level") not in LEVELS:
            raise InvalidArgumentError(f"unknown level {level!r}")
        return self._levels[level].header.with_count(self._levels[level].committed)

    def source(self, level: int) -> Source:
        """The I/O-core source of a level's file (refreshed to cover this process's count)."""
        self.check_open()
        self.header(level)   # the level checked
        return self.level_source(level, self._levels[level].count)

    # -- offsets and spans (seed 000's formulas with this tree's geometry) -------------------------------
    def token_offset(self, block: int, token: int) -> int:
        return token_offset(block, token, self.block_size)

    def gist_offset(self, gist: int, *, level: int = 1) -> int:
        """Byte offset of gist ``gist`` in the ``level`` file (rows of one level all have the same size)."""
        self.num_gists(level)
        return HEADER_SIZE + integer(gist, "gist") * self._levels[level].header.entry_size

    def gist_dtype_of(self, level: int) -> CtxDType:
        """The dtype the gists of ``level`` are stored in (a hybrid tree: fp16 at LOD1, q8 at LOD2)."""
        self.num_gists(level)
        return self.gist_dtypes[level]

    @property
    def gist_policy(self):
        """metadata.json's ``gist_dtype``: one name for both levels, or ``{"LOD1": ..., "LOD2": ...}``."""
        return gist_policy(self.gist_dtypes)

    def span(self, level: int, index: int) -> tuple:
        """LOD0 tokens ``[start, stop)`` summarized by entry ``index`` of ``level``."""
        return span_of(level, index, self.block_size)

    def children(self, level: int, index: int) -> range:
        return children_of(level, index, self.block_size)

    def parent(self, level: int, index: int) -> int:
        return parent_of(level, index, self.block_size)

    # -- reads ------------------------------------------------------------------------------------------
    def check_open(self) -> None:
        """Raise :class:`mcf.ClosedError` when the tree is closed (what every read and write does first)."""
        if self._closed:
            from mcf.errors import ClosedError

            raise ClosedError(f"{self.path}: tree is closed")

    def level_source(self, level: int, entries: int) -> Source:
        """The open byte source of level ``level``'s file, checked to hold ``entries`` entries (refreshed
        once if another process has grown it).  For the tree's own modules (assembly, snapshots)."""
        lv = self._levels[level]
        need = HEADER_SIZE + entries * lv.header.entry_size
        if need > lv.src.size:
            lv.src.refresh()
            if need > lv.src.size:
                raise TruncatedError("the file is shorter than its committed entries (truncated by someone "
                                     "else?)", path=lv.path, expected=f">= {need} bytes", got=lv.src.size)
        return lv.src

    def _range(self, n, start, stop, what):
        start = 0 if start is None else integer(start, "start")
        stop = n if stop is None else integer(stop, "stop")
        if not 0 <= start <= stop <= n:
            raise OutOfBoundsError(f"{self.path}: {what} [{start}, {stop}) outside [0, {n})")
        return start, stop

    def tokens(self, start: int | None = None, stop: int | None = None) -> np.ndarray:
        """Token ids ``[start, stop)`` (uint32; zero-copy when mapped)."""
        self.check_open()
        start, stop = self._range(self.num_tokens, start, stop, "tokens")
        return self.level_source(0, stop).array(HEADER_SIZE + start * 4, "<u4", stop - start)

    def block(self, block: int) -> np.ndarray:
        """The token ids of LOD0 block ``block`` (fewer than block_size for the partial last block)."""
        nb = -(-self.num_tokens // self.block_size)
        b = integer(block, "block")
        if not 0 <= b < nb:
            raise OutOfBoundsError(f"{self.path}: block {b} outside [0, {nb})")
        return self.tokens(b * self.block_size, min(self.num_tokens, (b + 1) * self.block_size))

    def gist(self, level: int, index: int, *, raw: bool = False) -> np.ndarray:
        """Gist ``index`` of ``level`` as a [d] array (zero-copy when mapped; q8 rows decoded to float32),
        or with ``raw=True`` the stored row as a 0-d array of :meth:`raw_gist_dtype`."""
        n = self.num_gists(level)
        i = integer(index, "gist index")
        if not 0 <= i < n:
            raise OutOfBoundsError(f"{self.path}: LOD{level} gist {i} outside [0, {n})")
        return self.gists(level, slice(i, i + 1), raw=raw)[0, ...]

    def raw_gist_dtype(self, level: int) -> np.dtype:
        """The dtype of one stored row of ``level`` (see :func:`mcf.megacontext.raw_gist_dtype`): what
        ``gists(level, raw=True)`` returns and the only raw rows ``append_gists``/``write_gists`` take."""
        return raw_gist_dtype(self.gist_dtype_of(level), self.embedding_dim)

    def gists(self, level: int, which=None, *, raw: bool = False) -> np.ndarray:
        """Gists of ``level``: all (None), a slice (zero-copy for step 1) or any integer indices (a
        gathered copy, one compiled call).

        q8 rows are decoded to float32 (one compiled call, MCF's dequantization kernel).  ``raw=True``
        hands out the stored rows instead, for every dtype: ``[n]`` of :meth:`raw_gist_dtype`, whose
        fields name the dtype (``fp16``, ``bf16``, ``fp32``, or ``q8_scales`` + ``q8_codes``), so that
        they can only be written back to a level that stores the same dtype and width (zero-copy for a
        step-1 slice)."""
        self.check_open()
        n = self.num_gists(level)
        d = self.embedding_dim
        dt = self.gist_dtypes[level]
        rb = self._levels[level].header.entry_size
        shape_of = (lambda k: (k,)) if raw else (lambda k: (k, d))
        npdt = self.raw_gist_dtype(level) if raw else dt.numpy
        if which is None:
            which = slice(0, n)
        if isinstance(which, slice):
            start, stop, step = slice_bounds(which, n, "gist slice")
            if step == 1 and (raw or not dt.quantized):
                stop = max(stop, start)
                return self.level_source(level, stop).array(HEADER_SIZE + start * rb, npdt, shape_of(stop - start))
            which = np.arange(start, stop, step)
        ix = np.asarray(which)
        if ix.ndim == 0:
            raise InvalidArgumentError("gist indices must be a slice or a 1-D array (use gist() for one)")
        ix = index_array(ix, n, "gist indices")   # numpy's rules: integers, or a mask of n bools
        ix = np.where(ix < 0, ix + n, ix)
        out = np.empty(shape_of(ix.shape[0]), dtype=npdt)
        if dt.quantized and not raw:
            return _mc.gather_q8(self.level_source(level, n), n, d, ix, out)
        return _mc.gather_rows(self.level_source(level, n), n, rb, ix, out)

    def plan_tail(self, budget: int, recent_tokens: int):
        """The simple focus plan: see :func:`mcf.megacontext.plan_tail`."""
        from mcf.megacontext.assembly import plan_tail

        return plan_tail(self, budget, recent_tokens)

    def assemble(self, plan, embeddings=None, *, out=None, dtype=None, threads: int = 1):
        """The working context of ``plan``: see :func:`mcf.megacontext.assembly.assemble`."""
        from mcf.megacontext.assembly import assemble

        return assemble(self, plan, embeddings=embeddings, out=out, dtype=dtype, threads=threads)

    def refresh(self) -> tuple:
        """Pick up what a writer in another process committed since opening; returns the counts.

        metadata.json is read first and the headers from LOD2 down, so the counts are consistent."""
        self.check_open()
        if self.writable:
            return self.counts
        meta, errs = load_metadata(self.path)
        if errs:
            raise errs[0]
        problems = []
        expect = counts_of(meta)
        heads = {}
        for level in (2, 1, 0):
            lv = self._levels[level]
            raw = stable_header(lv.src)
            lv.src.refresh()
            heads[level] = parse_header(raw, lv.src.size, path=lv.path, expect_level=level,
                                        expect_count=expect[level])
        staged = {}
        for level, h in heads.items():
            s = Level(level, self._levels[level].path)
            s.header = h
            s.src = None
            s.tail = self._levels[level].src.size - HEADER_SIZE - h.num_entries * h.entry_size
            staged[level] = s
        cross_check(self.path, meta, staged, problems)
        _raise_first_error(problems)
        for level, h in heads.items():
            lv = self._levels[level]
            lv.header = h
            lv.committed = lv.count = h.num_entries
            lv.tail = staged[level].tail
        self._meta = meta
        return self.counts

    # -- writes -----------------------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Raise unless the tree is open and writable (``mode='r+'``)."""
        self.check_open()
        if not self.writable:
            raise InvalidArgumentError(f"{self.path}: tree is open read-only (open it with mode='r+')")

    def append_tokens(self, ids, *, commit: bool = True) -> int:
        """Append token ids (any integer array-like) to LOD0; returns the new token count.

        With ``commit=False`` the ids are written but not published (call :meth:`commit`)."""
        self.check_writable()
        a = np.asarray(ids)
        if a.ndim != 1:
            raise InvalidArgumentError(f"token ids must be 1-D, got shape {a.shape}")
        if a.size:
            if a.dtype.kind not in "iu":
                raise InvalidArgumentError(f"token ids must be integers, got {a.dtype}")
            lo, hi = int(a.min()), int(a.max())
            limit = self.vocab_size or 2**32
            if lo < 0 or hi >= limit:
                raise InvalidArgumentError(f"token ids must lie in [0, {limit}) "
                                           f"({'vocab_size' if self.vocab_size else 'uint32'}), got [{lo}, {hi}]")
        a = np.ascontiguousarray(a, dtype="<u4")
        lv = self._levels[0]
        if a.size:
            pwrite_all(lv.fd, a, HEADER_SIZE + lv.count * 4, lv.path)
            lv.count += a.size
        if commit:
            self.commit()
        return lv.count

    def _as_gist_rows(self, rows, level) -> np.ndarray:
        """The rows as the level stores them: converted (round to nearest even), quantized (q8), or
        stored rows of the level's own :meth:`raw_gist_dtype` taken as they are."""
        d = self.embedding_dim
        dt = self.gist_dtypes[level]
        a = np.asarray(rows)
        if a.dtype.type is np.void or a.dtype == np.uint8:   # (ml_dtypes' bfloat16 is kind "V" too: not this)
            return self._as_raw_rows(a, level)
        if dt.quantized:
            return self._as_q8_rows(a)
        if a.ndim == 1 and a.shape[0] == d:
            a = a.reshape(1, d)
        if a.ndim != 2 or a.shape[1] != d:
            raise InvalidArgumentError(f"gists must have shape (n, {d}), got {a.shape}")
        if a.dtype.byteorder == ">":  # big-endian values are values: read them in native order
            a = a.astype(a.dtype.newbyteorder("="))
        if a.dtype == dt.numpy or (dt.code == 2 and a.dtype == np.dtype("<u2")):
            return np.ascontiguousarray(a)
        if a.dtype == np.float64:
            if dt.code in (1, 2):  # one rounding from the exact value (float32 on the way would round twice)
                bits = (_fpconv.f64_to_f16 if dt.code == 1 else _fpconv.f64_to_bf16)(a)
                return np.ascontiguousarray(bits).view(_mc.numpy_dtype(dt.code))
            with np.errstate(over="ignore"):   # beyond float32's range is infinity, as the other levels' casts
                a = a.astype(np.float32)
        if _mc.float_code(a.dtype) < 0:
            raise InvalidArgumentError(f"gists must be float16, bfloat16 or float32 (or float64), got {a.dtype}")
        return _mc.convert(a, np.empty(a.shape, dtype=_mc.numpy_dtype(dt.code)))

    def _as_raw_rows(self, a, level) -> np.ndarray:
        """Stored rows (another tree's ``gists(raw=True)``), taken as they are when their dtype is the
        level's own stored row dtype, dtype and width both (q8 rows once their scales are checked).
        Plain bytes are refused: an fp16 row of d = 17 is as wide as a q8 row, and nothing in uint8 says
        which of the two it is."""
        want = self.raw_gist_dtype(level)
        name = self.gist_dtypes[level].name
        if a.dtype != want:
            if a.dtype == np.uint8:
                raise InvalidArgumentError(
                    f"LOD{level} gists given as uint8 bytes: bytes do not say which dtype they hold; pass stored "
                    f"rows of the level's raw_gist_dtype({level}) = {want} (what gists(level, raw=True) returns; "
                    f"rows read from a file: arr.view(tree.raw_gist_dtype({level})))")
            raise InvalidArgumentError(f"stored gist rows of dtype {a.dtype} cannot be written to LOD{level}, which "
                                       f"stores {name} rows of d = {self.embedding_dim} ({want})")
        if a.ndim > 1:
            raise InvalidArgumentError(f"stored gist rows must be a 0-d or 1-D array of {want}, got shape {a.shape}")
        a = np.ascontiguousarray(a.reshape(-1))
        if self.gist_dtypes[level].quantized:
            bad = ((a["q8_scales"].view("<u2") & 0x7C00) == 0x7C00).any(axis=1)
            if bad.any():
                raise InvalidArgumentError(f"stored q8 gist {int(np.flatnonzero(bad)[0])} has a NaN or Inf block scale")
        return a

    def _as_q8_rows(self, a) -> np.ndarray:
        """Float rows [n, d] quantized with MCF's q8 quantizer."""
        d = self.embedding_dim
        if a.ndim == 1 and a.shape[0] == d:
            a = a.reshape(1, d)
        if a.ndim != 2 or a.shape[1] != d:
            raise InvalidArgumentError(f"gists must have shape (n, {d}), got {a.shape}")
        if a.dtype.kind != "f" and _mc.float_code(a.dtype) < 0:
            raise InvalidArgumentError(f"gists must be float16, bfloat16 or float32 (or float64), got {a.dtype}")
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("="))
        if a.dtype == np.float64 and a.size and np.nanmax(np.abs(a), initial=0.0) > np.finfo(np.float32).max:
            raise InvalidArgumentError("a gist value is too large for q8 (beyond float32's range)")
        return _mc.quantize_q8(a.astype(np.float32, copy=False))

    def append_gists(self, level: int, rows, *, checkpoint=_KEEP, commit: bool = True) -> int:
        """Append gists (``[n, d]``, converted to the tree's gist dtype with round-to-nearest-even) to
        LOD1 or LOD2; returns the new count.  Only complete spans get gists: LOD1 gist i needs tokens
        [32i, 32i+32), LOD2 gist j needs LOD1 gists [32j, 32j+32).  ``checkpoint`` names the GistNet
        checkpoint that produced them (default: the tree's current ``gistnet_checkpoint``)."""
        self.check_writable()
        self.num_gists(level)
        a = self._as_gist_rows(rows, level)
        lv = self._levels[level]
        lower = self._levels[level - 1].count
        limit = lower // self.block_size
        if lv.count + a.shape[0] > limit:
            what = "tokens" if level == 1 else "LOD1 gists"
            raise InvalidArgumentError(
                f"LOD{level} would hold {lv.count + a.shape[0]} gists, but {lower} {what} make only {limit} "
                f"complete spans of {self.block_size}")
        if checkpoint is not _KEEP:
            if checkpoint is not None and not isinstance(checkpoint, str):
                raise InvalidArgumentError("checkpoint must be a string or None")
            self._meta["gistnet_checkpoint"] = checkpoint
        if a.shape[0]:
            pwrite_all(lv.fd, a, HEADER_SIZE + lv.count * lv.header.entry_size, lv.path)
            key = f"LOD{level}"
            self._meta["levels"][key]["gists"] = set_range(self._meta["levels"][key]["gists"], lv.count,
                                                           lv.count + a.shape[0], self._meta["gistnet_checkpoint"])
            lv.count += a.shape[0]
            self._dirty = True
        if commit:
            self.commit()
        return lv.count

    def write_gists(self, level: int, start: int, rows, *, checkpoint) -> None:
        """Rewrite existing gists ``[start, start+n)`` in place (same offsets), e.g. after retraining
        GistNet, and record ``checkpoint`` for them.

        metadata.json marks the range as pending before the bytes change and clears the mark after, so
        an interrupted rewrite is reported instead of silently mixing two checkpoints.  Readers in
        other processes may see a mix of old and new rows while it runs."""
        self.check_writable()
        n = self.num_gists(level)
        a = self._as_gist_rows(rows, level)
        start = integer(start, "start")
        if not 0 <= start <= start + a.shape[0] <= n:
            raise OutOfBoundsError(f"{self.path}: LOD{level} gists [{start}, {start + a.shape[0]}) outside [0, {n}); "
                                   "append_gists adds new ones")
        if checkpoint is not None and not isinstance(checkpoint, str):
            raise InvalidArgumentError("checkpoint must be a string or None")
        if not a.shape[0]:
            return
        key = f"LOD{level}"
        lv = self._levels[level]
        stop = start + a.shape[0]
        ranges = self._meta["levels"][key]["gists"]
        self._meta["levels"][key]["gists"] = set_range(ranges, start, stop, checkpoint, pending=True)
        self._write_metadata()
        pwrite_all(lv.fd, a, HEADER_SIZE + start * lv.header.entry_size, lv.path)
        if self.durable:
            os.fdatasync(lv.fd)
        self._meta["levels"][key]["gists"] = set_range(self._meta["levels"][key]["gists"], start, stop, checkpoint)
        self._meta["gistnet_checkpoint"] = checkpoint
        self._write_metadata()

    def set_ingestion_complete(self, *, done: bool = True) -> None:
        self.check_writable()
        self._meta["ingestion_complete"] = bool(done)
        self._dirty = True
        self.commit()

    def commit(self) -> tuple:
        """Publish this writer's appends: data already written, then each header's count (LOD0, LOD1,
        LOD2), then metadata.json.  Returns the committed counts."""
        self.check_writable()
        changed = False
        for level in LEVELS:
            lv = self._levels[level]
            if lv.count == lv.committed:
                continue
            if self.durable:
                os.fdatasync(lv.fd)
            pwrite_all(lv.fd, struct.pack("<Q", lv.count), COUNT_OFFSET, lv.path)
            if self.durable:
                os.fdatasync(lv.fd)
            lv.committed = lv.count
            changed = True
        if changed or self._dirty:
            self._write_metadata()
        return self.committed_counts

    def _write_metadata(self):
        self._meta["last_modified"] = now_iso()
        self._meta = with_counts(self._meta, self.committed_counts)
        write_metadata(self.path, self._meta, durable=self.durable)
        self._dirty = False

    # -- safety -----------------------------------------------------------------------------------------
    def snapshot(self, dest=None) -> str:
        """A consistent, atomic copy of the committed tree (see :func:`mcf.megacontext.snapshots.snapshot`)."""
        from mcf.megacontext.snapshots import snapshot

        return snapshot(self, dest)

    def restore(self, snapshot_dir) -> None:
        """Replace this (writable) tree's contents with a snapshot and reload."""

        self.check_writable()
        for lv in self._levels.values():
            lv.close()
        _restore(snapshot_dir, self.path, locked=True)
        self._reconcile(self._load())

    def verify(self, *, deep: bool = False) -> list:
        """Every inconsistency of the directory as it is on disk (see :func:`verify`)."""
        return verify(self.path, deep=deep, mmap=self._mmap)

    def info(self) -> dict:
        """What ``mcf ctx info`` shows (a URL as messages show it: :func:`mcf.remote.redact`)."""
        levels = {}
        for level, lv in self._levels.items():
            h = lv.header
            lv.src.refresh()
            levels[f"LOD{level}"] = {
                "file": redact(lv.path), "layout": h.layout, "magic_order": h.magic_order, "version": h.version,
                "level": h.level, "block_size": h.block_size, "embedding_dim": h.embedding_dim,
                "dtype": h.dtype.name, "dtype_code": h.dtype_code, "model_name": h.model_name,
                "num_entries": lv.committed, "entry_bytes": h.entry_size,
                "file_size_bytes": lv.src.size, "uncommitted_bytes": lv.tail,
            }
        m = self.metadata
        return {"path": redact(self.path), "model_name": m["model_name"], "embedding_dim": self.embedding_dim,
                "block_size": self.block_size, "gist_dtype": self.gist_policy, "vocab_size": self.vocab_size,
                "num_tokens": self.num_tokens, "num_blocks": self.num_blocks,
                "num_gists": {"LOD1": self.num_gists(1), "LOD2": self.num_gists(2)},
                "gistnet_checkpoint": m.get("gistnet_checkpoint"), "ingestion_complete": m["ingestion_complete"],
                "created_at": m["created_at"], "last_modified": m["last_modified"],
                "checkpoints": {k: m["levels"][k]["gists"] for k in ("LOD1", "LOD2")},
                "files": dict(sorted(levels.items())), "notes": list(self.notes)}

    # -- lifetime ---------------------------------------------------------------------------------------
    def _release(self):
        for lv in self._levels.values():
            lv.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._closed = True

    def close(self) -> None:
        """Commit a writer's pending appends, then release the files (views stay valid)."""
        if self._closed:
            return
        try:
            if self.writable:
                self.commit()
        finally:
            self._release()

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass

    def __repr__(self):
        if self._closed:
            return f"<mcf MegaContext tree {redact(self.path)!r} closed>"
        t, n1, n2 = self.counts
        return (f"<mcf MegaContext tree {redact(self.path)!r} {'r+' if self.writable else 'r'}: {t} tokens, "
                f"{n1} LOD1 + "
                f"{n2} LOD2 gists, d={self.embedding_dim} {self._policy_text()}, K={self.block_size}>")

    def _policy_text(self) -> str:
        p = self.gist_policy
        return p if isinstance(p, str) else f"LOD1 {p['LOD1']} + LOD2 {p['LOD2']}"


# -- module-level entry points ---------------------------------------------------------------------------
def _raise_first_error(problems) -> None:
    """Raise the first problem of ``problems`` that is an error (warnings only become notes)."""
    for p in problems:
        if p.severity == "error":
            raise p.error


def _check_geometry(embedding_dim, block_size):
    for name, v in (("embedding_dim", embedding_dim), ("block_size", block_size)):
        if not 1 <= integer(v, name) <= 0xFFFF:
            raise InvalidArgumentError(f"{name} must lie in 1..65535 (a u16 in the header), got {v}")


def create(path, *, embedding_dim: int, model_name: str = "", block_size: int = DEFAULT_BLOCK_SIZE,
           gist_dtype="fp16", vocab_size: int | None = None, gistnet_checkpoint: str | None = None,
           mmap: bool | None = None, durable: bool = False) -> Tree:
    """Create an empty tree in directory ``path`` (created if missing) and open it for writing.

    ``gist_dtype`` is one dtype for both gist levels ("fp16", "bf16", "fp32" or "q8": MCF's 8-bit blocks
    with one f16 scale per 32 values, about half of fp16's size), ``"hybrid"`` (LOD1 fp16, LOD2 q8: the
    fine, recent-resolution gists exact to fp16, the coarse ones quantized, as seed 000 proposes) or a
    mapping ``{1: ..., 2: ...}``.

    Refuses a directory that already holds a tree (a metadata.json).  The files are written first and
    metadata.json last, so an interrupted create leaves no tree behind."""
    _check_geometry(embedding_dim, block_size)
    gdts = gist_dtypes(gist_dtype)
    if not isinstance(model_name, str):
        raise InvalidArgumentError("model_name must be a string")
    if vocab_size is not None and not 1 <= integer(vocab_size, "vocab_size") <= 2**32:
        raise InvalidArgumentError(f"vocab_size must be in 1..2**32, got {vocab_size!r}")
    if gistnet_checkpoint is not None and not isinstance(gistnet_checkpoint, str):
        raise InvalidArgumentError("gistnet_checkpoint must be a string or None")
    refuse_url(path, what="creating a MegaContext tree")
    path = os.path.abspath(os.fspath(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, path) from None
    if os.path.exists(os.path.join(path, METADATA)):
        raise InvalidArgumentError(f"{path}: a tree already exists here (metadata.json); open it instead")
    lock = acquire_lock(path)
    try:
        for level in LEVELS:
            h = CtxHeader(level=level, block_size=int(block_size), embedding_dim=int(embedding_dim),
                          dtype_code=0 if level == 0 else gdts[level].code, num_entries=0, model_name=model_name)
            fpath = level_path(path, level)
            try:
                # a FIFO or a device planted under the name is refused, never opened (a plain open would wait)
                with os.fdopen(open_regular(fpath, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
                    f.write(h.pack())
                    if durable:
                        f.flush()
                        fsync_file(f.fileno())
            except MCFError:
                raise
            except OSError as exc:
                raise os_error(exc, fpath) from None
        meta = new_metadata(model_name=model_name, embedding_dim=int(embedding_dim), block_size=int(block_size),
                            gist_dtype=gist_policy(gdts), vocab_size=None if vocab_size is None else int(vocab_size),
                            gistnet_checkpoint=gistnet_checkpoint)
        write_metadata(path, meta, durable=durable)
    finally:
        os.close(lock)
    return Tree(path, writable=True, mmap=mmap, durable=durable)


def restore(snapshot_dir, tree_dir) -> None:
    """Replace the tree in ``tree_dir`` (created if missing) with the snapshot in ``snapshot_dir``.

    The snapshot is validated first (it must open without errors).  Takes the writer lock, so it fails
    while a writer has the tree open; readers that have it open keep reading the old files until they
    reopen."""
    _restore(snapshot_dir, tree_dir, locked=False)


def _restore(snapshot_dir, tree_dir, *, locked: bool) -> None:
    from mcf.megacontext.snapshots import restore_validated

    snapshot_dir = os.path.abspath(os.fspath(snapshot_dir))
    with Tree(snapshot_dir) as snap:
        counts = snap.committed_counts
        entry = {lv: snap._levels[lv].header.entry_size for lv in LEVELS}
        snap_meta = with_counts(snap._meta, counts)
    restore_validated(snapshot_dir, tree_dir, counts=counts, entry_sizes=entry, meta=snap_meta, locked=locked)


def open_tree(path, mode: str = "r", *, mmap: bool | None = None, durable: bool = False) -> Tree:
    """Open a tree directory: ``mode="r"`` to read (any number of processes), ``"r+"`` to write (one
    process; it repairs what a killed writer left and reports it in ``tree.notes``).  The level files are
    mapped on a local disk and read with positional reads on a network or FUSE filesystem
    (``mmap=None``, the default); ``mmap=True``/``False`` decides instead."""
    if mode not in ("r", "r+"):
        raise InvalidArgumentError(f"mode must be 'r' or 'r+', got {mode!r}")
    return Tree(path, writable=mode == "r+", mmap=mmap, durable=durable)


def verify(path, *, deep: bool = False, mmap: bool | None = None) -> list:
    """Every inconsistency of a tree directory, as :class:`Problem` objects (empty when all is well).

    Checks the headers, the counts against the file sizes and each other, metadata.json against the
    headers, the checkpoint ranges and leftovers of interrupted writes.  ``deep`` also reads all data:
    token ids against ``vocab_size`` and gists for NaN/Inf."""
    path = dir_path(path)
    meta, levels, problems = scan(path, mmap)
    try:
        if deep and not any(p.severity == "error" for p in problems):
            problems += deep_checks(path, meta, levels)
    finally:
        for lv in levels.values():
            lv.close()
    return problems
