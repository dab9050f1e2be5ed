"""Worker processes for :func:`mcf.conversion.tokenize.tokenize` with ``workers > 1``.

Threads cannot scale this work: fastokens' ``encode_batch_flat`` holds the GIL (two threads encoded no
faster than one), and parsing JSON is Python work too.  So ``workers=N`` runs N processes, each with
its own interpreter and tokenizer:

- the parent chooses the backend once (:func:`mcf.conversion.tok_backends.choose_backend`: the probe
  runs in the parent only) and hands each worker, at its start (the pool's initializer), the tokenizer
  as its JSON (and its tiktoken vocabulary, if it is one) with the backend's *name*: the worker builds
  that backend with :func:`~mcf.conversion.tok_backends.make_backend`, without probing again;
- a local file that is not compressed never passes through the parent: the parent finds where blocks
  of whole lines of about :data:`BLOCK_BYTES` end by reading a little around each end
  (:func:`file_ranges`) and sends ``(offset, length)``; the worker reads the block, parses it
  (:func:`~mcf.conversion.tokenize._parse_block`) and encodes it
  (:func:`~mcf.conversion.tokenize.batch_encoder`), and returns its number of lines (so the parent
  learns the line numbers, for error messages, as it writes).  A compressed or remote input is read and
  decompressed by the parent's read-ahead thread, which sends the blocks' bytes with their first line's
  number;
- a worker writes a block's ids to a file of its own in a temporary directory (:func:`_spill`) and
  returns the small arrays (sequence lengths, sequences per document) through the pipe: reading the ids
  back costs the parent a third of unpickling them, and the parent's CPU is what the workers lack on a
  machine with as many cores as workers;
- the parent writes the results strictly in input order, with at most :data:`IN_FLIGHT` ``N`` blocks in
  flight, so the output is byte-identical for every N and memory (and the spill directory) stays bounded;
- each worker runs its tokenizer on one thread (``TOKENIZERS_PARALLELISM=false``,
  ``FASTOKENS_BPE_THREADS=1`` unless set): the workers are the parallelism.

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
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from mcf._core.fs import write_all
from mcf.conversion._lines import newline_mask, too_long
from mcf.errors import FormatError, MCFError, WorkerError, os_error

#: the size of a block of lines sent to a worker (whole lines: a block is longer when a line is)
BLOCK_BYTES = 4 << 20
#: blocks in flight per worker, so that a worker finds its next block waiting (on 2 cores, 943 MB: 2.47-2.50 s
#: with 4 a worker, 2.62-2.73 s with 2)
IN_FLIGHT = 4

#: per backend, inputs smaller than this (bytes on disk, all inputs together) are tokenized in the calling
#: process whatever ``workers`` says: starting the workers (about 0.3 s of wall time: the processes, then
#: 0.15-0.3 s of CPU each for fastokens to build a 32k BPE) costs more than they save (on 160 MB, 2 fastokens
#: workers ran 0.99x one process on 2 cores; on 960 MB, 1.48x).
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
    os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")
    _STATE["encode"] = setup(*args)


def _ready() -> int:
    """A worker's answer to the parent's first call: it has started (its initializer ran)."""
    return os.getpid()


def _work(block, first, path: str, as_json: bool, spill: str | None = None):
    """The worker's block encoder on one block: ``(results, lines, worker's pid, CPU seconds it used so
    far)``.  ``block`` is bytes (``first``: the number of its first line; ``lines`` None) or a
    :class:`FileRange`, read here, whose first line's number the parent does not know yet (``first``
    None: numbered from 1; the parent runs a block that fails again with the right numbers).  With
    ``spill`` (a path), the ids go to that file, not through the pipe (:func:`_spill`)."""
    if isinstance(block, FileRange):
        try:
            results, lines = block.encode(_STATE["encode"], first or 1, path, as_json)
        except OSError as exc:
            if isinstance(exc, MCFError):
                raise
            raise os_error(exc, path) from None
    else:
        results, lines = _STATE["encode"](block, first, path, as_json), None
    if spill is not None:
        results = _spill(results, spill)
    return results, lines, os.getpid(), time.process_time()


class Spilled:
    """Where a result's ids are: ``count`` ids of ``dtype`` in the block's spill file, after the ids of
    the block's results before it."""

    __slots__ = ("dtype", "count")

    def __init__(self, dtype: str, count: int):
        self.dtype = dtype
        self.count = count


