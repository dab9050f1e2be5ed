"""Interop with the real tools: Megatron-LM's compiled ``helpers_cpp`` (from the megatron-core wheel on
PyPI) for the sample index, its GPT index builders and sample assembly, and datatrove's Megatron
writer and tokenizer step."""

from __future__ import annotations

import json
import os
import types
import zlib
from pathlib import Path

import numpy as np
import pytest

import mcf
import mcf.megatron as mm
from _megatron_ref import load_megatron_oracle, ref_read, run_datatrove
from mcf.megatron import sample_index as si
from mcf.conversion.tokenize import tokenize


@pytest.fixture(scope="session")
def oracle(tmp_path_factory):
    try:
        return load_megatron_oracle(tmp_path_factory.mktemp("megatron-core-wheel"))
    except RuntimeError as exc:  # no PyPI access, no wheel for this Python, or one that does not load here
        pytest.skip(f"Megatron's helpers_cpp oracle unavailable: {exc}")


def _sizes(rng, kind: str, n: int) -> np.ndarray:
    if kind == "uniform":
        return rng.integers(1, 300, n).astype(np.int32)
    if kind == "zeros":
        s = rng.integers(0, 40, n).astype(np.int32)
        s[rng.random(n) < 0.3] = 0
        s[0] = max(int(s[0]), 1)
        return s
    if kind == "long":
        return rng.integers(1000, 5000, n).astype(np.int32)
    if kind == "tiny":
        return rng.integers(1, 4, n).astype(np.int32)
    raise AssertionError(kind)


CASES = [(kind, seq, epochs, drop, extra)
         for kind, seq in (("uniform", 64), ("uniform", 2), ("zeros", 17), ("long", 128), ("tiny", 1000),
                           ("uniform", 3000))
         for epochs in (1, 3)
         for drop in (True, False)
         for extra in (1, 0)]


@pytest.mark.parametrize("kind,seq,epochs,drop,extra", CASES)
def test_build_sample_idx_matches_helpers_cpp(oracle, kind, seq, epochs, drop, extra):
    rng = np.random.default_rng(zlib.crc32(repr((kind, seq, epochs, drop, extra)).encode()))  # stable seed
    sizes = _sizes(rng, kind, int(rng.integers(1, 400)))
    docs = oracle.build_document_index(np.arange(len(sizes)), epochs, np.random.RandomState(5), False)
    tpe = int(sizes.sum())
    assert epochs * tpe - extra >= 1, "the generated sizes must hold tokens"
    want = oracle.build_sample_idx(sizes, docs, seq, epochs, tpe, drop, extra)
    got = mm.build_sample_idx(sizes, docs, seq, epochs, tpe, drop, bool(extra))
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert np.array_equal(got, want)
    got64 = mm.build_sample_idx(sizes, docs, seq, epochs, tpe, drop, bool(extra), dtype=np.int64)
    want64 = oracle.helpers.build_sample_idx_int64(sizes, docs, seq, epochs, tpe, drop, extra)
    assert got64.dtype == np.int64 and np.array_equal(got64, want64)


def test_build_sample_idx_random_many(oracle):
    rng = np.random.default_rng(2024)
    for _ in range(60):
        n = int(rng.integers(1, 200))
        sizes = rng.integers(0, int(rng.integers(2, 600)), n).astype(np.int32)
        if sizes.sum() < 2:
            sizes[0] = 2
        subset = np.sort(rng.choice(n, int(rng.integers(1, n + 1)), replace=False))
        epochs = int(rng.integers(1, 4))
        docs = oracle.build_document_index(subset, epochs, np.random.RandomState(int(rng.integers(1 << 30))), False)
        tpe = int(sizes[subset].sum())
        if tpe < 2:
            continue
        seq = int(rng.integers(2, 700))
        drop = bool(rng.integers(2))
        extra = int(rng.integers(2))
        want = oracle.build_sample_idx(sizes, docs, seq, epochs, tpe, drop, extra)
        got = mm.build_sample_idx(sizes, docs, seq, epochs, tpe, drop, bool(extra))
        assert np.array_equal(got, want), (n, seq, epochs, drop, extra)


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("epochs", [1, 2, 4])
def test_document_and_shuffle_index_match_megatron(oracle, separate, epochs):
    docs = np.arange(3, 250, dtype=np.int64)
    want = oracle.build_document_index(docs, epochs, np.random.RandomState(77), separate)
    got = mm.build_document_index(docs, epochs, 77, separate)
    assert got.dtype == want.dtype == np.int32
    assert np.array_equal(got, want)
    for n, total in ((100, 100), (60, 100), (0, 5)):
        w = oracle.build_shuffle_index(n, total, np.random.RandomState(9))
        g = mm.build_shuffle_index(n, total, np.random.RandomState(9))
        assert g.dtype == w.dtype and np.array_equal(g, w)


