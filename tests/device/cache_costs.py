"""Cache-transaction costs on a GPU (MLX CUDA): hybrid and sliding-window targets, self-contained.

Not a pytest module: the lead runs it on the H200 device machine (no network, no ../shared). It
needs mlx (CUDA backend), mlx-lm, numpy; it reads nothing outside this repository and writes one
JSON, ``cache_costs.json``, to ``$OUT`` (default ./out), saved after every part.

Targets, random weights in the real shapes (costs depend on shapes, not values), bf16 then
4-bit (``nn.quantize``, group 64):
* ``qwen3.5-9b``: Qwen3.5-9B text (qwen3_5: 24 GatedDeltaNet + 8 full-attention layers);
* ``gemma3-12b``: Gemma-3-12B text (gemma3_text: 40 sliding-window layers of 1024 + 8 global).

For each, on a warm ~1.5k-token context (so the 1024-token windows have wrapped):
* ``verify_ms``: one verify forward of width 1..16 (calibrate.measure_verify: the verify
  transaction, rolled back after each);
* ``rollback``: for 8- and 16-row verifies and each accepted length, the verify forward's ms
  and the commit's ms (its lazy work evaluated), per recurrent rollback method: ``states``
  (per-position states: the verify runs the recurrence position by position) and ``replay``
  (the commit re-runs the recurrent mixers on the kept rows); the sliding target's commit
  slices its windows;
* ``decode``: tok/s of baseline, n-gram lookup (cap 16 and ``--max-draft auto`` after a short
  calibration), and an oracle drafter that proposes the target's own greedy continuation
  (a zero-cost drafter like lookup: acceptance forced to 1.0, or ~0.6 by corrupting drafts)
  at caps 4/8/16; for the hybrid, the oracle rounds under both rollback methods. Random
  weights rarely repeat themselves, so the oracle is what makes speculation measurable.
* ``--parts starter-overhead``: the transaction's own cost per round on the real starter
  model (this machine's backend): lookup rounds on a copy prompt with the transaction and
  with the old unchecked trim, and the transaction alone (marks + commit) in microseconds.

On the H200 (MLX staged by ../shared/device/stage-mlx-cuda.sh, as for h200_costs.py)::

    bash .devB/install.sh && export PYTHONPATH=/root/site:. PYTHONUNBUFFERED=1 &&
    python3 tests/device/cache_costs.py

It takes about 4 minutes and stops starting new parts after ``--budget`` seconds (330).
``--tiny`` runs the same code on toy shapes (a CPU check of the script, ~1 minute);
``--small`` on mid-size shapes (the CPU figures of the report).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
os.environ.setdefault("TANDEM_CACHE_DIR", tempfile.mkdtemp(prefix="tandem-cache-costs-"))  # fresh calibrations

import engine  # noqa: E402,F401  (OpenBLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from engine import caches  # noqa: E402
from engine import calibrate as C  # noqa: E402
from engine.drafters.base import Draft, Drafter  # noqa: E402
from engine.drafters.lookup import LookupDrafter  # noqa: E402
from engine.generate import Engine  # noqa: E402

QWEN35_9B = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=256, vocab_size=248320, rms_norm_eps=1e-6,
                 linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                 tie_word_embeddings=False, max_position_embeddings=262144,
                 rope_parameters={"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 10000000,
                                  "partial_rotary_factor": 0.25})
GEMMA3_12B = dict(hidden_size=3840, num_hidden_layers=48, intermediate_size=15360, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, vocab_size=262208, rope_theta=1e6,
                  rope_local_base_freq=1e4, query_pre_attn_scalar=256, sliding_window=1024,
                  sliding_window_pattern=6, max_position_embeddings=131072,
                  rope_scaling={"factor": 8.0, "rope_type": "linear"})
SHRINK = {  # --tiny / --small: the same code on smaller shapes
    "tiny": dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, vocab_size=1024, head_dim=32,
                 num_attention_heads=4, num_key_value_heads=2, linear_num_value_heads=4, linear_num_key_heads=2,
                 linear_key_head_dim=32, linear_value_head_dim=32, sliding_window=64, full_attention_interval=2,
                 sliding_window_pattern=2),
    "small": dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=3072, vocab_size=32000, head_dim=128,
                  num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16, linear_num_key_heads=8,
                  linear_key_head_dim=64, linear_value_head_dim=64, sliding_window=512, sliding_window_pattern=4),
}


class IdTokenizer:
    """Enough of a tokenizer for token-id prompts on random-weight targets."""

    eos_token_ids: list[int] = []
    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


class Oracle(Drafter):
    """Proposes the target's own greedy continuation (known from a baseline run), each token
    replaced with probability ``corrupt``: a zero-cost drafter with a chosen acceptance."""

    name = "oracle"

    def __init__(self, prompt_len: int, truth: list[int], corrupt: float = 0.0, max_draft: int = 16, seed: int = 0):
        self.prompt_len, self.truth, self.corrupt, self.max_draft = prompt_len, truth, corrupt, max_draft
        self.key = mx.random.key(seed)

    def propose(self, ids, cap, sampler):
        at = len(ids) - self.prompt_len
        tokens = self.truth[at : at + cap]
        if not tokens:
            return None
        if self.corrupt:
            self.key, sub = mx.random.split(self.key)
            flip = (mx.random.uniform(shape=(len(tokens),), key=sub) < self.corrupt).tolist()
            tokens = [(t + 1) if f else t for t, f in zip(tokens, flip)]
        return Draft(mx.array(tokens, dtype=mx.uint32))


def build(kind: str, shape: dict, dtype: mx.Dtype) -> nn.Module:
    if kind == "qwen3.5":
        from mlx_lm.models import qwen3_5 as mod

        args = mod.ModelArgs(model_type="qwen3_5", text_config=dict(shape, model_type="qwen3_5_text"))
    else:
        from mlx_lm.models import gemma3_text as mod

        args = mod.ModelArgs.from_dict(dict(shape, model_type="gemma3_text"))
    mx.random.seed(0)
    model = mod.Model(args)
    model.set_dtype(dtype)  # cast lazily, before the float32 init is materialised
    mx.eval(model.parameters())
    model.eval()
    return model


def quantize(model: nn.Module, bits: int) -> nn.Module:
    nn.quantize(model, group_size=64, bits=bits,
                class_predicate=lambda _p, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0)
    mx.eval(model.parameters())
    return model


def cache_arrays(cache: list) -> list[mx.array]:
    return [a for c in caches.leaves(cache) for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000.0, 3)


def rollback_part(eng: Engine, cache: list, ids: list[int], methods: list[str], reps: int, log) -> dict:
    """Verify ms and commit ms per (method, width, kept) on the warm ``cache`` (restored after
    each); the methods interleaved, so a machine's drift hits them alike."""
    target = eng.target
    out: dict = {m: {} for m in methods}
    for width in (8, 16):
        for kept in (range(1, width + 1) if width == 8 else (1, 2, 4, 8, 12, 16)):
            samples = {m: ([], []) for m in methods}
            for rep in range(reps + 1):
                for method in methods:
                    if target.recorder is not None:
                        target.recorder.method = method
                    save = caches.Savepoint(cache)
                    t0 = time.perf_counter()
                    logits, _, txn = target.verify(mx.array([ids[:width]]), cache)
                    mx.eval(logits, *cache_arrays(cache))
                    t1 = time.perf_counter()
                    txn.commit(kept)
                    mx.eval(*cache_arrays(cache))
                    t2 = time.perf_counter()
                    save.rollback()
                    if rep:  # the first is a warm-up
                        samples[method][0].append(t1 - t0)
                        samples[method][1].append(t2 - t1)
            for method, (verify_s, commit_s) in samples.items():
                v, c = median_ms(verify_s), median_ms(commit_s)
                out[method][f"{width}/{kept}"] = {"verify_ms": v, "commit_ms": c, "round_ms": round(v + c, 3)}
    for method, rows in out.items():
        log(f"  rollback {method}: " + ", ".join(f"{k} v{v['verify_ms']:.1f}+c{v['commit_ms']:.1f}"
                                                 for k, v in rows.items() if k.startswith("8/")))
    return out


