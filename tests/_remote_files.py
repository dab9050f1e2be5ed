"""The files the remote tests serve (over nginx and from SeaweedFS) and compare with their local reads:
one of every format mcf reads, written by its own writer or by the reference library."""

from __future__ import annotations

import json
import os
import zlib

import numpy as np


def rng(tag):
    return np.random.default_rng(zlib.crc32(tag.encode()))


def make_files(root) -> None:
    """Write into directory ``root``: model.mcf, model.safetensors, model.gguf, data.idx/.bin, tree/ (a
    MegaContext tree), kv_data.mcb, sharded/ (a safetensors checkpoint of two shards and its index)."""
    import mcf

    root = str(root)
    r = rng("remote-files")
    # MCF: plain dtypes and quantized tensors, one large enough to bypass the block cache
    with mcf.Writer(os.path.join(root, "model.mcf")) as w:
        w.add_tensor("big", r.standard_normal((1024, 2048)).astype(np.float32))    # 8 MiB
        w.add_tensor("f16", r.standard_normal((33, 65)).astype(np.float16))
        w.add_tensor("i64", r.integers(-2**40, 2**40, size=(7,), dtype=np.int64))
        w.add_tensor("u8", r.integers(0, 255, size=(3, 5), dtype=np.uint8))
        w.add_tensor("q", r.standard_normal((64, 256)).astype(np.float32), method="k4")
        w.add_tensor("q8", r.standard_normal((16, 64)).astype(np.float32), method="q8")
    # safetensors, written by the safetensors package
    from safetensors.numpy import save_file

    save_file({"w": r.standard_normal((40, 24)).astype(np.float32),
               "b": r.integers(0, 100, size=(9,), dtype=np.int32)}, os.path.join(root, "model.safetensors"))
    # a sharded safetensors checkpoint: index + two shards, one of them over the 1 MiB block cache
    d = os.path.join(root, "sharded")
    os.makedirs(d, exist_ok=True)
    save_file({"a.weight": r.standard_normal((512, 1024)).astype(np.float32),
               "a.bias": r.standard_normal((512,)).astype(np.float32)},
              os.path.join(d, "model-00001-of-00002.safetensors"))
    save_file({"b.weight": r.standard_normal((3,)).astype(np.float16)},
              os.path.join(d, "model-00002-of-00002.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                  "a.bias": "model-00001-of-00002.safetensors",
                                  "b.weight": "model-00002-of-00002.safetensors"}}, f)
    # GGUF, written by the gguf package
    import gguf

    gw = gguf.GGUFWriter(os.path.join(root, "model.gguf"), "llama")
    gw.add_tensor("tok", r.standard_normal((8, 64)).astype(np.float32))
    gw.add_tensor("h", r.standard_normal((4, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(r.standard_normal((6, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    gw.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()
    # Megatron dataset
    from mcf.megatron import Writer as MWriter

    mw = MWriter(os.path.join(root, "data"), dtype=np.uint16)
    for _ in range(50):
        n = int(r.integers(2, 300))
        mw.add_document(r.integers(0, 60000, size=(n,), dtype=np.uint16), [n // 2, n - n // 2])
    mw.finalize()
    # MegaContext tree
    from mcf import megacontext

    with megacontext.create(os.path.join(root, "tree"), embedding_dim=16, model_name="t", gist_dtype="fp16") as t:
        t.append_tokens(r.integers(0, 1000, size=32 * 40, dtype=np.uint32))
        t.append_gists(1, r.standard_normal((40, 16)).astype(np.float32))
        t.append_gists(2, r.standard_normal((1, 16)).astype(np.float32))
    # MCB kv file
    from mcf.bucket.kvfile import write_kv

    layers = [(r.standard_normal((2, 10, 8)).astype(np.float16), r.standard_normal((2, 10, 8)).astype(np.float16))
              for _ in range(3)]
    write_kv(os.path.join(root, "kv_data.mcb"), layers)


def files(root) -> list:
    """Every file under ``root``, as paths relative to it (what an upload to a bucket needs)."""
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(out)


def assert_same(a, b):
    """Equal dtype, shape and bits (NaN equal to NaN; void dtypes compared as bytes)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(np.uint8) if a.dtype.kind == "V" else a,
                          b.view(np.uint8) if b.dtype.kind == "V" else b, equal_nan=a.dtype.kind == "f")
