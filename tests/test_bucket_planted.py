"""Things planted in a bucket directory by someone else: symbolic links in place of the
registry journal, the lock, the models directory, the contexts directory and a context's files; FIFOs and
device files where JSON or KV data should be.  None may make the bucket write, create, truncate or read a
file outside its root, and none may make it block: each is refused with an MCFError naming the entry.

FIFO cases run the operation in a thread joined with a timeout: before the fix the open() of a FIFO
blocked forever (holding the bucket lock), and the test then opens the FIFO's other end itself so the
thread can finish, and fails.
"""

from __future__ import annotations

import os
import stat
import sys
import threading

import numpy as np
import pytest

import mcf
from mcf.bucket import Bucket


def kv(seed: int, n_layers=2, heads=2, seq=8, dim=4):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((heads, seq, dim)).astype(np.float32),
             rng.standard_normal((heads, seq, dim)).astype(np.float32)) for _ in range(n_layers)]


@pytest.fixture
def bucket(tmp_path):
    root = tmp_path / "bucket"
    b = Bucket(root)
    cid = b.ingest("m", kv(1), content="first")["context_id"]
    outside = tmp_path / "outside"
    outside.mkdir()
    return root, cid, outside


def finishes(fn, fifo=None, timeout=10.0):
    """Run ``fn`` in a thread; returns (result or exception).  If it is still running after ``timeout``
    seconds (blocked on ``fifo``), unblock it by opening the FIFO's other end and fail."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["value"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        if fifo is not None:
            for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
                try:
                    os.close(os.open(fifo, flags))  # the blocked open() returns
                except OSError:
                    pass
            t.join(5)
        pytest.fail(f"blocked for more than {timeout} s (on {fifo})")
    return out["value"]


def test_journal_symlink_does_not_truncate_a_file_outside(bucket):
    """Reported attack: registry.journal -> a file outside; the next ingest truncated and overwrote it."""
    root, _, outside = bucket
    victim = outside / "precious.txt"
    victim.write_bytes(b"do not touch\n" * 100)
    (root / "registry.journal").unlink()
    (root / "registry.journal").symlink_to(victim)
    b = Bucket(root)
    new = b.ingest("m", kv(2), content="second")["context_id"]
    assert victim.read_bytes() == b"do not touch\n" * 100
    assert not (root / "registry.journal").is_symlink()  # replaced by a regular journal (the link itself)
    assert {c["context_id"] for c in Bucket(root).discover("m")} >= {new}


def test_lock_symlink_creates_nothing_outside(bucket):
    """Reported attack: .lock -> a path outside; the first writer created the file there."""
    root, _, outside = bucket
    (root / ".lock").unlink()
    (root / ".lock").symlink_to(outside / "created-by-bucket")
    with pytest.raises(mcf.FormatError, match=r"\.lock: is a symbolic link"):
        Bucket(root).ingest("m", kv(3), content="third")
    assert not (outside / "created-by-bucket").exists()


def test_models_symlink_writes_nothing_outside(bucket):
    """Reported attack: models/ -> a directory outside; register_model wrote there."""
    root, _, outside = bucket
    (root / "models").rmdir()
    (root / "models").symlink_to(outside, target_is_directory=True)
    b = Bucket(root)
    with pytest.raises(mcf.FormatError, match="models: is a symbolic link"):
        b.register_model("llama", num_layers=2)
    assert list(outside.iterdir()) == []
    with pytest.raises(mcf.FormatError, match="models: is a symbolic link"):
        b.model("llama")


def test_registry_snapshot_symlink_is_replaced_not_followed(bucket):
    root, cid, outside = bucket
    victim = outside / "registry-copy.json"
    victim.write_text('{"models": []}')
    (root / "registry.json").unlink()
    (root / "registry.json").symlink_to(victim)
    b = Bucket(root)
    assert [c["context_id"] for c in b.discover("m")] == [cid]  # rebuilt from contexts/
    b.rebuild()
    assert victim.read_text() == '{"models": []}'
    assert not (root / "registry.json").is_symlink()


def test_contexts_directory_symlink_is_refused(bucket, tmp_path):
    root, cid, outside = bucket
    os.rename(root / "contexts", tmp_path / "moved")
    (root / "contexts").symlink_to(tmp_path / "moved", target_is_directory=True)
    with pytest.raises(mcf.FormatError, match="contexts: is a symbolic link"):
        Bucket(root)


def test_contexts_swapped_for_a_symlink_after_open(bucket, tmp_path):
    """A component replaced after the bucket was opened is not followed either (no check-then-use)."""
    root, cid, outside = bucket
    b = Bucket(root)
    os.rename(root / "contexts", tmp_path / "moved")
    (root / "contexts").symlink_to(tmp_path / "moved", target_is_directory=True)
    with pytest.raises(mcf.FormatError, match="symbolic link"):
        b.lookup(cid)
    with pytest.raises(mcf.FormatError, match="symbolic link"):
        b.ingest("m", kv(4), content="fourth")
    assert sorted(p.name for p in (tmp_path / "moved").iterdir()) == [cid]  # nothing written through the link


@pytest.mark.parametrize("name", ["metadata.json", "kv_data.mcb"])
def test_fifo_in_a_context_does_not_hang_scans(bucket, name):
    """Reported attack: a FIFO planted as metadata.json or kv_data.mcb hung scans forever while holding
    the bucket lock.  Every reader now refuses it at once."""
    root, cid, _ = bucket
    b = Bucket(root)
    victim = b.ingest("m", kv(5), content="fifo")["context_id"]
    p = root / "contexts" / victim / name
    p.unlink()
    os.mkfifo(p)
    for op in (lambda: b.lookup(victim),
               lambda: b.load(victim),
               lambda: b.rebuild(emit=False),
               lambda: b.discover("m", force_scan=True),
               lambda: Bucket(root).discover("m")):
        got = finishes(op, fifo=p)
        if isinstance(got, BaseException):
            assert isinstance(got, mcf.FormatError) and "FIFO" in str(got), got
        else:  # a listing: the context is skipped with the reason, the other one is still there
            skipped = got["skipped"] if isinstance(got, dict) and "skipped" in got else None
            if skipped is not None:
                assert [s["context_id"] for s in skipped] == [victim] and "FIFO" in skipped[0]["reason"]
            else:
                assert [c["context_id"] for c in got] == [cid]
    # and the lock is free: another writer gets through
    assert finishes(lambda: Bucket(root).ingest("m", kv(6), content="after"))["context_id"]


def test_fifo_as_registry_files_and_lock(bucket):
    root, cid, _ = bucket
    for name in ("registry.json", "registry.journal"):
        p = root / name
        p.unlink()
        os.mkfifo(p)
        b = finishes(lambda: Bucket(root), fifo=p)
        assert not isinstance(b, BaseException), b
        assert [c["context_id"] for c in finishes(lambda b=b: b.discover("m"), fifo=p)] == [cid]
        assert stat.S_ISREG(os.lstat(p).st_mode)  # replaced by the rebuilt registry
    (root / ".lock").unlink()
    os.mkfifo(root / ".lock")
    got = finishes(lambda: Bucket(root), fifo=root / ".lock")
    assert isinstance(got, mcf.FormatError) and ".lock: is a FIFO" in str(got)


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
def test_device_files_are_refused(bucket):
    root, cid, _ = bucket
    b = Bucket(root)
    for name in ("metadata.json", "kv_data.mcb"):
        victim = b.ingest("m", kv(7 + len(name)), content=name)["context_id"]
        p = root / "contexts" / victim / name
        p.unlink()
        os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
        with pytest.raises(mcf.FormatError, match="character device"):
            b.lookup(victim)
        with pytest.raises(mcf.FormatError, match="character device"):
            b.load(victim)
        assert victim in [s["context_id"] for s in b.rebuild(emit=False)["skipped"]]


def test_symlinked_context_files_are_refused_and_removed_as_links(bucket, tmp_path):
    root, cid, outside = bucket
    b = Bucket(root)
    target = outside / "kv.bin"
    os.rename(root / "contexts" / cid / "kv_data.mcb", target)
    (root / "contexts" / cid / "kv_data.mcb").symlink_to(target)
    with pytest.raises(mcf.FormatError, match="kv_data.mcb: is a symbolic link"):
        b.load(cid)
    b.delete(cid)
    assert target.is_file()  # the link went, never its target


def test_planted_verified_record_and_temp_names_are_not_followed(bucket):
    """.verified.json (the "once" cache) as a link or FIFO is ignored; a load still checks the data."""
    root, cid, outside = bucket
    d = root / "contexts" / cid
    os.mkfifo(d / ".verified.json")
    b = Bucket(root, verify="once")
    assert len(finishes(lambda: b.load(cid), fifo=d / ".verified.json")) == 2


def test_remove_tree_never_follows_links_at_any_depth(tmp_path):
    """The fd-based removal (ours, since ``shutil.rmtree(dir_fd=)`` needs Python 3.11) unlinks a link
    planted deep in the tree instead of following it, and walks a tree deeper than the recursion limit."""
    from mcf.bucket._fs import _remove_tree_at

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    victim = tmp_path / "victim"
    # build it relative to each new directory (an absolute path that deep exceeds PATH_MAX)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        os.mkdir("victim", dir_fd=fd)
        cur = os.open("victim", os.O_RDONLY, dir_fd=fd)
        os.symlink(str(outside), "link-to-outside", dir_fd=cur)
        for _ in range(sys.getrecursionlimit() + 50):
            os.mkdir("d", dir_fd=cur)
            nxt = os.open("d", os.O_RDONLY, dir_fd=cur)
            os.close(cur)
            cur = nxt
        os.symlink(str(outside), "deep-link", dir_fd=cur)
        with open(os.open("file", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=cur), "w") as f:
            f.write("x")
        os.close(cur)
        _remove_tree_at(fd, "victim")
    finally:
        os.close(fd)
    assert not victim.exists()
    assert (outside / "keep.txt").read_text() == "mine" and sorted(os.listdir(outside)) == ["keep.txt"]
