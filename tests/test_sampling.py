"""Sampled output is an exact sample of the target, through the real verify loop with multi-token
drafts, rejections at every draft position and bonus tokens after full acceptance.

How: long sampled decodes (``engine.speculative.decode``, a real ``Target`` and a real drafter,
draft cap 4). Afterwards one clean target forward over the whole sequence gives, for every
emitted token x_t, the exact target distribution p_t = p(. | x_<t) (truncated by the same
top-k/top-p rule). Speculative sampling is exact iff every x_t is a draw from p_t given
everything before it, whatever the round did (accepted draft, residual after a rejection, bonus).
A token's *draft position* j (0 = first token of its round, up to 4 = the bonus after four
accepted drafts) is fixed before the token is drawn, so for each j and each previous token a the
differences sum_t (onehot(x_t) - p_t) are a martingale with covariance
sum_t (diag p_t - p_t p_t^T): the quadratic form in that covariance is chi-square distributed.

Conditioning on the previous token matters: pooled over contexts, "drawn from the wrong
position's distribution" (a bonus token from the row before) has the same histogram as the right
one, since both average to the chain's stationary distribution. Two broken acceptance rules are
run through the same check to prove it has the power to fail (``test_the_check_catches_...``).

Cost: one sequence of 2,000 tokens per drafter (the old design drew 20,000 three-token samples
per drafter, a decode call each, and could only reach draft position 1); seconds, not a minute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.sampling as sampling_rules
from engine.drafters.base import Draft, Drafter
from engine.drafters.draft_model import DraftModelDrafter
from engine.sampling import Sampler, SamplingParams, accept_sampled, target_probs
from engine.speculative import FixedCap, decode
from engine.target import Target
from tests.tiny import make_tiny_model

VOCAB = 8
CAP = 4
PROMPT = [3, 4, 5, 6]
RUNS, LENGTH = 10, 200  # 2,000 sampled tokens per check
ALPHA = 1e-5  # per chi-square test; the runs are deterministic (seeded), so this is not a flake rate


def chi2_sf(x: float, dof: int) -> float:
    """P(chi-square(dof) > x), from the series of the regularized lower incomplete gamma."""
    a, z = dof / 2, x / 2
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-16 * total:
        n += 1
        term *= z / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a)) * total)


@dataclass
class Tally:
    """Per draft position j and previous token a: observed counts, expected counts, covariance."""

    observed: np.ndarray = field(default_factory=lambda: np.zeros((CAP + 1, VOCAB, VOCAB)))
    expected: np.ndarray = field(default_factory=lambda: np.zeros((CAP + 1, VOCAB, VOCAB)))
    cov: np.ndarray = field(default_factory=lambda: np.zeros((CAP + 1, VOCAB, VOCAB, VOCAB)))
    outcomes: np.ndarray = field(default_factory=lambda: np.zeros((CAP + 1, CAP + 1), dtype=int))  # [drafted, accepted]
    impossible: int = 0  # tokens the target gives probability 0

    def add(self, j: int, prev: int, token: int, p: np.ndarray) -> None:
        self.observed[j, prev, token] += 1
        self.expected[j, prev] += p
        self.cov[j, prev] += np.diag(p) - np.outer(p, p)
        self.impossible += p[token] == 0

    def chi2(self, j: int, pooled: bool = False) -> tuple[float, int]:
        """The covariance quadratic form summed over previous tokens (or pooled), and its dof."""
        cells = [(self.observed[j].sum(0), self.expected[j].sum(0), self.cov[j].sum(0))] if pooled else [
            (self.observed[j, a], self.expected[j, a], self.cov[j, a]) for a in range(VOCAB)]
        stat, dof = 0.0, 0
        for o, e, c in cells:
            w, u = np.linalg.eigh(c)
            keep = w > 1e-9 * max(w.max(), 1e-300)  # the directions with variance (sum-to-one drops one)
            z = u[:, keep].T @ (o - e)
            stat, dof = stat + float((z ** 2 / w[keep]).sum()), dof + int(keep.sum())
        return stat, dof

    def tv(self, j: int) -> float:
        """Total variation between the observed and the expected histogram at draft position j."""
        o, e = self.observed[j].sum(0), self.expected[j].sum(0)
        return 0.5 * float(np.abs(o - e).sum() / o.sum())


def sample_paths(model, drafter: Drafter, params: SamplingParams, target: Target | None = None) -> Tally:
    """``target``: the model's Target when the drafter already holds one (heads reading its taps)."""
    target, tally = target or Target(model), Tally()
    cap = FixedCap(min(CAP, drafter.max_draft))
    for run in range(RUNS):
        sampler = Sampler(SamplingParams(params.temperature, params.top_p, params.top_k, seed=run))
        tokens, positions = [], []
        for new, event in decode(target, drafter, PROMPT, sampler, max_new_tokens=LENGTH, cap_policy=cap):
            tokens += new
            positions += range(len(new))
            if event.drafted:
                tally.outcomes[event.drafted, event.accepted] += 1
        seq = PROMPT + tokens
        exact = np.array(target_probs(model(mx.array([seq]))[0, len(PROMPT) - 1 : -1], params), dtype=np.float64)
        for t, (token, j) in enumerate(zip(tokens, positions)):
            tally.add(j, seq[len(PROMPT) + t - 1], token, exact[t])
    return tally


