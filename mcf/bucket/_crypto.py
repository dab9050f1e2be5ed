"""Encryption at rest for ``kv_data.mcb``: AES-256-GCM per chunk, with the ``cryptography`` package.

Why per chunk: the file is already cut into independently decodable chunks (one per layer and K/V), so
a runtime that loads one layer or a token prefix decrypts only those chunks, on several threads.

Each encrypted chunk is stored as ``nonce (12 bytes) | ciphertext | tag (16 bytes)``; the nonce is
random per chunk and per write (never reused with a key), and the additional authenticated data is the
first 42 bytes of the file's header (magic .. compressed_size: shape, dtype, compression and sizes)
followed by the chunk's index as a u32, so a chunk cannot be moved to another position or another file
without failing authentication.  The header, the chunk table and the CRC-32s stay in clear: the CRC-32s
cover the stored (encrypted) bytes and still find accidental damage without the key; GCM's tag finds
tampering.  metadata.json (names, token counts, hashes) is not encrypted; it records the
:func:`key_id` of the key a context was encrypted with.

Keys are 32 random bytes.  A bucket takes one as ``Bucket(root, key=...)`` or from the environment
variable ``MCF_BUCKET_KEY`` (64 hex digits); :func:`generate_key` makes one.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct

from mcf._core.optional import require
from mcf.errors import ChecksumError, InvalidArgumentError

NONCE_SIZE = 12
TAG_SIZE = 16
OVERHEAD = NONCE_SIZE + TAG_SIZE
KEY_SIZE = 32
#: header bytes bound to every chunk (magic .. compressed_size; the CRC-32 is computed afterwards)
AAD_HEADER_BYTES = 42
ENV_KEY = "MCF_BUCKET_KEY"
#: what :func:`key_id` returns
KEY_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def _aesgcm():
    aead = require("cryptography.hazmat.primitives.ciphers.aead", feature="encrypted KV files", extra="bucket",
                   package="cryptography")
    return aead.AESGCM


def generate_key() -> bytes:
    """32 random bytes for AES-256-GCM (store them as you store any secret; ``key.hex()`` for the
    environment variable)."""
    return os.urandom(KEY_SIZE)


def parse_key(key) -> bytes | None:
    """``key`` as 32 bytes: bytes-like, or a str of 64 hex digits; None stays None."""
    if key is None:
        return None
    if isinstance(key, str):
        try:
            key = bytes.fromhex(key.strip())
        except ValueError:
            raise InvalidArgumentError("an encryption key given as text must be 64 hex digits") from None
    try:
        key = bytes(key)
    except TypeError:
        raise InvalidArgumentError(f"an encryption key must be 32 bytes or 64 hex digits, got {type(key).__name__}") \
            from None
    if len(key) != KEY_SIZE:
        raise InvalidArgumentError(f"an encryption key must be {KEY_SIZE} bytes (AES-256), got {len(key)}")
    return key


def key_id(key: bytes) -> str:
    """A public name of ``key``: 32 hex digits of a domain-separated SHA-256 of it, recorded with each
    context encrypted under it, so a bucket tells which key a context needs without trying to decrypt
    (the key cannot be recovered from it: a preimage of SHA-256)."""
    return hashlib.sha256(b"mcf-bucket-key-id\0" + parse_key(key)).hexdigest()[:32]


def key_from_env() -> bytes | None:
    v = os.environ.get(ENV_KEY)
    return parse_key(v) if v else None


def _aad(header42: bytes, index: int) -> bytes:
    return bytes(header42[:AAD_HEADER_BYTES]) + struct.pack("<I", index)


class ChunkCipher:
    """Encrypts and decrypts the chunks of one file (one key, one header)."""

    def __init__(self, key: bytes, header42: bytes):
        self._aes = _aesgcm()(parse_key(key))
        self._h = bytes(header42[:AAD_HEADER_BYTES])

    def encrypt(self, index: int, plain: bytes) -> bytes:
        nonce = os.urandom(NONCE_SIZE)
        return nonce + self._aes.encrypt(nonce, bytes(plain), _aad(self._h, index))

    def decrypt(self, index: int, stored, *, path=None, offset=None) -> bytes:
        from cryptography.exceptions import InvalidTag

        stored = memoryview(stored)
        if len(stored) < OVERHEAD:
            raise ChecksumError("encrypted chunk shorter than its nonce and tag", path=path, field=f"chunk[{index}]",
                                offset=offset, expected=f">= {OVERHEAD} bytes", got=len(stored))
        try:
            return self._aes.decrypt(bytes(stored[:NONCE_SIZE]), bytes(stored[NONCE_SIZE:]), _aad(self._h, index))
        except InvalidTag:
            raise ChecksumError("encrypted chunk failed authentication (wrong key, or the chunk or header was "
                                "changed)", path=path, field=f"chunk[{index}]", offset=offset) from None


def seal(key: bytes, plain: bytes, aad: bytes) -> bytes:
    """``nonce | ciphertext | tag`` of a small side file (a context's token ids), bound to ``aad``."""
    nonce = os.urandom(NONCE_SIZE)
    return nonce + _aesgcm()(parse_key(key)).encrypt(nonce, bytes(plain), aad)


def unseal(key: bytes, stored: bytes, aad: bytes, *, path=None) -> bytes:
    """What :func:`seal` sealed; ChecksumError when it fails authentication (another key, or changed)."""
    from cryptography.exceptions import InvalidTag

    if len(stored) < OVERHEAD:
        raise ChecksumError("encrypted file shorter than its nonce and tag", path=path,
                            expected=f">= {OVERHEAD} bytes", got=len(stored))
    try:
        return _aesgcm()(parse_key(key)).decrypt(stored[:NONCE_SIZE], stored[NONCE_SIZE:], aad)
    except InvalidTag:
        raise ChecksumError("encrypted file failed authentication (wrong key, or the file was changed)",
                            path=path) from None
