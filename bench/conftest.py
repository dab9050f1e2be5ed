"""Fixtures of the MCF reader benchmarks: the ~1 GiB F16 model (built once, cached), page-cache
touching, and the summary table of ratios printed at the end of the session.

Run from the repository root (the project's ``testpaths`` only names ``tests/``, so the normal test
run never collects this directory)::

    pytest bench/ --benchmark-only -s

The model is cached in ``$MCF_BENCH_DIR`` (default ``<tempdir>/mcf-bench``) and rebuilt only when its
manifest or the file sizes do not match what this file would write.  ``MCF_BENCH_MEMORY`` (``warm``,
the default, or ``fresh``) pins the allocator state of the benchmarks that allocate (see "allocator
state" below and bench/results/reader.md).
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

import mcf
from bench_common import (bench_dir, build_once, decoder_layer_spec, drop_manifest, read_manifest, sizes_match,
                          write_manifest)
from host_state import cpu_snapshot, other_cpu

# -- the model ---------------------------------------------------------------------------------------
# A Llama/Qwen-like decoder: 28 layers of q/k/v/o (grouped-query attention, 2 KV heads of 128, with
# q/k/v biases), gate/up/down MLP and two RMSNorms, plus tied embeddings and the final norm.
# 338 tensors, 536,535,296 F16 elements = 1,073,070,592 bytes (0.999 GiB) of payload.
HIDDEN = 1280
INTERMEDIATE = 3584
KV_DIM = 256
LAYERS = 28
VOCAB = 32000
SEED = 20240607
SPEC_VERSION = 1  # bump when the layout or the data changes, to invalidate cached files


def model_spec():
    """(name, shape, kind) of every tensor, in the order they are generated and written."""
    yield "model.embed_tokens.weight", (VOCAB, HIDDEN), "weight"
    for i in range(LAYERS):
        yield from decoder_layer_spec(f"model.layers.{i}.", HIDDEN, INTERMEDIATE, KV_DIM, bias=True)
    yield "model.norm.weight", (HIDDEN,), "norm"


def _generate(rng: np.random.Generator, shape, kind) -> np.ndarray:
    """Non-zero, realistic-looking F16 values (zeros write and compress unrealistically fast)."""
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "norm":
        x *= 0.05
        x += 1.0
    else:
        x *= 0.02
    return x.astype(np.float16)


# A second, tiny container with ten times as many tensors (same naming scheme, 64-wide layers): the
# open + views time at two tensor counts separates the fixed cost from the per-tensor cost.
MANY_LAYERS = 280
MANY_DIMS = dict(hidden=64, intermediate=128, kv=32, vocab=256)


def many_spec():
    h, i_, kv, v = (MANY_DIMS[k] for k in ("hidden", "intermediate", "kv", "vocab"))
    yield "model.embed_tokens.weight", (v, h), "weight"
    for i in range(MANY_LAYERS):
        yield from decoder_layer_spec(f"model.layers.{i}.", h, i_, kv, bias=True)
    yield "model.norm.weight", (h,), "norm"


@dataclass(frozen=True)
class BenchModel:
    mcf_path: str
    st_path: str
    many_path: str               # the tiny many-tensor container
    names: tuple                 # tensor names of the main model, sorted
    n_many: int                  # tensor count of the many-tensor container
    nbytes: int                  # tensor payload bytes (what "materialize everything" produces)
    mcf_size: int
    st_size: int
    built_s: float | None        # seconds spent building, None when reused from the cache

    @property
    def n_tensors(self) -> int:
        return len(self.names)


FILES = (("mcf_size", "model.mcf"), ("st_size", "model.safetensors"), ("many_size", "many.mcf"))


def _manifest_expected() -> dict:
    spec = list(model_spec())
    return {
        "spec_version": SPEC_VERSION,
        "seed": SEED,
        "n_tensors": len(spec),
        "n_many": len(list(many_spec())),
        "payload_bytes": sum(int(np.prod(s)) * 2 for _, s, _ in spec),
        "mcf_version": mcf.__version__,
    }


def _cached(cache_dir: str, want: dict):
    got = read_manifest(cache_dir, want)
    if got is None or not sizes_match(cache_dir, {fname: got.get(key) for key, fname in FILES}):
        return None
    return got


def _write_mcf(path, spec, rng):
    # One tensor in memory at a time (the largest, the embedding, is 164 MB of float32 scratch).
    with mcf.Writer(path) as w:
        for name, shape, kind in spec:
            w.add_tensor(name, _generate(rng, shape, kind))


def _build(cache_dir: str, want: dict) -> dict:
    import safetensors.numpy as stnp

    paths = {key: os.path.join(cache_dir, fname) for key, fname in FILES}
    drop_manifest(cache_dir)
    _write_mcf(paths["mcf_size"], model_spec(), np.random.default_rng(SEED))
    _write_mcf(paths["many_size"], many_spec(), np.random.default_rng(SEED + 1))
    # The same tensors as one safetensors file, passed as zero-copy views of the MCF mapping so the
    # data never has to sit in anonymous memory.
    tmp = paths["st_size"] + f".{os.getpid()}.tmp"
    with mcf.open(paths["mcf_size"]) as c:
        stnp.save_file({n: c.tensor(n) for n in c}, tmp)
    os.replace(tmp, paths["st_size"])
    got = dict(want, **{key: os.path.getsize(path) for key, path in paths.items()})
    write_manifest(cache_dir, got)
    return got


@pytest.fixture(scope="session")
def bench_model() -> BenchModel:
    cache_dir = bench_dir()
    os.makedirs(cache_dir, exist_ok=True)
    got, built_s = build_once(cache_dir, _manifest_expected(), _cached, _build)
    names = tuple(sorted(n for n, _, _ in model_spec()))
    return BenchModel(os.path.join(cache_dir, "model.mcf"), os.path.join(cache_dir, "model.safetensors"),
                      os.path.join(cache_dir, "many.mcf"), names, got["n_many"], got["payload_bytes"],
                      got["mcf_size"], got["st_size"], built_s)


# -- page cache --------------------------------------------------------------------------------------
def aligned_buffer(nbytes: int, align: int = 4096) -> np.ndarray:
    """A uint8 array whose data starts on an ``align`` boundary (independent of mcf's helper)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


class Toucher:
    """Reads whole files through a reused, page-aligned 8 MiB buffer so that they are in the page cache
    (idle files are evicted after about a minute on this machine).  Logs the speed of every touch: below
    ~4 GB/s means the file had been evicted, i.e. the first measurement without the touch would have
    been cold."""

    def __init__(self):
        self._buf = aligned_buffer(8 << 20)
        self._buf[:] = 1
        self.log: list = []

    def __call__(self, *paths) -> None:
        mv = memoryview(self._buf)
        for path in paths:
            t0 = time.perf_counter()
            n = 0
            with open(path, "rb", buffering=0) as f:
                while True:
                    k = f.readinto(mv)
                    if not k:
                        break
                    n += k
            dt = time.perf_counter() - t0
            self.log.append((os.path.basename(path), n / dt / 1e9))


@pytest.fixture(scope="session")
def touch() -> Toucher:
    t = Toucher()
    _REPORT.touches = t.log
    return t


# -- results and the summary table -------------------------------------------------------------------
@dataclass
class Row:
    group: str
    name: str
    role: str                    # "target", "anchor", "yardstick" or "reference"
    median_s: float
    gbps: float | None = None
    note: str = ""
    other_cpu: float | None = None   # share of all cores used by other processes during the test


@dataclass
class Verdict:
    group: str
    what: str
    value: str
    target: str
    met: bool


@dataclass
class Report:
    rows: list = field(default_factory=list)
    verdicts: list = field(default_factory=list)
    model: BenchModel | None = None
    test_start: tuple | None = None
    bench: object = None             # the running test's benchmark fixture
    touches: list = field(default_factory=list)   # (file name, GB/s) of every touch

    def row(self, group, name, role, median_s, nbytes=None, note=""):
        gbps = nbytes / median_s / 1e9 if nbytes else None
        other = other_cpu(self.test_start)
        self.rows.append(Row(group, name, role, median_s, gbps, note, other))
        if self.bench is not None:
            self.bench.extra_info.update(role=role, memory_mode=memory_mode(), other_cpu=other)

    def verdict(self, group, what, value, target, met):
        self.verdicts.append(Verdict(group, what, value, target, bool(met)))


_REPORT = Report()


# -- allocator state ---------------------------------------------------------------------------------
# The materialize and mmap=False benchmarks allocate about 1 GiB per round, and whether those pages are
# already faulted in changes the result by up to 3x here (a first-touch page fault costs more than
# copying the page).  glibc's default policy makes that depend on sizes and history (mmap for large
# blocks, a dynamic threshold, trimming), so figures flipped between runs.  MCF_BENCH_MEMORY picks one
# of two deterministic states, the same for every target and anchor, applied outside timed regions:
#   warm  (default): mallopt keeps every block in the heap and never trims it, and each round's arrays
#                    are freed before the next round: allocations reuse pages that are already faulted
#                    in (a long-lived process with a warm allocator).  Measures the copy and the
#                    per-tensor overhead.
#   fresh:           after every round its arrays are freed and malloc_trim(0) returns the memory to
#                    the kernel: every round pays the first-touch page faults that loading a model
#                    once, in a new process, pays.
MEMORY_MODES = ("warm", "fresh")
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def memory_mode() -> str:
    mode = os.environ.get("MCF_BENCH_MEMORY", "warm")
    if mode not in MEMORY_MODES:
        raise pytest.UsageError(f"MCF_BENCH_MEMORY must be one of {MEMORY_MODES}, not {mode!r}")
    return mode


def _libc():
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


class Memory:
    """Applies the memory mode: :meth:`release` after dropping a round's result."""

    def __init__(self, mode: str):
        self.mode = mode
        if mode == "warm":
            if _LIBC is None or not (_LIBC.mallopt(_M_MMAP_MAX, 0)
                                     and _LIBC.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))):
                raise pytest.UsageError("MCF_BENCH_MEMORY=warm needs glibc's mallopt")

    def release(self) -> None:
        gc.collect()
        if self.mode == "fresh" and _LIBC is not None:
            _LIBC.malloc_trim(0)


