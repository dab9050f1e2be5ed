"""Remote files (mcf.remote) against a real HTTP server on loopback that honours Range requests: nginx
when installed, else uvicorn + starlette's StaticFiles (tests/_http_server.py says which one ran), plus a
fault injector of our own (connection dropped mid-body, short bodies, Range ignored, missing size).

Every format is read twice, from its local path and from its URL, and the results must be equal.
"""

from __future__ import annotations

import http.server
import pickle
import threading

import numpy as np
import pytest

fsspec = pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

import mcf  # noqa: E402
from mcf import InvalidArgumentError, MCFIOError, MissingFileError  # noqa: E402
from mcf.remote import RemoteFile, is_url  # noqa: E402
import _http_server  # noqa: E402  (tests/ is on sys.path: pytest inserts the directory of test modules)
import _remote_files  # noqa: E402


_rng = _remote_files.rng
_eq = _remote_files.assert_same


# -- the served directory ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def www(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    _remote_files.make_files(root)
    return root


@pytest.fixture(scope="module")
def server(www, tmp_path_factory, request):
    with _http_server.serve(str(www), str(tmp_path_factory.mktemp("srv"))) as s:
        tr = request.config.pluginmanager.get_plugin("terminalreporter")
        capman = request.config.pluginmanager.get_plugin("capturemanager")
        if tr is not None and capman is not None:
            with capman.global_and_fixture_disabled():
                tr.write_line(f"\ntest_remote: HTTP server on loopback: {s.kind} (port {s.port})")
        yield s


# -- every format: remote equals local ---------------------------------------------------------------------
def test_is_url():
    assert is_url("http://h/x") and is_url("s3://b/k") and is_url("file:///tmp/x") and is_url(b"gs://b/k")
    assert not is_url("/tmp/x") and not is_url("x.mcf") and not is_url("c:\\x") and not is_url(3)


def test_mcf_remote_equals_local(server, www):
    local = mcf.open(str(www / "model.mcf"))
    with mcf.open(server.url("model.mcf")) as remote:
        assert remote.source.mode == "fileobj" and remote.path == server.url("model.mcf")
        assert list(remote.keys()) == list(local.keys())
        for name in local.keys():
            if local.info(name).dtype.quantized:
                _eq(remote.dequantize(name), local.dequantize(name))
                _eq(remote.raw(name), local.raw(name))
                _eq(remote.dequantize(name, rows=(3, 9)), local.dequantize(name, rows=(3, 9)))
            else:
                _eq(remote.tensor(name), local.tensor(name))
        loaded, ref = remote.load(), local.load()
        for name in ref:
            _eq(loaded[name], ref[name])
    with mcf.open(server.url("model.mcf"), mmap=True) as remote:  # mmap is meaningless for a URL: ignored
        assert not remote.source.is_mapped
    local.close()


def test_load_state_dict_remote(server, www):
    ref = mcf.load_state_dict(str(www / "model.mcf"), dtype="bfloat16")
    got = mcf.load_state_dict(server.url("model.mcf"), dtype="bfloat16")
    for name in ref:
        _eq(got[name], ref[name])


def test_tp_share_over_http_reads_only_its_rows(server, www):
    local = mcf.load_state_dict(str(www / "model.mcf"), names=["big"], tp_rank=1, tp_size=4)
    server.clear_log()
    got = mcf.load_state_dict(server.url("model.mcf"), names=["big"], tp_rank=1, tp_size=4)
    _eq(got["big"], local["big"])
    fetched = sum(r[3] for r in server.requests("model.mcf") if r[0] == "GET")
    # a quarter of the 8 MiB tensor, plus at most three 1 MiB blocks of header, directory and index
    assert fetched <= (2 << 20) + (3 << 20), fetched
    # column shares of quantized tensors (decoded once, then sliced) equal the local ones
    for name in ("q", "q8"):
        a = mcf.load_state_dict(str(www / "model.mcf"), names=[name], tp_rank=1, tp_size=2, tp_dim=1)
        b = mcf.load_state_dict(server.url("model.mcf"), names=[name], tp_rank=1, tp_size=2, tp_dim=1)
        _eq(b[name], a[name])


