"""The names inside a bucket directory: its files, and the model and context ids that become path
components.  One place, because the bucket's operations and its registry both build paths from them,
and an id is only ever turned into a path after :func:`check_context_id` / :func:`check_model_id`
accepted it (``ctx_`` + 32 hex digits, or a short name without ``..``: never a path outside the bucket).
The root's own name has one rule too: what a server tells its clients never includes it
(:func:`root_scrubber`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mcf.errors import InvalidArgumentError

__all__ = ["CTX_RE", "JOURNAL_NAME", "KV_NAME", "LOCK_NAME", "META_NAME", "MODEL_RE", "REGISTRY_NAME", "TOKENS_NAME",
           "VERIFIED_NAME", "check_context_id", "check_model_id", "ctx_rel", "model_rel", "root_scrubber"]

KV_NAME = "kv_data.mcb"
META_NAME = "metadata.json"
REGISTRY_NAME = "registry.json"
JOURNAL_NAME = "registry.journal"
LOCK_NAME = ".lock"
#: written next to kv_data.mcb after a complete successful CRC check (see Bucket.load's verify="once")
VERIFIED_NAME = ".verified.json"
#: the token ids of a context ingested with them (int64 LE; AES-256-GCM in an encrypted bucket): what KV events
#: announce (mcf.bucket.kv_events)
TOKENS_NAME = "token_ids.bin"
CTX_RE = re.compile(r"^ctx_[0-9a-f]{32}$")
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_model_id(model_id: Any) -> str:
    if not isinstance(model_id, str) or not MODEL_RE.fullmatch(model_id) or ".." in model_id:
        raise InvalidArgumentError(
            f"invalid model id {model_id!r}: 1-128 characters of letters, digits, '.', '_', '-', "
            "starting with a letter or digit, no '..'")
    return model_id


def check_context_id(context_id: Any) -> str:
    if not isinstance(context_id, str) or not CTX_RE.fullmatch(context_id):
        raise InvalidArgumentError(f"invalid context id {context_id!r}: expected 'ctx_' and 32 lowercase hex digits")
    return context_id


def ctx_rel(context_id: str) -> str:
    """``contexts/<id>``, relative to the bucket root (the id checked first)."""
    return "contexts/" + check_context_id(context_id)


def model_rel(model_id: str) -> str:
    """``models/<id>.json``, relative to the bucket root (the id checked first)."""
    return f"models/{check_model_id(model_id)}.json"


def root_scrubber(*roots: str | os.PathLike) -> Callable[[str], str]:
    """A function that replaces every spelling of the bucket directory in a message with ``<bucket>``.

    Why every spelling: a client must not learn where the bucket lives, and messages name files with the
    spelling the bucket was opened with (``--root a/../b`` stays ``a/../b``, which neither the absolute
    nor the resolved path matches).  Each of ``roots`` is taken as given, as a Path writes it, normalized,
    absolute (with and without ``..`` resolved) and with links resolved, without trailing slashes.  A
    spelling is replaced only as whole path components: a relative root ``b`` leaves ``abc/b``, ``b.json``
    and the word "bad" alone.  Spellings of only dots and slashes (``.``) hide nothing and are left."""
    spellings = set()
    for root in roots:
        r = os.fsdecode(os.fspath(root))
        for s in (r, str(Path(r)), os.path.normpath(r), str(Path(r).absolute()), os.path.abspath(r),
                  os.path.realpath(r)):
            s = s.rstrip("/") or s
            if s.strip("./"):
                spellings.add(s)
    if not spellings:
        return lambda message: message
    alternatives = "|".join(map(re.escape, sorted(spellings, key=len, reverse=True)))
    pattern = re.compile(rf"(?<![\w.~/-])(?:{alternatives})(?![\w.~-])")
    return lambda message: pattern.sub("<bucket>", message)
