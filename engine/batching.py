"""Continuous batching of requests on one engine: requests join and leave a running batch.

``Batcher`` resolves each request into its plan once (``Engine.plan``: prompt ids, mode, drafter,
cap policy, sampler), gives the row its own drafter (``Drafter.fork``: shared weights, its own
state) and its prefix-cache restore, and feeds each tick's tokens through the request's own
``RequestOutput`` (text, stop strings, result), so a request's chunks are those it gets alone.
One thread drives it (``step``); the server's engine thread and ``engine.api.generate_batch``
do. A target whose caches do not batch (``Target.batch_blocker``) runs its requests one at a
time, and each result says why (``GenerationResult.note``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from engine.batch import BatchLoop, BatchRow
from engine.generate import Chunk, Engine, Prompt, RequestOutput, RoundEvent

log = logging.getLogger("tandem.batch")

DEFAULT_MAX_BATCH = 4  # without a calibration of the target's batched forwards
BATCH_GAIN = 1.15  # a wider batch is the default only while its plain steps' aggregate rate grows this much


@dataclass
class Ticket:
    """A submitted request: where its chunks go and how it is cancelled."""

    output: RequestOutput
    row: BatchRow
    on_chunk: Callable[[Chunk], None]
    cancel: Callable[[], bool] | None = None
    on_error: Callable[[BaseException], None] | None = None
    done: bool = False
    result: Any = None  # the GenerationResult, once it ended


class Batcher:
    """Up to ``max_batch`` requests of one engine decoding together (one thread drives it)."""

    def __init__(self, engine: Engine, max_batch: int = DEFAULT_MAX_BATCH):
        self.engine = engine
        self.alone_reason = engine.target.batch_blocker()
        self.max_batch = 1 if self.alone_reason else max(1, int(max_batch))
        self.loop = BatchLoop(engine.target, max_batch=self.max_batch)
        self.tickets: list[Ticket] = []

    @property
    def busy(self) -> bool:
        return bool(self.tickets)

    @property
    def occupancy(self) -> int:
        return self.loop.occupancy

    @property
    def waiting(self) -> int:
        return len(self.loop.waiting)

    def submit(self, prompt: Prompt, *, on_chunk: Callable[[Chunk], None] | None = None,
               cancel: Callable[[], bool] | None = None, on_error: Callable[[BaseException], None] | None = None,
               on_round: Callable[[RoundEvent], None] | None = None, **kwargs: Any) -> Ticket:
        """Queue a request (``Engine.plan``'s keyword arguments); a bad one raises here."""
        plan = self.engine.plan(prompt, **kwargs)
        if self.alone_reason and self.max_batch == 1 and plan.note is None:
            plan.note = f"runs alone: {self.alone_reason}"
        out = RequestOutput(self.engine, plan, on_round=on_round, look_up=False)  # looked up as it starts
        row = BatchRow(prompt_ids=plan.prompt_ids, sampler=plan.sampler, max_new_tokens=plan.max_new_tokens,
                       drafter=plan.drafter.fork() if plan.drafter is not None else None,
                       cap_policy=plan.cap_policy, eos_ids=out.eos, mode=plan.mode,
                       on_start=lambda row: _resume(out, row), on_prompt=lambda row: out.remember(row.drafter),
                       embeddings=plan.embeddings, stats=out.stats)
        ticket = Ticket(out, row, on_chunk or _ignore, cancel, on_error)
        row.key = ticket
        self.tickets.append(ticket)
        self.loop.add(row)
        return ticket

    def step(self) -> None:
        """Cancel what was cancelled, then one tick of the batch; chunks go out as they come."""
        for ticket in list(self.tickets):
            if ticket.cancel is not None and ticket.cancel():
                ticket.output.stats.finish_reason = "cancelled"
                self._finish(ticket)
        if not self.loop.busy:
            return
        try:
            emitted = self.loop.step()
        except Exception as e:  # the forward failed: every admitted row's state is unknown now
            log.exception("batch tick failed")
            for ticket in [t for t in self.tickets if t.row in self.loop.rows]:
                self._fail(ticket, e)
            return
        width = self.loop.last_width
        for e in emitted:
            ticket: Ticket = e.row.key
            out = ticket.output
            out.batch_width = max(out.batch_width, width)
            chunks, ended = out.feed(e.tokens, e.event)
            for chunk in chunks:
                ticket.on_chunk(chunk)
            if e.done or ended:
                self._finish(ticket)

    def run(self) -> None:
        """Step until every submitted request has ended."""
        while self.busy:
            self.step()

    def _finish(self, ticket: Ticket) -> None:
        self._drop(ticket)
        plan = ticket.output.plan
        if ticket.row.waited_for_taps and plan.note is None:
            plan.note = "waited for requests whose drafter reads other target layers (one forward taps one set)"
        ticket.output.remember(ticket.row.drafter)
        for chunk in ticket.output.finish():
            if chunk.result is not None:
                ticket.result = chunk.result
            ticket.on_chunk(chunk)

    def _fail(self, ticket: Ticket, error: BaseException) -> None:
        self._drop(ticket)
        if ticket.on_error is None:
            raise error
        ticket.on_error(error)

    def _drop(self, ticket: Ticket) -> None:
        ticket.done = True
        self.loop.remove(ticket.row)
        if ticket in self.tickets:
            self.tickets.remove(ticket)


def _resume(out: RequestOutput, row: BatchRow) -> None:
    """Where a row starts: the prefix cache asked now, not at submit, so a request that waited,
    or arrived beside others with the same opening (an agent's system prompt and tools), restores
    what the rows before it prefilled (``BatchRow.on_prompt`` keeps each prompt as it is done)."""
    out.look_up()
    prefix = out.prefix_plan
    row.resume = prefix.resume if prefix else None
    row.on_prefill = prefix.on_prefill if prefix else None
    row.prefill_stops = out.prefill_stops


def _ignore(chunk: Chunk) -> None:
    """No one reads the chunks as they come (``generate_batch``): the ticket keeps the result."""


def warm_up(engine: Engine, modes: list[str], rows: int, progress: Callable[[int, int, str], None] | None = None,
            tokens: int | None = None) -> float:
    """``Engine.warm_up`` for batches of up to ``rows`` requests: each mode also runs a short
    batch of every row count from 2, its prompts of different lengths. Returns the seconds."""
    from engine.warmup import warm_prompt

    def short_batch(mode: str, n: int) -> None:
        batcher = Batcher(engine, n)
        for b in range(n):
            batcher.submit(warm_prompt(engine.target.vocab_size, 16 + 3 * b), mode=mode, max_new_tokens=8,
                           prefix_cache=False)
        batcher.run()

    return engine.warm_up(modes, progress=progress, tokens=tokens, rows=rows, generate_rows=short_batch)


def default_max_batch(engine: Engine) -> int:
    """``--max-batch`` when not given: the widest batch that this machine's cached calibration of
    the target (``tandem calibrate``, or the first ``--max-draft auto`` request) shows raising
    the aggregate rate of plain steps by ``BATCH_GAIN`` over the next narrower one measured;
    ``DEFAULT_MAX_BATCH`` without one."""
    from engine.calibrate import target_calibrations

    measured = [c for c in target_calibrations(engine) if c.batch_verify_ms]
    return widest_paying_batch(measured[-1]) if measured else DEFAULT_MAX_BATCH


def widest_paying_batch(cal: Any) -> int:
    """The widest measured batch whose rows-per-ms of plain steps beats the narrower's by ``BATCH_GAIN``."""
    best, rate = 1, 1.0 / cal.verify(1)
    for rows in sorted(int(b) for b in cal.batch_verify_ms):
        wider = rows / cal.at_batch(rows).verify(1)
        if wider < rate * BATCH_GAIN:
            break
        best, rate = rows, wider
    return best