def decode_part(eng: Engine, prompt: list[int], new_tokens: int, methods: list[str], log) -> dict:
    """tok/s of baseline, lookup (cap 16 and auto) and the oracle at forced acceptance."""
    target = eng.target

    def run(mode: str, drafter: Drafter | None = None, cap=None) -> dict:
        if drafter is not None:
            eng.set_drafter(mode, drafter)
        res = eng.generate(prompt, mode=mode, max_new_tokens=new_tokens, max_draft=cap)
        spec = res.rounds[1:]
        return {"tok_s": round(res.decode_tps, 2), "tokens": res.generated, "rounds": len(spec),
                "tokens_per_round": round(res.mean_accepted, 3),
                "ms_per_round": round(1000 * res.decode_s / max(1, len(spec)), 3), "token_ids": res.token_ids}

    out: dict = {}
    out["baseline"] = base = run("baseline")
    truth = base.pop("token_ids")
    log(f"  baseline {base['tok_s']} tok/s")
    for name, cap in (("lookup/16", 16), ("lookup/auto", "auto")):
        if cap == "auto":  # a short calibration first (cached), so auto does not measure mid-run
            C.calibrate(eng, "lookup", eng.drafter("lookup"), passes=2, overhead_rounds=6)
        r = out[name] = run("lookup", LookupDrafter(), cap)
        r["same_as_baseline"] = r.pop("token_ids") == truth
        log(f"  {name}: {r['tok_s']} tok/s, {r['tokens_per_round']} tokens/round")
    for method in methods:
        if target.recorder is not None:
            target.recorder.method = method
        for corrupt, caps in ((0.0, (4, 8, 16)), (0.15, (8,))):
            for cap in caps:
                name = f"oracle/{method}/p{1 - corrupt:.2f}/cap{cap}"
                r = out[name] = run("lookup", Oracle(len(prompt), truth, corrupt, seed=cap), cap)
                r["same_as_baseline"] = r.pop("token_ids") == truth
                log(f"  {name}: {r['tok_s']} tok/s, {r['tokens_per_round']} tokens/round, {r['ms_per_round']} ms/round")
    eng.set_drafter("lookup", LookupDrafter())
    return out