def _spill(results: list, name: str) -> list:
    """Write the ids of a block's results to a new file ``name`` and return the results with a
    :class:`Spilled` in their place: the parent reads them back with one ``read`` each, which costs
    it a third of what unpickling them from the pipe does (the worker saves the pickling)."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            out = []
            for flat, *rest in results:
                write_all(fd, np.ascontiguousarray(flat))
                out.append((Spilled(flat.dtype.str, len(flat)), *rest))
            return out
        finally:
            os.close(fd)
    except OSError as exc:   # TMPDIR full, or gone: the mcf error naming the file
        raise os_error(exc, name) from None


def _unspill(results: list, name: str, path: str) -> list:
    """The results a worker spilled to ``name`` (:func:`_spill`), their ids read back; the file removed."""
    try:
        with open(name, "rb") as f:
            out = []
            for spilled, *rest in results:
                want = spilled.count * np.dtype(spilled.dtype).itemsize
                data = f.read(want)
                if len(data) != want:
                    raise WorkerError(f"{path}: a tokenizing worker's spill file {name} holds {len(data)} bytes "
                                      f"where {want} were expected")
                out.append((np.frombuffer(data, spilled.dtype), *rest))
        os.unlink(name)
        return out
    except OSError as exc:
        if isinstance(exc, MCFError):
            raise
        raise os_error(exc, name) from None


def grouped(blocks, target: int):
    """``(first line, [bytes, ...], position)``: consecutive blocks of lines ``(first line, bytes,
    position)`` gathered until they hold ``target`` bytes (the last group may hold fewer); the group's
    lines are its blocks joined by newlines."""
    parts: list = []
    size = 0
    first = pos = None
    for f, block, p in blocks:
        if not parts:
            first = f
        parts.append(block)
        size += len(block) + 1
        pos = p
        if size >= target:
            yield first, parts, pos
            parts, size = [], 0
    if parts:
        yield first, parts, pos


class FileRange:
    """A block of whole lines of a local file that is not compressed, given by ``offset`` and ``length``
    (the last line's newline left out): the worker reads it from the file itself, so its bytes never
    pass through the parent, which found the block's end without reading the rest (:func:`file_ranges`).
    ``max_line_bytes`` is the longest line the block may hold (the caller's limit)."""

    __slots__ = ("offset", "length", "max_line_bytes")

    def __init__(self, offset: int, length: int, max_line_bytes: int):
        self.offset = int(offset)
        self.length = int(length)
        self.max_line_bytes = int(max_line_bytes)

    def read(self, path: str) -> bytes:
        """The block's bytes, read from ``path``; the file changed since the parent read it: FormatError."""
        fd = os.open(path, os.O_RDONLY)
        try:
            return _pread_exactly(fd, self.length, self.offset, path)
        finally:
            os.close(fd)

    def encode(self, encode, first: int, path: str, as_json: bool):
        """``(results of encode(block, first, path, as_json), number of lines)``; a line longer than
        ``max_line_bytes`` is the FormatError the one-process reader raises for it."""
        data = self.read(path)
        nl = newline_mask(data)
        if len(data) > self.max_line_bytes:   # only then can a line be too long
            ends = np.concatenate((np.flatnonzero(nl), [len(data)]))
            over = np.flatnonzero(np.diff(ends, prepend=-1) - 1 > self.max_line_bytes)
            if over.size:
                raise too_long(path, self.max_line_bytes, first + int(over[0]))
        return encode(data, first, path, as_json), int(np.count_nonzero(nl)) + 1


class LongLine:
    """Where :func:`file_ranges` found a line longer than ``max_line_bytes``: the line that starts at
    ``offset`` (its number is known only once the blocks before it are counted)."""

    __slots__ = ("offset",)

    def __init__(self, offset: int):
        self.offset = int(offset)


#: how much :func:`file_ranges` reads at a time looking for the end of a block's last line
SCAN_BYTES = 64 << 10


def _pread_exactly(fd: int, n: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, n, offset)
    while len(data) < n:
        more = os.pread(fd, n - len(data), offset + len(data))
        if not more:
            raise FormatError(f"the input changed while it was tokenized: {n} bytes expected at "
                              f"offset {offset}, {len(data)} read", path=path, offset=offset)
        data += more
    return data


def file_ranges(fd: int, size: int, target: int, max_line_bytes: int, path: str):
    """The :class:`FileRange` blocks of whole lines, of about ``target`` bytes each, of the first ``size``
    bytes of the file open as ``fd``, found by reading only around each block's end: a block ends at the
    first newline ``target`` bytes or more after its start.  Where no newline comes within
    ``max_line_bytes`` of that point, a block of the lines before it, then a :class:`LongLine`, and no
    more: the caller raises the error once the blocks before it are done (an earlier bad line is
    reported first, as in one process)."""
    pos = 0
    while pos < size:
        end = pos + target
        if end >= size:
            last = size - 1 if _pread_exactly(fd, 1, size - 1, path) == b"\n" else size
            yield FileRange(pos, last - pos, max_line_bytes)
            return
        at = end - 1
        nl = -1
        while at < size and at - (end - 1) <= max_line_bytes:
            window = _pread_exactly(fd, min(SCAN_BYTES, size - at), at, path)
            k = window.find(b"\n")
            if k >= 0:
                nl = at + k
                break
            at += len(window)
        if nl < 0 and at >= size:   # no newline to the end: the last line ends the file
            yield FileRange(pos, size - pos, max_line_bytes)
            return
        if nl < 0 or nl - (end - 1) > max_line_bytes:   # the line over the block's end is too long
            head = _pread_exactly(fd, end - pos, pos, path)
            cut = head.rfind(b"\n")
            if cut >= 0:
                yield FileRange(pos, cut, max_line_bytes)
            yield LongLine(pos + cut + 1)
            return
        yield FileRange(pos, nl - pos, max_line_bytes)
        pos = nl + 1


class BlockPool:
    """N worker processes encoding blocks of lines, each with the encoder ``setup(*args)`` builds in it
    (``setup`` is pickled by name: a module-level function).  :meth:`submit` returns the results of the blocks
    that are done, in input order, holding at most :data:`IN_FLIGHT` ``N`` blocks in flight; :meth:`drain` the
    rest.
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
        # the workers' ids come back through files here (see _spill), at most the blocks in flight at once
        self._spill_dir = tempfile.mkdtemp(prefix="mcf-tokenize-")
        try:
            self._ex = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init, initargs=(setup, args))
        except BaseException:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            raise
        self._spilled = 0
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

    def add_local(self, fn, path: str, tag, redo=None):
        """Queue the result of ``fn()``, computed here, as the next block's (an exception it raises is
        raised at that block's turn, through ``redo`` as :meth:`submit` says); yield as :meth:`submit` does."""
        fut: Future = Future()
        try:
            fut.set_result(fn())
        except Exception as exc:   # raised in input order, by _next
            fut.set_exception(exc)
        self._pending.append((fut, path, None, tag, False, redo))
        return self._flush()

    def add_error(self, raise_it, path: str, tag):
        """Queue ``raise_it()`` as the next block: called at that block's turn (after the blocks before it
        are written), it raises the error it names (an error whose line number is known only then)."""
        fut: Future = Future()
        fut.set_exception(FormatError("an error to be named at its turn", path=path))
        self._pending.append((fut, path, None, tag, False, raise_it))
        return self._flush()

    def submit(self, block, first, path: str, as_json: bool, tag, redo=None):
        """Send a block; yield ``((results, lines), tag)`` of the oldest blocks while more than ``IN_FLIGHT N`` are in
        flight (``lines``: the block's number of lines for a :class:`FileRange`, else None).  A block that
        fails with an mcf error calls ``redo()`` at its turn, if given: it encodes the block again here, its
        lines numbered from the right one, and raises that error (the worker's, if it returns)."""
        where = f"the lines from line {first} on" if first is not None else f"the lines from byte {block.offset} on"
        self._spilled += 1
        spill = os.path.join(self._spill_dir, f"{self._spilled}.ids")
        try:
            fut = self._ex.submit(_work, block, first, path, as_json, spill)
        except BrokenProcessPool:
            raise self._died(path, where) from None
        self._pending.append((fut, path, where, tag, spill, redo))
        return self._flush()

    def _flush(self):
        while len(self._pending) > IN_FLIGHT * self.workers or (self._pending and self._pending[0][0].done()):
            yield self._next()

    def drain(self):
        """``((results, lines), tag)`` of every block still in flight, in input order."""
        while self._pending:
            yield self._next()

    def _next(self):
        fut, path, where, tag, spill, redo = self._pending.popleft()
        try:
            results = fut.result()
        except BrokenProcessPool:
            raise self._died(path, where) from None
        except MCFError:
            if redo is None:
                raise
            redo()
            raise
        if spill:   # a worker's block (a local one's entry holds False)
            results, lines, pid, cpu = results
            self._cpu[pid] = cpu
            results = (_unspill(results, spill, path), lines)
        return results, tag

    @property
    def worker_cpu_seconds(self) -> float:
        """The CPU seconds the workers used (their start included) up to the last block they returned."""
        return sum(self._cpu.values())

    def _died(self, path: str, where: str) -> WorkerError:
        return WorkerError(f"{path}: a tokenizing worker process died (killed, or out of memory?) while {where} "
                           f"were being tokenized (workers={self.workers})")

    def close(self, *, wait: bool = True) -> None:
        """Stop the pool: cancel the blocks not started; with ``wait``, wait for the workers to end
        (else they end by themselves once they have read the pool's stop)."""
        for fut, *_ in self._pending:
            fut.cancel()
        self._pending.clear()
        self._starter.join()
        try:
            self._ex.shutdown(wait=wait, cancel_futures=True)
        finally:   # a worker still running writes its file into no directory: it fails, unread
            shutil.rmtree(self._spill_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        # after a clean run the workers only have to exit (0.1-0.3 s of interpreter teardown): not waited for
        self.close(wait=exc_type is not None)
