"""Which tensors of a model get which quantization method, and quantizing whole files.

The array-level quantizer is :mod:`mcf.container.quant`; this module is the policy around it that every
converter shares: the method of each tensor (``method`` plus ``PATTERN=METHOD`` overrides, rank-2
float tensors only), the importance of each tensor (an imatrix), the checks of a combination of
modes, and :func:`quantize_file` (``mcf quantize``: an MCF file to an MCF file, with the Go packer's
layout).  :func:`mcf.pack`, :func:`mcf.convert` and the GGUF converter all use it, so a model gets the
same methods whichever way it comes in.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import warnings

import numpy as np

from mcf.container.reader import open as open_container
from mcf._core.dtypes import DTypeInfo, parse_dtype
from mcf.errors import ArgumentTypeError, InvalidArgumentError, MCFError, in_tensor
from mcf.conversion.imatrix import as_importance, match_tensors
from mcf.conversion.second_moment import as_second_moment
from mcf.container.layout import SectionType
from mcf.container.quant import METHODS, QuantStats, dequantize, quantize, rows_f32, tensor_error_stats
from mcf.container.writer import Writer

__all__ = ["method_for", "parse_overrides", "resolve_policy", "plan_method", "plan_file", "describe_plan",
           "add_quantized", "importance_for", "check_imatrix_mode", "resolve_imatrix", "resolve_second_moment",
           "quantize_file"]


def method_for(name: str, default: str | None, overrides) -> str | None:
    for pattern, m in overrides:
        if fnmatch.fnmatchcase(name, pattern):
            return None if m in ("none", "keep") else m
    return default


def parse_overrides(items) -> list:
    """``["embed*=q8", "lm_head.weight=none"]`` -> [(pattern, method)]; first match wins.  Already parsed
    pairs pass as they are.  A single string is refused: iterated, it would be one override per character."""
    if isinstance(items, (str, bytes)):
        raise ArgumentTypeError(f"overrides must be a list of PATTERN=METHOD strings, got the single string {items!r}")
    items = list(items or ())
    if items and isinstance(items[0], tuple):
        return items
    out = []
    for it in items:
        if not isinstance(it, str):
            raise ArgumentTypeError(f"override {it!r} is not a PATTERN=METHOD string")
        if "=" not in it:
            raise InvalidArgumentError(f"override {it!r} is not PATTERN=METHOD")
        pat, m = it.rsplit("=", 1)
        m = m.strip().lower()
        if m not in METHODS + ("none", "keep"):
            raise InvalidArgumentError(f"override {it!r}: unknown method {m!r}; expected one of "
                                       f"{METHODS + ('none', 'keep')}")
        out.append((pat.strip(), m))
    return out


def resolve_policy(method, overrides) -> tuple:
    """Validate a default method and overrides once, before any output is written: ``(method or
    None, [(pattern, method)])``.  Overrides may be strings or already-parsed pairs."""
    if isinstance(method, str) and method.strip().lower() in ("none", "keep"):
        method = None
    if method is not None:
        try:
            method = parse_dtype(method).name
        except ValueError:
            pass
        if method not in METHODS:
            raise InvalidArgumentError(f"unknown method {method!r}; expected one of {METHODS}")
    return method, parse_overrides(overrides)


def plan_method(name: str, shape, dtype: DTypeInfo, method: str | None, overrides) -> str | None:
    """The method tensor ``name`` is quantized with, or None to store it as it is.

    Only rank-2 float tensors are quantized (norms, biases, integer and already-quantized tensors
    are copied); the first override whose glob matches the name wins over the default method."""
    m = method_for(name, method, overrides)
    if m is None or len(shape) != 2 or dtype.family != "float":
        return None
    return m


def plan_file(c, method: str | None, overrides) -> dict:
    """``{name: method or None}`` for every tensor of the open container ``c``, by :func:`plan_method`
    (``method`` and ``overrides`` as :func:`resolve_policy` returns them)."""
    return {n: plan_method(n, c.info(n).shape, c.info(n).dtype, method, overrides) for n in c}


def _tensors(n: int) -> str:
    return f"{n} tensor{'' if n == 1 else 's'}"


def _counted(dtypes) -> str:
    counts: dict = {}
    for d in dtypes:
        counts[d] = counts.get(d, 0) + 1
    return ", ".join(f"{d} x{k}" for d, k in counts.items())


def describe_plan(c, plan) -> list:
    """What :func:`quantize_file` does with each tensor of ``c`` under ``plan`` (:func:`plan_file`), as
    lines for a person: how many are quantized now (and with what), kept because they are quantized
    already, left as they are by ``none`` (the method or an override), or copied because they are not
    rank-2 floats.

    A quantized tensor is never quantized again: that would decode it and add a second rounding error
    to the first, at a size no smaller than quantizing the original once.  When the input holds such
    tensors the first line says so, since a run that quantizes nothing writes a copy of its input."""
    def quantizable(n):
        t = c.info(n)
        return len(t.shape) == 2 and t.dtype.family == "float"

    now = {n: m for n, m in plan.items() if m is not None}
    kept = [n for n in c if plan[n] is None and c.info(n).dtype.quantized]
    left = [n for n in c if plan[n] is None and quantizable(n)]
    copied = [n for n in c if plan[n] is None and not quantizable(n) and not c.info(n).dtype.quantized]
    lines = []
    if kept and not now:
        lines.append(f"the input is already quantized ({len(kept)} of its {_tensors(len(plan))}): nothing was "
                     "quantized again, the output holds the input's tensors")
    elif kept:
        lines.append(f"part of the input is already quantized ({len(kept)} of its {_tensors(len(plan))})")

    def dtypes(names):
        return _counted(c.info(n).dtype.name for n in names)

    if now:
        lines.append(f"  quantized: {_tensors(len(now))} ({_counted(now.values())})")
    if kept:
        lines.append(f"  kept as they are: {_tensors(len(kept))}, quantized already ({dtypes(kept)}: {_few(kept)}); "
                     "quantizing them again would add a second rounding error to the first: quantize the float "
                     "original instead")
    if left:
        lines.append(f"  left as they are by 'none' (the method or an override): {_tensors(len(left))} "
                     f"({dtypes(left)})")
    if copied:
        lines.append(f"  copied as they are: {_tensors(len(copied))} ({dtypes(copied)}): only rank-2 float tensors "
                     "are quantized")
    return lines


def add_quantized(w, name: str, array, src_dtype: DTypeInfo, method: str, *, compat: bool = False,
                  fast: bool = False, importance=None, second_moment=None, min_clip: float | None = None,
                  max_clip: float | None = None, report: bool = False) -> QuantStats | None:
    """Quantize a rank-2 float ``array`` (stored as ``src_dtype``) into writer ``w`` with its QuantInfo
    record; with ``report``, decode it again and return its error against the original.  ``compat``,
    ``fast``, ``importance`` and ``second_moment`` as in :func:`quantize`."""
    try:
        payload, q = quantize(array, method, compat=compat, fast=fast, importance=importance,
                              second_moment=second_moment, min_clip=min_clip, max_clip=max_clip,
                              src_dtype=src_dtype)
    except InvalidArgumentError as exc:
        if importance is None and second_moment is None:
            raise
        raise InvalidArgumentError(f"tensor {name!r}: {exc}") from None
    shape = tuple(int(d) for d in np.shape(array))
    w.add_tensor_bytes(name, method, shape, payload, quant=q)
    if not report:
        return None
    dec = dequantize(payload, method, shape)
    ref = rows_f32(np.asarray(array), 0, shape[0], src_dtype)
    rmse, snr, mx = tensor_error_stats(ref, dec)
    return QuantStats(name, method, shape, rmse, snr, mx, math.prod(shape) * src_dtype.itemsize,
                      payload.nbytes)


def importance_for(imatrix, name: str, method: str):
    """The importance vector of tensor ``name`` in ``imatrix`` (keyed by the file's tensor names, as
    :func:`resolve_imatrix` returns it) when ``method`` can use it (the q*/k* search), else None:
    int8/int4 keep one scale per tensor, so there is nothing for per-column weights to choose."""
    if not imatrix or parse_dtype(method).family == "raw":
        return None
    return imatrix.get(name)


def _few(names, n: int = 3) -> str:
    names = list(names)
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def resolve_imatrix(imatrix, planned) -> dict:
    """The importance vector of each tensor a run quantizes, keyed by the file's tensor names, from
    ``imatrix`` (None, a file or a mapping, as :func:`mcf.conversion.imatrix.as_importance` takes; its names are
    matched by :func:`mcf.conversion.imatrix.match_tensors`, across Hugging Face and GGUF naming).  ``planned`` is the
    ``(name, method)`` of every tensor the run will quantize, known before anything is written.

    N, the tensors an importance matrix is for, are the planned tensors whose method searches scales
    (q*, k*): int8/int4 keep one scale per tensor and do not use it.  An imatrix that matches none of
    N tensors (N > 0) is an error, since quantizing on would give the same bytes as without it, which
    is what a file named for another model, or in another naming convention, used to do silently.  One
    that matches some gives a warning saying how many and naming a few of the others, which are
    quantized unweighted: usual for embeddings and output heads (llama-imatrix does not record them),
    a sign of the wrong file otherwise."""
    if imatrix is None:
        return {}
    imatrix = as_importance(imatrix)
    return {n: imatrix[e] for n, e in _matched(imatrix, planned, "the importance matrix").items()}


def resolve_second_moment(second_moment, planned) -> dict:
    """``(entries, matched)``: ``entries`` is :func:`mcf.conversion.second_moment.as_second_moment` of ``second_moment``
    (None, a file or a mapping name -> matrix), ``matched`` maps each tensor a run quantizes with a q*/k* method
    to the name of its entry, by the rules of :func:`resolve_imatrix` (names matched across Hugging Face and
    GGUF naming; none matched is an error, some matched a warning).  A file's matrices are read one at a time,
    when their tensor is quantized (``entries[matched[name]]``), so a large model's do not all sit in memory."""
    if second_moment is None:
        return {}, {}
    entries = as_second_moment(second_moment)
    try:
        return entries, _matched(entries, planned, "the second moment file")
    except BaseException:
        if entries is not second_moment:   # opened here (a file)
            entries.close()
        raise


