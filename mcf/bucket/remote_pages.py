"""A bucket's pages area through ``mcf bucket serve``: :class:`RemotePageStore` has
:class:`mcf.bucket.pages.PageStore`'s interface over the server's page routes (``/mcrp/v1/pages/...``).

The server checks every page (header, key, CRC-32C) before it answers, applies its limits (a page's
size, transfers in flight, the HTTP layer's timeouts) and its bearer token; this client adds nothing to
the data but moves it: a page is the body of one request (its metadata first, ``meta_len`` bytes, then
its payload).  One keep-alive connection per thread (``http.client``, the standard library's: the
requests are plain and few per page).  The token is sent only in the ``Authorization`` header and never
appears in a message; a URL in a message goes through :func:`mcf.remote.redact`.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from mcf.bucket.pages import MAX_META_BYTES, byte_views, writable_views, check_namespace, page_name
from mcf.errors import AccessError, InvalidArgumentError, MCFIOError
from mcf.remote import redact

__all__ = ["TOKEN_ENV", "RemotePageStore"]

#: where the token is read from when none is given (the variable ``mcf bucket serve`` reads too)
TOKEN_ENV = "MCF_BUCKET_TOKEN"
_PREFIX = "/mcrp/v1/pages"
#: keys in one existence request (the server's limit, mcf.apps.bucket_server._openapi.MAX_EXISTS_KEYS)
MAX_EXISTS_KEYS = 4096
_log = logging.getLogger("mcf.bucket.remote_pages")


class RemotePageStore:
    """One namespace of the pages area of the bucket that ``url`` (``http(s)://host:port``) serves.
    ``token``: the server's bearer token (default: ``$MCF_BUCKET_TOKEN``, when set); ``timeout``: seconds
    for a connection and each read."""

    def __init__(self, url: str, namespace: str, *, token: str | None = None, timeout: float = 60.0) -> None:
        self.namespace = check_namespace(namespace)
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgumentError(f"a bucket server's URL is http(s)://host[:port], not {redact(url)!r}")
        self.url = redact(url)
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._base = parts.path.rstrip("/") + _PREFIX + "/" + namespace
        token = (os.environ.get(TOKEN_ENV) or None) if token is None else token
        self._auth = {"authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []  # every thread's, closed by close()
        self._lock = threading.Lock()

    # -- the connection ------------------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            conn = self._local.conn = cls(self._host, self._port, timeout=self.timeout)
            with self._lock:
                self._all.append(conn)
        return conn

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)

    def _request(self, method: str, path: str, body: Any = None, headers: dict | None = None,
                 ok: tuple[int, ...] = (200,)) -> tuple[int, Any, bytes]:
        """``(status, headers, body)``; a status outside ``ok`` and 404 raises."""
        h = dict(self._auth, **(headers or {}))
        for attempt in (0, 1):  # a kept-alive connection the server closed: once more on a new one
            conn = self._conn()
            try:
                conn.request(method, self._base + path, body=body, headers=h)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (ConnectionError, http.client.HTTPException, OSError) as exc:
                self._drop(conn)
                if attempt or not isinstance(exc, (ConnectionError, http.client.RemoteDisconnected)):
                    raise MCFIOError(f"{self.url}: page request failed: {exc}") from None
        if resp.getheader("connection", "").lower() == "close":
            self._drop(conn)
        if resp.status in ok or resp.status == 404:
            return resp.status, resp.headers, data
        try:
            why = json.loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            why = data[:200].decode("utf-8", "replace")
        where = f"{self.url} ({method} page of namespace {self.namespace})"
        if resp.status == 401:
            raise AccessError(f"{where}: refused: {why} (give the server's token, or set ${TOKEN_ENV})")
        if resp.status in (400, 413):
            raise InvalidArgumentError(f"{where}: {resp.status}: {why}")
        raise MCFIOError(f"{where}: {resp.status}: {why}")

    @staticmethod
    def _page(key: str) -> str:
        return "/page/" + urllib.parse.quote(page_name(key), safe="")

    # -- PageStore's interface -----------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self._request("HEAD", self._page(key))[0] == 200

    def _exist(self, keys: Sequence[str], prefix: bool) -> Any:
        body = json.dumps({"keys": list(keys), "prefix": prefix}).encode()
        _, _, data = self._request("POST", "/exists", body, {"content-type": "application/json"})
        return json.loads(data)["hits" if prefix else "exists"]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        for lo in range(0, len(keys), MAX_EXISTS_KEYS):
            out += self._exist(keys[lo:lo + MAX_EXISTS_KEYS], False)
        return out

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are there (one request per 4096 keys)."""
        hits = 0
        for lo in range(0, len(keys), MAX_EXISTS_KEYS):
            part = keys[lo:lo + MAX_EXISTS_KEYS]
            got = int(self._exist(part, True))
            hits += got
            if got < len(part):
                break
        return hits

    def put(self, key: str, data: Any, *, meta: bytes = b"", replace: bool = False) -> bool:
        """Store the page (as :meth:`PageStore.put`): True when the server wrote it."""
        meta = bytes(meta)
        if len(meta) > MAX_META_BYTES:
            raise InvalidArgumentError(f"page metadata of {len(meta)} bytes, more than the {MAX_META_BYTES} allowed")
        body = meta + b"".join(byte_views(data))
        query = f"?meta_len={len(meta)}" + ("&replace=true" if replace else "")
        _, _, answer = self._request("PUT", self._page(key) + query, body,
                                     {"content-type": "application/octet-stream"}, ok=(201,))
        return bool(json.loads(answer)["written"])

    def put_many(self, keys: Sequence[str], datas: Sequence[Any], *, metas: Sequence[bytes] | None = None,
                 replace: bool = False) -> list[bool]:
        """:meth:`put` for each key: per key whether it is stored now; a page refused is False and logged."""
        if len(datas) != len(keys) or (metas is not None and len(metas) != len(keys)):
            raise InvalidArgumentError(f"{len(keys)} keys and {len(datas)} pages")
        out = []
        for i, key in enumerate(keys):
            try:
                self.put(key, datas[i], meta=b"" if metas is None else metas[i], replace=replace)
                out.append(True)
            except (MCFIOError, InvalidArgumentError) as exc:
                _log.warning("page %r not written: %s", key[:80], exc)
                out.append(False)
        return out

    def read(self, key: str, alloc: Callable[[bytes, int], Any]) -> Any:
        """The page read into what ``alloc(meta, payload_size)`` returns, or None for a miss."""
        status, headers, data = self._request("GET", self._page(key))
        if status == 404:
            return None
        n = headers.get("x-page-meta-length", "")
        if not n.isdigit() or int(n) > len(data):
            raise MCFIOError(f"{self.url}: a page answer without a valid X-Page-Meta-Length ({n[:20]!r})")
        meta, payload = data[:int(n)], memoryview(data)[int(n):]
        result = alloc(meta, len(payload))
        if result is None:
            return None
        views = writable_views(result)
        if sum(len(v) for v in views) != len(payload):
            raise InvalidArgumentError(f"alloc gave {sum(len(v) for v in views)} bytes for a payload of {len(payload)}")
        pos = 0
        for v in views:
            v[:] = payload[pos:pos + len(v)]
            pos += len(v)
        return result

    def get(self, key: str) -> tuple[bytes, bytearray] | None:
        box: list[bytes] = []

        def alloc(meta: bytes, n: int) -> bytearray:
            box.append(meta)
            return bytearray(n)

        got = self.read(key, alloc)
        return None if got is None else (box[0], got)

    def get_into(self, key: str, out: Any) -> bool:
        views = writable_views(out)
        size = sum(len(v) for v in views)
        return self.read(key, lambda meta, n: views if n == size else None) is not None

    def get_many_into(self, keys: Sequence[str], outs: Sequence[Any]) -> list[bool]:
        if len(outs) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys and {len(outs)} destinations")
        return [self.get_into(k, o) for k, o in zip(keys, outs)]

    def keys(self) -> list[str]:
        status, _, data = self._request("GET", "")
        return [] if status == 404 else list(json.loads(data)["keys"])

    def delete(self, key: str) -> bool:
        return self._request("DELETE", self._page(key), ok=(204,))[0] == 204

    def close(self) -> None:
        """Close every thread's connection (a later call opens a new one)."""
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local = threading.local()

    def __enter__(self) -> RemotePageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemotePageStore({self.url!r}, {self.namespace!r})"
