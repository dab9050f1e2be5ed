"""The byte layout of MegaContext ``.ctx`` files: the one place that knows the header structs, the dtype
table, the offset formulas and the span arithmetic between levels.

Two header layouts exist (seeds 000 and 001 disagree; the decisions are in docs/megacontext.md):

canonical (written)                          legacy (read only)
  0  u32  magic  0x4D434354                    0  u32  magic
  4  u16  version = 1                          4  u16  version
  6  u16  level (0, 1, 2)                      6  u16  level
  8  u16  block_size K                         8  u16  block_size
 10  u16  embedding_dim d                     10  u16  embedding_dim
 12  u16  dtype_code                          12  u16  dtype_code
 14  u64  num_entries                         14  char[32] model_name
 22  char[32] model_name                      46  18 bytes reserved (zero)
 54  10 bytes reserved (zero)                     (no count: derived from the file size)

Everything is little-endian.  The magic is written as the bytes ``54 43 43 4D``; the reversed order
``4D 43 43 54`` (the ASCII string "MCCT", what a writer that took the seed's comment literally produces)
is accepted on read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

import numpy as np

from mcf._core.args import integer
from mcf.errors import FormatError, InvalidArgumentError, TruncatedError, UnsupportedVersionError

__all__ = [
    "MAGIC", "MAGIC_BYTES", "MAGIC_BYTES_REVERSED", "VERSION", "HEADER_SIZE", "LEVELS", "LEVEL_FILES",
    "DEFAULT_BLOCK_SIZE", "CtxDType", "CTX_DTYPES", "ctx_dtype", "CtxHeader", "parse_header",
    "token_offset", "gist_offset", "entry_size", "file_size", "span_of", "children_of", "parent_of",
    "COUNT_OFFSET", "MODEL_NAME_BYTES", "encode_model_name", "GIST_DTYPE_CODES", "Q8_BLOCK", "q8_row_bytes",
    "gist_dtypes", "gist_policy", "HYBRID", "raw_gist_dtype",
]

MAGIC = 0x4D434354
MAGIC_BYTES = struct.pack("<I", MAGIC)            # b"TCCM" = 54 43 43 4D
MAGIC_BYTES_REVERSED = MAGIC_BYTES[::-1]           # b"MCCT" = 4D 43 43 54
VERSION = 1
HEADER_SIZE = 64
LEVELS = (0, 1, 2)
LEVEL_FILES = {0: "LOD0.ctx", 1: "LOD1.ctx", 2: "LOD2.ctx"}
DEFAULT_BLOCK_SIZE = 32
MODEL_NAME_BYTES = 32
COUNT_OFFSET = 14                                  # num_entries in the canonical header

_CANONICAL = struct.Struct("<4sHHHHHQ32s10s")
_LEGACY = struct.Struct("<4sHHHHH32s18s")
assert _CANONICAL.size == _LEGACY.size == HEADER_SIZE


# -- dtypes ---------------------------------------------------------------------------------------------
try:  # optional: a real bfloat16 numpy dtype (else bf16 rows are handed out as uint16 bit patterns)
    import ml_dtypes as _ml_dtypes

    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _BF16 = None


@dataclass(frozen=True)
class CtxDType:
    code: int           # dtype_code in the header
    name: str           # name in metadata.json and the CLI
    itemsize: int
    storage: np.dtype   # how the bytes are stored (bf16 as uint16 bits)
    numpy: np.dtype     # what readers hand out (ml_dtypes.bfloat16 when installed; q8 rows decode to float32)
    is_float: bool
    quantized: bool = False   # q8: a row is blocks of 32 int8 codes with one f16 scale each (see q8_row_bytes)


def _dt(code, name, storage, numpy=None, is_float=True, quantized=False):
    st = np.dtype(storage).newbyteorder("<")
    return CtxDType(code, name, st.itemsize, st, st if numpy is None else numpy, is_float, quantized)


CTX_DTYPES = {
    0: _dt(0, "uint32", np.uint32, is_float=False),
    1: _dt(1, "fp16", np.float16),
    2: _dt(2, "bf16", np.uint16, _BF16 if _BF16 is not None else np.dtype("<u2")),
    3: _dt(3, "fp32", np.float32),
    # MCF's q8 block quantization, one row at a time: itemsize is 1 (a code), the row layout is q8_row_bytes'
    4: _dt(4, "q8", np.uint8, np.dtype("<f4"), quantized=True),
}
GIST_DTYPE_CODES = (1, 2, 3, 4)
_ALIASES = {"uint32": 0, "u32": 0, "fp16": 1, "f16": 1, "float16": 1, "half": 1, "bf16": 2, "bfloat16": 2,
            "fp32": 3, "f32": 3, "float32": 3, "float": 3, "q8": 4}
Q8_BLOCK = 32        # values per q8 block (MCF's q8: one f16 scale per 32 int8 codes)
HYBRID = "hybrid"    # the gist policy of seed 000: recent/fine LOD1 in fp16, older/coarse LOD2 in q8


def q8_row_bytes(embedding_dim: int) -> int:
    """Bytes of one q8 gist row: ``ceil(d / 32)`` f16 block scales, then the blocks' int8 codes
    (32 per block; the codes past ``d`` in the last block are zero padding)."""
    nb = -(-int(embedding_dim) // Q8_BLOCK)
    return nb * 2 + nb * Q8_BLOCK


def raw_gist_dtype(dtype, embedding_dim: int) -> np.dtype:
    """The numpy dtype of one stored gist row of ``dtype`` (a dtype of the table, or its name or code) and
    width ``embedding_dim``: what ``Tree.gists(level, raw=True)`` hands out and the only rows a raw write
    takes.

    A structured dtype, because bytes alone do not say what they hold: an fp16 or bf16 row of d = 17 or
    34 is exactly as wide as a q8 row (``2d == 34 * ceil(d / 32)``), so a q8 level given another tree's
    fp16 bytes would decode the halves as scales and codes.  The field names say the dtype (``fp16``,
    ``bf16`` (the bit patterns, as stored), ``fp32``; ``q8_scales`` and ``q8_codes`` for q8) and the
    subarray shapes say ``d``, so rows of two dtypes or widths never compare equal."""
    dt = ctx_dtype(dtype)
    d = integer(embedding_dim, "embedding_dim")
    if dt.code not in GIST_DTYPE_CODES:
        raise InvalidArgumentError(f"gists are stored as fp16, bf16, fp32 or q8, not {dt.name}")
    if dt.quantized:
        nb = -(-d // Q8_BLOCK)
        return np.dtype([("q8_scales", "<f2", (nb,)), ("q8_codes", "i1", (nb * Q8_BLOCK,))])
    return np.dtype([(dt.name, dt.storage, (d,))])


def gist_dtypes(policy) -> dict:
    """``{1: CtxDType, 2: CtxDType}`` of a gist dtype policy: one dtype for both levels (a name, code or
    numpy dtype), ``"hybrid"`` (LOD1 fp16, LOD2 q8), or a mapping ``{1: ..., 2: ...}`` (metadata.json's
    ``{"LOD1": ..., "LOD2": ...}`` too)."""
    if isinstance(policy, str) and policy.strip().lower() == HYBRID:
        return {1: CTX_DTYPES[1], 2: CTX_DTYPES[4]}
    if isinstance(policy, dict):
        keys = {1: 1, 2: 2, "1": 1, "2": 2, "LOD1": 1, "LOD2": 2}
        if set(keys.get(k, k) for k in policy) != {1, 2} or len(policy) != 2:
            raise InvalidArgumentError(f"a per-level gist dtype policy names levels 1 and 2 (or LOD1 and LOD2), "
                                       f"got {sorted(map(str, policy))}")
        out = {keys[k]: ctx_dtype(v) for k, v in policy.items()}
    else:
        d = ctx_dtype(policy)
        out = {1: d, 2: d}
    for d in out.values():
        if d.code not in GIST_DTYPE_CODES:
            raise InvalidArgumentError(f"gists are stored as fp16, bf16, fp32 or q8, not {d.name}")
    return out


def gist_policy(dtypes: dict):
    """metadata.json's ``gist_dtype`` of ``{1: CtxDType, 2: CtxDType}``: the name when both levels agree,
    else ``{"LOD1": name, "LOD2": name}``."""
    if dtypes[1].code == dtypes[2].code:
        return dtypes[1].name
    return {"LOD1": dtypes[1].name, "LOD2": dtypes[2].name}


def ctx_dtype(value) -> CtxDType:
    """A dtype of the table from a code, a name ("fp16", "f16", "bfloat16"...) or a numpy dtype."""
    if isinstance(value, CtxDType):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if int(value) in CTX_DTYPES:
            return CTX_DTYPES[int(value)]
        raise InvalidArgumentError(f"unknown .ctx dtype code {value!r}; expected one of {sorted(CTX_DTYPES)}")
    if isinstance(value, str):
        key = value.strip().lower()
        if key in _ALIASES:
            return CTX_DTYPES[_ALIASES[key]]
        raise InvalidArgumentError(f"unknown .ctx dtype {value!r}; expected one of {sorted(_ALIASES)}")
    try:
        npdt = np.dtype(value)
    except TypeError:
        raise InvalidArgumentError(f"cannot interpret {value!r} as a .ctx dtype") from None
    if npdt.name == "bfloat16":
        return CTX_DTYPES[2]
    for dt in CTX_DTYPES.values():
        if dt.code != 2 and not dt.quantized and dt.storage == npdt.newbyteorder("<"):
            return dt
    raise InvalidArgumentError(f"numpy dtype {npdt} has no .ctx equivalent (uint32, fp16, bf16, fp32)")


# -- offsets (seed 000's formulas) -------------------------------------------------------------------------
def token_offset(block_index: int, token_index: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Byte offset of token ``token_index`` of block ``block_index`` in LOD0.ctx."""
    b, t = integer(block_index, "block_index"), integer(token_index, "token_index")
    k = integer(block_size, "block_size")
    return HEADER_SIZE + (b * k + t) * 4


