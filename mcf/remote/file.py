"""RemoteFile: one remote object as a read-only, seekable file that the I/O core reads like any other (see
:mod:`mcf.remote` for how it reads)."""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict

from mcf._core.args import integer, real
from mcf._core.storage import defaults_for
from mcf._core.lifetime import ClosedOnExit
from mcf.errors import ArgumentTypeError, ClosedError, InvalidArgumentError, MCFIOError
from mcf.remote._fetch import Fetcher
from mcf.remote._plan import Part, plan
from mcf.remote._stores import default_options, fsspec_options
from mcf.remote._urls import is_url, redact, target

__all__ = ["RemoteFile", "DEFAULT_BLOCK_SIZE", "DEFAULT_CACHE_SIZE", "DEFAULT_REQUEST_SIZE", "DEFAULT_CONCURRENCY",
           "DEFAULT_COALESCE", "DEFAULT_RETRIES", "DEFAULT_RETRY_DELAY", "DEFAULT_TIMEOUT", "DEFAULT_MIN_RATE",
           "BACKENDS"]

DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_CACHE_SIZE = 64 << 20
# one ranged GET, and the requests in flight: the "object" row of the storage table, where every kind's
# read settings live (mcf._core.storage, which says why 8 MiB x 16).  128 MiB of answers at most.
DEFAULT_REQUEST_SIZE = defaults_for("object").chunk_bytes
DEFAULT_CONCURRENCY = defaults_for("object").threads
DEFAULT_COALESCE = 1 << 20
DEFAULT_RETRIES = 5
DEFAULT_RETRY_DELAY = 0.1
# seconds a connection may stay silent (connecting, or between two reads of a body) before the attempt
# fails and is retried: a stalled server must not hang a reader
DEFAULT_TIMEOUT = 60.0
# bytes per second a request must keep up on average once its ``timeout`` of grace is over: a request of n
# bytes fails (and is retried) after timeout + n / min_rate seconds.  16 KiB/s per request is a 2 Mbit/s link
# shared by 16 requests in flight: slower than any link a checkpoint is loaded over, faster than a server
# dripping bytes to hold a reader (an 8 MiB part then ends within 10 minutes, a 1 MiB block within 2)
DEFAULT_MIN_RATE = 16 << 10
BACKENDS = ("auto", "http", "obstore", "fsspec")

def _obstore_installed() -> bool:
    try:
        import obstore  # noqa: F401 - a cached import after the first one
    except ImportError:
        return False
    return True


