"""The bucket as a serving engine's KV store: one plugin per engine, each over :mod:`mcf.bucket.pages`.

* :mod:`mcf.bucket.engines.sglang`: an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``);
* :mod:`mcf.bucket.engines.lmcache`: an LMCache remote storage plugin (``remote_storage_plugins``), on a
  local bucket or on ``mcf bucket serve``;
* :mod:`mcf.bucket.engines.vllm`: a vLLM offloading secondary tier (``secondary_tiers``).

Each module imports without its engine: the engine's base class is imported when the module is, and
where the engine is not installed the plugin class is still defined but raises
:class:`mcf.MissingDependencyError` when it is made.  The keys are the engine's own (its page, chunk or
block hashes): nothing here computes a hash.
"""

from __future__ import annotations

import importlib
from typing import Any

from mcf._core.optional import require

__all__ = ["engine_class", "require_engine"]


def engine_class(module: str, name: str, *, feature: str, package: str) -> type:
    """The engine's class ``module.name``, or, where the engine does not import, a stand-in base whose
    constructor raises :class:`mcf.MissingDependencyError` naming ``package`` (so a plugin module
    imports everywhere and fails only when its plugin is made)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        pass

    class Missing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            require(module, feature=feature, extra=None, package=package)
            raise AssertionError(f"{module} imported on a second try")  # pragma: no cover

    Missing.__name__ = Missing.__qualname__ = f"Missing{name}"
    Missing.engine_missing = True
    return Missing


def require_engine(plugin: object) -> None:
    """Raise :class:`mcf.MissingDependencyError` when ``plugin``'s engine base class is a stand-in (the
    engine is not installed): the first line of each plugin's constructor, before it reads any of the
    engine's objects."""
    for base in type(plugin).__mro__:
        if base.__dict__.get("engine_missing"):
            base.__init__(plugin)
