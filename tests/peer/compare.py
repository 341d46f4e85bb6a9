"""Tandem and mlx-dspark side by side on this machine: baseline, lookup and DSpark decoding of
the same float32 model on the same prompts, greedy, the same token budget.

    PYTHONPATH=$PWD .venv/bin/python tests/peer/compare.py [--trials 3] [--per-class 2]

The peer runs in its own virtualenv (``--peer-python``, default /work/peer-venv/bin/python) as a
worker process (``peer_worker.py``) that waits while Tandem runs, so every (engine, mode) arm runs
on every prompt in every trial, interleaved and rotated (``tandem benchmark``'s ``arm_order``): a
busy machine slows all arms alike.

Both engines load one float32 mlx-lm folder, converted once from the starter GGUF (Tandem's
conversion cache, dense float32) into ``<tandem cache>/peer/smollm2-135m-fp32``; the peer loads
the shipped drafter ``resources/drafters/smollm2-135m-dspark`` unquantized (``--drafter-bits 0``).
Each engine uses its own defaults otherwise: Tandem's calibrated caps (calibrated before timing),
the peer's measured ``static_cap`` and its lookup defaults. Both preload OpenBLAS the same way;
Tandem's skinny matmuls (engine/skinny_gemm.py) are Tandem's own, so the peer runs without them
unless ``--peer-skinny`` lends them.

Reported per mode and engine: decode tok/s (median over trials of all prompts' tokens after the
first over their decode seconds, prefill excluded), Tandem/peer (median of per-trial ratios),
committed tokens per verify round, and whether every run's tokens equal that engine's own
baseline (``yes``, ``yes, N ties`` for flips within the float rounding, or ``NO``; and the two
baselines each other). Not collected by pytest (no ``test_`` prefix).

``serve_compare.py`` beside it compares the two engines' servers instead (``tandem serve`` and
``mlx-dspark serve``, each with ``--max-batch``): the same requests at once and one after another.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRAFTER = ROOT / "resources" / "drafters" / "smollm2-135m-dspark"
MODES = ("baseline", "lookup", "dspark")
ENGINES = ("tandem", "peer")
PEER_PYTHON = "/work/peer-venv/bin/python"  # the peer's own virtualenv, where there is one

# A few prompts per class, used when the product ships no prompt set (resources/prompts).
PROMPTS = {
    "chat": [
        "Give me three tips for staying focused while working from home, with one sentence on each.",
        "Write a short, friendly email inviting my team to a picnic on Saturday.",
        "Explain what a rainbow is to a ten-year-old.",
    ],
    "code": [
        "Write a Python function `is_palindrome(s)` that ignores case and punctuation, with a docstring "
        "and two examples.",
        "Here is a function:\n\ndef mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    "
        "return total / len(xs)\n\nRewrite it so that it returns None for an empty list, and repeat "
        "the whole function.",
        "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    ],
    "math": [
        "A shop sells pencils at 3 for $1. How much do 18 pencils cost? Explain step by step.",
        "Tom has 12 apples. He gives a third of them to Anna and eats 2. How many are left? Show your work.",
        "What is 15% of 240? Explain how you got the answer.",
    ],
}


def prompts(per_class: int) -> list[tuple[str, str]]:
    shipped = ROOT / "resources" / "prompts"
    if shipped.is_dir():
        from engine.benchmark import load_prompts

        try:
            return load_prompts(per_class=per_class, folder=shipped)
        except Exception as e:  # a different layout: say so and use the built-in set
            print(f"note: {shipped} not usable ({e}); using the built-in prompts", file=sys.stderr)
    return [(cls, text) for cls, texts in PROMPTS.items() for text in texts[:per_class]]


def model_folder(gguf: str | None = None, dtype: str | None = None) -> Path:
    """One mlx-lm folder both engines load, converted once, then cached. Default: the starter as
    dense float32 (the CPU policy). With ``dtype`` (a GPU run): ``gguf`` (default the starter) as
    Tandem loads it there, quantized weights kept and the rest cast to ``dtype``."""
    from engine.paths import cache_root

    stem = Path(gguf).stem.lower() if gguf else "smollm2-135m"
    out = cache_root() / "peer" / f"{stem}-{dtype or 'fp32'}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from mlx_lm.utils import save_config, save_model

    from engine.loading import load_model

    loaded = load_model(gguf, dense=True) if dtype is None else load_model(gguf, dtype=dtype)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, loaded.model)
    save_config({**loaded.config, "torch_dtype": dtype or "float32"}, tmp / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(loaded.path / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def peer_env(lend_skinny: bool, path: str | None = None) -> dict[str, str]:
    """The environment a peer process runs in: its own packages, Tandem's skinny matmuls off
    unless lent (it adds the repository to its path itself, for ``engine``'s OpenBLAS preload)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # its own site-packages only
    if path:  # a machine without a virtualenv for it: the folder its packages were installed into
        env["PYTHONPATH"] = path
    if not lend_skinny:
        env["TANDEM_NO_SKINNY"] = "1"
    return env


class Peer:
    """The mlx-dspark worker process: one JSON request, one JSON reply."""

    def __init__(self, python: str, lend_skinny: bool, path: str | None = None):
        env = peer_env(lend_skinny, path)
        self.proc = subprocess.Popen([python, str(Path(__file__).with_name("peer_worker.py"))], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the peer worker died (exit {self.proc.wait()}); see its stderr above")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise SystemExit(f"peer {msg.get('cmd')} failed: {reply.get('error')}")
        return reply

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@dataclass
class Run:
    tokens: list[int]
    decode_s: float
    rounds: int  # verify rounds after the prefill's token

    @property
    def timed_tokens(self) -> int:  # the first token comes from prefill
        return max(0, len(self.tokens) - 1)


@dataclass
class Arm:
    engine: str
    mode: str
    runs: list[list[Run | None]] = field(default_factory=list)  # [trial][prompt]

    @property
    def name(self) -> str:
        return f"{self.engine}:{self.mode}"

    def tps(self, trial: int) -> float:
        runs = self.runs[trial]
        seconds = sum(r.decode_s for r in runs)
        return sum(r.timed_tokens for r in runs) / seconds if seconds > 0 else 0.0

    def tokens_per_round(self) -> float:
        runs = [r for trial in self.runs for r in trial]
        rounds = sum(r.rounds for r in runs)
        return sum(r.timed_tokens for r in runs) / rounds if rounds else 0.0


def tandem_run(eng, mode: str, ids: list[int], max_new_tokens: int, max_draft: str | None = None) -> Run:
    r = eng.generate(ids, mode=mode, max_new_tokens=max_new_tokens, prefix_cache=False,
                     max_draft=None if mode == "baseline" else max_draft)
    return Run(list(r.token_ids), r.decode_s, len(r.rounds) - 1)


def peer_run(peer: Peer, mode: str, ids: list[int], max_new_tokens: int) -> Run:
    r = peer.ask(cmd="run", mode=mode, ids=ids, max_new_tokens=max_new_tokens)
    return Run(r["tokens"], r["decode_s"], r["rounds"])


def same_as(reference: list[int], other: list[int]) -> bool:
    """Equal tokens; one stopping earlier (EOS vs the budget) is not a divergence."""
    n = min(len(reference), len(other))
    return reference[:n] == other[:n]


def lossless(eng, work: list, reference: list[Run], runs: list[list[Run]]) -> str:
    """'yes', 'yes, N ties' (each divergence from the engine's own baseline a flip within the
    model's float rounding, proven by the top-2 margin of a clean re-run, as ``tandem benchmark``
    reports it) or 'NO'. Both engines run the same folder, so Tandem's target gives the margins."""
    from engine.benchmark import check_lossless

    ties = 0
    for trial in runs:
        for (_, ids), ref, run in zip(work, reference, trial):
            report = check_lossless(eng, ids, ref.tokens, run.tokens)  # None: equal, or one stopped earlier
            if report is None:
                continue
            if not report["near_tie"]:
                return "NO"
            ties += 1
    return f"yes, {ties} ties" if ties else "yes"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--per-class", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--peer-python", default=PEER_PYTHON)
    p.add_argument("--peer-path", default=None,
                   help="PYTHONPATH for the peer worker (its packages installed with pip --target)")
    p.add_argument("--gguf", default=None, help="the target GGUF (default: the starter)")
    p.add_argument("--dtype", default=None,
                   help="load the GGUF as Tandem does on a GPU (quantized weights kept) in this dtype; "
                        "default: dense float32, the CPU policy")
    p.add_argument("--max-draft", default=None,
                   help="Tandem's cap (auto, or a number; default: its calibrated cap)")
    p.add_argument("--peer-skinny", action="store_true",
                   help="lend Tandem's skinny matmuls (engine/skinny_gemm.py) to the peer as well")
    p.add_argument("--tandem-plain", action="store_true",
                   help="add Tandem with skinny matmuls and compiled small forwards off (the CPU step before them)")
    p.add_argument("--json", default=None, help="also write the raw figures here")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    import engine  # noqa: F401  (OpenBLAS preload first)
    from engine import platform
    from engine.api import load
    from engine.benchmark import arm_order
    from engine.calibrate import calibrate

    folder = model_folder(args.gguf, args.dtype)
    peer = Peer(args.peer_python, args.peer_skinny, args.peer_path)
    peer_info = peer.ask(cmd="load", model=str(folder), drafter=str(DRAFTER))
    eng = load(str(folder), drafter=str(DRAFTER))
    for mode in modes:
        if mode != "baseline":  # Tandem's default caps come from its calibration, measured before timing
            calibrate(eng, mode, eng.drafter(mode))
    if platform.backend() != "cpu":  # what `tandem generate` does on a GPU: compile the session's shapes now
        print(f"warm-up: {eng.warm_up(modes):.0f} s", file=sys.stderr)
    work = [(cls, eng.encode(text)) for cls, text in prompts(args.per_class)]
    blas = platform.blas_status()
    print(f"model {folder} | {len(work)} prompts x {args.trials} trials, {args.max_new_tokens} new tokens, greedy")
    print(f"tandem: skinny matmuls {blas.skinny}, compiled small forwards {eng.target.compiled_off or 'on'} | "
          f"peer: mlx "
          f"{peer_info['mlx']}, BLAS {peer_info['blas']}, skinny matmuls {peer_info['skinny']}, dspark cap "
          f"{peer_info['dspark_cap']}, lookup drafts in dspark {peer_info['dspark_lookup_drafts']}")
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        print(f"warning: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: absolute figures are "
              f"noisy, ratios less so")

    engines = ENGINES + (("tandem-plain",) if args.tandem_plain else ())
    compiled_off = eng.target.compiled_off
    arms = [Arm(e, m) for m in modes for e in engines]
    for arm in arms:
        arm.runs = [[None] * len(work) for _ in range(args.trials)]

    def run(arm: Arm, ids: list[int], n: int) -> Run:
        if arm.engine == "peer":
            return peer_run(peer, arm.mode, ids, n)
        if arm.engine == "tandem":
            return tandem_run(eng, arm.mode, ids, n, args.max_draft)
        platform.skinny_matmuls(False)  # "tandem-plain": this branch's CPU-step work off
        eng.target.compiled_off = "off for the comparison"
        try:
            return tandem_run(eng, arm.mode, ids, n, args.max_draft)
        finally:
            platform.skinny_matmuls(True)
            eng.target.compiled_off = compiled_off

    for arm in arms:  # warm-up: first-call allocations, traces, kernel builds
        run(arm, work[0][1], 8)
    started = time.perf_counter()
    for trial in range(args.trials):
        for j, (_, ids) in enumerate(work):
            for arm in (arms[i] for i in arm_order(len(arms), trial, j, len(work))):
                arm.runs[trial][j] = run(arm, ids, args.max_new_tokens)
        print(f"trial {trial + 1}/{args.trials} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    peer.close()

    by = {(a.engine, a.mode): a for a in arms}
    baselines = {e: by[(e, "baseline")] for e in ENGINES if (e, "baseline") in by}
    plain_head = f"{'plain tok/s':>12}{'plain/peer':>11}" if args.tandem_plain else ""
    print(f"\n{'mode':<10}{'tandem tok/s':>13}{'peer tok/s':>12}{'tandem/peer':>13}{'tandem tok/rnd':>16}"
          f"{'peer tok/rnd':>14}  {'tandem = base':<15}{'peer = base':<13}{plain_head}")
    report = {"trials": args.trials, "max_new_tokens": args.max_new_tokens, "prompts": len(work), "modes": {}}
    for mode in modes:
        t, q = by[("tandem", mode)], by[("peer", mode)]
        t_tps = [t.tps(i) for i in range(args.trials)]
        q_tps = [q.tps(i) for i in range(args.trials)]
        ratio = statistics.median(a / b for a, b in zip(t_tps, q_tps) if b > 0)
        match = {}
        for arm in (t, q):
            base = baselines.get(arm.engine)
            match[arm.engine] = "-" if base is None else lossless(eng, work, base.runs[0], arm.runs)
        plain = ""
        if args.tandem_plain:
            p_tps = [by[("tandem-plain", mode)].tps(i) for i in range(args.trials)]
            plain_ratio = statistics.median(a / b for a, b in zip(p_tps, q_tps) if b > 0)
            plain = f"{statistics.median(p_tps):12.1f}{plain_ratio:11.2f}"
        print(f"{mode:<10}{statistics.median(t_tps):13.1f}{statistics.median(q_tps):12.1f}{ratio:13.2f}"
              f"{t.tokens_per_round():16.2f}{q.tokens_per_round():14.2f}  {match['tandem']:<15}{match['peer']:<13}"
              f"{plain}")
        report["modes"][mode] = {"tandem_tok_s": t_tps, "peer_tok_s": q_tps, "ratio": ratio,
                                 "tandem_tokens_per_round": t.tokens_per_round(),
                                 "peer_tokens_per_round": q.tokens_per_round(), "matches_baseline": match}
    if len(baselines) == 2:
        same = all(same_as(baselines["tandem"].runs[0][j].tokens, baselines["peer"].runs[0][j].tokens)
                   for j in range(len(work)))
        print(f"tandem baseline = peer baseline: {'yes' if same else 'NO (float ties between the engines?)'}")
    print("tok/s: median over trials of (tokens after the first) / decode seconds; ratio: median of per-trial ratios")
    if args.tandem_plain:
        print("plain: Tandem with skinny matmuls and compiled small forwards switched off (the same process)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