def _transport(url, tgt, backend, opts, *, timeout, min_rate, request_size, concurrency, redacted):
    """The client of one URL (see :mod:`mcf.remote`): mcf's HTTP client for http(s) and, through URLs mcf
    signs, for S3; obstore's own client where mcf cannot sign (GCS, Azure, S3 with role credentials);
    fsspec for every other scheme, without obstore, and wherever asked for."""
    if backend == "fsspec" or (backend == "auto" and tgt.kind == "fsspec"):
        from mcf.remote._fsspec import FsspecTransport

        return FsspecTransport(url, fsspec_options(tgt.kind, opts), timeout=timeout, min_rate=min_rate,
                               redacted=redacted)
    if tgt.kind == "fsspec":
        raise InvalidArgumentError(f"{redacted}: backend={backend!r} reads s3://, gs://, az://, abfs:// and "
                                   "http(s):// URLs; this one needs backend='fsspec'")
    if tgt.kind == "s3" and backend in ("auto", "http"):
        from mcf.remote._sigv4 import s3_signer

        signer = s3_signer(tgt, opts)
        if signer is not None:
            from mcf.remote._http import HttpTransport

            return HttpTransport(signer("GET"), client_options=opts.get("client_options"), timeout=timeout,
                                 min_rate=min_rate, concurrency=concurrency, redacted=redacted, signer=signer)
        if backend == "http":
            raise InvalidArgumentError(f"{redacted}: backend='http' signs S3 requests with keys from the options, "
                                       "the environment or a profile (or anon=True); these credentials or options "
                                       "need backend='obstore'")
    if backend == "obstore" or (backend == "auto" and tgt.kind != "http"):
        if backend == "auto" and not _obstore_installed():
            from mcf.remote._fsspec import FsspecTransport

            return FsspecTransport(url, fsspec_options(tgt.kind, opts), timeout=timeout, min_rate=min_rate,
                                   redacted=redacted)
        from mcf.remote._obstore import ObstoreTransport

        return ObstoreTransport(tgt, opts, timeout=timeout, min_rate=min_rate, request_size=request_size,
                                url=redacted)
    if tgt.kind != "http":
        raise InvalidArgumentError(f"{redacted}: backend='http' reads http(s):// and s3:// URLs")
    from mcf.remote._http import HttpTransport

    extra = sorted(set(opts) - {"headers", "client_options", "anon"})
    if extra:
        raise InvalidArgumentError(f"storage_options for {redacted} take only ['anon', 'client_options', "
                                   f"'headers'], got {extra}")
    headers = opts.get("headers") or {}
    if not isinstance(headers, dict):
        raise ArgumentTypeError(f"storage_options['headers'] must be a dict, got {type(headers).__name__}")
    client = opts.get("client_options") or {}
    if not isinstance(client, dict):
        raise ArgumentTypeError(f"storage_options['client_options'] must be a dict, got {type(client).__name__}")
    return HttpTransport(url, headers=headers, client_options=client, timeout=timeout, min_rate=min_rate,
                         concurrency=concurrency, redacted=redacted)


