"""The command line, run as a user runs it (a subprocess through the installed entry point) and
in-process for speed."""

import json
import os
import subprocess

import numpy as np
import pytest

import mcf
from _vectors import MANTLE_NAMES, mantle_check, mantle_file
from mcf.cli import main
from _entry_point import mcf_command


def test_info_json_matches_go_report(capsys):
    for name in MANTLE_NAMES:
        assert main(["info", mantle_file(name), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        chk = mantle_check(name)
        assert d["header"]["file_size"] == chk["file_size"]
        assert [(t["name"], t["offset"], t["size"]) for t in d["tensors"]] == [
            (t["name"], t["data_off"], t["data_size"]) for t in chk["tensors"]]
        assert len(d["quant_info"]) == len(chk.get("quant_records", []))


def test_info_text(capsys):
    assert main(["info", mantle_file("k4")]) == 0
    out = capsys.readouterr().out
    for s in ("sections (10", "TensorIndex", "QuantInfo", "model info", "mcf-testmodel", "d.big", "k4",
              "64x4096", "quant records (11)"):
        assert s in out, s
    assert main(["info", "--no-mmap", mantle_file("f16")]) == 0


def test_info_of_safetensors_checkpoints(tmp_path, capsys):
    """``mcf info`` describes what the loaders read: a safetensors file, a sharded directory and its index,
    each tensor as safetensors itself sees it (dtype, shape, offset of its data in its shard)."""
    st = pytest.importorskip("safetensors.numpy", reason="safetensors (in the test extra) is not installed")
    from safetensors import safe_open

    rng = np.random.default_rng(7)
    shards = {"model-00001-of-00002.safetensors": {"a.weight": rng.standard_normal((4, 3)).astype(np.float32),
                                                   "a.bias": np.arange(3, dtype=np.int64)},
              "model-00002-of-00002.safetensors": {"b.weight": rng.standard_normal((2, 5)).astype(np.float16)}}
    for fn, tensors in shards.items():
        st.save_file(tensors, str(tmp_path / fn), metadata={"format": "np"})
    weight_map = {n: fn for fn, ts in shards.items() for n in ts}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    def expected(fn):
        raw = (tmp_path / fn).read_bytes()
        hlen = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + hlen])
        with safe_open(str(tmp_path / fn), "np") as f:
            return {n: (header[n]["dtype"], list(f.get_slice(n).get_shape()), 8 + hlen + header[n]["data_offsets"][0])
                    for n in f.keys()}

    assert main(["info", "--json", str(tmp_path / "model-00002-of-00002.safetensors")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == "safetensors" and d["shards"][0]["metadata"] == {"format": "np"}
    assert {t["name"]: (t["dtype"], t["shape"], t["offset"]) for t in d["tensors"]} == \
        expected("model-00002-of-00002.safetensors")
    for where in (tmp_path, tmp_path / "model.safetensors.index.json"):
        assert main(["info", "--json", str(where)]) == 0
        d = json.loads(capsys.readouterr().out)
        assert [os.path.basename(s["file"]) for s in d["shards"]] == list(shards)
        want = {**expected("model-00001-of-00002.safetensors"), **expected("model-00002-of-00002.safetensors")}
        assert {t["name"]: (t["dtype"], t["shape"], t["offset"]) for t in d["tensors"]} == want
        assert d["dtypes"] == {"F32": 1, "I64": 1, "F16": 1} and d["total_bytes"] == 48 + 24 + 20
        assert [d["shards"][t["shard"]]["file"].endswith(weight_map[t["name"]]) for t in d["tensors"]] == [True] * 3
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("safetensors checkpoint: index ") and "2 files, 3 tensors" in out
    assert "b.weight" in out and "F16" in out and "  [1]" in out
    bad = tmp_path / "bad" / "x.safetensors"
    bad.parent.mkdir()
    bad.write_bytes(b"\x05" + b"\x00" * 7 + b"{abc}")
    assert main(["info", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "x.safetensors" in err and "header at offset 8: header is not valid JSON" in err


def test_verify_ok_and_bad(tmp_path, capsys):
    assert main(["verify", mantle_file("k3")]) == 0
    assert "OK" in capsys.readouterr().out
    bad = tmp_path / "bad.mcf"
    with open(mantle_file("k3"), "rb") as f:
        data = f.read()
    bad.write_bytes(data[:-5])
    assert main(["verify", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "file_size" in out and str(bad) in out


def test_quantize_says_what_happened_to_each_tensor(tmp_path, capsys):
    """Re-quantizing a quantized file printed "(100.0% of the input)" and nothing else.  Every run
    says how many tensors were quantized, kept (quantized already: never quantized twice), left by 'none', or
    copied (not rank-2 floats)."""
    src, k4, q8 = mantle_file("f32"), str(tmp_path / "k4.mcf"), str(tmp_path / "q8.mcf")
    with mcf.open(src) as c:
        rank2 = [n for n in c if len(c.info(n).shape) == 2]
        others = len(c) - len(rank2)
    assert main(["quantize", src, k4, "-q", "--override", f"{rank2[0]}=none"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [f"  quantized: {len(rank2) - 1} tensors (k4 x{len(rank2) - 1})",
                         "  left as they are by 'none' (the method or an override): 1 tensor (f32 x1)",
                         f"  copied as they are: {others} tensors (f32 x{others}): only rank-2 float tensors are "
                         "quantized"]
    assert main(["quantize", k4, q8, "-q", "--method", "q8"]) == 0  # only the one left float gets quantized
    out = capsys.readouterr().out
    assert f"part of the input is already quantized ({len(rank2) - 1} of its {len(rank2) + others} tensors)" in out
    assert "  quantized: 1 tensor (q8 x1)" in out
    assert main(["quantize", q8, str(tmp_path / "again.mcf"), "-q", "--method", "k2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"the input is already quantized ({len(rank2)} of its {len(rank2) + others} tensors): nothing "
                        "was quantized again, the output holds the input's tensors")
    assert lines[2].startswith(f"  kept as they are: {len(rank2)} tensors, quantized already (")
    assert f"k4 x{len(rank2) - 1}" in lines[2] and "q8 x1" in lines[2]
    assert "quantize the float original instead" in lines[2]
    with mcf.open(q8) as a, mcf.open(str(tmp_path / "again.mcf")) as b:
        assert [(n, a.info(n).dtype.name) for n in a] == [(n, b.info(n).dtype.name) for n in b]


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing.mcf")]) == 1
    assert "missing.mcf" in capsys.readouterr().err


@pytest.mark.slow
def test_entry_point_subprocess(tmp_path):
    cmd = mcf_command()
    r = subprocess.run(cmd + ["verify", mantle_file("q4")], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(cmd + ["info", str(tmp_path / "nope.mcf")], capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "nope.mcf" in r.stderr


def test_demo_on_the_real_checkpoint(tmp_path, capsys, minilm_dir):
    assert main(["demo", "--workdir", str(tmp_path), "--model-dir", minilm_dir]) == 0
    out = capsys.readouterr().out
    assert "104/104 tensors bit-identical" in out
    assert "mcf verify: OK" in out
    assert "== quantize with every method" in out
    for m in ("q8", "q4", "k6", "k4", "k3", "k2", "int8", "int4"):
        with mcf.open(os.path.join(tmp_path, f"all-MiniLM-L6-v2.{m}.mcf")) as q:
            assert q.info("encoder.layer.0.attention.self.query.weight").dtype.name == m
    with mcf.open(os.path.join(tmp_path, "all-MiniLM-L6-v2.mcf")) as c:
        assert c.model_info.hidden_size == 384
        assert c.resource_json("config.json")["model_type"] == "bert"
        assert c.info("embeddings.word_embeddings.weight").shape == (30522, 384)


@pytest.fixture
def demo_without_heavy_steps(monkeypatch):
    """``mcf demo`` with its pack and round-trip steps for real (on the small mantle checkpoint) and the
    others replaced by stubs that write a file into the working directory: what the directory handling
    needs, in a second instead of a minute.  Yields the working directories the steps saw."""
    import mcf.apps.demo
    import mcf.apps.demo.megacontext
    import mcf.apps.demo.megatron

    seen = []

    def step(result):
        def run(*args, **kwargs):  # every step takes the working directory second
            workdir = args[1]
            seen.append(workdir)
            with open(os.path.join(workdir, f"step{len(seen)}.out"), "wb") as f:
                f.write(b"x" * 1000)
            return result
        return run

    monkeypatch.setattr(mcf.apps.demo, "demo_quantize", step([]))
    monkeypatch.setattr(mcf.apps.demo, "demo_export", step(0))
    monkeypatch.setattr(mcf.apps.demo.megatron, "demo_megatron", step({"problems": []}))
    monkeypatch.setattr(mcf.apps.demo.megacontext, "demo_megacontext", step(0))
    monkeypatch.setattr(mcf.apps.demo, "demo_bucket", step(0))
    return seen


def test_demo_removes_its_temporary_directory_unless_kept(tmp_path, monkeypatch, capsys, demo_without_heavy_steps):
    """Every `mcf demo` left 339 MB in a temporary directory.  It is removed at the end, on success
    and on failure; --keep DIR keeps the outputs, and the last line says where they are (or were)."""
    import tempfile

    from _vectors import MANTLE_MODEL

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where mkdtemp creates the demo's directory
    assert main(["demo", "--model-dir", MANTLE_MODEL]) == 0
    out = capsys.readouterr().out
    used = demo_without_heavy_steps[0]
    assert os.path.dirname(used) == str(scratch) and len(set(demo_without_heavy_steps)) == 1
    assert list(scratch.iterdir()) == [], "the demo left its temporary directory behind"
    assert out.splitlines()[-1] == (f"== outputs removed with their temporary directory {used} "
                                    "(keep them with --keep DIR)")

    import mcf.apps.demo

    def boom(*args, **kwargs):
        raise KeyboardInterrupt
    stub = mcf.apps.demo.demo_bucket
    monkeypatch.setattr(mcf.apps.demo, "demo_bucket", boom)
    assert main(["demo", "--model-dir", MANTLE_MODEL]) == 130  # interrupted: removed all the same
    assert list(scratch.iterdir()) == []
    monkeypatch.setattr(mcf.apps.demo, "demo_bucket", stub)

    keep = tmp_path / "kept"
    assert main(["demo", "--model-dir", MANTLE_MODEL, "--keep", str(keep)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"== outputs kept in {keep}"
    assert (keep / "all-MiniLM-L6-v2.mcf").is_file()


def test_demo_bert_forward_matches_transformers(minilm_dir):
    """The bucket demo's keys and values come from a plain-numpy BERT forward pass: it must compute what
    Hugging Face's BertModel computes on the same checkpoint."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import json

    from mcf.conversion.bert import bert_forward
    from mcf.apps.demo import weights_of
    from mcf.apps.demo.megacontext import load_tokenizer

    with open(os.path.join(minilm_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    ids = load_tokenizer(minilm_dir).encode("MCF stores model weights; buckets store KV caches.").ids
    hidden, kv = bert_forward(weights_of(minilm_dir), cfg, ids)
    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids])).last_hidden_state[0].numpy()
    assert np.abs(hidden - want).max() < 1e-4
    # the keys of layer 0 are the key projection of the embedding output
    emb = model.embeddings(torch.tensor([ids]))
    k0 = model.encoder.layer[0].attention.self.key(emb)[0].detach().numpy()
    heads = cfg["num_attention_heads"]
    assert np.abs(kv[0][0] - k0.reshape(len(ids), heads, -1).transpose(1, 0, 2)).max() < 1e-4
