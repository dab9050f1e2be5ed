"""``tokenize(workers=N)`` with worker processes (mcf.conversion._tokpool): the .bin/.idx are
byte-identical for N = 1, 2, 3 on JSON lines, plain text, gzip and zstd inputs, documents of several
sentences and empty texts under both ``empty_text`` rules, with the hf and fastokens backends; a malformed
line is the same FormatError as in one process; a worker killed mid-run is a WorkerError; the pool is
shut down and nothing is published on failure (Ctrl-C included); small inputs stay in one process and
say so."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _tokpool_hooks
import mcf
from mcf.cli import main
from mcf.conversion import _tokpool
from mcf.conversion import tokenize as tokenize_module
from mcf.conversion.tokenize import tokenize

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is in the test extra")

TEXTS = ["Hello, world! What?! ... -- (a) [b] {c}", "def f(x):\n    return {'a': [1, 2, 3]}\n",
         "English, Français, Grüße; Русский текст; 中文文本，日本語のテキスト", "emoji 😀 👍🏽 👨‍👩‍👧‍👦",
         "I'm you're he's can't won't", "0 1 12 123 1234 12345 3.14159 -2.5e-10", "tabs\tand\t\tmore",
         "<|endoftext|> inside and after <|endoftext|>"]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    """A small byte-level BPE trained here (500 entries)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    p = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(p))
    return str(p)


def test_tiktoken_workers_write_the_same_bytes(tmp_path, bpe_path, small_blocks):
    """A tiktoken vocabulary travels to the workers as itself (its ranks), and its backend runs there."""
    pytest.importorskip("tiktoken", reason="tiktoken is in the tokenize extra")
    from mcf.conversion import tok_backends as tb

    spec = json.loads(Path(bpe_path).read_text(encoding="utf-8"))
    u2b = {c: b for b, c in tb._bytes_to_unicode().items()}
    entries = sorted((i, t) for t, i in spec["model"]["vocab"].items() if not t.startswith("<|"))
    ranks = {bytes(u2b[c] for c in t): k for k, (_, t) in enumerate(entries)}
    vocab = tb.TiktokenVocab("test_bpe", ranks, r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+"""
                             r"""| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
                             special_tokens={"<|endoftext|>": len(ranks)})
    src = tmp_path / "in.jsonl"
    _write(src, _documents())
    outs = []
    for workers in (1, 3):
        out = str(tmp_path / f"o{workers}")
        stats = tokenize(str(src), out, vocab, append_eod=True, workers=workers, batch_size=7,
                         tokenizer_backend="tiktoken")
        assert stats["backend"] == "tiktoken" and stats["workers"] == workers
        outs.append(_outputs(out))
    assert outs[0] == outs[1] and len(small_blocks) >= 3


def _documents(n: int = 300) -> list:
    """Texts, sentence lists (with an empty sentence), an empty string, whitespace only, an empty list."""
    extra = ["", "   ", ["first sentence.", "", "second one"], [], "\u200b"]
    docs = [TEXTS[k % len(TEXTS)] + f" {k}" for k in range(n)]
    for k, d in enumerate(extra):
        docs.insert(7 + 41 * k, d)
    return docs


@pytest.fixture
def small_blocks(monkeypatch, tmp_path_factory):
    """Many small blocks (1 KiB blocks of 256-byte reads), the pool used whatever the input's size, the
    first block encoded by this process (as while the workers start) and the others by the workers;
    returns the list of the blocks the workers were sent (a FileRange, or the first line's number of a
    block of bytes)."""
    monkeypatch.setattr(_tokpool, "MIN_BYTES", dict.fromkeys(_tokpool.MIN_BYTES, 0))
    monkeypatch.setattr(_tokpool, "BLOCK_BYTES", 1024)
    monkeypatch.setattr(tokenize_module, "READ_BYTES", 256)
    ready = _tokpool.BlockPool.ready
    calls = []

    def first_local_then_wait(self):
        calls.append(1)
        if len(calls) == 1:
            return False
        self._starter.join()
        for f in self._warming:
            f.exception()   # waits until that worker has started (or failed to)
        return ready(self)

    monkeypatch.setattr(_tokpool.BlockPool, "ready", first_local_then_wait)
    sent = []
    submit = _tokpool.BlockPool.submit

    def counted(self, block, first, *args):
        sent.append(block if isinstance(block, _tokpool.FileRange) else first)
        return submit(self, block, first, *args)

    monkeypatch.setattr(_tokpool.BlockPool, "submit", counted)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("spill")))   # the workers' spill files
    yield sent
    left = [n for n in os.listdir(tempfile.tempdir) if n.startswith("mcf-tokenize-")]
    assert not left, "the pool removed its spill directory"


def _write(path: Path, docs: list) -> None:
    if path.suffix in (".gz", ".zst"):
        raw = path.with_suffix("")
        _write(raw, docs)
        data = raw.read_bytes()
        if path.suffix == ".gz":
            path.write_bytes(gzip.compress(data))
        else:
            zstandard = pytest.importorskip("zstandard", reason="zstandard is in the tokenize extra")
            path.write_bytes(zstandard.ZstdCompressor().compress(data))
        return
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write((json.dumps({"text": d}) if ".jsonl" in path.name else str(d).replace("\n", " ")) + "\n")


