"""Tokenizer backends (mcf.conversion.tok_backends): fastokens and tiktoken give HF tokenizers' ids on random
unicode text, ``auto`` falls back to HF tokenizers (saying why, once) for a tokenizer a backend refuses or
tokenizes differently, and ``mcf megatron tokenize`` writes the same bytes as Megatron's builder and
datatrove's tokenizer step under every backend, whatever the worker count; the block reader's three JSON
parsers agree."""

from __future__ import annotations

import base64
import gzip
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.megatron as mm
from _megatron_ref import ref_write, run_datatrove
from mcf.cli import main
from mcf.conversion import tok_backends as tb
from mcf.conversion import tokenize as tokenize_module
from mcf.conversion.tokenize import tokenize

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is in the test extra")

# cl100k_base's split pattern: possessive quantifiers, and the interval \p{N}{1,3}+ that Oniguruma reads
# otherwise (tok_backends.onig_pattern)
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                  r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:  # a lone surrogate (the probe has some)
        return False


def _training_text() -> list:
    here = Path(__file__).parent
    texts = [p.read_text(encoding="utf-8") for p in sorted(here.glob("test_megatron*.py"))[:4]]
    return texts + [t for t in tb.PROBE_TEXTS if _is_unicode(t)] * 3


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    """A small byte-level BPE (the kind of GPT-2, Llama 3, Qwen), trained here: 1500 entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer)
    p = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(p))
    return str(p)


@pytest.fixture(scope="module")
def tiktoken_vocab(bpe_path):
    """A tiktoken vocabulary: the BPE's tokens as bytes, ranked in their order, cl100k_base's pattern and
    ``<|endoftext|>`` after the ranks."""
    spec = json.loads(Path(bpe_path).read_text(encoding="utf-8"))
    u2b = {c: b for b, c in tb._bytes_to_unicode().items()}
    entries = sorted((i, t) for t, i in spec["model"]["vocab"].items() if not t.startswith("<|"))
    ranks = {bytes(u2b[c] for c in t): k for k, (_, t) in enumerate(entries)}
    return tb.TiktokenVocab("test_bpe", ranks, CL100K_PATTERN, special_tokens={"<|endoftext|>": len(ranks)})


@pytest.fixture(scope="module")
def tiktoken_file(tiktoken_vocab, tmp_path_factory):
    p = tmp_path_factory.mktemp("tiktoken") / "test_bpe.tiktoken"
    with open(p, "wb") as f:
        for t, r in sorted(tiktoken_vocab.ranks.items(), key=lambda x: x[1]):
            f.write(base64.b64encode(t) + b" " + str(r).encode() + b"\n")
    return str(p)


def _backends_of(source):
    names = ["fastokens"] + (["tiktoken"] if source.tiktoken is not None else [])
    out = []
    for name in names:
        try:
            out.append(tb.make_backend(name, source))
        except ImportError:
            pass  # not installed: the parametrized tests below skip it with the reason
    return out


def _need(name, extra="tokenize"):
    pytest.importorskip(name, reason=f"{name} is in the {extra} extra (pip install -e '.[{extra}]')")


# -- ids -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,name", [("json", "fastokens"), ("tiktoken", "fastokens"), ("tiktoken", "tiktoken")])
def test_backends_pass_the_probe(bpe_path, tiktoken_vocab, kind, name):
    _need(name)
    source = tb.load_source(bpe_path if kind == "json" else tiktoken_vocab)
    b = tb.make_backend(name, source)
    assert tb.probe_mismatch(b, tb.HFBackend(source.hf), source) is None
    assert tb.probe_mismatch(b, tb.HFBackend(source.hf), source, add_special_tokens=True) is None


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)
_PIECES = st.lists(st.one_of(_TEXT, st.sampled_from([" ", "  ", "\n", "\t", "'s", "123456", "<|endoftext|>", "é",
                                                      "\u0301", "👨‍👩‍👧", "中文", "x" * 50])), max_size=12).map("".join)


@pytest.mark.parametrize("kind", ["json", "tiktoken"])
def test_every_backend_gives_hf_ids_on_random_unicode(bpe_path, tiktoken_vocab, kind):
    _need("fastokens")
    source = tb.load_source(bpe_path if kind == "json" else tiktoken_vocab)
    ref = tb.HFBackend(source.hf)
    backends = _backends_of(source)
    assert backends

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(_PIECES, min_size=1, max_size=6))
    def check(texts):
        want_ids, want_offs = ref.encode(texts, False)
        for b in backends:
            ids, offs = b.encode(texts, False)
            assert ids.dtype == np.uint32 and offs.dtype == np.int64
            assert np.array_equal(offs, want_offs) and np.array_equal(ids, want_ids), b.name

    check()


def test_tiktoken_conversion_keeps_possessive_intervals():
    """cl100k_base's ``\\p{N}{1,3}+`` takes three digits at most in tiktoken; Oniguruma read as it is takes
    every digit, so the converted reference would split numbers differently."""
    assert tb.onig_pattern(r"\p{N}{1,3}+| ?[^\s]++") == r"(?>\p{N}{1,3})| ?[^\s]++"
    assert tb.onig_pattern(r"[a-z]{2}+x{1,}+") == r"(?>[a-z]{2})(?>x{1,})"


# -- auto and its fallback -------------------------------------------------------------------------------
@pytest.fixture
def fresh_choice(monkeypatch):
    """The probe's results and the notes already said are per process: start from none."""
    monkeypatch.setattr(tb, "_CHOSEN", {})
    monkeypatch.setattr(tb, "_SAID", set())


