"""The bucket's identities, all computed from content: a text's or a token list's hash, a context's id,
and the chained hashes of a token list's prefix chunks.

The same content gives the same id after a restart and in another process, so ingesting it twice stores
it once (the deduplication :meth:`mcf.bucket.Bucket.ingest` does), and a new prompt finds the longest
cached prefix by its chunk hashes (:meth:`mcf.bucket.Bucket.lookup_prefix`).  Token ids are hashed in
one canonical encoding, range-checked, so two different token lists can never hash alike.  The names
are importable from :mod:`mcf.bucket.store` too, where they were first defined.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from mcf.bucket import _layout as L
from mcf.errors import InvalidArgumentError

__all__ = ["PREFIX_CHUNK_TOKENS", "content_hash", "context_id_for", "prefix_hashes", "token_array"]

#: token ids are hashed as signed 64-bit little-endian integers: the range every ids dtype in use fits
_TOKEN_MIN, _TOKEN_MAX = -(2**63), 2**63 - 1


def token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``token_ids`` in their canonical encoding (int64, little-endian), every id range-checked first.

    Why checked: a plain ``astype("<i8")`` wraps around, so uint64 ``2**64 - 1`` and ``-1`` would
    hash alike and an ingest would deduplicate to the wrong context.  Ids outside the int64 range,
    booleans, floats, strings and anything not one-dimensional are refused instead."""
    try:
        arr = np.asarray(token_ids)
    except (OverflowError, ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"token_ids must be a 1-D sequence of integers: {exc}") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        kind = "integers beyond 64 bits" if arr.dtype == object else f"dtype {arr.dtype}, shape {arr.shape}"
        raise InvalidArgumentError(f"token_ids must be a 1-D sequence of integers (got {kind})")
    if arr.size and arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _TOKEN_MAX:
        raise InvalidArgumentError(f"token id {int(arr.max())} does not fit a signed 64-bit integer "
                                   f"(ids must be in {_TOKEN_MIN}..{_TOKEN_MAX})")
    return arr.astype("<i8", copy=False)


def content_hash(content: str | bytes | None = None, *, token_ids: Sequence[int] | np.ndarray | None = None) -> str:
    """``sha256:<hex>`` of the text (UTF-8) or of the token ids (as little-endian int64, range-checked:
    :func:`token_array`); the two kinds are domain-separated so a text never collides with a token
    list."""
    if (content is None) == (token_ids is None):
        raise InvalidArgumentError("give exactly one of content or token_ids")
    h = hashlib.sha256()
    if token_ids is not None:
        h.update(b"tokens\0")
        h.update(token_array(token_ids).tobytes())
    else:
        if isinstance(content, str):
            content = content.encode("utf-8")
        if not isinstance(content, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError("content must be str or bytes")
        h.update(b"text\0")
        h.update(bytes(content))
    return "sha256:" + h.hexdigest()


def context_id_for(model_id: str, chash: str, dtype: Any, shape: L.KVShape) -> str:
    """The id of a context: a hash of everything that makes two KV caches interchangeable."""
    key = "\0".join([model_id, chash, L.DTYPE_NAMES[L.parse_dtype(dtype)], str(shape.num_layers),
                     str(shape.num_kv_heads), str(shape.head_dim), str(shape.sequence_length)])
    return "ctx_" + hashlib.sha256(key.encode()).hexdigest()[:32]


#: tokens per prefix chunk: contexts ingested with token ids are indexed by the chained hash of each full
#: chunk, so a new prompt finds the longest cached prefix (the scheme of vLLM's and LMCache's prefix caches)
PREFIX_CHUNK_TOKENS = 256


def prefix_hashes(model_id: str, token_ids: Sequence[int] | np.ndarray, *,
                  chunk_tokens: int = PREFIX_CHUNK_TOKENS) -> list[str]:
    """Chained hashes of the full ``chunk_tokens``-token chunks of ``token_ids``: ``h[i] =
    sha256(h[i-1] || tokens of chunk i as int64 LE)[:32 hex]``, starting from a hash of the model id
    and the chunk size.  Equal ``h[i]`` means equal first ``(i+1) * chunk_tokens`` tokens."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise InvalidArgumentError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    arr = token_array(token_ids)
    prev = hashlib.sha256(f"mcb-prefix\0{model_id}\0{chunk_tokens}".encode()).digest()
    out = []
    for i in range(arr.size // chunk_tokens):
        prev = hashlib.sha256(prev + arr[i * chunk_tokens:(i + 1) * chunk_tokens].tobytes()).digest()
        out.append(prev[:16].hex())
    return out
