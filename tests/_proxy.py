"""A small TCP proxy on loopback that adds latency and misbehaves on purpose, for the remote tests and
benchmarks: this kernel has no netem, so delays and dropped connections are made here.

It runs as a child process (``python tests/_proxy.py ...``), so a test can SIGKILL it mid-read like a
dying server.  It forwards bytes unchanged (TLS-free HTTP, S3 signatures included: the Host header the
client signed is the one the server sees), and can

- ``delay``: hold each client->server chunk (a request) this many seconds before forwarding it, like
  a round trip of that length;
- ``drop_first=K``: close the first K connections as soon as their first request arrives (nothing
  answered: a connection reset before the response);
- ``cut_after=N`` (with ``cut_count=K``, default every connection): close a connection once N
  server->client bytes went through (a server dying mid-body).

Every request/response exchange is logged as one JSON line (connection id, start and end times, bytes
each way), so a test can tell how many requests were in flight at once (:meth:`Proxy.max_overlap`).
An exchange still open is written when its connection closes or the proxy stops (:meth:`Proxy.stop`
sends SIGTERM and waits: read the log after it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proxy:
    port: int
    upstream_port: int
    log: str
    proc: subprocess.Popen

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, rel: str = "") -> str:
        return f"{self.endpoint}/{rel.lstrip('/')}"

    def kill(self) -> None:
        """SIGKILL: every connection through the proxy is cut at once, new ones are refused."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM: the proxy writes its open exchanges to the log and exits."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def events(self) -> list:
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [json.loads(line) for line in f if line.strip()]

    def exchanges(self) -> list:
        return [e for e in self.events() if e["event"] == "exchange"]

    def max_overlap(self) -> int:
        """The most exchanges in flight at one moment (each from its request to its last response byte)."""
        edges = []
        for e in self.exchanges():
            if e["down"]:
                edges += [(e["t0"], 1), (e["t1"], -1)]
        best = cur = 0
        for _, d in sorted(edges, key=lambda x: (x[0], x[1])):
            cur += d
            best = max(best, cur)
        return best


def _ready(log, proc, timeout=15.0) -> bool:
    """True once the proxy logged that it listens (a probe connection would count as its first one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError), open(log) as f:
            if '"listening"' in f.readline():
                return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def start(upstream_port: int, workdir, *, delay: float = 0.0, drop_first: int = 0, cut_after: int | None = None,
          cut_count: int = -1):
    """Run a proxy to 127.0.0.1:``upstream_port`` on a free loopback port; yields a :class:`Proxy`;
    stopped by PID on exit."""
    os.makedirs(workdir, exist_ok=True)
    for _ in range(3):
        port = _free_port()
        log = os.path.join(workdir, f"proxy-{port}.log")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(log)
        args = [sys.executable, os.path.abspath(__file__), "--port", str(port), "--upstream", str(upstream_port),
                "--log", log, "--delay", str(delay), "--drop-first", str(drop_first), "--cut-count", str(cut_count)]
        if cut_after is not None:
            args += ["--cut-after", str(cut_after)]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _ready(log, proc):
            break
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    else:
        raise RuntimeError("could not start the proxy")
    p = Proxy(port, upstream_port, log, proc)
    try:
        yield p
    finally:
        p.stop()


# -- the proxy itself (runs in the child process) ---------------------------------------------------
class _Conn:
    def __init__(self, cid, logf):
        self.id = cid
        self.logf = logf
        self.t0 = None      # the open exchange: its first request byte ...
        self.t1 = None      # ... its last response byte
        self.up = self.down = 0
        self.down_total = 0

    def request(self, n):
        if self.t0 is not None and self.down:   # a new request after a response: the previous exchange ended
            self.flush()
        if self.t0 is None:
            self.t0 = time.time()
        self.up += n

    def response(self, n):
        self.down += n
        self.down_total += n
        self.t1 = time.time()

    def flush(self):
        if self.t0 is not None:
            self.write({"event": "exchange", "conn": self.id, "t0": self.t0, "t1": self.t1 or self.t0,
                        "up": self.up, "down": self.down})
        self.t0 = self.t1 = None
        self.up = self.down = 0

    def write(self, rec):
        self.logf.write(json.dumps(rec) + "\n")
        self.logf.flush()


async def _main(a):
    logf = open(a.log, "a", buffering=1)
    conns = {}
    counter = {"n": 0}

    async def handle(reader, writer):
        counter["n"] += 1
        cid = counter["n"]
        c = conns[cid] = _Conn(cid, logf)
        c.write({"event": "open", "conn": cid, "t": time.time()})
        drop = cid <= a.drop_first
        cut = a.cut_after is not None and (a.cut_count < 0 or cid <= a.cut_count)
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", a.upstream)
        except OSError:
            writer.close()
            c.write({"event": "refused", "conn": cid, "t": time.time()})
            del conns[cid]
            return
        done = asyncio.Event()

        async def up():
            try:
                while True:
                    data = await reader.read(1 << 16)
                    if not data:
                        break
                    c.request(len(data))
                    if drop:
                        c.write({"event": "drop", "conn": cid, "t": time.time()})
                        break
                    if a.delay:
                        await asyncio.sleep(a.delay)
                    uw.write(data)
                    await uw.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                done.set()

        async def down():
            try:
                while True:
                    data = await ur.read(1 << 16)
                    if not data:
                        break
                    if cut and c.down_total + len(data) >= a.cut_after:
                        keep = a.cut_after - c.down_total
                        if keep > 0:
                            writer.write(data[:keep])
                            c.response(keep)
                            await writer.drain()
                        c.write({"event": "cut", "conn": cid, "t": time.time(), "after": a.cut_after})
                        break
                    writer.write(data)
                    c.response(len(data))
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                done.set()

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        await done.wait()
        for t in tasks:
            t.cancel()
        for w in (writer, uw):
            with contextlib.suppress(Exception):
                w.transport.abort()   # a reset, not a polite close: the peer sees the connection die
        c.flush()
        c.write({"event": "close", "conn": cid, "t": time.time()})
        conns.pop(cid, None)

    server = await asyncio.start_server(handle, "127.0.0.1", a.port)
    logf.write(json.dumps({"event": "listening", "port": a.port, "t": time.time()}) + "\n")
    logf.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()
    for c in list(conns.values()):
        c.flush()
    logf.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--drop-first", type=int, default=0)
    ap.add_argument("--cut-after", type=int, default=None)
    ap.add_argument("--cut-count", type=int, default=-1)
    asyncio.run(_main(ap.parse_args()))
