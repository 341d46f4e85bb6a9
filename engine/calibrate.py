"""Per-machine cost curves, the draft cap they imply, and the ``--max-draft auto`` controller.

Whether speculation pays, and how many drafts to verify, depends on how a target forward's cost
grows with its width on *this* machine: on a 2-core Linux CPU with OpenBLAS, 16 rows cost 1.6-2.6x
one row; with MLX's CPU quantized kernels they cost 16x (spec/models.md §3.4). So the engine measures:

* ``verify(w)``: ms of one target forward over ``w`` tokens on a warm synthetic 512-token
  context, the cache trimmed back after each (``Target.forward`` + ``Target.rollback``);
* ``draft(c)``: ms of one proposal of ``c`` tokens, for drafters with their own model
  (n-gram lookup costs ~0 and its Python time lands in the overhead);
* the per-round overhead: full synthetic rounds of the real verify loop minus their forward (and
  model drafter) time, for speculative rounds and for plain steps;
* the machine's copy bandwidth (for the roofline).

Warm-ups, then medians over interleaved passes (a contended machine shifts all widths alike
instead of bending the curve). The result is cached in ``<cache>/calibration.json`` keyed by
device, MLX version, backend, precision, target, drafter and schema version.

Cost model. A drafter proposes ``L`` tokens (``L`` random for lookup: 0 without a match, then
``2*match-2``; fixed for model drafters); under cap ``C`` the loop verifies ``k = min(C, L)``.
Each draft token is accepted with probability ``p`` given the previous one was (per-token
Bernoulli), so with ``S(i) = P(L >= i)``::

    tokens(C) = 1 + sum_{i=1..C} S(i) p^i
    ms(C)     = sum_k P(k) verify(k + 1) + draft(C) + overhead          (C >= 1)
    rate(C)   = tokens(C) / ms(C),        rate(0) = 1 / (verify(1) + step_overhead)

With ``S = 1`` (a fixed-length drafter) this is ``(1 + sum p^i) / (draft(C) + verify(C+1) +
overhead)``. The default cap maximises it at ``STATIC_P`` = 0.70, the acceptance mlx-dspark fit
to 7 of 8 measured optima. ``CapController`` re-fits ``p`` and ``S`` from live rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import mlx.core as mx

from engine.drafters.base import Drafter
from engine.errors import TandemError

if TYPE_CHECKING:
    from engine.generate import Engine

SCHEMA = 1
CONTEXT = 512  # synthetic context the curves are measured at
PASSES = 4  # timed passes over the width grid (plus one warm-up pass)
OVERHEAD_ROUNDS = 12  # rounds of each kind (speculative, plain) timed for the overhead
STATIC_P = 0.70  # acceptance the default cap is chosen at
PRIOR_P = 0.65  # the controller's starting acceptance
PROBE_CAP = 4  # the largest cap a parked controller probes with (a probe must stay cheap)

Progress = Callable[[int, int, str], None]  # (done, total, stage)


# ===================================================================== the calibration record
@dataclass
class Calibration:
    """Measured cost curves for one (target, drafter) pair on one machine. Times in ms."""

    key: str
    fields: dict
    widths: list[int]
    verify_ms: list[float]
    draft_caps: list[int] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)  # empty: the drafter has no model
    overhead_ms: float = 0.0  # per speculative round, beyond verify + draft
    step_overhead_ms: float = 0.0  # per plain step (cap 0)
    bandwidth: float = 0.0  # copy bandwidth, bytes/s
    context: int = CONTEXT
    seconds: float = 0.0  # how long measuring took
    created: float = 0.0  # unix time
    from_cache: bool = field(default=False, compare=False)
    _verify_fit: list | None = field(default=None, init=False, repr=False, compare=False)
    _draft_fit: list | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def max_cap(self) -> int:
        return max(self.widths) - 1

    def verify(self, width: int) -> float:
        """The model's verify cost: the measured medians made non-decreasing (a wider forward
        never costs less; dips are mostly timing noise on a busy machine), interpolated."""
        if self._verify_fit is None:
            fit = _isotonic(self.verify_ms)
            self._verify_fit = [_interp(self.widths, fit, w) for w in range(max(self.widths) + 1)]
        return self._verify_fit[min(max(int(width), 0), len(self._verify_fit) - 1)]

    def draft(self, cap: int) -> float:
        if cap <= 0 or not self.draft_caps:
            return 0.0
        if self._draft_fit is None:
            fit = _isotonic(self.draft_ms)
            self._draft_fit = [_interp(self.draft_caps, fit, c) for c in range(max(self.draft_caps) + 1)]
        return self._draft_fit[min(int(cap), len(self._draft_fit) - 1)]

    def to_dict(self) -> dict:
        d = asdict(self)
        for private in ("from_cache", "_verify_fit", "_draft_fit"):
            d.pop(private)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        known = {f for f in cls.__dataclass_fields__ if f not in ("from_cache", "_verify_fit", "_draft_fit")}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def synthetic(cls, verify: Callable[[int], float] | Sequence[float], max_cap: int, *,
                  draft: Callable[[int], float] | None = None, overhead_ms: float = 0.0,
                  step_overhead_ms: float = 0.0) -> "Calibration":
        """Curves from a function of the width (or a list indexed by width - 1): for tests and
        what-if tables."""
        widths = list(range(1, max_cap + 2))
        v = [float(verify(w)) if callable(verify) else float(verify[w - 1]) for w in widths]
        caps = list(range(1, max_cap + 1)) if draft else []
        return cls("synthetic", {}, widths, v, caps, [float(draft(c)) for c in caps] if draft else [],
                   overhead_ms, step_overhead_ms)


def _isotonic(ys: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through the measured points; flat outside them."""
    if x <= xs[0]:
        return float(ys[0])
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    return float(ys[-1])


