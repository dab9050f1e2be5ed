"""The bucket with a model in the loop (mcf.bucket.hf): tiny causal LMs built from configs with random
weights compute KV caches at ingest; generation after loading a stored cache must equal a run of the same
model over content + query from scratch (transformers' own ``generate``), in tokens and in logits, for
every stored dtype, grouped-query attention and sliding windows included.  The REST routes are exercised
over loopback against a server started with ``--backend transformers``."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers backend needs torch (the 'transformers' extra)")
transformers = pytest.importorskip("transformers", reason="the 'transformers' extra")

import mcf  # noqa: E402
from _hf_models import BOS, EOS, WORDS, save_tiny, tiny_model, tiny_tokenizer  # noqa: E402
from mcf.bucket import Bucket  # noqa: E402
from mcf.bucket.hf import MissingDependencyError, TransformersBackend, weights_fingerprint  # noqa: E402

RNG = np.random.default_rng(12)
CONTENT = [BOS] + RNG.integers(3, 3 + len(WORDS), 57).tolist()
QUERY = RNG.integers(3, 3 + len(WORDS), 6).tolist()
STEPS = 12


def from_scratch(model, ids, steps=STEPS):
    """transformers' own greedy generation over the whole prompt: (tokens, [steps, vocab] logits)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences[0, len(ids):].tolist(), torch.stack([x[0] for x in out.logits]).float().numpy()


def cache_kw(model, cache) -> dict:
    """The forward's cache keyword: ``cache`` in transformers releases that renamed it (the old name warns
    there), ``past_key_values`` before."""
    import inspect

    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def rounded_prefix_run(model, content, query, steps, dtype, *, temperature=0.0, seed=None):
    """A from-scratch run whose prefix cache is rounded to ``dtype`` and back, as a stored cache of that
    dtype is: the content's prefill, the rounding, then the query and greedy (or seeded sampled) decoding."""
    from mcf.bucket.hf import _pick

    with torch.inference_mode():
        cache = transformers.DynamicCache(config=model.config)
        model(input_ids=torch.tensor([content]), use_cache=True, **cache_kw(model, cache))
        pairs = [(layer.keys.to(dtype).to(model.dtype), layer.values.to(dtype).to(model.dtype))
                 for layer in cache.layers]
        cache = transformers.DynamicCache(pairs, config=model.config)
        gen = None
        if temperature:
            gen = torch.Generator()
            gen.manual_seed(seed)
        feed, toks, logits = query, [], []
        for _ in range(steps):
            step = model(input_ids=torch.tensor([feed]), use_cache=True, **cache_kw(model, cache)).logits[0, -1].float()
            logits.append(step.numpy())
            toks.append(_pick(step, temperature, None, None, gen))
            feed = [toks[-1]]
    return toks, np.stack(logits)


