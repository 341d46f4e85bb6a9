"""The one bridge between the views and the engine worker: Qt signals, plus two thread-safe
side channels that must not wait for the worker's event loop (cancel flags and the telemetry
buffer). Views only ever talk to a ``Bridge``; only ``app.worker`` touches MLX.

Requests (GUI -> worker) are queued signals, so they run in the worker thread in order.
Replies (worker -> GUI) are signals emitted from the worker thread, delivered queued to the GUI.
Payloads are plain dicts/lists (``object``), never MLX arrays.
"""

from __future__ import annotations

import itertools
import threading

from PySide6.QtCore import Qt, QObject, QThread, Signal

from app.telemetry_model import TelemetryBuffer


class Bridge(QObject):
    # -- requests: GUI -> worker ---------------------------------------------------------------
    load_requested = Signal(object, object)  # (model spec or None for the starter, drafter or None)
    generate_requested = Signal(int, object, object)  # (request id, prompt: str | messages, params dict)
    race_requested = Signal(int, object, object, object)  # (request id, prompt, modes list, params dict)
    calibrate_requested = Signal(int, object)  # (request id, calibrate() keyword overrides or None)
    clear_cache_requested = Signal()  # forget cached prompt prefixes (a new or deleted chat)
    serve_requested = Signal(object)  # local server on ({"port": int, "api_key": str | None}) or off (None)

    # -- replies: worker -> GUI ----------------------------------------------------------------
    device_info = Signal(object)  # {"backend", "device", "memory_bytes", "blas"}
    registry_rows = Signal(object)  # engine.registry rows (target -> drafter pairs), sent once
    model_loading = Signal(str)  # what is being loaded
    model_loaded = Signal(object)  # model info dict (name, path, weight_bytes, ...)
    model_failed = Signal(str)  # one-line reason; the previous model (if any) stays loaded
    busy_changed = Signal(bool)  # the worker started / finished a job

    gen_started = Signal(int, object)  # (id, {"mode": resolved mode, "prompt_tokens": n})
    gen_calibrating = Signal(int, int, int, str)  # (id, done, total, what): a first auto message measures the machine
    gen_text = Signal(int, str)  # (id, new text)
    gen_finished = Signal(int, object)  # (id, result dict)
    gen_failed = Signal(int, str)  # (id, one-line error)

    race_lane_started = Signal(int, int, str)  # (id, lane, mode)
    race_lane_text = Signal(int, int, str)  # (id, lane, new text)
    race_lane_finished = Signal(int, int, object)  # (id, lane, lane dict)
    race_finished = Signal(int, object)  # (id, {"lanes": [...], "verdicts": [...]})

    calib_progress = Signal(int, int, int, str)  # (id, done, total, what)
    calib_finished = Signal(int, object)  # (id, curves dict)
    calib_failed = Signal(int, str)

    serving_changed = Signal(object)  # {"on", "url", "port", "api_key", "in_flight"[, "error"]}

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._ids = itertools.count(1)
        self._issued = 0
        self._cancelled_through = 0  # every request id <= this is cancelled
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self.telemetry = TelemetryBuffer()
        self.model_info: dict = {}
        self.pairs: list[dict] | None = None  # registry rows, once the worker has read them
        # (spec, drafter) of each load asked for and not yet answered, oldest first: the worker
        # answers each with exactly one model_loaded or model_failed, in order
        self.pending_loads: list[tuple] = []
        self.serving: dict = {"on": False}  # the local server's last state (app.serving)
        self.serving_changed.connect(self._remember_serving)
        self.model_loaded.connect(self._remember_model)
        self.model_failed.connect(self._load_answered)
        self.registry_rows.connect(self._remember_rows)

    def _remember_model(self, info: dict) -> None:
        self.model_info = dict(info)
        self._load_answered()

    def _load_answered(self, *_) -> None:
        if self.pending_loads:
            self.pending_loads.pop(0)

    def _remember_rows(self, rows: list) -> None:
        self.pairs = list(rows)

    def _remember_serving(self, state: dict) -> None:
        self.serving = dict(state)

    # -- request ids and cancellation (read by the worker between rounds) ----------------------
    def next_id(self) -> int:
        with self._lock:
            self._issued = next(self._ids)
            return self._issued

    def cancel(self, request_id: int | None = None) -> None:
        """Cancel one request, or (None) everything issued so far, queued ones included."""
        with self._lock:
            if request_id is None:
                self._cancelled_through = self._issued
            else:
                self._cancelled.add(request_id)

    def is_cancelled(self, request_id: int) -> bool:
        return request_id <= self._cancelled_through or request_id in self._cancelled

    # -- convenience senders used by the views ---------------------------------------------------
    def load(self, spec: str | None, drafter: str | None = None) -> None:
        self.pending_loads.append((spec, drafter))
        self.load_requested.emit(spec, drafter)

    def generate(self, prompt, params: dict) -> int:
        rid = self.next_id()
        self.generate_requested.emit(rid, prompt, dict(params))
        return rid

    def race(self, prompt, modes: list[str], params: dict) -> int:
        rid = self.next_id()
        self.race_requested.emit(rid, prompt, list(modes), dict(params))
        return rid

    def clear_prefix_cache(self) -> None:
        self.clear_cache_requested.emit()

    def calibrate(self, params: dict | None = None) -> int:
        rid = self.next_id()
        self.calibrate_requested.emit(rid, params)
        return rid

    def serve(self, port: int | None, api_key: str | None = None) -> None:
        """Switch the local server on at ``port`` (0: any free port) or off (None)."""
        self.serve_requested.emit(None if port is None else {"port": int(port), "api_key": api_key or None})


