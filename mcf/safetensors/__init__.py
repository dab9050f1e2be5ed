"""safetensors files and Hugging Face checkpoint directories, read through mcf's I/O core (local paths,
buffers, fsspec URLs) with the safetensors library's own checks; no dependency on that library.

- :func:`load_file`: the drop-in for ``safetensors.numpy.load_file`` (same dict, fresh arrays), which
  also takes directories, shard indexes and URLs, and loads only the tensors (``names=``) and pieces
  (``slices=``) asked for.  Code in :mod:`mcf.safetensors.load`.
- :func:`open_checkpoint` is what ``mcf pack`` and ``mcf convert`` read: a ``.safetensors`` file, or a
  directory (or URL) holding ``model.safetensors`` or ``model.safetensors.index.json`` and its shards.
  Code in :mod:`mcf.safetensors.reader`.

Writing safetensors is :func:`mcf.export`.
"""

from mcf.safetensors.load import load_file
from mcf.safetensors.reader import ST_DTYPES, Checkpoint, SafetensorsFile, SafetensorsTensor, open_checkpoint

__all__ = ["load_file", "SafetensorsFile", "SafetensorsTensor", "Checkpoint", "open_checkpoint", "ST_DTYPES"]
