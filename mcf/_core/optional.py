"""Optional dependencies: the one place that imports them and says how to install what is missing.

mcf needs only numpy.  Every other package serves one feature (lz4 and zstd compression, encryption,
the REST server, remote URLs, torch tensors, tokenizing) and is imported when that feature is used,
through :func:`require`, which turns a missing package into :class:`mcf.MissingDependencyError` naming
the package and the extra that installs it.  Packages that only make something faster (zlib-ng,
orjson) or richer (ml_dtypes' bfloat16 dtype) are imported where they are used, with a fallback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from mcf.errors import MissingDependencyError

__all__ = ["DISTRIBUTION", "install_hint", "require"]

#: The name mcf is published under: ``mcf`` on PyPI is an unrelated project (Modified Causal Forest).
#: The import name and the command stay ``mcf``.
DISTRIBUTION = "mcf-formats"


def install_hint(extra: str | None, package: str | None) -> str:
    """``pip install 'mcf-formats[extra]' (or: pip install package)``: what a message tells a user to run."""
    if extra is None:
        return f"pip install {package}"
    return f"pip install '{DISTRIBUTION}[{extra}]' (or: pip install {package})"


def require(module: str, *, feature: str, extra: str | None, package: str | None = None,
            error: type = MissingDependencyError) -> ModuleType:
    """Import ``module`` for ``feature``, or raise :class:`MissingDependencyError` saying to install
    ``package`` (default: the module's top-level name) with the ``extra``.  ``error`` may name a subclass
    for callers whose contract promises another class as well."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pkg = package or module.split(".")[0]
        missing = isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == module.split(".")[0]
        state = "which is not installed" if missing else f"which is installed but does not import ({exc})"
        raise error(f"{feature} needs the {pkg!r} package, {state}: {install_hint(extra, pkg)}",
                    package=pkg, extra=extra, feature=feature) from exc
