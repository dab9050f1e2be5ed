"""Importance matrices (mcf.conversion.imatrix): llama.cpp's GGUF format written and read (checked with gguf-py, an
independent reader and writer), the legacy .dat format, malformed files, the BERT collector against
transformers' own modules, and the command line."""

import struct
import subprocess
import sys

import numpy as np
import pytest

import mcf
from mcf.cli import main as cli_main
from mcf.conversion.imatrix import ImportanceCollector, read_imatrix, write_imatrix

gguf = pytest.importorskip("gguf", reason="gguf-py reads and writes the GGUF imatrix files independently")


def collector(rng):
    col = ImportanceCollector()
    for _ in range(3):
        col.add("blk.0.attn_q.weight", rng.standard_normal((7, 64)).astype(np.float32))
        col.add("blk.0.ffn_down.weight", rng.standard_normal((5, 96)).astype(np.float32) * 3)
    return col


def test_write_read_round_trip(tmp_path):
    col = collector(np.random.default_rng(1))
    p = tmp_path / "m.imatrix.gguf"
    col.write(p, datasets=["calib.txt"], chunk_count=3, chunk_size=128)
    got = read_imatrix(p)
    want = col.means()
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n].dtype == np.float32 and got[n].shape == want[n].shape
        np.testing.assert_allclose(got[n], want[n], rtol=1e-6)
    assert col.counts == {"blk.0.attn_q.weight": 21, "blk.0.ffn_down.weight": 15}


def test_our_file_read_by_gguf_py(tmp_path):
    col = collector(np.random.default_rng(2))
    p = tmp_path / "m.gguf"
    col.write(p, datasets=["a.txt", "b.txt"], chunk_count=6, chunk_size=64)
    r = gguf.GGUFReader(str(p))
    f = r.fields
    assert f["general.type"].contents() == "imatrix"
    assert f["imatrix.datasets"].contents() == ["a.txt", "b.txt"]
    assert f["imatrix.chunk_count"].contents() == 6 and f["imatrix.chunk_size"].contents() == 64
    tensors = {t.name: t for t in r.tensors}
    assert sorted(tensors) == sorted([n + s for n in col.sums for s in (".in_sum2", ".counts")])
    for n, s in col.sums.items():
        t = tensors[n + ".in_sum2"]
        assert list(t.shape) == [s.shape[0], 1] and t.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_allclose(np.asarray(t.data).reshape(-1), s.astype(np.float32))
        assert float(np.asarray(tensors[n + ".counts"].data).reshape(-1)[0]) == col.counts[n]


