"""GGUF, the single-file format of llama.cpp / ggml: a validating reader with fast dequantization
(:mod:`mcf.gguf.reader`) and conversion to MCF (:mod:`mcf.gguf.convert`).  See docs/gguf.md.

>>> import mcf.gguf
>>> g = mcf.gguf.open("model.gguf")                                   # doctest: +SKIP
>>> mcf.gguf.convert_gguf("model.gguf", "model.mcf", method="k4")     # doctest: +SKIP
"""

from mcf.gguf.convert import ConvertStats, convert_gguf, metadata_json, model_info
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
    "ggml_type",
    "metadata_json",
    "model_info",
    "open",
]
