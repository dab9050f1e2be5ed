"""``mcf megatron info|verify|merge|tokenize``."""

from __future__ import annotations

import logging
import sys
import time

import numpy as np

from mcf._core.cli_parser import QUIET_HELP, add_command, add_group
from mcf._core.console import human as _human
from mcf._core.console import json_text, printable
from mcf.remote import redact

__all__ = ["add_megatron_parser"]


def info_dict(ds) -> dict:
    lens = ds.sequence_lengths
    h = ds.header
    d = {
        "prefix": redact(ds.path_prefix),   # a URL as messages show it (no credentials)
        "idx": redact(ds.idx_path),
        "bin": redact(ds.bin_path),
        "variant": h.variant,
        "version": h.version,
        "dtype": str(ds.dtype),
        "dtype_code": h.dtype_code,
        "multimodal": h.multimodal,
        "sequences": len(ds),
        "documents": ds.num_documents,
        "tokens": ds.num_tokens,
        "idx_bytes": h.layout.size,
        "bin_bytes": ds._bin_src.size,
    }
    if len(lens):
        d["sequence_length"] = {"min": int(lens.min()), "max": int(lens.max()),
                                "mean": float(lens.mean(dtype=np.float64))}
    if h.multimodal:
        modes, counts = np.unique(ds.sequence_modes, return_counts=True)
        d["modes"] = {int(m): int(c) for m, c in zip(modes, counts)}
    return d


def cmd_info(args) -> int:
    from mcf.megatron import open as open_dataset

    with open_dataset(args.prefix, mmap=False if args.no_mmap else None) as ds:
        d = info_dict(ds)
        if args.json:
            print(json_text(d))
            return 0
        w = sys.stdout.write
        w(f"{printable(d['prefix'])}: Megatron indexed dataset ({d['variant']} index, version {d['version']})\n")
        w(f"  dtype        {d['dtype']} (code {d['dtype_code']})\n")
        w(f"  sequences    {d['sequences']:,}\n")
        w(f"  documents    {d['documents']:,}\n")
        w(f"  tokens       {d['tokens']:,}\n")
        if "sequence_length" in d:
            s = d["sequence_length"]
            w(f"  seq length   min {s['min']}, mean {s['mean']:.1f}, max {s['max']}\n")
        w(f"  multimodal   {'yes ' + str(d['modes']) if d['multimodal'] else 'no'}\n")
        w(f"  .idx         {_human(d['idx_bytes'])} ({d['idx_bytes']} bytes)\n")
        w(f"  .bin         {_human(d['bin_bytes'])} ({d['bin_bytes']} bytes)\n")
        if args.show:
            for i in range(min(args.show, len(ds))):
                toks = ds[i]
                w(f"  [{i}] {len(toks)} tokens: {toks[:16].tolist()}{' ...' if len(toks) > 16 else ''}\n")
    return 0


def cmd_verify(args) -> int:
    from mcf.errors import MCFError
    from mcf.megatron import open as open_dataset
    from mcf.megatron import verify

    try:  # a missing or unreadable file is an error of the command line, not a finding about a dataset
        open_dataset(args.prefix, mmap=False if args.no_mmap else None).close()
    except OSError:
        raise
    except MCFError:  # a bad dataset: verify lists every problem
        pass
    problems = verify(args.prefix, mmap=False if args.no_mmap else None)
    if problems:
        for p in problems:
            print(f"FAIL {printable(p)}")
        return 1
    with open_dataset(args.prefix, mmap=False if args.no_mmap else None) as ds:
        print(f"OK {printable(redact(ds.path_prefix))}: {len(ds):,} sequences, {ds.num_documents:,} documents, "
              f"{ds.num_tokens:,} tokens ({ds.dtype}, {ds.variant})")
    return 0


def cmd_merge(args) -> int:
    from mcf._core.console import Progress
    from mcf.megatron.writer import merge

    t0 = time.perf_counter()
    res = merge(args.output_prefix, args.inputs, mmap=False if args.no_mmap else None, overwrite=args.overwrite,
                progress=Progress("merge", enabled=None if not args.quiet else False))
    dt = time.perf_counter() - t0
    print(f"wrote {printable(redact(res.prefix))}: {res.inputs} datasets, {res.sequence_count:,} sequences, "
          f"{res.document_count:,} documents, {res.token_count:,} tokens in {dt:.2f}s")
    return 0


def _max_line_bytes(args) -> int:
    from mcf.conversion.export import parse_size
    from mcf.conversion.tokenize import MAX_LINE_BYTES

    return MAX_LINE_BYTES if args.max_line_bytes is None else parse_size(args.max_line_bytes)


