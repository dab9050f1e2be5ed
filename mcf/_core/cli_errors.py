"""How every ``mcf`` command ends: the one place that turns an exception into a message and an exit code.

A user error never ends in a traceback.  Whatever the subcommand (``mcf info``, ``mcf megatron
tokenize``, ``mcf bucket serve``...), a failure prints one line on stderr,

    mcf <command>: error: <what went wrong, where, and what was expected>

and the exit code says what kind of failure it was:

- 2: the command line is wrong (argparse's own errors, :class:`UsageError`: contradictory options, an
  invalid ``MCF_FORCE_IMPL``);
- 1: the command ran and failed: a bad or missing file (:class:`mcf.MCFError`, ``OSError``), a
  missing optional package (:class:`mcf.MissingDependencyError`), a failed check;
- 1 with "internal error": an exception mcf did not expect, i.e. a bug (the message says so);
- 130: interrupted (Ctrl-C).

``--debug`` anywhere on the command line, or ``MCF_DEBUG=1`` in the environment, re-raises instead, so
the traceback is shown.  (``MCF_DEBUG=1`` is also the debug-build switch of setup.py; at run time it
only means this.)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from mcf._core.console import printable
from mcf.errors import InvalidArgumentError, MCFError
from mcf._core.redaction import redact_text

__all__ = ["UsageError", "describe", "run", "DEBUG_FLAG", "DEBUG_ENV"]

DEBUG_FLAG = "--debug"
DEBUG_ENV = "MCF_DEBUG"

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(InvalidArgumentError):
    """The command line (or an environment variable the command reads) asks for something impossible."""


def debug_requested(argv: Sequence[str]) -> bool:
    return DEBUG_FLAG in _options(argv) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _options(argv: Sequence[str]) -> list:
    """The arguments before a ``--`` (after it, ``--debug`` would be a file name)."""
    argv = list(argv)
    return argv[:argv.index("--")] if "--" in argv else argv


def command_name(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``mcf megatron tokenize``: the program and the chosen subcommands, found by walking the parsers."""
    words = [parser.prog]
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if not chosen or chosen not in subs[0].choices:
            return " ".join(words)
        words.append(chosen)
        parser = subs[0].choices[chosen]


def describe(exc: BaseException) -> str:
    """The one-line message for an exception: the file first for OS errors (``path: No such file or
    directory``), mcf's own messages as they are (they already name the file, field, offset and what was
    expected), anything else with its type; any URL in it redacted (:func:`mcf.remote.redact`)."""
    return redact_text(_describe(exc))   # a URL's credentials, whoever raised (mcf's errors redact their own)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
        return f"{' -> '.join(where)}: {exc.strerror}" if where else exc.strerror
    if isinstance(exc, (MCFError, OSError)):
        return str(exc) or type(exc).__name__
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
        dispatch: Callable[[argparse.Namespace], int]) -> int:
    """Parse ``argv`` and run ``dispatch(args)``, reporting any failure as described in the module
    docstring.  Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    if DEBUG_FLAG in _options(argv):  # accepted anywhere, not only before the subcommand
        cut = argv.index("--") if "--" in argv else len(argv)
        argv = [a for a in argv[:cut] if a != DEBUG_FLAG] + argv[cut:]
    args = parser.parse_args(argv)  # exits 2 with "mcf <command>: error: ..." on a malformed command line
    prog = command_name(parser, args)
    try:
        return dispatch(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `mcf info big.mcf | head`: the reader left; not an error of ours
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_FAILED
    except (MCFError, OSError) as exc:
        if debug:
            raise
        print(f"{prog}: error: {printable(describe(exc))}", file=sys.stderr)  # messages quote files' strings
        return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - the point: no traceback unless asked for
        if debug:
            raise
        print(f"{prog}: internal error: {printable(describe(exc))}\n"
              f"{prog}: this is a bug in mcf; run again with {DEBUG_FLAG} (or {DEBUG_ENV}=1) to see the traceback, "
              "and please report it", file=sys.stderr)
        return EXIT_FAILED
