"""Cache transactions: after a verify forward every layer's cache holds exactly the committed rows.

A verify forward appends ``width`` rows ([anchor] + drafts) to every layer's cache; the loop keeps
the first ``kept`` and the rest must go, leaving each cache as if only the committed tokens had
been fed. How is decided from the cache objects themselves, never from the model's name:

* ``KVCache``, ``QuantizedKVCache``, ``ChunkedKVCache``, ``ConcatenateKVCache``: trimmed, and the
  count actually trimmed is checked (mlx-lm's ``trim_prompt_cache`` trims nothing, silently, as
  soon as one layer refuses); a ``ConcatenateKVCache`` also loses the rows physically.
* ``RotatingKVCache`` (sliding windows): a multi-row update (``_update_concat``) leaves the buffer in
  temporal order with the new rows last, so rejected rows are sliced off the end. mlx-lm's own
  ``trim`` only moves the write index (stale rows come back at the next reorder) and is refused
  once the window has wrapped.
* ``ArraysCache`` (recurrent state: GatedDeltaNet, Mamba, short convolutions): the state is
  replaced, not appended to; it is rewound from what the verify recorded (engine/recurrent.py).
* ``CacheList``: each member by its own kind.

Any other cache type is unknown: ``blocker`` names it, and speculation is refused for that model.

The same pieces serve the draft model (``Savepoint``: undo several one-row steps) and a prefix
cache (``snapshot``/``restore``, ``trimmable_to``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Protocol, Sequence

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from engine.shapes import ShapePolicy, StableKVCache  # a KVCache whose multi-row attention sees its whole buffer
from engine.slot_kv import SlotKV  # a batch row's full-attention layer, held in the batch's buffer

TRIMMED = (KVCache, QuantizedKVCache, ChunkedKVCache, ConcatenateKVCache, StableKVCache, SlotKV)
KNOWN = (*TRIMMED, RotatingKVCache, ArraysCache)
KV_GROUP_SIZE = 64
KV_BITS = (4, 8)


class CacheError(RuntimeError):
    """A cache did not end the way the committed rows require: an engine bug, never ignored."""


# ----------------------------------------------------------------------------------------
# What a cache list is made of
# ----------------------------------------------------------------------------------------
def leaves(cache: Iterable) -> list:
    """The per-layer caches with every ``CacheList`` opened up, in order."""
    out = []
    for c in cache:
        if type(c) is CacheList:
            out.extend(leaves(c.caches))
        else:
            out.append(c)
    return out


def blocker(cache: list) -> str | None:
    """Why rejected drafts could not be rolled back out of these caches, or None when they can.
    Exact types: a subclass may store its rows differently."""
    for i, c in enumerate(cache):
        for leaf in leaves([c]):
            if type(leaf) not in KNOWN:
                return f"layer {i} keeps a {type(leaf).__name__} cache, which the engine cannot roll back"
    return None


def stabilize(cache: list, policy: ShapePolicy | None) -> list:
    """``cache`` with every plain ``KVCache`` replaced by a ``StableKVCache`` under ``policy``;
    other kinds (rotating windows, recurrent state) stay. A model shares one mask among the
    layers of a kind, built from one of them, so every full-attention layer must change.
    ``cache`` itself when nothing changes (no policy, no plain KV cache, or one in use)."""
    plain = [c for c in leaves(cache or []) if type(c) is KVCache]
    if policy is None or not plain or any(not c.empty() for c in plain):
        return cache

    def convert(c: Any) -> Any:
        if type(c) is KVCache:
            return StableKVCache(policy.step)
        if type(c) is CacheList:  # a hybrid layer's several caches (Falcon-H1: recurrent + attention)
            return CacheList(*(convert(m) for m in c.caches))
        return c

    return [convert(c) for c in cache]


def describe(cache: list) -> str:
    """Layer caches by kind, e.g. '24 ArraysCache (recurrent), 8 KVCache (full attention)'."""
    kinds = {KVCache: "full attention", StableKVCache: "full attention", QuantizedKVCache: "quantized full attention",
             ChunkedKVCache: "chunked attention", ConcatenateKVCache: "full attention",
             RotatingKVCache: "sliding window", ArraysCache: "recurrent"}
    counts: dict[str, int] = {}
    for c in leaves(cache):
        label = f"{type(c).__name__} ({kinds.get(type(c), 'unknown to the engine')})"
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{n} {label}" for label, n in counts.items())


def has_recurrent(cache: list) -> bool:
    return any(type(c) is ArraysCache for c in leaves(cache))


def trim_only(cache: list) -> bool:
    """Every layer's cache drops rows by trimming (full attention): the cheapest rollbacks."""
    return all(type(c) in TRIMMED for c in leaves(cache))


