"""Sampling settings, truncated distributions and the speculative-sampling rule.

Greedy decoding accepts a draft while it equals the target's argmax. Sampling uses the
speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): accept draft token x with
probability min(1, p(x)/q(x)); at the first rejection sample from norm(max(0, p - q)); when every
draft is accepted sample a bonus token from p. The committed tokens are then an exact sample of
the target distribution p, whatever the drafter proposed; p and q are truncated by the same
top-k/top-p rule, so the output is exact for the truncated target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import mlx.core as mx

if TYPE_CHECKING:
    from engine.processors import LogitsProcessor


@dataclass(frozen=True)
class SamplingParams:
    """temperature <= 0 means greedy. top_k = 0 and top_p = 1 disable truncation."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> "SamplingParams":
        from engine.errors import TandemError

        if self.temperature < 0:
            raise TandemError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise TandemError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise TandemError(f"top_k must be >= 0, got {self.top_k}")
        return self


def target_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Softmax(logits / T) truncated by top-k then top-p and renormalised, in float32.

    Works on the last axis of any shape. Ties at the top-k threshold are all kept, so the
    rule is a deterministic function of the logits (the drafter and the target must agree).
    """
    logits = logits.astype(mx.float32) / max(params.temperature, 1e-6)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.sort(logits, axis=-1)[..., vocab - params.top_k : vocab - params.top_k + 1]
        logits = mx.where(logits >= kth, logits, -mx.inf)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_p = mx.take_along_axis(probs, order, axis=-1)
        before = mx.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        # The most likely token is always kept: a top_p below float32's smallest value rounds to
        # 0, where ``before < top_p`` would keep nothing (and sample token 0 from NaNs).
        first = mx.arange(vocab) == 0
        keep_sorted = (before < params.top_p) | first
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


class Sampler:
    """Holds the sampling settings and the random key stream of one generation, and its logit
    processors and logprobs (``engine/processors.py``; None: neither)."""

    def __init__(self, params: SamplingParams, processor: "LogitsProcessor | None" = None):
        self.params = params.validate()
        self.processor = processor
        seed = params.seed if params.seed is not None else int.from_bytes(__import__("os").urandom(4), "little")
        self._key = mx.random.key(seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def probs(self, logits: mx.array) -> mx.array:
        return target_probs(logits, self.params)

    def process(self, logits: mx.array, ids: Sequence[int], tail: mx.array | None = None) -> mx.array:
        """The target's rows as this request samples them (penalties, logit_bias): row i after
        ``ids`` + the first tokens of ``tail`` (``LogitsProcessor.rows``). Drafters never call it."""
        return logits if self.processor is None else self.processor.rows(logits, ids, tail)

    @property
    def wants_logprobs(self) -> bool:
        return self.processor is not None and self.processor.wants_logprobs

    def logprobs(self, rows: mx.array, tokens: Sequence[int]) -> list | None:
        """Each token's logprob (``engine.processors.TokenLogprob``) under processed ``rows``;
        None when the request asks for none."""
        return None if self.processor is None else self.processor.logprobs(rows, tokens)

    def pick(self, logits: mx.array) -> mx.array:
        """One token per row of logits: argmax when greedy, else a sample (lazy)."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return sample_from(self.probs(logits), self.next_key())


def sample_from(probs: mx.array, key: mx.array) -> mx.array:
    """Categorical sample per row of a probability array (zeros are never drawn)."""
    return mx.random.categorical(mx.log(probs), axis=-1, key=key)


def pick_rows(logits: mx.array, samplers: Sequence[Sampler], kept: Sequence[bool], probs: list[list[mx.array]]
              ) -> mx.array:
    """One draft token per row of ``logits`` [R, V] (lazy): the argmax for a greedy row or one
    whose draft here is not kept (a batch's filler), else a draw from the row's q with its
    sampler's next key, q appended to ``probs[r]``: the draws a row's lone proposal makes."""
    picks = mx.argmax(logits, axis=-1)
    if all(s.greedy for s in samplers):
        return picks
    out = []
    for r, (sampler, keep) in enumerate(zip(samplers, kept)):
        if sampler.greedy or not keep:
            out.append(picks[r])
            continue
        q = sampler.probs(logits[r])
        probs[r].append(q)
        out.append(sample_from(q, sampler.next_key()))
    return mx.stack(out)


