"""Where a multi-row verify's time goes on a GPU: the H200 calibrations price a 2-row verify of
the starter at about twice a plain step (bf16: 8.3 against 4.2 ms; 4-8 rows cost the same as 2),
so a round must keep ~1.4 drafts just to break even.

    python3 tests/device/verify_width.py --gguf STARTER.gguf --dtype bfloat16 --json OUT.json

All arms of a table run interleaved ``--reps`` times, as the benchmark's are (rotated, reversed
every other repetition: ``engine.benchmark.arm_order``), because the H200's timings drift by up
to 2x between minutes and arms timed one after another are not comparable; each figure is the
median ms of one call.

Whole forwards on a 180-token context (each trimmed back after), W = 2, 4, 8 rows:
  step                  one row, as a plain step runs it
  verify-W              W rows as the loop runs them now (stable shapes: the padded buffer with
                        an additive mask made once per forward; engine.cuda_skinny's matmuls)
  cublas-verify-W       the same with cuBLAS's matmuls (the skinny kernel off)
  boolmask-verify-W     cuBLAS and a bool mask, which MLX converts in every layer (as shipped before)
  exact-W               cuBLAS on a plain mlx-lm cache (keys sliced to the offset, causal mask)
Pieces, each a chain of one forward's count (30 layers):
  gemm-W                the 7 matmuls of a layer at W rows through MLX (gemv at 1 row, cuBLAS above)
  skinny-W              the same products through engine.cuda_skinny
  sdpa-W-{bool,additive,causal}  attention of W query rows over a 1024-row buffer with a bool or an
                        additive mask, or over the exact keys with a causal mask
And the largest logit gap between an 8-row verify and the same rows as plain steps, each way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from engine import api, cuda_skinny, shapes
from engine.benchmark import arm_order
from engine.prompts import load_prompts

WIDTHS = (2, 4, 8)


def race(arms: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median ms per call of each arm, the arms interleaved as the benchmark's are."""
    names = list(arms)
    for fn in arms.values():
        fn()  # warm: the first call of a shape builds its kernels and graph
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for n in (names[i] for i in arm_order(len(names), r, 0, 1)):
            t0 = time.perf_counter()
            arms[n]()
            times[n].append(1000 * (time.perf_counter() - t0))
    return {n: round(statistics.median(t), 3) for n, t in times.items()}


def forward_arm(target, cache, ids: mx.array, skinny: bool = True, additive: bool = True) -> Callable[[], None]:
    def run() -> None:
        installed, plain_additive = target.skinny_off, shapes.additive
        if not skinny:
            target.skinny_off = "off for this arm"
        if not additive:
            shapes.additive = lambda mask, dtype: mask
        try:
            logits, _ = target.forward(ids, cache)
            mx.eval(logits)
        finally:
            target.skinny_off, shapes.additive = installed, plain_additive
        for c in cache:
            c.trim(ids.shape[1])
    return run


def step_gap(target, cache, rows: mx.array, skinny: bool) -> float:
    """Largest |logit| gap between one forward of ``rows`` and the same rows as plain steps."""
    steps = []
    for i in range(rows.shape[1]):
        logits, _ = target.forward(rows[:, i:i + 1], cache)
        steps.append(logits)
    mx.eval(steps)
    for c in cache:
        c.trim(rows.shape[1])
    installed = target.skinny_off
    target.skinny_off = installed if skinny else "off"
    together, _ = target.forward(rows, cache)
    mx.eval(together)
    target.skinny_off = installed
    for c in cache:
        c.trim(rows.shape[1])
    return float(mx.abs(together.astype(mx.float32) - mx.concatenate(steps).astype(mx.float32)).max().item())


def in_dim(m: nn.Module) -> int:
    return m.weight.shape[1] * 32 // m.bits if isinstance(m, nn.QuantizedLinear) else m.weight.shape[1]


