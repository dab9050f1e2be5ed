"""No ``mcf`` command prints a string it read from a file raw: a context's name, a tensor
name, model metadata, a tree's timestamps, a file name, an error quoting any of them.  Printed raw, an
escape sequence in one retitles the terminal, writes its clipboard (OSC 52) or clears the screen, a
newline forges a second row of a listing, and a bidirectional override reorders what the user reads.
Every command shows them through one helper (``mcf._core.console.printable``, ``json_text`` for JSON)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mcf
from mcf._core.console import json_text, printable
from mcf.bucket.store import Bucket
from mcf.cli import main

#: a window title, a clipboard write, a clear screen, a forged listing row, an 8-bit CSI, a right-to-left
#: override and DEL
HOSTILE = ("doc\x1b]0;owned\x07\x1b]52;c;ZXZpbA==\x07\x1b[2J\nctx_" + "f" * 32 + "  m  999 tok  \x9b31m"
           "\u202etxt.exe\x7f")
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\x7f", "\x00")


def inert(text: str) -> bool:
    return not any(ch in text for ch in RAW)


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_helpers():
    assert printable(HOSTILE).count("\n") == 0 and inert(printable(HOSTILE))
    assert printable("doc\x1b[2J") == "doc\\x1b[2J" and printable("a\u202eb") == "a\\u202eb"
    assert printable("é 中 tab\tend") == "é 中 tab\\x09end"  # other scripts stay; every control is escaped
    assert printable("\ud800") == "\\ud800"  # an undecodable byte of a file name: printable at all
    text = json_text({"name": HOSTILE})
    assert inert(text) and json.loads(text) == {"name": HOSTILE}  # still JSON, and the same string


def test_bucket_ls_show_and_errors(tmp_path, capsys):
    root = tmp_path / "b"
    b = Bucket(root)
    kv = [(np.ones((2, 4, 4), np.float32), np.ones((2, 4, 4), np.float32))]
    evil = b.ingest("m", kv, content="a", name=HOSTILE)["context_id"]
    b.ingest("m", kv, content="b", name="plain")
    rc, out, _ = run(capsys, "bucket", "ls", "--root", str(root))
    assert rc == 0 and inert(out)
    assert len(out.splitlines()) == 2  # one row per context: the newline in the name forges none
    assert "doc\\x1b]0;owned\\x07" in out
    rc, out, _ = run(capsys, "bucket", "ls", "--json", "--root", str(root))
    assert rc == 0 and inert(out) and HOSTILE in [r["name"] for r in json.loads(out)]  # escaped, not changed
    rc, out, _ = run(capsys, "bucket", "show", "--root", str(root), evil)
    assert rc == 0 and inert(out) and json.loads(out)["content"]["name"] == HOSTILE
    # an error quoting a string from a file: metadata.json naming another context
    meta = root / "contexts" / evil / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["context_id"] = HOSTILE
    meta.write_text(json.dumps(doc))
    rc, _, err = run(capsys, "bucket", "show", "--root", str(root), evil)
    assert rc == 1 and inert(err) and len(err.splitlines()) == 1 and "context_id disagrees" in err


def test_mcf_info_and_verify(tmp_path, capsys):
    path = tmp_path / "x.mcf"
    with mcf.Writer(path) as w:
        w.add_model_info(mcf.ModelInfo(model_name=HOSTILE, arch=mcf.Arch.LLAMA, extras={HOSTILE: HOSTILE}))
        w.add_tensor(HOSTILE, np.zeros(4, np.float32))
        w.add_tensor("plain", np.zeros(4, np.float32))
    rc, out, _ = run(capsys, "info", str(path))
    assert rc == 0 and inert(out) and out.count("doc\\x1b]0;owned") == 4  # model name, extra's key and value, tensor
    rc, out, _ = run(capsys, "info", str(path), "--json")
    assert rc == 0 and inert(out) and json.loads(out)["tensors"][0]["name"] == HOSTILE
    bad = tmp_path / "bad\x1b]0;owned\x07.mcf"  # a file name from an archive
    bad.write_bytes(b"not an MCF file at all")
    rc, out, _ = run(capsys, "verify", str(bad))
    assert rc == 1 and inert(out) and out.startswith("FAIL")


def test_convert_gguf_report(tmp_path, capsys):
    gguf = pytest.importorskip("gguf", reason="writing a GGUF file needs gguf-py")
    src = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_name(HOSTILE)
    w.add_tensor("evil\x1b[2J\nname\u202e", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, out, err = run(capsys, "convert", str(src), "-o", str(tmp_path / "x.mcf"), "--report", "--quiet")
    assert rc == 0 and inert(out) and inert(err) and "evil\\x1b[2J\\x0aname" in out
    rc, out, _ = run(capsys, "info", str(tmp_path / "x.mcf"))
    assert rc == 0 and inert(out)


def test_megacontext_info(tmp_path, capsys):
    import mcf.megacontext as mc

    tree = tmp_path / "tree"
    mc.create(tree, embedding_dim=8, model_name="m").close()  # (the .ctx headers refuse unprintable names)
    meta = tree / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["created_at"] = HOSTILE
    meta.write_text(json.dumps(doc))
    for argv in (("ctx", "info", str(tree)), ("ctx", "info", str(tree), "--json")):
        rc, out, _ = run(capsys, *argv)
        assert rc == 0 and inert(out), out
    assert "created doc\\x1b]0;owned" in run(capsys, "ctx", "info", str(tree))[1]


def test_megatron_info_and_verify(tmp_path, capsys):
    from mcf.megatron import Writer

    d = tmp_path / "data\x1b]0;owned\x07\nset"  # a directory name from an archive
    d.mkdir()
    with Writer(str(d / "ds"), dtype=np.uint16) as w:
        w.add_document([1, 2, 3], [3])
    for argv in (("megatron", "info", str(d / "ds")), ("megatron", "verify", str(d / "ds"))):
        rc, out, _ = run(capsys, *argv)
        assert rc == 0 and inert(out) and "data\\x1b]0;owned\\x07\\x0aset/ds" in out.splitlines()[0], out
    rc, out, _ = run(capsys, "megatron", "info", str(d / "ds"), "--json")
    assert rc == 0 and inert(out) and json.loads(out)["prefix"] == str(d / "ds")
    (d / "ds.bin").write_bytes(b"")
    rc, out, err = run(capsys, "megatron", "verify", str(d / "ds"))
    assert rc == 1 and inert(out) and inert(err)
