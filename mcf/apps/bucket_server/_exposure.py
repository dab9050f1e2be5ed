"""Who may reach ``mcf bucket serve`` at all (docs/bucket.md, "Deploying"): the checks made before any
route sees a request, and the rules on where the server may listen.  :mod:`mcf.apps.bucket_server._http_limits`
beside it bounds what a client may cost; this module decides whether it is let in.

* **Token.** A bearer token is printable ASCII without spaces (it travels in a header); an empty one
  is an error, not "no authentication" (:func:`check_token`); it is compared in constant time, in one
  place (:func:`bearer_ok`: the routes, and the HTTP layer's choice of which connections to close first).
* **Protected mode** (Redis'): without a token the server listens on loopback only (:func:`check_bind`).
* **Host** (DNS rebinding): the ``Host`` header must be a valid host and port (RFC 9112 §3.2) naming a
  host of the allow-list (:func:`parse_allowed_hosts`); a page on evil.example whose name now resolves
  to 127.0.0.1 still sends ``Host: evil.example``.
* **Origin** (cross-site writes): a request carries at most one ``Origin``, and a state-changing one
  that carries one must come from this server's own origin (:class:`Exposure`).
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from typing import Any

from mcf._core.urls import is_loopback_host
from mcf.errors import InvalidArgumentError

__all__ = ["DEFAULT_ALLOWED_HOSTS", "MIN_TOKEN_BYTES", "Exposure", "bearer_ok", "check_bind", "check_token",
           "parse_allowed_hosts"]

#: the Host names answered by default: loopback only (a foreign Host is a DNS-rebinding page's request)
DEFAULT_ALLOWED_HOSTS = ("localhost", "127.0.0.1", "::1")
#: a token shorter than this draws a warning (a 32-byte random token is what ``secrets.token_urlsafe(32)`` gives)
MIN_TOKEN_BYTES = 32
_UNSAFE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


def check_token(token: Any) -> list[str]:
    """Validate a bearer token (None: no authentication); returns warnings to show the operator.

    An empty token is an error, not "no auth": ``--token "$UNSET_VARIABLE"`` must not open the server.
    A token must be printable ASCII without spaces (it travels in a header); one shorter than
    :data:`MIN_TOKEN_BYTES` is accepted with a warning."""
    if token is None:
        return []
    if not isinstance(token, str) or not token.strip():
        raise InvalidArgumentError("the bearer token is empty (an unset variable?); give a real token or none at all")
    if not re.fullmatch(r"[\x21-\x7e]+", token):
        raise InvalidArgumentError("the bearer token must be printable ASCII without spaces or line breaks")
    if len(token) < MIN_TOKEN_BYTES:
        return [f"the bearer token has {len(token)} bytes; use at least {MIN_TOKEN_BYTES} random ones "
                "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"]
    return []



def check_bind(host: str, token: str | None) -> None:
    """Protected mode (Redis'): without a token the server answers on loopback only, so refuse to
    listen anywhere else (``0.0.0.0``, ``::``, a LAN address, a host name)."""
    if token is None and not is_loopback_host(host):
        raise InvalidArgumentError(
            f"refusing to listen on {host!r} without a token: anyone who can reach that address could read and "
            "change the bucket.  Listen on 127.0.0.1 (the default), or set a token (MCF_BUCKET_TOKEN or "
            "--token-file) and put TLS in front (docs/bucket.md, Deploying)")


def bearer_ok(authorization: bytes | str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``token``, compared in constant time (the one
    place that decides: the routes, and the HTTP layer's choice of which connections to close first)."""
    if authorization is None:
        return False
    if isinstance(authorization, str):
        authorization = authorization.encode("latin-1", "replace")
    return hmac.compare_digest(authorization, f"Bearer {token}".encode())


_REG_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*\.?")
_PORT = re.compile(r":([0-9]{1,5})")
_ORIGIN = re.compile(r"(https?)://([^/?#]*)")


def _authority(value: str) -> tuple[str, int | None]:
    """``(host, port)`` of a Host header or an Origin's authority: the host lowercased, without a final
    dot, an IPv6 address in its compressed form.  Anything else is an :class:`InvalidArgumentError`
    saying why: a user part (``localhost:1@evil.example``), a path, text after an address in brackets,
    an IPv6 address without brackets, a zone id, an empty, non-decimal or out-of-range port (RFC 9112
    §3.2 and RFC 3986 §3.2.2: a server answers such a Host with 400)."""
    v = value.lower()
    if v.startswith("["):
        end = v.find("]")
        if end < 0:
            raise InvalidArgumentError("an IPv6 address without its closing ']'")
        try:
            name = ipaddress.IPv6Address(v[1:end]).compressed
        except ValueError:
            name = None
        if name is None or "%" in v[1:end]:
            raise InvalidArgumentError("not an IPv6 address (without a zone id) inside the brackets")
        rest = v[end + 1:]
    else:
        name, sep, port = v.partition(":")
        if not _REG_NAME.fullmatch(name):
            raise InvalidArgumentError("not a host name or address (letters, digits, '-', '_' and dots)")
        name, rest = name.rstrip("."), sep + port
    if not rest:
        return name, None
    m = _PORT.fullmatch(rest)
    if m is None or not 0 < int(m.group(1)) <= 65535:
        raise InvalidArgumentError("a port must be a decimal number from 1 to 65535")
    return name, int(m.group(1))


def _host_name(value: str) -> str:
    """An allowed host as the operator wrote it (``::1``, ``[::1]``, ``mcb.example.com.``), normalized
    as :func:`_authority` normalizes the Host header."""
    try:
        return ipaddress.IPv6Address(value.strip()).compressed
    except ValueError:
        pass
    try:
        return _authority(value.strip())[0]
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"allowed host {value!r} is not a host name or address: {exc}") from None


