"""What penalties, logit_bias and logprobs cost in decode speed (a benchmark, not a test: pytest
does not collect it).

    PYTHONPATH=$PWD python tests/bench_processors.py [--model starter|tiny] [--reps 5] [--tokens 128]
        [--modes baseline,lookup] [--json out.json]
    PYTHONPATH=$PWD python tests/bench_processors.py --isolated   # the per-step costs alone

Per mode, the same prompts run with nothing, with the penalties and a logit_bias, with
top-5 logprobs, and with both; each figure is the median over ``--reps`` repeats of the prompts
(settings interleaved per prompt, so a busy machine slows them alike), with the ratio against the
same mode without them: decode tok/s (wall clock), and tokens per CPU-second of the whole
generation (this process's CPU time, every thread: steadier than the wall clock on a shared
machine, the same prefill in every setting).

``--isolated`` times the pieces instead, each the minimum over many trials (what a busy machine
cannot inflate): one target forward of R rows (R = 1: a plain step; 9 and 17: verifies) after a
prompt, and the processing of R rows of the target's vocabulary (penalties and bias with drafts
in the history, top-5 logprobs, both), with the share of a step the processing adds. Greedy, so the token sequences of a mode are compared too (penalties
change them; logprobs alone must not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

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


def best_of(fn, trials: int) -> float:
    """Seconds of the fastest of ``trials`` calls (after one untimed)."""
    fn()
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def isolated(engine, trials: int) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from engine.processors import LogitsProcessor, Processing

    prompt = engine.encode(PROMPTS[0])
    output = [int(t) for t in engine.generate(PROMPTS[0], mode="baseline", max_new_tokens=48).token_ids]
    ids = prompt + output
    cache = make_prompt_cache(engine.model)
    mx.eval(engine.model(mx.array([ids]), cache=cache))
    rows_out = []
    for rows in (1, 9, 17):
        x = mx.array([ids[-rows:]])

        def forward():
            mx.eval(engine.model(x, cache=cache))
            trim_prompt_cache(cache, rows)

        logits = engine.model(x, cache=cache)[0]
        trim_prompt_cache(cache, rows)
        mx.eval(logits)
        drafts = mx.array(ids[-rows + 1:] if rows > 1 else [], dtype=mx.uint32)
        row = {"rows": rows, "forward_ms": best_of(forward, trials) * 1e3}
        for name in ("penalties+bias", "logprobs", "both"):
            proc = LogitsProcessor(Processing(**{k: v for k, v in SETTINGS[name].items()}), prompt)
            proc.rows(logits, ids)  # its counts, once (a decode keeps them between steps)

            def process():
                x = proc.rows(logits, ids, drafts if rows > 1 else None)
                mx.eval(x)
                proc.logprobs(x, ids[-rows:])

            row[name + "_ms"] = best_of(process, trials) * 1e3
        rows_out.append(row)
    return rows_out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="starter", choices=("starter", "tiny"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--modes", default="baseline,lookup")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"a subset of {', '.join(SETTINGS)} (none first)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts to run")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--isolated", action="store_true", help="time a forward and the processing alone")
    p.add_argument("--trials", type=int, default=30)
    args = p.parse_args(argv)
    engine = engine_for(args.model)
    if args.isolated:
        rows = isolated(engine, args.trials)
        print(f"{engine.name}: fastest of {args.trials} (ms); processing share = processing / (forward + processing)")
        for r in rows:
            print(f"  {r['rows']:2d} rows: forward {r['forward_ms']:7.2f} | " + " | ".join(
                f"{name} {r[name + '_ms']:6.3f} ({r[name + '_ms'] / (r['forward_ms'] + r[name + '_ms']):.1%})"
                for name in ("penalties+bias", "logprobs", "both")))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": engine.name, "trials": args.trials, "rows": rows}, f, indent=1)
        return 0
    engine.configure_prefix_cache(False)  # every run prefills: decode speed only is compared
    engine.suffix_index = None  # and lookup drafts from the context alone (not from the earlier runs)
    modes = args.modes.split(",")
    settings = {name: SETTINGS[name] for name in args.settings.split(",")}
    for mode in modes:  # warm the shapes once
        engine.generate(PROMPTS[0], mode=mode, max_new_tokens=16)
    speeds = {(m, s): [] for m in modes for s in settings}
    cpu_speeds = {(m, s): [] for m in modes for s in settings}
    tokens = {}
    prompts = PROMPTS[: args.prompts]
    for rep in range(args.reps):
        done = {key: [0, 0.0, 0.0, []] for key in speeds}  # tokens, decode seconds, CPU seconds, token ids
        for prompt in prompts:  # settings interleaved per prompt: a busy machine slows them alike
            for mode in modes:
                for name, kw in settings.items():
                    cpu = time.process_time()
                    r = engine.generate(prompt, mode=mode, max_new_tokens=args.tokens, **kw)
                    acc = done[mode, name]
                    acc[0] += r.generated - 1
                    acc[1] += r.decode_s
                    acc[2] += time.process_time() - cpu
                    acc[3].append(r.token_ids)
        for key, (n, seconds, cpu_seconds, ids) in done.items():
            speeds[key].append(n / seconds)
            cpu_speeds[key].append(n / cpu_seconds)
            tokens[key] = ids
        print(f"  rep {rep}: " + ", ".join(f"{m}/{s} {speeds[m, s][-1]:.1f}" for m, s in speeds), file=sys.stderr,
              flush=True)
    out = {"model": engine.name, "tokens": args.tokens, "reps": args.reps, "rows": []}
    print(f"{engine.name}: decode tok/s, median of {args.reps} (greedy, {len(prompts)} prompts x {args.tokens} tokens)")
    for mode in modes:
        base = statistics.median(speeds[mode, "none"])
        cpu_base = statistics.median(cpu_speeds[mode, "none"])
        for name in settings:
            tps, cpu_tps = statistics.median(speeds[mode, name]), statistics.median(cpu_speeds[mode, name])
            same = tokens[mode, name] == tokens[mode, "none"]
            print(f"  {mode:9s} {name:15s} {tps:8.1f} tok/s x{tps / base:.3f} | {cpu_tps:7.2f} tok/CPU-s "
                  f"x{cpu_tps / cpu_base:.3f} | same tokens as none: {same}")
            out["rows"].append({"mode": mode, "setting": name, "tok_s": round(tps, 2), "ratio": round(tps / base, 4),
                                "tok_per_cpu_s": round(cpu_tps, 3), "cpu_ratio": round(cpu_tps / cpu_base, 4),
                                "same_tokens": same})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
