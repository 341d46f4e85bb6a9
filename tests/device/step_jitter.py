"""How steady one plain decoding step is, run after run: the H200 benchmarks show a baseline
run's ms per step anywhere from 3.7 to 7.9 on the same prompt, which swamps a few percent of
engine cost. Run under different CPU affinities (``taskset``) to see whether the spread is the
host thread's placement.

    taskset -c 0-3 python3 tests/device/step_jitter.py --gguf STARTER.gguf --dtype float16 --runs 40

Prints the affinity, then the percentiles of ms per step over ``--runs`` baseline answers of
``--tokens`` tokens to one chat prompt, and a coarse histogram.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import engine.api as api
from engine.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    eng = api.load(args.gguf, dtype=args.dtype)
    ids = eng.encode(load_prompts(["chat"], 1)[0][1])
    eng.generate(ids, mode="baseline", max_new_tokens=16, prefix_cache=False)
    steps = []
    for _ in range(args.runs):
        r = eng.generate(ids, mode="baseline", max_new_tokens=args.tokens, prefix_cache=False)
        steps.append(r.decode_s * 1000.0 / max(1, r.generated - 1))
    q = statistics.quantiles(steps, n=10)
    cpus = sorted(os.sched_getaffinity(0))
    row = {"label": args.label, "cpus": len(cpus), "dtype": args.dtype, "runs": len(steps),
           "p10": round(q[0], 3), "median": round(statistics.median(steps), 3), "p90": round(q[-1], 3),
           "min": round(min(steps), 3), "max": round(max(steps), 3)}
    print(json.dumps(row), flush=True)
    lo = min(steps)
    bins = [0] * 10
    for s in steps:
        bins[min(9, int((s - lo) / max(1e-9, (max(steps) - lo)) * 10))] += 1
    print("  histogram from", round(lo, 2), "to", round(max(steps), 2), "ms:", bins, flush=True)
    if args.json:
        path = Path(args.json)
        rows = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(rows + [row | {"steps": [round(s, 3) for s in steps]}], indent=1))


if __name__ == "__main__":
    main()
