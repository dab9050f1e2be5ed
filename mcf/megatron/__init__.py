"""Megatron indexed datasets (``PREFIX.idx`` + ``PREFIX.bin``): read, write, merge, tokenize, sample.

- :func:`open` reads Megatron-LM, datatrove and fairseq datasets through the shared I/O core
  (mmap, positional reads, file-like objects), validated against the ``.bin`` on open; given a list of
  prefixes or a shard list it reads them as one :class:`ShardedDataset` without merging.
- :class:`Writer` writes them with Megatron's builder semantics (``add_item``, ``end_document``,
  ``add_document``, ``add_index``, ``finalize``), byte-identical to Megatron and datatrove.
- :mod:`mcf.megatron.sample_index`: Megatron's GPT document / sample / shuffle indices and
  :class:`GPTSamples`.
- :mod:`mcf.megatron.tokenize`: jsonl / text to a dataset with the Hugging Face ``tokenizers``.

See docs/megatron.md.
"""

from mcf.megatron._layout import MEGATRON_DTYPES, dtype_for_vocab
from mcf.megatron.reader import IndexedDataset, IndexHeader, open, verify
from mcf.megatron.sample_index import (GPTSamples, build_document_index, build_gpt_indices, build_sample_idx,
                                       build_shuffle_index)
from mcf.megatron.sharded import ShardedDataset
from mcf.megatron.writer import Writer, merge

__all__ = ["open", "verify", "IndexedDataset", "IndexHeader", "Writer", "MEGATRON_DTYPES", "dtype_for_vocab",
           "build_sample_idx", "build_document_index", "build_shuffle_index", "build_gpt_indices", "GPTSamples",
           "merge", "ShardedDataset", "demo_megatron"]


def demo_megatron(model_dir, workdir):
    """Tokenize the checkpoint's README into a dataset and print a summary (``mcf demo``'s last step)."""
    from mcf.megatron.demo import demo_megatron as _demo

    return _demo(model_dir, workdir)
