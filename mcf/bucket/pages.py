"""Pages: the bucket's store of fixed KV pages and chunks, keyed by the serving engine's own hashes.

A serving engine (SGLang's HiCache, LMCache, vLLM's offloading tiers) does not store whole contexts:
it stores one page (SGLang: 64 tokens), chunk (LMCache: 256 tokens) or block group (vLLM) at a time,
under a key it computed itself from the tokens before it, and asks "which of these 128 keys do you
have?" before every prefill.  ``contexts/`` (one ``kv_data.mcb`` per context, a registry, a lock) is
the wrong unit for that: a page store needs a lookup that costs a ``stat`` and a write that takes no
lock.  So the bucket keeps pages in an area of their own::

    <root>/pages/<namespace>/<name>               one page: header, key, engine metadata, payload
    <root>/pages/<namespace>/.<random>.tmp        a page being written (gc() removes old ones)

``namespace`` separates what must never be mixed (a model, a tensor-parallel rank, a layout): the
engine plugins derive it from the engine's configuration.  ``name`` is the engine's key, with every
byte outside ``[A-Za-z0-9_@=+,.-]`` (and a leading ``.``) written ``%XX``, so a key never names
another path, a temp file, or ``..``.

**The page file** (little-endian, the one layout of :data:`HEADER`):

====== ==== ================ ==============================================================
offset size field            meaning
====== ==== ================ ==============================================================
0      4    magic            ``MCBP``
4      2    version          2
6      2    flags            0
8      2    key_len          bytes of the key (UTF-8) after the header
10     2    checksum         the kind of the two checksums: 1, CRC-32C (the only kind)
12     4    meta_len         bytes of the engine's metadata after the key (at most 64 KiB)
16     8    payload_offset   where the payload starts: 4096-aligned for payloads of 4 KiB or more
24     8    payload_size     the file is exactly ``payload_offset + payload_size`` bytes
32     8    created_ns       when it was written (informational)
40     4    payload_crc      CRC-32C of the payload
44     4    header_crc       CRC-32C of the 64 header bytes (this field zero), the key and the metadata
48     16   reserved         0
====== ==== ================ ==============================================================

**Why CRC-32C** (and not zlib's CRC-32, which the ``kv_data.mcb`` files use): a batch of 128 pages is
half a gigabyte, and its checksum must cost less than reading it.  CRC-32C has an instruction on both
architectures mcf builds for (SSE4.2's ``crc32`` on x86-64, the ARMv8 CRC extension on aarch64): about
29 GB/s a core here with three interleaved streams, where zlib's CRC-32 ran at 7 GB/s and holds the GIL.
Its polynomial (Castagnoli's) detects at least as many error patterns at these lengths.  The ``checksum``
field names the kind, so another can be added without guessing; pages of version 1 (zlib's CRC-32, never
released) are refused as an unsupported version, which makes them misses.  ``csrc/pageio.c`` has the
variants (the scalar table code always compiled, the instruction chosen at run time, forced as every
kernel is with ``MCF_FORCE_IMPL``).

What each guarantee of the bucket becomes here:

* **Checksums.**  Every read checks the header's CRC, the key (a page renamed or copied under another
  key is refused), the sizes against the file's, and the payload's CRC *before* it answers a hit.  A
  page that fails is damage: it is removed and answered as a miss (the engine recomputes it), counted
  in :attr:`PageStore.stats`, never handed out.
* **Crash safety.**  A page is written to a hidden temp file with one ``pwritev`` and renamed over its
  name: the rename is the commit point, so a reader sees the whole old page, the whole new one, or
  none.  With ``durable=True`` the file is fsynced before the rename (and the directory after each
  batch), so a committed page survives a power loss; by default it is not (as SGLang's and LMCache's
  file stores, which never fsync), and a page torn by a power loss fails its CRC at the next read and
  is a miss.  Either way a torn write is never read as a hit.
* **TTL.**  ``ttl=`` seconds: a page whose file was last written more than ``ttl`` ago is a miss for
  every call (existence checks read it from the same ``stat``) and :meth:`PageStore.gc` deletes it;
  writing a page that is already there refreshes its time instead of rewriting it.
* **Tiers.**  Cold is the file (and so the page cache).  ``warm_budget_bytes=`` keeps verified pages of
  recent reads in this process's memory, least recently used out first; a warm copy is served only
  while the file is the one it was read from (inode, size, mtime, ctime from one ``stat``), so a page
  rewritten or deleted by another process is never served from memory.
* **Nothing planted is followed.**  The namespace directory is opened once through
  :class:`mcf.bucket._fs.BucketFS`; every page is opened relative to it with ``O_NOFOLLOW |
  O_NONBLOCK`` and checked with ``fstat`` (a link, FIFO or device under a page's name is a miss).

**Batches** are one call into ``mcf.bucket._pageio`` (C, without the GIL, on ``threads`` threads, each
taking the next page): a read opens a page and reads its payload in 256 KiB pieces straight into the
caller's memory, checksumming each piece as it arrives; a write checksums each piece as it writes it.
(No read-ahead advice: ``POSIX_FADV_WILLNEED`` on a cold batch's pages made its reads, and the later
warm reads of those pages, slower; see docs/bucket.md.)  Python then checks each header (a few
microseconds a page).  Nothing is allocated per page but its header, so a batch holds no more memory
than its destinations.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mcf._core.fs import fsync_file
from mcf.bucket import _pageio
from mcf.bucket._fs import BucketFS
from mcf.errors import (ArgumentTypeError, ChecksumError, FormatError, InvalidArgumentError, MCFError, TruncatedError,
                        UnsupportedVersionError)

__all__ = ["CHECKSUM_CRC32C", "HEADER", "MAX_META_BYTES", "PAGES_DIR", "PageStore", "byte_views", "check_namespace",
           "crc32c", "key_of_name", "page_name", "payload_offset", "writable_views"]

#: the pages area inside a bucket's root
PAGES_DIR = "pages"
MAGIC = b"MCBP"
VERSION = 2
#: the ``checksum`` field: the only kind so far
CHECKSUM_CRC32C = 1
#: magic, version, flags, key_len, checksum, meta_len, payload_offset, payload_size, created_ns,
#: payload_crc, header_crc, 16 reserved bytes
HEADER = struct.Struct("<4sHHHHIQQQII16x")
assert HEADER.size == 64
_PAYLOAD_CRC_FIELD = 40
_CRC_FIELD = 44
#: an engine's metadata for one page (LMCache's chunk header is 28 bytes for one group)
MAX_META_BYTES = 64 * 1024
#: a key, in characters (SGLang's are 64 hex digits; LMCache's ``model@world@worker@hash@dtype`` strings)
MAX_KEY_CHARS = 512
_MAX_NAME = 255
_ALIGN_LARGE = 4096
_TMP_MAX_AGE = 3600.0
_SAFE = re.compile(r"[A-Za-z0-9_@=+,-][A-Za-z0-9_@=+,.-]*")
_SAFE_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_@=+,.-")
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_IOV_MAX = 1024
_log = logging.getLogger("mcf.bucket.pages")


def check_namespace(namespace: Any) -> str:
    """A namespace is a directory name: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` without ``..``."""
    if not isinstance(namespace, str):
        raise ArgumentTypeError(f"a page namespace is a string, not {type(namespace).__name__}")
    if not _NAMESPACE.fullmatch(namespace) or ".." in namespace:
        raise InvalidArgumentError(f"bad page namespace {namespace!r}: expected [A-Za-z0-9][A-Za-z0-9._-]{{0,127}} "
                                   "without '..'")
    return namespace


def page_name(key: Any) -> str:
    """The file name of ``key``: the key itself when it is made of ``[A-Za-z0-9_@=+,.-]`` and does not
    start with ``.``; else every other UTF-8 byte (and a leading ``.``) as ``%XX``."""
    if not isinstance(key, str):
        raise ArgumentTypeError(f"a page key is a string, not {type(key).__name__}")
    if len(key) <= _MAX_NAME and _SAFE.fullmatch(key):
        return key
    if not key or len(key) > MAX_KEY_CHARS:
        raise InvalidArgumentError(f"a page key has 1 to {MAX_KEY_CHARS} characters, not {len(key)}")
    raw = key.encode("utf-8", "surrogatepass")
    name = "".join(chr(b) if b in _SAFE_BYTES and not (i == 0 and b == 0x2E) else f"%{b:02X}"
                   for i, b in enumerate(raw))
    if len(name) > _MAX_NAME:
        raise InvalidArgumentError(f"page key {key[:40]!r}... is {len(name)} bytes as a file name, more than "
                                   f"the {_MAX_NAME} a file system allows")
    return name


def key_of_name(name: str) -> str | None:
    """The key a page file name stands for (None for a name no key has: temp files, strays)."""
    if not name or name.startswith("."):
        return None
    if "%" not in name:
        return name if _SAFE.fullmatch(name) else None
    try:
        out, i = bytearray(), 0
        while i < len(name):
            if name[i] == "%":
                out.append(int(name[i + 1:i + 3], 16))
                i += 3
            else:
                out.append(ord(name[i]))
                i += 1
        key = out.decode("utf-8", "surrogatepass")
    except (ValueError, UnicodeDecodeError):
        return None
    return key if page_name(key) == name else None


def payload_offset(key_len: int, meta_len: int, payload_size: int) -> int:
    """Where the payload starts (the one layout rule, for writer and reader): right after the header,
    the key and the metadata, rounded up to 4096 bytes for payloads of 4 KiB or more (so the payload
    can be read with O_DIRECT and into page-aligned memory), to 64 bytes otherwise."""
    base = HEADER.size + key_len + meta_len
    align = _ALIGN_LARGE if payload_size >= _ALIGN_LARGE else 64
    return -(-base // align) * align


def byte_views(data: Any) -> list[memoryview]:
    """One or several buffers (bytes, numpy arrays, memoryviews, torch CPU tensors' numpy views) as flat
    byte views; each must be C-contiguous."""
    parts = data if isinstance(data, (list, tuple)) else [data]
    views = []
    for p in parts:
        try:
            v = memoryview(p)
        except TypeError:
            raise ArgumentTypeError(f"a page is a buffer (bytes, memoryview, numpy array), not "
                                    f"{type(p).__name__}") from None
        if not v.c_contiguous:
            raise InvalidArgumentError("a page buffer must be C-contiguous")
        views.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
    return views


def writable_views(out: Any) -> list[memoryview]:
    views = byte_views(out)
    for v in views:
        if v.readonly:
            raise InvalidArgumentError("a page is read into writable memory; this buffer is read-only")
    return views


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C of a buffer, continuing from ``value``: the pages' checksum (the fastest variant the CPU
    runs, or the one ``MCF_FORCE_IMPL`` names)."""
    return _pageio.crc32c(data, value)


def _crc(views: Iterable[memoryview], value: int = 0) -> int:
    for v in views:
        value = _pageio.crc32c(v, value)
    return value


def _preadv_full(fd: int, views: list[memoryview], offset: int) -> int:
    """Read into ``views`` from ``offset`` until they are full or the file ends; the bytes read."""
    total, want = 0, sum(len(v) for v in views)
    pending = [v for v in views if len(v)]
    while pending:
        n = os.preadv(fd, pending[:_IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]
    assert total <= want
    return total


def _encoded(keys: Sequence[str]) -> list[bytes]:
    """The page names of ``keys``, as C takes them (ASCII: page_name escapes every other byte)."""
    return [page_name(k).encode("ascii") for k in keys]


def _check_meta(meta: Any) -> bytes:
    meta = bytes(meta)
    if len(meta) > MAX_META_BYTES:
        raise InvalidArgumentError(f"page metadata of {len(meta)} bytes, more than the {MAX_META_BYTES} allowed")
    return meta


def _fixed(views: list[memoryview]) -> Callable[[bytes, int], Any]:
    """An ``alloc`` that answers ``views`` for a payload of their size, None (a miss) for another."""
    size = sum(len(v) for v in views)
    return lambda meta, n: views if n == size else None


class _WrongSize(MCFError):
    """A page that is there but not of the size the caller reads: a miss, not damage."""


class _Header:
    __slots__ = ("key_len", "meta_len", "payload_offset", "payload_size", "created_ns", "payload_crc")

    def __init__(self, key_len, meta_len, offset, size, created_ns, payload_crc):
        self.key_len, self.meta_len, self.payload_offset = key_len, meta_len, offset
        self.payload_size, self.created_ns, self.payload_crc = size, created_ns, payload_crc


class PageStore:
    """One namespace of a bucket's pages area (see the module docstring for the layout and guarantees).

    ``root`` is the bucket's directory (created if missing; the pages live under ``pages/<namespace>``,
    beside ``contexts/``).  Options: ``ttl`` (seconds a page lives after it was written; None: for
    ever), ``durable`` (fsync each page before its rename), ``verify`` (check the payload's CRC-32 on
    every read; False trusts the header's checks alone), ``warm_budget_bytes`` (the in-memory tier; 0:
    off), ``threads`` (the reads and writes of one batch run on this many threads), ``clock``
    (injectable, for TTL tests).

    Single-page calls raise :class:`mcf.MCFError` subclasses for bad arguments; what is *on disk*
    never raises from a read: a damaged page is a miss (and is removed), as the engines expect.
    """

    def __init__(self, root: str | os.PathLike, namespace: str, *, ttl: float | None = None, durable: bool = False,
                 verify: bool = True, warm_budget_bytes: int = 0, threads: int = 4,
                 clock: Callable[[], float] = time.time, create: bool = True) -> None:
        self.namespace = check_namespace(namespace)
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
            raise InvalidArgumentError(f"ttl is a number of seconds above 0 or None, not {ttl!r}")
        if isinstance(warm_budget_bytes, bool) or not isinstance(warm_budget_bytes, int) or warm_budget_bytes < 0:
            raise InvalidArgumentError(f"warm_budget_bytes is an integer >= 0, not {warm_budget_bytes!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 256:
            raise InvalidArgumentError(f"threads is an integer from 1 to 256, not {threads!r}")
        self.ttl, self.durable, self.verify = ttl, bool(durable), bool(verify)
        self.warm_budget_bytes, self.threads, self.clock = warm_budget_bytes, threads, clock
        self._fs = BucketFS(root, create=create)
        self.rel = f"{PAGES_DIR}/{self.namespace}"
        try:
            if create:
                self._fs.mkdir(PAGES_DIR, exist_ok=True)
                self._fs.mkdir(self.rel, exist_ok=True)
            self._dir = self._fs.open_dir(self.rel)
        except BaseException:
            self._fs.close()
            raise
        self._warm: OrderedDict[str, tuple[tuple, bytes, bytes]] = OrderedDict()
        self._warm_bytes = 0
        self._warm_lock = threading.Lock()
        #: counters: hits and misses of reads, pages written, pages found damaged (and removed)
        self.stats = {"hits": 0, "misses": 0, "writes": 0, "damaged": 0}

    # -- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        fd, self._dir = getattr(self, "_dir", -1), -1
        if fd >= 0:
            os.close(fd)
        self._fs.close()
        with self._warm_lock:
            self._warm.clear()
            self._warm_bytes = 0

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if getattr(self, "_dir", -1) >= 0:
                os.close(self._dir)
                self._dir = -1

    @property
    def dir_fd(self) -> int:
        if self._dir < 0:
            from mcf.errors import ClosedError
            raise ClosedError(f"{self._fs.where(self.rel)}: the page store is closed")
        return self._dir

    def where(self, *, key: str | None = None) -> str:
        """The page's path, for messages (the namespace's directory without a key)."""
        return str(self._fs.where(self.rel if key is None else f"{self.rel}/{page_name(key)}"))

    def _expired_ns(self, mtime_ns: int, now: float | None = None) -> bool:
        if self.ttl is None:
            return False
        return mtime_ns + int(self.ttl * 1e9) <= int((self.clock() if now is None else now) * 1e9)

    # -- existence -----------------------------------------------------------------------------------
    def _expire_ns(self, now: float | None = None) -> int:
        """A file whose mtime (ns) is at or before this is expired (``_expired_ns``'s rule, for C)."""
        if self.ttl is None:
            return _pageio.NEVER
        return int((self.clock() if now is None else now) * 1e9) - int(self.ttl * 1e9)

    def _live(self, name: str, now: float | None) -> os.stat_result | None:
        try:
            st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno in (errno.ENAMETOOLONG, errno.ELOOP):
                return None
            raise
        if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER.size or self._expired_ns(st.st_mtime_ns, now):
            return None
        return st

    def exists(self, key: str) -> bool:
        """Whether a page of ``key`` is there and unexpired (one ``stat``; the data is checked on read)."""
        return self._live(page_name(key), None) is not None

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`exists` for each key (one call into C: a ``stat`` each)."""
        live = _pageio.live_pages(self.dir_fd, _encoded(keys), min_size=HEADER.size, expire_ns=self._expire_ns(),
                                  stop_at_gap=False)
        return [bool(b) for b in live]

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are there: it stops at the first gap (what SGLang's
        ``batch_exists`` and LMCache's ``batched_contains`` answer).  One call into C: a ``stat`` each."""
        return _pageio.live_pages(self.dir_fd, _encoded(keys), min_size=HEADER.size, expire_ns=self._expire_ns())

    # -- writing -------------------------------------------------------------------------------------
    def put(self, key: str, data: Any, *, meta: bytes = b"", replace: bool = False) -> bool:
        """Store ``data`` (one buffer or a list of buffers, written one after the other) as the page of
        ``key``, with ``meta`` (the engine's own small header) beside it.  A page already there and
        unexpired is kept and its time refreshed (the same key holds the same tokens' KV), unless
        ``replace``; True when this call wrote the page."""
        name = page_name(key)
        views = byte_views(data)
        meta = _check_meta(meta)
        if not replace and self._refresh(name):
            return False
        err = self._write_batch([name], [key], [views], [meta])[0]
        if err is not None:
            raise self._fs._refuse(err, f"{self.rel}/{name}")
        if self.durable:
            fsync_file(self.dir_fd)
        return True

    def _touch(self, name: str) -> None:
        with contextlib.suppress(OSError):
            if self.ttl is not None:  # only an expiring page needs its time moved
                t = int(self.clock() * 1e9)
                os.utime(name, ns=(t, t), dir_fd=self.dir_fd, follow_symlinks=False)

    def _refresh(self, name: str) -> bool:
        if self._live(name, None) is None:
            return False
        self._touch(name)
        return True

    def _write_batch(self, names: list[str], keys: Sequence[str], views: list[list[memoryview]],
                     metas: list[bytes]) -> list[OSError | None]:
        """Write each page (one call into C, on ``threads`` threads): per page None, or the OSError that
        stopped it (its temp file removed)."""
        heads, sums, tmps = [], [], []
        created = time.time_ns()
        for key, vs, meta in zip(keys, views, metas):
            kb = key.encode("utf-8", "surrogatepass")
            size = sum(len(v) for v in vs)
            offset = payload_offset(len(kb), len(meta), size)
            head = bytearray(offset)
            HEADER.pack_into(head, 0, MAGIC, VERSION, 0, len(kb), CHECKSUM_CRC32C, len(meta), offset, size, created,
                             0, 0)
            end = HEADER.size + len(kb) + len(meta)
            head[HEADER.size:end] = kb + meta
            heads.append(head)
            sums.append(end)
            tmps.append(f".{uuid.uuid4().hex}.tmp".encode("ascii"))
        # a page's time is the store's clock (the TTL's reference); without a TTL the file system's
        mtime = int(self.clock() * 1e9) if self.ttl is not None else -1
        res = _pageio.write_pages(self.dir_fd, tmps, [n.encode("ascii") for n in names], heads, sums, views,
                                  payload_crc_at=_PAYLOAD_CRC_FIELD, head_crc_at=_CRC_FIELD, threads=self.threads,
                                  set_mtime_ns=mtime, durable=self.durable)
        out: list[OSError | None] = []
        for name, (status, err) in zip(names, res):
            if status == _pageio.OK:
                self._drop_warm(name)
                self.stats["writes"] += 1
                out.append(None)
            else:
                out.append(OSError(err, os.strerror(err)))
        return out

    def put_many(self, keys: Sequence[str], datas: Sequence[Any], *, metas: Sequence[bytes] | None = None,
                 replace: bool = False) -> list[bool]:
        """:meth:`put` for each key, in one call on ``threads`` threads: per key, whether its page is stored
        now (written, or already there).  A page that cannot be written (a full disk, an I/O error) is
        False and logged; arguments that are wrong for every page raise."""
        if len(datas) != len(keys) or (metas is not None and len(metas) != len(keys)):
            raise InvalidArgumentError(f"{len(keys)} keys, {len(datas)} pages"
                                       + ("" if metas is None else f" and {len(metas)} metadata"))
        names = [page_name(k) for k in keys]
        metas = [b""] * len(keys) if metas is None else [_check_meta(m) for m in metas]
        views = [byte_views(d) for d in datas]
        out = [False] * len(keys)
        todo = list(range(len(keys)))
        if not replace:
            live = _pageio.live_pages(self.dir_fd, [n.encode("ascii") for n in names], min_size=HEADER.size,
                                      expire_ns=self._expire_ns(), stop_at_gap=False)
            for i in todo:
                if live[i]:
                    self._touch(names[i])
                    out[i] = True
            todo = [i for i in todo if not live[i]]
        errs = self._write_batch([names[i] for i in todo], [keys[i] for i in todo], [views[i] for i in todo],
                                 [metas[i] for i in todo])
        for i, err in zip(todo, errs):
            if err is None:
                out[i] = True
            else:
                _log.warning("%s: page not written: %s", self.where(key=keys[i]), err)
        if self.durable and any(out):
            fsync_file(self.dir_fd)
        return out

    # -- reading -------------------------------------------------------------------------------------
    def _damaged(self, name: str, ident: tuple | None, exc: Exception) -> None:
        """Remove a page that failed a check (if the name still holds the file that failed: ``ident``'s
        device and inode)."""
        self.stats["damaged"] += 1
        _log.warning("%s: damaged page removed: %s", self._fs.where(f"{self.rel}/{name}"), exc)
        self._drop_warm(name)
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
            if ident is None or (st.st_dev, st.st_ino) == tuple(ident[:2]):
                os.unlink(name, dir_fd=self.dir_fd)

    def _parse(self, name: str, key: str, buf: memoryview, file_size: int) -> tuple[_Header, bytes]:
        where = self._fs.where(f"{self.rel}/{name}")
        if len(buf) < HEADER.size:
            raise TruncatedError("a page shorter than its header", path=where, expected=HEADER.size, got=len(buf))
        magic, version, flags, key_len, kind, meta_len, offset, size, created, pcrc, hcrc = HEADER.unpack_from(buf)
        if magic != MAGIC:
            raise FormatError("not a page file", path=where, field="magic", offset=0, expected=MAGIC, got=magic)
        if version != VERSION:
            raise UnsupportedVersionError("unsupported page version", path=where, field="version", offset=4,
                                          expected=VERSION, got=version)
        if flags:
            raise FormatError("unknown flags", path=where, field="flags", offset=6, expected=0, got=flags)
        if kind != CHECKSUM_CRC32C:
            raise UnsupportedVersionError("unknown checksum kind", path=where, field="checksum", offset=10,
                                          expected=f"{CHECKSUM_CRC32C} (CRC-32C)", got=kind)
        end = HEADER.size + key_len + meta_len
        if meta_len > MAX_META_BYTES or offset != payload_offset(key_len, meta_len, size) or len(buf) < end:
            raise FormatError("inconsistent header", path=where, field="payload_offset", offset=16,
                              expected=payload_offset(key_len, meta_len, size), got=offset)
        if offset + size != file_size:
            cls = TruncatedError if file_size < offset + size else FormatError
            raise cls("page size disagrees with the file's", path=where, field="payload_size", offset=24,
                      expected=file_size - offset, got=size)
        check = bytearray(buf[:end])
        check[_CRC_FIELD:_CRC_FIELD + 4] = b"\0\0\0\0"
        value = _pageio.crc32c(check)
        if value != hcrc:
            raise ChecksumError("header checksum mismatch", path=where, field="header_crc", offset=_CRC_FIELD,
                                expected=f"{value:08x}", got=f"{hcrc:08x}")
        stored_key = bytes(buf[HEADER.size:HEADER.size + key_len])
        if stored_key != key.encode("utf-8", "surrogatepass"):
            raise FormatError("the page holds another key", path=where, field="key", offset=HEADER.size,
                              expected=key, got=stored_key.decode("utf-8", "replace"))
        return _Header(key_len, meta_len, offset, size, created, pcrc), bytes(buf[HEADER.size + key_len:end])

    def _payload_mismatch(self, name: str, hdr: _Header, value: int) -> ChecksumError:
        return ChecksumError("payload checksum mismatch", path=self._fs.where(f"{self.rel}/{name}"),
                             field="payload_crc", offset=_PAYLOAD_CRC_FIELD, expected=f"{hdr.payload_crc:08x}",
                             got=f"{value:08x}")

    def _open(self, name: str) -> tuple[int, os.stat_result] | None:
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self.dir_fd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENAMETOOLONG, errno.EISDIR):
                return None  # a planted link or special file: never a hit
            raise
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode) or self._expired_ns(st.st_mtime_ns):
            os.close(fd)
            return None
        return fd, st

    def read(self, key: str, alloc: Callable[[bytes, int], Any]) -> Any:
        """The page of ``key`` read into memory that ``alloc(meta, payload_size)`` returns (a writable
        buffer, or a list of them, of exactly ``payload_size`` bytes; None to give up), checked; what
        ``alloc`` returned, or None for a miss (absent, expired, damaged, or ``alloc`` gave None)."""
        return self._read_general(page_name(key), key, alloc)

    def get_into(self, key: str, out: Any) -> bool:
        """Read the page of ``key`` into ``out`` (a writable buffer or a list of them whose sizes add up
        to the payload's): True for a hit, checked; False for a miss (absent, expired, damaged, or a
        page of another size)."""
        return self._read_batch([page_name(key)], [key], [writable_views(out)])[0]

    def get(self, key: str) -> tuple[bytes, bytearray] | None:
        """``(meta, payload)`` of ``key`` in new memory, or None for a miss."""
        box: list[bytes] = []

        def alloc(meta: bytes, n: int) -> bytearray:
            box.append(meta)
            return bytearray(n)

        got = self._read_general(page_name(key), key, alloc)
        return None if got is None else (box[0], got)

    def _read_general(self, name: str, key: str, alloc: Callable[[bytes, int], Any]) -> Any:
        """One page of any size and metadata, into what ``alloc`` returns: the header first, then the
        payload (the path of pages with metadata, LMCache's)."""
        if self.warm_budget_bytes:
            got = self._read_warm(name, alloc)
            if got is not None:
                self.stats["hits"] += 1
                return got
        opened = self._open(name)
        if opened is None:
            self.stats["misses"] += 1
            return None
        fd, st = opened
        ident = self._ident(st)
        where = self._fs.where(f"{self.rel}/{name}")
        try:
            try:
                first = bytearray(min(st.st_size, _ALIGN_LARGE))
                n = _preadv_full(fd, [memoryview(first)], 0)
                if n >= HEADER.size and first[:4] == MAGIC:
                    key_len, meta_len = HEADER.unpack_from(first)[3], HEADER.unpack_from(first)[5]
                    need = min(HEADER.size + key_len + meta_len, st.st_size)
                    if need > n and meta_len <= MAX_META_BYTES:
                        first = bytearray(need)
                        n = _preadv_full(fd, [memoryview(first)], 0)
                hdr, meta = self._parse(name, key, memoryview(first)[:n], st.st_size)
                result = alloc(meta, hdr.payload_size)
                if result is None:
                    raise _WrongSize
                dest = writable_views(result)
                if sum(len(v) for v in dest) != hdr.payload_size:
                    raise InvalidArgumentError(f"alloc gave {sum(len(v) for v in dest)} bytes for a payload "
                                               f"of {hdr.payload_size}")
                got = _preadv_full(fd, dest, hdr.payload_offset)
                if got != hdr.payload_size:
                    raise TruncatedError("short read", path=where, field="payload", offset=hdr.payload_offset,
                                         expected=hdr.payload_size, got=got)
                if self.verify:
                    value = _crc(dest)
                    if value != hdr.payload_crc:
                        raise self._payload_mismatch(name, hdr, value)
            finally:
                os.close(fd)
        except _WrongSize:
            self.stats["misses"] += 1
            return None
        except FormatError as exc:
            self._damaged(name, ident, exc)
            self.stats["misses"] += 1
            return None
        except OSError as exc:  # an I/O error: a miss, the file left for the next reader (and gc)
            _log.warning("%s: page not read: %s", where, exc)
            self.stats["misses"] += 1
            return None
        self._hit(name, ident, meta, hdr, dest)
        return result

    def _read_batch(self, names: list[str], keys: Sequence[str], views: list[list[memoryview]]) -> list[bool]:
        """Pages without metadata into known destinations: the warm tier first, the rest in one call into
        C (open, read, checksum, on ``threads`` threads), then each header checked here.  A
        file of another size than the destination's page goes through :meth:`_read_general`."""
        out = [False] * len(names)
        todo = []
        for i, vs in enumerate(views):
            if self.warm_budget_bytes and self._read_warm(names[i], _fixed(vs)) is not None:
                self.stats["hits"] += 1
                out[i] = True
            else:
                todo.append(i)
        if not todo:
            return out
        heads = [bytearray(payload_offset(len(keys[i].encode("utf-8", "surrogatepass")), 0,
                                          sum(len(v) for v in views[i]))) for i in todo]
        res = _pageio.read_pages(self.dir_fd, [names[i].encode("ascii") for i in todo], heads,
                                 [views[i] for i in todo], threads=self.threads, checksum=self.verify,
                                 expire_ns=self._expire_ns())
        for head, i, (status, err, value, ident) in zip(heads, todo, res):
            name = names[i]
            if status == _pageio.OK:
                out[i] = self._check(name, keys[i], head, value, ident, views[i])
                continue
            if status == _pageio.OTHER_SIZE:
                out[i] = self._read_general(name, keys[i], _fixed(views[i])) is not None
                continue
            if status == _pageio.SHORT:
                self._damaged(name, ident, TruncatedError("the page ended early", path=self._fs.where(
                    f"{self.rel}/{name}"), expected=ident[2]))
            elif status == _pageio.ERROR:  # an I/O error: a miss, the file left for the next reader (and gc)
                _log.warning("%s: page not read: %s", self._fs.where(f"{self.rel}/{name}"),
                             OSError(err, os.strerror(err)))
            self.stats["misses"] += 1
        return out

    def _check(self, name: str, key: str, head: bytearray, value: int, ident: tuple,
               views: list[memoryview]) -> bool:
        """Whether a page read whole by C is a hit: its header, key and payload CRC (``value``)."""
        try:
            if head[:4] == MAGIC and HEADER.unpack_from(head)[6] != len(head):
                raise _WrongSize  # a page of another size (and metadata) that happens to add up
            hdr, meta = self._parse(name, key, memoryview(head), ident[2])
            if self.verify and value != hdr.payload_crc:
                raise self._payload_mismatch(name, hdr, value)
        except _WrongSize:
            self.stats["misses"] += 1
            return False
        except FormatError as exc:
            self._damaged(name, ident, exc)
            self.stats["misses"] += 1
            return False
        self._hit(name, ident, meta, hdr, views)
        return True

    def get_many_into(self, keys: Sequence[str], outs: Sequence[Any]) -> list[bool]:
        """:meth:`get_into` for each key, in one call on ``threads`` threads; per key, hit or miss."""
        if len(outs) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys and {len(outs)} destinations")
        return self._read_batch([page_name(k) for k in keys], keys, [writable_views(o) for o in outs])

    # -- the warm tier -------------------------------------------------------------------------------
    @staticmethod
    def _ident(st: os.stat_result) -> tuple:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _hit(self, name: str, ident: tuple, meta: bytes, hdr, views: list[memoryview]) -> None:
        """Count a hit, and keep the page in the warm tier when it fits its budget."""
        self.stats["hits"] += 1
        if self.warm_budget_bytes and hdr.payload_size <= self.warm_budget_bytes:
            self._keep_warm(name, ident, meta, views)

    def _keep_warm(self, name: str, ident: tuple, meta: bytes, views: list[memoryview]) -> None:
        data = b"".join(views)
        with self._warm_lock:
            old = self._warm.pop(name, None)
            if old is not None:
                self._warm_bytes -= len(old[2])
            while self._warm and self._warm_bytes + len(data) > self.warm_budget_bytes:
                _, (_, _, gone) = self._warm.popitem(last=False)
                self._warm_bytes -= len(gone)
            self._warm[name] = (tuple(ident), meta, data)
            self._warm_bytes += len(data)

    def _drop_warm(self, name: str) -> None:
        if self.warm_budget_bytes:
            with self._warm_lock:
                old = self._warm.pop(name, None)
                if old is not None:
                    self._warm_bytes -= len(old[2])

    def _read_warm(self, name: str, alloc: Callable[[bytes, int], Any]) -> Any:
        with self._warm_lock:
            entry = self._warm.get(name)
        if entry is None:
            return None
        ident, meta, data = entry
        st = self._live(name, None)
        if st is None or self._ident(st) != ident:
            self._drop_warm(name)
            return None
        result = alloc(meta, len(data))
        if result is None:
            return None
        pos = 0
        for v in writable_views(result):
            v[:] = data[pos:pos + len(v)]
            pos += len(v)
        with self._warm_lock:
            if name in self._warm:
                self._warm.move_to_end(name)
        return result

    @property
    def warm_used_bytes(self) -> int:
        return self._warm_bytes

    # -- listing and removal -------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """The keys of every unexpired page (names that are no key, temp files, are left out)."""
        now = self.clock()
        out = []
        with os.scandir(self.dir_fd) as it:
            for e in it:
                key = key_of_name(e.name)
                if key is None:
                    continue
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and not self._expired_ns(st.st_mtime_ns, now):
                        out.append(key)
        return out

    def delete(self, key: str) -> bool:
        """Remove the page of ``key``; True when there was one."""
        name = page_name(key)
        self._drop_warm(name)
        try:
            os.unlink(name, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return False
        return True

    def gc(self) -> int:
        """Remove expired pages and the temp files of writers that died an hour ago or more; how many."""
        now = self.clock()
        removed = 0
        with os.scandir(self.dir_fd) as it:
            entries = [(e.name, e.stat(follow_symlinks=False)) for e in it]
        for name, st in entries:
            tmp = name.startswith(".") and name.endswith(".tmp")
            if (tmp and st.st_mtime + _TMP_MAX_AGE <= time.time()) or (
                    not tmp and key_of_name(name) is not None and self._expired_ns(st.st_mtime_ns, now)):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dir_fd)
                    self._drop_warm(name)
                    removed += 1
        return removed

    def clear(self) -> int:
        """Remove every page of the namespace; how many."""
        removed = 0
        with os.scandir(self.dir_fd) as it:
            names = [e.name for e in it if key_of_name(e.name) is not None]
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.dir_fd)
                removed += 1
        with self._warm_lock:
            self._warm.clear()
            self._warm_bytes = 0
        return removed
