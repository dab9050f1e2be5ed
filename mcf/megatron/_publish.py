"""Publishing a ``.bin``/``.idx`` pair so that a crash between its two renames can be finished later.

Two files cannot be replaced in one atomic step.  The writer therefore first records its intent in
``PREFIX.publish`` (the names of its two complete temporary files, as JSON) and holds an exclusive
``flock`` on that file while it renames them into place; the intent file is removed when both are in
place.  If the process dies between the renames, the intent file stays and its lock is released by the
kernel.  A reader that finds a pair it cannot open, and an intent file nobody holds locked, finishes the
publish (rolls forward: both temporary files are complete, they were written before the intent); a new
writer does the same before it starts.  A live writer is never disturbed: its lock is held.
"""

from __future__ import annotations

import fcntl
import json
import os

from mcf._core.fs import fsync_file, open_regular

INTENT_SUFFIX = ".publish"


def intent_path(prefix: str) -> str:
    return prefix + INTENT_SUFFIX


class Intent:
    """Held by a writer across its renames (a context manager)."""

    def __init__(self, prefix: str, renames: list, durable: bool):
        self.path = intent_path(prefix)
        from mcf._core.fs import create_temp

        d = os.path.dirname(os.path.abspath(self.path))
        fd, tmp = create_temp(d, os.path.basename(self.path))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"renames": [[os.path.basename(a), os.path.basename(b)] for a, b in renames]}, f)
            f.flush()
            if durable:
                fsync_file(f.fileno())
        self._fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.replace(tmp, self.path)          # the lock travels with the inode

    def done(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self._fd)


def finish_interrupted(prefix: str) -> bool:
    """Complete a publish whose writer died between its renames; True when something was done.
    Returns False (and touches nothing) when there is no intent file or a live writer holds it."""
    path = intent_path(prefix)
    try:
        fd = open_regular(path)  # a FIFO planted there is not an intent (and must not block)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False                    # a live writer is publishing right now
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                return False                # finished meanwhile, and a new writer's intent took the name
        except FileNotFoundError:
            return False                    # the writer finished between our open and our lock
        try:
            with os.fdopen(os.dup(fd), "r", encoding="utf-8") as f:
                doc = json.load(f)
            renames = [(str(a), str(b)) for a, b in doc["renames"]]
        except (OSError, ValueError, KeyError, TypeError):
            return False                    # not ours or damaged: leave it for a human
        d = os.path.dirname(os.path.abspath(path))
        for a, b in renames:
            if os.sep in a or os.sep in b or a in ("", ".", "..") or b in ("", ".", ".."):
                return False
            src = os.path.join(d, a)
            if os.path.exists(src):
                os.replace(src, os.path.join(d, b))
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return True
    finally:
        os.close(fd)
