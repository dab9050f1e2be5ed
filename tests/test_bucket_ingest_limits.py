"""What one upload may cost ``mcf bucket serve``, against a real server on
127.0.0.1: the bytes an upload's arrays may hold once decoded (``--max-ingest-bytes``), the memory an
accepted upload costs while it is written, how many ingests run at once (``--max-concurrent-ingests``,
503 with Retry-After past it), and a disk that fills up while an upload is spooled or written (507,
one log line).

Memory is the server's anonymous resident memory (RssAnon in /proc/<pid>/status), sampled every few
milliseconds while the request runs: the mapped upload is page cache, which the kernel can drop, and
is not what the issue measured.
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import subprocess
import threading
import time

import numpy as np
import pytest
from _bucket_attacks import bomb, good_npz, npz, port_of
from _bucket_server import serve, server_log

pytest.importorskip("starlette", reason="the server needs the 'server' extra (starlette)")
pytest.importorskip("uvicorn", reason="the server needs the 'server' extra (uvicorn)")

TOKEN = "ingest-limits-token-0123456789abcdefghijk"
MiB = 1 << 20
UPLOAD = {"Content-Type": "application/octet-stream"}
#: the reported attack: a 510 KiB body (two deflated float32 arrays of zeros, 256 MiB each)
AMPLIFIER = (1, 1, 1 << 20, 64)


def post(base, path, body, headers=None, timeout=300):
    conn = http.client.HTTPConnection("127.0.0.1", port_of(base), timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {TOKEN}", **UPLOAD, **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if data else None), dict(r.getheaders())
    except (BrokenPipeError, ConnectionResetError):
        r = conn.getresponse()
        return r.status, json.loads(r.read()), dict(r.getheaders())
    finally:
        conn.close()


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


def anon_growth(pid: int, fn):
    """Run ``fn()`` while sampling the server's anonymous memory; returns (result, peak growth in bytes)."""
    time.sleep(0.3)
    base = rss_anon(pid)
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon(pid))
            time.sleep(0.003)

    t = threading.Thread(target=sample)
    t.start()
    try:
        out = fn()
    finally:
        stop.set()
        t.join()
    grew = peak[0] - base
    print(f"server RssAnon {base / MiB:.0f} MiB, peak growth {grew / MiB:.1f} MiB")  # the report's figures (-s)
    return out, grew


@pytest.fixture(scope="module")
def amplifier():
    body = bomb(AMPLIFIER)
    assert len(body) < 600 << 10
    return body


# ------------------------------------------------------------------------------------------------
# amplification
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_an_accepted_amplifying_upload_costs_bounded_memory(tmp_path, amplifier, dtype):
    """Reported: a 510 KiB body was accepted and cost 240-258 MiB of anonymous memory while processed
    (with dtype=float32 too).  Each array is now converted a piece at a time and each compressed chunk
    written as soon as it is made: a chunk of zeros costs what it compresses to, not its 256 MiB."""
    with serve(tmp_path, TOKEN) as (base, proc):
        post(base, "/mcrp/v1/contexts?model_id=m&content=warm-up", good_npz())
        (st, out, _), grew = anon_growth(proc.pid, lambda: post(
            base, f"/mcrp/v1/contexts?model_id=m&content=amp&dtype={dtype}", amplifier))
        assert st == 201, out
        assert grew < 48 * MiB, f"{grew / MiB:.0f} MiB of anonymous memory for a {len(amplifier) >> 10} KiB body"


def test_the_decoded_size_is_bounded_by_an_operator_limit(tmp_path, amplifier):
    """--max-ingest-bytes bounds what an upload's arrays hold once decoded, read from their headers
    before any data is: 413, and nothing decoded."""
    with serve(tmp_path, TOKEN, "--max-ingest-bytes", str(64 * MiB)) as (base, proc):
        post(base, "/mcrp/v1/contexts?model_id=m&content=warm-up", good_npz())
        (st, out, _), grew = anon_growth(proc.pid, lambda: post(base, "/mcrp/v1/contexts?model_id=m&content=big",
                                                                 amplifier))
        assert st == 413 and "--max-ingest-bytes" in out["error"] and str(512 * MiB) in out["error"], out
        assert grew < 16 * MiB
        assert post(base, "/mcrp/v1/contexts?model_id=m&content=small", good_npz(1))[0] == 201


