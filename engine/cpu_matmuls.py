"""Which matmuls a model's forwards run on the CPU backend: Tandem's skinny loops or OpenBLAS's gemm.

``engine.skinny_gemm`` sends products of 1-14 rows (a plain step, a verify) past OpenBLAS's gemm,
which on some builds packs the weights before multiplying: OpenBLAS 0.3.21's Haswell/Zen kernels on
an AMD EPYC, where the loops made the starter's plain step twice as fast. On an Intel Xeon with
AVX-512, whose OpenBLAS SkylakeX kernels have a small-matrix path of their own, gemm won (the
starter's pipelined plain step 69.2 ms against the loops' 83.5) until the loops' prefetch hint was
fixed and attention's small products kept off OpenBLAS's threads; now the loops win there too (34.5
against 65.3 ms, a verify of 8 rows 56.3 against 98.1). A CPU or BLAS build not measured may still
favour gemm, so the first load of a model on a machine times both on the model's own forwards (the
verify loop's own pipelined plain steps, and a verify of 8 rows; interleaved) and keeps the faster.
The loops stay unless gemm wins by ``MARGIN``: their rows are bit-identical across verify widths,
which spares the loop near-tie flips. The choice is cached in ``<cache>/cpu-matmuls.json``, keyed
on the CPU, the OpenBLAS build and its threads, the loops' source and the model's shapes and
precision: later loads only read it. Models under ``MIN_BYTES`` of weights keep the loops untimed
(their forwards are too short to tell apart). ``TANDEM_CPU_MATMULS=loops|gemm`` skips the timing
and forces one (the test suite pins the loops).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from engine import platform
from engine.calibrate import measure_verify, model_precision, shape_signature, synthetic_prompt
from engine.errors import TandemError
from engine.paths import cache_root, read_json, write_json_atomic
from engine.sampling import Sampler, SamplingParams
from engine.speculative import DecodeStats, FixedCap, decode

CACHE_FILE = "cpu-matmuls.json"
MIN_BYTES = 32 << 20  # weights below this keep the loops, untimed
WIDTHS = (1, 8)  # a plain step and a DSpark round's verify at cap 7
PASSES = 3  # verifies timed per measurement (after one untimed)
STEPS = 6  # pipelined plain steps timed per measurement
PIPELINE_FILL = 3  # the loop's first steps (prefill's token, the pipeline's fill): not timed
CONTEXT = 128  # tokens in the cache the forwards are timed on
MARGIN = 1.03  # gemm replaces the loops only when their summed medians are this much higher
FORCE_ENV = "TANDEM_CPU_MATMULS"

Measure = Callable[[bool], Sequence[float]]  # skinny on? -> ms of each of WIDTHS
Progress = Callable[[int, int, str], None]  # (done, total, stage)


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


def choice_key(target: Any) -> str:
    """The CPU, the OpenBLAS build, the loops' source and the model's shapes and precision (as a
    calibration names them)."""
    model = target.model
    return "|".join((platform.device_name(), platform.blas_build(), _kernel_tag(),
                     shape_signature(model, target.tap_layers), model_precision(model)))


def _kernel_tag() -> str:
    """The loops' source in a choice's key (a changed kernel is timed again)."""
    from engine.skinny_gemm import source_id

    return f"skinny-{source_id()}"


def timed_forwards(target: Any, passes: int = PASSES, steps: int = STEPS) -> Measure:
    """Ms of a plain step (the loop's own: ``steps`` pipelined plain steps of ``decode`` at cap 0,
    after the pipeline's fill, median) and the median ms of a verify of 8 rows on the caches that
    run left (synchronous, as the loop runs it, rolled back), with the loops on or off."""
    prompt = synthetic_prompt(target.vocab_size, CONTEXT)
    greedy = Sampler(SamplingParams())

    def measure(skinny: bool) -> list[float]:
        platform.skinny_matmuls(skinny)
        stats, gaps, t_prev = DecodeStats(), [], None
        for _, event in decode(target, None, prompt, greedy, max_new_tokens=steps + PIPELINE_FILL,
                               cap_policy=FixedCap(0), stats=stats, mode="calibration"):
            if t_prev is not None and event.index >= PIPELINE_FILL:
                gaps.append(event.t - t_prev)
            t_prev = event.t
        verify = measure_verify(target, stats.cache, prompt, WIDTHS[1:], passes)
        return [statistics.median(gaps) * 1000.0, *verify]

    return measure


def choose(target: Any, *, measure: Measure | None = None, rounds: int = 2,
           progress: Progress | None = None) -> Choice | None:
    """Switch the skinny loops on or off for ``target``'s forwards on this machine: from the cache,
    else timed now (``rounds`` interleaved rounds of each, the cheapest median of each width kept:
    contention only adds time; ``progress`` hears of each measurement, only when timing). None
    where there is nothing to choose (another backend, no loops installed, a small model)."""
    if platform.backend() != "cpu" or not platform.skinny_installed():
        return None
    if forced := forced_choice():
        platform.skinny_matmuls(forced == "loops")
        return None
    if sum(v.nbytes for _, v in tree_flatten(target.model.parameters()) if isinstance(v, mx.array)) < MIN_BYTES:
        return None
    key = choice_key(target)
    stored = _read().get(key)
    if isinstance(stored, dict):
        try:
            choice = Choice(**{**stored, "cached": True})
        except TypeError:
            pass  # an older record: measured again
        else:
            platform.skinny_matmuls(choice.skinny)
            return choice
    measure = measure or timed_forwards(target)
    best: dict[bool, list[float]] = {}
    for done in range(2 * rounds):
        skinny = done % 2 == 0
        if progress is not None:
            progress(done, 2 * rounds, pick_name(skinny))
        ms = list(measure(skinny))
        best[skinny] = [min(a, b) for a, b in zip(best[skinny], ms)] if skinny in best else ms
    if progress is not None:
        progress(2 * rounds, 2 * rounds, "done")
    keep_loops = sum(best[False]) * MARGIN >= sum(best[True])
    choice = Choice(keep_loops, best[True], best[False], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
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
    return cache_root() / CACHE_FILE


def _read() -> dict:
    return read_json(_path())  # missing or damaged: measured again, never fatal


def _write(key: str, choice: Choice) -> None:
    current = f"|{_kernel_tag()}|"
    data = {k: v for k, v in _read().items() if current in k}  # an older kernel's records are never read again
    record = asdict(choice)
    record.pop("cached")
    data[key] = record
    try:
        write_json_atomic(_path(), data)
    except OSError:
        pass  # a read-only cache: the choice holds for this process and is measured again next time
