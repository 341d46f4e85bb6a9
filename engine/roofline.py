"""Memory roofline: how fast decoding could go if it only streamed bytes.

Plain decoding reads every active weight and the whole KV cache once per token, so on most
machines its ceiling is ``bandwidth / bytes_per_token``. Baseline's share of that ceiling (its
memory-bandwidth utilisation, MBU) says how healthy the plain path is; speculative decoding
commits several tokens per read of the weights, so its speed is reported as "x roofline" and can
exceed 1.

Bytes per token = active weight bytes + KV bytes per token x context (capped per layer by a
sliding window) + fixed recurrent state. Active weights count routed experts at top_k / n, and
leave out the embedding table unless the head is tied to it (a lookup reads one row).

The app builds a ``RooflineModel`` once per loaded model and feeds it ``RoundEvent``s::

    model = RooflineModel.from_engine(engine, bandwidth)   # bytes/s, e.g. Calibration.bandwidth
    tracker = RooflineTracker(model)
    engine.generate(prompt, on_round=lambda ev: plot(tracker.update(ev)))
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

# Names mlx-lm models use for the number of experts routed per token.
_TOP_K_ARGS = ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts")


# -- bandwidth ------------------------------------------------------------------------------
def measure_bandwidth(size_mb: int | None = None, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s (bytes read + bytes written per second), median of ``repeats``.

    On a GPU backend: chains of MLX elementwise passes over a 512 MB buffer, on the device that
    decodes. On the CPU backend: a host memcpy (numpy ``copyto``) of 256 MB, because MLX's CPU
    elementwise kernels are compute-bound at a fraction of what the memory sustains (BLAS reads
    weights far faster than they copy), so they would report a ceiling below baseline itself."""
    from engine.platform import backend

    if backend() == "cpu":
        import numpy as np

        src = np.ones((size_mb or 256) * 1024 * 1024 // 8)
        dst = np.empty_like(src)
        return 2 * src.nbytes / _median_time(lambda: np.copyto(dst, src), repeats)
    n = (size_mb or 512) * 1024 * 1024 // 4
    chain = 8
    a = mx.random.uniform(shape=(n,))
    mx.eval(a)

    def copies() -> None:
        b = a
        for _ in range(chain):
            b = b * 1.0001
        mx.eval(b)

    return 2 * a.nbytes * chain / _median_time(copies, repeats)


def _median_time(fn: Any, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):  # the first run is a warm-up (allocation, page faults)
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- bytes per token ------------------------------------------------------------------------
def _top_k(model: Any) -> int | None:
    args = getattr(model, "args", None)
    for obj in (args, getattr(args, "text_config", None)):
        for name in _TOP_K_ARGS:
            value = getattr(obj, name, None) if obj is not None and not isinstance(obj, dict) else (
                obj.get(name) if isinstance(obj, dict) else None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def active_weight_bytes(model: Any) -> int:
    """Bytes of weights one decode step reads (see the module docstring)."""
    params = tree_flatten(model.parameters())
    tied = not any(".lm_head." in f".{k}" or k.startswith("lm_head") for k, _ in params)
    top_k = _top_k(model)
    total = 0.0
    for path, value in params:
        nbytes = float(value.nbytes)
        if "embed_tokens" in path and not tied:
            nbytes /= max(1, value.shape[0])  # a lookup reads one row
        elif ("switch_mlp" in path or ".experts." in path) and top_k and value.ndim >= 2:
            n_experts = value.shape[0] if "switch_mlp" in path else None
            if n_experts is None:  # per-expert modules: experts.<i>.<...>
                n_experts = _count_experts(params, path)
            if n_experts and n_experts > top_k:
                nbytes *= top_k / n_experts
        total += nbytes
    return int(total)


def _count_experts(params: Sequence[tuple[str, Any]], path: str) -> int | None:
    head, _, rest = path.partition(".experts.")
    index, _, tail = rest.partition(".")
    if not index.isdigit():
        return None
    return sum(1 for k, _ in params if k.startswith(head + ".experts.") and k.endswith("." + tail))


@dataclass(frozen=True)
class KVProfile:
    """Per cached layer: bytes each context token adds, and its window (None: unbounded).
    ``state_bytes``: fixed recurrent state read every step (SSM/linear-attention layers)."""

    layers: tuple[tuple[int, int | None], ...]
    state_bytes: int = 0

    def bytes_at(self, context: int) -> int:
        return self.state_bytes + sum(per * (context if win is None else min(context, win)) for per, win in self.layers)

    @property
    def bytes_per_token(self) -> int:
        return sum(per for per, _ in self.layers)


def kv_profile(model: Any, cache: list | None = None) -> KVProfile:
    """Measure what the model's own cache stores per token with one single-token forward."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model) if cache is None else cache
    model(mx.array([[0]], dtype=mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    layers, state = [], 0
    for c in cache:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if keys is not None and values is not None and keys.ndim >= 2:
            rows = keys.shape[-2]  # allocated rows (a multiple of the cache's step)
            per = (keys.nbytes + values.nbytes) // max(1, rows)
            window = getattr(c, "max_size", None)
            layers.append((int(per), int(window) if window else None))
        else:
            state += sum(int(a.nbytes) for a in _arrays(c.state))
    return KVProfile(tuple(layers), state)


def _arrays(obj: Any) -> list:
    if isinstance(obj, mx.array):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [a for item in obj for a in _arrays(item)]
    return []


# -- the model and the tracker --------------------------------------------------------------
@dataclass
class RooflineModel:
    """Ceiling tok/s for one model on one machine, as a function of context length."""

    weight_bytes: int
    kv: KVProfile
    bandwidth: float  # bytes/s
    name: str = ""

    @classmethod
    def from_engine(cls, engine: Any, bandwidth: float) -> "RooflineModel":
        """``bandwidth`` in bytes/s (``Calibration.bandwidth`` or ``measure_bandwidth()``)."""
        model = engine.target.model if hasattr(engine, "target") else engine
        return cls(active_weight_bytes(model), kv_profile(model), float(bandwidth), getattr(engine, "name", ""))

    def bytes_per_token(self, context: int) -> int:
        return self.weight_bytes + self.kv.bytes_at(max(0, int(context)))

    def ceiling_tps(self, context: int) -> float:
        return self.bandwidth / self.bytes_per_token(context)

    def fraction(self, tps: float, context: int) -> float:
        """tok/s as a fraction of the ceiling: baseline's MBU, or speculation's "x roofline"."""
        return tps / self.ceiling_tps(context)

    def point(self, event: Any, tps: float | None = None) -> dict:
        """One plot point for a ``RoundEvent``. Without ``tps`` the round's own speed is used:
        committed tokens over the round's draft + verify seconds (None for the prefill token)."""
        if tps is None:
            busy = float(getattr(event, "draft_s", 0.0)) + float(getattr(event, "verify_s", 0.0))
            tps = event.committed / busy if busy > 0 else None
        ceiling = self.ceiling_tps(event.context)
        return {
            "index": event.index, "t": event.t, "context": event.context,
            "bytes_per_token": self.bytes_per_token(event.context), "ceiling_tps": ceiling,
            "tps": tps, "x_roofline": (tps / ceiling) if tps is not None else None,
        }

    def summary(self, context: int, baseline_tps: float | None = None) -> dict:
        out = {"weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv.bytes_per_token,
               "bandwidth_gbs": self.bandwidth / 1e9, "context": context,
               "bytes_per_token": self.bytes_per_token(context), "ceiling_tps": self.ceiling_tps(context)}
        if baseline_tps:
            out["baseline_tps"] = baseline_tps
            out["baseline_fraction"] = self.fraction(baseline_tps, context)
        return out


@dataclass
class RooflineTracker:
    """Smooths per-round speed over the last ``window`` rounds (by wall time between events)
    so the plot does not jump between fast accepted blocks and plain steps."""

    model: RooflineModel
    window: int = 16
    _events: deque = field(default_factory=deque)

    def reset(self) -> None:
        self._events.clear()

    def update(self, event: Any) -> dict:
        if event.index == 0:  # a new generation: round 0 is the prefill's token
            self._events.clear()
        self._events.append((event.t, event.generated))
        while len(self._events) > self.window + 1:
            self._events.popleft()
        tps = None
        if len(self._events) >= 2:
            (t0, g0), (t1, g1) = self._events[0], self._events[-1]
            tps = (g1 - g0) / (t1 - t0) if t1 > t0 else None
        return self.model.point(event, tps)  # tps None: the round's own speed

    point = update  # the same call under the name RooflineModel uses
