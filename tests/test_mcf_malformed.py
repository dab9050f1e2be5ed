"""Malformed MCF input: every truncation, a corpus of hand-made corrupt files, fuzzing, error pickling,
reads after close and caller errors.

The rule under test (issue text): every size, offset and count is checked with overflow-safe
arithmetic before use, and each problem raises a specific :class:`mcf.MCFError` subclass (that also
inherits the matching builtin) whose message names the file, the field and the offset.  Never a
segfault, a hang, a MemoryError or a stray builtin exception.
"""

from __future__ import annotations

import gc
import os
import pickle
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
from mcf.container.layout import SectionType

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

VECTORS = Path(__file__).parent / "vectors" / "mantle" / "files"
K3 = VECTORS / "k3.mcf"

U64 = 2**64 - 1
U32 = 2**32 - 1
P = struct.pack_into


# ------------------------------------------------------------------------------------------------
# the small valid file every corruption starts from
# ------------------------------------------------------------------------------------------------
def build_small(path) -> None:
    """A ~2.5 KB file: resources, ModelInfo, plain tensors of several dtypes, three quantized ones."""
    rng = np.random.default_rng(1234)
    with mcf.Writer(path) as w:
        w.add_resource("config.json", b'{"model_type":"llama","hidden_size":8}')
        w.add_resource("tokenizer.json", b'{"v":1}')
        w.add_resource("merges.txt", b"a b\n")
        w.add_model_info(mcf.ModelInfo(model_name="tiny", base_model="base", arch=mcf.Arch.LLAMA,
                                       vocab_size=11, hidden_size=8, rope_freq_base=10000.0,
                                       extras={"a.int": 1, "b.float": 2.5, "c.str": "x"}))
        lay = mcf.quant_layout("k4", (3, 40))
        sub = rng.integers(1, 64, lay.nbytes, dtype=np.uint8)  # sub-scales must stay <= 63
        w.add_tensor_bytes("q.k4", "k4", (3, 40), sub.tobytes(), quant={"min_clip": -1.0, "max_clip": 1.0})
        lay = mcf.quant_layout("q4", (2, 40))
        w.add_tensor_bytes("q.q4", "q4", (2, 40), rng.integers(0, 256, lay.nbytes, dtype=np.uint8).tobytes(),
                           quant={"min_clip": -2.0, "max_clip": 2.0})
        w.add_tensor("w.bf16", rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16))
        w.add_tensor("w.f16", rng.standard_normal(3).astype(np.float16))
        w.add_tensor("w.f32", rng.standard_normal((4, 5)).astype(np.float32))
        w.add_tensor("w.i8", np.arange(6, dtype=np.int8).reshape(2, 3))
        w.add_tensor("w.scalar", np.float64(3.5))
        w.add_tensor("w.u64", np.arange(3, dtype=np.uint64))
        w.add_tensor("w.u8", rng.integers(0, 256, (16, 40), dtype=np.uint8))


