"""docs/megacontext.md: its storage size table is what our own files measure (its examples run in
test_docs.py, with every other page's)."""

from __future__ import annotations

import os

import numpy as np

import mcf.megacontext as mc
from mcf.megacontext._layout import CTX_DTYPES, file_size

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "megacontext.md")


def doc_text():
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def size_table():
    rows = {}
    for line in doc_text().splitlines():
        cells = [c.strip().replace(",", "") for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].isdigit():
            rows[int(cells[0])] = [int(c) for c in cells[1:7]]
    return rows


def test_size_table_matches_our_files(tmp_path):
    rows = size_table()
    assert sorted(rows) == [10_000, 100_000, 1_000_000, 10_000_000, 100_000_000]
    fp16 = CTX_DTYPES[1]
    for t, (l0, n1, l1, n2, l2, total) in rows.items():
        assert (n1, n2) == (t // 32, t // 32 // 32)
        assert (l0, l1, l2) == (file_size(0, t, 2048, CTX_DTYPES[0]), file_size(1, n1, 2048, fp16),
                                file_size(2, n2, 2048, fp16))
        assert total == l0 + l1 + l2
    # the two small rows, measured on trees built here (the 1M row: test_megacontext_tree.py)
    rng = np.random.default_rng(0)
    rows16 = rng.standard_normal((128, 2048)).astype(np.float16)
    for t in (10_000, 100_000):
        path = tmp_path / str(t)
        with mc.create(path, embedding_dim=2048) as tree:
            tree.append_tokens(np.arange(t) % 50_000)
            while tree.num_gists(1) < t // 32:
                tree.append_gists(1, rows16[:min(128, t // 32 - tree.num_gists(1))], commit=False)
            tree.append_gists(2, rows16[:t // 32 // 32])
        got = [os.path.getsize(path / f"LOD{lv}.ctx") for lv in range(3)]
        assert got == [rows[t][0], rows[t][2], rows[t][4]]
