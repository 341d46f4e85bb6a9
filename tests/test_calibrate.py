"""Calibrator: the cap the cost model picks on known curves, the cache key and the disk cache,
the --max-draft auto controller on simulated acceptance streams, and a real calibration run on
a tiny random model."""

from __future__ import annotations

import json
import math
import random

import mlx.core as mx
import pytest

from engine import calibrate as C
from engine import cap_controller as CC
from engine import cost_model as M
from engine.drafters.lookup import LookupDrafter
from tests.tiny import make_tiny_engine

MAX = 32


def syn(verify, **kw) -> M.Calibration:
    return M.Calibration.synthetic(verify, MAX, **kw)


# ------------------------------------------------------------------ cap choice on known curves
def test_flat_curve_takes_the_largest_cap():
    cal = syn(lambda w: 50.0)  # verifying more rows is free: every draft is a bonus
    assert M.best_cap(cal, 0.7) == MAX
    assert M.static_cap(cal) == MAX


def test_linear_curve_parks_speculation():
    cal = syn(lambda w: 50.0 * w)  # quantized matmul on this CPU: cost grows with every row
    # rate(1) = (1 + p) / 100 < 1 / 50 for any p < 1: plain steps win
    assert M.best_cap(cal, 0.7) == 0
    assert M.best_cap(cal, 0.95) == 0
    assert M.static_cap(cal) == 1  # a fixed cap never parks; auto does


def test_knee_curve_stops_at_the_knee():
    cal = syn(lambda w: 50.0 if w <= 5 else 50.0 + 40.0 * (w - 5))
    # up to width 5 drafts are free; the 5th draft would add p^5 = 0.17 tokens for 40 ms while
    # the round already earns 2.77 tokens per 50 ms
    assert M.best_cap(cal, 0.7) == 4
    assert M.best_cap(cal, 0.9) == 4


def test_cliff_curve_depends_on_acceptance():
    cal = syn(lambda w: 50.0 if w == 1 else 100.0)  # bf16-like: 2x at width 2, then flat
    assert M.best_cap(cal, 0.7) == MAX  # (1 + 0.7/0.3) / 100 > 1 / 50
    assert M.best_cap(cal, 0.3) == 0  # (1 + 0.3/0.7) / 100 < 1 / 50
    # never parks: the longest useful cap (past ~18, p^i adds less than 1e-9 of a token)
    assert M.rate(cal, M.static_cap(cal, 0.3), 0.3) == pytest.approx(M.rate(cal, MAX, 0.3), rel=1e-9)


def test_drafter_cost_sets_an_interior_optimum():
    cal = syn(lambda w: 50.0, draft=lambda c: 10.0 * c)
    # rates at p=0.8: C=3 2.952/80, C=4 3.3616/90 (best), C=5 3.6893/100
    assert M.best_cap(cal, 0.8) == 4
    assert M.rate(cal, 4, 0.8) == pytest.approx(1000 * 3.3616 / 90)


def test_round_overhead_can_make_speculation_lose():
    assert M.best_cap(syn(lambda w: 50.0), 0.3) > 0
    cal = syn(lambda w: 50.0, overhead_ms=30.0)  # only speculative rounds pay it
    assert M.best_cap(cal, 0.3) == 0  # at most 1.43 tokens per 80 ms < 1 per 50 ms


def test_variable_length_drafts_weight_costs_by_length():
    cal = syn(lambda w: 50.0 + 10.0 * w)
    surv = [1.0, 0.5, 0.5, 0.5, 0.5] + [0.0] * 30  # no match half the time, else exactly 4 drafts
    assert M.expected_ms(cal, 8, surv) == pytest.approx(0.5 * 60 + 0.5 * 100)
    assert M.expected_tokens(8, 0.9, surv) == pytest.approx(1 + 0.5 * (0.9 + 0.81 + 0.729 + 0.6561))
    # caps past 4 change nothing, so the smallest of the tied best is chosen
    assert M.best_cap(cal, 0.9, survival=surv) == 4


