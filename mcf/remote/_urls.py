"""What a URL names: its scheme's client, the bucket (or host) a store is made for, the object's key; and
the URL as it may appear in a message (credentials never do).

HTTP(S) URLs go to mcf's own client (:mod:`._http`), a query string and ``user:password@`` included; the
object stores to obstore (one store per bucket, see :mod:`._stores`), which signs the URLs mcf's client
fetches where it can; every other scheme (``memory://``, ``file://``, ``hf://``...) goes to fsspec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from mcf.errors import InvalidArgumentError

__all__ = ["OBJECT_STORE_SCHEMES", "Target", "is_url", "redact", "refuse_url", "target"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")

#: scheme -> the store kind obstore builds for it
OBJECT_STORE_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "azure": "azure",
                        "abfs": "azure", "abfss": "azure", "adl": "azure", "http": "http", "https": "http"}

# query parameters that carry a credential (pre-signed S3/GCS URLs, Azure SAS tokens, API keys)
_SECRET_PARAM = re.compile(r"sig|signature|credential|token|key|secret|password", re.IGNORECASE)


def is_url(obj) -> bool:
    """True for a string that names a protocol (``scheme://...``): such paths are read remotely."""
    if isinstance(obj, bytes):
        try:
            obj = obj.decode()
        except UnicodeDecodeError:
            return False
    return isinstance(obj, str) and _URL.match(obj) is not None


def refuse_url(path, *, what: str = "writing") -> None:
    """Raise :class:`InvalidArgumentError` when ``path`` is a URL: remote files are read-only in mcf."""
    if is_url(path):
        raise InvalidArgumentError(f"{redact(path)}: {what} is not supported on remote URLs (remote files are "
                                   "read-only)")


def redact(url) -> str:
    """``url`` fit for a message or a log: a password in it (``https://user:pw@host``) and the values of
    query parameters that look like credentials (``X-Amz-Signature``, ``sig``, ``token``...) become
    ``***``."""
    if isinstance(url, bytes):
        url = url.decode(errors="replace")
    url = str(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return re.sub(r"//[^/@]*@", "//***@", url)
    netloc = parts.netloc
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        netloc = (user.split(":", 1)[0] + ":***" if ":" in user else user) + "@" + host
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_SECRET_PARAM.search(k) for k, _ in pairs):
            query = urlencode([(k, "***" if _SECRET_PARAM.search(k) else v) for k, v in pairs], safe="*")
    if netloc == parts.netloc and query == parts.query:
        return url   # nothing to hide (and urlunsplit would drop the // of memory:///x)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Any URL inside ``text`` (an error message of a client library) redacted as by :func:`redact`."""
    return re.sub(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+", lambda m: redact(m.group(0)), text)


@dataclass(frozen=True)
class Target:
    """Where one URL points: ``kind`` is "s3", "gcs", "azure", "http" (obstore) or "fsspec"; ``root`` is
    what a store is made for (``s3://bucket``, ``https://host:port``); ``key`` the object's path in it."""
    url: str
    kind: str
    root: str
    key: str


def target(url: str) -> Target:
    """Split ``url`` (see the module docstring); a URL that names no bucket/host or no object is refused."""
    scheme = url.split("://", 1)[0].lower()
    kind = OBJECT_STORE_SCHEMES.get(scheme)
    parts = urlsplit(url)
    if kind is None:
        return Target(url, "fsspec", scheme, url)
    if not parts.netloc:
        raise InvalidArgumentError(f"{redact(url)}: the URL names no {'host' if kind == 'http' else 'bucket'} "
                                   f"(expected {scheme}://{'HOST' if kind == 'http' else 'BUCKET'}/PATH)")
    key = unquote(parts.path).lstrip("/")
    if not key or key.endswith("/"):
        raise InvalidArgumentError(f"{redact(url)}: the URL names no object (expected {scheme}://"
                                   f"{parts.netloc}/PATH/TO/FILE)")
    return Target(url, kind, f"{scheme}://{parts.netloc}", key)
