"""Megatron indexed datasets (``PREFIX.idx`` + ``PREFIX.bin``): read, write, merge, tokenize, sample.

- :func:`open` reads Megatron-LM, datatrove and fairseq datasets through the shared I/O core
  (mmap, positional reads, file-like objects), validated against the ``.bin`` on open; given a list of
  prefixes or a shard list it reads them as one :class:`ShardedDataset` without merging.
- :class:`Writer` writes them with Megatron's builder semantics (``add_item``, ``end_document``,
  ``add_document``, ``add_index``, ``finalize``), byte-identical to Megatron and datatrove.
- :mod:`mcf.megatron.sample_index`: Megatron's GPT document / sample / shuffle indices and
  :class:`GPTSamples`.
- :mod:`mcf.conversion.tokenize`: jsonl / text to a dataset with the Hugging Face ``tokenizers``.

See docs/megatron.md.
"""

from mcf.megatron._layout import MEGATRON_DTYPES, dtype_for_vocab
from mcf.megatron import reader as _reader
from mcf.megatron.reader import IndexedDataset, IndexHeader, verify
from mcf.megatron.sample_index import (GPTSamples, build_document_index, build_gpt_indices, build_sample_idx,
                                       build_shuffle_index)
from mcf.megatron import sharded as _sharded
from mcf.megatron.sharded import ShardedDataset
from mcf.megatron.writer import Writer, merge

__all__ = ["open", "verify", "IndexedDataset", "IndexHeader", "Writer", "MEGATRON_DTYPES", "dtype_for_vocab",
           "build_sample_idx", "build_document_index", "build_shuffle_index", "build_gpt_indices", "GPTSamples",
           "merge", "ShardedDataset"]


def open(prefix=None, *, mmap: bool | None = None, multimodal: bool | None = None, validate: bool = True,  # noqa: A001
         idx=None, bin=None, allow_outside: bool = False):
    """Open ``PREFIX.idx`` + ``PREFIX.bin`` (``prefix`` may also end in ``.idx`` or ``.bin``).

    The files are mapped on a local disk and read with positional reads on a network or FUSE
    filesystem (``mmap=None``, the default); ``mmap=False`` always reads with positional reads (no
    address-space limits), ``mmap=True`` always maps;
    ``idx=`` and ``bin=`` take anything :func:`mcf.io.open_source` takes instead of a prefix (file-like
    objects, memoryviews, paths).  ``multimodal`` is detected from the .idx size unless given.
    ``validate=False`` skips the O(N) checks of the arrays (reads stay bounds-checked).

    A list of prefixes, or a shard list (``*.json``, as the Ray commit step writes), opens one
    read-only :class:`~mcf.megatron.sharded.ShardedDataset` over all of them, numbered as their
    concatenation, without merging or scanning them (see docs/scale.md).  A shard list read from a URL
    may only name shards relative to its own location; ``allow_outside=True`` also opens the absolute
    paths, other URLs and other buckets a list the caller trusts names (:mod:`mcf.megatron.sharded`).
    """
    if idx is None and bin is None and (isinstance(prefix, (list, tuple)) or _sharded.is_shard_list(prefix)):
        return _sharded.open_shards(prefix, mmap=mmap, multimodal=multimodal, validate=validate,
                                    allow_outside=allow_outside)
    return _reader.open(prefix, mmap=mmap, multimodal=multimodal, validate=validate, idx=idx, bin=bin)