def test_rates_in_one_pass_match_the_formula():
    cal = syn(lambda w: 40.0 + 3.0 * w + (15.0 if w > 9 else 0.0), draft=lambda c: 2.0 * c, overhead_ms=4.0,
              step_overhead_ms=1.0)
    surv = [1.0, 0.7, 0.7, 0.6, 0.6, 0.5, 0.2] + [0.1] * 30
    for s in (None, surv):
        assert M.rates(cal, 0.8, s) == pytest.approx([M.rate(cal, c, 0.8, s) for c in range(MAX + 1)])


def test_curve_fit_is_monotone_and_interpolates():
    cal = M.Calibration("k", {}, [1, 2, 4, 8], [10.0, 14.0, 12.0, 20.0])
    assert [cal.verify(w) for w in (1, 2, 4, 8)] == [10.0, 13.0, 13.0, 20.0]  # 14/12 pooled
    assert cal.verify(6) == pytest.approx(16.5)
    assert cal.verify(40) == 20.0 and cal.verify(0) == 10.0
    assert cal.max_cap == 7


# ------------------------------------------------------------------ cache key and disk cache
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cache_key_changes_with_every_field(tiny_llama, monkeypatch):
    drafter = tiny_llama.drafter("lookup")
    fields = C.key_fields(tiny_llama, "lookup", drafter)
    assert set(fields) == set(C.KEY_FIELDS)
    base = C.cache_key(fields)
    for name in C.KEY_FIELDS:
        changed = dict(fields, **{name: f"{fields[name]}-other"})
        assert C.cache_key(changed) != base, name

    # and each field really comes from what it names
    def key(engine=tiny_llama, d=drafter, **kw):
        return C.calibration_key(engine, "lookup", d, **kw)

    assert key() == base
    assert key(d=LookupDrafter(max_draft=16)) != base
    assert key(context=256) != base
    assert key(engine=make_tiny_engine(hidden=32)) != base  # other shapes, other costs
    assert key(engine=make_tiny_engine(seed=5)) == base  # same shapes and dtypes: same costs
    tapped = make_tiny_engine(seed=5)
    tapped.target.set_taps([0, 2])
    assert key(engine=tapped) == base  # a drafter's tap proxies change no cost: the same calibration
    bf16 = make_tiny_engine()
    bf16.model.set_dtype(mx.bfloat16)
    assert "bfloat16" in C.key_fields(bf16, "lookup", drafter)["precision"]
    assert key(engine=bf16) != base
    monkeypatch.setattr(C, "SCHEMA", C.SCHEMA + 1)
    assert key() != base
    monkeypatch.undo()
    monkeypatch.setattr(C.mx, "__version__", "0.0.1")
    assert key() != base
    monkeypatch.undo()
    import engine.platform as platform

    monkeypatch.setattr(platform, "device_name", lambda: "Another chip")
    assert key() != base
    monkeypatch.setattr(platform, "backend", lambda: "metal")
    assert "backend=metal" in key()


def test_the_key_walks_a_models_weights_once(monkeypatch):
    """Naming the target and the drafter walks every parameter: done once per loaded model (and
    tap layout), not before every ``--max-draft auto`` request's first token."""
    walks = []
    real = C.model_precision
    monkeypatch.setattr(C, "model_precision", lambda model: walks.append(model) or real(model))
    eng = make_tiny_engine(seed=3)
    drafter = eng.drafter("lookup")
    first = C.calibration_key(eng, "lookup", drafter)
    assert C.calibration_key(eng, "lookup", drafter) == first and walks == [eng.model]
    eng.target.set_taps([0, 1])  # another tap layout: named again, to the same key (taps cost nothing)
    assert C.calibration_key(eng, "lookup", drafter) == first and walks == [eng.model, eng.model]


def test_quantized_precision_is_named(tiny_llama):
    import mlx.nn as nn

    eng = make_tiny_engine(hidden=64)
    nn.quantize(eng.model, group_size=32, bits=4)
    assert C.model_precision(eng.model) == "q4g32/float32"
    assert C.model_precision(tiny_llama.model) == "float32"


