"""How a URL may appear in a message, a log or an output: without its credentials.

:func:`redact` is the one rule (``mcf.remote.redact`` is this function); :func:`redact_text` applies it to
every URL inside a text.  :mod:`mcf.errors` passes every message of an :class:`mcf.MCFError` through
:func:`redact_text`, and the command line every error line, so no call site can leak a password, a token
or a signature by forgetting to redact.  This module imports nothing of mcf: the error classes need it.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["URL_SCHEME", "redact", "redact_text"]

# scheme:// at the start of a string (what mcf._core.urls.is_url recognises)
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")

# the name of a query (or fragment) parameter that carries a credential, matched anywhere in the name and
# in any case: pre-signed S3 and GCS URLs (X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token,
# X-Goog-Signature), CloudFront (Signature, Policy, Key-Pair-Id), Azure SAS tokens (sig), API keys and
# OAuth tokens (api_key, access_token, auth, jwt...), passwords (password, passwd, pwd)
_SECRET_PARAM = re.compile(r"sig|credential|token|key|secret|pass|pwd|auth|session|jwt|bearer|policy|cookie",
                           re.IGNORECASE)


def redact(url) -> str | None:
    """``url`` fit for a message, a log or an output: whatever stands before an ``@`` in its authority (a
    user name and password, or a bare token as in ``https://TOKEN@host/``) becomes ``***``, and so does the
    value of every query or fragment parameter whose name looks like a credential (``X-Amz-Signature``,
    ``X-Amz-Credential``, ``sig``, ``token``, ``auth``, ``key``, ``password``...: docs/remote.md has the list).
    Everything else is kept exactly as written (other parameters such as ``?download=true``, percent
    escapes, ``memory:///``).  Anything that is not a URL (a local path) is returned as ``str`` unchanged,
    None as None; redacting twice gives the same text."""
    if url is None:
        return None
    if isinstance(url, bytes):
        url = url.decode(errors="replace")
    url = str(url)
    m = URL_SCHEME.match(url)
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
