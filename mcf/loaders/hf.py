"""What a load into a transformers model takes from transformers itself, so that the model ends up as
``from_pretrained`` leaves it (:func:`mcf.torch.load_model`).

- **A GGUF file's names** (:func:`gguf_names`): transformers' own table from llama.cpp's names to the
  model's (``get_gguf_hf_weights_map``, built from gguf-py's name table for the model's architecture),
  and the tensor processor ``from_pretrained(..., gguf_file=...)`` runs on each tensor
  (``TENSOR_PROCESSORS``).  A processor that only reorders rows (llama's Q/K un-permutation) becomes a row
  order of the read plan: each stored row is read into its place, decoded by mcf's kernels (never
  gguf-py's dequantizer).  Which rows go where is asked of the processor itself, on a column of row
  numbers.  A processor that does more (transposes, splits experts, shifts norms) is refused before anything
  is read: such a file is for ``from_pretrained``.  Tensors the table does not name are left out, as
  ``from_pretrained`` leaves them.
- **Non-persistent buffers** (:func:`init_buffers`): a model built on the meta device has its rotary
  embedding's ``inv_freq`` and ``original_inv_freq`` there too, and no checkpoint holds them.  transformers
  computes them in its ``_init_weights`` (the branch for modules named ``*RotaryEmbedding`` that have
  ``original_inv_freq``, with the module's ``rope_init_fn`` of its config); mcf gives them memory on the
  load's device and runs that same method on those modules alone.  Any other non-persistent buffer on the
  meta device is refused (:func:`buffer_problems`).

transformers is not imported here unless the model is one of its models (it is then already imported).
"""

from __future__ import annotations

import sys

import numpy as np

from mcf.errors import InvalidArgumentError, MissingDependencyError

__all__ = ["is_transformers_model", "gguf_names", "meta_buffers", "buffer_problems", "init_buffers"]


def is_transformers_model(model) -> bool:
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def tie_weights(model) -> None:
    """Tie a transformers model's weights its config says are tied, as ``from_pretrained`` does before it
    loads (transformers < 5 leaves a model built under accelerate's ``init_empty_weights()`` untied until
    then), so that a tied pair is one destination, filled once."""
    if is_transformers_model(model) and getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def gguf_names(model, w) -> tuple:
    """``(mapping, row_orders)`` for the GGUF file ``w`` (:class:`mcf.loaders.gguf_weights.GGUFWeights`) and
    the transformers ``model``: GGUF name -> the model's name (None: left out), and GGUF name -> the stored
    row of each of the model's rows where transformers' tensor processor reorders them."""
    try:
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map)
    except ImportError as exc:   # transformers' GGUF table needs gguf-py's name table
        raise MissingDependencyError(f"{w.where}: transformers' GGUF name table needs the gguf package ({exc})",
                                     package="gguf", feature="loading a GGUF file into a transformers model") from None
    arch = w.obj.metadata.get("general.architecture")
    cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    processor = cls(config=model.config.to_dict())
    import inspect

    try:   # transformers < 5 takes no processor (and names the model's type itself)
        if "processor" in inspect.signature(get_gguf_hf_weights_map).parameters:
            table = get_gguf_hf_weights_map(model, processor)
        else:
            table = get_gguf_hf_weights_map(model)
    except NotImplementedError as exc:
        raise InvalidArgumentError(f"{w.where}: transformers has no GGUF name table for this model ({exc})") from None
    mapping, orders = {}, {}
    for name in w.order:
        dest = table.get(name)
        mapping[name] = dest
        if dest is None or cls is TensorProcessor:
            continue
        order = _row_order(processor, name, w.shape(name), table)
        if order is False:
            raise InvalidArgumentError(
                f"{w.where}: transformers' {cls.__name__} changes GGUF tensor {name!r} beyond an order of its rows "
                f"(a transpose, a split or new values): mcf loads only files whose tensors it maps one to one; load "
                f"this model with from_pretrained(..., gguf_file=...)")
        if order is not None:
            orders[name] = order
    return mapping, orders


