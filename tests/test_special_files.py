"""Paths that are not regular files (a FIFO, /dev/zero, a socket) and resource files past their caps.

Opening a FIFO waits for a writer, forever, and /dev/zero never ends: every reader of mcf refuses anything
but a regular file before it can block (mcf._core.fs.open_regular), and every resource read whole
(config.json, tokenizer.json, shard indexes, imatrix files, calibration texts) has a size cap
(mcf._core.fs.read_regular).  Each call runs in a thread that is unblocked (a writer opens the FIFO) and
failed when it is still inside ``open()`` after a generous wait, so a missing check fails instead of
hanging the suite.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import stat
import threading

import numpy as np
import pytest

import mcf
import mcf.gguf
import mcf.safetensors
from _vectors import MANTLE_MODEL
from mcf._core import fs
from mcf.cli import main as cli_main

_WAIT_S = 60  # far beyond a refusal (microseconds); only a call blocked in open() reaches it


def _unblock(fifos) -> None:
    """Open each FIFO for writing (and close it), which lets a reader blocked in its open() go on."""
    for f in fifos:
        try:
            fd = os.open(f, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader waiting on this one (yet)
            continue
        os.close(fd)


def outcome(fn, *fifos):
    """The exception ``fn()`` raises (None when it returns); fails the test when it blocks."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(_WAIT_S)
    if t.is_alive():
        for _ in range(100):
            _unblock(fifos)
            t.join(0.1)
            if not t.is_alive():
                break
        pytest.fail(f"{fn} blocked (a FIFO opened for reading waits for a writer)")
    return box.get("error")


def refused(fn, path, kind, *fifos):
    err = outcome(fn, *fifos)
    assert isinstance(err, mcf.MCFIOError), repr(err)
    assert str(path) in str(err) and f"is {kind}, not a regular file" in str(err), str(err)
    return err


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "model.safetensors"
    os.mkfifo(p)
    return p


@pytest.mark.parametrize("reader", ["mcf.open", "safetensors.load_file", "gguf.open", "safetensors.open_checkpoint",
                                    "io.open_source", "sniff"])
def test_readers_refuse_a_fifo(fifo, reader):
    from mcf.io import open_source
    from mcf.conversion.sniff import sniff

    fn = {"mcf.open": mcf.open, "safetensors.load_file": mcf.safetensors.load_file, "gguf.open": mcf.gguf.open,
          "safetensors.open_checkpoint": mcf.safetensors.open_checkpoint, "io.open_source": open_source,
          "sniff": sniff}[reader]
    refused(lambda: fn(str(fifo)), fifo, "a FIFO", fifo)


def test_load_file_of_a_directory_whose_model_safetensors_is_a_fifo(fifo):
    refused(lambda: mcf.safetensors.load_file(str(fifo.parent)), fifo, "a FIFO", fifo)


def test_a_device_and_a_socket_are_refused(tmp_path, monkeypatch):
    refused(lambda: mcf.open("/dev/zero"), "/dev/zero", "a character device")
    refused(lambda: mcf.gguf.open("/dev/null"), "/dev/null", "a character device")
    monkeypatch.chdir(tmp_path)  # a relative socket name: macOS's temporary directories pass AF_UNIX's 104 bytes
    with socket.socket(socket.AF_UNIX) as s:
        s.bind("s.mcf")
        refused(lambda: mcf.open("s.mcf"), "s.mcf", "a socket")


@pytest.mark.parametrize("target", ["file", "dir"])
def test_mcf_info_refuses_a_fifo(fifo, target, capsys):
    arg = fifo if target == "file" else fifo.parent
    box = {}
    assert outcome(lambda: box.setdefault("rc", cli_main(["info", str(arg)])), fifo) is None
    assert box["rc"] != 0
    assert f"{fifo}: is a FIFO, not a regular file" in capsys.readouterr().err


def test_a_fifo_swapped_in_after_the_stat_is_caught_on_the_descriptor(fifo, tmp_path, monkeypatch):
    """The path is looked at with stat, then opened: a FIFO put there in between must neither block the
    open (O_NONBLOCK) nor pass (fstat of what was opened)."""
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    real_stat = os.stat
    monkeypatch.setattr(fs.os, "stat", lambda p, *a, **k: real_stat(regular) if str(p) == str(fifo)
                        else real_stat(p, *a, **k))
    refused(lambda: mcf.open(str(fifo)), fifo, "a FIFO", fifo)
    refused(lambda: fs.read_regular(fifo, limit=10), fifo, "a FIFO", fifo)


