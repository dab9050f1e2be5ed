"""An LMCache remote storage plugin that keeps LMCache's serialized chunks in a bucket's pages.

LMCache's configuration (YAML, or ``LMCACHE_*`` variables)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_serde: naive
    remote_storage_plugins: ["mcf"]
    extra_config:
      remote_storage_plugin.mcf.module_path: mcf.bucket.engines.lmcache
      remote_storage_plugin.mcf.class_name: BucketConnector
      remote_storage_plugin.mcf.root: /data/mcb                      # the bucket's directory

LMCache's plugin loader (``lmcache/v1/storage_backend/connector/__init__.py``) imports the module and
wraps :class:`BucketConnector` (a ``RemoteConnector``) in its ``DynamicConnectorAdapter``, which makes it
with ``(loop=, local_cpu_backend=, config=)`` for the URL ``plugin://mcf``.  That call does not say which
plugin entry it is for, so the connector finds its entry as the one whose ``module_path`` is this module:
one mcf entry per LMCache configuration (the name, ``mcf`` here, is free).  The connector stores each
chunk under LMCache's key string (``model@world@worker@hash@dtype``, ``CacheEngineKey.to_string()``) as
one page: LMCache's chunk header (``RemoteMetadata``: length, format, dtype and shape per group) is the
page's metadata and the chunk's bytes its payload, so a page is exactly what LMCache's ``fs://``
connector writes, with the bucket's header and checksums around it.

Other keys under ``remote_storage_plugin.<name>.``: ``namespace`` (default ``lmcache``; keys already
name model, world size and worker), ``ttl``, ``durable``, ``verify``, ``warm_budget_bytes``,
``threads``.

Through ``mcf bucket serve``: ``remote_storage_plugin.<name>.url: http://host:8765`` instead of ``root``
(:class:`mcf.bucket.remote_pages.RemotePageStore`); the token is ``remote_storage_plugin.<name>.token``
or, better, the ``MCF_BUCKET_TOKEN`` environment variable; ``timeout`` (seconds, default 60).  The
server's own settings (TTL, durability, its limits) apply there.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mcf.bucket.engines import engine_class, require_engine
from mcf.bucket.pages import PageStore
from mcf.bucket.remote_pages import RemotePageStore
from mcf.errors import InvalidArgumentError

__all__ = ["BucketConnector", "plugin_name_of", "plugin_options"]

_FEATURE = "the LMCache remote storage plugin (mcf.bucket.engines.lmcache)"
RemoteConnector = engine_class("lmcache.v1.storage_backend.connector.base_connector", "RemoteConnector",
                               feature=_FEATURE, package="lmcache")

_LOCAL = ("ttl", "durable", "verify", "warm_budget_bytes", "threads")
_REMOTE = ("url", "token", "timeout")
_KNOWN = ("module_path", "class_name", "root", "namespace") + _LOCAL + _REMOTE


def plugin_options(extra_config: dict | None, plugin_name: str) -> dict[str, Any]:
    """The ``remote_storage_plugin.<plugin_name>.*`` entries of LMCache's ``extra_config``, without the
    prefix; unknown ones are an error (a misspelt ``rooot`` must not fall back to a default)."""
    prefix = f"remote_storage_plugin.{plugin_name}."
    opts = {k[len(prefix):]: v for k, v in (extra_config or {}).items() if k.startswith(prefix)}
    unknown = sorted(set(opts) - set(_KNOWN))
    if unknown:
        raise InvalidArgumentError(f"unknown options of the mcf LMCache plugin {plugin_name!r}: "
                                   f"{[prefix + k for k in unknown]}; known: {list(_KNOWN)}")
    where = [k for k in ("root", "url") if isinstance(opts.get(k), str) and opts[k]]
    if len(where) != 1 or len([k for k in ("root", "url") if k in opts]) != 1:
        raise InvalidArgumentError(f"the mcf LMCache plugin {plugin_name!r} needs one of {prefix}root (the bucket's "
                                   f"directory) or {prefix}url (a server of it, mcf bucket serve)")
    if "url" in opts and any(k in opts for k in _LOCAL):
        raise InvalidArgumentError(f"{[prefix + k for k in _LOCAL if k in opts]} are the server's own settings: "
                                   f"they do not apply with {prefix}url")
    return opts


def plugin_name_of(extra_config: dict | None) -> str:
    """The name of the one ``remote_storage_plugins`` entry whose ``module_path`` is this module."""
    names = sorted(k[len("remote_storage_plugin."):-len(".module_path")] for k, v in (extra_config or {}).items()
                   if k.startswith("remote_storage_plugin.") and k.endswith(".module_path") and v == __name__)
    if len(names) != 1:
        raise InvalidArgumentError(f"the mcf LMCache plugin needs exactly one remote_storage_plugin.<name>.module_path "
                                   f"equal to {__name__!r} in extra_config, found {names}")
    return names[0]


def _open_store(opts: dict[str, Any]) -> PageStore | RemotePageStore:
    if "url" in opts:  # the token: the option, else $MCF_BUCKET_TOKEN; never in a message
        timeout = float(opts.get("timeout", 60.0))
        return RemotePageStore(opts["url"], opts.get("namespace", "lmcache"), token=opts.get("token"), timeout=timeout)
    local = {k: opts[k] for k in _LOCAL if k in opts}
    for k in ("durable", "verify"):  # LMCACHE_EXTRA_CONFIG and YAML may give strings
        if isinstance(local.get(k), str):
            local[k] = local[k].lower() in ("1", "true", "yes")
    for k in ("warm_budget_bytes", "threads"):
        if isinstance(local.get(k), str):
            local[k] = int(local[k])
    if isinstance(local.get("ttl"), str):
        local["ttl"] = float(local["ttl"])
    return PageStore(opts["root"], opts.get("namespace", "lmcache"), **local)


class BucketConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` over a bucket's pages."""

    def __init__(self, loop: Any, local_cpu_backend: Any, config: Any, *, metadata: Any = None,
                 plugin_name: str | None = None) -> None:
        require_engine(self)
        super().__init__(config, metadata if metadata is not None else local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.plugin_name = plugin_name or plugin_name_of(config.extra_config)
        self.store = _open_store(plugin_options(config.extra_config, self.plugin_name))

    # -- keys ----------------------------------------------------------------------------------------
    @staticmethod
    def _key(key: Any) -> str:
        return key.to_string()

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # -- existence -----------------------------------------------------------------------------------
    async def exists(self, key: Any) -> bool:
        return self.exists_sync(key)  # one stat (or one request): cheaper than a thread hop

    def exists_sync(self, key: Any) -> bool:
        return self.store.exists(self._key(key))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list) -> int:
        return self.store.prefix_hits([self._key(k) for k in keys])

    async def batched_async_contains(self, lookup_id: str, keys: list, pin: bool = False) -> int:
        return self.batched_contains(keys)

    # -- reading -------------------------------------------------------------------------------------
    def _get_sync(self, key: Any) -> Any:
        from lmcache.v1.protocol import RemoteMetadata

        box: list = []

        def alloc(meta: bytes, size: int) -> Any:
            if self.save_chunk_meta:
                if len(meta) < self.remote_metadata_bytes:
                    return None
                md = RemoteMetadata.deserialize(meta)
                obj = self.local_cpu_backend.allocate(md.shapes, md.dtypes, md.fmt)
            else:
                obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if obj is None:
                return None
            box.append(obj)
            view = memoryview(obj.byte_array).cast("B")
            if self.save_chunk_meta:
                return view if len(view) == size else None
            return view[:size] if 0 < size <= len(view) else None

        try:
            got = self.store.read(self._key(key), alloc)
        except BaseException:
            for obj in box:
                obj.ref_count_down()
            raise
        if got is None:
            for obj in box:
                obj.ref_count_down()
            return None
        obj = box[0]
        if not self.save_chunk_meta:
            obj = self.reshape_partial_chunk(obj, len(got))
        return obj

    async def get(self, key: Any) -> Any:
        return await self._run(self._get_sync, key)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list) -> list:
        return await asyncio.gather(*(self.get(k) for k in keys))

    # -- writing -------------------------------------------------------------------------------------
    def _meta(self, memory_obj: Any) -> bytes:
        if not self.save_chunk_meta:
            return b""
        from lmcache.v1.protocol import RemoteMetadata

        return RemoteMetadata(len(memory_obj.byte_array), memory_obj.get_shapes(), memory_obj.get_dtypes(),
                              memory_obj.get_memory_format()).serialize()

    def _put_sync(self, key: Any, memory_obj: Any) -> None:
        self.store.put(self._key(key), memory_obj.byte_array, meta=self._meta(memory_obj), replace=True)

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self._run(self._put_sync, key, memory_obj)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list, memory_objs: list) -> None:
        await asyncio.gather(*(self.put(k, m) for k, m in zip(keys, memory_objs)))

    # -- the rest ------------------------------------------------------------------------------------
    async def list(self) -> list[str]:
        return await self._run(self.store.keys)

    def remove_sync(self, key: Any) -> bool:
        return self.store.delete(self._key(key))

    async def close(self) -> None:
        self.store.close()
