"""The bucket's registry: the index of every committed context, kept as a snapshot (registry.json)
and a journal (registry.journal) of the changes since.

In memory the registry is ``{"created_at", "models": {model_id: {"model_hash", "contexts": {id:
summary}}}, "stamps": {id: [ino, mtime_ns, size] of its metadata.json}, "skipped": [...]}``.  On disk
it is registry.json (a snapshot in seed 003's list form plus the stamps) and registry.journal (one
CRC-guarded JSON line per change since the snapshot).  A change appends one line under the lock
instead of rewriting every context's summary; the journal is folded into a new snapshot when it
grows past a quarter of the contexts.  Replaying is idempotent (put = replace, del = remove), so a
crash between writing a snapshot and starting a new journal loses nothing.

The registry is a cache of ``contexts/``: when the snapshot or the journal is missing or damaged,
:meth:`Registry.load_locked` calls the ``rebuild`` it was given (the bucket re-reads every
metadata.json), and the bucket's scan heals what a killed writer left out.  Nothing in them is trusted
more than that: a file larger than the bucket's contexts can need (:data:`REGISTRY_BYTES_PER_CONTEXT`) is
refused unread, a malformed summary makes the file damaged, and a directory planted under either name
is moved aside so the rebuilt file can take its place.  The bucket's file lock
is taken by the caller (the ``*_locked`` methods say so); :attr:`Registry.mem` guards the in-memory
state between the threads of one process.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mcf._core.fs import fsync_file
from mcf.bucket._fs import BucketFS
from mcf.bucket._json import dumps, get_field, iso, parse_iso, parse_json
from mcf.bucket._names import CTX_RE, JOURNAL_NAME, REGISTRY_NAME, check_model_id
from mcf.bucket.tiers import preference
from mcf.errors import FormatError, MCFIOError, UnsupportedVersionError, os_error

__all__ = ["JOURNAL_COMPACT_BYTES", "REGISTRY_BASE_BYTES", "REGISTRY_BYTES_PER_CONTEXT", "REGISTRY_VERSION", "Registry",
           "check_registry_version", "journal_line", "journal_write", "made_by", "parse_journal_line", "summary"]

#: the registry's ``mcrp_version`` (seed 003 §7.2: semantic versioning).  A registry.json of another major
#: version is refused on read (UnsupportedVersionError), never rebuilt over; a newer minor version is read.
REGISTRY_VERSION = "1.0"
_VERSION_RE = re.compile(r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})(\.(0|[1-9][0-9]{0,5}))?$")
#: the registry journal is folded into a new registry.json once it passes this size (or 64 bytes per
#: context, whichever is larger), so replaying it stays a small fraction of reading the snapshot
JOURNAL_COMPACT_BYTES = 1 << 20
#: registry.json and registry.journal larger than REGISTRY_BASE_BYTES plus REGISTRY_BYTES_PER_CONTEXT per entry
#: of contexts/ are not read (a planted multi-gigabyte file must not be read into memory: it is damage, and
#: the registry is rebuilt over it).  A context's summary is a few hundred bytes and its prefix index, 35
#: bytes per 256 tokens: 256 KiB holds the summary of a context of 1.8 million tokens.  A bucket whose
#: contexts average more is rebuilt at every open (its registry is then larger than it may be read).
REGISTRY_BASE_BYTES = 16 << 20
REGISTRY_BYTES_PER_CONTEXT = 256 << 10


def made_by(meta: dict) -> dict:
    """The ``model`` block of a context's metadata: architecture, vocab_size and model_hash of the
    registered model that was current at ingest (empty for contexts of older buckets)."""
    m = meta.get("model")
    return m if isinstance(m, dict) else {}


def summary(meta: dict) -> dict:
    """A context's entry in the registry, from its (validated) metadata."""
    return {
        "context_id": meta["context_id"],
        "name": meta["content"]["name"],
        "token_count": meta["content"]["token_count"],
        "size_bytes": meta["kv_cache"]["size_bytes"],
        "last_accessed": meta["timestamps"]["last_accessed"],
        "expires_at": meta["timestamps"]["expires_at"],
        "pinned": meta.get("pinned", False),
        "dtype": meta["kv_cache"]["dtype"],
        "prefix": meta.get("prefix"),
        "preferred_tier": preference(meta)[0],
        "model_hash": made_by(meta).get("model_hash"),
    }