@pytest.fixture(scope="session", autouse=True)
def memory() -> Memory:
    return Memory(memory_mode())


@pytest.fixture
def report(bench_model, benchmark) -> Report:
    _REPORT.model = bench_model
    _REPORT.bench = benchmark
    _REPORT.test_start = cpu_snapshot()
    yield _REPORT
    _REPORT.bench = None


def _fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:8.1f} us"
    if s < 1:
        return f"{s * 1e3:8.2f} ms"
    return f"{s:8.3f} s "


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    r = _REPORT
    if not r.rows and not r.verdicts:
        return
    tw = terminalreporter
    tw.section("MCF reader benchmarks: medians, warm page cache")
    tw.write_line(f"memory mode: {memory_mode()} (MCF_BENCH_MEMORY: 'warm' reuses faulted-in pages, "
                  "'fresh' faults every page in anew each round; see bench/results/reader.md)")
    tw.write_line(f"mcf {mcf.__version__} from {os.path.dirname(mcf.__file__)}, numpy {np.__version__}")
    m = r.model
    if m is not None:
        tw.write_line(f"model: {m.n_tensors} F16 tensors, {m.nbytes / 2**30:.3f} GiB payload; "
                      f"mcf file {m.mcf_size:,} B, safetensors file {m.st_size:,} B"
                      + (f" (built in {m.built_s:.1f} s)" if m.built_s else " (cached)"))
    tw.write_line(f"{'group':<13} {'benchmark':<50} {'role':<10} {'median':>11} {'GB/s':>7} {'other':>5}  note")
    for row in r.rows:
        gb = f"{row.gbps:7.2f}" if row.gbps else "      -"
        oc = f"{row.other_cpu * 100:4.0f}%" if row.other_cpu is not None else "    -"
        tw.write_line(f"{row.group:<13} {row.name:<50} {row.role:<10} {_fmt_time(row.median_s):>11} {gb} {oc}  "
                      f"{row.note}")
    tw.write_line("(other: CPU share of both cores used by other processes during that test; above ~10% "
                  "the absolute figures of that row are inflated)")
    if r.verdicts:
        tw.write_line("")
        tw.write_line(f"{'group':<13} {'measure':<56} {'value':>12} {'target':>14}  met")
        for v in r.verdicts:
            tw.write_line(f"{v.group:<13} {v.what:<56} {v.value:>12} {v.target:>14}  "
                          f"{'yes' if v.met else 'NO'}")
    if r.touches:
        slow = min(g for _, g in r.touches)
        tw.write_line("")
        tw.write_line(f"page-cache touches: {len(r.touches)}, slowest {slow:.1f} GB/s "
                      + ("(a file had been evicted; the touch made it warm before measuring)" if slow < 4
                         else "(all files were already warm)"))
