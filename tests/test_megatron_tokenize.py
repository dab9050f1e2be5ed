"""``mcf megatron tokenize`` on the real all-MiniLM-L6-v2 tokenizer: output identical to what Megatron's
builder writes for the token ids the ``tokenizers`` library gives, for every input kind and worker
count; the other subcommands; the demo step."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

import mcf
import mcf.megatron as mm
from _megatron_ref import ref_read, ref_write
from mcf.cli import main
from mcf.conversion.tokenize import tokenize

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is in the test extra")


@pytest.fixture(scope="module")
def model_dir(minilm_dir):
    return minilm_dir


@pytest.fixture(scope="module")
def tok_path(model_dir):
    return os.path.join(model_dir, "tokenizer.json")


@pytest.fixture(scope="module")
def plain_tok(tok_path):
    t = tokenizers.Tokenizer.from_file(tok_path)
    t.no_truncation()
    t.no_padding()
    return t


@pytest.fixture(scope="module")
def texts(model_dir):
    from mcf.apps.demo.megatron import readme_paragraphs

    paras = readme_paragraphs(model_dir)
    # real text plus the edge cases: an empty text, whitespace only, non-ASCII, one long document
    return paras + ["", "   ", "Grüße aus Köln — ünïcödé ✓", " ".join(paras)]


def expected_documents(tok, docs, eod=None, special=False):
    """Megatron's preprocess_data semantics over the library's ids: one sequence per non-empty text,
    EOD appended to the last sequence of a non-empty document."""
    out = []
    for d in docs:
        sents = [d] if isinstance(d, str) else d
        seqs = [tok.encode(s, add_special_tokens=special).ids for s in sents]
        seqs = [s for s in seqs if s]
        if seqs and eod is not None:
            seqs[-1] = seqs[-1] + [eod]
        out.append([(np.array(s), 0) for s in seqs])
    return out


def write_jsonl(path, docs, key="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({key: d, "id": 1}) + "\n")


@pytest.mark.parametrize("workers,batch", [(1, 1000), (1, 3), (2, 4), (3, 1)])
def test_tokenize_jsonl_equals_megatron_builder(tmp_path, tok_path, plain_tok, texts, workers, batch):
    write_jsonl(tmp_path / "in.jsonl", texts)
    out = str(tmp_path / "out")
    stats = tokenize(tmp_path / "in.jsonl", out, tok_path, append_eod=True, workers=workers, batch_size=batch)
    eod = plain_tok.token_to_id("[SEP]")
    ref_write(str(tmp_path / "ref"), expected_documents(plain_tok, texts, eod), np.uint16)
    assert Path(out + ".idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    assert Path(out + ".bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert stats["documents"] == len(texts) and stats["sequences"] == len(texts) - 2
    with mm.open(out) as ds:
        assert ds.num_documents == len(texts)
        assert ds.document_sequences(len(texts) - 3) == range(len(texts) - 3, len(texts) - 3)  # "   "
        assert ds[0].tolist() == plain_tok.encode(texts[0], add_special_tokens=False).ids + [eod]


def test_compressed_and_text_inputs(tmp_path, tok_path, plain_tok, texts):
    zstd = pytest.importorskip("zstandard", reason="zstandard is in the test extra")
    docs = [t for t in texts if t.strip()]
    write_jsonl(tmp_path / "a.jsonl", docs)
    write_jsonl(tmp_path / "a.jsonl.gz", docs, opener=gzip.open)
    raw = (tmp_path / "a.jsonl").read_bytes()
    (tmp_path / "a.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(raw))
    (tmp_path / "renamed.jsonl").write_bytes(gzip.compress(raw))  # detected by magic, not name
    (tmp_path / "a.txt").write_text("\n".join(d.replace("\n", " ") for d in docs) + "\n\n", encoding="utf-8")
    outs = {}
    for name in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "renamed.jsonl"):
        tokenize(tmp_path / name, str(tmp_path / ("o-" + name)), tok_path)
        outs[name] = (Path(str(tmp_path / ("o-" + name)) + ".bin").read_bytes(),
                      Path(str(tmp_path / ("o-" + name)) + ".idx").read_bytes())
    assert len(set(outs.values())) == 1
    tokenize(tmp_path / "a.txt", str(tmp_path / "t"), tok_path)
    want = expected_documents(plain_tok, [d.replace("\n", " ") for d in docs])
    ref_write(str(tmp_path / "tr"), want, np.uint16)
    assert Path(str(tmp_path / "t") + ".bin").read_bytes() == (tmp_path / "tr.bin").read_bytes()
    assert Path(str(tmp_path / "t") + ".idx").read_bytes() == (tmp_path / "tr.idx").read_bytes()
    # several inputs are concatenated in order
    tokenize([tmp_path / "a.jsonl", tmp_path / "a.jsonl.gz"], str(tmp_path / "two"), tok_path)
    with mm.open(str(tmp_path / "two")) as ds, mm.open(str(tmp_path / "o-a.jsonl")) as one:
        assert len(ds) == 2 * len(one) and ds[len(one)].tolist() == one[0].tolist()


def test_sentence_lists_special_tokens_and_keys(tmp_path, tok_path, plain_tok):
    docs = [["First sentence.", "", "Second one here."], "plain text", [], ["only"]]
    write_jsonl(tmp_path / "s.jsonl", docs, key="content")
    tokenize(tmp_path / "s.jsonl", str(tmp_path / "s"), tok_path, json_key="content", append_eod=True,
             eod_token="[SEP]", add_special_tokens=True, batch_size=2)
    eod = plain_tok.token_to_id("[SEP]")
    ref_write(str(tmp_path / "r"), expected_documents(plain_tok, docs, eod, special=True), np.uint16)
    assert Path(str(tmp_path / "s") + ".idx").read_bytes() == (tmp_path / "r.idx").read_bytes()
    assert Path(str(tmp_path / "s") + ".bin").read_bytes() == (tmp_path / "r.bin").read_bytes()
    with mm.open(str(tmp_path / "s")) as ds:
        assert ds.document_indices.tolist() == [0, 3, 4, 4, 5]  # "" is [CLS] [SEP] with special tokens
        assert ds[0][0] == plain_tok.token_to_id("[CLS]")


def test_dtype_rules_with_a_large_vocabulary(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"w{i}": i for i in range(65520)}
    vocab["[UNK]"] = 65520
    t = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    write_jsonl(tmp_path / "v.jsonl", ["w1 w65519 nope", "w0"])
    tokenize(tmp_path / "v.jsonl", str(tmp_path / "meg"), t)
    tokenize(tmp_path / "v.jsonl", str(tmp_path / "dt"), t, dtype_rule="datatrove")
    with mm.open(str(tmp_path / "meg")) as a, mm.open(str(tmp_path / "dt")) as b:
        assert a.dtype == np.int32 and b.dtype == np.uint16
        assert a[0].tolist() == b[0].tolist() == [1, 65519, 65520]


@pytest.mark.parametrize("content,match", [
    (b'{"text": "ok"}\n{"txt": "no key"}\n', "no key 'text'"),
    (b'{"text": "ok"}\nnot json\n', "invalid JSON"),
    (b'{"text": 5}\n', "not a string"),
    (b'{"text": "\xff\xfe"}\n', "UTF-8"),
    (b"\x1f\x8b\x08\x00garbage-after-a-gzip-magic", "corrupt"),
    (gzip.compress(b'{"text": "truncated"}\n' * 50)[:-30], "corrupt"),
    (b"\x28\xb5\x2f\xfd" + b"not really zstd" * 3, "corrupt"),
])
def test_bad_input_files(tmp_path, tok_path, content, match):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(mcf.FormatError, match=match) as ei:
        tokenize(tmp_path / "bad.jsonl", str(tmp_path / "o"), tok_path)
    assert "bad.jsonl" in str(ei.value)
    assert not (tmp_path / "o.idx").exists() and not (tmp_path / "o.bin").exists()
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_bad_arguments(tmp_path, tok_path):
    write_jsonl(tmp_path / "in.jsonl", ["a"])
    with pytest.raises(mcf.InvalidArgumentError, match="no tokenizer"):
        tokenize(tmp_path / "in.jsonl", str(tmp_path / "o"), tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not a tokenizer")
    with pytest.raises(mcf.InvalidArgumentError, match="not a tokenizers file"):
        tokenize(tmp_path / "in.jsonl", str(tmp_path / "o"), tmp_path / "junk.json")
    with pytest.raises(mcf.InvalidArgumentError, match="--eod-token"):
        tokenize(tmp_path / "in.jsonl", str(tmp_path / "o"), tok_path, append_eod=True, eod_token="<nope>")
    with pytest.raises(mcf.InvalidArgumentError):
        tokenize(tmp_path / "in.jsonl", str(tmp_path / "o"), tok_path, workers=0)
    with pytest.raises(mcf.MissingFileError):
        tokenize(tmp_path / "nothing.jsonl", str(tmp_path / "o"), tok_path)


def test_cli_tokenize_info_verify_merge(tmp_path, tok_path, texts, capsys):
    write_jsonl(tmp_path / "in.jsonl", texts)
    out = str(tmp_path / "cli")
    assert main(["megatron", "tokenize", str(tmp_path / "in.jsonl"), "--tokenizer", tok_path, "--output-prefix", out,
                 "--append-eod", "--workers", "2", "-q"]) == 0
    text = capsys.readouterr().out
    assert f"{len(texts)} documents" in text and "tokens/s" in text
    assert main(["megatron", "info", out + ".idx", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    r = ref_read(out)
    assert d["sequences"] == len(r["lengths"]) and d["tokens"] == int(r["lengths"].sum())
    assert d["dtype"] == "uint16" and d["documents"] == len(texts) and d["variant"] == "megatron"
    assert main(["megatron", "info", out, "--show", "2", "--no-mmap"]) == 0
    assert "[1]" in capsys.readouterr().out
    assert main(["megatron", "verify", out]) == 0
    assert capsys.readouterr().out.startswith("OK")
    assert main(["megatron", "merge", str(tmp_path / "m"), out, out, "-q"]) == 0
    capsys.readouterr()
    with mm.open(str(tmp_path / "m")) as ds:
        assert len(ds) == 2 * len(r["lengths"]) and ds.verify() == []
    assert main(["megatron", "info", str(tmp_path / "missing")]) == 1
    assert "missing.idx" in capsys.readouterr().err


def test_output_prefix_in_a_new_directory(tmp_path, tok_path, texts, capsys):
    """docs/megatron.md's own example (--output-prefix data/corpus) failed on a fresh directory with
    "data/corpus.bin: No such file or directory", which reads like a missing input.  The missing directories
    are created, as mcf export -o DIR creates DIR; merge's output prefix too."""
    write_jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "data" / "v1" / "corpus"
    assert main(["megatron", "tokenize", str(tmp_path / "in.jsonl"), "--tokenizer", tok_path, "--output-prefix",
                 str(out), "-q"]) == 0
    assert (tmp_path / "data" / "v1" / "corpus.idx").is_file() and (tmp_path / "data" / "v1" / "corpus.bin").is_file()
    merged = tmp_path / "merged" / "all"
    assert main(["megatron", "merge", str(merged), str(out), str(out), "-q"]) == 0
    with mm.open(str(merged)) as ds:
        assert ds.verify() == []
    (tmp_path / "file").write_text("x")
    assert main(["megatron", "tokenize", str(tmp_path / "in.jsonl"), "--tokenizer", tok_path, "--output-prefix",
                 str(tmp_path / "file" / "corpus"), "-q"]) == 1
    assert "mcf megatron tokenize: error: " + str(tmp_path / "file") in capsys.readouterr().err
    with pytest.raises(mcf.InvalidArgumentError, match="remote URLs"):   # s3:// writes: test_megatron_remote.py
        tokenize(tmp_path / "in.jsonl", "https://example.invalid/corpus", tok_path)
    assert not os.path.exists("https:")


