"""The server's engine thread: it loads the model and runs one generation at a time.

Handler threads only parse requests and relay chunks; every MLX call happens in this thread (MLX
streams are thread-bound). Requests wait in a FIFO queue; a cancelled request that is still
queued never starts, and a long prefill stops between chunks when its request is cancelled."""

from __future__ import annotations

import dataclasses
import gc
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.errors import TandemError
from engine.serve.chat_format import RequestError
from engine.serve.metrics import EventHub, Metrics

log = logging.getLogger("tandem.server")


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
                events.publish({"type": "round", "id": job.id,  # a round's logprobs are the reply's, not telemetry
                                **{f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "logprobs"}})

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
                elif chunk.logprobs:
                    job.out.put(("text", chunk.text, chunk.logprobs))
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
