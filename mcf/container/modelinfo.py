"""The ModelInfo section (0x0001): architecture numbers, names and a typed key/value table.

Layout (v1, little-endian, offsets relative to the section start), as the Go reference writes it:

    u32 version=1 | u32 flags=0 | u32 arch | u32 pad
    u32 vocab, hidden, layers, heads, heads_kv, ctx, train_ctx, rope_type
    f32 rope_freq_base | f32 rope_scale
    u64 model_name_off | u64 base_model_off | u32 kv_count | u32 pad | u64 kv_off      (88 bytes)
    blobs, each 8-aligned: strings as ``u32 len + bytes`` zero-padded to 8; u32/f32 values in 8-byte
    slots; offset 0 means "absent"
    kv table, 8-aligned: ``u64 key_off | u32 type (1 u32, 2 f32, 3 string) | u32 pad | u64 value_off``,
    keys sorted bytewise

Blobs are appended in the order name, base model, then key, value, key, value... of the sorted
extras, which is what makes our bytes equal the Go packer's.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, field

import numpy as np

from mcf.errors import FormatError, InvalidArgumentError, TruncatedError, UnsupportedVersionError

__all__ = ["ModelInfo", "Arch", "RopeType", "encode_model_info", "decode_model_info"]

_FIXED = struct.Struct("<IIII8I2fQQIIQ")
assert _FIXED.size == 88
_KV = struct.Struct("<QIIQ")
KV_U32, KV_F32, KV_STRING = 1, 2, 3
VERSION = 1


class Arch(enum.IntEnum):
    UNKNOWN = 0
    LLAMA = 1
    MISTRAL = 2
    QWEN = 3
    GEMMA = 4
    GRANITE = 5
    SMOLLM3 = 6


class RopeType(enum.IntEnum):
    NONE = 0
    STANDARD = 1
    LINEAR = 2
    YARN = 3


def _enum_or_int(cls, v):
    try:
        return cls(v)
    except ValueError:
        return int(v)


@dataclass
class ModelInfo:
    """Descriptive model numbers.  Runtimes should not gate behaviour on these (the spec says so);
    they are for display, quick checks and tools.  ``extras`` values are ``int`` (stored as u32),
    ``float`` (f32) or ``str``; ``bytes`` values are kept as raw string blobs."""

    model_name: str = ""
    base_model: str = ""
    arch: int = Arch.UNKNOWN
    vocab_size: int = 0
    hidden_size: int = 0
    layer_count: int = 0
    head_count: int = 0
    head_count_kv: int = 0
    context_length: int = 0
    train_context: int = 0
    rope_type: int = RopeType.NONE
    rope_freq_base: float = 0.0
    rope_scale: float = 0.0
    extras: dict = field(default_factory=dict)

    @classmethod
    def from_hf_config(cls, config: dict, *, model_name: str = "") -> "ModelInfo":
        """Fill the fields from a Hugging Face ``config.json`` exactly as the Go packer does.

        Only ``model_type`` (architecture guess by substring), the six size fields and ``rope_theta``
        are read; ``rope_scaling`` is recorded as present, not interpreted.  Values the Go JSON decoder
        would not see as numbers (strings, booleans, out-of-range) become 0.
        """
        mi = cls(model_name=model_name)
        mt = config.get("model_type")
        if isinstance(mt, str):
            low = mt.lower()
            if "llama" in low:
                mi.arch = Arch.LLAMA
            elif "mistral" in low:
                mi.arch = Arch.MISTRAL
            elif "qwen" in low:
                mi.arch = Arch.QWEN
            elif "gemma" in low:
                mi.arch = Arch.GEMMA
            else:
                mi.arch = Arch.UNKNOWN
            mi.extras["hf.model_type"] = mt
        mi.vocab_size = _hf_u32(config, "vocab_size")
        mi.hidden_size = _hf_u32(config, "hidden_size")
        mi.layer_count = _hf_u32(config, "num_hidden_layers")
        mi.head_count = _hf_u32(config, "num_attention_heads")
        mi.head_count_kv = _hf_u32(config, "num_key_value_heads")
        mi.context_length = _hf_u32(config, "max_position_embeddings")
        rs = config.get("rope_scaling")
        if isinstance(rs, dict) and rs:
            mi.extras["hf.rope_scaling"] = "present"
        theta = config.get("rope_theta")
        if _is_number(theta) and math.isfinite(theta) and abs(theta) <= float(np.finfo(np.float32).max):
            mi.rope_freq_base = float(np.float32(theta))
        mi.extras["hf.config_json_present"] = 1
        return mi

    def to_bytes(self) -> bytes:
        return encode_model_info(self)

    @classmethod
    def from_bytes(cls, data, *, path=None, base_offset: int = 0) -> "ModelInfo":
        return decode_model_info(data, path=path, base_offset=base_offset)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["arch"] = Arch(self.arch).name.lower() if self.arch in Arch._value2member_map_ else int(self.arch)
        d["rope_type"] = (RopeType(self.rope_type).name.lower()
                          if self.rope_type in RopeType._value2member_map_ else int(self.rope_type))
        d["extras"] = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in self.extras.items()}
        return d


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _hf_u32(config: dict, key: str) -> int:
    v = config.get(key)
    if not _is_number(v):
        return 0
    v = float(v)  # Go decodes JSON numbers as float64
    if not (0 <= v <= 0xFFFFFFFF):
        return 0
    return int(v)


class _Blobs:
    def __init__(self, reserve: int):
        self.buf = bytearray(reserve)

    def _align(self):
        self.buf += b"\0" * (-len(self.buf) % 8)

    def add_bytes(self, b: bytes) -> int:
        if len(b) > 0xFFFFFFFF:
            raise InvalidArgumentError("ModelInfo string longer than 4 GiB")
        self._align()
        off = len(self.buf)
        self.buf += struct.pack("<I", len(b)) + b
        self._align()
        return off

    def add_string(self, s: str) -> int:
        return self.add_bytes(s.encode("utf-8")) if s else 0

    def add_scalar(self, fmt: str, v) -> int:
        self._align()
        off = len(self.buf)
        self.buf += struct.pack(fmt, v)
        self._align()
        return off


def encode_model_info(mi: ModelInfo) -> bytes:
    """Encode ``mi`` byte-for-byte as the Go reference's ``EncodeModelInfo``."""
    b = _Blobs(_FIXED.size)  # the fixed part, patched in at the end once the offsets are known
    name_off = b.add_string(mi.model_name)
    base_off = b.add_string(mi.base_model)
    kvs = []
    for key in sorted(mi.extras, key=lambda k: k.encode("utf-8")):
        if not isinstance(key, str) or key == "":
            raise InvalidArgumentError(f"ModelInfo extras keys must be non-empty strings, got {key!r}")
        v = mi.extras[key]
        if v is None:
            continue
        key_off = b.add_string(key)
        if isinstance(v, bool):
            raise InvalidArgumentError(f"ModelInfo extras[{key!r}]: booleans are not storable")
        if isinstance(v, str):
            kvs.append((key_off, KV_STRING, b.add_bytes(v.encode("utf-8"))))
        elif isinstance(v, (bytes, bytearray)):
            kvs.append((key_off, KV_STRING, b.add_bytes(bytes(v))))
        elif isinstance(v, (int, np.integer)):
            if not 0 <= int(v) <= 0xFFFFFFFF:
                raise InvalidArgumentError(f"ModelInfo extras[{key!r}] = {v} is outside uint32")
            kvs.append((key_off, KV_U32, b.add_scalar("<I", int(v))))
        elif isinstance(v, (float, np.floating)):
            fv = float(v)
            if not math.isfinite(fv) or abs(fv) > float(np.finfo(np.float32).max):
                raise InvalidArgumentError(f"ModelInfo extras[{key!r}] = {v} is not a finite float32")
            kvs.append((key_off, KV_F32, b.add_scalar("<f", fv)))
        else:
            raise InvalidArgumentError(
                f"ModelInfo extras[{key!r}] has unsupported type {type(v).__name__}")
    b._align()
    kv_off = len(b.buf)
    for key_off, typ, val_off in kvs:
        b.buf += _KV.pack(key_off, typ, 0, val_off)
    for name in ("vocab_size", "hidden_size", "layer_count", "head_count", "head_count_kv",
                 "context_length", "train_context", "rope_type", "arch"):
        v = int(getattr(mi, name))
        if not 0 <= v <= 0xFFFFFFFF:
            raise InvalidArgumentError(f"ModelInfo.{name} = {v} is outside uint32")
    for name in ("rope_freq_base", "rope_scale"):
        v = float(getattr(mi, name))
        if math.isfinite(v) and abs(v) > float(np.finfo(np.float32).max):
            raise InvalidArgumentError(f"ModelInfo.{name} = {v} is outside the float32 range")
    fixed = _FIXED.pack(
        VERSION, 0, int(mi.arch), 0,
        int(mi.vocab_size), int(mi.hidden_size), int(mi.layer_count), int(mi.head_count),
        int(mi.head_count_kv), int(mi.context_length), int(mi.train_context), int(mi.rope_type),
        float(mi.rope_freq_base), float(mi.rope_scale),
        name_off, base_off, len(kvs), 0, kv_off,
    )
    b.buf[0:88] = fixed
    return bytes(b.buf)


