"""Megatron datasets on a Ray cluster (Ray Data): tokenize beyond one machine, write and read shards.

- :func:`tokenize` runs ``mcf megatron tokenize`` on a cluster and writes ``PREFIX.bin``/``PREFIX.idx``
  byte-identical to the single-process command on the same inputs and options, whatever the cluster
  does: inputs are cut into byte ranges on line boundaries (:mod:`mcf.conversion._chunks`), each range is
  read, tokenized and written as shards by one fused Ray task, and the commit step merges the shards in
  input order with the existing streaming merge.  A rerun of a failed job reuses the chunks it finished.
- :class:`MegatronDatasink` writes token sequences from any Ray Data pipeline as Megatron shards, one
  atomic shard per order-key group and write task, named by its range (see
  :mod:`mcf.megatron._shard_dir`), then checks and merges them (or lists them for Megatron's
  ``--data-path`` blend, or for :func:`mcf.megatron.open`).
- :class:`MegatronDatasource` (and :func:`read_megatron`) reads one or many Megatron datasets, local or
  fsspec URLs, into blocks of sequences with their global sequence and document ids, split by sequence
  ranges (on document boundaries) across read tasks.

Ray is an optional dependency, the ``ray`` extra: ``pip install '.[ray]'`` in a checkout, ``pip install
'mcf-formats[ray]'`` by name.  See docs/scale.md.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from mcf._core.fs import make_parent_dir
from mcf._core.optional import require

pa = require("pyarrow", feature="mcf.conversion.raydata (Megatron datasets on Ray Data)", extra="ray",
             package="ray[data]")
ray = require("ray", feature="mcf.conversion.raydata (Megatron datasets on Ray Data)", extra="ray")
require("ray.data", feature="mcf.conversion.raydata (Megatron datasets on Ray Data)", extra="ray", package="ray[data]")
from ray.data.block import BlockAccessor, BlockMetadata  # noqa: E402 - after the check above
from ray.data.datasource import Datasink, Datasource, ReadTask  # noqa: E402

from mcf.errors import FormatError, InvalidArgumentError  # noqa: E402
from mcf.conversion._chunks import Chunk, describe_inputs, iter_chunk_documents, plan_chunks  # noqa: E402
from mcf.megatron._shard_dir import (DirectoryLock, ShardRun, commit_runs, complete_groups, read_plan,  # noqa: E402
                                     remove_our_files, run_name, scan_runs, task_name, write_plan)

__all__ = ["tokenize", "MegatronDatasink", "MegatronDatasource", "TextDatasource", "TokenizeStep", "read_megatron",
           "connect"]

PLAN_VERSION = 1
MIN_AUTO_CHUNK = 1 << 20
MAX_AUTO_CHUNK = 256 << 20


# -- reading text -------------------------------------------------------------------------------------
TEXT_SCHEMA = pa.schema([("group", pa.int64()), ("position", pa.int64()), ("end", pa.bool_()),
                         ("text", pa.large_string()), ("sentences", pa.large_list(pa.large_string()))])


def _text_block(group: int, first: int, docs: list, end: int | None) -> pa.Table:
    """Rows ``first, first+1, ...`` of ``group``: one per document (a str, or a list of str sentences),
    then the group's end marker (``end`` = its document count) when ``end`` is not None."""
    n = len(docs) + (end is not None)
    pos = np.arange(first, first + n, dtype=np.int64)
    is_end = np.zeros(n, bool)
    texts = [d if type(d) is str else None for d in docs]
    sents = [d if type(d) is not str else None for d in docs]
    if end is not None:
        is_end[-1] = True
        texts.append(None)
        sents.append(None)
    return pa.table([pa.array(np.full(n, group, np.int64)), pa.array(pos), pa.array(is_end),
                     pa.array(texts, pa.large_string()), pa.array(sents, pa.large_list(pa.large_string()))],
                    schema=TEXT_SCHEMA)


def read_chunk_blocks(chunk: Chunk, json_key: str, batch_size: int, *, drop_empty: bool = False,
                      max_line_bytes: int | None = None):
    """The blocks of one chunk: its documents in order, ``batch_size`` a block, the last block ending
    with the chunk's end marker (alone in a block when the chunk holds no document).  ``drop_empty``
    leaves out documents whose text is empty, as datatrove's readers do (``empty_text="datatrove"``),
    so that positions and the end marker count only the documents that become documents.
    ``max_line_bytes`` as :func:`mcf.conversion.tokenize.iter_documents` takes it (None: its default)."""
    batch: list = []
    first = 0
    for doc in iter_chunk_documents(chunk, json_key, max_line_bytes=max_line_bytes):
        if drop_empty and not doc:
            continue
        batch.append(doc)
        if len(batch) >= batch_size:
            yield _text_block(chunk.index, first, batch, None)
            first += len(batch)
            batch = []
    yield _text_block(chunk.index, first, batch, first + len(batch))


