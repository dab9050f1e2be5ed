"""``mcf bucket ingest|ls|show|rm|gc|rebuild|verify`` (every command takes ``--root DIR``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mcf.errors import InvalidArgumentError

__all__ = ["add_bucket_parser"]


def _bucket(args):
    from mcf.bucket.store import Bucket

    return Bucket(args.root, create=args.bucket_cmd in ("ingest", "serve"))


def _print(obj) -> None:
    print(json.dumps(obj, indent=1))


def _load_npz(path: str):
    """KV arrays from an .npz holding ``k`` and ``v``, each [num_layers, num_kv_heads, seq_len, head_dim]."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if "k" not in z.files or "v" not in z.files:
                raise InvalidArgumentError(f"{path}: expected arrays 'k' and 'v' (got {sorted(z.files)})")
            k, v = z["k"], z["v"]
    except (OSError, ValueError) as exc:
        if isinstance(exc, InvalidArgumentError):
            raise
        raise InvalidArgumentError(f"{path}: not a readable .npz file ({exc})") from None
    if k.ndim != 4 or k.shape != v.shape:
        raise InvalidArgumentError(f"{path}: 'k' and 'v' must both be [layers, heads, tokens, head_dim], got {k.shape} "
                                   f"and {v.shape}")
    return [(k[i], v[i]) for i in range(k.shape[0])]


def cmd_ingest(args) -> int:
    layers = _load_npz(args.kv)
    kw = {}
    if args.tokens is not None:
        try:
            kw["token_ids"] = np.load(args.tokens, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(f"{args.tokens}: not a readable .npy file ({exc})") from None
    elif args.text_file is not None:
        kw["content"] = Path(args.text_file).read_bytes()
    else:
        kw["content"] = args.text
    meta = _bucket(args).ingest(args.model, layers, name=args.name, source=args.source, dtype=args.dtype,
                                compression=args.compression, ttl=args.ttl, pinned=args.pin, **kw)
    _print({"context_id": meta["context_id"], "deduplicated": meta.get("deduplicated", False),
            "token_count": meta["content"]["token_count"], "size_bytes": meta["kv_cache"]["size_bytes"]})
    return 0


def cmd_ls(args) -> int:
    b = _bucket(args)
    models = [args.model] if args.model else [m["model_id"] for m in b.registry()["models"]]
    rows = [dict(c, model_id=m) for m in models for c in b.discover(m, force_scan=args.scan)]
    if args.json:
        _print(rows)
    else:
        for r in rows:
            print(f"{r['context_id']}  {r['model_id']}  {r['token_count']:>8} tok  {r['size_bytes']:>12} B  "
                  f"{r['name'] or ''}")
    return 0


def cmd_show(args) -> int:
    _print(_bucket(args).lookup(args.context_id, include_expired=True))
    return 0


def cmd_rm(args) -> int:
    b = _bucket(args)
    for cid in args.context_ids:
        b.delete(cid)
    return 0


def cmd_gc(args) -> int:
    _print({"deleted": _bucket(args).gc()})
    return 0


def cmd_rebuild(args) -> int:
    reg = _bucket(args).rebuild()
    _print({"statistics": reg["statistics"], "skipped": reg["skipped"]})
    return 0 if not reg["skipped"] else 1


def cmd_verify(args) -> int:
    b = _bucket(args)
    with b.open(args.context_id) as f:
        f.verify()
        f.load()
    print(f"{args.context_id}: OK")
    return 0


def cmd_serve(args) -> int:
    import os

    from mcf.bucket.server import serve

    serve(args.root, host=args.host, port=args.port, token=args.token or os.environ.get("MCB_TOKEN"))
    return 0


def add_bucket_parser(sub) -> None:
    """Register ``mcf bucket ...`` on the top-level subparsers."""
    p = sub.add_parser("bucket", help="Model Context Bucket: a store of pre-computed KV caches")
    bsub = p.add_subparsers(dest="bucket_cmd", required=True)

    def cmd(name, func, help):
        s = bsub.add_parser(name, help=help)
        s.add_argument("--root", required=True, help="bucket directory")
        s.set_defaults(func=func)
        return s

    s = cmd("ingest", cmd_ingest, "store a context from an .npz of k/v arrays [layers, heads, tokens, head_dim]")
    s.add_argument("model")
    s.add_argument("kv", help=".npz with arrays 'k' and 'v'")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the content the KV cache was computed from")
    src.add_argument("--text-file", help="a file holding that content")
    src.add_argument("--tokens", help=".npy of the token ids (enables prefix reuse)")
    s.add_argument("--name")
    s.add_argument("--source")
    s.add_argument("--dtype", default="float16", choices=("float32", "float16", "bfloat16", "int8"))
    s.add_argument("--compression", default="lz4", choices=("none", "lz4", "zstd"))
    s.add_argument("--ttl", type=float, help="seconds until the context expires")
    s.add_argument("--pin", action="store_true", help="never expire or garbage-collect it")

    s = cmd("ls", cmd_ls, "list the (unexpired) contexts of one model or of all")
    s.add_argument("model", nargs="?")
    s.add_argument("--scan", action="store_true", help="rescan contexts/ instead of trusting the registry")
    s.add_argument("--json", action="store_true")

    s = cmd("show", cmd_show, "print a context's metadata")
    s.add_argument("context_id")

    s = cmd("rm", cmd_rm, "delete contexts")
    s.add_argument("context_ids", nargs="+")

    cmd("gc", cmd_gc, "delete expired contexts and leftovers of crashed writers")
    cmd("rebuild", cmd_rebuild, "recreate registry.json from contexts/ (exit 1 if some could not be read)")

    s = cmd("serve", cmd_serve, "serve the REST API of seed 003 under /mcrp/v1/ (needs the 'server' extra)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8765)
    s.add_argument("--token", help="require 'Authorization: Bearer TOKEN' (or set MCB_TOKEN)")

    s = cmd("verify", cmd_verify, "check a context's KV file completely (header, sizes, CRC-32s)")
    s.add_argument("context_id")

