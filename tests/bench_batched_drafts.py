"""What a batch's draft costs when its rows propose together (``propose_rows``: one head forward
for every row) against one proposal per row (a benchmark, not a test: pytest does not collect it).

    PYTHONPATH=$PWD python tests/bench_batched_drafts.py [--model PATH] [--dtype D] [--rows 1,2,4]
        [--trials 20] [--draft-model PATH] [--json out.json]

The starter (or ``--model``, e.g. its GGUF) with its DSpark drafter, or with ``--draft-model`` that
draft model (its caches fed up to each row's anchor first, so a proposal feeds the anchor and
drafts), on this machine's backend and dtype policy (or ``--dtype``). Each row is a
shipped prompt (chat, code, math in turn) prefilled with its drafter begun; then, per row count,
the best of ``--trials`` of: every row proposing alone (greedy, the drafter's full block) and the
rows proposing together, each timed to its evaluated drafts. Both must give the same drafts.
"""

from __future__ import annotations

import argparse
import json
import time

import engine  # noqa: F401  (MLX set up as the product does)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--json")
    args = ap.parse_args()
    import mlx.core as mx

    from engine.api import load
    from engine.prompts import load_prompts
    from engine.sampling import Sampler, SamplingParams

    eng = load(args.model, dtype=args.dtype, draft_model=args.draft_model)
    eng.lookup_first = False  # the model drafter's own proposals (behind lookup, the rows lookup leaves)
    base = eng.drafter("draft" if args.draft_model else "dspark")
    target = eng.target
    target.set_taps(base.tap_layers)
    greedy = Sampler(SamplingParams())
    widest = max(int(r) for r in args.rows.split(","))
    per_class = -(-widest // 3)
    prompts = load_prompts(per_class=per_class)
    interleaved = [prompts[c * per_class + i] for i in range(per_class) for c in range(3)]  # chat, code, math, ...
    rows = []
    for _, text in interleaved[:widest]:
        ids = list(eng.encode(text))
        d = base.fork()
        _, hidden = target.prefill(ids[:-1], target.new_cache(), tap=True)
        d.begin(ids[:-1], hidden)
        d.catch_up(ids)  # a draft model's prompt (the others have none to feed)
        rows.append((d, ids))

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(args.trials):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    report = {"device": str(mx.default_device()), "dtype": str(eng.target.dtype) if hasattr(eng.target, "dtype") else None,
              "drafter": base.name, "max_draft": base.max_draft, "rows": {}}
    print(f"{'rows':>4} {'alone ms':>9} {'together ms':>12} {'ratio':>6}")
    for n in (int(r) for r in args.rows.split(",")):
        group = rows[:n]

        def alone():
            drafts = [d.propose(ids, d.max_draft, greedy) for d, ids in group]
            mx.eval([x.tokens for x in drafts])
            return drafts

        def together():
            drafts = type(base).propose_rows([(d, ids, d.max_draft, greedy) for d, ids in group])
            mx.eval([x.tokens for x in drafts])
            return drafts

        same = [a.tokens.tolist() for a in alone()] == [t.tokens.tolist() for t in together()]
        a, t = best(alone) * 1e3, best(together) * 1e3
        report["rows"][n] = {"alone_ms": a, "together_ms": t, "same_drafts": same}
        print(f"{n:>4} {a:9.2f} {t:12.2f} {a / t:6.2f}{'' if same else '  (drafts differ)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