# ===================================================================== the cost model
def _survival(survival: Sequence[float] | None, i: int) -> float:
    if survival is None:
        return 1.0
    return float(survival[i]) if i < len(survival) else float(survival[-1])


Acceptance = float | Sequence[float]  # one p for every position, or p[i] for draft position i >= 1


def _accept(p: Acceptance, i: int) -> float:
    if isinstance(p, (int, float)):
        return float(p)
    return float(p[i]) if i < len(p) else float(p[-1])


def expected_tokens(cap: int, p: Acceptance, survival: Sequence[float] | None = None) -> float:
    """Committed tokens per round: the target's own one plus each draft that is proposed
    (``S(i)``) and accepted along with all before it (``p^i``, or ``p_1 ... p_i``)."""
    tokens, chain = 1.0, 1.0
    for i in range(1, cap + 1):
        chain *= _accept(p, i)
        tokens += _survival(survival, i) * chain
    return tokens


def expected_ms(cal: Calibration, cap: int, survival: Sequence[float] | None = None) -> float:
    if cap <= 0:
        return cal.verify(1) + cal.step_overhead_ms
    verify = 0.0
    for k in range(cap + 1):  # k drafts verified: L == k below the cap, L >= cap at it
        pk = _survival(survival, k) - (_survival(survival, k + 1) if k < cap else 0.0)
        if pk > 0:
            verify += pk * cal.verify(k + 1)
    return verify + cal.draft(cap) + cal.overhead_ms


def rate(cal: Calibration, cap: int, p: Acceptance, survival: Sequence[float] | None = None) -> float:
    """Expected tokens per second at this cap (see the module docstring)."""
    if cap <= 0:
        return 1000.0 / expected_ms(cal, 0)
    return 1000.0 * expected_tokens(cap, p, survival) / expected_ms(cal, cap, survival)


def rates(cal: Calibration, p: Acceptance, survival: Sequence[float] | None = None,
          max_cap: int | None = None) -> list[float]:
    """``rate(cal, c, p, survival)`` for every cap c = 0..max_cap in one pass (the controller
    re-picks every few rounds; this keeps it at microseconds)."""
    top = cal.max_cap if max_cap is None else min(max_cap, cal.max_cap)
    v = [cal.verify(w) for w in range(1, top + 2)]
    out = [1000.0 / (v[0] + cal.step_overhead_ms)]
    tokens, shorter, p_i = 1.0, 0.0, 1.0
    for c in range(1, top + 1):
        s_prev, s_c = _survival(survival, c - 1), _survival(survival, c)
        p_i *= _accept(p, c)
        tokens += s_c * p_i
        shorter += (s_prev - s_c) * v[c - 1]  # drafts that stopped at c - 1 < cap: verify(c)
        ms = shorter + s_c * v[c] + cal.draft(c) + cal.overhead_ms
        out.append(1000.0 * tokens / ms)
    return out


