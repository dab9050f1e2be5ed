"""The HTTP/1.1 layer of ``mcf bucket serve``: what keeps slow, numerous or malformed clients from
exhausting the server or confusing it about where one request ends and the next begins.

uvicorn offers ``timeout_keep_alive`` (an idle connection *between* requests) and
``limit_concurrency`` (503 to requests past a count, once their headers have arrived): a client that
never finishes its headers, drips its body, or never reads its answers holds a connection forever,
and its h11 parser frames a request that carries both Content-Length and Transfer-Encoding by the
latter and keeps the connection, which is how a request is smuggled past a proxy that framed it by
the former.  So the protocol is uvicorn's h11 one, subclassed:

* **Connections.** At most :attr:`Limits.max_connections` are open.  When a new one arrives at the
  cap, the oldest connection that has not yet shown the bearer token (with no token configured: that
  has not finished a request head) is closed to make room; only when every open connection has, the
  newcomer gets 503 and is closed.  A flood of unauthenticated or half-open connections thus cannot
  lock out a client that holds the token (Redis closes clients under memory pressure the same way,
  worst first, with ``maxmemory-clients``).
* **Unauthenticated requests share a budget** of ``untrusted_rate`` a second (all connections that have
  not shown the token together, a token bucket as nginx's ``limit_req``): past it, each waits its turn
  before the application sees it, so a flood of them (or of guesses at the token) takes a bounded
  share of the server, whatever its number of connections, and requests with the token go first.
* **Deadlines**, each counting only the time the server waits for the client (not while it is busy
  itself and has stopped reading):

  - a request head must be complete ``header_timeout`` seconds after the connection opened or the
    previous answer was sent;
  - a body may pause ``body_timeout`` seconds at most, must arrive at ``body_min_rate`` bytes a second
    on average after its first ``body_timeout`` seconds (Apache mod_reqtimeout's ``MinRate``: the
    deadline moves one second later for every ``body_min_rate`` bytes received), and may take
    ``body_deadline`` seconds in all;
  - an answer: a client that takes no byte of it for ``send_timeout`` seconds is closed (nginx's
    ``send_timeout``), also after the server has decided to close the connection (a close waits for
    the unsent bytes, so without this a client that never reads would hold its slot forever).
* **Framing** (RFC 9112): a request with both Content-Length and Transfer-Encoding (§6.1), a header
  line folded onto the next (§5.2), or a line ending in a bare LF or holding a bare CR (§2.2) is
  answered 400 and the connection closed; a transfer coding other than chunked is 501; lengths that
  disagree, chunk sizes that are not hex or too long, and a space before a header's colon are 400
  (h11's own checks).  A request head larger than ``max_header_bytes`` or with more than
  ``max_headers`` fields is 431.
* **Pipelining**: a connection answers at most ``max_pipelined`` requests in a row that were already
  waiting when the previous answer was done; the last of them says ``Connection: close``.

Refusals at this layer are JSON like the application's errors and are written to the access log
(:mod:`mcf.apps.bucket_server._access_log`).  The subclass uses uvicorn's h11 protocol's own hooks (``cycle``,
``on_response_complete``, ``send_400_response``, ``flow``); the tests drive it with real sockets, so
a uvicorn change that breaks it fails them.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mcf._core.args import integer, real
from mcf.apps.bucket_server._access_log import log_request, request_target
from mcf.errors import InvalidArgumentError

__all__ = ["DEFAULT_BODY_DEADLINE", "DEFAULT_BODY_MIN_RATE", "DEFAULT_BODY_TIMEOUT", "DEFAULT_HEADER_TIMEOUT",
           "DEFAULT_MAX_CONNECTIONS", "DEFAULT_SEND_TIMEOUT", "DEFAULT_UNTRUSTED_RATE", "MAX_HEADER_BYTES",
           "MAX_HEADERS", "MAX_PIPELINED", "Limits", "protocol_class"]

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
#: bytes a second a body must average after its first body_timeout seconds (mod_reqtimeout's default is 500)
DEFAULT_BODY_MIN_RATE = 1024.0
#: a 1 GiB upload needs 1.8 MB/s to fit; raise it for large uploads over slow links
DEFAULT_BODY_DEADLINE = 600.0
#: nginx's send_timeout
DEFAULT_SEND_TIMEOUT = 60.0
#: the request line and header fields together (nginx: 1 KiB, then up to 4 x 8 KiB)
MAX_HEADER_BYTES = 16 * 1024
#: header fields of one request (Apache's LimitRequestFields)
MAX_HEADERS = 100
#: requests answered in a row from what a client pipelined
MAX_PIPELINED = 32
#: requests a second from connections that have not shown the token, all together (and the burst)
DEFAULT_UNTRUSTED_RATE = 50.0
_LONGEST_WAIT = 86400.0

# where h11 ends a request head: a blank line, after CRLF or a bare LF
_BLANK_LINE = re.compile(rb"\n\r?\n")
# the start of a request line, for the access log of a refused head
_REQUEST_LINE = re.compile(rb"([A-Z]{1,16}) ([^ \r\n]{1,2048}) HTTP/(1\.[01])\r?\n")


@dataclass
class Limits:
    """The limits (checked when made), and counters the tests (and a curious operator) can read."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    body_min_rate: float = DEFAULT_BODY_MIN_RATE
    body_deadline: float = DEFAULT_BODY_DEADLINE
    send_timeout: float = DEFAULT_SEND_TIMEOUT
    max_header_bytes: int = MAX_HEADER_BYTES
    max_headers: int = MAX_HEADERS
    max_pipelined: int = MAX_PIPELINED
    untrusted_rate: float = DEFAULT_UNTRUSTED_RATE
    #: the open connections, oldest first (a dict keeps insertion order)
    open: dict = field(default_factory=dict)
    refused: int = 0
    shed: int = 0
    timed_out: int = 0
    rejected: int = 0
    throttled: int = 0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_header_bytes", "max_headers", "max_pipelined"):
            integer(getattr(self, name), name, minimum=1)
        for name in ("header_timeout", "body_timeout", "body_deadline", "send_timeout"):
            v = real(getattr(self, name), name)
            if not 0 < v <= _LONGEST_WAIT:
                raise InvalidArgumentError(f"{name} must be a number of seconds in (0, {_LONGEST_WAIT:.0f}], got {v!r}")
        for name in ("body_min_rate", "untrusted_rate"):
            rate = real(getattr(self, name), name)
            if not 0 < rate < float("inf"):
                raise InvalidArgumentError(f"{name} must be a positive number (a second), got {rate!r}")


