"""A read plan turned into ranged GETs: neighbouring ranges merged, long runs cut into even parts.

Each part is one request; its ``sinks`` are the pieces of the caller's buffers it fills, so a part that
spans several tensors (small ones side by side, or a small gap between two) is scattered into them straight
from the response, and a tensor larger than a part is filled by several parts in flight together.  The
bytes of a gap are fetched and dropped: one request costs a round trip, which on an object store is worth
about a megabyte of transfer (object_store's own default gap), but a gap is paid for in bytes downloaded.
So two neighbours share a request only when the gap between them is at most ``coalesce`` bytes AND the
gaps of the run stay at most ``waste`` (a quarter) of the bytes wanted in it: the tensors of a checkpoint,
separated by alignment padding, merge; one rank's column share of a matrix (a short piece of every row,
three times as long a gap to the next) does not, and downloads its own bytes, not the whole matrix.
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


DEFAULT_WASTE = 0.25


def plan(ranges, *, part_size: int, coalesce: int, waste: float = DEFAULT_WASTE) -> list:
    """Parts covering every (offset, memoryview) of ``ranges``, in file order.  Overlapping and adjacent
    ranges share requests, and so do ranges at most ``coalesce`` bytes apart while the gap bytes of their
    run stay at most ``waste`` times the bytes wanted (the run downloads at most ``1 + waste`` times what it
    delivers); each run is cut into ``ceil(run / part_size)`` parts of equal size (give or take a byte),
    none larger than ``part_size``."""
    items = sorted(((int(off), mv) for off, mv in ranges if len(mv)), key=lambda r: r[0])
    runs = []   # [start, end, [(off, mv), ...], bytes wanted, gap bytes]
    for off, mv in items:
        end = off + len(mv)
        if runs:
            run = runs[-1]
            gap = off - run[1]
            new = max(0, end - max(off, run[1]))     # bytes this range adds beyond the run's end
            if gap <= 0 or (gap <= coalesce and run[4] + gap <= waste * (run[3] + new)):
                run[1] = max(run[1], end)
                run[2].append((off, mv))
                run[3] += new
                run[4] += max(0, gap)
                continue
        runs.append([off, end, [(off, mv)], len(mv), 0])
    parts = []
    for start, end, members, _, _ in runs:
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
