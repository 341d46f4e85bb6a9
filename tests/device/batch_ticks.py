"""What the ticks of a batched run are made of, per arm: how many forwards each tick ran and how
wide (rows x width), their mean time and the part of it spent building the forwards' graphs on
the host (``graph build``: a tick whose build time nears its whole time is host-bound), and per
row the drafts it verified and kept (those in other rows' rounds' padding apart: ``free``) and
the caps its policy asked for. Written for the H100 table where lookup@auto ran a four-row math batch
at 0.64x the batched baseline (h100-concurrent-starter-bfloat16-cuts.json), to see whether the
rounds speculated, were cut, or were slow for another reason.

    python3 tests/device/batch_ticks.py [--gguf STARTER.gguf] [--dtype bfloat16] --arms baseline,lookup
        [--classes math] [--trials 2] [--max-new-tokens 128] [--warm run|batch|none] [--widths 4]
        [--json OUT.json]

An arm is a mode (at ``--max-draft auto``) or ``mode@cap`` (``lookup@16``: a fixed cap;
``dspark@parked``: the drafter attached and never asked, ``FixedCap(0)``).
``--widths 4,1`` runs each arm's four requests as one batch and then one at a time through the
same loop, so a row's drafts and acceptance in the batch sit beside its own alone.

--warm run (the default) runs each arm's batch once for 8 tokens before timing; batch runs
``engine.batching.warm_up`` (what ``tandem serve`` does at load) instead, and none nothing, so the
slowest tick of trial 0 shows whether a shape was still compiled on first use.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import time
from pathlib import Path

import engine.batching as batching
from engine import batch
from engine.api import load
from engine.benchmark import Arm
from engine.concurrent_bench import AGENT, agent_prompts, run_batched
from engine.prompts import CLASSES, load_prompts, load_spec_bench
from engine.speculative import FixedCap


def instrument() -> list:
    """Patch the batch loop to record, per Batcher tick, its forwards (rows, width), whether it
    drafted, and its time; returns the list the ticks are appended to."""
    ticks: list = []
    current: dict = {}
    verify, drafts, step = batch.BatchLoop._verify, batch.BatchLoop._drafts, batching.Batcher.step

    def _verify(self, rows, ids):
        current.setdefault("forwards", []).append((len(rows), int(ids.shape[1])))
        t0 = time.perf_counter()
        try:
            return verify(self, rows, ids)
        finally:  # the forward's graph, built on the host (its kernels run later)
            current["build_s"] = current.get("build_s", 0.0) + time.perf_counter() - t0

    def _drafts(self, rows, caps):
        current["drafted"] = True
        return drafts(self, rows, caps)

    def _step(self):
        current.clear()
        t0 = time.perf_counter()
        step(self)
        ticks.append((tuple(current.get("forwards", [])), bool(current.get("drafted")), time.perf_counter() - t0,
                      current.get("build_s", 0.0)))

    batch.BatchLoop._verify, batch.BatchLoop._drafts, batching.Batcher.step = _verify, _drafts, _step
    return ticks


def _prompts(cls: str) -> list:
    """Four prompts of a class: chat/code/math, a Spec-Bench category, or the agent session's."""
    if cls == AGENT:
        return agent_prompts(4)
    return load_prompts([cls], 4) if cls in CLASSES else load_spec_bench([cls], 4)


def _cap(text: str) -> int | str:
    """``lookup@16`` -> 16; ``lookup@parked`` -> "parked"; ``lookup`` or ``lookup@auto`` -> "auto"."""
    return int(text) if text.isdigit() else text if text == PARKED else "auto"


PARKED = "parked"  # the drafter attached (its tap, its commits) but never asked: FixedCap(0)


@contextlib.contextmanager
def _parked(eng: object, arm: Arm):
    """For a ``@parked`` arm, every request's cap policy is ``FixedCap(0)``: what a row costs
    the batch's plain steps without a controller's probes."""
    if arm.cap != PARKED:
        yield arm
        return
    cls = type(eng)
    original = cls._cap_policy
    cls._cap_policy = lambda self, mode, drafter, max_draft, seeded=False, cached_only=False: (FixedCap(0), 0)
    try:
        yield Arm(arm.mode, None)
    finally:
        cls._cap_policy = original


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--arms", default="baseline,lookup")
    ap.add_argument("--classes", default="math")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warm", choices=("run", "batch", "none"), default="run")
    ap.add_argument("--widths", default="4", help="max batch of each run, e.g. 4,1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ticks = instrument()
    eng = load(args.gguf, dtype=args.dtype)
    eng.suffix_index = None
    arms = [Arm("baseline") if a == "baseline" else Arm(a.partition("@")[0], _cap(a.partition("@")[2]))
            for a in args.arms.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    if args.warm == "batch":
        print(f"batch warm-up: {batching.warm_up(eng, sorted({a.mode for a in arms}), 4):.1f} s", flush=True)
    out = []
    for cls in args.classes.split(","):
        group = [eng.encode(p) for _, p in _prompts(cls)]
        for arm, width, trial in ((a, w, t) for a in arms for w in widths for t in range(args.trials)):
            with _parked(eng, arm) as run_arm:
                if args.warm == "run" and trial == 0:
                    run_batched(eng, group, run_arm, 8, 0.0, width)  # warm-up (calibration, first shapes)
                ticks.clear()
                summary, results = run_batched(eng, group, run_arm, args.max_new_tokens, 0.0, width)
            kinds: dict = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
            for forwards, drafted, seconds, build in ticks:
                key = ",".join(f"{r}x{w}" for r, w in forwards) or "prefill"
                key += " drafted" if drafted else ""
                kinds[key][0] += 1
                kinds[key][1] += seconds
                kinds[key][2] = max(kinds[key][2], seconds)
                kinds[key][3] += build
            rows = [{"drafted": sum(d for d, _ in r.rounds[1:]), "accepted": sum(a for _, a in r.rounds[1:]),
                     # free drafts: verified in a round's padding, the row's own cap 0
                     "free": [sum(d for (d, _), c in zip(r.rounds, r.caps) if not c),
                              sum(a for (_, a), c in zip(r.rounds, r.caps) if not c)],
                     "caps": dict(collections.Counter(r.caps))} for r in results]
            entry = {"class": cls, "arm": arm.name, "width": width, "trial": trial,
                     "tok_s": round(summary["tok_s"], 1),
                     "ticks": {k: {"n": n, "mean_ms": round(1000 * s / n, 2), "max_ms": round(1000 * m, 2),
                                   "build_ms": round(1000 * b / n, 2)}
                               for k, (n, s, m, b) in kinds.items()},
                     "rows": rows}
            out.append(entry)
            print(f"{cls} {arm.name} max batch {width} trial {trial}: {entry['tok_s']} tok/s", flush=True)
            for k, v in sorted(entry["ticks"].items(), key=lambda kv: -kv[1]["n"] * kv[1]["mean_ms"]):
                print(f"   {k:28s} n={v['n']:4d} mean {v['mean_ms']:.2f} ms, max {v['max_ms']:.2f} ms,"
                      f" graph build {v['build_ms']:.2f} ms")
            for r in rows:
                print(f"   row: drafted {r['drafted']} accepted {r['accepted']} (free: {r['free'][0]} kept"
                      f" {r['free'][1]}) caps {r['caps']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
