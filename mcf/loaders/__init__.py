"""The loaders: any checkpoint (an MCF file, a safetensors file or directory, a URL of either) into
arrays the caller gets or owns.

:func:`mcf.loaders.weights.open_weights` is the one entry from "a checkpoint" to "the pieces to read":
it sniffs the input, opens it with its format's reader and answers with the tensors' read plans, which
the core's executor (:mod:`mcf.loading.plan`) carries out.  :func:`mcf.load_file` and
:func:`mcf.load_state_dict` (numpy) are in :mod:`mcf.loaders.state_dict`; :mod:`mcf.torch` builds torch
tensors from the same pieces, and :func:`mcf.loaders.device.stream_to_device` streams them onto a
device (fresh tensors or ones the caller has) through a bounded ring of host buffers.  What the
formats' readers share with the loaders (names and slices, read plans, casts) is in the core,
:mod:`mcf.loading`.
"""
