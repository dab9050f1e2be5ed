"""Converting checkpoints into MCF: a Hugging Face directory, one safetensors file, or a GGUF file.

One streaming pass: each tensor is read, optionally quantized (the rules of ``mcf quantize``) or cast,
and written before the next is touched, so peak memory stays near one tensor whatever the model's
size.  The safetensors path is the same code as :func:`mcf.pack` (with no method the output is
byte-identical to it); GGUF files go to :func:`mcf.conversion.gguf.convert_gguf`.
"""

from __future__ import annotations

import os

from mcf._core.args import file_path
from mcf.errors import FormatError, InvalidArgumentError
from mcf.conversion.pack import files_left_out  # re-exported: mcf convert and mcf pack leave out the same files

__all__ = ["convert", "DTYPES", "files_left_out"]

DTYPES = ("keep", "f32", "f16", "bf16")


# What a file mcf convert cannot read is good for, by its kind (mcf.conversion.sniff): the command the user seems
# to want.
_ELSEWHERE = {
    "mcf": "it is MCF already: to quantize it, mcf quantize {path} OUT.mcf --method k4 (in Python: "
           "mcf.conversion.quant_policy.quantize_file); to get safetensors back, mcf export {path} -o DIR",
    "json": "pass the checkpoint directory that holds it and the weights (model.safetensors)",
    "megatron-index": "a dataset, not a model: mcf megatron info / mcf megatron verify read it",
    "megacontext-level": "part of a tree, not a model: mcf ctx info TREE_DIR reads the tree",
    "bucket-kv": "a stored KV cache, not a model: mcf bucket verify --root BUCKET CONTEXT_ID checks it",
    "zip": "mcf converts safetensors and GGUF: save the weights as safetensors first "
           "(safetensors.torch.save_file(torch.load(...), 'model.safetensors'))",
    "pickle": "mcf converts safetensors and GGUF: save the weights as safetensors first "
              "(safetensors.torch.save_file(torch.load(...), 'model.safetensors'))",
    "npy": "one array: write it with mcf.Writer(...).add_tensor(name, numpy.load(...))",
    "gzip": "decompress it first",
    "zstd": "decompress it first",
    "text": "pass a checkpoint directory, a .safetensors or a .gguf file",
}
INPUTS = "a checkpoint directory, a .safetensors or a .gguf file"


def _input_kind(path: str) -> str:
    """``"gguf"`` or ``"safetensors"`` (also for a checkpoint directory), by the file's first bytes
    whatever its name says; a file of another known kind is refused here, with what it is and which
    command reads it.  Unrecognized bytes go to the reader the name suggests, which says what is wrong."""
    from mcf.conversion.sniff import sniff  # here: it imports every format, which `import mcf` need not

    if not os.path.isfile(path):
        return "safetensors"  # a directory, or missing: the checkpoint reader names the problem
    kind = sniff(path)
    if kind is None:
        return "gguf" if path.lower().endswith(".gguf") else "safetensors"
    if kind.name in ("gguf", "safetensors"):
        return kind.name
    raise FormatError(f"{kind.what}, not a checkpoint mcf convert reads; "
                      + _ELSEWHERE[kind.name].format(path=path), path=path, expected=INPUTS)


def convert(src, dst, *, method: str | None = None, overrides=(), compat: bool = False, fast: bool = False,
            imatrix=None, dtype: str = "keep", resources: bool = True, progress=None, report: bool = False,
            mmap: bool | None = None, durable: bool = True) -> list:
    """Convert checkpoint ``src`` into the MCF file ``dst``; returns per-tensor
    :class:`mcf.container.quant.QuantStats` when ``report`` is true (else an empty list).

    ``src``: a checkpoint directory (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``, plus config/tokenizer files that go into resource sections), a
    single ``.safetensors`` file, or a ``.gguf`` file.  ``method`` ("q8", "q4", "k6", "k4", "k3",
    "k2", "int8", "int4"; for GGUF also "native", see :func:`mcf.conversion.gguf.convert_gguf`) quantizes rank-2
    float tensors; ``overrides`` (``["embed*=q8",
    "lm_head.weight=none"]``, first match wins) picks a method per name; ``compat=True`` reproduces
    the Go quantizer's bytes; ``fast=True`` keeps the single-pass quantizer; ``imatrix`` (a file or a
    mapping name -> importance, see :mod:`mcf.conversion.imatrix`) weights the quantization error per column.
    ``dtype`` ("keep", "f32", "f16", "bf16") casts the float tensors that are not quantized.
    ``progress(done, total, name)`` is called after each tensor.  ``mmap`` chooses how safetensors
    inputs are read: mapped (True), with ``pread`` (False), or by their filesystem (None, the default:
    mapped on local disks).  For GGUF input the report is
    :func:`mcf.conversion.gguf.convert_gguf`'s per-tensor :class:`mcf.conversion.gguf.ConvertStats`: how each tensor was
    stored, and for a requantized one the error the MCF method added to the GGUF values (GGUF's own
    blocks are already lossy, and the original weights are not in the file).

    ``durable=False`` skips the fsyncs of the output (still published atomically; see :class:`mcf.Writer`).

    Every input is validated before the output is created; a bad input raises a
    :class:`mcf.MCFError` subclass naming the file and field, and leaves ``dst`` untouched.
    """
    from mcf.conversion.imatrix import as_importance
    from mcf.conversion.pack import pack_checkpoint
    from mcf.conversion.quant_policy import check_imatrix_mode, resolve_policy

    path = file_path(src, "src")
    dtype = str(dtype).strip().lower()
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    check_imatrix_mode(imatrix, compat, fast)
    imatrix = None if imatrix is None else as_importance(imatrix)  # a bad file fails before the output exists
    if _input_kind(path) == "gguf":
        from mcf.conversion.gguf import convert_gguf

        stats = convert_gguf(path, dst, method=method, overrides=overrides, compat=compat, dtype=dtype,
                             progress=progress, durable=durable, fast=fast, imatrix=imatrix, report=report)
        return list(stats) if report else []
    method, overrides = resolve_policy(method, overrides)
    return pack_checkpoint(path, dst, dtype=dtype, method=method, overrides=overrides, compat=compat,
                           fast=fast, imatrix=imatrix, report=report, resources=resources, mmap=mmap, progress=progress,
                           durable=durable)
