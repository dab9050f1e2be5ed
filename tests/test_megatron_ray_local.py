"""The pieces of the Ray path, run in this process without a cluster: line-exact chunks, the tokenize
step, the Datasink's shards and commit checks, resuming, and the Megatron Datasource's read tasks.
(tests/test_megatron_ray.py runs them on a real multi-node cluster.)"""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mcf
import mcf.megatron as mm
from mcf.conversion._chunks import describe_inputs, iter_chunk_documents, plan_chunks
from mcf.megatron._shard_dir import (ShardRun, check_runs, commit_runs, complete_groups, remove_our_files,
                                     run_name, scan_runs)
from mcf.conversion.tokenize import eod_token_id, iter_documents, load_tokenizer
from mcf.conversion.tokenize import tokenize as tokenize_local

pa = pytest.importorskip("pyarrow", reason="Ray Data's blocks are Arrow tables (mcf-formats[ray])")
pytest.importorskip("ray.data", reason="Ray is an optional extra: pip install 'mcf-formats[ray]'")
pytest.importorskip("tokenizers", reason="tokenizers is in the test extra")
from mcf.conversion import raydata  # noqa: E402


def ray_data_context():
    import ray.data

    return ray.data.DataContext.get_current()


class Ctx:
    def __init__(self, task_idx=0):
        self.task_idx = task_idx


@pytest.fixture(scope="module")
def tok_path(minilm_dir):
    return os.path.join(minilm_dir, "tokenizer.json")


@pytest.fixture(scope="module")
def texts(minilm_dir):
    from mcf.apps.demo.megatron import readme_paragraphs

    paras = readme_paragraphs(minilm_dir)
    return paras + ["", "   ", "Grüße aus Köln — ünïcödé ✓", " ".join(paras)]


