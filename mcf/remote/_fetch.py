"""Parts fetched concurrently, each checked and retried on its own, straight into the caller's buffers.

A pool of ``concurrency`` threads takes the parts in file order; a thread holds one part's response at a
time, so the bytes in flight never exceed ``concurrency * part size`` whatever the plan's size.  A
client releases the GIL while it waits on the network (obstore's Rust core; fsspec's event loop
thread), so the threads overlap their requests; copying an answer into its destination is a memcpy.

Every answer is checked before a byte of it is used: exactly ``end - start`` bytes, or the attempt
failed.  A failed attempt is retried while the transport calls it transient (connection reset or
refused, timeout, 5xx, 408, 429, a body cut short), after an exponential backoff with jitter
(``retry_delay * 2**k``, scaled by a random factor in [0.5, 1], at most ``MAX_DELAY``; longer when
the server sent ``Retry-After``, up to ``MAX_RETRY_AFTER``), at most ``retries`` times.  The first
failure that is final (404, 403, a server that ignores ``Range``, no attempt left) stops the other
threads at their next step and is raised: an :class:`mcf.MCFIOError` naming the URL, the range and
the file size, never a credential.
"""

from __future__ import annotations

import errno
import random
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from mcf.errors import MCFError, MCFIOError

__all__ = ["MAX_DELAY", "MAX_RETRY_AFTER", "Retry", "Fetcher"]

MAX_DELAY = 10.0          # seconds: the longest backoff between two attempts
MAX_RETRY_AFTER = 60.0    # seconds: the longest Retry-After honoured


@dataclass
class Retry:
    """A transport's verdict on a failed attempt: ``why`` (for the final message); ``transient`` says
    whether asking again may help; ``retry_after`` is the server's own wait, when it sent one."""
    why: str
    transient: bool = True
    retry_after: float | None = None


