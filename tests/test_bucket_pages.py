"""The bucket's pages area (mcf.bucket.pages): round trips, checksums, crash safety, TTL, the warm tier,
planted entries, key names."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from mcf.bucket.pages import HEADER, PageStore, key_of_name, page_name, payload_offset
from mcf.errors import ArgumentTypeError, InvalidArgumentError

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant (the CRC-32C)


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """CRC-32C from its definition (reflected polynomial 0x82F63B78, initial value and final xor
    0xFFFFFFFF), a bit at a time: the model every compiled variant is compared with."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _page(seed: int, n: int = 3 * 4096 + 100) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


def test_round_trip_and_prefix(tmp_path):
    with PageStore(tmp_path, "ns") as s:
        pages = [_page(i) for i in range(4)]
        assert s.put_many(["a", "b", "d"], [pages[0], pages[1], pages[3]]) == [True] * 3
        assert s.exists_many(["a", "b", "c", "d"]) == [True, True, False, True]
        assert s.prefix_hits(["a", "b", "c", "d"]) == 2
        outs = [np.zeros_like(p) for p in pages]
        assert s.get_many_into(["a", "b", "c", "d"], outs) == [True, True, False, True]
        assert all((outs[i] == pages[i]).all() for i in (0, 1, 3))
        assert not s.get_into("a", np.zeros(10, np.uint8))          # another size: a miss, not damage
        assert s.stats["damaged"] == 0 and s.exists("a")
        assert s.put("m", [b"ab", b"cd"], meta=b"\x01\x02") is True and s.put("m", b"zz") is False
        assert s.get("m") == (b"\x01\x02", bytearray(b"abcd"))
        assert sorted(s.keys()) == ["a", "b", "d", "m"]
        assert s.delete("m") and not s.delete("m") and s.get("m") is None


