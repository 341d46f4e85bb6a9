"""``--max-draft auto`` replayed on recorded drafts: controller what-ifs in seconds (a dev tool).

``record`` runs the starter greedily on held-out prompts, one plain step at a time, and before
every step asks the drafters what they would propose there: n-gram lookup's draft, whether it
is a cheap one, and DSpark's whole block with every slot's confidence. Greedy output does not
depend on the caps, so these traces hold every round any cap policy could run on them.

``replay`` then drives the real ``CapController`` (or fixed caps) over the traces on a modeled
device clock (the costs of ``sim_auto.py``: a pipelined plain step, a synced verify plus a little
per row, a DSpark call plus its catch-up pieces, a lookup), with any confidence cut, and prints
the modeled speed over plain decoding per class. It agrees with ``sim_auto.py`` (the fixed arms
to the third decimal where no answer ends early: ``sim_auto.py`` ignores EOS) but needs no model,
so many prompts and many controller settings can be compared in seconds:

    python3 tests/device/replay_auto.py record --per-class 12 --out /tmp/traces.json.gz
    python3 tests/device/replay_auto.py replay /tmp/traces.json.gz --fixed 7 \\
        --set PROBE_GAP=8 --set controller.min_rounds=12

``--set NAME=VALUE`` overrides a constant of ``engine.cap_controller`` (``PROBE_GAP``); with
``controller.`` a ``CapController`` keyword (``controller.hysteresis=1.05``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine  # noqa: E402,F401  (preloads BLAS)
from engine import cap_controller as CC  # noqa: E402
from engine import cost_model as M  # noqa: E402
from engine.calibrate import WARM_PLAIN  # noqa: E402
from engine.drafters.dspark import keep_count  # noqa: E402
from engine.speculative import _plain_run_length, _tell_no_draft  # noqa: E402  (the loop's own asks)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_auto import add_cost_arguments  # noqa: E402


# ===================================================================== record
class _Recorder:
    """A cap policy that never drafts (one plain step per run) and, each time the loop asks for
    a cap, records what the drafters would propose after the committed tokens."""

    def __init__(self, drafter, stats, sampler, trace: dict):
        self.drafter, self.stats, self.sampler, self.trace = drafter, stats, sampler, trace

    def cap(self) -> int:
        ids = self.stats.ids
        lookup, model = self.drafter.lookup, self.drafter.model_drafter
        draft = lookup.propose(ids, lookup.max_draft, self.sampler)
        self.trace["lookup"].append([] if draft is None else draft.tokens.tolist())
        self.trace["cheap"].append(bool(lookup.cheap_draft_ready(ids)))
        model.catch_up(ids)
        model.trace = []
        block = model.propose(ids, model.max_draft, self.sampler)
        self.trace["block"].append(block.tokens.tolist())
        self.trace["conf"].append([round(c, 5) for c in model.trace[-1]])
        model.trace = None
        return 0

    def plain_run(self) -> int:
        return 1

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        pass


def record(args) -> int:
    import engine.api as tandem
    from engine.prompts import load_prompts
    from engine.sampling import Sampler, SamplingParams
    from engine.speculative import DecodeStats, decode

    eng = tandem.load()
    drafter = eng.drafter("dspark")
    if not hasattr(drafter, "model_drafter"):
        raise SystemExit("record needs DSpark with lookup first (the starter's default)")
    eos = list(getattr(eng.tokenizer, "eos_token_ids", None) or [])  # as Engine.generate stops
    traces = []
    for cls, prompt in load_prompts(args.classes.split(","), per_class=args.per_class):
        ids = eng.encode(prompt)
        stats = DecodeStats()
        trace = {"cls": cls, "lookup": [], "cheap": [], "block": [], "conf": []}
        sampler = Sampler(SamplingParams())
        policy = _Recorder(drafter, stats, sampler, trace)
        for _ in decode(eng.target, drafter, ids, sampler, max_new_tokens=args.tokens, eos_ids=eos,
                        cap_policy=policy, stats=stats):
            pass
        trace["gen"] = stats.ids[len(ids):]
        trace["eos"] = stats.finish_reason == "stop"
        traces.append(trace)
        print(f"{cls}: {len(trace['gen'])} tokens, {len(trace['block'])} positions", file=sys.stderr)
    with gzip.open(args.out, "wt") as f:
        json.dump({"tokens": args.tokens, "max_draft": drafter.max_draft, "traces": traces}, f)
    return 0


# ===================================================================== replay
COSTS = ("step", "sync", "width_ms", "draft", "piece", "lookup_ms", "switch")


def _accepted(draft: list[int], following: list[int]) -> int:
    n = 0
    for d, g in zip(draft, following):
        if d != g:
            break
        n += 1
    return n


def replay_one(trace: dict, policy, costs: argparse.Namespace, cut: tuple[str, float | None], max_draft: int,
               max_tokens: int) -> tuple[float, list]:
    """Modeled ms of one request under ``policy`` and its rounds as (cap, drafted, accepted)."""
    gen = trace["gen"]
    total = min(len(gen), max_tokens)
    t, ms, seen, rounds = 0, 0.0, None, []  # t: index in gen of the anchor (the last committed token)
    rule, threshold = cut
    after_round = False
    while t + 1 < total:
        remaining = total - (t + 1)
        cap = max(0, min(policy.cap(), max_draft, remaining - 1))
        if cap and costs.mode == "lookup" and not trace["lookup"][t] and not costs.empty_rounds:
            # no match: plain steps until there is (engine/speculative.py asks Drafter.draft_ready
            # while the next forward is in flight, so it sees the match one token late)
            _tell_no_draft(policy)
            cap, run, stop = 0, remaining, _match_seen(trace)
        elif cap == 0:
            run, stop = max(1, min(_plain_run_length(policy), remaining)), _cheap_draft_stop(policy, trace)
        if cap == 0:
            for i in range(run):
                step = costs.step + (costs.switch if after_round and i == 0 else 0.0)
                ms += step
                t += 1
                policy.observe(0, 0, step / 1000.0)
                rounds.append((0, 0, 0))
                if i + 1 < run and stop(t):
                    break
            after_round = False
            continue
        round_ms = costs.lookup_ms
        draft = trace["lookup"][t][:cap]
        if not draft and costs.mode == "dspark":
            keep = len(trace["block"][t]) if threshold is None else keep_count(trace["conf"][t], threshold, rule)
            draft = trace["block"][t][:min(keep, cap)]
            pieces = 1 if seen is None else bin(max(0, t - seen)).count("1")
            seen = t
            round_ms += costs.draft + costs.piece * pieces
        k = len(draft)
        a = _accepted(draft, gen[t + 1:total])
        round_ms += costs.sync + costs.width_ms * k
        ms += round_ms
        t += a + 1
        policy.observe(k, a, round_ms / 1000.0)
        rounds.append((cap, k, a))
        after_round = True
    return ms, rounds


def _match_seen(trace: dict):
    """Ends a run of plain steps (asked with the new anchor's index) once lookup had a match."""
    return lambda t: bool(trace["lookup"][t - 1])


def _cheap_draft_stop(policy, trace: dict):
    """Ends a parked run where a watching policy meets a cheap draft (and tells it)."""
    watching = getattr(policy, "watch_cheap_drafts", lambda: False)

    def stop(t: int) -> bool:
        if watching() and trace["cheap"][t]:
            policy.cheap_draft()
            return True
        return False

    return stop


def _set(overrides: list[str]) -> dict:
    kwargs = {}
    for item in overrides:
        name, _, value = item.partition("=")
        number = float(value)
        number = int(number) if number.is_integer() and "." not in value else number
        if name.startswith("controller."):
            kwargs[name.split(".", 1)[1]] = number
        elif hasattr(CC, name):
            setattr(CC, name, number)
        else:
            raise SystemExit(f"no constant {name} in engine.cap_controller")
    return kwargs


def replay(args) -> int:
    from engine.speculative import FixedCap

    with gzip.open(args.traces, "rt") as f:
        data = json.load(f)
    traces, counts = [], {}
    for t in data["traces"]:  # the first --per-class of each class
        if t["cls"] in args.classes.split(",") and counts.get(t["cls"], 0) < args.per_class:
            counts[t["cls"]] = counts.get(t["cls"], 0) + 1
            traces.append(t)
    kwargs = _set(args.set)
    rule, _, thr = args.cut.partition("@")
    cut = (rule, float(thr) if thr and float(thr) > 0 else None)
    verify, draft_ms = (lambda w: args.step * (1.0 + 0.01 * w)), 1.0  # the GPU's optimistic curves
    if args.cal == "matched":
        verify, draft_ms = (lambda w: args.sync + args.width_ms * (w - 1)), args.draft
    slow = args.cal_pace  # the calibration timed at another pace than the requests run at
    cal = M.Calibration.synthetic(lambda w: slow * verify(w), 16, plain_ms=slow * args.step,
                                  draft=(lambda c: slow * draft_ms) if args.mode == "dspark" else None)
    arms = ["auto"] + [str(c) for c in args.fixed]
    best: dict[int, float] = {}  # per trace: the best of plain decoding and the fixed arms
    for arm in arms[::-1]:
        rng, request = random.Random(args.seed), 0  # every arm meets the same paces
        state, per_cls, rounds_n, regret = None, {}, [], {}
        for p in range(args.passes):
            for trace in traces:
                if arm == "auto":
                    if state is None:
                        state = CC.LearnedState()
                    else:  # as engine.calibrate.auto_cap_policy carries state between requests
                        state.shrink()
                    policy = CC.CapController(cal, data["max_draft"], state=state, warm_plain=WARM_PLAIN, **kwargs)
                else:
                    policy = FixedCap(int(arm))
                costs = args
                if args.drift or args.paces:  # this request's pace: the whole machine slower by a factor
                    paces = [float(x) for x in args.paces.split(",")] if args.paces else None
                    pace = paces[request % len(paces)] if paces else 1.0 + args.drift * rng.random()
                    request += 1
                    costs = argparse.Namespace(**{name: value * pace if name in COSTS else value
                                                  for name, value in vars(args).items()})
                ms, rounds = replay_one(trace, policy, costs, cut, data["max_draft"], args.tokens)
                if p == args.passes - 1:
                    n = min(len(trace["gen"]), args.tokens)
                    ratio = (n - 1) * costs.step / ms
                    per_cls.setdefault(trace["cls"], []).append(ratio)
                    if arm != "auto":
                        best[id(trace)] = max(best.get(id(trace), 1.0), ratio)
                    elif best:
                        regret.setdefault(trace["cls"], []).append(ratio / best[id(trace)])
                    rounds_n.append(sum(1 for c, _, _ in rounds if c > 0))
                    if args.show and arm == "auto":
                        print(f"  {trace['cls']}: " + " ".join(f"c{c}:{k}/{a}" if c else "." for c, k, a in rounds))
        means = {c: statistics.mean(v) for c, v in per_cls.items()}
        print(f"{arm:>5}: " + "  ".join(f"{c} {m:.3f}" + (f" (min {min(per_cls[c]):.2f})" if args.detail else "")
                                       for c, m in means.items())
              + f"  | geo {statistics.geometric_mean(list(means.values())):.3f}"
              + f"  worst {min(means.values()):.3f}  rounds/request {statistics.mean(rounds_n):.1f}")
        if regret:
            print("       of the best fixed or plain, per prompt: " + "  ".join(
                f"{c} {statistics.mean(v):.3f} (min {min(v):.2f})" for c, v in regret.items()))
            if args.detail:
                for c, v in per_cls.items():
                    print(f"       {c}: " + " ".join(f"{x:.2f}/{x / r:.2f}" for x, r in zip(v, regret[c])))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--per-class", type=int, default=12)
    rec.add_argument("--tokens", type=int, default=128)
    rec.add_argument("--classes", default="chat,code,math")
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay")
    rep.add_argument("traces")
    rep.add_argument("--classes", default="chat,code,math")
    rep.add_argument("--per-class", type=int, default=1 << 30)
    rep.add_argument("--tokens", type=int, default=128)
    rep.add_argument("--passes", type=int, default=2, help="passes over the prompts (state carries over)")
    rep.add_argument("--mode", choices=("dspark", "lookup"), default="dspark",
                     help="dspark: lookup first, else DSpark's block (the starter's default); lookup: n-gram lookup alone")
    rep.add_argument("--cut", default="slot@0.3", help="DSpark's confidence cut, rule@threshold (slot@0: none)")
    rep.add_argument("--fixed", type=int, nargs="*", default=[], help="fixed-cap arms too")
    add_cost_arguments(rep)
    rep.add_argument("--empty-rounds", action="store_true",
                     help="lookup with no match verifies an empty round (the loop before Drafter.draft_ready)")
    rep.add_argument("--switch", type=float, default=0.0, help="extra ms of a plain run's first step after a round")
    rep.add_argument("--drift", type=float, default=0.0,
                     help="each request runs on a machine slower by a random factor in [1, 1 + drift] (the H200's "
                          "timings moved up to 2x between minutes); each is compared with plain steps at its pace")
    rep.add_argument("--paces", default="", help="the requests' paces in turn instead, e.g. 1.8,1")
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--cal", choices=("optimistic", "matched"), default="optimistic")
    rep.add_argument("--cal-pace", type=float, default=1.0, help="the calibration was timed this much slower")
    rep.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    rep.add_argument("--show", action="store_true")
    rep.add_argument("--detail", action="store_true")
    args = ap.parse_args()
    return record(args) if args.cmd == "record" else replay(args)


if __name__ == "__main__":
    sys.exit(main())
