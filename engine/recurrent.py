"""Rewinding recurrent state (mlx-lm's ``ArraysCache``) to the accepted length of a verify.

GatedDeltaNet (Qwen3.5/3.6, Qwen3-Next), Mamba2 (Nemotron-H, Falcon-H1, Granite-4) and short
convolutions (LFM2) keep a fixed-size state that every token replaces: there are no rows to trim.
After a verify over ``[anchor] + drafts`` keeping ``kept`` rows, each such state must be the one
after exactly ``kept`` rows. A ``Recorder`` watches, during a verify, the modules that receive
such a cache (the innermost modules taking a ``cache`` argument) and rewinds them in one of two
ways:

* ``states`` (per-position states): the recurrence runs one position at a time and keeps every
  state (mlx-lm's recurrences on CPU and CUDA are a loop over positions already); a convolution's
  state is the last k-1 rows of its input, cut from the recorded input at the accepted length.
  Nothing is recomputed at commit.
* ``replay``: the module is re-run on the accepted rows from its state before the verify.

A module whose state ``states`` cannot derive is replayed; state changed where no watched module
ran makes the transaction re-feed the kept rows through the whole model. ``TANDEM_RECURRENT_ROLLBACK``
(states | replay) picks the way; the Target proves it on the model at load (else the other way,
else speculation is refused), so a family this module was not written against is checked, not
assumed.

Watching swaps the class of the watched modules and of their ``nn.Conv1d`` layers for a subclass
that records (parameter paths and the module tree stay unchanged), and wraps mlx-lm's
``gated_delta_update`` / ``ssm_update`` in the model's modules. All of it passes straight through
unless a recorder is recording, which only happens inside ``Target.verify``.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, _BaseCache

from engine.caches import leaves

if TYPE_CHECKING:
    from engine.caches import Verify

METHODS = ("states", "replay")
# Measured on a CPU (tests/device/cache_costs.py --small, Qwen3.5 shapes at 1024 wide, fp32, 8-row
# verifies): per-position states cost no measurable verify time and 0.3 ms per commit; replay
# commits cost 17-40 ms (7-17% of a round) whenever a draft is rejected. H200: the same script.
DEFAULT_METHOD = "states"
METHOD_ENV = "TANDEM_RECURRENT_ROLLBACK"

# Recurrence functions mlx-lm's models call, with their per-position arguments ([B, T, ...]).
STEPWISE = {
    "gated_delta_update": ("q", "k", "v", "a", "b", "mask"),
    "ssm_update": ("hidden_states", "B", "C", "dt", "mask"),
}

_active: "Recorder | None" = None  # the recorder of the forward being built (one MLX thread)


def default_method() -> str:
    method = os.environ.get(METHOD_ENV, DEFAULT_METHOD).strip().lower() or DEFAULT_METHOD
    if method not in METHODS:
        raise ValueError(f"{METHOD_ENV} must be one of {', '.join(METHODS)}, got {method!r}")
    return method


class Call:
    """One call of a watched module during a verify: its inputs and what it computed."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, caches: list):
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.caches = caches  # the cache leaves it was given
        self.conv_inputs: list[mx.array] = []  # each nn.Conv1d's (padded) input, in call order
        self.states: dict[int, list[mx.array]] = {}  # id(final state) -> the state after each position


class Recorder:
    """Watches a model's decoder layers; ``record()`` brackets one verify forward."""

    def __init__(self, layers: list, method: str | None = None):
        self.method = method or default_method()
        self.calls: list[Call] | None = None  # None: not recording
        self.stack: list[Call] = []
        for layer in layers:
            _watch(layer)

    def record(self) -> "Recording":
        return Recording(self)

    def innermost(self) -> Call | None:
        return self.stack[-1] if self.calls is not None and self.stack else None