def test_real_calibration_on_a_tiny_model_is_sane_and_cached(cache_dir, monkeypatch):
    eng = make_tiny_engine(hidden=128, vocab=512)
    seen = []
    cal = C.calibrate(eng, "lookup", progress=lambda d, t, s: seen.append((d, t, s)), passes=1,
                      overhead_rounds=4, context=128)
    assert not cal.from_cache
    assert cal.widths == C.width_grid(33) and cal.widths[0] == 1 and cal.widths[-1] == 33
    assert all(math.isfinite(v) and v > 0 for v in cal.verify_ms)
    fit = [cal.verify(w) for w in cal.widths]
    assert fit == sorted(fit) and cal.verify(33) >= cal.verify(1)
    assert cal.draft_caps == [] and cal.draft(8) == 0.0  # lookup has no model
    assert cal.overhead_ms >= 0 and cal.plain_ms > 0 and cal.bandwidth > 1e8
    assert cal.plain_step_ms() == cal.plain_ms and M.rate(cal, 0, 0.5) == pytest.approx(1000 / cal.plain_ms)
    assert 1 <= M.static_cap(cal) <= 32
    assert seen[-1][0] == seen[-1][1] and {s for _, _, s in seen} >= {"prefill", "verify curve", "rounds and plain steps"}
    assert eng.target.forwards == 0  # calibration forwards are not counted as generation work

    stored = json.loads((cache_dir / "calibration.json").read_text())
    assert list(stored["entries"]) == [cal.key]

    calls = []
    real_measure = C.measure
    monkeypatch.setattr(C, "measure", lambda *a, **k: calls.append(1) or real_measure(*a, **k))
    again = C.calibrate(eng, "lookup", passes=1, overhead_rounds=4, context=128)
    assert again.from_cache and not calls
    assert again.verify_ms == cal.verify_ms and again.key == cal.key
    fresh = C.calibrate(eng, "lookup", recalibrate=True, passes=1, overhead_rounds=4, context=128)
    assert calls == [1] and not fresh.from_cache and fresh.created >= cal.created


def test_round_overhead_is_timed_on_rounds_not_on_the_plain_steps_between(monkeypatch):
    """Where lookup has no match the loop takes plain steps: a calibration that timed those as
    rounds would call a whole plain step the rounds' overhead. On a modeled clock (a plain step
    10 ms, a verify 1 ms, nothing else) a round's overhead is 0 and a plain step 10 ms."""
    import time

    from engine.drafters.base import Draft, Drafter

    class Sometimes(Drafter):  # a draft at one position in four, as n-gram lookup on chat
        max_draft = 4

        def draft_ready(self, ids):
            return len(ids) % 4 == 0

        def propose(self, ids, cap, sampler):
            return Draft(mx.array([1, 2][:cap], dtype=mx.uint32)) if self.draft_ready(ids) else None

    eng = make_tiny_engine()
    now = [0.0]
    forward = eng.target.forward

    def timed(ids, cache, **kw):
        now[0] += 0.010 if kw.get("last_only") and ids.shape[1] == 1 else 0.001
        return forward(ids, cache, **kw)

    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(eng.target, "forward", timed)
    overhead, plain = C.measure_rounds(eng.target, Sometimes(), list(range(3, 40)), 4, rounds=6, passes=1)
    assert overhead == pytest.approx(0.0, abs=1e-6) and plain == pytest.approx(10.0)

    class Never(Sometimes):
        def draft_ready(self, ids):
            return False

    overhead, plain = C.measure_rounds(eng.target, Never(), list(range(3, 40)), 4, rounds=6, passes=1)
    assert overhead == 0.0 and plain == pytest.approx(10.0)  # no round to time: ends, and says none


