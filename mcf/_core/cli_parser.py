"""The argument parser every ``mcf`` command is built on: its ``--help`` shows what an option does when
it is left out.

``mcf quantize in.mcf out.mcf`` without ``--method`` used to write k4 while ``--help`` did not say so.
:class:`Parser` formats help with :class:`DefaultsHelpFormatter`, which appends ``(default: X)`` to the
help of every option that has a default worth showing (not ``None``, not a flag's ``False``, not an
empty list), unless the help line already says what the default is.  Subcommand parsers inherit the
class (argparse builds them with the type of the parser that owns the subcommands), so the groups that
register themselves (``mcf megatron``, ``mcf ctx``, ``mcf bucket``) follow the rule without doing
anything.  ``tests/test_cli_help.py`` walks the whole tree and checks that every argument has a help
line and every default is shown.
"""

from __future__ import annotations

import argparse

__all__ = ["Parser", "DefaultsHelpFormatter", "add_command", "add_group", "shows_default", "QUIET_HELP", "NO_MMAP_HELP",
           "JSON_HELP"]

# the help lines of the options many commands share, worded once
QUIET_HELP = "no progress bar on stderr"
NO_MMAP_HELP = "read with positional reads (pread) instead of mapping the file"
JSON_HELP = "machine-readable output (JSON)"


def shows_default(action: argparse.Action) -> bool:
    """Whether ``--help`` owes the user this action's default: an option (or optional positional) whose
    default is a value, not the absence of one (``None``, a flag's ``False``, an empty list)."""
    d = action.default
    if d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, (list, tuple)) and not d):
        return False
    return bool(action.option_strings) or action.nargs in ("?", "*")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter without its noise: ``(default: None)`` and
    ``(default: False)`` say nothing, and a help line that already explains its default
    ("default: the first of ...") is left as it is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if shows_default(action) and "default" not in text:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows every default (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def add_command(sub, name: str, func, help: str, *positionals, json: bool = False, no_mmap: bool = False,
                quiet: bool = False) -> argparse.ArgumentParser:
    """Register the subcommand ``name`` of ``sub`` (an ``add_subparsers`` result), run by ``func(args)``:
    its positional arguments, each ``(dest, help)`` or ``(dest, nargs, help)``, then the options many
    commands share, worded once (``--json``, ``--no-mmap``, ``-q/--quiet``, in that order; ``--help``
    lists options in the order they are added).  Returns the subcommand's parser, for its own options."""
    s = sub.add_parser(name, help=help)
    for dest, *nargs, text in positionals:
        s.add_argument(dest, help=text, **({"nargs": nargs[0]} if nargs else {}))
    if json:
        s.add_argument("--json", action="store_true", help=JSON_HELP)
    if no_mmap:
        s.add_argument("--no-mmap", action="store_true", help=NO_MMAP_HELP)
    if quiet:
        s.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)
    s.set_defaults(func=func)
    return s


def add_group(sub, name: str, help: str):
    """Register the command group ``mcf name COMMAND`` (``mcf megatron``, ``mcf ctx``, ``mcf bucket``) on
    ``sub``; returns its subcommands' ``add_subparsers`` result, for :func:`add_command` (the command
    chosen lands in ``args.<name>_cmd``)."""
    p = sub.add_parser(name, help=help)
    return p.add_subparsers(dest=f"{name}_cmd", required=True, metavar="COMMAND",
                            help=f"what to do (mcf {name} COMMAND --help tells more)")