@pytest.fixture(scope="module")
def models():
    return {"llama-gqa": tiny_model("llama", seed=1, heads=4, kv_heads=2),      # grouped-query attention
            "qwen2": tiny_model("qwen2", seed=2, heads=4, kv_heads=1),          # q/k/v biases, one KV head
            "gpt2": tiny_model("gpt2", seed=3, heads=4)}                          # multi-head, absolute positions


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "gpt2"])
def test_greedy_after_loading_equals_from_scratch_fp32(kind, models, tmp_path):
    model = models[kind]
    be = TransformersBackend(model, model_id=kind)
    with Bucket(tmp_path / "b") as b:
        meta = be.ingest(b, token_ids=CONTENT, compression="lz4")
        assert meta["kv_cache"]["dtype"] == "float32" and meta["content"]["token_count"] == len(CONTENT)
        num_layers, num_kv_heads, head_dim = be.kv_shape
        assert meta["kv_cache"]["shape"]["num_kv_heads"] == num_kv_heads == model.config.get_text_config(
            decoder=True).to_dict().get("num_key_value_heads", 4)
        g = be.generate(b, meta["context_id"], query_ids=QUERY, max_new_tokens=STEPS, stop_at_eos=False,
                        return_logits=True)
    want_tokens, want_logits = from_scratch(model, CONTENT + QUERY)
    assert g.token_ids == want_tokens
    assert g.logits.shape == want_logits.shape
    np.testing.assert_allclose(g.logits, want_logits, rtol=0, atol=2e-5)   # measured: 1.2e-6 (logits up to 2.6)
    assert (g.context_tokens, g.query_tokens, g.finish_reason, g.tier) == (len(CONTENT), len(QUERY), "length", "cold")


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "int8"])
def test_reduced_precision_caches(kv_dtype, models, tmp_path):
    """A cache stored in fp16 / bf16 / int8 is the fp32 prefix rounded once: against a from-scratch run with
    the same rounding the tokens are equal and the logits within float tolerance (measured 2.4e-7); against
    the unrounded run the logits move by the rounding: measured 5.5e-4 (fp16), 3.7e-3 (bf16), 1.8e-2 (int8)
    for logits up to 2.6; the bounds below are 4x that."""
    model = models["llama-gqa"]
    be = TransformersBackend(model, model_id="llama-gqa")
    with Bucket(tmp_path / "b") as b:
        meta = be.ingest(b, token_ids=CONTENT, dtype=kv_dtype)
        assert meta["kv_cache"]["dtype"] == kv_dtype
        g = be.generate(b, meta["context_id"], query_ids=QUERY, max_new_tokens=STEPS, stop_at_eos=False,
                        return_logits=True)
    exact_tokens, exact_logits = from_scratch(model, CONTENT + QUERY)
    drift = float(np.abs(g.logits - exact_logits).max())
    assert drift < {"float16": 2.2e-3, "bfloat16": 1.5e-2, "int8": 7.2e-2}[kv_dtype], drift
    assert g.token_ids == exact_tokens            # the rounding does not change these greedy tokens
    if kv_dtype == "int8":   # per-row symmetric int8: no torch dtype rounds the same way; the drift only
        return
    tokens, logits = rounded_prefix_run(model, CONTENT, QUERY, STEPS, getattr(torch, kv_dtype))
    assert g.token_ids == tokens
    np.testing.assert_allclose(g.logits, logits, rtol=0, atol=2e-5)


def test_fp16_model_with_its_own_fp16_cache(tmp_path):
    """A half-precision model stores its cache as it computed it (the default kv_dtype is the model's)."""
    model = tiny_model("llama", seed=4).to(torch.float16)
    be = TransformersBackend(model, model_id="llama-fp16")
    assert be.kv_dtype == "float16"
    with Bucket(tmp_path / "b") as b:
        meta = be.ingest(b, token_ids=CONTENT)
        assert meta["kv_cache"]["dtype"] == "float16"
        g = be.generate(b, meta["context_id"], query_ids=QUERY, max_new_tokens=STEPS, stop_at_eos=False,
                        return_logits=True)
    tokens, logits = from_scratch(model, CONTENT + QUERY)
    assert g.token_ids == tokens
    np.testing.assert_allclose(g.logits, logits, rtol=0, atol=8e-3)   # fp16 arithmetic in two orders: 2e-3 measured


def test_sampling_is_the_same_draw_from_the_same_distribution(models, tmp_path):
    model = models["llama-gqa"]
    be = TransformersBackend(model, model_id="llama-gqa")
    with Bucket(tmp_path / "b") as b:
        cid = be.ingest(b, token_ids=CONTENT)["context_id"]
        a = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS, temperature=0.8, seed=7, stop_at_eos=False)
        again = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS, temperature=0.8, seed=7, stop_at_eos=False)
        other = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS, temperature=5.0, seed=8, stop_at_eos=False)
        top1 = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS, temperature=0.8, top_k=1,
                           stop_at_eos=False)
        nucleus = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS, temperature=0.8, top_p=1e-6,
                              stop_at_eos=False)
        greedy = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS, stop_at_eos=False)
    want, _ = rounded_prefix_run(model, CONTENT, QUERY, STEPS, torch.float32, temperature=0.8, seed=7)
    assert a.token_ids == again.token_ids == want
    assert other.token_ids != a.token_ids
    assert top1.token_ids == nucleus.token_ids == greedy.token_ids     # both keep only the most likely token