def test_tokenizer_from_an_mcf_file_or_a_checkpoint_directory(tmp_path, model_dir, tok_path, texts, capsys):
    """--tokenizer model.mcf was refused ("stream did not contain valid UTF-8") although the MCF file
    carries the checkpoint's tokenizer.json.  An MCF file, an open container and a checkpoint directory are
    tokenizer sources wherever a tokenizer is taken, and give the bytes tokenizer.json gives."""
    write_jsonl(tmp_path / "in.jsonl", texts)
    packed = str(tmp_path / "model.mcf")
    mcf.pack(model_dir, packed)
    outs = {}
    for name, source in (("json", tok_path), ("mcf", packed), ("dir", model_dir)):
        outs[name] = str(tmp_path / name)
        assert main(["megatron", "tokenize", str(tmp_path / "in.jsonl"), "--tokenizer", source, "--output-prefix",
                     outs[name], "--append-eod", "-q"]) == 0
    capsys.readouterr()
    want = [Path(outs["json"] + ext).read_bytes() for ext in (".idx", ".bin")]
    for name in ("mcf", "dir"):
        assert [Path(outs[name] + ext).read_bytes() for ext in (".idx", ".bin")] == want, name
    from mcf.conversion.tokenizer import load_tokenizer

    with mcf.open(packed) as c:
        tok = load_tokenizer(c)
    assert tok.encode(texts[0]).ids == load_tokenizer(tok_path).encode(texts[0]).ids
    assert tok.truncation is None and tok.padding is None

    bare = str(tmp_path / "bare.mcf")
    mcf.pack(model_dir, bare, resources=False)
    assert main(["megatron", "tokenize", str(tmp_path / "in.jsonl"), "--tokenizer", bare, "--output-prefix",
                 str(tmp_path / "x"), "-q"]) == 1
    err = capsys.readouterr().err
    assert f"{bare}: the MCF file holds no tokenizer.json resource" in err
    with pytest.raises(mcf.InvalidArgumentError, match="a safetensors file, not a tokenizer"):
        load_tokenizer(os.path.join(model_dir, "model.safetensors"))


