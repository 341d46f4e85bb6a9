"""What penalties, logit_bias and logprobs cost in decode speed (a benchmark, not a test: pytest
does not collect it).

    PYTHONPATH=$PWD python tests/bench_processors.py [--model starter|tiny] [--reps 5] [--tokens 128]
        [--modes baseline,lookup] [--json out.json]

Per mode, the same prompts run with nothing, with the penalties and a logit_bias, with
top-5 logprobs, and with both; each figure is the median decode tok/s over ``--reps`` repeats of
the prompts (interleaved, so a busy machine slows every setting alike), and the ratio against
the same mode without them. Greedy, so the token sequences of a mode are compared too (penalties
change them; logprobs alone must not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SETTINGS = {
    "none": {},
    "penalties+bias": dict(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1,
                           logit_bias={7: -100.0, 11: 2.0}),
    "logprobs": dict(logprobs=5),
    "both": dict(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={7: -100.0, 11: 2.0},
                 logprobs=5),
}
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests.",
    "Summarise in five bullet points why speculative decoding keeps the output of the target model.",
    "Repeat this list twice, numbered: apples, pears, plums, cherries, grapes, lemons, limes, figs.",
]


def engine_for(name: str):
    if name == "tiny":
        from tests.tiny import make_tiny_engine

        return make_tiny_engine("llama", seed=0, layers=4, hidden=256)
    from engine.api import load

    return load()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="starter", choices=("starter", "tiny"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--modes", default="baseline,lookup")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts to run")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    engine = engine_for(args.model)
    engine.configure_prefix_cache(False)  # every run prefills: decode speed only is compared
    engine.suffix_index = None  # and lookup drafts from the context alone (not from the earlier runs)
    modes = args.modes.split(",")
    for mode in modes:  # warm the shapes once
        engine.generate(PROMPTS[0], mode=mode, max_new_tokens=16)
    speeds = {(m, s): [] for m in modes for s in SETTINGS}
    tokens = {}
    prompts = PROMPTS[: args.prompts]
    for rep in range(args.reps):
        done = {key: [0, 0.0, []] for key in speeds}  # tokens, seconds, token ids
        for prompt in prompts:  # settings interleaved per prompt: a busy machine slows them alike
            for mode in modes:
                for name, kw in SETTINGS.items():
                    r = engine.generate(prompt, mode=mode, max_new_tokens=args.tokens, **kw)
                    acc = done[mode, name]
                    acc[0] += r.generated - 1
                    acc[1] += r.decode_s
                    acc[2].append(r.token_ids)
        for key, (n, seconds, ids) in done.items():
            speeds[key].append(n / seconds)
            tokens[key] = ids
        print(f"  rep {rep}: " + ", ".join(f"{m}/{s} {speeds[m, s][-1]:.1f}" for m, s in speeds), file=sys.stderr,
              flush=True)
    out = {"model": engine.name, "tokens": args.tokens, "reps": args.reps, "rows": []}
    print(f"{engine.name}: decode tok/s, median of {args.reps} (greedy, {len(prompts)} prompts x {args.tokens} tokens)")
    for mode in modes:
        base = statistics.median(speeds[mode, "none"])
        for name in SETTINGS:
            tps = statistics.median(speeds[mode, name])
            same = tokens[mode, name] == tokens[mode, "none"]
            print(f"  {mode:9s} {name:15s} {tps:8.1f} tok/s  x{tps / base:.3f}  same tokens as none: {same}")
            out["rows"].append({"mode": mode, "setting": name, "tok_s": round(tps, 2), "ratio": round(tps / base, 4),
                                "same_tokens": same})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
