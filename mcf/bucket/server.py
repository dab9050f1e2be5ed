"""The REST server of seed 003 §6.1 under ``/mcrp/v1/`` (Starlette on uvicorn: the ``server`` extra).

Why these choices: the bucket does blocking file I/O, so every operation runs in the thread pool; KV
payloads are streamed from the file in 1 MiB pieces rather than buffered; errors are JSON with the
status a client can act on (400 bad argument, 401 missing token, 404 unknown id, 413 body too large,
422 malformed upload or stored data, 501 no query backend).  ``query`` needs a language model, which
this engine does not contain: it goes through a :class:`QueryBackend` given to :func:`create_app`.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import os
import re
import time
from typing import Any, Protocol

import numpy as np

from mcf._optional import require
from mcf.bucket.store import KV_NAME, Bucket, check_context_id, check_model_id
from mcf.errors import ContextNotFoundError, FormatError, InvalidArgumentError, MCFError

__all__ = ["OPENAPI", "QueryBackend", "create_app", "serve"]

PREFIX = "/mcrp/v1"
DEFAULT_MAX_BODY = 1 << 30
_STREAM_PIECE = 1 << 20


class QueryBackend(Protocol):
    """Answers a query against a cached context (a runtime with the model loaded)."""

    def query(self, bucket: Bucket, context_id: str, query: str, options: dict) -> dict: ...


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
    why = {400: "invalid argument or id", 401: "missing or wrong bearer token", 404: "no such context, model or route",
           409: "the tier cannot be reached here (no torch or no such device)", 413: "body too large",
           422: "malformed upload or corrupt stored data", 500: "I/O failure",
           501: "no query backend configured"}
    return {str(c): _json("Error", why[c]) for c in (401, 500, *codes)}


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
        "model_id": _MODEL_ID,
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
                                "size_bytes": {"type": "integer"}}},
    "PromoteRequest": {"type": "object", "properties": {
        "target_tier": {"type": "string", "enum": ["warm", "hot"], "default": "warm"},
        "device": {"type": "string", "pattern": _DEVICE_PATTERN, "default": "cuda"}}},
    "DemoteRequest": {"type": "object", "properties": {
        "target_tier": {"type": "string", "enum": ["warm", "cold"], "default": "cold"}}},
    "Tier": {"type": "object", "required": ["status", "context_id", "tier"],
             "properties": {"status": {"type": "string", "enum": ["success"]}, "context_id": _CTX_ID, "tier": _TIER}},
    "QueryRequest": {"type": "object", "required": ["query"],
                     "properties": {"query": {"type": "string"}, "options": {"type": "object"}}},
    "Answer": {"type": "object"},
    "Statistics": {"type": "object", "required": ["total_models", "total_contexts", "total_storage_bytes",
                                                  "total_tokens"],
                   "properties": {k: {"type": "integer", "minimum": 0} for k in
                                  ("total_models", "total_contexts", "total_storage_bytes", "total_tokens")}},
    "Registry": {"type": "object", "required": ["status", "mcrp_version", "statistics", "last_updated"],
                 "properties": {"status": {"type": "string", "enum": ["success"]}, "mcrp_version": {"type": "string"},
                                "statistics": _ref("Statistics"), "last_updated": {"type": "string"}}},
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
            "post": {"summary": "Ingest a context: body is an .npz with arrays k and v [layers, heads, tokens, head_dim]",
                     "parameters": [_p("model_id", "query", True, _MODEL_ID), _p("content", "query", False),
                                    _p("token_ids", "query", False,
                                       {"type": "string", "pattern": "^[0-9]{1,18}(,[0-9]{1,18})*$"},
                                       "comma-separated token ids (instead of content; enables prefix reuse)"),
                                    _p("name", "query", False), _p("source", "query", False),
                                    _p("dtype", "query", False,
                                       {"type": "string", "enum": ["float32", "float16", "bfloat16", "int8"]}),
                                    _p("compression", "query", False, {"type": "string", "enum": ["none", "lz4", "zstd"]}),
                                    _p("ttl", "query", False, {"type": "number", "exclusiveMinimum": True,
                                                               "minimum": 0, "maximum": 3.1e9})],
                     "requestBody": {"required": True, "content": {"application/octet-stream": _BINARY}},
                     "responses": {"201": _json("Ingested", "ingested (or found: deduplicated)"),
                                   **_errors(400, 413, 422)}},
        },
        f"{PREFIX}/contexts/{{id}}": {
            "get": {"summary": "Context metadata", "parameters": [_ID],
                    "responses": {"200": _json("Metadata", "metadata"), **_errors(400, 404, 422)}},
            "delete": {"summary": "Delete a context", "parameters": [_ID],
                       "responses": {"204": {"description": "deleted"}, **_errors(400, 404)}},
        },
        f"{PREFIX}/contexts/{{id}}/kv": {
            "get": {"summary": "Stream the context's kv_data.mcb to a runtime", "parameters": [_ID],
                    "responses": {"200": {"description": "kv_data.mcb bytes", "content": {
                        "application/octet-stream": _BINARY}}, **_errors(400, 404, 422)}},
        },
        f"{PREFIX}/contexts/{{id}}/query": {
            "post": {"summary": "Query with a context (needs a query backend)", "parameters": [_ID],
                     "requestBody": _body("QueryRequest", True),
                     "responses": {"200": _json("Answer", "the backend's answer"), **_errors(400, 404, 422, 501)}},
        },
        f"{PREFIX}/contexts/{{id}}/promote": {
            "post": {"summary": "Promote to warm (RAM) or hot (a torch device) in this server's memory",
                     "parameters": [_ID], "requestBody": _body("PromoteRequest"),
                     "responses": {"200": _json("Tier", "tier"), **_errors(400, 404, 409, 422)}},
        },
        f"{PREFIX}/contexts/{{id}}/demote": {
            "post": {"summary": "Demote to warm or cold in this server's memory", "parameters": [_ID],
                     "requestBody": _body("DemoteRequest"),
                     "responses": {"200": _json("Tier", "tier"), **_errors(400, 404)}},
        },
        f"{PREFIX}/models/{{id}}/contexts": {
            "get": {"summary": "Discover a model's contexts",
                    "parameters": [_p("id", schema=_MODEL_ID), _p("force_scan", "query", False, {"type": "boolean"})],
                    "responses": {"200": _json("Discovery", "contexts"), **_errors(400)}},
        },
        f"{PREFIX}/registry": {"get": {"summary": "Registry statistics",
                                       "responses": {"200": _json("Registry", "statistics"), **_errors()}}},
        f"{PREFIX}/registry/rebuild": {"post": {"summary": "Rebuild the registry from disk",
                                                "responses": {"200": _json("Rebuilt", "statistics"), **_errors()}}},
    },
}


def create_app(root: str | os.PathLike, *, token: str | None = None, backend: QueryBackend | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY, bucket: Bucket | None = None):
    require("starlette", feature="the bucket's REST server", extra="server")
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    b = bucket if bucket is not None else Bucket(root)

    def err(status: int, message: str) -> JSONResponse:
        return JSONResponse({"status": "error", "error": message}, status_code=status)

    def endpoint(fn):
        async def handler(request: Request):
            if token is not None and request.url.path != f"{PREFIX}/openapi.json":
                got = request.headers.get("authorization", "")
                if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                    return err(401, "missing or wrong bearer token")
            try:
                return await fn(request)
            except InvalidArgumentError as exc:
                return err(400, str(exc))
            except ContextNotFoundError as exc:
                return err(404, str(exc))
            except FormatError as exc:
                return err(422, str(exc))
            except MCFError as exc:
                return err(500, str(exc))
        return handler

    async def body_json(request: Request) -> dict:
        raw = await request.body()
        if not raw:
            return {}
        import json

        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError(f"request body is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise InvalidArgumentError("request body must be a JSON object")
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

    async def ingest(request: Request):
        q = request.query_params
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_body_bytes):
            return err(413, f"body larger than {max_body_bytes} bytes")
        chunks, total = [], 0
        async for piece in request.stream():
            total += len(piece)
            if total > max_body_bytes:
                return err(413, f"body larger than {max_body_bytes} bytes")
            chunks.append(piece)
        if "model_id" not in q:
            raise InvalidArgumentError("model_id is required")
        kw: dict[str, Any] = {}
        if "token_ids" in q:
            try:
                kw["token_ids"] = [int(t) for t in q["token_ids"].split(",") if t.strip()]
            except ValueError:
                raise InvalidArgumentError("token_ids must be comma-separated integers") from None
        else:
            kw["content"] = q.get("content")
        for k in ("name", "source", "dtype", "compression"):
            if k in q:
                kw[k] = q[k]
        if "ttl" in q:
            try:
                kw["ttl"] = float(q["ttl"])
            except ValueError:
                raise InvalidArgumentError("ttl must be a number") from None
        data = b"".join(chunks)

        def work():
            try:
                with np.load(io.BytesIO(data), allow_pickle=False) as z:
                    if "k" not in z.files or "v" not in z.files:
                        raise FormatError("the .npz body needs arrays 'k' and 'v'", field="body")
                    k, v = z["k"], z["v"]
            except (OSError, ValueError, EOFError) as exc:
                if isinstance(exc, MCFError):
                    raise
                raise FormatError(f"body is not a readable .npz: {exc}", field="body") from None
            if k.ndim != 4 or k.shape != v.shape:
                raise InvalidArgumentError(f"k and v must both be [layers, heads, tokens, head_dim], got {k.shape}, {v.shape}")
            return b.ingest(q["model_id"], [(k[i], v[i]) for i in range(k.shape[0])], **kw)

        meta = await run_in_threadpool(work)
        return JSONResponse({"status": "success", "context_id": meta["context_id"],
                             "deduplicated": meta.get("deduplicated", False),
                             "token_count": meta["content"]["token_count"],
                             "size_bytes": meta["kv_cache"]["size_bytes"]}, status_code=201)

    async def get_context(request: Request):
        return JSONResponse(await run_in_threadpool(b.lookup, request.path_params["id"]))

    async def delete_context(request: Request):
        await run_in_threadpool(b.delete, request.path_params["id"])
        return Response(status_code=204)

    async def stream_kv(request: Request):
        cid = request.path_params["id"]
        meta = await run_in_threadpool(b.lookup, cid)
        f = await run_in_threadpool(b.open, cid)  # validates header, sizes and chunk table first
        f.close()
        path = b.root / "contexts" / cid / KV_NAME
        try:
            fh = open(path, "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise ContextNotFoundError(f"no context {cid!r}") from None

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
        body = await body_json(request)
        cid = request.path_params["id"]
        await run_in_threadpool(b.lookup, cid)
        if backend is None:
            return err(501, "no query backend is configured: this engine stores KV caches but contains no "
                            "language model; pass a QueryBackend to create_app")
        if not isinstance(body.get("query"), str):
            raise InvalidArgumentError("'query' (a string) is required")
        answer = await run_in_threadpool(backend.query, b, cid, body["query"], body.get("options") or {})
        return JSONResponse(answer)

    async def promote(request: Request):
        body = await body_json(request)
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
        body = await body_json(request)
        cid = check_context_id(request.path_params["id"])
        await run_in_threadpool(b.lookup, cid)
        tier = await run_in_threadpool(b.demote, cid, body.get("target_tier", "cold"))
        return JSONResponse({"status": "success", "context_id": cid, "tier": tier})

    async def discover(request: Request):
        raw = request.query_params.get("force_scan", "false").lower()
        if raw not in ("true", "false", "1", "0"):
            raise InvalidArgumentError(f"force_scan must be true or false, got {raw!r}")
        force = raw in ("true", "1")
        t = time.perf_counter()
        out = await run_in_threadpool(lambda: b.discover(request.path_params["id"], force_scan=force))
        return JSONResponse({"status": "success", "model_id": request.path_params["id"], "from_cache": not force,
                             "scan_time_ms": (time.perf_counter() - t) * 1e3, "contexts": out})

    async def registry(request: Request):
        reg = await run_in_threadpool(b.registry)
        return JSONResponse({"status": "success", "mcrp_version": reg["mcrp_version"], "statistics": reg["statistics"],
                             "last_updated": reg["last_updated"]})

    async def rebuild(request: Request):
        reg = await run_in_threadpool(b.rebuild)
        return JSONResponse({"status": "success", "statistics": reg["statistics"], "skipped": reg["skipped"]})

    async def openapi(request: Request):
        return JSONResponse(OPENAPI)

    def by_method(**handlers):
        """One route per path, so a wrong method gets 405 with the full Allow header."""
        async def dispatch(request: Request):
            m = request.method.lower()
            return await handlers["get" if m == "head" else m](request)
        return dispatch, [m.upper() for m in handlers]

    table = {
        "/openapi.json": {"get": openapi},
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

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # contexts whose recorded preference is warm or hot (mcf bucket promote --root) are loaded before
        # the first request is answered
        await run_in_threadpool(b.apply_tier_preferences)
        yield

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)


def serve(root: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8765, token: str | None = None) -> None:
    """Run the server until interrupted (loopback by default)."""
    uvicorn = require("uvicorn", feature="mcf bucket serve", extra="server")
    uvicorn.run(create_app(root, token=token), host=host, port=port, log_level="warning")