class _TokenBucket:
    """``rate`` requests a second with a burst of as many: :meth:`wait` is how long the next one waits
    for its turn (each takes a turn, so waits grow in arrival order)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.at = rate, rate, time.monotonic()

    def wait(self) -> float:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate) - 1
        self.at = now
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


def _response(status: int, message: str) -> bytes:
    """A complete JSON error answer that closes the connection."""
    body = json.dumps({"status": "error", "error": message}).encode()
    extra = b"retry-after: 1\r\n" if status == 503 else b""
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n%scontent-length: %d\r\n\r\n"
            % (status, http.HTTPStatus(status).phrase.encode(), extra, len(body))) + body


def _describe(exc: Exception) -> str:
    """h11's message without its ``bytearray(...)`` wrapping, and short."""
    return re.sub(r"bytearray\((b['\"].*?['\"])\)", r"\1", str(exc))[:300]


#: what uvicorn warns about for every such request, which has its access-log line instead
_PER_REQUEST_WARNINGS = ("Invalid HTTP request received.", "Unsupported upgrade request.",
                         "No supported WebSocket library detected")


def _not_per_request(record: logging.LogRecord) -> bool:
    """uvicorn warns for every refusal of the parser and every ``Upgrade`` request: a client could fill
    the log with them; each has its own access-log line instead, with the status."""
    return not str(record.msg).startswith(_PER_REQUEST_WARNINGS)


#: what uvicorn's protocol logs (uvicorn.error otherwise), less the warnings above
_PROTOCOL_LOG = logging.getLogger("mcf.bucket.http")
_PROTOCOL_LOG.addFilter(_not_per_request)