class TextDatasource(Datasource):
    """JSON lines / text inputs as rows ``(group, position, end, text, sentences)``: one read task per
    chunk (:func:`mcf.conversion._chunks.plan_chunks`); ``group`` is the chunk, ``position`` the
    document's number in it, and the last row of each chunk is its end marker (``end`` true,
    ``position`` = the chunk's document count).  ``text`` holds a plain document, ``sentences`` a
    document given as a list of strings.  ``drop_empty`` leaves out documents with an empty text (what
    datatrove's readers do; see :func:`read_chunk_blocks`)."""

    def __init__(self, chunks, *, json_key: str = "text", batch_size: int = 1000, drop_empty: bool = False,
                 max_line_bytes: int | None = None):
        super().__init__()
        self.chunks = list(chunks)
        self.json_key = json_key
        self.max_line_bytes = max_line_bytes
        self.drop_empty = bool(drop_empty)
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")

    def estimate_inmemory_data_size(self):
        """Unknown until read (the text of a compressed input)."""
        return None

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        """One read task per chunk, whatever ``parallelism`` asks: the chunks are the parallelism."""
        tasks = []
        for c in self.chunks:
            size = (c.stop - c.start) if c.stop is not None else None
            meta = BlockMetadata(num_rows=None, size_bytes=size, input_files=[c.path], exec_stats=None)
            tasks.append(ReadTask(lambda c=c, k=self.json_key, b=self.batch_size, e=self.drop_empty,
                                  m=self.max_line_bytes: read_chunk_blocks(c, k, b, drop_empty=e, max_line_bytes=m),
                                  meta,
                                  schema=TEXT_SCHEMA, per_task_row_limit=per_task_row_limit))
        return tasks

    def get_name(self) -> str:
        """Read tasks show as ``ReadText``."""
        return "Text"


# -- tokenizing ---------------------------------------------------------------------------------------
_BACKENDS: dict = {}
_BACKENDS_LOCK = threading.Lock()


def _cached_backend(source_spec, digest: str, backend: str):
    """The worker process's backend for the tokenizer (built once per process and tokenizer)."""
    from mcf.conversion.tok_backends import TokenizerSource, make_backend

    with _BACKENDS_LOCK:
        b = _BACKENDS.get((digest, backend))
        if b is None:
            from tokenizers import Tokenizer

            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # one task, one core
            tokenizer_json, vocab = source_spec
            source = TokenizerSource(Tokenizer.from_str(tokenizer_json), vocab, "the tokenizer")
            b = make_backend(backend, source)
            _BACKENDS.clear()
            _BACKENDS[(digest, backend)] = b
        return b


def _list_array(offsets: np.ndarray, values: np.ndarray, null=None) -> pa.Array:
    mask = None if null is None or not null.any() else pa.array(null)
    return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values), mask=mask)


