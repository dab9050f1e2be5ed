"""A read plan streamed onto a device through a bounded ring of host buffers: what ``mcf.torch.load_file(path,
device="cuda")`` does, and what a loader into tensors that already live on a device calls.

:func:`stream_to_device` carries out the pieces of a read plan (:mod:`mcf.loading.plan`) into one tensor
per piece on the device: tensors it allocates (one allocation each, as ``load_file``'s CPU results), or
tensors the caller already has (``name -> tensor``, filled in place).  Why it works the way it does:

- **Host memory is the ring, whatever the model's size.**  ``ring_buffers`` buffers of ``ring_bytes``
  (default 4 x 64 MiB), pinned where the device supports it (CUDA), are filled one after the other with
  the next bytes of the results, in plan order: the read engine reads the ranges that land in a buffer
  straight into it (:meth:`mcf.io.Source.read_into`, one call per source and buffer), and decoded pieces
  (casts, quantized MCF tensors, block-scaled weights) are decoded into it by their stages' decoders, from
  a staging buffer of at most :data:`mcf.loading.plan.STAGING_BYTES` (64 MiB) that all the buffers being
  filled share.  A tensor larger than a buffer goes through the ring in pieces; a stage whose output is
  larger than a buffer (a ring of small buffers) is decoded once into host memory of its own, within the
  same staging budget, and goes through in pieces too.  Peak host memory: the ring plus 64 MiB.
- **Reads overlap copies.**  A filled buffer's bytes go to their tensors as non-blocking copies on a
  side stream, one copy per tensor part, followed by an event; the buffer is refilled only once that
  event has completed, while the other buffers are read.  Two buffers are filled at once (one with a
  ring of two or fewer), so the storage always has the next reads waiting.
- **The same pipeline runs to the CPU**, where a thread stands in for the copy stream (its events are
  ``threading.Event`` s): the tests drive every part of it (ring reuse, tensors across buffers, tiny rings,
  errors mid-stream) without a GPU.  Devices other than CUDA and the CPU get blocking copies from
  unpinned buffers.
- **All or nothing.**  An error while reading or decoding (a failing source, a NaN block scale) stops
  the stream: the fills under way finish, the copies already issued complete, and the error is raised;
  the tensors allocated here are dropped, so nothing partly filled is ever returned.  Tensors the caller
  passed in may then hold part of their bytes.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mcf._core._io import aligned_empty
from mcf._core.args import integer
from mcf._core.memory import allocating, check_fits, refused
from mcf._core.optional import require
from mcf.errors import ArgumentTypeError, InvalidArgumentError
from mcf.loading import plan as load_plan

_torch = require("torch", feature="mcf.torch", extra="torch")

__all__ = ["stream_to_device", "ring_settings", "torch_device", "RING_BUFFERS", "RING_BYTES"]

#: Buffers of the ring a load onto a device streams through, by default.
RING_BUFFERS = 4
#: Bytes of each of them, by default.
RING_BYTES = 64 << 20
# a decoded stage starts on this boundary of its buffer (the kernels' vector stores)
_ALIGN = 64
# what the decoders write for each decoded element (bfloat16 as its uint16 bits)
_DECODED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def ring_settings(ring_buffers, ring_bytes) -> tuple:
    """``(buffers, bytes)`` of the ring: the defaults for None, else checked integers (at least 1 each)."""
    n = RING_BUFFERS if ring_buffers is None else integer(ring_buffers, "ring_buffers", minimum=1)
    b = RING_BYTES if ring_bytes is None else integer(ring_bytes, "ring_bytes", minimum=1)
    return n, b


def stream_to_device(pieces: list, destinations, *, device, ring_buffers=None, ring_bytes=None, threads=None,
                     chunk_bytes=None) -> dict:
    """Carry out ``pieces`` onto ``device`` through the ring: ``name -> tensor`` in the order of ``pieces``.

    ``destinations``: a mapping ``name -> tensor`` of tensors on ``device`` to fill in place (contiguous,
    each of exactly its piece's bytes; its dtype and shape are the caller's to check), or a callable
    ``alloc(piece) -> tensor`` making a fresh one on ``device`` (how ``mcf.torch`` allocates), or None
    for flat ``uint8`` tensors of each piece's bytes.  Every destination is checked, and every fresh one
    allocated, before any byte is read.  ``device``: a torch device (``"cuda"``, ``"cuda:1"``,
    ``"cpu"``...).  ``ring_buffers``, ``ring_bytes``: the ring (None: 4 x 64 MiB; never more than the load
    needs).  ``threads``, ``chunk_bytes``: the read engine's, for each buffer's reads.
    """
    dev = torch_device(device)
    n_buffers, cap = ring_settings(ring_buffers, ring_bytes)
    if threads is not None:
        integer(threads, "threads", minimum=1)
    if chunk_bytes is not None:
        integer(chunk_bytes, "chunk_bytes", minimum=1)
    results, flats = _destinations(pieces, destinations, dev)
    need = sum(f.numel() for f in flats) + _ALIGN * sum(len(p.stages or ()) for p in pieces)
    cap = max(1, min(cap, need))
    check_fits(n_buffers * cap, pieces[0].source.name if pieces else "mcf", None,
               what=f"a ring of {n_buffers} host buffers of {cap} bytes")
    try:
        _Stream(dev, n_buffers, cap, threads, chunk_bytes).run(_fills(pieces, cap), flats)
    except BaseException:
        # the plan refers to the destinations by index only, so that the error's traceback keeps none of
        # the tensors allocated here alive
        results.clear()
        flats.clear()
        raise
    return results


# -- destinations ------------------------------------------------------------------------------------------
def torch_device(device):
    """``device`` as a torch.device; a CUDA device that torch does not see is refused here, before anything
    is read or allocated (a CUDA device without an index: the current one)."""
    try:
        dev = _torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"device={device!r} is not a torch device: {exc}") from None
    if dev.type == "cuda":
        count = _torch.cuda.device_count() if _torch.cuda.is_available() else 0
        if dev.index is None and count:
            dev = _torch.device("cuda", _torch.cuda.current_device())
        if dev.index is None or dev.index >= count:
            raise InvalidArgumentError(f"device={device!r}: torch {_torch.__version__} sees {count} CUDA "
                                       f"device{'' if count == 1 else 's'}")
    elif dev.type != "cpu":
        try:   # any other backend says here whether it has this device
            _torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as exc:
            why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise InvalidArgumentError(f"device={device!r} cannot be used: {why}") from None
    return dev


def _piece_bytes(p) -> int:
    if p.stages is None:
        return len(p.offsets) * p.size
    return math.prod(p.shape) * np.dtype(_DECODED[p.element.name]).itemsize


def _destinations(pieces, destinations, dev) -> tuple:
    """``(results, flats)``: the tensors returned, and the flat uint8 view of each piece's."""
    if destinations is not None and not isinstance(destinations, Mapping) and not callable(destinations):
        raise ArgumentTypeError("destinations must be a mapping name -> tensor, a callable alloc(piece) or None, "
                                f"got {type(destinations).__name__}")
    results, flats, total = {}, [], 0
    for p in pieces:
        nbytes = _piece_bytes(p)
        what = f"{p.source.name}: tensor {p.name!r}"
        if isinstance(destinations, Mapping):
            if p.name not in destinations:
                raise InvalidArgumentError(f"{what}: no destination tensor for it")
            t = destinations[p.name]
        else:
            total += nbytes
            t = _allocate(p, destinations, dev, nbytes, total)
        results[p.name] = t
        flats.append(_flat_bytes(t, dev, nbytes, what))
    return results, flats