def _outputs(prefix: str) -> tuple:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


@pytest.mark.parametrize("backend", ["hf", "fastokens"])
@pytest.mark.parametrize("name", ["in.jsonl", "in.txt", "in.jsonl.gz", "in.jsonl.zst"])
def test_workers_write_the_same_bytes(tmp_path, bpe_path, small_blocks, backend, name):
    if backend != "hf":
        pytest.importorskip(backend, reason=f"{backend} is in the tokenize extra")
    docs = _documents() if ".jsonl" in name else [d for d in _documents() if isinstance(d, str)]
    src = tmp_path / name
    _write(src, docs)
    for empty_text in ("megatron", "datatrove"):
        want = None
        for workers in (1, 2, 3):
            out = str(tmp_path / f"{empty_text}{workers}")
            del small_blocks[:]
            stats = tokenize(str(src), out, bpe_path, append_eod=True, workers=workers, batch_size=7,
                             tokenizer_backend=backend, empty_text=empty_text)
            assert stats["backend"] == backend and stats["workers"] == workers and stats["workers_note"] is None
            if workers > 1:
                assert len(small_blocks) >= 3, "the workers tokenized some blocks"
            if want is None:
                want = _outputs(out)
            assert _outputs(out) == want, (empty_text, workers)


def test_a_malformed_line_in_a_worker_names_the_line(tmp_path, bpe_path, small_blocks):
    docs = _documents()
    src = tmp_path / "in.jsonl"
    _write(src, docs)
    lines = src.read_bytes().split(b"\n")
    lines[250] = b'{"text": "unterminated}'
    src.write_bytes(b"\n".join(lines))
    errors = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        with pytest.raises(mcf.FormatError) as e:
            tokenize(str(src), str(out), bpe_path, workers=workers, tokenizer_backend="hf")
        assert not Path(str(out) + ".bin").exists() and not Path(str(out) + ".idx").exists()
        errors.append(str(e.value))
    assert "line 251" in errors[0] and errors[1] == errors[0]
    at = len(b"\n".join(lines[:250])) + 1   # where the bad line starts
    assert any(b.offset <= at <= b.offset + b.length for b in small_blocks), "the bad line reached a worker"


def _pool_processes() -> list:
    return multiprocessing.active_children()   # the fork server is not one of them: it is not a Process


def test_a_killed_worker_is_an_error_and_publishes_nothing(tmp_path, bpe_path, small_blocks, monkeypatch):
    monkeypatch.setattr(_tokpool, "_work", _tokpool_hooks.die_on_its_block)
    src = tmp_path / "in.jsonl"
    _write(src, _documents())
    out = tmp_path / "out"
    before = set(_pool_processes())
    with pytest.raises(mcf.WorkerError, match="worker process died") as e:
        tokenize(str(src), str(out), bpe_path, workers=2, tokenizer_backend="hf")
    assert isinstance(e.value, mcf.MCFError) and "in.jsonl" in str(e.value)
    assert not Path(str(out) + ".bin").exists() and not Path(str(out) + ".idx").exists()
    assert set(_pool_processes()) <= before, "the pool's processes ended"


def test_ctrl_c_stops_the_pool_and_publishes_nothing(tmp_path, bpe_path, small_blocks):
    src = tmp_path / "in.jsonl"
    _write(src, _documents())
    out = tmp_path / "out"
    before = set(_pool_processes())
    calls = []

    def progress(done, total, text):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tokenize(str(src), str(out), bpe_path, workers=2, tokenizer_backend="hf", progress=progress)
    assert not Path(str(out) + ".bin").exists() and not Path(str(out) + ".idx").exists()
    assert set(_pool_processes()) <= before, "the pool's processes ended"


def test_a_small_input_stays_in_one_process_and_says_why(tmp_path, bpe_path, capsys):
    src = tmp_path / "in.jsonl"
    _write(src, _documents(20))
    stats = tokenize(str(src), str(tmp_path / "a"), bpe_path, workers=3, tokenizer_backend="hf")
    assert stats["workers"] == 1 and "not 3" in stats["workers_note"]
    assert main(["megatron", "tokenize", str(src), "--tokenizer", bpe_path, "--output-prefix", str(tmp_path / "b"),
                 "--workers", "2", "--tokenizer-backend", "hf", "-q"]) == 0
    assert "note: tokenizing in one process, not 2" in capsys.readouterr().err
    assert _outputs(str(tmp_path / "a")) == _outputs(str(tmp_path / "b"))


