"""Models tab: built-in models and the local Hugging Face cache; download, evict, load.

Cache work lives in ``app.hub`` (Qt-free); downloads run in their own QThread (no MLX there)
and report progress through signals; loading goes to the engine worker through the bridge.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from PySide6.QtCore import QThread, Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QHeaderView, QLineEdit, QMessageBox, QProgressBar,
                               QPushButton, QTreeWidget, QTreeWidgetItem, QVBoxLayout, QWidget)

from app import hub
from app.bridge import Bridge
from app.views.common import Card, hbox, plain_label, set_tone, title_label

COLUMNS = ("Model", "Source", "Kind", "Size on disk", "Fits in memory", "Registry pair", "Status")


class DownloadThread(QThread):
    """Runs ``hub.download`` off the GUI thread. Cancel = set the event; the next progress
    update raises inside huggingface_hub and the thread ends with ``failed("download cancelled")``."""

    progress = Signal(str, float, float)  # (bytes|files, done, total)
    succeeded = Signal(str, str)  # (repo id, snapshot path)
    failed = Signal(str, str)  # (repo id, one-line reason)

    def __init__(self, repo_id: str, cache_dir: Optional[str] = None, endpoint: Optional[str] = None):
        super().__init__()
        self.repo_id = repo_id
        self.cache_dir = cache_dir
        self.endpoint = endpoint
        self.cancel_event = threading.Event()

    def run(self) -> None:
        try:
            path = hub.download(self.repo_id, self.progress.emit, self.cancel_event, cache_dir=self.cache_dir,
                                endpoint=self.endpoint)
        except hub.DownloadCancelled:
            self.failed.emit(self.repo_id, "download cancelled; the partial snapshot stays in the cache "
                                           "(download again to resume)")
        except hub.TandemError as err:
            self.failed.emit(self.repo_id, str(err))
        except Exception as err:  # never let a thread die silently
            self.failed.emit(self.repo_id, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        else:
            self.succeeded.emit(self.repo_id, path)


class ModelsView(QWidget):
    def __init__(self, bridge: Bridge, cache_dir: Optional[str] = None, endpoint: Optional[str] = None,
                 parent: Optional[QWidget] = None):
        super().__init__(parent)
        self.bridge = bridge
        self.cache_dir = cache_dir
        self.endpoint = endpoint
        self.entries: list[hub.ModelEntry] = []
        self.download_thread: Optional[DownloadThread] = None
        self.loaded: dict = {}
        self.loading: Optional[str] = None
        # Asked before evicting; tests replace it (a modal dialog would block them).
        self.confirm: Callable[[str, str], bool] = self._ask

        root = QVBoxLayout(self)
        root.setContentsMargins(20, 16, 20, 16)
        root.setSpacing(12)
        self.memory_label = plain_label("", "pageSubtitle", wrap=False)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.setObjectName("secondary")
        self.refresh_button.clicked.connect(self.refresh)
        root.addLayout(hbox((title_label("Models", "Built-in models and your local Hugging Face cache. "
                                                  "Targets generate; drafters speed a target up."), 1),
                            self.memory_label, self.refresh_button))

        table_card = Card()
        self.table = QTreeWidget()
        self.table.setObjectName("modelTable")
        self.table.setColumnCount(len(COLUMNS))
        self.table.setHeaderLabels(COLUMNS)
        self.table.setRootIsDecorated(False)
        self.table.setAlternatingRowColors(True)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.setUniformRowHeights(True)
        header = self.table.header()
        header.setSectionResizeMode(0, QHeaderView.Stretch)
        for i in range(1, len(COLUMNS)):
            header.setSectionResizeMode(i, QHeaderView.ResizeToContents)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.itemDoubleClicked.connect(lambda *_: self.load_selected())
        table_card.body.addWidget(self.table)
        self.detail = plain_label("", "hint")
        self.load_button = QPushButton("Load")
        self.load_button.setObjectName("primary")
        self.load_button.clicked.connect(self.load_selected)
        self.evict_button = QPushButton("Evict from cache…")
        self.evict_button.setObjectName("danger")
        self.evict_button.clicked.connect(lambda: self.evict_selected())
        table_card.body.addLayout(hbox((self.detail, 1), self.evict_button, self.load_button))
        root.addWidget(table_card, 1)

        dl = Card("Download from Hugging Face")
        self.repo_input = QLineEdit()
        self.repo_input.setPlaceholderText("org/name, e.g. mlx-community/Qwen3-0.6B-bf16")
        self.repo_input.returnPressed.connect(self.start_download)
        self.download_button = QPushButton("Download")
        self.download_button.setObjectName("primary")
        self.download_button.clicked.connect(self.start_download)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setObjectName("secondary")
        self.cancel_button.clicked.connect(self.cancel_download)
        self.cancel_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setFormat("")
        self.download_status = plain_label("", "hint")
        dl.body.addLayout(hbox(self.repo_input, self.download_button, self.cancel_button))
        dl.body.addWidget(self.progress)
        dl.body.addWidget(self.download_status)
        root.addWidget(dl)

        bridge.registry_rows.connect(lambda rows: self.refresh())
        bridge.model_loaded.connect(self._on_loaded)
        bridge.model_failed.connect(self._on_load_failed)
        bridge.model_loading.connect(self._on_loading)
        self.refresh()

    # -- listing -------------------------------------------------------------------------------
    def refresh(self) -> None:
        mem = hub.machine_memory()
        self.memory_label.setText(f"this machine: {hub.human_bytes(mem)} memory" if mem else "")
        selected = self.selected_entry()
        try:
            self.entries, warnings = hub.list_models(self.cache_dir, memory=mem, rows=self.bridge.pairs)
        except Exception as err:
            self.entries, warnings = hub.builtin_entries(mem), [f"could not read the HF cache: {err}"]
        self.table.clear()
        for entry in self.entries:
            item = QTreeWidgetItem([entry.display_name or entry.name, entry.source, entry.kind, entry.size_str,
                                    {True: "yes", False: "no", None: "?"}[entry.fits], entry.pair or "–",
                                    self._status(entry)])
            item.setData(0, Qt.UserRole, entry.name)
            item.setToolTip(0, f"{entry.name}\n{entry.description}")
            if self._is_loaded(entry):
                font = item.font(0)
                font.setBold(True)
                for c in range(len(COLUMNS)):
                    item.setFont(c, font)
            if entry.fits is False:
                item.setForeground(4, Qt.red)
            self.table.addTopLevelItem(item)
            if selected is not None and entry.name == selected.name:
                item.setSelected(True)
        hint = f"{len(self.entries)} models"
        if warnings:
            hint += f" · {len(warnings)} cache warning(s): {warnings[0][:120]}"
        self.detail.setText(hint)
        self._update_buttons()

    def _status(self, entry: hub.ModelEntry) -> str:
        if self._is_loaded(entry):
            return "loaded"
        if self.loading and self.loading == entry.name:
            return "loading…"
        if entry.source == "built-in" and not entry.installed:
            return "not installed"
        if not entry.complete:
            return "incomplete"
        return "ready"

    def _is_loaded(self, entry: hub.ModelEntry) -> bool:
        info = self.loaded
        if not info:
            return False
        names = {info.get("spec"), info.get("name")} - {None}
        if entry.name in names or (entry.source == "built-in" and entry.display_name in names):
            return True
        if entry.source == "built-in" and info.get("spec") is None and info.get("source", "").startswith("builtin:"):
            return entry.name == info["source"].split(":", 1)[1]  # None loads the starter model
        path = info.get("path") or ""
        return bool(entry.repo_path and path.startswith(entry.repo_path))

    def loaded_names(self) -> list[str]:
        info = self.loaded
        return [x for x in (info.get("spec"), info.get("name"), info.get("path"), info.get("drafter")) if x]

    def selected_entry(self) -> Optional[hub.ModelEntry]:
        items = self.table.selectedItems() if hasattr(self, "table") else []
        if not items:
            return None
        name = items[0].data(0, Qt.UserRole)
        return next((e for e in self.entries if e.name == name), None)

    def select(self, name: str) -> bool:
        for i in range(self.table.topLevelItemCount()):
            item = self.table.topLevelItem(i)
            if item.data(0, Qt.UserRole) == name:
                self.table.setCurrentItem(item)
                item.setSelected(True)
                return True
        return False

    def _update_buttons(self) -> None:
        e = self.selected_entry()
        self.load_button.setEnabled(e is not None and e.kind != "other" and e.installed and e.complete
                                    and self.loading is None)
        self.evict_button.setEnabled(e is not None and e.source == "hf-cache")
        if e is not None:
            self.detail.setText(f"{e.name}: {e.description}")

    # -- load / evict --------------------------------------------------------------------------
    def load_selected(self) -> None:
        e = self.selected_entry()
        if e is None:
            return
        if e.kind == "drafter":
            target = e.pair
            if not target:
                self._say(f"{e.name} is a drafter; load its target model and pick this drafter with it", "warn")
                return
            self.bridge.load(target, e.name)
            return
        drafter = e.pair if e.pair and any(x.name == e.pair for x in self.entries) else None
        self.bridge.load(e.name, drafter)

    def evict_selected(self) -> bool:
        e = self.selected_entry()
        if e is None or e.source != "hf-cache":
            return False
        if self._is_loaded(e):
            self._say(f"'{e.name}' is loaded right now; load another model before evicting it", "bad")
            return False
        try:
            size = hub.eviction_size(e.name, self.cache_dir)
        except hub.TandemError as err:
            self._say(str(err), "bad")
            return False
        if not self.confirm("Evict model", f"Delete every revision of {e.name} from the Hugging Face cache?\n"
                                           f"This frees {size}."):
            return False
        try:
            freed = hub.evict(e.name, self.cache_dir, loaded=self.loaded_names())
        except hub.TandemError as err:
            self._say(str(err), "bad")
            return False
        self.refresh()
        self._say(f"evicted {e.name}, freed {hub.human_bytes(freed)}", "good")
        return True

    def _ask(self, title: str, text: str) -> bool:
        return QMessageBox.question(self, title, text, QMessageBox.Yes | QMessageBox.Cancel,
                                    QMessageBox.Cancel) == QMessageBox.Yes

    def _say(self, text: str, tone: str = "") -> None:
        self.detail.setText(text)
        set_tone(self.detail, tone)

    def _on_loading(self, what: str) -> None:
        self.loading = what
        self._update_buttons()

    def _on_loaded(self, info: dict) -> None:
        self.loaded = dict(info)
        self.loading = None
        self.refresh()
        self._say(f"loaded {info.get('name')}" + (f" with drafter {info['drafter']}" if info.get("drafter") else ""),
                  "good")

    def _on_load_failed(self, message: str) -> None:
        self.loading = None
        self.refresh()
        self._say(message, "bad")

    # -- downloads -------------------------------------------------------------------------------
    @property
    def downloading(self) -> bool:
        return self.download_thread is not None and self.download_thread.isRunning()

    def start_download(self, repo_id: Optional[str] = None) -> Optional[DownloadThread]:
        repo_id = (repo_id or self.repo_input.text()).strip()
        if not repo_id or self.downloading:
            return None
        t = DownloadThread(repo_id, self.cache_dir, self.endpoint)
        t.progress.connect(self._on_progress)
        t.succeeded.connect(self._on_download_done)
        t.failed.connect(self._on_download_failed)
        t.finished.connect(self._on_download_thread_finished)
        self.download_thread = t
        self.progress.setRange(0, 0)  # busy until the first byte count arrives
        self.progress.setFormat("")
        self.download_status.setText(f"connecting for {repo_id}…")
        set_tone(self.download_status, "")
        self.download_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        t.start()
        return t

    def cancel_download(self) -> None:
        if self.download_thread is not None:
            self.download_thread.cancel_event.set()
            self.download_status.setText("cancelling…")

    def _on_progress(self, unit: str, done: float, total: float) -> None:
        if unit == "bytes" and total > 0:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * min(done / total, 1.0)))
            self.progress.setFormat(f"{hub.human_bytes(done)} of {hub.human_bytes(total)}")
        elif unit == "files" and total > 0:
            self.download_status.setText(f"{int(done)} of {int(total)} files")

    def _on_download_done(self, repo_id: str, path: str) -> None:
        self.progress.setRange(0, 1000)
        self.progress.setValue(1000)
        self.progress.setFormat("done")
        self.download_status.setText(f"{repo_id} is in the cache")
        set_tone(self.download_status, "good")
        self.refresh()
        self.select(repo_id)

    def _on_download_failed(self, repo_id: str, message: str) -> None:
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setFormat("")
        self.download_status.setText(message)
        set_tone(self.download_status, "bad")
        self.refresh()

    def _on_download_thread_finished(self) -> None:
        self.download_button.setEnabled(True)
        self.cancel_button.setEnabled(False)

    def shutdown(self, timeout_ms: int = 10_000) -> None:
        t = self.download_thread
        if t is not None and t.isRunning():
            t.cancel_event.set()
            t.wait(timeout_ms)
