"""--max-draft auto per batch width: the calibration's batched verify curves, the cost model at a
batch size, and a controller that speculates alone but parks in a batch where batched plain
steps win."""

from __future__ import annotations

import pytest

from engine.calibrate import BATCH_ROWS, calibrate
from engine.cap_controller import CapController
from engine.cost_model import Calibration, best_cap
from tests.tiny import make_tiny_engine


def batched(one_row: list[float], per_row_width: float) -> Calibration:
    """One-row curve ``one_row``; a batch of B rows costs the one-row step plus, per extra row and
    width, ``per_row_width`` ms (a machine where batching fills the compute)."""
    cal = Calibration.synthetic(one_row, max_cap=len(one_row) - 1, plain_ms=one_row[0], overhead_ms=0.1)
    cal.batch_widths = cal.widths[:6]
    cal.batch_verify_ms = {str(b): [one_row[0] + (b * w - 1) * per_row_width for w in cal.batch_widths]
                           for b in (2, 4, 8)}
    return cal


def test_at_batch_interpolates_and_scales_the_curves():
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)
    assert cal.at_batch(1) is cal
    four = cal.at_batch(4)
    assert four.verify(1) == cal.batch_verify_ms["4"][0] and four.verify(3) == cal.batch_verify_ms["4"][2]
    three = cal.at_batch(3)  # halfway between 2 and 4
    assert three.verify(2) == (cal.batch_verify_ms["2"][1] + cal.batch_verify_ms["4"][1]) / 2
    assert four.verify(9) > four.verify(6) > four.verify(1)  # beyond the measured widths: scaled like one row
    assert four.plain_ms == cal.plain_ms * four.verify(1) / cal.verify(1) and four.overhead_ms == 4 * cal.overhead_ms
    assert cal.at_batch(16).verify(2) == cal.batch_verify_ms["8"][1]  # past the largest batch: its curve
    assert Calibration.from_dict(cal.to_dict()).at_batch(4).verify(3) == four.verify(3)  # survives the cache



def test_a_batch_prices_its_drafts_as_measured_together_or_else_one_row_after_another():
    cal = Calibration.synthetic([10.0 + 0.5 * (w - 1) for w in range(1, 10)], max_cap=8, draft=lambda c: 2.0 * c)
    cal.batch_widths, cal.batch_verify_ms = cal.widths[:6], {"4": [20.0 + w for w in cal.widths[:6]]}
    assert cal.at_batch(4).draft(3) == 4 * cal.draft(3)  # row by row: four drafts' time
    cal.batch_draft_scale = {"2": 1.1, "4": 1.3, "8": 2.0}  # proposed together, as measured
    assert cal.at_batch(4).draft(3) == pytest.approx(1.3 * cal.draft(3))
    assert cal.at_batch(3).draft(3) == pytest.approx(1.2 * cal.draft(3))  # between the sizes measured
    assert cal.at_batch(16).draft(3) == pytest.approx(4.0 * cal.draft(3))  # past them: growing with the rows
    assert Calibration.from_dict(cal.to_dict()).at_batch(4).draft(3) == cal.at_batch(4).draft(3)

def test_auto_parks_in_a_batch_where_batched_plain_steps_win():
    # Alone a verify of 5 costs 1.2 plain steps (memory-bound): cap > 0 at p = 0.7. In a batch of 8
    # every extra row-width costs 2 ms of a 10 ms step: plain steps win.
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)
    assert best_cap(cal, 0.7) > 0 and best_cap(cal.at_batch(8), 0.7) == 0
    policy = CapController(cal, 8)
    policy.batch_rows(8)
    assert policy.cal.verify(2) == cal.at_batch(8).verify(2)
    seeded = CapController(cal, 8, seeded=True)
    seeded.batch_rows(8)
    assert seeded.cal is cal  # a seeded request's caps do not depend on the batch


def test_calibration_measures_batched_verify_curves():
    eng = make_tiny_engine("llama")
    cal = calibrate(eng, "lookup", recalibrate=True, passes=1, context=64, overhead_rounds=2)
    assert sorted(int(b) for b in cal.batch_verify_ms) == list(BATCH_ROWS)
    assert cal.batch_widths == [w for w in cal.widths if w <= 9]
    for b, curve in cal.batch_verify_ms.items():
        assert len(curve) == len(cal.batch_widths) and all(ms > 0 for ms in curve)
    assert cal.at_batch(4).verify(1) > 0


