"""Packing a Hugging Face checkpoint directory into one MCF file, the way the Go packer does.

With the default options the output is byte-identical to ``mantle pack`` (samcharles93/mantle): the
same resource sections in the same order (tokenizer_config.json re-encoded by Go's JSON encoder with
the chat template injected), the same ModelInfo, tensors sorted by name and 64-byte aligned.
Differences from the Go tool, all deliberate: non-float tensors are kept as they are under
``cast="f16"``/``"bf16"`` (Go refuses them), and NaNs stay NaN in a bf16 cast (Go's rounding can turn
some NaNs into infinities or -0).

Checkpoints in today's low-precision formats are stored without loss: FP8, E8M0 and F4 tensors as mcf's
extension dtypes, and each block-scaled weight (gpt-oss MXFP4 ``*_blocks`` + ``*_scales``, DeepSeek FP8 +
``weight_scale_inv``, ModelOpt NVFP4 ``weight`` + ``weight_scale`` + ``weight_scale_2``:
:mod:`mcf.safetensors.conventions`) as one tensor of dtype mxfp4, f8_e4m3_b128 or nvfp4 named after the
weight, its payload the checkpoint's bytes as they are (never requantized); :func:`mcf.export` writes the
parts back.  (The Go tool knows none of these.)
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable

import numpy as np

from mcf._core.args import file_path
from mcf._core.fs import MAX_JSON_BYTES, MAX_TOKENIZER_BYTES, read_regular
from mcf._core.gojson import go_marshal
from mcf._core._io import alloc_buffer
from mcf._core.scaled import nan_scales, payload_rows, scaled_layout
from mcf.safetensors.conventions import scaled_weights
from mcf.remote import is_url
from mcf.safetensors.reader import ST_DTYPES, locate_checkpoint, url_name
from mcf._core.dtypes import DType, DTypeInfo, parse_dtype
from mcf.errors import FormatError, InvalidArgumentError, MCFError, in_tensor
from mcf.container.layout import MAX_RANK, RESOURCE_FILES, SectionType, tensor_nbytes
from mcf.container.modelinfo import ModelInfo
from mcf.container.writer import Writer, cast_chunk

__all__ = ["pack", "pack_checkpoint", "write_checkpoint", "tokenizer_config_with_template", "model_info_for_dir",
           "files_left_out", "STORED_FILES", "RESOURCE_MAX_BYTES"]

#: the files of a checkpoint directory an MCF file keeps besides the weights: the resource sections
#: (written back under these names by mcf export), and what goes into them (the chat template, the
#: shard index)
STORED_FILES = tuple(RESOURCE_FILES.values()) + ("chat_template.jinja", "model.safetensors.index.json")

CASTS = ("keep", "f16", "bf16")
_STREAM_BYTES = 1 << 20  # bytes of a plain tensor read, converted and written per step
_MAX_ARRAY_BYTES = (1 << 63) - 1


#: the most bytes each resource file may hold: the tokenizer files (which reach 30+ MB)
#: :data:`mcf._core.fs.MAX_TOKENIZER_BYTES` (256 MiB), the JSON configs and the chat template
#: :data:`mcf._core.fs.MAX_JSON_BYTES` (64 MiB); the module mcf._core.fs says why.  A larger file, or
#: one that is not a regular file (a FIFO, /dev/zero...), is refused naming it.
RESOURCE_MAX_BYTES = {name: MAX_TOKENIZER_BYTES if name in ("tokenizer.json", "vocab.json", "merges.txt")
                      else MAX_JSON_BYTES for name in STORED_FILES if name != "model.safetensors.index.json"}


def _read(path):
    """The resource file ``path`` (None when there is none), within its cap."""
    name = os.path.basename(path)
    return read_regular(path, limit=RESOURCE_MAX_BYTES[name], what=name, missing_ok=True)


def tokenizer_config_with_template(model_dir: str) -> bytes | None:
    """tokenizer_config.json as the Go packer stores it: parsed, ``chat_template`` filled from
    chat_template.jinja (whitespace-trimmed) when missing or blank, re-encoded with Go's encoder."""
    cfg_bytes = _read(os.path.join(model_dir, "tokenizer_config.json"))
    tpl_bytes = _read(os.path.join(model_dir, "chat_template.jinja"))
    if cfg_bytes is None and tpl_bytes is None:
        return None
    cfg = {}
    if cfg_bytes:
        try:
            cfg = json.loads(cfg_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"not valid JSON: {exc}", path=os.path.join(model_dir, "tokenizer_config.json")) from None
        if not isinstance(cfg, dict):
            raise FormatError("not a JSON object", path=os.path.join(model_dir, "tokenizer_config.json"))
    tpl = (tpl_bytes or b"").decode("utf-8", "replace").strip(" \t\n\r\v\f")
    if tpl_bytes is not None and tpl:
        existing = cfg.get("chat_template")
        if not isinstance(existing, str) or existing.strip() == "":
            cfg["chat_template"] = tpl
    if not cfg:
        return cfg_bytes
    return go_marshal(cfg)


