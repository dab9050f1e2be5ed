"""Writing objects to an object store (``s3://``, ``gs://``, ``az://``): a stream of bytes that appears as one
object only when it is complete, and never when it is abandoned.

:class:`ObjectUpload` takes ``write`` calls from its owner and hands the bytes to obstore's ``put`` (Rust's
object_store), which runs in a thread of its own and uploads them as a multipart upload, ``part_size`` bytes
per part and ``concurrency`` parts in flight.  :meth:`ObjectUpload.commit` ends the stream: the store
completes the upload and the object appears, whole, at once (an S3 ``CompleteMultipartUpload``; GCS and
Azure the same).  :meth:`ObjectUpload.abort`, or any failure, ends it with an error instead: object_store
then aborts the multipart upload and no object appears (a store that keeps the parts of an upload nobody
completed, because the process died, drops them after the bucket's lifecycle rule for incomplete multipart
uploads: set one).  Memory is bounded: at most ``QUEUED`` pieces of about ``part_size`` bytes wait for the
uploader, and ``concurrency`` parts are in flight.

The stores are the readers' (:func:`mcf.remote._stores.object_store`: one per bucket, configured the way the
AWS, Google and Azure tools configure theirs, with ``storage_options`` or :func:`mcf.remote.storage_options`),
with obstore's own retries for the writes (a part's PUT is retried on a 5xx, a reset or a timeout).  Every
failure is an :class:`mcf.MCFError` naming the URL redacted (:func:`mcf.remote.redact`): a missing bucket a
:class:`mcf.MissingFileError`, refused or absent credentials an :class:`mcf.AccessError`, the rest an
:class:`mcf.MCFIOError`.  obstore needs Python 3.11 or later (the ``remote`` extra); writing has no fallback.
"""

from __future__ import annotations

import errno
import queue
import re
import threading

from mcf._core.args import integer
from mcf._core.optional import require
from mcf.errors import AccessError, InvalidArgumentError, MCFError, MCFIOError, MissingFileError
from mcf.remote._stores import default_options, object_store
from mcf.remote._urls import redact, redact_text, target

__all__ = ["ObjectUpload", "object_exists", "delete_object", "put_file", "DEFAULT_PART_SIZE",
           "DEFAULT_UPLOAD_CONCURRENCY", "MAX_PARTS", "part_size_for", "write_error"]

#: bytes per part of a multipart upload (S3 takes 5 MiB to 5 GiB, at most ``MAX_PARTS`` parts)
DEFAULT_PART_SIZE = 32 << 20
#: parts uploaded at once
DEFAULT_UPLOAD_CONCURRENCY = 8
#: S3's limit of parts in one multipart upload (GCS's XML API and Azure's blocks allow as many or more)
MAX_PARTS = 10_000
#: pieces handed over by ``write`` that may wait for the uploader
QUEUED = 2
#: retries of a part's request, by obstore (a write is never retried by mcf itself)
WRITE_RETRIES = 5
_WRITE_TIMEOUT = 60.0

_END = object()
_ABORT = object()


