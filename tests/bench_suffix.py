"""Suffix drafts across requests on the real starter model (a benchmark, not a test: pytest does not
collect it).

    PYTHONPATH=$PWD python tests/bench_suffix.py [--prompts 4] [--tokens 64] [--reps 2] [--arms ...] [--replay]
        [--classes chat,code,math]

A repeated-request session: each prompt (shipped humaneval and mt-bench turns) is asked once
(``fresh``), then again under another system prompt (``repeat``: the same question in a new
session, so the answer is mostly the earlier one but the context is not). Per arm and pass:
tokens per round, target forwards, tokens drafted from the history, decode tok/s. Arms:

* baseline: plain decoding;
* context: n-gram lookup on the current context only (``--no-suffix-drafts``);
* history: lookup with the index of earlier requests (what ``--mode lookup`` runs);
* dspark: the starter's DSpark drafter alone, no lookup;
* dspark+history: the same with the history first where it matches long (``modes.history_first``,
  what ``--mode auto`` runs for a pair whose row has no ``lookup_first``);
* auto: ``--mode auto`` as shipped (the starter's row: DSpark behind lookup, history included).

Every request runs under every arm in turn, and the session ``--reps`` times (each arm with its
own history, emptied per repetition); tok/s counts each request's fastest decode, so a busy
machine slows the arms alike. Every arm's output is checked against plain greedy decoding. The
``fresh`` pass matches only earlier prompts of that pass: the arms must not be slower there.

``--replay`` adds exact offline figures for lookup (context alone, and with the history at each
``--factors`` value of ``SPEC_FACTOR``): greedy output never depends on drafts, so replaying the
plain greedy outputs through a drafter gives the tokens per round it would reach, with no noise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("You are a helpful assistant.", "You are a careful assistant. Answer the question.")


def prompts(n: int, classes: str | None = None) -> dict[str, str]:
    """{prompt: its class}: ``n`` humaneval and mt-bench turns, or ``n`` of each shipped class."""
    if classes:
        from engine.prompts import load_prompts, load_spec_bench
        from engine.prompts import CLASSES as SHIPPED

        wanted = classes.split(",")
        categories = [c for c in wanted if c not in SHIPPED]
        pairs = load_prompts([c for c in wanted if c in SHIPPED], n)
        if categories:  # single-turn questions only
            pairs += [(c, t) for c, t in load_spec_bench(categories, n) if isinstance(t, str)]
        return {text: cls for cls, text in pairs}
    out = {}
    for name in ("humaneval", "mt-bench"):
        with open(ROOT / "resources" / "prompts" / f"{name}.jsonl") as f:
            out.update((json.loads(line)["turns"][0], name) for line in list(f)[: (n + 1) // 2])
    return dict(list(out.items())[:n])


def arm_setups(engine, arms: list[str]) -> dict:
    """Per arm: (mode, the drafter to set for that mode or None, whether it keeps a history)."""
    from engine import modes

    out = {}
    if any(a.startswith("dspark") for a in arms):
        saved = engine.lookup_first
        engine.lookup_first = False  # the DSpark drafter alone
        dspark = engine.drafter("dspark")
        engine.lookup_first = None
        wrapped = modes.history_first(engine, dspark)
        engine.lookup_first = saved
    for arm in arms:
        out[arm] = {"baseline": ("baseline", None, False), "context": ("lookup", None, False),
                    "history": ("lookup", None, True), "auto": ("auto", None, True)}.get(arm) or (
            ("dspark", dspark, False) if arm == "dspark" else ("dspark", wrapped, True))
    return out


def run_arms(engine, arms: list[str], texts: list[str], tokens: int, reference: dict, reps: int,
             classes: dict[str, str] | None = None) -> dict:
    """The session (fresh pass, then repeat pass) once per repetition, every request under every
    arm in turn (so a busy machine slows the arms alike), each arm with its own history; per arm
    and pass (and per pass and class, given ``classes``: {prompt: class}): tokens per round,
    target forwards, and tok/s from each request's fastest decode."""
    from engine.drafters.suffix import SuffixIndex

    setups = arm_setups(engine, arms)
    if "auto" in arms:
        engine._auto_drafter(engine.resolve_mode("auto"))  # built once: every arm's drafters live through the run
    keep, drafters = engine.suffix_index, dict(engine._drafters)
    best: dict = {}
    figures = {arm: {} for arm in arms}
    try:
        for _ in range(reps):
            histories = {arm: SuffixIndex() for arm in arms}
            for phase, system in (("fresh", SYSTEMS[0]), ("repeat", SYSTEMS[1])):
                for text in texts:
                    for arm, (mode, drafter, keeps) in setups.items():
                        engine._drafters.clear()
                        engine._drafters.update(drafters)
                        if drafter is not None:
                            engine.set_drafter(mode, drafter)
                        engine.suffix_index = histories[arm] if keeps else None
                        before = _history_counts(engine)
                        r = engine.generate(text, system=system, mode=mode, max_new_tokens=tokens, prefix_cache=False)
                        after = _history_counts(engine)
                        key = (arm, phase, text)
                        best[key] = min(best.get(key, (float("inf"),)), (r.decode_s, r, after[0] - before[0],
                                                                          after[1] - before[1]), key=lambda b: b[0])
    finally:
        engine.suffix_index = keep
        engine._drafters.clear()
        engine._drafters.update(drafters)
    for (arm, phase, text), (decode_s, r, hist_rounds, hist_tokens) in best.items():
        for key in (phase, f"{phase} {classes[text]}") if classes else (phase,):  # the pass, and its class's share
            f = figures[arm].setdefault(key, {"rounds": 0, "tokens": 0, "target_forwards": 0, "decode_s": 0.0,
                                              "history_rounds": 0, "history_tokens": 0, "same_as_greedy": True})
            f["rounds"] += len(r.rounds) - 1
            f["tokens"] += r.generated - 1
            f["target_forwards"] += r.target_forwards
            f["decode_s"] += decode_s
            f["history_rounds"] += hist_rounds
            f["history_tokens"] += hist_tokens
            f["same_as_greedy"] &= r.token_ids == reference[(phase, text)]
    for arm in figures:
        for f in figures[arm].values():
            f["tokens_per_round"] = round(f["tokens"] / max(1, f["rounds"]), 3)
            f["decode_tok_s"] = round(f["tokens"] / f.pop("decode_s"), 2)
    return figures


