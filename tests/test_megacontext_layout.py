"""The .ctx byte layout: both header layouts, the magic in both byte orders, seed 000's worked
examples, span arithmetic, and every header field a bad file can break."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mcf
from _megacontext_ref import MAGIC_LE, canonical_header, legacy_header
from mcf.megacontext import (CtxHeader, children_of, gist_offset, parent_of, parse_header, span_of,
                             token_offset)
from mcf.megacontext._layout import MAGIC_BYTES, MAGIC_BYTES_REVERSED, ctx_dtype, encode_model_name


def test_seed_000_worked_examples():
    # "Block 10, token 5: offset = 64 + ((10 * 32 + 5) * 4) = 1364 bytes"
    assert token_offset(10, 5) == 1364
    assert token_offset(10, 5, 32) == 64 + (10 * 32 + 5) * 4
    # "Gist 42 in LOD1.ctx (d=2048, fp16): offset = 64 + (42 * 2048 * 2) = 172096 bytes"
    assert gist_offset(42, 2048, 2) == 172096
    assert gist_offset(0, 2048, 2) == 64


def test_magic_bytes_on_disk():
    assert MAGIC_BYTES == bytes([0x54, 0x43, 0x43, 0x4D]) == struct.pack("<I", 0x4D434354)
    assert MAGIC_BYTES_REVERSED == b"MCCT"
    h = CtxHeader(level=1, block_size=32, embedding_dim=2048, dtype_code=1, num_entries=7, model_name="SmolLM3-3B")
    assert h.pack()[:4] == MAGIC_LE


def test_canonical_header_matches_the_seed_layout():
    h = CtxHeader(level=2, block_size=32, embedding_dim=2048, dtype_code=2, num_entries=976, model_name="SmolLM3-3B")
    raw = h.pack()
    assert len(raw) == 64
    assert raw == canonical_header(2, 32, 2048, 2, 976, b"SmolLM3-3B")
    assert struct.unpack_from("<Q", raw, 14)[0] == 976
    assert raw[22:32] == b"SmolLM3-3B"
    back = parse_header(raw, 64 + 976 * 4096)
    assert back == h
    assert back.layout == "canonical" and back.magic_order == "canonical"


def test_legacy_header_matches_seed_001_and_derives_the_count():
    raw = legacy_header(1, 32, 16, 1, b"SmolLM3-3B")
    h = CtxHeader(level=1, block_size=32, embedding_dim=16, dtype_code=1, num_entries=0, model_name="SmolLM3-3B")
    assert h.pack_legacy() == raw
    assert raw[14:24] == b"SmolLM3-3B"
    back = parse_header(raw, 64 + 5 * 32)
    assert back.layout == "legacy" and back.num_entries == 5 and back.model_name == "SmolLM3-3B"


@pytest.mark.parametrize("legacy", [False, True])
def test_reversed_magic_is_read(legacy):
    raw = (legacy_header(0, 32, 8, 0, b"m", magic=b"MCCT") if legacy
           else canonical_header(0, 32, 8, 0, 3, b"model", magic=b"MCCT"))
    h = parse_header(raw, 64 + 12)
    assert h.magic_order == "reversed"
    assert h.num_entries == 3
    assert h.pack()[:4] == MAGIC_LE   # written back canonically


@settings(max_examples=200, deadline=None)
@given(level=st.sampled_from([0, 1, 2]), k=st.integers(1, 0xFFFF), d=st.integers(1, 0xFFFF),
       code=st.sampled_from([1, 2, 3, 4]), n=st.integers(0, 50), extra=st.integers(0, 3),
       name=st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters="\x7f"),
                    max_size=40))
def test_header_round_trips_both_layouts(level, k, d, code, n, extra, name):
    code = 0 if level == 0 else code
    h = CtxHeader(level=level, block_size=k, embedding_dim=d, dtype_code=code, num_entries=n, model_name=name)
    esize = h.entry_size
    short = encode_model_name(name).rstrip(b"\0").decode("utf-8")
    assert len(short.encode()) <= 31 and name.startswith(short)
    # canonical, with `extra` uncommitted entries after the counted ones (metadata.json's count is the
    # hint a tree passes); without a hint when the count fills the file exactly
    for size, hint in ((64 + (n + extra) * esize, n), (64 + n * esize, None)):
        back = parse_header(h.pack(), size, expect_count=hint)
        assert (back.layout, back.num_entries, back.model_name, back.level, back.block_size, back.embedding_dim,
                back.dtype_code) == ("canonical", n, short, level, k, d, code)
    # legacy: the count comes from the size; metadata's count decides when both readings are possible
    raw = h.pack_legacy()
    back = parse_header(raw, 64 + n * esize, expect_count=n)
    # a 1-2 byte name read as a canonical count can equal the real count: then the 64 bytes mean the
    # same thing in both layouts except for the name, and nothing can tell them apart (canonical wins)
    ambiguous = int.from_bytes(raw[14:22], "little") == n and not raw[22:64].strip(b"\0")
    assert (back.num_entries, back.level, back.block_size, back.embedding_dim) == (n, level, k, d)
    assert back.model_name == short or (ambiguous and back.model_name == "")
    if len(short.encode()) >= 3:   # a name of 3+ bytes cannot be mistaken for a count that fits
        assert parse_header(h.pack_legacy(), 64 + n * esize).layout == "legacy"


def test_ambiguous_header_resolved_by_metadata_count_then_by_the_file_size():
    # A legacy file with an empty model name is byte for byte a canonical file that counts 0 entries and
    # has uncommitted bytes after them.  metadata.json's count decides; without it, the reading whose
    # count fills the file exactly (FORMATS.md: "the count checked against the file size tells which").
    raw = legacy_header(0, 32, 8, 0, b"")
    assert raw == canonical_header(0, 32, 8, 0, 0, b"")
    size = 64 + 40 * 4
    h = parse_header(raw, size, expect_count=40)
    assert h.layout == "legacy" and h.num_entries == 40
    h = parse_header(raw, size, expect_count=0)
    assert h.layout == "canonical" and h.num_entries == 0
    h = parse_header(raw, size)
    assert h.layout == "legacy" and h.num_entries == 40
    # a one-character legacy name "A" is the canonical count 65
    raw = legacy_header(0, 32, 8, 0, b"A")
    assert parse_header(raw, 64 + 100 * 4, expect_count=100).model_name == "A"
    assert parse_header(raw, 64 + 100 * 4, expect_count=65).num_entries == 65


def test_spans():
    assert span_of(0, 7) == (7, 8)
    assert span_of(1, 3) == (96, 128)
    assert span_of(2, 1) == (1024, 2048)
    assert list(children_of(2, 1)) == list(range(32, 64))
    assert list(children_of(1, 2)) == list(range(64, 96))
    assert parent_of(1, 63) == 1 and parent_of(0, 95) == 2
    assert span_of(2, 2, block_size=4) == (32, 48)
    for bad in (lambda: span_of(3, 0), lambda: children_of(0, 1), lambda: parent_of(2, 0)):
        with pytest.raises(mcf.InvalidArgumentError):
            bad()


def test_dtype_table():
    assert [ctx_dtype(c).name for c in range(5)] == ["uint32", "fp16", "bf16", "fp32", "q8"]
    assert ctx_dtype("float16").code == 1 and ctx_dtype("bfloat16").code == 2 and ctx_dtype("f32").code == 3
    import ml_dtypes
    import numpy as np

    assert ctx_dtype(np.float16).code == 1 and ctx_dtype(ml_dtypes.bfloat16).code == 2
    for bad in (5, "int4", np.int64, np.uint8, object()):
        with pytest.raises(mcf.InvalidArgumentError):
            ctx_dtype(bad)


# -- bad headers: each a specific MCFError naming the field and offset -------------------------------------
GOOD = canonical_header(1, 32, 16, 1, 2, b"model")
SIZE = 64 + 2 * 32


def patched(offset, fmt, value, raw=GOOD):
    b = bytearray(raw)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


@pytest.mark.parametrize("raw,size,cls,field,offset", [
    (b"XXXX" + GOOD[4:], SIZE, mcf.FormatError, "magic", 0),
    (patched(4, "<H", 2), SIZE, mcf.UnsupportedVersionError, "version", 4),
    (patched(6, "<H", 3), SIZE, mcf.FormatError, "level", 6),
    (patched(8, "<H", 0), SIZE, mcf.FormatError, "block_size", 8),
    (patched(10, "<H", 0), SIZE, mcf.FormatError, "embedding_dim", 10),
    (patched(12, "<H", 5), SIZE, mcf.FormatError, "dtype_code", 12),
    (patched(12, "<H", 0), SIZE, mcf.FormatError, "dtype_code", 12),          # a gist file of uint32
    (patched(14, "<Q", 3), SIZE, mcf.TruncatedError, "num_entries", 14),     # count larger than the file
    (patched(14, "<Q", 2**64 - 1), SIZE, mcf.TruncatedError, "num_entries", 14),
    (patched(60, "<B", 1), SIZE, mcf.FormatError, "reserved", 54),
    (GOOD[:40], 40, mcf.TruncatedError, "header", 0),
    (patched(22, "<B", 0xFF), SIZE, mcf.FormatError, "model_name", 22),     # not UTF-8
])
def test_bad_headers(raw, size, cls, field, offset):
    with pytest.raises(cls) as ei:
        parse_header(raw, size, path="x/LOD1.ctx")
    e = ei.value
    assert type(e) is cls
    assert (e.field, e.offset) == (field, offset)
    assert "x/LOD1.ctx" in str(e) and field in str(e)


def test_lod0_must_hold_tokens_and_level_must_match():
    raw = canonical_header(0, 32, 16, 1, 0)
    with pytest.raises(mcf.FormatError, match="uint32"):
        parse_header(raw, 64)
    with pytest.raises(mcf.FormatError, match="file name"):
        parse_header(canonical_header(1, 32, 16, 1, 0), 64, expect_level=2)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=80), st.integers(0, 10**6))
def test_random_bytes_never_escape_as_builtins(raw, size):
    try:
        parse_header(raw, size)
    except mcf.MCFError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 63), st.integers(0, 255))
def test_every_single_byte_corruption_is_a_format_error_or_still_valid(pos, val):
    raw = bytearray(GOOD)
    raw[pos] = val
    try:
        h = parse_header(bytes(raw), SIZE)
    except mcf.MCFError:
        return
    assert h.num_entries * h.entry_size <= SIZE - 64
