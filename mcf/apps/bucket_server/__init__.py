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
slow ones closed, and requests framed strictly (:mod:`mcf.apps.bucket_server._http_limits`); every request is
logged in one line (:mod:`mcf.apps.bucket_server._access_log`).  ``query`` needs a language model, which this
engine does not contain: it goes through a :class:`QueryBackend` given to :func:`create_app`
(:class:`mcf.bucket.hf.TransformersBackend` is one); a backend that also has ``ingest``
(:class:`IngestBackend`) lets the ingest route take the content itself as a JSON body and compute its
KV cache.

The parts: the OpenAPI document, which the routes are checked against (:mod:`mcf.apps.bucket_server._openapi`);
the Host, Origin and token checks and the loopback-or-token rule (:mod:`mcf.apps.bucket_server._exposure`); the
handlers (:mod:`mcf.apps.bucket_server._routes`).  This module wires them (:func:`create_app`) and runs them on
uvicorn (:func:`serve`).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol

from mcf._core.args import integer
from mcf._core.optional import require
from mcf.bucket._events import DEFAULT_KEEPALIVE, DEFAULT_MAX_STREAMS, EventHub
from mcf.apps.bucket_server._exposure import (DEFAULT_ALLOWED_HOSTS, Exposure, bearer_ok, check_bind, check_token,
                                  parse_allowed_hosts)
from mcf.apps.bucket_server._exposure import MIN_TOKEN_BYTES  # noqa: F401 - importable from here, as before the split
from mcf.apps.bucket_server._openapi import OPENAPI
from mcf.apps.bucket_server._openapi import PREFIX  # noqa: F401 - importable from here, as before the split
from mcf.bucket.store import Bucket
from mcf.errors import InvalidArgumentError

__all__ = ["DEFAULT_ALLOWED_HOSTS", "DEFAULT_MAX_BODY", "DEFAULT_MAX_CONCURRENT_INGESTS", "DEFAULT_MAX_INGEST_BYTES",
           "DEFAULT_MAX_CONCURRENT_PAGES", "DEFAULT_MAX_PAGE_BYTES", "DEFAULT_MAX_JSON_BODY", "DEFAULT_MAX_TEXT_BODY",
           "OPENAPI", "IngestBackend", "QueryBackend", "check_bind",
           "check_token", "create_app", "serve"]

#: the ingest upload (an .npz) as sent
DEFAULT_MAX_BODY = 1 << 30
#: the bytes an upload's arrays hold once decoded (read from their headers before any data): a 32-layer,
#: 8-KV-head, 128-dim model's 8,192-token context in float16 is 1 GiB
DEFAULT_MAX_INGEST_BYTES = 1 << 30
#: ingests (uploads or texts for a model backend) running at once; each holds about one array of the
#: context, converted and compressed, while it writes (docs/bucket.md, "Limits and their defaults")
DEFAULT_MAX_CONCURRENT_INGESTS = 4
#: a page of the pages area (its payload; its metadata may add up to 64 KiB): a serving engine's page or
#: chunk, 4 MiB for SGLang's 64 tokens of Llama-8B, 32 MiB for LMCache's 256
DEFAULT_MAX_PAGE_BYTES = 64 << 20
#: page reads and writes in flight at once (each holds its page in memory); more are 503 with Retry-After
DEFAULT_MAX_CONCURRENT_PAGES = 32
#: every other body (promote, demote, query, rebuild) is a small JSON object
DEFAULT_MAX_JSON_BODY = 1 << 20
#: a content sent as text to a model backend (JSON): 16 MiB is millions of tokens, beyond any model's window
DEFAULT_MAX_TEXT_BODY = 16 << 20
_log = logging.getLogger("mcf.apps.bucket_server")


class QueryBackend(Protocol):
    """Answers a query against a cached context (a runtime with the model loaded)."""

    def query(self, bucket: Bucket, context_id: str, query: str, options: dict) -> dict: ...


class IngestBackend(Protocol):
    """Computes the KV cache of a content with the model it serves (``model_id``), and stores it."""

    model_id: str

    def ingest(self, bucket: Bucket, content: str | None = None, *, token_ids: Any = None, **options: Any) -> dict: ...


