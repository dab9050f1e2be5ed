"""The warm and hot tiers of a bucket: KV caches held in this process's memory.

Cold is the disk (``kv_data.mcb``).  Warm holds decompressed numpy arrays under a byte budget and
evicts the least recently used context when a new one would pass it, so a server can keep its hottest
contexts ready without growing without bound.  The budget is checked against the size the metadata
records *before* anything is read, and room is made before the new arrays are allocated, so a
promotion never holds more than the budget plus nothing (a context larger than the budget is refused
unread).  Warm arrays are read-only: a caller's ``k *= 10`` on a loaded array must not change what every
later load of the context returns.  Hot holds torch tensors on a device (a GPU when one
exists); it needs torch and says so clearly when torch or the device is missing.  A hot copy on the CPU
is a second copy in the same RAM the warm budget bounds, so it is charged to its warm entry and leaves
with it; a GPU's memory is the device's, and is not budgeted here.  Tiers are per process: they are not
persisted (the file on disk stays the source of truth), and each copy is tagged with the data it was
read from, so a copy of a context deleted and stored again under the same id is never served.

The policy lives here too: which tier a context asks for (its persistent preference in metadata.json),
whether this process should act on that preference (the newer of the preference and this process's
last instruction wins) and in which order to fall back, and when a context has expired (TTL).  The
bucket (:mod:`mcf.bucket.store`) carries the decisions out: it reads the files and emits the events;
the copies one bucket object holds, and the moves between them, are :mod:`mcf.bucket._tier_ops`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from mcf._core.optional import require
from mcf.bucket import _layout as L
from mcf.bucket._json import parse_iso
from mcf.errors import InvalidArgumentError, MissingDependencyError

__all__ = ["TIERS", "HotTierFullError", "WarmBudgetError", "WarmCache", "expired", "hot_copy", "nbytes_of",
           "preference", "preference_steps", "select", "to_torch", "warm_nbytes"]

#: the tiers a context can be asked to live in, slowest first
TIERS = ("cold", "warm", "hot")


def preference(meta: dict) -> tuple[str | None, str | None, float | None]:
    """(tier, device, set_at) of a context's persistent tier preference, or Nones when it has none."""
    pref = (meta.get("storage") or {}).get("preference")
    if not isinstance(pref, dict) or pref.get("tier") not in TIERS:
        return None, None, None
    dev = pref.get("device") if isinstance(pref.get("device"), str) else None
    at = pref.get("set_at")
    return pref["tier"], dev, (at if isinstance(at, (int, float)) and not isinstance(at, bool) else None)


def preference_steps(meta: dict, current: str,
                     last_set_at: float | None) -> tuple[float | None, str, list[str]]:
    """What honouring a context's preference means now: ``(set_at, action, tiers)``.  ``action`` is
    "none" (no preference, one not newer than this process's last instruction ``last_set_at``, or the
    context is already there; ``set_at`` None when nothing is to be recorded), "demote" (to
    ``tiers[0]``) or "promote" (try ``tiers`` in order: a preference this process cannot meet, hot
    without torch or a device, larger than the warm budget, falls back to warm, then stays cold)."""
    tier, _, set_at = preference(meta)
    if tier is None or set_at is None or set_at <= (float("-inf") if last_set_at is None else last_set_at):
        return None, "none", []
    if tier == current:
        return set_at, "none", []
    if TIERS.index(tier) < TIERS.index(current):
        return set_at, "demote", [tier]
    return set_at, "promote", list(TIERS[TIERS.index(tier):0:-1])  # hot, then warm


def expired(summary_or_meta: dict, now: float, *, path: Any) -> bool:
    """True when a context's TTL has passed at ``now`` (a registry summary or a metadata.json); pinned
    contexts never expire.  ``path`` names the document in a malformed timestamp's FormatError."""
    ts = summary_or_meta.get("timestamps", summary_or_meta)
    exp = ts.get("expires_at")
    if exp is None or summary_or_meta.get("pinned", False):
        return False
    return parse_iso(exp, path, "expires_at") <= now


class WarmBudgetError(InvalidArgumentError):
    """A context does not fit the warm tier's byte budget (a well-formed request this process cannot
    satisfy: the server answers 409)."""


def nbytes_of(layers: Sequence[tuple[Any, Any]]) -> int:
    return sum(int(k.nbytes) + int(v.nbytes) for k, v in layers)


def warm_nbytes(meta: dict) -> int:
    """Bytes a context takes in the warm tier, from its (validated) metadata: its K and V arrays as
    loaded (int8 is dequantized to float32)."""
    from mcf.bucket import _layout as L

    shape, kd = meta["kv_cache"]["shape"], L.parse_dtype(meta["kv_cache"]["dtype"])
    itemsize = 4 if kd == L.KVDType.INT8 else L.DTYPE_ITEMSIZE[kd]
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["sequence_length"] * shape["head_dim"] * itemsize


def select(layers: list[tuple[Any, Any]], which: Sequence[int] | int | None,
           tokens: int | None) -> list[tuple[Any, Any]]:
    """The chosen layers and token prefix of a full per-layer (K, V) list (arrays or tensors)."""
    seq = layers[0][0].shape[1]
    sel, ntok = L.selection(which, tokens, len(layers), seq)
    if tokens is None:
        return [layers[i] for i in sel]
    return [(layers[i][0][:, :ntok], layers[i][1][:, :ntok]) for i in sel]


class _Entry:
    """One warm context: its arrays, their bytes, the bytes of the host copy kept with them (a hot copy
    on the CPU) and the tag of the committed data they were read from."""

    __slots__ = ("layers", "nbytes", "extra", "tag")

    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray]], nbytes: int, tag: Any) -> None:
        self.layers, self.nbytes, self.extra, self.tag = layers, nbytes, 0, tag


