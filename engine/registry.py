"""Known target -> drafter pairs (``resources/registry.json``), --mode auto, ``tandem models``.

Rows match on the model's *base name*: the organisation, a ``.gguf`` extension and trailing
quantization/format tags are dropped and case is ignored, so ``Qwen/Qwen3-8B``,
``mlx-community/Qwen3-8B-4bit``, ``Qwen3-8B-bf16`` and ``Qwen3-8B-MLX-8bit`` all find the
``Qwen3-8B`` rows. A row's drafter is a Hugging Face repo id, used only when it is already in
the local HF cache (we never download behind the user's back), or ``resources:<path>`` for a
drafter bundled with the app.

``auto_mode`` picks, in order: baseline when the target's cache cannot be rolled back; the
checkpoint's own format when the user gave ``--drafter``; the first registry row whose drafter
is on this machine and passes the compatibility checks; else n-gram lookup. So every model
runs, and a mode that needs a missing file is never chosen silently. A row with
``"auto": false`` (and a ``"why"``) still gives ``--mode dspark/dflash`` its drafter, but
``--mode auto`` passes it over: measured slower than lookup for that target.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from engine.errors import TandemError

if TYPE_CHECKING:
    from engine.generate import Engine

LABELS = {"dspark": "DSpark", "dflash": "DFlash"}

# Trailing tags that name a quantization or packaging, not a model.
_TAG = re.compile(
    r"[-_.](?:\d+(?:\.\d+)?-?bits?|bf16|fp16|f16|fp32|f32|float16|bfloat16|float32|fp8|int[48]|w\d+a\d+|"
    r"mxfp\d|nvfp\d|mlx|dwq|awq|gptq|exl2|gguf|qat|ud|dq|q\d(?:_[0-9a-z]+)*|iq\d(?:_[0-9a-z]+)*)$",
    re.IGNORECASE,
)


def base_name(name: str) -> str:
    """``mlx-community/Qwen3-8B-4bit`` -> ``qwen3-8b``."""
    text = str(name).strip().rstrip("/")
    text = re.split(r"[/\\]", text)[-1]
    if text.lower().endswith(".gguf"):
        text = text[:-5]
    text = text.lower()
    while True:
        m = _TAG.search(text)
        if not m or m.start() == 0:
            return text
        text = text[: m.start()]


def registry_path() -> Path:
    from engine.paths import resources_dir

    return resources_dir() / "registry.json"


@lru_cache(maxsize=4)
def _load(path: str) -> tuple[dict, ...]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return ()
    except (OSError, ValueError) as e:
        raise TandemError(f"{path}: unreadable registry ({e})") from None
    rows = data.get("pairs") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise TandemError(f"{path}: registry has no 'pairs' list")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("target", "mode", "drafter")):
            raise TandemError(f"{path}: pair {i} needs string 'target', 'mode' and 'drafter'")
        if row["mode"] not in LABELS:
            raise TandemError(f"{path}: pair {i} has mode '{row['mode']}' (dspark or dflash)")
    return tuple(rows)


def rows() -> list[dict]:
    return list(_load(str(registry_path())))


def _names(engine_or_name: "Engine | str") -> list[str]:
    if isinstance(engine_or_name, str):
        return [engine_or_name]
    names = [engine_or_name.name]
    loaded = getattr(engine_or_name, "loaded", None)
    if loaded is not None:
        names.append(Path(str(loaded.path)).name)
        names.append(str(loaded.source).split(":", 1)[-1])
    return names


def rows_for(engine_or_name: "Engine | str", mode: str | None = None) -> list[dict]:
    """Registry rows for this model (any quantization), in preference order."""
    keys = {base_name(n) for n in _names(engine_or_name) if n}
    out = []
    for row in rows():
        targets = [row["target"], *row.get("aliases", [])]
        if keys & {base_name(t) for t in targets} and (mode is None or row["mode"] == mode):
            out.append(row)
    return out


def lookup(model_name: str) -> dict | None:
    """The preferred registry row for a model name, or None."""
    found = rows_for(model_name)
    return found[0] if found else None


def available(row: dict) -> bool:
    """Whether the row's drafter is on this machine (bundled, or in the local HF cache)."""
    from engine.drafters.block import resolve_drafter_path

    if row.get("supported", True) is False:
        return False
    try:
        resolve_drafter_path(row["drafter"])
        return True
    except TandemError:
        return False


