"""The prefix cache's disk tier: entries survive a restart, one safetensors file each.

Layout: ``<root>/<identity hash>/<token hash>-<mac>.safetensors`` (root: ``--prefix-cache-dir``,
by default ``~/.cache/tandem/prefix``, respecting ``TANDEM_CACHE_DIR`` / ``XDG_CACHE_HOME``). One
folder per model identity (weights, precision, cache layout, backend, versions), so models never
see each other's entries. The file's metadata repeats the identity and lists the tokens and what
the entry can restore, so listing the folder reads headers only.

Whoever can write the folder must not be able to change what the model says. So the name carries
a keyed hash (BLAKE2b) of the whole file under a per-install secret kept outside the cache folder
(``install_key``: ``~/.config/tandem/prefix-cache.key``): a file is loaded only when its bytes,
tokens included, hash to its name, so a damaged file, or a forged one (one prompt's state under
another prompt's tokens), is refused and deleted, never loaded. Headers are listed before that
check, so they are checked for shape first (``check_meta``): a malformed one is refused and deleted
too, never a failed request.

A file is written to a temporary name and renamed, so a reader never sees half of one; temporary
files a killed writer left are removed when the folder is first listed, and those of live writers
count toward the folder's byte cap (least recently used first).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import re
import time
import uuid
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx

from engine import caches
from engine.drafters.base import DrafterState
from engine.paths import cache_root, config_root

if TYPE_CHECKING:
    from engine.target import Target

Entry = Any  # engine.prefix_cache.Entry, whose class the store hands to DiskTier (no import cycle)

log = logging.getLogger("tandem.prefix")

DEFAULT_DISK_BYTES = 4 << 30
MIN_DISK_TOKENS = 256  # shorter prefixes are quicker to prefill again than to keep on disk
MAX_HEADER = 64 << 20
MAX_TREE_DEPTH = 32  # what pack writes is a few levels deep; a crafted header can be 10^5
STALE_TMP_S = 3600.0  # a temporary file this old is removed even if its writer's pid is in use
FORMAT = "tandem-prefix-file-2"
KEY_FILE = "prefix-cache.key"


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
    except (OSError, ValueError, RecursionError):
        return None
    meta = header.get("__metadata__")
    return meta if isinstance(meta, dict) else None


def _is_int(value: Any, lo: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo


def _check_skeleton(root: Any) -> None:
    """What ``_skeleton`` writes: lists, ``{"$a": name}``, ``{"$d": {key: node}}`` and scalars,
    at most ``MAX_TREE_DEPTH`` deep (walked without recursion)."""
    stack = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise ValueError(f"nested more than {MAX_TREE_DEPTH} levels")
        if isinstance(node, list):
            stack.extend((x, depth + 1) for x in node)
        elif isinstance(node, dict):
            if set(node) == {"$a"} and isinstance(node["$a"], str):
                continue
            if set(node) != {"$d"} or not isinstance(node["$d"], dict):
                raise ValueError("an object that is neither an array reference nor a dict")
            stack.extend((x, depth + 1) for x in node["$d"].values())
        elif node is not None and not isinstance(node, (bool, int, float, str)):
            raise ValueError(f"a {type(node).__name__} in the tree")


def check_meta(meta: dict[str, str]) -> None:
    """The shape of an entry's metadata, checked before any of it is used (a listed header is not
    yet verified by its keyed hash). Raises ValueError naming what is wrong."""
    for key in ("tokens", "classes", "floors", "tree"):
        if not isinstance(meta.get(key), str):
            raise ValueError(f"no '{key}' string")
    n = len(decode_tokens(meta["tokens"]))
    classes, floors = json.loads(meta["classes"]), json.loads(meta["floors"])
    if not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise ValueError("'classes' is not a list of names")
    if not (isinstance(floors, list) and len(floors) == len(classes) and all(_is_int(f) for f in floors)):
        raise ValueError("'floors' is not one integer per cache")
    tree = json.loads(meta["tree"])
    if not (isinstance(tree, dict) and isinstance(tree.get("final"), list) and isinstance(tree.get("marks"), dict)
            and isinstance(tree.get("logits"), dict) and isinstance(tree.get("drafters"), list)):
        raise ValueError("'tree' lacks final, marks, logits or drafters")
    positions = [*tree["marks"], *tree["logits"]]
    if not all(re.fullmatch(r"[0-9]{1,12}", p) and int(p) <= n for p in positions):
        raise ValueError("a mark or logits position outside the tokens")
    for layers in tree["marks"].values():
        if not (isinstance(layers, dict) and all(re.fullmatch(r"[0-9]{1,6}", i) for i in layers)):
            raise ValueError("a mark is not a map of layer -> state")
    for d in tree["drafters"]:
        if not (isinstance(d, list) and len(d) == 4 and isinstance(d[0], str) and _is_int(d[1]) and _is_int(d[2])):
            raise ValueError("a drafter state is not [key, tokens, lookahead, tree]")
    _check_skeleton([tree["final"], list(tree["marks"].values()), list(tree["logits"].values()),
                     [d[3] for d in tree["drafters"]]])


def install_key(folder: Path | None = None) -> bytes:
    """The per-install secret that signs disk entries, from ``<config>/prefix-cache.key`` (created on
    first use, readable by its owner only). Kept outside the cache folder on purpose: whoever can
    write the cache must not be able to sign. A folder that cannot be written gets a key for this
    process only (entries then last until it exits)."""
    path = (folder or config_root()) / KEY_FILE

    def read() -> bytes | None:
        try:
            text = path.read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return bytes.fromhex(text) if re.fullmatch(r"[0-9a-f]{64}", text) else None

    key = read()
    if key is not None:
        return key
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{uuid.uuid4().hex}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex())
        if path.exists():  # unreadable or malformed: replaced
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # two processes starting at once: the first one's key wins
            except FileExistsError:
                pass
        key = read()
    except OSError as e:
        log.warning("prefix cache: cannot keep a key in %s (%s): disk entries last until this process exits",
                    path, e.strerror or e)
    finally:
        tmp.unlink(missing_ok=True)
    return key if key is not None else os.urandom(32)


def file_mac(data: bytes, key: bytes) -> str:
    """The keyed hash a file's name carries (128 bits)."""
    return hashlib.blake2b(data, key=key, digest_size=16).hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's live process
        return True
    return True


