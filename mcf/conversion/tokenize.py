"""Tokenize text into a Megatron indexed dataset with the Hugging Face ``tokenizers`` library's ids.

Inputs: JSON lines (``*.jsonl``/``*.json``, one document per line, the text under ``json_key``) or
plain text (any other name: one document per non-empty line), each optionally gzip- or
zstd-compressed (by extension or magic bytes).  A JSON value that is a list of strings is a document
of several sequences, as in Megatron's ``preprocess_data.py``.

The output is what Megatron's builder writes for the same token ids: one sequence per text (per
sentence for list values), one document per line, ``--append-eod`` adding the end-of-document token
to the last sequence of a non-empty document, and a text without tokens giving a document without
sequences (``empty_text="datatrove"``: one sequence of just the EOD, and no document for an empty
string, as datatrove's reader and tokenizer step write).  The token dtype follows Megatron's rule
(uint16 below 65500 tokens of vocabulary, else int32) or datatrove's (``dtype_rule="datatrove"``:
uint16 up to 65536).

Lines are read in pieces of :data:`READ_BYTES` and none may be longer than ``max_line_bytes``
(:data:`MAX_LINE_BYTES`, 64 MiB, by default; ``--max-line-bytes`` on the command line): a longer one is a
:class:`mcf.FormatError` naming the input and the line, raised before more than ``max_line_bytes +
READ_BYTES`` bytes of it are held, so a small compressed file that expands to one endless line (a
decompression bomb) costs time, never more memory than that.  An input is a regular file (a FIFO or a
device is refused naming it): its size is the progress total, and a Ray run seeks in it.

The tokenizer is anything :func:`mcf.conversion.tokenizer.load_tokenizer` takes: a ``tokenizers.Tokenizer``, a
``tokenizer.json``, a checkpoint directory, or an MCF file packed with its resources.

The ids are HF tokenizers'; the backend that computes them (HF tokenizers, fastokens, tiktoken) is chosen
by :func:`mcf.conversion.tok_backends.choose_backend` (``tokenizer_backend=``, ``auto`` by default: the
fastest that gives HF tokenizers' ids on a probe corpus).

A thread of its own reads and decompresses each input; the main thread cuts it into blocks of whole
lines, parses a block of JSON lines in one msgspec call (a block it refuses is parsed line by line with
orjson or ``json``, which names the line), encodes it in batches and writes in input order.  With
``workers=N > 1`` (and at least the backend's :data:`mcf.conversion._tokpool.MIN_BYTES` of input), N
worker processes parse and encode blocks of about 4 MiB instead, and the main thread writes their
results in input order (:mod:`mcf.conversion._tokpool`: threads cannot scale this, fastokens holds the
GIL), so the output does not depend on ``workers``.  The ids stay in numpy arrays from the backend to
the writer.  The ``tokenizers`` library's own thread pool is turned off (``TOKENIZERS_PARALLELISM=false``)
unless the caller set that variable, so that ``workers`` is the parallelism.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
import zlib
from functools import partial

import numpy as np

from mcf._core.args import integer
from mcf._core.fs import make_parent_dir, open_regular
from mcf._core.optional import require
from mcf.errors import FormatError, InvalidArgumentError, MCFError, os_error
from mcf.megatron.writer import Writer
from mcf.conversion.tokenizer import load_tokenizer  # noqa: F401 - re-exported: the tokenizer argument takes its sources
from mcf.conversion._inputs import input_size, open_input
from mcf.remote import is_url
from mcf.remote._urls import url_name
from mcf.conversion.tok_backends import choose_backend, load_source
from mcf.conversion import _tokpool
from mcf.conversion._lines import newlines, too_long

try:  # faster JSON when available
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None
try:  # JSON lines a block at a time (the tokenize extra)
    import msgspec as _msgspec
except ImportError:  # pragma: no cover - depends on the environment
    _msgspec = None

__all__ = ["tokenize", "iter_documents", "eod_token_id", "TokenizeStats", "EMPTY_TEXT_RULES", "MAX_LINE_BYTES",
           "READ_BYTES"]

#: the longest line (one document, without its newline) an input may have unless the caller allows more.
#: A line is held whole while it is parsed and tokenized, and costs about 15 times its size at the peak
#: (the text as bytes and as str, the parsed JSON, and a Python int per token: ~36 bytes for every ~4
#: bytes of text), so 64 MiB is about 1 GB of memory per line.  Real documents are far smaller: a book of
#: PG-19 is a few MB, a source file of The Stack at most 1 MB, a whole arXiv paper tens of MB at the most.
MAX_LINE_BYTES = 64 << 20
#: bytes of decompressed input read per step
READ_BYTES = 1 << 20

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|im_end|>")
_COMPRESSED = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd"}


def _compression(head: bytes) -> str | None:
    """``"gzip"``, ``"zstd"`` or None, from the first 4 bytes of an input (its magic, not its name)."""
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head == b"\x28\xb5\x2f\xfd":
        return "zstd"
    return None


def _open_text(path: str, raw=None):
    """A binary stream of the decompressed bytes and the raw file (for progress by compressed bytes).
    ``raw``, if given, is read instead of opening ``path`` (a byte range of it, or a remote file)."""
    if raw is None:  # a regular file: a FIFO or a device is refused, never opened for a blocking read
        raw = os.fdopen(open_regular(path), "rb")
    kind = _compression(raw.peek(4)[:4] if hasattr(raw, "peek") else b"")
    if kind == "gzip":
        return gzip.GzipFile(fileobj=raw), raw
    if kind == "zstd":
        try:
            zstandard = require("zstandard", feature=f"{path}: zstd-compressed input", extra="tokenize")
        except ImportError:
            raw.close()
            raise
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True), raw
    return raw, raw


def _zstd_errors() -> tuple:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - depends on the environment
        return ()
    return (zstandard.ZstdError,)


def _is_json(path: str) -> bool:
    base = url_name(path)   # a URL's name without its query (https://host/a.jsonl?download=true)
    ext = os.path.splitext(base)[1].lower()
    if ext in _COMPRESSED:
        base = base[: -len(ext)]
    return os.path.splitext(base)[1].lower() in (".jsonl", ".json", ".ndjson")


def check_max_line_bytes(max_line_bytes) -> int:
    """``max_line_bytes`` as an int >= 1 (InvalidArgumentError otherwise)."""
    n = integer(max_line_bytes, "max_line_bytes")
    if n < 1:
        raise InvalidArgumentError(f"max_line_bytes must be >= 1, got {n}")
    return n


def _pieces(stream):
    """The pieces of :data:`READ_BYTES` (read at each call, so tests can change it) of ``stream``."""
    while True:
        piece = stream.read(READ_BYTES)
        if not piece:
            return
        yield piece


class _ReadAhead:
    """The pieces of a stream, read (and decompressed: zlib and zstandard release the GIL) by a thread
    of their own, at most ``depth`` pieces ahead of the consumer.  An exception in the thread is raised
    in the consumer, at the point of the stream where it happened; :meth:`close` stops the thread.
    With ``raw`` (the file under a decompressing ``stream``), :attr:`position` is where ``raw`` was
    when the last piece the consumer took had been read."""

    _END = object()

    def __init__(self, stream, raw=None, depth: int = 4):
        import queue

        self._q = queue.Queue(depth)
        self._stop = threading.Event()
        self.position = 0
        self._t = threading.Thread(target=self._run, args=(stream, raw), name="mcf-tokenize-read", daemon=True)
        self._t.start()

    def _run(self, stream, raw):
        try:
            for piece in _pieces(stream):
                if not self._put((piece, raw.tell() if raw is not None else None)):
                    return
            self._put(self._END)
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(exc)

    def _put(self, item) -> bool:
        import queue

        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        while True:
            item = self._q.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            piece, self.position = item
            yield piece

    def close(self) -> None:
        self._stop.set()
        self._t.join()


def _line_blocks(pieces, path: str, max_line_bytes: int):
    """``(number of the first line, bytes)`` of blocks of whole lines (joined by ``\n``, without the last
    newline; the last line of the input too, without one), one block per piece read.  A line longer than
    ``max_line_bytes`` is a FormatError as soon as more than that of it has arrived, so no more than
    ``max_line_bytes + READ_BYTES`` bytes of a line are ever read, and only lines within the cap are
    joined into one object."""
    pending: list = []      # the pieces of a line that continues past the last piece read
    held = 0                # their total length
    lineno = 0              # lines before the next block
    for piece in _pieces(pieces) if hasattr(pieces, "read") else pieces:
        last_nl = piece.rfind(b"\n")
        if last_nl < 0:
            held += len(piece)
            if held > max_line_bytes:
                raise too_long(path, max_line_bytes, lineno + 1)
            pending.append(piece)
            continue
        if pending:
            first_nl = piece.find(b"\n")
            if held + first_nl > max_line_bytes:
                raise too_long(path, max_line_bytes, lineno + 1)
            pending.append(piece[:last_nl])
            block = b"".join(pending)
            pending.clear()
        else:
            block = piece[:last_nl]
        if len(block) > max_line_bytes:  # some line of the block may be too long: find the first
            ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
            starts = np.concatenate(([0], ends + 1))
            ends = np.concatenate((ends, [len(block)]))
            over = np.flatnonzero(ends - starts > max_line_bytes)
            if over.size:
                raise too_long(path, max_line_bytes, lineno + 1 + int(over[0]))
        yield lineno + 1, block
        lineno += newlines(block) + 1
        held = len(piece) - last_nl - 1
        if held:
            if held > max_line_bytes:
                raise too_long(path, max_line_bytes, lineno + 1)
            pending.append(piece[last_nl + 1:])
    if pending:
        yield lineno + 1, b"".join(pending)


def _json_block_decoder(json_key: str):
    """A msgspec decoder of a block of JSON lines into objects holding ``json_key`` (a str or a list of
    str), or None without msgspec.  It only speeds up what :func:`_parse_lines` does: a block it
    refuses is parsed again line by line, which names the line and decides."""
    if _msgspec is None:
        return None
    from typing import List, Union

    doc = _msgspec.defstruct("Document", [("value", Union[str, List[str]])], rename={"value": json_key})
    return _msgspec.json.Decoder(doc)


def _parse_lines(block: bytes, first: int, path: str, as_json: bool, json_key: str, out: list) -> list:
    """The documents of ``block`` (lines numbered from ``first``), one line at a time; ``out`` receives
    them as they are parsed (those before a line that is refused)."""
    loads = _orjson.loads if _orjson is not None else json.loads
    for lineno, data in enumerate(block.split(b"\n"), first):
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"not UTF-8 text: {exc.reason} at byte {exc.start} of the line",
                              path=path, field=f"line {lineno}") from None
        if as_json:
            if not line.strip():
                continue
            try:
                obj = loads(line)
            except (ValueError, RecursionError) as exc:  # json (no orjson): deep nesting recurses
                raise FormatError(f"invalid JSON: {exc}", path=path, field=f"line {lineno}") from None
            if not isinstance(obj, dict) or json_key not in obj:
                raise FormatError(f"no key {json_key!r}", path=path, field=f"line {lineno}")
            v = obj[json_key]
            if isinstance(v, str):
                pass
            elif isinstance(v, list) and all(isinstance(x, str) for x in v):
                pass
            else:
                raise FormatError(f"{json_key!r} is not a string or a list of strings", path=path,
                                  field=f"line {lineno}", got=type(v).__name__)
            if loads is json.loads:  # json accepts "\ud800" escapes (orjson and msgspec refuse them)
                for x in ([v] if type(v) is str else v):
                    try:
                        x.encode("utf-8")
                    except UnicodeEncodeError as exc:
                        raise FormatError(f"invalid JSON: a lone surrogate {x[exc.start]!r} in a string (not "
                                          "Unicode text)", path=path, field=f"line {lineno}") from None
            out.append(v)
        else:
            s = line.rstrip("\r")
            if s.strip():
                out.append(s)
    return out


def _parse_block(block: bytes, first: int, path: str, as_json: bool, json_key: str, decoder, out: list) -> list:
    """The documents of a block of lines, into ``out``: JSON lines decoded by msgspec in one call when it
    can, text decoded at once; what the fast way refuses goes line by line (the error names the line,
    and ``out`` holds the documents before it)."""
    if as_json:
        if decoder is not None:
            try:
                out.extend([d.value for d in decoder.decode_lines(block)])
                return out
            except (_msgspec.DecodeError, ValueError, RecursionError):  # (DecodeError is a ValueError since 0.19)
                pass
        return _parse_lines(block, first, path, True, json_key, out)
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        return _parse_lines(block, first, path, False, json_key, out)
    out.extend([s for s in (x.rstrip("\r") for x in text.split("\n")) if s.strip()])
    return out


def _raw_blocks(path: str, *, stream=None, max_line_bytes: int = MAX_LINE_BYTES, read_ahead: bool = False,
                positions: bool = True):
    """``(number of the first line, bytes of whole lines, compressed bytes consumed)`` of each block of
    lines of ``path`` (see :func:`_line_blocks`; the position is None without ``positions``), the
    input's read and decompression errors as mcf errors naming it; ``read_ahead`` reads and
    decompresses in a thread of its own (which also notes the position, so that asking for it never
    waits for a read in progress)."""
    max_line_bytes = check_max_line_bytes(max_line_bytes)
    stream, raw = _open_text(path, stream)
    ahead = _ReadAhead(stream, raw if positions else None) if read_ahead else None
    try:
        try:
            for first, block in _line_blocks(ahead if ahead is not None else stream, path, max_line_bytes):
                if not positions:
                    yield first, block, None
                else:
                    yield first, block, ahead.position if ahead is not None else raw.tell()
        except (EOFError, gzip.BadGzipFile, zlib.error, *_zstd_errors()) as exc:
            raise FormatError(f"corrupt compressed input: {exc}", path=path) from None
        except OSError as exc:
            if isinstance(exc, MCFError):
                raise
            if exc.errno is None:  # zlib/zstd errors carry no errno
                raise FormatError(f"corrupt compressed input: {exc}", path=path) from None
            raise os_error(exc, path) from None
    finally:
        if ahead is not None:
            ahead.close()
        raw.close()


def _document_blocks(path: str, *, json_key: str = "text", stream=None, max_line_bytes: int = MAX_LINE_BYTES,
                     read_ahead: bool = False, positions: bool = True):
    """``(documents, compressed bytes consumed)`` of each block of lines of ``path`` (see
    :func:`iter_documents`; the bytes are None without ``positions``); ``read_ahead`` reads and
    decompresses in a thread of its own."""
    as_json = _is_json(path)
    decoder = _json_block_decoder(json_key) if as_json else None
    blocks = _raw_blocks(path, stream=stream, max_line_bytes=max_line_bytes, read_ahead=read_ahead,
                         positions=positions)
    try:
        for first, block, pos in blocks:
            docs: list = []
            try:
                _parse_block(block, first, path, as_json, json_key, decoder, docs)
            except FormatError:
                if docs:  # the documents before the refused line, then the error
                    yield docs, pos
                raise
            yield docs, pos
    finally:
        blocks.close()   # the reading thread and the file, now


def iter_documents(path: str, *, json_key: str = "text", position=None, stream=None,
                   max_line_bytes: int = MAX_LINE_BYTES):
    """Yield each document of ``path`` as a ``str`` or a list of ``str`` (sentences).

    ``position``, if given, is a one-element list updated with the compressed bytes consumed.
    ``stream``, if given, is a binary stream read instead of opening ``path`` (which then only names the
    input in messages and tells JSON from text); it is closed at the end.  A line longer than
    ``max_line_bytes`` (:data:`MAX_LINE_BYTES` by default) is a :class:`mcf.FormatError` naming the
    input and the line; no more than ``max_line_bytes + READ_BYTES`` bytes of it are ever read."""
    for docs, pos in _document_blocks(path, json_key=json_key, stream=stream, max_line_bytes=max_line_bytes,
                                      positions=position is not None):
        if position is not None:
            position[0] = pos
        yield from docs


def eod_token_id(tok, *, token: str | None = None) -> int:
    """The id of ``token``, or of the first of the usual end-of-document tokens the vocabulary has."""
    names = (token,) if token else EOD_CANDIDATES
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    raise InvalidArgumentError(f"the tokenizer has no end-of-document token {' or '.join(names)}; "
                               "name one with --eod-token")


class TokenizeStats(dict):
    """``documents``, ``sequences``, ``tokens``, ``bytes_in``, ``seconds`` of a run; ``cpu_seconds``
    (this process's CPU time during the run, and its worker processes' from their start to their last
    block), ``workers`` (the processes that tokenized: 1 is this one) and ``workers_note`` (why fewer
    than asked, or None); ``backend`` and ``backend_note`` (see :func:`tokenize`)."""


EMPTY_TEXT_RULES = ("megatron", "datatrove")


def _as_dtype(ids: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """uint32 ids as ``dtype``, refusing an id that does not fit (the writer's rule, checked here in
    the worker that encoded them)."""
    dtype = np.dtype(dtype)
    if ids.size and dtype.kind in "iu" and not np.can_cast(ids.dtype, dtype, "safe"):
        hi = np.iinfo(dtype).max
        top = int(ids.max())
        if top > hi:
            at = int(np.argmax(ids > hi))
            raise InvalidArgumentError(f"token id {top} does not fit {dtype} [0, {hi}] (first at position {at} of the "
                                       "batch): the vocabulary is larger than --dtype-rule allows")
    return ids.astype(dtype, copy=False)


def batch_encoder(tok, add_special_tokens: bool, eod: int | None, dtype: np.dtype, *, empty_text: str = "megatron"):
    """``run(batch)`` -> ``(flat tokens, sequence lengths, sequences per document or None)`` for a batch
    of documents (str, or lists of str sentences), with ``tok`` a
    :class:`mcf.conversion.tok_backends.Backend` (or a ``tokenizers.Tokenizer``: its HF backend).  The
    ids stay in numpy arrays from the backend to the writer: no per-token Python."""
    from mcf.conversion.tok_backends import Backend, HFBackend

    backend = tok if isinstance(tok, Backend) else HFBackend(tok)
    datatrove = empty_text == "datatrove"
    dtype = np.dtype(dtype)

    def run(batch):
        """(flat tokens, per-sequence lengths, per-document sequence counts or None) for one batch."""
        if datatrove:  # datatrove's readers drop a document whose text is empty before tokenizing
            batch = [d for d in batch if d]
        if all(type(d) is str for d in batch):
            ids, offs = backend.encode(batch, add_special_tokens)
            lens = np.diff(offs)
            if eod is not None:
                add = np.ones(len(lens), bool) if datatrove else lens > 0   # datatrove: even a text without tokens
                ids = np.insert(ids, offs[1:][add], np.uint32(eod))
                lens = lens + add
            return _as_dtype(ids, dtype), lens.astype(np.int32), None
        # documents of several sentences: one sequence per non-empty sentence (datatrove: a plain text
        # is one sequence even when it has no tokens)
        sents, owner = [], []
        for k, d in enumerate(batch):
            for x in ([d] if type(d) is str else d):
                sents.append(x)
                owner.append(k)
        ids, offs = backend.encode(sents, add_special_tokens)
        slens = np.diff(offs)
        keep = slens > 0
        if datatrove:
            keep |= np.array([type(batch[k]) is str for k in owner], bool)
        owner_a = np.asarray(owner, np.int64)
        nseq = np.bincount(owner_a[keep], minlength=len(batch)) if len(owner_a) else np.zeros(len(batch), np.int64)
        if eod is not None and keep.any():  # the EOD closes each document's last kept sentence
            kept = np.flatnonzero(keep)
            last = kept[np.r_[owner_a[kept][1:] != owner_a[kept][:-1], True]]
            ids = np.insert(ids, offs[last + 1], np.uint32(eod))
            slens = slens.copy()
            slens[last] += 1
        return _as_dtype(ids, dtype), slens[keep].astype(np.int32), nseq

    return run


def _block_encoder(backend, *, json_key: str, add_special_tokens: bool, eod: int | None, dtype,
                   empty_text: str, batch_size: int):
    """``encode(block, first line, path, as_json)`` -> ``[(flat ids, sequence lengths, sequences per
    document or None), ...]``: a block of lines parsed (:func:`_parse_block`) and encoded by
    :func:`batch_encoder`, ``batch_size`` documents at a time."""
    run = batch_encoder(backend, add_special_tokens, eod, dtype, empty_text=empty_text)
    decoder = _json_block_decoder(json_key)

    def encode(block: bytes, first: int, path: str, as_json: bool) -> list:
        docs: list = []
        _parse_block(block, first, path, as_json, json_key, decoder if as_json else None, docs)
        return [run(docs[a:a + batch_size]) for a in range(0, len(docs), batch_size)]

    return encode


def _no_lines(encode, block: bytes, first: int, path: str, as_json: bool):
    """``(encode(block, ...), None)``: a block of bytes, whose first line's number is known."""
    return encode(block, first, path, as_json), None