def cmd_tokenize(args) -> int:
    # the command prints why auto fell back (a note on stderr, below); the library also logs it to the
    # mcf.tokenize logger, which Python's last-resort handler would print a second time
    logging.getLogger("mcf.tokenize").addHandler(logging.NullHandler())
    from mcf._core.console import Progress
    from mcf.conversion.tokenize import tokenize

    if args.ray is not None:
        return _tokenize_on_ray(args)
    for flag, v in (("--chunk-size", args.chunk_size), ("--shard-dir", args.shard_dir), ("--no-merge", args.no_merge),
                    ("--no-resume", args.no_resume)):
        if v:
            from mcf.errors import InvalidArgumentError

            raise InvalidArgumentError(f"{flag} applies to a run on a Ray cluster (--ray ADDRESS)")
    stats = tokenize(args.inputs, args.output_prefix, args.tokenizer, json_key=args.json_key,
                     append_eod=args.append_eod, eod_token=args.eod_token, workers=args.workers,
                     batch_size=args.batch_size, dtype_rule=args.dtype_rule,
                     add_special_tokens=args.add_special_tokens, empty_text=args.empty_text,
                     max_line_bytes=_max_line_bytes(args), overwrite=args.overwrite,
                     tokenizer_backend=args.tokenizer_backend, tiktoken_pattern=args.tiktoken_pattern,
                     progress=Progress("tokenize", enabled=None if not args.quiet else False))
    _say_backend_note(stats)
    if stats.get("workers_note"):   # --workers N not followed: why
        print(f"note: {stats['workers_note']}", file=sys.stderr)
    rate = stats["tokens"] / stats["seconds"] / 1e6 if stats["seconds"] > 0 else 0.0
    out = printable(redact(args.output_prefix))
    print(f"wrote {out}.idx/.bin: {stats['documents']:,} documents, {stats['sequences']:,} sequences, "
          f"{stats['tokens']:,} tokens in {stats['seconds']:.2f}s ({rate:.2f}M tokens/s, {stats['backend']})")
    return 0


def _say_backend_note(stats) -> None:
    """Why ``--tokenizer-backend auto`` fell back to HF tokenizers, on stderr (once: the library also logs it
    to the ``mcf.tokenize`` logger, which :func:`cmd_tokenize` gives a null handler)."""
    if stats.get("backend_note"):
        print(f"note: {stats['backend_note']}", file=sys.stderr)


def _tokenize_on_ray(args) -> int:
    from mcf.errors import InvalidArgumentError

    if args.workers != 1:
        raise InvalidArgumentError("--workers sets the worker processes of a run on this machine; with --ray every "
                                   "CPU of the cluster tokenizes (one task per CPU)")
    from mcf.conversion import raydata  # a MissingDependencyError names the extra when Ray is not installed
    from mcf.conversion.export import parse_size

    stats = raydata.tokenize(args.inputs, args.output_prefix, args.tokenizer, json_key=args.json_key,
                             append_eod=args.append_eod, eod_token=args.eod_token, batch_size=args.batch_size,
                             dtype_rule=args.dtype_rule, add_special_tokens=args.add_special_tokens,
                             empty_text=args.empty_text, max_line_bytes=_max_line_bytes(args), address=args.ray,
                             chunk_size=None if args.chunk_size is None else parse_size(args.chunk_size),
                             shard_dir=args.shard_dir, merge=not args.no_merge, resume=not args.no_resume,
                             tokenizer_backend=args.tokenizer_backend, tiktoken_pattern=args.tiktoken_pattern,
                             progress=not args.quiet)
    _say_backend_note(stats)
    rate = stats["tokens"] / stats["seconds"] / 1e6 if stats["seconds"] > 0 else 0.0
    reused = f", {stats['chunks_reused']} reused from an earlier run" if stats["chunks_reused"] else ""
    print(f"wrote {stats['output']}: {stats['documents']:,} documents, {stats['sequences']:,} sequences, "
          f"{stats['tokens']:,} tokens from {stats['chunks']} chunks{reused} in {stats['seconds']:.2f}s "
          f"({rate:.2f}M tokens/s)")
    print("  " + ", ".join(f"{k} {v:.2f}s" for k, v in stats["phases"].items()))
    return 0


