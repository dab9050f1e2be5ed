"""Memory a file makes mcf allocate: the one rule every reader follows before it allocates what a header sizes.

A header says how large each tensor is, and the readers allocate accordingly: the arrays a loader returns, a
decoded tensor, the bytes of a tensor read from a source that is not mapped.  A damaged or crafted header, or a
remote object that claims an absurd size, can ask for exabytes.  Each such allocation goes through
:func:`allocating`, which

- refuses, before anything is allocated, a request for more bytes than this machine's memory: physical RAM
  plus swap (:func:`memory_limit`).  A result is filled, every byte of it, so more than that can never
  succeed; unchecked it is a bare ``MemoryError`` at best, and with the kernel's overcommit a process the
  OOM killer ends once the pages are touched.  A loader counts all the results of one call together (they are
  all alive in the dict it returns);
- turns the ``MemoryError`` of an allocation the allocator refuses anyway (a lower limit: ``ulimit -v``, a
  container's cgroup) into the same :class:`mcf.errors.AllocationError`.

Both errors name the file, the tensor and the bytes.  Zero-copy views of a mapped file allocate nothing and
are never refused: a mapped checkpoint may be larger than the memory.
"""

from __future__ import annotations

import contextlib
import functools
import os

from mcf.errors import AllocationError, MCFError

__all__ = ["memory_limit", "check_fits", "allocating", "refused", "human_bytes"]

_ADDRESS_SPACE = (1 << 63) - 1


@functools.lru_cache(maxsize=1)
def memory_limit() -> int:
    """Bytes of physical memory plus swap (``sysconf``; swap from ``/proc/meminfo`` on Linux, none counted
    elsewhere), or less where the process's control group says so (a container's ``memory.max`` plus its
    ``memory.swap.max``, cgroup v2; ``memory.memsw.limit_in_bytes`` or ``memory.limit_in_bytes`` plus swap,
    v1): the most one call may allocate for a file's contents; the address space when the system does not
    say."""
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return _ADDRESS_SPACE
    if phys <= 0:
        return _ADDRESS_SPACE
    swap = _swap_bytes()
    return min(phys + swap, _cgroup_limit(swap), _ADDRESS_SPACE)


CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
_UNLIMITED = 1 << 62       # cgroup v1 writes "no limit" as a number near 2**63


def _read_limit(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    if not text.isdigit():          # "max": no limit
        return None
    n = int(text)
    return None if n >= _UNLIMITED else n


def _cgroup_limit(swap: int) -> int:
    """The memory (and swap) the process's control group allows, or the address space where none is set.
    Each group on the path from the process's own to the root is read (the tightest wins), at the path
    ``/proc/self/cgroup`` names and at the mount's root (what a container sees of its own group)."""
    try:
        with open(PROC_CGROUP, "rb") as f:
            lines = f.read(1 << 16).decode(errors="replace").splitlines()
    except OSError:
        return _ADDRESS_SPACE
    best = _ADDRESS_SPACE
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            base, files = CGROUP_ROOT, (("memory.max", "memory.swap.max"),)
        elif "memory" in controllers.split(","):
            base, files = os.path.join(CGROUP_ROOT, "memory"), (("memory.limit_in_bytes", None),
                                                                ("memory.memsw.limit_in_bytes", "memsw"))
        else:
            continue
        dirs, parts = [base], [p for p in path.split("/") if p and p != ".."]
        for k in range(1, len(parts) + 1):
            dirs.append(os.path.join(base, *parts[:k]))
        for d in dirs:
            for mem_name, extra in files:
                mem = _read_limit(os.path.join(d, mem_name))
                if mem is None:
                    continue
                if extra == "memsw":               # v1: memory and swap together
                    best = min(best, mem)
                elif extra is None:                # v1: memory alone, swap as the machine has it
                    best = min(best, mem + swap)
                else:                              # v2: memory, plus the group's swap (or the machine's)
                    sw = _read_limit(os.path.join(d, extra))
                    best = min(best, mem + (swap if sw is None else min(sw, swap)))
    return best


def _swap_bytes() -> int:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"SwapTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def human_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``2.0 EiB``)."""
    for unit in ("EiB", "PiB", "TiB", "GiB", "MiB", "KiB"):
        scale = 1 << (10 * ("KMGTPE".index(unit[0]) + 1))
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _where(path, tensor, what) -> str:
    if what is not None:
        return f"{path}: {what}"
    return f"{path}: tensor {tensor!r}" if tensor is not None else str(path)


def check_fits(nbytes: int, path, tensor, *, total: int | None = None, what: str | None = None) -> None:
    """Refuse ``nbytes`` for ``tensor`` of ``path`` (``what`` names something else: "section TensorIndex";
    with ``total``: the bytes of a whole load, this tensor included) when they are more than
    :func:`memory_limit`."""
    limit = memory_limit()
    asked = nbytes if total is None else total
    if asked <= limit:
        return
    need = (f"needs {nbytes} bytes ({human_bytes(nbytes)})" if total is None or total == nbytes else
            f"({nbytes} bytes) brings this load to {total} bytes ({human_bytes(total)})")
    raise AllocationError(f"{_where(path, tensor, what)} {need}, more than this machine's memory (RAM + swap: "
                          f"{human_bytes(limit)}); refused before allocating")


@contextlib.contextmanager
def allocating(nbytes: int, path, tensor, *, source=None, total: int | None = None, what: str | None = None):
    """Around code that allocates ``nbytes`` for ``tensor`` (or ``what``) of ``path``: :func:`check_fits` first
    (skipped when ``source`` is given and mapped: its views allocate nothing), then a ``MemoryError`` raised
    inside becomes :class:`mcf.errors.AllocationError` with the same names."""
    if source is None or not source.is_mapped:
        check_fits(nbytes, path, tensor, total=total, what=what)
    try:
        yield
    except MemoryError as exc:
        if isinstance(exc, MCFError):
            raise
        raise refused(nbytes, path, tensor, str(exc), what=what) from None


def refused(nbytes: int, path, tensor, why: str, *, what: str | None = None) -> AllocationError:
    """The error for ``nbytes`` for ``tensor`` (or ``what``) of ``path`` that the allocator refused, saying
    ``why``."""
    return AllocationError(f"{_where(path, tensor, what)}: {nbytes} bytes ({human_bytes(nbytes)}) could not be "
                           f"allocated: {why or 'out of memory'}")
