"""Searching the Hugging Face Hub for models: results with their format, size and parameter
count, and (GGUF repos, on demand) the files to choose from. Qt-free and MLX-free; every call
does network I/O, so the Models tab runs them on a background thread (app.background).

Facts behind the choices (huggingface_hub 2.4):
* ``HfApi.list_models`` has no timeout and retries connection errors with backoff, so a search
  first checks that the Hub answers at all (``hub.check_reachable``, proxy-aware);
* MLX and GGUF repos are tagged ``mlx`` / ``gguf`` (their library name), which ``filter`` matches;
* ``expand=["safetensors"]`` gives the stored parameter count per dtype (so the download size of
  a safetensors repo); ``expand=["gguf"]`` the parameter count and architecture of a GGUF repo,
  whose files (one per quantization) only ``model_info(files_metadata=True)`` sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from app.hub import CONNECT_TIMEOUT_S, check_reachable, hub_error
from engine.errors import TandemError

FORMATS = {"MLX": "mlx", "GGUF": "gguf", "Any format": None}  # the tab's choices -> Hub tag filter
EXPAND = ["downloads", "likes", "lastModified", "library_name", "tags", "safetensors", "gguf", "pipeline_tag"]
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
SEARCH_LIMIT = 40
_BITS = re.compile(r"(\d+)[-_]?bits?\b", re.IGNORECASE)


@dataclass
class SearchResult:
    """One Hub repo in the search table."""

    repo_id: str
    format: str  # "MLX", "GGUF", "safetensors" or "" (something else)
    downloads: int = 0
    likes: int = 0
    updated: str = ""  # YYYY-MM-DD
    size_bytes: Optional[int] = None  # what a download brings (safetensors repos; GGUF: per file, on demand)
    params: Optional[int] = None  # the model's parameter count (estimated for quantized MLX repos)
    architecture: str = ""
    pipeline: str = ""
    files: Optional[list[tuple[str, int]]] = field(default=None)  # GGUF files and sizes, once fetched


def result_format(library: Optional[str], tags: list[str], has_gguf: bool, has_safetensors: bool) -> str:
    tags = [t.lower() for t in tags]
    if library == "mlx" or "mlx" in tags:
        return "MLX"
    if library == "gguf" or "gguf" in tags or has_gguf:
        return "GGUF"
    return "safetensors" if has_safetensors else ""


def safetensors_sizes(parameters: dict[str, int], repo_id: str = "") -> tuple[int, int]:
    """(stored bytes, parameter count) from the Hub's per-dtype counts. MLX quantized weights
    are packed into U32 words: 32 / bits parameters each, bits read from the repo name
    ("...-4bit"), else 4, the common case (the scales and biases make this a slight overestimate)."""
    stored = sum(n * DTYPE_BYTES.get(dtype.upper(), 2) for dtype, n in parameters.items())
    packed = parameters.get("U32", 0)
    m = _BITS.search(repo_id)
    bits = int(m.group(1)) if m and 1 <= int(m.group(1)) <= 16 else 4
    params = sum(n for dtype, n in parameters.items() if dtype != "U32") + packed * 32 // bits
    return stored, params


def to_result(info) -> SearchResult:
    """A ``huggingface_hub.ModelInfo`` (fields from ``EXPAND``) as a table row."""
    safetensors = getattr(info, "safetensors", None)
    gguf = getattr(info, "gguf", None) or {}
    fmt = result_format(getattr(info, "library_name", None), list(getattr(info, "tags", None) or []),
                        bool(gguf), bool(safetensors))
    size = params = None
    if safetensors and fmt != "GGUF":
        size, params = safetensors_sizes(dict(safetensors.parameters), info.id)
    if gguf.get("total"):
        params = int(gguf["total"])
    updated = info.last_modified.date().isoformat() if getattr(info, "last_modified", None) else ""
    return SearchResult(repo_id=info.id, format=fmt, downloads=int(info.downloads or 0), likes=int(info.likes or 0),
                        updated=updated, size_bytes=size, params=params,
                        architecture=str(gguf.get("architecture") or ""),
                        pipeline=str(getattr(info, "pipeline_tag", None) or ""))


def search(text: str, fmt: str = "MLX", *, endpoint: Optional[str] = None, limit: int = SEARCH_LIMIT,
           timeout: float = CONNECT_TIMEOUT_S) -> list[SearchResult]:
    """Models matching ``text`` in the chosen format, most downloaded first; a one-line
    ``TandemError`` when offline, unreachable (proxy honoured) or on an HTTP error."""
    from huggingface_hub import HfApi, constants

    if fmt not in FORMATS:
        raise TandemError(f"unknown format '{fmt}': choose one of {', '.join(FORMATS)}")
    if constants.is_offline_mode():
        raise TandemError("offline (HF_HUB_OFFLINE is set): searching the Hub needs a network connection")
    endpoint = endpoint or constants.ENDPOINT
    check_reachable(endpoint, timeout)
    try:
        infos = HfApi(endpoint=endpoint).list_models(search=text.strip() or None, filter=FORMATS[fmt],
                                                     sort="downloads", limit=limit, expand=EXPAND)
        return [to_result(info) for info in infos]
    except Exception as err:
        raise hub_error(err, f"search for '{text}'") from None


def gguf_files(repo_id: str, *, endpoint: Optional[str] = None, timeout: float = CONNECT_TIMEOUT_S
               ) -> list[tuple[str, int]]:
    """A GGUF repo's model files with their sizes (vision projectors left out)."""
    from huggingface_hub import HfApi, constants

    endpoint = endpoint or constants.ENDPOINT
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, files_metadata=True, timeout=max(timeout, 10.0))
    except Exception as err:
        raise hub_error(err, f"listing the files of '{repo_id}'") from None
    return sorted(((s.rfilename, int(s.size or 0)) for s in info.siblings or []
                   if s.rfilename.lower().endswith(".gguf") and "mmproj" not in s.rfilename.lower()),
                  key=lambda f: f[0])
