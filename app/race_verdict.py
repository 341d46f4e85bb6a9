"""Race verdicts and replay maths: pure functions over token-id lists (no Qt, no MLX).

A race runs several decoders on one prompt with the same settings. Greedy speculative
decoding is lossless, so every lane must emit baseline's tokens, and stop where baseline stops:
with the same token budget the lengths of two greedy lanes cannot legitimately differ, so a
lane that ends (EOS) where baseline goes on, or goes on where baseline ended, diverges there
(EOS versus a token) like any other. Only a lane the user stopped (cancelled) may be shorter.
At the first diverging position the worker re-runs baseline's prefix on a clean cache and
reports the target's logit margin between its top-2 tokens and the gap between the two tokens:
~0 is a floating-point tie (a verify forward over several rows may round differently from a
one-row step), a clear gap is a real bug.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

# Logit gap under which two tokens count as tied. Measured divergences of correct engines on
# quantized/bf16 paths sit at 0.0-0.125 (spec/drafters.md "test strategy"); float32 is far tighter.
TIE_MARGIN = 0.125


@dataclass(frozen=True)
class Verdict:
    status: str  # "identical", "diverged", "cancelled" (a lane the user stopped), "sampled"
    index: Optional[int] = None  # first diverging position
    expected: Optional[int] = None  # baseline's token there; None: baseline ended there (EOS)
    got: Optional[int] = None  # this lane's token there; None: this lane ended there (EOS)
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
        return self.status in ("identical", "cancelled", "sampled") or bool(self.is_tie)


def first_divergence(reference: Sequence[int], candidate: Sequence[int]) -> Optional[int]:
    """The first position where the two outputs differ, the end of an output counting as a
    token (EOS): one that stops where the other goes on differs there. None when identical."""
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def token_diff(reference: Sequence[int], candidate: Sequence[int]) -> list[str]:
    """Per candidate token: "same"; "diverged" at the first divergence; "after" for everything past
    it (the two texts no longer line up)."""
    first = first_divergence(reference, candidate)
    first = len(candidate) if first is None else first
    return ["same" if i < first else ("diverged" if i == first else "after") for i in range(len(candidate))]


def token_sources(rounds: Iterable[tuple[int, int, str]]) -> list[str]:
    """How each emitted token was produced, from each round's (accepted, committed, drafted_by):
    a round commits its accepted drafts first, then one token of the target's own (unless EOS or
    the length limit cut the round short). "lookup": an n-gram lookup draft the target accepted;
    "drafter": a drafter model's (draft model, DSpark, DFlash); "target": the target's own choice."""
    out: list[str] = []
    for accepted, committed, drafted_by in rounds:
        drafted = min(accepted, committed) if drafted_by else 0
        out += ["lookup" if drafted_by == "lookup" else "drafter"] * drafted + ["target"] * (committed - drafted)
    return out


def classify(gap_or_margin: Optional[float], tie_margin: float = TIE_MARGIN) -> str:
    if gap_or_margin is None:
        return "unexplained"
    return "tie" if abs(gap_or_margin) <= tie_margin else "bug"


def verdict(reference: Sequence[int], candidate: Sequence[int], *, greedy: bool = True,
            margin: Optional[float] = None, gap: Optional[float] = None,
            token_text: Optional[dict[int, str]] = None, tie_margin: float = TIE_MARGIN,
            reference_finish: str = "", candidate_finish: str = "") -> Verdict:
    """Compare one lane with baseline. ``margin``/``gap`` come from the worker's clean re-run;
    the finish reasons ("stop", "length", "cancelled") tell a lane the user stopped from one
    that ended early on its own."""
    def name(t: Optional[int]) -> str:
        if t is None:
            return "end of output (EOS)"
        return repr(token_text.get(t, str(t))) if token_text else f"#{t}"

    first = first_divergence(reference, candidate)
    if first is None:
        return Verdict("identical", text=f"identical ({len(candidate)} tokens)")
    shorter_finish = candidate_finish if len(candidate) < len(reference) else reference_finish
    if first == min(len(reference), len(candidate)) and shorter_finish == "cancelled":
        return Verdict("cancelled", text=f"identical for {first} tokens, then stopped by the user")
    exp = reference[first] if first < len(reference) else None
    got = candidate[first] if first < len(candidate) else None
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
