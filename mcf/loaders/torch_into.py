"""torch destinations of a load into existing memory (:mod:`mcf.loaders.into`): :func:`load_into` for a
mapping of tensors, :func:`load_model` for a module's parameters and buffers, the machinery of
:func:`mcf.torch.load_into` and :func:`mcf.torch.load_model`.

- A tensor that is C-contiguous on the CPU is filled in place by the read engine: ``data_ptr`` unchanged,
  nothing allocated for it.  A contiguous tensor on another device (a GPU) is filled through the ring of
  pinned host buffers (:func:`mcf.loaders.device.stream_to_device`, one stream per device), as is a
  contiguous CPU tensor when ``ring_buffers``/``ring_bytes`` are given.  A strided view is filled through
  bounded CPU staging and ``copy_``.
- With ``group=`` (:mod:`mcf.loaders.distributed`) the ranks share the reads: the broadcasts land in each
  C-contiguous CPU tensor's memory; any other tensor is staged whole in host memory and copied in once the
  ranks are done (no ring: a group's load is broadcast through host memory).
- A module's parameters and buffers on the meta device (a model built under ``torch.device("meta")`` or
  accelerate's ``init_empty_weights()``) get memory once, on ``device``, after every check has passed:
  ``module._parameters[name]`` becomes a new ``Parameter`` (same ``requires_grad``), a buffer a new tensor
  (its persistence is the module's, unchanged); every module that held the meta tensor (tied weights) gets
  the same new one.
- Non-persistent buffers (not in a state dict, so never in a checkpoint) left on the meta device are
  computed as transformers computes them (:func:`mcf.loaders.hf.init_buffers`: rotary ``inv_freq``), or
  refused before anything is read with an error that says how to build the model.
- A GGUF file loaded into a transformers model takes its names from transformers' own GGUF table and its
  row orders from transformers' tensor processors (:mod:`mcf.loaders.hf`) unless ``mapping=`` is given.
"""

from __future__ import annotations

from collections.abc import Mapping

from mcf._core.optional import require
from mcf.errors import ArgumentTypeError, DTypeError, InvalidArgumentError
from mcf.loaders import hf
from mcf.loaders.device import ring_settings, stream_to_device, torch_device
from mcf.loaders.distributed import group_load
from mcf.loaders.gguf_weights import GGUFWeights
from mcf.loaders.into import Target, fill, open_for_into, plan_into
from mcf.loading.dtypes import ELEMENTS
from mcf.loading.plan import mmap_of_backend

torch = require("torch", feature="mcf.torch", extra="torch")
from torch.autograd.graph import increment_version  # noqa: E402 - torch is optional: imported after require

__all__ = ["torch_target", "load_into", "load_model"]


def _elements() -> dict:
    out = {}
    for e in ELEMENTS.values():
        t = getattr(torch, e.torch, None) if e.torch else None
        if t is not None:
            out.setdefault(t, e)
    return out


_BY_TORCH = _elements()


def torch_target(name: str, t) -> Target:
    """The :class:`Target` of tensor ``t``: in place when it is C-contiguous on the CPU, through staging and
    ``copy_`` otherwise, pending (``ident`` only) on the meta device."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"destination {name!r} must be a torch.Tensor, got {type(t).__name__}")
    el = _BY_TORCH.get(t.dtype)
    if el is None:
        raise DTypeError(f"destination {name!r} is {t.dtype}, which holds no tensor element type mcf loads")
    shape = tuple(t.shape)
    if el.name == "F4":   # float4_e2m1fn_x2: two values per element
        shape = shape[:-1] + (shape[-1] * 2,) if shape else shape
    if t.is_meta:
        return Target(name, el, shape, ident=id(t), pending=True)
    if t.is_neg() or t.is_conj():
        raise InvalidArgumentError(f"destination {name!r} is a lazily negated or conjugated view: pass the tensor "
                                   "itself")
    data = t.detach()
    span = layout = None
    if t.numel():
        start = data.data_ptr()
        stop = start + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        span, layout = ((t.device.type, t.device.index), start, stop), (shape, tuple(t.stride()), t.dtype)
    if t.device.type == "cpu" and t.is_contiguous():
        return Target(name, el, shape, memory=data.reshape(-1).view(torch.uint8).numpy(), span=span, layout=layout)

    def store(buf, data=data):
        src = torch.from_numpy(buf).view(data.dtype).reshape(data.shape)
        with torch.no_grad():
            data.copy_(src)

    return Target(name, el, shape, store=store, span=span, layout=layout)


def _check_ring(ring_buffers, ring_bytes, group) -> bool:
    """Whether a ring's settings were given (checked); refused with a group, whose load has no ring."""
    ringed = ring_buffers is not None or ring_bytes is not None
    if ringed:
        ring_settings(ring_buffers, ring_bytes)
        if group is not None:
            raise InvalidArgumentError("group= broadcasts the ranks' reads through host memory, with no ring: "
                                       "ring_buffers/ring_bytes size the ring of a load without a group")
    return ringed


