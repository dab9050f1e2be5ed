"""A model in the bucket's loop: a Hugging Face causal LM computes the KV cache of a text at ingest, and
answers queries from the stored cache (seed 003, "pre-compute once, query many"; the ``transformers``
extra: ``pip install '.[transformers]'`` in a checkout, ``pip install 'mcf-formats[transformers]'`` by name).

Why it is built this way:

* **It composes the bucket, it does not extend it.**  Ingest runs the model once over the content
  (prefill), takes the cache's keys and values per layer as ``[num_kv_heads, tokens, head_dim]`` and
  stores them with :meth:`Bucket.ingest`; a query reads them back with :meth:`Bucket.load`, builds the
  model's own cache object (``transformers.DynamicCache``, made with the model's config so sliding-window
  layers behave as in the model) and continues from there.  Everything the bucket guarantees (checksums,
  ids from content, tiers, encryption) applies unchanged.
* **Any causal LM whose cache is one K and one V per layer over every token**: Llama, Qwen2, Mistral,
  GPT-2 and the rest of the decoder-only family, with grouped-query attention or not.  The layout is
  probed once from a one-token forward pass rather than read from config field names, which differ from
  architecture to architecture.  Models whose cache is something else (linear attention or convolution
  states, layers sharing another layer's cache, keys and values of different widths) are refused with
  the reason; a sliding-window layer is accepted for contents that fit its window.
* **Exactly the computation of a from-scratch run.**  The cached prefix is what the model computed for
  the content; the query's tokens are fed after it at the positions that follow, and generation goes on
  token by token (greedy by default).  With the cache stored in the model's own dtype (the default), the
  tokens and logits equal a run over content + query from scratch to floating-point tolerance; a float16
  cache of a float32 model rounds the prefix once (tests/test_bucket_hf.py measures both).
* **The model's identity is checked.**  The backend registers its shape (layers, KV heads, head_dim,
  architecture) and a fingerprint of its weights under its model id; a bucket whose model id was
  registered with another shape or other weights is refused, because its contexts would give wrong
  answers silently.
* **Text in, text out, token ids too.**  The content is tokenized with special tokens (a BOS where the
  tokenizer adds one), the query without (it continues the content); a content given as token ids is
  stored with them, which indexes it for prefix reuse (:meth:`Bucket.lookup_prefix`).
* **One forward pass at a time.**  Model calls hold a lock: a server's worker threads queue instead of
  fighting over the same cores.
"""

from __future__ import annotations

import hashlib
import inspect
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mcf._core.optional import require
from mcf.bucket import _layout as L
from mcf.bucket.store import Bucket, check_model_id, content_hash, context_id_for, token_array
from mcf.errors import ArgumentTypeError, InvalidArgumentError, MissingDependencyError

__all__ = ["Generation", "MissingDependencyError", "TransformersBackend", "weights_fingerprint"]

#: the most tokens one query may generate (a server answers within bounded time)
MAX_NEW_TOKENS = 4096
#: query options the REST route accepts (seed 003 §4.3 names max_tokens and temperature)
QUERY_OPTIONS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_at_eos")
_TORCH_TO_KV = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _require():
    """(torch, transformers), or MissingDependencyError naming the extra."""
    feature = "the bucket's model backend (mcf.bucket.hf)"
    return (require("torch", feature=feature, extra="transformers"),
            require("transformers", feature=feature, extra="transformers"))


def weights_fingerprint(model, *, samples: int = 4096) -> str:
    """``sha256:...`` over every tensor of ``model.state_dict()``: its name, dtype, shape and ``samples``
    evenly spaced elements.

    A fingerprint, not a full hash: it reads a few MB instead of every weight (a 7B model's full hash takes
    seconds), and catches what changes a model's KV caches in practice (another checkpoint, a fine-tune, a
    merged adapter, another dtype), all of which change nearly every element of the tensors they touch.
    It does not catch an edit of a few isolated elements; pass ``model_hash=`` to the backend (the
    checkpoint's own hash or revision) for a guarantee."""
    torch, _ = _require()
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise InvalidArgumentError(f"samples must be a positive integer, got {samples!r}")
    h = hashlib.sha256(b"mcf-weights-fingerprint-v1\0")
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // samples)
            sample = flat[::step][:samples].contiguous().cpu()
            h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
            h.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True)