def test_progress_reports_tokens_per_second(tmp_path, tok_path, texts):
    write_jsonl(tmp_path / "in.jsonl", texts * 5)
    calls = []
    tokenize(tmp_path / "in.jsonl", str(tmp_path / "p"), tok_path, batch_size=10,
             progress=lambda done, total, what: calls.append((done, total, what)))
    assert calls and calls[-1][0] == calls[-1][1] == os.path.getsize(tmp_path / "in.jsonl")
    assert "tok/s" in calls[-1][2]


def test_demo_megatron_step(tmp_path, model_dir, plain_tok, capsys):
    from mcf.apps.demo.megatron import demo_megatron

    res = demo_megatron(model_dir, str(tmp_path))
    out = capsys.readouterr().out
    assert "megatron verify: OK" in out and res["problems"] == []
    from mcf.apps.demo.megatron import readme_paragraphs

    paras = readme_paragraphs(model_dir)
    with mm.open(res["prefix"]) as ds:
        assert ds.num_documents == len(paras)
        eod = plain_tok.token_to_id("[SEP]")
        for i, p in enumerate(paras):
            assert ds[i].tolist() == plain_tok.encode(p, add_special_tokens=False).ids + [eod]
        assert res["samples"] == (ds.num_tokens - 1) // 32


