"""Tiny Hugging Face causal LMs built from configs with seeded random weights, and a word-level tokenizer
built with the ``tokenizers`` package: the model-in-the-loop tests run without downloading anything."""

from __future__ import annotations

WORDS = ("the a of and to in is was it that for on with as by at from this be are or an which we you they "
         "cat dog hat sat ran red blue green house tree river city book door window light night day sun moon "
         "what where when who how why one two three four five six seven eight nine ten").split()
VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
BOS, EOS = 1, 2


def tiny_tokenizer():
    """A word-level tokenizer over :data:`WORDS` that adds ``<s>`` in front of a text with special tokens,
    wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tiny_model(kind: str = "llama", *, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, positions: int = 512, vocab: int | None = None, sliding_window: int | None = None):
    """A causal LM with random weights (``torch.manual_seed(seed)``): ``llama`` (grouped-query attention:
    ``kv_heads`` < ``heads``), ``qwen2`` (q/k/v biases), ``gpt2`` (multi-head, absolute positions) or
    ``mistral`` (with ``sliding_window``)."""
    import torch
    import transformers as tf

    vocab = vocab or len(VOCAB)
    common = dict(vocab_size=vocab, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.1)
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions, **common)
        cls = tf.GPT2LMHeadModel
    else:
        cfg_cls, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                        "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[kind]
        extra = {"sliding_window": sliding_window} if kind == "mistral" else {}
        cfg = cfg_cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
                      **extra, **common)
    torch.manual_seed(seed)
    return cls(cfg).eval()


def save_tiny(path, kind: str = "llama", **kw) -> None:
    """A checkpoint directory (config, safetensors weights, tokenizer) as ``from_pretrained`` reads it."""
    tiny_model(kind, **kw).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
