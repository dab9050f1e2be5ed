"""Optional dependencies: the one place that imports them and says how to install what is missing.

mcf needs only numpy.  Every other package serves one feature (lz4 and zstd compression, encryption,
the REST server, remote URLs, torch tensors, tokenizing) and is imported when that feature is used,
through :func:`require`, which turns a missing package into :class:`mcf.MissingDependencyError` naming
the package and the extra that installs it.  Packages that only make something faster (zlib-ng,
orjson) or richer (ml_dtypes' bfloat16 dtype) are imported where they are used, with a fallback.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from mcf.errors import MissingDependencyError

__all__ = ["DISTRIBUTION", "EXTRAS", "install_hint", "missing_packages", "require"]

#: The name mcf is published under: ``mcf`` on PyPI is an unrelated project (Modified Causal Forest).
#: The import name and the command stay ``mcf``.
DISTRIBUTION = "mcf-formats"

_BUCKET = (("lz4", "lz4"), ("zstandard", "zstandard"), ("zlib_ng", "zlib-ng"), ("cryptography", "cryptography"))

#: What each extra of pyproject.toml installs, as (module to import, requirement to ``pip install``):
#: the modules are what :func:`missing_packages` looks for, without importing them, so that a missing
#: extra is named whole at the first failure (``tests/test_packaging.py`` holds this table to
#: pyproject.toml's).  The test extras are not here: nothing in the package needs them.
EXTRAS = {
    "demo": (("tokenizers", "tokenizers"), ("lz4", "lz4"), ("safetensors", "safetensors")),
    "bf16": (("ml_dtypes", "ml_dtypes"),),
    "tokenize": (("tokenizers", "tokenizers"), ("zstandard", "zstandard"), ("fastokens", "fastokens"),
                 ("tiktoken", "tiktoken"), ("msgspec", "msgspec")),
    "bucket": _BUCKET,
    "server": _BUCKET + (("starlette", "starlette"), ("uvicorn", "uvicorn"), ("zmq", "pyzmq"), ("msgpack", "msgpack")),
    "remote": (("obstore", "obstore"), ("fsspec", "fsspec"), ("aiohttp", "aiohttp")),
    "torch": (("torch", "torch"),),
    "transformers": (("transformers", "transformers"), ("torch", "torch")),
    "ray": (("ray", "ray[data]"), ("pyarrow", "ray[data]"), ("tokenizers", "tokenizers")),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None  # None also when sys.modules[module] is None
    except (ImportError, ValueError):  # a parent that fails to import; a module without __spec__
        return False


def missing_packages(extra: str) -> list:
    """The requirements of ``extra`` whose module cannot be found, in the table's order, each once.
    Nothing is imported: a lookup on the import path only."""
    out = []
    for module, requirement in EXTRAS.get(extra, ()):
        if requirement not in out and not _installed(module):
            out.append(requirement)
    return out


def _shell_word(requirement: str) -> str:
    return f"'{requirement}'" if "[" in requirement else requirement


def install_hint(extra: str | None, packages) -> str:
    """What a message tells a user to run: ``pip install 'mcf-formats[extra]' ('.[extra]' from a checkout),
    or: pip install pkg ...``.  ``packages`` is one requirement or a list of them."""
    packages = [packages] if isinstance(packages, str) else [p for p in packages if p]
    direct = f"pip install {' '.join(_shell_word(p) for p in packages)}"
    if extra is None:
        return direct
    return f"pip install '{DISTRIBUTION}[{extra}]' ('.[{extra}]' from a checkout), or: {direct}"


def require(module: str, *, feature: str, extra: str | None, package: str | None = None,
            error: type = MissingDependencyError) -> ModuleType:
    """Import ``module`` for ``feature``, or raise :class:`MissingDependencyError` saying to install
    ``package`` (default: the module's top-level name) with the ``extra``, and naming every other
    package of the extra that is missing too.  ``error`` may name a subclass for callers whose contract
    promises another class as well."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pkg = package or module.split(".")[0]
        missing = isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == module.split(".")[0]
        state = "which is not installed" if missing else f"which is installed but does not import ({exc})"
        others = [p for p in missing_packages(extra) if p != pkg] if extra is not None else []
        if others:
            names = ", ".join(repr(p) for p in others)
            state += f"; the {extra!r} extra's {names} {'is' if len(others) == 1 else 'are'} missing too"
        raise error(f"{feature} needs the {pkg!r} package, {state}: {install_hint(extra, [pkg] + others)}",
                    package=pkg, extra=extra, feature=feature, missing=[pkg] + others) from exc
