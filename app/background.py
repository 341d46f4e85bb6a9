"""Blocking work that is not MLX (network, disk scans, downloads) off the GUI thread.

Each ``Job`` runs one call on a daemon Python thread and reports back through Qt signals, which
Qt queues to the GUI thread. Daemon threads, not QThreads: a QThread still running when its
object dies aborts the process, and a network call cannot be interrupted, so closing the app
would have to wait for it; a daemon thread is simply abandoned at exit. MLX work never goes
here: it belongs to the one engine thread (app.worker).

A Job is a QObject of the GUI thread, and Qt must not destroy one from another thread while
events for it wait. A view that drops its job as the result arrives (a new search, an eviction
after its size) left the thread's own reference last, so the object could die on that thread;
a failed job's traceback and a controlled job's progress callback made cycles that any
thread's garbage collector could free. Started jobs stay in ``_LIVE`` until ``finished`` reaches
the GUI thread and the thread has ended, and then let go of those references there.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from PySide6.QtCore import QObject, Signal

from engine.errors import TandemError

_LIVE: set["Job"] = set()  # started jobs whose ``finished`` the GUI thread has not handled yet


def one_line(err: BaseException) -> str:
    """A user-facing sentence for an error: a TandemError's own text, else its type and first line."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if isinstance(err, TandemError):
        return text or type(err).__name__
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


class Job(QObject):
    """``fn(*args, **kwargs)`` on a daemon thread; with ``control=True`` it also gets
    ``cancel=`` (a threading.Event that ``cancel()`` sets) and ``progress=`` (a callback whose
    value the ``progress`` signal carries).

    ``succeeded(result)`` or ``failed(one-line reason)`` follows, then ``finished``; a cancelled
    job still reports (``fn`` decides whether cancelling is an error).
    """

    succeeded = Signal(object)
    failed = Signal(str)
    progress = Signal(object)
    finished = Signal()

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str = "tandem-job", control: bool = False,
                 **kwargs: Any):
        super().__init__()
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.cancel_event = threading.Event()
        if control:
            self.kwargs.update(cancel=self.cancel_event, progress=lambda value: self._emit(self.progress, value))
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: Optional[BaseException] = None
        self._reported = False
        self.finished.connect(self._on_finished)  # queued: runs once the result has been delivered

    def start(self) -> "Job":
        _LIVE.add(self)
        self.thread.start()
        return self

    def cancel(self) -> None:
        self.cancel_event.set()

    @property
    def running(self) -> bool:
        """Started and its result not yet delivered to the GUI thread."""
        return self.thread.ident is not None and not self._reported

    def _on_finished(self) -> None:
        self._reported = True
        self.thread.join()  # emitting finished was its last act: it is ending, and then holds no reference
        self.fn, self.args, self.kwargs = None, (), {}  # the progress callback refers back to this job
        _LIVE.discard(self)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Join the thread (tests, shutdown); True when it ended."""
        if self.thread.ident is not None:
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def _emit(self, signal, *args) -> None:
        try:
            signal.emit(*args)
        except RuntimeError:  # the window (and this object) went away while the thread ran
            pass

    def _run(self) -> None:
        try:
            result = self.fn(*self.args, **self.kwargs)
        except Exception as err:  # never let a thread die silently
            self.error = err.with_traceback(None)  # its frames hold this job: no cycle for a thread's gc to free
            self._emit(self.failed, one_line(err))
        else:
            self._emit(self.succeeded, result)
        self._emit(self.finished)
