"""Conversion benchmarks: safetensors -> MCF (float and k4) and MCF -> safetensors, against a
plain copy of the same file measured in the same run (see bench/results/conversion.md).

The input is the ~1 GiB F16 ``model.safetensors`` of bench/conftest.py.  Both sides write to the same
file system (next to the cached model) and delete their output outside the timed region.  The
converter fsyncs its output before renaming it (as every mcf writer does), so the main anchor is
``shutil.copyfile`` followed by ``fsync``; the copy without fsync is timed in the same rounds and
reported too.  Both anchors are timed once before every round of the target (pedantic's untimed
``setup``), so the ratios compare interleaved measurements.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time

import pytest

import mcf
from mcf.conversion.checkpoint import convert
from mcf.conversion.export import export
from bench_common import bench_median

ROUNDS = 5
FLOAT_TARGET = 0.5   # convert at least half the throughput of a plain copy


def _copy(src, dst, sync):
    shutil.copyfile(src, dst)
    if sync:
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Anchors:
    """Untimed setup of every target round: a plain copy of ``src`` with and without fsync, timed
    and deleted, then the target's previous output deleted."""

    def __init__(self, src, out_dir, target_out):
        self.src = src
        self.tmp = os.path.join(out_dir, "copy.bin")
        self.target_out = target_out
        self.sync: list = []
        self.nosync: list = []

    def __call__(self):
        for sync, times in ((True, self.sync), (False, self.nosync)):
            t0 = time.perf_counter()
            _copy(self.src, self.tmp, sync)
            times.append(time.perf_counter() - t0)
            os.unlink(self.tmp)
        _remove(self.target_out)

    def median(self, sync=True):
        return statistics.median(self.sync if sync else self.nosync)


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


@pytest.fixture(scope="module")
def out_dir(bench_model):
    d = os.path.join(os.path.dirname(bench_model.st_path), "convert-out")
    os.makedirs(d, exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run(benchmark, report, group, label, fn, src, out_dir, out, nbytes, target=None):
    """Time ``fn`` (which writes ``out``) with :class:`Anchors` copying ``src`` before every round; report
    the target, both anchors and the ratios."""
    anchors = Anchors(src, out_dir, out)
    benchmark.pedantic(fn, setup=anchors, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    t = bench_median(benchmark)
    if t is None:
        return
    a_sync, a_nosync = anchors.median(True), anchors.median(False)
    benchmark.extra_info.update(copy_fsync_median_s=a_sync, copy_median_s=a_nosync,
                                ratio_to_copy_fsync=a_sync / t, ratio_to_copy=a_nosync / t)
    report.row(group, label, "target", t, nbytes)
    report.row(group, "  copyfile + fsync (interleaved)", "anchor", a_sync, os.path.getsize(src))
    report.row(group, "  copyfile, no fsync (interleaved)", "anchor", a_nosync, os.path.getsize(src))
    want = f">= {target:.2f}x" if target else "-"
    report.verdict(group, f"{label}: throughput / copyfile+fsync", f"{a_sync / t:.2f}x", want,
                   target is None or a_sync / t >= target)
    report.verdict(group, f"{label}: throughput / copyfile (no fsync)", f"{a_nosync / t:.2f}x", want,
                   target is None or a_nosync / t >= target)


@pytest.mark.benchmark(group="convert")
@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "pread"])
def test_convert_float(benchmark, bench_model, touch, report, out_dir, mmap):
    m = bench_model
    out = os.path.join(out_dir, "float.mcf")
    touch(m.st_path)
    _run(benchmark, report, "convert", f"convert float ({'mmap' if mmap else 'pread'})",
         lambda: convert(m.st_path, out, mmap=mmap), m.st_path, out_dir, out, m.nbytes, FLOAT_TARGET)
    with mcf.open(out) as c:
        assert len(c) == m.n_tensors and c.info(m.names[0]).dtype.name == "f16"
    _remove(out)


@pytest.mark.benchmark(group="convert")
def test_convert_float_no_fsync(benchmark, bench_model, touch, report, out_dir):
    """convert(durable=False): the same atomic publish without the fsyncs, i.e. what a plain copy does;
    its fair anchor is the copy without fsync."""
    m = bench_model
    out = os.path.join(out_dir, "float-nofsync.mcf")
    touch(m.st_path)
    _run(benchmark, report, "convert", "convert float (pread, durable=False)",
         lambda: convert(m.st_path, out, mmap=False, durable=False), m.st_path, out_dir, out, m.nbytes,
         FLOAT_TARGET)
    _remove(out)


@pytest.mark.benchmark(group="convert")
def test_convert_k4(benchmark, bench_model, touch, report, out_dir):
    m = bench_model
    out = os.path.join(out_dir, "k4.mcf")
    touch(m.st_path)
    _run(benchmark, report, "convert", "convert k4 (read bytes/s)", lambda: convert(m.st_path, out, method="k4"),
         m.st_path, out_dir, out, m.nbytes)
    with mcf.open(out) as c:
        assert c.info("model.embed_tokens.weight").dtype.name == "k4"
    _remove(out)


@pytest.mark.benchmark(group="export")
def test_export_float(benchmark, bench_model, touch, report, out_dir):
    m = bench_model
    out = os.path.join(out_dir, "out.safetensors")
    touch(m.mcf_path)
    _run(benchmark, report, "export", "export float (copy)", lambda: export(m.mcf_path, out), m.mcf_path, out_dir,
         out, m.nbytes)
    assert os.path.getsize(out) >= m.nbytes
    _remove(out)


@pytest.mark.benchmark(group="export")
def test_export_k4_to_f16(benchmark, bench_model, touch, report, out_dir):
    """Decoding k4 back to F16 (written bytes/s; the anchor copies the F16 MCF, the same size)."""
    m = bench_model
    k4 = os.path.join(out_dir, "src-k4.mcf")
    if not os.path.exists(k4):
        convert(m.st_path, k4, method="k4")
    out = os.path.join(out_dir, "out-k4.safetensors")
    touch(k4, m.mcf_path)
    _run(benchmark, report, "export", "export k4 -> f16 (written bytes/s)",
         lambda: export(k4, out, dtype="f16"), m.mcf_path, out_dir, out, m.nbytes)
    assert os.path.getsize(out) >= m.nbytes
    _remove(out)