def best_cap(cal: Calibration, p: Acceptance, *, max_cap: int | None = None, survival: Sequence[float] | None = None,
             allow_park: bool = True) -> int:
    """The cap with the highest expected rate (the smallest one on a tie); 0 = plain steps."""
    return _argmax(rates(cal, p, survival, max_cap), allow_park)


def _argmax(values: Sequence[float], allow_park: bool) -> int:
    best, best_value = None, -1.0
    for c in range(0 if allow_park else 1, len(values)):
        if values[c] > best_value * (1 + 1e-9):
            best, best_value = c, values[c]
    return int(best if best is not None else 0)


def static_cap(cal: Calibration, p: float = STATIC_P, max_cap: int | None = None) -> int:
    """The default cap for fixed ``--max-draft``-less runs: best at ``p``, never 0 (a user who
    picked a speculative mode gets speculation; ``auto`` may park it)."""
    return best_cap(cal, p, max_cap=max_cap, allow_park=False)


# ===================================================================== the live controller
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

    def shrink(self, factor: float = 0.5) -> None:
        """Start a new request trusting the old evidence less (the content changed)."""
        self.tokens_seen *= factor
        self.at_risk = [x * factor for x in self.at_risk]
        self.events = [x * factor for x in self.events]
        self.accepted_at = [x * factor for x in self.accepted_at]
        self.tried_at = [x * factor for x in self.tried_at]
        self.cost = [x * factor for x in self.cost]


def _bucket(position: int) -> int:
    """Draft positions 1, 2, 3-4, 5-8, 9-16, ... -> buckets 0, 1, 2, 3, 4, ..."""
    return max(0, int(position) - 1).bit_length()


class _Corrected:
    """A calibration seen through the live cost fit: ``verify(w) = c0 + c1 * (verify_cal(w) -
    verify_cal(1))``, drafter ms scaled by ``c1``. Quacks like ``Calibration`` for ``rates``."""

    def __init__(self, cal: Calibration, c0: float, c1: float):
        self.cal, self.c0, self.c1 = cal, c0, c1
        self.max_cap, self.overhead_ms, self.step_overhead_ms = cal.max_cap, cal.overhead_ms, cal.step_overhead_ms
        self._v1 = cal.verify(1)

    def verify(self, width: int) -> float:
        return self.c0 + self.c1 * (self.cal.verify(width) - self._v1)

    def draft(self, cap: int) -> float:
        return self.c1 * self.cal.draft(cap)