def test_text_in_text_out_and_deduplication(models, tmp_path):
    tok = tiny_tokenizer()
    model = models["llama-gqa"]
    be = TransformersBackend(model, tok, model_id="llama-gqa")
    text = "the cat sat on the red hat and the dog ran to the river at night"
    question = "where is the cat"
    with Bucket(tmp_path / "b") as b:
        meta = be.ingest(b, text, name="story")
        # the content's identity is the text (seed 003's content hash); the KV covers its tokens with the BOS
        assert meta["content"]["hash"] == mcf.bucket.content_hash(text)
        assert meta["content"]["token_count"] == len(tok.encode(text)) and tok.encode(text)[0] == BOS
        def no_prefill(ids):
            raise AssertionError("the model ran for content that is already stored")

        be.prefill, prefill = no_prefill, be.prefill
        again = be.ingest(b, text)
        assert again["deduplicated"] and again["context_id"] == meta["context_id"]
        be.prefill = prefill
        g = be.generate(b, meta["context_id"], question, max_new_tokens=8, stop_at_eos=False)
        ans = be.query(b, meta["context_id"], question, {"max_tokens": 8, "stop_at_eos": False})
    ids = tok.encode(text) + tok.encode(question, add_special_tokens=False)
    want, _ = from_scratch(model, ids, 8)
    assert g.token_ids == want and g.text == tok.decode(want, skip_special_tokens=True)
    assert ans["response"] == g.text and ans["token_ids"] == want
    assert ans["usage"] == {"context_tokens": len(tok.encode(text)), "query_tokens": 4, "generated_tokens": 8}
    assert ans["cache_hit"] and ans["status"] == "success" and ans["model_id"] == "llama-gqa"


def test_the_backend_reuses_only_what_the_bucket_would(models, tmp_path, monkeypatch):
    """The backend looks for stored content before it runs the model, and finds what the bucket's own
    ingest would deduplicate: content stored in clear is computed again and stored encrypted by a keyed
    bucket; content under another key is refused before the model runs."""
    monkeypatch.delenv("MCF_BUCKET_KEY", raising=False)
    be = TransformersBackend(models["llama-gqa"], tiny_tokenizer(), model_id="llama-gqa")
    text = "the cat sat on the mat"
    clear = be.ingest(Bucket(tmp_path), text)
    keyed = be.ingest(Bucket(tmp_path, key=bytes(32)), text)
    assert keyed["context_id"] == clear["context_id"] and not keyed.get("deduplicated")
    assert keyed["kv_cache"]["encrypted"] is True
    assert be.ingest(Bucket(tmp_path, key=bytes(32)), text)["deduplicated"]

    def no_prefill(ids):
        raise AssertionError("the model ran for content stored under another key")

    be.prefill = no_prefill
    with pytest.raises(mcf.EncryptionKeyError, match="another key"):
        be.ingest(Bucket(tmp_path, key=bytes(range(32))), text)


def test_stops_at_the_end_of_sequence_token(models, tmp_path):
    be = TransformersBackend(models["llama-gqa"], model_id="llama-gqa")
    assert be.eos_token_ids == {EOS}                        # from the model's config
    with Bucket(tmp_path / "b") as b:
        cid = be.ingest(b, token_ids=CONTENT)["context_id"]
        full = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS, stop_at_eos=False)
        be.eos_token_ids = {full.token_ids[3]}              # a token this continuation produces: it ends there
        g = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS)
        h = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS, stop_at_eos=False)
    first = full.token_ids.index(full.token_ids[3])
    assert (g.finish_reason, g.token_ids) == ("eos", full.token_ids[:first + 1])
    assert (h.finish_reason, h.token_ids) == ("length", full.token_ids)


def test_tiers_give_the_same_answer(models, tmp_path):
    model = models["qwen2"]
    be = TransformersBackend(model, model_id="qwen2")
    with Bucket(tmp_path / "b") as b:
        cid = be.ingest(b, token_ids=CONTENT, dtype="bfloat16", compression="zstd")["context_id"]
        answers = {}
        for tier in ("cold", "warm", "hot"):
            if tier != "cold":
                b.promote(cid, tier, device="cpu")
            g = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS, stop_at_eos=False, return_logits=True)
            assert g.tier == tier
            answers[tier] = g
    assert answers["cold"].token_ids == answers["warm"].token_ids == answers["hot"].token_ids
    assert np.array_equal(answers["cold"].logits, answers["hot"].logits)


def test_sliding_window_models(tmp_path):
    model = tiny_model("mistral", seed=6, sliding_window=24)
    be = TransformersBackend(model, model_id="mistral-sw")
    with Bucket(tmp_path / "b") as b:
        with pytest.raises(mcf.InvalidArgumentError, match="sliding-window layers keep only the last 23"):
            be.ingest(b, token_ids=CONTENT)                     # 58 tokens do not fit a 24-token window
        cid = be.ingest(b, token_ids=CONTENT[:20])["context_id"]
        g = be.generate(b, cid, query_ids=QUERY, max_new_tokens=STEPS, stop_at_eos=False, return_logits=True)
    tokens, logits = from_scratch(model, CONTENT[:20] + QUERY)   # generation runs past the window
    assert g.token_ids == tokens
    np.testing.assert_allclose(g.logits, logits, rtol=0, atol=2e-5)


