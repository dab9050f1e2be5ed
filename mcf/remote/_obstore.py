"""The object stores and HTTP(S) through obstore (the Python binding of Rust's object_store): ranged
GETs on a pooled connection per store, in Rust, with the GIL released while they run.

Chosen over fsspec (s3fs, aiohttp) because it is the fastest client measured here (docs/remote.md,
"Cost"), keeps up with the object stores' APIs for mcf, and reads the AWS/Google/Azure environment
variables itself.  Its own retries are off: :mod:`mcf.remote._fetch` retries every part (one count,
one backoff, checked lengths).  Its errors are sorted here into final ones (404, 403, 401, a server
that ignores ``Range``, other 4xx) and transient ones (connection errors, timeouts, 5xx, 408, 429, a
body cut short); object_store does not expose ``Retry-After`` headers, so its backoff is mcf's own.
"""

from __future__ import annotations

import errno
import re

from mcf._core.optional import require
from mcf.errors import AccessError, MCFIOError, MissingFileError
from mcf.remote._fetch import Retry
from mcf.remote._stores import object_store
from mcf.remote._urls import redact_text

__all__ = ["ObstoreTransport"]

_STATUS = re.compile(r"status code: (\d{3})")


_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_CAUSE = re.compile(r"(?:source|error): ([A-Z]\w*)[,\s]")
_OS_MESSAGE = re.compile(r'message: "([^"]+)"')
_NOT_A_CAUSE = {"reqwest", "hyper", "RetryError", "RetryErrorImpl", "Generic", "HttpError", "Status", "Some", "None",
                "Body", "Custom"}


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

    def __init__(self, target, opts: dict, *, timeout: float | None, url: str):
        self._obstore = require("obstore", feature=f"reading {target.root.split(':', 1)[0]}:// URLs with obstore",
                                extra="remote")
        self.url = url    # redacted, for messages
        self.store = object_store(target.kind, target.root, opts, timeout=timeout)
        self.path = target.key
        self.kind = target.kind
        self.etag = None

    def size(self):
        try:
            meta = self._obstore.head(self.store, self.path)
        except FileNotFoundError:
            if self.kind == "s3":
                # a HEAD answer has no body: a one-byte GET tells a missing bucket from a missing key
                self._obstore.get_range(self.store, self.path, start=0, end=1)
            raise
        self.etag = meta.get("e_tag") or None
        return int(meta["size"])

    def get(self, start: int, end: int, out=None):
        """One attempt: the bytes [start, end) as a buffer (obstore allocates it; the fetcher copies it
        into the destination), and False (not landed in ``out``).  With the ETag of the opening, every
        GET is conditional (``If-Match``): an object replaced while it is read fails, instead of giving a
        tensor made of two versions."""
        if self.etag is None:
            return self._obstore.get_range(self.store, self.path, start=start, end=end), False
        res = self._obstore.get(self.store, self.path, options={"range": (start, end), "if_match": self.etag})
        return res.bytes(), False

    def classify(self, exc):
        """A final :class:`mcf.MCFError` or a :class:`Retry` verdict for an exception of obstore."""
        from obstore.exceptions import (NotFoundError, NotSupportedError, PermissionDeniedError, PreconditionError,
                                        UnauthenticatedError)

        line = _first_line(exc)
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
            return MCFIOError(errno.EIO, "the server did not report the file's size (no Content-Length); mcf "
                              "needs it to bounds-check every read", self.url)
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