def files_left_out(src) -> list:
    """Entries of checkpoint directory ``src`` that :func:`pack` and :func:`mcf.conversion.checkpoint.convert` do not
    store: anything that is neither a weight file nor one of :data:`STORED_FILES` (a BERT ``vocab.txt``,
    ``special_tokens_map.json``, sentence-transformers' ``modules.json`` and module folders...).  MCF has
    no section for them, so the commands name them and say to keep them beside the MCF file.  Empty for
    a file."""
    path = file_path(src, "src")
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path)
                  if n not in STORED_FILES and not n.endswith(".safetensors") and not n.startswith("."))


def model_info_for_dir(model_dir: str, *, model_name: str | None = None) -> ModelInfo:
    """ModelInfo from config.json as the Go packer builds it (name = the directory's base name)."""
    name = model_name or os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
    raw = _read(os.path.join(model_dir, "config.json"))
    if raw is not None:
        try:
            cfg = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            cfg = None
        if isinstance(cfg, dict):
            return ModelInfo.from_hf_config(cfg, model_name=name)
    return ModelInfo(model_name=name)


def _resource_sections(model_dir: str):
    """(section type, bytes) of every resource file present, in the Go packer's order."""
    for typ, fname in RESOURCE_FILES.items():
        if typ == SectionType.TOKENIZER_CONFIG_JSON:
            data = tokenizer_config_with_template(model_dir)
        else:
            data = _read(os.path.join(model_dir, fname))
        if data is not None:
            yield typ, data


