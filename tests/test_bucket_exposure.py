"""The bucket server attacked the way the outside review did, over
loopback against ``mcf bucket serve`` started as a real process and stopped by PID.

Memory bounds are measured on the server process: its peak resident set (VmHWM in /proc/<pid>/status)
before and after each refused body may grow by less than 64 MiB.  Every loop is bounded by a count and
a deadline.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import socket
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
from _bucket_attacks import bomb, good_npz, npz
from _bucket_server import free_port, open_fds, peak_rss_bytes, serve

pytest.importorskip("starlette", reason="the server needs the 'server' extra (starlette)")
pytest.importorskip("uvicorn", reason="the server needs the 'server' extra (uvicorn)")

TOKEN = "exposure-test-token-0123456789abcdefghij"
MiB = 1 << 20
REFUSED_GROWTH = 64 * MiB


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def request(base, method, path, body=None, headers=None, token=TOKEN, timeout=60):
    """(status, parsed JSON or raw bytes, headers) over one fresh connection."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    h = dict(headers or {})
    if token is not None:
        h.setdefault("Authorization", f"Bearer {token}")
    try:
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
        try:
            parsed = json.loads(data) if data else None
        except ValueError:
            parsed = data
        return r.status, parsed, dict(r.getheaders())
    finally:
        conn.close()


UPLOAD = {"Content-Type": "application/octet-stream"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("exposed")
    with serve(root, TOKEN, "--max-body-bytes", str(256 * MiB)) as (base, proc):
        st, out, _ = request(base, "POST", "/mcrp/v1/contexts?model_id=m&content=seed", good_npz(), UPLOAD)
        assert st == 201, out
        yield base, proc, root, out["context_id"]


def growth_of(proc, fn):
    """Run ``fn`` (a request) and return (its result, growth of the server's peak RSS in bytes)."""
    before = peak_rss_bytes(proc.pid)
    out = fn()
    time.sleep(0.2)  # the handler thread finishes its cleanup
    grew = peak_rss_bytes(proc.pid) - before
    print(f"server peak RSS {before / MiB:.1f} MiB, grew by {grew / MiB:.2f} MiB")  # the report's figures (-s)
    return out, grew


def warm_up(base):
    """Touch every code path once, so imports and first-use allocations are not counted as growth."""
    request(base, "POST", "/mcrp/v1/contexts?model_id=m&content=warmup", good_npz(1), UPLOAD)
    request(base, "POST", "/mcrp/v1/contexts?model_id=m&content=warmup2", bomb((2, 2, 64, 64), corrupt_tail=True),
            UPLOAD)
    request(base, "POST", "/mcrp/v1/registry/rebuild", b"{}", JSON)


# ------------------------------------------------------------------------------------------------
# decompression bombs
# ------------------------------------------------------------------------------------------------
def test_npz_bomb_is_refused_with_413_in_bounded_memory(server):
    """Reported: a 2 MiB .npz declaring two 1 GiB arrays was accepted (201) and cost 3 GiB.  Here: two
    2 GiB members in ~4 MiB, refused from their headers with 413."""
    base, proc, root, _ = server
    warm_up(base)
    body = bomb()
    assert len(body) < 8 * MiB
    (st, out, _), grew = growth_of(proc, lambda: request(
        base, "POST", "/mcrp/v1/contexts?model_id=m&content=bomb", body, UPLOAD))
    assert st == 413 and out["status"] == "error" and "declare" in out["error"], out
    assert grew < REFUSED_GROWTH, f"server peak RSS grew by {grew / MiB:.1f} MiB"


def test_damaged_stream_within_the_limit_is_refused_in_bounded_memory(server):
    """A bomb whose declared size is within the limit (2 x 96 MiB) but whose deflate stream is damaged at
    the very end: refused (422) after streaming it to scratch space, never into memory."""
    base, proc, root, _ = server
    warm_up(base)
    body = bomb((12, 8, 1024, 256), corrupt_tail=True)
    (st, out, _), grew = growth_of(proc, lambda: request(
        base, "POST", "/mcrp/v1/contexts?model_id=m&content=damaged", body, UPLOAD))
    assert st == 422 and ("damaged" in out["error"] or "CRC" in out["error"]), out
    assert grew < REFUSED_GROWTH, f"server peak RSS grew by {grew / MiB:.1f} MiB"


def test_body_over_the_limit_without_length_is_cut_off(server):
    """A chunked upload (no Content-Length) of 300 MiB against a 256 MiB limit: 413 once the limit
    passes, and the body was spooled to disk, not held in memory."""
    base, proc, root, _ = server
    warm_up(base)

    def send():
        host, port = base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        piece = bytes(MiB)
        try:
            conn.request("POST", "/mcrp/v1/contexts?model_id=m&content=huge", body=(piece for _ in range(300)),
                         headers={**UPLOAD, "Authorization": f"Bearer {TOKEN}"}, encode_chunked=True)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: its answer is waiting
        try:
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    (st, out), grew = growth_of(proc, send)
    assert st == 413 and "limit" in out["error"], out
    assert grew < REFUSED_GROWTH, f"server peak RSS grew by {grew / MiB:.1f} MiB"


# ------------------------------------------------------------------------------------------------
# JSON bodies
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["promote", "demote", "query"])
def test_json_bodies_are_capped(server, route):
    """Reported: promote, demote, query read the whole body with no limit (1.5 GiB into memory before a
    400).  A declared 1.5 GiB body is refused from its header; a chunked one after 1 MiB."""
    base, proc, root, cid = server
    warm_up(base)
    st, out, _ = request(base, "POST", f"/mcrp/v1/contexts/{cid}/{route}", None,
                         {**JSON, "Content-Length": str(1536 * MiB)})
    assert st == 413, out

    def stream():
        host, port = base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        piece = b" " * MiB
        sent = 0
        try:
            conn.putrequest("POST", f"/mcrp/v1/contexts/{cid}/{route}")
            for k, v in {**JSON, "Authorization": f"Bearer {TOKEN}", "Transfer-Encoding": "chunked"}.items():
                conn.putheader(k, v)
            conn.endheaders()
            for _ in range(200):  # up to 200 MiB
                conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            r = conn.getresponse()
            return r.status, json.loads(r.read()), sent
        finally:
            conn.close()

    (st, out, sent), grew = growth_of(proc, stream)
    assert st == 413, out
    assert grew < REFUSED_GROWTH, f"server peak RSS grew by {grew / MiB:.1f} MiB after {sent / MiB:.0f} MiB sent"


