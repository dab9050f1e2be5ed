"""Encryption at rest of MCB KV files (AES-256-GCM per chunk) and of the contexts a keyed Bucket stores."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest

pytest.importorskip("cryptography", reason="encryption needs the cryptography package (bucket/test extras)")
from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

import mcf  # noqa: E402
from mcf.bucket import Bucket, open_kv, write_kv  # noqa: E402
from mcf.bucket import _layout as L  # noqa: E402
from mcf.bucket._crypto import ENV_KEY, NONCE_SIZE, generate_key  # noqa: E402

KEY = bytes(range(32))


def _layers(seed="enc", n=3, heads=2, tokens=16, dim=8):
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    return [(rng.standard_normal((heads, tokens, dim)).astype(np.float32),
             rng.standard_normal((heads, tokens, dim)).astype(np.float32)) for _ in range(n)]


def _write(layers, **kw) -> bytes:
    b = io.BytesIO()
    write_kv(b, layers, **kw)
    return b.getvalue()


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_encrypted_round_trip_equals_the_plain_file(compression, dtype):
    layers = _layers()
    enc = _write(layers, dtype=dtype, compression=compression, key=KEY)
    plain = _write(layers, dtype=dtype, compression=compression)
    with open_kv(memoryview(enc), key=KEY) as f, open_kv(memoryview(plain)) as g:
        assert f.header.encrypted and f.header.chunked and not g.header.encrypted
        want, got = g.load(), f.load()
        for (k0, v0), (k1, v1) in zip(want, got):
            assert np.array_equal(np.asarray(k0), np.asarray(k1)) and np.array_equal(np.asarray(v0), np.asarray(v1))
        part = f.load(layers=[2], tokens=5)            # one layer, a token prefix: only its chunks decrypt
        assert np.array_equal(np.asarray(part[0][1]), np.asarray(want[2][1])[:, :5])
        f.verify()                                     # the CRC-32 covers the stored (encrypted) bytes


def test_chunks_are_aes_gcm_with_the_documented_nonce_and_associated_data():
    """An independent decryption with the cryptography package, following docs/bucket.md's layout:
    nonce | ciphertext | tag per chunk, AAD = header[0:42] + u32 chunk index."""
    layers = _layers(n=2)
    enc = _write(layers, dtype="float32", compression="none", key=KEY)
    n = L.chunk_count(L.KVShape(2, 2, 8, 16))
    for i in range(n):
        off, size, crc, _ = L.CHUNK_ENTRY.unpack_from(enc, L.HEADER_SIZE + i * L.CHUNK_ENTRY.size)
        stored = enc[off:off + size]
        assert zlib.crc32(stored) == crc
        plain = AESGCM(KEY).decrypt(stored[:NONCE_SIZE], stored[NONCE_SIZE:], enc[:42] + struct.pack("<I", i))
        layer, kv = divmod(i, 2)
        assert plain == layers[layer][kv].astype("<f4").tobytes()
    # a fresh nonce per write: the same data never encrypts to the same bytes
    assert _write(layers, dtype="float32", key=KEY)[L.HEADER_SIZE:] != enc[L.HEADER_SIZE:]


def test_no_key_wrong_key_and_tampering_are_clear_errors():
    enc = bytearray(_write(_layers(), dtype="float16", compression="lz4", key=KEY))
    with open_kv(memoryview(bytes(enc))) as f:              # header and table open without the key
        assert f.header.encrypted
        with pytest.raises(mcf.InvalidArgumentError, match="encrypted; pass key="):
            f.load()
    with open_kv(memoryview(bytes(enc)), key=generate_key()) as f, \
            pytest.raises(mcf.ChecksumError, match="failed authentication"):
        f.load(verify=False)
    # a byte of a chunk changed and its CRC fixed up (a deliberate change, not an accident): the tag fails
    off, size, _, _ = L.CHUNK_ENTRY.unpack_from(enc, L.HEADER_SIZE)
    enc[off + NONCE_SIZE + 3] ^= 0x40
    with open_kv(memoryview(bytes(enc)), key=KEY) as f, pytest.raises(mcf.ChecksumError, match="authentication"):
        f.load(layers=[0], verify=False)
    # two chunks swapped in place (same size): authenticated with their index, so refused
    enc = bytearray(_write(_layers(), dtype="float32", compression="none", key=KEY))
    (o0, s0, c0, _), (o1, s1, c1, _) = (L.CHUNK_ENTRY.unpack_from(enc, L.HEADER_SIZE + i * L.CHUNK_ENTRY.size)
                                        for i in (0, 1))
    a, b = bytes(enc[o0:o0 + s0]), bytes(enc[o1:o1 + s1])
    enc[o0:o0 + s0], enc[o1:o1 + s1] = b, a
    with open_kv(memoryview(bytes(enc)), key=KEY) as f, pytest.raises(mcf.ChecksumError, match="authentication"):
        f.load(layers=[0], verify=False)


def test_bad_keys_and_flags_are_refused():
    for bad in (b"short", "zz" * 32, 123):
        with pytest.raises(mcf.InvalidArgumentError, match="key"):
            write_kv(io.BytesIO(), _layers(), key=bad)
    with pytest.raises(mcf.InvalidArgumentError, match="always chunked"):
        write_kv(io.BytesIO(), _layers(), key=KEY, chunked=False)
    enc = bytearray(_write(_layers(), compression="lz4", key=KEY))
    struct.pack_into("<H", enc, 6, int(L.Flags.ENCRYPTED))   # ENCRYPTED without CHUNKED
    with pytest.raises(mcf.FormatError, match="ENCRYPTED flag without CHUNKED"):
        open_kv(memoryview(bytes(enc)))


def test_bucket_with_a_key_encrypts_what_it_ingests(tmp_path, monkeypatch):
    layers = _layers("bucket")
    b = Bucket(tmp_path, key=KEY.hex())
    meta = b.ingest("m", layers, token_ids=list(range(16)), compression="lz4")
    assert meta["kv_cache"]["encrypted"] is True
    raw = (tmp_path / "contexts" / meta["context_id"] / "kv_data.mcb").read_bytes()
    assert layers[0][0].astype(np.float16).tobytes()[:64] not in raw
    got = Bucket(tmp_path, key=KEY).load(meta["context_id"])
    assert np.array_equal(got[1][0], layers[1][0].astype(np.float16))
    monkeypatch.delenv(ENV_KEY, raising=False)
    nokey = Bucket(tmp_path)
    assert [c["context_id"] for c in nokey.discover("m")] == [meta["context_id"]]   # listed, not readable
    with pytest.raises(mcf.InvalidArgumentError, match="encrypted"):
        nokey.load(meta["context_id"])
    monkeypatch.setenv(ENV_KEY, KEY.hex())                    # the server's way to get the key
    assert np.array_equal(Bucket(tmp_path).load(meta["context_id"])[2][1], layers[2][1].astype(np.float16))
