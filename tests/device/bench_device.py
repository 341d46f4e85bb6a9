"""Speed on a GPU machine (MLX CUDA): the starter with its drafter, a real draft/target pair, and
random 8B-shaped targets.

Not a pytest module: the lead runs it on the H200 device machine (no network, no ../shared),
staged by ``tests/device/stage_bench.sh``. It writes device-stamped JSON to ``--out`` (``$OUT``)
after every step, so a call stopped at its limit still returns what was measured.

Parts:

* ``starter``: the starter GGUF (``--gguf``) in each ``--dtypes`` (bfloat16 / float16; a GGUF is
  dequantized when it is converted, so the weights are dense), with its shipped DSpark drafter (lookup first, as its registry row
  says). First a compile-storm check, each in a fresh process: the same prompt three times per
  mode (baseline, lookup, dspark@6), first run vs later runs, with the stable-shape policy off
  (``TANDEM_STABLE_SHAPES=0``, the shapes of the code before it) and on. Then ``tandem benchmark``
  (warm-up, calibrations, every arm interleaved) on chat/code/math: baseline, lookup and dspark at
  ``auto`` and at the drafter's full block.
* ``pair``: the built-in Qwen2.5-Coder-1.5B GGUF (``--target``) in each ``--dtypes`` (default
  bfloat16; dense, as every converted GGUF) with the 0.5B GGUF (``--draft``) as its draft model
  (mode ``draft``; the 0.5B loads by the platform's policy, its dtype is recorded). First a check
  on one prompt (baseline vs ``draft@4``: same tokens, acceptance), then ``tandem benchmark`` on
  chat/code/math with traces: baseline, ``baseline-2`` (the A/A noise floor), lookup@auto and
  draft at each ``--draft-caps`` (auto and a fixed 4).
* ``random8b``: Qwen3-8B-shaped targets with random weights (costs depend on shapes, not values),
  bf16 and 4-bit (group 64), generated on the device. Random weights never repeat themselves, so
  n-gram lookup finds nothing: ``lookup@auto`` must park. To force acceptance, an *oracle
  drafter* proposes the target's own greedy continuation (computed by a baseline run first)
  with a seeded fraction of its tokens corrupted: at ``--oracle-accept`` 0.9 per token
  ``draft@auto`` must win on the flat GPU verify curve, at 0.0 (every first draft wrong) it
  must park. Registered as mode ``draft``; calibrated like any drafter.

``--tiny``: the same code on toy shapes and a few tokens, for a CPU dry run of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TANDEM_CACHE_DIR", tempfile.mkdtemp(prefix="tandem-bench-"))

import engine  # noqa: E402,F401  (preloads BLAS on a CPU dry run)
import mlx.core as mx  # noqa: E402

from engine import benchmark as B  # noqa: E402
from engine.drafters.base import Draft, Drafter  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
TINY = dict(QWEN3_8B, hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=512)
STORM_MODES = (("baseline", None), ("lookup", None), ("dspark", 6))


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def stamp() -> dict:
    from engine import platform

    return {"device": platform.device_name(), "backend": platform.backend(), "mlx": mx.__version__,
            "default_device": str(mx.default_device()), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "stable_shapes": os.environ.get("TANDEM_STABLE_SHAPES", "default")}


class Saver:
    def __init__(self, path: Path):
        self.path, self.data = path, {"machine": stamp(), "errors": {}}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def attempt(self, key: str, fn, deadline: float) -> None:
        left = deadline - time.time()
        if left < 20:
            self.data["errors"][key] = f"skipped: {left:.0f} s of the call's budget left"
            log(self.data["errors"][key])
            self.put("skipped", True)
            return
        log(f"=== {key} ({left:.0f} s left)")
        t0 = time.time()
        try:
            self.put(key, fn())
        except Exception as err:  # keep the other parts' figures
            self.data["errors"][key] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
            log(self.data["errors"][key])
            self.put("errors", self.data["errors"])
        log(f"=== {key}: {time.time() - t0:.1f} s")


# ------------------------------------------------------------------ compile-storm check
def storm(model: str, dtype: str, new_tokens: int, prompt: str) -> dict:
    """The same prompt three times per mode in this (fresh) process: decode tok/s of each run."""
    from engine.api import load

    t0 = time.time()
    eng = load(model, dtype=dtype)
    out = {"load_s": round(time.time() - t0, 2), "shapes": str(eng.target.shapes),
           "shapes_refused": eng.target.shapes_refused, "modes": {}}
    for mode, cap in STORM_MODES:
        runs = []
        for _ in range(3):
            t = time.time()
            r = eng.generate(prompt, mode=mode, max_new_tokens=new_tokens, max_draft=cap)
            runs.append({"tok_s": round(r.decode_tps, 2), "decode_s": round(r.decode_s, 3),
                         "wall_s": round(time.time() - t, 3), "tokens": r.generated,
                         "accept_per_round": round(r.mean_accepted, 3)})
        later = [x["tok_s"] for x in runs[1:]]
        out["modes"][f"{mode}@{cap}" if cap else mode] = {
            "runs": runs, "first_over_later": round(runs[0]["tok_s"] / (sum(later) / len(later)), 3) if any(later) else None}
        log(f"storm {dtype} {mode}: " + " / ".join(f"{x['tok_s']:.1f}" for x in runs) + " tok/s")
    return out


def storm_subprocess(model: str, dtype: str, new_tokens: int, prompt: str, stable: str, timeout: float) -> dict:
    """``storm`` in a fresh process (nothing compiled yet), with TANDEM_STABLE_SHAPES=``stable``."""
    env = dict(os.environ, TANDEM_STABLE_SHAPES=stable)
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, __file__, "storm", "--gguf", model, "--dtypes", dtype, "--max-new-tokens",
               str(new_tokens), "--prompt", prompt, "--json", f.name]
        proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
        sys.stdout.write(proc.stdout[-3000:])
        if proc.returncode != 0:
            raise RuntimeError(f"storm check failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return json.loads(Path(f.name).read_text())


# ------------------------------------------------------------------ starter
def starter_part(args, dtype: str, deadline: float) -> dict:
    from engine.api import load
    from engine.prompts import load_prompts

    out: dict = {"dtype": dtype}
    prompts = load_prompts(["chat", "code", "math"], args.prompts_per_class)
    storm_prompt = prompts[0][1]
    for label, stable in (("storm_exact_shapes", "0"), ("storm_stable_shapes", "default")):
        if label.split("_")[1] not in args.storms.split(","):
            continue
        left = deadline - time.time()
        if left < 150:
            out[label] = f"skipped: {left:.0f} s left"
            continue
        env_value = stable if stable != "default" else os.environ.get("TANDEM_STABLE_SHAPES", "")
        try:
            out[label] = storm_subprocess(args.gguf, dtype, args.max_new_tokens, storm_prompt, env_value,
                                          timeout=min(240, left - 60))
        except Exception as err:
            out[label] = f"{type(err).__name__}: {err}"
            log(out[label])
    if deadline - time.time() < 90:
        out["benchmark"] = f"skipped: {deadline - time.time():.0f} s of this dtype's budget left"
        return out
    eng = load(args.gguf, dtype=dtype)
    out["target_shapes"], out["target_shapes_refused"] = str(eng.target.shapes), eng.target.shapes_refused
    if args.tiny:
        quick_calibrations(eng, ("lookup", "dspark"))
    arms = B.make_arms(["lookup", "dspark"], B.parse_caps(args.caps), noise_floor=args.noise_floor)
    out["benchmark"] = benchmark(eng, prompts, arms, args)
    return out


def quick_calibrations(eng, modes) -> None:
    """A dry run: one-pass calibrations (cached, so the benchmark reuses them)."""
    from engine.calibrate import calibrate

    for mode in modes:
        calibrate(eng, mode, eng.drafter(mode), passes=1, overhead_rounds=3)


def benchmark(eng, prompts, arms, args) -> dict:
    """``tandem benchmark`` on ``prompts`` with run traces, logged; the report (plus its seconds)."""
    t0 = time.time()
    report = B.run_benchmark(eng, prompts, arms, trials=args.trials, max_new_tokens=args.max_new_tokens,
                             progress=lambda d, t, s: log(f"  bench {d}/{t} {s}"), trace=True)
    report["seconds"] = round(time.time() - t0, 1)
    log(B.format_report(report))
    return report


# ------------------------------------------------------------------ pair
def pair_arms(draft_caps: str) -> list[B.Arm]:
    """baseline, baseline-2 (the noise floor), lookup@auto, then the draft model at each cap."""
    arms = B.make_arms(["lookup"], ["auto"], noise_floor=True)
    return arms + [a for a in B.make_arms(["draft"], B.parse_caps(draft_caps)) if a.mode == "draft"]


def pair_check(eng, prompt, new_tokens: int) -> dict:
    """One prompt, baseline then draft@4: the draft model must change no token (greedy)."""
    base = eng.generate(prompt, mode="baseline", max_new_tokens=new_tokens)
    draft = eng.generate(prompt, mode="draft", max_new_tokens=new_tokens, max_draft=4)
    return {"same_tokens": base.token_ids == draft.token_ids, "tokens": base.generated,
            "baseline_tok_s": round(base.decode_tps, 2), "draft4_tok_s": round(draft.decode_tps, 2),
            "draft4_accept_per_round": round(draft.mean_accepted, 3), "draft4_rounds": len(draft.rounds)}


def pair_part(args, dtype: str, deadline: float, save) -> dict:
    """The pair in ``dtype``; ``save(out)`` after each step, so a call stopped at its limit keeps
    what was measured."""
    from engine.api import load
    from engine.calibrate import model_precision
    from engine.prompts import load_prompts

    prompts = load_prompts(["chat", "code", "math"], args.prompts_per_class)
    out: dict = {"dtype": dtype, "target": Path(args.target).name, "draft": Path(args.draft).name}
    t0 = time.time()
    eng = load(args.target, dtype=dtype, draft_model=args.draft)  # converts the GGUF on first use (cached)
    out["target_load_s"] = round(time.time() - t0, 1)
    out["target_shapes"] = str(eng.target.shapes)
    out["target_shapes_refused"] = eng.target.shapes_refused
    out["target_precision"] = model_precision(eng.model)
    t0 = time.time()
    drafter = eng.drafter("draft")  # converts + loads the 0.5B, refuses a different tokenizer
    out["draft_load_s"] = round(time.time() - t0, 1)
    out["draft_precision"] = model_precision(drafter.model)
    save(out)
    log(f"pair {dtype}: target {out['target_precision']} in {out['target_load_s']} s, "
        f"draft {out['draft_precision']} in {out['draft_load_s']} s")
    out["check"] = pair_check(eng, prompts[0][1], args.max_new_tokens)
    log(f"pair check: {out['check']}")
    save(out)
    if deadline - time.time() < 90:
        out["benchmark"] = f"skipped: {deadline - time.time():.0f} s of this dtype's budget left"
        log(out["benchmark"])
        return out
    if args.tiny:
        quick_calibrations(eng, ("lookup", "draft"))
    out["benchmark"] = benchmark(eng, prompts, pair_arms(args.draft_caps), args)
    return out


# ------------------------------------------------------------------ concurrent
def concurrent_part(args, dtype: str, deadline: float) -> dict:
    """``tandem benchmark --concurrent N`` (issue 42's table): the starter with its drafter
    (``--gguf``; arms lookup, dspark) or the pair's target with its draft model (``--target`` and
    ``--draft``; arms lookup, draft; without ``--draft`` lookup only), each at ``--caps``,
    batched against one after another."""
    from engine.api import load
    from engine.concurrent_bench import AGENT, agent_prompts, format_concurrent, run_concurrent
    from engine.prompts import CLASSES, load_prompts, load_spec_bench

    wanted, per = args.classes.split(","), max(args.prompts_per_class, args.concurrent)
    ours, spec = [c for c in wanted if c in CLASSES], [c for c in wanted if c not in CLASSES and c != AGENT]
    prompts = ((load_prompts(ours, per) if ours else []) + (load_spec_bench(spec, per) if spec else [])
               + (agent_prompts(args.concurrent) if AGENT in wanted else []))
    if args.target:  # without --draft the target alone (PARTS=coder stages only it): lookup's arm
        modes = ["lookup", "draft"] if args.draft else ["lookup"]
        eng = load(args.target, dtype=dtype, draft_model=args.draft)
    else:
        eng, modes = load(args.gguf, dtype=dtype), ["lookup", "dspark"]
    if args.tiny:
        quick_calibrations(eng, modes)
    arms = B.make_arms(modes, B.parse_caps(args.caps))
    t0 = time.time()
    report = run_concurrent(eng, prompts, arms, concurrent=args.concurrent, max_new_tokens=args.max_new_tokens,
                            trials=args.trials, progress=lambda d, t, s: log(f"  concurrent {d}/{t} {s}"))
    report["seconds"] = round(time.time() - t0, 1)
    log(format_concurrent(report))
    return report


# ------------------------------------------------------------------ random 8B
class IdTokenizer:
    """Enough of a tokenizer for token-id prompts on random-weight targets."""

    eos_token_ids: list[int] = []
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation of the current prompt (from a baseline run),
    with a seeded fraction ``1 - accept`` of positions corrupted (that draft and the ones after it
    are rejected): acceptance under control on a random-weight target."""

    name = "oracle"

    def __init__(self, references: dict[tuple, list[int]], accept: float, vocab: int, max_draft: int = 16,
                 seed: int = 0):
        self.references, self.accept, self.vocab, self.max_draft = references, accept, vocab, max_draft
        rng = random.Random(seed)
        self.wrong = [rng.random() >= accept for _ in range(1 << 16)]
        self.ref: list[int] = []
        self.prompt_len = 0

    def begin(self, prompt_ids, hidden) -> None:
        self.ref = self.references.get(tuple(prompt_ids), [])
        self.prompt_len = len(prompt_ids)

    def propose(self, ids, cap, sampler):
        g = len(ids) - self.prompt_len  # generated so far; the next one is ref[g]
        tokens = self.ref[g : g + cap]
        if not tokens:
            return None
        tokens = [(t + 1) % self.vocab if self.wrong[(g + i) % len(self.wrong)] else t for i, t in enumerate(tokens)]
        return Draft(mx.array(tokens, dtype=mx.uint32))


