"""The suffix index on disk: a restarted server keeps the history that lookup drafts from.

Beside the prefix cache's disk tier and keyed the same way: one folder per model identity
(weights fingerprint with their dtype, vocabulary size) under the tier's root, one file per index
(``suffix-shared-<mac>.safetensors`` for the process's, ``suffix-key-<id>-<mac>.safetensors`` for
an API key's, its id a keyed hash of the key's scope so the name reveals nothing). A file holds
the sequences (least recently used first) as two uint32 tensors, ``tokens`` and ``lengths``; the
postings are rebuilt on load, under the index's token budget.

Checked as the prefix tier checks its files (``engine/prefix_disk.py``): the name carries a keyed
hash of the bytes under the per-install secret, so a damaged, truncated or forged file is refused;
so is one of another format version or model identity, or one whose token ids are beyond the
vocabulary. A refused file is logged with the reason and removed, never loaded and never an
error. Writes go to a temporary file renamed into place; a save happens every ``SAVE_EVERY``
sequences added (after the reply is out) and when the engine stops (``Engine.save_history``).
Pure Python: no MLX, so any thread may save.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import threading
from array import array
from pathlib import Path
from typing import Any

from engine.drafters.suffix import SuffixIndex
from engine.prefix_disk import (MAX_HEADER, SignedFolder, file_mac, identity_dir, read_metadata, remove_stale_tmp,
                                temp_path)

log = logging.getLogger("tandem.suffix")

FORMAT = "tandem-suffix-file-1"
SAVE_EVERY = 16  # sequences added between periodic saves
MAX_FILE_BYTES = 256 << 20  # far above any budget's file (4 bytes a token): a bigger one is refused unread


def identity(target: Any) -> str:
    """What a stored index depends on: the weights (and their dtype) and the vocabulary."""
    from engine.prefix_cache import fingerprint

    return f"{FORMAT}|weights {fingerprint(target.model)}|vocab {target.vocab_size}"


def encode(sequences: list[list[int]], meta: dict[str, str]) -> bytes:
    """A safetensors file: the sequences end to end (``tokens``) and their ``lengths``, uint32."""
    tokens, lengths = array("I"), array("I", [len(s) for s in sequences])
    for seq in sequences:
        tokens.extend(seq)
    if sys.byteorder != "little":
        tokens.byteswap()
        lengths.byteswap()
    n, m = 4 * len(tokens), 4 * len(lengths)
    header = json.dumps({"tokens": {"dtype": "U32", "shape": [len(tokens)], "data_offsets": [0, n]},
                         "lengths": {"dtype": "U32", "shape": [len(lengths)], "data_offsets": [n, n + m]},
                         "__metadata__": meta}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + tokens.tobytes() + lengths.tobytes()


def decode(data: bytes) -> tuple[dict, list[list[int]]]:
    """(metadata, sequences) of what ``encode`` wrote. Raises ValueError naming what is wrong."""
    if len(data) < 8:
        raise ValueError("truncated (no header)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(len(data) - 8, MAX_HEADER):
        raise ValueError(f"header of {n} bytes in a file of {len(data)}")
    header = json.loads(data[8: 8 + n])
    if not isinstance(header, dict) or set(header) != {"tokens", "lengths", "__metadata__"}:
        raise ValueError("not a tokens + lengths file")
    body, arrays = data[8 + n:], {}
    for name in ("tokens", "lengths"):
        spec = header[name] if isinstance(header[name], dict) else {}
        offsets, shape = spec.get("data_offsets"), spec.get("shape")
        if (spec.get("dtype") != "U32" or not isinstance(shape, list) or len(shape) != 1
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(v, int) for v in (*offsets, shape[0]))
                or not 0 <= offsets[0] <= offsets[1] <= len(body) or offsets[1] - offsets[0] != 4 * shape[0]):
            raise ValueError(f"'{name}' is not a uint32 vector inside the file")
        begin, end = offsets
        values = array("I")
        values.frombytes(body[begin:end])
        if sys.byteorder != "little":
            values.byteswap()
        arrays[name] = values.tolist()
    if not isinstance(header["__metadata__"], dict):
        raise ValueError("no metadata")
    tokens, lengths = arrays["tokens"], arrays["lengths"]
    if sum(lengths) != len(tokens) or not all(lengths):
        raise ValueError("the lengths do not cut the tokens into sequences")
    sequences, at = [], 0
    for length in lengths:
        sequences.append(tokens[at: at + length])
        at += length
    return header["__metadata__"], sequences


class SuffixDisk(SignedFolder):
    """The files of one model's suffix indexes (bound to its identity before use)."""

    def __init__(self, root: Path, key: bytes | None = None):
        self.root = root
        self._key = key  # None: ``install_key()``, read when first needed
        self.identity: str | None = None
        self.vocab_size = 0
        self.dir: Path | None = None
        self._saved: dict[str | None, tuple[SuffixIndex, int]] = {}  # scope -> (index, version on disk)
        self._lock = threading.Lock()
        self.loads = self.saves = self.refused = 0

    def bind(self, identity: str, vocab_size: int) -> None:
        self.identity, self.vocab_size = identity, vocab_size
        self.dir = identity_dir(self.root, identity)
        self._saved.clear()

    def _stem(self, scope: str | None) -> str:
        return "suffix-shared" if scope is None else f"suffix-key-{file_mac(scope.encode(), self.key)[:16]}"

    def _files(self, scope: str | None) -> list[Path]:
        if self.dir is None or not self.dir.is_dir():
            return []
        stem = self._stem(scope)
        return sorted(p for p in self.dir.glob(f"{stem}-*.safetensors") if p.stem.rpartition("-")[0] == stem)

    def load(self, scope: str | None, index: SuffixIndex) -> int:
        """Add the stored sequences of ``scope`` to ``index`` (its budget applies); how many were
        read. A file that fails a check is logged and removed."""
        if self.dir is None:
            return 0
        remove_stale_tmp(self.dir)
        files = sorted(self._files(scope), key=_mtime)
        for path in files[:-1]:  # a save removes the file it replaces; a crash between can leave two
            path.unlink(missing_ok=True)
        sequences = self._read(files[-1]) if files else None
        if sequences is None:
            return 0
        for seq in sequences:
            index.add(seq)
        self._saved[scope] = (index, index.version)
        self.loads += 1
        return len(sequences)

    def _read(self, path: Path) -> list[list[int]] | None:
        meta = read_metadata(path)
        if meta is None:
            return self._refuse(path, "unreadable or truncated header")
        if meta.get("format") != FORMAT:
            return self._refuse(path, f"another format ({str(meta.get('format'))[:40]!r}, this build reads {FORMAT!r})")
        if meta.get("identity") != self.identity:
            return self._refuse(path, "written for another model, precision or vocabulary")
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                return self._refuse(path, f"larger than {MAX_FILE_BYTES >> 20} MiB")
            data = path.read_bytes()
        except OSError as e:
            return self._refuse(path, f"unreadable ({e.strerror or e})")
        if file_mac(data, self.key) != path.stem.rpartition("-")[2]:
            return self._refuse(path, "keyed hash mismatch (damaged, or not written by this install)")
        try:
            meta, sequences = decode(data)
        except Exception as e:  # whatever a file holds: refused, never an error
            return self._refuse(path, f"malformed ({type(e).__name__}: {str(e)[:80]})")
        if meta.get("format") != FORMAT or meta.get("identity") != self.identity:
            return self._refuse(path, "written for another model, precision or vocabulary")
        if any(max(seq) >= self.vocab_size for seq in sequences):
            return self._refuse(path, f"token ids beyond the vocabulary ({self.vocab_size})")
        return sequences

    def _refuse(self, path: Path, why: str) -> None:  # None: what ``_read`` returns for a refused file
        self.refused += 1
        log.warning("suffix index: %s: %s; removed", path.name, why)
        path.unlink(missing_ok=True)
        return None

    def save(self, scope: str | None, index: SuffixIndex, *, every: int = 1) -> bool:
        """Write ``index`` for ``scope`` when it changed by ``every`` versions or more since it was
        loaded or saved (atomically; the file it replaces is removed). True when it wrote."""
        if self.dir is None or self.identity is None:
            return False
        with self._lock:  # the engine thread's periodic save and the one at exit
            known, version = self._saved.get(scope, (None, 0))
            base = version if known is index else 0
            if index.version == base or index.version - base < every:
                return False
            return self._write(scope, index)

    def _write(self, scope: str | None, index: SuffixIndex) -> bool:
        version = index.version
        tmp = None
        try:
            data = encode(index.sequences(), {"format": FORMAT, "identity": self.identity})
            self.dir.mkdir(parents=True, exist_ok=True)
            stem = self._stem(scope)
            path = self.dir / f"{stem}-{file_mac(data, self.key)}.safetensors"
            tmp = temp_path(self.dir)
            tmp.write_bytes(data)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:  # a full disk or a read-only folder must not fail anything
            log.warning("suffix index: could not write to %s: %s", self.dir, e.strerror or e)
            return False
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        for old in self._files(scope):
            if old != path:
                old.unlink(missing_ok=True)
        self._saved[scope] = (index, version)
        self.saves += 1
        return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile
        return 0.0