def _fill(w, plan, held: dict, *, group, ringed: bool, ring_buffers, ring_bytes, threads, chunk_bytes) -> None:
    """Carry out ``plan`` into its targets, ``held`` being their tensors (destination name -> tensor): shared
    with ``group``'s ranks, or each contiguous tensor off the CPU (and on it when ``ringed``) through the ring
    of its device, the others by :func:`mcf.loaders.into.fill`."""
    if group is not None:
        fill(plan.pieces, plan.targets, threads=threads, chunk_bytes=chunk_bytes, group=group, weights=w)
        return
    rings, rest = {}, []
    for p in plan.pieces:
        t = held[plan.targets[p.name].name]
        if t.is_contiguous() and (ringed or t.device.type != "cpu"):
            rings.setdefault(t.device, []).append(p)
        else:
            rest.append(p)
    for dev, pieces in rings.items():
        stream_to_device(pieces, {p.name: held[plan.targets[p.name].name] for p in pieces}, device=dev,
                         ring_buffers=ring_buffers, ring_bytes=ring_bytes, threads=threads, chunk_bytes=chunk_bytes)
    if rest:
        fill(rest, plan.targets, threads=threads, chunk_bytes=chunk_bytes)


def load_into(tensors, filename, *, names=None, slices=None, mapping=None, strict: bool = True, dequantize=False,
              mmap=None, backend=None, threads=None, chunk_bytes=None, ring_buffers=None, ring_bytes=None,
              group=None) -> tuple:
    """:func:`mcf.torch.load_into`: ``tensors`` (name -> torch.Tensor) filled in place."""
    with group_load(group) as gl:   # an error on one rank before the ranks compare plans is told to all
        ringed = _check_ring(ring_buffers, ring_bytes, gl)
        if not isinstance(tensors, Mapping):
            raise ArgumentTypeError(f"tensors must be a mapping of name -> torch.Tensor, got "
                                    f"{type(tensors).__name__}")
        targets = {}
        for n, t in tensors.items():
            if not isinstance(n, str):
                raise ArgumentTypeError(f"destination names must be str, got {n!r}")
            targets[n] = torch_target(n, t)
            if targets[n].pending:
                raise InvalidArgumentError(f"destination {n!r} is on the meta device and has no memory to fill: "
                                           "mcf.torch.load_model(module, ...) gives a module's meta tensors memory")
        with open_for_into(filename, mmap=mmap_of_backend(backend, mmap)) as w:
            plan = plan_into(w, targets, names=names, slices=slices, mapping=mapping, strict=strict,
                             dequantize=dequantize, threads=threads, into="the tensors")
            _fill(w, plan, tensors, group=gl, ringed=ringed, ring_buffers=ring_buffers, ring_bytes=ring_bytes,
                  threads=threads, chunk_bytes=chunk_bytes)
    _written(plan, tensors)
    return plan.missing, plan.unexpected


def _written(plan, tensors) -> None:
    """Tell autograd that the tensors filled in place changed (as ``copy_`` does for the staged ones), so a
    graph that saved one of them refuses to use it."""
    for t in plan.targets.values():
        if t.memory is not None:
            increment_version(tensors[t.name])


