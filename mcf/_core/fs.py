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
- :func:`write_atomic` does the three for a small file written in one go (JSON lists, indexes);
  :func:`write_temp` does the first two for a writer that renames several files in an order of its own.
- :func:`fsync_file` is the one fsync of the package: ``fsync(2)`` on Linux; on macOS ``F_FULLFSYNC``,
  because there ``fsync`` only hands the data to the drive, whose write cache can still lose it on a power
  loss (Apple's fsync(2) man page says so).  :func:`preallocate` reserves a file's blocks up front where
  the system can (``posix_fallocate``; macOS has none).
- :func:`make_parent_dir` creates the missing directories an output path names (``--output-prefix
  data/corpus`` in a fresh checkout), as ``mcf export -o DIR`` creates ``DIR``: a command that fails
  with "data/corpus.bin: No such file or directory" reads as if an input were missing.

Readers follow one rule too: a path mcf reads is a regular file, checked *before* anything can block.
:func:`open_regular` looks at the path with ``stat`` (a FIFO, a socket or a device is refused without
being opened: opening a FIFO waits for a writer, forever; ``/dev/zero`` never ends), opens it with
``O_NONBLOCK`` (so a FIFO swapped in after the ``stat`` opens at once instead of blocking) and checks the
*opened descriptor* with ``fstat`` before clearing the flag again.  The refusal is an
:class:`mcf.MCFIOError` naming the path and what it is ("is a FIFO, not a regular file").
:func:`read_regular` reads such a file whole, up to a limit the caller states: the resources mcf reads
beside the weights (``config.json``, ``tokenizer.json``, shard indexes, imatrix files...) are read
in one piece, so each has a cap (:data:`MAX_JSON_BYTES`, :data:`MAX_TOKENIZER_BYTES`) and a larger file
is a :class:`mcf.FormatError` before any memory is spent on it.

The bucket keeps its own descriptor-relative variants (``mcf.bucket._fs``: every path is opened
under a directory descriptor with ``O_NOFOLLOW``), because a bucket directory is shared with other
processes and must not follow a planted link; the naming and ordering rules are the same.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat

from mcf._core.urls import refuse_url
from mcf.errors import FormatError, MCFError, MCFIOError, os_error

__all__ = ["MAX_JSON_BYTES", "MAX_TOKENIZER_BYTES", "TEMP_SUFFIX", "create_temp", "file_kind", "fsync_dir",
           "fsync_file", "make_parent_dir", "not_regular", "open_regular", "preallocate", "publish",
           "read_regular", "temp_name", "write_all", "write_atomic", "write_temp"]

TEMP_SUFFIX = ".tmp"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FULLFSYNC = getattr(fcntl, "F_FULLFSYNC", None)   # macOS only

#: the most bytes a JSON configuration file may hold (config.json, generation_config.json,
#: tokenizer_config.json, chat_template.jinja, a shard index, a Megatron shard list, an imatrix
#: file's JSON...).  Real ones are kilobytes; the largest shard indexes (a weight map of ~100k tensors)
#: and tokenizer configs (tens of thousands of added tokens) stay under 10 MB: 64 MiB leaves room
#: for six times that while keeping a planted or corrupt file from costing more than that in memory
#: (its parsed form takes several times its size).
MAX_JSON_BYTES = 64 << 20
#: the most bytes a tokenizer file may hold (tokenizer.json, vocab.json, merges.txt).  Real
#: tokenizer.json files reach 30+ MB (large multilingual vocabularies with their merges); 256 MiB
#: leaves eight times that, the same bound the GGUF reader puts on one string.
MAX_TOKENIZER_BYTES = 256 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def file_kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, for messages: "a regular file", "a FIFO", "a character
    device", ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_regular(path, mode: int) -> MCFIOError:
    """The error for ``path``, of this ``st_mode``, found where a regular file belongs."""
    kind = file_kind(mode)
    what = "not a regular file" if kind == "not a regular file" else f"is {kind}, not a regular file"
    return MCFIOError(errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL, what,
                      os.fsdecode(path) if path is not None else None)


def open_regular(path, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """A descriptor of the regular file ``path`` (``flags`` as for ``os.open``), or an
    :class:`mcf.MCFIOError` subclass naming it: missing, unreadable, or not a regular file (a FIFO, a
    socket, a device, a directory), which is refused without blocking.  See the module docstring."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except OSError as exc:
        if not flags & os.O_CREAT or exc.errno != errno.ENOENT:
            raise os_error(exc, os.fsdecode(p)) from None
    else:
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(p, st.st_mode)
    try:
        fd = os.open(p, flags | os.O_NONBLOCK | _CLOEXEC, mode)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a socket or FIFO swapped in after the stat
            try:
                err = not_regular(p, os.stat(p).st_mode)
            except OSError:
                err = None
            if err is not None:
                raise err from None
        raise os_error(exc, os.fsdecode(p)) from None
    with _undone_on_failure(lambda: os.close(fd), os.fsdecode(p)):
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between the stat and the open
            raise not_regular(p, st.st_mode)
        if not flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


@contextlib.contextmanager
def _undone_on_failure(undo, path):
    """Run ``undo()`` (close a descriptor, remove a temporary) when the block raises, then raise again: a
    plain OSError as the :class:`mcf.MCFIOError` naming ``path``, anything else as it is."""
    try:
        yield
    except BaseException as exc:
        undo()
        if isinstance(exc, OSError) and not isinstance(exc, MCFError):
            raise os_error(exc, path) from None
        raise


def _remove_if_there(tmp: str) -> None:
    if os.path.lexists(tmp):
        os.unlink(tmp)


def read_regular(path, *, limit: int, what: str = "file", missing_ok: bool = False) -> bytes | None:
    """The whole content of the regular file ``path`` (:func:`open_regular`), at most ``limit`` bytes.

    A larger file is a :class:`mcf.FormatError` naming it, ``what`` it is and the limit, raised before
    it is read (by its size) or as soon as more than ``limit`` bytes arrive (a file growing meanwhile),
    so no more than ``limit`` + 64 KiB is ever held.  ``missing_ok`` returns None for a path that does
    not exist instead of raising :class:`mcf.MissingFileError`."""
    p = os.fspath(path)
    try:
        fd = open_regular(p)
    except MCFIOError as exc:
        if missing_ok and exc.errno == errno.ENOENT:
            return None
        raise
    name = os.fsdecode(p)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise FormatError(f"{what} too large", path=name, expected=f"at most {limit} bytes",
                              got=f"{size} bytes")
        chunks, total = [], 0
        while True:
            piece = os.read(fd, max(min(limit + 1 - total, 1 << 26), 1 << 16))
            if not piece:
                break
            chunks.append(piece)
            total += len(piece)
            if total > limit:
                raise FormatError(f"{what} too large (it grew while read)", path=name,
                                  expected=f"at most {limit} bytes", got=f"more than {limit} bytes")
    except OSError as exc:
        if isinstance(exc, MCFError):
            raise
        raise os_error(exc, name) from None
    finally:
        os.close(fd)
    return b"".join(chunks)


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
    (:func:`mcf._core.urls.refuse_url`, saying ``what`` was attempted): it names no local directory."""
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


def write_temp(path, write) -> str:
    """The name of a complete, fsynced temporary file for ``path`` (:func:`create_temp`) that
    ``write(fd)`` filled; the caller renames it into place (:func:`publish`) or removes it.  The
    temporary is removed on any failure; OS errors are raised as :class:`mcf.MCFIOError` naming
    ``path``.  For a writer that publishes several files in an order of its own (``mcf export``'s
    shards); :func:`write_atomic` is the one-file case."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = create_temp(d, os.path.basename(path))
    except OSError as exc:
        raise os_error(exc, path) from None
    with _undone_on_failure(lambda: _remove_if_there(tmp), path):
        try:
            write(fd)
            fsync_file(fd)
        finally:
            os.close(fd)
    return tmp


def write_atomic(path, write, *, durable: bool = False) -> None:
    """Create ``path`` through a temporary file: ``write(fd)`` fills it, it is fsynced and renamed
    into place (:func:`publish`); the temporary is removed on any failure.  OS errors are raised as
    :class:`mcf.MCFIOError` naming ``path``."""
    path = os.fspath(path)
    tmp = write_temp(path, write)
    with _undone_on_failure(lambda: _remove_if_there(tmp), path):
        publish(tmp, path, durable=durable)