def _stream_plain(t, target: DTypeInfo, buf):
    """The bytes of safetensors tensor ``t`` as stored (or cast to ``target``), in chunks of at most
    ``buf.nbytes`` read with ``pread`` into the reused ``buf``.

    Reading through the mapping instead would leave every page read resident (mapped pages count in
    RSS until the kernel needs the memory: +1 GB peak for a 1 GB checkpoint); ``MADV_DONTNEED``
    after each chunk fixes that, but in measurements here a ``pread`` into a 1 MiB buffer that stays
    in the CPU cache was as fast or faster, needs no page faults and works the same for every
    source mode (:meth:`mcf.io.Source.read_ranges` preads even from a mapped source).
    """
    src = t.file.source
    info = t.dtype
    isz = max(1, info.itemsize)   # (F4: two values per byte)
    step = max(isz, buf.nbytes // isz * isz)
    same = target.code == info.code
    for o in range(0, t.nbytes, step):
        n = min(step, t.nbytes - o)
        chunk = buf[:n]
        src.read_ranges((t.offset + o,), (n,), chunk, (0,))
        if not same:
            chunk = cast_chunk(chunk.view(info.numpy), info, target)  # quiet: overflow is infinity
        yield chunk


def _raw_quantized(t):
    """(dtype, shape, QuantInfo fields) when the safetensors metadata marks U8 tensor ``t`` as a raw
    MCF quantized payload (:mod:`mcf.export`, ``dtype="raw"``), else None.  The description is
    checked against the payload size before it is trusted."""
    from mcf.conversion.export import RAW_KEY_PREFIX

    md = t.file.metadata if isinstance(t.file.metadata, dict) else {}
    desc = md.get(RAW_KEY_PREFIX + t.name)
    if desc is None:
        return None
    path, field = t.file.source.name, f"__metadata__[{RAW_KEY_PREFIX + t.name!r}]"
    try:
        d = json.loads(desc)
        info = parse_dtype(d["method"])
        shape = tuple(d["shape"])
        q = {"domain": int(d.get("domain", 0))}
        if "min_clip" in d:
            q.update(min_clip=float(d["min_clip"]), max_clip=float(d["max_clip"]))
        if (not info.quantized or q["domain"] not in (0, 1)
                or (q["domain"] and info.family != "raw")
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)
                or _array_bytes(shape, 4) > _MAX_ARRAY_BYTES):
            raise FormatError("not a quantized description MCF can hold")
        payload_rows(info, shape)   # rank 2 (mxfp4 / nvfp4: 2 or more)
        want = tensor_nbytes(info, shape, domain=q["domain"])
        if info.scaled:   # no QuantInfo record for the block-scaled extensions
            q = None
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise FormatError(f"bad quantized-tensor description: {exc}", path=path, field=field, got=desc) from None
    if t.dtype.code != DType.U8 or len(t.shape) != 1 or want != t.nbytes:
        raise FormatError(f"{info.name} {list(shape)} needs a U8 tensor of {want} bytes", path=path,
                          field=field, got=f"{t.dtype.name} {list(t.shape)}")
    return info, shape, q


def _stream_scaled(sw, buf):
    """The MCF payload of block-scaled weight ``sw``: each region the bytes of the checkpoint tensor that holds
    it, as they are, zero padding between (:mod:`mcf._core.scaled`).  A NaN block scale (an E8M0 0xFF, an E4M3
    NaN, a float32 NaN: every value of its block would decode to NaN, in mcf as in any reader) is refused with
    the scales tensor and the block named; the writer then leaves the output untouched."""
    lay = scaled_layout(sw.dtype, sw.shape)
    pos = 0
    for region, off, size, _, _ in lay.regions:
        if off > pos:
            yield np.zeros(off - pos, np.uint8)
        t = sw.parts[region]
        if t.nbytes != size:   # the conventions checked the shapes: an internal invariant
            raise AssertionError(f"{t.name}: {t.nbytes} bytes for the {size}-byte {region} region")
        done = 0
        for chunk in _stream_plain(t, t.dtype, buf):
            if region != "data":
                bad = nan_scales(sw.dtype, region, chunk)
                if bad.size:
                    item = 4 if region == "scale" or sw.dtype.family == "fp8block" else 1
                    k = int(bad[0])
                    raise FormatError(f"a NaN block scale: every value of its block of weight {sw.name!r} would "
                                      "decode to NaN", path=t.file.source.name,
                                      field=f"tensor {t.name!r} block [{done // item + k}]",
                                      expected=f"a number ({sw.dtype.name} scales)",
                                      got="0x" + bytes(chunk[k * item:(k + 1) * item][::-1]).hex())
            done += chunk.nbytes
            yield chunk
        pos = off + size


