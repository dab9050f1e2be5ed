"""The routes of ``mcf bucket serve`` (:mod:`mcf.apps.bucket_server`): one :class:`Handlers` object holds what
the handlers share (the bucket, the backend, the token, the limits, the event hub), its methods answer
the requests, and :meth:`Handlers.application` binds them to the paths of the OpenAPI document
(:mod:`mcf.apps.bucket_server._openapi`).

Every handler runs inside :meth:`Handlers.guarded`, the one place where the token is checked and an
error becomes its status (400, 404, 409, 413, 415, 422, 500, 507), with the bucket's location scrubbed
from the message; the exposure checks (:mod:`mcf.apps.bucket_server._exposure`) and the HTTP limits
(:mod:`mcf.apps.bucket_server._http_limits`) come before.  starlette is imported at the top: only
:func:`mcf.apps.bucket_server.create_app` imports this module, once it has checked the ``server`` extra.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import time
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mcf.bucket._events import EventHub, TooManyStreamsError, parse_last_id
from mcf.apps.bucket_server._exposure import bearer_ok
from mcf.bucket._npz import UploadTooLargeError, read_kv_npz
from mcf.apps.bucket_server._openapi import (DEVICE_PATTERN, MAX_EXISTS_KEYS, OPENAPI, PAGE_NAME_PATTERN, PREFIX,
                                             SCHEMAS, TOKEN_IDS_PATTERN, query_parameters)
from mcf.bucket.pages import MAX_KEY_CHARS, MAX_META_BYTES, PageStore, check_namespace, key_of_name
from mcf.bucket.store import Bucket, check_context_id, check_model_id
from mcf.bucket.tiers import HotTierFullError, WarmBudgetError, check_device
from mcf.errors import (ContextNotFoundError, EncryptionKeyError, FormatError, InvalidArgumentError, MCFError,
                        MCFIOError, StaleContextError)

__all__ = ["Handlers", "out_of_space"]

_STREAM_PIECE = 1 << 20
_JSON_TYPES = ("application/json",)
_UPLOAD_TYPES = ("application/octet-stream", "application/zip")
_TOKEN_IDS = re.compile(TOKEN_IDS_PATTERN)
_PAGE_NAME = re.compile(PAGE_NAME_PATTERN)
_OPEN_NAMESPACES = 256
_log = logging.getLogger("mcf.apps.bucket_server")


class _Busy(MCFError):
    """503 with Retry-After: too many page transfers in flight."""


class _UnsupportedMedia(InvalidArgumentError):
    """415: a body of a type the route does not take."""


def out_of_space(exc: BaseException) -> bool:
    """A full disk, or a full quota: 507 (MinIO's answer), not a server failure."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _media_type(request) -> str | None:
    ct = request.headers.get("content-type")
    return None if ct is None else ct.split(";", 1)[0].strip().lower()


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise InvalidArgumentError(f"{name} must be true or false, got {raw[:20]!r}")
    return raw in ("true", "1")


def _check_type(request: Request, allowed: tuple[str, ...], body_required: bool) -> None:
    """Only the documented content types on state-changing routes: a browser sends text/plain,
    form and multipart bodies cross-site without asking the server first (no CORS preflight)."""
    mt = _media_type(request)
    if mt is None and not body_required and request.headers.get("content-length", "0") == "0" \
            and "transfer-encoding" not in request.headers:
        return  # no body at all: the defaults
    if mt not in allowed:
        raise _UnsupportedMedia(f"content type {mt or '(none)'} is not accepted here; send {' or '.join(allowed)}")


async def _read_body(request: Request, limit: int, sink=None) -> bytes:
    """The body, read in pieces and refused (413) as soon as it passes ``limit`` bytes; with
    ``sink`` (a blocking write function) pieces go there, 1 MiB at a time from the thread pool."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise UploadTooLargeError(f"body of {declared} bytes, more than the limit of {limit} bytes")
    buf, total = bytearray(), 0
    async for piece in request.stream():
        total += len(piece)
        if total > limit:
            raise UploadTooLargeError(f"body larger than the limit of {limit} bytes")
        buf += piece
        if sink is not None and len(buf) >= _STREAM_PIECE:
            await run_in_threadpool(sink, bytes(buf))
            buf.clear()
    if sink is not None and buf:
        await run_in_threadpool(sink, bytes(buf))
        buf.clear()
    return bytes(buf)


def _ingest_options(q) -> dict:
    kw: dict[str, Any] = {}
    for k in ("name", "source", "dtype", "compression"):
        if k in q:
            kw[k] = q[k]
    if "ttl" in q:
        try:
            kw["ttl"] = float(q["ttl"])
        except ValueError:
            raise InvalidArgumentError("ttl must be a number") from None
    return kw


def _ingest_args(q) -> dict:
    """The query parameters of an ingest, checked before any of the body is read."""
    if "model_id" not in q:
        raise InvalidArgumentError("model_id is required")
    check_model_id(q["model_id"])
    kw: dict[str, Any] = {}
    if "token_ids" in q:
        if not _TOKEN_IDS.fullmatch(q["token_ids"]):
            raise InvalidArgumentError("token_ids must be comma-separated decimal integers of 1-18 digits")
        kw["token_ids"] = [int(t) for t in q["token_ids"].split(",")]
    if "content" in q:
        kw["content"] = q["content"]
    if ("content" in kw) == ("token_ids" in kw):
        raise InvalidArgumentError("give exactly one of content or token_ids")
    return dict(kw, **_ingest_options(q))


def _ingested(meta: dict) -> dict:
    """The answer to an ingest, from the context's metadata."""
    return {"status": "success", "context_id": meta["context_id"], "deduplicated": meta.get("deduplicated", False),
            "token_count": meta["content"]["token_count"], "size_bytes": meta["kv_cache"]["size_bytes"]}


def _pieces(fh):
    """A file's bytes, ``_STREAM_PIECE`` at a time; the file is closed at the end (or when dropped)."""
    with fh:
        while True:
            piece = fh.read(_STREAM_PIECE)
            if not piece:
                return
            yield piece


def _by_method(handlers: dict) -> tuple:
    """One route per path, so a wrong method gets 405 with the full Allow header."""
    async def dispatch(request: Request):
        m = request.method.lower()
        return await handlers[m if m in handlers or m != "head" else "get"](request)
    return dispatch, [m.upper() for m in handlers]


def _strict(path: str, method: str, fn):
    """Refuse query parameters the document does not declare (a typo like ``force_scna=true`` must
    not be silently ignored)."""
    allowed = query_parameters(path, method)

    async def checked(request: Request):
        unknown = sorted(set(request.query_params) - allowed)
        if unknown:
            raise InvalidArgumentError(f"unknown query parameter(s) {unknown}; allowed: {sorted(allowed)}")
        return await fn(request)
    return checked


async def _http_error(request: Request, exc: HTTPException):
    return JSONResponse({"status": "error", "error": exc.detail}, status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


class Handlers:
    """The request handlers of one application and what they share.  ``scrub`` removes every spelling
    of the bucket's location from a message (:func:`mcf.bucket._names.root_scrubber`); the limits are
    :func:`mcf.apps.bucket_server.create_app`'s (``max_text_bytes``: a text ingest's body)."""

    def __init__(self, bucket: Bucket, *, token: str | None, backend: Any, scrub, hub: EventHub,
                 max_body_bytes: int, max_json_bytes: int, max_text_bytes: int, max_ingest_bytes: int,
                 max_concurrent_ingests: int, max_page_bytes: int, max_concurrent_pages: int) -> None:
        self.bucket, self.token, self.backend, self.scrub, self.hub = bucket, token, backend, scrub, hub
        self.max_body_bytes, self.max_json_bytes, self.max_text_bytes = max_body_bytes, max_json_bytes, max_text_bytes
        self.max_ingest_bytes, self.max_concurrent_ingests = max_ingest_bytes, max_concurrent_ingests
        self.running = 0  # ingests admitted and not finished (the event loop is the only writer)
        self.max_page_bytes, self.max_concurrent_pages = max_page_bytes, max_concurrent_pages
        self.pages_running = 0  # page reads and writes in flight (the event loop is the only writer)
        self.page_stores: dict[str, PageStore] = {}  # open namespaces, the oldest dropped past _OPEN_NAMESPACES
        self.openapi_body = JSONResponse(OPENAPI).body  # rendered once: anyone may ask for it, without the token

    def application(self) -> Starlette:
        """The Starlette application: every route of the table, in :meth:`guarded` and :func:`_strict`."""
        table = {
            "/openapi.json": {"get": self.openapi},
            "/events": {"get": self.events},
            "/contexts": {"get": self.list_contexts, "post": self.ingest},
            "/contexts/{id}": {"get": self.get_context, "delete": self.delete_context},
            "/contexts/{id}/kv": {"get": self.stream_kv},
            "/contexts/{id}/query": {"post": self.query},
            "/contexts/{id}/promote": {"post": self.promote},
            "/contexts/{id}/demote": {"post": self.demote},
            "/models/{id}/contexts": {"get": self.discover},
            "/registry": {"get": self.registry},
            "/registry/rebuild": {"post": self.rebuild},
            "/pages/{namespace}": {"get": self.page_keys},
            "/pages/{namespace}/exists": {"post": self.pages_exist},
            "/pages/{namespace}/page/{key}": {"get": self.get_page, "head": self.head_page, "put": self.put_page,
                                              "delete": self.delete_page},
        }
        routes = []
        for path, handlers in table.items():
            fn, methods = _by_method({m: self.guarded(_strict(path, m, h)) for m, h in handlers.items()})
            routes.append(Route(PREFIX + path, fn, methods=methods))
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: self.unexpected},
                         lifespan=self.lifespan)

    # -- errors ------------------------------------------------------------------------------------
    def err(self, status: int, message: str, close: bool = False, headers: dict | None = None) -> JSONResponse:
        h = dict(headers or {}, **({"connection": "close"} if close else {}))
        return JSONResponse({"status": "error", "error": self.scrub(message)}, status_code=status, headers=h or None)

    def guarded(self, fn):
        """``fn`` behind the token check, its errors answered with their status."""
        async def handler(request: Request):
            if self.token is not None and request.url.path != f"{PREFIX}/openapi.json":
                if not bearer_ok(request.headers.get("authorization"), self.token):
                    # a body it sent is not read: end the connection rather than wait for the rest
                    h = request.headers
                    pending = h.get("content-length", "0") != "0" or "transfer-encoding" in h
                    return self.err(401, "missing or wrong bearer token", close=pending)
            try:
                return await fn(request)
            except UploadTooLargeError as exc:
                return self.err(413, str(exc), close=True)  # the rest of the body is not read: end the connection
            except _UnsupportedMedia as exc:
                return self.err(415, str(exc), close=True)
            except _Busy as exc:  # a body it sent is not read: end the connection
                return self.err(503, str(exc), close=True, headers={"retry-after": "1"})
            except (WarmBudgetError, HotTierFullError, StaleContextError, EncryptionKeyError) as exc:
                return self.err(409, str(exc))
            except InvalidArgumentError as exc:
                return self.err(400, str(exc))
            except ContextNotFoundError as exc:
                return self.err(404, str(exc))
            except FormatError as exc:
                return self.err(422, str(exc))
            except OSError as exc:  # MCFIOError from the bucket, or a bare one from the spool's writes
                if out_of_space(exc):  # the rest of an upload is not read: end the connection
                    _log.warning("%s %s: 507, no space left on the bucket's disk (%s)", request.method,
                                 request.url.path, self.scrub(str(exc)))
                    return self.err(507, f"no space left on the server's disk: {exc}", close=True)
                if not isinstance(exc, MCFIOError):
                    _log.exception("unexpected error on %s %s", request.method, request.url.path)
                    return self.err(500, "internal server error (logged on the server)")
                _log.warning("I/O failure: %s", self.scrub(str(exc)))
                return self.err(500, f"I/O failure on the server: {exc}")
            except MCFError as exc:
                return self.err(400, str(exc))
            except ClientDisconnect:
                return Response(status_code=400)  # nobody is listening any more
            except Exception:  # a bug: logged with its traceback, never shown to the client
                _log.exception("unexpected error on %s %s", request.method, request.url.path)
                return self.err(500, "internal server error (logged on the server)")
        return handler

    async def unexpected(self, request: Request, exc: Exception):
        _log.exception("unexpected error on %s %s", request.method, request.url.path)
        return self.err(500, "internal server error (logged on the server)")

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        # contexts whose recorded preference is warm or hot (mcf bucket promote --root) are loaded before
        # the first request is answered
        await run_in_threadpool(self.bucket.apply_tier_preferences)
        yield

    # -- bodies ------------------------------------------------------------------------------------
    async def body_json(self, request: Request, schema: str, limit: int | None = None) -> dict:
        """The JSON object body of a route whose document schema is ``schema`` (unknown fields are
        refused: a misspelt ``target_teir`` must not silently mean the default), at most ``limit`` bytes
        (default ``max_json_bytes``)."""
        _check_type(request, _JSON_TYPES, body_required=False)
        raw = await _read_body(request, self.max_json_bytes if limit is None else limit)
        if not raw.strip():
            return {}
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError(f"request body is not JSON: {exc}") from None
        except RecursionError:
            raise InvalidArgumentError("request body is not a JSON object (nested too deeply)") from None
        if not isinstance(obj, dict):
            raise InvalidArgumentError("request body must be a JSON object")
        known = SCHEMAS[schema].get("properties", {})
        unknown = sorted(set(obj) - set(known))
        if unknown:
            raise InvalidArgumentError(f"unknown field(s) {unknown} in the body; allowed: {sorted(known)}")
        return obj

    async def usable(self, cid: str, *, force: bool = False, hint: str = "") -> dict:
        """The metadata of context ``cid``, which must exist, be unexpired and (unless ``force``) not be
        stale: every route that hands a context's KV data on (as bytes, or to the query backend, which may
        read it without Bucket.load's check) refuses a stale one with 409, as Bucket.load does."""
        meta = await run_in_threadpool(self.bucket.lookup, cid)
        if not force and await run_in_threadpool(self.bucket.is_stale, meta):
            raise StaleContextError(f"{cid} is stale: it was computed by its model's former weights "
                                    f"(ingest the content again{hint})")
        return meta

    # -- the routes --------------------------------------------------------------------------------
    async def openapi(self, request: Request):
        return Response(self.openapi_body, media_type="application/json")

    async def events(self, request: Request):
        raw = request.query_params.get("last_event_id", request.headers.get("last-event-id"))
        try:
            last = parse_last_id(raw)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        try:
            s = self.hub.open(last)
        except TooManyStreamsError as exc:
            return self.err(503, str(exc))
        return StreamingResponse(self.hub.stream(s), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    async def list_contexts(self, request: Request):
        b = self.bucket
        model = request.query_params.get("model_id")
        if model is not None:
            check_model_id(model)  # an empty or malformed model_id is a 400, not "all models"
        reg = await run_in_threadpool(b.registry)
        models = [model] if model is not None else [m["model_id"] for m in reg["models"]]
        out = []
        for m in models:
            out += [dict(c, model_id=m) for c in await run_in_threadpool(b.discover, m)]
        return JSONResponse({"status": "success", "contexts": out})

    async def ingest(self, request: Request):
        """Admission first: past ``max_concurrent_ingests``, 503 before any of the body is read."""
        if self.running >= self.max_concurrent_ingests:
            return self.err(503, f"{self.running} concurrent ingests are running, the most this server takes at "
                                 "once (max_concurrent_ingests, --max-concurrent-ingests); retry later",
                            close=True, headers={"retry-after": "1"})
        self.running += 1
        try:
            if _media_type(request) in _JSON_TYPES:
                return await self.ingest_text(request)
            return await self.ingest_upload(request)
        finally:
            self.running -= 1

    async def ingest_text(self, request: Request):
        """The content itself as JSON (``{"content": text}`` or ``{"token_ids": [...]}``): the model
        backend computes its KV cache; the other parameters stay in the query, as for an upload."""
        q, backend = request.query_params, self.backend
        if "model_id" not in q:
            raise InvalidArgumentError("model_id is required")
        check_model_id(q["model_id"])
        for k in ("content", "token_ids"):
            if k in q:
                raise InvalidArgumentError(f"with a JSON body, {k} goes in the body, not in the query")
        kw = _ingest_options(q)
        if backend is None or not callable(getattr(backend, "ingest", None)):
            return self.err(501, "no model backend is configured: this server stores KV caches computed elsewhere "
                                 "(send them as an .npz upload, application/octet-stream), or start it with "
                                 "--backend transformers --model ... to compute them from text")
        if q["model_id"] != backend.model_id:
            raise InvalidArgumentError(f"this server's model backend serves {backend.model_id!r}, "
                                       f"not {q['model_id']!r}")
        body = await self.body_json(request, "TextIngest", limit=self.max_text_bytes)
        if ("content" in body) == ("token_ids" in body):
            raise InvalidArgumentError("give exactly one of content or token_ids in the body")
        if "content" in body and not isinstance(body["content"], str):
            raise InvalidArgumentError("content must be a string")
        ids = body.get("token_ids")
        if ids is not None and (not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in ids)):
            raise InvalidArgumentError("token_ids must be a list of non-negative integers")
        meta = await run_in_threadpool(backend.ingest, self.bucket, body.get("content"), token_ids=ids, **kw)
        out = _ingested(meta)
        if isinstance(meta.get("ingestion_time_ms"), (int, float)):
            out["ingestion_time_ms"] = meta["ingestion_time_ms"]
        return JSONResponse(out, status_code=201)

    async def ingest_upload(self, request: Request):
        q = request.query_params
        kw = _ingest_args(q)
        _check_type(request, _UPLOAD_TYPES, body_required=True)
        spool = await run_in_threadpool(self.bucket.scratch_file)
        try:
            await _read_body(request, self.max_body_bytes, sink=spool.write)
            meta = await run_in_threadpool(self._ingest_spooled, spool, q["model_id"], kw)
        finally:
            with contextlib.suppress(OSError):  # a full disk: the write above failed with it already
                spool.close()
        return JSONResponse(_ingested(meta), status_code=201)

    def _ingest_spooled(self, spool, model_id: str, kw: dict) -> dict:
        """The upload spooled to ``spool``, read as an .npz and ingested (in the thread pool)."""
        spool.flush()
        try:
            arrays = read_kv_npz(spool, limit=self.max_ingest_bytes, scratch=self.bucket.scratch_file, name="body")
        except UploadTooLargeError as exc:
            raise UploadTooLargeError(f"{exc} (max_ingest_bytes, --max-ingest-bytes)") from None
        with arrays:
            return self.bucket.ingest(model_id, arrays.layers(), **kw)

    async def get_context(self, request: Request):
        return JSONResponse(await run_in_threadpool(self.bucket.lookup, request.path_params["id"]))

    async def delete_context(self, request: Request):
        await run_in_threadpool(self.bucket.delete, request.path_params["id"])
        return Response(status_code=204)

    async def stream_kv(self, request: Request):
        cid = request.path_params["id"]
        meta = await self.usable(cid, force=_flag(request, "force"), hint=", or add ?force=true to fetch it anyway")
        f = await run_in_threadpool(self.bucket.open, cid)  # validates header, sizes and chunk table first
        # the bytes come from the descriptor that was validated, not from a second open of the path
        fh = os.fdopen(os.dup(f.fileno()), "rb")  # noqa: SIM115 - closed by the generator
        f.close()
        headers = {"content-length": str(os.fstat(fh.fileno()).st_size), "x-mcb-checksum": meta["storage"]["checksum"],
                   "x-mcb-dtype": meta["kv_cache"]["dtype"], "x-mcb-compression": meta["kv_cache"]["compression"]}
        return StreamingResponse(_pieces(fh), media_type="application/octet-stream", headers=headers)

    async def query(self, request: Request):
        body = await self.body_json(request, "QueryRequest")
        cid = request.path_params["id"]
        await self.usable(cid)
        if self.backend is None:
            return self.err(501, "no query backend is configured: this engine stores KV caches but contains no "
                                 "language model; start the server with --backend transformers --model ..., or "
                                 "pass a QueryBackend to create_app")
        if not isinstance(body.get("query"), str):
            raise InvalidArgumentError("'query' (a string) is required")
        if not isinstance(body.get("options", {}), dict):
            raise InvalidArgumentError("'options' must be an object")
        answer = await run_in_threadpool(self.backend.query, self.bucket, cid, body["query"],
                                         body.get("options") or {})
        return JSONResponse(answer)

    async def promote(self, request: Request):
        body = await self.body_json(request, "PromoteRequest")
        cid = check_context_id(request.path_params["id"])
        target, device = body.get("target_tier", "warm"), body.get("device", "cuda")
        if target not in ("warm", "hot"):
            raise InvalidArgumentError(f"promote to 'warm' or 'hot', not {target!r}")
        if not isinstance(device, str) or not re.fullmatch(DEVICE_PATTERN, device):
            raise InvalidArgumentError(f"device must match {DEVICE_PATTERN}, got {device!r}")
        await run_in_threadpool(self.bucket.lookup, cid)  # 404 before any tier question
        if target == "hot":
            try:
                check_device(device)
            except InvalidArgumentError as exc:  # a well-formed request this machine cannot satisfy
                return self.err(409, str(exc))
        tier = await run_in_threadpool(self.bucket.promote, cid, target, device=device)
        return JSONResponse({"status": "success", "context_id": cid, "tier": tier})

    async def demote(self, request: Request):
        body = await self.body_json(request, "DemoteRequest")
        cid = check_context_id(request.path_params["id"])
        await run_in_threadpool(self.bucket.lookup, cid)
        tier = await run_in_threadpool(self.bucket.demote, cid, body.get("target_tier", "cold"))
        return JSONResponse({"status": "success", "context_id": cid, "tier": tier})

    async def discover(self, request: Request):
        force, with_meta = _flag(request, "force_scan"), _flag(request, "include_metadata")
        model = request.path_params["id"]
        t = time.perf_counter()
        out = await run_in_threadpool(self.bucket.discover, model, force_scan=force, include_metadata=with_meta)
        return JSONResponse({"status": "success", "model_id": model, "from_cache": not force,
                             "scan_time_ms": (time.perf_counter() - t) * 1e3, "contexts": out})

    async def registry(self, request: Request):
        reg = await run_in_threadpool(self.bucket.registry)
        return JSONResponse({"status": "success", "mcrp_version": reg["mcrp_version"], "statistics": reg["statistics"],
                             "last_updated": reg["last_updated"]})

    async def rebuild(self, request: Request):
        await self.body_json(request, "RebuildRequest")  # no fields: nothing or {}
        reg = await run_in_threadpool(self.bucket.rebuild)
        skipped = [dict(x, reason=self.scrub(str(x.get("reason", "")))) for x in reg["skipped"]]
        return JSONResponse({"status": "success", "statistics": reg["statistics"], "skipped": skipped})

    # -- the pages area (mcf.bucket.pages over HTTP: docs/bucket.md §12) ----------------------------
    def _page_store(self, namespace: str, create: bool) -> PageStore | None:
        """The namespace's store (opened once, kept among the last ``_OPEN_NAMESPACES``); None when it
        does not exist and ``create`` is false (a read of a namespace nobody wrote: a miss)."""
        check_namespace(namespace)
        store = self.page_stores.get(namespace)
        if store is None:
            try:
                store = PageStore(self.bucket.root, namespace, create=create)
            except FileNotFoundError:
                if create:
                    raise
                return None
            if len(self.page_stores) >= _OPEN_NAMESPACES:  # dropped, not closed: a request may still use it
                self.page_stores.pop(next(iter(self.page_stores)))
            self.page_stores[namespace] = store
        return store

    @staticmethod
    def _page_key(request: Request) -> str:
        name = request.path_params["key"]
        key = key_of_name(name) if _PAGE_NAME.fullmatch(name) else None
        if key is None:
            raise InvalidArgumentError(f"{name[:80]!r} is not a page name (a key as mcf.bucket.pages.page_name "
                                       "writes it)")
        return key

    @contextlib.contextmanager
    def _page_slot(self):
        """One of ``max_concurrent_pages`` page transfers (each holds a page in memory)."""
        if self.pages_running >= self.max_concurrent_pages:
            raise _Busy(f"{self.pages_running} page transfers are running, the most this server takes at once "
                        "(max_concurrent_pages, --max-concurrent-pages); retry later")
        self.pages_running += 1
        try:
            yield
        finally:
            self.pages_running -= 1

    async def page_keys(self, request: Request):
        store = self._page_store(request.path_params["namespace"], create=False)
        keys = [] if store is None else await run_in_threadpool(store.keys)
        return JSONResponse({"status": "success", "keys": keys})

    async def pages_exist(self, request: Request):
        body = await self.body_json(request, "PagesExist")
        keys, prefix = body.get("keys"), body.get("prefix", True)
        if not isinstance(keys, list) or len(keys) > MAX_EXISTS_KEYS or not all(
                isinstance(k, str) and 1 <= len(k) <= MAX_KEY_CHARS for k in keys):
            raise InvalidArgumentError(f"keys must be a list of at most {MAX_EXISTS_KEYS} strings of 1 to "
                                       f"{MAX_KEY_CHARS} characters")
        if not isinstance(prefix, bool):
            raise InvalidArgumentError("prefix must be true or false")
        store = self._page_store(request.path_params["namespace"], create=False)
        if prefix:
            hits = 0 if store is None else await run_in_threadpool(store.prefix_hits, keys)
            return JSONResponse({"status": "success", "hits": hits})
        found = [False] * len(keys) if store is None else await run_in_threadpool(store.exists_many, keys)
        return JSONResponse({"status": "success", "exists": found})

    async def head_page(self, request: Request):
        key = self._page_key(request)
        store = self._page_store(request.path_params["namespace"], create=False)
        there = store is not None and await run_in_threadpool(store.exists, key)
        return Response(status_code=200) if there else self.err(404, "no such page")

    async def get_page(self, request: Request):
        key = self._page_key(request)
        store = self._page_store(request.path_params["namespace"], create=False)
        with self._page_slot():
            got = None if store is None else await run_in_threadpool(store.get, key)
        if got is None:
            return self.err(404, "no such page (absent, expired or damaged)")
        meta, payload = got
        return Response(meta + payload, media_type="application/octet-stream",
                        headers={"x-page-meta-length": str(len(meta))})

    async def put_page(self, request: Request):
        key = self._page_key(request)
        q = request.query_params
        raw_len = q.get("meta_len", "0")
        if not raw_len.isdigit() or int(raw_len) > MAX_META_BYTES:
            raise InvalidArgumentError(f"meta_len must be an integer from 0 to {MAX_META_BYTES}")
        meta_len = int(raw_len)
        replace = _flag(request, "replace")
        _check_type(request, _UPLOAD_TYPES[:1], body_required=True)
        store = self._page_store(request.path_params["namespace"], create=True)
        with self._page_slot():
            body = await _read_body(request, self.max_page_bytes + meta_len)
            if len(body) < meta_len:
                raise InvalidArgumentError(f"a body of {len(body)} bytes cannot hold meta_len={meta_len} bytes")
            view = memoryview(body)
            written = await run_in_threadpool(lambda: store.put(key, view[meta_len:], meta=view[:meta_len],
                                                                replace=replace))
        return JSONResponse({"status": "success", "written": written}, status_code=201)

    async def delete_page(self, request: Request):
        key = self._page_key(request)
        store = self._page_store(request.path_params["namespace"], create=False)
        if store is None or not await run_in_threadpool(store.delete, key):
            return self.err(404, "no such page")
        return Response(status_code=204)