def _rows(policies_and_drafts):
    """Rows (``batch_width`` reads their cap policies) and their plans (cap, drafts, Draft)."""
    from types import SimpleNamespace

    rows = [SimpleNamespace(cap_policy=p) for p, _ in policies_and_drafts]
    plans = [(len(d), list(d), None) for _, d in policies_and_drafts]
    return rows, plans


def _speculating(cal: Calibration, p: float, rows: int = 4, **kw) -> CapController:
    policy = CapController(cal, 8, **kw)
    policy.state.p = p
    policy.batch_rows(rows)
    policy._last_cap = 8  # as after cap() said 8
    return policy


def test_batch_width_cuts_drafts_the_batch_does_not_pay_for():
    from engine.batch import batch_width
    from engine.speculative import FixedCap

    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)
    plain = [(FixedCap(0), [])] * 3
    weak = _speculating(cal, 0.2)
    rows, plans = _rows(plain + [(weak, [1] * 8)])
    # one row's 8 weak drafts would make four rows pay a 9-wide forward: cut to a narrow one
    assert batch_width(rows, plans, weak) <= 2
    strong = [_speculating(cal, 0.95) for _ in range(4)]
    rows, plans = _rows([(p, [1] * 8) for p in strong])
    assert batch_width(rows, plans, strong[0]) > 4  # every row gains from the width
    # the ratio it maximises, checked by hand over every width
    def rate(w):
        return sum(p.expected_table()[min(8, w - 1)] for p in strong) / strong[0].round_ms(w)
    assert batch_width(rows, plans, strong[0]) == max(range(1, 10), key=rate)
    seeded = _speculating(cal, 0.2, seeded=True)
    rows, plans = _rows(plain + [(weak, [1] * 8), (seeded, [1] * 5)])
    assert batch_width(rows, plans, weak) == 6  # a seeded row's drafts are never cut
    rows, plans = _rows([(FixedCap(8), [1] * 8), (weak, [1] * 8)])
    assert batch_width(rows, plans, weak) == 9  # nor a fixed cap's
    assert batch_width(rows, plans, None) == 9  # no controller to price the forward: the widest


def test_a_cut_round_is_learned_at_the_cut_and_a_cut_to_nothing_is_a_plain_step():
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)
    policy = CapController(cal, 8)
    policy.state.cap = 8
    assert policy.cap() == 8 and policy.trimmable()
    policy.trim(3)
    policy.observe(3, 3, 0.02)  # all three accepted: censored at the cut, not a natural length of 3
    assert policy.state.events[3] == 0 and policy.state.at_risk[2] > 0
    assert policy.cap() == 8
    policy.trim(0)
    rounds = policy.state.rounds
    policy.observe(0, 0, 0.01)
    assert policy.state.rounds == rounds  # a plain step, not a round
    parked = CapController(cal, 8)
    parked.state.parked, parked.state.since_probe = True, 10**6
    assert parked.cap() > 0 and not parked.trimmable()  # a probe is never cut


def test_a_speculating_row_parks_the_round_it_joins_a_batch_where_plain_steps_win():
    """What a controller learned of the content (acceptance) is judged at the new width's costs as
    soon as the width changes, not after its next few rounds."""
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)
    policy = CapController(cal, 8)
    policy.state.p, policy.state.rounds = 0.7, policy.park_after
    policy._repick()
    assert not policy.state.parked and policy.state.cap > 0
    policy.batch_rows(8)
    assert policy.state.parked
    seeded = CapController(cal, 8, seeded=True)
    seeded.state.p, seeded.state.rounds, seeded.state.cap = 0.7, seeded.park_after, 3
    seeded.batch_rows(8)
    assert not seeded.state.parked  # a seeded request's caps do not follow the batch



def test_where_no_draft_can_pay_a_row_parks_at_once_and_never_probes():
    """In a batch whose forward grows so fast with its width that even drafts that all hold lose
    to plain steps (a wide batch on a compute-bound machine: a 1.5B target at four rows on two
    CPU cores), a probe can only lose: a row parks the moment it joins such a width and probes
    nothing there; alone again, it speculates at the cap it had (its parking was the width's, not
    its content's), while a row that was parked before keeps probing."""
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=20.0)
    policy = CapController(cal, 5)  # verify widths up to 6: the batch curves' own
    assert not policy._hopeless(calibrated=True) and not policy.state.parked
    policy.batch_rows(8)
    assert policy._hopeless(calibrated=True) and policy.state.parked
    policy.state.since_probe = 10**6
    assert [policy.cap() for _ in range(50)] == [0] * 50
    policy.batch_rows(1)
    assert not policy._hopeless(calibrated=True) and not policy.state.parked and policy.cap() == policy.state.cap > 0
    parked = CapController(cal, 5)
    parked.state.parked = True
    parked.batch_rows(8)
    parked.state.since_probe = 10**6
    assert parked.cap() == 0
    parked.batch_rows(1)
    assert parked.state.parked and parked.cap() > 0  # the probe it owes

