"""The REST server of seed 003 §6.1 under ``/mcrp/v1/`` (Starlette on uvicorn: the ``server`` extra).

Why these choices: the bucket does blocking file I/O, so every operation runs in the thread pool; KV
payloads are streamed from the file in 1 MiB pieces rather than buffered, and uploads are spooled to a
nameless file on the bucket's disk rather than held in memory; errors are JSON with the status a
client can act on (400 bad argument, 401 missing token, 403 cross-origin write, 404 unknown id, 409 a
tier this process cannot provide, 413 body too large, 415 wrong content type, 422 malformed upload or
stored data, 501 no query backend), and never name the bucket's absolute path.

Exposure (docs/bucket.md, "Deploying"): every state-changing route takes only ``application/json``
(or the upload's ``application/octet-stream``) and refuses requests whose ``Origin`` is not the
server's own, so a web page cannot drive it; the ``Host`` header must be a valid host and port
(RFC 9112 §3.2) naming a host in an allow-list (DNS rebinding); without a token :func:`serve` listens
on loopback only (Redis' protected mode); bodies are read in pieces up to a hard limit; ingests run a
few at a time (503 with Retry-After past :data:`DEFAULT_MAX_CONCURRENT_INGESTS`), their arrays bounded
once decoded; a full disk is 507 (as MinIO answers), logged in one line; connections are capped,
slow ones closed, and requests framed strictly (:mod:`mcf.bucket._http_limits`); every request is
logged in one line (:mod:`mcf.bucket._access_log`).  ``query`` needs a language model, which this
engine does not contain: it goes through a :class:`QueryBackend` given to :func:`create_app`
(:class:`mcf.bucket.hf.TransformersBackend` is one); a backend that also has ``ingest``
(:class:`IngestBackend`) lets the ingest route take the content itself as a JSON body and compute its
KV cache.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import ipaddress
import json
import logging
import os
import re
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol

from mcf._core.args import integer
from mcf._core.optional import require
from mcf.bucket._events import DEFAULT_KEEPALIVE, DEFAULT_MAX_STREAMS, EventHub, TooManyStreamsError, parse_last_id
from mcf.bucket.store import Bucket, check_context_id, check_model_id
from mcf.errors import ContextNotFoundError, FormatError, InvalidArgumentError, MCFError, MCFIOError, StaleContextError

__all__ = ["DEFAULT_ALLOWED_HOSTS", "DEFAULT_MAX_BODY", "DEFAULT_MAX_CONCURRENT_INGESTS", "DEFAULT_MAX_INGEST_BYTES",
           "DEFAULT_MAX_JSON_BODY", "DEFAULT_MAX_TEXT_BODY", "OPENAPI", "IngestBackend", "QueryBackend", "check_bind",
           "check_token", "create_app", "serve"]

PREFIX = "/mcrp/v1"
#: the ingest upload (an .npz) as sent
DEFAULT_MAX_BODY = 1 << 30
#: the bytes an upload's arrays hold once decoded (read from their headers before any data): a 32-layer,
#: 8-KV-head, 128-dim model's 8,192-token context in float16 is 1 GiB
DEFAULT_MAX_INGEST_BYTES = 1 << 30
#: ingests (uploads or texts for a model backend) running at once; each holds about one array of the
#: context, converted and compressed, while it writes (docs/bucket.md, "Limits and their defaults")
DEFAULT_MAX_CONCURRENT_INGESTS = 4
#: every other body (promote, demote, query, rebuild) is a small JSON object
DEFAULT_MAX_JSON_BODY = 1 << 20
#: a content sent as text to a model backend (JSON): 16 MiB is millions of tokens, beyond any model's window
DEFAULT_MAX_TEXT_BODY = 16 << 20
#: the Host names answered by default: loopback only (a foreign Host is a DNS-rebinding page's request)
DEFAULT_ALLOWED_HOSTS = ("localhost", "127.0.0.1", "::1")
#: a token shorter than this draws a warning (a 32-byte random token is what ``secrets.token_urlsafe(32)`` gives)
MIN_TOKEN_BYTES = 32
_STREAM_PIECE = 1 << 20
_JSON_TYPES = ("application/json",)
_UPLOAD_TYPES = ("application/octet-stream", "application/zip")
_UNSAFE_METHODS = ("POST", "PUT", "PATCH", "DELETE")
_log = logging.getLogger("mcf.bucket.server")


class QueryBackend(Protocol):
    """Answers a query against a cached context (a runtime with the model loaded)."""

    def query(self, bucket: Bucket, context_id: str, query: str, options: dict) -> dict: ...


class IngestBackend(Protocol):
    """Computes the KV cache of a content with the model it serves (``model_id``), and stores it."""

    model_id: str

    def ingest(self, bucket: Bucket, content: str | None = None, *, token_ids: Any = None, **options: Any) -> dict: ...


_CTX_ID = {"type": "string", "pattern": "^ctx_[0-9a-f]{32}$", "example": "ctx_" + "0" * 32}
_DEVICE_PATTERN = "^(cpu|cuda|mps)(:[0-9]{1,3})?$"
_MODEL_ID = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", "example": "llama-3-8b"}


def _p(name: str, where: str = "path", required: bool = True, schema: dict | None = None,
       description: str | None = None) -> dict:
    out = {"name": name, "in": where, "required": required, "schema": schema or {"type": "string"}}
    if description:
        out["description"] = description
    return out


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


def _errors(*codes: int) -> dict:
    why = {400: "invalid argument or id, or a Host header not in the allow-list",
           401: "missing or wrong bearer token", 403: "a state-changing request from another origin",
           404: "no such context, model or route",
           409: "the tier cannot be reached here (no torch or no such device, larger than the warm budget, "
                "or the device out of memory), "
                "or the context is stale (computed by its model's former weights), "
                "or encrypted under a key this server does not hold",
           413: "body too large (or, for an upload, the arrays it declares)",
           415: "content type not accepted on this route (JSON routes take application/json, the upload "
                "application/octet-stream)",
           422: "malformed upload or corrupt stored data", 500: "I/O failure on the server",
           501: "no model backend configured (query, or an ingest of text)",
           503: "too many event streams open, or too many ingests running (retry after the Retry-After seconds)",
           507: "no space left on the server's disk"}
    return {str(c): _json("Error", why[c]) for c in sorted({400, 401, 422, 500, *codes})}


#: what every state-changing route may also answer: cross-origin (403), body too large (413), wrong type (415)
_WRITE = (403, 413, 415)


_NULLABLE_STR = {"type": "string", "nullable": True}
_TIER = {"type": "string", "enum": ["hot", "warm", "cold"]}
_SUMMARY = {
    "type": "object",
    "required": ["context_id", "name", "token_count", "size_bytes", "last_accessed", "expires_at", "pinned",
                 "dtype", "tier", "is_loaded"],
    "properties": {
        "context_id": _CTX_ID, "name": _NULLABLE_STR, "token_count": {"type": "integer", "minimum": 0},
        "size_bytes": {"type": "integer", "minimum": 0}, "last_accessed": {"type": "string"},
        "expires_at": _NULLABLE_STR, "pinned": {"type": "boolean"},
        "dtype": {"type": "string", "enum": ["float32", "float16", "bfloat16", "int8"]},
        "prefix": {"type": "object", "nullable": True}, "tier": _TIER, "is_loaded": {"type": "boolean"},
        "preferred_tier": {"type": "string", "enum": ["hot", "warm", "cold"], "nullable": True},
        "model_id": _MODEL_ID, "model_hash": _NULLABLE_STR, "stale": {"type": "boolean"},
        "metadata": {"type": "object"},
    },
}
_SCHEMAS = {
    "Error": {"type": "object", "required": ["status", "error"],
              "properties": {"status": {"type": "string", "enum": ["error"]}, "error": {"type": "string"}}},
    "ContextSummary": _SUMMARY,
    "ContextList": {"type": "object", "required": ["status", "contexts"],
                    "properties": {"status": {"type": "string", "enum": ["success"]},
                                   "contexts": {"type": "array", "items": _ref("ContextSummary")}}},
    "Discovery": {"type": "object", "required": ["status", "model_id", "from_cache", "contexts"],
                  "properties": {"status": {"type": "string", "enum": ["success"]}, "model_id": _MODEL_ID,
                                 "from_cache": {"type": "boolean"}, "scan_time_ms": {"type": "number"},
                                 "contexts": {"type": "array", "items": _ref("ContextSummary")}}},
    "Metadata": {"type": "object", "required": ["context_id", "model_id", "version", "content", "kv_cache",
                                                "storage", "timestamps", "access"],
                 "properties": {"context_id": _CTX_ID, "model_id": _MODEL_ID, "version": {"type": "integer"},
                                "content": {"type": "object", "required": ["hash", "token_count"]},
                                "kv_cache": {"type": "object", "required": ["shape", "dtype", "size_bytes"]},
                                "storage": {"type": "object"}, "timestamps": {"type": "object"},
                                "access": {"type": "object"}, "pinned": {"type": "boolean"},
                                "prefix": {"type": "object", "nullable": True}}},
    "Ingested": {"type": "object", "required": ["status", "context_id", "deduplicated", "token_count", "size_bytes"],
                 "properties": {"status": {"type": "string", "enum": ["success"]}, "context_id": _CTX_ID,
                                "deduplicated": {"type": "boolean"}, "token_count": {"type": "integer"},
                                "size_bytes": {"type": "integer"}, "ingestion_time_ms": {"type": "number"}}},
    "TextIngest": {"type": "object", "additionalProperties": False,
                   "description": "the content itself, for a server with a model backend: exactly one of the two",
                   "properties": {"content": {"type": "string"},
                                  "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
    "PromoteRequest": {"type": "object", "additionalProperties": False, "properties": {
        "target_tier": {"type": "string", "enum": ["warm", "hot"], "default": "warm"},
        "device": {"type": "string", "pattern": _DEVICE_PATTERN, "default": "cuda"}}},
    "DemoteRequest": {"type": "object", "additionalProperties": False, "properties": {
        "target_tier": {"type": "string", "enum": ["warm", "cold"], "default": "cold"}}},
    "Tier": {"type": "object", "required": ["status", "context_id", "tier"],
             "properties": {"status": {"type": "string", "enum": ["success"]}, "context_id": _CTX_ID, "tier": _TIER}},
    "QueryRequest": {"type": "object", "required": ["query"], "additionalProperties": False,
                     "properties": {"query": {"type": "string"}, "options": {"type": "object"}}},
    "Answer": {"type": "object"},
    "Statistics": {"type": "object", "required": ["total_models", "total_contexts", "total_storage_bytes",
                                                  "total_tokens"],
                   "properties": {k: {"type": "integer", "minimum": 0} for k in
                                  ("total_models", "total_contexts", "total_storage_bytes", "total_tokens")}},
    "Registry": {"type": "object", "required": ["status", "mcrp_version", "statistics", "last_updated"],
                 "properties": {"status": {"type": "string", "enum": ["success"]}, "mcrp_version": {"type": "string"},
                                "statistics": _ref("Statistics"), "last_updated": {"type": "string"}}},
    "RebuildRequest": {"type": "object", "additionalProperties": False},
    "Rebuilt": {"type": "object", "required": ["status", "statistics", "skipped"],
                "properties": {"status": {"type": "string", "enum": ["success"]}, "statistics": _ref("Statistics"),
                               "skipped": {"type": "array", "items": {"type": "object"}}}},
}
_ID = _p("id", schema=_CTX_ID)
_BINARY = {"schema": {"type": "string", "format": "binary"}}


def _body(schema: str, required: bool = False) -> dict:
    return {"required": required, "content": {"application/json": {"schema": _ref(schema)}}}

OPENAPI: dict = {
    "openapi": "3.0.3",
    "info": {"title": "Model Context Bucket", "version": "1.0",
             "description": "Seed 003's REST API (MCRP v1) over a bucket of pre-computed KV caches."},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": _SCHEMAS},
    "security": [{"bearer": []}],
    "paths": {
        f"{PREFIX}/contexts": {
            "get": {"summary": "List all (unexpired) contexts, of one model when model_id is given",
                    "parameters": [_p("model_id", "query", False, _MODEL_ID)],
                    "responses": {"200": _json("ContextList", "contexts"), **_errors(400)}},
            "post": {"summary": "Ingest a context: body is an .npz with arrays k and v [layers, heads, tokens, "
                                "head_dim], or (with a model backend) the content as JSON, whose KV cache the server "
                                "computes",
                     "parameters": [_p("model_id", "query", True, _MODEL_ID), _p("content", "query", False),
                                    _p("token_ids", "query", False,
                                       {"type": "string", "pattern": "^[0-9]{1,18}(,[0-9]{1,18})*$"},
                                       "comma-separated token ids (instead of content; enables prefix reuse)"),
                                    _p("name", "query", False), _p("source", "query", False),
                                    _p("dtype", "query", False,
                                       {"type": "string", "enum": ["float32", "float16", "bfloat16", "int8"]}),
                                    _p("compression", "query", False,
                                       {"type": "string", "enum": ["none", "lz4", "zstd"]}),
                                    _p("ttl", "query", False, {"type": "number", "exclusiveMinimum": True,
                                                               "minimum": 0, "maximum": 3.1e9})],
                     "requestBody": {"required": True, "content": {"application/octet-stream": _BINARY,
                                                                   "application/json": {"schema": _ref("TextIngest")}}},
                     "responses": {"201": _json("Ingested", "ingested (or found: deduplicated)"),
                                   **_errors(*_WRITE, 409, 422, 501, 503, 507)}},
        },
        f"{PREFIX}/contexts/{{id}}": {
            "get": {"summary": "Context metadata", "parameters": [_ID],
                    "responses": {"200": _json("Metadata", "metadata"), **_errors(400, 404, 422)}},
            "delete": {"summary": "Delete a context", "parameters": [_ID],
                       "responses": {"204": {"description": "deleted"}, **_errors(*_WRITE, 404, 422)}},
        },
        f"{PREFIX}/contexts/{{id}}/kv": {
            "get": {"summary": "Stream the context's kv_data.mcb to a runtime",
                    "parameters": [_ID, _p("force", "query", False, {"type": "boolean"})],
                    "responses": {"200": {"description": "kv_data.mcb bytes", "content": {
                        "application/octet-stream": _BINARY}}, **_errors(404, 409, 422)}},
        },
        f"{PREFIX}/contexts/{{id}}/query": {
            "post": {"summary": "Query with a context (needs a query backend)", "parameters": [_ID],
                     "requestBody": _body("QueryRequest", True),
                     "responses": {"200": _json("Answer", "the backend's answer"),
                                   **_errors(*_WRITE, 404, 409, 422, 501)}},
        },
        f"{PREFIX}/contexts/{{id}}/promote": {
            "post": {"summary": "Promote to warm (RAM) or hot (a torch device) in this server's memory",
                     "parameters": [_ID], "requestBody": _body("PromoteRequest"),
                     "responses": {"200": _json("Tier", "tier"), **_errors(*_WRITE, 404, 409, 422)}},
        },
        f"{PREFIX}/contexts/{{id}}/demote": {
            "post": {"summary": "Demote to warm or cold in this server's memory", "parameters": [_ID],
                     "requestBody": _body("DemoteRequest"),
                     "responses": {"200": _json("Tier", "tier"), **_errors(*_WRITE, 404, 422)}},
        },
        f"{PREFIX}/models/{{id}}/contexts": {
            "get": {"summary": "Discover a model's contexts",
                    "parameters": [_p("id", schema=_MODEL_ID), _p("force_scan", "query", False, {"type": "boolean"}),
                                   _p("include_metadata", "query", False, {"type": "boolean"})],
                    "responses": {"200": _json("Discovery", "contexts"), **_errors(422)}},
        },
        f"{PREFIX}/registry": {"get": {"summary": "Registry statistics",
                                       "responses": {"200": _json("Registry", "statistics"), **_errors()}}},
        f"{PREFIX}/events": {
            "get": {"summary": "Server-Sent Events stream of bucket events (seed 003 §6.2)",
                    "parameters": [_p("last_event_id", "query", False, {"type": "string", "pattern": "^[0-9]{1,18}$"}),
                                   _p("Last-Event-ID", "header", False,
                                      {"type": "string", "pattern": "^[0-9]{1,18}$"})],
                    "responses": {"200": {"description": "text/event-stream: `id`, `event` and a JSON `data` line "
                                                         "per event, until the client leaves or the server stops",
                                          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                                  **_errors(503)}},
        },
        f"{PREFIX}/registry/rebuild": {"post": {"summary": "Rebuild the registry from disk",
                                                "requestBody": _body("RebuildRequest"),
                                                "responses": {"200": _json("Rebuilt", "statistics"),
                                                              **_errors(*_WRITE)}}},
    },
}


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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Protected mode (Redis'): without a token the server answers on loopback only, so refuse to
    listen anywhere else (``0.0.0.0``, ``::``, a LAN address, a host name)."""
    if token is None and not _is_loopback(host):
        raise InvalidArgumentError(
            f"refusing to listen on {host!r} without a token: anyone who can reach that address could read and "
            "change the bucket.  Listen on 127.0.0.1 (the default), or set a token (MCF_BUCKET_TOKEN or "
            "--token-file) and put TLS in front (docs/bucket.md, Deploying)")


