"""The parts of mcf.remote that need no server: the read plan (coalescing and splitting) against plain
slicing, the S3 settings' order of precedence, what a URL is sent to, and what a message may show of it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mcf
from mcf import InvalidArgumentError
from mcf.remote import redact, storage_options
from mcf.remote._plan import plan
from mcf.remote._stores import default_options, fsspec_options, s3_settings
from mcf.remote._urls import target

_BLOB = bytes(range(256)) * 400   # 102,400 bytes


@settings(max_examples=300, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, len(_BLOB) - 1), st.integers(0, 20_000)), min_size=0, max_size=30),
       part_size=st.sampled_from([1, 7, 100, 4096, 10_000, 1 << 20]),
       coalesce=st.sampled_from([0, 1, 50, 5000, 1 << 20]))
def test_plan_fills_every_buffer_exactly(ranges, part_size, coalesce):
    """Executing the parts (one slice of the file each, scattered into their sinks) fills every buffer
    with its bytes, whatever the overlaps, adjacency, sizes, order; no part exceeds part_size; parts
    are disjoint and in file order; a run is cut into parts of equal size give or take a byte."""
    coalesce = min(coalesce, part_size)
    if part_size < 100:   # a part per byte or seven: short ranges keep the example fast, the cases the same
        ranges = [(off, n % 300) for off, n in ranges]
    bufs = [(off, memoryview(bytearray(min(n, len(_BLOB) - off)))) for off, n in ranges]
    parts = plan(bufs, part_size=part_size, coalesce=coalesce)
    for p in parts:
        assert 0 < p.size <= part_size and p.sinks
        data = _BLOB[p.start:p.end]
        for off, mv in p.sinks:
            assert p.start <= off and off + len(mv) <= p.end
            mv[:] = data[off - p.start:off - p.start + len(mv)]
    for a, b in zip(parts, parts[1:]):
        assert a.end <= b.start
    for off, mv in bufs:
        assert bytes(mv) == _BLOB[off:off + len(mv)]
    fetched = sum(p.size for p in parts)
    covered = np.zeros(len(_BLOB), bool)
    for off, mv in bufs:
        covered[off:off + len(mv)] = True
    wanted = int(covered.sum())
    gaps = max(0, len(parts) - 1) * coalesce + (len(bufs)) * coalesce
    assert wanted <= fetched <= wanted + gaps     # only gaps of at most `coalesce` bytes are fetched extra


def test_plan_shapes():
    mv = memoryview(bytearray(10 << 20))
    # one 10 MiB buffer, 4 MiB parts: three even parts, not 4 + 4 + 2
    parts = plan([(0, mv)], part_size=4 << 20, coalesce=0)
    assert [p.size for p in parts] == [3495253, 3495253, 3495254]
    # each lands in its own slice of the buffer (no staging copy where the client can stream)
    assert [len(p.exact_sink()) for p in parts] == [p.size for p in parts]
    # two ranges 100 bytes apart: one request with coalesce >= 100, two without
    a, b = memoryview(bytearray(1000)), memoryview(bytearray(1000))
    assert len(plan([(0, a), (1100, b)], part_size=1 << 20, coalesce=100)) == 1
    assert len(plan([(0, a), (1100, b)], part_size=1 << 20, coalesce=99)) == 2
    # a part that is exactly one destination lands in it (no staging copy)
    (p,) = plan([(5, a)], part_size=1 << 20, coalesce=0)
    landing = p.exact_sink()
    landing[:3] = b"xyz"
    assert bytes(a[:3]) == b"xyz" and len(landing) == len(a)
    assert plan([], part_size=1, coalesce=0) == [] and plan([(3, memoryview(b""))], part_size=1, coalesce=0) == []


# -- S3 settings: the AWS order of precedence --------------------------------------------------------------
def _files(tmp_path, credentials="", config=""):
    (tmp_path / "credentials").write_text(credentials)
    (tmp_path / "config").write_text(config)
    return {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"), "AWS_CONFIG_FILE": str(tmp_path / "config")}


def test_s3_settings_order(tmp_path):
    env = _files(tmp_path, "[default]\naws_access_key_id = FILE\naws_secret_access_key = FILESECRET\n"
                           "[p]\naws_access_key_id = P\naws_secret_access_key = PSECRET\n",
                 "[default]\nregion = eu-north-1\nendpoint_url = http://file:1\n[profile p]\nregion = ap-south-1\n")
    s = s3_settings({}, env)
    assert (s["aws_access_key_id"], s["region"], s["endpoint_url"], s["credentials_from"]) == \
        ("FILE", "eu-north-1", "http://file:1", "profile")
    env.update(AWS_ACCESS_KEY_ID="ENV", AWS_SECRET_ACCESS_KEY="ENVSECRET", AWS_SESSION_TOKEN="ENVTOKEN",
               AWS_DEFAULT_REGION="us-west-2", AWS_ENDPOINT_URL="http://env:1")
    s = s3_settings({}, env)
    assert (s["aws_access_key_id"], s["aws_session_token"], s["region"], s["endpoint_url"]) == \
        ("ENV", "ENVTOKEN", "us-west-2", "http://env:1")
    env.update(AWS_REGION="us-east-2", AWS_ENDPOINT_URL_S3="http://env-s3:1")
    s = s3_settings({}, env)
    assert (s["region"], s["endpoint_url"]) == ("us-east-2", "http://env-s3:1")
    # AWS_PROFILE: env keys still win (as in the AWS CLI); an explicit profile beats them
    env["AWS_PROFILE"] = "p"
    assert s3_settings({}, env)["aws_access_key_id"] == "ENV"
    s = s3_settings({"profile": "p"}, env)
    assert (s["aws_access_key_id"], s["aws_session_token"], s["credentials_from"]) == ("P", None, "profile")
    assert s["region"] == "us-east-2"        # region and endpoint: the environment beats the profile file
    # explicit options beat everything, and take their token with them (or none)
    s = s3_settings({"key": "OPT", "secret": "OPTSECRET", "region_name": "sa-east-1", "endpoint": "http://o:1"}, env)
    assert (s["aws_access_key_id"], s["aws_session_token"], s["region"], s["endpoint_url"], s["credentials_from"]) \
        == ("OPT", None, "sa-east-1", "http://o:1", "options")
    # anonymous: no credentials from anywhere
    s = s3_settings({"anon": True}, env)
    assert s["anon"] and s["credentials_from"] is None and "aws_access_key_id" not in s


def test_s3_settings_refusals(tmp_path):
    env = _files(tmp_path)
    with pytest.raises(InvalidArgumentError, match="'nope'"):
        s3_settings({"profile": "nope"}, env)
    with pytest.raises(InvalidArgumentError, match="'nope'"):
        s3_settings({}, {**env, "AWS_PROFILE": "nope"})
    with pytest.raises(InvalidArgumentError, match="both an access key id and a secret"):
        s3_settings({"aws_access_key_id": "A"}, env)
    with pytest.raises(InvalidArgumentError, match="twice"):
        s3_settings({"key": "A", "aws_access_key_id": "B"}, env)
    with pytest.raises(InvalidArgumentError, match="client_kwargs"):
        s3_settings({"client_kwargs": {"verify": False}}, env)
    assert s3_settings({}, env)["credentials_from"] is None   # nothing anywhere: the client's own chain


def test_fsspec_spelling_for_s3fs():
    assert fsspec_options("s3", {"aws_access_key_id": "A", "aws_secret_access_key": "S", "region": "r",
                                 "endpoint_url": "http://h:1"}) == \
        {"key": "A", "secret": "S", "endpoint_url": "http://h:1", "client_kwargs": {"region_name": "r"}}
    assert fsspec_options("fsspec", {"anything": 1}) == {"anything": 1}


def test_storage_options_blocks_nest_by_prefix():
    assert default_options("s3://a/x") == {}
    with storage_options({"anon": True}):
        with storage_options({"region": "r"}, prefix="s3://a/"):
            assert default_options("s3://a/x") == {"region": "r"}
            assert default_options("s3://b/x") == {"anon": True}
        assert default_options("s3://a/x") == {"anon": True}
    assert default_options("s3://a/x") == {}


# -- URLs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, kind, root, key", [
    ("s3://bucket/dir/model.mcf", "s3", "s3://bucket", "dir/model.mcf"),
    ("gs://b/k", "gcs", "gs://b", "k"),
    ("az://container/a/b", "azure", "az://container", "a/b"),
    ("abfs://c@acct.dfs.core.windows.net/p/q", "azure", "abfs://c@acct.dfs.core.windows.net", "p/q"),
    ("https://host:8443/a%20b/c.bin", "http", "https://host:8443", "a b/c.bin"),
    ("https://host/x?download=true", "http", "https://host", "x"),     # mcf's HTTP client keeps the query
    ("https://user:pw@host/x", "http", "https://user:pw@host", "x"),
    ("memory:///x", "fsspec", "memory", "memory:///x"),
    ("hf://org/model/file", "fsspec", "hf", "hf://org/model/file"),
])
def test_where_urls_go(url, kind, root, key):
    t = target(url)
    assert (t.kind, t.root, t.key) == (kind, root, key)


def test_redact_hides_credentials_only():
    # the whole user part: a user name can be the token (https://TOKEN@host/, TOKEN:x-oauth-basic@...)
    assert redact("https://user:hunter2@host/x") == "https://***@host/x"
    r = redact("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKID%2F1&X-Amz-Signature=abc&versionId=7")
    assert "AKID" not in r and "abc" not in r and "versionId=7" in r
    assert redact("https://acct.blob.core.windows.net/c/b?sv=2020&sig=SECRET") .endswith("sv=2020&sig=***")
    for plain in ("s3://bucket/key", "http://127.0.0.1:80/a/b.mcf", "memory:///x"):
        assert redact(plain) == plain


def test_credentials_never_in_messages():
    """A URL with a password, refused or missing: the message names it with the password hidden."""
    from mcf.remote import RemoteFile

    url = "memory:///no/such/file?token=" + "tok-SECRET"
    with pytest.raises(FileNotFoundError) as ei:
        RemoteFile(url)
    assert "tok-SECRET" not in str(ei.value) and "token=***" in str(ei.value)
    url = "http://user:pw-SECRET@127.0.0.1:9/x"      # nothing listens on port 9: refused
    with pytest.raises(mcf.MCFIOError) as ei:
        RemoteFile(url, retries=0)
    assert "pw-SECRET" not in str(ei.value) and "//***@127.0.0.1:9" in str(ei.value)


def test_answers_in_memory_are_bounded_by_concurrency_times_part_size():
    """The fetcher holds one answer per thread at a time and drops it once copied: however large the
    plan, at most ``concurrency * request_size`` bytes of answers are alive (never a second copy of
    the file)."""
    import threading
    import time
    import weakref

    from mcf.remote._fetch import Fetcher

    class Answer(bytearray):
        pass

    live = {"now": 0, "peak": 0}
    lock = threading.Lock()

    def gone(n):
        with lock:
            live["now"] -= n

    class Transport:
        def get(self, start, end, out=None):
            a = Answer(_BLOB[start:end])
            with lock:
                live["now"] += len(a)
                live["peak"] = max(live["peak"], live["now"])
            weakref.finalize(a, gone, len(a))
            time.sleep(0.001)              # an answer in flight for a while, so the threads overlap
            return a, False

        def classify(self, exc):
            raise AssertionError(exc)

    dst = bytearray(len(_BLOB))
    parts = plan([(0, memoryview(dst))], part_size=1000, coalesce=0)
    stats = {}
    Fetcher(Transport(), url="u", size=len(_BLOB), retries=0, retry_delay=0, concurrency=4,
            stats=stats).fetch_all(parts)
    assert bytes(dst) == _BLOB and len(parts) == 103
    assert stats["max_in_flight"] == 4 and live["peak"] <= 4 * 1000 and live["now"] == 0, live


def test_presigned_url_matches_the_aws_documentation_example():
    """AWS's own example of query-string authentication ("Authenticating Requests: Using Query Parameters"):
    the same key, date and object give the signature the documentation prints."""
    import datetime

    from mcf.remote._sigv4 import presign

    url = presign("GET", "https://examplebucket.s3.amazonaws.com/test.txt", access_key="AKIAIOSFODNN7EXAMPLE",
                  secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", token=None, region="us-east-1",
                  expires=86400, now=datetime.datetime(2013, 5, 24, tzinfo=datetime.timezone.utc))
    assert url == ("https://examplebucket.s3.amazonaws.com/test.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256"
                   "&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request"
                   "&X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host"
                   "&X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404")


def test_s3_object_urls_are_path_style_and_quoted():
    from mcf.remote._sigv4 import object_url

    assert object_url(None, "eu-west-1", "b", "a b/c?#%.bin") == \
        "https://s3.eu-west-1.amazonaws.com/b/a%20b/c%3F%23%25.bin"
    assert object_url("http://127.0.0.1:8333/", "us-east-1", "b", "k") == "http://127.0.0.1:8333/b/k"
