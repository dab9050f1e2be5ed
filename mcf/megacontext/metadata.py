"""metadata.json of a MegaContext tree: the fields of seed 000, their validation and the atomic write.

Seed 000's fields are kept as it names them (``version``, ``created_at``, ``model_name``,
``embedding_dim``, ``block_size``, ``levels`` with ``num_tokens``/``num_blocks``/``num_gists`` and
``file_size_bytes``, ``gistnet_checkpoint``, ``ingestion_complete``, ``last_modified``).  mcf adds
``gist_dtype``, an optional ``vocab_size`` and, per gist level, ``gists``: run-length ranges saying which
GistNet checkpoint produced which gists (``{"start", "stop", "gistnet_checkpoint", "pending"}``;
``pending`` marks a range being rewritten in place, so an interrupted rewrite is visible).

The file is a summary, written last in every commit: the counts in the .ctx headers are the commit
point, so metadata.json may lag them (after a killed writer) but never lead them.
"""

from __future__ import annotations

import json
import math
import os
import time

from mcf._core.fs import fsync_file, publish, read_regular, write_all
from mcf.errors import FormatError, MCFError, MissingFileError, UnsupportedVersionError, os_error
from mcf.remote import is_url
from mcf.remote._urls import join_path
from mcf.megacontext._layout import CTX_DTYPES, LEVEL_FILES, file_size, gist_dtypes

__all__ = ["METADATA", "VERSION", "new_metadata", "read_metadata", "validate_metadata", "write_metadata",
           "counts_of", "with_counts", "set_range", "now_iso", "LEVEL_KEYS"]

METADATA = "metadata.json"
VERSION = 1
LEVEL_KEYS = ("LOD0", "LOD1", "LOD2")
MAX_BYTES = 64 << 20   # a metadata.json larger than this is not ours (refuse before parsing)


def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def new_metadata(*, model_name: str, embedding_dim: int, block_size: int, gist_dtype,
                 vocab_size: int | None = None, gistnet_checkpoint: str | None = None) -> dict:
    now = now_iso()
    meta = {
        "version": VERSION,
        "created_at": now,
        "model_name": model_name,
        "embedding_dim": embedding_dim,
        "block_size": block_size,
        "gist_dtype": gist_dtype,
        "vocab_size": vocab_size,
        "levels": {},
        "gistnet_checkpoint": gistnet_checkpoint,
        "ingestion_complete": False,
        "last_modified": now,
    }
    return with_counts(meta, (0, 0, 0))


def counts_of(meta: dict) -> tuple:
    lv = meta["levels"]
    return lv["LOD0"]["num_tokens"], lv["LOD1"]["num_gists"], lv["LOD2"]["num_gists"]


