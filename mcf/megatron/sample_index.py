"""Megatron's GPT sample indices: which tokens make up each training sample, and in which order.

Megatron-LM's ``GPTDataset`` builds three arrays (``gpt_dataset.py`` and ``helpers.cpp``):

- the **document index**: the ids of the sequences to train on, tiled once per epoch and shuffled
  with ``numpy.random.RandomState(seed)`` (the last epoch shuffled on its own when it is used for
  less than 80% of its samples: the "separate final epoch" rule);
- the **sample index** (``build_sample_idx``): ``[num_samples + 1, 2]`` rows of (position in the
  document index, token offset) where each sample starts; a sample spans ``seq_length`` tokens plus
  one extra token (the last label) that it shares with the next sample;
- the **shuffle index**: a permutation of the samples, from the same random state.

This module reproduces them exactly (the same arrays, the same dtypes) with the sample index built in
C, and adds the checks Megatron leaves to ``assert`` or to nothing: document ids outside the sizes,
negative sizes, values that do not fit int32, and a token count larger than the document index holds.
"""

from __future__ import annotations

import numpy as np

from mcf._core.args import index_array, integer
from mcf.errors import InvalidArgumentError, OutOfBoundsError
from mcf.megatron import _megatron

__all__ = ["build_sample_idx", "build_document_index", "build_shuffle_index", "num_epochs_for",
           "separate_final_epoch", "build_gpt_indices", "GPTSamples"]

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def _int32_array(a, name: str, lo: int = 0) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, np.int32)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{name} must hold integers, not {arr.dtype}")
    if arr.dtype != np.int32:
        mn, mx = int(arr.min()), int(arr.max())
        if mn < lo or mx > INT32_MAX:
            bad = int(np.flatnonzero((arr < lo) | (arr > INT32_MAX))[0])
            raise InvalidArgumentError(f"{name}[{bad}] = {int(arr[bad])} does not fit [{lo}, {INT32_MAX}]")
    # aligned too: the .idx arrays sit at odd offsets (34 + ...) and C loads them as int32_t*
    return np.require(arr, dtype=np.int32, requirements=("C", "A"))


def _int_arg(v, name: str, lo: int, hi: int) -> int:
    x = integer(v, name)
    if not lo <= x <= hi:
        raise InvalidArgumentError(f"{name} must lie in [{lo}, {hi}], got {x}")
    return x


def build_sample_idx(sizes, document_idx, seq_length: int, num_epochs: int, tokens_per_epoch: int,
                     drop_last_partial_sequence: bool = True, add_extra_token_to_sequence: bool = True,
                     dtype=None) -> np.ndarray:
    """Megatron's ``helpers.build_sample_idx``: ``[num_samples + 1, 2]`` rows of (index into
    ``document_idx``, token offset in that document) where each sample starts.

    ``num_samples`` is ``(num_epochs * tokens_per_epoch - extra) // seq_length`` when dropping the last
    partial sequence, else Megatron's single-precision ceiling of the same quotient.  The output is
    int32 unless ``len(document_idx)`` exceeds int32 (Megatron's rule), or ``dtype`` if given.
    """
    sz = _int32_array(sizes, "sizes")
    di = _int32_array(document_idx, "document_idx")
    if sz.size == 0 or di.size == 0:
        raise InvalidArgumentError("sizes and document_idx must not be empty")
    extra = _int_arg(int(add_extra_token_to_sequence), "add_extra_token_to_sequence", 0, 1)
    seq = _int_arg(seq_length, "seq_length", 2, INT32_MAX - extra)
    epochs = _int_arg(num_epochs, "num_epochs", 1, INT32_MAX)
    tpe = _int_arg(tokens_per_epoch, "tokens_per_epoch", 2, INT64_MAX)
    if epochs * tpe > INT64_MAX:
        raise InvalidArgumentError("num_epochs * tokens_per_epoch overflows int64")
    # Bound the output by what the documents could hold at most (O(len(sizes)), vectorized); the exact
    # token count is checked during the C loop itself (it reports where the documents ran out).
    if epochs * tpe > di.size * max(int(sz.max()), 0):
        raise InvalidArgumentError(
            f"num_epochs * tokens_per_epoch = {epochs * tpe} exceeds what {di.size} documents of at most "
            f"{int(sz.max())} tokens hold")
    num_samples = _megatron.num_samples_for(epochs, tpe, seq, bool(drop_last_partial_sequence), extra)
    if num_samples < 0:
        raise InvalidArgumentError("no samples: num_epochs * tokens_per_epoch < add_extra_token_to_sequence")
    if dtype is None:
        use64 = max(di.size, int(sz.max())) > INT32_MAX
    else:
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise InvalidArgumentError(f"dtype must be int32 or int64, not {dt}")
        use64 = dt == np.int64
        if not use64 and di.size > INT32_MAX:
            raise InvalidArgumentError("document_idx is too long for an int32 sample index")
    out, bad, stuck = _megatron.build_sample_idx_raw(sz, di, seq, num_samples, extra, use64)
    if bad >= 0:
        d = int(di[bad])
        if not 0 <= d < sz.size:
            raise OutOfBoundsError(f"document_idx[{bad}] = {d} is not an index into sizes (length {sz.size})")
        raise InvalidArgumentError(f"sizes[{d}] = {int(sz[d])} is negative")
    # With tokens_per_epoch * num_epochs <= the tokens of document_idx, no full sample runs past the last
    # document; only the final partial one may (when it is kept).  Rows past `exact` come from
    # Megatron's single-precision sample count: kept, as Megatron keeps them.
    x = epochs * tpe - extra
    exact = x // seq if drop_last_partial_sequence else -(-x // seq)
    if stuck >= 0 and (stuck <= exact if drop_last_partial_sequence else stuck < exact):
        raise InvalidArgumentError(
            f"num_epochs * tokens_per_epoch = {epochs * tpe} exceeds the tokens of the documents in document_idx: "
            f"they run out in sample {stuck - 1} of samples 0..{exact - 1} "
            "(Megatron would cut or repeat the last sample)")
    return out


