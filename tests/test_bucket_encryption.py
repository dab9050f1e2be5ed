"""Encryption at rest of MCB KV files (AES-256-GCM per chunk) and of the contexts a keyed Bucket stores."""

from __future__ import annotations

import io
import json
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


# ------------------------------------------------------------------------------------------------
# deduplication and keys
# ------------------------------------------------------------------------------------------------
KEY2 = bytes(range(100, 132))


def _header_flags(root, cid) -> int:
    raw = (root / "contexts" / cid / "kv_data.mcb").read_bytes()[:8]
    return struct.unpack_from("<H", raw, 6)[0]


def test_a_keyed_bucket_stores_encrypted_what_was_stored_in_clear(tmp_path, monkeypatch):
    """Deduplicating would have left the data in clear on disk while the keyed bucket answered as if it
    were stored as it stores everything: the encrypted data takes its place instead."""
    monkeypatch.delenv(ENV_KEY, raising=False)
    layers = _layers("dedup")
    clear = Bucket(tmp_path).ingest("m", layers, content="doc", compression="lz4")
    assert not _header_flags(tmp_path, clear["context_id"]) & L.Flags.ENCRYPTED
    keyed = Bucket(tmp_path, key=KEY)
    meta = keyed.ingest("m", layers, content="doc", compression="lz4")
    assert meta["context_id"] == clear["context_id"] and not meta.get("deduplicated")
    assert meta["kv_cache"]["encrypted"] is True and _header_flags(tmp_path, meta["context_id"]) & L.Flags.ENCRYPTED
    assert layers[0][0].astype(np.float16).tobytes()[:64] not in (
        tmp_path / "contexts" / meta["context_id"] / "kv_data.mcb").read_bytes()
    assert np.array_equal(keyed.load(meta["context_id"])[2][1], layers[2][1].astype(np.float16))
    assert keyed.ingest("m", layers, content="doc")["deduplicated"]  # now under its key: the same context
    assert [c["context_id"] for c in Bucket(tmp_path).discover("m")] == [meta["context_id"]]


def test_content_encrypted_under_another_key_is_neither_reused_nor_overwritten(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_KEY, raising=False)
    layers = _layers("k1")
    first = Bucket(tmp_path, key=KEY)
    cid = first.ingest("m", layers, content="doc")["context_id"]
    before = (tmp_path / "contexts" / cid / "kv_data.mcb").read_bytes()
    for other, why in ((Bucket(tmp_path, key=KEY2), "under another key"), (Bucket(tmp_path), "has no key")):
        with pytest.raises(mcf.EncryptionKeyError, match=why):
            other.ingest("m", _layers("other values"), content="doc")
        with pytest.raises(mcf.EncryptionKeyError):
            other.load(cid)
        with pytest.raises(mcf.EncryptionKeyError):
            other.promote(cid)
        assert other.tier(cid) == "cold"
    assert (tmp_path / "contexts" / cid / "kv_data.mcb").read_bytes() == before
    assert np.array_equal(first.load(cid)[0][0], layers[0][0].astype(np.float16))
    assert first.ingest("m", layers, content="doc")["deduplicated"]
    # a context written before key ids were recorded: its first layer is tried with the key
    meta_path = tmp_path / "contexts" / cid / "metadata.json"
    doc = json.loads(meta_path.read_text())
    del doc["kv_cache"]["key_id"]
    meta_path.write_text(json.dumps(doc))
    with pytest.raises(mcf.EncryptionKeyError, match="under another key"):
        Bucket(tmp_path, key=KEY2).ingest("m", layers, content="doc")
    assert Bucket(tmp_path, key=KEY).ingest("m", layers, content="doc")["deduplicated"]
    doc["kv_cache"]["key_id"] = "not hex"
    meta_path.write_text(json.dumps(doc))
    with pytest.raises(mcf.FormatError, match="kv_cache.key_id"):
        first.lookup(cid)


def test_prefix_lookup_passes_over_contexts_under_another_key(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_KEY, raising=False)
    ids = list(range(16))
    Bucket(tmp_path, key=KEY, prefix_chunk_tokens=4).ingest("m", _layers("p"), token_ids=ids)
    assert Bucket(tmp_path, key=KEY, prefix_chunk_tokens=4).lookup_prefix("m", ids)["tokens"] == 16
    assert Bucket(tmp_path, key=KEY2, prefix_chunk_tokens=4).lookup_prefix("m", ids) is None


def test_rest_ingests_of_content_stored_under_other_keys(tmp_path):
    """Over HTTP, servers started on one bucket with no key, key 1 and key 2: content first stored in
    clear is stored encrypted by the keyed server (201, not "deduplicated"), and content stored under
    key 1 is a 409 for the server with key 2 and the one without a key, on ingest and on use."""
    from _bucket_server import request, serve

    pytest.importorskip("starlette", reason="the server needs the 'server' extra (starlette)")
    pytest.importorskip("uvicorn", reason="the server needs the 'server' extra (uvicorn)")
    bio = io.BytesIO()
    k = np.random.default_rng(0).standard_normal((2, 2, 8, 4)).astype(np.float32)
    np.savez(bio, k=k, v=-k)
    upload = (bio.getvalue(), {"Content-Type": "application/octet-stream"})
    root = tmp_path / "b"
    keys = {"none": {ENV_KEY: ""}, "k1": {ENV_KEY: KEY.hex()}, "k2": {ENV_KEY: KEY2.hex()}}

    def ingest(base, content):
        return request(base, "POST", f"/mcrp/v1/contexts?model_id=m&content={content}&dtype=float32", *upload)

    with serve(root, None, env=keys["none"]) as (base, _):
        st, out, _ = ingest(base, "clear")
        assert st == 201 and not out["deduplicated"], out
        clear_id = out["context_id"]
    with serve(root, None, env=keys["k1"]) as (base, _):
        st, out, _ = ingest(base, "clear")
        assert st == 201 and not out["deduplicated"] and out["context_id"] == clear_id, out
        assert _header_flags(root, clear_id) & L.Flags.ENCRYPTED
        assert ingest(base, "clear")[1]["deduplicated"]
        st, out, _ = ingest(base, "secret")
        assert st == 201, out
        secret_id = out["context_id"]
    stored = (root / "contexts" / secret_id / "kv_data.mcb").read_bytes()
    for name in ("k2", "none"):
        with serve(root, None, env=keys[name]) as (base, _):
            st, out, _ = ingest(base, "secret")
            assert st == 409 and "encrypted" in out["error"], (name, st, out)
            st, out, _ = request(base, "POST", f"/mcrp/v1/contexts/{secret_id}/promote", b"{}",
                                 {"Content-Type": "application/json"})
            assert st == 409 and "key" in out["error"], (name, st, out)
    assert (root / "contexts" / secret_id / "kv_data.mcb").read_bytes() == stored