def _matched(entries, planned, what: str) -> dict:
    """tensor name -> entry name for the q*/k* tensors of ``planned``; 0 of N is an error, some a warning."""
    targets = [n for n, m in planned if m is not None and parse_dtype(m).family != "raw"]
    if not targets:
        return {}
    found = match_tensors(entries, targets)
    if not found:
        raise InvalidArgumentError(
            f"{what} matched 0 of the {len(targets)} tensors quantized with a q*/k* method: its "
            f"entries ({_few(sorted(entries))}) name none of the tensors ({_few(targets)}), under their own "
            "names or their Hugging Face / GGUF counterparts; was it made for another model?")
    missing = [n for n in targets if n not in found]
    if missing:
        warnings.warn(f"{what} matched {len(found)} of the {len(targets)} tensors quantized with a "
                      f"q*/k* method; quantized {'unweighted' if 'importance' in what else 'by the search alone'} "
                      f"(no entry): {_few(missing)}", UserWarning, stacklevel=4)
    return found


def check_imatrix_mode(imatrix, compat: bool, fast: bool, *, second_moment=None) -> None:
    """An importance matrix weights the search, a second moment chooses its codes: refuse them up front with
    the single-pass modes, and the two together (the second moment's diagonal is the importance vector)."""
    if imatrix is not None and second_moment is not None:
        raise InvalidArgumentError("give an importance matrix or a second moment file, not both: the second "
                                   "moment's diagonal is the importance vector, and it weights the scales")
    if imatrix is not None and (compat or fast):
        raise InvalidArgumentError("an importance matrix weights the error-minimizing search; it does not apply "
                                   "with " + ("compat" if compat else "fast"))
    if second_moment is not None and (compat or fast):
        raise InvalidArgumentError("a second moment chooses the codes of the error-minimizing search; it does not "
                                   "apply with " + ("compat" if compat else "fast"))