def target_part(kind: str, shape: dict, dtype: mx.Dtype, bits: int | None, context: int, new_tokens: int, reps: int,
                log, holder: dict, decode: bool = True) -> dict:
    t0 = time.perf_counter()
    model = holder.get(kind) or build(kind, shape, dtype)
    if bits:
        model = quantize(model, bits)
        holder.pop(kind, None)  # quantized in place
    else:
        holder[kind] = model
    eng = Engine(model, IdTokenizer(), name=f"{kind}-random{'-q4' if bits else ''}")
    target = eng.target
    out: dict = {"build_s": round(time.perf_counter() - t0, 2), "caches": target.describe_caches(),
                 "speculation_blocker": target.speculation_blocker()}
    log(f"  {out['caches']} (built in {out['build_s']}s)")
    methods = ["states", "replay"] if target.recorder is not None else ["slice"]
    ids = C.synthetic_prompt(target.vocab_size, context)
    cache = target.new_cache()
    t1 = time.perf_counter()
    target.prefill(ids, cache)
    mx.eval(*cache_arrays(cache))
    out["prefill_s"] = round(time.perf_counter() - t1, 3)
    probe = ids[-64:]
    widths = list(range(1, 17))
    for method in methods:
        if target.recorder is not None:
            target.recorder.method = method
        ms = C.measure_verify(target, cache, probe, widths, passes=reps)
        out.setdefault("verify_ms", {})[method] = dict(zip(map(str, widths), (round(v, 3) for v in ms)))
        log(f"  verify ms ({method}): " + " ".join(f"{w}:{v:.1f}" for w, v in zip(widths, ms)))
    out["rollback"] = rollback_part(eng, cache, probe, methods, reps, log)
    del cache
    if decode:
        out["decode"] = decode_part(eng, ids[: min(len(ids), 1024)], new_tokens, methods, log)
    if target.recorder is not None:
        target.recorder.method = "states"
    return out


