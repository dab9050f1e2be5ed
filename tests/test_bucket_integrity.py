"""Integrity in memory and of content ids: arrays handed out by the warm and
hot tiers cannot be used to change what later loads return; token ids are hashed in a canonical,
range-checked encoding (uint64 2**64-1 and -1 no longer collide); a promotion to the warm tier checks its
budget against the metadata before reading anything and copies each byte once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mcf
from mcf.bucket import Bucket, content_hash
from mcf.bucket.store import prefix_hashes, token_array
from mcf.bucket.tiers import WarmBudgetError


def kv(seed: int, n_layers=2, heads=2, seq=8, dim=4):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((heads, seq, dim)).astype(np.float32),
             rng.standard_normal((heads, seq, dim)).astype(np.float32)) for _ in range(n_layers)]


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_warm_loads_are_read_only(tmp_path, compression):
    """Reported: after promote(cid, "warm"), load() returned the tier's own writable arrays, so a caller's
    ``k *= 10`` corrupted every later load from that bucket."""
    b = Bucket(tmp_path)
    layers = kv(1)
    cid = b.ingest("m", layers, content="warm", dtype="float32", compression=compression)["context_id"]
    b.promote(cid, "warm")
    k, v = b.load(cid)[0]
    with pytest.raises(ValueError, match="read-only"):
        k *= 10
    with pytest.raises(ValueError):
        k.flags.writeable = True  # a view of a read-only array cannot be made writable
    part = b.load(cid, layers=[1], tokens=3)[0][1]
    with pytest.raises(ValueError, match="read-only"):
        part[:] = 0
    np.testing.assert_array_equal(b.load(cid)[0][0], layers[0][0])
    # a caller who needs to write gets its own arrays with out= (or a copy)
    out = [(np.empty((2, 8, 4), np.float32), np.empty((2, 8, 4), np.float32)) for _ in range(2)]
    got = b.load(cid, out=out)
    got[0][0][:] = 7
    np.testing.assert_array_equal(b.load(cid)[0][0], layers[0][0])


def test_hot_loads_are_copies(tmp_path):
    torch = pytest.importorskip("torch", reason="the hot tier needs PyTorch")
    b = Bucket(tmp_path)
    layers = kv(2)
    cid = b.ingest("m", layers, content="hot", dtype="float32", compression="none")["context_id"]
    b.promote(cid, "hot", device="cpu")
    k = b.load(cid, as_torch=True)[0][0]
    k.mul_(10)
    again = b.load(cid, as_torch=True)[0][0]
    assert torch.equal(again, torch.from_numpy(layers[0][0]))
    np.testing.assert_array_equal(b.load(cid)[0][0], layers[0][0])  # the warm copy below it too


def test_uint64_max_and_minus_one_do_not_collide(tmp_path):
    """Reported: token ids were cast with astype("<i8"), so uint64 2**64-1 and -1 hashed alike and an
    ingest deduplicated to another context."""
    b = Bucket(tmp_path)
    n = 8
    first = b.ingest("m", kv(3), token_ids=[-1] * n)
    with pytest.raises(mcf.InvalidArgumentError, match="does not fit a signed 64-bit"):
        b.ingest("m", kv(4), token_ids=np.full(n, 2**64 - 1, np.uint64))
    with pytest.raises(mcf.InvalidArgumentError):
        content_hash(token_ids=np.full(n, 2**64 - 1, np.uint64))
    with pytest.raises(mcf.InvalidArgumentError):
        prefix_hashes("m", np.full(512, 2**63, np.uint64))
    assert [c["context_id"] for c in b.discover("m")] == [first["context_id"]]


@pytest.mark.parametrize("ids", [[2**63], [2**64 - 1], [-(2**63) - 1], [2**70], [-1, 2**63], [True, False],
                                 [1.0, 2.0], ["1", "2"], [[1, 2]], np.array([1, 2], np.float32)])
def test_token_ids_outside_int64_or_not_integers_are_refused(ids):
    with pytest.raises(mcf.InvalidArgumentError, match="token"):
        token_array(ids)


def test_canonical_token_encoding_is_the_int64_one():
    """Ids that fit are hashed exactly as before (little-endian int64), whatever integer dtype holds them:
    existing context ids and prefix hashes stay valid."""
    import hashlib

    ids = [0, 1, 2**63 - 1, 5]
    want = "sha256:" + hashlib.sha256(b"tokens\0" + np.array(ids, "<i8").tobytes()).hexdigest()
    for arr in (ids, np.array(ids, np.uint64), np.array(ids, ">i8"), np.array(ids, np.int64)):
        assert content_hash(token_ids=arr) == want
    assert content_hash(token_ids=np.array([1, 2], np.uint8)) == content_hash(token_ids=[1, 2])
    assert token_array([-(2**63), -1]).tolist() == [-(2**63), -1]


def test_promote_checks_the_budget_before_reading(tmp_path, monkeypatch):
    """Reported: promoting to warm decompressed the whole context before checking the memory budget (a
    1.25 GiB context peaked at 5 GiB and was then refused).  Now the metadata's size is checked first."""
    b = Bucket(tmp_path, warm_budget_bytes=1000)
    cid = b.ingest("m", kv(5), content="big", dtype="float32")["context_id"]  # 2 * 2 * 64 * 4 = 1024 bytes
    opened = []
    monkeypatch.setattr(Bucket, "open", lambda self, *a, **k: opened.append(a) or pytest.fail("read the data"))
    with pytest.raises(WarmBudgetError, match="1024 bytes, more than the warm budget of 1000"):
        b.promote(cid, "warm")
    assert opened == [] and b.tier(cid) == "cold"
    # int8 is counted as what the tier holds: float32 after dequantization
    monkeypatch.undo()
    b8 = Bucket(tmp_path / "i8", warm_budget_bytes=1023)
    c8 = b8.ingest("m", kv(5), content="big", dtype="int8")["context_id"]
    with pytest.raises(WarmBudgetError):
        b8.promote(c8)
    assert Bucket(tmp_path / "i8", warm_budget_bytes=1024).promote(c8) == "warm"