class WarmCache:
    """context id -> per-layer (K, V) arrays, least recently used first, within ``budget_bytes``.

    An entry may also be charged for a copy of the same data kept elsewhere in host memory (a hot copy
    on the CPU, :meth:`charge`): those bytes count against the budget like the arrays, and an entry
    evicted to make room takes its charge with it, so the caller drops that copy too.  Each entry keeps
    the ``tag`` of the data it was read from (the bucket's (checksum, created_at) of the committed
    context), so a copy of a context deleted and stored again under the same id is told apart."""

    def __init__(self, budget_bytes: int) -> None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
            raise InvalidArgumentError(f"warm budget must be a non-negative integer, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._items: OrderedDict[str, _Entry] = OrderedDict()
        self.used_bytes = 0

    def __contains__(self, cid: str) -> bool:
        return cid in self._items

    def get(self, cid: str) -> list[tuple[np.ndarray, np.ndarray]] | None:
        item = self._items.get(cid)
        if item is None:
            return None
        self._items.move_to_end(cid)
        return item.layers

    def tag(self, cid: str) -> Any:
        """The tag ``cid`` was put with (None when it is not warm)."""
        item = self._items.get(cid)
        return None if item is None else item.tag

    def check_fits(self, cid: str, size: int, *, what: str = "") -> None:
        """WarmBudgetError unless ``size`` bytes fit the whole budget (checked before anything is read)."""
        if size > self.budget_bytes:
            raise WarmBudgetError(f"{cid} needs {size} bytes{what}, more than the warm budget of {self.budget_bytes}")

    def _evict_for(self, size: int, keep: str | None = None) -> list[str]:
        evicted = []
        while self.used_bytes + size > self.budget_bytes:
            old = next(k for k in self._items if k != keep)
            self.pop(old)
            evicted.append(old)
        return evicted

    def make_room(self, cid: str, size: int) -> list[str]:
        """Drop ``cid`` and evict least recently used contexts until ``size`` more bytes fit; returns the
        ids evicted.  WarmBudgetError (nothing evicted) when ``size`` exceeds the whole budget."""
        self.check_fits(cid, size)
        self.pop(cid)
        return self._evict_for(size)

    def put(self, cid: str, layers: list[tuple[np.ndarray, np.ndarray]], *, tag: Any = None) -> list[str]:
        """Insert (most recently used), read-only; returns the ids evicted to stay within the budget."""
        n = nbytes_of(layers)
        evicted = self.make_room(cid, n)
        for k, v in layers:
            k.flags.writeable = False
            v.flags.writeable = False
        self._items[cid] = _Entry(layers, n, tag)
        self.used_bytes += n
        return evicted

    def charge(self, cid: str, extra: int) -> list[str]:
        """Count ``extra`` more bytes against warm context ``cid`` (replacing its former charge), evicting
        other contexts, least recently used first, until they fit; returns the ids evicted.
        WarmBudgetError (nothing evicted) when the context and ``extra`` exceed the whole budget."""
        item = self._items[cid]
        self.check_fits(cid, item.nbytes + extra, what=" with its copy in host memory")
        self.uncharge(cid)
        self._items.move_to_end(cid)
        evicted = self._evict_for(extra, keep=cid)
        item.extra = extra
        self.used_bytes += extra
        return evicted

    def uncharge(self, cid: str) -> None:
        item = self._items.get(cid)
        if item is not None:
            self.used_bytes -= item.extra
            item.extra = 0

    def pop(self, cid: str) -> bool:
        item = self._items.pop(cid, None)
        if item is not None:
            self.used_bytes -= item.nbytes + item.extra
        return item is not None

    def ids(self) -> list[str]:
        return list(self._items)


class HotTierUnavailableError(MissingDependencyError, InvalidArgumentError):
    """torch is not installed: a missing dependency that names its extra, and, as the bucket's contract
    has it, an InvalidArgumentError (a request this machine cannot satisfy: the server answers it so, and
    an unmeetable hot preference falls back to warm)."""


class HotTierFullError(InvalidArgumentError):
    """The device ran out of memory while a context was copied onto it: a well-formed request this
    process cannot satisfy now (the server answers 409, as for the warm budget).  Nothing half-placed
    is kept; the context stays in the warm tier."""


def _torch():
    return require("torch", feature="the hot tier and torch output", extra="torch", error=HotTierUnavailableError)


def to_torch(arr: np.ndarray, *, device: Any = None):
    """A torch tensor holding a copy of ``arr`` (bf16 kept as torch.bfloat16), on ``device``."""
    torch = _torch()
    a = np.array(arr)  # owned and writable: a mapped read-only page must never be handed out as writable
    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if device is None else t.to(device)


def check_device(device: Any):
    """The torch device, or a clear error when it does not exist here."""
    torch = _torch()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"invalid torch device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"device {device!r} is not available: torch sees no CUDA device")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise InvalidArgumentError(f"device {device!r} is not available")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise InvalidArgumentError(f"unsupported device type {dev.type!r}")
    return dev


def hot_copy(context_id: str, layers: Sequence[tuple[Any, Any]], device: Any) -> list:
    """Torch copies of every layer on ``device``, all or nothing: running out of device (or host)
    memory part way raises :class:`HotTierFullError` and drops the copies made so far."""
    torch = _torch()
    oom = tuple(c for c in (getattr(torch, "OutOfMemoryError", None),
                            getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)) if isinstance(c, type))
    try:
        return [(to_torch(k, device=device), to_torch(v, device=device)) for k, v in layers]
    except (MemoryError, *oom) as exc:
        raise HotTierFullError(f"context {context_id!r} does not fit on {device}: out of memory "
                               f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
