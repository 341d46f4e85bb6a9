"""Where a decode step and a speculative round go on the CPU backend, and what this branch's
CPU-step work buys: the starter model (SmolLM2-135M, dense float32 + OpenBLAS), one process,
arms interleaved, medians over repeats.

    PYTHONPATH=$PWD .venv/bin/python tests/peer/cpu_step.py [--tokens 64] [--repeats 5] [--context 400]

Tables:
1. plain greedy decoding, tok/s and share of the memory roofline (engine/roofline.py): Tandem's
   baseline with skinny matmuls (engine/skinny_gemm.py) and compiled small forwards
   (engine/compiled.py) on and off, and ``mlx_lm.generate``'s loop on the same model and prompt;
2. one step's anatomy: graph build (Python) vs the whole step, MLX graph nodes per token;
3. the verify-cost curve (one forward of W rows on a warm cache) with skinny matmuls on and off;
4. a lookup round on a copy-heavy prompt: the round vs its target forward; the rest (drafting,
   commit, rollback, events, detokenizer, stop matcher) is the engine's overhead;
5. attention's share of a W-row forward (the forward timed with attention replaced by a stand-in
   that returns its queries, its keys and values still computed: a cost split, not a model), and what one ``mx.exp`` costs per
   element on this backend (every attention score goes through one in the softmax).
6. plain greedy decoding after synthetic prompts of 32 to 1024 tokens: how a step grows with the
   context (attention's small products through OpenBLAS once woke its threads against the pool).
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Callable

import engine  # noqa: F401,I001  (OpenBLAS and the skinny matmuls load before mlx.core)
import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import trim_prompt_cache

from engine import platform, sampling
from engine.api import load
from engine.roofline import RooflineModel, measure_bandwidth

CHAT = "Write a short story about a robot who learns to paint."
COPY = ("Repeat this code exactly:\n\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n\ndef is_prime(n):\n    if n < 2:\n        return False\n"
        "    for d in range(2, int(n ** 0.5) + 1):"
        "\n        if n % d == 0:\n            return False\n    return True\n")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def graph_nodes(target, cache, token: int) -> int:
    """Primitives in one step's graph as MLX exports it (the plain path: compiled functions
    export their inner graphs too, so this counts what the plain step launches)."""
    off = target.compiled_off
    target.compiled_off = "counting"
    try:
        logits, _ = target.forward(mx.array([[token]], dtype=mx.uint32), cache, last_only=True)
        with tempfile.NamedTemporaryFile(suffix=".dot") as f:
            mx.export_to_dot(f.name, mx.argmax(logits[-1]))
            nodes = len(re.findall(r'label ="[A-Za-z]', open(f.name).read()))
    finally:
        target.compiled_off = off
        trim_prompt_cache(cache, 1)
    return nodes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="new tokens per decoding run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--context", type=int, default=100, help="tokens of context for the verify-cost curve")
    p.add_argument("--tables", default="123456", help="which tables to print, e.g. 3 for the verify-cost curve")
    args = p.parse_args(argv)

    eng = load()
    target = eng.target
    compiled_off = target.compiled_off
    blas = platform.blas_status()
    bandwidth = measure_bandwidth()
    roof = RooflineModel.from_engine(eng, bandwidth)
    chat = eng.encode(CHAT)
    print(f"{eng.name} on {platform.device_name()} | MLX {mx.__version__} | BLAS {blas.state} | skinny matmuls "
          f"{blas.skinny} | compiled small forwards {compiled_off or 'on'} | OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')} | load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"roofline: {roof.weight_bytes / 1e6:.0f} MB weights/token, copy bandwidth {bandwidth / 1e9:.1f} GB/s -> "
          f"ceiling {roof.ceiling_tps(len(chat) + args.tokens // 2):.1f} tok/s at {len(chat) + args.tokens // 2} "
          f"tokens")

    def configure(skinny: bool, compiled: bool) -> None:
        platform.skinny_matmuls(skinny)
        target.compiled_off = compiled_off if compiled else "off for the comparison"

    if "1" in args.tables:
        plain_decoding(eng, chat, args, configure, roof)
    if "2" in args.tables:
        step_anatomy(target, chat, args, configure)
    if "3" in args.tables:
        verify_curve(eng, args, configure)
    if "4" in args.tables:
        lookup_round(eng, target, args)
    if "5" in args.tables:
        attention_share(eng, args)
    if "6" in args.tables:
        decode_by_context(eng, args)
    return 0


def plain_decoding(eng, chat: list[int], args, configure, roof) -> None:
    def tandem(n: int) -> float:
        r = eng.generate(chat, mode="baseline", max_new_tokens=n)
        return r.decode_tps

    def mlx_lm(n: int) -> float:
        start = count = None
        for count, _ in enumerate(stream_generate(eng.model, eng.tokenizer, chat, max_tokens=n), 1):
            if count == 1:
                start = time.perf_counter()
        return (count - 1) / (time.perf_counter() - start)

    arms = {
        "tandem baseline (skinny + compiled)": (tandem, True, True),
        "tandem baseline, skinny only": (tandem, True, False),
        "tandem baseline, compiled only": (tandem, False, True),
        "tandem baseline, neither (main)": (tandem, False, False),
        "mlx_lm.generate, skinny": (mlx_lm, True, True),
        "mlx_lm.generate, OpenBLAS gemm": (mlx_lm, False, True),
    }
    results: dict[str, list[float]] = {name: [] for name in arms}
    for name, (fn, skinny, compiled) in arms.items():  # warm-up
        configure(skinny, compiled)
        fn(8)
    names = list(arms)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fn, skinny, compiled = arms[name]
            configure(skinny, compiled)
            results[name].append(fn(args.tokens))
    configure(True, True)
    context = len(chat) + args.tokens // 2
    ref = results["tandem baseline, neither (main)"]
    print(f"\n1. plain greedy decoding, {args.tokens} tokens x {args.repeats} repeats")
    print(f"{'arm':<38}{'tok/s':>8}{'ms/token':>10}{'x roof':>8}{'x main':>8}")
    for name, tps in results.items():
        ratio = med([a / b for a, b in zip(tps, ref)])
        print(f"{name:<38}{med(tps):8.1f}{1000 / med(tps):10.1f}{roof.fraction(med(tps), context):8.2f}{ratio:8.2f}")



def step_anatomy(target, chat: list[int], args, configure) -> None:
    cache = target.new_cache()
    target.prefill(chat, cache)
    token = chat[-1]
    step = {}
    for rep in range(max(9, args.repeats * 3)):
        for skinny, compiled in ((True, True), (False, False)):
            configure(skinny, compiled)
            t0 = time.perf_counter()
            logits, _ = target.forward(mx.array([[token]], dtype=mx.uint32), cache, last_only=True)
            y = mx.argmax(logits[-1])
            t1 = time.perf_counter()
            y.item()
            t2 = time.perf_counter()
            trim_prompt_cache(cache, 1)
            step.setdefault((skinny, compiled, "build"), []).append(t1 - t0)
            step.setdefault((skinny, compiled, "step"), []).append(t2 - t0)
    configure(True, True)
    print("\n2. one decode step (synchronous, no pipelining)")
    print(f"{'configuration':<38}{'step ms':>9}{'graph build ms':>16}")
    for skinny, compiled, label in ((True, True, "skinny + compiled"), (False, False, "neither (main)")):
        print(f"{label:<38}{med(step[(skinny, compiled, 'step')]) * 1e3:9.1f}"
              f"{med(step[(skinny, compiled, 'build')]) * 1e3:16.2f}")
    print(f"MLX graph nodes per token (plain path): {graph_nodes(target, cache, token)}; host syncs per token: 1 "
          f"(the token read; baseline queues the next step first)")


def timed_forwards(eng, args, widths: tuple[int, ...], arms: dict[str, Callable[[], None]]) -> tuple[dict, int]:
    """One forward of W rows on a warm cache at ``--context`` tokens, per arm (its setup called
    first), interleaved over ``max(5, --repeats)`` repeats: ({(W, arm): [seconds]}, context).

    Each timed forward follows an untimed one of the same width and arm: the first forward after
    a switch otherwise pays for the last arm's threads (OpenBLAS's spin on after its gemm, against
    the skinny pool) and, once per width, for tracing the compiled pieces."""
    target = eng.target
    long_prompt = eng.encode(CHAT * (1 + args.context // 12))[-args.context:]
    cache = target.new_cache()
    target.prefill(long_prompt, cache)
    times: dict[tuple[int, str], list[float]] = {}

    def forward(ids: mx.array, w: int) -> float:
        t0 = time.perf_counter()
        logits, _, txn = target.verify(ids, cache)
        mx.eval(logits)
        elapsed = time.perf_counter() - t0
        txn.commit(1 if w == 1 else 0)  # a one-row forward keeps its row (context grows by a few)
        return elapsed

    for rep in range(max(5, args.repeats)):
        for w in widths:
            ids = mx.array([long_prompt[-w:]], dtype=mx.uint32)
            for arm, setup in arms.items():
                setup()
                forward(ids, w)
                times.setdefault((w, arm), []).append(forward(ids, w))
    return times, len(long_prompt)


def verify_curve(eng, args, configure) -> None:
    """One forward of W rows on a warm cache: skinny matmuls split over the BLAS thread count,
    the same on one thread, and OpenBLAS's gemm; x step = the cost over a baseline step (W=1)."""
    widths = (1, 2, 3, 4, 6, 8, 9, 16)
    threads = platform.skinny_threads()

    def setting(skinny: bool, count: int) -> Callable[[], None]:
        def setup() -> None:
            configure(skinny, True)
            platform.skinny_threads(count)
        return setup

    arms = {f"skinny x{threads}": setting(True, threads), "skinny x1": setting(True, 1), "gemm": setting(False, threads)}
    try:
        curve, context = timed_forwards(eng, args, widths, arms)
    finally:
        configure(True, True)
        platform.skinny_threads(threads)
    step = med(curve[(1, f"skinny x{threads}")])
    print(f"\n3. verify cost: one forward of W rows at {context} tokens of context "
          f"(ms; x step = over a baseline step, W=1 skinny, {step * 1e3:.1f} ms)")
    print(f"{'W':>4}" + "".join(f"{arm:>14}{'x step':>8}" for arm in arms))
    for w in widths:
        print(f"{w:4d}" + "".join(f"{med(curve[(w, arm)]) * 1e3:14.1f}{med(curve[(w, arm)]) / step:8.2f}"
                                  for arm in arms))


