"""Which matmuls a model's forwards run on the CPU backend: Tandem's skinny loops or OpenBLAS's gemm.

``engine.skinny_gemm`` sends products of 1-14 rows (a plain step, a verify) past OpenBLAS's
gemm, which on some builds packs the weights before multiplying: OpenBLAS 0.3.21's Haswell/Zen
kernels on an AMD EPYC, where the loops made the starter's plain step twice as fast. Where
OpenBLAS has a small-matrix path of its own (its SkylakeX kernels on an Intel Xeon with AVX-512)
gemm is the faster one: there the starter's plain step took 60.5 ms against the loops' 75.4
(pipelined), a verify of 8 rows 94.6 against 104.5. Neither wins everywhere, so the first load
of a model on a machine times both on the model's own forwards (plain steps pipelined as the
loop runs them, and a verify of 8 rows; interleaved) and keeps the faster. The loops stay unless
gemm wins by ``MARGIN``: their rows are bit-identical across verify widths, which spares the loop
near-tie flips. The choice is cached in ``<cache>/cpu-matmuls.json``, keyed on the CPU, the
OpenBLAS build and its threads, the loops' source and the model's shapes and precision: later
loads only read it. Models under ``MIN_BYTES`` of weights keep the loops untimed (their forwards
are too short to tell apart). ``TANDEM_CPU_MATMULS=loops|gemm`` skips the timing and forces one
(the test suite pins the loops).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from engine import platform
from engine.calibrate import measure_verify, synthetic_prompt
from engine.errors import TandemError

CACHE_FILE = "cpu-matmuls.json"
MIN_BYTES = 32 << 20  # weights below this keep the loops, untimed
WIDTHS = (1, 8)  # a plain step and a DSpark round's verify at cap 7
PASSES = 3  # verifies timed per measurement (after one untimed)
STEPS = 6  # pipelined plain steps timed per measurement
CONTEXT = 128  # tokens in the cache the forwards are timed on
MARGIN = 1.03  # gemm replaces the loops only when their summed medians are this much higher
FORCE_ENV = "TANDEM_CPU_MATMULS"

Measure = Callable[[bool], Sequence[float]]  # skinny on? -> ms of each of WIDTHS


@dataclass
class Choice:
    skinny: bool  # the loops on (True) or OpenBLAS's gemm for every product (False)
    skinny_ms: list[float]  # median ms of each of WIDTHS with the loops
    gemm_ms: list[float]  # ... with OpenBLAS's gemm
    measured: str  # when (UTC)
    cached: bool = False  # read from the cache at this load

    def describe(self) -> str:
        pick = pick_name(self.skinny)
        ms = ", ".join(f"{w} row{'s' if w > 1 else ''} {a:.1f} vs {b:.1f} ms"
                       for w, a, b in zip(WIDTHS, self.skinny_ms, self.gemm_ms))
        return f"{pick} for 1-14-row products (loops vs gemm: {ms}; measured {self.measured})"


def pick_name(skinny: bool) -> str:
    return "Tandem's skinny loops" if skinny else "OpenBLAS's gemm"


def model_signature(model: Any) -> str:
    """Parameter count, bytes and dtypes: what the forwards' matmuls depend on."""
    params = [v for _, v in tree_flatten(model.parameters()) if isinstance(v, mx.array)]
    dtypes = sorted({str(v.dtype).removeprefix("mlx.core.") for v in params})
    return f"{sum(v.size for v in params)}p:{sum(v.nbytes for v in params)}B:{'+'.join(dtypes)}"


def choice_key(model: Any) -> str:
    from engine.skinny_gemm import source_id

    return "|".join((platform.device_name(), platform.blas_build(), f"skinny-{source_id()}", model_signature(model)))