def create_app(root: str | os.PathLike, *, token: str | None = None, backend: QueryBackend | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY, max_json_bytes: int = DEFAULT_MAX_JSON_BODY,
               allowed_hosts: Any = DEFAULT_ALLOWED_HOSTS, bucket: Bucket | None = None,
               max_event_streams: int = DEFAULT_MAX_STREAMS, events_keepalive: float = DEFAULT_KEEPALIVE,
               max_ingest_bytes: int = DEFAULT_MAX_INGEST_BYTES,
               max_concurrent_ingests: int = DEFAULT_MAX_CONCURRENT_INGESTS,
               max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES, max_concurrent_pages: int = DEFAULT_MAX_CONCURRENT_PAGES):
    """The Starlette application.  ``allowed_hosts``: the Host names answered (``"*"``: any, for a
    server behind a proxy that checks them); ``max_body_bytes`` bounds the ingest upload as sent,
    ``max_ingest_bytes`` the bytes its arrays declare (checked before any is decoded), ``max_json_bytes``
    every other body (a text ingest's: :data:`DEFAULT_MAX_TEXT_BODY`, or ``max_body_bytes`` when
    smaller); past ``max_concurrent_ingests`` ingests at once, one more is 503 with ``Retry-After``.
    ``max_page_bytes`` bounds a page's payload on the pages routes, ``max_concurrent_pages`` the page
    reads and writes in flight (503 with ``Retry-After`` past it).
    ``backend`` answers the query route (:class:`QueryBackend`) and, when it has ``ingest``
    (:class:`IngestBackend`), takes text ingests; without one both answer 501.
    ``max_event_streams`` open ``/events`` streams at most (503 past it), each sent a keep-alive comment
    every ``events_keepalive`` seconds (:mod:`mcf.bucket._events`); the hub is ``app.state.events``.
    The handlers are :class:`mcf.apps.bucket_server._routes.Handlers`'s, behind
    :class:`mcf.apps.bucket_server._exposure.Exposure`."""
    require("starlette", feature="the bucket's REST server", extra="server")
    from mcf.bucket._names import root_scrubber
    from mcf.apps.bucket_server._routes import Handlers

    check_token(token)
    for name, v in (("max_body_bytes", max_body_bytes), ("max_json_bytes", max_json_bytes),
                    ("max_ingest_bytes", max_ingest_bytes), ("max_concurrent_ingests", max_concurrent_ingests),
                    ("max_page_bytes", max_page_bytes), ("max_concurrent_pages", max_concurrent_pages)):
        integer(v, name, minimum=1)
    hosts, any_host = parse_allowed_hosts(allowed_hosts)
    b = bucket if bucket is not None else Bucket(root)
    scrub = root_scrubber(root, b.root)  # every spelling of the bucket's location: never sent to a client
    hub = EventHub(b.subscribe, max_streams=max_event_streams, keepalive=events_keepalive, scrub=scrub)
    if backend is not None and getattr(backend, "model_id", None):
        b.model_loaded(backend.model_id)  # in the history: a stream opened with last_event_id=0 replays it
    handlers = Handlers(b, token=token, backend=backend, scrub=scrub, hub=hub, max_body_bytes=max_body_bytes,
                        max_json_bytes=max_json_bytes, max_text_bytes=min(max_body_bytes, DEFAULT_MAX_TEXT_BODY),
                        max_ingest_bytes=max_ingest_bytes, max_concurrent_ingests=max_concurrent_ingests,
                        max_page_bytes=max_page_bytes, max_concurrent_pages=max_concurrent_pages)
    app = handlers.application()
    app.state.events = hub
    return Exposure(app, hosts, any_host, handlers.err)


