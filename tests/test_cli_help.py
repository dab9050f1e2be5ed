"""What ``mcf --help`` promises, over the whole command tree: every positional and option has a help line,
every default is shown (``mcf quantize`` without ``--method`` writes k4: its help must say so), and
``mcf --version`` / ``mcf version`` say what a bug report needs."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess

import numpy as np
import pytest

import mcf
from mcf.cli import build_parser, main
from _entry_point import mcf_command


def _parsers(parser, words=("mcf",)):
    """(command words, parser) of the top-level parser and every subcommand's, at any depth."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, words + (name,))


def _default_shown(default) -> bool:
    return not (default is None or default is False or default is argparse.SUPPRESS
                or (isinstance(default, (list, tuple)) and not default))


def _rendered(parser, action) -> str:
    """The help text argparse prints for one action, with its %(default)s filled in."""
    fmt = parser._get_formatter()
    fmt.add_argument(action)
    return " ".join(fmt.format_help().split())


PARSERS = list(_parsers(build_parser()))


def test_the_walk_reaches_every_group():
    found = {" ".join(w) for w, _ in PARSERS}
    assert {"mcf", "mcf quantize", "mcf version", "mcf megatron tokenize", "mcf ctx ingest",
            "mcf bucket serve"} <= found
    assert len(found) >= 33


@pytest.mark.parametrize("words,parser", PARSERS, ids=[" ".join(w) for w, _ in PARSERS])
def test_every_argument_has_help_and_every_default_is_shown(words, parser):
    missing, hidden = [], []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._SubParsersAction):  # the COMMAND argument and each command
            missing += [f"{name} {c.dest}" for c in action._choices_actions if not (c.help or "").strip()]
            if not (action.help or "").strip():
                missing.append(name)
            continue
        if not (action.help or "").strip() or action.help is argparse.SUPPRESS:
            missing.append(name)
        elif _default_shown(action.default) and (action.option_strings or action.nargs in ("?", "*")):
            text = _rendered(parser, action)
            if str(action.default) not in text or "default" not in text:
                hidden.append(f"{name} (default {action.default!r}): {text}")
    assert not missing, f"{' '.join(words)}: arguments without a help line: {missing}"
    assert not hidden, f"{' '.join(words)}: defaults --help does not show:\n" + "\n".join(hidden)


def test_quantize_help_names_k4(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["quantize", "--help"])
    assert ei.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: k4)" in out


def _mcf():
    return mcf_command()


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"mcf {mcf.__version__}") and os.path.dirname(mcf.__file__) in out, out
    # as a user runs it: the console script
    r = subprocess.run(_mcf() + ["--version"], capture_output=True, text=True, check=False, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "MCF_FORCE_IMPL"})
    assert r.returncode == 0 and r.stdout.startswith(f"mcf {mcf.__version__}"), r.stderr


def test_version_flag_prints_a_long_install_path_on_one_line(capsys, monkeypatch):
    """argparse's version action wraps its text to the terminal: a wheel installed under a long path (a CI
    runner's test venv) came out as ".../site-\npackages/mcf", and the path could not be copied."""
    line = ("mcf 0.1.0 (mcf-formats) at "
            "/tmp/cibw-run-x1y2z3/cp311-manylinux_x86_64/venv-test/lib/python3.11/site-packages/mcf")
    monkeypatch.setattr("mcf._core.about.version_line", lambda: line)
    monkeypatch.setenv("COLUMNS", "60")
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0 and capsys.readouterr().out == line + "\n"


def test_version_command_says_what_a_bug_report_needs(capsys, monkeypatch):
    monkeypatch.delenv("MCF_FORCE_IMPL", raising=False)
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    k = mcf.kernel_info()
    for want in (f"mcf {mcf.__version__}", os.path.dirname(mcf.__file__), f"numpy {np.__version__}",
                 f"Python {platform.python_version()}", platform.machine(), f"kernels: {k['active']}",
                 ", ".join(k["supported"])):
        assert want in out, (want, out)
    assert main(["version", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mcf"]["version"] == mcf.__version__ and d["mcf"]["location"] == os.path.dirname(mcf.__file__)
    assert d["numpy"]["version"] == np.__version__ and d["python"]["version"] == platform.python_version()
    assert d["kernels"]["active"] == k["active"] and d["kernels"]["supported"] == k["supported"]
    assert set(d["optional"]) >= {"tokenizers", "lz4", "starlette", "uvicorn", "torch"}


def test_version_reports_a_bad_forced_variant_instead_of_failing(capsys, monkeypatch):
    """A bug report is most needed when something is off: an invalid MCF_FORCE_IMPL is shown, not fatal."""
    monkeypatch.setenv("MCF_FORCE_IMPL", "avx3")
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert "MCF_FORCE_IMPL='avx3'" in out and "unknown kernel variant" in out
