"""``tandem app``: open the desktop app. The engine never imports Qt; the app package is
imported only when this command runs, and a missing PySide6 is a one-line error."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from engine.errors import TandemError

INSTALL_HINT = "pip install 'mlx-tandem[app]'  (PySide6-Essentials <6.12 on Python 3.11, and pyqtgraph)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model to load at start (default: the starter model)")
    p.add_argument("--drafter", default=None, help="DSpark/DFlash drafter to load with it")
    p.add_argument("--quit-after", type=float, default=None, metavar="SECONDS",
                   help="close the window after this many seconds (smoke tests)")


def missing_dependencies() -> list[str]:
    return [name for name in ("PySide6", "pyqtgraph") if importlib.util.find_spec(name) is None]


def no_display_reason() -> str | None:
    """Qt aborts the process when Linux has no screen to open; say so in one line instead."""
    if sys.platform != "linux" or os.environ.get("QT_QPA_PLATFORM"):
        return None
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        return None
    return ("no display found (DISPLAY and WAYLAND_DISPLAY are unset): run it in a desktop session, or on a "
            "virtual screen with `xvfb-run -a tandem app`; `tandem generate` and `tandem serve` need no display")


def run(args: argparse.Namespace) -> int:
    reason = no_display_reason()
    if reason:
        raise TandemError(reason)
    missing = missing_dependencies()
    if missing:
        raise TandemError(f"the desktop app needs {' and '.join(missing)}: {INSTALL_HINT}")
    try:
        from app.main import run_app
    except ImportError as err:  # e.g. PySide6 present but its Qt libraries (libGL, xcb) are not
        raise TandemError(f"the desktop app could not start: {err}") from None
    return run_app(model=args.model, drafter=args.drafter, quit_after=args.quit_after)
