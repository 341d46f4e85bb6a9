"""Options shared by every front end that loads a model (``tandem generate``, ``serve``,
``calibrate``, ``benchmark``, ``train-drafter``): their argparse flags and the one function that
turns them into an ``Engine``. Not a CLI module: the server and the benchmark use it too."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.generate import Engine


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model and drafter selection."""
    p.add_argument("--model", default=None,
                   help="HF repo id (from the local HF cache), local mlx-lm folder, .gguf file, or a built-in name; "
                        "default: the starter model SmolLM2-135M-Instruct")
    p.add_argument("--drafter", default=None,
                   help="DSpark/DFlash/EAGLE-3 checkpoint (HF repo id or local folder), or for --mode mtp an MTP "
                        "sidecar (folder or .safetensors) when the model's own folder has no MTP head")
    p.add_argument("--draft-model", default=None, help="small autoregressive draft model sharing the tokenizer (--mode draft)")
    p.add_argument("--drafter-bits", type=int, default=None,
                   help="quantize drafter weights to this many bits where quantized matmul is fast (Metal/CUDA; default 4)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="cast the target's floating parameters (quantized weights stay quantized on Metal/CUDA); "
                        "default: float32 on the CPU backend, as stored on Metal/CUDA")
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="DSpark: cut a draft at the confidence threshold (see --confidence-rule; default: the "
                        "threshold this machine's calibration picked, else the drafter's own; 0 = never cut)")
    p.add_argument("--confidence-rule", choices=("slot", "product"), default=None,
                   help="DSpark: 'slot' stops at the first slot whose confidence is below the threshold (DeepSpec's "
                        "rule), 'product' where the running product of confidences falls below it (default: the "
                        "rule this machine's calibration picked, else the drafter's own, else slot)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="DSpark: draft from the first N tokens of the drafter's draft_vocab.json (most frequent "
                        "first); 0 = the full vocabulary; default: every token the file lists")
    p.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                   help="quantize the target's full-attention KV cache to this many bits (group size 64) on "
                        "Metal/CUDA; off on the CPU backend, where quantized kernels are slower than float")
    p.add_argument("--lookup-first", action=argparse.BooleanOptionalAction, default=None,
                   help="model drafters: take n-gram lookup's draft when the context repeats itself, the drafter's "
                        "otherwise (default: the registry's choice for the pair)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def add_prefix_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The prefix cache: stored prompt prefixes are restored instead of prefilled again."""
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt from its first token (no reuse across turns and requests)")
    p.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MB",
                   help="memory for stored prefixes (default: a quarter of the memory available at start)")
    p.add_argument("--prefix-cache-dir", nargs="?", const="", default=None, metavar="DIR",
                   help="also keep prefixes on disk, across restarts (default folder: ~/.cache/tandem/prefix), "
                        "and the history of earlier requests that lookup drafts from")
    p.add_argument("--prefix-cache-disk-mb", type=float, default=None, metavar="MB",
                   help="size cap of the disk tier (default 4096)")
    p.add_argument("--no-suffix-drafts", action="store_true",
                   help="n-gram lookup drafts from the current context only, not from earlier requests")


def parse_max_draft(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-draft takes an integer or 'auto', got '{value}'")


def calibrate_first(engine: "Engine", mode: str, max_draft: int | str | None) -> "Engine":
    """Measure now, with a bar on stderr, the calibration that the first request in ``mode`` would
    otherwise measure before its first token (``Engine.prepare``: ``--max-draft auto``'s, once per
    machine and model, then cached). Returns the engine."""
    from engine.calibrate import tqdm_progress

    progress, close = tqdm_progress("calibrating this machine for speculation (once per model)")  # drawn if it runs
    try:
        engine.prepare(mode, max_draft, progress)
    finally:
        close()
    return engine


def warm_up(engine: "Engine", modes: list[str], rows: int | None = 1) -> "Engine":
    """Where a backend compiles per shape (CUDA), compile the shapes ``modes`` will use now, for
    batches of up to ``rows`` requests (None: ``--max-batch``'s default), with a progress bar on
    stderr; elsewhere nothing to do. Returns the engine."""
    if engine.target.shapes is None:
        return engine
    from engine import batching
    from engine.calibrate import tqdm_progress

    rows = batching.default_max_batch(engine) if rows is None else rows
    progress, close = tqdm_progress("warming up")
    try:
        batching.warm_up(engine, modes, rows, progress)
    finally:
        close()
    return engine


def load_engine(args: argparse.Namespace) -> "Engine":
    from engine.api import load
    from engine.calibrate import tqdm_progress

    check_prefix_cache_arguments(args)
    progress, close = tqdm_progress("timing this CPU's matmuls (once per model)")  # drawn only if it runs
    try:
        engine = load(args.model, drafter=getattr(args, "drafter", None),
                      draft_model=getattr(args, "draft_model", None),
                      drafter_bits=getattr(args, "drafter_bits", None),
                      confidence_threshold=getattr(args, "confidence_threshold", None),
                      confidence_rule=getattr(args, "confidence_rule", None), dtype=getattr(args, "dtype", None),
                      draft_vocab=getattr(args, "draft_vocab", None), lookup_first=getattr(args, "lookup_first", None),
                      kv_bits=getattr(args, "kv_bits", None), progress=progress)
    finally:
        close()
    disk = None
    if hasattr(args, "no_prefix_cache"):
        disk = args.prefix_cache_dir
        if disk == "":
            from engine.prefix_disk import default_dir

            disk = str(default_dir())
        engine.configure_prefix_cache(not args.no_prefix_cache, memory_mb=args.prefix_cache_mb, disk_dir=disk,
                                      disk_mb=args.prefix_cache_disk_mb)
        disk = None if args.no_prefix_cache else disk
    # The history lookup drafts from is kept beside the prefix cache's disk tier when that is on.
    engine.configure_suffix_drafts(not getattr(args, "no_suffix_drafts", False), disk_dir=disk)
    return engine


def check_prefix_cache_arguments(args: argparse.Namespace) -> None:
    """Refuse bad prefix cache flags before a model loads."""
    from engine.errors import TandemError

    for flag in ("prefix_cache_mb", "prefix_cache_disk_mb"):
        value = getattr(args, flag, None)
        if value is not None and value < 0:
            raise TandemError(f"--{flag.replace('_', '-')} must be >= 0, got {value:g}")
    folder = getattr(args, "prefix_cache_dir", None)
    if folder:
        from pathlib import Path

        path = Path(folder).expanduser()
        if path.exists() and not path.is_dir():
            raise TandemError(f"--prefix-cache-dir {folder}: not a folder")