class CapController:
    """``--max-draft auto``: re-picks the cap from the calibrated curves and live acceptance.

    * Acceptance ``p``: an EWMA of per-token Bernoulli outcomes (each accepted draft a 1, the
      first rejected one a 0); a fully accepted round adds no 0 (censored: the next draft
      might have failed too). Young, it is a running mean seeded with ``PRIOR_P``. Per draft
      position (buckets 1, 2, 3-4, 5-8, ...) the conditional acceptance is estimated too,
      shrunk toward ``p``: a lookup draft whose first tokens matched tends to match on, which
      a single ``p`` undervalues.
    * Draft lengths ``S(i)``: a decayed Kaplan-Meier estimate from the drafts seen. A draft
      shorter than the cap is the drafter's natural length; one at the cap says only
      ``L >= cap``. Lengths never seen are assumed to continue (optimism that explores).
    * Costs: the calibrated curve, corrected live. Round times (``observe``'s seconds) are fit
      as ``c0 + c1 * g(k)``, ``g`` the curve's extra cost of ``k`` drafts over a plain step, by
      decayed least squares shrunk toward the calibration (``c0 = verify(1)``, ``c1 = 1``). It
      follows what the curve at 512 tokens cannot know: the real context (wide verifies cost
      relatively less at short contexts on the CPU), load, clocks.
    * Every ``repick_every`` rounds, switch to the best cap when it beats the current one by
      ``hysteresis``. Cap 0 (plain steps) is allowed after ``park_after`` informative rounds;
      parked, every ``probe_every``-th round is a probe at a cheap cap to keep learning.

    The cap only decides how many drafts are verified, never what is committed: lossless.
    """

    label = "auto"

    def __init__(self, cal: Calibration, max_cap: int | None = None, *, state: LearnedState | None = None,
                 alpha: float = 0.02, prior_weight: float = 4.0, decay: float = 0.03, repick_every: int = 4,
                 hysteresis: float = 1.03, park_after: int = 24, probe_every: int = 8, cost_decay: float = 0.01,
                 cost_prior: float = 0.5, position_prior: float = 4.0, position_decay: float = 0.01):
        self.cal = cal
        self.max_cap = cal.max_cap if max_cap is None else min(max_cap, cal.max_cap)
        self.state = state if state is not None else LearnedState()
        n = self.max_cap + 2
        self.state.at_risk = (self.state.at_risk + [0.0] * n)[:n]
        self.state.events = (self.state.events + [0.0] * n)[:n]
        nb = _bucket(self.max_cap) + 1
        self.state.accepted_at = (self.state.accepted_at + [0.0] * nb)[:nb]
        self.state.tried_at = (self.state.tried_at + [0.0] * nb)[:nb]
        self.alpha, self.prior_weight, self.decay = alpha, prior_weight, decay
        self.repick_every, self.hysteresis = repick_every, hysteresis
        self.park_after, self.probe_every = park_after, probe_every
        self.cost_decay, self.cost_prior = cost_decay, cost_prior
        self.position_prior, self.position_decay = position_prior, position_decay  # structure drifts slowly
        if len(self.state.cost) != 5:
            self.state.cost = [0.0] * 5
        self._since_repick = 0
        self._since_probe = 0
        self._last_cap = 0
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
        """(c0 ms, c1): the live fit of round ms = c0 + c1 * g, shrunk toward (verify(1), 1)."""
        W, Wg, Wgg, Ws, Wgs = self.state.cost
        c0p = self.cal.verify(1)
        g_ref = max(self._g(min(8, self.max_cap), min(8, self.max_cap)), 0.1 * c0p)
        p0, p1 = self.cost_prior, self.cost_prior * g_ref * g_ref
        a, b, d = W + p0, Wg, Wgg + p1
        e, f = Ws + p0 * c0p, Wgs + p1
        det = a * d - b * b
        c0, c1 = (e * d - b * f) / det, (a * f - b * e) / det
        return min(max(c0, 0.1 * c0p), 10 * c0p), min(max(c1, 0.02), 10.0)

    def corrected(self) -> "_Corrected":
        return _Corrected(self.cal, *self.cost_fit())

    def acceptance(self) -> list[float]:
        """p_i = P(draft i accepted | drafts before it were), i = 0..max_cap (index 0 unused):
        per position bucket, shrunk toward the overall ``p`` with ``position_prior`` drafts."""
        st, m = self.state, self.position_prior
        per_bucket = [(a + m * st.p) / (t + m) for a, t in zip(st.accepted_at, st.tried_at)]
        return [st.p] + [per_bucket[_bucket(i)] for i in range(1, self.max_cap + 1)]

    def rates(self) -> list[float]:
        return rates(self.corrected(), self.acceptance(), self.survival(), self.max_cap)

    # -- CapPolicy -------------------------------------------------------------------------
    def cap(self) -> int:
        st = self.state
        if st.parked and self._since_probe >= self.probe_every:
            self._since_probe = 0
            cap = max(1, min(PROBE_CAP, _argmax(self.rates(), allow_park=False)))
        else:
            cap = 0 if st.parked else int(st.cap)
        self._last_cap = cap
        self.history.append(cap)
        return cap

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        st = self.state
        cap = self._last_cap
        if st.parked:
            self._since_probe += 1
        if cap > 0:
            st.rounds += 1
            self._learn_length(min(drafted, cap), cap)
            self._learn_acceptance(drafted, accepted)
        if seconds > 0:
            self._learn_cost(min(drafted, cap), cap, seconds * 1000.0)
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

    def _learn_cost(self, k: int, cap: int, ms: float) -> None:
        g = self._g(k, cap)
        c0, c1 = self.cost_fit()
        predicted = c0 + c1 * g
        ms = min(max(ms, 0.5 * predicted), 2.0 * predicted)  # a burst of contention is not the curve
        keep = 1.0 - self.cost_decay
        W, Wg, Wgg, Ws, Wgs = (x * keep for x in self.state.cost)
        self.state.cost = [W + 1.0, Wg + g, Wgg + g * g, Ws + ms, Wgs + g * ms]

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

    def _repick(self) -> None:
        st = self.state
        rates = self.rates()
        allow_park = st.rounds >= self.park_after
        best = _argmax(rates, allow_park)
        current = 0 if st.parked else int(st.cap)
        if rates[best] > rates[current] * self.hysteresis:
            if best == 0:
                st.parked = True
                self._since_probe = 0
            else:
                st.parked, st.cap = False, best


