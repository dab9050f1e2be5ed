"""The registry files are a cache, and a damaged or planted one heals or is refused with a clear message,
as metadata.json is: an oversized registry.json or journal is not read into memory,
a directory planted under either name is moved aside, a snapshot that lost a context's summary but kept
its stamp does not hide it from a scan, and one malformed expiry does not make every list fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mcf
from mcf.bucket import _registry
from mcf.bucket.store import Bucket

MiB = 1 << 20


def kv(seed: int):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((2, 8, 4)).astype(np.float32), rng.standard_normal((2, 8, 4)).astype(np.float32))]


@pytest.fixture
def bucket(tmp_path):
    root = tmp_path / "b"
    b = Bucket(root)
    cids = [b.ingest("m", kv(i), content=f"c{i}", ttl=3600)["context_id"] for i in range(3)]
    b.close()
    return root, sorted(cids)


def listed(root, **kw) -> list[str]:
    with Bucket(root) as b:
        return sorted(c["context_id"] for c in b.discover("m", **kw))


# ------------------------------------------------------------------------------------------------
# size caps
# ------------------------------------------------------------------------------------------------
def peak_rss_of_open(root) -> int:
    """Peak RSS (bytes) of a fresh process that opens the bucket and lists its model."""
    code = textwrap.dedent(f"""
        from mcf.bucket.store import Bucket
        b = Bucket({str(root)!r})
        print(len(b.discover("m")))
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                print(int(line.split()[1]) * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    n, peak = out.stdout.split()
    assert int(n) == 3, out.stdout
    return int(peak)


@pytest.mark.parametrize("name", ["registry.json", "registry.journal"])
def test_an_oversized_registry_file_is_not_read(bucket, name):
    """A planted 512 MiB sparse file cost 1 GiB of memory to open the bucket (read whole, then decoded);
    now its size alone refuses it, and the registry is rebuilt from contexts/."""
    root, cids = bucket
    baseline = peak_rss_of_open(root)
    with open(root / name, "r+b") as f:
        f.truncate(512 * MiB)
    grew = peak_rss_of_open(root) - baseline
    print(f"{name} of 512 MiB: peak RSS grew by {grew / MiB:.1f} MiB")  # the report's figure (-s)
    assert grew < 32 * MiB
    assert (root / name).stat().st_size < MiB  # replaced by the rebuilt registry
    assert listed(root) == cids


def test_the_size_cap_grows_with_the_contexts(bucket):
    root, cids = bucket
    with Bucket(root) as b:
        cap = b._reg.size_limit()
        assert cap == _registry.REGISTRY_BASE_BYTES + 3 * _registry.REGISTRY_BYTES_PER_CONTEXT
        # a registry just under the cap is read (whitespace is valid JSON around the document), one byte
        # more is refused and rebuilt
        doc = (root / "registry.json").read_bytes()
        (root / "registry.json").write_bytes(doc + b" " * (cap - len(doc)))
    assert listed(root) == cids and (root / "registry.json").stat().st_size == cap
    (root / "registry.json").write_bytes(doc + b" " * (cap - len(doc) + 1))
    assert listed(root) == cids and (root / "registry.json").stat().st_size < cap


# ------------------------------------------------------------------------------------------------
# a directory planted under a registry file's name
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["registry.json", "registry.journal"])
def test_a_directory_named_like_a_registry_file_is_moved_aside(bucket, name):
    root, cids = bucket
    (root / name).unlink()
    (root / name).mkdir()
    (root / name / "keep.txt").write_text("someone's file")
    assert listed(root) == cids
    assert (root / name).is_file()
    aside = [p for p in root.iterdir() if p.name.startswith(f".{name}.") and p.name.endswith(".displaced")]
    assert len(aside) == 1 and (aside[0] / "keep.txt").read_text() == "someone's file"  # moved, not removed
    with Bucket(root) as b:  # and writes go on
        b.ingest("m", kv(9), content="after")
    assert len(listed(root)) == 4


