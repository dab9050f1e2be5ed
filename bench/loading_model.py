"""The checkpoint the loading benchmarks read (bench/load_peers.py, bench/remote_throughput.py): a
Llama-shaped decoder of 836 M bfloat16 parameters, 1.67 GB, in the three forms users have it in.

- ``single/model.safetensors``: one file written by ``safetensors.torch.save_file`` itself (the layout
  every peer reads: safetensors' own header, its own tensor order), next to a ``config.json``;
- ``sharded/``: the same tensors in four files of at most 450 MB, each written by safetensors, with
  the ``model.safetensors.index.json`` a Hugging Face checkpoint has;
- ``model.mcf``: the same weights packed by ``mcf.pack`` from the sharded directory (kept as bf16).

Why this model: 16 layers of hidden size 2048 (TinyLlama's widths: grouped-query attention with 4 KV
heads of 64, MLP 5632, vocabulary 32000, untied ``lm_head``) make 1.67 GB, above the 1.5 GB the issue asks
for and well above every loader's fixed costs; 147 tensors from 8 KiB norms to 131 MB embeddings, so a
plan is neither one big range nor many tiny ones.  Values are normal(0, 0.02) (norms 1 + normal(0, 0.05))
in bfloat16, never zeros: zeros write, and on some paths read, unrealistically fast here
(bench/results/reader.md, "The model").  Every matrix divides by 4 along the dimension tensor parallelism
splits (rows of q/k/v/gate/up/embeddings/lm_head, columns of o/down), so rank 0 of 4 is a valid plan
(:func:`tp_plan`).

The files are built once (about a minute) and cached in ``$MCF_BENCH_DIR/loading`` (default
``<tempdir>/mcf-bench/loading``) with a manifest holding the spec's version, the file sizes and the
CRC-32 of every tensor's bytes, which the benchmarks check every loader's result against.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass

from bench_common import (bench_dir, build_once, decoder_layer_spec, drop_manifest, read_manifest, sizes_match,
                          write_manifest)

HIDDEN = 2048
INTERMEDIATE = 5632
KV_DIM = 256            # 4 KV heads of 64
LAYERS = 16
VOCAB = 32000
SEED = 20261124
SHARD_BYTES = 450_000_000
SPEC_VERSION = 1        # bump when the layout or the data changes: the cache is rebuilt

# Megatron's split of each matrix kind: column-parallel weights (output features = rows) along dim 0,
# row-parallel weights (input features = columns) along dim 1; the vocabulary is split along its rows.
SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1,
             "embed_tokens": 0, "lm_head": 0}


def model_spec():
    """(name, shape, kind) of every tensor, in generation order."""
    yield "model.embed_tokens.weight", (VOCAB, HIDDEN), "weight"
    for i in range(LAYERS):
        yield from decoder_layer_spec(f"model.layers.{i}.", HIDDEN, INTERMEDIATE, KV_DIM)
    yield "model.norm.weight", (HIDDEN,), "norm"
    yield "lm_head.weight", (VOCAB, HIDDEN), "weight"


def payload_bytes() -> int:
    total = 0
    for _, shape, _ in model_spec():
        n = 2
        for d in shape:
            n *= d
        total += n
    return total


def tp_plan(rank: int = 0, world: int = 4) -> dict:
    """``slices=`` for one tensor-parallel rank: every matrix cut along :data:`SPLIT_DIM`, norms whole."""
    import mcf

    plan = {}
    for name, shape, _ in model_spec():
        kind = name.split(".")[-2]
        plan[name] = mcf.Shard(rank, world, SPLIT_DIM[kind]) if len(shape) == 2 else None
    return plan


def tp_bytes(world: int = 4) -> int:
    """Bytes of one rank's share (every matrix 1/world, norms whole)."""
    total = 0
    for _name, shape, _ in model_spec():
        n = 2
        for d in shape:
            n *= d
        total += n // world if len(shape) == 2 else n
    return total


