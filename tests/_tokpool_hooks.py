"""Stand-ins for ``mcf.conversion._tokpool._work`` that tokenize's worker processes run in
tests/test_tokenize_pool.py: a worker is another process, so it finds them by name (this module), not
through the test's monkeypatch."""

from __future__ import annotations

import os
import signal

from mcf.conversion import _tokpool


def die_on_its_block(block, first, path: str, as_json: bool, spill=None):
    """A worker killed (SIGKILL: no exception, no cleanup) while it tokenizes a block."""
    os.kill(os.getpid(), signal.SIGKILL)
    return _tokpool._work(block, first, path, as_json, spill)   # not reached
