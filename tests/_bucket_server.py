"""`mcf bucket serve` as a real process on loopback, for the server tests (one place for start-up and
shutdown)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(root, token: str | None, *args: str, env: dict | None = None, ready: bool = True, cwd=None):
    """Start the server on ``root`` with bearer ``token`` (None: none) and extra command-line ``args``, in
    directory ``cwd`` (default: this one; a relative ``root`` is relative to it); yields ``(base_url,
    process)`` (base ``http://127.0.0.1:<port>``) once the OpenAPI document answers (right away when not
    ``ready``); stops it by PID on exit.  Its standard error (the listening line, the access log,
    warnings) goes to a temporary file, read with :func:`server_log`: a pipe nobody reads would block a
    server that logs every request once 64 KiB are waiting."""
    port = free_port()
    env = dict(os.environ, **(env or {}))
    env.pop("MCB_TOKEN", None)
    env.pop("MCF_BUCKET_TOKEN", None)
    if token is not None:
        env["MCF_BUCKET_TOKEN"] = token
    # append mode: the child shares this open file (and its offset) with us, so without O_APPEND its next
    # line would land wherever our last read left the offset, over what it wrote before
    log = tempfile.TemporaryFile(mode="a+b")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "mcf.cli", "bucket", "serve", "--root", str(root),
                             "--port", str(port), *args], env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=log)
    proc.log_file = log
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while ready:
            try:
                urllib.request.urlopen(base + "/mcrp/v1/openapi.json", timeout=2).close()
                break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start: {server_log(proc)!r}") from None
                time.sleep(0.1)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def server_log(proc) -> str:
    """Everything the server started by :func:`serve` has written to its standard error so far."""
    fd = proc.log_file.fileno()
    chunks, at = [], 0
    while chunk := os.pread(fd, 1 << 16, at):   # pread: the shared offset stays where the child writes
        chunks.append(chunk)
        at += len(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set size so far (VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/<pid>/status")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def request(base, method, path, body=None, headers=None, token=None, timeout=60):
    """(status, parsed JSON or raw bytes, headers) of one request over a fresh connection to ``base``
    (``http://127.0.0.1:<port>``); ``token`` is sent as the bearer token when given."""
    import http.client
    import json

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
