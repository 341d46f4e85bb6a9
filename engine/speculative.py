"""The verify loop: one loop for every mode (baseline, lookup, draft model, DSpark, DFlash).

Per round: the drafter proposes up to ``cap`` tokens after the anchor (the last committed token);
the target runs one forward over ``[anchor] + drafts`` and its own choice at each row decides
what is committed (greedy: the argmax; sampling: the speculative-sampling rule); the verify's
cache transaction (engine/caches.py) then keeps only the committed rows, so every layer's cache,
full attention, sliding window or recurrent state, is what a forward over the committed tokens
would have left. A round always commits at least one token.

With no drafter (baseline) or no proposal, a round is one plain target step. Baseline steps are
pipelined the way ``mlx_lm.generate`` does it: the next forward is queued before the current
token is read back, so the host never waits on the device between tokens.

A sequence may start from a ``Resume`` (a prefix cache hit: the target's caches already hold the
prompt's first tokens) and prefill only the rest. ``DecodeStats`` says at every yield which
tokens the target's caches hold, so the caller can keep them for the next prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import mlx.core as mx

from engine.drafters.base import Drafter, DrafterState
from engine.sampling import Sampler, accept_greedy, accept_sampled
from engine.target import Target


@dataclass
class RoundEvent:
    """What one round did; the app's telemetry and the server's /events subscribe to these."""

    index: int
    t: float  # seconds since decoding started, at the end of this round
    drafted: int  # tokens proposed (verified) this round
    accepted: int  # proposed tokens the target agreed with
    committed: int  # tokens emitted this round (accepted + the target's own, after stops)
    cap: int  # the draft cap in force
    context: int  # prompt + generated tokens after this round
    generated: int  # generated tokens so far
    draft_s: float = 0.0
    verify_s: float = 0.0
    mode: str = ""
    drafted_by: str = ""  # the drafter whose draft this round verified ("" when none): "lookup", "dspark", ...


class CapPolicy(Protocol):
    """Chooses how many drafts to verify each round. It can never change the output."""

    def cap(self) -> int: ...

    def observe(self, drafted: int, accepted: int, seconds: float) -> None: ...


@dataclass
class FixedCap:
    value: int

    def cap(self) -> int:
        return self.value

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        pass


@dataclass
class Resume:
    """Start after a restored prefix instead of token 0."""

    cache: list  # the target's caches holding the prompt's first ``cached`` tokens (the loop writes them)
    cached: int
    logits: mx.array | None = None  # the row after those tokens: needed when they are the whole prompt
    drafter_state: DrafterState | None = None  # for ``Drafter.resume``


@dataclass
class DecodeStats:
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per round
    target_forwards: int = 0
    finish_reason: str = "length"
    cached_tokens: int = 0  # prompt tokens restored instead of prefilled
    # What the target's caches hold at each yield: the first ``cache_len`` tokens of ``ids``
    # (prompt + committed). ``drafter_ready``: the drafter has seen the sequence (its state is this one's).
    ids: list[int] = field(default_factory=list)
    cache: list | None = None
    cache_len: int = 0
    prompt_logits: mx.array | None = None  # the row after the prompt
    drafter_ready: bool = False


def decode(
    target: Target,
    drafter: Drafter | None,
    prompt_ids: Sequence[int],
    sampler: Sampler,
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    cap_policy: CapPolicy | None = None,
    stats: DecodeStats | None = None,
    mode: str = "",
    prefill_progress: Callable[[int, int], None] | None = None,
    resume: Resume | None = None,
    on_prefill: Callable[[int, list], None] | None = None,
) -> Iterator[tuple[list[int], RoundEvent]]:
    """Yield (new token ids, round event) per round until EOS or ``max_new_tokens``.

    EOS is never yielded; a stop inside an accepted block truncates the block. The caller may
    stop iterating at any time (stop strings, cancel); nothing needs cleaning up.
    ``on_prefill(n, cache)``: called when the caches hold the prompt's first n tokens (after a
    restore, after each prefill chunk), before anything else is written to them.
    """
    stats = stats if stats is not None else DecodeStats()
    cap_policy = cap_policy or FixedCap(drafter.max_draft if drafter else 0)
    eos = set(int(e) for e in eos_ids)
    tap = bool(drafter and drafter.tap_layers)
    if tap:
        target.set_taps(drafter.tap_layers)
    forwards_at_start = target.forwards
    stats.prompt_tokens = len(prompt_ids)

    t0 = time.perf_counter()
    cached = resume.cached if resume is not None else 0
    cache = resume.cache if resume is not None else target.new_cache()
    stats.cache, stats.cached_tokens, stats.ids = cache, cached, list(prompt_ids)

    def prefilled(done: int, total: int) -> None:
        stats.cache_len = cached + done
        if on_prefill is not None:
            on_prefill(stats.cache_len, cache)
        if prefill_progress is not None:
            prefill_progress(done, total)

    prefilled(0, len(prompt_ids) - cached)
    if cached < len(prompt_ids):
        logits, hidden = target.prefill(prompt_ids[cached:], cache, tap=tap, progress=prefilled, offset=cached)
    else:  # the whole prompt was restored, with the row after it
        logits, hidden = resume.logits, None
    stats.prompt_logits = logits
    first = sampler.pick(logits)
    ids = stats.ids
    ids.append(first.item())
    stats.prefill_s = time.perf_counter() - t0
    t_start = time.perf_counter()
    generated = 0

    def emit(tokens: list[int], drafted: int, accepted: int, cap: int, draft_s=0.0, verify_s=0.0, drafted_by=""):
        """Apply EOS / length stops to a committed block; return (tokens, event, done)."""
        nonlocal generated
        done = False
        out = []
        for tok in tokens:
            if tok in eos:
                stats.finish_reason, done = "stop", True
                break
            out.append(tok)
            if generated + len(out) >= max_new_tokens:
                stats.finish_reason, done = "length", True
                break
        generated += len(out)
        stats.rounds.append((drafted, accepted))
        stats.target_forwards = target.forwards - forwards_at_start
        event = RoundEvent(len(stats.rounds) - 1, time.perf_counter() - t_start, drafted, accepted, len(out), cap,
                           len(prompt_ids) + generated, generated, draft_s, verify_s, mode, drafted_by)
        return out, event, done

    if max_new_tokens <= 0:
        return
    out, event, done = emit([ids[-1]], 0, 0, 0)
    yield out, event
    if done:
        return

    if drafter is None:
        yield from _pipelined_steps(target, cache, first, sampler, emit, stats)
        return

    if cached:
        drafter.resume(prompt_ids, cached, resume.drafter_state, hidden)
    else:
        drafter.begin(prompt_ids, hidden)
    stats.drafter_ready = True
    while True:
        remaining = max_new_tokens - generated
        cap = max(0, min(cap_policy.cap(), drafter.max_draft, remaining - 1))
        t_round = time.perf_counter()
        draft = drafter.propose(ids, cap, sampler) if cap > 0 else None
        if draft is not None and len(draft) > cap:
            draft.tokens = draft.tokens[:cap]
            draft.probs = None if draft.probs is None else draft.probs[:cap]
        k = len(draft) if draft is not None else 0
        anchor = mx.array([ids[-1]], dtype=mx.uint32)
        verify_ids = mx.concatenate([anchor, draft.tokens.astype(mx.uint32)]) if k else anchor
        t_verify = time.perf_counter()
        logits, hidden, txn = target.verify(verify_ids[None], cache, tap=tap)
        if sampler.greedy:
            n, committed = accept_greedy(verify_ids[1:], logits)
        else:
            n, committed = accept_sampled(verify_ids[1:], draft.probs if k else None, logits, sampler)
        txn.commit(n + 1)
        t_end = time.perf_counter()
        ids.extend(committed)
        stats.cache_len = len(ids) - 1  # all but the new anchor
        drafter.commit(ids, len(committed), hidden[: n + 1] if hidden is not None else None)
        cap_policy.observe(k, n, t_end - t_round)
        out, event, done = emit(committed, k, n, cap, t_verify - t_round, t_end - t_verify,
                                (draft.source or drafter.name) if k else "")
        yield out, event
        if done:
            return


def _pipelined_steps(target: Target, cache: list, first: mx.array, sampler: Sampler, emit,
                     stats: DecodeStats) -> Iterator:
    """Plain decoding with the next forward queued before the current token is read.
    ``first`` was already emitted by the caller; each step queues the forward after ``y``,
    so the caches hold every token read so far."""

    def queue_next(y: mx.array) -> mx.array:
        logits, _ = target.forward(y.reshape(1, 1).astype(mx.uint32), cache, last_only=True)
        nxt = sampler.pick(logits[-1])
        mx.async_eval(nxt)
        return nxt

    y = queue_next(first)
    stats.cache_len = len(stats.ids)  # ids ends with first
    while True:
        next_y = queue_next(y)
        token = y.item()
        stats.ids.append(token)
        stats.cache_len = len(stats.ids)
        out, event, done = emit([token], 0, 0, 0)
        yield out, event
        if done:
            return
        y = next_y