GREEDY = Sampler(SamplingParams(temperature=0.0))


class OneHotDrafts(Drafter):
    """The draft model's greedy tokens, without probabilities (q one-hot, as n-gram lookup and
    greedy drafters report): the rule accepts a one-hot draft d with probability p(d)."""

    name = "one-hot"

    def __init__(self, inner: DraftModelDrafter):
        self.inner, self.max_draft = inner, inner.max_draft

    def begin(self, prompt_ids, hidden):
        self.inner.begin(prompt_ids, hidden)

    def propose(self, ids, cap, sampler):
        draft = self.inner.propose(ids, cap, GREEDY)
        return None if draft is None else Draft(draft.tokens)

    def commit(self, ids, n_new, hidden):
        self.inner.commit(ids, n_new, hidden)


def models():
    target = make_tiny_model("llama", seed=11, vocab=VOCAB, layers=1, hidden=32, scale=3.0)
    # The draft model: the target with noise on its head, so q is near p (long accepted runs) but not p.
    draft = make_tiny_model("llama", seed=11, vocab=VOCAB, layers=1, hidden=32, scale=3.0)
    mx.random.seed(5)
    draft.lm_head.weight = draft.lm_head.weight + 0.15 * mx.random.normal(draft.lm_head.weight.shape)
    mx.eval(draft.parameters())
    return target, draft


