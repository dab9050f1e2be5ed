"""The ``mcf`` command of the interpreter running the tests, as a user of that environment runs it.

Not ``shutil.which("mcf")``: the first ``mcf`` on PATH may belong to another environment (a CI leg runs
``venv/bin/python -m pytest`` without activating the venv, and PATH then finds the machine Python's
``mcf``, another install of another build), and the test would exercise that one instead."""

from __future__ import annotations

import os
import sys


def mcf_command() -> list:
    """``[path of this environment's mcf script]``, or ``[python, -m, mcf.cli]`` where none is installed
    (a checkout run with PYTHONPATH)."""
    exe = os.path.join(os.path.dirname(sys.executable), "mcf")
    return [exe] if os.path.isfile(exe) and os.access(exe, os.X_OK) else [sys.executable, "-m", "mcf.cli"]
