"""Models other apps already downloaded: LM Studio's and Ollama's local stores, listed so the
user can load them without downloading twice. Qt-free and MLX-free (the Models tab scans on a
background thread).

Layouts (public docs and code of both projects):
* LM Studio keeps Hugging Face's ``publisher/repo`` tree under ``~/.lmstudio/models`` (older
  versions: ``~/.cache/lm-studio/models``): GGUF files (``mmproj-*`` are vision projectors,
  not models) and MLX model folders (``config.json`` + safetensors).
* Ollama keeps OCI-style manifests under ``$OLLAMA_MODELS`` (default ``~/.ollama/models``):
  ``manifests/<registry>/<namespace>/<model>/<tag>`` is JSON whose ``layers`` name blobs by
  digest; the layer with mediaType ``application/vnd.ollama.image.model`` is the GGUF, stored
  as ``blobs/sha256-<hex>`` (the digest's ':' becomes '-'). ``registry.ollama.ai/library/x/tag``
  is what ``ollama`` calls ``x:tag``.

GGUF files load through the engine's GGUF path, which wants a ``.gguf`` name: an Ollama blob is
linked under a readable name in Tandem's cache first (``link_for_loading``).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Optional

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_DEFAULT_REGISTRY = "registry.ollama.ai"
MAX_DEPTH = 4  # publisher/repo/[subfolder/]file: never walk a whole disk by mistake
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def lmstudio_roots(home: Optional[Path] = None) -> list[Path]:
    home = Path(home) if home else Path.home()
    roots, seen = [], set()
    for root in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"):
        if root.is_dir() and root.resolve() not in seen:
            seen.add(root.resolve())
            roots.append(root)
    return roots


def ollama_root(home: Optional[Path] = None) -> Optional[Path]:
    env = os.environ.get("OLLAMA_MODELS")
    root = Path(env).expanduser() if env else (Path(home) if home else Path.home()) / ".ollama" / "models"
    return root if (root / "manifests").is_dir() else None


# -- GGUF headers --------------------------------------------------------------------------------
# gguf.GGUFReader parses every field, the whole vocabulary included (6 s for a 150k-token
# vocabulary here): too slow for a listing. This reads the architecture and sums the tensor
# shapes (the parameter count), skipping every other value.
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFInfo:
    architecture: str
    params: int  # elements over all tensors (quantized blocks counted as the values they hold)
    name: str = ""  # general.name, when present


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) < size:
        raise ValueError("truncated header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    if n > 1 << 24:
        raise ValueError("implausible string length")
    return f.read(n).decode("utf-8", "replace")


def _skip(f: BinaryIO, vtype: int) -> None:
    if vtype in _SCALARS:
        f.seek(_SCALARS[vtype], os.SEEK_CUR)
    elif vtype == _STRING:
        f.seek(_read(f, "<Q"), os.SEEK_CUR)
    elif vtype == _ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item in _SCALARS:
            f.seek(_SCALARS[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


def gguf_info(path: Path) -> Optional[GGUFInfo]:
    """Architecture and parameter count from a GGUF header; None if it is not a readable GGUF."""
    try:
        with open(path, "rb", buffering=1 << 20) as f:
            if f.read(4) != b"GGUF" or _read(f, "<I") < 2:
                return None
            n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
            arch = name = ""
            for _ in range(n_kv):
                key, vtype = _string(f), _read(f, "<I")
                if key in ("general.architecture", "general.name") and vtype == _STRING:
                    value = _string(f)
                    arch, name = (value, name) if key == "general.architecture" else (arch, value)
                else:
                    _skip(f, vtype)
            params = 0
            for _ in range(n_tensors):
                _string(f)
                dims = [_read(f, "<Q") for _ in range(_read(f, "<I"))]
                f.seek(4 + 8, os.SEEK_CUR)  # tensor type, data offset
                count = 1
                for d in dims:
                    count *= d
                params += count
    except (OSError, ValueError, struct.error):
        return None
    return GGUFInfo(arch, params, name)


# -- the stores ----------------------------------------------------------------------------------
@dataclass
class LocalModel:
    """A model found in another app's store."""

    name: str  # what the user knows it as: "publisher/repo/file.gguf", "llama3.2:3b"
    source: str  # "LM Studio" or "Ollama"
    path: Path  # the GGUF file or MLX folder
    format: str  # "GGUF" or "MLX"
    size_bytes: int
    split: bool = False  # one part of a split GGUF


