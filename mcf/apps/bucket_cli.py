"""``mcf bucket ingest|ls|show|rm|promote|demote|gc|rebuild|verify|serve`` (``--root DIR``; promote and
demote take ``--url`` instead to act on a running server)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mcf._core.cli_parser import JSON_HELP, add_command, add_group
from mcf._core.console import json_text, printable
from mcf.errors import InvalidArgumentError

__all__ = ["add_bucket_parser"]

CONTEXT_ID_HELP = "the context's id (mcf bucket ls lists them)"


def _bucket(args):
    from mcf.bucket.store import Bucket

    return Bucket(args.root, create=args.bucket_cmd in ("ingest", "serve"))


def _print(obj) -> None:
    print(json_text(obj, indent=1))


def _load_npz(path: str, scratch=None):
    """KV arrays from an .npz holding ``k`` and ``v``, each [num_layers, num_kv_heads, seq_len, head_dim]:
    checked like an upload (no decompression bomb, float or integer data only), stored members mapped
    from the file rather than read into memory."""
    from mcf.bucket._npz import read_kv_npz

    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise InvalidArgumentError(f"{path}: cannot read ({exc.strerror})") from None
    with f, read_kv_npz(f, limit=None, scratch=scratch, name=path) as arrays:
        return arrays.layers()


def cmd_ingest(args) -> int:
    b = _bucket(args)
    layers = _load_npz(args.kv, scratch=b.scratch_file)  # deflated members decompress onto the bucket's disk
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
    meta = b.ingest(args.model, layers, name=args.name, source=args.source, dtype=args.dtype,
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
            # the name is the ingester's text: shown escaped, so it cannot drive the terminal or forge a row
            print(f"{r['context_id']}  {r['model_id']}  {r['token_count']:>8} tok  {r['size_bytes']:>12} B  "
                  f"{printable(r['name'] or '')}")
    return 0


def cmd_show(args) -> int:
    _print(_bucket(args).lookup(args.context_id, include_expired=True))
    return 0


def cmd_rm(args) -> int:
    b = _bucket(args)
    for cid in args.context_ids:
        b.delete(cid)
    return 0


def _token(args, *, for_server: bool) -> str | None:
    """The bearer token: ``--token-file`` (first line), ``--token``, or the ``MCF_BUCKET_TOKEN``
    environment variable (``MCB_TOKEN``, its older name, is still read).  Given but empty is an error
    (an unset shell variable must not mean "no authentication")."""
    import os
    import stat
    import sys

    token = None
    if getattr(args, "token_file", None):
        try:
            with open(args.token_file, "rb") as f:
                st = os.fstat(f.fileno())
                token = f.read(4096).decode("utf-8", "replace").splitlines()[0:1]
        except OSError as exc:
            raise InvalidArgumentError(f"{args.token_file}: cannot read the token file ({exc.strerror})") from None
        token = token[0].strip() if token else ""
        if for_server and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            print(f"mcf: warning: {printable(args.token_file)} is readable by other users "
                  f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it", file=sys.stderr)
        if not token:
            raise InvalidArgumentError(f"{args.token_file}: the token file is empty")
    elif args.token is not None:
        token = args.token
        if not token.strip():
            raise InvalidArgumentError("--token is empty (an unset variable?); give a token or leave the option out")
        if for_server:
            print("mcf: warning: a token given with --token shows in the process list; use --token-file or the "
                  "MCF_BUCKET_TOKEN environment variable", file=sys.stderr)
    else:
        for var in ("MCF_BUCKET_TOKEN", "MCB_TOKEN"):
            if var in os.environ:
                token = os.environ[var]
                if not token.strip():
                    raise InvalidArgumentError(f"{var} is set but empty; unset it to run without a token")
                break
    return token


def _tier_via_server(args, action: str, body: dict) -> int:
    """POST .../contexts/{id}/promote|demote to a running server: the move happens in its memory now."""
    import urllib.error
    import urllib.request

    url = f"{args.url.rstrip('/')}/mcrp/v1/contexts/{args.context_id}/{action}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    token = _token(args, for_server=False)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            _print(json.loads(r.read()))
            return 0
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            msg = json.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            msg = raw.decode("utf-8", "replace")[:500]
        raise InvalidArgumentError(f"{url}: HTTP {e.code}: {msg}") from None
    except urllib.error.URLError as e:
        raise InvalidArgumentError(f"{url}: cannot reach the server ({e.reason})") from None


def _tier_preference(args, tier: str, device: str | None) -> int:
    meta = _bucket(args).set_tier_preference(args.context_id, tier, device=device)
    pref = meta["storage"]["preference"]
    _print({"context_id": args.context_id, "preferred_tier": pref["tier"], "device": pref["device"],
            "note": "recorded in metadata.json; processes serving this bucket apply it on their next load of "
                    "the context, the server also at start-up (use --url to move it in a running server now)"})
    return 0


def cmd_promote(args) -> int:
    if args.url:
        return _tier_via_server(args, "promote", {"target_tier": args.tier, "device": args.device or "cuda"})
    return _tier_preference(args, args.tier, args.device if args.tier == "hot" else None)


def cmd_demote(args) -> int:
    if args.url:
        return _tier_via_server(args, "demote", {"target_tier": args.tier})
    return _tier_preference(args, args.tier, None)


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


def _check_can_listen(host: str, port: int) -> None:
    """Bind once before the server starts, so an address in use or a bad host is reported as an error of
    this command (uvicorn would log it and exit 3)."""
    import socket

    from mcf.errors import MCFIOError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidArgumentError(f"--host {host!r}: not an address this machine can listen on ({exc.strerror})") \
            from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(addr)
        except OSError as exc:
            raise MCFIOError(exc.errno, f"cannot listen there: {exc.strerror}", f"{host}:{port}") from None


def cmd_serve(args) -> int:
    import sys

    from mcf.apps.bucket_server import check_bind, serve

    kw = {k: getattr(args, k) for k in ("max_body_bytes", "max_ingest_bytes", "max_concurrent_ingests",
                                        "max_page_bytes", "max_concurrent_pages")
          if getattr(args, k) is not None}
    if args.warm_budget_bytes is not None:
        kw["warm_budget_bytes"] = args.warm_budget_bytes
    if args.max_event_streams is not None:
        if args.max_event_streams < 1:
            raise InvalidArgumentError(f"--max-event-streams must be at least 1, got {args.max_event_streams}")
        kw["max_event_streams"] = args.max_event_streams
    if args.kv_events is not None or args.kv_events_replay is not None:
        kw.update(kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
                  kv_events_block_size=args.kv_events_block_size, kv_events_expose=args.kv_events_expose)
    if args.default_ttl is not None:
        from mcf.bucket.store import check_ttl

        kw["default_ttl"] = check_ttl(args.default_ttl, "--default-ttl")
    if (args.backend is None) != (args.model is None):
        raise InvalidArgumentError("--backend and --model go together (--backend transformers --model PATH_OR_ID)")
    for flag, v in (("--model-id", args.model_id), ("--device", args.device), ("--dtype", args.dtype)):
        if v is not None and args.backend is None:
            raise InvalidArgumentError(f"{flag} configures a model backend: give --backend and --model too")
    token = _token(args, for_server=True)
    check_bind(args.host, token)              # protected mode first: nothing is bound without a token off loopback
    _check_can_listen(args.host, args.port)   # and refused before minutes of model loading, not after
    if args.backend is not None:
        from mcf.bucket.hf import TransformersBackend

        print(f"mcf: loading {args.model} ...", file=sys.stderr, flush=True)
        kw["backend"] = TransformersBackend.from_pretrained(args.model, model_id=args.model_id,
                                                             device=args.device or "cpu", dtype=args.dtype)
        print(f"mcf: serving model {kw['backend'].model_id!r}", file=sys.stderr, flush=True)
    try:
        serve(args.root, host=args.host, port=args.port, token=token, allowed_hosts=args.allow_host,
              max_connections=args.max_connections, header_timeout=args.header_timeout,
              body_timeout=args.body_timeout, body_min_rate=args.body_min_rate, body_deadline=args.body_deadline,
              send_timeout=args.send_timeout, access_log=not args.no_access_log,
              on_listening=lambda m: print(f"mcf: {m}", file=sys.stderr, flush=True),
              on_warning=lambda w: print(f"mcf: warning: {w}", file=sys.stderr, flush=True), **kw)
    except SystemExit as exc:  # uvicorn's way to give up after logging why
        if exc.code in (0, None):
            return 0
        raise InvalidArgumentError(f"the server stopped (uvicorn exit status {exc.code}; its message is above)") \
            from None
    return 0


def _port(text: str) -> int:
    import argparse

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0..65535")
    return port


def add_bucket_parser(sub) -> None:
    """Register ``mcf bucket ...`` on the top-level subparsers."""
    bsub = add_group(sub, "bucket", "Model Context Bucket: a store of pre-computed KV caches")

    def cmd(name, func, help, *, url=False):
        s = add_command(bsub, name, func, help)
        if url:  # --root (persistent preference) or --url (a running server, now)
            where = s.add_mutually_exclusive_group(required=True)
            where.add_argument("--root", help="bucket directory: record the tier as the context's preference")
            where.add_argument("--url", help="a running 'mcf bucket serve' (e.g. http://127.0.0.1:8765): move "
                                             "the context in that server's memory now")
            tok = s.add_mutually_exclusive_group()
            tok.add_argument("--token-file", help="bearer token for --url: the first line of this file (or set "
                                                  "MCF_BUCKET_TOKEN)")
            tok.add_argument("--token", help="bearer token for --url (visible in the process list)")
        else:
            s.add_argument("--root", required=True, help="bucket directory")
        return s

    s = cmd("ingest", cmd_ingest, "store a context from an .npz of k/v arrays [layers, heads, tokens, head_dim]")
    s.add_argument("model", help="the id of a model registered in the bucket")
    s.add_argument("kv", help=".npz with arrays 'k' and 'v'")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the content the KV cache was computed from")
    src.add_argument("--text-file", help="a file holding that content")
    src.add_argument("--tokens", help=".npy of the token ids (enables prefix reuse)")
    s.add_argument("--name", help="a name for the context, shown by mcf bucket ls")
    s.add_argument("--source", help="where the content came from (a path or URL, kept in the metadata)")
    s.add_argument("--dtype", default="float16", choices=("float32", "float16", "bfloat16", "int8"),
                   help="how the K/V values are stored")
    s.add_argument("--compression", default="lz4", choices=("none", "lz4", "zstd"), help="of the KV file")
    s.add_argument("--ttl", type=float, help="seconds until the context expires")
    s.add_argument("--pin", action="store_true", help="never expire or garbage-collect it")

    s = cmd("ls", cmd_ls, "list the (unexpired) contexts of one model or of all")
    s.add_argument("model", nargs="?", help="a model id (default: every model)")
    s.add_argument("--scan", action="store_true", help="rescan contexts/ instead of trusting the registry")
    s.add_argument("--json", action="store_true", help=JSON_HELP)

    s = cmd("show", cmd_show, "print a context's metadata")
    s.add_argument("context_id", help=CONTEXT_ID_HELP)

    s = cmd("rm", cmd_rm, "delete contexts")
    s.add_argument("context_ids", nargs="+", help="ids of the contexts (mcf bucket ls lists them)")

    s = cmd("promote", cmd_promote, "move a context to a faster tier: warm (RAM) or hot (a torch device)", url=True)
    s.add_argument("context_id", help=CONTEXT_ID_HELP)
    s.add_argument("--tier", default="warm", choices=("warm", "hot"), help="the tier to move it to")
    s.add_argument("--device", help="torch device for the hot tier (default cuda)")

    s = cmd("demote", cmd_demote, "move a context to a slower tier: warm or cold (disk only)", url=True)
    s.add_argument("context_id", help=CONTEXT_ID_HELP)
    s.add_argument("--tier", default="cold", choices=("warm", "cold"), help="the tier to move it to")

    cmd("gc", cmd_gc, "delete expired contexts and leftovers of crashed writers")
    cmd("rebuild", cmd_rebuild, "recreate registry.json from contexts/ (exit 1 if some could not be read)")

    s = cmd("serve", cmd_serve, "serve the REST API of seed 003 under /mcrp/v1/ (needs the 'server' extra)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, loopback only; any other address needs a token)")
    s.add_argument("--port", type=_port, default=8765, help="TCP port to listen on")
    tok = s.add_mutually_exclusive_group()
    tok.add_argument("--token-file", help="require 'Authorization: Bearer TOKEN', TOKEN being the first line of this "
                                          "file (or set MCF_BUCKET_TOKEN)")
    tok.add_argument("--token", help="the token itself (visible in the process list: prefer --token-file)")
    s.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header is NAME (repeatable; '*' for any, with a token only). "
                        "Default: localhost, 127.0.0.1, ::1 and the --host address")
    s.add_argument("--max-body-bytes", type=int, help="largest ingest upload as sent (default 1 GiB)")
    s.add_argument("--max-ingest-bytes", type=int, metavar="N",
                   help="the most an upload's arrays may hold once decoded, checked before any is (default 1 GiB)")
    s.add_argument("--max-concurrent-ingests", type=int, metavar="N",
                   help="ingests running at once; more are refused with 503 and Retry-After (default 4)")
    s.add_argument("--max-page-bytes", type=int, metavar="N",
                   help="largest page payload on the pages routes (default 64 MiB)")
    s.add_argument("--max-concurrent-pages", type=int, metavar="N",
                   help="page reads and writes in flight; more are refused with 503 and Retry-After (default 32)")
    s.add_argument("--max-connections", type=int, help="open connections at most; at the cap a new one replaces "
                                                       "the oldest without the token, else gets 503 (default 256)")
    s.add_argument("--header-timeout", type=float, help="seconds a client has to send a request's headers (default 10)")
    s.add_argument("--body-timeout", type=float, help="seconds a request body may pause (default 30)")
    s.add_argument("--body-min-rate", type=float, metavar="BYTES_PER_S",
                   help="after --body-timeout seconds, a body must average this rate (default 1024)")
    s.add_argument("--body-deadline", type=float, metavar="SECONDS",
                   help="seconds a request body may take in all (default 600)")
    s.add_argument("--send-timeout", type=float, metavar="SECONDS",
                   help="close a client that takes no byte of its answer for this long (default 60)")
    s.add_argument("--no-access-log", action="store_true", help="do not log a line per request on standard error")
    s.add_argument("--warm-budget-bytes", type=int, help="RAM for contexts promoted to the warm tier (default 1 GiB)")
    s.add_argument("--max-event-streams", type=int, metavar="N",
                   help="open /mcrp/v1/events streams allowed at once (default 32; 503 past it)")
    s.add_argument("--kv-events", metavar="tcp://HOST:PORT",
                   help="publish the bucket's stored blocks as vLLM's KV events on this ZMQ PUB address (loopback "
                        "unless --kv-events-expose; needs the 'server' extra's pyzmq and msgpack)")
    s.add_argument("--kv-events-replay", metavar="tcp://HOST:PORT",
                   help="the KV events' replay socket (ROUTER): a subscriber asks for the batches it missed")
    s.add_argument("--kv-events-block-size", type=int, default=16, metavar="N",
                   help="tokens per announced block: the engine's --block-size (default 16, vLLM's)")
    s.add_argument("--kv-events-expose", action="store_true",
                   help="allow a non-loopback KV events address (the events carry prompts' token ids, and ZMQ "
                        "has no authentication: put it behind a network policy)")
    s.add_argument("--default-ttl", type=float, metavar="SECONDS",
                   help="expiry of contexts ingested without a ttl (default: never; seed 003 suggests 604800, 7 days)")
    s.add_argument("--backend", choices=("transformers",),
                   help="a model in the loop: answer queries and compute KV caches from text (the 'transformers' "
                        "extra); needs --model")
    s.add_argument("--model", help="with --backend: a Hugging Face causal LM, a local directory or a Hub id")
    s.add_argument("--model-id", help="the model's id in the bucket (default: the last part of --model)")
    s.add_argument("--device", help="torch device for the model (default cpu)")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="the model's dtype (default: as stored)")

    s = cmd("verify", cmd_verify, "check a context's KV file completely (header, sizes, CRC-32s)")
    s.add_argument("context_id", help=CONTEXT_ID_HELP)

