"""``--max-draft auto`` on a modeled GPU clock, with real weights and real drafts (a dev tool).

The starter and its shipped drafter run here on the CPU, through the real loop and the real
controller, while time moves only by a cost model of the device (ms per pipelined plain step,
per verify width, per drafter call and per pending context piece): so how much auto loses or
wins against plain steps on a GPU can be studied without a GPU, deterministically, and the
controller tuned between device sessions. Figures are the modeled ratio to plain decoding.

    python3 tests/device/sim_auto.py --modes dspark,lookup --per-class 3 --tokens 128

The default costs are the H200's for the starter in fp16 with the cheaper verifies
(tests/device/results/h200-verify-width-float16.json, h200-auto9-*: a plain step ~3.6 ms
pipelined, a verify of up to 8 rows ~6.0 ms, a DSpark call ~1.2 ms plus ~0.3 ms per context piece
it catches up on; a round then costs 1.9-2.3 plain steps, as the H200 runs realized). The costs
before that work: ``--step 4.4 --sync 5.6 --width-ms 0.05 --draft 4.2 --piece 0.4`` (h200-starter.log).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine  # noqa: E402,F401  (preloads BLAS)
from engine import cap_controller as CC  # noqa: E402
from engine import cost_model as M  # noqa: E402
from engine.calibrate import WARM_PLAIN  # noqa: E402
from engine.sampling import Sampler, SamplingParams  # noqa: E402
from engine.speculative import DecodeStats, FixedCap, decode  # noqa: E402


class ModeledClock:
    """Advances by modeled ms: a pipelined plain step ``step``; any other target forward
    ``sync + width_ms * (width - 1)``; a model drafter's proposal ``draft`` plus ``piece`` per
    power-of-two piece of the context rows it has not seen (DSpark catches up on them); an
    n-gram lookup ``lookup_ms``."""

    def __init__(self, target, drafter, *, step: float, sync: float, width_ms: float, draft: float,
                 piece: float, lookup_ms: float):
        self.now = 0.0
        self._patched = []
        seen = [None]

        def forward(real, ids, cache, **kw):
            w = ids.shape[1]
            self.now += (step if kw.get("last_only") and w == 1 else sync + width_ms * (w - 1)) / 1000.0
            return real(ids, cache, **kw)

        def model_propose(real, ids, cap, sampler):
            pieces = 1 if seen[0] is None else bin(max(0, len(ids) - seen[0])).count("1")
            seen[0] = len(ids)
            self.now += (draft + piece * pieces) / 1000.0
            return real(ids, cap, sampler)

        def lookup_propose(real, ids, cap, sampler):
            self.now += lookup_ms / 1000.0
            return real(ids, cap, sampler)

        self._patch(target, "forward", forward)
        inner = getattr(drafter, "model_drafter", None)
        if inner is not None:
            self._patch(inner, "propose", model_propose)
            self._patch(drafter.lookup, "propose", lookup_propose)
        elif drafter.name == "lookup":
            self._patch(drafter, "propose", lookup_propose)
        else:
            self._patch(drafter, "propose", model_propose)

    def _patch(self, obj, name, wrapper):
        real = getattr(obj, name)
        setattr(obj, name, lambda *a, **kw: wrapper(real, *a, **kw))
        self._patched.append((obj, name))

    def __call__(self) -> float:
        return self.now

    def close(self) -> None:
        for obj, name in self._patched:
            delattr(obj, name)


def add_cost_arguments(ap: argparse.ArgumentParser) -> None:
    """The modeled device's costs in ms (``ModeledClock``), shared with ``replay_auto.py``."""
    ap.add_argument("--step", type=float, default=3.6)
    ap.add_argument("--sync", type=float, default=6.0)
    ap.add_argument("--width-ms", type=float, default=0.01)
    ap.add_argument("--draft", type=float, default=1.2)
    ap.add_argument("--piece", type=float, default=0.3)
    ap.add_argument("--lookup-ms", type=float, default=0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="dspark,lookup")
    ap.add_argument("--per-class", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2, help="passes over the prompts (state carries over)")
    add_cost_arguments(ap)
    ap.add_argument("--cal", choices=("optimistic", "matched"), default="optimistic",
                    help="the calibration the controller starts from: the GPU's optimistic curves, or "
                         "curves that match the modeled clock (a CPU run: --step 47 --sync 56 --width-ms 14 --draft 13)")
    ap.add_argument("--fixed", type=int, default=0, help="also a fixed-cap arm at this cap")
    ap.add_argument("--classes", default="chat,code,math")
    ap.add_argument("--show", action="store_true", help="print each auto run of the last pass, round by round")
    args = ap.parse_args()

    import engine.api as tandem
    from engine.prompts import load_prompts

    eng = tandem.load()
    prompts = load_prompts(args.classes.split(","), per_class=args.per_class)
    # The calibration a GPU measured for this pair promised ~1.4x at full drafts (its curves
    # priced rounds far below what they cost): an optimistic model the live fit must correct.
    if args.cal == "matched":
        verify, draft_ms = (lambda w: args.sync + args.width_ms * (w - 1)), args.draft
    else:
        verify, draft_ms = (lambda w: args.step * (1.0 + 0.01 * w)), 1.0
    cal = M.Calibration.synthetic(verify, 16, plain_ms=args.step, draft=lambda c: draft_ms)
    for mode in args.modes.split(","):
        drafter = eng.drafter(mode)
        state = None
        arms = {"auto": []} | ({str(args.fixed): []} if args.fixed else {})
        for p in range(args.passes):
            for cls, prompt in prompts:
                ids = eng.encode(prompt)
                for arm in arms:
                    if arm == "auto":  # as engine.calibrate.auto_cap_policy carries state between requests
                        if state is None:
                            state = CC.LearnedState()
                        else:
                            state.shrink()
                        policy = CC.CapController(cal, drafter.max_draft, state=state, warm_plain=WARM_PLAIN)
                    else:
                        policy = FixedCap(args.fixed)
                    clock = ModeledClock(eng.target, drafter, step=args.step, sync=args.sync,
                                         width_ms=args.width_ms, draft=args.draft, piece=args.piece,
                                         lookup_ms=args.lookup_ms)
                    stats = DecodeStats()
                    n, start = 0, None
                    try:
                        for out, _ in decode(eng.target, drafter, ids, Sampler(SamplingParams()),
                                             max_new_tokens=args.tokens, cap_policy=policy, stats=stats, clock=clock):
                            start = clock.now if start is None else start  # decode time: after the prefill's token
                            n += len(out)
                    finally:
                        clock.close()
                    plain_ms = (n - 1) * args.step
                    ms = (clock.now - start) * 1000.0
                    if args.show and arm == "auto" and p == args.passes - 1:
                        print(f"{mode} {cls}: " + " ".join(f"c{c}:{d}/{a}" if c else "." for c, (d, a)
                                                         in zip(stats.caps[1:], stats.rounds[1:])))
                    arms[arm].append((p, cls, plain_ms / ms, sum(1 for c in stats.caps[1:] if c > 0)))
        for arm, rows in arms.items():
            last = [r for r in rows if r[0] == args.passes - 1]
            per_cls = {}
            for _, cls, ratio, _ in last:
                per_cls.setdefault(cls, []).append(ratio)
            print(f"{mode}@{arm}: " + "  ".join(f"{c} {statistics.mean(v):.3f} ({' '.join(f'{x:.2f}' for x in v)})"
                                              for c, v in per_cls.items())
                  + f"  | rounds/request {statistics.mean(r[3] for r in last):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
