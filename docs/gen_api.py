#!/usr/bin/env python
"""Generate docs/api.md, the API reference, from the docstrings of mcf's public modules.

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is stale (the test suite runs this)

The reference lists what each public module exports (its ``__all__``): signatures from ``inspect``
(the compiled modules embed theirs), the docstring as written, and for classes their public methods and
properties.  The docstrings are the single source; this page is never edited by hand.

The page must come out the same on every supported Python, so the check passes wherever the suite runs:
signatures are rendered here, not by ``str(inspect.Signature)``; a class shows only its own docstring (an
enum without one lists its members, instead of the docstring the interpreter's ``enum`` module lends it,
which differs between versions); and a module whose optional dependency is not installed (``mcf.torch``
without torch) keeps the section the page already has, with a note on stderr.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "api.md")

# (module, one line on what it is for).  Order = order on the page.
MODULES = [
    ("mcf", "MCF model containers: open, write, pack, quantize; the error classes"),
    ("mcf.io", "the I/O core every format reads through (mmap, pread, file-like, memory, remote)"),
    ("mcf.remote", "remote files: object stores, HTTP(S) and fsspec URLs read with concurrent, checked ranged GETs"),
    ("mcf.conversion.checkpoint", "import from safetensors / Hugging Face checkpoints and GGUF"),
    ("mcf.conversion.export", "export MCF back to safetensors checkpoints"),
    ("mcf.gguf", "the validating GGUF reader and its decoders"),
    ("mcf.conversion.gguf", "GGUF to MCF (what mcf.convert does with a .gguf input, with GGUF's own options)"),
    ("mcf.safetensors", "safetensors files and checkpoint directories: the safetensors.numpy.load_file drop-in, "
                        "the reader, block-scaled weights (MXFP4, FP8, NVFP4) decoded"),
    ("mcf.loading", "what every loader shares: Rows and Shard, the pieces of tensors to load"),
    ("mcf.conversion.imatrix", "importance matrices for the quantizer: read and write llama.cpp's format, "
                               "collect from activations"),
    ("mcf.conversion.second_moment", "second moments of the layers' inputs for error-feedback quantization: "
                                     "collect, write, read"),
    ("mcf.torch", "load MCF files and safetensors checkpoints as torch tensors (the safetensors.torch.load_file "
                  "drop-in), and into a model (the safetensors.torch.load_model drop-in)"),
    ("mcf.loaders.state_dict", "load MCF files and safetensors checkpoints as numpy arrays"),
    ("mcf.loaders.into", "load checkpoints into memory the caller holds: names, tied weights, checks, the fill "
                         "(mcf.load_into, and the machinery of mcf.torch.load_into / load_model)"),
    ("mcf.megatron", "Megatron-LM indexed datasets (.bin/.idx), sample indices, tokenization"),
    ("mcf.conversion.raydata", "Megatron datasets on a Ray cluster: tokenize, Datasink, Datasource (mcf-formats[ray])"),
    ("mcf.megacontext", "MegaContext trees (LOD0/1/2.ctx + metadata.json)"),
    ("mcf.bucket", "Model Context Bucket: a persistent KV-cache store"),
    ("mcf.bucket.hf", "a model in the bucket's loop: a Hugging Face causal LM computes and reuses KV caches"),
]


def _doc(obj) -> str:
    d = inspect.getdoc(obj) or ""
    return d.strip()


def _format_signature(sig: inspect.Signature) -> str:
    """The signature with string annotations (``from __future__ import annotations``) unquoted and
    class defaults shown by name."""
    parts, star_done = [], False
    for p in sig.parameters.values():
        if p.kind == p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind == p.VAR_POSITIONAL:
            star_done = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)}"
        if p.default is not p.empty:
            d = p.default
            d = f"{d.__module__}.{d.__qualname__}" if inspect.isclass(d) else repr(d)
            d = re.sub(r"<([\w.]+) object at 0x[0-9a-fA-F]+>", r"<\1>", d)  # sentinels: stable text
            text += f" = {d}" if p.annotation is not p.empty else f"={d}"
        parts.append(text)
    out = f"({', '.join(parts)})"
    if sig.return_annotation is not sig.empty:
        r = sig.return_annotation
        out += f" -> {r if isinstance(r, str) else inspect.formatannotation(r)}"
    return out


def _signature(name: str, obj) -> str:
    try:
        return f"{name}{_format_signature(inspect.signature(obj))}"
    except (TypeError, ValueError):
        doc = _doc(obj)
        first = doc.splitlines()[0] if doc else ""
        return first if first.startswith(name + "(") else f"{name}(...)"


def _strip_embedded_signature(name: str, doc: str) -> str:
    """Cython's embedsignature puts the signature on the docstring's first line: do not print it twice."""
    lines = doc.splitlines()
    if lines and lines[0].startswith(name + "("):
        lines = lines[1:]
    return "\n".join(lines).strip()


def _public_members(cls):
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_") and name not in ("__init__", "__getitem__", "__call__"):
            continue
        if name.startswith("__") and not getattr(member, "__doc__", None):
            continue
        if name == "__init__" and (member.__doc__ or "").startswith("Initialize self"):
            continue
        yield name, member


def _render_callable(lines: list, qual: str, short: str, obj, level: str) -> None:
    lines.append(f"{level} `{_signature(short, obj).replace(short, qual, 1)}`\n")
    doc = _strip_embedded_signature(short, _doc(obj))
    if doc:
        lines.append(doc + "\n")


def _own_doc(cls) -> str:
    """The class's own docstring: never one inherited from a base (``inspect.getdoc`` would take
    IntEnum's, whose text depends on the Python version) nor enum's placeholder ("An enumeration.")."""
    d = cls.__dict__.get("__doc__")
    if not isinstance(d, str) or (issubclass(cls, enum.Enum) and d.strip() == "An enumeration."):
        return ""
    return inspect.cleandoc(d)


def _render_class(lines: list, qual: str, cls) -> None:
    lines.append(f"### class `{qual}`\n")
    doc = _own_doc(cls)
    if doc:
        lines.append(doc + "\n")
    elif issubclass(cls, enum.Enum):
        lines.append("Members: " + ", ".join(f"`{m.name}` = {m.value!r}" for m in cls) + "\n")
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    if bases:
        lines.append(f"Bases: {', '.join(f'`{b}`' for b in bases)}\n")
    for name, member in _public_members(cls):
        if isinstance(member, property):
            d = _doc(member)
            lines.append(f"- **`{name}`** (property){': ' + d.splitlines()[0] if d else ''}\n")
        elif isinstance(member, (staticmethod, classmethod)):
            _render_callable(lines, f"{qual}.{name}", name, member.__func__, "####")
        elif callable(member):
            _render_callable(lines, f"{qual}.{name}", name, member, "####")


def _existing_sections() -> dict:
    """``## module`` heading -> its text as the current page has it."""
    if not os.path.exists(OUT):
        return {}
    with open(OUT, encoding="utf-8") as f:
        text = f.read()
    parts = re.split(r"(?m)^(?=## )", text)
    return {p.split("\n", 1)[0][3:].strip(): p.rstrip() + "\n" for p in parts[1:]}


