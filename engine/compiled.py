"""Compiled norms and rotary embeddings for the target's small forwards (steps and verifies).

On MLX's CPU backend ``mx.fast.rms_norm`` and ``mx.fast.rope`` run their fallbacks: a norm is 7
kernels, a rope 18 (positions, inverse frequencies, cos, sin, rotate, concatenate), and one
SmolLM2 decode step launches ~1,900 kernels in all, each paying a fixed dispatch cost that
dwarfs its few hundred floats of work. ``mx.compile`` fuses each chain into a few kernels. The
cache update and attention stay as they are (their shapes grow every step; a compiled function
would retrace each time), so the compiled pieces are the cache-free ones, and they compute the
same float32 operations in the same order: the install probe demands bit-identical logits
against the plain forward and leaves the model untouched otherwise.

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
    as arrays (one per distinct cache offset, shared by every layer's rope)."""

    def __init__(self) -> None:
        self.on = False
        self._offsets: dict[int, mx.array] = {}

    def set(self, on: bool) -> None:
        self.on = on
        self._offsets = {}

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


class CompiledRoPE(nn.RoPE):
    _tandem_switch: Switch

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self._tandem_switch.on:
            return _rope(self.dims, self.traditional, self.base, self.scale)(x, self._tandem_switch.offset(offset))
        return super().__call__(x, offset)


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