# -- the line-length cap: a line is held whole, so it is bounded ------------------------------------------

class _CountingStream(__import__("io").RawIOBase):
    """``data`` served lazily, counting the bytes handed out (an 8 MiB line is never built as one object
    by the stream itself)."""

    def __init__(self, head: bytes, fill: int, size: int):
        self.head, self.fill, self.size, self.served = head, fill, size, 0

    def readable(self):
        return True

    def readinto(self, b):
        n = min(len(b), self.size - self.served)
        if n <= 0:
            return 0
        mv = memoryview(b).cast("B")
        k = max(0, min(n, len(self.head) - self.served))
        mv[:k] = self.head[self.served:self.served + k]
        mv[k:n] = bytes([self.fill]) * (n - k)
        self.served += n
        return n


def test_a_line_past_the_cap_is_refused_before_it_is_read_whole():
    """A 3 MB .jsonl.gz can hold one 3 GiB line: it is refused once more than max_line_bytes of it arrived,
    naming the file and the line, and the reader never takes more than max_line_bytes + READ_BYTES."""
    from mcf.conversion import tokenize as tokenize_module

    cap = 64 << 10
    head = b'{"text": "one"}\n{"text": "two"}\n{"text": "'
    stream = _CountingStream(head, ord("a"), 16 << 20)   # a third line of 16 MiB
    docs = []
    with pytest.raises(mcf.FormatError) as ei:
        for d in tokenize_module.iter_documents("big.jsonl", stream=stream, max_line_bytes=cap):
            docs.append(d)
    assert docs == ["one", "two"]
    assert ei.value.path == "big.jsonl" and ei.value.field == "line 3"
    assert f"longer than the {cap} bytes allowed" in str(ei.value) and "--max-line-bytes" in str(ei.value)
    assert stream.served <= len(head) + cap + tokenize_module.READ_BYTES


