"""Validation of a MegaContext tree directory: reading each level's header, cross-checking the levels,
metadata.json and the file sizes, and the deep data checks of ``verify(deep=True)``.

Nothing here raises on a bad tree: every finding is a :class:`Problem`, and the caller decides (opening
raises the first error; :func:`mcf.megacontext.verify` returns them all).
"""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass

import numpy as np

from mcf.io import Source, open_source
from mcf.errors import FormatError, MCFError, MCFIOError, TruncatedError
from mcf.megacontext._files import level_path, not_a_dir
from mcf.megacontext._layout import (COUNT_OFFSET, HEADER_SIZE, LEVEL_FILES, CtxHeader, encode_model_name, gist_dtypes,
                                     parse_header)
from mcf.megacontext._lock import RESTORE_MARKER
from mcf.remote._urls import join_path
from mcf.megacontext.metadata import METADATA, counts_of, load_metadata
from mcf.remote import is_url

__all__ = ["Level", "Problem", "cross_check", "deep_checks", "read_level", "scan", "stable_header"]


@dataclass(frozen=True)
class Problem:
    """One finding of :func:`verify` (or of opening): ``severity`` is ``"error"`` (the tree cannot be
    trusted as is), ``"warning"`` (an inconsistency that a writer's open repairs, e.g. after a killed
    writer) or ``"note"`` (worth knowing, not wrong: a legacy header, reversed magic)."""

    severity: str
    error: MCFError

    def __str__(self) -> str:
        return f"{self.severity}: {self.error}"


class Level:
    """One .ctx file as the tree sees it."""

    __slots__ = ("level", "path", "src", "fd", "header", "committed", "count", "tail")

    def __init__(self, level: int, path: str):
        self.level = level
        self.path = path
        self.src: Source | None = None
        self.fd = -1
        self.header: CtxHeader | None = None
        self.committed = 0   # entries counted by the header on disk
        self.count = 0       # entries this process sees (committed + its own uncommitted appends)
        self.tail = 0        # bytes after the committed entries (an uncommitted append)

    def close(self):
        if self.src is not None:
            self.src.close()
            self.src = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def stable_header(src: Source) -> bytes:
    """The header bytes, read until two reads agree (a writer may be updating the count)."""
    n = min(HEADER_SIZE, src.size)
    raw = src.read(0, n)
    for _ in range(100):
        again = src.read(0, n)
        if again == raw:
            return raw
        raw = again
    return raw


def read_level(dirpath, level, mmap, expect_count, problems) -> Level:
    """Open and parse one level's file; a failure becomes an error in ``problems`` (the Level has no header)."""
    lv = Level(level, level_path(dirpath, level))
    try:
        lv.src = open_source(lv.path, mmap=mmap)
        raw = stable_header(lv.src)
        # the data of every counted entry was written before the count: refresh after reading it
        lv.src.refresh()
        lv.header = parse_header(raw, lv.src.size, path=lv.path, expect_level=level, expect_count=expect_count)
    except MCFError as exc:
        problems.append(Problem("error", exc))
        return lv
    h = lv.header
    lv.committed = lv.count = h.num_entries
    lv.tail = lv.src.size - HEADER_SIZE - h.num_entries * h.entry_size
    if h.layout == "legacy":
        problems.append(Problem("note", FormatError(
            "legacy header layout (seed 001: model_name at 14, no count; the count comes from the file size)",
            path=lv.path, field="header", offset=0)))
    if h.magic_order == "reversed":
        problems.append(Problem("note", FormatError("magic in reversed byte order (4D 43 43 54)", path=lv.path,
                                                    field="magic", offset=0)))
    return lv


