"""The bucket server's OpenAPI document (``GET /mcrp/v1/openapi.json``), as data.

The document is the contract the routes are held to, not a description written beside them: a route
refuses a query parameter its operation does not declare (:func:`query_parameters`) and a JSON body
field its schema does not list (:data:`SCHEMAS`), the ingest's ``token_ids`` and the promote's
``device`` are checked against the patterns published here, and the schemathesis test drives the
server from this document.  It is built once, from the small helpers below (a parameter, a schema
reference, the error answers a route may give), so each fact is written once; the served bytes are
``JSONResponse(OPENAPI).body``, rendered once when the application is made.
"""

from __future__ import annotations

__all__ = ["DEVICE_PATTERN", "MAX_EXISTS_KEYS", "OPENAPI", "PAGE_NAME_PATTERN", "PREFIX", "SCHEMAS",
           "TOKEN_IDS_PATTERN", "query_parameters"]

#: every route of the API is under this path
PREFIX = "/mcrp/v1"
#: a torch device the hot tier may be asked for (promote's ``device``)
DEVICE_PATTERN = "^(cpu|cuda|mps)(:[0-9]{1,3})?$"
#: an ingest's ``token_ids`` query parameter: comma-separated decimal integers of 1-18 digits
TOKEN_IDS_PATTERN = "^[0-9]{1,18}(,[0-9]{1,18})*$"
#: a page's key in a path: its file name in the pages area (mcf.bucket.pages.page_name: the key, with
#: every byte outside [A-Za-z0-9_@=+,.-] and a leading '.' written %XX, that '%' itself sent as %25)
PAGE_NAME_PATTERN = "^([A-Za-z0-9_@=+,-]|%[0-9A-F]{2})([A-Za-z0-9_@=+,.-]|%[0-9A-F]{2}){0,254}$"
_NAMESPACE = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", "example": "lmcache"}
#: keys in one existence check
MAX_EXISTS_KEYS = 4096
_CTX_ID = {"type": "string", "pattern": "^ctx_[0-9a-f]{32}$", "example": "ctx_" + "0" * 32}
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
           503: "too many event streams open, or too many ingests or page transfers running (retry after the "
                "Retry-After seconds)",
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
SCHEMAS = {
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
        "device": {"type": "string", "pattern": DEVICE_PATTERN, "default": "cuda"}}},
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
    "PagesExist": {"type": "object", "required": ["keys"], "additionalProperties": False,
                   "properties": {"keys": {"type": "array", "maxItems": MAX_EXISTS_KEYS,
                                           "items": {"type": "string", "minLength": 1, "maxLength": 512}},
                                  "prefix": {"type": "boolean", "default": True,
                                             "description": "count the keys there from the first, up to the "
                                                            "first gap (else one answer per key)"}}},
    "PagesFound": {"type": "object", "required": ["status"],
                   "properties": {"status": {"type": "string", "enum": ["success"]},
                                  "hits": {"type": "integer", "minimum": 0},
                                  "exists": {"type": "array", "items": {"type": "boolean"}}}},
    "PageKeys": {"type": "object", "required": ["status", "keys"],
                 "properties": {"status": {"type": "string", "enum": ["success"]},
                                "keys": {"type": "array", "items": {"type": "string"}}}},
    "PageWritten": {"type": "object", "required": ["status", "written"],
                    "properties": {"status": {"type": "string", "enum": ["success"]},
                                   "written": {"type": "boolean", "description": "false: a page was there and "
                                                                                 "was kept (without replace)"}}},
    "Rebuilt": {"type": "object", "required": ["status", "statistics", "skipped"],
                "properties": {"status": {"type": "string", "enum": ["success"]}, "statistics": _ref("Statistics"),
                               "skipped": {"type": "array", "items": {"type": "object"}}}},
}
_ID = _p("id", schema=_CTX_ID)
_NS = _p("namespace", schema=_NAMESPACE)
_KEY = _p("key", schema={"type": "string", "pattern": PAGE_NAME_PATTERN},
          description="the page's key as its file name (mcf.bucket.pages.page_name), percent-encoded")
_BINARY = {"schema": {"type": "string", "format": "binary"}}


def _body(schema: str, required: bool = False) -> dict:
    return {"required": required, "content": {"application/json": {"schema": _ref(schema)}}}


OPENAPI: dict = {
    "openapi": "3.0.3",
    "info": {"title": "Model Context Bucket", "version": "1.0",
             "description": "Seed 003's REST API (MCRP v1) over a bucket of pre-computed KV caches."},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": SCHEMAS},
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
                                       {"type": "string", "pattern": TOKEN_IDS_PATTERN},
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
        f"{PREFIX}/pages/{{namespace}}": {
            "get": {"summary": "The keys of a namespace's (unexpired) pages", "parameters": [_NS],
                    "responses": {"200": _json("PageKeys", "keys"), **_errors(400)}},
        },
        f"{PREFIX}/pages/{{namespace}}/exists": {
            "post": {"summary": "Which of these pages are there (a stat each): from the first up to the first gap, "
                                "or one answer per key",
                     "parameters": [_NS], "requestBody": _body("PagesExist", True),
                     "responses": {"200": _json("PagesFound", "hits"), **_errors(*_WRITE)}},
        },
        f"{PREFIX}/pages/{{namespace}}/page/{{key}}": {
            "get": {"summary": "A page, checked (header, key, CRC-32C): its metadata then its payload",
                    "parameters": [_NS, _KEY],
                    "responses": {"200": {"description": "the page's metadata (X-Page-Meta-Length bytes) followed by "
                                                         "its payload",
                                          "headers": {"X-Page-Meta-Length": {"schema": {"type": "integer"}}},
                                          "content": {"application/octet-stream": _BINARY}},
                                  **_errors(404, 503)}},
            "head": {"summary": "Whether the page is there (a stat; its data is checked on GET)",
                     "parameters": [_NS, _KEY],
                     "responses": {"200": {"description": "there"}, **_errors(404)}},
            "put": {"summary": "Store a page: the body is its metadata (meta_len bytes) followed by its payload",
                    "parameters": [_NS, _KEY,
                                   _p("meta_len", "query", False, {"type": "integer", "minimum": 0,
                                                                   "maximum": 65536, "default": 0}),
                                   _p("replace", "query", False, {"type": "boolean"},
                                      "rewrite a page that is there (default: keep it)")],
                    "requestBody": {"required": True, "content": {"application/octet-stream": _BINARY}},
                    "responses": {"201": _json("PageWritten", "stored"), **_errors(*_WRITE, 503, 507)}},
            "delete": {"summary": "Remove a page", "parameters": [_NS, _KEY],
                       "responses": {"204": {"description": "removed"}, **_errors(*_WRITE, 404)}},
        },
        f"{PREFIX}/registry/rebuild": {"post": {"summary": "Rebuild the registry from disk",
                                                "requestBody": _body("RebuildRequest"),
                                                "responses": {"200": _json("Rebuilt", "statistics"),
                                                              **_errors(*_WRITE)}}},
    },
}


def query_parameters(path: str, method: str) -> set[str]:
    """The names of the query parameters the document declares for ``method`` (lowercase) on ``path``
    (relative to :data:`PREFIX`); an operation it does not have declares none."""
    op = OPENAPI["paths"].get(PREFIX + path, {}).get(method, {})
    return {p["name"] for p in op.get("parameters", ()) if p["in"] == "query"}