@pytest.fixture(scope="module")
def small_path(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("small") / "small.mcf"
    build_small(p)
    return p


@pytest.fixture(scope="module")
def small_bytes(small_path) -> bytes:
    return small_path.read_bytes()


@pytest.fixture(scope="module")
def k3_bytes() -> bytes:
    return K3.read_bytes()


class Lay:
    """Absolute offsets of the structures of a valid file, for patching."""

    def __init__(self, data: bytes):
        self.data = data
        self.size = len(data)
        with mcf.open(memoryview(data)) as c:
            self.header = c.header
            self.sec = {s.type: s for s in c.sections}
            self.dir = c.header.section_dir_offset
            self.dirent = {s.type: self.dir + 24 * i for i, s in enumerate(c.sections)}
            self.pos = {t.name: t.index for t in c.index.values()}   # name -> on-disk entry position
            self.infos = {t.name: t for t in c.index.values()}
        self.T = self.sec[SectionType.TENSOR_INDEX].offset
        (self.ti_version, self.ti_flags, self.count, self.dims_count, self.entries_off, self.dims_off,
         self.strings_off, self.strings_size) = struct.unpack_from("<IIIIQQQQ", data, self.T)
        self.Q = self.sec[SectionType.QUANT_INFO].offset if SectionType.QUANT_INFO in self.sec else None
        self.M = self.sec[SectionType.MODEL_INFO].offset if SectionType.MODEL_INFO in self.sec else None
        self.td = self.sec[SectionType.TENSOR_DATA]

    def entry(self, name: str) -> int:
        return self.T + self.entries_off + 40 * self.pos[name]

    def entry_fields(self, name: str):
        return struct.unpack_from("<IIIIIIQQ", self.data, self.entry(name))

    def dim(self, name: str, k: int) -> int:
        dim_off = self.entry_fields(name)[4]
        return self.T + self.dims_off + 8 * (dim_off + k)

    def mi(self, field_off: int, fmt: str = "<Q") -> int:
        return struct.unpack_from(fmt, self.data, self.M + field_off)[0]

    def kv(self, i: int) -> int:
        return self.M + self.mi(80) + 24 * i

    def boundaries(self) -> set:
        """Offsets where a structure starts or ends (for targeted truncation)."""
        pts = {0, 4, 6, 8, 12, 16, 24, 32, 40, self.size}
        for s in self.sec.values():
            pts |= {s.offset, s.offset + s.size}
        n = self.header.section_count
        pts |= {self.dir + 24 * i + k for i in range(n + 1) for k in (0, 4, 8, 16)}
        pts |= {self.T + k for k in range(0, 48, 4)}
        pts |= {self.T + self.entries_off + 40 * i for i in range(self.count + 1)}
        strings = self.T + self.strings_off
        pts |= {self.T + self.dims_off, strings, strings + self.strings_size}
        for t in self.infos.values():
            pts |= {t.offset, t.offset + t.nbytes}
        if self.Q is not None:
            pts |= {self.Q + 8 + 24 * i for i in range(self.sec[SectionType.QUANT_INFO].size // 24 + 1)}
        return {p for q in pts for p in range(q - 2, q + 3) if 0 <= p < self.size}


@pytest.fixture(scope="module")
def small_lay(small_bytes) -> Lay:
    return Lay(small_bytes)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def exercise(c) -> None:
    """Read everything a container offers; only MCFError may come out."""
    for name in c:
        t = c.info(name)
        c.raw(name).tobytes()
        if t.quantized:
            c.quant_layout(name)
            c.quant_record(name)
            for arr in c.quant_regions(name).values():
                arr.tobytes()
        else:
            np.asarray(c.tensor(name)).tobytes()
            if t.dtype.family == "float":
                c.to_float32(name)
    for r in c.quant_info:
        assert r.name in c
    try:
        _ = c.model_info
    except mcf.FormatError:
        pass
    for fname, data in c.resources.items():
        assert isinstance(data, bytes)
        for get in (c.resource_text, c.resource_json) if fname.endswith(".json") else (c.resource_text,):
            try:
                get(fname)
            except mcf.FormatError:
                pass
    for s in c.sections:
        c.section_bytes(s.type)
    assert isinstance(c.verify(), list)


def open_or_mcferror(buf) -> None:
    """Open ``buf`` in memory: must either raise MCFError or open and survive :func:`exercise`."""
    try:
        c = mcf.open(buf)
    except mcf.MCFError:
        return
    try:
        exercise(c)
    except mcf.MCFError:
        pass
    finally:
        c.close()


def check_error(exc: BaseException, expected: type, field: str, path=None) -> None:
    assert type(exc) is expected, f"{type(exc).__name__} instead of {expected.__name__}: {exc}"
    assert isinstance(exc, mcf.MCFError)
    assert isinstance(exc, ValueError)
    msg = str(exc)
    if path is not None:
        assert str(path) in msg, msg
    assert field in msg, f"field {field!r} not in {msg!r}"
    assert "offset" in msg, msg
    assert exc.offset is not None and exc.field is not None


# ------------------------------------------------------------------------------------------------
# every truncation
# ------------------------------------------------------------------------------------------------
def _sweep_memory(data: bytes, lengths, fix_file_size: bool) -> list:
    """Open every prefix in memory; return the lengths that did not raise FormatError."""
    mv = memoryview(data)
    bad = []
    for n in lengths:
        if fix_file_size and n >= 32:
            buf = bytearray(mv[:n])
            P("<Q", buf, 24, n)
        else:
            buf = mv[:n]
        try:
            mcf.open(buf).close()
        except mcf.FormatError as exc:
            if not isinstance(exc, mcf.MCFError) or "offset" not in str(exc):
                bad.append((n, repr(exc)))
        except BaseException as exc:  # noqa: BLE001 - the point is to catch everything else
            bad.append((n, repr(exc)))
        else:
            bad.append((n, "opened"))
    return bad


@pytest.mark.parametrize("which", ["small", "k3"])
def test_every_truncation_in_memory(which, small_bytes, k3_bytes):
    data = small_bytes if which == "small" else k3_bytes
    with mcf.open(memoryview(data)) as c:   # the full file is fine
        assert c.header.file_size == len(data)
    bad = _sweep_memory(data, range(len(data)), fix_file_size=False)
    assert not bad, bad[:5]


def test_every_truncation_with_consistent_file_size(small_bytes, small_lay, k3_bytes):
    """The prefix's header is patched to claim the prefix length, so the checks past the header run."""
    assert not _sweep_memory(small_bytes, range(len(small_bytes)), fix_file_size=True)
    lay = Lay(k3_bytes)
    lengths = sorted(lay.boundaries() | set(range(0, len(k3_bytes), 61)))
    assert len(lengths) > 2000
    bad = _sweep_memory(k3_bytes, lengths, fix_file_size=True)
    assert not bad, bad[:5]


def test_every_truncation_bytearray(small_bytes):
    for n in range(len(small_bytes)):
        with pytest.raises(mcf.FormatError):
            mcf.open(bytearray(small_bytes[:n]))


def _sweep_files(data: bytes, lengths, path: Path) -> None:
    """Truncate a copy of the file in place, longest first, and open it through all file modes."""
    path.write_bytes(data)
    for n in sorted(lengths, reverse=True):
        os.truncate(path, n)
        for mode in ("mmap", "pread", "fileobj"):
            if mode == "fileobj":
                with open(path, "rb") as f:
                    with pytest.raises(mcf.FormatError) as ei:
                        mcf.open(f)
            else:
                with pytest.raises(mcf.FormatError) as ei:
                    mcf.open(path, mmap=(mode == "mmap"))
            assert isinstance(ei.value, mcf.MCFError)
            assert str(path) in str(ei.value), (n, mode, str(ei.value))
            assert "offset" in str(ei.value)


def test_every_truncation_small_file_modes(small_bytes, tmp_path):
    _sweep_files(small_bytes, range(len(small_bytes)), tmp_path / "cut.mcf")


def test_truncation_k3_file_modes(k3_bytes, tmp_path):
    lay = Lay(k3_bytes)
    lengths = lay.boundaries() | set(range(0, len(k3_bytes), 997))
    _sweep_files(k3_bytes, lengths, tmp_path / "cut.mcf")


# ------------------------------------------------------------------------------------------------
# the corpus of hand-made corrupt files
# ------------------------------------------------------------------------------------------------
F, TR, UV = mcf.FormatError, mcf.TruncatedError, mcf.UnsupportedVersionError
CFG, TOK, MERGES = SectionType.HF_CONFIG_JSON, SectionType.TOKENIZER_JSON, SectionType.MERGES_TXT
TI, TD = SectionType.TENSOR_INDEX, SectionType.TENSOR_DATA
QI, MI = SectionType.QUANT_INFO, SectionType.MODEL_INFO


def _swap_entries(b, L, a, c):
    x, y = L.entry(a), L.entry(c)
    b[x:x + 40], b[y:y + 40] = L.data[y:y + 40], L.data[x:x + 40]


def _dup_name(b, L):
    x = L.entry("w.f32")
    b[L.entry("w.i8"):L.entry("w.i8") + 8] = L.data[x:x + 8]


def _bad_utf8_name(b, L):
    name_off, name_len = L.entry_fields("w.u8")[:2]
    b[L.T + L.strings_off + name_off + name_len - 1] = 0xFF   # "w.u\xff" still sorts last


def _overflow_dims(b, L):
    P("<QQ", b, L.dim("w.f32", 0), 2**33, 2**33)    # 2**66 elements


def _all_dims_max(b, L):
    for k in range(L.dims_count):
        P("<Q", b, L.T + L.dims_off + 8 * k, U64)


def _kv_string_len(b, L):
    value_off = struct.unpack_from("<Q", L.data, L.kv(2) + 16)[0]
    P("<I", b, L.M + value_off, U32)


def _appended(b, L):
    b += b"\0" * 8


# (id, patch(b, L), stage, expected class, field substring)
#   stage "open": mcf.open raises; "model_info": opening works, c.model_info raises and verify() reports;
#   "json"/"text": resource_json("config.json") / resource_text("merges.txt") raise.
CORPUS = [
    # header
    ("magic", lambda b, L: b.__setitem__(slice(0, 4), b"MCG\0"), "open", F, "magic"),
    ("magic-gguf", lambda b, L: b.__setitem__(slice(0, 4), b"GGUF"), "open", F, "magic"),
    ("major-0", lambda b, L: P("<H", b, 4, 0), "open", UV, "major"),
    ("major-2", lambda b, L: P("<H", b, 4, 2), "open", UV, "major"),
    ("major-ffff", lambda b, L: P("<H", b, 4, 0xFFFF), "open", UV, "major"),
    ("file_size+1", lambda b, L: P("<Q", b, 24, L.size + 1), "open", TR, "file_size"),
    ("file_size-8", lambda b, L: P("<Q", b, 24, L.size - 8), "open", TR, "file_size"),
    ("file_size-max", lambda b, L: P("<Q", b, 24, U64), "open", TR, "file_size"),
    ("file_size-0", lambda b, L: P("<Q", b, 24, 0), "open", TR, "file_size"),
    ("appended", _appended, "open", TR, "file_size"),
    ("header_size-39", lambda b, L: P("<I", b, 8, 39), "open", F, "header_size"),
    ("header_size-0", lambda b, L: P("<I", b, 8, 0), "open", F, "header_size"),
    ("header_size-past-eof", lambda b, L: P("<I", b, 8, L.size + 1), "open", F, "header_size"),
    ("header_size-max", lambda b, L: P("<I", b, 8, U32), "open", F, "header_size"),
    ("section_count-0", lambda b, L: P("<I", b, 12, 0), "open", F, "section_count"),
    ("section_count-huge", lambda b, L: P("<I", b, 12, U32), "open", F, "section_count"),
    ("section_count+1", lambda b, L: P("<I", b, 12, L.header.section_count + 1), "open", TR,
     "section_dir_offset"),
    ("dir-inside-header", lambda b, L: P("<Q", b, 16, 8), "open", F, "section_dir_offset"),
    ("dir-at-0", lambda b, L: P("<Q", b, 16, 0), "open", F, "section_dir_offset"),
    ("dir-before-header_size", lambda b, L: (P("<I", b, 8, 48), P("<Q", b, 16, 40)), "open", F,
     "section_dir_offset"),
    ("dir-past-eof", lambda b, L: P("<Q", b, 16, L.size), "open", TR, "section_dir_offset"),
    ("dir-runs-past-eof", lambda b, L: P("<Q", b, 16, L.dir + 8), "open", TR, "section_dir_offset"),
    ("dir-max", lambda b, L: P("<Q", b, 16, U64), "open", TR, "section_dir_offset"),
    ("dir-wraps", lambda b, L: P("<Q", b, 16, 2**64 - 24), "open", TR, "section_dir_offset"),
    # section directory
    ("sec-misaligned", lambda b, L: P("<Q", b, L.dirent[CFG] + 8, L.sec[CFG].offset + 4), "open", F,
     "config.json).offset"),
    ("sec-misaligned-td", lambda b, L: P("<Q", b, L.dirent[TD] + 8, L.td.offset + 1), "open", F,
     "TensorData).offset"),
    ("sec-offset-past-eof", lambda b, L: P("<Q", b, L.dirent[CFG] + 8, L.size + 8), "open", TR,
     "config.json).offset"),
    ("sec-size-past-eof", lambda b, L: P("<Q", b, L.dirent[TD] + 16, L.size), "open", TR,
     "TensorData).offset"),
    ("sec-size-max", lambda b, L: P("<Q", b, L.dirent[CFG] + 16, U64), "open", TR, "config.json).offset"),
    ("sec-offset-max", lambda b, L: P("<QQ", b, L.dirent[CFG] + 8, 2**64 - 8, 16), "open", TR,
     "config.json).offset"),
    ("sec-inside-header", lambda b, L: P("<Q", b, L.dirent[CFG] + 8, 0), "open", F, "config.json).offset"),
    ("sec-inside-header-32", lambda b, L: P("<Q", b, L.dirent[MERGES] + 8, 32), "open", F,
     "merges.txt).offset"),
    ("sec-overlaps-dir", lambda b, L: P("<Q", b, L.dirent[QI] + 16, L.dir - L.Q + 8), "open", F,
     "QuantInfo).offset"),
    ("sec-inside-dir", lambda b, L: P("<Q", b, L.dirent[MERGES] + 8, L.dir), "open", F, "merges.txt).offset"),
    ("sec-overlap-next", lambda b, L: P("<Q", b, L.dirent[CFG] + 16, L.sec[CFG].size + 16), "open", F,
     "offset"),
    ("sec-overlap-td", lambda b, L: P("<Q", b, L.dirent[TD] + 8, L.td.offset - 8), "open", F, "offset"),
    ("sec-same-range", lambda b, L: P("<QQ", b, L.dirent[MERGES] + 8, L.sec[TOK].offset, L.sec[TOK].size),
     "open", F, "offset"),
    ("sec-dup-resource", lambda b, L: P("<I", b, L.dirent[MERGES], TOK), "open", F, "tokenizer.json).type"),
    ("sec-dup-modelinfo", lambda b, L: P("<I", b, L.dirent[CFG], MI), "open", F, "ModelInfo).type"),
    ("sec-dup-tensordata", lambda b, L: P("<I", b, L.dirent[MERGES], TD), "open", F, "TensorData).type"),
    ("sec-version-2", lambda b, L: P("<I", b, L.dirent[TI] + 4, 2), "open", UV, "TensorIndex).version"),
    ("sec-version-0", lambda b, L: P("<I", b, L.dirent[CFG] + 4, 0), "open", UV, "config.json).version"),
    ("no-tensordata", lambda b, L: P("<I", b, L.dirent[TD], 0x7777), "open", F, "TensorData"),
    # TensorIndex header
    ("ti-version-2", lambda b, L: P("<I", b, L.T, 2), "open", UV, "TensorIndex.version"),
    ("ti-version-0", lambda b, L: P("<I", b, L.T, 0), "open", UV, "TensorIndex.version"),
    ("ti-count-0", lambda b, L: P("<I", b, L.T + 8, 0), "open", F, "TensorIndex.tensor_count"),
    ("ti-count-huge", lambda b, L: P("<I", b, L.T + 8, U32), "open", TR, "TensorIndex.entries_off"),
    ("ti-count+1", lambda b, L: P("<I", b, L.T + 8, L.count + 1), "open", F, "TensorIndex.entry"),
    ("ti-entries-past", lambda b, L: P("<Q", b, L.T + 16, L.sec[TI].size), "open", TR,
     "TensorIndex.entries_off"),
    ("ti-entries-max", lambda b, L: P("<Q", b, L.T + 16, U64), "open", TR, "TensorIndex.entries_off"),
    ("ti-dims-count-huge", lambda b, L: P("<I", b, L.T + 12, U32), "open", TR, "TensorIndex.dims_off"),
    ("ti-dims-off-max", lambda b, L: P("<Q", b, L.T + 24, U64), "open", TR, "TensorIndex.dims_off"),
    ("ti-strings-size-huge", lambda b, L: P("<Q", b, L.T + 40, U64), "open", TR, "TensorIndex.strings_off"),
    ("ti-strings-off-max", lambda b, L: P("<Q", b, L.T + 32, U64), "open", TR, "TensorIndex.strings_off"),
    ("ti-section-tiny", lambda b, L: P("<Q", b, L.dirent[TI] + 16, 40), "open", TR, "TensorIndex.header"),
    ("ti-section-empty", lambda b, L: P("<Q", b, L.dirent[TI] + 16, 0), "open", TR, "TensorIndex.header"),
    # TensorIndex entries
    ("dtype-0", lambda b, L: P("<I", b, L.entry("w.f32") + 8, 0), "open", F, "dtype"),
    ("dtype-unknown", lambda b, L: P("<I", b, L.entry("w.f32") + 8, 0x13), "open", F, "dtype"),
    ("dtype-max", lambda b, L: P("<I", b, L.entry("w.f32") + 8, U32), "open", F, "dtype"),
    ("rank-17", lambda b, L: P("<I", b, L.entry("w.f32") + 12, 17), "open", F, "rank"),
    ("rank-max", lambda b, L: P("<I", b, L.entry("w.f32") + 12, U32), "open", F, "rank"),
    ("rank-16-past-dims", lambda b, L: P("<I", b, L.entry("w.f32") + 12, 16), "open", TR, "dim_off"),
    ("dim_off-out", lambda b, L: P("<I", b, L.entry("w.f32") + 16, L.dims_count), "open", TR, "dim_off"),
    ("dim_off-max", lambda b, L: P("<I", b, L.entry("w.f32") + 16, U32), "open", TR, "dim_off"),
    ("dims-overflow", _overflow_dims, "open", F, "data_size"),
    ("dims-all-max", _all_dims_max, "open", F, "data_size"),
    ("dim-zero", lambda b, L: P("<Q", b, L.dim("w.f32", 0), 0), "open", F, "data_size"),
    ("data_size+1", lambda b, L: P("<Q", b, L.entry("w.f32") + 32, 81), "open", F, "data_size"),
    ("data_size-max", lambda b, L: P("<Q", b, L.entry("w.f32") + 32, U64), "open", F, "data_size"),
    ("data_size-quant", lambda b, L: P("<Q", b, L.entry("q.k4") + 32, L.infos["q.k4"].nbytes + 64), "open",
     F, "data_size"),
    ("data_off-before-td", lambda b, L: P("<Q", b, L.entry("w.f32") + 24, L.td.offset - 8), "open", TR,
     "data_off"),
    ("data_off-end-past-td", lambda b, L: P("<Q", b, L.entry("w.f32") + 24, L.td.offset + L.td.size - 4),
     "open", TR, "data_off"),
    ("data_off-past-eof", lambda b, L: P("<Q", b, L.entry("w.f32") + 24, L.size + 64), "open", TR,
     "data_off"),
    ("data_off-max", lambda b, L: P("<Q", b, L.entry("w.f32") + 24, 2**64 - 8), "open", TR, "data_off"),
    ("name-past-blob", lambda b, L: P("<I", b, L.entry("w.f32") + 4, L.strings_size), "open", TR, "name_off"),
    ("name_off-max", lambda b, L: P("<I", b, L.entry("w.f32"), U32), "open", TR, "name_off"),
    ("name_len-max", lambda b, L: P("<I", b, L.entry("w.f32") + 4, U32), "open", TR, "name_off"),
    ("name-empty", lambda b, L: P("<I", b, L.entry("w.f32") + 4, 0), "open", F, "name_len"),
    ("names-unsorted", lambda b, L: _swap_entries(b, L, "w.f16", "w.i8"), "open", F, "name"),
    ("names-duplicate", _dup_name, "open", F, "name"),
    ("names-duplicate-unsorted-flag", lambda b, L: (_dup_name(b, L), P("<I", b, L.T + 4, 2)), "open", F,
     "name"),
    ("name-bad-utf8", _bad_utf8_name, "open", F, "name"),
    ("quant-misaligned", lambda b, L: P("<Q", b, L.entry("q.k4") + 24, L.infos["q.k4"].offset + 8), "open",
     F, "data_off"),
    ("quant-rank-1", lambda b, L: P("<I", b, L.entry("q.k4") + 12, 1), "open", F, "rank"),
    ("quant-rank-3", lambda b, L: P("<I", b, L.entry("q.k4") + 12, 3), "open", F, "rank"),
    ("quant-rank-0", lambda b, L: P("<I", b, L.entry("q.q4") + 12, 0), "open", F, "rank"),
    ("quant-no-aligned64-flag", lambda b, L: P("<Q", b, 32, 0), "open", F, "dtype"),
    ("plain-to-quant-dtype", lambda b, L: P("<I", b, L.entry("w.u8") + 8, 0x21), "open", F, "data_size"),
    # QuantInfo
    ("qi-version-2", lambda b, L: P("<I", b, L.Q, 2), "open", UV, "QuantInfo.version"),
    ("qi-count-huge", lambda b, L: P("<I", b, L.Q + 4, U32), "open", TR, "QuantInfo.record_count"),
    ("qi-count+1", lambda b, L: P("<I", b, L.Q + 4, 3), "open", TR, "QuantInfo.record_count"),
    ("qi-section-tiny", lambda b, L: P("<Q", b, L.dirent[QI] + 16, 4), "open", TR, "QuantInfo.header"),
    ("qi-index-count", lambda b, L: P("<I", b, L.Q + 8, L.count), "open", F, "tensor_index"),
    ("qi-index-max", lambda b, L: P("<I", b, L.Q + 8, U32), "open", F, "tensor_index"),
    ("qi-index-dup", lambda b, L: P("<I", b, L.Q + 8 + 24, 0), "open", F, "tensor_index"),
    ("qi-index-plain", lambda b, L: P("<I", b, L.Q + 8, L.pos["w.f32"]), "open", F, "method"),
    ("qi-method", lambda b, L: P("<B", b, L.Q + 12, 0x30), "open", F, "method"),
    ("qi-method-0", lambda b, L: P("<B", b, L.Q + 12, 0), "open", F, "method"),
    ("qi-domain-1", lambda b, L: P("<B", b, L.Q + 13, 1), "open", F, "QuantInfo.record[0]"),
    ("qi-domain-ff", lambda b, L: P("<B", b, L.Q + 13, 0xFF), "open", F, "QuantInfo.record[0]"),
    ("qi-block-size", lambda b, L: P("<H", b, L.Q + 14, 64), "open", F, "QuantInfo.record[0]"),
    ("qi-super-size", lambda b, L: P("<H", b, L.Q + 16, 0), "open", F, "QuantInfo.record[0]"),
    ("qi-reserved", lambda b, L: P("<B", b, L.Q + 8 + 15, 1), "open", F, "QuantInfo.record[0].reserved"),
    ("qi-reserved-2", lambda b, L: P("<B", b, L.Q + 8 + 24 + 10, 0x80), "open", F,
     "QuantInfo.record[1].reserved"),
    # ModelInfo (decoded lazily)
    ("mi-version-2", lambda b, L: P("<I", b, L.M, 2), "model_info", UV, "ModelInfo.version"),
    ("mi-flags", lambda b, L: P("<I", b, L.M + 4, 1), "model_info", F, "ModelInfo.flags"),
    ("mi-section-tiny", lambda b, L: P("<Q", b, L.dirent[MI] + 16, 80), "model_info", TR, "ModelInfo.header"),
    ("mi-name-off", lambda b, L: P("<Q", b, L.M + 56, L.sec[MI].size), "model_info", TR,
     "ModelInfo.model_name"),
    ("mi-name-off-max", lambda b, L: P("<Q", b, L.M + 56, U64), "model_info", TR, "ModelInfo.model_name"),
    ("mi-name-len", lambda b, L: P("<I", b, L.M + L.mi(56), U32), "model_info", TR, "ModelInfo.model_name"),
    ("mi-base-off", lambda b, L: P("<Q", b, L.M + 64, L.sec[MI].size - 2), "model_info", TR,
     "ModelInfo.base_model"),
    ("mi-kv-count-huge", lambda b, L: P("<I", b, L.M + 72, U32), "model_info", TR, "ModelInfo.kv_off"),
    ("mi-kv-count+1", lambda b, L: P("<I", b, L.M + 72, 4), "model_info", TR, "ModelInfo.kv_off"),
    ("mi-kv-off-max", lambda b, L: P("<Q", b, L.M + 80, U64), "model_info", TR, "ModelInfo.kv_off"),
    ("mi-kv-off-0", lambda b, L: P("<Q", b, L.M + 80, 0), "model_info", TR, "ModelInfo.kv_off"),
    ("mi-kv-type", lambda b, L: P("<I", b, L.kv(0) + 8, 9), "model_info", F, "ModelInfo.kv[0].type"),
    ("mi-kv-type-0", lambda b, L: P("<I", b, L.kv(2) + 8, 0), "model_info", F, "ModelInfo.kv[2].type"),
    ("mi-kv-key-off", lambda b, L: P("<Q", b, L.kv(1), U64), "model_info", TR, "ModelInfo.kv[1].key"),
    ("mi-kv-key-empty", lambda b, L: P("<Q", b, L.kv(1), 0), "model_info", F, "ModelInfo.kv[1].key"),
    ("mi-kv-value-off", lambda b, L: P("<Q", b, L.kv(0) + 16, L.sec[MI].size - 2), "model_info", TR,
     "ModelInfo.kv[0].value"),
    ("mi-kv-value-0", lambda b, L: P("<Q", b, L.kv(1) + 16, 0), "model_info", TR, "ModelInfo.kv[1].value"),
    ("mi-kv-string-len", _kv_string_len, "model_info", TR, "ModelInfo.kv[2].value"),
    # resources
    ("json-invalid", lambda b, L: b.__setitem__(L.sec[CFG].offset, ord("}")), "json", F, "config.json"),
    ("json-bad-utf8", lambda b, L: b.__setitem__(L.sec[CFG].offset + 2, 0xFF), "json", F, "config.json"),
    ("text-bad-utf8", lambda b, L: b.__setitem__(L.sec[MERGES].offset, 0xFF), "text", F, "merges.txt"),
]


def _modes(path: Path):
    """(label, opener, name in messages) for the four ways to open a file."""
    data = path.read_bytes()
    yield "mmap", lambda: mcf.open(path), str(path)
    yield "pread", lambda: mcf.open(path, mmap=False), str(path)
    yield "memory", lambda: mcf.open(memoryview(data)), "<memory>"

    def fileobj():
        f = open(path, "rb")  # noqa: SIM115 - closed below
        try:
            c = mcf.open(f)
        except BaseException:
            f.close()
            raise
        c._test_file = f
        return c

    yield "fileobj", fileobj, str(path)


def _close(c) -> None:
    c.close()
    f = getattr(c, "_test_file", None)
    if f is not None:
        f.close()


@pytest.mark.parametrize("case_id, patch, stage, expected, field",
                         [pytest.param(*c, id=c[0]) for c in CORPUS])
def test_corrupt_corpus(case_id, patch, stage, expected, field, small_lay, tmp_path):
    b = bytearray(small_lay.data)
    patch(b, small_lay)
    assert bytes(b) != small_lay.data, "the patch changed nothing"
    path = tmp_path / f"{case_id}.mcf"
    path.write_bytes(b)
    for _mode, opener, name in _modes(path):
        if stage == "open":
            with pytest.raises(mcf.MCFError) as ei:
                opener()
            check_error(ei.value, expected, field, name)
            continue
        c = opener()
        try:
            with pytest.raises(mcf.MCFError) as ei:
                if stage == "model_info":
                    _ = c.model_info
                elif stage == "json":
                    c.resource_json("config.json")
                else:
                    c.resource_text("merges.txt")
            check_error(ei.value, expected, field, name)
            if stage != "text":
                problems = c.verify()
                assert any(field in p and name in p for p in problems), problems
            # everything else in the file is still readable
            assert c.tensor("w.f32").shape == (4, 5)
        finally:
            _close(c)


def test_corpus_covers_every_structure():
    """The corpus hits the header, directory, TensorIndex, QuantInfo, ModelInfo and resources."""
    ids = {c[0] for c in CORPUS}
    assert len(ids) == len(CORPUS)
    assert len(CORPUS) >= 100
    assert {c[3] for c in CORPUS} == {F, TR, UV}


def test_unknown_minor_and_unknown_sections_are_fine(small_lay):
    """What the spec says readers must accept: an unknown minor and unknown section types."""
    b = bytearray(small_lay.data)
    P("<H", b, 6, 77)
    P("<IIQQ", b, small_lay.dirent[MERGES], 0xBEEF, 9, small_lay.sec[MERGES].offset, 4)
    with mcf.open(memoryview(b)) as c:
        assert c.header.minor == 77
        assert c.section(0xBEEF).version == 9
        assert c.resource("merges.txt") is None
        exercise(c)


def test_unsorted_names_without_sorted_flag_open(small_lay):
    """Unsorted entries are legal when the sorted flag is clear; QuantInfo keeps pointing at the entry
    position on disk."""
    b = bytearray(small_lay.data)
    _swap_entries(b, small_lay, "w.f16", "w.u8")
    P("<I", b, small_lay.T + 4, 2)
    with mcf.open(memoryview(small_lay.data)) as good, mcf.open(memoryview(b)) as c:
        assert list(c) == list(good)
        for name in good:
            assert c.raw(name).tobytes() == good.raw(name).tobytes()
        assert [r.name for r in c.quant_info] == [r.name for r in good.quant_info]


# ------------------------------------------------------------------------------------------------
# tiny and degenerate files
# ------------------------------------------------------------------------------------------------
def _header(**kw) -> bytearray:
    f = dict(magic=b"MCF\0", major=1, minor=1, header_size=40, count=1, dir=40, size=40, flags=0)
    f.update(kw)
    return bytearray(struct.pack("<4sHHIIQQQ", f["magic"], f["major"], f["minor"], f["header_size"],
                                 f["count"], f["dir"], f["size"], f["flags"]))


def _tiny_files(small_bytes):
    h43 = _header(size=43) + b"\0\0\0"
    return [
        ("empty", b"", TR, "header"),
        ("one-byte", b"M", TR, "header"),
        ("39-bytes", bytes(_header()[:39]), TR, "header"),
        ("40-zero-bytes", bytes(40), F, "magic"),
        ("43-bytes-prefix", small_bytes[:43], TR, "file_size"),
        ("43-bytes-own-header", bytes(h43), TR, "section_dir_offset"),
        ("header-only-no-sections", bytes(_header(count=0)), F, "section_count"),
        ("header-only-dir-past-end", bytes(_header()), TR, "section_dir_offset"),
        ("dir-entry-zero", bytes(_header(size=64) + bytes(24)), F, "section[0]"),
        ("dir-entry-overlaps-dir", bytes(_header(size=64) + struct.pack("<IIQQ", 0x100, 1, 48, 8)), F,
         "section[0]"),
    ]


@pytest.mark.parametrize("idx", range(10))
def test_tiny_files(idx, small_bytes, tmp_path):
    case_id, data, expected, field = _tiny_files(small_bytes)[idx]
    path = tmp_path / f"{case_id}.mcf"
    path.write_bytes(data)
    for mode, opener, name in _modes(path):
        try:
            c = opener()
        except mcf.MCFError as exc:
            check_error(exc, expected, field, name)
        else:  # pragma: no cover - reported as a failure
            _close(c)
            pytest.fail(f"{case_id} opened in mode {mode}")


def test_zero_size_section_at_eof_is_accepted():
    """A resource of size 0 at the very end of the header area is legal: it occupies no bytes."""
    data = _header(size=64) + struct.pack("<IIQQ", 0x100, 1, 40, 0)
    with mcf.open(memoryview(bytes(data))) as c:
        assert c.resource("config.json") == b""
        assert len(c) == 0


def test_deeply_nested_json_resource(tmp_path):
    """json.loads recursion and int-size limits surface as FormatError, not RecursionError/ValueError."""
    for i, payload in enumerate([b"[" * 100_000, b"1" * 5000, b"\xff\xfe"]):
        path = tmp_path / f"nested{i}.mcf"
        with mcf.Writer(path) as w:
            w.add_resource("config.json", payload)
        with mcf.open(path) as c:
            with pytest.raises(mcf.MCFError) as ei:
                c.resource_json("config.json")
            check_error(ei.value, F, "config.json", path)
            assert len(c.verify()) == 1


# ------------------------------------------------------------------------------------------------
# fuzzing
# ------------------------------------------------------------------------------------------------
@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes(data):
    open_or_mcferror(memoryview(data))


@st.composite
def plausible_files(draw):
    """Random bytes behind a header that passes the first checks, so the directory code is reached."""
    body = draw(st.binary(min_size=0, max_size=400))
    count = draw(st.integers(1, 6))
    size = 40 + len(body) + 24 * count
    entries = b"".join(
        struct.pack("<IIQQ", draw(st.sampled_from([1, 2, 3, 4, 0x100, 0x102, 0x105, 0x999])),
                    draw(st.sampled_from([1, 1, 1, 2])),
                    draw(st.integers(0, size + 16)) // 8 * 8, draw(st.integers(0, size)))
        for _ in range(count))
    flags = draw(st.integers(0, 1))
    return bytes(_header(count=count, dir=40 + len(body), size=size, flags=flags) + body + entries)


@settings(max_examples=500, deadline=None)
@given(plausible_files())
def test_random_plausible_files(data):
    open_or_mcferror(memoryview(data))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_single_byte_mutation(small_bytes, data):
    pos = data.draw(st.integers(0, len(small_bytes) - 1), label="pos")
    val = data.draw(st.integers(0, 255).filter(lambda v: v != small_bytes[pos]), label="val")
    b = bytearray(small_bytes)
    b[pos] = val
    open_or_mcferror(memoryview(b))


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_word_mutation(small_bytes, small_lay, data):
    """Overwrite an aligned u32/u64 inside the header, directory, TensorIndex, QuantInfo or ModelInfo with
    an interesting value (0, 1, max, near-max, the file size...)."""
    regions = [(0, 40), (small_lay.dir, small_lay.size), (small_lay.T, small_lay.T + small_lay.sec[TI].size),
               (small_lay.Q, small_lay.Q + 32), (small_lay.M, small_lay.M + small_lay.sec[MI].size)]
    lo, hi = data.draw(st.sampled_from(regions), label="region")
    width = data.draw(st.sampled_from([4, 8]), label="width")
    pos = data.draw(st.integers(lo, hi - width), label="pos") // 4 * 4
    top = 2 ** (8 * width) - 1
    val = data.draw(st.sampled_from([0, 1, 7, 8, 40, 64, small_lay.size, small_lay.size - 8, top, top - 7,
                                     top // 2 + 1, 2**32]).map(lambda v: v & top)
                    | st.integers(0, top), label="val")
    b = bytearray(small_bytes)
    P("<I" if width == 4 else "<Q", b, pos, val)
    open_or_mcferror(memoryview(b))


def test_every_single_byte_flip(small_bytes):
    """Every byte of the small file XOR 0xFF and set to 0x80: open in memory, then read everything."""
    for pos in range(len(small_bytes)):
        for val in (small_bytes[pos] ^ 0xFF, 0x80):
            if val == small_bytes[pos]:
                continue
            b = bytearray(small_bytes)
            b[pos] = val
            open_or_mcferror(memoryview(b))


# ------------------------------------------------------------------------------------------------
# errors are picklable
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [mcf.FormatError, mcf.TruncatedError, mcf.UnsupportedVersionError,
                                 mcf.ChecksumError])
def test_format_error_pickles(cls):
    e = cls("bad thing", path="/x/y.mcf", field="TensorIndex.entry[3].rank", offset=1234, expected=2,
            got=17)
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is cls
    assert str(e2) == str(e)
    assert (e2.reason, e2.path, e2.field, e2.offset, e2.expected, e2.got) == \
        ("bad thing", "/x/y.mcf", "TensorIndex.entry[3].rank", 1234, 2, 17)
    assert "/x/y.mcf" in str(e2) and "offset 1234" in str(e2)


def test_raised_error_pickles(small_lay, tmp_path):
    b = bytearray(small_lay.data)
    P("<I", b, small_lay.entry("w.f32") + 12, 17)
    path = tmp_path / "rank.mcf"
    path.write_bytes(b)
    with pytest.raises(mcf.FormatError) as ei:
        mcf.open(path)
    e2 = pickle.loads(pickle.dumps(ei.value))
    assert type(e2) is type(ei.value)
    assert str(e2) == str(ei.value)
    assert e2.path == str(path)


def test_other_errors_pickle():
    for e in (mcf.TensorNotFoundError("no tensor named 'x'"), mcf.OutOfBoundsError("read past end"),
              mcf.ClosedError("closed"), mcf.DTypeError("quantized")):
        e2 = pickle.loads(pickle.dumps(e))
        assert type(e2) is type(e) and str(e2) == str(e)


# ------------------------------------------------------------------------------------------------
# reads after close
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["mmap", "pread", "memory", "fileobj"])
def test_reads_after_close(mode, small_path):
    opener = dict((m, o) for m, o, _ in _modes(small_path))[mode]
    c = opener()
    names = list(c)
    plain = [n for n in names if not c.info(n).quantized]
    quant = [n for n in names if c.info(n).quantized]
    views = {n: c.tensor(n) for n in plain}
    regions = {n: c.quant_regions(n) for n in quant}
    raws = {n: c.raw(n) for n in names}
    want = {n: v.tobytes() for n, v in views.items()}
    want_regions = {n: {k: a.tobytes() for k, a in r.items()} for n, r in regions.items()}
    want_raw = {n: v.tobytes() for n, v in raws.items()}
    src = c.source
    _close(c)
    assert c.closed
    for call in (lambda: c.tensor("w.f32"), lambda: c.raw("q.k4"), lambda: c.quant_regions("q.k4"),
                 lambda: c.model_info, lambda: c.resources, lambda: c.resource("config.json"),
                 lambda: c.to_float32("w.f16"), lambda: c.section_bytes(SectionType.TENSOR_INDEX),
                 lambda: src.read(0, 4), lambda: src.view(0, 4), lambda: src.array(0, np.uint8, 4),
                 lambda: src.readinto(0, bytearray(4)), lambda: src.refresh()):
        with pytest.raises(mcf.ClosedError) as ei:
            call()
        assert isinstance(ei.value, mcf.MCFError) and isinstance(ei.value, ValueError)
    c.close()  # closing twice is fine
    c = src = opener = None  # the lambdas above share these variables: no reference is left
    gc.collect()
    # views handed out before close stay readable (numpy issues #9537/#9562: no crash)
    for n, v in views.items():
        assert v.tobytes() == want[n]
        assert v.sum() is not None
    for n, r in regions.items():
        assert {k: a.tobytes() for k, a in r.items()} == want_regions[n]
    for n, v in raws.items():
        assert v.tobytes() == want_raw[n]
    del views, regions
    gc.collect()
    for n, v in raws.items():
        assert v.tobytes() == want_raw[n]


def test_views_outlive_container_context(small_path):
    with mcf.open(small_path) as c:
        a = c.tensor("w.f32")
        b = c.tensor("w.f32")[1:, ::2]
        expect = np.array(a)
    del c
    gc.collect()
    assert np.array_equal(a, expect)
    assert np.array_equal(b, expect[1:, ::2])


# ------------------------------------------------------------------------------------------------
# caller errors
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["mmap", "pread", "memory", "fileobj"])
def test_missing_tensor(mode, small_path):
    c = dict((m, o) for m, o, _ in _modes(small_path))[mode]()
    try:
        for call in (c.tensor, c.info, c.raw, c.quant_regions, c.to_float32, c.quant_record):
            with pytest.raises(mcf.TensorNotFoundError) as ei:
                call("missing")
            assert isinstance(ei.value, KeyError) and isinstance(ei.value, mcf.MCFError)
            assert "missing" in str(ei.value)
        with pytest.raises(KeyError):
            c.tensor("w.f32\0")
        assert "missing" not in c
        assert "w.f32" in c
        assert c.tensor("q.k4").dtype == np.float32  # quantized tensors come back dequantized
        with pytest.raises(mcf.DTypeError) as ei:
            c.dequantize("w.i8")
        assert isinstance(ei.value, TypeError)
        with pytest.raises(mcf.DTypeError):
            c.quant_regions("w.f32")
        with pytest.raises(mcf.DTypeError):
            c.to_float32("w.i8")
    finally:
        _close(c)


BAD_RANGES = [(-1, 1), (0, -1), (-1, -1), (-(2**70), 1), (0, 2**70), (2**70, 0), (2**70, 1), (2**64 - 1, 2),
              (2**63, 2**63), (2**64, 0), ("size", 1), ("size-1", 2), (1, "size"), ("size+1", 0)]


@pytest.mark.parametrize("mode", ["mmap", "pread", "memory", "fileobj"])
@pytest.mark.parametrize("offset, size", BAD_RANGES)
def test_source_out_of_bounds(mode, offset, size, small_path):
    c = dict((m, o) for m, o, _ in _modes(small_path))[mode]()
    try:
        src = c.source
        n = src.size

        def val(v):
            return {"size": n, "size-1": n - 1, "size+1": n + 1}.get(v, v) if isinstance(v, str) else v

        offset, size = val(offset), val(size)
        for call in (src.read, src.view, src.check):
            with pytest.raises(mcf.OutOfBoundsError) as ei:
                call(offset, size)
            assert isinstance(ei.value, IndexError) and isinstance(ei.value, mcf.MCFError)
            assert c.path in str(ei.value)
        if size >= 0 and size < 1 << 20:
            with pytest.raises(mcf.OutOfBoundsError):
                src.readinto(offset, bytearray(size))
        # the source still works afterwards
        assert src.read(0, 4) == b"MCF\0"
        assert src.read(n, 0) == b""
        assert len(src.view(n - 8, 8)) == 8
    finally:
        _close(c)
