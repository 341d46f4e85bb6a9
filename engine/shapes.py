"""Stable shapes: few distinct attention and verify shapes, so a GPU backend compiles each once.

MLX's CUDA backend builds a cuDNN attention graph for every new (query rows, key rows) shape of
a multi-row forward (tens of ms each) and a matmul plan for every new width. A verify forward
over ``[anchor] + drafts`` on a cache of ``offset`` rows has a new shape nearly every round (the
offset grows, the draft length varies), so speculative rounds kept paying that compile cost: on
an H200 the first run of a prompt was 10x slower than the same prompt again. Under a
``ShapePolicy``:

* ``StableKVCache`` (a drop-in mlx-lm ``KVCache``) grows its buffers in ``step`` rows and hands a
  multi-row forward the whole buffer with an explicit mask (rows past the offset are masked
  out, so they add exact zeros to the softmax); one-row steps get the usual slice, which MLX
  already serves from shape-stable kernels. Key rows change only every ``step`` tokens.
* verify widths are padded up to the next width of a short ladder (``pad``): the loop appends
  filler tokens after the drafts, reads no logits from them and trims their rows from the cache
  with the rejected drafts, so nothing of them is committed or left behind (causal attention:
  real rows never see them).

The block drafters' context cache (``engine/drafters/block.py``) follows the same policy. On the
CPU and Metal backends nothing is compiled per shape and the policy is off (``TANDEM_STABLE_SHAPES=1``
forces it, ``0`` turns it off).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

CUDA_STEP = 1024  # KV rows per growth step on CUDA: one new attention graph per width every 1024 tokens
LADDER = (1, 2, 4, 8, 16, 32, 64)  # verify widths (a 135M..8B forward costs about the same at 5 and 8 rows)


@dataclass(frozen=True)
class ShapePolicy:
    step: int = CUDA_STEP
    widths: tuple[int, ...] = LADDER

    def pad(self, width: int) -> int:
        """The ladder width a forward of ``width`` rows runs at (wider than the ladder: exact)."""
        for w in self.widths:
            if w >= width:
                return w
        return width

    def ladder(self, width: int) -> list[int]:
        """Every width a forward of up to ``width`` rows runs at (the calibrator measures them,
        the warm-up compiles them)."""
        widest = self.pad(width)
        return [w for w in self.widths if w <= widest] + ([widest] if widest not in self.widths else [])


def capacity(rows: int, step: int) -> int:
    """Buffer rows holding ``rows``: a multiple of ``step``, at least one step."""
    return max(1, -(-rows // step)) * step


def pieces(rows: int, stable: bool, chunk: int) -> list[int]:
    """Row counts to feed ``rows`` rows in: chunks of at most ``chunk`` (bounded memory), and
    under a shape policy powers of two, largest first (13 -> 8 + 4 + 1), so rows fed after a
    parked stretch bring a known width instead of a new one (and a compile) almost every time."""
    out = []
    while rows > 0:
        size = min(rows, chunk)
        if stable:
            size = 1 << (size.bit_length() - 1)
        out.append(size)
        rows -= size
    return out


def default_policy() -> ShapePolicy | None:
    """Stable shapes where a backend compiles per shape (CUDA), else None."""
    forced = os.environ.get("TANDEM_STABLE_SHAPES", "").strip()
    if forced in ("0", "1"):
        return ShapePolicy() if forced == "1" else None
    from engine import platform

    return ShapePolicy() if platform.backend() == "cuda" else None


def capacity_mask(offset: int, rows: int, capacity: int, window: int | None = None, causal: bool = True) -> mx.array:
    """[rows, capacity] bool: query row i (absolute position offset + i) sees key j when j holds
    a real row (j < offset + rows), j <= offset + i (causal) and, with a window, lies within it."""
    q = mx.arange(offset, offset + rows)[:, None]
    k = mx.arange(capacity)[None, :]
    mask = k < offset + rows
    if causal:
        mask = mask & (k <= q)
    if window:
        mask = mask & (q - k < window)
        if not causal:
            mask = mask & (k - q < window)
    return mask


def additive(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """A bool mask as the additive one MLX's GPU attention takes (0 where seen, the dtype's
    lowest value elsewhere: exact zeros after the softmax, as the bool mask gives). Made once
    per forward here, a bool mask would be converted again in every layer."""
    return mx.where(mask, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))


class StableKVCache(KVCache):
    """mlx-lm's ``KVCache`` with capacity-shaped multi-row attention (see the module docstring).
    Trimming is the parent's (the offset moves back; stale rows stay masked)."""

    def __init__(self, step: int = CUDA_STEP):
        super().__init__()
        self.step = step

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            self._grow(prev + n, keys, values)
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n
        if n == 1:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def _grow(self, need: int, keys: mx.array, values: mx.array) -> None:
        size = capacity(need, self.step)
        b, heads, _, k_dim = keys.shape
        new_k = mx.zeros((b, heads, size, k_dim), keys.dtype)
        new_v = mx.zeros((b, heads, size, values.shape[3]), values.dtype)
        if self.keys is not None and self.offset:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    @property
    def state(self) -> Any:
        return KVCache.state.fget(self)

    @state.setter
    def state(self, value: Any) -> None:
        KVCache.state.fset(self, value)
        if self.keys is not None and self.keys.shape[2] % self.step:  # a kept state cut to its rows
            self._grow(self.offset, self.keys, self.values)

    def reserve(self, rows: int, like: tuple[mx.array, mx.array]) -> None:
        """Grow to hold ``rows`` now (the warm-up builds kernels for later capacities)."""
        if self.keys is None or rows > self.keys.shape[2]:
            self._grow(rows, *like)

    def fetched(self, n: int) -> int:
        """Key rows ``update_and_fetch`` of ``n`` rows returns: its rows for one, else the whole
        buffer as that update leaves it."""
        if n == 1:
            return self.offset + 1
        rows = capacity(self.offset + n, self.step)
        return rows if self.keys is None else max(rows, self.keys.shape[2])

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if n == 1:
            return super().make_mask(n, return_array=return_array, window_size=window_size)
        mask = capacity_mask(self.offset, n, self.fetched(n), window_size)
        return mask if self.keys is None else additive(mask, self.keys.dtype)
