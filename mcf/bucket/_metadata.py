"""A committed context's documents: ``metadata.json`` (seed 003 §3.1: what the context is, what computed it,
where and how its KV data is stored, its timestamps and access counts) and ``.verified.json`` (the
record of the last complete check of its ``kv_data.mcb``, for ``verify="once"``).

Everything read from a bucket directory is untrusted: :func:`read_metadata` refuses a context directory,
metadata.json or kv_data.mcb that is not what it claims (a planted link, FIFO or device), and
:func:`validate_metadata` checks every field the bucket relies on, so a damaged or hand-edited document is a
FormatError that names the file and the field, never a KeyError or a wrong answer.  :func:`new_metadata`
is the document an ingest writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcf.bucket import _layout as L
from mcf.bucket._crypto import KEY_ID_RE
from mcf.bucket._fs import BucketFS, refusal
from mcf.bucket._json import MAX_DOC_BYTES, dumps, get_field, iso, parse_iso, parse_json
from mcf.bucket._names import KV_NAME, META_NAME, VERIFIED_NAME, check_model_id, ctx_rel
from mcf.errors import ContextNotFoundError, FormatError, InvalidArgumentError, MCFError, MCFIOError, os_error

if TYPE_CHECKING:
    from mcf.bucket.kvfile import KVHeader

__all__ = ["metadata_stamp", "new_metadata", "read_metadata", "read_verified", "unlinked", "validate_metadata",
           "write_metadata", "write_verified"]


def read_metadata(fs: BucketFS, context_id: str) -> dict:
    """The validated metadata.json of a committed context.  The context directory, metadata.json and
    kv_data.mcb must be what they claim (no link, FIFO or device: FormatError); a missing one is
    ContextNotFoundError."""
    rel = ctx_rel(context_id)
    p = fs.where(f"{rel}/{META_NAME}")
    try:
        with fs.dir(rel) as d:
            try:
                kv = os.stat(KV_NAME, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                if unlinked(fs, rel, d):  # a delete moved the directory away while it was read
                    raise ContextNotFoundError(f"no context {context_id!r} in {fs.root}") from None
                raise FormatError("kv_data.mcb is missing", path=fs.where(rel)) from None
            if not stat.S_ISREG(kv.st_mode):
                raise FormatError(refusal(kv.st_mode), path=fs.where(f"{rel}/{KV_NAME}"))
            raw = fs.read_at(d, META_NAME, limit=MAX_DOC_BYTES, rel=f"{rel}/{META_NAME}")
    except FileNotFoundError:
        raise ContextNotFoundError(f"no context {context_id!r} in {fs.root}") from None
    except OSError as exc:
        raise os_error(exc, p) from None
    meta = parse_json(raw, p)
    validate_metadata(meta, p, context_id)
    return meta


def unlinked(fs: BucketFS, rel: str, dir_fd: int) -> bool:
    """True when the directory open as ``dir_fd`` is no longer the one at ``rel``."""
    st, here = fs.lstat(rel), os.fstat(dir_fd)
    return st is None or (st.st_dev, st.st_ino) != (here.st_dev, here.st_ino)


def validate_metadata(meta: Any, p: Path, context_id: str) -> None:
    """FormatError (naming ``p`` and the field) unless ``meta`` is the metadata.json of ``context_id``
    with every field the bucket reads, of its type."""
    if get_field(meta, p, "context_id", types=str) != context_id:
        raise FormatError("context_id disagrees with its directory", path=p, field="context_id",
                          expected=context_id, got=meta["context_id"])
    check_model_id(get_field(meta, p, "model_id", types=str))
    get_field(meta, p, "content", "name", types=(str, type(None)))
    get_field(meta, p, "content", "hash", types=str)
    get_field(meta, p, "content", "token_count", types=int)
    for k in ("num_layers", "num_kv_heads", "head_dim", "sequence_length"):
        get_field(meta, p, "kv_cache", "shape", k, types=int)
    dt = get_field(meta, p, "kv_cache", "dtype", types=str)
    try:
        L.parse_dtype(dt)
    except InvalidArgumentError:
        raise FormatError("unknown dtype", path=p, field="kv_cache.dtype", got=dt) from None
    get_field(meta, p, "kv_cache", "size_bytes", types=int)
    get_field(meta, p, "storage", "checksum", types=str)
    kid = meta["kv_cache"].get("key_id")
    if kid is not None and (not isinstance(kid, str) or not KEY_ID_RE.fullmatch(kid)):
        raise FormatError("not a key id", path=p, field="kv_cache.key_id", expected="32 lowercase hex digits",
                          got=str(kid)[:40])
    get_field(meta, p, "timestamps", "created_at", types=str)
    get_field(meta, p, "timestamps", "last_accessed", types=str)
    get_field(meta, p, "timestamps", "expires_at", types=(str, type(None)))
    parse_iso(meta["timestamps"]["expires_at"], p, "timestamps.expires_at")
    get_field(meta, p, "access", "count", types=int)
    pre = meta.get("prefix")
    if pre is not None:
        get_field(meta, p, "prefix", "chunk_tokens", types=int)
        if not all(isinstance(h, str) for h in get_field(meta, p, "prefix", "hashes", types=list)):
            raise FormatError("prefix hashes must be strings", path=p, field="prefix.hashes")
    # what computed the KV data (written since the model block exists; absent or null in older
    # buckets): its fields decide compatibility and staleness, so a mistyped one is refused, not compared
    maker = meta.get("model")
    if maker is not None:
        if not isinstance(maker, dict):
            raise FormatError("wrong type", path=p, field="model", expected="an object or null",
                              got=type(maker).__name__)
        for k, kinds in (("architecture", str), ("vocab_size", int), ("model_hash", str)):
            v = maker.get(k)
            if v is not None and (not isinstance(v, kinds) or isinstance(v, bool)):
                raise FormatError("wrong type", path=p, field=f"model.{k}", expected=f"{kinds.__name__} or null",
                                  got=type(v).__name__)
        if maker.get("vocab_size") is not None and maker["vocab_size"] < 1:
            raise FormatError("vocab_size must be positive", path=p, field="model.vocab_size",
                              got=maker["vocab_size"])


def new_metadata(context_id: str, model_id: str, *, name: str | None, source: str | None, chash: str,
                 shape: L.KVShape, dtype: L.KVDType, compression: L.Compression, header: KVHeader,
                 key_id: str | None, now: float, ttl: float | None, pinned: bool, prefix: dict | None,
                 model: dict | None) -> dict:
    """The metadata.json an ingest writes beside the ``kv_data.mcb`` it wrote (``header``), at ``now``;
    ``key_id`` is the id of the key the data is encrypted with (None when it is in clear)."""
    return {
        "context_id": context_id,
        "model_id": model_id,
        "version": 1,
        "content": {"name": name, "source": source, "hash": chash, "token_count": shape.sequence_length},
        "kv_cache": {
            "format": "mcb-v1",
            "shape": {"num_layers": shape.num_layers, "num_heads": shape.num_kv_heads,
                      "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                      "sequence_length": shape.sequence_length},
            "dtype": L.DTYPE_NAMES[dtype],
            "size_bytes": L.HEADER_SIZE + header.compressed_size,
            "original_size": header.original_size,
            "compressed": compression != L.Compression.NONE,
            "compression": L.COMPRESSION_NAMES[compression],
            "chunked": header.chunked,
            "encrypted": header.encrypted,
            "key_id": key_id,
        },
        "storage": {"tier": "cold", "path": f"contexts/{context_id}/{KV_NAME}",
                    "checksum": f"crc32:{header.checksum:08x}"},
        "timestamps": {"created_at": iso(now), "last_accessed": iso(now),
                       "expires_at": None if ttl is None else iso(now + ttl)},
        "access": {"count": 0, "last_query": None},
        "pinned": bool(pinned),
        "prefix": prefix,
        "model": model,
    }


def write_metadata(fs: BucketFS, meta: dict, *, durable: bool = True) -> None:
    """Replace a committed context's metadata.json (caller holds the lock).  Access statistics are
    written without fsync (``durable=False``): a crash may lose the last counts, never the file."""
    fs.write_atomic(f"{ctx_rel(meta['context_id'])}/{META_NAME}", dumps(meta, False), durable=durable)


def metadata_stamp(fs: BucketFS, context_id: str) -> list[int] | None:
    """[inode, mtime_ns, size] of the context's metadata.json (what :meth:`mcf.bucket.Bucket.scan`
    compares with the registry's stamp); None when it cannot be looked at."""
    try:
        st = fs.lstat(f"{ctx_rel(context_id)}/{META_NAME}")
    except (FormatError, MCFIOError):
        return None
    return None if st is None else [st.st_ino, st.st_mtime_ns, st.st_size]


# -- the "once" verification record ---------------------------------------------------------------------
def read_verified(fs: BucketFS, context_id: str) -> tuple | None:
    """The (identity, checksum) recorded in the context's .verified.json by the last process that
    checked its kv_data.mcb completely; None when absent, unreadable, too large or not a regular
    file."""
    try:
        doc = json.loads(fs.read(f"{ctx_rel(context_id)}/{VERIFIED_NAME}", limit=4096))
        ident = tuple(doc["identity"])
        if len(ident) != 5 or not all(isinstance(x, int) for x in ident) or not isinstance(doc["checksum"], int):
            return None
        return (ident, doc["checksum"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def write_verified(fs: BucketFS, context_id: str, rec: tuple, *, now: float) -> None:
    """Record a complete, successful check so other processes with verify="once" can skip it.  A
    cache: written atomically without fsync, and a bucket that cannot be written just goes without."""
    doc = {"identity": list(rec[0]), "checksum": rec[1], "verified_at": iso(now)}
    with contextlib.suppress(MCFError, OSError):
        fs.write_atomic(f"{ctx_rel(context_id)}/{VERIFIED_NAME}", dumps(doc, False), durable=False)
