"""The bucket directory: ingest/discover/lookup/load/delete, content-derived ids that survive a restart,
TTL with a controllable clock, pinning, events, model compatibility, hostile ids and JSON, a writer
killed mid-ingest and mid-registry-update, and two processes ingesting at once."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
from mcf.bucket import _registry
from mcf.bucket.store import Bucket, content_hash
from mcf.errors import ContextNotFoundError


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def kv(seed: int, n_layers=2, heads=2, seq=8, dim=4):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((heads, seq, dim)).astype(np.float32),
             rng.standard_normal((heads, seq, dim)).astype(np.float32)) for _ in range(n_layers)]


def ids(entries):
    return sorted(e["context_id"] for e in entries)


def test_ingest_discover_load_survives_restart(tmp_path):
    b = Bucket(tmp_path)
    layers = kv(1)
    meta = b.ingest("medicine-7b", layers, content="The pathophysiology of diabetes", name="ch5",
                    source="file:///book.pdf#5", compression="zstd", dtype="float32")
    cid = meta["context_id"]
    assert meta["content"]["hash"] == content_hash("The pathophysiology of diabetes")
    assert meta["kv_cache"]["shape"]["num_layers"] == 2 and meta["kv_cache"]["compression"] == "zstd"
    kvp = tmp_path / "contexts" / cid / "kv_data.mcb"
    assert meta["kv_cache"]["size_bytes"] == kvp.stat().st_size
    assert json.loads((tmp_path / "contexts" / cid / "metadata.json").read_text())["context_id"] == cid
    out = b.load(cid)
    for (k, v), (k0, v0) in zip(out, layers):
        np.testing.assert_array_equal(k, k0)
        np.testing.assert_array_equal(v, v0)
    # a new process (a new object on the same root) finds the same content under the same id
    b2 = Bucket(tmp_path)
    assert ids(b2.discover("medicine-7b")) == [cid]
    assert b2.lookup(cid)["access"]["count"] == 1
    again = b2.ingest("medicine-7b", layers, content="The pathophysiology of diabetes", dtype="float32")
    assert again["context_id"] == cid and again["deduplicated"]
    # id depends on model, content, dtype and shape
    others = {
        b2.ingest("legal-13b", layers, content="The pathophysiology of diabetes", dtype="float32")["context_id"],
        b2.ingest("medicine-7b", layers, content="other", dtype="float32")["context_id"],
        b2.ingest("medicine-7b", layers, content="The pathophysiology of diabetes", dtype="float16")["context_id"],
        b2.ingest("medicine-7b", layers[:1], content="The pathophysiology of diabetes", dtype="float32")["context_id"],
        b2.ingest("medicine-7b", layers, token_ids=list(range(8)), dtype="float32")["context_id"],
    }
    assert len(others) == 5 and cid not in others
    reg = Bucket(tmp_path).registry()
    assert reg["statistics"]["total_contexts"] == 6 and reg["statistics"]["total_models"] == 2
    assert sorted(m["model_id"] for m in reg["models"]) == ["legal-13b", "medicine-7b"]


def test_uncompressed_load_is_mmap_view(tmp_path):
    b = Bucket(tmp_path)
    cid = b.ingest("m", kv(2), content="x", compression="none")["context_id"]
    (k, _), _ = b.load(cid, tokens=3)
    assert k.shape == (2, 3, 4) and not k.flags.writeable and not k.flags.owndata


def test_delete_and_not_found(tmp_path):
    b = Bucket(tmp_path)
    cid = b.ingest("m", kv(3), content="x")["context_id"]
    b.delete(cid)
    assert b.discover("m") == [] and not (tmp_path / "contexts" / cid).exists()
    for op in (b.lookup, b.load, b.delete):
        with pytest.raises(ContextNotFoundError):
            op(cid)
    with pytest.raises(KeyError):
        b.lookup("ctx_" + "0" * 32)


def test_ttl_gc_and_pinning_with_clock(tmp_path):
    clock = Clock()
    b = Bucket(tmp_path, clock=clock)
    events = []
    b.subscribe(events.append)
    short = b.ingest("m", kv(4), content="short", ttl=10)["context_id"]
    pinned = b.ingest("m", kv(5), content="pinned", ttl=10, pinned=True)["context_id"]
    forever = b.ingest("m", kv(6), content="forever")["context_id"]
    clock.t += 9.5
    assert ids(b.discover("m")) == sorted([short, pinned, forever])
    clock.t += 1
    assert ids(b.discover("m")) == sorted([pinned, forever])
    assert short in ids(b.discover("m", include_expired=True))
    with pytest.raises(ContextNotFoundError, match="expired"):
        b.lookup(short)
    assert b.lookup(short, include_expired=True)["context_id"] == short
    assert b.gc() == [short]
    assert not (tmp_path / "contexts" / short).exists()
    assert ids(b.discover("m", include_expired=True)) == sorted([pinned, forever])
    b.pin(pinned, pinned=False)
    assert ids(b.discover("m")) == [forever]
    assert b.gc() == [pinned]
    kinds = [e["event"] for e in events]
    assert kinds.count("context.ingested") == 3 and kinds.count("context.expired") == 2
    assert all("timestamp" in e for e in events)
    with pytest.raises(mcf.InvalidArgumentError):
        b.ingest("m", kv(7), content="y", ttl=0)


def test_model_compatibility(tmp_path):
    b = Bucket(tmp_path)
    b.register_model("llama-8b", architecture="llama", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16")
    cid = b.ingest("llama-8b", kv(8), content="a", dtype="float16")["context_id"]
    with pytest.raises(mcf.InvalidArgumentError, match="num_layers"):
        b.ingest("llama-8b", kv(8, n_layers=3), content="a")
    with pytest.raises(mcf.InvalidArgumentError, match="dtype"):
        b.ingest("llama-8b", kv(8), content="a", dtype="float32")
    assert len(b.load(cid, model="llama-8b")) == 2
    with pytest.raises(mcf.InvalidArgumentError, match="head_dim"):
        b.load(cid, model={"num_layers": 2, "head_dim": 128})
    with pytest.raises(ContextNotFoundError, match="unknown model"):
        b.load(cid, model="never-registered")
    other = b.ingest("mistral", kv(8), content="a")["context_id"]
    b.register_model("mistral")
    with pytest.raises(mcf.InvalidArgumentError, match="belongs to"):
        b.load(other, model="llama-8b")


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", "ctx_../../etc", "/etc/passwd", "ctx_" + "0" * 31 + "/",
                                 "", "ctx_" + "G" * 32, 5, None, "a\0b", "x" * 200,
                                 "ctx_" + "0" * 32 + "\n"])  # "$" matches before a final newline (schemathesis)
def test_hostile_ids_touch_nothing(tmp_path, bad):
    root = tmp_path / "bucket"
    b = Bucket(root)
    cid = b.ingest("m", kv(9), content="keep")["context_id"]
    outside = tmp_path / "outside.json"
    outside.write_text("sentinel")
    def listing():
        return sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*")
                      if p.name not in (".lock", "registry.json") and p.is_file())

    before = listing()
    for op in (b.lookup, b.load, b.delete, b.pin):
        with pytest.raises(mcf.InvalidArgumentError):
            op(bad)
    bad_model = bad if not (isinstance(bad, str) and bad.startswith("ctx_")) else bad.replace("ctx", ".ctx")
    for op in (b.discover, b.model, b.register_model):
        with pytest.raises(mcf.InvalidArgumentError):
            op(bad_model)
    with pytest.raises(mcf.InvalidArgumentError):
        b.ingest(bad_model, kv(9), content="x")
    assert listing() == before
    assert outside.read_text() == "sentinel"
    assert ids(b.discover("m")) == [cid]


def test_malformed_json(tmp_path):
    b = Bucket(tmp_path)
    good = b.ingest("m", kv(10), content="good")["context_id"]
    bad = b.ingest("m", kv(11), content="bad")["context_id"]
    meta_path = tmp_path / "contexts" / bad / "metadata.json"
    for text in ["{", "[]", '{"context_id": 5}', "\xff\xfe", json.dumps({"context_id": good}),
                 json.dumps({**json.loads((tmp_path / "contexts" / good / "metadata.json").read_text()),
                             "context_id": bad, "kv_cache": {"shape": {}}})]:
        meta_path.write_bytes(text.encode("latin-1"))
        with pytest.raises(mcf.FormatError) as ei:
            b.lookup(bad)
        assert str(meta_path) in str(ei.value)
        reg = b.rebuild()
        assert ids(c for m in reg["models"] for c in m["contexts"]) == [good]
        assert [s["context_id"] for s in reg["skipped"]] == [bad]
    # a corrupt or missing registry is a cache: rebuilt on next use
    for text in ["not json", '{"models": [{"model_id": "m", "contexts": [{"context_id": "../../x"}]}]}', None]:
        if text is None:
            (tmp_path / "registry.json").unlink()
        else:
            (tmp_path / "registry.json").write_text(text)
        assert ids(Bucket(tmp_path).discover("m")) == [good]


def test_corrupt_kv_file_is_reported(tmp_path):
    b = Bucket(tmp_path)
    cid = b.ingest("m", kv(12), content="c", compression="none")["context_id"]
    p = tmp_path / "contexts" / cid / "kv_data.mcb"
    raw = bytearray(p.read_bytes())
    raw[100] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(mcf.ChecksumError):
        b.load(cid)
    p.write_bytes(bytes(raw[:80]))
    with pytest.raises(mcf.TruncatedError):
        b.load(cid)


# ------------------------------------------------------------------------------------------------
# processes: crashes and concurrency
# ------------------------------------------------------------------------------------------------
WORKER = textwrap.dedent("""
    import os, sys, zlib
    import numpy as np
    from mcf.bucket import _registry, store
    root, tag, count, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if crash_at != "none":
        real_rename = os.rename
        committed = []
        if crash_at == "snapshot":
            _registry.JOURNAL_COMPACT_BYTES = 0  # every registry update then writes a new snapshot
        def rename(src, dst, *a, **k):
            # crash_at "snapshot": die right before the registry snapshot written after the first commit
            # would be replaced; crash_at "commit": die right before the context directory is renamed
            # into place (renames inside a bucket are relative to a directory descriptor: bare names)
            if crash_at == "snapshot" and str(dst) == "registry.json" and committed:
                os._exit(9)
            if crash_at == "commit" and str(dst).startswith("ctx_"):
                os._exit(9)
            if str(dst).startswith("ctx_"):
                committed.append(dst)
            return real_rename(src, dst, *a, **k)
        real_journal_write = _registry.journal_write
        def journal_write(fd, payload):
            # crash_at "registry": die halfway through appending the registry journal record
            if crash_at == "registry":
                os.write(fd, payload[: len(payload) // 2])
                os._exit(9)
            return real_journal_write(fd, payload)
        os.rename, _registry.journal_write = rename, journal_write
    b = store.Bucket(root)
    rng = np.random.default_rng(zlib.crc32(tag.encode()))  # stable across runs
    for i in range(count):
        layers = [(rng.standard_normal((2, 64, 16)).astype(np.float32),) * 2 for _ in range(4)]
        m = b.ingest("m", layers, content=f"{tag}-{i}", compression="lz4" if i % 2 else "none")
        print(m["context_id"], flush=True)
""")


def run_worker(root, tag, count, crash_at="none", **kw):
    return subprocess.Popen([sys.executable, "-c", WORKER, str(root), tag, str(count), crash_at],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def assert_consistent(root: Path, committed: set[str]):
    """Everything committed loads after a rebuild; nothing half-written is visible."""
    b = Bucket(root)
    reg = b.rebuild()
    listed = {c["context_id"] for m in reg["models"] for c in m["contexts"]}
    assert committed <= listed
    assert reg["skipped"] == []
    for cid in listed:
        assert len(b.load(cid, record_access=False)) == 4
    assert listed == set(ids(b.discover("m")))
    visible = {p.name for p in (root / "contexts").iterdir() if not p.name.startswith(".")}
    assert visible == listed


@pytest.mark.parametrize("crash_at", ["commit", "registry", "snapshot"])
def test_killed_at_a_fixed_point_then_rebuild(tmp_path, crash_at):
    Bucket(tmp_path).ingest("m", kv(13, n_layers=4, seq=64, dim=16), content="before")
    proc = run_worker(tmp_path, "w", 3, crash_at)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 9, err
    assert out == ""  # it died inside its first ingest
    dirs = [p.name for p in (tmp_path / "contexts").iterdir()]
    unhealed = Bucket(tmp_path, reconcile=False).registry()  # what the registry files say by themselves
    before = {c["context_id"] for m in Bucket(tmp_path).registry()["models"] for c in m["contexts"]}
    # "snapshot": committed, then killed while writing a snapshot; "registry": committed, its journal line
    # torn.  Either way the registry files alone do not list it, and the next open's reconciliation does
    assert len(before) == (1 if crash_at == "commit" else 2)
    if crash_at == "snapshot":
        assert len([d for d in dirs if d.startswith("ctx_")]) == 2
        assert unhealed["statistics"]["total_contexts"] == 1
    elif crash_at == "registry":
        assert len([d for d in dirs if d.startswith("ctx_")]) == 2
        assert unhealed["statistics"]["total_contexts"] == 1
        # the next writer drops the torn line and appends after it
        b = Bucket(tmp_path)
        extra = b.ingest("m", kv(14, n_layers=4, seq=64, dim=16), content="after")["context_id"]
        assert ids(Bucket(tmp_path, reconcile=False).discover("m")) == sorted(before | {extra})
        before |= {extra}
    else:  # not committed (died before the rename)
        assert any(d.startswith(".tmp-") for d in dirs) and len([d for d in dirs if d.startswith("ctx_")]) == 1
    assert_consistent(tmp_path, before)
    b = Bucket(tmp_path)
    b.gc()  # fresh temp dirs are left alone (a live writer may own them)
    assert len(b.discover("m")) == {"commit": 1, "registry": 3, "snapshot": 2}[crash_at]


def test_killed_at_random_times_then_rebuild(tmp_path):
    committed: set[str] = set()
    for delay in (0.0, 0.05, 0.2):
        proc = run_worker(tmp_path, f"r{delay}", 2000)
        first = proc.stdout.readline()  # it is ingesting now
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL  # killed mid-run, not finished
        committed |= set((first + out).split())
        assert_consistent(tmp_path, committed)
    assert len(committed) >= 3


def test_two_processes_ingest_at_once(tmp_path):
    procs = [run_worker(tmp_path, tag, 12) for tag in ("a", "b")]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
    written = set(outs[0][0].split()) | set(outs[1][0].split())
    assert len(written) == 24
    # without a rebuild: the registry saw every update (the lock serialized them)
    assert set(ids(Bucket(tmp_path).discover("m"))) == written
    assert_consistent(tmp_path, written)


# ------------------------------------------------------------------------------------------------
# prefix reuse
# ------------------------------------------------------------------------------------------------
def kv_tokens(seed: int, n: int):
    return kv(seed, n_layers=2, heads=2, seq=n, dim=4)


def test_prefix_lookup_longest_and_partial_load(tmp_path):
    clock = Clock()
    b = Bucket(tmp_path, clock=clock, prefix_chunk_tokens=16)
    rng = np.random.default_rng(20)
    base = rng.integers(0, 50_000, 100).tolist()
    two = base[:40] + [7] * 10             # shares chunks 0, 1 with base (32 tokens)
    three = base[:50] + [9] * 3            # shares chunks 0..2 (48 tokens)
    la, l2, l3 = kv_tokens(21, 100), kv_tokens(22, 50), kv_tokens(23, 53)
    a = b.ingest("m", la, token_ids=base)["context_id"]
    c2 = b.ingest("m", l2, token_ids=two, ttl=5)["context_id"]
    c3 = b.ingest("m", l3, token_ids=three, dtype="float32")["context_id"]
    b.ingest("m", kv_tokens(24, 20), content="text only")  # no token ids: not indexed

    # a prompt continuing base for 70 tokens: base itself matches 4 whole chunks (64 tokens)
    hit = Bucket(tmp_path, clock=clock, prefix_chunk_tokens=16).lookup_prefix("m", base[:70] + [1, 2])
    assert (hit["context_id"], hit["tokens"]) == (a, 64)
    (k, v), _ = b.load(a, tokens=hit["tokens"])
    np.testing.assert_array_equal(k, la[0][0][:, :64].astype(np.float16))
    # a prompt that follows `three` (not base) after token 50: only `three` has chunk 2... and base too
    q = three[:48] + [5] * 20
    hit = b.lookup_prefix("m", q)
    assert hit["tokens"] == 48 and hit["context_id"] in (a, c3)
    assert b.lookup_prefix("m", q, dtype="float32")["context_id"] == c3
    # a prompt sharing two chunks with `two`, diverging from base in chunk 2
    q = two[:45] + [3] * 30
    assert b.lookup_prefix("m", q)["tokens"] == 32
    # nothing shared in the first chunk, shorter than a chunk, other model
    assert b.lookup_prefix("m", [1] * 40) is None
    assert b.lookup_prefix("m", base[:15]) is None
    assert b.lookup_prefix("other", base) is None
    # a different chunk size never matches hashes made with another
    assert Bucket(tmp_path, prefix_chunk_tokens=8).lookup_prefix("m", base) is None
    # expired and deleted contexts are not offered
    clock.t += 10
    only_two = two[:40] + [0] * 30
    hit = b.lookup_prefix("m", only_two)
    assert hit is None or hit["context_id"] != c2
    b.delete(a)
    assert b.lookup_prefix("m", base[:70])["context_id"] == c3


def test_prefix_lookup_skips_what_load_refuses(tmp_path):
    """A stale 1,024-token context was returned (its load raises StaleContextError) instead of the current
    one sharing 512 tokens; an encrypted one cannot be loaded without the key."""
    pytest.importorskip("cryptography", reason="encrypted contexts need the 'bucket' extra")
    b = Bucket(tmp_path, prefix_chunk_tokens=256)
    rng = np.random.default_rng(40)
    prompt = rng.integers(0, 50_000, 1100).tolist()
    b.register_model("m", model_hash="sha256:v1")
    stale = b.ingest("m", kv_tokens(41, 1024), token_ids=prompt[:1024])["context_id"]
    b.register_model("m", model_hash="sha256:v2")            # other weights: `stale` is now stale
    current = b.ingest("m", kv_tokens(42, 600), token_ids=prompt[:512] + [1] * 88)["context_id"]
    assert b.is_stale(stale) and not b.is_stale(current)
    hit = b.lookup_prefix("m", prompt)
    assert (hit["context_id"], hit["tokens"]) == (current, 512)
    assert len(b.load(hit["context_id"], tokens=hit["tokens"])) == 2
    # an encrypted context is offered to a bucket that has the key only
    key = bytes(range(32))
    secret = Bucket(tmp_path, prefix_chunk_tokens=256, key=key).ingest(
        "m", kv_tokens(43, 768), token_ids=prompt[:768])["context_id"]
    assert Bucket(tmp_path, prefix_chunk_tokens=256, key=key).lookup_prefix("m", prompt)["context_id"] == secret
    hit = b.lookup_prefix("m", prompt)
    assert (hit["context_id"], hit["tokens"]) == (current, 512)
    # nothing loadable at all: None, not a context that load refuses
    b.delete(current)
    assert b.lookup_prefix("m", prompt) is None


def test_layer_and_token_selections_follow_the_integer_rules(tmp_path):
    """``load(tokens=True)`` returned one token and ``load(layers=True)`` layer 1 from the warm tier.  As for
    every integer argument of mcf, bools, floats and strings are refused on every path and numpy integers
    taken, in Bucket.load (cold and warm) and KVFile.load alike."""
    b = Bucket(tmp_path)
    layers = kv(50, n_layers=3)
    cid = b.ingest("m", layers, content="sel", dtype="float32")["context_id"]
    from mcf.bucket import open_kv

    for warm in (False, True):
        if warm:
            b.promote(cid, "warm")
        want = b.load(cid, layers=[2, 0], tokens=3)
        np.testing.assert_array_equal(want[0][0], layers[2][0][:, :3])
        for good in ({"layers": [np.int64(2), np.uint8(0)], "tokens": np.int32(3)},):
            got = b.load(cid, **good)
            assert all(np.array_equal(x, y) for p, q in zip(got, want) for x, y in zip(p, q))
        for bad in ({"tokens": True}, {"tokens": 2.0}, {"tokens": np.bool_(True)}, {"layers": True},
                    {"layers": [1.0]}, {"layers": [np.bool_(False)]}, {"layers": "1"}, {"tokens": "3"},
                    {"layers": [3]}, {"tokens": 9}, {"layers": [-1]}):
            with pytest.raises(mcf.InvalidArgumentError):
                b.load(cid, **bad)
    with open_kv(tmp_path / "contexts" / cid / "kv_data.mcb") as f:
        for bad in ({"tokens": True}, {"layers": True}, {"layers": [1.0]}, {"layers": "1"}):
            with pytest.raises(mcf.InvalidArgumentError):
                f.load(**bad)
        assert np.array_equal(f.load(np.int64(1), tokens=np.uint16(2))[0][1], layers[1][1][:, :2])


def test_prefix_argument_errors(tmp_path):
    b = Bucket(tmp_path, prefix_chunk_tokens=4)
    with pytest.raises(mcf.InvalidArgumentError, match="token ids"):
        b.ingest("m", kv_tokens(30, 10), token_ids=list(range(9)))
    with pytest.raises(mcf.InvalidArgumentError):
        b.lookup_prefix("m", [[1, 2]])
    with pytest.raises(mcf.InvalidArgumentError):
        b.lookup_prefix("m", [1.5, 2.5])
    with pytest.raises(mcf.InvalidArgumentError):
        Bucket(tmp_path, prefix_chunk_tokens=0)
    cid = b.ingest("m", kv_tokens(31, 8), token_ids=list(range(8)))["context_id"]
    b.rebuild()  # fold the journal into registry.json, so the garbage written below is what gets read
    meta_path = tmp_path / "contexts" / cid / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["prefix"]["hashes"] = [5]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(mcf.FormatError, match="prefix"):
        b.lookup(cid)
    # a registry whose prefix entries are garbage is survived (the context metadata decides)
    reg = json.loads((tmp_path / "registry.json").read_text())
    reg["models"][0]["contexts"][0]["prefix"] = {"chunk_tokens": 4, "hashes": [[1], 3]}
    (tmp_path / "registry.json").write_text(json.dumps(reg))
    assert Bucket(tmp_path, prefix_chunk_tokens=4).lookup_prefix("m", list(range(8))) is None


# ------------------------------------------------------------------------------------------------
# tiers
# ------------------------------------------------------------------------------------------------
def test_warm_tier_budget_and_lru(tmp_path):
    per = 2 * 2 * (2 * 8 * 4) * 4  # 2 layers x (K, V) x [2, 8, 4] float32 (loaded as stored: float32)
    b = Bucket(tmp_path, warm_budget_bytes=2 * per)
    events = []
    b.subscribe(events.append)
    cids = [b.ingest("m", kv(40 + i), content=f"w{i}", dtype="float32", compression="lz4")["context_id"]
            for i in range(3)]
    assert b.promote(cids[0]) == "warm" and b.promote(cids[1]) == "warm"
    assert b.warm_used_bytes == 2 * per
    b.load(cids[0])  # cids[0] is now the most recently used
    b.promote(cids[2])  # evicts cids[1], the least recently used
    assert [b.tier(c) for c in cids] == ["warm", "cold", "warm"]
    assert b.warm_used_bytes == 2 * per
    assert any(e["event"] == "context.demoted" and e["context_id"] == cids[1] for e in events)
    # served from RAM: equal to the disk data, and writable copies rather than the mapping
    layers = kv(40)
    got = b.load(cids[0], layers=[1], tokens=5)
    np.testing.assert_array_equal(got[0][0], layers[1][0][:, :5])
    tiers = {d["context_id"]: (d["tier"], d["is_loaded"]) for d in b.discover("m")}
    assert tiers[cids[0]] == ("warm", True) and tiers[cids[1]] == ("cold", False)
    assert b.demote(cids[0]) == "cold" and b.warm_used_bytes == per
    b.delete(cids[2])
    assert b.warm_used_bytes == 0
    with pytest.raises(mcf.InvalidArgumentError, match="budget"):
        Bucket(tmp_path, warm_budget_bytes=per - 1).promote(cids[0])
    with pytest.raises(mcf.InvalidArgumentError):
        b.promote(cids[0], "cold")
    with pytest.raises(mcf.InvalidArgumentError):
        b.demote(cids[0], "hot")
    b.promote(cids[1])
    with pytest.raises(mcf.InvalidArgumentError):  # warm hits validate their arguments too
        b.load(cids[1], layers=[5])


def test_hot_tier_and_torch_output(tmp_path):
    torch = pytest.importorskip("torch", reason="the hot tier needs PyTorch")
    b = Bucket(tmp_path)
    layers = kv(50)
    cid = b.ingest("m", layers, content="hot", dtype="bfloat16", compression="none")["context_id"]
    (k, v), _ = b.load(cid, as_torch=True)
    assert k.dtype == torch.bfloat16 and k.shape == (2, 8, 4)
    np.testing.assert_array_equal(k.float().numpy(), layers[0][0].astype(ml_dtypes_bf16()).astype(np.float32))
    k.add_(1)  # torch output is an owned copy: writing it never touches the mapping
    np.testing.assert_array_equal(b.load(cid, as_torch=True)[0][0].float().numpy(),
                                  layers[0][0].astype(ml_dtypes_bf16()).astype(np.float32))
    if not torch.cuda.is_available():
        with pytest.raises(mcf.InvalidArgumentError, match="CUDA"):
            b.promote(cid, "hot", device="cuda")
        assert b.tier(cid) == "cold"
    with pytest.raises(mcf.InvalidArgumentError, match="device"):
        b.promote(cid, "hot", device="not-a-device")
    assert b.promote(cid, "hot", device="cpu") == "hot"
    hot = b.load(cid, as_torch=True, layers=1, tokens=3)
    assert hot[0][1].shape == (2, 3, 4)
    assert b.demote(cid, "warm") == "warm" and b.demote(cid) == "cold"


def ml_dtypes_bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def test_planted_symlinks_are_not_followed(tmp_path):
    root = tmp_path / "bucket"
    b = Bucket(root)
    good = b.ingest("m", kv(60), content="good")["context_id"]
    victim = b.ingest("m", kv(61), content="victim")["context_id"]
    outside = tmp_path / "outside"
    (root / "contexts" / victim).rename(outside)  # a real context directory, now outside the root
    (root / "contexts" / victim).symlink_to(outside, target_is_directory=True)
    with pytest.raises(mcf.FormatError, match="symbolic link"):
        b.lookup(victim)
    reg = b.rebuild()
    assert [s["context_id"] for s in reg["skipped"]] == [victim]
    assert ids(b.discover("m")) == [good]
    b.delete(victim)  # removes the link, not its target
    assert not (root / "contexts" / victim).exists() and (outside / "kv_data.mcb").is_file()
    # a symlinked file inside a real context directory
    d = root / "contexts" / good
    (d / "kv_data.mcb").rename(tmp_path / "kv.bin")
    (d / "kv_data.mcb").symlink_to(tmp_path / "kv.bin")
    with pytest.raises(mcf.FormatError, match="symbolic link"):
        b.load(good)


def test_ids_with_a_trailing_newline_are_refused():
    """A regex ending in "$" also matches before a final newline; ids are matched whole (found by
    schemathesis: GET /contexts?model_id=x%0A was answered 200)."""
    from mcf.bucket.store import check_context_id, check_model_id

    with pytest.raises(mcf.InvalidArgumentError):
        check_model_id("llama\n")
    with pytest.raises(mcf.InvalidArgumentError):
        check_context_id("ctx_" + "0" * 32 + "\n")
    assert check_model_id("llama") == "llama"


# ------------------------------------------------------------------------------------------------
# the registry journal and the incremental scan
# ------------------------------------------------------------------------------------------------
def test_ingest_appends_to_the_journal_not_the_snapshot(tmp_path, monkeypatch):
    b = Bucket(tmp_path)
    first = b.ingest("m", kv(40), content="first")["context_id"]
    snap = (tmp_path / "registry.json").stat()
    other = Bucket(tmp_path)  # a second handle (as another process would have) sees every change
    assert ids(other.discover("m")) == [first]
    made = [b.ingest("m" if i % 2 else "n", kv(41 + i), content=f"c{i}")["context_id"] for i in range(6)]
    b.pin(made[0])
    b.delete(made[1])
    after = (tmp_path / "registry.json").stat()
    assert (after.st_ino, after.st_mtime_ns) == (snap.st_ino, snap.st_mtime_ns)  # not rewritten
    lines = (tmp_path / "registry.journal").read_bytes().splitlines()
    assert len(lines) == 1 + 6 + 1 + 1
    want = {"m": sorted([first] + [c for i, c in enumerate(made) if i % 2 and c != made[1]]), "n": sorted(made[0::2])}
    assert ids(other.discover("m")) == want["m"] and ids(other.discover("n")) == want["n"]
    assert [c["pinned"] for c in other.discover("n") if c["context_id"] == made[0]] == [True]
    reg = other.registry()
    assert reg["statistics"]["total_contexts"] == 1 + 5
    # the rebuilt registry says the same
    rebuilt = Bucket(tmp_path).rebuild()
    assert {m["model_id"]: ids(m["contexts"]) for m in rebuilt["models"]} == want
    assert (tmp_path / "registry.journal").stat().st_size == 0
    # a long journal is folded into a new snapshot
    monkeypatch.setattr(_registry, "JOURNAL_COMPACT_BYTES", 1500)
    b2 = Bucket(tmp_path)
    for i in range(6):
        b2.ingest("m", kv(60 + i), content=f"fold{i}")
    assert (tmp_path / "registry.journal").stat().st_size < 1500
    assert len(Bucket(tmp_path).discover("m")) == len(want["m"]) + 6
    assert len(other.discover("m")) == len(want["m"]) + 6  # the old handle reloads the new snapshot


def test_damaged_journal_is_rebuilt_and_torn_tail_ignored(tmp_path):
    b = Bucket(tmp_path)
    made = [b.ingest("m", kv(70 + i), content=f"d{i}")["context_id"] for i in range(3)]
    j = tmp_path / "registry.journal"
    raw = j.read_bytes()
    # a torn final line (a writer killed mid-append) is ignored: by the registry files alone the
    # committed context is not listed, the others are; a scan lists it, and so does opening the bucket
    j.write_bytes(raw[:-20])
    assert ids(Bucket(tmp_path, reconcile=False).discover("m")) == sorted(made[:2])
    assert ids(Bucket(tmp_path, reconcile=False).discover("m", force_scan=True)) == sorted(made)
    j.write_bytes(raw[:-20])
    assert ids(Bucket(tmp_path).discover("m")) == sorted(made)
    # a damaged line with good lines after it: the journal cannot be trusted, the registry is rebuilt
    lines = raw.splitlines(keepends=True)
    lines[0] = lines[0][:12] + (b"X" if lines[0][12:13] != b"X" else b"Y") + lines[0][13:]
    j.write_bytes(b"".join(lines))
    (tmp_path / "registry.json").write_text(json.dumps({"models": []}))  # force a full reload
    assert ids(Bucket(tmp_path).discover("m")) == sorted(made)


def test_force_scan_rereads_only_what_changed(tmp_path, monkeypatch):
    b = Bucket(tmp_path)
    made = [b.ingest("m", kv(80 + i), content=f"s{i}")["context_id"] for i in range(5)]
    # changes behind the registry's back: a context removed, one edited, one added from elsewhere
    elsewhere = Bucket(tmp_path / "elsewhere")
    new = elsewhere.ingest("m", kv(90), content="new")["context_id"]
    shutil.copytree(tmp_path / "elsewhere" / "contexts" / new, tmp_path / "contexts" / new)
    shutil.rmtree(tmp_path / "contexts" / made[0])
    mp = tmp_path / "contexts" / made[1] / "metadata.json"
    meta = json.loads(mp.read_text())
    meta["content"]["name"] = "renamed by hand, and longer"
    mp.write_text(json.dumps(meta))
    read = []
    real = Bucket._read_meta
    monkeypatch.setattr(Bucket, "_read_meta", lambda self, cid: read.append(cid) or real(self, cid))
    got = b.discover("m", force_scan=True)
    assert ids(got) == sorted(made[1:] + [new])
    assert sorted(read) == sorted([made[1], new])  # the three unchanged ones were only stat()ed
    assert [c["name"] for c in got if c["context_id"] == made[1]] == ["renamed by hand, and longer"]
    assert ids(Bucket(tmp_path).discover("m")) == sorted(made[1:] + [new])  # journaled for everyone


# ------------------------------------------------------------------------------------------------
# persistent tier preferences (what `mcf bucket promote/demote --root` records)
# ------------------------------------------------------------------------------------------------
def test_tier_preference_is_honoured_by_other_handles(tmp_path):
    t = [1000.0]
    server = Bucket(tmp_path, clock=lambda: t[0])  # a long-lived process
    cid = server.ingest("m", kv(100), content="pref")["context_id"]
    events = []
    server.subscribe(events.append)
    cli = Bucket(tmp_path, clock=lambda: t[0])  # a short-lived one
    t[0] += 1
    cli.set_tier_preference(cid, "warm")
    assert server.tier(cid) == "cold"
    server.load(cid)
    assert server.tier(cid) == "warm" and [e["to_tier"] for e in events if e["event"] == "context.promoted"] == ["warm"]
    assert [c["preferred_tier"] for c in server.discover("m")] == ["warm"]
    # a later instruction in the process wins over the older preference
    t[0] += 1
    server.demote(cid)
    server.load(cid)
    assert server.tier(cid) == "cold"
    # a newer preference wins over the older instruction
    t[0] += 1
    cli.set_tier_preference(cid, "warm")
    server.load(cid)
    assert server.tier(cid) == "warm"
    t[0] += 1
    cli.set_tier_preference(cid, "cold")
    server.load(cid)
    assert server.tier(cid) == "cold"
    # a fresh process applies preferences up front
    t[0] += 1
    cli.set_tier_preference(cid, "warm")
    fresh = Bucket(tmp_path, clock=lambda: t[0])
    assert fresh.apply_tier_preferences() == {cid: "warm"} and fresh.tier(cid) == "warm"
    with pytest.raises(mcf.InvalidArgumentError):
        cli.set_tier_preference(cid, "lukewarm")
    with pytest.raises(mcf.InvalidArgumentError):
        cli.set_tier_preference(cid, "warm", device="cuda")
    with pytest.raises(KeyError):  # ContextNotFoundError
        cli.set_tier_preference("ctx_" + "1" * 32, "warm")


def test_unmeetable_hot_preference_falls_back_to_warm(tmp_path):
    b = Bucket(tmp_path)
    cid = b.ingest("m", kv(101), content="hot")["context_id"]
    Bucket(tmp_path).set_tier_preference(cid, "hot", device="cuda:7")
    events = []
    b.subscribe(events.append)
    try:
        import torch

        has_dev = torch.cuda.is_available() and torch.cuda.device_count() > 7
    except ImportError:
        has_dev = False
    out = b.load(cid)  # never fails because of a preference
    assert len(out) == 2
    assert b.tier(cid) == ("hot" if has_dev else "warm")
    if not has_dev:
        assert [e["tier"] for e in events if e["event"] == "context.preference_unmet"] == ["hot"]


# ------------------------------------------------------------------------------------------------
# verification policy and loading into caller buffers
# ------------------------------------------------------------------------------------------------
def test_verify_once_checks_each_file_identity_once(tmp_path, monkeypatch):
    from mcf.bucket.kvfile import KVFile

    calls = []
    real = KVFile.verify
    monkeypatch.setattr(KVFile, "verify", lambda self: calls.append(1) or real(self))
    b = Bucket(tmp_path, verify="once")
    cid = b.ingest("m", kv(110, seq=64), content="once", compression="none")["context_id"]
    for _ in range(3):
        b.load(cid, record_access=False)
    assert len(calls) == 1  # the same file: checked on the first load only
    assert Bucket(tmp_path).load(cid, record_access=False) and len(calls) == 2  # "always" is the default
    b.load(cid, record_access=False, verify=True)
    assert len(calls) == 3  # a per-call override
    # another process (a new Bucket) finds the record the first one left next to the file
    sidecar = tmp_path / "contexts" / cid / ".verified.json"
    assert json.loads(sidecar.read_text())["checksum"] == int(b.lookup(cid)["storage"]["checksum"][6:], 16)
    Bucket(tmp_path, verify="once").load(cid, record_access=False)
    assert len(calls) == 3
    for junk in ("{", json.dumps({"identity": [1, 2], "checksum": 5}), json.dumps({"identity": "x"})):
        sidecar.write_text(junk)  # an unusable record means: check again (and write a good one)
        Bucket(tmp_path, verify="once").load(cid, record_access=False)
    assert len(calls) == 6
    Bucket(tmp_path, verify="once").load(cid, record_access=False)
    assert len(calls) == 6
    # any write to the file changes its identity (ctime): checked again, the damage found before use
    p = tmp_path / "contexts" / cid / "kv_data.mcb"
    raw = bytearray(p.read_bytes())
    raw[200] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(mcf.ChecksumError):
        b.load(cid, record_access=False)
    with pytest.raises(mcf.InvalidArgumentError):
        Bucket(tmp_path, verify="sometimes")


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
def test_bucket_load_into_out(tmp_path, compression):
    b = Bucket(tmp_path)
    layers = kv(111, n_layers=3, seq=16)
    cid = b.ingest("m", layers, content="out", dtype="float32", compression=compression)["context_id"]
    out = [(np.zeros((2, 16, 4), np.float32), np.zeros((2, 16, 4), np.float32)) for _ in range(3)]
    got = b.load(cid, out=out)
    assert got[2][1] is out[2][1]
    np.testing.assert_array_equal(out[2][1], layers[2][1])
    b.promote(cid, "warm")  # from the warm tier too
    out2 = [(np.zeros((2, 8, 4), np.float32), np.zeros((2, 8, 4), np.float32))]
    b.load(cid, layers=[1], tokens=8, out=out2)
    np.testing.assert_array_equal(out2[0][0], layers[1][0][:, :8])
    with pytest.raises(mcf.InvalidArgumentError):
        b.load(cid, layers=[1], out=out2)  # 16 tokens do not fit 8


def test_registry_without_orjson(tmp_path, monkeypatch):
    """orjson is optional: the json module writes and reads the same snapshot."""
    b = Bucket(tmp_path)
    made = [b.ingest("m", kv(120 + i), content=f"j{i}")["context_id"] for i in range(3)]
    with_orjson = b.rebuild()
    from mcf.bucket import _json

    monkeypatch.setattr(_json, "_orjson", None)
    again = Bucket(tmp_path).rebuild()
    assert with_orjson["models"] == again["models"]
    assert ids(Bucket(tmp_path).discover("m")) == sorted(made)
    assert _json.loads(b'{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}


def _line(rec) -> bytes:
    body = json.dumps(rec).encode()
    return b"%08x " % zlib.crc32(body) + body + b"\n"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.lists(st.one_of(
    st.binary(max_size=80),
    st.builds(_line, st.one_of(
        st.just({"op": "put"}), st.just({"op": "del", "context_id": "../x"}), st.just({"op": "zap"}),
        st.just([1, 2]), st.just({"op": "put", "model_id": "m", "summary": {"context_id": "ctx_" + "a" * 32}}),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)))), max_size=6))
def test_garbage_journal_never_breaks_discovery(tmp_path_factory, junk):
    """Whatever registry.journal holds, discovery answers and a scan lists exactly what is committed
    (torn or damaged lines are dropped or make the registry rebuild itself)."""
    root = tmp_path_factory.mktemp("junk")
    b = Bucket(root)
    made = sorted(b.ingest("m", kv(130 + i), content=f"g{i}")["context_id"] for i in range(2))
    j = root / "registry.journal"
    j.write_bytes(j.read_bytes() + b"".join(x if isinstance(x, bytes) else x for x in junk))
    fresh = Bucket(root)
    listed = ids(fresh.discover("m"))
    assert set(listed) <= set(made)
    assert ids(fresh.discover("m", force_scan=True)) == made
    fresh.ingest("m", kv(140), content="after the junk")
    assert len(Bucket(root).discover("m", force_scan=True)) == 3


def test_one_bucket_shared_by_threads(tmp_path):
    """The server's thread pool shares one Bucket: ingests, discovery, scans, prefix lookups and tier
    moves at once leave it consistent (the in-memory registry is guarded, the file lock orders writers)."""
    import threading

    b = Bucket(tmp_path, prefix_chunk_tokens=4)
    errors, made = [], []

    def writer(tag):
        try:
            for i in range(8):
                src = {"token_ids": list(range(i, i + 8))} if tag == "t" else {"content": f"{tag}{i}"}
                made.append(b.ingest("m", kv(zlib.crc32(f"{tag}{i}".encode()) % 1000, seq=8), **src)["context_id"])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader():
        try:
            for _ in range(25):
                for c in b.discover("m"):
                    b.tier(c["context_id"])
                b.lookup_prefix("m", list(range(8)))
                b.discover("m", force_scan=True)
                b.registry()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in ("a", "t")] + [threading.Thread(target=reader)
                                                                                  for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert ids(b.discover("m")) == sorted(set(made)) == ids(Bucket(tmp_path).discover("m", force_scan=True))
    assert len(set(made)) == 16


def test_model_document_without_or_with_another_model_id_is_a_format_error(tmp_path):
    """Found by the bucket_dir fuzz target: models/<id>.json without "model_id" made check_compatible
    raise a bare KeyError."""
    import json

    b = Bucket(tmp_path)
    b.register_model("m", num_layers=1)
    p = tmp_path / "models" / "m.json"
    doc = json.loads(p.read_text())
    del doc["model_id"]
    p.write_text(json.dumps(doc))
    with pytest.raises(mcf.FormatError, match="model_id"):
        b.model("m")
    doc["model_id"] = "other"
    p.write_text(json.dumps(doc))
    with pytest.raises(mcf.FormatError, match="another model"):
        b.model("m")


# ------------------------------------------------------------------------------------------------
# what KV data may be
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_ingest_from_nested_lists_in_every_dtype(tmp_path, dtype):
    """``ingest(..., dtype="bfloat16")`` with lists raised AttributeError ('list' object has no
    attribute 'dtype'); lists are now taken in every dtype, as arrays are."""
    layers = kv(120)
    as_lists = [(k.tolist(), v.tolist()) for k, v in layers]
    b = Bucket(tmp_path)
    from_lists = b.ingest("m", as_lists, content="lists", dtype=dtype)
    from_arrays = b.ingest("m2", layers, content="lists", dtype=dtype)
    for (k1, v1), (k2, v2) in zip(b.load(from_lists["context_id"]), b.load(from_arrays["context_id"])):
        np.testing.assert_array_equal(np.asarray(k1, np.float32), np.asarray(k2, np.float32))
        np.testing.assert_array_equal(np.asarray(v1, np.float32), np.asarray(v2, np.float32))


@pytest.mark.parametrize("bad", [np.complex64, np.bool_, "M8[s]", "U3", object, [("a", "<f4")]])
def test_kv_data_of_other_kinds_is_refused_not_cast(tmp_path, bad):
    """Only floating-point and integer KV data; complex (its imaginary part would be
    dropped), bool, datetime, strings, objects and structured arrays are refused."""
    a = np.zeros((2, 8, 4), dtype=bad)
    with pytest.raises(mcf.InvalidArgumentError, match="floating point or integer"):
        Bucket(tmp_path).ingest("m", [(a, a)], content="bad")
    with pytest.raises(mcf.InvalidArgumentError):
        Bucket(tmp_path).ingest("m", [([[[1, 2]], [[3]]], [[[1, 2]], [[3]]])], content="ragged")
    assert Bucket(tmp_path).discover("m") == []


@pytest.mark.parametrize("error", ["torch", "memory"])
def test_hot_tier_out_of_memory_keeps_the_warm_copy(tmp_path, monkeypatch, error):
    """A device that runs out of memory while a context is copied onto it is a request this process
    cannot satisfy now (HotTierFullError, 409 over REST), not a failure: nothing half-placed is kept,
    the context stays warm, and a later promote can succeed."""
    torch = pytest.importorskip("torch", reason="the hot tier needs PyTorch")
    from mcf.bucket import HotTierFullError, tiers

    b = Bucket(tmp_path)
    cid = b.ingest("m", kv(51), content="oom", compression="none")["context_id"]
    real, calls = tiers.to_torch, []

    def to_torch(arr, *, device=None):
        calls.append(1)
        if len(calls) == 3:  # the second layer's key: the first layer is already on the device
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)") if error == "torch" else MemoryError()
        return real(arr, device=device)

    monkeypatch.setattr(tiers, "to_torch", to_torch)
    with pytest.raises(HotTierFullError, match="out of memory") as info:
        b.promote(cid, "hot", device="cpu")
    assert isinstance(info.value, mcf.InvalidArgumentError) and cid in str(info.value)
    assert b.tier(cid) == "warm"
    monkeypatch.setattr(tiers, "to_torch", real)
    assert b.promote(cid, "hot", device="cpu") == "hot"


def test_hot_tier_out_of_memory_is_409_over_rest(tmp_path, monkeypatch):
    """The server's answer, from its ASGI application in-process (no socket)."""
    torch = pytest.importorskip("torch", reason="the hot tier needs PyTorch")
    pytest.importorskip("starlette", reason="the server needs the 'server' extra")
    import asyncio

    from mcf.bucket import tiers
    from mcf.apps.bucket_server import create_app

    cid = Bucket(tmp_path).ingest("m", kv(52), content="oom", compression="none")["context_id"]

    def to_torch(arr, *, device=None):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(tiers, "to_torch", to_torch)
    app = create_app(tmp_path)
    body = json.dumps({"target_tier": "hot", "device": "cpu"}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": f"/mcrp/v1/contexts/{cid}/promote", "raw_path": f"/mcrp/v1/contexts/{cid}/promote".encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    sent, events = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return events.pop(0) if events else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    payload = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert start["status"] == 409, payload
    assert "out of memory" in payload["error"]