def cross_check(dirpath, meta, levels, problems) -> None:
    """Geometry, counts and metadata against each other; appends to ``problems``."""
    heads = {k: v.header for k, v in levels.items() if v.header is not None}
    mpath = join_path(dirpath, METADATA)
    ref = heads.get(0) or next(iter(heads.values()), None)
    for lv, h in sorted(heads.items()):
        path = levels[lv].path
        for field, off in (("block_size", 8), ("embedding_dim", 10)):
            if ref is not None and getattr(h, field) != getattr(ref, field):
                problems.append(Problem("error", FormatError(
                    f"{field} differs from {LEVEL_FILES[ref.level]}'s", path=path, field=field, offset=off,
                    expected=getattr(ref, field), got=getattr(h, field))))
            if meta is not None and getattr(h, field) != meta[field]:
                problems.append(Problem("error", FormatError(
                    f"{field} differs from metadata.json's", path=path, field=field, offset=off,
                    expected=meta[field], got=getattr(h, field))))
        if lv > 0 and meta is not None and h.dtype.code != gist_dtypes(meta["gist_dtype"])[lv].code:
            problems.append(Problem("error", FormatError(
                f"LOD{lv}'s gist dtype differs from metadata.json's gist_dtype", path=path, field="dtype_code",
                offset=12, expected=gist_dtypes(meta["gist_dtype"])[lv].name, got=h.dtype.name)))
        if meta is not None and encode_model_name(h.model_name) != encode_model_name(meta["model_name"]):
            problems.append(Problem("warning", FormatError(
                "model_name differs from metadata.json's", path=path, field="model_name",
                offset=14 if h.layout == "legacy" else 22, expected=meta["model_name"], got=h.model_name)))
    k = ref.block_size if ref is not None else None
    for lv, what in ((1, "more LOD1 gists than LOD0 blocks"), (2, "more LOD2 gists than groups of LOD1 gists")):
        if not (k and lv - 1 in heads and lv in heads):
            continue
        below, n = heads[lv - 1].num_entries, heads[lv].num_entries
        if n > math.ceil(below / k):
            problems.append(Problem("error", FormatError(
                what, path=levels[lv].path, field="num_entries", offset=COUNT_OFFSET,
                expected=f"<= ceil({below} / {k}) = {math.ceil(below / k)}", got=n)))
        elif lv == 1 and n > below // k:  # a gist of the partial LOD0 block (docs/megacontext.md)
            problems.append(Problem("warning", FormatError(
                "the partial trailing LOD0 block has a gist", path=levels[1].path, field="num_entries",
                offset=COUNT_OFFSET, expected=f"<= {below // k}", got=n)))
    for lv, h in heads.items():
        what = "tokens" if lv == 0 else "gists"
        if levels[lv].tail > 0:
            problems.append(Problem("warning", TruncatedError(
                f"{levels[lv].tail} bytes after the {h.num_entries} committed {what} (an append that was "
                "never committed: the writer stopped before updating the header)", path=levels[lv].path,
                field="num_entries", offset=COUNT_OFFSET, expected=HEADER_SIZE + h.num_entries * h.entry_size,
                got=HEADER_SIZE + h.num_entries * h.entry_size + levels[lv].tail)))
        if meta is None:
            continue
        m = counts_of(meta)[lv]
        if m > h.num_entries:
            problems.append(Problem("error", FormatError(
                f"metadata.json counts more {what} than {LEVEL_FILES[lv]} commits", path=mpath,
                field=f"levels.LOD{lv}", expected=f"<= {h.num_entries}", got=m)))
        elif m < h.num_entries:
            problems.append(Problem("warning", FormatError(
                f"metadata.json is behind {LEVEL_FILES[lv]} (the writer stopped after committing the header and "
                "before rewriting metadata.json)", path=mpath, field=f"levels.LOD{lv}", expected=h.num_entries,
                got=m)))
        if lv > 0:
            ranges = meta["levels"][f"LOD{lv}"]["gists"]
            covered = sum(r["stop"] - r["start"] for r in ranges)
            if covered < h.num_entries:
                problems.append(Problem("warning", FormatError(
                    f"{h.num_entries - covered} gists have no recorded GistNet checkpoint", path=mpath,
                    field=f"levels.LOD{lv}.gists", expected=h.num_entries, got=covered)))
            for r in ranges:
                if r["pending"]:
                    problems.append(Problem("warning", FormatError(
                        f"an in-place rewrite of gists [{r['start']}, {r['stop']}) with "
                        f"{r['gistnet_checkpoint']!r} was interrupted: they may mix old and new rows",
                        path=mpath, field=f"levels.LOD{lv}.gists")))
    if os.path.exists(os.path.join(dirpath, METADATA + ".tmp")):
        problems.append(Problem("warning", FormatError("a metadata.json.tmp left by an interrupted commit",
                                                       path=os.path.join(dirpath, METADATA + ".tmp"))))


