"""Cutting tokenizer inputs into byte ranges that separate tasks read, line-exact, in any order.

A chunk is a byte range ``[start, stop)`` of one input.  Its documents are the lines that *start* inside
the range: a task seeks to ``start - 1``, skips to the end of that line (unless the byte there is a
newline), and reads on until the line that holds byte ``stop - 1`` is finished.  The chunks of an input
therefore hold every line exactly once, whatever the chunk size, and concatenating their documents in
chunk order gives the documents of the whole file in order: that is what makes a distributed
tokenization byte-identical to :func:`mcf.conversion.tokenize.tokenize`.  Compressed inputs (gzip, zstd)
cannot be entered in the middle: each is one chunk.

Inputs are local paths or fsspec URLs (``s3://``, ``gs://``, ``https://``...).  Each input is
fingerprinted (size and modification time, or the object store's ETag) so that a resumed job can tell
whether the shards it finds were made from the same bytes.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

from mcf._core.fs import open_regular
from mcf.errors import FormatError, InvalidArgumentError, os_error

__all__ = ["Chunk", "InputFile", "describe_inputs", "plan_chunks", "iter_chunk_documents", "DEFAULT_CHUNK_SIZE"]

DEFAULT_CHUNK_SIZE = 64 << 20
_SCAN = 1 << 16                      # bytes read at a time when looking for the end of a line
_GZIP = b"\x1f\x8b"
_ZSTD = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class InputFile:
    """An input and what identifies its bytes."""

    path: str
    size: int
    fingerprint: str                 # "size:mtime_ns" for local files, the store's ETag/mtime for URLs
    compressed: bool


@dataclass(frozen=True)
class Chunk:
    """Byte range ``[start, stop)`` of input number ``input`` (``stop`` None: the whole file)."""

    index: int                       # position in the plan: the shard group of its documents
    input: int
    path: str
    start: int
    stop: int | None


def _is_url(p: str) -> bool:
    from mcf.remote import is_url

    return is_url(p)


def _open_raw(path: str):
    """A seekable binary file: a local file, or an fsspec file for a URL."""
    if _is_url(path):
        from mcf.remote import url_to_fs

        fs, p = url_to_fs(path, None)
        try:
            return fs.open(p, "rb")
        except FileNotFoundError:
            from mcf.errors import MissingFileError

            raise MissingFileError(2, "no such input", path) from None
    return os.fdopen(open_regular(path), "rb")  # a FIFO or a device is refused, never opened for a blocking read


def describe_inputs(inputs) -> list:
    """:class:`InputFile` of each input (size, fingerprint, and whether it is gzip/zstd compressed)."""
    out = []
    for obj in inputs:
        p = os.fsdecode(os.fspath(obj))
        if _is_url(p):
            from mcf.remote import url_to_fs

            fs, q = url_to_fs(p, None)
            try:
                info = fs.info(q)
            except FileNotFoundError:
                from mcf.errors import MissingFileError

                raise MissingFileError(2, "no such input", p) from None
            size = int(info.get("size") or 0)
            tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
            fp = f"{size}:{tag}"
        else:
            try:
                st = os.stat(p)
            except OSError as exc:
                raise os_error(exc, p) from None
            size, fp = st.st_size, f"{st.st_size}:{st.st_mtime_ns}"
        with _open_raw(p) as f:
            head = f.read(4)
        out.append(InputFile(p, size, fp, head[:2] == _GZIP or head[:4] == _ZSTD))
    return out


def plan_chunks(files, chunk_size: int = DEFAULT_CHUNK_SIZE) -> list:
    """The chunks of ``files`` (:class:`InputFile`), in input order: ranges of ``chunk_size`` bytes of
    each plain input, one chunk per compressed or empty input."""
    chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise InvalidArgumentError(f"chunk size must be >= 1 byte, got {chunk_size}")
    chunks = []
    for i, f in enumerate(files):
        if f.compressed or f.size == 0:
            chunks.append(Chunk(len(chunks), i, f.path, 0, None))
            continue
        for a in range(0, f.size, chunk_size):
            chunks.append(Chunk(len(chunks), i, f.path, a, min(a + chunk_size, f.size)))
    return chunks


class _LineRange(io.RawIOBase):
    """The bytes of the lines that start in ``[start, stop)`` of ``raw``: from the first line start at
    or after ``start`` to the end of the line holding byte ``stop - 1``."""

    def __init__(self, raw, start: int, stop: int):
        self._raw = raw
        if start > 0:
            raw.seek(start - 1)
            if raw.read(1) != b"\n":
                start = self._skip_line(raw, start)
        else:
            raw.seek(0)
        self._pos = start
        self._begin = start
        self._stop = stop
        self._tail = start >= stop     # nothing starts in the range: empty
        self._done = start >= stop

    @staticmethod
    def _skip_line(raw, pos: int) -> int:
        """The position after the next newline from ``pos`` (or the end of the file)."""
        while True:
            block = raw.read(_SCAN)
            if not block:
                return pos
            k = block.find(b"\n")
            if k >= 0:
                pos += k + 1
                raw.seek(pos)
                return pos
            pos += len(block)

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        if self._done:
            return 0
        mv = memoryview(b).cast("B")
        if not self._tail:
            want = min(len(mv), self._stop - self._pos)
            got = self._raw.readinto(mv[:want]) if hasattr(self._raw, "readinto") else None
            if got is None:
                data = self._raw.read(want)
                got = len(data)
                mv[:got] = data
            if got == 0:
                self._done = True
                return 0
            self._pos += got
            if self._pos >= self._stop:
                # the range ends at a line end, or inside a line that must be finished
                self._tail = True
                self._done = mv[got - 1] == 0x0A
            return got
        data = self._raw.read(min(len(mv), _SCAN))
        if not data:
            self._done = True
            return 0
        k = data.find(b"\n")
        if k >= 0:
            data = data[:k + 1]
            self._done = True
        mv[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


def chunk_stream(chunk: Chunk):
    """A binary stream of the chunk's bytes (for :func:`mcf.conversion.tokenize.iter_documents`)."""
    raw = _open_raw(chunk.path)
    if chunk.stop is None:
        # a whole file: buffered so that the reader can peek at the compression magic
        return raw if hasattr(raw, "peek") else io.BufferedReader(raw, 1 << 20)
    try:
        return _LineRange(raw, chunk.start, chunk.stop)
    except OSError as exc:
        raw.close()
        raise os_error(exc, chunk.path) from None


def iter_chunk_documents(chunk: Chunk, json_key: str = "text", *, max_line_bytes: int | None = None):
    """The documents of ``chunk`` in order, as :func:`mcf.conversion.tokenize.iter_documents` yields them
    (``max_line_bytes`` None: its default).  An error names the input and the line, counted from the
    chunk's first line."""
    from mcf.conversion.tokenize import MAX_LINE_BYTES, iter_documents

    stream = chunk_stream(chunk)
    begin = stream._begin if isinstance(stream, _LineRange) else 0
    try:
        yield from iter_documents(chunk.path, json_key=json_key, stream=stream,
                                  max_line_bytes=MAX_LINE_BYTES if max_line_bytes is None else max_line_bytes)
    except FormatError as exc:
        if not begin or exc.field is None:
            raise
        raise FormatError(exc.reason, path=exc.path, field=f"{exc.field} after byte {begin}",
                          offset=exc.offset, expected=exc.expected, got=exc.got) from None