def test_layout_of_a_page(tmp_path):
    with PageStore(tmp_path, "ns") as s:
        s.put("k", _page(1, 8192))
    raw = (tmp_path / "pages" / "ns" / "k").read_bytes()
    magic, version, flags, key_len, kind, meta_len, offset, size, _t, pcrc, hcrc = HEADER.unpack_from(raw)
    assert (magic, version, flags, key_len, kind, meta_len) == (b"MCBP", 2, 0, 1, 1, 0)   # kind 1: CRC-32C
    assert offset == payload_offset(1, 0, 8192) == 4096 and size == 8192 and len(raw) == offset + size
    assert raw[offset:] == _page(1, 8192).tobytes()
    # both checksums are CRC-32C, checked against the plain-Python reference
    assert pcrc == crc32c_reference(raw[offset:])
    assert hcrc == crc32c_reference(raw[:44] + b"\0\0\0\0" + raw[48:HEADER.size + 1])


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "zeros", "other_key"])
def test_a_damaged_page_is_a_miss_and_is_removed(tmp_path, damage):
    with PageStore(tmp_path, "ns") as s:
        s.put("k", _page(2))
        s.put("j", _page(3))
    p = tmp_path / "pages" / "ns" / "k"
    raw = bytearray(p.read_bytes())
    if damage == "flip_payload":
        raw[-1] ^= 1
    elif damage == "flip_header":
        raw[30] ^= 1
    elif damage == "truncate":
        raw = raw[:len(raw) // 2]
    elif damage == "zeros":             # what a power loss leaves of an unsynced file on some file systems
        raw = bytearray(len(raw))
    else:                               # a page copied under another key's name
        raw = bytearray((tmp_path / "pages" / "ns" / "j").read_bytes())
    p.write_bytes(raw)
    with PageStore(tmp_path, "ns") as s:
        out = np.zeros_like(_page(2))
        assert s.get_into("k", out) is False
        assert s.get("k") is None
        assert s.stats["damaged"] == 1 and not p.exists()
        assert s.get_into("j", out) or damage == "other_key"


def test_a_torn_write_is_never_read_as_a_hit(tmp_path):
    """A writer killed at any point leaves the old page, the new page, or none at the key's name, never a
    part: killed in the middle of a 64 MiB page, only a temp file is left, which gc() removes once old."""
    code = ("import sys, numpy as np\nfrom mcf.bucket.pages import PageStore\n"
            "s = PageStore(sys.argv[1], 'ns')\nprint('ready', flush=True)\n"
            "s.put('big', np.ones(1 << 26, np.uint8))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    for delay in (0.0, 0.02, 0.05):
        proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().startswith(b"ready")
        if delay:
            subprocess.run([sys.executable, "-c", f"import time; time.sleep({delay})"], check=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        with PageStore(tmp_path, "ns") as s:
            out = np.zeros(1 << 26, np.uint8)
            hit = s.get_into("big", out)
            assert hit == s.exists("big")
            assert not hit or (out == 1).all()
            s.delete("big")
    names = os.listdir(tmp_path / "pages" / "ns")
    for n in names:
        assert n.startswith(".") and n.endswith(".tmp")
        os.utime(tmp_path / "pages" / "ns" / n, (0, 0))
    with PageStore(tmp_path, "ns") as s:
        assert s.gc() == len(names) and s.keys() == []


def test_ttl(tmp_path):
    now = [1000.0]
    with PageStore(tmp_path, "ns", ttl=60, clock=lambda: now[0]) as s:
        s.put("k", b"x" * 100)
        mtime = os.stat(tmp_path / "pages" / "ns" / "k").st_mtime
        assert mtime == 1000.0
        now[0] = mtime + 30
        assert s.exists("k") and s.get("k") is not None
        now[0] = mtime + 61
        assert not s.exists("k") and s.get("k") is None and s.prefix_hits(["k"]) == 0 and s.keys() == []
        assert s.gc() == 1 and not (tmp_path / "pages" / "ns" / "k").exists()
        assert s.put("k", b"y" * 100) is True        # written again
        os.utime(tmp_path / "pages" / "ns" / "k", (mtime, mtime))
        now[0] = mtime + 59
        assert s.put("k", b"z" * 100) is False       # there: kept, its time refreshed
        now[0] = mtime + 90
        assert s.get("k") == (b"", bytearray(b"y" * 100))
    with pytest.raises(InvalidArgumentError):
        PageStore(tmp_path, "ns", ttl=0)


def test_warm_tier_serves_only_the_current_file(tmp_path):
    with PageStore(tmp_path, "ns", warm_budget_bytes=3 * 20000) as s, PageStore(tmp_path, "ns") as other:
        s.put("k", _page(1, 20000))
        out = np.zeros(20000, np.uint8)
        assert s.get_into("k", out) and s.warm_used_bytes == 20000
        os.unlink(tmp_path / "pages" / "ns" / "k")           # served from memory only while the file is there
        assert not s.get_into("k", out)
        other.put("k", _page(2, 20000))                      # rewritten by another process: the new bytes
        assert s.get_into("k", out) and (out == _page(2, 20000)).all()
        other.put("k", _page(3, 20000), replace=True)
        assert s.get_into("k", out) and (out == _page(3, 20000)).all()
        for i in range(5):                                   # least recently used out first, within budget
            s.put(f"p{i}", _page(i, 20000))
            assert s.get_into(f"p{i}", out)
        assert s.warm_used_bytes <= 3 * 20000


def test_planted_entries_are_misses(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 5000)
    with PageStore(tmp_path, "ns") as s:
        d = tmp_path / "pages" / "ns"
        os.symlink(secret, d / "link")
        os.mkfifo(d / "fifo")
        (d / "dir").mkdir()
        for k in ("link", "fifo", "dir"):
            assert not s.exists(k) and s.get(k) is None
        assert s.put("link", b"new") is True               # the rename replaces the link, not its target
        assert secret.read_bytes() == b"s" * 5000 and s.get("link") == (b"", bytearray(b"new"))


@pytest.mark.parametrize("key", ["0123abcd" * 8, "meta-llama/Llama-3.1-8B@1@0@-1f3a@bfloat16", ".hidden", "..",
                                 "a%b", "ключ", "x" * 200, "with space"])
def test_key_names(tmp_path, key):
    name = page_name(key)
    assert "/" not in name and not name.startswith(".") and key_of_name(name) == key
    with PageStore(tmp_path, "ns") as s:
        s.put(key, b"v")
        assert s.keys() == [key] and s.get(key) == (b"", bytearray(b"v"))


def test_bad_arguments(tmp_path):
    with pytest.raises(InvalidArgumentError):
        PageStore(tmp_path, "../up")
    with pytest.raises(ArgumentTypeError):
        PageStore(tmp_path, 3)
    with PageStore(tmp_path, "ns") as s:
        with pytest.raises(InvalidArgumentError):
            s.put("k" * 600, b"x")
        with pytest.raises(InvalidArgumentError):
            s.put("", b"x")
        with pytest.raises(ArgumentTypeError):
            s.put(b"bytes-key", b"x")
        with pytest.raises(ArgumentTypeError):
            s.put("k", 3)
        with pytest.raises(InvalidArgumentError):
            s.get_into("k", b"read-only")
        with pytest.raises(InvalidArgumentError):
            s.put("k", b"x", meta=b"m" * (64 * 1024 + 1))
    assert key_of_name(".abc.tmp") is None and key_of_name("%zz") is None


# -- the checksum: every variant this CPU runs, bit for bit against the reference ----------------------------
IMPLS = __import__("mcf").kernel_info()["supported"]


@pytest.mark.parametrize("impl", IMPLS)
def test_crc32c_variants_match_the_reference(impl):
    from mcf.bucket import _pageio
    assert _pageio.crc32c(b"123456789", impl=impl) == 0xE3069283 == crc32c_reference(b"123456789")  # the check value
    data = _page(7, 3 * 4096 * 2 + 1234).tobytes()   # two rounds of the three-stream loop, then the tail
    for lo, hi in [(0, 0), (0, 1), (3, 11), (1, 4096 * 3 + 9), (0, len(data)), (5, len(data) - 3)]:
        part = data[lo:hi]
        assert _pageio.crc32c(part, impl=impl) == crc32c_reference(part), (impl, lo, hi)
        # continuing from a value is the CRC of the concatenation
        mid = (hi - lo) // 3
        assert _pageio.crc32c(part[mid:], _pageio.crc32c(part[:mid], impl=impl), impl=impl) == crc32c_reference(part)
    hw = {"avx2", "avx512", "neon"}
    assert _pageio.crc32c_variant(impl) in ({"scalar"} | (hw if impl != "scalar" else set()))


def test_crc32c_forced_by_the_environment(tmp_path):
    """MCF_FORCE_IMPL=scalar makes the pages (written and read) use the scalar table code: same bytes."""
    code = ("import sys; from mcf.bucket import _pageio; from mcf.bucket.pages import PageStore\n"
            "s = PageStore(sys.argv[1], 'ns'); s.put('k', bytes(range(256)) * 100)\n"
            "print(_pageio.crc32c_variant(), open(sys.argv[1] + '/pages/ns/k', 'rb').read()[40:48].hex())\n")
    runs = []
    for force in ("scalar", ""):
        env = dict(os.environ, MCF_FORCE_IMPL=force)
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / (force or "best"))], env=env, check=True,
                             capture_output=True, text=True).stdout.split()
        runs.append(out)
    assert runs[0][0] == "scalar"
    assert runs[0][1][:8] == runs[1][1][:8]        # the payload's CRC does not depend on the variant


