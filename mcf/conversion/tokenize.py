"""Tokenize text into a Megatron indexed dataset with the Hugging Face ``tokenizers`` library.

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

``workers`` threads tokenize batches in parallel (``tokenizers`` releases the GIL while encoding);
the main thread reads, parses and writes in input order, so the output does not depend on
``workers``.  The library's own thread pool is turned off (``TOKENIZERS_PARALLELISM=false``) unless
the caller set that variable, so that ``workers`` is the parallelism.
"""

from __future__ import annotations

import gzip
import json
import os
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mcf._core.args import integer
from mcf._core.fs import make_parent_dir, open_regular
from mcf._core.optional import require
from mcf.errors import FormatError, InvalidArgumentError, MCFError, os_error
from mcf.megatron import _megatron
from mcf.megatron.writer import Writer
from mcf.conversion.tokenizer import load_tokenizer  # the tokenizer argument: any source mcf.conversion.tokenizer takes
from mcf.conversion._inputs import input_size, open_input
from mcf.remote import is_url
from mcf.remote._urls import url_name

try:  # faster JSON when available
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

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


def _open_text(path: str, raw=None):
    """A binary stream of the decompressed bytes and the raw file (for progress by compressed bytes).
    ``raw``, if given, is read instead of opening ``path`` (a byte range of it, or a remote file)."""
    if raw is None:  # a regular file: a FIFO or a device is refused, never opened for a blocking read
        raw = os.fdopen(open_regular(path), "rb")
    head = raw.peek(4)[:4] if hasattr(raw, "peek") else b""
    kind = None
    if head[:2] == b"\x1f\x8b":
        kind = "gzip"
    elif head == b"\x28\xb5\x2f\xfd":
        kind = "zstd"
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


def _lines(stream, path: str, max_line_bytes: int):
    """``(number, bytes)`` of each line of ``stream`` (without its newline; a last line without one
    too), read in pieces of READ_BYTES: a line longer than ``max_line_bytes`` is a FormatError as soon
    as more than that of it has arrived, so no more than ``max_line_bytes + READ_BYTES`` bytes of a line are
    ever read, and only lines within the cap are joined into one object."""
    pending: list = []      # the pieces of a line that continues past the last piece read
    held = 0                # their total length
    lineno = 0

    def too_long(n):
        return FormatError(f"line longer than the {max_line_bytes} bytes allowed (max_line_bytes; "
                           "--max-line-bytes on the command line)", path=path, field=f"line {n}",
                           expected=f"at most {max_line_bytes} bytes")

    while True:
        piece = stream.read(READ_BYTES)
        if not piece:
            break
        parts = piece.split(b"\n")
        last = parts.pop()
        for k, line in enumerate(parts):
            lineno += 1
            if k == 0 and pending:
                pending.append(line)
                line = b"".join(pending)
                pending.clear()
                held = 0
            if len(line) > max_line_bytes:
                raise too_long(lineno)
            yield lineno, line
        if last:
            held += len(last)
            if held > max_line_bytes:
                raise too_long(lineno + 1)
            pending.append(last)
    if pending:
        yield lineno + 1, b"".join(pending)


def iter_documents(path: str, *, json_key: str = "text", position=None, stream=None,
                   max_line_bytes: int = MAX_LINE_BYTES):
    """Yield each document of ``path`` as a ``str`` or a list of ``str`` (sentences).

    ``position``, if given, is a one-element list updated with the compressed bytes consumed.
    ``stream``, if given, is a binary stream read instead of opening ``path`` (which then only names the
    input in messages and tells JSON from text); it is closed at the end.  A line longer than
    ``max_line_bytes`` (:data:`MAX_LINE_BYTES` by default) is a :class:`mcf.FormatError` naming the
    input and the line; no more than ``max_line_bytes + READ_BYTES`` bytes of it are ever read."""
    max_line_bytes = check_max_line_bytes(max_line_bytes)
    stream, raw = _open_text(path, stream)
    as_json = _is_json(path)
    loads = _orjson.loads if _orjson is not None else json.loads
    try:
        lineno = 0
        try:
            for lineno, data in _lines(stream, path, max_line_bytes):
                if position is not None and lineno % 1024 == 0:
                    position[0] = raw.tell()
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
                        yield v
                    elif isinstance(v, list) and all(isinstance(x, str) for x in v):
                        yield v
                    else:
                        raise FormatError(f"{json_key!r} is not a string or a list of strings", path=path,
                                          field=f"line {lineno}", got=type(v).__name__)
                else:
                    s = line.rstrip("\r")
                    if s.strip():
                        yield s
        except (EOFError, gzip.BadGzipFile, zlib.error, *_zstd_errors()) as exc:
            raise FormatError(f"corrupt compressed input: {exc}", path=path) from None
        except OSError as exc:
            if isinstance(exc, MCFError):
                raise
            if exc.errno is None:  # zlib/zstd errors carry no errno
                raise FormatError(f"corrupt compressed input: {exc}", path=path) from None
            raise os_error(exc, path) from None
        if position is not None:
            position[0] = raw.tell()
    finally:
        raw.close()


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
    """``documents``, ``sequences``, ``tokens``, ``bytes_in``, ``seconds`` of a run."""


EMPTY_TEXT_RULES = ("megatron", "datatrove")