def test_safetensors_remote(server, www):
    from safetensors.numpy import load_file

    from mcf.safetensors.reader import SafetensorsFile, open_checkpoint

    ref = load_file(str(www / "model.safetensors"))
    with SafetensorsFile(server.url("model.safetensors")) as f:
        assert sorted(f.tensors) == sorted(ref)
        for name, t in f.tensors.items():
            _eq(t.array(), ref[name])
    with open_checkpoint(server.url("model.safetensors")) as ck:
        assert sorted(ck.sorted_names()) == sorted(ref)


def test_gguf_remote(server, www):
    from mcf import gguf as mgguf

    local = mgguf.open(str(www / "model.gguf"))
    with mgguf.open(server.url("model.gguf")) as remote:
        assert list(remote.tensors) == list(local.tensors)
        for name in local.tensors:
            _eq(remote.dequantize(name), local.dequantize(name))
            _eq(remote.raw(name), local.raw(name))
    local.close()


def test_megatron_remote(server, www):
    from mcf import megatron

    local = megatron.open(str(www / "data"))
    with megatron.open(server.url("data"), mmap=False) as remote:
        assert len(remote) == len(local) and remote.num_documents == local.num_documents
        _eq(remote.sequence_lengths, local.sequence_lengths)
        for k in (0, 1, 17, len(local) - 1):
            _eq(remote[k], local[k])
        _eq(remote.document(3), local.document(3))
    with megatron.open(server.url("data.idx")) as remote:  # a prefix may end in .idx, as for paths
        _eq(remote[5], local[5])
    local.close()


def test_megacontext_remote(server, www):
    from mcf import megacontext

    local = megacontext.open_tree(str(www / "tree"))
    with megacontext.open_tree(server.url("tree/")) as remote:
        assert remote.counts == local.counts and remote.metadata == local.metadata
        _eq(remote.tokens(), local.tokens())
        _eq(remote.tokens(100, 700), local.tokens(100, 700))
        for level in (1, 2):
            _eq(remote.gists(level), local.gists(level))
        _eq(remote.gists(1, [3, 1, 39]), local.gists(1, [3, 1, 39]))
    assert [str(p) for p in megacontext.verify(server.url("tree"), deep=True)] == \
        [str(p) for p in megacontext.verify(str(www / "tree"), deep=True)]
    # a tree URL with a query (a token, ?download=true): each file's name goes before it, the query after
    # (the files were joined onto the whole string: "tree/?download=true/metadata.json")
    for url in (server.url("tree/") + "?download=true", server.url("tree") + "?download=true"):
        with megacontext.open_tree(url) as q:
            assert q.counts == local.counts
            _eq(q.gists(2), local.gists(2))
    local.close()
    with pytest.raises(InvalidArgumentError, match="remote"):
        megacontext.open_tree(server.url("tree"), "r+")
    with pytest.raises(InvalidArgumentError, match="remote"):
        megacontext.create(server.url("tree2"), embedding_dim=16)
    with pytest.raises(MissingFileError, match="metadata.json"):
        megacontext.open_tree(server.url("no-such-tree"))


def test_kvfile_remote(server, www):
    from mcf.bucket.kvfile import open_kv, write_kv

    with open_kv(str(www / "kv_data.mcb")) as local, open_kv(server.url("kv_data.mcb")) as remote:
        a, b = local.load(), remote.load()
        assert len(a) == len(b)
        for (k1, v1), (k2, v2) in zip(a, b):
            _eq(np.asarray(k1), np.asarray(k2))
            _eq(np.asarray(v1), np.asarray(v2))
    k = np.zeros((1, 2, 4), np.float16)
    with pytest.raises(InvalidArgumentError, match="remote"):
        write_kv(server.url("new.mcb"), [(k, k)])