def write_checkpoint(ckpt, w: Writer, *, dtype: str = "keep", method: str | None = None, overrides=(),
                     compat: bool = False, fast: bool = False, imatrix=None, report: bool = False,
                     progress=None) -> list:
    """Stream every tensor of an open checkpoint into writer ``w``, sorted by name: rank-2 float
    tensors picked by ``method``/``overrides`` (:func:`mcf.conversion.quant_policy.plan_method`) are quantized
    (``compat``,
    ``fast``, and ``imatrix``, None, a file or a mapping name -> importance, as in
    :func:`mcf.conversion.quant_policy.quantize_file`, matched to the tensors by
    :func:`mcf.conversion.quant_policy.resolve_imatrix`
    before anything is written), the
    others stored as they are or, for floats, cast to ``dtype``.  The one tensor loop of
    :func:`pack` and :func:`mcf.conversion.checkpoint.convert`; returns the QuantStats of ``report``."""
    from mcf.conversion.quant_policy import add_quantized, importance_for, plan_method, resolve_imatrix, resolve_policy

    target = None if dtype == "keep" else parse_dtype(dtype)
    method, ov = resolve_policy(method, overrides)
    stats = []
    weights = scaled_weights(ckpt.tensors)
    parts = {n for sw in weights.values() for n in sw.part_names}
    names = sorted([n for n in ckpt.tensors if n not in parts] + list(weights), key=lambda n: n.encode("utf-8"))
    # a raw quantized payload (U8, 1-D) is never planned: plan_method takes rank-2 float tensors only; nor is a
    # block-scaled weight (already quantized, its bytes are kept)
    plan = {n: plan_method(n, ckpt.tensors[n].shape, ckpt.tensors[n].dtype, method, ov) for n in names
            if n not in weights}
    imatrix = resolve_imatrix(imatrix, plan.items())
    buf = alloc_buffer(_STREAM_BYTES)
    for i, name in enumerate(names):
        if name in weights:
            sw = weights[name]
            try:
                w.add_tensor_bytes(name, sw.dtype, sw.shape, _stream_scaled(sw, buf))
            except FormatError:   # names the checkpoint's tensor and block already
                raise
            except MCFError as exc:
                raise in_tensor(exc, sw.parts["data"].file.source.name, name) from exc
            if progress is not None:
                progress(i + 1, len(names), name)
            continue
        t = ckpt.tensors[name]
        try:
            raw = _raw_quantized(t)
            m = None if raw is not None else plan[name]
            if raw is not None:  # a quantized payload exported with dtype="raw": stored again as it was
                qinfo, shape, q = raw
                w.add_tensor_bytes(name, qinfo, shape, _stream_plain(t, t.dtype, buf), quant=q)
            elif m is not None:
                st = add_quantized(w, name, t.array(), t.dtype, m, compat=compat, fast=fast,
                                   importance=importance_for(imatrix, name, m), report=report)
                t.file.source.advise("dontneed", t.offset, t.nbytes)
                if st is not None:
                    stats.append(st)
            else:
                tgt = target if target is not None and t.dtype.family == "float" else t.dtype
                w.add_tensor_bytes(name, tgt, t.shape, _stream_plain(t, tgt, buf))
        except MCFError as exc:  # name the file and the tensor, whatever failed
            raise in_tensor(exc, t.file.source.name, name) from exc
        if progress is not None:
            progress(i + 1, len(names), name)
    return stats


def pack(model_dir, output, *, cast: str = "keep", align: int = 64, dedup: bool = False,
         resources: bool = True, mmap: bool | None = None, model_name: str | None = None,
         progress: Callable[[int, int, str], None] | None = None) -> str:
    """Pack a checkpoint directory (``model.safetensors`` or sharded) into ``output``.

    ``cast``: "keep", "f16" or "bf16" (float tensors only, round to nearest even).  ``align``: tensor
    alignment (1 disables padding).  ``dedup``: store byte-identical tensors once.  ``resources``:
    include config/tokenizer/vocab/merges files.  ``model_name``: ModelInfo name (default: the
    directory's base name, as the Go packer does).  ``progress(done, total, name)`` is called per tensor.
    Peak memory stays near one conversion chunk: tensors are streamed from the input.
    :func:`mcf.conversion.checkpoint.convert` is the same with quantization and GGUF input.
    """
    cast = cast.strip().lower() if isinstance(cast, str) else cast
    if cast not in CASTS:
        raise InvalidArgumentError(f"cast must be one of {CASTS}, got {cast!r}")
    pack_checkpoint(model_dir, output, dtype=cast, align=align, dedup=dedup, resources=resources, mmap=mmap,
                    model_name=model_name, progress=progress)
    return os.fspath(output)