def decode_by_context(eng, args) -> None:
    from engine.calibrate import synthetic_prompt

    print(f"\n6. plain greedy decoding by context, {args.tokens} tokens after a synthetic prompt, median of {args.repeats}")
    print(f"{'prompt':>8}{'tok/s':>9}{'ms/token':>10}")
    for n in (32, 128, 256, 512, 1024):
        ids = synthetic_prompt(eng.target.vocab_size, n)
        runs = [eng.generate(ids, mode="baseline", max_new_tokens=args.tokens, prefix_cache=False,
                             chat_template=False) for _ in range(args.repeats)]
        ms = med([1000.0 * r.decode_s / max(1, r.generated) for r in runs])
        print(f"{n:>8}{1000.0 / ms:>9.1f}{ms:>10.1f}")


def attention_share(eng, args) -> None:
    """Table 5: a forward of W rows with the model's attention and with a stand-in, and mx.exp's rate."""
    target = eng.target
    module = sys.modules[type(target.model).__module__]
    attention = getattr(module, "scaled_dot_product_attention", None)
    if attention is None:
        print(f"\n5. skipped: {module.__name__} calls no scaled_dot_product_attention")
        return
    widths = (1, 4, 8, 16)

    def stand_in(queries, keys, values, *a, **kw):  # still reads keys and values: the cache writes stay in the graph
        return queries + 0 * (keys[:, :1, -1:, :1] + values[:, :1, -1:, :1])

    def using(fn: Callable) -> Callable[[], None]:
        return lambda: setattr(module, "scaled_dot_product_attention", fn)

    try:
        times, context = timed_forwards(eng, args, widths, {"as is": using(attention), "no attention": using(stand_in)})
    finally:
        module.scaled_dot_product_attention = attention
    x = mx.random.normal((1 << 20,))
    mx.eval(x)
    rate = {}
    for name, op in (("exp", mx.exp), ("multiply", lambda a: a * a)):
        runs = []
        for _ in range(max(5, args.repeats)):
            t0 = time.perf_counter()
            mx.eval(op(x))
            runs.append(time.perf_counter() - t0)
        rate[name] = med(runs) / x.size * 1e9
    heads = getattr(getattr(target.model, "args", None), "num_attention_heads", 0)
    print(f"\n5. attention's share of a forward of W rows at {context} tokens of context (ms)")
    print(f"{'W':>4}{'as is':>10}{'no attention':>14}{'attention':>11}{'share':>7}{'softmax exps':>14}")
    for w in widths:
        full, bare = med(times[(w, "as is")]), med(times[(w, "no attention")])
        exps = target.num_layers * heads * w * context
        print(f"{w:4d}{full * 1e3:10.1f}{bare * 1e3:14.1f}{(full - bare) * 1e3:11.1f}{(full - bare) / full:7.0%}"
              f"{exps:14,d}")
    print(f"mx.exp: {rate['exp']:.1f} ns per element (a multiply: {rate['multiply']:.2f}); the softmax exps above at "
          f"that rate take {target.num_layers * heads * 8 * context * rate['exp'] / 1e6:.1f} ms of the "
          f"8-row forward")


