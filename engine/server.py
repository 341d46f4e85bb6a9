"""``tandem serve``: OpenAI and Anthropic compatible APIs on one local port.

    tandem serve [--model M] [--mode auto] [--port 8080] [--api-key KEY]

Routes: POST /v1/chat/completions, /v1/completions (OpenAI), /v1/messages,
/v1/messages/count_tokens (Anthropic); GET /v1/models, /health, /metrics (Prometheus text),
/events (per-round speculative telemetry as server-sent events). The ``/v1`` prefix is optional.

Design:

* The standard library's ``ThreadingHTTPServer``: one thread per connection, no dependency, and
  the traffic is one local user's. SSE is written with chunked transfer encoding, so streaming
  connections stay reusable.
* ONE engine thread (``EngineWorker``) loads the model (``engine_factory`` runs there) and does
  all MLX work; requests wait in a FIFO queue. Handler threads only parse, render the prompt
  with the tokenizer (under a lock), and relay chunks from a per-request queue to the socket.
* Cancellation: while relaying, the handler watches its socket (a zero-timeout ``select`` plus a
  ``MSG_PEEK``) and notices a write failure; either sets the request's cancel flag, which
  ``Engine.stream`` reads after every round and the prefill-progress hook reads between prefill
  chunks. A cancelled request that is still queued never starts.
* Streams send a keep-alive (an SSE comment, or Anthropic's ``ping`` event) when nothing was
  written for ``keepalive_s`` (long queue waits and prefills), so clients and proxies don't time out.
* /events subscribers each get a bounded queue; when one is full its events are dropped (and
  counted), so a slow subscriber never stalls decoding.
* Bad JSON or a bad field: 400 with the dialect's error body. A prompt longer than the model's
  context (``max_position_embeddings`` from the config, or ``--max-context``): 400 naming both
  numbers; ``max_tokens`` beyond the context is clipped to what fits (``finish_reason: length``).
* Omitted sampling fields use the server's flags (default greedy: output equals plain greedy
  decoding in every mode); a request may pick its own mode and draft cap with the extension
  field ``"tandem": {"mode": "lookup", "max_draft": 8}``.

In-process use (tests, the app)::

    srv = make_server(lambda: tandem.load(), port=0).start()
    ... srv.url ...
    srv.stop()
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hmac
import json
import logging
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from engine import server_anthropic as anthropic_api
from engine import server_openai as openai_api
from engine.chat_format import (GenSpec, OutputParser, Reply, RequestError, matched_stop, new_id, opens_thinking,
                                render_chat)
from engine.errors import TandemError

log = logging.getLogger("tandem.server")

MAX_BODY = 32 * 1024 * 1024
EVENT_QUEUE = 512  # per /events subscriber
POLL_S = 0.05  # how often a waiting handler looks at its socket


# -- configuration -------------------------------------------------------------------------------

@dataclass
class ServerConfig:
    mode: str = "auto"
    max_draft: int | str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    default_max_tokens: int = 1024
    max_context: int | None = None  # None: read from the model's config
    keepalive_s: float = 10.0
    model_name: str | None = None  # None: the engine's name


def model_context(engine: Any) -> int | None:
    """The model's context length from its config (``max_position_embeddings`` and kin)."""
    configs = []
    loaded = getattr(engine, "loaded", None)
    if loaded is not None and isinstance(getattr(loaded, "config", None), dict):
        configs += [loaded.config, loaded.config.get("text_config") or {}]
    args = getattr(engine.model, "args", None)
    if args is not None:
        configs.append(vars(args) if hasattr(args, "__dict__") else {})
    for cfg in configs:
        for key in ("max_position_embeddings", "n_ctx", "max_sequence_length", "seq_length"):
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


# -- metrics and events ------------------------------------------------------------------------

