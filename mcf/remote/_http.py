"""mcf's own HTTP(S) client for ranged GETs: the one place that decides what is sent, what is followed and
what is accepted, for every ``http(s)://`` URL and for the object stores' pre-signed URLs.

It exists because the clients it replaces on these paths could not be told what a loader of untrusted
URLs needs: obstore (reqwest) follows every redirect and forwards session tokens and user headers to the
new origin, and buffers a whole answer before its length is checked; fsspec's aiohttp path sends no
``If-Match``.  Python's ``http.client`` gives each of these decisions to the caller:

- **bounded answers**: a body is read straight into the destination in pieces of at most one socket read,
  never past the range's length; an answer that announces (``Content-Length``) or sends more than the
  range is refused, so memory stays at the destination whatever a server sends;
- **deadlines**: ``timeout`` bounds each silence (connecting, or between two reads); a request must also
  finish within ``timeout + bytes / min_rate`` seconds, so a server that drips a byte at a time fails
  (and is retried) instead of holding a read for hours;
- **one version**: the size, ETag and Last-Modified seen at opening are pinned; every GET carries
  ``If-Match`` (a strong ETag) and every answer's ETag, Last-Modified and total size are compared, so a
  file replaced during a load is an error on servers that ignore ``If-Match`` too;
- **redirects** (at most :data:`MAX_REDIRECTS`): followed within one origin with every header; to
  another origin without any credential (``Authorization``, cookies, ``X-Amz-Security-Token``, the
  URL's user and password, and every header the caller configured, such as an API key), as curl and
  requests do; from https to http never; and never to another origin for a request mcf signed for an
  object store (its signature holds for the endpoint's host only, and the endpoint could copy the
  signed query, session token included, into the ``Location``).

Connections are kept alive and reused per origin (``pool``); a connection whose answer was not read to
its end is closed, never reused.  Proxies come from the environment (``HTTPS_PROXY``, ``HTTP_PROXY``,
``NO_PROXY``) as the other clients read them.
"""

from __future__ import annotations

import base64
import email.utils
import errno
import http.client
import socket
import ssl
import threading
import time
import urllib.request
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from mcf.errors import AccessError, InvalidArgumentError, MCFIOError, MissingFileError
from mcf.remote._fetch import Retry
from mcf.remote._urls import redact, redact_text

__all__ = ["HttpTransport", "MAX_REDIRECTS", "CREDENTIAL_HEADERS", "parse_content_range", "retry_after"]

MAX_REDIRECTS = 5
#: headers that carry a credential: never sent to another origin after a redirect
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "cookie2", "x-amz-security-token",
                                "x-goog-user-project", "x-ms-authorization"})
#: obstore's client options mcf's client honours (the same names, so one dict serves both)
CLIENT_OPTIONS = frozenset({"allow_invalid_certificates", "root_certificate", "default_headers", "user_agent",
                            "proxy_url"})
# obstore's tuning of its own connection pool and protocol: meaningless here, accepted and ignored
_OBSTORE_TUNING = frozenset({"allow_http", "connect_timeout", "timeout", "read_timeout", "pool_idle_timeout",
                             "pool_max_idle_per_host", "http1_only", "http2_only", "http2_keep_alive_interval",
                             "http2_keep_alive_timeout", "http2_keep_alive_while_idle", "http2_max_frame_size",
                             "randomize_addresses", "default_content_type"})
_READ_PIECE = 1 << 20          # the most one socket read may bring (a piece is copied nowhere: it lands in place)
_MAX_DISCARD = 64 << 10        # a redirect's or an error's body read (and dropped) to keep the connection


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, parts) -> "_Origin":
        scheme = parts.scheme.lower()
        port = parts.port or (443 if scheme == "https" else 80)
        return cls(scheme, (parts.hostname or "").lower(), port)


def parse_content_range(value):
    """``(first, last, total)`` of ``Content-Range: bytes first-last/total`` (total None for ``*``), or None."""
    try:
        unit, rest = value.strip().split(" ", 1)
        span, total = rest.split("/", 1)
        a, b = (int(x) for x in span.split("-", 1))
        return (a, b, None if total.strip() == "*" else int(total)) if unit.lower() == "bytes" else None
    except (AttributeError, ValueError):
        return None


