"""Per-machine cost curves, the draft cap they imply, and the ``--max-draft auto`` controller.

Whether speculation pays, and how many drafts to verify, depends on how a target forward's cost
grows with its width on *this* machine: on a 2-core Linux CPU with OpenBLAS, 16 rows cost 1.6-2.6x
one row; with MLX's CPU quantized kernels they cost 16x (spec/models.md §3.4). So the engine measures:

* ``verify(w)``: ms of one target forward over ``w`` tokens on a warm synthetic 512-token
  context, rolled back after each (``Target.verify`` and its cache transaction);
* ``draft(c)``: ms of one proposal of ``c`` tokens, for drafters with their own model
  (n-gram lookup costs ~0 and its Python time lands in the overhead);
* the per-round overhead: full synthetic rounds of the real verify loop minus their forward (and
  model drafter) time, for speculative rounds and for plain steps;
* the machine's copy bandwidth (for the roofline).

Warm-ups, then medians over interleaved passes (a contended machine shifts all widths alike
instead of bending the curve). The result is cached in ``<cache>/calibration.json`` keyed by
device, MLX version, backend, precision, target, drafter and schema version.

The cost model and the live controller: ``engine/cost_model.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx

from engine.cost_model import (
    CONTEXT,
    STATIC_P,
    Calibration,
    CapController,
    LearnedState,
    best_cap,
    rate,
    static_cap,
)
from engine.drafters.base import Drafter
from engine.errors import TandemError
from engine.protocols import EngineLike

SCHEMA = 1
PASSES = 4  # timed passes over the width grid (plus one warm-up pass)
OVERHEAD_ROUNDS = 12  # rounds of each kind (speculative, plain) timed for the overhead

Progress = Callable[[int, int, str], None]  # (done, total, stage)


# Learned state per engine (weakly held) and (mode, drafter): the next request starts warm.
_LEARNED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

#: Progress callback for a calibration that ``--max-draft auto`` triggers on first use of a pair
#: (the app or a CLI sets it to show a bar; None measures silently).
auto_progress: Progress | None = None


def auto_cap_policy(engine: EngineLike, mode: str, drafter: Drafter) -> CapController:
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


def default_cap(engine: EngineLike, mode: str, drafter: Drafter) -> int | None:
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


def _target_id(engine: EngineLike) -> str:
    loaded = getattr(engine, "loaded", None)
    path = getattr(loaded, "path", None)
    base = Path(str(path)).name if path else engine.name
    return f"{base}#{_shape_signature(engine.target.model)}"


def _drafter_id(engine: EngineLike, mode: str, drafter: Drafter) -> str:
    parts = [mode, drafter.name, f"max{drafter.max_draft}"]
    spec = engine.draft_model_spec if mode == "draft" else engine.drafter_path if mode in ("dspark", "dflash", "eagle3", "mtp") else None
    if spec:
        parts.append(Path(str(spec)).name)
    model = getattr(drafter, "model", None)
    if drafter.has_model and model is not None and hasattr(model, "parameters"):
        parts.append(_shape_signature(model))
        parts.append(model_precision(model))
    return ":".join(parts)


KEY_FIELDS = ("schema", "device", "mlx", "backend", "precision", "target", "drafter", "context")


def key_fields(engine: EngineLike, mode: str, drafter: Drafter, context: int = CONTEXT) -> dict:
    from engine import platform

    return {
        "schema": SCHEMA, "device": platform.device_name(), "mlx": mx.__version__,
        "backend": platform.backend() + ("+skinny" if platform.skinny_active() else ""),  # cheaper narrow forwards
        "precision": model_precision(engine.target.model), "target": _target_id(engine),
        "drafter": _drafter_id(engine, mode, drafter), "context": context,
    }


def cache_key(fields: dict) -> str:
    return "|".join(f"{name}={fields[name]}" for name in KEY_FIELDS)


def calibration_key(engine: EngineLike, mode: str, drafter: Drafter, context: int = CONTEXT) -> str:
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
    """Median ms of one verify forward over each width on ``cache``, rolled back after each
    (a one-row forward is a plain step and keeps its row: the context grows by a few tokens)."""
    rows = [mx.array([list(ids[:w])], dtype=mx.uint32) for w in widths]

    def one(i: int) -> float:
        t0 = time.perf_counter()
        logits, _, txn = target.verify(rows[i], cache)
        mx.eval(logits)
        dt = time.perf_counter() - t0
        txn.commit(1 if widths[i] == 1 else 0)
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


def calibrate(engine: EngineLike, mode: str = "lookup", drafter: Drafter | None = None, *, recalibrate: bool = False,
              progress: Progress | None = None, passes: int = PASSES, context: int = CONTEXT,
              overhead_rounds: int = OVERHEAD_ROUNDS) -> Calibration:
    """This pair's calibration: from the cache unless ``recalibrate``, else measured (seconds)
    and cached. ``progress(done, total, stage)`` reports the measurement."""
    if drafter is None:
        drafter = engine.drafter(mode)
    if drafter is None:
        raise TandemError(f"mode '{mode}' has no drafter to calibrate: pick lookup, draft, dspark, dflash, eagle3 or mtp")
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


def measure(engine: EngineLike, drafter: Drafter, fields: dict, *, progress: Progress | None = None,
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


def format_report(cal: Calibration, engine: EngineLike | None = None) -> str:
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