def _plain_file(path: str):
    """A descriptor of ``path`` if it is a local regular file that is not compressed (its blocks can be
    read by offset), else None; a missing or irregular file: the mcf error naming it."""
    fd = open_regular(path)
    try:
        head = os.pread(fd, 4, 0)
    except OSError as exc:
        os.close(fd)
        raise os_error(exc, path) from None
    if _compression(head) is not None:
        os.close(fd)
        return None
    return fd


def _pool_encoder(tokenizer_json: str, tiktoken, label: str, backend_name: str, options: dict):
    """A worker process's :func:`_block_encoder`: the backend the parent chose, built by its name (no
    probe: :func:`choose_backend` ran once, in the parent)."""
    from mcf.conversion.tok_backends import TokenizerSource, make_backend

    hf = None
    if backend_name == "hf":   # the other backends build from the JSON (or the tiktoken vocabulary) alone
        from tokenizers import Tokenizer

        hf = Tokenizer.from_str(tokenizer_json)
    source = TokenizerSource(hf, tiktoken, label, json=tokenizer_json)
    return _block_encoder(make_backend(backend_name, source), **options)


def tokenize(inputs, output_prefix, tokenizer, *, json_key: str = "text", append_eod: bool = False,
             eod_token: str | None = None, workers: int = 1, batch_size: int = 1000,
             dtype_rule: str = "megatron", add_special_tokens: bool = False, empty_text: str = "megatron",
             max_line_bytes: int = MAX_LINE_BYTES, tokenizer_backend: str = "auto", tiktoken_pattern: str | None = None,
             overwrite: bool = False, storage_options: dict | None = None, progress=None) -> TokenizeStats:
    """Tokenize ``inputs`` (one path or several, concatenated in order) into ``output_prefix``.

    Inputs may be URLs (``s3://``, ``gs://``, ``az://``, ``http(s)://``...: read through :mod:`mcf.remote`),
    and ``output_prefix`` an object-store URL (``s3://bucket/corpus``: the ``.bin`` is uploaded as it is
    written and the ``.idx`` last; an existing dataset there is refused unless ``overwrite``; see
    :class:`mcf.megatron.Writer`).  ``storage_options`` configure every URL's store
    (:func:`mcf.remote.storage_options` otherwise).

    ``tokenizer_backend`` is ``"auto"``, ``"hf"``, ``"fastokens"`` or ``"tiktoken"``
    (:mod:`mcf.conversion.tok_backends`); the stats say which ran (``backend``) and, when ``auto`` fell back
    to HF tokenizers, why (``backend_note``).  ``tiktoken_pattern`` is the split pattern of a ``.tiktoken``
    ranks file given as ``tokenizer``.

    ``empty_text`` says what a text without tokens becomes: ``"megatron"`` (``preprocess_data.py``) a
    document with no sequence, and no EOD; ``"datatrove"`` (its reader + ``MegatronDocumentTokenizer``)
    one sequence holding just the EOD with ``append_eod`` (an empty sequence without), while an empty
    string (``""``, or ``[]``) is dropped, as datatrove's readers drop it.
    ``max_line_bytes`` is the longest line an input may have (:data:`MAX_LINE_BYTES` by default): a longer
    one stops the run with a :class:`mcf.FormatError` naming the input and the line.
    ``progress(done_bytes, total_bytes, text)`` is called as input is consumed (compressed bytes).

    ``workers=N`` above 1 tokenizes in N worker processes (started with ``forkserver``, or ``spawn``
    where there is none: a script calling this needs the ``if __name__ == "__main__":`` guard), whose
    results are written in input order: the output is byte-identical for every N.  Input smaller than
    the backend's :data:`mcf.conversion._tokpool.MIN_BYTES` (on disk, all inputs together: 8 MiB for
    ``hf``, 128 MiB for fastokens and tiktoken) is tokenized in this process whatever N, the stats'
    ``workers`` and ``workers_note`` saying so: starting the processes costs more than they save there.
    A worker that dies is a :class:`mcf.WorkerError`; nothing is published on any error, Ctrl-C
    included."""
    if isinstance(inputs, (str, bytes, os.PathLike)):
        inputs = [inputs]
    inputs = [os.fsdecode(os.fspath(p)) for p in inputs]
    workers = integer(workers, "workers")
    if workers < 1:
        raise InvalidArgumentError(f"workers must be >= 1, got {workers}")
    batch_size = integer(batch_size, "batch_size")
    if batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")
    if empty_text not in EMPTY_TEXT_RULES:
        raise InvalidArgumentError(f"empty_text must be one of {EMPTY_TEXT_RULES}, got {empty_text!r}")
    max_line_bytes = check_max_line_bytes(max_line_bytes)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = [input_size(p, storage_options) for p in inputs]  # a missing input stops the run before the output
    total_bytes = sum(sizes)
    if _tokpool.workers_for(workers, total_bytes)[0] > 1:   # workers may be used (the backend decides)
        _tokpool.warm_up()   # the worker processes' server imports what they need while the tokenizer loads
    source = load_source(tokenizer, tiktoken_pattern=tiktoken_pattern)
    tok = source.hf
    backend, note = choose_backend(source, tokenizer_backend, add_special_tokens=add_special_tokens)
    eod = eod_token_id(tok, token=eod_token) if append_eod else None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    used, workers_note = _tokpool.workers_for(workers, total_bytes, backend.name)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    stats = TokenizeStats(documents=0, sequences=0, tokens=0, bytes_in=total_bytes, seconds=0.0, backend=backend.name,
                          backend_note=note, workers=used, workers_note=workers_note)
    if not is_url(output_prefix):
        make_parent_dir(output_prefix, what="writing a dataset")
    w = Writer(output_prefix, vocab_size=vocab, dtype_rule=dtype_rule, overwrite=overwrite,
               storage_options=storage_options)
    run = batch_encoder(backend, add_special_tokens, eod, w.dtype, empty_text=empty_text)
    done_before = 0

    def write(result):
        flat, lens, nseq = result
        if nseq is None:
            w.add_documents(flat, lens, empty="skip" if empty_text == "megatron" else "sequence")
            stats["documents"] += len(lens)
        else:
            pos = 0
            s = 0
            for k in nseq:
                ln = lens[s:s + k]
                cnt = int(ln.sum(dtype=np.int64))
                w.add_document(flat[pos:pos + cnt], ln)
                pos += cnt
                s += k
            stats["documents"] += len(nseq)
        stats["tokens"] += len(flat)

    def report(pos_bytes):
        if progress is not None:
            el = time.perf_counter() - t0
            rate = stats["tokens"] / el / 1e6 if el > 0 else 0.0
            progress(min(pos_bytes, total_bytes), total_bytes, f"{stats['tokens']:,} tokens, {rate:.2f}M tok/s")

    try:
        with w:
            if used == 1:
                for path, size in zip(inputs, sizes):
                    batch: list = []
                    for docs, pos in _document_blocks(path, json_key=json_key, max_line_bytes=max_line_bytes,
                                                      stream=open_input(path, storage_options), read_ahead=True):
                        batch.extend(docs)
                        while len(batch) >= batch_size:
                            part, batch = batch[:batch_size], batch[batch_size:]
                            write(run(part))
                            report(done_before + pos)
                    if batch:
                        write(run(batch))
                    done_before += size
                    report(done_before)
            else:
                options = dict(json_key=json_key, add_special_tokens=add_special_tokens, eod=eod, dtype=w.dtype,
                               empty_text=empty_text, batch_size=batch_size)
                encode = _block_encoder(backend, **options)   # this process's, while the workers start
                with _tokpool.BlockPool(used, _pool_encoder,
                                        (source.json, source.tiktoken, source.label, backend.name, options)) as pool:
                    lines = [0] * len(inputs)   # per input, its lines written so far: numbers its FileRange blocks

                    def written(done):
                        for (results, nlines), (k, at) in done:
                            for r in results:
                                write(r)
                            if nlines is not None:
                                lines[k] += nlines
                            report(at)

                    def again(block, k, path, as_json):   # a FileRange block that failed, numbered right
                        block.encode(encode, lines[k] + 1, path, as_json)

                    def long_line(k, path):
                        raise too_long(path, max_line_bytes, lines[k] + 1)

                    for k, (path, size) in enumerate(zip(inputs, sizes)):
                        as_json = _is_json(path)
                        fd = None if is_url(path) else _plain_file(path)
                        if fd is not None:   # the workers read the blocks: this process only finds their ends
                            try:
                                for block in _tokpool.file_ranges(fd, size, _tokpool.BLOCK_BYTES, max_line_bytes,
                                                                  path):
                                    if isinstance(block, _tokpool.LongLine):   # raised once the blocks before it
                                        written(pool.add_error(partial(long_line, k, path), path, (k, done_before)))
                                        written(pool.drain())   # are written (an error in one of them first)
                                    tag = (k, done_before + min(block.offset + block.length + 1, size))
                                    redo = partial(again, block, k, path, as_json)
                                    if pool.ready():
                                        written(pool.submit(block, None, path, as_json, tag, redo))
                                    else:   # the workers are starting: this process encodes meanwhile
                                        written(pool.add_local(partial(block.encode, encode, 1, path, as_json),
                                                               path, tag, redo))
                            finally:
                                os.close(fd)
                            done_before += size
                            continue
                        blocks = _raw_blocks(path, stream=open_input(path, storage_options),
                                             max_line_bytes=max_line_bytes, read_ahead=True)
                        try:
                            for first, parts, pos in _tokpool.grouped(blocks, _tokpool.BLOCK_BYTES):
                                block = b"\n".join(parts)
                                if pool.ready():
                                    written(pool.submit(block, first, path, as_json, (k, done_before + pos)))
                                else:
                                    written(pool.add_local(partial(_no_lines, encode, block, first, path, as_json),
                                                           path, (k, done_before + pos)))
                        finally:
                            blocks.close()
                        done_before += size
                    written(pool.drain())
                    stats["cpu_seconds"] = pool.worker_cpu_seconds   # the parent's is added below
                report(done_before)
            stats["sequences"] = w.sequence_count
    finally:
        stats["seconds"] = time.perf_counter() - t0
        stats["cpu_seconds"] = stats.get("cpu_seconds", 0.0) + time.process_time() - cpu0
    if progress is not None and total_bytes == 0:
        progress(0, 0, "0 tokens")
    return stats