def add_megatron_parser(sub) -> None:
    """Register ``mcf megatron ...`` on the top-level subparsers."""
    msub = add_group(sub, "megatron", "Megatron indexed datasets (.idx/.bin): info, verify, merge, tokenize")

    prefix = ("prefix", "dataset prefix (PREFIX.idx + PREFIX.bin; a .idx or .bin path works too)")
    s = add_command(msub, "info", cmd_info, "header, counts, dtype and sizes of a dataset", prefix, json=True,
                    no_mmap=True)
    s.add_argument("--show", type=int, default=0, metavar="N", help="print the first N sequences")
    add_command(msub, "verify", cmd_verify, "check a dataset completely; report every problem, exit 1 if any", prefix,
                no_mmap=True)
    s = add_command(msub, "merge", cmd_merge, "concatenate datasets into one (one pass, bounded memory)",
                    ("output_prefix", "the dataset to write (OUTPUT_PREFIX.idx + .bin; s3://BUCKET/PREFIX, gs://, "
                     "az:// upload it)"),
                    ("inputs", "+", "input dataset prefixes (local or URLs), in order"), no_mmap=True, quiet=True)
    s.add_argument("--overwrite", action="store_true", help="replace a dataset that exists at an object-store "
                   "output prefix (a local one is always replaced atomically)")

    s = add_command(msub, "tokenize", cmd_tokenize, "tokenize jsonl / text (gzip, zstd) into a dataset",
                    ("inputs", "+", "input files (.jsonl[.gz|.zst] or plain text, one document a line; s3://, gs://, "
                     "az://, http(s):// URLs too)"))
    s.add_argument("--tokenizer", required=True, help="a tokenizer.json, a checkpoint directory holding one, an "
                   "MCF file packed with its resources (it carries the tokenizer.json), tiktoken:NAME (a tiktoken "
                   "encoding tiktoken can load), or a .tiktoken ranks file (with --tiktoken-pattern)")
    s.add_argument("--tokenizer-backend", choices=("auto", "hf", "fastokens", "tiktoken"), default="auto",
                   help="what encodes: auto (default) takes the fastest of fastokens and tiktoken that gives HF "
                        "tokenizers' ids on a built-in probe, else HF tokenizers (saying why); a named backend must "
                        "pass the probe too")
    s.add_argument("--tiktoken-pattern", metavar="REGEX|NAME", help="the split pattern of a .tiktoken ranks file: a "
                   "regex, or the name of a tiktoken encoding (cl100k_base...) whose pattern and special tokens it "
                   "takes")
    s.add_argument("--output-prefix", required=True,
                   help="the dataset to write: OUTPUT_PREFIX.idx + .bin (missing directories are created; "
                        "s3://BUCKET/PREFIX, gs://, az:// upload it)")
    s.add_argument("--overwrite", action="store_true", help="replace a dataset that exists at an object-store "
                   "output prefix (a local one is always replaced atomically)")
    s.add_argument("--json-key", default="text", help="the field of each jsonl line that holds the text")
    s.add_argument("--append-eod", action="store_true", help="end every non-empty document with the EOD token")
    s.add_argument("--eod-token", help="the EOD token (default: the first of "
                   "<|endoftext|>, </s>, <eos>, <|end_of_text|>, [SEP], <|im_end|> in the vocabulary)")
    s.add_argument("--workers", type=int, default=1, help="tokenizing worker processes (1: in this process)")
    s.add_argument("--batch-size", type=int, default=1000, help="documents per batch")
    s.add_argument("--dtype-rule", choices=("megatron", "datatrove"), default="megatron",
                   help="uint16 below 65500 (megatron) or up to 65536 (datatrove) vocabulary entries")
    s.add_argument("--add-special-tokens", action="store_true",
                   help="let the tokenizer's post-processor add its special tokens (e.g. [CLS] ... [SEP])")
    s.add_argument("--empty-text", choices=("megatron", "datatrove"), default="megatron",
                   help="a text without tokens: a document with no sequence (megatron), or one sequence "
                        "holding just the EOD, with empty strings dropped (datatrove)")
    s.add_argument("--max-line-bytes", metavar="SIZE",
                   help="the longest input line (one document) accepted, e.g. 256MiB (default 64MiB: a line is "
                        "held whole while it is tokenized, at about 15 times its size); a longer one is an error "
                        "naming the file and the line")
    g = s.add_argument_group("on a Ray cluster (the ray extra: pip install '.[ray]' in a checkout, or "
                             "pip install 'mcf-formats[ray]'; see docs/scale.md)")
    g.add_argument("--ray", metavar="ADDRESS", help="run on the Ray cluster at ADDRESS (host:port of the head, "
                   "ray://...), or 'auto': the cluster this machine belongs to, else a local one")
    g.add_argument("--chunk-size", metavar="SIZE", help="bytes of input per task (e.g. 64MiB; default: about "
                   "four chunks per cluster CPU); compressed inputs are one chunk each")
    g.add_argument("--shard-dir", help="where tasks write their shards (default OUTPUT_PREFIX.shards; every node "
                   "must see it)")
    g.add_argument("--no-merge", action="store_true", help="keep the shards and write OUTPUT_PREFIX.shards.json "
                   "(for mcf.megatron.open and Megatron's --data-path) instead of merging them")
    g.add_argument("--no-resume", action="store_true", help="start over instead of reusing the chunks an "
                   "interrupted run finished")
    s.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)
