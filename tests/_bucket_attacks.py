"""What the server tests send when they attack ``mcf bucket serve``: archives that expand (``bomb``),
raw HTTP over a socket (for what http.client refuses to send: smuggled framing, bad Host headers,
pipelined requests), and clients that read or send slowly.  Every loop is bounded by a count and a
deadline."""

from __future__ import annotations

import io
import re
import socket
import time
import zipfile
import zlib

import numpy as np

MiB = 1 << 20


def npz(**arrays) -> bytes:
    bio = io.BytesIO()
    np.savez(bio, **arrays)
    return bio.getvalue()


def good_npz(seed=0, layers=2, heads=2, tokens=6, dim=4):
    rng = np.random.default_rng(seed)
    return npz(k=rng.standard_normal((layers, heads, tokens, dim)).astype(np.float32),
               v=rng.standard_normal((layers, heads, tokens, dim)).astype(np.float32))


def bomb(shape=(16, 8, 4096, 512), corrupt_tail=False) -> bytes:
    """A valid .npz of two deflated float32 arrays of zeros of ``shape`` (1 GiB each at the default shape,
    the reported attack: about 2 MiB in all).  Made in a second: the zero blocks are compressed once,
    each ending with a full flush, so one compressed block can be repeated.  ``corrupt_tail`` damages the
    last compressed bytes of ``v``."""
    zero = bytes(4 * MiB)
    nbytes = int(np.prod(shape)) * 4
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    c.compress(b"x")
    c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zero) + c.flush(zlib.Z_FULL_FLUSH)  # independent of what came before

    class Repeating:
        def __init__(self):
            self.c = zlib.compressobj(6, zlib.DEFLATED, -15)

        def compress(self, data):
            return block if data is zero else self.c.compress(data) + self.c.flush(zlib.Z_FULL_FLUSH)

        def flush(self, mode=zlib.Z_FINISH):
            return self.c.flush(mode)

    bio = io.BytesIO()
    real = zipfile._get_compressor
    zipfile._get_compressor = lambda *a, **k: Repeating()
    try:
        with zipfile.ZipFile(bio, "w", zipfile.ZIP_DEFLATED) as z:
            for name in ("k.npy", "v.npy"):
                with z.open(name, "w", force_zip64=True) as m:
                    np.lib.format.write_array_header_1_0(m, {"descr": "<f4", "fortran_order": False, "shape": shape})
                    for _ in range(nbytes // len(zero)):
                        m.write(zero)
                    m.write(bytes(nbytes % len(zero)))
    finally:
        zipfile._get_compressor = real
    data = bytearray(bio.getvalue())
    if corrupt_tail:
        with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
            info = z.getinfo("v.npy")
        start = info.header_offset + 30 + len(info.filename) + len(info.extra)
        for i in range(start + info.compress_size - 64, start + info.compress_size - 8):
            data[i] ^= 0x5A
    return bytes(data)


# ------------------------------------------------------------------------------------------------
# raw HTTP
# ------------------------------------------------------------------------------------------------
def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def connect(base: str, *, rcvbuf: int | None = None, timeout: float = 10) -> socket.socket:
    """A socket to the server; ``rcvbuf`` shrinks its receive buffer first (a client that reads slowly
    advertises a small window)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port_of(base)))
    return s


def head(method: str, path: str, *lines: str, host: str = "127.0.0.1", token: str | None = None) -> bytes:
    """A request head with CRLF line ends: the request line, Host, the bearer token and ``lines``."""
    out = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    if token is not None:
        out.append(f"Authorization: Bearer {token}")
    return ("\r\n".join([*out, *lines]) + "\r\n\r\n").encode("latin-1")


def read_until_closed(s: socket.socket, deadline: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes the connection (True) or ``deadline`` passes (False)."""
    data = bytearray()
    while time.monotonic() < deadline:
        s.settimeout(max(0.05, min(1.0, deadline - time.monotonic())))
        try:
            piece = s.recv(1 << 16)
        except TimeoutError:
            continue
        except (ConnectionResetError, ConnectionAbortedError):
            return bytes(data), True
        if not piece:
            return bytes(data), True
        data += piece
    return bytes(data), False


def exchange(base: str, data: bytes, *, wait: float = 10) -> tuple[list[tuple[int, dict, bytes]], bool]:
    """Send ``data`` on a new connection; returns the responses read (status, headers, body) and
    whether the server closed the connection within ``wait`` seconds."""
    with connect(base) as s:
        s.sendall(data)
        raw, closed = read_until_closed(s, time.monotonic() + wait)
    return parse_responses(raw), closed


def parse_responses(raw: bytes) -> list[tuple[int, dict, bytes]]:
    """The complete responses in ``raw`` (Content-Length framed, as this server sends them, or chunked)."""
    out = []
    while raw:
        end = raw.find(b"\r\n\r\n")
        if end < 0:
            break
        lines = raw[:end].decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        rest = raw[end + 4:]
        if "content-length" in headers:
            n = int(headers["content-length"])
            if len(rest) < n:
                break
            body, raw = rest[:n], rest[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body = bytearray()
            while True:
                m = re.match(rb"([0-9a-fA-F]+)\r\n", rest)
                if m is None:
                    return out
                n = int(m.group(1), 16)
                body += rest[m.end():m.end() + n]
                rest = rest[m.end() + n + 2:]
                if n == 0:
                    break
            body, raw = bytes(body), rest
        else:
            body, raw = rest, b""
        out.append((status, headers, bytes(body)))
    return out


# ------------------------------------------------------------------------------------------------
# slow clients
# ------------------------------------------------------------------------------------------------
def slow_reader(base: str, request: bytes, count: int, *, seconds: float = 5) -> socket.socket:
    """A connection that pipelines ``count`` copies of ``request`` with a 4 KiB receive window and never
    reads: it sends what the server takes within ``seconds`` (the server stops reading once its answers
    back up) and returns the socket, still open."""
    s = connect(base, rcvbuf=4096)
    s.setblocking(False)
    data = memoryview(request * count)
    deadline = time.monotonic() + seconds
    while data and time.monotonic() < deadline:
        try:
            n = s.send(data)
            data = data[n:]
        except BlockingIOError:
            time.sleep(0.02)
    return s


def dripper(base: str, path: str, token: str | None, length: int, content_type: str) -> socket.socket:
    """A connection that sends a request head declaring ``length`` body bytes and no body yet."""
    s = connect(base)
    s.sendall(head("POST", path, f"Content-Type: {content_type}", f"Content-Length: {length}", token=token))
    return s


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (EOF or reset), without waiting; data it sent is discarded."""
    s.setblocking(False)
    try:
        while True:
            piece = s.recv(1 << 16)
            if not piece:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def server_end_open(base: str, s: socket.socket) -> bool:
    """Whether the server's end of connection ``s`` is still established (from /proc/net/tcp, so the
    client need not read anything to find out)."""
    server = f"0100007F:{port_of(base):04X}"
    client = f"0100007F:{s.getsockname()[1]:04X}"
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == server and fields[2] == client:
                return fields[3] == "01"  # ESTABLISHED
    return False
