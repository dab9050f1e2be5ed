"""The bucket's model registry: ``models/<model_id>.json``, what a model requires of its contexts, and
staleness.

A model document records the model's identity (``model_hash``: which weights) and its compatibility
(architecture, vocab_size, layers, kv heads, head_dim, dtype).  An ingest under a registered model checks
the KV data against it and records in the context's metadata what computed it (the ``model`` block,
:func:`model_block`); a load or :meth:`mcf.bucket.Bucket.check_compatible` compares that block with the
model asked for (:func:`check_model`).  Registering the model again with another hash makes its older
contexts *stale*: computed by weights that are no longer the model's (:func:`stale`).  A context with
no recorded hash, or of a model without one, is never stale: nothing says which weights computed it.

The :class:`mcf.bucket.Bucket` methods of the same names carry these out on its directory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mcf.bucket import _layout as L
from mcf.bucket._fs import BucketFS
from mcf.bucket._json import MAX_DOC_BYTES, get_field, iso, parse_json
from mcf.bucket._names import check_model_id, model_rel
from mcf.bucket._registry import made_by
from mcf.errors import ContextNotFoundError, FormatError, InvalidArgumentError, MCFIOError, StaleContextError

__all__ = ["COMPATIBILITY_KEYS", "check_model", "check_staleness_meta", "current_hash", "model_block",
           "new_model_document", "read_model", "stale_error", "stale_under"]

#: what a model may require of a context (Bucket.check_compatible, load(model=...)); register_model records
#: all but model_hash as the model's ``model_compatibility``, and model_hash as its identity
COMPATIBILITY_KEYS = ("architecture", "num_layers", "num_kv_heads", "head_dim", "dtype", "vocab_size", "model_hash")


def new_model_document(model_id: str, *, architecture: str | None, num_layers: int | None,
                       num_kv_heads: int | None, head_dim: int | None, dtype: str | None, vocab_size: int | None,
                       model_hash: str | None, clock: Callable[[], float]) -> dict:
    """The model document :meth:`mcf.bucket.Bucket.register_model` writes, every field checked first
    (InvalidArgumentError); ``clock`` gives its ``created_at``."""
    compat = {"architecture": architecture, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
              "head_dim": head_dim, "dtype": None if dtype is None else L.DTYPE_NAMES[L.parse_dtype(dtype)],
              "vocab_size": vocab_size}
    for k in ("num_layers", "num_kv_heads", "head_dim", "vocab_size"):
        v = compat[k]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise InvalidArgumentError(f"{k} must be a non-negative integer, got {v!r}")
    for k, v in (("architecture", architecture), ("model_hash", model_hash)):
        if v is not None and (not isinstance(v, str) or not v or len(v) > 256):
            raise InvalidArgumentError(f"{k} must be a non-empty string of at most 256 characters, got {v!r}")
    return {"model_id": check_model_id(model_id), "model_hash": model_hash, "created_at": iso(clock()),
            "model_compatibility": compat}


def read_model(fs: BucketFS, model_id: str) -> dict | None:
    """The model document of ``model_id`` in the bucket ``fs``, or None when the model was never
    registered; FormatError when it is not a model document of that model."""
    rel = model_rel(model_id)
    p = fs.where(rel)
    try:
        doc = parse_json(fs.read(rel, limit=MAX_DOC_BYTES), p)
    except FileNotFoundError:
        return None
    get_field(doc, p, "model_compatibility", types=dict)
    # every reader below relies on both (fuzz: a document without model_id made a KeyError escape)
    if get_field(doc, p, "model_id", types=str) != model_id:
        raise FormatError("model document names another model", path=p, field="model_id", expected=model_id,
                          got=doc["model_id"])
    return doc


def current_hash(read: Callable[[str], dict | None], model_id: str) -> str | None:
    """The registered model's hash (``read`` gives its document); None when unregistered or unreadable
    (the registry is a cache: a damaged model document must not stop contexts from being listed)."""
    try:
        doc = read(model_id)
    except (FormatError, MCFIOError):
        return None
    return (doc or {}).get("model_hash")


def model_block(model_id: str, doc: dict | None, shape: L.KVShape, dtype_name: str) -> dict | None:
    """The ``model`` block an ingest records in a context's metadata (None when ``model_id`` is not
    registered: ``doc`` is None), after checking the KV data's shape and dtype against the model
    document ``doc`` (InvalidArgumentError)."""
    if doc is None:
        return None
    compat = doc["model_compatibility"]
    for k, have in (("num_layers", shape.num_layers), ("num_kv_heads", shape.num_kv_heads),
                    ("head_dim", shape.head_dim), ("dtype", dtype_name)):
        if compat.get(k) is not None and compat[k] != have:
            raise InvalidArgumentError(f"model {model_id!r} needs {k}={compat[k]!r}, the KV data has {have!r}")
    # what computed this KV data (seed 003 §7.1): checked again at load, and the hash marks it stale
    # once the model is registered with other weights
    return {"architecture": compat.get("architecture"), "vocab_size": compat.get("vocab_size"),
            "model_hash": doc.get("model_hash")}


def check_model(meta: dict, model: dict | str, read: Callable[[str], dict | None]) -> None:
    """Raise unless the context ``meta`` can be used with ``model`` (a model id, whose document ``read``
    gives, or a dict of :data:`COMPATIBILITY_KEYS`), staleness aside: check_compatible's comparison."""
    context_id = meta["context_id"]
    if isinstance(model, str):
        doc = read(model)
        if doc is None:
            raise ContextNotFoundError(f"unknown model {model!r}")
        if doc["model_id"] != meta["model_id"]:
            raise InvalidArgumentError(f"{context_id} belongs to model {meta['model_id']!r}, not {model!r}")
        # the registered hash is the current one: comparing it with the context's is the stale check
        compat = doc["model_compatibility"]
        model = {k: compat.get(k) for k in COMPATIBILITY_KEYS if k != "model_hash"}
    if not isinstance(model, dict):
        raise InvalidArgumentError(f"model must be a model id or a compatibility dict, got {type(model).__name__}")
    unknown = [k for k in model if k not in COMPATIBILITY_KEYS]
    if unknown:
        raise InvalidArgumentError(f"unknown key(s) {', '.join(map(repr, unknown))} in the model given for "
                                   f"{context_id}; the known ones are {', '.join(COMPATIBILITY_KEYS)}")
    want = dict(model)
    if want.get("dtype") is not None:
        want["dtype"] = L.DTYPE_NAMES[L.parse_dtype(want["dtype"])]
    shape, dtype = meta["kv_cache"]["shape"], meta["kv_cache"]["dtype"]
    maker = made_by(meta)
    have = {"num_layers": shape["num_layers"], "num_kv_heads": shape["num_kv_heads"], "head_dim": shape["head_dim"],
            "dtype": dtype, "architecture": maker.get("architecture"), "vocab_size": maker.get("vocab_size"),
            "model_hash": maker.get("model_hash")}
    for k, w in want.items():
        # architecture, vocab_size and model_hash are known for contexts ingested under a registered model only
        if w is not None and have[k] is not None and have[k] != w:
            raise InvalidArgumentError(f"{context_id} is incompatible: {k} is {have[k]!r}, the model needs {w!r}")


