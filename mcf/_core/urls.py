"""What counts as a URL, for the core: a string that names a protocol (``scheme://...``) is read by
:mod:`mcf.remote`, never opened as a local path, and never written to (remote files are read-only).

The core needs only these two facts; opening a URL is :func:`mcf.io.open_source`'s (the I/O core's public
face, above both the local core and :mod:`mcf.remote`), so the core never imports the remote layer.
"""

from __future__ import annotations

from mcf._core.redaction import URL_SCHEME, redact
from mcf.errors import InvalidArgumentError

__all__ = ["is_url", "refuse_url"]


def is_url(obj) -> bool:
    """True for a string that names a protocol (``scheme://...``): such paths are read remotely."""
    if isinstance(obj, bytes):
        try:
            obj = obj.decode()
        except UnicodeDecodeError:
            return False
    return isinstance(obj, str) and URL_SCHEME.match(obj) is not None


def refuse_url(path, *, what: str = "writing") -> None:
    """Raise :class:`InvalidArgumentError` when ``path`` is a URL: remote files are read-only in mcf."""
    if is_url(path):
        raise InvalidArgumentError(f"{redact(path)}: {what} is not supported on remote URLs (remote files are "
                                   "read-only)")
