"""``tandem doctor``: which backend, BLAS and dtype are in use, and why."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from engine.doctor import format_doctor

    print(format_doctor())
    return 0
