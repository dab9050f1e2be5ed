"""Peak memory of convert_gguf: converting a ~430 MB GGUF file keeps the resident set of the converting
process far below the file size (measured in a subprocess from /proc: VmHWM after clear_refs)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures", "gguf"))
import gguf_fixtures as fx  # noqa: E402 - from the path above

ROWS = COLS = 4096
LAYOUT = [("F16", 6), ("Q4_K", 4), ("Q8_0", 4), ("F32", 2)]

CHILD = r"""
import json, sys
import mcf.gguf as G
import mcf.conversion.gguf as GC

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)

src, dst, mmap, method = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] or None
GC.convert_gguf(src, dst + ".warm", method=method, mmap=mmap)  # first run: imports, allocator state
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
base = status("VmRSS")
stats = GC.convert_gguf(src, dst, method=method, mmap=mmap)
print(json.dumps({"base": base, "peak": status("VmHWM"), "out": sum(s.nbytes_out for s in stats),
                  "how": sorted({s.how for s in stats})}))
"""


def _write_big_gguf(path):
    """Written one tensor at a time (GGUFWriter.add_tensor_info + write_tensor_data), so this process
    never holds the whole file either."""
    w = gguf.GGUFWriter(path, "llama")
    plan = []
    for tname, count in LAYOUT:
        for i in range(count):
            qt = fx.qtype(tname)
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            nbytes = ROWS * COLS // bs * ts
            plan.append((f"{tname.lower()}.{i}", tname, nbytes))
            if tname in ("F16", "F32"):
                w.add_tensor_info(plan[-1][0], (ROWS, COLS), np.dtype(np.float16 if tname == "F16" else np.float32),
                                  nbytes)
            else:
                w.add_tensor_info(plan[-1][0], (ROWS, COLS * ts // bs), np.dtype(np.uint8), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, tname, _nbytes in plan:
        rng = fx.rng_for("memory " + name)
        if tname == "F16":
            a = (rng.standard_normal((ROWS, COLS), dtype=np.float32) * 0.02).astype(np.float16)
        elif tname == "F32":
            a = rng.standard_normal((ROWS, COLS), dtype=np.float32) * 0.02
        else:
            bs, ts = gguf.GGML_QUANT_SIZES[fx.qtype(tname)]
            a = fx.random_blocks(tname, ROWS * COLS // bs, rng, normal=True).reshape(ROWS, -1)
        w.write_tensor_data(a)
        del a
    w.close()


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf_mem") / "big.gguf")
    _write_big_gguf(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("mmap,method", [(False, ""), (True, ""), (False, "native")],
                         ids=["pread", "mmap", "pread-native"])
def test_convert_peak_rss_stays_far_below_the_file_size(big_gguf, tmp_path, mmap, method):
    size = os.path.getsize(big_gguf)
    assert size > 400e6
    dst = str(tmp_path / "out.mcf")
    r = subprocess.run([sys.executable, "-c", CHILD, big_gguf, dst, "1" if mmap else "0", method],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    grew = m["peak"] - m["base"]
    assert m["out"] > size  # the float outputs are bigger than the input: nothing was skipped
    if method == "native":
        assert "native" in m["how"]
    # streamed in 1 MiB chunks: measured +1 MiB (pread), +15 MiB (mmap), +2.7 MiB (native) for a 424 MiB
    # file (~830 MB of output); without MADV_DONTNEED on consumed ranges the mmap run grows by the whole
    # file (440 MiB)
    assert grew < 32 << 20, f"peak RSS grew by {grew / 2**20:.0f} MiB converting a {size / 2**20:.0f} MiB file"
    for p in (dst, dst + ".warm"):
        os.unlink(p)