def starter_overhead(rounds: int, log) -> dict:
    """The transaction's share of a lookup round on the real starter (full attention)."""
    from mlx_lm.models.cache import trim_prompt_cache

    from engine.api import load
    from engine.target import Target

    eng = load()
    text = ("def add(a, b):\n    return a + b\n\n" * 40)
    prompt = list(eng.tokenizer.encode(text))
    verify = Target.verify

    class Untracked:  # the old rollback: an unchecked trim
        def __init__(self, cache, width):
            self.cache, self.width = cache, width

        def commit(self, kept):
            trim_prompt_cache(self.cache, self.width - kept)

    def plain(self, ids, cache, *, tap=False):
        logits, hidden = self.forward(ids, cache, tap=tap)
        return logits, hidden, Untracked(cache, int(ids.shape[1]))

    out: dict = {}
    for label in ("transaction", "plain trim", "transaction", "plain trim"):
        Target.verify = verify if label == "transaction" else plain
        try:
            res = eng.generate(prompt, mode="lookup", max_new_tokens=rounds, max_draft=16, chat_template=False)
        finally:
            Target.verify = verify
        per_round = 1000 * res.decode_s / max(1, len(res.rounds) - 1)
        out.setdefault(label, []).append(round(per_round, 3))
        log(f"  {label}: {per_round:.2f} ms/round ({res.mean_accepted:.2f} tokens/round)")
    cache = eng.target.new_cache()
    eng.target.prefill(prompt, cache)
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        txn = caches.Verify(cache, 9)
        for c in caches.leaves(cache):  # as if the verify appended 9 rows (offsets only)
            c.offset += 9
        txn.commit(3)
        for c in caches.leaves(cache):
            c.offset -= 3
    out["transaction_us"] = round((time.perf_counter() - t0) / n * 1e6, 2)
    rounds_ms = statistics.median(out["transaction"])
    out["transaction_share"] = round(out["transaction_us"] / 1000 / rounds_ms, 5)
    log(f"  transaction alone: {out['transaction_us']} us per round = {100 * out['transaction_share']:.3f}% of a round")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "./out"), help="folder for cache_costs.json (default $OUT)")
    ap.add_argument("--parts", default="qwen3.5-9b,gemma3-12b", help="also: starter-overhead")
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=330.0, help="start no new part after this many seconds")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--bits", default="16,4", help="weight precisions to run: 16 (--dtype) and/or 4")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode part (curves and rollback only)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="toy shapes: a CPU check of the script")
    size.add_argument("--small", action="store_true", help="mid-size shapes (CPU figures)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args), "errors": {}}

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {text}", flush=True)

    def save() -> None:
        (out_dir / "cache_costs.json").write_text(json.dumps(result, indent=1, default=str))

    def attempt(name: str, fn) -> None:
        if time.perf_counter() - started > args.budget:
            result["errors"][name] = f"skipped: over the {args.budget:.0f}s budget"
            log(result["errors"][name])
            return
        log(f"=== {name}")
        try:
            result[name] = fn()
        except Exception as err:  # keep the other parts' figures
            result["errors"][name] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
            log(result["errors"][name])
        save()

    from engine import platform

    result["machine"] = {"device": platform.device_name(), "backend": platform.backend(), "mlx": mx.__version__}
    log(json.dumps(result["machine"]))
    size = "tiny" if args.tiny else "small" if args.small else None
    context = min(args.context, 160) if args.tiny else args.context
    new_tokens = min(args.new_tokens, 24) if args.tiny else args.new_tokens
    parts = args.parts.split(",")
    for kind, name, shape in (("qwen3.5", "qwen3.5-9b", QWEN35_9B), ("gemma3", "gemma3-12b", GEMMA3_12B)):
        if name not in parts:
            continue
        shape = dict(shape, **{k: v for k, v in SHRINK.get(size, {}).items() if k in shape})
        holder: dict = {}
        for bits in [None if b == 16 else b for b in map(int, args.bits.split(","))]:
            attempt(f"{name}-{f'q{bits}' if bits else args.dtype}",
                    lambda: target_part(kind, shape, getattr(mx, args.dtype), bits, context, new_tokens, args.reps,
                                        log, holder, decode=not args.no_decode))
        holder.clear()
    if "starter-overhead" in parts:
        attempt("starter-overhead", lambda: starter_overhead(48 if args.tiny else 160, log))
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    result["seconds"] = round(time.perf_counter() - started, 1)
    save()
    log(f"wrote {out_dir / 'cache_costs.json'}")
    return 1 if any(not e.startswith("skipped") for e in result["errors"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
