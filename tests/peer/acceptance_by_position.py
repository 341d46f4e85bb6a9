"""Tokens per round by position in the answer: where a drafter's rounds commit few tokens (a dev tool).

The starter with a DSpark drafter, greedy, its full block (no confidence cut, no lookup first),
on the shipped held-out prompts; each round is counted at the answer position it starts from.
The shipped drafter's chat rounds commit 1.75-2.0 tokens over an answer's first 128 tokens and
5.9 past 256 (long answers repeat themselves), which is why ``tandem benchmark`` at 128 tokens
reads chat far below ``val_walk`` over whole answers (``val_walk128`` is the training-side twin):

    .venv/bin/python tests/peer/acceptance_by_position.py [--drafter resources:drafters/smollm2-135m-dspark]
        [--per-class 6] [--max-new-tokens 512]

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine  # noqa: E402,F401  (OpenBLAS before mlx.core)
import engine.api as tandem  # noqa: E402
from engine.prompts import load_prompts  # noqa: E402

EDGES = (0, 16, 32, 64, 128, 256, 512, 1024)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default="resources:drafters/smollm2-135m-dspark")
    p.add_argument("--per-class", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--cap", type=int, default=7)
    args = p.parse_args()
    eng = tandem.load(drafter=args.drafter, confidence_threshold=0.0, lookup_first=False)
    table: dict[str, dict[int, list[int]]] = {}
    for cls, prompt in load_prompts(per_class=args.per_class):
        r = tandem.generate(eng, prompt, mode="dspark", max_new_tokens=args.max_new_tokens, max_draft=args.cap)
        position = 1  # the first token is the prefill's
        for _, accepted in r.rounds[1:]:
            start = max(e for e in EDGES if position >= e)
            cell = table.setdefault(cls, {}).setdefault(start, [0, 0])
            cell[0] += 1
            cell[1] += accepted + 1
            position += accepted + 1
        print(f"{cls}: {len(r.token_ids)} tokens, {r.mean_accepted:.2f} tokens/round", flush=True)
    starts = [e for e in EDGES if any(e in row for row in table.values())]
    print("\ntokens/round (rounds) by the answer position a round starts from")
    print(f"{'class':<6}" + "".join(f"{f'{a}-{b}':>14}" for a, b in zip(starts, EDGES[1:])))
    for cls, row in table.items():
        cells = [f"{row[s][1] / row[s][0]:.2f} ({row[s][0]})" if s in row else "" for s in starts]
        print(f"{cls:<6}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