# ------------------------------------------------------------------------------------------------
# no client input gives a 500
# ------------------------------------------------------------------------------------------------
def hostile_uploads():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((2, 2, 6, 4)).astype(np.float32)
    npy = io.BytesIO()
    np.save(npy, k)
    many = io.BytesIO()
    with zipfile.ZipFile(many, "w") as z:
        for i in range(10_000):
            z.writestr(f"x{i}.npy", b"")
    structured = np.zeros((2, 2, 6, 4), dtype=[("a", "<f4"), ("b", "<i4")])
    return {
        "npy-not-npz": (npy.getvalue(), 422),
        "truncated-zip": (good_npz()[:-40], 422),
        "truncated-middle": (good_npz()[:300], 422),
        "empty": (b"", 422),
        "string-array": (npz(k=k.astype(str), v=k.astype(str)), 422),
        "complex": (npz(k=k.astype(np.complex64), v=k.astype(np.complex64)), 422),
        "bool": (npz(k=k > 0, v=k > 0), 422),
        "datetime": (npz(k=k.astype("M8[s]"), v=k.astype("M8[s]")), 422),
        "structured": (npz(k=structured, v=structured), 422),
        "object": (npz(k=np.array([[[[None]]]], dtype=object), v=np.array([[[[None]]]], dtype=object)), 422),
        "missing-v": (npz(k=k), 422),
        "extra-member": (npz(k=k, v=k, w=k), 422),
        "3-d": (npz(k=k[0], v=k[0]), 422),
        "shape-mismatch": (npz(k=k, v=k[:, :, :5]), 422),
        "10000-members": (many.getvalue(), 422),
        "zero-layers": (npz(k=k[:0], v=k[:0]), 400),
        "nan-as-int8": (npz(k=np.full_like(k, np.nan), v=k), 400),
    }


