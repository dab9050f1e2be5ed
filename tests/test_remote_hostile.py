"""Hostile and changing servers against every client of ``mcf.remote``: mcf's own HTTP client (the default
for http(s) URLs and, through pre-signed URLs, for S3), obstore's client and fsspec's aiohttp.

- an answer larger than its range (a ``Content-Length`` of 1 TiB, an endless chunked body) is cut off at
  the range's length: the server manages to send little more than the range before the client hangs up;
- a server that drips bytes fails the request within ``timeout + bytes / min_rate``;
- a redirect to another origin carries no credential (API keys, Basic auth, an S3 session token);
- a file replaced while it is read is an error, whether the server honours ``If-Match`` or not;
- a column share of a matrix over HTTP downloads close to its own bytes, and ``bytes_read`` says what came.
"""

from __future__ import annotations

import errno
import http.server
import socket
import threading

import numpy as np
import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

import mcf  # noqa: E402
from mcf import MCFIOError  # noqa: E402
from mcf.remote import RemoteFile, open_remote  # noqa: E402

DATA = bytes(np.random.default_rng(7).integers(0, 256, size=4 << 20, dtype=np.uint8))


@pytest.fixture(params=["http", "obstore", "fsspec"])
def backend(request):
    if request.param == "obstore":
        pytest.importorskip("obstore", reason="obstore is not installed (the remote extra installs it on Python 3.11 "
                                              "and later)")
    return request.param


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _range(self):
        h = self.headers.get("Range")
        if not h or not h.startswith("bytes="):
            return None
        a, b = h[6:].split("-")
        return int(a), int(b) + 1

    def do_HEAD(self):
        self.server.seen.append(("HEAD", self.path, dict(self.headers)))
        self.server.head(self)

    def do_GET(self):
        self.server.seen.append(("GET", self.path, dict(self.headers)))
        self.server.get(self, self._range())

    def send_all(self, data: bytes):
        """Write ``data``, counting what the client accepted before it hung up."""
        try:
            for i in range(0, len(data), 1 << 16):
                self.wfile.write(data[i:i + (1 << 16)])
                self.server.sent += min(1 << 16, len(data) - i)
        except OSError:
            self.close_connection = True


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass

    def __init__(self, host="127.0.0.1"):
        super().__init__((host, 0), _Handler)
        self.seen = []
        self.sent = 0
        self.data = DATA
        self.etag = '"v1"'
        self.modified = "Wed, 01 Jan 2025 00:00:00 GMT"
        self.honour_if_match = True
        self.after_first_get = None      # called once, after the first GET is answered
        self.head = self.plain_head
        self.get = self.plain_get
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path="/blob.bin"):
        return f"http://{self.server_address[0]}:{self.server_address[1]}{path}"

    def stop(self):
        self.shutdown()
        self.server_close()

    # -- a well-behaved server, its version in ETag and Last-Modified ---------------------------------------
    def plain_head(self, h):
        h.send_response(200)
        h.send_header("Content-Length", str(len(self.data)))
        if self.etag:
            h.send_header("ETag", self.etag)
        if self.modified:
            h.send_header("Last-Modified", self.modified)
        h.end_headers()

    def plain_get(self, h, rng):
        im = h.headers.get("If-Match")
        if self.honour_if_match and im is not None and self.etag and im != self.etag:
            h.send_response(412)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        a, b = rng or (0, len(self.data))
        body = self.data[a:b]
        h.send_response(206 if rng else 200)
        if rng:
            h.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(self.data)}")
        h.send_header("Content-Length", str(len(body)))
        if self.etag:
            h.send_header("ETag", self.etag)
        if self.modified:
            h.send_header("Last-Modified", self.modified)
        h.end_headers()
        h.send_all(body)
        if self.after_first_get is not None:
            f, self.after_first_get = self.after_first_get, None
            f()


@pytest.fixture
def srv():
    s = _Server()
    yield s
    s.stop()


