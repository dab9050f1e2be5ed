"""Old import paths of modules that moved, kept working.

The converters, loaders and applications used to sit at the top of the package and inside the format
packages (``mcf.imatrix``, ``mcf.megatron.tokenize``, ``mcf.bucket.server``, ...).  They now live in the
layer they belong to (``mcf.conversion``, ``mcf.loaders``, ``mcf.apps``; docs/architecture.md), and
code written against the old paths keeps importing them: ``import mcf.imatrix`` gives the very module
object ``mcf.conversion.imatrix`` is, so patching one patches the other.

A table of strings and a finder on ``sys.meta_path``: nothing is imported until an old path is.
``mcf.convert``, ``mcf.export`` and ``mcf.pack`` are not here: those names are the functions.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "mcf.imatrix": "mcf.conversion.imatrix",
    "mcf.second_moment": "mcf.conversion.second_moment",
    "mcf.quant_policy": "mcf.conversion.quant_policy",
    "mcf.sniff": "mcf.conversion.sniff",
    "mcf.tokenizer": "mcf.conversion.tokenizer",
    "mcf.models.bert": "mcf.conversion.bert",
    "mcf.gguf.convert": "mcf.conversion.gguf",
    "mcf.megatron.tokenize": "mcf.conversion.tokenize",
    "mcf.megatron.raydata": "mcf.conversion.raydata",
    "mcf.state_dict": "mcf.loaders.state_dict",
    "mcf.demo": "mcf.apps.demo",
    "mcf.bucket.server": "mcf.apps.bucket_server",
    "mcf.bucket.cli": "mcf.apps.bucket_cli",
    "mcf.megatron.cli": "mcf.apps.megatron_cli",
    "mcf.megacontext.cli": "mcf.apps.megacontext_cli",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at the new one (the same object).  The import
    system stamps the alias's spec on the module it gets; the module's own is put back."""

    def __init__(self):
        self._specs: dict = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED and fullname != "mcf.models":
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname == "mcf.models")

    def create_module(self, spec):
        if spec.name == "mcf.models":   # the old package of mcf.models.bert: an empty namespace
            return None
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        own = self._specs.pop(module.__spec__.name, None)
        if own is not None:
            module.__spec__ = own


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
