"""Worker processes for :func:`mcf.conversion.tokenize.tokenize` with ``workers > 1``.

Threads cannot scale this work: fastokens' ``encode_batch_flat`` holds the GIL (two threads encoded no
faster than one), and parsing JSON is Python work too.  So ``workers=N`` runs N processes, each with
its own interpreter and tokenizer:

- the parent chooses the backend once (:func:`mcf.conversion.tok_backends.choose_backend`: the probe
  runs in the parent only) and hands each worker, at its start (the pool's initializer), the tokenizer
  as its JSON (and its tiktoken vocabulary, if it is one) with the backend's *name*: the worker builds
  that backend with :func:`~mcf.conversion.tok_backends.make_backend`, without probing again;
- the parent's read-ahead thread reads and decompresses; the parent cuts blocks of whole lines of about
  :data:`BLOCK_BYTES` (the numbers of their first line with them, for error messages) and sends them to
  the workers, which parse them (:func:`~mcf.conversion.tokenize._parse_block`) and encode them
  (:func:`~mcf.conversion.tokenize.batch_encoder`) and send back numpy arrays (ids in the output
  dtype, sequence lengths, sequences per document);
- the parent writes the results strictly in input order, with at most ``2 N`` blocks in flight, so the
  output is byte-identical for every N and memory stays bounded.

The processes start with ``forkserver`` (``spawn`` where it is missing): never a plain ``fork`` of a
parent that runs threads (the read-ahead thread, the tokenizer libraries' own).  A worker ignores
SIGINT: Ctrl-C reaches the parent, which stops the pool.  A worker's error (a malformed line: the same
:class:`mcf.FormatError`, naming the file and line, as in one process) is raised in the parent when it
reaches that block; a worker that dies is a :class:`mcf.WorkerError`; the pool is shut down whatever
happens, and the caller's Writer then publishes nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from mcf.errors import FormatError, WorkerError, os_error

#: the size of a block of lines sent to a worker (whole lines: a block is longer when a line is)
BLOCK_BYTES = 4 << 20

#: per backend, inputs smaller than this (bytes on disk, all inputs together) are tokenized in the calling
#: process whatever ``workers`` says: starting the workers (about 0.5 s in a fresh process, 0.2 s of CPU
#: each for fastokens to build a 32k BPE) and sending the ids back through pipes cost more than they save.
#: (Not the workers' separate word caches: two fastokens tokenizers encoding a half each of 160 MB of Python
#: source used no more CPU than one encoding all of it.)  HF tokenizers encodes about 3 MB/s a process,
#: fastokens and tiktoken about 150 MB/s.
MIN_BYTES = {"hf": 8 << 20, "fastokens": 128 << 20, "tiktoken": 128 << 20}

_STATE: dict = {}   # in a worker: what _init built


def start_method() -> str:
    """``forkserver`` where the platform has it, else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def workers_for(workers: int, total_bytes: int, backend: str | None = None):
    """``(processes to use, note or None)`` for ``workers`` asked, ``total_bytes`` of input and the
    ``backend``'s name (None: before it is chosen, the smallest threshold): 1 (the calling process, no
    pool) for ``workers=1`` and for inputs below the backend's :data:`MIN_BYTES`, with a note saying why."""
    least = min(MIN_BYTES.values(), default=0)
    floor = least if backend is None else MIN_BYTES.get(backend, max(MIN_BYTES.values(), default=0))
    if workers <= 1 or total_bytes >= floor:
        return workers, None
    return 1, (f"tokenizing in one process, not {workers}: the input ({total_bytes:,} bytes) is smaller than "
               f"{floor / (1 << 20):g} MiB, where starting worker processes for the {backend} backend costs more "
               "time than they save")


#: what the fork server imports once, so that a worker forked from it starts without importing them
PRELOAD = ("mcf.conversion.tokenize", "tokenizers", "fastokens", "msgspec")


def _preload(ctx) -> None:
    """Add :data:`PRELOAD` to the fork server's preloaded modules (it imports them when it starts, if
    it has not started yet; a module that is not installed is skipped), keeping those already set."""
    from multiprocessing import forkserver

    current = list(getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None) or ["__main__"])
    if not set(PRELOAD) <= set(current):
        ctx.set_forkserver_preload(current + [m for m in PRELOAD if m not in current])


def warm_up() -> None:
    """Start the fork server now (it imports :data:`PRELOAD` in a process of its own), so that it is ready
    when the pool starts its workers: the caller loads the tokenizer meanwhile."""
    if start_method() == "forkserver":
        from multiprocessing import forkserver

        _preload(multiprocessing.get_context("forkserver"))
        forkserver.ensure_running()