def identity_dir(root: Path, identity: str) -> Path:
    """The folder of one model identity's files under ``root`` (the suffix index's too)."""
    return root / hashlib.sha256(identity.encode()).hexdigest()[:20]


def temp_path(folder: Path) -> Path:
    """A temporary file name in ``folder`` for a write that is renamed when complete (``_stale_tmp``
    recognises those a killed writer left)."""
    return folder / f".tmp-{os.getpid()}-{uuid.uuid4().hex}.safetensors"


def remove_stale_tmp(folder: Path) -> None:
    """Remove the temporary files in ``folder`` whose writer is gone."""
    for path in folder.glob(".tmp-*") if folder.is_dir() else ():
        if _stale_tmp(path):
            path.unlink(missing_ok=True)


def _stale_tmp(tmp: Path) -> bool:
    """A temporary file whose writer is gone (its pid, in the name, is not running) or that is older
    than ``STALE_TMP_S``."""
    m = re.fullmatch(r"\.tmp-([0-9]{1,10})-[0-9a-f]+\.safetensors", tmp.name)
    try:
        old = time.time() - tmp.stat().st_mtime > STALE_TMP_S
    except OSError:
        return False
    return old or m is None or (int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))))


class SignedFolder:
    """Files whose names carry a keyed hash (``file_mac``) under ``key``, by default the install's
    own (``install_key``, read when first needed): the disk tier's and the suffix index's."""

    _key: bytes | None = None

    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = install_key()
        return self._key


# ----------------------------------------------------------------------------------------
# The tier
# ----------------------------------------------------------------------------------------
class DiskTier(SignedFolder):
    def __init__(self, root: Path, entry_type: type, max_bytes: int | None = None, min_tokens: int | None = None,
                 key: bytes | None = None):
        self.root = root
        self._key = key  # None: ``install_key()``, read when first needed
        self.entry_type = entry_type
        self.max_bytes = DEFAULT_DISK_BYTES if max_bytes is None else max(0, int(max_bytes))
        self.min_tokens = MIN_DISK_TOKENS if min_tokens is None else max(1, int(min_tokens))
        self.identity: str | None = None
        self.dir: Path | None = None
        self._index: dict[Path, "Entry"] | None = None  # file -> its entry without arrays
        self.loads = self.saves = self.refused = 0

    def bind(self, identity: str) -> None:
        self.identity = identity
        self.dir = identity_dir(self.root, identity)
        self._index = None

    def _listing(self) -> dict[Path, "Entry"]:
        if self._index is None:
            self._index = {}
            if self.dir is not None and self.dir.is_dir():
                remove_stale_tmp(self.dir)  # writes that were killed half way
                for path in sorted(self.dir.glob("*.safetensors")):
                    if path.name.startswith("."):
                        continue
                    meta = read_metadata(path)
                    if meta is None or meta.get("format") != FORMAT or meta.get("identity") != self.identity:
                        self._refuse(path, "unreadable header or another model's entry")
                        continue
                    try:
                        check_meta(meta)
                        stub = unpack(self.entry_type, None, meta)
                    except Exception as e:  # any malformed header: refused, never a failed request
                        self._refuse(path, f"malformed metadata ({type(e).__name__}: {str(e)[:80]})")
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
        if file_mac(data, self.key) != path.stem.rpartition("-")[2]:
            self._refuse(path, "keyed hash mismatch (damaged, or not written by this install)")
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
            tmp = temp_path(self.dir)
            mx.save_safetensors(str(tmp), arrays, meta)
            stem = token_hash(entry.tokens)
            path = self.dir / f"{stem}-{file_mac(tmp.read_bytes(), self.key)}.safetensors"
            os.replace(tmp, path)
            tmp = None
        except Exception as e:  # a full disk or a read-only folder must not fail the generation
            log.warning("prefix cache: could not write to %s: %s", self.dir, e)
            return
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        listing = self._listing()
        replaced = {p for p in listing if p.stem.rpartition("-")[0] == stem} | set(entry.absorbed) | {entry.path}
        replaced -= {path, None}  # never the file just written: an entry restored from it, written again
        for old in replaced:
            old.unlink(missing_ok=True)
            listing.pop(old, None)
        entry.absorbed = []
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
        total = sum(size for _, size, _ in files) + self._temp_bytes()
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            p.unlink(missing_ok=True)
            self._listing().pop(p, None)
            total -= size

    def _temp_bytes(self) -> int:
        """Bytes in temporary files: other writers' entries in progress, which count toward the cap."""
        total = 0
        for p in self.dir.glob(".tmp-*") if self.dir is not None else ():
            try:
                total += p.stat().st_size
            except OSError:
                continue
        return total

    def usage(self) -> tuple[int, int]:
        """(files, bytes) in this model's folder."""
        files = [p for p in self._listing()]
        return len(files), sum(p.stat().st_size for p in files if p.exists())

    def describe(self) -> str:
        if self.dir is None:
            return f"{self.root} (not bound yet)"
        n, size = self.usage()
        return f"{self.dir} ({n} entries, {size / 2**20:.1f} of {self.max_bytes / 2**20:.0f} MiB)"