def _row_order(processor, name: str, shape: tuple, table: dict):
    """The row order ``processor`` gives tensor ``name`` of ``shape``: None (rows as stored), an int64 array
    (the stored row of each row), or False (it does more than reorder rows)."""
    if not shape:
        probe = np.zeros((), np.float64)
    else:
        probe = np.arange(shape[0], dtype=np.float64).reshape((shape[0],) + (1,) * (len(shape) - 1))
    try:
        res = processor.process(weights=probe, name=name, tensor_key_mapping=table,
                                parsed_parameters={"tensors": {}, "config": dict(processor.config)})
    except Exception:   # a processor that reshapes by the model's sizes cannot take a column of row numbers
        return False
    got = np.asarray(res.weights)
    if res.name != name or got.shape != probe.shape:
        return False
    if not shape:
        return None if float(got) == 0 else False
    order = got.reshape(-1)
    if not np.array_equal(np.sort(order), probe.reshape(-1)):
        return False
    order = order.astype(np.int64)
    return None if np.array_equal(order, np.arange(shape[0])) else order


def meta_buffers(model) -> list:
    """``(qualified name, module, attribute)`` of every non-persistent buffer of ``model`` on the meta device."""
    out = []
    for prefix, mod in model.named_modules():
        for attr, buf in mod._buffers.items():
            if buf is not None and buf.is_meta and attr in mod._non_persistent_buffers_set:
                out.append((f"{prefix}.{attr}" if prefix else attr, mod, attr))
    return out


def _rotary(mod) -> bool:
    """transformers' own test for the modules its ``_init_weights`` computes rotary buffers of."""
    return "RotaryEmbedding" in type(mod).__name__ and hasattr(mod, "original_inv_freq")


def buffer_problems(model, pending: list) -> list:
    """The names of ``pending`` (:func:`meta_buffers`) :func:`init_buffers` cannot compute."""
    if not pending:
        return []
    ok = is_transformers_model(model)
    return [name for name, mod, _ in pending if not (ok and _rotary(mod))]


def _owner(model, module):
    """The innermost transformers model that holds ``module`` (its ``_init_weights`` is the one that applies)."""
    tf = sys.modules["transformers"]
    owner = model
    for _, mod in model.named_modules():
        if isinstance(mod, tf.PreTrainedModel) and any(m is module for m in mod.modules()):
            owner = mod
    return owner


def init_buffers(model, pending: list, device) -> None:
    """Give the buffers ``pending`` (:func:`meta_buffers`, all of rotary modules of a transformers model)
    memory on ``device`` and compute them with the model's ``_init_weights``, as ``from_pretrained`` does.
    A module whose buffers that leaves unset gets its meta buffers back and is an error."""
    import torch

    modules = {}
    for _, mod, attr in pending:
        modules.setdefault(id(mod), (mod, []))[1].append(attr)
    for mod, attrs in modules.values():
        old = {a: mod._buffers[a] for a in attrs}
        for a in attrs:
            dt = old[a].dtype
            mod._buffers[a] = (torch.full(old[a].shape, float("nan"), dtype=dt, device=device) if dt.is_floating_point
                               else torch.empty(old[a].shape, dtype=dt, device=device))
        with torch.no_grad():
            _owner(model, mod)._init_weights(mod)
            if "inv_freq" in attrs and bool(mod._buffers["inv_freq"].isnan().any()) and hasattr(mod, "rope_init_fn"):
                # transformers < 5: _init_weights leaves rotary buffers alone; the module's __init__ computes
                # them with its rope_init_fn, which is what from_pretrained's construction ran
                inv_freq, _ = mod.rope_init_fn(mod.config, device)
                mod._buffers["inv_freq"] = inv_freq.to(device=device, dtype=mod._buffers["inv_freq"].dtype)
                if "original_inv_freq" in attrs:
                    mod._buffers["original_inv_freq"] = mod._buffers["inv_freq"].clone()
                elif hasattr(mod, "original_inv_freq"):
                    mod.original_inv_freq = mod._buffers["inv_freq"]
        unset = [a for a in attrs if mod._buffers[a].is_floating_point() and bool(mod._buffers[a].isnan().any())]
        if unset:
            mod._buffers.update(old)
            raise InvalidArgumentError(f"{type(model).__name__}: {type(mod).__name__}'s _init_weights left its "
                                       f"non-persistent buffers {unset} unset; build the model with its buffers in "
                                       "memory (accelerate's init_empty_weights() keeps buffers on the CPU)")