def test_chunked_prefill_stores_the_same_cache(models, tmp_path):
    model = models["llama-gqa"]
    whole = TransformersBackend(model, model_id="llama-gqa").prefill(CONTENT)
    chunked = TransformersBackend(model, model_id="llama-gqa", prefill_chunk=16).prefill(CONTENT)
    for (k1, v1), (k2, v2) in zip(whole, chunked):
        np.testing.assert_allclose(k1, k2, rtol=0, atol=1e-5)
        np.testing.assert_allclose(v1, v2, rtol=0, atol=1e-5)


def test_the_model_identity_is_checked(models, tmp_path):
    llama = TransformersBackend(models["llama-gqa"], model_id="shared-id")
    with Bucket(tmp_path / "b") as b:
        cid = llama.ingest(b, token_ids=CONTENT)["context_id"]
        doc = b.model("shared-id")
        assert doc["model_compatibility"] == {"architecture": "llama", "num_layers": 2, "num_kv_heads": 2,
                                              "head_dim": 16, "dtype": None,
                                              "vocab_size": models["llama-gqa"].config.vocab_size}
        assert doc["model_hash"] == weights_fingerprint(models["llama-gqa"]) == llama.model_hash
        # same architecture and shape, other weights: refused, its contexts would be wrong
        other = TransformersBackend(tiny_model("llama", seed=99, heads=4, kv_heads=2), model_id="shared-id")
        with pytest.raises(mcf.InvalidArgumentError, match="computed by other weights"):
            other.generate(b, cid, query_ids=QUERY)
        with pytest.raises(mcf.InvalidArgumentError, match="computed by other weights"):
            other.ingest(b, token_ids=CONTENT)
        # ... unless the caller vouches for them
        TransformersBackend(models["llama-gqa"], model_id="shared-id", model_hash=doc["model_hash"]).register(b)
        # another shape under the same id
        with pytest.raises(mcf.InvalidArgumentError, match="num_kv_heads=2; this model has num_kv_heads=1"):
            TransformersBackend(tiny_model("llama", kv_heads=1), model_id="shared-id").generate(b, cid, query_ids=QUERY)
        with pytest.raises(mcf.InvalidArgumentError, match="architecture='llama'; this model has architecture='qwen2'"):
            TransformersBackend(models["qwen2"], model_id="shared-id").generate(b, cid, query_ids=QUERY)
        # a context of another model
        q = TransformersBackend(models["qwen2"], model_id="qwen2")
        with pytest.raises(mcf.InvalidArgumentError, match="belongs to model 'shared-id'"):
            q.generate(b, cid, query_ids=QUERY)
        # new weights accepted on purpose: the former weights' contexts are stale, then computed again
        other.register(b, new_weights=True)
        assert b.model("shared-id")["model_hash"] == other.model_hash
        assert [(c["context_id"], c["stale"]) for c in b.discover("shared-id")] == [(cid, True)]
        with pytest.raises(mcf.bucket.StaleContextError, match="is stale"):
            other.generate(b, cid, query_ids=QUERY)
        again = other.ingest(b, token_ids=CONTENT)
        assert not again.get("deduplicated") and again["context_id"] == cid
        assert again["model"]["model_hash"] == other.model_hash
        assert [c["stale"] for c in b.discover("shared-id")] == [False]
        want, _ = from_scratch(other.model, CONTENT + QUERY, 4)
        assert other.generate(b, cid, query_ids=QUERY, max_new_tokens=4, stop_at_eos=False).token_ids == want
    # the fingerprint sees a change of weights and of dtype, and is stable
    m = tiny_model("llama", seed=1, heads=4, kv_heads=2)
    fp = weights_fingerprint(m)
    assert fp == weights_fingerprint(models["llama-gqa"])
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight.mul_(1.001)
    assert weights_fingerprint(m) != fp
    assert weights_fingerprint(tiny_model("llama", seed=1, heads=4, kv_heads=2).to(torch.bfloat16)) != fp


