"""The server's engine thread: it loads the model and runs the generations.

Handler threads only parse requests and relay chunks; every MLX call happens in this thread (MLX
streams are thread-bound). With ``max_batch`` > 1 requests decode together (engine/batching.py:
continuous batching, a request joining between rounds after its own chunked prefill, a finished
one leaving at once); with 1, one at a time through ``Engine.stream`` as before. Requests wait in
a FIFO queue bounded by ``max_queue`` (a full queue answers 503 with Retry-After); a cancelled
request that is still queued never starts, and a cancelled one in flight stops at the next
round or prefill chunk.

``JobRunner`` is all of it but the thread (queue, admission, replies), so a host that owns an
engine thread already (the desktop app, app/serving.py) drives it there."""

from __future__ import annotations

import dataclasses
import gc
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from engine.errors import TandemError
from engine.serve.chat_format import RequestError
from engine.serve.metrics import EventHub, Metrics

log = logging.getLogger("tandem.server")


DEFAULT_MAX_QUEUE = 64  # requests waiting for the engine before new ones get 503
IDLE_WARM_S = 0.5  # idle this long, the engine thread compiles the next shape past the longest request
RETRY_AFTER_S = 2


class _Cancelled(Exception):
    pass


def _retry_later(message: str, kind: str) -> RequestError:
    """A 503 that tells the client when to come back (``Retry-After``)."""
    error = RequestError(message, status=503, kind=kind)
    error.retry_after = RETRY_AFTER_S
    return error


