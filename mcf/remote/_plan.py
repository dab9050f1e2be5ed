"""A read plan turned into ranged GETs: neighbouring ranges merged, long runs cut into even parts.

Each part is one request; its ``sinks`` are the pieces of the caller's buffers it fills, so a part that
spans several tensors (small ones side by side, or a gap of at most ``coalesce`` bytes between two) is
scattered into them straight from the response, and a tensor larger than a part is filled by several
parts in flight together.  The bytes of a gap are fetched and dropped: one request costs a round trip,
which on an object store is worth about a megabyte of transfer (object_store's own default gap).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

__all__ = ["Part", "plan"]


@dataclass
class Part:
    start: int
    end: int
    sinks: list = field(default_factory=list)   # (file offset, writable memoryview), inside [start, end)

    @property
    def size(self) -> int:
        return self.end - self.start

    def exact_sink(self):
        """The one destination that is exactly this part's bytes (then the part can land in place), else None."""
        if len(self.sinks) == 1:
            off, mv = self.sinks[0]
            if off == self.start and len(mv) == self.size:
                return mv
        return None


def plan(ranges, *, part_size: int, coalesce: int) -> list:
    """Parts covering every (offset, memoryview) of ``ranges``, in file order.  Ranges at most ``coalesce``
    bytes apart (or overlapping) share requests; each run of them is cut into ``ceil(run / part_size)``
    parts of equal size (give or take a byte), none larger than ``part_size``."""
    items = sorted(((int(off), mv) for off, mv in ranges if len(mv)), key=lambda r: r[0])
    runs = []   # [start, end, [(off, mv), ...]]
    for off, mv in items:
        end = off + len(mv)
        if runs and off <= runs[-1][1] + coalesce:
            run = runs[-1]
            run[1] = max(run[1], end)
            run[2].append((off, mv))
        else:
            runs.append([off, end, [(off, mv)]])
    parts = []
    for start, end, members in runs:
        n = -(-(end - start) // part_size)
        cuts = [start + (end - start) * k // n for k in range(n + 1)]
        run_parts = [Part(a, b) for a, b in zip(cuts, cuts[1:])]
        for off, mv in members:
            m_end = off + len(mv)
            k = bisect_right(cuts, off) - 1     # the first part this range touches
            while k < n and run_parts[k].start < m_end:
                p = run_parts[k]
                a, b = max(off, p.start), min(m_end, p.end)
                p.sinks.append((a, mv[a - off:b - off]))
                k += 1
        parts += [p for p in run_parts if p.sinks]
    return parts
