"""Where the product's own files are: ``resources/`` beside the ``engine`` package (the source
tree, an installed wheel and the macOS bundle all lay it out that way). Imports no MLX."""

from __future__ import annotations

from pathlib import Path


def resources_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "resources"
