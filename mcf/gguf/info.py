"""What ``mcf info`` shows of a GGUF file: the header, the metadata keys (long arrays summarized), how
many tensors of each ggml type, and the tensor table, each tensor with its type and what mcf does with
it (``kind``: ``float`` and ``quant`` are decoded, ``int`` stored as it is, ``unsupported`` only read raw).

Metadata strings come from whoever made the file, so the text report prints them through
:func:`mcf._core.console.printable` and the JSON one through ``json_text`` (escape sequences shown, not
run).  A vocabulary of 150,000 tokens is one line (``[string] x 150000``), not 150,000.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import numpy as np

from mcf._core.fs import open_regular

from mcf._core.console import human, printable, write_tensor_table
from mcf.gguf.reader import GGUFFile
from mcf.remote._urls import url_name

__all__ = ["info_dict", "print_info", "is_gguf_file"]

_MAX_SHOWN = 8  # array items shown in the text report; strings longer than 120 characters are cut


def is_gguf_file(path) -> bool:
    """True for a path or URL named ``*.gguf`` (a URL's query aside: ``x.gguf?download=true``) or a file that
    starts with the GGUF magic."""
    if url_name(path).lower().endswith(".gguf"):
        return True
    try:
        fd = open_regular(path)  # a FIFO would block a plain open; the reader that follows says what it is
    except (OSError, TypeError, ValueError):
        return False
    try:
        return os.pread(fd, 4, 0) == b"GGUF"
    except OSError:
        return False
    finally:
        os.close(fd)


def _summary(value, vtype):
    """A metadata value as JSON can hold it: scalars as they are, arrays as their element type and length
    (and their first items)."""
    if isinstance(vtype, tuple):
        items = value.tolist() if isinstance(value, np.ndarray) else value
        head = [x.hex() if isinstance(x, bytes) else x for x in items[:_MAX_SHOWN]]
        return {"array": vtype[1], "length": len(items), "head": head if vtype[1] != "array" else []}
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    return value


def info_dict(g: GGUFFile) -> dict:
    tensors = list(g.tensors.values())
    return {
        "file": g.path,
        "format": "gguf",
        "version": g.version,
        "alignment": g.alignment,
        "data_offset": g.data_offset,
        "file_size": g.source.size,
        "metadata": {k: {"type": list(t) if isinstance(t, tuple) else t, "value": _summary(g.metadata[k], t)}
                     for k, t in g.value_types.items()},
        "types": dict(Counter(t.type.name for t in tensors)),
        "tensors": [{"name": t.name, "ggml_type": t.type.name, "ggml_code": t.type.code, "shape": list(t.shape),
                     "offset": t.offset, "size": t.nbytes, "kind": t.type.kind}
                    for t in tensors],
    }


def _show(value, vtype) -> str:
    if isinstance(vtype, tuple):
        s = value
        text = f"[{vtype[1]}] x {s['length']}"
        if s["head"]:
            text += ": " + ", ".join(repr(x) if isinstance(x, str) else str(x) for x in s["head"])
            text += ", ..." if s["length"] > len(s["head"]) else ""
        return text
    if isinstance(value, dict):
        return "0x" + value["bytes_hex"]
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 120 else text[:117] + "..."


def print_info(g: GGUFFile, *, out=None) -> None:
    out = out or sys.stdout
    w = out.write
    d = info_dict(g)
    w(f"{printable(g.path)}: GGUF v{d['version']}, {human(d['file_size'])} ({d['file_size']} bytes), "
      f"alignment {d['alignment']}, data at {d['data_offset']}\n")
    md = d["metadata"]
    w(f"\nmetadata ({len(md)} keys):\n")
    kw = min(max([len(printable(k)) for k in md] + [4]), 48)
    for k, e in md.items():
        t = e["type"]
        vt = tuple(t) if isinstance(t, list) else t
        w(f"  {printable(k):<{kw}} {printable(_show(e['value'], vt))}\n")
    types = ", ".join(f"{n} x {c}" for n, c in sorted(d["types"].items(), key=lambda kv: (-kv[1], kv[0])))
    w(f"\ntypes: {types or 'none'}\n")
    write_tensor_table(w, d["tensors"], "ggml_type", 7, title="type",
                       tail=lambda t: "  (mcf cannot decode this type)" if t["kind"] == "unsupported" else "")