def quantize_file(src, dst, method: str | None, *, overrides=(), compat: bool = False, fast: bool = False,
                  imatrix=None, second_moment=None, min_clip: float | None = None, max_clip: float | None = None,
                  report: bool = False, progress=None, mmap: bool | None = None):
    """Quantize every rank-2 float tensor of MCF file ``src`` into ``dst``; copy everything else.

    The output is laid out as the Go quantizer lays it out (ModelInfo and resource sections copied in
    directory order, tensors sorted and 64-aligned, then TensorIndex and QuantInfo), so with
    ``compat=True`` and the same method it is byte-identical to ``mantle quantize``.  ``fast`` keeps the
    single-pass quantizer (see :func:`quantize`).  ``imatrix`` (a file :func:`mcf.conversion.imatrix.read_imatrix`
    reads, or a mapping name -> per-column importance) weights the error of the tensors it names; the
    others are quantized unweighted, with a warning, and an imatrix that names none of them is refused
    (:func:`resolve_imatrix`).  ``second_moment`` (a file :class:`mcf.conversion.second_moment.SecondMoments` reads, or
    a mapping name -> ``[columns, columns]`` matrix) instead chooses the codes of the tensors it names by error
    feedback (:func:`quantize`), by the same name rules; give one of ``imatrix`` and ``second_moment``.
    Returns a list of :class:`QuantStats` when ``report`` is true (else an empty list).
    """

    method, ov = resolve_policy(method, overrides)
    check_imatrix_mode(imatrix, compat, fast, second_moment=second_moment)
    stats = []
    with open_container(src, mmap=mmap) as c:
        plan = plan_file(c, method, ov)
        imat = resolve_imatrix(imatrix, plan.items())  # before the output exists
        moments, matched = resolve_second_moment(second_moment, plan.items())
        with contextlib.ExitStack() as opened, Writer(dst, align=64) as w:
            if moments is not second_moment and hasattr(moments, "close"):   # a file opened here
                opened.callback(moments.close)
            for s in c.sections:
                if s.type in (SectionType.TENSOR_INDEX, SectionType.TENSOR_DATA, SectionType.QUANT_INFO):
                    continue
                w.add_section(s.type, c.section_bytes(s.type), version=s.version)
            names = list(c)
            for i, name in enumerate(names):
                t = c.info(name)
                try:
                    m = plan[name]
                    if m is not None:
                        h = moments[matched[name]] if name in matched else None
                        st = add_quantized(w, name, c.tensor(name), t.dtype, m, compat=compat, fast=fast,
                                           importance=importance_for(imat, name, m), second_moment=h,
                                           min_clip=min_clip, max_clip=max_clip, report=report)
                        if st is not None:
                            stats.append(st)
                    elif t.dtype.quantized:
                        rec = c.quant_record(name)
                        q = None if rec is None else {"min_clip": rec.min_clip, "max_clip": rec.max_clip,
                                                      "domain": rec.domain}
                        w.add_tensor_bytes(name, t.dtype.code, t.shape, c.raw(name), quant=q)
                    else:
                        w.add_tensor_bytes(name, t.dtype.code, t.shape, c.raw(name))
                except MCFError as exc:  # name the file and the tensor, whatever failed
                    raise in_tensor(exc, c.path, name) from exc
                if progress is not None:
                    progress(i + 1, len(names), name)
    return stats
