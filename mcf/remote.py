"""Remote files: any fsspec URL (``http(s)://``, ``s3://``, ``gs://``, ``memory://``, ``file://``...) read
with range requests through a block cache, as a file-like object the I/O core reads like any other.

:func:`mcf.io.open_source` turns a URL string into a ``fileobj`` :class:`mcf.io.Source` over a
:class:`RemoteFile`, so every reader that opens its input with ``open_source`` (MCF, safetensors, GGUF,
Megatron ``.idx``/``.bin``, MegaContext ``.ctx``, MCB ``kv_data.mcb``) reads URLs without knowing it.

Why a class of our own on top of fsspec instead of ``fsspec.open(...)``: a remote server can answer a
range request with fewer bytes than asked (a dropped connection, a truncated body), ignore ``Range``
and send the whole file with status 200, or label another range in ``Content-Range``.  fsspec hands
such answers back as they are; a tensor read from them would be silently short or shifted.  Here every
answer's length is checked against the request (for HTTP also its status and ``Content-Range``: those
requests are made on fsspec's aiohttp session by :meth:`RemoteFile._http_range`, which streams the
body into the destination), transient failures are retried a bounded number of times, and the last
failure becomes an :class:`mcf.MCFIOError` naming the URL, the offset and both sizes.  The file size must be known up front
(``HEAD``/``Content-Length``), since every bounds check of the readers depends on it.

Small reads go through an LRU cache of aligned blocks (``block_size``, default 1 MiB; a header, an index
and many short sequences cost a few requests, not one each); reads of more than ``4 * block_size`` bytes
bypass the cache and are fetched in ``request_size`` pieces, concurrently where the file system is
asynchronous (HTTP), straight into the caller's buffer.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections import OrderedDict

from mcf._core.optional import require
from mcf.errors import AccessError, ClosedError, InvalidArgumentError, MCFIOError, MissingDependencyError, MissingFileError

__all__ = ["RemoteFile", "is_url", "open_remote", "refuse_url",
           "DEFAULT_BLOCK_SIZE", "DEFAULT_CACHE_SIZE", "DEFAULT_REQUEST_SIZE", "DEFAULT_RETRIES", "DEFAULT_TIMEOUT"]

DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_CACHE_SIZE = 64 << 20
DEFAULT_REQUEST_SIZE = 16 << 20
DEFAULT_RETRIES = 3
# seconds an HTTP connection may stay silent (connecting, or between two reads of a body) before the
# attempt fails and is retried: a stalled server must not hang a reader
DEFAULT_TIMEOUT = 60.0
# concurrent requests of one large read (HTTP); bounds the bytes in flight to CONCURRENCY * request_size
CONCURRENCY = 4

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(obj) -> bool:
    """True for a string that names a protocol (``scheme://...``): such paths go through fsspec."""
    if isinstance(obj, bytes):
        try:
            obj = obj.decode()
        except UnicodeDecodeError:
            return False
    return isinstance(obj, str) and _URL.match(obj) is not None


def refuse_url(path, *, what: str = "writing") -> None:
    """Raise :class:`InvalidArgumentError` when ``path`` is a URL: remote files are read-only in mcf."""
    if is_url(path):
        raise InvalidArgumentError(f"{path}: {what} is not supported on remote URLs (remote files are read-only)")


def _fsspec():
    return require("fsspec", feature="reading URLs", extra="remote")


def url_to_fs(url, storage_options):
    fsspec = _fsspec()
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:  # e.g. s3:// without s3fs: fsspec's message names the package
        raise MissingDependencyError(f"{url}: fsspec cannot load the file system for this URL: {exc}",
                                     package=getattr(exc, "name", None), feature=f"{url.split(':', 1)[0]}:// URLs") \
            from None
    except ValueError as exc:
        raise InvalidArgumentError(f"{url}: not a URL fsspec can open: {exc}") from None


def _with_timeout(url, opts, timeout):
    """fsspec's HTTP client has no socket timeout by default: add one unless the caller set client_kwargs."""
    if timeout is None or "client_kwargs" in opts or not url.lower().startswith(("http://", "https://")):
        return opts
    aiohttp = require("aiohttp", feature="reading http(s) URLs", extra="remote")
    t = float(timeout)
    return {**opts, "client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t)}}


def _os_error(exc, url):
    if isinstance(exc, FileNotFoundError):
        return MissingFileError(errno.ENOENT, "no such remote file", url)
    if isinstance(exc, PermissionError):
        return AccessError(errno.EACCES, "access to the remote file was denied", url)
    return None


class RemoteFile:
    """A read-only, seekable file over range requests with a block cache.  See the module docstring.

    ``size`` is fetched once at opening (a URL whose size is unknown is refused);
    ``retries`` bounds the extra attempts per request (waiting ``retry_delay * 2**k`` seconds between
    them); ``timeout`` is the longest an HTTP connection may stay silent before an attempt fails;
    ``storage_options`` go to fsspec (credentials, endpoints); ``stats`` counts requests and cache hits.
    """

    def __init__(self, url: str, *, block_size: int = DEFAULT_BLOCK_SIZE, cache_size: int = DEFAULT_CACHE_SIZE,
                 request_size: int = DEFAULT_REQUEST_SIZE, retries: int = DEFAULT_RETRIES,
                 retry_delay: float = 0.05, timeout: float | None = DEFAULT_TIMEOUT,
                 storage_options: dict | None = None):
        if isinstance(url, bytes):
            url = url.decode()
        if not is_url(url):
            raise InvalidArgumentError(f"{url!r} is not a URL (expected scheme://...)")
        for label, v in (("block_size", block_size), ("request_size", request_size)):
            if int(v) < 1:
                raise InvalidArgumentError(f"{label} must be >= 1, got {v}")
        if int(retries) < 0 or int(cache_size) < 0:
            raise InvalidArgumentError("retries and cache_size must be >= 0")
        self.url = self.name = url
        self.block_size = int(block_size)
        self.request_size = int(request_size)
        self.cache_size = int(cache_size)
        self.retries = int(retries)
        self.retry_delay = float(retry_delay)
        self._opts = dict(storage_options or {})
        self.timeout = timeout
        self._fs, self._path = url_to_fs(url, _with_timeout(url, self._opts, timeout))
        # HTTP(S): range requests made on fsspec's own aiohttp session, status and Content-Range checked,
        # bodies streamed into the destination (see _http_range); other protocols use fsspec's cat_file
        self._http = "http" in (getattr(self._fs, "protocol", ()) or ()) and hasattr(self._fs, "set_session")
        self._pos = 0
        self._closed = False
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "retries": 0, "cache_hits": 0, "bytes_fetched": 0}
        self.size = self._fetch_size()

    # -- size -------------------------------------------------------------------------------------
    def _fetch_size(self) -> int:
        last = None
        for attempt in range(self.retries + 1):
            try:
                info = self._fs.info(self._path)
            except Exception as exc:  # noqa: BLE001 - see _fetch
                mapped = _os_error(exc, self.url)
                if mapped is not None:
                    raise mapped from None
                last = exc
                self._sleep(attempt)
                continue
            if info.get("type") == "directory":
                raise MCFIOError(errno.EISDIR, "is a directory, not a file", self.url)
            size = info.get("size")
            if size is None:
                raise MCFIOError(errno.EIO, "the server did not report the file's size (no Content-Length); "
                                 "mcf needs it to bounds-check every read", self.url)
            size = int(size)
            if size < 0:
                raise MCFIOError(errno.EIO, f"the server reported a negative size {size}", self.url)
            return size
        raise MCFIOError(errno.EIO, f"cannot get the size after {self.retries + 1} attempts: "
                         f"{type(last).__name__}: {last}", self.url)

    # -- fetching ---------------------------------------------------------------------------------
    def _sleep(self, attempt):
        if attempt < self.retries and self.retry_delay > 0:
            time.sleep(self.retry_delay * (2 ** attempt))

    def _check(self, data, start, end):
        """None when ``data`` is exactly the requested range, else what went wrong."""
        if isinstance(data, BaseException):
            return f"{type(data).__name__}: {data}"
        if len(data) == end - start:
            return None
        if len(data) == self.size and start > 0 or len(data) > end - start:
            return (f"got {len(data)} bytes for a {end - start}-byte range: the server ignored the Range "
                    "header (it must answer 206 Partial Content)")
        return f"got {len(data)} bytes for a {end - start}-byte range (short read)"

    def _fail(self, start, end, why, attempts=None):
        n = self.retries + 1 if attempts is None else attempts
        return MCFIOError(errno.EIO, f"range read of {end - start} bytes at offset {start} (file size "
                          f"{self.size}) failed after {n} attempt{'s' if n != 1 else ''}: {why}", self.url)

    def _fetch(self, start: int, end: int, out: memoryview | None = None, done: int = 0, why=None):
        """Exactly the bytes [start, end) (into ``out`` when given, else returned), retried; raises
        MCFIOError naming URL, offset and sizes.  ``done`` attempts (that failed with ``why``) were made
        by the caller already."""
        for attempt in range(done, self.retries + 1):
            self.stats["requests"] += 1
            if attempt:
                self.stats["retries"] += 1
            try:
                if self._http:
                    dst = out if out is not None else memoryview(bytearray(end - start))
                    data = self._sync(self._http_range, start, end, dst)
                    if data is None:
                        data = dst
                else:
                    data = self._fs.cat_file(self._path, start=start, end=end)
            except Exception as exc:  # noqa: BLE001 - back ends raise their own types (aiohttp, botocore...)
                mapped = _os_error(exc, self.url)
                if mapped is not None:
                    raise mapped from None
                data = exc
            why = data if isinstance(data, str) else self._check(data, start, end)
            if why is None:
                self.stats["bytes_fetched"] += end - start
                if out is not None and not self._http:
                    out[:] = data
                return data
            if "ignored the Range" in why:
                raise self._fail(start, end, why, attempt + 1)  # asking again gets the same whole-file answer
            self._sleep(attempt)
        if why is None:
            why = "no attempt left"
        raise self._fail(start, end, why)

    # -- HTTP ---------------------------------------------------------------------------------------
    def _sync(self, fn, *args):
        from fsspec.asyn import sync

        return sync(self._fs.loop, fn, *args)

    async def _http_range(self, start: int, end: int, mv: memoryview):
        """One range request on fsspec's aiohttp session, the body streamed into ``mv`` (no ``bytes`` of
        the whole body is built).  Returns None when ``mv`` holds exactly [start, end), else what went
        wrong (a string); raises for transport errors (retried by the caller) and 404/403."""
        fs = self._fs
        session = await fs.set_session()
        kw = dict(fs.kwargs)
        headers = dict(kw.pop("headers", None) or {})
        headers["Range"] = f"bytes={start}-{end - 1}"
        headers.setdefault("Accept-Encoding", "identity")  # ranges of the stored bytes, never of a gzip body
        async with session.get(fs.encode_url(self._path), headers=headers, **kw) as r:
            if r.status == 404:
                raise MissingFileError(errno.ENOENT, "no such remote file", self.url)
            if r.status in (401, 403):
                raise AccessError(errno.EACCES, "access to the remote file was denied", self.url)
            if r.status == 200:
                if not (start == 0 and end == self.size):
                    return (f"status 200 for a {end - start}-byte range at offset {start}: the server ignored "
                            "the Range header (it must answer 206 Partial Content)")
            elif r.status == 206:
                why = self._check_content_range(r.headers.get("Content-Range"), start, end)
                if why:
                    return why
            else:
                raise MCFIOError(f"HTTP status {r.status} {r.reason}")
            n, want = 0, end - start
            async for chunk in r.content.iter_any():
                k = len(chunk)
                if n + k > want:
                    return f"got more than the {want} bytes of the range (short Content-Range?)"
                mv[n:n + k] = chunk
                n += k
        if n != want:
            return f"got {n} bytes for a {want}-byte range (short read)"
        return None

    def _check_content_range(self, value, start, end):
        """None when ``Content-Range: bytes a-b/total`` names exactly the requested range of this file."""
        try:
            unit, rest = value.split(" ", 1)
            span, total = rest.split("/", 1)
            a, b = (int(x) for x in span.split("-", 1))
        except (AttributeError, ValueError):
            return f"206 answer with a missing or malformed Content-Range {value!r}"
        if unit != "bytes" or a != start or b != end - 1 or (total != "*" and int(total) != self.size):
            return (f"206 answer for the wrong range: Content-Range {value!r}, asked for bytes {start}-{end - 1}"
                    f"/{self.size}")
        return None

    def _split(self, start: int, mv: memoryview) -> list:
        """(start, end, destination) pieces of at most request_size bytes covering ``mv``."""
        n = len(mv)
        return [(a, min(a + self.request_size, start + n), mv[a - start:min(a + self.request_size, start + n) - start])
                for a in range(start, start + n, self.request_size)]

    def _fetch_pieces(self, pieces: list) -> None:
        """Fill every (start, end, destination) piece, CONCURRENCY at a time when the file system is
        asynchronous; each piece is checked, and a failed one is retried alone within its attempt budget."""
        if self._http:
            self._http_many(pieces)
            return
        batch = CONCURRENCY if getattr(self._fs, "async_impl", False) and len(pieces) > 1 else 1
        for i in range(0, len(pieces), batch):
            group = pieces[i:i + batch]
            if len(group) == 1:
                self._fetch(*group[0])
                continue
            self.stats["requests"] += len(group)
            try:
                results = self._fs.cat_ranges([self._path] * len(group), [a for a, _, _ in group],
                                              [b for _, b, _ in group], on_error="return")
            except Exception as exc:  # noqa: BLE001 - fall back to one checked request per piece
                results = [exc] * len(group)
            for (a, b, dst), data in zip(group, results):
                why = self._check(data, a, b)
                if why is None:
                    self.stats["bytes_fetched"] += b - a
                    dst[:] = data
                    continue
                mapped = _os_error(data, self.url) if isinstance(data, BaseException) else None
                if mapped is not None:
                    raise mapped
                self._sleep(0)
                self._fetch(a, b, dst, done=1, why=why)

    def _http_many(self, pieces: list) -> None:
        """HTTP pieces CONCURRENCY at a time, each streamed into its destination."""
        import asyncio

        async def group(g):
            return await asyncio.gather(*(self._http_range(a, b, dst) for a, b, dst in g), return_exceptions=True)

        for i in range(0, len(pieces), CONCURRENCY):
            g = pieces[i:i + CONCURRENCY]
            self.stats["requests"] += len(g)
            results = self._sync(group, g)
            for (a, b, dst), res in zip(g, results):
                if res is None:
                    self.stats["bytes_fetched"] += b - a
                    continue
                if isinstance(res, BaseException):
                    mapped = _os_error(res, self.url)
                    if mapped is not None:
                        raise mapped
                    if not isinstance(res, Exception):
                        raise res
                elif "ignored the Range" in res:
                    raise self._fail(a, b, res, 1)
                why = res if isinstance(res, str) else f"{type(res).__name__}: {res}"
                self._sleep(0)
                self._fetch(a, b, dst, done=1, why=why)

    def _block(self, k: int) -> bytes:
        blk = self._cache.get(k)
        if blk is not None:
            self._cache.move_to_end(k)
            self.stats["cache_hits"] += 1
            return blk
        return None

    def _read_cached(self, start: int, mv: memoryview) -> None:
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
            run = k   # one request for a run of missing blocks
            while run + 1 <= last and (run + 1) not in self._cache:
                run += 1
            a, b = k * bs, min((run + 1) * bs, self.size)
            data = self._fetch(a, b)
            if not isinstance(data, bytes):
                data = bytes(data)
            for j in range(k, run + 1):
                blocks[j] = data[(j - k) * bs:(j - k + 1) * bs]
                if self.cache_size >= bs:
                    self._cache[j] = blocks[j]
            while len(self._cache) * bs > self.cache_size:
                self._cache.popitem(last=False)
            k = run + 1
        pos = 0
        for j in range(first, last + 1):
            blk = blocks[j]
            lo = start + pos - j * bs
            take = min(len(blk) - lo, n - pos)
            mv[pos:pos + take] = blk[lo:lo + take]
            pos += take

    # -- file-like interface ---------------------------------------------------------------------
    def readinto(self, buffer) -> int:
        if self._closed:
            raise ClosedError("I/O operation on closed remote file")
        mv = memoryview(buffer).cast("B")
        n = min(len(mv), max(0, self.size - self._pos))
        if n == 0:
            return 0
        with self._lock:
            if n > 4 * self.block_size:
                self._fetch_pieces(self._split(self._pos, mv[:n]))
            else:
                self._read_cached(self._pos, mv[:n])
        self._pos += n
        return n

    def readinto_ranges(self, offsets, buffers) -> None:
        """Fill each of ``buffers`` from the matching offset, all at once: the large ones are split into
        request_size pieces fetched CONCURRENCY at a time across buffers (a whole model's tensors load
        with requests in flight, not one tensor after another), the small ones go through the cache.
        The I/O core's ``read_ranges`` (``Container.load``) uses this; the file position is unchanged."""
        if self._closed:
            raise ClosedError("I/O operation on closed remote file")
        pieces = []
        small = []
        for off, buf in zip(offsets, buffers):
            mv = memoryview(buf).cast("B")
            off = int(off)
            if off < 0 or off + len(mv) > self.size:
                raise MCFIOError(errno.EINVAL, f"range of {len(mv)} bytes at offset {off} is outside the file "
                                 f"(size {self.size})", self.url)
            if len(mv) > 4 * self.block_size:
                pieces += self._split(off, mv)
            elif len(mv):
                small.append((off, mv))
        with self._lock:
            for off, mv in small:
                self._read_cached(off, mv)
            if pieces:
                self._fetch_pieces(pieces)

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

    def close(self) -> None:
        self._closed = True
        self._cache.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        # reopened by URL in the receiving process (DataLoader workers)
        return (_reopen, (self.url, self.block_size, self.cache_size, self.request_size, self.retries,
                          self.retry_delay, self.timeout, self._opts))

    def __repr__(self) -> str:
        return f"<mcf RemoteFile {self.url!r} {self.size} bytes>"


def _reopen(url, block_size, cache_size, request_size, retries, retry_delay, timeout, opts):
    return RemoteFile(url, block_size=block_size, cache_size=cache_size, request_size=request_size,
                      retries=retries, retry_delay=retry_delay, timeout=timeout, storage_options=opts)


def open_remote(url, **kwargs):
    """A :class:`mcf.io.Source` over ``url`` (keyword arguments go to :class:`RemoteFile`)."""
    from mcf._core._io import Source

    return Source._from_fileobj(RemoteFile(url, **kwargs), owns=True)
