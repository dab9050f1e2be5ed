"""The MCF dtype table: the one place that knows every tensor dtype code, its name and its size.

Codes are those of the MCF spec and of the Go reference (``pkg/mcf/tensor_index.go``): plain dtypes
1..12, the quantization registry 0x10..0x33.  Quantized dtypes have no numpy equivalent; their payload
layout comes from :func:`mcf.container.layout.quant_layout`.

From 0x8000 on are mcf's own extensions (docs/mcf.md, "mcf extensions"): the element types and block
formats today's checkpoints ship in (FP8, E8M0, FP4; MXFP4, NVFP4, DeepSeek's block-scaled FP8).  The
reference implementation numbers its dtypes from 1 up in small groups, so a code this high cannot collide
with one it adds; a reader that does not know a code refuses the tensor (unknown dtype) rather than guess
its size.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from mcf.errors import InvalidArgumentError

__all__ = ["DType", "DTypeInfo", "dtype_info", "parse_dtype", "plain_nbytes", "PLAIN", "QUANTIZED", "EXTENSION_BASE"]

#: The first code of mcf's own dtypes (everything below is the MCF spec's).
EXTENSION_BASE = 0x8000


class DType(enum.IntEnum):
    F32 = 0x01
    F16 = 0x02
    BF16 = 0x03
    F64 = 0x04
    I8 = 0x05
    U8 = 0x06
    I16 = 0x07
    U16 = 0x08
    I32 = 0x09
    U32 = 0x0A
    I64 = 0x0B
    U64 = 0x0C
    INT8 = 0x10
    INT4 = 0x11
    Q8 = 0x20
    Q4 = 0x21
    K6 = 0x30
    K4 = 0x31
    K3 = 0x32
    K2 = 0x33
    # mcf extensions (docs/mcf.md): element types, one value per element
    F8_E4M3 = 0x8001       # float8_e4m3fn (OCP FP8)
    F8_E5M2 = 0x8002
    F8_E4M3FNUZ = 0x8003
    F8_E5M2FNUZ = 0x8004
    F8_E8M0 = 0x8005       # float8_e8m0fnu: the OCP MX scale
    F4 = 0x8006            # float4_e2m1fn, two per byte
    # mcf extensions: block-scaled weight formats (payloads with regions, like q*/k*)
    MXFP4 = 0x8010         # OCP MX: 32 E2M1 values per E8M0 scale (gpt-oss, GGUF MXFP4)
    NVFP4 = 0x8011         # NVIDIA ModelOpt: 16 E2M1 values per E4M3 scale, one float32 scale per tensor
    F8_E4M3_B128 = 0x8012  # DeepSeek-V3: E4M3 values, one float32 scale per 128 x 128 block


@dataclass(frozen=True)
class DTypeInfo:
    code: DType
    name: str            # lower-case user-facing name ("f32", "k4")
    family: str          # "float", "int", "raw" (int8/int4), "block" (q*), "super" (k*); extensions: "float8"
                         # (FP8 and E8M0 elements), "float4" (F4), "mxfp4", "nvfp4", "fp8block"
    itemsize: int        # bytes per element for plain dtypes, 0 for quantized ones and F4 (half a byte)
    bits: int            # bits per element (for quantized: bits per code)
    numpy: np.dtype | None  # storage dtype of a plain tensor (BF16 as uint16 bits, FP8 as uint8 bits)

    @property
    def quantized(self) -> bool:
        """A payload of regions (scales, codes) laid out by quant_layout, decoded by the kernels."""
        return self.family in _QUANTIZED_FAMILIES

    @property
    def extension(self) -> bool:
        """One of mcf's own dtypes (code 0x8000 and up), which other MCF readers do not know."""
        return self.code >= EXTENSION_BASE

    @property
    def scaled(self) -> bool:
        """A block-scaled extension format (mxfp4, nvfp4, f8_e4m3_b128): any rank from 2 for the E2M1
        formats, rows being every dimension but the last; no QuantInfo record (its method is one byte)."""
        return self.family in _SCALED_FAMILIES


def _p(code, name, family, np_dtype):
    dt = np.dtype(np_dtype).newbyteorder("<")
    return DTypeInfo(code, name, family, dt.itemsize, dt.itemsize * 8, dt)


def _q(code, name, family, bits):
    return DTypeInfo(code, name, family, 0, bits, None)


_SCALED_FAMILIES = frozenset({"mxfp4", "nvfp4", "fp8block"})
_QUANTIZED_FAMILIES = frozenset({"raw", "block", "super"}) | _SCALED_FAMILIES


