"""Clients that hold connections by being slow, against a real
``mcf bucket serve`` on 127.0.0.1: readers that pipeline requests and never read the answers, floods of
unauthenticated requests, and uploads that drip a byte at a time.  What is checked is what the
attack aimed at: an authorised client still gets an answer, and the slow connections are closed
(the server's open descriptors fall back).  Every loop is bounded by a count and a deadline.
"""

from __future__ import annotations

import http.client
import json
import time

import pytest
from _bucket_attacks import (closed_by_server, connect, dripper, exchange, head, port_of, read_until_closed,
                             server_end_open, slow_reader)
from _bucket_server import serve

pytest.importorskip("starlette", reason="the server needs the 'server' extra (starlette)")
pytest.importorskip("uvicorn", reason="the server needs the 'server' extra (uvicorn)")

TOKEN = "slow-clients-token-0123456789abcdefghijkl"
UPLOAD = "application/octet-stream"


def authorised_get(base, path="/mcrp/v1/registry", timeout=10) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port_of(base), timeout=timeout)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
        r = conn.getresponse()
        r.read()
        return r.status
    except (ConnectionError, TimeoutError) as exc:
        return type(exc).__name__
    finally:
        conn.close()


def wait_for(predicate, seconds: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


# ------------------------------------------------------------------------------------------------
# slow readers
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flood", ["openapi", "unauthorised"])
def test_slow_readers_cannot_lock_out_an_authorised_client(tmp_path, flood):
    """Reported: 12 connections (the cap) pipelining 1,000 GET /openapi.json each (or 40,000 requests
    that get 401) with a small window and never reading kept every slot, and an authorised request got
    503 after 45-64 s.  Connections that have not shown the token give way to one that has."""
    with serve(tmp_path, TOKEN, "--max-connections", "12") as (base, proc):
        request = (head("GET", "/mcrp/v1/openapi.json") if flood == "openapi"
                   else head("GET", "/mcrp/v1/registry", token="wrong-token"))
        readers = [slow_reader(base, request, 1000 if flood == "openapi" else 3000, seconds=1) for _ in range(12)]
        try:
            time.sleep(1)
            statuses = [authorised_get(base) for _ in range(3)]
            assert statuses == [200] * 3, statuses
        finally:
            for s in readers:
                s.close()


def test_a_reader_that_does_not_drain_is_closed_after_the_send_timeout(tmp_path):
    """nginx's send_timeout: a client that takes no byte of its answer for that long is closed, token
    or not (here an authorised one fetching a 32 MiB KV file, which shedding would not touch, in one
    request, which the pipelining cap would not end).  Before, the connection was still open 65 s later."""
    import numpy as np

    from mcf.bucket import Bucket

    rng = np.random.default_rng(0)
    k = rng.standard_normal((8, 4096, 128)).astype(np.float32)
    cid = Bucket(tmp_path).ingest("m", [(k, k)], content="big", dtype="float32", compression="none")["context_id"]
    with serve(tmp_path, TOKEN, "--send-timeout", "2") as (base, proc):
        s = slow_reader(base, head("GET", f"/mcrp/v1/contexts/{cid}/kv", token=TOKEN), 1, seconds=0.5)
        try:
            time.sleep(0.5)
            assert server_end_open(base, s)
            assert wait_for(lambda: not server_end_open(base, s), 12), "the stalled connection is still open"
        finally:
            s.close()


def test_a_reader_that_drains_slowly_is_not_cut_off(tmp_path):
    """The send timeout measures time without progress, not the whole answer: a client reading a few KiB
    every half second gets all of a 30-response pipeline with a 1 s send timeout."""
    with serve(tmp_path, TOKEN, "--send-timeout", "1") as (base, proc):
        s = connect(base, rcvbuf=4096)
        s.sendall(head("GET", "/mcrp/v1/openapi.json") * 29 + head("GET", "/mcrp/v1/openapi.json", "Connection: close"))
        data = bytearray()
        deadline = time.monotonic() + 120
        s.settimeout(5)
        while time.monotonic() < deadline:
            piece = s.recv(16384)
            if not piece:
                break
            data += piece
            time.sleep(0.05)
        s.close()
        assert data.count(b"HTTP/1.1 200 OK") == 30


def test_pipelined_requests_per_connection_are_capped(tmp_path):
    """A connection answers a bounded number of requests that were already waiting when the previous
    answer was done, then says ``Connection: close``; the client sends the rest again on a new one (RFC
    9112 §9.3.2)."""
    with serve(tmp_path, TOKEN) as (base, proc):
        responses, closed = exchange(base, head("GET", "/mcrp/v1/registry", token=TOKEN) * 200, wait=30)
        assert closed and 1 <= len(responses) < 200, len(responses)
        assert all(r[0] == 200 for r in responses)
        assert responses[-1][1].get("connection") == "close"


def test_paced_requests_on_one_connection_are_not_capped(tmp_path):
    """Keep-alive as clients use it (one request at a time) is not pipelining."""
    with serve(tmp_path, TOKEN) as (base, proc):
        conn = http.client.HTTPConnection("127.0.0.1", port_of(base), timeout=10)
        try:
            for _ in range(150):
                conn.request("GET", "/mcrp/v1/registry", headers={"Authorization": f"Bearer {TOKEN}"})
                r = conn.getresponse()
                r.read()
                assert r.status == 200
        finally:
            conn.close()


def test_half_open_connections_give_way_to_authorised_ones(tmp_path):
    """Connections that opened and sent nothing are the first shed when the cap is reached."""
    with serve(tmp_path, TOKEN, "--max-connections", "8", "--header-timeout", "30") as (base, proc):
        held = [connect(base) for _ in range(8)]
        try:
            time.sleep(0.3)
            assert [authorised_get(base) for _ in range(3)] == [200] * 3
        finally:
            for s in held:
                s.close()


def test_authorised_connections_are_not_shed_for_unauthenticated_ones(tmp_path):
    """When every slot holds an authorised request in progress, a newcomer gets 503, not one of them."""
    with serve(tmp_path, TOKEN, "--max-connections", "4", "--body-timeout", "30") as (base, proc):
        uploads = [dripper(base, "/mcrp/v1/registry/rebuild", TOKEN, 10, "application/json") for _ in range(4)]
        try:
            time.sleep(0.3)
            responses, closed = exchange(base, head("GET", "/mcrp/v1/openapi.json"), wait=5)
            assert [r[0] for r in responses] == [503] and closed
            assert not any(closed_by_server(s) for s in uploads)
            for s in uploads:
                s.sendall(b"{}" + b" " * 8)
            for s in uploads:
                raw, _ = read_until_closed(s, time.monotonic() + 10)
                assert raw.startswith(b"HTTP/1.1 200"), raw[:100]
        finally:
            for s in uploads:
                s.close()


# ------------------------------------------------------------------------------------------------
# slow-drip uploads
# ------------------------------------------------------------------------------------------------
def test_a_drip_fed_upload_is_cut_off_by_the_minimum_rate(tmp_path):
    """Reported: one byte every 3 s with --body-timeout 4 held a slot forever (each byte renewed the
    pause deadline).  mod_reqtimeout's rule: a body has body-timeout seconds, plus one second per
    --body-min-rate bytes received."""
    with serve(tmp_path, TOKEN, "--body-timeout", "4", "--max-connections", "4") as (base, proc):
        drips = [dripper(base, "/mcrp/v1/contexts?model_id=m&content=drip", TOKEN, 100_000, UPLOAD)
                 for _ in range(4)]
        try:
            start = time.monotonic()
            cut = []
            while time.monotonic() < start + 15 and len(cut) < len(drips):
                for s in drips:
                    if s not in cut:
                        try:
                            s.send(b"P")
                        except OSError:
                            cut.append(s)
                            continue
                        if closed_by_server(s):
                            cut.append(s)
                time.sleep(0.5)
            took = time.monotonic() - start
            assert len(cut) == len(drips), f"{len(drips) - len(cut)} drip-fed uploads still open after {took:.0f} s"
            assert took < 9, took
            assert authorised_get(base) == 200
        finally:
            for s in drips:
                s.close()


def test_a_body_has_a_total_deadline(tmp_path):
    """A body that arrives fast enough for the minimum rate still has --body-deadline seconds in all."""
    with serve(tmp_path, TOKEN, "--body-deadline", "3", "--body-min-rate", "100") as (base, proc):
        s = dripper(base, "/mcrp/v1/contexts?model_id=m&content=steady", TOKEN, 10_000_000, UPLOAD)
        try:
            start = time.monotonic()
            while time.monotonic() < start + 15:
                try:
                    s.send(b"x" * 2000)
                except OSError:
                    break
                if closed_by_server(s):
                    break
                time.sleep(0.5)
            assert time.monotonic() - start < 7
        finally:
            s.close()


def test_a_body_the_server_is_slow_to_read_is_not_cut_off(tmp_path):
    """Time while the server itself is not reading (its thread pool busy, its buffer full) is not
    counted against the client: a 64 MiB upload with a 1 s pause deadline and a high minimum rate
    completes."""
    import numpy as np

    from _bucket_attacks import npz

    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 8, 4096, 128)).astype(np.float32)
    body = npz(k=k, v=k)
    with serve(tmp_path, TOKEN, "--body-timeout", "1", "--body-min-rate", "1000000") as (base, proc):
        conn = http.client.HTTPConnection("127.0.0.1", port_of(base), timeout=60)
        conn.request("POST", "/mcrp/v1/contexts?model_id=m&content=big&dtype=float32", body=body,
                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": UPLOAD})
        r = conn.getresponse()
        out = json.loads(r.read())
        conn.close()
        assert r.status == 201, out


def test_unauthenticated_requests_share_one_budget(monkeypatch):
    """The token bucket that paces requests from connections without the token: a burst of ``rate``,
    then one every 1/rate seconds, each waiting its turn in arrival order (a fake clock)."""
    from mcf.apps.bucket_server import _http_limits

    now = [100.0]
    monkeypatch.setattr(_http_limits.time, "monotonic", lambda: now[0])
    bucket = _http_limits._TokenBucket(10.0)
    assert [bucket.wait() for _ in range(10)] == [0.0] * 10
    assert [round(bucket.wait(), 6) for _ in range(3)] == [0.1, 0.2, 0.3]
    now[0] += 1.0  # a second refills ten turns: three are owed
    assert round(bucket.wait(), 6) == 0.0 and round(bucket.wait(), 6) == 0.0
    now[0] += 60
    assert [bucket.wait() for _ in range(10)] == [0.0] * 10  # never more than the burst banked
    assert bucket.wait() > 0
