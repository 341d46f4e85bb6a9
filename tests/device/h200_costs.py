"""Cost curves and a small benchmark on a GPU machine (MLX CUDA backend), self-contained.

Not a pytest module (no ``test_`` prefix): the lead runs it on the H200 device machine, which has
no network and no ../shared. It needs mlx (with its CUDA backend) and mlx-lm importable, plus
numpy and tqdm; it reads nothing outside this repository and writes one JSON to ``--out``.

Parts (``--parts``, default all):
* ``qwen3-8b``: a Qwen3-8B-shaped target with random weights (costs depend on shapes, not
  values), in bf16 and then 4-bit (group 64): calibration (verify curve 1..33, overhead,
  copy bandwidth, default cap, roofline) and a benchmark of baseline vs lookup at fixed caps
  and ``auto`` on token-id prompts (one copy-heavy).
* ``smollm2-shape``: the starter's shapes (SmolLM2-135M) with random weights, bf16: calibration.
* ``starter``: the real starter model if ``--starter PATH`` names its converted mlx-lm folder
  (or its GGUF); calibration and the benchmark on the handful of prompts embedded below.

On the H200 device machine, with MLX staged by ../shared/device/stage-mlx-cuda.sh (two
back-to-back device calls: carry .devA ``bash .devA/keep.sh``, then carry .devB)::

    bash .devB/install.sh && export PYTHONPATH=/root/site:. PYTHONUNBUFFERED=1 &&
    python3 tests/device/h200_costs.py --out "$OUT" [--starter /path/to/smollm2-folder]

It takes a few minutes; ``--smoke`` runs the same code on toy shapes (a CPU check of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
os.environ.setdefault("TANDEM_CACHE_DIR", tempfile.mkdtemp(prefix="tandem-h200-"))  # fresh calibrations

import engine  # noqa: E402,F401
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from engine import benchmark as B  # noqa: E402
from engine import calibrate as C
from engine import cost_model as M  # noqa: E402
from engine.generate import Engine  # noqa: E402
from engine.roofline import RooflineModel  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True)

# A few prompts from the team's sets (mt-bench, humaneval, gsm8k), embedded: no ../shared there.
PROMPTS = [
    ("chat", "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
             "experiences and must-see attractions."),
    ("chat", "Draft a professional email seeking your supervisor's feedback on the 'Quarterly Financial Report' "
             "you prepared. Ask specifically about the data analysis, presentation style, and the clarity of "
             "conclusions drawn. Keep the email short and to the point."),
    ("code", "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
             "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
             "    \"\"\" Check if in given list of numbers, are any two numbers closer to each other than\n"
             "    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n"
             "    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n    \"\"\"\n\n```"),
    ("code", "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
             "from typing import List\n\n\ndef separate_paren_groups(paren_string: str) -> List[str]:\n"
             "    \"\"\" Input to this function is a string containing multiple groups of nested parentheses. "
             "Your goal is to\n    separate those group into separate strings and return the list of those.\n"
             "    Separate groups are balanced (each open brace is properly closed) and not nested within each other\n"
             "    Ignore any spaces in the input string.\n    >>> separate_paren_groups('( ) (( )) (( )( ))')\n"
             "    ['()', '(())', '(()())']\n    \"\"\"\n\n```"),
    ("math", "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
             "her friends every day with four. She sells the remainder at the farmers' market daily for $2 per "
             "fresh duck egg. How much in dollars does she make every day at the farmers' market?\n"
             "Please reason step by step, and put your final answer within \\boxed{}."),
    ("math", "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it "
             "take?\nPlease reason step by step, and put your final answer within \\boxed{}."),
]


class IdTokenizer:
    """Enough of a tokenizer for token-id prompts on random-weight targets."""

    eos_token_ids = [0]
    eos_token_id = 0
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


def random_target(shape: dict, name: str, arch: str = "qwen3") -> Engine:
    if arch == "qwen3":
        from mlx_lm.models import qwen3 as mod
    else:
        from mlx_lm.models import llama as mod
    args = mod.ModelArgs(model_type=arch, **shape)
    mx.random.seed(0)
    model = mod.Model(args)
    model.set_dtype(mx.bfloat16)  # cast lazily, before the float32 init is materialised
    mx.eval(model.parameters())
    model.eval()
    return Engine(model, IdTokenizer(), name=name)


def token_prompts(vocab: int) -> list[tuple[str, list[int]]]:
    key = mx.random.key(1)
    block = mx.random.randint(10, vocab, (160,), key=key).tolist()
    noise = mx.random.randint(10, vocab, (320,), key=mx.random.key(2)).tolist()
    return [("copy", block + block[:120]), ("random", noise[:200]), ("random", noise[200:])]


def calibration_part(eng: Engine, log) -> dict:
    t0 = time.perf_counter()
    cal = C.calibrate(eng, "lookup", recalibrate=True)
    log(C.format_report(cal, eng))
    roof = RooflineModel.from_engine(eng, cal.bandwidth)
    return {"calibration": cal.to_dict(), "default_cap": M.static_cap(cal),
            "best_cap_by_p": {str(p): M.best_cap(cal, p) for p in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)},
            "verify_ratio": {str(w): round(v / cal.verify_ms[0], 3) for w, v in zip(cal.widths, cal.verify_ms)},
            "roofline": roof.summary(cal.context, M.rate(cal, 0, 0.0)), "seconds": time.perf_counter() - t0}


def bench_part(eng: Engine, prompts, caps, trials: int, new_tokens: int, log) -> dict:
    report = B.run_benchmark(eng, prompts, B.make_arms(["lookup"], caps), trials=trials, max_new_tokens=new_tokens)
    log(B.format_report(report))
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for h200_costs.json (default $OUT)")
    ap.add_argument("--starter", default=None, help="converted SmolLM2-135M-Instruct folder (or its .gguf), if here")
    ap.add_argument("--parts", default="qwen3-8b,smollm2-shape,starter")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--caps", default="2,4,8,16,32,auto")
    ap.add_argument("--smoke", action="store_true", help="toy shapes, to check the script itself on a CPU")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    caps = B.parse_caps(args.caps)
    result: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args), "errors": {}}

    def log(text: str) -> None:
        print(text, flush=True)

    def save() -> None:
        (out_dir / "h200_costs.json").write_text(json.dumps(result, indent=1, default=str))

    def attempt(name: str, fn) -> None:
        log(f"=== {name}")
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as err:  # keep the other parts' figures
            result["errors"][name] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
            log(result["errors"][name])
        log(f"=== {name}: {time.perf_counter() - t0:.1f}s")
        save()

    from engine import platform

    result["machine"] = {"device": platform.device_name(), "backend": platform.backend(), "mlx": mx.__version__,
                         "default_device": str(mx.default_device())}
    log(json.dumps(result["machine"]))
    qwen, smol = dict(QWEN3_8B), dict(SMOLLM2_135M)
    if args.smoke:  # a CPU smoke test of this script: same code, toy shapes
        qwen.update(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, vocab_size=2048)
        smol.update(num_hidden_layers=2)

    if "qwen3-8b" in parts:
        holder: dict = {}

        def bf16() -> dict:
            eng = holder["eng"] = random_target(qwen, "qwen3-8b-shape-random")
            out = calibration_part(eng, log)
            out["benchmark"] = bench_part(eng, token_prompts(qwen["vocab_size"]), caps, args.trials,
                                          args.max_new_tokens, log)
            return out

        def q4() -> dict:
            eng = holder.get("eng") or random_target(qwen, "qwen3-8b-shape-random")
            nn.quantize(eng.model, group_size=64, bits=4)
            mx.eval(eng.model.parameters())
            eng = Engine(eng.model, eng.tokenizer, name="qwen3-8b-shape-random")  # re-probe the quantized target
            out = calibration_part(eng, log)
            out["benchmark"] = bench_part(eng, token_prompts(qwen["vocab_size"]), caps, args.trials,
                                          args.max_new_tokens, log)
            return out

        attempt("qwen3-8b-bf16", bf16)
        attempt("qwen3-8b-q4", q4)
        holder.clear()

    if "smollm2-shape" in parts:
        attempt("smollm2-shape-bf16", lambda: calibration_part(
            random_target(smol, "smollm2-135m-shape-random", arch="llama"), log))

    if "starter" in parts:
        if args.starter and Path(args.starter).exists():
            def starter() -> dict:
                from engine.api import load

                eng = load(args.starter)
                out = calibration_part(eng, log)
                out["benchmark"] = bench_part(eng, PROMPTS, caps, args.trials, args.max_new_tokens, log)
                return out

            attempt("starter", starter)
        else:
            result["starter"] = {"skipped": f"no converted starter folder at {args.starter!r} (pass --starter PATH)"}
            log(result["starter"]["skipped"])
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    log(f"wrote {out_dir / 'h200_costs.json'}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
