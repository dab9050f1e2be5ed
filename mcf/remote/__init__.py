"""Remote files: object stores (``s3://``, ``gs://``, ``az://``, ``abfs://``), HTTP(S) and any other fsspec URL
(``memory://``, ``file://``, ``hf://``...), read with concurrent, checked, retried ranged GETs straight
into the caller's buffers, as a file-like object the I/O core reads like any other.

:func:`mcf.io.open_source` turns a URL string into a ``fileobj`` :class:`mcf.io.Source` over a
:class:`RemoteFile`, so every reader that opens its input with ``open_source`` (MCF, safetensors, GGUF,
Megatron ``.idx``/``.bin``, MegaContext ``.ctx``, MCB ``kv_data.mcb``) reads URLs without knowing it.
The source's ``read_ranges``/``read_into`` hand a whole load plan to :meth:`RemoteFile.readinto_ranges`:

- **the plan** (``_plan``): ranges less than ``coalesce`` bytes apart share a request, runs are cut into
  even parts of at most ``request_size`` bytes, and each part lands in the pieces of the destination
  buffers it covers, so a checkpoint loads with ``concurrency`` requests in flight across its tensors
  and never holds more than ``concurrency * request_size`` bytes of answers (no second copy of the file);
- **the checks** (``_fetch``, ``_http``): every answer must be exactly the bytes asked for (HTTP: status 206
  and the right ``Content-Range`` too), read in place and never past its range, of the version seen at
  opening (``If-Match`` its ETag, and every answer's ETag, Last-Modified and size compared), within
  ``timeout + bytes / min_rate`` seconds; a transient failure (reset, timeout, 5xx, 408, 429, a short body)
  is retried with exponential backoff and jitter, at most ``retries`` times; a final one (404, 403, a
  server ignoring ``Range``, no attempt left) is an :class:`mcf.MCFError` naming the URL, the range and
  the file size, never a credential;
- **the clients**: mcf's own (``_http``, on ``http.client``) for every http(s) URL and for S3 through URLs
  it signs itself (``_sigv4``), following redirects without credentials to another origin; obstore
  (Rust's object_store) for GCS, Azure and S3 with role credentials (``_obstore``, ``_stores``); fsspec
  for every other scheme (``_fsspec``).  ``backend=`` picks one ("http", "obstore", "fsspec");
- **the configuration** (``_stores``): what the AWS tools read (``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
  ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, ``AWS_PROFILE`` and the shared files), or explicit
  ``storage_options`` given to :func:`open_remote`/:class:`RemoteFile`, or set for a block of code with
  :func:`storage_options` (which reaches readers that open several URLs themselves).

Small reads (a header, an index, a short sequence) go through an LRU cache of aligned blocks
(``block_size``, 1 MiB; ``cache_size``, 64 MiB), so parsing a file costs a request or two, not one per
field.  The file size must be known up front (``HEAD``/``Content-Length``): every bounds check of the
readers depends on it.  Remote files are read-only: every writer refuses a URL (:func:`refuse_url`), except
the Megatron writers, which write datasets to object stores through :mod:`mcf.remote._upload` (a multipart
upload that appears whole on completion, or not at all).
"""

from __future__ import annotations

from mcf.remote._urls import is_url, redact, refuse_url

__all__ = ["RemoteFile", "is_url", "open_remote", "refuse_url", "redact", "storage_options", "url_to_fs",
           "BACKENDS", "DEFAULT_BLOCK_SIZE", "DEFAULT_CACHE_SIZE", "DEFAULT_REQUEST_SIZE", "DEFAULT_CONCURRENCY",
           "DEFAULT_COALESCE", "DEFAULT_RETRIES", "DEFAULT_RETRY_DELAY", "DEFAULT_TIMEOUT", "DEFAULT_MIN_RATE"]

# The remote file and its settings load on first use (PEP 562): a reader that only asks whether a path is a
# URL, or redacts one, does not import the fetcher, the stores and their thread pools.
_LAZY = {"RemoteFile": "mcf.remote.file", "BACKENDS": "mcf.remote.file", "storage_options": "mcf.remote._stores",
         **{n: "mcf.remote.file" for n in __all__ if n.startswith("DEFAULT_")}}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def url_to_fs(url, storage_options):
    """fsspec's file system and path for ``url`` (``storage_options`` go to the file system).  A function
    here, so that ``import mcf`` does not import the HTTP clients."""
    from mcf.remote._fsspec import url_to_fs as to_fs

    return to_fs(url, storage_options)


def open_remote(url, **options):
    """A :class:`mcf.io.Source` over ``url``; ``options`` are :class:`RemoteFile`'s (``storage_options``,
    ``request_size``, ``concurrency``, ``retries``, ``timeout``...).  Hand the source to any reader."""
    from mcf._core._io import Source
    from mcf.remote.file import RemoteFile

    return Source.from_fileobj(RemoteFile(url, **options), owns=True)
