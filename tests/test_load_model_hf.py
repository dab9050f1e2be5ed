"""``mcf.torch.load_model`` into transformers models built without weights (on the meta device, or with
accelerate's ``init_empty_weights``): the model it fills is the model ``from_pretrained`` gives, to the last
bit of its logits, from a safetensors file, a sharded checkpoint, an MCF file kept in bfloat16 and a GGUF
file (names from transformers' own GGUF table, llama's Q/K rows reordered as transformers reorders them,
mcf's decoders); a quantized MCF file decodes into the model's dtype.  The tiny models of tests/_hf_models.py
keep every test at a fraction of a second."""

from __future__ import annotations

import copy
import os
import sys

import pytest

import mcf

torch = pytest.importorskip("torch", reason="torch is in the test extra")
transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is in the test extra")

sys.path.insert(0, os.path.dirname(__file__))
from _hf_models import tiny_model  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 12, 40, 3, 7, 22]])


# from_config's dtype keyword: torch_dtype before transformers 5 (which deprecates that spelling)
_DTYPE_KW = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def _meta(cfg, dtype=None):
    cfg = copy.deepcopy(cfg)   # from_config(dtype=) sets the config's dtype
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg, **({_DTYPE_KW: dtype} if dtype else {}))
    return m.eval()


def _logits(m):
    with torch.no_grad():
        return m(IDS).logits


def _same_model(got, want):
    sg, sw = got.state_dict(), want.state_dict()
    assert sg.keys() == sw.keys()
    for k in sw:
        assert sg[k].dtype == sw[k].dtype and torch.equal(sg[k], sw[k]), k
    for (n, a), (_, b) in zip(got.named_buffers(), want.named_buffers()):
        assert torch.equal(a, b), n
    a, b = _logits(got), _logits(want)
    assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    m = tiny_model("llama")
    m.save_pretrained(d / "f32")
    m.save_pretrained(d / "sharded", max_shard_size="100KB")
    m.to(torch.bfloat16).save_pretrained(d / "bf16")
    mcf.convert(str(d / "f32"), str(d / "bf16.mcf"), dtype="bf16")
    mcf.convert(str(d / "f32"), str(d / "q8.mcf"), method="q8")
    return d, tiny_model("llama")


