"""Prefix keys exactly as the serving engines compute them: vLLM's block hashes, SGLang HiCache's page
hashes and LMCache's chunk keys, from token ids, without the engines installed.

A KV store that an engine asks "do you hold the KV of these tokens?" must answer in the engine's own
keys: the engine never sends tokens, only its hashes.  Each function here reproduces one engine's
function bit for bit (tests/test_bucket_keys.py compares them with vectors the engines' own functions
produced: ``tools/kv_golden.py`` regenerates them):

* :func:`vllm_block_hashes`: vLLM's ``hash_block_tokens`` chain with ``--prefix-caching-hash-algo
  sha256_cbor`` (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``).  One 32-byte digest
  per *full* block: ``h[i] = SHA256(canonical CBOR [h[i-1], [tokens of block i], extra keys or null])``
  with ``h[-1] = NONE_HASH = SHA256(CBOR(seed))``.  The default ``sha256`` algorithm hashes a pickle
  and so is Python-only; ``sha256_cbor`` is the one to configure for a store.  :func:`vllm_event_hash`
  is the 64-bit form vLLM's KV events carry.
* :func:`sglang_page_hashes`: HiCache's ``get_hash_str`` (``sglang/srt/mem_cache/utils.py`` over
  ``cpp_utils/hash_binding.cpp``): ``h[i] = SHA256(h[i-1] || tokens of page i as uint32 LE)`` in hex,
  no prefix before the first page; a page holding a token of 2**32 or more is hashed as
  ``SHA256(h[i-1] || 0xff || tokens as uint64 LE)``.
* :func:`lmcache_chunk_hashes` and :func:`lmcache_key`: LMCache's ``ChunkedTokenDatabase``
  (``lmcache/v1/token_database.py``) and ``CacheEngineKey.to_string`` (``lmcache/utils.py``).

Why the CBOR is written here rather than taken from ``cbor2``: the encoding needed is small (unsigned
and negative integers, byte and text strings, arrays, null: RFC 8949 §4.2.1's deterministic encoding,
which is what ``cbor2.dumps(canonical=True)`` writes for these types) and the hash is on the hot path
of every lookup: token arrays are encoded with numpy, a whole sequence at once, instead of one Python
call per token.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mcf._core.args import integer
from mcf.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["VLLM_DEFAULT_SEED", "LMCACHE_HASH_ALGORITHMS", "vllm_none_hash", "vllm_block_hashes", "vllm_extra_keys",
           "vllm_event_hash", "sglang_page_hashes", "sglang_namespace_seed", "sglang_event_hash",
           "lmcache_chunk_hashes", "lmcache_key", "cbor_dumps"]

#: the seed of vLLM's NONE_HASH when neither ``seed`` nor ``PYTHONHASHSEED`` gives one (vLLM's
#: ``DEFAULT_NONE_HASH_SEED``)
VLLM_DEFAULT_SEED = "vllm-none-hash"

#: the ``pre_caching_hash_algorithm`` values of LMCache 0.5.6 reproduced here ("builtin" is its default)
LMCACHE_HASH_ALGORITHMS = ("builtin", "sha256_cbor", "sha256")

#: LMCache's CacheEngineKey dtype names (``TORCH_DTYPE_TO_STR_DTYPE``), by the names numpy and torch use
_LMCACHE_DTYPES = {
    "float16": "half", "half": "half", "bfloat16": "bfloat16", "float32": "float", "float": "float",
    "float64": "double", "double": "double", "int8": "int8", "uint8": "uint8", "int16": "int16",
    "int32": "int32", "int64": "int64", "bool": "bool", "float8_e4m3fn": "fp8_e4m3fn",
    "fp8_e4m3fn": "fp8_e4m3fn", "float8_e4m3fnuz": "fp8_e4m3fnuz", "fp8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2", "fp8_e5m2": "fp8_e5m2", "float8_e5m2fnuz": "fp8_e5m2fnuz",
    "fp8_e5m2fnuz": "fp8_e5m2fnuz",
}

_U64 = (1 << 64) - 1


# ------------------------------------------------------------------------------------------------
# deterministic CBOR (RFC 8949 §4.2.1) of the types the engines hash
# ------------------------------------------------------------------------------------------------
def _head(major: int, n: int) -> bytes:
    """The initial byte(s) of a CBOR item of major type ``major`` and argument ``n`` (shortest form)."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n <= 0xFF:
        return bytes((m | 24, n))
    if n <= 0xFFFF:
        return bytes((m | 25,)) + n.to_bytes(2, "big")
    if n <= 0xFFFFFFFF:
        return bytes((m | 26,)) + n.to_bytes(4, "big")
    return bytes((m | 27,)) + n.to_bytes(8, "big")


