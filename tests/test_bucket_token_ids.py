"""A context's token ids (contexts/<id>/token_ids.bin, what KV events announce): kept, checked against the
content hash, sealed in an encrypted bucket, never followed when planted."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mcf.bucket import Bucket
from mcf.errors import EncryptionKeyError, FormatError

pytest.importorskip("cryptography", reason="encryption needs the bucket extra's cryptography")


def layers(n: int):
    return [(np.ones((2, n, 8), np.float32), np.ones((2, n, 8), np.float32))]


def test_kept_and_read_back(tmp_path):
    with Bucket(tmp_path / "b") as b:
        toks = np.array([0, 1, 2**31, 2**40, -5, 2**63 - 1])
        cid = b.ingest("m", layers(6), token_ids=toks)["context_id"]
        got = b.token_ids(cid)
        assert got.dtype == np.int64 and got.tolist() == toks.tolist()
        with open(tmp_path / "b" / "contexts" / cid / "token_ids.bin", "rb") as f:
            assert f.read() == toks.astype("<i8").tobytes()
        assert b.token_ids(b.ingest("m", layers(6), content="text")["context_id"]) is None


def test_changed_token_ids_are_refused(tmp_path):
    with Bucket(tmp_path / "b") as b:
        cid = b.ingest("m", layers(4), token_ids=[1, 2, 3, 4])["context_id"]
        path = tmp_path / "b" / "contexts" / cid / "token_ids.bin"
        path.write_bytes(np.array([1, 2, 3, 5], "<i8").tobytes())
        with pytest.raises(FormatError, match="content hash"):
            b.token_ids(cid)
        path.write_bytes(b"\0" * 7)
        with pytest.raises(FormatError):
            b.token_ids(cid)


def test_a_planted_link_is_not_followed(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(np.arange(4, dtype="<i8").tobytes())
    with Bucket(tmp_path / "b") as b:
        cid = b.ingest("m", layers(4), token_ids=np.arange(4))["context_id"]
        path = tmp_path / "b" / "contexts" / cid / "token_ids.bin"
        path.unlink()
        os.symlink(secret, path)
        with pytest.raises(FormatError):
            b.token_ids(cid)


def test_sealed_in_an_encrypted_bucket(tmp_path):
    from mcf.bucket._crypto import generate_key

    key = generate_key()
    toks = np.arange(1000, 1040)
    with Bucket(tmp_path / "b", key=key) as b:
        cid = b.ingest("m", layers(40), token_ids=toks)["context_id"]
        assert b.token_ids(cid).tolist() == toks.tolist()
    raw = (tmp_path / "b" / "contexts" / cid / "token_ids.bin").read_bytes()
    assert toks.astype("<i8").tobytes() not in raw and len(raw) == 40 * 8 + 28
    with Bucket(tmp_path / "b") as b, pytest.raises(EncryptionKeyError):
        b.token_ids(cid)
    with Bucket(tmp_path / "b", key=generate_key()) as b, pytest.raises(EncryptionKeyError):
        b.token_ids(cid)