def _open(url, backend, **kw):
    kw.setdefault("retries", 0)
    kw.setdefault("retry_delay", 0.0)
    return RemoteFile(url, backend=backend, **kw)


# -- answers larger than the range --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["huge-length", "endless-chunked"])
def test_an_answer_larger_than_its_range_is_cut_off(srv, backend, kind):
    """The server answers a 1 MiB range with ``Content-Length: 2**40`` (or an endless chunked body) and keeps
    sending; the client refuses it after at most the range plus what the sockets buffer, not the 64 MiB the
    server would send (before, obstore and s3fs buffered the whole answer: memory grew at network speed)."""
    endless = bytes(64 << 20)

    def get(h, rng):
        a, b = rng
        h.send_response(206)
        h.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(srv.data)}")
        if kind == "huge-length":
            h.send_header("Content-Length", str(2 ** 40))
            h.end_headers()
            h.send_all(endless)
        else:
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            try:
                for i in range(0, len(endless), 1 << 16):
                    h.wfile.write(b"10000\r\n" + endless[i:i + (1 << 16)] + b"\r\n")
                    srv.sent += 1 << 16
            except OSError:
                pass
        h.close_connection = True

    srv.get = get
    f = _open(srv.url(), backend, request_size=1 << 20)
    with pytest.raises(MCFIOError, match="more than|announces|no Content-Length"):
        f.readinto(bytearray(1 << 20))
    # what the client swallowed: the range, one streaming chunk and the sockets' buffers, never the 64 MiB
    assert srv.sent <= (1 << 20) + (24 << 20), srv.sent


# -- a server that drips ---------------------------------------------------------------------------------------
def test_a_dripping_server_fails_within_the_minimum_rate(srv, backend):
    """One byte every 50 ms keeps every silence short; the request still fails once it is slower than
    ``min_rate`` after ``timeout`` seconds (before: a 1 KiB read took as long as the server liked)."""
    stop = threading.Event()

    def get(h, rng):
        a, b = rng
        h.send_response(206)
        h.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(srv.data)}")
        h.send_header("Content-Length", str(b - a))
        h.end_headers()
        try:
            for i in range(a, b):
                if stop.wait(0.05):
                    break
                h.wfile.write(srv.data[i:i + 1])
                h.wfile.flush()
                srv.sent += 1
        except OSError:
            pass
        h.close_connection = True

    srv.get = get
    f = _open(srv.url(), backend, timeout=0.5, min_rate=2000.0, block_size=4096, cache_size=0)
    try:
        with pytest.raises(MCFIOError, match="min_rate|timed out|imeout|Timeout") as ei:
            f.read(2048)            # 2 KiB at 20 bytes/s: 100 s if nothing stopped it
        assert srv.url() in str(ei.value)
        assert srv.sent < 2048      # it gave up long before the server finished dripping
    finally:
        stop.set()


# -- redirects ----------------------------------------------------------------------------------------------------
@pytest.fixture
def other():
    s = _Server(host="127.0.0.2")       # another origin (another host) on loopback
    yield s
    s.stop()


def _redirect_to(target):
    def answer(h, rng=None):
        h.send_response(307)
        h.send_header("Location", target.url(h.path))
        h.send_header("Content-Length", "0")
        h.end_headers()
    return answer