def test_line_cap_boundaries_and_lines_across_reads(tmp_path, monkeypatch):
    from mcf.conversion import tokenize as tokenize_module

    lines = [b'{"text": "a"}', b"", b'{"text": "' + b"b" * 40 + b'"}', b'{"text": "c"}']
    longest = max(map(len, lines))
    for tail in (b"\n", b""):  # the last line with and without its newline
        p = tmp_path / "in.jsonl"
        p.write_bytes(b"\n".join(lines) + tail)
        for read_bytes in (1, 7, 1 << 20):  # a line split over many reads, or read in one
            monkeypatch.setattr(tokenize_module, "READ_BYTES", read_bytes)
            got = list(tokenize_module.iter_documents(str(p), max_line_bytes=longest))
            assert got == ["a", "b" * 40, "c"]
            with pytest.raises(mcf.FormatError) as ei:
                list(tokenize_module.iter_documents(str(p), max_line_bytes=longest - 1))
            assert ei.value.field == "line 3"
    with pytest.raises(mcf.InvalidArgumentError):
        list(tokenize_module.iter_documents(str(p), max_line_bytes=0))


def test_line_cap_in_tokenize_the_cli_and_a_ray_chunk(tmp_path, tok_path, capsys):
    from mcf.conversion._chunks import Chunk, iter_chunk_documents

    p = tmp_path / "bomb.jsonl.gz"
    with gzip.open(p, "wb") as f:
        f.write(b'{"text": "fine"}\n{"text": "' + b"x" * (4 << 20) + b'"}\n')
    assert p.stat().st_size < 64 << 10           # small on disk, one 4 MiB line inside
    with pytest.raises(mcf.FormatError, match="line 2") as ei:
        tokenize(p, str(tmp_path / "o"), tok_path, max_line_bytes=1 << 20)
    assert str(p) in str(ei.value)
    assert not (tmp_path / "o.bin").exists()
    assert main(["megatron", "tokenize", str(p), "--tokenizer", tok_path, "--output-prefix", str(tmp_path / "c"),
                 "--max-line-bytes", "1MiB", "-q"]) != 0
    err = capsys.readouterr().err
    assert f"{p}: line 2: line longer than the {1 << 20} bytes allowed" in err
    assert main(["megatron", "tokenize", str(p), "--tokenizer", tok_path, "--output-prefix", str(tmp_path / "c"),
                 "--max-line-bytes", "8MiB", "-q"]) == 0
    capsys.readouterr()
    with pytest.raises(mcf.FormatError, match="line 2"):
        list(iter_chunk_documents(Chunk(0, 0, str(p), 0, None), max_line_bytes=1 << 20))
    assert len(list(iter_chunk_documents(Chunk(0, 0, str(p), 0, None)))) == 2  # the default cap: 64 MiB
