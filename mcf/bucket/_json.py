"""The bucket's JSON documents (metadata.json, models/<id>.json, registry.json, .verified.json):
parsing with a FormatError that names the file, writing, typed field access, and the ISO 8601
timestamps they hold.  Shared by the bucket's operations (:mod:`mcf.bucket.store`) and its registry
(:mod:`mcf.bucket._registry`).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mcf.errors import FormatError

__all__ = ["MAX_DOC_BYTES", "dumps", "get_field", "iso", "loads", "parse_iso", "parse_json"]

try:  # orjson parses and writes the registry snapshot 3-5x faster; the json module is the fallback
    import orjson as _orjson
except ImportError:  # pragma: no cover - the test extra installs orjson
    _orjson = None

#: metadata.json, models/<id>.json and .verified.json larger than this are refused unread (a planted
#: multi-gigabyte file must not be read into memory); prefix hashes of a 10M-token context take ~1.4 MB
MAX_DOC_BYTES = 64 << 20


def loads(raw: bytes) -> Any:
    if _orjson is not None:
        try:
            return _orjson.loads(raw)
        except _orjson.JSONDecodeError:
            pass  # let the json module word the error (and accept what it accepts, e.g. huge ints)
    return json.loads(raw.decode("utf-8"))


def dumps(obj: Any, compact: bool) -> bytes:
    if compact and _orjson is not None:
        try:
            return _orjson.dumps(obj)
        except TypeError:  # integers beyond 64 bits
            pass
    return json.dumps(obj, indent=None if compact else 1, separators=(",", ":") if compact else None).encode()


def parse_json(raw: bytes, path: Path) -> Any:
    try:
        return loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"malformed JSON: {exc}", path=path) from None


def get_field(obj: Any, path: Path, *keys: str, types: type | tuple[type, ...] = object) -> Any:
    """``obj[k0][k1]...`` with a FormatError naming the field when a level is missing or mistyped."""
    cur = obj
    for i, k in enumerate(keys):
        if not isinstance(cur, dict) or k not in cur:
            raise FormatError("missing field", path=path, field=".".join(keys[: i + 1]))
        cur = cur[k]
    if not isinstance(cur, types) or (isinstance(cur, bool) and types is int):
        raise FormatError("wrong type", path=path, field=".".join(keys), expected=str(types), got=type(cur).__name__)
    return cur


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_iso(s: Any, path: Path, field: str) -> float | None:
    if s is None:
        return None
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except (AttributeError, TypeError, ValueError):
        raise FormatError("not an ISO 8601 timestamp", path=path, field=field, got=s) from None
