"""Per-machine cost curves, the draft cap they imply, and the ``--max-draft auto`` controller.

Whether speculation pays, and how many drafts to verify, depends on how a target forward's cost
grows with its width on *this* machine: on a 2-core Linux CPU with OpenBLAS, 16 rows cost 1.6-2.6x
one row; with MLX's CPU quantized kernels they cost 16x (spec/models.md §3.4). So the engine measures:

* ``verify(w)``: ms of one target forward over ``w`` tokens on a warm synthetic 512-token
  context, rolled back after each (``Target.verify`` and its cache transaction);
* ``draft(c)``: ms of one proposal of ``c`` tokens, for drafters with their own model
  (n-gram lookup costs ~0 and its Python time lands in the overhead);
* rounds as the loop runs them: full synthetic rounds of the real verify loop minus their
  forward (and model drafter) time give the per-round overhead; a run of the loop's pipelined
  plain steps gives the plain step (what ``--max-draft auto`` parks on);
* under a shape policy (CUDA) the verify curve is measured at the ladder widths the loop pads
  to, and every other width is priced at its padded one;
* for a DSpark drafter with a confidence head, the cut (rule and threshold) that pays here:
  a greedy trace of its per-slot scores and the target's acceptance on a few shipped prompts,
  priced with these curves (``tune_cut``);
* the machine's copy bandwidth (for the roofline);
* the same forwards after ``LONG_CONTEXT`` x as many tokens (4096), at a few widths (and the drafter at a few
  caps): attention reads every row of the context, so a long agent request's rounds and plain
  steps cost more, wider ones more so; ``Calibration.at_context`` prices a request's own length
  from the two, and ``--max-draft auto`` follows the sequence as it grows. The long cache is the
  short one's rows repeated (``caches.repeat_rows``): no long prefill to wait for.

Warm-ups, then medians over interleaved passes (a contended machine shifts all widths alike
instead of bending the curve). A burst that bends one anyway (a narrower forward costing more
than a wider one: a build or a test run beside it) gets the curve measured again, keeping each
width's cheaper median; a cached calibration is reused for good, so one burst must not price
every later round. The result is cached in ``<cache>/calibration.json`` keyed by
device, MLX version, backend, precision, target, drafter and schema version.

The cost model: ``engine/cost_model.py``; the live controller: ``engine/cap_controller.py``.
"""

from __future__ import annotations

import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx

from engine.cap_controller import CapController, LearnedState
from engine.cost_model import CONTEXT, STATIC_P, Calibration, best_cap, rate, static_cap
from engine.drafters.base import Drafter
from engine.errors import TandemError
from engine.paths import cache_root, read_json, write_json_atomic
from engine.protocols import EngineLike

SCHEMA = 7  # 4: verify curves of batched forwards (continuous batching); 5: costs at a long context;
# 6: batched forwards over the batch's slot buffers (engine/slot_kv.py); 7: batched drafts (propose_rows)
PASSES = 4  # timed passes over the width grid (plus one warm-up pass)
OVERHEAD_ROUNDS = 12  # rounds of each kind (speculative, plain) timed for the overhead
MAX_TOKENS_PER_SAMPLE = 16  # tokens decoded per round wanted, at most (lookup's rounds need a match)
CUT_THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
CUT_TOKENS = 48  # new tokens per shipped prompt in the confidence trace
WARM_PLAIN = 4  # plain steps opening each auto request: the plain step at this context, timed (the middle two)
BATCH_ROWS = (2, 4, 8)  # sequences per forward the batched verify curves are measured at
BATCH_MAX_WIDTH = 9  # ... over widths 1..9 (a batch's caps are small; wider ones scale like one row's)
REMEASURES = 2  # extra measurements of a curve a contention burst bent
BENT = 1.25  # a narrower forward costing this much more than a wider one: a burst, not the machine
AGREE = 0.10  # two measurements of a curve this close everywhere: what the machine does
LONG_CONTEXT = 8  # x the curves' context (4096 tokens): where the costs are measured again (Calibration.at_context)
LONG_WIDTHS = (1, 4, 8)  # ... at these verify widths (and the widest; slopes in between interpolate), the drafter at 3 caps
CONTEXT_TABLE = (512, 2048, 8192, 32768)  # contexts the report prices the default cap at

