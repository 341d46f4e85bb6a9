"""Speed where users run it, on tiny targets and a modeled clock (never by timing):

* ``--max-draft auto`` parks a slow drafter within a few rounds, runs pipelined plain steps
  parked, probes rarely, unparks when acceptance rises, and keeps speculating when it pays;
* a seeded sampled auto run is reproducible whatever the clock says;
* the calibrator's confidence cut follows the cost curves.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from engine import calibrate as C
from engine import cap_controller as CC
from engine import cost_model as M
from engine.drafters.base import Draft, Drafter
from engine.sampling import Sampler, SamplingParams
from engine.speculative import DecodeStats, decode
from tests.tiny import make_tiny_engine

PROMPT = [5, 9, 14, 3, 22, 7, 30, 11]


@pytest.fixture(scope="module")
def eng():
    return make_tiny_engine("qwen3", seed=2, scale=4.0)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    return tmp_path


def reference(eng, n: int = 160) -> list[int]:
    return [t for out, _ in decode(eng.target, None, PROMPT, Sampler(SamplingParams()), max_new_tokens=n) for t in out]


class Oracle(Drafter):
    """Proposes the target's own greedy continuation (all accepted) or, before ``right_from``
    generated tokens, the same tokens shifted by one (the first is always rejected)."""

    name = "oracle"

    def __init__(self, ref: list[int], right_from: int = 0, max_draft: int = 8):
        self.ref, self.right_from, self.max_draft = ref, right_from, max_draft

    def propose(self, ids, cap, sampler):
        g = len(ids) - len(PROMPT)
        tokens = self.ref[g : g + cap]
        if not tokens:
            return None
        if g < self.right_from:
            tokens = [(t + 1) % 96 for t in tokens]
        return Draft(mx.array(tokens, dtype=mx.uint32))


class CostClock:
    """Time that moves only by modeled costs: each target forward (a pipelined plain step costs
    ``step``, any other forward ``verify(width)``) and each proposal (``draft``), in ms."""

    def __init__(self, target, drafter, step: float, verify, draft: float):
        self.now, self.step, self.verify, self.draft = 0.0, step, verify, draft
        self.plain_steps = 0
        forward, propose = target.forward, drafter.propose

        def timed_forward(ids, cache, **kw):
            plain = kw.get("last_only") and ids.shape[1] == 1
            self.plain_steps += bool(plain)
            self.now += (self.step if plain else self.verify(ids.shape[1])) / 1000.0
            return forward(ids, cache, **kw)

        def timed_propose(ids, cap, sampler):
            self.now += self.draft / 1000.0
            return propose(ids, cap, sampler)

        target.forward, drafter.propose = timed_forward, timed_propose
        self._restore = lambda: (setattr(target, "forward", forward), delattr(drafter, "propose"))

    def __call__(self) -> float:
        return self.now

    def close(self) -> None:
        self._restore()


def run_auto(eng, drafter, ctrl, clock, n: int = 160, sampler=None):
    stats = DecodeStats()
    try:
        tokens = [t for out, _ in decode(eng.target, drafter, PROMPT, sampler or Sampler(SamplingParams()),
                                         max_new_tokens=n, cap_policy=ctrl, stats=stats, clock=clock) for t in out]
    finally:
        clock.close()
    return tokens, stats


def optimistic_cal() -> M.Calibration:
    """Curves that promise speculation pays: flat verify, a free drafter."""
    return M.Calibration.synthetic(lambda w: 1.0, 8, plain_ms=1.0)


# ------------------------------------------------------------------ the controller in the loop
def test_a_slow_drafter_parks_within_a_few_rounds_and_runs_pipelined_plain_steps(eng):
    ref = reference(eng)
    drafter = Oracle(ref, right_from=10 ** 6)  # every first draft rejected: one token per round
    clock = CostClock(eng.target, drafter, step=1.0, verify=lambda w: 1.5, draft=3.0)  # a round: 4.5 ms
    ctrl = CC.CapController(optimistic_cal(), drafter.max_draft, warm_plain=3)
    tokens, stats = run_auto(eng, drafter, ctrl, clock)
    assert tokens == ref
    caps = stats.caps[1:]
    assert caps[:3] == [0, 0, 0]  # warm plain steps: the plain step at this context, timed
    spec = [i for i, c in enumerate(caps) if c > 0]
    assert spec and ctrl.state.parked
    rounds_before_parking = sum(1 for c in caps[3 : caps.index(0, 3)] if c > 0)
    assert rounds_before_parking <= ctrl.min_rounds + ctrl.repick_every  # whatever the curves promised
    probes = [c for c in caps[caps.index(0, 3):] if c > 0]
    assert probes and all(1 <= c <= CC.PROBE_CAP for c in probes)
    assert len(probes) <= 4  # rare: gaps 16, 32, 64, ... plain steps
    gaps = np.diff([i for i, c in enumerate(caps) if c > 0 and i > caps.index(0, 3)])
    assert all(b >= a for a, b in zip(gaps, gaps[1:]))  # the gap grows after each failed probe
    # parked, the loop ran long pipelined runs (one cap() per run, not per token)
    assert clock.plain_steps >= 0.8 * caps.count(0) and len(ctrl.history) < 0.3 * len(caps)
    modeled_ms = clock.now * 1000.0
    assert modeled_ms < 1.15 * len(ref) * 1.0  # within 15% of all-plain (1 ms a token), probes included


def test_a_drafter_with_nothing_to_propose_parks_where_a_plain_round_costs_a_sync(eng):
    """n-gram lookup on chat on a GPU: most rounds find no match and become one unpipelined
    step, which costs a host sync that pipelined plain steps hide."""
    ref = reference(eng)
    drafter = Oracle(ref)
    drafter.propose = lambda ids, cap, sampler: None
    clock = CostClock(eng.target, drafter, step=1.0, verify=lambda w: 1.4, draft=0.02)
    ctrl = CC.CapController(M.Calibration.synthetic(lambda w: 1.0, 8, plain_ms=1.0), drafter.max_draft, warm_plain=3)
    tokens, stats = run_auto(eng, drafter, ctrl, clock)
    assert tokens == ref and ctrl.state.parked
    caps = stats.caps[1:]
    parked_at = caps.index(0, 3)
    assert sum(1 for c in caps[:parked_at] if c > 0) <= ctrl.min_rounds + ctrl.repick_every
    assert sum(1 for c in caps[parked_at:] if c > 0) <= len(caps) / CC.PROBE_GAP + 1  # probes: one per gap at most
    assert clock.now * 1000.0 < 1.05 * len(ref)  # within 5% of plain steps throughout


def test_a_drafter_that_pays_keeps_speculating(eng):
    ref = reference(eng)
    drafter = Oracle(ref)  # every draft accepted
    clock = CostClock(eng.target, drafter, step=1.0, verify=lambda w: 1.2 + 0.05 * w, draft=0.5)
    ctrl = CC.CapController(M.Calibration.synthetic(lambda w: 1.2 + 0.05 * w, 8, plain_ms=1.0,
                                                   draft=lambda c: 0.5), drafter.max_draft, warm_plain=3)
    tokens, stats = run_auto(eng, drafter, ctrl, clock)
    assert tokens == ref and not ctrl.state.parked
    assert sum(1 for c in stats.caps[4:] if c == 0) <= 1  # only the last token is plain
    assert clock.now * 1000.0 < 0.4 * len(ref)  # several tokens per ~2 ms round vs 1 ms a token


def test_a_sure_loss_parks_after_two_rounds(eng):
    """A GPU round that costs several plain steps and commits one token: every round loses."""
    ref = reference(eng)
    drafter = Oracle(ref, right_from=10 ** 6)
    clock = CostClock(eng.target, drafter, step=1.0, verify=lambda w: 1.5, draft=3.0)
    ctrl = CC.CapController(optimistic_cal(), drafter.max_draft, warm_plain=3)
    tokens, stats = run_auto(eng, drafter, ctrl, clock)
    assert tokens == ref
    caps = stats.caps[1:]
    assert caps[3 : 3 + CC.SURE_ROUNDS] == [caps[3]] * CC.SURE_ROUNDS and caps[3] > 0
    assert caps[3 + CC.SURE_ROUNDS] == 0  # parked right after the second losing round


def test_each_request_is_judged_on_its_own_rounds(eng):
    """A request that wins (copy-heavy code) leaves the controller speculating; the next one,
    on content where drafts fail, parks within a few rounds: the winning spell's record does
    not carry over to shield it."""
    ref = reference(eng)
    pays = M.Calibration.synthetic(lambda w: 1.2 + 0.05 * w, 8, plain_ms=1.0, draft=lambda c: 0.5)
    state = CC.LearnedState()
    good = Oracle(ref)
    ctrl = CC.CapController(pays, good.max_draft, state=state, warm_plain=C.WARM_PLAIN)
    run_auto(eng, good, ctrl, CostClock(eng.target, good, step=1.0, verify=lambda w: 1.2 + 0.05 * w, draft=0.5))
    assert not state.parked
    state.shrink()
    bad = Oracle(ref, right_from=10 ** 6)
    ctrl = CC.CapController(pays, bad.max_draft, state=state, warm_plain=C.WARM_PLAIN)
    tokens, stats = run_auto(eng, bad, ctrl, CostClock(eng.target, bad, step=1.0, verify=lambda w: 1.5, draft=3.0))
    assert tokens == ref
    caps = stats.caps[1:]
    assert caps[0] > 0  # after a clear win the request speculates from its first step (no warm plain steps)
    assert sum(1 for c in caps[: caps.index(0)] if c > 0) <= CC.SURE_ROUNDS


def test_warm_plain_steps_are_skipped_only_after_a_clear_win(eng):
    """Warm plain steps open a request unless the last one's latest rounds beat plain steps
    timed lately by CLEAR_WIN: after a clear win the next request drafts from its first step;
    after a narrow win, a parked request or with no plain step timed yet, the warm steps stay."""
    ref = reference(eng)
    pays = M.Calibration.synthetic(lambda w: 1.2 + 0.05 * w, 8, plain_ms=1.0, draft=lambda c: 0.5)

    def request(state, drafter, clock_verify, draft_ms):
        ctrl = CC.CapController(pays, drafter.max_draft, state=state, warm_plain=C.WARM_PLAIN)
        tokens, stats = run_auto(eng, drafter, ctrl, CostClock(eng.target, drafter, step=1.0, verify=clock_verify,
                                                               draft=draft_ms))
        assert tokens == ref
        return stats.caps[1:]

    clear = CC.LearnedState()
    first = request(clear, Oracle(ref), lambda w: 1.2 + 0.05 * w, 0.5)
    assert first[:C.WARM_PLAIN] == [0] * C.WARM_PLAIN  # no plain step timed yet
    assert clear.plain[0] > 0 and not clear.parked
    clear.shrink()
    assert clear.last_spell[0] >= 4 and clear.last_spell[1] / clear.last_spell[2] >= CC.CLEAR_WIN
    assert request(clear, Oracle(ref), lambda w: 1.2 + 0.05 * w, 0.5)[0] > 0
    # One-token drafts, all accepted: 2 tokens per 1.7 plain steps' time, a narrow win that keeps the warm steps.
    narrow = CC.LearnedState()
    request(narrow, Oracle(ref, max_draft=1), lambda w: 1.2, 0.5)
    narrow.shrink()
    assert not narrow.parked and narrow.last_spell[0] >= 4
    assert narrow.last_spell[1] / narrow.last_spell[2] < CC.CLEAR_WIN
    assert request(narrow, Oracle(ref), lambda w: 1.2 + 0.05 * w, 0.5)[:C.WARM_PLAIN] == [0] * C.WARM_PLAIN
    # A request that ended parked (drafts always wrong) leaves no spell to go by.
    lost = CC.LearnedState()
    request(lost, Oracle(ref, right_from=10 ** 6), lambda w: 1.5, 3.0)
    assert lost.parked
    lost.shrink()
    assert lost.last_spell == [0.0, 0.0, 0.0]
    assert request(lost, Oracle(ref), lambda w: 1.2 + 0.05 * w, 0.5)[:C.WARM_PLAIN] == [0] * C.WARM_PLAIN


def test_probes_that_keep_failing_stay_rare_on_later_requests(eng):
    """Each parked request probes once at its start (its content may pay), but a gap grown by
    failed probes is halved, not reset: a drafter that loses on every request costs few
    probes per request."""
    ref = reference(eng, 240)
    state = CC.LearnedState()
    probes = []
    for _ in range(3):
        if state.rounds:
            state.shrink()
        drafter = Oracle(ref, right_from=10 ** 6)
        ctrl = CC.CapController(optimistic_cal(), drafter.max_draft, state=state, warm_plain=3)
        tokens, stats = run_auto(eng, drafter, ctrl, CostClock(eng.target, drafter, step=1.0,
                                                               verify=lambda w: 1.5, draft=3.0), n=240)
        assert tokens == ref and state.parked
        probes.append(sum(1 for c in stats.caps[1:] if c > 0))
    assert probes[-1] <= 3 and probes[-1] < probes[0]
    assert state.probe_gap >= 4 * CC.PROBE_GAP


class CatchingUp(Oracle):
    """A draft model's costs on a launch-bound GPU: whatever it has not seen (the prompt, a
    parked run) costs ``per_token`` ms to feed, in ``catch_up`` before a round or else in the
    proposal; then the proposal itself (the clock's ``draft``)."""

    def __init__(self, ref, clock_ms: list, per_token: float, **kw):
        super().__init__(ref, **kw)
        self.clock_ms, self.per_token, self.seen = clock_ms, per_token, 0

    def begin(self, prompt_ids, hidden):
        self.seen = 0  # fed lazily, as DraftModelDrafter does

    def catch_up(self, ids):
        backlog = len(ids) - 1 - self.seen
        if backlog < 16:
            return 0
        self.clock_ms[0] += backlog * self.per_token
        self.seen = len(ids) - 1
        return backlog

    def propose(self, ids, cap, sampler):
        self.clock_ms[0] += max(0, len(ids) - self.seen) * self.per_token
        self.seen = len(ids)
        return super().propose(ids, cap, sampler)


def test_a_costly_probe_waits_for_its_budget_across_short_answers(eng):
    """Qwen2.5-Coder-1.5B with its 0.5B draft model on the H200: a probe feeds the draft model
    its backlog, then a round of several plain steps commits a token or two. Once parked, short
    answers (128 tokens) keep within a few per cent of plain steps: the probes' loss, catch-up
    included, waits for its budget across requests instead of coming at every request's start;
    yet the controller still looks now and then."""
    ref = reference(eng, 128)
    state = CC.LearnedState()
    spent, probes = [], []
    for request in range(7):
        if request:
            state.shrink()
        clock_ms = [0.0]
        drafter = CatchingUp(ref, clock_ms, per_token=0.1, right_from=10 ** 6)
        clock = CostClock(eng.target, drafter, step=1.0, verify=lambda w: 1.5, draft=3.0)
        ctrl = CC.CapController(optimistic_cal(), drafter.max_draft, state=state, warm_plain=3)
        timed = lambda: clock() + clock_ms[0] / 1000.0  # noqa: E731
        timed.close = clock.close
        tokens, stats = run_auto(eng, drafter, ctrl, timed, n=128)
        assert tokens == ref and state.parked
        spent.append(timed() * 1000.0)
        probes.append(sum(1 for c in stats.caps[1:] if c > 0))
    plain = 1.5 + (len(ref) - 1) * 1.0  # the prefill, then pipelined plain steps
    assert sum(spent[1:]) < plain * len(spent[1:]) * (1 + 1.5 * CC.PROBE_BUDGET)
    assert 1 <= sum(probes[1:]) < len(probes[1:])  # still looking, not at every request
    assert state.budget_gap() > CC.NEW_REQUEST_GAP


def test_rounds_are_judged_against_plain_steps_timed_at_their_own_pace(eng):
    """A machine's pace drifts (the H200's by up to 2x within a minute). A request that ended in
    a clear win on a slow spell, after many plain steps timed at that pace, lets the next one
    skip its warm steps; on a fast spell that one's rounds (one token for 2.2 plain steps) look
    even against the stale steps. It times plain steps at its own pace once its rounds stop
    winning clearly, and parks them."""
    ref = reference(eng, 128)
    state = CC.LearnedState()
    slow = Oracle(ref, right_from=30)  # wrong drafts, then right ones: parked, then a clear win
    clock = CostClock(eng.target, slow, step=3.0, verify=lambda w: 3.3, draft=1.5)
    tokens, stats = run_auto(eng, slow, CC.CapController(optimistic_cal(), slow.max_draft, state=state,
                                                        warm_plain=4), clock, n=128)
    assert tokens == ref and not state.parked and state.plain[0] > 8  # many plain steps timed at 3 ms
    state.shrink()
    fast = Oracle(ref, right_from=10 ** 6)  # every first draft rejected
    clock = CostClock(eng.target, fast, step=1.0, verify=lambda w: 1.7, draft=0.5)
    ctrl = CC.CapController(optimistic_cal(), fast.max_draft, state=state, warm_plain=4)
    tokens, stats = run_auto(eng, fast, ctrl, clock, n=128)
    assert tokens == ref
    caps = stats.caps[1:]
    assert caps[0] > 0  # the last request won clearly: no warm steps
    first_plain = caps.index(0)
    assert first_plain <= ctrl.min_rounds  # re-timed once the rounds stopped winning clearly
    assert ctrl.plain_ms() < 1.5 and state.parked
    assert sum(1 for c in caps if c > 0) <= ctrl.min_rounds + 4  # parked within a few rounds, probes apart


def test_a_calibration_timed_in_a_slow_minute_does_not_outweigh_the_request_s_own_steps(eng):
    """The calibration is timed once (on the H200 one read a plain step at 7.95 ms where the
    benchmark's ran at 4-5). Once a request has timed two plain steps they alone price a plain
    step, so rounds that lose two to one at the request's pace park after SURE_ROUNDS."""
    ref = reference(eng, 96)
    drafter = Oracle(ref, right_from=10 ** 6)  # one token a round
    clock = CostClock(eng.target, drafter, step=1.0, verify=lambda w: 1.7, draft=0.5)
    slow = M.Calibration.synthetic(lambda w: 3.0, 8, plain_ms=3.0)
    ctrl = CC.CapController(slow, drafter.max_draft, warm_plain=4)
    tokens, stats = run_auto(eng, drafter, ctrl, clock, n=96)
    assert tokens == ref
    caps = stats.caps[1:]
    assert caps[:4] == [0, 0, 0, 0] and abs(ctrl.plain_ms() - 1.0) < 1e-6
    assert caps[4 : 4 + CC.SURE_ROUNDS] == [caps[4]] * CC.SURE_ROUNDS and caps[4] > 0
    assert caps[4 + CC.SURE_ROUNDS] == 0  # parked after SURE_ROUNDS rounds, not after min_rounds


def test_a_parked_controller_unparks_when_acceptance_rises(eng):
    ref = reference(eng, 400)
    drafter = Oracle(ref, right_from=60)
    clock = CostClock(eng.target, drafter, step=1.0, verify=lambda w: 1.2 + 0.05 * w, draft=0.5)
    ctrl = CC.CapController(M.Calibration.synthetic(lambda w: 1.2 + 0.05 * w, 8, plain_ms=1.0,
                                                   draft=lambda c: 0.5), drafter.max_draft)
    tokens, stats = run_auto(eng, drafter, ctrl, clock, n=400)
    assert tokens == ref
    caps = stats.caps[1:]
    assert 0 in caps[:60]  # wrong drafts: parked early on
    assert not ctrl.state.parked and caps[-20:-1].count(0) == 0  # right drafts: speculating again
    assert max(caps[-20:]) > CC.PROBE_CAP


def test_a_cheap_draft_ends_a_parked_plain_run_for_a_probe(eng):
    """Copying starts mid-answer (a long n-gram match): the parked controller tries it the step
    the match appears, not at its next scheduled probe, and unparks on it."""
    ref = reference(eng, 240)

    class CopyLater(Oracle):
        def cheap_draft_ready(self, ids):
            return len(ids) - len(PROMPT) >= 120

    drafter = CopyLater(ref, right_from=120)  # wrong drafts before token 120, right (and cheap) after
    clock = CostClock(eng.target, drafter, step=1.0, verify=lambda w: 1.1, draft=3.0)
    ctrl = CC.CapController(optimistic_cal(), drafter.max_draft, warm_plain=3)
    tokens, stats = run_auto(eng, drafter, ctrl, clock, n=240)
    assert tokens == ref
    pos, starts = 0, []
    for (drafted, accepted), cap in zip(stats.rounds, stats.caps):
        starts.append((pos, cap))
        pos += accepted + 1 if cap else 1
    parked_from = next(p for p, c in starts[5:] if c == 0)
    assert parked_from < 40  # wrong drafts: parked early
    first_after = next(p for p, c in starts if c > 0 and p >= 120)
    assert first_after <= 122  # the match was tried at once (the next scheduled probe was far)
    assert not ctrl.state.parked and sum(1 for p, c in starts if p > 200 and c == 0) <= 1


def test_a_parked_run_that_starts_unwatched_is_watched_once_the_policy_looks_again(eng):
    """A cheap probe was just tried, so the long parked run that follows starts unwatched; once
    the policy watches again (its CHEAP_GAP elapsed) a cheap draft ends the run at that step,
    not at the run's end (a whole answer's copying went unseen that way on the H200 traces)."""
    ref = reference(eng, 60)

    class Cheap(Oracle):
        def cheap_draft_ready(self, ids):
            return True

    class WatchLater:
        def __init__(self):
            self.steps, self.told, self.history = 0, 0, []

        def cap(self):
            self.history.append(4 if self.told else 0)
            return self.history[-1]

        def plain_run(self):
            return 1000

        def watch_cheap_drafts(self):
            return self.steps >= 5

        def cheap_draft(self):
            self.told += 1

        def observe(self, drafted, accepted, seconds):
            self.steps += drafted == 0

    policy = WatchLater()
    out = [t for o, _ in decode(eng.target, Cheap(ref), PROMPT, Sampler(SamplingParams()), max_new_tokens=60,
                                cap_policy=policy) for t in o]
    assert out == ref
    assert policy.told == 1 and policy.history[:2] == [0, 4]  # one run, ended for the probe
    assert policy.steps == 6  # the step the watch began (the fifth was asked about the sixth's forward)


def test_lookup_calls_only_a_long_verbatim_match_cheap():
    from engine.drafters.lookup import STRONG_MATCH, LookupDrafter
    from engine.drafters.lookup_first import LookupFirst

    text = [7, 8, 9, 10, 11, 12, 13, 14, 1, 2]
    for drafter in (LookupDrafter(), LookupFirst(Oracle([], max_draft=4))):
        drafter.begin(text, None)
        assert not drafter.cheap_draft_ready(text)
        assert not drafter.cheap_draft_ready(text + text[: STRONG_MATCH - 1])  # a short match fires often on chat
        assert drafter.cheap_draft_ready(text + text[:STRONG_MATCH])


class Stretches(Oracle):
    """Knows when it has a draft (as n-gram lookup does): the target's own continuation inside
    ``stretches`` of generated positions, nothing elsewhere."""

    def __init__(self, ref: list[int], stretches: list[range]):
        super().__init__(ref)
        self.stretches = stretches

    def draft_ready(self, ids):
        return any(len(ids) - len(PROMPT) in s for s in self.stretches)

    def propose(self, ids, cap, sampler):
        return super().propose(ids, cap, sampler) if self.draft_ready(ids) else None


def test_a_drafter_with_nothing_to_propose_gets_pipelined_plain_steps_not_rounds(eng):
    """Lookup on chat: between matches the loop takes pipelined plain steps (an empty round
    would be an unpipelined step each), the controller prices them as plain steps, not as
    rounds, and drafts again where a match appears."""
    ref = reference(eng)
    stretches = [range(40, 60), range(100, 120)]
    drafter = Stretches(ref, stretches)
    clock = CostClock(eng.target, drafter, step=1.0, verify=lambda w: 1.4, draft=0.02)
    ctrl = CC.CapController(M.Calibration.synthetic(lambda w: 1.4, 8, plain_ms=1.0), drafter.max_draft, warm_plain=3)
    tokens, stats = run_auto(eng, drafter, ctrl, clock)
    assert tokens == ref
    rounds = [(d, c) for (d, _), c in zip(stats.rounds[1:], stats.caps[1:]) if c > 0]
    assert rounds and all(d > 0 for d, _ in rounds)  # no empty round: every verify had drafts
    assert ctrl.state.rounds == len(rounds) and not ctrl.state.parked  # plain steps are not rounds
    # rounds only in the stretches (a run ends one step after a draft is ready: the check runs
    # while the next forward is in flight, so it cannot see the token that forward feeds)
    before = np.cumsum([0] + [a + 1 for _, a in stats.rounds])  # tokens generated before each round
    assert all(any(g in s for s in stretches) for g, c in zip(before[1:], stats.caps[1:]) if c > 0)
    plain = stats.caps[1:].count(0)
    assert clock.plain_steps >= plain - 2 * len(stretches) - 3  # pipelined: one unpipelined start per run
    assert clock.now * 1000.0 < len(ref) - 30  # the stretches' rounds win; nothing else lost to syncs


def test_lookup_without_a_match_takes_plain_steps_and_stays_baseline(eng):
    """The real n-gram drafter under a fixed cap: no empty round, and greedy output is plain greedy's."""
    from engine.drafters.lookup import LookupDrafter

    copy = PROMPT * 3
    ref = [t for out, _ in decode(eng.target, None, copy, Sampler(SamplingParams()), max_new_tokens=120) for t in out]
    drafter = LookupDrafter(max_draft=8)
    stats = DecodeStats()
    tokens = [t for out, _ in decode(eng.target, drafter, copy, Sampler(SamplingParams()), max_new_tokens=120,
                                     stats=stats) for t in out]
    assert tokens == ref
    drafted = [d for (d, _), c in zip(stats.rounds[1:], stats.caps[1:]) if c > 0]
    assert drafted and all(d > 0 for d in drafted)  # a round only where lookup had a match
    assert 0 in stats.caps[1:]  # ... and plain steps between


def test_plain_runs_hand_back_the_exact_round_state(eng):
    """Rounds and plain runs interleave at every length and the output is still baseline's."""
    ref = reference(eng)
    drafter = Oracle(ref, right_from=0)

    class Alternating:
        def __init__(self):
            self.rng, self.last = random.Random(3), 0

        def cap(self):
            self.last = self.rng.choice([0, 0, 1, 3, 8])
            return self.last

        def plain_run(self):
            return self.rng.choice([1, 2, 5])

        def observe(self, drafted, accepted, seconds):
            pass

    stats = DecodeStats()
    tokens = [t for out, _ in decode(eng.target, drafter, PROMPT, Sampler(SamplingParams()), max_new_tokens=160,
                                     cap_policy=Alternating(), stats=stats) for t in out]
    assert tokens == ref and 0 in stats.caps[1:] and max(stats.caps) == 8


def test_seeded_auto_runs_are_reproducible_whatever_the_clock(eng, cache_dir):
    from engine.drafters.lookup import LookupDrafter

    C.calibrate(eng, "lookup", LookupDrafter(), passes=1, overhead_rounds=3, context=64)  # cached for both runs
    sampler = lambda: Sampler(SamplingParams(temperature=0.9, seed=11))  # noqa: E731
    copy = PROMPT * 4
    runs = {}
    for seeded in (True, False):
        for name, verify in (("fast", lambda w: 0.5), ("slow", lambda w: 40.0)):
            drafter = LookupDrafter()
            ctrl = C.auto_cap_policy(eng, "lookup", drafter, seeded=seeded)
            clock = CostClock(eng.target, drafter, step=1.0, verify=verify, draft=0.0)
            stats = DecodeStats()
            try:
                tokens = [t for out, _ in decode(eng.target, drafter, copy, sampler(), max_new_tokens=120,
                                                 cap_policy=ctrl, stats=stats, clock=clock) for t in out]
            finally:
                clock.close()
            runs[seeded, name] = (tokens, stats.caps)
    assert runs[True, "fast"] == runs[True, "slow"]  # same caps, same sampled tokens
    assert runs[False, "fast"][1] != runs[False, "slow"][1]  # live timings move the unseeded caps: the test has power


def test_seeded_generation_through_the_engine_is_reproducible(eng, cache_dir, monkeypatch):
    import time as _time

    rng = random.Random(0)
    real = _time.perf_counter
    monkeypatch.setattr(_time, "perf_counter", lambda: real() + rng.random() * 0.05)  # a jittery clock
    kw = dict(mode="lookup", max_draft="auto", max_new_tokens=40, temperature=0.8, seed=5)
    first = eng.generate(PROMPT * 3, **kw)
    second = eng.generate(PROMPT * 3, **kw)
    assert first.token_ids == second.token_ids and first.caps == second.caps


# ------------------------------------------------------------------ the calibrated confidence cut
def test_the_confidence_cut_follows_the_cost_curves():
    rng = random.Random(5)
    trace = []
    for _ in range(400):  # scores that predict acceptance: each slot survives with its score
        conf = [rng.uniform(0.05, 0.95) for _ in range(7)]
        accepted = 0
        while accepted < 7 and rng.random() < conf[accepted]:
            accepted += 1
        trace.append((conf, accepted))
    flat = M.Calibration.synthetic(lambda w: 10.0, 7, draft=lambda c: 2.0)  # a GPU: wide verifies cost nothing
    steep = M.Calibration.synthetic(lambda w: 10.0 * w, 7, draft=lambda c: 2.0)  # quantized CPU matmul
    rule, threshold, table = C.tune_cut(flat, trace, ("slot", 0.3))
    assert threshold <= 0.2 and table["none"] >= max(table.values()) / 1.011  # longer drafts are nearly free
    rule2, threshold2, table2 = C.tune_cut(steep, trace, ("slot", None))
    assert threshold2 >= 0.5  # every kept slot costs a full row: only confident ones pay
    assert table2[f"{rule2}@{threshold2:g}"] == max(table2.values())
    assert set(table) == {f"{r}@{t:g}" for r in ("slot", "product") for t in C.CUT_THRESHOLDS} | {"none"}


def test_calibration_traces_a_real_drafter_and_hands_it_the_cut(cache_dir, tmp_path):
    from tests.drafter_ckpt import target_config_of, dspark_checkpoint, copy_target_head, write

    eng = make_tiny_engine("qwen3", seed=4, scale=4.0)
    cfg, w = dspark_checkpoint(target_config_of(eng.model), markov_rank=16, taps=[0, 1, 2])
    copy_target_head(w, eng.model)
    w["confidence_head.proj.bias"] = np.array([0.5], dtype=np.float32)
    eng.drafter_path = str(write(tmp_path / "d", cfg, w))
    drafter = eng.drafter("dspark")
    assert drafter.cfg.confidence_head and drafter.calibrated is None
    trace = C.confidence_trace(eng, drafter, ["w5 w9 w14 w3", "w22 w7 w30"], max_new_tokens=16)
    assert trace and all(len(conf) == 7 and 0 <= acc <= 7 for conf, acc in trace)
    cal = C.calibrate(eng, "dspark", drafter, passes=1, overhead_rounds=3, context=64)
    assert cal.confidence_rule in ("slot", "product") and cal.confidence_threshold is not None
    assert drafter.calibrated == (cal.confidence_rule, cal.confidence_threshold) and drafter.trace is None
    assert "confidence cut" in C.format_report(cal)


def drive_parked(ctrl: CC.CapController, probe, steps: int = 400, run_ms=lambda i, n: 1.0) -> list[int]:
    """Feed a parked controller plain steps (``run_ms(i, n)`` ms for step i of a run of n; 1 ms
    each by default) and ``probe(cap) -> (drafted, accepted, s)`` rounds until ``steps`` tokens;
    returns the plain steps before each probe."""
    gaps, run = [], 0
    while steps > 0:
        cap = ctrl.cap()
        if cap == 0:
            n = ctrl.plain_run()
            for i in range(n):
                ctrl.observe(0, 0, run_ms(i, n) / 1000.0)
            run, steps = run + n, steps - n
        else:
            gaps.append(run)
            run = 0
            drafted, accepted, seconds = probe(cap)
            ctrl.observe(drafted, accepted, seconds)
            steps -= accepted + 1
    return gaps


@pytest.mark.parametrize("probe", [lambda cap: (cap, 0, 0.003),  # first draft rejected
                                   lambda cap: (1, 1, 0.003)],  # one confident draft, accepted: the drafter stopped
                         ids=["rejected", "short"])
def test_a_losing_probe_never_unparks_on_the_curves_word(probe):
    """Curves that promise speculation pays (as a GPU calibration did, 1.4x predicted for
    rounds that lost) must not unpark a controller whose probes lose: rejected ones, or ones
    the drafter itself cut short (a 1-token draft, accepted, at 3 plain steps' cost)."""
    state = CC.LearnedState(parked=True, rounds=20)
    ctrl = CC.CapController(optimistic_cal(), 8, state=state)
    def probe_while_parked(cap: int):
        assert state.parked  # never unparked by an earlier probe
        return probe(cap)

    gaps = drive_parked(ctrl, probe_while_parked)
    assert len(gaps) >= 3 and state.parked


def test_one_probe_that_holds_and_beats_plain_steps_unparks_at_once():
    """Content changes (prose, then code to copy): a probe whose drafts all held at a better
    rate than plain steps unparks at once, whatever the failed probes before it said."""
    stale = M.Calibration.synthetic(lambda w: 50.0 * w, 8)  # curves that say rounds lose
    # failed probes (1 token per 10 ms) and plain steps (1 ms) on record
    state = CC.LearnedState(parked=True, rounds=20, probes=[3.3, 3.3, 33.0], plain=[50.0, 50.0])
    ctrl = CC.CapController(stale, 8, state=state)
    assert ctrl.cap() > 0  # a parked request starts with a probe
    ctrl.observe(3, 0, 0.003)  # rejected
    assert state.parked
    drive_parked(ctrl, lambda cap: (cap, 0, 0.003), steps=100)  # more rejected probes
    assert state.parked
    while ctrl.cap() == 0:
        for _ in range(ctrl.plain_run()):
            ctrl.observe(0, 0, 0.001)
    ctrl.observe(3, 3, 0.003)  # 3 drafts (the drafter stopped by itself), all accepted: 4 tokens in 3 ms
    assert not state.parked


@pytest.mark.parametrize("drafted", [0, 4], ids=["empty", "rejected"])
def test_probes_back_off_only_when_they_cost_more_than_a_plain_step(drafted):
    """A probe that cost a drafter's call and committed one token (DSpark on a GPU: 2-2.7 plain
    steps, drafting nothing or drafting wrong) backs off; an n-gram lookup that found nothing or
    guessed wrong (about a plain step and a sync) costs too little to wait for."""
    costly = CC.CapController(optimistic_cal(), 8, state=CC.LearnedState(parked=True, rounds=20))
    gaps = drive_parked(costly, lambda cap: (min(drafted, cap), 0, 0.003))
    assert gaps[0] == 0  # a parked start probes at once
    assert all(g >= 2 ** i * CC.PROBE_GAP for i, g in enumerate(gaps[1:4], 1))  # doubling ...
    assert gaps[1] >= 0.5 * 2 / CC.PROBE_BUDGET  # ... and the budget: half the first probe's 2-step loss
    cheap = CC.CapController(optimistic_cal(), 8, state=CC.LearnedState(parked=True, rounds=20))
    gaps = drive_parked(cheap, lambda cap: (min(drafted, cap), 0, 0.0011))
    # nearly free (0.1 plain steps lost a probe): no doubling, as often as the budget allows
    assert set(gaps[1:]) == {max(CC.PROBE_GAP, round(0.1 / CC.PROBE_BUDGET))}


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_a_failed_probe_is_charged_the_pipeline_it_empties(backend):
    """A round empties the pipeline of queued plain steps: on a GPU whose step is mostly host
    work the first plain step after it takes ~1.5 steps (the H200 measured 1.48x). A rejected
    n-gram probe there costs its 1.3-step round and that half step: it loses 0.8 steps, not 0.3,
    and backs off. On the CPU backend a run reads 2 steps, 1, ..., ~0: no refill, so the same
    probe loses 0.3 steps and keeps the budget's gap."""
    run_ms = {"gpu": lambda i, n: 1.5 if i == 0 else 1.0,
              "cpu": lambda i, n: 2.0 if i == 0 else 0.02 if i == n - 1 else 1.0}[backend]
    ctrl = CC.CapController(optimistic_cal(), 8, state=CC.LearnedState(parked=True, rounds=20))
    gaps = drive_parked(ctrl, lambda cap: (min(4, cap), 0, 0.0013), steps=600, run_ms=run_ms)
    assert gaps[0] == 0 and len(gaps) >= 4
    if backend == "gpu":
        assert ctrl.refill_ms() == pytest.approx(0.5, abs=0.01)
        assert ctrl.state.probe_gap > CC.PROBE_GAP and min(gaps[3:]) >= 0.6 / CC.PROBE_BUDGET
    else:
        assert ctrl.refill_ms() < 0.05
        assert ctrl.state.probe_gap == CC.PROBE_GAP and max(gaps[1:]) <= 0.35 / CC.PROBE_BUDGET


def test_a_parked_controller_probes_each_new_request_and_unparks_on_fast_probes():
    cal = M.Calibration.synthetic(lambda w: 50.0 * w, 8)  # stale curves: every round loses
    state = CC.LearnedState(parked=True, probe_gap=CC.MAX_PROBE_GAP)  # parked by earlier requests
    state.shrink()
    assert state.probe_gap == CC.NEW_REQUEST_GAP > CC.PROBE_GAP  # not reset: failed probes stay rare
    ctrl = CC.CapController(cal, 8, state=state, warm_plain=3)
    caps = []
    for _ in range(12):
        cap = ctrl.cap()
        caps.append(cap)
        k = cap
        ctrl.observe(k, k, (0.02 if k else 0.05))  # rounds really take 20 ms for k + 1 tokens, steps 50 ms
    assert caps[:3] == [0, 0, 0] and caps[3] > 0  # the first probe right after the warm steps
    assert not ctrl.state.parked  # realized probes beat plain steps, whatever the stale curves say
    seeded = CC.CapController(cal, 8, state=CC.LearnedState(parked=True), seeded=True)
    for _ in range(40):
        k = seeded.cap()
        seeded.observe(k, k, 0.001)
    assert seeded.state.parked  # seeded: timings never move it (the curves say plain steps win)


@pytest.mark.parametrize("run_ms", [[2.0, 1.0, 1.0, 0.02], [1.3, 1.0, 1.0, 1.0]], ids=["cpu", "gpu"])
def test_plain_steps_are_timed_without_a_run_first_and_last_step(run_ms):
    """A run of pipelined plain steps on the CPU backend reads 2 steps, 1, 1, ~0 (reading a
    token waits for the step queued behind it too, so the last comes out already done); on a
    GPU the first fills the pipeline. Either way the plain step is the middle steps' 1 ms:
    counting the last would price plain steps at half their cost and park a winning drafter."""
    cal = M.Calibration.synthetic(lambda w: 1.0, 8, plain_ms=1.0)
    state = CC.LearnedState()
    for _ in range(5):  # five requests (a controller each, the state carried over): warm steps, a round
        state.shrink()
        ctrl = CC.CapController(cal, 8, state=state, warm_plain=4)
        assert ctrl.cap() == 0 and ctrl.plain_run() == 4
        for ms in run_ms:
            ctrl.observe(0, 0, ms / 1000.0)
        assert ctrl.cap() > 0
        ctrl.observe(2, 2, 0.002)
    assert state.plain[0] > 0 and state.plain[1] / state.plain[0] == pytest.approx(1.0)
    assert ctrl.plain_ms() == pytest.approx(1.0)
