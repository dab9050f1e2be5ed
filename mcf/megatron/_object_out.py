"""A Megatron dataset written to an object store (``s3://bucket/corpus`` -> ``corpus.bin`` + ``corpus.idx``).

An object store has no rename, so the pair cannot be swapped into place as on a disk.  What a reader sees is
kept consistent by the order of the writes instead:

1. before any work, an existing ``.idx`` or ``.bin`` at the prefix is refused unless ``overwrite`` (a
   :class:`mcf.MCFIOError` with errno ``EEXIST`` naming the prefix);
2. the ``.bin`` streams into a multipart upload as it is produced (:class:`mcf.remote._upload.ObjectUpload`),
   while the ``.idx`` is built in an unnamed local temporary file (``staging_dir``, the system's temporary
   directory by default: it needs about 13 bytes per sequence);
3. when everything is written, an old ``.idx`` (``overwrite``) is deleted, then the ``.bin`` upload is
   completed (the object appears whole, at once), then the ``.idx`` is uploaded.

So a reader that finds the ``.idx`` finds the complete ``.bin`` it describes; no moment shows a new ``.bin``
beside an old ``.idx``; a failure anywhere before step 3 leaves the store as it was (the multipart upload is
abandoned), and one during step 3 leaves at most a ``.bin`` without its ``.idx``, which no reader opens as a
dataset.  Two writers racing for one prefix are not arbitrated (nothing in S3 locks a prefix).
"""

from __future__ import annotations

import os
import tempfile

from mcf.errors import MCFIOError, os_error
from mcf.remote import redact

__all__ = ["ObjectOutput", "check_output", "COPY_BYTES", "REMOTE_COPY_BYTES"]

#: bytes read from a local input ``.bin`` per piece handed to the upload
COPY_BYTES = 8 << 20
#: bytes read from an input ``.bin`` at a URL per piece (eight 8 MiB requests in flight)
REMOTE_COPY_BYTES = 64 << 20


def check_output(prefix: str, *, overwrite: bool, storage_options: dict | None) -> dict:
    """Refuse an existing dataset at ``prefix`` unless ``overwrite``; returns what :class:`ObjectOutput`
    needs (the options, and whether an old ``.idx`` must be removed before the new ``.bin`` appears)."""
    import errno

    from mcf.remote._upload import object_exists

    found = [ext for ext in (".idx", ".bin") if object_exists(prefix + ext, storage_options=storage_options)]
    if found and not overwrite:
        names = " and ".join(prefix.rsplit("/", 1)[-1] + e for e in found)
        raise MCFIOError(errno.EEXIST, f"a dataset exists there already ({names}): pass overwrite=True (--overwrite "
                         "on the command line) to replace it", redact(prefix))
    return {"storage_options": storage_options, "old_idx": ".idx" in found}


class ObjectOutput:
    """The sink of :func:`mcf.megatron._merge.merge` (and of :class:`mcf.megatron.Writer`) for an object-store
    prefix: ``write_idx`` at offsets of the local ``.idx``, ``write_bin``/``copy_bin`` in order, ``publish``."""

    check = staticmethod(check_output)

    def __init__(self, prefix: str, checked: dict, *, idx_size: int | None = None, bin_size: int | None = None,
                 staging_dir: str | None = None):
        from mcf.remote._upload import ObjectUpload, part_size_for

        self.prefix = prefix
        self.idx_path = prefix + ".idx"
        self.bin_path = prefix + ".bin"
        self._opts = checked["storage_options"]
        self._old_idx = checked["old_idx"]
        self.bin_nbytes = 0
        try:
            self.idx_file = tempfile.TemporaryFile(dir=staging_dir, prefix=".mcf-megatron-idx-")
        except OSError as exc:
            raise os_error(exc, staging_dir or tempfile.gettempdir()) from None
        self._idx_size = idx_size
        try:
            self._upload = ObjectUpload(self.bin_path, storage_options=self._opts, part_size=part_size_for(bin_size))
        except BaseException:
            self.idx_file.close()
            raise

    def write_idx(self, offset: int, data) -> None:
        mv = memoryview(data).cast("B")
        try:
            while len(mv):
                k = os.pwrite(self.idx_file.fileno(), mv[:1 << 30], offset)
                mv = mv[k:]
                offset += k
        except OSError as exc:
            raise os_error(exc, f"the local .idx of {redact(self.prefix)} ({self.idx_file.name})") from None

    def write_bin(self, data) -> None:
        self._upload.write(data)
        self.bin_nbytes += len(memoryview(data).cast("B"))

    def copy_bin(self, src, nbytes: int, offset: int) -> None:
        """Append ``nbytes`` from the start of the Source ``src``; ``offset`` must be the bytes so far."""
        if offset != self.bin_nbytes:  # pragma: no cover - the merge appends in order
            raise AssertionError(f"out-of-order .bin write at {offset}, {self.bin_nbytes} written")
        done = 0
        step = COPY_BYTES if src.mode in ("mmap", "pread") else REMOTE_COPY_BYTES
        while done < nbytes:
            k = min(step, nbytes - done)
            self.write_bin(src.view(done, k))
            done += k

    def publish(self, bin_size: int) -> None:
        """Complete the ``.bin`` (after removing an old ``.idx``), then upload the ``.idx``."""
        from mcf.remote._upload import delete_object, put_file

        if bin_size != self.bin_nbytes:  # pragma: no cover - an internal invariant
            raise AssertionError(f".bin of {self.bin_nbytes} bytes written, {bin_size} expected")
        self.idx_file.flush()
        size = os.fstat(self.idx_file.fileno()).st_size
        if self._idx_size is not None and size != self._idx_size:  # pragma: no cover - an internal invariant
            raise AssertionError(f".idx of {size} bytes written, {self._idx_size} expected")
        if self._old_idx:
            delete_object(self.idx_path, storage_options=self._opts)
        self._upload.commit()
        put_file(self.idx_path, self.idx_file, storage_options=self._opts, size=size)
        self.idx_file.close()

    def abort(self) -> None:
        self._upload.abort()
        self.idx_file.close()
