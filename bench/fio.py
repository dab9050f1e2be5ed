"""The storage's limit for a cold read: fio's sequential read of the same file, as the loading benchmarks
(bench/load_peers.py) and the read engine's settings sweep (bench/read_engine_settings.py) take it.

8 MiB blocks, ``--readonly``, buffered or O_DIRECT, ``jobs`` processes each reading its own consecutive
part of the file (``--offset_increment``) with ``psync``; fio reports the bandwidth it measured itself.
The caller drops the page cache first.
"""

from __future__ import annotations

import shutil
import subprocess

__all__ = ["available", "sequential_read"]


def available() -> bool:
    return shutil.which("fio") is not None


def sequential_read(path: str, size: int, *, direct: bool, jobs: int) -> float:
    """GB/s of fio's sequential read of the first ``size`` bytes of ``path`` (NaN if fio gave nothing)."""
    r = subprocess.run(["fio", "--name=seq", f"--filename={path}", "--readonly", "--rw=read", "--bs=8M",
                        f"--direct={int(direct)}", f"--numjobs={jobs}", "--group_reporting",
                        f"--size={size // jobs}", f"--offset_increment={size // jobs}", "--ioengine=psync",
                        "--output-format=terse", "--terse-version=3"],
                       capture_output=True, text=True, timeout=600)
    fields = r.stdout.strip().split(";")
    kib_s = float(fields[6]) if len(fields) > 6 else float("nan")   # terse v3: field 6 is the read bandwidth
    return kib_s * 1024 / 1e9
