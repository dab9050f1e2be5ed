"""The REST server started as a real process on loopback (``mcf bucket serve``) and exercised over
HTTP with the standard library's client."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from _bucket_server import serve

pytest.importorskip("starlette", reason="the server needs the 'server' extra (starlette)")
pytest.importorskip("uvicorn", reason="the server needs the 'server' extra (uvicorn)")

from mcf.bucket import open_kv

TOKEN = "s3cret-token-of-at-least-32-bytes-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bucket")
    with serve(root, TOKEN) as (url, _):
        yield url + "/mcrp/v1", root


def call(base, method, path, body=None, token=TOKEN, headers=None, raw=False):
    headers = dict(headers or {})
    if body is not None and not any(h.lower() == "content-type" for h in headers):
        # the upload is application/octet-stream, every other body JSON (urllib would send a form type)
        headers["Content-Type"] = "application/octet-stream" if path.startswith("/contexts?") else "application/json"
    req = urllib.request.Request(base + path, data=body, method=method, headers=headers)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            data = r.read()
            return r.status, (data if raw else (json.loads(data) if data else None)), dict(r.headers)
    except urllib.error.HTTPError as e:
        data = e.read()
        return e.code, json.loads(data) if data else None, dict(e.headers)


def npz_body(seed=0, layers=2, heads=2, tokens=6, dim=4):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((layers, heads, tokens, dim)).astype(np.float32)
    v = rng.standard_normal((layers, heads, tokens, dim)).astype(np.float32)
    bio = io.BytesIO()
    np.savez(bio, k=k, v=v)
    return bio.getvalue(), k, v


def test_endpoints(server):
    base, root = server
    st, doc, _ = call(base, "GET", "/openapi.json", token=None)
    assert st == 200 and doc["openapi"].startswith("3.") and "/mcrp/v1/contexts/{id}/kv" in doc["paths"]
    body, k, v = npz_body()
    st, out, _ = call(base, "POST", "/contexts?model_id=llama&token_ids=1,2,3,4,5,6&name=doc&dtype=float32", body)
    assert st == 201, out
    cid = out["context_id"]
    st, out2, _ = call(base, "POST", "/contexts?model_id=llama&token_ids=1,2,3,4,5,6&dtype=float32", body)
    assert st == 201 and out2["deduplicated"] and out2["context_id"] == cid
    st, meta, _ = call(base, "GET", f"/contexts/{cid}")
    assert st == 200 and meta["content"]["name"] == "doc"
    st, lst, _ = call(base, "GET", "/contexts")
    assert st == 200 and [c["context_id"] for c in lst["contexts"]] == [cid]
    st, disc, _ = call(base, "GET", "/models/llama/contexts?force_scan=true")
    assert st == 200 and [c["context_id"] for c in disc["contexts"]] == [cid]
    # the KV payload streamed to a runtime decodes to what was uploaded
    st, raw, headers = call(base, "GET", f"/contexts/{cid}/kv", raw=True)
    assert st == 200 and headers["x-mcb-checksum"] == meta["storage"]["checksum"]
    with open_kv(memoryview(raw)) as f:
        got = f.load()
    np.testing.assert_array_equal(got[1][0], k[1])
    np.testing.assert_array_equal(got[1][1], v[1])
    st, out, _ = call(base, "POST", f"/contexts/{cid}/promote", json.dumps({"target_tier": "warm"}).encode())
    assert (st, out["tier"]) == (200, "warm")
    st, out, _ = call(base, "POST", f"/contexts/{cid}/demote", b"")
    assert (st, out["tier"]) == (200, "cold")
    st, out, _ = call(base, "POST", f"/contexts/{cid}/query", json.dumps({"query": "hi"}).encode())
    assert st == 501 and "no query backend" in out["error"]
    st, reg, _ = call(base, "GET", "/registry")
    assert st == 200 and reg["statistics"]["total_contexts"] == 1
    st, reb, _ = call(base, "POST", "/registry/rebuild")
    assert st == 200 and reb["statistics"]["total_contexts"] == 1
    st, _, _ = call(base, "DELETE", f"/contexts/{cid}")
    assert st == 204
    st, out, _ = call(base, "GET", f"/contexts/{cid}")
    assert st == 404 and out["status"] == "error"


def test_errors(server):
    base, root = server
    assert call(base, "GET", "/registry", token=None)[0] == 401
    assert call(base, "GET", "/registry", token="wrong")[0] == 401
    assert call(base, "GET", "/contexts/..%2F..%2Fetc")[0] in (400, 404)
    st, out, _ = call(base, "GET", "/contexts/ctx_../etc")
    assert st in (400, 404) and out["status"] == "error"
    st, out, _ = call(base, "GET", "/contexts/not-an-id")
    assert st == 400 and "invalid context id" in out["error"]
    assert call(base, "DELETE", "/contexts/ctx_" + "0" * 32)[0] == 404
    assert call(base, "GET", "/models/..bad/contexts")[0] == 400
    assert call(base, "POST", "/contexts?model_id=m&content=x", b"not an npz")[0] == 422
    bio = io.BytesIO()
    np.savez(bio, x=np.zeros(2))
    assert call(base, "POST", "/contexts?model_id=m&content=x", bio.getvalue())[0] == 422
    body, _, _ = npz_body(1)
    assert call(base, "POST", "/contexts?content=x", body)[0] == 400
    assert call(base, "POST", "/contexts?model_id=m&content=x&dtype=float64", body)[0] == 400
    assert call(base, "POST", "/contexts?model_id=m&token_ids=1,x", body)[0] == 400
    st, out, _ = call(base, "POST", "/contexts?model_id=m&content=x", body)
    cid = out["context_id"]
    assert call(base, "POST", f"/contexts/{cid}/promote", b"{not json")[0] == 400
    assert call(base, "POST", f"/contexts/{cid}/promote", json.dumps({"target_tier": "cold"}).encode())[0] == 400
    st, out, _ = call(base, "POST", f"/contexts/{cid}/promote",
                      json.dumps({"target_tier": "hot", "device": "cuda"}).encode())
    assert st in (200, 409)  # 409 with a clear message unless this machine has CUDA and torch
    assert call(base, "GET", "/nowhere")[0] == 404
    # corrupt stored data: 422 with the reason, the server keeps running
    kv = root / "contexts" / cid / "kv_data.mcb"
    kv.write_bytes(kv.read_bytes()[:70])
    st, out, _ = call(base, "GET", f"/contexts/{cid}/kv")
    assert st == 422 and "kv_data.mcb" in out["error"]
    assert call(base, "GET", "/registry")[0] == 200


def test_cli_promote_demote_through_the_server(server, capsys):
    """``mcf bucket promote --url`` moves the context in the running server's memory now."""
    from mcf.cli import main

    base, root = server
    body, _, _ = npz_body(7)
    st, out, _ = call(base, "POST", "/contexts?model_id=tiers&content=cli", body)
    cid = out["context_id"]
    url = base[: -len("/mcrp/v1")]
    assert main(["bucket", "promote", "--url", url, "--token", TOKEN, cid]) == 0
    assert json.loads(capsys.readouterr().out)["tier"] == "warm"
    st, disc, _ = call(base, "GET", "/models/tiers/contexts")
    assert [c["tier"] for c in disc["contexts"]] == ["warm"]
    assert main(["bucket", "demote", "--url", url, "--token", TOKEN, cid]) == 0
    assert json.loads(capsys.readouterr().out)["tier"] == "cold"
    assert main(["bucket", "promote", "--url", url, "--token", "wrong", cid]) == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["bucket", "promote", "--url", url, "--token", TOKEN, "ctx_" + "0" * 32]) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert main(["bucket", "promote", "--url", "http://127.0.0.1:1", cid]) == 1
    assert "cannot reach" in capsys.readouterr().err
