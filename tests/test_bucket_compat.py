"""The compatibility rules of seed 003 §7: what a context must match to be used with a model (architecture
and vocab_size as well as layers, KV heads, head_dim and dtype), contexts made stale by a model registered
again with other weights (listed as stale, refused on load unless forced, replaced by the next ingest of
the same content), the registry's ``mcrp_version`` checked on read, and ``discover(include_metadata=...)``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

import mcf
from mcf.bucket import Bucket, StaleContextError

SHAPE = dict(architecture="llama", num_layers=2, num_kv_heads=2, head_dim=4, vocab_size=32000)


def kv(seed=0, tokens=5):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((2, tokens, 4)).astype(np.float32),
             rng.standard_normal((2, tokens, 4)).astype(np.float32)) for _ in range(2)]


def test_architecture_and_vocab_size_are_checked(tmp_path):
    with Bucket(tmp_path / "b") as b:
        b.register_model("m", model_hash="sha256:aa", **SHAPE)
        meta = b.ingest("m", kv(), content="text")
        # what computed the KV data is recorded with it
        assert meta["model"] == {"architecture": "llama", "vocab_size": 32000, "model_hash": "sha256:aa"}
        cid = meta["context_id"]
        assert b.check_compatible(cid, "m")["context_id"] == cid
        assert b.check_compatible(cid, dict(SHAPE))["context_id"] == cid
        for k, v in (("architecture", "qwen2"), ("vocab_size", 32001), ("num_layers", 3), ("num_kv_heads", 1),
                     ("head_dim", 8), ("dtype", "bfloat16")):
            with pytest.raises(mcf.InvalidArgumentError, match=f"incompatible: {k} is .*, the model needs {v!r}"):
                b.check_compatible(cid, dict(SHAPE, **{k: v}))
            with pytest.raises(mcf.InvalidArgumentError, match="incompatible"):
                b.load(cid, model=dict(SHAPE, **{k: v}))
        assert len(b.load(cid, model=dict(SHAPE, dtype="float16"))) == 2
        with pytest.raises(mcf.InvalidArgumentError, match="compatibility dict"):
            b.check_compatible(cid, ["llama"])
        # a context ingested before its model was registered has no recorded architecture or vocabulary:
        # only its shape can be checked
        old = b.ingest("n", kv(1), content="older")
        assert old["model"] is None
        b.register_model("n", **SHAPE)
        assert b.check_compatible(old["context_id"], dict(SHAPE, architecture="other", vocab_size=7))
        with pytest.raises(mcf.InvalidArgumentError, match="head_dim"):
            b.check_compatible(old["context_id"], dict(SHAPE, head_dim=2))
        for bad in ({"vocab_size": -1}, {"vocab_size": True}, {"architecture": ""}, {"model_hash": 5},
                    {"model_hash": "x" * 300}):
            with pytest.raises(mcf.InvalidArgumentError):
                b.register_model("m", **bad)


def test_a_new_model_hash_makes_the_former_contexts_stale(tmp_path):
    with Bucket(tmp_path / "b") as b:
        b.register_model("m", model_hash="sha256:v1", **SHAPE)
        c1 = b.ingest("m", kv(0), content="one")["context_id"]
        c2 = b.ingest("m", kv(1), content="two")["context_id"]
        assert {c["context_id"]: c["stale"] for c in b.discover("m")} == {c1: False, c2: False}
        assert b.registry()["models"][0]["model_hash"] == "sha256:v1"

        b.register_model("m", model_hash="sha256:v2", **SHAPE)    # a fine-tune: other weights
        # listed, and listed as stale, by this object and by a fresh one (another process)
        for bb in (b, Bucket(tmp_path / "b")):
            assert {c["context_id"]: c["stale"] for c in bb.discover("m")} == {c1: True, c2: True}
            assert bb.is_stale(c1) and bb.registry()["models"][0]["model_hash"] == "sha256:v2"
            with pytest.raises(StaleContextError, match=rf"{c1} is stale: .*sha256:v1.*sha256:v2") as ei:
                bb.load(c1)
            assert isinstance(ei.value, mcf.InvalidArgumentError)
            np.testing.assert_array_equal(bb.load(c1, force=True, verify=True)[1][0], kv(0)[1][0].astype(np.float16))
        # the next ingest of the same content computes it again in place of the stale one
        again = b.ingest("m", kv(5), content="one")
        assert again["context_id"] == c1 and not again.get("deduplicated")
        assert again["model"]["model_hash"] == "sha256:v2"
        np.testing.assert_array_equal(b.load(c1)[0][0], kv(5)[0][0].astype(np.float16))
        assert b.ingest("m", kv(5), content="one")["deduplicated"]       # and is deduplicated from then on
        assert {c["context_id"]: c["stale"] for c in b.discover("m")} == {c1: False, c2: True}
        assert not [p for p in (tmp_path / "b" / "contexts").iterdir() if p.name.startswith(".tmp-")]
        # a rebuilt registry says the same
        b.rebuild()
        assert {c["context_id"]: c["stale"] for c in Bucket(tmp_path / "b").discover("m")} == {c1: False, c2: True}
        # back to the first weights: what v2 computed is stale now, what v1 computed is not
        b.register_model("m", model_hash="sha256:v1", **SHAPE)
        assert {c["context_id"]: c["stale"] for c in b.discover("m")} == {c1: True, c2: False}


def test_contexts_of_unknown_weights_are_never_stale(tmp_path):
    with Bucket(tmp_path / "b") as b:
        c0 = b.ingest("m", kv(0), content="before registration")["context_id"]
        b.register_model("m", **SHAPE)                                  # no hash
        c1 = b.ingest("m", kv(1), content="no hash")["context_id"]
        b.register_model("m", model_hash="sha256:v1", **SHAPE)
        assert [c["stale"] for c in b.discover("m")] == [False, False]
        b.load(c0)
        b.load(c1)


def _registry_doc(root):
    return json.loads((root / "registry.json").read_text())


def test_a_mistyped_model_block_is_refused_not_compared(tmp_path):
    """The metadata's ``model`` block decides compatibility and staleness: a field of the wrong type
    (a hash that is a number, a vocab_size that is a string or a bool) would compare unequal and mark
    the context stale or incompatible for no reason, so reading the metadata refuses it, naming it."""
    with Bucket(tmp_path / "b") as b:
        b.register_model("m", model_hash="sha256:aa", **SHAPE)
        cid = b.ingest("m", kv(), content="text")["context_id"]
    mp = tmp_path / "b" / "contexts" / cid / "metadata.json"
    good = json.loads(mp.read_text())
    for block, field in (([1], "model"), ("llama", "model"), ({"model_hash": 5}, "model.model_hash"),
                         ({"model_hash": {"sha256": "aa"}}, "model.model_hash"),
                         ({"vocab_size": "32000"}, "model.vocab_size"), ({"vocab_size": True}, "model.vocab_size"),
                         ({"vocab_size": 0}, "model.vocab_size"), ({"architecture": 3}, "model.architecture")):
        mp.write_text(json.dumps(dict(good, model=block)))
        with Bucket(tmp_path / "b") as b:
            with pytest.raises(mcf.FormatError) as ei:
                b.lookup(cid)
            assert field in str(ei.value) and "metadata.json" in str(ei.value), (block, str(ei.value))
    # null, an empty block and partial blocks of the right types are read (older buckets, other writers)
    for block in (None, {}, {"model_hash": None}, {"architecture": "llama", "vocab_size": 32000}):
        mp.write_text(json.dumps(dict(good, model=block)))
        with Bucket(tmp_path / "b") as b:
            assert b.lookup(cid)["context_id"] == cid
            assert b.is_stale(cid) is False


def test_the_registry_version_is_checked_on_read(tmp_path):
    root = tmp_path / "b"
    with Bucket(root) as b:
        b.register_model("m", model_hash="sha256:v1", **SHAPE)
        cid = b.ingest("m", kv(), content="text")["context_id"]
        b.rebuild()
    doc = _registry_doc(root)
    assert doc["mcrp_version"] == "1.0"
    # a newer minor version reads
    (root / "registry.json").write_text(json.dumps(dict(doc, mcrp_version="1.7")))
    with Bucket(root) as b:
        assert [c["context_id"] for c in b.discover("m")] == [cid]
    # another major version is refused, and left as it is (not rebuilt over)
    for v in ("2.0", "0.9", "10.1.3"):
        raw = json.dumps(dict(doc, mcrp_version=v))
        (root / "registry.json").write_text(raw)
        with pytest.raises(mcf.UnsupportedVersionError, match=f"mcrp_version {v} is not readable") as ei:
            Bucket(root)
        assert ei.value.field == "mcrp_version" and "registry.json" in str(ei.value)
        assert (root / "registry.json").read_text() == raw
    # a missing or malformed version is a damaged cache: rebuilt from contexts/
    for bad in (None, 1.0, "one", "1", "1.0.0.0", "01.0", "1." + "9" * 50):
        d = dict(doc)
        if bad is None:
            del d["mcrp_version"]
        else:
            d["mcrp_version"] = bad
        (root / "registry.json").write_text(json.dumps(d))
        with Bucket(root) as b:
            assert [c["context_id"] for c in b.discover("m")] == [cid]
        assert _registry_doc(root)["mcrp_version"] == "1.0"


def test_discover_with_metadata(tmp_path):
    with Bucket(tmp_path / "b") as b:
        b.register_model("m", model_hash="sha256:v1", **SHAPE)
        ids = [b.ingest("m", kv(i), content=f"doc {i}", name=f"n{i}")["context_id"] for i in range(3)]
        plain = b.discover("m")
        assert all("metadata" not in c for c in plain)
        full = b.discover("m", include_metadata=True)
        assert [c["context_id"] for c in full] == [c["context_id"] for c in plain] and sorted(ids) == sorted(
            c["context_id"] for c in full)
        for c in full:
            assert c["metadata"] == b.lookup(c["context_id"])
            assert {k: v for k, v in c.items() if k != "metadata"} in plain
        # a context deleted behind the registry's back is left out, not an error
        import shutil

        shutil.rmtree(tmp_path / "b" / "contexts" / ids[0])
        assert ids[0] not in [c["context_id"] for c in b.discover("m", include_metadata=True)]
        for k in ("include_metadata", "force_scan"):
            with pytest.raises(mcf.InvalidArgumentError, match=f"{k} must be True or False"):
                b.discover("m", **{k: "yes"})


TOKEN = "compat-token-of-at-least-32-bytes-0123456789"


def call(base, path, method="GET"):
    req = urllib.request.Request(base + path, method=method, headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_rest_stale_contexts_and_discovery_with_metadata(tmp_path):
    pytest.importorskip("uvicorn", reason="the server needs the 'server' extra")
    from _bucket_server import serve

    root = tmp_path / "b"
    with Bucket(root) as b:
        b.register_model("m", model_hash="sha256:v1", **SHAPE)
        cid = b.ingest("m", kv(), content="text")["context_id"]
    with serve(root, TOKEN) as (url, _):
        base = url + "/mcrp/v1"
        st, out = call(base, "/models/m/contexts?include_metadata=true")
        assert st == 200 and out["contexts"][0]["metadata"]["context_id"] == cid
        assert out["contexts"][0]["stale"] is False
        st, out = call(base, "/models/m/contexts")
        assert st == 200 and "metadata" not in out["contexts"][0]
        assert call(base, "/models/m/contexts?include_metadata=maybe")[0] == 400
        assert call(base, f"/contexts/{cid}/kv")[0] == 200
        with Bucket(root) as b:
            b.register_model("m", model_hash="sha256:v2", **SHAPE)
        st, out = call(base, "/models/m/contexts")
        assert st == 200 and out["contexts"][0]["stale"] is True
        st, out = call(base, f"/contexts/{cid}/kv")
        assert st == 409 and "stale" in out["error"]
        st, raw = call(base, f"/contexts/{cid}/kv?force=true")
        assert st == 200 and raw[:4] == (root / "contexts" / cid / "kv_data.mcb").read_bytes()[:4]


# -- check_compatible compares model_hash, refuses unknown keys and stale contexts --------------------------
def test_check_compatible_compares_the_model_hash(tmp_path):
    """``load(cid, model={..., "model_hash": "sha256:new"})`` returned the cache computed under the old
    hash: the hash was never compared."""
    with Bucket(tmp_path / "b") as b:
        b.register_model("m", model_hash="sha256:old", **SHAPE)
        cid = b.ingest("m", kv(), content="text")["context_id"]
        assert b.check_compatible(cid, dict(SHAPE, model_hash="sha256:old"))["context_id"] == cid
        assert len(b.load(cid, model=dict(SHAPE, model_hash="sha256:old"))) == 2
        for call in (lambda: b.check_compatible(cid, dict(SHAPE, model_hash="sha256:new")),
                     lambda: b.load(cid, model=dict(SHAPE, model_hash="sha256:new")),
                     lambda: b.load(cid, model={"model_hash": "sha256:new"}, force=True)):
            with pytest.raises(mcf.InvalidArgumentError,
                               match="model_hash is 'sha256:old', the model needs 'sha256:new'"):
                call()
        # a context whose weights nobody recorded cannot be compared: only its shape is checked
        old = b.ingest("u", kv(1), content="unregistered")["context_id"]
        assert b.check_compatible(old, {"model_hash": "sha256:any", "num_layers": 2})["context_id"] == old
        # the dtype may be given as any spelling the bucket accepts
        assert b.check_compatible(cid, {"dtype": np.float16})["context_id"] == cid
        with pytest.raises(mcf.InvalidArgumentError, match="dtype"):
            b.check_compatible(cid, {"dtype": "float64x"})


def test_check_compatible_refuses_unknown_keys(tmp_path):
    """A typo (``"architectur"``) was ignored: the check passed without checking the architecture."""
    with Bucket(tmp_path / "b") as b:
        b.register_model("m", model_hash="sha256:aa", **SHAPE)
        cid = b.ingest("m", kv(), content="text")["context_id"]
        for model in ({"architectur": "qwen2"}, dict(SHAPE, model_id="m"), {1: 2}):
            for call in (lambda: b.check_compatible(cid, model), lambda: b.load(cid, model=model)):
                with pytest.raises(mcf.InvalidArgumentError, match="unknown key") as e:
                    call()
                assert repr(next(k for k in model if k not in SHAPE)) in str(e.value)
                for known in ("architecture", "model_hash", "vocab_size", "num_layers", "dtype"):
                    assert known in str(e.value)


def test_check_compatible_reports_a_stale_context(tmp_path):
    with Bucket(tmp_path / "b") as b:
        b.register_model("m", model_hash="sha256:v1", **SHAPE)
        cid = b.ingest("m", kv(), content="text")["context_id"]
        b.register_model("m", model_hash="sha256:v2", **SHAPE)
        for model in ("m", dict(SHAPE), {}):
            with pytest.raises(StaleContextError, match=rf"{cid} is stale"):
                b.check_compatible(cid, model)
            with pytest.raises(StaleContextError):
                b.load(cid, model=model)
            assert len(b.load(cid, model=model, force=True)) == 2     # force loads it anyway, still checked
        with pytest.raises(mcf.InvalidArgumentError, match="incompatible: head_dim"):
            b.load(cid, model=dict(SHAPE, head_dim=8), force=True)


def test_is_stale_names_what_a_metadata_dict_lacks(tmp_path):
    """``is_stale({})`` raised a bare KeyError."""
    with Bucket(tmp_path / "b") as b:
        b.register_model("m", model_hash="sha256:v1", **SHAPE)
        meta = b.ingest("m", kv(), content="text")
        assert b.is_stale(meta) is False and b.is_stale(meta["context_id"]) is False
        for bad, what in (({}, "model_id"), ({"model_id": 5}, "model_id"), ({"model_id": "m", "model": 3}, "model"),
                          ({"model_id": "m", "model": {"model_hash": 7}}, "model.model_hash")):
            with pytest.raises(mcf.InvalidArgumentError, match=what.replace(".", r"\.")):
                b.is_stale(bad)
        with pytest.raises(mcf.ArgumentTypeError, match="context id or"):
            b.is_stale(None)
        assert b.is_stale({"model_id": "m"}) is False                     # no recorded weights: never stale
        assert b.is_stale({"model_id": "m", "model": {"model_hash": "sha256:v0"}}) is True


def asgi(app, method, path, body=b""):
    """``(status, JSON body)`` of one request to the ASGI application, in this process (no socket)."""
    import asyncio

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    sent, events = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return events.pop(0) if events else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def test_rest_query_refuses_a_stale_context(tmp_path):
    """The query route handed a stale context to its backend, which may read the KV data without
    Bucket.load's check: it answers 409 as /kv does, before the backend runs."""
    pytest.importorskip("starlette", reason="the server needs the 'server' extra")
    from mcf.apps.bucket_server import create_app

    asked = []

    class Backend:
        def query(self, bucket, context_id, query, options):
            asked.append(context_id)
            return {"status": "success", "response": "ok"}

    with Bucket(tmp_path / "b") as b:
        b.register_model("m", model_hash="sha256:v1", **SHAPE)
        cid = b.ingest("m", kv(), content="text")["context_id"]
        app = create_app(tmp_path / "b", backend=Backend(), bucket=b)
        body = json.dumps({"query": "why?"}).encode()
        assert asgi(app, "POST", f"/mcrp/v1/contexts/{cid}/query", body) == (200, {"status": "success",
                                                                                   "response": "ok"})
        b.register_model("m", model_hash="sha256:v2", **SHAPE)
        st, out = asgi(app, "POST", f"/mcrp/v1/contexts/{cid}/query", body)
        assert st == 409 and f"{cid} is stale" in out["error"], out
        assert asked == [cid]