Progress = Callable[[int, int, str], None]  # (done, total, stage)


# Learned state per engine (weakly held) and (mode, drafter): the next request starts warm.
_LEARNED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

def auto_cap_policy(engine: EngineLike, mode: str, drafter: Drafter, seeded: bool = False,
                    cached_only: bool = False) -> CapController | None:
    """``--max-draft auto``: this pair's calibration (from the cache, or measured now) and the
    acceptance learned on earlier requests of this engine. ``seeded``: a fresh state that
    ignores live timings, so the same seeded request gives the same tokens every time. A
    calibration measured here reports to the engine's ``calibration_progress``; ``cached_only``:
    None where this machine has none (nothing is measured)."""
    cal = calibrate(engine, mode, drafter, progress=getattr(engine, "calibration_progress", None),
                    cached_only=cached_only)
    if cal is None:
        return None
    if seeded:
        return CapController(cal, drafter.max_draft, seeded=True)
    per_engine = _LEARNED.setdefault(engine, {})
    state = per_engine.get((mode, id(drafter)))
    if state is None:
        state = per_engine[(mode, id(drafter))] = LearnedState()
    else:
        state.shrink()
    return CapController(cal, drafter.max_draft, state=state, warm_plain=WARM_PLAIN)


def default_cap(engine: EngineLike, mode: str, drafter: Drafter) -> int | None:
    """The static cap from a cached calibration of this pair, or None when none is cached
    (measuring would stall a plain ``generate``; ``tandem calibrate`` fills the cache). The
    calibration's confidence cut applies too."""
    cal = load_cached(calibration_key(engine, mode, drafter))
    if cal is None:
        return None
    apply_cut(drafter, cal)
    return min(static_cap(cal), drafter.max_draft)


def _dspark(drafter: Drafter) -> Any:
    """The DSpark drafter inside ``drafter`` (itself, or behind lookup), else None."""
    inner = getattr(drafter, "model_drafter", drafter)
    return inner if hasattr(inner, "calibrated") and hasattr(inner, "trace") else None


def apply_cut(drafter: Drafter, cal: Calibration) -> None:
    """Give a DSpark drafter the confidence cut its calibration picked (the user's own
    ``--confidence-rule``/``--confidence-threshold`` still win: the drafter reads them first)."""
    inner = _dspark(drafter)
    if inner is not None and cal.confidence_rule is not None and cal.confidence_threshold is not None:
        inner.calibrated = (cal.confidence_rule, float(cal.confidence_threshold))


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


def shape_signature(model: Any, taps: Sequence[int] = ()) -> str:
    """Hash of parameter shapes and dtypes: costs depend on these, not on the values. ``taps``:
    layers wrapped by the target's tap proxies, hashed under their own names (a tap costs
    nothing, and the key must not change when a drafter installs one)."""
    import hashlib

    from mlx.utils import tree_flatten

    wrapped = tuple(f"layers.{i}.layer." for i in taps)
    h = hashlib.sha256()
    for path, value in tree_flatten(model.parameters()):
        for w in wrapped:
            path = path.replace(w, w[: -len("layer.")])
        h.update(f"{path}:{tuple(value.shape)}:{value.dtype};".encode())
    return h.hexdigest()[:10]


