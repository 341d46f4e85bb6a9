"""The prefix cache's disk tier: entries survive a restart, one safetensors file each.

Layout: ``<root>/<identity hash>/<token hash>-<crc32>.safetensors`` (root: ``--prefix-cache-dir``,
by default ``~/.cache/tandem/prefix``, respecting ``TANDEM_CACHE_DIR`` / ``XDG_CACHE_HOME``). One
folder per model identity (weights, precision, cache layout, backend, versions), so models never
see each other's entries. The file's metadata repeats the identity and lists the tokens and what
the entry can restore, so listing the folder reads headers only.

A file is written to a temporary name and renamed, so a reader never sees half of one. The CRC32
of the whole file is in its name: a truncated or altered file, or one whose metadata names
another identity, is refused and deleted, never loaded. The folder is kept under a byte cap,
least recently used first.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import time
import uuid
import zlib
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx

from engine import caches
from engine.drafters.base import DrafterState
from engine.paths import cache_root

if TYPE_CHECKING:
    from engine.target import Target

Entry = Any  # engine.prefix_cache.Entry, whose class the store hands to DiskTier (no import cycle)

log = logging.getLogger("tandem.prefix")

DEFAULT_DISK_BYTES = 4 << 30
MIN_DISK_TOKENS = 256  # shorter prefixes are quicker to prefill again than to keep on disk
MAX_HEADER = 64 << 20
FORMAT = "tandem-prefix-file-1"


def default_dir() -> Path:
    return cache_root() / "prefix"


# ----------------------------------------------------------------------------------------
# Encoding: arrays go to the file's tensors, everything else to a JSON skeleton
# ----------------------------------------------------------------------------------------
def _skeleton(tree: Any, key: str, arrays: dict[str, mx.array]) -> Any:
    if isinstance(tree, mx.array):
        arrays[key] = tree
        return {"$a": key}
    if isinstance(tree, (list, tuple)):
        return [_skeleton(x, f"{key}.{i}", arrays) for i, x in enumerate(tree)]
    if isinstance(tree, dict):
        return {"$d": {str(k): _skeleton(v, f"{key}.{k}", arrays) for k, v in tree.items()}}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise TypeError(f"cannot store a {type(tree).__name__} in a prefix cache file")


def _rebuild(skeleton: Any, arrays: dict[str, mx.array]) -> Any:
    if isinstance(skeleton, list):
        return [_rebuild(x, arrays) for x in skeleton]
    if isinstance(skeleton, dict):
        if "$a" in skeleton:
            return arrays[skeleton["$a"]]
        return {k: _rebuild(v, arrays) for k, v in skeleton["$d"].items()}
    return skeleton


def encode_tokens(tokens: Sequence[int]) -> str:
    return base64.b64encode(array("I", tokens).tobytes()).decode()


def decode_tokens(text: str) -> list[int]:
    out = array("I")
    out.frombytes(base64.b64decode(text))
    return out.tolist()


def token_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha256(array("I", tokens).tobytes()).hexdigest()[:24]


def pack(entry: "Entry", identity: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    arrays: dict[str, mx.array] = {}
    final = [_skeleton(s, f"final.{i}", arrays) for i, s in enumerate(entry.final)]  # rows only (compact_snapshot)
    marks = {str(p): {str(i): _skeleton(s, f"mark.{p}.{i}", arrays) for i, s in layers.items()}
             for p, layers in entry.marks.items()}
    logits = {str(p): _skeleton(row, f"logits.{p}", arrays) for p, row in entry.logits.items()}
    drafters = [[key, d.tokens, d.lookahead, _skeleton(d.tree, f"drafter.{j}", arrays)]
                for j, (key, d) in enumerate(entry.drafters.items())]
    meta = {"format": FORMAT, "identity": identity, "tokens": encode_tokens(entry.tokens),
            "classes": json.dumps(entry.classes), "floors": json.dumps(entry.floors),
            "tree": json.dumps({"final": final, "marks": marks, "logits": logits, "drafters": drafters})}
    return arrays, meta


def unpack(entry_type: type, arrays: dict[str, mx.array] | None, meta: dict[str, str]) -> "Entry":
    """An entry from a file's metadata, with its arrays (None: a listing with the arrays left out)."""
    tree = json.loads(meta["tree"])
    fill = (lambda s: _rebuild(s, arrays)) if arrays is not None else (lambda s: None)
    entry = entry_type(decode_tokens(meta["tokens"]), json.loads(meta["classes"]), json.loads(meta["floors"]),
                  [fill(s) for s in tree["final"]] if arrays is not None else None)
    entry.marks = {int(p): {int(i): fill(s) for i, s in layers.items()} for p, layers in tree["marks"].items()}
    entry.logits = {int(p): fill(s) for p, s in tree["logits"].items()}
    entry.drafters = {key: DrafterState(int(tokens), fill(s), int(ahead)) for key, tokens, ahead, s in tree["drafters"]}
    entry.dirty = False
    return entry


def read_metadata(path: Path) -> dict[str, str] | None:
    """A safetensors file's ``__metadata__``, read without loading its tensors; None if unreadable."""
    from engine.loading import safetensors_header

    try:
        header, _ = safetensors_header(path, max_bytes=MAX_HEADER)
    except (OSError, ValueError):
        return None
    meta = header.get("__metadata__")
    return meta if isinstance(meta, dict) else None


def _remove_if_stale(tmp: Path, age_s: float = 3600.0) -> None:
    try:
        if time.time() - tmp.stat().st_mtime > age_s:
            tmp.unlink()
    except OSError:
        pass


