"""app.background.Job: the result reaches the GUI thread, and the Job object dies there, whichever
side lets go of it last (Qt must not destroy a GUI-thread object from another thread while events
for it wait; the full suite once crashed in the Models view's eviction, under load)."""

from __future__ import annotations

import threading
import weakref

import pytest

pytest.importorskip("PySide6")

from app.background import Job  # noqa: E402


class LingeringJob(Job):
    """A job whose thread lingers after reporting until ``release`` is set, as on a busy machine."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = threading.Event()

    def _run(self) -> None:
        super()._run()
        self.release.wait(5)


def test_a_job_dropped_as_its_result_arrives_dies_on_the_gui_thread(qtbot):
    held, results, died_on = {}, [], []
    job = LingeringJob(lambda: 42, name="tandem-test-job")
    weakref.finalize(job, lambda: died_on.append(threading.current_thread().name))
    release = job.release

    def on_result(value):
        results.append(value)
        held.clear()  # the view replaces its job as the result arrives (a new search, the eviction itself)
        release.set()  # ... and only then does the job's thread end

    job.succeeded.connect(on_result)
    held["job"] = job.start()
    del job
    qtbot.waitUntil(lambda: bool(died_on), timeout=5000)
    assert results == [42]
    assert died_on == [threading.main_thread().name]


@pytest.mark.parametrize("control", [False, True])
def test_a_failing_job_reports_one_line_and_is_released(qtbot, control):
    died_on = []

    def broken(**_):
        raise ValueError("no such repo\nsecond line")

    job = Job(broken, name="tandem-test-job", control=control)
    weakref.finalize(job, lambda: died_on.append(threading.current_thread().name))
    with qtbot.waitSignal(job.failed, timeout=5000) as failed:
        job.start()
    qtbot.waitUntil(lambda: not job.running, timeout=5000)
    assert failed.args == ["ValueError: no such repo"] and not job.thread.is_alive()
    assert isinstance(job.error, ValueError)
    del job, failed
    qtbot.waitUntil(lambda: bool(died_on), timeout=5000)
    assert died_on == [threading.main_thread().name]