@pytest.mark.parametrize("how", ["headers", "userinfo"])
def test_a_redirect_to_another_origin_carries_no_credential(srv, other, backend, how):
    srv.head = _redirect_to(other)
    srv.get = _redirect_to(other)
    opts = {"headers": {"X-Api-Key": "KEY-SECRET", "Authorization": "Bearer TOKEN-SECRET"}} if how == "headers" \
        else {}
    url = srv.url() if how == "headers" else srv.url().replace("http://", "http://user:PW-SECRET@")
    if backend == "obstore" and how == "userinfo":
        # obstore's own client cannot keep a password from another origin: such URLs are refused outright
        with pytest.raises(mcf.InvalidArgumentError, match="credentials") as ei:
            _open(url, "obstore")
        assert "PW-SECRET" not in str(ei.value) and srv.seen == [] and other.seen == []
        return
    if backend == "obstore":
        # obstore (reqwest) cannot be told not to forward headers: mcf's default client is the answer to that
        f = _open(url, "http", storage_options=opts)
    else:
        f = _open(url, backend, storage_options=opts)
    assert f.read(100) == DATA[:100]
    first = [h for _, _, h in srv.seen]
    moved = [h for _, _, h in other.seen]
    assert moved, "the redirect was not followed"
    text = repr(moved).lower()
    for secret in ("key-secret", "token-secret", "authorization", "x-api-key"):
        assert secret not in text, (secret, moved)
    if how == "headers":
        assert all(h.get("X-Api-Key") == "KEY-SECRET" for h in first)      # the first origin got them


def test_a_redirect_within_the_origin_keeps_the_headers(srv):
    def get(h, rng):
        if h.path == "/blob.bin":
            h.send_response(302)
            h.send_header("Location", "/moved.bin")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        srv.plain_get(h, rng)

    def head(h):
        if h.path == "/blob.bin":
            return get(h, None)
        srv.plain_head(h)

    srv.get, srv.head = get, head
    f = _open(srv.url(), "http", storage_options={"headers": {"X-Api-Key": "K"}})
    assert f.read(10) == DATA[:10]
    assert all(h.get("X-Api-Key") == "K" for _, _, h in srv.seen)
    assert any(p == "/moved.bin" for _, p, _ in srv.seen)


def test_an_s3_session_token_never_reaches_another_origin(srv, other):
    """S3 requests are pre-signed URLs fetched by mcf's client, and a signed request follows no redirect to
    another origin (its signature is for the endpoint's host anyway): the next origin never sees the session
    token, not even where the endpoint copies the whole signed URL into its Location (obstore's own client
    sent x-amz-security-token along as a header)."""
    pytest.importorskip("obstore", reason="obstore signs S3 URLs (the remote extra installs it on Python 3.11+)")
    srv.head = _redirect_to(other)
    srv.get = _redirect_to(other)
    opts = {"endpoint_url": srv.url("").rstrip("/"), "region": "us-east-1", "aws_access_key_id": "AKID",
            "aws_secret_access_key": "SK-SECRET", "aws_session_token": "SESSION-SECRET"}
    with pytest.raises(MCFIOError, match="another origin") as ei:
        RemoteFile("s3://bucket/blob.bin", storage_options=opts, retries=0, retry_delay=0.0)
    assert "SESSION-SECRET" not in str(ei.value) and "127.0.0.2" in str(ei.value)
    assert not other.seen
    assert "sk-secret" not in repr(srv.seen).lower()      # the secret key itself is never sent anywhere


def test_redirect_loops_are_bounded(srv):
    srv.head = srv.get = _redirect_to(srv)       # to itself, forever
    with pytest.raises(MCFIOError, match="redirects"):
        _open(srv.url(), "http")


# -- a file replaced while it is read ----------------------------------------------------------------------
@pytest.mark.parametrize("honours", [True, False], ids=["if-match-honoured", "if-match-ignored"])
@pytest.mark.parametrize("version", ["etag", "last-modified"])
def test_a_file_replaced_during_a_load_is_an_error(srv, backend, honours, version):
    srv.honour_if_match = honours
    if version == "last-modified":
        srv.etag = None

    def replace():
        srv.data = bytes(reversed(DATA))
        srv.etag = '"v2"' if version == "etag" else None
        srv.modified = "Thu, 02 Jan 2025 00:00:00 GMT"

    f = _open(srv.url(), backend, request_size=1 << 20, concurrency=1, block_size=1 << 16)
    srv.after_first_get = replace
    with pytest.raises(MCFIOError, match="changed while it was read") as ei:
        f.readinto(bytearray(4 << 20))
    assert ei.value.errno == errno.ESTALE and srv.url() in str(ei.value)


