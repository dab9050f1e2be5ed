"""``mcf bucket ...`` through mcf.cli.main, as a user would run it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mcf.bucket.store import Bucket
from mcf.cli import main


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["bucket", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def npz(tmp_path):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 2, 12, 8)).astype(np.float32)
    v = rng.standard_normal((3, 2, 12, 8)).astype(np.float32)
    p = tmp_path / "kv.npz"
    np.savez(p, k=k, v=v)
    return p, k, v


def test_ingest_ls_show_verify_rm(tmp_path, capsys, npz):
    path, k, v = npz
    root = str(tmp_path / "b")
    toks = tmp_path / "t.npy"
    np.save(toks, np.arange(12))
    rc, out, _ = run(capsys, "ingest", "--root", root, "llama", str(path), "--tokens", str(toks), "--name", "doc",
                     "--dtype", "float32", "--compression", "zstd")
    assert rc == 0
    cid = json.loads(out)["context_id"]
    got = Bucket(root).load(cid)
    np.testing.assert_array_equal(got[2][1], v[2])
    rc, out, _ = run(capsys, "ingest", "--root", root, "llama", str(path), "--text", "hello", "--ttl", "60")
    cid2 = json.loads(out)["context_id"]
    rc, out, _ = run(capsys, "ls", "--root", root, "--json")
    assert rc == 0 and sorted(r["context_id"] for r in json.loads(out)) == sorted([cid, cid2])
    rc, out, _ = run(capsys, "ls", "--root", root, "llama")
    assert cid in out and "doc" in out
    rc, out, _ = run(capsys, "show", "--root", root, cid)
    assert json.loads(out)["kv_cache"]["compression"] == "zstd"
    assert run(capsys, "verify", "--root", root, cid)[:2] == (0, f"{cid}: OK\n")
    assert run(capsys, "rm", "--root", root, cid2)[0] == 0
    rc, out, _ = run(capsys, "rebuild", "--root", root)
    assert rc == 0 and json.loads(out)["statistics"]["total_contexts"] == 1
    rc, out, _ = run(capsys, "gc", "--root", root)
    assert rc == 0 and json.loads(out) == {"deleted": []}


def test_errors_are_reported_not_raised(tmp_path, capsys, npz):
    path, _, _ = npz
    root = str(tmp_path / "b")
    rc, _, err = run(capsys, "show", "--root", root, "../etc")
    assert rc == 1 and "mcf bucket show: error:" in err  # no bucket there
    rc, out, _ = run(capsys, "ingest", "--root", root, "m", str(path), "--text", "x", "--compression", "none")
    cid = json.loads(out)["context_id"]
    rc, _, err = run(capsys, "show", "--root", root, "../../etc/passwd")
    assert rc == 1 and "invalid context id" in err
    rc, _, err = run(capsys, "rm", "--root", root, "ctx_" + "0" * 32)
    assert rc == 1 and "no context" in err
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros(3))
    rc, _, err = run(capsys, "ingest", "--root", root, "m", str(bad), "--text", "x")
    assert rc == 1 and "'k' and 'v'" in err
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    rc, _, err = run(capsys, "ingest", "--root", root, "m", str(tmp_path / "junk.npz"), "--text", "x")
    assert rc == 1 and "junk.npz: not a zip archive" in err
    kv = tmp_path / "b" / "contexts" / cid / "kv_data.mcb"
    raw = bytearray(kv.read_bytes())
    raw[-1] ^= 1
    kv.write_bytes(bytes(raw))
    rc, _, err = run(capsys, "verify", "--root", root, cid)
    assert rc == 1 and "CRC-32" in err
    (tmp_path / "b" / "contexts" / cid / "metadata.json").write_text("{")
    rc, out, _ = run(capsys, "rebuild", "--root", root)
    assert rc == 1 and json.loads(out)["skipped"][0]["context_id"] == cid


def test_promote_demote_record_a_preference(tmp_path, capsys, npz):
    """Without a server the CLI cannot hold memory; it records the tier as the context's preference,
    which a long-lived Bucket (the server) applies on its next load and at start-up."""
    path, _, _ = npz
    root = str(tmp_path / "b")
    rc, out, _ = run(capsys, "ingest", "--root", root, "m", str(path), "--text", "x")
    cid = json.loads(out)["context_id"]
    server = Bucket(root)
    rc, out, _ = run(capsys, "promote", "--root", root, cid)
    assert rc == 0 and json.loads(out)["preferred_tier"] == "warm"
    assert Bucket(root).lookup(cid)["storage"]["preference"]["tier"] == "warm"
    server.load(cid)
    assert server.tier(cid) == "warm"
    fresh = Bucket(root)
    assert fresh.apply_tier_preferences() == {cid: "warm"}
    rc, out, _ = run(capsys, "ls", "--root", root, "--json")
    assert json.loads(out)[0]["preferred_tier"] == "warm"
    rc, out, _ = run(capsys, "demote", "--root", root, cid)
    assert rc == 0 and json.loads(out)["preferred_tier"] == "cold"
    server.load(cid)
    assert server.tier(cid) == "cold"
    rc, out, _ = run(capsys, "promote", "--root", root, cid, "--tier", "hot", "--device", "cpu")
    assert rc == 0 and json.loads(out) | {"note": ""} == {"context_id": cid, "preferred_tier": "hot", "device": "cpu",
                                                           "note": ""}
    rc, _, err = run(capsys, "promote", "--root", root, "ctx_" + "0" * 32)
    assert rc == 1 and "no context" in err
    with pytest.raises(SystemExit):  # --root and --url are exclusive, one is required
        main(["bucket", "promote", cid])
    capsys.readouterr()
