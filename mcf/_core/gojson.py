"""JSON encoding exactly as Go's ``encoding/json.Marshal`` writes a decoded ``map[string]any``.

The Go packer re-encodes tokenizer_config.json this way (after injecting the chat template), so byte
compatibility needs it: keys sorted, compact, ``<``, ``>``, ``&``, U+2028 and U+2029 escaped, every
number formatted as a float64 the way strconv does (``4096``, ``1e+21``, ``1e-7``).
"""

from __future__ import annotations

import math

from mcf.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["go_marshal"]

_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_HTML = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def _string(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch in _SHORT:
            out.append(_SHORT[ch])
        elif ch in _HTML:
            out.append(_HTML[ch])
        elif ord(ch) < 0x20:
            out.append("\\u%04x" % ord(ch))
        elif 0xD800 <= ord(ch) <= 0xDFFF:  # lone surrogate: Go decoded it as U+FFFD
            out.append("\ufffd")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _float(f: float) -> str:
    if not math.isfinite(f):
        raise InvalidArgumentError(f"json: unsupported value: {f}")
    if f == 0:
        return "-0" if math.copysign(1.0, f) < 0 else "0"
    a = abs(f)
    r = repr(f)
    if a < 1e-6 or a >= 1e21:
        # Go: shortest digits in %e form, exponent at least two digits, then "e-07" -> "e-7"
        mant, _, exp = (r if "e" in r else f"{f:e}").partition("e")
        if "e" not in r:  # repr gave fixed notation; rebuild the shortest digits in e form
            digits = r.lstrip("-").replace(".", "").lstrip("0").rstrip("0") or "0"
            e = math.floor(math.log10(a))
            mant = ("-" if f < 0 else "") + digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
            exp = str(e)
        if mant.endswith(".0"):
            mant = mant[:-2]
        e = int(exp)
        s = f"{mant}e{'-' if e < 0 else '+'}{abs(e):02d}"
        if e < 0 and abs(e) < 10:
            s = f"{mant}e-{abs(e)}"
        return s
    # fixed notation with the shortest round-tripping digits
    if "e" in r:
        mant, _, exp = r.partition("e")
        neg = mant.startswith("-")
        mant = mant.lstrip("-")
        ip, _, fp = mant.partition(".")
        digits = ip + fp
        point = len(ip) + int(exp)
        if point >= len(digits):
            s = digits + "0" * (point - len(digits))
        elif point <= 0:
            s = "0." + "0" * (-point) + digits
        else:
            s = digits[:point] + "." + digits[point:]
        if "." in s:
            s = s.rstrip("0").rstrip(".")
        return ("-" if neg else "") + s
    if r.endswith(".0"):
        r = r[:-2]
    return r


def go_marshal(obj) -> bytes:
    """Encode like Go ``json.Marshal`` of the value ``json.Unmarshal`` into ``any`` would give."""
    return _enc(obj).encode("utf-8")


def _enc(v) -> str:
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (int, float)):
        return _float(float(v))
    if isinstance(v, dict):
        items = sorted(v.items(), key=lambda kv: kv[0].encode("utf-8", "surrogatepass"))
        return "{" + ",".join(_string(k) + ":" + _enc(x) for k, x in items) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_enc(x) for x in v) + "]"
    raise ArgumentTypeError(f"cannot encode {type(v).__name__}")