def _allocate(p, alloc, dev, nbytes: int, total: int):
    """A fresh destination for ``p``: host memory is refused beyond the machine's before it is allocated
    (:func:`mcf._core.memory.allocating`, the whole load counted), and an allocator's refusal on any device
    is :class:`mcf.AllocationError`."""
    with allocating(nbytes, p.source.name, p.name, total=total) if dev.type == "cpu" else contextlib.nullcontext():
        try:
            return _torch.empty(nbytes, dtype=_torch.uint8, device=dev) if alloc is None else alloc(p)
        except RuntimeError as exc:   # torch's allocators refuse with a RuntimeError (OutOfMemoryError on a GPU)
            text = str(exc)
            if "allocate" not in text and "out of memory" not in text:
                raise
            raise refused(nbytes, p.source.name, p.name, text.splitlines()[0]) from None


def _flat_bytes(t, dev, nbytes: int, what: str):
    if not isinstance(t, _torch.Tensor):
        raise ArgumentTypeError(f"{what}: the destination must be a torch.Tensor, got {type(t).__name__}")
    if t.device != dev:
        raise InvalidArgumentError(f"{what}: the destination is on {t.device}; expected {dev}")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{what}: the destination is not contiguous; expected a contiguous tensor")
    have = t.numel() * t.element_size()
    if have != nbytes:
        raise InvalidArgumentError(f"{what}: the destination holds {have} bytes ({t.dtype}, {tuple(t.shape)}); "
                                   f"expected {nbytes}")
    return t.detach().reshape(-1).view(_torch.uint8)


# -- the plan cut into buffers ------------------------------------------------------------------------------
class _Fill:
    """What one buffer receives: ``reads`` (source, file offsets, buffer offsets, lengths), ``decodes``
    (source, stage, buffer offset, numpy dtype), a ``spill`` part ((spill, its offset, length), copied to
    the buffer's start) and the ``copies`` to the device (the piece's index, offset in its destination,
    buffer offset, length)."""

    __slots__ = ("reads", "decodes", "spill", "copies", "used")

    def __init__(self):
        self.reads, self.decodes, self.copies = [], [], []
        self.spill = None
        self.used = 0


