"""Suffix drafts across requests on the real starter model (a benchmark, not a test: pytest does not
collect it).

    PYTHONPATH=$PWD python tests/bench_suffix.py [--prompts 6] [--tokens 96] [--arms context,history,...]

A repeated-request session: each prompt (shipped humaneval and mt-bench turns) is asked once, then
again under another system prompt (the same question in a new session: the answer is mostly the
earlier one, but the context is not). Figures are for the second pass, per arm:

* context: n-gram lookup on the current context only (``--no-suffix-drafts``);
* history: lookup with the index of earlier requests (what ``--mode lookup`` runs);
* dspark: the starter's DSpark drafter alone, no lookup;
* dspark+history: the same with the history first where it is confident (``modes.history_first``,
  what ``--mode auto`` runs for a pair whose row has no ``lookup_first``);
* auto: ``--mode auto`` as shipped (the starter's row: DSpark behind lookup, history included).

``fresh`` is the first pass (only earlier prompts of that pass to match): the arms must not be slower
there. Every arm's output is checked against plain greedy decoding. The machine may be shared: ratios
matter.

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


def prompts(n: int) -> list[str]:
    out = []
    for name in ("humaneval", "mt-bench"):
        with open(ROOT / "resources" / "prompts" / f"{name}.jsonl") as f:
            out += [json.loads(line)["turns"][0] for line in f][: (n + 1) // 2]
    return out[:n]


def arm_drafter(engine, arm: str):
    """(mode, drafter) of an arm; the drafter is set for that mode on the engine."""
    from engine import modes

    if arm in ("context", "history"):
        return "lookup", engine.drafter("lookup")
    if arm == "auto":
        return "auto", None
    saved = engine.lookup_first
    engine.lookup_first = False  # the DSpark drafter alone
    dspark = engine.drafter("dspark")
    engine.lookup_first = saved
    if arm == "dspark":
        engine.set_drafter("dspark", dspark)
        return "dspark", dspark
    engine.lookup_first = None
    wrapped = modes.history_first(engine, dspark)
    engine.lookup_first = saved
    engine.set_drafter("dspark", wrapped)
    return "dspark", wrapped


def run_arm(engine, arm: str, texts: list[str], tokens: int, reference: dict) -> dict:
    from engine.benchmark import forget_earlier_requests

    forget_earlier_requests(engine)
    keep, drafters = engine.suffix_index, dict(engine._drafters)
    if arm == "context":
        engine.suffix_index = None
    mode, _ = arm_drafter(engine, arm)
    figures = {}
    try:
        for phase, system in (("fresh", SYSTEMS[0]), ("repeat", SYSTEMS[1])):
            rounds = toks = forwards = 0
            decode_s = 0.0
            hist_rounds = hist_tokens = 0
            same = True
            for text in texts:
                drafter = engine.drafter(mode) if mode != "auto" else None
                before = _history_counts(engine, mode)
                r = engine.generate(text, system=SYSTEMS[0] if phase == "fresh" else system, mode=mode,
                                    max_new_tokens=tokens, prefix_cache=False)
                after = _history_counts(engine, mode)
                hist_rounds += after[0] - before[0]
                hist_tokens += after[1] - before[1]
                same &= r.token_ids == reference[(phase, text)]
                rounds += len(r.rounds) - 1
                forwards += r.target_forwards
                toks += r.generated - 1
                decode_s += r.decode_s
                del drafter
            figures[phase] = {"tokens_per_round": round(toks / max(1, rounds), 3), "target_forwards": forwards,
                              "decode_tok_s": round(toks / decode_s, 2) if decode_s else 0.0,
                              "history_rounds": hist_rounds, "history_tokens": hist_tokens, "same_as_greedy": same}
    finally:
        engine.suffix_index = keep
        engine._drafters.clear()
        engine._drafters.update(drafters)
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


def _history_counts(engine, mode: str) -> tuple[int, int]:
    """(rounds, tokens) drafted from the history so far by the lookup inside ``mode``'s drafter."""
    total = [0, 0]
    drafters = [d for d in engine._drafters.values() if d is not None]
    drafters += [made[1] for made in getattr(engine, "_auto_drafters", {}).values() if made[1] is not None]
    seen = set()
    for d in drafters:
        lookup = getattr(d, "lookup", d)
        if id(lookup) in seen:
            continue
        seen.add(id(lookup))
        total[0] += getattr(lookup, "from_history", 0)
        total[1] += getattr(lookup, "history_tokens", 0)
    return total[0], total[1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--arms", default="context,history,dspark,dspark+history,auto")
    p.add_argument("--replay", action="store_true", help="exact offline tokens per round of lookup too")
    p.add_argument("--factors", default="1,2", help="SPEC_FACTOR values --replay tries (the shipped one first)")
    p.add_argument("--reference", default=None, metavar="FILE",
                   help="keep plain greedy outputs here and reuse them (the baseline pass is the slow part)")
    args = p.parse_args()
    from engine.api import load

    engine = load()
    engine.configure_prefix_cache(False)
    texts = prompts(args.prompts)
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
    for arm in filter(None, args.arms.split(",")):
        out["arms"][arm] = run_arm(engine, arm, texts, args.tokens, reference)
        print(arm, json.dumps(out["arms"][arm]), file=sys.stderr, flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
