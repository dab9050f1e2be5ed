"""Model Context Bucket: a persistent, checksummed store of pre-computed KV caches (seed 003).

:mod:`mcf.bucket.kvfile` reads and writes one context's ``kv_data.mcb``; see docs/bucket.md.
"""

from mcf.bucket.kvfile import (
    DEFAULT_MAX_DECOMPRESSED_BYTES,
    Int8KV,
    KVFile,
    KVHeader,
    open_kv,
    read_kv,
    write_kv,
)

__all__ = ["DEFAULT_MAX_DECOMPRESSED_BYTES", "Int8KV", "KVFile", "KVHeader", "open_kv", "read_kv", "write_kv"]