class _Spill:
    """A stage whose output is larger than a buffer: decoded once into host memory of its own by the first
    fill that needs it, released by the last."""

    def __init__(self, source, stage, dtype):
        self.source, self.stage, self.dtype = source, stage, dtype
        self.array = None


def _ranges(offsets: np.ndarray, size: int, pos: int, take: int, at: int) -> tuple:
    """The reads that fill bytes ``pos .. pos + take`` of a result made of equal ranges of ``size`` bytes at
    ``offsets``, into a buffer from ``at``: (file offsets, buffer offsets, lengths)."""
    k = np.arange(pos // size, (pos + take - 1) // size + 1, dtype=np.int64)
    starts = np.maximum(k * size, pos)
    ends = np.minimum((k + 1) * size, pos + take)
    return offsets[k] + (starts - k * size), at + (starts - pos), ends - starts


def _fills(pieces, cap: int):
    """The buffers' contents, in plan order: each piece's result bytes follow one another through the
    buffers (a decoded stage whole in one buffer, on an aligned offset, unless it is larger than a buffer)."""
    fill = _Fill()
    for index, p in enumerate(pieces):
        if p.stages is None:
            total = _piece_bytes(p)
            offsets = np.asarray(p.offsets, np.int64)
            pos = 0
            while pos < total:
                if fill.used == cap:
                    yield fill
                    fill = _Fill()
                take = min(cap - fill.used, total - pos)
                fill.reads.append((p.source,) + _ranges(offsets, p.size, pos, take, fill.used))
                fill.copies.append((index, pos, fill.used, take))
                fill.used += take
                pos += take
            continue
        dtype = _DECODED[p.element.name]
        itemsize = np.dtype(dtype).itemsize
        for st in p.stages:
            first, count = st.span
            n = count * itemsize
            if n == 0:
                continue
            if n <= cap:
                at = -(-fill.used // _ALIGN) * _ALIGN
                if at + n > cap:
                    yield fill
                    fill, at = _Fill(), 0
                fill.decodes.append((p.source, st, at, dtype))
                fill.copies.append((index, first * itemsize, at, n))
                fill.used = at + n
                continue
            if fill.used:
                yield fill
                fill = _Fill()
            spill = _Spill(p.source, st, dtype)
            for pos in range(0, n, cap):
                take = min(cap, n - pos)
                fill.spill = (spill, pos, take)
                fill.copies.append((index, first * itemsize + pos, 0, take))
                fill.used = take
                yield fill
                fill = _Fill()
    if fill.used:
        yield fill


# -- filling buffers ----------------------------------------------------------------------------------------
class _Budget:
    """The staging bytes the buffers being filled may hold together; a request larger than all of it waits
    until nothing else is held."""

    def __init__(self, cap: int):
        self.cap, self.held = cap, 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.cap)
        with self.cond:
            while self.held + n > self.cap:
                self.cond.wait()
            self.held += n
        return n

    def release(self, n: int) -> None:
        with self.cond:
            self.held -= n
            self.cond.notify_all()


def _run_fill(fill: _Fill, buf: np.ndarray, budget: _Budget, threads, chunk_bytes) -> None:
    by_source = {}
    for src, offs, ats, lens in fill.reads:
        entry = by_source.get(id(src))
        if entry is None:
            entry = by_source[id(src)] = (src, [], [])
        entry[1].append(offs)
        entry[2].extend(buf[a:a + n] for a, n in zip(ats.tolist(), lens.tolist()))
    for src, offs, dests in by_source.values():
        src.read_into(np.concatenate(offs), dests, threads=threads, chunk_bytes=chunk_bytes)
    batch, held = [], 0
    for item in fill.decodes:
        if batch and held + item[1].nbytes > budget.cap:
            _decode(batch, held, buf, budget, threads, chunk_bytes)
            batch, held = [], 0
        batch.append(item)
        held += item[1].nbytes
    if batch:
        _decode(batch, held, buf, budget, threads, chunk_bytes)
    if fill.spill is not None:
        spill, pos, take = fill.spill
        if spill.array is None:
            st = spill.stage
            spill.array = aligned_empty(st.span[1] * np.dtype(spill.dtype).itemsize, _ALIGN)
            load_plan.decode_stages([(spill.source, st, spill.array.view(spill.dtype))], threads=threads,
                                    chunk_bytes=chunk_bytes)
        buf[:take] = spill.array[pos:pos + take]
        if pos + take == spill.array.shape[0]:
            spill.array = None


def _decode(batch, held: int, buf, budget: _Budget, threads, chunk_bytes) -> None:
    items = [(src, st, buf[at:at + st.span[1] * np.dtype(dt).itemsize].view(dt)) for src, st, at, dt in batch]
    got = budget.acquire(held)
    try:
        load_plan.decode_stages(items, threads=threads, chunk_bytes=chunk_bytes)
    finally:
        budget.release(got)


# -- copies to the device -----------------------------------------------------------------------------------
class _StreamCopies:
    """Non-blocking copies on a side stream of a CUDA device, each buffer's followed by an event."""

    def __init__(self, dev):
        self.stream = _torch.cuda.Stream(dev)
        # the destinations were allocated (or last used) on the current stream
        self.stream.wait_stream(_torch.cuda.current_stream(dev))

    def issue(self, pairs):
        with _torch.no_grad(), _torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = _torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, event) -> None:
        event.synchronize()

    def close(self) -> None:
        self.stream.synchronize()


