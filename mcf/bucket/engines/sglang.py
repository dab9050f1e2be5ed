"""An SGLang HiCache storage backend that keeps its pages in a bucket (:mod:`mcf.bucket.pages`).

Started by SGLang itself::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "mcf", "module_path": "mcf.bucket.engines.sglang",
        "class_name": "BucketHiCacheStorage", "interface_v1": 1, "root": "/data/mcb"}'

SGLang's factory (``sglang/srt/mem_cache/storage/backend_factory.py``) imports the class and calls
``BucketHiCacheStorage(storage_config, kwargs)``.  Keys are SGLang's page hashes; each page is one page
file.  ``interface_v1: 1`` makes SGLang call :meth:`~BucketHiCacheStorage.batch_get_v1` /
:meth:`~BucketHiCacheStorage.batch_set_v1`, which read and write the host pool's memory in place (no
staging copy); without it SGLang uses ``batch_get`` / ``batch_set`` with one tensor per page.  Both
store the same bytes: a page is the host pool's flat data page (``get_data_page(i, flat=True)``: every
layer's K, then every layer's V), which is also what SGLang's ``HiCacheFile`` writes, so the answers
match its answers on the same operations.

The extra-config keys besides SGLang's three: ``root`` (the bucket's directory; required),
``namespace`` (default: ``sglang-<model>-<tp_rank>-<tp_size>``, and the pipeline and context-parallel
ranks when they are more than one; MLA models share one namespace across tensor-parallel ranks, as
``HiCacheFile`` shares its files), ``ttl`` (seconds), ``durable`` (fsync each page), ``verify``
(default true), ``warm_budget_bytes`` (default 0), ``threads`` (default 4).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from typing import Any

from mcf.bucket.engines import engine_class, require_engine
from mcf.bucket.pages import PageStore
from mcf.errors import InvalidArgumentError

__all__ = ["BucketHiCacheStorage", "default_namespace"]

HiCacheStorage = engine_class("sglang.srt.mem_cache.hicache_storage", "HiCacheStorage",
                              feature="the SGLang HiCache backend (mcf.bucket.engines.sglang)", package="sglang")

_OPTIONS = ("root", "namespace", "ttl", "durable", "verify", "warm_budget_bytes", "threads")
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
_MAMBA_SUFFIX = ".mamba"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", text).strip("-.") or "model"


def default_namespace(storage_config: Any, *, tp_sharded: bool = False) -> str:
    """The namespace of one SGLang rank's pages: what ``HiCacheFile`` puts in its file names' suffix
    (model, tensor-parallel rank and size; pipeline and context-parallel ranks when used; MLA models
    share theirs across tensor-parallel ranks unless ``tp_sharded``)."""
    c = storage_config
    model = _safe("-".join((c.model_name or "").split("/")))
    shard = f"-pp{c.pp_rank}of{c.pp_size}" if c.pp_size > 1 else ""
    if getattr(c, "attn_cp_size", 1) > 1:
        shard += f"-cp{c.attn_cp_rank}of{c.attn_cp_size}"
    if getattr(c, "dcp_size", 1) > 1:
        shard += f"-dcp{c.dcp_rank}of{c.dcp_size}-page{c.logical_page_size}"
    tp = f"-tp{c.tp_rank}of{c.tp_size}"
    ns = f"sglang-{model}{shard if c.is_mla_model and not tp_sharded else tp + shard}"
    if len(ns) > 128:  # a long model name: keep its start, and a digest of the whole
        ns = ns[:111] + "-" + hashlib.sha256(ns.encode()).hexdigest()[:16]
    return ns


def _page_views(pool: Any, host_indices: Any, n_pages: int) -> list[list[memoryview]] | None:
    """Each page's memory in the host pool, as byte views in the flat page's order (K of every layer,
    then V), from the pool's zero-copy metadata; None when the pool has none (then data pages are used)."""
    meta = getattr(pool, "get_page_buffer_meta", None)
    if meta is None:
        return None
    ptrs, sizes = meta(host_indices)
    if not ptrs or len(ptrs) % n_pages:
        return None
    per = len(ptrs) // n_pages
    pages = []
    for p in range(n_pages):
        segs = [memoryview((ctypes.c_char * sizes[i]).from_address(ptrs[i])).cast("B")
                for i in range(p * per, (p + 1) * per)]
        if per % 2 == 0 and hasattr(pool, "v_buffer"):  # MHA: (K, V) pairs -> every K, then every V
            segs = segs[0::2] + segs[1::2]
        pages.append(segs)
    return pages


class BucketHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a bucket's pages (see the module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        require_engine(self)
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - set(_OPTIONS) - set(_SGLANG_KEYS))
        if unknown:
            raise InvalidArgumentError(f"unknown extra-config keys for the mcf HiCache backend: {unknown}; "
                                       f"known: {list(_OPTIONS)}")
        root = extra.get("root")
        if not isinstance(root, str) or not root:
            raise InvalidArgumentError("the mcf HiCache backend needs \"root\": the bucket's directory, in "
                                       "--hicache-storage-backend-extra-config")
        opts = {k: extra[k] for k in ("ttl", "durable", "verify", "warm_budget_bytes", "threads") if k in extra}
        self.storage_config = storage_config
        ns = extra.get("namespace") or default_namespace(storage_config)
        self.store = PageStore(root, ns, **opts)
        tp_ns = extra.get("namespace") or default_namespace(storage_config, tp_sharded=True)
        self.tp_store = self.store if tp_ns == ns else PageStore(root, tp_ns, **opts)
        self.mem_pool_host = None

    def _store(self, key: str) -> PageStore:
        return self.tp_store if key.endswith(_MAMBA_SUFFIX) else self.store

    # -- the legacy interface: one tensor per page -----------------------------------------------------
    @staticmethod
    def _bytes(tensor: Any) -> Any:
        import torch

        return tensor.contiguous().view(torch.uint8).numpy()

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        if target_location is None:
            return None
        if not target_location.is_contiguous():
            return None
        return target_location if self._store(key).get_into(key, self._bytes(target_location)) else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        targets = list(target_locations or [None] * len(keys))
        if any(t is None or not t.is_contiguous() for t in targets) or self.tp_store is not self.store:
            return [self.get(k, t) for k, t in zip(keys, targets)]
        hits = self.store.get_many_into(keys, [self._bytes(t) for t in targets])
        return [t if hit else None for t, hit in zip(targets, hits)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if value is None:
            return False
        return self._store(key).put_many([key], [self._bytes(value)])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        values = list(values or [])
        if len(values) != len(keys):
            return False
        if self.tp_store is not self.store:
            return all(self.set(k, v) for k, v in zip(keys, values))
        return all(self.store.put_many(keys, [self._bytes(v) for v in values]))

    def exists(self, key: str) -> bool:
        return self._store(key).exists(key)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if self.tp_store is self.store:
            return self.store.prefix_hits(keys)
        for i, k in enumerate(keys):
            if not self._store(k).exists(k):
                return i
        return len(keys)

    # -- interface v1: in place in the host pool -----------------------------------------------------
    def _v1_views(self, keys: list[str], host_indices: Any) -> list | None:
        pool = self.mem_pool_host
        if pool is None:
            raise InvalidArgumentError("batch_get_v1/batch_set_v1 before SGLang registered its host pool")
        page = pool.page_size
        if host_indices.numel() != len(keys) * page:
            return None
        return _page_views(pool, host_indices, len(keys))

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        views = self._v1_views(keys, host_indices)
        if views is None and host_indices.numel() != len(keys) * self.mem_pool_host.page_size:
            return [False] * len(keys)
        if views is not None and self.tp_store is self.store:
            return self.store.get_many_into(keys, views)
        pool, page = self.mem_pool_host, self.mem_pool_host.page_size
        out = []
        for i, key in enumerate(keys):
            if views is not None:
                out.append(self._store(key).get_into(key, views[i]))
                continue
            dummy = pool.get_dummy_flat_data_page()
            ok = self._store(key).get_into(key, self._bytes(dummy))
            if ok:
                pool.set_from_flat_data_page(int(host_indices[i * page]), dummy)
            out.append(ok)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        views = self._v1_views(keys, host_indices)
        if views is None and host_indices.numel() != len(keys) * self.mem_pool_host.page_size:
            return [False] * len(keys)
        if views is None:
            pool, page = self.mem_pool_host, self.mem_pool_host.page_size
            views = [self._bytes(pool.get_data_page(int(host_indices[i * page]), flat=True)) for i in range(len(keys))]
        if self.tp_store is self.store:
            return self.store.put_many(keys, views)
        return [self._store(k).put_many([k], [v])[0] for k, v in zip(keys, views)]

    # -- the rest ------------------------------------------------------------------------------------
    def clear(self) -> bool:
        self.store.clear()
        if self.tp_store is not self.store:
            self.tp_store.clear()
        return True

    def get_stats(self) -> Any:
        return None

    def close(self) -> None:
        self.store.close()
        if self.tp_store is not self.store:
            self.tp_store.close()
