"""Native MTP heads: the target's own multi-token-prediction head as the drafter. Two layouts:

* Qwen3.5 / 3.6 / 3.8, Qwen3-Next (``MTPHead``, below);
* DeepSeek-V3 and GLM-4.5 "nextn" (``NextNHead``, at the end).

Layout (the checkpoint's ``mtp.*`` tensors; the parameter names here drop the prefix):
``fc [H, 2H]``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm [H]`` and
``layers.0.*``, one full-attention decoder layer of the target's own kind (gated queries, q/k
norms, partial RoPE; a dense or MoE MLP). It has no embedding or head: it uses the target's.

Row t: ``fc([pre_fc_norm_embedding(embed(x_{t+1})); pre_fc_norm_hidden(h_t)])`` (embedding
first) -> the layer at position t -> ``norm`` -> the target's lm_head -> x_{t+2}, where h_t is
the target's final-norm output at t (the lm_head input: target tap ``FINAL``). A deeper draft
runs the same head again on its own normed output. The row bookkeeping, the head's own KV
cache (committed rows only) and the chain are ``chain.ChainDrafter``'s. Reading and checking
the weights: ``engine/drafters/formats.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from engine.drafters.chain import ChainDrafter
from engine.target import FINAL

if TYPE_CHECKING:
    from engine.target import Target

MAX_DEPTH = 3  # measured per-depth acceptance falls fast (0.70, 0.29, 0.18 on Qwen3.5)


class MTPHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float, layers: list[nn.Module]):
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = layers
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, caches: list) -> mx.array:
        """embeds, hidden [R, L, H] -> normed outputs [R, L, H]; appends L rows to ``caches``."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1))
        for layer, cache in zip(self.layers, caches):
            mask = cache.make_mask(x.shape[1], return_array=False, window_size=None)
            x = layer(x, mask, cache)
        return self.norm(x)

    @property
    def dtype(self) -> mx.Dtype:
        w = self.fc.scales if isinstance(self.fc, nn.QuantizedLinear) else self.fc.weight
        return w.dtype


class MTPDrafter(ChainDrafter):
    name = "mtp"
    tap_layers = (FINAL,)

    def __init__(self, head: MTPHead, target: "Target", depth: int = MAX_DEPTH):
        super().__init__(head, target, depth=max(1, min(int(depth), MAX_DEPTH)))

    def run_rows(self, tokens: mx.array, features: mx.array, caches: list) -> mx.array:
        dtype = self.model.dtype
        return self.model(self.target.embed_tokens(tokens).astype(dtype), features.astype(dtype), caches)

    def logits(self, state: mx.array) -> mx.array:
        return self.target.head(state)


class NextNHead(nn.Module):
    """DeepSeek-V3 / GLM-4.5 layout (``model.layers.{N}.*``, N = the trunk's layer count; names
    here drop that prefix): ``enorm``, ``hnorm`` [H], ``eh_proj`` [H, 2H], one decoder layer of the
    target's own kind (MLA or GQA attention, MoE) and ``shared_head.norm``. Its ``embed_tokens``
    and ``shared_head.head`` are copies of the target's, whose own are used.

    Row t: ``eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])`` (the embedding zeroed at position 0)
    -> the layer -> output state (pre-norm); logits = lm_head(shared_head.norm(state)). A deeper
    draft feeds the pre-norm state back as h."""

    def __init__(self, hidden_size: int, eps: float, layers: list[nn.Module]):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = layers
        self.shared_head = _SharedHead(hidden_size, eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, caches: list) -> mx.array:
        """embeds, hidden [R, L, H] -> pre-norm states [R, L, H]; appends L rows to ``caches``."""
        # The row at position 0 has no previous token: no embedding. (A batch's merged caches,
        # whose offsets are per row, only ever chain after committed rows.)
        if isinstance(caches[0].offset, int) and caches[0].offset == 0:
            embeds = mx.concatenate([mx.zeros_like(embeds[:, :1]), embeds[:, 1:]], axis=1)
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache.make_mask(x.shape[1], return_array=True, window_size=None), cache)
        return x

    @property
    def dtype(self) -> mx.Dtype:
        w = self.eh_proj.scales if isinstance(self.eh_proj, nn.QuantizedLinear) else self.eh_proj.weight
        return w.dtype


class _SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)


class NextNDrafter(MTPDrafter):
    """The chain on a ``NextNHead``: states are pre-norm, logits through ``shared_head.norm``."""

    def logits(self, state: mx.array) -> mx.array:
        return self.target.head(self.model.shared_head.norm(state))
