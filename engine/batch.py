"""The batched verify loop: several sequences share each target forward, each speculating on its own.

``decode`` (engine/speculative.py) runs one sequence; ``BatchLoop`` runs up to ``max_batch`` of
them with the same rules per row. A tick is:

1. **A prefill slice** of the oldest sequence still prefilling: one chunk (boundaries where
   ``Target.prefill`` puts them, ``prefill_bounds``, so a row's caches are what a lone prefill
   leaves), and more while they fit in ``PREFILL_SLICE_S``. Rows already decoding, and requests
   arriving, wait for one chunk or the slice, whichever is longer, never a whole prompt. Where a
   chunk takes longer than the slice (a CPU, a large model) that is one chunk a tick; where
   chunks are quick (a GPU), a long prompt joins the batch in a few ticks instead of one round
   per chunk, while the rows before it decode narrow.
2. **One round for every decoding row** in one target forward: each row asks its own cap policy,
   its own drafter proposes (drafters run per row; their state is per row), and the verify carries
   each row's ``[anchor] + drafts``, padded to the widest with filler rows that are never
   committed. Each row accepts by its own sampler and commits through its own cache transaction,
   so its caches end as a lone sequence's would (engine/batch_cache.py).

A row's tokens, stops and events are what ``decode`` yields for it; a finished, cancelled or
stopped row leaves at once and the next tick admits whoever waits. On the CPU backend a row's
arithmetic does not depend on the other rows, so greedy and seeded output equal a lone run's
(tests/test_batch.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx

from engine.drafters.base import Drafter
from engine.sampling import Sampler, accept_block
from engine.slot_kv import Slots
from engine.speculative import (
    CapPolicy,
    DecodeStats,
    FixedCap,
    Resume,
    RoundEvent,
    _cheap_draft_stop,
    _plain_run_length,
    _tell_catch_up,
    _tell_context,
    _tell_no_draft,
    stop_block,
)
from engine.target import Target, prefill_bounds


CUT_RUN = 4  # plain steps a row takes after the batch cut all of its drafts, before it drafts again
MAX_CUT_RUN = 64  # ... doubled at each cut to nothing in a row, up to this
CATCH_UP_HORIZON = 16  # tokens a row's catch-up is spread over at least (see _catch_ups)
PREFILL_SLICE_S = 0.03  # a tick's prefill beyond its first chunk: what decoding rows may wait for a newcomer


@dataclass(eq=False)  # a row is itself: membership tests compare identities
class BatchRow:
    """One sequence of a batch: its plan (sampler, drafter, cap policy) and its state."""

    prompt_ids: list[int]
    sampler: Sampler
    max_new_tokens: int
    drafter: Drafter | None = None  # this row's own (``Drafter.fork``)
    cap_policy: CapPolicy | None = None
    eos_ids: Sequence[int] = ()
    mode: str = ""
    resume: Resume | None = None
    on_prefill: Callable[[int, list], None] | None = None
    on_start: Callable[["BatchRow"], None] | None = None  # at its first prefill chunk: may set resume, on_prefill, prefill_stops
    on_prompt: Callable[["BatchRow"], None] | None = None  # once its prompt is in its caches (and drafter), if any was prefilled
    embeddings: Callable[[int, int], mx.array | None] | None = None  # an image prompt's (Target.prompt_embeddings)
    prefill_stops: Sequence[int] = ()  # prompt positions where a prefill chunk must end (prefix-cache marks)
    stats: DecodeStats = field(default_factory=DecodeStats)
    key: object = None  # the caller's handle (a request)
    # state
    cache: list | None = None
    prefilled: int = 0  # prompt tokens the caches hold
    hidden_parts: list = field(default_factory=list)
    generated: int = 0
    done: bool = False
    run_left: int = 0  # plain steps left in the current run (decode's _plain_run)
    run_stop: Callable[[], bool] | None = None  # ends the run early (a draft is ready)
    forwards: int = 0
    waited_for_taps: bool = False  # it waited for rows whose drafter reads other target layers
    slotted: bool = False  # its full-attention caches are in the batch's buffers (engine/slot_kv.py)
    planned: int | None = None  # its next round's cap, asked early (while a plain step was in flight)
    cuts: int = 0  # rounds in a row whose drafts the batch cut to nothing
    cut_width: int = 0  # the batch's width at the last of them (its plain run ends when that changes)
    t_start: float = 0.0
    t_last: float = 0.0

    @property
    def decoding(self) -> bool:
        return not self.done and self.cache is not None and self.prefilled >= len(self.prompt_ids)

    @property
    def tap(self) -> bool:
        return bool(self.drafter and self.drafter.tap_layers)


@dataclass
class Emitted:
    """What one tick gave one row: new tokens (EOS and past-budget tokens cut) and the event."""

    row: BatchRow
    tokens: list[int]
    event: RoundEvent
    done: bool


@dataclass
class _Flight:
    """A round of plain steps whose forward is queued: the next tokens are lazy, so the next
    round can be queued on them before they are read (``decode``'s pipelined plain steps)."""

    rows: list[BatchRow]
    picks: list[mx.array]  # per row, its next token (lazy)
    processed: list[mx.array]  # per row, the row its token was picked from (logprobs)
    hidden: mx.array | None  # [rows, 1, taps] for rows whose drafter reads target layers
    t_issue: float


class BatchLoop:
    """Up to ``max_batch`` sequences decoding together on one target (one thread owns it)."""

    def __init__(self, target: Target, *, max_batch: int = 4, clock: Callable[[], float] | None = None,
                 prefill_slice_s: float | None = None):
        self.target = target
        self.max_batch = max(1, int(max_batch))
        self.prefill_slice_s = PREFILL_SLICE_S if prefill_slice_s is None else prefill_slice_s
        self.clock = clock or time.perf_counter
        self.rows: list[BatchRow] = []  # admitted: prefilling or decoding, in arrival order
        self.waiting: list[BatchRow] = []
        self.last_width = 0  # rows in the last tick's round (0: it ran only a prefill chunk)
        self.slots = Slots()  # decoding rows' full-attention keys and values, one buffer per layer
        self._flight: _Flight | None = None  # a round of plain steps queued before the last one was read
        self._round_owed = False  # a prompt's last chunk ended the last tick: this one is a round
        self._plain_last = False  # the last round was plain steps: a drafting one now empties the pipeline

    # -- membership ---------------------------------------------------------------------
    def add(self, row: BatchRow) -> BatchRow:
        row.cap_policy = row.cap_policy or FixedCap(row.drafter.max_draft if row.drafter else 0)
        _tell(row.cap_policy, "detach")  # learns on its own copy beside the other rows
        row.stats.prompt_tokens = len(row.prompt_ids)
        self.waiting.append(row)
        self._admit()
        return row

    def remove(self, row: BatchRow) -> None:
        """Take a row out now (finished, cancelled, stopped by its caller)."""
        row.done = True
        for group in (self.rows, self.waiting):
            if row in group:
                group.remove(row)
        if row.slotted:  # its own caches back, for whoever keeps them (the prefix cache, the stats)
            self.slots.leave(row.cache)
            row.slotted = False
        if not self.rows:  # a step queued for rows that all left: nobody reads it
            self._flight = None
        _tell(row.cap_policy, "rejoin")
        self._admit()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def occupancy(self) -> int:
        return len(self.rows)

    def _admit(self) -> None:
        """Admit waiting rows in arrival order while there is room. A row whose drafter taps other
        target layers than a running row's waits until those have left (one forward taps one set)."""
        while self.waiting and len(self.rows) < self.max_batch:
            row = self.waiting[0]
            if row.tap and any(r.tap and r.drafter.tap_layers != row.drafter.tap_layers for r in self.rows):
                row.waited_for_taps = True
                return
            self.waiting.pop(0)
            if row.tap:
                self.target.set_taps(row.drafter.tap_layers)
            self.rows.append(row)

    # -- one tick -------------------------------------------------------------------------
    def step(self) -> list[Emitted]:
        """One prefill chunk (if a row is prefilling), then one round for every decoding row. A
        chunk that ends a prompt ends the tick, so its first token goes out before the others'
        round, which the next tick runs before any other chunk."""
        self.last_width = 0
        prefilling = [r for r in self.rows if not r.done and not r.decoding]
        if prefilling and not self._round_owed:  # decoding rows wait one chunk or the slice at most
            first = self._prefill_slice(prefilling[0])
            if first is not None:
                if first.done:
                    self.remove(first.row)
                self._round_owed = any(r.decoding for r in self.rows)
                return [first]
        self._round_owed = False
        decoding = [r for r in self.rows if r.decoding]
        out = self._round(decoding) if decoding else []
        for e in out:
            if e.done:
                self.remove(e.row)
        return out

    def _prefill_slice(self, row: BatchRow) -> Emitted | None:
        """``row``'s next chunk, and the ones after it while the next (timed as the last) still
        ends within the slice; the row's first token once its prompt is in."""
        start = self.clock()
        while True:
            began = self.clock()
            first = self._prefill_chunk(row)  # synchronous: its caches are evaluated
            now = self.clock()
            if first is not None or (now - start) + (now - began) > self.prefill_slice_s:
                return first

    def _prefill_chunk(self, row: BatchRow) -> Emitted | None:
        target, stats = self.target, row.stats
        if row.cache is None:
            row.t_start = self.clock()
            if row.on_start is not None:  # asked now, when the rows before it have prefilled
                row.on_start(row)
            row.prefilled = row.resume.cached if row.resume is not None else 0
            row.cache = row.resume.cache if row.resume is not None else target.new_cache()
            stats.cache, stats.cached_tokens, stats.ids = row.cache, row.prefilled, list(row.prompt_ids)
            self._prefilled(row)
        n = len(row.prompt_ids)
        if row.prefilled < n:
            done = row.prefilled
            end = done + prefill_bounds(n - done, done, [stop - done for stop in row.prefill_stops])[1]  # one chunk
            with target.prompt_embeddings(row.embeddings):
                logits, hidden = target.prefill(row.prompt_ids[row.prefilled:end], row.cache, tap=row.tap,
                                                offset=row.prefilled)
            if hidden is not None:
                row.hidden_parts.append(hidden)
            row.prefilled = end
            row.forwards += 1
            self._prefilled(row)
            if end < n:
                return None
        else:  # the whole prompt was restored, with the row after it
            logits = row.resume.logits
        stats.prompt_logits = logits
        processed = row.sampler.process(logits, stats.ids)
        stats.ids.append(row.sampler.pick(processed).item())
        stats.prefill_s = self.clock() - row.t_start
        hidden = mx.concatenate(row.hidden_parts, axis=0) if row.hidden_parts else None
        row.hidden_parts = []
        if row.drafter is not None:
            if row.resume is not None and row.resume.cached:
                row.drafter.resume(row.prompt_ids, row.resume.cached, row.resume.drafter_state, hidden)
            else:
                row.drafter.begin(row.prompt_ids, hidden)
            stats.drafter_ready = True
        if row.on_prompt is not None and (row.resume is None or row.resume.cached < n):
            row.on_prompt(row)  # the prompt's state, for a row beside it with the same opening
        row.t_start = row.t_last = self.clock()
        return self._emit(row, [stats.ids[-1]], 0, 0, 0, logprobs=row.sampler.logprobs(processed, [stats.ids[-1]]))

    def _prefilled(self, row: BatchRow) -> None:
        row.stats.cache_len = row.prefilled
        if row.on_prefill is not None:
            row.on_prefill(row.prefilled, row.cache)

    def _round(self, rows: list[BatchRow]) -> list[Emitted]:
        t_round = self.clock()
        for row in rows:
            if not row.slotted:
                self.slots.join(row.cache)
                row.slotted = True
        if self._flight is not None:  # queued last tick: this tick reads it (unless all its rows left)
            flight, self._flight = self._flight, None
            if any(r in rows for r in flight.rows):
                return self._land(flight, rows)
        for row in rows:  # the cap policy prices this round at the batch's width
            told = getattr(row.cap_policy, "batch_rows", None)
            if told is not None:
                told(len(rows))
            if row.cut_width and row.cut_width != len(rows):  # cut at another width: ask again now
                row.run_left = row.cuts = row.cut_width = 0
        caps = _uncut([self._propose(row) for row in rows], rows, self._plain_last)
        if not any(caps):  # every row takes a plain step: queued, and the next one queued on it
            return self._plain(rows)
        plans = self._drafts(rows, caps)
        judge = _judge(rows)
        width = batch_width(rows, plans, judge)
        plans = [_trimmed(row, plan, width - 1, len(rows)) for row, plan in zip(rows, plans)]
        if width == 1:  # nothing drafted, or all of it cut: plain steps, queued (the next may chain on them)
            return self._plain(rows)
        width = self.target.verify_width(width)
        plans = [_filled(row, plan, width - 1) for row, plan in zip(rows, plans)]
        verify = mx.array([[row.stats.ids[-1]] + d + [row.stats.ids[-1]] * (width - 1 - len(d))
                           for row, (_, d, _) in zip(rows, plans)], dtype=mx.uint32)
        t_verify = self.clock()
        logits, hidden, txns = self._verify(rows, verify)
        self.last_width, self._plain_last = len(rows), False
        out = []
        for b, (row, (cap, drafts, draft), txn) in enumerate(zip(rows, plans, txns)):
            k, ids = len(drafts), row.stats.ids
            n, committed, rows_k = accept_block(row.sampler, verify[b, 1 : k + 1], draft.probs if k else None,
                                                logits[b, : k + 1], ids)
            txn.commit(n + 1)
            logprobs = row.sampler.logprobs(rows_k[: n + 1], committed)
            row.forwards += 1
            ids.extend(committed)
            row.stats.cache_len = len(ids) - 1
            if row.drafter is not None:
                row_hidden = hidden[b, : n + 1] if hidden is not None and row.tap else None
                row.drafter.commit(ids, len(committed), row_hidden)
            t_end = self.clock()
            source = (draft.source or row.drafter.name) if k else ""
            out.append(self._emit(row, committed, k, n, cap, t_verify - t_round, t_end - t_verify, source, logprobs))
            now = self.clock()
            # priced at the row's own width: the rest of a wider forward is the others' cost. A
            # row whose padding carried free drafts took the plain step its policy planned
            drafted, kept = (k, n) if cap else (0, 0)
            share = 1.0
            if judge is not None and drafted + 1 < width:
                share = judge.round_ms(drafted + 1) / judge.round_ms(width)
            row.cap_policy.observe(drafted, kept, (now - row.t_last) * share)
            row.t_last = now
        return out

    def _plain(self, rows: list[BatchRow]) -> list[Emitted]:
        """A plain step of every row from its last token, queued, the next one queued on it where it chains."""
        return self._land(self._queue(rows, [mx.array(row.stats.ids[-1]) for row in rows], False), rows)

    def _verify(self, rows: list[BatchRow], ids: mx.array) -> tuple[mx.array, mx.array | None, list]:
        """One forward of ``ids`` [rows, width] over the rows' caches, tapped where a row's drafter
        reads target layers: (logits, hidden, one transaction per row), rows first."""
        tap = any(r.tap for r in rows)
        if len(rows) == 1:  # a lone row runs the one-sequence verify (any cache kind, recurrent too)
            logits, hidden, txn = self.target.verify(ids, rows[0].cache, tap=tap)
            return logits[None], None if hidden is None else hidden[None], [txn]
        return self.target.verify_rows(ids, [r.cache for r in rows], tap=tap)

    def _queue(self, rows: list[BatchRow], anchors: list[mx.array], in_flight: bool) -> _Flight:
        """Queue one plain step for every row from ``anchors`` (lazy when ``in_flight``: the tokens
        of the round still in flight, not yet in ``ids``), and the picks of its tokens."""
        logits, hidden, txns = self._verify(rows, mx.stack(anchors).reshape(len(rows), 1).astype(mx.uint32))
        for txn in txns:  # a plain step keeps its row; recurrent state takes it now, before the next queues
            txn.commit(1)
        processed = [row.sampler.process(logits[b, -1], row.stats.ids, anchors[b] if in_flight else None)
                     for b, row in enumerate(rows)]
        picks = [row.sampler.pick(p) for row, p in zip(rows, processed)]
        wanted = [p for row, p in zip(rows, processed) if row.sampler.wants_logprobs]
        mx.async_eval(*picks, *([hidden] if hidden is not None else []), *wanted)
        return _Flight(list(rows), picks, processed, hidden, self.clock())

    def _chains(self, flight: _Flight, rows: list[BatchRow]) -> bool:
        """Whether the next round can be queued before this one's tokens are read: the same rows,
        each taking a plain step next. Each row's next plan is asked now (``_propose``), its
        token in flight not yet in ``ids``, as ``decode`` asks whether a run goes on; a row whose
        run ends asks its cap policy now too, unless it is seeded (its caps, and so its sample,
        follow ``decode``'s order: asked after the last token is read). A row that will draft
        keeps the plans asked (``planned``; its policy hears of the step in flight as a plain
        step read after the plan, ``_land``) and the round is not queued. Nor is it while a
        request prefills or waits for a free row: its first token waits for one round at most."""
        if flight.rows != rows or any(r.drafter is not None and r.run_left == 0 and r.sampler.params.seed is not None
                                      for r in rows):
            return False
        if any(not r.decoding for r in self.rows) or (self.waiting and len(self.rows) < self.max_batch):
            return False  # a request is about to prefill: its chunk waits for the step in flight only
        caps = _uncut([self._propose(row) for row in rows], rows, after_plain=True)
        if any(caps):
            for row, cap in zip(rows, caps):
                row.planned = cap
            return False
        return True

    def _land(self, flight: _Flight, rows: list[BatchRow]) -> list[Emitted]:
        """Read a queued round's tokens (queuing the next round first where it chains) and emit
        them. A row that left while its step was in flight is skipped: the token it fed is one
        it had emitted, so its caches hold its sequence (``stats.cache_len`` says how much)."""
        if self._chains(flight, rows):
            self._flight = self._queue(rows, flight.picks, True)
        fed_next = self._flight.rows if self._flight is not None else []
        self.last_width, self._plain_last = len(flight.rows), True
        out = []
        for b, row in enumerate(flight.rows):
            if row.done or row not in rows:
                continue
            ids = row.stats.ids
            ids.append(flight.picks[b].item())
            row.forwards += 1
            row.stats.cache_len = len(ids) if row in fed_next else len(ids) - 1
            if row.drafter is not None:
                row.drafter.commit(ids, 1, flight.hidden[b, :1] if flight.hidden is not None and row.tap else None)
            logprobs = row.sampler.logprobs(flight.processed[b], [ids[-1]])
            out.append(self._emit(row, [ids[-1]], 0, 0, 0, 0.0, self.clock() - flight.t_issue, "", logprobs))
            now = self.clock()
            observe = row.cap_policy.observe
            if row.planned:  # its policy planned the round after this step while it was in flight
                observe = getattr(row.cap_policy, "observe_ahead", observe)
            observe(0, 0, now - row.t_last)
            row.t_last = now
        return out

    def _propose(self, row: BatchRow) -> int:
        """This row's cap for its next round; 0: a plain step.

        Runs of plain steps follow ``decode``'s schedule step for step (a parked policy's
        ``plain_run``, plain steps until the drafter has a draft), so a seeded row draws the
        same random numbers as alone: whether a run goes on is asked before each step's token is
        known, as ``decode`` asks it before queuing the next pipelined forward."""
        if row.planned is not None:  # asked already, while the step before was in flight
            cap, row.planned = row.planned, None
            return cap
        drafter, policy = row.drafter, row.cap_policy
        if drafter is None:
            return 0
        ids = row.stats.ids
        remaining = row.max_new_tokens - row.generated
        if row.run_left == 0:
            _tell_context(policy, len(ids))
            cap = max(0, min(policy.cap(), drafter.max_draft, remaining - 1))
            if cap and not drafter.draft_ready(ids):  # nothing to propose: plain steps until there is
                _tell_no_draft(policy)
                row.run_left, row.run_stop = remaining, (lambda: drafter.draft_ready(ids))
            elif cap == 0:
                row.run_left = max(1, min(_plain_run_length(policy), remaining))
                row.run_stop = _cheap_draft_stop(policy, drafter, ids)
            else:
                return cap
        row.run_left -= 1
        if row.run_left > 0 and row.run_stop is not None and row.run_stop():
            row.run_left = 0
        return 0

    def _drafts(self, rows: list[BatchRow], caps: list[int]) -> list[tuple[int, list[int], object]]:
        """(cap, draft tokens, Draft) per row; no tokens: a plain step. Rows whose drafters share
        one model and can propose together (``propose_rows``: one head forward for all of them)
        do; a seeded row proposes alone, so its drafts, and its sample, are those it gets alone."""
        proposals: dict[int, object] = {}
        together: dict[tuple, list[int]] = {}
        caught_up = sum(self._catch_up(row) for row, cap in zip(rows, caps) if cap)
        for row in rows:  # a one-off backlog: not this round's cost, to any row that waited for it
            row.t_last += caught_up
        for b, (row, cap) in enumerate(zip(rows, caps)):
            if not cap:
                continue
            drafter = row.drafter
            if hasattr(drafter, "propose_rows") and row.sampler.params.seed is None:
                together.setdefault((type(drafter), id(getattr(drafter, "model", None))), []).append(b)
            else:
                proposals[b] = drafter.propose(row.stats.ids, cap, row.sampler)
        for group in together.values():
            drafter = rows[group[0]].drafter
            made = drafter.propose_rows([(rows[b].drafter, rows[b].stats.ids, caps[b], rows[b].sampler) for b in group])
            proposals.update(zip(group, made))
        plans = []
        for b, cap in enumerate(caps):
            draft = proposals.get(b)
            if draft is None or len(draft) == 0:
                plans.append((cap, [], None))
                continue
            if len(draft) > cap:
                draft.keep(cap)
            plans.append((cap, draft.tokens.tolist(), draft))
        return plans

    def _catch_up(self, row: BatchRow) -> float:
        """The row's drafter's catch-up, done now: its seconds (0: nothing to feed), told to its policy."""
        t0 = self.clock()
        if not row.drafter.catch_up(row.stats.ids):
            return 0.0
        caught_up = self.clock() - t0
        _tell_catch_up(row.cap_policy, caught_up)
        return caught_up

    def _emit(self, row: BatchRow, tokens: list[int], drafted: int, accepted: int, cap: int,
              draft_s: float = 0.0, verify_s: float = 0.0, drafted_by: str = "", logprobs: list | None = None
              ) -> Emitted:
        stats = row.stats
        out, reason = stop_block(tokens, row.eos_ids, row.generated, row.max_new_tokens)
        if reason is not None:
            stats.finish_reason = reason
        row.generated += len(out)
        stats.rounds.append((drafted, accepted))
        stats.caps.append(cap)
        stats.target_forwards = row.forwards
        event = RoundEvent(len(stats.rounds) - 1, self.clock() - row.t_start, drafted, accepted, len(out), cap,
                           len(row.prompt_ids) + row.generated, row.generated, draft_s, verify_s, row.mode,
                           drafted_by, None if logprobs is None else logprobs[: len(out)])
        return Emitted(row, out, event, reason is not None)


def _filled(row: BatchRow, plan: tuple[int, list[int], object], room: int) -> tuple[int, list[int], object]:
    """``plan``, or for a row that drafts nothing this round (a plain run, a cut, a parked policy)
    a free draft (``Drafter.free_draft``: an n-gram match) in the ``room`` the round's width gives
    its padding anyway, with cap 0: its policy planned a plain step. Not a seeded row: its draws
    follow the schedule it has alone."""
    room = min(room, row.max_new_tokens - row.generated - 1)
    if plan[1] or room <= 0 or row.drafter is None or row.sampler.params.seed is not None:
        return plan
    draft = row.drafter.free_draft(row.stats.ids, room, row.sampler)
    if draft is None or len(draft) == 0:
        return plan
    if len(draft) > room:
        draft.keep(room)
    return 0, draft.tokens.tolist(), draft


def _judge(rows: Sequence[BatchRow]) -> object | None:
    """The cap controller that prices this batch's forwards (``batch_width``), if a row has one."""
    return next((r.cap_policy for r in rows if hasattr(r.cap_policy, "round_ms")), None)


def _uncut(caps: list[int], rows: Sequence[BatchRow], after_plain: bool = False) -> list[int]:
    """``caps``, or all 0 where drafting does not pay the batch: where the rounds the caps
    promise (each row's acceptance, and how far its drafter tends to reach), verified at the best
    width with the draft's cost (and, ``after_plain``, the pipeline of queued plain steps the
    round empties: ``refill_ms``), commit fewer tokens a ms than a plain step of every row
    (queued, without a round's overhead), nobody drafts (a draft forward saved, and plain steps
    stay queued). A row whose drafts may not be cut (a seeded request, a probe, a fixed cap) drafts."""
    judge = _judge(rows)
    if not any(caps) or judge is None or len(rows) == 1:
        return caps
    if any(cap and not _may_trim(r.cap_policy) for r, cap in zip(rows, caps)):
        return caps
    cost = judge.corrected()
    # the step as calibrated at this width, or as timed live where that ran faster: a row's live
    # plain steps also hold the ticks in which other rows prefilled
    plain = len(rows) / min(cost.plain_step_ms(), judge.cal.plain_step_ms())
    refill = judge.refill_ms() if after_plain else 0.0
    worths = _worths(rows, judge, before=True)
    once = _catch_ups(rows, caps, worths)
    best = max(sum(_worth(t, min(cap, w - 1)) for t, cap in zip(worths, caps))
               / (cost.verify(w) + cost.draft(w - 1) + refill + once) for w in range(2, max(caps) + 2))
    if best > plain:
        return caps
    return [_trimmed(row, (cap, [0] * cap, None), 0, len(rows))[0] for row, cap in zip(rows, caps)]


def _catch_ups(rows: Sequence[BatchRow], caps: list[int], worths: list[list[float]]) -> float:
    """What the drafting rows' catch-ups (a draft model feeding the prompt, or the run of plain
    steps the batch cut it to) add to this round, each spread over the rounds left to pay it
    back: its tokens still to come, guessed as many as it generated so far (at least
    CATCH_UP_HORIZON, at most its budget), at what a round of its cap commits. A row near its
    end does not start a draft model on a backlog of a thousand tokens for one more token."""
    total = 0.0
    for row, cap, table in zip(rows, caps, worths):
        drafter = getattr(row, "drafter", None)
        ms = drafter.backlog_ms(row.stats.ids) if cap and drafter is not None else 0.0
        if ms > 0:
            left = min(row.max_new_tokens - row.generated, max(row.generated, CATCH_UP_HORIZON))
            total += ms * _worth(table, cap) / max(1, left)
    return total


def _worths(rows: Sequence[BatchRow], judge: object, before: bool = False) -> list[list[float]]:
    """Per row, the tokens a round verifying k of its drafts commits (k = 0, 1, ...), by the row's
    own controller (the judge's for a row without one); ``before`` the drafts are made: at cap
    k, where a draft may stop short of it."""
    return [(r.cap_policy if hasattr(r.cap_policy, "expected_table") else judge).expected_table(before)
            for r in rows]


def _worth(table: list[float], k: int) -> float:
    return table[min(k, len(table) - 1)]


def batch_width(rows: Sequence[BatchRow], plans: Sequence[tuple[int, list[int], object]], judge: object | None) -> int:
    """The verify width of one round. Every row of the forward pays the widest row's width, so
    the drafts are cut where the whole batch expects the most tokens per ms (``judge``: a cap
    controller at this batch's width prices the forward; each row's own controller says what
    its first k drafts are worth). A row whose drafts may not be cut (a seeded request, a
    parked request's probe, a fixed cap) sets the least width. Without a judge: the widest."""
    widest = max(len(d) for _, d, _ in plans) + 1
    if widest == 1 or len(rows) == 1 or judge is None:
        return widest
    least = max([1] + [len(d) + 1 for r, (_, d, _) in zip(rows, plans) if d and not _may_trim(r.cap_policy)])
    if least == widest:
        return widest

    worths, cost = _worths(rows, judge), judge.corrected()

    def rate(w: int) -> float:
        return sum(_worth(t, min(len(d), w - 1)) for t, (_, d, _) in zip(worths, plans)) / cost.verify(w)

    return max(range(least, widest + 1), key=rate)  # the narrowest of equals


def _may_trim(policy: object) -> bool:
    trimmable = getattr(policy, "trimmable", None)
    return trimmable is not None and trimmable()


def _trimmed(row: BatchRow, plan: tuple[int, list[int], object], most: int, width: int
             ) -> tuple[int, list[int], object]:
    """``plan`` with at most ``most`` drafts in a batch of ``width`` rows; its cap policy hears of
    a cut (none: a plain step)."""
    cap, drafts, draft = plan
    if not drafts:
        return plan
    if len(drafts) <= most:
        row.cuts = row.cut_width = 0
        return plan
    row.cap_policy.trim(most)
    if most == 0:  # plain steps for a while: drafting again soon would likely be cut again (and
        # its draft forward be lost), the more likely the more often it was
        row.cuts, row.cut_width = row.cuts + 1, width
        row.run_left, row.run_stop = min(MAX_CUT_RUN, CUT_RUN << (row.cuts - 1)), None
        return 0, [], None
    row.cuts = row.cut_width = 0
    draft.keep(most)
    return most, drafts[:most], draft


def _tell(policy: object, hook: str) -> None:
    told = getattr(policy, hook, None)
    if told is not None:
        told()