def test_a_parked_row_probes_batch_width_times_rarer():
    """A probe widens a forward every row of the batch pays for: a parked controller in a batch of
    4 waits four times the plain steps it waits alone; a seeded one keeps its own schedule."""
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)

    def plain_steps_before_probe(policy):
        policy.state.parked, policy.state.since_probe, policy.state.probe_gap = True, 0, 8
        steps = 0
        while policy.cap() == 0:
            policy.observe(0, 0, 0.01)
            steps += 1
        return steps

    alone, seeded, batched4 = CapController(cal, 8), CapController(cal, 8, seeded=True), CapController(cal, 8)
    for policy in (seeded, batched4):
        policy.batch_rows(4)
    assert plain_steps_before_probe(alone) == 8 and plain_steps_before_probe(seeded) == 8
    assert plain_steps_before_probe(batched4) == 32


def test_rows_learn_on_their_own_state_and_hand_it_back():
    from engine.batch import BatchLoop, BatchRow
    from engine.cap_controller import LearnedState
    from engine.sampling import Sampler, SamplingParams

    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)
    shared = LearnedState()
    first, second = CapController(cal, 8, state=shared), CapController(cal, 8, state=shared)
    eng = make_tiny_engine("llama")
    loop = BatchLoop(eng.target, max_batch=2)
    rows = [loop.add(BatchRow([1, 2, 3], Sampler(SamplingParams()), 4, cap_policy=p)) for p in (first, second)]
    assert first.state is not shared and second.state is not shared and first.state is not second.state
    first.state.p = 0.123
    second.state.p = 0.456
    loop.remove(rows[0])
    assert first.state is shared and shared.p == 0.123
    shared.shrink()  # a new request's start does not touch the one still in flight
    assert second.state.p == 0.456
    loop.remove(rows[1])
    assert second.state is shared and shared.p == 0.456


def test_max_batch_default_is_the_widest_batch_that_still_pays():
    from engine.batching import BATCH_GAIN, widest_paying_batch

    # memory-bound: an extra row costs 0.2 ms of a 10 ms step, every doubling nearly doubles the rate
    assert widest_paying_batch(batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=0.2)) == 8
    # compute-bound: an extra row costs a whole step, no batch pays
    assert widest_paying_batch(batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=10.0)) == 1
    # in between: 2 rows pay, 4 no longer by BATCH_GAIN over 2
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=6.0)
    rate = {b: b / cal.at_batch(b).verify(1) for b in (1, 2, 4)}
    assert rate[2] >= BATCH_GAIN * rate[1] and rate[4] < BATCH_GAIN * rate[2]
    assert widest_paying_batch(cal) == 2


def test_server_max_batch_comes_from_the_targets_calibration(tmp_path, monkeypatch):
    from engine.batching import DEFAULT_MAX_BATCH, default_max_batch, widest_paying_batch
    from engine.calibrate import target_calibrations

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # a machine that calibrated nothing yet
    eng = make_tiny_engine("gemma3")
    assert target_calibrations(eng) == [] and default_max_batch(eng) == DEFAULT_MAX_BATCH
    cal = calibrate(eng, "lookup", recalibrate=True, passes=1, context=64, overhead_rounds=2)
    (cached,) = target_calibrations(eng)
    assert cached.batch_verify_ms == cal.batch_verify_ms
    assert default_max_batch(eng) == widest_paying_batch(cal)
    assert target_calibrations(make_tiny_engine("llama")) == []  # another target's are not its own


