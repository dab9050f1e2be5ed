"""A small deterministic mutator: the libFuzzer-free way to drive the targets (CI, or atheris missing).

It does what matters most for binary headers: flip bits, overwrite bytes, plant "interesting" integers
(0, 1, -1, powers of two, near-max, the input's own size) as u8/u16/u32/u64 at any offset, truncate,
cut or duplicate runs, and splice two corpus inputs.  Given the same ``random.Random`` seed it produces
the same inputs, so a failure in CI reproduces exactly.
"""

from __future__ import annotations

import random
import struct

_WIDTHS = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}


def _interesting(rng: random.Random, width: int, size: int) -> int:
    top = 2 ** (8 * width) - 1
    v = rng.choice([0, 1, 2, 7, 8, 16, 40, 64, 255, 256, 4096, size, size - 8, size + 8, top, top - 1,
                    top - 7, top // 2, top // 2 + 1, 2**31, 2**32, 2**62, rng.getrandbits(8 * width)])
    return v & top


def mutate(data: bytes, rng: random.Random, corpus=()) -> bytes:
    """One input derived from ``data`` by 1-4 random edits."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        n = len(b)
        if op == 0 and n:                                   # flip one bit
            b[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:                                 # set one byte
            b[rng.randrange(n)] = rng.randrange(256)
        elif op in (2, 3) and n:                            # plant an interesting integer
            width = rng.choice([1, 2, 4, 8])
            if n >= width:
                pos = rng.randrange(n - width + 1)
                if op == 3:
                    pos -= pos % width                      # aligned, where header fields live
                struct.pack_into(_WIDTHS[width], b, pos, _interesting(rng, width, n))
        elif op == 4:                                       # truncate
            del b[rng.randrange(n + 1):]
        elif op == 5 and n:                                 # cut a run
            i = rng.randrange(n)
            del b[i:i + rng.randint(1, 64)]
        elif op == 6 and n:                                 # duplicate a run
            i = rng.randrange(n)
            j = rng.randrange(n + 1)
            b[j:j] = b[i:i + rng.randint(1, 64)]
        elif op == 7 and corpus:                            # splice with another input
            other = rng.choice(corpus)
            i = rng.randrange(len(b) + 1)
            j = rng.randrange(len(other) + 1)
            b = b[:i] + bytearray(other[j:])
    return bytes(b)