# Learned state per engine (weakly held) and (mode, drafter): the next request starts warm.
_LEARNED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

#: Progress callback for a calibration that ``--max-draft auto`` triggers on first use of a pair
#: (the app or a CLI sets it to show a bar; None measures silently).
auto_progress: Progress | None = None


def auto_cap_policy(engine: "Engine", mode: str, drafter: Drafter) -> CapController:
    """``--max-draft auto``: this pair's calibration (from the cache, or measured now) and the
    acceptance learned on earlier requests of this engine."""
    cal = calibrate(engine, mode, drafter, progress=auto_progress)
    per_engine = _LEARNED.setdefault(engine, {})
    state = per_engine.get((mode, id(drafter)))
    if state is None:
        state = per_engine[(mode, id(drafter))] = LearnedState()
    else:
        state.shrink()
    return CapController(cal, drafter.max_draft, state=state)


def default_cap(engine: "Engine", mode: str, drafter: Drafter) -> int | None:
    """The static cap from a cached calibration of this pair, or None when none is cached
    (measuring would stall a plain ``generate``; ``tandem calibrate`` fills the cache)."""
    cal = load_cached(calibration_key(engine, mode, drafter))
    return None if cal is None else min(static_cap(cal), drafter.max_draft)


# ===================================================================== identity and the cache
def model_precision(model: Any) -> str:
    """``float32``, ``bfloat16``, ``q4g64/bfloat16`` ...: what the weights cost to read."""
    from mlx.utils import tree_flatten

    counts: dict[str, int] = {}
    quant: set[str] = set()
    for path, value in tree_flatten(model.parameters()):
        if path.endswith(".scales"):
            continue
        if value.dtype in (mx.uint32, mx.uint8) and path.endswith(".weight"):
            continue  # packed quantized weight; read from the module below
        name = str(value.dtype).replace("mlx.core.", "")
        counts[name] = counts.get(name, 0) + value.size
    for _, module in model.named_modules():
        bits = getattr(module, "bits", None)
        if bits is not None and hasattr(module, "scales"):
            quant.add(f"q{bits}g{getattr(module, 'group_size', '?')}")
    dense = max(counts, key=counts.get) if counts else "unknown"
    return "/".join(sorted(quant) + [dense])


def _shape_signature(model: Any) -> str:
    """Hash of parameter shapes and dtypes: costs depend on these, not on the values."""
    import hashlib

    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    for path, value in tree_flatten(model.parameters()):
        h.update(f"{path}:{tuple(value.shape)}:{value.dtype};".encode())
    return h.hexdigest()[:10]


def _target_id(engine: "Engine") -> str:
    loaded = getattr(engine, "loaded", None)
    path = getattr(loaded, "path", None)
    base = Path(str(path)).name if path else engine.name
    return f"{base}#{_shape_signature(engine.target.model)}"


def _drafter_id(engine: "Engine", mode: str, drafter: Drafter) -> str:
    parts = [mode, drafter.name, f"max{drafter.max_draft}"]
    spec = engine.draft_model_spec if mode == "draft" else engine.drafter_path if mode in ("dspark", "dflash") else None
    if spec:
        parts.append(Path(str(spec)).name)
    model = getattr(drafter, "model", None)
    if drafter.has_model and model is not None and hasattr(model, "parameters"):
        parts.append(_shape_signature(model))
        parts.append(model_precision(model))
    return ":".join(parts)


KEY_FIELDS = ("schema", "device", "mlx", "backend", "precision", "target", "drafter", "context")


def key_fields(engine: "Engine", mode: str, drafter: Drafter, context: int = CONTEXT) -> dict:
    from engine import platform

    return {
        "schema": SCHEMA, "device": platform.device_name(), "mlx": mx.__version__, "backend": platform.backend(),
        "precision": model_precision(engine.target.model), "target": _target_id(engine),
        "drafter": _drafter_id(engine, mode, drafter), "context": context,
    }


def cache_key(fields: dict) -> str:
    return "|".join(f"{name}={fields[name]}" for name in KEY_FIELDS)


def calibration_key(engine: "Engine", mode: str, drafter: Drafter, context: int = CONTEXT) -> str:
    return cache_key(key_fields(engine, mode, drafter, context))


def cache_path() -> Path:
    from engine.gguf import cache_root

    return cache_root() / "calibration.json"


