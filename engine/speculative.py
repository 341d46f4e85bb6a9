"""The verify loop: one loop for every mode (baseline, lookup, draft model, DSpark, DFlash).

Per round: the drafter proposes up to ``cap`` tokens after the anchor (the last committed token);
the target runs one forward over ``[anchor] + drafts`` and its own choice at each row decides
what is committed (greedy: the argmax; sampling: the speculative-sampling rule); the verify's
cache transaction (engine/caches.py) then keeps only the committed rows, so every layer's cache,
full attention, sliding window or recurrent state, is what a forward over the committed tokens
would have left. A round always commits at least one token.

Plain steps (baseline, a parked ``--max-draft auto``, the last token) are pipelined the way
``mlx_lm.generate`` does it: the next forward is queued before the current token is read back,
so the host never waits on the device between tokens. The loop switches between runs of plain
steps and speculative rounds as the cap policy asks (``CapPolicy.plain_run``): a run ends on a
committed token that has not been fed to the target, exactly the state a round starts from.
A drafter that knows it has nothing to propose (``Drafter.draft_ready``: n-gram lookup with
no match) gets pipelined plain steps until it has, the policy told (``no_draft``); a round
whose drafter proposes nothing after all is one plain (unpipelined) step.

Under a shape policy (``engine/shapes.py``, CUDA) a verify is padded to the next ladder width
with filler rows after the drafts; their logits are never read and the verify's commit drops
their rows with the rejected drafts.

Round times (``CapPolicy.observe``) are wall time from one emitted round to the next, so a
plain step and a round are priced alike, including the consumer's share between them. A
drafter's catch-up before a round (``Drafter.catch_up``: a draft model feeding the prompt or a
parked run) is a one-off, not the round's cost: it is left out and told to the policy apart
(``observe_catch_up``), which counts it as the price of probing.

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
from engine.sampling import Sampler, accept_block
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
    logprobs: list | None = None  # per committed token (engine.processors.TokenLogprob), when the request asks


class CapPolicy(Protocol):
    """Chooses how many drafts to verify each round. It can never change the output.

    When ``cap()`` is 0 the loop takes ``plain_run()`` pipelined plain steps (a policy without
    the method gets one) and reports each to ``observe`` with ``drafted == 0``. While the
    policy's optional ``watch_cheap_drafts()`` says so, the run ends early when the drafter has
    a cheap draft ready (``Drafter.cheap_draft_ready``), telling the policy ``cheap_draft()``.
    When ``cap()`` is not 0 but the drafter has nothing to propose (``Drafter.draft_ready``),
    the loop tells the optional ``no_draft()`` and takes plain steps, observed as above, until
    the drafter has; then it asks ``cap()`` again.
    An optional ``observe_catch_up(seconds)`` hears of a drafter's catch-up before the round
    that ``observe`` reports next; an optional ``batch_rows(n)`` (engine/batch.py) hears, before
    each round, how many sequences share its forward, and an optional ``observe_ahead`` (same
    arguments as ``observe``) hears of a plain step read after ``cap()`` planned the round that
    follows it (the batch asks while that step is in flight); an optional ``context(n)`` hears,
    before each ``cap()``, how many tokens the sequence holds (prompt and output)."""

    def cap(self) -> int: ...

    def observe(self, drafted: int, accepted: int, seconds: float) -> None: ...


@dataclass
class FixedCap:
    value: int

    def cap(self) -> int:
        return self.value

    def plain_run(self) -> int:
        return PLAIN_FOREVER

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        pass


PLAIN_FOREVER = 1 << 40


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
    caps: list[int] = field(default_factory=list)  # the cap of each round (0: a plain step)
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
    clock: Callable[[], float] | None = None,
    resume: Resume | None = None,
    on_prefill: Callable[[int, list], None] | None = None,
    prefill_stops: Sequence[int] = (),
    prompt_embeddings: Callable[[int, int], mx.array | None] | None = None,
) -> Iterator[tuple[list[int], RoundEvent]]:
    """Yield (new token ids, round event) per round until EOS or ``max_new_tokens``.

    EOS is never yielded; a stop inside an accepted block truncates the block. The caller may
    stop iterating at any time (stop strings, cancel); nothing needs cleaning up. ``clock``:
    the time source for events and the cap policy (default ``time.perf_counter``; tests drive
    a cost model through it). ``on_prefill(n, cache)``: called when the caches hold the prompt's
    first n tokens (after a restore, after each prefill chunk), before anything else is written
    to them. ``prefill_stops``: prompt positions where a prefill chunk ends (and ``on_prefill``
    is called) besides the usual ones. ``prompt_embeddings``: an image prompt's input embeddings
    for its prefill (``Target.prompt_embeddings``).
    """
    clock = clock or time.perf_counter
    stats = stats if stats is not None else DecodeStats()
    cap_policy = cap_policy or FixedCap(drafter.max_draft if drafter else 0)
    eos = set(int(e) for e in eos_ids)
    tap = bool(drafter and drafter.tap_layers)
    if tap:
        target.set_taps(drafter.tap_layers)
    forwards_at_start = target.forwards
    stats.prompt_tokens = len(prompt_ids)

    t0 = clock()
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
        with target.prompt_embeddings(prompt_embeddings):
            logits, hidden = target.prefill(prompt_ids[cached:], cache, tap=tap, progress=prefilled, offset=cached,
                                            stops=[s - cached for s in prefill_stops])
    else:  # the whole prompt was restored, with the row after it
        logits, hidden = resume.logits, None
    stats.prompt_logits = logits
    ids = stats.ids
    row = sampler.process(logits, ids)
    first = sampler.pick(row)
    ids.append(first.item())
    stats.prefill_s = clock() - t0
    t_start = clock()
    generated = 0

    def emit(tokens: list[int], drafted: int, accepted: int, cap: int, draft_s=0.0, verify_s=0.0, drafted_by="",
             logprobs=None):
        """Apply EOS / length stops to a committed block; return (tokens, event, done)."""
        nonlocal generated
        out, reason = stop_block(tokens, eos, generated, max_new_tokens)
        done = reason is not None
        if done:
            stats.finish_reason = reason
        generated += len(out)
        stats.rounds.append((drafted, accepted))
        stats.caps.append(cap)
        stats.target_forwards = target.forwards - forwards_at_start
        event = RoundEvent(len(stats.rounds) - 1, clock() - t_start, drafted, accepted, len(out), cap,
                           len(prompt_ids) + generated, generated, draft_s, verify_s, mode, drafted_by,
                           None if logprobs is None else logprobs[: len(out)])
        return out, event, done

    if max_new_tokens <= 0:
        return
    out, event, done = emit([ids[-1]], 0, 0, 0, logprobs=sampler.logprobs(row, [ids[-1]]))
    yield out, event
    if done:
        return

    if drafter is None:
        for out, event, done, _ in _plain_run(target, cache, ids, sampler, PLAIN_FOREVER, False, emit, stats):
            yield out, event
            if done:
                return
        return  # unreachable: a plain run ends at a stop

    if cached:
        drafter.resume(prompt_ids, cached, resume.drafter_state, hidden)
    else:
        drafter.begin(prompt_ids, hidden)
    stats.drafter_ready = True
    t_last = clock()  # end of the last emitted round: rounds are timed emit to emit
    while True:
        remaining = max_new_tokens - generated
        _tell_context(cap_policy, len(ids))
        cap = max(0, min(cap_policy.cap(), drafter.max_draft, remaining - 1))
        if cap and not drafter.draft_ready(ids):  # nothing to propose (no n-gram match): plain steps until there is
            _tell_no_draft(cap_policy)
            cap, run, stop = 0, remaining, (lambda: drafter.draft_ready(ids))
        elif cap == 0:
            run = max(1, min(_plain_run_length(cap_policy), remaining))
            stop = _cheap_draft_stop(cap_policy, drafter, ids)
        if cap == 0:
            for out, event, done, hidden in _plain_run(target, cache, ids, sampler, run, tap, emit, stats, stop):
                drafter.commit(ids, 1, hidden)
                now = clock()
                cap_policy.observe(0, 0, now - t_last)
                t_last = now
                yield out, event
                if done:
                    return
            continue
        t_round = clock()
        if drafter.catch_up(ids):  # a one-off backlog (the prompt, a parked run): not the round's cost
            caught_up = clock() - t_round
            t_last += caught_up
            _tell_catch_up(cap_policy, caught_up)
            t_round = clock()
        draft = drafter.propose(ids, cap, sampler)
        if draft is not None and len(draft) > cap:
            draft.keep(cap)
        k = len(draft) if draft is not None else 0
        width = k + 1
        pad = target.verify_width(width) - width if k else 0  # filler rows: read nothing, dropped by the commit
        verify_ids = mx.array([ids[-1]], dtype=mx.uint32)
        if k:
            parts = [verify_ids, draft.tokens.astype(mx.uint32)]
            verify_ids = mx.concatenate(parts + ([mx.full((pad,), ids[-1], dtype=mx.uint32)] if pad else []))
        t_verify = clock()
        logits, hidden, txn = target.verify(verify_ids[None], cache, tap=tap)
        if pad:
            logits = logits[:width]
        drafts = verify_ids[1:width]
        n, committed, rows = accept_block(sampler, drafts, draft.probs if k else None, logits, ids)
        txn.commit(n + 1)
        logprobs = sampler.logprobs(rows[: n + 1], committed)
        t_end = clock()
        ids.extend(committed)
        stats.cache_len = len(ids) - 1  # all but the new anchor
        drafter.commit(ids, len(committed), hidden[: n + 1] if hidden is not None else None)
        out, event, done = emit(committed, k, n, cap, t_verify - t_round, t_end - t_verify,
                                (draft.source or drafter.name) if k else "", logprobs)
        now = clock()
        cap_policy.observe(k, n, now - t_last)
        t_last = now
        yield out, event
        if done:
            return


def stop_block(tokens: Sequence[int], eos: Sequence[int] | set[int], generated: int, max_new_tokens: int
               ) -> tuple[list[int], str | None]:
    """A committed block cut at EOS (not kept) or at the token budget: (tokens to emit, finish
    reason "stop" / "length", or None when the sequence goes on)."""
    out: list[int] = []
    for tok in tokens:
        if tok in eos:
            return out, "stop"
        out.append(tok)
        if generated + len(out) >= max_new_tokens:
            return out, "length"
    return out, None


def _tell_catch_up(policy: CapPolicy, seconds: float) -> None:
    told = getattr(policy, "observe_catch_up", None)
    if told is not None:
        told(seconds)


def _tell_context(policy: CapPolicy, tokens: int) -> None:
    told = getattr(policy, "context", None)
    if told is not None:
        told(tokens)


def _tell_no_draft(policy: CapPolicy) -> None:
    told = getattr(policy, "no_draft", None)
    if told is not None:
        told()


def _plain_run_length(policy: CapPolicy) -> int:
    run = getattr(policy, "plain_run", None)
    return int(run()) if run is not None else 1


def _cheap_draft_stop(policy: CapPolicy, drafter: Drafter, ids: list[int]) -> Callable[[], bool] | None:
    """For a plain run: a check that ends it early when the policy is watching and a cheap draft
    is ready (and tells the policy), or None for a policy that never watches. Asked at every
    step: a policy may start watching in the middle of a long parked run."""
    watching = getattr(policy, "watch_cheap_drafts", None)
    if watching is None:
        return None

    def stop() -> bool:
        if watching() and drafter.cheap_draft_ready(ids):
            policy.cheap_draft()
            return True
        return False

    return stop


def _plain_run(target: Target, cache: list, ids: list[int], sampler: Sampler, n: int, tap: bool, emit,
               stats: DecodeStats, stop: Callable[[], bool] | None = None) -> Iterator:
    """``n`` plain target steps from the anchor ``ids[-1]``, each forward queued before the
    previous token is read back. Appends each token to ``ids`` and yields (tokens, event, done,
    tapped row of the token fed before it). The last token is not fed: it is the next anchor.
    ``stop()``, asked before each next forward is queued (on ``ids`` without the token in
    flight), ends the run after that token instead.
    ``stats.cache_len`` follows what the caches hold: a queued forward has fed the yielded token."""

    def queue(token: mx.array, in_flight: bool) -> tuple:
        logits, hidden = target.forward(token.reshape(1, 1).astype(mx.uint32), cache, last_only=True, tap=tap)
        row = sampler.process(logits[-1], ids, token if in_flight else None)  # after ids (+ the token in flight)
        nxt = sampler.pick(row)
        mx.async_eval(nxt, *([hidden] if hidden is not None else []), *([row] if sampler.wants_logprobs else []))
        return nxt, hidden, row

    y, hidden, row = queue(mx.array(ids[-1]), False)
    for i in range(n):
        following = queue(y, True) if i + 1 < n and not (stop is not None and stop()) else None
        ids.append(y.item())
        stats.cache_len = len(ids) if following is not None else len(ids) - 1  # a queued forward fed y
        out, event, done = emit([ids[-1]], 0, 0, 0, logprobs=sampler.logprobs(row, [ids[-1]]))
        yield out, event, done, hidden
        if done or following is None:
            return
        y, hidden, row = following
