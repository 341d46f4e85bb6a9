"""Where the product's own files are: ``resources/`` beside the ``engine`` package (the source
tree, an installed wheel and the macOS bundle all lay it out that way), and Tandem's cache
folder. Imports no MLX."""

from __future__ import annotations

import os
from pathlib import Path


def resources_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "resources"


def cache_root() -> Path:
    """Tandem's cache folder: ``$TANDEM_CACHE_DIR`` or ``$XDG_CACHE_HOME/tandem`` (~/.cache/tandem)."""
    if env := os.environ.get("TANDEM_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem"