def with_counts(meta: dict, counts) -> dict:
    """A copy of ``meta`` whose levels describe ``counts`` = (tokens, LOD1 gists, LOD2 gists)."""
    d = meta["embedding_dim"]
    k = meta["block_size"]
    gdt = gist_dtypes(meta["gist_dtype"])
    old = meta.get("levels") or {}
    t, n1, n2 = counts
    levels = {"LOD0": {"num_blocks": t // k, "num_tokens": t, "file_size_bytes": file_size(0, t, d, CTX_DTYPES[0])}}
    for key, n, level in (("LOD1", n1, 1), ("LOD2", n2, 2)):
        ranges = [dict(r) for r in (old.get(key) or {}).get("gists", [])]
        levels[key] = {"num_gists": n, "file_size_bytes": file_size(level, n, d, gdt[level]), "gists": _clip(ranges, n)}
    out = dict(meta)
    out["levels"] = levels
    return out


def _clip(ranges, n):
    out = []
    for r in ranges:
        if r["start"] >= n:
            continue
        r = dict(r)
        r["stop"] = min(r["stop"], n)
        out.append(r)
    return out


def set_range(ranges: list, start: int, stop: int, checkpoint, *, pending: bool = False) -> list:
    """The ranges with ``[start, stop)`` set to ``checkpoint``; neighbours with equal values merge."""
    if stop <= start:
        return [dict(r) for r in ranges]
    out = []
    for r in ranges:
        if r["stop"] <= start or r["start"] >= stop:
            out.append(dict(r))
            continue
        if r["start"] < start:
            out.append(dict(r, stop=start))
        if r["stop"] > stop:
            out.append(dict(r, start=stop))
    out.append({"start": start, "stop": stop, "gistnet_checkpoint": checkpoint, "pending": bool(pending)})
    out.sort(key=lambda r: r["start"])
    merged = []
    for r in out:
        if (merged and merged[-1]["stop"] == r["start"]
                and merged[-1]["gistnet_checkpoint"] == r["gistnet_checkpoint"]
                and merged[-1]["pending"] == r["pending"]):
            merged[-1]["stop"] = r["stop"]
        else:
            merged.append(r)
    return merged


# -- validation --------------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_metadata(obj, *, path=None) -> list:
    """Every problem of a parsed metadata.json, as FormatError instances (empty when valid)."""
    errs = []

    def bad(field, reason, expected=None, got=None, cls=FormatError):
        errs.append(cls(reason, path=path, field=field, expected=expected, got=got))

    if not isinstance(obj, dict):
        bad("metadata", "metadata.json is not a JSON object", got=type(obj).__name__)
        return errs
    v = obj.get("version")
    if not _is_int(v):
        bad("version", "missing or not an integer", expected=VERSION, got=v)
    elif v != VERSION:
        bad("version", "unsupported metadata version", expected=VERSION, got=v, cls=UnsupportedVersionError)
    for key in ("embedding_dim", "block_size"):
        x = obj.get(key)
        if not _is_int(x) or not 1 <= x <= 0xFFFF:
            bad(key, "missing or outside 1..65535" if x != 0 else f"{key} is 0", expected="1..65535", got=x)
    if not isinstance(obj.get("model_name"), str):
        bad("model_name", "missing or not a string", got=obj.get("model_name"))
    g = obj.get("gist_dtype", "fp16")
    gdt = None
    names = ("fp16", "bf16", "fp32", "q8")
    if isinstance(g, str) and g in names or (isinstance(g, dict) and set(g) == {"LOD1", "LOD2"}
                                             and all(isinstance(v, str) and v in names for v in g.values())):
        gdt = gist_dtypes(g)
    else:
        bad("gist_dtype", "unknown gist dtype", expected='fp16, bf16, fp32, q8 or {"LOD1": ..., "LOD2": ...}',
            got=g)
    vs = obj.get("vocab_size")
    if vs is not None and (not _is_int(vs) or vs < 1):
        bad("vocab_size", "not a positive integer", got=vs)
    ck = obj.get("gistnet_checkpoint")
    if ck is not None and not isinstance(ck, str):
        bad("gistnet_checkpoint", "not a string or null", got=ck)
    if not isinstance(obj.get("ingestion_complete"), bool):
        bad("ingestion_complete", "missing or not a boolean", got=obj.get("ingestion_complete"))
    for key in ("created_at", "last_modified"):
        if not isinstance(obj.get(key), str):
            bad(key, "missing or not a string", got=obj.get(key))
    levels = obj.get("levels")
    if not isinstance(levels, dict):
        bad("levels", "missing or not an object", got=levels)
        return errs
    k = obj.get("block_size") if _is_int(obj.get("block_size")) and obj.get("block_size") > 0 else None
    d = obj.get("embedding_dim") if _is_int(obj.get("embedding_dim")) and obj.get("embedding_dim") > 0 else None
    counts = {}
    for li, key in enumerate(LEVEL_KEYS):
        lv = levels.get(key)
        f = f"levels.{key}"
        if not isinstance(lv, dict):
            bad(f, "missing or not an object", got=lv)
            continue
        ckey = "num_tokens" if li == 0 else "num_gists"
        n = lv.get(ckey)
        if not _is_int(n) or n < 0:
            bad(f"{f}.{ckey}", "missing or not a non-negative integer", got=n)
            continue
        counts[li] = n
        fs = lv.get("file_size_bytes")
        if li == 0 or (d is not None and gdt is not None):
            want = file_size(li, n, d or 1, CTX_DTYPES[0] if li == 0 else gdt[li])
            if not _is_int(fs) or fs != want:
                bad(f"{f}.file_size_bytes", f"does not match {ckey}", expected=want, got=fs)
        if li == 0:
            nb = lv.get("num_blocks")
            if k is not None and (not _is_int(nb) or nb not in (n // k, -(-n // k))):
                bad(f"{f}.num_blocks", "does not match num_tokens", expected=n // k, got=nb)
        else:
            errs.extend(_validate_ranges(lv.get("gists", []), n, f"{f}.gists", path))
    if k is not None:
        if 0 in counts and 1 in counts and counts[1] > math.ceil(counts[0] / k):
            bad("levels.LOD1.num_gists", "more LOD1 gists than LOD0 blocks",
                expected=f"<= ceil({counts[0]} / {k})", got=counts[1])
        if 1 in counts and 2 in counts and counts[2] > math.ceil(counts[1] / k):
            bad("levels.LOD2.num_gists", "more LOD2 gists than groups of LOD1 gists",
                expected=f"<= ceil({counts[1]} / {k})", got=counts[2])
    return errs


def _validate_ranges(ranges, n, field, path):
    errs = []
    if not isinstance(ranges, list):
        return [FormatError("not a list", path=path, field=field, got=type(ranges).__name__)]
    prev = 0
    for i, r in enumerate(ranges):
        f = f"{field}[{i}]"
        if (not isinstance(r, dict) or not _is_int(r.get("start")) or not _is_int(r.get("stop"))
                or not (r.get("gistnet_checkpoint") is None or isinstance(r.get("gistnet_checkpoint"), str))
                or not isinstance(r.get("pending", False), bool)):
            errs.append(FormatError("a range is {start, stop, gistnet_checkpoint, pending}", path=path,
                                    field=f, got=r))
            continue
        if not prev <= r["start"] < r["stop"] <= n:
            errs.append(FormatError("ranges must be sorted, non-empty, disjoint and within the gists",
                                    path=path, field=f, expected=f"{prev} <= start < stop <= {n}",
                                    got=[r["start"], r["stop"]]))
            continue
        prev = r["stop"]
    return errs


def read_metadata(dirpath) -> dict:
    """Read and validate ``<dirpath>/metadata.json``; raises the first problem."""
    meta, errs = load_metadata(dirpath)
    if errs:
        raise errs[0]
    return meta


def load_metadata(dirpath):
    """(metadata or None, problems) without raising: what ``verify`` needs to list everything."""
    path = join_path(dirpath, METADATA)
    try:
        if is_url(path):  # a read-only tree over fsspec
            from mcf.remote import RemoteFile

            with RemoteFile(path) as f:
                raw = f.read(MAX_BYTES + 1)
        else:  # a regular file (a FIFO or a device is refused, never read)
            raw = read_regular(path, limit=MAX_BYTES, what="metadata.json")
    except FileNotFoundError:
        import errno

        return None, [MissingFileError(errno.ENOENT, "metadata.json is missing (not a MegaContext tree, or "
                                                     "its creation was interrupted)", path)]
    except FormatError as exc:  # larger than MAX_BYTES
        return None, [exc]
    except OSError as exc:
        return None, [exc if isinstance(exc, MCFError) else os_error(exc, path)]
    if len(raw) > MAX_BYTES:
        return None, [FormatError("metadata.json is too large", path=path, field="metadata",
                                  expected=f"<= {MAX_BYTES} bytes")]
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, [FormatError(f"not valid JSON: {exc}", path=path, field="metadata")]
    errs = validate_metadata(obj, path=path)
    if errs:
        return None, errs
    obj.setdefault("gist_dtype", "fp16")
    obj.setdefault("vocab_size", None)
    for key in ("LOD1", "LOD2"):
        lv = obj["levels"][key]
        if "gists" not in lv:   # seed 000's metadata: its one gistnet_checkpoint made every gist
            n = lv["num_gists"]
            lv["gists"] = [{"start": 0, "stop": n, "gistnet_checkpoint": obj.get("gistnet_checkpoint"),
                            "pending": False}] if n else []
        for r in lv["gists"]:  # both keys are optional in a range: give every reader them
            r.setdefault("pending", False)
            r.setdefault("gistnet_checkpoint", None)
    return obj, []


def write_metadata(dirpath, meta: dict, *, durable: bool = False, name: str = METADATA) -> None:
    """Replace metadata.json (or ``name``) atomically (temporary file + rename), so readers see the old
    or the new version, never a torn one."""
    dirpath = os.fspath(dirpath)
    path = os.path.join(dirpath, name)
    tmp = path + ".tmp"
    data = json.dumps(meta, indent=2).encode("utf-8") + b"\n"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            write_all(fd, data)
            if durable:
                fsync_file(fd)
        finally:
            os.close(fd)
        publish(tmp, path, durable=durable)
    except OSError as exc:
        if isinstance(exc, MCFError):
            raise
        raise os_error(exc, path) from None


def level_file(dirpath, level: int) -> str:
    return join_path(dirpath, LEVEL_FILES[level])