def build_document_index(documents, num_epochs: int, random_state, separate_final_epoch: bool = False) -> np.ndarray:
    """Megatron's ``_build_document_index``: ``documents`` tiled ``num_epochs`` times as int32 and
    shuffled with ``random_state`` (a ``numpy.random.RandomState`` or a seed); with
    ``separate_final_epoch`` the first ``num_epochs - 1`` epochs and the last are shuffled apart."""
    rs = random_state if isinstance(random_state, np.random.RandomState) else np.random.RandomState(random_state)
    docs = _int32_array(documents, "documents")
    epochs = _int_arg(num_epochs, "num_epochs", 1, INT32_MAX)
    if not separate_final_epoch or epochs == 1:
        out = np.tile(docs, epochs)  # == numpy.mgrid[0:E, 0:D][1] filled with documents, flattened
        rs.shuffle(out)
        return out
    first = build_document_index(docs, epochs - 1, rs, False)
    last = build_document_index(docs, 1, rs, False)
    return np.concatenate((first, last))


def build_shuffle_index(num_samples: int, total_size: int, random_state) -> np.ndarray:
    """Megatron's ``_build_shuffle_index``: ``[0, num_samples)`` shuffled, then
    ``[num_samples, total_size)`` shuffled apart; uint32 unless ``total_size >= 2**32 - 2``."""
    rs = random_state if isinstance(random_state, np.random.RandomState) else np.random.RandomState(random_state)
    n = _int_arg(num_samples, "num_samples", 0, INT64_MAX)
    t = _int_arg(total_size, "total_size", n, INT64_MAX)
    dtype = np.uint32 if t < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, n, 1, dtype=dtype)
    rs.shuffle(first)
    if n == t:
        return first
    last = np.arange(n, t, 1, dtype=dtype)
    rs.shuffle(last)
    return np.concatenate((first, last))


