"""One request of the concurrent benchmark, alone, in each mode at fixed caps and each dtype:
where a mode's greedy tokens leave plain decoding's, the clean forward's top three there, in
that dtype and in float32. Written for the RAG request #3 that sessions 7-13 saw diverge at
token 40 on an H100 in bf16 (three tokens within three bf16 units): is a speculative path wrong,
or is it the bf16 rounding of the forward's order?

    python3 tests/device/divergence_probe.py --gguf STARTER.gguf [--cls rag] [--index 3]
        [--dtypes bfloat16,float32] [--modes baseline,lookup@4,dspark@4,dspark@8] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import time

from engine.api import load
from engine.benchmark import clean_top, first_divergence, is_near_tie
from engine.prompts import CLASSES, load_prompts, load_spec_bench


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--cls", default="rag")
    ap.add_argument("--index", type=int, default=3)
    ap.add_argument("--per-class", type=int, default=4, help="prompts loaded for the class (the benchmark's four)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--modes", default="baseline,lookup@4,dspark@4,dspark@8")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    load_class = load_prompts if args.cls in CLASSES else load_spec_bench
    prompt = [p for k, p in load_class([args.cls], args.per_class) if k == args.cls][args.index]
    engines = {dtype: load(args.gguf, dtype=dtype) for dtype in args.dtypes.split(",")}
    out: dict = {"cls": args.cls, "index": args.index, "runs": {}, "divergences": []}
    for dtype, eng in engines.items():
        ids = eng.encode(prompt)
        runs = {}
        for spec in args.modes.split(","):
            mode, _, cap = spec.partition("@")
            eng.generate(ids, mode=mode, max_new_tokens=8, max_draft=int(cap) if cap else None)  # warm
            t0 = time.perf_counter()
            r = eng.generate(ids, mode=mode, max_new_tokens=args.max_new_tokens, max_draft=int(cap) if cap else None)
            runs[spec] = r.token_ids
            print(f"{dtype} {spec}: {len(r.token_ids)} tokens in {time.perf_counter() - t0:.2f} s", flush=True)
        out["runs"][dtype] = runs
        base = runs[args.modes.split(",")[0]]
        for spec, tokens in runs.items():
            i = first_divergence(base, tokens)
            if i is None:
                continue
            where = ids + base[:i]
            d = {"dtype": dtype, "mode": spec, "index": i, "baseline_token": base[i], "mode_token": tokens[i],
                 "top3": {}}
            for dt, e in engines.items():
                d["top3"][dt], native = clean_top(e, where, 3)
                if dt == dtype:
                    d["near_tie"] = is_near_tie(d["top3"][dt][0][1], d["top3"][dt][1][1], native)
            out["divergences"].append(d)
            print(f"{dtype} {spec} leaves {args.modes.split(',')[0]} at token {i}: {base[i]} vs {tokens[i]}; "
                  + "; ".join(f"clean {dt} top3 " + ", ".join(f"{t}:{v:.4f}" for t, v in top)
                              for dt, top in d["top3"].items()), flush=True)
    for spec in args.modes.split(","):  # each mode across dtypes: where does bf16 leave float32?
        if len(engines) > 1:
            a, b = (out["runs"][dt][spec] for dt in list(engines)[:2])
            print(f"{spec}: {list(engines)[0]} vs {list(engines)[1]} first differ at {first_divergence(a, b)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