@dataclass(eq=False)  # jobs are told apart by identity (sets of running jobs)
class Job:
    id: str
    endpoint: str
    prompt_ids: list[int]
    kwargs: dict
    out: queue.Queue = field(default_factory=queue.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0


class JobRunner:
    """Jobs onto one engine, without a thread of its own: the queue the handler threads fill
    (``submit``), admission into the batch and the replies on each job's ``out`` queue. The thread
    that owns the engine drives it: ``EngineWorker`` below for ``tandem serve``; the desktop app's
    engine thread when it serves the model it holds (``attach`` it with the app's own ``Batcher``,
    then ``admit_queued`` and step while ``has_work``; ``wake`` tells that thread a job came).

    A job's ``out`` queue receives ``("text", str)`` per round, then ``("result", GenerationResult)``,
    or ``("error", message, http_status)``, or ``("cancelled",)`` when it was cancelled before it began.
    ``on_event`` (the driving thread) gets the dicts ``/events`` publishes: request, round, result, error.
    """

    def __init__(self, events: EventHub, metrics: Metrics, max_batch: int | None = 1, max_queue: int = DEFAULT_MAX_QUEUE,
                 *, wake: Callable[[], None] | None = None, on_event: Callable[[dict], None] | None = None):
        self.events = events
        self.metrics = metrics
        self.max_batch = None if max_batch is None else max(1, int(max_batch))  # None: from the calibration
        self.max_queue = max(1, int(max_queue))
        self.wake = wake
        self.on_event = on_event
        self.batcher: Any = None  # engine.batching.Batcher when max_batch > 1
        self.running: set[Job] = set()  # batched jobs admitted and not yet answered
        self.engine: Any = None
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.jobs: queue.Queue = queue.Queue()
        self.current: Job | None = None
        self.refusal: str | None = None  # set: why submit answers 503 (shutting down, switched off)
        self.longest = 0  # the longest context a request reached (prompt and answer), in tokens
        self.warm_ahead = True  # compile the shapes past it while idle (off after a failed step)

    def attach(self, engine: Any, batcher: Any = None) -> None:
        """Serve ``engine`` (in the driving thread): batched through ``batcher`` when given (shared
        with the host's own requests), else through a new one when ``max_batch`` > 1."""
        self.engine = engine
        self.batcher = batcher
        if getattr(engine, "calibration_progress", False) is None:  # a request that measures (a seeded
            # one, or any where requests may) is logged: every request waits for it
            engine.calibration_progress = _calibration_log(
                "calibrating this machine for a request's --max-draft auto (once per model)", 5.0)
        if self.max_batch is None:
            from engine.batching import default_max_batch

            self.max_batch = default_max_batch(engine)
            log.info("--max-batch %d (this machine's calibration of the model, else the default)", self.max_batch)
        if batcher is None and self.max_batch > 1:
            from engine.batching import Batcher

            self.batcher = Batcher(engine, self.max_batch)
            if self.batcher.alone_reason:
                log.info("requests run one at a time: %s", self.batcher.alone_reason)
        self.ready.set()

    @property
    def has_work(self) -> bool:
        """Jobs waiting to be admitted or being answered."""
        return bool(self.running) or not self.jobs.empty()

    def refuse(self, message: str | None) -> None:
        """Answer every later ``submit`` with 503 and ``message`` (None: take jobs again); jobs
        already taken go on."""
        self.refusal = message

    def admit_queued(self) -> None:
        """Take every queued job into the batch (never blocks)."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self.metrics.gauge("queued", -1)
                self._admit(job)

    def submit(self, job: Job) -> Job:
        if self.refusal is not None:
            raise RequestError(self.refusal, status=503, kind="api_error")
        if not self.ready.is_set():  # its prompt was rendered for the engine being replaced
            raise _retry_later("the model is being changed; retry shortly", "api_error")
        if self.jobs.qsize() >= self.max_queue:
            self.metrics.add(rejected=1)
            raise _retry_later(f"the server is busy: {self.max_queue} requests are waiting; retry shortly",
                               "overloaded_error")
        self.metrics.gauge("queued", 1)
        self.jobs.put(job)
        if self.wake is not None:
            self.wake()
        return job

    def _admit(self, job: Job) -> None:
        if job.cancel.is_set():
            job.out.put(("cancelled",))
            return
        job.started = time.perf_counter()
        on_round = self._publisher(job)
        self._announce(job)
        self.running.add(job)

        def on_error(e: BaseException) -> None:
            log.error("generation %s failed: %s", job.id, e)
            self._failed(job, f"internal error: {type(e).__name__}: {e}", 500)

        try:
            self.batcher.submit(job.prompt_ids, on_chunk=lambda chunk: self._relay(job, chunk),
                                cancel=job.cancel.is_set, on_error=on_error, on_round=on_round, **job.kwargs)
        except TandemError as e:
            self._failed(job, str(e), 400)
        except Exception as e:  # a bug must not take the engine thread down with it
            log.error("generation %s failed:\n%s", job.id, traceback.format_exc())
            self._failed(job, f"internal error: {type(e).__name__}: {e}", 500)

    @property
    def _observed(self) -> bool:
        return self.on_event is not None or self.events.active

    def _publish(self, event: dict, evict: bool = False) -> None:
        if self.on_event is not None:
            self.on_event(event)
        if self.events.active:
            self.events.publish(event, evict=evict)

    def _publisher(self, job: Job) -> Callable[[Any], None]:
        def on_round(ev: Any) -> None:
            if self._observed:
                self._publish({"type": "round", "id": job.id,  # a round's logprobs are the reply's, not telemetry
                               **{f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "logprobs"}})

        return on_round

    def _announce(self, job: Job) -> None:
        if self._observed:
            self._publish({"type": "request", "id": job.id, "endpoint": job.endpoint,
                           "prompt_tokens": len(job.prompt_ids), "queue_s": round(job.started - job.submitted, 4),
                           **{k: job.kwargs.get(k) for k in ("mode", "max_new_tokens", "temperature")}}, evict=True)

    def _relay(self, job: Job, chunk: Any) -> None:
        """One chunk of a job's stream to its handler: text (with logprobs when asked), or the result."""
        if chunk.result is not None:
            self._delivered(job, chunk.result)
        elif chunk.logprobs:
            job.out.put(("text", chunk.text, chunk.logprobs))
        elif chunk.text:
            job.out.put(("text", chunk.text))

    def _delivered(self, job: Job, result: Any) -> None:
        self.longest = max(self.longest, result.prompt_tokens + len(result.token_ids))
        self.running.discard(job)
        self.metrics.result(result)
        if self._observed:
            self._publish({"type": "result", "id": job.id, **result.to_dict()}, evict=True)
        job.out.put(("result", result))

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():
            job.out.put(("cancelled",))
            return
        job.started = time.perf_counter()
        on_round = self._publisher(job)

        def progress(done: int, total: int) -> None:
            if job.cancel.is_set():  # a long prefill stops between chunks
                raise _Cancelled()

        self._announce(job)
        try:
            for chunk in self.engine.stream(job.prompt_ids, on_round=on_round, cancel=job.cancel.is_set,
                                            prefill_progress=progress, **job.kwargs):
                self._relay(job, chunk)
        except _Cancelled:
            self.metrics.add(cancelled=1)
            self._failed(job, "cancelled during prefill", None)
        except TandemError as e:
            self._failed(job, str(e), 400)
        except Exception as e:  # a bug must not take the engine thread down with it
            log.error("generation %s failed:\n%s", job.id, traceback.format_exc())
            self._failed(job, f"internal error: {type(e).__name__}: {e}", 500)

    def _failed(self, job: Job, message: str, status: int | None) -> None:
        self.running.discard(job)
        if status is not None:
            self.metrics.add(errors=1)
        if self._observed:
            self._publish({"type": "error", "id": job.id, "message": message}, evict=True)
        job.out.put(("error", message, status) if status is not None else ("cancelled",))

    def cancel_all(self, message: str) -> None:
        """Refuse new jobs, answer the queued ones with 503 and cancel those in flight (each ends
        "cancelled" at the engine's next round or prefill chunk)."""
        self.refuse(message)
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.out.put(("error", message, 503))
        current = self.current
        if current is not None:
            current.cancel.set()
        for job in list(self.running):
            job.cancel.set()


class _JobWaiting(Exception):
    """A request arrived while the engine thread measured a calibration between requests."""


def _calibration_log(what: str, every_s: float) -> Callable[[int, int, str], None]:
    """A calibration's progress, logged as ``what: done/total, stage`` at most every ``every_s``
    seconds (and its last step)."""
    last = [float("-inf")]

    def progress(done: int, total: int, stage: str) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s or done >= total:
            last[0] = now
            log.info("%s: %d/%d, %s", what, done, total, stage)
    return progress


class EngineWorker(JobRunner, threading.Thread):
    """``tandem serve``'s engine thread: loads the model (``engine_factory()`` runs here) and runs
    the jobs: batched with ``max_batch`` > 1, else one at a time."""

    def __init__(self, engine_factory: Callable[[], Any], events: EventHub, metrics: Metrics,
                 max_batch: int | None = 1, max_queue: int = DEFAULT_MAX_QUEUE,
                 default_decoding: tuple[str, int | str | None] | None = None):
        JobRunner.__init__(self, events, metrics, max_batch, max_queue)
        threading.Thread.__init__(self, name="tandem-engine", daemon=True)
        self.factory = engine_factory
        # the server's mode and cap: calibrations are measured between requests, this one's first
        # (None: a request that needs one measures it)
        self.default_decoding = default_decoding

    def run(self) -> None:
        try:
            try:
                self.attach(self.factory())
                if self.default_decoding is not None and hasattr(self.engine, "defer_calibration"):
                    self.engine.defer_calibration(*self.default_decoding)  # no request waits for one
            except Exception as e:  # TandemError and anything else: the server reports it, never dies
                self.engine = None
                self.load_error = str(e) if isinstance(e, TandemError) else f"{type(e).__name__}: {e}"
                log.error("model load failed: %s", self.load_error)
            finally:
                self.ready.set()
            if self.batcher is not None:
                self._run_batched()
                return
            ahead = None
            while self.engine is not None:
                ahead = ahead or self._calibration_ahead()
                try:
                    job = self.jobs.get(timeout=IDLE_WARM_S if ahead is not None else None)
                except queue.Empty:
                    ahead = self._warm_step(ahead)  # idle: one step, then look for a job again
                    continue
                if job is None:
                    return
                self.metrics.gauge("queued", -1)
                self.current = job
                try:
                    self._run(job)
                finally:
                    self.current = None
        finally:
            if self.engine is not None and hasattr(self.engine, "save_history"):
                self.engine.save_history()  # the history lookup drafts from, when kept on disk
            # Free the model and this thread's MLX streams before the thread ends. Without
            # clear_streams (MLX 0.32) a thread that ran compiled functions can abort the process at
            # exit: "terminate called without an active exception".
            self.engine = None
            self.batcher = None
            gc.collect()
            import mlx.core as mx

            mx.clear_streams()

    # -- batched ----------------------------------------------------------------------------
    def _run_batched(self) -> None:
        """Admit what arrived (blocking only when nothing runs), then one tick of the batch. While
        nothing runs, the shapes past the warm-up are compiled a step at a time (``_shapes_ahead``)."""
        batcher = self.batcher
        ahead = None
        while True:
            block = not batcher.busy
            while True:
                if block and ahead is None:
                    ahead = self._calibration_ahead() or self._shapes_ahead()
                try:
                    job = self.jobs.get(block=block, timeout=IDLE_WARM_S if block and ahead is not None else None)
                except queue.Empty:
                    if not block:
                        break
                    ahead = self._warm_step(ahead)  # idle: one step, then look for a job again
                    continue
                if job is None:  # stopping: the jobs in flight were cancelled; let them end so
                    batcher.step()
                    return
                self.metrics.gauge("queued", -1)
                self._admit(job)
                block = False
            batcher.step()
            self.metrics.set_gauge("batch_occupancy", batcher.occupancy)

    def _warm_step(self, ahead: Iterator[str]) -> Iterator[str] | None:
        """One step of ``ahead``; None once it is done, or failed (logged: serving goes on, with
        shapes compiled on first use as before, and no idle warm-up again)."""
        try:
            stage = next(ahead, None)
        except Exception as e:  # e.g. out of memory at a long context: never take the engine thread down
            log.warning("idle warm-up stopped: %s: %s", type(e).__name__, e)
            self.warm_ahead = False
            return None
        if stage is not None:
            log.debug("idle warm-up: %s", stage)
        return ahead if stage is not None else None

    def _calibration_ahead(self) -> Iterator[str] | None:
        """The calibrations requests skipped (``Engine.uncalibrated``: theirs drafted at a fixed
        cap), measured while nothing runs, or None when there are none. A request that arrives
        stops the measurement at its next step; it starts again at the next idle moment."""
        engine = self.engine
        return self._calibrations(engine) if getattr(engine, "uncalibrated", None) else None

    def _calibrations(self, engine: Any) -> Iterator[str]:
        while engine.uncalibrated:
            mode = next(iter(engine.uncalibrated))
            log.info("calibrating --max-draft auto for mode %s while idle (once per machine and model)", mode)
            try:
                engine.prepare(mode, "auto", self._idle_progress(mode))
            except _JobWaiting:
                log.info("calibration of mode %s paused for a request: it starts again when the server is idle", mode)
                yield "calibration paused"
                continue
            except Exception as e:  # never take the engine thread down: the mode keeps its fixed cap
                log.warning("calibration of mode %s failed (%s: %s): its requests keep a fixed cap",
                            mode, type(e).__name__, e)
                engine.uncalibrated.pop(mode, None)
                continue
            log.info("calibrated mode %s: its --max-draft auto requests use it from now on", mode)
            yield "calibrated"

    def _idle_progress(self, mode: str) -> Callable[[int, int, str], None]:
        logged = _calibration_log(f"calibrating mode {mode}", 10.0)

        def progress(done: int, total: int, stage: str) -> None:
            if not self.jobs.empty():
                raise _JobWaiting()
            logged(done, total, stage)
        return progress

    def _shapes_ahead(self) -> Iterator[str] | None:
        """Under a shape policy (CUDA), the shapes of the KV capacities from the warm-up's up to one
        step past the longest context a request reached (``engine.warmup.shapes_past``), or None
        when those are compiled. An agent's context grows request by request: its next request
        then meets compiled shapes instead of compiling them in its ticks (an H200 paid 28-106 ms
        rounds against 14-24 ms there)."""
        from engine.warmup import shapes_past

        engine, warmed = self.engine, getattr(self.engine, "warmed", None)
        policy = getattr(getattr(engine, "target", None), "shapes", None)
        if not self.warm_ahead or warmed is None or policy is None or self.longest + policy.step <= warmed.tokens:
            return None
        return shapes_past(engine, self.longest + policy.step)

    def stop(self, timeout: float = 10.0) -> None:
        self.cancel_all("the server is shutting down")
        self.jobs.put(None)
        self.join(timeout)
