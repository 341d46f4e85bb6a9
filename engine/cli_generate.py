"""``tandem generate``: stream a completion and print a one-line summary."""

from __future__ import annotations

import argparse
import sys

from engine.generate import MODES


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model and drafter selection, shared by generate, calibrate, benchmark and serve."""
    p.add_argument("--model", default=None,
                   help="HF repo id (from the local HF cache), local mlx-lm folder, .gguf file, or a built-in name; "
                        "default: the starter model SmolLM2-135M-Instruct")
    p.add_argument("--drafter", default=None, help="DSpark/DFlash checkpoint: HF repo id or local folder")
    p.add_argument("--draft-model", default=None, help="small autoregressive draft model sharing the tokenizer (--mode draft)")
    p.add_argument("--drafter-bits", type=int, default=None,
                   help="quantize drafter weights to this many bits where quantized matmul is fast (Metal/CUDA; default 4)")
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="DSpark: cut a draft where the running product of confidences falls below this "
                        "(default: the drafter's own setting, if it has one; 0 = never cut)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="DSpark: draft from the first N tokens of the drafter's draft_vocab.json (most frequent "
                        "first); 0 = the full vocabulary; default: every token the file lists")
    p.add_argument("--lookup-first", action=argparse.BooleanOptionalAction, default=None,
                   help="DSpark/DFlash: take n-gram lookup's draft when the context repeats itself, the drafter's "
                        "otherwise (default: the registry's choice for the pair)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def parse_max_draft(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-draft takes an integer or 'auto', got '{value}'")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--mode", default="auto", choices=MODES)
    p.add_argument("--prompt", required=False, default=None, help="the prompt text ('-' reads standard input)")
    p.add_argument("--system", default=None, help="a system message (chat template only)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-draft", type=parse_max_draft, default=None,
                   help="draft cap per round: an integer, 0 for the drafter's full block, or 'auto' "
                        "(calibrated cost curves + live acceptance); default: the mode's calibrated-free default")
    add_sampling_arguments(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--json", action="store_true", help="print the result summary as JSON")


def load_engine(args: argparse.Namespace):
    from engine.api import load

    return load(args.model, drafter=getattr(args, "drafter", None), draft_model=getattr(args, "draft_model", None),
                drafter_bits=getattr(args, "drafter_bits", None),
                confidence_threshold=getattr(args, "confidence_threshold", None),
                draft_vocab=getattr(args, "draft_vocab", None), lookup_first=getattr(args, "lookup_first", None))


def run(args: argparse.Namespace) -> int:
    from engine.errors import TandemError

    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    if prompt is None:
        raise TandemError("--prompt is required (or '-' to read standard input)")
    if not prompt.strip():
        raise TandemError("empty prompt: give some text to continue")
    if args.max_new_tokens < 1:
        raise TandemError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    eng = load_engine(args)
    result = None
    for chunk in eng.stream(prompt, mode=args.mode, max_new_tokens=args.max_new_tokens, max_draft=args.max_draft,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=args.stop, chat_template=not args.no_chat_template, system=args.system):
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        if chunk.result is not None:
            result = chunk.result
    sys.stdout.write("\n")
    if args.json:
        import json

        print(json.dumps(result.to_dict()))
    else:
        print(f"[{eng.name}] {result.summary()}", file=sys.stderr)
    return 0