def test_bad_input_is_refused(models, tmp_path):
    be = TransformersBackend(models["gpt2"], model_id="gpt2")           # 512 positions, no tokenizer
    with Bucket(tmp_path / "b") as b:
        cid = be.ingest(b, token_ids=CONTENT)["context_id"]
        cases = [
            (lambda: be.ingest(b, "some text"), "no tokenizer"),
            (lambda: be.ingest(b, token_ids=[]), "no tokens"),
            (lambda: be.ingest(b, token_ids=[1, len(WORDS) + 3]), "outside the model's vocabulary"),
            (lambda: be.ingest(b, token_ids=[-1]), "outside the model's vocabulary"),
            (lambda: be.ingest(b, token_ids=[1] * 513), "more than the model's 512 positions"),
            (lambda: be.ingest(b, "x", token_ids=[1]), "exactly one of content or token_ids"),
            (lambda: be.generate(b, cid, query_ids=[]), "the query has no tokens"),
            (lambda: be.generate(b, cid, query_ids=[3], max_new_tokens=512), "positions"),
            (lambda: be.generate(b, cid, query_ids=[3], max_new_tokens=0), "max_tokens"),
            (lambda: be.generate(b, cid, query_ids=[3], temperature=-1), "temperature"),
            (lambda: be.generate(b, cid, query_ids=[3], top_k=5), "give a temperature"),
            (lambda: be.generate(b, cid, query_ids=[3], temperature=1.0, top_p=1.5), "top_p"),
            (lambda: be.generate(b, cid, query_ids=[3], temperature=1.0, seed=-1), "seed"),
            (lambda: be.query(b, cid, "x", {"stream": True}), "unknown option"),
            (lambda: be.query(b, cid, "x", {"max_tokens": "3"}), "max_tokens"),
            (lambda: be.query(b, cid, "x", None), "options must be a dict"),          # was a bare TypeError
            (lambda: be.query(b, cid, "x", ["max_tokens"]), "options must be a dict"),  # was an AttributeError
            (lambda: be.query(b, cid, "x", {1: 2, "stream": 3}), r"unknown option\(s\) 1, 'stream'"),
            (lambda: be.generate(b, "ctx_" + "0" * 32, query_ids=[3]), "ctx_0000"),
        ]
        for call, what in cases:
            with pytest.raises(mcf.MCFError, match=what):
                call()
    with pytest.raises(mcf.InvalidArgumentError, match="invalid model id"):
        TransformersBackend(models["gpt2"], model_id="../escape")
    with pytest.raises(mcf.InvalidArgumentError, match="prefill_chunk"):
        TransformersBackend(models["gpt2"], model_id="g", prefill_chunk=0)


def test_a_cache_that_is_not_one_kv_pair_per_token_is_refused():
    from mcf.bucket.hf import _layout_of

    class Odd:        # a cache layer of another kind (linear attention, shared KV, ...)
        keys = values = None

    cache = transformers.DynamicCache()
    cache.layers = [Odd()]
    with pytest.raises(mcf.InvalidArgumentError, match="cannot be stored in a bucket"):
        _layout_of(cache, 1, "OddModel")


