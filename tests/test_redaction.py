"""No password, token or signature of a URL reaches a message or an output (``mcf.remote.redact``): a URL with
``user:pw@``, with a bare ``TOKEN@`` and with ``?X-Amz-Signature=...&token=...&auth=...`` goes through every
surface that shows a path given by the user (``mcf info`` as text and JSON, the loaders' errors,
``megacontext.open_tree``'s errors, ``mcf ctx info``, the command line's error line), served over HTTP on
loopback (nginx or the uvicorn fallback: tests/_http_server.py; both ignore the credentials)."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

import mcf  # noqa: E402
import mcf.safetensors as mst  # noqa: E402
from mcf.cli import main  # noqa: E402
from mcf.remote import redact  # noqa: E402
from mcf.remote._urls import redact_text  # noqa: E402
import _http_server  # noqa: E402  (tests/ is on sys.path: pytest inserts the directory of test modules)

SECRET = "SECRET"
QUERY = f"X-Amz-Signature=sig-{SECRET}&token=tok2-{SECRET}&auth=auth-{SECRET}"


# -- the function itself --------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, shown", [
    ("https://user:pw@h/x", "https://***@h/x"),
    ("https://TOKEN@h/x", "https://***@h/x"),
    ("https://TOKEN:x-oauth-basic@h/x", "https://***@h/x"),
    ("s3://AKID:SK@bucket/k", "s3://***@bucket/k"),
    ("https://h/x?X-Amz-Signature=s&X-Amz-Credential=c&X-Amz-Security-Token=t&versionId=7",
     "https://h/x?X-Amz-Signature=***&X-Amz-Credential=***&X-Amz-Security-Token=***&versionId=7"),
    ("https://h/x?download=true&auth=a&access_token=b&api_key=c&password=d",
     "https://h/x?download=true&auth=***&access_token=***&api_key=***&password=***"),
    ("https://d.cloudfront.net/x?Expires=1&Signature=s&Key-Pair-Id=k&Policy=p",
     "https://d.cloudfront.net/x?Expires=1&Signature=***&Key-Pair-Id=***&Policy=***"),
    ("https://acct.blob.core.windows.net/c/b?sv=2020&sig=s%2Fx", "https://acct.blob.core.windows.net/c/b?sv=2020&sig=***"),
    ("https://h/x?a=b%20c;token=t&d=1", "https://h/x?a=b%20c;token=***&d=1"),   # other values kept as written
    ("https://h/x?X%2DAmz%2DSignature=s", "https://h/x?X%2DAmz%2DSignature=***"),
    ("https://h/cb#access_token=t&state=1", "https://h/cb#access_token=***&state=1"),
    ("memory:///x?sig=1", "memory:///x?sig=***"),
    ("memory:///plain/x.mcf", "memory:///plain/x.mcf"),
    ("http://127.0.0.1:80/a/b.mcf?download=true", "http://127.0.0.1:80/a/b.mcf?download=true"),
    ("/local/path?token=x", "/local/path?token=x"),   # not a URL: a file name, shown as it is
])
def test_redact(url, shown):
    assert redact(url) == shown
    assert redact(shown) == shown   # twice is once
    assert redact_text(f"cannot read '{url}': gone") == f"cannot read '{shown}': gone"


# -- every surface ----------------------------------------------------------------------------------------------
def _st(path, tensors: dict):
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def _index(d, wm):
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("www-redact")
    for name in ("sharded", "noshard", "badindex"):
        (root / name).mkdir()
    _st(root / "sharded" / "s1.safetensors", {"a": np.ones(3, np.float32)})
    _st(root / "sharded" / "s2.safetensors", {"b": np.zeros(2, np.float16)})
    _index(root / "sharded", {"a": "s1.safetensors", "b": "s2.safetensors"})
    _st(root / "noshard" / "s1.safetensors", {"a": np.ones(3, np.float32)})
    _index(root / "noshard", {"a": "s1.safetensors", "b": "gone.safetensors"})
    _index(root / "badindex", {})
    from mcf import megacontext

    rng = np.random.default_rng(0)
    with megacontext.create(str(root / "tree"), embedding_dim=16, model_name="t", gist_dtype="fp16") as t:
        t.append_tokens(rng.integers(0, 1000, size=32 * 4, dtype=np.uint32))
        t.append_gists(1, rng.standard_normal((4, 16)).astype(np.float32))
    shutil.copytree(root / "tree", root / "badmeta")
    (root / "badmeta" / "metadata.json").write_text("{not json")
    shutil.copytree(root / "tree", root / "nolevel")
    os.remove(root / "nolevel" / "LOD1.ctx")
    with _http_server.serve(str(root), str(tmp_path_factory.mktemp("srv-redact"))) as s:
        yield s


@pytest.fixture(params=["password", "token", "query"])
def url(request, server):
    """``url(rel)``: the served file ``rel`` with one kind of secret in its URL."""
    host = f"127.0.0.1:{server.port}"

    def make(rel):
        if request.param == "password":
            return f"http://user:pw-{SECRET}@{host}/{rel}"
        if request.param == "token":
            return f"http://tok-{SECRET}@{host}/{rel}"
        return f"http://{host}/{rel}?{QUERY}"

    make.kind = request.param
    return make


def _clean(*texts):
    for t in texts:
        assert SECRET not in str(t), t


def _clean_error(exc):
    """Nothing of the exception shows a secret: its message, arguments, file name, path, and the same after
    pickling (a DataLoader worker's error reaches the parent so)."""
    again = pickle.loads(pickle.dumps(exc))
    _clean(str(exc), repr(exc), exc.args, getattr(exc, "filename", None), getattr(exc, "path", None),
           str(again), getattr(again, "filename", None))
    assert "***" in str(exc), str(exc)   # the URL is named, redacted


def test_mcf_info_text_and_json(server, url, capsys):
    for rel in ("sharded/model.safetensors.index.json", "sharded/", "sharded/s1.safetensors"):
        assert main(["info", url(rel)]) == 0
        out = capsys.readouterr().out
        _clean(out)
        assert "***" in out
        assert main(["info", "--json", url(rel)]) == 0
        d = json.loads(capsys.readouterr().out)
        _clean(json.dumps(d))
        assert all("***" in s["file"] for s in d["shards"])
        if rel.endswith(".json") or rel.endswith("/"):
            assert d["index"] == redact(url("sharded/model.safetensors.index.json"))


def test_loader_errors(server, url):
    with pytest.raises(mcf.TensorNotFoundError) as ei:
        mst.load_file(url("sharded/"), names=["nope"])
    _clean_error(ei.value)
    with pytest.raises(mcf.TensorNotFoundError) as ei:
        mcf.load_file(url("sharded/model.safetensors.index.json"), names=["nope"])
    _clean_error(ei.value)
    with pytest.raises(mcf.TensorNotFoundError) as ei:
        mst.dequantize(url("sharded/"), "nope")
    _clean_error(ei.value)
    with pytest.raises(mcf.MissingFileError) as ei:          # a shard the index lists is not there
        mst.load_file(url("noshard/"))
    _clean_error(ei.value)
    with pytest.raises(mcf.MissingFileError) as ei:
        mcf.load_file(url("noshard"))
    _clean_error(ei.value)
    with pytest.raises(mcf.FormatError) as ei:               # an index without a weight_map
        mst.load_file(url("badindex/model.safetensors.index.json"))
    _clean_error(ei.value)
    with pytest.raises(mcf.MissingFileError) as ei:          # neither model.safetensors nor an index
        mcf.load_file(url("nothing-here/"))
    _clean_error(ei.value)


def test_megacontext_errors_and_outputs(server, url, capsys):
    from mcf import megacontext

    for rel, cls in (("no-such-tree", mcf.MissingFileError), ("badmeta", mcf.FormatError),
                     ("nolevel", mcf.MCFError)):
        with pytest.raises(mcf.MCFError) as ei:
            megacontext.open_tree(url(rel))
        _clean_error(ei.value)
        if url.kind != "query":   # (a tree URL's query is not carried to the files under it)
            assert isinstance(ei.value, cls), ei.value
        _clean(*[p.error for p in megacontext.verify(url(rel))])
        assert main(["ctx", "verify", url(rel)]) == 1
        _clean(capsys.readouterr())
    if url.kind != "query":
        with megacontext.open_tree(url("tree")) as t:
            _clean(t.info())
        for args in (["ctx", "info", url("tree")], ["ctx", "info", "--json", url("tree")],
                     ["ctx", "verify", url("tree")]):
            assert main(args) == 0
            out = capsys.readouterr().out
            _clean(out)
            assert "***" in out


def test_command_line_error_line(server, url, capsys):
    for rel in ("noshard/", "badindex/model.safetensors.index.json", "nothing-here/", "no-such.mcf"):
        assert main(["info", url(rel)]) == 1
        err = capsys.readouterr().err
        _clean(err)
        assert "error:" in err and "internal error" not in err and "***" in err, err
