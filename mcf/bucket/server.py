"""The REST server of seed 003 §6.1 under ``/mcrp/v1/`` (Starlette on uvicorn: the ``server`` extra).

Why these choices: the bucket does blocking file I/O, so every operation runs in the thread pool; KV
payloads are streamed from the file in 1 MiB pieces rather than buffered; errors are JSON with the
status a client can act on (400 bad argument, 401 missing token, 404 unknown id, 413 body too large,
422 malformed upload or stored data, 501 no query backend).  ``query`` needs a language model, which
this engine does not contain: it goes through a :class:`QueryBackend` given to :func:`create_app`.
"""

from __future__ import annotations

import hmac
import io
import os
from typing import Any, Protocol

import numpy as np

from mcf.bucket.store import KV_NAME, Bucket
from mcf.errors import ContextNotFoundError, FormatError, InvalidArgumentError, MCFError

__all__ = ["OPENAPI", "QueryBackend", "create_app", "serve"]

PREFIX = "/mcrp/v1"
DEFAULT_MAX_BODY = 1 << 30
_STREAM_PIECE = 1 << 20


class QueryBackend(Protocol):
    """Answers a query against a cached context (a runtime with the model loaded)."""

    def query(self, bucket: Bucket, context_id: str, query: str, options: dict) -> dict: ...


def _p(name: str, where: str = "path", required: bool = True, schema: dict | None = None) -> dict:
    return {"name": name, "in": where, "required": required, "schema": schema or {"type": "string"}}


