"""Telemetry buffers and the maths the plots draw (no Qt, no MLX).

The worker thread appends round events and finished-generation points; the Telemetry tab reads a
snapshot on a ~10 Hz timer. Bounded deques + one short lock: the decoder never waits on the GUI
(an old event falls off the end instead) and the GUI never waits on the decoder.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

MAX_ROUNDS = 512  # round events kept for the acceptance plot (the current generation)
MAX_POINTS = 256  # finished generations kept for the roofline plot
MAX_REQUESTS = 32  # requests kept for the requests table (the running ones and the latest finished)


@dataclass
class Snapshot:
    version: int
    rounds: list[dict]
    points: list[dict]
    model: dict
    calibration: Optional[dict]
    label: str = ""
    requests: list[dict] = field(default_factory=list)  # oldest first: label, state, rounds, tokens, width...
    batch_width: int = 0  # requests sharing the target's forwards now


@dataclass
class TelemetryBuffer:
    max_rounds: int = MAX_ROUNDS
    max_points: int = MAX_POINTS
    rounds: deque = field(init=False)
    points: deque = field(init=False)
    model: dict = field(default_factory=dict)  # name, weight_bytes, kv_bytes_per_token, bandwidth_gbs, ...
    calibration: Optional[dict] = None  # {"widths": [...], "verify_ms": [...], "draft_ms": {...}, ...}
    label: str = ""  # what the rounds belong to, e.g. "chat | dspark"
    version: int = 0  # bumps on every change; the view redraws only when it moved
    batch_width: int = 0  # requests decoding together now (the chat's and the local server's)

    def __post_init__(self):
        self.rounds = deque(maxlen=self.max_rounds)
        self.points = deque(maxlen=self.max_points)
        self.requests: dict[Any, dict] = {}  # key -> its row in the requests table, oldest first
        self.followed: Any = None  # the request whose rounds the acceptance plot shows
        self._lock = threading.Lock()

    def begin(self, label: str, key: Any = None) -> None:
        """A new generation starts: the acceptance plot follows it from round 0 (the newest one,
        when several decode together); ``key`` names it in the requests table."""
        with self._lock:
            self.rounds.clear()
            self.label = label
            self.followed = key
            self.requests[key] = {"label": label, "state": "running", "rounds": 0, "tokens": 0, "accepted": 0,
                                  "mode": "", "width": max(self.batch_width, 1)}
            while len(self.requests) > MAX_REQUESTS:
                old = next((k for k, r in self.requests.items() if r["state"] != "running"), None)
                self.requests.pop(old if old is not None else next(iter(self.requests)))
            self.version += 1

    def push_round(self, event: dict, key: Any = None) -> None:
        """One round of request ``key``: its row counts it; the plot shows it if it follows it."""
        with self._lock:
            row = self.requests.get(key)
            if row is not None:
                row["rounds"] += int(event.get("index", 1) > 0)
                row["tokens"] += int(event.get("committed", 0))
                row["accepted"] += int(event.get("accepted", 0))
                row["mode"] = event.get("mode") or row["mode"]
                row["width"] = max(row["width"], self.batch_width)
            if key == self.followed:
                self.rounds.append(event)
            self.version += 1

    def end(self, key: Any, result: Optional[dict] = None, error: str = "") -> None:
        """Request ``key`` ended: its result (``GenerationResult.to_dict()``'s fields) or an error."""
        with self._lock:
            row = self.requests.get(key)
            if row is None:
                return
            if result is not None:
                row["state"] = result.get("finish_reason") or "done"
                row["tokens"] = int(result.get("tokens", row["tokens"]))
                row["width"] = int(result.get("batch_width") or row["width"])
            else:
                row["state"] = error or "failed"
            self.version += 1

    def set_batch_width(self, width: int) -> None:
        with self._lock:
            if width != self.batch_width:
                self.batch_width = width
                self.version += 1

    def push_point(self, point: dict) -> None:
        with self._lock:
            self.points.append(point)
            self.version += 1

    def set_model(self, info: dict) -> None:
        with self._lock:
            self.model = dict(info)
            self.points.clear()  # tok/s of another model don't belong under this ceiling
            self.version += 1

    def update_model(self, **info) -> None:
        with self._lock:
            self.model.update(info)
            self.version += 1

    def set_calibration(self, curves: Optional[dict]) -> None:
        with self._lock:
            self.calibration = curves
            self.version += 1

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self.version, list(self.rounds), list(self.points), dict(self.model),
                            self.calibration, self.label, [dict(r) for r in self.requests.values()],
                            self.batch_width)


# -- the numbers the plots show -------------------------------------------------------------------
KV = Union[float, dict]  # bytes per token, or {"layers": [[bytes/token, window|None], ...], "state": bytes}


def kv_bytes_at(kv: KV, context: float) -> float:
    """KV (and recurrent state) bytes one decode step reads at this context; mirrors
    ``engine.roofline.KVProfile.bytes_at`` on the plain numbers the worker sends."""
    context = max(context, 0.0)
    if isinstance(kv, dict):
        layers = kv.get("layers") or []
        return float(kv.get("state", 0)) + sum(per * (context if win is None else min(context, win))
                                               for per, win in layers)
    return float(kv or 0.0) * context


def ceiling_tps(bandwidth_bytes_s: float, weight_bytes: float, kv: KV = 0.0, context: float = 0.0) -> float:
    """Memory-bandwidth roofline for one-token-per-forward decoding: every step streams the active
    weights and the KV cache once, so tok/s <= bandwidth / (weights + KV bytes at this context)."""
    per_token = weight_bytes + kv_bytes_at(kv, context)
    return bandwidth_bytes_s / per_token if bandwidth_bytes_s > 0 and per_token > 0 else 0.0


def ceiling_curve(bandwidth_bytes_s: float, weight_bytes: float, kv: KV, max_context: float,
                  n: int = 48) -> tuple[list[float], list[float]]:
    xs = [max_context * i / (n - 1) for i in range(n)]
    return xs, [ceiling_tps(bandwidth_bytes_s, weight_bytes, kv, x) for x in xs]


def acceptance_series(rounds: Sequence[dict]) -> tuple[list[int], list[int], list[int], list[float]]:
    """Per speculative round: index, drafted, accepted, running mean of tokens per round (tau =
    accepted + 1, the target's own token). Round 0 (the prefill's token) is left out."""
    idx, drafted, accepted, mean = [], [], [], []
    total = 0
    for ev in rounds:
        if ev.get("index", 1) == 0:
            continue
        idx.append(int(ev["index"]))
        drafted.append(int(ev["drafted"]))
        accepted.append(int(ev["accepted"]))
        total += int(ev["accepted"]) + 1
        mean.append(total / len(idx))
    return idx, drafted, accepted, mean


def live_tps(rounds: Sequence[dict], window: int = 16) -> Optional[float]:
    """Decode tok/s over the last ``window`` rounds, from the events' timestamps."""
    spec = [ev for ev in rounds if ev.get("index", 1) > 0]
    if len(spec) < 2:
        return None
    tail = spec[-window:]
    first = spec[-window - 1] if len(spec) > window else spec[0]
    tokens = sum(int(ev["committed"]) for ev in tail if ev is not first)
    dt = float(tail[-1]["t"]) - float(first["t"])
    return tokens / dt if dt > 0 and tokens > 0 else None
