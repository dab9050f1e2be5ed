"""One load of the loading benchmarks, in the fresh process this script is: bench/load_peers.py and
bench/remote_throughput.py start it once per measurement.

    python bench/load_child.py '{"case": "mcf.safetensors", "state": "cold", "verify": true}'

Why a fresh process per run: the page cache state (dropped or touched right before, here, after the
imports), the allocator (no memory freed by an earlier run to reuse: every loader pays for fresh memory,
as a server starting up does) and the peak RSS are then this run's own.  What is timed is the load and
the touch a user pays, after every import: for every result, one byte of every 4 KiB page is read
(``touch_pages``), which materialises mapped tensors (safetensors' default) and costs next to nothing on
memory the loader already filled, so every loader is charged for having the whole checkpoint in memory.

The child prints one JSON line: seconds, bytes of the result, peak RSS (VmHWM) and RSS before the load,
the host state over the timed window (load average, other processes' share of the cores), the bytes
this process read from storage (/proc/self/io ``read_bytes``: readahead included), what the loader says
it read (``bytes_read``, for mcf), and with ``verify`` whether every tensor's bytes match the CRC-32s of
the checkpoint's manifest (a tensor-parallel slice: its bytes in the file).
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_common import touch_files  # noqa: E402
from host_state import cpu_snapshot, drop_caches, load_average, other_cpu  # noqa: E402
from loading_model import loading_model, tp_plan  # noqa: E402

MiB = 1 << 20


# -- the cases ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """``setup(m, spec) -> (load, info)``: imports and arguments (untimed); ``load()`` returns the result
    (a dict of tensors or arrays); ``info(result) -> dict`` adds what the loader reports, after timing.
    ``files(m, spec)``: the local files whose page cache is dropped or touched first."""
    setup: Callable
    files: Callable
    result: str = "tensors"    # "tensors": the checkpoint; "slices": rank 0 of 4 (tp_plan); "file": a file's
                               # bytes; "ranges": the same in parts


def _single(m, spec):
    return [m.single]


def _mcf_file(m, spec):
    return [m.mcf]


def _shards(m, spec):
    return m.shard_files


def _none(m, spec):
    return []


def _src_of(m, spec, key):
    return spec.get("url") or getattr(m, key)


def _mcf_numpy_st(m, spec):
    import mcf.safetensors
    path = _src_of(m, spec, "single")
    kwargs = spec.get("kwargs", {})   # threads=, chunk_bytes= of a settings sweep; none by default
    return (lambda: mcf.safetensors.load_file(path, **kwargs)), None


def _mcf_numpy_mcf(m, spec):
    import mcf
    path = _src_of(m, spec, "mcf")
    return (lambda: mcf.load_file(path)), None


def _mcf_numpy_sharded(m, spec):
    import mcf.safetensors
    path = _src_of(m, spec, "sharded")
    return (lambda: mcf.safetensors.load_file(path)), None


def _mcf_torch(key):
    def setup(m, spec):
        import mcf.torch
        path = _src_of(m, spec, key)
        return (lambda: mcf.torch.load_file(path)), None
    return setup


def _engine_info(sources):
    def info(result):
        return {"bytes_read": sum(s.bytes_read for s in sources()),
                "read_stats": [str(s.read_stats) for s in sources() if s.read_stats is not None]}
    return info


def _mcf_slices_st(m, spec):
    import mcf.safetensors
    plan = tp_plan(0, 4)
    held = {}

    def load():
        held["ckpt"] = ckpt = mcf.safetensors.open_checkpoint(m.single)   # opened inside the timed region
        return mcf.safetensors.load_file(ckpt, slices=plan)
    return load, _engine_info(lambda: [f.source for f in held["ckpt"].files])


def _mcf_slices_mcf(m, spec):
    import mcf
    plan = tp_plan(0, 4)
    held = {}

    def load():
        held["c"] = c = mcf.open(m.mcf)
        return mcf.load_file(c, slices=plan)
    return load, _engine_info(lambda: [held["c"].source])


def _mcf_full_st(m, spec):
    """mcf.safetensors.load_file with the source at hand, for its bytes_read."""
    import mcf.safetensors
    held = {}

    def load():
        held["ckpt"] = ckpt = mcf.safetensors.open_checkpoint(m.single)
        return mcf.safetensors.load_file(ckpt)
    return load, _engine_info(lambda: [f.source for f in held["ckpt"].files])


def _mcf_full_mcf(m, spec):
    """mcf.load_file of the .mcf with the container at hand, for its bytes_read."""
    import mcf
    held = {}

    def load():
        held["c"] = c = mcf.open(m.mcf)
        return mcf.load_file(c)
    return load, _engine_info(lambda: [held["c"].source])


def _mcf_torch_slices(m, spec):
    import mcf.torch
    plan = tp_plan(0, 4)
    return (lambda: mcf.torch.load_file(m.single, slices=plan)), None


def _st_slices(m, spec):
    """safetensors' own way to load one rank's share: ``safe_open(...).get_slice(name)[...]`` per tensor
    (what vLLM and transformers' tensor-parallel loading call)."""
    from safetensors import safe_open
    plan = tp_plan(0, 4)

    def load():
        out = {}
        with safe_open(m.single, framework="pt") as f:
            for name in f.keys():
                spec_ = plan[name]
                sl = f.get_slice(name)
                if spec_ is None:
                    out[name] = sl[:]
                    continue
                shape = sl.get_shape()
                k = shape[spec_.dim] // spec_.world
                lo, hi = spec_.rank * k, (spec_.rank + 1) * k
                out[name] = sl[lo:hi] if spec_.dim == 0 else sl[:, lo:hi]
        return out
    return load, None


def _st_torch_mmap(m, spec):
    from safetensors.torch import load_file
    return (lambda: load_file(m.single)), None


def _st_torch_pread(m, spec):
    from safetensors.torch import load_file
    return (lambda: load_file(m.single, backend="pread")), None


def _st_numpy(m, spec):
    import ml_dtypes  # noqa: F401 - registers "bfloat16" with numpy, which safetensors.numpy asks for by name
    from safetensors.numpy import load_file
    return (lambda: load_file(m.single)), None


def _fastsafetensors(m, spec):
    """fastsafetensors on the CPU without GPUDirect (``nogds=True``): its pread path into a buffer per
    file, tensors as views of it (documented in its SafeTensorsFileLoader docstring)."""
    import torch  # noqa: F401 - its framework
    from fastsafetensors import SafeTensorsFileLoader
    held = []

    def load():
        loader = SafeTensorsFileLoader(None, "cpu", nogds=True)
        loader.add_filenames({0: [m.single]})
        fb = loader.copy_files_to_device()
        held.append((loader, fb))
        return {k: fb.get_tensor(k) for k in loader.get_keys()}
    return load, None


def _runai(m, spec):
    """Run:ai Model Streamer's SafetensorsStreamer to the CPU, its defaults (owned tensors)."""
    from runai_model_streamer import SafetensorsStreamer
    path = spec.get("url") or m.single

    def load():
        with SafetensorsStreamer() as s:
            s.stream_file(path)
            return dict(s.get_tensors())
    return load, None


def _memcpy_anchor(m, spec):
    """The warm anchor: the file's bytes copied by 2 threads (``memcpy`` through ctypes, which releases the
    GIL) from a mapping of the warm file, populated before timing so the source costs no fault, into one
    fresh anonymous mapping with the system's default page policy, whose pages the two threads fault in
    as they write: what a loader's destination costs, with no file system call in the way."""
    import ctypes
    import mmap
    import threading

    import numpy as np
    fd = os.open(m.single, os.O_RDONLY)
    n = os.fstat(fd).st_size
    src = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    os.close(fd)
    src_addr = np.frombuffer(src, np.uint8).ctypes.data
    huge = spec.get("anchor") == "hugepage"

    def load(_keep=src):   # the source mapping lives as long as the closure
        dst = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            dst.madvise(mmap.MADV_HUGEPAGE)
        arr = np.frombuffer(dst, np.uint8)
        half = n // 2 // 4096 * 4096
        parts = ((0, half), (half, n - half))
        ts = [threading.Thread(target=ctypes.memmove, args=(arr.ctypes.data + o, src_addr + o, k)) for o, k in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return {"file": arr}
    return load, None


def _fresh(n: int):
    """``n`` bytes of fresh anonymous memory with the system's page policy, as a uint8 array (the same in
    every checkout a case runs against)."""
    import mmap

    import numpy as np
    return np.frombuffer(mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)[:n]


def _remote_readinto(m, spec):
    """The whole object as one read, ``open_source(url).readinto(0, dst)``: the remote path with no loader
    on top, in this checkout and in an older one (the call exists in both)."""
    from mcf.io import open_source
    url = spec["url"]

    def load():
        with open_source(url) as src:
            dst = _fresh(src.size)
            src.readinto(0, dst)
        return {"file": dst}
    return load, None


def _ceiling(m, spec):
    """The same bytes as parallel ranged GETs by a bare client, obstore's ``get_ranges`` (``part``-byte
    ranges; it keeps 10 in flight and returns each as its own buffer), nothing else done: what the server
    and the client library can deliver."""
    from urllib.parse import urlsplit

    import numpy as np
    import obstore
    url, part = spec["url"], spec.get("part", 8 * MiB)
    u = urlsplit(url)
    if u.scheme == "s3":
        from obstore.store import S3Store
        store = S3Store(u.netloc, endpoint=os.environ["AWS_ENDPOINT_URL"], region=os.environ["AWS_REGION"],
                        client_options={"allow_http": True})
    else:
        from obstore.store import HTTPStore
        store = HTTPStore.from_url(f"{u.scheme}://{u.netloc}", client_options={"allow_http": True})
    key = u.path.lstrip("/")
    size = obstore.head(store, key)["size"]
    starts = list(range(0, size, part))
    ends = [min(a + part, size) for a in starts]

    def load():
        got = obstore.get_ranges(store, key, starts=starts, ends=ends, coalesce=0)
        return {str(k): np.frombuffer(b, np.uint8) for k, b in enumerate(got)}
    return load, None


CASES = {
    "mcf.safetensors": Case(_mcf_numpy_st, _single),
    "mcf.load_file.mcf": Case(_mcf_numpy_mcf, _mcf_file),
    "mcf.safetensors.sharded": Case(_mcf_numpy_sharded, _shards),
    "mcf.torch": Case(_mcf_torch("single"), _single),
    "mcf.torch.mcf": Case(_mcf_torch("mcf"), _mcf_file),
    "mcf.torch.sharded": Case(_mcf_torch("sharded"), _shards),
    "mcf.safetensors.full+stats": Case(_mcf_full_st, _single),
    "mcf.load_file.mcf.full+stats": Case(_mcf_full_mcf, _mcf_file),
    "mcf.safetensors.slices": Case(_mcf_slices_st, _single, "slices"),
    "mcf.load_file.mcf.slices": Case(_mcf_slices_mcf, _mcf_file, "slices"),
    "mcf.torch.slices": Case(_mcf_torch_slices, _single, "slices"),
    "safetensors.get_slice": Case(_st_slices, _single, "slices"),
    "safetensors.torch.mmap": Case(_st_torch_mmap, _single),
    "safetensors.torch.pread": Case(_st_torch_pread, _single),
    "safetensors.numpy": Case(_st_numpy, _single),
    "fastsafetensors": Case(_fastsafetensors, _single),
    "runai": Case(_runai, _single),
    "memcpy": Case(_memcpy_anchor, _single, "file"),
    "remote.readinto": Case(_remote_readinto, _none, "file"),
    "ceiling": Case(_ceiling, _none, "ranges"),
}


# -- what every run does -----------------------------------------------------------------------------
def _bytes_of(t):
    """A tensor's or array's bytes as a uint8 numpy array (no copy when contiguous)."""
    import numpy as np
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    import torch
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def touch_pages(result) -> int:
    """One byte of every 4 KiB page of every tensor: mapped tensors become resident (their faults are paid
    here), copied ones are merely read."""
    total = 0
    for t in result.values():
        b = _bytes_of(t)
        if b.size:
            total += int(b[::4096].sum())
    return total


def nbytes_of(result) -> int:
    return sum(_bytes_of(t).size for t in result.values())


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (readahead included; 0 from the page cache)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def verify(m, result, kind: str, file: str) -> str:
    """"ok", or what differs from the checkpoint (``file``: the local copy of what was read whole)."""
    import numpy as np
    if kind in ("file", "ranges"):
        want = 0
        with open(file, "rb") as f:
            while chunk := f.read(64 * MiB):
                want = zlib.crc32(chunk, want)
        got = 0
        for part in result.values():   # "ranges": in file order, as get_ranges returns them
            got = zlib.crc32(part, got)
        return "ok" if got == want else "the bytes differ from the file"
    names = set(m.crc)
    if set(result) != names:
        return f"names differ: {sorted(set(result) ^ names)[:4]}"
    if kind == "tensors":
        for n, want in m.crc.items():
            if zlib.crc32(_bytes_of(result[n])) != want:
                return f"{n}: bytes differ"
        return "ok"
    import mcf.safetensors
    ref = mcf.safetensors.load_file(m.single, copy=False)   # read-only views of the file
    for n, spec in tp_plan(0, 4).items():
        r = ref[n]
        if spec is not None:
            k = r.shape[spec.dim] // spec.world
            r = r[k * spec.rank:k * (spec.rank + 1)] if spec.dim == 0 else r[:, k * spec.rank:k * (spec.rank + 1)]
        if not np.array_equal(_bytes_of(result[n]), np.ascontiguousarray(r).reshape(-1).view(np.uint8)):
            return f"{n}: slice bytes differ"
    return "ok"


def run(spec: dict) -> dict:
    m = loading_model()
    case = CASES[spec["case"]]
    load, info = case.setup(m, spec)
    state = spec.get("state", "cold")
    if state == "cold":
        drop_caches()
    elif state == "warm":
        touch_files(case.files(m, spec))
    rss0 = _status("VmRSS")
    io0 = _read_bytes()
    load0 = load_average()
    snap = cpu_snapshot()
    cpu0 = os.times()
    t0 = time.perf_counter()
    result = load()
    touch_pages(result)
    seconds = time.perf_counter() - t0
    cpu1 = os.times()
    other = other_cpu(snap, min_seconds=0.05)
    out = {"case": spec["case"], "state": state, "seconds": seconds, "nbytes": nbytes_of(result),
           "rss_before": rss0, "peak_rss": _status("VmHWM"), "rss_after": _status("VmRSS"),
           "read_bytes": _read_bytes() - io0, "user_s": cpu1.user - cpu0.user, "system_s": cpu1.system - cpu0.system,
           "load": load0, "other_cpu": other}
    if info is not None:
        out.update(info(result))
    if spec.get("verify"):
        out["verified"] = verify(m, result, case.result, spec.get("file", m.single))
    return out


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