def _named(owner: Any, model: Any, taps: Sequence[int] = ()) -> tuple[str, str]:
    """``model``'s (precision, shape signature), kept on ``owner`` (its target or drafter): each
    walks every parameter, a few ms before every ``--max-draft auto`` request's first token, and
    a loaded model's parameters keep their shapes and dtypes."""
    memo = owner.__dict__.setdefault("_calibration_names", {})
    key = (id(model), tuple(taps))
    if key not in memo:
        memo[key] = (model_precision(model), shape_signature(model, taps))
    return memo[key]


def _target_id(engine: EngineLike) -> str:
    loaded = getattr(engine, "loaded", None)
    path = getattr(loaded, "path", None)
    base = Path(str(path)).name if path else engine.name
    return f"{base}#{_named(engine.target, engine.target.model, engine.target.tap_layers)[1]}"


def _drafter_id(engine: EngineLike, mode: str, drafter: Drafter) -> str:
    parts = [mode, drafter.name, f"max{drafter.max_draft}"]
    spec = engine.draft_model_spec if mode == "draft" else engine.drafter_path if mode in ("dspark", "dflash", "eagle3", "mtp") else None
    if spec:
        parts.append(Path(str(spec)).name)
    model = getattr(drafter, "model", None)
    if drafter.has_model and model is not None and hasattr(model, "parameters"):
        precision, signature = _named(drafter, model)
        parts += [signature, precision]
    return ":".join(parts)


KEY_FIELDS = ("schema", "device", "mlx", "backend", "precision", "target", "drafter", "context")


def _target_fields(engine: EngineLike) -> dict:
    """The key fields that name this machine and target (the first ones of ``KEY_FIELDS``)."""
    from engine import platform

    return {
        "schema": SCHEMA, "device": platform.device_name(), "mlx": mx.__version__,
        "backend": "+".join(filter(None, (platform.backend(), platform.skinny_label()))),  # cheaper narrow forwards
        "precision": _named(engine.target, engine.target.model, engine.target.tap_layers)[0],
        "target": _target_id(engine),
    }


def key_fields(engine: EngineLike, mode: str, drafter: Drafter, context: int = CONTEXT) -> dict:
    return {**_target_fields(engine), "drafter": _drafter_id(engine, mode, drafter), "context": context}


def cache_key(fields: dict) -> str:
    return "|".join(f"{name}={fields[name]}" for name in KEY_FIELDS)


def calibration_key(engine: EngineLike, mode: str, drafter: Drafter, context: int = CONTEXT) -> str:
    return cache_key(key_fields(engine, mode, drafter, context))


def cache_path() -> Path:
    return cache_root() / "calibration.json"


def _read_cache() -> dict:
    data = read_json(cache_path())
    return data if data.get("schema") == SCHEMA else {}


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


def target_calibrations(engine: EngineLike) -> list[Calibration]:
    """This machine's cached calibrations of ``engine``'s target, whatever the drafter (their
    target curves, batched ones included, are the target's)."""
    fields = _target_fields(engine)
    prefix = "|".join(f"{name}={fields[name]}" for name in KEY_FIELDS if name in fields) + "|"
    found = []
    for key, entry in _read_cache().get("entries", {}).items():
        if key.startswith(prefix) and isinstance(entry, dict):
            try:
                found.append(Calibration.from_dict(entry))
            except TypeError:
                continue
    return found


def save(cal: Calibration) -> Path:
    """Merge into the cache file, written atomically (temp file + rename)."""
    path = cache_path()
    data = _read_cache() or {"schema": SCHEMA, "entries": {}}
    data.setdefault("entries", {})[cal.key] = cal.to_dict()
    write_json_atomic(path, data)
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


def bent(ms: Sequence[float], tolerance: float = BENT) -> bool:
    """Whether a cost curve over growing widths (or draft caps) has a point ``tolerance`` x above
    a later one: on any backend more tokens cost at least as much, so part of the passes were
    slowed by something else."""
    cheapest_after = float("inf")
    for value in reversed(ms):
        if value > tolerance * cheapest_after:
            return True
        cheapest_after = min(cheapest_after, value)
    return False


