"""The ``--max-draft auto`` controller: re-picks the draft cap from a machine's calibrated cost
curves (``engine/cost_model.py``) and what live rounds show, and parks speculation (plain steps,
with cheap probes) when rounds lose to plain steps. ``CapController``'s docstring has the rules.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from engine.cost_model import Calibration, argmax_cap, best_cap, rates

PRIOR_P = 0.65  # the controller's starting acceptance
PROBE_CAP = 4  # the largest cap a parked controller probes with (a probe must stay cheap)
PROBE_GAP = 4  # plain steps before a parked controller's first probe; doubles after each failed one
# (a floor: PROBE_BUDGET keeps costly probes rarer; a rejected DSpark round on a CPU loses ~0.15 plain
# steps, and with chat's first-draft acceptance near 0.45 a parked request needs several probes to see a win)
MAX_PROBE_GAP = 256
NEW_REQUEST_GAP = 64  # the longest gap a new request starts with: a second look within a short answer
CHEAP_GAP = 8  # plain steps between two probes that a cheap draft (a long n-gram match) triggered
PROBE_BUDGET = 0.02  # parked, probes lose at most this share of the plain steps' time ...
MAX_BUDGET_GAP = 1024  # ... unless that needs a longer gap than this (a few requests' worth)
CLEAR_LOSS = 1.25  # rounds this much slower than plain steps park after min_rounds / 2 rounds
SURE_LOSS = 1.5  # ... and this much slower after SURE_ROUNDS (a GPU round that costs 2.4 plain steps
SURE_ROUNDS = 2  # and commits 1.5 tokens loses 3 ms a round: every round counts)
CLEAR_WIN = 1.3  # the last request's latest rounds beat timed plain steps this much: the next skips its warm steps
STALE_PLAIN = 1.0  # plain steps timed on earlier requests count as at most this many steps in a new one ...
FRESH_PLAIN = 2  # ... and not at all once it has timed this many: a machine's pace drifts (the H200's by
# up to 2x within a minute), and rounds must be judged against plain steps timed at their pace
REFILL_DECAY = 0.2  # the refill is learned from few samples (one a round that follows plain steps)
CONTEXT_STEP = 128  # the curves are re-priced each time the sequence grows past another multiple of this


@dataclass
class LearnedState:
    """What a controller has learned; carried over between requests on the same engine."""

    p: float = PRIOR_P
    tokens_seen: float = 0.0  # per-token acceptance observations (for the young running mean)
    at_risk: list[float] = field(default_factory=list)  # rounds known to have L >= i
    events: list[float] = field(default_factory=list)  # rounds known to have L == i
    rounds: int = 0  # informative rounds (cap > 0)
    cap: int | None = None
    parked: bool = False
    accepted_at: list[float] = field(default_factory=list)  # per position bucket: drafts accepted
    tried_at: list[float] = field(default_factory=list)  # per position bucket: drafts reached
    # decayed least-squares sums for round ms = c0 + c1 * g (g: the curve's width increment)
    cost: list[float] = field(default_factory=lambda: [0.0] * 5)  # W, Wg, Wgg, Ws, Wgs
    plain: list[float] = field(default_factory=lambda: [0.0, 0.0])  # decayed (steps, ms) of plain steps
    realized: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # rounds, tokens, ms since unparking
    last_spell: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # ``realized`` as the last request ended
    probes: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # decayed probes, their tokens, ms
    probe_gap: int = PROBE_GAP
    since_probe: int = 0  # parked plain steps since the last probe, across requests
    probe_loss: float = 0.0  # plain steps a probe loses beyond its tokens, catch-up included (EWMA)
    refill: list[float] = field(default_factory=lambda: [0.0, 0.0])  # decayed (runs, ms) a round costs the steps after it

    def shrink(self, factor: float = 0.5) -> None:
        """Start a new request trusting the old evidence less (the content changed)."""
        self.tokens_seen *= factor
        self.at_risk = [x * factor for x in self.at_risk]
        self.events = [x * factor for x in self.events]
        self.accepted_at = [x * factor for x in self.accepted_at]
        self.tried_at = [x * factor for x in self.tried_at]
        self.cost = [x * factor for x in self.cost]
        scale = min(factor, STALE_PLAIN / self.plain[0]) if self.plain[0] > 0 else factor
        self.plain = [x * scale for x in self.plain]
        self.last_spell = [0.0, 0.0, 0.0] if self.parked else self.realized
        self.realized = [0.0, 0.0, 0.0]  # new content: a spell is judged on its own rounds
        self.probes = [x * factor for x in self.probes]
        # A parked request probes at its start (new content may pay) and again within a short
        # answer; probes that kept failing on earlier requests stay rarer than PROBE_GAP, and
        # probes too costly for the budget wait for it across requests (budget_gap).
        self.probe_gap = min(max(PROBE_GAP, self.probe_gap // 2), NEW_REQUEST_GAP)

    def budget_gap(self) -> int:
        """The fewest plain steps between probes that keeps their losses within PROBE_BUDGET."""
        return min(int(self.probe_loss / PROBE_BUDGET), MAX_BUDGET_GAP)


# What a request learns of its content (acceptance), apart from its machine's economics.
CONTENT = ("p", "tokens_seen", "at_risk", "events", "rounds", "accepted_at", "tried_at")


def _bucket(position: int) -> int:
    """Draft positions 1, 2, 3-4, 5-8, 9-16, ... -> buckets 0, 1, 2, 3, 4, ..."""
    return max(0, int(position) - 1).bit_length()


class _Corrected:
    """A calibration seen through the live cost fit: ``verify(w) = c0 + c1 * (verify_cal(w) -
    verify_cal(1))``, drafter ms scaled by ``c1``, the round overhead inside ``c0`` (it is fit
    on whole rounds) and the live plain step. Quacks like ``Calibration`` for ``rates``."""

    def __init__(self, cal: Calibration, c0: float, c1: float, plain_ms: float):
        self.cal, self.c0, self.c1, self.plain_ms = cal, c0, c1, plain_ms
        self.max_cap, self.overhead_ms = cal.max_cap, 0.0
        self._v1 = cal.verify(1)

    def verify(self, width: int) -> float:
        return self.c0 + self.c1 * (self.cal.verify(width) - self._v1)

    def draft(self, cap: int) -> float:
        return self.c1 * self.cal.draft(cap)

    def plain_step_ms(self) -> float:
        return self.plain_ms


class CapController:
    """``--max-draft auto``: re-picks the cap from the calibrated curves and live evidence.

    * Acceptance ``p``: an EWMA of per-token Bernoulli outcomes (each accepted draft a 1, the
      first rejected one a 0); a fully accepted round adds no 0 (censored: the next draft
      might have failed too). Young, it is a running mean seeded with ``PRIOR_P``. Per draft
      position (buckets 1, 2, 3-4, 5-8, ...) the conditional acceptance is estimated too,
      shrunk toward ``p``: a lookup draft whose first tokens matched tends to match on, which
      a single ``p`` undervalues.
    * Draft lengths ``S(i)``: a decayed Kaplan-Meier estimate from the drafts seen. A draft
      shorter than the cap is the drafter's natural length; one at the cap says only
      ``L >= cap``. Lengths never seen are assumed to continue (optimism that explores).
    * Costs: the calibrated curve, corrected live. Round times (``observe``'s seconds, emit to
      emit) are fit as ``c0 + c1 * g(k)``, ``g`` the curve's extra cost of ``k`` drafts over a
      plain step, by decayed least squares shrunk toward the calibration. Plain steps (pipelined
      runs, each run's first and last step apart) are timed on their own: cap 0 is priced at
      the realized plain step, this request's own once it has timed ``FRESH_PLAIN`` of them.
    * Every ``repick_every`` rounds, switch to the best cap when it beats the current one by
      ``hysteresis``. Cap 0 (plain steps) is allowed after ``park_after`` informative rounds,
      and forced, checked after every round, when the rounds since the last unparking (or
      since the request began) realized fewer tokens per second than plain steps do: after
      ``min_rounds`` rounds; after half as many when they lost by more than ``CLEAR_LOSS``;
      after ``SURE_ROUNDS`` when they lost by more than ``SURE_LOSS``. Whatever the model
      believes, a speculating controller that loses to plain steps parks within a few rounds.
      Parked, the loop runs pipelined plain steps; a probe at a cheap cap follows every
      ``probe_gap`` of them (the gap doubles after a probe that lost more than half a plain
      step, up to ``MAX_PROBE_GAP``, and halves after an accepted one). Each
      parked request starts with a probe, then keeps its predecessors' gap halved, at most
      ``NEW_REQUEST_GAP``: probes that keep failing stay rare, yet a short answer gets a second
      look. Whatever the gap says, probes wait until they lose at most ``PROBE_BUDGET`` of the
      plain steps' time, counted across requests: a probe's loss (its time, plus the drafter's
      catch-up before it, beyond what its tokens cost as plain steps) sets the fewest steps
      between two (a draft model that feeds its whole backlog to make one costly round is
      probed once in several short answers, not at each one's start). It unparks when a probe
      whose drafts all held beats a plain step's rate, when the probes lately do, or when the
      model does after a probe stopped only by its cap with every draft accepted (a capped
      probe undervalues long drafts; a rejected or self-cut one outweighs curves that may
      promise too much).
    * ``seeded``: decisions from the calibrated curves and observed acceptance only, never from
      live timings, so a seeded sampled run (whose tokens depend on the caps) is reproducible.
      No warm plain steps, no cost fit, no realized-rate parking.
    * Context: the loop tells ``context(n)`` how long the sequence is before each cap; rounds and
      plain steps are priced at that length (``Calibration.at_context``: attention's cost grows
      with the K/V it reads), and live round times are fit net of the calibrated context cost, so
      rounds timed on a short request still inform a long one. Where even drafts that all hold
      lose to a plain step at this length, or at this batch width (``batch_rows``: a wide batch
      on a compute-bound machine), it parks at once and takes no probe until a length or width
      where a draft might pay.
    * ``warm_plain``: plain steps that open each request (unseeded), timing plain steps at this
      context before the first round; skipped when the last request's latest rounds beat plain
      steps timed lately by ``CLEAR_WIN``, and then taken once its own rounds stop winning that
      clearly (the steps it would judge them by were timed at another pace). Plain steps timed
      on earlier requests weigh at most ``STALE_PLAIN`` steps in a new one.

    The cap only decides how many drafts are verified, never what is committed: lossless.
    """

    label = "auto"

    def __init__(self, cal: Calibration, max_cap: int | None = None, *, state: LearnedState | None = None,
                 seeded: bool = False, alpha: float = 0.02, prior_weight: float = 4.0, decay: float = 0.03,
                 repick_every: int = 4, hysteresis: float = 1.03, park_after: int = 8, min_rounds: int = 8,
                 warm_plain: int = 0, cost_decay: float = 0.01, cost_prior: float = 0.5, position_prior: float = 4.0,
                 position_decay: float = 0.01, plain_decay: float = 0.05, plain_prior: float = 2.0,
                 realized_decay: float = 0.1):
        self.cal = self.one_row_cal = self.flat_cal = cal  # see _price
        self.rows = 1  # sequences sharing the forwards now (batch_rows)
        self.widest = 1  # the most it shared them with (what of it the engine keeps: rejoin)
        self.priced_context = 0  # the sequence length ``cal`` is priced at (``context``)
        self.max_cap = cal.max_cap if max_cap is None else min(max_cap, cal.max_cap)
        self.state = state if state is not None else LearnedState()
        self.seeded = seeded
        n = self.max_cap + 2
        self.state.at_risk = (self.state.at_risk + [0.0] * n)[:n]
        self.state.events = (self.state.events + [0.0] * n)[:n]
        nb = _bucket(self.max_cap) + 1
        self.state.accepted_at = (self.state.accepted_at + [0.0] * nb)[:nb]
        self.state.tried_at = (self.state.tried_at + [0.0] * nb)[:nb]
        self.alpha, self.prior_weight, self.decay = alpha, prior_weight, decay
        self.repick_every, self.hysteresis = repick_every, hysteresis
        self.park_after, self.min_rounds = park_after, min_rounds
        self.cost_decay, self.cost_prior = cost_decay, cost_prior
        self.position_prior, self.position_decay = position_prior, position_decay  # structure drifts slowly
        self.plain_decay, self.plain_prior, self.realized_decay = plain_decay, plain_prior, realized_decay
        if len(self.state.cost) != 5:
            self.state.cost = [0.0] * 5
        self._since_repick = 0
        if self.state.parked:  # a parked request probes right after its warm plain steps, budget allowing
            self.state.since_probe = max(self.state.since_probe, self.state.probe_gap)
        self._probing = False
        self._catch_up_ms = 0.0  # the drafter's catch-up before the round observed next
        self._width_parked = 0  # parked by ``batch_rows`` at a width where no draft pays: the cap it had
        self._cheap = False  # the loop saw a cheap draft ready: probe now
        self._cheap_probe = False  # the probe in flight was one
        self._since_cheap = CHEAP_GAP  # plain steps since the last cheap probe
        self._run_pos = 0  # position in the current run of plain steps (the first one fills the pipeline)
        self._pending_plain = 0.0  # the run's latest plain step (ms), timed once a later one shows it was not the last
        # the plain steps since the last round: how many, the first's and the latest's ms, and whether
        # a round came before them (not the prefill): what that round cost the pipeline (``refill_ms``)
        self._since_round = 0
        self._since_round_first_ms = self._since_round_last_ms = 0.0
        self._round_before = False
        self._fresh_plain = [0.0, 0.0]  # this request's timed plain steps (decayed): steps, ms
        self._fresh_timed = 0  # ... how many
        # plain steps that open a request: its plain cost, live (not after a clear win; then, once,
        # when its rounds stop winning clearly: the pace they were judged at may be stale)
        self._warm_plain = warm_plain
        self._retime = not seeded and warm_plain > 0 and self._clear_win()
        self._warm = 0 if seeded or self._retime else warm_plain
        self._last_cap = 0
        self._shared: LearnedState | None = None  # the engine's state while this request learns on a copy (detach)
        self.history: list[int] = []  # cap returned per round (telemetry, tests)
        if self.state.cap is None or self.state.cap > self.max_cap:
            self.state.cap = best_cap(cal, self.state.p, max_cap=self.max_cap, survival=self.survival(),
                                      allow_park=False)

    # -- the model as learned so far -------------------------------------------------------
    @property
    def p(self) -> float:
        return self.state.p

    def survival(self) -> list[float]:
        """S(i) = P(L >= i) for i = 0..max_cap + 1."""
        s, out = 1.0, []
        for i in range(self.max_cap + 2):
            out.append(s)
            # one pseudo-round that continued: a single short draft does not end all hope
            s *= 1.0 - min(1.0, self.state.events[i] / (self.state.at_risk[i] + 1.0))
        return out

    def _g(self, drafted: int, cap: int) -> float:
        """The curve's extra ms for a round that verified ``drafted`` drafts under ``cap``."""
        return self.cal.verify(drafted + 1) - self.cal.verify(1) + (self.cal.draft(cap) if cap > 0 else 0.0)

    def cost_fit(self) -> tuple[float, float]:
        """(c0 ms, c1): the live fit of round ms = c0 + c1 * g, shrunk toward (verify(1) +
        overhead, 1), at the calibration's own context (add ``context_ms`` for this one)."""
        W, Wg, Wgg, Ws, Wgs = self.state.cost
        c0p = self.flat_cal.verify(1) + self.flat_cal.overhead_ms
        g_ref = max(self._g(min(8, self.max_cap), min(8, self.max_cap)), 0.1 * c0p)
        p0, p1 = self.cost_prior, self.cost_prior * g_ref * g_ref
        a, b, d = W + p0, Wg, Wgg + p1
        e, f = Ws + p0 * c0p, Wgs + p1
        det = a * d - b * b
        c0, c1 = (e * d - b * f) / det, (a * f - b * e) / det
        return min(max(c0, 0.1 * c0p), 10 * c0p), min(max(c1, 0.02), 10.0)

    def context_ms(self) -> float:
        """What a one-row verify costs at the priced context beyond the calibration's context."""
        return self.cal.verify(1) - self.flat_cal.verify(1)

    def _clear_win(self) -> bool:
        """The last request's latest rounds (``min_rounds`` / 2 at least) beat plain steps timed live on
        earlier requests by ``CLEAR_WIN``: this request speculates from its first step. Warm plain
        steps cost a short answer several percent (4 tokens at a plain step each where a round
        commits 2-3); where rounds lose or win narrowly, or no plain step was timed lately, they
        stay, and ``_losing`` still parks a spell that loses."""
        rounds, tokens, ms = self.state.last_spell  # all 0 after a request that ended parked
        if rounds < self.min_rounds // 2 or ms <= 0 or self.state.plain[0] < 0.5:
            return False
        return self._speedup(self.state.last_spell) >= CLEAR_WIN

    def _speedup(self, spell: list[float]) -> float:
        """A spell's (rounds, tokens, ms) tokens per second over plain steps' (0 with no time)."""
        _, tokens, ms = spell
        return tokens / ms * self.plain_ms() if ms > 0 else 0.0

    def plain_ms(self) -> float:
        """One plain step: once this request has timed ``FRESH_PLAIN`` steps, theirs alone (its
        own pace); before, the steps timed on earlier requests shrunk toward the calibration
        (which was timed once, at its own pace: on the H200 one read 7.95 ms against 4-5)."""
        prior = self.cal.plain_step_ms()
        if self.seeded:
            return prior
        if self._fresh_timed >= FRESH_PLAIN:
            steps, ms = self._fresh_plain
            return ms / steps
        steps, ms = self.state.plain
        return (ms + self.plain_prior * prior) / (steps + self.plain_prior)

    def corrected(self) -> Calibration | _Corrected:
        if self.seeded:
            return self.cal
        c0, c1 = self.cost_fit()
        return _Corrected(self.cal, c0 + self.context_ms(), c1, self.plain_ms())

    def acceptance(self) -> list[float]:
        """p_i = P(draft i accepted | drafts before it were), i = 0..max_cap (index 0 unused):
        per position bucket, shrunk toward the overall ``p`` with ``position_prior`` drafts."""
        st, m = self.state, self.position_prior
        per_bucket = [(a + m * st.p) / (t + m) for a, t in zip(st.accepted_at, st.tried_at)]
        return [st.p] + [per_bucket[_bucket(i)] for i in range(1, self.max_cap + 1)]

    def rates(self) -> list[float]:
        return rates(self.corrected(), self.acceptance(), self.survival(), self.max_cap)

    # -- CapPolicy -------------------------------------------------------------------------
    def batch_rows(self, rows: int) -> None:
        """This request now decodes in a batch of ``rows`` sequences: price rounds and plain steps
        with the curves measured at that many (``Calibration.at_batch``), so the cap, and whether
        to park, follow the batch width. A seeded controller keeps one row's curves: its caps,
        and so its tokens, must not depend on what else the server is answering."""
        if rows != self.rows and not self.seeded:
            self.rows, self.widest = rows, max(self.widest, rows)
            self._price()
            if not self.state.parked and self._hopeless(calibrated=True):  # no draft can pay at this width
                self._park()
                self._width_parked = max(1, int(self.state.cap))
            elif self._width_parked and not self._hopeless(calibrated=True):  # parked for the width, not the content
                self._unpark(self._width_parked)
                self._width_parked = 0
            elif self.state.rounds >= self.park_after:  # what it learned of the content, at this width's costs
                self._repick()

    def context(self, tokens: int) -> None:
        """The sequence (prompt and output) is ``tokens`` long now: price rounds and plain steps
        at this context, re-priced every ``CONTEXT_STEP`` tokens; park at once where, past the
        calibration's own context, even drafts that all hold lose to plain steps. A seeded
        controller follows it too (its context is a function of its own tokens: reproducible)."""
        priced = int(tokens) - int(tokens) % CONTEXT_STEP
        if priced == self.priced_context:
            return
        self.priced_context = priced
        self._price()
        if priced > self.one_row_cal.context and not self.state.parked and self._hopeless():
            self._park()

    def _price(self) -> None:
        """``cal``: the curves at this batch width and context; ``flat_cal``: at this width and the
        calibration's own context (the frame the live cost fit is kept in)."""
        self.flat_cal = self.one_row_cal.at_batch(self.rows)
        self.cal = self.one_row_cal.at_context(self.priced_context).at_batch(self.rows)

    def _hopeless(self, calibrated: bool = False) -> bool:
        """Drafts that all hold, at every cap, still lose to a plain step (the best case), by the
        curves as corrected by live timings or, ``calibrated``, as measured (what a noisy spell of
        timings cannot talk it into: a probe is the only way out of a wrong belief)."""
        best = rates(self.cal if calibrated else self.corrected(), 1.0, None, self.max_cap)
        return max(best[1:], default=0.0) < best[0]

    def detach(self) -> None:
        """This request decodes beside others (engine/batch.py): it learns on its own copy of the
        engine's state (its spells, parking and probes are its own, and a request that joins
        does not ``shrink`` the evidence of one in flight); ``rejoin`` hands it back."""
        if self._shared is None:
            self._shared, self.state = self.state, copy.deepcopy(self.state)

    def rejoin(self) -> None:
        """The request left the batch: what it learned becomes the engine's (the last to leave
        wins). After forwards shared with other rows, only what it learned of the content (its
        acceptance): its timings, its cap and whether it parked were a batch's economics, and
        the engine's next lone request starts from its own (it would otherwise start parked
        where a batch of four parked, and lose most of a short answer before a probe)."""
        if self._shared is not None:
            learned = self.state.__dict__
            if self.widest > 1:
                learned = {k: learned[k] for k in CONTENT}
            self._shared.__dict__.update(learned)
            self.state, self._shared = self._shared, None

    def expected_table(self, before: bool = False) -> list[float]:
        """Tokens a round commits with 0..max_cap drafts, by the learned per-position acceptance
        (the accepted drafts and the target's own token after them). ``before``: at a cap of
        0..max_cap, before the drafts are known, each position reached by the drafter
        (``survival``: a draft may stop short of the cap) and accepted. One pass for every cap:
        a batch prices each row at every width it weighs, each time a row asks to draft, on a
        host-bound GPU where a tick is ~10 ms."""
        survival = self.survival() if before else None
        tokens, reach, table = 1.0, 1.0, [1.0]
        for i, a in enumerate(self.acceptance()[1:], start=1):
            reach *= a
            tokens += survival[i] * reach if before else reach
            table.append(tokens)
        return table

    def round_ms(self, width: int) -> float:
        """A forward verifying ``width`` rows per sequence, at this batch's width (ms)."""
        return self.corrected().verify(width)

    def trimmable(self) -> bool:
        """May the batch verify fewer of this round's drafts than the cap allowed? Not a seeded
        request's (its caps must not depend on other requests), nor a probe (a parked request's
        only way to see that its content started to pay)."""
        return not self.seeded and not self._probing and self._last_cap > 0

    def trim(self, cap: int) -> None:
        """The batch verifies at most ``cap`` of this round's drafts (a width every row of the
        forward pays); 0: the round became a plain step, timed as one."""
        if 0 < cap < self._last_cap:
            self._last_cap = cap
        elif cap == 0 and self._last_cap > 0:
            self._next(0)

    def cap(self) -> int:
        st = self.state
        if self._warm > 0:
            cap = 0
        elif st.parked and (self._cheap or st.since_probe >= self._gap()) and not self._hopeless(calibrated=True):
            # (where even drafts that all hold lose, as in a wide batch on a compute-bound machine,
            # a probe could only lose: the next one waits for a width or context where one might pay)
            self._probing, self._cheap_probe, self._cheap = True, self._cheap, False
            cap = max(1, min(PROBE_CAP, argmax_cap(self.rates(), allow_park=False)))
        else:
            cap = 0 if st.parked else int(st.cap)
        self._next(cap)
        self.history.append(cap)
        return cap

    def _next(self, cap: int) -> None:
        """What the loop does next: rounds at ``cap``, or (0) a run of plain steps."""
        if cap == 0:
            self._run_pos = 0  # a run of plain steps starts
        self._pending_plain = 0.0  # the last step of the run before: not timed
        self._last_cap = cap

    def watch_cheap_drafts(self) -> bool:
        """Parked, a long n-gram match may end a plain run early for a probe: copying is found
        the step it starts, at about a plain step's cost, without waiting for the next probe."""
        return self.state.parked and self._warm == 0 and self._since_cheap >= CHEAP_GAP

    def cheap_draft(self) -> None:
        self._cheap = True

    def no_draft(self) -> None:
        """The drafter has nothing to propose after ``cap()`` said draft: the plain steps the loop
        takes instead are plain steps (timed as such; a probe waits for a draft), not rounds."""
        self._next(0)

    def plain_run(self) -> int:
        """Plain steps to take in a row now that ``cap()`` said 0: to the next probe, parked."""
        if self._warm > 0:
            return self._warm
        if self.state.parked:
            return max(1, self._gap() - self.state.since_probe)
        return 1

    def _gap(self) -> int:
        """Plain steps between probes. In a batch of B rows a probe widens the forward every row
        pays for (engine/batch.py never cuts a probe), so it costs about B times what its own
        round shows: B times rarer (a seeded controller keeps one row's schedule)."""
        return max(self.state.probe_gap, self.state.budget_gap()) * self.rows

    def observe_catch_up(self, seconds: float) -> None:
        self._catch_up_ms += seconds * 1000.0

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        st = self.state
        cap = self._last_cap
        if cap == 0:  # one plain step
            self._warm = max(0, self._warm - 1)
            if st.parked:
                st.since_probe += 1
                self._since_cheap += 1
            # A run's first step fills the pipeline, and its last may come out already done (on the
            # CPU backend reading a token waits for the step queued behind it too: a 3-step run
            # reads 2 steps, 1, ~0): only the steps between are timed, each once the next is seen.
            if not self.seeded:
                if self._since_round == 0:
                    self._since_round_first_ms = seconds * 1000.0
                self._since_round_last_ms = seconds * 1000.0
                self._since_round += 1
                if self._run_pos >= 2 and self._pending_plain > 0:  # the next is seen, however long it took
                    keep = 1.0 - self.plain_decay
                    st.plain = [st.plain[0] * keep + 1.0, st.plain[1] * keep + self._pending_plain]
                    steps, ms = self._fresh_plain
                    self._fresh_plain = [steps * keep + 1.0, ms * keep + self._pending_plain]
                    self._fresh_timed += 1
                self._pending_plain = seconds * 1000.0  # the first's is replaced before it could count
            self._run_pos += 1
            return
        self._run_pos = 0
        catch_up_ms, self._catch_up_ms = self._catch_up_ms, 0.0
        if not self.seeded:
            self._learn_refill()
        st.rounds += 1
        self._learn_length(min(drafted, cap), cap)
        self._learn_acceptance(drafted, accepted)
        ms = 0.0
        if not self.seeded and seconds > 0:
            ms = self._learn_cost(min(drafted, cap), cap, seconds * 1000.0)
            keep = 1.0 - self.realized_decay
            r, t, total = st.realized
            st.realized = [r + 1.0, t * keep + accepted + 1.0, total * keep + ms]
        if self._retime and not st.parked and st.realized[0] >= self.min_rounds // 2 and \
                self._speedup(st.realized) < CLEAR_WIN:
            self._retime, self._warm = False, self._warm_plain  # time plain steps now, before judging
            return
        if not st.parked and not self._probing and self._losing():
            self._park_losing()
            return
        if self._probing:
            self._probing = False
            cheap, self._cheap_probe = self._cheap_probe, False
            if cheap:
                self._since_cheap = 0  # the regular probes keep their own schedule
            else:
                st.since_probe = 0
            full = 0 < cap == drafted == accepted  # stopped by the cap, not by the drafter
            won = 0 < drafted == accepted and seconds > 0 and not self.seeded and \
                (accepted + 1) / (seconds * 1000.0) > self.hysteresis / self.plain_ms()  # its own clock
            if not self.seeded and seconds > 0:
                keep = 1.0 - 0.3
                n, t, total = st.probes
                st.probes = [n * keep + 1.0, t * keep + accepted + 1.0, total * keep + ms]
            self._repick(probe_won=won, probe_full=full)
            # A probe that lost more than half a plain step (a rejected or empty DSpark call:
            # 2-2.7 steps on the H200 for a token) says look again later; one that lost less (an
            # n-gram lookup, rejected or empty: 1.0-1.3 steps) costs too little to wait for; an
            # accepted one says look sooner. Seeded (no clock): a rejected probe backs off. A
            # probe a cheap draft triggered leaves the regular schedule alone.
            loss = (ms + catch_up_ms + self.refill_ms()) / self.plain_ms() - (accepted + 1)  # in plain steps
            lost = loss > 0.5 if ms > 0 else accepted < drafted
            if not cheap and ms > 0:
                loss = max(0.0, loss)
                st.probe_loss = loss if st.probe_loss == 0 else 0.5 * (st.probe_loss + loss)
            if st.parked and not cheap:
                if lost:
                    st.probe_gap = min(2 * st.probe_gap, MAX_PROBE_GAP)
                elif drafted and accepted == drafted:
                    st.probe_gap = max(PROBE_GAP, st.probe_gap // 2)
            return
        self._since_repick += 1
        if self._since_repick >= self.repick_every:
            self._since_repick = 0
            self._repick()

    def _learn_acceptance(self, drafted: int, accepted: int) -> None:
        st = self.state
        if drafted > 0:
            keep = 1.0 - self.position_decay
            st.accepted_at = [x * keep for x in st.accepted_at]
            st.tried_at = [x * keep for x in st.tried_at]
            for i in range(1, min(drafted, accepted + 1, self.max_cap) + 1):
                b = _bucket(i)
                st.tried_at[b] += 1.0
                st.accepted_at[b] += 1.0 if i <= accepted else 0.0
        outcomes = [1.0] * accepted + ([0.0] if accepted < drafted else [])  # censored at full accept
        for x in outcomes:
            st.tokens_seen += 1
            w = max(self.alpha, 1.0 / (st.tokens_seen + self.prior_weight))
            st.p += w * (x - st.p)

    def _learn_cost(self, k: int, cap: int, ms: float) -> float:
        """Fold one round's ms into the fit; returns it clipped to [0.5, 2] x the prediction (a
        burst of contention is not the curve, and hits plain steps alike)."""
        g = self._g(k, cap)
        c0, c1 = self.cost_fit()
        at_context = self.context_ms()
        predicted = c0 + at_context + c1 * g
        ms = min(max(ms, 0.5 * predicted), 2.0 * predicted)
        keep = 1.0 - self.cost_decay
        W, Wg, Wgg, Ws, Wgs = (x * keep for x in self.state.cost)
        flat = ms - at_context  # the fit is kept at the calibration's context
        self.state.cost = [W + 1.0, Wg + g, Wgg + g * g, Ws + flat, Wgs + g * flat]
        return ms

    def observe_ahead(self, drafted: int, accepted: int, seconds: float) -> None:
        """A plain step read after ``cap()`` planned the round that follows it (a batch asks while
        the step is in flight, so that plain steps stay queued where nobody drafts): observed as
        the plain step it was, the round still planned."""
        planned, self._last_cap = self._last_cap, 0
        self.observe(drafted, accepted, seconds)
        self._last_cap = planned

    def _learn_refill(self) -> None:
        """Before a round: fold in what the round before the plain steps since cost them. A round
        empties the pipeline, so the first plain step after it waits for a forward that was not
        queued ahead (on a GPU whose step is mostly host work: ~1.5 steps on the H200). On the
        CPU backend the first reads two steps and the last ~0, so the run's first and last
        step against two plain steps measure the refill on either backend (~0 on the CPU)."""
        steps, self._since_round = self._since_round, 0
        after_round, self._round_before = self._round_before, True
        if not after_round or steps == 0:
            return
        plain = self.plain_ms()
        excess = self._since_round_first_ms + (self._since_round_last_ms if steps >= 2 else 0.0) - min(steps, 2) * plain
        excess = min(max(excess, -plain), 2.0 * plain)  # a stall (another process) is not the round's
        keep = 1.0 - REFILL_DECAY
        runs, ms = self.state.refill
        self.state.refill = [runs * keep + 1.0, ms * keep + excess]

    def refill_ms(self) -> float:
        """What a round costs the plain steps that follow it beyond their own time (ms, >= 0):
        the pipeline it emptied. A probe that fails pays it; rounds that follow rounds do not."""
        runs, ms = self.state.refill
        return max(0.0, ms / runs) if runs > 0 and not self.seeded else 0.0

    def _learn_length(self, k: int, cap: int) -> None:
        st = self.state
        keep = 1.0 - self.decay
        st.at_risk = [x * keep for x in st.at_risk]
        st.events = [x * keep for x in st.events]
        exact = k < cap  # the drafter stopped by itself: L == k
        for i in range(k + (1 if exact else 0)):
            st.at_risk[i] += 1.0
        if exact:
            st.events[k] += 1.0

    def _losing(self) -> bool:
        """Did the rounds since the last unparking realize fewer tokens per second than plain
        steps? A sure loss counts after ``SURE_ROUNDS`` rounds, a clear one after
        ``min_rounds`` / 2, a close one after ``min_rounds`` (noise)."""
        if self.seeded:
            return False
        rounds, _, ms = self.state.realized
        if ms <= 0 or rounds < SURE_ROUNDS:
            return False
        margin = self.hysteresis if rounds >= self.min_rounds else \
            CLEAR_LOSS if rounds >= self.min_rounds // 2 else SURE_LOSS
        return self._speedup(self.state.realized) * margin < 1.0

    def _park_losing(self) -> None:
        """Park after a losing spell; a short one (content that soon lost again) probes less often."""
        st = self.state
        short = st.realized[0] < 4 * PROBE_GAP
        self._park()
        st.probe_gap = min(2 * st.probe_gap, MAX_PROBE_GAP) if short else PROBE_GAP

    def _park(self) -> None:
        st = self.state
        st.parked, st.probes = True, [0.0, 0.0, 0.0]
        st.since_probe = 0

    def _repick(self, probe_won: bool = False, probe_full: bool = False) -> None:
        """Re-pick the cap (or park, or unpark). After a probe: ``probe_won``, its drafts all held
        at a better rate than plain steps; ``probe_full``, it was stopped by its cap with every
        draft accepted."""
        st = self.state
        rates = self.rates()
        current = 0 if st.parked else int(st.cap)
        if st.parked and not self.seeded and (probe_won or st.probes[0] > 0 and
                                              1000.0 * st.probes[1] / st.probes[2] > rates[0] * self.hysteresis):
            # the probes lately, or this one whose drafts all held, beat plain steps
            self._unpark(max(1, argmax_cap(rates, allow_park=False)))
            return
        if not st.parked and not self.seeded and st.realized[0] >= 4 * PROBE_GAP:
            st.probe_gap = PROBE_GAP  # a long winning spell: probe soon after a later parking
        best = argmax_cap(rates, st.rounds >= self.park_after)
        if rates[best] > rates[current] * self.hysteresis:
            if best == 0:
                self._park()
            elif st.parked:
                # A probe is live evidence: the model (whose curves may promise too much) unparks
                # only after one whose drafts all held, never after a rejected one.
                if self.seeded or probe_full:
                    self._unpark(best)
            else:
                st.cap = best

    def _unpark(self, cap: int) -> None:
        st = self.state
        st.parked, st.cap = False, cap
        st.realized = [0.0, 0.0, 0.0]  # a new spell of rounds: judged afresh
        st.probes = [0.0, 0.0, 0.0]
