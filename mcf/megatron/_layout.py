"""The byte layout of a Megatron ``.idx`` file, in one place: header struct, dtype code tables, sizes.

Megatron-LM (``megatron/core/datasets/indexed_dataset.py``) and datatrove write::

    0   9   magic  b"MMIDIDX\\x00\\x00"
    9   8   u64 version = 1
    17  1   u8  dtype code
    18  8   u64 N  (sequence count)
    26  8   u64 D  (len(document_indices) = documents + 1)
    34      int32 sequence_lengths[N], int64 sequence_pointers[N], int64 document_indices[D],
            int8 sequence_modes[N] (multimodal files only; nothing in the header says so)

The older fairseq variant stops the header after N (26 bytes), has no document index, and its
dtype table differs (7 is float64 there, 9/10 are uint32/uint64).  Nothing in the file names the
variant: the exact ``.idx`` size tells them apart (``size_of`` below is the only place that knows).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from mcf._core.args import integer
from mcf.errors import InvalidArgumentError

__all__ = ["MAGIC", "VERSION", "HEADER", "HEADER_SIZE", "FAIRSEQ_HEADER", "FAIRSEQ_HEADER_SIZE",
           "MEGATRON_DTYPES", "FAIRSEQ_DTYPES", "Layout", "layout_for", "dtype_code", "dtype_for_vocab",
           "LENGTH_DTYPE", "POINTER_DTYPE", "DOC_DTYPE", "MODE_DTYPE", "writer_dtype"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")          # magic, version, dtype code, N, D
HEADER_SIZE = HEADER.size                  # 34
FAIRSEQ_HEADER = struct.Struct("<9sQBQ")   # magic, version, dtype code, N
FAIRSEQ_HEADER_SIZE = FAIRSEQ_HEADER.size  # 26

LENGTH_DTYPE = np.dtype("<i4")
POINTER_DTYPE = np.dtype("<i8")
DOC_DTYPE = np.dtype("<i8")
MODE_DTYPE = np.dtype("i1")

# Megatron's DType enum (indexed_dataset.py); datatrove writes codes 8 (uint16) and 4 (int32).
MEGATRON_DTYPES = {
    1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2"),
}
# fairseq's _code_to_dtype: 6 was ``np.float`` and 7 ``np.double``, both float64.
FAIRSEQ_DTYPES = {
    1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f8"), 8: np.dtype("<u2"),
    9: np.dtype("<u4"), 10: np.dtype("<u8"),
}

# Megatron's DType.optimal_dtype: uint16 below 65500; datatrove's token_size: uint16 up to 65536.
MEGATRON_UINT16_LIMIT = 65500
DATATROVE_UINT16_LIMIT = 65536


@dataclass(frozen=True)
class Layout:
    """Where each array of one ``.idx`` starts, for a given variant and counts."""

    variant: str        # "megatron" or "fairseq"
    n: int              # sequences
    d: int              # len(document_indices); 0 for fairseq
    multimodal: bool
    lengths_off: int
    pointers_off: int
    docs_off: int       # == modes_off - 8*d; for fairseq the end of the pointers
    modes_off: int
    size: int           # exact .idx size


def layout_for(variant: str, n: int, d: int, multimodal: bool) -> Layout:
    """The exact layout of an ``.idx`` with these counts (Python integers: no overflow)."""
    if variant == "fairseq":
        lo = FAIRSEQ_HEADER_SIZE
        po = lo + 4 * n
        end = po + 8 * n
        return Layout("fairseq", n, 0, False, lo, po, end, end, end)
    lo = HEADER_SIZE
    po = lo + 4 * n
    do = po + 8 * n
    mo = do + 8 * d
    return Layout("megatron", n, d, multimodal, lo, po, do, mo, mo + (n if multimodal else 0))


def dtype_code(dtype) -> int:
    """Megatron's code of a token dtype (the writer only writes Megatron's table)."""
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)
    for code, d in MEGATRON_DTYPES.items():
        if d == dt:
            return code
    raise InvalidArgumentError(
        f"dtype {np.dtype(dtype)} has no Megatron code; expected one of "
        f"{', '.join(str(d) for d in MEGATRON_DTYPES.values())}")


def dtype_for_vocab(vocab_size: int, rule: str = "megatron") -> np.dtype:
    """uint16 when the vocabulary fits (``rule``: Megatron's ``< 65500`` or datatrove's ``<= 65536``),
    else int32."""
    if rule == "megatron":
        small = vocab_size < MEGATRON_UINT16_LIMIT
    elif rule == "datatrove":
        small = vocab_size <= DATATROVE_UINT16_LIMIT
    else:
        raise InvalidArgumentError(f"unknown dtype rule {rule!r}; expected 'megatron' or 'datatrove'")
    if vocab_size < 0:
        raise InvalidArgumentError(f"vocab_size must be >= 0, got {vocab_size}")
    return MEGATRON_DTYPES[8] if small else MEGATRON_DTYPES[4]


def writer_dtype(dtype=None, vocab_size: int | None = None, rule: str = "megatron") -> np.dtype:
    """The token dtype a writer uses: ``dtype`` if given, else the one :func:`dtype_for_vocab` picks
    for ``vocab_size``, else int32 (Megatron's builder default)."""
    if dtype is not None and vocab_size is not None:
        raise InvalidArgumentError("pass dtype or vocab_size, not both")
    if dtype is not None:
        return MEGATRON_DTYPES[dtype_code(dtype)]
    if vocab_size is not None:
        return dtype_for_vocab(integer(vocab_size, "vocab_size"), rule)
    return MEGATRON_DTYPES[4]