class _AccessLog:
    """One access-log line per request answered by the application (:mod:`mcf.apps.bucket_server._access_log`):
    the status and body bytes it sent, and the time from the request to the last byte handed over."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from mcf.apps.bucket_server._access_log import log_request, request_target

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
          max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES, max_concurrent_pages: int = DEFAULT_MAX_CONCURRENT_PAGES,
          max_connections: int | None = None, header_timeout: float | None = None,
          body_timeout: float | None = None, body_min_rate: float | None = None, body_deadline: float | None = None,
          send_timeout: float | None = None, warm_budget_bytes: int | None = None, log_level: str = "warning",
          access_log: bool = True, on_listening: Callable[[str], None] | None = None,
          on_warning: Callable[[str], None] | None = None, backend: QueryBackend | None = None,
          default_ttl: float | None = None, max_event_streams: int = DEFAULT_MAX_STREAMS,
          kv_events: str | None = None, kv_events_replay: str | None = None, kv_events_block_size: int = 16,
          kv_events_expose: bool = False) -> None:
    """Run the server until interrupted: loopback by default, and only loopback without a token
    (:func:`check_bind`).  ``allowed_hosts`` adds Host names to the loopback ones (and the listening
    address); ``max_body_bytes``, ``max_ingest_bytes``, ``max_concurrent_ingests``, ``max_page_bytes`` and
    ``max_concurrent_pages`` are :func:`create_app`'s; ``max_connections``, ``header_timeout``,
    ``body_timeout``, ``body_min_rate``, ``body_deadline`` and ``send_timeout`` are the limits of
    :mod:`mcf.apps.bucket_server._http_limits` (None: its
    default); ``warm_budget_bytes`` the warm tier's budget; ``backend`` answers queries (and, with an
    ``ingest`` method, computes KV caches from text); ``default_ttl`` the seconds until a context
    ingested without ``ttl`` expires (default: never); ``max_event_streams`` the open ``/events``
    streams allowed.  ``kv_events`` (``tcp://HOST:PORT``) publishes the bucket's stored blocks as vLLM's KV
    events, with a replay socket at ``kv_events_replay`` (:class:`mcf.bucket.kv_events.KVEventPublisher`:
    topics ``kv@<host>:<port>@<model>`` name this server's address, blocks of ``kv_events_block_size``
    tokens; a non-loopback events address needs ``kv_events_expose``).  Once listening, ``on_listening``
    (default: the log) is told where and how (``listening on http://127.0.0.1:8765 (token: required)``);
    each request is logged in one line on standard error unless ``access_log`` is False.  Token warnings
    (:func:`check_token`) go to ``on_warning`` (default: :func:`warnings.warn`)."""
    from mcf.apps.bucket_server import _http_limits as limits_mod

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
    publisher = None
    if kv_events is not None:
        from mcf.bucket.kv_events import KVEventPublisher

        int_hashes = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip() not in ("0", "")
        where = f"[{host}]" if ":" in host else host
        publisher = KVEventPublisher(bucket, kv_events, replay_endpoint=kv_events_replay, address=f"{where}:{port}",
                                     block_size=kv_events_block_size, int_hashes=int_hashes,
                                     expose=kv_events_expose)
    elif kv_events_replay is not None:
        raise InvalidArgumentError("a KV events replay socket needs KV events (kv_events=, --kv-events)")
    try:
        app = create_app(root, token=token, max_body_bytes=max_body_bytes, bucket=bucket, backend=backend,
                         max_event_streams=max_event_streams, max_ingest_bytes=max_ingest_bytes,
                         max_concurrent_ingests=max_concurrent_ingests, max_page_bytes=max_page_bytes,
                         max_concurrent_pages=max_concurrent_pages,
                         allowed_hosts="*" if "*" in extra else (*DEFAULT_ALLOWED_HOSTS, *extra))
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise

    def authorised(headers) -> bool:
        return token is None or any(k == b"authorization" and bearer_ok(v, token) for k, v in headers)

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

    try:
        _Server(config).run()
    finally:
        if publisher is not None:
            publisher.close()


def _log_config(access_log: bool) -> dict:
    """uvicorn's logging set-up, with the server's own loggers (warnings of ``mcf.apps.bucket_server``, the
    access log of :mod:`mcf.apps.bucket_server._access_log`) on uvicorn's standard-error handler and format."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["mcf.bucket"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    config["loggers"]["mcf.bucket.access"] = {"level": "INFO" if access_log else "WARNING"}
    return config
