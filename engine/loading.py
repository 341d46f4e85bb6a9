"""Resolve a model spec to an mlx-lm folder and load it with the right dtype policy.

A spec is one of: None / a built-in name ("starter", "qwen2.5-coder-0.5b", ...), a ``.gguf``
file (converted once, cached), a local mlx-lm folder, or a Hugging Face repo id that is
already in the local HF cache (downloads only with ``allow_download=True``).

On the CPU backend quantized layers are dequantized and every floating parameter is cast to
float32: MLX's CPU quantized and fp16 kernels are 10-40x slower than BLAS sgemm
(spec/models.md §3). On Metal/CUDA the weights are kept as stored.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from engine import platform, starter
from engine.errors import TandemError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# The files mlx-lm needs from a repo (mirrors mlx_lm.utils.DEFAULT_ALLOW_PATTERNS); restricting
# the offline snapshot check to them avoids IncompleteSnapshotError on unrelated files.
_HF_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]


@dataclass
class LoadedModel:
    model: Any  # mlx.nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    path: Path  # the mlx-lm folder
    name: str  # display name
    source: str  # "builtin:<name>", "gguf:<file>", "folder:<dir>" or "hf:<repo>"
    config: dict
    dtype: str  # dominant floating dtype of the parameters, e.g. "float32"
    quantized: bool
    vision: Any = None  # engine.vision.Vision when loaded through mlx-vlm (its tower and processor)


@dataclass(frozen=True)
class _Resolved:
    path: Path
    name: str
    source: str


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _from_hf_cache(repo: str, allow_download: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, local_files_only=not allow_download, allow_patterns=_HF_PATTERNS))
    except LocalEntryNotFoundError:
        if allow_download:
            raise TandemError(f"model '{repo}' is not in the local Hugging Face cache and could not be downloaded (offline?)") from None
        raise TandemError(
            f"model '{repo}' is not in the local Hugging Face cache; download it first (hf download {repo})"
        ) from None
    except HFValidationError as e:
        raise TandemError(f"'{repo}' is not a valid Hugging Face repo id: {_first_line(e)}") from None
    except Exception as e:  # RepositoryNotFound, gated, incomplete snapshot, HTTP errors...
        raise TandemError(f"model '{repo}' could not be fetched from Hugging Face: {_first_line(e)}") from None


def _check_folder(folder: Path) -> None:
    if (folder / "config.json").is_file():
        return
    ggufs = sorted(folder.glob("*.gguf"))
    hint = f"; to use the GGUF, pass the file: {ggufs[0]}" if ggufs else ""
    raise TandemError(f"{folder}: not an mlx-lm model folder (no config.json){hint}")


def _resolve(spec: Optional[str], allow_download: bool) -> _Resolved:
    from engine.gguf import ensure_converted

    text = "" if spec is None else str(spec).strip()
    builtin = starter.builtin_model(text or None)
    if builtin is not None:
        return _Resolved(starter.builtin_path(builtin.name), builtin.display_name, f"builtin:{builtin.name}")
    p = Path(text).expanduser()
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise TandemError(f"{p}: not a model (expected a .gguf file or an mlx-lm folder)")
        folder = ensure_converted(p)
        return _Resolved(folder, p.stem, f"gguf:{p.resolve()}")
    if p.is_dir():
        _check_folder(p)
        return _Resolved(p, p.resolve().name, f"folder:{p.resolve()}")
    if _REPO_ID.match(text) and not text.lower().endswith(".gguf"):
        folder = _from_hf_cache(text, allow_download)
        _check_folder(folder)
        return _Resolved(folder, text, f"hf:{text}")
    if text.lower().endswith(".gguf") or text.startswith(("/", ".", "~")):
        raise TandemError(f"{p}: no such file or folder")
    known = ", ".join(m.name for m in starter.BUILTIN_MODELS)
    raise TandemError(f"model '{text}' not found: not a file, a folder, a Hugging Face repo id or a built-in name ({known})")


def resolve_model_path(spec: Optional[str], *, allow_download: bool = False) -> Path:
    """The local mlx-lm folder for ``spec`` (converting a GGUF or built-in model if needed)."""
    return _resolve(spec, allow_download).path


class SafetensorsHeaderError(ValueError):
    """A .safetensors header that cannot be read: what is wrong, in a few words."""


def safetensors_header(file: Path, max_bytes: int | None = None) -> tuple[dict, int]:
    """A .safetensors file's JSON header (tensor names -> dtype/shape/offsets, ``__metadata__``)
    and its length in bytes, read without the tensors. Raises OSError or SafetensorsHeaderError."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsHeaderError("truncated (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or (max_bytes is not None and n > max_bytes):
            raise SafetensorsHeaderError(f"truncated or corrupt header (claims {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError:  # UnicodeDecodeError included
            raise SafetensorsHeaderError("corrupt header (not JSON)") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError("corrupt header")
    return header, n


def check_safetensors(file: Path) -> Optional[str]:
    """Why a .safetensors file is unusable (truncated, bad header), or None if it looks fine.

    Reads only the header, so it is cheap; MLX's own errors on such files are cryptic or
    happen lazily at the first eval.
    """
    try:
        size = file.stat().st_size
        header, n = safetensors_header(file)
    except OSError as e:
        return _first_line(e)
    except SafetensorsHeaderError as e:
        return str(e)
    ends = [v.get("data_offsets", [0, 0])[1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    need = 8 + n + max(ends, default=0)
    if need > size:
        return f"truncated (needs {need} bytes, has {size})"
    return None


def _check_weights(folder: Path) -> None:
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise TandemError(f"{folder}: no model*.safetensors weights in the folder")
    for f in files:
        if problem := check_safetensors(f):
            raise TandemError(f"{f}: {problem}")


def _read_config(folder: Path) -> dict:
    file = folder / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TandemError(f"{file}: unreadable config ({_first_line(e)})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise TandemError(f"{file}: no 'model_type' field")
    return config


def _is_quantized(model) -> bool:
    import mlx.nn as nn

    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or "scales" in m for _, m in model.named_modules())


def _dominant_dtype(model) -> str:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    sizes: dict[str, int] = {}
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            key = str(p.dtype).removeprefix("mlx.core.")
            sizes[key] = sizes.get(key, 0) + p.size
    return max(sizes, key=sizes.get) if sizes else "unknown"


def make_dense(model, dtype: str = "float32") -> None:
    """Dequantize quantized layers and cast floating parameters to ``dtype``, in place (lazy)."""
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model

    if _is_quantized(model):
        dequantize_model(model)
    model.set_dtype(getattr(mx, dtype))


def make_dense_float32(model) -> None:
    """Dequantize quantized layers and cast floating parameters to float32, in place."""
    import mlx.core as mx

    make_dense(model)
    mx.eval(model.parameters())


DTYPES = ("float32", "bfloat16", "float16")


def load_model(spec: Optional[str] = None, *, dense: Optional[bool] = None, allow_download: bool = False,
               dtype: Optional[str] = None) -> LoadedModel:
    """Load ``spec`` (see module doc) with mlx-lm; any failure is a one-line TandemError.

    ``dense=None`` follows ``platform.prefers_dense_float32()`` (True on CPU). ``dtype`` casts
    the floating parameters afterwards (quantized weights stay packed; their scales follow).
    """
    if dtype is not None and dtype not in DTYPES:
        raise TandemError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    resolved = _resolve(spec, allow_download)
    folder = resolved.path
    raw_config = _read_config(folder)
    _check_weights(folder)

    import mlx.core as mx
    from mlx_lm.utils import load

    from engine import vision as vision_mod

    if dense is None:
        dense = platform.prefers_dense_float32()
    vision = None

    def set_precision(model) -> None:
        if dense:  # straight to the asked dtype: a float32 copy first would double the peak memory
            make_dense(model, dtype or "float32")
        elif dtype is not None:
            model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())

    try:
        if vision_mod.wants_vlm(raw_config):  # a vision tower, or an architecture only mlx-vlm has
            model, tokenizer, vision, config = vision_mod.load_vlm(folder, set_precision)
            return _loaded(model, tokenizer, resolved, config, dense, vision)
        # lazy: a float16 file is cast straight to float32, never held twice in memory
        model, tokenizer, config = load(str(folder), return_config=True, lazy=True)
        set_precision(model)
    except TandemError:
        raise
    except ValueError as e:
        msg = _first_line(e)
        if m := re.match(r"Model type (\S+) not supported", msg):
            hint = ("; it has a vision tower: install the vision extra (pip install 'mlx-tandem[vision]')"
                    if vision_mod.takes_images(raw_config) and not vision_mod.vlm_installed() else "")
            raise TandemError(f"unknown architecture '{m.group(1).rstrip('.')}' in {folder / 'config.json'}{hint}") from None
        raise TandemError(f"{folder}: cannot load model ({msg})") from None
    except Exception as e:  # mlx / tokenizer errors
        raise TandemError(f"{folder}: cannot load model ({type(e).__name__}: {_first_line(e)})") from None
    return _loaded(model, tokenizer, resolved, config, dense, vision)


def _loaded(model, tokenizer, resolved: _Resolved, config: dict, dense: bool, vision=None) -> LoadedModel:
    if dense:  # the config now describes the dense model that was actually built
        config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=resolved.path,
        name=resolved.name,
        source=resolved.source,
        config=config,
        dtype=_dominant_dtype(model),
        quantized=_is_quantized(model),
        vision=vision,
    )
