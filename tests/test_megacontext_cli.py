"""``mcf ctx info|verify|ingest|snapshot|restore`` and the MegaContext demo on the real
all-MiniLM-L6-v2 checkpoint (its tokenizer, its word-embedding matrix, its README as the text)."""

from __future__ import annotations

import json
import os
import struct
import subprocess

import numpy as np
import pytest

import mcf.megacontext as mc
from _megacontext_ref import mean_pool, numpy_assembly
from mcf.cli import main
from _entry_point import mcf_command


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    tokenizers = pytest.importorskip("tokenizers")
    from mcf.safetensors.reader import open_checkpoint

    tok = tokenizers.Tokenizer.from_file(os.path.join(minilm_dir, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    with open_checkpoint(minilm_dir) as ck:
        table = np.array(ck.tensors["embeddings.word_embeddings.weight"].array())
    return tok, table


def test_demo_on_the_real_checkpoint(minilm_dir, minilm, tmp_path, capsys):
    from mcf.apps.demo.megacontext import demo_megacontext

    assert demo_megacontext(minilm_dir, str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "equals a plain numpy assembly: yes" in out and "verify (tree and snapshot): OK" in out
    assert out.count("token rows identical, gist rows within") == 2 and "q8    : gist files" in out
    with mc.open(tmp_path / "megacontext-tree-hybrid") as h:
        assert h.gist_policy == {"LOD1": "fp16", "LOD2": "q8"}
    tok, table = minilm
    with open(os.path.join(minilm_dir, "README.md"), encoding="utf-8") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()]
    ids = np.concatenate([tok.encode(p, add_special_tokens=False).ids for p in paragraphs]).astype(np.uint32)
    with mc.open(tmp_path / "megacontext-tree") as t:
        assert t.model_name == "sentence-transformers/all-MiniLM-L6-v2" and t.embedding_dim == 384
        assert t.vocab_size == 30522 and t.ingestion_complete
        assert np.array_equal(t.tokens(), ids)
        n1 = len(ids) // 32
        lod1 = mean_pool(table[ids[:n1 * 32]], 32, np.float16)
        assert np.array_equal(t.gists(1).view(np.uint16), lod1.view(np.uint16))
        lod2 = mean_pool(lod1[:n1 // 32 * 32], 32, np.float16)
        assert np.array_equal(t.gists(2).view(np.uint16), lod2.view(np.uint16))
        plan = t.plan_tail(128, 64)
        assert set(plan.levels.tolist()) == {0, 1, 2}                      # all three levels in play
        wc = t.assemble(plan, table)
        ref = numpy_assembly(ids, lod1, lod2, plan, 32, table)
        assert np.array_equal(wc.embeddings, ref[4]) and np.array_equal(wc.positions, ref[1])
    assert f"{len(ids)} tokens" in out


def test_ingest_info_verify_snapshot_restore(minilm_dir, minilm, tmp_path, capsys):
    text = tmp_path / "in.txt"
    with open(os.path.join(minilm_dir, "README.md"), encoding="utf-8") as f:
        text.write_text(f.read())
    tree = tmp_path / "tree"
    assert main(["ctx", "ingest", str(tree), str(text), "--model-dir", minilm_dir, "--chunk-bytes", "3000",
                 "--complete", "-q"]) == 0
    out = capsys.readouterr().out
    assert "ingested" in out
    with mc.open(tree) as t:
        n = t.num_tokens
        assert n > 3000 and t.counts[1] == n // 32 and t.ingestion_complete
        assert t.checkpoint_ranges(1)[0][2] == "mean-pooling:embeddings.word_embeddings.weight"
    # info
    assert main(["ctx", "info", str(tree)]) == 0
    out = capsys.readouterr().out
    assert "LOD1.ctx" in out and "canonical" in out and f"{n} tokens" in out
    assert main(["ctx", "info", str(tree), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["num_tokens"] == n and d["files"]["LOD0"]["file_size_bytes"] == 64 + 4 * n
    # ids input appends to the same tree
    ids = tmp_path / "ids.u32"
    ids.write_bytes(np.arange(100, 164, dtype="<u4").tobytes())
    assert main(["ctx", "ingest", str(tree), str(ids), "--ids", "--model-dir", minilm_dir, "-q"]) == 0
    capsys.readouterr()
    with mc.open(tree) as t:
        assert t.num_tokens == n + 64 and np.array_equal(t.tokens(n), np.arange(100, 164))
        assert t.counts[1] == (n + 64) // 32
    # snapshot, damage, verify fails, restore, verify passes
    assert main(["ctx", "snapshot", str(tree), "--dest", str(tmp_path / "snap")]) == 0
    assert "snapshot" in capsys.readouterr().out
    assert main(["ctx", "verify", str(tree), "--deep"]) == 0
    assert capsys.readouterr().out.startswith("OK")
    b = bytearray((tree / "LOD1.ctx").read_bytes())
    struct.pack_into("<H", b, 10, 0)
    (tree / "LOD1.ctx").write_bytes(bytes(b))
    assert main(["ctx", "verify", str(tree)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "embedding_dim" in out and "LOD1.ctx" in out
    assert main(["ctx", "info", str(tree)]) == 1
    assert "embedding_dim" in capsys.readouterr().err
    assert main(["ctx", "restore", str(tmp_path / "snap"), str(tree)]) == 0
    capsys.readouterr()
    assert main(["ctx", "verify", str(tree)]) == 0


def test_ingest_errors_are_reported(tmp_path, capsys):
    txt = tmp_path / "a.txt"
    txt.write_text("hello")
    assert main(["ctx", "ingest", str(tmp_path / "t"), str(txt)]) == 1
    assert "--model-dir" in capsys.readouterr().err
    ids = tmp_path / "ids"
    ids.write_bytes(b"\1\0\0\0\2\0")
    assert main(["ctx", "ingest", str(tmp_path / "t"), str(ids), "--ids", "--embedding-dim", "8", "-q"]) == 1
    assert "whole number" in capsys.readouterr().err
    assert main(["ctx", "verify", str(tmp_path / "missing")]) == 1  # no tree: an error, not a finding
    assert f"mcf ctx verify: error: {tmp_path / 'missing'}: no such tree directory" in capsys.readouterr().err


def test_entry_point_subprocess(tmp_path):
    with mc.create(tmp_path / "t", embedding_dim=4) as t:
        t.append_tokens(np.arange(70))
    cmd = mcf_command()
    r = subprocess.run(cmd + ["ctx", "verify", str(tmp_path / "t")], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr


def test_ingest_reads_an_endless_line_in_bounded_pieces():
    """``mcf ctx ingest`` of text read whole lines (``for line in f``): a file without newlines was held whole.
    Now no read asks for more than a chunk, a long line is cut after its last whitespace inside a chunk, and the
    text comes back exactly."""
    import io

    from mcf.apps.megacontext_cli import _text_chunks

    class Recorder(io.StringIO):
        asked = []

        def readline(self, size=-1):
            self.asked.append(size)
            return super().readline(size)

    text = ("lorem ipsum " * 5000) + "\nshort line\n" + "x" * 3000
    f = Recorder(text)
    out = list(_text_chunks(f, 1024))
    assert "".join(t for t, _ in out) == text
    assert all(0 < n <= 1024 for n in Recorder.asked)          # never an unbounded readline
    assert all(len(t) <= 2 * 1024 for t, _ in out)
    words = [t for t, _ in out if "lorem" in t and "xx" not in t]
    assert all(t.endswith((" ", "\n")) for t in words)          # words kept whole where the text allows