def test_a_batch_cuts_one_rows_weak_drafts_and_its_answer_stays_the_same():
    """Three rows on a real target: two plain, one whose controller (acceptance 0.2) drafts 8
    tokens each round on a machine where each extra row-width costs a whole step. The batch
    verifies none of them (every forward is one row wide), never asks the drafter for them (even
    8 drafts would be cut), keeps its plain steps queued, asks the controller again after 4 and
    then 8 plain steps (a cut doubles the wait), and the row's answer is its greedy one."""
    from engine.batch import BatchLoop, BatchRow
    from engine.sampling import Sampler, SamplingParams
    from engine.speculative import FixedCap
    from tests.tiny import FixedDrafter

    eng = make_tiny_engine("llama")
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=10.0)
    weak = CapController(cal, 8)
    weak.state.p, weak.state.cap = 0.2, 8
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    widths = []
    verify_rows = eng.target.verify_rows

    def recording(ids, row_caches, **kw):
        widths.append(int(ids.shape[1]))
        return verify_rows(ids, row_caches, **kw)

    eng.target.verify_rows = recording
    loop = BatchLoop(eng.target, max_batch=3)
    budgets = [24, 24, 12]  # the plain rows outlast the weak one: it decodes at a width of three throughout
    rows = [loop.add(BatchRow(p, Sampler(SamplingParams()), n, cap_policy=FixedCap(0)))
            for p, n in zip(prompts[:2], budgets)]
    drafter = FixedDrafter([1] * 8)
    asked = []
    drafter.propose = lambda ids, cap, sampler: asked.append(cap) or FixedDrafter.propose(drafter, ids, cap, sampler)
    rows.append(loop.add(BatchRow(prompts[2], Sampler(SamplingParams()), budgets[2], drafter=drafter,
                                  cap_policy=weak)))
    tokens = {id(r): [] for r in rows}
    chained = []  # per round of all three rows: was the next one queued before its tokens were read?
    while loop.busy:
        for e in loop.step():
            tokens[id(e.row)].extend(e.tokens)
        if loop.last_width == 3 and all(r.decoding for r in rows):
            chained.append(loop._flight is not None)
    del eng.target.verify_rows
    assert widths and set(widths) == {1}  # no forward carried the weak drafts
    assert all(d == 0 for d, _ in rows[2].stats.rounds) and weak.history[0] == 8
    assert asked == [] and weak.history == [8, 8] and rows[2].cuts == 2  # rounds 1 and 6 of 11 (not 11 too)
    assert len(chained) > 5 and all(chained)  # a cut known before the round keeps the plain steps queued
    for r, p, n in zip(rows, prompts, budgets):
        assert tokens[id(r)] == eng.generate(p, mode="baseline", max_new_tokens=n, prefix_cache=False).token_ids


def test_a_request_that_parked_in_a_batch_leaves_the_engine_its_acceptance_not_its_parking():
    """A row detaches from the engine's learned state, parks at a width of four (batched plain
    steps win there) and leaves: the engine's next lone request keeps the engine's own cap and
    parking but learns the row's acceptance. A row that decoded alone hands back everything."""
    from engine.cap_controller import LearnedState

    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)
    shared = LearnedState(p=0.7, cap=4)
    row = CapController(cal, 8, state=shared)
    row.detach()
    row.batch_rows(4)
    row.state.p, row.state.rounds = 0.55, 20
    row._park()
    row.batch_rows(1)  # the others left before it did
    row.rejoin()
    assert row.state is shared and not shared.parked and shared.cap == 4  # the engine's own economics
    assert shared.p == 0.55 and shared.rounds == 20  # what the row learned of the content
    alone = CapController(cal, 8, state=shared)
    alone.detach()
    alone._park()
    alone.rejoin()
    assert shared.parked  # one row's forwards: its parking is the engine's


def test_a_batch_decision_reads_each_rows_controller_once():
    """A batch weighs every verify width for every row each time a row asks to draft, on a GPU
    where a tick of a small model is ~10 ms of host work: each row's acceptance and draft
    lengths are read once per decision (one table of what each cap is worth), not once per
    width and row (28 reads for four rows weighing 7 widths cost ~0.3 ms a decision here), and
    the decision is the one the per-cap reading gives."""
    from types import SimpleNamespace

    from engine.batch import _uncut, _worth, _worths, batch_width

    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=0.2)
    policies = [_speculating(cal, p) for p in (0.3, 0.5, 0.7, 0.9)]
    for policy in policies:
        for drafted, accepted in ((8, 2), (3, 3), (8, 8), (5, 1)):
            policy._last_cap = 8
            policy.observe(drafted, accepted, 0.02)
        policy._last_cap = 8
    rows = [SimpleNamespace(cap_policy=p, cuts=0, run_left=0, run_stop=None, cut_width=0) for p in policies]
    before, after = _worths(rows, None, before=True), _worths(rows, None)
    for policy, at_cap, drafted in zip(policies, before, after):
        for k in range(10):
            assert _worth(at_cap, k) == pytest.approx(_per_cap(policy, k, before=True))
            assert _worth(drafted, k) == pytest.approx(_per_cap(policy, k))
    reads = []
    for policy in policies:
        acceptance = policy.acceptance
        policy.acceptance = lambda acceptance=acceptance: reads.append(1) or acceptance()
    _uncut([7, 0, 3, 0], rows, after_plain=True)
    assert len(reads) == len(rows)
    reads.clear()
    plans = [(8, [1] * n, None) for n in (7, 0, 3, 5)]
    batch_width(rows, plans, policies[0])
    assert len(reads) == len(rows)