def lookup_round(eng, target, args) -> None:
    spent = {"forward": 0.0}
    real_forward, real_accept = target.forward, sampling.accept_greedy

    def timed_forward(*a, **kw):
        t0 = time.perf_counter()
        try:
            return real_forward(*a, **kw)
        finally:
            spent["forward"] += time.perf_counter() - t0

    def timed_accept(*a, **kw):  # the sync: the forward's compute finishes in here
        t0 = time.perf_counter()
        try:
            return real_accept(*a, **kw)
        finally:
            spent["forward"] += time.perf_counter() - t0

    copy = eng.encode(COPY)
    eng.generate(copy, mode="lookup", max_new_tokens=8)
    rows = []
    target.forward, sampling.accept_greedy = timed_forward, timed_accept
    try:
        for rep in range(args.repeats):
            spent["forward"] = 0.0
            first: list[float] = []
            r = eng.generate(copy, mode="lookup", max_new_tokens=args.tokens * 2,
                             on_round=lambda ev: first.append(spent["forward"]) if ev.index == 0 else None)
            rounds = len(r.rounds) - 1
            forward_s = spent["forward"] - first[0]  # after the prefill's token, like decode_s
            rows.append((r.decode_s / rounds, forward_s / rounds, r.mean_accepted, r.decode_tps))
    finally:
        target.forward, sampling.accept_greedy = real_forward, real_accept
    round_s, forward_s = med([x[0] for x in rows]), med([x[1] for x in rows])
    print(f"\n4. lookup on a copy prompt, {args.tokens * 2} tokens x {args.repeats} repeats (medians)")
    print(f"round {round_s * 1e3:.1f} ms = target forward (graph build + compute + sync) {forward_s * 1e3:.1f} ms + "
          f"engine overhead {(round_s - forward_s) * 1e3:.2f} ms ({(round_s - forward_s) / round_s:.1%} of a round); "
          f"{med([x[2] for x in rows]):.2f} tokens/round, {med([x[3] for x in rows]):.1f} tok/s")


if __name__ == "__main__":
    sys.exit(main())
