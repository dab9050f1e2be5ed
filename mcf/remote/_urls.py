"""What a URL names: its scheme's client, the bucket (or host) a store is made for, the object's key; and
the URL as it may appear in a message (credentials never do: :func:`redact`, which lives in
:mod:`mcf._core.redaction` so that :mod:`mcf.errors` can apply it to every message without an import
circle).

HTTP(S) URLs go to mcf's own client (:mod:`._http`), a query string and ``user:password@`` included; the
object stores to obstore (one store per bucket, see :mod:`._stores`), which signs the URLs mcf's client
fetches where it can; every other scheme (``memory://``, ``file://``, ``hf://``...) goes to fsspec.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from mcf._core.redaction import redact, redact_text
from mcf._core.urls import is_url, refuse_url
from mcf.errors import InvalidArgumentError

__all__ = ["OBJECT_STORE_SCHEMES", "Target", "is_url", "redact", "redact_text", "refuse_url", "target",
           "has_query_syntax", "split_url", "url_name", "join_path"]

#: scheme -> the store kind obstore builds for it
OBJECT_STORE_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "azure": "azure",
                        "abfs": "azure", "abfss": "azure", "adl": "azure", "http": "http", "https": "http"}


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


# -- a URL's name, its query aside -------------------------------------------------------------------
def has_query_syntax(url: str) -> bool:
    """True for the URLs whose path is percent-encoded and may be followed by a query and a fragment
    (http(s) and the object stores); fsspec's other schemes (``memory://``, ``file://``, ``hf://``) take
    everything after ``scheme://`` as a literal path, ``?`` and ``#`` included."""
    return url.split("://", 1)[0].lower() in OBJECT_STORE_SCHEMES


def split_url(url: str) -> tuple:
    """``(head, query)``: the URL up to the end of its path, and its query with the ``?`` ("" when none); a
    fragment is left out.  A URL of a literal-path scheme is all head."""
    if not has_query_syntax(url):
        return url, ""
    cut = min((k for k in (url.find("?"), url.find("#")) if k != -1), default=len(url))
    head, rest = url[:cut], url[cut:]
    return head, rest.split("#", 1)[0] if rest.startswith("?") else ""


def url_name(path) -> str:
    """The name a decision by name looks at: a path as it is; for an http(s) or object-store URL, the URL
    without its query and fragment, its path percent-decoded (``https://h/m.safetensors?download=true`` is
    ``https://h/m.safetensors``); for fsspec's other schemes the URL as it is (their paths are literal)."""
    p = os.fsdecode(os.fspath(path))
    if not is_url(p):
        return p
    head, _ = split_url(p)
    if not has_query_syntax(p):
        return head
    scheme, rest = head.split("://", 1)
    host, slash, key = rest.partition("/")
    return f"{scheme}://{host}{slash}{unquote(key)}"


def join_path(base, name: str) -> str:
    """The path or URL of the file ``name`` in the directory ``base``.  A URL keeps its query (how the store is
    reached: ``?download=true``, a token) after the new path; for http(s) and the object stores ``name`` is
    percent-encoded, so a file named ``a?b#c%20.safetensors`` is the file of that name, not a query or a
    fragment (fsspec's other schemes take names as they are)."""
    base = os.fsdecode(os.fspath(base))
    if not is_url(base):
        return os.path.join(base, name)
    head, query = split_url(base)
    if has_query_syntax(base):
        name = quote(name, safe="")
    return head.rstrip("/") + "/" + name + query