def test_memory_and_file_urls(www):
    data = (www / "model.mcf").read_bytes()
    fsspec.filesystem("memory").pipe("/remote-test/model.mcf", data)
    local = mcf.open(str(www / "model.mcf"))
    for url in ("memory:///remote-test/model.mcf", (www / "model.mcf").as_uri()):
        with mcf.open(url) as c:
            for name in ("f16", "big", "i64"):
                _eq(c.tensor(name), local.tensor(name))
    local.close()


# -- block cache and request pattern (counted in the server's access log) -------------------------------
def test_block_cache_few_requests_for_many_small_reads(server, www):
    server.clear_log()
    src = mcf.io.open_source(server.url("model.mcf"))
    rng = _rng("small-reads")
    ref = (www / "model.mcf").read_bytes()
    offs = rng.integers(0, (1 << 20) - 100, size=500)
    for o in offs:
        assert src.read(int(o), 100) == ref[o:o + 100]
    reqs = [r for r in server.requests("model.mcf") if r[0] == "GET"]
    # 500 reads inside the first MiB: one block request (plus nothing else)
    assert len(reqs) == 1 and reqs[0][2] == 206 and reqs[0][4] == "bytes=0-1048575", reqs
    assert src._fileobj.stats["cache_hits"] >= 499 if hasattr(src, "_fileobj") else True
    src.close()


