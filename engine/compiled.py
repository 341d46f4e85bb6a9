"""Compiled norms and rotary embeddings for the target's small forwards (steps and verifies).

On MLX's CPU backend ``mx.fast.rms_norm`` and ``mx.fast.rope`` run their fallbacks: a norm is 7
kernels, a rope 18 (positions, inverse frequencies, cos, sin, rotate, concatenate), and one
SmolLM2 decode step launches ~1,900 kernels in all, each paying a fixed dispatch cost that
dwarfs its few hundred floats of work. ``mx.compile`` fuses each chain into a few kernels. The
cache update and attention stay as they are (their shapes grow every step; a compiled function
would retrace each time), so the compiled pieces are the cache-free ones, and they compute the
same float32 operations in the same order: the install probe demands bit-identical logits
against the plain forward and leaves the model untouched otherwise.

Every layer's rope rotates by the same angles (the forward's positions), so a forward computes
them once: the rope itself applied to a unit vector gives its own cos and sin, bit for bit
(``1*cos - 0*sin``), and each layer then runs one compiled rotation, ``x*(cos, cos) +
(x2, x1)*(-sin, sin)``, the fallback's products and sums in another order that IEEE makes exact
(``a - b`` is ``a + (-b)``; sums commute). Computing the angles in every layer took ~2.5 ms of a
starter step's ~37. A batch's forward passes each row's offset as one array, the same object in
every layer (``slot_kv.row_offsets``), and gets each row's angles once the same way. Ropes over
part of the head and interleaved ones keep the per-layer compiled rope.

The modules are switched in place (their class becomes a subclass whose ``__call__`` takes the
compiled path while the target's switch is on), so parameter names, taps and drafters that
borrow target modules see the model they expect. ``Target.forward`` turns the switch on for
forwards of at most ``MAX_WIDTH`` rows: prefill chunks keep the plain path (their many widths
would each cost a trace). CPU backend only: Metal and CUDA run the fused kernels themselves.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

MAX_WIDTH = 64  # rows per forward that take the compiled path (each new width traces once)


class Switch:
    """Whether a target's compiled modules take the compiled path, and this forward's offsets
    as arrays and rope angles (one per distinct cache offset, shared by every layer's rope)."""

    def __init__(self) -> None:
        self.on = False
        self._offsets: dict[int, mx.array] = {}
        self._angles: dict[tuple, tuple[mx.array, mx.array]] = {}

    def set(self, on: bool) -> None:
        self.on = on
        self._offsets = {}
        self._angles = {}

    def rope_angles(self, rope: nn.RoPE, offset: int | mx.array, rows: int, dtype: mx.Dtype
                    ) -> tuple[mx.array, mx.array]:
        """(cos, cos) and (-sin, sin) at positions ``offset ..`` ([rows, dims]; per batch row,
        [batch, 1, rows, dims], for an array of offsets), as ``rope`` computes them for ``dtype``
        (it rotates a unit vector: ``1*cos - 0*sin``, ``1*sin + 0*cos``). An array is keyed by
        identity (a batch's layers share one, ``slot_kv.row_offsets``), and held while keyed."""
        per_row = isinstance(offset, mx.array)
        key = (rope.dims, rope.base, rope.scale, id(offset) if per_row else offset, rows, dtype)
        if key not in self._angles:
            half, batch = rope.dims // 2, offset.size if per_row else 1
            unit = mx.concatenate([mx.ones((batch, 1, rows, half), dtype), mx.zeros((batch, 1, rows, half), dtype)],
                                  axis=-1)
            cos_sin = _rope(rope.dims, False, rope.base, rope.scale)(unit, self.offset(offset))
            if not per_row:
                cos_sin = cos_sin[0, 0]
            cos, sin = cos_sin[..., :half], cos_sin[..., half:]
            self._angles[key] = (mx.concatenate([cos, cos], axis=-1), mx.concatenate([-sin, sin], axis=-1), offset)
        return self._angles[key][:2]

    def offset(self, value: int | mx.array) -> mx.array:
        if isinstance(value, mx.array):
            return value
        if value not in self._offsets:
            self._offsets[value] = mx.array(value, dtype=mx.int32)
        return self._offsets[value]


@lru_cache(maxsize=None)
def _rms_norm(eps: float) -> Callable:
    return mx.compile(lambda x, weight: mx.fast.rms_norm(x, weight, eps))


@lru_cache(maxsize=None)
def _rope(dims: int, traditional: bool, base: float, scale: float) -> Callable:
    return mx.compile(lambda x, offset: mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale,
                                                     offset=offset))


class CompiledRMSNorm(nn.RMSNorm):
    _tandem_switch: Switch

    def __call__(self, x: mx.array) -> mx.array:
        if self._tandem_switch.on:
            return _rms_norm(self.eps)(x, self["weight"])
        return super().__call__(x)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return x * cos + mx.concatenate([x[..., half:], x[..., :half]], axis=-1) * sin


_rotate_compiled = mx.compile(_rotate)  # traced once per shape: q and k, at each width


class CompiledRoPE(nn.RoPE):
    _tandem_switch: Switch

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        switch = self._tandem_switch
        if not switch.on:
            return super().__call__(x, offset)
        if not self.traditional and self.dims == x.shape[-1] and (
                isinstance(offset, int) or (isinstance(offset, mx.array) and offset.ndim == 1 and offset.size == x.shape[0])):
            return _rotate_compiled(x, *switch.rope_angles(self, offset, x.shape[-2], x.dtype))
        return _rope(self.dims, self.traditional, self.base, self.scale)(x, switch.offset(offset))


# Exactly these classes (a subclass may override __call__ with other maths).
_SWAPS = {nn.RMSNorm: CompiledRMSNorm, nn.RoPE: CompiledRoPE}


def swap_modules(model: nn.Module, switch: Switch) -> list[tuple[nn.Module, type]]:
    """Switch every plain RMSNorm and RoPE in ``model`` to its compiled class, governed by
    ``switch``; returns (module, original class) pairs for ``restore``."""
    swapped = []
    for _, module in model.named_modules():
        if type(module) in _SWAPS.values():  # a second Target over the same model takes them over
            object.__setattr__(module, "_tandem_switch", switch)
            continue
        compiled = _SWAPS.get(type(module))
        if compiled is None:
            continue
        swapped.append((module, type(module)))
        module.__class__ = compiled
        object.__setattr__(module, "_tandem_switch", switch)
    return swapped


def restore(swapped: list[tuple[nn.Module, type]]) -> None:
    for module, cls in swapped:
        module.__class__ = cls


def probe(forward: Callable[[], mx.array], switch: Switch) -> str:
    """'' when ``forward`` (a fresh forward returning logits) is bit-identical with the switch
    on and off, else why not."""
    switch.set(False)
    plain = forward()
    switch.set(True)
    try:
        fast = forward()
    except Exception as e:  # a model whose modules do not take an array offset, say
        return f"compiled forward failed: {type(e).__name__}: {e}"
    finally:
        switch.set(False)
    mx.eval(plain, fast)
    if plain.shape != fast.shape or not mx.array_equal(plain, fast).item():
        return f"compiled forward differs from the plain one by {mx.abs(plain - fast).max().item():.3g}"
    return ""


def describe(model: Any) -> dict[str, int]:
    """How many modules of each compiled kind ``model`` holds (for telemetry and tests)."""
    counts: dict[str, int] = {}
    for _, module in model.named_modules():
        if isinstance(module, (CompiledRMSNorm, CompiledRoPE)):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return counts
