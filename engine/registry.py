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
``"auto": false`` (and a ``"why"``) still gives ``--mode dspark/dflash/eagle3`` its drafter, but
``--mode auto`` passes it over: measured slower than lookup for that target. An ``mtp`` row's
drafter is ``model:mtp``, the target checkpoint's own MTP head: usable when the loaded folder
still has its ``mtp.*`` tensors (mlx-community conversions strip them).
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import lru_cache
from pathlib import Path

from engine import starter
from engine.errors import TandemError
from engine.protocols import EngineLike

LABELS = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "EAGLE-3", "mtp": "MTP"}
OWN_HEAD = "model:mtp"  # an mtp row's drafter: the target checkpoint's own MTP head

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
            raise TandemError(f"{path}: pair {i} has mode '{row['mode']}' ({', '.join(LABELS)})")
        if (row["mode"] == "mtp") != (row["drafter"] == OWN_HEAD):
            raise TandemError(f"{path}: pair {i}: an mtp row's drafter is '{OWN_HEAD}', and only an mtp row's")
    return tuple(rows)


def rows() -> list[dict]:
    return list(_load(str(registry_path())))


def match_names(engine_or_name: EngineLike | str) -> list[str]:
    """The names a model is matched on: the name given, or a loaded engine's (its name, folder and
    source), each with the built-in model it names (``smollm2`` -> ``SmolLM2-135M-Instruct``), so
    ``tandem models --model X`` finds the rows ``--model X --mode ...`` runs with."""
    if isinstance(engine_or_name, str):
        names = [engine_or_name]
    else:
        names = [engine_or_name.name]
        loaded = getattr(engine_or_name, "loaded", None)
        if loaded is not None:
            names.append(Path(str(loaded.path)).name)
            names.append(str(loaded.source).split(":", 1)[-1])
    out = []
    for name in filter(None, (str(n).strip() for n in names)):
        builtin = starter.builtin_model(name)
        out += [name, builtin.display_name, builtin.name] if builtin else [name]
    return out


def rows_for(engine_or_name: EngineLike | str, mode: str | None = None) -> list[dict]:
    """Registry rows for this model (any quantization), in preference order."""
    keys = {base_name(n) for n in match_names(engine_or_name)}
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
    """Whether the row's drafter is on this machine (bundled, or in the local HF cache; an own
    MTP head comes with the model)."""
    from engine.drafters.checkpoint import resolve_drafter_path

    if row.get("supported", True) is False:
        return False
    if row["drafter"] == OWN_HEAD:
        return True
    try:
        resolve_drafter_path(row["drafter"])
        return True
    except TandemError:
        return False


def _usable(row: dict, engine: EngineLike) -> bool:
    """Available, in a format we run, and made for this target (configs and headers only)."""
    from engine.drafters import formats
    from engine.drafters.block import check_compatible, parse_config
    from engine.drafters.checkpoint import read_config, resolve_drafter_path

    if not available(row):
        return False
    try:
        if row["drafter"] == OWN_HEAD:
            return engine.drafter_path is None and own_mtp_problem(engine) is None
        path = resolve_drafter_path(row["drafter"])
        raw = read_config(path)
        where = f"drafter {path}"
        kind = formats.drafter_kind(raw, where)
        if kind == "eagle3":
            formats.check_eagle3_compatible(formats.parse_eagle3_config(raw, engine.target.num_layers, where),
                                            engine.target, where)
        else:
            check_compatible(parse_config(raw, where), engine.target, where)
    except TandemError:
        return False
    return kind == row["mode"]


def usable_row(engine: EngineLike, mode: str | None = None, *, for_auto: bool = False) -> dict | None:
    for row in rows_for(engine, mode):
        if (not for_auto or row.get("auto", True)) and _usable(row, engine):
            return row
    return None


def missing_drafter_message(engine: EngineLike, mode: str) -> str:
    """Why ``--mode dspark/dflash/eagle3`` has no drafter for this engine, and what to do."""
    label = LABELS.get(mode, mode)
    found = rows_for(engine, mode)
    if not found:
        article = "an" if label[0] in "AEIOU" else "a"
        return (f"--mode {mode} needs {article} {label} drafter: pass --drafter (a checkpoint folder or Hugging Face repo id); "
                f"none is registered for {engine.name}")
    row = found[0]
    if row.get("supported", True) is False:
        return f"--mode {mode}: the registered drafter {row['drafter']} for {engine.name} is not supported ({row.get('why', 'unsupported format')})"
    if not available(row):
        return (f"--mode {mode}: the registered drafter {row['drafter']} for {engine.name} is not in the local "
                f"Hugging Face cache; download it (hf download {row['drafter']}) or pass --drafter")
    return f"--mode {mode}: the registered drafter {row['drafter']} does not fit {engine.name}; pass --drafter"


def model_config(engine: EngineLike) -> dict:
    """The target's config.json (or, for a model built in code, its args)."""
    loaded = getattr(engine, "loaded", None)
    if loaded is not None and isinstance(getattr(loaded, "config", None), dict):
        return loaded.config
    try:
        return dataclasses.asdict(getattr(engine.model, "args", None))
    except TypeError:
        return {}


def model_folder(engine: EngineLike) -> Path | None:
    loaded = getattr(engine, "loaded", None)
    return Path(str(loaded.path)) if loaded is not None and getattr(loaded, "path", None) else None


def own_mtp_problem(engine: EngineLike) -> str | None:
    """Why the target's own MTP head cannot draft (none in its folder, a layout we do not run), or None."""
    from engine.drafters import formats

    try:
        problem = formats.mtp_layout_problem(model_config(engine), engine.name)
        if problem is None and not formats.mtp_files(model_folder(engine), model_config(engine)):
            problem = (f"{engine.name} ships no MTP head (mlx-community conversions strip it): load the original "
                       f"checkpoint or pass an MTP sidecar with --drafter")
    except TandemError as e:
        problem = str(e)
    return problem


def drafter_path_kind(spec: str) -> str:
    """The kind of drafter ``--drafter`` names ('mtp' for a bare .safetensors sidecar)."""
    from engine.drafters.checkpoint import read_config, resolve_drafter_path
    from engine.drafters.formats import drafter_kind, mtp_files

    file = Path(spec).expanduser()
    if file.is_file() and file.suffix == ".safetensors":
        return "mtp"
    path = resolve_drafter_path(spec)
    if not (path / "config.json").is_file() and mtp_files(path):  # a bare sidecar folder
        return "mtp"
    return drafter_kind(read_config(path), f"drafter {path}")


def auto_mode(engine: EngineLike) -> str:
    """The mode --mode auto runs (see the module docstring)."""
    if engine.target.speculation_blocker() is not None:
        return "baseline"
    if engine.drafter_path:
        return drafter_path_kind(engine.drafter_path)
    row = usable_row(engine, for_auto=True)
    return row["mode"] if row else "lookup"


def drafter_problem(engine: EngineLike, mode: str) -> str | None:
    """Why ``--mode dspark/dflash/eagle3/mtp`` cannot run on this engine (no drafter on this
    machine, no MTP head, or the --drafter checkpoint is of another kind), or None. Reads configs
    and file headers only."""
    if engine.drafter_path:
        try:
            kind = drafter_path_kind(engine.drafter_path)
        except TandemError as e:
            return str(e)
        return None if kind == mode else f"the drafter {engine.drafter_path} is a {LABELS[kind]} checkpoint (--mode {kind})"
    if mode == "mtp":
        return own_mtp_problem(engine)
    return None if usable_row(engine, mode) else missing_drafter_message(engine, mode)