@pytest.mark.parametrize("case", sorted(hostile_uploads()))
def test_hostile_uploads_get_a_documented_4xx(server, case):
    base, proc, root, _ = server
    body, want = hostile_uploads()[case]
    dtype = "&dtype=int8" if case == "nan-as-int8" else ""
    st, out, headers = request(base, "POST", f"/mcrp/v1/contexts?model_id=m&content={case}{dtype}", body, UPLOAD)
    assert st == want, (case, st, out)
    assert headers["content-type"] == "application/json" and out["status"] == "error"
    assert str(root) not in out["error"] and os.path.realpath(root) not in out["error"]


def test_fortran_order_and_integer_arrays_are_accepted(server):
    base, proc, root, _ = server
    k = np.asfortranarray(np.arange(2 * 2 * 6 * 4, dtype=np.int16).reshape(2, 2, 6, 4))
    st, out, _ = request(base, "POST", "/mcrp/v1/contexts?model_id=m&content=fortran&dtype=float32",
                         npz(k=k, v=k + 1), UPLOAD)
    assert st == 201, out
    st, raw, _ = request(base, "GET", f"/mcrp/v1/contexts/{out['context_id']}/kv")
    from mcf.bucket import open_kv

    with open_kv(memoryview(raw)) as f:
        np.testing.assert_array_equal(f.load()[1][0], k[1].astype(np.float32))


@pytest.mark.parametrize("query,want", [
    ("model_id=m&content=x&token_ids=1,2", 400),          # both: as in the library
    ("model_id=m", 400),                                  # neither
    ("model_id=m&token_ids=1234567890123456789", 400),    # 19 digits: outside the documented pattern
    ("model_id=m&token_ids=-1,2", 400),
    ("model_id=m&token_ids=1_000", 400),
    ("model_id=m&token_ids=", 400),
    ("model_id=..%2Fetc&content=x", 400),
    ("model_id=m&content=x&dtype=complex64", 400),
    ("model_id=m&content=x&ttl=nan", 400),
    ("model_id=m&content=x&ttl=-5", 400),
])
def test_bad_ingest_parameters_are_400_before_the_body_is_read(server, query, want):
    base, proc, root, _ = server
    st, out, _ = request(base, "POST", f"/mcrp/v1/contexts?{query}", good_npz(3), UPLOAD)
    assert st == want, out


def test_hostile_json_bodies(server):
    base, proc, root, cid = server
    for body in (b"[" * 100_000, b"{" * 100_000, b'{"a":' * 50_000, b"\xff\xfe", b"[]", b"1", b'"x"',
                 json.dumps({"target_tier": ["warm"]}).encode(), json.dumps({"device": {"x": 1}}).encode()):
        for route in ("promote", "demote", "query"):
            st, out, _ = request(base, "POST", f"/mcrp/v1/contexts/{cid}/{route}", body, JSON)
            assert st in (400, 501) and out["status"] == "error", (route, body[:20], st, out)
    st, out, _ = request(base, "POST", "/mcrp/v1/registry/rebuild", b'{"x": 1}', JSON)
    assert st == 400