def piece_arms(layer: nn.Module, dtype: mx.Dtype, n_layers: int) -> dict[str, Callable[[], None]]:
    arms: dict[str, Callable[[], None]] = {}
    mats = [m for _, m in layer.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.Linear))]
    skinny = not cuda_skinny.available() and all(type(m.weight) is mx.array and m.weight.dtype == dtype for m in mats)
    for w in (1,) + WIDTHS:
        inputs = {in_dim(m): mx.random.normal((1, w, in_dim(m))).astype(dtype) for m in mats}
        mx.eval(list(inputs.values()))
        arms[f"gemm-{w}"] = lambda inputs=inputs: mx.eval([mx.matmul(inputs[in_dim(m)], m.weight.T) if isinstance(m, nn.Linear)
                                                           else m(inputs[in_dim(m)]) for _ in range(n_layers) for m in mats])
        if w > 1 and skinny:
            arms[f"skinny-{w}"] = lambda inputs=inputs: mx.eval([cuda_skinny.skinny_matmul(inputs[in_dim(m)], m.weight)
                                                                 for _ in range(n_layers) for m in mats])
    attn = layer.self_attn
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    dim = attn.o_proj.weight.shape[0] // heads if isinstance(attn.o_proj, nn.Linear) else 64
    offset, capacity = 180, 1024
    k = mx.random.normal((1, kv_heads, capacity, dim)).astype(dtype)
    v = mx.random.normal((1, kv_heads, capacity, dim)).astype(dtype)
    scale = dim ** -0.5
    for w in (1,) + WIDTHS:
        q = mx.random.normal((1, heads, w, dim)).astype(dtype)
        bool_mask = shapes.capacity_mask(offset, w, capacity)
        add_mask = shapes.additive(bool_mask, dtype)
        mx.eval(q, k, v, bool_mask, add_mask)
        for name, mask in (("bool", bool_mask), ("additive", add_mask)):
            arms[f"sdpa-{w}-{name}"] = lambda q=q, mask=mask: mx.eval(
                [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask) for _ in range(n_layers)])
        end = offset + w
        arms[f"sdpa-{w}-causal"] = lambda q=q, end=end, w=w: mx.eval(
            [mx.fast.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], scale=scale,
                                                  mask="causal" if w > 1 else None) for _ in range(n_layers)])
    return arms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    eng = api.load(args.gguf, dtype=args.dtype)
    target = eng.target
    (_, prompt), = load_prompts(["chat"], 1)
    ids = (eng.encode(prompt) * 8)[:180]
    dtype = next(p.dtype for _, p in tree_flatten(target.model.parameters())
                 if p.dtype in (mx.bfloat16, mx.float16, mx.float32))
    result: dict = {"dtype": args.dtype, "skinny": target.skinny_off or "on", "shapes": target.shapes is not None,
                    "context": len(ids), "reps": args.reps}
    rows = mx.array([ids[:8]])
    stable = target.new_cache()
    target.prefill(ids, stable)
    exact = make_prompt_cache(target.model)
    target.prefill(ids, exact)
    arms = {"step": forward_arm(target, stable, rows[:, :1])}
    for w in WIDTHS:
        arms[f"verify-{w}"] = forward_arm(target, stable, rows[:, :w])
        arms[f"cublas-verify-{w}"] = forward_arm(target, stable, rows[:, :w], skinny=False)
        arms[f"boolmask-verify-{w}"] = forward_arm(target, stable, rows[:, :w], skinny=False, additive=False)
        arms[f"exact-{w}"] = forward_arm(target, exact, rows[:, :w], skinny=False)
    result["forwards"] = race(arms, args.reps)
    result["pieces"] = race(piece_arms(target.layers[0], dtype, len(target.layers)), args.reps)
    result["step_gap_8"] = {"verify": step_gap(target, exact, rows, skinny=True),
                            "cublas": step_gap(target, exact, rows, skinny=False)}
    for key, value in result.items():
        if isinstance(value, dict):
            print(key + ": " + "  ".join(f"{k} {v}" for k, v in value.items()))
        else:
            print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