class TokenizeStep:
    """``map_batches`` function: text rows (see :class:`TextDatasource`) to token rows
    ``(group, position, end, tokens, lengths)``, with exactly the tokenization of
    :func:`mcf.conversion.tokenize.tokenize` (``tokens`` holds a document's tokens, ``lengths`` its
    sequences' lengths).  ``empty_text`` is the single-process option of that name: ``"megatron"``, a
    document without tokens has no sequence; ``"datatrove"``, a plain text is always one sequence (read
    its documents with ``TextDatasource(drop_empty=True)``: datatrove drops empty texts before
    tokenizing).  The tokenizer travels as its JSON (and its tiktoken vocabulary, if it is one) and
    its backend is built once per worker process: ``tokenizer_backend`` is chosen here, on the driver,
    as the single-process run chooses it (:func:`mcf.conversion.tok_backends.choose_backend`: ``auto``
    probes once), and every worker uses that one."""

    def __init__(self, tokenizer, *, add_special_tokens: bool = False, eod: int | None = None, dtype=np.int32,
                 batch_size: int = 1000, empty_text: str = "megatron", tokenizer_backend: str = "auto",
                 tiktoken_pattern: str | None = None):
        from mcf.conversion.tok_backends import choose_backend, load_source
        from mcf.conversion.tokenize import EMPTY_TEXT_RULES

        if empty_text not in EMPTY_TEXT_RULES:
            raise InvalidArgumentError(f"empty_text must be one of {EMPTY_TEXT_RULES}, got {empty_text!r}")
        self.empty_text = empty_text

        source = load_source(tokenizer, tiktoken_pattern=tiktoken_pattern)
        chosen, self.backend_note = choose_backend(source, tokenizer_backend, add_special_tokens=add_special_tokens)
        self.backend = chosen.name
        self.tokenizer_json = source.json
        self.tiktoken = source.tiktoken
        self.digest = source.digest
        self.add_special_tokens = bool(add_special_tokens)
        self.eod = None if eod is None else int(eod)
        self.dtype = np.dtype(dtype)
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")

    def _encode(self, run, docs: list):
        """``(tokens per document, sequences per document, sequence lengths, flat tokens)``."""
        flat, lens, nseq = run(docs)
        if nseq is None:   # one sequence per document; without tokens, none (megatron) or an empty one (datatrove)
            if self.empty_text == "datatrove":
                return lens.astype(np.int64), np.ones(len(lens), np.int64), lens, flat
            return lens.astype(np.int64), (lens > 0).astype(np.int64), lens[lens > 0], flat
        nseq = np.asarray(nseq, np.int64)
        starts = np.zeros(len(nseq) + 1, np.int64)
        np.cumsum(nseq, out=starts[1:])
        cum = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=cum[1:])
        return cum[starts[1:]] - cum[starts[:-1]], nseq, lens, flat

    def __call__(self, table: pa.Table) -> pa.Table:
        from mcf.conversion.tokenize import batch_encoder

        tok = _cached_backend((self.tokenizer_json, self.tiktoken), self.digest, self.backend)
        run = batch_encoder(tok, self.add_special_tokens, self.eod, self.dtype, empty_text=self.empty_text)
        n = table.num_rows
        is_end = table.column("end").to_numpy(zero_copy_only=False).astype(bool, copy=False)
        rows = np.flatnonzero(~is_end)
        doc_tokens = np.zeros(n, np.int64)
        doc_seqs = np.zeros(n, np.int64)
        flats, seq_lens = [np.empty(0, self.dtype)], [np.empty(0, np.int32)]
        # Ray may hand over a block much larger than a batch; encoding it at once would hold every
        # document's Encoding objects at the same time (hundreds of MB per task), so it goes in batches.
        for a in range(0, len(rows), self.batch_size):
            part = rows[a:a + self.batch_size]
            sl = table.take(pa.array(part)) if len(part) != n else table
            texts = sl.column("text").to_pylist()
            sents = sl.column("sentences").to_pylist()
            docs = [t if t is not None else s for t, s in zip(texts, sents)]
            if any(d is None for d in docs):
                raise FormatError("a document row holds neither text nor sentences", field="text")
            toks, seqs, lens, flat = self._encode(run, docs)
            doc_tokens[part] = toks
            doc_seqs[part] = seqs
            seq_lens.append(lens)
            flats.append(flat)
        tok_off = np.zeros(n + 1, np.int64)
        np.cumsum(doc_tokens, out=tok_off[1:])
        len_off = np.zeros(n + 1, np.int64)
        np.cumsum(doc_seqs, out=len_off[1:])
        flat = np.concatenate(flats).astype(self.dtype, copy=False)
        return pa.table({"group": table.column("group"), "position": table.column("position"),
                         "end": table.column("end"), "tokens": _list_array(tok_off, flat, is_end),
                         "lengths": _list_array(len_off, np.concatenate(seq_lens).astype(np.int32, copy=False),
                                                is_end)})


# -- writing shards -----------------------------------------------------------------------------------
def _list_column(table: pa.Table, name: str):
    """``(offsets, values)`` of a list column (zero-copy for Arrow list types; other columns, e.g. Ray's
    tensor extension types, are converted row by row)."""
    col = table.column(name)
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        offs = np.asarray(arr.offsets).astype(np.int64, copy=False)
        vals = arr.values
        if vals.null_count:
            raise InvalidArgumentError(f"column {name!r} holds null items")
        return offs, vals.to_numpy(zero_copy_only=False)
    rows = arr.to_numpy(zero_copy_only=False)
    parts = [np.asarray(r).reshape(-1) if r is not None else np.empty(0, np.int64) for r in rows]
    offs = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(p) for p in parts], out=offs[1:])
    vals = np.concatenate(parts) if parts else np.empty(0, np.int64)
    return offs, vals


def _int_column(table: pa.Table, name: str) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        raise InvalidArgumentError(f"column {name!r} holds nulls")
    a = col.to_numpy()
    if a.dtype.kind not in "iu":
        raise InvalidArgumentError(f"column {name!r} must hold integers, not {a.dtype}")
    return a.astype(np.int64, copy=False)


