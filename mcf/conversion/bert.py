"""A plain-numpy forward pass of a BERT encoder (the demo's MiniLM), returning per-layer keys and values.

The bucket demo stores a real KV cache, so it needs real keys and values: this computes them from the
checkpoint's weights with nothing but numpy (float32, the operations of Hugging Face's ``BertModel`` in
eval mode: embeddings + LayerNorm, then per layer self-attention, residual + LayerNorm, GELU MLP,
residual + LayerNorm).  It is a demo helper, not an inference engine: one sequence, no batching.
"""

from __future__ import annotations

import numpy as np

from mcf.errors import InvalidArgumentError


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to ~1e-7 absolute (Abramowitz & Stegun 7.1.26), enough for float32 activations; numpy has
    no erf and scipy is not a dependency."""
    s = np.sign(x)
    a = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t \
        * np.exp(-a * a)
    return (s * y).astype(x.dtype)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / np.float32(np.sqrt(2.0))))


def bert_forward(weights, config: dict, token_ids, *, progress=None, observe=None) -> tuple[np.ndarray, list]:
    """Run the encoder on one sequence.  ``weights``: name -> array (any mapping with the Hugging Face
    names, e.g. ``mcf.open(path)`` or a safetensors checkpoint's arrays).  Returns the last hidden state
    ``[T, hidden]`` and ``[(K, V), ...]`` per layer, each ``[heads, T, head_dim]`` float32: the keys and
    values the attention of that layer used.  ``progress(done, total, what)`` is called per layer;
    ``observe(weight_name, inputs)`` with the ``[T, in]`` input of every linear layer before it is applied
    (the importance-matrix collector of :mod:`mcf.conversion.imatrix`)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    t = len(ids)
    if not 0 < t <= int(config["max_position_embeddings"]):
        raise InvalidArgumentError(f"{t} tokens; the model takes 1..{config['max_position_embeddings']}")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    hd = hidden // heads
    eps = float(config.get("layer_norm_eps", 1e-12))

    def w(name):
        return np.asarray(weights[name], dtype=np.float32)

    def linear(x, prefix):
        if observe is not None:
            observe(prefix + ".weight", x)
        return x @ w(prefix + ".weight").T + w(prefix + ".bias")

    x = w("embeddings.word_embeddings.weight")[ids] + w("embeddings.position_embeddings.weight")[:t] \
        + w("embeddings.token_type_embeddings.weight")[0]
    x = _layer_norm(x, w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"), eps)
    kv = []
    for i in range(int(config["num_hidden_layers"])):
        p = f"encoder.layer.{i}."
        q = linear(x, p + "attention.self.query").reshape(t, heads, hd).transpose(1, 0, 2)
        k = linear(x, p + "attention.self.key").reshape(t, heads, hd).transpose(1, 0, 2)
        v = linear(x, p + "attention.self.value").reshape(t, heads, hd).transpose(1, 0, 2)
        kv.append((np.ascontiguousarray(k), np.ascontiguousarray(v)))
        s = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(hd))
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        ctx = (s @ v).transpose(1, 0, 2).reshape(t, hidden)
        x = _layer_norm(linear(ctx, p + "attention.output.dense") + x,
                        w(p + "attention.output.LayerNorm.weight"), w(p + "attention.output.LayerNorm.bias"), eps)
        h = _gelu(linear(x, p + "intermediate.dense"))
        x = _layer_norm(linear(h, p + "output.dense") + x,
                        w(p + "output.LayerNorm.weight"), w(p + "output.LayerNorm.bias"), eps)
        if progress is not None:
            progress(i + 1, int(config["num_hidden_layers"]), f"layer {i}")
    return x, kv


def sentence_embedding(hidden: np.ndarray) -> np.ndarray:
    """sentence-transformers' pooling for all-MiniLM-L6-v2: the mean over tokens, L2-normalized."""
    e = hidden.mean(axis=0)
    return e / np.linalg.norm(e)