def test_errors_never_show_the_bucket_path(server):
    """Errors over HTTP name files relative to the bucket (``<bucket>/...``), never its absolute path."""
    base, proc, root, _ = server
    st, out, _ = request(base, "POST", "/mcrp/v1/contexts?model_id=m&content=victim", good_npz(9), UPLOAD)
    cid = out["context_id"]
    kv = root / "contexts" / cid / "kv_data.mcb"
    kv.write_bytes(kv.read_bytes()[:70])
    seen = []
    for method, path in (("GET", f"/mcrp/v1/contexts/{cid}/kv"), ("POST", f"/mcrp/v1/contexts/{cid}/promote"),
                         ("GET", "/mcrp/v1/contexts/ctx_" + "0" * 32), ("DELETE", "/mcrp/v1/contexts/ctx_" + "1" * 32)):
        post = method == "POST"
        st, out, _ = request(base, method, path, b"{}" if post else None, JSON if post else None)
        assert 400 <= st < 500, (path, st, out)
        seen.append(out["error"])
    assert any("<bucket>/contexts/" in e and "kv_data.mcb" in e for e in seen), seen
    for e in seen:
        assert str(root) not in e and os.path.realpath(root) not in e, e
    # the reasons a rebuild lists for skipped contexts are scrubbed the same way
    (root / "contexts" / cid / "metadata.json").write_text("{")
    st, out, _ = request(base, "POST", "/mcrp/v1/registry/rebuild")
    assert st == 200 and [x["context_id"] for x in out["skipped"]] == [cid]
    assert "<bucket>/contexts/" in out["skipped"][0]["reason"] and str(root) not in json.dumps(out)
    request(base, "DELETE", f"/mcrp/v1/contexts/{cid}")


# ------------------------------------------------------------------------------------------------
# browsers, DNS rebinding, tokens and binding
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,ctype,body", [
    ("/mcrp/v1/contexts?model_id=m&content=form", "text/plain", "npz"),
    ("/mcrp/v1/contexts?model_id=m&content=form", "application/x-www-form-urlencoded", "npz"),
    ("/mcrp/v1/contexts?model_id=m&content=form", "multipart/form-data; boundary=x", "npz"),
    ("/mcrp/v1/contexts?model_id=m&content=form", None, "npz"),
    ("/mcrp/v1/contexts/{cid}/promote", "text/plain", b'{"target_tier": "warm"}'),
    ("/mcrp/v1/contexts/{cid}/promote", "application/x-www-form-urlencoded", b""),
    ("/mcrp/v1/registry/rebuild", "text/plain", b""),
    ("/mcrp/v1/registry/rebuild", "application/x-www-form-urlencoded", b"a=b"),
])
def test_state_changing_routes_refuse_browser_content_types(server, path, ctype, body):
    """Reported: ingest/promote/rebuild accepted text/plain and form bodies, which a web page sends
    cross-site without a CORS preflight.  They are now 415."""
    base, proc, root, cid = server
    headers = {} if ctype is None else {"Content-Type": ctype}
    st, out, _ = request(base, "POST", path.format(cid=cid), good_npz(4) if body == "npz" else body, headers)
    assert st == 415, out


def test_bodyless_writes_and_json_types_still_work(server):
    base, proc, root, cid = server
    assert request(base, "POST", "/mcrp/v1/registry/rebuild")[0] == 200  # no body, no type: the defaults
    assert request(base, "POST", f"/mcrp/v1/contexts/{cid}/demote", b"", {"Content-Type": "application/json"})[0] == 200
    assert request(base, "POST", f"/mcrp/v1/contexts/{cid}/demote", b"{}",
                   {"Content-Type": "application/json; charset=utf-8"})[0] == 200


@pytest.mark.parametrize("host,want", [("evil.example", 400), ("evil.example:{port}", 400), ("127.0.0.1:{port}", 200),
                                       ("localhost:{port}", 200), ("LOCALHOST.", 200), ("[::1]:{port}", 200),
                                       ("127.0.0.1.evil.example", 400), ("", 400)])
