"""The ``tandem`` command and its subcommands: argument parsing and entry points only.

Each subcommand is a module here exposing ``add_arguments(parser)`` and ``run(args) -> int``; the
work itself lives in the engine (``engine.generate``, ``engine.calibrate``, ``engine.benchmark``,
``engine.serve``, ``engine.train`` ...). Nothing outside this package imports it. Errors a user
can fix print one line."""

from __future__ import annotations

import argparse
import importlib
import sys

import engine  # noqa: F401  (preloads OpenBLAS before mlx.core is imported anywhere)
from engine.errors import TandemError

# subcommand -> (module, help)
COMMANDS = {
    "generate": ("engine.cli.generate", "generate text from a prompt (streamed) with speculative decoding"),
    "doctor": ("engine.cli.doctor", "report the backend, BLAS, dtype policy and models in use, and why"),
    "models": ("engine.cli.models", "list built-in models and the target -> drafter registry"),
    "calibrate": ("engine.cli.calibrate", "measure this machine's verify/draft cost curves and pick the draft cap"),
    "benchmark": ("engine.cli.benchmark", "compare modes on chat/code/math prompts: tok/s, acceptance, losslessness"),
    "serve": ("engine.cli.serve", "serve OpenAI and Anthropic compatible APIs on one local port"),
    "claude": ("engine.cli.claude", "launch Claude Code against a running tandem server"),
    "train-drafter": ("engine.cli.train", "train a DSpark drafter for a target on this machine"),
    "app": ("engine.cli.app", "open the desktop app"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported (start-up stays fast)."""
    parser = argparse.ArgumentParser(prog="tandem", description="Lossless speculative decoding on MLX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name != command:
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as err:
            if err.name and (err.name == module or module.startswith(err.name + ".")):
                p.set_defaults(_missing=True)
                continue
            raise
        mod.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    if getattr(args, "_missing", False):
        print(f"tandem: '{args.command}' is not available in this installation", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except TandemError as err:
        print(f"tandem: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntandem: interrupted", file=sys.stderr)
        return 130