def random_target(shape: dict, bits: int | None):
    import mlx.nn as nn
    from mlx_lm.models import qwen3

    from engine.generate import Engine

    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", **shape))
    model.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    model.eval()
    return Engine(model, IdTokenizer(), name=f"qwen3-8b-shape-random-{'q%d' % bits if bits else 'bf16'}")


def random8b_part(args, bits: int | None, deadline: float) -> dict:
    shape = TINY if args.tiny else QWEN3_8B
    t0 = time.time()
    eng = random_target(shape, bits)
    out: dict = {"build_s": round(time.time() - t0, 1), "shapes": str(eng.target.shapes),
                 "shapes_refused": eng.target.shapes_refused}
    log(f"shapes: {out['shapes']}" + (f" (refused: {out['shapes_refused']})" if out["shapes_refused"] else ""))
    vocab = shape["vocab_size"]
    key = mx.random.key(1)
    block = mx.random.randint(10, vocab, (96,), key=key).tolist()
    prompts = [("copy", block + block[:64]), ("random", mx.random.randint(10, vocab, (160,), key=mx.random.key(2)).tolist())]
    n = args.max_new_tokens
    references = {}
    for _, ids in prompts:  # the target's own continuations, for the oracle
        references[tuple(ids)] = eng.generate(ids, mode="baseline", max_new_tokens=n + 40).token_ids
    for accept in args.oracle_accept:
        if deadline - time.time() < 60:
            out[f"oracle_{accept}"] = "skipped: budget"
            continue
        eng.set_drafter("draft", OracleDrafter(references, accept, vocab))
        modes = ["draft"] + (["lookup"] if accept == args.oracle_accept[-1] else [])
        caps = B.parse_caps(args.caps_8b)
        report = B.run_benchmark(eng, prompts, B.make_arms(modes, caps), trials=args.trials, max_new_tokens=n,
                                 progress=lambda d, t, s: log(f"  8b {d}/{t} {s}"))
        log(B.format_report(report))
        out[f"oracle_{accept}"] = report
    return out


