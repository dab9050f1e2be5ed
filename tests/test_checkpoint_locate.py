"""Which files a safetensors checkpoint path or URL means (``mcf.safetensors.reader.locate_checkpoint``), the
same for every transport and every caller: a local directory, a directory URL over HTTP (nginx or the uvicorn
fallback, tests/_http_server.py), over a server of our own that answers 403 for a missing file (S3 without
ListBucket, CloudFront) and on fsspec's in-memory file system (``memory://``)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest

fsspec = pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

import mcf  # noqa: E402
import mcf.safetensors as mst  # noqa: E402
from mcf.cli import main  # noqa: E402
from mcf.safetensors import reader  # noqa: E402
import _http_server  # noqa: E402  (tests/ is on sys.path: pytest inserts the directory of test modules)

from safetensors.numpy import save  # noqa: E402

SINGLE = {"single.weight": np.arange(12, dtype=np.float32).reshape(3, 4)}
SHARD_A = {"a.weight": np.full((2, 3), 7, np.float16)}
SHARD_B = {"b.weight": np.arange(5, dtype=np.int32)}
# a shard literally named with the three characters a URL gives a meaning to
ODD = "a?b#c%20.safetensors"


def _sharded_files(first="model-00001-of-00002.safetensors", second="model-00002-of-00002.safetensors") -> dict:
    """name -> bytes of an index and its two shards."""
    index = {"metadata": {}, "weight_map": {"a.weight": first, "b.weight": second}}
    return {reader.INDEX_NAME: json.dumps(index).encode(), first: save(SHARD_A), second: save(SHARD_B)}


def _both() -> dict:
    """A directory as the audit found it: model.safetensors and an index with shards of other tensors."""
    return {"model.safetensors": save(SINGLE), **_sharded_files()}


def _put_local(d, files: dict) -> str:
    os.makedirs(d, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    return str(d)


def _put_memory(root: str, files: dict) -> str:
    fs = fsspec.filesystem("memory")
    for name, data in files.items():
        fs.pipe(f"{root}/{name}", data)
    return "memory://" + root


@pytest.fixture
def memdir(request):
    """A fresh directory on fsspec's in-memory file system, removed afterwards."""
    root = f"/locate-{request.node.name}".replace("[", "-").replace("]", "")
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _same(got: dict, want: dict):
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k


# -- model.safetensors first, then the index, for every transport ------------------------------------------
@pytest.mark.parametrize("where", ["local", "memory"])
def test_directory_with_model_safetensors_and_an_index_reads_model_safetensors(tmp_path, memdir, where):
    """A directory holding model.safetensors and model.safetensors.index.json is its model.safetensors, as
    transformers reads it, whether it is a local path or a URL (URLs read the index's shards)."""
    d = _put_local(tmp_path / "both", _both()) if where == "local" else _put_memory(memdir, _both())
    _same(mst.load_file(d), SINGLE)
    _same(mcf.load_file(d), SINGLE)
    with mst.open_checkpoint(d) as ck:
        assert ck.index is None and list(ck.tensors) == ["single.weight"]
    loc = reader.locate_checkpoint(d)
    assert [os.path.basename(f) for f in loc.files] == ["model.safetensors"] and loc.index is None
    assert loc.directory == d


@pytest.mark.parametrize("where", ["local", "memory"])
def test_directory_without_model_safetensors_reads_the_index(tmp_path, memdir, where):
    files = _sharded_files()
    d = _put_local(tmp_path / "sh", files) if where == "local" else _put_memory(memdir, files)
    _same(mst.load_file(d), {**SHARD_A, **SHARD_B})
    _same(mcf.load_file(d + "/"), {**SHARD_A, **SHARD_B})
    loc = reader.locate_checkpoint(d)
    assert loc.index.endswith(reader.INDEX_NAME)
    assert loc.shards == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def test_pack_and_convert_of_a_directory_follow_the_rule(tmp_path):
    """mcf pack and mcf convert read the files the loaders read: model.safetensors, not the shards."""
    d = _put_local(tmp_path / "both", _both())
    for out, run in ((tmp_path / "p.mcf", lambda o: mcf.pack(d, o)), (tmp_path / "c.mcf", lambda o: mcf.convert(d, o))):
        run(str(out))
        with mcf.open(str(out)) as c:
            assert list(c.keys()) == ["single.weight"]
            assert np.array_equal(c.tensor("single.weight"), SINGLE["single.weight"])
    assert main(["pack", d, "-o", str(tmp_path / "cli.mcf"), "-q"]) == 0
    with mcf.open(str(tmp_path / "cli.mcf")) as c:
        assert list(c.keys()) == ["single.weight"]


