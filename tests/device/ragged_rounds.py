"""What a batched round costs on this machine when only one row drafts, three ways.

A batched verify pads every row to the widest row's width (engine/batch.py), so in a batch of four
where one row drafts 7 tokens the forward carries 32 rows of which 11 are real. On a CPU the
forward's time follows the rows it carries, so such a round costs several plain steps. Two ways
around the padding are timed here beside it, each on the starter's real forwards over slot
buffers of a given context:

  plain       the batch's plain step: 4 rows x 1
  padded      4 rows x W, as the batch runs a round today
  packed      the same [4, W] forward with every linear (and the tied head) run only on the real
              rows (gathered before the product, spread back after) and attention split into runs
              of rows with equal real widths: what a ragged verify saves without new kernels
  split       the plain step of all 4 rows, then the drafting row's drafts verified alone (one
              row x k over its own slot): two forwards, no padding

Each line prints the median ms (arms interleaved, ``--reps`` rounds) and the break-even: how many
of the drafting row's drafts must be kept for the round to commit tokens as fast as plain steps
(the round commits one token per row plus the kept drafts; ``B * ms / plain - B``).

    PYTHONPATH=$PWD python3 tests/device/ragged_rounds.py --contexts 300,1800 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import lru_cache

import engine  # noqa: F401  (first: it sets up the CPU's BLAS before MLX loads)
import mlx.core as mx
import mlx.nn as nn

from engine import api, platform
from engine.benchmark import arm_order
from engine.prompts import load_spec_bench
from engine.slot_kv import Slots

ROWS = 4


class Packing:
    """Which rows of a [B, W] forward are real: row b's first ``counts[b]``."""

    def __init__(self, counts: list[int], width: int):
        self.shape = (len(counts), width)
        keep, spread = [], []
        for b, c in enumerate(counts):
            start = len(keep)
            keep.extend(b * width + i for i in range(c))
            spread.extend(start + min(i, c - 1) for i in range(width))
        self.keep, self.spread = mx.array(keep, dtype=mx.uint32), mx.array(spread, dtype=mx.uint32)
        self.runs: list[tuple[int, int, int]] = []  # (first row, end row, real width)
        for b, c in enumerate(counts):
            if self.runs and self.runs[-1][2] == c:
                self.runs[-1] = (self.runs[-1][0], b + 1, c)
            else:
                self.runs.append((b, b + 1, c))


ACTIVE: list[Packing | None] = [None]


def _packed(x: mx.array, fn) -> mx.array:
    p = ACTIVE[0]
    if p is None or x.ndim != 3 or tuple(x.shape[:2]) != p.shape:
        return fn(x)
    y = fn(mx.take(x.reshape(-1, x.shape[-1]), p.keep, axis=0)[None])
    return mx.take(y[0], p.spread, axis=0).reshape(*p.shape, y.shape[-1])


@lru_cache(maxsize=None)
def _packed_class(cls: type) -> type:
    if issubclass(cls, nn.Embedding):
        return type(f"Packed{cls.__name__}", (cls,), {"as_linear": lambda self, x: _packed(x, lambda v: cls.as_linear(self, v))})
    return type(f"Packed{cls.__name__}", (cls,), {"__call__": lambda self, x: _packed(x, lambda v: cls.__call__(self, v))})


def _split_attention(original):
    def attend(queries, keys, values, *args, mask=None, **kwargs):
        p = ACTIVE[0]
        if p is None or (queries.shape[0], queries.shape[2]) != p.shape or not isinstance(mask, mx.array) or mask.ndim != 4:
            return original(queries, keys, values, *args, mask=mask, **kwargs)
        width, parts = p.shape[1], []
        for b0, b1, c in p.runs:
            part = original(queries[b0:b1, :, :c], keys[b0:b1], values[b0:b1], *args, mask=mask[b0:b1, :, :c], **kwargs)
            if c < width:
                part = mx.concatenate([part, mx.zeros((*part.shape[:2], width - c, part.shape[3]), part.dtype)], axis=2)
            parts.append(part)
        return mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    return attend


def install(model: nn.Module) -> None:
    for _, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.__class__ = _packed_class(type(module))
        home = sys.modules.get(type(module).__module__)
        fn = getattr(home, "scaled_dot_product_attention", None)
        if fn is not None and not getattr(fn, "split", False):
            wrapped = _split_attention(fn)
            wrapped.split = True
            home.scaled_dot_product_attention = wrapped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="300,1800")
    ap.add_argument("--drafts", default="3,7,15", help="the drafting row's drafts k (width k + 1)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    eng = api.load()
    target = eng.target
    install(target.model)
    text_ids = eng.tokenizer.encode(" ".join(p for _, p in load_spec_bench(["summarization", "rag"], 4)))
    report = {"device": platform.device_name(), "backend": mx.default_device().type.name, "rows": ROWS, "contexts": {}}
    for context in (int(c) for c in args.contexts.split(",")):
        if len(text_ids) < context + 8 * ROWS:
            raise SystemExit(f"the shipped prompts hold {len(text_ids)} tokens, fewer than a {context}-token context needs")
        caches = []
        for b in range(ROWS):
            cache = target.new_cache()
            target.prefill(text_ids[b * 7 : b * 7 + context], cache)
            caches.append(cache)
        slots = Slots()
        for cache in caches:
            slots.join(cache)

        def batch(width: int, counts: list[int] | None = None) -> None:
            ids = mx.array([[5 + b + i for i in range(width)] for b in range(ROWS)], dtype=mx.uint32)
            ACTIVE[0] = Packing(counts, width) if counts else None
            try:
                logits, _, txns = target.verify_rows(ids, caches)
                mx.eval(logits)
            finally:
                ACTIVE[0] = None
            for txn in txns:
                txn.commit(1 if width == 1 else 0)
            if width == 1:  # keep the context where it was
                for cache in caches:
                    for c in cache:
                        c.trim(1)

        def split(k: int) -> None:
            batch(1)
            logits, _, txn = target.verify(mx.array([[7 + i for i in range(max(k, 2))]], dtype=mx.uint32), caches[0])
            mx.eval(logits)
            txn.commit(0)

        arms = {"plain": lambda: batch(1)}
        for k in (int(x) for x in args.drafts.split(",")):
            w = k + 1
            arms[f"padded k={k}"] = lambda w=w: batch(w)
            arms[f"packed k={k}"] = lambda w=w: batch(w, [w] + [1] * (ROWS - 1))
            arms[f"split k={k}"] = lambda k=k: split(k)
        names = list(arms)
        for fn in arms.values():
            fn()
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.reps):
            for n in (names[i] for i in arm_order(len(names), r, 0, 1)):
                t0 = time.perf_counter()
                arms[n]()
                times[n].append(1000 * (time.perf_counter() - t0))
        ms = {n: statistics.median(t) for n, t in times.items()}
        plain = ms["plain"]
        rows = {n: {"ms": round(v, 1), "steps": round(v / plain, 2), "break_even_kept": round(ROWS * v / plain - ROWS, 1)}
                for n, v in ms.items()}
        report["contexts"][context] = rows
        for n, row in rows.items():
            print(f"context {context:5d}  {n:12s} {row['ms']:7.1f} ms  {row['steps']:5.2f} steps  "
                  f"break-even: {row['break_even_kept']:5.1f} drafts kept", flush=True)
        for cache in caches:
            slots.leave(cache)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