class MegatronDatasink(Datasink):
    """Write a Ray Data dataset of token rows as Megatron shards in ``directory``.

    Each row is one document: ``tokens`` (a list of token ids), and optionally ``lengths`` (the lengths
    of its sequences; without it a document is one sequence, and a document without tokens follows
    ``empty``: "skip" gives a document without sequences, as Megatron's preprocess_data.py, "sequence"
    one empty sequence, as datatrove).  With ``document`` set, each row is one *sequence* instead and
    adjacent rows with the same value of that column form a document (the rows
    :class:`MegatronDatasource` yields).

    ``order`` names the column(s) of the rows' order: ``"position"`` or ``("group", "position")``
    (int64, positions counted from 0 within a group).  Each write task then writes one shard per group
    it holds, named by its range, and a row whose ``end`` column is true is the group's end marker
    (its position is the group's document count; it is not written).  The shards are put in
    ``(group, position)`` order, whatever order the cluster ran the tasks in, and the commit refuses a
    document written twice and a group with an end marker that misses documents.  Without ``order`` a
    task writes one shard named by its task index, in the order Ray delivers rows (deterministic only
    with ``DataContext.execution_options.preserve_order``).

    With ``output_prefix``, the write is committed when Ray reports it complete: the shards are merged
    in order into ``output_prefix`` (``merge=True``, atomic) and removed, or listed in
    ``output_prefix + ".shards.json"`` (``merge=False``) for :func:`mcf.megatron.open` and Megatron's
    ``--data-path``.  Either way :attr:`runs` lists the shards this write produced, and :attr:`result`
    what the commit wrote.
    """

    def __init__(self, directory, *, dtype=None, vocab_size: int | None = None, dtype_rule: str = "megatron",
                 tokens: str = "tokens", lengths: str | None = "lengths", document: str | None = None,
                 order=None, end: str = "end", empty: str = "skip", output_prefix=None, merge: bool = True,
                 durable: bool = True):
        from mcf.megatron._layout import writer_dtype
        from mcf.remote import refuse_url

        refuse_url(directory, what="writing shards")
        self.dtype = writer_dtype(dtype, vocab_size, dtype_rule)
        if empty not in ("skip", "sequence"):
            raise InvalidArgumentError(f"empty must be 'skip' or 'sequence', not {empty!r}")
        if isinstance(order, str):
            order = (None, order)
        elif order is not None:
            order = tuple(order)
            if len(order) != 2 or not all(isinstance(c, str) for c in order):
                raise InvalidArgumentError("order is a column name or a (group, position) pair of column names")
        self.directory = os.path.abspath(os.fspath(directory))
        self.tokens, self.lengths, self.document = tokens, lengths, document
        self.order, self.end, self.empty = order, end, empty
        self.output_prefix = None if output_prefix is None else os.fspath(output_prefix)
        self.merge = bool(merge)
        self.durable = bool(durable)
        self.runs: list = []
        self.result = None

    # -- driver side ----------------------------------------------------------------------------------
    def on_write_start(self, schema=None) -> None:
        """Create the shard directory (on the driver, before the first write task)."""
        os.makedirs(self.directory, exist_ok=True)

    def on_write_complete(self, write_result) -> None:
        """Collect the shards every write task reported (:attr:`runs`) and, with ``output_prefix``,
        check and commit them (:attr:`result`).  A check that fails publishes nothing."""
        self.runs = [ShardRun.from_dict(d) for ret in write_result.write_returns for d in (ret or [])]
        if self.output_prefix is not None:
            self.result = commit_runs(self.directory, self.runs, output_prefix=self.output_prefix, dtype=self.dtype,
                                      merge=self.merge)

    # -- worker side ----------------------------------------------------------------------------------
    def write(self, blocks, ctx) -> list:
        """One write task: its rows sorted by the order key, one shard per group (or one shard named by
        the task without ``order``), each published atomically.  Returns the shards as dicts."""
        tables = [t for t in (BlockAccessor.for_block(b).to_arrow() for b in blocks) if t.num_rows]
        if not tables:
            return []
        table = pa.concat_tables(tables).combine_chunks() if len(tables) > 1 else tables[0].combine_chunks()
        os.makedirs(self.directory, exist_ok=True)
        n = table.num_rows
        if self.order is None:
            t = int(ctx.task_idx)
            return [self._write_run(table, 0, n, task_name(t), None, t, t, False).to_dict()]
        gcol, pcol = self.order
        group = _int_column(table, gcol) if gcol is not None else np.zeros(n, np.int64)
        pos = _int_column(table, pcol)
        is_end = (table.column(self.end).to_numpy(zero_copy_only=False).astype(bool)
                  if self.end in table.column_names else np.zeros(n, bool))
        if n and (int(group.min()) < 0 or int(pos.min()) < 0):
            raise InvalidArgumentError(f"order keys must be >= 0 (columns {self.order})")
        idx = np.lexsort((pos, group))
        if not np.array_equal(idx, np.arange(n)):
            table, group, pos, is_end = table.take(pa.array(idx)), group[idx], pos[idx], is_end[idx]
        dup = np.flatnonzero((group[1:] == group[:-1]) & (pos[1:] == pos[:-1]))
        if dup.size:
            raise InvalidArgumentError(f"order key (group {group[dup[0]]}, position {pos[dup[0]]}) appears twice")
        cuts = np.flatnonzero(group[1:] != group[:-1]) + 1
        out = []
        for a, b in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [n]))):
            a, b = int(a), int(b)
            ends = np.flatnonzero(is_end[a:b])
            if ends.size and (ends.size > 1 or ends[0] != b - a - 1):
                raise InvalidArgumentError(f"group {group[a]}: rows after its end marker")
            end = bool(ends.size)
            last_doc = b - 1 if end else b
            first = int(pos[a])
            stop = int(pos[b - 1]) if end else int(pos[b - 1]) + 1
            name = run_name(int(group[a]), first, stop, end)
            out.append(self._write_run(table, a, last_doc, name, int(group[a]), first, stop, end).to_dict())
        return out

    def _write_run(self, table, a: int, b: int, name: str, group, first: int, stop: int, end: bool) -> ShardRun:
        from mcf.megatron.writer import Writer

        w = Writer(os.path.join(self.directory, name), dtype=self.dtype, durable=self.durable)
        with w:
            if b > a:
                self._add_rows(w, table, a, b)
        return ShardRun(name, group, first, stop, end, w.document_count, w.sequence_count, w.token_count)

    def _add_rows(self, w, table, a: int, b: int) -> None:
        offs, vals = _list_column(table, self.tokens)
        t0, t1 = int(offs[a]), int(offs[b])
        flat = vals[t0:t1]
        per_row = np.diff(offs[a:b + 1])
        if self.document is not None:
            docs = table.column(self.document).to_numpy()[a:b]
            cut = np.flatnonzero(docs[1:] != docs[:-1]) + 1
            bounds = np.concatenate(([0], cut, [b - a]))
            if len(bounds) - 1 == b - a:
                w.add_documents(flat, per_row, empty="sequence")
                return
            tok_bounds = np.concatenate(([0], np.cumsum(per_row)))
            for s, e in zip(bounds[:-1], bounds[1:]):
                w.add_document(flat[tok_bounds[s]:tok_bounds[e]], per_row[s:e])
            return
        if self.lengths is None or self.lengths not in table.column_names:
            w.add_documents(flat, per_row, empty=self.empty)
            return
        loffs, lvals = _list_column(table, self.lengths)
        lo = loffs[a:b + 1]
        nseq = np.diff(lo)
        seqlens = lvals[int(lo[0]):int(lo[-1])].astype(np.int64, copy=False)
        if seqlens.size and int(seqlens.min()) < 0:
            raise InvalidArgumentError(f"column {self.lengths!r} holds a negative sequence length")
        if (nseq == 1).all() and np.array_equal(seqlens, per_row):
            w.add_documents(flat, per_row, empty="sequence")
        elif (nseq <= 1).all() and np.array_equal(nseq == 0, per_row == 0) and (seqlens > 0).all():
            w.add_documents(flat, per_row, empty="skip")
        else:
            tok_bounds = np.concatenate(([0], np.cumsum(per_row)))
            for k in range(b - a):
                w.add_document(flat[tok_bounds[k]:tok_bounds[k + 1]],
                               seqlens[int(lo[k] - lo[0]):int(lo[k + 1] - lo[0])])

    def get_name(self) -> str:
        """The write tasks' name (``WriteMegatron``)."""
        return "WriteMegatron"