def write_jsonl(path, docs, key="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({key: d, "id": 1}) + "\n")


# -- chunks ---------------------------------------------------------------------------------------------
line_text = st.text(alphabet=st.sampled_from(list("ab c\r\t✓é") + ["\n"]), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(line_text, max_size=12), st.booleans(), st.integers(1, 50))
def test_chunks_hold_every_line_once_in_order(tmp_path_factory, lines, trailing, size):
    d = tmp_path_factory.mktemp("c")
    p = d / "in.txt"
    body = "\n".join(lines) + ("\n" if trailing and lines else "")
    p.write_bytes(body.encode())
    want = list(iter_documents(str(p)))
    chunks = plan_chunks(describe_inputs([str(p)]), size)
    got = [doc for c in chunks for doc in iter_chunk_documents(c)]
    assert got == want
    assert all(c.stop is None or c.stop - c.start <= size for c in chunks)


def test_chunks_of_jsonl_with_lists_and_blank_lines(tmp_path):
    docs = ["alpha", ["one", "two", ""], "", "x" * 3000, ["z"], "ünï ✓"]
    p = tmp_path / "in.jsonl"
    write_jsonl(p, docs)
    raw = p.read_bytes().replace(b"\n", b"\n\n   \n", 2)   # blank and whitespace lines between documents
    p.write_bytes(raw)
    for size in (1, 7, 100, 1 << 20):
        chunks = plan_chunks(describe_inputs([str(p)]), size)
        assert [d for c in chunks for d in iter_chunk_documents(c, "text")] == docs


def test_compressed_inputs_are_one_chunk(tmp_path):
    write_jsonl(tmp_path / "a.jsonl.gz", ["a", "b"], opener=gzip.open)
    zstd = pytest.importorskip("zstandard", reason="zstd inputs need zstandard (test extra)")
    (tmp_path / "b.jsonl").write_bytes(zstd.ZstdCompressor().compress(b'{"text": "c"}\n'))
    (tmp_path / "e.txt").write_bytes(b"")
    files = describe_inputs([tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl", tmp_path / "e.txt"])
    assert [f.compressed for f in files] == [True, True, False]
    chunks = plan_chunks(files, 1)
    assert [(c.input, c.stop) for c in chunks] == [(0, None), (1, None), (2, None)]
    assert [list(iter_chunk_documents(c)) for c in chunks] == [["a", "b"], ["c"], []]


def test_a_bad_line_names_the_input_and_where(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "ok"}\n' * 20 + b"not json\n" + b'{"text": "ok"}\n' * 5)
    chunks = plan_chunks(describe_inputs([str(p)]), 100)
    with pytest.raises(mcf.FormatError, match=r"bad.jsonl: line \d+ after byte \d+: invalid JSON"):
        for c in chunks:
            list(iter_chunk_documents(c))
    with pytest.raises(mcf.MissingFileError):
        describe_inputs([tmp_path / "missing.jsonl"])
    with pytest.raises(mcf.InvalidArgumentError):
        plan_chunks(describe_inputs([str(p)]), 0)


# -- the whole pipeline, in this process ------------------------------------------------------------------
def run_pipeline(tmp_path, inputs, tok, *, chunk_size, json_key="text", append_eod=False, special=False,
                 dtype_rule="megatron", batch=3, seed=0, merge=True, step_batch=1000, empty_text="megatron"):
    """What raydata.tokenize does on a cluster, with the tasks run here in a shuffled order."""
    t = load_tokenizer(tok)
    eod = eod_token_id(t) if append_eod else None
    dtype = mm.dtype_for_vocab(t.get_vocab_size(with_added_tokens=True), dtype_rule)
    step = raydata.TokenizeStep(t, add_special_tokens=special, eod=eod, dtype=dtype, batch_size=step_batch,
                                empty_text=empty_text)
    chunks = plan_chunks(describe_inputs(inputs), chunk_size)
    sink = raydata.MegatronDatasink(tmp_path / "shards", dtype=dtype, order=("group", "position"), durable=False)
    tasks = raydata.TextDatasource(chunks, json_key=json_key, batch_size=batch,
                                   drop_empty=empty_text == "datatrove").get_read_tasks(8)
    order = list(range(len(tasks)))
    random.Random(seed).shuffle(order)
    runs = []
    for k in order:
        runs += [ShardRun.from_dict(x) for x in sink.write([step(b) for b in tasks[k]()], Ctx(k))]
    return commit_runs(str(tmp_path / "shards"), runs, output_prefix=str(tmp_path / "out"), dtype=dtype, merge=merge,
                       expected_groups=[c.index for c in chunks])


def same_files(a, b):
    return all(Path(a + ext).read_bytes() == Path(b + ext).read_bytes() for ext in (".idx", ".bin"))


@pytest.mark.parametrize("opts", [
    dict(append_eod=True),
    dict(append_eod=False, special=True),
    dict(append_eod=True, dtype_rule="datatrove", json_key="content"),
    dict(append_eod=True, empty_text="datatrove"),
    dict(append_eod=False, empty_text="datatrove", special=True),
])
def test_pipeline_equals_single_process(tmp_path, tok_path, texts, opts):
    key = opts.get("json_key", "text")
    docs = texts + [[texts[0], "", texts[1]], []] + texts[:3]
    write_jsonl(tmp_path / "a.jsonl", docs, key=key)
    write_jsonl(tmp_path / "b.jsonl.gz", texts[:4], key=key, opener=gzip.open)
    (tmp_path / "c.txt").write_text("\n".join(texts[:5]) + "\n\n  \n", encoding="utf-8")
    inputs = [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl.gz", "c.txt")]
    tokenize_local(inputs, str(tmp_path / "ref"), tok_path, json_key=key, append_eod=opts["append_eod"],
                   add_special_tokens=opts.get("special", False), dtype_rule=opts.get("dtype_rule", "megatron"),
                   empty_text=opts.get("empty_text", "megatron"))
    # blocks smaller and larger than the tokenize step's batches (Ray may merge read blocks)
    for seed, size, batch, step_batch in ((0, 300, 3, 1000), (1, 1 << 20, 50, 2), (2, 41, 1, 1)):
        res = run_pipeline(tmp_path, inputs, tok_path, chunk_size=size, seed=seed, batch=batch,
                           step_batch=step_batch, **opts)
        assert same_files(str(tmp_path / "out"), str(tmp_path / "ref")), (seed, size)
        assert not (tmp_path / "shards").exists()          # merged: the shard directory is gone
        with mm.open(str(tmp_path / "ref")) as r:
            assert res["documents"] == r.num_documents and res["tokens"] == r.num_tokens


def test_shard_list_output_reads_as_the_merged_dataset(tmp_path, tok_path, texts):
    write_jsonl(tmp_path / "a.jsonl", texts * 3)
    tokenize_local(str(tmp_path / "a.jsonl"), str(tmp_path / "ref"), tok_path, append_eod=True)
    res = run_pipeline(tmp_path, [str(tmp_path / "a.jsonl")], tok_path, chunk_size=500, append_eod=True, merge=False)
    assert res["output"] == str(tmp_path / "out") + ".shards.json"
    with mm.open(res["output"]) as s, mm.open(str(tmp_path / "ref")) as r:
        assert s.num_shards > 1 and len(s) == len(r) and s.num_documents == r.num_documents
        assert all(s[i].tolist() == r[i].tolist() for i in range(len(r)))
        assert s.document_indices.tolist() == r.document_indices.tolist()
    mm.merge(str(tmp_path / "m"), [sh.prefix for sh in mm.open(res["output"]).shards])
    with mm.open(str(tmp_path / "m")) as m, mm.open(str(tmp_path / "ref")) as r:
        assert m.document_indices[-1] == r.document_indices[-1]


# -- the sink and the commit checks -----------------------------------------------------------------------
def token_table(group, positions, docs, ends=()):
    """Rows of (group, position, end, tokens) for documents ``docs`` (lists of ids) at ``positions``."""
    tokens = list(docs) + [None] * len(ends)
    return pa.table({"group": pa.array([group] * len(tokens), pa.int64()),
                     "position": pa.array(list(positions) + list(ends), pa.int64()),
                     "end": pa.array([False] * len(docs) + [True] * len(ends)),
                     "tokens": pa.array(tokens, pa.large_list(pa.uint16()))})


def test_sink_orders_rows_and_names_shards_by_range(tmp_path):
    sink = raydata.MegatronDatasink(tmp_path / "s", dtype=np.uint16, order=("group", "position"), lengths=None,
                                    durable=False)
    # one task holding two groups, rows out of order, the end marker of group 1 in another block
    b1 = token_table(1, [2, 0], [[5, 6], [1]])
    b2 = token_table(0, [0], [[9]], ends=[1])
    b3 = token_table(1, [1], [[]], ends=[3])
    runs = [ShardRun.from_dict(x) for x in sink.write([b1, b2, b3], Ctx())]
    assert [r.name for r in runs] == [run_name(0, 0, 1, True), run_name(1, 0, 3, True)]
    res = commit_runs(str(tmp_path / "s"), runs, output_prefix=str(tmp_path / "o"), dtype=np.uint16,
                      expected_groups=[0, 1])
    with mm.open(str(tmp_path / "o")) as ds:
        assert [ds.document(k).tolist() for k in range(ds.num_documents)] == [[9], [1], [], [5, 6]]
        assert len(ds) == 3 and res["documents"] == 4   # the empty document has no sequence (empty="skip")


def test_sink_refuses_duplicates_and_rows_past_the_end(tmp_path):
    sink = raydata.MegatronDatasink(tmp_path / "s", dtype=np.uint16, order=("group", "position"), durable=False)
    with pytest.raises(mcf.InvalidArgumentError, match="appears twice"):
        sink.write([token_table(0, [0, 0], [[1], [2]])], Ctx())
    with pytest.raises(mcf.InvalidArgumentError, match="after its end marker"):
        sink.write([token_table(0, [0, 2], [[1], [2]], ends=[1])], Ctx())
    with pytest.raises(mcf.InvalidArgumentError, match=">= 0"):
        sink.write([token_table(0, [-1], [[1]])], Ctx())


def R(group, first, stop, end=False, documents=None):
    docs = stop - first if documents is None else documents
    return ShardRun(run_name(group, first, stop, end), group, first, stop, end, docs, docs, docs)


def test_commit_checks():
    ok = [R(0, 0, 3), R(0, 3, 5, True), R(1, 0, 0, True)]
    assert [r.name for r in check_runs(list(reversed(ok)), expected_groups=[0, 1])] == [r.name for r in ok]
    with pytest.raises(mcf.FormatError, match="written twice"):
        check_runs(ok + [R(0, 2, 4)])            # a retried task that split its rows differently
    with pytest.raises(mcf.FormatError, match=r"missing documents \[3, 4\)"):
        check_runs([R(0, 0, 3), R(0, 4, 5, True)])
    with pytest.raises(mcf.FormatError, match="missing documents some of"):
        check_runs([R(0, 0, 5, True, documents=4)])
    with pytest.raises(mcf.FormatError, match="no end marker"):
        check_runs([R(0, 0, 3)], expected_groups=[0])
    with pytest.raises(mcf.FormatError, match="unexpected groups"):
        check_runs(ok + [R(7, 0, 1, True)], expected_groups=[0, 1])
    with pytest.raises(mcf.FormatError, match="past its end marker"):
        check_runs([R(0, 0, 2, True), R(0, 2, 3)])
    assert set(complete_groups(ok + [R(2, 0, 3)])) == {0, 1}


def test_resume_scan_keeps_complete_groups_and_cleans_ours(tmp_path):
    d = tmp_path / "s"
    sink = raydata.MegatronDatasink(d, dtype=np.uint16, order=("group", "position"), durable=False)
    sink.write([token_table(0, [0, 1], [[1], [2]], ends=[2])], Ctx())
    sink.write([token_table(1, [0], [[3]])], Ctx())                      # group 1 unfinished
    (d / ".g000000000002-000000000000-000000000001.bin.77.abcd.tmp").write_bytes(b"x")   # a killed writer's
    (d / "notes.txt").write_text("not ours")
    runs = scan_runs(str(d))
    assert sorted(r.name for r in runs) == [run_name(0, 0, 2, True), run_name(1, 0, 1, False)]
    done = complete_groups(runs)
    assert list(done) == [0]
    remove_our_files(str(d), keep={r.name for rs in done.values() for r in rs})
    assert sorted(os.listdir(d)) == sorted([run_name(0, 0, 2, True) + ".bin", run_name(0, 0, 2, True) + ".idx",
                                            "notes.txt"])
    # a damaged shard is not trusted
    Path(str(d / run_name(0, 0, 2, True)) + ".bin").write_bytes(b"\x00")
    with pytest.raises(mcf.MCFError):
        scan_runs(str(d))


def test_sink_by_task_and_empty_policy(tmp_path):
    sink = raydata.MegatronDatasink(tmp_path / "s", dtype=np.uint16, lengths=None, empty="sequence", durable=False,
                                    output_prefix=str(tmp_path / "o"))
    t1 = pa.table({"tokens": pa.array([[1, 2], []], pa.large_list(pa.int64()))})
    t0 = pa.table({"tokens": pa.array([[7]], pa.list_(pa.int32()))})
    runs = [ShardRun.from_dict(x) for x in sink.write([t1], Ctx(1)) + sink.write([t0], Ctx(0))]
    assert [r.name for r in runs] == ["t000001", "t000000"]
    res = commit_runs(str(tmp_path / "s"), runs, output_prefix=str(tmp_path / "o"), dtype=np.uint16)
    with mm.open(res["output"]) as ds:
        assert [ds[i].tolist() for i in range(len(ds))] == [[7], [1, 2], []]     # task order; empty="sequence"
    with pytest.raises(mcf.InvalidArgumentError, match="does not fit"):
        sink.write([pa.table({"tokens": pa.array([[70000]], pa.list_(pa.int64()))})], Ctx(2))


# -- reading Megatron datasets ------------------------------------------------------------------------
def build(tmp_path, name, docs):
    p = str(tmp_path / name)
    with mm.Writer(p, dtype=np.uint16, durable=False) as w:
        for lens in docs:
            w.add_document(np.arange(sum(lens), dtype=np.int64) % 1000, lens)
    return p


@pytest.mark.parametrize("parallelism", [1, 2, 3, 7, 50])
def test_datasource_tasks_cover_every_sequence_once_on_document_boundaries(tmp_path, parallelism):
    a = build(tmp_path, "a", [[3, 1, 2], [4], [1, 1]])
    b = build(tmp_path, "b", [])
    c = build(tmp_path, "c", [[2], [5, 5, 5, 5], [1]])
    src = raydata.MegatronDatasource([a, b, c], block_sequences=2)
    tables = [t for task in src.get_read_tasks(parallelism) for t in task()]
    rows = pa.concat_tables(tables)
    with mm.open([a, b, c]) as view:
        assert rows.column("sequence").to_pylist() == list(range(len(view)))
        assert [np.asarray(x).tolist() for x in rows.column("tokens").to_pylist()] == [v.tolist() for v in view]
        di = view.document_indices
        assert rows.column("document").to_pylist() == (np.searchsorted(di, np.arange(len(view)), "right") - 1).tolist()
    # no document is split between two read tasks
    for task in src.get_read_tasks(parallelism):
        blocks = list(task())
        if blocks:
            got = pa.concat_tables(blocks)
            seqs = got.column("sequence").to_pylist()
            docs = got.column("document").to_pylist()
            first_doc, last_doc = docs[0], docs[-1]
            assert seqs[0] == int(di[first_doc]) and seqs[-1] + 1 == int(di[last_doc + 1])


def test_datasource_to_sink_round_trip(tmp_path):
    a = build(tmp_path, "a", [[3, 1, 2], [4], [], [1, 1]])
    c = build(tmp_path, "c", [[2], [5, 5, 5, 5], [1]])
    mm.merge(str(tmp_path / "ref"), [a, c])
    src = raydata.MegatronDatasource([a, c], block_sequences=3)
    sink = raydata.MegatronDatasink(tmp_path / "s", dtype=np.uint16, order="sequence", document="document",
                                    durable=False)
    runs = []
    tasks = src.get_read_tasks(3)
    for k in (2, 0, 1):
        runs += [ShardRun.from_dict(x) for x in sink.write(list(tasks[k]()), Ctx(k))]
    res = commit_runs(str(tmp_path / "s"), runs, output_prefix=str(tmp_path / "o"), dtype=np.uint16)
    with mm.open(res["output"]) as o, mm.open(str(tmp_path / "ref")) as r:
        # documents without sequences cannot travel as sequence rows; every other document does
        assert [o.document(k).tolist() for k in range(o.num_documents)] == \
            [r.document(k).tolist() for k in range(r.num_documents) if len(r.document_sequences(k))]
        assert o.sequence_lengths.tolist() == r.sequence_lengths.tolist()


def test_datasource_refuses_a_damaged_range(tmp_path):
    a = build(tmp_path, "a", [[3, 1, 2], [4]])
    raw = bytearray(Path(a + ".idx").read_bytes())
    raw[34 + 4:34 + 8] = (-5).to_bytes(4, "little", signed=True)       # sequence 1's length
    Path(a + ".idx").write_bytes(bytes(raw))
    src = raydata.MegatronDatasource(a)
    with pytest.raises(mcf.FormatError, match="negative sequence length"):
        for task in src.get_read_tasks(1):
            list(task())


def test_url_inputs(tmp_path, tok_path, texts):
    """Inputs named by fsspec URLs are read by range (plain) or whole (compressed), as local files are."""
    fsspec = pytest.importorskip("fsspec", reason="URL inputs need fsspec (the remote extra)")
    write_jsonl(tmp_path / "a.jsonl", texts * 2)
    write_jsonl(tmp_path / "b.jsonl.gz", texts[:3], opener=gzip.open)
    tokenize_local([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl.gz")], str(tmp_path / "ref"), tok_path,
                   append_eod=True)
    mem = fsspec.filesystem("memory")
    urls = []
    for n in ("a.jsonl", "b.jsonl.gz"):
        mem.pipe(f"/i16test/{n}", (tmp_path / n).read_bytes())
        urls.append(f"memory:///i16test/{n}")
    try:
        files = describe_inputs(urls)
        assert [f.compressed for f in files] == [False, True] and files[0].size == (tmp_path / "a.jsonl").stat().st_size
        run_pipeline(tmp_path, urls, tok_path, chunk_size=400, append_eod=True)
        assert same_files(str(tmp_path / "out"), str(tmp_path / "ref"))
        with pytest.raises(mcf.MissingFileError):
            describe_inputs(["memory:///i16test/none.jsonl"])
    finally:
        mem.rm("/i16test", recursive=True)


def test_sink_takes_rays_tensor_columns(tmp_path):
    """map_batches returning numpy arrays gives Ray's tensor extension columns (variable or fixed shape)."""
    import warnings

    from ray.data.block import BlockAccessor

    with warnings.catch_warnings():   # Ray 2.60 warns about its own deprecated options when it makes its context
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"ray\.data\.")
        ray_data_context()
    var = BlockAccessor.batch_to_block({"position": np.array([2, 0, 1]), "tokens": [
        np.array([5, 6, 7], np.int32), np.array([1, 2], np.int32), np.array([], np.int32)]})
    fixed = BlockAccessor.batch_to_block({"position": np.array([3, 4]),
                                          "tokens": [np.array([8, 9]), np.array([10, 11])]})
    assert all(isinstance(b.schema.field("tokens").type, pa.ExtensionType) for b in (var, fixed))
    sink = raydata.MegatronDatasink(tmp_path / "s", vocab_size=32000, order="position", durable=False,
                                    output_prefix=str(tmp_path / "o"))
    runs = [ShardRun.from_dict(x) for x in sink.write([fixed], Ctx(1)) + sink.write([var], Ctx(0))]
    res = commit_runs(str(tmp_path / "s"), runs, output_prefix=str(tmp_path / "o"), dtype=sink.dtype)
    with mm.open(res["output"]) as ds:
        assert ds.dtype == np.uint16 and ds.num_documents == 5
        assert [ds.document(k).tolist() for k in range(5)] == [[1, 2], [], [5, 6, 7], [8, 9], [10, 11]]
    # interleaved keys of two tasks cannot be put in order: refused, not silently misordered
    sink2 = raydata.MegatronDatasink(tmp_path / "s2", vocab_size=32000, order="position", durable=False)
    t = lambda pos: pa.table({"position": pa.array(pos, pa.int64()),  # noqa: E731
                              "tokens": pa.array([[1]] * len(pos), pa.list_(pa.int64()))})
    runs = [ShardRun.from_dict(x) for x in sink2.write([t([0, 2])], Ctx(0)) + sink2.write([t([1, 3])], Ctx(1))]
    with pytest.raises(mcf.FormatError, match="interleave"):
        commit_runs(str(tmp_path / "s2"), runs, output_prefix=str(tmp_path / "o2"), dtype=sink2.dtype)
    assert not (tmp_path / "o2.idx").exists()


def test_prepare_reuses_finished_chunks_and_starts_over_on_change(tmp_path):
    from mcf.megatron._shard_dir import PLAN_FILE

    src = tmp_path / "a.txt"
    src.write_text("one\ntwo\nthree\nfour\n")
    d = str(tmp_path / "shards")
    os.makedirs(d)
    files = describe_inputs([str(src)])
    opts = {"version": 1, "json_key": "text", "inputs": [[f.path, f.fingerprint] for f in files]}
    chunks, kept = raydata.prepare_shard_dir(d, files, opts, 5)
    assert len(chunks) == 4 and kept == [] and os.path.exists(os.path.join(d, PLAN_FILE))
    sink = raydata.MegatronDatasink(d, dtype=np.uint16, order=("group", "position"), durable=False)
    sink.write([token_table(0, [0], [[1]], ends=[1])], Ctx())           # chunk 0 finished
    sink.write([token_table(2, [0], [[3]])], Ctx())                     # chunk 2 begun, not finished
    again, kept = raydata.prepare_shard_dir(d, files, opts, None)      # the same job: the stored plan
    assert again == chunks and [r.name for r in kept] == [run_name(0, 0, 1, True)]
    assert sorted(os.listdir(d)) == sorted([PLAN_FILE, run_name(0, 0, 1, True) + ".bin",
                                            run_name(0, 0, 1, True) + ".idx"])
    # another chunk size, changed options, a changed input, or resume=False: start over
    for change in (dict(chunk_size=7), dict(options=dict(opts, json_key="content")), dict(resume=False)):
        sink.write([token_table(0, [0], [[1]], ends=[1])], Ctx())
        _, kept = raydata.prepare_shard_dir(d, files, change.get("options", opts), change.get("chunk_size", None),
                                            resume=change.get("resume", True))
        assert kept == [] and [n for n in os.listdir(d) if n.endswith(".idx")] == [], change
    src.write_text("one\ntwo\nthree\nfour\nfive\n")
    files2 = describe_inputs([str(src)])
    sink.write([token_table(0, [0], [[1]], ends=[1])], Ctx())
    opts2 = dict(opts, inputs=[[f.path, f.fingerprint] for f in files2])
    chunks2, kept = raydata.prepare_shard_dir(d, files2, opts2, None)
    assert kept == [] and len(chunks2) == 1      # no stored plan matches: one chunk (no cluster: 1 CPU)


def test_empty_inputs_give_an_empty_dataset(tmp_path, tok_path):
    (tmp_path / "e.jsonl").write_bytes(b"")
    (tmp_path / "f.txt").write_bytes(b"\n \n")
    inputs = [str(tmp_path / "e.jsonl"), str(tmp_path / "f.txt")]
    tokenize_local(inputs, str(tmp_path / "ref"), tok_path)
    res = run_pipeline(tmp_path, inputs, tok_path, chunk_size=1)
    assert res["documents"] == 0 and same_files(str(tmp_path / "out"), str(tmp_path / "ref"))


def test_datasource_reads_urls(tmp_path):
    fsspec = pytest.importorskip("fsspec", reason="URL reads need fsspec (the remote extra)")
    a = build(tmp_path, "a", [[3, 1, 2], [4], [1, 1]])
    mem = fsspec.filesystem("memory")
    for ext in (".idx", ".bin"):
        mem.pipe("/i16src/a" + ext, Path(a + ext).read_bytes())
    try:
        src = raydata.MegatronDatasource("memory:///i16src/a")
        rows = pa.concat_tables([t for task in src.get_read_tasks(2) for t in task()])
        with mm.open(a) as ds:
            assert [np.asarray(x).tolist() for x in rows.column("tokens").to_pylist()] == [v.tolist() for v in ds]
            assert rows.column("document").to_pylist() == [0, 0, 0, 1, 2, 2]
    finally:
        mem.rm("/i16src", recursive=True)


def test_one_job_per_shard_directory(tmp_path):
    from mcf.megatron._shard_dir import DirectoryLock

    with DirectoryLock(str(tmp_path / "s")):
        with pytest.raises(mcf.InvalidArgumentError, match="another job"):
            DirectoryLock(str(tmp_path / "s"))
    DirectoryLock(str(tmp_path / "s")).release()          # free again once the first job is done