def _init(setup, args: tuple) -> None:
    """A worker's initializer: ``setup(*args)`` builds the worker's block encoder once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent handles Ctrl-C and stops the pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # one worker, one core
    _STATE["encode"] = setup(*args)


def _ready() -> int:
    """A worker's answer to the parent's first call: it has started (its initializer ran)."""
    return os.getpid()


def _work(block, first: int, path: str, as_json: bool):
    """The worker's block encoder on one block (bytes, or a :class:`FileRange` of ``path``):
    ``(results, worker's pid, CPU seconds it used so far)``."""
    if isinstance(block, FileRange):
        try:
            block = block.read(path)
        except OSError as exc:
            raise os_error(exc, path) from None
    results = _STATE["encode"](block, first, path, as_json)
    return results, os.getpid(), time.process_time()


def grouped(blocks, target: int):
    """``(first line, [bytes, ...], position, offset)``: consecutive blocks of lines ``(first line, bytes,
    position, offset)`` gathered until they hold ``target`` bytes (the last group may hold fewer); the
    group's lines are its blocks joined by newlines."""
    parts: list = []
    size = 0
    first = pos = at = None
    for f, block, p, o in blocks:
        if not parts:
            first, at = f, o
        parts.append(block)
        size += len(block) + 1
        pos = p
        if size >= target:
            yield first, parts, pos, at
            parts, size = [], 0
    if parts:
        yield first, parts, pos, at


class FileRange:
    """A block of lines a worker reads from the input file itself (a local file that is not compressed):
    ``offset`` and ``length`` in the file, instead of the bytes through a pipe."""

    __slots__ = ("offset", "length")

    def __init__(self, offset: int, parts: list):
        self.offset = int(offset)
        self.length = sum(len(p) for p in parts) + len(parts) - 1

    def read(self, path: str) -> bytes:
        """The block's bytes, read from ``path``; the file changed since the parent read it: FormatError."""
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, self.length, self.offset)
            while len(data) < self.length:
                more = os.pread(fd, self.length - len(data), self.offset + len(data))
                if not more:
                    raise FormatError(f"the input changed while it was tokenized: {self.length} bytes expected at "
                                      f"offset {self.offset}, {len(data)} read", path=path, offset=self.offset)
                data += more
            return data
        finally:
            os.close(fd)


class BlockPool:
    """N worker processes encoding blocks of lines, each with the encoder ``setup(*args)`` builds in it
    (``setup`` is pickled by name: a module-level function).  :meth:`submit` returns the results of the blocks
    that are done, in input order, holding at most ``2 N`` blocks in flight; :meth:`drain` the rest.
    While the workers start (a second or so: an interpreter, the imports, the tokenizer), the caller
    encodes blocks itself (:meth:`ready` says when to stop; :meth:`add_local` queues what it made), so
    that starting the pool costs little wall time.  A context manager: leaving it shuts the pool down
    (waiting for the blocks being encoded, dropping those not started)."""

    def __init__(self, workers: int, setup, args: tuple):
        self.workers = int(workers)
        method = start_method()
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            _preload(ctx)
        self._ex = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init, initargs=(setup, args))
        self._pending: deque = deque()
        self._cpu: dict = {}   # worker pid -> CPU seconds it reported last
        self._warming: list = []   # the first call of each worker (appended by the starting thread)
        self._up = False
        # one call per worker starts one process (the pool starts them as calls come), from a thread:
        # starting one waits for the server to fork it, and the caller has blocks to encode meanwhile
        self._starter = threading.Thread(target=self._start, name="mcf-tokenize-pool-start", daemon=True)
        self._starter.start()

    def _start(self) -> None:
        try:
            for _ in range(self.workers):
                self._warming.append(self._ex.submit(_ready))
        except BaseException as exc:   # the pool is broken or shut down: ready() says so
            fut: Future = Future()
            fut.set_exception(BrokenProcessPool(str(exc)))
            self._warming.append(fut)

    def ready(self) -> bool:
        """Whether a worker has started (WorkerError when one could not): from then on the blocks go to
        the pool, and the other workers take their share as they start."""
        if self._up:
            return True
        done = [f for f in list(self._warming) if f.done()]
        if not done:
            return False
        try:
            for f in done:
                f.result()
        except BrokenProcessPool:
            raise WorkerError(f"a tokenizing worker process could not start (workers={self.workers})") from None
        self._up = True
        return True

    def add_local(self, fn, path: str, first: int, tag):
        """Queue the result of ``fn()``, computed here, as the next block's (an exception it raises is
        raised at that block's turn); yield as :meth:`submit` does."""
        fut: Future = Future()
        try:
            fut.set_result(fn())
        except Exception as exc:   # raised in input order, by _next
            fut.set_exception(exc)
        self._pending.append((fut, path, first, tag, False))
        return self._flush()

    def submit(self, block, first: int, path: str, as_json: bool, tag):
        """Send a block; yield ``(results, tag)`` of the oldest blocks while more than ``2 N`` are in flight."""
        try:
            fut = self._ex.submit(_work, block, first, path, as_json)
        except BrokenProcessPool:
            raise self._died(path, first) from None
        self._pending.append((fut, path, first, tag, True))
        return self._flush()

    def _flush(self):
        while len(self._pending) > 2 * self.workers or (self._pending and self._pending[0][0].done()):
            yield self._next()

    def drain(self):
        """``(results, tag)`` of every block still in flight, in input order."""
        while self._pending:
            yield self._next()

    def _next(self):
        fut, path, first, tag, remote = self._pending.popleft()
        try:
            results = fut.result()
        except BrokenProcessPool:
            raise self._died(path, first) from None
        if remote:
            results, pid, cpu = results
            self._cpu[pid] = cpu
        return results, tag

    @property
    def worker_cpu_seconds(self) -> float:
        """The CPU seconds the workers used (their start included) up to the last block they returned."""
        return sum(self._cpu.values())

    def _died(self, path: str, first: int) -> WorkerError:
        return WorkerError(f"{path}: a tokenizing worker process died (killed, or out of memory?) while the lines "
                           f"from line {first} on were being tokenized (workers={self.workers})")

    def close(self, *, wait: bool = True) -> None:
        """Stop the pool: cancel the blocks not started; with ``wait``, wait for the workers to end
        (else they end by themselves once they have read the pool's stop)."""
        for fut, *_ in self._pending:
            fut.cancel()
        self._pending.clear()
        self._starter.join()
        self._ex.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        # after a clean run the workers only have to exit (0.1-0.3 s of interpreter teardown): not waited for
        self.close(wait=exc_type is not None)
