"""``mcf ctx``: info, verify, ingest, snapshot and restore of MegaContext trees."""

from __future__ import annotations

import io
import os
import sys
import time

__all__ = ["add_ctx_parser"]


from mcf._core.console import human as _human  # noqa: E402  (one formatter for every subcommand)
from mcf._core.console import json_text, printable  # noqa: E402  (strings from a tree, printed safely)
from mcf._core.cli_parser import NO_MMAP_HELP, QUIET_HELP, add_command, add_group  # noqa: E402
from mcf.remote import is_url, redact  # noqa: E402  (a tree URL as messages show it)


def cmd_info(args) -> int:
    import mcf.megacontext as mc

    with mc.open(args.tree, mmap=False if args.no_mmap else None) as tree:
        d = tree.info()
    if args.json:
        print(json_text(d))
        return 0
    w = sys.stdout.write
    g = d["gist_dtype"]
    g = printable(g if isinstance(g, str) else f"LOD1 {g['LOD1']} + LOD2 {g['LOD2']}")
    w(f"{printable(d['path'])}: MegaContext tree, model {d['model_name']!r}, d={d['embedding_dim']} {g}, "
      f"K={d['block_size']}" + (f", vocab {d['vocab_size']}" if d["vocab_size"] else "") + "\n")
    w(f"  {d['num_tokens']} tokens ({d['num_blocks']} full blocks), {d['num_gists']['LOD1']} LOD1 gists, "
      f"{d['num_gists']['LOD2']} LOD2 gists; ingestion {'complete' if d['ingestion_complete'] else 'open'}\n")
    w(f"  created {printable(d['created_at'])}, modified {printable(d['last_modified'])}, gistnet checkpoint "
      f"{d['gistnet_checkpoint']!r}\n\n")
    w(f"  {'file':<9} {'layout':<10} {'magic':<9} {'dtype':<6} {'entries':>12} {'entry':>7} {'size':>14} "
      f"{'uncommitted':>11}\n")
    for key, f in d["files"].items():
        w(f"  {key + '.ctx':<9} {printable(f['layout']):<10} {printable(f['magic_order']):<9} "
          f"{printable(f['dtype']):<6} {f['num_entries']:>12} {f['entry_bytes']:>7} {f['file_size_bytes']:>14,} "
          f"{f['uncommitted_bytes']:>11}\n")
    total = sum(f["file_size_bytes"] for f in d["files"].values())
    w(f"  total {_human(total)}\n")
    for key, ranges in d["checkpoints"].items():
        for r in ranges:
            w(f"  {key} gists [{r['start']}, {r['stop']}): {r['gistnet_checkpoint']!r}"
              f"{' (rewrite pending)' if r['pending'] else ''}\n")
    for n in d["notes"]:
        w(f"  {printable(n)}\n")
    return 0


def cmd_verify(args) -> int:
    import errno

    import mcf.megacontext as mc
    from mcf.errors import MCFIOError, MissingFileError

    # an error of the command line, not a finding about a tree (a URL "directory" is checked by its metadata.json)
    if not is_url(args.tree) and not os.path.isdir(args.tree):
        if os.path.exists(args.tree):
            raise MCFIOError(errno.ENOTDIR, "not a directory (a MegaContext tree is a directory)", args.tree)
        raise MissingFileError(errno.ENOENT, "no such tree directory", args.tree)
    problems = mc.verify(args.tree, deep=args.deep, mmap=False if args.no_mmap else None)
    errors = [p for p in problems if p.severity == "error"]
    for p in problems:
        print(f"{'FAIL' if p.severity == 'error' else p.severity.upper()} {printable(p.error)}")
    if errors:
        return 1
    print(f"OK {printable(redact(args.tree))}" + (f" ({len(problems)} warnings/notes)" if problems else ""))
    return 0


def _embedding_table(ckpt, name):
    if name:
        if name not in ckpt.tensors:
            from mcf.errors import TensorNotFoundError

            raise TensorNotFoundError(f"no tensor {name!r} in the checkpoint")
        return ckpt.tensors[name].array(), name
    for cand in sorted(ckpt.tensors):
        if cand.endswith(("word_embeddings.weight", "embed_tokens.weight", "wte.weight")):
            return ckpt.tensors[cand].array(), cand
    from mcf.errors import TensorNotFoundError

    raise TensorNotFoundError("no input-embedding tensor found (pass --embedding-tensor)")