def test_the_server_starts_on_a_bucket_with_a_directory_named_registry_json(bucket):
    pytest.importorskip("starlette", reason="the server needs the 'server' extra (starlette)")
    pytest.importorskip("uvicorn", reason="the server needs the 'server' extra (uvicorn)")
    from _bucket_server import request, serve

    root, cids = bucket
    (root / "registry.json").unlink()
    (root / "registry.json").mkdir()
    with serve(root, None) as (base, _):
        st, out, _ = request(base, "GET", "/mcrp/v1/contexts?model_id=m")
        assert st == 200 and sorted(c["context_id"] for c in out["contexts"]) == cids, out


def test_a_directory_named_lock_is_refused_with_a_clear_message(bucket):
    root, _ = bucket
    (root / ".lock").unlink()
    (root / ".lock").mkdir()
    with pytest.raises(mcf.FormatError, match=r"\.lock: is a directory"):
        Bucket(root)


# ------------------------------------------------------------------------------------------------
# a snapshot that lost a summary, and malformed summaries
# ------------------------------------------------------------------------------------------------
def edit_snapshot(root, fn) -> None:
    doc = json.loads((root / "registry.json").read_text())
    fn(doc)
    (root / "registry.json").write_text(json.dumps(doc))


def test_a_forced_scan_finds_a_context_the_snapshot_lost(bucket):
    """The snapshot lost a context's summary but kept its stamp (an edit, a restore from another copy):
    the stamp said "unchanged", so even a forced scan skipped it and the context stayed hidden."""
    root, cids = bucket
    with Bucket(root) as b:
        b.rebuild(emit=False)  # everything in the snapshot, nothing in the journal
    edit_snapshot(root, lambda d: d["models"][0]["contexts"].pop(0))
    with Bucket(root, reconcile=False) as b:
        assert len(b.discover("m")) == 2  # the cache says what the snapshot says...
        assert sorted(c["context_id"] for c in b.discover("m", force_scan=True)) == cids  # ...a scan what is on disk
    assert listed(root) == cids  # and opening the bucket (its reconciling scan) heals it as well


@pytest.mark.parametrize("where", ["snapshot", "journal"])
@pytest.mark.parametrize("field, bad", [("expires_at", "garbage"), ("expires_at", 17), ("pinned", "yes"),
                                        ("last_accessed", None)])
def test_one_malformed_summary_does_not_fail_every_list(bucket, where, field, bad):
    """One garbage expires_at made every list of the model a FormatError (HTTP 422).  A malformed summary
    is damage to the cache: the registry is rebuilt from the contexts' own metadata."""
    root, cids = bucket
    with Bucket(root) as b:
        b.rebuild(emit=False)
    if where == "snapshot":
        edit_snapshot(root, lambda d: d["models"][0]["contexts"][1].__setitem__(field, bad))
    else:
        with Bucket(root) as b:
            summ = next(c for c in b.discover("m") if c["context_id"] == cids[1])
        summ = {k: v for k, v in summ.items() if k not in ("tier", "is_loaded", "stale")}
        summ[field] = bad
        with open(root / "registry.journal", "ab") as f:
            f.write(_registry.journal_line({"op": "put", "model_id": "m", "model_hash": None, "summary": summ,
                                            "stamp": None, "at": "2026-01-01T00:00:00.000000Z"}))
    with Bucket(root, reconcile=False) as b:
        got = b.discover("m")
    assert sorted(c["context_id"] for c in got) == cids
    assert all(isinstance(c["expires_at"], str) and isinstance(c["pinned"], bool)
               and isinstance(c["last_accessed"], str) for c in got)


def test_rest_lists_survive_a_garbage_expiry(bucket):
    pytest.importorskip("starlette", reason="the server needs the 'server' extra (starlette)")
    pytest.importorskip("uvicorn", reason="the server needs the 'server' extra (uvicorn)")
    from _bucket_server import request, serve

    root, cids = bucket
    with Bucket(root) as b:
        b.rebuild(emit=False)
    with serve(root, None) as (base, _):
        edit_snapshot(root, lambda d: d["models"][0]["contexts"][1].__setitem__("expires_at", "garbage"))
        os.utime(root / "registry.json", ns=(1, 1))  # a stamp the server has not seen: it reads the file again
        for path in ("/mcrp/v1/contexts?model_id=m", "/mcrp/v1/models/m/contexts", "/mcrp/v1/contexts"):
            st, out, _ = request(base, "GET", path)
            assert st == 200 and sorted(c["context_id"] for c in out["contexts"]) == cids, (path, st, out)