def _read_cache() -> dict:
    path = cache_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}  # a damaged cache is rebuilt, never fatal
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else {}


def load_cached(key: str) -> Calibration | None:
    entry = _read_cache().get("entries", {}).get(key)
    if not isinstance(entry, dict):
        return None
    try:
        cal = Calibration.from_dict(entry)
    except TypeError:
        return None
    cal.from_cache = True
    return cal


def save(cal: Calibration) -> Path:
    """Merge into the cache file, written atomically (temp file + rename)."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read_cache() or {"schema": SCHEMA, "entries": {}}
    data.setdefault("entries", {})[cal.key] = cal.to_dict()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


# ===================================================================== measuring
def width_grid(max_width: int, dense_to: int = 9) -> list[int]:
    """Every width up to ``dense_to`` (where curves bend), then a sparse set, always the last."""
    grid = [w for w in range(1, min(max_width, dense_to) + 1)]
    grid += [w for w in (12, 16, 17, 24, 32, 33, 48, 64, 65) if dense_to < w < max_width]
    if max_width not in grid:
        grid.append(max_width)
    return grid


def synthetic_prompt(vocab: int, length: int = CONTEXT, period: int = 64, seed: int = 0) -> list[int]:
    """A repeated random block: n-gram lookup finds matches, every model sees real tokens."""
    low = min(10, max(0, vocab - 2))
    block = mx.random.randint(low, vocab, (period,), key=mx.random.key(seed)).tolist()
    return [int(block[i % period]) for i in range(length)]


def _median_passes(n_items: int, passes: int, run_one: Callable[[int], float], tick: Callable[[], None]) -> list[float]:
    """Interleaved passes over the items (direction alternating), one warm-up pass first."""
    samples: list[list[float]] = [[] for _ in range(n_items)]
    for rep in range(passes + 1):
        order = range(n_items) if rep % 2 == 0 else range(n_items - 1, -1, -1)
        for i in order:
            dt = run_one(i)
            if rep:
                samples[i].append(dt)
            tick()
    return [statistics.median(s) * 1000.0 for s in samples]


def measure_verify(target: Any, cache: list, ids: Sequence[int], widths: Sequence[int], passes: int,
                   tick: Callable[[], None] = lambda: None) -> list[float]:
    """Median ms of one forward over each width on ``cache``, trimmed back after each."""
    rows = [mx.array([list(ids[:w])], dtype=mx.uint32) for w in widths]

    def one(i: int) -> float:
        t0 = time.perf_counter()
        logits, _ = target.forward(rows[i], cache)
        mx.eval(logits)
        dt = time.perf_counter() - t0
        target.rollback(cache, widths[i])
        return dt

    return _median_passes(len(widths), passes, one, tick)


def measure_drafter(drafter: Drafter, ids: Sequence[int], caps: Sequence[int], passes: int,
                    tick: Callable[[], None] = lambda: None) -> list[float]:
    from engine.sampling import Sampler, SamplingParams

    sampler = Sampler(SamplingParams(seed=0))

    def one(i: int) -> float:
        t0 = time.perf_counter()
        draft = drafter.propose(ids, caps[i], sampler)
        if draft is not None:
            mx.eval(draft.tokens, *([draft.probs] if draft.probs is not None else []))
        return time.perf_counter() - t0

    return _median_passes(len(caps), passes, one, tick)


class _Alternate:
    """Plain step and speculative round in turn, for the overhead measurement."""

    label = "calibration"

    def __init__(self, cap: int):
        self.spec_cap, self.i = cap, 0

    def cap(self) -> int:
        return self.spec_cap if self.i % 2 else 0

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        self.i += 1


def measure_overhead(target: Any, drafter: Drafter, ids: Sequence[int], cap: int, rounds: int = OVERHEAD_ROUNDS,
                     tick: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """(speculative round, plain step) overhead in ms from the real verify loop.

    Each round's wall time minus the part the curves stand for, taken from the same round's
    own timings (``verify_s``, and ``draft_s`` for a drafter with a model): subtracting a curve
    measured seconds earlier would drown the few-ms overhead in a shared machine's noise. What
    remains is the loop's bookkeeping and, for lookup, its Python n-gram search."""
    from engine.sampling import Sampler, SamplingParams
    from engine.speculative import decode

    spec, plain = [], []
    t_prev, paused = None, 0.0
    steps = decode(target, drafter, ids, Sampler(SamplingParams(seed=0)), max_new_tokens=100_000,
                   cap_policy=_Alternate(cap), mode="calibration")
    try:
        for _, event in steps:
            sampled = t_prev is not None and event.index >= 3
            if sampled:
                model_s = event.verify_s + (event.draft_s if drafter.has_model else 0.0)
                (spec if event.cap else plain).append((event.t - t_prev - paused - model_s) * 1000.0)
            t_prev, paused = event.t, 0.0
            if sampled:
                t_tick = time.perf_counter()
                tick()  # a progress bar's redraw is not the loop's overhead
                paused = time.perf_counter() - t_tick
            if len(spec) >= rounds and len(plain) >= rounds:
                break
    finally:
        steps.close()
    return max(0.0, statistics.median(spec)), max(0.0, statistics.median(plain))