# ------------------------------------------------------------------ main
def per_dtype(args, out_dir: Path, part: str, run) -> None:
    """``run(dtype, deadline, saver)`` for each of ``--dtypes``, each with its share of the call's
    budget and its own JSON file."""
    dtypes = args.dtypes.split(",")
    start = time.time()
    for i, dtype in enumerate(dtypes):
        share = start + args.budget * (i + 1) / len(dtypes)
        saver = Saver(out_dir / f"bench-{part}-{dtype}.json")
        saver.attempt(part, lambda: run(dtype, share, saver), share)
        mx.clear_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("starter", "pair", "random8b", "storm", "concurrent"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--gguf", default=None, help="the starter's GGUF file")
    ap.add_argument("--target", default=None, help="pair: the target's GGUF (Qwen2.5-Coder-1.5B)")
    ap.add_argument("--draft", default=None, help="pair: the draft model's GGUF (Qwen2.5-Coder-0.5B)")
    ap.add_argument("--dtypes", default=None, help="default: bfloat16,float16 (starter), bfloat16 (pair)")
    ap.add_argument("--bits", default="16,4", help="random8b: 16 (bf16) and/or quantized bits")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts-per-class", type=int, default=2)
    ap.add_argument("--storms", default="exact,stable",
                    help="starter: which compile-storm checks run (exact: shapes as before stable shapes)")
    ap.add_argument("--noise-floor", action="store_true", help="starter: a second baseline arm (A/A)")
    ap.add_argument("--caps", default="auto,0", help="starter arms' caps (0: the drafter's full block)")
    ap.add_argument("--caps-8b", default="auto,8")
    ap.add_argument("--concurrent", type=int, default=4, help="concurrent: requests at once")
    ap.add_argument("--classes", default="chat,code,math",
                    help="concurrent: prompt classes (chat, code, math; Spec-Bench's categories; agent)")
    ap.add_argument("--draft-caps", default="auto,4", help="pair: the draft model's caps")
    ap.add_argument("--oracle-accept", type=float, nargs="+", default=[0.9, 0.0])
    ap.add_argument("--budget", type=float, default=560.0, help="seconds this call may spend (parts skip past it)")
    ap.add_argument("--prompt", default=None, help="storm: the prompt")
    ap.add_argument("--json", default=None, help="storm: where to write its result")
    ap.add_argument("--tiny", action="store_true", help="toy shapes and few tokens: a CPU dry run of this script")
    args = ap.parse_args()
    if args.dtypes is None:
        args.dtypes = "bfloat16" if args.part in ("pair", "concurrent") else "bfloat16,float16"
    if args.part == "storm":
        Path(args.json).write_text(json.dumps(storm(args.gguf, args.dtypes, args.max_new_tokens, args.prompt)))
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(json.dumps(stamp()))
    if args.part == "starter":
        if not args.gguf or not Path(args.gguf).is_file():
            log(f"no starter GGUF at {args.gguf!r}")
            return 2
        per_dtype(args, out_dir, "starter", lambda dtype, share, saver: starter_part(args, dtype, share))
    elif args.part == "pair":
        missing = [f for f in (args.target, args.draft) if not f or not Path(f).is_file()]
        if missing:
            log(f"no pair GGUF at {missing[0]!r}")
            return 2
        per_dtype(args, out_dir, "pair",
                  lambda dtype, share, saver: pair_part(args, dtype, share, lambda o: saver.put("pair", o)))
    elif args.part == "concurrent":
        name = "concurrent-pair" if args.target else "concurrent-starter"
        wanted = ([args.target] + ([args.draft] if args.draft else [])) if args.target else [args.gguf]
        missing = [f for f in wanted if not f or not Path(f).is_file()]
        if missing:
            log(f"no GGUF at {missing[0]!r}")
            return 2
        per_dtype(args, out_dir, name, lambda dtype, share, saver: concurrent_part(args, dtype, share))
    else:
        saver = Saver(out_dir / "bench-random8b.json")
        bits_list = [int(b) for b in args.bits.split(",")]
        start = time.time()
        for i, bits in enumerate(bits_list):  # each precision gets its share of the budget
            share = start + args.budget * (i + 1) / len(bits_list)
            saver.attempt(f"qwen3-8b-{'bf16' if bits >= 16 else f'q{bits}'}",
                          lambda: random8b_part(args, None if bits >= 16 else bits, share), share)
            mx.clear_cache()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
