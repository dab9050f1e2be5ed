"""Paths of the reference files the tests use (copied from shared/vectors so the suite stands alone)."""

import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MANTLE = os.path.join(HERE, "vectors", "mantle")
MANTLE_FILES = os.path.join(MANTLE, "files")
MANTLE_MODEL = os.path.join(MANTLE, "model", "mcf-testmodel")
FIXTURES = os.path.join(HERE, "fixtures")
MANTLE_NAMES = ("f32", "f16", "q4", "k4", "k3")


def mantle_file(name: str) -> str:
    return os.path.join(MANTLE_FILES, f"{name}.mcf")


def mantle_check(name: str) -> dict:
    with open(os.path.join(MANTLE_FILES, f"{name}.check.json")) as f:
        return json.load(f)


def mantle_manifest() -> dict:
    with open(os.path.join(MANTLE, "manifest.json")) as f:
        return json.load(f)


def load_fixture(relpath: str):
    """Import a generator script under ``tests/fixtures`` by its path (``"mcf_golden.py"``,
    ``"megatron/megatron_golden.py"``).  tests/fixtures is never put on sys.path: its data directories
    (``fixtures/gguf``, ``fixtures/megatron``...) would be importable there as namespace packages, and
    ``import gguf`` would find one when the real package is not installed."""
    path = os.path.join(FIXTURES, relpath)
    name = "fixture_" + os.path.splitext(os.path.basename(path))[0]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # before running it: dataclasses and pickling look the module up
        spec.loader.exec_module(mod)
    return sys.modules[name]
