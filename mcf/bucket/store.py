"""The bucket directory: contexts on disk, the registry that indexes them, and the operations of
seed 003 §4 (ingest, discover, lookup, load, delete, gc, rebuild)::

    <root>/
      registry.json               snapshot of every context's summary, grouped by model (rebuild() recreates it)
      registry.journal            changes since the snapshot, one CRC-guarded JSON line each
      models/<model_id>.json      model identity (model_hash) and compatibility (architecture, vocab_size, layers,
                                  kv heads, head_dim, dtype)
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
* **The registry is a cache.**  A change appends one line to the journal under the lock; the snapshot
  is rewritten atomically (temp + fsync + rename) when the journal grows; when either is missing or
  unreadable it is rebuilt from ``contexts/``.  Nothing committed depends on it.
* **Writers are serialized with ``fcntl.flock``** on ``.lock``; the KV data itself is written before the
  lock is taken, so concurrent ingests only queue for the rename and the registry update.
* **Nothing planted in the directory is followed.**  Every file operation goes through
  :class:`mcf.bucket._fs.BucketFS`: relative to the root's descriptor, ``O_NOFOLLOW`` on every
  component, ``fstat`` on what was opened; links, FIFOs and devices are refused, never followed.
* **A delete is final.**  Ids come from the content, not the values, so a context deleted and ingested
  again has the same id: the delete drops the tier copies after the rename, under the mutex a promotion
  holds until its copy is in a tier, and every copy is tagged with the data it was read from, so no read
  in flight (here or in another process) can bring the deleted data back.
* **The registry heals itself.**  Opening a bucket reconciles the registry with ``contexts/`` (the
  incremental :meth:`Bucket.scan`), and an ingest that finds its context already committed but not
  listed (a writer killed between the commit rename and the journal append) lists it.

Where the parts live: :class:`Bucket` here is the public face and carries out every operation (the
lock, the commit, events, what may be served); it delegates to modules named for what they hold:

* :mod:`mcf.bucket.ids`: the identities computed from content (``content_hash``, ``context_id_for``,
  ``prefix_hashes``, ``token_array``), also importable from here;
* :mod:`mcf.bucket._models`: model documents (``models/<model_id>.json``), compatibility
  (``COMPATIBILITY_KEYS``, also importable from here) and staleness;
* :mod:`mcf.bucket._metadata`: a context's metadata.json (read without following anything planted,
  validated field by field, written) and its ``.verified.json`` record;
* :mod:`mcf.bucket._tier_ops`: the warm and hot copies this object holds, tagged with the data they were
  read from, and the moves that fill and empty them (the tiers' mechanics and policy are
  :mod:`mcf.bucket.tiers`);
* :mod:`mcf.bucket._registry` (snapshot and journal), :mod:`mcf.bucket._names` (file names, id checks),
  :mod:`mcf.bucket._fs` (descriptor-relative file operations), :mod:`mcf.bucket._json` (documents).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mcf._core.fs import fsync_file
from mcf._core.lifetime import ClosedOnExit
from mcf.bucket import _layout as L
from mcf.bucket._crypto import key_id, seal, unseal
from mcf.bucket._fs import BucketFS
from mcf.bucket._json import dumps, iso
from mcf.bucket._metadata import (
    metadata_stamp,
    new_metadata,
    read_metadata,
    read_verified,
    unlinked,
    validate_metadata,
    write_metadata,
    write_verified,
)
from mcf.bucket._models import COMPATIBILITY_KEYS  # importable from here, as before the split
from mcf.bucket._models import (
    check_model,
    check_staleness_meta,
    current_hash,
    model_block,
    new_model_document,
    read_model,
    stale_error,
    stale_under,
)
from mcf.bucket._names import (
    CTX_RE,
    JOURNAL_NAME,  # noqa: F401  (importable from here, as before the split)
    KV_NAME,
    LOCK_NAME,
    META_NAME,
    REGISTRY_NAME,  # noqa: F401  (importable from here, as before the split)
    TOKENS_NAME,
    check_context_id,
    check_model_id,
    ctx_rel,
    model_rel,
)
from mcf.bucket._registry import REGISTRY_VERSION  # noqa: F401  (importable from here, as before the split)
from mcf.bucket._registry import Registry, document, made_by, summary
from mcf.bucket._tier_ops import ProcessTiers
from mcf.bucket.ids import (  # importable from here, as before the split
    PREFIX_CHUNK_TOKENS,
    content_hash,
    context_id_for,
    prefix_hashes,
    token_array,
)
from mcf.bucket.kvfile import KVFile, open_kv, write_kv
from mcf.bucket.tiers import TIERS, check_device, expired, preference, preference_steps
from mcf.errors import (
    ArgumentTypeError,
    ChecksumError,
    ContextNotFoundError,
    EncryptionKeyError,
    FormatError,
    InvalidArgumentError,
    MCFError,
    MCFIOError,
    MissingFileError,
    StaleContextError,
    os_error,
)
from mcf.io import open_fd
from mcf.remote import refuse_url

__all__ = ["Bucket", "content_hash", "context_id_for", "COMPATIBILITY_KEYS"]

#: temp directories older than this are considered abandoned by a crashed writer and removed by gc()
STALE_TMP_SECONDS = 3600.0


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------
def _verify_policy(v: Any) -> str:
    if v is True or v == "always":
        return "always"
    if v is False or v == "never":
        return "never"
    if v == "once":
        return "once"
    raise InvalidArgumentError(f"verify must be 'always' (True), 'once' or 'never' (False), got {v!r}")


def _copy_into(out: Any, layers: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Copy per-layer (K, V) arrays into the caller's ``out`` pairs (same count, shapes and dtypes)."""
    if not isinstance(out, (list, tuple)) or len(out) != len(layers):
        raise InvalidArgumentError(f"out must be a list of {len(layers)} (K, V) pairs")
    for i, (pair, src) in enumerate(zip(out, layers)):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidArgumentError(f"out[{i}]: expected a (K, V) pair")
        for a, b in zip(pair, src):
            if not isinstance(a, np.ndarray) or a.shape != b.shape or a.dtype != b.dtype or not a.flags.writeable:
                raise InvalidArgumentError(f"out[{i}]: expected writable arrays of shape {b.shape} and dtype {b.dtype}")
            np.copyto(a, b)
    return [tuple(p) for p in out]