# -- reading Megatron datasets ------------------------------------------------------------------------
def _check_range(ds, a: int, b: int) -> None:
    """Check the index entries ``[a, b)`` of a dataset opened without validation, as opening with
    validation would check them (lengths, pointers, extents), without reading the rest."""
    if b <= a:
        return
    lens = ds.sequence_lengths[a:b].astype(np.int64)
    ptrs = ds.sequence_pointers[a:b]
    isz = ds.dtype.itemsize
    bad = np.flatnonzero(lens < 0)
    if bad.size:
        raise FormatError("negative sequence length", path=ds.idx_path, field=f"sequence_lengths[{a + bad[0]}]")
    bad = np.flatnonzero(ptrs[1:] != ptrs[:-1] + lens[:-1] * isz)
    if bad.size:
        raise FormatError("pointer is not the end of the previous sequence", path=ds.idx_path,
                          field=f"sequence_pointers[{a + bad[0] + 1}]")
    if int(ptrs[0]) < 0 or int(ptrs[-1]) + int(lens[-1]) * isz > ds._bin_src.size:
        raise FormatError("sequences run outside the .bin", path=ds.idx_path, field=f"sequence_pointers[{a}]")


def _document_ids(ds, a: int, b: int) -> np.ndarray:
    """Local document id of each sequence in ``[a, b)``, checked against the document index."""
    di = ds.document_indices
    seq = np.arange(a, b, dtype=np.int64)
    doc = np.searchsorted(di, seq, side="right") - 1
    nd = len(di) - 1
    if seq.size and (int(doc.min()) < 0 or int(doc.max()) >= nd or (di[doc] > seq).any() or (di[doc + 1] <= seq).any()):
        raise FormatError("the document index does not run over these sequences in order", path=ds.idx_path,
                          field="document_indices")
    return doc


