"""Race verdicts and replay maths: pure functions over token-id lists (no Qt, no MLX).

A race runs several decoders on one prompt with the same settings. Greedy speculative
decoding is lossless, so every lane must emit baseline's tokens. The verdict compares each lane
with baseline (lane 0): identical, a length-only difference (one lane stopped earlier, e.g. a
stop string landing in a different round; not a divergence), or the first diverging position.
There the worker re-runs baseline's prefix on a clean cache and reports the target's logit
margin between its top-2 tokens: a margin of ~0 is a floating-point tie (a verify forward over
several rows may round differently from a one-row step), a clear margin is a real bug.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Sequence

# Logit gap under which two tokens count as tied. Measured divergences of correct engines on
# quantized/bf16 paths sit at 0.0-0.125 (spec/drafters.md "test strategy"); float32 is far tighter.
TIE_MARGIN = 0.125


@dataclass(frozen=True)
class Verdict:
    status: str  # "identical", "length_only", "diverged", "sampled"
    index: Optional[int] = None  # first diverging position
    expected: Optional[int] = None  # baseline's token there
    got: Optional[int] = None  # this lane's token there
    margin: Optional[float] = None  # target's top-1 minus top-2 logit at that position (clean re-run)
    gap: Optional[float] = None  # target's logit of baseline's token minus that of this lane's token
    text: str = ""

    @property
    def is_tie(self) -> Optional[bool]:
        value = self.gap if self.gap is not None else self.margin
        return None if value is None else abs(value) <= TIE_MARGIN

    @property
    def ok(self) -> bool:
        """True unless this is a greedy divergence that is not a tie (a bug) or not yet explained."""
        return self.status in ("identical", "length_only", "sampled") or bool(self.is_tie)


def first_divergence(reference: Sequence[int], candidate: Sequence[int]) -> Optional[int]:
    """Index of the first position where both lists have a token and they differ."""
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return i
    return None


def token_diff(reference: Sequence[int], candidate: Sequence[int]) -> list[str]:
    """Per candidate token: "same"; "diverged" at the first divergence; "after" for everything past
    it (the two texts no longer line up); "extra" past baseline's end when nothing diverged."""
    first = first_divergence(reference, candidate)
    out = []
    for i in range(len(candidate)):
        if first is not None and i >= first:
            out.append("diverged" if i == first else "after")
        else:
            out.append("extra" if i >= len(reference) else "same")
    return out


def classify(gap_or_margin: Optional[float], tie_margin: float = TIE_MARGIN) -> str:
    if gap_or_margin is None:
        return "unexplained"
    return "tie" if abs(gap_or_margin) <= tie_margin else "bug"


def verdict(reference: Sequence[int], candidate: Sequence[int], *, greedy: bool = True,
            margin: Optional[float] = None, gap: Optional[float] = None,
            token_text: Optional[dict[int, str]] = None, tie_margin: float = TIE_MARGIN) -> Verdict:
    """Compare one lane with baseline. ``margin``/``gap`` come from the worker's clean re-run."""
    name = (lambda t: repr(token_text.get(t, str(t)))) if token_text else (lambda t: f"#{t}")
    first = first_divergence(reference, candidate)
    if first is None:
        if len(reference) == len(candidate):
            return Verdict("identical", text=f"identical ({len(candidate)} tokens)")
        short, long_ = sorted((len(reference), len(candidate)))
        return Verdict("length_only", text=f"identical for {short} tokens; lengths differ ({len(reference)} vs "
                                           f"{len(candidate)}): not a divergence")
    exp, got = reference[first], candidate[first]
    where = f"first divergence at token {first}: baseline {name(exp)}, this lane {name(got)}"
    if not greedy:
        return Verdict("sampled", first, exp, got, margin, gap,
                       f"{where}; sampled (temperature > 0) lanes are separate exact samples, so differences "
                       "are expected")
    value = gap if gap is not None else margin
    kind = classify(value, tie_margin)
    what = "logit gap" if gap is not None else "top-2 logit margin"
    if kind == "tie":
        tail = f"; target's {what} there is {value:.4g}: a floating-point tie, not a bug"
    elif kind == "bug":
        tail = (f"; target's {what} there is {value:.4g}: the target clearly prefers {name(exp)}, "
                "a real divergence (bug)")
    else:
        tail = ""
    return Verdict("diverged", first, exp, got, margin, gap, where + tail)


def speedup(tps: float, baseline_tps: float) -> Optional[float]:
    return tps / baseline_tps if baseline_tps > 0 and tps > 0 else None


def visible_tokens(token_times: Sequence[float], t: float) -> int:
    """How many tokens a lane had emitted ``t`` seconds after its request began (for the replay)."""
    return bisect.bisect_right(token_times, t)


def replay_length(lanes_token_times: Sequence[Sequence[float]]) -> float:
    """Seconds the side-by-side replay lasts: until the slowest lane's last token."""
    return max((times[-1] for times in lanes_token_times if times), default=0.0)
