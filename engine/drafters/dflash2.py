"""DFlash 2 drafters (``incoai/*-DFlash2``, mirrored by z-lab; block 8): the DFlash backbone with
two dynamic convolutions per layer and a candidate selector that walks one chain.

Convolution (``attention_conv`` and ``mlp_conv`` around each sublayer): from the sublayer's
normed input x, ``kernel_projection`` gives per-position kernels ``dyn[t] [2, K, H/group]``;
``prepare`` mixes x along the block positions before the sublayer, ``finish`` its output after:
``out_t = sum_o (base_kernel[j, o] + dyn[t, j, o]) * x_{t-o}`` (j = 0 for prepare, 1 for
finish; zeros before the anchor slot; one dynamic weight per group of ``group`` channels).
Context rows are not convolved: they only give the attention its keys and values.

Selector: each draft slot keeps the target head's top-K tokens (K = ``selector_top_k``) with
their logits as unary scores and adds an edge score for the token chosen before it,
``<A[prev] * P(h_k), B[cand]>`` (``predecessor_codebook`` A, ``successor_codebook`` B,
``hidden_projection`` P, rank r). The chain starts at the anchor. Greedy takes the best score;
sampling draws from q = the sampler's truncated softmax over the K scores, and that q, widened
to the vocabulary with zeros, is what the verify rule receives: drafts are exact draws from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.drafters.base import Draft
from engine.drafters.block import BlockBackbone, BlockConfig, ContextKV, DecoderLayer
from engine.drafters.dflash import DFlashDrafter
from engine.sampling import Sampler, sample_from, spread_to_vocab

if TYPE_CHECKING:
    from engine.target import Target


class DynamicConv(nn.Module):
    """z-lab's grouped dynamic causal convolution along the block."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = mx.zeros((2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def kernels(self, x: mx.array) -> mx.array:
        """x [R, L, H] -> dynamic kernels [R, L, 2, K, H/group]."""
        b, n, h = x.shape
        return self.kernel_projection(x).reshape(b, n, 2, self.kernel, h // self.group)

    def convolve(self, x: mx.array, dyn: mx.array, which: int) -> mx.array:
        """Convolve x [R, L, H] with base_kernel[which] + dyn[:, :, which]."""
        b, n, h = x.shape
        groups = h // self.group
        blocks = x.reshape(b, n, groups, self.group)
        base = self.base_kernel[which].astype(x.dtype)
        out = mx.zeros_like(blocks)
        for o in range(self.kernel):
            if o >= n:
                break
            shifted = blocks if o == 0 else mx.pad(blocks[:, : n - o], [(0, 0), (o, 0), (0, 0), (0, 0)])
            weight = base[o].reshape(groups, self.group) + dyn[:, :, which, o, :, None]
            out = out + weight * shifted
        return out.reshape(b, n, h)


class DFlash2Layer(DecoderLayer):
    def __init__(self, cfg: BlockConfig, index: int):
        super().__init__(cfg, index)
        self.attention_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = DynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def __call__(self, x: mx.array, kv: ContextKV | list[ContextKV]) -> mx.array:
        h = self.input_layernorm(x)
        dyn = self.attention_conv.kernels(h)
        a = self.self_attn(self.attention_conv.convolve(h, dyn, 0), kv)
        x = x + self.attention_conv.convolve(a, dyn, 1)
        h = self.post_attention_layernorm(x)
        dyn = self.mlp_conv.kernels(h)
        return x + self.mlp_conv.convolve(self.mlp(self.mlp_conv.convolve(h, dyn, 0)), dyn, 1)


class CandidateSelector(nn.Module):
    def __init__(self, vocab: int, rank: int, hidden: int):
        super().__init__()
        self.predecessor_codebook = mx.zeros((vocab, rank))  # stored without ".weight", as published
        self.successor_codebook = mx.zeros((vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)


class DFlash2Model(BlockBackbone):
    def __init__(self, cfg: BlockConfig):
        super().__init__(cfg)
        self.layers = [DFlash2Layer(cfg, i) for i in range(cfg.num_layers)]
        self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.selector_rank, cfg.hidden_size)


def top_candidates(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(ids [n, k], logits [n, k]) of each row's k largest logits, best first."""
    idx = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logits, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(idx, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


class DFlash2Drafter(DFlashDrafter):
    name = "dflash2"

    def __init__(self, model: DFlash2Model, cfg: BlockConfig, target: "Target"):
        super().__init__(model, cfg, target)
        self.top_k = min(cfg.selector_top_k, target.vocab_size)

    def draft(self, h: mx.array, logits: mx.array, anchor: int, sampler: Sampler) -> Draft:
        cands, unary = top_candidates(logits.astype(mx.float32), self.top_k)
        selector = self.model.candidate_selector
        proj = selector.hidden_projection(h).astype(mx.float32)
        succ = selector.successor_codebook[cands].astype(mx.float32)  # [cap, K, r]
        prev = mx.array(anchor, dtype=mx.uint32)
        tokens, probs = [], []
        for k in range(h.shape[0]):
            edge = succ[k] @ (selector.predecessor_codebook[prev].astype(mx.float32) * proj[k])
            scores = unary[k] + edge
            if sampler.greedy:
                index = mx.argmax(scores)
            else:
                q = sampler.probs(scores)
                probs.append(q)
                index = sample_from(q, sampler.next_key())
            prev = cands[k][index].astype(mx.uint32)
            tokens.append(prev)
        q = spread_to_vocab(mx.stack(probs), cands, self.target.vocab_size) if probs else None
        return Draft(mx.stack(tokens), q)
