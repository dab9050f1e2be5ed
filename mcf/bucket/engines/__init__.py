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

__all__ = ["engine_class"]


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
    return Missing
