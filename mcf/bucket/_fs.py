"""Every file operation inside a bucket, made relative to the root directory's descriptor.

Why: a bucket directory can be writable by more people than the process serving it, or restored from
an archive someone else made.  Anything planted in it (a symbolic link named ``registry.journal``,
``.lock``, ``models`` or ``contexts/<id>/metadata.json``; a FIFO or a device file where a JSON or KV
file should be) must not make the bucket read, create, truncate or delete a file outside its root, and
must not make it block.  Path checks before an ``open`` cannot promise that (the path can change
between the check and the use), so nothing here checks a path and then uses it:

* the root is opened once, by its path (following links: choosing the root is the caller's business);
* every component below it is opened relative to its parent's descriptor (``dir_fd``) with
  ``O_NOFOLLOW``, so no component is resolved twice and none can be swapped for a link;
* files are opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO then opens at once instead of waiting for
  a writer; the flag is cleared again on the regular file), and the *opened descriptor* is checked with
  ``fstat``: anything but a regular file is closed and refused;
* renames, ``mkdir``, ``unlink`` and tree removal take directory descriptors too, and removal never
  follows a link (a link is removed itself, never what it points to).

A refused entry raises :class:`~mcf.errors.FormatError` naming it (the bucket's content is not what a
bucket holds); a missing one :class:`~mcf.errors.MissingFileError` (also a ``FileNotFoundError``).
Paths inside the bucket are written as ``"contexts/<id>/metadata.json"`` (``/``-separated, no ``.``
or ``..`` components, checked) and only joined to the root for messages.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

from mcf._core.fs import file_kind, fsync_file
from mcf.errors import ClosedError, FormatError, InvalidArgumentError, os_error

__all__ = ["BucketFS", "refusal"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
def refusal(mode: int) -> str:
    """Why an entry of this ``st_mode`` is refused where a regular file belongs."""
    if stat.S_ISLNK(mode):
        return "is a symbolic link; links are not followed inside a bucket"
    return f"is {file_kind(mode)}, not a regular file"


def _parts(rel: str) -> list[str]:
    parts = rel.split("/")
    for p in parts:
        if p in ("", ".", "..") or "\0" in p:
            raise InvalidArgumentError(f"bad bucket-relative path {rel!r}")  # a bug in the caller, never user input
    return parts


class BucketFS:
    """The root directory of a bucket, held open; see the module docstring for the rules."""

    def __init__(self, root: str | os.PathLike, *, create: bool) -> None:
        self.root = Path(root)
        try:
            if create:
                os.makedirs(self.root, exist_ok=True)
            self._fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except OSError as exc:
            raise os_error(exc, self.root) from exc

    # -- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    @property
    def fd(self) -> int:
        if self._fd < 0:
            raise ClosedError(f"{self.root}: the bucket is closed")
        return self._fd

    def where(self, rel: str) -> Path:
        """``rel`` as a path under the root, for messages."""
        return self.root / rel

    def _refuse(self, exc: OSError, rel: str) -> Exception:
        """The error to raise for a failed system call on ``rel``."""
        if exc.errno == errno.ELOOP:
            return FormatError("is a symbolic link; links are not followed inside a bucket", path=self.where(rel))
        if exc.errno == errno.ENOTDIR:
            return FormatError("a path component is not a directory", path=self.where(rel))
        if exc.errno == errno.ENXIO:  # O_WRONLY | O_NONBLOCK on a FIFO without a reader, or a socket
            return FormatError("not a regular file", path=self.where(rel))
        if exc.errno == errno.EISDIR:  # a directory where a file is written (opened for writing, renamed over)
            return FormatError("is a directory, not a regular file", path=self.where(rel))
        return os_error(exc, self.where(rel))

    # -- directories ---------------------------------------------------------------------------------
    def open_dir(self, rel: str | None) -> int:
        """A new descriptor of directory ``rel`` (None: the root), every component opened with
        O_NOFOLLOW relative to its parent.  The caller closes it (or uses :meth:`dir`)."""
        fd = os.dup(self.fd) if rel is None else -1
        if rel is None:
            return fd
        parent = self.fd
        parts = _parts(rel)
        for i, part in enumerate(parts):
            try:
                fd = os.open(part, _DIR_FLAGS, dir_fd=parent)
            except OSError as exc:
                err = self._refuse(exc, rel)
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # say what is there instead of a directory
                    with contextlib.suppress(OSError):
                        st = os.stat(part, dir_fd=parent, follow_symlinks=False)
                        what = ("is a symbolic link; links are not followed inside a bucket"
                                if stat.S_ISLNK(st.st_mode) else f"is {file_kind(st.st_mode)}, not a directory")
                        err = FormatError(what, path=self.where("/".join(parts[:i + 1])))
                if parent != self._fd:
                    os.close(parent)
                raise err from None
            if parent != self._fd:
                os.close(parent)
            parent = fd
        return fd

    @contextlib.contextmanager
    def dir(self, rel: str | None) -> Iterator[int]:
        """Directory ``rel`` (None: the root itself, not duplicated) for the duration of a block."""
        if rel is None:
            yield self.fd
            return
        fd = self.open_dir(rel)
        try:
            yield fd
        finally:
            os.close(fd)

    def _split(self, rel: str) -> tuple[str | None, str]:
        head, _, name = rel.rpartition("/")
        _parts(rel)
        return (head or None), name

    def mkdir(self, rel: str, *, exist_ok: bool = False) -> None:
        head, name = self._split(rel)
        with self.dir(head) as d:
            try:
                os.mkdir(name, 0o755, dir_fd=d)
            except FileExistsError:
                if not exist_ok:
                    raise
            except OSError as exc:
                raise self._refuse(exc, rel) from None

    def fsync_dir(self, rel: str | None) -> None:
        with self.dir(rel) as d:
            fsync_file(d)

    def listdir(self, rel: str) -> list[tuple[str, os.stat_result | None]]:
        """(name, lstat result or None when it vanished) of every entry of directory ``rel``, each
        ``lstat``-ed relative to the open directory (a DirEntry of a descriptor-based scan must not
        outlive the descriptor, so none is handed out)."""
        out = []
        with self.dir(rel) as d:
            try:
                with os.scandir(d) as it:
                    for e in it:
                        try:
                            out.append((e.name, e.stat(follow_symlinks=False)))
                        except OSError:
                            out.append((e.name, None))
            except OSError as exc:
                raise self._refuse(exc, rel) from None
        return out

    # -- files ---------------------------------------------------------------------------------------
    def open_file_at(self, dir_fd: int, name: str, flags: int = os.O_RDONLY, mode: int = 0o644, *,
                     rel: str | None = None) -> int:
        """A descriptor of the regular file ``name`` in directory ``dir_fd``: opened with O_NOFOLLOW and
        O_NONBLOCK, checked with fstat, then made blocking again.  ``rel`` names it in messages."""
        rel = rel or name
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as exc:
            raise self._refuse(exc, rel) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(refusal(st.st_mode), path=self.where(rel))
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise self._refuse(exc, rel) from None
            raise
        return fd

    def open_file(self, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
        head, name = self._split(rel)
        with self.dir(head) as d:
            return self.open_file_at(d, name, flags, mode, rel=rel)

    def read(self, rel: str, *, limit: int | None = None) -> bytes:
        """The whole regular file ``rel`` (FormatError when it is larger than ``limit`` bytes)."""
        head, name = self._split(rel)
        with self.dir(head) as d:
            return self.read_at(d, name, limit=limit, rel=rel)

    def read_at(self, dir_fd: int, name: str, *, limit: int | None = None, rel: str | None = None) -> bytes:
        rel = rel or name
        fd = self.open_file_at(dir_fd, name, rel=rel)
        try:
            size = os.fstat(fd).st_size
            if limit is not None and size > limit:
                raise FormatError(f"file of {size} bytes, more than the {limit} allowed", path=self.where(rel))
            chunks, want = [], size + 1  # one byte more: a file that grew meanwhile is read to its end below
            while True:
                piece = os.read(fd, max(want, 1 << 16))
                if not piece:
                    break
                chunks.append(piece)
                want -= len(piece)
                if limit is not None and sum(map(len, chunks)) > limit:
                    raise FormatError(f"file larger than the {limit} bytes allowed", path=self.where(rel))
        except OSError as exc:
            raise self._refuse(exc, rel) from None
        finally:
            os.close(fd)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def write_atomic(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        """Replace ``rel`` with ``data``: a new hidden file in the same directory, written (and fsynced
        when ``durable``), renamed over ``rel`` (which replaces a planted link itself, never its
        target), then the directory fsynced when ``durable``."""
        head, name = self._split(rel)
        tmp = f".{name}.{uuid.uuid4().hex}.tmp"
        with self.dir(head) as d:
            try:
                fd = self.open_file_at(d, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, rel=rel)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    if durable:
                        fsync_file(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, name, src_dir_fd=d, dst_dir_fd=d)
                if durable:
                    fsync_file(d)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
                raise self._refuse(exc, rel) from None
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
                raise

    def temp_file(self, rel: str) -> int:
        """A new read-write file in directory ``rel`` that has no name (``O_TMPFILE``; where the file
        system lacks it, a hidden name unlinked at once): its space is freed when the last descriptor
        and mapping of it go, whatever happens to the process."""
        with self.dir(rel) as d:
            tmpfile = getattr(os, "O_TMPFILE", 0)
            if tmpfile:
                try:
                    return os.open(".", tmpfile | os.O_RDWR | _CLOEXEC, 0o600, dir_fd=d)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                        raise self._refuse(exc, rel) from None
            name = f".spool-{uuid.uuid4().hex}"
            fd = self.open_file_at(d, name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, rel=f"{rel}/{name}")
            os.unlink(name, dir_fd=d)
            return fd

    # -- names ---------------------------------------------------------------------------------------
    def lstat(self, rel: str) -> os.stat_result | None:
        """``lstat`` of ``rel`` (its directories opened without following links); None when absent."""
        head, name = self._split(rel)
        try:
            with self.dir(head) as d:
                return os.stat(name, dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._refuse(exc, rel) from None

    def rename(self, src: str, dst: str) -> None:
        """Rename within one directory or between two; a link is moved as itself."""
        shead, sname = self._split(src)
        dhead, dname = self._split(dst)
        with self.dir(shead) as sd:
            with (contextlib.nullcontext(sd) if dhead == shead else self.dir(dhead)) as dd:
                try:
                    os.rename(sname, dname, src_dir_fd=sd, dst_dir_fd=dd)
                except OSError as exc:
                    raise self._refuse(exc, src) from None

    def remove_tree(self, rel: str) -> None:
        """Remove ``rel`` and everything below it, never following a link (a link, FIFO or file is
        unlinked itself); errors are ignored, as for leftovers that may already be gone."""
        head, name = self._split(rel)
        with contextlib.suppress(OSError), self.dir(head) as d:
            self.remove_tree_at(d, name)

    def remove_tree_at(self, dir_fd: int, name: str) -> None:
        with contextlib.suppress(OSError):
            _remove_tree_at(dir_fd, name)


def _remove_tree_at(dir_fd: int, name: str) -> None:
    """Remove ``name`` under ``dir_fd`` and everything below it through directory descriptors only, so
    a link planted anywhere in the tree is unlinked, never followed. ``shutil.rmtree(dir_fd=)`` does
    the same but only from Python 3.11; this walk keeps an explicit stack, so a planted tree deeper
    than the recursion limit is removed too. The first directory that cannot be removed raises
    ``OSError`` and leaves the rest, as leftovers for the next sweep."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    stack = [(dir_fd, name, os.open(name, flags, dir_fd=dir_fd))]  # (parent fd, name, own fd)
    try:
        while stack:
            parent, dname, fd = stack[-1]
            child = None
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            child = entry.name
                            break
                        os.unlink(entry.name, dir_fd=fd)
                    except OSError:
                        pass
            if child is not None:
                try:
                    stack.append((fd, child, os.open(child, flags, dir_fd=fd)))
                    continue
                except OSError:
                    pass  # vanished or replaced by a link since the scan: fall through, rmdir fails
            stack.pop()
            os.close(fd)
            os.rmdir(dname, dir_fd=parent)  # a refusal ends the walk: rescanning would loop forever
    finally:
        for _, _, fd in stack:
            os.close(fd)

