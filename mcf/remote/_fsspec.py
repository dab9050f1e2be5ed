"""Every other scheme through fsspec (``memory://``, ``file://``, ``hf://``, an HTTP URL with a query
string...), and every scheme when asked for (``backend="fsspec"``) or when obstore is not installed.

HTTP(S) requests are made on fsspec's own aiohttp session (its client options, proxies and redirects
apply), with the status and ``Content-Range`` of every answer checked and the body streamed into the
destination; a 429 or 503 with ``Retry-After`` waits as long as the server asked.  Other file systems
answer through ``cat_file``, checked by length only: an object store answering with the right number
of bytes from the wrong offset would go unnoticed there (S3 and GCS do not do this).
"""

from __future__ import annotations

import errno
import email.utils
import time

from mcf._core.optional import require
from mcf.errors import AccessError, InvalidArgumentError, MCFIOError, MissingDependencyError, MissingFileError
from mcf.remote._fetch import Retry
from mcf.remote._urls import redact, redact_text

__all__ = ["FsspecTransport", "url_to_fs"]


def _fsspec():
    return require("fsspec", feature="reading URLs", extra="remote")


def url_to_fs(url, storage_options):
    """fsspec's file system and path for ``url`` (``storage_options`` go to the file system)."""
    fsspec = _fsspec()
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:  # e.g. s3:// without s3fs: fsspec's message names the package
        raise MissingDependencyError(f"{redact(url)}: fsspec cannot load the file system for this URL: {exc}",
                                     package=getattr(exc, "name", None), feature=f"{url.split(':', 1)[0]}:// URLs") \
            from None
    except ValueError as exc:
        raise InvalidArgumentError(f"{redact(url)}: not a URL fsspec can open: {redact_text(str(exc))}") from None
    except TypeError as exc:   # an option the file system does not take
        raise InvalidArgumentError(f"{redact(url)}: fsspec's file system refused the storage options "
                                   f"{sorted(storage_options or {})}: {redact_text(str(exc))}") from None


def _with_timeout(url, opts, timeout):
    """fsspec's HTTP client has no socket timeout by default: add one unless the caller set client_kwargs."""
    if timeout is None or "client_kwargs" in opts or not url.lower().startswith(("http://", "https://")):
        return opts
    aiohttp = require("aiohttp", feature="reading http(s) URLs", extra="remote")
    t = float(timeout)
    return {**opts, "client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t)}}


def _retry_after(value) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (a number of seconds, or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


class FsspecTransport:
    name = "fsspec"
    # fsspec's asynchronous file systems run every request on one event loop, a single Python thread that
    # also handles each chunk of every body: past 4 in flight it only contends (measured over nginx)
    max_concurrency = 4

    def __init__(self, url: str, opts: dict, *, timeout: float | None, redacted: str):
        self.url = redacted
        self._fs, self._path = url_to_fs(url, _with_timeout(url, opts, timeout))
        # HTTP(S): range requests on fsspec's aiohttp session (see _http_range); others: cat_file
        self._http = "http" in (getattr(self._fs, "protocol", ()) or ()) and hasattr(self._fs, "set_session")
        self.size_hint = None

    def size(self):
        info = self._fs.info(self._path)
        if info.get("type") == "directory":
            raise MCFIOError(errno.EISDIR, "is a directory, not a file", self.url)
        size = info.get("size")
        if size is None:
            raise MCFIOError(errno.EIO, "the server did not report the file's size (no Content-Length); mcf "
                             "needs it to bounds-check every read", self.url)
        size = int(size)
        if size < 0:
            raise MCFIOError(errno.EIO, f"the server reported a negative size {size}", self.url)
        self.size_hint = size
        return size

    def get(self, start: int, end: int, out=None):
        """One attempt: (data, landed).  HTTP streams into ``out`` when given (landed), else into a
        fresh buffer; a Retry verdict is returned (not raised) for a checked answer that was wrong."""
        if self._http:
            from fsspec.asyn import sync

            dst = out if out is not None else memoryview(bytearray(end - start))
            res = sync(self._fs.loop, self._http_range, start, end, dst)
            if not isinstance(res, int):    # a Retry verdict, or a final error (404, 403)
                return res, False
            return dst[:res], out is not None
        return self._fs.cat_file(self._path, start=start, end=end), False

    def classify(self, exc):
        if isinstance(exc, FileNotFoundError):
            return MissingFileError(errno.ENOENT, "no such remote file", self.url)
        if isinstance(exc, PermissionError):
            return AccessError(errno.EACCES, "access to the remote file was denied", self.url)
        return Retry(f"{type(exc).__name__}: {redact_text(str(exc))}")

    async def _http_range(self, start: int, end: int, mv: memoryview):
        """One range request on fsspec's aiohttp session, the body streamed into ``mv`` (no ``bytes`` of
        the whole body is built).  Returns the bytes received, or a Retry verdict; raises for transport
        errors (classified by the caller) and 404/403."""
        fs = self._fs
        session = await fs.set_session()
        kw = dict(fs.kwargs)
        headers = dict(kw.pop("headers", None) or {})
        headers["Range"] = f"bytes={start}-{end - 1}"
        headers.setdefault("Accept-Encoding", "identity")  # ranges of the stored bytes, never of a gzip body
        async with session.get(fs.encode_url(self._path), headers=headers, **kw) as r:
            if r.status == 404:
                return MissingFileError(errno.ENOENT, "no such remote file", self.url)
            if r.status in (401, 403):
                return AccessError(errno.EACCES, "access to the remote file was denied", self.url)
            if r.status == 200:
                if not (start == 0 and end == self.size_hint):
                    return Retry(f"status 200 for a {end - start}-byte range at offset {start}: the server ignored "
                                 "the Range header (it must answer 206 Partial Content)", transient=False)
            elif r.status == 206:
                why = self._check_content_range(r.headers.get("Content-Range"), start, end)
                if why:
                    return Retry(why)
            else:
                transient = r.status >= 500 or r.status in (408, 429)
                return Retry(f"HTTP status {r.status} {r.reason}", transient=transient,
                             retry_after=_retry_after(r.headers.get("Retry-After")))
            n, want = 0, end - start
            async for chunk in r.content.iter_any():
                k = len(chunk)
                if n + k > want:
                    return Retry(f"got more than the {want} bytes of the range (short Content-Range?)")
                mv[n:n + k] = chunk
                n += k
        return n

    def _check_content_range(self, value, start, end):
        """None when ``Content-Range: bytes a-b/total`` names exactly the requested range of this file."""
        try:
            unit, rest = value.split(" ", 1)
            span, total = rest.split("/", 1)
            a, b = (int(x) for x in span.split("-", 1))
        except (AttributeError, ValueError):
            return f"206 answer with a missing or malformed Content-Range {value!r}"
        if unit != "bytes" or a != start or b != end - 1 or (total != "*" and int(total) != self.size_hint):
            return (f"206 answer for the wrong range: Content-Range {value!r}, asked for bytes {start}-{end - 1}"
                    f"/{self.size_hint}")
        return None
