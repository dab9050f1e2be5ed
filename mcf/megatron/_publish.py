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


def publish_pair(prefix: str, bin_tmp: str, idx_tmp: str, bin_size: int, durable: bool) -> None:
    """Rename the complete temporary files ``bin_tmp`` and ``idx_tmp`` to ``prefix + ".bin"`` and
    ``prefix + ".idx"``, the ``.bin`` first, under an :class:`Intent`.

    The old files are held open meanwhile: replacing the last link of a file frees its blocks inside
    rename(2) (4 ms for a 600 KB .bin on ext4 here), which would keep the prefix in its mixed state (new
    .bin, old .idx) that long; with the old inodes still referenced each step takes microseconds and the
    blocks are freed after both renames.  Between the two renames the prefix holds the new .bin beside the
    old .idx: the reader refuses such a pair by the .bin size the .idx implies, unless the two datasets
    happen to have the same .bin size (``bin_size``, the new one's): then the old .idx is removed first,
    so that moment (or a crash in it) shows a missing .idx instead of a plausible mixed dataset."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    held = []
    for p in (bin_path, idx_path):
        try:
            # O_NONBLOCK: only held, never read; a FIFO planted there must not block the publish
            held.append(os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)))
        except OSError:
            pass
    try:
        # a crash between the two renames is finished by the next reader or writer (finish_interrupted)
        with Intent(prefix, [(bin_tmp, bin_path), (idx_tmp, idx_path)], durable) as intent:
            try:
                same = os.stat(bin_path).st_size == bin_size
            except FileNotFoundError:
                same = False
            if same:
                try:
                    os.unlink(idx_path)
                except FileNotFoundError:
                    pass
            os.replace(bin_tmp, bin_path)
            os.replace(idx_tmp, idx_path)
            intent.done()
    finally:
        for fd in held:
            os.close(fd)


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
