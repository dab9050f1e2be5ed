"""Snapshots and restore of a MegaContext tree (seed 000's ``checkpoints/<timestamp>/`` layout).

A snapshot copies the committed prefix of each .ctx file (a canonical header with the committed count,
then the data) into a staging directory, writes metadata.json last, syncs everything and renames the
staging directory into place: a snapshot directory either exists complete or not at all.

A restore copies a snapshot's files next to the tree's under temporary names, records the plan in a
marker file, renames them over the tree's files (metadata.json last) and deletes the marker.  A restore
interrupted after the marker was written is finished by the next writer's open (the renames are
idempotent); one interrupted before leaves the tree untouched and only temporary files to remove.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from mcf.errors import InvalidArgumentError, MCFIOError, os_error
from mcf.megacontext._layout import HEADER_SIZE, LEVEL_FILES, LEVELS
from mcf.megacontext._lock import acquire_lock, restore_marker
from mcf._core.fs import fsync_dir, fsync_file, open_regular
from mcf.megacontext.metadata import METADATA, now_iso, with_counts, write_metadata

__all__ = ["snapshot", "restore_validated", "finish_restore", "CHECKPOINTS"]

CHECKPOINTS = "checkpoints"
_TMP_PREFIX = ".restore-"


def _copy_range(src_fd, dst_fd, offset, count, path):
    """Copy ``count`` bytes at ``offset`` of src_fd to the current end of dst_fd (copy_file_range when
    the kernel has it, so the bytes need not pass through user space)."""
    done = 0
    try:
        while done < count:
            want = min(count - done, 1 << 30)
            try:
                n = os.copy_file_range(src_fd, dst_fd, want, offset + done)
            except (AttributeError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno not in (18, 22, 38, 95):  # EXDEV EINVAL ENOSYS EOPNOTSUPP
                    raise
                n = os.write(dst_fd, os.pread(src_fd, min(want, 1 << 24), offset + done))
            if n <= 0:
                raise MCFIOError(5, "file shrank while copying", path)
            done += n
    except OSError as exc:
        raise os_error(exc, path) from None


def _stamp() -> str:
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())


def snapshot(tree, dest=None) -> str:
    """Copy the committed state of ``tree`` to ``dest`` (default ``<tree>/checkpoints/<UTC time>/``);
    returns the snapshot directory.

    From the writer the copy is exact.  From a reader in another process, the counts are read once
    (:meth:`Tree.refresh`) and only that prefix is copied, which appends cannot disturb; gists being
    rewritten in place by the writer at that moment may be copied half old, half new."""
    tree.check_open()
    if tree.writable:
        tree.commit()
    else:
        tree.refresh()
    counts = tree.committed_counts
    if dest is None:
        base = os.path.join(tree.path, CHECKPOINTS)
        dest = os.path.join(base, _stamp())
        k = 1
        while os.path.exists(dest):
            k += 1
            dest = os.path.join(base, f"{_stamp()}_{k}")
    dest = os.path.abspath(os.fspath(dest))
    if os.path.exists(dest):
        raise InvalidArgumentError(f"{dest}: already exists")
    parent = os.path.dirname(dest)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = os.path.join(parent, f".{os.path.basename(dest)}.partial-{os.getpid()}")
        if os.path.exists(staging):
            shutil.rmtree(staging)
        os.mkdir(staging)
    except OSError as exc:
        raise os_error(exc, dest) from None
    try:
        for level in LEVELS:
            out = os.path.join(staging, LEVEL_FILES[level])
            n = counts[level]
            try:
                fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            except OSError as exc:
                raise os_error(exc, out) from None
            try:
                hdr = tree.header(level).with_count(n).pack()
                os.write(fd, hdr)
                src = tree.level_source(level, n)
                _copy_range(src.fileno(), fd, HEADER_SIZE, n * tree.header(level).entry_size, src.name)
                fsync_file(fd)
            finally:
                os.close(fd)
        meta = with_counts(tree.metadata, counts)
        meta["snapshot"] = {"of": tree.path, "taken_at": now_iso()}
        write_metadata(staging, meta, durable=True)
        fsync_dir(staging)
        os.rename(staging, dest)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


_marker = restore_marker


def finish_restore(tree_dir) -> list:
    """Roll an interrupted restore forward (marker present) or clean up its temporary files (no
    marker: the tree was never touched).  Called by a writer's open, under the writer lock."""
    done = []
    marker = _marker(tree_dir)
    names = [LEVEL_FILES[lv] for lv in LEVELS] + [METADATA]
    if os.path.exists(marker):
        for name in names:
            tmp = os.path.join(tree_dir, _TMP_PREFIX + name)
            if os.path.exists(tmp):
                os.replace(tmp, os.path.join(tree_dir, name))
        fsync_dir(tree_dir)
        os.unlink(marker)
        fsync_dir(tree_dir)
        done.append("finished an interrupted restore")
    for name in names:
        tmp = os.path.join(tree_dir, _TMP_PREFIX + name)
        if os.path.exists(tmp):
            os.unlink(tmp)
            done.append(f"removed {tmp}")
    return done


def restore_validated(snapshot_dir, tree_dir, *, counts: dict, entry_sizes: dict, meta: dict, locked: bool) -> None:
    """The file work of :func:`mcf.megacontext.restore`, once the snapshot in ``snapshot_dir`` opened
    without errors (``counts``: its committed entries per level, ``entry_sizes``: bytes per entry of
    each level, ``meta``: its metadata with those counts).  ``locked``: the caller already holds
    ``tree_dir``'s writer lock."""
    snapshot_dir = os.path.abspath(os.fspath(snapshot_dir))
    tree_dir = os.path.abspath(os.fspath(tree_dir))
    entry = entry_sizes
    snap_meta = dict(meta)
    snap_meta.pop("snapshot", None)
    snap_meta["restored_from"] = snapshot_dir
    snap_meta["last_modified"] = now_iso()
    try:
        os.makedirs(tree_dir, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, tree_dir) from None
    lock = -1 if locked else acquire_lock(tree_dir)
    try:
        finish_restore(tree_dir)
        for level in LEVELS:
            name = LEVEL_FILES[level]
            src_path = os.path.join(snapshot_dir, name)
            tmp = os.path.join(tree_dir, _TMP_PREFIX + name)
            try:
                sfd = open_regular(src_path)
                dfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
            except OSError as exc:
                raise os_error(exc, src_path) from None
            try:
                _copy_range(sfd, dfd, 0, HEADER_SIZE + counts[level] * entry[level], src_path)
                fsync_file(dfd)
            finally:
                os.close(sfd)
                os.close(dfd)
        write_metadata(tree_dir, snap_meta, durable=True, name=_TMP_PREFIX + METADATA)
        with open(_marker(tree_dir) + ".tmp", "w") as f:
            json.dump({"snapshot": snapshot_dir, "files": [LEVEL_FILES[lv] for lv in LEVELS] + [METADATA]}, f)
            f.flush()
            fsync_file(f.fileno())
        os.replace(_marker(tree_dir) + ".tmp", _marker(tree_dir))
        fsync_dir(tree_dir)
        finish_restore(tree_dir)
    except OSError as exc:
        raise os_error(exc, tree_dir) from None
    finally:
        if lock >= 0:
            os.close(lock)
