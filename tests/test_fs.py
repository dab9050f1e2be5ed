"""mcf._core.fs: the one place of the filesystem rules every writer follows (issue 15 item 3)."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import stat

import pytest

import mcf
from mcf._core import fs


def test_create_temp_names_and_mode(tmp_path):
    old = os.umask(0o022)
    try:
        fd, name = fs.create_temp(str(tmp_path), "model.mcf")
    finally:
        os.umask(old)
    os.close(fd)
    assert re.fullmatch(rf"\.model\.mcf\.{os.getpid()}\.[0-9a-f]{{8}}\.tmp", os.path.basename(name))
    assert os.path.dirname(name) == str(tmp_path)
    assert stat.S_IMODE(os.stat(name).st_mode) == 0o644  # what a plain open() gives, not mkstemp's 0600


def test_write_atomic_publishes_and_cleans_up(tmp_path):
    p = tmp_path / "a.json"
    p.write_bytes(b"old")
    fs.write_atomic(p, lambda fd: fs.write_all(fd, b"new"), durable=True)
    assert p.read_bytes() == b"new"

    def fail(fd):
        fs.write_all(fd, b"half")
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError):
        fs.write_atomic(p, fail)
    assert p.read_bytes() == b"new"                       # the destination is untouched
    assert sorted(os.listdir(tmp_path)) == ["a.json"]     # and the temporary is gone


def test_write_atomic_names_the_file_on_os_errors(tmp_path):
    with pytest.raises(mcf.MissingFileError) as ei:
        fs.write_atomic(tmp_path / "no" / "such" / "x", lambda fd: None)
    assert "x" in str(ei.value)


def test_fsync_dir_raises_instead_of_swallowing(tmp_path):
    fs.fsync_dir(tmp_path)
    with pytest.raises(mcf.MissingFileError) as ei:
        fs.fsync_dir(tmp_path / "gone")
    assert str(tmp_path / "gone") in str(ei.value)


def test_no_second_implementation():
    """No module other than mcf._core.fs (and the bucket's descriptor-relative variant) defines the
    filesystem helpers again."""
    pkg = pathlib.Path(mcf.__file__).parent
    names = {"fsync_dir", "_fsync_dir", "create_temp", "_create_temp", "write_atomic", "write_all", "_write_all"}
    bad = []
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg).as_posix()
        if rel in ("_core/fs.py", "bucket/_fs.py"):
            continue
        for node in ast.parse(path.read_text()).body:  # module-level functions
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
                bad.append(f"{rel}:{node.lineno}: {node.name}")
    assert not bad, bad
