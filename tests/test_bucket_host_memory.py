"""Hot copies on ``device="cpu"`` are host memory, and count against the warm budget.

A hot copy on the CPU holds a second copy of a context's warm arrays in the process's RAM.  It was
counted against nothing and outlived the warm copy's eviction, so a client promoting contexts to
"hot" on "cpu" over REST grew the server without bound (11 promotions of 32 MiB added 384 MiB with a
64 MiB warm budget) until the OOM killer ended it.  Now the warm entry is charged for it (a cpu-hot
context costs twice its warm size), and leaves with it."""

from __future__ import annotations

import gc
import io
import json
import weakref

import numpy as np
import pytest
from _bucket_server import peak_rss_bytes, request, serve

from mcf.bucket import WarmBudgetError
from mcf.bucket.store import Bucket

torch = pytest.importorskip("torch", reason="the hot tier needs PyTorch")

MiB = 1 << 20


def layers_of(seed: int, n_layers=2, heads=2, tokens=64, dim=16):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((heads, tokens, dim)).astype(np.float32),
             rng.standard_normal((heads, tokens, dim)).astype(np.float32)) for _ in range(n_layers)]


PER = 2 * 2 * 2 * 64 * 16 * 4  # the warm bytes of one context of layers_of(): 2 layers, K and V, float32


def held(b: Bucket, cids) -> int:
    """What the tiers hold in host memory, from what they report: a warm context its arrays, a hot one
    (on the CPU) its arrays and their copy."""
    return sum({"cold": 0, "warm": PER, "hot": 2 * PER}[b.tier(c)] for c in cids)


def test_hot_copies_on_the_cpu_count_against_the_warm_budget(tmp_path):
    b = Bucket(tmp_path, warm_budget_bytes=5 * PER)
    events = []
    b.subscribe(events.append)
    cids = [b.ingest("m", layers_of(i), content=f"c{i}", dtype="float32")["context_id"] for i in range(6)]
    first = None
    for i, c in enumerate(cids):
        assert b.promote(c, "hot", device="cpu") == "hot"
        assert held(b, cids) == b.warm_used_bytes <= 5 * PER, [b.tier(x) for x in cids]
        if i == 0:
            first = weakref.ref(b._tiers.hot[c][1][0][0])  # one tensor of the first hot copy
        np.testing.assert_array_equal(b.load(c, as_torch=True)[1][1].numpy(), layers_of(i)[1][1])
    assert b.tier(cids[0]) == "cold"  # evicted for the later ones: its hot copy went with its warm arrays
    gc.collect()
    assert first() is None  # and is really gone, not just unlisted
    assert any(e["event"] == "context.demoted" and e["context_id"] == cids[0] and e["from_tier"] == "hot"
               and e["to_tier"] == "cold" for e in events)
    # dropping the hot copy gives its bytes back
    hot = [c for c in cids if b.tier(c) == "hot"]
    assert b.demote(hot[0], "warm") == "warm"
    assert held(b, cids) == b.warm_used_bytes
    # a context whose arrays and hot copy together exceed the budget is refused before anything is read,
    # and what is in the tiers stays as it was
    before = [b.tier(c) for c in cids]
    small = Bucket(tmp_path, warm_budget_bytes=2 * PER - 1)
    with pytest.raises(WarmBudgetError, match="hot copy on the CPU"):
        small.promote(cids[0], "hot", device="cpu")
    assert small.tier(cids[0]) == "cold" and small.warm_used_bytes == 0
    assert small.promote(cids[0]) == "warm"  # warm alone fits
    assert [b.tier(c) for c in cids] == before


def npz_body(seed: int, n_layers=2, heads=8, tokens=2048, dim=64) -> bytes:
    """A context of 16 MiB in float32 (K and V of 2 layers of [8, 2048, 64])."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n_layers, heads, tokens, dim), dtype=np.float32)
    bio = io.BytesIO()
    np.savez(bio, k=k, v=-k)
    return bio.getvalue()


def test_rest_hot_promotions_on_the_cpu_stay_within_the_warm_budget(tmp_path):
    """The audit's attack, scaled down: 11 hot promotions on "cpu" of 16 MiB contexts under a 64 MiB warm
    budget.  At most the budget is held, and the server's peak memory grows by about that much, not by
    the 11 copies."""
    budget, per = 64 * MiB, 16 * MiB
    with serve(tmp_path / "b", None, "--warm-budget-bytes", str(budget)) as (base, proc):
        cids = []
        for i in range(11):
            st, out, _ = request(base, "POST", f"/mcrp/v1/contexts?model_id=m&content=c{i}&dtype=float32",
                                 npz_body(i), {"Content-Type": "application/octet-stream"})
            assert st == 201, out
            cids.append(out["context_id"])
        # one promotion first: the code paths, imports and torch's own start-up are not counted as growth
        body = json.dumps({"target_tier": "hot", "device": "cpu"}).encode()
        assert request(base, "POST", f"/mcrp/v1/contexts/{cids[0]}/promote", body,
                       {"Content-Type": "application/json"})[0] == 200
        request(base, "POST", f"/mcrp/v1/contexts/{cids[0]}/demote", b"", {"Content-Type": "application/json"})
        before = peak_rss_bytes(proc.pid)
        for c in cids:
            st, out, _ = request(base, "POST", f"/mcrp/v1/contexts/{c}/promote", body,
                                 {"Content-Type": "application/json"})
            assert st == 200 and out["tier"] == "hot", out
            st, out, _ = request(base, "GET", "/mcrp/v1/models/m/contexts")
            tiers = [x["tier"] for x in out["contexts"]]
            assert per * (2 * tiers.count("hot") + tiers.count("warm")) <= budget, tiers
        grew = peak_rss_bytes(proc.pid) - before
        print(f"server peak RSS grew by {grew / MiB:.0f} MiB for 11 hot promotions of {per // MiB} MiB")  # (-s)
        assert grew < budget + 48 * MiB  # the 11 copies alone would be 176 MiB
    # a context whose hot copy on the CPU would not fit is a 409, as for the warm budget
    with serve(tmp_path / "b", None, "--warm-budget-bytes", str(2 * per - 1)) as (base, _):
        st, out, _ = request(base, "POST", f"/mcrp/v1/contexts/{cids[0]}/promote", body,
                             {"Content-Type": "application/json"})
        assert st == 409 and "hot copy on the CPU" in out["error"], out
