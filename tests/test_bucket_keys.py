"""mcf.bucket.keys against the engines' own answers (tests/fixtures/kv_keys/golden.json.gz, written by
tools/kv_golden.py with vLLM, LMCache and SGLang installed), and its refusals."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import pickle

import numpy as np
import pytest

from _kv_cases import N_CASES, case
from _vectors import FIXTURES
from mcf.bucket import keys
from mcf.errors import ArgumentTypeError, InvalidArgumentError


@pytest.fixture(scope="module")
def golden():
    with gzip.open(os.path.join(FIXTURES, "kv_keys", "golden.json.gz")) as f:
        g = json.load(f)
    assert g["n_cases"] == N_CASES == len(g["vllm"]) == len(g["sglang"]) == len(g["lmcache"])
    return g


@pytest.fixture(scope="module")
def cases():
    return [case(i) for i in range(N_CASES)]


def test_cases_cover_what_they_claim(cases):
    sizes = {c["block_size"] for c in cases}
    assert sizes == {16, 64}
    toks = {t for c in cases for t in c["tokens"]}
    for lo, hi in ((23, 24), (255, 256), (65535, 65536), (2**32 - 1, 2**32)):
        assert lo in toks and hi in toks
    assert 2**64 - 1 in toks and any(t >= 2**64 for t in toks)
    kinds = {c["kind"] for c in cases if c["extra"]}
    assert kinds == {"lora", "mm", "cache_salt", "prompt_embeds", "all"}
    # multimodal items that start before a block (negative offsets in the hash) and span several blocks
    assert any(m[2] > c["block_size"] for c in cases for m in c["extra"].get("mm", ()))


def test_vllm_block_hashes_match_vllm(golden, cases, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    for c, (n, last, event) in zip(cases, golden["vllm"]):
        hs = keys.vllm_block_hashes(c["tokens"], block_size=c["block_size"], seed=c["seed"],
                                    extra_keys=c["extra"] or None)
        assert len(hs) == n, c["i"]
        if n:
            assert hs[-1].hex() == last, c["i"]
            assert keys.vllm_event_hash(hs[-1]) == event, c["i"]


def test_vllm_seed_from_pythonhashseed(golden, cases, monkeypatch):
    """Without seed=, PYTHONHASHSEED is the seed, as in vLLM."""
    c = next(c for c in cases if c["seed"] is not None and golden["vllm"][c["i"]][0])
    monkeypatch.setenv("PYTHONHASHSEED", c["seed"])
    hs = keys.vllm_block_hashes(c["tokens"], block_size=c["block_size"], extra_keys=c["extra"] or None)
    assert hs[-1].hex() == golden["vllm"][c["i"]][1]
    monkeypatch.delenv("PYTHONHASHSEED")
    assert keys.vllm_none_hash().hex().startswith("9bd96a48") and keys.vllm_none_hash().hex().endswith("eef0")


def test_vllm_per_block_extra_keys_and_chaining(cases):
    """The per-block form of extra_keys, vllm_extra_keys' output, and parent= continuing a chain all give the
    same digests as one call."""
    c = next(c for c in cases if c["kind"] == "all" and len(c["tokens"]) >= 3 * c["block_size"])
    bs, toks = c["block_size"], c["tokens"]
    whole = keys.vllm_block_hashes(toks, block_size=bs, extra_keys=c["extra"])
    per_block = keys.vllm_extra_keys(len(toks), block_size=bs, **c["extra"])
    assert keys.vllm_block_hashes(toks, block_size=bs, extra_keys=per_block) == whole
    tail = keys.vllm_block_hashes(toks[bs:], block_size=bs, extra_keys=per_block[1:], parent=whole[0])
    assert tail == whole[1:]


def test_numpy_and_list_inputs_agree(cases):
    c = next(c for c in cases if not c["extra"] and len(c["tokens"]) > 64)
    toks = c["sglang_tokens"]  # below 2**63
    ref = keys.vllm_block_hashes(toks, block_size=16)
    for dt in (np.int64, np.uint64):
        assert keys.vllm_block_hashes(np.array(toks, dtype=dt), block_size=16) == ref
    small = [t % 30000 for t in toks]
    ref = keys.vllm_block_hashes(small, block_size=16)
    for dt in (np.int32, np.uint16, np.int64):
        assert keys.vllm_block_hashes(np.array(small, dtype=dt), block_size=16) == ref


def test_sglang_page_hashes_match_sglang(golden, cases):
    for c, (n, last, prior) in zip(cases, golden["sglang"]):
        ns = keys.sglang_namespace_seed(extra_key=c["sglang_ns"][0], cache_salt=c["sglang_ns"][1]) \
            if c["sglang_ns"] else None
        assert ns == prior, c["i"]
        hs = keys.sglang_page_hashes(c["sglang_tokens"], page_size=c["block_size"], prior=ns)
        assert len(hs) == n, c["i"]
        if n:
            assert hs[-1] == last, c["i"]


def test_sglang_event_hash():
    h = "ff" * 32
    assert keys.sglang_event_hash(h) == -1
    assert keys.sglang_event_hash("00" * 7 + "05" + "aa" * 24) == 5


def test_lmcache_chunk_hashes_and_keys_match_lmcache(golden, cases, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    for c, (n, last, none_hash, key) in zip(cases, golden["lmcache"]):
        alg = c["lmcache_algorithm"]
        # "builtin" hashes a string for its NONE_HASH: only the engine's process knows it (see the docs)
        kw = {"none_hash": none_hash} if alg == "builtin" else {"seed": c["seed"]}
        hs = keys.lmcache_chunk_hashes(c["tokens"], chunk_size=c["block_size"], hash_algorithm=alg,
                                       save_unfull_chunk=c["lmcache_unfull"], **kw)
        assert len(hs) == n, c["i"]
        if n:
            assert hs[-1] == last, c["i"]
            k = c["lmcache_key"]
            assert keys.lmcache_key(k["model_name"], k["world_size"], k["worker_id"], hs[-1], k["dtype"],
                                    tags=k["tags"]) == key, c["i"]


def test_cbor_matches_the_encoding_rules():
    """Spot checks of RFC 8949's deterministic encoding (cbor2 writes the same; the golden vectors cover it
    through the engines)."""
    assert keys.cbor_dumps(23) == b"\x17" and keys.cbor_dumps(24) == b"\x18\x18"
    assert keys.cbor_dumps(256) == b"\x19\x01\x00" and keys.cbor_dumps(65536) == b"\x1a\x00\x01\x00\x00"
    assert keys.cbor_dumps(2**32) == b"\x1b" + (2**32).to_bytes(8, "big")
    assert keys.cbor_dumps(-1) == b"\x20" and keys.cbor_dumps(-25) == b"\x38\x18"
    assert keys.cbor_dumps(2**64) == b"\xc2\x49\x01" + b"\0" * 8
    assert keys.cbor_dumps(None) == b"\xf6" and keys.cbor_dumps(()) == b"\x80"
    assert keys.cbor_dumps("a") == b"\x61a" and keys.cbor_dumps(b"ab") == b"\x42ab"
    assert keys.cbor_dumps(np.array([1, 300], np.uint16)) == b"\x82\x01\x19\x01\x2c"


def test_lmcache_sha256_is_a_pickle():
    toks = list(range(16))
    prev = int.from_bytes(hashlib.sha256(pickle.dumps("s", protocol=pickle.HIGHEST_PROTOCOL)).digest()[:8], "big")
    want = int.from_bytes(hashlib.sha256(pickle.dumps((prev, tuple(toks), ()), protocol=5)).digest()[:8], "big")
    assert keys.lmcache_chunk_hashes(toks, chunk_size=16, hash_algorithm="sha256", seed="s") == [want]


def test_lmcache_key_dtypes():
    assert keys.lmcache_key("m", 1, 0, 255, np.float16) == "m@1@0@ff@half"
    assert keys.lmcache_key("m", 2, 1, -16, "bfloat16", tags={"a": "b"}) == "m@2@1@-10@bfloat16@a%b"
    with pytest.raises(InvalidArgumentError, match="no LMCache name"):
        keys.lmcache_key("m", 1, 0, 1, "complex64")


@pytest.mark.parametrize("bad", [[1.5], ["a"], [[1, 2]], [True, 1], "abc", 3])
def test_bad_tokens_refused(bad):
    with pytest.raises((InvalidArgumentError, ArgumentTypeError)):
        keys.vllm_block_hashes(bad, block_size=1)


def test_refusals():
    with pytest.raises(InvalidArgumentError, match="block_size"):
        keys.vllm_block_hashes([1], block_size=0)
    with pytest.raises(InvalidArgumentError, match="0..2\\*\\*63-1"):
        keys.sglang_page_hashes([-1])
    with pytest.raises(InvalidArgumentError, match="0..2\\*\\*63-1"):
        keys.sglang_page_hashes([2**63])
    with pytest.raises(InvalidArgumentError, match="64 hex digits"):
        keys.sglang_page_hashes([1], prior="abcd")
    with pytest.raises(InvalidArgumentError, match="hash_algorithm"):
        keys.lmcache_chunk_hashes([1], hash_algorithm="md5")
    with pytest.raises(InvalidArgumentError, match="unknown extra key"):
        keys.vllm_block_hashes([1] * 16, extra_keys={"lora_name": "x"})
    with pytest.raises(InvalidArgumentError, match="sorted"):
        keys.vllm_extra_keys(32, mm=[("b", 9, 1), ("a", 2, 1)])
    with pytest.raises(InvalidArgumentError, match="entries for"):
        keys.vllm_block_hashes([1] * 32, extra_keys=[None])
    with pytest.raises(ArgumentTypeError, match="seed"):
        keys.vllm_none_hash(seed=42)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the golden vectors' builtin hashes are Python 3.11+'s: 3.11 "
                    "changed str hashing from SipHash-2-4 to SipHash-1-3, so LMCache's builtin chunk hashes depend on "
                    "the interpreter too")
def test_lmcache_builtin_under_the_engines_pythonhashseed(golden):
    """LMCache's default "builtin" algorithm starts from hash(seed), a string hash: a process started with
    the engine's PYTHONHASHSEED (0 for the golden vectors) reproduces it without none_hash=."""
    import subprocess
    import sys

    code = """if True:
        import json, sys
        sys.path.insert(0, "tests")
        from _kv_cases import N_CASES, case
        from mcf.bucket import keys
        out = {}
        for i in range(N_CASES):
            c = case(i)
            if c["lmcache_algorithm"] == "builtin":
                out[i] = keys.lmcache_chunk_hashes(c["tokens"], chunk_size=c["block_size"], hash_algorithm="builtin",
                                                   seed=c["seed"] or keys.VLLM_DEFAULT_SEED,
                                                   save_unfull_chunk=c["lmcache_unfull"])[-1:]
        print(json.dumps(out))
    """
    env = dict(os.environ, PYTHONHASHSEED="0")
    got = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True, cwd=os.path.dirname(os.path.dirname(__file__))).stdout)
    assert len(got) > 300
    for i, last in got.items():
        n, want, _, _ = golden["lmcache"][int(i)]
        assert last == ([want] if n else []), i