def _align(view, x: int) -> int:
    """The first document start at or after global sequence ``x``."""
    if x <= 0 or x >= len(view):
        return max(0, min(x, len(view)))
    k, j = view.locate(x)
    ds = view.shard(k)
    di = ds.document_indices
    d = int(np.searchsorted(di, j, side="right")) - 1
    if int(di[d]) == j:
        return x
    return x - j + int(di[d + 1])


def read_sequence_blocks(shards, meta: dict, a: int, b: int, block_sequences: int, mmap: bool | None):
    """Blocks ``(tokens, sequence, document)`` of the documents that start in global sequences
    ``[a, b)`` of the shards (a read task's work)."""
    from mcf.megatron.sharded import ShardedDataset

    view = ShardedDataset(shards, dtype=meta["dtype"], multimodal=meta["multimodal"], mmap=mmap, validate=False)
    try:
        lo, hi = _align(view, a), _align(view, b)
        s = lo
        while s < hi:
            k, j = view.locate(s)
            ds = view.shard(k)
            take = min(hi - s, len(ds) - j, block_sequences)
            _check_range(ds, j, j + take)
            toks, offs = ds.gather(np.arange(j, j + take))
            docs = _document_ids(ds, j, j + take) + int(view.document_starts[k])
            yield pa.table({"tokens": _list_array(offs, toks), "sequence": pa.array(np.arange(s, s + take)),
                            "document": pa.array(docs)})
            s += take
    finally:
        view.close()


class MegatronDatasource(Datasource):
    """Megatron datasets as rows ``(tokens, sequence, document)``: each sequence's tokens with its global
    sequence and document ids, numbered as in the concatenation of ``paths`` (one prefix, a list of
    prefixes, or a shard list; local paths or fsspec URLs).

    The sequences are split into contiguous ranges across read tasks, moved to document boundaries so
    that no document is split between tasks.  The driver reads only the headers (or the shard list);
    each task opens the shards it reads and checks the index entries it uses.  ``allow_outside``: a
    shard list read from a URL may name shards outside its own location (refused by default, see
    :mod:`mcf.megatron.sharded`)."""

    def __init__(self, paths, *, block_sequences: int = 65536, mmap: bool | None = None,
                 allow_outside: bool = False):
        super().__init__()
        from mcf.megatron.sharded import is_shard_list, open_shards

        if isinstance(paths, (str, bytes, os.PathLike)) and not is_shard_list(paths):
            paths = [paths]
        view = open_shards(paths, allow_outside=allow_outside)
        self.shards = view.shards
        self.meta = {"dtype": str(view.dtype), "multimodal": view.multimodal}
        self.itemsize = view.dtype.itemsize
        self.num_sequences = len(view)
        self.tokens = sum(s.tokens for s in view.shards) if all(s.tokens is not None for s in view.shards) else None
        view.close()
        self.block_sequences = int(block_sequences)
        if self.block_sequences < 1:
            raise InvalidArgumentError(f"block_sequences must be >= 1, got {block_sequences}")
        self.mmap = mmap

    def estimate_inmemory_data_size(self):
        """Tokens times their size, plus the ids (None when a token count is unknown: URL shards)."""
        if self.tokens is None:
            return None
        return self.tokens * self.itemsize + 24 * self.num_sequences

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        """``parallelism`` contiguous sequence ranges (at most one per sequence), each moved to document
        boundaries by its task."""
        n = self.num_sequences
        k = max(1, min(int(parallelism) if parallelism and parallelism > 0 else 1, n))
        bounds = [n * i // k for i in range(k + 1)]
        per_seq = (self.estimate_inmemory_data_size() or 0) // max(n, 1)
        schema = pa.schema([("tokens", pa.large_list(pa.from_numpy_dtype(np.dtype(self.meta["dtype"])))),
                            ("sequence", pa.int64()), ("document", pa.int64())])
        tasks = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            meta = BlockMetadata(num_rows=None, size_bytes=per_seq * (b - a) or None,
                                 input_files=[s.prefix for s in self.shards][:16], exec_stats=None)
            tasks.append(ReadTask(lambda a=a, b=b: read_sequence_blocks(self.shards, self.meta, a, b,
                                                                        self.block_sequences, self.mmap),
                                  meta, schema=schema, per_task_row_limit=per_task_row_limit))
        return tasks

    def get_name(self) -> str:
        """Read tasks show as ``ReadMegatron``."""
        return "Megatron"


def read_megatron(paths, *, block_sequences: int = 65536, mmap: bool | None = None, allow_outside: bool = False,
                  **read_args):
    """``ray.data.read_datasource(MegatronDatasource(paths, ...), **read_args)``."""
    return ray.data.read_datasource(MegatronDatasource(paths, block_sequences=block_sequences, mmap=mmap,
                                                       allow_outside=allow_outside), **read_args)


# -- the tokenize command on a cluster ----------------------------------------------------------------
def _mcf_cause(exc):
    """The mcf error a task raised, from inside Ray's wrappers (``RayTaskError``, Ray Data's
    ``UserCodeException``), or None."""
    from mcf.errors import MCFError

    seen: set = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MCFError) and not isinstance(e, ray.exceptions.RayError):
            return e
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None


