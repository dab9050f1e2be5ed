"""GGUF, the single-file format of llama.cpp / ggml: a validating reader with fast dequantization
(:mod:`mcf.gguf.reader`), a drop-in for gguf-py's ``gguf.quants.dequantize`` (:mod:`mcf.gguf.quants`)
and conversion to MCF (:mod:`mcf.gguf.convert`).  See docs/gguf.md.

>>> import mcf.gguf
>>> g = mcf.gguf.open("model.gguf")                                   # doctest: +SKIP
>>> mcf.gguf.dequantize(g.raw("blk.0.attn_q.weight"), "Q4_K")        # doctest: +SKIP
>>> mcf.gguf.convert_gguf("model.gguf", "model.mcf", method="k4")     # doctest: +SKIP
"""

from mcf.gguf.convert import ConvertStats, convert_gguf, metadata_json, model_info
from mcf.gguf.quants import dequantize
from mcf.gguf.reader import (GGUF_METADATA_SECTION, SUPPORTED_TYPES, GGMLType, GGUFFile, GGUFTensor, ggml_type,
                             open)

__all__ = [
    "GGUF_METADATA_SECTION",
    "SUPPORTED_TYPES",
    "ConvertStats",
    "GGMLType",
    "GGUFFile",
    "GGUFTensor",
    "convert_gguf",
    "dequantize",
    "ggml_type",
    "metadata_json",
    "model_info",
    "open",
]
