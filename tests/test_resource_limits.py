"""What a file can make mcf allocate: results sized by a header are refused with an MCFError naming the file,
the tensor and the size when they cannot be allocated, and parsing a safetensors header takes a bounded
multiple of its size (docs/reliability.md, "Memory a file can ask for")."""

from __future__ import annotations

import io
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import mcf
import mcf.gguf
import mcf.safetensors
from mcf._core import memory
from mcf.errors import AllocationError


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


# -- allocations sized by a file ------------------------------------------------------------------------------

class _Claims(io.RawIOBase):
    """A file-like object that claims ``size`` bytes (as a remote object's HEAD may): ``data``, then zeros."""

    def __init__(self, data: bytes, size: int, name: str = "claims.safetensors"):
        self.data, self.size, self.pos, self.name = data, size, 0, name

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, off, whence=0):
        self.pos = off if whence == 0 else (self.pos + off if whence == 1 else self.size + off)
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        mv = memoryview(b).cast("B")
        chunk = self.data[self.pos:self.pos + len(mv)]
        mv[:len(chunk)] = chunk
        mv[len(chunk):] = bytes(len(mv) - len(chunk))
        self.pos += len(mv)
        return len(mv)


def _claimed_safetensors(dtype: str, shape: list, itemsize: int) -> _Claims:
    n = math.prod(shape) * itemsize
    h = json.dumps({"big": {"dtype": dtype, "shape": shape, "data_offsets": [0, n]}}).encode()
    return _Claims(struct.pack("<Q", len(h)) + h, 8 + len(h) + n)


HUGE = "tensor 'big' needs 2305843009213693952 bytes \\(2.0 EiB\\), more than this machine's memory"


@pytest.mark.parametrize("how", ["safetensors.load_file", "load_state_dict", "SafetensorsTensor.array",
                                 "torch.load_file"])
def test_a_2_eib_tensor_is_refused_before_allocating(how):
    """A source that claims 2 EiB and a header declaring a 2 EiB tensor: before, numpy's bare MemoryError (and
    torch's RuntimeError); now an AllocationError (a MemoryError too) naming the file, the tensor and the size,
    raised before anything is allocated."""
    f = _claimed_safetensors("U8", [1 << 61], 1)
    with pytest.raises(AllocationError, match="claims.safetensors: " + HUGE) as e:
        if how == "safetensors.load_file":
            mcf.safetensors.load_file(f)
        elif how == "load_state_dict":
            mcf.load_state_dict(f)
        elif how == "SafetensorsTensor.array":
            mcf.safetensors.SafetensorsFile(f).tensors["big"].array()
        else:
            pytest.importorskip("torch", reason="torch is not installed (an optional extra)")
            import mcf.torch as torch_loader
            torch_loader.load_file(f)
    assert isinstance(e.value, MemoryError) and "refused before allocating" in str(e.value)


def _limit(monkeypatch, nbytes):
    monkeypatch.setattr(memory, "memory_limit", lambda: nbytes)


def test_the_results_of_one_load_count_together(tmp_path, monkeypatch):
    """Each tensor fits, both together do not: the second is refused (nothing has been read yet); views of a
    mapped file allocate nothing and are never refused."""
    a = np.zeros(600 << 10, np.uint8)
    path = tmp_path / "two.safetensors"
    _write_safetensors(path, {"a": a, "b": a})
    _limit(monkeypatch, 1 << 20)
    with pytest.raises(AllocationError, match=r"two.safetensors: tensor 'b' \(614400 bytes\) brings this load to "
                                              r"1228800 bytes \(1.2 MiB\), more than this machine's memory"):
        mcf.safetensors.load_file(path)
    assert set(mcf.safetensors.load_file(path, names=["a"])) == {"a"}
    views = mcf.safetensors.load_file(path, copy=False, mmap=True)
    assert not views["b"].flags.owndata


def test_an_allocation_the_allocator_refuses_is_named(monkeypatch):
    """Below the machine rule (here: no rule at all), the allocator may still refuse (ulimit -v, a cgroup):
    its MemoryError becomes an AllocationError naming the file, the tensor and the size."""
    _limit(monkeypatch, (1 << 63) - 1)
    f = _claimed_safetensors("U8", [1 << 61], 1)
    with pytest.raises(AllocationError, match=r"claims.safetensors: tensor 'big': 2305843009213693952 bytes "
                                              r"\(2.0 EiB\) could not be allocated"):
        mcf.safetensors.load_file(f)


