"""What a parked plain step costs beside a baseline step, piece by piece: the H200 runs show
``--max-draft auto``'s parked steps on chat slower than the baseline's (6.56 against 6.16 ms in
bf16, h200-auto7), with no pipeline refill to blame (a run's time fits n x step + ~0).

    python3 tests/device/parked_steps.py --gguf STARTER.gguf --dtype bfloat16 --json OUT.json

Arms, interleaved on each prompt as the benchmark's are (``engine.benchmark.arm_order``; the
starter with its lookup-first DSpark drafter):
  baseline       no drafter
  parked         the drafter attached, never proposing (``FixedCap(0)``): the tap and its commits
  parked-notap   the same without the tap (the plain steps return no hidden rows)
  parked-watch   parked, watching for cheap drafts: each ready one ends the run, which restarts
  auto-parked    the real ``--max-draft auto`` controller, parked with no probe due
  auto           the real controller as shipped (probes, cheap-draft probes)
For ``auto``, each plain step is also set beside the baseline step of the same token (same prompt
and repetition), by how many plain steps after the last round it came: is a step slower right
after a probe?
Per arm: median ms per step over runs (decode time / (tokens - 1)), and the median of its ratio to
the baseline run of the same prompt and repetition.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

import engine.api as api
import engine.speculative as speculative
from engine.benchmark import arm_order
from engine.prompts import load_prompts
from engine.speculative import PLAIN_FOREVER, FixedCap

DRAFTER = "resources:drafters/smollm2-135m-dspark"


class ParkedWatch:
    """Parked for good, ending a run whenever a cheap draft is ready (and never probing it)."""

    label = "parked-watch"

    def __init__(self) -> None:
        self.runs = 0

    def cap(self) -> int:
        return 0

    def plain_run(self) -> int:
        self.runs += 1
        return PLAIN_FOREVER

    def watch_cheap_drafts(self) -> bool:
        return True

    def cheap_draft(self) -> None:
        pass

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--classes", default="chat,math")
    ap.add_argument("--per-class", type=int, default=3)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    eng = api.load(args.gguf, drafter=DRAFTER, dtype=args.dtype)
    prompts = [(c, eng.encode(p)) for c, p in load_prompts(args.classes.split(","), args.per_class)]
    plain_run = speculative._plain_run

    def untapped(target, cache, ids, sampler, n, tap, *rest, **kw):
        return plain_run(target, cache, ids, sampler, n, False, *rest, **kw)

    def auto():
        return eng._cap_policy("dspark", eng.drafter("dspark"), "auto")[0]

    def auto_parked():
        policy = auto()
        policy.state.parked, policy.state.probe_gap, policy._warm = True, 10**9, 0
        policy.state.since_probe = 0
        return policy

    def run(arm: str, ids: list[int]) -> tuple[float, int, list]:
        mode, policy = "dspark", None
        if arm == "baseline":
            mode = "baseline"
        elif arm in ("parked", "parked-notap"):
            policy = FixedCap(0)
        elif arm == "parked-watch":
            policy = ParkedWatch()
        elif arm == "auto-parked":
            policy = auto_parked()
        elif arm == "auto":
            policy = auto()
        events = []
        speculative._plain_run = untapped if arm == "parked-notap" else plain_run
        try:
            r = eng.generate(ids, mode=mode, max_new_tokens=args.tokens, prefix_cache=False, cap_policy=policy,
                             on_round=events.append)
        finally:
            speculative._plain_run = plain_run
        runs = policy.runs if isinstance(policy, ParkedWatch) else 1
        return r.decode_s * 1000.0 / max(1, r.generated - 1), runs, events

    def step_times(events: list) -> list[tuple[int, int, float]]:
        """(token index, plain steps since the last round, ms) of each plain step but the first."""
        out, since = [], 0
        for before, ev in zip(events, events[1:]):
            since = since + 1 if ev.cap == 0 else 0
            if ev.cap == 0:
                out.append((ev.generated - 1, since, (ev.t - before.t) * 1000.0))
        return out

    arms = ["baseline", "parked", "parked-notap", "parked-watch", "auto-parked", "auto"]
    after_round: dict[str, list[float]] = {}  # bucket of steps since the last round -> auto / baseline
    for arm in arms:  # warm-up: calibration (auto), allocations, kernels
        run(arm, prompts[0][1][:64])
    ms = {a: [] for a in arms}
    ratio = {a: [] for a in arms}
    restarts = []
    t0 = time.perf_counter()
    for rep in range(args.reps):
        for j, (cls, ids) in enumerate(prompts):
            got, trace = {}, {}
            for arm in (arms[i] for i in arm_order(len(arms), rep, j, len(prompts))):
                step, runs, events = run(arm, ids)
                got[arm], trace[arm] = step, step_times(events)
                ms[arm].append((cls, step))
                if arm == "parked-watch":
                    restarts.append(runs - 1)
            for arm in arms:
                ratio[arm].append((cls, got["baseline"] / got[arm]))
            base = {tok: step for tok, _, step in trace["baseline"]}
            for tok, since, step in trace["auto"]:
                if tok in base:
                    key = str(since) if since <= 4 else "5-8" if since <= 8 else "9-16" if since <= 16 else "17+"
                    after_round.setdefault(key, []).append(step / base[tok])
        print(f"rep {rep + 1}/{args.reps} done at {time.perf_counter() - t0:.0f}s", flush=True)

    rows = {}
    for arm in arms:
        row = {}
        for cls in args.classes.split(",") + ["all"]:
            steps = [s for c, s in ms[arm] if cls in (c, "all")]
            ratios = [x for c, x in ratio[arm] if cls in (c, "all")]
            row[cls] = {"ms_per_step": round(statistics.median(steps), 3),
                        "x_baseline": round(statistics.median(ratios), 4)}
        rows[arm] = row
        print(f"{arm:13s} " + "  ".join(f"{c} {v['ms_per_step']:.3f} ms ({v['x_baseline']:.3f}x)"
                                         for c, v in row.items()), flush=True)
    print(f"parked-watch: {statistics.mean(restarts):.1f} run restarts per answer")
    order = ["1", "2", "3", "4", "5-8", "9-16", "17+"]
    after = {k: {"steps": len(after_round[k]), "x_baseline_step": round(statistics.median(after_round[k]), 4),
                 "mean": round(statistics.mean(after_round[k]), 4)} for k in order if k in after_round}
    print("auto's plain steps / the baseline's same-token step, by steps since the last round:")
    for k, v in after.items():
        print(f"  {k:>5s}: {v['steps']:4d} steps, median {v['x_baseline_step']:.3f}, mean {v['mean']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(mx.default_device()), "dtype": args.dtype,
                                               "tokens": args.tokens, "reps": args.reps, "arms": rows,
                                               "watch_restarts": statistics.mean(restarts),
                                               "auto_steps_after_round": after}, indent=1))


if __name__ == "__main__":
    main()