class Generation:
    """What a query produced: the generated ``token_ids`` (and their ``text`` when the backend has a
    tokenizer), ``logits`` ([steps, vocab] float32, one row per generated token, when asked for), why it
    stopped (``"eos"`` or ``"length"``), the token counts, the tier the context was served from, and the
    time spent loading the cache, injecting it and generating (ms)."""

    token_ids: list
    text: str | None
    finish_reason: str
    context_tokens: int
    query_tokens: int
    tier: str
    timings_ms: dict = field(default_factory=dict)
    logits: np.ndarray | None = None


class TransformersBackend:
    """A Hugging Face causal LM serving one model id of a bucket: :meth:`ingest` stores the KV cache of a
    text, :meth:`generate` continues from a stored one, :meth:`query` is the REST server's query backend.

    ``model``: a ``transformers`` causal LM (``AutoModelForCausalLM``), used on its device and in its dtype,
    switched to evaluation mode (no dropout);
    ``tokenizer``: its tokenizer (a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``), or None to
    work with token ids only; ``model_id``: the bucket's name for the model; ``model_hash``: its identity
    (default :func:`weights_fingerprint`); ``kv_dtype``: how caches are stored (default the model's own
    dtype, which keeps them exact); ``prefill_chunk``: feed long contents this many tokens at a time (less
    memory for attention, same cache to float tolerance)."""

    def __init__(self, model, tokenizer=None, *, model_id: str, model_hash: str | None = None,
                 kv_dtype: str | None = None, prefill_chunk: int | None = None) -> None:
        torch, _ = _require()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_id = check_model_id(model_id)
        if model_hash is not None and not isinstance(model_hash, str):
            raise InvalidArgumentError(f"model_hash must be a string, got {model_hash!r}")
        self._model_hash = model_hash
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool)
                                          or prefill_chunk < 1):
            raise InvalidArgumentError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        param = next(iter(model.parameters()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.dtype = param.dtype if param is not None else torch.float32
        own = _TORCH_TO_KV.get(str(self.dtype).removeprefix("torch."), "float32")
        self.kv_dtype = L.DTYPE_NAMES[L.parse_dtype(kv_dtype if kv_dtype is not None else own)]
        self.config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.max_positions = getattr(self.config, "max_position_embeddings", None)
        self._lock = threading.RLock()
        self._layout: dict | None = None
        accepts = inspect.signature(model.forward).parameters
        self._keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}
        # transformers 5.x renames the forward's cache argument: ``cache`` where the model takes it (the old
        # name warns there, and goes at 5.40), ``past_key_values`` before the rename
        self._cache_kw = "cache" if "cache" in accepts else "past_key_values"
        self.eos_token_ids = self._eos_ids()

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, model_id: str | None = None, device: str = "cpu",
                        dtype: str | None = None, **kw) -> TransformersBackend:
        """Load a checkpoint (a local directory or a Hub id) and its tokenizer with ``transformers``'
        Auto classes.  ``model_id`` defaults to the last component of ``name_or_path``; ``dtype`` is the
        model's torch dtype (``float32``, ``bfloat16``, ``float16``; default: as stored).  Remote code is
        never run (``trust_remote_code`` stays off)."""
        torch, transformers = _require()
        from mcf.bucket.tiers import check_device

        dev = check_device(device)
        kwargs: dict[str, Any] = {}
        if dtype is not None:
            if dtype not in _TORCH_TO_KV:
                raise InvalidArgumentError(f"dtype must be one of {sorted(_TORCH_TO_KV)}, got {dtype!r}")
            kwargs["dtype"] = getattr(torch, dtype)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
            tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError, KeyError, TypeError, ImportError, RuntimeError) as exc:
            # a missing file, an unknown architecture, a model that is not a causal LM, a tokenizer needing a
            # package that is not installed: one clear error, not a traceback from deep inside transformers
            raise InvalidArgumentError(f"{name_or_path}: cannot load a causal LM and its tokenizer: "
                                       f"{type(exc).__name__}: {exc}") from None
        model.to(dev)
        if model_id is None:
            model_id = _default_model_id(str(name_or_path))
        return cls(model, tokenizer, model_id=model_id, **kw)

    # -- identity -----------------------------------------------------------------------------------------
    @property
    def model_hash(self) -> str:
        if self._model_hash is None:
            self._model_hash = weights_fingerprint(self.model)
        return self._model_hash

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the model's cache."""
        lay = self._probe()
        return lay["num_layers"], lay["num_kv_heads"], lay["head_dim"]

    def _probe(self) -> dict:
        """The cache layout, from a one-token forward pass (field names differ between architectures; the
        cache object does not lie)."""
        if self._layout is None:
            torch, _ = _require()
            with self._lock, torch.inference_mode():
                cache = self._new_cache()
                self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device),
                           use_cache=True, **{self._cache_kw: cache}, **self._keep_kw)
                self._layout = _layout_of(cache, 1, type(self.model).__name__)
        return self._layout

    def compatibility(self) -> dict:
        """What a context must match to be used with this model (the bucket's ``model_compatibility``)."""
        num_layers, num_kv_heads, head_dim = self.kv_shape
        return {"architecture": getattr(self.config, "model_type", None) or type(self.model).__name__,
                "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                "vocab_size": self.vocab_size}

    def register(self, bucket: Bucket, *, new_weights: bool = False) -> dict:
        """Register this model in ``bucket`` under :attr:`model_id` (shape, vocabulary and weights
        fingerprint), or check an existing registration: InvalidArgumentError when the bucket's model id
        stands for another shape or other weights (its contexts would give wrong answers).

        ``new_weights=True`` accepts other weights of the same shape (a fine-tune, a new revision of the
        checkpoint): the model is registered again with this model's hash, which marks every context of
        the former weights stale (listed as stale, refused on load, computed again by the next ingest of
        the same content)."""
        want = self.compatibility()
        doc = bucket.model(self.model_id)
        if doc is None:
            return bucket.register_model(self.model_id, model_hash=self.model_hash, **want)
        have = doc["model_compatibility"]
        for k, v in want.items():
            if have.get(k) is not None and have[k] != v:
                raise InvalidArgumentError(f"model {self.model_id!r} is registered in this bucket with "
                                           f"{k}={have[k]!r}; this model has {k}={v!r}: use another model_id")
        if doc.get("model_hash") != self.model_hash and (new_weights or doc.get("model_hash") is None):
            return bucket.register_model(self.model_id, model_hash=self.model_hash, **want)
        if doc.get("model_hash") is not None and doc["model_hash"] != self.model_hash:
            raise InvalidArgumentError(
                f"model {self.model_id!r} is registered in this bucket with weights {doc['model_hash']}, this model's "
                f"are {self.model_hash}: its contexts were computed by other weights and would give wrong answers "
                "(use another model_id; pass the registered model_hash if the weights are the same; or "
                "register(bucket, new_weights=True), which marks the former weights' contexts stale)")
        return doc

    # -- tokens ---------------------------------------------------------------------------------------------
    def encode(self, text: str, *, special: bool) -> list[int]:
        """Token ids of ``text`` (``special``: with the tokenizer's special tokens, e.g. a BOS)."""
        if self.tokenizer is None:
            raise InvalidArgumentError("this backend has no tokenizer: give token ids instead of text")
        if not isinstance(text, str):
            raise InvalidArgumentError(f"text must be a string, got {type(text).__name__}")
        enc = self.tokenizer.encode(text, add_special_tokens=special)
        return list(getattr(enc, "ids", enc))

    def decode(self, ids) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _eos_ids(self) -> set[int]:
        out: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            v = getattr(src, "eos_token_id", None)
            out |= set(v if isinstance(v, (list, tuple)) else [] if v is None else [v])
        return {int(i) for i in out if isinstance(i, int) and 0 <= i < self.vocab_size}

    def _ids(self, ids, what: str) -> list[int]:
        arr = token_array(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise InvalidArgumentError(f"{what}: token id {bad} is outside the model's vocabulary "
                                       f"(0..{self.vocab_size - 1})")
        return arr.tolist()

    # -- the model ------------------------------------------------------------------------------------------
    def _new_cache(self):
        _, transformers = _require()
        return transformers.DynamicCache(config=self.model.config)

    def _forward(self, ids, cache):
        torch, _ = _require()
        return self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                          use_cache=True, **{self._cache_kw: cache}, **self._keep_kw)

    def prefill(self, token_ids) -> list[tuple[np.ndarray, np.ndarray]]:
        """Run the model once over ``token_ids``: per layer (K, V), each [num_kv_heads, tokens, head_dim] as
        numpy arrays (float32 for a bfloat16 model: numpy has no bfloat16; the values are exact)."""
        torch, _ = _require()
        ids = self._ids(token_ids, "content")
        if not ids:
            raise InvalidArgumentError("the content has no tokens")
        self._check_positions(len(ids))
        lay = self._probe()
        if lay["window"] is not None and len(ids) > lay["window"]:
            raise InvalidArgumentError(f"{len(ids)} tokens: this model's sliding-window layers keep only the last "
                                       f"{lay['window']}, so a longer context cannot be stored whole")
        step = self.prefill_chunk or len(ids)
        with self._lock, torch.inference_mode():
            cache = self._new_cache()
            for i in range(0, len(ids), step):
                self._forward(ids[i:i + step], cache)
            _layout_of(cache, len(ids), type(self.model).__name__)
            out = []
            for layer in cache.layers:
                k, v = layer.keys[0], layer.values[0]
                out.append((_to_numpy(k), _to_numpy(v)))
        return out

    def _check_positions(self, n: int) -> None:
        if self.max_positions is not None and n > self.max_positions:
            raise InvalidArgumentError(f"{n} tokens: more than the model's {self.max_positions} positions")

    # -- the bucket -----------------------------------------------------------------------------------------
    def ingest(self, bucket: Bucket, content: str | None = None, *, token_ids=None, name: str | None = None,
               source: str | None = None, dtype: str | None = None, compression: Any = "lz4",
               ttl: float | None = None, pinned: bool = False, threads: int = 1) -> dict:
        """Compute and store the KV cache of ``content`` (a text, tokenized with special tokens) or of
        ``token_ids`` (stored with them: indexed for prefix reuse).  Returns the bucket's metadata, with
        ``"deduplicated": True`` when the same content was already stored (then the model does not run)
        and ``"ingestion_time_ms"``."""
        t0 = time.perf_counter()
        if (content is None) == (token_ids is None):
            raise InvalidArgumentError("give exactly one of content or token_ids")
        self.register(bucket)
        ids = self.encode(content, special=True) if content is not None else self._ids(token_ids, "token_ids")
        kd = L.parse_dtype(dtype if dtype is not None else self.kv_dtype)
        num_layers, num_kv_heads, head_dim = self.kv_shape
        chash = content_hash(content) if content is not None else content_hash(token_ids=ids)
        cid = context_id_for(self.model_id, chash, kd, L.KVShape(num_layers, num_kv_heads, head_dim, len(ids)))
        # pre-compute once: the same content for the same model and dtype is already there, as the bucket's
        # ingest would return it (a stale one, or one in clear while the bucket encrypts, is computed again)
        meta = bucket.reusable(cid)
        if meta is not None:
            return dict(meta, ingestion_time_ms=(time.perf_counter() - t0) * 1e3)
        layers = self.prefill(ids)
        src = {"content": content} if content is not None else {"token_ids": ids}
        meta = bucket.ingest(self.model_id, layers, name=name, source=source, dtype=kd, compression=compression,
                             ttl=ttl, pinned=pinned, threads=threads, **src)
        return dict(meta, ingestion_time_ms=(time.perf_counter() - t0) * 1e3)

    def load_cache(self, bucket: Bucket, context_id: str):
        """The stored context as the model's cache object: ``(DynamicCache, tokens, tier)``, the tier being
        the one it was served from.  The context must belong to :attr:`model_id` and match its shape."""
        torch, transformers = _require()
        self.register(bucket)
        meta = bucket.lookup(context_id)
        if meta["model_id"] != self.model_id:
            raise InvalidArgumentError(f"{context_id} belongs to model {meta['model_id']!r}, this backend serves "
                                       f"{self.model_id!r}")
        tier = bucket.tier(context_id)
        stored = meta["kv_cache"]["dtype"]
        if tier == "hot" or stored == "int8":
            # hot: copies on the tier's device; int8: dequantized to float32 by the bucket
            layers = bucket.load(context_id, model=self.model_id, as_torch=True)
        else:
            # decoded (or copied) once, straight into tensors of the stored dtype
            s = meta["kv_cache"]["shape"]
            shape = (s["num_kv_heads"], s["sequence_length"], s["head_dim"])
            tdt = getattr(torch, stored)
            layers = [(torch.empty(shape, dtype=tdt), torch.empty(shape, dtype=tdt)) for _ in range(s["num_layers"])]
            bucket.load(context_id, model=self.model_id, out=[(_numpy_view(k), _numpy_view(v)) for k, v in layers])
        pairs = [(k.to(device=self.device, dtype=self.dtype)[None], v.to(device=self.device, dtype=self.dtype)[None])
                 for k, v in layers]
        cache = transformers.DynamicCache(pairs, config=self.model.config)
        return cache, meta["kv_cache"]["shape"]["sequence_length"], tier

    def generate(self, bucket: Bucket, context_id: str, query: str | None = None, *, query_ids=None,
                 max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop_at_eos: bool = True,
                 return_logits: bool = False) -> Generation:
        """Continue from the stored context ``context_id``: feed ``query`` (a text, tokenized without
        special tokens: it continues the content) or ``query_ids`` after it, then generate up to
        ``max_new_tokens`` tokens, greedily (``temperature`` 0) or sampled (``temperature`` > 0, optionally
        ``top_k`` / ``top_p``, reproducible with ``seed``), stopping at the model's end-of-sequence token
        unless ``stop_at_eos`` is False."""
        torch, _ = _require()
        if (query is None) == (query_ids is None):
            raise InvalidArgumentError("give exactly one of query or query_ids")
        max_new_tokens, temperature, top_k, top_p, seed = _sampling(max_new_tokens, temperature, top_k, top_p, seed)
        qids = self.encode(query, special=False) if query is not None else self._ids(query_ids, "query_ids")
        if not qids:
            raise InvalidArgumentError("the query has no tokens (the logits of the content's last token are not "
                                       "stored: at least one query token is needed)")
        t0 = time.perf_counter()
        with self._lock, torch.inference_mode():
            cache, ntok, tier = self.load_cache(bucket, context_id)
            self._check_positions(ntok + len(qids) + max_new_tokens)
            t1 = time.perf_counter()
            gen = None
            if temperature > 0:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed if seed is not None else secrets.randbits(63))  # not torch's global RNG
            out, logits, finish, feed = [], [], "length", qids
            t2 = time.perf_counter()
            for _ in range(max_new_tokens):
                step = self._forward(feed, cache).logits[0, -1].float()
                if return_logits:
                    logits.append(step.cpu().numpy())
                tok = _pick(step, temperature, top_k, top_p, gen)
                out.append(tok)
                if stop_at_eos and tok in self.eos_token_ids:
                    finish = "eos"
                    break
                feed = [tok]
            t3 = time.perf_counter()
        return Generation(out, self.decode(out), finish, ntok, len(qids), tier,
                          {"load": (t1 - t0) * 1e3, "generate": (t3 - t2) * 1e3, "total": (t3 - t0) * 1e3},
                          np.stack(logits) if return_logits and logits else None)

    def query(self, bucket: Bucket, context_id: str, query: str, options: dict) -> dict:
        """The REST query route's answer (seed 003 §4.3): ``options`` may hold ``max_tokens`` (default 64),
        ``temperature`` (default 0: greedy), ``top_k``, ``top_p``, ``seed`` and ``stop_at_eos``."""
        if not isinstance(options, dict):
            raise ArgumentTypeError(f"options must be a dict of {', '.join(QUERY_OPTIONS)}, "
                                    f"got {type(options).__name__}")
        unknown = [k for k in options if k not in QUERY_OPTIONS]
        if unknown:
            raise InvalidArgumentError(f"unknown option(s) {', '.join(map(repr, unknown))}; "
                                       f"allowed: {list(QUERY_OPTIONS)} (streaming is not supported)")
        g = self.generate(bucket, context_id, query, max_new_tokens=options.get("max_tokens", 64),
                          temperature=options.get("temperature", 0.0), top_k=options.get("top_k"),
                          top_p=options.get("top_p"), seed=options.get("seed"),
                          stop_at_eos=_flag(options.get("stop_at_eos", True), "stop_at_eos"))
        return {"status": "success", "response": g.text, "token_ids": g.token_ids, "finish_reason": g.finish_reason,
                "usage": {"context_tokens": g.context_tokens, "query_tokens": g.query_tokens,
                          "generated_tokens": len(g.token_ids)},
                "cache_hit": True, "tier": g.tier, "latency_ms": g.timings_ms["total"],
                "timings_ms": g.timings_ms, "model_id": self.model_id}


