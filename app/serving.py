"""Serve the app's model to other programs (LM Studio's local-server switch): ``tandem serve``'s
OpenAI and Anthropic endpoints on the engine the app already holds, so an agent and the user's
chat share one loaded model instead of loading it twice.

Everything here runs in the engine worker's thread (app.worker), the only one that touches MLX.
One ``Batcher`` (the ``JobRunner``'s) decodes the chat's requests and the server's together. The
HTTP threads only parse and relay (engine.serve); they queue jobs on that ``JobRunner``, whose
``wake`` asks the worker thread to pump: admit what arrived, one tick of the batch, again while
work remains.

Same defaults as ``tandem serve``: 127.0.0.1 only, Host and Origin checks against web pages
(engine.serve.http), an optional API key. Switching it off closes the port (new connections are
refused) and the requests in flight are answered to the end. While it is on, a server request
whose ``--max-draft auto`` finds this machine uncalibrated drafts at the mode's fixed cap and says
so (no client waits a minute for a measurement); a chat message in that mode measures it, with its
progress shown and Stop to cancel, and the Telemetry tab's Calibrate does too.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from engine.serve.metrics import EventHub, Metrics
from engine.serve.server import ServerConfig, TandemServer
from engine.serve.worker import JobRunner

HOST = "127.0.0.1"  # this machine only, as ``tandem serve`` binds by default


class Serving:
    """The shared batch, and the local server while it is on. Not thread-safe: the worker
    thread calls every method; ``wake`` is the one call that comes from the HTTP threads."""

    def __init__(self, wake: Callable[[], None], on_event: Callable[[dict], None], max_batch: int):
        metrics = Metrics()
        # Its batch is the app's: the chat's requests join it too (``batcher_for``). Its metrics
        # and its jobs outlive a switch-off, so the in-flight ones end and /metrics goes on counting.
        self.runner = JobRunner(EventHub(metrics), metrics, max(2, max_batch), wake=wake, on_event=on_event)
        self.server: Optional[TandemServer] = None
        # A tokenizer may change itself on its first encode: the handler threads settle it under this
        # lock (engine/serve/routes.py), and the chat encodes under it too (one lock across restarts).
        self.tokenizer_lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self.server is not None

    @property
    def batcher(self) -> Any:
        """The shared ``engine.batching.Batcher`` (None until a model is attached)."""
        return self.runner.batcher

    @property
    def busy(self) -> bool:
        """Requests in the batch, or server jobs waiting to join it."""
        return bool(self.batcher is not None and self.batcher.busy) or self.runner.has_work

    @property
    def batched(self) -> bool:
        """Chat requests go through the shared batch: while serving, or while server requests
        switched off mid-flight still decode (a chat then joins them instead of waiting)."""
        return self.on or self.busy

    def batcher_for(self, engine: Any) -> Any:
        if self.runner.engine is not engine:
            self.runner.attach(engine)
        return self.batcher

    def state(self) -> dict:
        """What the views show: on/off, the address, the batch."""
        srv = self.server
        return {"on": srv is not None, "url": srv.url if srv else None, "port": srv.port if srv else None,
                "api_key": bool(srv.api_key) if srv else False, "in_flight": len(self.runner.running)}

    # -- on / off ---------------------------------------------------------------------------------
    def start(self, engine: Any, port: int, api_key: Optional[str] = None) -> TandemServer:
        """Listen on 127.0.0.1:``port`` (0: any free port) for requests to ``engine``; raises
        TandemError when the port cannot be had."""
        if self.server is not None:
            self.stop()
        self.batcher_for(engine)
        engine.calibrate_on_request = False  # a server request never makes the others wait (below)
        server = TandemServer(None, HOST, port, api_key, ServerConfig(max_batch=self.runner.max_batch),
                              runner=self.runner)
        server.tokenizer_lock = self.tokenizer_lock
        self.runner.refuse(None)
        self.server = server.start()
        return server

    def stop(self) -> None:
        """Close the port: new connections are refused; the requests in flight go on (``pump``)."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()
        if self.runner.engine is not None:
            self.runner.engine.calibrate_on_request = True

    # -- driving the batch ------------------------------------------------------------------------
    def pump(self) -> bool:
        """Admit the server jobs that arrived, then one tick of the batch; True while work remains."""
        self.runner.admit_queued()
        batcher = self.batcher
        if batcher is not None and batcher.busy:
            batcher.step()
            self.runner.metrics.set_gauge("batch_occupancy", batcher.occupancy)
        return self.busy

    def drain(self) -> None:
        """Answer everything in flight or queued (before the engine is replaced)."""
        while self.pump():
            pass

    def pause(self) -> None:
        """A new model is coming: server requests not yet queued wait for it (``/health`` says
        loading); one rendered for this model and submitted now gets 503 with Retry-After."""
        self.runner.ready.clear()

    def attach(self, engine: Any) -> None:
        """Serve ``engine`` from now on (after a load, or the old one again after a failed load):
        a new batch for a new engine; the same one (ready again) for the same engine."""
        if self.runner.engine is engine:
            self.runner.ready.set()
        else:
            self.runner.attach(engine)
        engine.calibrate_on_request = not self.on

    def shutdown(self) -> None:
        """The app is closing: close the port, cancel everything and let the batch say so."""
        self.stop()
        self.runner.cancel_all("the app is closing")
        if self.batcher is not None:
            self.batcher.step()  # cancelled requests end at once: their handlers get their answer
        self.runner.engine = self.runner.batcher = None
