"""The object stores and HTTP(S) through obstore (the Python binding of Rust's object_store): ranged
GETs on a pooled connection per store, in Rust, with the GIL released while they run.

S3 with keys mcf knows (options, environment, profile, or none at all for ``anon``) does not come here: mcf
signs its URLs itself (:mod:`mcf.remote._sigv4`) and fetches them with its own HTTP client.
:class:`ObstoreTransport`, obstore's own client end to end, serves GCS, Azure, S3 with credentials only the
client can find (web identity, instance roles) or options only it knows, and ``backend="obstore"``: its
answers are streamed in bounded chunks and cut off at the range's length, every answer's ETag is compared
with the one pinned at opening, and a request's deadline is the store's overall timeout (``timeout +
request_size / min_rate``); redirects are reqwest's (it drops ``Authorization`` on a cross-origin one,
not other headers).  Its own retries are off: :mod:`mcf.remote._fetch` retries every part (one count,
one backoff, checked lengths).  Its errors are sorted here into final ones (404, 403, 401, a server
that ignores ``Range``, other 4xx) and transient ones (connection errors, timeouts, 5xx, 408, 429, a
body cut short); object_store does not expose ``Retry-After`` headers, so its backoff is mcf's own.
"""

from __future__ import annotations

import errno
import re
import time

from mcf._core.optional import require
from mcf.errors import AccessError, InvalidArgumentError, MCFIOError, MissingFileError
from mcf.remote._fetch import Retry
from mcf.remote._stores import object_store
from mcf.remote._urls import redact_text

__all__ = ["ObstoreTransport"]

def _fatal(exc: BaseException) -> bool:
    """True for the exceptions a client call must let through (not a failure of the request)."""
    return isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))


_STATUS = re.compile(r"status code: (\d{3})")


_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_CAUSE = re.compile(r"(?:source|error): ([A-Z]\w*)[,\s]")
_OS_MESSAGE = re.compile(r'message: "([^"]+)"')
_NOT_A_CAUSE = {"reqwest", "hyper", "RetryError", "RetryErrorImpl", "Generic", "HttpError", "Status", "Some", "None",
                "Body", "Custom"}


def _more_than(want: int) -> Retry:
    return Retry(f"got more than the {want} bytes of the range", transient=False)


def _first_line(exc) -> str:
    """The first line of an obstore error (its "Debug source" tree below is long), with the kind of the
    HTTP failure and its innermost cause from that tree: "... body error (Timeout: TimedOut)"."""
    text = str(exc).strip()
    lines = text.splitlines()
    line = re.sub(r"^(Generic \w+ error: )+", "", lines[0] if lines else type(exc).__name__)
    kind = _KIND.search(text)
    causes = _OS_MESSAGE.findall(text) or [c for c in _CAUSE.findall(text) if c not in _NOT_A_CAUSE]
    detail = ": ".join(x for x in (kind.group(1) if kind else None, causes[-1] if causes else None) if x)
    if detail:
        line += f" ({detail})"
    return redact_text(line)