def test_bent_curves_are_told_from_steady_ones():
    # verify ms at widths 1-8 on this 2-core CPU (the starter, float32, 512 tokens): a calibration
    # with a test run beside it, and two on a quiet machine (one with a 3 % wobble at width 8)
    assert C.bent([154.1, 107.6, 161.1, 141.3, 169.7, 205.8, 223.3, 338.8])
    assert not C.bent([61.0, 92.0, 108.0, 132.0, 144.0, 160.0, 170.0, 188.0])
    assert not C.bent([66.0, 113.0, 141.0, 161.0, 174.0, 196.0, 194.0, 192.0])
    assert C.bent([10.0, 13.0, 20.0, 15.0]) and not C.bent([10.0, 13.0, 16.0, 15.0])


@pytest.mark.parametrize("attempts, calls, result", [
    ("steady", 1, "steady"),
    ("burst steady", 2, "steady"),  # each width keeps its cheaper median (the widest's too)
    ("burst burst", 2, "burst"),  # bent the same way twice: the machine's own curve
    ("burst other burst", 1 + C.REMEASURES, "min"),  # bursts every time: at most REMEASURES more
])
def test_a_curve_bent_by_contention_is_measured_again(attempts, calls, result, cache_dir, monkeypatch):
    """A burst during the verify curve (width 1 dearer than width 2, the widest slowed too) gets
    the curve measured again; the progress bar still ends full."""
    eng = make_tiny_engine(hidden=128, vocab=512)
    widths = C.width_grid(33)
    steady = [10.0 + w for w in widths]
    burst = [30.0] + steady[1:-1] + [90.0]
    other = [28.0] + steady[1:4] + [40.0] + steady[5:-1] + [80.0]
    curves = {"steady": steady, "burst": burst, "other": other}
    sequence = [curves[name] for name in attempts.split()]
    measured = []

    def measure_verify(target, cache, ids, ws, passes, tick=lambda: None):
        assert list(ws) == widths
        measured.append(1)
        for _ in range((passes + 1) * len(ws)):
            tick()
        return list(sequence[min(len(measured), len(sequence)) - 1])

    monkeypatch.setattr(C, "measure_verify", measure_verify)
    seen = []
    cal = C.calibrate(eng, "lookup", progress=lambda d, t, s: seen.append((d, t)), passes=1,
                      overhead_rounds=4, context=128, long_context=0)  # this curve only
    assert len(measured) == calls
    want = [min(values) for values in zip(*sequence)] if result == "min" else curves[result]
    assert cal.verify_ms == want and (result != "min" or C.bent(want))
    assert seen[-1][0] == seen[-1][1] and all(d <= t for d, t in seen)