def _usable(row: dict, engine: "Engine") -> bool:
    """Available, in a format we run, and made for this target (config checks only)."""
    from engine.drafters import block

    if not available(row):
        return False
    try:
        path = block.resolve_drafter_path(row["drafter"])
        cfg = block.parse_config(block.read_config(path), f"drafter {path}")
        block.check_compatible(cfg, engine.target, f"drafter {path}")
    except TandemError:
        return False
    return cfg.kind == row["mode"]


def usable_row(engine: "Engine", mode: str | None = None, *, for_auto: bool = False) -> dict | None:
    for row in rows_for(engine, mode):
        if (not for_auto or row.get("auto", True)) and _usable(row, engine):
            return row
    return None


def missing_drafter_message(engine: "Engine", mode: str) -> str:
    """Why ``--mode dspark/dflash`` has no drafter for this engine, and what to do."""
    label = LABELS.get(mode, mode)
    found = rows_for(engine, mode)
    if not found:
        return (f"--mode {mode} needs a {label} drafter: pass --drafter (a checkpoint folder or Hugging Face repo id); "
                f"none is registered for {engine.name}")
    row = found[0]
    if row.get("supported", True) is False:
        return f"--mode {mode}: the registered drafter {row['drafter']} for {engine.name} is not supported ({row.get('why', 'unsupported format')})"
    if not available(row):
        return (f"--mode {mode}: the registered drafter {row['drafter']} for {engine.name} is not in the local "
                f"Hugging Face cache; download it (hf download {row['drafter']}) or pass --drafter")
    return f"--mode {mode}: the registered drafter {row['drafter']} does not fit {engine.name}; pass --drafter"


def auto_mode(engine: "Engine") -> str:
    """The mode --mode auto runs (see the module docstring)."""
    from engine.drafters import block

    if not engine.target.can_rollback:
        return "baseline"
    if engine.drafter_path:
        path = block.resolve_drafter_path(engine.drafter_path)
        return block.checkpoint_kind(block.read_config(path), f"drafter {path}")
    row = usable_row(engine, for_auto=True)
    return row["mode"] if row else "lookup"


# ----------------------------------------------------------------------------------------
# tandem models
# ----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="show only the registry rows this model name matches")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _status(row: dict) -> str:
    if row.get("supported", True) is False:
        return "unsupported"
    return "yes" if available(row) else "no"


def _table(headers: list[str], body: Iterable[list[str]]) -> str:
    body = [list(map(str, r)) for r in body]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in body)])


def builtin_models() -> list[dict]:
    try:
        from engine.starter import list_builtin_models
    except ImportError:
        return []
    return list_builtin_models()


def run(args: argparse.Namespace) -> int:
    selected = rows_for(args.model) if args.model else rows()
    table = [dict(row, base_name=base_name(row["target"]), local=_status(row)) for row in selected]
    builtins = [] if args.model else builtin_models()
    if args.json:
        print(json.dumps({"builtin": builtins, "registry": table}, indent=2))
        return 0
    if builtins:
        print("Built-in models (work offline once installed):")
        print(_table(["name", "model", "installed", "about"],
                     [[m["name"] + (" (default)" if m.get("default") else ""), m["display_name"],
                       "yes" if m["installed"] else "no", m["description"]] for m in builtins]))
        print()
    if args.model and not table:
        print(f"No registered drafter for {args.model} (base name '{base_name(args.model)}'); --mode auto uses lookup.")
        return 0
    print(f"Drafter registry ({registry_path()}):")
    print(_table(["target", "base-name match", "mode", "drafter", "local", "auto"],
                 [[r["target"], r["base_name"], r["mode"], r["drafter"], r["local"],
                   "yes" if r.get("auto", True) else "no"] for r in table]))
    print("\nlocal: 'yes' = bundled or in the local Hugging Face cache (never downloaded automatically).",
          file=sys.stdout)
    print("auto: 'no' = used by --mode dspark/dflash, passed over by --mode auto:")
    for r in table:
        if not r.get("auto", True):
            print(f"  {r['target']} ({r['mode']}): {r.get('why', 'measured slower than lookup')}")
    return 0
