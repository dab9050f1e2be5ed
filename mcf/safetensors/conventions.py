"""Block-scaled weights in safetensors checkpoints, recognised by name, dtype and shape.

safetensors records element types only; a block-scaled weight is several tensors tied together by naming
convention.  Three conventions ship in today's checkpoints, and each is one of mcf's extension dtypes
(docs/mcf.md; their layouts in :mod:`mcf._core.scaled`):

==============  ==========================================================  ====================================
convention      tensors                                                     weight
==============  ==========================================================  ====================================
gpt-oss MXFP4   ``P_blocks`` U8 ``[..., R, C/32, 16]`` (32 E2M1 values      ``P``, mxfp4 ``[..., R, C]``
                per 16 bytes, element 2k in the low nibble of byte k) and
                ``P_scales`` U8 (or F8_E8M0) ``[..., R, C/32]``: one E8M0
                scale per block (OpenAI's original checkpoints write
                ``P.blocks`` / ``P.scales``)
DeepSeek FP8    ``W`` F8_E4M3 ``[M, N]`` and ``W_scale_inv`` F32            ``W``, f8_e4m3_b128 ``[M, N]``
                ``[ceil(M/128), ceil(N/128)]``: one scale per 128 x 128
                block, the last ones partial
ModelOpt NVFP4  ``W`` U8 ``[M, N/2]`` (even column in the low nibble),       ``W``, nvfp4 ``[M, N]``
                ``W_scale`` F8_E4M3 ``[M, N/16]`` and ``W_scale_2`` F32
                ``[]``; ``input_scale`` (for activations) is not part of
                the weight and stays a tensor of its own
==============  ==========================================================  ====================================

A pair (or triple) whose names match a convention but whose dtypes or shapes do not fit it is refused with
a :class:`mcf.FormatError` naming the tensor at fault (a scales tensor whose shape does not match its blocks,
a block count that does not divide the row), rather than loaded as something it is not.  A tensor with no
partner is an ordinary tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcf._core.dtypes import DType, DTypeInfo, dtype_info
from mcf.errors import FormatError

__all__ = ["ScaledWeight", "scaled_weights", "GPT_OSS", "DEEPSEEK", "MODELOPT"]

GPT_OSS = "gpt-oss mxfp4"
DEEPSEEK = "deepseek fp8"
MODELOPT = "modelopt nvfp4"


@dataclass(frozen=True)
class ScaledWeight:
    """One block-scaled weight of a checkpoint: its ``name``, ``dtype`` (mxfp4, nvfp4 or f8_e4m3_b128) and
    ``shape`` as a model sees it, the ``convention`` it ships in, and ``parts``: the tensor
    (:class:`mcf.safetensors.SafetensorsTensor`) holding each region of its MCF payload ("data", "scales",
    and nvfp4's per-tensor "scale"), byte for byte."""

    name: str
    dtype: DTypeInfo
    shape: tuple
    convention: str
    parts: dict

    def locate(self, region: str, offset: int):
        """``(source, file offset)`` of byte ``offset`` of region ``region`` of the weight's payload."""
        t = self.parts[region]
        return t.file.source, t.offset + offset

    @property
    def part_names(self) -> list:
        return [t.name for t in self.parts.values()]


def _shape_error(path, t, reason, expected):
    return FormatError(reason, path=path, field=f"header[{t.name!r}].shape", offset=8, expected=expected,
                       got=list(t.shape))


def _gpt_oss(tensors: dict, name: str):
    """``P_blocks`` + ``P_scales`` (or ``P.blocks`` + ``P.scales``), or None."""
    for suffix, partner in (("_blocks", "_scales"), (".blocks", ".scales")):
        if name.endswith(suffix) and name[:-len(suffix)] + partner in tensors:
            base = name[:-len(suffix)]
            break
    else:
        return None
    blocks, scales = tensors[name], tensors[base + partner]
    path = blocks.file.source.name
    if blocks.element.name != "U8" or scales.element.name not in ("U8", "F8_E8M0"):
        raise FormatError(f"{name!r} and {scales.name!r} look like gpt-oss MXFP4 blocks and scales, which are U8 "
                          "(scales also F8_E8M0)", path=path, field=f"header[{name!r}].dtype", offset=8,
                          expected="U8 blocks, U8 or F8_E8M0 scales",
                          got=f"{blocks.element.name}, {scales.element.name}")
    if len(blocks.shape) < 3 or blocks.shape[-1] != 16:
        raise _shape_error(path, blocks, "MXFP4 blocks hold 32 values in 16 bytes: the last dimension must be 16, "
                           "after at least a row and a block dimension", "[..., rows, blocks, 16]")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise _shape_error(blocks.file.source.name if scales.file is blocks.file else scales.file.source.name,
                           scales, f"the scales tensor's shape does not match its blocks {name!r} (one scale "
                           "per block)", list(blocks.shape[:-1]))
    shape = tuple(blocks.shape[:-2]) + (blocks.shape[-2] * 32,)
    return ScaledWeight(base, dtype_info(DType.MXFP4), shape, GPT_OSS, {"scales": scales, "data": blocks})


def _deepseek(tensors: dict, name: str):
    """``W`` F8_E4M3 + ``W_scale_inv`` F32 of rank 2, or None."""
    inv = tensors.get(name + "_scale_inv")
    w = tensors[name]
    if inv is None or w.element.name != "F8_E4M3" or inv.element.name != "F32" or len(inv.shape) != 2:
        return None   # (a per-tensor scale_inv, or E8M0 scales, are another convention: left as they are)
    path = inv.file.source.name
    if len(w.shape) != 2:
        raise _shape_error(w.file.source.name, w, f"a weight with 128 x 128 block scales {inv.name!r} must be rank 2",
                           "[rows, cols]")
    want = [-(-w.shape[0] // 128), -(-w.shape[1] // 128)]
    if list(inv.shape) != want:
        raise _shape_error(path, inv, f"the scales tensor's shape does not match its blocks: {name!r} "
                           f"{list(w.shape)} in blocks of 128 x 128", want)
    return ScaledWeight(name, dtype_info(DType.F8_E4M3_B128), tuple(w.shape), DEEPSEEK, {"scales": inv, "data": w})


def _modelopt(tensors: dict, name: str):
    """``W`` U8 + ``W_scale`` F8_E4M3 + ``W_scale_2`` F32 (one value), or None."""
    sc = tensors.get(name + "_scale")
    w = tensors[name]
    if sc is None or w.element.name != "U8" or sc.element.name != "F8_E4M3":
        return None
    path = sc.file.source.name
    sc2 = tensors.get(name + "_scale_2")
    if sc2 is None:
        raise FormatError(f"the NVFP4 weight {name!r} with block scales {sc.name!r} has no per-tensor scale "
                          f"{name + '_scale_2'!r}", path=path, field=f"header[{sc.name!r}]", offset=8)
    if sc2.element.name != "F32" or math.prod(sc2.shape) != 1 or len(sc2.shape) > 1:
        raise FormatError("NVFP4's per-tensor scale is one F32 value", path=sc2.file.source.name,
                          field=f"header[{sc2.name!r}]", offset=8, expected="F32 []",
                          got=f"{sc2.element.name} {list(sc2.shape)}")
    if len(w.shape) != 2 or len(sc.shape) != 2 or sc.shape[0] != w.shape[0]:
        raise _shape_error(path, sc, f"the scales tensor's shape does not match its packed weight {name!r} "
                           f"{list(w.shape)} (one scale per 16 values of a row)",
                           [w.shape[0], "cols / 16"] if len(w.shape) == 2 else "[rows, cols / 16]")
    cols = 2 * w.shape[1]
    if sc.shape[1] * 16 != cols:
        raise _shape_error(path, sc, f"the block count does not divide the row: {name!r} holds {cols} values per "
                           f"row, {sc.shape[1]} blocks of 16 hold {sc.shape[1] * 16}", [w.shape[0], cols / 16])
    return ScaledWeight(name, dtype_info(DType.NVFP4), (w.shape[0], cols), MODELOPT,
                        {"scale": sc2, "scales": sc, "data": w})


def scaled_weights(tensors: dict) -> dict:
    """The block-scaled weights among ``tensors`` (name -> :class:`mcf.safetensors.SafetensorsTensor`, a
    checkpoint's ``tensors``): weight name -> :class:`ScaledWeight`, in the order of their data tensors in
    ``tensors``.  A weight name that is also a tensor's, or a tensor claimed by two weights, is a
    :class:`mcf.FormatError`."""
    found = {}
    claimed = {}
    for name in tensors:
        sw = _gpt_oss(tensors, name) or _deepseek(tensors, name) or _modelopt(tensors, name)
        if sw is None:
            continue
        data = sw.parts["data"]
        if sw.name in tensors and sw.name != data.name:
            raise FormatError(f"the {sw.convention} weight {sw.name!r} (from {data.name!r}) has the name of another "
                              "tensor", path=data.file.source.name, field=f"header[{sw.name!r}]", offset=8)
        for t in sw.parts.values():
            if claimed.setdefault(t.name, sw.name) != sw.name:
                raise FormatError(f"tensor {t.name!r} belongs to two weights, {claimed[t.name]!r} and {sw.name!r}",
                                  path=t.file.source.name, field=f"header[{t.name!r}]", offset=8)
        found[sw.name] = sw
    return found