def test_auto_takes_fastokens_for_byte_level_bpe(bpe_path, fresh_choice):
    _need("fastokens")
    b, note = tb.choose_backend(tb.load_source(bpe_path), "auto")
    assert b.name == "fastokens" and note is None


def test_auto_falls_back_for_a_bert_tokenizer_and_says_why_once(minilm_dir, fresh_choice, caplog, tmp_path):
    """fastokens refuses WordPiece with BERT's normalizer: auto uses HF tokenizers, logs the reason once
    (not a Python warning), returns it with the stats, and the command line prints it."""
    _need("fastokens")
    tok = os.path.join(minilm_dir, "tokenizer.json")
    source = tb.load_source(tok)
    with caplog.at_level(logging.WARNING, logger="mcf.tokenize"):
        b, note = tb.choose_backend(source, "auto")
        b2, note2 = tb.choose_backend(tb.load_source(tok), "auto")
    assert b.name == b2.name == "hf"
    assert note == note2 and "fastokens does not load" in note
    said = [r for r in caplog.records if r.name == "mcf.tokenize"]
    assert len(said) == 1 and said[0].getMessage() == note
    with pytest.raises(mcf.InvalidArgumentError, match="fastokens does not load"):
        tb.choose_backend(source, "fastokens")


def test_the_command_line_says_why_auto_fell_back_once(minilm_dir, tmp_path):
    """In a process of its own (no logging configured, as a user runs it): the reason is one note on stderr,
    not also a line from Python's last-resort log handler."""
    _need("fastokens")
    import subprocess

    src = tmp_path / "in.jsonl"
    _write_jsonl(src, ["one document", "and another"])
    r = subprocess.run([sys.executable, "-m", "mcf", "megatron", "tokenize", str(src), "--tokenizer",
                        os.path.join(minilm_dir, "tokenizer.json"), "--output-prefix", str(tmp_path / "out"), "-q"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("fastokens does not load") == 1 and "note: " in r.stderr, r.stderr


def test_auto_falls_back_when_ids_differ_and_a_named_backend_is_refused(bpe_path, fresh_choice, monkeypatch):
    _need("fastokens")
    real = tb.FastokensBackend.encode

    def off_by_one_on_digits(self, texts, add_special_tokens):
        ids, offs = real(self, texts, add_special_tokens)
        if any("123" in t for t in texts):
            ids = ids.copy()
            ids[:1] += 1
        return ids, offs

    monkeypatch.setattr(tb.FastokensBackend, "encode", off_by_one_on_digits)
    source = tb.load_source(bpe_path)
    b, note = tb.choose_backend(source, "auto")
    assert b.name == "hf" and "fastokens: its ids differ from HF tokenizers' on" in note
    with pytest.raises(mcf.InvalidArgumentError, match="does not tokenize .* as HF tokenizers does"):
        tb.choose_backend(source, "fastokens")


def test_auto_without_fastokens_says_it_is_not_installed(bpe_path, fresh_choice, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastokens", None)
    b, note = tb.choose_backend(tb.load_source(bpe_path), "auto")
    assert b.name == "hf" and "fastokens is not installed" in note
    with pytest.raises(mcf.MissingDependencyError, match="tokenize"):
        tb.choose_backend(tb.load_source(bpe_path), "fastokens")


def test_backend_arguments_are_checked(bpe_path):
    source = tb.load_source(bpe_path)
    with pytest.raises(mcf.InvalidArgumentError, match="one of"):
        tb.choose_backend(source, "fast")
    with pytest.raises(mcf.InvalidArgumentError, match="needs a tiktoken-format tokenizer"):
        tb.choose_backend(source, "tiktoken")
    with pytest.raises(mcf.InvalidArgumentError, match="applies to a .tiktoken"):
        tb.load_source(bpe_path, tiktoken_pattern=r"\s+")


def test_tiktoken_file_sources(tiktoken_file, tiktoken_vocab, tmp_path):
    _need("tiktoken")
    with pytest.raises(mcf.InvalidArgumentError, match="--tiktoken-pattern"):
        tb.load_source(tiktoken_file)
    source = tb.load_source(tiktoken_file, tiktoken_pattern=CL100K_PATTERN)
    assert source.tiktoken.ranks == tiktoken_vocab.ranks and source.tiktoken.special_tokens == {}
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(Path(tiktoken_file).read_bytes()[:4000] + b"!!!! 7\n")
    with pytest.raises(mcf.FormatError) as ei:
        tb.read_tiktoken_file(str(bad))
    assert ei.value.path == str(bad) and ei.value.field.startswith("line ")
    import pickle

    again = pickle.loads(pickle.dumps(tiktoken_vocab))
    assert again.ranks == tiktoken_vocab.ranks and again.special_tokens == tiktoken_vocab.special_tokens


# -- datasets: the same bytes under every backend ----------------------------------------------------------
def _documents():
    docs = _training_text()[:4] + [t for t in tb.PROBE_TEXTS if _is_unicode(t)]
    return docs + ["", "   ", ["first sentence.", "", "second one"], "<|endoftext|> inside"] * 2


def _write_jsonl(path, docs, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")


def _expected(hf, docs, eod):
    """Megatron's preprocess_data over HF tokenizers' ids (one sequence per non-empty text, the EOD on the
    last sequence of a non-empty document)."""
    out = []
    for d in docs:
        seqs = [hf.encode(s, add_special_tokens=False).ids for s in ([d] if isinstance(d, str) else d)]
        seqs = [s for s in seqs if s]
        if seqs and eod is not None:
            seqs[-1] = seqs[-1] + [eod]
        out.append([(np.array(s), 0) for s in seqs])
    return out


BACKEND_CASES = [("json", "hf"), ("json", "fastokens"), ("tiktoken", "hf"), ("tiktoken", "fastokens"),
                 ("tiktoken", "tiktoken")]


@pytest.mark.parametrize("kind,backend", BACKEND_CASES)
def test_tokenize_equals_megatron_builder_under_each_backend(tmp_path, bpe_path, tiktoken_vocab, kind, backend):
    if backend != "hf":
        _need(backend)
    tokenizer = bpe_path if kind == "json" else tiktoken_vocab
    hf = tb.load_source(tokenizer).hf
    docs = _documents()
    src = tmp_path / "in.jsonl.gz"
    _write_jsonl(src, docs, gzip.open)
    eod = hf.token_to_id("<|endoftext|>")
    ref = str(tmp_path / "ref")
    ref_write(ref, _expected(hf, docs, eod), np.uint16)
    outs = []
    for workers, batch in ((1, 1000), (2, 3), (3, 1)):
        out = str(tmp_path / f"out{workers}")
        stats = tokenize(str(src), out, tokenizer, append_eod=True, workers=workers, batch_size=batch,
                         tokenizer_backend=backend)
        assert stats["backend"] == backend and stats["backend_note"] is None
        assert stats["documents"] == len(docs)
        outs.append(out)
    for out in outs:
        for ext in (".idx", ".bin"):
            assert Path(out + ext).read_bytes() == Path(ref + ext).read_bytes(), (out, ext)


@pytest.mark.parametrize("kind,backend", BACKEND_CASES)
def test_tokenize_equals_datatrove_step_under_each_backend(tmp_path, bpe_path, tiktoken_vocab, kind, backend):
    pytest.importorskip("datatrove", reason="datatrove is in the test extra (pip install -e '.[test]')")
    if backend != "hf":
        _need(backend)
    tokenizer = bpe_path if kind == "json" else tiktoken_vocab
    tok_file = str(tmp_path / "tokenizer.json")   # datatrove reads a tokenizer.json: the reference's
    Path(tok_file).write_text(tb.load_source(tokenizer).json, encoding="utf-8")
    docs = [d for d in _documents() if isinstance(d, str)]
    src, dt_prefix = run_datatrove(tmp_path, "dt", docs, tok_file, "<|endoftext|>")
    for workers in (1, 2):
        ours = str(tmp_path / f"ours{workers}")
        tokenize(src, ours, tokenizer, append_eod=True, eod_token="<|endoftext|>",
                 dtype_rule="datatrove", empty_text="datatrove", workers=workers, batch_size=5,
                 tokenizer_backend=backend)
        for ext in (".idx", ".bin"):
            assert Path(ours + ext).read_bytes() == Path(dt_prefix + ext).read_bytes(), (workers, ext)


def test_cli_backend_flags_and_a_tiktoken_file(tmp_path, bpe_path, tiktoken_file, tiktoken_vocab, capsys, fresh_choice):
    _need("tiktoken")
    docs = [d for d in _documents() if isinstance(d, str)]
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, docs)
    out = str(tmp_path / "tt")
    assert main(["megatron", "tokenize", str(src), "--tokenizer", tiktoken_file, "--tiktoken-pattern", CL100K_PATTERN,
                 "--output-prefix", out, "--tokenizer-backend", "tiktoken", "-q"]) == 0
    assert "tiktoken)" in capsys.readouterr().out
    ref = str(tmp_path / "ref")   # the same vocabulary without its special token: the same ids here
    tokenize(str(src), ref, tb.TiktokenVocab("v", tiktoken_vocab.ranks, CL100K_PATTERN), tokenizer_backend="hf")
    for ext in (".idx", ".bin"):
        assert Path(out + ext).read_bytes() == Path(ref + ext).read_bytes()
    with mm.open(out) as ds:
        assert ds.num_documents == len(docs)
    # auto's note on the command line: fastokens missing
    bert_like = tmp_path / "wordlevel.json"
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    t = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "[SEP]": 2}, unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer()
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.save(str(bert_like))
    if _installed("fastokens"):
        assert main(["megatron", "tokenize", str(src), "--tokenizer", str(bert_like), "--output-prefix",
                     str(tmp_path / "wp"), "-q"]) == 0
        captured = capsys.readouterr()
        assert "note: tokenizing with HF tokenizers: fastokens does not load" in captured.err
        assert "hf)" in captured.out


def _installed(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


# -- the reader ------------------------------------------------------------------------------------------
def _use_parser(parser: str, monkeypatch) -> None:
    """Make ``parser`` the JSON lines parser: msgspec (blocks), else orjson or json (line by line)."""
    if parser == "msgspec":
        _need("msgspec")
    else:
        monkeypatch.setattr(tokenize_module, "_msgspec", None)
    if parser == "orjson":
        _need("orjson", "test")   # an optional speed-up of the line-by-line parser; datatrove needs it
    if parser == "json":
        monkeypatch.setattr(tokenize_module, "_orjson", None)


@pytest.mark.parametrize("parser", ["msgspec", "orjson", "json"])
def test_block_reader_parsers_agree_and_name_the_line(tmp_path, monkeypatch, parser):
    _use_parser(parser, monkeypatch)
    lines = [json.dumps({"text": d, "id": k, "meta": {"x": [1, 2]}}) for k, d in enumerate(_documents())]
    lines[3:3] = ["", "   ", "\t"]
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join(lines) + "\r\n", encoding="utf-8")
    for read_bytes in (5, 4096, 1 << 20):
        monkeypatch.setattr(tokenize_module, "READ_BYTES", read_bytes)
        assert list(tokenize_module.iter_documents(str(p))) == _documents()
    bad = lines[:5] + ['{"text": 5}'] + lines[5:]
    p.write_text("\n".join(bad), encoding="utf-8")
    got = []
    with pytest.raises(mcf.FormatError) as ei:
        for d in tokenize_module.iter_documents(str(p)):
            got.append(d)
    assert ei.value.field == "line 6" and got == _documents()[:3]   # lines 4 and 5 are blank


@pytest.mark.parametrize("parser", ["msgspec", "orjson", "json"])
def test_a_lone_surrogate_in_json_is_a_format_error(tmp_path, monkeypatch, bpe_path, parser):
    """json.loads turns ``"\\ud800"`` into a str that is not Unicode text; without orjson and msgspec it
    reached the tokenizer, whose TypeError escaped ``tokenize``."""
    _use_parser(parser, monkeypatch)
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'{"text": "fine"}\n{"text": "a \\ud800 b"}\n')
    with pytest.raises(mcf.FormatError) as ei:
        tokenize(str(p), str(tmp_path / "out"), bpe_path, tokenizer_backend="hf")
    assert ei.value.field == "line 2" and ei.value.path == str(p)


def test_a_failing_read_ahead_thread_raises_in_the_reader(tmp_path, bpe_path):
    p = tmp_path / "in.jsonl.gz"
    data = gzip.compress(b"".join(json.dumps({"text": f"doc {k}"}).encode() + b"\n" for k in range(20000)))
    p.write_bytes(data[: len(data) // 2])    # truncated: the decompressing thread fails
    with pytest.raises(mcf.FormatError, match="corrupt compressed input"):
        tokenize(str(p), str(tmp_path / "out"), bpe_path)
    assert not (tmp_path / "out.idx").exists()


def test_token_ids_that_do_not_fit_the_dtype_are_refused(tmp_path, bpe_path):
    run = tokenize_module.batch_encoder(tb.HFBackend(tb.load_source(bpe_path).hf), False, 70000, np.uint16)
    with pytest.raises(mcf.InvalidArgumentError, match="does not fit uint16"):
        run(["some text"])


# -- Ray: the step uses the chosen backend ----------------------------------------------------------------
def test_ray_step_uses_the_chosen_backend(tmp_path, bpe_path, fresh_choice):
    pytest.importorskip("ray", reason="ray is in the ray extra")
    _need("fastokens")
    from mcf.conversion import raydata
    from mcf.conversion._chunks import describe_inputs, plan_chunks

    src = tmp_path / "in.jsonl"
    _write_jsonl(src, _documents())
    chunks = plan_chunks(describe_inputs([str(src)]), 1 << 20)
    tables = {}
    for backend in ("hf", "fastokens", "auto"):
        step = raydata.TokenizeStep(bpe_path, eod=0, dtype=np.uint16, batch_size=4, tokenizer_backend=backend)
        assert step.backend == ("fastokens" if backend == "auto" else backend)
        blocks = [b for c in chunks for b in raydata.read_chunk_blocks(c, "text", 7)]
        tables[backend] = [step(b).to_pydict() for b in blocks]
    assert tables["hf"] == tables["fastokens"] == tables["auto"]
