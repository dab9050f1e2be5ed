"""The real consumer of ``mcf.gguf.dequantize``: transformers' GGUF loader (``from_pretrained(...,
gguf_file=...)``), which decodes every tensor with ``gguf.dequantize`` (``from gguf import dequantize`` in
modeling_gguf_pytorch_utils.py, looked up when a file is loaded).  A tiny llama is written as GGUF with
gguf-py (tests/_gguf_llama.py: real Q8_0 / Q4_0 / Q5_1 / TQ2_0 / MXFP4 quantizations and raw blocks of
K-quant, IQ and NVFP4 types) and loaded with gguf-py's dequantizer, then with mcf's put in its place as
docs/gguf.md shows: the weights and the model's outputs are identical."""

import os
import sys

import numpy as np
import pytest

import mcf.gguf

gguf = pytest.importorskip("gguf", reason="gguf-py is in the test extra")
torch = pytest.importorskip("torch", reason="torch is in the test extra")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate (in the test extra)")

sys.path.insert(0, os.path.dirname(__file__))
from _gguf_llama import write_llama_gguf  # noqa: E402
from _hf_models import tiny_model  # noqa: E402

TYPES = {
    "token_embd.weight": "Q8_0", "output.weight": "Q6_K", "*norm.weight": "F32",
    "blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q4_0", "blk.0.attn_v.weight": "Q5_1",
    "blk.0.attn_output.weight": "TQ2_0", "blk.0.ffn_gate.weight": "MXFP4", "blk.0.ffn_up.weight": "Q4_K",
    "blk.0.ffn_down.weight": "IQ4_XS",
    "blk.1.attn_q.weight": "IQ2_XXS", "blk.1.attn_k.weight": "IQ3_S", "blk.1.attn_v.weight": "IQ1_M",
    "blk.1.attn_output.weight": "NVFP4", "blk.1.ffn_gate.weight": "IQ2_S", "blk.1.ffn_up.weight": "TQ1_0",
    "blk.1.ffn_down.weight": "IQ4_NL",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_model("llama", hidden=256, heads=4, kv_heads=2, layers=2)
    d = tmp_path_factory.mktemp("gguf_llama")
    chosen = write_llama_gguf(model, str(d / "tiny.gguf"), TYPES)
    return d, model, chosen


def _load(d, monkeypatch, dequantize=None):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with monkeypatch.context() as m:
        if dequantize is not None:
            m.setattr(gguf, "dequantize", dequantize)  # what docs/gguf.md tells a user to do
        return transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file="tiny.gguf").eval()


def test_transformers_loads_the_same_model_with_mcf_dequantize(checkpoint, monkeypatch):
    d, original, chosen = checkpoint
    assert set(chosen.values()) >= {"IQ2_XXS", "IQ1_M", "TQ1_0", "MXFP4", "NVFP4", "Q4_K"}
    calls = []

    def counting(data, qtype):
        calls.append(int(qtype))
        return mcf.gguf.dequantize(data, qtype)

    reference = _load(d, monkeypatch)
    with_mcf = _load(d, monkeypatch, counting)
    assert sorted(set(calls)) == sorted({int(gguf.GGMLQuantizationType[t]) for t in chosen.values()})
    assert len(calls) == len(chosen)  # every tensor went through mcf's function

    ref_sd, mcf_sd = reference.state_dict(), with_mcf.state_dict()
    assert ref_sd.keys() == mcf_sd.keys() == original.state_dict().keys()
    for k in ref_sd:
        assert ref_sd[k].dtype == mcf_sd[k].dtype
        assert torch.equal(ref_sd[k].view(torch.int32), mcf_sd[k].view(torch.int32)), k
    ids = torch.tensor([[1, 5, 9, 12, 40, 3, 7, 22]])
    with torch.no_grad():
        a, b = reference(ids).logits, with_mcf(ids).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_the_checkpoint_is_the_model(checkpoint, monkeypatch):
    """The file is a faithful llama checkpoint, not just bytes both loaders agree on: a tensor gguf-py
    quantized (Q8_0, Q/K permutation undone by transformers) comes back within Q8_0's error, and the
    layer norms exactly."""
    d, original, _ = checkpoint
    loaded = _load(d, monkeypatch, mcf.gguf.dequantize)
    o, got = original.state_dict(), loaded.state_dict()
    q = o["model.layers.0.self_attn.q_proj.weight"]
    err = (got["model.layers.0.self_attn.q_proj.weight"] - q).abs().max().item()
    assert 0 < err <= q.abs().max().item() / 127 * 0.51 + 1e-6
    assert torch.equal(got["model.layers.1.post_attention_layernorm.weight"],
                       o["model.layers.1.post_attention_layernorm.weight"])
    np.testing.assert_allclose(got["model.embed_tokens.weight"].numpy(), o["model.embed_tokens.weight"].numpy(),
                               atol=float(o["model.embed_tokens.weight"].abs().max()) / 127)