class Fetcher:
    """Runs parts against one transport with one retry policy, and counts what it did (``stats``)."""

    def __init__(self, transport, *, url: str, size: int, retries: int, retry_delay: float, concurrency: int,
                 stats: dict):
        self.transport = transport
        self.url = url              # already redacted
        self.size = size
        self.retries = retries
        self.retry_delay = retry_delay
        self.concurrency = concurrency
        self.stats = stats
        self._count = threading.Lock()
        self._in_flight = 0
        if getattr(transport, "counts_bytes", False):
            # the transport counts each byte as it arrives (a refused or cut answer's too)
            transport.count = lambda n: self._add(bytes_fetched=n)

    # -- bookkeeping -------------------------------------------------------------------------------------
    def _add(self, **kw):
        with self._count:
            for k, v in kw.items():
                self.stats[k] = self.stats.get(k, 0) + v

    def _flight(self, d):
        with self._count:
            self._in_flight += d
            if self._in_flight > self.stats.get("max_in_flight", 0):
                self.stats["max_in_flight"] = self._in_flight

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        d = min(MAX_DELAY, self.retry_delay * (2 ** attempt)) * random.uniform(0.5, 1.0)
        if retry_after is not None:
            d = max(d, min(MAX_RETRY_AFTER, retry_after))
        return d

    def fail(self, start, end, why, attempts) -> MCFIOError:
        return MCFIOError(errno.EIO, f"range read of {end - start} bytes at offset {start} (file size {self.size}) "
                          f"failed after {attempts} attempt{'s' if attempts != 1 else ''}: {why}", self.url)

    def call(self, fn, what: str):
        """``fn()`` (a request that is not a range: the size), retried like a part (it raises, or returns a
        :class:`Retry` verdict); ``what`` names it in the final error."""
        why = "no attempt made"
        for attempt in range(self.retries + 1):
            self._add(requests=1, retries=1 if attempt else 0)
            try:
                res = fn()
            except MCFError:
                raise
            except BaseException as exc:  # noqa: BLE001 - see fetch()
                if _fatal(exc):
                    raise
                verdict = self.transport.classify(exc)
            else:
                if not isinstance(res, Retry):   # a transport may return its verdict on an answer
                    return res
                verdict = res
            if isinstance(verdict, MCFError):
                raise verdict
            why = verdict.why
            if not verdict.transient:
                break
            if attempt < self.retries:
                time.sleep(self.backoff(attempt, verdict.retry_after))
        n = min(attempt + 1, self.retries + 1)
        raise MCFIOError(errno.EIO, f"cannot get {what} after {n} attempt{'s' if n != 1 else ''}: {why}", self.url)

    # -- one part ----------------------------------------------------------------------------------------
    def fetch(self, part, stop: threading.Event | None = None) -> None:
        """Fill every sink of ``part`` or raise; ``stop`` set by another thread ends the retries early."""
        start, end = part.start, part.end
        in_place = part.exact_sink()
        why = "no attempt made"
        for attempt in range(self.retries + 1):
            if stop is not None and stop.is_set():
                return
            self._add(requests=1, retries=1 if attempt else 0)
            self._flight(1)
            try:
                data, landed = self.transport.get(start, end, in_place)
            except MCFError:
                raise
            except BaseException as exc:  # noqa: BLE001 - every client raises its own types (obstore's panics
                if _fatal(exc):           # derive from BaseException); classify() sorts them
                    raise
                verdict = self.transport.classify(exc)
            else:
                if not getattr(self.transport, "counts_bytes", False) and not isinstance(data, (Retry, MCFError)):
                    self._add(bytes_fetched=len(data))   # what arrived, whether it is accepted or not
                verdict = self._check(data, start, end)
                if verdict is None:
                    if not landed:
                        _scatter(data, part)
                    return
            finally:
                self._flight(-1)
            if isinstance(verdict, MCFError):
                raise verdict
            why = verdict.why
            if not verdict.transient:
                raise self.fail(start, end, why, attempt + 1)
            if attempt < self.retries:
                delay = self.backoff(attempt, verdict.retry_after)
                if stop is not None:
                    if stop.wait(delay):
                        return
                elif delay > 0:
                    time.sleep(delay)
        raise self.fail(start, end, why, self.retries + 1)

    def _check(self, data, start, end):
        """None when ``data`` (a transport's answer, or a Retry it returned) is exactly [start, end)."""
        if isinstance(data, (Retry, MCFError)):
            return data
        n, want = len(data), end - start
        if n == want:
            return None
        if n > want or (n == self.size and start > 0):
            return Retry(f"got {n} bytes for a {want}-byte range: the server ignored the Range header (it "
                         "must answer 206 Partial Content)", transient=False)
        return Retry(f"got {n} bytes for a {want}-byte range (short read)")

    # -- many parts --------------------------------------------------------------------------------------
    def fetch_all(self, parts: list) -> None:
        """Every part, ``concurrency`` at a time; the first final error is raised once the others stopped."""
        if not parts:
            return
        conc = min(self.concurrency, getattr(self.transport, "max_concurrency", None) or self.concurrency)
        if len(parts) == 1 or conc <= 1:
            for p in parts:
                self.fetch(p)
            return
        stop = threading.Event()
        ex = ThreadPoolExecutor(max_workers=min(conc, len(parts)), thread_name_prefix="mcf-remote")
        try:
            futures = [ex.submit(self.fetch, p, stop) for p in parts]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
            if failed:
                stop.set()
                raise failed[0].exception()
        finally:
            stop.set()
            ex.shutdown(wait=True, cancel_futures=True)


def _fatal(exc: BaseException) -> bool:
    """Exceptions that are not a failed request: let through."""
    return isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))


def _scatter(data, part) -> None:
    """Copy one answer into the sinks of its part."""
    src = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    base = part.start
    for off, mv in part.sinks:
        mv[:] = src[off - base:off - base + len(mv)]