def write_llama_style(path, entries, general_type="imatrix"):
    """A GGUF imatrix as llama-imatrix writes it (in_sum2 + in_sum + counts, [n, n_mat]), by gguf-py."""
    w = gguf.GGUFWriter(str(path), arch="")
    w.kv_data[0].pop("general.architecture", None)  # an imatrix has no architecture
    w.add_string("general.type", general_type)
    w.add_array("imatrix.datasets", ["wiki.train.raw"])
    w.add_uint32("imatrix.chunk_count", 10)
    w.add_uint32("imatrix.chunk_size", 512)
    for name, (sum2, counts) in entries.items():
        sum2 = np.asarray(sum2, np.float32).reshape(len(counts), -1)
        w.add_tensor(name + ".in_sum", np.sqrt(sum2))
        w.add_tensor(name + ".in_sum2", sum2)
        w.add_tensor(name + ".counts", np.asarray(counts, np.float32).reshape(len(counts), 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_read_llama_cpp_gguf(tmp_path):
    p = tmp_path / "llama.imatrix.gguf"
    rng = np.random.default_rng(3)
    dense = rng.random(32) * 100
    experts = rng.random((4, 16)) * 10
    write_llama_style(p, {"blk.0.attn_k.weight": (dense, [50.0]),
                          "blk.0.ffn_up_exps.weight": (experts, [5.0, 0.0, 2.0, 1.0])})
    got = read_imatrix(p)
    np.testing.assert_allclose(got["blk.0.attn_k.weight"], (dense.astype(np.float32) / 50).astype(np.float32),
                               rtol=1e-6)
    e = got["blk.0.ffn_up_exps.weight"]
    assert e.shape == (4, 16) and (e[1] == 0).all()  # an expert never routed to: no information
    np.testing.assert_allclose(e[2], experts[2].astype(np.float32) / 2, rtol=1e-6)
    write_llama_style(tmp_path / "model.gguf", {"x": (dense, [1.0])}, general_type="model")
    with pytest.raises(mcf.FormatError, match="general.type"):
        read_imatrix(tmp_path / "model.gguf")


def legacy_bytes(entries, trailer=True):
    out = [struct.pack("<i", len(entries))]
    for name, (ncall, vals) in entries.items():
        b = name.encode()
        v = np.asarray(vals, "<f4")
        out += [struct.pack("<i", len(b)), b, struct.pack("<ii", ncall, v.size), v.tobytes()]
    if trailer:
        out += [struct.pack("<ii", 7, 9), b"calib.txt"]
    return b"".join(out)


def test_read_legacy_dat(tmp_path):
    p = tmp_path / "old.dat"
    p.write_bytes(legacy_bytes({"blk.0.attn_v.weight": (4, [4.0, 8.0, 0.0]), "output.weight": (0, [1.5, 2.5])}))
    got = read_imatrix(p)
    assert got["blk.0.attn_v.weight"].tolist() == [1.0, 2.0, 0.0]  # stored as mean * ncall
    assert got["output.weight"].tolist() == [1.5, 2.5]
    p.write_bytes(legacy_bytes({"a": (1, [1.0])}, trailer=False))
    assert read_imatrix(p)["a"].tolist() == [1.0]


@pytest.mark.parametrize("data, match", [
    (b"", "n_entries"),
    (struct.pack("<i", 0), "not an importance matrix"),
    (struct.pack("<i", 1) + struct.pack("<i", 100) + b"ab", "name length"),
    (struct.pack("<i", 1) + struct.pack("<i", 1) + b"a" + struct.pack("<ii", 1, 1000) + b"\0" * 8, "value count"),
    (struct.pack("<i", 1) + struct.pack("<i", 1) + b"a" + struct.pack("<ii", 1, -3), "value count"),
    (struct.pack("<i", 1) + struct.pack("<i", 1) + b"a" + struct.pack("<ii", 1, 1) + struct.pack("<f", np.nan),
     "finite"),
    (struct.pack("<i", 1) + struct.pack("<i", 1) + b"a" + struct.pack("<ii", 1, 1) + struct.pack("<f", -1.0),
     "finite"),
    (struct.pack("<i", 2) + (struct.pack("<i", 1) + b"a" + struct.pack("<ii", 1, 1) + struct.pack("<f", 1.0)) * 2,
     "duplicate"),
    (struct.pack("<i", 1) + struct.pack("<i", 1) + b"a" + struct.pack("<ii", 1, 1) + struct.pack("<f", 1.0) + b"xyz",
     "ends inside"),
    (struct.pack("<i", 1) + struct.pack("<i", 2) + b"\xff\xfe" + struct.pack("<ii", 1, 1) + b"\0" * 4, "UTF-8"),
    (b"GGUF" + b"\0" * 8, None),
])
def test_malformed_files(tmp_path, data, match):
    p = tmp_path / "bad.imatrix"
    p.write_bytes(data)
    with pytest.raises(mcf.FormatError, match=match):
        read_imatrix(p)


def test_gguf_without_counts_or_entries(tmp_path):
    p = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(p), arch="")
    w.add_string("general.type", "imatrix")
    w.add_tensor("a.in_sum2", np.ones((1, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(mcf.FormatError, match="counts"):
        read_imatrix(p)
    write_imatrix(p, {}, {})
    with pytest.raises(mcf.FormatError, match="no importance entries"):
        read_imatrix(p)


def test_collector_checks_shapes():
    col = ImportanceCollector()
    col.add("w", np.ones((2, 3), np.float32))
    with pytest.raises(mcf.InvalidArgumentError, match="columns"):
        col.add("w", np.ones((2, 4), np.float32))
    with pytest.raises(mcf.InvalidArgumentError, match="tokens, columns"):
        col.add("v", np.ones(3, np.float32))


TEXT = ("Sentence embeddings map a sentence to a vector. Quantization stores each weight in a few bits; "
        "the importance of an input column is how large its activations are. ") * 6


def test_collect_bert_matches_transformers_hooks(minilm_dir, tmp_path):
    """The mean squared input of every linear layer, as measured by forward hooks on transformers' BertModel
    over the same chunks, equals what the numpy forward pass records."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from mcf.conversion.imatrix import collect_bert
    from mcf.apps.demo.megacontext import load_tokenizer

    col, chunks = collect_bert(minilm_dir, [TEXT], chunk_tokens=48)
    assert chunks >= 2
    tok = load_tokenizer(minilm_dir)
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    sums, counts = {}, {}

    def hook(name):
        def f(_mod, inp):
            x = inp[0].detach().double().reshape(-1, inp[0].shape[-1]).numpy()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return f

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(hook(name + ".weight"))
    with torch.no_grad():
        for i in range(0, len(ids), 46):
            model(torch.tensor([[cls] + ids[i:i + 46] + [sep]]))
    means = col.means()
    assert "pooler.dense.weight" not in means  # sentence embeddings pool the tokens; the pooler never runs
    assert sorted(means) == sorted(n for n in sums if not n.startswith("pooler"))
    for n, m in means.items():
        assert counts[n] == col.counts[n]
        np.testing.assert_allclose(m, sums[n] / counts[n], rtol=2e-4, atol=1e-7)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "mcf.cli", *args], capture_output=True, text=True, check=False)


def test_cli_imatrix_and_quantize(minilm_dir, tmp_path):
    """mcf imatrix on the packed demo checkpoint, then mcf quantize --imatrix: the weighted tensors differ
    from the unweighted search, the others (no entry: embeddings) are the same bytes, the file verifies."""
    from mcf.conversion.pack import pack

    packed = tmp_path / "minilm.mcf"
    pack(minilm_dir, packed)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT, encoding="utf-8")
    im = tmp_path / "minilm.imatrix.gguf"
    r = run_cli("imatrix", str(packed), "--text", str(text), "-o", str(im), "--chunk", "64", "-q")
    assert r.returncode == 0, r.stderr
    assert "importance of 36 weight tensors" in r.stdout
    imat = read_imatrix(im)
    with mcf.open(packed) as c:
        for n, v in imat.items():
            assert v.shape == (c.info(n).shape[1],) and (v > 0).all()
    out_w, out_u = tmp_path / "w.mcf", tmp_path / "u.mcf"
    r = run_cli("quantize", str(packed), str(out_w), "--method", "k3", "--imatrix", str(im), "-q")
    assert r.returncode == 0, r.stderr
    assert run_cli("quantize", str(packed), str(out_u), "--method", "k3", "-q").returncode == 0
    assert run_cli("verify", str(out_w)).returncode == 0
    with mcf.open(out_w) as a, mcf.open(out_u) as b:
        for n in a:
            same = a.raw(n).tobytes() == b.raw(n).tobytes()
            assert same == (n not in imat or not a.info(n).quantized), n
    r = run_cli("quantize", str(packed), str(tmp_path / "f.mcf"), "--method", "k3", "--fast", "--imatrix", str(im))
    assert r.returncode == 2 and "--imatrix" in r.stderr
    bad = tmp_path / "bad.dat"
    bad.write_bytes(legacy_bytes({"encoder.layer.0.attention.self.query.weight": (1, [1.0] * 10)}))
    r = run_cli("quantize", str(packed), str(tmp_path / "g.mcf"), "--method", "k4", "--imatrix", str(bad), "-q")
    assert r.returncode != 0 and "encoder.layer.0.attention.self.query.weight" in r.stderr and "384 columns" in r.stderr
    assert not (tmp_path / "g.mcf").exists()
    r = run_cli("quantize", str(packed), str(tmp_path / "g.mcf"), "--imatrix", str(tmp_path / "nope.gguf"), "-q")
    assert r.returncode == 1 and "nope.gguf" in r.stderr and "Traceback" not in r.stderr


def test_cli_imatrix_refuses_other_models(tmp_path):
    with mcf.Writer(tmp_path / "m.mcf") as w:
        w.add_resource("config.json", b'{"model_type": "llama", "max_position_embeddings": 128}')
        w.add_resource("tokenizer.json", b"{}")
        w.add_tensor("x", np.zeros((2, 2), np.float32))
    text = tmp_path / "t.txt"
    text.write_text("hello", encoding="utf-8")
    r = run_cli("imatrix", str(tmp_path / "m.mcf"), "--text", str(text), "-o", str(tmp_path / "o.gguf"))
    assert r.returncode == 1 and "BERT" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o.gguf").exists()
    r = run_cli("imatrix", str(tmp_path / "m.mcf"), "--text", str(tmp_path / "missing.txt"), "-o", "o.gguf")
    assert r.returncode == 1 and "missing.txt" in r.stderr and "Traceback" not in r.stderr


def test_convert_gguf_with_llama_cpp_imatrix(tmp_path):
    """A GGUF model and an importance matrix in llama.cpp's format name tensors alike: mcf convert --imatrix
    weights exactly the tensors the file names; --fast keeps the single-pass quantizer."""
    from mcf.conversion.checkpoint import convert

    rng = np.random.default_rng(8)
    q = rng.standard_normal((16, 64)).astype(np.float32)
    up = rng.standard_normal((8, 96)).astype(np.float32)
    model = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(model), "llama")
    w.add_tensor("blk.0.attn_q.weight", q)
    w.add_tensor("blk.0.ffn_up.weight", up)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    im = tmp_path / "imatrix.gguf"
    sums = rng.random(64) * 50
    write_llama_style(im, {"blk.0.attn_q.weight": (sums, [10.0])})
    with pytest.warns(UserWarning, match=r"matched 1 of the 2 .*unweighted.*'blk.0.ffn_up.weight'"):
        convert(model, tmp_path / "w.mcf", method="k4", imatrix=im)
    convert(model, tmp_path / "f.mcf", method="k4", fast=True)
    with mcf.open(tmp_path / "w.mcf") as c, mcf.open(tmp_path / "f.mcf") as f:
        imp = (sums.astype(np.float32) / 10).astype(np.float32)
        assert c.raw("blk.0.attn_q.weight").tobytes() == mcf.quantize(q, "k4", importance=imp)[0].tobytes()
        assert c.raw("blk.0.ffn_up.weight").tobytes() == mcf.quantize(up, "k4")[0].tobytes()
        assert f.raw("blk.0.attn_q.weight").tobytes() == mcf.quantize(q, "k4", fast=True)[0].tobytes()
    from mcf.conversion.gguf import convert_gguf

    with pytest.warns(UserWarning, match="matched 1 of the 2"):  # a path, as convert() takes (was AttributeError)
        convert_gguf(model, tmp_path / "p.mcf", method="k4", imatrix=im)
    assert (tmp_path / "p.mcf").read_bytes() == (tmp_path / "w.mcf").read_bytes()
    with pytest.raises(mcf.InvalidArgumentError, match="fast"):
        convert(model, tmp_path / "x.mcf", method="k4", fast=True, imatrix=im)
    assert not (tmp_path / "x.mcf").exists()


def test_convert_and_quantize_file_weight_alike(tmp_path):
    """The safetensors path of mcf convert and mcf quantize apply an importance mapping the same way
    (names with an entry weighted; int8 ignores it; other names unweighted)."""
    from _vectors import MANTLE_MODEL
    from mcf.conversion.checkpoint import convert
    from mcf.conversion.quant_policy import quantize_file

    mcf.pack(MANTLE_MODEL, tmp_path / "p.mcf")
    with mcf.open(tmp_path / "p.mcf") as c:
        names = [n for n in c if len(c.info(n).shape) == 2 and c.info(n).dtype.family == "float"]
        imat = {n: np.random.default_rng(len(n)).random(c.info(n).shape[1]) for n in names[::2]}
    for method in ("k3", "int8"):
        if method == "k3":  # half the tensors have an entry: the others are named in a warning
            for call in (lambda: convert(MANTLE_MODEL, tmp_path / "c.mcf", method=method, imatrix=imat),
                         lambda: quantize_file(tmp_path / "p.mcf", tmp_path / "q.mcf", method, imatrix=imat)):
                with pytest.warns(UserWarning, match=f"matched {len(imat)} of the {len(names)} tensors"):
                    call()
        else:  # int8 has one scale per tensor: it does not use an importance matrix, nothing is matched
            convert(MANTLE_MODEL, tmp_path / "c.mcf", method=method, imatrix=imat)
            quantize_file(tmp_path / "p.mcf", tmp_path / "q.mcf", method, imatrix=imat)
        with mcf.open(tmp_path / "c.mcf") as a, mcf.open(tmp_path / "q.mcf") as b, mcf.open(tmp_path / "p.mcf") as c:
            assert {n: a.raw(n).tobytes() for n in a} == {n: b.raw(n).tobytes() for n in b}
            for n in names:
                kw = {"importance": imat[n]} if n in imat and method == "k3" else {}
                assert b.raw(n).tobytes() == mcf.quantize(c.tensor(n), method, **kw)[0].tobytes(), n


# -- arguments of the wrong type are named ----------------------------------------------------------
@pytest.mark.parametrize("path", [5, None, ["a.gguf"], 2.5])
def test_read_and_write_refuse_a_path_of_the_wrong_type(tmp_path, path):
    with pytest.raises(mcf.ArgumentTypeError, match="path"):
        read_imatrix(path)
    with pytest.raises(mcf.ArgumentTypeError, match="path"):
        write_imatrix(path, {"a": np.ones(3)}, {"a": 1})


@pytest.mark.parametrize("sums, counts, kw, cls, match", [
    ({"a": np.ones(3)}, {"a": "x"}, {}, mcf.ArgumentTypeError, "counts"),
    ({"a": "abc"}, {"a": 1}, {}, mcf.ArgumentTypeError, "sums"),
    ({5: np.ones(3)}, {5: 1}, {}, mcf.ArgumentTypeError, "name"),
    ({"a": np.ones(3)}, {"a": 1}, {"datasets": 5}, mcf.ArgumentTypeError, "datasets"),
    ({"a": np.ones(3)}, {"a": 1}, {"chunk_count": "x"}, mcf.InvalidArgumentError, "chunk_count"),
    ({"a": np.ones(3)}, {"a": 1}, {"chunk_size": -1}, mcf.InvalidArgumentError, "chunk_size"),
    ({"a": np.ones(3)}, {"a": 1}, {"chunk_count": 2 ** 32}, mcf.InvalidArgumentError, "chunk_count"),
    ({"a": np.full(3, 1e40)}, {"a": 1}, {}, mcf.InvalidArgumentError, "float32"),
    ({"a": np.array([1.0, -1.0])}, {"a": 1}, {}, mcf.InvalidArgumentError, ">= 0"),
    ({"a": np.ones(3)}, {"a": -2}, {}, mcf.InvalidArgumentError, ">= 0"),
    ({"a": np.ones((2, 2, 2))}, {"a": 1}, {}, mcf.InvalidArgumentError, "1-D"),
], ids=["count str", "sums str", "name int", "datasets int", "chunk_count str", "chunk_size negative",
        "chunk_count u32", "sums beyond f32", "negative sum", "negative count", "3-D sums"])
def test_write_imatrix_refuses_what_it_cannot_write(tmp_path, sums, counts, kw, cls, match):
    """Each used to raise a bare ValueError/TypeError/struct.error, or wrote a file (infinite in_sum2) that
    read_imatrix then refused."""
    p = tmp_path / "o.gguf"
    with pytest.raises(cls, match=match):
        write_imatrix(p, sums, counts, **kw)
    assert not p.exists()


def test_collector_refuses_inputs_that_are_not_numbers():
    col = ImportanceCollector()
    with pytest.raises(mcf.ArgumentTypeError, match="name"):
        col.add(5, np.ones((2, 3), np.float32))
    with pytest.raises(mcf.ArgumentTypeError, match="'w'"):
        col.add("w", [[object(), object()]])
    with pytest.raises(mcf.ArgumentTypeError, match="'w'"):
        col.add("w", np.ones((2, 3), bool))
    assert col.sums == {}


def test_as_importance_refuses_other_types_and_keys():
    from mcf.conversion.imatrix import as_importance

    with pytest.raises(mcf.ArgumentTypeError, match="imatrix"):
        as_importance(5)
    with pytest.raises(mcf.ArgumentTypeError, match="imatrix"):
        as_importance({5: np.ones(3)})


def test_collect_bert_refuses_arguments_of_the_wrong_type(minilm_dir):
    """A single string as ``texts`` was read as one text per character; a path or chunk size of the wrong
    type leaked a bare TypeError."""
    from mcf.conversion.imatrix import collect_bert

    for kw, match in [({"texts": "one text"}, "texts"), ({"texts": [b"bytes"]}, r"texts\[0\]"),
                      ({"texts": ["ok"], "chunk_tokens": "64"}, "chunk_tokens"),
                      ({"texts": ["ok"], "model": None}, "model")]:
        args = {"model": minilm_dir, **kw}
        with pytest.raises((mcf.ArgumentTypeError, mcf.InvalidArgumentError), match=match):
            collect_bert(args.pop("model"), args.pop("texts"), **args)


def write_tensors(path, tensors):
    """A GGUF imatrix holding exactly ``tensors`` (name -> array), by gguf-py."""
    w = gguf.GGUFWriter(str(path), arch="")
    w.kv_data[0].pop("general.architecture", None)
    w.add_string("general.type", "imatrix")
    for n, a in tensors.items():
        w.add_tensor(n, np.asarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GOOD = {"a.in_sum2": np.ones((1, 8), np.float32), "a.counts": np.ones((1, 1), np.float32)}


@pytest.mark.parametrize("tensors, field, match", [
    ({**GOOD, "b.counts": np.ones((1, 1), np.float32)}, "b.counts", "b.in_sum2"),
    ({**GOOD, "b.in_sum": np.ones((1, 8), np.float32)}, "b.in_sum", "b.in_sum2"),
    ({**GOOD, "a.in_sum": np.ones((1, 7), np.float32)}, "a.in_sum", "7 values"),
    ({**GOOD, "a.in_sum": np.ones((1, 8), np.float16)}, "a.in_sum", "F32"),
    ({"a.in_sum2": np.ones((2, 8), np.float32), "a.counts": np.ones((1, 1), np.float32)}, "a.counts", "one count"),
    ({"a.in_sum2": np.ones((1, 8), np.float32), "a.counts": np.ones((3, 1), np.float32)}, "a.counts", "one count"),
], ids=["counts without in_sum2", "in_sum alone", "in_sum of another size", "in_sum not F32",
        "fewer counts than matrices", "more counts than matrices"])
def test_gguf_entries_follow_llama_cpp_rules(tmp_path, tensors, field, match):
    """llama.cpp refuses an imatrix whose NAME.counts has no NAME.in_sum2 (or the reverse), whose NAME.in_sum
    differs in size from NAME.in_sum2 or is not F32 ("mismatched sums and counts"); these were ignored."""
    p = tmp_path / "x.gguf"
    write_tensors(p, tensors)
    with pytest.raises(mcf.FormatError, match=match) as ei:
        read_imatrix(p)
    assert ei.value.field == field and ei.value.path == str(p)
    write_tensors(p, {**GOOD, "a.in_sum": np.ones((1, 8), np.float32), "a.extra_stat": np.ones(3, np.float32)})
    assert read_imatrix(p)["a"].tolist() == [1.0] * 8  # a matching in_sum and tensors of other names: fine


# -- an imatrix in the other naming convention ----------------------------------------------------------
HF_AND_GGUF = {  # Hugging Face name -> what llama.cpp's convert_hf_to_gguf.py names it (checked with gguf-py below)
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.11.self_attn.k_proj.weight": "blk.11.attn_k.weight",
    "model.layers.1.self_attn.v_proj.weight": "blk.1.attn_v.weight",
    "model.layers.1.self_attn.o_proj.weight": "blk.1.attn_output.weight",
    "model.layers.2.mlp.gate_proj.weight": "blk.2.ffn_gate.weight",
    "model.layers.2.mlp.up_proj.weight": "blk.2.ffn_up.weight",
    "model.layers.2.mlp.down_proj.weight": "blk.2.ffn_down.weight",
    "model.layers.0.self_attn.q_proj.bias": "blk.0.attn_q.bias",
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "layers.3.self_attn.q_proj.weight": "blk.3.attn_q.weight",
    "layers.3.attention.wq.weight": "blk.3.attn_q.weight",
    "layers.3.attention.wk.weight": "blk.3.attn_k.weight",
    "layers.3.attention.wv.weight": "blk.3.attn_v.weight",
    "layers.3.attention.wo.weight": "blk.3.attn_output.weight",
    "layers.3.feed_forward.w1.weight": "blk.3.ffn_gate.weight",
    "layers.3.feed_forward.w2.weight": "blk.3.ffn_down.weight",
    "layers.3.feed_forward.w3.weight": "blk.3.ffn_up.weight",
    "tok_embeddings.weight": "token_embd.weight",
    "encoder.layer.5.attention.self.query.weight": "blk.5.attn_q.weight",
    "encoder.layer.5.attention.self.key.bias": "blk.5.attn_k.bias",
    "encoder.layer.5.attention.self.value.weight": "blk.5.attn_v.weight",
    "encoder.layer.5.attention.output.dense.weight": "blk.5.attn_output.weight",
    "encoder.layer.5.intermediate.dense.weight": "blk.5.ffn_up.weight",
    "encoder.layer.5.output.dense.weight": "blk.5.ffn_down.weight",
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "bert.encoder.layer.0.output.dense.weight": "blk.0.ffn_down.weight",
}


def test_gguf_names_agree_with_gguf_py():
    """mcf's small table gives the names gguf-py's TensorNameMap (what convert_hf_to_gguf.py uses) gives;
    names outside the table (norms, GGUF names, other models) have none."""
    from mcf.conversion.imatrix import gguf_name

    llama = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, 12)
    bert = gguf.TensorNameMap(gguf.MODEL_ARCH.BERT, 12)
    for hf, gg in HF_AND_GGUF.items():
        assert gguf_name(hf) == gg, hf
        tmap = bert if ".layer." in hf or hf.startswith(("embeddings.", "bert.")) else llama
        assert tmap.get_name(hf.removeprefix("bert."), try_suffixes=(".weight", ".bias")) == gg, hf
    for other in ("blk.0.attn_q.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
                  "encoder.layer.0.attention.output.LayerNorm.weight", "pooler.dense.weight",
                  "model.layers.0.self_attn.q_proj", "transformer.h.0.attn.c_attn.weight", "x"):
        assert gguf_name(other) is None, other


def llama_style_mcf(path, rng, *, layers=2, hidden=64, inter=96, vocab=40):
    """A small llama-style model with Hugging Face names, and its GGUF-named importance (what llama-imatrix
    measures for the GGUF conversion: every linear layer, no embeddings, no output head)."""
    shapes = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = (hidden, hidden)
        shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
    shapes.update({"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                   "lm_head.weight": (vocab, hidden)})
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    with mcf.Writer(path) as w:
        for n, a in arrays.items():
            w.add_tensor(n, a)
    from mcf.conversion.imatrix import gguf_name

    imp = {gguf_name(n): rng.random(s[1]) * 10 ** rng.uniform(-2, 2, s[1])
           for n, s in shapes.items() if len(s) == 2 and "embed" not in n and "lm_head" not in n}
    return arrays, imp


def test_quantize_hf_file_with_gguf_imatrix(tmp_path, capsys):
    """Exactly the case docs/quantization.md describes: llama-imatrix's GGUF names against a Hugging Face-named
    file.  It was a silent no-op (exit 0, bytes identical to no imatrix); now every linear layer gets its
    entry, and the embeddings and output head (no entry) are named in a warning."""
    from mcf.conversion.imatrix import gguf_name
    from mcf.conversion.quant_policy import quantize_file

    src, im = tmp_path / "hf.mcf", tmp_path / "llama.imatrix.gguf"
    arrays, imp = llama_style_mcf(src, np.random.default_rng(11))
    write_imatrix(im, {n: v * 7 for n, v in imp.items()}, {n: 7 for n in imp})
    imat = read_imatrix(im)
    with pytest.warns(UserWarning, match=r"matched 14 of the 16 tensors.*'lm_head.weight', 'model.embed_tokens"):
        quantize_file(src, tmp_path / "w.mcf", "k3", imatrix=im)
    with mcf.open(tmp_path / "w.mcf") as c:
        for n, a in arrays.items():
            if a.ndim != 2:
                continue
            kw = {"importance": imat[gguf_name(n)]} if gguf_name(n) in imat else {}
            assert c.raw(n).tobytes() == mcf.quantize(a, "k3", **kw)[0].tobytes(), n
    # the command line: exit 0, the warning on one line, different bytes from no imatrix
    assert cli_main(["quantize", str(src), str(tmp_path / "c.mcf"), "--method", "k3", "--imatrix", str(im), "-q"]) == 0
    err = capsys.readouterr().err
    assert "mcf quantize: warning: the importance matrix matched 14 of the 16" in err and "Traceback" not in err
    assert cli_main(["quantize", str(src), str(tmp_path / "u.mcf"), "--method", "k3", "-q"]) == 0
    assert (tmp_path / "c.mcf").read_bytes() == (tmp_path / "w.mcf").read_bytes()
    assert (tmp_path / "c.mcf").read_bytes() != (tmp_path / "u.mcf").read_bytes()


def test_imatrix_matching_nothing_is_an_error(tmp_path, capsys):
    """An imatrix of another model (or another naming) used to be ignored without a word."""
    from mcf.conversion.quant_policy import quantize_file

    src, im = tmp_path / "hf.mcf", tmp_path / "other.gguf"
    llama_style_mcf(src, np.random.default_rng(12))
    write_imatrix(im, {"transformer.h.0.attn.c_attn.weight": np.ones(64)}, {"transformer.h.0.attn.c_attn.weight": 1})
    with pytest.raises(mcf.InvalidArgumentError, match=r"matched 0 of the 16 tensors .*c_attn.*model.layers"):
        quantize_file(src, tmp_path / "o.mcf", "k4", imatrix=im)
    assert cli_main(["quantize", str(src), str(tmp_path / "o.mcf"), "--method", "q4", "--imatrix", str(im)]) == 1
    assert "matched 0 of the 16" in capsys.readouterr().err
    assert not (tmp_path / "o.mcf").exists()
    with pytest.raises(mcf.InvalidArgumentError, match="matched 0 of the 14"):  # N counts what gets quantized
        quantize_file(src, tmp_path / "o.mcf", "k4", imatrix=im, overrides=["*embed*=none", "lm_head*=int8"])
    # int8/int4 do not use an importance matrix: nothing to match, nothing refused
    quantize_file(src, tmp_path / "o.mcf", "int8", imatrix=im)
    with pytest.raises(mcf.InvalidArgumentError, match="matched 0 of the 16"):
        mcf.convert(_as_safetensors(src, tmp_path), tmp_path / "c.mcf", method="k4", imatrix=im)
    assert not (tmp_path / "c.mcf").exists()


def _as_safetensors(src, tmp_path):
    stnp = pytest.importorskip("safetensors.numpy")
    out = tmp_path / "model.safetensors"
    with mcf.open(src) as c:
        stnp.save_file({n: np.array(c.tensor(n)) for n in c}, str(out))
    return out


def test_gguf_file_with_hf_named_imatrix(tmp_path):
    """The other direction: a GGUF model converted with an imatrix measured on the Hugging Face model
    (mcf imatrix names its entries as the file it ran on)."""
    from mcf.conversion.imatrix import gguf_name

    rng = np.random.default_rng(13)
    arrays, imp = llama_style_mcf(tmp_path / "hf.mcf", rng, layers=1)
    model = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(model), "llama")
    for n, a in arrays.items():
        w.add_tensor(gguf_name(n) or n.replace("model.", ""), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    by_hf = {hf: imp[gguf_name(hf)] for hf in arrays if gguf_name(hf) in imp}
    with pytest.warns(UserWarning, match="matched 7 of the 9"):
        mcf.convert(model, tmp_path / "g.mcf", method="k4", imatrix=by_hf)
    with mcf.open(tmp_path / "g.mcf") as c:
        for hf, v in by_hf.items():
            assert c.raw(gguf_name(hf)).tobytes() == mcf.quantize(arrays[hf], "k4", importance=v)[0].tobytes()


def test_ambiguous_names_are_not_guessed():
    from mcf.conversion.imatrix import match_tensors

    two = {"model.layers.0.self_attn.q_proj.weight": 1, "layers.0.attention.wq.weight": 2}
    assert match_tensors(two, ["blk.0.attn_q.weight"]) == {}  # two entries claim it
    assert match_tensors({"blk.0.attn_q.weight": 1}, list(two)) == {}  # two tensors claim it
    assert match_tensors({"blk.0.attn_q.weight": 1, "layers.0.attention.wq.weight": 2}, list(two)) == \
        {"layers.0.attention.wq.weight": "layers.0.attention.wq.weight"}


def test_bert_checkpoint_with_gguf_named_imatrix(minilm_dir, tmp_path):
    """The demo checkpoint (BERT names) and an imatrix in llama.cpp's names for its GGUF conversion give the
    bytes of the same imatrix under the checkpoint's own names."""
    from mcf.conversion.imatrix import collect_bert, gguf_name
    from mcf.conversion.pack import pack
    from mcf.conversion.quant_policy import quantize_file

    packed = tmp_path / "minilm.mcf"
    pack(minilm_dir, packed)
    col, _ = collect_bert(packed, [TEXT], chunk_tokens=48)
    hf = col.means()
    as_gguf = {gguf_name(n): v for n, v in hf.items()}
    assert None not in as_gguf and len(as_gguf) == len(hf) == 36
    ov = ["encoder.layer.1.*=k4", "embeddings.word_embeddings.weight=k4", "*=none"]
    for name, imat in (("h.mcf", hf), ("g.mcf", as_gguf)):
        with pytest.warns(UserWarning, match=r"matched 6 of the 7 .*'embeddings.word_embeddings.weight'"):
            quantize_file(packed, tmp_path / name, None, overrides=ov, imatrix=imat)
    assert (tmp_path / "h.mcf").read_bytes() == (tmp_path / "g.mcf").read_bytes()
