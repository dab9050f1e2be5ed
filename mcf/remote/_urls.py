"""What a URL names: its scheme's client, the bucket (or host) a store is made for, the object's key; and
the URL as it may appear in a message (credentials never do).

The object stores and HTTP(S) go to obstore (one store per bucket or host, see :mod:`._stores`);
every other scheme (``memory://``, ``file://``, ``hf://``...) goes to fsspec.  An HTTP URL with a query
string (a pre-signed URL, ``?download=true``) also goes to fsspec: an object-store path cannot carry
one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from mcf.errors import InvalidArgumentError

__all__ = ["OBJECT_STORE_SCHEMES", "Target", "is_url", "redact", "refuse_url", "target"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")

#: scheme -> the store kind obstore builds for it
OBJECT_STORE_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "azure": "azure",
                        "abfs": "azure", "abfss": "azure", "adl": "azure", "http": "http", "https": "http"}

# the name of a query (or fragment) parameter that carries a credential, matched anywhere in the name and
# in any case: pre-signed S3 and GCS URLs (X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token,
# X-Goog-Signature), CloudFront (Signature, Policy, Key-Pair-Id), Azure SAS tokens (sig), API keys and
# OAuth tokens (api_key, access_token, auth, jwt...), passwords (password, passwd, pwd)
_SECRET_PARAM = re.compile(r"sig|credential|token|key|secret|pass|pwd|auth|session|jwt|bearer|policy|cookie",
                           re.IGNORECASE)


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


def redact(url) -> str | None:
    """``url`` fit for a message, a log or an output: whatever stands before an ``@`` in its authority (a
    user name and password, or a bare token as in ``https://TOKEN@host/``) becomes ``***``, and so does the
    value of every query or fragment parameter whose name looks like a credential (``X-Amz-Signature``,
    ``X-Amz-Credential``, ``sig``, ``token``, ``auth``, ``key``, ``password``...: ``_SECRET_PARAM``).
    Everything else is kept exactly as written (other parameters such as ``?download=true``, percent
    escapes, ``memory:///``).  Anything that is not a URL (a local path) is returned as ``str`` unchanged,
    None as None; redacting twice gives the same text."""
    if url is None:
        return None
    if isinstance(url, bytes):
        url = url.decode(errors="replace")
    url = str(url)
    m = _URL.match(url)
    if m is None:
        return url
    head = m.end()
    stop = len(url)
    for ch in "/?#":
        k = url.find(ch, head)
        if k != -1:
            stop = min(stop, k)
    authority, rest = url[head:stop], url[stop:]
    if "@" in authority:
        authority = "***@" + authority.rsplit("@", 1)[1]
    path, _, fragment = rest.partition("#")
    path, q, query = path.partition("?")
    out = url[:head] + authority + path
    if q:
        out += "?" + _redact_params(query)
    if "#" in rest:
        out += "#" + _redact_params(fragment)
    return out


def _redact_params(text: str) -> str:
    """``a=1&X-Amz-Signature=s`` with the value of each credential-like parameter as ``***``: pieces are
    separated by ``&`` (and ``;``); from a credential on, the rest of its ``&`` piece is hidden."""
    pieces = text.split("&")
    for i, piece in enumerate(pieces):
        subs = piece.split(";")
        for j, sub in enumerate(subs):
            key, eq, _ = sub.partition("=")
            if eq and _SECRET_PARAM.search(unquote(key.replace("+", " "))):
                pieces[i] = ";".join(subs[:j] + [key + "=***"])
                break
    return "&".join(pieces)


# a URL inside free text: up to a space or a quote, without a trailing punctuation mark
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]*[^\s'\"<>`),.:;!]")


def redact_text(text) -> str:
    """``text`` (a message, of mcf or of a client library) with every URL in it redacted as by
    :func:`redact`."""
    text = str(text)
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


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
    if kind == "http" and (parts.query or parts.fragment or parts.username is not None):
        kind = None   # a query string (pre-signed URLs), a fragment or credentials in the URL: fsspec's aiohttp
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
