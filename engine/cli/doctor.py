"""``tandem doctor``: which backend, BLAS and dtype are in use, and why."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, nargs="?", const="",
                   help="also load this model (no value: the starter) and show its caches and the modes it runs, "
                        "or why it runs baseline")


def run(args: argparse.Namespace) -> int:
    from engine.doctor import format_doctor

    print(format_doctor(args.model))
    return 0