@pytest.mark.parametrize("kind", ["draft", "dspark"])
def test_drafters_with_a_model_get_a_drafter_curve(kind, cache_dir, tmp_path):
    from engine.drafters.draft_model import DraftModelDrafter
    from tests import drafter_ckpt as ck
    from tests.tiny import make_tiny_model

    eng = make_tiny_engine(scale=4.0)
    if kind == "draft":
        drafter = DraftModelDrafter(make_tiny_model(seed=7, layers=1))
    else:  # a real DSpark checkpoint in the on-disk format: tapped target, block drafter
        eng.drafter_path = str(ck.write(tmp_path / "dspark", *ck.dspark_checkpoint(ck.target_config_of(eng.model))))
        drafter = eng.drafter("dspark")
    cal = C.calibrate(eng, kind, drafter, passes=1, overhead_rounds=3, context=64)
    assert cal.draft_caps == list(range(1, drafter.max_draft + 1))
    assert cal.widths == list(range(1, drafter.max_draft + 2))  # fixed-length drafts: every width
    assert all(math.isfinite(v) and v > 0 for v in cal.draft_ms)
    assert cal.draft(drafter.max_draft) >= cal.draft(1) > 0
    assert f"{kind}:" in cal.key and f"max{drafter.max_draft}" in cal.key
    # at the long context too where it reads the target's hidden states (a draft model would need a prefill)
    assert cal.long_caps == ([1, drafter.max_draft // 2 + 1, drafter.max_draft] if kind == "dspark" else [])
    assert len(cal.long_draft_ms) == len(cal.long_caps) and all(ms > 0 for ms in cal.long_draft_ms)
    # B rows' drafts proposed together, as a multiple of one row's; a batch's rounds priced with it
    assert sorted(int(b) for b in cal.batch_draft_scale) == list(C.BATCH_ROWS)
    assert all(math.isfinite(r) and r > 0 for r in cal.batch_draft_scale.values())
    assert cal.at_batch(4).draft(1) == pytest.approx(cal.draft(1) * cal.batch_draft_scale["4"])
    # the curves drive a lossless auto run through the one verify loop
    prompt = [3, 9, 4, 7, 12, 5, 3, 9, 4, 7]
    base = eng.generate(prompt, mode="baseline", max_new_tokens=20)
    eng.set_drafter(kind, drafter)
    auto = eng.generate(prompt, mode=kind, max_draft="auto", max_new_tokens=20)
    assert auto.token_ids == base.token_ids


def test_damaged_cache_file_is_rebuilt(cache_dir):
    (cache_dir / "calibration.json").write_text("{not json")
    eng = make_tiny_engine()
    cal = C.calibrate(eng, "lookup", passes=1, overhead_rounds=3, context=64)
    assert C.load_cached(cal.key) is not None


# ------------------------------------------------------------------ the controller
def bernoulli_accepts(rng: random.Random, p: float, k: int) -> int:
    n = 0
    while n < k and rng.random() < p:
        n += 1
    return n


def simulate(ctrl: CC.CapController, rng: random.Random, p: float, rounds: int, natural=None, true_cal=None,
             noise: float = 0.05) -> list[int]:
    """Drive the controller like the verify loop: cap() then observe(drafted, accepted, s),
    the round taking what ``true_cal`` (default: the calibration itself) says, with noise."""
    true_cal = true_cal or ctrl.cal
    caps = []
    for _ in range(rounds):
        cap = ctrl.cap()
        caps.append(cap)
        k = 0 if cap == 0 else cap if natural is None else min(cap, natural(rng))
        ms = true_cal.verify(k + 1) + true_cal.draft(cap)
        ctrl.observe(k, bernoulli_accepts(rng, p, k) if k else 0, ms * (1 + noise * rng.random()) / 1000)
    return caps


def test_acceptance_estimate_is_censored_at_full_acceptance():
    cal = syn(lambda w: 50.0)
    full, partial, none = (CC.CapController(cal) for _ in range(3))
    for c in (full, partial, none):
        c.cap()
    full.observe(4, 4, 0.1)
    partial.observe(4, 3, 0.1)
    none.observe(0, 0, 0.1)  # no draft: nothing learned about acceptance
    assert none.p == CC.PRIOR_P
    assert full.p > partial.p
    assert partial.p < CC.PRIOR_P + 3 * (1 - CC.PRIOR_P)  # the rejection pulled it down
    always = CC.CapController(syn(lambda w: 50.0))
    simulate(always, random.Random(0), 1.0, 200)
    assert always.p > 0.97  # never a rejection: the estimate only rises


def test_controller_converges_to_the_optimum_for_the_true_acceptance():
    cal = syn(lambda w: 50.0, draft=lambda c: 10.0 * c)
    ctrl = CC.CapController(cal)
    start = ctrl.cap()
    assert start == M.best_cap(cal, CC.PRIOR_P, allow_park=False)
    simulate(ctrl, random.Random(1), 0.92, 400)
    optimum = M.best_cap(cal, 0.92)
    assert optimum != start
    assert abs(ctrl.p - 0.92) < 0.05
    final = ctrl.history[-1]
    assert M.rate(cal, final, 0.92) >= M.rate(cal, optimum, 0.92) / 1.03  # a flat optimum: 6-9 within 1%


def test_controller_parks_when_speculation_loses_and_probes():
    cal = syn(lambda w: 50.0 * w)
    ctrl = CC.CapController(cal)
    caps = simulate(ctrl, random.Random(2), 0.3, 200)
    first_park = caps.index(0)
    assert 0 < first_park <= ctrl.min_rounds + ctrl.repick_every  # the rounds lost: parked within a few
    tail = caps[-100:]
    assert tail.count(0) >= 95  # probes are rare once they keep failing
    probes = [c for c in caps[first_park:] if c]
    assert probes and all(1 <= c <= CC.PROBE_CAP for c in probes)
    young = CC.CapController(cal, seeded=True)  # no live timings: parks on the model alone, once it has evidence
    caps = simulate(young, random.Random(2), 0.3, 200)
    assert all(c > 0 for c in caps[: young.park_after]) and caps[-50:].count(0) >= 45


def test_controller_unparks_when_acceptance_recovers():
    cal = syn(lambda w: 50.0 if w == 1 else 100.0)
    ctrl = CC.CapController(cal)
    rng = random.Random(3)
    simulate(ctrl, rng, 0.15, 200)
    assert ctrl.state.parked
    caps = simulate(ctrl, rng, 0.97, 300)
    assert not ctrl.state.parked and caps[-1] > CC.PROBE_CAP


def test_controller_learns_variable_draft_lengths():
    cal = syn(lambda w: 50.0 + 2.0 * w)
    ctrl = CC.CapController(cal)
    natural = lambda rng: 0 if rng.random() < 0.5 else 6  # lookup: a miss, or a 6-token match
    simulate(ctrl, random.Random(4), 0.9, 300, natural)
    surv = ctrl.survival()
    assert 0.35 < surv[1] < 0.65  # the hit rate
    assert surv[7] < 0.1  # drafts never run past 6
    assert ctrl.history[-1] >= 6


def test_controller_corrects_the_curve_from_observed_round_times():
    calibrated = syn(lambda w: 50.0 + 25.0 * w)  # a stale curve: steep
    true = syn(lambda w: 45.0 + 2.0 * w)  # what rounds really cost now: nearly flat
    natural = lambda rng: 0 if rng.random() < 0.4 else rng.choice([4, 8, 16, 32])
    surv = [1.0] + [0.6] * 4 + [0.45] * 4 + [0.3] * 8 + [0.15] * 16 + [0.0]  # the truth, with p = 0.9
    best_true = M.rate(true, M.best_cap(true, 0.9, survival=surv), 0.9, surv)
    stale = M.best_cap(calibrated, 0.9, survival=surv)
    assert M.rate(true, stale, 0.9, surv) < 0.85 * best_true  # trusting the curve would cost >15%
    ctrl = CC.CapController(calibrated)
    simulate(ctrl, random.Random(6), 0.9, 400, natural, true_cal=true)
    c0, c1 = ctrl.cost_fit()
    assert c0 == pytest.approx(48.0, rel=0.1) and c1 == pytest.approx(0.08, abs=0.05)
    assert M.rate(true, ctrl.history[-1], 0.9, surv) >= best_true / 1.05


def test_contention_bursts_do_not_bend_the_fit():
    cal = syn(lambda w: 50.0 + 5.0 * w)
    ctrl = CC.CapController(cal)
    rng = random.Random(7)
    for i in range(300):
        cap = ctrl.cap()
        k = min(cap, 8)
        ms = cal.verify(k + 1) * (20.0 if i % 10 == 0 else 1.0)  # every 10th round stalls
        ctrl.observe(k, max(0, k - 1), ms / 1000)  # most drafts accepted: speculation pays
    c0, c1 = ctrl.cost_fit()
    assert c0 == pytest.approx(55.0, rel=0.15) and c1 == pytest.approx(1.0, abs=0.25)


def test_auto_policy_in_generation_is_lossless_and_keeps_learning(cache_dir):
    eng = make_tiny_engine(scale=4.0)
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    base = eng.generate(prompt, mode="baseline", max_new_tokens=40)
    auto = eng.generate(prompt, mode="lookup", max_draft="auto", max_new_tokens=40)
    assert auto.token_ids == base.token_ids and auto.cap == "auto"
    assert (cache_dir / "calibration.json").is_file()
    policy = C.auto_cap_policy(eng, "lookup", eng.drafter("lookup"))
    assert policy.label == "auto" and policy.state.rounds > 0  # carried over from the request above
    assert C.default_cap(eng, "lookup", eng.drafter("lookup")) == M.static_cap(policy.cal)


# ------------------------------------------------------------------ tandem calibrate
def test_cli_prints_the_curves_and_reuses_the_cache(cache_dir, tmp_path, capsys):
    from engine.cli import main
    from tests.test_gguf import write_tiny_gguf

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, "llama")
    assert main(["calibrate", "--model", str(gguf), "--passes", "1"]) == 0
    out = capsys.readouterr().out
    assert "measured in" in out and "default cap (p=0.7)" in out and "roofline at 512 tokens" in out
    assert "   33 " in out  # the widest verify of lookup's 32 drafts
    assert main(["calibrate", "--model", str(gguf), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["from_cache"] and 1 <= data["default_cap"] <= 32 and data["widths"][-1] == 33
    assert main(["calibrate", "--model", str(gguf), "--passes", "0"]) == 1
    assert "--passes must be at least 1" in capsys.readouterr().err


def test_the_progress_bar_follows_a_total_that_grows():
    """A curve measured again adds its passes to the total: the bar shows done of the new total,
    not a count past the end."""
    from tqdm import tqdm

    update, close = C.tqdm_progress("calibrating")
    update(0, 10, "prefill")
    update(10, 10, "verify curve")
    update(12, 14, "verify curve")
    (bar,) = [b for b in tqdm._instances if b.desc.startswith("calibrating")]
    assert (bar.n, bar.total) == (12, 14)
    close()


def test_a_first_auto_request_tells_its_calibration_and_prepare_measures_it_ahead(cache_dir, monkeypatch, capsys):
    """A first ``--max-draft auto`` request measures this machine before its first token and tells
    the engine's ``calibration_progress``; ``Engine.prepare`` measures the same ahead (``tandem
    generate`` before the first token, a server between requests), so the request then measures
    nothing. A fixed cap measures nothing at all."""
    from engine.options import calibrate_first

    calls = []
    real_measure = C.measure
    monkeypatch.setattr(C, "measure", lambda *a, **k: calls.append(1) or real_measure(*a, **k))
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]

    eng = make_tiny_engine(scale=4.0)
    told = []
    eng.calibration_progress = lambda done, total, stage: told.append((done, total, stage))
    eng.generate(prompt, mode="lookup", max_draft="auto", max_new_tokens=8)
    assert calls == [1] and told and told[-1][0] == told[-1][1]
    before = len(told)
    eng.prepare("lookup", "auto", progress=lambda *a: told.append(a))  # cached now: nothing runs
    assert calls == [1] and len(told) == before

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(cache_dir / "fresh"))  # another machine's first start
    eng = make_tiny_engine(scale=4.0)
    capsys.readouterr()
    calibrate_first(eng, "lookup", 4)  # a fixed cap: no calibration, no bar
    assert calls == [1] and "calibrating" not in capsys.readouterr().err
    calibrate_first(eng, "lookup", "auto")  # the bar `tandem generate` draws
    assert calls == [1, 1] and "calibrating this machine for speculation" in capsys.readouterr().err
    assert eng.calibration_progress is None  # lent to that call only
    seen = []
    eng.calibration_progress = lambda *a: seen.append(a)
    result = eng.generate(prompt, mode="lookup", max_draft="auto", max_new_tokens=8)
    assert calls == [1, 1] and not seen and result.cap == "auto"


def test_doctor_says_which_drafters_are_calibrated_here(cache_dir):
    from engine.doctor import model_rows

    eng = make_tiny_engine(seed=6)
    assert dict(model_rows(eng))["Calibration"].startswith("none on this machine yet")
    cal = C.calibrate(eng, "lookup", passes=1, overhead_rounds=4, context=128)
    assert dict(model_rows(eng))["Calibration"].startswith(f"lookup (default cap {M.static_cap(cal)}, measured 20")