def connect(address: str | None = None) -> None:
    """Join a Ray cluster: ``address`` as ``ray.init`` takes it (``host:port`` of the head, ``ray://...``),
    or ``"auto"``/None: the cluster this machine belongs to (``ray start``, ``RAY_ADDRESS``), else a new
    one-machine cluster.  Nothing happens when Ray is already initialized in this process."""
    if ray.is_initialized():
        return
    kwargs = {"logging_level": "WARNING"}
    if address in (None, "", "auto"):
        try:
            ray.init(address="auto", **kwargs)
        except (ConnectionError, RuntimeError, ValueError):
            ray.init(**kwargs)
    else:
        ray.init(address=address, **kwargs)


def _auto_chunk_size(total: int) -> int:
    cpus = int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else 1
    cpus = max(cpus, 1)
    size = total // (4 * cpus) if total else MAX_AUTO_CHUNK
    return int(min(MAX_AUTO_CHUNK, max(MIN_AUTO_CHUNK, size)))


def prepare_shard_dir(shard_dir: str, files, options: dict, chunk_size: int | None, *, resume: bool = True):
    """``(chunks, kept)``: the plan of a tokenize job and the shards of its chunks that an earlier run of
    the same job finished.  The plan in ``shard_dir`` is reused when its options and inputs (with their
    fingerprints) are the same and ``chunk_size`` is None or the same; otherwise the directory's shards
    are removed and a new plan is written.  Shards of unfinished chunks and writers' temporary files
    are removed either way.  The caller holds the directory's lock."""
    old = read_plan(shard_dir) if resume else None
    if (old is not None and old.get("options") == options
            and (chunk_size is None or old.get("chunk_size") == int(chunk_size))):
        chunks = [Chunk(*c) for c in old["chunks"]]
    else:
        size = int(chunk_size) if chunk_size is not None else _auto_chunk_size(sum(f.size for f in files))
        chunks = plan_chunks(files, size)
        remove_our_files(shard_dir, plan=True)
        write_plan(shard_dir, {"options": options, "chunk_size": size,
                               "chunks": [[c.index, c.input, c.path, c.start, c.stop] for c in chunks]})
    planned = {c.index for c in chunks}
    done = {g: rs for g, rs in complete_groups(scan_runs(shard_dir)).items() if g in planned}
    kept = [r for rs in done.values() for r in rs]
    remove_our_files(shard_dir, keep={r.name for r in kept})
    return chunks, kept