def batch_encoder(tok, add_special_tokens: bool, eod: int | None, dtype: np.dtype, *, empty_text: str = "megatron"):
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    datatrove = empty_text == "datatrove"

    def run(batch):
        """(flat tokens, per-document sequence lengths or None, document count) for one batch."""
        if datatrove:  # datatrove's readers drop a document whose text is empty before tokenizing
            batch = [d for d in batch if d]
        simple = all(type(d) is str for d in batch)
        if simple:
            ids = [e.ids for e in encode(batch, add_special_tokens=add_special_tokens)] if batch else []
            if eod is not None:
                for x in ids:
                    if x or datatrove:  # datatrove: even a text without tokens gets its EOS
                        x.append(eod)
            flat, lens = _megatron.flat_tokens(ids, dtype)
            return flat, lens, None
        # documents of several sentences: one sequence per non-empty sentence (datatrove: a plain text
        # is one sequence even when it has no tokens)
        sents, owner = [], []
        for k, d in enumerate(batch):
            for s in ([d] if type(d) is str else d):
                sents.append(s)
                owner.append(k)
        ids = [e.ids for e in encode(sents, add_special_tokens=add_special_tokens)] if sents else []
        per_doc: list = [[] for _ in batch]
        for k, x in zip(owner, ids):
            if x or (datatrove and type(batch[k]) is str):
                per_doc[k].append(x)
        if eod is not None:
            for seqs in per_doc:
                if seqs:
                    seqs[-1].append(eod)
        flat_lists = [x for seqs in per_doc for x in seqs]
        flat, lens = _megatron.flat_tokens(flat_lists, dtype)
        return flat, lens, [len(seqs) for seqs in per_doc]

    return run


def tokenize(inputs, output_prefix, tokenizer, *, json_key: str = "text", append_eod: bool = False,
             eod_token: str | None = None, workers: int = 1, batch_size: int = 1000,
             dtype_rule: str = "megatron", add_special_tokens: bool = False, empty_text: str = "megatron",
             max_line_bytes: int = MAX_LINE_BYTES, overwrite: bool = False, storage_options: dict | None = None,
             progress=None) -> TokenizeStats:
    """Tokenize ``inputs`` (one path or several, concatenated in order) into ``output_prefix``.

    Inputs may be URLs (``s3://``, ``gs://``, ``az://``, ``http(s)://``...: read through :mod:`mcf.remote`),
    and ``output_prefix`` an object-store URL (``s3://bucket/corpus``: the ``.bin`` is uploaded as it is
    written and the ``.idx`` last; an existing dataset there is refused unless ``overwrite``; see
    :class:`mcf.megatron.Writer`).  ``storage_options`` configure every URL's store
    (:func:`mcf.remote.storage_options` otherwise).

    ``empty_text`` says what a text without tokens becomes: ``"megatron"`` (``preprocess_data.py``) a
    document with no sequence, and no EOD; ``"datatrove"`` (its reader + ``MegatronDocumentTokenizer``)
    one sequence holding just the EOD with ``append_eod`` (an empty sequence without), while an empty
    string (``""``, or ``[]``) is dropped, as datatrove's readers drop it.
    ``max_line_bytes`` is the longest line an input may have (:data:`MAX_LINE_BYTES` by default): a longer
    one stops the run with a :class:`mcf.FormatError` naming the input and the line.
    ``progress(done_bytes, total_bytes, text)`` is called as input is consumed (compressed bytes)."""
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
    tok = load_tokenizer(tokenizer)
    eod = eod_token_id(tok, token=eod_token) if append_eod else None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    sizes = [input_size(p, storage_options) for p in inputs]  # a missing input stops the run before the output
    total_bytes = sum(sizes)
    t0 = time.perf_counter()
    stats = TokenizeStats(documents=0, sequences=0, tokens=0, bytes_in=total_bytes, seconds=0.0)
    if not is_url(output_prefix):
        make_parent_dir(output_prefix, what="writing a dataset")
    w = Writer(output_prefix, vocab_size=vocab, dtype_rule=dtype_rule, overwrite=overwrite,
               storage_options=storage_options)
    run = batch_encoder(tok, add_special_tokens, eod, w.dtype, empty_text=empty_text)
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
            pool = ThreadPoolExecutor(workers) if workers > 1 else None
            try:
                pending: deque = deque()
                for path, size in zip(inputs, sizes):
                    pos = [0]
                    batch: list = []
                    for doc in iter_documents(path, json_key=json_key, position=pos, max_line_bytes=max_line_bytes,
                                              stream=open_input(path, storage_options)):
                        batch.append(doc)
                        if len(batch) >= batch_size:
                            if pool is None:
                                write(run(batch))
                            else:
                                pending.append(pool.submit(run, batch))
                                while len(pending) > 2 * workers:
                                    write(pending.popleft().result())
                            batch = []
                            report(done_before + pos[0])
                    if batch:
                        if pool is None:
                            write(run(batch))
                        else:
                            pending.append(pool.submit(run, batch))
                    while pending:
                        write(pending.popleft().result())
                    done_before += size
                    report(done_before)
            finally:
                if pool is not None:
                    for f in pending:
                        f.cancel()
                    pool.shutdown(wait=True)
            stats["sequences"] = w.sequence_count
    finally:
        stats["seconds"] = time.perf_counter() - t0
    if progress is not None and total_bytes == 0:
        progress(0, 0, "0 tokens")
    return stats
