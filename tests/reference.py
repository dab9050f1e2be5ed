"""Plain-numpy reference of every quantization kernel, written from the spec (docs/mcf.md), not from the C.

Slow and simple on purpose: bit streams via np.unpackbits, float32 arithmetic in the order the spec
states, explicit rounding rules.  The compiled variants must match it bit for bit.
"""

import numpy as np

BITS = {"q8": 8, "q4": 4, "k6": 6, "k4": 4, "k3": 3, "k2": 2, "int8": 8, "int4": 4}
FAMILY = {"q8": "block", "q4": "block", "k6": "super", "k4": "super", "k3": "super", "k2": "super",
          "int8": "raw", "int4": "raw"}


def align64(x):
    return (x + 63) // 64 * 64


def layout(method, rows, cols, domain=0):
    """(region name -> (offset, size)), total size: the spec's formulas, independently of mcf.layout."""
    bits, fam = BITS[method], FAMILY[method]
    if fam == "raw":
        row_bytes = cols if bits == 8 else (cols + 1) // 2
        off = 64
        regs = {"scale": (0, 4)}
        if domain == 1:
            regs["zero"] = (64, 4)
            off = 128
        regs["data"] = (off, rows * row_bytes)
        return regs, off + rows * row_bytes
    bpr = -(-cols // 32)
    spr = -(-bpr // 8)
    tb, ts = rows * bpr, rows * spr
    data = tb * 32 * bits // 8
    if fam == "block":
        return {"scales": (0, 2 * tb), "data": (align64(2 * tb), data)}, align64(2 * tb) + data
    sub = align64(2 * ts)
    d = align64(sub + tb)
    return {"super_scales": (0, 2 * ts), "sub_scales": (sub, tb), "data": (d, data)}, d + data


def f16_scale(h):
    """f16 bits -> float32 with subnormals flushed to zero (the reference decoder's rule)."""
    h = np.asarray(h, dtype=np.uint16)
    f = h.view(np.float16).astype(np.float32)
    sub = (h & 0x7C00) == 0
    return np.where(sub, np.where(h & 0x8000, np.float32(-0.0), np.float32(0.0)), f).astype(np.float32)


def codes_of_blocks(data, bits, nblocks):
    """Signed codes [nblocks, 32] of LSB-first bit streams of 4*bits bytes per block."""
    raw = np.frombuffer(bytes(data), np.uint8)[: nblocks * 4 * bits].reshape(nblocks, 4 * bits)
    b = np.unpackbits(raw, axis=1, bitorder="little").reshape(nblocks, 32, bits).astype(np.int64)
    v = (b << np.arange(bits)).sum(axis=2)
    v = np.where(v >= 1 << (bits - 1), v - (1 << bits), v)
    return v.astype(np.int8)


def raw_codes(data, bits, rows, cols):
    row_bytes = cols if bits == 8 else (cols + 1) // 2
    raw = np.frombuffer(bytes(data), np.uint8)[: rows * row_bytes].reshape(rows, row_bytes)
    if bits == 8:
        return raw.view(np.int8).copy()
    lo = (raw & 0xF).astype(np.int16)
    hi = (raw >> 4).astype(np.int16)
    v = np.stack([lo, hi], axis=2).reshape(rows, 2 * row_bytes)[:, :cols]
    return np.where(v >= 8, v - 16, v).astype(np.int8)


def dequant(payload, method, rows, cols, domain=0):
    """float32 [rows, cols]: q: scale * q; k: (super * (u6 / 32)) * q; int: scale * (q - zero)."""
    payload = np.frombuffer(bytes(payload), np.uint8)
    regs, _ = layout(method, rows, cols, domain)
    bits, fam = BITS[method], FAMILY[method]

    def reg(name):
        o, n = regs[name]
        return payload[o:o + n]

    if fam == "raw":
        scale = reg("scale").view("<f4")[0]
        zero = reg("zero").view("<f4")[0] if "zero" in regs else np.float32(0)
        if scale == 0:  # a zero scale decodes to +0.0, whatever the codes and the zero point say
            return np.zeros((rows, cols), np.float32)
        q = raw_codes(reg("data"), bits, rows, cols).astype(np.float32)
        return (scale * (q - zero)).astype(np.float32)
    bpr = -(-cols // 32)
    q = codes_of_blocks(reg("data"), bits, rows * bpr).astype(np.float32).reshape(rows, bpr, 32)
    if fam == "block":
        s = f16_scale(reg("scales").view("<u2")).reshape(rows, bpr)
    else:
        spr = -(-bpr // 8)
        sup = f16_scale(reg("super_scales").view("<u2")).reshape(rows, spr)
        u6 = (reg("sub_scales") & 0x3F).astype(np.float32).reshape(rows, bpr)
        with np.errstate(invalid="ignore"):  # an infinite super scale times u6 = 0 (masked below)
            s = (np.repeat(sup, 8, axis=1)[:, :bpr] * (u6 / np.float32(32.0))).astype(np.float32)
        s = np.where(u6 == 0, np.float32(0), s)
    with np.errstate(invalid="ignore"):  # infinite scales times code 0 are NaN, as in the C
        w = (s[:, :, None] * q).astype(np.float32)
    # The Go decoder skips a block whose scale is zero (q*: the f16 scale after the subnormal flush;
    # k*: super == 0 or u6 == 0): every value of it is +0.0, never -0.0 for a negative code.
    w = np.where((s == 0)[:, :, None], np.float32(0), w).astype(np.float32)
    return w.reshape(rows, bpr * 32)[:, :cols]


def to_f16_bits(x):
    with np.errstate(over="ignore"):  # overflow to infinity is the correct rounding
        return np.asarray(x, np.float32).astype(np.float16).view(np.uint16)


def to_bf16_bits(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = np.where(nan, (u >> 16) | 0x40, r)
    return r.astype(np.uint16)


def f16_trunc(x):
    """float32 -> f16 bits with the mantissa truncated and subnormals flushed (the Go quantizer)."""
    u = np.asarray(x, np.float32).reshape(-1).view(np.uint32).astype(np.int64)
    sign = (u >> 16) & 0x8000
    e = ((u >> 23) & 0xFF) - 127 + 15
    m = u & 0x7FFFFF
    out = np.where(e >= 31, sign | 0x7C00, np.where(e <= 0, sign, sign | (np.clip(e, 0, 31) << 10) | (m >> 13)))
    return out.astype(np.uint16)


def round_half_away(x):
    x = np.asarray(x, dtype=np.float64)
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def quantize(x, method, compat=False):
    """Reference quantizer for q*/k* (weights domain, default clips = -+max|x|): payload bytes."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    bits, fam = BITS[method], FAMILY[method]
    qmax = (1 << (bits - 1)) - 1
    bpr = -(-cols // 32)
    pad = np.zeros((rows, bpr * 32), np.float32)
    pad[:, :cols] = x
    blocks = pad.reshape(rows, bpr, 32)
    bmax = np.abs(blocks).max(axis=2).astype(np.float32)
    bscale = np.where(bmax > 0, bmax / np.float32(qmax), np.float32(0)).astype(np.float32)
    regs, total = layout(method, rows, cols)
    out = np.zeros(total, np.uint8)

    def enc16(v):
        return f16_trunc(v) if compat else to_f16_bits(v)

    if fam == "block":
        h = enc16(bscale).reshape(rows, bpr)
        used = bscale if compat else f16_scale(h)
        o, n = regs["scales"]
        out[o:o + n] = h.reshape(-1).view(np.uint8)
    else:
        spr = -(-bpr // 8)
        padded = np.zeros((rows, spr * 8), np.float32)
        padded[:, :bpr] = bscale
        sup = padded.reshape(rows, spr, 8).max(axis=2).astype(np.float32)
        h = enc16(sup)
        supv = sup if compat else f16_scale(h).reshape(rows, spr)
        o, n = regs["super_scales"]
        out[o:o + n] = h.reshape(-1).view(np.uint8)
        supb = np.repeat(supv, 8, axis=1)[:, :bpr]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = (bscale / supb).astype(np.float32)
            u = round_half_away((ratio * np.float32(32.0)).astype(np.float32))
        u6 = np.where((bscale > 0) & (supb > 0), np.clip(u, 1, 63), 0).astype(np.uint8)
        o, n = regs["sub_scales"]
        out[o:o + n] = u6.reshape(-1)
        used = np.where((u6 > 0) & (supb > 0), supb * (u6.astype(np.float32) / np.float32(32.0)),
                        np.float32(0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(used != 0, np.float32(1.0) / used, np.float32(0)).astype(np.float32)
    prod = (blocks * inv[:, :, None]).astype(np.float32)
    q = np.clip(round_half_away(prod), -qmax, qmax).astype(np.int64)
    q = np.where(used[:, :, None] != 0, q, 0)
    # pack LSB-first
    u = (q & ((1 << bits) - 1)).astype(np.uint8).reshape(rows * bpr, 32)
    bitsarr = ((u[:, :, None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(rows * bpr, 32 * bits)
    packed = np.packbits(bitsarr, axis=1, bitorder="little")
    o, n = regs["data"]
    out[o:o + n] = packed.reshape(-1)
    return out


def raw_quantize_codes(x, bits, scale, zero):
    """int8/int4 codes as the spec defines them: q = clamp(round_half_away(x / scale + zero), qmin, qmax)
    with x * (1 / scale) and the + zero each rounded to float32; rows packed (int4: item 0 in the low
    nibble, odd rows padded to a whole byte)."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    qmax, qmin = (1 << (bits - 1)) - 1, -(1 << (bits - 1))
    if scale == 0:
        q = np.zeros(x.shape, np.int64)
    else:
        with np.errstate(over="ignore"):
            inv = np.float32(1.0) / np.float32(scale)
        if np.isfinite(inv):
            p = ((x * inv).astype(np.float32) + np.float32(zero)).astype(np.float32)
        else:  # a scale below 2**-128: x / scale (x * inf would be NaN for x = 0)
            p = ((x / np.float32(scale)).astype(np.float32) + np.float32(zero)).astype(np.float32)
        q = np.clip(round_half_away(p), qmin, qmax).astype(np.int64)
    if bits == 8:
        return q.astype(np.int8).view(np.uint8)
    u = (q & 0xF).astype(np.uint8)
    if cols % 2:
        u = np.concatenate([u, np.zeros((rows, 1), np.uint8)], axis=1)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def exact_round_bits(x, kind):
    """float64 values -> f16 or bf16 bit patterns (uint16), rounded ONCE to nearest even from the exact
    value, with exact rational arithmetic (fractions): the independent reference for every
    float64 -> half conversion.  Overflow gives infinity; NaN a quiet NaN of the same sign."""
    import math
    from fractions import Fraction

    man, emin, ebits = {"f16": (10, -14, 5), "bf16": (7, -126, 8)}[kind]
    bias = (1 << (ebits - 1)) - 1
    top = (2 - Fraction(1, 1 << man)) * Fraction(2) ** bias          # the largest finite value
    halfway = top + Fraction(2) ** (bias - man - 1)                  # ties to even round to infinity
    out = []
    for v in np.asarray(x, np.float64).reshape(-1):
        v = float(v)
        sign = 0x8000 if math.copysign(1.0, v) < 0 else 0
        if math.isnan(v):
            out.append(sign | (((1 << ebits) - 1) << man) | (1 << (man - 1)))
            continue
        a = Fraction(abs(v)) if math.isfinite(v) else None
        if a is None or a >= halfway:
            out.append(sign | (((1 << ebits) - 1) << man))
            continue
        e = max(math.floor(math.log2(a)) if a else emin, emin)
        if a and Fraction(2) ** e > a:  # log2 rounding at exact powers of two
            e -= 1
        e = max(e, emin)
        ulp = Fraction(2) ** (e - man)
        q = a / ulp
        n = math.floor(q)
        r = q - n
        if r > Fraction(1, 2) or (r == Fraction(1, 2) and n % 2):
            n += 1
        if n == 0:
            out.append(sign)
            continue
        if n >= 2 << man:   # carried into the next binade
            n //= 2
            e += 1
        if n < 1 << man:    # subnormal
            out.append(sign | n)
        else:
            out.append(sign | ((e + bias) << man) | (n - (1 << man)))
    return np.array(out, np.uint16).reshape(np.shape(x))
