"""The filesystem rules every writer of mcf follows, in one place.

A writer never changes a file a reader may have open: it writes a temporary file next to the
destination and renames it over the destination (``rename(2)`` is atomic within a directory), so a
reader, or a crash, sees the old file or the new one, never a torn one.

- :func:`create_temp` makes the temporary: ``.<name>.<pid>.<random>.tmp`` in the destination's
  directory (hidden, recognisable by recovery code as a crashed writer's leftover, never a name a
  reader looks for), created exclusively with the permissions a plain ``open`` gives (``mkstemp``'s
  0600 would leak into the published file).
- :func:`publish` renames it into place; with ``durable=True`` it also fsyncs the directory, which is
  what makes the rename itself survive a power loss (the file's own data must have been fsynced by
  the writer before, on the descriptor it holds).
- :func:`fsync_dir` fsyncs a directory and raises :class:`mcf.MCFIOError` when the operating system
  refuses: a caller that asked for durability is told when it did not get it.  No writer swallows
  that error (an earlier version of the MCF writer did).
- :func:`write_atomic` does the three for a small file written in one go (JSON lists, indexes).
- :func:`fsync_file` is the one fsync of the package: ``fsync(2)`` on Linux; on macOS ``F_FULLFSYNC``,
  because there ``fsync`` only hands the data to the drive, whose write cache can still lose it on a power
  loss (Apple's fsync(2) man page says so).  :func:`preallocate` reserves a file's blocks up front where
  the system can (``posix_fallocate``; macOS has none).
- :func:`make_parent_dir` creates the missing directories an output path names (``--output-prefix
  data/corpus`` in a fresh checkout), as ``mcf export -o DIR`` creates ``DIR``: a command that fails
  with "data/corpus.bin: No such file or directory" reads as if an input were missing.

The bucket keeps its own descriptor-relative variants (``mcf.bucket._fs``: every path is opened
under a directory descriptor with ``O_NOFOLLOW``), because a bucket directory is shared with other
processes and must not follow a planted link; the naming and ordering rules are the same.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets

from mcf.errors import MCFError, os_error

__all__ = ["TEMP_SUFFIX", "create_temp", "fsync_dir", "fsync_file", "make_parent_dir", "preallocate", "publish",
           "temp_name", "write_all", "write_atomic"]

TEMP_SUFFIX = ".tmp"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FULLFSYNC = getattr(fcntl, "F_FULLFSYNC", None)   # macOS only


def fsync_file(fd: int) -> None:
    """Make what was written to ``fd`` (a file or a directory) durable; raises the ``OSError`` of the
    system.  macOS: ``F_FULLFSYNC`` (a plain fsync there leaves the data in the drive's cache), and the
    plain fsync where a filesystem does not support it (some network and FUSE ones answer ENOTSUP)."""
    if _FULLFSYNC is not None:
        try:
            fcntl.fcntl(fd, _FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


def preallocate(fd: int, size: int) -> None:
    """Allocate the first ``size`` bytes of the file ``fd`` now, so that a full disk fails here with ENOSPC
    rather than later with SIGBUS on a write through a mapping.  ``posix_fallocate`` where the system has it;
    elsewhere (macOS) the file is only extended to ``size`` (sparse: there the disk-full case stays a
    write error)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    elif os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)


def make_parent_dir(path, *, what: str = "writing") -> None:
    """Create the directories above the file ``path`` that do not exist yet (``mkdir -p``); an
    :class:`mcf.MCFIOError` subclass names the directory when that fails.  A URL is refused first
    (:func:`mcf.remote.refuse_url`, saying ``what`` was attempted): it names no local directory."""
    from mcf.remote import refuse_url

    refuse_url(path, what=what)
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, directory) from None


def temp_name(directory: str, base: str) -> str:
    """A fresh temporary name for ``base`` in ``directory`` (``.<base>.<pid>.<random>.tmp``)."""
    return os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def create_temp(directory: str, base: str) -> tuple[int, str]:
    """``(fd, name)`` of a new, exclusively created temporary file for ``base`` in ``directory``,
    opened read-write with mode 0666 (before the umask).  Raises the ``OSError`` of ``open`` (the
    caller names the destination in its error)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _CLOEXEC
    for _ in range(100):
        name = temp_name(directory, base)
        try:
            return os.open(name, flags, 0o666), name
        except FileExistsError:
            continue
    raise os_error(FileExistsError(errno.EEXIST, "could not create a temporary file"), directory)


def fsync_dir(dirpath) -> None:
    """fsync the directory ``dirpath`` (so renames and creations in it are durable).  Raises
    :class:`mcf.MCFIOError` naming the directory."""
    dirpath = os.fspath(dirpath) or "."
    try:
        fd = os.open(dirpath, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    except OSError as exc:
        raise os_error(exc, dirpath) from None
    try:
        fsync_file(fd)
    except OSError as exc:
        raise os_error(exc, dirpath) from None
    finally:
        os.close(fd)


def publish(tmp: str, final: str, *, durable: bool) -> None:
    """Rename ``tmp`` over ``final``; with ``durable`` fsync ``final``'s directory afterwards.  The
    caller fsyncs the file's data first (it holds the descriptor) and removes ``tmp`` on failure."""
    os.replace(tmp, final)
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(final)))


def write_all(fd: int, data) -> None:
    """Write every byte of ``data`` (any buffer) to ``fd`` (``os.write`` may write less)."""
    mv = memoryview(data).cast("B")
    while mv:
        mv = mv[os.write(fd, mv):]


def write_atomic(path, write, *, durable: bool = False) -> None:
    """Create ``path`` through a temporary file: ``write(fd)`` fills it, it is fsynced and renamed
    into place (:func:`publish`); the temporary is removed on any failure.  OS errors are raised as
    :class:`mcf.MCFIOError` naming ``path``."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = create_temp(d, os.path.basename(path))
    except OSError as exc:
        raise os_error(exc, path) from None
    try:
        try:
            write(fd)
            fsync_file(fd)
        finally:
            os.close(fd)
        publish(tmp, path, durable=durable)
    except BaseException as exc:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, MCFError):
            raise os_error(exc, path) from None
        raise