_TABLE = [
    _p(DType.F32, "f32", "float", np.float32),
    _p(DType.F16, "f16", "float", np.float16),
    _p(DType.BF16, "bf16", "float", np.uint16),
    _p(DType.F64, "f64", "float", np.float64),
    _p(DType.I8, "i8", "int", np.int8),
    _p(DType.U8, "u8", "int", np.uint8),
    _p(DType.I16, "i16", "int", np.int16),
    _p(DType.U16, "u16", "int", np.uint16),
    _p(DType.I32, "i32", "int", np.int32),
    _p(DType.U32, "u32", "int", np.uint32),
    _p(DType.I64, "i64", "int", np.int64),
    _p(DType.U64, "u64", "int", np.uint64),
    _q(DType.INT8, "int8", "raw", 8),
    _q(DType.INT4, "int4", "raw", 4),
    _q(DType.Q8, "q8", "block", 8),
    _q(DType.Q4, "q4", "block", 4),
    _q(DType.K6, "k6", "super", 6),
    _q(DType.K4, "k4", "super", 4),
    _q(DType.K3, "k3", "super", 3),
    _q(DType.K2, "k2", "super", 2),
    _p(DType.F8_E4M3, "f8_e4m3", "float8", np.uint8),
    _p(DType.F8_E5M2, "f8_e5m2", "float8", np.uint8),
    _p(DType.F8_E4M3FNUZ, "f8_e4m3fnuz", "float8", np.uint8),
    _p(DType.F8_E5M2FNUZ, "f8_e5m2fnuz", "float8", np.uint8),
    _p(DType.F8_E8M0, "f8_e8m0", "float8", np.uint8),
    DTypeInfo(DType.F4, "f4", "float4", 0, 4, None),
    _q(DType.MXFP4, "mxfp4", "mxfp4", 4),
    _q(DType.NVFP4, "nvfp4", "nvfp4", 4),
    _q(DType.F8_E4M3_B128, "f8_e4m3_b128", "fp8block", 8),
]

_BY_CODE = {info.code: info for info in _TABLE}
_BY_NAME = {info.name: info for info in _TABLE}
# aliases users type: numpy names and the Go tool's upper-case names
_ALIASES = {
    "float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "half": "f16",
    "int8_t": "i8", "uint8": "u8", "int16": "i16", "uint16": "u16", "int32": "i32", "uint32": "u32",
    "int64": "i64", "uint64": "u64",
    # the extensions under their safetensors, torch and ml_dtypes names
    "float8_e4m3fn": "f8_e4m3", "f8_e4m3fn": "f8_e4m3", "float8_e5m2": "f8_e5m2", "float8_e4m3fnuz": "f8_e4m3fnuz",
    "float8_e5m2fnuz": "f8_e5m2fnuz", "float8_e8m0fnu": "f8_e8m0", "float4_e2m1fn": "f4", "f4_e2m1": "f4",
}
#: ml_dtypes' numpy types of the extension element types (all but F4, which numpy cannot hold packed)
_ML_DTYPES = {"float8_e4m3fn": DType.F8_E4M3, "float8_e5m2": DType.F8_E5M2, "float8_e4m3fnuz": DType.F8_E4M3FNUZ,
              "float8_e5m2fnuz": DType.F8_E5M2FNUZ, "float8_e8m0fnu": DType.F8_E8M0}

PLAIN = frozenset(info.code for info in _TABLE if not info.quantized)
QUANTIZED = frozenset(info.code for info in _TABLE if info.quantized)


def dtype_info(code: int) -> DTypeInfo:
    """Look up a dtype by its on-disk code; ``KeyError`` if unknown (callers turn it into a
    FormatError with the file context)."""
    return _BY_CODE[code]


def is_known(code: int) -> bool:
    return code in _BY_CODE


def parse_dtype(value) -> DTypeInfo:
    """Accept a DType, a code, a name ("f16", "K4", "bfloat16") or a numpy dtype."""
    if isinstance(value, DTypeInfo):
        return value
    if isinstance(value, (int, DType)) and not isinstance(value, bool):
        try:
            return _BY_CODE[value]
        except KeyError:
            raise InvalidArgumentError(f"unknown MCF dtype code {value!r}") from None
    if isinstance(value, str):
        key = value.strip().lower()
        key = _ALIASES.get(key, key)
        if key in _BY_NAME:
            return _BY_NAME[key]
        raise InvalidArgumentError(f"unknown MCF dtype {value!r}; expected one of {sorted(_BY_NAME)}")
    try:
        npdt = np.dtype(value)
    except TypeError:
        raise InvalidArgumentError(f"cannot interpret {value!r} as an MCF dtype") from None
    return from_numpy(npdt)


def from_numpy(npdt: np.dtype) -> DTypeInfo:
    """The MCF dtype storing a numpy dtype (``ml_dtypes.bfloat16`` maps to BF16)."""
    if npdt.name == "bfloat16":
        return _BY_CODE[DType.BF16]
    if npdt.name in _ML_DTYPES:
        return _BY_CODE[_ML_DTYPES[npdt.name]]
    if npdt.byteorder == ">":
        raise InvalidArgumentError(f"MCF stores little-endian data; {npdt} is big-endian (convert it with "
                                   "a.astype(a.dtype.newbyteorder('<')))")
    for info in _TABLE:
        if info.numpy is not None and info.family in ("float", "int") and info.code != DType.BF16 \
                and info.numpy == npdt.newbyteorder("<"):
            return info
    raise InvalidArgumentError(f"numpy dtype {npdt} has no MCF equivalent")


def plain_nbytes(info: DTypeInfo, numel: int) -> int | None:
    """Bytes of ``numel`` elements of the plain dtype ``info``: F4 packs two per byte and needs an even
    count (None otherwise, as safetensors refuses a tensor that does not fill whole bytes)."""
    if info.family == "float4":
        return None if numel % 2 else numel // 2
    return numel * info.itemsize