def protocol_class(limits: Limits, *, authorised: Callable[[list], bool] = lambda headers: True) -> type:
    """uvicorn's h11 protocol with ``limits`` applied (pass it as ``uvicorn.Config(http=...)``).
    ``authorised(headers)`` says whether a request head (h11's list of lowercased name, value pairs)
    carries the bearer token; connections that have sent one are never closed to make room, and their
    requests do not wait for the budget of unauthenticated ones."""
    import h11
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = _response(503, "too many open connections; retry later")
    untrusted = _TokenBucket(limits.untrusted_rate)
    if _PROTOCOL_LOG.level == logging.NOTSET:
        _PROTOCOL_LOG.setLevel(logging.INFO)  # uvicorn formats its trace messages when the level is lower
    send_step = min(1.0, limits.send_timeout / 4)

    class ClientClock(FlowControl):
        """uvicorn's flow control, also keeping the time reading was paused by the server (its
        buffer full, or the application busy): that time is not the client's to account for."""

        def __init__(self, transport) -> None:
            super().__init__(transport)
            self._paused_at = 0.0
            self._paused_for = 0.0

        def pause_reading(self) -> None:
            if not self.read_paused:
                self._paused_at = time.monotonic()
            super().pause_reading()

        def resume_reading(self) -> None:
            if self.read_paused:
                self._paused_for += time.monotonic() - self._paused_at
            super().resume_reading()

        def now(self) -> float:
            """Seconds the server has spent able to read from this client (a monotonic clock)."""
            now = time.monotonic()
            return now - self._paused_for - ((now - self._paused_at) if self.read_paused else 0.0)

    class WatchedTransport:
        """The connection's transport, counting the bytes handed to it: when some are left waiting
        for the client (after a write, or a close), the owner's send deadline starts."""

        def __init__(self, transport, owner) -> None:
            self._transport, self._owner, self.written = transport, owner, 0

        def write(self, data) -> None:
            self.written += len(data)
            self._transport.write(data)
            if self._transport.get_write_buffer_size():
                self._owner.watch_send()

        def close(self) -> None:
            self._transport.close()
            if self._transport.get_write_buffer_size():
                self._owner.watch_send()

        def __getattr__(self, name):
            return getattr(self._transport, name)

    class StrictConnection(h11.Connection):
        """h11's server side, refusing what RFC 9112 lets a server refuse and h11 accepts; the status
        and reason of a refusal are kept in :attr:`refusal` for the answer."""

        def __init__(self, on_request: Callable) -> None:
            super().__init__(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
            self.refusal: tuple[int, str] | None = None
            self.request_line: tuple[str, str, str] | None = None  # of a refused head, for the access log
            self._on_request = on_request
            # the bytes of the head being received (h11's buffer is copied once per request, then the
            # pieces that arrive are added: a head sent a byte at a time costs linear time, not quadratic)
            self._head: bytearray | None = None
            self._searched = 0

        def refuse(self, status: int, message: str):
            self.refusal = (status, message)
            raise h11.RemoteProtocolError(message, error_status_hint=status)

        def receive_data(self, data: bytes) -> None:
            if self._head is not None:
                self._head += data
            super().receive_data(data)

        def next_event(self):
            state = self.their_state
            try:
                if state is h11.IDLE:
                    if self._head is None:
                        self._head, self._searched = bytearray(self.trailing_data[0]), 0
                    self._check_head(self._head)
                event = super().next_event()
                if state is h11.IDLE and event is not h11.NEED_DATA:
                    self._head = None
                if type(event) is h11.Request:
                    self._check_request(event)
                return event
            except h11.RemoteProtocolError as exc:
                if self.refusal is None:
                    status = exc.error_status_hint
                    if status == 431 and state is not h11.IDLE:
                        status = 400  # h11's size limit hit by a chunk line, not by a head
                    self.refusal = (status, _describe(exc))
                raise

        def _check_head(self, data: bytearray) -> None:
            end = _BLANK_LINE.search(data, max(0, self._searched - 2))
            if end is None:
                self._searched = len(data)
                if len(data) > limits.max_header_bytes:
                    self.refuse(431, f"request head larger than {limits.max_header_bytes} bytes")
                return
            head = bytes(data[:end.end()])
            line = _REQUEST_LINE.match(head)
            if line:
                self.request_line = tuple(x.decode("latin-1") for x in line.groups())
            if len(head) > limits.max_header_bytes:
                self.refuse(431, f"request head of {len(head)} bytes, larger than {limits.max_header_bytes} bytes")
            crlf = head.count(b"\r\n")
            if head.count(b"\n") != crlf:
                self.refuse(400, "a line of the request head ends in a bare LF: lines end in CRLF (RFC 9112 §2.2)")
            if head.count(b"\r") != crlf:
                self.refuse(400, "a bare CR in the request head (RFC 9112 §2.2)")
            if b"\n " in head or b"\n\t" in head:
                self.refuse(400, "a header line continues on the next line (obs-fold, refused by RFC 9112 §5.2)")
            if crlf - 2 > limits.max_headers:
                self.refuse(431, f"{crlf - 2} header fields, more than the {limits.max_headers} allowed")

        def _check_request(self, event) -> None:
            names = {name for name, _ in event.headers}
            if b"transfer-encoding" in names and b"content-length" in names:
                self.refuse(400, "a request with both Content-Length and Transfer-Encoding cannot be framed safely "
                                 "(RFC 9112 §6.1): send one of them")
            self._on_request(event)

    class LimitedH11Protocol(H11Protocol):
        _refused = False
        _trusted = False
        _timer: asyncio.TimerHandle | None = None
        _send_timer: asyncio.TimerHandle | None = None
        _pipelined = 0
        _body: list | None = None  # [cycle, started, last piece, bytes received] on the client clock

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.conn = StrictConnection(self._saw_request)
            self.logger = _PROTOCOL_LOG
            app = self.app

            async def in_turn(scope, receive, send) -> None:
                """The application, once a request without the token has had its turn."""
                if not self._trusted:
                    wait = untrusted.wait()
                    if wait > 0:
                        limits.throttled += 1
                        await asyncio.sleep(wait)
                await app(scope, receive, send)

            self.app = in_turn

        # -- connections ---------------------------------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(limits.open) >= limits.max_connections and not self._make_room():
                self._refused = True
                limits.refused += 1
                transport.write(busy)
                transport.close()
                log_request(transport.get_extra_info("peername"), "-", "-", "1.1", 503, len(busy), 0.0)
                return
            limits.open[self] = None
            super().connection_made(WatchedTransport(transport, self))
            self.flow = ClientClock(self.transport)
            self._arm(limits.header_timeout, self._expire)

        def _make_room(self) -> bool:
            """Close the oldest connection that has not shown the token; False when there is none."""
            for other in limits.open:
                if not other._trusted:
                    limits.shed += 1
                    other._close_now()
                    return True
            return False

        def _close_now(self) -> None:
            limits.open.pop(self, None)
            self._disarm()
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            limits.open.pop(self, None)
            self._disarm()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None
            super().connection_lost(exc)

        def _saw_request(self, event) -> None:
            if not self._trusted and authorised(event.headers):
                self._trusted = True

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._body is not None:
                self._body[2] = self.flow.now()
                self._body[3] += len(data)
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:
                self._pipelined = 0  # a request that came on its own
            self._track()

        def on_response_complete(self) -> None:
            before = self.cycle
            super().on_response_complete()  # starts the next request at once when it was already waiting
            if self.transport.is_closing():
                return
            if self.cycle is not before and self.cycle is not None:
                self._pipelined += 1
                if self._pipelined >= limits.max_pipelined:
                    # uvicorn answers "Connection: close" to a request that asked for it, and then closes
                    self.cycle.scope["headers"].append((b"connection", b"close"))
            self._arm(limits.header_timeout, self._expire)  # the next request's head is due
            self._track()

        def send_400_response(self, msg: str) -> None:
            """Every refusal of the parser (uvicorn's name): JSON with the status the refusal calls for."""
            status, reason = self.conn.refusal or (400, msg)
            limits.rejected += 1
            answer = _response(status, reason)
            self.transport.write(answer)
            self.transport.close()
            method, target, version = self.conn.request_line or ("-", "-", "1.1")
            path, _, query = target.partition("?")
            log_request(self.client, method, request_target(path.encode("latin-1"), query.encode("latin-1")),
                        version, status, len(answer), 0.0)

        # -- request deadlines ---------------------------------------------------------------------
        def _track(self) -> None:
            """Move the deadline along with the request: none while the application works on a
            complete request, the body deadlines while its body is due."""
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                self._body = None
                return  # waiting for a head: the header deadline stands
            if cycle.more_body and not cycle.disconnected:
                if self._body is None or self._body[0] is not cycle:
                    now = self.flow.now()
                    self._body = [cycle, now, now, 0]
                self._arm_body()
            else:
                self._body = None
                self._disarm()

        def _body_due(self) -> float:
            _, started, last, received = self._body
            return min(last + limits.body_timeout, started + limits.body_timeout + received / limits.body_min_rate,
                       started + limits.body_deadline)

        def _arm_body(self) -> None:
            self._arm(max(0.0, self._body_due() - self.flow.now()) + 0.01, self._body_expired)

        def _body_expired(self) -> None:
            self._timer = None
            if self._body is None or self.transport.is_closing():
                return
            if self.flow.read_paused:  # the server stopped reading: its time, not the client's
                self._arm(min(1.0, limits.body_timeout), self._body_expired)
            elif self.flow.now() >= self._body_due():
                self._expire()
            else:
                self._arm_body()

        def _arm(self, seconds: float, then: Callable[[], None]) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, then)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                limits.timed_out += 1
                self.transport.abort()

        # -- the send deadline ---------------------------------------------------------------------
        def watch_send(self) -> None:
            """Bytes wait for the client: check every ``send_step`` that it takes some."""
            if self._send_timer is None:
                self._flushed = self.transport.written - self.transport.get_write_buffer_size()
                self._progress = time.monotonic()
                self._send_timer = self.loop.call_later(send_step, self._check_send)

        def _check_send(self) -> None:
            self._send_timer = None
            waiting = self.transport.get_write_buffer_size()
            if not waiting:
                return
            flushed, now = self.transport.written - waiting, time.monotonic()
            if flushed > self._flushed:
                self._flushed, self._progress = flushed, now
            elif now - self._progress >= limits.send_timeout:
                limits.timed_out += 1
                self.transport.abort()
                return
            self._send_timer = self.loop.call_later(send_step, self._check_send)

    return LimitedH11Protocol