def parse_allowed_hosts(value: Any) -> tuple[set[str], bool]:
    """``(names, any_host)`` of an allow-list as :func:`mcf.apps.bucket_server.create_app` takes it: one name
    or several, normalized (:func:`_host_name`); ``"*"`` (alone or among them) allows any host."""
    any_host = value == "*" or (not isinstance(value, str) and "*" in value)
    hosts = set() if any_host else {_host_name(h) for h in ([value] if isinstance(value, str) else value)}
    return hosts, any_host


class Exposure:
    """The checks made before any route sees a request (a plain ASGI wrapper: cheap, and it also covers
    404s and 405s): the ``Host`` header must be a valid host and port (RFC 9112 §3.2: 400 otherwise,
    whatever name it seems to hold) naming an allowed host (DNS rebinding: a page on evil.example
    whose name now resolves to 127.0.0.1 still sends ``Host: evil.example``), a request carries at
    most one ``Origin`` (a browser sends one; with two, a check of either could be fooled by the
    other), and a state-changing request that carries one must come from this server's own origin (a
    page elsewhere, or on another port of localhost, cannot drive it: browsers always send Origin on
    cross-origin POST and DELETE, even when they skip the CORS preflight).  ``hosts`` and ``any_host``
    are :func:`parse_allowed_hosts`'s; ``err(status, message)`` makes the ASGI answer of a refusal."""

    def __init__(self, app, hosts: set[str], any_host: bool, err) -> None:
        self.app, self.hosts, self.any_host, self.err = app, hosts, any_host, err

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                return await self.err(*refusal)(scope, receive, send)
        return await self.app(scope, receive, send)

    def refusal(self, scope) -> tuple[int, str] | None:
        hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
        origins = [v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"]
        if not hosts:
            return 400, "a Host header is required"
        try:
            name, port = _authority(hosts[0])
        except InvalidArgumentError as exc:
            return 400, f"Host {hosts[0]!r} is not a valid host[:port] (RFC 9112 §3.2): {exc}"
        if not self.any_host and name not in self.hosts:
            return 400, f"Host {hosts[0]!r} is not served here (allowed: {sorted(self.hosts)}; see --allow-host)"
        if len(origins) > 1:
            return 400, "more than one Origin header: a browser sends one (RFC 6454 §7.3)"
        if origins and scope["method"] in _UNSAFE_METHODS:
            scheme = scope.get("scheme", "http")
            if not _same_origin(origins[0], scheme, name, port):
                return 403, (f"cross-origin request from {origins[0]!r} refused: this API takes state-changing "
                             "requests only from programs, not from web pages of other origins")
        return None


def _same_origin(origin: str, scheme: str, name: str, port: int | None) -> bool:
    """Whether an ``Origin`` value is this server's own origin (scheme, host and port, the default port
    of the scheme when none is written); ``null`` and anything malformed are not."""
    m = _ORIGIN.fullmatch(origin.strip().lower().removesuffix("/"))
    if m is None:
        return False
    try:
        o_name, o_port = _authority(m.group(2))
    except InvalidArgumentError:
        return False
    default = {"http": 80, "https": 443}
    return (m.group(1), o_name, o_port or default[m.group(1)]) == (scheme, name, port or default.get(scheme))