def _text_chunks(f, chunk_bytes):
    """Pieces of a text stream, cut at line ends, about ``chunk_bytes`` long.  A line is read at most
    ``chunk_bytes`` characters at a time, so one endless line (a file without newlines) holds no more than
    that: a line longer than a chunk is cut after its last whitespace inside the chunk (or at the chunk's
    end where it has none), so words stay whole wherever the text allows."""
    buf = []
    size = 0
    carry = ""
    while True:
        line = carry + f.readline(max(1, chunk_bytes - len(carry)))
        carry = ""
        if not line:
            break
        if not line.endswith("\n") and len(line) >= chunk_bytes:
            cut = max(line.rfind(" "), line.rfind("\t")) + 1
            if 0 < cut < len(line):
                line, carry = line[:cut], line[cut:]
        buf.append(line)
        size += len(line)
        if size >= chunk_bytes:
            yield "".join(buf), size
            buf, size = [], 0
    if carry:
        buf.append(carry)
        size += len(carry)
    if buf:
        yield "".join(buf), size


def cmd_ingest(args) -> int:
    import numpy as np

    import mcf.megacontext as mc
    from mcf._core.console import Progress
    from mcf.errors import InvalidArgumentError

    table = pool = tok = None
    ckpt = None
    if args.model_dir:
        from mcf.safetensors.reader import open_checkpoint
        from mcf.conversion.tokenizer import load_tokenizer

        ckpt = open_checkpoint(args.model_dir)
        table, tname = _embedding_table(ckpt, args.embedding_tensor)
        if not args.ids:
            tok = load_tokenizer(args.model_dir)
        if not args.no_gists:
            pool = mc.MeanPool(table, checkpoint=f"mean-pooling:{tname}")
    elif not args.ids:
        raise InvalidArgumentError("text input needs --model-dir (its tokenizer.json); or pass --ids")
    infile = None
    try:
        # '-' reads stdin (where a pipe goes); a path is a regular file, refused before the tree is touched
        # when it is not (a FIFO's open would wait for a writer)
        if args.input != "-":
            from mcf._core.fs import open_regular

            infile = os.fdopen(open_regular(args.input), "rb")
        if os.path.exists(os.path.join(args.tree, "metadata.json")):
            tree = mc.open(args.tree, "r+")
        else:
            d = table.shape[1] if table is not None else args.embedding_dim
            if not d:
                raise InvalidArgumentError("a new tree needs --model-dir or --embedding-dim")
            name = args.model_name or (os.path.basename(os.path.normpath(args.model_dir)) if args.model_dir else "")
            tree = mc.create(args.tree, embedding_dim=int(d), model_name=name, block_size=args.block_size,
                             gist_dtype=args.dtype, vocab_size=None if table is None else table.shape[0])
        with tree:
            for n in tree.notes:
                print(f"  {printable(n)}")
            t0 = time.perf_counter()
            start = tree.num_tokens
            total = os.fstat(infile.fileno()).st_size if infile is not None else 0
            prog = Progress("ingest", enabled=None if not args.quiet else False)
            done = 0
            if args.ids:
                src = sys.stdin.buffer if infile is None else infile
                with src:
                    while True:
                        raw = src.read(args.chunk_bytes // 4 * 4 or 4)
                        if not raw:
                            break
                        if len(raw) % 4:
                            raise InvalidArgumentError(f"{args.input}: not a whole number of uint32 ids")
                        tree.append_tokens(np.frombuffer(raw, dtype="<u4"), commit=False)
                        if pool is not None:
                            mc.build_gists(tree, pool, commit=False)
                        tree.commit()
                        done += len(raw)
                        prog(done, max(total, done))
            else:
                src = sys.stdin if infile is None else io.TextIOWrapper(infile, encoding="utf-8")
                with src:
                    for text, nbytes in _text_chunks(src, args.chunk_bytes):
                        ids = tok.encode(text, add_special_tokens=False).ids
                        tree.append_tokens(np.asarray(ids, dtype=np.uint32), commit=False)
                        if pool is not None:
                            mc.build_gists(tree, pool, commit=False)
                        tree.commit()
                        done += nbytes
                        prog(done, max(total, done))
            if args.complete:
                tree.set_ingestion_complete()
            dt = time.perf_counter() - t0
            t, n1, n2 = tree.counts
            print(f"ingested {t - start} tokens into {tree.path} in {dt:.2f}s: now {t} tokens, {n1} LOD1 + {n2} "
                  f"LOD2 gists")
    finally:
        if infile is not None:
            infile.close()
        if ckpt is not None:
            ckpt.close()
    return 0


def cmd_snapshot(args) -> int:
    import mcf.megacontext as mc

    with mc.open(args.tree) as tree:
        dest = tree.snapshot(args.dest)
        t, n1, n2 = tree.committed_counts
    print(f"snapshot {dest}: {t} tokens, {n1} LOD1 + {n2} LOD2 gists")
    return 0


def cmd_restore(args) -> int:
    import mcf.megacontext as mc

    mc.restore(args.snapshot, args.tree)
    with mc.open(args.tree) as tree:
        t, n1, n2 = tree.counts
    print(f"restored {args.tree} from {args.snapshot}: {t} tokens, {n1} LOD1 + {n2} LOD2 gists")
    return 0


def add_ctx_parser(sub) -> None:
    """Register ``mcf ctx ...`` on the top-level subparsers."""
    cs = add_group(sub, "ctx", "MegaContext trees (LOD0/LOD1/LOD2 .ctx files)")

    tree = ("tree", "tree directory (LOD0/1/2.ctx + metadata.json)")
    add_command(cs, "info", cmd_info, "headers, counts, sizes, checkpoints and notes of a tree", tree, json=True,
                no_mmap=True)
    s = add_command(cs, "verify", cmd_verify, "list every inconsistency; exit 1 if any is an error", tree)
    s.add_argument("--deep", action="store_true", help="also read all data (token ids, NaN/Inf gists)")
    s.add_argument("--no-mmap", action="store_true", help=NO_MMAP_HELP)

    s = add_command(cs, "ingest", cmd_ingest, "stream a text (or uint32 ids) into a tree, building mean-pooled gists",
                    ("tree", "tree directory (created when it holds no tree)"),
                    ("input", "UTF-8 text file, or raw little-endian uint32 ids with --ids; '-' for stdin (a "
                              "pipe: a path must be a regular file)"))
    s.add_argument("--model-dir", help="checkpoint directory: tokenizer.json and the embedding matrix")
    s.add_argument("--embedding-tensor", help="name of the [vocab, d] input-embedding tensor")
    s.add_argument("--ids", action="store_true", help="input holds token ids, not text")
    s.add_argument("--no-gists", action="store_true", help="append tokens only")
    s.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32", "q8", "hybrid"),
                   help="gist dtype of a new tree (q8: MCF 8-bit blocks; hybrid: LOD1 fp16, LOD2 q8)")
    s.add_argument("--block-size", type=int, default=32, help="tokens per LOD1 gist (and LOD1 gists per LOD2 "
                                                               "gist) of a new tree")
    s.add_argument("--embedding-dim", type=int, help="d of a new tree without --model-dir")
    s.add_argument("--model-name", help="model name of a new tree")
    s.add_argument("--chunk-bytes", type=int, default=1 << 20, help="commit after about this much input")
    s.add_argument("--complete", action="store_true", help="mark ingestion_complete at the end")
    s.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)

    s = add_command(cs, "snapshot", cmd_snapshot, "consistent, atomic copy to <tree>/checkpoints/<time>/ (or --dest)",
                    ("tree", "tree directory to copy"))
    s.add_argument("--dest", help="snapshot directory to create (default: <tree>/checkpoints/<UTC time>)")
    add_command(cs, "restore", cmd_restore, "replace a tree with a snapshot",
                ("snapshot", "a snapshot directory (mcf ctx snapshot)"), ("tree", "the tree directory it replaces"))
