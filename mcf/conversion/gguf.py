"""GGUF to MCF: :func:`convert_gguf` and the model description taken from a GGUF file's metadata.

The converter sits above the reader (:mod:`mcf.gguf.reader`) and the quantization policy
(:mod:`mcf.conversion.quant_policy`); the reader never imports it, so reading a GGUF file (as
:mod:`mcf.conversion.imatrix` does) does not pull in the MCF writer.  See docs/gguf.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from mcf.errors import DTypeError, InvalidArgumentError, MCFError, in_tensor
from mcf.gguf.reader import GGUF_METADATA_SECTION, SUPPORTED_TYPES, GGUFFile, GGUFTensor, open

__all__ = ["ConvertStats", "convert_gguf", "metadata_json", "model_info"]


_CHUNK = 1 << 20           # bytes per streamed chunk (1 MiB stays in the caches: measured faster than 16 MiB)
_NATIVE = {"Q8_0": "q8", "Q4_0": "q4"}
_MXFP4_BLOCK = 17          # ggml's block_mxfp4: one E8M0 byte, then 16 bytes of 32 E2M1 codes


@dataclass(frozen=True)
class ConvertStats:
    """What :func:`convert_gguf` did with one tensor.  ``how`` is ``"copy"`` (bytes as they are),
    ``"cast"`` (float to another float dtype), ``"decode"`` (ggml blocks to float), ``"native"``
    (Q8_0/Q4_0 re-laid out as MCF q8/q4 without loss) or ``"quantize"`` (to ``stored_as``).

    With ``report=True``, a quantized tensor also carries the error the requantization added: RMSE,
    SNR in dB and max |error| of MCF's decoded values against the GGUF tensor's own decoded values (the
    loss of the GGUF quantization itself is not included: the original weights are not in the file).
    None for the other tensors, which are stored without loss."""

    name: str
    ggml_type: str
    stored_as: str
    how: str
    shape: tuple
    nbytes_in: int
    nbytes_out: int
    rmse: float | None = None
    snr_db: float | None = None
    max_abs_err: float | None = None


_ARCH_WORDS = (("llama", "LLAMA"), ("mistral", "MISTRAL"), ("qwen", "QWEN"), ("gemma", "GEMMA"),
               ("granite", "GRANITE"), ("smollm3", "SMOLLM3"))


def model_info(g: GGUFFile):
    """A :class:`mcf.ModelInfo` from the GGUF keys llama.cpp writes (``general.architecture``,
    ``general.name``, ``<arch>.block_count``, ``.embedding_length``, ``.attention.head_count(_kv)``,
    ``.context_length``, ``.rope.freq_base``, ``.rope.scaling.*``; vocabulary size from
    ``tokenizer.ggml.tokens``).  Missing or odd-typed values become 0, as the HF path does."""
    from mcf.container.modelinfo import Arch, ModelInfo, RopeType

    md = g.metadata

    def u32(key):
        v = md.get(key)
        if isinstance(v, np.ndarray) and v.size and v.dtype.kind in "iu":  # per-layer values
            v = int(v.max())
        if isinstance(v, bool) or not isinstance(v, int):
            return 0
        return v if 0 <= v < 2 ** 32 else 0

    def f32(key):
        v = md.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or abs(v) > float(np.finfo(np.float32).max):
            return 0.0
        return float(np.float32(v))

    arch = md.get("general.architecture")
    arch = arch if isinstance(arch, str) else ""
    name = md.get("general.name")
    mi = ModelInfo(model_name=name if isinstance(name, str) else "")
    base = md.get("general.basename")
    if isinstance(base, str):
        mi.base_model = base
    low = arch.lower()
    mi.arch = Arch.UNKNOWN
    for word, member in _ARCH_WORDS:
        if word in low:
            mi.arch = Arch[member]
            break
    p = arch + "."
    tokens = md.get("tokenizer.ggml.tokens")
    mi.vocab_size = len(tokens) if isinstance(tokens, list) and len(tokens) < 2 ** 32 else u32(p + "vocab_size")
    mi.hidden_size = u32(p + "embedding_length")
    mi.layer_count = u32(p + "block_count")
    mi.head_count = u32(p + "attention.head_count")
    mi.head_count_kv = u32(p + "attention.head_count_kv")
    mi.context_length = u32(p + "context_length")
    mi.train_context = u32(p + "rope.scaling.original_context_length")
    mi.rope_freq_base = f32(p + "rope.freq_base")
    mi.rope_scale = f32(p + "rope.scaling.factor")
    st = md.get(p + "rope.scaling.type")
    if st == "linear":
        mi.rope_type = RopeType.LINEAR
    elif st == "yarn":
        mi.rope_type = RopeType.YARN
    elif p + "rope.freq_base" in md or p + "rope.dimension_count" in md:
        mi.rope_type = RopeType.STANDARD
    if arch:
        mi.extras["gguf.architecture"] = arch
    mi.extras["gguf.version"] = g.version
    ft = md.get("general.file_type")
    if isinstance(ft, int) and not isinstance(ft, bool) and 0 <= ft < 2 ** 32:
        mi.extras["gguf.file_type"] = ft
    return mi


def _jsonable(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, bytes):
        return {"bytes_hex": v.hex()}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def metadata_json(g: GGUFFile) -> bytes:
    """The whole GGUF header as JSON (what :func:`convert_gguf` stores in section 0x0200): version,
    alignment, every key with its value and value type, and each tensor's ggml type and dims.
    Strings that are not UTF-8 appear as ``{"bytes_hex": ...}``; non-finite floats as JSON's
    ``NaN``/``Infinity`` extension (Python's json reads them)."""
    doc = {
        "format": "gguf",
        "version": g.version,
        "alignment": g.alignment,
        "metadata": {k: _jsonable(v) for k, v in g.metadata.items()},
        "value_types": {k: (list(t) if isinstance(t, tuple) else t) for k, t in g.value_types.items()},
        "tensors": [{"name": t.name, "ggml_type": t.type.name, "dims": list(t.dims)} for t in g.tensors.values()],
    }
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class _Reader:
    """Chunks of a tensor's bytes in file order, without keeping them: mapped pages are dropped with
    MADV_DONTNEED once used, positional reads go into one reused aligned buffer."""

    def __init__(self, g: GGUFFile):
        from mcf.io import aligned_empty

        self.src = g.source
        self.mapped = self.src.mode in ("mmap", "memory")
        self.buf = None if self.mapped else aligned_empty(_CHUNK + 4096)
        self._last = None

    def read(self, off: int, n: int) -> np.ndarray:
        self.release()
        if self.mapped:
            v = self.src.view(off, n)
            self._last = (off, n)
            return v
        if n > self.buf.size:
            from mcf.io import aligned_empty

            self.buf = aligned_empty(n)
        self.src.readinto(off, self.buf[:n])
        return self.buf[:n]

    def release(self):
        if self._last is not None and self.src.mode == "mmap":
            self.src.advise("dontneed", *self._last)
        self._last = None


def _block_chunks(t: GGUFTensor, out_itemsize: int):
    """(first block, block count) pieces of a tensor, each giving about _CHUNK bytes of output."""
    nb = t.nbytes // t.type.size if t.type.size else 0
    per = max(1, _CHUNK // max(1, t.type.block * out_itemsize))
    for b in range(0, nb, per):
        yield b, min(per, nb - b)


def _float_target(t: GGUFTensor, dtype: str):
    from mcf._core.dtypes import parse_dtype

    if dtype == "keep":
        own = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F64": "f64"}.get(t.type.name, "f32")
        return parse_dtype(own)
    return parse_dtype(dtype)


def convert_gguf(src, dst, *, method=None, overrides=(), compat=False, dtype="keep", progress=None,
                 mmap: bool = False, threads: int = 1, durable: bool = True, fast: bool = False,
                 imatrix=None, report: bool = False) -> list:
    """Convert a GGUF file to MCF, one tensor at a time (peak memory near one tensor).

    - ``dtype="keep"``: F32/F16/BF16/F64 tensors are stored as they are; quantized ggml types are
      decoded to float32.  ``"f32"``/``"f16"``/``"bf16"`` casts every float tensor (decoded ones too).
    - ``method`` (``"q8"``, ``"q4"``, ``"k6"``, ``"k4"``, ``"k3"``, ``"k2"``, ``"int8"``, ``"int4"``)
      requantizes every rank-2 tensor to an MCF method as :func:`mcf.conversion.quant_policy.quantize_file` does (the
      ggml blocks are decoded to float32 first); ``overrides`` (``["*.ffn_down.*=q8", "output.*=none"]``)
      choose per tensor name, first match wins, ``compat``, ``fast`` and ``imatrix`` (None, a file, or a mapping
      name -> importance; llama.cpp's importance matrices use GGUF names, and Hugging Face names are matched too) as
      in ``mcf quantize`` (:func:`mcf.conversion.quant_policy.resolve_imatrix`).
    - ``report=True``: each requantized tensor's :class:`ConvertStats` carries the error the MCF method
      added (RMSE, SNR, max |error| against the tensor's decoded GGUF values), as ``mcf convert --report``
      prints it.
    - MXFP4 tensors (type 39, gpt-oss) become MCF mxfp4 with the same values, their bytes re-laid out, unless
      ``method`` requantizes them or ``dtype`` asks for floats (an E8M0 scale of 0xFF, which ggml reads as
      2^128 and MCF as NaN, is refused; the code ggml reads as +0 and E2M1 as -0 is stored as +0).
    - ``method="native"``: Q8_0 and Q4_0 tensors of rank 2 become MCF q8 / q4 without any loss (the
      two formats compute ``w = d * q`` identically; only the byte layout changes); a tensor with a
      subnormal, infinite or NaN block scale (which MCF's decoder would flush) is decoded to float32
      instead, also without loss.  Other types are decoded as with ``method=None``.

    Tensor names are kept as GGUF has them and shapes are row-major (GGUF's dims reversed); no
    llama.cpp -> Hugging Face renaming or Q/K un-permuting is done.  ModelInfo is filled from the GGUF
    keys and the full metadata is kept as JSON in section 0x0200 (:data:`GGUF_METADATA_SECTION`).
    ``mmap=False`` (the default) reads with positional reads into one reused buffer, so the resident
    memory stays flat whatever the file size.  ``durable=False`` publishes the output without fsync
    (see :class:`mcf.Writer`).  Returns a :class:`ConvertStats` per tensor.
    """
    from mcf._core.dtypes import parse_dtype
    from mcf.container.quant import METHODS, quantize
    from mcf.conversion.quant_policy import importance_for, method_for, parse_overrides, resolve_imatrix
    from mcf.container.writer import Writer, cast_chunk

    if method is not None and method != "native" and method not in METHODS:
        raise InvalidArgumentError(f"unknown method {method!r}; expected one of {METHODS + ('native',)}")
    if dtype != "keep":
        try:
            info = parse_dtype(dtype)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if info.family != "float":
            raise InvalidArgumentError(f"dtype must be 'keep', 'f32', 'f16', 'bf16' or 'f64', got {dtype!r}")
        dtype = info.name
    ov = parse_overrides(overrides)
    stats = []
    g = open(src, mmap=mmap)
    try:
        for t in g.tensors.values():  # refuse before writing anything
            if t.type.kind == "unsupported" and t.type.name != "MXFP4":
                raise DTypeError(f"{g.path}: tensor {t.name!r} has ggml type {t.type.name}, which mcf cannot "
                                 f"decode (supported: {', '.join(SUPPORTED_TYPES)}, I8..I64)")
        imatrix = resolve_imatrix(imatrix, [(t.name, _requantized(t, method_for(t.name, method, ov)))
                                            for t in g.tensors.values()])
        rd = _Reader(g)
        with Writer(dst, align=64, durable=durable) as w:  # durable: see mcf.Writer
            w.add_model_info(model_info(g))
            w.add_section(GGUF_METADATA_SECTION, metadata_json(g))
            names = list(g.tensors)
            for i, name in enumerate(names):
                t = g.tensors[name]
                m = method_for(name, method, ov)
                imp = importance_for(imatrix, name, m) if _requantized(t, m) else None
                try:
                    stats.append(_convert_one(g, w, rd, t, m, compat, dtype, threads, quantize, cast_chunk, fast,
                                              imp, report))
                except MCFError as exc:  # name the file and the tensor, whatever failed
                    raise in_tensor(exc, g.path, name) from exc
                rd.release()
                if progress is not None:
                    progress(i + 1, len(names), name)
    finally:
        g.close()
    return stats


def _requantized(t: GGUFTensor, m) -> str | None:
    """The MCF method tensor ``t`` is quantized with under method ``m`` (what :func:`_convert_one` does), or None:
    "native" reuses ggml blocks, integer tensors are copied, only rank-2 tensors are quantized."""
    return m if m not in (None, "native") and t.type.kind != "int" and len(t.shape) == 2 else None


def _stream_copy(rd: _Reader, t: GGUFTensor):
    for off in range(0, t.nbytes, _CHUNK):
        yield rd.read(t.offset + off, min(_CHUNK, t.nbytes - off))


def _stream_decode(g: GGUFFile, rd: _Reader, t: GGUFTensor, out_dt, threads):
    from mcf.gguf import _gguf

    buf = np.empty(min(t.n_elements, _CHUNK // out_dt.itemsize + t.type.block), dtype=out_dt)
    for b0, n in _block_chunks(t, out_dt.itemsize):
        raw = rd.read(t.offset + b0 * t.type.size, n * t.type.size)
        o = buf[:n * t.type.block]
        _gguf.dequantize_blocks(raw, t.type.code, n, o, threads=threads)
        yield o


def _stream_cast(rd: _Reader, t: GGUFTensor, src_info, dst_info, cast):
    step = max(1, _CHUNK // src_info.itemsize)
    for e in range(0, t.n_elements, step):
        n = min(step, t.n_elements - e)
        raw = rd.read(t.offset + e * src_info.itemsize, n * src_info.itemsize).view(src_info.numpy)
        yield cast(raw, src_info, dst_info)


def _decode_all_f32(g: GGUFFile, rd: _Reader, t: GGUFTensor, threads) -> np.ndarray:
    out = np.empty(t.shape, dtype=np.float32)
    flat = out.reshape(-1)
    pos = 0
    for chunk in _stream_decode(g, rd, t, np.dtype(np.float32), threads):
        flat[pos:pos + chunk.size] = chunk
        pos += chunk.size
    return out


def _convert_one(g, w, rd, t: GGUFTensor, m, compat, dtype, threads, quantize, cast, fast=False, importance=None,
                 report=False):
    from mcf._core.dtypes import parse_dtype

    tn = t.type.name
    if tn == "MXFP4" and dtype == "keep" and len(t.shape) >= 2 and (m in (None, "native") or len(t.shape) > 2):
        # kept as MCF mxfp4 (an expert stack of rank 3 too, which q*/k* could not hold); a float dtype, a
        # requantized matrix and a vector (mxfp4 is rows of blocks) go the way of every other block type below
        return _convert_mxfp4(g, w, rd, t)
    if t.type.kind == "int":
        info = parse_dtype(tn.lower())
        w.add_tensor_bytes(t.name, info, t.shape, _stream_copy(rd, t))
        return ConvertStats(t.name, tn, info.name, "copy", t.shape, t.nbytes, t.nbytes)
    rank2 = len(t.shape) == 2
    if m == "native" and tn in _NATIVE and rank2:
        st = _native(g, w, rd, t)
        if st is not None:
            return st
        arr = _decode_all_f32(g, rd, t, threads)  # flushed scales: keep the exact float32 values
        w.add_tensor_bytes(t.name, "f32", t.shape, arr)
        return ConvertStats(t.name, tn, "f32", "decode", t.shape, t.nbytes, arr.nbytes)
    if m is not None and m != "native" and rank2:
        if t.type.kind == "quant":
            arr, sd = _decode_all_f32(g, rd, t, threads), "f32"
        else:
            sd = {"F32": "f32", "F16": "f16", "BF16": "bf16", "F64": "f64"}[tn]
            arr = rd.read(t.offset, t.nbytes).view(t.type.numpy).reshape(t.shape)
            if not rd.mapped:
                arr = arr.copy()  # the reader's buffer is reused
        try:
            payload, q = quantize(arr, m, compat=compat, fast=fast, importance=importance, src_dtype=sd,
                                  threads=threads)
        except InvalidArgumentError as exc:
            if importance is None:
                raise
            raise InvalidArgumentError(f"{g.path}: tensor {t.name!r}: {exc}") from None
        err = _requantization_error(arr, sd, payload, m, t.shape) if report else (None, None, None)
        del arr
        w.add_tensor_bytes(t.name, m, t.shape, payload, quant=q)
        return ConvertStats(t.name, tn, m, "quantize", t.shape, t.nbytes, payload.nbytes, *err)
    target = _float_target(t, dtype)
    if t.type.kind == "float":
        src_info = parse_dtype({"F32": "f32", "F16": "f16", "BF16": "bf16", "F64": "f64"}[tn])
        if src_info.code == target.code:
            w.add_tensor_bytes(t.name, target, t.shape, _stream_copy(rd, t))
            return ConvertStats(t.name, tn, target.name, "copy", t.shape, t.nbytes, t.nbytes)
        w.add_tensor_bytes(t.name, target, t.shape, _stream_cast(rd, t, src_info, target, cast))
        return ConvertStats(t.name, tn, target.name, "cast", t.shape, t.nbytes, t.n_elements * target.itemsize)
    if target.name == "f64":
        target = parse_dtype("f32")
    out_dt = np.dtype(np.float32) if target.name == "f32" else np.dtype(np.float16 if target.name == "f16"
                                                                        else np.uint16)
    w.add_tensor_bytes(t.name, target, t.shape, _stream_decode(g, rd, t, out_dt, threads))
    return ConvertStats(t.name, tn, target.name, "decode", t.shape, t.nbytes, t.n_elements * target.itemsize)


def _requantization_error(arr, src_dtype: str, payload, method: str, shape) -> tuple:
    """(RMSE, SNR dB, max |error|) of MCF's decode of ``payload`` against the values it was made from."""
    from mcf._core.dtypes import parse_dtype
    from mcf.container.quant import dequantize, rows_f32, tensor_error_stats

    ref = rows_f32(np.asarray(arr), 0, shape[0], parse_dtype(src_dtype))
    return tensor_error_stats(ref, dequantize(payload, method, shape))


def _native(g, w, rd, t: GGUFTensor):
    """Q8_0 / Q4_0 -> MCF q8 / q4, streamed: the scales (1/17 or 1/9 of the tensor) are gathered
    first, then the codes chunk by chunk.  None if a scale would be flushed by MCF's decoder."""
    from mcf.gguf import _gguf
    from mcf.container.layout import quant_layout

    meth = _NATIVE[t.type.name]
    rows, cols = t.shape
    lay = quant_layout(meth, (rows, cols))
    nb = rows * lay.blocks_per_row
    assert nb * t.type.size == t.nbytes
    scales = np.empty(nb, dtype=np.uint16)
    bad = 0
    per = max(1, _CHUNK // t.type.size)
    for b0 in range(0, nb, per):
        n = min(per, nb - b0)
        bad += _gguf.relayout_scales(rd.read(t.offset + b0 * t.type.size, n * t.type.size), t.type.code, n,
                                     scales[b0:b0 + n])
    rd.release()
    if bad:
        return None
    cb = 32 if meth == "q8" else 16
    data_off = lay.region("data").offset

    def gen():
        yield scales.view(np.uint8)
        yield np.zeros(data_off - 2 * nb, dtype=np.uint8)
        codes = np.empty(per * cb, dtype=np.uint8)
        for b0 in range(0, nb, per):
            n = min(per, nb - b0)
            _gguf.relayout_codes(rd.read(t.offset + b0 * t.type.size, n * t.type.size), t.type.code, n, codes)
            yield codes[:n * cb]

    w.add_tensor_bytes(t.name, meth, t.shape, gen())
    return ConvertStats(t.name, t.type.name, meth, "native", t.shape, t.nbytes, lay.nbytes)


def _mxfp4_codes(blocks: np.ndarray) -> np.ndarray:
    """The codes of ggml MXFP4 blocks (``[n, 17]``: E8M0, then byte j holding element j in its low nibble and
    element j + 16 in its high one, as ggml's dequantize_row_mxfp4 reads them) in the order of OCP MX and of
    MCF's mxfp4: byte k holding element 2k (low nibble) and 2k + 1 (high); ``[n, 16]``.  ggml's table reads
    code 0b1000 as +0 where E2M1 has -0: it becomes code 0, so every value, the sign of zero included, is
    the one ggml (and gguf-py) decodes."""
    q = blocks[:, 1:]
    x = np.concatenate([q & 0x0F, q >> 4], axis=1)   # the 32 elements in order
    x[x == 8] = 0
    return x[:, 0::2] | (x[:, 1::2] << 4)


def _mxfp4_payload_chunks(g, rd, t: GGUFTensor, lay):
    """The MCF mxfp4 payload of GGUF MXFP4 tensor ``t``, streamed: its E8M0 bytes gathered first (1/17 of the
    tensor), then the codes re-ordered chunk by chunk.  ggml reads an E8M0 byte e as 2^(e - 127), the OCP value
    MCF keeps, except 0xFF: ggml's 2^128 where OCP MX has NaN, which no MCF mxfp4 block can hold."""
    from mcf.errors import FormatError

    nb = t.nbytes // _MXFP4_BLOCK
    per = max(1, _CHUNK // _MXFP4_BLOCK)
    scales = np.empty(nb, np.uint8)
    for b0 in range(0, nb, per):
        n = min(per, nb - b0)
        scales[b0:b0 + n] = rd.read(t.offset + b0 * _MXFP4_BLOCK, n * _MXFP4_BLOCK).reshape(n, _MXFP4_BLOCK)[:, 0]
    rd.release()
    bad = np.flatnonzero(scales == 0xFF)
    if bad.size:
        raise FormatError(f"MXFP4 block {int(bad[0])} has the E8M0 scale 0xFF, which ggml reads as 2^128 and OCP MX "
                          "(MCF's mxfp4) as NaN: the tensor cannot be kept as mxfp4", path=g.path,
                          field=f"tensor {t.name!r} block [{int(bad[0])}]", expected="E8M0 0x00..0xFE", got="0xff")
    yield scales
    yield np.zeros(lay.region("data").offset - nb, np.uint8)
    for b0 in range(0, nb, per):
        n = min(per, nb - b0)
        yield _mxfp4_codes(rd.read(t.offset + b0 * _MXFP4_BLOCK, n * _MXFP4_BLOCK).reshape(n, _MXFP4_BLOCK)).reshape(-1)


def _convert_mxfp4(g, w, rd, t: GGUFTensor):
    """GGUF MXFP4 (type 39) -> MCF mxfp4: the same values, the bytes re-laid out (no requantization)."""
    from mcf.container.layout import quant_layout
    from mcf._core.dtypes import dtype_info, DType

    info = dtype_info(DType.MXFP4)
    lay = quant_layout(info, t.shape)
    w.add_tensor_bytes(t.name, info, t.shape, _mxfp4_payload_chunks(g, rd, t, lay))
    return ConvertStats(t.name, "MXFP4", "mxfp4", "native", t.shape, t.nbytes, lay.nbytes)