def _bearer_ok(authorization: bytes | str | None, token: str) -> bool:
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


def _out_of_space(exc: BaseException) -> bool:
    """A full disk, or a full quota: 507 (MinIO's answer), not a server failure."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _media_type(request) -> str | None:
    ct = request.headers.get("content-type")
    return None if ct is None else ct.split(";", 1)[0].strip().lower()


def create_app(root: str | os.PathLike, *, token: str | None = None, backend: QueryBackend | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY, max_json_bytes: int = DEFAULT_MAX_JSON_BODY,
               allowed_hosts: Any = DEFAULT_ALLOWED_HOSTS, bucket: Bucket | None = None,
               max_event_streams: int = DEFAULT_MAX_STREAMS, events_keepalive: float = DEFAULT_KEEPALIVE,
               max_ingest_bytes: int = DEFAULT_MAX_INGEST_BYTES,
               max_concurrent_ingests: int = DEFAULT_MAX_CONCURRENT_INGESTS):
    """The Starlette application.  ``allowed_hosts``: the Host names answered (``"*"``: any, for a
    server behind a proxy that checks them); ``max_body_bytes`` bounds the ingest upload as sent,
    ``max_ingest_bytes`` the bytes its arrays declare (checked before any is decoded), ``max_json_bytes``
    every other body (a text ingest's: :data:`DEFAULT_MAX_TEXT_BODY`, or ``max_body_bytes`` when
    smaller); past ``max_concurrent_ingests`` ingests at once, one more is 503 with ``Retry-After``.
    ``backend`` answers the query route (:class:`QueryBackend`) and, when it has ``ingest``
    (:class:`IngestBackend`), takes text ingests; without one both answer 501.
    ``max_event_streams`` open ``/events`` streams at most (503 past it), each sent a keep-alive comment
    every ``events_keepalive`` seconds (:mod:`mcf.bucket._events`); the hub is ``app.state.events``."""
    require("starlette", feature="the bucket's REST server", extra="server")
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from mcf.bucket._npz import UploadTooLargeError, read_kv_npz
    from mcf.bucket.tiers import HotTierFullError, WarmBudgetError
    from mcf.errors import EncryptionKeyError
    from mcf.bucket._names import root_scrubber

    check_token(token)
    for name, v in (("max_body_bytes", max_body_bytes), ("max_json_bytes", max_json_bytes),
                    ("max_ingest_bytes", max_ingest_bytes), ("max_concurrent_ingests", max_concurrent_ingests)):
        integer(v, name, minimum=1)
    any_host = allowed_hosts == "*" or (not isinstance(allowed_hosts, str) and "*" in allowed_hosts)
    hosts = set() if any_host else {_host_name(h) for h in ([allowed_hosts] if isinstance(allowed_hosts, str)
                                                           else allowed_hosts)}
    b = bucket if bucket is not None else Bucket(root)
    scrub = root_scrubber(root, b.root)  # every spelling of the bucket's location: never sent to a client

    def err(status: int, message: str, close: bool = False, headers: dict | None = None) -> JSONResponse:
        h = dict(headers or {}, **({"connection": "close"} if close else {}))
        return JSONResponse({"status": "error", "error": scrub(message)}, status_code=status, headers=h or None)

    def endpoint(fn):
        async def handler(request: Request):
            if token is not None and request.url.path != f"{PREFIX}/openapi.json":
                if not _bearer_ok(request.headers.get("authorization"), token):
                    # a body it sent is not read: end the connection rather than wait for the rest
                    h = request.headers
                    pending = h.get("content-length", "0") != "0" or "transfer-encoding" in h
                    return err(401, "missing or wrong bearer token", close=pending)
            try:
                return await fn(request)
            except UploadTooLargeError as exc:
                return err(413, str(exc), close=True)  # the rest of the body is not read: end the connection
            except _UnsupportedMedia as exc:
                return err(415, str(exc), close=True)
            except (WarmBudgetError, HotTierFullError, StaleContextError, EncryptionKeyError) as exc:
                return err(409, str(exc))
            except InvalidArgumentError as exc:
                return err(400, str(exc))
            except ContextNotFoundError as exc:
                return err(404, str(exc))
            except FormatError as exc:
                return err(422, str(exc))
            except OSError as exc:  # MCFIOError from the bucket, or a bare one from the spool's writes
                if _out_of_space(exc):  # the rest of an upload is not read: end the connection
                    _log.warning("%s %s: 507, no space left on the bucket's disk (%s)", request.method,
                                 request.url.path, scrub(str(exc)))
                    return err(507, f"no space left on the server's disk: {exc}", close=True)
                if not isinstance(exc, MCFIOError):
                    _log.exception("unexpected error on %s %s", request.method, request.url.path)
                    return err(500, "internal server error (logged on the server)")
                _log.warning("I/O failure: %s", scrub(str(exc)))
                return err(500, f"I/O failure on the server: {exc}")
            except MCFError as exc:
                return err(400, str(exc))
            except ClientDisconnect:
                return Response(status_code=400)  # nobody is listening any more
            except Exception:  # a bug: logged with its traceback, never shown to the client
                _log.exception("unexpected error on %s %s", request.method, request.url.path)
                return err(500, "internal server error (logged on the server)")
        return handler

    async def read_body(request: Request, limit: int, sink=None) -> bytes:
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

    def check_type(request: Request, allowed: tuple[str, ...], body_required: bool) -> None:
        """Only the documented content types on state-changing routes: a browser sends text/plain,
        form and multipart bodies cross-site without asking the server first (no CORS preflight)."""
        mt = _media_type(request)
        if mt is None and not body_required and request.headers.get("content-length", "0") == "0" \
                and "transfer-encoding" not in request.headers:
            return  # no body at all: the defaults
        if mt not in allowed:
            raise _UnsupportedMedia(f"content type {mt or '(none)'} is not accepted here; send {' or '.join(allowed)}")

    async def body_json(request: Request, schema: str, limit: int | None = None) -> dict:
        """The JSON object body of a route whose document schema is ``schema`` (unknown fields are
        refused: a misspelt ``target_teir`` must not silently mean the default), at most ``limit`` bytes
        (default ``max_json_bytes``)."""
        check_type(request, _JSON_TYPES, body_required=False)
        raw = await read_body(request, max_json_bytes if limit is None else limit)
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
        known = _SCHEMAS[schema].get("properties", {})
        unknown = sorted(set(obj) - set(known))
        if unknown:
            raise InvalidArgumentError(f"unknown field(s) {unknown} in the body; allowed: {sorted(known)}")
        return obj

    async def list_contexts(request: Request):
        model = request.query_params.get("model_id")
        if model is not None:
            check_model_id(model)  # an empty or malformed model_id is a 400, not "all models"
        reg = await run_in_threadpool(b.registry)
        models = [model] if model is not None else [m["model_id"] for m in reg["models"]]
        out = []
        for m in models:
            out += [dict(c, model_id=m) for c in await run_in_threadpool(b.discover, m)]
        return JSONResponse({"status": "success", "contexts": out})

    token_ids_re = re.compile(OPENAPI["paths"][f"{PREFIX}/contexts"]["post"]["parameters"][2]["schema"]["pattern"])

    def ingest_args(q) -> dict:
        """The query parameters of an ingest, checked before any of the body is read."""
        if "model_id" not in q:
            raise InvalidArgumentError("model_id is required")
        check_model_id(q["model_id"])
        kw: dict[str, Any] = {}
        if "token_ids" in q:
            if not token_ids_re.fullmatch(q["token_ids"]):
                raise InvalidArgumentError("token_ids must be comma-separated decimal integers of 1-18 digits")
            kw["token_ids"] = [int(t) for t in q["token_ids"].split(",")]
        if "content" in q:
            kw["content"] = q["content"]
        if ("content" in kw) == ("token_ids" in kw):
            raise InvalidArgumentError("give exactly one of content or token_ids")
        return dict(kw, **ingest_options(q))

    def ingest_options(q) -> dict:
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

    async def ingest_text(request: Request):
        """The content itself as JSON (``{"content": text}`` or ``{"token_ids": [...]}``): the model
        backend computes its KV cache; the other parameters stay in the query, as for an upload."""
        q = request.query_params
        if "model_id" not in q:
            raise InvalidArgumentError("model_id is required")
        check_model_id(q["model_id"])
        for k in ("content", "token_ids"):
            if k in q:
                raise InvalidArgumentError(f"with a JSON body, {k} goes in the body, not in the query")
        kw = ingest_options(q)
        if backend is None or not callable(getattr(backend, "ingest", None)):
            return err(501, "no model backend is configured: this server stores KV caches computed elsewhere (send "
                            "them as an .npz upload, application/octet-stream), or start it with --backend "
                            "transformers --model ... to compute them from text")
        if q["model_id"] != backend.model_id:
            raise InvalidArgumentError(f"this server's model backend serves {backend.model_id!r}, "
                                       f"not {q['model_id']!r}")
        body = await body_json(request, "TextIngest", limit=min(max_body_bytes, DEFAULT_MAX_TEXT_BODY))
        if ("content" in body) == ("token_ids" in body):
            raise InvalidArgumentError("give exactly one of content or token_ids in the body")
        if "content" in body and not isinstance(body["content"], str):
            raise InvalidArgumentError("content must be a string")
        ids = body.get("token_ids")
        if ids is not None and (not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**63 for i in ids)):
            raise InvalidArgumentError("token_ids must be a list of non-negative integers")
        meta = await run_in_threadpool(lambda: backend.ingest(b, body.get("content"), token_ids=ids, **kw))
        out = {"status": "success", "context_id": meta["context_id"], "deduplicated": meta.get("deduplicated", False),
               "token_count": meta["content"]["token_count"], "size_bytes": meta["kv_cache"]["size_bytes"]}
        if isinstance(meta.get("ingestion_time_ms"), (int, float)):
            out["ingestion_time_ms"] = meta["ingestion_time_ms"]
        return JSONResponse(out, status_code=201)

    running = [0]  # ingests admitted and not finished (the event loop is the only writer)

    async def ingest(request: Request):
        """Admission first: past ``max_concurrent_ingests``, 503 before any of the body is read."""
        if running[0] >= max_concurrent_ingests:
            return err(503, f"{running[0]} concurrent ingests are running, the most this server takes at once "
                            "(max_concurrent_ingests, --max-concurrent-ingests); retry later",
                       close=True, headers={"retry-after": "1"})
        running[0] += 1
        try:
            if _media_type(request) in _JSON_TYPES:
                return await ingest_text(request)
            return await ingest_upload(request)
        finally:
            running[0] -= 1

    async def ingest_upload(request: Request):
        q = request.query_params
        kw = ingest_args(q)
        check_type(request, _UPLOAD_TYPES, body_required=True)
        spool = await run_in_threadpool(b.scratch_file)
        try:
            await read_body(request, max_body_bytes, sink=spool.write)

            def work():
                spool.flush()
                try:
                    arrays = read_kv_npz(spool, limit=max_ingest_bytes, scratch=b.scratch_file, name="body")
                except UploadTooLargeError as exc:
                    raise UploadTooLargeError(f"{exc} (max_ingest_bytes, --max-ingest-bytes)") from None
                with arrays:
                    return b.ingest(q["model_id"], arrays.layers(), **kw)

            meta = await run_in_threadpool(work)
        finally:
            with contextlib.suppress(OSError):  # a full disk: the write above failed with it already
                spool.close()
        return JSONResponse({"status": "success", "context_id": meta["context_id"],
                             "deduplicated": meta.get("deduplicated", False),
                             "token_count": meta["content"]["token_count"],
                             "size_bytes": meta["kv_cache"]["size_bytes"]}, status_code=201)

    async def get_context(request: Request):
        return JSONResponse(await run_in_threadpool(b.lookup, request.path_params["id"]))

    async def delete_context(request: Request):
        await run_in_threadpool(b.delete, request.path_params["id"])
        return Response(status_code=204)

    def flag(request: Request, name: str) -> bool:
        raw = request.query_params.get(name, "false").lower()
        if raw not in ("true", "false", "1", "0"):
            raise InvalidArgumentError(f"{name} must be true or false, got {raw[:20]!r}")
        return raw in ("true", "1")

    async def usable(cid: str, *, force: bool = False, hint: str = "") -> dict:
        """The metadata of context ``cid``, which must exist, be unexpired and (unless ``force``) not be
        stale: every route that hands a context's KV data on (as bytes, or to the query backend, which may
        read it without Bucket.load's check) refuses a stale one with 409, as Bucket.load does."""
        meta = await run_in_threadpool(b.lookup, cid)
        if not force and await run_in_threadpool(b.is_stale, meta):
            raise StaleContextError(f"{cid} is stale: it was computed by its model's former weights "
                                    f"(ingest the content again{hint})")
        return meta

    async def stream_kv(request: Request):
        cid = request.path_params["id"]
        meta = await usable(cid, force=flag(request, "force"), hint=", or add ?force=true to fetch it anyway")
        f = await run_in_threadpool(b.open, cid)  # validates header, sizes and chunk table first
        # the bytes come from the descriptor that was validated, not from a second open of the path
        fh = os.fdopen(os.dup(f.fileno()), "rb")  # noqa: SIM115 - closed by the generator
        f.close()

        def pieces():
            with fh:
                while True:
                    piece = fh.read(_STREAM_PIECE)
                    if not piece:
                        return
                    yield piece

        headers = {"content-length": str(os.fstat(fh.fileno()).st_size), "x-mcb-checksum": meta["storage"]["checksum"],
                   "x-mcb-dtype": meta["kv_cache"]["dtype"], "x-mcb-compression": meta["kv_cache"]["compression"]}
        return StreamingResponse(pieces(), media_type="application/octet-stream", headers=headers)

    async def query(request: Request):
        body = await body_json(request, "QueryRequest")
        cid = request.path_params["id"]
        await usable(cid)
        if backend is None:
            return err(501, "no query backend is configured: this engine stores KV caches but contains no "
                            "language model; start the server with --backend transformers --model ..., or pass a "
                            "QueryBackend to create_app")
        if not isinstance(body.get("query"), str):
            raise InvalidArgumentError("'query' (a string) is required")
        if not isinstance(body.get("options", {}), dict):
            raise InvalidArgumentError("'options' must be an object")
        answer = await run_in_threadpool(backend.query, b, cid, body["query"], body.get("options") or {})
        return JSONResponse(answer)

    async def promote(request: Request):
        body = await body_json(request, "PromoteRequest")
        cid = check_context_id(request.path_params["id"])
        target, device = body.get("target_tier", "warm"), body.get("device", "cuda")
        if target not in ("warm", "hot"):
            raise InvalidArgumentError(f"promote to 'warm' or 'hot', not {target!r}")
        if not isinstance(device, str) or not re.fullmatch(_DEVICE_PATTERN, device):
            raise InvalidArgumentError(f"device must match {_DEVICE_PATTERN}, got {device!r}")
        await run_in_threadpool(b.lookup, cid)  # 404 before any tier question
        if target == "hot":
            from mcf.bucket.tiers import check_device

            try:
                check_device(device)
            except InvalidArgumentError as exc:  # a well-formed request this machine cannot satisfy
                return err(409, str(exc))
        tier = await run_in_threadpool(lambda: b.promote(cid, target, device=device))
        return JSONResponse({"status": "success", "context_id": cid, "tier": tier})

    async def demote(request: Request):
        body = await body_json(request, "DemoteRequest")
        cid = check_context_id(request.path_params["id"])
        await run_in_threadpool(b.lookup, cid)
        tier = await run_in_threadpool(b.demote, cid, body.get("target_tier", "cold"))
        return JSONResponse({"status": "success", "context_id": cid, "tier": tier})

    async def discover(request: Request):
        force, with_meta = flag(request, "force_scan"), flag(request, "include_metadata")
        t = time.perf_counter()
        out = await run_in_threadpool(lambda: b.discover(request.path_params["id"], force_scan=force,
                                                         include_metadata=with_meta))
        return JSONResponse({"status": "success", "model_id": request.path_params["id"], "from_cache": not force,
                             "scan_time_ms": (time.perf_counter() - t) * 1e3, "contexts": out})

    async def registry(request: Request):
        reg = await run_in_threadpool(b.registry)
        return JSONResponse({"status": "success", "mcrp_version": reg["mcrp_version"], "statistics": reg["statistics"],
                             "last_updated": reg["last_updated"]})

    async def rebuild(request: Request):
        await body_json(request, "RebuildRequest")  # no fields: nothing or {}
        reg = await run_in_threadpool(b.rebuild)
        skipped = [dict(x, reason=scrub(str(x.get("reason", "")))) for x in reg["skipped"]]
        return JSONResponse({"status": "success", "statistics": reg["statistics"], "skipped": skipped})

    openapi_body = JSONResponse(OPENAPI).body  # rendered once: anyone may ask for it, without the token

    async def openapi(request: Request):
        return Response(openapi_body, media_type="application/json")

    def by_method(**handlers):
        """One route per path, so a wrong method gets 405 with the full Allow header."""
        async def dispatch(request: Request):
            m = request.method.lower()
            return await handlers["get" if m == "head" else m](request)
        return dispatch, [m.upper() for m in handlers]

    hub = EventHub(b.subscribe, max_streams=max_event_streams, keepalive=events_keepalive, scrub=scrub)
    if backend is not None and getattr(backend, "model_id", None):
        b.model_loaded(backend.model_id)  # in the history: a stream opened with last_event_id=0 replays it

    async def events(request: Request):
        raw = request.query_params.get("last_event_id", request.headers.get("last-event-id"))
        try:
            last = parse_last_id(raw)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        try:
            s = hub.open(last)
        except TooManyStreamsError as exc:
            return err(503, str(exc))
        return StreamingResponse(hub.stream(s), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    table = {
        "/openapi.json": {"get": openapi},
        "/events": {"get": events},
        "/contexts": {"get": list_contexts, "post": ingest},
        "/contexts/{id}": {"get": get_context, "delete": delete_context},
        "/contexts/{id}/kv": {"get": stream_kv},
        "/contexts/{id}/query": {"post": query},
        "/contexts/{id}/promote": {"post": promote},
        "/contexts/{id}/demote": {"post": demote},
        "/models/{id}/contexts": {"get": discover},
        "/registry": {"get": registry},
        "/registry/rebuild": {"post": rebuild},
    }

    def strict(path: str, method: str, fn):
        """Refuse query parameters the document does not declare (a typo like ``force_scna=true`` must
        not be silently ignored)."""
        op = OPENAPI["paths"].get(PREFIX + path, {}).get(method, {})
        allowed = {p["name"] for p in op.get("parameters", ()) if p["in"] == "query"}

        async def checked(request: Request):
            unknown = sorted(set(request.query_params) - allowed)
            if unknown:
                raise InvalidArgumentError(f"unknown query parameter(s) {unknown}; allowed: {sorted(allowed)}")
            return await fn(request)
        return checked

    routes = []
    for path, handlers in table.items():
        fn, methods = by_method(**{m: endpoint(strict(path, m, h)) for m, h in handlers.items()})
        routes.append(Route(PREFIX + path, fn, methods=methods))

    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse({"status": "error", "error": exc.detail}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def unexpected(request: Request, exc: Exception):
        _log.exception("unexpected error on %s %s", request.method, request.url.path)
        return err(500, "internal server error (logged on the server)")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # contexts whose recorded preference is warm or hot (mcf bucket promote --root) are loaded before
        # the first request is answered
        await run_in_threadpool(b.apply_tier_preferences)
        yield

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: unexpected},
                    lifespan=lifespan)
    app.state.events = hub
    return _Exposure(app, hosts, any_host, err)