def test_a_block_read_by_a_worker_from_a_changed_file_is_a_format_error(tmp_path):
    """A worker reads a local file's block itself (offset, length): a file cut short since is refused."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "a"}\n{"text": "b"}\n')
    block = _tokpool.FileRange(14, 13, 1 << 20)
    assert block.read(str(src)) == b'{"text": "b"}'
    src.write_bytes(b'{"text": "a"}\n{"te')
    with pytest.raises(mcf.FormatError, match="changed while it was tokenized") as e:
        block.read(str(src))
    assert e.value.path == str(src) and e.value.offset == 14


def _ranges(data: bytes, target: int, max_line_bytes: int, tmp_path) -> list:
    p = tmp_path / "ranges.txt"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        return list(_tokpool.file_ranges(fd, len(data), target, max_line_bytes, str(p)))
    finally:
        os.close(fd)


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"x")), max_size=40),
       final_newline=st.booleans(), target=st.integers(1, 120))
def test_file_ranges_are_the_lines_of_the_file(tmp_path_factory, lines, final_newline, target):
    """The blocks a worker reads by offset hold exactly the file's lines, as the one-process reader cuts
    them (a final newline ends the last line, it does not start an empty one), each block but the last
    ending at the first newline ``target`` bytes or more after its start."""
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    got = _ranges(data, target, 1 << 20, tmp_path_factory.mktemp("r"))
    assert all(isinstance(b, _tokpool.FileRange) for b in got)
    blocks = [data[b.offset:b.offset + b.length] for b in got]
    want = list(tokenize_module._line_blocks(iter([data]) if data else iter([]), "x", 1 << 20))
    assert b"\n".join(blocks).split(b"\n") == b"\n".join(b for _, b in want).split(b"\n") or not data
    for b, nxt in zip(got, got[1:]):
        assert b.length + 1 >= target and data[b.offset + b.length:b.offset + b.length + 1] == b"\n"
        assert nxt.offset == b.offset + b.length + 1
        assert b"\n" not in data[b.offset + target - 1:b.offset + b.length]


def test_file_ranges_stop_at_a_line_too_long(tmp_path):
    data = b"a\nbb\n" + b"c" * 100 + b"\nd\n"
    got = _ranges(data, 6, 20, tmp_path)
    assert [type(b).__name__ for b in got] == ["FileRange", "LongLine"]
    assert data[got[0].offset:got[0].length] == b"a\nbb" and got[1].offset == 5


@pytest.mark.parametrize("name", ["in.jsonl", "in.txt"])
@pytest.mark.parametrize("case", ["across a block's end", "inside a block"])
def test_a_line_too_long_for_the_workers_is_the_one_process_error(tmp_path, bpe_path, small_blocks, monkeypatch,
                                                                   name, case):
    """A line over ``max_line_bytes``, across a block's end (found while looking for that end) or inside
    a block a worker reads (found by the worker), is the FormatError one process raises: the same line."""
    docs = [d for d in _documents(600) if isinstance(d, str)]
    src = tmp_path / name
    _write(src, docs)
    if case == "inside a block":   # the second block (a worker's) holds the whole long line
        monkeypatch.setattr(_tokpool, "BLOCK_BYTES", 8192)
        starts = np.cumsum([0] + [len(x) + 1 for x in src.read_bytes().split(b"\n")])
        where, length = int(np.searchsorted(starts, 9000)), 2600
    else:
        where, length = 40, 6000
    docs[where] = "y" * length
    _write(src, docs)
    kinds = [type(b).__name__ for b in _ranges(src.read_bytes(), _tokpool.BLOCK_BYTES, 2500, tmp_path)]
    assert ("LongLine" in kinds) == (case == "across a block's end")
    errors = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        with pytest.raises(mcf.FormatError, match="longer than") as e:
            tokenize(str(src), str(out), bpe_path, workers=workers, tokenizer_backend="hf", max_line_bytes=2500)
        assert not Path(str(out) + ".bin").exists()
        errors.append(str(e.value))
    assert f"line {where + 1}" in errors[0] and errors[1] == errors[0]


def test_a_spill_file_that_cannot_be_written_or_read_is_an_mcf_error(tmp_path):
    """A worker's ids go through a file in TMPDIR: a full or vanished TMPDIR is an mcf error naming it."""
    import numpy as np

    results = [(np.arange(5, dtype=np.uint16), np.array([5], np.int32), None)]
    with pytest.raises(mcf.MCFError) as e:
        _tokpool._spill(results, str(tmp_path / "gone" / "1.ids"))
    assert isinstance(e.value, OSError) and "1.ids" in str(e.value)
    name = str(tmp_path / "2.ids")
    spilled = _tokpool._spill(results, name)
    back = _tokpool._unspill(spilled, name, "in.jsonl")
    assert back[0][0].tolist() == [0, 1, 2, 3, 4] and not os.path.exists(name)
    with pytest.raises(mcf.MCFError, match="2.ids"):
        _tokpool._unspill(spilled, name, "in.jsonl")
    Path(name).write_bytes(b"\0" * 4)   # fewer bytes than the worker said it wrote
    with pytest.raises(mcf.WorkerError, match="holds 4 bytes where 10"):
        _tokpool._unspill(spilled, name, "in.jsonl")