def _per_cap(policy: CapController, k: int, before: bool = False) -> float:
    """Tokens a round of ``k`` drafts commits, position by position (what the table must hold)."""
    tokens, reach, survival = 1.0, 1.0, policy.survival()
    for i, a in enumerate(policy.acceptance()[1 : min(k, policy.max_cap) + 1], start=1):
        reach *= a
        tokens += (survival[i] if before else 1.0) * reach
    return tokens


def test_nobody_drafts_where_a_round_loses_to_a_queued_plain_step_of_every_row():
    """The batch's judge of widths prices a round with no drafts as a round; whether to draft at
    all is priced against what the batch does instead: a queued plain step of every row, which
    on a GPU costs about half a round. There four rows of drafts that pay against a round lose
    to it, and nobody drafts; where a plain step costs a round, they draft."""
    from types import SimpleNamespace

    from engine.batch import _uncut, batch_width

    def four_rows(plain_ms: float):
        cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=0.2)
        cal.plain_ms = plain_ms
        return [SimpleNamespace(cap_policy=_speculating(cal, 0.5), cuts=0, run_left=0, run_stop=None)
                for _ in range(4)]

    rows = four_rows(plain_ms=5.0)
    assert batch_width(rows, [(3, [0] * 3, None)] * 4, rows[0].cap_policy) > 1  # against a round: draft
    assert _uncut([3, 3, 3, 3], rows) == [0, 0, 0, 0] and all(r.cuts == 1 and r.run_left for r in rows)
    rows = four_rows(plain_ms=10.5)
    assert _uncut([3, 3, 3, 3], rows) == [3, 3, 3, 3]
    # where a round empties a pipeline of queued plain steps that takes a round's time to refill,
    # it loses to them; between rounds (nothing queued to empty) it still pays
    rows[0].cap_policy.state.refill = [1.0, 10.0]
    assert _uncut([3, 3, 3, 3], rows, after_plain=False) == [3, 3, 3, 3]
    assert _uncut([3, 3, 3, 3], rows, after_plain=True) == [0, 0, 0, 0]


def test_a_draft_models_catch_up_is_priced_over_the_tokens_left_to_pay_it_back():
    """A row whose draft model has a backlog (the prompt, or the plain steps the batch cut it to)
    pays a catch-up before it can draft, measured by its drafter (``backlog_ms``). The batch
    spreads it over the row's tokens still to come: near the end of a request the rows do not
    start on it for a token or two (on this CPU three such catch-ups of a 0.5B draft model took
    3 s each for one token each); with many tokens to come, or nothing to feed, they draft."""
    from types import SimpleNamespace

    from engine.batch import _uncut
    from engine.drafters.draft_model import DraftModelDrafter
    from tests.tiny import make_tiny_model

    base = DraftModelDrafter(make_tiny_model("llama", seed=5), max_draft=4)
    prompt = [(5 * i + 3) % 60 + 2 for i in range(41)]
    base.begin(prompt[:-1], None)
    assert base.backlog_ms(prompt) == 0.0  # fed nothing yet, so its pace is not known
    assert base.catch_up(prompt) == 40 and base.pace.ms_per_token > 0  # measured as it fed
    assert base.backlog_ms(prompt) == 0.0 and base.backlog_ms(prompt + [7] * 15) == 0.0  # a short one rides the round

    def four_rows(generated: int, max_new_tokens: int, backlog: int):
        cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=0.2)
        cal.plain_ms = 10.5
        rows = []
        for _ in range(4):
            drafter = base.fork()
            drafter.begin(prompt[:-1], None)  # a fresh row: its prompt is its backlog
            ids = prompt[: backlog + 1] if backlog else []
            rows.append(SimpleNamespace(cap_policy=_speculating(cal, 0.5), cuts=0, run_left=0, run_stop=None,
                                        drafter=drafter, stats=SimpleNamespace(ids=ids), generated=generated,
                                        max_new_tokens=max_new_tokens))
        return rows

    base.pace.ms_per_token = 1.0  # the forks share it: 40 tokens to feed cost 40 ms a row
    assert _uncut([3, 3, 3, 3], four_rows(0, 64, backlog=0)) == [3, 3, 3, 3]  # nothing to feed: as before
    assert _uncut([3, 3, 3, 3], four_rows(60, 64, backlog=40)) == [0, 0, 0, 0]  # four tokens left
    assert _uncut([3, 3, 3, 3], four_rows(400, 1000, backlog=40)) == [3, 3, 3, 3]  # hundreds to come


