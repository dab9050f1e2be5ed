"""The access log of ``mcf bucket serve``: one line per request, shaped like uvicorn's own
(``127.0.0.1:54321 - "GET /mcrp/v1/registry HTTP/1.1" 200``) so the tools and habits of uvicorn users
apply, followed by the bytes of the answer's body and the time it took (``182 1.4 ms``).

Why the server writes its own rather than using uvicorn's: uvicorn's line has no size or duration,
it logs the query string (where a client may have put a secret), and it never sees the requests the
HTTP layer refuses before the application runs (smuggled framing, oversized heads, connections past
the cap), which are the ones an operator looks for after an attack.  The request line is logged as
the client sent it (still percent-encoded), with anything outside printable ASCII escaped so a line
of the log stays one line, and a query string is shown as ``?...``.  Headers are never logged: the
bearer token travels in one.
"""

from __future__ import annotations

import logging
import re

__all__ = ["LOGGER", "log_request", "request_target"]

LOGGER = logging.getLogger("mcf.bucket.access")
_UNPRINTABLE = re.compile(r"[^\x21-\x7e]")
_MAX_PATH = 512


def _printable(text: str, limit: int) -> str:
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}", text[:limit])


def request_target(raw_path: bytes | None, query: bytes | None) -> str:
    """The path to log for a request: as sent, without its query string (``?...`` when it had one)."""
    path = _printable((raw_path or b"-").decode("latin-1"), _MAX_PATH)
    return path + ("?..." if query else "")


def log_request(client: tuple | None, method: str, target: str, http_version: str, status: int, nbytes: int,
                seconds: float) -> None:
    """Log one request (``target`` from :func:`request_target`); ``client`` is ``(host, port)`` or None."""
    if not LOGGER.isEnabledFor(logging.INFO):
        return
    who = f"{client[0]}:{client[1]}" if client else "-"
    LOGGER.info('%s - "%s %s HTTP/%s" %d %d %.1f ms', who, _printable(method, 16), target,
                _printable(http_version, 8), status, nbytes, seconds * 1e3)
