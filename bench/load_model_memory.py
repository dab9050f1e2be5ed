"""Peak memory of loading a checkpoint into a model: ``mcf.torch.load_model`` beside ``from_pretrained`` and
``safetensors.torch.load_model``, each in a fresh process.

    python bench/load_model_memory.py            # builds the checkpoint once (~285 MB), then every case

The checkpoint is a Llama-shaped bfloat16 model (vocabulary 32000, hidden 1024, 6 layers, 143 M parameters,
285 MB), saved with ``save_pretrained`` in ``$MCF_BENCH_DIR/load_model`` (default ``<tempdir>/mcf-bench``).

Each case runs in its own process (this script with ``--child CASE``): the imports, then the model built as
the case builds it, then the RSS is read and the peak (``VmHWM``) reset (``/proc/self/clear_refs``), then
the load, then one byte of every 4 KiB page of every weight read (what a first forward pass does: a weight
that is a view of a mapped file counts once it is used), then the new peak.  ``growth`` is the peak minus
the RSS before the load: every byte the load added at its worst moment, file pages it mapped included (a
mapped checkpoint's pages count in RSS while they are mapped), against the model's bytes (its parameters
and buffers after the load).

Cases:

- ``mcf meta``: ``mcf.torch.load_model`` into a model built on the meta device (its weights allocated by
  the load, once); ``mcf meta f32``: the same into a float32 model (the bfloat16 values cast through staging);
- ``mcf refit``: ``mcf.torch.load_model`` into a model that already holds weights (``from_config``, its
  memory allocated and initialised before the measurement): nothing of the model's size may be allocated;
- ``safetensors``: ``safetensors.torch.load_model`` into a model built with its weights (``from_config``:
  allocated and initialised before the measurement, as for ``mcf refit``);
- ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CASES = ["mcf meta", "mcf meta f32", "mcf refit", "safetensors", "from_pretrained"]
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
              num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
              tie_word_embeddings=False)


def _dir() -> str:
    root = os.environ.get("MCF_BENCH_DIR") or os.path.join(tempfile.gettempdir(), "mcf-bench")
    return os.path.join(root, "load_model")


def _build(d: str) -> None:
    if os.path.exists(os.path.join(d, "model.safetensors")):
        return
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(d)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _child(case: str, d: str) -> dict:
    import torch
    import transformers

    import mcf.torch
    import safetensors.torch

    cfg = transformers.AutoConfig.from_pretrained(d)
    dtype = torch.float32 if case == "mcf meta f32" else torch.bfloat16
    model = None
    if case in ("mcf meta", "mcf meta f32"):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    elif case in ("mcf refit", "safetensors"):   # weights in the process's own memory, every page touched
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:   # VmHWM back to the current RSS
        f.write("5")
    t0 = time.perf_counter()
    if case.startswith("mcf"):
        result = mcf.torch.load_model(model, d)
    elif case == "safetensors":
        result = safetensors.torch.load_model(model, os.path.join(d, "model.safetensors"))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
        result = ([], [])
    seconds = time.perf_counter() - t0
    for t in model.state_dict().values():   # one byte per page: a mapped weight counts once it is used
        if t.numel():
            t.detach().contiguous().reshape(-1).view(torch.uint8)[::4096].sum()
    peak = _status("VmHWM")
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"case": case, "seconds": round(seconds, 3), "model_bytes": model_bytes, "rss_before": before,
            "growth": peak - before, "ratio": round((peak - before) / model_bytes, 3),
            "missing": len(result[0]), "unexpected": len(result[1])}


def main() -> None:
    d = _dir()
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], d)))
        return
    os.makedirs(d, exist_ok=True)
    _build(d)
    rows = []
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--child", case], check=True, capture_output=True,
                             text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    MiB = 1 << 20
    print(f"model: {rows[0]['model_bytes'] / MiB:.0f} MiB bfloat16 ({d}); load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':<16} {'seconds':>8} {'RSS before MiB':>15} {'peak growth MiB':>16} {'growth / model':>15}")
    for r in rows:
        print(f"{r['case']:<16} {r['seconds']:>8.2f} {r['rss_before'] / MiB:>15.0f} {r['growth'] / MiB:>16.0f} "
              f"{r['ratio']:>15.2f}")


if __name__ == "__main__":
    main()
