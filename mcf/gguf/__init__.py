"""GGUF, the single-file format of llama.cpp / ggml: a validating reader with fast dequantization
(:mod:`mcf.gguf.reader`) and a drop-in for gguf-py's ``gguf.quants.dequantize`` (:mod:`mcf.gguf.quants`).
Conversion to MCF is a converter above the formats: :func:`mcf.convert` or :mod:`mcf.conversion.gguf`.
See docs/gguf.md.

>>> import mcf.gguf
>>> g = mcf.gguf.open("model.gguf")                                   # doctest: +SKIP
>>> mcf.gguf.dequantize(g.raw("blk.0.attn_q.weight"), "Q4_K")        # doctest: +SKIP
"""

from mcf.gguf.quants import dequantize
from mcf.gguf.reader import GGUF_METADATA_SECTION, SUPPORTED_TYPES, GGMLType, GGUFFile, GGUFTensor, ggml_type, open

__all__ = ["GGUF_METADATA_SECTION", "SUPPORTED_TYPES", "GGMLType", "GGUFFile", "GGUFTensor", "dequantize", "ggml_type",
           "open"]