STOP_WAIT_MS = 3000  # how long closing waits for the worker to wind down
_OUTLIVED: list["EngineHost"] = []  # hosts whose worker was still busy when their window closed


class EngineHost(QObject):
    """Owns the one worker QThread. ``stop()`` must run before the widgets die (else Qt aborts
    with "QThread: Destroyed while thread is still running")."""

    def __init__(self, bridge: Bridge, engine_factory=None, parent: QObject | None = None):
        super().__init__(parent)
        from app.worker import EngineWorker  # imports no MLX at module level; MLX loads in the thread

        self.bridge = bridge
        self.thread = QThread()
        self.thread.setObjectName("tandem-engine")
        self.worker = EngineWorker(bridge, engine_factory)
        self.worker.moveToThread(self.thread)
        bridge.load_requested.connect(self.worker.load)
        bridge.generate_requested.connect(self.worker.generate)
        bridge.race_requested.connect(self.worker.race)
        bridge.calibrate_requested.connect(self.worker.calibrate)
        bridge.clear_cache_requested.connect(self.worker.clear_prefix_cache)
        bridge.serve_requested.connect(self.worker.serve)
        # Runs in the worker thread just before it ends (MLX streams are thread-bound).
        self.thread.finished.connect(self.worker.release, Qt.ConnectionType.DirectConnection)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_ms: int = STOP_WAIT_MS) -> bool:
        """Cancel everything and join the thread, waiting at most ``timeout_ms``: a cancelled job
        ends within one decode round, prefill chunk or calibration step. One that cannot be
        interrupted (a model load, a GGUF conversion) may take longer; then this host (thread,
        worker, bridge, signals muted) is kept alive until the process ends rather than let Qt
        destroy a running QThread, which aborts the process. Returns whether the thread ended."""
        if not self.thread.isRunning():
            return True
        self.bridge.cancel()
        self.thread.quit()
        if self.thread.wait(timeout_ms):
            return True
        self.bridge.blockSignals(True)  # its views are going away
        self.bridge.setParent(None)  # outlives its window: the worker still reads it
        _OUTLIVED.append(self)
        return False
