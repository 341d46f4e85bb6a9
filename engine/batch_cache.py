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

Full attention (``KVCache``) and sliding windows (``RotatingKVCache``) batch. Recurrent state
(``ArraysCache``) and any other kind do not (``batchable`` says why): such a target decodes its
requests one at a time.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache, _BaseCache

from engine.caches import CacheError, leaves

BATCHABLE = (KVCache, RotatingKVCache)


def batchable(cache: list) -> str | None:
    """Why these caches cannot share a batched forward, or None when they can."""
    for i, c in enumerate(cache):
        if type(c) is CacheList:
            return f"layer {i} keeps several caches in one (CacheList)"
        if type(c) not in BATCHABLE:
            kind = "recurrent state" if type(c).__name__ == "ArraysCache" else type(c).__name__
            return f"layer {i} keeps {kind}, which the engine does not batch yet"
    return None


def fetched_length(c: Any, n: int) -> int:
    """Keys a single-sequence cache returns from ``update_and_fetch`` of ``n`` rows (what its own
    ``make_mask(n)`` is shaped for)."""
    if type(c) is KVCache:
        return int(c.offset) + n
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
        m = m > -1e30  # an additive mask: 0 where seen
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

    @property
    def offset(self) -> mx.array:
        return mx.array([int(c.offset) for c in self.rows], dtype=mx.int32)

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
        return (mx.concatenate([_left_pad(k, longest, 2) for k in ks], axis=0),
                mx.concatenate([_left_pad(v, longest, 2) for v in vs], axis=0))

    def empty(self) -> bool:
        return all(c.empty() for c in self.rows)

    @property
    def state(self) -> list:
        raise CacheError("a RowBatch has no state of its own: its rows' caches do")


def batch_view(row_caches: Sequence[list]) -> list[RowBatch]:
    """Per layer, one ``RowBatch`` over every row's cache of that layer."""
    per_row = [leaves(c) for c in row_caches]
    return [RowBatch([row[i] for row in per_row]) for i in range(len(per_row[0]))]