# -- helpers ----------------------------------------------------------------------------------------------
def _default_model_id(name_or_path: str) -> str:
    import re

    base = name_or_path.rstrip("/").rsplit("/", 1)[-1]
    cand = re.sub(r"[^A-Za-z0-9._-]", "-", base).lstrip("._-")[:128].replace("..", ".")
    if not cand:
        raise InvalidArgumentError(f"cannot derive a model id from {name_or_path!r}: pass model_id")
    return check_model_id(cand)


def _layout_of(cache, tokens: int, model_name: str) -> dict:
    """num_layers, num_kv_heads, head_dim and the sliding window (None: none) of a filled DynamicCache,
    checking that every layer holds one K and one V of the same shape over all ``tokens``."""
    _, transformers = _require()
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layers = list(getattr(cache, "layers", ()))
    if not layers:
        raise InvalidArgumentError(f"{model_name}: the model filled no cache layers")
    shapes, windows = set(), []
    for i, layer in enumerate(layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) or getattr(layer, "keys", None) is None:
            raise InvalidArgumentError(f"{model_name}: cache layer {i} is a {type(layer).__name__}, not one key and "
                                       "one value tensor per token: this model's cache cannot be stored in a bucket")
        k, v = layer.keys, layer.values
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != 1:
            raise InvalidArgumentError(f"{model_name}: cache layer {i} has keys {tuple(k.shape)} and values "
                                       f"{tuple(v.shape)}; a bucket stores equal [heads, tokens, head_dim] pairs")
        if k.shape[2] != tokens:
            raise InvalidArgumentError(f"{model_name}: cache layer {i} holds {k.shape[2]} of {tokens} tokens "
                                       "(a sliding window): the context does not fit the model's window")
        shapes.add((k.shape[1], k.shape[3]))
        if isinstance(layer, DynamicSlidingWindowLayer):
            windows.append(int(layer.sliding_window) - 1)
    if len(shapes) != 1:
        raise InvalidArgumentError(f"{model_name}: cache layers of different shapes {sorted(shapes)}")
    heads, dim = shapes.pop()
    return {"num_layers": len(layers), "num_kv_heads": int(heads), "head_dim": int(dim),
            "window": min(windows) if windows else None}


