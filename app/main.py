"""The main window: four tabs over one engine worker thread, and a status bar.

    python -m app            # or: tandem app
    python -m app --model mlx-community/Qwen3-0.6B-bf16
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import engine  # noqa: F401  (preloads OpenBLAS before anything imports mlx.core)
from PySide6.QtCore import QCoreApplication, QEvent, Qt, QTimer
from PySide6.QtGui import QAction, QActionGroup, QGuiApplication, QKeySequence
from PySide6.QtWidgets import QApplication, QLabel, QMainWindow, QProgressBar, QTabWidget

from app import theme
from app.bridge import Bridge, EngineHost
from app.hub import human_bytes
from app.settings import APPLICATION, ORGANISATION, AppSettings
from app.views.chat import ChatView
from app.views.models import ModelsView
from app.views.race import RaceView
from app.views.telemetry import TelemetryView

APP_NAME = APPLICATION
FONT_STEP = 1.0


def make_application(argv: Optional[Sequence[str]] = None) -> QApplication:
    app = QApplication.instance()
    if app is None:
        QGuiApplication.setHighDpiScaleFactorRoundingPolicy(Qt.HighDpiScaleFactorRoundingPolicy.PassThrough)
        app = QApplication(list(argv) if argv is not None else [sys.argv[0]])
    app.setApplicationName(APP_NAME)
    app.setOrganizationName(ORGANISATION)
    app.setStyle("Fusion")
    return app


class MainWindow(QMainWindow):
    """``engine_factory(spec, drafter) -> Engine`` replaces ``engine.api.load`` (tests pass a tiny
    random engine); it runs in the worker thread. Call ``shutdown()`` before the window dies."""

    def __init__(self, *, model: Optional[str] = None, drafter: Optional[str] = None, engine_factory=None,
                 cache_dir: Optional[str] = None, endpoint: Optional[str] = None, autoload: bool = True,
                 settings: Optional[AppSettings] = None):
        super().__init__()
        self.setWindowTitle(APP_NAME)
        self.resize(1280, 820)
        self.settings = settings or AppSettings()
        self.apply_theme()
        self.bridge = Bridge(self)
        self.host = EngineHost(self.bridge, engine_factory)
        self._closed = False

        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.chat = ChatView(self.bridge, self.settings)
        self.models = ModelsView(self.bridge, cache_dir=cache_dir, endpoint=endpoint, settings=self.settings)
        self.chat.header.entries = lambda: self.models.entries  # the chat's model picker lists what the
        self.chat.header.load_entry = self.models.load_entry  # Models tab lists, and loads the same way
        self.models.listed.connect(self.chat.header.refresh_models)
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
        self.serve_status = QLabel("")
        self.serve_status.setObjectName("statusServe")
        bar.addWidget(self.model_status, 1)
        bar.addPermanentWidget(self.serve_status)
        bar.addPermanentWidget(self.busy)
        bar.addPermanentWidget(self.device_status)

        b = self.bridge
        b.device_info.connect(self._on_device)
        b.model_loading.connect(lambda what: self.model_status.setText(f"loading {what}…"))
        b.model_loaded.connect(self._on_model)
        b.model_failed.connect(self._on_model_failed)
        b.busy_changed.connect(self.busy.setVisible)
        b.serving_changed.connect(self._on_serving)
        self._build_menus()
        hints = QGuiApplication.styleHints()
        if hasattr(hints, "colorSchemeChanged"):  # follow the OS while the theme is "system"
            hints.colorSchemeChanged.connect(self._on_os_scheme)

        geometry = self.settings.window_geometry
        if geometry is not None:
            self.restoreGeometry(geometry)

        self.host.start()
        if autoload:
            b.load(model, drafter)

    # -- menus and appearance ----------------------------------------------------------------------
    def _build_menus(self) -> None:
        chat = self.chat

        def action(menu, text: str, slot, keys=None) -> QAction:
            act = QAction(text, self)
            if keys is not None:
                act.setShortcuts(keys if isinstance(keys, list) else [QKeySequence(keys)])
            act.triggered.connect(slot)
            menu.addAction(act)
            return act

        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        self.new_chat_action = action(file_menu, "New chat", self._new_chat, QKeySequence.StandardKey.New)
        file_menu.addSeparator()
        action(file_menu, "Export chat as Markdown…", lambda: chat.export_conversation(fmt="markdown"), "Ctrl+E")
        action(file_menu, "Export chat as JSON…", lambda: chat.export_conversation(fmt="json"), "Ctrl+Shift+E")
        file_menu.addSeparator()
        switch = self.models.serve_panel.switch
        self.serve_action = QAction("Serve the model on this machine", self, checkable=True)
        self.serve_action.setChecked(switch.isChecked())
        self.serve_action.toggled.connect(switch.setChecked)  # the Models tab's switch does the work
        switch.toggled.connect(self.serve_action.setChecked)
        file_menu.addAction(self.serve_action)
        file_menu.addSeparator()
        action(file_menu, "Quit", self.close, QKeySequence.StandardKey.Quit)

        chat_menu = bar.addMenu("&Chat")
        self.send_action = action(chat_menu, "Send", self._send, "Ctrl+Return")
        self.stop_action = action(chat_menu, "Stop", chat.stop, "Ctrl+.")
        self.regenerate_action = action(chat_menu, "Regenerate last answer", self._regenerate, "Ctrl+R")
        chat_menu.addSeparator()
        self.focus_action = action(chat_menu, "Focus the prompt", self._focus_prompt, "Ctrl+L")
        action(chat_menu, "Show parameters", lambda: chat.show_parameters(chat.panel.isHidden()), "Ctrl+Shift+P")
        action(chat_menu, "Show chat list", lambda: chat.sidebar.setVisible(chat.sidebar.isHidden()),
               "Ctrl+Shift+L")

        view_menu = bar.addMenu("&View")
        theme_menu = view_menu.addMenu("Theme")
        group = QActionGroup(self)
        self.theme_actions: dict[str, QAction] = {}
        for name, label in (("system", "Follow the system"), ("light", "Light"), ("dark", "Dark")):
            act = QAction(label, self, checkable=True)
            act.setChecked(self.settings.theme == name)
            act.triggered.connect(lambda checked=False, n=name: self.set_theme(n))
            group.addAction(act)
            theme_menu.addAction(act)
            self.theme_actions[name] = act
        view_menu.addSeparator()
        action(view_menu, "Larger text", lambda: self.set_font_size(self._font_pt() + FONT_STEP),
               [QKeySequence(QKeySequence.StandardKey.ZoomIn), QKeySequence("Ctrl+=")])
        action(view_menu, "Smaller text", lambda: self.set_font_size(self._font_pt() - FONT_STEP),
               QKeySequence.StandardKey.ZoomOut)
        action(view_menu, "Default text size", lambda: self.set_font_size(0), "Ctrl+0")

    def _new_chat(self) -> None:
        self.tabs.setCurrentWidget(self.chat)
        self.chat.new_chat()

    def _send(self) -> None:
        self.tabs.setCurrentWidget(self.chat)
        self.chat.send()

    def _regenerate(self) -> None:
        self.tabs.setCurrentWidget(self.chat)
        self.chat.regenerate()

    def _focus_prompt(self) -> None:
        self.tabs.setCurrentWidget(self.chat)
        self.chat.focus_prompt()

    def _font_pt(self) -> float:
        return self.settings.font_size or theme.default_font_pt()

    def apply_theme(self) -> str:
        """The chosen theme and text size; rendered messages follow by themselves (theme.notifier)."""
        return theme.apply(QApplication.instance(), self.settings.theme, self.settings.font_size)

    def _on_os_scheme(self, *_) -> None:
        if self.settings.theme == "system":
            self.apply_theme()

    def set_theme(self, choice: str) -> None:
        self.settings.theme = choice
        if choice in getattr(self, "theme_actions", {}):
            self.theme_actions[choice].setChecked(True)
        self.apply_theme()

    def set_font_size(self, points: float) -> None:
        """Points; 0 = the platform's default."""
        self.settings.font_size = 0 if not points else min(max(points, theme.MIN_FONT_PT), theme.MAX_FONT_PT)
        self.apply_theme()

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

    def _on_serving(self, state: dict) -> None:
        self.serve_status.setText(f"serving at {state['url']}" if state.get("on") else "")

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
        # the stopped answer's reply is queued for the chat: deliver it so it is saved
        QCoreApplication.sendPostedEvents(self.chat, QEvent.Type.MetaCall)
        self.chat.shutdown()
        self.settings.window_geometry = self.saveGeometry()
        self.settings.sync()

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