def gist_offset(gist_index: int, embedding_dim: int, dtype_bytes) -> int:
    """Byte offset of gist ``gist_index`` in LOD1.ctx / LOD2.ctx (``dtype_bytes``: the element size, or
    a dtype of the table, e.g. ``"q8"``, whose rows are not whole elements)."""
    d = integer(embedding_dim, "embedding_dim")
    if isinstance(dtype_bytes, (str, CtxDType)):
        row = entry_size(1, d, ctx_dtype(dtype_bytes))
    else:
        row = d * integer(dtype_bytes, "dtype_bytes")
    return HEADER_SIZE + integer(gist_index, "gist_index") * row


def entry_size(level: int, embedding_dim: int, dtype: CtxDType) -> int:
    """Bytes per entry: a uint32 token at LOD0, a d-wide vector at LOD1/LOD2 (q8: see q8_row_bytes)."""
    if level == 0:
        return 4
    return q8_row_bytes(embedding_dim) if dtype.quantized else embedding_dim * dtype.itemsize


def file_size(level: int, count: int, embedding_dim: int, dtype: CtxDType) -> int:
    return HEADER_SIZE + count * entry_size(level, embedding_dim, dtype)


# -- spans -----------------------------------------------------------------------------------------------
def span_of(level: int, index: int, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple:
    """The LOD0 tokens ``[start, stop)`` that entry ``index`` of ``level`` summarizes: token i at LOD0,
    tokens [K*i, K*i+K) for LOD1 gist i, tokens [K*K*j, K*K*j+K*K) for LOD2 gist j."""
    level = integer(level, "level")
    if level not in LEVELS:
        raise InvalidArgumentError(f"unknown level {level!r}; expected 0, 1 or 2")
    w = integer(block_size, "block_size") ** level
    i = integer(index, "index")
    return i * w, i * w + w


def children_of(level: int, index: int, block_size: int = DEFAULT_BLOCK_SIZE) -> range:
    """Entries of ``level - 1`` that entry ``index`` of ``level`` summarizes (LOD2 gist j covers LOD1
    gists 32j..32j+31, LOD1 gist i covers tokens 32i..32i+31)."""
    if integer(level, "level") not in (1, 2):
        raise InvalidArgumentError(f"only LOD1 and LOD2 entries have children, not level {level!r}")
    i, k = integer(index, "index"), integer(block_size, "block_size")
    return range(i * k, i * k + k)


def parent_of(level: int, index: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The entry of ``level + 1`` whose span holds entry ``index`` of ``level``."""
    if integer(level, "level") not in (0, 1):
        raise InvalidArgumentError(f"only LOD0 and LOD1 entries have parents, not level {level!r}")
    return integer(index, "index") // integer(block_size, "block_size")


# -- header ----------------------------------------------------------------------------------------------
def encode_model_name(name: str) -> bytes:
    """The header's char[32]: UTF-8, NUL-padded, cut at a character boundary to at most 31 bytes so that
    it stays NUL-terminated (metadata.json keeps the full name)."""
    raw = name.encode("utf-8")
    if len(raw) > MODEL_NAME_BYTES - 1:
        raw = raw[:MODEL_NAME_BYTES - 1].decode("utf-8", "ignore").encode("utf-8")
    return raw.ljust(MODEL_NAME_BYTES, b"\0")


def _decode_model_name(raw: bytes):
    """The name, or None when the bytes are not a NUL-padded printable UTF-8 string."""
    end = raw.find(b"\0")
    text, pad = (raw, b"") if end < 0 else (raw[:end], raw[end:])
    if pad.strip(b"\0"):
        return None
    try:
        s = text.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in s):
        return None
    return s


@dataclass(frozen=True)
class CtxHeader:
    level: int
    block_size: int
    embedding_dim: int
    dtype_code: int
    num_entries: int
    model_name: str = ""
    version: int = VERSION
    layout: str = "canonical"          # "canonical" or "legacy" (how it was read)
    magic_order: str = "canonical"     # "canonical" or "reversed"

    @property
    def dtype(self) -> CtxDType:
        return CTX_DTYPES[self.dtype_code]

    @property
    def entry_size(self) -> int:
        return entry_size(self.level, self.embedding_dim, self.dtype)

    def pack(self) -> bytes:
        """The canonical 64 bytes (the only layout mcf writes)."""
        return _CANONICAL.pack(MAGIC_BYTES, self.version, self.level, self.block_size, self.embedding_dim,
                               self.dtype_code, self.num_entries, encode_model_name(self.model_name),
                               b"\0" * 10)

    def pack_legacy(self, magic: bytes = MAGIC_BYTES) -> bytes:
        """Seed 001's layout (for tests and fixtures: files other tools may have written)."""
        return _LEGACY.pack(magic, self.version, self.level, self.block_size, self.embedding_dim,
                            self.dtype_code, encode_model_name(self.model_name), b"\0" * 18)

    def with_count(self, n: int) -> "CtxHeader":
        return replace(self, num_entries=n)


def parse_header(raw: bytes, size: int, *, path=None, expect_level=None, expect_count=None) -> CtxHeader:
    """Validate the 64 header bytes of a file of ``size`` bytes and tell the layouts apart.

    A canonical header is one whose reserved bytes 54..63 are zero, whose model name (22..53) is
    NUL-padded printable UTF-8 and whose count fits in the file.  A legacy header has zero bytes 46..63,
    a valid name at 14..45 and a data size that is a whole number of entries.  When both readings are
    possible (only a legacy file with an empty or one- or two-character name can look canonical), the
    count that equals ``expect_count`` (metadata.json's) decides, then the reading that fills the file
    exactly, then the canonical one.
    """
    if size < HEADER_SIZE or len(raw) < HEADER_SIZE:
        raise TruncatedError("file shorter than the 64-byte header", path=path, field="header", offset=0,
                             expected=f">= {HEADER_SIZE} bytes", got=f"{min(size, len(raw))} bytes")
    magic = raw[:4]
    if magic == MAGIC_BYTES:
        order = "canonical"
    elif magic == MAGIC_BYTES_REVERSED:
        order = "reversed"
    else:
        raise FormatError("not a MegaContext .ctx file (bad magic)", path=path, field="magic", offset=0,
                          expected=f"{MAGIC_BYTES.hex(' ')} (or {MAGIC_BYTES_REVERSED.hex(' ')})",
                          got=magic.hex(" "))
    _, version, level, block_size, dim, code, count, cname, cres = _CANONICAL.unpack(raw[:HEADER_SIZE])
    lname, lres = _LEGACY.unpack(raw[:HEADER_SIZE])[6:]
    if version != VERSION:
        raise UnsupportedVersionError("unsupported .ctx version", path=path, field="version", offset=4,
                                      expected=VERSION, got=version)
    if level not in LEVELS:
        raise FormatError("unknown level", path=path, field="level", offset=6, expected="0, 1 or 2",
                          got=level)
    if expect_level is not None and level != expect_level:
        raise FormatError("level does not match the file name", path=path, field="level", offset=6,
                          expected=expect_level, got=level)
    if block_size == 0:
        raise FormatError("block_size is 0", path=path, field="block_size", offset=8, expected=">= 1",
                          got=0)
    if dim == 0:
        raise FormatError("embedding_dim is 0", path=path, field="embedding_dim", offset=10, expected=">= 1",
                          got=0)
    if code not in CTX_DTYPES:
        raise FormatError("unknown dtype_code", path=path, field="dtype_code", offset=12,
                          expected="0 (uint32), 1 (fp16), 2 (bf16), 3 (fp32) or 4 (q8)", got=code)
    if level == 0 and code != 0:
        raise FormatError("LOD0 holds uint32 token ids", path=path, field="dtype_code", offset=12,
                          expected="0 (uint32)", got=code)
    if level > 0 and code not in GIST_DTYPE_CODES:
        raise FormatError("gist files hold floats", path=path, field="dtype_code", offset=12,
                          expected="1 (fp16), 2 (bf16), 3 (fp32) or 4 (q8)", got=code)
    esize = entry_size(level, dim, CTX_DTYPES[code])
    capacity = (size - HEADER_SIZE) // esize
    base = dict(level=level, block_size=block_size, embedding_dim=dim, dtype_code=code, version=version,
                magic_order=order)
    cands = []
    cname_s = _decode_model_name(cname)
    canonical_shape = not cres.strip(b"\0") and cname_s is not None
    if canonical_shape and count <= capacity:
        cands.append(CtxHeader(num_entries=count, model_name=cname_s, layout="canonical", **base))
    lname_s = _decode_model_name(lname)
    if not lres.strip(b"\0") and lname_s is not None and (size - HEADER_SIZE) % esize == 0:
        cands.append(CtxHeader(num_entries=capacity, model_name=lname_s, layout="legacy", **base))
    if not cands:
        if canonical_shape:
            raise TruncatedError("num_entries is larger than the file holds", path=path, field="num_entries",
                                 offset=COUNT_OFFSET, expected=f"<= {capacity} ({size} bytes)", got=count)
        if cname_s is None and not cres.strip(b"\0"):
            raise FormatError("model_name is not NUL-padded printable UTF-8", path=path, field="model_name",
                              offset=22, got=cname.hex(" "))
        raise FormatError("reserved bytes are not zero", path=path, field="reserved", offset=54,
                          expected="zeros", got=cres.hex(" "))
    if len(cands) == 1:
        return cands[0]
    for pick in ([c for c in cands if c.num_entries == expect_count] if expect_count is not None else [],
                 [c for c in cands if c.num_entries == capacity and (size - HEADER_SIZE) % esize == 0]):
        if pick:
            return pick[0]
    return cands[0]
