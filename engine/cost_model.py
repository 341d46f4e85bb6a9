"""The cost model of a speculative round: expected tokens, time and rate at each draft cap.

A ``Calibration`` holds one machine's measured cost curves for a (target, drafter) pair
(``engine/calibrate.py`` measures and caches them).

Cost model. A drafter proposes ``L`` tokens (``L`` random for lookup: 0 without a match, then
``2*match-2``; fixed for model drafters); under cap ``C`` the loop verifies ``k = min(C, L)``.
Each draft token is accepted with probability ``p`` given the previous one was (per-token
Bernoulli), so with ``S(i) = P(L >= i)``::

    tokens(C) = 1 + sum_{i=1..C} S(i) p^i
    ms(C)     = sum_k P(k) verify(k + 1) + draft(C) + overhead          (C >= 1)
    rate(C)   = tokens(C) / ms(C),        rate(0) = 1 / plain step

``verify(w)`` prices the width a forward really runs at (padded to the shape ladder on CUDA);
a plain step is a pipelined one, measured as the loop runs it.

With ``S = 1`` (a fixed-length drafter) this is ``(1 + sum p^i) / (draft(C) + verify(C+1) +
overhead)``. The default cap maximises it at ``STATIC_P`` = 0.70, the acceptance mlx-dspark fit
to 7 of 8 measured optima. The ``--max-draft auto`` controller (``engine/cap_controller.py``)
re-fits ``p``, ``S`` and the costs from live rounds and compares realized round time with realized
plain-step time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

CONTEXT = 512  # synthetic context the curves are measured at
STATIC_P = 0.70  # acceptance the default cap is chosen at
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
    step_overhead_ms: float = 0.0  # per plain step beyond verify(1), when plain_ms is not measured
    plain_ms: float = 0.0  # one pipelined plain step as the loop runs it (0: verify(1) + step_overhead_ms)
    pad_widths: list[int] = field(default_factory=list)  # verify widths padded to this ladder (CUDA)
    confidence_rule: str | None = None  # DSpark confidence cut chosen for this machine (calibrate.tune_cut)
    confidence_threshold: float | None = None
    confidence_table: dict = field(default_factory=dict)  # "rule@threshold" -> predicted tok/s
    bandwidth: float = 0.0  # copy bandwidth, bytes/s
    # verify(w) of a forward over B sequences at once (continuous batching): "B" -> ms at each of
    # ``batch_widths`` (the narrow end of ``widths``, where a batch's caps fall)
    batch_verify_ms: dict = field(default_factory=dict)
    batch_widths: list[int] = field(default_factory=list)
    # what B rows' drafts cost proposed together (``propose_rows``), as a multiple of one row's:
    # "B" -> ratio (empty: the drafter proposes row by row, B times one row's cost)
    batch_draft_scale: dict = field(default_factory=dict)
    context: int = CONTEXT
    # the same forwards after ``long_context`` tokens (0: not measured): verify at ``long_widths``,
    # the drafter at ``long_caps``; ``at_context`` prices a longer context from the two
    long_context: int = 0
    long_widths: list[int] = field(default_factory=list)
    long_verify_ms: list[float] = field(default_factory=list)
    long_caps: list[int] = field(default_factory=list)
    long_draft_ms: list[float] = field(default_factory=list)
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
        never costs less; dips are mostly timing noise on a busy machine), interpolated; a
        width is priced at the ladder width it is padded to."""
        if self._verify_fit is None:
            fit = _isotonic(self.verify_ms)
            self._verify_fit = [_interp(self.widths, fit, w) for w in range(max(self.widths) + 1)]
        width = int(width)
        if self.pad_widths:
            width = next((w for w in self.pad_widths if w >= width), width)
        return self._verify_fit[min(max(width, 0), len(self._verify_fit) - 1)]

    def plain_step_ms(self) -> float:
        return self.plain_ms if self.plain_ms > 0 else self.verify(1) + self.step_overhead_ms

    def draft(self, cap: int) -> float:
        if cap <= 0 or not self.draft_caps:
            return 0.0
        if self._draft_fit is None:
            fit = _isotonic(self.draft_ms)
            self._draft_fit = [_interp(self.draft_caps, fit, c) for c in range(max(self.draft_caps) + 1)]
        return self._draft_fit[min(int(cap), len(self._draft_fit) - 1)]

    def at_batch(self, rows: int) -> "Calibration":
        """These curves as one of ``rows`` sequences decoding together sees them: a round or a
        plain step lasts the batch's forward (verify at ``rows`` rows, interpolated between the
        measured batch sizes, wider widths scaled like the one-row curve) plus every row's
        bookkeeping and the batch's drafting (the rows' drafts proposed together, as measured,
        or one row's after another). Itself when ``rows`` is 1 or no batch was measured."""
        sizes = sorted(int(b) for b in self.batch_verify_ms)
        if rows <= 1 or not sizes or not self.batch_widths:
            return self
        lower = max([1] + [b for b in sizes if b <= rows])
        upper = min([b for b in sizes if b >= rows], default=lower)

        def curve(b: int) -> list[float]:
            return [self.verify(w) for w in self.batch_widths] if b == 1 else self.batch_verify_ms[str(b)]

        lo, hi = curve(lower), curve(upper)
        t = 0.0 if upper == lower else (rows - lower) / (upper - lower)
        at = [a + (b - a) * t for a, b in zip(lo, hi)]
        edge = self.batch_widths[-1]
        scale = _interp(self.batch_widths, at, edge) / max(self.verify(edge), 1e-9)
        verify = [_interp(self.batch_widths, at, w) if w <= edge else self.verify(w) * scale for w in self.widths]
        step = _interp(self.batch_widths, at, 1) / max(self.verify(1), 1e-9)
        drafting = _batch_drafting(self.batch_draft_scale, rows)
        return replace(self, verify_ms=verify, draft_ms=[ms * drafting for ms in self.draft_ms],
                       overhead_ms=self.overhead_ms * rows, plain_ms=self.plain_ms * step,
                       step_overhead_ms=self.step_overhead_ms * rows, batch_verify_ms={}, batch_widths=[])

    def at_context(self, tokens: int) -> "Calibration":
        """These curves after ``tokens`` tokens of context: each forward's cost grows linearly with
        the context it attends over (the K/V it reads), at the per-token slope measured between
        ``context`` and ``long_context`` (per width for the verify, per cap for the drafter;
        interpolated between the widths measured, never negative), extrapolated past it. A plain
        step grows like a one-row verify, a batch's forward like one row's times its rows. Itself
        at or below ``context`` (the curves as measured) or when no long context was measured."""
        extra = int(tokens) - self.context
        if extra <= 0 or self.long_context <= self.context or not self.long_widths:
            return self
        span = self.long_context - self.context

        def slope(points: Sequence[int], long_ms: Sequence[float], short: Callable[[int], float]) -> Callable[[int], float]:
            per_token = [max(0.0, (ms - short(x)) / span) for x, ms in zip(points, _isotonic(long_ms))]
            return lambda x: _interp(points, per_token, x)

        verify = slope(self.long_widths, self.long_verify_ms, self.verify)
        draft = slope(self.long_caps, self.long_draft_ms, self.draft) if self.long_caps and self.draft_caps else None
        return replace(
            self, verify_ms=[ms + extra * verify(w) for w, ms in zip(self.widths, self.verify_ms)],
            draft_ms=[ms + extra * draft(c) for c, ms in zip(self.draft_caps, self.draft_ms)] if draft else self.draft_ms,
            plain_ms=self.plain_ms + extra * verify(1) if self.plain_ms > 0 else 0.0,
            batch_verify_ms={b: [ms + int(b) * extra * verify(w) for w, ms in zip(self.batch_widths, curve)]
                             for b, curve in self.batch_verify_ms.items()},
            context=int(tokens), long_context=0, long_widths=[], long_verify_ms=[], long_caps=[], long_draft_ms=[])

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
                  step_overhead_ms: float = 0.0, plain_ms: float = 0.0) -> "Calibration":
        """Curves from a function of the width (or a list indexed by width - 1): for tests and
        what-if tables."""
        widths = list(range(1, max_cap + 2))
        v = [float(verify(w)) if callable(verify) else float(verify[w - 1]) for w in widths]
        caps = list(range(1, max_cap + 1)) if draft else []
        return cls("synthetic", {}, widths, v, caps, [float(draft(c)) for c in caps] if draft else [],
                   overhead_ms, step_overhead_ms, plain_ms)


