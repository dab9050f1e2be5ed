"""The command-line scaffolding every subcommand shares: a progress bar, human-readable sizes, the
reports of ``mcf info`` and ``mcf quantize --report``, and the one rule for printing what came from a
file (:func:`printable`, :func:`json_text`).

Why the rule: names, metadata strings and paths come from files someone else made (a context's name in
a bucket, a tensor name or metadata value in an MCF or GGUF file, a MegaContext tree's timestamps).
Printed raw, an escape sequence in one of them drives the user's terminal (retitles the window, writes
the clipboard through OSC 52, clears the screen), a newline forges a second row in a listing, and a
bidirectional override makes the text read differently from what it is.  Every command prints such
strings through :func:`printable` (or, as JSON, :func:`json_text`), which shows those characters as
escapes instead.

It lives in the core (not in :mod:`mcf.cli`) so format CLIs (``mcf megatron``, ``mcf megacontext``)
and the demo use it without importing the ``mcf`` entry point, which imports them.  The error
printing and ``--debug`` handling are in :mod:`mcf._core.cli_errors`.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from typing import Any

__all__ = ["Progress", "human", "info_dict", "json_text", "print_info", "print_report", "printable",
           "write_tensor_table"]

#: what a terminal acts on instead of showing: C0 controls (ESC, BEL, CR, LF, BS, ...), DEL, C1 controls
#: (CSI, OSC, ... as single code points), the bidirectional marks, embeddings, overrides and isolates
#: (which reorder what follows), the line and paragraph separators, and lone surrogates (undecodable
#: bytes of a file name, which cannot be printed at all)
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: Any) -> str:
    """``str(text)`` with every character a terminal would act on (C0 and C1 controls, DEL, bidirectional
    controls, line separators, lone surrogates) shown as ``\\xNN`` or ``\\uNNNN``: one line, nothing for the
    terminal to do; everything else, other scripts included, is left as it is."""
    return _UNSAFE.sub(_escape, str(text))


def json_text(obj: Any, *, indent: int | None = 2) -> str:
    """``obj`` as JSON safe to print: ASCII only (json's ``ensure_ascii``: control characters, C1, bidi
    and surrogates as ``\\uNNNN``), and DEL, which JSON leaves raw, as ``\\u007f``."""
    return json.dumps(obj, indent=indent).replace("\x7f", "\\u007f")


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class Progress:
    """A minimal progress bar on stderr (only when it is a terminal, or when forced)."""

    def __init__(self, label: str, *, enabled: bool | None = None):
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int, what: str = "") -> None:
        if not self.enabled:
            return
        width = 30
        frac = done / total if total else 1.0
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        el = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.label} [{bar}] {done}/{total} {el:5.1f}s {printable(what)[:40]:<40}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def info_dict(c) -> dict:
    h = c.header
    mi = c.model_info
    return {
        "file": c.path,
        "header": {"magic": h.magic.hex(), "major": h.major, "minor": h.minor, "header_size": h.header_size,
                   "section_count": h.section_count, "section_dir_offset": h.section_dir_offset,
                   "file_size": h.file_size, "flags": h.flags},
        "sections": [{"type": s.type, "name": s.name, "version": s.version, "offset": s.offset,
                      "size": s.size} for s in c.sections],
        "model_info": None if mi is None else mi.to_dict(),
        "tensors": [{"index": t.index, "name": t.name, "dtype": t.dtype.name, "shape": list(t.shape),
                     "offset": t.offset, "size": t.nbytes} for t in c.index.values()],
        "quant_info": [{"tensor_index": r.tensor_index, "tensor": r.name, "method": r.method,
                        "domain": r.domain, "block_size": r.block_size, "super_size": r.super_size,
                        "min_clip": r.min_clip, "max_clip": r.max_clip} for r in c.quant_info],
    }


def print_info(c, *, out=None) -> None:
    out = out or sys.stdout
    d = info_dict(c)
    h = d["header"]
    w = out.write
    w(f"{printable(c.path)}: MCF {h['major']}.{h['minor']}, {human(h['file_size'])} ({h['file_size']} bytes), "
      f"flags=0x{h['flags']:x}{' (tensor data aligned 64)' if h['flags'] & 1 else ''}\n")
    w(f"\nsections ({len(d['sections'])}, directory at {h['section_dir_offset']}):\n")
    w(f"  {'type':>6}  {'name':<24} {'offset':>12} {'size':>12}\n")
    for s in sorted(d["sections"], key=lambda s: s["offset"]):
        w(f"  0x{s['type']:04x}  {printable(s['name']):<24} {s['offset']:>12} {s['size']:>12}\n")
    mi = d["model_info"]
    if mi:
        w("\nmodel info:\n")
        for k in ("model_name", "base_model", "arch", "vocab_size", "hidden_size", "layer_count", "head_count",
                  "head_count_kv", "context_length", "train_context", "rope_type", "rope_freq_base", "rope_scale"):
            if mi[k] not in ("", 0, 0.0, None):
                w(f"  {k:<16} {printable(mi[k])}\n")
        for k, v in mi["extras"].items():
            w(f"  {printable(k):<16} {printable(v)}\n")
    nw = write_tensor_table(w, d["tensors"], "dtype", 5)
    if d["quant_info"]:
        w(f"\nquant records ({len(d['quant_info'])}):\n")
        for r in d["quant_info"]:
            w(f"  {printable(r['tensor']):<{nw}} method=0x{r['method']:02x} domain={r['domain']} "
              f"block={r['block_size']} "
              f"super={r['super_size']} clip=[{r['min_clip']:.6g}, {r['max_clip']:.6g}]\n")


def write_tensor_table(w, tensors: list, key: str, width: int, *, title: str | None = None, totals: bool = True,
                       head: str = "", tail=None) -> int:
    """The tensor table ``mcf info`` shows of every format, through ``w`` (a ``write``): a heading (with the
    count and size of the tensors where ``totals``), a header line ending in ``head``, then a line a tensor
    of ``tensors`` (``info_dict`` entries): name, the ``key`` entry (``width`` wide, titled ``title``, by
    default ``key``), shape, size, offset and ``tail(t)``.  Returns the width of the name column (60 at
    most), for the lines that follow."""
    total = sum(t["size"] for t in tensors)
    w(f"\ntensors ({len(tensors)}, {human(total)}):\n" if totals else "\ntensors:\n")
    names = [printable(t["name"]) for t in tensors]
    nw = min(max([len(n) for n in names] + [4]), 60)
    w(f"  {'name':<{nw}} {title or key:<{width}} {'shape':<18} {'size':>12} {'offset':>12}{head}\n")
    for t, name in zip(tensors, names):
        shape = "x".join(map(str, t["shape"])) or "scalar"
        w(f"  {name:<{nw}} {t[key]:<{width}} {shape:<18} {t['size']:>12} {t['offset']:>12}"
          f"{tail(t) if tail else ''}\n")
    return nw


def print_report(stats, *, out=None) -> None:
    """Per-tensor quantization error: RMSE, SNR and max |error| of the decoded values."""
    out = out or sys.stdout
    if not stats:
        out.write("no tensor was quantized\n")
        return
    nw = min(max(len(printable(s.name)) for s in stats), 60)
    out.write(f"\n  {'tensor':<{nw}} {'method':<6} {'shape':<14} {'RMSE':>10} {'SNR dB':>8} {'max|err|':>10} "
              f"{'ratio':>6}\n")
    for s in stats:
        shape = "x".join(map(str, s.shape))
        out.write(f"  {printable(s.name):<{nw}} {s.method:<6} {shape:<14} {s.rmse:>10.3g} {s.snr_db:>8.2f} "
                  f"{s.max_abs_err:>10.3g} {s.nbytes_in / max(1, s.nbytes_out):>5.2f}x\n")
    n = sum(math.prod(s.shape) for s in stats)
    mse = sum(s.rmse ** 2 * math.prod(s.shape) for s in stats) / max(1, n)
    snrs = [s.snr_db for s in stats if math.isfinite(s.snr_db)]
    out.write(f"  {'all ' + str(len(stats)) + ' quantized tensors':<{nw}} {'':<6} {'':<14} {math.sqrt(mse):>10.3g} "
              f"{(sum(snrs) / len(snrs) if snrs else float('nan')):>8.2f} {max(s.max_abs_err for s in stats):>10.3g} "
              f"{sum(s.nbytes_in for s in stats) / max(1, sum(s.nbytes_out for s in stats)):>5.2f}x"
              "   (RMSE over all values, mean SNR)\n")