def decode_model_info(data, *, path=None, base_offset: int = 0) -> ModelInfo:
    """Decode a ModelInfo payload, checking every offset against the payload size.

    ``base_offset`` (the section's file offset) only serves error messages."""
    data = bytes(data)
    n = len(data)

    def err(cls, reason, field, off, **kw):
        return cls(reason, path=path, field=f"ModelInfo.{field}", offset=base_offset + off, **kw)

    if n < _FIXED.size:
        raise err(TruncatedError, "section too small", "header", 0, expected=f">= {_FIXED.size} bytes",
                  got=f"{n} bytes")
    (version, flags, arch, _pad, vocab, hidden, layers, heads, heads_kv, ctx, train_ctx, rope_type,
     rope_base, rope_scale, name_off, base_off, kv_count, _pad2, kv_off) = _FIXED.unpack_from(data, 0)
    if version != VERSION:
        raise err(UnsupportedVersionError, "unsupported version", "version", 0, expected=VERSION, got=version)
    if flags != 0:
        raise err(FormatError, "unknown flags", "flags", 4, expected=0, got=hex(flags))

    def read_blob(off, what, at):
        if off == 0:
            return b""
        if off > n - 4:
            raise err(TruncatedError, f"{what} offset outside the section", what, at,
                      expected=f"<= {n - 4}", got=off)
        (ln,) = struct.unpack_from("<I", data, off)
        if ln > n - off - 4:
            raise err(TruncatedError, f"{what} runs past the section", what, off,
                      expected=f"length <= {n - off - 4}", got=ln)
        return data[off + 4: off + 4 + ln]

    def text(b):
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return b

    mi = ModelInfo(
        model_name=text(read_blob(name_off, "model_name", 56)),
        base_model=text(read_blob(base_off, "base_model", 64)),
        arch=_enum_or_int(Arch, arch), vocab_size=vocab, hidden_size=hidden, layer_count=layers,
        head_count=heads, head_count_kv=heads_kv, context_length=ctx, train_context=train_ctx,
        rope_type=_enum_or_int(RopeType, rope_type), rope_freq_base=rope_base, rope_scale=rope_scale,
    )
    if kv_count:
        if kv_off == 0 or kv_off > n or kv_count > (n - kv_off) // _KV.size:
            raise err(TruncatedError, "key/value table outside the section", "kv_off", 80,
                      expected=f"{kv_count} entries of {_KV.size} bytes inside {n} bytes", got=kv_off)
        for i in range(kv_count):
            at = kv_off + i * _KV.size
            key_off, typ, _p, val_off = _KV.unpack_from(data, at)
            key = text(read_blob(key_off, f"kv[{i}].key", at))
            if not key:
                raise err(FormatError, "empty key", f"kv[{i}].key", at)
            if typ == KV_U32 or typ == KV_F32:
                if val_off == 0 or val_off > n - 4:
                    raise err(TruncatedError, "value outside the section", f"kv[{i}].value", at + 16,
                              expected=f"<= {n - 4}", got=val_off)
                val = struct.unpack_from("<I" if typ == KV_U32 else "<f", data, val_off)[0]
            elif typ == KV_STRING:
                val = text(read_blob(val_off, f"kv[{i}].value", at + 16))
            else:
                raise err(FormatError, "unknown value type", f"kv[{i}].type", at + 8,
                          expected="1 (u32), 2 (f32) or 3 (string)", got=typ)
            mi.extras[key if isinstance(key, str) else key.decode("latin-1")] = val
    return mi
