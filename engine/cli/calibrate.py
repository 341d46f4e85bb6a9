"""``tandem calibrate``: measure this machine's verify/draft cost curves and pick the draft cap."""

from __future__ import annotations

import argparse
import json

from engine.calibrate import PASSES, cache_path, calibrate, format_report, tqdm_progress
from engine.cost_model import static_cap
from engine.errors import TandemError
from engine.options import add_model_arguments, load_engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--mode", default="lookup", choices=("auto", "lookup", "draft", "dspark", "dflash", "eagle3", "mtp"),
                   help="which drafter's curves to measure (default: lookup)")
    p.add_argument("--recalibrate", action="store_true", help="measure again even if this pair is cached")
    p.add_argument("--passes", type=int, default=PASSES, help=f"timed passes per width (default {PASSES})")
    p.add_argument("--json", action="store_true", help="print the calibration as JSON")


def run(args: argparse.Namespace) -> int:
    if args.passes < 1:
        raise TandemError(f"--passes must be at least 1, got {args.passes}")
    eng = load_engine(args)
    mode = eng.resolve_mode(args.mode)
    drafter = eng.drafter(mode)
    progress, close = tqdm_progress(f"calibrating {eng.name} / {mode}")
    try:
        cal = calibrate(eng, mode, drafter, recalibrate=args.recalibrate, progress=progress, passes=args.passes)
    finally:
        close()
    if args.json:
        out = cal.to_dict()
        out["default_cap"] = static_cap(cal)
        out["from_cache"] = cal.from_cache
        print(json.dumps(out, indent=1))
    else:
        print(format_report(cal, eng))
        print(f"cache: {cache_path()}")
    return 0
