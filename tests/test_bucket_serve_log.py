"""What ``mcf bucket serve`` tells its operator: a line saying where it listens and
how it is protected, then one access-log line per request in the shape uvicorn users know (client,
request line, status) with the bytes sent and the time taken; ``--no-access-log`` turns the latter off.
Tokens never reach the log, nor do query strings (a client may put secrets there)."""

from __future__ import annotations

import http.client
import re
import time

import pytest
from _bucket_attacks import exchange, head, port_of
from _bucket_server import serve, server_log

pytest.importorskip("starlette", reason="the server needs the 'server' extra (starlette)")
pytest.importorskip("uvicorn", reason="the server needs the 'server' extra (uvicorn)")

TOKEN = "serve-log-token-0123456789abcdefghijklmnop"
ACCESS = re.compile(r'INFO: +127\.0\.0\.1:\d+ - "(\S+) (\S+) HTTP/1\.1" (\d{3}) (\d+) ([0-9.]+) ms$')


def get(base, path, token=TOKEN, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port_of(base), timeout=10)
    try:
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        conn.request("GET", path, headers=h)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def logged(proc, n, seconds=5):
    """The access-log lines, once at least ``n`` are there."""
    deadline = time.monotonic() + seconds
    while True:
        lines = [m.groups() for m in map(ACCESS.search, server_log(proc).splitlines())
                 if m and m.group(2) != "/mcrp/v1/openapi.json"]  # not the start-up probe
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_the_listening_line_says_where_and_how(tmp_path):
    with serve(tmp_path / "a", TOKEN) as (base, proc):
        assert f"mcf: listening on {base} (token: required)" in server_log(proc)
    with serve(tmp_path / "b", None) as (base, proc):
        assert f"mcf: listening on {base} (token: off, protected mode: loopback only)" in server_log(proc)


def test_every_request_is_logged_without_tokens_or_query_strings(tmp_path):
    secret = "sig-" + "9" * 30
    with serve(tmp_path, TOKEN) as (base, proc):
        assert get(base, "/mcrp/v1/registry")[0] == 200
        assert get(base, "/mcrp/v1/registry", token="wrong-" + secret)[0] == 401
        assert get(base, f"/mcrp/v1/models/m/contexts?force_scan=true&x={secret}")[0] == 400
        assert get(base, "/mcrp/v1/nowhere")[0] == 404
        responses, _ = exchange(base, head("GET", "/mcrp/v1/registry", "X-A: a\r\n b", token=TOKEN))
        assert responses[0][0] == 400   # refused by the HTTP layer, before the application: logged too
        responses, _ = exchange(base, head("GET", "/mcrp/v1/registry", "Connection: Upgrade, close",
                                           "Upgrade: websocket", token=TOKEN))
        assert responses[0][0] == 200   # no WebSocket here: an ordinary request, one line
        lines = logged(proc, 6)
        assert [(m, p, s) for m, p, s, _, _ in lines] == [
            ("GET", "/mcrp/v1/registry", "200"), ("GET", "/mcrp/v1/registry", "401"),
            ("GET", "/mcrp/v1/models/m/contexts?...", "400"), ("GET", "/mcrp/v1/nowhere", "404"),
            ("GET", "/mcrp/v1/registry", "400"), ("GET", "/mcrp/v1/registry", "200")], lines
        assert all(int(b) > 0 and float(ms) >= 0 for *_, b, ms in lines)
        log = server_log(proc)
        assert TOKEN not in log and secret not in log and "Bearer" not in log
        assert "WARNING" not in log, log


def test_no_access_log(tmp_path):
    with serve(tmp_path, TOKEN, "--no-access-log") as (base, proc):
        for _ in range(3):
            assert get(base, "/mcrp/v1/registry")[0] == 200
        time.sleep(0.3)
        log = server_log(proc)
        assert "mcf: listening on" in log and not logged(proc, 1, seconds=0.5), log
