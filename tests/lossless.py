"""Helpers that prove losslessness: compare two greedy token streams and, where they differ,
show that the target was at an exact floating-point tie there (else it is a bug)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

TIE_MARGIN = 1e-4  # top-2 logit gap below which batched vs single-row float rounding may flip argmax


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token. Runs with the same token budget that differ only in
    length differ at the shorter one's end (one of them stopped at EOS there)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(model, prefix: Sequence[int], new_cache=None) -> float:
    """Gap between the two largest next-token logits after ``prefix`` (a clean forward on a cache
    from ``new_cache``, default the model's own)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = new_cache() if new_cache is not None else make_prompt_cache(model)
    logits = model(mx.array([list(prefix)]), cache=cache)[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:]
    return (top[1] - top[0]).item()


def assert_same_greedy(model, prompt_ids: Sequence[int], baseline: Sequence[int], other: Sequence[int], label: str,
                       new_cache=None):
    """Equal, or different only at a float tie of the target (proved by the margin)."""
    i = first_divergence(baseline, other)
    if i is None:
        return
    margin = top2_margin(model, list(prompt_ids) + list(baseline[:i]), new_cache)
    assert margin < TIE_MARGIN, (
        f"{label}: diverged from baseline at token {i} with a top-2 logit margin "
        f"of {margin:.3g}: not a floating-point tie, so this is a bug")
