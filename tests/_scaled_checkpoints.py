"""Small checkpoints in the three block-scaled conventions, written here (no downloads): a few tensors of each,
with the names, dtypes, shapes (scaled down) and config.json of the real ones, and the plain-numpy reference
of each convention written from its published layout.

- gpt-oss (openai/gpt-oss-20b): experts as U8 ``*_blocks`` [E, 2I, H/32, 16] and U8 E8M0 ``*_scales``
  [E, 2I, H/32], everything else BF16; ``quantization_config: {"quant_method": "mxfp4", ...}``.
- DeepSeek-V3 (deepseek-ai/DeepSeek-V3): F8_E4M3 weights with F32 ``weight_scale_inv`` over 128 x 128 blocks
  (``kv_a_proj_with_mqa`` [576, 7168] -> [5, 56] ships partial edge blocks; here [136, 200] -> [2, 2]);
  ``quantization_config: {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``.
- ModelOpt NVFP4 (nvidia/DeepSeek-R1-FP4, Kimi-K2.5-NVFP4, Llama FP4 exports): U8 ``weight`` [out, in/2],
  F8_E4M3 ``weight_scale`` [out, in/16], F32 ``weight_scale_2`` [] and ``input_scale`` [];
  ``quantization_config: {"quant_method": "modelopt", "quant_algo": "NVFP4", ...}`` and hf_quant_config.json.

The files are written by :func:`write_safetensors`, the format's layout by hand (8-byte header length, JSON
header, data), so they need neither torch nor the safetensors package.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

_ST_NUMPY = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "U8": np.uint8, "F8_E4M3": ml_dtypes.float8_e4m3fn,
             "F8_E8M0": ml_dtypes.float8_e8m0fnu, "F16": np.float16, "I64": np.int64}

#: the E2M1 values of the 16 codes (OCP MX v1.0, FP4 E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit;
#: code 0b1000 is -0.0)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """``tensors``: name -> (safetensors dtype, shape, raw bytes), written in that order."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    pos = 0
    for name, (dt, shape, raw) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for _, _, raw in tensors.values():
            f.write(raw)


def _bf16(rng, shape):
    return ("BF16", shape, (rng.standard_normal(shape) * 0.05).astype(ml_dtypes.bfloat16).tobytes())


def _f32(rng, shape, lo=0.5, hi=2.0):
    return ("F32", shape, rng.uniform(lo, hi, shape).astype("<f4").tobytes())


