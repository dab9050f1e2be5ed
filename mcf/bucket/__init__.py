"""Model Context Bucket: a persistent, checksummed store of pre-computed KV caches (seed 003).

:mod:`mcf.bucket.kvfile` reads and writes one context's ``kv_data.mcb``; :mod:`mcf.bucket.store` is the
bucket directory (registry, contexts, models) and its operations.  See docs/bucket.md.
"""

from mcf.bucket.kvfile import DEFAULT_MAX_DECOMPRESSED_BYTES, Int8KV, KVFile, KVHeader, open_kv, read_kv, write_kv
from mcf.bucket.store import Bucket, content_hash, context_id_for
from mcf.bucket.tiers import HotTierFullError, HotTierUnavailableError, WarmBudgetError
from mcf.errors import EncryptionKeyError, StaleContextError

__all__ = [
    "DEFAULT_MAX_DECOMPRESSED_BYTES",
    "Bucket",
    "EncryptionKeyError",
    "HotTierFullError",
    "HotTierUnavailableError",
    "WarmBudgetError",
    "Int8KV",
    "KVFile",
    "KVHeader",
    "StaleContextError",
    "content_hash",
    "context_id_for",
    "open_kv",
    "read_kv",
    "write_kv",
]