def num_epochs_for(num_samples: int | None, tokens_per_epoch: int, seq_length: int,
                   *, add_extra_token_to_sequence: bool = True) -> int:
    """Megatron's ``_get_num_epochs``: the fewest epochs whose tokens cover ``num_samples`` samples."""
    if num_samples is None:
        return 1
    want = (integer(num_samples, "num_samples") * integer(seq_length, "seq_length")
            + int(bool(add_extra_token_to_sequence)))
    tpe = integer(tokens_per_epoch, "tokens_per_epoch")
    if tpe <= 0:
        raise InvalidArgumentError("tokens_per_epoch must be > 0")
    return max(1, -(-want // tpe))


def separate_final_epoch(num_samples: int | None, num_epochs: int, tokens_per_epoch: int, seq_length: int,
                         *, add_extra_token_to_sequence: bool = True) -> bool:
    """Megatron's rule: shuffle the last epoch apart when fewer than 80% of its samples are used."""
    num_epochs = _int_arg(num_epochs, "num_epochs", 1, INT32_MAX)
    tokens_per_epoch = _int_arg(tokens_per_epoch, "tokens_per_epoch", 1, INT64_MAX)
    seq_length = _int_arg(seq_length, "seq_length", 1, INT32_MAX)
    if num_epochs == 1 or num_samples is None:
        return False
    extra = int(bool(add_extra_token_to_sequence))
    sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    from_final = integer(num_samples, "num_samples") - sans_final
    per_epoch = (tokens_per_epoch - extra) // seq_length
    if not 0 <= from_final <= per_epoch + 1:  # Megatron asserts both
        raise InvalidArgumentError(f"inconsistent sample counts: {from_final} samples from the final epoch, "
                                   f"{per_epoch} per epoch")
    return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)


def build_gpt_indices(sizes, seq_length: int, *, num_samples: int | None = None, seed: int = 1234,
                      indices=None, add_extra_token_to_sequence: bool = True,
                      drop_last_partial_sequence: bool = True):
    """``(document_index, sample_index, shuffle_index)`` exactly as Megatron's GPTDataset builds them
    for the sequences ``indices`` (all by default) of a dataset whose sequence lengths are ``sizes``
    (an array, or an :class:`IndexedDataset`)."""
    if hasattr(sizes, "sequence_lengths"):
        sizes = sizes.sequence_lengths
    sz = _int32_array(sizes, "sizes")
    seq_length = _int_arg(seq_length, "seq_length", 1, INT32_MAX)
    if num_samples is not None:
        num_samples = _int_arg(num_samples, "num_samples", 0, INT64_MAX)
    # numpy's meaning of an index array: integers, or a mask with one entry per sequence
    idx = np.arange(sz.size, dtype=np.int32) if indices is None else \
        _int32_array(index_array(indices, sz.size), "indices")
    if idx.size and int(idx.max()) >= sz.size:
        raise OutOfBoundsError(f"indices reach {int(idx.max())}, but there are {sz.size} sequences")
    extra = int(bool(add_extra_token_to_sequence))
    tpe = int(sz[idx].sum(dtype=np.int64)) if idx.size else 0
    if tpe < 2:
        raise InvalidArgumentError(f"the selected sequences hold {tpe} tokens; at least 2 are needed")
    epochs = num_epochs_for(num_samples, tpe, seq_length, add_extra_token_to_sequence=extra)
    sep = separate_final_epoch(num_samples, epochs, tpe, int(seq_length), add_extra_token_to_sequence=extra)
    rs = np.random.RandomState(seed)
    document_index = build_document_index(idx, epochs, rs, sep)
    sample_index = build_sample_idx(sz, document_index, seq_length, epochs, tpe, drop_last_partial_sequence, extra)
    total = sample_index.shape[0] - 1
    if sep:
        sans_final = ((epochs - 1) * tpe - extra) // int(seq_length)
        shuffle_index = build_shuffle_index(sans_final, total, rs)
    else:
        shuffle_index = build_shuffle_index(total, total, rs)
    return document_index, sample_index, shuffle_index


class GPTSamples:
    """Training samples as Megatron's ``GPTDataset`` yields them: ``samples[i]`` is an int64 array of
    ``seq_length + 1`` tokens (``seq_length`` without the extra token), read across sequence
    boundaries in the shuffled order and padded with ``pad_token_id`` when the data runs out.
    ``tokens = s[:-1]`` and ``labels = s[1:]`` are Megatron's inputs and targets."""

    def __init__(self, dataset, seq_length: int, *, num_samples: int | None = None, seed: int = 1234,
                 indices=None, add_extra_token_to_sequence: bool = True, drop_last_partial_sequence: bool = True,
                 pad_token_id: int = -1):
        self.dataset = dataset
        self.seq_length = integer(seq_length, "seq_length")
        self.extra = int(bool(add_extra_token_to_sequence))
        self.pad_token_id = integer(pad_token_id, "pad_token_id")
        self.document_index, self.sample_index, self.shuffle_index = build_gpt_indices(
            dataset, seq_length, num_samples=num_samples, seed=seed, indices=indices,
            add_extra_token_to_sequence=add_extra_token_to_sequence,
            drop_last_partial_sequence=drop_last_partial_sequence)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def _parts(self, idx: int):
        n = len(self)
        i = integer(idx, "a sample index")
        i = i + n if i < 0 else i
        if not 0 <= i < n:
            raise OutOfBoundsError(f"sample {idx} out of range for {n} samples")
        j = int(self.shuffle_index[i])
        beg, beg_off = (int(x) for x in self.sample_index[j])
        end, end_off = (int(x) for x in self.sample_index[j + 1])
        for k in range(beg, end + 1):
            off = beg_off if k == beg else 0
            length = end_off - off + self.extra if k == end else None
            yield int(self.document_index[k]), off, length

    def __getitem__(self, idx: int) -> np.ndarray:
        want = self.seq_length + self.extra
        out = np.full(want, self.pad_token_id, dtype=np.int64)
        pos = 0
        for doc, off, length in self._parts(idx):
            part = self.dataset.get(doc, off, length)
            out[pos:pos + len(part)] = part
            pos += len(part)
        return out

    def document_ids(self, idx: int) -> np.ndarray:
        """The sequence ids sample ``idx`` draws from, in order."""
        return np.array([d for d, _, _ in self._parts(idx)], dtype=np.int64)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]