def _cbor_int(v: int) -> bytes:
    if 0 <= v <= _U64:
        return _head(0, v)
    if -(1 << 64) <= v < 0:
        return _head(1, -1 - v)
    # beyond 64 bits: a bignum, tag 2 (or 3 for -1 - n) over the shortest big-endian bytes, as cbor2 writes it
    n, tag = (v, 0xC2) if v > 0 else (-1 - v, 0xC3)
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes((tag,)) + _head(2, len(body)) + body


def _cbor_into(out: list[bytes], obj: Any) -> None:
    if obj is None:
        out.append(b"\xf6")
    elif isinstance(obj, (bool, np.bool_)):
        raise ArgumentTypeError(f"a CBOR hash input must not hold booleans (got {obj!r}): an engine never hashes one")
    elif isinstance(obj, (int, np.integer)):
        out.append(_cbor_int(int(obj)))
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        out.append(_head(2, len(b)))
        out.append(b)
    elif isinstance(obj, str):
        b = obj.encode("utf-8")
        out.append(_head(3, len(b)))
        out.append(b)
    elif isinstance(obj, (tuple, list)):
        out.append(_head(4, len(obj)))
        for item in obj:
            _cbor_into(out, item)
    elif isinstance(obj, np.ndarray) and obj.ndim == 1 and obj.dtype.kind in "iu":
        out.append(_token_cbor(obj))
    else:
        raise ArgumentTypeError(f"cannot hash a {type(obj).__name__} as the engines do: a CBOR hash input holds "
                                "integers, bytes, strings, tuples or lists of them, and None")


def cbor_dumps(obj: Any) -> bytes:
    """``obj`` (None, integers, bytes, strings, and tuples or lists of them) in deterministic CBOR: the
    bytes of ``cbor2.dumps(obj, canonical=True)`` for these types."""
    out: list[bytes] = []
    _cbor_into(out, obj)
    return b"".join(out)


