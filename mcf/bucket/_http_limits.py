"""What keeps slow or numerous clients from exhausting ``mcf bucket serve``: a cap on open connections,
a deadline for each request's headers and an idle deadline for its body.

uvicorn offers ``timeout_keep_alive`` (an idle connection *between* requests) and
``limit_concurrency`` (503 to requests past a count, but only once their headers have arrived): a client
that opens a connection and never finishes its headers holds a descriptor forever, and a thousand of
them exhaust the process's descriptors.  So the HTTP protocol is uvicorn's h11 one (which also caps a
request's headers at 16 KiB), subclassed to:

* close a new connection at once, with a 503, when :attr:`Limits.max_connections` are open;
* close a connection whose request headers are not complete ``header_timeout`` seconds after it
  opened (or after the previous response on a kept-alive connection);
* close a connection that sends nothing for ``body_timeout`` seconds while a request body is due.

The subclass uses uvicorn's h11 protocol's own hooks (``cycle``, ``on_response_complete``); the tests
drive it with real half-open sockets, so a uvicorn change that breaks it fails them.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

__all__ = ["DEFAULT_BODY_TIMEOUT", "DEFAULT_HEADER_TIMEOUT", "DEFAULT_MAX_CONNECTIONS", "Limits", "protocol_class"]

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0


@dataclass
class Limits:
    """The limits, and counters the tests (and a curious operator) can read."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    open: set = field(default_factory=set)
    refused: int = 0
    timed_out: int = 0


def _busy_response() -> bytes:
    body = json.dumps({"status": "error", "error": "too many open connections; retry later"}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


def protocol_class(limits: Limits) -> type:
    """uvicorn's h11 protocol with ``limits`` applied (pass it as ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = _busy_response()

    class LimitedH11Protocol(H11Protocol):
        _refused = False
        _timer: asyncio.TimerHandle | None = None

        # -- connections ---------------------------------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(limits.open) >= limits.max_connections:
                self._refused = True
                limits.refused += 1
                transport.write(busy)
                transport.close()
                return
            limits.open.add(self)
            super().connection_made(transport)
            self._arm(limits.header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            limits.open.discard(self)
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(limits.header_timeout)  # the next request's headers are due (or uvicorn's keep-alive ends it)
                self._track()  # a pipelined request may have started already

        # -- deadlines -----------------------------------------------------------------------------
        def _track(self) -> None:
            """Move the deadline along with the request: none while the application works on a
            complete request, the body deadline (renewed by every piece) while its body is due."""
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                return  # still waiting for headers: the header deadline stands
            if cycle.more_body and not cycle.disconnected:
                self._arm(limits.body_timeout)
            else:
                self._disarm()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                limits.timed_out += 1
                self.transport.abort()

    return LimitedH11Protocol