def _megatron_gpt_indices(oracle, sizes, seq, num_samples, seed, extra, drop):
    """Megatron's GPTDataset._build_document_sample_shuffle_indices, step for step, on the oracle."""
    indices = np.arange(len(sizes))
    tpe = int(np.sum(sizes[indices]))
    num_epochs = 1
    if num_samples is not None:
        tokens, want = tpe, num_samples * seq + extra
        while tokens < want:
            num_epochs += 1
            tokens += tpe
    if num_epochs == 1:
        separate = False
    else:
        sans = ((num_epochs - 1) * tpe - extra) // seq
        from_final = num_samples - sans
        per_epoch = (tpe - extra) // seq
        separate = from_final < int(0.80 * per_epoch)
    rs = np.random.RandomState(seed)
    doc = oracle.build_document_index(indices, num_epochs, rs, separate)
    smp = oracle.build_sample_idx(sizes, doc, seq, num_epochs, tpe, drop, extra)
    if separate:
        shf = oracle.build_shuffle_index(sans, smp.shape[0] - 1, rs)
    else:
        shf = oracle.build_shuffle_index(smp.shape[0] - 1, smp.shape[0] - 1, rs)
    return doc, smp, shf


class _MegatronLikeReader:
    """The data access GPTDataset uses: ``get(idx, offset, length)`` on a numpy buffer (no bounds)."""

    def __init__(self, prefix):
        r = ref_read(prefix)
        self.r = r
        self.buf = np.fromfile(prefix + ".bin", np.uint8)

    def get(self, idx, offset=0, length=None):
        ln = int(self.r["lengths"][idx])
        if length is None:
            length = ln - offset
        ptr = int(self.r["pointers"][idx]) + offset * self.r["dtype"].itemsize
        return np.frombuffer(self.buf, dtype=self.r["dtype"], count=length, offset=ptr)


@pytest.mark.parametrize("num_samples,seq,extra,drop", [(None, 32, 1, True), (500, 32, 1, True),
                                                        (900, 50, 1, True), (300, 16, 0, True),
                                                        (None, 40, 1, False)])
def test_gpt_samples_match_megatron(oracle, tmp_path, num_samples, seq, extra, drop):
    rng = np.random.default_rng(seq)
    prefix = str(tmp_path / "gpt")
    with mm.Writer(prefix, dtype=np.uint16) as w:
        for _ in range(120):
            w.add_item(rng.integers(0, 65535, int(rng.integers(0, 90)), dtype=np.uint16))
            w.end_document()
    with mm.open(prefix) as ds:
        sizes = ds.sequence_lengths.copy()
        doc, smp, shf = _megatron_gpt_indices(oracle, sizes, seq, num_samples, 1234, extra, drop)
        samples = mm.GPTSamples(ds, seq, num_samples=num_samples, seed=1234, add_extra_token_to_sequence=bool(extra),
                                drop_last_partial_sequence=drop)
        assert np.array_equal(samples.document_index, doc)
        assert samples.sample_index.dtype == smp.dtype and np.array_equal(samples.sample_index, smp)
        assert samples.shuffle_index.dtype == shf.dtype and np.array_equal(samples.shuffle_index, shf)
        fake = types.SimpleNamespace(
            shuffle_index=shf, sample_index=smp, document_index=doc, dataset=_MegatronLikeReader(prefix),
            config=types.SimpleNamespace(add_extra_token_to_sequence=extra, sequence_length=seq), _pad_token_id=-1)
        for i in list(range(min(len(samples), 40))) + [len(samples) - 1]:
            text, ids = oracle.query_sample(fake, i)
            got = samples[i]
            assert got.dtype == np.int64 and len(got) == seq + extra
            assert np.array_equal(got, text), i
            assert np.array_equal(samples.document_ids(i), ids)