_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """Counters for /metrics, in Prometheus text format."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.totals = dict(prompt_tokens=0, generated_tokens=0, prefill_seconds=0.0, decode_seconds=0.0,
                           drafted_tokens=0, accepted_tokens=0, rounds=0, target_forwards=0, generations=0,
                           cancelled=0, errors=0, events_dropped=0)
        self.last: dict[str, float] = dict(decode_tok_s=0.0, prefill_tok_s=0.0, accept_per_round=0.0)
        self.latency = [0] * (len(_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.in_flight = 0
        self.queued = 0

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

    def gauge(self, name: str, delta: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + delta)

    def result(self, result: Any) -> None:
        spec = result.rounds[1:]
        with self._lock:
            t = self.totals
            t["generations"] += 1
            t["prompt_tokens"] += result.prompt_tokens
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
                   [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
            metric("requests_in_flight", "gauge", "generation requests being answered", [("", self.in_flight)])
            metric("queue_depth", "gauge", "generation requests waiting for the engine", [("", self.queued)])
            metric("generations_total", "counter", "generations finished (any finish reason)", [("", t["generations"])])
            metric("generations_cancelled_total", "counter", "generations cancelled (client gone)", [("", t["cancelled"])])
            metric("generation_errors_total", "counter", "generations that failed", [("", t["errors"])])
            metric("prompt_tokens_total", "counter", "prompt tokens prefilled", [("", t["prompt_tokens"])])
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


# -- the engine thread -------------------------------------------------------------------------

class _Cancelled(Exception):
    pass


@dataclass
class Job:
    id: str
    endpoint: str
    prompt_ids: list[int]
    kwargs: dict
    out: queue.Queue = field(default_factory=queue.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0


class EngineWorker(threading.Thread):
    """Owns the engine: loads it (``engine_factory()`` runs here) and runs jobs one at a time.

    A job's ``out`` queue receives ``("text", str)`` per round, then ``("result", GenerationResult)``,
    or ``("error", message, http_status)``, or ``("cancelled",)`` when it was cancelled before it began.
    """

    def __init__(self, engine_factory: Callable[[], Any], events: EventHub, metrics: Metrics):
        super().__init__(name="tandem-engine", daemon=True)
        self.factory = engine_factory
        self.events = events
        self.metrics = metrics
        self.engine: Any = None
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.jobs: queue.Queue = queue.Queue()
        self.current: Job | None = None
        self._stopping = False

    def run(self) -> None:
        try:
            try:
                self.engine = self.factory()
            except Exception as e:  # TandemError and anything else: the server reports it, never dies
                self.load_error = str(e) if isinstance(e, TandemError) else f"{type(e).__name__}: {e}"
                log.error("model load failed: %s", self.load_error)
            finally:
                self.ready.set()
            while self.engine is not None:
                job = self.jobs.get()
                if job is None:
                    return
                self.metrics.gauge("queued", -1)
                self.current = job
                try:
                    self._run(job)
                finally:
                    self.current = None
        finally:
            # Free the model and this thread's MLX streams before the thread ends. Without
            # clear_streams (MLX 0.32) a thread that ran compiled functions can abort the process at
            # exit: "terminate called without an active exception".
            self.engine = None
            gc.collect()
            import mlx.core as mx

            mx.clear_streams()

    def submit(self, job: Job) -> Job:
        if self._stopping:
            raise RequestError("the server is shutting down", status=503, kind="api_error")
        self.metrics.gauge("queued", 1)
        self.jobs.put(job)
        return job

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():
            job.out.put(("cancelled",))
            return
        job.started = time.perf_counter()
        events = self.events

        def on_round(ev: Any) -> None:
            if events.active:
                events.publish({"type": "round", "id": job.id, **dataclasses.asdict(ev)})

        def progress(done: int, total: int) -> None:
            if job.cancel.is_set():  # a long prefill stops between chunks
                raise _Cancelled()

        if events.active:
            events.publish({"type": "request", "id": job.id, "endpoint": job.endpoint,
                            "prompt_tokens": len(job.prompt_ids), "queue_s": round(job.started - job.submitted, 4),
                            **{k: job.kwargs.get(k) for k in ("mode", "max_new_tokens", "temperature")}}, evict=True)
        try:
            for chunk in self.engine.stream(job.prompt_ids, on_round=on_round, cancel=job.cancel.is_set,
                                            prefill_progress=progress, **job.kwargs):
                if chunk.result is not None:
                    self.metrics.result(chunk.result)
                    if events.active:
                        events.publish({"type": "result", "id": job.id, **chunk.result.to_dict()}, evict=True)
                    job.out.put(("result", chunk.result))
                elif chunk.text:
                    job.out.put(("text", chunk.text))
        except _Cancelled:
            self.metrics.add(cancelled=1)
            self._failed(job, "cancelled during prefill", None)
        except TandemError as e:
            self._failed(job, str(e), 400)
        except Exception as e:  # a bug must not take the engine thread down with it
            log.error("generation %s failed:\n%s", job.id, traceback.format_exc())
            self._failed(job, f"internal error: {type(e).__name__}: {e}", 500)

    def _failed(self, job: Job, message: str, status: int | None) -> None:
        if status is not None:
            self.metrics.add(errors=1)
        if self.events.active:
            self.events.publish({"type": "error", "id": job.id, "message": message}, evict=True)
        job.out.put(("error", message, status) if status is not None else ("cancelled",))

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.out.put(("error", "the server is shutting down", 503))
        current = self.current
        if current is not None:
            current.cancel.set()
        self.jobs.put(None)
        self.join(timeout)


# -- HTTP ------------------------------------------------------------------------------------------

class _ClientGone(Exception):
    pass


_DIALECTS = {"openai": openai_api, "anthropic": anthropic_api}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tandem"
    timeout = 600  # an idle keep-alive connection lets its thread go after this long
    _endpoint, _sse_open, _body_read, _last_write = "other", False, True, 0.0

    @property
    def tandem(self) -> "TandemServer":
        return self.server.tandem  # type: ignore[attr-defined]

    # -- plumbing -------------------------------------------------------------------------------
    def log_message(self, fmt: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), fmt % args)

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        self.tandem.metrics.request(self._endpoint, int(code) if str(code).isdigit() else 0)
        log.info('"%s" %s', self.requestline, code)

    def _route(self) -> str:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        return path[3:] or "/" if path.startswith("/v1/") or path == "/v1" else path

    @property
    def _dialect(self) -> str:
        return "anthropic" if "/messages" in self.path or "anthropic-version" in self.headers else "openai"

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj, ensure_ascii=False).encode())

    def _error(self, status: int, message: str, *, kind: str | None = None, param: str | None = None,
               code: str | None = None) -> None:
        kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                        413: "request_too_large", 503: "overloaded_error"}.get(status, "api_error")
        if self._dialect == "openai" and kind == "api_error":
            kind = "server_error"
        self._json(status, _DIALECTS[self._dialect].error_body(message, kind, param, code))

    def _start_sse(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._sse_open = True

    def _write(self, frames: list[bytes] | bytes) -> None:
        data = b"".join(frames) if isinstance(frames, list) else frames
        if not data:
            return
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except OSError:  # BrokenPipe, ConnectionReset: the client left
            raise _ClientGone() from None
        self._last_write = time.monotonic()

    def _end_sse(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True

    def _client_gone(self) -> bool:
        """The peer closed its end (EOF is readable); pipelined bytes don't count."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _authorized(self) -> bool:
        key = self.tandem.api_key
        if not key:
            return True
        auth = self.headers.get("Authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else self.headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), key.encode())

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
                if len(data) > MAX_BODY:
                    raise RequestError("request body too large", status=413, kind="request_too_large")
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("a request body with Content-Length is required", status=411)
        try:
            n = int(length)
        except ValueError:
            raise RequestError("bad Content-Length header") from None
        if n > MAX_BODY:
            raise RequestError(f"request body too large ({n} bytes; at most {MAX_BODY})", status=413, kind="request_too_large")
        return self.rfile.read(n)

    def _read_json(self) -> dict:
        raw = self._read_body()
        self._body_read = True
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    # -- dispatch -------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self._handle({"/health": self._health, "/metrics": self._metrics, "/events": self._events,
                      "/models": self._models, "/": self._index}, get=True)

    def do_POST(self) -> None:
        self._handle({"/chat/completions": self._chat, "/completions": self._completions,
                      "/messages": self._messages, "/messages/count_tokens": self._count_tokens}, get=False)

    def _handle(self, routes: dict, get: bool) -> None:
        self._endpoint, self._sse_open, self._body_read = "other", False, get
        self._last_write = time.monotonic()
        route = self._route()
        fn = routes.get(route)
        if fn is None and get and route.startswith("/models/"):
            fn = self._models
        try:
            if fn is None:
                other = "POST" if get else "GET"
                self.close_connection = not self._body_read
                raise RequestError(f"no route {self.command} {urlsplit(self.path).path}"
                                   + (f" (try {other})" if route in ("/chat/completions", "/completions", "/messages",
                                                                    "/models", "/health", "/metrics", "/events") else ""),
                                   status=404, kind="not_found_error")
            self._endpoint = route
            if route != "/health" and not self._authorized():
                self.close_connection = not self._body_read
                raise RequestError("invalid API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                                   status=401, kind="authentication_error")
            fn()
        except _ClientGone:
            self.close_connection = True
        except RequestError as e:
            self._fail(e.status, str(e), kind=e.kind, param=e.param, code=e.code)
        except TandemError as e:
            self._fail(400, str(e))
        except Exception as e:
            log.error("%s %s failed:\n%s", self.command, self.path, traceback.format_exc())
            self._fail(500, f"internal error: {type(e).__name__}: {e}")

    def _fail(self, status: int, message: str, **kw: Any) -> None:
        if not self._body_read:
            self.close_connection = True  # the unread body would be taken for the next request
        try:
            if self._sse_open:  # the stream already began: say it in the stream, then end it
                writer = openai_api.ChatWriter if self._dialect == "openai" else anthropic_api.MessagesWriter
                self._write(writer.stream_error(message))
                self._end_sse()
            else:
                self._error(status, message, **kw)
        except (_ClientGone, OSError):
            self.close_connection = True

    # -- simple routes --------------------------------------------------------------------------
    def _index(self) -> None:
        self._json(200, {"name": "tandem", "model": self.tandem.model_name,
                         "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                                       "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics", "/events"]})

    def _health(self) -> None:
        w = self.tandem.worker
        if w.load_error:
            self._json(503, {"status": "error", "error": w.load_error})
        elif not w.ready.is_set():
            self._json(503, {"status": "loading"})
        else:
            self._json(200, {"status": "ok", "model": self.tandem.model_name, "mode": self.tandem.config.mode,
                             "queue_depth": self.tandem.metrics.queued, "in_flight": self.tandem.metrics.in_flight})

    def _metrics(self) -> None:
        self._send(200, self.tandem.metrics.render().encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _models(self) -> None:
        self._engine()
        name, now = self.tandem.model_name, int(self.tandem.started_at)
        # One list both SDKs can read: OpenAI's fields and Anthropic's side by side.
        entry = {"id": name, "object": "model", "created": now, "owned_by": "tandem", "type": "model",
                 "display_name": name, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                 "context_length": self.tandem.max_context}
        route = self._route()
        if route.startswith("/models/"):
            self._json(200, entry)  # any id: this server answers every model name with its one model
            return
        self._json(200, {"object": "list", "data": [entry], "has_more": False, "first_id": name, "last_id": name})

    def _events(self) -> None:
        hub = self.tandem.events
        q = hub.subscribe()
        try:
            self._start_sse()
            self._write(b": connected\n\n")
            while True:
                try:
                    event = q.get(timeout=min(self.tandem.config.keepalive_s, 1.0))
                except queue.Empty:
                    if self._client_gone():
                        raise _ClientGone()
                    if time.monotonic() - self._last_write >= self.tandem.config.keepalive_s:
                        self._write(b": keep-alive\n\n")
                    continue
                if event is None:  # the server is stopping
                    self._end_sse()
                    self.close_connection = True
                    return
                self._write(f"event: {event['type']}\ndata: ".encode() + json.dumps(event).encode() + b"\n\n")
        finally:
            hub.unsubscribe(q)

    # -- generation -----------------------------------------------------------------------------
    def _engine(self) -> Any:
        worker = self.tandem.worker
        while not worker.ready.wait(POLL_S * 4):
            if self._client_gone():
                raise _ClientGone()
        if worker.load_error:
            raise RequestError(f"the model failed to load: {worker.load_error}", status=503, kind="api_error")
        return worker.engine

    def _chat(self) -> None:
        spec = openai_api.parse_chat(self._read_json())
        self._generate(spec, openai_api.ChatWriter(spec), openai_api)

    def _completions(self) -> None:
        spec = openai_api.parse_completion(self._read_json())
        self._generate(spec, None, openai_api)

    def _messages(self) -> None:
        spec = anthropic_api.parse_request(self._read_json())
        self._generate(spec, anthropic_api.MessagesWriter(spec), anthropic_api)

    def _count_tokens(self) -> None:
        spec = anthropic_api.parse_request(self._read_json(), count_only=True)
        _, ids = self._render(self._engine(), spec)
        self._json(200, {"input_tokens": len(ids)})

    def _render(self, engine: Any, spec: GenSpec) -> tuple[str, list[int]]:
        with self.tandem.tokenizer_lock:
            if spec.kind == "chat":
                return render_chat(engine.tokenizer, spec.messages, spec.tools)
            if isinstance(spec.prompt, str):
                return spec.prompt, engine.encode(spec.prompt, chat_template=False)
            vocab = engine.target.vocab_size
            if any(t >= vocab for t in spec.prompt):
                raise RequestError(f"'prompt' has a token id outside the vocabulary (size {vocab})", param="prompt")
            return engine.tokenizer.decode(spec.prompt), list(spec.prompt)

    def _generate(self, spec: GenSpec, writer: Any, dialect: Any) -> None:
        t0 = time.perf_counter()
        srv, cfg = self.tandem, self.tandem.config
        engine = self._engine()
        prompt_text, ids = self._render(engine, spec)
        if writer is None:
            writer = openai_api.CompletionWriter(spec, prompt_text)
        limit = srv.max_context
        if limit and len(ids) >= limit:
            raise dialect.context_error(len(ids), limit)
        wanted = spec.max_tokens or cfg.default_max_tokens
        kwargs = dict(
            mode=spec.mode or cfg.mode, max_draft=spec.max_draft if spec.max_draft is not None else cfg.max_draft,
            max_new_tokens=min(wanted, limit - len(ids)) if limit else wanted,
            temperature=cfg.temperature if spec.temperature is None else spec.temperature,
            top_p=cfg.top_p if spec.top_p is None else spec.top_p,
            top_k=cfg.top_k if spec.top_k is None else spec.top_k,
            seed=cfg.seed if spec.seed is None else spec.seed, stop=spec.stop)
        prefix = {"openai": "chatcmpl-" if spec.kind == "chat" else "cmpl-", "anthropic": "msg_"}
        reply = Reply(id=new_id(prefix["anthropic" if dialect is anthropic_api else "openai"]),
                      model=spec.model or srv.model_name, created=int(time.time()), prompt_tokens=len(ids),
                      stop=spec.stop)
        parser = None
        if spec.kind == "chat":
            names = [t["function"]["name"] for t in spec.tools] if spec.tools else None
            parser = OutputParser(tool_names=names, in_think=opens_thinking(prompt_text))
        job = srv.worker.submit(Job(reply.id, self._endpoint, ids, kwargs))
        srv.metrics.gauge("in_flight", 1)
        try:
            if spec.stream:
                self._stream(job, writer, parser, reply, spec)
            else:
                for _ in self._relay(job, writer, parser, reply, spec):
                    pass
                self._json(200, writer.body(reply))
        finally:
            job.cancel.set()  # a no-op when it finished; stops it when anything above failed
            srv.metrics.gauge("in_flight", -1)
            srv.metrics.latency_observe(time.perf_counter() - t0)

    def _relay(self, job: Job, writer: Any, parser: OutputParser | None, reply: Reply, spec: GenSpec,
               keepalive: Callable[[], None] | None = None) -> Iterator[list]:
        """Yield parsed events as the engine produces them; fill ``reply`` when it finishes."""
        keepalive_s = self.tandem.config.keepalive_s
        last_check = 0.0
        while True:
            try:
                item = job.out.get(timeout=POLL_S)
            except queue.Empty:
                item = None
            now = time.monotonic()
            if item is None or now - last_check >= POLL_S:
                last_check = now
                if self._client_gone():
                    job.cancel.set()
                    raise _ClientGone()
            if item is None:
                if keepalive is not None and now - self._last_write >= keepalive_s:
                    keepalive()
                continue
            kind = item[0]
            if kind == "text":
                events = parser.feed(item[1]) if parser else [("text", item[1])]
                reply.add(events)
                yield events
            elif kind == "result":
                events = parser.finish() if parser else []
                reply.add(events)
                self._finish_reply(reply, item[1], spec, job)
                yield events
                return
            elif kind == "cancelled":
                raise _ClientGone()
            else:
                raise RequestError(item[1], status=item[2], kind="invalid_request_error" if item[2] == 400 else "api_error")

    def _finish_reply(self, reply: Reply, result: Any, spec: GenSpec, job: Job) -> None:
        reply.result = result
        if result.finish_reason == "stop" and spec.stop:
            with self.tandem.tokenizer_lock:
                full = self.tandem.worker.engine.tokenizer.decode(result.token_ids, skip_special_tokens=False)
            reply.stop_sequence = matched_stop(full, spec.stop)
        reply.x_tandem = {**result.to_dict(), "ttft_s": round(result.ttft_s, 4),
                          "queue_s": round(job.started - job.submitted, 4)}
        if spec.ignored:
            reply.x_tandem["ignored"] = spec.ignored
        if result.finish_reason == "cancelled":
            raise RequestError("the generation was cancelled (the server is shutting down)", status=503,
                               kind="api_error")

    def _stream(self, job: Job, writer: Any, parser: OutputParser | None, reply: Reply, spec: GenSpec) -> None:
        def begin() -> None:
            if not self._sse_open:
                self._start_sse()
                self._write(writer.start(reply))

        def keepalive() -> None:
            begin()
            self._write(writer.keepalive())

        for events in self._relay(job, writer, parser, reply, spec, keepalive):
            begin()
            self._write(writer.events(reply, events))
        begin()
        self._write(writer.end(reply))
        self._end_sse()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return  # a client that went away is not an error
        log.error("request from %s failed:\n%s", client_address, traceback.format_exc())


class TandemServer:
    """The HTTP server plus its engine thread. ``start()`` returns at once (the model loads in the
    engine thread; requests wait for it); ``wait_ready()`` blocks until it is loaded."""

    def __init__(self, engine_factory: Callable[[], Any], host: str = "127.0.0.1", port: int = 8080,
                 api_key: str | None = None, config: ServerConfig | None = None):
        self.config = config or ServerConfig()
        self.api_key = api_key or None
        self.metrics = Metrics()
        self.events = EventHub(self.metrics)
        self.worker = EngineWorker(engine_factory, self.events, self.metrics)
        self.tokenizer_lock = threading.Lock()
        self.started_at = time.time()
        try:
            self.httpd = _HTTPServer((host, port), Handler)
        except OSError as e:
            raise TandemError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.httpd.tandem = self  # type: ignore[attr-defined]
        self.host, self.port = self.httpd.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}"

    @property
    def model_name(self) -> str:
        engine = self.worker.engine
        return self.config.model_name or (engine.name if engine is not None else "tandem")

    @property
    def max_context(self) -> int | None:
        if self.config.max_context:
            return self.config.max_context
        return model_context(self.worker.engine) if self.worker.engine is not None else None

    def start(self) -> "TandemServer":
        self.worker.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="tandem-http", daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> "TandemServer":
        if not self.worker.ready.wait(timeout):
            raise TandemError(f"the model did not load within {timeout:.0f}s")
        if self.worker.load_error:
            raise TandemError(self.worker.load_error)
        return self

    def stop(self) -> None:
        self.events.close()
        if self._thread is not None:
            self.httpd.shutdown()
        self.worker.stop()
        self.httpd.server_close()

    def __enter__(self) -> "TandemServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def make_server(engine_factory: Callable[[], Any], host: str = "127.0.0.1", port: int = 8080,
                api_key: str | None = None, **config: Any) -> TandemServer:
    """A server (not yet started) whose engine ``engine_factory()`` builds in the engine thread.
    ``config``: the fields of ``ServerConfig`` (mode, max_draft, temperature, ..., keepalive_s)."""
    return TandemServer(engine_factory, host, port, api_key, ServerConfig(**config))


# -- CLI -------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.cli_generate import add_model_arguments, add_sampling_arguments, parse_max_draft
    from engine.generate import MODES

    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None,
                   help="require this key on every route but /health (Authorization: Bearer KEY or x-api-key: KEY)")
    p.add_argument("--mode", default="auto", choices=MODES, help="decoding mode when a request names none")
    p.add_argument("--max-draft", type=parse_max_draft, default=None,
                   help="draft cap per round: an integer, 0 for the drafter's full block, or 'auto'")
    add_sampling_arguments(p)
    p.add_argument("--max-tokens", type=int, default=1024, dest="default_max_tokens",
                   help="max new tokens when a request does not say (default 1024)")
    p.add_argument("--max-context", type=int, default=None,
                   help="refuse prompts longer than this (default: the model's max_position_embeddings)")
    p.add_argument("--served-name", default=None, help="the model name /v1/models reports (default: the model's)")
    p.add_argument("--keepalive", type=float, default=10.0, help="seconds between SSE keep-alives while waiting")
    p.add_argument("--quiet", action="store_true", help="do not log each request")


def run(args: argparse.Namespace) -> int:
    from engine.cli_generate import load_engine

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.default_max_tokens < 1:
        raise TandemError(f"--max-tokens must be at least 1, got {args.default_max_tokens}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"tandem: warning: listening on {args.host} without --api-key: anyone who can reach this "
              "machine can use the model", file=sys.stderr)
    config = ServerConfig(mode=args.mode, max_draft=args.max_draft, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, default_max_tokens=args.default_max_tokens,
                          max_context=args.max_context, keepalive_s=args.keepalive, model_name=args.served_name)
    server = TandemServer(lambda: load_engine(args), args.host, args.port, args.api_key, config)

    def on_term(signum: int, frame: Any) -> None:  # a service manager's stop: same clean exit as Ctrl-C
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, on_term)
    server.start()
    print(f"tandem: loading {args.model or 'the starter model'} ...", file=sys.stderr, flush=True)
    try:
        server.wait_ready()
        ctx = server.max_context
        print(f"tandem: serving {server.model_name} (mode {args.mode}, context {ctx or 'unknown'}) at {server.url}\n"
              f"  OpenAI:    {server.url}/v1/chat/completions   (base_url={server.url}/v1)\n"
              f"  Anthropic: {server.url}/v1/messages           (base_url={server.url})\n"
              f"  telemetry: {server.url}/events  {server.url}/metrics\n"
              f"  Ctrl-C stops the server.", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\ntandem: stopping", file=sys.stderr)
        return 0
    finally:
        server.stop()