def replay(engine, texts: list[str], reference: dict, history: bool, cap: int = 16) -> dict:
    """Greedy decoding's rounds with lookup as the drafter, computed from the greedy outputs:
    each round drafts after the committed tokens and accepts the draft's agreeing prefix plus one."""
    from engine.drafters.lookup import LookupDrafter
    from engine.drafters.suffix import SuffixIndex

    index, figures = SuffixIndex(), {}
    for phase, system in (("fresh", SYSTEMS[0]), ("repeat", SYSTEMS[1])):
        rounds = tokens = drafted = accepted = 0
        for text in texts:
            prompt, out = engine.encode(text, system=system), reference[(phase, text)]
            drafter = LookupDrafter(history=index if history else None)
            drafter.begin(prompt, None)
            ids, pos = prompt + out[:1], 1
            while pos < len(out):
                room = min(cap, len(out) - pos - 1)  # the loop's cap: the last token comes from the target
                draft = drafter.propose(ids, room, None) if room else None
                guess = draft.tokens.tolist()[:room] if draft is not None else []
                n = next((i for i, t in enumerate(guess) if t != out[pos + i]), len(guess))
                ids += out[pos: pos + n + 1]
                pos += n + 1
                drafter.commit(ids, n + 1, None)
                rounds, drafted, accepted = rounds + 1, drafted + len(guess), accepted + n
            tokens += len(out) - 1
            index.add(prompt + out)
        figures[phase] = {"tokens_per_round": round(tokens / max(1, rounds), 3), "drafted": drafted,
                          "accepted": accepted}
    return figures


def _history_counts(engine) -> tuple[int, int]:
    """(rounds, tokens) drafted from the history so far by the lookups inside the engine's drafters."""
    drafters = [d for d in engine._drafters.values() if d is not None]
    drafters += [made[1] for made in getattr(engine, "_auto_drafters", {}).values() if made[1] is not None]
    lookups = {id(getattr(d, "lookup", d)): getattr(d, "lookup", d) for d in drafters}
    return (sum(getattr(d, "from_history", 0) for d in lookups.values()),
            sum(getattr(d, "history_tokens", 0) for d in lookups.values()))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=4, help="prompts in all, or per class with --classes")
    p.add_argument("--classes", default=None,
                   help="prompts of these shipped classes or Spec-Bench categories (chat,code,math,...), mixed "
                        "in one session, with figures per class too")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--arms", default="baseline,context,history,dspark,dspark+history,auto")
    p.add_argument("--reps", type=int, default=2, help="sessions run; each request's fastest decode counts")
    p.add_argument("--replay", action="store_true", help="exact offline tokens per round of lookup too")
    p.add_argument("--factors", default="1,2", help="SPEC_FACTOR values --replay tries (the shipped one first)")
    p.add_argument("--reference", default=None, metavar="FILE",
                   help="keep plain greedy outputs here and reuse them (the baseline pass is the slow part)")
    args = p.parse_args()
    from engine.api import load

    engine = load()
    engine.configure_prefix_cache(False)
    classes = prompts(args.prompts, args.classes)
    texts = list(classes)
    t0 = time.perf_counter()
    saved = Path(args.reference) if args.reference else None
    stored = json.loads(saved.read_text()) if saved is not None and saved.exists() else {}
    if stored.get("key") != [texts, args.tokens]:
        stored = {"key": [texts, args.tokens], "outputs": [], "tok_s": 0.0}
        base_toks = base_s = 0.0
        for phase, system in (("fresh", SYSTEMS[0]), ("repeat", SYSTEMS[1])):
            for text in texts:
                r = engine.generate(text, system=system, mode="baseline", max_new_tokens=args.tokens,
                                    prefix_cache=False)
                stored["outputs"].append([phase, text, r.token_ids])
                base_toks += r.generated - 1
                base_s += r.decode_s
        stored["tok_s"] = round(base_toks / base_s, 2)
        if saved is not None:
            saved.write_text(json.dumps(stored))
    reference = {(phase, text): ids for phase, text, ids in stored["outputs"]}
    out = {"model": engine.name, "prompts": len(texts), "max_new_tokens": args.tokens,
           "baseline_decode_tok_s": stored["tok_s"], "arms": {}}
    if args.replay:
        from engine.drafters import suffix

        shipped = suffix.SPEC_FACTOR
        out["replay"] = {"context": replay(engine, texts, reference, history=False)}
        for factor in (float(f) for f in args.factors.split(",")):
            suffix.SPEC_FACTOR = factor
            out["replay"][f"history, {factor:g} per matched token"] = replay(engine, texts, reference, history=True)
        suffix.SPEC_FACTOR = shipped
        print("replay", json.dumps(out["replay"]), file=sys.stderr, flush=True)
    arms = [a for a in args.arms.split(",") if a]
    if arms:
        out["reps"] = args.reps
        out["arms"] = run_arms(engine, arms, texts, args.tokens, reference, args.reps,
                               classes if args.classes else None)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