def test_sample_idx_rejects_what_megatron_reads_out_of_bounds(oracle):
    sizes = np.array([5, 7, 9], np.int32)
    with pytest.raises(mcf.OutOfBoundsError, match=r"document_idx\[1\] = 3"):
        mm.build_sample_idx(sizes, np.array([0, 3], np.int32), 4, 1, 14, True, True)
    with pytest.raises(mcf.InvalidArgumentError, match="exceeds what 2 documents"):
        mm.build_sample_idx(sizes, np.array([0, 1], np.int32), 4, 1, 100, True, True)
    # 12 tokens, 16 claimed
    with pytest.raises(mcf.InvalidArgumentError, match=r"run out in sample 2 of samples 0\.\.2"):
        mm.build_sample_idx(sizes, np.array([0, 1], np.int32), 4, 1, 16, True, True)
    with pytest.raises(mcf.InvalidArgumentError, match="run out"):
        mm.build_sample_idx(sizes, np.array([0, 1], np.int32), 4, 1, 16, False, True)
    with pytest.raises(mcf.InvalidArgumentError, match="seq_length"):
        mm.build_sample_idx(sizes, np.array([0, 1], np.int32), 1, 1, 12, True, True)
    with pytest.raises(mcf.InvalidArgumentError, match="does not fit"):
        mm.build_sample_idx(np.array([5, 2**31], np.int64), np.array([0], np.int32), 4, 1, 5, True, True)
    with pytest.raises(mcf.InvalidArgumentError, match=r"sizes\[1\] = -1 is negative"):
        mm.build_sample_idx(np.array([5, -1, 3], np.int32), np.array([0, 1, 2], np.int32), 4, 1, 12, True, True)
    assert si.num_epochs_for(None, 100, 10) == 1
    assert si.num_epochs_for(25, 100, 10) == 3


def test_oracle_so_is_for_this_python(oracle):
    import sys

    tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
    assert tag in os.path.basename(oracle.so_path)


# -- datatrove ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def datatrove():
    return pytest.importorskip("datatrove", reason="datatrove is in the test extra (pip install -e '.[test]')")


def _datatrove_documents(rng, n):
    docs = []
    for k in range(n):
        ln = int(rng.integers(1, 300)) if k % 7 else 0
        docs.append(rng.integers(0, 65536, ln).tolist())
    return docs


@pytest.mark.parametrize("token_size", [2, 4])
def test_our_writer_bytes_equal_datatrove(datatrove, tmp_path, token_size):
    from datatrove.pipeline.tokens.megatron_tokenizer import MegatronTokenizedFile

    rng = np.random.default_rng(token_size)
    docs = _datatrove_documents(rng, 200)
    f = MegatronTokenizedFile(str(tmp_path / "dt"), "shard", token_size=token_size)
    for d in docs:
        f.write(d)
    f.close()
    vocab = 65536 if token_size == 2 else 65537
    with mm.Writer(str(tmp_path / "ours"), vocab_size=vocab, dtype_rule="datatrove") as w:
        for d in docs:
            w.add_document(d, [len(d)])
    for ext in (".idx", ".bin"):
        assert (tmp_path / ("ours" + ext)).read_bytes() == (tmp_path / "dt" / ("shard" + ext)).read_bytes(), ext
    # bulk API, same bytes
    flat = np.concatenate([np.asarray(d, np.int64) for d in docs])
    with mm.Writer(str(tmp_path / "bulk"), vocab_size=vocab, dtype_rule="datatrove") as w:
        w.add_documents(flat, [len(d) for d in docs])
    assert (tmp_path / "bulk.idx").read_bytes() == (tmp_path / "ours.idx").read_bytes()
    # and we read datatrove's dataset token for token
    with mm.open(str(tmp_path / "dt" / "shard")) as ds:
        assert ds.verify() == []
        assert len(ds) == len(docs) and ds.num_documents == len(docs)
        for i, d in enumerate(docs):
            assert ds[i].tolist() == d


def _strip_inference_settings(src: str, dst: str) -> None:
    """A copy of tokenizer.json without the checkpoint's truncation/padding (datatrove keeps them;
    pretraining data wants every token)."""
    with open(src, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["truncation"] = None
    cfg["padding"] = None
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_dir):
    return os.path.join(minilm_dir, "tokenizer.json")


def _readme_docs(tokenizer_path):
    from mcf.apps.demo.megatron import readme_paragraphs

    return readme_paragraphs(os.path.dirname(tokenizer_path))


def test_tokenize_equals_datatrove_megatron_step(datatrove, tmp_path, minilm_tokenizer):
    docs = _readme_docs(minilm_tokenizer) * 3
    tok = str(tmp_path / "tokenizer.json")
    _strip_inference_settings(minilm_tokenizer, tok)
    src, dt_prefix = run_datatrove(tmp_path, "dt", docs, tok, "[SEP]")
    for workers in (1, 2):
        ours = str(tmp_path / f"ours{workers}")
        stats = tokenize(src, ours, minilm_tokenizer, append_eod=True,
                                     eod_token="[SEP]", dtype_rule="datatrove", workers=workers, batch_size=7)
        assert stats["documents"] == len(docs)
        for ext in (".idx", ".bin"):
            assert Path(ours + ext).read_bytes() == Path(dt_prefix + ext).read_bytes(), (workers, ext)
    with mm.open(dt_prefix) as ds:
        assert ds.verify() == [] and len(ds) == len(docs)


