"""``tandem benchmark``: the flags and the report printing; the runs live in ``engine.benchmark``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.benchmark import (
    format_multi_turn,
    format_report,
    is_mismatch,
    make_arms,
    parse_caps,
    run_benchmark,
    run_multi_turn,
)
from engine.concurrent_bench import AGENT, agent_prompts
from engine.context_bench import check_single_turn, format_context, parse_contexts, run_context
from engine.prompts import CLASSES, SPEC_BENCH, SUITES, load_conversations, load_prompts, load_spec_bench
from engine.calibrate import tqdm_progress
from engine.errors import TandemError
from engine.generate import MODES
from engine.options import add_model_arguments, load_engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--modes", default="baseline,lookup",
                   help="comma-separated modes (baseline is always included as the reference)")
    p.add_argument("--max-draft", default=None,
                   help="draft cap(s) for the speculative modes: integers and/or 'auto', comma-separated "
                        "(e.g. 2,4,8,16,32,auto sweeps them); default: each mode's default cap")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--suite", choices=SUITES, default="classes",
                   help="'classes': chat, code and math prompts; 'spec-bench': Spec-Bench's categories (multi-turn, "
                        "translation, summarization, qa, math, rag), one column each")
    p.add_argument("--prompts-per-class", type=int, default=3, help="prompts per class (or Spec-Bench category)")
    p.add_argument("--classes", default=None,
                   help=f"comma-separated; classes: {', '.join(CLASSES)} (default all); spec-bench: "
                        f"{', '.join(SPEC_BENCH)} (default all); with --concurrent also '{AGENT}': requests "
                        "of the --agent-replay session, spread over it")
    p.add_argument("--prompts-dir", default=None, help="folder with the prompt .jsonl files (default: TANDEM_PROMPTS_DIR, "
                                                       "else the prompts shipped with Tandem)")
    p.add_argument("--noise-floor", action="store_true",
                   help="also run plain decoding as a second arm (baseline-2): an A/A comparison showing how far "
                        "identical arms drift apart on this machine")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the full report as JSON here")
    p.add_argument("--concurrent", type=int, default=0, metavar="N",
                   help="N requests at once per class: continuous batching against one after another "
                        "(aggregate tok/s, p50/p95 latency and time to first token)")
    p.add_argument("--arrival-ms", type=float, default=0.0, metavar="MS",
                   help="with --concurrent: request i arrives i*MS after the first (default: all at once)")
    p.add_argument("--shared-prefix", action="store_true",
                   help="with --concurrent: requests use the prefix cache, emptied before each pass, so a request "
                        "restores what the requests before it (batched: the rows before it) prefilled of a common "
                        "opening (agent requests share their system prompt and conversation)")
    p.add_argument("--multi-turn", action="store_true",
                   help="measure the prefix cache: later turns of mt-bench conversations (--prompts-per-class of them), "
                        "time to first token with the earlier turns restored vs prefilled from token 0, per mode")
    p.add_argument("--context", default=None, metavar="N,N,...",
                   help="context lengths in tokens (e.g. 512,2048,8192): before each prompt a preamble of exactly N "
                        "tokens of shipped text (Tandem's own source for code prompts, Spec-Bench's articles for the "
                        "rest); prints each mode's speed-up against the context length")
    p.add_argument("--agent-replay", nargs="?", const="single", default=None, choices=("single", "delegating"),
                   help="replay a coding agent's session built from Tandem's own source (single: 16 requests, each the "
                        "whole conversation so far; delegating: 18, the agent handing each module's edit to a "
                        "sub-agent in a fresh conversation): tok/s per mode, lookup with the suffix index emptied "
                        "before every request (in-context) and kept across the session (+suffix)")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES or m == "auto"]
    if bad:
        raise TandemError(f"unknown mode '{bad[0]}' in --modes: choose from {', '.join(m for m in MODES if m != 'auto')}")
    if args.prompts_per_class < 1:
        raise TandemError(f"--prompts-per-class must be at least 1, got {args.prompts_per_class}")
    contexts = parse_contexts(args.context) if args.context is not None else None
    chosen = [flag for flag, on in (("--concurrent", args.concurrent), ("--multi-turn", args.multi_turn),
                                    ("--context", contexts is not None), ("--agent-replay", args.agent_replay)) if on]
    if len(chosen) > 1:
        raise TandemError(f"{chosen[0]} and {chosen[1]} are separate benchmarks: pick one")
    if args.multi_turn:
        return _multi_turn(args, modes)
    if args.agent_replay:
        return _agent_replay(args, modes)
    classes = [c.strip() for c in (args.classes or "").split(",") if c.strip()]
    folder = Path(args.prompts_dir) if args.prompts_dir else None
    agent = AGENT in classes
    if agent and not args.concurrent:
        raise TandemError(f"--classes {AGENT} is --concurrent's (the session alone: --agent-replay)")
    classes = [c for c in classes if c != AGENT]
    if args.concurrent:  # a class's group is its first N prompts
        args.prompts_per_class = max(args.prompts_per_class, args.concurrent)
    if agent and not classes:
        prompts = []
    elif args.suite == "spec-bench":
        prompts = load_spec_bench(classes or None, args.prompts_per_class, folder)
    else:
        prompts = load_prompts(classes or list(CLASSES), args.prompts_per_class, folder)
    if agent:
        prompts += agent_prompts(args.concurrent)
    caps = parse_caps(args.max_draft)
    if contexts is not None:
        check_single_turn(prompts)  # before the model loads
    eng = load_engine(args)
    arms = make_arms(modes, caps, noise_floor=args.noise_floor)
    if args.concurrent:
        return _concurrent(args, eng, prompts, arms)
    cal_progress, cal_close = tqdm_progress("calibrating")
    warm_progress, warm_close = tqdm_progress("warming up")
    progress, close = tqdm_progress(f"benchmark {eng.name}")
    settings = dict(trials=args.trials, max_new_tokens=args.max_new_tokens, progress=progress,
                    calibration_progress=cal_progress, warmup_progress=warm_progress)
    try:
        if contexts is None:
            report = run_benchmark(eng, prompts, arms, **settings)
        else:
            report = run_context(eng, prompts, arms, contexts, **settings)
    finally:
        cal_close()
        warm_close()
        close()
    report["suite"] = args.suite
    print(format_report(report) if contexts is None else format_context(report))
    return _finish(args, report)


def _concurrent(args: argparse.Namespace, eng: Any, prompts: list, arms: list) -> int:
    from engine.concurrent_bench import format_concurrent, run_concurrent

    if args.arrival_ms < 0:
        raise TandemError(f"--arrival-ms must be >= 0, got {args.arrival_ms}")
    progress, close = tqdm_progress(f"concurrent {eng.name}")
    try:
        report = run_concurrent(eng, prompts, arms, concurrent=args.concurrent, arrival_ms=args.arrival_ms,
                                max_new_tokens=args.max_new_tokens, trials=args.trials,
                                shared_prefix=args.shared_prefix, progress=progress)
    finally:
        close()
    print(format_concurrent(report))
    return _finish(args, report)


def _multi_turn(args: argparse.Namespace, modes: list[str]) -> int:
    conversations = load_conversations(args.prompts_per_class, Path(args.prompts_dir) if args.prompts_dir else None)
    eng = load_engine(args)
    progress, close = tqdm_progress(f"multi-turn {eng.name}")
    try:
        report = run_multi_turn(eng, conversations, modes, trials=args.trials, max_new_tokens=args.max_new_tokens,
                                progress=progress)
    finally:
        close()
    print(format_multi_turn(report))
    return _finish(args, report)


def _agent_replay(args: argparse.Namespace, modes: list[str]) -> int:
    from engine.agent_bench import format_agent_replay, run_agent_replay

    arms = make_arms(modes, parse_caps(args.max_draft))
    eng = load_engine(args)
    cal_progress, cal_close = tqdm_progress("calibrating")
    warm_progress, warm_close = tqdm_progress("warming up")
    progress, close = tqdm_progress(f"agent replay {eng.name}")
    try:
        report = run_agent_replay(eng, arms, shape=args.agent_replay, trials=args.trials,
                                  max_new_tokens=args.max_new_tokens, progress=progress,
                                  calibration_progress=cal_progress, warmup_progress=warm_progress)
    finally:
        cal_close()
        warm_close()
        close()
    print(format_agent_replay(report))
    return _finish(args, report)


def _finish(args: argparse.Namespace, report: dict) -> int:
    if args.json:
        Path(args.json).expanduser().parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).expanduser().write_text(json.dumps(report, indent=1))
        print(f"report: {args.json}", file=sys.stderr)
    mismatches = [d for d in report["divergences"] if is_mismatch(d)]
    return 3 if mismatches else 0
