"""Full-attention keys and values of a batch's rows kept in one buffer per layer between forwards.

``RowBatch`` (engine/batch_cache.py) stacks each row's own cache into a padded batch for every
forward: per layer, a copy of every row's keys and values, and a dozen small ops per row. On the
starter at a few hundred tokens of context that is a quarter of a four-row plain step. Here a
decoding row's full-attention caches (``KVCache``) move once, when the row starts decoding in a
batch, into a ``SlotLayer`` per layer: keys and values ``[rows, heads, capacity, dim]``, row b
left-aligned from column 0 (as its own cache holds them) and each row with its own length. A
forward writes each row's new keys at its own length (one scatter per layer) and attends over the
buffer up to the longest row, each row masked to its own keys: no copy of old keys at all.

Each row's view of its slot, ``SlotKV``, is an ordinary trimmable cache to the rest of the engine:
a verify's transaction rolls it back by its own accepted length by lowering its length (the rows
past it are garbage that the mask never shows), and a row running alone appends to its slot like
any ``KVCache``. When the row leaves, its slot becomes the cache it joined as again (a copy of
its rows), so what outlives the batch (a prefix-cache entry, the caller's stats) never sees a slot.

Columns past a row's length are masked, so a row's scores and weighted values are the sums a
lone forward over its own keys computes, plus terms of exactly zero.

Under a shape policy (CUDA: ``StableKVCache``, engine/shapes.py) the layer keeps the policy's
step and, for forwards of several rows per sequence, attends over the whole buffer with an
additive mask, as ``StableKVCache`` does: shapes change once per step of columns, not every round.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, _BaseCache

from engine.shapes import StableKVCache, additive, capacity, capacity_mask

STEP = 256  # columns a buffer grows by, as mlx-lm's KVCache does


class SlotKV(_BaseCache):
    """One row's full-attention cache of one layer, held in that layer's batch buffer."""

    def __init__(self, layer: "SlotLayer", offset: int):
        self.layer = layer
        self.offset = offset

    @property
    def index(self) -> int:
        return self.layer.slots.index(self)

    @property
    def keys(self) -> mx.array:
        b = self.index
        return self.layer.keys[b : b + 1, :, : self.offset]

    @property
    def values(self) -> mx.array:
        b = self.index
        return self.layer.values[b : b + 1, :, : self.offset]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """A forward of this row alone: append, then return its rows (as ``KVCache`` does; its
        whole slot under a shape policy, for several rows)."""
        self.layer.write([self], keys, values)
        if self.layer.stable and keys.shape[2] > 1:
            b = self.index
            return self.layer.keys[b : b + 1], self.layer.values[b : b + 1]
        return self.keys, self.values

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> Any:
        layer = self.layer
        if layer.stable and n > 1:
            mask = capacity_mask(self.offset, n, layer.columns(self.offset + n, n), window_size)
            return additive(mask, layer.keys.dtype)
        return KVCache.make_mask(self, n, window_size=window_size, return_array=return_array)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n  # the rows past the length stay in the buffer, masked, until overwritten
        return n

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def state(self) -> tuple[mx.array, mx.array, int]:
        return self.keys, self.values, self.offset  # as KVCache's

    @state.setter
    def state(self, value: Any) -> None:
        raise TypeError("a row's batch slot is restored by leaving the batch first (SlotLayer.leave)")


class SlotLayer(_BaseCache):
    """One full-attention layer's keys and values of every row in the batch; in a batched forward
    it is the cache the model sees for this layer."""

    def __init__(self, step: int = STEP, stable: bool = False):
        self.step, self.stable = step, stable  # stable: a shape policy's (engine/shapes.py)
        self.keys: mx.array | None = None  # [rows, heads, capacity, dim]
        self.values: mx.array | None = None
        self.slots: list[SlotKV] = []
        self._index: tuple | None = None  # (offsets, n) -> the scatter positions, reused by the next layer

    # -- membership ---------------------------------------------------------------------
    def join(self, cache: KVCache) -> SlotKV:
        """Move one row's cache into a new slot (a copy of its rows, once)."""
        n = int(cache.offset)
        keys, values = (cache.keys[..., :n, :], cache.values[..., :n, :]) if n else (None, None)
        slot = SlotKV(self, n)
        if self.keys is None:
            if keys is None:
                raise ValueError("a row joins a batch's slots after its prefill: its cache holds no keys yet")
            self.keys, self.values = _room(keys, self._capacity(n)), _room(values, self._capacity(n))
        else:
            size = max(self.keys.shape[2], self._capacity(n))
            self.keys, self.values = _room(self.keys, size), _room(self.values, size)
            if n:
                keys, values = _room(keys, size), _room(values, size)
            else:
                keys = mx.zeros((1, *self.keys.shape[1:]), dtype=self.keys.dtype)
                values = mx.zeros((1, *self.values.shape[1:]), dtype=self.values.dtype)
            self.keys = mx.concatenate([self.keys, keys], axis=0)
            self.values = mx.concatenate([self.values, values], axis=0)
        self.slots.append(slot)
        return slot

    def leave(self, slot: SlotKV) -> KVCache:
        """Take one row out: its rows as the cache it joined with (a copy), the others close up."""
        b, n = slot.index, slot.offset
        out = StableKVCache(self.step) if self.stable else KVCache()
        if n:
            out.state = (mx.contiguous(self.keys[b : b + 1, :, :n]), mx.contiguous(self.values[b : b + 1, :, :n]), n)
        self.slots.pop(b)
        if not self.slots:
            self.keys = self.values = None
        else:
            keep = mx.array([i for i in range(len(self.slots) + 1) if i != b])
            self.keys, self.values = self.keys[keep], self.values[keep]
        mx.eval(*(x for x in (out.keys, out.values, self.keys, self.values) if x is not None))
        slot.layer = None
        return out

    # -- the batched forward ------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        return row_offsets(tuple(s.offset for s in self.slots))

    def columns(self, end: int, n: int) -> int:
        """Key columns a forward of ``n`` rows per sequence attends over, its longest row ending
        at ``end``: up to there, or under a shape policy (several rows) the whole buffer."""
        if self.stable and n > 1:  # the buffer as ``write`` leaves it
            return self.keys.shape[2] if end <= self.keys.shape[2] else self._capacity(end)
        return end

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False) -> mx.array:
        """[rows, 1, n, keys]: row b's query i sees its own keys up to its own position."""
        offsets = [s.offset for s in self.slots]
        columns = mx.arange(self.columns(max(offsets) + n, n))
        position = mx.array(offsets)[:, None] + mx.arange(n)[None]  # [rows, n]
        seen = columns[None, None] <= position[..., None]
        if window_size is not None:
            seen = seen & (columns[None, None] > position[..., None] - window_size)
        return additive(seen[:, None], self.keys.dtype) if self.stable else seen[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[0] != len(self.slots):
            raise ValueError(f"a forward of {keys.shape[0]} rows over {len(self.slots)} slots")
        n = keys.shape[2]
        end = self.columns(self.write(self.slots, keys, values), n)
        return self.keys[..., :end, :], self.values[..., :end, :]

    def write(self, slots: list[SlotKV], keys: mx.array, values: mx.array) -> int:
        """Write ``keys``/``values`` [len(slots), heads, n, dim] at each slot's own length;
        advance the lengths. Returns the longest length after it."""
        n = keys.shape[2]
        end = max(s.offset for s in slots) + n
        if end > self.keys.shape[2]:
            size = self._capacity(end)
            self.keys, self.values = _room(self.keys, size), _room(self.values, size)
        if len(slots) == 1:
            b, at = slots[0].index, slots[0].offset
            self.keys[b : b + 1, :, at : at + n] = keys
            self.values[b : b + 1, :, at : at + n] = values
        else:
            if len(slots) != len(self.slots):
                raise ValueError("a batched write covers every slot, in slot order")
            where = self._positions([s.offset for s in slots], keys.shape)
            self.keys = mx.put_along_axis(self.keys, where, keys, axis=2)
            self.values = mx.put_along_axis(self.values, where, values, axis=2)
        for s in slots:
            s.offset += n
        return end

    def _positions(self, offsets: list[int], shape: tuple) -> mx.array:
        key = (tuple(offsets), tuple(shape))
        if self._index is None or self._index[0] != key:
            at = mx.array(offsets)[:, None, None, None] + mx.arange(shape[2])[None, None, :, None]
            self._index = (key, mx.broadcast_to(at, shape))
        return self._index[1]

    def empty(self) -> bool:
        return all(s.empty() for s in self.slots)

    @property
    def state(self) -> Any:
        raise TypeError("a batch's slot layer has no state of its own: its rows' slots do")

    def _capacity(self, n: int) -> int:
        return capacity(n + 1, self.step)


@lru_cache(maxsize=1)
def row_offsets(offsets: tuple[int, ...]) -> mx.array:
    """A batched forward's per-row cache lengths as one int32 array, the same object for the same
    lengths: every layer of the forward hands RoPE the same offsets, so its angles are computed
    once (engine/compiled.py). Only the last one is kept: every forward commits at least a row,
    so the next forward's lengths differ, and an array a model changed in place is never handed
    to a later forward."""
    return mx.array(offsets, dtype=mx.int32)


def _room(x: mx.array, capacity: int) -> mx.array:
    """``x`` cut or padded with zeros along axis 2 to ``capacity`` columns."""
    have = x.shape[2]
    if have >= capacity:
        return x[..., :capacity, :] if have > capacity else x
    pad = mx.zeros((*x.shape[:2], capacity - have, x.shape[3]), dtype=x.dtype)
    return mx.concatenate([x, pad], axis=2)


class Slots:
    """The slot layers of one batch: one per cache leaf (layer) of full attention (``KVCache``, or
    ``StableKVCache`` under a shape policy)."""

    def __init__(self):
        self.layers: dict[int, SlotLayer] = {}

    def join(self, cache: list) -> None:
        """Move a row's full-attention caches into the batch's slots, in place in ``cache``."""
        def move(i: int, c: Any) -> Any:
            if type(c) is KVCache:
                return self.layers.setdefault(i, SlotLayer()).join(c)
            if type(c) is StableKVCache:
                return self.layers.setdefault(i, SlotLayer(c.step, stable=True)).join(c)
            return c

        _replace_leaves(cache, move)

    def reserve(self, columns: int) -> None:
        """Grow every layer's buffers to hold ``columns`` key rows (the warm-up's capacities)."""
        for layer in self.layers.values():
            size = max(layer.keys.shape[2], layer._capacity(columns - 1))
            layer.keys, layer.values = _room(layer.keys, size), _room(layer.values, size)

    def leave(self, cache: list) -> None:
        """Give a row its own full-attention caches back, in place in ``cache``."""
        def back(i: int, c: Any) -> Any:
            if type(c) is not SlotKV:
                return c
            layer = c.layer
            out = layer.leave(c)
            if not layer.slots:
                self.layers.pop(i, None)
            return out

        _replace_leaves(cache, back)


def _replace_leaves(cache: list, fn: Callable[[int, Any], Any]) -> None:
    """Replace each leaf (``CacheList`` members opened up) by ``fn(leaf index, leaf)``, in place."""
    counter = iter(range(1 << 30))

    def walk(c: Any) -> Any:
        if type(c) is CacheList:
            c.caches = tuple(walk(m) for m in c.caches)
            return c
        return fn(next(counter), c)

    for j, c in enumerate(cache):
        cache[j] = walk(c)
