"""The pages area through `mcf bucket serve` (mcf.bucket.remote_pages.RemotePageStore against the page
routes): round trips, the token, the server's limits, keys that are no file names."""

from __future__ import annotations

import urllib.error
import urllib.request

import numpy as np
import pytest
from _bucket_server import serve

from mcf.bucket.pages import PageStore
from mcf.bucket.remote_pages import RemotePageStore
from mcf.errors import AccessError, InvalidArgumentError

TOKEN = "pages-test-token-0123456789abcdef"


def _page(seed: int, n: int = 3 * 4096 + 100) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n, dtype=np.uint8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("pages-bucket")
    PageStore(root / "mcb", "warmup").close()  # a bucket directory with a pages area
    with serve(root / "mcb", TOKEN, "--max-page-bytes", "65536", "--no-access-log") as (base, _proc):
        yield base, root / "mcb"


def test_round_trips_through_the_server(server, monkeypatch):
    base, root = server
    monkeypatch.setenv("MCF_BUCKET_TOKEN", TOKEN)
    keys = ["a", "meta-llama/Llama-3.1-8B@1@0@-22@bfloat16", "%odd key.", "d"]   # '/', '%', ' ', a leading '.'
    pages = [_page(i) for i in range(4)]
    with RemotePageStore(base, "srv") as s:
        assert s.put_many(keys[:3], pages[:3]) == [True] * 3
        assert s.put(keys[3], pages[3], meta=b"\x01\x02") is True and s.put(keys[3], b"zz") is False
        assert s.exists(keys[1]) and not s.exists("nope")
        assert s.exists_many([keys[0], "nope", keys[2]]) == [True, False, True]
        assert s.prefix_hits([keys[0], keys[1], "nope", keys[2]]) == 2
        outs = [np.zeros_like(p) for p in pages[:3]]
        assert s.get_many_into(keys[:3] + ["nope"], outs + [np.zeros(4, np.uint8)]) == [True] * 3 + [False]
        assert all((o == p).all() for o, p in zip(outs, pages))
        assert s.get(keys[3]) == (b"\x01\x02", bytearray(pages[3].tobytes()))
        assert sorted(s.keys()) == sorted(keys)
        assert s.delete(keys[0]) and not s.delete(keys[0]) and s.get(keys[0]) is None
    # what the server stored is the local pages area, the same files a local PageStore reads
    with PageStore(root, "srv", create=False) as local:
        out = np.zeros_like(pages[1])
        assert local.get_into(keys[1], out) and (out == pages[1]).all()


def test_refused_without_the_token(server, monkeypatch):
    base, _ = server
    monkeypatch.delenv("MCF_BUCKET_TOKEN", raising=False)
    with RemotePageStore(base, "srv") as s, pytest.raises(AccessError, match="token") as err:
        s.put("k", b"x")
    assert TOKEN not in str(err.value)
    with RemotePageStore(base, "srv", token="wrong-" + TOKEN) as s, pytest.raises(AccessError) as err:
        s.prefix_hits(["k"])
    assert TOKEN not in str(err.value)


def test_an_oversized_page_is_refused(server):
    base, _ = server
    with RemotePageStore(base, "srv", token=TOKEN) as s:
        with pytest.raises(InvalidArgumentError, match="413"):
            s.put("big", np.zeros(65536 + 1, np.uint8))
        assert not s.exists("big")
        assert s.put("fits", np.zeros(65536, np.uint8)) is True


def test_bad_names_and_namespaces_are_400(server):
    base, _ = server
    for path in ("/mcrp/v1/pages/srv/page/%25zz", "/mcrp/v1/pages/..x/page/k", "/mcrp/v1/pages/srv/page/.hidden"):
        req = urllib.request.Request(base + path, headers={"authorization": f"Bearer {TOKEN}"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        err.value.close()
        assert err.value.code == 400, path