def length(cache: list) -> int | None:
    """Tokens the caches hold (None when no layer counts them: only recurrent state)."""
    for c in leaves(cache):
        if type(c) is not ArraysCache:
            return int(c.offset)
    return None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (binary search on slices: C speed)."""
    a, b = list(a), list(b)
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def trim(c: Any, n: int) -> None:
    """Trim ``n`` rows off one trimmable cache, checking they really went."""
    if n <= 0:
        return
    got = c.trim(n)
    if got != n:
        raise CacheError(f"{type(c).__name__} trimmed {got} of {n} rows")
    if type(c) is ConcatenateKVCache:  # its trim moves only the offset; updates concatenate onto keys
        c.keys, c.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


def trimmable_to(cache: list, tokens: int) -> bool:
    """Whether trimming alone takes these caches back to ``tokens`` tokens exactly (for a prefix
    cache: else restore a ``snapshot`` taken at that boundary)."""
    now = length(cache)
    if now is None or not 0 <= tokens <= now:
        return False
    for c in leaves(cache):
        if type(c) is ArraysCache:
            if tokens != now:
                return False
        elif type(c) is RotatingKVCache:
            if c.offset >= c.max_size and tokens != now:  # wrapped: older rows are gone
                return False
        elif type(c) is ChunkedKVCache:
            if c.offset - c.start_position < now - tokens:
                return False
        elif type(c) not in TRIMMED:
            return False
    return True


def trim_to(cache: list, tokens: int) -> None:
    """Trim every layer back to ``tokens`` tokens (``trimmable_to`` must hold)."""
    if not trimmable_to(cache, tokens):
        raise CacheError(f"these caches cannot be trimmed back to {tokens} tokens")
    n = length(cache) - tokens
    for c in leaves(cache):
        if type(c) is not ArraysCache:
            trim(c, n)  # a sliding window that never wrapped trims like a full cache


# ----------------------------------------------------------------------------------------
# Snapshots
# ----------------------------------------------------------------------------------------
def _handles(state: Any) -> Any:
    """The state with every array as a new handle on the same buffer: a later in-place write to
    the live cache (``keys[..., i, :] = x``) goes to the live handle and copies the buffer first,
    so these keep the old values. Costs nothing unless such a write happens."""
    return tree_map(lambda x: copy.copy(x) if isinstance(x, mx.array) else x, state)


def snapshot(cache: list) -> list:
    """Every layer's cache as it is now, unaffected by anything done to the live caches later."""
    return [_handles(c.state) for c in leaves(cache)]


def compact_snapshot(cache: list) -> list:
    """``snapshot`` for keeping: a full-attention layer's state cut to the rows it holds (a copy).
    Its live buffer has spare rows past the offset (mlx-lm grows by 256, a ``StableKVCache`` by
    1024 on CUDA), which a kept entry would otherwise hold for nothing; ``restore`` grows the
    buffer again on the next write."""
    out = []
    for c, state in zip(leaves(cache), snapshot(cache)):
        if type(c) in (KVCache, StableKVCache) and c.keys is not None and c.keys.shape[2] > c.offset:
            keys, values, offset = state
            state = (mx.contiguous(keys[..., :offset, :]), mx.contiguous(values[..., :offset, :]), offset)
        out.append(state)
    return out


def restore(cache: list, snap: list) -> None:
    """Put a ``snapshot`` back into the same cache list (it can be restored again later)."""
    parts = leaves(cache)
    if len(parts) != len(snap):
        raise CacheError(f"snapshot of {len(snap)} caches restored into {len(parts)}")
    for c, state in zip(parts, snap):
        c.state = _handles(state)


