"""A real HTTP server on loopback that honours Range requests, for the remote-file tests and benchmarks.

nginx (Debian's package) when it is on PATH (``MCF_TEST_HTTP_SERVER=uvicorn`` skips it); otherwise uvicorn
serving starlette's ``StaticFiles`` (both in the test extras) in a child process.  Either way every request lands in
``access.log`` as ``METHOD URI STATUS BYTES "RANGE"``, so tests can count the requests a read made.

Run as a script (``python tests/_http_server.py ROOT PORT LOG``) it is the uvicorn fallback itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

NGINX_CONF = """\
worker_processes 1;
daemon off;
master_process off;
error_log {d}/error.log warn;
pid {d}/nginx.pid;
events {{ worker_connections 256; }}
http {{
    default_type application/octet-stream;
    log_format ranges '$request_method $uri $status $body_bytes_sent "$http_range"';
    access_log {d}/access.log ranges;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    sendfile on;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port, proc, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
        time.sleep(0.05)
    return False


@dataclass
class Server:
    kind: str          # "nginx" or "uvicorn"
    root: str
    port: int
    log: str

    def url(self, rel: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{rel.lstrip('/')}"

    def requests(self, rel: str | None = None) -> list:
        """Logged requests as (method, uri, status, bytes, range), optionally only those of one file."""
        out = []
        if not os.path.exists(self.log):
            return out
        with open(self.log) as f:
            for line in f:
                parts = line.rstrip("\n").split(" ", 4)
                if len(parts) < 5:
                    continue
                method, uri, status, nbytes, rng = parts
                if rel is None or uri == "/" + rel.lstrip("/"):
                    out.append((method, uri, int(status), int(nbytes), rng.strip('"')))
        return out

    def clear_log(self) -> None:
        # truncate in place: both servers keep the file open in append mode
        with open(self.log, "r+") as f:
            f.truncate(0)


def _start_nginx(root, d):
    exe = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
    if exe is None:
        return None, None
    for _ in range(3):
        port = free_port()
        conf = os.path.join(d, "nginx.conf")
        with open(conf, "w") as f:
            f.write(NGINX_CONF.format(d=d, port=port, root=os.path.abspath(root)))
        proc = subprocess.Popen([exe, "-p", d, "-c", conf], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if _wait_port(port, proc):
            return proc, port
        _stop(proc)
    return None, None


def _start_uvicorn(root, d):
    log = os.path.join(d, "access.log")
    for _ in range(3):
        port = free_port()
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), os.path.abspath(root), str(port), log],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if _wait_port(port, proc):
            return proc, port
        _stop(proc)
    raise RuntimeError("could not start the uvicorn fallback server")


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


@contextlib.contextmanager
def serve(root, workdir, prefer: str = "nginx"):
    """Serve directory ``root`` over HTTP on a free loopback port; yields a :class:`Server`."""
    os.makedirs(workdir, exist_ok=True)
    prefer = os.environ.get("MCF_TEST_HTTP_SERVER", prefer)  # "uvicorn" forces the fallback
    proc = port = None
    kind = "uvicorn"
    if prefer == "nginx":
        proc, port = _start_nginx(root, workdir)
        if proc is not None:
            kind = "nginx"
    if proc is None:
        proc, port = _start_uvicorn(root, workdir)
    log = os.path.join(workdir, "access.log")
    if not os.path.exists(log):
        open(log, "a").close()
    try:
        yield Server(kind, os.path.abspath(root), port, log)
    finally:
        _stop(proc)


def _fallback_main(root, port, log):
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Mount
    from starlette.staticfiles import StaticFiles

    static = StaticFiles(directory=root)
    logf = open(log, "a", buffering=1)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return await static(scope, receive, send)
        rng = next((v.decode() for k, v in scope["headers"] if k == b"range"), "-")
        info = {"status": 0, "bytes": 0}

        async def send_logged(msg):
            if msg["type"] == "http.response.start":
                info["status"] = msg["status"]
            elif msg["type"] == "http.response.body":
                info["bytes"] += len(msg.get("body", b""))
                if not msg.get("more_body"):
                    logf.write(f'{scope["method"]} {scope["path"]} {info["status"]} {info["bytes"]} "{rng}"\n')
            await send(msg)

        try:
            await static(scope, receive, send_logged)
        except HTTPException as exc:   # StaticFiles raises 404/405 for the app to answer; without an
            # exception middleware around it uvicorn would answer 500, and a missing file must be a 404
            await send_logged({"type": "http.response.start", "status": exc.status_code,
                               "headers": [(b"content-length", b"0")]})
            await send_logged({"type": "http.response.body", "body": b""})

    del Starlette, Mount
    uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning", access_log=False)


if __name__ == "__main__":
    _fallback_main(*sys.argv[1:4])
