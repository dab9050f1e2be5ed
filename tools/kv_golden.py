"""Regenerate tests/fixtures/kv_keys/golden.json.gz: the serving engines' own keys for the cases of
tests/_kv_cases.py, which tests/test_bucket_keys.py compares mcf.bucket.keys with (CI does not install
the engines: it reads the committed file).

    python tools/kv_golden.py [--venv DIR] [--keep]

Makes a throwaway virtual environment (with the system's site-packages, for torch), installs vLLM,
LMCache and SGLang from their wheels with ``--no-deps`` plus the few small packages their hashing
modules import, and calls, for each case:

* vLLM: ``init_none_hash(sha256_cbor)`` (with ``PYTHONHASHSEED`` set for a seeded case), then a real
  ``vllm.v1.request.Request`` (its LoRA request, multimodal features, cache salt, prompt embeddings)
  hashed by ``get_request_block_hasher(block_size, sha256_cbor)``, and ``maybe_convert_block_hash`` for
  the events' 64-bit form;
* LMCache: ``ChunkedTokenDatabase`` with ``pre_caching_hash_algorithm`` and ``chunk_size`` set,
  ``process_tokens(make_key=False)``, and ``CacheEngineKey(...).to_string()``;
* SGLang: ``get_hash_str`` and ``storage_namespace_seed`` (their source, taken from the installed
  ``sglang/srt/mem_cache/utils.py``, whose own imports need triton kernels) over the installed native
  hash extension (compiled on first use with the system's C++ compiler and OpenSSL headers).

Only the answers are stored: per case the number of hashes and the last one in full (each hash chains
over every one before it), and the 64-bit event form of the last vLLM block.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "fixtures", "kv_keys", "golden.json.gz")
ENGINES = {"vllm": "0.33.0", "lmcache": "0.5.6", "sglang": "0.5.23"}
# what the hashing modules import beyond torch (installed with their own dependencies)
DEPS = ["cbor2", "msgspec", "pyzmq", "openai-harmony", "openai", "pillow", "pybase64", "cachetools", "uvloop",
        "prometheus-client", "xgrammar", "fastapi", "partial-json-parser", "llguidance", "numba"]


def outer(args) -> int:
    venv = args.venv or tempfile.mkdtemp(prefix="kv-golden-")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--no-deps"] + [f"{k}=={v}" for k, v in ENGINES.items()], check=True)
    subprocess.run(pip + DEPS, check=True)
    # string hashing fixed, so LMCache's "builtin" NONE_HASH (a string's hash()) and the file come out the same
    # every time; the inner run removes the variable from its environment before vLLM reads it
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONHASHSEED="0")
    rc = subprocess.run([py, os.path.abspath(__file__), "--inner"], env=env).returncode
    if not args.keep and not args.venv:
        import shutil

        shutil.rmtree(venv, ignore_errors=True)
    return rc


def _sglang_functions():
    """get_hash_str and storage_namespace_seed as the installed SGLang defines them."""
    import ast
    import hashlib
    from typing import Any, List, Optional

    from sglang.srt.mem_cache.cpp_utils import native_hash
    from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash

    path = os.path.join(os.path.dirname(os.path.dirname(native_hash.__file__)), "utils.py")
    tree = ast.parse(open(path).read())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("get_hash_str",
                                                                                   "storage_namespace_seed")]
    ns = {"hashlib": hashlib, "get_native_hash": get_native_hash, "Optional": Optional, "List": List, "Any": Any}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), path, "exec"), ns)
    return ns["get_hash_str"], ns["storage_namespace_seed"]


def inner() -> int:
    import importlib.metadata as md

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.token_database import ChunkedTokenDatabase
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    os.environ.pop("PYTHONHASHSEED", None)  # the interpreter already took it for its string hashes
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import _kv_cases

    get_hash_str, storage_namespace_seed = _sglang_functions()
    lm_dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float8_e4m3fn": torch.float8_e4m3fn}
    out: dict = {"engines": {k: md.version(k) for k in ENGINES}, "n_cases": _kv_cases.N_CASES,
                 "vllm": [], "sglang": [], "lmcache": []}
    for i in range(_kv_cases.N_CASES):
        c = _kv_cases.case(i)
        bs, toks, extra = c["block_size"], c["tokens"], c["extra"]
        # vLLM
        if c["seed"] is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = c["seed"]
        kv_cache_utils.init_none_hash(sha256_cbor)
        lora = extra.get("lora")
        mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                    mm_position=PlaceholderRange(offset=off, length=ln))
              for ident, off, ln in extra.get("mm", ())]
        embeds = extra.get("prompt_embeds")
        req = Request(str(i), None if embeds is not None else list(toks), SamplingParams(max_tokens=1), None,
                      prompt_embeds=None if embeds is None else torch.from_numpy(embeds.copy()),
                      mm_features=mm or None,
                      lora_request=LoRARequest(lora[0], 1 + i, lora[1]) if lora else None,
                      cache_salt=extra.get("cache_salt"),
                      block_hasher=kv_cache_utils.get_request_block_hasher(bs, sha256_cbor))
        assert list(req.all_token_ids) == list(toks)
        hs = req.block_hashes
        out["vllm"].append([len(hs), hs[-1].hex() if hs else None,
                            kv_cache_utils.maybe_convert_block_hash(hs[-1]) if hs else None])
        # SGLang
        prior = storage_namespace_seed(*c["sglang_ns"]) if c["sglang_ns"] else None
        ph = get_hash_str(c["sglang_tokens"], prior, page_size=bs) if c["sglang_tokens"] else []
        out["sglang"].append([len(ph), ph[-1] if ph else None, prior])
        # LMCache (its NONE_HASH comes from vLLM's init_none_hash, under the same PYTHONHASHSEED)
        alg, unfull = c["lmcache_algorithm"], c["lmcache_unfull"]
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=bs, pre_caching_hash_algorithm=alg,
                                                save_unfull_chunk=unfull)
        db = ChunkedTokenDatabase(cfg)
        import lmcache.v1.token_database as tdb

        lh = [h for _, _, h in db.process_tokens(tokens=list(toks), make_key=False)]
        k = c["lmcache_key"]
        key = None
        if lh:
            rc = {f"lmcache.tag.{a}": b for a, b in k["tags"].items()} if k["tags"] else None
            key = CacheEngineKey(k["model_name"], k["world_size"], k["worker_id"], lh[-1], lm_dtypes[k["dtype"]],
                                 rc).to_string()
        out["lmcache"].append([len(lh), lh[-1] if lh else None, tdb.NONE_HASH, key])
    os.environ.pop("PYTHONHASHSEED", None)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with gzip.GzipFile(OUT, "wb", mtime=0) as f:
        f.write(json.dumps(out, separators=(",", ":")).encode())
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes) from {out['engines']}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", help="use (or make) this virtual environment instead of a throwaway one")
    p.add_argument("--keep", action="store_true", help="keep the throwaway virtual environment")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    return inner() if args.inner else outer(args)


if __name__ == "__main__":
    sys.exit(main())
