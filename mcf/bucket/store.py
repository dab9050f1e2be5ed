"""The bucket directory: contexts on disk, the registry that indexes them, and the operations of
seed 003 §4 (ingest, discover, lookup, load, delete, gc, rebuild)::

    <root>/
      registry.json               cache of every context's summary, grouped by model (rebuild() recreates it)
      models/<model_id>.json      model identity and compatibility (architecture, layers, kv heads, head_dim)
      contexts/<context_id>/      one committed context
        metadata.json             seed 003 §3.1 fields
        kv_data.mcb               the KV cache (mcf.bucket.kvfile)
      .lock                       flock'ed by every writer

Why the design:

* **Ids come from content** (model id, content hash, dtype, shape), so the same content is found again
  after a restart and ingesting it twice stores it once.  Ids are ``ctx_`` + 32 hex digits and nothing
  else is accepted, so an id can never name a path outside the bucket.
* **The commit point is one rename.**  A context is written into ``contexts/.tmp-*`` (each file fsynced),
  then the directory is renamed to its id and ``contexts/`` fsynced.  A crash before the rename leaves
  only a temp directory nobody lists (``gc`` removes old ones); a crash after it leaves a committed
  context that ``rebuild()`` puts back into the registry.
* **The registry is a cache.**  It is rewritten atomically (temp + fsync + rename) under the lock; when
  it is missing or unreadable it is rebuilt from ``contexts/``.  Nothing committed depends on it.
* **Writers are serialized with ``fcntl.flock``** on ``.lock``; the KV data itself is written before the
  lock is taken, so concurrent ingests only queue for the rename and the registry update.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from mcf.bucket import _layout as L
from mcf.bucket.kvfile import KVFile, open_kv, write_kv
from mcf.errors import (
    ContextNotFoundError,
    FormatError,
    InvalidArgumentError,
    MCFIOError,
    os_error,
)

__all__ = ["Bucket", "content_hash", "context_id_for"]

REGISTRY_VERSION = "1.0"
KV_NAME = "kv_data.mcb"
META_NAME = "metadata.json"
_CTX_RE = re.compile(r"^ctx_[0-9a-f]{32}$")
_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: temp directories older than this are considered abandoned by a crashed writer and removed by gc()
STALE_TMP_SECONDS = 3600.0


# ------------------------------------------------------------------------------------------------
# ids and hashes
# ------------------------------------------------------------------------------------------------
def check_model_id(model_id: Any) -> str:
    if not isinstance(model_id, str) or not _MODEL_RE.fullmatch(model_id) or ".." in model_id:
        raise InvalidArgumentError(
            f"invalid model id {model_id!r}: 1-128 characters of letters, digits, '.', '_', '-', "
            "starting with a letter or digit, no '..'")
    return model_id


def check_context_id(context_id: Any) -> str:
    if not isinstance(context_id, str) or not _CTX_RE.fullmatch(context_id):
        raise InvalidArgumentError(f"invalid context id {context_id!r}: expected 'ctx_' and 32 lowercase hex digits")
    return context_id


def content_hash(content: str | bytes | None = None, token_ids: Sequence[int] | np.ndarray | None = None) -> str:
    """``sha256:<hex>`` of the text (UTF-8) or of the token ids (as little-endian int64); the two
    kinds are domain-separated so a text never collides with a token list."""
    if (content is None) == (token_ids is None):
        raise InvalidArgumentError("give exactly one of content or token_ids")
    h = hashlib.sha256()
    if token_ids is not None:
        arr = np.asarray(token_ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise InvalidArgumentError("token_ids must be a 1-D sequence of integers")
        h.update(b"tokens\0")
        h.update(arr.astype("<i8").tobytes())
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


def prefix_hashes(model_id: str, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int = PREFIX_CHUNK_TOKENS) -> list[str]:
    """Chained hashes of the full ``chunk_tokens``-token chunks of ``token_ids``: ``h[i] =
    sha256(h[i-1] || tokens of chunk i as int64 LE)[:32 hex]``, starting from a hash of the model id
    and the chunk size.  Equal ``h[i]`` means equal first ``(i+1) * chunk_tokens`` tokens."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise InvalidArgumentError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgumentError("token_ids must be a 1-D sequence of integers")
    arr = arr.astype("<i8")
    prev = hashlib.sha256(f"mcb-prefix\0{model_id}\0{chunk_tokens}".encode()).digest()
    out = []
    for i in range(arr.size // chunk_tokens):
        prev = hashlib.sha256(prev + arr[i * chunk_tokens:(i + 1) * chunk_tokens].tobytes()).digest()
        out.append(prev[:16].hex())
    return out


# ------------------------------------------------------------------------------------------------
# small file-system helpers
# ------------------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj: Any, *, durable: bool = True) -> None:
    """Replace ``path`` atomically (temp + rename); ``durable`` also fsyncs the file and its directory
    (skipped only for access statistics, which may be lost in a crash but never half-written)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1, sort_keys=False)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            _fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise os_error(exc, path) from exc


def _read_json(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise os_error(exc, path) from exc
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"malformed JSON: {exc}", path=path) from None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_iso(s: Any, path: Path, field: str) -> float | None:
    if s is None:
        return None
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except (AttributeError, TypeError, ValueError):
        raise FormatError("not an ISO 8601 timestamp", path=path, field=field, got=s) from None


def _get(obj: Any, path: Path, *keys: str, types: type | tuple[type, ...] = object) -> Any:
    """``obj[k0][k1]...`` with a FormatError naming the field when a level is missing or mistyped."""
    cur = obj
    for i, k in enumerate(keys):
        if not isinstance(cur, dict) or k not in cur:
            raise FormatError("missing field", path=path, field=".".join(keys[: i + 1]))
        cur = cur[k]
    if not isinstance(cur, types) or (isinstance(cur, bool) and types is int):
        raise FormatError("wrong type", path=path, field=".".join(keys), expected=str(types), got=type(cur).__name__)
    return cur


# ------------------------------------------------------------------------------------------------
# the bucket
# ------------------------------------------------------------------------------------------------
class Bucket:
    """A bucket directory.  ``clock`` (seconds since the epoch) is injectable so TTLs can be tested.

    >>> b = Bucket("/data/mcb")                                                # doctest: +SKIP
    >>> info = b.ingest("llama-3-8b", layers, content="The pathophysiology of diabetes...")
    >>> [c["context_id"] for c in b.discover("llama-3-8b")]
    >>> layers = b.load(info["context_id"])                                     # [(K, V), ...]
    """

    def __init__(self, root: str | os.PathLike, *, clock: Callable[[], float] = time.time, create: bool = True,
                 prefix_chunk_tokens: int = PREFIX_CHUNK_TOKENS, warm_budget_bytes: int = 1 << 30) -> None:
        from mcf.bucket.tiers import WarmCache

        self._warm = WarmCache(warm_budget_bytes)
        self._hot: dict[str, tuple[Any, list[tuple[Any, Any]]]] = {}
        self.root = Path(root)
        self.clock = clock
        prefix_hashes("m", [], prefix_chunk_tokens)  # validates the chunk size
        self.prefix_chunk_tokens = prefix_chunk_tokens
        self._subscribers: list[Callable[[dict], None]] = []
        self._cache: dict | None = None
        self._cache_stamp: tuple | None = None
        try:
            if create:
                (self.root / "contexts").mkdir(parents=True, exist_ok=True)
                (self.root / "models").mkdir(exist_ok=True)
            elif not (self.root / "contexts").is_dir():
                raise InvalidArgumentError(f"{self.root} is not a bucket (no contexts/ directory)")
        except OSError as exc:
            raise os_error(exc, self.root) from exc

    # -- paths ---------------------------------------------------------------------------------------
    @property
    def registry_path(self) -> Path:
        return self.root / "registry.json"

    def _ctx_dir(self, context_id: str) -> Path:
        return self.root / "contexts" / check_context_id(context_id)

    def _model_path(self, model_id: str) -> Path:
        return self.root / "models" / f"{check_model_id(model_id)}.json"

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        try:
            fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise os_error(exc, self.root / ".lock") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    # -- events --------------------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[dict], None]) -> Callable[[], None]:
        """Call ``callback(event)`` for every event of seed 003 §6.2 this object emits; returns an
        unsubscribe function."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def _emit(self, event: str, **fields: Any) -> None:
        ev = {"event": event, **fields, "timestamp": _iso(self.clock())}
        for cb in list(self._subscribers):
            cb(ev)

    # -- models --------------------------------------------------------------------------------------
    def register_model(self, model_id: str, *, architecture: str | None = None, num_layers: int | None = None,
                       num_kv_heads: int | None = None, head_dim: int | None = None, dtype: str | None = None,
                       model_hash: str | None = None) -> dict:
        """Record a model's identity and the shape its contexts must have (checked at ingest and load)."""
        compat = {"architecture": architecture, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
                  "head_dim": head_dim, "dtype": None if dtype is None else L.DTYPE_NAMES[L.parse_dtype(dtype)]}
        for k in ("num_layers", "num_kv_heads", "head_dim"):
            v = compat[k]
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise InvalidArgumentError(f"{k} must be a non-negative integer, got {v!r}")
        doc = {"model_id": check_model_id(model_id), "model_hash": model_hash, "created_at": _iso(self.clock()),
               "model_compatibility": compat}
        with self._lock():
            _write_json_atomic(self._model_path(model_id), doc)
        return doc

    def model(self, model_id: str) -> dict | None:
        """The model document, or None when the model was never registered."""
        p = self._model_path(model_id)
        try:
            doc = _read_json(p)
        except FileNotFoundError:
            return None
        _get(doc, p, "model_compatibility", types=dict)
        return doc

    def check_compatible(self, context_id: str, model: dict | str) -> None:
        """Raise InvalidArgumentError unless the context's shape and dtype match ``model`` (a model id
        registered in this bucket or a compatibility dict)."""
        meta = self.lookup(context_id)
        if isinstance(model, str):
            doc = self.model(model)
            if doc is None:
                raise ContextNotFoundError(f"unknown model {model!r}")
            if doc["model_id"] != meta["model_id"]:
                raise InvalidArgumentError(f"{context_id} belongs to model {meta['model_id']!r}, not {model!r}")
            model = doc["model_compatibility"]
        shape, dtype = meta["kv_cache"]["shape"], meta["kv_cache"]["dtype"]
        have = {"num_layers": shape["num_layers"], "num_kv_heads": shape["num_kv_heads"], "head_dim": shape["head_dim"],
                "dtype": dtype, "architecture": meta.get("architecture")}
        for k, want in model.items():
            if k in have and want is not None and k != "architecture" and have[k] != want:
                raise InvalidArgumentError(f"{context_id} is incompatible: {k} is {have[k]!r}, the model needs {want!r}")

    # -- registry ------------------------------------------------------------------------------------
    def _empty_registry(self) -> dict:
        now = _iso(self.clock())
        return {"mcrp_version": REGISTRY_VERSION, "created_at": now, "last_updated": now, "models": [],
                "statistics": {}}

    @staticmethod
    def _summary(meta: dict) -> dict:
        return {
            "context_id": meta["context_id"],
            "name": meta["content"]["name"],
            "token_count": meta["content"]["token_count"],
            "size_bytes": meta["kv_cache"]["size_bytes"],
            "last_accessed": meta["timestamps"]["last_accessed"],
            "expires_at": meta["timestamps"]["expires_at"],
            "pinned": meta.get("pinned", False),
            "dtype": meta["kv_cache"]["dtype"],
            "prefix": meta.get("prefix"),
        }

    @staticmethod
    def _restat(reg: dict) -> dict:
        ctxs = [c for m in reg["models"] for c in m["contexts"]]
        reg["statistics"] = {
            "total_models": len(reg["models"]),
            "total_contexts": len(ctxs),
            "total_storage_bytes": sum(c["size_bytes"] for c in ctxs),
            "total_tokens": sum(c["token_count"] for c in ctxs),
        }
        return reg

    def _read_registry_locked(self) -> dict:
        """The registry from disk; rebuilt from contexts/ when missing or unreadable (caller holds the lock)."""
        try:
            reg = _read_json(self.registry_path)
            self._validate_registry(reg)
            return reg
        except (FileNotFoundError, FormatError):
            return self._rebuild_locked()

    def _validate_registry(self, reg: Any) -> None:
        p = self.registry_path
        for i, m in enumerate(_get(reg, p, "models", types=list)):
            check = {"models": m}
            _get(check, p, "models", "model_id", types=str)
            for c in _get(check, p, "models", "contexts", types=list):
                for k, t in (("context_id", str), ("name", (str, type(None))), ("token_count", int),
                             ("size_bytes", int)):
                    _get({"c": c}, p, "c", k, types=t)
                if not _CTX_RE.fullmatch(c["context_id"]):
                    raise FormatError("invalid context id in registry", path=p, field=f"models[{i}]", got=c["context_id"])

    def _write_registry_locked(self, reg: dict) -> None:
        reg["last_updated"] = _iso(self.clock())
        self._restat(reg)
        _write_json_atomic(self.registry_path, reg)
        self._cache = None

    def _registry(self) -> dict:
        """The cached registry, reloaded when registry.json changed on disk (another process wrote it)."""
        try:
            st = os.stat(self.registry_path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if self._cache is None or stamp is None or stamp != self._cache_stamp:
            with self._lock():
                reg = self._read_registry_locked()
                st = os.stat(self.registry_path)
                self._cache_stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            self._cache = reg
            # prefix index: chained chunk hash -> [(context id, tokens covered)], per model
            index: dict[tuple[str, str], list[tuple[str, int]]] = {}
            for m in reg["models"]:
                for c in m["contexts"]:
                    pre = c.get("prefix")
                    if (isinstance(pre, dict) and pre.get("chunk_tokens") == self.prefix_chunk_tokens
                            and isinstance(pre.get("hashes"), list)):
                        for i, h in enumerate(pre["hashes"]):
                            if isinstance(h, str):
                                index.setdefault((m["model_id"], h), []).append((c["context_id"], (i + 1) * self.prefix_chunk_tokens))
            self._prefix_index = index
        return self._cache

    def registry(self) -> dict:
        """The registry document of seed 003 §3.2 (models, their contexts, statistics)."""
        return json.loads(json.dumps(self._registry()))

    def _registry_put(self, reg: dict, model_id: str, summary: dict | None, remove: str | None = None) -> None:
        for m in reg["models"]:
            m["contexts"] = [c for c in m["contexts"] if c["context_id"] not in (remove, summary and summary["context_id"])]
        reg["models"] = [m for m in reg["models"] if m["contexts"] or m["model_id"] == model_id and summary]
        if summary is not None:
            for m in reg["models"]:
                if m["model_id"] == model_id:
                    m["contexts"].append(summary)
                    break
            else:
                doc = self.model(model_id) or {}
                reg["models"].append({"model_id": model_id, "model_hash": doc.get("model_hash"), "contexts": [summary]})

    # -- metadata ------------------------------------------------------------------------------------
    def _read_meta(self, context_id: str) -> dict:
        d = self._ctx_dir(context_id)
        p = d / META_NAME
        self._no_symlinks(d, p, d / KV_NAME)
        try:
            meta = _read_json(p)
        except FileNotFoundError:
            raise ContextNotFoundError(f"no context {context_id!r} in {self.root}") from None
        self._validate_meta(meta, p, context_id)
        return meta

    @staticmethod
    def _no_symlinks(*paths: Path) -> None:
        """A planted symlink must not make the bucket read or delete files outside its root."""
        for q in paths:
            if q.is_symlink():
                raise FormatError("symbolic links are not followed inside a bucket", path=q)

    @staticmethod
    def _validate_meta(meta: Any, p: Path, context_id: str) -> None:
        if _get(meta, p, "context_id", types=str) != context_id:
            raise FormatError("context_id disagrees with its directory", path=p, field="context_id",
                              expected=context_id, got=meta["context_id"])
        check_model_id(_get(meta, p, "model_id", types=str))
        _get(meta, p, "content", "name", types=(str, type(None)))
        _get(meta, p, "content", "hash", types=str)
        _get(meta, p, "content", "token_count", types=int)
        for k in ("num_layers", "num_kv_heads", "head_dim", "sequence_length"):
            _get(meta, p, "kv_cache", "shape", k, types=int)
        dt = _get(meta, p, "kv_cache", "dtype", types=str)
        try:
            L.parse_dtype(dt)
        except InvalidArgumentError:
            raise FormatError("unknown dtype", path=p, field="kv_cache.dtype", got=dt) from None
        _get(meta, p, "kv_cache", "size_bytes", types=int)
        _get(meta, p, "timestamps", "created_at", types=str)
        _get(meta, p, "timestamps", "last_accessed", types=str)
        _get(meta, p, "timestamps", "expires_at", types=(str, type(None)))
        _parse_iso(meta["timestamps"]["expires_at"], p, "timestamps.expires_at")
        _get(meta, p, "access", "count", types=int)
        pre = meta.get("prefix")
        if pre is not None:
            _get(meta, p, "prefix", "chunk_tokens", types=int)
            if not all(isinstance(h, str) for h in _get(meta, p, "prefix", "hashes", types=list)):
                raise FormatError("prefix hashes must be strings", path=p, field="prefix.hashes")

    def _expired(self, summary_or_meta: dict, now: float) -> bool:
        ts = summary_or_meta.get("timestamps", summary_or_meta)
        exp = ts.get("expires_at")
        if exp is None or summary_or_meta.get("pinned", False):
            return False
        return _parse_iso(exp, self.registry_path, "expires_at") <= now

    # -- operations ----------------------------------------------------------------------------------
    def ingest(self, model_id: str, layers: Sequence[Sequence[Any]], *, content: str | bytes | None = None,
               token_ids: Sequence[int] | np.ndarray | None = None, name: str | None = None,
               source: str | None = None, dtype: Any = "float16", compression: Any = "lz4",
               ttl: float | None = None, pinned: bool = False, threads: int = 1) -> dict:
        """Store a context: ``layers[i] = (K, V)`` of shape [num_kv_heads, tokens, head_dim], for the text
        ``content`` or its ``token_ids``.  Returns the metadata (with ``"deduplicated": True`` when the
        same context was already stored; its data is then left as it was)."""
        check_model_id(model_id)
        chash = content_hash(content, token_ids)
        if ttl is not None and (not isinstance(ttl, (int, float)) or isinstance(ttl, bool)
                                or not 0 < ttl < 100 * 365 * 86400):
            raise InvalidArgumentError(f"ttl must be a positive number of seconds below 100 years, got {ttl!r}")
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError("name must be a string")
        if source is not None and not isinstance(source, str):
            raise InvalidArgumentError("source must be a string")
        kd = L.parse_dtype(dtype)
        comp = L.parse_compression(compression)
        from mcf.bucket.kvfile import _shape_of

        shape = _shape_of(layers)
        if token_ids is not None and len(token_ids) != shape.sequence_length:
            raise InvalidArgumentError(f"{len(token_ids)} token ids for KV data of {shape.sequence_length} tokens")
        doc = self.model(model_id)
        if doc is not None:
            compat = doc["model_compatibility"]
            for k, have in (("num_layers", shape.num_layers), ("num_kv_heads", shape.num_kv_heads),
                            ("head_dim", shape.head_dim), ("dtype", L.DTYPE_NAMES[kd])):
                if compat.get(k) is not None and compat[k] != have:
                    raise InvalidArgumentError(f"model {model_id!r} needs {k}={compat[k]!r}, the KV data has {have!r}")
        cid = context_id_for(model_id, chash, kd, shape)
        final = self._ctx_dir(cid)
        if (final / META_NAME).exists():
            meta = self._read_meta(cid)
            meta["deduplicated"] = True
            return meta

        ntok = shape.sequence_length
        prefix = None
        if token_ids is not None:
            prefix = {"chunk_tokens": self.prefix_chunk_tokens,
                      "hashes": prefix_hashes(model_id, token_ids, self.prefix_chunk_tokens)}
        tmp = self.root / "contexts" / f".tmp-{uuid.uuid4().hex}"
        try:
            tmp.mkdir()
            kv_path = tmp / KV_NAME
            header = write_kv(kv_path, layers, dtype=kd, compression=comp, threads=threads)
            with open(kv_path, "rb+") as f:
                os.fsync(f.fileno())
            now = self.clock()
            meta = {
                "context_id": cid,
                "model_id": model_id,
                "version": 1,
                "content": {"name": name, "source": source, "hash": chash, "token_count": ntok},
                "kv_cache": {
                    "format": "mcb-v1",
                    "shape": {"num_layers": shape.num_layers, "num_heads": shape.num_kv_heads,
                              "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                              "sequence_length": shape.sequence_length},
                    "dtype": L.DTYPE_NAMES[kd],
                    "size_bytes": L.HEADER_SIZE + header.compressed_size,
                    "original_size": header.original_size,
                    "compressed": comp != L.Compression.NONE,
                    "compression": L.COMPRESSION_NAMES[comp],
                    "chunked": header.chunked,
                },
                "storage": {"tier": "cold", "path": f"contexts/{cid}/{KV_NAME}",
                            "checksum": f"crc32:{header.checksum:08x}"},
                "timestamps": {"created_at": _iso(now), "last_accessed": _iso(now),
                               "expires_at": None if ttl is None else _iso(now + ttl)},
                "access": {"count": 0, "last_query": None},
                "pinned": bool(pinned),
                "prefix": prefix,
            }
            _write_json_atomic(tmp / META_NAME, meta)
            _fsync_dir(tmp)
            with self._lock():
                if (final / META_NAME).exists():  # another process committed the same content meanwhile
                    shutil.rmtree(tmp, ignore_errors=True)
                    meta = self._read_meta(cid)
                    meta["deduplicated"] = True
                    return meta
                os.rename(tmp, final)  # the commit point
                _fsync_dir(final.parent)
                reg = self._read_registry_locked()
                self._registry_put(reg, model_id, self._summary(meta))
                self._write_registry_locked(reg)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise os_error(exc, tmp) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._emit("context.ingested", model_id=model_id, context_id=cid)
        return meta

    def discover(self, model_id: str, *, force_scan: bool = False, include_expired: bool = False) -> list[dict]:
        """The contexts of ``model_id`` (summaries): from the cached registry, or from ``contexts/``
        with ``force_scan`` (which also repairs the registry)."""
        check_model_id(model_id)
        if force_scan:
            self.rebuild(emit=False)
        reg = self._registry()
        now = self.clock()
        out = []
        for m in reg["models"]:
            if m["model_id"] == model_id:
                out = [dict(c, tier=self.tier(c["context_id"]), is_loaded=self.tier(c["context_id"]) != "cold")
                       for c in m["contexts"] if include_expired or not self._expired(c, now)]
        self._emit("context.discovered", model_id=model_id, contexts=[c["context_id"] for c in out])
        return out

    def lookup_prefix(self, model_id: str, token_ids: Sequence[int] | np.ndarray, *, dtype: Any = None) -> dict | None:
        """The cached context sharing the longest prefix with ``token_ids`` (whole chunks of
        ``prefix_chunk_tokens``), as ``{"context_id", "tokens", "metadata"}``; None when no chunk
        matches.  Load just the shared part with ``load(context_id, tokens=result["tokens"])``."""
        check_model_id(model_id)
        want_dtype = None if dtype is None else L.DTYPE_NAMES[L.parse_dtype(dtype)]
        hashes = prefix_hashes(model_id, token_ids, self.prefix_chunk_tokens)
        self._registry()
        index = self._prefix_index
        now = self.clock()
        for h in reversed(hashes):  # chained: a match at chunk i implies chunks 0..i match
            for cid, ntok in index.get((model_id, h), ()):
                try:
                    meta = self.lookup(cid)
                except (ContextNotFoundError, FormatError):
                    continue
                if self._expired(meta, now) or (want_dtype is not None and meta["kv_cache"]["dtype"] != want_dtype):
                    continue
                pre = meta.get("prefix") or {}
                if h not in pre.get("hashes", ()):  # registry stale against the context: skip
                    continue
                return {"context_id": cid, "tokens": ntok, "metadata": meta}
        return None

    def lookup(self, context_id: str, *, include_expired: bool = False) -> dict:
        """The metadata of one context (ContextNotFoundError when absent or expired)."""
        meta = self._read_meta(check_context_id(context_id))
        if not include_expired and self._expired(meta, self.clock()):
            raise ContextNotFoundError(f"context {context_id!r} expired at {meta['timestamps']['expires_at']}")
        return meta

    def open(self, context_id: str, *, mmap: bool = True) -> KVFile:
        """The context's KV file, validated against its metadata."""
        meta = self.lookup(context_id)
        path = self._ctx_dir(context_id) / KV_NAME
        f = open_kv(path, mmap=mmap)
        s, want = f.shape, meta["kv_cache"]["shape"]
        got = {"num_layers": s.num_layers, "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
               "sequence_length": s.sequence_length}
        for k, v in got.items():
            if want[k] != v:
                f.close()
                raise FormatError("KV file shape disagrees with metadata.json", path=path, field=k,
                                  expected=want[k], got=v)
        if L.DTYPE_NAMES[f.dtype] != meta["kv_cache"]["dtype"]:
            f.close()
            raise FormatError("KV file dtype disagrees with metadata.json", path=path, field="dtype",
                              expected=meta["kv_cache"]["dtype"], got=L.DTYPE_NAMES[f.dtype])
        return f

    def load(self, context_id: str, *, layers: Sequence[int] | int | None = None, tokens: int | None = None,
             threads: int = 2, verify: bool = True, model: dict | str | None = None,
             record_access: bool = True, as_torch: bool = False) -> list[tuple[Any, Any]]:
        """Per-layer (K, V) numpy arrays (zero-copy views when stored uncompressed and not in a warmer
        tier).  ``model`` (a model id or compatibility dict) is checked first; ``record_access`` updates
        the access statistics; ``as_torch`` returns torch tensors (the hot tier's, on its device, when
        the context is hot; else CPU copies)."""
        from mcf.bucket.tiers import select, to_torch

        if model is not None:
            self.check_compatible(context_id, model)
        else:
            self.lookup(context_id)  # absent or expired contexts are not served from a tier either
        hot = self._hot.get(context_id)
        warm = self._warm.get(context_id)
        if as_torch and hot is not None:
            out = select(hot[1], layers, tokens)
        elif warm is not None:
            out = select(warm, layers, tokens)
        else:
            with self.open(context_id) as f:
                out = f.load(layers, tokens=tokens, threads=threads, verify=verify)
        if as_torch and hot is None:
            out = [(to_torch(k), to_torch(v)) for k, v in out]
        if record_access:
            self._touch(context_id)
        return out

    # -- tiers ---------------------------------------------------------------------------------------
    def tier(self, context_id: str) -> str:
        """"hot" (torch tensors on a device), "warm" (decompressed in RAM) or "cold" (on disk only)."""
        return "hot" if context_id in self._hot else "warm" if context_id in self._warm else "cold"

    @property
    def warm_used_bytes(self) -> int:
        return self._warm.used_bytes

    def promote(self, context_id: str, target_tier: str = "warm", *, device: Any = "cuda", threads: int = 2) -> str:
        """Move a context to a faster tier: ``warm`` loads and decompresses it into RAM (evicting the
        least recently used warm contexts past the budget); ``hot`` also places it on ``device``
        through torch (InvalidArgumentError when torch or the device is missing)."""
        from mcf.bucket.tiers import check_device, to_torch

        if target_tier not in ("warm", "hot"):
            raise InvalidArgumentError(f"promote to 'warm' or 'hot', not {target_tier!r}")
        meta = self.lookup(context_id)
        if target_tier == "hot":
            dev = check_device(device)
        layers = self._warm.get(context_id)
        if layers is None:
            with self.open(context_id) as f:
                layers = [(np.array(k), np.array(v)) for k, v in f.load(threads=threads)]
            for old in self._warm.put(context_id, layers):
                self._emit("context.demoted", context_id=old, from_tier="warm", to_tier="cold", reason="warm budget")
        if target_tier == "hot":
            self._hot[context_id] = (dev, [(to_torch(k, dev), to_torch(v, dev)) for k, v in layers])
        self._emit("context.promoted", model_id=meta["model_id"], context_id=context_id, to_tier=target_tier)
        return self.tier(context_id)

    def demote(self, context_id: str, target_tier: str = "cold") -> str:
        """Move a context to a slower tier (``warm`` drops its device copy, ``cold`` drops both)."""
        check_context_id(context_id)
        if target_tier not in ("warm", "cold"):
            raise InvalidArgumentError(f"demote to 'warm' or 'cold', not {target_tier!r}")
        before = self.tier(context_id)
        self._hot.pop(context_id, None)
        if target_tier == "cold":
            self._warm.pop(context_id)
        if before != self.tier(context_id):
            self._emit("context.demoted", context_id=context_id, from_tier=before, to_tier=self.tier(context_id))
        return self.tier(context_id)

    def _touch(self, context_id: str) -> None:
        with self._lock():
            try:
                meta = self._read_meta(context_id)
            except ContextNotFoundError:
                return  # deleted meanwhile: the caller already holds its arrays
            meta["access"]["count"] += 1
            meta["timestamps"]["last_accessed"] = _iso(self.clock())
            _write_json_atomic(self._ctx_dir(context_id) / META_NAME, meta, durable=False)

    def pin(self, context_id: str, pinned: bool = True) -> dict:
        """Pinned contexts never expire and are never reaped by gc."""
        with self._lock():
            meta = self._read_meta(check_context_id(context_id))
            meta["pinned"] = bool(pinned)
            _write_json_atomic(self._ctx_dir(context_id) / META_NAME, meta)
            reg = self._read_registry_locked()
            self._registry_put(reg, meta["model_id"], self._summary(meta))
            self._write_registry_locked(reg)
        return meta

    def delete(self, context_id: str, *, _event: str = "context.deleted") -> None:
        check_context_id(context_id)
        self._hot.pop(context_id, None)
        self._warm.pop(context_id)
        with self._lock():
            d = self._ctx_dir(context_id)
            if not d.is_dir():
                raise ContextNotFoundError(f"no context {context_id!r} in {self.root}")
            try:
                model_id = self._read_meta(context_id)["model_id"]
            except (FormatError, ContextNotFoundError):
                model_id = None
            grave = d.with_name(f".del-{uuid.uuid4().hex}")
            try:
                os.rename(d, grave)
                _fsync_dir(d.parent)
            except OSError as exc:
                raise os_error(exc, d) from exc
            reg = self._read_registry_locked()
            self._registry_put(reg, model_id or "", None, remove=context_id)
            self._write_registry_locked(reg)
            if grave.is_symlink():
                grave.unlink()  # remove the link itself, never what it points to
            else:
                shutil.rmtree(grave, ignore_errors=True)
        self._emit(_event, model_id=model_id, context_id=context_id)

    def gc(self) -> list[str]:
        """Delete expired (unpinned) contexts and leftovers of crashed writers; returns the ids deleted."""
        now = self.clock()
        gone = []
        for cid in self._scan_ids():
            try:
                meta = self._read_meta(cid)
            except (FormatError, ContextNotFoundError):
                continue
            if self._expired(meta, now):
                with contextlib.suppress(ContextNotFoundError):
                    self.delete(cid, _event="context.expired")
                    gone.append(cid)
        cdir = self.root / "contexts"
        with self._lock():
            for entry in os.scandir(cdir):
                if entry.name.startswith(".del-") or (
                        entry.name.startswith(".tmp-") and time.time() - entry.stat().st_mtime > STALE_TMP_SECONDS):
                    shutil.rmtree(entry.path, ignore_errors=True)
        return gone

    def _scan_ids(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root / "contexts")
                          if _CTX_RE.fullmatch(e.name) and (e.is_dir(follow_symlinks=False) or e.is_symlink()))
        except OSError as exc:
            raise os_error(exc, self.root / "contexts") from exc

    def _rebuild_locked(self) -> dict:
        reg = self._empty_registry()
        skipped = []
        by_model: dict[str, list[dict]] = {}
        for cid in self._scan_ids():
            try:
                meta = self._read_meta(cid)
                if not (self._ctx_dir(cid) / KV_NAME).is_file():
                    raise FormatError("kv_data.mcb is missing", path=self._ctx_dir(cid))
            except (FormatError, ContextNotFoundError, InvalidArgumentError, MCFIOError) as exc:
                skipped.append({"context_id": cid, "reason": str(exc)})
                continue
            by_model.setdefault(meta["model_id"], []).append(self._summary(meta))
        for model_id, summaries in by_model.items():
            doc = self.model(model_id) if self._model_path(model_id).exists() else None
            reg["models"].append({"model_id": model_id, "model_hash": (doc or {}).get("model_hash"),
                                  "contexts": summaries})
        reg["skipped"] = skipped
        self._write_registry_locked(reg)
        return reg

    def rebuild(self, *, emit: bool = True) -> dict:
        """Recreate registry.json from ``contexts/`` (after a crash or by hand).  Returns the registry;
        its ``skipped`` list names context directories that could not be read, and why."""
        with self._lock():
            reg = self._rebuild_locked()
        if emit:
            self._emit("registry.rebuilt", contexts=[c["context_id"] for m in reg["models"] for c in m["contexts"]])
        return json.loads(json.dumps(reg))