def check_ttl(ttl: Any, name: str) -> float | None:
    if ttl is not None and (not isinstance(ttl, (int, float)) or isinstance(ttl, bool)
                            or not 0 < ttl < 100 * 365 * 86400):
        raise InvalidArgumentError(f"{name} must be a positive number of seconds below 100 years, got {ttl!r}")
    return ttl


def _tokens_aad(context_id: str) -> bytes:
    """What an encrypted token_ids.bin is bound to: it cannot be moved to another context."""
    return b"mcf-token-ids\0" + context_id.encode()


# ------------------------------------------------------------------------------------------------
# the bucket
# ------------------------------------------------------------------------------------------------
class Bucket(ClosedOnExit):
    """A bucket directory.  ``clock`` (seconds since the epoch) is injectable so TTLs can be tested.

    >>> b = Bucket("/data/mcb")                                                # doctest: +SKIP
    >>> info = b.ingest("llama-3-8b", layers, content="The pathophysiology of diabetes...")
    >>> [c["context_id"] for c in b.discover("llama-3-8b")]
    >>> layers = b.load(info["context_id"])                                     # [(K, V), ...]

    ``key`` (32 bytes or 64 hex digits; default: the ``MCF_BUCKET_KEY`` environment variable) encrypts
    the KV data of every context this object ingests with AES-256-GCM and decrypts encrypted contexts on
    load (:mod:`mcf.bucket._crypto`); without a key, encrypted contexts are listed but cannot be loaded.

    ``default_ttl`` (seconds) applies to every ingest that gives no ``ttl``.  It is None (never expire)
    rather than seed 003's 7 days: a library must not delete what its caller stored unless told to
    (docs/bucket.md, "Defaults").
    """

    def __init__(self, root: str | os.PathLike, *, clock: Callable[[], float] = time.time, create: bool = True,
                 prefix_chunk_tokens: int = PREFIX_CHUNK_TOKENS, warm_budget_bytes: int = 1 << 30,
                 verify: bool | str = "always", key: Any = None, reconcile: bool = True,
                 default_ttl: float | None = None) -> None:
        from mcf.bucket._crypto import key_from_env, parse_key

        self._key = parse_key(key) if key is not None else key_from_env()
        self.default_ttl = check_ttl(default_ttl, "default_ttl")

        self.verify = _verify_policy(verify)
        self._verified: dict[str, tuple] = {}

        # threads of one process (the server's pool) share this object: the registry's ``_mem`` guards the
        # in-memory registry (always taken after the file lock, never before it), ``_tiers.mutex`` the tiers
        self._tiers = ProcessTiers(warm_budget_bytes)
        self.root = Path(root)
        self.clock = clock
        prefix_hashes("m", [], chunk_tokens=prefix_chunk_tokens)  # validates the chunk size
        self.prefix_chunk_tokens = prefix_chunk_tokens
        self._subscribers: list[Callable[[dict], None]] = []
        refuse_url(root, what="a bucket")   # a URL is not a directory: never create "https:/host/..." locally
        try:
            self._fs = BucketFS(self.root, create=create)
        except FileNotFoundError:
            raise MissingFileError(errno.ENOENT, "is not a bucket (no such directory)", str(self.root)) from None
        self._reg = Registry(self._fs, self.root, self.clock, self._rebuild_locked)
        self._mem = self._reg.mem
        try:
            if create:
                self._fs.mkdir("contexts", exist_ok=True)
                self._fs.mkdir("models", exist_ok=True)
            try:
                os.close(self._fs.open_dir("contexts"))
            except FileNotFoundError:
                raise InvalidArgumentError(f"{self.root} is not a bucket (no contexts/ directory)") from None
            if reconcile:
                self._reconcile()
        except BaseException:
            self._fs.close()
            raise

    def _reconcile(self) -> None:
        """Bring the registry in line with ``contexts/`` (:meth:`scan`): a writer killed between its
        commit rename and its journal line left a committed context unlisted, a delete killed at the same
        point a listed ghost.  Skipped when the bucket is read-only to this process (nothing can be
        written; readers still see every committed context through ``lookup``)."""
        try:
            self.scan()
        except MCFIOError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise

    def close(self) -> None:
        """Release the root directory's descriptor (the object cannot be used afterwards)."""
        self._fs.close()

    def scratch_file(self):
        """A new, nameless read-write binary file on the bucket's own disk (``contexts/``), freed when
        closed and unmapped: the server spools uploads there instead of holding them in memory."""
        return os.fdopen(self._fs.temp_file("contexts"), "w+b")

    # -- paths ---------------------------------------------------------------------------------------
    @property
    def registry_path(self) -> Path:
        return self._reg.registry_path

    def _ctx_dir(self, context_id: str) -> Path:
        """For messages only: every access goes through ``self._fs``."""
        return self.root / ctx_rel(context_id)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        fd = self._fs.open_file(LOCK_NAME, os.O_RDWR | os.O_CREAT)
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
        ev = {"event": event, **fields, "timestamp": iso(self.clock())}
        for cb in list(self._subscribers):
            cb(ev)

    def model_loaded(self, model_id: str) -> list[dict]:
        """Say that a runtime loaded ``model_id`` (seed 003 §6.2's ``model.loaded``): discovers its
        contexts (``context.discovered``) and emits ``model.loaded`` with their ids; returns them.  The
        server calls it at start-up for its model backend."""
        found = self.discover(model_id)
        self._emit("model.loaded", model_id=model_id, contexts=[c["context_id"] for c in found])
        return found

    # -- models --------------------------------------------------------------------------------------
    def register_model(self, model_id: str, *, architecture: str | None = None, num_layers: int | None = None,
                       num_kv_heads: int | None = None, head_dim: int | None = None, dtype: str | None = None,
                       vocab_size: int | None = None, model_hash: str | None = None) -> dict:
        """Record a model's identity and what its contexts must match (seed 003 §7.1; checked at ingest
        and load).  Registering again replaces the document: a new ``model_hash`` (other weights: a new
        checkpoint, a fine-tune) marks every context ingested under the old one stale (listed with
        ``"stale": True``, refused by :meth:`load` unless forced, replaced by the next ingest of the same
        content)."""
        doc = new_model_document(model_id, architecture=architecture, num_layers=num_layers,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, vocab_size=vocab_size,
                                 model_hash=model_hash, clock=self.clock)
        with self._lock():
            self._fs.write_atomic(model_rel(model_id), dumps(doc, False))
        return doc

    def model(self, model_id: str) -> dict | None:
        """The model document, or None when the model was never registered."""
        return read_model(self._fs, model_id)

    def _model_hash(self, model_id: str) -> str | None:
        """The registered model's hash for the registry; None when unregistered or unreadable (the
        registry is a cache: a damaged model document must not stop contexts from being listed)."""
        return current_hash(self.model, model_id)

    def check_compatible(self, context_id: str, model: dict | str) -> dict:
        """Raise unless the context can be used with ``model`` (a model id registered in this bucket, or a
        dict of :data:`COMPATIBILITY_KEYS`); returns the context's metadata.

        InvalidArgumentError when the context's shape, dtype, architecture, vocab_size or model_hash differ
        from the model's (each compared where both sides know it: a context ingested before its model was
        registered has no recorded architecture, vocabulary or weights), or when ``model`` has a key that
        is not one of these (a misspelt ``"architectur"`` must not pass unchecked).  StaleContextError when
        the context is stale (computed by other weights than its model's current ones), whatever ``model``
        says: :meth:`load` with ``force=True`` is the way to use it anyway."""
        meta = self.lookup(context_id)
        self._check_model(meta, model)
        stale = self._stale_error(meta)
        if stale is not None:
            raise stale
        return meta

    def _check_model(self, meta: dict, model: dict | str) -> None:
        """check_compatible's comparison of the context ``meta`` with ``model``, staleness aside."""
        check_model(meta, model, self.model)

    def _stale_error(self, meta: dict) -> StaleContextError | None:
        """The StaleContextError of a stale context (what load and check_compatible raise), else None."""
        return stale_error(meta, self._model_hash(meta["model_id"]))

    def _refusal(self, meta: dict, *, force: bool = False) -> MCFError | None:
        """What :meth:`load` would raise for the context ``meta`` before reading it, or None: expired,
        stale (unless ``force``), or encrypted while this object has no key.  :meth:`lookup_prefix`
        offers only contexts with none of these."""
        if self._expired(meta, self.clock()):
            return ContextNotFoundError(f"context {meta['context_id']!r} expired at {meta['timestamps']['expires_at']}")
        if not force:
            stale = self._stale_error(meta)
            if stale is not None:
                return stale
        return self._key_refusal(meta)

    def _key_refusal(self, meta: dict) -> EncryptionKeyError | None:
        """The EncryptionKeyError of a context this object cannot decrypt, known from its metadata (no key
        here, or another key's id recorded), else None."""
        if meta["kv_cache"].get("encrypted") is not True:
            return None
        if self._key is None:
            return EncryptionKeyError(f"{meta['context_id']}: the KV data is encrypted; open the bucket with key= "
                                      "(or set MCF_BUCKET_KEY)")
        recorded = meta["kv_cache"].get("key_id")
        if recorded is not None and recorded != key_id(self._key):
            return EncryptionKeyError(f"{meta['context_id']}: the KV data is encrypted under another key (key id "
                                      f"{recorded}) than this bucket's ({key_id(self._key)})")
        return None

    def is_stale(self, context_id_or_meta: str | dict) -> bool:
        """True when the context was ingested under another ``model_hash`` than its model's current one.
        A context ingested while its model had no hash (or was unregistered) is never stale: nothing
        says which weights computed it.  Takes a context id or its metadata (as :meth:`lookup` returns it:
        ``model_id`` is needed, the ``model`` block is read when present)."""
        if isinstance(context_id_or_meta, str):
            meta = self.lookup(context_id_or_meta, include_expired=True)
        elif isinstance(context_id_or_meta, dict):
            meta = check_staleness_meta(context_id_or_meta)
        else:
            raise ArgumentTypeError(f"is_stale takes a context id or its metadata (a dict), not "
                                    f"{type(context_id_or_meta).__name__}")
        return stale_under(made_by(meta).get("model_hash"), self._model_hash(meta["model_id"]))

    # -- registry (mcf.bucket._registry: snapshot + journal) -----------------------------------------------
    @property
    def journal_path(self) -> Path:
        return self._reg.journal_path

    def _meta_stamp(self, context_id: str) -> list[int] | None:
        """[inode, mtime_ns, size] of the context's metadata.json (what :meth:`scan` compares)."""
        return metadata_stamp(self._fs, context_id)

    def _load_locked(self) -> dict:
        """The registry state, refreshed from disk (caller holds the lock)."""
        return self._reg.load_locked()

    def _journal_locked(self, records: list[dict]) -> None:
        """Append registry records (caller holds the lock)."""
        self._reg.journal_locked(records)

    def _put_record(self, meta: dict, stamp: list[int] | None) -> dict:
        return {"op": "put", "model_id": meta["model_id"], "model_hash": self._model_hash(meta["model_id"]),
                "summary": summary(meta), "stamp": stamp}

    def _registry(self) -> dict:
        """The in-memory registry, refreshed when registry.json or the journal changed on disk
        (another process wrote them): two stat() calls when nothing changed."""
        state = self._reg.fresh()
        if state is not None:
            return state
        with self._lock():
            return self._reg.load_locked()

    def _prefix(self) -> dict[tuple[str, str], list[tuple[str, int]]]:
        """chained chunk hash -> [(context id, tokens covered)] per model, built on demand."""
        state = self._registry()
        with self._mem:
            return self._reg.prefix_locked_mem(state, self.prefix_chunk_tokens)

    def registry(self) -> dict:
        """The registry document of seed 003 §3.2 (models, their contexts, statistics)."""
        state = self._registry()
        with self._mem:
            doc = json.loads(json.dumps(document(state)))
        for m in doc["models"]:  # the model's current identity (registering again changes it)
            m["model_hash"] = self._model_hash(m["model_id"])
        return doc

    # -- metadata ------------------------------------------------------------------------------------
    def _read_meta(self, context_id: str) -> dict:
        """The validated metadata.json of a committed context.  The context directory, metadata.json and
        kv_data.mcb must be what they claim (no link, FIFO or device: FormatError); a missing one is
        ContextNotFoundError."""
        return read_metadata(self._fs, context_id)

    def _unlinked(self, rel: str, dir_fd: int) -> bool:
        """True when the directory open as ``dir_fd`` is no longer the one at ``rel``."""
        return unlinked(self._fs, rel, dir_fd)

    @staticmethod
    def _validate_meta(meta: Any, p: Path, context_id: str) -> None:
        validate_metadata(meta, p, context_id)

    def _expired(self, summary_or_meta: dict, now: float) -> bool:
        return expired(summary_or_meta, now, path=self._reg.registry_path)

    # -- operations ----------------------------------------------------------------------------------
    def ingest(self, model_id: str, layers: Sequence[Sequence[Any]], *, content: str | bytes | None = None,
               token_ids: Sequence[int] | np.ndarray | None = None, name: str | None = None,
               source: str | None = None, dtype: Any = "float16", compression: Any = "lz4",
               ttl: float | None = None, pinned: bool = False, threads: int = 1) -> dict:
        """Store a context: ``layers[i] = (K, V)`` of shape [num_kv_heads, tokens, head_dim], for the text
        ``content`` or its ``token_ids``.  Returns the metadata (with ``"deduplicated": True`` when the
        same context was already stored; its data is then left as it was, unless it is stale or stored
        in clear while this bucket encrypts: then the new data takes its place; see :meth:`reusable`)."""
        check_model_id(model_id)
        chash = content_hash(content, token_ids=token_ids)
        ttl = self.default_ttl if ttl is None else check_ttl(ttl, "ttl")
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError("name must be a string")
        if source is not None and not isinstance(source, str):
            raise InvalidArgumentError("source must be a string")
        kd = L.parse_dtype(dtype)
        comp = L.parse_compression(compression)
        from mcf.bucket.kvfile import shape_of

        shape = shape_of(layers)
        if token_ids is not None and len(token_ids) != shape.sequence_length:
            raise InvalidArgumentError(f"{len(token_ids)} token ids for KV data of {shape.sequence_length} tokens")
        maker = model_block(model_id, self.model(model_id), shape, L.DTYPE_NAMES[kd])
        cid = context_id_for(model_id, chash, kd, shape)
        rel = ctx_rel(cid)
        found = self.reusable(cid)
        if found is not None:
            return found

        prefix = None
        if token_ids is not None:
            prefix = {"chunk_tokens": self.prefix_chunk_tokens,
                      "hashes": prefix_hashes(model_id, token_ids, chunk_tokens=self.prefix_chunk_tokens)}
        tmp_rel = f"contexts/.tmp-{uuid.uuid4().hex}"
        replaced = False
        try:
            self._fs.mkdir(tmp_rel)
            with self._fs.dir(tmp_rel) as td:
                fd = self._fs.open_file_at(td, KV_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                           rel=f"{tmp_rel}/{KV_NAME}")
                with os.fdopen(fd, "wb") as f:
                    header = write_kv(f, layers, dtype=kd, compression=comp, threads=threads, key=self._key,
                                      scratch=self.scratch_file)  # conversions in a file, not in RAM
                    f.flush()
                    fsync_file(f.fileno())
                if token_ids is not None:  # what KV events announce (mcf.bucket.kv_events), sealed like the KV data
                    data = token_array(token_ids).tobytes()
                    if self._key is not None:
                        data = seal(self._key, data, _tokens_aad(cid))
                    fd = self._fs.open_file_at(td, TOKENS_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                               rel=f"{tmp_rel}/{TOKENS_NAME}")
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                        f.flush()
                        fsync_file(f.fileno())
                meta = new_metadata(cid, model_id, name=name, source=source, chash=chash, shape=shape, dtype=kd,
                                    compression=comp, header=header,
                                    key_id=key_id(self._key) if header.encrypted else None, now=self.clock(),
                                    ttl=ttl, pinned=pinned, prefix=prefix, model=maker)
                fd = self._fs.open_file_at(td, META_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                           rel=f"{tmp_rel}/{META_NAME}")
                with os.fdopen(fd, "wb") as f:
                    f.write(dumps(meta, False))
                    f.flush()
                    fsync_file(f.fileno())
                fsync_file(td)
            with self._lock():
                if self._fs.lstat(rel) is not None:  # another process committed the same content meanwhile
                    if not self._replaceable_locked(cid):
                        self._fs.remove_tree(tmp_rel)
                        return self._deduplicated_locked(cid)
                    # a stale context of the same content: the new one takes its place (a crash between
                    # the two steps loses only the stale one)
                    self._drop_tree(rel)
                    replaced = True
                self._fs.rename(tmp_rel, rel)  # the commit point
                self._fs.fsync_dir("contexts")
                self._journal_locked([self._put_record(meta, self._meta_stamp(cid))])
            if replaced:
                with self._tiers.mutex:  # copies of the replaced context are of other data
                    self._drop_tiers(cid)
        except OSError as exc:
            self._fs.remove_tree(tmp_rel)
            if isinstance(exc, MCFError):
                raise
            raise os_error(exc, self._fs.where(tmp_rel)) from exc
        except BaseException:
            self._fs.remove_tree(tmp_rel)  # gone already once committed
            raise
        self._emit("context.ingested", model_id=model_id, context_id=cid)
        return meta

    def reusable(self, context_id: str) -> dict | None:
        """The metadata of the committed context ``context_id`` when an ingest of that id would return it
        as it is (with ``"deduplicated": True``), None when an ingest would store it: absent, stale
        (computed by the model's former weights), or stored in clear while this bucket encrypts (the
        ingest stores it encrypted in its place).  EncryptionKeyError when it is encrypted under a key this
        bucket does not hold, or while this bucket has none: neither returned as usable nor overwritten.
        What an ingest checks before computing anything (a model backend checks it before it runs)."""
        if self._fs.lstat(ctx_rel(context_id)) is None:
            return None
        with self._lock():
            # looked at again under the lock: a delete may have come in between
            if self._fs.lstat(ctx_rel(context_id)) is None or self._replaceable_locked(context_id):
                return None
            return self._deduplicated_locked(context_id)

    def _replaceable_locked(self, context_id: str) -> bool:
        """True when a new ingest of the committed context of this id replaces it instead of returning it
        (caller holds the lock): it is stale, or in clear while this bucket encrypts.  EncryptionKeyError
        when it is encrypted under a key this bucket does not hold (or it has none): deduplicating would
        answer with data unusable here, replacing would take it from the holders of its key."""
        try:
            meta = self._read_meta(context_id)
        except (ContextNotFoundError, FormatError):
            return False
        if self.is_stale(meta):
            return True
        if meta["kv_cache"].get("encrypted") is not True:
            return self._key is not None
        if not self._holds_key(context_id, meta):
            where = ("this bucket has no key" if self._key is None
                     else "under another key than this bucket's")
            raise EncryptionKeyError(
                f"{context_id} is already stored, encrypted, and {where}: returning it would answer with data "
                "that cannot be loaded here, and storing it again would take it from whoever holds its key. "
                "Use that key (key=, MCF_BUCKET_KEY), or delete the context first")
        return False

    def _holds_key(self, context_id: str, meta: dict) -> bool:
        """True when this object's key decrypts the encrypted context ``meta``: from the key id its
        metadata records, or, for a context written before key ids were recorded, by authenticating its
        first layer's chunks with the key."""
        if self._key_refusal(meta) is not None:
            return False
        if meta["kv_cache"].get("key_id") is not None:
            return True
        try:
            with self.open(context_id) as f:
                f.load(layers=[0], tokens=1, verify=False)
        except ChecksumError:  # failed authentication: another key (or a deliberate change)
            return False
        return True

    def _drop_tree(self, rel: str) -> None:
        """Remove a committed context directory (renamed aside first, so the name is free at once)."""
        aside = f"contexts/.tmp-{uuid.uuid4().hex}"
        self._fs.rename(rel, aside)
        self._fs.remove_tree(aside)

    def _deduplicated_locked(self, context_id: str) -> dict:
        """The metadata of an already committed context, which is listed from now on: a writer killed
        between its commit rename and its journal line left it unlisted, and re-ingesting the same
        content is how a user finds out (caller holds the lock)."""
        meta = self._read_meta(context_id)
        state = self._load_locked()
        stamp = self._meta_stamp(context_id)
        with self._mem:
            listed = state["stamps"].get(context_id, False) == stamp
        if not listed:
            self._journal_locked([self._put_record(meta, stamp)])
        meta["deduplicated"] = True
        return meta

    def discover(self, model_id: str, *, force_scan: bool = False, include_expired: bool = False,
                 include_metadata: bool = False) -> list[dict]:
        """The contexts of ``model_id`` (seed 003 §4.2): from the cached registry, or with ``force_scan``
        after checking ``contexts/`` against it (:meth:`scan`).  Each entry is the registry's summary with
        ``tier``, ``is_loaded`` and ``stale`` (computed by the model's former weights: :meth:`load`
        refuses it unless forced); ``include_metadata`` adds each context's whole metadata.json as
        ``metadata`` (one file read per context; a context deleted meanwhile is left out)."""
        check_model_id(model_id)
        for k, v in (("force_scan", force_scan), ("include_expired", include_expired),
                     ("include_metadata", include_metadata)):
            if not isinstance(v, bool):
                raise InvalidArgumentError(f"{k} must be True or False, got {v!r}")
        state = self.scan() if force_scan else self._registry()
        now = self.clock()
        current = self._model_hash(model_id)
        with self._mem:
            m = state["models"].get(model_id)
            summaries = list(m["contexts"].values()) if m is not None else []
        out, where = [], self._reg.registry_path
        for c in summaries:
            if include_expired or not expired(c, now, path=where):
                tier = self.tier(c["context_id"])
                entry = dict(c, tier=tier, is_loaded=tier != "cold", stale=stale_under(c.get("model_hash"), current))
                if include_metadata:
                    try:
                        entry["metadata"] = self._read_meta(c["context_id"])
                    except ContextNotFoundError:
                        continue
                out.append(entry)
        self._emit("context.discovered", model_id=model_id, contexts=[c["context_id"] for c in out])
        return out

    def scan(self) -> dict:
        """Bring the registry in line with ``contexts/``: list the directory, ``lstat`` every
        metadata.json and re-read only those whose (inode, mtime, size) differ from the registry's
        stamp (new, rewritten or replaced contexts); contexts gone from disk are dropped.  Changes are
        journaled.  Cheaper than :meth:`rebuild`, which re-reads every metadata.json; it does not
        notice a kv_data.mcb removed by hand behind an unchanged metadata.json (rebuild does)."""
        with self._lock():
            state = self._load_locked()
            stamps = state["stamps"]
            on_disk: dict[str, list[int] | None] = {}
            match, stat_at, tail = CTX_RE.fullmatch, os.stat, "/" + META_NAME
            with self._fs.dir("contexts") as cfd:
                try:
                    with os.scandir(cfd) as it:  # plain strings: pathlib would triple the cost per context
                        for e in it:
                            if match(e.name):
                                try:  # a stamp only: reading goes through _read_meta's checks
                                    st = stat_at(e.name + tail, dir_fd=cfd, follow_symlinks=False)
                                    on_disk[e.name] = [st.st_ino, st.st_mtime_ns, st.st_size]
                                except OSError:
                                    on_disk[e.name] = None
                except OSError as exc:
                    raise os_error(exc, self._fs.where("contexts")) from exc
            records, skipped = [], []
            with self._mem:  # a stamp without its summary (a snapshot edited or restored) lists nothing
                summarized = {cid for m in state["models"].values() for cid in m["contexts"]}
            for cid, stamp in on_disk.items():
                if stamp is not None and stamps.get(cid) == stamp and cid in summarized:
                    continue
                try:
                    meta = self._read_meta(cid)
                except (FormatError, ContextNotFoundError, InvalidArgumentError, MCFIOError) as exc:
                    skipped.append({"context_id": cid, "reason": str(exc)})
                    if cid in stamps:
                        records.append({"op": "del", "context_id": cid})
                    continue
                records.append(self._put_record(meta, stamp))
            records += [{"op": "del", "context_id": cid} for cid in stamps if cid not in on_disk]
            if records:
                self._journal_locked(records)
            state = self._reg.cache
            state["skipped"] = skipped
        return state

    def lookup_prefix(self, model_id: str, token_ids: Sequence[int] | np.ndarray, *, dtype: Any = None) -> dict | None:
        """The cached context sharing the longest prefix with ``token_ids`` (whole chunks of
        ``prefix_chunk_tokens``), as ``{"context_id", "tokens", "metadata"}``; None when no chunk
        matches.  Load just the shared part with ``load(context_id, tokens=result["tokens"])``.

        Only contexts that :meth:`load` would serve are offered: a longer match that is expired, stale
        (computed by the model's former weights) or encrypted while this object has no key is passed
        over for a shorter one that can be used."""
        check_model_id(model_id)
        want_dtype = None if dtype is None else L.DTYPE_NAMES[L.parse_dtype(dtype)]
        hashes = prefix_hashes(model_id, token_ids, chunk_tokens=self.prefix_chunk_tokens)
        index = self._prefix()
        for h in reversed(hashes):  # chained: a match at chunk i implies chunks 0..i match
            for cid, ntok in index.get((model_id, h), ()):
                try:
                    meta = self.lookup(cid)
                except (ContextNotFoundError, FormatError):
                    continue
                if want_dtype is not None and meta["kv_cache"]["dtype"] != want_dtype:
                    continue
                if self._refusal(meta) is not None:  # expired, stale, or encrypted without the key: load refuses
                    continue
                pre = meta.get("prefix") or {}
                if h not in pre.get("hashes", ()):  # registry stale against the context: skip
                    continue
                return {"context_id": cid, "tokens": ntok, "metadata": meta}
        return None

    def token_ids(self, context_id: str, *, include_expired: bool = False) -> np.ndarray | None:
        """The token ids a context was ingested with (int64), or None for a context ingested from text (or by
        an mcf that did not keep them).  They are checked against the context's content hash before they
        are returned (FormatError when they differ); in an encrypted bucket they are sealed with the key like
        the KV data (EncryptionKeyError without it)."""
        meta = self.lookup(context_id, include_expired=include_expired)
        rel = f"{ctx_rel(context_id)}/{TOKENS_NAME}"
        n = meta["content"]["token_count"]
        try:
            raw = self._fs.read(rel, limit=8 * n + 64)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if isinstance(exc, MCFError):
                raise
            raise os_error(exc, self._fs.where(rel)) from exc
        if meta["kv_cache"].get("encrypted") is True:  # sealed with the key its KV data is encrypted with
            refusal = self._key_refusal(meta)
            if refusal is not None:
                raise refusal
            raw = unseal(self._key, raw, _tokens_aad(context_id), path=self._fs.where(rel))
        if len(raw) != 8 * n or content_hash(token_ids=np.frombuffer(raw, "<i8")) != meta["content"]["hash"]:
            raise FormatError("token ids disagree with the context's content hash", path=self._fs.where(rel),
                              field="content.hash", expected=meta["content"]["hash"])
        return np.frombuffer(raw, "<i8").copy()

    def lookup(self, context_id: str, *, include_expired: bool = False) -> dict:
        """The metadata of one context (ContextNotFoundError when absent or expired)."""
        meta = self._read_meta(check_context_id(context_id))
        if not include_expired and self._expired(meta, self.clock()):
            raise ContextNotFoundError(f"context {context_id!r} expired at {meta['timestamps']['expires_at']}")
        return meta

    def open(self, context_id: str, *, mmap: bool | None = None) -> KVFile:
        """The context's KV file, validated against its metadata (``mmap``: as :func:`mcf.bucket.open_kv`)."""
        rel = f"{ctx_rel(context_id)}/{KV_NAME}"
        path = self._fs.where(rel)
        for attempt in (1, 2):
            meta = self.lookup(context_id)
            try:
                fd = self._fs.open_file(rel)
                break
            except FileNotFoundError:
                # deleted (or replaced) between the two reads: looking again says which (not found, or
                # the new context), never an I/O error
                if attempt == 2:
                    raise ContextNotFoundError(f"no context {context_id!r} in {self.root}") from None
        f = open_kv(open_fd(fd, path, mmap=mmap), key=self._key)
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
             threads: int = 2, verify: bool | str | None = None, model: dict | str | None = None,
             record_access: bool = True, as_torch: bool = False,
             out: Sequence[tuple[np.ndarray, np.ndarray]] | None = None, force: bool = False) -> list[tuple[Any, Any]]:
        """Per-layer (K, V) numpy arrays (zero-copy views when stored uncompressed and not in a warmer
        tier).  ``model`` (a model id or compatibility dict) is checked first; ``record_access`` updates
        the access statistics; ``as_torch`` returns torch tensors (the hot tier's, on its device, when
        the context is hot; else CPU copies).  ``out`` fills the caller's own arrays (see
        :meth:`KVFile.load`).  ``verify`` overrides the bucket's policy for this call: "always" (True)
        checks the CRC-32s of everything read, "once" skips the check when this object already
        verified the same file (same device, inode, size, mtime and ctime), False skips it.  A stale context
        (ingested under another ``model_hash`` than its model's current one) is a StaleContextError unless
        ``force``."""
        from mcf.bucket.tiers import select, to_torch

        policy = self.verify if verify is None else _verify_policy(verify)
        if out is not None and as_torch:
            raise InvalidArgumentError("out= and as_torch=True exclude each other")

        meta = self.lookup(context_id)  # absent or expired contexts are not served from a tier either
        if model is not None:
            self._check_model(meta, model)
        refusal = self._refusal(meta, force=force)
        if refusal is not None:
            raise refusal
        self._honour_preference(context_id, meta)
        hot, warm = self._tier_copies(context_id, meta)
        if as_torch and hot is not None:
            # copies on the device: the tier's own tensors stay what every later load returns
            res = [(k.clone(), v.clone()) for k, v in select(hot[1], layers, tokens)]
        elif warm is not None:
            # views of the tier's read-only arrays (the flag cannot be set back on a view)
            res = [(k.view(), v.view()) for k, v in select(warm, layers, tokens)]
            if out is not None:
                res = _copy_into(out, res)
        else:
            with self.open(context_id) as f:
                ident = f.identity() if policy == "once" else None
                rec = (ident, f.header.checksum)
                skip = ident is not None and rec in (self._verified.get(context_id), self._read_verified(context_id))
                res = f.load(layers, tokens=tokens, threads=threads, verify=policy != "never" and not skip,
                             out=out)
                if ident is not None and f.verified and not skip:
                    self._verified[context_id] = rec
                    self._write_verified(context_id, rec)
        if as_torch and hot is None:
            res = [(to_torch(k), to_torch(v)) for k, v in res]
        if record_access:
            self._touch(context_id)
        return res

    # -- tiers ---------------------------------------------------------------------------------------
    def tier(self, context_id: str) -> str:
        """"hot" (torch tensors on a device), "warm" (decompressed in RAM) or "cold" (on disk only)."""
        return self._tiers.tier(context_id)

    @property
    def warm_used_bytes(self) -> int:
        """Bytes the warm tier holds: its arrays, and the hot copies on the CPU counted with them."""
        return self._tiers.warm.used_bytes

    def _tier_copies(self, context_id: str, meta: dict) -> tuple[Any, Any]:
        """(hot entry, warm arrays) of ``context_id`` that hold the committed data ``meta`` describes, each
        None when absent.  Ids come from the content, not the values: a copy read before the context was
        deleted and stored again (by this process or another) is of other data, told apart by its tag,
        and dropped here instead of being served."""
        return self._tiers.copies(context_id, meta)

    def _drop_hot(self, context_id: str) -> None:
        """Drop the hot copy (and its charge on the warm budget when it is in host memory)."""
        self._tiers.drop_hot(context_id)

    def _drop_tiers(self, context_id: str) -> None:
        self._tiers.drop(context_id)

    def _evicted(self, ids: list[str]) -> None:
        """Contexts the warm tier evicted for room: a hot copy in host memory, charged to the warm entry,
        leaves with it (a device's copy stays: its memory is the device's)."""
        self._tiers.evicted(ids, self._emit)

    def promote(self, context_id: str, target_tier: str = "warm", *, device: Any = "cuda", threads: int = 2) -> str:
        """Move a context to a faster tier: ``warm`` loads and decompresses it into RAM (evicting the
        least recently used warm contexts past the budget; :class:`~mcf.bucket.tiers.WarmBudgetError`,
        with nothing read, when it is larger than the whole budget); ``hot`` also places it on ``device``
        through torch (InvalidArgumentError when torch or the device is missing;
        :class:`~mcf.bucket.tiers.HotTierFullError`, the context left warm, when the device runs out of
        memory).  A hot copy on ``device="cpu"`` is host memory: it counts against the warm budget
        with the warm arrays (twice the context's warm size in all), and leaves when they are evicted."""
        with self._tiers.mutex:
            if target_tier not in ("warm", "hot"):
                raise InvalidArgumentError(f"promote to 'warm' or 'hot', not {target_tier!r}")
            meta = self.lookup(context_id)
            refusal = self._key_refusal(meta)  # before anything is read, as for the budget
            if refusal is not None:
                raise refusal
            dev = check_device(device) if target_tier == "hot" else None
            self._tiers.fill(context_id, meta, dev, open_kv=lambda: self.open(context_id), threads=threads,
                             emit=self._emit)
            self._tiers.set_at[context_id] = self.clock()
            self._emit("context.promoted", model_id=meta["model_id"], context_id=context_id, to_tier=target_tier)
            return self.tier(context_id)

    def demote(self, context_id: str, target_tier: str = "cold") -> str:
        """Move a context to a slower tier (``warm`` drops its device copy, ``cold`` drops both)."""
        with self._tiers.mutex:
            check_context_id(context_id)
            if target_tier not in ("warm", "cold"):
                raise InvalidArgumentError(f"demote to 'warm' or 'cold', not {target_tier!r}")
            before = self.tier(context_id)
            self._drop_hot(context_id)
            if target_tier == "cold":
                self._tiers.warm.pop(context_id)
            self._tiers.set_at[context_id] = self.clock()
            if before != self.tier(context_id):
                self._emit("context.demoted", context_id=context_id, from_tier=before, to_tier=self.tier(context_id))
            return self.tier(context_id)

    # -- the "once" verification record -----------------------------------------------------------------
    def _read_verified(self, context_id: str) -> tuple | None:
        """The (identity, checksum) recorded in the context's .verified.json by the last process that
        checked its kv_data.mcb completely; None when absent, unreadable, too large or not a regular
        file."""
        return read_verified(self._fs, context_id)

    def _write_verified(self, context_id: str, rec: tuple) -> None:
        """Record a complete, successful check so other processes with verify="once" can skip it.  A
        cache: written atomically without fsync, and a bucket that cannot be written just goes without."""
        write_verified(self._fs, context_id, rec, now=self.clock())

    # -- persistent tier preferences -----------------------------------------------------------------
    def set_tier_preference(self, context_id: str, tier: str, *, device: str | None = None) -> dict:
        """Record in metadata.json the tier ``context_id`` should live in ("cold", "warm" or "hot" on
        ``device``).  Tiers are process memory, so this is what a command line (or any short-lived
        process) can change: every Bucket serving this directory honours the preference on its next
        ``load`` of the context, and :meth:`apply_tier_preferences` (run by the server at start-up)
        applies all of them.  An instruction given later in a process (``promote``/``demote``) wins
        over an older preference, and a newer preference over an older instruction."""
        check_context_id(context_id)
        if tier not in TIERS:
            raise InvalidArgumentError(f"tier must be one of {', '.join(TIERS)}, not {tier!r}")
        if device is not None and (tier != "hot" or not isinstance(device, str)):
            raise InvalidArgumentError("a device is only meaningful for the hot tier")
        with self._lock():
            meta = self._read_meta(context_id)
            if self._expired(meta, self.clock()):
                raise ContextNotFoundError(f"context {context_id!r} expired at {meta['timestamps']['expires_at']}")
            meta.setdefault("storage", {})["preference"] = {"tier": tier, "device": device, "set_at": self.clock()}
            self._write_meta(meta)
            self._journal_locked([self._put_record(meta, self._meta_stamp(context_id))])
        return meta

    def _honour_preference(self, context_id: str, meta: dict) -> None:
        """Move ``context_id`` to its preferred tier when the preference is newer than this process's
        last instruction for it.  A preference this process cannot meet (hot without torch or the
        device, larger than the warm budget) falls back to warm, then to cold, with an event saying so;
        a load never fails because of a preference."""
        with self._tiers.mutex:
            set_at, action, tiers = preference_steps(meta, self.tier(context_id), self._tiers.set_at.get(context_id))
            if set_at is None:
                return
            self._tiers.set_at[context_id] = set_at
            if action == "demote":
                self.demote(context_id, tiers[0])
            for t in tiers if action == "promote" else ():
                try:
                    self.promote(context_id, t, device=preference(meta)[1] or "cuda")
                    break
                except InvalidArgumentError as exc:
                    self._emit("context.preference_unmet", context_id=context_id, tier=t, reason=str(exc))
            self._tiers.set_at[context_id] = set_at

    def apply_tier_preferences(self) -> dict[str, str]:
        """Honour every unexpired context's tier preference now (the server does this at start-up, so
        contexts marked warm are in RAM before the first request); returns {context_id: tier}."""
        out = {}
        state = self._registry()
        with self._mem:
            summaries = [c for m in state["models"].values() for c in m["contexts"].values()]
        for c in summaries:
            if c.get("preferred_tier") in ("warm", "hot"):
                try:
                    meta = self.lookup(c["context_id"])
                except (ContextNotFoundError, FormatError):
                    continue
                self._honour_preference(c["context_id"], meta)
                out[c["context_id"]] = self.tier(c["context_id"])
        return out

    def _write_meta(self, meta: dict, *, durable: bool = True) -> None:
        """Replace a committed context's metadata.json (caller holds the lock).  Access statistics are
        written without fsync (``durable=False``): a crash may lose the last counts, never the file."""
        write_metadata(self._fs, meta, durable=durable)

    def _touch(self, context_id: str) -> None:
        with self._lock():
            try:
                meta = self._read_meta(context_id)
            except ContextNotFoundError:
                return  # deleted meanwhile: the caller already holds its arrays
            meta["access"]["count"] += 1
            meta["timestamps"]["last_accessed"] = iso(self.clock())
            self._write_meta(meta, durable=False)

    def pin(self, context_id: str, *, pinned: bool = True) -> dict:
        """Pinned contexts never expire and are never reaped by gc."""
        with self._lock():
            meta = self._read_meta(check_context_id(context_id))
            meta["pinned"] = bool(pinned)
            self._write_meta(meta)
            self._journal_locked([self._put_record(meta, self._meta_stamp(context_id))])
        return meta

    def delete(self, context_id: str) -> None:
        """Remove a context (its directory, registry entry and cached copies); emits ``context.deleted``."""
        self._delete(context_id, event="context.deleted")

    def _delete(self, context_id: str, *, event: str) -> None:
        rel = ctx_rel(context_id)
        try:
            with self._lock():
                if self._fs.lstat(rel) is None:
                    raise ContextNotFoundError(f"no context {context_id!r} in {self.root}")
                try:
                    model_id = self._read_meta(context_id)["model_id"]
                except (FormatError, ContextNotFoundError, MCFIOError):
                    model_id = None
                grave = f"contexts/.del-{uuid.uuid4().hex}"
                self._fs.rename(rel, grave)  # a planted link is moved (and removed) as itself
                self._fs.fsync_dir("contexts")
                self._journal_locked([{"op": "del", "context_id": context_id}])
                self._fs.remove_tree(grave)
        except ContextNotFoundError:
            with self._tiers.mutex:  # deleted by another process: copies of it are of nothing
                self._drop_tiers(context_id)
            raise
        # after the rename, under the tier mutex: a promotion that read the old file holds the mutex until
        # its copy is in a tier, so this drops that copy too, and one that starts later finds no context
        with self._tiers.mutex:
            self._drop_tiers(context_id)
        self._emit(event, model_id=model_id, context_id=context_id)

    def gc(self) -> list[str]:
        """Delete expired (unpinned) contexts and leftovers of crashed writers; returns the ids deleted."""
        now = self.clock()
        gone = []
        for cid in self._scan_ids():
            try:
                meta = self._read_meta(cid)
            except (FormatError, ContextNotFoundError, MCFIOError):
                continue
            if self._expired(meta, now):
                with contextlib.suppress(ContextNotFoundError):
                    self._delete(cid, event="context.expired")
                    gone.append(cid)
        with self._lock(), self._fs.dir("contexts") as cfd:
            for name, st in self._fs.listdir("contexts"):
                if st is not None and (name.startswith(".del-") or (
                        name.startswith(".tmp-") and time.time() - st.st_mtime > STALE_TMP_SECONDS)):
                    self._fs.remove_tree_at(cfd, name)
        return gone

    def _scan_ids(self) -> list[str]:
        """The committed context directories (and links planted under such names, which readers refuse)."""
        return sorted(name for name, st in self._fs.listdir("contexts")
                      if CTX_RE.fullmatch(name) and st is not None
                      and (stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)))

    def _rebuild_locked(self) -> dict:
        state = self._reg.empty_state()
        skipped = []
        hashes: dict[str, Any] = {}
        for cid in self._scan_ids():
            stamp = self._meta_stamp(cid)
            try:
                meta = self._read_meta(cid)  # also checks that kv_data.mcb is a regular file
            except (FormatError, ContextNotFoundError, InvalidArgumentError, MCFIOError) as exc:
                skipped.append({"context_id": cid, "reason": str(exc)})
                continue
            mid = meta["model_id"]
            if mid not in hashes:
                hashes[mid] = self._model_hash(mid)
            m = state["models"].setdefault(mid, {"model_hash": hashes[mid], "contexts": {}})
            m["contexts"][cid] = summary(meta)
            state["stamps"][cid] = stamp
        state["skipped"] = skipped
        self._reg.write_snapshot_locked(state)
        return state

    def rebuild(self, *, emit: bool = True) -> dict:
        """Recreate registry.json from ``contexts/`` (after a crash or by hand), re-reading every
        metadata.json.  Returns the registry; its ``skipped`` list names context directories that could
        not be read, and why."""
        with self._lock():
            state = self._rebuild_locked()
        reg = json.loads(json.dumps(document(state)))
        if emit:
            self._emit("registry.rebuilt", contexts=[c["context_id"] for m in reg["models"] for c in m["contexts"]])
        return reg