def retry_after(value) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (a number of seconds, or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


class _Pool:
    """Idle keep-alive connections per origin (and proxy), at most ``limit`` each."""

    def __init__(self, limit: int, context, proxy: str | None = None):
        self.limit = limit
        self.context = context
        self.proxy = proxy
        self._idle: dict = {}
        self._lock = threading.Lock()

    def get(self, origin: _Origin, timeout: float | None):
        with self._lock:
            idle = self._idle.get(origin)
            if idle:
                conn = idle.pop()
                conn.sock is not None and conn.sock.settimeout(timeout)
                return conn
        return self._new(origin, timeout)

    def _new(self, origin: _Origin, timeout):
        proxy = self.proxy or _proxy_for(origin)
        if proxy is None:
            if origin.scheme == "https":
                return http.client.HTTPSConnection(origin.host, origin.port, timeout=timeout, context=self.context)
            return http.client.HTTPConnection(origin.host, origin.port, timeout=timeout)
        pp = urlsplit(proxy)
        phost, pport = pp.hostname, pp.port or (443 if pp.scheme == "https" else 80)
        if origin.scheme == "https":
            conn = http.client.HTTPSConnection(phost, pport, timeout=timeout, context=self.context)
            conn.set_tunnel(origin.host, origin.port)
        else:
            conn = http.client.HTTPConnection(phost, pport, timeout=timeout)
            conn._mcf_absolute = True   # an http proxy takes the absolute URL as the request target
        return conn

    def put(self, origin: _Origin, conn) -> None:
        with self._lock:
            idle = self._idle.setdefault(origin, [])
            if len(idle) < self.limit:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for c in conns:
            c.close()

    def __del__(self):
        # a RemoteFile dropped without close(): its idle connections go with it, not at the interpreter's exit
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing may escape a finalizer
            pass


def _proxy_for(origin: _Origin):
    proxies = urllib.request.getproxies_environment()
    if not proxies or urllib.request.proxy_bypass_environment(origin.host, proxies):
        return None
    return proxies.get(origin.scheme)


def _ssl_context(client_options: dict):
    ctx = ssl.create_default_context()
    root = client_options.get("root_certificate")
    if root:
        if isinstance(root, bytes) or "-----BEGIN" in str(root):
            ctx.load_verify_locations(cadata=root.decode() if isinstance(root, bytes) else root)
        else:
            ctx.load_verify_locations(cafile=str(root))
    if str(client_options.get("allow_invalid_certificates", "")).lower() in ("true", "1"):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class _Answer:
    """One response whose status line and headers arrived; the body is read by the caller."""

    def __init__(self, conn, resp, origin, url):
        self.conn, self.resp, self.origin, self.url = conn, resp, origin, url
        self.status = resp.status
        self.headers = resp.headers


class HttpTransport:
    """Size and ranged GETs of one object over HTTP(S), checked as the module docstring says.

    ``url`` is the object's URL (a query string and ``user:password@`` are kept; the latter becomes Basic
    authentication for that origin only).  ``signer(method)``, when given, returns a fresh pre-signed URL for
    ``method`` (an object store's: the credentials ride in its query string) and replaces ``url`` for each
    request.  ``headers`` are sent with every request to the first origin (they may hold an API key)."""

    name = "http"
    counts_bytes = True     # every byte read is counted as it arrives (``count``), a refused answer's too

    def __init__(self, url: str, *, headers: dict | None = None, client_options: dict | None = None,
                 timeout: float | None, min_rate: float, concurrency: int, redacted: str, signer=None):
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise InvalidArgumentError(f"{redacted}: not an http(s) URL with a host")
        self.url = redacted
        self._signer = signer
        self._headers = {str(k): str(v) for k, v in (headers or {}).items()}
        client_options = dict(client_options or {})
        unknown = sorted(set(client_options) - CLIENT_OPTIONS - _OBSTORE_TUNING)
        if unknown:
            raise InvalidArgumentError(f"{redacted}: client_options {unknown} are not understood by mcf's HTTP client "
                                       f"(it takes {sorted(CLIENT_OPTIONS)}; backend='obstore' takes obstore's)")
        for k, v in (client_options.pop("default_headers", None) or {}).items():
            self._headers.setdefault(str(k), v.decode() if isinstance(v, bytes) else str(v))
        if client_options.get("user_agent"):
            self._headers.setdefault("User-Agent", str(client_options["user_agent"]))
        if parts.username is not None or parts.password is not None:
            from urllib.parse import unquote

            cred = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(cred).decode()
            netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
            if ":" in parts.hostname:   # IPv6 literal
                netloc = f"[{parts.hostname}]" + (f":{parts.port}" if parts.port else "")
            url = parts._replace(netloc=netloc).geturl()
        self._url = url
        self._origin = _Origin.of(urlsplit(url))
        self.timeout = timeout
        self.min_rate = float(min_rate)
        # a redirect may lead to https whatever the first scheme: every transport has a TLS context
        self._pool = _Pool(max(1, int(concurrency)), _ssl_context(client_options), client_options.get("proxy_url"))
        self.size_hint = None
        self.etag = None
        self.last_modified = None
        self.count = _ignore

    # -- requests ------------------------------------------------------------------------------------
    def _deadline(self, nbytes: int) -> float:
        slack = self.timeout if self.timeout is not None else 60.0
        return time.monotonic() + slack + nbytes / self.min_rate

    def _request(self, method: str, headers: dict, deadline: float) -> _Answer:
        """Send ``method`` to the object's URL and follow redirects; the answer's body is still unread."""
        url = self._signer(method) if self._signer is not None else self._url
        origin = _Origin.of(urlsplit(url))
        same_origin = origin == self._origin
        hdrs = {**self._headers, **headers} if same_origin else dict(headers)
        for _hop in range(MAX_REDIRECTS + 1):
            ans = self._send(method, url, origin, hdrs, deadline)
            if ans.status not in (301, 302, 303, 307, 308):
                return ans
            location = ans.headers.get("Location")
            self._discard(ans)
            if not location:
                return ans
            new = urljoin(url, location.strip())
            np_ = urlsplit(new)
            if np_.scheme.lower() not in ("http", "https") or not np_.hostname:
                raise MCFIOError(errno.EIO, f"redirected to {redact(new)}, which is not an http(s) URL", self.url)
            if origin.scheme == "https" and np_.scheme.lower() == "http":
                raise MCFIOError(errno.EIO, f"redirected from https to plain http ({redact(new)}): refused, the "
                                 "answer could be altered on the way", self.url)
            new_origin = _Origin.of(np_)
            if new_origin != origin and self._signer is not None:
                # a pre-signed request is valid for its endpoint's host only, and the endpoint may have copied
                # the signed query (a session token in it) into the Location: never follow it elsewhere
                raise MCFIOError(errno.EIO, f"redirected to another origin ({redact(f'{np_.scheme}://{np_.netloc}')}) "
                                 "on a signed object-store request: refused (for S3, set the bucket's region or "
                                 "endpoint)", self.url)
            if new_origin != origin:
                # another origin gets no credential: not the caller's headers, not the URL's password, not a token
                hdrs = {k: v for k, v in hdrs.items()
                        if k.lower() not in CREDENTIAL_HEADERS and k not in self._headers}
            if np_.username is not None or np_.password is not None:
                raise MCFIOError(errno.EIO, f"redirected to a URL with credentials in it ({redact(new)}): refused",
                                 self.url)
            url, origin = new, new_origin
        raise MCFIOError(errno.EIO, f"more than {MAX_REDIRECTS} redirects", self.url)

    def _send(self, method, url, origin, headers, deadline) -> _Answer:
        parts = urlsplit(url)
        conn = self._pool.get(origin, self._silence(deadline))
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        if getattr(conn, "_mcf_absolute", False):
            target = parts._replace(fragment="").geturl()
        try:
            conn.request(method, target, headers={"Accept-Encoding": "identity", **headers})
            resp = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        return _Answer(conn, resp, origin, url)

    def _silence(self, deadline: float) -> float | None:
        """The socket timeout of the next operation: the silence allowed, never past the deadline."""
        left = max(0.001, deadline - time.monotonic())
        return left if self.timeout is None else min(self.timeout, left)

    def _discard(self, ans: _Answer) -> None:
        """Drop a short body to keep the connection; close it when the body is long or unknown."""
        length = ans.resp.length
        if length is not None and length <= _MAX_DISCARD and not ans.resp.will_close:
            try:
                ans.resp.read()
            except (OSError, http.client.HTTPException):
                ans.conn.close()
                return
            self._pool.put(ans.origin, ans.conn)
        else:
            ans.resp.close()
            ans.conn.close()

    def _small_body(self, ans: _Answer) -> bytes:
        """The start of an error answer's body (an object store's XML error), at most ``_MAX_DISCARD`` bytes."""
        try:
            if ans.conn.sock is not None:
                ans.conn.sock.settimeout(self.timeout)
            return ans.resp.read1(_MAX_DISCARD) if ans.resp.length is None or ans.resp.length > 0 else b""
        except (OSError, http.client.HTTPException):
            return b""

    def _release(self, ans: _Answer, complete: bool) -> None:
        if complete and not ans.resp.will_close:
            ans.resp.close()
            self._pool.put(ans.origin, ans.conn)
        else:
            ans.resp.close()
            ans.conn.close()

    # -- the transport interface -----------------------------------------------------------------------
    def size(self) -> int:
        """The size, ETag and Last-Modified every later answer is compared with: from a HEAD, or, where the
        server refuses HEAD (a pre-signed GET URL answers it 403), from a GET of the first byte."""
        ans = self._request("HEAD", {}, self._deadline(0))
        self._release(ans, complete=True)
        if ans.status in (400, 403, 405, 501) or (ans.status == 404 and self._signer is not None):
            # a refused HEAD; or an object store's 404, whose reason (no such bucket or key) only a GET's body says
            return self._size_by_get(ans.status)
        verdict = self._status_error(ans, "HEAD")
        if verdict is not None:
            if isinstance(verdict, Exception):
                raise verdict
            return verdict   # a Retry: Fetcher.call retries it
        length = ans.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            raise MCFIOError(errno.EIO, "the server did not report the file's size (no Content-Length); mcf "
                             "needs it to bounds-check every read", self.url)
        return self._pin(ans, int(length))

    def _pin(self, ans: _Answer, size: int) -> int:
        self.size_hint = size
        self.etag = ans.headers.get("ETag") or None
        self.last_modified = ans.headers.get("Last-Modified") or None
        return size

    def _size_by_get(self, head_status: int) -> int:
        ans = self._request("GET", {"Range": "bytes=0-0"}, self._deadline(1))
        try:
            if ans.status in (206, 416):
                cr = ans.headers.get("Content-Range") or ""
                total = cr.rsplit("/", 1)[-1].strip() if "/" in cr else ""
                if total.isdigit():
                    return self._pin(ans, int(total))
            verdict = self._status_error(ans, "GET")
            if ans.status == 404 and b"<Code>NoSuchBucket</Code>" in self._small_body(ans):
                verdict = MissingFileError(errno.ENOENT, "no such bucket", self.url)
            if verdict is None:
                verdict = MCFIOError(errno.EIO, f"the server refused HEAD (HTTP {head_status}) and a GET of the "
                                     "first byte reported no size (no Content-Range total); mcf needs it to "
                                     "bounds-check every read", self.url)
            if isinstance(verdict, Exception):
                raise verdict
            return verdict   # a Retry: Fetcher.call retries it
        finally:
            self._release(ans, complete=False)

    def get(self, start: int, end: int, out=None):
        """One attempt: (the bytes [start, end), landed) or (a :class:`Retry`, False)."""
        want = end - start
        deadline = self._deadline(want)
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if self.etag and not self.etag.startswith("W/"):
            headers["If-Match"] = self.etag
        ans = self._request("GET", headers, deadline)
        complete = False
        try:
            verdict = self._status_error(ans, "GET") or self._check_answer(ans, start, end)
            if verdict is not None:
                if isinstance(verdict, Retry) and not verdict.transient:
                    return verdict, False
                return verdict, False
            dst = out if out is not None else memoryview(bytearray(want))
            got, verdict = self._read_body(ans, dst, want, deadline)
            if verdict is not None:
                return verdict, False
            complete = True
            return dst[:got], out is not None
        finally:
            self._release(ans, complete)

    def _status_error(self, ans: _Answer, method: str):
        """The verdict of a status that is not a success: an MCF error (final) or a :class:`Retry`."""
        s = ans.status
        if s in (200, 206):
            return None
        if s == 404:
            return MissingFileError(errno.ENOENT, "no such remote file", self.url)
        if s in (401, 403):
            return AccessError(errno.EACCES, f"access to the remote file was denied (HTTP {s})", self.url)
        if s == 412:
            return MCFIOError(errno.ESTALE, f"the remote file changed while it was read (its ETag is no longer "
                              f"{self.etag}): open it again", self.url)
        transient = s >= 500 or s in (408, 429)
        return Retry(f"HTTP status {s} {ans.resp.reason}", transient=transient,
                     retry_after=retry_after(ans.headers.get("Retry-After")))

    def _changed(self, what: str, was, now) -> MCFIOError:
        return MCFIOError(errno.ESTALE, f"the remote file changed while it was read (its {what} was {was}, the "
                          f"server now answers {now}): open it again", self.url)

    def _check_answer(self, ans: _Answer, start: int, end: int):
        """None when a 200/206 answer is for [start, end) of the version pinned at opening."""
        h = ans.headers
        etag, modified = h.get("ETag"), h.get("Last-Modified")
        if self.etag is not None and etag is not None and etag != self.etag:
            return self._changed("ETag", self.etag, etag)
        if self.etag is None and self.last_modified is not None and modified is not None \
                and modified != self.last_modified:
            return self._changed("Last-Modified", self.last_modified, modified)
        want = end - start
        length = h.get("Content-Length")
        if ans.status == 200:
            if not (start == 0 and end == self.size_hint):
                return Retry(f"status 200 for a {want}-byte range at offset {start}: the server ignored the Range "
                             "header (it must answer 206 Partial Content)", transient=False)
            total = self.size_hint
        else:
            cr = parse_content_range(h.get("Content-Range"))
            if cr is None:
                return Retry(f"206 answer with a missing or malformed Content-Range {h.get('Content-Range')!r}")
            a, b, total = cr
            if total is not None and self.size_hint is not None and total != self.size_hint:
                return self._changed("size", self.size_hint, total)
            if a != start or b != end - 1:
                return Retry(f"206 answer for the wrong range: Content-Range {h.get('Content-Range')!r}, asked for "
                             f"bytes {start}-{end - 1}/{self.size_hint}")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return Retry(f"malformed Content-Length {length!r}", transient=False)
            if n > want:
                return Retry(f"the answer announces {n} bytes (Content-Length) for a {want}-byte range: refused "
                             "before reading it", transient=False)
            if n < want:
                return Retry(f"got {n} bytes for a {want}-byte range (short read: Content-Length {n})")
        return None

    def _read_body(self, ans: _Answer, dst: memoryview, want: int, deadline: float):
        """Read exactly ``want`` bytes into ``dst`` (never more), within the deadline: (bytes, None) or
        (bytes so far, verdict)."""
        resp, conn = ans.resp, ans.conn
        chunked = resp.chunked
        n = 0
        t0 = time.monotonic()
        while n < want:
            if conn.sock is not None:
                conn.sock.settimeout(self._silence(deadline))
            try:
                if chunked:
                    piece = resp.read1(min(want - n, _READ_PIECE))
                    k = len(piece)
                    dst[n:n + k] = piece
                else:
                    k = resp.fp.readinto1(dst[n:min(want, n + _READ_PIECE)])
            except (socket.timeout, TimeoutError):
                return n, self._slow(n, want, t0, deadline)
            if not k:
                return n, Retry(f"got {n} bytes for a {want}-byte range (short read)")
            n += k
            self.count(k)
            if time.monotonic() > deadline and n < want:
                return n, self._slow(n, want, t0, deadline)
        if chunked:
            try:
                if conn.sock is not None:
                    conn.sock.settimeout(self._silence(deadline))
                extra = resp.read1(1)
            except (socket.timeout, TimeoutError, http.client.HTTPException, OSError):
                extra = b"?"
            if extra:
                return n, Retry(f"got more than the {want} bytes of the range", transient=False)
        else:
            resp.length = 0      # read to its end through fp: the response is complete
        return n, None

    def _slow(self, n, want, t0, deadline) -> Retry:
        took = time.monotonic() - t0
        if time.monotonic() >= deadline - 0.001:
            return Retry(f"timed out: {n} of {want} bytes in {took:.1f} s, slower than the minimum rate of "
                         f"{self.min_rate:.0f} bytes/s (min_rate) after the {self.timeout} s allowed to start")
        return Retry(f"timed out: the server sent nothing for {self.timeout} s ({n} of {want} bytes)")

    def classify(self, exc):
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return Retry(f"timed out: {exc}")
        if isinstance(exc, ssl.SSLCertVerificationError):
            return MCFIOError(errno.EIO, f"TLS certificate verification failed: {exc.verify_message}", self.url)
        return Retry(f"{type(exc).__name__}: {redact_text(str(exc))}")

    def close(self) -> None:
        self._pool.close()


def _ignore(n: int) -> None:
    pass
