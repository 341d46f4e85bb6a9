"""Warm-up at load time: run once every shape a session will use, before the first request.

A GPU backend compiles a kernel (MLX CUDA: a cuDNN attention graph, a matmul plan, a fused
elementwise kernel) the first time it sees a shape. Under the shape policy
(``engine/shapes.py``) a session only ever uses a few: the verify ladder's widths and one-row
steps at each KV capacity, and each block drafter's block at each of its capacities. This runs
all of them for the capacities up to ``tokens`` context tokens (KV buffers reserved, not
filled: kernels depend on shapes, not values), then a short generation per mode for everything
else. Without a shape policy (CPU, Metal) only the short generations run.

A batch (engine/batch.py) multiplies the shapes by its row count: with ``rows`` > 1 the verify
ladder runs again over 2..``rows`` rows' slots at each capacity, and each mode generates once
more per row count (``generate_rows``: the drafters' batched proposals, the queued plain steps).
Without it an H100 paid 40-64 ms ticks, against 7-9 ms, where a batch met a shape first.

Capacities past ``tokens`` compile on first use, unless ``shapes_past`` runs them: the same steps,
one at a time, which ``tandem serve``'s engine thread advances while idle (engine/serve/worker.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import mlx.core as mx

from engine import caches
from engine.drafters.block import CONTEXT_CHUNK
from engine.protocols import EngineLike
from engine.shapes import StableKVCache
from engine.shapes import capacity as capacity_of
from engine.slot_kv import Slots

WARM_TOKENS = 4096  # context the shapes are prepared for (later capacities compile on first use)
Progress = Callable[[int, int, str], None]


def tokens_for(prompt_lengths: Iterable[int], max_new_tokens: int) -> int:
    """The context a warm-up covers for these prompts: ``WARM_TOKENS``, or the longest prompt with
    its answer where longer. A benchmark warms this far, so that no timed pass compiles a shape
    (the first arm to meet a long context would pay for every arm after it)."""
    return max([WARM_TOKENS] + [n + max_new_tokens + 1 for n in prompt_lengths])


@dataclass(frozen=True)
class Warmed:
    """What ``warm_up`` prepared on an engine (``engine.warmed``), for ``shapes_past`` to go on from."""
    modes: tuple[str, ...]
    rows: int
    tokens: int  # the largest KV capacity warmed


@dataclass
class _Plan:
    """The shapes a warm-up runs at each capacity: the verify ladder's widths, the batch row counts,
    and the drafters with shapes of their own."""
    widths: list[int]
    batches: list[int]
    block_drafters: list = field(default_factory=list)
    draft_models: list = field(default_factory=list)

    def units(self) -> int:
        """Steps of one capacity (``_capacity_steps`` yields this many)."""
        return len(self.widths) * (1 + len(self.batches)) + len(self.block_drafters) + len(self.draft_models)


def _plan(engine: EngineLike, modes: Sequence[str], rows: int) -> _Plan:
    target, policy = engine.target, engine.target.shapes
    drafters = {m: engine.drafter(m) for m in modes if m != "baseline"}
    widest = max([d.max_draft + 1 for d in drafters.values() if d is not None] + [1])
    unique = list({id(d): d for d in drafters.values() if d is not None}.values())
    return _Plan(widths=policy.ladder(widest) if policy else [],
                 batches=list(range(2, rows + 1)) if policy and target.batch_blocker() is None else [],
                 block_drafters=[d for d in unique if hasattr(getattr(d, "model_drafter", d), "reserve")],
                 draft_models=[d for d in unique if hasattr(d, "warm_up")])  # a draft model's own pieces


def warm_up(engine: EngineLike, modes: Sequence[str] = ("baseline",), *, tokens: int = WARM_TOKENS,
            progress: Progress | None = None, generate: Callable[[str], object] | None = None,
            rows: int = 1, generate_rows: Callable[[str, int], object] | None = None) -> float:
    """Prepare ``modes`` on ``engine`` for batches of up to ``rows`` rows; returns the seconds it
    took. ``generate(mode)`` runs a short generation of a mode (the Engine passes its own),
    ``generate_rows(mode, n)`` a short batch of ``n`` requests (engine/batching.py's)."""
    t0 = time.perf_counter()
    policy = engine.target.shapes
    plan = _plan(engine, modes, rows)
    capacities = capacity_of(tokens, policy.step) // policy.step if policy else 0
    total = capacities * plan.units() + len(modes) * (1 + (len(plan.batches) if generate_rows is not None else 0))
    done = 0

    def tick(stage: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, stage)

    if policy is not None:  # every capacity, from the first
        engine.warmed = Warmed(tuple(modes), rows, 0)
        for stage in _capacities(engine, plan, tokens):
            tick(stage)
    for mode in modes:
        if generate is not None:
            generate(mode)
        tick(f"{mode} warm-up generation")
        for n in plan.batches if generate_rows is not None else ():
            generate_rows(mode, n)
            tick(f"{mode} warm-up batch of {n}")
    return time.perf_counter() - t0


def shapes_past(engine: EngineLike, tokens: int) -> Iterator[str]:
    """The shapes of the KV capacities past those ``warm_up`` prepared (``engine.warmed``: its
    modes and rows), up to the one holding ``tokens``, run one step (one width of one row count,
    or one drafter's shapes) each time it is advanced; each step's stage once it ran. A serving
    engine thread advances this while idle, so a request longer than any before it (an agent's
    context grows request by request) meets compiled shapes instead of compiling them in its
    ticks. Nothing without a shape policy or a warm-up."""
    warmed = getattr(engine, "warmed", None)
    if warmed is None or engine.target.shapes is None:
        return iter(())
    return _capacities(engine, _plan(engine, warmed.modes, warmed.rows), tokens)


def _capacities(engine: EngineLike, plan: _Plan, tokens: int) -> Iterator[str]:
    """Every shape of ``plan`` at each capacity past ``engine.warmed``'s up to the one holding
    ``tokens``, a step per yield (its stage); ``engine.warmed`` grows as each capacity ends."""
    target, warmed, step = engine.target, engine.warmed, engine.target.shapes.step
    for capacity in range(warmed.tokens + step, capacity_of(tokens, step) + 1, step):
        yield from _uncounted(target, _capacity_steps(target, plan, capacity))
        engine.warmed = Warmed(warmed.modes, warmed.rows, capacity)


def _capacity_steps(target, plan: _Plan, capacity: int) -> Iterator[str]:
    """Every shape of ``plan`` at one KV capacity, a step per yield (its stage)."""
    for _ in _target_shapes(target, capacity, plan.widths):
        yield f"target shapes at {capacity} tokens"
    for n in plan.batches:
        for _ in _batch_shapes(target, n, capacity, plan.widths):
            yield f"{n}-row batch shapes at {capacity} tokens"
    for drafter in plan.block_drafters:
        _drafter_shapes(target, getattr(drafter, "model_drafter", drafter), capacity)
        yield f"drafter shapes at {capacity} tokens"
    for drafter in plan.draft_models:
        drafter.warm_up(capacity)
        yield f"draft model shapes at {capacity} tokens"


def _uncounted(target, steps: Iterator[str]) -> Iterator[str]:
    """``steps``, the target's forwards in each not counted as generation work (a serving
    engine's telemetry counts requests' forwards between them)."""
    while True:
        forwards = target.forwards
        try:
            stage = next(steps)
        except StopIteration:
            return
        finally:
            target.forwards = forwards
        yield stage


def warm_prompt(vocab_size: int, n: int = 16) -> list[int]:
    """The token ids a warm-up generation feeds (any ids do: kernels depend on shapes)."""
    return [(5 * i + 2) % max(2, vocab_size) for i in range(n)]


def _prompt(target, n: int = 8) -> list[int]:
    vocab = max(2, target.vocab_size)
    return [(7 * i + 3) % vocab for i in range(n)]


def _reserve(cache: list, capacity: int) -> None:
    for c in caches.leaves(cache):  # a hybrid layer's CacheList holds its KV cache inside
        if isinstance(c, StableKVCache):
            c.reserve(capacity, (c.keys, c.values))


def _target_shapes(target, capacity: int, widths: Sequence[int]) -> Iterator[None]:
    """A forward at each ladder width (and a one-row step) on a cache of ``capacity`` rows."""
    ids = _prompt(target, max(8, max(widths, default=1)))
    cache = target.new_cache()
    target.prefill(ids[:4], cache)
    _reserve(cache, capacity)
    for w in widths:
        logits, _, txn = target.verify(mx.array([ids[:w]], dtype=mx.uint32), cache)
        mx.eval(logits)
        txn.commit(1 if w == 1 else 0)  # a one-row step keeps its row (the capacity stays)
        yield


def _batch_shapes(target, rows: int, capacity: int, widths: Sequence[int]) -> Iterator[None]:
    """A batched forward at each ladder width over ``rows`` rows' slots of ``capacity`` columns
    (the rows of different lengths, as a batch's are)."""
    ids = _prompt(target, max(8, max(widths, default=1)) + rows)
    slots, row_caches = Slots(), []
    for b in range(rows):
        cache = target.new_cache()
        target.prefill(ids[: 4 + b], cache)
        slots.join(cache)
        row_caches.append(cache)
    slots.reserve(capacity)
    for w in widths:
        logits, _, txns = target.verify_rows(mx.array([ids[:w]] * rows, dtype=mx.uint32), row_caches)
        mx.eval(logits)
        for txn in txns:
            txn.commit(1 if w == 1 else 0)  # as _target_shapes: a one-row step keeps its row
        yield


def _drafter_shapes(target, drafter, capacity: int) -> None:
    """One proposal with the drafter's context buffers at ``capacity`` rows."""
    from engine.sampling import Sampler, SamplingParams

    ids = _prompt(target)
    if drafter.tap_layers:
        target.set_taps(drafter.tap_layers)
    _, hidden = target.prefill(ids[:-1], target.new_cache(), tap=bool(drafter.tap_layers))
    drafter.begin(ids[:-1], hidden)
    drafter.reserve(capacity)
    draft = drafter.propose(ids, drafter.max_draft, Sampler(SamplingParams()))
    if draft is not None:
        mx.eval(draft.tokens)
    # Rows committed during plain steps are projected in power-of-two pieces: each piece size
    # into a buffer of this capacity (zeros: kernels depend on shapes, not values).
    size = 1
    while size <= min(CONTEXT_CHUNK, capacity - len(ids)):
        drafter.begin(ids[:-1], hidden)
        drafter.reserve(capacity)
        drafter.commit(ids, size, mx.zeros((size, hidden.shape[-1]), dtype=hidden.dtype))
        drafter.reserve(capacity)  # projects the pending rows
        mx.eval(drafter.state().tree)
        size *= 2
