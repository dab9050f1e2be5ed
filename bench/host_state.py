"""The state of this shared machine next to a figure: the load average, and the share of the cores other
processes used while a measurement ran (bench/README.md, "How to read the results": figures drift +-25%
with the other work here, so every figure carries the host state it was taken in).

Used by bench/conftest.py (in-process benchmarks) and the loading benchmarks' fresh child processes
(bench/load_child.py), so both compute "other" the same way.
"""

from __future__ import annotations

import os
import time

__all__ = ["load_average", "cpu_snapshot", "other_cpu", "machine", "drop_caches"]


def load_average() -> float:
    """The 1-minute load average."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def cpu_snapshot():
    """(busy seconds of the whole machine, this process's CPU seconds, wall time), or None off Linux.
    Busy counts user, nice, system, irq, softirq and steal time (the hypervisor's other guests)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    except (OSError, ValueError, IndexError):
        return None
    t = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system, time.monotonic()


def other_cpu(start, end=None, min_seconds: float = 0.5):
    """Fraction of the machine's cores (0..1) used by other processes between two snapshots: the other
    work the measurement competed with.  None when the window is too short for /proc/stat's ticks."""
    end = end if end is not None else cpu_snapshot()
    if start is None or end is None or end[2] - start[2] < min_seconds:
        return None
    other = (end[0] - start[0]) - (end[1] - start[1])
    return max(0.0, other / ((end[2] - start[2]) * (os.cpu_count() or 1)))


def machine() -> dict:
    """What the figures depend on besides the code: cores, memory, kernel, transparent huge pages."""
    def read(path):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    mem = None
    for line in (read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            mem = round(int(line.split()[1]) / 2**20, 1)
    return {"cpus": os.cpu_count(), "mem_gib": mem, "kernel": os.uname().release,
            "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag")}


def drop_caches() -> None:
    """Empty the page cache (root only): what a cold measurement starts from."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
