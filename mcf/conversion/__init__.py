"""The converters: everything that reads one format and writes another, or prepares what a writer needs.

- :mod:`mcf.conversion.checkpoint`: safetensors files, Hugging Face directories and GGUF to MCF
  (:func:`mcf.convert`), with quantization; :mod:`mcf.conversion.pack`: a checkpoint directory to MCF
  as the Go packer writes it (:func:`mcf.pack`); :mod:`mcf.conversion.export`: MCF back to
  safetensors (:func:`mcf.export`); :mod:`mcf.conversion.gguf`: GGUF to MCF.
- :mod:`mcf.conversion.quant_policy`: which tensor gets which method (``--quant``, overrides).
- Calibration: :mod:`mcf.conversion.imatrix` (importance matrices, llama.cpp's format),
  :mod:`mcf.conversion.second_moment` (the layers' input second moments for error-feedback
  quantization) and :mod:`mcf.conversion.bert`, the plain-numpy BERT forward pass that collects them.
- Text to Megatron datasets: :mod:`mcf.conversion.tokenize` (one process) and
  :mod:`mcf.conversion.raydata` (a Ray cluster); :mod:`mcf.conversion.tokenizer` builds the tokenizer
  from a tokenizer.json, a checkpoint directory or an MCF file.
- :mod:`mcf.conversion.sniff`: what kind of file this is, from every format's magic.

The package imports none of them until one is used.  Its modules' names are not the functions'
(``mcf.convert`` is the function; its module is ``mcf.conversion.checkpoint``).
"""

_SUBMODULES = frozenset({"checkpoint", "export", "pack", "gguf", "quant_policy", "imatrix", "second_moment", "bert",
                         "tokenize", "raydata", "tokenizer", "sniff"})


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES)