def test_open_regular_clears_nonblock_and_reads(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abc")
    fd = fs.open_regular(p)
    try:
        import fcntl

        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
        assert os.read(fd, 10) == b"abc"
    finally:
        os.close(fd)
    with pytest.raises(mcf.MissingFileError):
        fs.open_regular(tmp_path / "missing")
    with pytest.raises(mcf.MCFIOError, match="is a directory, not a regular file"):
        fs.open_regular(tmp_path)


# -- resources read whole: regular files, within their caps ------------------------------------------------

def test_read_regular_caps_what_it_reads(tmp_path, monkeypatch):
    p = tmp_path / "config.json"
    p.write_bytes(b"x" * 1000)
    assert fs.read_regular(p, limit=1000) == b"x" * 1000
    with pytest.raises(mcf.FormatError) as ei:
        fs.read_regular(p, limit=999, what="config.json")
    assert str(p) in str(ei.value) and "at most 999 bytes" in str(ei.value) and "got 1000 bytes" in str(ei.value)
    assert fs.read_regular(tmp_path / "none", limit=10, missing_ok=True) is None
    # a file that grows after its size was taken: never more than the limit plus one read is held
    requested = []
    real_read = os.read

    def growing_read(fd, n):
        requested.append(n)
        return b"y" * n  # as if the file never ended

    monkeypatch.setattr(fs.os, "read", growing_read)
    with pytest.raises(mcf.FormatError, match="grew while read"):
        fs.read_regular(p, limit=1 << 20)
    monkeypatch.setattr(fs.os, "read", real_read)
    assert sum(requested) <= (1 << 20) + (1 << 16)


def _model_copy(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(MANTLE_MODEL, d)
    return d


def test_pack_refuses_a_config_json_that_is_dev_zero(tmp_path, capsys):
    """config.json -> /dev/zero ended in "internal error: MemoryError"."""
    d = _model_copy(tmp_path)
    (d / "config.json").unlink()
    os.symlink("/dev/zero", d / "config.json")
    refused(lambda: mcf.pack(str(d), str(tmp_path / "o.mcf")), d / "config.json", "a character device")
    box = {}
    assert outcome(lambda: box.setdefault("rc", cli_main(["pack", str(d), "-o", str(tmp_path / "o.mcf"),
                                                          "-q"]))) is None
    err = capsys.readouterr().err
    assert box["rc"] != 0 and "internal error" not in err
    assert f"{d / 'config.json'}: is a character device, not a regular file" in err
    assert not (tmp_path / "o.mcf").exists()


@pytest.mark.parametrize("command", ["pack", "convert"])
def test_pack_and_convert_refuse_a_fifo_tokenizer_json(tmp_path, command):
    d = _model_copy(tmp_path)
    (d / "tokenizer.json").unlink()
    os.mkfifo(d / "tokenizer.json")
    fn = mcf.pack if command == "pack" else mcf.convert
    refused(lambda: fn(str(d), str(tmp_path / "o.mcf")), d / "tokenizer.json", "a FIFO", d / "tokenizer.json")


def test_pack_caps_each_resource(tmp_path, monkeypatch):
    pack_module = importlib.import_module("mcf.conversion.pack")  # mcf.pack is also the function

    assert pack_module.RESOURCE_MAX_BYTES["tokenizer.json"] == fs.MAX_TOKENIZER_BYTES == 256 << 20
    assert pack_module.RESOURCE_MAX_BYTES["config.json"] == fs.MAX_JSON_BYTES == 64 << 20
    d = _model_copy(tmp_path)
    size = (d / "tokenizer.json").stat().st_size
    monkeypatch.setitem(pack_module.RESOURCE_MAX_BYTES, "tokenizer.json", size - 1)
    with pytest.raises(mcf.FormatError) as ei:
        mcf.pack(str(d), str(tmp_path / "o.mcf"))
    assert str(d / "tokenizer.json") in str(ei.value) and f"at most {size - 1} bytes" in str(ei.value)
    monkeypatch.setitem(pack_module.RESOURCE_MAX_BYTES, "tokenizer.json", size)
    mcf.pack(str(d), str(tmp_path / "o.mcf"))


def _tokenizer_file(path):
    """A small word-level tokenizer.json at ``path``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    t = Tokenizer(WordLevel({"[UNK]": 0, "a": 1, "b": 2, "</s>": 3}, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    t.save(str(path))
    return str(path)


def test_load_tokenizer_refuses_a_fifo_and_a_file_past_the_cap(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers", reason="tokenizers is in the test extra")
    import mcf.conversion.tokenizer as tokenizer_module

    p = tmp_path / "tokenizer.json"
    os.mkfifo(p)
    refused(lambda: tokenizer_module.load_tokenizer(str(p)), p, "a FIFO", p)
    refused(lambda: tokenizer_module.load_tokenizer(str(tmp_path)), p, "a FIFO", p)
    p.unlink()
    _tokenizer_file(p)
    assert tokenizer_module.load_tokenizer(str(p)).encode("a b").ids == [1, 2]
    monkeypatch.setattr(tokenizer_module, "MAX_TOKENIZER_BYTES", p.stat().st_size - 1)
    with pytest.raises(mcf.FormatError, match="tokenizer file too large"):
        tokenizer_module.load_tokenizer(str(p))


def test_imatrix_readers_refuse_special_files_and_oversized_ones(tmp_path, monkeypatch, capsys):
    import mcf.conversion.imatrix as imatrix
    from mcf.conversion.second_moment import is_second_moment_file

    p = tmp_path / "imatrix.dat"
    os.mkfifo(p)
    refused(lambda: imatrix.read_imatrix(str(p)), p, "a FIFO", p)
    assert outcome(lambda: is_second_moment_file(str(p)), p) is None
    refused(lambda: imatrix.read_imatrix("/dev/zero"), "/dev/zero", "a character device")
    # a legacy file is read whole: within its cap
    p.unlink()
    p.write_bytes(np.int32(0).tobytes())  # no entries
    monkeypatch.setattr(imatrix, "MAX_LEGACY_BYTES", 3)
    with pytest.raises(mcf.FormatError, match="legacy importance matrix too large"):
        imatrix.read_imatrix(str(p))
    # config.json of a checkpoint directory
    d = tmp_path / "model"
    d.mkdir()
    os.symlink("/dev/zero", d / "config.json")
    refused(lambda: imatrix._model_config(str(d)), d / "config.json", "a character device")
    # calibration texts of mcf imatrix
    box = {}
    fifo_text = tmp_path / "calibration.txt"
    os.mkfifo(fifo_text)
    assert outcome(lambda: box.setdefault("rc", cli_main(["imatrix", MANTLE_MODEL, "--text", str(fifo_text), "-o",
                                                          str(tmp_path / "o.gguf")])), fifo_text) is None
    assert box["rc"] != 0 and f"{fifo_text}: is a FIFO, not a regular file" in capsys.readouterr().err


def test_safetensors_index_that_is_a_fifo(tmp_path):
    d = _model_copy(tmp_path)
    (d / "model.safetensors").unlink()
    idx = d / "model.safetensors.index.json"
    os.mkfifo(idx)
    refused(lambda: mcf.safetensors.open_checkpoint(str(d)), idx, "a FIFO", idx)


def test_megatron_tokenize_refuses_a_fifo_input(tmp_path):
    pytest.importorskip("tokenizers", reason="tokenizers is in the test extra")
    from mcf.conversion.tokenize import iter_documents, tokenize

    p = tmp_path / "docs.jsonl"
    os.mkfifo(p)
    refused(lambda: list(iter_documents(str(p))), p, "a FIFO", p)
    tok = _tokenizer_file(tmp_path / "tokenizer.json")
    refused(lambda: tokenize([str(p)], str(tmp_path / "out"), tok), p, "a FIFO", p)
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()


def test_kind_names():
    assert fs.file_kind(stat.S_IFIFO) == "a FIFO"
    assert fs.file_kind(stat.S_IFCHR) == "a character device"
    assert fs.file_kind(stat.S_IFREG) == "a regular file"
    err = fs.not_regular("p", stat.S_IFBLK)
    assert isinstance(err, mcf.MCFIOError) and str(err).endswith("is a block device, not a regular file: 'p'")


def test_megatron_writer_publishes_over_a_fifo(tmp_path):
    """The writer holds the old .bin/.idx open across its renames: a FIFO there must not block it."""
    import mcf.megatron as mm

    prefix = str(tmp_path / "ds")
    os.mkfifo(prefix + ".bin")

    def write():
        with mm.Writer(prefix, dtype=np.uint16, durable=False) as w:
            w.add_document(np.arange(5), [2, 3])

    assert outcome(write, prefix + ".bin") is None
    with mm.open(prefix) as ds:
        assert [x.tolist() for x in ds] == [[0, 1], [2, 3, 4]]


def test_creating_a_megacontext_tree_over_a_planted_fifo_is_refused(tmp_path):
    """``create`` opened each level file with a plain ``open(path, "wb")``: a FIFO planted under the name
    waited for a reader forever.  It is refused, naming the file."""
    import mcf.megacontext as mc
    from mcf.megacontext._files import level_path

    tree = tmp_path / "tree"
    tree.mkdir()
    p = level_path(str(tree), 1)
    os.mkfifo(p)

    def unblock_writer():
        try:
            os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK))
        except OSError:
            pass

    err = outcome(lambda: mc.create(str(tree), embedding_dim=8))
    if err is None:
        unblock_writer()
    assert isinstance(err, mcf.MCFIOError) and "is a FIFO, not a regular file" in str(err), repr(err)
    assert str(p) in str(err)
