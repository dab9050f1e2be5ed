"""What a file can make mcf allocate: results sized by a header are refused with an MCFError naming the file,
the tensor and the size when they cannot be allocated, and parsing a safetensors header takes a bounded
multiple of its size (docs/reliability.md, "Memory a file can ask for")."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

import mcf  # noqa: F401  (the subprocesses import the same mcf)


def _many_tensors_header(nbytes: int) -> bytes:
    """A safetensors file of about ``nbytes`` of header holding nothing but empty tensors: the most tensor
    entries a header of that size can hold, so the most Python objects its parse makes."""
    parts, size, i = [], 2, 0
    while True:
        s = f'"{i:x}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
        if size + len(s) + 1 > nbytes:
            break
        parts.append(s)
        size += len(s) + 1
        i += 1
    hdr = ("{" + ",".join(parts) + "}").encode()
    return struct.pack("<Q", len(hdr)) + hdr


# Peak RSS of this process image: Linux's VmHWM, which starts afresh at exec.  getrusage's ru_maxrss would
# start at the RSS of pytest itself, whose high-water mark Linux carries over fork and exec into the child.
_PEAK = """
import resource, sys
import mcf.safetensors

def peak():
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except OSError:   # not Linux: getrusage (bytes on macOS)
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024

before = peak()
f = mcf.safetensors.SafetensorsFile(sys.argv[1], mmap=sys.argv[2] == "mmap")
print(len(f.tensors), peak() - before)
"""


@pytest.mark.parametrize("mode", ["pread", "mmap"])
def test_header_parse_memory_is_a_bounded_multiple_of_its_size(tmp_path, mode):
    """A 16 MiB header of ~300 000 empty tensors: parsing it (peak RSS growth, in a fresh process) stays under
    8x its size, the documented bound for headers of tensor entries (about 5x measured at the 100 MiB cap).
    Before, json.loads' dict and two lists per entry plus a frozen dataclass with a __dict__ per tensor took
    16x, with the garbage collector running over them again and again."""
    raw = _many_tensors_header(16 << 20)
    path = tmp_path / "many.safetensors"
    path.write_bytes(raw)
    r = subprocess.run([sys.executable, "-c", _PEAK, str(path), mode], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    count, grown = map(int, r.stdout.split())
    assert count > 250_000
    assert grown < 8 * len(raw), f"{grown / len(raw):.1f}x the header"