class RemoteFile(ClosedOnExit):
    """A read-only, seekable file over ranged GETs.  See :mod:`mcf.remote`.

    ``size`` is fetched once at opening (an object whose size is unknown is refused).  Large reads are
    cut into ``request_size`` parts, ``concurrency`` in flight; ranges less than ``coalesce`` bytes
    apart share a request; small reads go through an LRU cache of ``block_size`` blocks
    (``cache_size`` bytes in all).  ``retries`` bounds the extra attempts per request (exponential
    backoff from ``retry_delay`` seconds, with jitter); ``timeout`` is the longest a connection may stay
    silent.  ``storage_options`` configure the store (credentials, endpoint, region: see
    :func:`mcf.remote.storage_options`); ``backend`` picks the client ("auto": obstore for object
    stores and HTTP, fsspec for the rest).  ``stats`` counts requests, retries, cache hits, bytes
    fetched and the most requests in flight at once.
    """

    def __init__(self, url: str, *, block_size: int = DEFAULT_BLOCK_SIZE, cache_size: int = DEFAULT_CACHE_SIZE,
                 request_size: int = DEFAULT_REQUEST_SIZE, concurrency: int = DEFAULT_CONCURRENCY,
                 coalesce: int = DEFAULT_COALESCE, retries: int = DEFAULT_RETRIES,
                 retry_delay: float = DEFAULT_RETRY_DELAY, timeout: float | None = DEFAULT_TIMEOUT,
                 min_rate: float = DEFAULT_MIN_RATE, storage_options: dict | None = None, backend: str = "auto"):
        if isinstance(url, bytes):
            url = url.decode()
        if not is_url(url):
            raise InvalidArgumentError(f"{url!r} is not a URL (expected scheme://...)")
        self.url = url
        self.name = redact(url)
        self.block_size = integer(block_size, "block_size", minimum=1)
        self.request_size = integer(request_size, "request_size", minimum=1)
        self.cache_size = integer(cache_size, "cache_size", minimum=0)
        self.concurrency = integer(concurrency, "concurrency", minimum=1)
        self.coalesce = integer(coalesce, "coalesce", minimum=0)
        self.retries = integer(retries, "retries", minimum=0)
        self.retry_delay = real(retry_delay, "retry_delay")
        if not self.retry_delay >= 0:
            raise InvalidArgumentError(f"retry_delay must be >= 0 seconds, got {retry_delay!r}")
        if timeout is not None:
            timeout = real(timeout, "timeout")
            if not timeout > 0:
                raise InvalidArgumentError(f"timeout must be > 0 seconds (or None), got {timeout!r}")
        self.timeout = timeout
        min_rate = real(min_rate, "min_rate")
        if not min_rate > 0:
            raise InvalidArgumentError(f"min_rate must be > 0 bytes per second, got {min_rate!r}")
        self.min_rate = min_rate
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if storage_options is None:
            storage_options = default_options(url)
        elif not isinstance(storage_options, dict):
            raise ArgumentTypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        self._opts = dict(storage_options)
        self._backend_asked = backend
        self._transport = _transport(url, target(url), backend, self._opts, timeout=timeout, min_rate=min_rate,
                                     request_size=self.request_size, concurrency=self.concurrency,
                                     redacted=self.name)
        self.backend = self._transport.name
        self._pos = 0
        self._closed = False
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "retries": 0, "cache_hits": 0, "bytes_fetched": 0, "max_in_flight": 0}
        self._fetcher = Fetcher(self._transport, url=self.name, size=0, retries=self.retries,
                                retry_delay=self.retry_delay, concurrency=self.concurrency, stats=self.stats)
        self.size = self._fetcher.size = self._fetcher.call(self._transport.size, "the size")

    # -- reading -------------------------------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise ClosedError(f"{self.name}: I/O operation on a closed remote file")

    def _fetch_plan(self, ranges, threads=None, chunk_bytes=None) -> None:
        """Fetch (offset, memoryview) ranges: coalesced, split into parts, ``concurrency`` in flight."""
        f = self._fetcher
        part = self.request_size if chunk_bytes is None else integer(chunk_bytes, "chunk_bytes", minimum=1)
        conc = self.concurrency if threads is None else integer(threads, "threads", minimum=1)
        parts = plan(ranges, part_size=part, coalesce=min(self.coalesce, part))
        saved = f.concurrency
        f.concurrency = conc
        try:
            f.fetch_all(parts)
        finally:
            f.concurrency = saved

    def _block(self, k: int):
        blk = self._cache.get(k)
        if blk is not None:
            self._cache.move_to_end(k)
            self.stats["cache_hits"] += 1
        return blk

    def _cached_copy(self, start: int, mv: memoryview) -> bool:
        """Copy [start, start+len(mv)) from the cache when every block of it is there."""
        bs = self.block_size
        first, last = start // bs, (start + len(mv) - 1) // bs
        if any(k not in self._cache for k in range(first, last + 1)):
            return False
        self._copy_blocks({k: self._block(k) for k in range(first, last + 1)}, start, mv)
        return True

    def _copy_blocks(self, blocks, start, mv):
        bs, n, pos = self.block_size, len(mv), 0
        for j in range(start // bs, (start + n - 1) // bs + 1):
            blk = blocks[j]
            lo = start + pos - j * bs
            take = min(len(blk) - lo, n - pos)
            mv[pos:pos + take] = blk[lo:lo + take]
            pos += take

    def _read_cached(self, start: int, mv: memoryview) -> None:
        """A small read through the block cache: missing neighbouring blocks in one request."""
        bs = self.block_size
        n = len(mv)
        first, last = start // bs, (start + n - 1) // bs
        blocks = {}
        k = first
        while k <= last:
            blk = self._block(k)
            if blk is not None:
                blocks[k] = blk
                k += 1
                continue
            run = k
            while run + 1 <= last and (run + 1) not in self._cache:
                run += 1
            a, b = k * bs, min((run + 1) * bs, self.size)
            buf = bytearray(b - a)
            self._fetcher.fetch(Part(a, b, [(a, memoryview(buf))]))
            data = bytes(buf)
            for j in range(k, run + 1):
                blocks[j] = data[(j - k) * bs:(j - k + 1) * bs]
                if self.cache_size >= bs:
                    self._cache[j] = blocks[j]
            while len(self._cache) * bs > self.cache_size:
                self._cache.popitem(last=False)
            k = run + 1
        self._copy_blocks(blocks, start, mv)

    def readinto(self, buffer) -> int:
        self._check_open()
        mv = memoryview(buffer).cast("B")
        n = min(len(mv), max(0, self.size - self._pos))
        if n == 0:
            return 0
        with self._lock:
            if n > 4 * self.block_size:
                self._fetch_plan([(self._pos, mv[:n])])
            else:
                self._read_cached(self._pos, mv[:n])
        self._pos += n
        return n

    def readinto_ranges(self, offsets, buffers, *, threads=None, chunk_bytes=None) -> None:
        """Fill each of ``buffers`` from the matching offset, all at once: ranges already in the block
        cache are copied from it, the others coalesced and split into parts with ``concurrency``
        requests in flight across the whole plan (``threads`` and ``chunk_bytes`` override the
        concurrency and the part size for this call).  The I/O core's ``read_ranges``/``read_into``
        call this; the file position is unchanged."""
        self._check_open()
        ranges = []
        for off, buf in zip(offsets, buffers):
            mv = memoryview(buf).cast("B")
            off = integer(off, "offset")
            if off < 0 or off + len(mv) > self.size:
                raise MCFIOError(errno.EINVAL, f"range of {len(mv)} bytes at offset {off} is outside the file "
                                 f"(size {self.size})", self.name)
            if mv.readonly:
                raise InvalidArgumentError(f"{self.name}: the destination of the range at offset {off} is read-only")
            if len(mv):
                ranges.append((off, mv))
        with self._lock:
            todo = [(off, mv) for off, mv in ranges if not (self._cache and self._cached_copy(off, mv))]
            if todo:
                self._fetch_plan(todo, threads, chunk_bytes)

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = max(0, self.size - self._pos)
        buf = bytearray(min(size, max(0, self.size - self._pos)))
        got = self.readinto(buf)
        return bytes(buf[:got])

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            pos = offset
        elif whence == os.SEEK_CUR:
            pos = self._pos + offset
        elif whence == os.SEEK_END:
            pos = self.size + offset
        else:
            raise InvalidArgumentError(f"bad whence {whence}")
        if pos < 0:
            raise InvalidArgumentError("negative seek position")
        self._pos = int(pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def version(self) -> dict:
        """The object's version pinned at opening (``etag``, ``modified``): every read is held to it.

        ``modified`` is the Last-Modified date as a string; each is None when the server sent none."""
        t = self._transport
        modified = getattr(t, "modified", None) or getattr(t, "last_modified", None)
        return {"etag": getattr(t, "etag", None), "modified": None if modified is None else str(modified)}

    @property
    def bytes_fetched(self) -> int:
        """Bytes that arrived from the server so far (a coalesced gap's, a refused answer's and a retried
        attempt's included): what :attr:`mcf.io.Source.bytes_read` reports for a URL."""
        return self.stats["bytes_fetched"]

    def close(self) -> None:
        self._closed = True
        self._cache.clear()
        closer = getattr(self._transport, "close", None)
        if closer is not None:
            closer()

    def __reduce__(self):
        # reopened by URL in the receiving process (DataLoader workers)
        return (_reopen, (self.url, {"block_size": self.block_size, "cache_size": self.cache_size,
                                     "request_size": self.request_size, "concurrency": self.concurrency,
                                     "coalesce": self.coalesce, "retries": self.retries,
                                     "retry_delay": self.retry_delay, "timeout": self.timeout,
                                     "min_rate": self.min_rate,
                                     "storage_options": self._opts, "backend": self._backend_asked}))

    def __repr__(self) -> str:
        return f"<mcf RemoteFile {self.name!r} {self.size} bytes via {self.backend}>"


def _reopen(url, kwargs):
    return RemoteFile(url, **kwargs)
