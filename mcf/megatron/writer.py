"""Writing Megatron indexed datasets with the semantics of Megatron's ``IndexedDatasetBuilder``.

What differs, on purpose:

- token ids outside the dtype's range raise :class:`mcf.InvalidArgumentError` (Megatron's
  ``numpy.array(tokens, dtype=...)`` wraps them silently);
- the per-sequence arrays (lengths, document boundaries, modes) spill to temporary files past 64 MB
  each, so memory stays bounded however many sequences are written or merged (Megatron keeps Python
  lists of everything and has been reported to need hundreds of GB to merge large corpora);
- the pointers are computed at ``finalize`` by a compiled exclusive prefix sum, with int64 overflow
  checked;
- both files are written to temporary names and renamed into place at ``finalize`` (the ``.bin``
  first, then the ``.idx``), so an interrupted build leaves no half-written dataset; the old ``.idx``
  is removed first when the old ``.bin`` has the new one's size, so no moment shows a mixed pair that
  the reader's size check would accept;
- a document left open at ``finalize`` (sequences added after the last ``end_document``) is closed, so
  the result always has a valid document index.
"""

from __future__ import annotations

import errno
import os
import tempfile

import numpy as np

from mcf._core.args import integer, integers
from mcf._core.lifetime import PublishedOnExit
from mcf._core.fs import create_temp, fsync_dir, fsync_file
from mcf.errors import InvalidArgumentError, MCFError, MCFIOError, os_error
from mcf.megatron import _megatron
from mcf.megatron._layout import (DOC_DTYPE, HEADER, LENGTH_DTYPE, MAGIC, MODE_DTYPE, VERSION,
                                  dtype_code, writer_dtype)

__all__ = ["Writer"]

INT32_MAX = 2**31 - 1


