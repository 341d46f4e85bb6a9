"""Tiny random models and a made-up tokenizer for tests (no downloads, milliseconds each)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.drafters.base import Draft, Drafter
from engine.generate import Engine

VOCAB = 96
EOS = "</s>"


def make_tokenizer(vocab: int = VOCAB) -> TokenizerWrapper:
    """A word-level tokenizer: token i is the word ``w{i}``; id 0 is EOS, id 1 BOS."""
    words = {"</s>": 0, "<s>": 1}
    for i in range(2, vocab):
        words[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token="<s>")
    return TokenizerWrapper(fast)


def make_tiny_model(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 4, hidden: int = 64,
                    scale: float = 1.0):
    """A random mlx-lm model. ``scale`` stretches the logits so greedy choices are not near-ties."""
    mx.random.seed(seed)
    common = dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "llama":
        from mlx_lm.models import llama as mod

        args = mod.ModelArgs(model_type="llama", **common)
    elif arch == "qwen3":
        from mlx_lm.models import qwen3 as mod

        args = mod.ModelArgs(model_type="qwen3", head_dim=hidden // 4, max_position_embeddings=4096, **common)
    else:
        raise ValueError(arch)
    model = mod.Model(args)
    if scale != 1.0:
        model.lm_head.weight = model.lm_head.weight * scale
    mx.eval(model.parameters())
    model.eval()
    return model


def make_tiny_engine(arch: str = "llama", seed: int = 0, **kw) -> Engine:
    return Engine(make_tiny_model(arch, seed, **kw), make_tokenizer(kw.get("vocab", VOCAB)), name=f"tiny-{arch}")


class FixedDrafter(Drafter):
    """Always proposes the same tokens (one-hot q, like n-gram lookup): lets tests control how
    many drafts are accepted."""

    name = "fixed"

    def __init__(self, tokens, max_draft: int = 8):
        self.tokens = list(tokens)
        self.max_draft = max_draft

    def propose(self, ids, cap, sampler):
        return Draft(mx.array(self.tokens[:cap], dtype=mx.uint32))
