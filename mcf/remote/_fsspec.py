"""Every other scheme through fsspec (``memory://``, ``file://``, ``hf://``, an HTTP URL with a query
string...), and every scheme when asked for (``backend="fsspec"``) or when obstore is not installed.

HTTP(S) requests (``backend="fsspec"``) are made on fsspec's own aiohttp session (its client options and
proxies apply) with the rules of mcf's own client (:mod:`mcf.remote._http`): redirects followed by hand, no
credential to another origin; ``If-Match`` the ETag seen at opening and every answer's ETag compared; the
status and ``Content-Range`` checked; the body streamed into the destination and cut off at the range's
length; a deadline of ``timeout + bytes / min_rate`` per request; a 429 or 503 with ``Retry-After`` waits as
long as the server asked.  Other file systems answer through ``cat_file``, checked by length, and the
file's identity (ETag, modification time, size from ``info``) is compared with the opening's after every
answer, at the cost of one more request each: an object store answering with the right number of bytes
from the wrong offset would go unnoticed there (S3 and GCS do not do this), and ``cat_file`` holds a whole
answer in memory before mcf sees it (parts are at most ``request_size`` bytes).
"""

from __future__ import annotations

import errno

from mcf._core.optional import require
from mcf.errors import AccessError, InvalidArgumentError, MCFIOError, MissingDependencyError, MissingFileError
from mcf.remote._fetch import Retry
from mcf.remote._http import CREDENTIAL_HEADERS, MAX_REDIRECTS, parse_content_range, retry_after
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


