"""Which tensors a load returns (``names=``) and which piece of each (``slices=``): names or glob
patterns, matched against the tensors of a checkpoint.

Patterns follow :func:`fnmatch.fnmatchcase` (case-sensitive everywhere, ``*`` also matches dots:
``"layers.*.mlp.*"``).  An entry that is a tensor's exact name is that name, even if it contains
``*``, ``?`` or ``[``; any other entry with those characters is a pattern.  A plain name that is not in
the checkpoint, and a pattern that matches nothing, are errors that name them: a typo in a rank's
plan must not load a model with a missing or whole weight.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping

from mcf.errors import ArgumentTypeError, InvalidArgumentError, TensorNotFoundError
from mcf.loading.slices import Rows, Shard

__all__ = ["select_names", "match_slices", "selection"]

_GLOB = re.compile(r"[*?\[]")


def _entries(names, what: str):
    if isinstance(names, (str, bytes)):
        raise InvalidArgumentError(f"{what} must be a list of tensor names or patterns, not one string "
                                   f"({what}=[{names!r}])")
    try:
        entries = list(names)
    except TypeError:
        raise ArgumentTypeError(f"{what} must be a list of tensor names or patterns, got "
                                f"{type(names).__name__}") from None
    for e in entries:
        if not isinstance(e, str):
            raise ArgumentTypeError(f"every entry of {what} must be a str, got {e!r} ({type(e).__name__})")
    return entries


def _matches(entry: str, available, known: set, path: str, what: str) -> list:
    """The tensors ``entry`` names: itself when it is a tensor's name, else the tensors a pattern
    matches (in ``available``'s order); an error when there are none."""
    if entry in known:
        return [entry]
    if _GLOB.search(entry):
        rx = re.compile(fnmatch.translate(entry))
        found = [n for n in available if rx.match(n)]
        if not found:
            raise TensorNotFoundError(f"{path}: no tensor matches the pattern {entry!r} of {what}")
        return found
    raise TensorNotFoundError(f"{path}: no tensor named {entry!r} (in {what})")


def select_names(names, available, path: str) -> list:
    """The tensors ``names`` asks for, each once: every entry's matches in turn, a pattern's in the order
    of ``available`` (the checkpoint's order); all of ``available`` when ``names`` is None."""
    if names is None:
        return list(available)
    known = set(available)
    out, seen = [], set()
    for entry in _entries(names, "names"):
        for n in _matches(entry, available, known, path, "names"):
            if n not in seen:
                seen.add(n)
                out.append(n)
    return out


def match_slices(slices, available, path: str) -> dict:
    """``name -> Rows | Shard | None`` from a slice plan ``{name or pattern: spec}``: the first entry
    that matches a tensor decides for it (so ``{"*norm*": None, "*": Shard(r, n)}`` keeps norms whole);
    None means the whole tensor.  Every key must match some tensor of the checkpoint."""
    if slices is None:
        return {}
    if not isinstance(slices, Mapping):
        raise ArgumentTypeError(f"slices must be a mapping of tensor name or pattern -> Rows | Shard | None, "
                                f"got {type(slices).__name__}")
    known = set(available)
    out = {}
    for key in _entries(slices.keys(), "slices"):
        spec = slices[key]
        if spec is not None and not isinstance(spec, (Rows, Shard)):
            raise ArgumentTypeError(f"slices[{key!r}] must be mcf.Rows(start, stop), mcf.Shard(rank, world, dim) "
                                    f"or None, got {spec!r}")
        for n in _matches(key, available, known, path, "slices"):
            out.setdefault(n, spec)
    return out


def selection(names, slices, available, path: str):
    """``(chosen, specs)``: the tensors to load (:func:`select_names`) and the piece of each
    (:func:`match_slices`), every argument checked before anything is read."""
    return select_names(names, available, path), match_slices(slices, available, path)