class _ThreadCopies:
    """The CPU's copy stream: one thread copies in the order the copies are issued; a buffer's event is
    set once its copies are done."""

    def __init__(self):
        self.jobs = queue.SimpleQueue()
        self.error = None
        self.thread = threading.Thread(target=self._work, name="mcf-ring-copies", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        with _torch.no_grad():
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                pairs, event = job
                if self.error is None:
                    try:
                        for dst, src in pairs:
                            dst.copy_(src)
                    except BaseException as exc:   # handed to the thread that waits for this buffer
                        self.error = exc
                event.set()

    def issue(self, pairs):
        event = threading.Event()
        self.jobs.put((pairs, event))
        return event

    def wait(self, event) -> None:
        event.wait()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join()
        if self.error is not None:
            raise self.error


class _BlockingCopies:
    """Devices without a stream API here: each copy is done when ``issue`` returns."""

    def issue(self, pairs):
        with _torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)

    def wait(self, event) -> None:
        pass

    def close(self) -> None:
        pass


class _Stream:
    """One load through the ring: buffers filled by a pool of two threads (one with a ring of two or fewer
    buffers), their copies issued in order from the calling thread."""

    def __init__(self, dev, n_buffers: int, cap: int, threads, chunk_bytes):
        self.dev, self.cap, self.threads, self.chunk_bytes = dev, cap, threads, chunk_bytes
        self.buffers = [None] * n_buffers   # (torch tensor, numpy view), made on first use
        self.events = [None] * n_buffers
        self.depth = 1 if n_buffers <= 2 else 2
        self.budget = _Budget(load_plan.STAGING_BYTES)

    def _buffer(self, slot: int):
        if self.buffers[slot] is None:
            if self.dev.type == "cuda":
                t = _torch.empty(self.cap, dtype=_torch.uint8, pin_memory=True)
                self.buffers[slot] = (t, t.numpy())
            else:
                a = aligned_empty(self.cap, 4096)
                self.buffers[slot] = (_torch.from_numpy(a), a)
        return self.buffers[slot]

    def run(self, fills, flats: list) -> None:
        """Fill the buffers with ``fills`` (:func:`_fills`) and copy them into ``flats``, the destinations'
        bytes."""
        copies = (_StreamCopies(self.dev) if self.dev.type == "cuda" else
                  _ThreadCopies() if self.dev.type == "cpu" else _BlockingCopies())
        pending = deque()
        pool = ThreadPoolExecutor(self.depth, thread_name_prefix="mcf-ring-fill")
        try:
            for i, fill in enumerate(fills):
                slot = i % len(self.buffers)
                alone = fill.spill is not None   # a spilled stage's memory is held by one fill at a time
                while pending and (alone or len(pending) >= self.depth):
                    self._issue(pending.popleft(), copies, flats)
                if self.events[slot] is not None:
                    copies.wait(self.events[slot])
                    self.events[slot] = None
                _, buf = self._buffer(slot)
                future = pool.submit(_run_fill, fill, buf, self.budget, self.threads, self.chunk_bytes)
                pending.append((fill, slot, future))
                if alone:
                    self._issue(pending.popleft(), copies, flats)
            while pending:
                self._issue(pending.popleft(), copies, flats)
        except BaseException:
            for _, _, future in pending:   # let the fills under way end before their buffers go
                future.exception()
            pending.clear()
            try:
                copies.close()
            except BaseException:   # the error being raised says what went wrong first
                pass
            raise
        finally:
            pool.shutdown(wait=True)
        copies.close()

    def _issue(self, entry, copies, flats: list) -> None:
        fill, slot, future = entry
        future.result()
        t, _ = self.buffers[slot]
        self.events[slot] = copies.issue([(flats[i][d:d + n], t[b:b + n]) for i, d, b, n in fill.copies])
