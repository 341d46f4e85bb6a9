"""How many tokens the starter's drafter would commit per full block, by the target's and the
drafter's precision: separates a precision loss in the drafter from a different target
continuation (the H200 runs commit fewer tokens per round in float16 than in bfloat16).

    python3 tests/device/drafter_precision.py --gguf STARTER.gguf --targets bfloat16,float16 --json OUT.json

For each target precision and each drafter precision (the target's, and float32), greedy
decoding of the first ``--prompts`` mt-bench prompts: every ``--every`` tokens the drafter
proposes a full block (no confidence cut) and the script counts how many of its tokens the
target's own greedy continuation confirms. Also: how many tokens the shipped confidence cut keeps
of each block, how many blocks it cuts to nothing, and blocks whose states are not finite.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

import engine.api as api
import engine.drafters.checkpoint as checkpoint
from engine.drafters.dspark import confident_prefix
from engine.prompts import load_prompts
from engine.sampling import Sampler, SamplingParams


def measure(gguf: str | None, target_dtype: str, drafter_dtype: str | None, prompts: list[str], tokens: int,
            every: int) -> dict:
    original = checkpoint.compute_dtype
    if drafter_dtype is not None:
        checkpoint.compute_dtype = lambda target: getattr(mx, drafter_dtype)
    try:
        eng = api.load(gguf, drafter="resources:drafters/smollm2-135m-dspark", dtype=target_dtype)
        target = eng.target
        drafter = eng.drafter("dspark")
        drafter = getattr(drafter, "model_drafter", drafter)  # lookup-first wraps it
    finally:
        checkpoint.compute_dtype = original
    drafter.trace = []  # proposals keep the full block and record every slot's confidence
    rule, threshold = drafter.cut()  # the shipped cut, applied to the recorded confidences
    target.set_taps(drafter.tap_layers)
    greedy = Sampler(SamplingParams(temperature=0.0))
    committed, blocks, not_finite, kept, empty = 0, 0, 0, 0, 0
    for text in prompts:
        ids = eng.encode(text)
        cache = target.new_cache()
        logits, hidden = target.prefill(ids, cache, tap=True)
        drafter.begin(ids, hidden)
        ids = list(ids) + [int(mx.argmax(logits).item())]
        proposals = []
        for step in range(tokens):
            if step % every == 0:
                states = drafter.block_states(ids)
                not_finite += not bool(mx.all(mx.isfinite(states.astype(mx.float32))).item())
                draft = drafter.propose(ids, drafter.max_draft, greedy)
                keep = confident_prefix(mx.array(drafter.trace[-1]), threshold, rule)
                kept += keep
                empty += keep == 0
                proposals.append((len(ids), draft.tokens.tolist() if draft is not None else []))
            step_logits, tapped = target.forward(mx.array([[ids[-1]]], dtype=mx.uint32), cache, last_only=True,
                                                 tap=True)
            ids.append(int(mx.argmax(step_logits[-1]).item()))
            drafter.commit(ids, 1, tapped)
        for pos, draft in proposals:
            k = 0
            while k < len(draft) and pos + k < len(ids) and draft[k] == ids[pos + k]:
                k += 1
            committed += k + 1  # the target's own token after the accepted ones
            blocks += 1
    return {"target": target_dtype, "drafter": str(drafter.dtype).replace("mlx.core.", ""),
            "tokens_per_block": round(committed / max(blocks, 1), 3), "blocks": blocks, "not_finite": not_finite,
            "kept_by_cut": round(kept / max(blocks, 1), 3), "cut_to_nothing": empty,
            "cut": [rule, threshold]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None, help="the starter GGUF (default: the built-in starter)")
    ap.add_argument("--targets", default="bfloat16,float16")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompts = [text for _, text in load_prompts(["chat"], args.prompts)]  # mt-bench's first turns
    rows = []
    for target_dtype in args.targets.split(","):
        for drafter_dtype in (None, "float32"):
            t0 = time.perf_counter()
            row = measure(args.gguf, target_dtype, drafter_dtype, prompts, args.tokens, args.every)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
