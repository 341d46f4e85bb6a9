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

import json
import re
from functools import lru_cache
from pathlib import Path

from engine.errors import TandemError
from engine.protocols import EngineLike

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


def _names(engine_or_name: EngineLike | str) -> list[str]:
    if isinstance(engine_or_name, str):
        return [engine_or_name]
    names = [engine_or_name.name]
    loaded = getattr(engine_or_name, "loaded", None)
    if loaded is not None:
        names.append(Path(str(loaded.path)).name)
        names.append(str(loaded.source).split(":", 1)[-1])
    return names


def rows_for(engine_or_name: EngineLike | str, mode: str | None = None) -> list[dict]:
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
    from engine.drafters.checkpoint import resolve_drafter_path

    if row.get("supported", True) is False:
        return False
    try:
        resolve_drafter_path(row["drafter"])
        return True
    except TandemError:
        return False


def _usable(row: dict, engine: EngineLike) -> bool:
    """Available, in a format we run, and made for this target (config checks only)."""
    from engine.drafters.block import check_compatible, parse_config
    from engine.drafters.checkpoint import read_config, resolve_drafter_path

    if not available(row):
        return False
    try:
        path = resolve_drafter_path(row["drafter"])
        cfg = parse_config(read_config(path), f"drafter {path}")
        check_compatible(cfg, engine.target, f"drafter {path}")
    except TandemError:
        return False
    return cfg.kind == row["mode"]


def usable_row(engine: EngineLike, mode: str | None = None, *, for_auto: bool = False) -> dict | None:
    for row in rows_for(engine, mode):
        if (not for_auto or row.get("auto", True)) and _usable(row, engine):
            return row
    return None


def missing_drafter_message(engine: EngineLike, mode: str) -> str:
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


def auto_mode(engine: EngineLike) -> str:
    """The mode --mode auto runs (see the module docstring)."""
    from engine.drafters.block import checkpoint_kind
    from engine.drafters.checkpoint import read_config, resolve_drafter_path

    if engine.target.speculation_blocker() is not None:
        return "baseline"
    if engine.drafter_path:
        path = resolve_drafter_path(engine.drafter_path)
        return checkpoint_kind(read_config(path), f"drafter {path}")
    row = usable_row(engine, for_auto=True)
    return row["mode"] if row else "lookup"


def block_drafter_problem(engine: EngineLike, mode: str) -> str | None:
    """Why ``--mode dspark/dflash`` cannot run on this engine (no drafter on this machine, or the
    --drafter checkpoint is of the other kind), or None. Reads configs only."""
    from engine.drafters.block import checkpoint_kind
    from engine.drafters.checkpoint import read_config, resolve_drafter_path

    if engine.drafter_path:
        try:
            path = resolve_drafter_path(engine.drafter_path)
            kind = checkpoint_kind(read_config(path), f"drafter {path}")
        except TandemError as e:
            return str(e)
        return None if kind == mode else f"the drafter {engine.drafter_path} is a {LABELS[kind]} checkpoint (--mode {kind})"
    return None if usable_row(engine, mode) else missing_drafter_message(engine, mode)