def test_large_read_bypasses_cache_in_pieces(server, www):
    server.clear_log()
    f = RemoteFile(server.url("model.mcf"), request_size=3 << 20)
    ref = (www / "model.mcf").read_bytes()
    f.seek(100)
    buf = bytearray(8 << 20)
    assert f.readinto(buf) == len(buf) and bytes(buf) == ref[100:100 + len(buf)]
    reqs = [r for r in server.requests("model.mcf") if r[0] == "GET"]
    ranges = sorted(r[4] for r in reqs)
    # 8 MiB in three even parts of at most 3 MiB (not 3 + 3 + 2)
    cuts = [100 + (8 << 20) * k // 3 for k in range(4)]
    want = sorted(f"bytes={a}-{b - 1}" for a, b in zip(cuts, cuts[1:]))
    assert ranges == want and all(r[2] == 206 for r in reqs)
    assert f.stats["cache_hits"] == 0 and f.stats["retries"] == 0


def test_load_fetches_large_tensors_concurrently_in_pieces(server, www):
    """Container.load() hands all ranges to RemoteFile.readinto_ranges at once: the 8 MiB tensor is
    fetched in request_size pieces, small tensors through the block cache."""
    from mcf.remote import open_remote

    src = open_remote(server.url("model.mcf"), request_size=1 << 20)
    with mcf.open(src) as c:
        server.clear_log()
        got = c.load()
        ref = mcf.load_file(str(www / "model.mcf"), dtype="raw")   # Container.load: quantized tensors raw
        for name in ref:
            _eq(got[name], ref[name])
        info = c.info("big")
        gets = [r for r in server.requests("model.mcf") if r[0] == "GET"]
        starts = {int(r[4][6:].split("-")[0]) for r in gets}
        assert {info.offset + k * (1 << 20) for k in range(8)} <= starts
        assert all(r[2] == 206 for r in gets)
    src.close()


def test_loader_chunk_bytes_and_threads_reach_a_url(server, www):
    """A loader's chunk_bytes= and threads= set the size of the ranged GETs and the requests in flight for
    a URL, as they set the read engine's chunks and workers for a file (they used to be dropped on the
    way to the remote file, which kept its own 8 MiB x 16)."""
    from mcf.io import open_source

    info = mcf.open(str(www / "model.mcf")).info("big")
    server.clear_log()
    got = mcf.load_file(server.url("model.mcf"), names=["big"], chunk_bytes=1 << 20)
    np.testing.assert_array_equal(got["big"], mcf.load_file(str(www / "model.mcf"), names=["big"])["big"])
    gets = [r for r in server.requests("model.mcf") if r[0] == "GET"]
    starts = {int(r[4][6:].split("-")[0]) for r in gets}
    assert {info.offset + k * (1 << 20) for k in range(8)} <= starts

    f = RemoteFile(server.url("model.mcf"))
    dst = np.empty(6 << 20, np.uint8)
    with open_source(f) as src:
        before = f.stats["requests"]   # the size, asked at opening
        src.read_into([0], [dst], threads=2, chunk_bytes=1 << 20)
    assert f.stats["requests"] - before == 6 and f.stats["max_in_flight"] <= 2
    assert bytes(dst) == (www / "model.mcf").read_bytes()[:6 << 20]


def test_cache_is_bounded(server):
    f = RemoteFile(server.url("model.mcf"), block_size=4096, cache_size=4 * 4096)
    for k in range(20):
        f.seek(k * 4096)
        f.read(10)
    assert len(f._cache) == 4 and f.stats["requests"] == 1 + 20    # the size, then one GET per block


def test_remote_source_pickles(server, www):
    src = mcf.io.open_source(server.url("model.mcf"))
    again = pickle.loads(pickle.dumps(src))
    assert again.size == src.size and again.read(1000, 64) == (www / "model.mcf").read_bytes()[1000:1064]
    c = pickle.loads(pickle.dumps(mcf.open(server.url("model.mcf"))))
    _eq(c.tensor("f16"), mcf.open(str(www / "model.mcf")).tensor("f16"))


def test_missing_url(server):
    with pytest.raises(MissingFileError) as ei:
        mcf.open(server.url("nope.mcf"))
    assert "nope.mcf" in str(ei.value)


def test_bounds_still_checked(server):
    src = mcf.io.open_source(server.url("model.mcf"))
    with pytest.raises(mcf.OutOfBoundsError):
        src.read(src.size - 10, 11)


# -- fault injection --------------------------------------------------------------------------------------
class _Faulty(http.server.BaseHTTPRequestHandler):
    """Serves one byte string; ``server.mode`` picks the misbehaviour for GET requests (the first
    ``server.fail_first`` ones only, when that is set)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def _range(self):
        h = self.headers.get("Range")
        if not h or not h.startswith("bytes="):
            return None
        a, b = h[6:].split("-")
        return int(a), int(b) + 1

    def do_HEAD(self):
        self.server.log.append(("HEAD", None))
        self.send_response(200)
        if self.server.mode != "nolength":
            self.send_header("Content-Length", str(len(self.server.data)))
        else:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def do_GET(self):
        data, mode = self.server.data, self.server.mode
        rng = self._range()
        self.server.log.append(("GET", rng))
        n_get = sum(1 for m, _ in self.server.log if m == "GET")
        if self.server.fail_first and n_get > self.server.fail_first:
            mode = "ok"
        if mode == "norange" or rng is None:
            body, status = data, 200
        else:
            body, status = data[rng[0]:rng[1]], 206
        if mode == "status":   # an error status, with Retry-After when the test set one
            self.send_response(self.server.status)
            if self.server.retry_after is not None:
                self.send_header("Retry-After", self.server.retry_after)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if mode == "short":   # a lying server: the Content-Range of the request, half the body
            body = body[: len(body) // 2]
        if mode == "wrongoffset":   # the right length from the wrong place, honestly labelled
            body = data[rng[0] + 1:rng[1] + 1] if rng else data
        if mode == "stall":  # headers, then silence
            self.send_response(206 if rng else 200)
            if rng:
                self.send_header("Content-Range", f"bytes {rng[0]}-{rng[1] - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.flush()
            self.server.release.wait(10)
            self.close_connection = True
            return
        if mode == "nolength":  # a body delimited by closing the connection: no size anywhere
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True
            return
        self.send_response(status)
        if status == 206:
            a = rng[0] + (1 if mode == "wrongoffset" else 0)
            self.send_header("Content-Range", f"bytes {a}-{rng[1] - 1 + a - rng[0]}/{len(data)}")
        if mode == "drop":
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 3])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # clients hanging up on a faulty answer: expected
        pass


@pytest.fixture
def faulty():
    srv = _QuietServer(("127.0.0.1", 0), _Faulty)
    srv.daemon_threads = True
    srv.data = bytes(_rng("faulty").integers(0, 256, size=3 << 20, dtype=np.uint8))
    srv.mode = "ok"
    srv.fail_first = 0
    srv.status, srv.retry_after = 503, None
    srv.log = []
    srv.release = threading.Event()
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/blob.bin"
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


@pytest.fixture(params=["http", "obstore", "fsspec"])
def backend(request):
    """Every client of http(s):// URLs: mcf's own (the default), obstore's and fsspec's aiohttp."""
    if request.param == "obstore":
        pytest.importorskip("obstore", reason="obstore is not installed (the remote extra installs it on Python 3.11 "
                                              "and later)")
    return request.param


def _gets(faulty):
    return sum(1 for g in faulty.log if g[0] == "GET")


def _read_all(url, **kw):
    f = RemoteFile(url, retry_delay=0.0, **kw)
    buf = bytearray(f.size)
    f.readinto(buf)
    return bytes(buf), f


@pytest.mark.parametrize("mode", ["drop", "short"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_fault_gives_clear_error_after_bounded_retries(faulty, backend, mode, size):
    faulty.mode = mode
    f = RemoteFile(faulty.url, retries=2, retry_delay=0.0, block_size=1 << 16, backend=backend)
    f.seek(5000)
    buf = bytearray(300 if size == "small" else (1 << 20))
    with pytest.raises(MCFIOError) as ei:
        f.readinto(buf)
    msg = str(ei.value)
    assert faulty.url in msg and "at offset" in msg and "3 attempts" in msg, msg
    assert _gets(faulty) == 3                           # bounded: 1 + retries, not forever
    assert f.tell() == 5000   # nothing was reported as read (the buffer may hold part of it)
    if mode == "short":
        assert "short read" in msg


def test_wrong_content_range_is_refused(faulty, backend):
    faulty.mode = "wrongoffset"
    f = RemoteFile(faulty.url, retries=1, retry_delay=0.0, backend=backend)
    f.seek(1000)
    with pytest.raises(MCFIOError, match="wrong range"):
        f.read(100)
    f.seek(4096)
    with pytest.raises(MCFIOError, match="wrong range"):
        f.readinto(bytearray(2 << 20))   # the large-read path too


def test_range_ignored_is_refused_without_retrying(faulty, backend):
    faulty.mode = "norange"
    f = RemoteFile(faulty.url, retries=3, retry_delay=0.0, backend=backend)
    f.seek(1000)
    with pytest.raises(MCFIOError, match="ignored the Range header") as ei:
        f.read(100)
    assert "at offset 0 " in str(ei.value) and "after 1 attempt:" in str(ei.value)   # the block holding 1000
    assert _gets(faulty) == 1
    # reading from offset 0 with Range ignored is still refused unless the whole file was asked for
    with pytest.raises(MCFIOError, match="ignored the Range"):
        RemoteFile(faulty.url, retry_delay=0.0, backend=backend).read(10)


def test_transient_drops_are_retried(faulty, backend):
    faulty.mode = "drop"
    faulty.fail_first = 2
    got, f = _read_all(faulty.url, retries=3, request_size=1 << 20, backend=backend)
    assert got == faulty.data and f.stats["retries"] >= 2


@pytest.mark.parametrize("status", [500, 502, 503, 408, 429])
def test_transient_statuses_are_retried(faulty, backend, status):
    faulty.mode, faulty.status, faulty.fail_first = "status", status, 2
    got, f = _read_all(faulty.url, retries=2, backend=backend)
    assert got == faulty.data and f.stats["retries"] == 2 and _gets(faulty) == 3
    faulty.log.clear()
    faulty.fail_first = 0                 # always failing: bounded, then a clear error with the status
    f = RemoteFile(faulty.url, retries=2, retry_delay=0.0, backend=backend)
    with pytest.raises(MCFIOError, match=f"3 attempts: .*{status}") as ei:
        f.read(10)
    assert faulty.url in str(ei.value) and _gets(faulty) == 3


@pytest.mark.parametrize("status", [400, 416])
def test_client_errors_are_final(faulty, backend, status):
    faulty.mode, faulty.status = "status", status
    f = RemoteFile(faulty.url, retries=3, retry_delay=0.0, backend=backend)
    with pytest.raises(MCFIOError, match=f"after 1 attempt: .*{status}"):
        f.read(10)
    assert _gets(faulty) == 1


@pytest.mark.parametrize("status, error", [(404, MissingFileError), (403, mcf.AccessError)])
def test_missing_or_refused_on_get(faulty, backend, status, error):
    """The size was known, then a GET is refused (the object deleted, a token expired): the class the
    status means, at once."""
    f = RemoteFile(faulty.url, retries=3, retry_delay=0.0, backend=backend)
    faulty.mode, faulty.status = "status", status
    with pytest.raises(error) as ei:
        f.read(10)
    assert faulty.url in str(ei.value) and _gets(faulty) == 1


def test_retry_after_is_honoured(faulty, monkeypatch):
    """A 429 or 503 with Retry-After waits as long as the server asked (up to a bound) before the next
    attempt, on the client that can see the header (fsspec's aiohttp; obstore does not expose it)."""
    from mcf.remote import _fetch

    waits = []
    monkeypatch.setattr(_fetch.time, "sleep", waits.append)
    faulty.mode, faulty.status, faulty.fail_first = "status", 429, 1
    faulty.retry_after = "7"
    got, f = _read_all(faulty.url, retries=2, backend="fsspec")
    assert got == faulty.data and waits == [7.0]
    faulty.log.clear()
    faulty.retry_after = "100000"         # bounded: a server cannot park the reader for a day
    waits.clear()
    _read_all(faulty.url, retries=2, backend="fsspec")
    assert waits == [_fetch.MAX_RETRY_AFTER]


def test_backoff_grows_with_jitter():
    from mcf.remote._fetch import MAX_DELAY, Fetcher

    f = Fetcher(None, url="u", size=0, retries=9, retry_delay=0.1, concurrency=1, stats={})
    for k in range(9):
        got = [f.backoff(k) for _ in range(200)]
        top = min(MAX_DELAY, 0.1 * 2 ** k)
        assert all(top / 2 <= d <= top for d in got) and len(set(got)) > 100   # jittered, in [top/2, top]


def test_whole_file_through_a_container_of_faults(faulty, backend, tmp_path):
    """An MCF reader over a server that drops every body: a clear MCFIOError, never a short tensor."""
    from mcf.remote import open_remote

    with mcf.Writer(str(tmp_path / "x.mcf")) as w:
        w.add_tensor("x", np.arange(4096, dtype=np.float32))
    faulty.data = (tmp_path / "x.mcf").read_bytes()
    faulty.mode = "drop"
    with pytest.raises(MCFIOError, match="127.0.0.1"):
        mcf.open(open_remote(faulty.url, retry_delay=0.0, backend=backend)).tensor("x")
    faulty.mode = "ok"
    c = mcf.open(open_remote(faulty.url, block_size=1024, retry_delay=0.0, backend=backend))   # 16 KiB: "large"
    faulty.mode = "drop"
    with pytest.raises(MCFIOError, match="127.0.0.1"):
        c.load()          # read_ranges -> RemoteFile.readinto_ranges


def test_stalled_server_times_out(faulty, backend):
    faulty.mode = "stall"
    f = RemoteFile(faulty.url, retries=1, retry_delay=0.0, timeout=0.3, backend=backend)
    with pytest.raises(MCFIOError, match="2 attempts") as ei:
        f.read(100)
    assert _gets(faulty) == 2
    assert "imeout" in str(ei.value) or "timed out" in str(ei.value), str(ei.value)


def test_unknown_size_is_refused(faulty, backend):
    faulty.mode = "nolength"
    with pytest.raises(MCFIOError, match="size"):
        RemoteFile(faulty.url, retry_delay=0.0, backend=backend)


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        RemoteFile("/not/a/url")
    with pytest.raises(InvalidArgumentError):
        RemoteFile("memory:///x", block_size=0)


# -- the block cache against plain slicing --------------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_BLOB = bytes(_rng("blob").integers(0, 256, size=50_000, dtype=np.uint8))


@settings(max_examples=60, deadline=None)
@given(block=st.sampled_from([1, 7, 64, 4096, 1 << 20]), cache_blocks=st.integers(0, 5),
       reads=st.lists(st.tuples(st.integers(0, 50_100), st.integers(0, 30_000)), min_size=1, max_size=12))
def test_reads_equal_slices(block, cache_blocks, reads):
    """Any sequence of seek+readinto through any block/cache geometry returns exactly the file's bytes
    (cached, uncached, straddling blocks, past the end)."""
    fsspec.filesystem("memory").pipe("/remote-test/blob.bin", _BLOB)
    f = RemoteFile("memory:///remote-test/blob.bin", block_size=block, cache_size=cache_blocks * block,
                   request_size=max(1, 3 * block))
    for off, n in reads:
        f.seek(off)
        buf = bytearray(n)
        got = f.readinto(buf)
        want = _BLOB[off:off + n]
        assert got == len(want) and bytes(buf[:got]) == want
        assert f.tell() == off + got
    assert len(f._cache) <= cache_blocks


def test_reads_equal_slices_over_http(server, www):
    ref = (www / "model.mcf").read_bytes()
    rng = _rng("http-slices")
    f = RemoteFile(server.url("model.mcf"), block_size=4096, cache_size=8 * 4096, request_size=50_000)
    for _ in range(40):
        off = int(rng.integers(0, len(ref)))
        n = int(rng.choice([1, 100, 4095, 4097, 20_000, 200_000]))
        f.seek(off)
        assert f.read(n) == ref[off:off + n]


def test_safetensors_checkpoint_directory_url(server, www, tmp_path):
    """A "directory" URL: model.safetensors, or model.safetensors.index.json and its shards, fetched by
    name (no listing), like Hugging Face's resolve URLs."""
    import json

    from safetensors.numpy import load_file, save_file

    from mcf.safetensors.reader import open_checkpoint

    rng = _rng("sharded")
    a = {"a.weight": rng.standard_normal((8, 4)).astype(np.float32)}
    b = {"b.weight": rng.standard_normal((3,)).astype(np.float16)}
    d = www / "sharded-small"
    d.mkdir(exist_ok=True)
    save_file(a, str(d / "model-00001-of-00002.safetensors"))
    save_file(b, str(d / "model-00002-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}))
    with open_checkpoint(server.url("sharded-small/")) as ck:
        assert ck.sorted_names() == ["a.weight", "b.weight"]
        _eq(ck.tensors["a.weight"].array(), a["a.weight"])
        _eq(ck.tensors["b.weight"].array(), b["b.weight"])
    single = www / "single"
    single.mkdir(exist_ok=True)
    (single / "model.safetensors").write_bytes((www / "model.safetensors").read_bytes())
    ref = load_file(str(www / "model.safetensors"))
    with open_checkpoint(server.url("single")) as ck:
        assert sorted(ck.tensors) == sorted(ref)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": "../x.safetensors"}}))
    with pytest.raises(mcf.FormatError, match="plain file names"):
        open_checkpoint(server.url("sharded-small"))
    with pytest.raises(MissingFileError):
        open_checkpoint(server.url("no-such-dir"))