def _walk(root: Path) -> Iterator[tuple[Path, list[str], list[str]]]:
    for folder, dirs, files in os.walk(root, followlinks=False):
        depth = len(Path(folder).relative_to(root).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < MAX_DEPTH else []
        yield Path(folder), dirs, sorted(files)


def scan_lmstudio(home: Optional[Path] = None) -> list[LocalModel]:
    found = []
    for root in lmstudio_roots(home):
        for folder, _, files in _walk(root):
            rel = folder.relative_to(root).as_posix()
            if "config.json" in files and any(f.endswith(".safetensors") for f in files):
                size = sum((folder / f).stat().st_size for f in files if (folder / f).is_file())
                found.append(LocalModel(rel, "LM Studio", folder, "MLX", size))
                continue
            for f in files:
                low = f.lower()
                if not low.endswith(".gguf") or low.startswith("mmproj"):
                    continue
                split = _SPLIT.search(f)
                if split and split.group(1) != "00001":
                    continue  # a split model is listed once, by its first part
                file = folder / f
                try:
                    size = file.stat().st_size
                except OSError:
                    continue
                found.append(LocalModel(f"{rel}/{f}", "LM Studio", file, "GGUF", size, split=bool(split)))
    return found


def ollama_name(manifest: Path, manifests_root: Path) -> str:
    """``registry.ollama.ai/library/llama3.2/3b`` -> ``llama3.2:3b`` (ollama's own short form)."""
    parts = manifest.relative_to(manifests_root).parts
    if len(parts) < 4:
        return "/".join(parts)
    registry, namespace, model, tag = parts[0], "/".join(parts[1:-2]), parts[-2], parts[-1]
    if registry == OLLAMA_DEFAULT_REGISTRY:
        return f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
    return f"{registry}/{namespace}/{model}:{tag}"


def scan_ollama(home: Optional[Path] = None) -> list[LocalModel]:
    root = ollama_root(home)
    if root is None:
        return []
    manifests = root / "manifests"
    found = []
    for folder, _, files in _walk(manifests):
        for f in files:
            manifest = folder / f
            try:
                layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers") or []
            except (OSError, ValueError, AttributeError):
                continue
            model = next((layer for layer in layers if isinstance(layer, dict)
                          and str(layer.get("mediaType", "")).startswith(OLLAMA_MODEL_LAYER)), None)
            digest = str((model or {}).get("digest", ""))
            if not digest.startswith("sha256:"):
                continue  # safetensors-based (tensor layers) or unreadable: not a GGUF
            blob = root / "blobs" / digest.replace(":", "-", 1)
            if not blob.is_file():
                continue
            found.append(LocalModel(ollama_name(manifest, manifests), "Ollama", blob, "GGUF",
                                    int(model.get("size") or blob.stat().st_size)))
    return sorted(found, key=lambda m: m.name)


def link_for_loading(name: str, path: Path, cache_root: Path) -> Path:
    """A path the engine's GGUF loader accepts: the file itself when it is named ``*.gguf``,
    else (an Ollama blob) a symlink ``<cache>/ollama/<name>.gguf`` to it, so the model also
    gets a readable name."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" or path.is_dir():
        return path
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name.replace(":", "-")).strip("-.") or "model"
    link = cache_root / "ollama" / f"{safe}.gguf"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.resolve() == path.resolve():
        return link
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(path)
    return link
