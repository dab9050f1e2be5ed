"""A Hugging Face llama written as a GGUF checkpoint the way llama.cpp's converter writes one, with gguf-py
only: llama.cpp's tensor names (``gguf.get_tensor_name_map``), its Q/K row permutation (which transformers'
GGUF loader undoes), the ``llama.*`` keys transformers reads its config from, and each tensor in a ggml
type chosen by name.  Nothing is downloaded.

Types gguf-py can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, TQ1_0, TQ2_0, MXFP4) are real quantizations of the
model's weights.  For the others (K-quants, IQ types, NVFP4, Q1_0) gguf-py has no quantizer and none exists
in Python, so their blocks are random codes with a scale sized after the weights' (``raw_blocks``): the
values are not the model's, but they are valid blocks of that type, which is what a loader decodes."""

from __future__ import annotations

import fnmatch
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "gguf"))
from gguf_fixtures import set_iq1m_scale  # noqa: E402

# the mix of a llama.cpp Q4_K_M file: Q6_K for attn_v / ffn_down / output, Q4_K elsewhere, norms in F32
Q4_K_M = {"*attn_v.weight": "Q6_K", "*ffn_down.weight": "Q6_K", "output.weight": "Q6_K", "*norm.weight": "F32",
          "*": "Q4_K"}


def _permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute: interleave the two rotary halves of each head."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def raw_blocks(x: np.ndarray, type_name: str, seed: int = 0) -> np.ndarray:
    """Valid ``type_name`` blocks for a float array shaped like ``x`` (rows x columns): random codes, every
    float16 scale set so that the block's values are about as large as ``x``'s (see the module docstring)."""
    import gguf

    t = gguf.GGMLQuantizationType[type_name]
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    nb = x.size // bs
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) or 1e-3
    scale_fields = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
                    "IQ4_NL": (0,), "IQ4_XS": (0,), "Q1_0": (0,)}
    # the largest code each type multiplies its scale by, roughly (IQ grids reach ~40, K-quant sub-scales ~60)
    reach = {"Q2_K": 45.0, "Q3_K": 120.0, "Q4_K": 60.0, "Q5_K": 120.0, "Q6_K": 2000.0, "IQ2_XXS": 60.0,
             "IQ2_XS": 60.0, "IQ2_S": 60.0, "IQ3_XXS": 120.0, "IQ3_S": 100.0, "IQ1_S": 8.0, "IQ4_NL": 80.0,
             "IQ4_XS": 1500.0, "Q1_0": 1.0}
    if type_name in scale_fields:
        d = np.full(nb, rms / reach[type_name], np.float16).view(np.uint8).reshape(nb, 2)
        for off in scale_fields[type_name]:
            b[:, off:off + 2] = d
            if type_name in ("Q2_K", "Q4_K", "Q5_K") and off == scale_fields[type_name][1]:
                b[:, off:off + 2] = np.full(nb, rms / reach[type_name] / 4, np.float16).view(np.uint8).reshape(nb, 2)
    elif type_name == "IQ1_M":
        set_iq1m_scale(b, np.full(nb, rms / 8.0, np.float16))
    elif type_name == "NVFP4":
        b[:, :4] = 0x28  # UE4M3 2^-2: values up to 1.5 before the weights' size is applied
    else:
        raise ValueError(f"no random-block recipe for {type_name}")
    return b.reshape(*x.shape[:-1], x.shape[-1] // bs * ts)


def write_llama_gguf(model, path: str, types=Q4_K_M, seed: int = 0) -> dict:
    """Write HF ``LlamaForCausalLM`` ``model`` to ``path`` as GGUF; ``types`` maps glob patterns over the GGUF
    tensor names to ggml type names (first match wins).  Returns {gguf name: type name}."""
    import gguf

    cfg = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    chosen = {}
    for k, (hf_name, tensor) in enumerate(model.state_dict().items()):
        base, suffix = hf_name.rsplit(".", 1)
        name = name_map.get_name(base) + "." + suffix
        x = tensor.detach().float().numpy()
        if name.endswith("attn_q.weight"):
            x = _permute(x, cfg.num_attention_heads, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            x = _permute(x, cfg.num_attention_heads, cfg.num_key_value_heads)
        tname = next(t for pat, t in types.items() if fnmatch.fnmatchcase(name, pat))
        chosen[name] = tname
        qt = gguf.GGMLQuantizationType[tname]
        if tname == "F32":
            w.add_tensor(name, np.ascontiguousarray(x, np.float32))
        elif tname == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            try:
                q = gguf.quants.quantize(x, qt)
            except NotImplementedError:
                q = raw_blocks(x, tname, seed + k)
            w.add_tensor(name, q, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return chosen
