"""Helpers shared by the benchmarks: timing loops and pytest-benchmark plumbing, page-cache touching, the
cache of built inputs (``$MCF_BENCH_DIR``, a manifest, one build under a lock), corpus text and result files.

Standard library only, and at module level only what bench/loading_model.py imported already (``statistics``
is imported where it is used): loading_model imports this module in the fresh child processes of
bench/load_child.py, whose imports stay what they were.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time

MiB = 1 << 20


# -- timing --------------------------------------------------------------------------------------------
def median_time(fn, rounds=7):
    """Median seconds of ``rounds`` calls of ``fn`` (outside pytest-benchmark: an anchor's own loop)."""
    import statistics

    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_median(benchmark):
    """Median seconds of the last pedantic run (None with --benchmark-disable)."""
    stats = getattr(benchmark, "stats", None)
    return stats.stats.median if stats is not None else None


class Rounds:
    """Runs ``fn`` as a pedantic target that allocates its result; the untimed teardown checks the
    first result with ``check``, drops it and applies the memory mode (bench/conftest.py's ``Memory``)."""

    def __init__(self, fn, memory, check=None):
        self.fn = fn
        self.memory = memory
        self.check = check
        self._result = None

    def target(self, *args):
        self._result = self.fn(*args)

    def teardown(self, *args, **kwargs):
        result, self._result = self._result, None
        if self.check is not None:
            self.check(result)
            self.check = None
        del result
        self.memory.release()


class Interleaved:
    """A pedantic ``setup`` that times ``fn`` once before every round of the target (untimed for the
    target) and then drops its result like :class:`Rounds`: the anchor's samples are taken between
    the target's, not a minute earlier."""

    def __init__(self, fn, memory=None):
        self.fn = fn
        self.memory = memory
        self.times: list = []

    def __call__(self):
        t0 = time.perf_counter()
        result = self.fn()
        self.times.append(time.perf_counter() - t0)
        del result
        if self.memory is not None:
            self.memory.release()

    @property
    def median(self):
        import statistics

        return statistics.median(self.times) if self.times else None


# -- page cache ----------------------------------------------------------------------------------------
def touch_files(paths) -> None:
    """Read every file whole through one reused 8 MiB buffer: in the page cache, nothing mapped."""
    buf = bytearray(8 * MiB)
    mv = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(mv):
                pass


# -- model shapes --------------------------------------------------------------------------------------
def decoder_layer_spec(prefix: str, hidden: int, intermediate: int, kv: int, bias: bool = False):
    """(name, shape, kind) of one Llama-style decoder layer's tensors, in checkpoint order: grouped-query
    attention with ``kv`` K/V rows (``bias``: q/k/v biases, as Qwen's), a gated MLP, two RMSNorms."""
    yield prefix + "input_layernorm.weight", (hidden,), "norm"
    for proj, rows in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
        yield prefix + f"self_attn.{proj}.weight", (rows, hidden), "weight"
        if bias:
            yield prefix + f"self_attn.{proj}.bias", (rows,), "bias"
    yield prefix + "self_attn.o_proj.weight", (hidden, hidden), "weight"
    yield prefix + "post_attention_layernorm.weight", (hidden,), "norm"
    yield prefix + "mlp.gate_proj.weight", (intermediate, hidden), "weight"
    yield prefix + "mlp.up_proj.weight", (intermediate, hidden), "weight"
    yield prefix + "mlp.down_proj.weight", (hidden, intermediate), "weight"


# -- cached inputs -------------------------------------------------------------------------------------
def bench_dir() -> str:
    """``$MCF_BENCH_DIR``, default ``<tempdir>/mcf-bench``: where the benchmarks cache what they build."""
    return os.environ.get("MCF_BENCH_DIR") or os.path.join(tempfile.gettempdir(), "mcf-bench")


def read_manifest(root: str, want: dict):
    """``root/manifest.json`` when it holds every item of ``want``, else None."""
    try:
        with open(os.path.join(root, "manifest.json")) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    return got if {k: got.get(k) for k in want} == want else None


def sizes_match(root: str, sizes: dict) -> bool:
    """Whether every file named in ``sizes`` (relative to ``root``) exists with that size."""
    try:
        return all(os.path.getsize(os.path.join(root, rel)) == size for rel, size in sizes.items())
    except OSError:
        return False


def drop_manifest(root: str) -> None:
    """Remove the manifest before a rebuild, so that a build cut short is never taken for a complete one."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, "manifest.json"))


def write_manifest(root: str, got: dict) -> None:
    """Publish ``root/manifest.json`` atomically (written aside, then renamed)."""
    tmp = os.path.join(root, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(got, f, indent=1)
    os.replace(tmp, os.path.join(root, "manifest.json"))


def build_once(root: str, want: dict, cached, build):
    """``(manifest, seconds spent building or None)``: ``cached(root, want)`` when it accepts the files,
    else ``build(root, want)``, under a lock so that two runs sharing the cache build it once."""
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        got = cached(root, want)
        if got is not None:
            return got, None
        t0 = time.perf_counter()
        got = build(root, want)
        return got, time.perf_counter() - t0


# -- corpus text ---------------------------------------------------------------------------------------
def utf8_texts(paths):
    """The text of each file of ``paths`` that reads as UTF-8 (the others are skipped)."""
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                yield f.read()
        except (UnicodeDecodeError, OSError):
            continue


def text_paragraphs(paths, min_chars: int) -> list:
    """The blank-line separated paragraphs, stripped, longer than ``min_chars``, of every file that reads
    as UTF-8 (the others are skipped)."""
    return [p.strip() for text in utf8_texts(paths) for p in text.split("\n\n") if len(p.strip()) > min_chars]


def write_untruncated_tokenizer(src: str, dst: str) -> None:
    """A copy of the ``tokenizer.json`` at ``src`` without truncation or padding (whole documents)."""
    with open(src, encoding="utf-8") as f:
        cfg = json.load(f)
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(dict(cfg, truncation=None, padding=None), f)


# -- results of the standalone scripts -----------------------------------------------------------------
def print_summary(lines: list, runs, json_path=None) -> None:
    """Print the summary lines; with ``json_path``, also write them with every run there."""
    print("\n".join(lines))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"summary": lines, "runs": runs}, f, indent=1)


def evict_page_cache(*paths) -> None:
    """Drop the page cache of ``paths`` (written back first), so the next read comes from the disk:
    ``posix_fadvise(DONTNEED)``, which needs no root (``drop_caches`` is not writable everywhere)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