def _exact_float(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Token values ``a`` as the float ``dtype`` of the dataset.  A float dataset stores every id as a
    value, so an id it cannot represent exactly (16777217 in float32, 0.1 from float64 in float32) is
    refused, as an integer dataset refuses an id outside its range, instead of being rounded."""
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(a, dtype=dtype)
    if a.dtype.kind == "b":
        return out
    if a.dtype.kind == "f":
        if np.can_cast(a.dtype, dtype, "safe"):  # float16 -> float32 -> float64 are exact
            return out
        with np.errstate(over="ignore", invalid="ignore"):
            bad = np.flatnonzero((out.astype(a.dtype) != a) & ~np.isnan(a))
    else:  # integers up to 2**(mantissa bits + 1) are exact (numpy calls int64 -> float64 "safe": it
        # is not); past that, check each one as a Python int
        lim = 1 << (np.finfo(dtype).nmant + 1)
        if a.dtype.itemsize * 8 - (a.dtype.kind == "i") <= np.finfo(dtype).nmant + 1:
            return out
        big = np.flatnonzero((a > lim) | (a < -lim))
        f = out[big].astype(np.float64)    # integral values (|f| > 2**24): they convert back exactly
        top = 2.0 ** (64 if a.dtype.kind == "u" else 63)
        inside = f < top                   # float(2**63 - 1) rounds up to 2**63, outside int64
        back = np.where(inside, f, 0).astype(a.dtype)
        bad = big[~inside | (back != a[big])]
    if len(bad):
        i = int(bad[0])
        raise InvalidArgumentError(f"token id {a[i].item()!r} at position {i} cannot be stored exactly in a {dtype} "
                                   f"dataset (it would become {out[i].item()!r})")
    return out
_CHUNK = 1 << 20            # items per chunk when streaming the index out
_BIN_BUFFER = 1 << 20       # bytes buffered before a write(2) to the .bin


class _Column:
    """An append-only typed array that keeps at most ``limit`` bytes in memory and spills the rest to
    an unnamed temporary file."""

    def __init__(self, dtype, directory: str, limit: int = 64 << 20):
        self.dtype = np.dtype(dtype)
        self.directory = directory
        self.limit = limit
        self.count = 0
        self._pending: list = []
        self._chunks: list = []
        self._mem = 0
        self._file = None
        self._spilled = 0

    def append(self, v: int) -> None:
        self._pending.append(v)
        self.count += 1
        if len(self._pending) >= 65536:
            self._flush_pending()

    def extend(self, arr: np.ndarray) -> None:
        if len(arr) == 0:
            return
        self._flush_pending()
        a = np.array(arr, dtype=self.dtype, copy=True)
        self._chunks.append(a)
        self._mem += a.nbytes
        self.count += len(a)
        if self._mem > self.limit:
            self._spill()

    def _flush_pending(self) -> None:
        if self._pending:
            a = np.array(self._pending, dtype=self.dtype)
            self._pending = []
            self._chunks.append(a)
            self._mem += a.nbytes
            if self._mem > self.limit:
                self._spill()

    def _spill(self) -> None:
        if self._file is None:
            self._file = tempfile.TemporaryFile(dir=self.directory, prefix=".mcf-megatron-")
        for a in self._chunks:
            self._file.write(memoryview(a).cast("B"))
            self._spilled += len(a)
        self._chunks = []
        self._mem = 0

    def last(self):
        if self._pending:
            return self._pending[-1]
        if self._chunks:
            return int(self._chunks[-1][-1])
        if self._spilled:
            self._file.flush()
            self._file.seek((self._spilled - 1) * self.dtype.itemsize)
            v = np.frombuffer(self._file.read(self.dtype.itemsize), self.dtype)[0]
            self._file.seek(0, os.SEEK_END)
            return int(v)
        return None

    def chunks(self, size: int = _CHUNK):
        """The values in order, in arrays of at most ``size`` items (aligned, freshly allocated)."""
        self._flush_pending()
        if self._file is not None:
            self._file.flush()
            self._file.seek(0)
            left = self._spilled
            while left:
                k = min(size, left)
                a = np.empty(k, self.dtype)
                got = self._file.readinto(memoryview(a).cast("B"))
                if got != a.nbytes:
                    raise MCFIOError(errno.EIO, "temporary index spill file is short", self._file.name)
                yield a
                left -= k
            self._file.seek(0, os.SEEK_END)
        for a in self._chunks:
            for s in range(0, len(a), size):
                yield a[s:s + size]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._chunks = []
        self._pending = []


class _BinOut:
    """The .bin being written: small writes are buffered, large ones and shard copies go straight to
    the file descriptor (so ``copy_file_range`` and ``write`` never disagree on the position)."""

    def __init__(self, fd: int, name: str):
        self.fd = fd
        self.name = name
        self.nbytes = 0
        self._buf = bytearray()

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        if len(self._buf) + len(mv) <= _BIN_BUFFER:
            self._buf += mv
        else:
            self.flush()
            self._write_all(mv)
        self.nbytes += len(mv)

    def _write_all(self, mv) -> None:
        try:
            while len(mv):
                k = os.write(self.fd, mv)
                mv = mv[k:]
        except OSError as exc:
            raise os_error(exc, self.name) from None

    def flush(self) -> None:
        if self._buf:
            self._write_all(memoryview(self._buf))
            self._buf = bytearray()

    def copy_from(self, src, nbytes: int) -> None:
        """Append ``nbytes`` from the start of the Source ``src`` (a shard's .bin)."""
        self.flush()
        done = 0
        if src.mode in ("mmap", "pread") and hasattr(os, "copy_file_range"):
            try:
                while done < nbytes:
                    k = os.copy_file_range(src.fileno(), self.fd, nbytes - done, done)
                    if k == 0:
                        break
                    done += k
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise os_error(exc, self.name) from None
        step = 8 << 20
        while done < nbytes:
            k = min(step, nbytes - done)
            self._write_all(memoryview(src.view(done, k)))
            done += k
        self.nbytes += nbytes


class _BinUpload:
    """The .bin of a Writer whose prefix is an object-store URL: streamed into its upload
    (:class:`mcf.megatron._object_out.ObjectOutput`), with :class:`_BinOut`'s interface."""

    fd = -1

    def __init__(self, out):
        self.out = out
        self.name = out.bin_path
        self.nbytes = 0

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.out.write_bin(mv)
        self.nbytes += len(mv)

    def flush(self) -> None:
        pass

    def copy_from(self, src, nbytes: int) -> None:
        self.out.copy_bin(src, nbytes, self.nbytes)
        self.nbytes += nbytes


class Writer(PublishedOnExit):
    """Write ``PREFIX.bin`` + ``PREFIX.idx``.

    The token dtype is ``dtype`` if given, else chosen from ``vocab_size`` by ``dtype_rule``
    (``"megatron"``: uint16 below 65500, else int32; ``"datatrove"``: uint16 up to 65536, else int32),
    else int32 (Megatron's builder default).  Use as a context manager: leaving the block normally
    finalizes, an exception discards everything and leaves existing files untouched.

    ``durable=True`` fsyncs both files (and the directory) before and after publishing them, so a
    finalized dataset survives a power loss; ``durable=False`` keeps the atomic renames but leaves
    write-back to the kernel, as Megatron and datatrove do.

    ``prefix`` may be an object-store URL (``s3://bucket/corpus``, ``gs://``, ``az://``): the ``.bin`` then
    streams into a multipart upload as it is written, the ``.idx`` is built in ``staging_dir`` (the system's
    temporary directory by default) with the per-sequence arrays, and ``finalize`` completes the ``.bin``
    and uploads the ``.idx`` last, so a reader that finds the ``.idx`` finds the whole dataset; an aborted
    writer leaves nothing.  A dataset that exists there already is refused unless ``overwrite`` (a local
    one is replaced atomically); ``storage_options`` configure the store
    (:func:`mcf.remote.storage_options` otherwise).  See :mod:`mcf.megatron._object_out`.
    """

    def __init__(self, prefix, *, dtype=None, vocab_size: int | None = None, dtype_rule: str = "megatron",
                 multimodal: bool = False, atomic: bool = True, durable: bool = True, overwrite: bool = False,
                 storage_options: dict | None = None, staging_dir=None):
        from mcf.megatron.reader import split_prefix
        from mcf.remote import is_url

        self.dtype = writer_dtype(dtype, vocab_size, dtype_rule)
        self.dtype_code = dtype_code(self.dtype)
        self.prefix = split_prefix(prefix)
        self._remote = None
        remote = is_url(self.prefix)
        if atomic and not remote:
            from mcf.megatron._publish import finish_interrupted

            finish_interrupted(self.prefix)  # a predecessor killed between its renames: complete it first
        self.idx_path = self.prefix + ".idx"
        self.bin_path = self.prefix + ".bin"
        self.multimodal = bool(multimodal)
        self._atomic = bool(atomic)
        self._durable = bool(durable)
        self._closed = False
        self._int = self.dtype.kind in "iu"
        if self._int:
            info = np.iinfo(self.dtype)
            self._lo, self._hi = int(info.min), int(info.max)
        checked = None
        if remote:
            from mcf.megatron._object_out import check_output

            checked = check_output(self.prefix, overwrite=overwrite, storage_options=storage_options)
            directory = os.fspath(staging_dir) if staging_dir is not None else tempfile.gettempdir()
        else:
            directory = os.path.dirname(os.path.abspath(self.prefix))
        self._dir = directory
        self._lengths = _Column(LENGTH_DTYPE, directory)
        self._docs = _Column(DOC_DTYPE, directory)
        self._docs.append(0)
        self._modes = _Column(MODE_DTYPE, directory) if self.multimodal else None
        self._idx_tmp = self._bin_tmp = None
        if remote:
            from mcf.megatron._object_out import ObjectOutput

            self._remote = ObjectOutput(self.prefix, checked, staging_dir=directory)
            self._bin = _BinUpload(self._remote)
            return
        try:
            if self._atomic:
                fd, self._bin_tmp = create_temp(directory, os.path.basename(self.bin_path))
            else:
                self._bin_tmp = self.bin_path
                fd = os.open(self.bin_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0),
                             0o666)
        except OSError as exc:
            raise os_error(exc, self.bin_path) from None
        self._bin = _BinOut(fd, self._bin_tmp)

    # -- counts ---------------------------------------------------------------------------------------
    @property
    def sequence_count(self) -> int:
        return self._lengths.count

    @property
    def document_count(self) -> int:
        """Documents closed so far."""
        return self._docs.count - 1

    @property
    def token_count(self) -> int:
        return self._bin.nbytes // self.dtype.itemsize

    # -- adding ---------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"{self.prefix}: the writer is finalized or aborted")

    def _tokens(self, tokens) -> np.ndarray:
        """Tokens as a flat contiguous array of the dataset's dtype, range-checked."""
        a = np.asarray(tokens)
        if a.ndim != 1:
            a = a.reshape(-1)
        if a.size == 0:
            return np.empty(0, self.dtype)
        if not self._int:
            if a.dtype.kind not in "iubf":
                raise InvalidArgumentError(f"tokens must be numbers, not {a.dtype}")
            return _exact_float(a, self.dtype)
        if a.dtype.kind == "b":
            a = a.view(np.uint8)
        if a.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"token ids must be integers that fit {self.dtype}; got an array of {a.dtype}")
        a = np.ascontiguousarray(a)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("="))
        if not np.can_cast(a.dtype, self.dtype, "safe"):
            bad = _megatron.find_out_of_range(a, self._lo, self._hi)
            if bad >= 0:
                raise InvalidArgumentError(
                    f"token id {int(a[bad])} at position {bad} does not fit {self.dtype} "
                    f"[{self._lo}, {self._hi}] (Megatron would wrap it silently)")
        return a.astype(self.dtype, copy=False)

    def _check_mode(self, mode) -> int:
        m = integer(mode, "sequence mode")
        if not -128 <= m <= 127:
            raise InvalidArgumentError(f"sequence mode {m} does not fit int8")
        return m

    def add_item(self, tokens, mode: int = 0) -> None:
        """Append one sequence (``mode`` is stored for multimodal datasets)."""
        self._check_open()
        a = self._tokens(tokens)
        if a.size > INT32_MAX:
            raise InvalidArgumentError(f"a sequence holds at most {INT32_MAX} tokens, got {a.size}")
        m = self._check_mode(mode) if self.multimodal else 0
        self._bin.write(a)
        self._lengths.append(int(a.size))
        if self.multimodal:
            self._modes.append(m)

    def end_document(self) -> None:
        """Close the current document: it holds the sequences added since the previous boundary."""
        self._check_open()
        self._docs.append(self._lengths.count)

    def add_document(self, tokens, lengths, modes=None) -> None:
        """Append one document made of ``len(lengths)`` sequences whose tokens are ``tokens``
        concatenated (``sum(lengths)`` must equal the number of tokens)."""
        self._check_open()
        a = self._tokens(tokens)
        ln = integers(lengths, "lengths")
        if ln.size and (int(ln.min()) < 0 or int(ln.max()) > INT32_MAX):
            raise InvalidArgumentError(f"sequence lengths must lie in [0, {INT32_MAX}]")
        if int(ln.sum()) != a.size:
            raise InvalidArgumentError(f"lengths sum to {int(ln.sum())} but {a.size} tokens were given")
        md = None
        if self.multimodal:
            md = np.zeros(ln.size, MODE_DTYPE) if modes is None else integers(modes, "modes")
            if md.size != ln.size:
                raise InvalidArgumentError(f"{md.size} modes for {ln.size} sequences")
            if md.size and (int(md.min()) < -128 or int(md.max()) > 127):
                raise InvalidArgumentError("sequence modes must fit int8")
        self._bin.write(a)
        self._lengths.extend(ln)
        self._docs.append(self._lengths.count)
        if md is not None:
            self._modes.extend(md)

    def add_documents(self, tokens, lengths, *, empty: str = "sequence") -> None:
        """Append many one-sequence documents at once: document ``k`` is the next ``lengths[k]`` tokens.

        ``empty="sequence"`` stores an empty document as one empty sequence (datatrove);
        ``empty="skip"`` as a document with no sequence (Megatron's ``preprocess_data.py``)."""
        self._check_open()
        if empty not in ("sequence", "skip"):
            raise InvalidArgumentError(f"empty must be 'sequence' or 'skip', not {empty!r}")
        a = self._tokens(tokens)
        ln = integers(lengths, "lengths")
        if ln.size == 0:
            if a.size:
                raise InvalidArgumentError(f"no lengths for {a.size} tokens")
            return
        if int(ln.min()) < 0 or int(ln.max()) > INT32_MAX:
            raise InvalidArgumentError(f"document lengths must lie in [0, {INT32_MAX}]")
        if int(ln.sum()) != a.size:
            raise InvalidArgumentError(f"lengths sum to {int(ln.sum())} but {a.size} tokens were given")
        start = self._lengths.count
        if empty == "skip":
            has = ln > 0
            seqs = ln[has]
            ends = start + np.cumsum(has, dtype=np.int64)
        else:
            seqs = ln
            ends = start + np.arange(1, ln.size + 1, dtype=np.int64)
        self._bin.write(a)
        self._lengths.extend(seqs)
        self._docs.extend(ends)
        if self.multimodal:
            self._modes.extend(np.zeros(seqs.size, MODE_DTYPE))

    def add_index(self, source, *, mmap: bool | None = None) -> None:
        """Append a whole dataset (a prefix or an open :class:`IndexedDataset`), streaming: its .bin is
        copied with ``copy_file_range`` when possible and its arrays in chunks."""
        from mcf.megatron.reader import IndexedDataset, open as open_dataset

        self._check_open()
        own = not isinstance(source, IndexedDataset)
        ds = open_dataset(source, mmap=mmap) if own else source
        try:
            if ds.dtype != self.dtype:
                raise InvalidArgumentError(f"{ds.idx_path}: dtype {ds.dtype} differs from the writer's {self.dtype}")
            if self.multimodal and not ds.multimodal:
                raise InvalidArgumentError(f"{ds.idx_path}: not multimodal, but the writer is")
            offset = self._lengths.count
            lens = ds.sequence_lengths
            for s in range(0, len(lens), _CHUNK):
                self._lengths.extend(lens[s:s + _CHUNK])
            di = ds.document_indices
            for s in range(1, len(di), _CHUNK):
                self._docs.extend(di[s:s + _CHUNK] + offset)
            if self.multimodal:
                md = ds.sequence_modes
                for s in range(0, len(md), _CHUNK):
                    self._modes.extend(md[s:s + _CHUNK])
            self._bin.copy_from(ds._bin_src, ds._bin_src.size)
        finally:
            if own:
                # the shard's index pages were only needed once: let the kernel drop them now, so that
                # the resident set does not grow with every shard merged
                ds._idx_src.advise("dontneed")
                ds.close()

    # -- finishing ------------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Write the .idx (pointers computed from the lengths) and publish both files."""
        if self._closed:
            return
        try:
            if self._docs.last() != self._lengths.count:
                self._docs.append(self._lengths.count)
            self._bin.flush()
            if self._remote is not None:
                self._index_into(self._remote.idx_file)
                self._remote.publish(self._bin.nbytes)
                self._closed = True
                self._release()
                return
            if self._durable:
                fsync_file(self._bin.fd)
            os.close(self._bin.fd)
            self._bin.fd = -1
            self._write_index()
            if self._atomic:
                self._publish()
                if self._durable:
                    fsync_dir(os.path.dirname(os.path.abspath(self.idx_path)))
            self._closed = True
            self._release()
        except OSError as exc:
            self.abort()
            if isinstance(exc, MCFError):
                raise
            raise os_error(exc, self.prefix) from None
        except BaseException:
            self.abort()
            raise

    close = finalize

    def _publish(self) -> None:
        """Rename both files into place (see :func:`mcf.megatron._publish.publish_pair`)."""
        from mcf.megatron._publish import publish_pair

        publish_pair(self.prefix, self._bin_tmp, self._idx_tmp, self._bin.nbytes, self._durable)

    def _write_index(self) -> None:
        if self._atomic:
            fd, self._idx_tmp = create_temp(self._dir, os.path.basename(self.idx_path))
        else:
            self._idx_tmp = self.idx_path
            fd = os.open(self.idx_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            self._index_into(f)
            if self._durable:
                fsync_file(f.fileno())

    def _index_into(self, f) -> None:
        """Write the whole .idx to the binary file ``f`` (pointers computed from the lengths), flushed."""
        f.write(HEADER.pack(MAGIC, VERSION, self.dtype_code, self._lengths.count, self._docs.count))
        for a in self._lengths.chunks():
            f.write(memoryview(a).cast("B"))
        cur = 0
        isz = self.dtype.itemsize
        buf = np.empty(_CHUNK, np.int64)
        for a in self._lengths.chunks():
            out = buf[:len(a)]
            cur = _megatron.prefix_pointers(a, isz, cur, out)
            f.write(memoryview(out).cast("B"))
        if cur != self._bin.nbytes:  # pragma: no cover - an internal invariant
            raise AssertionError(f"pointers end at {cur}, .bin holds {self._bin.nbytes} bytes")
        for a in self._docs.chunks():
            f.write(memoryview(a).cast("B"))
        if self.multimodal:
            for a in self._modes.chunks():
                f.write(memoryview(a).cast("B"))
        f.flush()

    def _release(self) -> None:
        for c in (self._lengths, self._docs, self._modes):
            if c is not None:
                c.close()

    def abort(self) -> None:
        """Discard everything written; existing files at the prefix are left as they were."""
        was = self._closed
        self._closed = True
        if self._remote is not None:
            self._release()
            if not was:
                self._remote.abort()
            return
        if self._bin.fd >= 0:
            os.close(self._bin.fd)
            self._bin.fd = -1
        self._release()
        if was:
            return
        for p in (self._bin_tmp, self._idx_tmp):
            if p is not None and os.path.exists(p):
                os.unlink(p)

    _publish_on_exit = finalize  # a with block that ends normally publishes; one left by an exception aborts


def merge(output_prefix, inputs, *, mmap: bool | None = None, durable: bool = True, progress=None,
          overwrite: bool = False, storage_options: dict | None = None):
    """Concatenate the datasets ``inputs`` (prefixes) into ``output_prefix`` in one pass: the output's layout
    from the inputs' headers, then each input opened once (validated), its arrays written at their final
    offsets and its ``.bin`` copied by the kernel (``copy_file_range``); a few inputs open at a time, memory
    bounded whatever the counts (:mod:`mcf.megatron._merge`).  The bytes are Megatron-LM's merge's
    (``IndexedDatasetBuilder.add_index`` per input, then ``finalize``).

    All inputs must share one dtype; the output is multimodal when the first input holding sequences is
    (the others must then be too; a multimodal input merged into a plain output loses its modes, as in
    Megatron).  ``mmap`` is how the inputs are read (:func:`mcf.megatron.open`); ``durable`` fsyncs the
    output before and after publishing it; ``progress(done, total, name)`` is called after each input.

    Inputs may be URLs, and ``output_prefix`` an object-store URL (``s3://bucket/corpus``, ``gs://``,
    ``az://``): the ``.bin`` is uploaded first and the ``.idx`` last, so a reader that finds the ``.idx``
    finds the whole dataset; an output that exists there is refused unless ``overwrite`` (a local output is
    replaced atomically).  ``storage_options`` configure every URL's store, the inputs' and the output's
    (:func:`mcf.remote.storage_options` otherwise).

    Returns a :class:`~mcf.megatron._merge.MergeResult`: ``prefix``, ``idx_path``, ``bin_path``, ``dtype``,
    ``multimodal``, ``inputs``, ``sequence_count``, ``document_count``, ``token_count``."""
    from mcf.megatron._merge import merge as merge_one_pass

    return merge_one_pass(output_prefix, inputs, mmap=mmap, durable=durable, progress=progress,
                          overwrite=overwrite, storage_options=storage_options)