def tokenize(inputs, output_prefix, tokenizer, *, json_key: str = "text", append_eod: bool = False,
             eod_token: str | None = None, batch_size: int = 1000, dtype_rule: str = "megatron",
             add_special_tokens: bool = False, empty_text: str = "megatron", max_line_bytes: int | None = None,
             address: str | None = None, chunk_size: int | None = None,
             shard_dir=None, merge: bool = True, resume: bool = True, ray_remote_args: dict | None = None,
             tokenizer_backend: str = "auto", tiktoken_pattern: str | None = None, progress: bool = True):
    """:func:`mcf.conversion.tokenize.tokenize` on a Ray cluster, with byte-identical output.

    Inputs (local paths every node can read, or fsspec URLs) are cut into chunks of ``chunk_size``
    bytes (default: about four per cluster CPU, between 1 and 256 MiB; compressed inputs are one chunk
    each).  Shards go to ``shard_dir`` (default ``output_prefix + ".shards"``, which must be on a
    filesystem every node writes to).  ``merge=True`` merges them into ``output_prefix`` and removes
    them; ``merge=False`` keeps them and writes ``output_prefix + ".shards.json"``.
    ``max_line_bytes`` is the longest input line accepted (None:
    :data:`mcf.conversion.tokenize.MAX_LINE_BYTES`), as in the single-process run, and so are
    ``tokenizer_backend`` (chosen once, here) and ``tiktoken_pattern``.

    A job that fails leaves no ``output_prefix.bin``/``.idx`` and keeps its finished shards with its
    plan: the same command run again (``resume=True``) reads only the chunks that are not finished.
    Changed inputs or options start over.  Returns a :class:`~mcf.conversion.tokenize.TokenizeStats`
    with ``chunks``, ``chunks_reused``, ``output`` and ``phases`` added: the wall seconds of
    ``prepare`` (loading the tokenizer, reading the inputs' sizes and fingerprints), ``connect`` (joining
    or starting the cluster), ``plan`` (the chunk plan, the shard directory and what an earlier run
    finished), ``tokenize`` (the Ray Data job: starting the workers, reading, tokenizing, writing the
    shards) and ``commit`` (checking and merging the shards)."""
    from mcf.megatron._layout import dtype_for_vocab
    from mcf.conversion.tok_backends import load_source
    from mcf.conversion.tokenize import MAX_LINE_BYTES, TokenizeStats, check_max_line_bytes, eod_token_id
    from mcf.remote import refuse_url

    t0 = time.perf_counter()
    refuse_url(output_prefix, what="writing a dataset")
    if isinstance(inputs, (str, bytes, os.PathLike)):
        inputs = [inputs]
    inputs = [os.fsdecode(os.fspath(p)) for p in inputs]
    if not inputs:
        raise InvalidArgumentError("no inputs")
    if int(batch_size) < 1:
        raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")
    if chunk_size is not None and int(chunk_size) < 1:
        raise InvalidArgumentError(f"chunk_size must be >= 1 byte, got {chunk_size}")
    max_line_bytes = check_max_line_bytes(MAX_LINE_BYTES if max_line_bytes is None else max_line_bytes)
    output_prefix = os.fspath(output_prefix)
    source = load_source(tokenizer, tiktoken_pattern=tiktoken_pattern)
    tok = source.hf
    eod = eod_token_id(tok, token=eod_token) if append_eod else None
    dtype = dtype_for_vocab(tok.get_vocab_size(with_added_tokens=True), dtype_rule)
    step = TokenizeStep(source, add_special_tokens=add_special_tokens, eod=eod, dtype=dtype, batch_size=batch_size,
                        empty_text=empty_text, tokenizer_backend=tokenizer_backend)
    files = describe_inputs(inputs)
    total_bytes = sum(f.size for f in files)
    make_parent_dir(output_prefix, what="writing a dataset")  # and of the default shard directory beside it
    t_connect = time.perf_counter()
    connect(address)
    t_plan = time.perf_counter()
    ray.data.DataContext.get_current().enable_progress_bars = bool(progress)
    shard_dir = os.path.abspath(os.fspath(shard_dir) if shard_dir is not None else output_prefix + ".shards")
    options = {"version": PLAN_VERSION, "json_key": json_key, "eod": eod,
               "add_special_tokens": bool(add_special_tokens),
               "empty_text": empty_text, "dtype": str(dtype), "tokenizer_sha256": step.digest,
               "inputs": [[f.path, f.fingerprint] for f in files]}
    with DirectoryLock(shard_dir):
        chunks, kept = prepare_shard_dir(shard_dir, files, options, chunk_size, resume=resume)
        done = {r.group for r in kept}
        todo = [c for c in chunks if c.index not in done]
        new_runs: list = []
        t_run = time.perf_counter()
        if todo:
            sink = MegatronDatasink(shard_dir, dtype=dtype, order=("group", "position"), end="end")
            args = dict(ray_remote_args or {})      # the same for the three stages, so that they fuse
            source = TextDatasource(todo, json_key=json_key, batch_size=batch_size,
                                    drop_empty=empty_text == "datatrove", max_line_bytes=max_line_bytes)
            ds = ray.data.read_datasource(source, override_num_blocks=len(todo),
                                          ray_remote_args=args)
            ds = ds.map_batches(step, batch_format="pyarrow", batch_size=None, zero_copy_batch=True, **args)
            try:
                ds.write_datasink(sink, ray_remote_args=args)
            except Exception as exc:
                cause = _mcf_cause(exc)
                if cause is None or cause is exc:
                    raise
                raise cause from exc       # a malformed input line: the FormatError, not Ray's wrapping of it
            new_runs = sink.runs
        t_commit = time.perf_counter()
        result = commit_runs(shard_dir, kept + new_runs, output_prefix=output_prefix, dtype=dtype, merge=merge,
                             expected_groups={c.index for c in chunks})
    t_end = time.perf_counter()
    phases = {"prepare": t_connect - t0, "connect": t_plan - t_connect, "plan": t_run - t_plan,
              "tokenize": t_commit - t_run, "commit": t_end - t_commit}
    return TokenizeStats(documents=result["documents"], sequences=result["sequences"], tokens=result["tokens"],
                         bytes_in=total_bytes, seconds=t_end - t0, chunks=len(chunks),
                         chunks_reused=len(chunks) - len(todo), shards=result["shards"], output=result["output"],
                         phases=phases, backend=step.backend, backend_note=step.backend_note)