# Texts with nothing to tokenize, next to ordinary ones: an empty string (datatrove's reader drops it
# with a warning), whitespace only and a zero-width space (no token with this vocabulary).
EMPTY_TEXTS = ["Hello world.", "", "   ", "\u200b", "Second one.", "", "last"]


@pytest.mark.parametrize("eos", ["[SEP]", None])
def test_empty_texts_datatrove_rule_equals_datatrove(datatrove, tmp_path, minilm_tokenizer, eos):
    """``empty_text="datatrove"`` writes datatrove's bytes for texts without tokens: one sequence of
    just the EOS (an empty one without ``eos_token``), and no document at all for an empty string."""
    tok = str(tmp_path / "tokenizer.json")
    _strip_inference_settings(minilm_tokenizer, tok)
    if eos is None:  # datatrove then keeps the tokenizer's own post-processor: drop it, as ours does
        with open(tok, encoding="utf-8") as f:
            cfg = json.load(f)
        cfg["post_processor"] = None
        with open(tok, "w", encoding="utf-8") as f:
            json.dump(cfg, f)
    src, dt_prefix = run_datatrove(tmp_path, "dt", EMPTY_TEXTS, tok, eos)
    for workers, batch in ((1, 1000), (2, 2)):
        ours = str(tmp_path / f"ours{workers}")
        stats = tokenize(src, ours, tok, append_eod=eos is not None, eod_token=eos, dtype_rule="datatrove",
                         empty_text="datatrove", workers=workers, batch_size=batch)
        for ext in (".idx", ".bin"):
            assert Path(ours + ext).read_bytes() == Path(dt_prefix + ext).read_bytes(), (eos, workers, ext)
        assert stats["documents"] == len([t for t in EMPTY_TEXTS if t])
    from mcf.cli import main

    cli = str(tmp_path / "cli")
    argv = ["megatron", "tokenize", src, "--tokenizer", tok, "--output-prefix", cli, "--dtype-rule", "datatrove",
            "--empty-text", "datatrove", "-q"] + (["--append-eod", "--eod-token", eos] if eos else [])
    assert main(argv) == 0
    assert Path(cli + ".bin").read_bytes() == Path(dt_prefix + ".bin").read_bytes()
    assert Path(cli + ".idx").read_bytes() == Path(dt_prefix + ".idx").read_bytes()
    with mm.open(dt_prefix) as ds:
        lens = ds.sequence_lengths.tolist()
        assert len(ds) == ds.num_documents == 5            # the two "" were dropped
        assert lens[1:3] == ([1, 1] if eos else [0, 0])     # "   " and "\u200b": EOS alone, or empty
    # the default (Megatron's rule) differs exactly there: those texts are documents without sequences
    meg = str(tmp_path / "meg")
    tokenize(src, meg, tok, append_eod=eos is not None, eod_token=eos, dtype_rule="datatrove")
    with mm.open(meg) as ds, mm.open(dt_prefix) as dt:
        assert ds.num_documents == len(EMPTY_TEXTS) and len(ds) == 3
        assert [ds[i].tolist() for i in range(3)] == [dt[i].tolist() for i in (0, 3, 4)]


def test_empty_texts_datatrove_rule_with_sentence_lists(tmp_path, minilm_tokenizer):
    """Sentence lists keep Megatron's one-sequence-per-non-empty-sentence rule under either setting; an
    empty list is dropped with ``empty_text="datatrove"`` as an empty string is."""
    tok = str(tmp_path / "tokenizer.json")
    _strip_inference_settings(minilm_tokenizer, tok)
    src = tmp_path / "s.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for d in (["One.", "", "Two."], [], "   ", "", ["   "], "x"):
            f.write(json.dumps({"text": d}) + "\n")
    out = str(tmp_path / "o")
    tokenize(str(src), out, tok, append_eod=True, eod_token="[SEP]", empty_text="datatrove", batch_size=4)
    with mm.open(out) as ds:
        sep = ds[2].tolist()
        assert ds.document_indices.tolist() == [0, 2, 3, 3, 4]   # list, "   ", ["   "], "x"
        assert sep == [102] and ds[1].tolist()[-1] == 102 and ds[3].tolist()[-1] == 102
    with pytest.raises(mcf.InvalidArgumentError, match="empty_text"):
        tokenize(str(src), out, tok, empty_text="skip")