def _e4m3_bytes(rng, n):
    """Random E4M3 bytes, every pattern but the two NaNs (weights and scales hold numbers)."""
    b = rng.integers(0, 256, n, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 1
    return b


def _write_dir(d, tensors, config, extra_files=None):
    os.makedirs(d, exist_ok=True)
    write_safetensors(os.path.join(d, "model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name, doc in (extra_files or {}).items():
        with open(os.path.join(d, name), "w") as f:
            json.dump(doc, f, indent=2)
    return d


# -- gpt-oss ------------------------------------------------------------------------------------------

GPT_OSS = dict(hidden=64, inter=64, experts=4, heads=4, kv_heads=2, head_dim=16, vocab=32)


def gpt_oss(d, *, seed=0):
    """A one-layer gpt-oss checkpoint (E = 4 experts, H = I = 64).  Returns the directory."""
    c = GPT_OSS
    rng = np.random.default_rng(seed)
    H, INTER, E = c["hidden"], c["inter"], c["experts"]
    t = {}
    t["model.embed_tokens.weight"] = _bf16(rng, (c["vocab"], H))
    p = "model.layers.0."
    t[p + "input_layernorm.weight"] = _bf16(rng, (H,))
    for proj, rows in (("q_proj", c["heads"] * c["head_dim"]), ("k_proj", c["kv_heads"] * c["head_dim"]),
                       ("v_proj", c["kv_heads"] * c["head_dim"])):
        t[p + f"self_attn.{proj}.weight"] = _bf16(rng, (rows, H))
        t[p + f"self_attn.{proj}.bias"] = _bf16(rng, (rows,))
    t[p + "self_attn.o_proj.weight"] = _bf16(rng, (H, c["heads"] * c["head_dim"]))
    t[p + "self_attn.sinks"] = _bf16(rng, (c["heads"],))
    t[p + "post_attention_layernorm.weight"] = _bf16(rng, (H,))
    t[p + "mlp.router.weight"] = _bf16(rng, (E, H))
    t[p + "mlp.router.bias"] = _bf16(rng, (E,))
    for proj, rows, inner in (("gate_up_proj", 2 * INTER, H), ("down_proj", H, INTER)):
        blocks = rng.integers(0, 256, (E, rows, inner // 32, 16), dtype=np.uint8)
        scales = rng.integers(118, 130, (E, rows, inner // 32), dtype=np.uint8)   # 2^-9 .. 2^2, as trained
        t[p + f"mlp.experts.{proj}_blocks"] = ("U8", blocks.shape, blocks.tobytes())
        t[p + f"mlp.experts.{proj}_scales"] = ("U8", scales.shape, scales.tobytes())
        t[p + f"mlp.experts.{proj}_bias"] = _bf16(rng, (E, rows))
    t["model.norm.weight"] = _bf16(rng, (H,))
    t["lm_head.weight"] = _bf16(rng, (c["vocab"], H))
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H,
              "intermediate_size": INTER, "num_local_experts": E, "num_experts_per_tok": 2, "num_hidden_layers": 1,
              "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"], "head_dim": c["head_dim"],
              "vocab_size": c["vocab"], "torch_dtype": "bfloat16",
              "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                                 "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"],
                                      "quant_method": "mxfp4"}}
    return _write_dir(d, t, config)


def mxfp4_reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss's ``*_blocks`` [..., G, 16] and ``*_scales`` [..., G] decoded as float32 [..., G * 32].

    OCP Microscaling Formats (MX) v1.0: a block of 32 E2M1 elements shares one E8M0 scale X = 2^(e - 127)
    (E8M0: 8 exponent bits, bias 127, no sign, 0xFF NaN); each value is X * element.  gpt-oss packs element 2k
    in the low nibble and 2k + 1 in the high nibble of byte k (transformers' convert_moe_packed_tensors:
    ``sub[:, 0::2] = lut[blk & 0x0F]``, ``sub[:, 1::2] = lut[blk >> 4]``, then ``ldexp(sub, scales - 127)``)."""
    lo, hi = E2M1[blocks & 0x0F], E2M1[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(blocks.shape[:-1] + (32,))
    x = np.ldexp(np.float32(1), scales.astype(np.int32) - 127).astype(np.float32)   # exact, 2^-127 included
    x[scales == 0xFF] = np.nan
    return (vals * x[..., None]).reshape(blocks.shape[:-2] + (blocks.shape[-2] * 32,))


# -- DeepSeek-V3 ---------------------------------------------------------------------------------------

def deepseek_v3(d, *, seed=1):
    """A one-layer DeepSeek-V3 checkpoint with FP8 projections, edge blocks partial in both dimensions."""
    rng = np.random.default_rng(seed)
    H = 200
    t = {}
    t["model.embed_tokens.weight"] = _bf16(rng, (32, H))
    p = "model.layers.0."
    t[p + "input_layernorm.weight"] = _bf16(rng, (H,))
    for name, shape in (("self_attn.kv_a_proj_with_mqa", (136, H)), ("self_attn.q_a_proj", (96, H)),
                        ("mlp.experts.0.gate_proj", (256, H)), ("mlp.experts.0.down_proj", (H, 256))):
        w = _e4m3_bytes(rng, shape[0] * shape[1])
        t[p + name + ".weight"] = ("F8_E4M3", shape, w.tobytes())
        t[p + name + ".weight_scale_inv"] = _f32(rng, (-(-shape[0] // 128), -(-shape[1] // 128)), 1e-4, 1e-2)
    t[p + "self_attn.q_a_layernorm.weight"] = _bf16(rng, (96,))
    t[p + "mlp.gate.weight"] = _bf16(rng, (8, H))
    t[p + "mlp.gate.e_score_correction_bias"] = _f32(rng, (8,))
    t["lm_head.weight"] = _bf16(rng, (32, H))
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
              "num_hidden_layers": 1, "n_routed_experts": 1, "moe_intermediate_size": 256, "q_lora_rank": 96,
              "kv_lora_rank": 72, "qk_rope_head_dim": 64, "vocab_size": 32, "torch_dtype": "bfloat16",
              "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [128, 128]}}
    return _write_dir(d, t, config)


def fp8_block_reference(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """DeepSeek-V3's ``weight_dequant`` (inference/kernel.py) in numpy: the F8_E4M3 weight [M, N] as float32
    times the float32 scale of its 128 x 128 block, ``y = x.to(float32) * s[i // 128, j // 128]``, the last
    blocks covering what is left of each dimension.  E4M3 (OCP FP8): bias 7, no infinity, S.1111.111 is NaN."""
    x = w.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), 128, axis=0), 128, axis=1)[:w.shape[0], :w.shape[1]]
    return x * s


# -- ModelOpt NVFP4 --------------------------------------------------------------------------------------

def modelopt_nvfp4(d, *, seed=2):
    """A one-layer Llama-style NVFP4 export of NVIDIA ModelOpt (hidden 64, intermediate 96)."""
    rng = np.random.default_rng(seed)
    H, INTER = 64, 96
    t = {}
    t["model.embed_tokens.weight"] = _bf16(rng, (32, H))
    p = "model.layers.0."
    t[p + "input_layernorm.weight"] = _bf16(rng, (H,))
    for name, (out, inp) in (("self_attn.q_proj", (H, H)), ("self_attn.k_proj", (16, H)),
                             ("self_attn.v_proj", (16, H)), ("self_attn.o_proj", (H, H)),
                             ("mlp.gate_proj", (INTER, H)), ("mlp.up_proj", (INTER, H)), ("mlp.down_proj", (H, INTER))):
        t[p + name + ".input_scale"] = ("F32", (), np.float32(rng.uniform(0.01, 0.1)).tobytes())
        t[p + name + ".weight"] = ("U8", (out, inp // 2),
                                   rng.integers(0, 256, (out, inp // 2), dtype=np.uint8).tobytes())
        sc = rng.integers(0x28, 0x60, (out, inp // 16), dtype=np.uint8)     # E4M3 0.5 .. 8-ish, like real scales
        t[p + name + ".weight_scale"] = ("F8_E4M3", (out, inp // 16), sc.tobytes())
        t[p + name + ".weight_scale_2"] = ("F32", (), np.float32(rng.uniform(1e-4, 1e-3)).tobytes())
    t[p + "post_attention_layernorm.weight"] = _bf16(rng, (H,))
    t["model.norm.weight"] = _bf16(rng, (H,))
    t["lm_head.weight"] = _bf16(rng, (32, H))
    qcfg = {"config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float",
                                                                "group_size": 16},
                                          "weights": {"dynamic": False, "num_bits": 4, "type": "float",
                                                      "group_size": 16},
                                          "targets": ["Linear"]}},
            "ignore": ["lm_head"], "quant_algo": "NVFP4", "producer": {"name": "modelopt", "version": "0.37.0"},
            "quant_method": "modelopt"}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": INTER,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 32,
              "torch_dtype": "bfloat16", "quantization_config": qcfg}
    hf_quant = {"producer": {"name": "modelopt", "version": "0.37.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": ["lm_head"]}}
    return _write_dir(d, t, config, {"hf_quant_config.json": hf_quant})


def nvfp4_reference(weight: np.ndarray, weight_scale: np.ndarray, weight_scale_2) -> np.ndarray:
    """ModelOpt's NVFP4 weight [M, N/2] decoded as float32 [M, N].  The format (NVIDIA, "Introducing NVFP4 for
    efficient and accurate low-precision inference"): E2M1 values in blocks of 16, each block with an FP8 E4M3
    scale, and an FP32 scale per tensor.  The layout and the order of operations, from NVFP4QTensor
    (NVIDIA/Model-Optimizer, modelopt/torch/quantization/qtensor/nvfp4_tensor.py): values packed
    ``(q[..., 1::2] << 4) | q[..., 0::2]`` (even column in the low nibble), E2M1 codes; ``dequantize``:
    ``per_block_scale = weight_scale.to(float32) * weight_scale_2``, then each block of 16 values times it.
    (ModelOpt's own table maps code 0b1000 to +0.0; E2M1 defines it as -0.0, which is what this reference and
    mcf write: the two differ in the sign of zero only.)"""
    vals = np.stack([E2M1[weight & 0x0F], E2M1[weight >> 4]], axis=-1).reshape(weight.shape[0], -1)
    per_block = weight_scale.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(weight_scale_2)
    return (vals.reshape(weight.shape[0], -1, 16) * per_block[..., None]).reshape(vals.shape)


# -- MCF payloads of the three formats, split by docs/mcf.md's formulas (not mcf's code) --------------------

def align64(x):
    return (x + 63) // 64 * 64


def split_payload(fmt, shape, p):
    """The regions of an MCF payload, by docs/mcf.md's formulas (not mcf's code)."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if fmt == "mxfp4":
        tb = rows * cols // 32
        return {"scales": p[:tb], "data": p[align64(tb):align64(tb) + 16 * tb]}
    if fmt == "nvfp4":
        tb = rows * cols // 16
        return {"scale": p[:4], "scales": p[64:64 + tb], "data": p[align64(64 + tb):align64(64 + tb) + 8 * tb]}
    ns = -(-rows // 128) * -(-cols // 128)
    return {"scales": p[:4 * ns], "data": p[align64(4 * ns):align64(4 * ns) + rows * cols]}


def payload_reference(fmt, shape, p):
    """The float32 values of an MCF payload of ``fmt``, from the conventions' numpy references."""
    r = split_payload(fmt, shape, p)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if fmt == "mxfp4":
        return mxfp4_reference(r["data"].reshape(rows, cols // 32, 16), r["scales"].reshape(rows, cols // 32))
    if fmt == "nvfp4":
        return nvfp4_reference(r["data"].reshape(rows, cols // 2), r["scales"].reshape(rows, cols // 16),
                               r["scale"].view("<f4")[0])
    return fp8_block_reference(r["data"].reshape(rows, cols),
                               r["scales"].view("<f4").reshape(-(-rows // 128), -(-cols // 128)))


def payload_size(fmt, shape):
    """The payload size of docs/mcf.md's formulas."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if fmt == "mxfp4":
        return align64(rows * cols // 32) + rows * cols // 2
    if fmt == "nvfp4":
        return align64(64 + rows * cols // 16) + rows * cols // 2
    return align64(4 * -(-rows // 128) * -(-cols // 128)) + rows * cols


def read_tensor(path, name):
    """A tensor of a file written by :func:`write_safetensors`, as numpy (raw U8 / F32 / float8 views)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(n))
        e = hdr[name]
        f.seek(8 + n + e["data_offsets"][0])
        raw = f.read(e["data_offsets"][1] - e["data_offsets"][0])
    return np.frombuffer(raw, _ST_NUMPY[e["dtype"]]).reshape(e["shape"])
