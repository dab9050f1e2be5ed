"""The committed golden kv_data.mcb files (tests/fixtures/bucket_golden.py) decode to the values they
were written from, their headers read as FORMATS.md §4 says, and the writer reproduces the
uncompressed ones byte for byte."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from _vectors import load_fixture
from mcf.bucket import open_kv, write_kv

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

FIX = Path(__file__).parent / "fixtures"
golden = load_fixture("bucket_golden.py")

CASES = [(dt, st) for dt in golden.DTYPES for st in golden.STORAGES]


@pytest.mark.parametrize("dtype,storage", CASES)
def test_golden_decodes(dtype, storage):
    path = FIX / "bucket" / golden.name(dtype, storage)
    raw = path.read_bytes()
    magic, ver, flags, nl, nh, hd, seq, dt, comp, orig, csize, crc, res = struct.unpack("<4sHHIIIIBBQQI18s", raw[:64])
    assert (magic, ver, nl, nh, seq, hd) == (b"MCB\0", 1, 2, 2, 5, 3)
    assert dt == golden.DTYPES.index(dtype)
    assert comp == {"none": 0, "lz4": 1, "zstd": 2}[golden.STORAGES[storage][0]]
    assert flags == int(golden.STORAGES[storage][1]) and crc == zlib.crc32(raw[64:]) and csize == len(raw) - 64
    with open_kv(path) as f:
        out = f.load()
    np_dt = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "int8": np.float32}[dtype]
    for i, (k, v) in enumerate(out):
        for got, kv in ((k, 0), (v, 1)):
            want = golden.values(i, kv)
            if dtype == "int8":  # per-row scale max|row|/127: within half a step
                step = np.abs(want).max(axis=-1, keepdims=True) / 127
                assert got.dtype == np.float32 and (np.abs(got - want) <= step / 2 + 1e-6).all()
            else:
                assert got.dtype == np_dt
                np.testing.assert_array_equal(got.astype(np.float32), want)


@pytest.mark.parametrize("dtype", golden.DTYPES)
def test_writer_reproduces_uncompressed(dtype):
    bio = io.BytesIO()
    write_kv(bio, golden.layers(), dtype=dtype, compression="none")
    assert bio.getvalue() == (FIX / "bucket" / golden.name(dtype, "none")).read_bytes()
