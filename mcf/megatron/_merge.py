"""Merging Megatron datasets in one pass: the output's layout from the inputs' headers, then each input
opened once, its arrays written straight to their final offsets and its ``.bin`` appended by large copies.

The result is byte for byte what Megatron-LM's ``IndexedDatasetBuilder`` writes when ``add_index`` is
called for every input in order and then ``finalize`` (its ``tools/merge_datasets.py``): the lengths,
modes and document boundaries concatenated (each input's boundaries shifted by the sequences before it),
the pointers recomputed as the prefix sums over the whole ``.bin``.

How, and why so:

1. **Headers first.**  Every input's ``.idx`` header (34 bytes) gives its sequence and document counts,
   so the output's counts, its exact ``.idx`` size and the offset of every input's part in each of its
   four arrays are known before anything is written.  No array is kept in memory or spilled to a
   temporary file to be read back at the end (what a builder that learns the counts as it goes must do).
2. **One input at a time.**  Each input is then opened (and validated, as :func:`mcf.megatron.open`
   validates), its arrays are written at their offsets in the output ``.idx`` (the lengths and the modes
   as they are, the pointers and the document boundaries shifted by numpy in chunks of 1M items), its
   ``.bin`` is copied to its offset with ``copy_file_range`` (the kernel copies, nothing passes through
   Python; 8 MiB reads where the file system cannot) by one of two copier threads, on a duplicate of its
   descriptor, while the next input is opened and validated; then it is closed.  At most two descriptors
   of the input being opened and ``COPIES_IN_FLIGHT`` (8) of the inputs being copied are open at any
   moment, however many inputs there are: a thousand shards need no raised descriptor limit.  Memory
   stays at a few chunks whatever the counts.
3. **Atomic publish.**  Both files are written under temporary names beside the output and renamed into
   place at the end, the ``.bin`` first (:func:`mcf.megatron._publish.publish_pair`, with the intent
   file that lets a crash between the renames be finished).  An error leaves the output untouched.

An input that changed between the header pass and its turn (other counts than its header said) is a
:class:`mcf.FormatError` naming it; nothing is published.

Writing to an object store (``s3://``, ``gs://``, ``az://``) goes through :mod:`mcf.megatron._object_out`:
the ``.bin`` streams into a multipart upload as the inputs are read, the ``.idx`` is built in an unnamed
local temporary file and uploaded after the ``.bin`` is complete.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from dataclasses import dataclass

import numpy as np

from mcf._core.fs import create_temp, fsync_dir, fsync_file, make_parent_dir
from mcf.errors import FormatError, InvalidArgumentError, TruncatedError, os_error
from mcf.io import open_source
from mcf.megatron._layout import HEADER, MAGIC, VERSION, dtype_code, layout_for

__all__ = ["merge", "MergeResult"]

CHUNK = 1 << 20             # items per chunk of the shifted arrays
COPY_BYTES = 8 << 20        # bytes per read where copy_file_range cannot copy
REMOTE_COPY_BYTES = 64 << 20  # bytes per read of an input at a URL (eight 8 MiB requests in flight)
COPY_THREADS = 2            # copier threads: the kernel copies one input while the next one is opened
COPIES_IN_FLIGHT = 8        # inputs queued or being copied (each holds one duplicated descriptor)
PREFETCH_BYTES = 256 << 20 # .bin bytes the kernel is asked to read ahead of the input being merged
SCAN_THREADS = 8            # inputs whose header is read at once (each holds one descriptor meanwhile)
_INT64_MAX = 2**63 - 1
_MAX_WRITE = 1 << 30        # bytes per pwrite(2) (Linux writes at most 2 GiB - 4 KiB at once)


@dataclass(frozen=True)
class MergeResult:
    """What :func:`merge` wrote (the names of :class:`mcf.megatron.Writer`'s counts)."""

    prefix: str
    idx_path: str
    bin_path: str
    dtype: np.dtype
    multimodal: bool
    inputs: int
    sequence_count: int
    document_count: int
    token_count: int


@dataclass(frozen=True)
class _Input:
    prefix: str
    variant: str
    sequences: int
    documents: int          # documents, not len(document_indices)
    multimodal: bool
    dtype: np.dtype
    bin_bytes: int | None   # the .bin's size on a local disk (for sizing an upload's parts), else None


def _prefixes(inputs) -> list:
    from mcf.megatron.reader import split_prefix

    out = []
    for obj in inputs:
        if not isinstance(obj, (str, bytes, os.PathLike)):
            raise InvalidArgumentError(f"merge takes dataset prefixes (str, bytes or os.PathLike), not "
                                       f"{type(obj).__name__}")
        out.append(split_prefix(obj))
    return out


def _scan_one(p: str) -> _Input:
    from mcf.megatron.reader import parse_header
    from mcf.remote import is_url

    src = open_source(p + ".idx", mmap=False)
    try:
        h = parse_header(src)
        if src.mode == "pread" and hasattr(os, "posix_fadvise"):
            # the whole index is read again when the input is merged: have the kernel fetch it now, in the
            # background, instead of one small synchronous read per input later (a hint; errors ignored)
            try:
                os.posix_fadvise(src.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
    finally:
        src.close()
    docs = h.document_count - 1 if h.variant == "megatron" else h.sequence_count
    size = None
    if not is_url(p):
        try:
            size = os.stat(p + ".bin").st_size
        except OSError:
            pass    # opening the input says what is wrong with it
    return _Input(p, h.variant, h.sequence_count, docs, h.multimodal, h.dtype, size)


def _scan(prefixes) -> list:
    """Each input's counts from its ``.idx`` header (one small read each), read by :data:`SCAN_THREADS`
    threads: a thousand cold inputs cost a thousand disk (or network) round trips, which overlap there."""
    if len(prefixes) < 2:
        return [_scan_one(p) for p in prefixes]
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    # each read in a copy of the caller's context: mcf.remote.storage_options(...) set around the call holds
    with ThreadPoolExecutor(min(SCAN_THREADS, len(prefixes)), thread_name_prefix="mcf-merge-scan") as ex:
        return list(ex.map(lambda p, ctx: ctx.run(_scan_one, p), prefixes,
                           [contextvars.copy_context() for _ in prefixes]))


def _plan(infos) -> tuple:
    """(dtype, multimodal) of the output: the first input's dtype (every input must have it); multimodal
    when the first input that holds sequences is (an empty input's index cannot say)."""
    dtype = infos[0].dtype
    dtype_code(dtype)           # an input dtype the Megatron format has no code for is refused here
    full = [i for i in infos if i.sequences]
    multimodal = full[0].multimodal if full else False
    for i in infos:
        if i.dtype != dtype:
            raise InvalidArgumentError(f"{i.prefix}: dtype {i.dtype} differs from the first input's {dtype} "
                                       f"({infos[0].prefix})")
        if multimodal and i.sequences and not i.multimodal:
            raise InvalidArgumentError(f"{i.prefix}: not multimodal, but {full[0].prefix} is (every input of a "
                                       "multimodal merge must carry sequence modes)")
    return dtype, multimodal


class _Prefetch:
    """Asks the kernel to read the local inputs' ``.bin`` files up to :data:`PREFETCH_BYTES` ahead of the one
    being merged (``POSIX_FADV_WILLNEED``; a descriptor is held only for the call): a thousand small files
    read one after another each start with a short readahead window, and the disk idles between them."""

    def __init__(self, infos):
        self.infos = infos
        self.next = 0       # the first input not prefetched yet
        self.bytes = 0      # bytes prefetched ahead of the input being merged

    def upto(self, k: int) -> None:
        if not hasattr(os, "posix_fadvise"):
            return
        if k > 0 and self.infos[k - 1].bin_bytes is not None:
            self.bytes -= self.infos[k - 1].bin_bytes
        while self.next < len(self.infos) and (self.next <= k or self.bytes < PREFETCH_BYTES):
            info = self.infos[self.next]
            self.next += 1
            if info.bin_bytes is None:
                continue    # an input at a URL
            if self.next - 1 >= k:
                self.bytes += info.bin_bytes
            try:
                fd = os.open(info.prefix + ".bin", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                continue    # opening the input for the merge says what is wrong with it
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def _pwrite_all(fd: int, data, offset: int, name: str) -> None:
    mv = memoryview(data).cast("B")
    try:
        while len(mv):
            k = os.pwrite(fd, mv[:_MAX_WRITE], offset)
            mv = mv[k:]
            offset += k
    except OSError as exc:
        raise os_error(exc, name) from None


class LocalOutput:
    """The output pair as two temporary files beside the prefix, renamed into place by :meth:`publish`."""

    def __init__(self, prefix: str, *, durable: bool):
        from mcf.megatron._publish import finish_interrupted

        make_parent_dir(prefix, what="writing a dataset")
        self.prefix = prefix
        self.idx_path = prefix + ".idx"
        self.bin_path = prefix + ".bin"
        self.durable = durable
        finish_interrupted(prefix)  # a predecessor killed between its renames: complete it first
        self._dir = os.path.dirname(os.path.abspath(prefix))
        self.bin_fd = self.idx_fd = -1
        self.bin_tmp = self.idx_tmp = None
        self._copies: deque = deque()
        self._executor = None
        try:
            self.bin_fd, self.bin_tmp = create_temp(self._dir, os.path.basename(self.bin_path))
            self.idx_fd, self.idx_tmp = create_temp(self._dir, os.path.basename(self.idx_path))
        except OSError as exc:
            self.abort()
            raise os_error(exc, prefix) from None
        except BaseException:
            self.abort()
            raise

    def write_idx(self, offset: int, data) -> None:
        _pwrite_all(self.idx_fd, data, offset, self.idx_tmp)

    def copy_bin(self, src, nbytes: int, offset: int) -> None:
        """Put ``nbytes`` from the start of the Source ``src`` at ``offset`` of the ``.bin``.  A local file is
        copied by the kernel in a copier thread, on a duplicate of its descriptor (the caller may close the
        source at once), while the caller goes on with the next input; other sources are copied here."""
        if src.mode in ("mmap", "pread") and hasattr(os, "copy_file_range"):
            self._wait(COPIES_IN_FLIGHT - 1)
            fd = os.dup(src.fileno())
            try:
                if nbytes and hasattr(os, "posix_fadvise"):
                    # start reading this input now, while earlier copies run: the kernel's readahead of
                    # one small file at a time stays short of the disk's speed (a hint; errors ignored)
                    try:
                        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_WILLNEED)
                    except OSError:
                        pass
                self._copies.append(self._pool().submit(self._copy_fd, fd, src.name, nbytes, offset))
            except BaseException:
                os.close(fd)
                raise
            return
        done = 0
        while done < nbytes:
            k = min(REMOTE_COPY_BYTES, nbytes - done)
            _pwrite_all(self.bin_fd, src.view(done, k), offset + done, self.bin_tmp)
            done += k

    def _pool(self):
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="mcf-merge-copy")
        return self._executor

    def _copy_fd(self, fd: int, name: str, nbytes: int, offset: int) -> None:
        """Copy ``nbytes`` from the start of ``fd`` (closed at the end) to ``offset`` of the ``.bin``."""
        done = 0
        try:
            try:
                while done < nbytes:
                    k = os.copy_file_range(fd, self.bin_fd, nbytes - done, done, offset + done)
                    if k == 0:
                        break
                    done += k
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ETXTBSY):
                    raise os_error(exc, self.bin_path if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                                   else name) from None
            while done < nbytes:   # a file system that cannot copy in the kernel; or a file cut short
                try:
                    data = os.pread(fd, min(COPY_BYTES, nbytes - done), done)
                except OSError as exc:
                    raise os_error(exc, name) from None
                if not data:
                    raise TruncatedError(f"the .bin became shorter while it was merged: {done} of {nbytes} bytes",
                                         path=name, field="size", expected=f"{nbytes} bytes", got=f"{done} bytes")
                _pwrite_all(self.bin_fd, data, offset + done, self.bin_tmp)
                done += len(data)
        finally:
            os.close(fd)

    def _wait(self, keep: int) -> None:
        """Wait until at most ``keep`` copies are in flight; raise the first copy's error."""
        while len(self._copies) > keep:
            self._copies.popleft().result()

    def _stop_copies(self) -> None:
        for f in self._copies:
            f.cancel()
        for f in self._copies:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - the output is being discarded; the first error is raised already
                pass
        self._copies.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def publish(self, bin_size: int) -> None:
        from mcf.megatron._publish import publish_pair

        self._wait(0)
        self._stop_copies()
        try:
            if self.durable:
                fsync_file(self.bin_fd)
                fsync_file(self.idx_fd)
            for name in ("bin_fd", "idx_fd"):
                fd, _ = getattr(self, name), setattr(self, name, -1)
                os.close(fd)
            publish_pair(self.prefix, self.bin_tmp, self.idx_tmp, bin_size, self.durable)
            self.bin_tmp = self.idx_tmp = None
            if self.durable:
                fsync_dir(self._dir)
        except OSError as exc:
            raise os_error(exc, self.prefix) from None

    def abort(self) -> None:
        self._stop_copies()
        for name in ("bin_fd", "idx_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)
        for name in ("bin_tmp", "idx_tmp"):
            p = getattr(self, name)
            setattr(self, name, None)
            if p is not None:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass


def _changed(ds, info: _Input, field: str, got) -> FormatError:
    return FormatError("the input changed while it was merged (its header said otherwise a moment ago)",
                       path=ds.idx_path, field=field, expected=getattr(info, field), got=got)


def _append(out, info: _Input, ds, lay, seq0: int, doc0: int, bin0: int, multimodal: bool, buf) -> int:
    """Write input ``ds`` into ``out`` at sequence ``seq0``, document ``doc0``, byte ``bin0``; returns the
    bytes of its ``.bin``."""
    h = ds.header
    if h.sequence_count != info.sequences:
        raise _changed(ds, info, "sequences", h.sequence_count)
    if ds.num_documents != info.documents:
        raise _changed(ds, info, "documents", ds.num_documents)
    if ds.dtype != info.dtype:
        raise _changed(ds, info, "dtype", ds.dtype)
    n = info.sequences
    nbytes = ds._bin_src.size
    if n:
        out.write_idx(lay.lengths_off + 4 * seq0, ds._arrs.lens)
        ptrs = ds.sequence_pointers
        for s in range(0, n, CHUNK):
            part = ptrs[s:s + CHUNK]
            out.write_idx(lay.pointers_off + 8 * (seq0 + s), np.add(part, bin0, out=buf[:len(part)]))
        if multimodal:
            out.write_idx(lay.modes_off + seq0, ds._arrs.modes)
    di = ds.document_indices
    for s in range(1, len(di), CHUNK):
        part = di[s:s + CHUNK]
        out.write_idx(lay.docs_off + 8 * (doc0 + s), np.add(part, seq0, out=buf[:len(part)]))
    if nbytes:
        out.copy_bin(ds._bin_src, nbytes, bin0)
    return nbytes


def merge(output_prefix, inputs, *, mmap: bool | None = None, durable: bool = True, progress=None,
          overwrite: bool = False, storage_options: dict | None = None) -> MergeResult:
    """Concatenate the datasets ``inputs`` (prefixes, local or URLs) into ``output_prefix`` in one pass
    (see the module docstring); the output's bytes are Megatron-LM's merge's.

    All inputs must share one dtype; the output is multimodal when the first input holding sequences is
    (the others must then be too; a multimodal input merged into a plain output loses its modes, as in
    Megatron).  ``mmap`` is how the inputs are read (:func:`mcf.megatron.open`).  ``durable`` fsyncs the
    output before and after publishing it.  ``progress(done, total, name)`` is called after each input.

    Inputs may be URLs (read through :mod:`mcf.remote`), and ``output_prefix`` an object-store URL
    (``s3://bucket/corpus``, ``gs://``, ``az://``): the ``.bin`` is uploaded first and the ``.idx`` last, so
    a reader that finds the ``.idx`` finds the whole dataset; an output that exists already is refused
    unless ``overwrite`` (a local output is replaced atomically, as the :class:`~mcf.megatron.Writer`
    replaces it).  ``storage_options`` configure every URL's store, the inputs' and the output's
    (:func:`mcf.remote.storage_options` otherwise)."""
    if storage_options is not None:
        from mcf.remote import storage_options as options_for_urls

        with options_for_urls(storage_options):
            return _merge(output_prefix, inputs, mmap, durable, progress, overwrite, storage_options)
    return _merge(output_prefix, inputs, mmap, durable, progress, overwrite, None)


def _merge(output_prefix, inputs, mmap, durable, progress, overwrite, storage_options) -> MergeResult:
    from mcf.megatron.reader import open as open_dataset
    from mcf.remote import is_url, redact

    prefixes = _prefixes(inputs)
    if not prefixes:
        raise InvalidArgumentError("merge needs at least one input dataset")
    out_prefix = os.fsdecode(os.fspath(output_prefix))
    remote = is_url(out_prefix)
    if remote:
        from mcf.megatron._object_out import ObjectOutput

        out_prefix = out_prefix[:-4] if out_prefix.endswith((".idx", ".bin")) else out_prefix
        check = ObjectOutput.check(out_prefix, overwrite=overwrite, storage_options=storage_options)
    else:
        from mcf.megatron.reader import split_prefix

        out_prefix = split_prefix(out_prefix)
    infos = _scan(prefixes)
    dtype, multimodal = _plan(infos)
    n_all = sum(i.sequences for i in infos)
    d_all = 1 + sum(i.documents for i in infos)
    lay = layout_for("megatron", n_all, d_all, multimodal)
    if remote:
        sizes = [i.bin_bytes for i in infos]
        out = ObjectOutput(out_prefix, check, idx_size=lay.size, bin_size=None if None in sizes else sum(sizes))
    else:
        out = LocalOutput(out_prefix, durable=durable)
    try:
        out.write_idx(0, HEADER.pack(MAGIC, VERSION, dtype_code(dtype), n_all, d_all))
        out.write_idx(lay.docs_off, np.zeros(1, np.int64))
        buf = np.empty(min(CHUNK, max(n_all, d_all)), np.int64)
        seq0 = doc0 = bin0 = 0
        ahead = _Prefetch(infos)
        for k, info in enumerate(infos):
            if ahead is not None:
                ahead.upto(k)
            ds = open_dataset(info.prefix, mmap=mmap, multimodal=info.multimodal)
            try:
                bin0 += _append(out, info, ds, lay, seq0, doc0, bin0, multimodal, buf)
            finally:
                # the input's index pages were needed once: let the kernel drop them, so the resident set
                # does not grow with every input merged
                ds._idx_src.advise("dontneed")
                ds.close()
            if bin0 > _INT64_MAX:
                raise InvalidArgumentError(f"the merged .bin would pass {_INT64_MAX} bytes (int64 pointers)")
            seq0 += info.sequences
            doc0 += info.documents
            if progress is not None:
                progress(k + 1, len(infos), redact(info.prefix))
        if bin0 % dtype.itemsize:  # pragma: no cover - every input was validated
            raise AssertionError(f".bin of {bin0} bytes is not a whole number of {dtype} tokens")
        out.publish(bin0)
    except BaseException:
        out.abort()
        raise
    return MergeResult(out_prefix, out.idx_path, out.bin_path, np.dtype(dtype), multimodal, len(infos), n_all,
                       d_all - 1, bin0 // dtype.itemsize)