def steady_curve(measure_once: Callable[[], list[float]], remeasures: int = REMEASURES,
                 on_remeasure: Callable[[], None] = lambda: None) -> list[float]:
    """``measure_once()`` again while its curve is bent (at most ``remeasures`` more times),
    keeping each point's cheapest median: contention only adds time. A measurement that repeats
    the last one within ``AGREE`` everywhere ends it: the bend is the machine's own (a kernel
    switch between widths), not a burst."""
    curve = measure_once()
    for _ in range(remeasures):
        if not bent(curve):
            break
        on_remeasure()
        again = measure_once()
        repeats = all(abs(a - b) <= AGREE * min(a, b) for a, b in zip(curve, again))
        curve = [min(a, b) for a, b in zip(curve, again)]
        if repeats:
            break
    return curve


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


def measure_batch_verify(target: Any, cache: list, rows: int, ids: Sequence[int], widths: Sequence[int], passes: int,
                         tick: Callable[[], None] = lambda: None) -> list[float]:
    """``measure_verify`` for a forward over ``rows`` sequences at once, each on a copy of
    ``cache`` (snapshots), their full-attention layers in one buffer per layer as the batch loop
    keeps them (engine/slot_kv.py)."""
    from engine import caches
    from engine.slot_kv import Slots

    snap = caches.snapshot(cache)
    row_caches, slots = [], Slots()
    for _ in range(rows):
        c = target.new_cache()
        caches.restore(c, snap)
        slots.join(c)
        row_caches.append(c)
    batches = [mx.array([list(ids[:w])] * rows, dtype=mx.uint32) for w in widths]

    def one(i: int) -> float:
        t0 = time.perf_counter()
        logits, _, txns = target.verify_rows(batches[i], row_caches)
        mx.eval(logits)
        dt = time.perf_counter() - t0
        for txn in txns:
            txn.commit(1 if widths[i] == 1 else 0)
        return dt

    return _median_passes(len(widths), passes, one, tick)