def test_a_page_of_version_1_is_refused_as_a_miss(tmp_path):
    """Pages of the first layout (zlib's CRC-32, no checksum kind) are an unsupported version: a miss."""
    import struct
    with PageStore(tmp_path, "ns") as s:
        s.put("k", _page(4, 8192))
    p = tmp_path / "pages" / "ns" / "k"
    raw = bytearray(p.read_bytes())
    struct.pack_into("<HHHH", raw, 4, 1, 0, 1, 0)   # version 1, checksum kind 0
    p.write_bytes(raw)
    with PageStore(tmp_path, "ns") as s:
        assert s.get_into("k", np.zeros(8192, np.uint8)) is False and s.stats["damaged"] == 1


def test_batches_on_threads_and_pages_with_metadata(tmp_path):
    """A batch larger than the threads, destinations of several buffers, pages with metadata read through
    the batch (another size: a miss), and a warm tier all agree with single reads."""
    pages = [_page(20 + i, 4096 * (i % 3 + 1) + i) for i in range(13)]
    keys = [f"p{i}" for i in range(13)]
    with PageStore(tmp_path, "ns", threads=3, warm_budget_bytes=1 << 16) as s:
        assert s.put_many(keys, pages) == [True] * 13
        assert s.put("meta", b"xyz", meta=b"m") is True
        outs = [[np.zeros(len(p) // 2, np.uint8), np.zeros(len(p) - len(p) // 2, np.uint8)] for p in pages]
        assert s.get_many_into(keys, outs) == [True] * 13
        assert all((np.concatenate(o) == p).all() for o, p in zip(outs, pages))
        assert s.get_many_into(keys[:2] + ["meta", "nope"], [np.zeros(len(p), np.uint8) for p in pages[:2]]
                               + [np.zeros(3, np.uint8), np.zeros(3, np.uint8)]) == [True, True, True, False]
        assert s.stats["damaged"] == 0 and s.warm_used_bytes > 0
        assert s.put_many(keys[:2], pages[:2]) == [True, True] and s.stats["writes"] == 14   # kept, not rewritten