def _isotonic(ys: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def _batch_drafting(scale: dict, rows: int) -> float:
    """What ``rows`` rows' drafts cost, in one row's: the measured ratios interpolated (past the
    largest batch measured, growing with the rows from there); ``rows`` where none were measured."""
    if not scale:
        return float(rows)
    sizes = sorted(int(b) for b in scale)
    top = sizes[-1]
    ratio = _interp([1] + sizes, [1.0] + [float(scale[str(b)]) for b in sizes], min(rows, top))
    return ratio * max(1.0, rows / top)


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
        return cal.plain_step_ms()
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
    out = [1000.0 / cal.plain_step_ms()]
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
    return argmax_cap(rates(cal, p, survival, max_cap), allow_park)


def argmax_cap(values: Sequence[float], allow_park: bool) -> int:
    """The cap (an index of ``values``, rates per cap) with the highest rate, the smallest one on a
    tie; 0 only when ``allow_park``."""
    best, best_value = None, -1.0
    for c in range(0 if allow_park else 1, len(values)):
        if values[c] > best_value * (1 + 1e-9):
            best, best_value = c, values[c]
    return int(best if best is not None else 0)


def static_cap(cal: Calibration, p: float = STATIC_P, max_cap: int | None = None) -> int:
    """The default cap for fixed ``--max-draft``-less runs: best at ``p``, never 0 (a user who
    picked a speculative mode gets speculation; ``auto`` may park it)."""
    return best_cap(cal, p, max_cap=max_cap, allow_park=False)