def test_empty_memory_directory_names_both_probes(memdir):
    _put_memory(memdir, {"README": b"nothing here"})
    with pytest.raises(mcf.MissingFileError) as ei:
        mst.load_file("memory://" + memdir)
    msg = str(ei.value)
    assert f"memory://{memdir}/model.safetensors: no such remote file" in msg
    assert f"memory://{memdir}/{reader.INDEX_NAME}: no such remote file" in msg


# -- a URL is a file, an index or a directory by its path, query and fragment aside ----------------------
@pytest.fixture(scope="module")
def www(tmp_path_factory):
    root = tmp_path_factory.mktemp("www-locate")
    _put_local(root / "single", {"model.safetensors": save(SINGLE)})
    _put_local(root / "both", _both())
    _put_local(root / "sharded", _sharded_files())
    _put_local(root / "odd", _sharded_files(first=ODD))
    with _http_server.serve(str(root), str(tmp_path_factory.mktemp("srv-locate"))) as s:
        yield s


@pytest.mark.parametrize("query", ["?download=true", "#frag", "?download=true#frag"])
def test_url_of_a_file_with_a_query_is_a_file(www, query, capsys):
    """``.../model.safetensors?download=true`` is the file (mcf.safetensors.load_file read it as a directory)."""
    url = www.url("single/model.safetensors") + query
    _same(mst.load_file(url), SINGLE)
    _same(mcf.load_file(url), SINGLE)
    with mst.open_checkpoint(url) as ck:
        assert list(ck.tensors) == ["single.weight"]
    assert main(["info", "--json", url]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "safetensors"


def test_url_of_an_index_or_a_directory_with_a_query(www):
    """The query of an index or directory URL is kept on every file under it (how the store is reached)."""
    want = {**SHARD_A, **SHARD_B}
    _same(mst.load_file(www.url("sharded/" + reader.INDEX_NAME) + "?download=true"), want)
    _same(mst.load_file(www.url("sharded") + "?download=true"), want)
    _same(mcf.load_file(www.url("sharded") + "?download=true"), want)
    _same(mst.load_file(www.url("both") + "?download=true"), SINGLE)   # model.safetensors first here too
    _same(mcf.load_file(www.url("both")), SINGLE)
    loc = reader.locate_checkpoint(www.url("sharded") + "?download=true")
    assert all(f.endswith(".safetensors?download=true") for f in loc.files)


@pytest.mark.parametrize("where", ["http", "memory"])
def test_shard_names_with_url_characters(www, memdir, where):
    """A shard literally named ``a?b#c%20.safetensors`` is that file: its name is percent-encoded when it
    is joined to an HTTP URL (fsspec's other schemes take paths as they are)."""
    if where == "http":
        d = www.url("odd")
    else:
        d = _put_memory(memdir, _sharded_files(first=ODD))
    want = {**SHARD_A, **SHARD_B}
    _same(mst.load_file(d), want)
    _same(mcf.load_file(d + "/" + reader.INDEX_NAME), want)
    with mst.open_checkpoint(d) as ck:   # the index's checks see the shard's own name
        assert sorted(ck.tensors) == ["a.weight", "b.weight"]
    loc = reader.locate_checkpoint(d)
    assert loc.shards[0] == ODD
    assert loc.files[0].endswith("/a%3Fb%23c%2520.safetensors" if where == "http" else "/" + ODD)


# -- a store that answers 403 for a missing key -------------------------------------------------------------
class _Store(http.server.BaseHTTPRequestHandler):
    """Serves ``server.files`` (path -> bytes) with Range support; a missing path is ``server.missing``
    (403, as S3 answers to whoever may not list the bucket)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _file(self):
        path = unquote(urlsplit(self.path).path)
        self.server.log.append((self.command, path))
        return self.server.files.get(path)

    def _refuse(self):
        self.send_response(self.server.missing)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self):
        data = self._file()
        if data is None:
            return self._refuse()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()

    def do_GET(self):
        data = self._file()
        if data is None:
            return self._refuse()
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, b = (int(x) for x in rng[6:].split("-"))
            body = data[a:b + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{a + len(body) - 1}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def _store(files: dict, missing: int = 403):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    srv.daemon_threads = True
    srv.files, srv.missing, srv.log = files, missing, []
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(params=["obstore", "fsspec"])
def client(request):
    """Plain http:// URLs go to obstore; a URL with a query string to fsspec's aiohttp."""
    if request.param == "obstore":
        pytest.importorskip("obstore", reason="obstore is not installed (the remote extra installs it on Python 3.11 "
                                              "and later)")
        return ""
    return "?download=true"


def test_directory_url_on_a_store_that_answers_403_for_missing_keys(client):
    files = {"/single/model.safetensors": save(SINGLE)}
    files.update({"/sharded/" + n: b for n, b in _sharded_files().items()})
    with _store(files) as (srv, base):
        _same(mst.load_file(base + "/single" + client), SINGLE)    # (the index was probed first: a 403)
        _same(mcf.load_file(base + "/single" + client), SINGLE)
        _same(mst.load_file(base + "/sharded" + client), {**SHARD_A, **SHARD_B})   # 403 for model.safetensors
        with pytest.raises((mcf.AccessError, mcf.MissingFileError)) as ei:
            mst.load_file(base + "/nothing" + client)
        msg = str(ei.value)
        assert f"{base}/nothing/model.safetensors{client}: " in msg, msg
        assert f"{base}/nothing/{reader.INDEX_NAME}{client}: " in msg, msg
        if not client:   # obstore says what the store answered (fsspec reports a refusal as a missing file)
            assert isinstance(ei.value, mcf.AccessError) and msg.count("403") >= 2, msg


def test_directory_url_probes_hide_credentials():
    with _store({}) as (srv, base):
        with pytest.raises(OSError) as ei:
            mst.load_file(base.replace("//", "//user:pw-SECRET@") + "/nothing?token=tok-SECRET")
    assert "SECRET" not in str(ei.value) and "token=***" in str(ei.value)


# -- a NUL in a shard name ------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["local", "memory"])
def test_nul_in_a_shard_name_is_a_format_error(tmp_path, memdir, where, capsys):
    files = _sharded_files(first="bad\0name.safetensors")
    del files["bad\0name.safetensors"]   # (no file system has it: only the index names it)
    d = _put_local(tmp_path / "nul", files) if where == "local" else _put_memory(memdir, files)
    with pytest.raises(mcf.FormatError) as ei:
        mst.open_checkpoint(d)
    assert ei.value.field == "weight_map['a.weight']" and ei.value.path.endswith(reader.INDEX_NAME)
    assert "NUL" in str(ei.value)
    with pytest.raises(mcf.FormatError):
        mcf.load_file(d)
    assert main(["info", d]) == 1
    err = capsys.readouterr().err
    assert "internal error" not in err and "NUL" in err and "weight_map['a.weight']" in err


def test_mcf_info_knows_a_gguf_url_by_its_path_not_its_query():
    """``x.gguf?download=true`` is a GGUF file for ``mcf info`` (it decided by the whole string's suffix)."""
    from mcf.gguf.info import is_gguf_file

    assert is_gguf_file("https://h/m/x.gguf?download=true")
    assert is_gguf_file("https://h/m/x.GGUF#frag")
    assert not is_gguf_file("https://h/m/x.bin?name=.gguf")
