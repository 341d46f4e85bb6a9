"""Costs at a long context: the calibration's second measurement (the target's caches lengthened
by repeating their rows), ``Calibration.at_context`` pricing any length from the two, and
``--max-draft auto`` following the sequence's length: it parks where a long context makes
speculation lose, and its live cost fit carries over between short and long requests."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine import caches
from engine import calibrate as C
from engine.api import generate_batch
from engine.cap_controller import CONTEXT_STEP, CapController
from engine.cost_model import Calibration, best_cap, rates
from tests.tiny import make_tiny_engine

LONG = 4096


def short_ms(w: int) -> float:
    return 10.0 + 0.5 * (w - 1)  # at 512 tokens a verify of 17 rows costs 1.8 plain steps


def per_token(w: int) -> float:
    return 0.001 + 0.02 * (w - 1)  # ms per token of context: wide verifies read the context once per row


def mild(w: int) -> float:
    return 0.001 + 0.001 * (w - 1)  # ms per token of context where speculation still pays at 8k tokens


def forced(max_cap: int = 16, context: int = 512, long_context: int = LONG, per_token=per_token) -> Calibration:
    """Curves where speculation wins at ``context`` and (``per_token``) loses past a few thousand tokens."""
    cal = Calibration.synthetic(short_ms, max_cap, plain_ms=short_ms(1) + 0.5, overhead_ms=0.2,
                                draft=lambda c: 1.0 + 0.1 * c)
    cal.context, cal.long_context = context, long_context
    cal.long_widths = [1, 2, 4, 8, max_cap + 1]
    cal.long_verify_ms = [short_ms(w) + (long_context - context) * per_token(w) for w in cal.long_widths]
    cal.long_caps = [1, max_cap]
    cal.long_draft_ms = [cal.draft(c) + (long_context - context) * 0.0005 for c in cal.long_caps]
    return cal


# ------------------------------------------------------------------ the cost model
def test_at_context_prices_measured_points_and_extrapolates_linearly():
    cal = forced()
    assert cal.at_context(512) is cal and cal.at_context(100) is cal  # the curves as measured
    at_long = cal.at_context(LONG)
    for w, ms in zip(cal.long_widths, cal.long_verify_ms):
        assert at_long.verify(w) == pytest.approx(ms)
    assert at_long.verify(3) == pytest.approx(short_ms(3) + (LONG - 512) * per_token(3))  # slopes interpolate
    far = cal.at_context(16384)
    extra = 16384 - 512
    assert far.verify(1) == pytest.approx(short_ms(1) + extra * per_token(1))
    assert far.plain_ms == pytest.approx(cal.plain_ms + extra * per_token(1))  # a plain step grows like verify(1)
    assert far.draft(16) == pytest.approx(cal.draft(16) + extra * 0.0005)
    assert far.context == 16384 and far.at_context(20000) is far  # priced once, not twice
    assert Calibration.from_dict(cal.to_dict()).at_context(16384).verify(9) == pytest.approx(far.verify(9))
    assert Calibration.synthetic(short_ms, 16).at_context(16384).verify(9) == short_ms(9)  # nothing measured


def test_a_long_curve_below_the_short_one_never_makes_a_context_cheaper():
    cal = forced()
    cal.long_verify_ms = [ms - 5.0 for ms in cal.verify_ms[:1]] + cal.long_verify_ms[1:]  # noise at width 1
    assert cal.at_context(32768).verify(1) == cal.verify(1)


def test_batched_curves_grow_with_every_row_reading_its_own_context():
    cal = forced()
    cal.batch_widths = [1, 2, 3]
    cal.batch_verify_ms = {"2": [12.0, 13.0, 14.0], "4": [15.0, 17.0, 19.0]}
    far = cal.at_context(8192)
    extra = 8192 - 512
    assert far.batch_verify_ms["4"][1] == pytest.approx(17.0 + 4 * extra * per_token(2))
    assert far.at_batch(4).verify(2) == pytest.approx(far.batch_verify_ms["4"][1])


# ------------------------------------------------------------------ --max-draft auto
def test_auto_parks_where_long_context_makes_speculation_lose():
    cal = forced()
    assert best_cap(cal, 1.0) > 0 and max(rates(cal.at_context(16384), 1.0)[1:]) < rates(cal.at_context(16384), 1.0)[0]
    for seeded in (False, True):
        short = CapController(cal, 16, seeded=seeded)
        short.context(300)
        assert not short.state.parked and short.cap() > 0
        long = CapController(cal, 16, seeded=seeded)
        long.context(16384 + 5)
        assert long.priced_context == 16384 and long.state.parked and long.cap() == 0
        assert long.plain_run() >= 1
    unmeasured = Calibration.synthetic(short_ms, 16, plain_ms=10.5, overhead_ms=0.2)
    blind = CapController(unmeasured, 16)
    blind.context(16384)
    assert not blind.state.parked  # no long measurement: priced as before


def test_live_cost_fit_is_kept_at_the_calibration_context():
    """Rounds timed at 8k tokens just as the curves priced there say leave the fit on the
    calibration (no drift), and a later short request is priced short again."""
    cal = forced(per_token=mild)
    ctrl = CapController(cal, 16)
    ctrl.context(8192)
    at = cal.at_context(8192)
    for _ in range(60):
        cap = ctrl.cap()
        assert cap > 0
        k = min(3, cap)
        ctrl.observe(k, k, (at.verify(k + 1) + at.draft(cap) + at.overhead_ms) / 1000)  # rounds that pay
    c0, c1 = ctrl.cost_fit()
    assert c0 == pytest.approx(cal.verify(1) + cal.overhead_ms, rel=0.05) and c1 == pytest.approx(1.0, abs=0.1)
    assert ctrl.corrected().verify(5) == pytest.approx(at.verify(5) + at.overhead_ms, rel=0.05)
    ctrl.context(600)
    assert ctrl.corrected().verify(1) == pytest.approx(cal.verify(1) + cal.overhead_ms, rel=0.05)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_engine(scale=4.0)


def test_the_loop_tells_the_policy_the_context_alone_and_in_a_batch(tiny):
    """Through the real verify loop: a long prompt (past where the forced curves lose) parks
    from the first step, a short one speculates; both lossless."""
    cal = forced(max_cap=8, context=64, long_context=256)  # the tiny model's "long" is a few hundred tokens
    lookup = tiny.drafter("lookup")
    for length, parked in ((40, False), (1200, True)):
        prompt = [5 + (i % 11) for i in range(length)]
        base = tiny.generate(prompt, mode="baseline", max_new_tokens=12, prefix_cache=False)
        for run in ("alone", "batch"):
            policy = CapController(cal, lookup.max_draft, seeded=True)  # the curves decide, not this machine's clock
            if run == "alone":
                got = tiny.generate(prompt, mode="lookup", cap_policy=policy, max_new_tokens=12, prefix_cache=False)
            else:
                got = generate_batch(tiny, [prompt], mode="lookup", cap_policy=policy, max_new_tokens=12,
                                     prefix_cache=False)[0]
            assert got.token_ids == base.token_ids
            assert policy.priced_context == length // CONTEXT_STEP * CONTEXT_STEP
            assert policy.state.parked == parked and (policy.history[0] == 0) == parked, (length, run)


# ------------------------------------------------------------------ measuring
def test_repeated_rows_lengthen_the_cache_without_a_prefill(tiny):
    target = tiny.target
    cache = target.new_cache()
    target.prefill(list(range(5, 45)), cache)
    caches.repeat_rows(cache, 300)
    assert caches.length(cache) == 300
    logits, _, txn = target.verify(mx.array([[7, 8, 9]], dtype=mx.uint32), cache)
    assert logits.shape[0] == 3
    txn.commit(1)
    assert caches.length(cache) == 301


def test_calibration_measures_costs_at_a_long_context(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    eng = make_tiny_engine()
    cal = C.calibrate(eng, "lookup", recalibrate=True, passes=1, context=64, overhead_rounds=2)
    assert cal.context == 64 and cal.long_context == C.LONG_CONTEXT * 64
    assert cal.long_widths == [1, 4, 8, 33] and len(cal.long_verify_ms) == 4
    assert all(ms > 0 for ms in cal.long_verify_ms) and cal.long_caps == []  # lookup has no drafter model
    assert cal.at_context(4096).verify(33) >= cal.verify(33)
    again = C.calibrate(eng, "lookup", passes=1, context=64, overhead_rounds=2)
    assert again.from_cache and again.long_verify_ms == cal.long_verify_ms
    assert "tokens of context: verify w1" in C.format_report(cal)
    off = C.calibrate(eng, "lookup", recalibrate=True, passes=1, context=64, overhead_rounds=2, long_context=0)
    assert off.long_context == 0 and off.at_context(4096) is off