PROMOTE_PEAK = textwrap.dedent("""
    import json, sys, tracemalloc
    from mcf.bucket import Bucket

    root, cid, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
    b = Bucket(root, warm_budget_bytes=budget)
    b.lookup(cid)
    tracemalloc.start()  # numpy arrays and bytes are traced; mapped file pages (page cache) are not
    try:
        b.promote(cid, "warm", threads=1)
        outcome = "warm"
    except Exception as exc:
        outcome = type(exc).__name__
    print(json.dumps({"outcome": outcome, "peak": tracemalloc.get_traced_memory()[1]}))
""")


@pytest.mark.parametrize("compression", ["lz4", "zstd", "none"])
def test_promote_peak_memory(tmp_path, compression):
    """The peak memory of a promotion is the context once (plus a chunk), not a decompressed copy and a
    second copy of it; a refused promotion costs nothing.  Measured in a fresh process as the peak of the
    heap (tracemalloc sees numpy's arrays and Python's bytes; the mapped file is page cache, not the
    process's to account for)."""
    import json

    rng = np.random.default_rng(6)
    heads, seq, dim, n_layers = 8, 1024, 128, 12  # 12 * 2 * 8 * 1024 * 128 * 2 bytes = 48 MiB as float16
    layers = [(rng.standard_normal((heads, seq, dim)).astype(np.float16),) * 2 for _ in range(n_layers)]
    size = 2 * n_layers * heads * seq * dim * 2
    cid = Bucket(tmp_path).ingest("m", layers, content="peak", dtype="float16", compression=compression)["context_id"]
    del layers

    def run(budget):
        p = subprocess.run([sys.executable, "-c", PROMOTE_PEAK, str(tmp_path), cid, str(budget)], capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    ok = run(2 * size)
    assert ok["outcome"] == "warm"
    assert ok["peak"] < 1.2 * size, (ok["peak"] / size, "x the context")
    refused = run(size - 1)
    assert refused["outcome"] == "WarmBudgetError"
    assert refused["peak"] < 1 << 20, refused


def test_bucket_refuses_a_url(tmp_path, monkeypatch):
    """A URL is not a directory: Bucket("https://h/b") must not create ``https:/h/b`` locally."""
    from mcf.errors import InvalidArgumentError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="remote URLs"):
        Bucket("https://h/b")
    assert not os.path.exists(tmp_path / "https:")


def test_float64_to_bfloat16_rounds_once(tmp_path):
    """float64 KV data stored as bfloat16 rounds once from the exact value (through float32 it would
    round twice: 1 + 2**-8 + 2**-40 would become 1.0 instead of 1.0078125)."""
    b = Bucket(tmp_path / "b")
    x = np.full((1, 2, 4), 1 + 2.0 ** -8 + 2.0 ** -40, dtype=np.float64)
    info = b.ingest("m", [(x, -x)], token_ids=[1, 2], dtype="bfloat16")
    k, v = b.load(info["context_id"])[0]
    assert np.asarray(k, dtype=np.float32).ravel()[0] == np.float32(1.0078125)
    assert np.asarray(v, dtype=np.float32).ravel()[0] == np.float32(-1.0078125)
