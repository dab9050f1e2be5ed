"""Decoding any quantized payload an MCF file can hold, through one entry point.

MCF's own block formats (q*, k*, int8/int4: :mod:`mcf._core._kernels`) and mcf's block-scaled extensions
(mxfp4, nvfp4, f8_e4m3_b128: :mod:`mcf._core._mx`) are decoded by different compiled modules; the readers,
the loaders' read plans and :func:`mcf.dequantize` call :func:`decode_payload` and need not know which.  The
extensions may have any rank from 2 (an expert stack ``[E, out, in]`` of mxfp4), so the payload's rows are
every dimension but the last; the old formats are rank 2.
"""

from __future__ import annotations

import numpy as np

from mcf._core import _kernels, _mx
from mcf._core.dtypes import DTypeInfo
from mcf._core.scaled import payload_rows
from mcf.container.layout import Domain

__all__ = ["decode_payload"]


def decode_payload(payload, info: DTypeInfo, shape, *, domain: int = Domain.WEIGHTS, dtype=np.float32,
                   rows=None, out=None, impl=None, threads: int = 1) -> np.ndarray:
    """The payload of a quantized tensor of ``shape`` decoded to float32 / float16 / bfloat16 as a
    ``[n, cols]`` array: payload rows ``rows`` (``(start, stop)`` or a slice; every dimension but the last
    counts as rows), all by default, into ``out`` when given."""
    if info.scaled:
        return _mx.dequantize(payload, info.code, tuple(shape), dtype=dtype, row_range=rows, out=out, impl=impl,
                              threads=threads)
    r, c = payload_rows(info, shape)
    return _kernels.dequantize(payload, info.code, r, c, domain=domain, dtype=dtype, row_range=rows, out=out,
                               impl=impl, threads=threads)
