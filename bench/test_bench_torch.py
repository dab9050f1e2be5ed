"""mcf.torch.load_state_dict against safetensors.torch.load_file on the same weights (the ~1 GiB F16 model
of bench/conftest.py, as model.mcf and model.safetensors), both materialized on the CPU.

safetensors 0.8's ``load_file`` maps the file by default (tensors over a private mapping: nothing is
read until used) and reads into fresh memory with ``backend="pread"``.  So two pairs, each the same
treatment on both sides:

- mapped: ``load_state_dict(copy=False)`` (zero-copy views of a private copy-on-write mapping, as
  safetensors' own) vs ``load_file()``, each followed by reading one byte of every page (the page faults a
  first forward pass would pay);
- fresh memory: ``load_state_dict()`` (the default) vs ``load_file(backend="pread")``.

Target: at least 1.0x the throughput of ``load_file`` in both pairs, each ratio taken from
interleaved measurements of the same run (the anchor is timed once before every round of the target, in
pedantic's untimed setup).  The untouched loads are reported as references (their fixed cost).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import mcf.torch as mtorch  # noqa: E402
from bench_common import Interleaved, Rounds, bench_median  # noqa: E402

ROUNDS = 7
TARGET = 1.0


def _check(m):
    def check(sd):
        assert len(sd) == m.n_tensors
        assert sum(t.numel() * t.element_size() for t in sd.values()) == m.nbytes
        ref = safetensors_torch.load_file(m.st_path)
        for name in ("model.embed_tokens.weight", "model.layers.7.mlp.down_proj.weight", "model.norm.weight"):
            assert torch.equal(sd[name], ref[name])
    return check


def _run(benchmark, fn, memory, m, setup=None):
    memory.release()
    run = Rounds(fn, memory, _check(m))
    benchmark.pedantic(run.target, setup=setup, teardown=run.teardown, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    return bench_median(benchmark)


def _touch_pages(sd):
    """Read one byte of every 4 KiB page of every tensor: a mapped tensor becomes resident (its page
    faults are paid here), a copied one is merely read.  What a forward pass would do first."""
    total = 0
    for t in sd.values():
        if t.numel():
            total += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return sd


# (label, role, function, anchor label) -- anchors: safetensors' two back ends, the same treatment
CASES = {
    "st-mmap": ("safetensors.torch.load_file() + touch every page", "anchor",
                lambda m: _touch_pages(safetensors_torch.load_file(m.st_path))),
    "st-pread": ("safetensors.torch.load_file(backend='pread')", "anchor",
                 lambda m: safetensors_torch.load_file(m.st_path, backend="pread")),
    "mcf-view": ("mcf.torch.load_state_dict(copy=False) + touch every page", "target",
                 lambda m: _touch_pages(mtorch.load_state_dict(m.mcf_path, copy=False))),
    "mcf-copy": ("mcf.torch.load_state_dict()", "target",
                 lambda m: mtorch.load_state_dict(m.mcf_path)),
    "mcf-copy2": ("mcf.torch.load_state_dict(threads=2)", "target",
                  lambda m: mtorch.load_state_dict(m.mcf_path, threads=2)),
    "mcf-view-only": ("mcf.torch.load_state_dict(copy=False) without touching", "reference",
                      lambda m: mtorch.load_state_dict(m.mcf_path, copy=False)),
    "st-mmap-only": ("safetensors.torch.load_file() without touching", "reference",
                     lambda m: safetensors_torch.load_file(m.st_path)),
}
ANCHOR_OF = {"mcf-view": "st-mmap", "mcf-copy": "st-pread", "mcf-copy2": "st-pread"}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.benchmark(group="torch-load")
def test_torch_load(benchmark, bench_model, touch, report, memory, case):
    m = bench_model
    touch(m.mcf_path, m.st_path)
    label, role, fn = CASES[case]
    anchor = Interleaved(lambda: CASES[ANCHOR_OF[case]][2](m), memory) if case in ANCHOR_OF else None
    t = _run(benchmark, lambda: fn(m), memory, m, setup=anchor)
    if t is None:
        return
    note = ""
    if anchor is not None:
        a = anchor.median
        ratio = a / t
        benchmark.extra_info.update(anchor_median_s=a, ratio=ratio)
        note = f"{ratio:.2f}x {CASES[ANCHOR_OF[case]][0].split(' + ')[0]} (interleaved)"
        report.verdict("torch-load", f"{label[:40]} vs {ANCHOR_OF[case]}", f"{ratio:.2f}x", f">= {TARGET:.1f}x",
                       ratio >= TARGET)
    report.row("torch-load", label, role, t, m.nbytes if "only" not in case else None, note)
