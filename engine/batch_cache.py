"""Several sequences' caches seen by the model as one batch, so B requests share one forward.

Each sequence (a *row*) keeps its own single-sequence caches, exactly as the one-request loop
uses them: a verify's transaction (engine/caches.py ``Verify``) then rolls each row back by its
own accepted length with the code that is proven for every cache kind, and a row joins or leaves
the batch by being listed or not. For one forward, ``RowBatch`` stands in for one layer's cache of
every row: the model's multi-row update goes to each row's own cache, and what comes back is
left-padded to the longest row and stacked; the attention mask is each row's own mask, padded
the same way (padding is never attended to). RoPE positions are each row's own offset.

What it costs: per layer and forward, a copy of each row's keys and values into the batch (a
KV read, as attention does anyway). On a memory-bound machine it is small beside the weights
that the batch reads once instead of B times (a 1.5B fp32 model: 6 GB of weights against 57 kB
of K/V per token and row).

Recurrent state (``ArraysCache``: GatedDeltaNet, Mamba2, short convolutions) has no rows to pad:
the rows' states are stacked into one batched ``ArraysCache`` for the forward, and each row's
state after its own accepted length is cut from the per-position states the verify recorded
(engine/recurrent.py ``state_picks``) by ``RowVerify``. Full attention (``KVCache``), sliding
windows (``RotatingKVCache``), recurrent state and ``CacheList`` layers of those batch; any other
kind does not (``batchable`` says why), and such a target decodes its requests one at a time.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, _BaseCache

from engine.caches import CacheError, Verify, leaves
from engine.shapes import StableKVCache
from engine.slot_kv import SlotKV, row_offsets

# StableKVCache (a shape policy's full attention): a target's rows batch through the slot buffers
# (engine/slot_kv.py); a draft model's, which live one round, through RowBatch
BATCHABLE = (KVCache, StableKVCache, RotatingKVCache, ArraysCache, SlotKV)


def batchable(cache: list) -> str | None:
    """Why these caches cannot share a batched forward, or None when they can."""
    for i, c in enumerate(cache):
        for leaf in leaves([c]):
            if type(leaf) not in BATCHABLE:
                return f"layer {i} keeps a {type(leaf).__name__} cache, which the engine does not batch"
    return None


def fetched_length(c: Any, n: int) -> int:
    """Keys a single-sequence cache returns from ``update_and_fetch`` of ``n`` rows (what its own
    ``make_mask(n)`` is shaped for)."""
    if type(c) in (KVCache, SlotKV):
        return int(c.offset) + n
    if type(c) is StableKVCache:
        return c.fetched(n)
    if type(c) is RotatingKVCache:
        if n > 1:  # _update_concat: the window in temporal order, at most max_size - 1 old rows
            return (min(int(c.offset), c.max_size - 1) if c.keys is not None else 0) + n
        size = 0 if c.keys is None else int(c.keys.shape[2])
        if c.keys is None or (c.offset >= size and size < c.max_size):
            size += min(c.step, c.max_size - int(c.offset))
        return min(int(c.offset) + 1, min(size, c.max_size))
    raise CacheError(f"{type(c).__name__} does not batch")


def _row_mask(c: Any, n: int, length: int, window_size: int | None) -> mx.array:
    """One row's mask [n, length] (bool), from the row cache's own ``make_mask``."""
    m = c.make_mask(n, window_size=window_size, return_array=True)
    if m is None:
        return mx.ones((n, length), dtype=mx.bool_)
    if isinstance(m, str):  # "causal"
        return create_causal_mask(n, length - n)
    if m.dtype != mx.bool_:
        m = m == 0  # an additive mask: 0 where seen (its lowest value is only -65504 in float16)
    if m.shape[-1] != length:
        raise CacheError(f"{type(c).__name__} mask covers {m.shape[-1]} keys, the fetch {length}")
    return mx.broadcast_to(m.reshape(-1, length), (n, length))


def _left_pad(x: mx.array, length: int, axis: int) -> mx.array:
    short = length - x.shape[axis]
    if short == 0:
        return x
    shape = list(x.shape)
    shape[axis] = short
    return mx.concatenate([mx.zeros(shape, dtype=x.dtype), x], axis=axis)


class RowBatch(_BaseCache):
    """One layer's caches of B rows as one batch cache, for one forward."""

    def __init__(self, rows: Sequence[Any]):
        self.rows = list(rows)
        self._keys: mx.array | None = None

    @property
    def keys(self) -> mx.array | None:
        """The last fetch's batched keys. Some models tie the last layer's keys to the output
        (``mx.depends``) for evaluation order; the rows' own caches need no such tie."""
        return self._keys

    @keys.setter
    def keys(self, value: mx.array) -> None:
        self._keys = value

    @property
    def offset(self) -> mx.array:
        return row_offsets(tuple(int(c.offset) for c in self.rows))

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> mx.array:
        lengths = [fetched_length(c, n) for c in self.rows]
        longest = max(lengths)
        masks = [_left_pad(_row_mask(c, n, t, window_size), longest, 1) for c, t in zip(self.rows, lengths)]
        return mx.stack(masks)[:, None]  # [B, 1, n, keys]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        lengths = [fetched_length(c, n) for c in self.rows]
        ks, vs = [], []
        for r, (c, want) in enumerate(zip(self.rows, lengths)):
            k, v = c.update_and_fetch(keys[r : r + 1], values[r : r + 1])
            if k.shape[2] != want:
                raise CacheError(f"{type(c).__name__} fetched {k.shape[2]} keys where its mask covers {want}")
            ks.append(k)
            vs.append(v)
        longest = max(lengths)
        self._keys = mx.concatenate([_left_pad(k, longest, 2) for k in ks], axis=0)
        return self._keys, mx.concatenate([_left_pad(v, longest, 2) for v in vs], axis=0)

    def empty(self) -> bool:
        return all(c.empty() for c in self.rows)

    @property
    def state(self) -> list:
        raise CacheError("a RowBatch has no state of its own: its rows' caches do")


