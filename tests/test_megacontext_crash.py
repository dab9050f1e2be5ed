"""Crash safety and concurrent readers, with real processes: a writer killed with SIGKILL at random
points leaves a tree that opens with its last committed counts and data; readers in another process
always see a consistent committed prefix while the writer appends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

import mcf.megacontext as mc
from _megacontext_ref import gist_rows, token_stream_at

HERE = os.path.dirname(os.path.abspath(__file__))
WRITER = os.path.join(HERE, "_megacontext_writer.py")
STREAM_SEED = 5
D = 8
KILLS = 24


def start_writer(path, seed, commits=10**9):
    p = subprocess.Popen([sys.executable, WRITER, str(path), str(seed), str(commits)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("ready"), (line, p.stderr.read() if p.poll() is not None else "")
    return p, line


def check_consistent(t, live=False) -> tuple:
    """Everything a reader may rely on: counts that fit each other, the exact token stream prefix,
    and every gist equal to what the checkpoint recorded for it produced.  ``live``: the writer is
    running, so a gist may be in the middle of an in-place rewrite (documented: each value is then
    the old or the new one)."""
    tcount, n1, n2 = t.counts
    k = t.block_size
    assert n1 <= tcount // k and n2 <= n1 // k
    assert np.array_equal(t.tokens(), token_stream_at(0, tcount, STREAM_SEED))
    for level, n in ((1, n1), (2, n2)):
        g = t.gists(level)
        assert g.shape == (n, D)
        for start, stop, ckpt, pending in t.checkpoint_ranges(level):
            stop = min(stop, n)
            if pending or start >= stop:
                continue             # an interrupted rewrite: rows may be old, new or torn (reported)
            version = 2 if ckpt == "v2" else 1   # None: appended by a writer killed before recording it
            got = g[start:stop]
            if live:
                assert ((got == gist_rows(level, start, stop, D, 1))
                        | (got == gist_rows(level, start, stop, D, 2))).all()
            else:
                assert np.array_equal(got, gist_rows(level, start, stop, D, version)), (level, start, stop, ckpt)
        covered = sum(min(b, n) - a for a, b, _, _ in t.checkpoint_ranges(level) if a < n)
        if covered < n:              # the rest are appends whose checkpoint was not recorded yet
            got = g[covered:]
            assert np.array_equal(got, gist_rows(level, covered, n, D, 1)) or (live and (
                (got == gist_rows(level, covered, n, D, 1)) | (got == gist_rows(level, covered, n, D, 2))).all())
    return tcount, n1, n2


def test_writer_killed_at_random_points(tmp_path):
    path = tmp_path / "tree"
    with mc.create(path, embedding_dim=D, model_name="crash-test"):
        pass
    rng = np.random.default_rng(20261122)
    last = (0, 0, 0)
    seen_notes = []
    for run in range(KILLS):
        p, ready = start_writer(path, run)
        seen_notes.append(ready)
        time.sleep(float(rng.uniform(0.0, 0.25)))
        p.send_signal(signal.SIGKILL)
        p.communicate()
        assert p.returncode == -signal.SIGKILL
        with mc.open(path) as t:     # a reader: must open, whatever the writer was doing
            counts = check_consistent(t)
            assert all(a >= b for a, b in zip(counts, last))        # committed data is never lost
            last = counts
            # what the reader saw on disk agrees with what verify reports: only warnings, no errors
        assert all(p.severity != "error" for p in mc.verify(path))
    # the next writer repairs whatever the last kill left, and then all is clean
    with mc.open(path, "r+") as t:
        assert t.counts == last
        check_consistent(t)
    assert [p for p in mc.verify(path, deep=True) if "rewrite" not in str(p)] == []
    assert last[0] > 0


def test_readers_see_a_consistent_prefix_while_one_writer_appends(tmp_path):
    path = tmp_path / "tree"
    with mc.create(path, embedding_dim=D, model_name="concurrency"):
        pass
    p, _ = start_writer(path, 99, commits=1500)
    states = set()
    try:
        with mc.open(path) as long_lived:
            while p.poll() is None:
                states.add(long_lived.refresh())
                check_consistent(long_lived, live=True)
                plan = long_lived.plan_tail(300, 64)
                wc = long_lived.assemble(plan)
                assert np.array_equal(wc.token_ids,
                                      long_lived.tokens(long_lived.num_tokens - int((wc.levels == 0).sum())))
                with mc.open(path) as fresh:                  # a reader opening mid-append
                    states.add(check_consistent(fresh, live=True))
    finally:
        if p.poll() is None:
            p.kill()
        out, err = p.communicate()
    assert p.returncode == 0, err
    assert "done" in out
    assert len(states) >= 2
    with mc.open(path) as t:
        check_consistent(t)
    assert [p for p in mc.verify(path) if "rewrite" not in str(p)] == []