def test_a_row_cut_in_a_batch_drafts_again_once_it_is_alone():
    """The plain run a cut imposes belongs to the width it was cut at: when the other rows leave,
    the row asks its controller at once (alone its drafts are its own to pay) instead of waiting
    out a run meant for a batch of three."""
    from engine.batch import BatchLoop, BatchRow
    from engine.sampling import Sampler, SamplingParams
    from engine.speculative import FixedCap
    from tests.tiny import FixedDrafter

    eng = make_tiny_engine("llama")
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=10.0)
    weak = CapController(cal, 8)
    weak.state.p, weak.state.cap = 0.2, 8
    loop = BatchLoop(eng.target, max_batch=3)
    plain = [loop.add(BatchRow(p, Sampler(SamplingParams()), 20, cap_policy=FixedCap(0)))
             for p in ([5, 6, 7, 8], [9, 10, 11])]
    drafter = FixedDrafter([1] * 8)
    asked = []
    drafter.propose = lambda ids, cap, sampler: asked.append(len(ids)) or FixedDrafter.propose(drafter, ids, cap, sampler)
    row = loop.add(BatchRow([12, 13, 14, 15, 16], Sampler(SamplingParams()), 40, drafter=drafter, cap_policy=weak))
    alone_from = None
    while loop.busy:
        loop.step()
        if alone_from is None and all(r.done for r in plain):
            alone_from = len(row.stats.ids)
    assert row.cuts == 0 and alone_from is not None and asked  # cut with the others, drafting after
    assert asked[0] <= alone_from + 1  # at its first round alone, not CUT_RUN (or more) rounds later


def test_a_parked_row_in_a_batch_is_judged_by_its_probes_not_by_the_step_before_them():
    """The batch asks a row whose plain run ends for its next plan while the run's last step is
    still in flight (so that plain steps stay queued where nobody drafts). The controller then
    hears of that step as a plain step read after the plan: taken for the probe it planned, the
    probe was judged by a plain step's time and tokens (never a loss, so never rarer), and the
    step went into the fits as a round whose drafter proposed nothing."""
    from engine.batch import BatchLoop, BatchRow
    from engine.sampling import Sampler, SamplingParams
    from engine.speculative import FixedCap
    from tests.tiny import FixedDrafter

    eng = make_tiny_engine("llama")
    cal = batched([10.0 + 0.5 * (w - 1) for w in range(1, 10)], per_row_width=2.0)
    policy = CapController(cal, 8)
    policy.state.parked, policy.state.rounds, policy.state.probe_gap = True, 20, 2
    seen = []
    observe = policy.observe
    policy.observe = lambda k, n, s: seen.append((policy._last_cap, policy._probing, k)) or observe(k, n, s)
    loop = BatchLoop(eng.target, max_batch=3)
    for p in ([5, 6, 7, 8], [9, 10, 11]):
        loop.add(BatchRow(p, Sampler(SamplingParams()), 40, cap_policy=FixedCap(0)))
    row = loop.add(BatchRow([12, 13, 14, 15, 16], Sampler(SamplingParams()), 40, drafter=FixedDrafter([1] * 8),
                            cap_policy=policy))
    while loop.busy:
        loop.step()
    probes = [k for cap, probing, k in seen if probing and cap > 0]
    assert probes and all(k > 0 for k in probes)  # each probe observed as its own round
    assert all(k > 0 for cap, _, k in seen if cap > 0)  # the drafter always proposes: no empty rounds
    assert sum(1 for c in row.stats.caps if c > 0) == len(probes)
