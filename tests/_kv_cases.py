"""The token sequences and extra keys of the engine-key golden vectors (tests/fixtures/kv_keys/golden.json.gz).

``tools/kv_golden.py`` feeds these cases to vLLM's, SGLang's and LMCache's own functions and stores only
their answers; tests/test_bucket_keys.py rebuilds the same cases here and compares mcf.bucket.keys with
them.  The cases come from a fixed rule over splitmix64 (not numpy's generators, whose streams may
change between numpy versions), so the file holds no token ids.

What the rule covers: block sizes 16 and 64; tokens at every CBOR width boundary (23/24, 255/256,
65535/65536, 2**32-1/2**32, 2**64-1) mixed with random ids of every width, a few beyond 64 bits (CBOR
bignums); empty and sub-block sequences; each kind of vLLM extra key (LoRA, multimodal items
straddling blocks, a cache salt, prompt embeddings) alone and all together; a non-default seed.
"""

from __future__ import annotations

import numpy as np

N_CASES = 1000
BOUNDARIES = (0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1)
EXTRA_KINDS = ("none", "lora", "mm", "cache_salt", "prompt_embeds", "all")
DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")
LMCACHE_ALGORITHMS = ("sha256_cbor", "sha256", "builtin")
_M64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, seed: int) -> None:
        self.state = seed & _M64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n


def case(i: int) -> dict:
    """Case ``i``: ``tokens`` (Python ints), ``block_size``, ``seed`` (None: the default), ``extra`` (the
    keyword arguments of mcf.bucket.keys.vllm_extra_keys, with ``prompt_embeds`` as a float32 array),
    ``sglang_tokens`` and ``sglang_ns`` ((extra_key, cache_salt) or None), the LMCache algorithm and
    key fields."""
    r = SplitMix64(0x6B76 + i)
    bs = 16 if i % 2 == 0 else 64
    kind = EXTRA_KINDS[(i // 2) % len(EXTRA_KINDS)]
    n = 0 if i % 97 == 5 else r.below(bs) if i % 13 == 3 else r.below(6 * bs) + bs
    toks = []
    for _ in range(n):
        p = r.below(10)
        if p < 4:
            toks.append(BOUNDARIES[r.below(len(BOUNDARIES))])
        else:
            bits = (5, 8, 16, 24, 32, 40, 63, 64)[r.below(8)]
            toks.append(r.next() & ((1 << bits) - 1))
    if i % 50 == 7 and n:  # beyond 64 bits: CBOR bignums (vLLM, LMCache)
        toks[r.below(n)] = 2**64 + r.below(1000)
        toks[r.below(n)] = 2**70 + 3
    extra: dict = {}
    if kind in ("lora", "all"):
        extra["lora"] = (f"adapter-{r.below(100)}", f"/adapters/a{r.below(1000)}")
    if kind in ("mm", "all") and n:
        items, at = [], r.below(max(1, bs // 2))
        for j in range(1 + r.below(3)):
            length = 1 + r.below(2 * bs)
            if at + length > n:
                break
            items.append((f"mm-{i}-{j}-{r.next():016x}", at, length))
            at += length + r.below(bs)
        if items:
            extra["mm"] = items
    if kind in ("cache_salt", "all"):
        extra["cache_salt"] = f"salt-{r.next():x}"
    embeds = None
    if kind in ("prompt_embeds", "all"):
        raw = np.array([r.next() & 0x3FFFFFFF for _ in range(n * 4)], dtype=np.uint32)  # finite float32 bits
        embeds = raw.view(np.float32).reshape(n, 4)
        extra["prompt_embeds"] = embeds
        toks = [0] * n  # a prompt given as embeddings: vLLM's token ids are zeros
    seed = "42" if i % 7 == 3 else None
    ns = None
    if i % 5 == 1:
        ns = (f"ns{r.below(10)}", None if i % 10 == 1 else f"salt{r.below(10)}")
    return {
        "i": i, "tokens": toks, "block_size": bs, "kind": kind, "extra": extra, "seed": seed,
        "sglang_tokens": [t % 2**63 for t in toks], "sglang_ns": ns,
        "lmcache_algorithm": LMCACHE_ALGORITHMS[i % 3], "lmcache_unfull": i % 4 == 1,
        "lmcache_key": {"model_name": f"org/model-{i % 3}", "world_size": 1 + i % 4, "worker_id": i % 2,
                        "dtype": DTYPES[i % len(DTYPES)],
                        "tags": {"user": f"u{i % 3}"} if i % 5 == 0 else None},
    }
