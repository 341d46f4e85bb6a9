"""Where a batch of short requests spends the time that is not plain steps: per arm, each
request's plan (``Engine.plan``), its prefill chunks (the forward, the first token, the drafter's
``begin``), and every tick of the batch, for four requests at once. Written for the H100 trace
where dspark@auto ran chat at 0.93x the batched baseline while its rows' plain steps took the
baseline's time (h100-auto-trace-dspark-s11.json): the difference is before and between them.

    python3 tests/device/first_ticks.py [--gguf STARTER.gguf] [--dtype bfloat16] [--classes chat]
        [--arms baseline,lookup@auto,dspark@auto] [--trials 3] [--profile 25] [--json OUT.json]

An arm ``MODE@plain`` never drafts (every round a plain step) but keeps its drafter: ``dspark@plain``
against ``baseline`` is a tapped plain tick against an untapped one. ``--profile N`` prints each
arm's N functions of most host time, and Tandem's N of most cumulative time (cProfile, its
last trial).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import engine.batching as batching
from engine import batch
from engine.api import load
from engine.benchmark import Arm, arm_order
from engine.concurrent_bench import run_batched
from engine.drafters.base import Drafter
from engine.generate import Engine
from engine.prompts import CLASSES, load_prompts, load_spec_bench


def timed(owner: type, name: str, log: list) -> None:
    """Wrap ``owner.name`` so each call appends its wall ms to ``log``."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            log.append(1000 * (time.perf_counter() - t0))

    setattr(owner, name, wrapper)


def parse_arm(text: str) -> Arm:
    mode, _, cap = text.partition("@")
    return Arm(mode, None if not cap else cap if cap in ("auto", "plain") else int(cap))


@contextlib.contextmanager
def arm_setup(arm: Arm):
    """``MODE@plain``: the arm's rows propose no round (plain steps only); its drafter still runs."""
    if arm.cap != "plain":
        yield arm
        return
    real = batch.BatchLoop._propose
    batch.BatchLoop._propose = lambda self, row: 0
    try:
        yield Arm(arm.mode, "auto")
    finally:
        batch.BatchLoop._propose = real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--classes", default="chat")
    ap.add_argument("--arms", default="baseline,lookup@auto,dspark@auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    eng = load(args.gguf, dtype=args.dtype)
    eng.suffix_index = None
    arms = [parse_arm(a) for a in args.arms.split(",")]
    print(f"batch warm-up: {batching.warm_up(eng, sorted({a.mode for a in arms}), 4):.1f} s", flush=True)
    logs: dict[str, list] = {k: [] for k in ("plan", "prefill_chunk", "begin", "tick")}
    timed(Engine, "plan", logs["plan"])
    timed(batch.BatchLoop, "_prefill_chunk", logs["prefill_chunk"])
    timed(batch.BatchLoop, "step", logs["tick"])
    for cls in type(eng.drafter("dspark")).__mro__ if "dspark" in args.arms else ():
        if "begin" in vars(cls) and issubclass(cls, Drafter):
            timed(cls, "begin", logs["begin"])
    out: dict = {}
    for cls in args.classes.split(","):
        prompts = load_prompts([cls], 4) if cls in CLASSES else load_spec_bench([cls], 4)
        group = [eng.encode(p) for _, p in prompts]
        for arm in arms:
            with arm_setup(arm) as run_arm:
                run_batched(eng, group, run_arm, 8, 0.0, 4)  # calibration, first shapes
        rows = {arm.name: [] for arm in arms}
        profiles: dict[str, str] = {}
        for trial in range(args.trials):
            for i in arm_order(len(arms), trial, 0, 1):
                arm = arms[i]
                for log in logs.values():
                    log.clear()
                profiler = cProfile.Profile() if args.profile and trial == args.trials - 1 else None
                with arm_setup(arm) as run_arm:
                    if profiler:
                        profiler.enable()
                    summary, _ = run_batched(eng, group, run_arm, args.max_new_tokens, 0.0, 4)
                    if profiler:
                        profiler.disable()
                        text = io.StringIO()
                        stats = pstats.Stats(profiler, stream=text)
                        stats.sort_stats("tottime").print_stats(args.profile)
                        stats.sort_stats("cumulative").print_stats("/engine/", args.profile)  # Tandem's own calls
                        profiles[arm.name] = text.getvalue()
                ticks = list(logs["tick"])
                rows[arm.name].append({
                    "tok_s": round(summary["tok_s"], 1), "wall_ms": round(summary["wall_s"] * 1000, 1),
                    "plan_ms": round(sum(logs["plan"]), 2), "prefill_chunk_ms": round(sum(logs["prefill_chunk"]), 2),
                    "begin_ms": round(sum(logs["begin"]), 2), "ticks": len(ticks),
                    "tick_median_ms": round(statistics.median(ticks), 2), "ticks_ms_sum": round(sum(ticks), 1),
                    "first_ticks_ms": [round(t, 1) for t in ticks[:12]],
                    "slow_ticks_ms": sorted(round(t, 1) for t in ticks if t > 2 * statistics.median(ticks)),
                    "ttft_s": [round(t, 4) for t in summary.get("ttft_s", [])]})
        for name, trials in rows.items():
            for t in trials:
                print(f"{cls} {name:12s} {t['tok_s']:7.1f} tok/s wall {t['wall_ms']:7.1f} plan {t['plan_ms']:5.1f} "
                      f"prefill {t['prefill_chunk_ms']:6.1f} begin {t['begin_ms']:5.1f} ticks {t['ticks']} "
                      f"median {t['tick_median_ms']:5.2f} sum {t['ticks_ms_sum']:7.1f} first {t['first_ticks_ms']} "
                      f"slow {t['slow_ticks_ms']}", flush=True)
        for name, text in profiles.items():
            print(f"===== {cls} {name} host time by function (cProfile, last trial)\n{text}", flush=True)
        out[cls] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
