"""``tandem generate``: stream a completion and print a one-line summary."""

from __future__ import annotations

import argparse
import sys

from engine.generate import MODES
from engine.processors import parse_logit_bias
from engine.serve.chat_format import template_reads
from engine.options import (add_model_arguments, add_prefix_cache_arguments, add_sampling_arguments,
                            calibrate_first, load_engine, parse_max_draft, warm_up)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--mode", default="auto", choices=MODES)
    p.add_argument("--prompt", required=False, default=None, help="the prompt text ('-' reads standard input)")
    p.add_argument("--system", default=None, help="a system message (chat template only)")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for the prompt (repeatable; a vision model: PNG, JPEG, WebP, GIF, BMP)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-draft", type=parse_max_draft, default=None,
                   help="draft cap per round: an integer, 0 for the drafter's full block, or 'auto' "
                        "(calibrated cost curves + live acceptance); default: 'auto' under --mode auto, else the mode's "
                        "calibrated cap")
    add_sampling_arguments(p)
    add_prefix_cache_arguments(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--no-thinking", action="store_true",
                   help="tell the chat template enable_thinking=false (Qwen3 and others: no reasoning block)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2: minus this for tokens already generated")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="-2..2: minus this times the times a token was generated")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0: divide (multiply when negative) the logits of tokens seen in prompt or output; 1 = off")
    p.add_argument("--logit-bias", type=parse_logit_bias, default=None, metavar="ID:BIAS,...",
                   help="add BIAS (-100..100) to token ID's logit; -100 keeps it out")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="print each token's logprob and its N most likely alternatives (0..20) to standard error")
    p.add_argument("--json", action="store_true", help="print the result summary as JSON")


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
    images = _read_images(args.image, args.no_chat_template)  # before the load: a bad file fails fast
    eng = load_engine(args)
    for note in eng.notes:
        print(f"tandem: {note}", file=sys.stderr)
    if images and (refusal := eng.image_refusal()):
        raise TandemError(refusal)
    template_kwargs = {"enable_thinking": False} if args.no_thinking else None
    if args.no_thinking and not template_reads(eng.tokenizer, "enable_thinking"):
        print(f"tandem: --no-thinking: {eng.name}'s chat template has no enable_thinking switch", file=sys.stderr)
    calibrate_first(eng, args.mode, args.max_draft)  # with a bar, not silently before the first token
    warm_up(eng, [args.mode])
    result = None
    for chunk in eng.stream(prompt, mode=args.mode, max_new_tokens=args.max_new_tokens, max_draft=args.max_draft,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=args.stop, chat_template=not args.no_chat_template, system=args.system,
                            images=images,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty, logit_bias=args.logit_bias,
                            logprobs=args.logprobs, template_kwargs=template_kwargs):
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        if chunk.result is not None:
            result = chunk.result
    sys.stdout.write("\n")
    for t in result.logprobs or ():
        top = " ".join(f"{eng.tokenizer.decode([i])!r}={v:.3f}" for i, v in t.top)
        print(f"{eng.tokenizer.decode([t.token])!r} {t.logprob:.4f}" + (f" | {top}" if top else ""), file=sys.stderr)
    if args.json:
        import json

        print(json.dumps(result.to_dict()))
    else:
        print(f"[{eng.name}] {result.summary()}", file=sys.stderr)
    return 0


def _read_images(paths: list[str], no_chat_template: bool) -> list:
    if not paths:
        return []
    from engine.errors import TandemError
    from engine.images import MAX_IMAGES, read_image_file

    if no_chat_template:
        raise TandemError("--image needs the chat template (it places the image); drop --no-chat-template")
    if len(paths) > MAX_IMAGES:
        raise TandemError(f"{len(paths)} --image files; at most {MAX_IMAGES}")
    return [read_image_file(p) for p in paths]