def test_missing_packages_name_the_extra():
    """Without transformers (or torch) the backend says which extra to install; the error is an MCFError and
    an ImportError."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from mcf.bucket.hf import TransformersBackend, MissingDependencyError\n"
            "import mcf\n"
            "try:\n    TransformersBackend(object(), model_id='m')\n"
            "except MissingDependencyError as e:\n"
            "    print(isinstance(e, mcf.MCFError), isinstance(e, ImportError), e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("True True ") and "pip install 'mcf-formats[transformers]'" in out
    assert issubclass(MissingDependencyError, mcf.MCFError) and issubclass(MissingDependencyError, ImportError)


# -- the REST routes, over loopback --------------------------------------------------------------------------
TOKEN = "hf-token-of-at-least-32-bytes-0123456789abcd"


def call(base, method, path, body=None, content_type="application/json"):
    req = urllib.request.Request(base + path, data=body, method=method,
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_rest_text_ingest_and_query_with_a_backend(tmp_path):
    pytest.importorskip("uvicorn", reason="the server needs the 'server' extra")
    from _bucket_server import serve

    ckpt = tmp_path / "tiny-llama"
    save_tiny(ckpt, "llama", seed=11)
    text = "the cat sat on the red hat and the dog ran to the river at night"
    with serve(tmp_path / "bucket", TOKEN, "--backend", "transformers", "--model", str(ckpt)) as (url, _):
        base = url + "/mcrp/v1"
        # the start-up's model.loaded (seed 003 §6.2), replayed to an event stream opened from the beginning
        from test_bucket_events import Events

        ev = Events(url, query="?last_event_id=0", token=TOKEN)
        (_, d1, e1), (_, d2, e2) = ev.next(), ev.next()
        assert (d1, e1["model_id"], e1["contexts"]) == ("context.discovered", "tiny-llama", [])
        assert (d2, e2["model_id"], e2["contexts"]) == ("model.loaded", "tiny-llama", [])
        ev.close()
        st, out = call(base, "POST", "/contexts?model_id=tiny-llama&name=story&compression=zstd",
                       json.dumps({"content": text}).encode())
        assert st == 201, out
        assert out["token_count"] == len(text.split()) + 1 and out["ingestion_time_ms"] > 0
        cid = out["context_id"]
        st, again = call(base, "POST", "/contexts?model_id=tiny-llama", json.dumps({"content": text}).encode())
        assert st == 201 and again["deduplicated"] and again["context_id"] == cid
        st, ans = call(base, "POST", f"/contexts/{cid}/query",
                       json.dumps({"query": "where is the cat",
                                   "options": {"max_tokens": 6, "stop_at_eos": False}}).encode())
        assert st == 200, ans
        # token ids instead of text (indexed for prefix reuse)
        st, by_ids = call(base, "POST", "/contexts?model_id=tiny-llama", json.dumps({"token_ids": CONTENT}).encode())
        assert st == 201 and by_ids["token_count"] == len(CONTENT)
        st, meta = call(base, "GET", f"/contexts/{by_ids['context_id']}")
        assert meta["prefix"] is not None
        # refusals: another model id, both or neither field, bad ids, unknown options, text in the query string
        for path, body, code, what in (
                ("/contexts?model_id=other", {"content": text}, 400, "serves 'tiny-llama'"),
                ("/contexts?model_id=tiny-llama", {"content": text, "token_ids": [1]}, 400, "exactly one"),
                ("/contexts?model_id=tiny-llama", {}, 400, "exactly one"),
                ("/contexts?model_id=tiny-llama", {"token_ids": [1, -2]}, 400, "non-negative"),
                ("/contexts?model_id=tiny-llama", {"token_ids": [1, 10**6]}, 400, "vocabulary"),
                ("/contexts?model_id=tiny-llama", {"content": text, "extra": 1}, 400, "unknown field"),
                ("/contexts?model_id=tiny-llama&content=x", {"content": text}, 400, "goes in the body"),
                (f"/contexts/{cid}/query", {"query": "x", "options": {"stream": True}}, 400, "unknown option"),
                (f"/contexts/{cid}/query", {"query": "x", "options": {"max_tokens": 10**6}}, 400, "max_tokens")):
            st, err = call(base, "POST", path, json.dumps(body).encode())
            assert (st, what in err.get("error", "")) == (code, True), (path, body, st, err)
    # the same answer in-process, and from transformers over content + query from scratch
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    want, _ = from_scratch(model, tok.encode(text) + tok.encode("where is the cat", add_special_tokens=False), 6)
    assert ans["token_ids"] == want and ans["response"] == tok.decode(want, skip_special_tokens=True)
    assert ans["usage"]["context_tokens"] == out["token_count"] and ans["tier"] == "cold"


def test_rest_text_ingest_without_a_backend_is_501(tmp_path):
    pytest.importorskip("uvicorn", reason="the server needs the 'server' extra")
    from _bucket_server import serve

    with serve(tmp_path / "bucket", TOKEN) as (url, _):
        st, err = call(url + "/mcrp/v1", "POST", "/contexts?model_id=m", json.dumps({"content": "text"}).encode())
        assert st == 501 and "--backend transformers" in err["error"]


def test_serve_flags_are_checked_before_anything_loads(tmp_path):
    for args, what in ((["--backend", "transformers"], "--backend and --model go together"),
                       (["--model", "x"], "--backend and --model go together"),
                       (["--model-id", "x"], "--model-id configures a model backend"),
                       (["--backend", "transformers", "--model", str(tmp_path / "missing")], "cannot load"),
                       (["--backend", "transformers", "--model", "x", "--device", "tpu"], "invalid torch device"),
                       (["--backend", "transformers", "--model", "x", "--host", "0.0.0.0"], "without a token")):
        p = subprocess.run([sys.executable, "-m", "mcf.cli", "bucket", "serve", "--root", str(tmp_path / "b"), *args],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 1 and what in p.stderr, (args, p.stderr)