def render() -> str:
    lines = ["# API reference\n",
             "Generated from the docstrings by `docs/gen_api.py`; do not edit by hand. Modules not listed "
             "here (those starting with `_`) are internal.\n"]
    toc, body = [], []
    existing = None
    for modname, what in MODULES:
        toc.append(f"- [`{modname}`](#{modname.replace('.', '')}): {what}")
        try:
            mod = importlib.import_module(modname)
        except ImportError as exc:  # mcf.MissingDependencyError: keep what the page says about it
            existing = _existing_sections() if existing is None else existing
            if modname not in existing:
                raise SystemExit(f"gen_api: cannot import {modname} ({exc}) and docs/api.md has no section "
                                 "for it: run this where it imports") from None
            print(f"gen_api: {modname} kept as docs/api.md has it (cannot import it here: {exc})", file=sys.stderr)
            body.append(existing[modname])
            continue
        body.append(f"## {modname}\n")
        doc = _doc(mod)
        if doc:
            body.append(doc + "\n")
        names = getattr(mod, "__all__", None)
        if names is None:
            names = [n for n, v in vars(mod).items() if not n.startswith("_")
                     and getattr(v, "__module__", None) == modname]
        for n in names:
            obj = getattr(mod, n)
            qual = f"{modname}.{n}"
            if inspect.ismodule(obj):
                continue
            if inspect.isclass(obj):
                if issubclass(obj, BaseException):
                    body.append(f"### exception `{qual}`\n")
                    bases = ", ".join(f"`{b.__name__}`" for b in obj.__bases__)
                    body.append(f"Bases: {bases}\n")
                    if _doc(obj) and _doc(obj) != _doc(obj.__bases__[0]):
                        body.append(_doc(obj) + "\n")
                else:
                    _render_class(body, qual, obj)
            elif callable(obj):
                _render_callable(body, qual, n, obj, "###")
            else:
                body.append(f"### `{qual}` = `{obj!r}`\n")
    return "\n".join(lines + toc + [""] + body).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from the docstrings")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        with open(OUT, encoding="utf-8") as f:
            if f.read() != text:
                print("docs/api.md is stale: run python docs/gen_api.py", file=sys.stderr)
                return 1
        return 0
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
