"""A read-only passthrough FUSE filesystem for the tests, and the fixture code that mounts it.

Run as a program (``python tests/_fuse_passthrough.py ROOT MOUNTPOINT [--eio-from OFFSET]``) it serves
ROOT at MOUNTPOINT in the foreground through mfusepy (ctypes over Debian's libfuse3) until it is
unmounted.  ``--eio-from`` makes every read of a byte at or past OFFSET fail with EIO: a disk or a server
failing in the middle of a file, which no local filesystem can be made to do on demand.

:func:`mounted` mounts it in a child process and yields the mount point, or skips the test with the
reason FUSE cannot be used here (no ``/dev/fuse``, no ``fusermount3``, mfusepy or libfuse missing, or
the kernel refusing the mount); it always unmounts with ``fusermount3 -u`` and stops the child by its
PID.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time

FUSE_MAGIC = 0x65735546


def _serve(root: str, mountpoint: str, eio_from: int | None) -> None:
    import mfusepy as fuse

    class Passthrough(fuse.Operations):
        use_ns = True

        def _path(self, path):
            return os.path.join(root, path.lstrip("/"))

        def getattr(self, path, fh=None):
            try:
                st = os.lstat(self._path(path))
            except OSError as exc:
                raise fuse.FuseOSError(exc.errno) from None
            return {"st_mode": st.st_mode, "st_nlink": st.st_nlink, "st_size": st.st_size, "st_uid": st.st_uid,
                    "st_gid": st.st_gid, "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns,
                    "st_ctime": st.st_ctime_ns}

        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(self._path(path))

        def open(self, path, flags):
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise fuse.FuseOSError(errno.EROFS)
            return os.open(self._path(path), os.O_RDONLY)

        def read(self, path, size, offset, fh):
            if eio_from is not None and offset + size > eio_from:
                raise fuse.FuseOSError(errno.EIO)
            return os.pread(fh, size, offset)

        def release(self, path, fh):
            os.close(fh)
            return 0

    fuse.FUSE(Passthrough(), mountpoint, foreground=True, nothreads=False, ro=True)


def _is_fuse(path: str) -> bool:
    import mcf.io
    try:
        return mcf.io.storage_of(path).magic == FUSE_MAGIC
    except OSError:
        return False


@contextlib.contextmanager
def mounted(root, mountpoint, *, eio_from: int | None = None):
    """Mount ``root`` read-only at ``mountpoint`` (both existing directories); yields the mount point."""
    import pytest

    if not os.path.exists("/dev/fuse"):
        pytest.skip("FUSE: /dev/fuse does not exist on this machine")
    fusermount = shutil.which("fusermount3")
    if fusermount is None:
        pytest.skip("FUSE: fusermount3 is not installed (Debian's fuse3 package)")
    try:
        import mfusepy  # noqa: F401  (also loads libfuse: fails without libfuse3)
    except (ImportError, OSError, EnvironmentError) as exc:
        pytest.skip(f"FUSE: mfusepy cannot be used ({exc})")
    args = [sys.executable, os.path.abspath(__file__), str(root), str(mountpoint)]
    if eio_from is not None:
        args += ["--eio-from", str(eio_from)]
    log = tempfile.TemporaryFile()  # noqa: SIM115  (closed in the finally below)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not _is_fuse(str(mountpoint)):
            if proc.poll() is not None:
                log.seek(0)
                out = log.read().decode(errors="replace")
                if "ermission" in out or "EPERM" in out or "not permitted" in out:
                    pytest.skip(f"FUSE: the kernel refused the mount: {out.strip()[-300:]}")
                raise AssertionError(f"the FUSE server exited with {proc.returncode}: {out[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("the FUSE mount did not appear within 20 s")
            time.sleep(0.05)
        yield str(mountpoint)
    finally:
        subprocess.run([fusermount, "-u", str(mountpoint)], capture_output=True, timeout=30)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
        log.close()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("mountpoint")
    ap.add_argument("--eio-from", type=int)
    a = ap.parse_args()
    _serve(a.root, a.mountpoint, a.eio_from)