def calibrate(engine: "Engine", mode: str = "lookup", drafter: Drafter | None = None, *, recalibrate: bool = False,
              progress: Progress | None = None, passes: int = PASSES, context: int = CONTEXT,
              overhead_rounds: int = OVERHEAD_ROUNDS) -> Calibration:
    """This pair's calibration: from the cache unless ``recalibrate``, else measured (seconds)
    and cached. ``progress(done, total, stage)`` reports the measurement."""
    if drafter is None:
        drafter = engine.drafter(mode)
    if drafter is None:
        raise TandemError(f"mode '{mode}' has no drafter to calibrate: pick lookup, draft, dspark or dflash")
    if context < 64:
        raise TandemError(f"calibration context must be at least 64 tokens, got {context}")
    fields = key_fields(engine, mode, drafter, context)
    key = cache_key(fields)
    if not recalibrate:
        cached = load_cached(key)
        if cached is not None:
            return cached
    cal = measure(engine, drafter, fields, progress=progress, passes=passes, context=context,
                  overhead_rounds=overhead_rounds)
    save(cal)
    return cal


def measure(engine: "Engine", drafter: Drafter, fields: dict, *, progress: Progress | None = None,
            passes: int = PASSES, context: int = CONTEXT, overhead_rounds: int = OVERHEAD_ROUNDS) -> Calibration:
    from engine.roofline import measure_bandwidth

    target = engine.target
    t_start = time.perf_counter()
    forwards = target.forwards
    widths = width_grid(drafter.max_draft + 1, dense_to=33 if drafter.has_model else 9)
    caps = width_grid(drafter.max_draft, dense_to=33) if drafter.has_model else []
    total = 1 + (passes + 1) * (len(widths) + len(caps)) + 2 * overhead_rounds + 1
    done = 0

    def tick(stage: str) -> Callable[[], None]:
        def _tick() -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(min(done, total), total, stage)
        return _tick

    ids = synthetic_prompt(target.vocab_size, context)
    tap = bool(drafter.tap_layers)
    if tap:
        target.set_taps(drafter.tap_layers)
    try:
        if progress is not None:
            progress(0, total, "prefill")
        cache = target.new_cache()
        _, hidden = target.prefill(ids, cache, tap=tap)
        tick("prefill")()
        probe = ids[-64:] + ids[: max(0, max(widths) - 64)]  # ordinary tokens to verify
        verify_ms = measure_verify(target, cache, probe, widths, passes, tick("verify curve"))
        draft_ms: list[float] = []
        if caps:
            # the loop's state after prefill: the target holds the prompt, the anchor is one more token.
            # A lookup-first combination is priced by its model drafter: lookup's rounds cost ~0, and
            # on this repetitive synthetic context lookup would draft every round.
            costly = getattr(drafter, "model_drafter", drafter)
            costly.begin(ids, hidden)
            draft_ms = measure_drafter(costly, ids + [ids[-64]], caps, passes, tick("drafter curve"))
        del cache, hidden
        cal = Calibration(cache_key(fields), fields, widths, verify_ms, caps, draft_ms)
        # The overhead is the loop's own work, the same at any context: a 128-token prompt keeps
        # this prefill short (and skips a one-off slow first run seen on fresh 512-row caches).
        cal.overhead_ms, cal.step_overhead_ms = measure_overhead(
            target, drafter, ids[:128], min(drafter.max_draft, 8), overhead_rounds, tick("round overhead"))
        cal.bandwidth = measure_bandwidth()
        tick("bandwidth")()
    finally:
        target.forwards = forwards  # calibration forwards are not generation work
    cal.seconds = time.perf_counter() - t_start
    cal.created = time.time()
    return cal


