"""mcf._core.fs: the one place of the filesystem rules every writer follows."""

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


def test_fsync_file_is_full_fsync_where_the_system_has_it(tmp_path, monkeypatch):
    """macOS's fsync leaves data in the drive's cache: fsync_file asks for F_FULLFSYNC there, and falls back
    to the plain fsync where a filesystem refuses it.  Played here with a stand-in for the fcntl call."""
    calls = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", fd)))
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        monkeypatch.setattr(fs, "_FULLFSYNC", None)                  # Linux
        fs.fsync_file(fd)
        assert calls == [("fsync", fd)]
        calls.clear()
        monkeypatch.setattr(fs, "_FULLFSYNC", 51)                    # macOS's F_FULLFSYNC number
        monkeypatch.setattr(fs.fcntl, "fcntl", lambda f, op: calls.append(("fcntl", f, op)))
        fs.fsync_file(fd)
        assert calls == [("fcntl", fd, 51)]
        calls.clear()

        def refuse(f, op):
            raise OSError(45, "Operation not supported")            # ENOTSUP on a network filesystem

        monkeypatch.setattr(fs.fcntl, "fcntl", refuse)
        fs.fsync_file(fd)
        assert calls == [("fsync", fd)]
    finally:
        os.close(fd)


def test_preallocate_with_and_without_posix_fallocate(tmp_path, monkeypatch):
    for have in (True, False):
        path = tmp_path / f"f{have}"
        path.write_bytes(b"abc")
        if not have:                                                 # macOS: no posix_fallocate
            monkeypatch.delattr(os, "posix_fallocate", raising=False)
        fd = os.open(path, os.O_RDWR)
        try:
            fs.preallocate(fd, 1 << 20)
            fs.preallocate(fd, 10)                                   # never shrinks
        finally:
            os.close(fd)
        assert path.stat().st_size == 1 << 20 and path.read_bytes()[:3] == b"abc"


def test_no_module_calls_fsync_or_fallocate_directly():
    """One place decides how a file is made durable (F_FULLFSYNC on macOS) and preallocated."""
    root = pathlib.Path(mcf.__file__).parent
    bad = [f"{p.relative_to(root)}:{n}" for p in root.rglob("*.py") if p.name != "fs.py"
           for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
           if re.search(r"\bos\.(fsync|posix_fallocate)\(", line)]
    assert not bad, bad