def journal_line(rec: dict) -> bytes:
    body = json.dumps(rec, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


def parse_journal_line(line: bytes) -> dict | None:
    """A journal record, or None when the line is torn or damaged (its CRC-32 does not match)."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    try:
        crc = int(line[:8], 16)
    except ValueError:
        return None
    body = line[9:]
    if zlib.crc32(body) != crc:
        return None
    try:
        rec = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def journal_write(fd: int, payload: bytes) -> None:
    """Write all of ``payload`` at the current offset (a separate function so crash tests can stop a
    writer exactly here)."""
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view):]


def check_registry_version(doc: Any, p: Path) -> None:
    """registry.json's ``mcrp_version``: another major version is UnsupportedVersionError (a newer mcf's
    bucket: not rebuilt over); a missing or malformed one is a damaged registry (FormatError: rebuilt)."""
    v = get_field(doc, p, "mcrp_version", types=str)
    m = _VERSION_RE.fullmatch(v)
    if m is None:
        raise FormatError("mcrp_version is not MAJOR.MINOR", path=p, field="mcrp_version", got=v[:40])
    major = REGISTRY_VERSION.split(".")[0]
    if m.group(1) != major:
        raise UnsupportedVersionError(
            f"registry mcrp_version {v} is not readable by this mcf (it reads {major}.x): the bucket was written "
            "by another major version", path=p, field="mcrp_version", expected=f"{major}.x", got=v)


_SUMMARY_FIELDS = (("context_id", str), ("name", (str, type(None))), ("token_count", int), ("size_bytes", int),
                   ("last_accessed", str), ("expires_at", (str, type(None))), ("pinned", bool))


def check_summary(c: Any, p: Path, where: str) -> None:
    """A context's summary as the registry's readers use it (every list checks its expiry): a malformed
    one is damage to the cache, which is then rebuilt from the contexts' own metadata.  Runs once per
    context when a snapshot is read, so the common case is a few type checks; the error names the field."""
    try:
        ok = all(isinstance(c[k], t) and (t is not int or type(c[k]) is int) for k, t in _SUMMARY_FIELDS)
    except (KeyError, TypeError):
        ok = False
    if not ok:
        for k, t in _SUMMARY_FIELDS:
            get_field({"c": c}, p, "c", k, types=t)
    if not CTX_RE.fullmatch(c["context_id"]):
        raise FormatError("invalid context id in registry", path=p, field=where, got=c["context_id"])
    if c["expires_at"] is not None:
        parse_iso(c["expires_at"], p, f"{where}.expires_at")


def state_remove(state: dict, cid: str) -> None:
    for mid, m in list(state["models"].items()):
        if m["contexts"].pop(cid, None) is not None and not m["contexts"]:
            del state["models"][mid]
    state["stamps"].pop(cid, None)


def apply(state: dict, rec: dict) -> None:
    """One journal record applied to an in-memory registry (idempotent)."""
    if rec["op"] == "put":
        summ, mid = rec["summary"], rec["model_id"]
        cid = summ["context_id"]
        state_remove(state, cid)
        m = state["models"].setdefault(mid, {"model_hash": rec.get("model_hash"), "contexts": {}})
        m["model_hash"] = rec.get("model_hash", m["model_hash"])  # the model's current hash at that change
        m["contexts"][cid] = summ
        state["stamps"][cid] = rec.get("stamp")
    else:
        state_remove(state, rec["context_id"])
    state["last_updated"] = rec.get("at", state["last_updated"])


def document(state: dict) -> dict:
    """The registry document of seed 003 §3.2 (models, their contexts, statistics) of a state."""
    models = [{"model_id": mid, "model_hash": m["model_hash"], "contexts": list(m["contexts"].values())}
              for mid, m in state["models"].items()]
    ctxs = [c for m in models for c in m["contexts"]]
    return {"mcrp_version": REGISTRY_VERSION, "created_at": state["created_at"],
            "last_updated": state["last_updated"], "models": models,
            "statistics": {"total_models": len(models), "total_contexts": len(ctxs),
                           "total_storage_bytes": sum(c["size_bytes"] for c in ctxs),
                           "total_tokens": sum(c["token_count"] for c in ctxs)},
            "skipped": list(state.get("skipped", []))}


class Registry:
    """The snapshot and journal of one bucket directory, and this process's cached copy of them.

    ``rebuild()`` (called with the bucket's lock held) recreates the registry from ``contexts/`` and
    writes it with :meth:`write_snapshot_locked`; it is the bucket's, because only the bucket reads
    contexts."""

    def __init__(self, fs: BucketFS, root: Path, clock: Callable[[], float], rebuild: Callable[[], dict]) -> None:
        self._fs = fs
        self.root = root
        # for messages (every access goes through the descriptor-relative ``fs``); joined once, because an
        # expiry check names registry.json and discover() makes one per context
        self.registry_path = root / REGISTRY_NAME
        self.journal_path = root / JOURNAL_NAME
        self.clock = clock
        self._rebuild = rebuild
        self.cache: dict | None = None
        self.snap_stamp: tuple | None = None
        self.journal_ino: int | None = None
        self.journal_pos = 0
        self.prefix_index: dict | None = None
        #: guards the in-memory registry (always taken after the file lock, never before it)
        self.mem = threading.RLock()


    def empty_state(self) -> dict:
        return {"created_at": iso(self.clock()), "last_updated": iso(self.clock()), "models": {}, "stamps": {},
                "skipped": []}

    def file_stamp(self, name: str) -> tuple | None:
        """(inode, mtime_ns, size) of registry.json or the journal (the link itself if one was planted:
        reading it is then refused, and the registry rebuilt)."""
        st = self._fs.lstat(name)
        return None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size)

    def size_limit(self) -> int:
        """The most bytes registry.json (or the journal to replay) may hold for contexts/ as it is now
        (:data:`REGISTRY_BYTES_PER_CONTEXT`)."""
        try:
            with self._fs.dir("contexts") as d, os.scandir(d) as it:
                n = sum(1 for _ in it)
        except (OSError, FormatError):
            n = 0
        return REGISTRY_BASE_BYTES + n * REGISTRY_BYTES_PER_CONTEXT

    def check_record(self, rec: Any) -> dict:
        p = self.journal_path
        op = get_field(rec, p, "op", types=str)
        if op == "put":
            check_model_id(get_field(rec, p, "model_id", types=str))
            check_summary(get_field(rec, p, "summary", types=dict), p, "summary")
        elif op == "del":
            if not CTX_RE.fullmatch(get_field(rec, p, "context_id", types=str)):
                raise FormatError("invalid context id in journal", path=p, got=rec["context_id"])
        else:
            raise FormatError("unknown journal operation", path=p, field="op", got=op)
        return rec

    def read_snapshot(self) -> dict:
        """registry.json as in-memory state (FileNotFoundError / FormatError when unusable)."""
        p = self.registry_path
        doc = parse_json(self._fs.read(REGISTRY_NAME, limit=self.size_limit()), p)
        check_registry_version(doc, p)
        state = self.empty_state()
        state["created_at"] = doc.get("created_at", state["created_at"]) if isinstance(doc, dict) else None
        for i, m in enumerate(get_field(doc, p, "models", types=list)):
            mid = check_model_id(get_field({"m": m}, p, "m", "model_id", types=str))
            ctxs = {}
            for c in get_field({"m": m}, p, "m", "contexts", types=list):
                check_summary(c, p, f"models[{i}]")
                ctxs[c["context_id"]] = c
            if ctxs:
                state["models"][mid] = {"model_hash": m.get("model_hash"), "contexts": ctxs}
        stamps = doc.get("stamps", {})
        if not isinstance(stamps, dict):
            raise FormatError("stamps must be an object", path=p, field="stamps")
        state["stamps"] = stamps
        state["skipped"] = doc.get("skipped", []) if isinstance(doc.get("skipped"), list) else []
        return state

    def replay(self, state: dict, start: int) -> int:
        """Apply journal records from byte ``start``; returns the end of the last whole, valid record.
        A torn final line (a writer killed mid-append) ends the replay; a bad line followed by good
        ones means the journal was damaged: FormatError (the caller rebuilds)."""
        try:
            fd = self._fs.open_file(JOURNAL_NAME)
        except FileNotFoundError:
            return start
        try:
            with os.fdopen(fd, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size - start > REGISTRY_BASE_BYTES and size - start > self.size_limit():
                    raise FormatError(f"{size - start} bytes to replay, more than the {self.size_limit()} a "
                                      "registry of this bucket may hold", path=self.journal_path)
                f.seek(start)
                data = f.read()
        except OSError as exc:
            raise os_error(exc, self.journal_path) from exc
        pos = start
        lines = data.split(b"\n")
        for i, line in enumerate(lines[:-1]):  # the piece after the last newline is incomplete
            rec = parse_journal_line(line)
            if rec is None:
                if any(parse_journal_line(x) is not None for x in lines[i + 1:-1]):
                    raise FormatError("damaged registry journal line", path=self.journal_path, offset=pos)
                break
            apply(state, self.check_record(rec))
            pos += len(line) + 1
        return pos

    def fresh(self) -> dict | None:
        """The cached state when neither registry.json nor the journal changed on disk since this process
        last read or wrote them (two stat() calls), else None (the caller loads under the lock)."""
        if self.cache is not None:
            snap, jst = self.file_stamp(REGISTRY_NAME), self.file_stamp(JOURNAL_NAME)
            jkey = (jst[0], jst[2]) if jst is not None else (None, 0)
            if snap is not None and snap == self.snap_stamp and jkey == (self.journal_ino, self.journal_pos):
                return self.cache
        return None

    def load_locked(self) -> dict:
        """The registry state, refreshed from disk (caller holds the lock): only the journal's new tail
        when the snapshot is unchanged, else snapshot + whole journal, else a rebuild from contexts/."""
        with self.mem:
            return self._load_locked_mem()

    def _load_locked_mem(self) -> dict:
        snap, jst = self.file_stamp(REGISTRY_NAME), self.file_stamp(JOURNAL_NAME)
        st = self.cache
        jino, jsize = (jst[0], jst[2]) if jst is not None else (None, 0)
        if (st is not None and snap is not None and snap == self.snap_stamp and jino == self.journal_ino
                and jsize >= self.journal_pos):
            if jsize > self.journal_pos:
                try:
                    self.journal_pos = self.replay(st, self.journal_pos)
                except FormatError:
                    return self._rebuild()
                self.prefix_index = None
            return st
        try:
            st = self.read_snapshot()
            pos = self.replay(st, 0)
        except UnsupportedVersionError:
            raise  # another major version's registry: refused, not overwritten by a rebuild
        except (FileNotFoundError, FormatError):
            return self._rebuild()
        self._set_cache(st, snap, jst, pos)
        return st

    def _set_cache(self, state: dict, snap: tuple | None, jst: tuple | None, pos: int) -> None:
        self.cache, self.snap_stamp, self.prefix_index = state, snap, None
        self.journal_ino, self.journal_pos = (jst[0] if jst else None), pos

    def write_snapshot_locked(self, state: dict) -> None:
        """Write registry.json from ``state`` and start an empty journal (caller holds the lock)."""
        state["last_updated"] = iso(self.clock())
        doc = document(state)
        doc["stamps"] = state["stamps"]
        self._publish_locked(REGISTRY_NAME, dumps(doc, True))
        self._publish_locked(JOURNAL_NAME, b"")  # after the snapshot: replaying the old journal is harmless
        self._set_cache(state, self.file_stamp(REGISTRY_NAME), self.file_stamp(JOURNAL_NAME), 0)

    def _publish_locked(self, name: str, data: bytes) -> None:
        """Replace registry file ``name`` with ``data``.  A rename replaces a planted link or file but not
        a directory: one planted under the name is moved aside (to ``.<name>.<random>.displaced``, kept
        for whoever put it there), so a bucket whose cache location is taken still opens."""
        try:
            self._fs.write_atomic(name, data)
        except (FormatError, MCFIOError):
            st = self._fs.lstat(name)
            if st is None or not stat.S_ISDIR(st.st_mode):
                raise
            self._fs.rename(name, f".{name}.{uuid.uuid4().hex}.displaced")
            self._fs.write_atomic(name, data)

    def journal_locked(self, records: list[dict]) -> None:
        """Append records (caller holds the lock): applied in memory, then written as whole lines and
        fsynced; a long journal is folded into a new snapshot."""
        state = self.load_locked()
        at = iso(self.clock())
        with self.mem:
            for rec in records:
                rec["at"] = at
                apply(state, rec)
            self.prefix_index = None
        n_ctx = sum(len(m["contexts"]) for m in state["models"].values())
        if self.journal_pos + sum(len(json.dumps(r)) for r in records) > max(JOURNAL_COMPACT_BYTES, 64 * n_ctx):
            self.write_snapshot_locked(state)
            return
        payload = b"".join(journal_line(r) for r in records)
        try:
            fd = self._fs.open_file(JOURNAL_NAME, os.O_WRONLY | os.O_CREAT)
        except FormatError:  # something planted in its place: a new snapshot replaces it (the link itself)
            self.write_snapshot_locked(state)
            return
        try:
            try:
                if os.fstat(fd).st_size != self.journal_pos or self.journal_ino != os.fstat(fd).st_ino:
                    os.ftruncate(fd, self.journal_pos)  # drop a torn line left by a killed writer
                os.lseek(fd, self.journal_pos, os.SEEK_SET)
                journal_write(fd, payload)
                fsync_file(fd)
                ino = os.fstat(fd).st_ino
            finally:
                os.close(fd)
        except OSError as exc:
            raise os_error(exc, self.journal_path) from exc
        self.journal_ino, self.journal_pos = ino, self.journal_pos + len(payload)

    def prefix_locked_mem(self, state: dict, chunk_tokens: int) -> dict[tuple[str, str], list[tuple[str, int]]]:
        """chained chunk hash -> [(context id, tokens covered)] per model, built on demand (caller holds
        :attr:`mem`)."""
        if self.prefix_index is None:
            index: dict[tuple[str, str], list[tuple[str, int]]] = {}
            for mid, m in state["models"].items():
                for c in m["contexts"].values():
                    pre = c.get("prefix")
                    if (isinstance(pre, dict) and pre.get("chunk_tokens") == chunk_tokens
                            and isinstance(pre.get("hashes"), list)):
                        for i, h in enumerate(pre["hashes"]):
                            if isinstance(h, str):
                                index.setdefault((mid, h), []).append((c["context_id"], (i + 1) * chunk_tokens))
            self.prefix_index = index
        return self.prefix_index
