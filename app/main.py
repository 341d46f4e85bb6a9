"""The main window: four tabs over one engine worker thread, and a status bar.

    python -m app            # or: tandem app
    python -m app --model mlx-community/Qwen3-0.6B-bf16
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import engine  # noqa: F401  (preloads OpenBLAS before anything imports mlx.core)
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QFont, QGuiApplication
from PySide6.QtWidgets import QApplication, QLabel, QMainWindow, QProgressBar, QTabWidget

from app.bridge import Bridge, EngineHost
from app.hub import human_bytes
from app.views.chat import ChatView
from app.views.models import ModelsView
from app.views.race import RaceView
from app.views.telemetry import TelemetryView

APP_NAME = "Tandem"
STYLE = Path(__file__).with_name("style.qss")
ICONS = Path(__file__).with_name("icons")


def make_application(argv: Optional[Sequence[str]] = None) -> QApplication:
    app = QApplication.instance()
    if app is None:
        QGuiApplication.setHighDpiScaleFactorRoundingPolicy(Qt.HighDpiScaleFactorRoundingPolicy.PassThrough)
        app = QApplication(list(argv) if argv is not None else [sys.argv[0]])
    app.setApplicationName(APP_NAME)
    app.setOrganizationName("Tandem")
    app.setStyle("Fusion")
    font = QFont(app.font())
    font.setPointSizeF(max(font.pointSizeF(), 10.0))
    app.setFont(font)
    if STYLE.exists():
        # url() in a stylesheet resolves against the working directory: make icon paths absolute.
        app.setStyleSheet(STYLE.read_text().replace("@ICONS@", ICONS.as_posix()))
    return app


class MainWindow(QMainWindow):
    """``engine_factory(spec, drafter) -> Engine`` replaces ``engine.api.load`` (tests pass a tiny
    random engine); it runs in the worker thread. Call ``shutdown()`` before the window dies."""

    def __init__(self, *, model: Optional[str] = None, drafter: Optional[str] = None, engine_factory=None,
                 cache_dir: Optional[str] = None, endpoint: Optional[str] = None, autoload: bool = True):
        super().__init__()
        self.setWindowTitle(APP_NAME)
        self.resize(1280, 820)
        self.bridge = Bridge(self)
        self.host = EngineHost(self.bridge, engine_factory)
        self._closed = False

        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.chat = ChatView(self.bridge)
        self.models = ModelsView(self.bridge, cache_dir=cache_dir, endpoint=endpoint)
        self.race = RaceView(self.bridge)
        self.telemetry = TelemetryView(self.bridge)
        self.tabs.addTab(self.chat, "Chat")
        self.tabs.addTab(self.models, "Models")
        self.tabs.addTab(self.race, "Race")
        self.tabs.addTab(self.telemetry, "Telemetry")
        self.setCentralWidget(self.tabs)

        bar = self.statusBar()
        self.model_status = QLabel("no model")
        self.model_status.setObjectName("statusModel")
        self.device_status = QLabel("starting engine…")
        self.device_status.setObjectName("statusDevice")
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)
        self.busy.setFixedSize(90, 10)
        self.busy.setTextVisible(False)
        self.busy.hide()
        bar.addWidget(self.model_status, 1)
        bar.addPermanentWidget(self.busy)
        bar.addPermanentWidget(self.device_status)

        b = self.bridge
        b.device_info.connect(self._on_device)
        b.model_loading.connect(lambda what: self.model_status.setText(f"loading {what}…"))
        b.model_loaded.connect(self._on_model)
        b.model_failed.connect(self._on_model_failed)
        b.busy_changed.connect(self.busy.setVisible)

        self.host.start()
        if autoload:
            b.load(model, drafter)

    # -- status bar ------------------------------------------------------------------------------
    def _on_device(self, info: dict) -> None:
        mem = info.get("memory_bytes") or 0
        self.device_status.setText(f"{info.get('backend', '?')} · {info.get('device', '?')} · {human_bytes(mem)}")

    def _on_model(self, info: dict) -> None:
        bits = [info.get("name", "?"), info.get("dtype", "?"), f"{info.get('params', 0) / 1e6:.0f}M params",
                f"{info.get('weight_bytes', 0) / 1e6:.0f} MB"]
        if info.get("drafter"):
            bits.append(f"drafter {info['drafter']}")
        self.model_status.setText("  ·  ".join(bits))

    def _on_model_failed(self, message: str) -> None:
        self.model_status.setText(message if not self.bridge.model_info else
                                  f"{message}  (still using {self.bridge.model_info.get('name')})")

    # -- lifecycle -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop timers and background work, cancel the worker's job and give it a few seconds
        (a generation stops within a round or a prefill chunk); idempotent, never blocks longer."""
        if self._closed:
            return
        self._closed = True
        self.telemetry.shutdown()
        self.race.shutdown()
        self.models.shutdown()
        self.host.stop()

    def closeEvent(self, event) -> None:
        self.hide()  # the window goes at once; the worker winds down behind it
        self.shutdown()
        super().closeEvent(event)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app", description="Tandem desktop app")
    add_arguments(p)
    return p.parse_args(argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model to load at start (default: the starter model)")
    p.add_argument("--drafter", default=None, help="DSpark/DFlash drafter to load with it")
    p.add_argument("--quit-after", type=float, default=None, metavar="SECONDS",
                   help="close the window after this many seconds (smoke tests)")


def run_app(model: Optional[str] = None, drafter: Optional[str] = None, quit_after: Optional[float] = None) -> int:
    app = make_application()
    win = MainWindow(model=model, drafter=drafter)
    win.show()
    if quit_after is not None:
        QTimer.singleShot(int(quit_after * 1000), win.close)
    try:
        rc = int(app.exec())
    finally:
        win.shutdown()
    if win.host.thread.isRunning():
        # A job that cannot be interrupted (a model load) outlived the window: end the process
        # now, without the destructors that would abort on a running QThread.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return run_app(args.model, args.drafter, args.quit_after)