CASES = {
    "draft-model": (lambda d: DraftModelDrafter(d, max_draft=CAP), SamplingParams(temperature=1.0, top_p=0.9, top_k=6)),
    "one-hot": (lambda d: OneHotDrafts(DraftModelDrafter(d, max_draft=CAP)), SamplingParams(temperature=0.7)),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_speculative_sampling_is_exact(kind):
    make_drafter, params = CASES[kind]
    target, draft = models()
    assert_exact(sample_paths(target, make_drafter(draft), params))


def assert_exact(tally: Tally, cap: int = CAP) -> None:
    """Every path of the rule ran, often (a rejection at each draft position, and the bonus token),
    and every draft position's tokens follow the target's exact conditionals."""
    full = tally.outcomes[cap]
    rejected_at = [int(full[i]) for i in range(cap)]  # rounds of ``cap`` drafts that accepted exactly i
    assert min(rejected_at) >= 20 and full[cap] >= 20, f"rounds by accepted drafts: {full}"
    assert tally.observed[1:].sum() >= 0.4 * RUNS * LENGTH  # a large share came from draft positions >= 1
    assert tally.impossible == 0
    assert_conditionals(tally, cap)


def assert_conditionals(tally: Tally, cap: int, label: str = "") -> None:
    """Each position 0..cap: chi-square by previous token and pooled, and total variation < 0.1."""
    for j in range(cap + 1):
        for pooled in (False, True):
            stat, dof = tally.chi2(j, pooled)
            assert chi2_sf(stat, dof) > ALPHA, f"{label}position {j} ({'pooled' if pooled else 'by previous token'}): " \
                                               f"chi-square {stat:.1f} on {dof} dof"
        assert tally.tv(j) < 0.1, f"{label}position {j}: total variation {tally.tv(j):.3f}"


def _bonus_from_previous_row(drafts, draft_probs, target_logits, sampler):
    k = drafts.shape[0]
    if k >= 2:  # the bonus token drawn from the row before its own
        target_logits = mx.concatenate([target_logits[:k], target_logits[k - 1 : k]])
    return accept_sampled(drafts, draft_probs, target_logits, sampler)


def _first_q_for_every_draft(drafts, draft_probs, target_logits, sampler):
    if draft_probs is not None and drafts.shape[0] >= 2:  # positions >= 1 judged with position 0's q
        draft_probs = mx.broadcast_to(draft_probs[:1], draft_probs.shape)
    return accept_sampled(drafts, draft_probs, target_logits, sampler)


@pytest.mark.parametrize("broken", [_bonus_from_previous_row, _first_q_for_every_draft])
def test_the_check_catches_a_broken_rule_at_later_positions(monkeypatch, broken):
    """The same check, on rules that are wrong only at draft positions >= 1, must fail."""
    monkeypatch.setattr(sampling_rules, "accept_sampled", broken)  # the rule the verify loop applies
    make_drafter, params = CASES["draft-model"]
    target, draft = models()
    tally = sample_paths(target, make_drafter(draft), params)
    worst = min(chi2_sf(*tally.chi2(j)) for j in range(CAP + 1))
    assert worst < ALPHA  # the check above fails (by orders of magnitude: p ~ 1e-8 or below)
    assert chi2_sf(*tally.chi2(0)) > ALPHA  # position 0 is untouched by either bug


def test_truncation_keeps_top_k_and_nucleus():
    logits = mx.array([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = np.array(target_probs(logits, SamplingParams(temperature=1.0, top_k=2)))[0]
    assert (p[2:] == 0).all() and abs(p.sum() - 1) < 1e-6 and p[0] > p[1] > 0
    p = np.array(target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5)))[0]
    assert p[0] == pytest.approx(1.0)  # the top token alone holds > 50 %
    full = np.array(mx.softmax(logits, axis=-1))[0]
    p = np.array(target_probs(logits, SamplingParams(temperature=1.0, top_p=0.9)))[0]
    keep = np.cumsum(full) - full < 0.9
    assert ((p > 0) == keep).all()


def test_a_top_p_below_float32_resolution_keeps_the_most_likely_token():
    """top_p = 1e-46 is 0 in float32: the nucleus rule kept nothing and token 0 was sampled."""
    logits = mx.array([[0.0, 1.0, 5.0, 2.0]])
    for top_p in (1e-46, 5e-324, 1e-30):
        params = SamplingParams(temperature=1.0, top_p=top_p, seed=0)
        p = np.array(target_probs(logits, params))[0]
        assert p.tolist() == [0.0, 0.0, 1.0, 0.0], (top_p, p)
        sampler = Sampler(params)
        assert {sampler.pick(logits).item() for _ in range(5)} == {2}


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(temperature=st.one_of(st.just(1e-300), st.floats(1e-8, 2.0)),
       top_p=st.one_of(st.just(5e-324), st.floats(1e-300, 1.0)), top_k=st.integers(0, 12),
       logits=st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=10), seed=st.integers(0, 2**32 - 1))
def test_fuzzed_sampling_parameters_give_a_distribution_that_keeps_the_top_token(temperature, top_p, top_k,
                                                                                    logits, seed):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    row = mx.array([logits])
    p = np.array(target_probs(row, params))[0]
    assert np.isfinite(p).all() and (p >= 0).all() and abs(p.sum() - 1) < 1e-4, p
    full = np.array(target_probs(row, SamplingParams(temperature=temperature)))[0]
    assert full[p > 0].max() == full.max()  # a most likely token survives (of tied ones, any)
    token = Sampler(params).pick(row).item()
    assert p[token] > 0


def test_seed_makes_sampling_reproducible(tiny_llama):
    a = tiny_llama.generate([5, 6, 7], mode="lookup", temperature=0.9, seed=42, max_new_tokens=20)
    b = tiny_llama.generate([5, 6, 7], mode="lookup", temperature=0.9, seed=42, max_new_tokens=20)
    assert a.token_ids == b.token_ids


def test_chi2_sf_matches_known_values():
    # Closed forms: dof 2 -> exp(-x/2); dof 4 -> exp(-x/2) (1 + x/2); and the table's 5 % points.
    assert chi2_sf(3.0, 2) == pytest.approx(math.exp(-1.5), rel=1e-9)
    assert chi2_sf(7.0, 4) == pytest.approx(math.exp(-3.5) * 4.5, rel=1e-9)
    assert chi2_sf(11.0705, 5) == pytest.approx(0.05, rel=1e-4)
    assert chi2_sf(124.342, 100) == pytest.approx(0.05, rel=1e-4)