def _slots(model) -> dict:
    """id(tensor) -> [(module, attribute, is_parameter)] of every parameter and buffer of ``model``, each
    module that holds a tensor (tied weights: several)."""
    out = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for attr, v in mod._parameters.items():
            if v is not None:
                out.setdefault(id(v), []).append((mod, attr, True))
        for attr, v in mod._buffers.items():
            if v is not None:
                out.setdefault(id(v), []).append((mod, attr, False))
    return out


def _materialize(old, slots: list, device):
    """A new tensor of ``old``'s shape and dtype on ``device``, put in every slot that holds ``old``."""
    new = torch.empty(old.shape, dtype=old.dtype, device=device)
    if isinstance(old, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
    seen = set()
    for mod, attr, is_param in slots:
        if (id(mod), attr) in seen:
            continue
        seen.add((id(mod), attr))
        (mod._parameters if is_param else mod._buffers)[attr] = new
    return new


def load_model(model, filename, *, strict: bool = True, device=None, names=None, slices=None, mapping=None,
               dequantize=False, mmap=None, backend=None, threads=None, chunk_bytes=None, ring_buffers=None,
               ring_bytes=None, group=None) -> tuple:
    """:func:`mcf.torch.load_model`."""
    with group_load(group) as gl:   # an error on one rank before the ranks compare plans is told to all
        ringed = _check_ring(ring_buffers, ring_bytes, gl)
        return _load_model(model, filename, strict=strict, device=device, names=names, slices=slices,
                           mapping=mapping, dequantize=dequantize, mmap=mmap, backend=backend, threads=threads,
                           chunk_bytes=chunk_bytes, ring_buffers=ring_buffers, ring_bytes=ring_bytes, gl=gl,
                           ringed=ringed)


def _load_model(model, filename, *, strict, device, names, slices, mapping, dequantize, mmap, backend, threads,
                chunk_bytes, ring_buffers, ring_bytes, gl, ringed) -> tuple:
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    dev = torch_device("cpu" if device is None else device)   # a device torch does not have: refused here
    if dev.type == "meta":
        raise InvalidArgumentError("device='meta' has no memory to load into: pass the device the model's meta "
                                   "tensors are to live on (the CPU by default)")
    hf.tie_weights(model)
    state = model.state_dict(keep_vars=True)
    targets = {n: torch_target(n, t) for n, t in state.items()}
    pending_buffers = hf.meta_buffers(model)   # non-persistent, on the meta device
    where_model = f"{type(model).__name__}"
    with open_for_into(filename, mmap=mmap_of_backend(backend, mmap)) as w:
        if isinstance(w, GGUFWeights) and mapping is None and hf.is_transformers_model(model):
            mapping, w.row_orders = hf.gguf_names(model, w)
        plan = plan_into(w, targets, names=names, slices=slices, mapping=mapping, strict=strict,
                         dequantize=dequantize, threads=threads, into=where_model)
        unbuilt = hf.buffer_problems(model, pending_buffers)
        if unbuilt and strict:
            raise InvalidArgumentError(
                f"{where_model}: the non-persistent buffers {', '.join(repr(n) for n in unbuilt)} are on the meta "
                "device; no checkpoint holds them and mcf cannot compute them: build the model with its buffers "
                "in memory (accelerate's init_empty_weights() keeps buffers on the CPU), or pass strict=False to "
                "leave them there")
        hf.init_buffers(model, [b for b in pending_buffers if b[0] not in unbuilt], dev)
        slots = _slots(model)
        for name, t in list(plan.targets.items()):
            if t.pending:
                new = _materialize(state[t.name], slots[id(state[t.name])], dev)
                plan.targets[name] = torch_target(t.name, new)
                state[t.name] = new
        _fill(w, plan, state, group=gl, ringed=ringed, ring_buffers=ring_buffers, ring_bytes=ring_bytes,
              threads=threads, chunk_bytes=chunk_bytes)
    _written(plan, state)
    return plan.missing + [n for n in unbuilt if n not in plan.missing], plan.unexpected