def repeat_rows(cache: list, rows: int) -> None:
    """Lengthen every full-attention cache to ``rows`` tokens by repeating the rows it holds: a
    forward after it costs what one after ``rows`` real tokens costs (attention reads every row,
    whatever its values), without prefilling them. For timing only (the calibration's long
    context): the rows are no real sequence's. Windowed and recurrent caches stay as they are
    (what they read does not grow with the context)."""
    grown = []
    for c in leaves(cache):
        held = getattr(c, "offset", 0)
        if type(c) not in TRIMMED or not held or held >= rows:
            continue
        copies = -(-rows // held)

        def longer(x: mx.array, held: int = held, copies: int = copies) -> mx.array:
            return mx.concatenate([x[..., :held, :]] * copies, axis=2)[..., :rows, :]

        c.keys, c.values = tree_map(longer, (c.keys, c.values))
        c.offset = rows
        grown.append((c.keys, c.values))
    mx.eval(grown)


def _mark(c: Any) -> Any:
    if type(c) in TRIMMED:
        return int(c.offset)  # rows past the mark are only ever appended: the offset suffices
    if type(c) is ArraysCache:
        # Models assign new state arrays (cache[i] = x), never write into them: refs suffice, and
        # identity then says which slots a forward replaced.
        return list(c.cache), c.left_padding, c.lengths
    return _handles(c.state)


def _restore_mark(c: Any, mark: Any) -> None:
    if type(c) in TRIMMED:
        trim(c, int(c.offset) - mark)
    elif type(c) is ArraysCache:
        slots, c.left_padding, c.lengths = mark
        c.cache = list(slots)
    else:
        c.state = _handles(mark)


def _drop_rotating(c: RotatingKVCache, n: int) -> None:
    """Slice the newest ``n`` rows off a sliding-window cache whose last update appended several
    rows (``_update_concat``: temporal order, new rows last, write index at the end)."""
    if n <= 0:
        return
    if c.keys is None or c._idx != c.keys.shape[2] or c.keys.shape[2] <= n:
        raise CacheError(f"RotatingKVCache is not in the layout of a multi-row update (idx {c._idx}, "
                         f"rows {None if c.keys is None else c.keys.shape[2]}); cannot drop {n} rows")
    c.keys = c.keys[..., :-n, :]
    c.values = c.values[..., :-n, :]
    c.offset -= n
    c._idx -= n


class Savepoint:
    """The caches as they are now. Rows appended afterwards, by any number of forwards, can be
    undone with ``rollback``. Full-attention layers keep only an offset; sliding windows and
    recurrent state keep handles on their arrays (a one-row step over a wrapped window writes in
    place, which then copies that window's buffer once)."""

    def __init__(self, cache: list):
        self.cache = cache
        self.leaves = leaves(cache)
        self.marks = [_mark(c) for c in self.leaves]

    def restore_leaf(self, i: int) -> None:
        _restore_mark(self.leaves[i], self.marks[i])

    def rollback(self) -> None:
        for i in range(len(self.leaves)):
            self.restore_leaf(i)

    def changed(self, i: int) -> bool:
        """Whether a forward since the savepoint replaced any array of recurrent leaf ``i``."""
        slots = self.marks[i][0]
        return any(a is not b for a, b in zip(self.leaves[i].cache, slots))


class Rewinder(Protocol):
    """What a verify recorded about the modules that own recurrent state (engine/recurrent.py)."""

    def rewind(self, txn: "Verify", kept: int) -> set[int] | None:
        """Rewind the recurrent leaves to ``kept`` rows; the leaf indices it fixed, or None."""


class Verify(Savepoint):
    """A transaction around one forward of ``width`` rows: ``commit(kept)`` keeps the first rows.

    ``rewinder``: the verify's recording, for recurrent state. ``rerun(kept)``: feed the first
    ``kept`` rows again (the last resort for recurrent state changed where nothing recorded it).
    """

    def __init__(self, cache: list, width: int, *, rewinder: Rewinder | None = None,
                 rerun: Callable[[int], None] | None = None):
        self.width = int(width)
        self.rewinder = rewinder
        self.rerun = rerun
        self.committed = False
        if self.width > 1:
            super().__init__(cache)
        else:  # a one-row forward is a plain step: there is never anything to undo
            self.cache, self.leaves, self.marks = cache, [], []

    def commit(self, kept: int) -> None:
        width = self.width
        if not 0 <= kept <= width or (width == 1 and kept == 0):
            raise CacheError(f"cannot keep {kept} of a {width}-row forward")
        if self.committed:
            raise CacheError("this verify was committed already")
        self.committed = True
        drop = width - kept
        if drop == 0:
            return
        if kept == 0:
            self.rollback()
            return
        recurrent = [i for i, c in enumerate(self.leaves) if type(c) is ArraysCache and self.changed(i)]
        done: set[int] = set()
        if recurrent:
            fixed = self.rewinder.rewind(self, kept) if self.rewinder is not None else None
            if fixed is None or not set(recurrent) <= fixed:
                if self.rerun is None:
                    raise CacheError("recurrent state changed outside any recorded module and cannot be rewound")
                self.rollback()
                self.rerun(kept)
                return
            done = fixed
        for i, c in enumerate(self.leaves):
            if i in done or type(c) is ArraysCache:
                continue
            if type(c) is RotatingKVCache:
                before = self.marks[i][2]  # offset in the rotating state tuple
                if c.offset != before + width:
                    raise CacheError(f"RotatingKVCache grew by {c.offset - before} rows in a {width}-row forward")
                _drop_rotating(c, drop)
            else:
                if c.offset != self.marks[i] + width:
                    raise CacheError(f"{type(c).__name__} grew by {c.offset - self.marks[i]} rows "
                                     f"in a {width}-row forward")
                trim(c, drop)


# ----------------------------------------------------------------------------------------
# KV-cache quantization
# ----------------------------------------------------------------------------------------
def quantize_kv(cache: list, bits: int, group_size: int = KV_GROUP_SIZE) -> list:
    """Full-attention layers' ``KVCache`` -> ``QuantizedKVCache``. Sliding windows and recurrent
    state stay as they are: mlx-lm has no quantized rotating or recurrent cache."""
    if bits not in KV_BITS:
        raise ValueError(f"kv bits must be one of {KV_BITS}, got {bits}")

    def convert(c: Any) -> Any:
        if type(c) is KVCache:
            return QuantizedKVCache(group_size=group_size, bits=bits)
        if type(c) is CacheList:
            return CacheList(*(convert(m) for m in c.caches))
        return c

    return [convert(c) for c in cache]