def scan(dirpath, mmap: bool | None):
    """(metadata or None, levels, problems): everything about a tree directory, without raising."""
    problems = []
    if not is_url(dirpath) and not os.path.isdir(dirpath):  # a URL "directory" is checked by its metadata.json
        problems.append(Problem("error", not_a_dir(dirpath)))
        return None, {}, problems
    marker = os.path.join(dirpath, RESTORE_MARKER)
    if os.path.exists(marker):
        problems.append(Problem("error", MCFIOError(errno.EBUSY, "a restore from a snapshot was interrupted; "
                                                    "open the tree for writing to finish it", marker)))
    meta, errs = load_metadata(dirpath)
    problems += [Problem("error", e) for e in errs]
    expect = counts_of(meta) if meta is not None else (None, None, None)
    levels = {}
    for level in (2, 1, 0):   # the reverse of the commit order
        levels[level] = read_level(dirpath, level, mmap, expect[level], problems)
    if os.path.exists(marker) and not any(isinstance(p.error, MCFIOError) and p.error.filename == marker
                                          for p in problems):
        problems.append(Problem("error", MCFIOError(errno.EBUSY, "a restore from a snapshot started while "
                                                    "the tree was being opened; open it again", marker)))
    cross_check(dirpath, meta, levels, problems)
    return meta, levels, problems


def deep_checks(path, meta, levels) -> list:
    """Read all the data: token ids against ``vocab_size``, gists for NaN/Inf (the first hit per level)."""
    out = []
    chunk = 1 << 22
    vs = meta.get("vocab_size")
    lv = levels[0]
    t = lv.header.num_entries
    if vs:
        for s in range(0, t, chunk):
            a = lv.src.array(HEADER_SIZE + s * 4, "<u4", min(chunk, t - s))
            bad = np.flatnonzero(a >= vs)
            if bad.size:
                i = s + int(bad[0])
                out.append(Problem("error", FormatError(
                    f"token id at position {i} is outside the vocabulary", path=lv.path, field="tokens",
                    offset=HEADER_SIZE + i * 4, expected=f"< {vs}", got=int(a[bad[0]]))))
                break
    for level in (1, 2):
        lv = levels[level]
        h = lv.header
        n = h.num_entries
        if not n:
            continue
        if h.dtype.quantized:   # q8: the f16 block scales at the start of each row
            nb = -(-h.embedding_dim // 32)
            bits, mask, width, what = "<u2", 0x7C00, h.entry_size // 2, "a q8 block scale that is NaN or Inf"
        else:
            bits, mask = ("<u2", 0x7C00) if h.dtype_code == 1 else ("<u2", 0x7F80) if h.dtype_code == 2 \
                else ("<u4", 0x7F800000)
            nb, width, what = h.embedding_dim, h.embedding_dim, "NaN or Inf"
        rows = max(1, chunk // h.embedding_dim)
        for s in range(0, n, rows):
            m = min(rows, n - s)
            a = lv.src.array(HEADER_SIZE + s * h.entry_size, bits, (m, width))[:, :nb]
            bad = np.flatnonzero(((a & mask) == mask).any(axis=1))
            if bad.size:
                out.append(Problem("warning", FormatError(
                    f"gist {s + int(bad[0])} holds {what} ({int(((a & mask) == mask).any(axis=1).sum())}"
                    " such gists in this chunk)", path=lv.path, field="gists",
                    offset=HEADER_SIZE + (s + int(bad[0])) * h.entry_size)))
                break
    return out