def _pretrained(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()


@pytest.mark.parametrize("src", ["f32/model.safetensors", "sharded", "sharded/model.safetensors.index.json"])
def test_meta_model_is_from_pretrained(llama, src):
    d, original = llama
    if src == "sharded":
        assert len([f for f in os.listdir(d / "sharded") if f.endswith(".safetensors")]) > 1
    m = _meta(original.config)
    assert m.model.rotary_emb.inv_freq.is_meta
    assert mcf.torch.load_model(m, str(d / src)) == ([], [])
    assert all(not t.is_meta and t.device.type == "cpu" for t in m.state_dict().values())
    _same_model(m, _pretrained(d / "f32"))


def test_init_empty_weights_model_is_from_pretrained(llama):
    accelerate = pytest.importorskip("accelerate", reason="accelerate is in the test extra")
    d, original = llama
    with accelerate.init_empty_weights():
        m = transformers.AutoModelForCausalLM.from_config(original.config).eval()
    assert m.model.embed_tokens.weight.is_meta and not m.model.rotary_emb.inv_freq.is_meta
    assert mcf.torch.load_model(m, str(d / "f32")) == ([], [])
    _same_model(m, _pretrained(d / "f32"))


def test_refit_of_a_live_model_keeps_its_memory(llama, tmp_path):
    d, _ = llama
    m = _pretrained(d / "f32")
    ptrs = {k: (v.data_ptr(), id(v)) for k, v in m.state_dict(keep_vars=True).items()}
    tiny_model("llama", seed=7).save_pretrained(tmp_path / "other")
    assert mcf.torch.load_model(m, str(tmp_path / "other")) == ([], [])
    assert {k: (v.data_ptr(), id(v)) for k, v in m.state_dict(keep_vars=True).items()} == ptrs
    _same_model(m, _pretrained(tmp_path / "other"))


def test_tied_weights_share_storage(tmp_path):
    original = tiny_model("gpt2")
    assert original.config.tie_word_embeddings
    original.save_pretrained(tmp_path / "gpt2")
    assert "lm_head.weight" not in safetensors_torch.load_file(str(tmp_path / "gpt2" / "model.safetensors"))
    accelerate = pytest.importorskip("accelerate", reason="accelerate is in the test extra")
    with accelerate.init_empty_weights():   # GPT-2's attention masks (transformers < 5) stay in memory
        m = transformers.AutoModelForCausalLM.from_config(original.config).eval()
    assert mcf.torch.load_model(m, str(tmp_path / "gpt2")) == ([], [])
    assert m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr()
    assert m.lm_head.weight is m.transformer.wte.weight
    _same_model(m, _pretrained(tmp_path / "gpt2"))


def test_float32_model_from_bf16_checkpoint_is_the_cast_copy(llama):
    d, original = llama
    m = _meta(original.config)
    assert mcf.torch.load_model(m, str(d / "bf16")) == ([], [])
    want = tiny_model("llama")
    want.load_state_dict(safetensors_torch.load_file(str(d / "bf16" / "model.safetensors")))
    _same_model(m, want)


def test_mcf_file_kept_in_bf16(llama):
    d, original = llama
    with mcf.open(str(d / "bf16.mcf")) as c:
        assert {c.info(n).dtype.name for n in c} == {"bf16"}
    m = _meta(original.config, torch.bfloat16)
    assert mcf.torch.load_model(m, str(d / "bf16.mcf")) == ([], [])
    _same_model(m, _pretrained(d / "bf16", dtype=torch.bfloat16))


def test_quantized_mcf_decodes_into_the_models_dtype(llama):
    """q8 weights decode into float32 parameters as mcf.torch.load_state_dict decodes them, and the model stays
    close to the original: docs/loading.md states the error."""
    d, original = llama
    m = _meta(original.config)
    assert mcf.torch.load_model(m, str(d / "q8.mcf")) == ([], [])
    want = tiny_model("llama")
    want.load_state_dict(mcf.torch.load_state_dict(str(d / "q8.mcf")))
    _same_model(m, want)
    o = original.state_dict()
    for k, v in m.state_dict().items():   # q8: a relative RMS error of about 0.5% per matrix
        if v.dim() == 2:
            assert 0 < (v - o[k]).pow(2).mean().sqrt() <= 0.01 * o[k].pow(2).mean().sqrt(), k
    a, b = _logits(m), _logits(original)
    assert 0 < (a - b).abs().max() <= 0.03 * b.abs().max()
    half = _meta(original.config, torch.bfloat16)
    mcf.torch.load_model(half, str(d / "q8.mcf"))
    assert half.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert torch.equal(half.model.layers[0].mlp.down_proj.weight,
                       mcf.torch.load_state_dict(str(d / "q8.mcf"), dtype=torch.bfloat16)[
                           "model.layers.0.mlp.down_proj.weight"])


def test_strict_names_every_missing_and_unexpected_and_writes_nothing(llama, tmp_path):
    d, original = llama
    deeper = tiny_model("llama", layers=3).config
    m = _meta(deeper)
    with pytest.raises(mcf.LoadMismatchError) as e:
        mcf.torch.load_model(m, str(d / "f32"))
    msg = str(e.value)
    assert "missing (9," in msg
    for k in m.state_dict():
        if k.startswith("model.layers.2."):
            assert repr(k) in msg, k
    assert all(t.is_meta for t in m.state_dict().values()) and m.model.rotary_emb.inv_freq.is_meta
    shallow = _meta(tiny_model("llama", layers=1).config)
    with pytest.raises(RuntimeError, match=r"unexpected \(9,") as e:
        mcf.torch.load_model(shallow, str(d / "f32"))
    assert all(t.is_meta for t in shallow.state_dict().values())
    missing, unexpected = mcf.torch.load_model(shallow, str(d / "f32"), strict=False)
    assert missing == [] and sorted(unexpected) == sorted(k for k in original.state_dict()
                                                           if k.startswith("model.layers.1."))
    wrong = _meta(tiny_model("llama", hidden=32, heads=2, kv_heads=1).config)
    with pytest.raises(mcf.LoadMismatchError, match="shape mismatch for 'model.embed_tokens.weight'"):
        mcf.torch.load_model(wrong, str(d / "f32"), strict=False)


# -- GGUF --------------------------------------------------------------------------------------------------
TYPES = {"token_embd.weight": "Q8_0", "output.weight": "Q6_K", "*norm.weight": "F32",
         "blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q4_K", "blk.1.attn_q.weight": "F16",
         "blk.1.attn_k.weight": "BF16", "*": "Q4_0"}


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory):
    pytest.importorskip("gguf", reason="gguf-py writes the file and holds transformers' GGUF name table")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate (in the test extra)")
    from _gguf_llama import write_llama_gguf

    d = tmp_path_factory.mktemp("gguf_llama")
    write_llama_gguf(tiny_model("llama", hidden=256), str(d / "tiny.gguf"), TYPES)
    return d


def test_gguf_file_is_from_pretrained(gguf_llama, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = gguf_llama
    cfg = transformers.AutoConfig.from_pretrained(str(d), gguf_file="tiny.gguf")
    m = _meta(cfg)
    assert mcf.torch.load_model(m, str(d / "tiny.gguf")) == ([], [])
    # the q/k rows are reordered (transformers' LlamaTensorProcessor), not loaded as stored
    with mcf.gguf.open(str(d / "tiny.gguf")) as g:
        stored = torch.from_numpy(g.array("blk.1.attn_q.weight").astype("float32"))
    assert not torch.equal(m.model.layers[1].self_attn.q_proj.weight, stored)
    _same_model(m, _pretrained(d, gguf_file="tiny.gguf"))


def test_gguf_processor_beyond_a_row_order_is_refused(gguf_llama, monkeypatch):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    class Transposing(gguf_utils.TensorProcessor):
        def process(self, weights, name, **kwargs):
            return gguf_utils.GGUFTensor(weights.T if "ffn_up" in name else weights, name, {})

    monkeypatch.setitem(gguf_utils.TENSOR_PROCESSORS, "llama", Transposing)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = _meta(transformers.AutoConfig.from_pretrained(str(gguf_llama), gguf_file="tiny.gguf"))
    with pytest.raises(mcf.InvalidArgumentError, match="Transposing changes GGUF tensor 'blk.0.ffn_up.weight'"):
        mcf.torch.load_model(m, str(gguf_llama / "tiny.gguf"))
    assert all(t.is_meta for t in m.state_dict().values())