def _token_items(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(every token's CBOR bytes concatenated, the byte offset where each token starts plus the end),
    for a 1-D array of non-negative integers below 2**64, computed for the whole array at once."""
    v = arr.astype(np.uint64, copy=False)
    n = v.size
    be = v.astype(">u8").view(np.uint8).reshape(n, 8)
    cells = np.zeros((n, 9), np.uint8)
    w1, w2 = (v >= 24) & (v <= 0xFF), (v > 0xFF) & (v <= 0xFFFF)
    w4, w8 = (v > 0xFFFF) & (v <= 0xFFFFFFFF), v > 0xFFFFFFFF
    small = v < 24
    cells[small, 0] = v[small].astype(np.uint8)
    lengths = np.ones(n, np.int64)
    for mask, code, width in ((w1, 24, 1), (w2, 25, 2), (w4, 26, 4), (w8, 27, 8)):
        cells[mask, 0] = code
        cells[mask, 1:1 + width] = be[mask, 8 - width:]
        lengths[mask] = 1 + width
    body = cells[np.arange(9)[None, :] < lengths[:, None]]
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return body, offsets


def _token_cbor(arr: np.ndarray) -> bytes:
    """A CBOR array of the tokens in ``arr``."""
    if arr.size and (arr.dtype.kind == "i" and int(arr.min()) < 0):
        return cbor_dumps([int(t) for t in arr])
    body, _ = _token_items(arr)
    return _head(4, arr.size) + body.tobytes()


# ------------------------------------------------------------------------------------------------
# token ids
# ------------------------------------------------------------------------------------------------
def _tokens(token_ids: Any, what: str = "token_ids") -> np.ndarray | list[int]:
    """``token_ids`` as a 1-D integer array (uint64 when every id is in 0..2**64-1, int64 when some are
    negative) or, for Python integers beyond 64 bits, a list of ints.  Booleans, floats, strings and
    anything not one-dimensional are refused."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    else:
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
            raise ArgumentTypeError(f"{what} must be a 1-D sequence of integers, got {type(token_ids).__name__}")
        if hasattr(token_ids, "numpy") and hasattr(token_ids, "cpu"):  # a torch tensor
            token_ids = token_ids.cpu().numpy()
        try:
            arr = np.asarray(token_ids)
        except (OverflowError, ValueError, TypeError) as exc:
            raise InvalidArgumentError(f"{what} must be a 1-D sequence of integers: {exc}") from None
        if arr.dtype.kind == "b" or (arr.dtype.kind in "iu" and any(isinstance(t, (bool, np.bool_))
                                                                   for t in token_ids)):
            raise InvalidArgumentError(f"{what} must hold integers, not booleans")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.uint64)
    if arr.dtype == object or (arr.dtype.kind == "f" and not isinstance(token_ids, np.ndarray)):
        # Python integers numpy could not hold in one integer dtype (uint64 ids beside negative ones, or
        # beyond 64 bits): checked one by one
        vals = list(token_ids)
        for t in vals:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise InvalidArgumentError(f"{what} must hold integers only, got {t!r} ({type(t).__name__})")
        vals = [int(t) for t in vals]
        if min(vals) >= 0 and max(vals) <= _U64:
            return np.array(vals, dtype=np.uint64)
        return vals
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        return arr.astype(np.int64, copy=False)
    return arr.astype(np.uint64, copy=False)


def _positive(value: Any, what: str) -> int:
    return integer(value, what, minimum=1)


# ------------------------------------------------------------------------------------------------
# vLLM
# ------------------------------------------------------------------------------------------------
def _vllm_seed(seed: str | None) -> str:
    if seed is None:
        env = os.environ.get("PYTHONHASHSEED")
        return VLLM_DEFAULT_SEED if env is None else env
    if not isinstance(seed, str):
        raise ArgumentTypeError(f"seed must be a string (vLLM hashes PYTHONHASHSEED as text), got "
                                f"{type(seed).__name__}")
    return seed


def vllm_none_hash(*, seed: str | None = None) -> bytes:
    """vLLM's NONE_HASH for ``sha256_cbor``: ``SHA256(CBOR(seed))``, the parent of every first block.
    ``seed`` defaults to ``$PYTHONHASHSEED`` when set, else ``"vllm-none-hash"``, as vLLM's
    ``init_none_hash`` resolves it (vLLM versions before the fixed default drew a random seed unless
    PYTHONHASHSEED was set: give the engine the variable, and this function the same value)."""
    return hashlib.sha256(cbor_dumps(_vllm_seed(seed))).digest()


def vllm_extra_keys(num_tokens: int, *, block_size: int = 16, lora: tuple[str, str] | None = None,
                    mm: Sequence[tuple[str, int, int]] | None = None, cache_salt: str | None = None,
                    prompt_embeds: Any = None) -> list[tuple | None]:
    """The extra keys vLLM hashes into each full block of a request of ``num_tokens`` tokens
    (``generate_block_hash_extra_keys``), one entry per full block, None for a block with none:

    * ``lora``: ``(lora_name, lora_path)`` of the request's adapter: ``("lora", name, path)`` in every block;
    * ``mm``: the request's multimodal items as ``(identifier, offset, length)``, sorted by offset (vLLM's
      ``mm_features``): ``("mm", identifier, item offset - block start)`` in every block the item overlaps;
    * ``cache_salt``: ``("cache_salt", salt)`` in the first block only;
    * ``prompt_embeds``: the prompt's embeddings, ``[num_tokens, hidden]`` as a numpy array with the
      tensor's raw bytes (a bfloat16 tensor: ``t.view(torch.uint16).numpy()``): ``("prompt_embeds",
      sha256 of the block's rows)`` in every block.

    In vLLM's order: LoRA, multimodal, cache salt, prompt embeddings."""
    num_tokens = integer(num_tokens, "num_tokens", minimum=0)
    block_size = _positive(block_size, "block_size")
    if lora is not None:
        if (not isinstance(lora, (tuple, list)) or len(lora) != 2
                or not all(isinstance(x, str) for x in lora)):
            raise InvalidArgumentError(f"lora must be (lora_name, lora_path), two strings, got {lora!r}")
    items: list[tuple[str, int, int]] = []
    for i, it in enumerate(mm or ()):
        if not isinstance(it, (tuple, list)) or len(it) != 3 or not isinstance(it[0], str):
            raise InvalidArgumentError(f"mm[{i}] must be (identifier, offset, length), got {it!r}")
        items.append((it[0], integer(it[1], f"mm[{i}] offset", minimum=0), integer(it[2], f"mm[{i}] length",
                                                                                      minimum=1)))
    if any(a[1] > b[1] for a, b in zip(items, items[1:])):
        raise InvalidArgumentError("mm items must be sorted by offset, as vLLM's mm_features are")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ArgumentTypeError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    embeds = None
    if prompt_embeds is not None:
        embeds = np.ascontiguousarray(np.asarray(prompt_embeds))
        if embeds.ndim < 1 or embeds.shape[0] < num_tokens:
            raise InvalidArgumentError(f"prompt_embeds must hold a row per token ({num_tokens}), got shape "
                                       f"{embeds.shape}")
    out: list[tuple | None] = []
    cur = 0  # vLLM's curr_mm_idx
    for start in range(0, num_tokens - block_size + 1, block_size):
        end = start + block_size
        keys: list[tuple] = []
        if lora is not None:
            keys.append(("lora", lora[0], lora[1]))
        if items and items[-1][1] + items[-1][2] > start:  # _gen_mm_extra_hash_keys
            while cur < len(items):
                ident, offset, length = items[cur]
                if end > offset:
                    if start >= offset + length:
                        cur += 1
                        continue
                    keys.append(("mm", ident, offset - start))
                    if end >= offset + length:
                        cur += 1
                    else:
                        break
                else:
                    break
        if cache_salt and start == 0:
            keys.append(("cache_salt", cache_salt))
        if embeds is not None:
            keys.append(("prompt_embeds", hashlib.sha256(embeds[start:end].tobytes()).digest()))
        out.append(tuple(keys) if keys else None)
    return out


def vllm_block_hashes(token_ids: Any, *, block_size: int = 16, seed: str | None = None,
                      extra_keys: Any = None, parent: bytes | None = None) -> list[bytes]:
    """vLLM's block hashes of ``token_ids`` (``--prefix-caching-hash-algo sha256_cbor``): one 32-byte
    digest per full block of ``block_size`` tokens (a trailing partial block has none).

    ``seed``: as :func:`vllm_none_hash`.  ``extra_keys``: None; a mapping of :func:`vllm_extra_keys`'
    arguments (``{"lora": (name, path), "mm": [...], "cache_salt": s, "prompt_embeds": a}``); or one
    entry per full block, each None or the tuple of tagged keys vLLM hashes with that block.
    ``parent``: the digest of the block before ``token_ids`` (to continue a chain), default NONE_HASH."""
    block_size = _positive(block_size, "block_size")
    toks = _tokens(token_ids)
    nblocks = len(toks) // block_size
    if extra_keys is None:
        extras: list = [None] * nblocks
    elif isinstance(extra_keys, Mapping):
        unknown = set(extra_keys) - {"lora", "mm", "cache_salt", "prompt_embeds"}
        if unknown:
            raise InvalidArgumentError(f"unknown extra key kind(s) {sorted(unknown)}: vLLM hashes lora, mm, "
                                       "cache_salt and prompt_embeds")
        extras = vllm_extra_keys(len(toks), block_size=block_size, **extra_keys)
    else:
        extras = list(extra_keys)
        if len(extras) < nblocks:
            raise InvalidArgumentError(f"extra_keys has {len(extras)} entries for {nblocks} full blocks")
        for i, e in enumerate(extras[:nblocks]):
            if e is not None and not isinstance(e, tuple):
                raise InvalidArgumentError(f"extra_keys[{i}] must be None or a tuple of keys, got {type(e).__name__}")
    if parent is None:
        prev = vllm_none_hash(seed=seed)
    elif isinstance(parent, (bytes, bytearray)) and len(parent) == 32:
        prev = bytes(parent)
    else:
        raise InvalidArgumentError("parent must be a 32-byte digest")
    if nblocks == 0:
        return []
    arr_head = _head(4, block_size)
    if isinstance(toks, np.ndarray) and toks.dtype == np.uint64:
        body, offsets = _token_items(toks[:nblocks * block_size])
        raw = body.tobytes()
        spans = [(int(offsets[i * block_size]), int(offsets[(i + 1) * block_size])) for i in range(nblocks)]
        blocks = [arr_head + raw[a:b] for a, b in spans]
    else:
        blocks = [cbor_dumps([int(t) for t in toks[i * block_size:(i + 1) * block_size]]) for i in range(nblocks)]
    out = []
    for i in range(nblocks):
        e = extras[i]
        tail = b"\xf6" if e is None else cbor_dumps(e)
        prev = hashlib.sha256(b"\x83\x58\x20" + prev + blocks[i] + tail).digest()
        out.append(prev)
    return out


def vllm_event_hash(digest: bytes) -> int:
    """The 64-bit form of a block hash in vLLM's KV events (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``,
    the default): the digest's last 8 bytes as a big-endian unsigned integer."""
    if not isinstance(digest, (bytes, bytearray)) or not digest:
        raise InvalidArgumentError("digest must be a non-empty bytes object")
    return int.from_bytes(digest, "big") & _U64


# ------------------------------------------------------------------------------------------------
# SGLang HiCache
# ------------------------------------------------------------------------------------------------
def sglang_namespace_seed(*, extra_key: str | None = None, cache_salt: str | None = None) -> str | None:
    """The prior hash SGLang seeds a request's storage chain with (``storage_namespace_seed``): None when
    the request has neither an ``extra_key`` nor a ``cache_salt``."""
    if extra_key is None and cache_salt is None:
        return None
    h = hashlib.sha256(b"sglang-cache-namespace-v1")
    for name, part in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if part is None:
            h.update(b"\x00")
            continue
        if not isinstance(part, str):
            raise ArgumentTypeError(f"{name} must be a string, got {type(part).__name__}")
        enc = part.encode("utf-8")
        h.update(b"\x01" + len(enc).to_bytes(8, "little") + enc)
    return h.hexdigest()


def sglang_page_hashes(token_ids: Any, *, page_size: int = 64, prior: str | None = None) -> list[str]:
    """SGLang HiCache's page hashes of ``token_ids`` (``get_hash_str(token_ids, prior, page_size)``):
    64 hex digits per page, chained from ``prior`` (a page hash, or :func:`sglang_namespace_seed`; None
    or "" for none).  Like SGLang, a trailing partial page gets a hash too: give whole pages for keys
    HiCache stores.  Token ids must be in 0..2**63-1 (SGLang's range); a page with one of 2**32 or
    more is hashed in SGLang's wide form (a 0xff byte, then uint64 LE tokens)."""
    page_size = _positive(page_size, "page_size")
    toks = _tokens(token_ids)
    if isinstance(toks, list) or toks.dtype != np.uint64 or (toks.size and int(toks.max()) > (1 << 63) - 1):
        raise InvalidArgumentError("SGLang hashes token ids in 0..2**63-1 only")
    if prior:
        if not isinstance(prior, str):
            raise ArgumentTypeError(f"prior must be a hex string, got {type(prior).__name__}")
        try:
            prev = bytes.fromhex(prior)
        except ValueError:
            raise InvalidArgumentError(f"prior must be hex digits, got {prior[:80]!r}") from None
        if len(prev) != 32:
            raise InvalidArgumentError(f"prior must be 64 hex digits (32 bytes), got {len(prev)} bytes")
    else:
        prev = b""
    out = []
    for start in range(0, toks.size, page_size):
        page = toks[start:start + page_size]
        if page.size and int(page.max()) > 0xFFFFFFFF:
            data = b"\xff" + page.astype("<u8").tobytes()
        else:
            data = page.astype("<u4").tobytes()
        prev = hashlib.sha256(prev + data).digest()
        out.append(prev.hex())
    return out


def sglang_event_hash(page_hash: str) -> int:
    """The signed 64-bit form of a page hash in SGLang's KV events (``hash_str_to_int64``): its first
    16 hex digits as a two's-complement integer."""
    if not isinstance(page_hash, str) or len(page_hash) < 16:
        raise InvalidArgumentError("page_hash must be a hex string of at least 16 digits")
    try:
        v = int(page_hash[:16], 16)
    except ValueError:
        raise InvalidArgumentError(f"page_hash must be hex digits, got {page_hash[:80]!r}") from None
    return v - (1 << 64) if v >= 1 << 63 else v


# ------------------------------------------------------------------------------------------------
# LMCache
# ------------------------------------------------------------------------------------------------
def _lmcache_fn(algorithm: str):
    if algorithm in ("sha256_cbor", "sha256_cbor_64bit"):
        return lambda obj: hashlib.sha256(cbor_dumps(obj)).digest()
    if algorithm == "sha256":
        return lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    if algorithm == "builtin":
        return hash
    raise InvalidArgumentError(f"hash_algorithm must be one of {', '.join(LMCACHE_HASH_ALGORITHMS)} (LMCache's "
                               f"pre_caching_hash_algorithm), got {algorithm!r}")


def _as_int(h: int | bytes) -> int:
    """LMCache's ``_normalize_hash_to_int``: a digest's first 8 bytes, big-endian."""
    return int.from_bytes(h[:8], "big") if isinstance(h, bytes) else h


def lmcache_chunk_hashes(token_ids: Any, *, chunk_size: int = 256, hash_algorithm: str = "sha256_cbor",
                         seed: str | None = None, none_hash: int | None = None,
                         save_unfull_chunk: bool = False) -> list[int]:
    """LMCache's chunk hashes of ``token_ids`` (``ChunkedTokenDatabase.process_tokens(make_key=False)``):
    ``h[i] = first 8 bytes (big-endian) of H((h[i-1], tuple(chunk i), ()))``, from ``h[-1] = NONE_HASH``.

    ``hash_algorithm`` is LMCache's ``pre_caching_hash_algorithm``: "sha256_cbor" (portable: configure it
    for a store shared by processes), "sha256" (SHA-256 of a pickle) or "builtin" (Python's ``hash()``
    of the tuple, LMCache's default: its NONE_HASH is ``hash(seed)``, a string hash, so it is
    reproducible only by a process started with the same ``PYTHONHASHSEED`` as the engine).
    ``none_hash``: LMCache's NONE_HASH when it is not derived as with vLLM installed beside LMCache (its
    first 8 bytes of vLLM's NONE_HASH for the same algorithm, from ``seed`` as
    :func:`vllm_none_hash`): 0 when LMCache runs without vLLM (and then hashes with "builtin" whatever
    it is configured with).  ``save_unfull_chunk``: hash a trailing partial chunk too (LMCache's option
    of that name, default False)."""
    chunk_size = _positive(chunk_size, "chunk_size")
    fn = _lmcache_fn(hash_algorithm)
    if not isinstance(save_unfull_chunk, bool):
        raise ArgumentTypeError(f"save_unfull_chunk must be True or False, got {save_unfull_chunk!r}")
    if none_hash is None:
        prev = _as_int(fn(_vllm_seed(seed)))
    else:
        prev = integer(none_hash, "none_hash")
    toks = _tokens(token_ids)
    vals = toks.tolist() if isinstance(toks, np.ndarray) else toks
    end = len(vals) if save_unfull_chunk else len(vals) - len(vals) % chunk_size
    out = []
    for start in range(0, end, chunk_size):
        prev = _as_int(fn((prev, tuple(vals[start:start + chunk_size]), ())))
        out.append(prev)
    return out


def lmcache_key(model_name: str, world_size: int, worker_id: int, chunk_hash: int, dtype: Any, *,
                tags: Mapping[str, str] | None = None) -> str:
    """LMCache's ``CacheEngineKey(...).to_string()``: ``model@world_size@worker_id@<hash hex>@<dtype>``
    (the hash in lowercase hex without padding, a minus sign for a negative "builtin" hash), then
    ``@name%value`` per tag (the ``lmcache.tag.*`` request configs, in their order).  ``dtype``: a
    numpy or torch dtype, or its name ("float16", "bfloat16", ... or LMCache's own, "half")."""
    if not isinstance(model_name, str) or not model_name:
        raise InvalidArgumentError("model_name must be a non-empty string")
    world_size = integer(world_size, "world_size", minimum=1)
    worker_id = integer(worker_id, "worker_id", minimum=0)
    chunk_hash = integer(chunk_hash, "chunk_hash")
    name = str(dtype).removeprefix("torch.")
    if not isinstance(dtype, str):
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in _LMCACHE_DTYPES:
        raise InvalidArgumentError(f"dtype {dtype!r} has no LMCache name (known: {', '.join(sorted(_LMCACHE_DTYPES))})")
    s = f"{model_name}@{world_size}@{worker_id}@{chunk_hash:x}@{_LMCACHE_DTYPES[name]}"
    for k, v in (tags or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ArgumentTypeError("tags must map strings to strings")
        s += f"@{k}%{v}"
    return s
