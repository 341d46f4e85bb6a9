"""The local API server behind ``tandem serve``: OpenAI and Anthropic dialects on one port.

    tandem serve [--model M] [--mode auto] [--port 8080] [--api-key-file PATH] [--allow-origin ORIGIN]

Routes: POST /v1/chat/completions, /v1/completions (OpenAI), /v1/messages,
/v1/messages/count_tokens (Anthropic); GET /v1/models, /health, /metrics (Prometheus text),
/events (per-round speculative telemetry as server-sent events). The ``/v1`` prefix is optional.

The pieces: ``http`` (request reading, limits, auth, JSON/SSE replies), ``routes`` (the
endpoints), ``worker`` (the one engine thread that owns every MLX call), ``metrics`` (Prometheus
counters, the /events hub), ``openai``/``anthropic`` (the dialects) and ``chat_format`` (prompt
rendering and output parsing shared by both).

* Concurrency: ``--max-batch N`` (``max_batch``) decodes up to N requests together, each
  speculating on its own (engine/batching.py); a request joins a running batch after its own
  chunked prefill and leaves it when it ends. ``x_tandem.batch_width`` says how many requests it
  shared forwards with. A full queue (``--max-queue``) answers 503 with ``Retry-After``.
* Cancellation: while relaying, the handler watches its socket and notices a write failure;
  either sets the request's cancel flag, which ``Engine.stream`` reads after every round and the
  prefill-progress hook reads between prefill chunks.
* Streams send a keep-alive (an SSE comment, or Anthropic's ``ping`` event) when nothing was
  written for ``keepalive_s`` (long queue waits and prefills), so clients and proxies don't time out.
* Bad JSON or a bad field: 400 with the dialect's error body. A prompt longer than the model's
  context (``max_position_embeddings`` from the config, or ``--max-context``): 400 naming both
  numbers (a prompt too many bytes long to fit is refused before it is tokenized, see
  ``routes``); ``max_tokens`` beyond the context is clipped to what fits (``finish_reason: length``).
* A final assistant message is a prefill: the reply continues it.
* Web pages are refused (Host and Origin checks, ``engine.serve.http``): ``--allow-host`` and
  ``--allow-origin`` open it up where wanted.
* Lookup drafts from earlier requests (``Engine.history``): with API keys, each key's requests
  draft only from that key's own earlier requests (several keys: one a line in ``--api-key-file``),
  so the speed of a reply never tells one client what another sent; without keys, from the process's.
* Omitted sampling fields use the server's flags (default greedy: output equals plain greedy
  decoding in every mode); a request may pick its own mode and draft cap with the extension
  field ``"tandem": {"mode": "lookup", "max_draft": 8}``.
* Requests that share a prefix (a system prompt, the conversation so far) restore it from the
  engine's prefix cache and prefill only the rest; replies report it in
  ``usage.prompt_tokens_details.cached_tokens`` (OpenAI), ``usage.cache_read_input_tokens``
  (Anthropic, whose ``input_tokens`` then counts the rest) and ``x_tandem.cached_tokens``.

In-process use (tests)::

    srv = make_server(lambda: tandem.load(), port=0).start()
    ... srv.url ...
    srv.stop()

A host that owns the engine thread already (the desktop app) passes its own ``JobRunner``
(``runner=``) and drives it there; ``stop()`` then closes the port and leaves the requests in
flight to that thread, which answers them to the end.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from engine.errors import TandemError
from engine.serve.http import Access, HTTPServer
from engine.serve.metrics import EventHub, Metrics
from engine.serve.routes import Handler
from engine.serve.worker import DEFAULT_MAX_QUEUE, EngineWorker, JobRunner


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
    allow_hosts: tuple[str, ...] = ()  # Host names answered besides localhost and the bound address
    allow_origins: tuple[str, ...] = ()  # browser Origins served (with CORS headers); none by default
    max_batch: int | None = 1  # requests decoding together (continuous batching); 1: one at a time; None: calibrated
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting beyond it get 503 with Retry-After
    allow_image_urls: bool = False  # fetch http(s) image URLs named in requests (off: data URLs only)
    thinking: bool | None = None  # enable_thinking for templates with the switch unless a request says; None: theirs
    # --max-draft auto's calibration measured between requests, none waiting for it (tandem serve);
    # False: the first request that needs it measures it
    calibrate_while_idle: bool = False


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


class TandemServer:
    """The HTTP server plus its engine thread. ``start()`` returns at once (the model loads in the
    engine thread; requests wait for it); ``wait_ready()`` blocks until it is loaded. With
    ``runner`` (and no factory) the host's thread drives the engine instead."""

    def __init__(self, engine_factory: Callable[[], Any] | None, host: str = "127.0.0.1", port: int = 8080,
                 api_key: str | Sequence[str] | None = None, config: ServerConfig | None = None, *,
                 runner: JobRunner | None = None):
        self.config = config or ServerConfig()
        keys = [api_key] if isinstance(api_key, str) or api_key is None else list(api_key)
        # Stripped: the handler strips what clients send, too. Each key drafts from its own history.
        self.api_keys = tuple(dict.fromkeys(k.strip() for k in keys if k and k.strip()))
        self.hosted = runner is not None
        if runner is not None:
            self.metrics, self.events, self.worker = runner.metrics, runner.events, runner
        else:
            self.metrics = Metrics()
            self.events = EventHub(self.metrics)
            self.worker = EngineWorker(engine_factory, self.events, self.metrics, max_batch=self.config.max_batch,
                                       max_queue=self.config.max_queue,
                                       default_decoding=(self.config.mode, self.config.max_draft)
                                       if self.config.calibrate_while_idle else None)
        self.tokenizer_lock = threading.Lock()  # only for the tokenizer's first use (routes.Handler._tokenizer)
        self.settled_tokenizer: Any = None
        self.started_at = time.time()
        try:
            self.httpd = HTTPServer((host, port), Handler)
        except OSError as e:
            raise TandemError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.httpd.tandem = self  # type: ignore[attr-defined]
        self.host, self.port = self.httpd.server_address[:2]
        self.access = Access.for_bind(host, self.config.allow_hosts, self.config.allow_origins)
        self._thread: threading.Thread | None = None

    @property
    def api_key(self) -> str | None:
        """The (first) key clients must send, or None when the server takes any request."""
        return self.api_keys[0] if self.api_keys else None

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
        if not self.hosted:
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
        """Close the port. Our own engine thread cancels what runs and ends; a host's runner
        refuses new requests (a kept-alive connection's next one gets 503) and its thread answers
        those in flight to the end."""
        self.events.close()
        if self._thread is not None:
            self.httpd.shutdown()
        if self.hosted:
            self.worker.refuse("the server was switched off")
        else:
            self.worker.stop()
        self.httpd.server_close()

    def __enter__(self) -> "TandemServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def make_server(engine_factory: Callable[[], Any], host: str = "127.0.0.1", port: int = 8080,
                api_key: str | Sequence[str] | None = None, **config: Any) -> TandemServer:
    """A server (not yet started) whose engine ``engine_factory()`` builds in the engine thread.
    ``config``: the fields of ``ServerConfig`` (mode, max_draft, temperature, ..., keepalive_s)."""
    return TandemServer(engine_factory, host, port, api_key, ServerConfig(**config))
