"""What each row's ``--max-draft auto`` controller saw and decided in a batched run: per row, the
sequence of its observations (plain runs folded into one line), with the cap it asked, the drafts
kept, the ms it was charged, whether it was parked or probing, its plain step, refill and probe
gap, and at the end the cost curve it priced rounds with at this batch width. Written for the
H100 runs where lookup@auto ran summarization at 0.93x the batched baseline while lookup at a
fixed cap of 16 ran 1.2x it (h100-batch-ticks-...-s10-summ.json).

    python3 tests/device/auto_trace.py [--gguf STARTER.gguf] [--dtype bfloat16] [--draft-model PATH] [--mode lookup]
        [--classes summarization] [--max-new-tokens 128] [--sequential-first] [--suffix-index] [--json OUT.json]

``--sequential-first`` runs the arm's requests one after another before the traced batch, as
``tandem benchmark --concurrent`` does (the engine's auto state has then learned at one row);
``--suffix-index`` keeps the engine's suffix index (emptied before each run, as there).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import engine.batching as batching
from engine import batch, cap_controller
from engine.api import load
from engine.benchmark import Arm
from engine.concurrent_bench import run_batched, run_sequential
from engine.prompts import CLASSES, load_prompts, load_spec_bench


def instrument() -> dict:
    """Patch CapController.observe to log every observation by controller."""
    log: dict = {}
    observe = cap_controller.CapController.observe

    def _observe(self, drafted, accepted, seconds):
        cap, st = self._last_cap, self.state
        entry = {"cap": cap, "drafted": drafted, "accepted": accepted, "ms": round(seconds * 1000, 2),
                 "parked": st.parked, "probing": self._probing, "cheap": self._cheap_probe}
        observe(self, drafted, accepted, seconds)
        entry.update(plain_ms=round(self.plain_ms(), 2), refill_ms=round(self.refill_ms(), 2),
                     gap=self._gap(), probe_loss=round(st.probe_loss, 2), p=round(st.p, 3),
                     parked_after=st.parked, rows=self.rows)
        log.setdefault(id(self), []).append(entry)

    cap_controller.CapController.observe = _observe
    return log


def instrument_cuts() -> list:
    """Patch batch._uncut to log each decision where a row asked to draft: the batch's plain rate
    (tokens/ms: live and calibrated plain step), the best round's (its width, tokens, ms, refill)."""
    decisions: list = []
    uncut = batch._uncut

    def _uncut(caps, rows, after_plain=False):
        out = uncut(caps, rows, after_plain)
        judge = batch._judge(rows)
        if any(caps) and judge is not None and len(rows) > 1:
            cost = judge.corrected()
            refill = judge.refill_ms() if after_plain else 0.0
            worths = batch._worths(rows, judge, before=True)
            best = max(range(2, max(caps) + 2), key=lambda w: sum(
                batch._worth(t, min(c, w - 1)) for t, c in zip(worths, caps))
                / (judge.round_ms(w) + cost.draft(w - 1) + refill))
            worth = [round(batch._worth(t, min(c, best - 1)), 2) for t, c in zip(worths, caps)]
            decisions.append({"caps": list(caps), "cut": not any(out), "after_plain": after_plain,
                              "live_plain_ms": round(cost.plain_step_ms(), 2),
                              "cal_plain_ms": round(judge.cal.plain_step_ms(), 2), "width": best, "worth": worth,
                              "round_ms": round(judge.round_ms(best), 2), "draft_ms": round(cost.draft(best - 1), 2),
                              "refill_ms": round(refill, 2)})
        return out

    batch._uncut = _uncut
    return decisions


def fold(entries: list) -> list[str]:
    """Plain runs as one line each, rounds one line each."""
    lines, run = [], []
    for e in entries + [None]:
        if e is not None and e["cap"] == 0:
            run.append(e)
            continue
        if run:
            ms = [r["ms"] for r in run]
            lines.append(f"  plain x{len(run):3d}  ms first {ms[0]:.1f} mid {sorted(ms)[len(ms) // 2]:.1f} last {ms[-1]:.1f}"
                         f"  parked {run[-1]['parked_after']} gap {run[-1]['gap']} plain_ms {run[-1]['plain_ms']}")
            run = []
        if e is not None:
            kind = "probe" if e["probing"] else "round"
            kind += "(cheap)" if e["cheap"] else ""
            lines.append(f"  {kind:12s} cap {e['cap']:2d} drafted {e['drafted']:2d} accepted {e['accepted']:2d}"
                         f" ms {e['ms']:.1f}  -> parked {e['parked_after']} gap {e['gap']} loss {e['probe_loss']}"
                         f" refill {e['refill_ms']} plain {e['plain_ms']} p {e['p']} rows {e['rows']}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--draft-model", default=None, help="a draft model for --mode draft")
    ap.add_argument("--mode", default="lookup")
    ap.add_argument("--classes", default="summarization")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sequential-first", action="store_true")
    ap.add_argument("--suffix-index", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    eng = load(args.gguf, dtype=args.dtype, draft_model=args.draft_model)
    if not args.suffix_index:
        eng.suffix_index = None
    print(f"batch warm-up: {batching.warm_up(eng, ['baseline', args.mode], 4):.1f} s", flush=True)
    out = {}
    log, decisions = instrument(), instrument_cuts()
    for cls in args.classes.split(","):
        prompts = load_prompts([cls], 4) if cls in CLASSES else load_spec_bench([cls], 4)
        group = [eng.encode(p) for _, p in prompts]
        arm = Arm(args.mode, "auto")
        run_batched(eng, group, arm, 8, 0.0, 4)  # warm-up: calibration, first shapes
        base = [run_batched(eng, group, Arm("baseline"), args.max_new_tokens, 0.0, 4)[0]["tok_s"]]
        if args.sequential_first:
            print(f"{cls} {arm.name} one after another: {run_sequential(eng, group, arm, args.max_new_tokens, 0.0)[0]['tok_s']:.1f} tok/s")
        log.clear()
        decisions.clear()
        summary, _ = run_batched(eng, group, arm, args.max_new_tokens, 0.0, 4)
        base.append(run_batched(eng, group, Arm("baseline"), args.max_new_tokens, 0.0, 4)[0]["tok_s"])
        print(f"{cls} {arm.name}: {summary['tok_s']:.1f} tok/s; the batched baseline before and after it: "
              f"{base[0]:.1f}, {base[1]:.1f}")
        print(f" batch decisions with a draft asked: {len(decisions)}, cut {sum(d['cut'] for d in decisions)}")
        for d in decisions[:40]:
            print("  ", json.dumps(d))
        for i, entries in enumerate(log.values()):
            print(f" row {i}:")
            print("\n".join(fold(entries)))
        out[cls] = {"tok_s": summary["tok_s"], "baseline_tok_s": base, "rows": [list(v) for v in log.values()],
                    "decisions": list(decisions)}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
