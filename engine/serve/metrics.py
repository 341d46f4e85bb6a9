"""Server telemetry: Prometheus counters (``/metrics``) and the per-round event hub (``/events``).

Each ``/events`` subscriber gets a bounded queue; when one is full its oldest events are dropped
(and counted), so a slow subscriber never stalls decoding."""

from __future__ import annotations

import queue
import threading
from typing import Any

EVENT_QUEUE = 512  # per /events subscriber


def label_value(text: str) -> str:
    """A label value as the exposition format escapes it (backslash, double quote, newline)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """Counters for /metrics, in Prometheus text format."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.totals = dict(prompt_tokens=0, cached_tokens=0, generated_tokens=0, prefill_seconds=0.0, decode_seconds=0.0,
                           drafted_tokens=0, accepted_tokens=0, rounds=0, target_forwards=0, generations=0,
                           cancelled=0, errors=0, events_dropped=0, rejected=0)
        self.last: dict[str, float] = dict(decode_tok_s=0.0, prefill_tok_s=0.0, accept_per_round=0.0)
        self.latency = [0] * (len(_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.in_flight = 0
        self.queued = 0
        self.batch_occupancy = 0  # requests sharing the engine's forwards now (continuous batching)

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def latency_observe(self, seconds: float) -> None:
        with self._lock:
            self.latency_sum += seconds
            for i, b in enumerate(_BUCKETS):
                if seconds <= b:
                    self.latency[i] += 1
                    break
            else:
                self.latency[-1] += 1

    def add(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                self.totals[k] += v

    def set_gauge(self, name: str, value: int) -> None:
        with self._lock:
            setattr(self, name, value)

    def gauge(self, name: str, delta: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + delta)

    def result(self, result: Any) -> None:
        spec = result.rounds[1:]
        with self._lock:
            t = self.totals
            t["generations"] += 1
            t["prompt_tokens"] += result.prompt_tokens
            t["cached_tokens"] += result.cached_tokens
            t["generated_tokens"] += result.generated
            t["prefill_seconds"] += result.prefill_s
            t["decode_seconds"] += result.decode_s
            t["drafted_tokens"] += sum(d for d, _ in spec)
            t["accepted_tokens"] += sum(a for _, a in spec)
            t["rounds"] += len(spec)
            t["target_forwards"] += result.target_forwards
            t["cancelled"] += result.finish_reason == "cancelled"
            self.last = dict(decode_tok_s=result.decode_tps, prefill_tok_s=result.prefill_tps,
                             accept_per_round=result.mean_accepted)

    def render(self) -> str:
        with self._lock:
            t, lines = self.totals, []

            def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
                lines.extend([f"# HELP tandem_{name} {help_text}", f"# TYPE tandem_{name} {kind}"])
                lines.extend(f"tandem_{name}{labels} {value:g}" if isinstance(value, float) else
                             f"tandem_{name}{labels} {value}" for labels, value in samples)

            metric("requests_total", "counter", "HTTP requests by endpoint and status",
                   [(f'{{endpoint="{label_value(e)}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("requests_in_flight", "gauge", "generation requests being answered", [("", self.in_flight)])
            metric("queue_depth", "gauge", "generation requests waiting for the engine", [("", self.queued)])
            metric("batch_occupancy", "gauge", "requests decoding together in the engine's batch",
                   [("", self.batch_occupancy)])
            metric("requests_rejected_total", "counter", "requests refused with 503 because the queue was full",
                   [("", t["rejected"])])
            metric("generations_total", "counter", "generations finished (any finish reason)", [("", t["generations"])])
            metric("generations_cancelled_total", "counter", "generations cancelled (client gone)", [("", t["cancelled"])])
            metric("generation_errors_total", "counter", "generations that failed", [("", t["errors"])])
            metric("prompt_tokens_total", "counter", "prompt tokens (prefilled or restored)", [("", t["prompt_tokens"])])
            metric("prompt_tokens_cached_total", "counter", "prompt tokens restored from the prefix cache",
                   [("", t["cached_tokens"])])
            metric("generated_tokens_total", "counter", "tokens generated", [("", t["generated_tokens"])])
            metric("prefill_seconds_total", "counter", "seconds spent in prefill", [("", float(t["prefill_seconds"]))])
            metric("decode_seconds_total", "counter", "seconds spent decoding", [("", float(t["decode_seconds"]))])
            metric("decode_tokens_per_second", "gauge", "decode speed of the last generation",
                   [("", float(self.last["decode_tok_s"]))])
            metric("prefill_tokens_per_second", "gauge", "prefill speed of the last generation",
                   [("", float(self.last["prefill_tok_s"]))])
            metric("drafted_tokens_total", "counter", "draft tokens verified", [("", t["drafted_tokens"])])
            metric("accepted_tokens_total", "counter", "draft tokens accepted", [("", t["accepted_tokens"])])
            rate = t["accepted_tokens"] / t["drafted_tokens"] if t["drafted_tokens"] else 0.0
            metric("acceptance_rate", "gauge", "accepted / drafted tokens since start", [("", float(rate))])
            metric("accept_length", "gauge", "tokens committed per verify round, last generation",
                   [("", float(self.last["accept_per_round"]))])
            metric("verify_rounds_total", "counter", "verify rounds after prefill", [("", t["rounds"])])
            metric("target_forwards_total", "counter", "target model forwards", [("", t["target_forwards"])])
            metric("events_dropped_total", "counter", "/events messages dropped for slow subscribers",
                   [("", t["events_dropped"])])
            lines.extend(["# HELP tandem_request_duration_seconds generation request latency",
                          "# TYPE tandem_request_duration_seconds histogram"])
            acc = 0
            for b, n in zip(list(_BUCKETS) + ["+Inf"], self.latency):
                acc += n
                lines.append(f'tandem_request_duration_seconds_bucket{{le="{b}"}} {acc}')
            lines += [f"tandem_request_duration_seconds_sum {self.latency_sum:g}",
                      f"tandem_request_duration_seconds_count {acc}"]
        return "\n".join(lines) + "\n"


class EventHub:
    """Fan-out of telemetry events to /events subscribers through bounded queues."""

    def __init__(self, metrics: Metrics, maxsize: int = EVENT_QUEUE):
        self._subs: set[queue.Queue] = set()
        self._lock = threading.Lock()
        self._metrics = metrics
        self._maxsize = maxsize

    @property
    def active(self) -> bool:
        return bool(self._subs)

    def subscribe(self) -> queue.Queue:
        q: queue.Queue = queue.Queue(self._maxsize)
        with self._lock:
            self._subs.add(q)
        return q

    def unsubscribe(self, q: queue.Queue) -> None:
        with self._lock:
            self._subs.discard(q)

    def publish(self, event: dict, *, evict: bool = False) -> None:
        """Never waits (the decode thread calls this). A full queue drops ``event``, or with
        ``evict`` (request start/end: rare and needed to make sense of the rounds) its oldest entry."""
        with self._lock:
            subs = list(self._subs)
        for q in subs:
            try:
                q.put_nowait(event)
                continue
            except queue.Full:
                self._metrics.add(events_dropped=1)
            if evict:
                try:
                    q.get_nowait()
                    q.put_nowait(event)
                except (queue.Empty, queue.Full):
                    pass

    def close(self) -> None:
        with self._lock:
            subs = list(self._subs)
        for q in subs:
            while True:
                try:
                    q.put_nowait(None)
                    break
                except queue.Full:
                    try:
                        q.get_nowait()
                    except queue.Empty:
                        pass