def accept_greedy(drafts: mx.array, target_logits: mx.array) -> tuple[int, list[int]]:
    """Greedy verify. drafts [k], target_logits [k+1, V] (row i predicts the token after
    input i). Returns (n accepted, committed tokens = drafts[:n] + [argmax at n])."""
    choice = mx.argmax(target_logits, axis=-1)
    k = drafts.shape[0]
    if k == 0:
        return 0, [choice.item()]
    same = (drafts == choice[:k]).astype(mx.int32)
    n_acc = mx.cumprod(same).sum()
    mx.eval(n_acc, choice)
    n = n_acc.item()
    # drafts[:n] equal the argmaxes there, so the committed tokens are the argmaxes.
    return n, choice[: n + 1].tolist()


def accept_sampled(
    drafts: mx.array, draft_probs: mx.array | None, target_logits: mx.array, sampler: Sampler
) -> tuple[int, list[int]]:
    """Speculative-sampling verify. draft_probs [k, V] is q for each draft (None = one-hot
    drafts, as from n-gram lookup). Returns (n accepted, committed tokens)."""
    p = sampler.probs(target_logits)  # [k+1, V]
    k = drafts.shape[0]
    vocab = p.shape[-1]
    if k == 0:
        tok = sample_from(p[0], sampler.next_key())
        return 0, [tok.item()]
    if draft_probs is None:
        q = (mx.arange(vocab)[None, :] == drafts[:, None]).astype(mx.float32)
    else:
        q = _fit_vocab(draft_probs.astype(mx.float32), vocab)
    idx = drafts[:, None]
    p_d = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(k,), key=sampler.next_key())
    accepted = (u * q_d < p_d).astype(mx.int32)  # u < p/q without dividing by q
    n_acc = mx.cumprod(accepted).sum()
    mx.eval(n_acc)
    n = n_acc.item()
    if n == k:
        last = p[k]
    else:
        residual = mx.maximum(p[n] - q[n], 0.0)
        mass = residual.sum()
        # mass == 0 only when p == q, where rejection has probability zero; stay defined anyway.
        last = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[n])
    tok = sample_from(last, sampler.next_key()).item()
    return n, drafts[:n].tolist() + [tok]


def accept_block(sampler: Sampler, drafts: mx.array, draft_probs: mx.array | None, logits: mx.array,
                 ids: Sequence[int]) -> tuple[int, list[int], mx.array]:
    """One verify's acceptance: the rows as this request samples them (``Sampler.process``: row i
    after ``ids`` + ``drafts[:i]``), then the greedy or speculative-sampling rule. Returns (n
    accepted, committed tokens, the processed rows). No drafts: one plain step's token."""
    rows = sampler.process(logits, ids, drafts)
    if sampler.greedy:
        n, committed = accept_greedy(drafts, rows)
    else:
        n, committed = accept_sampled(drafts, draft_probs, rows, sampler)
    return n, committed, rows


def _fit_vocab(q: mx.array, vocab: int) -> mx.array:
    """A drafter's vocabulary may be padded or shorter than the target's: widen with zeros
    (tokens the drafter cannot propose) or cut the padding (never proposed)."""
    width = q.shape[-1]
    if width == vocab:
        return q
    if width > vocab:
        return q[..., :vocab]
    return mx.concatenate([q, mx.zeros((*q.shape[:-1], vocab - width), dtype=q.dtype)], axis=-1)


def spread_to_vocab(q: mx.array, ids: mx.array | None, vocab: int) -> mx.array:
    """q [k, n] over a drafter's own token list -> [k, vocab] over the target's vocabulary,
    zeros elsewhere. ``ids``: the target token of each column, [n] (one list for every row, a
    reduced draft vocabulary) or [k, n] (per row, e.g. candidates); None: q is already [k, vocab]."""
    if ids is None:
        return q
    ids = ids.astype(mx.int32)
    if ids.ndim == 1:
        ids = mx.broadcast_to(ids[None], q.shape)
    return mx.put_along_axis(mx.zeros((q.shape[0], vocab), dtype=q.dtype), ids, q, axis=-1)