# ----------------------------------------------------------------------------------------
# The tier
# ----------------------------------------------------------------------------------------
class DiskTier:
    def __init__(self, root: Path, entry_type: type, max_bytes: int | None = None, min_tokens: int | None = None):
        self.root = root
        self.entry_type = entry_type
        self.max_bytes = DEFAULT_DISK_BYTES if max_bytes is None else max(0, int(max_bytes))
        self.min_tokens = MIN_DISK_TOKENS if min_tokens is None else max(1, int(min_tokens))
        self.identity: str | None = None
        self.dir: Path | None = None
        self._index: dict[Path, "Entry"] | None = None  # file -> its entry without arrays
        self.loads = self.saves = self.refused = 0

    def bind(self, identity: str) -> None:
        self.identity = identity
        self.dir = self.root / hashlib.sha256(identity.encode()).hexdigest()[:20]
        self._index = None

    def _listing(self) -> dict[Path, "Entry"]:
        if self._index is None:
            self._index = {}
            if self.dir is not None and self.dir.is_dir():
                for path in sorted(self.dir.glob("*.safetensors")):
                    if path.name.startswith("."):
                        _remove_if_stale(path)  # a write that was killed half way
                        continue
                    meta = read_metadata(path)
                    if meta is None or meta.get("format") != FORMAT or meta.get("identity") != self.identity:
                        self._refuse(path, "unreadable header or another model's entry")
                        continue
                    try:
                        stub = unpack(self.entry_type, None, meta)
                    except (KeyError, ValueError, TypeError):
                        self._refuse(path, "malformed metadata")
                        continue
                    stub.path = path
                    self._index[path] = stub
        return self._index

    def _refuse(self, path: Path, why: str) -> None:
        self.refused += 1
        log.warning("prefix cache: %s: %s; removed", path.name, why)
        path.unlink(missing_ok=True)
        if self._index is not None:
            self._index.pop(path, None)

    def best(self, prompt: Sequence[int], drafter_key: str | None, needs_state: bool) -> tuple["Entry | None", int]:
        best, p = None, 0
        for stub in self._listing().values():
            q = stub.usable(prompt, drafter_key, needs_state)
            if q > p:
                best, p = stub, q
        return best, p

    def load(self, stub: "Entry", target: "Target") -> "Entry | None":
        """The entry behind a listing, checked end to end; None (and the file deleted) if it fails."""
        path = stub.path
        try:
            data = path.read_bytes()
        except OSError as e:
            self._refuse(path, f"unreadable ({e.strerror or e})")
            return None
        want = path.stem.rpartition("-")[2]
        if f"{zlib.crc32(data):08x}" != want:
            self._refuse(path, "checksum mismatch (truncated or damaged)")
            return None
        try:
            arrays, meta = mx.load(io.BytesIO(data), format="safetensors", return_metadata=True)
            if meta.get("format") != FORMAT or meta.get("identity") != self.identity:
                self._refuse(path, "written for another model, precision or backend")
                return None
            entry = unpack(self.entry_type, arrays, meta)
        except Exception as e:  # a file that passes the checksum but still does not parse
            self._refuse(path, f"malformed ({type(e).__name__}: {e})")
            return None
        classes = [type(c).__name__ for c in caches.leaves(target.new_cache())]
        if entry.classes != classes or len(entry.floors) != len(classes):
            self._refuse(path, "cache layout differs from the model's")
            return None
        entry.path = path
        self.loads += 1
        os.utime(path)  # recently used
        return entry

    def save(self, entry: "Entry") -> None:
        """Write an entry (atomically); drop the files it replaces; keep the folder under its cap."""
        if self.dir is None or self.identity is None or len(entry.tokens) < self.min_tokens or entry.final is None:
            return
        entry.dirty = False
        tmp = None
        try:
            arrays, meta = pack(entry, self.identity)
            if sum(a.nbytes for a in arrays.values()) > self.max_bytes:
                return
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex}.safetensors"
            mx.save_safetensors(str(tmp), arrays, meta)
            crc = zlib.crc32(tmp.read_bytes())
            stem = token_hash(entry.tokens)
            path = self.dir / f"{stem}-{crc:08x}.safetensors"
            os.replace(tmp, path)
            tmp = None
        except Exception as e:  # a full disk or a read-only folder must not fail the generation
            log.warning("prefix cache: could not write to %s: %s", self.dir, e)
            return
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        listing = self._listing()
        for old in [p for p in listing if p != path and (p.stem.rpartition("-")[0] == stem or p in entry.absorbed)]:
            old.unlink(missing_ok=True)
            listing.pop(old, None)
        for old in entry.absorbed:
            old.unlink(missing_ok=True)
        entry.absorbed = []
        if entry.path is not None and entry.path != path:
            entry.path.unlink(missing_ok=True)
            listing.pop(entry.path, None)
        entry.path = path
        stub = unpack(self.entry_type, None, meta)
        stub.path = path
        listing[path] = stub
        self.saves += 1
        self._trim(keep=path)

    def _trim(self, keep: Path) -> None:
        files = []
        for p in self._listing():
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            self._listing().pop(p, None)
            total -= size

    def usage(self) -> tuple[int, int]:
        """(files, bytes) in this model's folder."""
        files = [p for p in self._listing()]
        return len(files), sum(p.stat().st_size for p in files if p.exists())

    def describe(self) -> str:
        if self.dir is None:
            return f"{self.root} (not bound yet)"
        n, size = self.usage()
        return f"{self.dir} ({n} entries, {size / 2**20:.1f} of {self.max_bytes / 2**20:.0f} MiB)"
