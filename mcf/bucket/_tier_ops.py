"""The tiers one :class:`mcf.bucket.Bucket` object holds: its warm arrays and hot tensors, the mutex that
guards them, and the moves that fill and empty them.

The tiers' mechanics and policy (the warm budget and its eviction order, torch placement, preferences,
expiry) are :mod:`mcf.bucket.tiers`; the bucket (:mod:`mcf.bucket.store`) looks a context up, decides
whether it may be served and emits the events.  What is here ties each copy in memory to the committed
data it was read from: a copy is tagged with that data (its checksum and when it was committed,
:func:`data_tag`), and a copy whose tag is not the context's current one is dropped instead of served.
Ids come from the content, not the values, so a context deleted and stored again (by this process or
another) has the same id and other data.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mcf.bucket.tiers import WarmCache, hot_copy, nbytes_of, warm_nbytes

if TYPE_CHECKING:
    from mcf.bucket.kvfile import KVFile

__all__ = ["ProcessTiers", "data_tag", "in_host_memory"]


def data_tag(meta: dict) -> tuple[str, str]:
    """What tells two contexts of one id apart (the id depends on the content, not on the values): the
    checksum of the stored data and when it was committed."""
    return meta["storage"]["checksum"], meta["timestamps"]["created_at"]


def in_host_memory(device: Any) -> bool:
    """True for a torch device whose tensors live in the process's own RAM."""
    return device.type == "cpu"


class ProcessTiers:
    """The warm tier (a :class:`~mcf.bucket.tiers.WarmCache` of ``warm_budget_bytes``) and the hot tier
    of one bucket object, with the mutex that guards both and when this process last set each context's
    tier (what a persistent preference is compared with).  Threads of one process (the server's pool)
    share the bucket object: every method that changes a tier runs under ``mutex``."""

    def __init__(self, warm_budget_bytes: int) -> None:
        self.warm = WarmCache(warm_budget_bytes)
        #: context id -> (torch device, per-layer tensors, tag of the data they hold: see copies)
        self.hot: dict[str, tuple[Any, list[tuple[Any, Any]], Any]] = {}
        self.mutex = threading.RLock()
        #: context id -> when this process last set its tier (an instruction, or a preference honoured)
        self.set_at: dict[str, float] = {}

    def tier(self, context_id: str) -> str:
        """"hot" (torch tensors on a device), "warm" (decompressed in RAM) or "cold" (on disk only)."""
        return "hot" if context_id in self.hot else "warm" if context_id in self.warm else "cold"

    def copies(self, context_id: str, meta: dict) -> tuple[Any, Any]:
        """(hot entry, warm arrays) of ``context_id`` that hold the committed data ``meta`` describes, each
        None when absent.  A copy read before the context was deleted and stored again is of other data,
        told apart by its tag, and dropped here instead of being served."""
        tag = data_tag(meta)
        with self.mutex:
            if self.warm.tag(context_id) not in (None, tag):
                self.drop(context_id)
            hot = self.hot.get(context_id)
            if hot is not None and hot[2] != tag:
                self.drop_hot(context_id)
                hot = None
            return hot, self.warm.get(context_id)

    def drop_hot(self, context_id: str) -> None:
        """Drop the hot copy (and its charge on the warm budget when it is in host memory)."""
        entry = self.hot.pop(context_id, None)
        if entry is not None and in_host_memory(entry[0]):
            self.warm.uncharge(context_id)

    def drop(self, context_id: str) -> None:
        """Drop every copy of ``context_id``."""
        self.hot.pop(context_id, None)
        self.warm.pop(context_id)

    def evicted(self, ids: list[str], emit: Callable[..., None]) -> None:
        """Contexts the warm tier evicted for room: a hot copy in host memory, charged to the warm entry,
        leaves with it (a device's copy stays: its memory is the device's); ``emit`` is told of each."""
        for old in ids:
            entry = self.hot.get(old)
            from_tier = "warm"
            if entry is not None and in_host_memory(entry[0]):
                del self.hot[old]
                from_tier = "hot"
            emit("context.demoted", context_id=old, from_tier=from_tier, to_tier=self.tier(old),
                 reason="warm budget")

    def fill(self, context_id: str, meta: dict, device: Any, *, open_kv: Callable[[], KVFile], threads: int,
             emit: Callable[..., None]) -> None:
        """Put the committed context ``meta`` describes into the warm tier (read with ``open_kv``, unless a
        copy of its data is there) and, with a torch ``device``, into the hot tier on it; the caller holds
        the mutex.  Both budgets are checked against the metadata's size before anything is read
        (:class:`~mcf.bucket.tiers.WarmBudgetError`); a hot copy on the CPU is charged to the warm entry
        (:class:`~mcf.bucket.tiers.HotTierFullError` when the device runs out of memory, the context left
        warm).  ``emit`` is told of the contexts evicted for room."""
        on_host = device is not None and in_host_memory(device)
        size = warm_nbytes(meta)
        # both budgets are checked against the metadata's size before anything is read
        self.warm.check_fits(context_id, 2 * size if on_host else size,
                             what=" (its warm arrays and their hot copy on the CPU)" if on_host else "")
        _, layers = self.copies(context_id, meta)
        if layers is None:
            # room is made before the arrays are allocated; each byte is then decompressed (or copied)
            # once, straight into the arrays the tier keeps
            self.evicted(self.warm.make_room(context_id, size), emit)
            with open_kv() as f:
                # the tag of the file actually read: if the context was replaced since the lookup,
                # this copy matches the new metadata only when it holds the new data
                tag = (f"crc32:{f.header.checksum:08x}", meta["timestamps"]["created_at"])
                layers = f.load_copy(threads=threads)
            self.warm.put(context_id, layers, tag=tag)
        if device is not None:
            self.drop_hot(context_id)
            if on_host:
                self.evicted(self.warm.charge(context_id, nbytes_of(layers)), emit)
            try:
                self.hot[context_id] = (device, hot_copy(context_id, layers, device), self.warm.tag(context_id))
            except BaseException:
                self.warm.uncharge(context_id)
                raise