# -- bytes downloaded by a column share ----------------------------------------------------------------------
def test_a_column_share_downloads_close_to_its_bytes(srv, tmp_path):
    """A quarter of the columns of a matrix (2 KiB of every 8 KiB row) over HTTP: the gaps between rows are
    not fetched (before: neighbouring ranges under 1 MiB apart were merged and every rank downloaded the
    whole tensor), and ``bytes_read`` counts what the server sent."""
    w = np.random.default_rng(1).standard_normal((512, 2048)).astype(np.float32)
    with mcf.Writer(str(tmp_path / "m.mcf")) as wr:
        wr.add_tensor("w", w)
    srv.data = (tmp_path / "m.mcf").read_bytes()
    src = open_remote(srv.url(), cache_size=0)
    with mcf.open(src) as c:
        before = src.bytes_read
        sent0 = srv.sent
        got = mcf.load_state_dict(c, names=["w"], tp_rank=1, tp_size=4, tp_dim=1)["w"]
        share = got.nbytes
        assert np.array_equal(got, w[:, 512:1024])
        downloaded = srv.sent - sent0
        assert downloaded <= 1.3 * share, (downloaded, share)
        assert src.bytes_read - before == downloaded       # what arrived, not what was asked for


def test_bytes_read_counts_a_retried_answer(srv):
    """A body cut short and retried: both attempts' bytes count."""
    calls = {"n": 0}

    def get(h, rng):
        calls["n"] += 1
        if calls["n"] == 1:
            a, b = rng
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(srv.data)}")
            h.send_header("Content-Length", str(b - a))
            h.end_headers()
            h.send_all(srv.data[a:a + (b - a) // 2])
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        srv.plain_get(h, rng)

    srv.get = get
    f = RemoteFile(srv.url(), retries=2, retry_delay=0.0, request_size=1 << 20)
    buf = bytearray(1 << 20)
    f.readinto(buf)
    assert bytes(buf) == DATA[:1 << 20]
    assert f.bytes_fetched == (1 << 20) + (1 << 19)


# -- settings and paths no request can carry ------------------------------------------------------------------
@pytest.mark.parametrize("client", ["auto", "obstore"])
def test_a_region_with_a_newline_is_refused_before_any_request(srv, client):
    """obstore's signer panics on it (pyo3's PanicException derives from BaseException and escaped every
    ``except Exception``); it is refused as an argument now, before a request is made."""
    if client == "obstore":
        pytest.importorskip("obstore", reason="obstore is not installed (the remote extra installs it on Python "
                                              "3.11 and later)")
    opts = {"endpoint_url": srv.url("").rstrip("/"), "region": "us\neast-1", "aws_access_key_id": "A",
            "aws_secret_access_key": "S"}
    with pytest.raises(mcf.InvalidArgumentError, match="region"):
        RemoteFile("s3://bucket/blob.bin", storage_options=opts, backend=client, retries=3, retry_delay=0.0)
    assert srv.seen == []


@pytest.mark.parametrize("client", ["auto", "obstore"])
def test_an_object_path_obstore_cannot_parse_is_not_retried(srv, client):
    """``..`` in a key: an argument error at once, not six attempts as if the network had failed."""
    pytest.importorskip("obstore", reason="obstore is not installed (the remote extra installs it on Python "
                                          "3.11 and later)")
    opts = {"endpoint_url": srv.url("").rstrip("/"), "region": "us-east-1", "aws_access_key_id": "A",
            "aws_secret_access_key": "S"}
    with pytest.raises(mcf.InvalidArgumentError, match="a/../b"):
        RemoteFile("s3://bucket/a/../b", storage_options=opts, backend=client, retries=5, retry_delay=0.0)
    assert srv.seen == []


def test_a_panic_inside_the_client_is_an_mcf_error_not_retried():
    """Whatever else makes obstore panic ends as an MCFIOError after one attempt, never a PanicException."""
    pytest.importorskip("obstore", reason="obstore is not installed (the remote extra installs it on Python 3.11 "
                                          "and later)")
    from mcf.remote._fetch import Fetcher

    class Panic(BaseException):       # what pyo3_runtime.PanicException is: not an Exception
        pass

    calls = []

    class Transport:
        def get(self, start, end, out=None):
            calls.append(start)
            raise Panic("called `Result::unwrap()` on an `Err` value")

        def classify(self, exc):
            from mcf.remote._obstore import ObstoreTransport

            return ObstoreTransport.classify(type("T", (), {"url": "s3://b/k", "etag": None})(), exc)

    from mcf.remote._plan import Part

    f = Fetcher(Transport(), url="s3://b/k", size=10, retries=5, retry_delay=0.0, concurrency=1, stats={})
    with pytest.raises(MCFIOError, match="panic"):
        f.fetch(Part(0, 10, [(0, memoryview(bytearray(10)))]))
    assert calls == [0]


# -- s3fs (backend="fsspec" for s3://, or no obstore and credentials from a role) -----------------------------
@pytest.mark.parametrize("kind", ["huge-length", "replaced"])
def test_s3fs_answers_are_read_in_bounded_pieces_and_pinned(srv, kind):
    """s3fs's cat_file holds a whole answer: mcf reads its get_object bodies itself, in 1 MiB pieces, never past
    the range, with IfMatch the ETag of the opening and the answer's ETag compared."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (mcf reads S3 without it; it is only used with "
                                       "backend='fsspec')")
    if kind == "huge-length":
        def get(h, rng):
            a, b = rng
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(srv.data)}")
            h.send_header("Content-Length", str(2 ** 40))
            h.send_header("ETag", srv.etag)
            h.end_headers()
            h.send_all(bytes(64 << 20))
            h.close_connection = True
        srv.get = get
    else:
        srv.honour_if_match = False

        def replace():
            srv.data, srv.etag = bytes(reversed(DATA)), '"v2"'
        srv.after_first_get = replace
    opts = {"endpoint_url": srv.url("").rstrip("/"), "key": "A", "secret": "S",
            "client_kwargs": {"region_name": "us-east-1"}}
    f = RemoteFile("s3://bucket/blob.bin", backend="fsspec", storage_options=opts, retries=0, retry_delay=0.0,
                   request_size=1 << 20, concurrency=1, block_size=1 << 16)
    with pytest.raises(MCFIOError, match="announces|changed while it was read"):
        f.readinto(bytearray(4 << 20))
    assert srv.sent <= (4 << 20) + (24 << 20), srv.sent


# -- TLS ------------------------------------------------------------------------------------------------------
@pytest.fixture
def tls(tmp_path):
    """An https server on loopback with a certificate made here for 127.0.0.1 (cryptography), and its PEM."""
    import datetime
    import ipaddress
    import ssl

    x509 = pytest.importorskip("cryptography.x509", reason="cryptography is not installed (the test extras have it)")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(pem)
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    s = _Server()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    s.socket = ctx.wrap_socket(s.socket, server_side=True)
    s.https = lambda path="/blob.bin": s.url(path).replace("http://", "https://")
    yield s, pem.decode()
    s.stop()


def test_https_with_the_servers_certificate(tls):
    s, pem = tls
    f = _open(s.https(), "http", storage_options={"client_options": {"root_certificate": pem}})
    assert f.read(100) == DATA[:100]
    with pytest.raises(MCFIOError, match="certificate"):
        _open(s.https(), "http")                    # not signed by a CA the machine trusts


def test_a_redirect_from_https_to_http_is_refused(tls, other):
    s, pem = tls
    s.head = _redirect_to(other)                    # other serves plain http
    with pytest.raises(MCFIOError, match="https to plain http"):
        _open(s.https(), "http", storage_options={"client_options": {"root_certificate": pem}})
    assert other.seen == []
