"""safetensors files and Hugging Face checkpoint directories, read through mcf's I/O core (local paths,
buffers, fsspec URLs) with the safetensors library's own checks; no dependency on that library.

:func:`open_checkpoint` is what ``mcf pack`` and ``mcf convert`` read: a ``.safetensors`` file, or a
directory (or URL) holding ``model.safetensors`` or ``model.safetensors.index.json`` and its shards.
The code is in :mod:`mcf.safetensors.reader`.  Writing safetensors is :func:`mcf.export`.
"""

from mcf.safetensors.reader import ST_DTYPES, SafetensorsFile, SafetensorsTensor, open_checkpoint

__all__ = ["SafetensorsFile", "SafetensorsTensor", "open_checkpoint", "ST_DTYPES"]
