"""Paths of the reference files the tests use (copied from shared/vectors so the suite stands alone)."""

import json
import os

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
