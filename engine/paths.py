"""Where the product's own files are: ``resources/`` beside the ``engine`` package (the source
tree, an installed wheel and the macOS bundle all lay it out that way), and Tandem's cache
folder. Imports no MLX."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def resources_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "resources"


def cache_root() -> Path:
    """Tandem's cache folder: ``$TANDEM_CACHE_DIR`` or ``$XDG_CACHE_HOME/tandem`` (~/.cache/tandem)."""
    if env := os.environ.get("TANDEM_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem"


def config_root() -> Path:
    """Tandem's settings folder, outside the cache: ``$TANDEM_CONFIG_DIR`` or
    ``$XDG_CONFIG_HOME/tandem`` (~/.config/tandem)."""
    if env := os.environ.get("TANDEM_CONFIG_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "tandem"


def read_json(path: Path) -> dict:
    """A cache file's JSON object, or {} when it is missing, unreadable, damaged or not an object:
    a cache is rebuilt, never fatal."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON through a temp file and a rename: a reader (another process too) sees
    the old file or the whole new one, never half of it. Raises OSError (a read-only folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