def part_size_for(total: int | None) -> int:
    """The part size for an object of ``total`` bytes (None: unknown): :data:`DEFAULT_PART_SIZE`, or larger
    (whole MiB) so that the object fits in :data:`MAX_PARTS` parts with room to spare."""
    if total is None:
        return DEFAULT_PART_SIZE
    need = -(-int(total) // (MAX_PARTS * 9 // 10))
    return max(DEFAULT_PART_SIZE, -(-need // (1 << 20)) << 20)


def _store(url: str, storage_options):
    tgt = target(url)
    if tgt.kind not in ("s3", "gcs", "azure"):
        raise InvalidArgumentError(f"{redact(url)}: writing is not supported on {url.split('://', 1)[0]}:// remote "
                                   "URLs (they are read-only); mcf writes to object stores: s3://, gs://, az://")
    require("obstore", feature=f"writing {url.split('://', 1)[0]}:// URLs", extra="remote")
    opts = default_options(url) if storage_options is None else dict(storage_options)
    return object_store(tgt.kind, tgt.root, opts, timeout=_WRITE_TIMEOUT, retries=WRITE_RETRIES), tgt.key


def _line(exc) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return redact_text(re.sub(r"^(Generic \w+ error: )+", "", line))


def write_error(exc: BaseException, url: str, what: str) -> BaseException:
    """An :class:`mcf.MCFError` for an exception of obstore met while ``what`` (e.g. "uploading the object")
    at ``url``; an MCFError, a KeyboardInterrupt or another non-Exception is returned as it is."""
    if isinstance(exc, MCFError) or not isinstance(exc, Exception):
        return exc
    shown = redact(url)
    try:
        from obstore.exceptions import (AlreadyExistsError, NotFoundError, PermissionDeniedError,
                                        UnauthenticatedError)
    except ImportError:  # pragma: no cover - obstore raised it, so it is there
        return MCFIOError(errno.EIO, f"failed {what}: {_line(exc)}", shown)
    text = str(exc)
    if isinstance(exc, (NotFoundError, FileNotFoundError)):
        return MissingFileError(errno.ENOENT, "no such bucket" if "NoSuchBucket" in text else
                                f"not found while {what}: {_line(exc)}", shown)
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or re.search(
            r"\b(403|401)\b|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch", text):
        return AccessError(errno.EACCES, f"access denied while {what} (check the credentials, and that they may "
                           f"read and write there): {_line(exc)}", shown)
    if re.search(r"latest/api/token|credential", text, re.IGNORECASE):
        return AccessError(errno.EACCES, f"no credentials were found while {what} (none in storage_options, in "
                           "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile, and no role the client could "
                           f"reach): {_line(exc)}", shown)
    if isinstance(exc, AlreadyExistsError):
        return MCFIOError(errno.EEXIST, f"the object exists (while {what})", shown)
    return MCFIOError(errno.EIO, f"failed {what}: {_line(exc)}", shown)


def object_exists(url: str, *, storage_options: dict | None = None) -> bool:
    """True when the object ``url`` exists (a HEAD request)."""
    store, key = _store(url, storage_options)   # first: a missing obstore is a MissingDependencyError
    import obstore

    try:
        obstore.head(store, key)
    except FileNotFoundError:
        return False
    except BaseException as exc:  # noqa: BLE001 - sorted into MCFErrors
        err = write_error(exc, url, "looking for an existing object")
        if isinstance(err, MissingFileError) and "no such bucket" not in str(err):
            return False
        raise err from None
    return True


def delete_object(url: str, *, storage_options: dict | None = None) -> None:
    """Remove the object ``url`` (nothing happens when there is none)."""
    store, key = _store(url, storage_options)
    import obstore

    try:
        obstore.delete(store, key)
    except FileNotFoundError:
        return
    except BaseException as exc:  # noqa: BLE001 - sorted into MCFErrors
        raise write_error(exc, url, "deleting the object") from None


def put_file(url: str, fileobj, *, storage_options: dict | None = None, size: int | None = None) -> None:
    """Upload the binary file ``fileobj`` from its start as the object ``url`` (whole, atomically)."""
    store, key = _store(url, storage_options)
    import obstore

    fileobj.seek(0)
    try:
        obstore.put(store, key, fileobj, chunk_size=part_size_for(size), max_concurrency=DEFAULT_UPLOAD_CONCURRENCY)
    except BaseException as exc:  # noqa: BLE001 - sorted into MCFErrors
        raise write_error(exc, url, "uploading the object") from None


class ObjectUpload:
    """One object written as a stream (see the module docstring): ``write`` the bytes in order, then
    ``commit`` (the object appears whole) or ``abort`` (nothing appears).  Not thread-safe: one writer."""

    def __init__(self, url: str, *, storage_options: dict | None = None, part_size: int = DEFAULT_PART_SIZE,
                 concurrency: int = DEFAULT_UPLOAD_CONCURRENCY):
        self.url = url
        self.name = redact(url)
        self.part_size = integer(part_size, "part_size", minimum=5 << 20)
        self.concurrency = integer(concurrency, "concurrency", minimum=1)
        store, key = _store(url, storage_options)
        import obstore

        self.nbytes = 0
        self._buf = bytearray()
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUED)
        self._error: BaseException | None = None
        self._done = False
        self._aborting = False

        def run():
            try:
                obstore.put(store, key, self._pieces(), chunk_size=self.part_size,
                            max_concurrency=self.concurrency)
            except BaseException as exc:  # noqa: BLE001 - handed to the writing thread
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"mcf-upload {self.name}", daemon=True)
        self._thread.start()

    def _pieces(self):
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if item is _ABORT:
                raise MCFIOError(errno.ECANCELED, "upload abandoned", self.name)
            yield item

    def _hand(self, item) -> None:
        """Queue ``item`` for the uploader; raise its error if it stopped."""
        while True:
            if self._error is not None or not self._thread.is_alive():
                self._raise()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _raise(self):
        self._done = True
        exc = self._error or MCFIOError(errno.EIO, "the upload stopped", self.name)
        raise write_error(exc, self.url, "uploading the object") from None

    def write(self, data) -> None:
        """Append ``data`` (any bytes-like object; copied before this returns)."""
        if self._done:
            raise MCFIOError(errno.EINVAL, "the upload is finished", self.name)
        mv = memoryview(data).cast("B")
        self.nbytes += len(mv)
        if len(self._buf) + len(mv) < self.part_size:
            self._buf += mv
            return
        if self._buf:
            self._buf += mv
            piece, self._buf = self._buf, bytearray()
        else:
            piece = bytes(mv)
        self._hand(piece)

    def commit(self) -> None:
        """Hand over what is buffered and complete the upload: the object appears whole.  Raises the
        upload's error (and nothing appears) when it failed."""
        if self._done:
            raise MCFIOError(errno.EINVAL, "the upload is finished", self.name)
        if self._buf:
            piece, self._buf = self._buf, bytearray()
            self._hand(piece)
        self._hand(_END)
        self._thread.join()
        self._done = True
        if self._error is not None:
            self._raise()

    def abort(self) -> None:
        """Abandon the upload: nothing appears at the URL.  Safe to call twice and after a failure."""
        if self._done and not self._thread.is_alive():
            return
        self._done = True
        self._buf = bytearray()
        while self._thread.is_alive():
            try:                      # make room, then tell the uploader to fail
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            try:
                self._queue.put(_ABORT, timeout=0.1)
                break
            except queue.Full:
                continue
        self._thread.join()

    def __del__(self):
        # a writer dropped without commit or abort: the uploader must not wait forever (and must not commit)
        if not self._done and getattr(self, "_thread", None) is not None and self._thread.is_alive():
            self.abort()

    def __repr__(self) -> str:
        return f"<mcf ObjectUpload {self.name!r} {self.nbytes} bytes>"

