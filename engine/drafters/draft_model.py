"""A small autoregressive draft model that shares the target's tokenizer.

The classic two-model setup (e.g. Qwen2.5-Coder-0.5B drafting for 1.5B). The draft model keeps
its own KV cache of committed tokens; each proposal feeds what it has not seen yet and then
runs ``cap`` cheap steps. Its drafts stay on the device as a lazy graph, so the target's verify
forward is queued behind them without a host round trip.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engine.drafters.base import Draft, Drafter
from engine.errors import TandemError
from engine.sampling import Sampler


def check_same_tokenizer(target_tok: Any, draft_tok: Any, target_name: str, draft_name: str) -> None:
    """Token ids mean the same thing in both models, or the pair is refused."""
    a, b = target_tok.get_vocab(), draft_tok.get_vocab()
    if a != b:
        diff = len(set(a.items()) ^ set(b.items()))
        raise TandemError(
            f"draft model {draft_name} does not share the tokenizer of {target_name} "
            f"({len(b)} vs {len(a)} tokens, {diff} entries differ)"
        )


class DraftModelDrafter(Drafter):
    name = "draft"
    has_model = True

    def __init__(self, model: Any, max_draft: int = 4):
        self.model = model
        self.max_draft = max_draft
        self._cache: list = []
        self._cached: list[int] = []  # tokens whose K/V the draft cache holds, in order
        self._uncommitted = mx.array([], dtype=mx.uint32)  # drafts fed to the cache, not yet in _cached

    def begin(self, prompt_ids: Sequence[int], hidden: mx.array | None) -> None:
        self._cache = make_prompt_cache(self.model)
        self._cached = []
        self._uncommitted = mx.array([], dtype=mx.uint32)
        # Prefill all but the last prompt token now (the loop's anchor is fed at proposal time).
        head = list(prompt_ids)[:-1]
        for start in range(0, len(head), 512):
            self.model(mx.array([head[start : start + 512]]), cache=self._cache)
            mx.eval([c.state for c in self._cache])
        self._cached = head

    def _sync(self, ids: Sequence[int]) -> list[int]:
        """Trim cached rows that are not a prefix of ``ids``; return the tokens still to feed."""
        keep = 0
        for a, b in zip(self._cached, ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # always feed at least the anchor
        if keep < len(self._cached):
            trim_prompt_cache(self._cache, len(self._cached) - keep)
            self._cached = self._cached[:keep]
        return list(ids[keep:])

    def propose(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        cap = min(cap, self.max_draft)
        if cap <= 0:
            return None
        pending = self._sync(ids)
        logits = self.model(mx.array([pending]), cache=self._cache)[0, -1]
        tokens, probs = [], []
        for i in range(cap):
            if sampler.greedy:
                tok = mx.argmax(logits, axis=-1)
            else:
                q = sampler.probs(logits)
                probs.append(q)
                tok = mx.random.categorical(mx.log(q), key=sampler.next_key())
            tokens.append(tok)
            if i + 1 < cap:
                logits = self.model(tok.reshape(1, 1), cache=self._cache)[0, -1]
        draft = Draft(mx.stack(tokens).astype(mx.uint32), mx.stack(probs) if probs else None)
        # The cache now also holds the first cap-1 drafts; their values are read after verify.
        self._cached = list(ids)
        self._uncommitted = draft.tokens[: cap - 1]
        return draft

    def commit(self, ids: Sequence[int], n_new: int, hidden: mx.array | None) -> None:
        # Record the drafted rows so _sync keeps the accepted ones and trims the rest.
        self._cached += self._uncommitted.tolist()
        self._uncommitted = mx.array([], dtype=mx.uint32)