# ===================================================================== tandem calibrate
def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.cli_generate import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--mode", default="lookup", choices=("auto", "lookup", "draft", "dspark", "dflash"),
                   help="which drafter's curves to measure (default: lookup)")
    p.add_argument("--recalibrate", action="store_true", help="measure again even if this pair is cached")
    p.add_argument("--passes", type=int, default=PASSES, help=f"timed passes per width (default {PASSES})")
    p.add_argument("--json", action="store_true", help="print the calibration as JSON")


def format_report(cal: Calibration, engine: "Engine | None" = None) -> str:
    """The curves, the model's rates and the chosen caps, as a text table."""
    v1 = cal.verify(1)
    lines = [f"calibration {'(cached)' if cal.from_cache else f'measured in {cal.seconds:.1f}s'}: {cal.key}",
             f"context {cal.context} tokens | overhead {cal.overhead_ms:.2f} ms/round, plain step "
             f"{cal.step_overhead_ms:.2f} ms | copy bandwidth {cal.bandwidth / 1e9:.2f} GB/s", "",
             "width  verify ms (median)    fit   fit x width-1" + ("   draft ms (cap = width-1)" if cal.draft_caps else "")]
    for w, ms in zip(cal.widths, cal.verify_ms):
        extra = f"   {cal.draft(w - 1):8.2f}" if cal.draft_caps and w > 1 else ""
        lines.append(f"{w:5d}  {ms:18.2f} {cal.verify(w):8.2f} {cal.verify(w) / v1:15.2f}{extra}")
    lines += ["", "predicted tok/s by cap (fixed-length drafts):",
              "  cap " + "".join(f"{f'p={p:.1f}':>9}" for p in (0.3, 0.5, 0.7, 0.9))]
    for c in sorted({0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32} & set(range(cal.max_cap + 1))):
        lines.append(f"  {c:3d} " + "".join(f"{rate(cal, c, p):9.1f}" for p in (0.3, 0.5, 0.7, 0.9)))
    chosen = static_cap(cal)
    lines += ["", f"default cap (p={STATIC_P}): {chosen}  ->  {rate(cal, chosen, STATIC_P):.1f} tok/s predicted vs "
                  f"{rate(cal, 0, STATIC_P):.1f} plain"]
    lines.append("best cap by acceptance: " + ", ".join(
        f"p={p:g}: {best_cap(cal, p)}" for p in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)) + "  (0 = plain steps)")
    if engine is not None and cal.bandwidth > 0:
        from engine.roofline import RooflineModel

        roof = RooflineModel.from_engine(engine, cal.bandwidth)
        base = rate(cal, 0, 0.0)
        s = roof.summary(cal.context, base)
        lines.append(f"roofline at {cal.context} tokens: {s['bytes_per_token'] / 1e6:.1f} MB/token -> ceiling "
                     f"{s['ceiling_tps']:.1f} tok/s; plain steps ~{base:.1f} tok/s = {s['baseline_fraction']:.2f} of it")
    return "\n".join(lines)


def tqdm_progress(desc: str = "calibrating") -> tuple[Progress, Callable[[], None]]:
    """A progress callback drawing a bar on stderr, and a function that closes it."""
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int, stage: str) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, unit="step")
        bar.set_postfix_str(stage, refresh=False)
        bar.update(done - bar.n)

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close


def run(args: argparse.Namespace) -> int:
    from engine.cli_generate import load_engine

    if args.passes < 1:
        raise TandemError(f"--passes must be at least 1, got {args.passes}")
    eng = load_engine(args)
    mode = eng.resolve_mode(args.mode)
    drafter = eng.drafter(mode)
    progress, close = tqdm_progress(f"calibrating {eng.name} / {mode}")
    try:
        cal = calibrate(eng, mode, drafter, recalibrate=args.recalibrate, progress=progress, passes=args.passes)
    finally:
        close()
    if args.json:
        out = cal.to_dict()
        out["default_cap"] = static_cap(cal)
        out["from_cache"] = cal.from_cache
        print(json.dumps(out, indent=1))
    else:
        print(format_report(cal, eng))
        print(f"cache: {cache_path()}")
    return 0


__all__ = ["Calibration", "CapController", "LearnedState", "auto_cap_policy", "best_cap", "cache_key", "calibrate",
           "default_cap", "expected_ms", "expected_tokens", "key_fields", "rate", "rates", "static_cap"]