_ID = _p("id")
_JSON = {"content": {"application/json": {"schema": {"type": "object"}}}}
_ERR = {"description": "error", **_JSON}
OPENAPI: dict = {
    "openapi": "3.0.3",
    "info": {"title": "Model Context Bucket", "version": "1.0"},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    "security": [{"bearer": []}],
    "paths": {
        f"{PREFIX}/contexts": {
            "get": {"summary": "List all (unexpired) contexts", "parameters": [_p("model_id", "query", False)],
                    "responses": {"200": {"description": "contexts", **_JSON}}},
            "post": {"summary": "Ingest a context: body is an .npz with arrays k and v [layers, heads, tokens, head_dim]",
                     "parameters": [_p("model_id", "query"), _p("content", "query", False),
                                    _p("token_ids", "query", False), _p("name", "query", False),
                                    _p("source", "query", False), _p("dtype", "query", False),
                                    _p("compression", "query", False),
                                    _p("ttl", "query", False, {"type": "number"})],
                     "requestBody": {"required": True, "content": {"application/octet-stream": {
                         "schema": {"type": "string", "format": "binary"}}}},
                     "responses": {"201": {"description": "ingested", **_JSON}, "400": _ERR, "413": _ERR, "422": _ERR}},
        },
        f"{PREFIX}/contexts/{{id}}": {
            "get": {"summary": "Context metadata", "parameters": [_ID],
                    "responses": {"200": {"description": "metadata", **_JSON}, "404": _ERR}},
            "delete": {"summary": "Delete a context", "parameters": [_ID],
                       "responses": {"204": {"description": "deleted"}, "404": _ERR}},
        },
        f"{PREFIX}/contexts/{{id}}/kv": {
            "get": {"summary": "Stream the context's kv_data.mcb to a runtime", "parameters": [_ID],
                    "responses": {"200": {"description": "kv_data.mcb bytes", "content": {
                        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                        "404": _ERR}},
        },
        f"{PREFIX}/contexts/{{id}}/query": {
            "post": {"summary": "Query with a context (needs a query backend)", "parameters": [_ID],
                     "requestBody": {"required": True, **_JSON},
                     "responses": {"200": {"description": "answer", **_JSON}, "501": _ERR}},
        },
        f"{PREFIX}/contexts/{{id}}/promote": {
            "post": {"summary": "Promote to warm or hot", "parameters": [_ID], "requestBody": {"required": False, **_JSON},
                     "responses": {"200": {"description": "tier", **_JSON}, "400": _ERR, "404": _ERR}},
        },
        f"{PREFIX}/contexts/{{id}}/demote": {
            "post": {"summary": "Demote to warm or cold", "parameters": [_ID], "requestBody": {"required": False, **_JSON},
                     "responses": {"200": {"description": "tier", **_JSON}, "400": _ERR, "404": _ERR}},
        },
        f"{PREFIX}/models/{{id}}/contexts": {
            "get": {"summary": "Discover a model's contexts",
                    "parameters": [_ID, _p("force_scan", "query", False, {"type": "boolean"})],
                    "responses": {"200": {"description": "contexts", **_JSON}, "400": _ERR}},
        },
        f"{PREFIX}/registry": {"get": {"summary": "Registry statistics",
                                       "responses": {"200": {"description": "statistics", **_JSON}}}},
        f"{PREFIX}/registry/rebuild": {"post": {"summary": "Rebuild the registry from disk",
                                                "responses": {"200": {"description": "statistics", **_JSON}}}},
    },
}


def create_app(root: str | os.PathLike, *, token: str | None = None, backend: QueryBackend | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY, bucket: Bucket | None = None):
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
        reg = await run_in_threadpool(b.registry)
        models = [model] if model else [m["model_id"] for m in reg["models"]]
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
        tier = await run_in_threadpool(lambda: b.promote(request.path_params["id"], body.get("target_tier", "warm"),
                                                         device=body.get("device", "cuda")))
        return JSONResponse({"status": "success", "tier": tier})

    async def demote(request: Request):
        body = await body_json(request)
        tier = await run_in_threadpool(b.demote, request.path_params["id"], body.get("target_tier", "cold"))
        return JSONResponse({"status": "success", "tier": tier})

    async def discover(request: Request):
        force = request.query_params.get("force_scan", "false").lower() in ("1", "true", "yes")
        out = await run_in_threadpool(lambda: b.discover(request.path_params["id"], force_scan=force))
        return JSONResponse({"status": "success", "model_id": request.path_params["id"], "from_cache": not force,
                             "contexts": out})

    async def registry(request: Request):
        reg = await run_in_threadpool(b.registry)
        return JSONResponse({"status": "success", "mcrp_version": reg["mcrp_version"], "statistics": reg["statistics"],
                             "last_updated": reg["last_updated"]})

    async def rebuild(request: Request):
        reg = await run_in_threadpool(b.rebuild)
        return JSONResponse({"status": "success", "statistics": reg["statistics"], "skipped": reg["skipped"]})

    async def openapi(request: Request):
        return JSONResponse(OPENAPI)

    routes = [
        Route(f"{PREFIX}/openapi.json", endpoint(openapi), methods=["GET"]),
        Route(f"{PREFIX}/contexts", endpoint(list_contexts), methods=["GET"]),
        Route(f"{PREFIX}/contexts", endpoint(ingest), methods=["POST"]),
        Route(f"{PREFIX}/contexts/{{id}}", endpoint(get_context), methods=["GET"]),
        Route(f"{PREFIX}/contexts/{{id}}", endpoint(delete_context), methods=["DELETE"]),
        Route(f"{PREFIX}/contexts/{{id}}/kv", endpoint(stream_kv), methods=["GET"]),
        Route(f"{PREFIX}/contexts/{{id}}/query", endpoint(query), methods=["POST"]),
        Route(f"{PREFIX}/contexts/{{id}}/promote", endpoint(promote), methods=["POST"]),
        Route(f"{PREFIX}/contexts/{{id}}/demote", endpoint(demote), methods=["POST"]),
        Route(f"{PREFIX}/models/{{id}}/contexts", endpoint(discover), methods=["GET"]),
        Route(f"{PREFIX}/registry", endpoint(registry), methods=["GET"]),
        Route(f"{PREFIX}/registry/rebuild", endpoint(rebuild), methods=["POST"]),
    ]

    async def http_error(request: Request, exc: HTTPException):
        return err(exc.status_code, exc.detail)

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def serve(root: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8765, token: str | None = None) -> None:
    """Run the server until interrupted (loopback by default)."""
    try:
        import uvicorn
    except ImportError:
        raise InvalidArgumentError("the server needs the 'server' extra: pip install mcf[server]") from None
    uvicorn.run(create_app(root, token=token), host=host, port=port, log_level="warning")