class ObstoreTransport:
    """Size and ranged GETs of one object (``target``: see mcf.remote._urls.Target)."""

    name = "obstore"

    counts_bytes = True

    def __init__(self, target, opts: dict, *, timeout: float | None, min_rate: float, request_size: int, url: str):
        self._obstore = require("obstore", feature=f"reading {target.root.split(':', 1)[0]}:// URLs with obstore",
                                extra="remote")
        self.url = url    # redacted, for messages
        if target.kind == "http" and ("?" in target.url or "#" in target.url or "@" in target.root):
            raise InvalidArgumentError(f"{url}: backend='obstore' reads http(s) URLs without a query string, a "
                                       "fragment or credentials; use backend='auto'")
        # a request's deadline: the store's overall timeout, sized for the largest request
        deadline = (timeout if timeout is not None else 60.0) + request_size / min_rate
        self.store = object_store(target.kind, target.root, opts, timeout=timeout, deadline=deadline)
        self.path = target.key
        self.kind = target.kind
        self.timeout = timeout
        self.min_rate = float(min_rate)
        self.etag = None
        self.modified = None
        self.size_hint = None
        self.count = lambda n: None

    def size(self):
        try:
            meta = self._obstore.head(self.store, self.path)
        except FileNotFoundError:
            if self.kind == "s3":
                # a HEAD answer has no body: a one-byte GET tells a missing bucket from a missing key
                self._obstore.get_range(self.store, self.path, start=0, end=1)
            raise
        self.etag = meta.get("e_tag") or None
        self.modified = meta.get("last_modified")
        self.size_hint = int(meta["size"])
        return self.size_hint

    def get(self, start: int, end: int, out=None):
        """One attempt: (the bytes [start, end) in ``out`` or a fresh buffer, landed) or (a verdict, False).
        With the ETag of the opening, every GET is conditional (``If-Match``), and every answer's ETag (or
        modification time) and size are compared with the opening's too (for servers that ignore
        ``If-Match``).  The body comes one network read at a time, copied in place and cut
        off at the range's length: a server that sends more holds no more memory than one network read."""
        t0 = time.monotonic()
        deadline = t0 + (self.timeout if self.timeout is not None else 60.0) + (end - start) / self.min_rate
        opts = {"range": (start, end)}
        if self.etag is not None:
            opts["if_match"] = self.etag
        res = self._obstore.get(self.store, self.path, options=opts)
        meta = res.meta
        etag = meta.get("e_tag") or None
        if self.etag is not None and etag is not None and etag != self.etag:
            return self._changed("ETag", self.etag, etag), False
        if self.etag is None and self.modified is not None and meta.get("last_modified") not in (None, self.modified):
            return self._changed("modification time", self.modified, meta.get("last_modified")), False
        if meta.get("size") is not None and self.size_hint is not None and int(meta["size"]) != self.size_hint:
            return self._changed("size", self.size_hint, meta["size"]), False
        want = end - start
        dst = out if out is not None else memoryview(bytearray(want))
        n = 0
        for chunk in res.stream(min_chunk_size=1):      # each network read as it comes: the deadline is checked
            k = len(chunk)                              # between two of them, however slowly they come
            self.count(k)
            if n + k > want:
                return _more_than(want), False
            dst[n:n + k] = memoryview(chunk)
            n += k
            if time.monotonic() > deadline and n < want:
                return Retry(f"timed out: {n} of {want} bytes in {time.monotonic() - t0:.1f} s, slower than the "
                             f"minimum rate of {self.min_rate:.0f} bytes/s (min_rate) after the {self.timeout} s "
                             "allowed to start"), False
        return dst[:n], out is not None

    def _changed(self, what, was, now) -> MCFIOError:
        return MCFIOError(errno.ESTALE, f"the remote file changed while it was read (its {what} was {was}, the "
                          f"server now answers {now}): open it again", self.url)

    def classify(self, exc):
        """A final :class:`mcf.MCFError` or a :class:`Retry` verdict for an exception of obstore."""
        from obstore.exceptions import (InvalidPathError, NotFoundError, NotSupportedError, PermissionDeniedError,
                                        PreconditionError, UnauthenticatedError)

        line = _first_line(exc)
        if not isinstance(exc, Exception):   # a panic inside obstore (pyo3's PanicException): a bug, not a blip
            return MCFIOError(errno.EIO, f"obstore failed internally (a panic), not retried: {line}", self.url)
        if isinstance(exc, (InvalidPathError, TypeError, ValueError)):
            return InvalidArgumentError(f"{self.url}: obstore cannot use this object path: {line}")
        if isinstance(exc, (NotFoundError, FileNotFoundError)):
            what = "no such bucket" if "NoSuchBucket" in str(exc) else "no such remote file"
            return MissingFileError(errno.ENOENT, what, self.url)
        if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)):
            return AccessError(errno.EACCES, "access to the remote file was denied (check the credentials, "
                               f"and that they may read this object): {line}", self.url)
        if isinstance(exc, PreconditionError):
            return MCFIOError(errno.ESTALE, f"the remote file changed while it was read (its ETag is no longer "
                              f"{self.etag}): open it again", self.url)
        if isinstance(exc, NotSupportedError) and "Range request not supported" in line:
            return Retry("the server ignored the Range header (it must answer 206 Partial Content)",
                         transient=False)
        if "Content-Length Header missing" in line:
            return MCFIOError(errno.EIO, "an answer of the server had no Content-Length (obstore's client needs one "
                              "to read it; a HEAD without it leaves the file's size unknown, which mcf refuses)",
                              self.url)
        m = re.search(r"Requested (\d+)\.\.(\d+), got (\d+)\.\.(\d+)", line)
        if m:
            return Retry(f"206 answer for the wrong range: asked for bytes {m.group(1)}-{int(m.group(2)) - 1}, "
                         f"got {m.group(3)}-{int(m.group(4)) - 1}")
        m = _STATUS.search(str(exc))
        if m:
            status = int(m.group(1))
            if status == 404:
                return MissingFileError(errno.ENOENT, "no such remote file", self.url)
            if status in (401, 403):
                return AccessError(errno.EACCES, f"access to the remote file was denied: {line}", self.url)
            if 400 <= status < 500 and status not in (408, 429):
                return Retry(f"HTTP status {status}: {line}", transient=False)
        return Retry(f"{type(exc).__name__}: {line}")
