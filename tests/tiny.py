"""Tiny random models and a made-up tokenizer for tests (no downloads, milliseconds each)."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten
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
    elif arch in FAMILIES:
        return make_family_model(arch, seed=seed, vocab=vocab, layers=layers, hidden=hidden, scale=scale)
    else:
        raise ValueError(arch)
    model = mod.Model(args)
    if scale != 1.0:
        model.lm_head.weight = model.lm_head.weight * scale
    mx.eval(model.parameters())
    model.eval()
    return model


# Families whose caches are not plain KVCache: sliding windows (RotatingKVCache), recurrent state
# (ArraysCache: GatedDeltaNet, Mamba2, short convolutions), both in one layer (CacheList).
FAMILIES = ("llama-sliding", "gemma3", "qwen3_5", "nemotron_h", "falcon_h1", "lfm2")
WINDOW = 8  # sliding window of the tiny sliding-window models


def make_family_model(arch: str, seed: int = 0, vocab: int = VOCAB, layers: int = 4, hidden: int = 64,
                      scale: float = 1.0, window: int = WINDOW):
    """A tiny random model of one of ``FAMILIES`` from mlx-lm's own classes."""
    mx.random.seed(seed)
    heads, kv_heads, head_dim = 4, 2, hidden // 4
    if arch == "llama-sliding":
        from mlx_lm.models import llama as mod

        kinds = ["full_attention" if i % 3 == 0 else "sliding_attention" for i in range(layers)]
        args = mod.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                             intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             vocab_size=vocab, rms_norm_eps=1e-5, tie_word_embeddings=False, layer_types=kinds,
                             sliding_window=window)
    elif arch == "gemma3":
        from mlx_lm.models import gemma3_text as mod

        args = mod.ModelArgs(model_type="gemma3_text", hidden_size=hidden, num_hidden_layers=layers,
                             intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, query_pre_attn_scalar=head_dim, vocab_size=vocab,
                             sliding_window=window, sliding_window_pattern=2)
    elif arch == "qwen3_5":
        from mlx_lm.models import qwen3_5 as mod

        text = dict(model_type="qwen3_5_text", hidden_size=hidden, num_hidden_layers=layers,
                    intermediate_size=2 * hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                    head_dim=head_dim, vocab_size=vocab, rms_norm_eps=1e-6, linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4, full_attention_interval=2, tie_word_embeddings=False,
                    max_position_embeddings=4096)
        args = mod.ModelArgs(model_type="qwen3_5", text_config=text)
    elif arch == "nemotron_h":
        from mlx_lm.models import nemotron_h as mod

        pattern = ["M", "*", "M", "-"] * (layers // 4) + ["M"] * (layers % 4)
        args = mod.ModelArgs(model_type="nemotron_h", vocab_size=vocab, hidden_size=hidden,
                             intermediate_size=2 * hidden, max_position_embeddings=4096, num_attention_heads=heads,
                             num_key_value_heads=kv_heads, head_dim=head_dim, attention_bias=False,
                             mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
                             conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
                             use_conv_bias=True, hybrid_override_pattern=pattern)
    elif arch == "falcon_h1":
        from mlx_lm.models import falcon_h1 as mod

        args = mod.ModelArgs(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                             vocab_size=vocab, mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16,
                             mamba_n_heads=4, mamba_n_groups=1, mamba_chunk_size=16, tie_word_embeddings=False,
                             rope_theta=10000.0)
    elif arch == "lfm2":
        from mlx_lm.models import lfm2 as mod

        args = mod.ModelArgs(model_type="lfm2", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                             norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=hidden, block_multiple_of=16,
                             block_ffn_dim_multiplier=None, block_auto_adjust_ff_dim=False,
                             block_ff_dim=2 * hidden, full_attn_idxs=[i for i in range(layers) if i % 3 == 1])
    else:
        raise ValueError(arch)
    model = mod.Model(args)
    if scale != 1.0:
        params = dict(tree_flatten(model.parameters()))  # the head, else the tied embedding
        key = next(k for k in ("lm_head.weight", "language_model.lm_head.weight", "model.embed_tokens.weight")
                   if k in params)
        model.load_weights([(key, params[key] * scale)], strict=False)
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