def stale_under(context_hash: Any, current_hash: Any) -> bool:
    """True when a context computed by the weights ``context_hash`` is stale under the model's current
    ``current_hash`` (both known, and different)."""
    return context_hash is not None and current_hash is not None and context_hash != current_hash


def stale_error(meta: dict, current: str | None) -> StaleContextError | None:
    """The StaleContextError of the context ``meta`` when it is stale under the model's current hash
    ``current`` (what load and check_compatible raise), else None."""
    if not stale_under(made_by(meta).get("model_hash"), current):
        return None
    return StaleContextError(
        f"{meta['context_id']} is stale: it was computed by model {meta['model_id']!r} with weights "
        f"{made_by(meta)['model_hash']}, and the model is now registered with {current}"
        " (ingest the content again, or load(..., force=True) to use it anyway)")


def check_staleness_meta(meta: dict) -> dict:
    """``meta``, a caller's metadata dict given to :meth:`mcf.bucket.Bucket.is_stale`, once what the
    staleness check reads is there and of its type (InvalidArgumentError)."""
    if not isinstance(meta.get("model_id"), str):
        raise InvalidArgumentError(f"is_stale: the metadata has no model_id string (got "
                                   f"{meta.get('model_id', 'none')!r}); give a context id or its metadata "
                                   "as lookup() returns it")
    maker = meta.get("model")
    if maker is not None and not isinstance(maker, dict):
        raise InvalidArgumentError(f"is_stale: the metadata's model must be an object or null, got "
                                   f"{type(maker).__name__}")
    if maker is not None and not isinstance(maker.get("model_hash"), (str, type(None))):
        raise InvalidArgumentError(f"is_stale: the metadata's model.model_hash must be a string or null, got "
                                   f"{type(maker['model_hash']).__name__}")
    return meta