def stacked(rows: Sequence[ArraysCache]) -> ArraysCache:
    """The rows' recurrent states as one batched ``ArraysCache`` (row b is batch entry b)."""
    out = ArraysCache(len(rows[0].cache))
    for j in range(len(out.cache)):
        slots = [r.cache[j] for r in rows]
        if any(s is None for s in slots):
            if not all(s is None for s in slots):
                raise CacheError("rows of a batch must all have started their recurrent state")
            continue
        out.cache[j] = mx.concatenate(slots, axis=0)
    return out


def _batched(rows: Sequence[Any]) -> Any:
    kind = type(rows[0])
    if kind is CacheList:
        return CacheList(*(_batched([r.caches[m] for r in rows]) for m in range(len(rows[0].caches))))
    if kind is ArraysCache:
        return stacked(rows)
    if kind is SlotKV:  # the rows' layer buffer itself, when the forward covers its slots in order
        layer = rows[0].layer
        if all(r.layer is layer for r in rows) and [r.index for r in rows] == list(range(len(layer.slots))):
            return layer
    return RowBatch(rows)


def batch_view(row_caches: Sequence[list]) -> list:
    """Per layer, one batch cache over every row's cache of that layer: a ``RowBatch`` for
    attention, the stacked state for recurrent layers, a ``CacheList`` of those for a layer of
    several."""
    return [_batched([row[i] for row in row_caches]) for i in range(len(row_caches[0]))]


def run_rows(model: Any, ids: mx.array, row_caches: Sequence[list]) -> mx.array:
    """A plain model (a draft model, not the target) over ``ids`` [B, L], row b after its own
    caches ``row_caches[b]``, each row keeping all L rows: attention rows go to each row's cache
    as the forward runs, and each recurrent layer's new batched state is cut back into the rows'.
    Returns the lazy logits [B, L, V]."""
    view = batch_view(row_caches)
    before = recurrent_slots(view)
    logits = model(ids, cache=view)
    width = int(ids.shape[1])
    picks = recurrent_picks(view, before, width, None)  # no recording: each state after the whole forward
    for b, cache in enumerate(row_caches):
        put_picks(cache, picks, width, b)
    return logits


def recurrent_slots(view: list) -> dict[int, list]:
    """Per recurrent leaf of a batch view (by index in ``leaves(view)``): its slots before a
    forward (``recurrent_picks`` finds the ones the forward replaced)."""
    return {i: list(c.cache) for i, c in enumerate(leaves(view)) if type(c) is ArraysCache}


Pick = Callable[[int], mx.array]  # a slot's batched value after the first ``kept`` rows


def recurrent_picks(view: list, before: dict[int, list], width: int, recording: Any | None
                    ) -> dict[int, list[tuple[int, Pick]]]:
    """Per recurrent leaf of ``view`` (by index in ``leaves(view)``): (slot, pick) for each slot the
    forward replaced. A one-row forward's new state is the state after its row; a wider one's
    comes from the per-position states ``recording`` kept."""
    view_leaves = leaves(view)
    picks: dict[int, list[tuple[int, Pick]]] = {}
    if width == 1 or recording is None:
        for i, slots in before.items():
            picks[i] = [(j, lambda kept, v=v: v) for j, v in enumerate(view_leaves[i].cache) if v is not slots[j]]
        return picks
    from engine.recurrent import state_picks

    index = {id(c): i for i, c in enumerate(view_leaves)}
    marks = {i: (slots,) for i, slots in before.items()}
    for call in recording.calls:
        own = [index[id(c)] for c in call.caches if id(c) in index and index[id(c)] in before]
        found = state_picks(call, view_leaves, marks, own, width)
        if found is None:
            raise CacheError("a batched verify recorded no per-position state for a recurrent layer")
        for i, j, pick in found:
            picks.setdefault(i, []).append((j, pick))
    for i, slots in before.items():
        replaced = {j for j, v in enumerate(view_leaves[i].cache) if v is not slots[j]}
        if replaced - {j for j, _ in picks.get(i, [])}:
            raise CacheError("recurrent state changed outside any recorded module in a batched verify")
    return picks


class RowVerify(Verify):
    """One row's transaction in a batched verify: its attention layers drop the rows it did not
    keep (``Verify``), its recurrent layers take their state after ``kept`` rows from the batch's
    recording, cut to this row."""

    def __init__(self, cache: list, width: int, row: int):
        super().__init__(cache, width)  # marks taken before the forward
        self.row = row
        self.picks: dict[int, list[tuple[int, Pick]]] = {}  # set once the forward ran

    def commit(self, kept: int) -> None:
        super().commit(kept)  # the row's recurrent slots were not written: only attention rows go
        if kept == 0:  # rolled back: the slots keep their state from before the forward
            return
        put_picks(self.cache, self.picks, kept, self.row)


def put_picks(cache: list, picks: dict[int, list[tuple[int, Pick]]], kept: int, row: int) -> None:
    """Row ``row``'s recurrent slots in its own ``cache``: each picked state after ``kept`` rows, cut to the row."""
    row_leaves = leaves(cache)
    for i, slots in picks.items():
        for j, pick in slots:
            row_leaves[i][j] = pick(kept)[row : row + 1]