def pipelined_steps_ms(target: Any, cache: list, logits: mx.array, steps: int = STEPS) -> float:
    """Mean ms of ``steps`` greedy plain steps run as the loop runs them: each forward
    queued before the token before it is read back (the threads of a product then share the
    cores with the next step's graph building, which a synchronous step never shows)."""
    def queue(token: mx.array) -> mx.array:
        out, _ = target.forward(token.reshape(1, 1).astype(mx.uint32), cache, last_only=True)
        nxt = mx.argmax(out[-1])
        mx.async_eval(nxt)
        return nxt

    token = queue(mx.argmax(logits))
    start = 0.0
    for i in range(steps + 1):  # the first read fills the pipeline: timed from there
        following = queue(token)
        token.item()
        if i == 0:
            start = time.perf_counter()
        token = following
    token.item()
    return (time.perf_counter() - start) * 1000.0 / (steps + 1)


def timed_forwards(target: Any, passes: int = PASSES, steps: int = STEPS) -> Measure:
    """Ms of a plain step (pipelined, ``steps`` of them on a fresh cache) and the median ms of a
    verify of 8 rows (synchronous, as the loop runs it, rolled back), with the loops on or off."""
    prompt = synthetic_prompt(target.vocab_size, CONTEXT)

    def measure(skinny: bool) -> list[float]:
        platform.skinny_matmuls(skinny)
        cache = target.new_cache()
        logits, _ = target.prefill(prompt, cache)
        step = pipelined_steps_ms(target, cache, logits, steps)
        return [step, *measure_verify(target, cache, prompt, WIDTHS[1:], passes)]

    return measure


def choose(target: Any, *, measure: Measure | None = None, rounds: int = 2) -> Choice | None:
    """Switch the skinny loops on or off for ``target``'s forwards on this machine: from the cache,
    else timed now (``rounds`` interleaved rounds of each, the cheapest median of each width kept:
    contention only adds time). None where there is nothing to choose (another backend, no loops
    installed, a small model)."""
    if platform.backend() != "cpu" or not platform.skinny_installed():
        return None
    if forced := forced_choice():
        platform.skinny_matmuls(forced == "loops")
        return None
    if sum(v.nbytes for _, v in tree_flatten(target.model.parameters()) if isinstance(v, mx.array)) < MIN_BYTES:
        return None
    key = choice_key(target.model)
    stored = _read().get(key)
    if isinstance(stored, dict):
        try:
            choice = Choice(**{**stored, "cached": True})
        except TypeError:
            choice = None  # an older record: measured again
        if choice is not None:
            platform.skinny_matmuls(choice.skinny)
            return choice
    measure = measure or timed_forwards(target)
    best: dict[bool, list[float]] = {}
    for _ in range(rounds):
        for skinny in (True, False):
            ms = list(measure(skinny))
            best[skinny] = [min(a, b) for a, b in zip(best[skinny], ms)] if skinny in best else ms
    keep_loops = sum(best[False]) * MARGIN >= sum(best[True])
    choice = Choice(keep_loops, [round(x, 2) for x in best[True]], [round(x, 2) for x in best[False]],
                    time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    platform.skinny_matmuls(choice.skinny)
    _write(key, choice)
    return choice


def forced_choice() -> str:
    """``TANDEM_CPU_MATMULS``: 'loops' or 'gemm', '' when unset (timed per machine and model)."""
    value = os.environ.get(FORCE_ENV, "").strip().lower()
    if value not in ("", "loops", "gemm"):
        raise TandemError(f"{FORCE_ENV}={value!r}: use 'loops' (Tandem's skinny matmuls), 'gemm' (OpenBLAS's) "
                          "or leave it unset (timed once per machine and model)")
    return value


def _path():
    from engine.paths import cache_root

    return cache_root() / CACHE_FILE


def _read() -> dict:
    try:
        data = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}  # missing or damaged: measured again, never fatal
    return data if isinstance(data, dict) else {}


def _write(key: str, choice: Choice) -> None:
    data = _read()
    record = asdict(choice)
    record.pop("cached")
    data[key] = record
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: the choice holds for this process and is measured again next time