class FsspecTransport:
    name = "fsspec"
    counts_bytes = True     # HTTP counts each chunk as it arrives; cat_file's answers are counted here
    # fsspec's asynchronous file systems run every request on one event loop, a single Python thread that
    # also handles each chunk of every body: past 4 in flight it only contends (measured over nginx)
    max_concurrency = 4

    def __init__(self, url: str, opts: dict, *, timeout: float | None, min_rate: float, redacted: str):
        self.url = redacted
        self._fs, self._path = url_to_fs(url, _with_timeout(url, opts, timeout))
        # HTTP(S): range requests on fsspec's aiohttp session (see _http_range); others: cat_file
        self._http = "http" in (getattr(self._fs, "protocol", ()) or ()) and hasattr(self._fs, "set_session")
        # s3fs: get_object read in bounded pieces (its cat_file holds a whole answer, whatever its length)
        self._s3 = not self._http and hasattr(self._fs, "_call_s3") and hasattr(self._fs, "split_path")
        self.size_hint = None
        self.etag = None
        self.modified = None
        self.identity = None
        self.timeout = timeout
        self.min_rate = float(min_rate)
        self.count = lambda n: None

    def _deadline(self, nbytes: int) -> float:
        return (self.timeout if self.timeout is not None else 60.0) + nbytes / self.min_rate

    @staticmethod
    def _identity(info: dict):
        """What tells two versions of a file apart in an fsspec ``info`` answer."""
        keys = ("ETag", "etag", "e_tag", "mtime", "LastModified", "last_modified", "updated", "size")
        return tuple((k, str(info[k])) for k in keys if info.get(k) is not None)

    def size(self):
        if self._http:
            from fsspec.asyn import sync

            res = sync(self._fs.loop, self._http_head)
            if isinstance(res, BaseException):
                raise res
            return res
        info = self._fs.info(self._path)
        self.identity = self._identity(info)
        if self._s3:
            self.etag = info.get("ETag") or None
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
        if self._s3:
            from fsspec.asyn import sync

            dst = out if out is not None else memoryview(bytearray(end - start))
            res = sync(self._fs.loop, self._s3_range, start, end, dst)
            if not isinstance(res, int):
                return res, False
            return dst[:res], out is not None
        data = self._fs.cat_file(self._path, start=start, end=end)
        self.count(len(data))
        if self.identity:
            now = self._identity(self._fs.info(self._path))
            if now != self.identity:
                return MCFIOError(errno.ESTALE, f"the remote file changed while it was read ({dict(self.identity)} "
                                  f"at opening, now {dict(now)}): open it again", self.url), False
        return data, False

    def classify(self, exc):
        if isinstance(exc, FileNotFoundError):
            return MissingFileError(errno.ENOENT, "no such remote file", self.url)
        if isinstance(exc, PermissionError):
            return AccessError(errno.EACCES, "access to the remote file was denied", self.url)
        import asyncio

        if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
            return Retry(f"timed out after the request's deadline (timeout + bytes / min_rate): {exc}")
        return Retry(f"{type(exc).__name__}: {redact_text(str(exc))}")

    async def _request(self, method: str, headers: dict, nbytes: int):
        """``method`` on fsspec's aiohttp session, redirects followed by hand: within one origin with every
        header, to another without any credential (the caller's headers, ``auth``, the URL's password);
        from https to http never.  Returns the response, to be used in ``async with``, or the final error
        a 404, 401 or 403 (or a refused redirect) means."""
        import aiohttp
        from yarl import URL

        fs = self._fs
        session = await fs.set_session()
        kw = dict(fs.kwargs)
        user_headers = dict(kw.pop("headers", None) or {})
        kw.pop("allow_redirects", None)
        kw.pop("timeout", None)
        t = self.timeout
        timeout = aiohttp.ClientTimeout(total=self._deadline(nbytes), sock_connect=t, sock_read=t)
        url = URL(fs.encode_url(self._path), encoded=True)
        first = url.origin()
        hdrs = {**user_headers, **headers, "Accept-Encoding": "identity"}
        for _ in range(MAX_REDIRECTS + 1):
            r = await session.request(method, url, headers=hdrs, allow_redirects=False, timeout=timeout, **kw)
            if r.status not in (301, 302, 303, 307, 308) or "Location" not in r.headers:
                refused = self._refused(r.status)
                if refused is not None:
                    r.release()
                    return refused
                return r
            new = url.join(URL(r.headers["Location"]))
            r.release()
            if new.scheme not in ("http", "https") or (url.scheme == "https" and new.scheme == "http"):
                return MCFIOError(errno.EIO, f"redirected to {redact(str(new))}: refused (not https after https, "
                                  "or not an http(s) URL)", self.url)
            if new.origin() != first:
                hdrs = {k: v for k, v in hdrs.items() if k.lower() not in CREDENTIAL_HEADERS and k not in user_headers}
                kw.pop("auth", None)
                new = new.with_user(None)
            url = new
        return MCFIOError(errno.EIO, f"more than {MAX_REDIRECTS} redirects", self.url)

    def _refused(self, status: int):
        """The final error a 404, 401 or 403 means, or None."""
        if status == 404:
            return MissingFileError(errno.ENOENT, "no such remote file", self.url)
        if status in (401, 403):
            return AccessError(errno.EACCES, f"access to the remote file was denied (HTTP {status})", self.url)
        return None

    async def _http_head(self):
        r = await self._request("HEAD", {}, 0)
        if isinstance(r, BaseException):
            return r
        async with r:
            if r.status != 200:
                return MCFIOError(errno.EIO, f"HTTP status {r.status} {r.reason} for HEAD", self.url)
            length = r.headers.get("Content-Length")
            if length is None or not length.strip().isdigit():
                return MCFIOError(errno.EIO, "the server did not report the file's size (no Content-Length); mcf "
                                  "needs it to bounds-check every read", self.url)
            self.size_hint = int(length)
            self.etag = r.headers.get("ETag") or None
            self.modified = r.headers.get("Last-Modified") or None
            return self.size_hint

    async def _http_range(self, start: int, end: int, mv: memoryview):
        """One range request on fsspec's aiohttp session, the body streamed into ``mv`` (no ``bytes`` of
        the whole body is built).  Returns the bytes received, or a verdict (a Retry, or a final error)."""
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if self.etag and not self.etag.startswith("W/"):
            headers["If-Match"] = self.etag
        r = await self._request("GET", headers, end - start)
        if isinstance(r, BaseException):
            return r
        async with r:
            if r.status == 412:
                return MCFIOError(errno.ESTALE, f"the remote file changed while it was read (its ETag is no longer "
                                  f"{self.etag}): open it again", self.url)
            etag, modified = r.headers.get("ETag"), r.headers.get("Last-Modified")
            if self.etag is not None and etag is not None and etag != self.etag:
                return MCFIOError(errno.ESTALE, f"the remote file changed while it was read (its ETag was "
                                  f"{self.etag}, the server now answers {etag}): open it again", self.url)
            if self.etag is None and self.modified is not None and modified is not None and modified != self.modified:
                return MCFIOError(errno.ESTALE, f"the remote file changed while it was read (its Last-Modified was "
                                  f"{self.modified}, the server now answers {modified}): open it again", self.url)
            if r.status == 200:
                if not (start == 0 and end == self.size_hint):
                    return Retry(f"status 200 for a {end - start}-byte range at offset {start}: the server ignored "
                                 "the Range header (it must answer 206 Partial Content)", transient=False)
            elif r.status == 206:
                why = self._check_content_range(r.headers.get("Content-Range"), start, end)
                if why:
                    return why if isinstance(why, BaseException) else Retry(why)
            else:
                transient = r.status >= 500 or r.status in (408, 429)
                return Retry(f"HTTP status {r.status} {r.reason}", transient=transient,
                             retry_after=retry_after(r.headers.get("Retry-After")))
            n, want = 0, end - start
            length = r.headers.get("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > want:
                return Retry(f"the answer announces {length} bytes (Content-Length) for a {want}-byte range: "
                             "refused before reading it", transient=False)
            async for chunk in r.content.iter_any():
                n = self._land(mv, n, chunk, want)
                if isinstance(n, Retry):
                    return n
        return n

    def _land(self, mv: memoryview, n: int, chunk, want: int):
        """Copy one piece of an answer to ``mv[n:]``: the new count, or a Retry when it passes the range."""
        k = len(chunk)
        self.count(k)
        if n + k > want:
            return Retry(f"got more than the {want} bytes of the range", transient=False)
        mv[n:n + k] = chunk
        return n + k

    async def _s3_range(self, start: int, end: int, mv: memoryview):
        """One ``get_object`` of s3fs with ``Range`` and ``IfMatch``, its body read in pieces of at most 1 MiB
        straight into ``mv`` under the request's deadline and never past the range.  Returns the bytes
        received or a verdict; raises what s3fs raises (classified by the caller)."""
        import asyncio
        import time

        want = end - start
        deadline = time.monotonic() + self._deadline(want)
        bucket, key, version = self._fs.split_path(self._path)
        kw = {"Range": f"bytes={start}-{end - 1}"}
        if version:
            kw["VersionId"] = version
        if self.etag:
            kw["IfMatch"] = self.etag
        try:
            resp = await asyncio.wait_for(self._fs._call_s3("get_object", Bucket=bucket, Key=key, **kw),
                                          max(0.001, deadline - time.monotonic()))
        except OSError as exc:
            if "PreconditionFailed" in str(exc) or "412" in str(exc):
                return MCFIOError(errno.ESTALE, f"the remote file changed while it was read (its ETag is no "
                                  f"longer {self.etag}): open it again", self.url)
            raise
        body = resp["Body"]
        try:
            etag = resp.get("ETag")
            if self.etag is not None and etag is not None and etag != self.etag:
                return MCFIOError(errno.ESTALE, f"the remote file changed while it was read (its ETag was "
                                  f"{self.etag}, the server now answers {etag}): open it again", self.url)
            why = self._check_content_range(resp.get("ContentRange"), start, end)
            if why:
                return why if isinstance(why, BaseException) else Retry(why)
            length = resp.get("ContentLength")
            if length is not None and int(length) > want:
                return Retry(f"the answer announces {length} bytes (Content-Length) for a {want}-byte range: "
                             "refused before reading it", transient=False)
            n = 0
            while n < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    return Retry(f"timed out: {n} of {want} bytes, slower than the minimum rate of "
                                 f"{self.min_rate:.0f} bytes/s (min_rate)")
                chunk = await asyncio.wait_for(body.read(min(1 << 20, want - n + 1)), left)
                if not chunk:
                    break
                n = self._land(mv, n, chunk, want)
                if isinstance(n, Retry):
                    return n
            return n
        finally:
            body.close()

    def _check_content_range(self, value, start, end):
        """None when ``Content-Range: bytes a-b/total`` names exactly the requested range of this file."""
        cr = parse_content_range(value)
        if cr is None:
            return f"206 answer with a missing or malformed Content-Range {value!r}"
        a, b, total = cr
        if total is not None and total != self.size_hint:
            return MCFIOError(errno.ESTALE, f"the remote file changed while it was read (its size was "
                              f"{self.size_hint}, the server now answers {total}): open it again", self.url)
        if a != start or b != end - 1:
            return (f"206 answer for the wrong range: Content-Range {value!r}, asked for bytes {start}-{end - 1}"
                    f"/{self.size_hint}")
        return None