@dataclass(frozen=True)
class LoadingModel:
    root: str
    single: str            # single/model.safetensors
    sharded: str           # the sharded directory
    mcf: str               # model.mcf
    nbytes: int            # tensor payload
    crc: dict              # name -> CRC-32 of the tensor's bytes
    sizes: dict            # file name -> bytes
    built_s: float | None  # seconds spent building; None when reused

    @property
    def shard_files(self) -> list:
        return sorted(os.path.join(self.sharded, f) for f in os.listdir(self.sharded) if f.endswith(".safetensors"))


def cache_dir() -> str:
    return os.path.join(bench_dir(), "loading")


def _expected() -> dict:
    spec = list(model_spec())
    return {"spec_version": SPEC_VERSION, "seed": SEED, "n_tensors": len(spec), "payload_bytes": payload_bytes()}


def _files(root: str) -> list:
    out = [os.path.join("single", "model.safetensors"), "model.mcf"]
    d = os.path.join(root, "sharded")
    if os.path.isdir(d):
        out += [os.path.join("sharded", f) for f in sorted(os.listdir(d))]
    return out


def _cached(root: str, want: dict):
    got = read_manifest(root, want)
    if got is None or not sizes_match(root, got.get("sizes", {})):
        return None
    return got if got.get("sizes") else None


def _config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": 32,
            "num_key_value_heads": KV_DIM // 64, "vocab_size": VOCAB, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def _build(root: str, want: dict) -> dict:
    import torch
    from safetensors.torch import save_file

    import mcf

    drop_manifest(root)
    gen = torch.Generator().manual_seed(SEED)
    tensors, crc = {}, {}
    for name, shape, kind in model_spec():
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        x = x * 0.05 + 1.0 if kind == "norm" else x * 0.02
        t = x.to(torch.bfloat16)
        tensors[name] = t
        crc[name] = zlib.crc32(t.view(torch.uint8).numpy())
    cfg = json.dumps(_config(), indent=1)
    for d in ("single", "sharded"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
        with open(os.path.join(root, d, "config.json"), "w") as f:
            f.write(cfg)
    meta = {"format": "pt"}
    tmp = os.path.join(root, "single", f".model.{os.getpid()}.tmp")
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, os.path.join(root, "single", "model.safetensors"))
    # shards in generation (layer) order, each at most SHARD_BYTES, as transformers' save_pretrained cuts them
    groups, cur, held = [], {}, 0
    for name, _, _ in model_spec():
        n = tensors[name].numel() * 2
        if cur and held + n > SHARD_BYTES:
            groups.append(cur)
            cur, held = {}, 0
        cur[name] = tensors[name]
        held += n
    groups.append(cur)
    sd = os.path.join(root, "sharded")
    for f in os.listdir(sd):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.unlink(os.path.join(sd, f))
    weight_map = {}
    for k, g in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(g, os.path.join(sd, fname), metadata=meta)
        weight_map.update({n: fname for n in g})
    with open(os.path.join(sd, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": payload_bytes()}, "weight_map": weight_map}, f, indent=1)
    del tensors, groups, cur
    mcf.pack(sd, os.path.join(root, "model.mcf"))
    got = dict(want, crc=crc, sizes={rel: os.path.getsize(os.path.join(root, rel)) for rel in _files(root)})
    write_manifest(root, got)
    return got


def loading_model() -> LoadingModel:
    """The checkpoint, built on first use (under a lock: two runs sharing the cache build it once)."""
    root = cache_dir()
    os.makedirs(root, exist_ok=True)
    got, built_s = build_once(root, _expected(), _cached, _build)
    return LoadingModel(root, os.path.join(root, "single", "model.safetensors"), os.path.join(root, "sharded"),
                        os.path.join(root, "model.mcf"), got["payload_bytes"], got["crc"], got["sizes"], built_s)


if __name__ == "__main__":
    m = loading_model()
    print(f"{m.root}: {m.nbytes:,} B of payload, {len(m.crc)} tensors"
          + (f", built in {m.built_s:.0f} s" if m.built_s else " (cached)"))
    for rel, size in m.sizes.items():
        print(f"  {rel}: {size:,} B")
