"""What counts as a URL, for the core: a string that names a protocol (``scheme://...``) is read by
:mod:`mcf.remote`, never opened as a local path, and never written to (remote files are read-only).

The core needs only these two facts; opening a URL is :func:`mcf.io.open_source`'s (the I/O core's public
face, above both the local core and :mod:`mcf.remote`), so the core never imports the remote layer.
"""

from __future__ import annotations

import ipaddress

from mcf._core.redaction import URL_SCHEME, redact
from mcf.errors import InvalidArgumentError

__all__ = ["is_url", "refuse_url", "is_loopback_host"]


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


def is_loopback_host(host: str) -> bool:
    """True for a host name or address a listener on it serves only this machine: ``localhost``, an IPv4
    127/8 or the IPv6 ``::1`` address (bracketed or not).  What the servers and publishers that refuse to be
    exposed without saying so (``mcf bucket serve``, its KV events) take as loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
