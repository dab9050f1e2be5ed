"""Converting checkpoints into MCF: a Hugging Face directory, one safetensors file, or a GGUF file.

One streaming pass: each tensor is read, optionally quantized (the rules of ``mcf quantize``) or cast,
and written before the next is touched, so peak memory stays near one tensor whatever the model's
size.  The safetensors path is the same code as :func:`mcf.pack` (with no method the output is
byte-identical to it); GGUF files go to :func:`mcf.gguf.convert_gguf`.
"""

from __future__ import annotations

import os

from mcf._core.args import file_path
from mcf.errors import InvalidArgumentError

__all__ = ["convert", "DTYPES", "files_left_out"]

DTYPES = ("keep", "f32", "f16", "bf16")


def _is_gguf(path: str) -> bool:
    if path.lower().endswith(".gguf"):
        return True
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                return f.read(4) == b"GGUF"
        except OSError:
            return False
    return False


def files_left_out(src) -> list:
    """Entries of checkpoint directory ``src`` that :func:`convert` does not store: anything that is
    neither a weight file nor one of the resource files MCF has a section for (a BERT ``vocab.txt``,
    ``special_tokens_map.json``, sentence-transformers' module folders...).  Empty for a file."""
    from mcf.container.layout import RESOURCE_FILES

    path = file_path(src, "src")
    if not os.path.isdir(path):
        return []
    kept = set(RESOURCE_FILES.values()) | {"chat_template.jinja", "model.safetensors.index.json"}
    return sorted(n for n in os.listdir(path)
                  if n not in kept and not n.endswith(".safetensors") and not n.startswith("."))


def convert(src, dst, *, method: str | None = None, overrides=(), compat: bool = False, fast: bool = False,
            imatrix=None, dtype: str = "keep", resources: bool = True, progress=None, report: bool = False,
            mmap: bool | None = None, durable: bool = True) -> list:
    """Convert checkpoint ``src`` into the MCF file ``dst``; returns per-tensor
    :class:`mcf.container.quant.QuantStats` when ``report`` is true (else an empty list).

    ``src``: a checkpoint directory (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``, plus config/tokenizer files that go into resource sections), a
    single ``.safetensors`` file, or a ``.gguf`` file.  ``method`` ("q8", "q4", "k6", "k4", "k3",
    "k2", "int8", "int4"; for GGUF also "native", see :func:`mcf.gguf.convert_gguf`) quantizes rank-2
    float tensors; ``overrides`` (``["embed*=q8",
    "lm_head.weight=none"]``, first match wins) picks a method per name; ``compat=True`` reproduces
    the Go quantizer's bytes; ``fast=True`` keeps the single-pass quantizer; ``imatrix`` (a file or a
    mapping name -> importance, see :mod:`mcf.imatrix`) weights the quantization error per column.
    ``dtype`` ("keep", "f32", "f16", "bf16") casts the float tensors that are not quantized.
    ``progress(done, total, name)`` is called after each tensor.  ``mmap`` chooses how safetensors
    inputs are read: mapped (True), with ``pread`` (False), or by their filesystem (None, the default:
    mapped on local disks).  For GGUF input the report is
    :func:`mcf.gguf.convert_gguf`'s per-tensor :class:`mcf.gguf.ConvertStats` (how each tensor was
    stored), as GGUF's own blocks are already lossy.

    ``durable=False`` skips the fsyncs of the output (still published atomically; see :class:`mcf.Writer`).

    Every input is validated before the output is created; a bad input raises a
    :class:`mcf.MCFError` subclass naming the file and field, and leaves ``dst`` untouched.
    """
    from mcf.imatrix import as_importance
    from mcf.pack import pack_checkpoint
    from mcf.quant_policy import check_imatrix_mode, resolve_policy

    path = file_path(src, "src")
    dtype = str(dtype).strip().lower()
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    check_imatrix_mode(imatrix, compat, fast)
    imatrix = None if imatrix is None else as_importance(imatrix)  # a bad file fails before the output exists
    if _is_gguf(path):
        from mcf.gguf.convert import convert_gguf

        stats = convert_gguf(path, dst, method=method, overrides=overrides, compat=compat, dtype=dtype,
                             progress=progress, durable=durable, fast=fast, imatrix=imatrix)
        return list(stats) if report else []
    method, overrides = resolve_policy(method, overrides)
    return pack_checkpoint(path, dst, dtype=dtype, method=method, overrides=overrides, compat=compat,
                           fast=fast, imatrix=imatrix, report=report, resources=resources, mmap=mmap, progress=progress, durable=durable)
