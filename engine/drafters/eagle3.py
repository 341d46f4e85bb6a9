"""EAGLE-3 heads (vLLM speculators ``Eagle3Speculator``; SafeAILab / SpecForge
``LlamaForCausalLMEagle3``), drafting a chain in the one verify loop (no tree).

The head reads three target states per position, the inputs of decoder layers ``aux`` (default
2, N/2, N-3; our taps are the outputs of the layers before them), concatenated low|mid|high and
fused by ``fc`` (3·H_t -> H). Its first decoder layer takes ``[input_layernorm(embed(x_{t+1}));
hidden_norm(g_t)]`` (embedding first, 2H wide) into its attention and adds the attention output
to ``g_t`` (or to ``hidden_norm(g_t)`` with ``norm_before_residual``); further layers are plain
Llama layers. Logits are ``lm_head(norm(h))`` over a reduced draft vocabulary: draft id i is
target token ``i + d2t[i]``, and q is zero on every other token. The embedding is the target's
unless the checkpoint carries its own. A chain row feeds the head's own pre-norm output back as
g (``fc`` only maps the target's states). Rows, cache and chain: ``chain.ChainDrafter``. Reading
and checking checkpoints: ``engine/drafters/formats.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP

from engine.drafters.chain import ChainDrafter

if TYPE_CHECKING:
    from engine.target import Target


@dataclass
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # inputs of these target layers (HF hidden_states[i])
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int | None = None
    attention_bias: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_bias: bool = False
    own_embedding: bool = False
    speculative_tokens: int = 3
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The input of layer i is the output of layer i-1."""
        return tuple(i - 1 for i in self.aux_layer_ids)


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, in_dims: int):
        super().__init__()
        from mlx_lm.models.rope_utils import initialize_rope

        d, bias = cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv, self.head_dim, self.scale = cfg.num_heads, cfg.num_kv_heads, d, d ** -0.5
        self.q_proj = nn.Linear(in_dims, cfg.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(in_dims, cfg.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(in_dims, cfg.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=bias)
        self.rope = initialize_rope(d, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings)

    def __call__(self, x: mx.array, cache) -> mx.array:
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, n, self.n_kv, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv, -1).transpose(0, 2, 1, 3)
        # Rows after the cached ones, in order ("causal", or none for one row); a batch's merged
        # cache also masks each row's left padding. Asked before the rows go in, as mlx-lm does.
        mask = cache.make_mask(n, return_array=False, window_size=None)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class FirstLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h = cfg.hidden_size
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * h)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache) -> mx.array:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = residual + self.self_attn(mx.concatenate([self.input_layernorm(embeds), normed], axis=-1), cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def __call__(self, x: mx.array, cache) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Model(nn.Module):
    """Parameter names are the speculators checkpoint's (``layers.0.*``, ``fc``, ``norm``, ``lm_head``)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        n_aux = len(cfg.aux_layer_ids)
        if cfg.norm_before_fc:
            self.input_norm = nn.RMSNorm(n_aux * cfg.target_hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = [FirstLayer(cfg)] + [Layer(cfg) for _ in range(1, cfg.num_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if cfg.own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def features(self, taps: mx.array) -> mx.array:
        """Concatenated target states [m, n_aux·H_t] -> g [m, H]."""
        if self.cfg.norm_before_fc:
            taps = self.input_norm(taps)
        return self.fc(taps)

    def __call__(self, embeds: mx.array, hidden: mx.array, caches: list) -> mx.array:
        """embeds, g [R, L, H] -> pre-norm outputs [R, L, H]; appends L rows to ``caches``."""
        x = self.layers[0](embeds, hidden, caches[0])
        for layer, cache in zip(self.layers[1:], caches[1:]):
            x = layer(x, cache)
        return x

    def logits(self, h: mx.array) -> mx.array:
        return self.lm_head(self.norm(h))

    @property
    def dtype(self) -> mx.Dtype:
        return self.norm.weight.dtype


class Eagle3Drafter(ChainDrafter):
    name = "eagle3"

    def __init__(self, model: Eagle3Model, target: "Target", vocab_ids: mx.array | None = None,
                 depth: int | None = None):
        super().__init__(model, target, depth=depth or model.cfg.speculative_tokens, vocab_ids=vocab_ids)
        self.cfg = model.cfg
        self.tap_layers = model.cfg.tap_layers

    def context_features(self, hidden: mx.array) -> mx.array:
        return self.model.features(hidden.astype(self.model.dtype))

    def run_rows(self, tokens: mx.array, features: mx.array, caches: list) -> mx.array:
        embed = self.model.embed_tokens if self.cfg.own_embedding else self.target.embed_tokens
        dtype = self.model.dtype
        return self.model(embed(tokens).astype(dtype), features.astype(dtype), caches)

    def logits(self, state: mx.array) -> mx.array:
        return self.model.logits(state)
