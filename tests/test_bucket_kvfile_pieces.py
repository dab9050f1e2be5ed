"""write_kv converts and compresses a tensor at a time in bounded pieces: the bytes it
writes must not depend on how the pieces fall, nor on where a tensor is put together (memory or a
scratch file), nor on the number of threads."""

from __future__ import annotations

import io
import tempfile

import ml_dtypes
import numpy as np
import pytest

from mcf.bucket import Int8KV, open_kv, write_kv
from mcf.bucket import kvfile
from mcf.errors import InvalidArgumentError


def layers(order="C", dtype=np.float32):
    rng = np.random.default_rng(7)
    out = []
    for i in range(3):
        k = (rng.standard_normal((3, 37, 5)) * (i + 1)).astype(dtype)
        v = rng.standard_normal((3, 37, 5)).astype(dtype)
        out.append((np.asfortranarray(k), np.asfortranarray(v)) if order == "F" else (k, v))
    return out


def written(data, **kw) -> bytes:
    bio = io.BytesIO()
    write_kv(bio, data, **kw)
    return bio.getvalue()


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_pieces_write_the_bytes_of_a_whole_tensor(monkeypatch, compression, dtype, order):
    data = layers(order)
    whole = written(data, dtype=dtype, compression=compression)
    monkeypatch.setattr(kvfile, "_ENCODE_PIECE", 64)  # 3 rows of 5 float32 per piece
    assert written(data, dtype=dtype, compression=compression) == whole
    assert written(data, dtype=dtype, compression=compression, threads=2) == whole
    assert written(data, dtype=dtype, compression=compression, scratch=tempfile.TemporaryFile) == whole
    with open_kv(memoryview(whole)) as f:
        f.verify()
        got = f.load()
    if dtype == "float32":
        np.testing.assert_array_equal(got[2][0], data[2][0])


def test_pieces_of_other_input_dtypes(monkeypatch):
    """float64, bfloat16 and integer inputs (bf16 rounding from float64 is done once, from the exact value)."""
    for dt in (np.float64, ml_dtypes.bfloat16, np.int16):
        data = layers(dtype=dt)
        for stored in ("float16", "bfloat16", "int8"):
            monkeypatch.setattr(kvfile, "_ENCODE_PIECE", 1 << 30)
            whole = written(data, dtype=stored, compression="lz4")
            monkeypatch.setattr(kvfile, "_ENCODE_PIECE", 48)
            assert written(data, dtype=stored, compression="lz4") == whole, (dt, stored)


def test_int8kv_pairs_and_encryption(monkeypatch):
    data = [(Int8KV(np.ones((2, 4, 3), np.int8), np.full((2, 4), 0.5, np.float32)),) * 2]
    key = bytes(range(32))
    monkeypatch.setattr(kvfile, "_ENCODE_PIECE", 8)
    raw = written(data, dtype="int8", compression="lz4", key=key)
    with open_kv(memoryview(raw), key=key) as f:
        np.testing.assert_array_equal(f.load()[0][0], np.full((2, 4, 3), 0.5, np.float32))
    raw = written(layers(), dtype="float16", compression="none", key=key)
    with open_kv(memoryview(raw), key=key) as f:
        f.verify()


def test_a_nan_in_a_later_piece_still_refuses_int8(monkeypatch):
    data = layers()
    data[1][1][2, 30, 4] = np.nan
    monkeypatch.setattr(kvfile, "_ENCODE_PIECE", 64)
    with pytest.raises(InvalidArgumentError, match="finite"):
        written(data, dtype="int8", compression="lz4")


def test_crc32_combine_matches_zlib():
    import os
    import zlib

    for a, b in ((b"", b""), (b"abc", b""), (b"", b"xyz"), (os.urandom(100), os.urandom(70_001))):
        assert kvfile._crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