def _to_numpy(t) -> np.ndarray:
    import torch

    t = t.detach().to("cpu")
    if t.dtype not in (torch.float32, torch.float16):
        t = t.float()  # bfloat16 and others: numpy has no bfloat16, float32 holds them exactly
    return t.contiguous().numpy()


def _numpy_view(t) -> np.ndarray:
    """A writable numpy array sharing ``t``'s memory (bfloat16 as ml_dtypes' bfloat16, the bucket's type)."""
    import torch

    if t.dtype == torch.bfloat16:
        from mcf.bucket.kvfile import NP_DTYPES

        return t.view(torch.int16).numpy().view(NP_DTYPES[L.KVDType.BF16])
    return t.numpy()


def _flag(v, name: str) -> bool:
    if not isinstance(v, bool):
        raise InvalidArgumentError(f"{name} must be true or false, got {v!r}")
    return v


def _sampling(max_new_tokens, temperature, top_k, top_p, seed):
    def num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)

    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) \
            or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise InvalidArgumentError(f"max_tokens must be an integer in 1..{MAX_NEW_TOKENS}, got {max_new_tokens!r}")
    if not num(temperature) or temperature < 0:
        raise InvalidArgumentError(f"temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise InvalidArgumentError(f"top_k must be a positive integer, got {top_k!r}")
    if top_p is not None and (not num(top_p) or not 0 < top_p <= 1):
        raise InvalidArgumentError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
        raise InvalidArgumentError(f"seed must be an integer in 0..2**63-1, got {seed!r}")
    if (top_k is not None or top_p is not None) and temperature == 0:
        raise InvalidArgumentError("top_k and top_p apply to sampling: give a temperature > 0")
    return max_new_tokens, float(temperature), top_k, top_p, seed


def _pick(logits, temperature: float, top_k, top_p, gen) -> int:
    """The next token: the argmax (the first of equal maxima) when ``temperature`` is 0, else a draw from
    the softmax of ``logits / temperature`` restricted to the ``top_k`` most likely tokens and to the
    smallest set whose probability reaches ``top_p``."""
    import torch

    if temperature == 0:
        return int(torch.argmax(logits))
    x = logits / temperature
    if top_k is not None and top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
    probs = torch.softmax(x, dim=-1)
    if top_p is not None and top_p < 1:
        p, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(p, 0) - p) >= top_p     # keep the tokens needed to reach top_p (at least one)
        p = torch.where(drop, torch.zeros_like(p), p)
        probs = torch.zeros_like(probs).scatter(0, order, p)
    return int(torch.multinomial(probs, 1, generator=gen))
