"""The LZ4 block decoder that writes into caller-owned memory (csrc/lz4block.c), against the real
``lz4`` package: every block lz4 writes decodes to the same bytes, and no malformed block is read or
written past its buffers (the decoder either agrees with lz4's own decoder or refuses)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

lz4_block = pytest.importorskip("lz4.block", reason="the bucket extra (lz4)")

import mcf  # noqa: E402
from mcf.bucket._codec import lz4_block_decompress_into as decode_into  # noqa: E402


def decode(src: bytes, n: int) -> bytes:
    out = bytearray(n)
    assert decode_into(src, out) == n
    return bytes(out)


def reference(src: bytes, n: int) -> bytes | None:
    try:
        out = lz4_block.decompress(src, uncompressed_size=n)
    except lz4_block.LZ4BlockError:
        return None
    return out if len(out) == n else None


def payloads():
    # text-like, runs (offset-1 matches), periodic data (short offsets), noise, KV-like fp16
    return st.one_of(
        st.binary(max_size=5000),
        st.builds(lambda b, k: b * k, st.binary(min_size=1, max_size=7), st.integers(1, 3000)),
        st.builds(lambda s, n: np.random.default_rng(s).integers(0, 3, n, dtype=np.uint8).tobytes(),
                  st.integers(0, 2**32 - 1), st.integers(0, 70000)),
        st.builds(lambda s, n: np.random.default_rng(s).standard_normal(n).astype(np.float16).tobytes(),
                  st.integers(0, 2**32 - 1), st.integers(0, 20000)),
    )


@settings(max_examples=150, deadline=None)
@given(payloads(), st.sampled_from(["default", "fast", "hc"]))
def test_round_trip_against_lz4(data, mode):
    if mode == "hc":
        comp = lz4_block.compress(data, store_size=False, mode="high_compression", compression=9)
    elif mode == "fast":
        comp = lz4_block.compress(data, store_size=False, mode="fast", acceleration=8)
    else:
        comp = lz4_block.compress(data, store_size=False)
    assert decode(comp, len(data)) == data


def test_into_numpy_and_readonly_source():
    data = np.arange(100000, dtype=np.float32).tobytes()
    comp = memoryview(lz4_block.compress(data, store_size=False))  # read-only, as a mapped file is
    out = np.empty(len(data), np.uint8)
    decode_into(comp, out)
    assert out.tobytes() == data
    with pytest.raises((ValueError, TypeError, BufferError)):  # the destination must be writable
        decode_into(comp, memoryview(data))


def test_wrong_sizes_and_malformed_blocks():
    data = bytes(range(256)) * 40
    comp = lz4_block.compress(data, store_size=False)
    with pytest.raises(mcf.FormatError, match="more than"):
        decode_into(comp, bytearray(len(data) - 1))
    with pytest.raises(mcf.FormatError, match="fewer than"):
        decode_into(comp, bytearray(len(data) + 1))
    with pytest.raises(mcf.FormatError, match="malformed"):
        decode_into(b"", bytearray(0))
    # a match that points before the start of the output
    with pytest.raises(mcf.FormatError, match="malformed"):
        decode_into(bytes([0x10, ord("a"), 0x05, 0x00]), bytearray(10))
    # offset 0 is not a match
    with pytest.raises(mcf.FormatError, match="malformed"):
        decode_into(bytes([0x10, ord("a"), 0x00, 0x00]), bytearray(10))
    # a length continuation that runs off the end
    with pytest.raises(mcf.FormatError, match="malformed"):
        decode_into(bytes([0xF0, 255, 255]), bytearray(600))
    # an empty block (one zero token) decodes to nothing
    assert decode_into(b"\x00", bytearray(0)) == 0
    # every truncation of a real block is refused or (never) decoded wrongly
    for cut in range(len(comp)):
        try:
            got = decode(comp[:cut], len(data))
        except mcf.FormatError:
            continue
        assert got == data  # pragma: no cover - a shorter block cannot hold all of it


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 2000))
def test_random_blocks_agree_with_lz4_or_are_refused(src, n):
    """On arbitrary bytes: whenever lz4's own decoder produces n bytes, ours produces the same; when
    ours succeeds, lz4 (which may be stricter about the end of a block) agrees or refuses."""
    ref = reference(src, n)
    try:
        got = decode(src, n)
    except mcf.FormatError:
        assert ref is None
        return
    assert ref is None or ref == got


def test_mutated_real_blocks():
    rng = np.random.default_rng(zlib.crc32(b"lz4 mutations"))
    data = (np.sin(np.arange(20000) / 7) * 100).astype(np.int16).tobytes()
    comp = bytearray(lz4_block.compress(data, store_size=False))
    for _ in range(400):
        bad = bytearray(comp)
        for _ in range(int(rng.integers(1, 4))):
            bad[int(rng.integers(len(bad)))] = int(rng.integers(256))
        ref = reference(bytes(bad), len(data))
        try:
            got = decode(bytes(bad), len(data))
        except mcf.FormatError:
            assert ref is None
            continue
        assert ref is None or ref == got
