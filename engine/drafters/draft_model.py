"""A small autoregressive draft model that shares the target's tokenizer.

The classic two-model setup (e.g. Qwen2.5-Coder-0.5B drafting for 1.5B). The draft model keeps
its own cache of committed tokens; each proposal feeds what it has not seen yet and then runs
``cap`` steps. Its drafts stay on the device as a lazy graph, so the target's verify forward is
queued behind them without a host round trip. Nothing is fed before the first proposal: a
request that ``--max-draft auto`` keeps parked never pays the draft model's prefill. A long
backlog (the prompt, a parked run) is fed by ``catch_up`` before the round, so the round is
timed on its own.

The draft steps write their rows into the draft model's cache. At the next proposal the rows of
rejected drafts go: full-attention caches trim them (checked); a draft model with sliding
windows or recurrent state (Gemma-3, Qwen3.5 as drafters) returns to the savepoint taken before
the proposal fed anything (engine/caches.py) and feeds those tokens again with the accepted
drafts and the new ones, one forward of a few rows.

Under a shape policy (engine/shapes.py, CUDA) the draft model's attention caches are
``StableKVCache`` buffers and what a proposal feeds goes in power-of-two pieces (after a parked
run that is hundreds of tokens): a backend that compiles a kernel per (rows, key rows) shape
then builds a few once (``warm_up``) instead of one on nearly every proposal.

Rows of a batch propose together (``propose_rows``): each forward runs once over every row that
needs it, through each row's own cache (``engine.batch_cache.batch_view``: full attention, a
shape policy's buffers, sliding windows, recurrent state), so the draft model's weights are read
once a step for the batch instead of once a row.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine import caches
from engine.batch_cache import batchable, run_rows
from engine.drafters.base import Draft, Drafter, DrafterState, propose_each
from engine.errors import TandemError
from engine.sampling import Sampler, pick_rows, sample_from
from engine.shapes import ShapePolicy, StableKVCache, pieces

FEED_CHUNK = 512  # rows fed per forward at most: bounded memory for a long prompt
CATCH_UP_MIN = 16  # a shorter backlog is fed with the proposal, in the same lazy graph (no sync)


class FeedPace:
    """The draft model's measured feeding pace (ms a token, averaged), one object shared by a
    drafter and its forks (a batch's rows), so what one row's catch-up took prices the others'."""

    def __init__(self) -> None:
        self.ms_per_token = 0.0  # 0: not measured yet

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        ms = 1000.0 * seconds / tokens
        self.ms_per_token = ms if self.ms_per_token == 0 else 0.7 * self.ms_per_token + 0.3 * ms


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

    def __init__(self, model: Any, max_draft: int = 4, shapes: ShapePolicy | None = None):
        self.model = model
        self.max_draft = max_draft
        self.shapes = shapes
        self._cache: list = []
        self._trims = True  # every layer of the draft model drops rows by trimming
        self._cached: list[int] = []  # tokens whose rows the draft cache holds, in order
        self._uncommitted = mx.array([], dtype=mx.uint32)  # drafts fed to the cache, not yet in _cached
        self._savepoint: caches.Savepoint | None = None  # before the last proposal fed its tokens
        self._saved = 0  # tokens the cache held at that savepoint
        self.pace = FeedPace()

    def speculation_blocker(self) -> str | None:
        reason = caches.blocker(make_prompt_cache(self.model))
        return None if reason is None else f"the draft model: {reason}"

    def begin(self, prompt_ids: Sequence[int], hidden: mx.array | None) -> None:
        self._reset()  # the prompt is fed at the first proposal, or by catch_up before it

    def _reset(self) -> None:
        self._cache = caches.stabilize(make_prompt_cache(self.model), self.shapes)
        reason = caches.blocker(self._cache)
        if reason is not None:
            raise TandemError(f"the draft model cannot draft: {reason}")
        self._trims = caches.trim_only(self._cache)
        self._cached = []
        self._savepoint = None
        self._uncommitted = mx.array([], dtype=mx.uint32)

    def _feed(self, tokens: list[int]) -> None:
        """Prefill these committed tokens after the cached ones, a chunk per sync (the anchor
        after them is fed with the proposal)."""
        t0 = time.perf_counter()
        for start in range(0, len(tokens), FEED_CHUNK):
            self._forward(tokens[start : start + FEED_CHUNK])
            mx.eval([c.state for c in self._cache])
        self.pace.add(len(tokens), time.perf_counter() - t0)
        self._cached = self._cached + tokens

    def _forward(self, tokens: list[int]) -> mx.array:
        """The draft model over ``tokens`` after its cache: the last row's logits. Under a shape
        policy in power-of-two pieces (``shapes.pieces``), queued lazily."""
        start = 0
        for size in pieces(len(tokens), self.shapes is not None, FEED_CHUNK):
            logits = self.model(mx.array([tokens[start : start + size]]), cache=self._cache)
            start += size
        return logits[0, -1]

    def warm_up(self, capacity: int) -> None:
        """Build, now, the kernels a proposal uses with the cache at ``capacity`` rows: a forward
        of each power-of-two width up to FEED_CHUNK (values do not matter, shapes do). Leaves no state."""
        self._reset()
        stable = [c for c in caches.leaves(self._cache) if isinstance(c, StableKVCache)]
        if not stable:  # no shape policy, or a draft model without full-attention layers
            return
        self.model(mx.zeros((1, 1), dtype=mx.uint32), cache=self._cache)
        for c in stable:
            c.reserve(capacity, (c.keys, c.values))
        width = 1
        while width <= FEED_CHUNK and width < capacity:
            mx.eval(self.model(mx.zeros((1, width), dtype=mx.uint32), cache=self._cache))
            for c in stable:  # windows and recurrent state are left to the reset below
                caches.trim(c, width)
            width *= 2
        self._reset()

    def catch_up(self, ids: Sequence[int]) -> int:
        """Feed, now, the committed tokens before the anchor that the cache lacks, when they are
        many (the prompt, a parked run): the loop times this apart from the round."""
        if not self._cache:
            return 0
        return self._feed_backlog(self._sync(ids), CATCH_UP_MIN)[0]

    def backlog_ms(self, ids: Sequence[int]) -> float:
        if not self._cache:
            return 0.0
        backlog = len(ids) - 1 - caches.common_prefix(self._cached, ids)
        return backlog * self.pace.ms_per_token if backlog >= CATCH_UP_MIN else 0.0  # a shorter one rides the round

    def _feed_backlog(self, pending: list[int], least: int) -> tuple[int, list[int]]:
        """Feed every pending token but the anchor now when they are ``least`` or more:
        (tokens fed, tokens still to feed)."""
        backlog = pending[:-1]
        if len(backlog) < least:
            return 0, pending
        self._feed(backlog)
        return len(backlog), pending[-1:]

    def state(self) -> DrafterState | None:
        if not self._cache or not self._cached or self._uncommitted.size:
            return None
        return DrafterState(len(self._cached), {"cache": caches.compact_snapshot(self._cache),
                                                "ids": mx.array(self._cached, dtype=mx.uint32)})

    def resume(self, prompt_ids: Sequence[int], cached: int, state: DrafterState | None,
               hidden: mx.array | None) -> None:
        if state is None:
            self.begin(prompt_ids, hidden)
            return
        self._reset()
        caches.restore(self._cache, state.tree["cache"])
        head = list(prompt_ids)[:-1]
        stored = [int(t) for t in state.tree["ids"].tolist()]
        keep = caches.common_prefix(stored, head)
        if not caches.trimmable_to(self._cache, keep):  # e.g. a recurrent draft model past its state
            self.begin(prompt_ids, hidden)
            return
        caches.trim_to(self._cache, keep)
        self._cached = stored[:keep]  # the rest of the prompt is fed later, as after begin

    def _sync(self, ids: Sequence[int]) -> list[int]:
        """Drop cached rows that are not a prefix of ``ids``; return the tokens still to feed."""
        if self._uncommitted.size:  # proposed again without a commit (calibration): the drafts are in
            self._cached += self._uncommitted.tolist()
            self._uncommitted = mx.array([], dtype=mx.uint32)
        keep = min(caches.common_prefix(self._cached, ids), len(ids) - 1)  # always feed at least the anchor
        if keep < len(self._cached):
            if self._trims:
                for c in caches.leaves(self._cache):
                    caches.trim(c, len(self._cached) - keep)
            elif self._savepoint is not None and keep >= self._saved:
                self._savepoint.rollback()  # everything the last proposal fed goes, and is fed again
                keep = self._saved
            else:
                raise caches.CacheError(f"draft cache holds {len(self._cached)} tokens, {keep} still valid, "
                                        f"and cannot go back past its savepoint at {self._saved}")
            self._cached = self._cached[:keep]
        self._savepoint = None
        return list(ids[keep:])

    def propose(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        cap = min(cap, self.max_draft)
        if cap <= 0:
            return None
        logits = self._forward(self._pending(ids))
        tokens, probs = [], []
        for i in range(cap):
            if sampler.greedy:
                tok = mx.argmax(logits, axis=-1)
            else:
                q = sampler.probs(logits)
                probs.append(q)
                tok = sample_from(q, sampler.next_key())
            tokens.append(tok)
            if i + 1 < cap:
                logits = self.model(tok.reshape(1, 1), cache=self._cache)[0, -1]
        return self._drafted(ids, Draft(mx.stack(tokens).astype(mx.uint32), mx.stack(probs) if probs else None))

    def _pending(self, ids: Sequence[int]) -> list[int]:
        """Before a proposal after ``ids``: the tokens it feeds first (the anchor and what the
        cache lacks). A backlog nobody caught up goes in bounded chunks now, not one graph; a
        cache that cannot trim takes its savepoint here."""
        _, pending = self._feed_backlog(self._sync(ids), FEED_CHUNK)
        if not self._trims:
            self._savepoint, self._saved = caches.Savepoint(self._cache), len(ids) - len(pending)
        return pending

    def _drafted(self, ids: Sequence[int], draft: Draft) -> Draft:
        """After a proposal: the cache also holds its drafts but the last; their values are read after verify."""
        self._cached = list(ids)
        self._uncommitted = draft.tokens[:-1]
        return draft

    @staticmethod
    def propose_rows(requests: Sequence[tuple["DraftModelDrafter", Sequence[int], int, Sampler]]) -> list[Draft | None]:
        """``propose`` for several rows of one draft model (a batch's): each forward runs once over
        the rows that need it, through each row's own cache. A row's pending tokens (its anchor
        and what was committed since its last proposal) go in the first forward
        (``_first_forward``); then one forward a draft over the rows still drafting. Each row
        ends as after its own ``propose`` (its cache's values may differ in the last bits) and
        samples with its own sampler, a key per draft, as alone."""
        drafting = [b for b, (drafter, _, cap, _) in enumerate(requests) if min(cap, drafter.max_draft) > 0]
        group = [b for b in drafting if _batches(requests[b][0]._cache)]
        out = propose_each(requests, [b for b in drafting if b not in group], [None] * len(requests))
        if len(group) < 2:
            return propose_each(requests, group, out)
        rows = [requests[b] for b in group]
        drafters = [d for d, _, _, _ in rows]
        caps = [min(cap, d.max_draft) for d, _, cap, _ in rows]
        logits = _first_forward(drafters, [d._pending(ids) for d, ids, _, _ in rows])
        tokens: list[list[mx.array]] = [[] for _ in rows]
        probs: list[list[mx.array]] = [[] for _ in rows]
        active = list(range(len(rows)))
        for i in range(max(caps)):
            picks = pick_rows(logits, [rows[r][3] for r in active], [True] * len(active), [probs[r] for r in active])
            for at, r in enumerate(active):
                tokens[r].append(picks[at])
            feeding = [at for at, r in enumerate(active) if i + 1 < caps[r]]  # a row feeds its first cap - 1 drafts
            if not feeding:
                break
            active = [active[at] for at in feeding]
            fed = picks[mx.array(feeding)] if len(feeding) < picks.shape[0] else picks
            logits = run_rows(drafters[0].model, fed.astype(mx.uint32)[:, None],
                              [drafters[r]._cache for r in active])[:, -1]
        for b, (d, ids, _, _), row_tokens, row_probs in zip(group, rows, tokens, probs):
            draft = Draft(mx.stack(row_tokens).astype(mx.uint32), mx.stack(row_probs) if row_probs else None)
            out[b] = d._drafted(ids, draft)
        return out

    def commit(self, ids: Sequence[int], n_new: int, hidden: mx.array | None) -> None:
        # Record the drafted rows so _sync keeps the accepted ones and trims the rest.
        self._cached += self._uncommitted.tolist()
        self._uncommitted = mx.array([], dtype=mx.uint32)


def _batches(cache: list) -> bool:
    """Whether a row's draft cache can share a forward with others'."""
    return bool(cache) and batchable(cache) is None


def _first_forward(drafters: Sequence[DraftModelDrafter], pending: list[list[int]]) -> mx.array:
    """Each row's pending tokens after its own cache: the logits [R, V] after its last. Rows go in
    one forward, right-padded to the longest (under a shape policy, to a power of two) inside a
    transaction per row that keeps its own tokens (``caches.Verify``: a trim, or a sliding
    window's rows cut). Recurrent state cannot drop padding without a recording of the forward,
    so a draft model that keeps it feeds one forward per pending length instead."""
    model = drafters[0].model
    caches_of = [d._cache for d in drafters]
    if caches.has_recurrent(caches_of[0]):
        out: list[mx.array | None] = [None] * len(drafters)
        for size in sorted({len(p) for p in pending}):
            rows = [r for r, p in enumerate(pending) if len(p) == size]
            start = 0
            for piece in pieces(size, drafters[0].shapes is not None, FEED_CHUNK):  # as ``_forward``
                ids = mx.array([pending[r][start : start + piece] for r in rows], dtype=mx.uint32)
                logits = run_rows(model, ids, [caches_of[r] for r in rows])
                start += piece
            for at, r in enumerate(rows):
                out[r] = logits[at, -1]
        return mx.stack(out)
    width = max(len(p) for p in pending)
    if drafters[0].shapes is not None:
        width = 1 << (width - 1).bit_length()  # a power of two: a known batch shape, not a new one
    txns = [caches.Verify(c, width) for c in caches_of]
    logits = run_rows(model, mx.array([p + p[-1:] * (width - len(p)) for p in pending], dtype=mx.uint32), caches_of)
    for txn, p in zip(txns, pending):  # the padding's rows go
        txn.commit(len(p))
    return mx.stack([logits[r, len(p) - 1] for r, p in enumerate(pending)])
