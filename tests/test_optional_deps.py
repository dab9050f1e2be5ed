"""Every optional feature with its package made unimportable: the error is an mcf.MissingDependencyError
(an MCFError and an ImportError), raised where the feature is used, naming the package and the extra that
installs it; packages that only make things faster or richer fall back instead (mcf/_core/optional.py).

A package is made unimportable the way Python itself allows: ``sys.modules[name] = None`` (for it and its
loaded submodules), which makes ``import name`` raise ModuleNotFoundError until the test ends."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mcf
from mcf._core.optional import DISTRIBUTION, require
from mcf.cli import main


def block(monkeypatch, *names):
    for name in names:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.setitem(sys.modules, loaded, None)
        monkeypatch.setitem(sys.modules, name, None)


def check(exc_info, package, extra):
    exc = exc_info.value
    assert isinstance(exc, mcf.MissingDependencyError)
    assert isinstance(exc, mcf.MCFError) and isinstance(exc, ImportError)
    assert (exc.package, exc.extra) == (package, extra)
    assert f"needs the {package!r} package, which is not installed" in str(exc)
    if extra is not None:
        assert f"pip install '{DISTRIBUTION}[{extra}]'" in str(exc)
    assert f"pip install {package}" in str(exc)


@pytest.fixture
def kv():
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((2, 8, 4)).astype(np.float32), rng.standard_normal((2, 8, 4)).astype(np.float32))
            for _ in range(2)]


def test_lz4_to_write_lz4_kv_files(monkeypatch, tmp_path, kv):
    from mcf.bucket.kvfile import write_kv

    block(monkeypatch, "lz4")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        write_kv(tmp_path / "a.mcb", kv, compression="lz4")
    check(ei, "lz4", "bucket")
    write_kv(tmp_path / "b.mcb", kv, compression="none")  # uncompressed files need nothing


def test_lz4_to_ingest_into_a_bucket(monkeypatch, tmp_path, kv, capsys):
    """A first-run failure: the demo's bucket step without lz4."""
    from mcf.bucket import Bucket

    block(monkeypatch, "lz4")
    b = Bucket(tmp_path / "b")
    b.register_model("m", architecture="x", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        b.ingest("m", kv, content=b"text", compression="lz4")
    check(ei, "lz4", "bucket")
    np.savez(tmp_path / "kv.npz", k=np.stack([k for k, _ in kv]), v=np.stack([v for _, v in kv]))
    assert main(["bucket", "ingest", "--root", str(tmp_path / "b"), "m", str(tmp_path / "kv.npz"), "--text", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mcf bucket ingest: error: lz4 compression of KV files needs the 'lz4' package")
    assert f"pip install '{DISTRIBUTION}[bucket]'" in err


def test_zstandard_to_write_and_to_read_zstd_kv_files(monkeypatch, tmp_path, kv):
    pytest.importorskip("zstandard", reason="writing the zstd file this test reads needs zstandard")
    from mcf.bucket.kvfile import read_kv, write_kv

    write_kv(tmp_path / "z.mcb", kv, compression="zstd")
    block(monkeypatch, "zstandard")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        write_kv(tmp_path / "y.mcb", kv, compression="zstd")
    check(ei, "zstandard", "bucket")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        read_kv(tmp_path / "z.mcb")
    check(ei, "zstandard", "bucket")


def test_cryptography_for_encrypted_kv_files(monkeypatch, tmp_path, kv):
    from mcf.bucket.kvfile import write_kv

    block(monkeypatch, "cryptography")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        write_kv(tmp_path / "e.mcb", kv, compression="none", key=os.urandom(32))
    check(ei, "cryptography", "bucket")


def test_starlette_and_uvicorn_for_the_server(monkeypatch, tmp_path, capsys):
    from mcf.apps.bucket_server import create_app, serve

    block(monkeypatch, "starlette")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        create_app(tmp_path / "b")
    check(ei, "starlette", "server")
    monkeypatch.undo()
    block(monkeypatch, "uvicorn")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        serve(tmp_path / "b", port=0)  # refused before anything listens
    check(ei, "uvicorn", "server")
    assert main(["bucket", "serve", "--root", str(tmp_path / "b"), "--port", "0"]) == 1
    assert capsys.readouterr().err.startswith("mcf bucket serve: error: mcf bucket serve needs the 'uvicorn' package")


def test_every_missing_package_of_the_extra_is_named_at_once(monkeypatch, tmp_path, capsys):
    """Without uvicorn and starlette, `mcf bucket serve` asked for uvicorn, and after
    `pip install uvicorn` for starlette.  The first failure names both, and one command installs both."""
    from mcf.apps.bucket_server import serve

    block(monkeypatch, "starlette", "uvicorn")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        serve(tmp_path / "b", port=0)
    exc = ei.value
    assert set(exc.missing) == {"starlette", "uvicorn"} and exc.missing[0] == exc.package
    other = ({"starlette", "uvicorn"} - {exc.package}).pop()
    assert f"the 'server' extra's {other!r} is missing too" in str(exc)
    assert f"pip install {exc.package} {other}" in str(exc) and f"pip install '{DISTRIBUTION}[server]'" in str(exc)
    assert main(["bucket", "serve", "--root", str(tmp_path / "b"), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "'starlette'" in err and "'uvicorn'" in err, err
    # the same for any extra: lz4 and zstandard of the bucket extra
    monkeypatch.undo()
    block(monkeypatch, "lz4", "zstandard", "cryptography")
    from mcf.bucket.kvfile import write_kv

    with pytest.raises(mcf.MissingDependencyError) as ei:
        write_kv(tmp_path / "a.mcb", [(np.ones((1, 2, 2), np.float32),) * 2], compression="lz4")
    assert ei.value.missing == ("lz4", "zstandard", "cryptography")
    assert "the 'bucket' extra's 'zstandard', 'cryptography' are missing too" in str(ei.value)
    assert "pip install lz4 zstandard cryptography" in str(ei.value)


def test_a_requirement_with_brackets_is_quoted_for_the_shell(monkeypatch):
    from mcf._core.optional import install_hint

    assert install_hint("ray", ["ray[data]", "tokenizers"]).endswith("or: pip install 'ray[data]' tokenizers")
    assert install_hint(None, "s3fs") == "pip install s3fs"


def test_fsspec_and_aiohttp_for_urls(monkeypatch):
    from mcf.remote import RemoteFile

    url = "http://127.0.0.1:9/model.mcf"  # nothing listens on port 9
    # http(s):// needs no optional package: mcf's own client reads it (here: a refused connection, not a
    # missing dependency)
    block(monkeypatch, "obstore", "fsspec", "aiohttp")
    with pytest.raises(mcf.MCFIOError, match="refused") as ei:
        RemoteFile(url, retries=0)
    assert not isinstance(ei.value, mcf.MissingDependencyError)
    monkeypatch.undo()
    # fsspec's HTTP client, asked for by name, needs fsspec and aiohttp (and names what is missing)
    block(monkeypatch, "fsspec")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        RemoteFile(url, backend="fsspec")
    check(ei, "fsspec", "remote")
    monkeypatch.undo()
    block(monkeypatch, "aiohttp")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        RemoteFile(url, backend="fsspec")
    check(ei, "aiohttp", "remote")
    monkeypatch.undo()
    block(monkeypatch, "fsspec")   # every other scheme needs fsspec
    with pytest.raises(mcf.MissingDependencyError) as ei:
        mcf.open("memory:///model.mcf")
    check(ei, "fsspec", "remote")


def test_obstore_for_object_stores(monkeypatch):
    from mcf.remote import RemoteFile

    block(monkeypatch, "obstore")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        RemoteFile("s3://bucket/model.mcf", backend="obstore")   # asked for by name: never a silent fallback
    check(ei, "obstore", "remote")


def test_obstore_to_write_datasets_to_object_stores(monkeypatch, tmp_path):
    """Writing to an object store has no fallback: the Megatron writer, merge and tokenize name the extra
    before anything is written (a raw ModuleNotFoundError escaped the lookup of an existing output)."""
    import mcf.megatron as mm

    block(monkeypatch, "obstore")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        mm.Writer("s3://bucket/corpus", dtype=np.uint16)
    check(ei, "obstore", "remote")
    with mm.Writer(str(tmp_path / "a"), dtype=np.uint16) as w:
        w.add_item([1, 2])
    with pytest.raises(mcf.MissingDependencyError) as ei:
        mm.merge("gs://bucket/corpus", [str(tmp_path / "a")])
    check(ei, "obstore", "remote")


def test_a_url_scheme_whose_fsspec_backend_is_missing(monkeypatch):
    pytest.importorskip("fsspec", reason="the scheme is resolved by fsspec")
    block(monkeypatch, "s3fs", "obstore")   # without obstore, s3:// goes to fsspec, which needs s3fs
    with pytest.raises(mcf.MissingDependencyError) as ei:
        mcf.open("s3://bucket/model.mcf")
    assert isinstance(ei.value, mcf.MCFError) and "s3://bucket/model.mcf" in str(ei.value)
    assert "s3fs" in str(ei.value)


def test_torch_for_mcf_torch_and_the_hot_tier(monkeypatch):
    block(monkeypatch, "torch")
    monkeypatch.delitem(sys.modules, "mcf.torch", raising=False)
    with pytest.raises(mcf.MissingDependencyError) as ei:
        importlib.import_module("mcf.torch")
    check(ei, "torch", "torch")
    from mcf.bucket.tiers import to_torch

    with pytest.raises(mcf.MissingDependencyError) as ei:
        to_torch(np.zeros(3, np.float32))
    check(ei, "torch", "torch")
    # the bucket's contract: a hot tier this machine cannot provide is an InvalidArgumentError too
    # (the server answers 409, an unmeetable hot preference falls back to warm)
    assert isinstance(ei.value, mcf.InvalidArgumentError)


@pytest.mark.parametrize("missing", ["torch", "transformers"])
def test_torch_and_transformers_for_the_bucket_model_backend(monkeypatch, tmp_path, capsys, missing):
    from mcf.bucket.hf import TransformersBackend, weights_fingerprint

    import importlib.util

    block(monkeypatch, missing)
    # torch is checked first: where it is not installed at all (the test-core legs), it is what is named
    named = "torch" if importlib.util.find_spec("torch") is None else missing
    for call in (lambda: TransformersBackend(object(), model_id="m"), lambda: weights_fingerprint(object()),
                 lambda: TransformersBackend.from_pretrained(str(tmp_path / "model"))):
        with pytest.raises(mcf.MissingDependencyError) as ei:
            call()
        check(ei, named, "transformers")
    assert main(["bucket", "serve", "--root", str(tmp_path / "b"), "--port", "0", "--backend", "transformers",
                 "--model", str(tmp_path / "model")]) == 1
    err = capsys.readouterr().err
    assert f"needs the {named!r} package" in err and f"pip install '{DISTRIBUTION}[transformers]'" in err


def test_tokenizers_for_tokenizing(monkeypatch, tmp_path, capsys):
    from mcf.conversion.tokenize import load_tokenizer

    block(monkeypatch, "tokenizers")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        load_tokenizer(tmp_path / "tokenizer.json")
    check(ei, "tokenizers", "tokenize")
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    assert main(["megatron", "tokenize", str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path),
                 "--output-prefix", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mcf megatron tokenize: error: tokenizing text needs the 'tokenizers' package")
    assert f"pip install '{DISTRIBUTION}[tokenize]'" in err


def test_zstandard_for_zstd_compressed_tokenizer_input(monkeypatch, tmp_path):
    from mcf.conversion.tokenize import iter_documents

    p = tmp_path / "docs.jsonl.zst"
    p.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16)  # the zstd magic is all the sniffing reads
    block(monkeypatch, "zstandard")
    with pytest.raises(mcf.MissingDependencyError) as ei:
        list(iter_documents(str(p)))
    check(ei, "zstandard", "tokenize")
    assert str(p) in str(ei.value)


@pytest.mark.parametrize("module", ["tokenizers", "lz4", "safetensors"])
def test_the_demo_checks_its_extra_before_any_work(monkeypatch, tmp_path, capsys, module):
    block(monkeypatch, module)
    assert main(["demo", "--model-dir", str(tmp_path), "--workdir", str(tmp_path / "w")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "w").exists()  # refused before any step ran
    assert err.startswith("mcf demo: error: mcf demo (")
    assert f"needs the {module!r} package, which is not installed: pip install '{DISTRIBUTION}[demo]'" in err


def test_a_package_that_is_installed_but_broken(monkeypatch, tmp_path):
    """An ImportError from inside the package (a missing shared library, say) is not 'not installed'."""
    pkg = tmp_path / "lz4"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('liblz4.so.1: cannot open shared object file')\n")
    for m in [m for m in sys.modules if m == "lz4" or m.startswith("lz4.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(mcf.MissingDependencyError) as ei:
        require("lz4.block", feature="lz4 compression of KV files", extra="bucket", package="lz4")
    assert "which is installed but does not import (liblz4.so.1: cannot open shared object file)" in str(ei.value)
    assert f"pip install '{DISTRIBUTION}[bucket]'" in str(ei.value)


def test_the_error_pickles_with_its_fields():
    exc = mcf.MissingDependencyError("x needs y", package="y", extra="bucket", feature="x")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is mcf.MissingDependencyError
    assert (str(back), back.package, back.extra, back.feature, back.name) == ("x needs y", "y", "bucket", "x", "y")
    exc = mcf.MissingDependencyError("x needs y, z", package="y", extra="server", feature="x", missing=("y", "z"))
    assert pickle.loads(pickle.dumps(exc)).missing == ("y", "z")


def test_speedups_and_bfloat16_fall_back_without_their_packages(tmp_path):
    """ml_dtypes (bfloat16 arrays), zlib-ng (fast CRC-32) and orjson (fast JSON) are not needed: without
    them bf16 comes back as its uint16 bits, CRCs use zlib and JSON the json module.  In a fresh
    interpreter, because these are imported when mcf is."""
    code = textwrap.dedent(f"""
        import sys
        for name in ("ml_dtypes", "zlib_ng", "orjson"):
            sys.modules[name] = None
        import numpy as np
        import mcf
        from mcf.bucket import Bucket, kvfile

        path = {str(tmp_path / "bf16.mcf")!r}
        with mcf.Writer(path) as w:
            w.add_tensor("w", np.array([1.0, -2.5, 3.0], np.float32), dtype="bf16")
        with mcf.open(path) as c:
            t = c.tensor("w")
            assert t.dtype == np.uint16 and t.tolist() == [0x3F80, 0xC020, 0x4040], (t.dtype, t)
        assert mcf.load_state_dict(path)["w"].dtype == np.uint16
        assert kvfile.CRC_BACKEND == "zlib"
        b = Bucket({str(tmp_path / "b")!r})
        b.register_model("m", architecture="x", num_layers=1, num_kv_heads=1, head_dim=2, dtype="bfloat16")
        kv = [(np.ones((1, 3, 2), np.float32), np.zeros((1, 3, 2), np.float32))]
        meta = b.ingest("m", kv, content=b"x", dtype="bfloat16", compression="none")
        (k, v), = Bucket({str(tmp_path / "b")!r}).load(meta["context_id"], model="m")
        assert k.dtype == np.uint16 and (k == 0x3F80).all() and (v == 0).all()
        for name in ("ml_dtypes", "zlib_ng", "orjson"):
            assert sys.modules[name] is None, name
        print("fallbacks ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "fallbacks ok", r.stderr