def test_mcf_and_gguf_decoders_check_what_they_allocate(tmp_path, monkeypatch):
    """Container.tensor/raw/to_float32/dequantize (read with pread: fresh memory) and GGUFFile.dequantize: the
    result and the bytes read count; a row range counts only its rows."""
    w = np.ones((64, 256), np.float32)
    with mcf.Writer(tmp_path / "w.mcf") as wr:
        wr.add_tensor("w", w)
    _limit(monkeypatch, 64 * 256 * 4 + 1000)   # the stored bytes fit, stored + decoded do not
    with mcf.open(tmp_path / "w.mcf", mmap=False) as c:
        assert c.tensor("w").shape == (64, 256) and c.raw("w").size == w.nbytes
        for call in (lambda: c.to_float32("w"), lambda: c.dequantize("w")):
            with pytest.raises(AllocationError, match=r"w.mcf: tensor 'w' needs 131072 bytes \(128.0 KiB\)"):
                call()
    with mcf.open(tmp_path / "w.mcf") as c:   # mapped: only the result counts
        assert c.to_float32("w").shape == (64, 256)
        _limit(monkeypatch, 64 * 256 * 4 - 1)
        with pytest.raises(AllocationError, match=r"w.mcf: tensor 'w' needs 65536 bytes"):
            c.dequantize("w")
        assert c.dequantize("w", rows=(0, 4)).shape == (4, 256)
    gg = os.path.join(os.path.dirname(__file__), "fixtures", "gguf", "golden_v3.gguf")
    with mcf.gguf.open(gg) as g:
        name, t = max(g.tensors.items(), key=lambda kv: math.prod(kv[1].shape))
        n = math.prod(t.shape)
        _limit(monkeypatch, n * 4 - 1)
        with pytest.raises(AllocationError, match=f"golden_v3.gguf: tensor '{name}' needs {n * 4} bytes"):
            g.dequantize(name)
        _limit(monkeypatch, n * 4)
        assert g.dequantize(name).size == n


def _write_safetensors(path, tensors: dict) -> None:
    header, off, blobs = {}, 0, []
    for name, a in tensors.items():
        header[name] = {"dtype": "U8", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
        blobs.append(a.tobytes())
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_torch_allocator_refusal_is_named(monkeypatch):
    """torch's CPU allocator refuses with a RuntimeError ("can't allocate memory"): an AllocationError too."""
    pytest.importorskip("torch", reason="torch is not installed (an optional extra)")
    import mcf.torch as mtorch
    _limit(monkeypatch, (1 << 63) - 1)
    with pytest.raises(AllocationError, match=r"claims.safetensors: tensor 'big': 2305843009213693952 bytes "
                                              r"\(2.0 EiB\) could not be allocated: .*allocate"):
        mtorch.load_file(_claimed_safetensors("U8", [1 << 61], 1))


def test_an_mcf_section_larger_than_the_memory_is_refused():
    """An MCF file (a source that claims 2 EiB) whose TensorIndex section says it is 1 EiB: refused when the
    index is read, naming the file and the section, instead of the read buffer's bare MemoryError."""
    from mcf.container.layout import DIR_ENTRY, HEADER, HEADER_SIZE, MAGIC, MAJOR, MINOR, SectionType

    size = 1 << 60
    start = HEADER_SIZE + 2 * DIR_ENTRY.size
    total = start + size + 8
    head = (HEADER.pack(MAGIC, MAJOR, MINOR, HEADER_SIZE, 2, HEADER_SIZE, total, 0)
            + DIR_ENTRY.pack(SectionType.TENSOR_INDEX, 1, start, size)
            + DIR_ENTRY.pack(SectionType.TENSOR_DATA, 1, start + size, 8))
    with pytest.raises(AllocationError, match=r"claims.mcf: section TensorIndex needs 1152921504606846976 bytes "
                                              r"\(1.0 EiB\), more than this machine's memory"):
        mcf.open(_Claims(head, total, name="claims.mcf"))


@pytest.mark.parametrize("version", ["v2", "v1", "v1-memsw", "none"])
def test_a_control_groups_limit_bounds_what_a_file_may_ask_for(tmp_path, monkeypatch, version):
    """In a container the machine's RAM is not what the process may use: the control group's memory limit (and
    its swap limit) bounds the allocation rule too, at any level of the group's path."""
    from mcf._core import memory

    root = tmp_path / "cgroup"
    proc = tmp_path / "cgroup.txt"
    gib = 1 << 30
    if version == "v2":
        d = root / "a" / "b"
        d.mkdir(parents=True)
        (root / "a" / "memory.max").write_text(str(3 * gib))
        (d / "memory.max").write_text("max")
        (root / "a" / "memory.swap.max").write_text(str(gib))
        proc.write_text("0::/a/b\n")
        want = 3 * gib + 7         # the group allows 1 GiB of swap, the machine has 7 bytes
    elif version.startswith("v1"):
        d = root / "memory" / "docker" / "x"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(str(2 * gib))
        if version == "v1-memsw":
            (d / "memory.memsw.limit_in_bytes").write_text(str(2 * gib + 5))
        (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")   # the root: no limit
        proc.write_text("4:memory:/docker/x\n0::/\n")
        want = 2 * gib + (5 if version == "v1-memsw" else 7)
    else:
        root.mkdir()
        proc.write_text("0::/\n")
        want = None
    monkeypatch.setattr(memory, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(memory, "PROC_CGROUP", str(proc))
    got = memory._cgroup_limit(7)
    if want is None:
        assert got >= 1 << 62
    else:
        assert got == want
        memory.memory_limit.cache_clear()
        try:
            assert memory.memory_limit() <= want
        finally:
            monkeypatch.undo()
            memory.memory_limit.cache_clear()
