"""The defaults of seed 003 §9.1 as mcf decides them (docs/bucket.md, "Defaults"): a context never expires
unless a ttl or the bucket's ``default_ttl`` says so; LZ4 compression; the warm tier's fixed budget."""

from __future__ import annotations

import numpy as np
import pytest

import mcf
from mcf.bucket import Bucket
from mcf.cli import main


def kv():
    a = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    return [(a, a + 1)] * 2


def test_default_ttl(tmp_path):
    now = [1_000_000.0]
    with Bucket(tmp_path / "never", clock=lambda: now[0]) as b:
        assert b.default_ttl is None and b._tiers.warm.budget_bytes == 1 << 30
        meta = b.ingest("m", kv(), content="x")
        assert meta["timestamps"]["expires_at"] is None and meta["kv_cache"]["compression"] == "lz4"
    with Bucket(tmp_path / "week", clock=lambda: now[0], default_ttl=7 * 86400) as b:
        week = b.ingest("m", kv(), content="a")["context_id"]
        hour = b.ingest("m", kv(), content="b", ttl=3600)["context_id"]   # an explicit ttl wins
        now[0] += 3601
        assert [c["context_id"] for c in b.discover("m")] == [week]
        now[0] += 7 * 86400
        assert b.discover("m") == []
        assert sorted(b.gc()) == sorted([week, hour])
    for bad in (0, -1, True, "1", 100 * 365 * 86400):
        with pytest.raises(mcf.InvalidArgumentError, match="default_ttl must be a positive number"):
            Bucket(tmp_path / "bad", default_ttl=bad)


def test_serve_refuses_a_bad_default_ttl(tmp_path, capsys):
    pytest.importorskip("uvicorn", reason="the server needs the 'server' extra")
    assert main(["bucket", "serve", "--root", str(tmp_path / "b"), "--port", "0", "--default-ttl", "-5"]) == 1
    assert "--default-ttl must be a positive number of seconds" in capsys.readouterr().err
