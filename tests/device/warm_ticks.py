"""Whether ``engine.batching.warm_up`` leaves any batch shape to compile on first use, without a
real model: a random model of ``--layers`` x ``--hidden`` (mlx-lm's own llama class, tests/tiny.py)
decodes four requests of different lengths together (baseline and lookup), in a fresh process
per ``--warm`` choice, and prints the median and slowest of its rounds (Batcher ticks that ran
one). On a GPU (a shape policy) a first-use compile shows as a slow round under ``--warm none``
and should be gone under ``--warm batch``; on the CPU (no policy) the two read alike.

    PYTHONPATH=$PWD python3 tests/device/warm_ticks.py --warm batch|none [--layers 8] [--hidden 1024]
        [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import engine  # noqa: F401  (first: the CPU's BLAS preload)
import engine.batching as batching
from tests.tiny import make_tiny_engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", choices=("batch", "none"), required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    eng = make_tiny_engine("llama", seed=3, layers=args.layers, hidden=args.hidden, scale=4.0)
    eng.suffix_index = None
    warm_s = batching.warm_up(eng, ["baseline", "lookup"], 4) if args.warm == "batch" else 0.0
    out = {"warm": args.warm, "warm_up_s": round(warm_s, 2), "policy": eng.target.shapes is not None, "arms": {}}
    for mode in ("baseline", "lookup"):
        batcher = batching.Batcher(eng, 4)
        for n in (40, 90, 150, 230):  # four prompt lengths, some repeating (lookup drafts)
            batcher.submit([2 + (i * 7) % 50 for i in range(n)], mode=mode, max_new_tokens=args.max_new_tokens,
                           max_draft=None if mode == "baseline" else "auto", prefix_cache=False)
        ticks = []
        while batcher.busy:
            t0 = time.perf_counter()
            batcher.step()
            if batcher.loop.last_width:  # a round (a tick of only a prefill chunk is left out)
                ticks.append(1000 * (time.perf_counter() - t0))
        out["arms"][mode] = {"ticks": len(ticks), "median_ms": round(statistics.median(ticks), 2),
                             "max_ms": round(max(ticks), 2), "slowest_5_ms": sorted(round(t, 1) for t in ticks)[-5:]}
        print(mode, out["arms"][mode], flush=True)
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