def long_points(widths: Sequence[int], caps: Sequence[int]) -> tuple[list[int], list[int]]:
    """The verify widths (of those measured: ``LONG_WIDTHS`` and the widest) and drafter caps (the
    first, middle and last) measured again at the long context."""
    long_widths = [w for w in widths if w in LONG_WIDTHS or w == widths[-1]]
    long_caps = sorted({caps[0], caps[len(caps) // 2], caps[-1]}) if caps else []
    return long_widths, long_caps


def repeat_hidden(hidden: mx.array | None, rows: int) -> mx.array | None:
    """A tapped hidden-state block (rows first) repeated to ``rows`` rows, as ``caches.repeat_rows``
    lengthens the target's caches: the drafter's context as long as the target's."""
    if hidden is None:
        return None
    copies = -(-rows // hidden.shape[0])
    return mx.concatenate([hidden] * copies, axis=0)[:rows]


def _evaluate(drafts: Sequence[Any]) -> None:
    """Wait for proposals (``Draft`` or None): their tokens and q."""
    mx.eval([a for d in drafts if d is not None for a in (d.tokens, d.probs) if a is not None])


def measure_drafter(drafter: Drafter, ids: Sequence[int], caps: Sequence[int], passes: int,
                    tick: Callable[[], None] = lambda: None) -> list[float]:
    from engine.sampling import Sampler, SamplingParams

    sampler = Sampler(SamplingParams(seed=0))

    def one(i: int) -> float:
        t0 = time.perf_counter()
        _evaluate([drafter.propose(ids, caps[i], sampler)])
        return time.perf_counter() - t0

    return _median_passes(len(caps), passes, one, tick)


def measure_batch_drafts(drafter: Drafter, ids: Sequence[int], hidden: mx.array | None, cap: int, passes: int,
                         tick: Callable[[], None] = lambda: None) -> dict[str, float]:
    """What B rows' drafts at ``cap`` cost proposed together (``propose_rows``), as a multiple of
    one row's, for each B in BATCH_ROWS: "B" -> ratio. Each row is a fork of ``drafter`` begun
    on ``ids`` (its prompt fed before timing); one row and each B are timed in turns, so a change
    of the machine's pace moves them alike. Empty for a drafter that proposes row by row."""
    from engine.sampling import Sampler, SamplingParams

    together = getattr(type(drafter), "propose_rows", None)
    if together is None:
        return {}
    anchor = list(ids) + [ids[-64]]
    rows = []
    for _ in range(max(BATCH_ROWS)):
        fork = drafter.fork()
        fork.begin(ids, hidden)
        fork.catch_up(anchor)
        rows.append(fork)
    sizes = (1,) + BATCH_ROWS
    sampler = Sampler(SamplingParams(seed=0))

    def one(i: int) -> float:
        t0 = time.perf_counter()
        _evaluate(together([(fork, anchor, cap, sampler) for fork in rows[: sizes[i]]]))
        return time.perf_counter() - t0

    ms = _median_passes(len(sizes), passes, one, tick)
    return {str(b): t / max(ms[0], 1e-9) for b, t in zip(BATCH_ROWS, ms[1:])}


def measure_rounds(target: Any, drafter: Drafter, ids: Sequence[int], cap: int, rounds: int = OVERHEAD_ROUNDS,
                   tick: Callable[[], None] = lambda: None, passes: int = 2,
                   plain_ids: Sequence[int] | None = None) -> tuple[float, float]:
    """(speculative round overhead ms, plain step ms) from the real verify loop, run as it runs:
    rounds at a fixed ``cap`` after ``ids``, and a run of pipelined plain steps (a parked
    controller's) after ``plain_ids`` (default ``ids``): a step's cost grows with the context
    (attention; on a CPU 10-40 % from 200 to 512 tokens), so the plain step is timed at the
    verify curve's context, which it is compared with.

    A round's overhead is its wall time (emit to emit) minus the part the curves stand for,
    taken from the same round's own timings (``verify_s``, and ``draft_s`` for a drafter with a
    model): subtracting a curve measured seconds earlier would drown the few-ms overhead in a
    shared machine's noise. What remains is the loop's bookkeeping and, for lookup, its Python
    n-gram search. Kinds alternate ``passes`` times, so contention hits both alike. Only rounds
    count as rounds: where lookup has no match the loop takes plain steps, which are skipped
    (at most ``MAX_TOKENS_PER_SAMPLE`` tokens are decoded per sample wanted; no round met: no
    overhead)."""
    from engine.sampling import Sampler, SamplingParams
    from engine.speculative import FixedCap, decode

    spec: list[float] = []
    plain: list[float] = []
    for _ in range(passes):
        for policy, out, prompt in ((FixedCap(cap), spec, ids), (FixedCap(0), plain, plain_ids or ids)):
            t_prev, paused, got = None, 0.0, 0
            steps = decode(target, drafter, prompt, Sampler(SamplingParams(seed=0)),
                           max_new_tokens=MAX_TOKENS_PER_SAMPLE * rounds, cap_policy=policy, mode="calibration")
            try:
                for _, event in steps:
                    # past the pipeline's fill; a round when rounds are timed (not a step lookup had nothing for)
                    sampled = t_prev is not None and event.index >= 3 and (event.cap > 0) == (policy.value > 0)
                    if sampled:
                        model_s = event.verify_s + (event.draft_s if drafter.has_model else 0.0)
                        out.append((event.t - t_prev - paused - model_s) * 1000.0)
                        got += 1
                    t_prev, paused = event.t, 0.0
                    if sampled:
                        t_tick = time.perf_counter()
                        tick()  # a progress bar's redraw is not the loop's cost
                        paused = time.perf_counter() - t_tick
                    if got >= rounds:
                        break
            finally:
                steps.close()
    return max(0.0, statistics.median(spec)) if spec else 0.0, max(1e-3, statistics.median(plain))


def confidence_trace(engine: EngineLike, drafter: Drafter, texts: Sequence[str], max_new_tokens: int = CUT_TOKENS,
                     tick: Callable[[], None] = lambda: None) -> list[tuple[list[float], int]]:
    """(per-slot confidence scores, drafts the target accepted) for every full-block round of
    greedy DSpark decoding (no cut) on ``texts``. Greedy: a cut never changes which drafts
    are accepted before it, so any cut's rounds can be replayed from this one trace."""
    from engine.sampling import Sampler, SamplingParams
    from engine.speculative import DecodeStats, FixedCap, decode

    inner = _dspark(drafter)
    out: list[tuple[list[float], int]] = []
    tok = engine.tokenizer
    for text in texts:
        ids = engine.encode(text)
        inner.trace, stats = [], DecodeStats()
        try:
            for _ in decode(engine.target, inner, ids, Sampler(SamplingParams()), max_new_tokens=max_new_tokens,
                            cap_policy=FixedCap(inner.max_draft), stats=stats,
                            eos_ids=list(getattr(tok, "eos_token_ids", None) or [])):
                pass
            drafted = [(d, a) for d, a in stats.rounds[1:] if d > 0]
            out += [(conf, a) for conf, (d, a) in zip(inner.trace, drafted) if d == inner.max_draft == len(conf)]
        finally:
            inner.trace = None
        tick()
    return out


def tune_cut(cal: Calibration, trace: Sequence[tuple[list[float], int]], default: tuple[str, float | None],
             tolerance: float = 0.01) -> tuple[str, float, dict]:
    """The (rule, threshold) whose replay of ``trace`` earns the most tokens per second on
    these curves (a round costs the full block's draft, the verify of what it keeps and the
    overhead; a cut to nothing still pays the draft), and every option's rate. The drafter's
    own cut is kept unless another beats it by ``tolerance``. Threshold 0: no cut."""
    from engine.drafters.dspark import RULES, keep_count

    block = len(trace[0][0])

    def rate(rule: str, threshold: float) -> float:
        tokens = ms = 0.0
        for conf, accepted in trace:
            keep = keep_count(conf, threshold, rule) if threshold > 0 else block
            tokens += 1 + min(keep, accepted)
            ms += cal.draft(block) + cal.verify(keep + 1) + cal.overhead_ms
        return 1000.0 * tokens / ms

    table = {f"{rule}@{t:g}": rate(rule, t) for rule in RULES for t in CUT_THRESHOLDS}
    table["none"] = rate("slot", 0.0)
    best = max(table, key=table.get)
    rule, threshold = default[0], default[1] or 0.0
    own = rate(rule, threshold)
    if table[best] > own * (1 + tolerance):
        rule, threshold = ("slot", 0.0) if best == "none" else (best.split("@")[0], float(best.split("@")[1]))
    return rule, threshold, {k: round(v, 2) for k, v in table.items()}


def calibrate(engine: EngineLike, mode: str = "lookup", drafter: Drafter | None = None, *, recalibrate: bool = False,
              progress: Progress | None = None, passes: int = PASSES, context: int = CONTEXT,
              overhead_rounds: int = OVERHEAD_ROUNDS, long_context: int | None = None,
              cached_only: bool = False) -> Calibration | None:
    """This pair's calibration: from the cache unless ``recalibrate``, else measured (seconds)
    and cached; ``cached_only``: None instead of measuring. ``progress(done, total, stage)``
    reports the measurement. ``long_context``: the context the costs are measured at again
    (default ``LONG_CONTEXT`` x ``context``; 0: not)."""
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
            apply_cut(drafter, cached)
            return cached
    if cached_only:
        return None
    cal = measure(engine, drafter, fields, progress=progress, passes=passes, context=context,
                  overhead_rounds=overhead_rounds, long_context=long_context)
    save(cal)
    apply_cut(drafter, cal)
    return cal


def measure(engine: EngineLike, drafter: Drafter, fields: dict, *, progress: Progress | None = None,
            passes: int = PASSES, context: int = CONTEXT, overhead_rounds: int = OVERHEAD_ROUNDS,
            long_context: int | None = None) -> Calibration:
    from engine import caches
    from engine.roofline import measure_bandwidth

    target = engine.target
    t_start = time.perf_counter()
    long_context = LONG_CONTEXT * context if long_context is None else long_context
    forwards = target.forwards
    shapes = target.shapes
    if shapes is not None:  # the loop pads every verify to the ladder: measure those widths only
        widths = shapes.ladder(drafter.max_draft + 1)
    else:
        widths = width_grid(drafter.max_draft + 1, dense_to=33 if drafter.has_model else 9)
    caps = width_grid(drafter.max_draft, dense_to=33) if drafter.has_model else []
    inner = _dspark(drafter)
    tune = inner is not None and inner.cfg.confidence_head
    texts: list[str] = []
    if tune:
        from engine.prompts import calibration_texts

        try:
            texts = calibration_texts()
        except TandemError:
            tune = False  # no prompts to trace: keep the drafter's own cut
    n_batch = (len(BATCH_ROWS) * sum(w <= BATCH_MAX_WIDTH for w in widths) + (1 + len(BATCH_ROWS)) * bool(caps)
               if target.batch_blocker() is None else 0)
    # the drafter again at the long context where it reads the target's hidden states (repeated
    # like the cache); a draft model would need a long prefill of its own: its curve stays as measured
    long_widths, long_caps = long_points(widths, caps if drafter.tap_layers else []) if long_context > context \
        else ([], [])
    total = (1 + (passes + 1) * (len(widths) + len(caps) + n_batch + len(long_widths) + len(long_caps))
             + 4 * overhead_rounds + len(texts) + 1)
    done = 0

    def tick(stage: str) -> Callable[[], None]:
        def _tick() -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(min(done, total), total, stage)
        return _tick

    def more(n_items: int) -> Callable[[], None]:
        def grow() -> None:  # a curve measured again: its passes join the progress bar
            nonlocal total
            total += (passes + 1) * n_items
        return grow

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
        verify_ms = steady_curve(lambda: measure_verify(target, cache, probe, widths, passes, tick("verify curve")),
                                 on_remeasure=more(len(widths)))
        draft_ms: list[float] = []
        if caps:
            # the loop's state after prefill: the target holds the prompt, the anchor is one more token.
            # A lookup-first combination is priced by its model drafter: lookup's rounds cost ~0, and
            # on this repetitive synthetic context lookup would draft every round.
            costly = getattr(drafter, "model_drafter", drafter)
            costly.begin(ids, hidden)
            draft_ms = steady_curve(lambda: measure_drafter(costly, ids + [ids[-64]], caps, passes, tick("drafter curve")),
                                    on_remeasure=more(len(caps)))
        batch_widths = [w for w in widths if w <= BATCH_MAX_WIDTH]
        batch_ms, batch_drafting = {}, {}
        if target.batch_blocker() is None:
            if caps:
                batch_drafting = measure_batch_drafts(costly, ids, hidden, min(caps[-1], BATCH_MAX_WIDTH - 1), passes,
                                                      tick("drafts of several sequences"))
            for rows in BATCH_ROWS:
                batch_ms[str(rows)] = steady_curve(
                    lambda rows=rows: measure_batch_verify(target, cache, rows, probe, batch_widths, passes,
                                                           tick(f"verify curve, {rows} sequences")),
                    on_remeasure=more(len(batch_widths)))
        long_verify_ms: list[float] = []
        long_draft_ms: list[float] = []
        if long_widths:  # last: the cache is lengthened in place
            caches.repeat_rows(cache, long_context)
            long_ids = synthetic_prompt(target.vocab_size, long_context)
            probe = long_ids[-64:] + long_ids[: max(0, max(long_widths) - 64)]
            long_verify_ms = steady_curve(
                lambda: measure_verify(target, cache, probe, long_widths, passes, tick("verify curve, long context")),
                on_remeasure=more(len(long_widths)))
            if long_caps:
                costly = getattr(drafter, "model_drafter", drafter)
                costly.begin(long_ids, repeat_hidden(hidden, long_context))
                long_draft_ms = steady_curve(
                    lambda: measure_drafter(costly, long_ids + [long_ids[-64]], long_caps, passes,
                                            tick("drafter curve, long context")),
                    on_remeasure=more(len(long_caps)))
        del cache, hidden
        cal = Calibration(cache_key(fields), fields, widths, verify_ms, caps, draft_ms,
                          pad_widths=list(shapes.widths) if shapes is not None else [],
                          batch_verify_ms=batch_ms, batch_widths=batch_widths if batch_ms else [],
                          batch_draft_scale=batch_drafting, context=context,
                          long_context=long_context if long_widths else 0, long_widths=long_widths,
                          long_verify_ms=long_verify_ms, long_caps=long_caps if long_draft_ms else [],
                          long_draft_ms=long_draft_ms)
        # The loop's own work is the same at any context: a 128-token prompt keeps the rounds'
        # prefills short (and skips a one-off slow first run seen on fresh 512-row caches); the
        # plain steps run at the curve's context, as verify(w) was measured.
        cal.overhead_ms, cal.plain_ms = measure_rounds(target, drafter, ids[:128], min(drafter.max_draft, 8),
                                                       overhead_rounds, tick("rounds and plain steps"), plain_ids=ids)
        cal.step_overhead_ms = cal.plain_ms - cal.verify(1)
        if tune:
            trace = confidence_trace(engine, drafter, texts, tick=tick("confidence trace"))
            if trace:
                default = (inner.default_rule, inner.default_threshold)
                cal.confidence_rule, cal.confidence_threshold, cal.confidence_table = tune_cut(cal, trace, default)
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
             f"context {cal.context} tokens | overhead {cal.overhead_ms:.2f} ms/round, plain step (pipelined) "
             f"{cal.plain_step_ms():.2f} ms | copy bandwidth {cal.bandwidth / 1e9:.2f} GB/s"
             + (f" | verify widths padded to {cal.pad_widths}" if cal.pad_widths else ""), "",
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
    if cal.long_context:
        lines.append(f"at {cal.long_context} tokens of context: verify " + ", ".join(
            f"w{w} {ms:.2f}" for w, ms in zip(cal.long_widths, cal.long_verify_ms)) + " ms" + "".join(
            f" | draft c{c} {ms:.2f}" for c, ms in zip(cal.long_caps, cal.long_draft_ms)))
        best = []
        for n in CONTEXT_TABLE:
            at = cal.at_context(n)
            cap = best_cap(at, STATIC_P)
            best.append(f"{n}: " + (f"cap {cap}, {rate(at, cap, STATIC_P) / rate(at, 0, STATIC_P):.2f}x" if cap
                                    else "plain steps"))
        lines.append(f"best cap by context (p={STATIC_P}, predicted speed-up): " + "; ".join(best))
    if cal.confidence_rule is not None:
        top = sorted(cal.confidence_table.items(), key=lambda kv: -kv[1])[:4]
        lines.append(f"DSpark confidence cut: {cal.confidence_rule} rule at {cal.confidence_threshold:g} "
                     f"(predicted tok/s: " + ", ".join(f"{k} {v:.1f}" for k, v in top) + ")")
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
        bar.total = total  # a curve measured again adds its passes to the total
        bar.set_postfix_str(stage, refresh=False)
        bar.update(done - bar.n)

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close