class Recording:
    """Context manager for one forward; afterwards the ``Rewinder`` of its transaction."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder
        self.method = recorder.method
        self.calls: list[Call] = []

    def __enter__(self) -> "Recording":
        global _active
        self._outer = _active
        self.recorder.calls, self.recorder.stack = self.calls, []
        _active = self.recorder
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        _active = self._outer
        self.recorder.calls, self.recorder.stack = None, []

    # -- the Rewinder protocol --------------------------------------------------------------
    def rewind(self, txn: "Verify", kept: int) -> set[int] | None:
        index = {id(c): i for i, c in enumerate(txn.leaves)}
        fixed: set[int] = set()
        for call in self.calls:
            own = [index[id(c)] for c in call.caches if id(c) in index]
            if self.method == "states" and _pick_states(call, txn, own, kept):
                fixed.update(i for i in own if type(txn.leaves[i]) is ArraysCache)
            else:
                _replay(call, txn, own, kept)
                fixed.update(own)
        return fixed


# ----------------------------------------------------------------------------------------
# rewinding
# ----------------------------------------------------------------------------------------
def _pick_states(call: Call, txn: "Verify", own: list[int], kept: int) -> bool:
    """Set each replaced slot of the call's recurrent caches to its value after ``kept`` rows,
    from the per-position states and convolution inputs the verify recorded. False (and nothing
    changed) when some slot has no such record."""
    picks = state_picks(call, txn.leaves, txn.marks, own, txn.width)
    if picks is None:
        return False
    for i, j, after in picks:
        txn.leaves[i][j] = after(kept)
    return True


def state_picks(call: Call, leaves: list, marks: list, own: list[int], width: int
                ) -> list[tuple[int, int, Callable[[int], mx.array]]] | None:
    """For each slot of the call's recurrent leaves that the forward replaced: (leaf index, slot,
    ``after(kept)``: the slot's value after the first ``kept`` of the ``width`` rows, every
    sequence of the batch at once). None when some slot has no record."""
    picks = []
    conv_inputs = list(call.conv_inputs)
    for i in own:
        c = leaves[i]
        if type(c) is not ArraysCache:
            continue
        before = marks[i][0]
        for j, value in enumerate(c.cache):
            if value is before[j]:
                continue
            states = call.states.get(id(value))
            if states is not None and states[-1] is value:
                picks.append((i, j, lambda kept, states=states: states[kept - 1]))
                continue
            # A convolution state: the last k-1 rows of [old state; new rows]; after ``kept`` rows
            # those are rows kept .. kept+k-2 of the convolution's input.
            x = next((x for x in conv_inputs if value is not None and x.ndim == 3 and value.ndim == 3
                      and x.shape[0] == value.shape[0] and x.shape[2] == value.shape[2]
                      and x.shape[1] == value.shape[1] + width), None)
            if x is None:
                return None
            conv_inputs.remove(x)
            picks.append((i, j, lambda kept, x=x, n=value.shape[1]: x[:, kept : kept + n]))
    return picks


def _replay(call: Call, txn: "Verify", own: list[int], kept: int) -> None:
    """Restore every cache the module was given to its state before the verify, then run the
    module again on the first ``kept`` rows (its output is not needed, only its cache updates)."""
    for i in own:
        txn.restore_leaf(i)
    width = txn.width
    args = [_first_rows(a, width, kept) for a in call.args]
    kwargs = {k: _first_rows(v, width, kept) for k, v in call.kwargs.items()}
    call.module(*args, **kwargs)


def _first_rows(a: Any, width: int, kept: int) -> Any:
    """An argument of a ``width``-row call, cut to its first ``kept`` rows."""
    if not isinstance(a, mx.array):
        return a
    if a.ndim == 3 and a.shape[1] == width:  # activations [B, L, D]
        return a[:, :kept]
    if a.ndim in (2, 4) and a.shape[-2] == width:  # an attention mask [.., L, keys]
        # One query row sees every cached key: what the models' own masks say for one row.
        return None if kept == 1 else a[..., :kept, : a.shape[-1] - (width - kept)]
    return a


# ----------------------------------------------------------------------------------------
# watching
# ----------------------------------------------------------------------------------------
def _takes_cache(module: nn.Module) -> bool:
    try:
        return "cache" in inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return False


def _submodules(module: nn.Module) -> Iterator[nn.Module]:
    """Direct child modules (also inside lists and dicts)."""

    def walk(value: Any) -> Iterator[nn.Module]:
        if isinstance(value, nn.Module):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                yield from walk(v)

    for value in module.values():
        yield from walk(value)


def _watch(module: nn.Module) -> bool:
    """Watch the innermost cache-taking modules under ``module`` (itself when none is deeper) and
    every ``nn.Conv1d``. Returns whether a cache-taking module was found at or below it."""
    if getattr(type(module), "_tandem_watched", False):
        return type(module) is not _WatchedConv1d  # watched already (another Target on this model)
    found = False
    for child in _submodules(module):
        found |= _watch(child)
    if type(module) is nn.Conv1d:
        module.__class__ = _WatchedConv1d
    elif not found and _takes_cache(module):
        for _, m in module.named_modules():  # the recurrence may be called from any of them
            _patch_recurrences(sys.modules.get(type(m).__module__))
        module.__class__ = _watched_class(type(module))
        found = True
    return found


@functools.lru_cache(maxsize=None)
def _watched_class(cls: type) -> type:
    if getattr(cls, "_tandem_watched", False):
        return cls

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        rec = _active
        if rec is None or rec.calls is None:
            return cls.__call__(self, *args, **kwargs)
        given = [c for v in (*args, *kwargs.values()) if isinstance(v, _BaseCache) for c in leaves([v])]
        if not any(type(c) is ArraysCache for c in given):
            return cls.__call__(self, *args, **kwargs)
        call = Call(self, args, kwargs, given)
        rec.calls.append(call)
        rec.stack.append(call)
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            rec.stack.pop()

    return type(cls.__name__, (cls,), {"__call__": __call__, "_tandem_watched": True, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


class _WatchedConv1d(nn.Conv1d):
    """An nn.Conv1d that hands its input to the recording module call it runs in (states mode)."""

    _tandem_watched = True

    def __call__(self, x: mx.array) -> mx.array:
        rec = _active
        call = rec.innermost() if rec is not None and rec.method == "states" else None
        if call is not None:
            call.conv_inputs.append(x)
        return super().__call__(x)


def _patch_recurrences(module: Any) -> None:
    """Wrap mlx-lm's recurrence functions as the model's module sees them (once)."""
    if module is None:
        return
    for name, per_position in STEPWISE.items():
        fn = getattr(module, name, None)
        if callable(fn) and not hasattr(fn, "_tandem_original"):
            setattr(module, name, _stepwise(fn, per_position))


def _stepwise(fn: Callable, per_position: tuple[str, ...]) -> Callable:
    """``fn`` as is, except inside a recording module call in states mode: then one position at
    a time (the same arithmetic as mlx-lm's loop over positions), keeping the state after each."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        rec = _active
        call = rec.innermost() if rec is not None and rec.method == "states" else None
        if call is None:
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a.get("lengths") is not None or a.get(per_position[0]) is None:
            return fn(*args, **kwargs)
        state, outputs, states = a["state"], [], []
        for t in range(a[per_position[0]].shape[1]):
            step = dict(a)
            step.update({n: a[n][:, t : t + 1] for n in per_position if a.get(n) is not None})
            step["state"] = state
            y, state = fn(**step)
            outputs.append(y)
            states.append(state)
        call.states[id(state)] = states
        return mx.concatenate(outputs, axis=1), state

    run._tandem_original = fn
    return run