def test_concurrent_ingests_are_limited_with_503_and_retry_after(tmp_path):
    """Past --max-concurrent-ingests, an ingest is refused at once (503, Retry-After), before its body is
    read; the ones admitted complete."""
    body = good_npz(2)
    with serve(tmp_path, TOKEN, "--max-concurrent-ingests", "2", "--body-timeout", "30") as (base, proc):
        port = port_of(base)
        held = []
        for i in range(2):  # two ingests whose bodies are still coming
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.putrequest("POST", f"/mcrp/v1/contexts?model_id=m&content=held-{i}")
            for k, v in {"Authorization": f"Bearer {TOKEN}", **UPLOAD, "Content-Length": str(len(body))}.items():
                conn.putheader(k, v)
            conn.endheaders()
            conn.send(body[:100])
            held.append(conn)
        time.sleep(0.5)
        st, out, headers = post(base, "/mcrp/v1/contexts?model_id=m&content=third", body)
        assert st == 503 and "concurrent ingests" in out["error"] and headers.get("retry-after") == "1", (st, out)
        assert post(base, "/mcrp/v1/registry/rebuild", b"{}", {"Content-Type": "application/json"})[0] == 200
        for conn in held:
            conn.send(body[100:])
            r = conn.getresponse()
            assert r.status == 201, r.read()
            r.read()
            conn.close()
        assert post(base, "/mcrp/v1/contexts?model_id=m&content=fourth", body)[0] == 201


# ------------------------------------------------------------------------------------------------
# disk full
# ------------------------------------------------------------------------------------------------
#: where the disk fills up: (tmpfs size, array shape, stored dtype, compression)
FULL = {
    "spool": ("8m", (1, 2, 8192, 128), "float32", "none"),    # the 16 MiB upload does not fit
    "write": ("8m", (1, 2, 2560, 128), "float32", "none"),    # the 5 MiB upload fits, its 5 MiB KV file does not
    "convert": ("10m", (1, 2, 4608, 128), "float16", "lz4"),  # 9 MiB fit, the 2.25 MiB conversion buffer does not
}


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of the test's size, mounted for the test (this needs root, or CAP_SYS_ADMIN)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FULL[request.param][0]}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up (needs root): {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("small_disk", sorted(FULL), indirect=True)
def test_disk_full_is_507_with_one_log_line(small_disk, request):
    """Reported: a disk that filled up while an upload was spooled was a 500 with a traceback in the log
    for every request.  MinIO answers 507 Insufficient Storage: so does this server, and logs one line.
    The disk fills while the upload is spooled, while its KV file is written, or when the buffer a
    tensor is converted in is allocated (in a file: it must be ENOSPC there, never SIGBUS)."""
    where = request.node.callspec.params["small_disk"]
    _, shape, dtype, compression = FULL[where]
    k = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    body = npz(k=k, v=k + 1)
    with serve(small_disk, TOKEN) as (base, proc):
        before = len(server_log(proc))
        for i in range(3):
            st, out, _ = post(base, f"/mcrp/v1/contexts?model_id=m&content=full-{where}-{i}&dtype={dtype}"
                                    f"&compression={compression}", body)
            assert st == 507, (st, out)
            assert "no space left" in out["error"].lower() and str(small_disk) not in out["error"], out
        time.sleep(0.3)
        log = server_log(proc)[before:]
        lines = [ln for ln in log.splitlines() if "space" in ln.lower()]
        assert len(lines) == 3 and "Traceback" not in log, log
        # nothing is left behind on the full disk, and the server still ingests what fits
        assert post(base, "/mcrp/v1/contexts?model_id=m&content=fits", good_npz(5))[0] == 201
    st = os.statvfs(small_disk)
    assert st.f_bfree * st.f_frsize > 6 * MiB, "a failed upload left its bytes behind"


def test_enospc_is_mapped_everywhere_it_can_come_from():
    """The same status for ENOSPC and EDQUOT (a quota), whichever layer raised them."""
    from mcf.apps.bucket_server._routes import out_of_space
    from mcf.errors import MCFIOError

    assert out_of_space(OSError(errno.ENOSPC, "No space left on device"))
    assert out_of_space(MCFIOError(errno.EDQUOT, "Disk quota exceeded", "x"))
    assert not out_of_space(OSError(errno.EIO, "I/O error"))