def _array_bytes(shape, itemsize: int) -> int:
    """What numpy counts against its 2**63 limit: the non-zero dims times the item size (4 for
    quantized tensors, which decode to float32)."""
    return math.prod(d for d in shape if d) * itemsize


def _check_shapes(ckpt) -> None:
    """Refuse, before the output exists, a tensor the MCF reader would refuse: more than MAX_RANK
    dimensions, or a shape numpy cannot describe (non-zero dims times 4 bytes past 2**63, which an
    empty tensor with one huge dimension can have: it passes the safetensors size check); a bad
    description of a raw quantized payload; a block-scaled weight whose parts do not fit together."""
    scaled_weights(ckpt.tensors)   # block-scaled weights whose parts do not fit together
    for name, t in ckpt.tensors.items():
        if t.dtype is None:
            raise FormatError("unsupported dtype: MCF has no equivalent", path=t.file.source.name,
                              field=f"header[{name!r}].dtype", offset=8, expected="one of " + ",".join(ST_DTYPES),
                              got=t.element.name)
        _raw_quantized(t)
        field = f"header[{name!r}].shape"
        if len(t.shape) > MAX_RANK:
            raise FormatError("too many dimensions for MCF", path=t.file.source.name, field=field, offset=8,
                              expected=f"<= {MAX_RANK}", got=len(t.shape))
        if _array_bytes(t.shape, max(4, t.dtype.itemsize)) > _MAX_ARRAY_BYTES:
            raise FormatError("shape too large for an array", path=t.file.source.name, field=field, offset=8,
                              expected="non-zero dims * itemsize < 2**63", got=list(t.shape))


def pack_checkpoint(path, output, *, dtype: str = "keep", method: str | None = None, overrides=(),
                    compat: bool = False, fast: bool = False, imatrix=None, report: bool = False, align: int = 64,
                    dedup: bool = False,
                    resources: bool = True, mmap: bool | None = None, model_name: str | None = None,
                    progress=None, durable: bool = True) -> list:
    """A checkpoint directory or a single safetensors file into an MCF file (see :func:`pack`).

    Directories contribute their resource files and a ModelInfo from config.json; a single file a
    ModelInfo named after it.  Which files of a directory are read is the loaders' rule
    (:func:`mcf.safetensors.reader.locate_checkpoint`: ``model.safetensors``, else the index and its
    shards, else every ``*.safetensors``).  Everything is validated before the output is created."""
    from mcf.conversion.quant_policy import resolve_policy

    path = file_path(path, "path")
    resolve_policy(method, overrides)  # a bad method or override fails before anything is written
    if dtype != "keep":
        parse_dtype(dtype)
    located = locate_checkpoint(path)   # which files of a directory: the loaders' rule
    is_dir = located.directory is not None and not is_url(path)   # (a directory URL's files cannot be listed)
    with located.open(mmap=mmap) as ckpt:
        _check_shapes(ckpt)
        with Writer(output, align=align, dedup=dedup, durable=durable) as w:
            if resources and is_dir:
                for typ, data in _resource_sections(path):
                    w.add_section(typ, data)
            if is_dir:
                w.add_model_info(model_info_for_dir(path, model_name=model_name))
            else:
                stem = os.path.basename(url_name(path).rstrip("/"))   # (a URL's name without its query)
                stem = stem[:-len(".safetensors")] if stem.endswith(".safetensors") else stem
                w.add_model_info(ModelInfo(model_name=model_name or stem))
            return write_checkpoint(ckpt, w, dtype=dtype, method=method, overrides=overrides, compat=compat,
                                    fast=fast, imatrix=imatrix, report=report, progress=progress)