class _UnsupportedMedia(InvalidArgumentError):
    """415: a body of a type the route does not take."""


class _Exposure:
    """The checks made before any route sees a request (a plain ASGI wrapper: cheap, and it also covers
    404s and 405s): the ``Host`` header must be a valid host and port (RFC 9112 §3.2: 400 otherwise,
    whatever name it seems to hold) naming an allowed host (DNS rebinding: a page on evil.example
    whose name now resolves to 127.0.0.1 still sends ``Host: evil.example``), a request carries at
    most one ``Origin`` (a browser sends one; with two, a check of either could be fooled by the
    other), and a state-changing request that carries one must come from this server's own origin (a
    page elsewhere, or on another port of localhost, cannot drive it: browsers always send Origin on
    cross-origin POST and DELETE, even when they skip the CORS preflight)."""

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


class _AccessLog:
    """One access-log line per request answered by the application (:mod:`mcf.bucket._access_log`):
    the status and body bytes it sent, and the time from the request to the last byte handed over."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from mcf.bucket._access_log import log_request, request_target

        start, status, sent = time.perf_counter(), [0], [0]

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                sent[0] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            log_request(scope.get("client"), scope["method"],
                        request_target(scope.get("raw_path"), scope.get("query_string")),
                        scope.get("http_version", "1.1"), status[0] or 500, sent[0], time.perf_counter() - start)


def serve(root: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
          allowed_hosts: Any = None, max_body_bytes: int = DEFAULT_MAX_BODY,
          max_ingest_bytes: int = DEFAULT_MAX_INGEST_BYTES,
          max_concurrent_ingests: int = DEFAULT_MAX_CONCURRENT_INGESTS,
          max_connections: int | None = None, header_timeout: float | None = None,
          body_timeout: float | None = None, body_min_rate: float | None = None, body_deadline: float | None = None,
          send_timeout: float | None = None, warm_budget_bytes: int | None = None, log_level: str = "warning",
          access_log: bool = True, on_listening: Callable[[str], None] | None = None,
          on_warning: Callable[[str], None] | None = None, backend: QueryBackend | None = None,
          default_ttl: float | None = None, max_event_streams: int = DEFAULT_MAX_STREAMS) -> None:
    """Run the server until interrupted: loopback by default, and only loopback without a token
    (:func:`check_bind`).  ``allowed_hosts`` adds Host names to the loopback ones (and the listening
    address); ``max_body_bytes``, ``max_ingest_bytes`` and ``max_concurrent_ingests`` are
    :func:`create_app`'s; ``max_connections``, ``header_timeout``, ``body_timeout``, ``body_min_rate``,
    ``body_deadline`` and ``send_timeout`` are the limits of :mod:`mcf.bucket._http_limits` (None: its
    default); ``warm_budget_bytes`` the warm tier's budget; ``backend`` answers queries (and, with an
    ``ingest`` method, computes KV caches from text); ``default_ttl`` the seconds until a context
    ingested without ``ttl`` expires (default: never); ``max_event_streams`` the open ``/events``
    streams allowed.  Once listening, ``on_listening`` (default: the log) is told where and how
    (``listening on http://127.0.0.1:8765 (token: required)``); each request is logged in one line on
    standard error unless ``access_log`` is False.  Token warnings (:func:`check_token`) go to
    ``on_warning`` (default: :func:`warnings.warn`)."""
    from mcf.bucket import _http_limits as limits_mod

    uvicorn = require("uvicorn", feature="mcf bucket serve", extra="server")
    for w in check_token(token):
        (on_warning or (lambda m: warnings.warn(m, UserWarning, stacklevel=3)))(w)
    check_bind(host, token)
    extra = list(allowed_hosts or ())
    if "*" in extra and token is None:
        raise InvalidArgumentError("--allow-host '*' needs a token: without one, any web page could reach the "
                                   "server through DNS rebinding")
    if host not in ("0.0.0.0", "::", ""):
        extra.append(host)
    given = {"max_connections": max_connections, "header_timeout": header_timeout, "body_timeout": body_timeout,
             "body_min_rate": body_min_rate, "body_deadline": body_deadline, "send_timeout": send_timeout}
    limits = limits_mod.Limits(**{k: v for k, v in given.items() if v is not None})
    bkw: dict[str, Any] = {"default_ttl": default_ttl}
    if warm_budget_bytes is not None:
        bkw["warm_budget_bytes"] = warm_budget_bytes
    bucket = Bucket(root, **bkw)
    app = create_app(root, token=token, max_body_bytes=max_body_bytes, bucket=bucket, backend=backend,
                     max_event_streams=max_event_streams, max_ingest_bytes=max_ingest_bytes,
                     max_concurrent_ingests=max_concurrent_ingests,
                     allowed_hosts="*" if "*" in extra else (*DEFAULT_ALLOWED_HOSTS, *extra))

    def authorised(headers) -> bool:
        return token is None or any(k == b"authorization" and _bearer_ok(v, token) for k, v in headers)

    config = uvicorn.Config(_AccessLog(app), host=host, port=port, log_level=log_level, access_log=False,
                            log_config=_log_config(access_log), server_header=False,
                            ws="none",  # an upgraded connection would leave the limits of the HTTP protocol
                            http=limits_mod.protocol_class(limits, authorised=authorised))
    protection = "token: required" if token is not None else "token: off, protected mode: loopback only"
    announce = on_listening or _log.info

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and self.servers:  # the address really bound (port 0 picks one)
                bound = self.servers[0].sockets[0].getsockname()
                where = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
                announce(f"listening on http://{where}:{bound[1]} ({protection})")

        def handle_exit(self, sig, frame):  # end the event streams, or uvicorn waits for them forever
            app.app.state.events.close()
            super().handle_exit(sig, frame)

    _Server(config).run()


def _log_config(access_log: bool) -> dict:
    """uvicorn's logging set-up, with the server's own loggers (warnings of ``mcf.bucket.server``, the
    access log of :mod:`mcf.bucket._access_log`) on uvicorn's standard-error handler and format."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["mcf.bucket"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    config["loggers"]["mcf.bucket.access"] = {"level": "INFO" if access_log else "WARNING"}
    return config
