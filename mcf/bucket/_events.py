"""Bucket events over the wire: the server's ``GET /mcrp/v1/events``, a Server-Sent Events stream of
seed 003 §6.2's events (docs/bucket.md §7).

Why it is built this way:

* **One hub per server, fed by** :meth:`Bucket.subscribe`.  Events are emitted by whichever thread ran
  the operation (the server's thread pool); the hub numbers them, keeps the last ``history`` of them and
  wakes each stream on its event loop with ``call_soon_threadsafe``.  Nothing blocks the emitting thread.
* **Resumable.**  Every event has an increasing ``id``; a client that reconnects with ``Last-Event-ID``
  (what a browser's ``EventSource`` sends by itself) or ``?last_event_id=`` gets the events after it
  that are still in the history, so a dropped connection loses nothing recent.  ``last_event_id=0``
  replays the whole history (``model.loaded``, emitted at start-up, among them).
* **Bounded.**  At most ``max_streams`` streams are open (503 past that); each buffers at most
  ``queue_size`` events: a client that does not read is sent ``event: overflow`` with the id to resume
  from, and its stream ends, instead of growing the server's memory.  A comment line every
  ``keepalive`` seconds keeps proxies from closing an idle stream and finds dead clients.
* **Ends with the server.**  :meth:`EventHub.close` (called when the server is asked to stop) ends every
  stream, so a shutdown does not wait for clients that never hang up.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from mcf.errors import InvalidArgumentError, MCFError

__all__ = ["EventHub", "TooManyStreamsError"]

DEFAULT_HISTORY = 1024
DEFAULT_QUEUE = 256
DEFAULT_MAX_STREAMS = 32
DEFAULT_KEEPALIVE = 15.0


class TooManyStreamsError(MCFError):
    """``max_streams`` event streams are open already (the server answers 503)."""


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop, size: int) -> None:
        self.loop, self.size = loop, size
        self.items: collections.deque = collections.deque()
        self.wake = asyncio.Event()
        self.overflowed = False

    def push(self, item: tuple[int, dict]) -> None:  # any thread; the hub's lock is held
        if self.overflowed:
            return
        if len(self.items) >= self.size:
            self.overflowed = True
        else:
            self.items.append(item)
        self.wake_up()

    def wake_up(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.wake.set)
        except RuntimeError:  # its loop is closed: nobody reads this stream any more
            self.overflowed = True


class EventHub:
    """Fans a bucket's events out to event streams (see the module's docstring)."""

    def __init__(self, subscribe: Callable[[Callable[[dict], None]], Callable[[], None]], *,
                 history: int = DEFAULT_HISTORY, queue_size: int = DEFAULT_QUEUE,
                 max_streams: int = DEFAULT_MAX_STREAMS, keepalive: float = DEFAULT_KEEPALIVE,
                 scrub: Callable[[str], str] = lambda s: s) -> None:
        for name, v in (("history", history), ("queue_size", queue_size), ("max_streams", max_streams)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {v!r}")
        self.queue_size, self.max_streams, self.keepalive, self._scrub = queue_size, max_streams, keepalive, scrub
        self._lock = threading.Lock()
        self._history: collections.deque = collections.deque(maxlen=history)
        self._last = 0
        self._streams: set[_Stream] = set()
        self.closed = False
        self._unsubscribe = subscribe(self._on_event)

    @property
    def last_id(self) -> int:
        return self._last

    def _on_event(self, event: dict) -> None:
        with self._lock:
            self._last += 1
            item = (self._last, event)
            self._history.append(item)
            for s in list(self._streams):
                s.push(item)
                if s.overflowed:  # its reader will end it; a stream nobody reads frees its slot here
                    self._streams.discard(s)

    def close(self) -> None:
        """End every stream (the server is stopping) and stop listening to the bucket."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            streams = list(self._streams)
        self._unsubscribe()
        for s in streams:
            s.wake_up()

    def _format(self, eid: int, event: dict) -> bytes:
        data = self._scrub(json.dumps(event, separators=(",", ":"), default=str))
        return f"id: {eid}\nevent: {event.get('event', 'message')}\ndata: {data}\n\n".encode()

    def open(self, last_id: int | None) -> _Stream:
        """A new stream on the running loop, holding the history after ``last_id`` (None: nothing)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if len(self._streams) >= self.max_streams:
                raise TooManyStreamsError(f"{self.max_streams} event streams are open already")
            s = _Stream(loop, self.queue_size + len(self._history))
            if last_id is not None:
                for item in self._history:
                    if item[0] > last_id:
                        s.push(item)
            s.size = self.queue_size
            self._streams.add(s)
        return s

    async def stream(self, s: _Stream) -> AsyncIterator[bytes]:
        """The bytes of one stream until the client leaves, it overflows or the hub closes."""
        try:
            yield f"retry: 2000\n: mcf bucket events, last id {self._last}\n\n".encode()
            while not self.closed:
                try:
                    await asyncio.wait_for(s.wake.wait(), timeout=self.keepalive)
                except asyncio.TimeoutError:
                    yield b": keepalive\n\n"
                    continue
                s.wake.clear()
                while s.items:
                    yield self._format(*s.items.popleft())
                if s.overflowed:
                    with self._lock:
                        resume = self._last
                    gone = json.dumps({"event": "overflow", "reason": f"more than {self.queue_size} events unread",
                                       "resume_after": "the id of the last event received"})
                    yield f"event: overflow\ndata: {gone}\n: last id {resume}\n\n".encode()
                    return
        finally:
            with self._lock:
                self._streams.discard(s)


def parse_last_id(value: Any) -> int | None:
    """``Last-Event-ID`` / ``last_event_id``: a non-negative decimal integer of at most 18 digits."""
    if value is None:
        return None
    if not isinstance(value, str) or not (1 <= len(value) <= 18) or not value.isascii() or not value.isdigit():
        raise InvalidArgumentError(f"last event id must be a non-negative decimal integer, got {str(value)[:24]!r}")
    return int(value)
