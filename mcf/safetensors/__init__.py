"""safetensors files and Hugging Face checkpoint directories, read through mcf's I/O core (local paths,
buffers, fsspec URLs) with the safetensors library's own checks; no dependency on that library.

- :func:`load_file`: the drop-in for ``safetensors.numpy.load_file`` (same dict, fresh arrays), which
  also takes directories, shard indexes and URLs, and loads only the tensors (``names=``) and pieces
  (``slices=``) asked for.  Code in :mod:`mcf.safetensors.load`.
- :func:`dequantize` (and ``load_file(..., dequantize=True)``): the weights checkpoints ship block-scaled
  (gpt-oss MXFP4, DeepSeek FP8, ModelOpt NVFP4), decoded by mcf's compiled kernels; :func:`scaled_weights`
  lists them.  Code in :mod:`mcf.safetensors.conventions`.
- :func:`open_checkpoint` is what ``mcf pack`` and ``mcf convert`` read: a ``.safetensors`` file, or a
  directory (or URL) holding ``model.safetensors`` or ``model.safetensors.index.json`` and its shards.
  Code in :mod:`mcf.safetensors.reader`.

Writing safetensors is :func:`mcf.export`.
"""

from mcf.safetensors.conventions import ScaledWeight, scaled_weights
from mcf.safetensors.load import dequantize, load_file
from mcf.safetensors.reader import ST_DTYPES, Checkpoint, SafetensorsFile, SafetensorsTensor, open_checkpoint

__all__ = ["load_file", "dequantize", "scaled_weights", "ScaledWeight", "SafetensorsFile", "SafetensorsTensor",
           "Checkpoint", "open_checkpoint", "ST_DTYPES"]