def test_host_header_allow_list(server, host, want):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example."""
    base, proc, root, cid = server
    port = base.rsplit(":", 1)[1]
    st, out, _ = request(base, "GET", "/mcrp/v1/registry", headers={"Host": host.format(port=port)})
    assert st == want, out


def test_cross_origin_writes_are_refused(server):
    base, proc, root, cid = server
    port = base.rsplit(":", 1)[1]
    for origin in ("http://evil.example", "null", f"http://localhost:{int(port) + 1}", "https://127.0.0.1:" + port):
        st, out, _ = request(base, "POST", "/mcrp/v1/registry/rebuild", headers={"Origin": origin})
        assert st == 403, (origin, out)
        st, _, _ = request(base, "DELETE", f"/mcrp/v1/contexts/{cid}", headers={"Origin": origin})
        assert st == 403
    st, _, headers = request(base, "GET", "/mcrp/v1/registry", headers={"Origin": "http://evil.example"})
    assert st == 200 and not any(h.lower().startswith("access-control") for h in headers)  # no CORS: unreadable
    st, _, _ = request(base, "POST", "/mcrp/v1/registry/rebuild", headers={"Origin": base})
    assert st == 200  # the server's own origin


def test_allow_host_option(tmp_path):
    with serve(tmp_path, TOKEN, "--allow-host", "mcb.internal") as (base, proc):
        port = base.rsplit(":", 1)[1]
        assert request(base, "GET", "/mcrp/v1/registry", headers={"Host": f"mcb.internal:{port}"})[0] == 200
        assert request(base, "GET", "/mcrp/v1/registry", headers={"Host": "other.internal"})[0] == 400


def run_cli(*args, env=None, timeout=30):
    e = dict(os.environ)
    e.pop("MCF_BUCKET_TOKEN", None)
    e.pop("MCB_TOKEN", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "mcf.cli", "bucket", "serve", *args], capture_output=True, text=True,
                          env=e, timeout=timeout)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "example.org"])
def test_no_token_means_loopback_only(tmp_path, host):
    """Protected mode: without a token, refuse to listen anywhere but loopback (nothing is bound)."""
    p = run_cli("--root", str(tmp_path), "--host", host, "--port", str(free_port()))
    assert p.returncode == 1 and "without a token" in p.stderr, p.stderr


@pytest.mark.parametrize("args,env,message", [
    (["--token", ""], {}, "--token is empty"),
    ([], {"MCF_BUCKET_TOKEN": ""}, "MCF_BUCKET_TOKEN is set but empty"),
    ([], {"MCB_TOKEN": " "}, "MCB_TOKEN is set but empty"),
    (["--token", "has space inside it 0123456789abcdefgh"], {}, "printable ASCII"),
    (["--allow-host", "*"], {}, "needs a token"),
])
def test_bad_tokens_are_errors(tmp_path, args, env, message):
    p = run_cli("--root", str(tmp_path), "--port", str(free_port()), *args, env=env)
    assert p.returncode == 1 and message in p.stderr, p.stderr


def test_token_file(tmp_path):
    tf = tmp_path / "token"
    tf.write_text(TOKEN + "\n")
    os.chmod(tf, 0o600)
    with serve(tmp_path / "b", None, "--token-file", str(tf)) as (base, proc):
        assert request(base, "GET", "/mcrp/v1/registry", token=TOKEN)[0] == 200
        assert request(base, "GET", "/mcrp/v1/registry", token=TOKEN + "x")[0] == 401
        assert request(base, "GET", "/mcrp/v1/registry", token=None)[0] == 401
    empty = tmp_path / "empty"
    empty.write_text("\n")
    p = run_cli("--root", str(tmp_path / "b"), "--port", str(free_port()), "--token-file", str(empty))
    assert p.returncode == 1 and "token file is empty" in p.stderr


def test_token_warnings_are_printed(tmp_path):
    """A world-readable token file, a short token and --token on the command line each draw a warning
    (the server is then stopped: the warnings come before it listens)."""
    tf = tmp_path / "token"
    tf.write_text("short\n")
    os.chmod(tf, 0o644)
    port = free_port()
    e = {k: v for k, v in os.environ.items() if k not in ("MCF_BUCKET_TOKEN", "MCB_TOKEN")}
    for args, want in ((["--token-file", str(tf)], ["readable by other users", "5 bytes"]),
                       (["--token", "x" * 40], ["process list"])):
        proc = subprocess.Popen([sys.executable, "-m", "mcf.cli", "bucket", "serve", "--root", str(tmp_path / "b"),
                                 "--port", str(port), *args], env=e, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                text=True)
        try:
            deadline = time.monotonic() + 30
            lines = []
            while time.monotonic() < deadline and not all(any(w in ln for ln in lines) for w in want):
                line = proc.stderr.readline()
                if not line:
                    break
                lines.append(line)
            assert all(any(w in ln for ln in lines) for w in want), lines
        finally:
            proc.terminate()
            proc.communicate(timeout=20)


# ------------------------------------------------------------------------------------------------
# slow clients
# ------------------------------------------------------------------------------------------------
def wait_closed(socks, deadline):
    """Sockets the server closed before ``deadline`` (EOF or reset on read)."""
    closed = set()
    while time.monotonic() < deadline and len(closed) < len(socks):
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                if s.recv(65536) == b"":
                    closed.add(i)
            except BlockingIOError:
                pass
            except (ConnectionResetError, OSError):
                closed.add(i)
        time.sleep(0.05)
    return closed


def test_half_open_connections_are_capped_and_timed_out(tmp_path):
    """Reported: connections that never finish their headers stayed open, so 1,000 of them exhausted the
    server's descriptors.  300 here against a cap of 40 and a 1 s header deadline."""
    limits = ("--max-connections", "40", "--header-timeout", "1", "--body-timeout", "1")
    with serve(tmp_path, TOKEN, *limits) as (base, proc):
        port = int(base.rsplit(":", 1)[1])
        baseline = open_fds(proc.pid)
        socks = []
        try:
            for _ in range(300):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET /mcrp/v1/registry HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # never finished
                s.setblocking(False)
                socks.append(s)
            time.sleep(0.3)
            assert open_fds(proc.pid) <= baseline + 40 + 5  # the rest were refused at once
            closed = wait_closed(socks, time.monotonic() + 15)
            assert len(closed) == len(socks), f"{len(socks) - len(closed)} half-open connections still open"
            assert open_fds(proc.pid) <= baseline + 2
            # a body that stops coming is cut off too
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /mcrp/v1/registry/rebuild HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nAuthorization: Bearer " + TOKEN.encode()
                      + b"\r\nContent-Length: 100\r\n\r\n{")
            s.setblocking(False)
            socks.append(s)
            assert wait_closed([s], time.monotonic() + 15) == {0}
        finally:
            for s in socks:
                s.close()
        assert request(base, "GET", "/mcrp/v1/registry")[0] == 200  # and the server still answers


def test_connections_over_the_cap_get_503(tmp_path):
    """Past the cap, with every open connection an authorised request in progress (so none is closed
    to make room: tests/test_bucket_slow_clients.py), a new connection gets 503."""
    with serve(tmp_path, TOKEN, "--max-connections", "4", "--header-timeout", "30") as (base, proc):
        port = int(base.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
        for s in held:
            s.sendall(b"POST /mcrp/v1/registry/rebuild HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                      b"\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 2\r\n\r\n")
        try:
            time.sleep(0.2)
            st, out, _ = request(base, "GET", "/mcrp/v1/registry")
            assert st == 503 and "too many open connections" in out["error"]
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 10
        while request(base, "GET", "/mcrp/v1/registry")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_keep_alive_connections_still_work(tmp_path):
    with serve(tmp_path, TOKEN, "--header-timeout", "2") as (base, proc):
        host, port = base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            for _ in range(20):
                conn.request("GET", "/mcrp/v1/registry", headers={"Authorization": f"Bearer {TOKEN}"})
                r = conn.getresponse()
                r.read()
                assert r.status == 200
        finally:
            conn.close()
