"""Bucket events over the wire (seed 003 §6.2): ``GET /mcrp/v1/events`` streams Server-Sent Events from a
real ``mcf bucket serve`` process on loopback, read with http.client; every read has a deadline.  The
server's hardening applies to the stream: the bearer token, a cap on open streams, the header deadline
(a stream outlives it) and a shutdown that does not wait for clients that never hang up.
(``model.loaded``, emitted when a server starts with a model backend, is checked in tests/test_bucket_hf.py.)"""

from __future__ import annotations

import http.client
import io
import json
import time

import numpy as np
import pytest

pytest.importorskip("uvicorn", reason="the server needs the 'server' extra")
pytest.importorskip("starlette", reason="the server needs the 'server' extra")

from _bucket_server import serve  # noqa: E402

TOKEN = "events-token-of-at-least-32-bytes-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Events:
    """One event stream: ``next()`` returns the next event as (id, name, data) within a deadline."""

    def __init__(self, base, headers=None, query="", token=TOKEN):
        host, port = base.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=10)
        self.conn.request("GET", "/mcrp/v1/events" + query,
                          headers={"Authorization": f"Bearer {token}", **(headers or {})})
        self.resp = self.conn.getresponse()

    def next(self, deadline=10.0):
        end = time.monotonic() + deadline
        fields: dict = {}
        while time.monotonic() < end:
            line = self.resp.fp.readline()
            if not line:
                return None  # the stream ended
            line = line.decode().rstrip("\n")
            if not line:
                if "event" in fields:
                    return int(fields.get("id", -1)), fields["event"], json.loads(fields["data"])
                fields = {}
                continue
            if line.startswith(":"):
                continue
            k, _, v = line.partition(": ")
            fields[k] = v
        raise AssertionError("no event before the deadline")

    def close(self):
        self.conn.close()


def request(base, method, path, body=None, ctype="application/json"):
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, "/mcrp/v1" + path, body=body, headers={**AUTH, "Content-Type": ctype})
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def npz(seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((2, 2, 5, 4)).astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, k=k, v=k + 1)
    return buf.getvalue()


def test_events_stream_every_operation_and_resume(tmp_path):
    with serve(tmp_path / "b", TOKEN, "--header-timeout", "1") as (base, proc):
        # the token is required, as on every route
        host, port = base.removeprefix("http://").split(":")
        c = http.client.HTTPConnection(host, int(port), timeout=10)
        c.request("GET", "/mcrp/v1/events")
        r = c.getresponse()
        assert r.status == 401 and json.loads(r.read())["error"] == "missing or wrong bearer token"
        c.close()
        for q in ("?last_event_id=-1", "?last_event_id=x", "?last_event_id=" + "9" * 19, "?since=3"):
            st, out = request(base, "GET", "/events" + q)
            assert st == 400, (q, out)

        ev = Events(base)
        assert ev.resp.status == 200 and ev.resp.getheader("content-type").startswith("text/event-stream")
        time.sleep(1.5)  # longer than the header deadline: an open stream is not cut by it
        st, out = request(base, "POST", "/contexts?model_id=m&content=doc", npz(), "application/octet-stream")
        assert st == 201, out
        cid = out["context_id"]
        assert request(base, "POST", f"/contexts/{cid}/promote", b"{}")[0] == 200
        assert request(base, "POST", f"/contexts/{cid}/demote", b"{}")[0] == 200
        assert request(base, "GET", "/models/m/contexts")[0] == 200
        assert request(base, "DELETE", f"/contexts/{cid}")[0] == 204
        assert request(base, "POST", "/registry/rebuild", b"{}")[0] == 200
        got = [ev.next() for _ in range(6)]
        assert [g[1] for g in got] == ["context.ingested", "context.promoted", "context.demoted",
                                       "context.discovered", "context.deleted", "registry.rebuilt"]
        ids = [g[0] for g in got]
        assert ids == sorted(ids) and len(set(ids)) == 6
        assert all(g[2]["event"] == g[1] and g[2]["timestamp"].endswith("Z") for g in got)
        assert got[0][2]["context_id"] == cid and got[0][2]["model_id"] == "m"
        assert got[3][2]["contexts"] == [cid] and got[5][2]["contexts"] == []

        # a client that reconnects with Last-Event-ID (header or query) gets what it missed, in order
        again = Events(base, headers={"Last-Event-ID": str(ids[2])})
        assert [again.next()[0] for _ in range(3)] == ids[3:]
        again.close()
        replay = Events(base, query="?last_event_id=0")
        assert [replay.next()[1] for _ in range(6)] == [g[1] for g in got]
        replay.close()

        # stopping the server ends open streams instead of waiting for them
        proc.terminate()
        proc.wait(timeout=15)
        assert ev.next() is None
        ev.close()


def test_the_number_of_open_streams_is_capped(tmp_path):
    with serve(tmp_path / "b", TOKEN, "--max-event-streams", "2") as (base, _):
        first, second = Events(base), Events(base)
        assert first.resp.status == second.resp.status == 200
        st, out = request(base, "GET", "/events")
        assert st == 503 and "2 event streams are open already" in out["error"]
        first.close()
        deadline = time.monotonic() + 10
        while True:  # the server notices the closed stream at its next write or keep-alive
            request(base, "GET", "/models/m/contexts")  # an event: a write to every stream
            third = Events(base)
            if third.resp.status == 200:
                break
            third.close()
            assert time.monotonic() < deadline, "a closed stream kept its slot"
            time.sleep(0.2)
        request(base, "GET", "/models/m/contexts")
        assert third.next()[1] == "context.discovered"
        assert second.next()[1] == "context.discovered"
        third.close()
        second.close()


def test_a_client_that_does_not_read_is_cut_off_not_buffered():
    """The hub alone: a stream holds at most queue_size unread events, then says overflow and ends."""
    import asyncio
    import threading

    from mcf.bucket import Bucket  # noqa: F401 - the hub is fed by Bucket.subscribe; a plain list here
    from mcf.bucket._events import EventHub

    subscribers = []
    hub = EventHub(lambda cb: subscribers.append(cb) or (lambda: subscribers.remove(cb)), queue_size=2,
                   history=3, keepalive=0.05)

    async def run():
        s = hub.open(None)
        emit = threading.Thread(target=lambda: [subscribers[0]({"event": f"e{i}"}) for i in range(5)])
        emit.start()
        emit.join()
        chunks = [c async for c in hub.stream(s)]
        late = hub.open(0)  # the history keeps the last 3
        backlog = list(late.items)
        return chunks, backlog

    chunks, backlog = asyncio.run(asyncio.wait_for(run(), 10))
    text = b"".join(chunks).decode()
    assert "event: e0" in text and "event: e1" in text and "event: e2" not in text
    assert text.rstrip().splitlines()[-2].startswith("data: ") and "event: overflow" in text
    assert [i for i, _ in backlog] == [3, 4, 5]
    hub.close()
    assert subscribers == []


def test_model_loaded_from_the_library(tmp_path):
    from mcf.bucket import Bucket

    with Bucket(tmp_path / "b") as b:
        cid = b.ingest("m", [(np.zeros((1, 2, 4), np.float32),) * 2], content="x")["context_id"]
        seen = []
        b.subscribe(seen.append)
        assert [c["context_id"] for c in b.model_loaded("m")] == [cid]
        assert [(e["event"], e["contexts"]) for e in seen] == [("context.discovered", [cid]), ("model.loaded", [cid])]
