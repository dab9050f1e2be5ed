"""mcf: fast, validated readers and writers for the on-disk formats ML infrastructure lives on.

- MCF model containers: :func:`mcf.open`, :class:`mcf.Writer`, :func:`mcf.pack`; checkpoints in and
  out: :func:`mcf.convert` (safetensors, HF directories, GGUF), :func:`mcf.export` (safetensors).
- The I/O core every format reads through: :func:`mcf.io.open_source` (paths, buffers, fsspec URLs).
- Loading weights from MCF files and safetensors checkpoints: :func:`mcf.load_file` and
  :func:`mcf.load_state_dict` (numpy), :func:`mcf.torch.load_file` and :func:`mcf.torch.load_state_dict`
  (torch), :func:`mcf.safetensors.load_file` (the drop-in for ``safetensors.numpy.load_file``); into
  memory the caller holds: :func:`mcf.load_into`, :func:`mcf.torch.load_into`, :func:`mcf.torch.load_model`;
  partial and per-rank loads with ``names=`` and ``slices=`` (:class:`mcf.Rows`, :class:`mcf.Shard`).
- Errors: everything raised on purpose derives from :class:`mcf.MCFError`.
"""

from mcf import io
from mcf.container.reader import Container, Header, Section, open
from mcf._core.dtypes import DType
from mcf.errors import (AccessError, AllocationError, ArgumentTypeError, ChecksumError, ClosedError,
                        ContextNotFoundError, DTypeError, EncryptionKeyError, FormatError, InvalidArgumentError,
                        LoadMismatchError, MCFError, MCFIOError,
                        MissingDependencyError, MissingFileError, OutOfBoundsError, StaleContextError,
                        TensorNotFoundError, TruncatedError, UnknownNameError, UnsupportedVersionError, WorkerError)
from mcf.container.layout import SectionType, quant_layout
from mcf.container.modelinfo import Arch, ModelInfo, RopeType
from mcf.container.quantinfo import QuantRecord
from mcf.container.tensor_index import TensorInfo
from mcf.loaders.state_dict import load_file, load_state_dict
from mcf.loading import Rows, Shard

from mcf._core import aliases as _aliases
from mcf._core.about import VERSION as __version__  # noqa: F401 - written once, read by pyproject.toml too

_aliases.install()   # old import paths of the modules that moved (mcf.imatrix, mcf.megatron.tokenize, ...)


def get_include():
    """The directory to add to Cython's include path to build a compiled extension against mcf:
    ``cimport mcf._core._io`` and ``cimport mcf._core._fpconv`` find their ``.pxd`` files under it.  It
    holds only those (``mcf/_include``), not the directory above the package, which in a normal install
    is all of site-packages.  The ``.pxd`` files need no C header: the C compiler needs nothing from mcf.
    See docs/extending.md."""
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_include")


# The format packages load on first use, so ``import mcf`` stays light and ``mcf.torch.load_file(...)`` works
# as the docs write it without a separate ``import mcf.torch`` (PEP 562).  mcf.torch itself imports
# without torch installed; it says which extra to install when it is used.
_SUBMODULES = frozenset({"torch", "safetensors", "gguf", "remote", "megatron", "megacontext", "bucket", "loading",
                         "conversion", "loaders", "apps"})
# calibration and the tokenizer builder, reachable under their short names as before they moved
_CONVERSION = frozenset({"imatrix", "second_moment", "tokenizer"})


# Names whose modules load on first use: ``import mcf`` loads what mcf.open and mcf.load_file need, not
# the writer, the quantizers and the converters (``from mcf import Writer`` works the same).
_LAZY = {"Writer": "mcf.container.writer", "pack": "mcf.conversion.pack", "convert": "mcf.conversion.checkpoint",
         "export": "mcf.conversion.export", "kernel_info": "mcf._core._kernels", "quantize": "mcf.container.quant",
         "dequantize": "mcf.container.quant", "load_into": "mcf.loaders.into"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"mcf.{name}")
    if name in _CONVERSION:
        import importlib

        return importlib.import_module(f"mcf.conversion.{name}")
    raise AttributeError(f"module 'mcf' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES | _CONVERSION | set(_LAZY))


__all__ = [
    "open", "load_file", "Container", "Header", "Section", "TensorInfo", "ModelInfo", "Arch", "RopeType", "QuantRecord",
    "Writer", "pack", "convert", "export", "kernel_info", "quantize", "dequantize", "DType", "SectionType",
    "quant_layout", "io",
    "MCFError", "FormatError", "TruncatedError", "UnsupportedVersionError", "ChecksumError",
    "OutOfBoundsError", "TensorNotFoundError", "LoadMismatchError", "DTypeError", "ClosedError", "MCFIOError",
    "MissingFileError", "AccessError", "AllocationError", "InvalidArgumentError", "MissingDependencyError",
    "ContextNotFoundError", "ArgumentTypeError", "UnknownNameError", "StaleContextError", "EncryptionKeyError",
    "WorkerError",
    "load_state_dict", "load_into",
    "Rows", "Shard",
    "get_include",
]
