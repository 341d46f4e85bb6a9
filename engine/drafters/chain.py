"""Chain heads: a small head that reads the target's state at position t with the token at t+1,
predicts token t+2, and runs again on its own output for each further draft. Native MTP heads
(``engine/drafters/mtp.py``) and EAGLE-3 (``engine/drafters/eagle3.py``) work this way.

Rows. Row t pairs the target's feature at position t (what the target had when it predicted
token t+1) with token t+1; it sits at position t in the head's own attention cache and its
output predicts token t+2. A committed row is fed as soon as its token is known: the target
caches ``ids[:-1]``, so the rows go up to the one for the anchor (its feature is the previous
position's, its token the anchor), and that last row's output, the *seed*, predicts the first
draft. Each further draft runs one *chain* row (the previous draft, the head's own output) at
the next position. Chain rows live in the cache during ``propose`` only and are trimmed right
after it (``engine.caches.trim``, the count checked), so the cache always holds exactly the committed rows, each made
from the target's own feature, as in training (vLLM and SGLang re-run accepted positions the
same way).

Sampling: each draft is a draw from q = the sampler's truncated softmax of the head's logits at
that step, given the drafts actually drawn before it; q (widened to the target's vocabulary
with zeros when the head drafts from a reduced vocabulary) is what the verify rule receives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine import caches
from engine.drafters.base import Draft, Drafter, DrafterState, propose_each
from engine.errors import TandemError
from engine.sampling import Sampler, pick_rows, sample_from, spread_to_vocab

if TYPE_CHECKING:
    from engine.target import Target

CONTEXT_CHUNK = 512  # prompt rows fed per eval in begin(): bounded memory


class ChainDrafter(Drafter):
    """The row bookkeeping and the chain; subclasses say how rows are computed."""

    has_model = True

    def __init__(self, model: nn.Module, target: "Target", *, depth: int, vocab_ids: mx.array | None = None):
        """``depth``: the most drafts one proposal chains. ``vocab_ids`` [N]: the target token
        of each logit column when the head drafts from a reduced vocabulary (else None)."""
        self.model = model
        self.target = target
        self.max_draft = int(depth)
        self.vocab_ids = vocab_ids
        self._caches = self.new_cache()
        self._fed = 0  # committed rows in the head's cache (rows 0.._fed-1)
        self._pending: mx.array | None = None  # target features whose next token was not known yet
        self._seed: mx.array | None = None  # output of the last committed row

    # -- what a head defines ----------------------------------------------------------------
    def new_cache(self) -> list:
        return [KVCache() for _ in self.model.layers]

    def context_features(self, hidden: mx.array) -> mx.array:
        """Tapped target rows [m, ...] -> the head's feature per committed row [m, F]."""
        return hidden

    def run_rows(self, tokens: mx.array, features: mx.array, caches: list) -> mx.array:
        """Rows of R sequences (tokens [R, L], features [R, L, F]) appended to ``caches`` (this
        drafter's own, R = 1, or a batch's merged ones) -> output states [R, L, S]."""
        raise NotImplementedError

    def run(self, tokens: mx.array, features: mx.array) -> mx.array:
        """Rows (tokens [L], features [L, F]) appended to the cache -> output states [L, S]."""
        return self.run_rows(tokens[None], features[None], self._caches)[0]

    def chain_features(self, state: mx.array) -> mx.array:
        """The feature a chain row reads from the previous row's output state."""
        return state

    def logits(self, state: mx.array) -> mx.array:
        """Output state [..., S] -> logits over the head's vocabulary [..., N]."""
        raise NotImplementedError

    # -- rows -----------------------------------------------------------------------------------
    @property
    def context_len(self) -> int:
        return self._fed

    def _cache_state(self) -> list[mx.array]:
        return [a for c in self._caches if c.keys is not None for a in (c.keys, c.values)]

    def _feed(self, ids: Sequence[int]) -> None:
        """Run every pending row whose next token is now in ``ids``."""
        pending = self._pending
        if pending is None:
            return
        n = min(int(pending.shape[0]), len(ids) - 1 - self._fed)
        for start in range(0, max(n, 0), CONTEXT_CHUNK):
            stop = min(n, start + CONTEXT_CHUNK)
            tokens = mx.array([int(t) for t in ids[self._fed + 1 : self._fed + 1 + stop - start]], dtype=mx.uint32)
            out = self.run(tokens, self.context_features(pending[start:stop]))
            self._fed += stop - start
            self._seed = out[-1]
            if stop < n:
                mx.eval(self._seed, self._cache_state())
        if n > 0:
            self._pending = pending[n:] if n < pending.shape[0] else None

    def begin(self, prompt_ids: Sequence[int], hidden: mx.array | None) -> None:
        if hidden is None:
            raise TandemError(f"{self.name}: the target produced no tapped hidden states")
        self._caches = self.new_cache()
        self._fed, self._seed, self._pending = 0, None, hidden
        self._feed(prompt_ids)  # the last prompt row waits for the first generated token

    def state(self) -> DrafterState | None:
        """The committed rows. Row t also read token t+1: a resume after p tokens needs p + 1 to match."""
        if not self._fed or self._pending is not None:
            return None
        return DrafterState(self._fed, caches.snapshot(self._caches), lookahead=1)

    def resume(self, prompt_ids: Sequence[int], cached: int, state: DrafterState | None,
               hidden: mx.array | None) -> None:
        if not cached:
            self.begin(prompt_ids, hidden)
            return
        if hidden is None or state is None or state.tokens < cached:
            raise RuntimeError(f"{self.name} drafter: no stored rows for the {cached} restored tokens")
        self._caches = self.new_cache()
        caches.restore(self._caches, state.tree)
        for cache in self._caches:  # rows 0..cached-1: row cached-1 reads prompt token `cached`
            caches.trim(cache, cache.offset - cached)
        self._fed, self._seed, self._pending = cached, None, hidden
        self._feed(prompt_ids)

    def commit(self, ids: Sequence[int], n_new: int, hidden: mx.array | None) -> None:
        if hidden is None or hidden.shape[0] == 0:
            return
        self._pending = hidden if self._pending is None else mx.concatenate([self._pending, hidden])
        self._feed(ids)
        mx.async_eval(self._seed, self._cache_state())

    def agreement(self, ids: Sequence[int]) -> tuple[int, int]:
        """(positions where the first draft equals the target's greedy next token, positions) over
        ``ids``, teacher-forced in one batched pass (a load-time probe; the live state is kept)."""
        target = self.target
        target.set_taps(self.tap_layers)
        with target.uncounted():  # probes are not generation work
            logits, hidden = target.forward(mx.array([list(ids)], dtype=mx.uint32), target.new_cache(), tap=True)
        live, self._caches = self._caches, self.new_cache()
        try:
            out = self.run(mx.array(list(ids[1:]), dtype=mx.uint32), self.context_features(hidden[:-1]))
            mine = self._to_target(mx.argmax(self.logits(out), axis=-1))
        finally:
            self._caches = live
        same = (mine == mx.argmax(logits[1:], axis=-1).astype(mx.uint32)).astype(mx.int32).sum().item()
        return int(same), len(ids) - 1

    # -- the chain ------------------------------------------------------------------------------
    def _to_target(self, index: mx.array) -> mx.array:
        token = index if self.vocab_ids is None else self.vocab_ids[index]
        return token.astype(mx.uint32)

    def propose(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        self._feed(ids)
        self._check_anchor(ids)
        cap = min(int(cap), self.max_draft)
        if cap <= 0 or self._seed is None:
            return None
        state, token = self._seed, None
        tokens, probs = [], []
        for k in range(cap):
            if k:
                state = self.run(token.reshape(1), self.chain_features(state)[None])[0]
            logits = self.logits(state)
            if sampler.greedy:
                index = mx.argmax(logits)
            else:
                q = sampler.probs(logits)
                probs.append(q)
                index = sample_from(q, sampler.next_key())
            token = self._to_target(index)
            tokens.append(token)
        for cache in self._caches:  # chain rows go (the count checked); the committed rows stay
            caches.trim(cache, cap - 1)
        return Draft(mx.stack(tokens), self._spread(probs))

    def _spread(self, probs: list[mx.array]) -> mx.array | None:
        return spread_to_vocab(mx.stack(probs), self.vocab_ids, self.target.vocab_size) if probs else None

    @staticmethod
    def propose_rows(requests: Sequence[tuple["ChainDrafter", Sequence[int], int, Sampler]]) -> list[Draft | None]:
        """``propose`` for several sequences whose drafters share one head (rows of a batch,
        ``engine/batch.py``): each chain step runs the head once over every row, its attention over
        a copy of each row's committed rows (mlx-lm's ``BatchKVCache.merge``, left-padded), and its
        logits once for every row. The chain rows live in that copy, which is dropped after; the
        rows' own caches are only read. Each row's draft is one ``propose`` could give it alone
        (the head's sums may differ in the last bits); a row samples with its own sampler, one key
        per slot it keeps, as alone."""
        caps = []
        for drafter, ids, cap, _ in requests:
            drafter._feed(ids)
            drafter._check_anchor(ids)
            caps.append(min(int(cap), drafter.max_draft) if drafter._seed is not None else 0)
        live = [b for b, cap in enumerate(caps) if cap > 0]
        out: list[Draft | None] = [None] * len(requests)
        if len(live) < 2:
            return propose_each(requests, live, out)
        drafters = [requests[b][0] for b in live]
        samplers = [requests[b][3] for b in live]
        width = max(caps[b] for b in live)
        head = drafters[0]
        merged = [BatchKVCache.merge([d._caches[i] for d in drafters]) for i in range(len(head._caches))]
        state = mx.stack([d._seed for d in drafters])
        tokens, probs = [], [[] for _ in live]
        for k in range(width):
            if k:
                state = head.run_rows(token[:, None], head.chain_features(state)[:, None], merged)[:, 0]
            picks = pick_rows(head.logits(state), samplers, [k < caps[b] for b in live], probs)
            token = head._to_target(picks)
            tokens.append(token)
        tokens = mx.stack(tokens, axis=1)
        for r, (b, drafter) in enumerate(zip(live, drafters)):
            out[b] = Draft(tokens[r, : caps[b]], drafter._spread(probs[r]))
        return out

    def _check_anchor(self, ids: Sequence[int]) -> None:
        if self._fed != len(ids) - 1 or self._pending is not None:
            raise RuntimeError(f"{self.name} drafter out of step: {self._fed} rows for an anchor at {len(ids) - 1}")
